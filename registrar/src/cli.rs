//! The command line: `serve`, and the operator's `apply`, `delete` and `dump`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::keys::DEFAULT_PREFIX;
use crate::listen::ListenAddr;

#[derive(Debug, Parser)]
#[command(
    name = "aether-registrar",
    version,
    about = "The reference registrar of the Aether mesh: serves the registry API (aether.registry.v1) to node agents, storing services, endpoints, drain marks and QUIC pairs in etcd v3",
    long_about = "The reference registrar of the Aether mesh: serves the registry API (aether.registry.v1) to node \
agents, storing services, endpoints, drain marks and QUIC pairs in etcd v3.\n\n\
Watch streams follow etcd watches and carry etcd revisions, so any number of replicas can serve one etcd, and a \
client resumes from its last revision on any of them.\n\n\
Exits 0 on success, 1 on an error (its message names the flag, file, field or value at fault), 2 on bad usage."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the registry API
    Serve(Box<ServeArgs>),
    /// Upsert the services of a registry file (the agent's --registry-file schema): ports,
    /// VIP and endpoints; endpoints absent from the file are removed, drain marks are kept
    Apply {
        #[command(flatten)]
        client: ClientArgs,
        /// The registry file
        #[arg(long, value_name = "FILE")]
        file: PathBuf,
    },
    /// Remove a service with its endpoints and drain marks
    Delete {
        #[command(flatten)]
        client: ClientArgs,
        /// The service, as NAMESPACE/NAME
        #[arg(long, value_name = "NAMESPACE/NAME")]
        service: String,
    },
    /// Print the registry as sorted JSON: services in the registry file's schema, each
    /// endpoint with its effective state (a drain mark overrides healthy) and its QUIC
    /// twin where it has one (quic, quic_sni), then the drain marks. Two equal registries
    /// print the same bytes
    Dump {
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// etcd client URLs, comma-separated (https:// with --etcd-ca)
    #[arg(
        long,
        env = "AETHER_REGISTRAR_ETCD",
        value_name = "URL[,URL...]",
        value_delimiter = ',',
        required = true
    )]
    pub etcd: Vec<String>,

    /// The key prefix of the registry in etcd
    #[arg(long, env = "AETHER_REGISTRAR_ETCD_PREFIX", value_name = "PREFIX", default_value = DEFAULT_PREFIX)]
    pub etcd_prefix: String,

    /// CA certificate (PEM) to verify etcd's serving certificate; turns on TLS
    #[arg(long, env = "AETHER_REGISTRAR_ETCD_CA", value_name = "FILE")]
    pub etcd_ca: Option<PathBuf>,

    /// Client certificate (PEM) for etcd, with --etcd-key
    #[arg(
        long,
        env = "AETHER_REGISTRAR_ETCD_CERT",
        value_name = "FILE",
        requires = "etcd_key"
    )]
    pub etcd_cert: Option<PathBuf>,

    /// Client key (PEM) for etcd, with --etcd-cert
    #[arg(
        long,
        env = "AETHER_REGISTRAR_ETCD_KEY",
        value_name = "FILE",
        requires = "etcd_cert"
    )]
    pub etcd_key: Option<PathBuf>,

    /// Where to serve: unix:///path (callers identified by their uid, see --agent-uid and
    /// --operator-uid; unchanged by mutual TLS) or host:port (TCP, with mutual TLS,
    /// --token-review or --insecure-listen; TLS with --tls-cert or --spiffe-endpoint)
    #[arg(long, env = "AETHER_REGISTRAR_LISTEN", value_name = "ADDR")]
    pub listen: ListenAddr,

    /// Serve TLS on a TCP --listen with this certificate chain (PEM, the leaf first), with
    /// --tls-key. Read again at a handshake after the file changed, so a renewed
    /// certificate is served without a restart. TLS authenticates the registrar to its
    /// callers (agents check it with --registrar-ca) and keeps their tokens off the wire;
    /// the callers are still authenticated by --token-review
    #[arg(
        long,
        env = "AETHER_REGISTRAR_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// The private key (PEM) of --tls-cert
    #[arg(
        long,
        env = "AETHER_REGISTRAR_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// Mutual TLS: ask callers for a client certificate, an X.509-SVID whose chain leads to
    /// a CA certificate in this PEM file (a SPIFFE trust bundle), with --tls-cert. Read
    /// again at a handshake after the file changed. The SVID must carry exactly one URI
    /// SAN, a SPIFFE ID (in --trust-domain when set); --agent-spiffe-id and
    /// --operator-spiffe-id say what it may do. Without --token-review a caller without a
    /// certificate fails the handshake; with it, such a caller must send a bearer token
    #[arg(
        long,
        env = "AETHER_REGISTRAR_CLIENT_CA_BUNDLE",
        value_name = "FILE",
        requires = "tls_cert",
        conflicts_with = "spiffe_endpoint"
    )]
    pub client_ca_bundle: Option<PathBuf>,

    /// Mutual TLS from a SPIFFE Workload API socket, unix:///PATH (a SPIRE agent's): the
    /// registrar serves its own SVID from there and checks callers' X.509-SVIDs against
    /// the trust bundle of --trust-domain from there, both rotated live (a rotated SVID is
    /// served from the next handshake on). Instead of --tls-cert. The start fails if no
    /// SVID comes within 30 s
    #[arg(
        long,
        env = "SPIFFE_ENDPOINT_SOCKET",
        value_name = "unix:///PATH",
        requires = "trust_domain",
        conflicts_with = "tls_cert"
    )]
    pub spiffe_endpoint: Option<String>,

    /// The SPIFFE trust domain, a bare name such as example.org: callers' SVIDs must be in
    /// it (mutual TLS), and with --spiffe-endpoint so must the registrar's own
    #[arg(long, env = "AETHER_REGISTRAR_TRUST_DOMAIN", value_name = "NAME")]
    pub trust_domain: Option<String>,

    /// An agent's SPIFFE ID (mutual TLS); repeatable. Such a caller may watch and set drain
    /// marks for one node: the node named where the ID holds `{node}` as a path segment
    /// (per-node agent IDs, e.g. spiffe://example.org/aether-agent/{node}), else the node
    /// its bearer token is bound to, which it must then send beside the SVID (e.g.
    /// spiffe://example.org/ns/aether-system/sa/aether-agent with --token-review). A caller
    /// that sends both an SVID and a token must pass with each, and where both name a node
    /// they must name the same one
    #[arg(long = "agent-spiffe-id", value_name = "ID", value_parser = parse_id_pattern)]
    pub agent_spiffe_ids: Vec<crate::authz::IdPattern>,

    /// A SPIFFE ID that may also apply and delete services (mutual TLS); repeatable. If it
    /// also sends a bearer token, the token must allow the call too
    #[arg(long = "operator-spiffe-id", value_name = "ID", value_parser = parse_spiffe_id)]
    pub operator_spiffe_ids: Vec<String>,

    /// Serve Prometheus metrics on this address (`GET /metrics`), e.g. 0.0.0.0:9091: calls
    /// by method and status, open watch streams and why they ended, TLS handshakes, and
    /// whether this replica leads [default: none]
    #[arg(long, env = "AETHER_REGISTRAR_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Serve the kubelet's probes on this address, plain HTTP, e.g. 0.0.0.0:9092: GET /live
    /// answers 200 while the process runs; GET /ready answers 200 once the registry API
    /// listens and etcd answers within 1 s, and 503 with the reason before, while etcd
    /// does not answer, and once SIGTERM came [default: none]
    #[arg(long, env = "AETHER_REGISTRAR_HEALTH_ADDR", value_name = "HOST:PORT")]
    pub health_addr: Option<std::net::SocketAddr>,

    /// Accept plain TCP on --listen. TCP authenticates nobody: every caller may then do
    /// everything, apply and delete included. For tests and trusted networks only
    #[arg(long, env = "AETHER_REGISTRAR_INSECURE_LISTEN")]
    pub insecure_listen: bool,

    /// Serve TCP to callers that present a bearer token, checked with the Kubernetes
    /// TokenReview API (in cluster, or --kubeconfig): the agents' projected
    /// service-account tokens (audience --token-audience), which name their service
    /// account and the node their pod runs on. An agent may then speak for its own node
    /// only. The registrar's service account needs `create` on tokenreviews
    #[arg(
        long,
        env = "AETHER_REGISTRAR_TOKEN_REVIEW",
        conflicts_with = "insecure_listen"
    )]
    pub token_review: bool,

    /// Kubernetes API access, for --token-review, discovery and --taint-guard [default:
    /// the pod's service account, in cluster]
    #[arg(long, env = "KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,

    /// The audience the agents' tokens must be minted for (--token-review)
    #[arg(long, value_name = "AUDIENCE", default_value = "aether-registrar")]
    pub token_audience: String,

    /// A service account, NAMESPACE/NAME, whose tokens are agents': they may watch and set
    /// drain marks for the node their token is bound to (--token-review); repeatable
    #[arg(long = "agent-service-account", value_name = "NAMESPACE/NAME", value_parser = parse_account)]
    pub agent_accounts: Vec<String>,

    /// A user name (as TokenReview reports it) that may also apply and delete services
    /// (--token-review); repeatable
    #[arg(long = "operator-user", value_name = "USER")]
    pub operator_users: Vec<String>,

    /// A uid whose processes may watch and set drain marks over the unix socket (the
    /// agents' uid); repeatable
    #[arg(long = "agent-uid", value_name = "UID")]
    pub agent_uids: Vec<u32>,

    /// A uid whose processes may also apply and delete services over the unix socket;
    /// repeatable [default: the registrar's own uid]
    #[arg(long = "operator-uid", value_name = "UID")]
    pub operator_uids: Vec<u32>,

    /// Mode of the unix socket, octal. Reaching the socket is not being allowed to call:
    /// the caller's uid decides that
    #[arg(long, value_name = "OCTAL", default_value = "666", value_parser = parse_mode)]
    pub socket_mode: u32,

    /// The cluster this registrar serves: a watch naming another cluster is refused
    /// (FAILED_PRECONDITION); one naming none is served
    #[arg(long, env = "AETHER_REGISTRAR_CLUSTER", value_name = "NAME")]
    pub cluster: Option<String>,

    /// Accept loopback endpoint addresses and VIPs (127.0.0.0/8, ::1) from apply and
    /// discovery. Off: they are refused (apply: INVALID_ARGUMENT naming the field;
    /// discovery: the endpoint is left out, logged and counted), since an agent would
    /// send traffic for them to its own node. For tests and single-host setups only.
    /// Link-local (169.254.0.0/16, fe80::/10), multicast, broadcast and unspecified
    /// addresses are refused either way
    #[arg(long, env = "AETHER_REGISTRAR_ALLOW_LOOPBACK_ENDPOINTS")]
    pub allow_loopback_endpoints: bool,

    /// Read etcd for each full view instead of serving it from the view the registrar
    /// keeps from its etcd watch. A full view goes to a watch stream that cannot resume
    /// (an agent's first start or a respawned worker); from etcd it costs a read of every
    /// key (110,000 at 10,000 services) per stream. Off: etcd is read once, at start and
    /// after a broken watch, and the kept view costs the registrar its keys' memory
    #[arg(long, env = "AETHER_REGISTRAR_FULL_VIEWS_FROM_ETCD")]
    pub full_views_from_etcd: bool,

    /// Discover services from Kubernetes: watch Services and EndpointSlices
    /// (discovery.k8s.io/v1) and write them into etcd with the source `kubernetes`. auto:
    /// on when the registrar has Kubernetes API access (--kubeconfig, or a service account
    /// mounted in its pod). Kubernetes wins over files: discovery takes over a service of
    /// the same name that `apply` wrote, and `apply` and `delete` refuse a discovered one.
    /// Only the holder of the Lease (--lease-name) writes
    #[arg(long, env = "AETHER_REGISTRAR_DISCOVERY", value_name = "WHEN", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub discovery: String,

    /// Discover only these namespaces (repeatable) [default: every namespace]
    #[arg(long = "discover-namespace", value_name = "NAMESPACE")]
    pub discover_namespaces: Vec<String>,

    /// Never discover these namespaces (repeatable)
    #[arg(long = "ignore-namespace", value_name = "NAMESPACE")]
    pub ignore_namespaces: Vec<String>,

    /// Re-apply the startup taint aether.io/agent-not-ready:NoSchedule to any node with no
    /// non-terminating Ready agent pod (--agent-selector) for --taint-grace. Needs nodes:
    /// get, list, watch, patch and pods: get, list, watch. Only the Lease holder patches
    #[arg(long, env = "AETHER_REGISTRAR_TAINT_GUARD")]
    pub taint_guard: bool,

    /// Seconds a node may have no Ready agent pod before the guard taints it
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub taint_grace: u64,

    /// The namespace of the agent pods (--taint-guard) [default: --lease-namespace]
    #[arg(
        long,
        env = "AETHER_REGISTRAR_AGENT_NAMESPACE",
        value_name = "NAMESPACE"
    )]
    pub agent_namespace: Option<String>,

    /// The label selector of the agent pods (--taint-guard)
    #[arg(
        long,
        value_name = "SELECTOR",
        default_value = "app.kubernetes.io/name=aether-agent,app.kubernetes.io/component=agent"
    )]
    pub agent_selector: String,

    /// A label selector of the nodes the guard covers (--taint-guard): the nodes the agent
    /// DaemonSet runs on [default: every node]
    #[arg(long, value_name = "SELECTOR", default_value = "")]
    pub guard_node_selector: String,

    /// The namespace of the leader-election Lease (coordination.k8s.io/v1)
    #[arg(
        long,
        env = "POD_NAMESPACE",
        value_name = "NAMESPACE",
        default_value = "default"
    )]
    pub lease_namespace: String,

    /// The name of the leader-election Lease
    #[arg(long, value_name = "NAME", default_value = "aether-registrar")]
    pub lease_name: String,

    /// This replica's identity in the Lease [default: host name and pid]
    #[arg(long, env = "POD_NAME", value_name = "ID")]
    pub leader_id: Option<String>,

    /// Seconds a leader's Lease lasts without renewal; another replica takes over after it
    /// (a leader stops writing after two thirds of it)
    #[arg(long, value_name = "SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub lease_duration: u64,

    /// HTTP/2 streams (calls) open at once on one connection; a stream past it is refused
    /// by HTTP/2 itself (REFUSED_STREAM)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_concurrent_streams: u32,

    /// Connections open at once on --listen; one past it is closed at once, before TLS
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,

    /// Connections open at once from one source address (TCP); one past it is closed at
    /// once, before TLS
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections_per_source: u64,

    /// HTTP/2 receive window, per stream and per connection, in bytes: the most request
    /// data a connection can have sent that the registrar has not read
    #[arg(long, value_name = "BYTES", default_value_t = 65_535, value_parser = clap::value_parser!(u32).range(65_535..))]
    pub http2_window: u32,

    /// The largest request of a watch, a drain mark or a delete, in bytes (gRPC framing
    /// included); a larger one ends with RESOURCE_EXHAUSTED
    #[arg(long, value_name = "BYTES", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(64..))]
    pub max_request_bytes: u64,

    /// The largest ApplyServices request, in bytes (gRPC framing included); a larger one
    /// ends with RESOURCE_EXHAUSTED
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20, value_parser = clap::value_parser!(u64).range(64..))]
    pub max_apply_bytes: u64,

    /// Seconds a call may take to answer (a watch: to open), authentication included;
    /// past it the call ends with DEADLINE_EXCEEDED. A caller's shorter grpc-timeout wins
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub call_timeout: u64,

    /// Seconds between HTTP/2 pings on an idle connection
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub http2_keepalive_interval: u64,

    /// Seconds a ping may go unanswered before the connection is closed
    #[arg(long, value_name = "SECONDS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub http2_keepalive_timeout: u64,

    /// Watch streams open at once for one node (cluster and node), of distinct instances:
    /// an owner and its standby. A stream with the instance of an open one replaces it; a
    /// new instance past the cap is refused with RESOURCE_EXHAUSTED
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_watch_streams_per_node: u64,

    /// TokenReviews a second one source address may cause (--token-review); tokens the
    /// pre-filter refuses and cached answers cost none. Past it a call is
    /// RESOURCE_EXHAUSTED
    #[arg(long, value_name = "RATE", default_value_t = 5.0)]
    pub token_reviews_per_source: f64,

    /// TokenReviews one source address may cause at once above --token-reviews-per-source
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub token_review_burst: u32,

    /// TokenReviews in flight at once; a call waits up to 5 s for one, then is UNAVAILABLE
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub token_reviews_in_flight: u64,

    /// Drain marks (SetEndpointState calls) a second one node may make; past it and the
    /// burst a call is RESOURCE_EXHAUSTED
    #[arg(long, value_name = "RATE", default_value_t = 20.0)]
    pub drain_marks_per_node: f64,

    /// Drain marks one node may make at once above --drain-marks-per-node: a node whose
    /// pods all go at once marks each of their addresses
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub drain_mark_burst: u32,

    /// QUIC pairs one node may advertise (SetQuicPairs sets a node's whole set); a larger
    /// set is RESOURCE_EXHAUSTED. Each pair takes at most 512 bytes, so this also bounds
    /// the request (pairs x 520 bytes + 1 KiB) and the node's value in etcd
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=8192))]
    pub quic_pairs_per_node: u32,

    /// SetQuicPairs calls a second one node may make; past it and the burst a call is
    /// RESOURCE_EXHAUSTED. A call states the node's whole set, so an agent coalesces
    /// changes into its next call
    #[arg(long, value_name = "RATE", default_value_t = 1.0)]
    pub quic_pair_sets_per_node: f64,

    /// SetQuicPairs calls one node may make at once above --quic-pair-sets-per-node
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub quic_pair_set_burst: u32,

    /// Log format on stderr: text or json (RUST_LOG filters; default info)
    #[arg(long, env = "AETHER_REGISTRAR_LOG_FORMAT", value_name = "FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The registrar: unix:///path or host:port, or several, comma-separated (each is
    /// tried in turn)
    #[arg(long, env = "AETHER_REGISTRAR", value_name = "ADDR[,ADDR...]")]
    pub registrar: String,

    /// Seconds to wait for a connection and for each call
    #[arg(long, value_name = "SECONDS", default_value_t = 10)]
    pub timeout: u64,

    /// A file holding a bearer token, for a registrar that reviews tokens (--token-review)
    #[arg(long, env = "AETHER_REGISTRAR_TOKEN_FILE", value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Speak TLS to a host:port registrar (one with --tls-cert), checking its certificate
    /// against the CA certificates in this PEM file and the address's host
    #[arg(long, env = "AETHER_REGISTRAR_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,

    /// A client certificate chain (PEM, the leaf first) to present over TLS (--ca), with
    /// --key: an operator's X.509-SVID, for a registrar with mutual TLS
    /// (--operator-spiffe-id)
    #[arg(
        long,
        env = "AETHER_REGISTRAR_CLIENT_CERT",
        value_name = "FILE",
        requires_all = ["key", "ca"]
    )]
    pub cert: Option<PathBuf>,

    /// The private key (PEM) of --cert
    #[arg(
        long,
        env = "AETHER_REGISTRAR_CLIENT_KEY",
        value_name = "FILE",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,
}

