//! The supervisor's lifecycle: one explicit phase, the worker it runs and one set of
//! timers, advanced by `step(event, now)`, which returns the actions for the driver
//! (`supervise`) to perform. After Envoy's hot restart, whose parent keeps the logic in an
//! `Internal` class and the socket I/O outside, and the worker's own `takeover::step`.
//!
//! Pure: no syscall, no clock, no log. The process's resources (the lock, listeners, the
//! worker's control socket) are opaque values of a [`Resources`] type: the lifecycle
//! holds them in the phase that owns them, moves them into actions and never calls into
//! them. Dropping one, as a standby does with the listeners it held when it drains, is the
//! one effect it has; the tests use plain numbers.
//!
//! Phases: Standby → Taking → (Blocked ⇄ Taking) → Owning → Draining → Exiting; any phase
//! may drain. The worker's own conversation is the [`Monitor`]'s.

#[cfg(test)]
mod tests;
mod timers;

use std::fmt::Debug;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use shared_proto::backoff::Backoff;
use shared_proto::control::{Body, Drain, Ping, Takeover};

use crate::monitor::{Monitor, Notice, Violation, WorkerPhase};
use timers::fire;
pub use timers::{Timers, respawn_backoff};

pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A worker that has not answered a heartbeat for this long is killed and replaced.
pub const HEARTBEAT_DEADLINE: Duration = Duration::from_secs(5);
/// A worker that ran this long resets the respawn backoff (as does one that reached
/// StandbyComplete or Serving): the backoff only grows for a worker that keeps dying
/// before it gets anywhere.
pub const HEALTHY_RESET: Duration = Duration::from_secs(60);
/// How often the node sockets are tried again while a lock-less server answers.
pub const BIND_RETRY: Duration = Duration::from_millis(20);
/// How soon a standby asks the owner again after no answer, and after an offer.
pub const FETCH_RETRY: Duration = Duration::from_millis(200);
pub const FETCH_REFRESH: Duration = Duration::from_secs(2);
/// How often the owner checks that the node's conflist still chains aether-cni.
pub const CONFLIST_EVERY: Duration = Duration::from_secs(5);
/// How long a drained worker may take before it is killed.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(25);
/// A standby holding sockets that has found no owner on `handoff.sock` for this long,
/// while another process holds the lock, closes them (`Event::NoOwner`).
pub const HELD_ORPHANED: Duration = Duration::from_secs(1);
/// A standby that fetched the sockets this recently (it refreshes every
/// [`FETCH_REFRESH`]) counts as a successor at drain time.
pub const SUCCESSOR_FRESH: Duration = Duration::from_secs(5);

/// What the lifecycle holds without looking inside.
pub trait Resources: Debug {
    type Pid: Copy + Eq + Debug;
    /// The supervisor's end of a worker's control socket.
    type Control: Debug;
    /// The node lock, acquired.
    type Lock: Debug;
    /// Listeners kept for a takeover: the owner's, fetched over `handoff.sock`, or the
    /// ones systemd kept across a restart.
    type Held: Debug;
    /// The owned node: lock, both listeners, the `handoff.sock` listener.
    type Node: Debug;
}

#[derive(Debug)]
pub enum Phase<R: Resources> {
    /// Waiting for the node lock; the owner's listeners once fetched.
    Standby {
        held: Option<R::Held>,
    },
    /// The lock is ours and [`Action::TakeNode`] is out: the driver answers at once with
    /// [`Event::Took`], [`Event::Blocked`] or [`Event::TakeFailed`]. `quiet`: a retry, whose
    /// block is not reported again.
    Taking {
        since: Instant,
        quiet: bool,
    },
    /// The lock is ours, but a server without it still answers on a socket path.
    Blocked {
        lock: R::Lock,
        since: Instant,
    },
    Owning(Owned<R>),
    /// Drain requested; `node` until the worker released it.
    Draining {
        node: Option<Owned<R>>,
    },
    Exiting(i32),
}

