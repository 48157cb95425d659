//! The driver: performs what the pure [`lifecycle`](crate::lifecycle) decides.
//!
//! Three parts, after the supervisor's `supervise`: [`Agent::wire`] builds everything a
//! standby and a lone agent start alike (storage, the node and its sources, health, the
//! control channel, the encoding cache); [`run`] turns what the control channel, the
//! gates and the driver's own tasks report into events; [`Agent::perform`] carries out
//! the actions the lifecycle returns, at once and in order. Every decision is the
//! lifecycle's. The node is touched only after a `Takeover`: its descriptors are checked,
//! the storage diff is reconciled when the start was contended, and then both sockets
//! are served.

use std::collections::{BTreeSet, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_model::{Gates, Identity, Inputs};
use anyhow::Context;
use shared_proto::flags::KubeAccess;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::acks::Acks;
use crate::config::Config;
use crate::control::{Command, Control, ControlError};
use crate::health::{self, Status};
use crate::lifecycle::{Action, Event, Lifecycle, Note};
use crate::metrics::Metrics;
use crate::node::Node;
use crate::storage::Storage;
use crate::takeover::{Gate, Phase, SvidWait};
use crate::xds::encoded::Encoded;
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

/// Runs the worker until the lifecycle exits; returns the exit code.
pub async fn run(cfg: Config, control_fd: OwnedFd) -> anyhow::Result<i32> {
    let mut agent = Agent::wire(cfg, control_fd).await?;
    let mut event = Event::Gates(*agent.gates.borrow_and_update());
    loop {
        if let Some(code) = agent.feed(event).await? {
            return Ok(code);
        }
        event = loop {
            let wake = tokio::select! {
                changed = agent.gates.changed() => match changed {
                    Ok(()) => Wake::Gates(*agent.gates.borrow_and_update()),
                    Err(_) => continue,
                },
                Some(ended) = agent.ended_rx.recv() => Wake::Ended(ended),
                command = agent.control.next() => Wake::Command(command),
            };
            break agent.event(wake)?;
        };
    }
}

/// What woke the driver.
enum Wake {
    Gates(Gates),
    Ended(Ended),
    Command(Result<Command, ControlError>),
}

/// What a task the driver started reports when it ends.
#[derive(Debug)]
enum Ended {
    GateTimer(Gate),
    /// The takeover reconcile, and how long it took; whether it took the standby's
    /// followed view without reading the folder.
    Reconciled(Duration, bool),
    /// The SVID wait: how long it took, and how many pods still had none.
    SvidsAwaited(Duration, usize),
    /// The CNI API finished its in-flight calls after a drain.
    CniDrained,
    /// The released owner is done with the proxy's streams.
    StreamsDone,
}

/// What performing an action leads to.
enum Then {
    Next,
    /// An answer for the lifecycle, stepped before the next action.
    Answer(Event),
    Exit(i32),
}

/// The node's descriptors, from the Takeover on.
struct NodeFds {
    /// The node lock's descriptor: held until the node is released after a drain, so the
    /// node stays owned while this worker serves even if its supervisor is gone.
    lock: Option<OwnedFd>,
    /// The listeners until serving starts, which consumes them.
    listeners: Option<(OwnedFd, OwnedFd)>,
}

/// The tasks the wiring starts that run as long as the worker; their handles are kept
/// with it.
#[allow(dead_code)] // Held, never read.
struct Sources {
    storage_upkeep: JoinHandle<()>,
    registry: JoinHandle<()>,
    capture: JoinHandle<()>,
    identity: Option<identity::Identity>,
    conflist: Option<JoinHandle<()>>,
    lock_wait: JoinHandle<()>,
}

/// The worker: the lifecycle, what the wiring built, and what the driver holds between
/// actions.
struct Agent {
    core: Lifecycle,
    cfg: Config,
    control: Control,
    node: Arc<Node>,
    gates: watch::Receiver<Gates>,
    storage: Arc<Storage>,
    metrics: Arc<Metrics>,
    status: Arc<watch::Sender<Status>>,
    /// The pods a standby took from the owner's records while following them.
    followed: Arc<Mutex<BTreeSet<String>>>,
    stop_following: watch::Sender<bool>,
    /// The standby's follow of the owner's records, until the takeover's reconcile takes
    /// what it leaves.
    follower: Option<tokio::task::JoinHandle<cni::Followed>>,
    /// The reconcile took the followed view unread: the owner's scan of the folder comes
    /// once serving.
    check_followed: bool,
    observed: Arc<writers::Observed>,
    mesh_dns: Arc<writers::MeshDns>,
    /// The node's QUIC pairs, when it has twins.
    quic_pairs: Option<Arc<writers::QuicPairs>>,
    /// The owner's writers of the pairs (file, registry), stopped at release.
    pair_writers: Vec<JoinHandle<()>>,
    kube: Option<kube::Kube>,
    acks: Acks,
    encoded: Arc<Encoded>,
    _sources: Sources,
    ended_tx: mpsc::Sender<Ended>,
    ended_rx: mpsc::Receiver<Ended>,
    node_fds: Option<NodeFds>,
    /// The pods lacking an SVID just before the reconcile (see `SvidWait`).
    svid_wait: SvidWait,
    serving: Option<Serving>,
    problems: health::Reporter,
    /// When the client-certificate gate started waiting (storage loaded).
    cert_gate_armed: Instant,
}

impl Agent {
    /// Builds what a standby and a lone agent start with alike: storage, the node and its
    /// sources, health, the control channel and the encoding cache. The one place the
    /// worker is wired.
    async fn wire(cfg: Config, control_fd: OwnedFd) -> anyhow::Result<Self> {
        let metrics = Metrics::new();
        let storage = Arc::new(
            Storage::open(&cfg.state_dir, metrics.clone()).context("opening pod storage")?,
        );
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
            inbound_access_log: cfg.agent.inbound_access_log.clone(),
            identity,
            quic_twins: cfg
                .agent
                .quic_twin_addr
                .filter(|_| pod_svids)
                .map(|address| aether_model::QuicTwins {
                    address,
                    max: cfg.agent.quic_twin_max,
                }),
            ..Inputs::default()
        });
        cni::load(&node, &storage);
        // The client-certificate gate follows the stored pods' SVIDs (with pods' SVIDs and
        // a bound); without, it has nothing to wait for.
        let cert_gate = pod_svids && !cfg.agent.pod_certificate_gate.is_zero();
        node.set_gate(|g| {
            g.pod_certificates =
                !cert_gate || node.with_inputs(|i| identity::lacking_svids(i).is_empty())
        });
        // A standby follows the owner's pod records until the node is handed to it.
        let followed = Arc::new(Mutex::new(BTreeSet::new()));
        let (stop_following, following) = watch::channel(false);
        let follower = tokio::spawn(cni::follow(
            node.clone(),
            storage.clone(),
            followed.clone(),
            following,
        ));
        // Restored in a standby too; written by the owner alone (see `writers`).
        let observed = writers::Observed::restore(&cfg.state_dir);
        let mesh_dns = writers::MeshDns::restore(&cfg.state_dir, node.clone(), metrics.clone());
        let status = Arc::new(watch::Sender::new(Status::new(
            &cfg.node_name,
            &cfg.pod_name,
        )));
        let problems = health::Reporter::new(status.clone());
        // Restored in a standby too; written (file and registry) by the owner alone.
        let quic_pairs = node.with_inputs(|i| i.quic_twins.is_some()).then(|| {
            writers::QuicPairs::restore(
                &cfg.state_dir,
                cfg.agent.quic_pair_window,
                node.clone(),
                metrics.clone(),
                status.clone(),
            )
        });
        tokio::spawn(show_versions(node.clone(), status.clone()));
        tokio::spawn(follow_twins_and_certificates(
            node.clone(),
            metrics.clone(),
            cert_gate,
        ));
        if cert_gate {
            status.send_modify(|s| {
                s.pod_certificate_gate = Some(health::PodCertificateGate {
                    state: "waiting",
                    bound_ms: cfg.agent.pod_certificate_gate.as_millis() as u64,
                    ..Default::default()
                })
            });
        }
        // Failed record writes show in /ready; deferred record removals are retried.
        let storage_upkeep = storage.start_upkeep(problems.clone());
        let registry = match registrar_source(&cfg, &node)? {
            Some((addrs, me)) => {
                registrar::spawn(addrs, me, node.clone(), metrics.clone(), problems.clone())
            }
            None => registry::spawn_embedded(
                cfg.agent.registry_file.clone(),
                cfg.agent.registry_max_bytes,
                node.clone(),
                metrics.clone(),
            ),
        };
        let capture = capture::spawn(
            cfg.agent.capture_file.clone(),
            node.clone(),
            metrics.clone(),
        );
        // Watches in a standby too; writes only once handed a writer at Serve.
        let kube = kube_source(&cfg, &metrics, &problems)?;
        // A standby too: it holds the agent's and the stored pods' SVIDs before it takes
        // over; with API access, only for the pods the API server places on this node.
        let identity = identity_cfg.map(|c| {
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
        let conflist = cfg
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
        let lock_wait = crate::lockwait::spawn(&cfg.run_dir, status.subscribe(), problems.clone());

        let control = Control::new(control_fd)?;
        // Encoded from the first snapshot on, in a standby too: a takeover answers with
        // copies.
        let encoded = Arc::new(Encoded::default());
        let acks = Acks::default();
        tokio::spawn(xds::encoded::keep_warm(
            node.subscribe(),
            encoded.clone(),
            metrics.clone(),
            xds::encoded::WarmHold {
                status: status.subscribe(),
                acks: acks.subscribe(),
                fresh: acks.fresh(),
                done: false,
                deadline: None,
            },
            xds::encoded::WarmGate {
                gates: node.gates(),
                set: Box::new({
                    let node = node.clone();
                    move || node.set_gate(|g| g.encodings_warm = true)
                }),
                marked: false,
            },
        ));
        let (ended_tx, ended_rx) = mpsc::channel(8);
        Ok(Self {
            core: Lifecycle::new(pod_svids),
            cfg,
            control,
            gates: node.gates(),
            node,
            storage,
            metrics,
            status,
            followed,
            stop_following,
            follower: Some(follower),
            check_followed: false,
            observed,
            mesh_dns,
            quic_pairs,
            pair_writers: Vec::new(),
            kube,
            acks,
            encoded,
            _sources: Sources {
                storage_upkeep,
                registry,
                capture,
                identity,
                conflist,
                lock_wait,
            },
            ended_tx,
            ended_rx,
            node_fds: None,
            svid_wait: SvidWait::default(),
            serving: None,
            problems,
            cert_gate_armed: Instant::now(),
        })
    }

    /// Turns what woke the driver into the lifecycle's event, doing first what cannot
    /// wait: a Takeover's descriptors are checked (and the standby stops following the
    /// owner's records) before anything else.
    fn event(&mut self, wake: Wake) -> anyhow::Result<Event> {
        Ok(match wake {
            Wake::Gates(g) => Event::Gates(g),
            Wake::Ended(Ended::GateTimer(gate)) => {
                let g = *self.gates.borrow();
                let passed = match gate {
                    Gate::Registry => g.registry_loaded,
                    Gate::Capture => g.capture_landed,
                    Gate::Identity => g.agent_svid,
                    Gate::PodCertificates => g.storage_loaded && g.pod_certificates,
                };
                Event::GateTimedOut { gate, passed }
            }
            Wake::Ended(Ended::Reconciled(took, followed)) => {
                self.check_followed = followed;
                Event::ReconcileDone { took }
            }
            Wake::Ended(Ended::SvidsAwaited(took, missed)) => Event::SvidsAwaited { took, missed },
            Wake::Ended(Ended::CniDrained) => Event::Drained,
            Wake::Ended(Ended::StreamsDone) => Event::StreamsDone,
            Wake::Command(Ok(Command::Drain { successor })) => Event::Drain { successor },
            Wake::Command(Ok(Command::Takeover(msg, fds))) => {
                // From here on this process writes the records: it stops reading them as
                // the owner writes.
                self.stop_following.send_replace(true);
                shared_proto::fault_hook!("takeover");
                let fds = fdcheck::check(&self.cfg.run_dir, fds)
                    .context("checking the Takeover descriptors")?;
                self.node_fds = Some(NodeFds {
                    lock: Some(fds.lock),
                    listeners: Some((fds.xds, fds.cni)),
                });
                Event::Takeover {
                    msg,
                    at: Instant::now(),
                    now_us: now_us(),
                }
            }
            Wake::Command(Err(e)) => {
                error!(error = %e, "control channel to the supervisor ended");
                Event::ControlEnded
            }
        })
    }

    /// Steps the lifecycle and performs its actions; an action's answer is stepped at
    /// once, before the next action. Then `/ready` shows the new state. Returns the exit
    /// code once the lifecycle exits.
    async fn feed(&mut self, event: Event) -> anyhow::Result<Option<i32>> {
        let mut actions = VecDeque::from(self.core.step(event));
        while let Some(action) = actions.pop_front() {
            match self.perform(action).await? {
                Then::Next => {}
                Then::Answer(answer) => {
                    for a in self.core.step(answer).into_iter().rev() {
                        actions.push_front(a);
                    }
                }
                Then::Exit(code) => return Ok(Some(code)),
            }
        }
        let core = &self.core;
        self.status.send_modify(|s| core.show(s));
        Ok(None)
    }

    async fn perform(&mut self, action: Action) -> anyhow::Result<Then> {
        match action {
            Action::Report(phase) => {
                self.control.report(phase)?;
                if matches!(phase, Phase::StandbyComplete | Phase::Serving) {
                    let after = self.cert_gate_armed.elapsed().as_millis() as u64;
                    self.status.send_modify(|s| {
                        if let Some(g) = &mut s.pod_certificate_gate {
                            g.ready_after_ms.get_or_insert(after);
                        }
                    });
                }
                info!(phase = phase.as_str(), owner = self.core.owner(), "phase");
            }
            Action::ArmGateTimers => {
                for (gate, after) in [
                    (Gate::Registry, REGISTRY_GATE),
                    (Gate::Capture, CAPTURE_GATE),
                    (Gate::Identity, IDENTITY_GATE),
                ] {
                    let tx = self.ended_tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        let _ = tx.send(Ended::GateTimer(gate)).await;
                    });
                }
            }
            Action::ArmPodCertificateGate => {
                self.cert_gate_armed = Instant::now();
                let (tx, after) = (self.ended_tx.clone(), self.cfg.agent.pod_certificate_gate);
                tokio::spawn(async move {
                    tokio::time::sleep(after).await;
                    let _ = tx.send(Ended::GateTimer(Gate::PodCertificates)).await;
                });
            }
            Action::Reconcile => {
                // The pods the standby took from the owner during the overlap are waited
                // for like those the reconcile adds.
                let taken = self
                    .followed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                self.svid_wait = SvidWait::new(
                    self.node
                        .with_inputs(identity::lacking_svids)
                        .difference(&taken)
                        .cloned()
                        .collect(),
                );
                // What the previous owner flushed before it released the node.
                self.observed.reload();
                let (node, storage, tx, follower) = (
                    self.node.clone(),
                    self.storage.clone(),
                    self.ended_tx.clone(),
                    self.follower.take(),
                );
                tokio::spawn(async move {
                    let start = Instant::now();
                    // Stopped at the takeover: it ends after any look under way.
                    let followed = match follower {
                        Some(f) => f.await.ok(),
                        None => None,
                    };
                    let how = cni::reconcile(&node, &storage, followed).await;
                    match &how {
                        Ok(cni::Reconciled::Followed) => info!(
                            changed = 0,
                            read = false,
                            "takeover reconcile: the standby had followed every write to the pod records; the owner's scan comes once serving"
                        ),
                        Ok(cni::Reconciled::Read(n)) => {
                            info!(
                                changed = n,
                                read = true,
                                "takeover reconcile applied the storage diff"
                            )
                        }
                        Err(e) => {
                            error!(error = %format!("{e:#}"), "takeover reconcile failed; serving what storage held at start")
                        }
                    }
                    shared_proto::fault_hook!("reconcile");
                    let followed = matches!(how, Ok(cni::Reconciled::Followed));
                    let _ = tx.send(Ended::Reconciled(start.elapsed(), followed)).await;
                });
            }
            Action::AwaitSvids => {
                let (node, wait, tx) = (
                    self.node.clone(),
                    std::mem::take(&mut self.svid_wait),
                    self.ended_tx.clone(),
                );
                tokio::spawn(async move {
                    let (took, missed) = await_svids(&node, &wait, SVID_WAIT).await;
                    let _ = tx.send(Ended::SvidsAwaited(took, missed)).await;
                });
            }
            Action::Serve { tidy } => {
                shared_proto::fault_hook!("serve");
                self.serving = Some(self.serve()?);
                let served = Event::Served {
                    at: Instant::now(),
                    now_us: now_us(),
                };
                // The owner alone writes the mesh-DNS snapshot and its heartbeat.
                tokio::spawn(writers::mesh_dns::run_writer(self.mesh_dns.clone()));
                // And the QUIC pairs: the file, and the registry when there is one. The
                // fetch window starts now.
                if let Some(pairs) = &self.quic_pairs {
                    pairs.start_serving();
                    self.pair_writers
                        .push(tokio::spawn(writers::quic_pairs::run_writer(pairs.clone())));
                    if let Some((addrs, me)) = registrar_source(&self.cfg, &self.node)? {
                        self.pair_writers.push(registrar::pairs::spawn(
                            addrs,
                            me,
                            pairs.clone(),
                            self.metrics.clone(),
                            self.status.clone(),
                        ));
                    }
                }
                // The owner's scan the reconcile left for after serving; not while the
                // proxy (or its relay) switches over to this owner, with which it would
                // compete for the CPU: after the proxy's first ACK of this owner, or
                // FIRST_ACK_WAIT without one.
                if std::mem::take(&mut self.check_followed) {
                    let (node, storage) = (self.node.clone(), self.storage.clone());
                    let mut acked = self.acks.subscribe();
                    tokio::spawn(async move {
                        let first_ack = acked.wait_for(Option::is_some);
                        let _ = tokio::time::timeout(xds::encoded::FIRST_ACK_WAIT, first_ack).await;
                        if let Err(e) = cni::check_followed(&node, &storage).await {
                            warn!(error = %format!("{e:#}"), "the owner's scan of the pod records folder failed");
                        }
                    });
                }
                // What `Storage::open` left in place, now that no one else writes; a
                // reconcile's reload already did it.
                if tidy {
                    let storage = self.storage.clone();
                    tokio::task::spawn_blocking(move || {
                        if let Err(e) = storage.tidy() {
                            warn!(error = %e, "tidying the pod records folder failed");
                        }
                    });
                }
                return Ok(Then::Answer(served));
            }
            Action::Drain => {
                // No Kubernetes write after this: a write in progress holds the lifecycle
                // lock, which the CNI API's fence waits for.
                if let Some(k) = &self.kube {
                    k.stop();
                }
                match self.serving.as_mut().and_then(|s| s.drain_cni.take()) {
                    Some(tx) => {
                        let _ = tx.send(());
                    }
                    // Nothing served: nothing in flight.
                    None => return Ok(Then::Exit(0)),
                }
            }
            Action::Release { await_successor } => {
                let serving = self.serving.take().expect("Release follows a served drain");
                let handover = serving.handover.clone();
                serving.close_xds_listener().await;
                // A relay that takes the overlap is told now: its next stream waits in the
                // socket's backlog for the successor while this owner's stream carries on.
                if await_successor {
                    handover.begin_overlap();
                }
                // Before the lock passes: the successor reloads the files at takeover. Off
                // the runtime thread (writes and fsyncs, 4 ms and more on a busy node), so
                // that the proxy's streams and the registry feed go on meanwhile: a change
                // made as the roll starts reaches the proxy through this owner.
                // The pairs' registry writers stop first: the final flush's state is the
                // last this process states (the successor states it from the file).
                for w in self.pair_writers.drain(..) {
                    w.abort();
                }
                let (observed, mesh_dns) = (self.observed.clone(), self.mesh_dns.clone());
                let pairs = self.quic_pairs.clone();
                let flushed = tokio::task::spawn_blocking(move || {
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
                    // The pairs' last write lands before the lock passes too; after it
                    // this process states no set to the registry.
                    if let Some(pairs) = pairs {
                        pairs.flush_final();
                    }
                });
                if let Err(e) = flushed.await {
                    error!(error = %e, "the release's flushes failed");
                }
                // The listeners went with the servers; the lock is the last descriptor of
                // the node this process holds besides the streams.
                if let Some(fds) = &mut self.node_fds {
                    fds.lock = None;
                }
                let (tx, xds_path) = (self.ended_tx.clone(), self.cfg.run_dir.join("xds.sock"));
                tokio::spawn(async move {
                    if await_successor {
                        self::await_successor(&xds_path).await;
                    }
                    let started = Instant::now();
                    let (relays, closed) = handover.end_relay_streams().await;
                    if relays > 0 {
                        info!(
                            relays,
                            closed,
                            took_us = started.elapsed().as_micros() as u64,
                            "ended the relays' streams: each re-states its session on the successor"
                        );
                    }
                    let _ = tx.send(Ended::StreamsDone).await;
                });
            }
            Action::Exit(code) => return Ok(Then::Exit(code)),
            Action::Note(note) => self.note(note),
        }
        Ok(Then::Next)
    }

    /// Logs, and counts, what the lifecycle notes.
    fn note(&self, note: Note) {
        let metrics = &self.metrics;
        match note {
            Note::GateTimedOut(gate) => {
                warn!(gate = ?gate, "first-serve gate timed out; a lone owner serves without it")
            }
            Note::PodCertificateGate { passed } => {
                let waited = self.cert_gate_armed.elapsed();
                let result = if passed { "passed" } else { "timed_out" };
                metrics
                    .pod_certificate_gate
                    .get_or_create(&crate::metrics::ResultLabel {
                        result: result.into(),
                    })
                    .inc();
                metrics
                    .pod_certificate_gate_seconds
                    .set(waited.as_secs_f64());
                // The problem is in place before /ready shows the gate timed out.
                let late = (!passed).then(|| {
                    let mut lacking = self.node.with_inputs(identity::lacking_svids);
                    let left =
                        report_late_certificates_now(&self.node, &self.problems, &mut lacking);
                    (lacking, left)
                });
                self.status.send_modify(|s| {
                    if let Some(g) = &mut s.pod_certificate_gate {
                        g.state = if passed { "passed" } else { "timed-out" };
                        g.waited_ms = waited.as_millis() as u64;
                    }
                });
                if passed {
                    info!(
                        waited_ms = waited.as_millis() as u64,
                        "client-certificate gate passed: every stored pod holds its SVID"
                    );
                } else if let Some((lacking, left)) = late {
                    warn!(
                        waited_ms = waited.as_millis() as u64,
                        pods = lacking.len(),
                        "client-certificate gate timed out; proceeding: those pods have no QUIC twin until their SVID comes"
                    );
                    if left {
                        tokio::spawn(report_late_certificates(
                            self.node.clone(),
                            self.problems.clone(),
                            lacking,
                        ));
                    }
                }
            }
            Note::TakeoverReceived {
                msg: t,
                fd_passing_us,
            } => {
                info!(
                    generation = t.generation,
                    handed_off = t.handed_off,
                    respawn = t.respawn,
                    uncontended = t.uncontended,
                    lock_wait_us = t.lock_wait_us,
                    bind_us = t.bind_us,
                    fd_passing_us,
                    "takeover received"
                );
                metrics.generation.set(t.generation as i64);
                // The supervisor's count: a new worker starts at 0 and catches up.
                metrics
                    .worker_respawns
                    .inc_by(t.respawns.saturating_sub(metrics.worker_respawns.get()));
                metrics.observe_phase("lock_wait", t.lock_wait_us as f64 / 1e6);
                metrics.observe_phase("bind", t.bind_us as f64 / 1e6);
                metrics.observe_phase("fd_passing", fd_passing_us as f64 / 1e6);
            }
            Note::SvidWait { took, missed } => {
                metrics.observe_phase("svid_wait", took.as_secs_f64());
                if missed > 0 {
                    warn!(
                        pods = missed,
                        waited_ms = took.as_millis() as u64,
                        "takeover: serving before every pod it added has its SVID"
                    );
                } else {
                    info!(
                        waited_us = took.as_micros() as u64,
                        "takeover: the pods it added hold their SVIDs"
                    );
                }
            }
            Note::Serving { taken, first_serve } => {
                metrics.observe_phase("reconcile", taken.times.reconcile_us as f64 / 1e6);
                metrics.observe_phase("first_serve", first_serve.as_secs_f64());
                info!(
                    generation = taken.generation,
                    total_us = taken.times.total_us,
                    first_serve_us = taken.times.first_serve_us,
                    reconcile_us = taken.times.reconcile_us,
                    "serving the node"
                );
            }
            Note::Drained { successor } => {
                info!(
                    successor,
                    "in-flight CNI calls finished; releasing the node"
                )
            }
            Note::Exiting => info!("exiting"),
        }
    }

    /// Starts serving both sockets, the owner-only writers and the metrics listener.
    fn serve(&mut self) -> anyhow::Result<Serving> {
        let listener = |fd: OwnedFd| -> anyhow::Result<tokio::net::UnixListener> {
            let std_l = std::os::unix::net::UnixListener::from(fd);
            std_l.set_nonblocking(true)?;
            Ok(tokio::net::UnixListener::from_std(std_l)?)
        };
        let (xds_fd, cni_fd) = self
            .node_fds
            .as_mut()
            .and_then(|fds| fds.listeners.take())
            .context("serving started twice")?;
        let xds_l = listener(xds_fd)?;
        let cni_l = listener(cni_fd)?;
        let (cfg, metrics) = (&self.cfg, &self.metrics);
        // The proxy keeps its stream until this process exits (a relay's ends at the
        // handover, `Handover`): a drain only stops accepting.
        let (stop_xds, stop_rx) = oneshot::channel::<()>();
        let handover = xds::server::Handover::default();
        let on_demand = cfg.agent.on_demand_clusters.then(|| self.observed.clone());
        let xds_accept = tokio::spawn(xds::server::serve(
            xds_l,
            self.node.subscribe(),
            self.encoded.clone(),
            self.acks.clone(),
            metrics.clone(),
            on_demand,
            async move {
                let _ = stop_rx.await;
            },
            xds::server::Limits::default(),
            if cfg.agent.xds_digest_resume {
                xds::server::Resume::Digest
            } else {
                xds::server::Resume::Plain
            },
            handover.clone(),
        ));
        // The owner alone writes what the proxy showed it uses.
        tokio::spawn(writers::run_writer(self.observed.clone()));
        // The owner alone sets drain marks: a standby never reaches this point.
        let marks = registrar_source(cfg, &self.node)?
            .map(|(addrs, me)| registrar::Marks::spawn(addrs, me, metrics.clone(), &cfg.state_dir));
        // The owner alone writes what the Kubernetes API shows (Terminating marks, stale
        // records, the startup taint), from now on.
        if let Some(k) = &self.kube {
            k.serve(kube::Writer::new(
                self.node.clone(),
                self.storage.clone(),
                marks.clone(),
                self.acks.clone(),
            ));
        }
        let (drain_cni, drain) = oneshot::channel();
        let (node, storage, acks, m, done) = (
            self.node.clone(),
            self.storage.clone(),
            self.acks.clone(),
            metrics.clone(),
            self.ended_tx.clone(),
        );
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = drain.await;
            };
            let mut service = cni::CniService::new(node, storage, Arc::new(acks), m);
            if let Some(marks) = marks {
                service = service.with_drain_marks(marks);
            }
            if let Err(e) = cni::serve(cni_l, service, shutdown, cni::Limits::default()).await {
                error!(error = %format!("{e:#}"), "CNI API stopped");
            }
            let _ = done.send(Ended::CniDrained).await;
        });
        if let Some(addr) = cfg.agent.metrics_addr.0 {
            tokio::spawn(serve_metrics(addr, metrics.clone()));
        }
        Ok(Serving {
            drain_cni: Some(drain_cni),
            stop_xds,
            xds_accept,
            handover,
        })
    }
}

