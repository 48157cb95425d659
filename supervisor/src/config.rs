//! Command-line flags of `aether-supervisor`, each also read from its environment
//! variable. Parsed once at start; nothing reads the environment later.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "aether-supervisor",
    version,
    about = "Privileged half of the Aether node agent",
    long_about = "Holds the node lock (<run-dir>/agent.lock), owns the node sockets \
(xds.sock, cni.sock) and runs the unprivileged aether-worker with no capabilities.\n\n\
A second supervisor started beside a running one is a warm standby: its worker builds \
everything, it binds nothing, and it takes the node over the instant the first one's \
generation is gone. With only --run-dir, --state-dir and --health-dir pointed at writable \
folders it runs as an ordinary user: embedded registry, no identity, no Kubernetes.\n\n\
With --keep-sockets it is instead the node's socket keeper (see that flag)."
)]
pub struct Config {
    /// Folder of agent.lock, xds.sock, cni.sock and handoff.sock, shared by generations.
    #[arg(long, env = "AETHER_RUN_DIR", default_value = "/run/aether")]
    pub run_dir: PathBuf,
    /// Folder of the pod records and persisted state, shared by generations.
    #[arg(long, env = "AETHER_STATE_DIR", default_value = "/var/lib/aether")]
    pub state_dir: PathBuf,
    /// Folder of the worker's agent-health.sock; private to this generation (the pod's /tmp).
    #[arg(long, env = "AETHER_HEALTH_DIR", default_value = "/tmp")]
    pub health_dir: PathBuf,
    /// Worker executable [default: aether-worker beside this binary].
    #[arg(long, env = "AETHER_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// uid:gid the worker runs as when the supervisor runs as root; uid 0 and gid 0 are
    /// refused.
    #[arg(long, env = "AETHER_WORKER_USER", default_value = "65532:65532", value_parser = parse_user)]
    pub worker_user: (u32, u32),
    /// Node name [default: the hostname].
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Instance key of this agent [default: aether-agent-<pid>].
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Registrar addresses, comma-separated, each `unix:///path` or `host:port` [default:
    /// none, the embedded local registry]. The worker watches the registry there (keyed by
    /// cluster, node and --pod-name), and a standby is not ready until it has loaded it.
    /// Exclusive with --registry-file.
    #[arg(long, env = "AETHER_REGISTRAR")]
    pub registrar: Option<String>,
    /// The mesh cluster this node belongs to, as the registrar keys its watch streams.
    #[arg(long, env = "AETHER_CLUSTER", default_value = "default")]
    pub cluster: String,
    /// A file holding the bearer token the worker presents to the registrar (in a
    /// cluster, the pod's projected service-account token with the audience
    /// aether-registrar); read at each call, so a rotated token is picked up. The worker's
    /// uid must be able to read it
    #[arg(long, env = "AETHER_REGISTRAR_TOKEN_FILE", requires = "registrar")]
    pub registrar_token_file: Option<PathBuf>,
    /// Embedded registry: services and endpoints as JSON, reloaded on change.
    #[arg(long, env = "AETHER_REGISTRY_FILE")]
    pub registry_file: Option<PathBuf>,
    /// Largest registry file the worker reads, in bytes; a bigger one is rejected with an
    /// error naming both sizes, and the last good registry stays. 10,000 services with 10
    /// endpoints each take about 7 MB.
    #[arg(long, env = "AETHER_REGISTRY_MAX_BYTES", default_value_t = 64 << 20)]
    pub registry_max_bytes: u64,
    /// Serve the proxy only the mesh clusters its pods have called (the observed
    /// upstreams, kept in the state folder across rolls) and let it fetch any other on
    /// its first request to it (Envoy's on-demand CDS; needs DELTA_GRPC ADS). For large
    /// meshes: Envoy's memory then follows what the node uses, not the mesh's size.
    #[arg(long, env = "AETHER_ON_DEMAND_CLUSTERS")]
    pub on_demand_clusters: bool,
    /// Capture projection override as JSON, reloaded on change.
    #[arg(long, env = "AETHER_CAPTURE_FILE")]
    pub capture_file: Option<PathBuf>,
    /// Kubernetes API access from this kubeconfig (its current context) [default: the
    /// pod's service account when KUBERNETES_SERVICE_HOST is set, else no Kubernetes].
    /// With access, the worker watches this node's pods and node object; the owner marks
    /// deleting pods' records Terminating, collects stale records and removes the node's
    /// startup taint. The worker must be able to read the file (it runs as --worker-user).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Set by the kubelet in every pod: the API server's address for in-cluster access.
    #[arg(long, env = "KUBERNETES_SERVICE_HOST", hide = true)]
    pub kubernetes_service_host: Option<String>,
    #[arg(long, env = "KUBERNETES_SERVICE_PORT", hide = true, default_value_t = 443)]
    pub kubernetes_service_port: u16,
    /// How long a pod record must stay absent from the API server's complete list of this
    /// node's pods (with no CNI DEL) before the owner removes it: `60s`, `1500ms`, `2m`.
    #[arg(long, env = "AETHER_STALE_RECORD_GRACE", default_value = "60s", value_parser = parse_grace)]
    pub stale_record_grace: String,
    /// SPIFFE Workload API socket, `unix:///path` [default: no workload identity]. Turns
    /// workload identity on: the worker fetches the agent's own SVID and the trust bundle
    /// there (the worker user must be able to connect) and serves them to the proxy over
    /// SDS. Needs --trust-domain. A standby is ready only once it holds its SVID.
    #[arg(long, env = "SPIFFE_ENDPOINT_SOCKET", value_name = "unix:///PATH", requires = "trust_domain")]
    pub spiffe_endpoint: Option<String>,
    /// The SPIRE agent's admin socket, `unix:///path`, serving SPIRE's Delegated Identity
    /// API [default: none, pods get no SVID of their own]. The worker subscribes each
    /// local pod's SVID there (selectors k8s:ns, k8s:pod-name, k8s:pod-uid); the agent's
    /// SPIFFE ID must be among the SPIRE agent's authorized_delegates. Needs
    /// --spiffe-endpoint.
    #[arg(long, env = "AETHER_SPIFFE_BROKER_ENDPOINT", value_name = "unix:///PATH", requires = "spiffe_endpoint")]
    pub spiffe_broker_endpoint: Option<String>,
    /// The mesh's SPIFFE trust domain, a bare name such as example.org. The agent's and
    /// the pods' SVIDs must be in it, and peers must present a SPIFFE ID in it. Required
    /// with --spiffe-endpoint.
    #[arg(long, env = "AETHER_TRUST_DOMAIN", value_name = "NAME")]
    pub trust_domain: Option<String>,
    /// Pods' inbound mTLS with workload identity: permissive (mTLS and plaintext on the
    /// same port) or strict (mTLS only; a pod without its SVID has no inbound listener
    /// until the SVID comes).
    #[arg(long, env = "AETHER_MTLS", value_name = "MODE", default_value = "permissive", value_parser = ["permissive", "strict"])]
    pub mtls: String,
    /// CNI conf folder whose conflist the owner re-asserts [default: none]: at takeover
    /// and every 5 s it runs `--cni-plugin-bin chain`, which appends the aether-cni entry
    /// to the runtime's conflist when it is missing.
    #[arg(long, env = "AETHER_CNI_CONF_DIR")]
    pub cni_conf_dir: Option<PathBuf>,
    /// The aether-cni executable that re-asserts the conflist [default: aether-cni beside
    /// this binary]. Opened at start and run from that descriptor.
    #[arg(long, env = "AETHER_CNI_PLUGIN_BIN", requires = "cni_conf_dir")]
    pub cni_plugin_bin: Option<PathBuf>,
    /// Prometheus metrics address, bound by the owner only; "off" disables them.
    #[arg(long, env = "AETHER_METRICS_ADDR", default_value = "127.0.0.1:15090", value_parser = parse_metrics)]
    pub metrics_addr: MetricsAddr,
    /// Log format of both processes: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Run as the node's socket keeper instead of an agent: hold duplicates of the
    /// owner's listening sockets (fetched over handoff.sock, refreshed every 2 s) and
    /// offer them on <run-dir>/keeper.sock to a new agent that finds no owner to take them
    /// from. Run it outside the agent's pod, beside it: across a delete-then-create roll
    /// the proxy's reconnect then waits in the kept socket's backlog instead of being
    /// refused. Takes no lock, starts no worker, needs no capability; only --run-dir and
    /// --log-format apply.
    #[arg(long, env = "AETHER_KEEP_SOCKETS")]
    pub keep_sockets: bool,
}

fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s.split_once(':').ok_or_else(|| format!("worker user {s:?} is not uid:gid"))?;
    let uid = u.parse().map_err(|_| format!("worker user {s:?}: uid {u:?} is not a number"))?;
    let gid = g.parse().map_err(|_| format!("worker user {s:?}: gid {g:?} is not a number"))?;
    if uid == 0 {
        return Err(format!("worker user {s:?}: the worker must not run as uid 0"));
    }
    if gid == 0 {
        return Err(format!("worker user {s:?}: the worker must not run as gid 0 (root's group owns files it must not write)"));
    }
    Ok((uid, gid))
}

