//! The test identity provider's certificate authority and the X.509-SVIDs it mints, with
//! rcgen (a test double: no real SPIRE server signs these).
//!
//! The CA is made at start for one trust domain: a self-signed ECDSA P-256 certificate
//! with the trust domain's SPIFFE ID (`spiffe://<trust-domain>`) as URI SAN, CA:true,
//! keyCertSign and cRLSign, as a SPIRE server's X.509 authority. Its DER is the trust
//! bundle. A leaf SVID is what the X509-SVID standard asks for: the SPIFFE ID as the only
//! URI SAN, CA:false, digitalSignature (with keyEncipherment and keyAgreement, as SPIRE
//! sets), serverAuth and clientAuth; a fresh ECDSA P-256 key in PKCS#8; valid from the
//! moment it is minted for the configured lifetime; a fresh serial number each time.
//!
//! Serial numbers are printed as Envoy's admin `/certs` prints `serial_number`: lowercase
//! hex, two digits per byte, without leading zero bytes ([`serial_hex`]).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, CustomExtension, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};

/// One trust domain's certificate authority.
pub struct Ca {
    trust_domain: String,
    key: KeyPair,
    cert: Certificate,
}

/// A minted X.509-SVID.
#[derive(Clone, Debug)]
pub struct Svid {
    pub spiffe_id: String,
    /// The leaf certificate, DER (the whole chain: the CA is the bundle, not part of it).
    pub cert_der: Vec<u8>,
    pub cert_pem: String,
    /// The private key, PKCS#8 DER.
    pub key_der: Vec<u8>,
    /// The private key, PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`).
    pub key_pem: String,
    /// The serial number as Envoy prints it ([`serial_hex`]).
    pub serial: String,
    /// notAfter, in seconds since the Unix epoch.
    pub expires_at: i64,
}

impl Ca {
    /// A new CA for `trust_domain` (a bare name such as `example.org`).
    pub fn new(trust_domain: &str) -> anyhow::Result<Ca> {
        check_trust_domain(trust_domain)?;
        let key = KeyPair::generate().context("generating the CA key")?;
        let mut params = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
        params.subject_alt_names = vec![SanType::URI(
            format!("spiffe://{trust_domain}")
                .try_into()
                .context("the trust domain's SPIFFE ID")?,
        )];
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.distinguished_name.push(DnType::CountryName, "US");
        params
            .distinguished_name
            .push(DnType::OrganizationName, "SPIFFE");
        params.distinguished_name.push(
            DnType::CommonName,
            format!("aether test identity provider CA ({trust_domain})"),
        );
        params.serial_number = Some(SerialNumber::from_slice(&next_serial()));
        let cert = params.self_signed(&key).context("self-signing the CA")?;
        Ok(Ca {
            trust_domain: trust_domain.to_owned(),
            key,
            cert,
        })
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The CA certificate, DER: the trust bundle.
    pub fn der(&self) -> &[u8] {
        self.cert.der()
    }

    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// Mints an X.509-SVID for `spiffe_id` (any `spiffe://` URI with a path; it need not be
    /// in this CA's trust domain, so that tests can make a mismatched one), valid from now
    /// for `lifetime`.
    pub fn mint(&self, spiffe_id: &str, lifetime: Duration) -> anyhow::Result<Svid> {
        self.mint_with_ips(spiffe_id, lifetime, &[])
    }

    /// [`Self::mint`] with IP address SANs beside the SPIFFE ID (a server's certificate that
    /// clients checking a host name also accept).
    pub fn mint_with_ips(
        &self,
        spiffe_id: &str,
        lifetime: Duration,
        ips: &[std::net::IpAddr],
    ) -> anyhow::Result<Svid> {
        let Some(rest) = spiffe_id.strip_prefix("spiffe://") else {
            bail!("{spiffe_id:?} is not a SPIFFE ID (spiffe://...)")
        };
        if !rest
            .split_once('/')
            .is_some_and(|(td, path)| !td.is_empty() && !path.is_empty())
        {
            bail!("{spiffe_id:?} is not a SPIFFE ID with a trust domain and a path");
        }
        let key = KeyPair::generate().context("generating an SVID key")?;
        let mut params = CertificateParams::new(Vec::<String>::new()).context("SVID parameters")?;
        params.subject_alt_names = vec![SanType::URI(
            spiffe_id
                .to_owned()
                .try_into()
                .context("the SPIFFE ID as a URI SAN")?,
        )];
        params
            .subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        // CA:false as SPIRE (Go) writes it: a critical basicConstraints holding an empty
        // SEQUENCE. rcgen's ExplicitNoCa encodes `cA FALSE`, the DEFAULT, which DER forbids
        // and strict parsers (Python's cryptography) refuse.
        params.is_ca = IsCa::NoCa;
        let mut basic_constraints =
            CustomExtension::from_oid_content(&[2, 5, 29, 19], vec![0x30, 0x00]);
        basic_constraints.set_criticality(true);
        params.custom_extensions = vec![basic_constraints];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyAgreement,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.distinguished_name.push(DnType::CountryName, "US");
        params
            .distinguished_name
            .push(DnType::OrganizationName, "SPIRE");
        params.use_authority_key_identifier_extension = true;
        // Whole seconds, as the certificate holds them, so that notAfter - notBefore is the
        // lifetime exactly.
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(unix_now());
        params.not_before = now.into();
        params.not_after = (now + lifetime).into();
        let serial = next_serial();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .context("signing an SVID")?;
        let expires_at = i64::try_from(
            (now + lifetime)
                .duration_since(SystemTime::UNIX_EPOCH)?
                .as_secs(),
        )?;
        Ok(Svid {
            spiffe_id: spiffe_id.to_owned(),
            cert_der: cert.der().to_vec(),
            cert_pem: cert.pem(),
            key_der: key.serialize_der(),
            key_pem: key.serialize_pem(),
            serial: hex(&serial),
            expires_at,
        })
    }
}

/// A trust domain name as SPIFFE allows it: lowercase letters, digits, `.`, `-`, `_`.
fn check_trust_domain(name: &str) -> anyhow::Result<()> {
    if name.is_empty()
        || !name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
        })
    {
        bail!("{name:?} is not a trust domain name (lowercase letters, digits, '.', '-', '_')");
    }
    Ok(())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_secs()
}