/// How many pods the `pod-certificates` problem names.
const CERTIFICATES_LISTED: usize = 10;

/// After the client-certificate gate timed out: the `pod-certificates` problem names the
/// pods that were still without their SVID (at most [`CERTIFICATES_LISTED`], then a
/// count), updated as theirs come or they go, and cleared when none is left. The caller
/// has set it once already ([`report_late_certificates_now`]), before `/ready` shows the
/// gate's outcome.
async fn report_late_certificates(
    node: Arc<Node>,
    problems: health::Reporter,
    mut late: BTreeSet<String>,
) {
    let mut snapshots = node.subscribe();
    snapshots.borrow_and_update();
    while snapshots.changed().await.is_ok() {
        if !report_late_certificates_now(&node, &problems, &mut late) {
            return;
        }
    }
}

/// Sets the `pod-certificates` problem from the pods of `late` still without their SVID
/// (dropping those that have it or are gone), or clears it when none is left; false then.
fn report_late_certificates_now(
    node: &Node,
    problems: &health::Reporter,
    late: &mut BTreeSet<String>,
) -> bool {
    let names: Vec<String> = node.with_inputs(|i| {
        late.retain(|uid| i.pods.contains_key(uid) && !i.identity.pods.contains_key(uid));
        late.iter()
            .take(CERTIFICATES_LISTED)
            .map(|uid| match i.pods.get(uid) {
                Some(p) => format!("{}/{} ({uid})", p.namespace, p.name),
                None => uid.clone(),
            })
            .collect()
    });
    if late.is_empty() {
        problems.clear("pod-certificates");
        info!("every pod the client-certificate gate timed out on holds its SVID now");
        return false;
    }
    let more = late.len().saturating_sub(names.len());
    problems.set(
        "pod-certificates",
        format!(
            "{} stored pod(s) without their SVID when the client-certificate gate timed out; no QUIC twin until it comes: {}{}",
            late.len(),
            names.join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        ),
    );
    true
}

