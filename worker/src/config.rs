//! The worker's command line. The supervisor builds it; nothing here reads the
//! environment, which the supervisor clears.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use aether_model::MtlsMode;
use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(name = "aether-worker", version, about = "Unprivileged half of the Aether node agent; started by aether-supervisor, not by hand")]
pub struct Config {
    /// The inherited control socket (SOCK_SEQPACKET) to the supervisor.
    #[arg(long, default_value_t = 3)]
    pub control_fd: i32,
    /// Used to check that handed-over sockets are bound where expected, and by a released
    /// owner to see its successor answer on `xds.sock`.
    #[arg(long)]
    pub run_dir: PathBuf,
    #[arg(long)]
    pub state_dir: PathBuf,
    #[arg(long)]
    pub health_dir: PathBuf,
    #[arg(long, default_value = "localhost")]
    pub node_name: String,
    #[arg(long, default_value = "aether-agent")]
    pub pod_name: String,
    #[arg(long)]
    pub registry_file: Option<PathBuf>,
    /// Largest registry file read, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub registry_max_bytes: u64,
    #[arg(long)]
    pub capture_file: Option<PathBuf>,
    /// The proxy fetches the mesh's clusters on demand (delta ADS only).
    #[arg(long)]
    pub on_demand_clusters: bool,
    /// Registrar addresses, comma-separated: `unix:///path` or `host:port`.
    #[arg(long)]
    pub registrar: Option<String>,
    /// A bearer token for the registrar (the pod's projected token), read at each call.
    #[arg(long)]
    pub registrar_token_file: Option<PathBuf>,
    /// The mesh cluster this node belongs to, as the registrar keys its watch streams.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// The SPIFFE Workload API (`unix:///path`, what SPIFFE_ENDPOINT_SOCKET names): the
    /// agent's own SVID and the trust bundle, followed across rotations. Setting it turns
    /// workload identity on, and then --trust-domain is required. A standby is complete
    /// only once it holds its SVID; a lone owner waits 5 s for it, then serves without.
    #[arg(long, value_name = "unix:///PATH")]
    pub spiffe_endpoint: Option<String>,
    /// SPIRE's Delegated Identity API on the SPIRE agent's admin socket (`unix:///path`):
    /// one SVID stream per local pod, named by the selectors k8s:ns, k8s:pod-name and
    /// k8s:pod-uid. The agent must be one of the SPIRE agent's authorized delegates. Needs
    /// --spiffe-endpoint. Without it no pod gets an SVID.
    #[arg(long, value_name = "unix:///PATH")]
    pub spiffe_broker_endpoint: Option<String>,
    /// The SPIFFE trust domain of the mesh (a bare name such as `example.org`). The
    /// agent's and the pods' SVIDs must be in it (an SVID from another one is not served),
    /// and a peer's certificate must carry a SPIFFE ID in it.
    #[arg(long, value_name = "NAME")]
    pub trust_domain: Option<String>,
    /// Pods' inbound mTLS: `permissive` (mTLS and plaintext on the same port) or `strict`
    /// (mTLS only: a pod without its SVID has no inbound listener until the SVID comes).
    /// Applies with --spiffe-endpoint only.
    #[arg(long, value_name = "MODE", default_value = "permissive", value_parser = parse_mtls)]
    pub mtls: MtlsMode,
    /// The node's CNI conf folder: `/ready` reports whether its first conflist chains
    /// aether-cni. Read only; the owner's supervisor repairs it.
    #[arg(long)]
    pub cni_conf_dir: Option<PathBuf>,
    /// Kubernetes API access from a kubeconfig file (its current context).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubernetes API access from the pod's service account, to the API server at
    /// HOST:PORT (the supervisor passes KUBERNETES_SERVICE_HOST and _PORT, since this
    /// process's environment is cleared).
    #[arg(long, value_name = "HOST:PORT")]
    pub kube_in_cluster: Option<String>,
    /// How long a pod record must stay absent from the API server's complete pod list
    /// before the owner removes it (`60s`, `1500ms`, `2m`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub stale_record_grace: Duration,
    /// "off" or an address; bound only once this worker owns the node.
    #[arg(long, default_value = "off")]
    pub metrics_addr: String,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

fn parse_mtls(s: &str) -> Result<MtlsMode, String> {
    s.parse()
}

/// Workload identity as the flags set it: on when `--spiffe-endpoint` is set.
#[derive(Debug, Clone)]
pub struct IdentityConfig {
    pub workload_api: spiffe::transport::Endpoint,
    /// The flag's text, for logs and `/ready`.
    pub workload_api_text: String,
    pub broker: Option<(spiffe::transport::Endpoint, String)>,
    pub trust_domain: spiffe::TrustDomain,
    pub mode: MtlsMode,
}

/// A duration as `<number><unit>`, the unit one of `ms`, `s`, `m`; the number may have
/// a fraction.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let n: f64 = number.parse().map_err(|_| format!("duration {s:?}: expected a number and a unit (ms, s, m), as in 60s"))?;
    let seconds = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("duration {s:?}: unit {unit:?} is none of ms, s, m")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("duration {s:?}: {e}"))
}

