//! The driver: performs what the pure [`takeover`] state machine decides.
//!
//! Start-up is the same for a standby and a lone agent: load storage, start the
//! registry and capture feeds, answer health, say Hello to the supervisor. The node is
//! touched only after a `Takeover`: its descriptors are checked, the storage diff is
//! reconciled when the start was contended, and then both sockets are served.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_model::{Identity, Inputs};
use anyhow::Context;
use shared_proto::flags::KubeAccess;
use tokio::sync::{oneshot, watch};
use tracing::{error, info, warn};

use crate::config::Config;
use crate::control::{Command, Control};
use crate::health::{self, TakeoverTimes};
use crate::metrics::Metrics;
use crate::node::Node;
use crate::storage::Storage;
use crate::takeover::{self, Action, Event, Gate, Phase, State, SvidWait};
use crate::{capture, cni, fdcheck, httpmini, identity, kube, registrar, registry, writers, xds};

const REGISTRY_GATE: Duration = Duration::from_secs(15);
const CAPTURE_GATE: Duration = Duration::from_secs(10);
/// A lone owner waits this long for its own SVID, then serves without it and says so.
const IDENTITY_GATE: Duration = Duration::from_secs(5);
/// How long a takeover waits, after its reconcile, for the SVIDs of the pods it added.
const SVID_WAIT: Duration = Duration::from_secs(1);
/// How long a released owner keeps the proxy's streams waiting for its successor to
/// answer on `xds.sock`. A complete standby serves within milliseconds of the lock; past
/// this bound the old owner exits anyway and the proxy's reconnect waits in the backlog.
const SUCCESSOR_BOUND: Duration = Duration::from_secs(2);

/// The clock of `Takeover.sent_at_us` (monotonic, shared with the supervisor).
fn now_us() -> u64 {
    shared_proto::control::monotonic_us()
}

/// Everything the owner needs once it serves.
struct Owned {
    /// The node lock's descriptor: held until the node is released after a drain, so the
    /// node stays owned while this worker serves even if its supervisor is gone.
    lock: Option<OwnedFd>,
    /// The listeners until serving starts, which consumes them.
    listeners: Option<(OwnedFd, OwnedFd)>,
    generation: u64,
    received: Instant,
    times: TakeoverTimes,
    /// Wall clock at which the supervisor acquired the lock, in µs.
    lock_acquired_us: u64,
}

