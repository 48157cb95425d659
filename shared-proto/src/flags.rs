//! The agent's settings that the worker acts on and the supervisor only passes on: one
//! definition for both processes. An operator sets them on `aether-supervisor`, as a flag
//! or through the environment variable beside it; the supervisor hands them to its worker
//! as flags ([`AgentFlags::worker_args`]), and the worker, whose environment is cleared,
//! parses them from its command line with the variables ignored ([`without_env`]).
//! The supervisor opens none of these files or sockets and never looks inside them.

use std::path::PathBuf;

pub use crate::duration::parse_duration;

#[derive(Debug, Clone, clap::Args)]
pub struct AgentFlags {
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
    /// uid must be able to read it.
    #[arg(long, env = "AETHER_REGISTRAR_TOKEN_FILE", requires = "registrar")]
    pub registrar_token_file: Option<PathBuf>,
    /// CA certificates (PEM) to check a TCP registrar's serving certificate against,
    /// with the address's host as its name: the worker then speaks TLS to the registrar
    /// (one serving with --tls-cert). Read again at each connect, so a rotated bundle is
    /// picked up. With workload identity the worker also presents the agent's SVID, once
    /// it has one, as its client certificate. The worker's uid must be able to read it.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_CA",
        value_name = "FILE",
        requires = "registrar"
    )]
    pub registrar_ca: Option<PathBuf>,
    /// The registrar's SPIFFE ID, e.g. spiffe://example.org/ns/aether-system/sa/aether-registrar
    /// [default: none]. With workload identity (--spiffe-endpoint) the worker then speaks
    /// mutual TLS to a TCP registrar: it presents the agent's own SVID as its client
    /// certificate (a new connection, after a rotation, presents the new one) and checks
    /// that the registrar's certificate chains to the trust bundle from the Workload API
    /// and carries exactly this SPIFFE ID (no host name is checked). Instead of
    /// --registrar-ca; a --registrar-token-file token is still sent beside the SVID.
    #[arg(
        long,
        env = "AETHER_REGISTRAR_SPIFFE_ID",
        value_name = "SPIFFE-ID",
        requires_all = ["registrar", "spiffe_endpoint"],
        conflicts_with = "registrar_ca"
    )]
    pub registrar_spiffe_id: Option<String>,
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
    /// A file in the proxy's filesystem (an absolute path, or /dev/stdout) where every
    /// pod's inbound listener logs each connection [default: none, no access log]: one
    /// JSON line when the connection to the pod is made and one when it ends, with the
    /// peer's SPIFFE ID (`peer_uri_san`, empty in plaintext), its TLS version, its address,
    /// the upstream address the proxy used and the pod's address. An audit of who reached
    /// each pod with which identity. The proxy opens it; the agent never does.
    #[arg(long, env = "AETHER_INBOUND_ACCESS_LOG", value_name = "PATH", value_parser = parse_access_log)]
    pub inbound_access_log: Option<String>,
    /// Capture projection override as JSON, reloaded on change.
    #[arg(long, env = "AETHER_CAPTURE_FILE")]
    pub capture_file: Option<PathBuf>,
    /// How long a pod record must stay absent from the API server's complete list of this
    /// node's pods (with no CNI DEL) before the owner removes it: `60s`, `1500ms`, `2m`.
    #[arg(long, env = "AETHER_STALE_RECORD_GRACE", default_value = "60s", value_parser = parse_duration)]
    pub stale_record_grace: std::time::Duration,
    /// SPIFFE Workload API socket, `unix:///path` [default: no workload identity]. Turns
    /// workload identity on: the worker fetches the agent's own SVID and the trust bundle
    /// there (the worker user must be able to connect) and serves them to the proxy over
    /// SDS. Needs --trust-domain. A standby is ready only once it holds its SVID.
    #[arg(
        long,
        env = "SPIFFE_ENDPOINT_SOCKET",
        value_name = "unix:///PATH",
        requires = "trust_domain"
    )]
    pub spiffe_endpoint: Option<String>,
    /// The SPIRE agent's admin socket, `unix:///path`, serving SPIRE's Delegated Identity
    /// API [default: none, pods get no SVID of their own]. The worker subscribes each
    /// local pod's SVID there (selectors k8s:ns, k8s:pod-name, k8s:pod-uid); the agent's
    /// SPIFFE ID must be among the SPIRE agent's authorized_delegates. Needs
    /// --spiffe-endpoint.
    #[arg(
        long,
        env = "AETHER_SPIFFE_BROKER_ENDPOINT",
        value_name = "unix:///PATH",
        requires = "spiffe_endpoint"
    )]
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
    /// The node address where the pods' QUIC twins listen, `HOST:PORT` (UDP) [default:
    /// none, no twin]. With pods' SVIDs (--spiffe-broker-endpoint) the proxy binds this one
    /// UDP port, and every local pod holding its SVID gets a twin there: HTTP/3 with the
    /// pod's SVID, chosen by the server name `<pod uid>.twin.aether`, a client SVID of the
    /// trust domain required, forwarded over HTTP to the pod's inbound target. A pod opts
    /// out with `AETHER_QUIC_TWIN=off` in its CNI arguments.
    #[arg(
        long,
        env = "AETHER_QUIC_TWIN_ADDR",
        value_name = "HOST:PORT",
        requires = "spiffe_broker_endpoint",
        value_parser = parse_twin_addr
    )]
    pub quic_twin_addr: Option<std::net::SocketAddr>,
    /// At most this many QUIC twins on the node (about 57 KiB of proxy memory each); the
    /// pods past it (in uid order) get none, counted in
    /// aether_quic_twins_refused and named in the log.
    #[arg(long, env = "AETHER_QUIC_TWIN_MAX", default_value_t = 256)]
    pub quic_twin_max: usize,
    /// The lenient client-certificate gate: with pods' SVIDs, a lone agent's first serve
    /// and a standby's readiness wait at most this long for the SVIDs of the pods it holds
    /// records for, then proceed; a pod still without one has no QUIC twin until it comes,
    /// and `/ready` names it under `pod-certificates`. `0s` turns the wait off.
    #[arg(long, env = "AETHER_POD_CERTIFICATE_GATE", default_value = "3s", value_parser = parse_duration)]
    pub pod_certificate_gate: std::time::Duration,
    /// The QUIC pair fetch window: the owner advertises a pod's twin to the registry
    /// (SetQuicPairs, and `<state-dir>/quic-pairs.json`) once the twin has been served
    /// this long by this agent. It restarts at every takeover (it measures how long this
    /// agent has served; a standby serves nothing), and the pairs the previous owner
    /// advertised stay advertised while it runs. 15 s is Envoy's default
    /// `initial_fetch_timeout`, the longest the proxy waits for a twin's SDS secret before
    /// it gives up on it: a twin served that long has been taken by the proxy, not just
    /// sent to it. `0s` advertises a twin as soon as it is served.
    #[arg(long, env = "AETHER_QUIC_PAIR_WINDOW", default_value = "15s", value_parser = parse_duration)]
    pub quic_pair_window: std::time::Duration,
    /// CNI conf folder whose conflist the owner re-asserts [default: none]: at takeover
    /// and every 5 s the supervisor runs `--cni-plugin-bin chain`, which appends the
    /// aether-cni entry to the runtime's conflist when it is missing. The worker only
    /// reports on `/ready` whether the file chains it.
    #[arg(long, env = "AETHER_CNI_CONF_DIR")]
    pub cni_conf_dir: Option<PathBuf>,
    /// Prometheus metrics address, bound by the owner's worker only; "off" disables them.
    #[arg(long, env = "AETHER_METRICS_ADDR", default_value = "127.0.0.1:15090", value_parser = parse_metrics)]
    pub metrics_addr: MetricsAddr,
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
    #[arg(
        long,
        env = "KUBERNETES_SERVICE_PORT",
        hide = true,
        default_value_t = 443
    )]
    pub kubernetes_service_port: u16,
    /// Log format of both processes: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Whether the ADS server takes the xDS relay's digest resume (shared_proto::resume);
    /// false answers the relay as an owner without it does (tests of version skew).
    #[arg(
        long,
        env = "AETHER_XDS_DIGEST_RESUME",
        hide = true,
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub xds_digest_resume: bool,
}

