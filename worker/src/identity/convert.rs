//! SVIDs and bundles as the `spiffe` crate parses them, converted into the model's
//! types: PEM text for the proxy's SDS secrets, the leaf's serial number and validity.
//! Pure; the key is copied from memory into memory, never onto a disk.

use aether_model::Svid;
use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("the SVID of {spiffe_id} has a leaf certificate that does not parse: {reason}")]
    Leaf { spiffe_id: String, reason: String },
    #[error("the validity of the SVID of {spiffe_id} is before 1970")]
    Validity { spiffe_id: String },
}

/// `svid` as the model holds it: the chain (leaf first) and the PKCS#8 key as PEM, the
/// leaf's serial in lowercase hex as Envoy's admin `/certs` prints it, and its validity.
pub fn svid(svid: &spiffe::X509Svid) -> Result<Svid, ConvertError> {
    let spiffe_id = svid.spiffe_id().to_string();
    let (_, leaf) =
        X509Certificate::from_der(svid.leaf().as_bytes()).map_err(|e| ConvertError::Leaf {
            spiffe_id: spiffe_id.clone(),
            reason: e.to_string(),
        })?;
    let validity = leaf.validity();
    let secs = |t: i64| {
        u64::try_from(t).map_err(|_| ConvertError::Validity {
            spiffe_id: spiffe_id.clone(),
        })
    };
    Ok(Svid {
        chain_pem: svid
            .cert_chain()
            .iter()
            .map(|c| pem("CERTIFICATE", c.as_bytes()))
            .collect(),
        key_pem: pem("PRIVATE KEY", svid.private_key().as_bytes()),
        serial: serial_hex(leaf.raw_serial()),
        not_before: secs(validity.not_before.timestamp())?,
        not_after: secs(validity.not_after.timestamp())?,
        spiffe_id,
    })
}

/// The bundle's CA certificates, PEM, in the order the provider sent them.
pub fn bundle_pem(bundle: &spiffe::X509Bundle) -> String {
    bundle
        .authorities()
        .iter()
        .map(|c| pem("CERTIFICATE", c.as_bytes()))
        .collect()
}

fn pem(tag: &str, der: &[u8]) -> String {
    let config = ::pem::EncodeConfig::new().set_line_ending(::pem::LineEnding::LF);
    ::pem::encode_config(&::pem::Pem::new(tag, der), config)
}

/// A DER INTEGER's content as BoringSSL's `BN_bn2hex` prints it, lowercased (Envoy's
/// `/certs` `serial_number`): two digits per byte, leading zero bytes dropped, `0` for 0.
pub fn serial_hex(der_integer: &[u8]) -> String {
    let first = der_integer
        .iter()
        .position(|b| *b != 0)
        .unwrap_or(der_integer.len());
    let digits: String = der_integer[first..]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digits.is_empty() {
        "0".into()
    } else {
        digits
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, SystemTime};

    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType, SerialNumber};

    use super::*;

    /// A CA and, signed by it, an SVID for `spiffe_id` valid over `not_before..not_after`
    /// (unix seconds), parsed as the `spiffe` crate parses what a provider sends; and the
    /// CA's DER.
    pub(crate) fn minted(
        spiffe_id: &str,
        serial: &[u8],
        not_before: u64,
        not_after: u64,
    ) -> (spiffe::X509Svid, Vec<u8>) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let td = spiffe_id
            .trim_start_matches("spiffe://")
            .split('/')
            .next()
            .unwrap();
        ca.subject_alt_names = vec![SanType::URI(format!("spiffe://{td}").try_into().unwrap())];
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(Vec::<String>::new()).unwrap();
        leaf.subject_alt_names = vec![SanType::URI(spiffe_id.to_string().try_into().unwrap())];
        leaf.is_ca = IsCa::ExplicitNoCa;
        leaf.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        leaf.serial_number = Some(SerialNumber::from_slice(serial));
        leaf.not_before = (SystemTime::UNIX_EPOCH + Duration::from_secs(not_before)).into();
        leaf.not_after = (SystemTime::UNIX_EPOCH + Duration::from_secs(not_after)).into();
        let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
        let svid = spiffe::X509Svid::parse_from_der(leaf.der(), &key.serialize_der()).unwrap();
        (svid, ca.der().to_vec())
    }

    #[test]
    fn an_svid_becomes_pem_with_its_serial_and_validity() {
        let (x, _) = minted(
            "spiffe://example.org/ns/a/pod/b",
            &[0x00, 0x7f, 0x01],
            1_700_000_000,
            1_700_003_600,
        );
        let s = svid(&x).unwrap();
        assert_eq!(s.spiffe_id, "spiffe://example.org/ns/a/pod/b");
        assert_eq!((s.not_before, s.not_after), (1_700_000_000, 1_700_003_600));
        assert_eq!(
            s.serial, "7f01",
            "leading zero bytes dropped, as Envoy prints it"
        );
        assert!(
            s.chain_pem.starts_with("-----BEGIN CERTIFICATE-----\n")
                && s.chain_pem.ends_with("-----END CERTIFICATE-----\n"),
            "{}",
            s.chain_pem
        );
        assert!(!s.chain_pem.contains('\r'));
        assert!(s.key_pem.starts_with("-----BEGIN PRIVATE KEY-----\n"));
        // The PEM holds exactly the DER the provider sent.
        assert_eq!(
            ::pem::parse(&s.chain_pem).unwrap().contents(),
            x.leaf().as_bytes()
        );
        assert_eq!(
            ::pem::parse(&s.key_pem).unwrap().contents(),
            x.private_key().as_bytes()
        );
    }

    #[test]
    fn a_bundle_becomes_its_authorities_in_pem() {
        let (_, ca) = minted("spiffe://example.org/x", &[1], 0, 10);
        let (_, ca2) = minted("spiffe://example.org/y", &[2], 0, 10);
        let td = spiffe::TrustDomain::new("example.org").unwrap();
        let bundle = spiffe::X509Bundle::from_x509_authorities(td, &[&ca[..], &ca2[..]]).unwrap();
        let pems = ::pem::parse_many(bundle_pem(&bundle)).unwrap();
        assert_eq!(
            pems.iter()
                .map(|p| p.contents().to_vec())
                .collect::<Vec<_>>(),
            vec![ca, ca2]
        );
    }

    #[test]
    fn serials_print_as_envoy_prints_them() {
        for (der, want) in [
            (&[0x00, 0x80][..], "80"),
            (&[0x01, 0x00][..], "0100"),
            (&[0x00][..], "0"),
            (&[][..], "0"),
            (&[0x7f, 0xab][..], "7fab"),
        ] {
            assert_eq!(serial_hex(der), want, "{der:?}");
        }
    }
}