pub async fn run(cfg: Config, control_fd: OwnedFd) -> anyhow::Result<i32> {
    let metrics = Metrics::new();
    let storage =
        Arc::new(Storage::open(&cfg.state_dir, metrics.clone()).context("opening pod storage")?);
    let identity_cfg = cfg.identity()?;
    let identity = Identity {
        trust_domain: identity_cfg.as_ref().map(|c| c.trust_domain.to_string()),
        mode: identity_cfg.as_ref().map(|c| c.mode).unwrap_or_default(),
        ..Identity::default()
    };
    // With pods' SVIDs, a takeover waits (bounded) for those of the pods it adds.
    let pod_svids = identity_cfg.as_ref().is_some_and(|c| c.broker.is_some());
    let node = Node::new(Inputs {
        on_demand_clusters: cfg.agent.on_demand_clusters,
        identity,
        ..Inputs::default()
    });
    cni::load(&node, &storage);
    // A standby follows the owner's pod records until the node is handed to it.
    let followed = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let (stop_following, following) = watch::channel(false);
    tokio::spawn(cni::follow(
        node.clone(),
        storage.clone(),
        followed.clone(),
        following,
    ));
    // Restored in a standby too; written by the owner alone (see `writers`).
    let observed = writers::Observed::restore(&cfg.state_dir);
    let mesh_dns = writers::MeshDns::restore(&cfg.state_dir, node.clone(), metrics.clone());
    let status = Arc::new(watch::Sender::new(health::Status::new(
        &cfg.node_name,
        &cfg.pod_name,
    )));
    let problems = health::Reporter::new(status.clone());
    // Failed record writes show in /ready; deferred record removals are retried.
    let _storage_upkeep = storage.start_upkeep(problems.clone());
    let registrar = registrar_source(&cfg)?;
    let _registry = match &registrar {
        Some((addrs, me)) => registrar::spawn(
            addrs.clone(),
            me.clone(),
            node.clone(),
            metrics.clone(),
            problems.clone(),
        ),
        None => registry::spawn_embedded(
            cfg.agent.registry_file.clone(),
            cfg.agent.registry_max_bytes,
            node.clone(),
            metrics.clone(),
        ),
    };
    let _capture = capture::spawn(
        cfg.agent.capture_file.clone(),
        node.clone(),
        metrics.clone(),
    );
    // Watches in a standby too; writes only once handed a writer at Serve.
    let kube = kube_source(&cfg, &metrics, &problems)?;
    // A standby too: it holds the agent's and the stored pods' SVIDs before it takes over;
    // with API access, only for the pods the API server places on this node.
    let _identity = identity_cfg.map(|c| {
        let placement = kube.as_ref().map(kube::Kube::pods);
        identity::spawn(
            c,
            node.clone(),
            metrics.clone(),
            problems.clone(),
            placement,
        )
    });
    // Standby and owner alike say whether the node's conflist chains aether-cni.
    let _conflist = cfg
        .agent
        .cni_conf_dir
        .clone()
        .map(|dir| crate::conflist::spawn(dir, problems.clone()));

    let health_listener =
        health::bind_after_predecessor(&cfg.health_dir, Duration::from_secs(1)).await?;
    tokio::spawn(health::serve(
        health_listener,
        status.subscribe(),
        metrics.clone(),
    ));
    // A standby names a holder of the node lock that is not an agent (see `lockwait`).
    let _lock_wait = crate::lockwait::spawn(&cfg.run_dir, status.subscribe(), problems.clone());

    let mut control = Control::new(control_fd)?;
    let acks = crate::acks::Acks::default();
    // Encoded from the first snapshot on, in a standby too: a takeover answers with copies.
    let encoded = Arc::new(xds::encoded::Encoded::default());
    tokio::spawn(xds::encoded::keep_warm(
        node.subscribe(),
        encoded.clone(),
        metrics.clone(),
    ));
    let mut state = State::new(pod_svids);
    let mut gates = node.gates();
    let mut owned: Option<Owned> = None;
    let (timeout_tx, mut timeout_rx) = tokio::sync::mpsc::channel::<Gate>(2);
    let (reconciled_tx, mut reconciled_rx) = tokio::sync::mpsc::channel::<Duration>(1);
    let (svids_tx, mut svids_rx) = tokio::sync::mpsc::channel::<(Duration, usize)>(1);
    // The pods lacking an SVID just before the reconcile (see `SvidWait`).
    let mut svid_wait = SvidWait::default();
    let mut serving: Option<Serving> = None;
    let (drained_tx, mut drained_rx) = tokio::sync::mpsc::channel::<()>(1);
    let (exit_tx, mut exit_rx) = tokio::sync::mpsc::channel::<()>(1);
    let mut successor = false;
    // Whether the takeover ran a reconcile (its storage reload cleans up as `tidy` would).
    let mut reconciled = false;
    let mut pending = vec![Event::Gates(*gates.borrow_and_update())];

    loop {
        for event in pending.drain(..) {
            let (next, actions) = takeover::step(state, event);
            state = next;
            for action in actions {
                match action {
                    Action::Report(phase) => {
                        control.report(phase)?;
                        info!(phase = phase.as_str(), owner = state.owner, "phase");
                    }
                    Action::ArmGateTimers => {
                        for (gate, after) in [
                            (Gate::Registry, REGISTRY_GATE),
                            (Gate::Capture, CAPTURE_GATE),
                            (Gate::Identity, IDENTITY_GATE),
                        ] {
                            let tx = timeout_tx.clone();
                            tokio::spawn(async move {
                                tokio::time::sleep(after).await;
                                let _ = tx.send(gate).await;
                            });
                        }
                    }
                    Action::Reconcile => {
                        reconciled = true;
                        // The pods the standby took from the owner during the overlap
                        // are waited for like those the reconcile adds.
                        let taken = followed.lock().unwrap_or_else(|e| e.into_inner()).clone();
                        svid_wait = SvidWait::new(
                            node.with_inputs(identity::lacking_svids)
                                .difference(&taken)
                                .cloned()
                                .collect(),
                        );
                        // What the previous owner flushed before it released the node.
                        observed.reload();
                        let (node, storage, tx) =
                            (node.clone(), storage.clone(), reconciled_tx.clone());
                        tokio::spawn(async move {
                            let start = Instant::now();
                            match cni::reconcile(&node, &storage).await {
                                Ok(n) => info!(
                                    changed = n,
                                    "takeover reconcile applied the storage diff"
                                ),
                                Err(e) => {
                                    error!(error = %format!("{e:#}"), "takeover reconcile failed; serving what storage held at start")
                                }
                            }
                            shared_proto::fault_hook!("reconcile");
                            let _ = tx.send(start.elapsed()).await;
                        });
                    }
                    Action::AwaitSvids => {
                        let (node, wait, tx) = (
                            node.clone(),
                            std::mem::take(&mut svid_wait),
                            svids_tx.clone(),
                        );
                        tokio::spawn(async move {
                            let _ = tx.send(await_svids(&node, &wait, SVID_WAIT).await).await;
                        });
                    }
                    Action::Serve => {
                        shared_proto::fault_hook!("serve");
                        let o = owned.as_mut().expect("Serve follows a takeover");
                        serving = Some(serve(
                            &cfg,
                            o,
                            &node,
                            &storage,
                            &acks,
                            &encoded,
                            &observed,
                            &metrics,
                            kube.as_ref(),
                            drained_tx.clone(),
                        )?);
                        // The owner alone writes the mesh-DNS snapshot and its heartbeat.
                        tokio::spawn(writers::mesh_dns::run_writer(mesh_dns.clone()));
                        // What `Storage::open` left in place, now that no one else writes;
                        // a reconcile's reload already did it.
                        if !reconciled {
                            let storage = storage.clone();
                            tokio::task::spawn_blocking(move || {
                                if let Err(e) = storage.tidy() {
                                    warn!(error = %e, "tidying the pod records folder failed");
                                }
                            });
                        }
                    }
                    Action::Drain => match serving.as_mut().and_then(|s| {
                        // No Kubernetes write after this: a write in progress holds the
                        // lifecycle lock, which the CNI API's fence waits for.
                        if let Some(k) = &kube {
                            k.stop();
                        }
                        s.drain_cni.take()
                    }) {
                        Some(tx) => {
                            let _ = tx.send(());
                        }
                        // Nothing served: nothing in flight.
                        None => return Ok(0),
                    },
                    Action::Release => {
                        serving
                            .take()
                            .expect("Release follows a served drain")
                            .close_xds_listener()
                            .await;
                        // Before the lock passes: the successor reloads the file at takeover.
                        match observed.flush_final() {
                            Ok(wrote) => info!(
                                wrote,
                                clusters = observed.names().len(),
                                "observed upstreams flushed before release"
                            ),
                            Err(e) => {
                                error!(file = %observed.path().display(), error = %e, "observed upstreams: flush at drain failed")
                            }
                        }
                        mesh_dns.flush();
                        // The listeners went with the servers; the lock is the last
                        // descriptor of the node this process holds besides the streams.
                        if let Some(o) = &mut owned {
                            o.lock = None;
                        }
                        let (tx, xds_path) = (exit_tx.clone(), cfg.run_dir.join("xds.sock"));
                        tokio::spawn(async move {
                            if successor {
                                await_successor(&xds_path).await;
                            }
                            let _ = tx.send(()).await;
                        });
                    }
                }
            }
            status.send_modify(|s| {
                s.role = if state.owner { "owner" } else { "standby" };
                s.phase = state.phase.as_str();
                s.ready = state.ready();
                s.waiting_for = state.waiting_for();
                if let Some(o) = &owned {
                    s.generation = o.generation;
                    s.takeover = Some(o.times);
                }
            });
        }

        tokio::select! {
            changed = gates.changed() => {
                if changed.is_ok() {
                    pending.push(Event::Gates(*gates.borrow_and_update()));
                }
            }
            Some(gate) = timeout_rx.recv() => {
                let g = *gates.borrow();
                let passed = match gate {
                    Gate::Registry => g.registry_loaded,
                    Gate::Capture => g.capture_landed,
                    Gate::Identity => g.agent_svid,
                };
                if !passed && state.phase != Phase::Serving {
                    warn!(gate = ?gate, "first-serve gate timed out; a lone owner serves without it");
                }
                pending.push(Event::GateTimedOut(gate));
            }
            Some(took) = reconciled_rx.recv() => {
                if let Some(o) = &mut owned {
                    o.times.reconcile_us = took.as_micros() as u64;
                }
                pending.push(Event::ReconcileDone);
            }
            Some((took, missed)) = svids_rx.recv() => {
                if let Some(o) = &mut owned {
                    o.times.svid_wait_us = took.as_micros() as u64;
                    o.times.svid_wait_missed = missed;
                }
                metrics.observe_phase("svid_wait", took.as_secs_f64());
                if missed > 0 {
                    warn!(pods = missed, waited_ms = took.as_millis() as u64, "takeover: serving before every pod it added has its SVID");
                } else {
                    info!(waited_us = took.as_micros() as u64, "takeover: the pods it added hold their SVIDs");
                }
                pending.push(Event::SvidsReady);
            }
            Some(()) = drained_rx.recv() => {
                info!(successor, "in-flight CNI calls finished; releasing the node");
                pending.push(Event::Drained);
            }
            Some(()) = exit_rx.recv() => {
                info!("exiting");
                return Ok(0);
            }
            command = control.next() => match command {
                Ok(Command::Drain { successor: s }) => {
                    successor = s;
                    pending.push(Event::Drain);
                }
                Ok(Command::Takeover(t, fds)) => {
                    // From here on this process writes the records: it stops reading them
                    // as the owner writes.
                    stop_following.send_replace(true);
                    shared_proto::fault_hook!("takeover");
                    let fds = fdcheck::check(&cfg.run_dir, fds).context("checking the Takeover descriptors")?;
                    let fd_passing_us = now_us().saturating_sub(t.sent_at_us);
                    info!(generation = t.generation, handed_off = t.handed_off, respawn = t.respawn, uncontended = t.uncontended,
                        lock_wait_us = t.lock_wait_us, bind_us = t.bind_us, fd_passing_us, "takeover received");
                    metrics.generation.set(t.generation as i64);
                    // The supervisor's count: a new worker starts at 0 and catches up.
                    metrics.worker_respawns.inc_by(t.respawns.saturating_sub(metrics.worker_respawns.get()));
                    metrics.observe_phase("lock_wait", t.lock_wait_us as f64 / 1e6);
                    metrics.observe_phase("bind", t.bind_us as f64 / 1e6);
                    metrics.observe_phase("fd_passing", fd_passing_us as f64 / 1e6);
                    owned = Some(Owned {
                        lock: Some(fds.lock),
                        listeners: Some((fds.xds, fds.cni)),
                        generation: t.generation,
                        received: Instant::now(),
                        times: TakeoverTimes {
                            lock_wait_us: t.lock_wait_us,
                            bind_us: t.bind_us,
                            fd_passing_us,
                            handed_off: t.handed_off,
                            respawn: t.respawn,
                            ..TakeoverTimes::default()
                        },
                        lock_acquired_us: t.sent_at_us.saturating_sub(t.bind_us),
                    });
                    pending.push(Event::Takeover { reconcile: !t.uncontended && !t.respawn });
                }
                Err(e) => {
                    error!(error = %e, "control channel to the supervisor ended");
                    return Ok(1);
                }
            },
        }
    }
}