/// How the worker reaches the Kubernetes API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeAccess {
    Kubeconfig(PathBuf),
    /// `HOST:PORT` of the API server (an IPv6 host in brackets), with the pod's service
    /// account.
    InCluster(String),
    None,
}

impl AgentFlags {
    /// A kubeconfig wins over the in-cluster environment.
    pub fn kube_access(&self) -> KubeAccess {
        match (&self.kubeconfig, &self.kubernetes_service_host) {
            (Some(k), _) => KubeAccess::Kubeconfig(k.clone()),
            (None, Some(h)) if !h.is_empty() => {
                let host = if h.contains(':') && !h.starts_with('[') {
                    format!("[{h}]")
                } else {
                    h.clone()
                };
                KubeAccess::InCluster(format!("{host}:{}", self.kubernetes_service_port))
            }
            (None, _) => KubeAccess::None,
        }
    }

    /// The same settings as the worker's flags.
    pub fn worker_args(&self) -> Vec<String> {
        let path = |p: &PathBuf| path_arg(p);
        let mut a = vec![
            format!("--cluster={}", self.cluster),
            format!("--registry-max-bytes={}", self.registry_max_bytes),
            format!(
                "--stale-record-grace={}ms",
                self.stale_record_grace.as_millis()
            ),
            format!("--mtls={}", self.mtls),
            format!("--metrics-addr={}", self.metrics_addr),
            format!("--log-format={}", self.log_format),
            format!("--kubernetes-service-port={}", self.kubernetes_service_port),
            format!("--quic-twin-max={}", self.quic_twin_max),
            format!(
                "--pod-certificate-gate={}ms",
                self.pod_certificate_gate.as_millis()
            ),
            format!("--quic-pair-window={}ms", self.quic_pair_window.as_millis()),
        ];
        let optional = [
            ("registrar", self.registrar.clone()),
            (
                "registrar-token-file",
                self.registrar_token_file.as_ref().map(path),
            ),
            ("registrar-ca", self.registrar_ca.as_ref().map(path)),
            ("registrar-spiffe-id", self.registrar_spiffe_id.clone()),
            ("registry-file", self.registry_file.as_ref().map(path)),
            ("capture-file", self.capture_file.as_ref().map(path)),
            ("inbound-access-log", self.inbound_access_log.clone()),
            ("spiffe-endpoint", self.spiffe_endpoint.clone()),
            (
                "spiffe-broker-endpoint",
                self.spiffe_broker_endpoint.clone(),
            ),
            ("trust-domain", self.trust_domain.clone()),
            ("quic-twin-addr", self.quic_twin_addr.map(|a| a.to_string())),
            ("cni-conf-dir", self.cni_conf_dir.as_ref().map(path)),
            ("kubeconfig", self.kubeconfig.as_ref().map(path)),
            (
                "kubernetes-service-host",
                self.kubernetes_service_host.clone(),
            ),
        ];
        a.extend(
            optional
                .into_iter()
                .filter_map(|(flag, v)| v.map(|v| format!("--{flag}={v}"))),
        );
        if self.on_demand_clusters {
            a.push("--on-demand-clusters".into());
        }
        if !self.xds_digest_resume {
            a.push("--xds-digest-resume=false".into());
        }
        a
    }
}