impl Config {
    /// Workload identity, when `--spiffe-endpoint` turns it on; an error names the flag at
    /// fault.
    pub fn identity(&self) -> anyhow::Result<Option<IdentityConfig>> {
        let Some(workload_api_text) = &self.spiffe_endpoint else {
            anyhow::ensure!(
                self.spiffe_broker_endpoint.is_none(),
                "--spiffe-broker-endpoint needs --spiffe-endpoint: the pods' SVIDs are served beside the agent's own SVID and trust bundle"
            );
            return Ok(None);
        };
        let endpoint = |flag: &str, text: &str| {
            spiffe::transport::Endpoint::parse(text).map_err(|e| anyhow::anyhow!("{flag} {text:?}: {e} (expected unix:///path)"))
        };
        let workload_api = endpoint("--spiffe-endpoint", workload_api_text)?;
        let broker = match &self.spiffe_broker_endpoint {
            Some(text) => Some((endpoint("--spiffe-broker-endpoint", text)?, text.clone())),
            None => None,
        };
        let Some(name) = &self.trust_domain else {
            anyhow::bail!("--spiffe-endpoint is set but --trust-domain is not: the trust domain whose SVIDs the agent serves is required with workload identity (AETHER_TRUST_DOMAIN)");
        };
        let trust_domain = parse_trust_domain(name)?;
        Ok(Some(IdentityConfig { workload_api, workload_api_text: workload_api_text.clone(), broker, trust_domain, mode: self.mtls }))
    }

    pub fn metrics_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        if self.metrics_addr == "off" {
            return Ok(None);
        }
        Ok(Some(self.metrics_addr.parse().map_err(|e| anyhow::anyhow!("--metrics-addr {:?}: {e}", self.metrics_addr))?))
    }
}

/// A bare trust domain name, as SPIFFE writes it: lower-case letters, digits, `.`, `-`, `_`.
fn parse_trust_domain(name: &str) -> anyhow::Result<spiffe::TrustDomain> {
    let bad = |why: &str| anyhow::anyhow!("--trust-domain {name:?}: {why}");
    if name.contains(':') || name.contains('/') {
        return Err(bad("expected a bare trust domain name such as example.org, not a URI"));
    }
    let td = spiffe::TrustDomain::new(name).map_err(|e| bad(&e.to_string()))?;
    if td.as_str() != name {
        return Err(bad("a trust domain name is lower case"));
    }
    Ok(td)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_a_unit_and_errors_name_the_value() {
        for (text, want) in [("60s", 60_000), ("1500ms", 1500), ("2m", 120_000), ("0.5s", 500), ("0s", 0)] {
            assert_eq!(parse_duration(text), Ok(Duration::from_millis(want)), "{text}");
        }
        for bad in ["", "60", "s", "1h", "-1s", "1.2.3s"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    fn parse(args: &[&str]) -> Config {
        Config::try_parse_from([&["aether-worker", "--run-dir=/r", "--state-dir=/s", "--health-dir=/h"], args].concat()).unwrap()
    }

    #[test]
    fn identity_is_on_with_the_workload_api_and_needs_a_trust_domain() {
        assert!(parse(&[]).identity().unwrap().is_none());
        assert_eq!(parse(&[]).mtls, MtlsMode::Permissive);
        let c = parse(&["--spiffe-endpoint=unix:///run/spire/agent.sock", "--trust-domain=example.org", "--mtls=strict"]).identity().unwrap().unwrap();
        assert_eq!((c.trust_domain.as_str(), c.mode), ("example.org", MtlsMode::Strict));
        assert_eq!(c.workload_api, spiffe::transport::Endpoint::Unix("/run/spire/agent.sock".into()));
        assert!(c.broker.is_none());
        let c = parse(&["--spiffe-endpoint=unix:///a.sock", "--spiffe-broker-endpoint=unix:///b.sock", "--trust-domain=t"]).identity().unwrap().unwrap();
        assert_eq!(c.broker.map(|b| b.0), Some(spiffe::transport::Endpoint::Unix("/b.sock".into())));

        for (args, names) in [
            (&["--spiffe-endpoint=unix:///a.sock"][..], "--trust-domain"),
            (&["--spiffe-broker-endpoint=unix:///b.sock"][..], "--spiffe-broker-endpoint"),
            (&["--spiffe-endpoint=/a.sock", "--trust-domain=t"][..], "--spiffe-endpoint \"/a.sock\""),
            (&["--spiffe-endpoint=unix:///a.sock", "--spiffe-broker-endpoint=http://x", "--trust-domain=t"][..], "--spiffe-broker-endpoint \"http://x\""),
            (&["--spiffe-endpoint=unix:///a.sock", "--trust-domain=Example.org"][..], "--trust-domain \"Example.org\""),
            (&["--spiffe-endpoint=unix:///a.sock", "--trust-domain=spiffe://example.org"][..], "--trust-domain \"spiffe://example.org\""),
        ] {
            let e = parse(args).identity().unwrap_err().to_string();
            assert!(e.contains(names), "{args:?}: {e}");
        }
        let e = Config::try_parse_from(["aether-worker", "--run-dir=/r", "--state-dir=/s", "--health-dir=/h", "--mtls=STRICT"]).unwrap_err().to_string();
        assert!(e.contains("STRICT"), "{e}");
    }
}