/// Waits until every pod `wait` is for holds its SVID, for at most `bound`. Returns how
/// long it waited and how many of those pods still had none.
async fn await_svids(node: &Node, wait: &SvidWait, bound: Duration) -> (Duration, usize) {
    let start = Instant::now();
    let deadline = tokio::time::Instant::now() + bound;
    let mut snapshots = node.subscribe();
    loop {
        // A pod's SVID changes its secrets, so each one that lands publishes a snapshot.
        let pending = node.with_inputs(|i| wait.pending(&identity::lacking_svids(i)).len());
        if pending == 0 {
            return (start.elapsed(), 0);
        }
        tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { return (start.elapsed(), pending) },
            () = tokio::time::sleep_until(deadline) => return (start.elapsed(), pending),
        }
    }
}

/// The registrar addresses and this agent's key, when `--registrar` is set.
fn registrar_source(
    cfg: &Config,
) -> anyhow::Result<Option<(Vec<registrar::Address>, registrar::Identity)>> {
    let Some(list) = &cfg.agent.registrar else {
        return Ok(None);
    };
    anyhow::ensure!(
        cfg.agent.registry_file.is_none(),
        "--registrar and --registry-file are both set; the registry comes from one source: the registrar in a cluster, the file on one machine"
    );
    let me = registrar::Identity {
        cluster: cfg.agent.cluster.clone(),
        node: cfg.node_name.clone(),
        instance: cfg.pod_name.clone(),
        token_file: cfg.agent.registrar_token_file.clone(),
        ca_file: cfg.agent.registrar_ca.clone(),
    };
    // A bundle that does not load stops the start, naming the file; it is read again at
    // each connect.
    if let Some(ca) = &me.ca_file {
        shared_proto::registry_tls::client_config(ca).context("--registrar-ca")?;
    }
    Ok(Some((registrar::parse_addresses(list)?, me)))
}