/// The node, while this supervisor holds it.
#[derive(Debug)]
pub struct Owned<R: Resources> {
    pub node: R::Node,
    pub took: Took,
    /// When a standby last fetched the node sockets.
    offered_at: Option<Instant>,
    /// When sockets handed over came to this supervisor, while no socket keeper is known
    /// to hold them: a standby of the previous owner may hold them too, fetched before the
    /// takeover, and wait for the lock (`Event::Took`). Cleared once the keeper fetches
    /// them, since an agent that wins the lock then takes them from the keeper.
    shared_at: Option<Instant>,
    /// A worker was sent this node already: the next Takeover is a respawn's.
    taken_over: bool,
}

/// How the node was taken, as the Takeover message reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Took {
    pub generation: u64,
    /// The listeners came from the previous generation (or the socket keeper).
    pub handed_off: bool,
    /// They came from the socket keeper, which goes on holding them.
    pub kept: bool,
    /// The lock was free at the first try.
    pub uncontended: bool,
    pub lock_wait: Duration,
    pub bind: Duration,
}

/// The worker process, while it runs.
#[derive(Debug)]
pub struct Worker<R: Resources> {
    pub pid: R::Pid,
    pub control: R::Control,
    monitor: Monitor,
    started: Instant,
    /// The seq of the last Ping sent.
    pinged: u64,
    /// It closed its end of the control socket: nothing more to read.
    closed: bool,
    /// SIGKILL sent: nothing it says counts any more.
    killed: bool,
}

#[derive(Debug)]
pub enum Event<R: Resources> {
    /// Time passed: whatever timer is due runs.
    Tick,
    /// SIGTERM or SIGINT.
    DrainRequested,
    Spawned {
        pid: R::Pid,
        control: R::Control,
    },
    SpawnFailed,
    /// One decoded message from the worker.
    Message(Body),
    /// The worker closed its control socket.
    ControlClosed,
    /// The worker sent something undecodable, or descriptors it must not send.
    ControlBroken(String),
    /// A child exited; `code` as the supervisor would exit with it.
    Exited {
        pid: R::Pid,
        code: i32,
        status: String,
    },
    LockAcquired(R::Lock),
    LockFailed,
    Took(R::Node, Took),
    /// A lock-less server answers on `path`; the lock comes back.
    Blocked {
        lock: R::Lock,
        path: PathBuf,
    },
    TakeFailed,
    /// The owner's listeners, or none (no owner answered, or its offer was refused).
    Fetched(Option<R::Held>),
    /// Nothing listens on `handoff.sock` (no socket there, or refused): no owner offers
    /// the node sockets.
    NoOwner,
    /// The owner's `handoff.sock` served a peer; `keeper`: the node's socket keeper.
    Offered {
        keeper: bool,
    },
    TakeoverNotSent(String),
}

#[derive(Debug)]
pub enum Action<R: Resources> {
    Spawn,
    /// Sends Ping or Drain to the current worker.
    Send(Body),
    /// Sends Takeover with the node's lock and listeners; the driver stamps `sent_at_us`.
    SendTakeover(Takeover),
    Kill {
        pid: R::Pid,
        why: Kill,
    },
    /// Gets the node's listeners: `held` if each is still bound at its path (asking the
    /// socket keeper first when `ask_keeper`), else fresh ones. Then records the
    /// generation and opens `handoff.sock`.
    TakeNode {
        lock: R::Lock,
        held: Option<R::Held>,
        ask_keeper: bool,
        since: Instant,
    },
    FetchHandoff,
    ReassertConflist,
    /// Puts duplicates of the listeners in systemd's fd store, where there is one.
    StoreListeners,
    /// Tells systemd's watchdog (`WATCHDOG=1`, where `WatchdogSec=` asks for it) that this
    /// supervisor runs and its worker answered a heartbeat. Only a Pong leads to it, so a
    /// worker that stops answering, or keeps dying, lets the watchdog restart the unit.
    Watchdog,
    /// Unlocks the node (the worker shares the lock's open file description) and closes
    /// this supervisor's descriptors of it.
    Release(R::Node),
    Report(Report<R>),
}

