//! What a deleted pod's certificate secret becomes in Envoy: a tombstone.
//!
//! Envoy keeps a secret as long as something uses it, whatever the control plane says:
//! - a removed pod listener drains for Envoy's `--drain-time-s` (600 s by default) and
//!   keeps its SDS secret until it is gone; a delta removal of that secret is ignored;
//! - state of the world cannot remove an SDS resource at all: a response that omits a
//!   name leaves the proxy with the last version it got.
//!
//! So a pod secret (`spiffe|pod|<uid>`, `spiffe|inbound|<uid>`) that the proxy holds or
//! asks for, and that the snapshot no longer has, is first overwritten with this
//! certificate: self-signed, no SPIFFE ID, trusted by no one, its key published here.
//! Whatever still uses the name (a draining listener, the outbound certificate mapper, a
//! reconnect that asks for it again) then holds no identity and no private key of any
//! pod: a handshake that presents it is refused by every peer of the mesh. Over delta
//! ADS, once the proxy has answered the tombstone, the name is removed too
//! ([`super::delta`]), which frees it where nothing uses it any more. Over state of the
//! world the tombstone stays until the proxy stops asking for the name.
//!
//! The key is public by design: it proves nothing, so it protects nothing.

use aether_model as snapshot;
use envoy_types::pb::google::protobuf::Any;

use super::convert;

/// The tombstone's content hash, as its version on the wire: fixed, so that a proxy
/// that already holds the tombstone is not sent it again (after a reconnect too).
pub const HASH: u64 = 0x7a6f_6d62_6965_0001;

/// Self-signed, `CN=aether-no-identity`, valid until 2126, no subject alternative name.
pub const CERT_PEM: &str = include_str!("tombstone/cert.pem");
const KEY_PEM: &str = include_str!("tombstone/key.pem");

/// Whether `name` is a pod's certificate secret, which a tombstone replaces when the pod
/// goes. The trust bundle and any other name are removed as before.
pub fn applies_to(name: &str) -> bool {
    name.starts_with(snapshot::POD_SECRET_PREFIX)
        || name.starts_with(snapshot::INBOUND_SECRET_PREFIX)
}

/// The tombstone under `name`, encoded for the wire.
pub fn encode(name: &str) -> Any {
    convert::secret(&snapshot::NamedSecret {
        name: name.to_string(),
        secret: snapshot::Secret::Certificate {
            chain_pem: CERT_PEM.to_string(),
            key_pem: KEY_PEM.to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;

    #[test]
    fn only_pod_certificates_get_a_tombstone() {
        assert!(applies_to(&snapshot::pod_secret_name("u1")));
        assert!(applies_to(&snapshot::inbound_secret_name("u1")));
        assert!(!applies_to(snapshot::BUNDLE_SECRET));
        assert!(!applies_to("spiffe|none"));
    }

    /// The tombstone is a certificate with its key under the name asked for, and it names
    /// no identity: no subject alternative name at all.
    #[test]
    fn the_tombstone_names_no_identity() {
        let s: tls::Secret =
            prost::Message::decode(encode("spiffe|inbound|u1").value.as_slice()).expect("a Secret");
        assert_eq!(s.name, "spiffe|inbound|u1");
        let Some(tls::secret::Type::TlsCertificate(c)) = s.r#type else {
            panic!("a TLS certificate")
        };
        assert!(c.private_key.is_some());
        let (_, pem) = x509_parser::pem::parse_x509_pem(CERT_PEM.as_bytes()).expect("PEM");
        let cert = pem.parse_x509().expect("X.509");
        assert!(cert.subject_alternative_name().expect("SAN").is_none());
        assert!(cert.subject().to_string().contains("aether-no-identity"));
        assert!(KEY_PEM.contains("PRIVATE KEY-----"));
    }
}
