//! Mutual TLS to a registrar with the agent's own X.509-SVID (`--registrar-spiffe-id`):
//! the agent presents the SVID the node holds at connect time, so a connection made after
//! a rotation presents the new one, and it checks the registrar's certificate against the
//! trust bundle from the Workload API and its one URI SAN against the expected SPIFFE ID.
//! SVIDs carry no host name, so none is checked.

use std::sync::Arc;

use aether_model::Svid;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{
    CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// Why the registrar's certificate is not the expected SVID.
#[derive(Debug, thiserror::Error)]
pub enum PeerIdError {
    #[error("the registrar's certificate carries {0} URI SANs, not one SPIFFE ID")]
    UriSans(usize),
    #[error("the registrar presented SPIFFE ID {got:?}, not --registrar-spiffe-id {want:?}")]
    Mismatch { got: String, want: String },
}

/// The URI SANs of certificate `der`.
pub fn uri_sans(der: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(u) => Some((*u).to_owned()),
            _ => None,
        })
        .collect()
}

#[derive(Debug)]
struct RegistrarId {
    roots: Arc<RootCertStore>,
    expected: String,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for RegistrarId {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        let other = |e: PeerIdError| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        };
        match uri_sans(end_entity).as_slice() {
            [id] if *id == self.expected => Ok(ServerCertVerified::assertion()),
            [id] => Err(other(PeerIdError::Mismatch {
                got: id.clone(),
                want: self.expected.clone(),
            })),
            ids => Err(other(PeerIdError::UriSans(ids.len()))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

/// The SVID as a client certificate: its chain and key.
pub fn client_cert(svid: &Svid) -> anyhow::Result<shared_proto::registry_tls::ClientCert> {
    let chain = CertificateDer::pem_slice_iter(svid.chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("the agent's SVID {}: {e}", svid.spiffe_id))?;
    let key = PrivateKeyDer::from_pem_slice(svid.key_pem.as_bytes())
        .map_err(|e| anyhow::anyhow!("the key of the agent's SVID {}: {e}", svid.spiffe_id))?;
    Ok((chain, key))
}

/// The client configuration presenting `svid` and accepting only a registrar whose
/// certificate chains to `bundle_pem` and names `expected`.
pub fn client_config(
    svid: &Svid,
    bundle_pem: &str,
    expected: &str,
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let provider: Arc<CryptoProvider> = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(bundle_pem.as_bytes()) {
        let c = c.map_err(|e| anyhow::anyhow!("the trust bundle: {e}"))?;
        roots
            .add(c)
            .map_err(|e| anyhow::anyhow!("the trust bundle: {e}"))?;
    }
    anyhow::ensure!(!roots.is_empty(), "the trust bundle holds no certificate");
    let verifier = RegistrarId {
        roots: Arc::new(roots),
        expected: expected.to_owned(),
        algs: provider.signature_verification_algorithms,
    };
    let (chain, key) = client_cert(svid)?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports rustls's default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(chain, key)
        .map_err(|e| anyhow::anyhow!("the agent's SVID {}: {e}", svid.spiffe_id))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};

    struct Ca {
        key: KeyPair,
        cert: rcgen::Certificate,
    }

    fn ca(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_owned());
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = p.self_signed(&key).unwrap();
        Ca { key, cert }
    }

    type Leaf = (Svid, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

    fn svid(ca: &Ca, uris: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names = uris
            .iter()
            .map(|u| SanType::URI((*u).to_owned().try_into().unwrap()))
            .collect();
        let cert = p.signed_by(&key, &ca.cert, &ca.key).unwrap();
        let model = Svid {
            spiffe_id: uris.first().map_or_else(String::new, |u| (*u).to_owned()),
            chain_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            serial: "1".into(),
            not_before: 0,
            not_after: u64::MAX,
        };
        let der = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap();
        (model, vec![cert.der().clone()], der)
    }

    /// One in-memory handshake; the first error either side meets.
    fn handshake(
        client: Arc<rustls::ClientConfig>,
        server: Arc<rustls::ServerConfig>,
    ) -> Result<(), rustls::Error> {
        let mut c = rustls::ClientConnection::new(client, "registrar.invalid".try_into().unwrap())?;
        let mut s = rustls::ServerConnection::new(server)?;
        for _ in 0..10 {
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets()?;
            let mut buf = Vec::new();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    /// The agent accepts a registrar whose SVID chains to the bundle and names the
    /// expected ID, presenting its own SVID; another ID, two URI SANs or another CA are
    /// refused, naming what was wrong.
    #[test]
    fn the_registrar_must_present_the_expected_spiffe_id() {
        let (bundle_ca, other_ca) = (ca("bundle"), ca("other"));
        let want = "spiffe://td/registrar";
        let (agent, _, _) = svid(&bundle_ca, &["spiffe://td/agent/n"]);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = |ca: &Ca, uris: &[&str]| {
            let (_, chain, key) = svid(ca, uris);
            let mut roots = RootCertStore::empty();
            roots.add(bundle_ca.cert.der().clone()).unwrap();
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider.clone(),
            )
            .build()
            .unwrap();
            Arc::new(
                rustls::ServerConfig::builder_with_provider(provider.clone())
                    .with_safe_default_protocol_versions()
                    .unwrap()
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(chain, key)
                    .unwrap(),
            )
        };
        let client = client_config(&agent, &bundle_ca.cert.pem(), want).unwrap();
        handshake(client.clone(), server(&bundle_ca, &[want])).expect("the expected registrar");
        for (ca, uris, why) in [
            (
                &bundle_ca,
                &["spiffe://td/other"][..],
                "got: \"spiffe://td/other\"",
            ),
            (&bundle_ca, &[want, "spiffe://td/x"][..], "UriSans(2)"),
            (&other_ca, &[want][..], "UnknownIssuer"),
        ] {
            let e = handshake(client.clone(), server(ca, uris)).unwrap_err();
            assert!(format!("{e:?}").contains(why), "{uris:?}: {e:?}");
        }
    }
}
