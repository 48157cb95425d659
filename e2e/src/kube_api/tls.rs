//! The server's certificates, made at start: a CA (what a kubeconfig's
//! `certificate-authority-data` carries, as a cluster's CA) and a serving certificate it
//! signs for 127.0.0.1 and localhost. rustls with ring, HTTP/1.1 only.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

pub struct Tls {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    pub config: Arc<ServerConfig>,
}

pub fn make() -> Tls {
    let ca_key = KeyPair::generate().expect("generating the test API server's CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "aether test kube-apiserver CA");
    let ca = ca_params
        .self_signed(&ca_key)
        .expect("self-signing the test API server's CA");

    let key = KeyPair::generate().expect("generating the test API server's key");
    let mut params = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .expect("serving certificate parameters");
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let cert = params
        .signed_by(&key, &ca, &ca_key)
        .expect("signing the test API server's certificate");

    let chain = vec![
        CertificateDer::from(cert.der().to_vec()),
        CertificateDer::from(ca.der().to_vec()),
    ];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("rustls protocol versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("the test API server's certificate and key");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Tls {
        ca_pem: ca.pem(),
        config: Arc::new(config),
    }
}

/// Standard base64 with padding (RFC 4648), for the kubeconfig's certificate data.
pub fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc_4648() {
        for (input, expected) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(super::base64(input.as_bytes()), expected);
        }
    }
}