/// Why a worker is killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kill {
    MissedHeartbeats,
    DrainDeadline,
    /// Drain requested before it said Hello: nothing to drain.
    NoHello,
    Violation(Violation),
    Malformed(String),
    TakeoverNotSent(String),
    /// It closed its control socket: it is dying; make sure, and respawn now.
    Dying,
}

/// What the driver logs, and tells systemd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report<R: Resources> {
    Respawning {
        pid: R::Pid,
        how: String,
        ran: Duration,
        delay: Duration,
        respawns: u64,
    },
    /// SIGCHLD of a worker already replaced on its control socket's end.
    ReplacedReaped {
        status: String,
    },
    StandbyComplete,
    Serving {
        generation: u64,
    },
    WorkerDraining,
    DrainRequested {
        owner: bool,
        successor: bool,
    },
    ExitedAfterDrain {
        status: String,
    },
    /// The released worker closed its control socket: the supervisor's job is done.
    ReleasedClosed,
    /// The lock came when this supervisor no longer takes the node.
    LockIgnored,
    LiveServer {
        path: PathBuf,
    },
    /// The held sockets' owner is gone, yet another process holds the lock: closed.
    HeldOrphaned,
}

pub struct Lifecycle<R: Resources> {
    phase: Phase<R>,
    worker: Option<Worker<R>>,
    timers: Timers,
    backoff: Backoff,
    /// Workers respawned so far (reported in Takeover).
    respawns: u64,
    /// `--cni-conf-dir` is set: the owner re-asserts the conflist.
    conflist: bool,
    /// Since when this standby's fetches have found no owner on `handoff.sock`.
    no_owner_since: Option<Instant>,
}

impl<R: Resources> Lifecycle<R> {
    /// A standby (holding `held` when systemd kept listeners) that starts its worker and
    /// asks for the owner's listeners at once.
    pub fn new(now: Instant, held: Option<R::Held>, conflist: bool) -> Self {
        let timers = Timers {
            respawn: Some(now),
            fetch: Some(now),
            ..Timers::default()
        };
        Self {
            phase: Phase::Standby { held },
            worker: None,
            timers,
            backoff: respawn_backoff(),
            respawns: 0,
            conflist,
            no_owner_since: None,
        }
    }

    pub fn timers(&self) -> &Timers {
        &self.timers
    }

    pub fn exit_code(&self) -> Option<i32> {
        match self.phase {
            Phase::Exiting(code) => Some(code),
            _ => None,
        }
    }

    pub fn worker(&self) -> Option<&Worker<R>> {
        self.worker.as_ref()
    }

    /// The worker's control socket, while there is something to read on it.
    pub fn control(&self) -> Option<&R::Control> {
        self.worker
            .as_ref()
            .filter(|w| !w.closed)
            .map(|w| &w.control)
    }

    /// The node, from takeover until the worker released it.
    pub fn node(&self) -> Option<&R::Node> {
        match &self.phase {
            Phase::Owning(o) | Phase::Draining { node: Some(o) } => Some(&o.node),
            _ => None,
        }
    }

    pub fn held(&self) -> Option<&R::Held> {
        match &self.phase {
            Phase::Standby { held } => held.as_ref(),
            _ => None,
        }
    }