/// The Kubernetes source, when the flags give API access.
fn kube_source(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    problems: &health::Reporter,
) -> anyhow::Result<Option<kube::Kube>> {
    let access = match cfg.agent.kube_access() {
        KubeAccess::Kubeconfig(path) => kube::Access::Kubeconfig(path),
        KubeAccess::InCluster(addr) => kube::Access::in_cluster(&addr)?,
        KubeAccess::None => {
            info!(
                "no Kubernetes API access (neither --kubeconfig nor KUBERNETES_SERVICE_HOST): no pod or node watches, no startup taint removal"
            );
            return Ok(None);
        }
    };
    info!(access = %access, stale_record_grace_ms = cfg.agent.stale_record_grace.as_millis() as u64, "Kubernetes API access");
    let options = kube::Options {
        node_name: cfg.node_name.clone(),
        stale_grace: cfg.agent.stale_record_grace,
    };
    Ok(Some(kube::Kube::spawn(
        access,
        options,
        metrics.clone(),
        problems.clone(),
    )))
}

/// An owner's servers, as the drain needs them.
struct Serving {
    /// Tells the CNI API to stop taking calls; it reports on `drained` once the calls in
    /// flight have finished.
    drain_cni: Option<oneshot::Sender<()>>,
    /// Tells the ADS server to close its listener; the open streams stay.
    stop_xds: oneshot::Sender<()>,
    /// Ends once the ADS listener is closed.
    xds_accept: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Serving {
    /// Closes the ADS listener (the CNI API closed its own when drained) and returns once
    /// it is closed; the open proxy streams stay.
    async fn close_xds_listener(self) {
        let _ = self.stop_xds.send(());
        match self.xds_accept.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => warn!(error = %format!("{e:#}"), "ADS server ended with an error"),
            Err(e) => warn!(error = %e, "ADS accept task failed"),
        }
    }
}