/// A duration as the worker reads it (`<number><unit>`, unit ms, s or m), checked here so
/// that a bad value fails at start instead of in every respawned worker.
fn parse_grace(s: &str) -> Result<String, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let ok = number.parse::<f64>().is_ok_and(|n| n.is_finite()) && matches!(unit, "ms" | "s" | "m");
    if ok { Ok(s.to_string()) } else { Err(format!("duration {s:?}: expected a number and a unit (ms, s, m), as in 60s")) }
}

/// How the worker reaches the Kubernetes API, as the flags and the environment say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeAccess {
    Kubeconfig(PathBuf),
    /// `HOST:PORT` of the API server (an IPv6 host in brackets).
    InCluster(String),
    None,
}

impl Config {
    /// A kubeconfig wins over the in-cluster environment.
    pub fn kube_access(&self) -> KubeAccess {
        match (&self.kubeconfig, &self.kubernetes_service_host) {
            (Some(k), _) => KubeAccess::Kubeconfig(k.clone()),
            (None, Some(h)) if !h.is_empty() => {
                let host = if h.contains(':') && !h.starts_with('[') { format!("[{h}]") } else { h.clone() };
                KubeAccess::InCluster(format!("{host}:{}", self.kubernetes_service_port))
            }
            (None, _) => KubeAccess::None,
        }
    }
}