    pub fn step(&mut self, event: Event<R>, now: Instant) -> Vec<Action<R>> {
        let mut out = Vec::new();
        match event {
            Event::Tick => self.tick(now, &mut out),
            Event::DrainRequested => self.drain(now, &mut out),
            Event::Spawned { pid, control } => {
                let monitor = Monitor::default();
                self.worker = Some(Worker {
                    pid,
                    control,
                    monitor,
                    started: now,
                    pinged: 0,
                    closed: false,
                    killed: false,
                });
            }
            Event::SpawnFailed => self.timers.respawn = Some(now + self.backoff.next_wait()),
            Event::Message(body) => self.on_message(&body, now, &mut out),
            Event::ControlClosed => self.on_closed(now, &mut out),
            Event::ControlBroken(detail) => self.kill(Kill::Malformed(detail), &mut out),
            Event::Exited { pid, code, status } => self.on_exit(pid, code, status, now, &mut out),
            Event::LockAcquired(lock) => match self.take_phase() {
                Phase::Standby { held } => {
                    self.timers.fetch = None;
                    self.phase = Phase::Taking {
                        since: now,
                        quiet: false,
                    };
                    out.push(Action::TakeNode {
                        lock,
                        ask_keeper: held.is_none(),
                        held,
                        since: now,
                    });
                }
                other => {
                    // The lock thread reports once; only a draining supervisor sees it
                    // late. Dropping the lock closes it: the node stays free.
                    self.phase = other;
                    out.push(Action::Report(Report::LockIgnored));
                }
            },
            Event::LockFailed => {
                if matches!(self.phase, Phase::Standby { .. }) {
                    self.exit(1);
                }
            }
            Event::Took(node, took) => match self.take_phase() {
                Phase::Taking { .. } => {
                    // Sockets handed over may be held by a standby of the previous owner
                    // too: a drain soon after counts it as a successor, so that whoever
                    // wins the lock then can take the sockets from this one, unless the
                    // keeper holds them (a recreate roll's new agent takes them from it).
                    let shared_at = (took.handed_off && !took.kept).then_some(now);
                    self.phase = Phase::Owning(Owned {
                        node,
                        took,
                        offered_at: None,
                        shared_at,
                        taken_over: false,
                    });
                    self.send_takeover(&mut out);
                    // After the Takeover is out: the file work is never on the takeover's path.
                    self.timers.conflist = self.conflist.then_some(now);
                    out.push(Action::StoreListeners);
                }
                other => {
                    self.phase = other;
                    out.push(Action::Release(node));
                }
            },
            Event::Blocked { lock, path } => match self.take_phase() {
                Phase::Taking { since, quiet } => {
                    if !quiet {
                        out.push(Action::Report(Report::LiveServer { path }));
                    }
                    self.phase = Phase::Blocked { lock, since };
                    self.timers.retry = Some(now + BIND_RETRY);
                }
                other => self.phase = other,
            },
            Event::TakeFailed => self.exit(1),
            Event::Fetched(fetched) => {
                self.no_owner_since = None;
                if let Phase::Standby { held } = &mut self.phase {
                    let got = fetched.is_some();
                    if got {
                        *held = fetched;
                    }
                    self.timers.fetch = Some(now + if got { FETCH_REFRESH } else { FETCH_RETRY });
                }
            }
            Event::NoOwner => {
                if let Phase::Standby { held } = &mut self.phase {
                    let since = *self.no_owner_since.get_or_insert(now);
                    if held.is_some() && now.duration_since(since) >= HELD_ORPHANED {
                        // The owner they came from is gone, yet the lock is not ours: its
                        // holder has no sockets and waits for every copy of the old ones
                        // to close (a server without the lock still answers), while this
                        // standby waits for the lock. Closing ours ends both waits.
                        *held = None;
                        self.no_owner_since = None;
                        out.push(Action::Report(Report::HeldOrphaned));
                    }
                    self.timers.fetch = Some(now + FETCH_RETRY);
                }
            }
            Event::Offered { keeper } => {
                if let Phase::Owning(o) | Phase::Draining { node: Some(o) } = &mut self.phase {
                    if keeper {
                        o.shared_at = None;
                    } else {
                        o.offered_at = Some(now);
                    }
                }
            }
            Event::TakeoverNotSent(e) => self.kill(Kill::TakeoverNotSent(e), &mut out),
        }
        out
    }

    fn take_phase(&mut self) -> Phase<R> {
        std::mem::replace(&mut self.phase, Phase::Exiting(1))
    }

    fn exit(&mut self, code: i32) {
        self.phase = Phase::Exiting(code);
        self.timers = Timers::default();
    }