/// Waits, for at most [`SUCCESSOR_BOUND`], until the successor answers on `xds.sock`.
async fn await_successor(xds_path: &std::path::Path) {
    match xds::await_server(xds_path, SUCCESSOR_BOUND).await {
        Ok(took) => info!(
            after_us = took.as_micros() as u64,
            "the successor serves on xds.sock; ending the proxy's streams"
        ),
        Err(e) => {
            warn!(error = %e, "the successor did not answer; ending the proxy's streams anyway")
        }
    }
}

/// Starts serving both sockets and the metrics listener.
#[allow(clippy::too_many_arguments)]
fn serve(
    cfg: &Config,
    o: &mut Owned,
    node: &Arc<Node>,
    storage: &Arc<Storage>,
    acks: &crate::acks::Acks,
    encoded: &Arc<xds::encoded::Encoded>,
    observed: &Arc<writers::Observed>,
    metrics: &Arc<Metrics>,
    kube: Option<&kube::Kube>,
    drained: tokio::sync::mpsc::Sender<()>,
) -> anyhow::Result<Serving> {
    let listener = |fd: OwnedFd| -> anyhow::Result<tokio::net::UnixListener> {
        let std_l = std::os::unix::net::UnixListener::from(fd);
        std_l.set_nonblocking(true)?;
        Ok(tokio::net::UnixListener::from_std(std_l)?)
    };
    let (xds_fd, cni_fd) = o.listeners.take().context("serving started twice")?;
    let xds_l = listener(xds_fd)?;
    let cni_l = listener(cni_fd)?;
    // The proxy keeps its stream until this process exits: a drain only stops accepting.
    let (stop_xds, stop_rx) = oneshot::channel::<()>();
    let on_demand = cfg.agent.on_demand_clusters.then(|| observed.clone());
    let xds_accept = tokio::spawn(xds::server::serve_observed(
        xds_l,
        node.subscribe(),
        encoded.clone(),
        acks.clone(),
        metrics.clone(),
        on_demand,
        async move {
            let _ = stop_rx.await;
        },
    ));
    // The owner alone writes what the proxy showed it uses.
    tokio::spawn(writers::run_writer(observed.clone()));
    // The owner alone sets drain marks: a standby never reaches this point.
    let marks = registrar_source(cfg)?
        .map(|(addrs, me)| registrar::Marks::spawn(addrs, me, metrics.clone()));
    // The owner alone writes what the Kubernetes API shows (Terminating marks, stale
    // records, the startup taint), from now on.
    if let Some(k) = kube {
        k.serve(kube::Writer::new(
            node.clone(),
            storage.clone(),
            marks.clone(),
            acks.clone(),
        ));
    }
    let (drain_cni, drain) = oneshot::channel();
    let (node, storage, acks, m) = (node.clone(), storage.clone(), acks.clone(), metrics.clone());
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = drain.await;
        };
        if let Err(e) = cni::serve(cni_l, node, storage, acks, m, marks, shutdown).await {
            error!(error = %format!("{e:#}"), "CNI API stopped");
        }
        let _ = drained.send(()).await;
    });
    if let Some(addr) = cfg.agent.metrics_addr.0 {
        tokio::spawn(serve_metrics(addr, metrics.clone()));
    }
    let first_serve = o.received.elapsed();
    o.times.first_serve_us = first_serve.as_micros() as u64;
    o.times.total_us = now_us().saturating_sub(o.lock_acquired_us);
    metrics.observe_phase("reconcile", o.times.reconcile_us as f64 / 1e6);
    metrics.observe_phase("first_serve", first_serve.as_secs_f64());
    info!(
        generation = o.generation,
        total_us = o.times.total_us,
        first_serve_us = o.times.first_serve_us,
        reconcile_us = o.times.reconcile_us,
        "serving the node"
    );
    Ok(Serving {
        drain_cni: Some(drain_cni),
        stop_xds,
        xds_accept,
    })
}

