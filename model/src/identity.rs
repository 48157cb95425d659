//! Workload identity in the model: the SPIFFE SVIDs the agent holds, the trust bundle,
//! and the mTLS mode. The identity sources convert into these types; the builder turns
//! them into SDS secrets and into the TLS settings of the pods' listeners and of the
//! clusters of mTLS-capable services.
//!
//! Key material lives here in memory only (it reaches the proxy inline in an SDS secret
//! and is never written to a file). Its `Debug` output never shows it.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// How a pod's inbound listener treats peers without a certificate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum MtlsMode {
    /// mTLS and plaintext on the same port, told apart by the TLS inspector. A pod whose
    /// SVID has not arrived keeps its plaintext path.
    #[default]
    Permissive,
    /// mTLS only. A pod without its SVID gets no inbound listener until the SVID
    /// arrives (fail closed).
    Strict,
}

impl MtlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            MtlsMode::Permissive => "permissive",
            MtlsMode::Strict => "strict",
        }
    }
}

impl std::str::FromStr for MtlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "permissive" => Ok(MtlsMode::Permissive),
            "strict" => Ok(MtlsMode::Strict),
            other => Err(format!(
                "unknown mTLS mode {other:?}: expected \"permissive\" or \"strict\""
            )),
        }
    }
}

/// One X.509-SVID: the certificate chain (leaf first) and its private key, both PEM.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct Svid {
    pub spiffe_id: String,
    pub chain_pem: String,
    pub key_pem: String,
    /// The leaf's serial number in lowercase hex, as Envoy's admin `/certs` prints it.
    pub serial: String,
    /// The leaf's validity, in seconds since the Unix epoch.
    pub not_before: u64,
    pub not_after: u64,
}

impl fmt::Debug for Svid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Svid")
            .field("spiffe_id", &self.spiffe_id)
            .field("serial", &self.serial)
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl Svid {
    /// The moment from which the SVID counts as about to expire: 80 % of its lifetime.
    pub fn renew_by(&self) -> u64 {
        let life = self.not_after.saturating_sub(self.not_before);
        self.not_before + life / 5 * 4 + (life % 5) * 4 / 5
    }
}

/// The identity inputs of a snapshot. `trust_domain: None` turns identity off: no
/// secrets, no TLS anywhere, and every resource is what it was without identity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub trust_domain: Option<String>,
    pub mode: MtlsMode,
    /// The trust domain's CA certificates (PEM), from the Workload API.
    pub bundle: Option<String>,
    /// The agent's own SVID. It is the agent's alone: no snapshot resource carries it,
    /// so no pod's connection can present it.
    pub agent: Option<Svid>,
    /// Local pods' SVIDs, by pod uid.
    pub pods: BTreeMap<String, Svid>,
}

impl Identity {
    pub fn enabled(&self) -> bool {
        self.trust_domain.is_some()
    }
}

/// SDS resource names. A pod's outbound certificate is named by its uid: the outbound
/// listener has a filter chain per pod that holds its SVID, matched by the pod's IPs as the
/// connection's direct source, which names that secret, and Envoy fetches it on demand. So
/// a new pod at a reused IP names another secret, and its connections another upstream
/// pool key: it never rides a connection made with the old pod's certificate. A source no
/// pod chain matches names [`NO_SVID_SECRET_PREFIX`] and its address, never served. Its
/// inbound certificate is a secret of its own, also named by the pod's uid, which the
/// pod's listener subscribes to at once: in Envoy 1.40 one name cannot serve both,
/// because the listener's SDS subscription and the on-demand selector's do not share the
/// answer (the selector's handshake then waits out its connect timeout), and a listener
/// warms on a plain SDS certificate, keeps session resumption, and lists it in the admin
/// `/certs`.
pub const BUNDLE_SECRET: &str = "spiffe|bundle";