    fn tick(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let t = &mut self.timers;
        if fire(&mut t.respawn, now) && self.worker.is_none() {
            out.push(Action::Spawn);
        }
        if fire(&mut t.retry, now) {
            match self.take_phase() {
                Phase::Blocked { lock, since } => {
                    self.phase = Phase::Taking { since, quiet: true };
                    out.push(Action::TakeNode {
                        lock,
                        held: None,
                        ask_keeper: true,
                        since,
                    });
                }
                other => self.phase = other,
            }
        }
        let t = &mut self.timers;
        if fire(&mut t.fetch, now) {
            out.push(Action::FetchHandoff);
        }
        if fire(&mut t.conflist, now) {
            t.conflist = Some(now + CONFLIST_EVERY);
            out.push(Action::ReassertConflist);
        }
        if fire(&mut t.drain, now) {
            self.kill(Kill::DrainDeadline, out);
        }
        let t = &mut self.timers;
        let Some(w) = &mut self.worker else { return };
        if fire(&mut t.heartbeat, now) {
            // One kill a deadline: SIGCHLD or the socket's end follows.
            t.heartbeat = Some(now + HEARTBEAT_DEADLINE);
            w.killed = true;
            out.push(Action::Kill {
                pid: w.pid,
                why: Kill::MissedHeartbeats,
            });
        } else if fire(&mut t.ping, now) && !w.closed {
            t.ping = Some(now + HEARTBEAT_EVERY);
            w.pinged += 1;
            out.push(Action::Send(Body::Ping(Ping { seq: w.pinged })));
        }
    }

    fn drain(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let node = match self.take_phase() {
            p @ (Phase::Draining { .. } | Phase::Exiting(_)) => {
                self.phase = p;
                return;
            }
            Phase::Owning(o) => Some(o),
            // A standby's held listeners, or a lock still blocked: closed here, the node
            // stays with whoever else holds it.
            Phase::Standby { .. } | Phase::Taking { .. } | Phase::Blocked { .. } => None,
        };
        let successor = node
            .as_ref()
            .and_then(|o| o.offered_at.max(o.shared_at))
            .is_some_and(|t| now.duration_since(t) < SUCCESSOR_FRESH);
        out.push(Action::Report(Report::DrainRequested {
            owner: node.is_some(),
            successor,
        }));
        self.timers = Timers {
            ping: self.timers.ping,
            heartbeat: self.timers.heartbeat,
            ..Timers::default()
        };
        match self
            .worker
            .as_mut()
            .map(|w| (w.monitor.may_send_drain(), &mut w.monitor))
        {
            Some((true, monitor)) => {
                monitor.drain_sent();
                out.push(Action::Send(Body::Drain(Drain { successor })));
            }
            Some((false, _)) => self.kill(Kill::NoHello, out),
            None => {
                if let Some(o) = node {
                    out.push(Action::Release(o.node));
                }
                return self.exit(0);
            }
        }
        self.timers.drain = Some(now + DRAIN_DEADLINE);
        self.phase = Phase::Draining { node };
    }

    fn kill(&mut self, why: Kill, out: &mut Vec<Action<R>>) {
        if let Some(w) = self.worker.as_mut().filter(|w| !w.killed) {
            w.killed = true;
            out.push(Action::Kill { pid: w.pid, why });
        }
    }

    fn on_message(&mut self, body: &Body, now: Instant, out: &mut Vec<Action<R>>) {
        let Some(w) = self.worker.as_mut().filter(|w| !w.killed) else {
            return;
        };
        let notice = match w.monitor.on_message(body) {
            Ok(Notice::Pong(seq)) if seq == 0 || seq > w.pinged => {
                let detail = format!("Pong {seq} answers no Ping (the last was {})", w.pinged);
                Err(Violation {
                    phase: w.monitor.phase(),
                    detail,
                })
            }
            other => other,
        };
        match notice {
            Err(v) => self.kill(Kill::Violation(v), out),
            Ok(Notice::Hello) => {
                self.timers.ping = Some(now + HEARTBEAT_EVERY);
                self.timers.heartbeat = Some(now + HEARTBEAT_DEADLINE);
                self.send_takeover(out);
            }
            Ok(Notice::Pong(_)) => {
                self.timers.heartbeat = Some(now + HEARTBEAT_DEADLINE);
                out.push(Action::Watchdog);
            }
            Ok(Notice::StandbyComplete) => {
                self.backoff.reset();
                // A status that crossed our Takeover says nothing new to systemd.
                if !matches!(self.phase, Phase::Owning(_) | Phase::Draining { .. }) {
                    out.push(Action::Report(Report::StandbyComplete));
                }
            }
            Ok(Notice::Serving) => {
                self.backoff.reset();
                let generation = self.took().map_or(0, |t| t.generation);
                out.push(Action::Report(Report::Serving { generation }));
            }
            Ok(Notice::Draining) => out.push(Action::Report(Report::WorkerDraining)),
            Ok(Notice::Released) => {
                if let Phase::Draining { node } = &mut self.phase
                    && let Some(o) = node.take()
                {
                    out.push(Action::Release(o.node));
                }
            }
            Ok(Notice::Reconciling | Notice::Crossed) => {}
        }
    }