/// Serves Prometheus metrics on `addr`. The previous owner may hold the port for a few
/// milliseconds after it handed the node over, so binding is retried for a while.
///
/// At most `MAX_CONNECTIONS` are open at once (any host-network process can connect;
/// one past the cap is closed at once and counted), and the text is encoded at most once
/// per `CACHE_FOR`, however many scrapes come.
pub async fn serve_metrics(addr: std::net::SocketAddr, metrics: Arc<Metrics>) {
    const MAX_CONNECTIONS: usize = 64;
    const CACHE_FOR: Duration = Duration::from_secs(1);
    let mut delay = Duration::from_millis(10);
    let deadline = Instant::now() + Duration::from_secs(30);
    let listener = loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            Err(e) => {
                warn!(addr = %addr, error = %e, "cannot bind the metrics address; metrics disabled");
                return;
            }
        }
    };
    let mut acceptor =
        crate::accept::Acceptor::new(listener, "metrics", MAX_CONNECTIONS, metrics.clone());
    loop {
        let conn = acceptor.next().await;
        let metrics = metrics.clone();
        tokio::spawn(httpmini::serve_one(conn, move |path| match path {
            "/metrics" => httpmini::Response {
                status: 200,
                content_type: "application/openmetrics-text; version=1.0.0; charset=utf-8",
                body: metrics.encode_cached(CACHE_FOR),
            },
            _ => httpmini::Response {
                status: 404,
                content_type: "text/plain",
                body: "try /metrics\n".into(),
            },
        }));
    }
}