/// A path as a command-line value (a non-UTF-8 byte is replaced).
pub fn path_arg(p: &std::path::Path) -> String {
    String::from_utf8_lossy(p.as_os_str().as_encoded_bytes()).into_owned()
}

/// A command whose arguments read no environment variable: the worker's.
pub fn without_env(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| a.env(None::<&'static str>))
}

/// An access log path: absolute (the proxy resolves it in its own filesystem, not the
/// agent's), with no control character.
fn parse_access_log(s: &str) -> Result<String, String> {
    if !s.starts_with('/') {
        return Err(format!(
            "inbound access log {s:?}: an absolute path in the proxy's filesystem, such as /dev/stdout"
        ));
    }
    if s.chars().any(char::is_control) {
        return Err(format!(
            "inbound access log {s:?}: a control character in the path"
        ));
    }
    Ok(s.to_string())
}

/// The twins' address: an IP and a port other than 0 (the proxy binds it, and clients are
/// told it).
fn parse_twin_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let a: std::net::SocketAddr = s
        .parse()
        .map_err(|e| format!("QUIC twin address {s:?}: {e} (expected IP:PORT)"))?;
    if a.port() == 0 {
        return Err(format!("QUIC twin address {s:?}: port 0"));
    }
    Ok(a)
}

/// The metrics address, or none ("off").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsAddr(pub Option<std::net::SocketAddr>);

