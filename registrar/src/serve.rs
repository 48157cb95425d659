//! `aether-registrar serve`: the wiring. Refuses unauthenticated TCP without
//! `--insecure-listen`, and a bad `--tls-cert`/`--tls-key`, before anything else; checks
//! that etcd answers, binds (the metrics and probe ports first), and serves until SIGTERM
//! or SIGINT, when `/ready` turns 503 and open watch streams end with UNAVAILABLE (their
//! clients resume on another replica or after the restart). The socket file is left in
//! place at exit; the next start replaces it once nothing answers on it.

use std::sync::Arc;
use std::time::Duration;

use aether_model::check::Loopback;
use anyhow::Context;
use shared_proto::registry::registry_server::RegistryServer;
use tokio::signal::unix::{SignalKind, signal};

use crate::authz::Policy;
use crate::cli::ServeArgs;
use crate::conns::{self, ConnLimits, Conns};
use crate::gate::{BodyLimits, Gate, GateLayer, Transport};
use crate::health::Health;
use crate::keys::Layout;
use crate::kubernetes::discovery::{self, Namespaces};
use crate::kubernetes::lease::LeaseConfig;
use crate::kubernetes::taint_guard::GuardConfig;
use crate::kubernetes::{self, Controllers};
use crate::listen::{self, Bound, ListenAddr, ListenError};
use crate::metrics::Metrics;
use crate::mtls;
use crate::service::{AgentWrites, MarkRate, PairLimits, Registrar};
use crate::store::{EtcdOptions, Store};
use crate::tls;
use crate::tokenreview::{ReviewLimits, Reviewer};

fn bound_kind(b: &Bound) -> bool {
    matches!(b, Bound::Tcp(_))
}

/// How long open connections get to close after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The largest HTTP/2 header block a request may send (8 KiB): a projected
/// service-account token is about 1 KiB.
const MAX_HEADER_LIST: u32 = 8 << 10;