/// Shows the latest snapshot's versions on `/ready` (`xds_versions`), so that a check can
/// compare them with what the proxy holds.
async fn show_versions(node: Arc<Node>, status: Arc<watch::Sender<Status>>) {
    let mut snapshots = node.subscribe();
    loop {
        let versions = health::XdsVersions::of(&snapshots.borrow_and_update());
        status.send_if_modified(|s| {
            let changed = s.xds_versions.as_ref() != Some(&versions);
            s.xds_versions = Some(versions);
            changed
        });
        if snapshots.changed().await.is_err() {
            return;
        }
    }
}

/// Follows the snapshots: the QUIC twins served and those past the bound (metrics, and a
/// log line when the refused set changes), and, with the client-certificate gate on,
/// whether every local pod holds its SVID (the gate's input).
async fn follow_twins_and_certificates(node: Arc<Node>, metrics: Arc<Metrics>, cert_gate: bool) {
    let mut snapshots = node.subscribe();
    let mut refused_before: Vec<String> = Vec::new();
    loop {
        let snapshot = snapshots.borrow_and_update().clone();
        let twins = match snapshot
            .listeners
            .get(aether_model::QUIC_TWINS)
            .map(|l| &l.kind)
        {
            Some(aether_model::ListenerKind::QuicTwins { twins }) => twins.len(),
            _ => 0,
        };
        metrics.quic_twins.set(twins as i64);
        metrics
            .quic_twins_refused
            .set(snapshot.twins_refused.len() as i64);
        if snapshot.twins_refused != refused_before {
            if !snapshot.twins_refused.is_empty() {
                warn!(
                    refused = snapshot.twins_refused.len(),
                    twins,
                    pods = %snapshot.twins_refused.join(","),
                    "QUIC twins at --quic-twin-max: these pods have none"
                );
            }
            refused_before = snapshot.twins_refused.clone();
        }
        if cert_gate {
            let all = node.with_inputs(|i| identity::lacking_svids(i).is_empty());
            node.set_gate(|g| g.pod_certificates = all);
        }
        if snapshots.changed().await.is_err() {
            return;
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
    node: &Arc<Node>,
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
        registrar_spiffe_id: cfg.agent.registrar_spiffe_id.clone(),
        // With workload identity the agent's SVID is its client certificate.
        credentials: cfg
            .agent
            .spiffe_endpoint
            .is_some()
            .then(|| registrar::Credentials(node.clone())),
    };
    if let Some(id) = &me.registrar_spiffe_id {
        anyhow::ensure!(
            id.strip_prefix("spiffe://")
                .and_then(|r| r.split_once('/'))
                .is_some_and(|(td, path)| !td.is_empty() && !path.is_empty()),
            "--registrar-spiffe-id {id:?}: expected a SPIFFE ID, spiffe://TRUST-DOMAIN/PATH"
        );
    }
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
    /// Ends the relays' streams once the node is handed over.
    handover: xds::server::Handover,
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
            no_quic_twin: false,
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