pub fn pod_secret_name(uid: &str) -> String {
    format!("{POD_SECRET_PREFIX}{uid}")
}

pub fn inbound_secret_name(uid: &str) -> String {
    format!("{INBOUND_SECRET_PREFIX}{uid}")
}

/// The prefix of every pod's inbound secret (see [`inbound_secret_name`]).
pub const INBOUND_SECRET_PREFIX: &str = "spiffe|inbound|";

/// The prefix of every pod's outbound secret (see [`pod_secret_name`]).
pub const POD_SECRET_PREFIX: &str = "spiffe|pod|";

/// What a connection from a source that no pod chain matches names, before its address: a
/// pod secret's prefix (so the clusters' matcher picks mTLS, and a strict pod without its
/// SVID fails its handshake rather than going plaintext), then `|`, which no pod uid
/// holds, so that no secret of that name is ever served.
pub const NO_SVID_SECRET_PREFIX: &str = "spiffe|pod|no-svid|";

/// An SDS secret.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub enum Secret {
    /// A certificate chain and its key.
    Certificate { chain_pem: String, key_pem: String },
    /// A validation context: the trust domain's CA certificates, and the SPIFFE ID prefix
    /// (`spiffe://<trust domain>/`) a peer's URI SAN must have.
    Validation {
        ca_pem: String,
        spiffe_prefix: String,
    },
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Secret::Certificate { .. } => f.write_str("Secret::Certificate(<redacted>)"),
            Secret::Validation { spiffe_prefix, .. } => {
                write!(f, "Secret::Validation({spiffe_prefix})")
            }
        }
    }
}

/// A named secret, as the snapshot holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NamedSecret {
    pub name: String,
    pub secret: Secret,
}

/// TLS on a pod's inbound listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InboundTls {
    /// The pod's certificate (SDS name).
    pub certificate: String,
    /// Also serve plaintext on the same port (permissive).
    pub plaintext: bool,
}

/// TLS origination on an outbound cluster, for its endpoints marked mTLS-capable. A
/// connection presents its calling pod's own certificate, or none: no other certificate
/// is ever named, and the agent's SVID is never a pod's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UpstreamTls {
    /// Permissive: a connection that names no certificate (it comes from a pod whose SVID
    /// has not arrived, see [`crate::ListenerKind::HttpOutbound`]) goes plaintext, which a
    /// permissive peer accepts and a strict one refuses. Strict (false): it names the
    /// pod's certificate anyway, which is not served, so its handshake fails.
    pub plaintext_without_certificate: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renew_by_is_eighty_percent_of_the_lifetime() {
        let s = Svid {
            spiffe_id: "spiffe://t/x".into(),
            chain_pem: String::new(),
            key_pem: String::new(),
            serial: "01".into(),
            not_before: 1000,
            not_after: 2000,
        };
        assert_eq!(s.renew_by(), 1800);
        let odd = Svid {
            not_after: 1003,
            ..s
        };
        assert_eq!(odd.renew_by(), 1002);
    }

    #[test]
    fn debug_never_shows_the_key() {
        let s = Svid {
            spiffe_id: "spiffe://t/x".into(),
            chain_pem: "CHAIN".into(),
            key_pem: "SECRET-KEY".into(),
            serial: "01".into(),
            not_before: 0,
            not_after: 1,
        };
        assert!(!format!("{s:?}").contains("SECRET-KEY"));
        let c = Secret::Certificate {
            chain_pem: "CHAIN".into(),
            key_pem: "SECRET-KEY".into(),
        };
        assert!(!format!("{c:?}").contains("SECRET-KEY"));
    }

    #[test]
    fn modes_parse_and_name_themselves() {
        for m in [MtlsMode::Permissive, MtlsMode::Strict] {
            assert_eq!(m.as_str().parse::<MtlsMode>(), Ok(m));
        }
        assert!("STRICT".parse::<MtlsMode>().unwrap_err().contains("STRICT"));
    }
}