/// How long the start waits for etcd to answer.
const ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mutual = args.spiffe_endpoint.is_some() || args.client_ca_bundle.is_some();
    if let (ListenAddr::Tcp(a), false) = (
        &args.listen,
        args.insecure_listen || args.token_review || mutual,
    ) {
        return Err(ListenError::InsecureTcp(a.clone()).into());
    }
    if mutual && !matches!(args.listen, ListenAddr::Tcp(_)) {
        anyhow::bail!(
            "--spiffe-endpoint and --client-ca-bundle are for a TCP --listen; a unix socket identifies callers by uid (--agent-uid, --operator-uid)"
        );
    }
    if mutual && args.insecure_listen {
        anyhow::bail!(
            "--insecure-listen lets every caller do everything; with mutual TLS (--spiffe-endpoint or --client-ca-bundle) callers are authenticated by their SVIDs: drop it"
        );
    }
    let trust_domain = match &args.trust_domain {
        Some(name) => Some(
            spiffe::TrustDomain::new(name)
                .ok()
                .filter(|td| td.as_str() == name && !name.contains(':'))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "--trust-domain {name:?}: expected a bare trust domain name such as example.org"
                    )
                })?,
        ),
        None => None,
    };
    if args.token_review && !matches!(args.listen, ListenAddr::Tcp(_)) {
        anyhow::bail!(
            "--token-review is for a TCP --listen; a unix socket identifies callers by uid (--agent-uid, --operator-uid)"
        );
    }
    if args.tls_cert.is_some() && !matches!(args.listen, ListenAddr::Tcp(_)) {
        anyhow::bail!(
            "--tls-cert is for a TCP --listen; a unix socket is reached only on this host"
        );
    }
    // A bad certificate, key or bundle fails the start, naming the file, and so does a
    // Workload API that sends no SVID, before anything binds.
    let provider = tls::provider();
    let serving: Option<Arc<dyn rustls::server::ResolvesServerCert>>;
    let mut roots = None;
    match (&args.tls_cert, &args.tls_key, &args.spiffe_endpoint) {
        (Some(cert), Some(key), _) => {
            serving = Some(Arc::new(tls::Certs::load(cert, key, provider.clone())?));
            if let Some(bundle) = &args.client_ca_bundle {
                roots = Some(mtls::Source::Files(mtls::BundleFile::load(bundle)?));
            }
        }
        (_, _, Some(endpoint)) => {
            let td = trust_domain
                .clone()
                .context("--spiffe-endpoint needs --trust-domain")?;
            let source = mtls::workload_source(endpoint, &td).await?;
            serving = Some(Arc::new(mtls::WorkloadCerts::new(
                source.clone(),
                provider.clone(),
            )));
            roots = Some(mtls::Source::Workload {
                source,
                trust_domain: td,
            });
        }
        _ => serving = None,
    }
    if args.etcd_prefix.is_empty() {
        anyhow::bail!("--etcd-prefix is empty; the registry needs a prefix of its own");
    }
    let layout = Layout::new(&args.etcd_prefix);
    let loopback = if args.allow_loopback_endpoints {
        tracing::warn!(
            "--allow-loopback-endpoints: loopback endpoint addresses are accepted; agents send their traffic to their own node"
        );
        Loopback::Allow
    } else {
        Loopback::Refuse
    };
    let opts = EtcdOptions {
        endpoints: args.etcd.clone(),
        ca: args.etcd_ca.clone(),
        cert: args.etcd_cert.clone(),
        key: args.etcd_key.clone(),
        connect_timeout: ETCD_CONNECT_TIMEOUT,
    };
    let store = Store::connect(&opts, layout).await?;
    let own_uid = nix::unistd::getuid().as_raw();
    let policy = Policy {
        agent_uids: args.agent_uids.clone(),
        operator_uids: if args.operator_uids.is_empty() {
            vec![own_uid]
        } else {
            args.operator_uids.clone()
        },
        agent_accounts: args.agent_accounts.clone(),
        operator_users: args.operator_users.clone(),
        agent_ids: args.agent_spiffe_ids.clone(),
        operator_ids: args.operator_spiffe_ids.clone(),
    };
    let discovery = match args.discovery.as_str() {
        "on" => true,
        "off" => false,
        _ => args.kubeconfig.is_some() || kubernetes::in_cluster(),
    };
    let kube_client = match args.token_review || discovery || args.taint_guard {
        true => Some(kubernetes::client(args.kubeconfig.as_deref()).await?),
        false => None,
    };
    let metrics = Metrics::new(kube_client.is_some() && (discovery || args.taint_guard));
    let reviewer = match (args.token_review, &kube_client) {
        (true, Some(c)) => Some(std::sync::Arc::new(Reviewer::new(
            c.clone(),
            args.token_audience.clone(),
            ReviewLimits {
                in_flight: usize::try_from(args.token_reviews_in_flight).unwrap_or(usize::MAX),
                per_source: args.token_reviews_per_source,
                burst: f64::from(args.token_review_burst),
            },
            metrics.clone(),
        ))),
        _ => None,
    };
    // Bound before the registry API, so a taken port fails the start with its address.
    if let Some(addr) = &args.metrics_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
        tracing::info!(addr = %addr, "serving metrics on GET /metrics");
        tokio::spawn(crate::metrics::serve(l, metrics.clone()));
    }
    let health = Health::new(store.clone());
    if let Some(addr) = &args.health_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("--health-addr {addr}: cannot listen"))?;
        tracing::info!(addr = %addr, "serving the probes on GET /live and GET /ready");
        tokio::spawn(crate::health::serve(l, health.clone()));
    }
    let bound = listen::bind(
        &args.listen,
        args.insecure_listen || args.token_review || mutual,
        args.socket_mode,
    )
    .await?;
    let tls = serving.map(|certs| {
        let verifier = roots.map(|source| {
            Arc::new(mtls::SvidVerifier::new(
                source,
                args.trust_domain.clone(),
                !args.token_review,
                provider.clone(),
                metrics.clone(),
            )) as Arc<dyn rustls::server::danger::ClientCertVerifier>
        });
        tls::config_with(certs, verifier, provider.clone())
    });
    let transport = match (bound_kind(&bound), reviewer) {
        (false, _) => Transport::Unix,
        (true, reviewer) if mutual => {
            tracing::info!(listen = %args.listen, trust_domain = ?args.trust_domain,
                agents = ?args.agent_spiffe_ids.iter().map(ToString::to_string).collect::<Vec<_>>(),
                operators = ?args.operator_spiffe_ids, tokens = reviewer.is_some(),
                "serving mutual TLS: callers present an X.509-SVID{}",
                if reviewer.is_some() { ", a bearer token, or both (then both must hold)" } else { "" });
            if args.agent_spiffe_ids.is_empty() && args.operator_spiffe_ids.is_empty() {
                tracing::warn!(
                    "mutual TLS without --agent-spiffe-id or --operator-spiffe-id: no SVID may call anything"
                );
            }
            if reviewer.is_none() {
                for p in args.agent_spiffe_ids.iter().filter(|p| !p.has_node()) {
                    tracing::warn!(agent_spiffe_id = %p, "this agent ID names no node and, without --token-review, no token can: its callers are refused; use {{node}} or --token-review");
                }
            }
            Transport::Mtls(reviewer)
        }
        (true, Some(r)) => {
            tracing::info!(listen = %args.listen, tls = tls.is_some(), audience = %args.token_audience, agents = ?policy.agent_accounts, operators = ?policy.operator_users,
                "serving TCP to callers with a bearer token, checked with TokenReview");
            if tls.is_none() {
                tracing::warn!(listen = %args.listen, "serving plain TCP: callers' tokens and the registry cross the network unencrypted; pass --tls-cert and --tls-key");
            }
            Transport::TokenTcp(r)
        }
        (true, None) => {
            tracing::warn!(listen = %args.listen, tls = tls.is_some(), "serving TCP (--insecure-listen): callers are not authenticated and every caller may apply and delete services");
            Transport::InsecureTcp
        }
    };
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let shutdown_seen = shutdown_rx.clone();
    let mut controllers = tokio::task::JoinSet::new();
    if let (Some(client), true) = (&kube_client, discovery || args.taint_guard) {
        let lease = LeaseConfig {
            namespace: args.lease_namespace.clone(),
            name: args.lease_name.clone(),
            identity: args.leader_id.clone().unwrap_or_else(default_identity),
            duration: Duration::from_secs(args.lease_duration),
        };
        let namespaces = discovery.then(|| Namespaces {
            include: args.discover_namespaces.iter().cloned().collect(),
            exclude: args.ignore_namespaces.iter().cloned().collect(),
        });
        let taint_guard = args.taint_guard.then(|| GuardConfig {
            grace: Duration::from_secs(args.taint_grace),
            agent_namespace: args
                .agent_namespace
                .clone()
                .unwrap_or_else(|| args.lease_namespace.clone()),
            agent_selector: args.agent_selector.clone(),
            node_selector: args.guard_node_selector.clone(),
        });
        tracing::info!(lease = %format!("{}/{}", lease.namespace, lease.name), identity = %lease.identity, discovery, taint_guard = args.taint_guard,
            namespaces = ?args.discover_namespaces, ignored = ?args.ignore_namespaces, "Kubernetes controllers starting; the Lease holder writes");
        kubernetes::spawn(
            &mut controllers,
            client.clone(),
            store.clone(),
            Controllers {
                lease,
                discovery: namespaces.map(|namespaces| discovery::Config {
                    namespaces,
                    loopback,
                    refused: metrics.discovery_endpoints_refused.clone(),
                }),
                taint_guard,
            },
            shutdown_rx.clone(),
            metrics.leader.clone(),
        );
    }
    let registrar = Registrar::new(
        store,
        args.cluster.clone(),
        usize::try_from(args.max_watch_streams_per_node).unwrap_or(usize::MAX),
        AgentWrites {
            marks: MarkRate {
                per_second: args.drain_marks_per_node,
                burst: f64::from(args.drain_mark_burst),
            },
            pairs: PairLimits {
                per_node: args.quic_pairs_per_node as usize,
                rate: MarkRate {
                    per_second: args.quic_pair_sets_per_node,
                    burst: f64::from(args.quic_pair_set_burst),
                },
            },
        },
        shutdown_rx,
        metrics.clone(),
        loopback,
        args.full_views_from_etcd,
    );
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let stopping = health.clone();
    let stop = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping"),
            _ = int.recv() => tracing::info!("SIGINT: stopping"),
        }
        stopping.set_stopping();
        let _ = shutdown_tx.send(true);
    };
    tracing::info!(
        listen = %args.listen, etcd = %args.etcd.join(","), prefix = %args.etcd_prefix,
        agent_uids = ?policy.agent_uids, operator_uids = ?policy.operator_uids, cluster = ?args.cluster,
        "serving the registry API"
    );
    let limits = BodyLimits {
        small: usize::try_from(args.max_request_bytes).unwrap_or(usize::MAX),
        apply: usize::try_from(args.max_apply_bytes).unwrap_or(usize::MAX),
        pairs: PairLimits::request_bytes(args.quic_pairs_per_node as usize),
    };
    let gate = GateLayer(std::sync::Arc::new(Gate {
        transport,
        policy: policy.clone(),
        limits,
        metrics: metrics.clone(),
    }));
    let conns = Conns::new(
        ConnLimits {
            total: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
            per_source: usize::try_from(args.max_connections_per_source).unwrap_or(usize::MAX),
        },
        metrics.clone(),
    );
    tracing::info!(
        max_concurrent_streams = args.max_concurrent_streams,
        max_connections = args.max_connections,
        max_connections_per_source = args.max_connections_per_source,
        http2_window = args.http2_window,
        max_request_bytes = args.max_request_bytes,
        max_apply_bytes = args.max_apply_bytes,
        call_timeout_s = args.call_timeout,
        "limits"
    );
    // The gate answers before the body is read; the service's own decoding limit is the
    // largest of them, the gate's cap per method the one that applies.
    let service = RegistryServer::new(registrar)
        .max_decoding_message_size(limits.small.max(limits.apply).max(limits.pairs));
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(args.max_concurrent_streams)
        .initial_stream_window_size(args.http2_window)
        .initial_connection_window_size(args.http2_window)
        .http2_max_header_list_size(MAX_HEADER_LIST)
        .http2_keepalive_interval(Some(Duration::from_secs(args.http2_keepalive_interval)))
        .http2_keepalive_timeout(Some(Duration::from_secs(args.http2_keepalive_timeout)))
        .timeout(Duration::from_secs(args.call_timeout))
        .layer(gate)
        .add_service(service);
    // Bound above: connections queue in the backlog until the server takes them.
    health.set_serving();
    let serving = async {
        match bound {
            Bound::Unix(l) => {
                server
                    .serve_with_incoming_shutdown(conns::unix(l, conns), stop)
                    .await
            }
            Bound::Tcp(l) => match tls {
                Some(config) => {
                    server
                        .serve_with_incoming_shutdown(
                            tls::incoming(l, config, tls::MAX_HANDSHAKES, conns, metrics.clone()),
                            stop,
                        )
                        .await
                }
                None => {
                    server
                        .serve_with_incoming_shutdown(conns::tcp(l, conns), stop)
                        .await
                }
            },
        }
    };
    // A graceful HTTP/2 shutdown waits for every client to acknowledge it; a hung client
    // does not hold the exit up for longer than this.
    let mut stopping = shutdown_seen;
    let deadline = async move {
        let _ = stopping.wait_for(|s| *s).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = serving => served.with_context(|| format!("serving on {}", args.listen))?,
        _ = deadline => tracing::warn!("connections still open {SHUTDOWN_GRACE:?} after the signal; exiting without them"),
    }
    // The leader releases its Lease on the way out, so that another replica takes over
    // without waiting for it to expire.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while controllers.join_next().await.is_some() {}
    })
    .await;
    tracing::info!("stopped");
    Ok(())
}

/// The Lease identity when no --leader-id (POD_NAME) is given: host name and pid.
fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "registrar".into());
    format!("{host}-{}", std::process::id())
}