    /// How the node was taken, while it is held.
    pub fn took(&self) -> Option<Took> {
        match &self.phase {
            Phase::Owning(o) | Phase::Draining { node: Some(o) } => Some(o.took),
            _ => None,
        }
    }

    /// Hands the node to a worker that said Hello and has not had it yet.
    fn send_takeover(&mut self, out: &mut Vec<Action<R>>) {
        let (Phase::Owning(o), Some(w)) = (&mut self.phase, &mut self.worker) else {
            return;
        };
        if w.killed || !w.monitor.may_send_takeover() {
            return;
        }
        w.monitor.takeover_sent();
        let t = o.took;
        out.push(Action::SendTakeover(Takeover {
            generation: t.generation,
            respawn: std::mem::replace(&mut o.taken_over, true),
            handed_off: t.handed_off,
            lock_wait_us: micros(t.lock_wait),
            bind_us: micros(t.bind),
            sent_at_us: 0,
            uncontended: t.uncontended,
            respawns: self.respawns,
        }));
    }

    fn on_closed(&mut self, now: Instant, out: &mut Vec<Action<R>>) {
        let Some(w) = &mut self.worker else { return };
        if w.monitor.phase() == WorkerPhase::Released {
            // It handed everything on and is exiting: its job is done, so is ours. Its
            // SIGCHLD is not waited for (the kernel's teardown can take a grace period).
            out.push(Action::Report(Report::ReleasedClosed));
            return self.exit(0);
        }
        if matches!(self.phase, Phase::Draining { .. }) {
            // The drained worker is exiting; its SIGCHLD ends the supervisor.
            w.closed = true;
            return;
        }
        // A dying worker's control socket closes before the kernel has finished its exit,
        // which can wait for a grace period (closing an inotify instance does). Make sure
        // it dies and respawn now; its SIGCHLD is reaped when it comes.
        if !w.killed {
            out.push(Action::Kill {
                pid: w.pid,
                why: Kill::Dying,
            });
        }
        self.respawn_after("closed its control socket".into(), now, out);
    }

    fn on_exit(
        &mut self,
        pid: R::Pid,
        code: i32,
        status: String,
        now: Instant,
        out: &mut Vec<Action<R>>,
    ) {
        if self.worker.as_ref().is_none_or(|w| w.pid != pid) {
            out.push(Action::Report(Report::ReplacedReaped { status }));
            return;
        }
        if matches!(self.phase, Phase::Draining { .. }) {
            self.worker = None;
            out.push(Action::Report(Report::ExitedAfterDrain { status }));
            return self.exit(code);
        }
        self.respawn_after(format!("exited: {status}"), now, out);
    }

    /// The worker is gone: schedule its successor.
    fn respawn_after(&mut self, how: String, now: Instant, out: &mut Vec<Action<R>>) {
        let Some(w) = self.worker.take() else { return };
        let ran = now.duration_since(w.started);
        if ran >= HEALTHY_RESET {
            self.backoff.reset();
        }
        self.respawns += 1;
        let delay = self.backoff.next_wait();
        (self.timers.ping, self.timers.heartbeat) = (None, None);
        self.timers.respawn = Some(now + delay);
        out.push(Action::Report(Report::Respawning {
            pid: w.pid,
            how,
            ran,
            delay,
            respawns: self.respawns,
        }));
    }
}

pub fn micros(d: Duration) -> u64 {
    d.as_micros().try_into().unwrap_or(u64::MAX)
}