impl std::fmt::Display for MetricsAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(a) => write!(f, "{a}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_metrics(s: &str) -> Result<MetricsAddr, String> {
    match s {
        "off" => Ok(MetricsAddr(None)),
        _ => s
            .parse()
            .map(|a| MetricsAddr(Some(a)))
            .map_err(|e| format!("metrics address {s:?}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use clap::{FromArgMatches, Parser};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        flags: AgentFlags,
    }

    fn parse(args: &[&str]) -> Result<AgentFlags, String> {
        let cmd = without_env(<Cli as clap::CommandFactory>::command());
        let m = cmd
            .try_get_matches_from([&["agent"], args].concat())
            .map_err(|e| e.to_string())?;
        Ok(Cli::from_arg_matches(&m).map_err(|e| e.to_string())?.flags)
    }

    #[test]
    fn an_inbound_access_log_must_be_an_absolute_path() {
        let e = parse(&["--inbound-access-log=access.log"]).unwrap_err();
        assert!(
            e.contains("\"access.log\"") && e.contains("absolute path"),
            "{e}"
        );
        assert_eq!(
            parse(&["--inbound-access-log=/var/log/aether/in.log"])
                .unwrap()
                .inbound_access_log
                .as_deref(),
            Some("/var/log/aether/in.log")
        );
    }

    /// What the supervisor passes on, the worker parses back to the same settings.
    #[test]
    fn the_worker_reads_back_what_the_supervisor_passes_on() {
        let all = [
            "--registrar=unix:///r.sock",
            "--cluster=east",
            "--registrar-token-file=/t",
            "--registrar-ca=/ca.pem",
            "--registry-max-bytes=99",
            "--capture-file=/c.json",
            "--inbound-access-log=/dev/stdout",
            "--on-demand-clusters",
            "--stale-record-grace=1.5s",
            "--spiffe-endpoint=unix:///a.sock",
            "--spiffe-broker-endpoint=unix:///b.sock",
            "--trust-domain=example.org",
            "--mtls=strict",
            "--cni-conf-dir=/etc/cni/net.d",
            "--metrics-addr=off",
            "--log-format=json",
            "--kubeconfig=/k",
            "--kubernetes-service-host=fd00::1",
            "--kubernetes-service-port=6443",
            "--quic-twin-addr=10.0.0.5:15443",
            "--quic-twin-max=7",
            "--pod-certificate-gate=250ms",
            "--quic-pair-window=2500ms",
        ];
        for args in [
            &all[..],
            &[],
            &["--registry-file=/reg.json", "--stale-record-grace=2m"],
            &[
                "--registrar=10.0.0.1:7800",
                "--registrar-spiffe-id=spiffe://example.org/registrar",
                "--spiffe-endpoint=unix:///a.sock",
                "--trust-domain=example.org",
            ],
        ] {
            let given = parse(args).unwrap();
            let passed = given.worker_args();
            let back = parse(&passed.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
            assert_eq!(
                format!("{back:?}"),
                format!("{given:?}"),
                "{args:?} passed on as {passed:?}"
            );
        }
        assert_eq!(
            parse(&["--stale-record-grace=1.5s"])
                .unwrap()
                .stale_record_grace,
            std::time::Duration::from_millis(1500)
        );
    }

    #[test]
    fn bad_values_and_missing_companions_are_named() {
        for (args, names) in [
            (&["--stale-record-grace=1h"][..], "\"1h\""),
            (&["--metrics-addr=nope"], "\"nope\""),
            (&["--mtls=STRICT"], "STRICT"),
            (&["--spiffe-endpoint=unix:///a.sock"], "--trust-domain"),
            (
                &[
                    "--spiffe-broker-endpoint=unix:///b.sock",
                    "--trust-domain=t",
                ],
                "--spiffe-endpoint",
            ),
            (&["--registrar-token-file=/t"], "--registrar"),
            (
                &["--quic-twin-addr=10.0.0.5:15443"],
                "--spiffe-broker-endpoint",
            ),
            (
                &[
                    "--quic-twin-addr=10.0.0.5:0",
                    "--spiffe-broker-endpoint=unix:///b.sock",
                    "--spiffe-endpoint=unix:///a.sock",
                    "--trust-domain=t",
                ],
                "\"10.0.0.5:0\"",
            ),
            (&["--pod-certificate-gate=3"], "\"3\""),
            (&["--registrar-ca=/ca.pem"], "--registrar"),
            (
                &["--registrar=a:1", "--registrar-spiffe-id=spiffe://t/r"],
                "--spiffe-endpoint",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.contains(names), "{args:?}: {e}");
        }
    }

    #[test]
    fn kube_access_prefers_a_kubeconfig_then_the_in_cluster_environment() {
        let access = |args: &[&str]| parse(args).unwrap().kube_access();
        assert_eq!(
            access(&[
                "--kubernetes-service-host=10.96.0.1",
                "--kubernetes-service-port=6443"
            ]),
            KubeAccess::InCluster("10.96.0.1:6443".into())
        );
        assert_eq!(
            access(&["--kubernetes-service-host=fd00::1"]),
            KubeAccess::InCluster("[fd00::1]:443".into())
        );
        assert_eq!(
            access(&["--kubernetes-service-host=10.96.0.1", "--kubeconfig=/k"]),
            KubeAccess::Kubeconfig("/k".into())
        );
        assert_eq!(access(&["--kubernetes-service-host="]), KubeAccess::None);
        assert_eq!(access(&[]), KubeAccess::None);
    }

    /// The worker's command line alone counts: a variable set in its environment does not.
    #[test]
    fn the_worker_reads_no_environment_variable() {
        let cmd = without_env(<Cli as clap::CommandFactory>::command());
        assert!(cmd.get_arguments().all(|a| a.get_env().is_none()));
        let with_env = <Cli as clap::CommandFactory>::command();
        assert!(
            with_env
                .get_arguments()
                .any(|a| a.get_env() == Some(std::ffi::OsStr::new("AETHER_REGISTRAR")))
        );
    }
}