/// 16 bytes: 8 random, then a process-wide counter, so no two certificates of one test
/// process share a serial. The first byte is kept in 0x10..=0x7f: the number is positive
/// (DER needs no leading zero byte) and its hex has no leading zero digit, so every
/// client (Envoy, Python's `'%x'`) prints the same 32 digits.
fn next_serial() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = RandomState::new().hash_one(count);
    let mut serial = [0u8; 16];
    serial[..8].copy_from_slice(&random.to_be_bytes());
    serial[8..].copy_from_slice(&count.to_be_bytes());
    serial[0] = 0x10 + serial[0] % 0x70;
    serial
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The serial number of a DER certificate as Envoy's admin `/certs` prints
/// `serial_number` (BoringSSL's `BN_bn2hex`, lowercased): two hex digits per byte of the
/// positive integer, leading zero bytes dropped, `0` for zero. None if `cert_der` is not
/// a certificate.
pub fn serial_hex(cert_der: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL,
    // serialNumber INTEGER, ... }, ... }
    let (certificate, _) = der_element(cert_der, 0x30)?;
    let (tbs, _) = der_element(certificate, 0x30)?;
    let after_version = match tbs.first() {
        Some(0xa0) => der_element(tbs, 0xa0)?.1,
        _ => tbs,
    };
    let (serial, _) = der_element(after_version, 0x02)?;
    let digits = hex(serial
        .iter()
        .position(|b| *b != 0)
        .map_or(&[][..], |first| &serial[first..]));
    Some(if digits.is_empty() {
        "0".to_owned()
    } else {
        digits
    })
}

/// The contents of the DER element at the start of `input` if its tag is `tag`, and what
/// follows it.
fn der_element(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (found, contents, rest) = crate::datapath::der_next(input)?;
    (found == tag).then_some((contents, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serial_hex_reads_what_was_set() {
        let ca = Ca::new("example.org").unwrap();
        let a = ca
            .mint("spiffe://example.org/a", Duration::from_secs(60))
            .unwrap();
        let b = ca
            .mint("spiffe://example.org/a", Duration::from_secs(60))
            .unwrap();
        assert_eq!(serial_hex(&a.cert_der).as_deref(), Some(a.serial.as_str()));
        assert_eq!(a.serial.len(), 32);
        assert_ne!(a.serial, b.serial);
        assert_eq!(serial_hex(b"not a certificate"), None);
    }

    #[test]
    fn rejects_what_is_not_a_spiffe_id_or_trust_domain() {
        assert!(Ca::new("Example.org").is_err());
        let ca = Ca::new("example.org").unwrap();
        for bad in [
            "https://example.org/a",
            "spiffe://example.org",
            "spiffe://example.org/",
            "spiffe:///a",
        ] {
            assert!(ca.mint(bad, Duration::from_secs(60)).is_err(), "{bad}");
        }
    }
}