#[cfg(test)]
mod tests {
    use aether_model::{Change, Pod, Svid};

    use super::*;

    fn pod(uid: &str, ip: &str) -> Pod {
        Pod {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
            container_id: "c".into(),
            netns: "/n".into(),
            ifname: "eth0".into(),
            ips: vec![ip.parse().unwrap()],
            terminating: false,
        }
    }

    fn svid(serial: &str) -> Svid {
        Svid {
            spiffe_id: "spiffe://t/x".into(),
            chain_pem: "C".into(),
            key_pem: "K".into(),
            serial: serial.into(),
            not_before: 0,
            not_after: 10,
        }
    }

    /// The takeover's SVID wait on the node: it ends when the added pod's SVID lands,
    /// however long the baseline pod waits, and gives up after its bound.
    #[tokio::test(start_paused = true)]
    async fn the_svid_wait_ends_with_the_added_pods_svid_or_its_bound() {
        let identity = Identity {
            trust_domain: Some("t".into()),
            ..Identity::default()
        };
        let node = Node::new(Inputs {
            identity,
            ..Inputs::default()
        });
        node.apply([Change::UpsertPod(pod("held", "10.0.0.1"))]);
        // Noted before the reconcile; then the reconcile adds "added".
        let wait = SvidWait::new(node.with_inputs(identity::lacking_svids));
        node.apply([Change::UpsertPod(pod("added", "10.0.0.2"))]);
        let waiting = tokio::spawn({
            let node = node.clone();
            let wait = wait.clone();
            async move { await_svids(&node, &wait, SVID_WAIT).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "ended before the added pod's SVID");
        node.apply([Change::SetPodSvid {
            uid: "added".into(),
            svid: Some(svid("01")),
        }]);
        let (took, missed) = waiting.await.unwrap();
        assert_eq!(missed, 0);
        assert!(took < SVID_WAIT, "{took:?}");

        // Another added pod whose SVID never comes: the bound ends the wait.
        node.apply([Change::UpsertPod(pod("never", "10.0.0.3"))]);
        let start = tokio::time::Instant::now();
        let (_, missed) = await_svids(&node, &wait, SVID_WAIT).await;
        assert_eq!(missed, 1);
        assert_eq!(start.elapsed(), SVID_WAIT);
    }
}