/// A metrics address, or none ("off").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsAddr(pub Option<SocketAddr>);

impl std::fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(a) => write!(f, "{a}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_metrics(s: &str) -> Result<MetricsAddr, String> {
    if s == "off" {
        return Ok(MetricsAddr(None));
    }
    s.parse().map(|a| MetricsAddr(Some(a))).map_err(|e| format!("metrics address {s:?}: {e}"))
}

impl Config {
    /// The worker's identity flags, passed on as given (the worker checks them and opens
    /// the sockets; the supervisor never does). None without --spiffe-endpoint.
    pub fn identity_worker_args(&self) -> Vec<String> {
        let Some(endpoint) = &self.spiffe_endpoint else { return Vec::new() };
        let mut a = vec![format!("--spiffe-endpoint={endpoint}"), format!("--mtls={}", self.mtls)];
        if let Some(td) = &self.trust_domain {
            a.push(format!("--trust-domain={td}"));
        }
        if let Some(b) = &self.spiffe_broker_endpoint {
            a.push(format!("--spiffe-broker-endpoint={b}"));
        }
        a
    }

    pub fn lock_path(&self) -> PathBuf {
        self.run_dir.join("agent.lock")
    }
    pub fn xds_path(&self) -> PathBuf {
        self.run_dir.join("xds.sock")
    }
    pub fn cni_path(&self) -> PathBuf {
        self.run_dir.join("cni.sock")
    }
    pub fn handoff_path(&self) -> PathBuf {
        self.run_dir.join("handoff.sock")
    }
    pub fn keeper_path(&self) -> PathBuf {
        self.run_dir.join("keeper.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_user_parsing() {
        assert_eq!(parse_user("65532:65532"), Ok((65532, 65532)));
        for bad in ["65532", "a:1", "1:b", "0:0", "65532:0", ""] {
            let err = parse_user(bad).expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn kube_access_prefers_a_kubeconfig_then_the_in_cluster_environment() {
        // Every field set on the command line, which wins over whatever environment the
        // test runs in (a CI job inside a pod has KUBERNETES_SERVICE_HOST).
        let parse = |args: &[&str]| {
            let mut c = Config::try_parse_from([&["aether-supervisor"], args].concat()).unwrap();
            if !args.iter().any(|a| a.starts_with("--kubernetes-service-port")) {
                c.kubernetes_service_port = 443;
            }
            if !args.iter().any(|a| a.starts_with("--kubeconfig")) {
                c.kubeconfig = None;
            }
            if !args.iter().any(|a| a.starts_with("--kubernetes-service-host")) {
                c.kubernetes_service_host = None;
            }
            c
        };
        let c = parse(&["--kubernetes-service-host=10.96.0.1", "--kubernetes-service-port=6443"]);
        assert_eq!(c.kube_access(), KubeAccess::InCluster("10.96.0.1:6443".into()));
        let c = parse(&["--kubernetes-service-host=fd00::1"]);
        assert_eq!(c.kube_access(), KubeAccess::InCluster("[fd00::1]:443".into()));
        let c = parse(&["--kubernetes-service-host=10.96.0.1", "--kubeconfig=/k"]);
        assert_eq!(c.kube_access(), KubeAccess::Kubeconfig("/k".into()));
        assert_eq!(parse(&[]).kube_access(), KubeAccess::None);
        assert_eq!(parse(&["--stale-record-grace=1s"]).stale_record_grace, "1s");
        let e = Config::try_parse_from(["aether-supervisor", "--stale-record-grace=1h"]).unwrap_err().to_string();
        assert!(e.contains("\"1h\""), "{e}");
    }

    #[test]
    fn identity_flags_pass_to_the_worker_and_need_each_other() {
        let parse = |args: &[&str]| Config::try_parse_from([&["aether-supervisor"], args].concat());
        // The environment of the test run may set these; the command line wins.
        let c = parse(&["--spiffe-endpoint=unix:///run/spire/agent.sock", "--trust-domain=example.org", "--mtls=strict", "--spiffe-broker-endpoint=unix:///run/spire/admin.sock"]).unwrap();
        assert_eq!(
            c.identity_worker_args(),
            [
                "--spiffe-endpoint=unix:///run/spire/agent.sock",
                "--mtls=strict",
                "--trust-domain=example.org",
                "--spiffe-broker-endpoint=unix:///run/spire/admin.sock"
            ]
        );
        let c = parse(&["--spiffe-endpoint=unix:///a.sock", "--trust-domain=t"]).unwrap();
        assert_eq!(c.identity_worker_args(), ["--spiffe-endpoint=unix:///a.sock", "--mtls=permissive", "--trust-domain=t"]);
        let e = parse(&["--spiffe-endpoint=unix:///a.sock"]).unwrap_err().to_string();
        assert!(e.contains("--trust-domain"), "{e}");
        let e = parse(&["--spiffe-broker-endpoint=unix:///b.sock", "--trust-domain=t"]).unwrap_err().to_string();
        assert!(e.contains("--spiffe-endpoint"), "{e}");
        let e = parse(&["--mtls=STRICT"]).unwrap_err().to_string();
        assert!(e.contains("STRICT"), "{e}");
    }

    #[test]
    fn metrics_off() {
        assert_eq!(parse_metrics("off"), Ok(MetricsAddr(None)));
        assert!(parse_metrics("nope").is_err());
    }
}