fn parse_id_pattern(s: &str) -> Result<crate::authz::IdPattern, String> {
    crate::authz::IdPattern::parse(s)
}

fn parse_spiffe_id(s: &str) -> Result<String, String> {
    match crate::mtls::trust_domain_of(s) {
        Some(_) if !s.contains('{') => Ok(s.to_owned()),
        _ => Err(format!(
            "{s:?} is not a SPIFFE ID (spiffe://TRUST-DOMAIN/PATH)"
        )),
    }
}

fn parse_account(s: &str) -> Result<String, String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok(s.to_owned())
        }
        _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
    }
}

fn parse_mode(s: &str) -> Result<u32, String> {
    match u32::from_str_radix(s, 8) {
        Ok(m) if m <= 0o777 => Ok(m),
        _ => Err(format!("{s:?} is not an octal mode of 0 to 777")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_flags_parse() {
        let cli = Cli::try_parse_from([
            "aether-registrar",
            "serve",
            "--etcd",
            "http://127.0.0.1:2379,http://127.0.0.1:22379",
            "--listen",
            "unix:///run/r.sock",
            "--agent-uid",
            "65532",
            "--agent-uid",
            "65533",
            "--socket-mode",
            "660",
        ])
        .unwrap();
        let Command::Serve(s) = cli.command else {
            panic!("serve")
        };
        assert_eq!(s.etcd.len(), 2);
        assert_eq!(s.agent_uids, [65532, 65533]);
        assert_eq!(s.socket_mode, 0o660);
        assert!(s.operator_uids.is_empty());
        assert!(
            !s.allow_loopback_endpoints,
            "loopback is refused by default"
        );
        assert_eq!(
            (
                s.discovery.as_str(),
                s.taint_guard,
                s.taint_grace,
                s.lease_duration
            ),
            ("auto", false, 30, 15)
        );
        assert_eq!(
            (
                s.max_concurrent_streams,
                s.max_connections,
                s.max_connections_per_source,
                s.max_request_bytes,
                s.max_apply_bytes,
                s.max_watch_streams_per_node
            ),
            (16, 1024, 16, 4096, 4 << 20, 2)
        );
        let e = Cli::try_parse_from([
            "aether-registrar",
            "serve",
            "--etcd",
            "x",
            "--listen",
            "unix:///r",
            "--discovery",
            "maybe",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("maybe"), "{e}");
        let e = Cli::try_parse_from([
            "aether-registrar",
            "serve",
            "--etcd",
            "x",
            "--listen",
            "unix:///r",
            "--taint-grace",
            "0",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--taint-grace"), "{e}");
        let e = Cli::try_parse_from([
            "aether-registrar",
            "serve",
            "--etcd",
            "x",
            "--listen",
            "nowhere",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("nowhere"), "{e}");
    }
}
