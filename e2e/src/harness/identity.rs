//! `ARG_IDENTITY=permissive|strict`: the rolled node runs with workload identity. A test
//! identity provider ([`crate::identity::IdentityProvider`], trust domain
//! [`TRUST_DOMAIN`]) runs beside the node, and every agent generation gets the four
//! identity flags (`--spiffe-endpoint`, `--spiffe-broker-endpoint`, `--trust-domain`,
//! `--mtls`). The worker then serves each local pod's SVID to Envoy as the SDS secret
//! `spiffe|inbound|<uid>`, the certificate of the pod's inbound mTLS chain; Envoy's admin
//! `/certs` lists it with its serial number, which is how the harness sees it served.
//!
//! Per roll the harness checks that every pod it knows present has its SVID in `/certs`
//! ([`missing_svids`]), times how soon after the takeover the pod it ADDed between the
//! standby's Ready and the SIGTERM (surge; one the new owner's reconcile adds and waits
//! for) shows ([`wait_serial`]), and reads the takeover's `svid_wait` from the new
//! owner's `/ready`.
//!
//! The load is unchanged: it goes through Envoy's outbound listener to the services'
//! loopback upstreams, plaintext endpoints that are not pods, so identity is not on its
//! path (a permissive pod keeps its plaintext chain; strict only closes pods' inbound).

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use super::churn::PodId;
use crate::envoy::Envoy;
use crate::identity::IdentityProvider;

/// The trust domain of the provider beside the node.
pub const TRUST_DOMAIN: &str = "aether.test";
/// The takeover waits at most this long for the SVIDs of the pods its reconcile added
/// (ARCHITECTURE.md, "Takeover wait"); the overlap pod must show in Envoy within it.
pub const TAKEOVER_SVID_WAIT: Duration = Duration::from_secs(1);
/// Every present pod's SVID must be in Envoy's `/certs` this long after the new owner
/// serves.
pub const PODS_DEADLINE: Duration = Duration::from_secs(2);
/// How often `/certs` is read while waiting.
const POLL: Duration = Duration::from_millis(5);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mtls {
    Permissive,
    Strict,
}

impl Mtls {
    pub fn name(self) -> &'static str {
        match self {
            Mtls::Permissive => "permissive",
            Mtls::Strict => "strict",
        }
    }

    pub fn parse(s: &str) -> Result<Mtls> {
        match s.trim() {
            "permissive" => Ok(Mtls::Permissive),
            "strict" => Ok(Mtls::Strict),
            other => bail!("ARG_IDENTITY={other:?}: permissive or strict"),
        }
    }
}

/// The provider beside one node; stops when dropped.
pub struct NodeIdentity {
    pub provider: IdentityProvider,
    pub mtls: Mtls,
}

impl NodeIdentity {
    /// Starts the provider with its sockets in `<node root>/identity`. The worker runs as
    /// another uid when the harness runs as root, and connecting to a unix socket needs
    /// write permission on its file: the folder and both sockets are opened to every uid.
    pub fn start(root: &Path, mtls: Mtls) -> Result<NodeIdentity> {
        let dir = root.join("identity");
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("chmod {}", dir.display()))?;
        let provider = IdentityProvider::start(&dir, TRUST_DOMAIN)
            .context("start the test identity provider")?;
        for p in [provider.workload_socket(), provider.delegated_socket()] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666))
                .with_context(|| format!("chmod {}", p.display()))?;
        }
        Ok(NodeIdentity { provider, mtls })
    }

    /// The agent's identity flags (the supervisor passes them on to its worker).
    pub fn agent_args(&self) -> Vec<String> {
        vec![
            format!(
                "--spiffe-endpoint=unix://{}",
                self.provider.workload_socket().display()
            ),
            format!(
                "--spiffe-broker-endpoint=unix://{}",
                self.provider.delegated_socket().display()
            ),
            format!("--trust-domain={}", self.provider.trust_domain()),
            format!("--mtls={}", self.mtls.name()),
        ]
    }
}

/// Every certificate serial number in Envoy's admin `/certs` (lowercase hex, as
/// [`IdentityProvider::serial_of_pod`] gives them).
pub fn envoy_serials(envoy: &Envoy) -> Result<BTreeSet<String>> {
    let (status, body) = envoy.get("/certs").context("Envoy /certs")?;
    if status != 200 {
        bail!("Envoy /certs answered {status}");
    }
    let v: Value =
        serde_json::from_str(&body).map_err(|e| anyhow!("Envoy /certs is not JSON: {e}"))?;
    let mut out = BTreeSet::new();
    for c in v["certificates"].as_array().into_iter().flatten() {
        for chain in c["cert_chain"].as_array().into_iter().flatten() {
            if let Some(s) = chain["serial_number"].as_str() {
                out.insert(s.to_lowercase());
            }
        }
    }
    Ok(out)
}

/// The pods of `pods` whose current SVID is not in Envoy's `/certs` by `deadline` (read
/// at least once), each named with why.
pub fn missing_svids(
    envoy: &Envoy,
    provider: &IdentityProvider,
    pods: &[PodId],
    deadline: Instant,
) -> Result<Vec<String>> {
    loop {
        let serials = envoy_serials(envoy)?;
        let missing: Vec<String> = pods
            .iter()
            .filter_map(|p| match provider.serial_of_pod(&p.uid) {
                None => Some(format!(
                    "pod {} ({}): never subscribed at the identity provider",
                    p.uid, p.name
                )),
                Some(s) if !serials.contains(&s.to_lowercase()) => Some(format!(
                    "pod {} ({}): its SVID (serial {s}) is not in Envoy's /certs",
                    p.uid, p.name
                )),
                Some(_) => None,
            })
            .collect();
        if missing.is_empty() || Instant::now() >= deadline {
            return Ok(missing);
        }
        std::thread::sleep(POLL);
    }
}

/// When a `/certs` read first showed the pod's current SVID serial; None when none did by
/// `deadline` (read at least once).
pub fn wait_serial(
    envoy: &Envoy,
    provider: &IdentityProvider,
    uid: &str,
    deadline: Instant,
) -> Result<Option<Instant>> {
    loop {
        if let Some(s) = provider.serial_of_pod(uid) {
            let serials = envoy_serials(envoy)?;
            let seen = Instant::now();
            if serials.contains(&s.to_lowercase()) {
                return Ok(Some(seen));
            }
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(POLL);
    }
}
