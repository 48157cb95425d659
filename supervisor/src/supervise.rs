//! The supervisor's event loop: one thread, `poll(2)` over the signal descriptor, the
//! node-lock wake-up, the worker's control socket and the handoff listener, with timers
//! for heartbeats, respawns, retries and, while it owns the node, the CNI conflist
//! re-assertion. No async runtime.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use shared_proto::control::{Body, Drain, Ping, Takeover};
use shared_proto::fdpass;
use tracing::{debug, error, info, warn};

use crate::config::Config;
use crate::conflist;
use crate::handoff;
use crate::monitor::{Monitor, Notice};
use crate::sys::listen::{self, ListenError};
use crate::sys::{self, lock};
use crate::sys::spawn::{self, Image, Plan};

const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// A worker that has not answered a heartbeat for this long is killed and replaced.
const HEARTBEAT_DEADLINE: Duration = Duration::from_secs(5);
/// Respawn delays: the first crash after a healthy run is respawned at once (the node's
/// sockets keep queueing the proxy's reconnect meanwhile); a worker that keeps dying is
/// respawned after 0.1 s, then 0.2 s, doubling up to 5 s.
const RESPAWN_MIN: Duration = Duration::from_millis(100);
const RESPAWN_MAX: Duration = Duration::from_secs(5);
/// A worker that ran this long resets the respawn backoff (as does one that reached
/// StandbyComplete or Serving): the backoff only grows for a worker that keeps dying
/// before it gets anywhere.
const HEALTHY_RESET: Duration = Duration::from_secs(60);
const BIND_RETRY: Duration = Duration::from_millis(20);
const HANDOFF_RETRY: Duration = Duration::from_millis(200);
const HANDOFF_REFRESH: Duration = Duration::from_secs(2);
/// How often the owner checks that the node's conflist still chains aether-cni.
const CONFLIST_EVERY: Duration = Duration::from_secs(5);
/// How long a drained worker may take before it is killed.
const DRAIN_DEADLINE: Duration = Duration::from_secs(25);
/// A standby that fetched the sockets this recently (it refreshes every
/// [`HANDOFF_REFRESH`]) counts as a successor at drain time.
const SUCCESSOR_FRESH: Duration = Duration::from_secs(5);

struct Worker {
    pid: Pid,
    control: OwnedFd,
    monitor: Monitor,
    started: Instant,
    last_pong: Instant,
    next_ping: Instant,
    seq: u64,
    /// The worker closed its end: it is exiting.
    closed: bool,
}

/// The node, once this supervisor holds the lock.
struct Owned {
    lock: std::fs::File,
    xds: OwnedFd,
    cni: OwnedFd,
    ids: [(u64, u64); 2],
    generation: u64,
    handed_off: bool,
    uncontended: bool,
    lock_wait: Duration,
    bind: Duration,
    handoff: Option<OwnedFd>,
    /// When a standby last fetched the node sockets over `handoff.sock`.
    offered_at: Option<Instant>,
    /// A worker has been sent the node already.
    taken_over: bool,
}

pub struct Supervisor {
    cfg: Config,
    image: Image,
    plan: Plan,
    owner: (u32, u32),
    signals: SignalFd,
    /// Readable once the lock thread has a result; `None` after its end closed, so that
    /// poll does not keep reporting the hang-up (the owner would spin on it).
    lock_wake: Option<UnixStream>,
    lock_rx: mpsc::Receiver<Result<lock::Held, lock::LockError>>,
    /// The lock, acquired but waiting for the socket paths to be free.
    pending: Option<lock::Held>,
    pending_since: Option<Instant>,
    bind_retry_at: Option<Instant>,
    owned: Option<Owned>,
    held: Option<handoff::Held>,
    handoff_at: Instant,
    worker: Option<Worker>,
    respawn_at: Option<Instant>,
    backoff: Duration,
    respawns: u64,
    drain_deadline: Option<Instant>,
    /// Next conflist check (owner with --cni-conf-dir only), and the last result logged.
    conflist_at: Option<Instant>,
    conflist_last: Option<String>,
    exit: Option<i32>,
}

/// The node's listeners, xds then cni, with their paths' (dev, ino).
type Listeners = (OwnedFd, OwnedFd, [(u64, u64); 2]);

fn micros(d: Duration) -> u64 {
    d.as_micros().try_into().unwrap_or(u64::MAX)
}

fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!(error = %e, "sd_notify failed");
    }
}

impl Supervisor {
    pub fn new(
        cfg: Config,
        signals: SignalFd,
        worker_args: Vec<String>,
        env: Vec<(String, String)>,
        from_systemd: (Option<OwnedFd>, Option<OwnedFd>),
    ) -> anyhow::Result<Self> {
        let held = held_from_systemd(&cfg, from_systemd);
        let root = nix::unistd::geteuid().is_root();
        let worker_path = cfg.worker_bin.clone().unwrap_or_else(spawn::default_worker_path);
        let image = Image::open(&worker_path)?;
        let plan = Plan::new(worker_args, env, root.then_some(cfg.worker_user))?;
        let owner = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
        let lock_path = cfg.lock_path();
        let lock_file = lock::open(&lock_path)?;
        let (lock_wake, wake_w) = UnixStream::pair()?;
        lock_wake.set_nonblocking(true)?;
        let lock_rx = lock::spawn_waiter(lock_file, lock_path, wake_w);
        Ok(Self {
            cfg,
            image,
            plan,
            owner,
            signals,
            lock_wake: Some(lock_wake),
            lock_rx,
            pending: None,
            pending_since: None,
            bind_retry_at: None,
            owned: None,
            held,
            handoff_at: Instant::now(),
            worker: None,
            respawn_at: Some(Instant::now()),
            backoff: Duration::ZERO,
            respawns: 0,
            drain_deadline: None,
            conflist_at: None,
            conflist_last: None,
            exit: None,
        })
    }

    /// Runs until the worker exits after a drain request. Returns the exit code.
    pub fn run(mut self) -> i32 {
        info!(worker = %self.image.path.display(), uid = ?self.plan.drop_to, "supervisor started; waiting for the node lock");
        notify(&[sd_notify::NotifyState::Status("standby: waiting for the node lock")]);
        while self.exit.is_none() {
            self.tick();
            if self.exit.is_some() {
                break;
            }
            self.wait_and_dispatch();
        }
        self.exit.unwrap_or(1)
    }

    /// Time-driven work: respawns, heartbeats, retries.
    fn tick(&mut self) {
        let now = Instant::now();
        if self.respawn_at.is_some_and(|t| t <= now) && self.worker.is_none() {
            self.respawn_at = None;
            self.spawn_worker();
        }
        if self.bind_retry_at.is_some_and(|t| t <= now) {
            self.bind_retry_at = None;
            self.try_take_node();
        }
        if self.owned.is_none() && self.exit.is_none() && self.drain_deadline.is_none() && self.handoff_at <= now {
            self.fetch_handoff();
        }
        if self.owned.is_some() && self.drain_deadline.is_none() && self.conflist_at.is_some_and(|t| t <= now) {
            self.reassert_conflist();
        }
        if let Some(d) = self.drain_deadline
            && d <= now
            && let Some(w) = &self.worker
        {
            error!(pid = w.pid.as_raw(), "worker did not finish draining in {DRAIN_DEADLINE:?}; killing it");
            let _ = kill(w.pid, Signal::SIGKILL);
            self.drain_deadline = None;
        }
        let mut ping = None;
        if let Some(w) = &mut self.worker
            && w.monitor.phase() != crate::monitor::WorkerPhase::AwaitHello
        {
            if now.duration_since(w.last_pong) > HEARTBEAT_DEADLINE {
                error!(pid = w.pid.as_raw(), "worker missed heartbeats for {HEARTBEAT_DEADLINE:?}; killing it");
                let _ = kill(w.pid, Signal::SIGKILL);
                w.last_pong = now; // One kill is enough; SIGCHLD follows.
            } else if w.next_ping <= now {
                w.seq += 1;
                w.next_ping = now + HEARTBEAT_EVERY;
                ping = Some(w.seq);
            }
        }
        if let Some(seq) = ping {
            self.send(Body::Ping(Ping { seq }), &[]);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut ds = vec![self.respawn_at, self.bind_retry_at, self.drain_deadline];
        if self.owned.is_some() && self.drain_deadline.is_none() {
            ds.push(self.conflist_at);
        }
        if self.owned.is_none() && self.drain_deadline.is_none() {
            ds.push(Some(self.handoff_at));
        }
        if let Some(w) = &self.worker {
            ds.push(Some(w.next_ping));
            ds.push(Some(w.last_pong + HEARTBEAT_DEADLINE));
        }
        ds.into_iter().flatten().min()
    }

    fn wait_and_dispatch(&mut self) {
        let timeout = match self.next_deadline() {
            Some(d) => PollTimeout::try_from(d.saturating_duration_since(Instant::now()) + Duration::from_millis(1))
                .unwrap_or(PollTimeout::MAX),
            None => PollTimeout::NONE,
        };
        let (sig, wake, ctl, hand) = {
            let mut fds = vec![PollFd::new(self.signals.as_fd(), PollFlags::POLLIN)];
            let wake_i = self.lock_wake.as_ref().map(|w| {
                fds.push(PollFd::new(w.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let ctl_i = self.worker.as_ref().filter(|w| !w.closed).map(|w| {
                fds.push(PollFd::new(w.control.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            let hand_i = self.owned.as_ref().and_then(|o| o.handoff.as_ref()).map(|h| {
                fds.push(PollFd::new(h.as_fd(), PollFlags::POLLIN));
                fds.len() - 1
            });
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    error!(error = %e, "poll failed");
                    self.exit = Some(1);
                    return;
                }
            }
            let ready = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
            (ready(0), wake_i.is_some_and(ready), ctl_i.is_some_and(ready), hand_i.is_some_and(ready))
        };
        if sig {
            self.on_signals();
        }
        if wake {
            self.on_lock_wake();
        }
        if ctl {
            self.on_control();
        }
        if hand {
            self.on_handoff_connection();
        }
    }

    fn on_signals(&mut self) {
        while let Ok(Some(info)) = self.signals.read_signal() {
            match Signal::try_from(info.ssi_signo as i32) {
                Ok(Signal::SIGTERM) | Ok(Signal::SIGINT) => self.begin_drain(),
                Ok(Signal::SIGCHLD) => self.reap(),
                _ => {}
            }
        }
    }

    fn begin_drain(&mut self) {
        if self.drain_deadline.is_some() || self.exit.is_some() {
            return;
        }
        let successor = self.owned.as_ref().and_then(|o| o.offered_at).is_some_and(|t| t.elapsed() < SUCCESSOR_FRESH);
        info!(owner = self.owned.is_some(), successor, "drain requested; forwarding to the worker");
        self.drain_deadline = Some(Instant::now() + DRAIN_DEADLINE);
        self.respawn_at = None;
        match &mut self.worker {
            Some(w) if w.monitor.may_send_drain() => {
                w.monitor.drain_sent();
                self.send(Body::Drain(Drain { successor }), &[]);
            }
            Some(w) => {
                // Not yet said Hello: nothing to drain.
                let _ = kill(w.pid, Signal::SIGKILL);
            }
            None => self.exit = Some(0),
        }
    }

    fn reap(&mut self) {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    if self.worker.as_ref().is_some_and(|w| Some(w.pid) == status.pid()) {
                        self.on_worker_exit(status);
                    } else {
                        info!(status = ?status, "reaped a worker that was already replaced");
                    }
                }
            }
        }
    }

    fn on_worker_exit(&mut self, status: WaitStatus) {
        let code = match status {
            WaitStatus::Exited(_, c) => c,
            WaitStatus::Signaled(_, s, _) => 128 + s as i32,
            _ => 1,
        };
        if self.drain_deadline.is_some() {
            let w = self.worker.take().expect("worker exists");
            info!(pid = w.pid.as_raw(), status = ?status, "worker exited after drain; supervisor exits");
            self.exit = Some(code);
            return;
        }
        self.respawn_after(&format!("exited: {status:?}"));
    }

    /// The worker is gone: schedule its successor (at once after a healthy run).
    fn respawn_after(&mut self, how: &str) {
        let w = self.worker.take().expect("worker exists");
        let ran = w.started.elapsed();
        if ran >= HEALTHY_RESET {
            self.backoff = Duration::ZERO;
        }
        self.respawns += 1;
        error!(pid = w.pid.as_raw(), how, ran_ms = ran.as_millis() as u64, respawn_in_ms = self.backoff.as_millis() as u64, respawns = self.respawns, "worker exited unexpectedly; respawning");
        self.respawn_at = Some(Instant::now() + self.backoff);
        self.grow_backoff();
    }

    fn grow_backoff(&mut self) {
        self.backoff = (self.backoff * 2).clamp(RESPAWN_MIN, RESPAWN_MAX);
    }

    fn spawn_worker(&mut self) {
        let (mine, theirs) = match socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "socketpair for the worker failed");
                self.respawn_at = Some(Instant::now() + self.backoff);
                self.grow_backoff();
                return;
            }
        };
        let spawned = spawn::spawn(&self.image, &self.plan, &theirs);
        drop(theirs);
        match spawned {
            Ok(pid) => {
                let now = Instant::now();
                info!(pid = pid.as_raw(), "worker started");
                let _ = nix::fcntl::fcntl(&mine, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK));
                self.worker = Some(Worker { pid, control: mine, monitor: Monitor::default(), started: now, last_pong: now, next_ping: now + HEARTBEAT_EVERY, seq: 0, closed: false });
            }
            Err(e) => {
                error!(error = %e, worker = %self.image.path.display(), "spawning the worker failed");
                self.respawn_at = Some(Instant::now() + self.backoff);
                self.grow_backoff();
            }
        }
    }

    fn send(&mut self, body: Body, fds: &[std::os::fd::BorrowedFd<'_>]) {
        let Some(w) = &self.worker else { return };
        if let Err(e) = fdpass::send_control(w.control.as_fd(), body, fds) {
            warn!(pid = w.pid.as_raw(), error = %e, "sending to the worker failed");
        }
    }

    fn on_control(&mut self) {
        loop {
            let Some(w) = &mut self.worker else { return };
            let pid = w.pid;
            match fdpass::recv_control(w.control.as_fd(), true) {
                Err(e) if e.would_block() => return,
                Err(fdpass::Error::Closed) if w.monitor.phase() == crate::monitor::WorkerPhase::Released => {
                    // The released worker has handed everything on and is exiting: its
                    // job is done, so is ours. Its SIGCHLD is not waited for (the
                    // kernel's teardown can take a grace period); init reaps it.
                    info!(pid = pid.as_raw(), "released worker closed its control socket; supervisor exits");
                    self.exit = Some(0);
                    return;
                }
                Err(fdpass::Error::Closed) if self.drain_deadline.is_some() => {
                    // The drained worker is exiting; SIGCHLD follows and ends the
                    // supervisor. Stop polling its socket.
                    w.closed = true;
                    return;
                }
                Err(fdpass::Error::Closed) => {
                    // A dying worker's control socket closes before the kernel has
                    // finished its exit, which can wait for a grace period (closing an
                    // inotify instance does; see the worker's main). Make sure it dies,
                    // and respawn now: its SIGCHLD is reaped when it comes.
                    let _ = kill(pid, Signal::SIGKILL);
                    self.respawn_after("closed its control socket");
                    return;
                }
                Err(e) => {
                    error!(pid = pid.as_raw(), error = %e, "malformed control message from the worker; killing it");
                    let _ = kill(pid, Signal::SIGKILL);
                    return;
                }
                Ok((body, _fds)) => match w.monitor.on_message(&body) {
                    Err(v) => {
                        error!(pid = pid.as_raw(), error = %v, "killing the worker");
                        let _ = kill(pid, Signal::SIGKILL);
                        return;
                    }
                    Ok(n) => self.on_notice(n),
                },
            }
        }
    }

    fn on_notice(&mut self, n: Notice) {
        match n {
            Notice::Hello => {
                if self.owned.is_some() && self.drain_deadline.is_none() {
                    self.send_takeover();
                }
            }
            Notice::StandbyComplete => {
                // A worker that reached its goal is not a crash loop: the next respawn
                // starts from the shortest delay again.
                self.backoff = Duration::ZERO;
                info!("worker is a complete standby");
                notify(&[sd_notify::NotifyState::Status("standby: complete, waiting for the node lock")]);
            }
            Notice::Reconciling | Notice::Crossed => {}
            Notice::Serving => {
                self.backoff = Duration::ZERO;
                let generation = self.owned.as_ref().map_or(0, |o| o.generation);
                info!(generation, "worker serves the node");
                notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&format!("owner: generation {generation}, serving"))]);
            }
            Notice::Draining => info!("worker is draining"),
            Notice::Released => self.release_node(),
            Notice::Pong(_) => {
                if let Some(w) = &mut self.worker {
                    w.last_pong = Instant::now();
                }
            }
        }
    }

    fn on_lock_wake(&mut self) {
        if let Some(w) = &self.lock_wake {
            let mut buf = [0u8; 8];
            // The lock thread writes one byte and ends: EOF (or an error) means it is gone
            // and there is nothing more to wait for.
            let gone = match std::io::Read::read(&mut &*w, &mut buf) {
                Ok(n) => n == 0,
                Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted),
            };
            if gone {
                self.lock_wake = None;
            }
        }
        match self.lock_rx.try_recv() {
            Ok(Ok(held)) => {
                if self.drain_deadline.is_some() {
                    info!("node lock acquired while draining; not taking the node");
                    return;
                }
                info!(waited_ms = held.waited.as_millis() as u64, uncontended = held.uncontended, "node lock acquired");
                self.pending = Some(held);
                self.pending_since = Some(Instant::now());
                self.try_take_node();
            }
            Ok(Err(e)) => {
                error!(error = %e, "node lock failed");
                self.exit = Some(1);
            }
            Err(_) => {}
        }
    }

    /// With the lock held: get the listening sockets, bump the generation, open the
    /// handoff listener, and hand the node to the worker.
    fn try_take_node(&mut self) {
        let Some(mut held_lock) = self.pending.take() else { return };
        let start = self.pending_since.unwrap_or_else(Instant::now);
        let xds_path = self.cfg.xds_path();
        let cni_path = self.cfg.cni_path();
        if self.held.is_none() {
            // No owner handed its sockets over (a delete-then-create roll, or a killed
            // generation): the node's socket keeper may hold them.
            self.held = self.fetch_from_keeper();
        }
        let from_handoff = self.held.take().and_then(|h| {
            let ok = listen::verify_held(&h.xds, &xds_path, h.offer.xds_dev, h.offer.xds_ino)
                .and_then(|()| listen::verify_held(&h.cni, &cni_path, h.offer.cni_dev, h.offer.cni_ino));
            match ok {
                Ok(()) => Some(h),
                Err(e) => {
                    warn!(error = %e, "handed-off sockets no longer match their paths; binding fresh ones");
                    None
                }
            }
        });
        let handed_off = from_handoff.is_some();
        let (xds, cni, ids) = match from_handoff {
            Some(h) => {
                let ids = h.ids();
                (h.xds, h.cni, ids)
            }
            None => match self.bind_fresh(&xds_path, &cni_path) {
                Ok(v) => v,
                Err(ListenError::LiveServer { path }) => {
                    if self.bind_retry_at.is_none() && start.elapsed() < BIND_RETRY * 2 {
                        warn!(path = %path.display(), "a server without the node lock still answers; waiting for it to go away");
                    }
                    self.pending = Some(held_lock);
                    self.bind_retry_at = Some(Instant::now() + BIND_RETRY);
                    return;
                }
                Err(e) => {
                    error!(error = %e, "cannot bind the node sockets");
                    self.exit = Some(1);
                    return;
                }
            },
        };
        let bind = start.elapsed();
        let generation = match lock::bump_generation(&mut held_lock.file, &self.cfg.lock_path()) {
            Ok(g) => g,
            Err(e) => {
                error!(error = %e, "cannot record the generation");
                self.exit = Some(1);
                return;
            }
        };
        let handoff = match listen::bind_fresh(&self.cfg.handoff_path(), SockType::SeqPacket, 0o600, self.owner) {
            Ok(b) => {
                let _ = nix::fcntl::fcntl(&b.fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK));
                Some(b.fd)
            }
            Err(e) => {
                // Without it the next roll binds fresh sockets: slower, still correct.
                warn!(error = %e, "cannot open the handoff socket; the next generation will bind fresh sockets");
                None
            }
        };
        info!(generation, handed_off, bind_us = micros(bind), "this agent owns the node");
        notify(&[sd_notify::NotifyState::Status(&format!("owner: generation {generation}, taking over"))]);
        self.owned = Some(Owned {
            lock: held_lock.file,
            xds,
            cni,
            ids,
            generation,
            handed_off,
            uncontended: held_lock.uncontended,
            lock_wait: held_lock.waited,
            bind,
            handoff,
            offered_at: None,
            taken_over: false,
        });
        if self.worker.as_ref().is_some_and(|w| w.monitor.may_send_takeover()) {
            self.send_takeover();
        }
        // After the Takeover is out: the file work is never on the takeover's path.
        if self.cfg.cni_conf_dir.is_some() {
            self.conflist_at = Some(Instant::now());
        }
        if let Some(o) = &self.owned {
            match sys::fdstore::store(o.xds.as_fd(), o.cni.as_fd()) {
                Ok(true) => info!("node sockets stored in systemd's fd store (kept across a restart)"),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "cannot store the node sockets in systemd's fd store"),
            }
        }
    }

    /// Makes the node's conflist chain aether-cni (owner only); logs what changed.
    fn reassert_conflist(&mut self) {
        self.conflist_at = Some(Instant::now() + CONFLIST_EVERY);
        let Some(dir) = &self.cfg.cni_conf_dir else { return };
        let entry = conflist::entry(&self.cfg.cni_path());
        let result = conflist::reassert(dir, &entry);
        let summary = match &result {
            Ok(conflist::Outcome::NoConflist) => format!("no CNI network configuration in {} yet", dir.display()),
            Ok(conflist::Outcome::Chained(p) | conflist::Outcome::Repaired(p)) => format!("{} chains aether-cni", p.display()),
            Err(e) => e.to_string(),
        };
        match &result {
            Ok(conflist::Outcome::Repaired(p)) => {
                warn!(file = %p.display(), "the CNI conflist lacked aether-cni (rewritten by another writer?); appended it")
            }
            _ if self.conflist_last.as_deref() == Some(summary.as_str()) => {}
            Ok(_) => info!("{summary}"),
            Err(e) => error!(error = %e, "cannot re-assert the CNI conflist"),
        }
        self.conflist_last = Some(summary);
    }

    fn bind_fresh(&self, xds_path: &PathBuf, cni_path: &PathBuf) -> Result<Listeners, ListenError> {
        for p in [xds_path, cni_path] {
            if listen::live_server(p)? {
                return Err(ListenError::LiveServer { path: p.clone() });
            }
        }
        // xds.sock: the proxy connects as a member of the worker's group (the chart gives
        // Envoy that supplementary group). cni.sock: only the runtime's CNI plugin, root.
        let xds_group = self.plan.drop_to.map_or(self.owner.1, |(_, gid)| gid);
        let x = listen::bind_fresh(xds_path, SockType::Stream, 0o660, (self.owner.0, xds_group))?;
        let c = listen::bind_fresh(cni_path, SockType::Stream, 0o600, self.owner)?;
        Ok((x.fd, c.fd, [(x.dev, x.ino), (c.dev, c.ino)]))
    }

    fn send_takeover(&mut self) {
        let Some(o) = &mut self.owned else { return };
        let Some(w) = &mut self.worker else { return };
        if !w.monitor.may_send_takeover() {
            return;
        }
        w.monitor.takeover_sent();
        // A worker after the first that served this ownership is a respawn.
        let respawn = std::mem::replace(&mut o.taken_over, true);
        let sent_at_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, micros);
        let msg = Takeover {
            generation: o.generation,
            respawn,
            handed_off: o.handed_off,
            lock_wait_us: micros(o.lock_wait),
            bind_us: micros(o.bind),
            sent_at_us,
            uncontended: o.uncontended,
            respawns: self.respawns,
        };
        let fds = [o.lock.as_fd(), o.xds.as_fd(), o.cni.as_fd()];
        if let Err(e) = fdpass::send_control(w.control.as_fd(), Body::Takeover(msg), &fds) {
            error!(error = %e, "sending Takeover failed; killing the worker");
            let _ = kill(w.pid, Signal::SIGKILL);
        }
    }

    /// The drained worker has nothing in flight and holds no listener or lock descriptor:
    /// unlock the node so that the standby takes it over now, while the worker's open
    /// proxy streams still serve. Dropping `Owned` closes this supervisor's copies of the
    /// lock, the listeners (the standby holds its own) and the handoff listener.
    fn release_node(&mut self) {
        let Some(o) = self.owned.take() else { return };
        match o.lock.unlock() {
            Ok(()) => info!(generation = o.generation, "node lock released; the worker keeps its proxy streams until the successor serves"),
            // Closing the descriptor below releases it too, once the worker's copy is gone.
            Err(e) => warn!(error = %e, "unlocking the node lock failed; it is released when the descriptor closes"),
        }
        notify(&[sd_notify::NotifyState::Status("draining: node lock released")]);
    }

    fn on_handoff_connection(&mut self) {
        let Some(o) = &mut self.owned else { return };
        let Some(listener) = &o.handoff else { return };
        while let Some(conn) = handoff::accept(listener) {
            match handoff::serve_one(conn, o.generation, &o.xds, &o.cni, o.ids) {
                Ok(false) => {
                    o.offered_at = Some(Instant::now());
                    info!(generation = o.generation, "offered the node sockets to a standby");
                }
                Ok(true) => debug!(generation = o.generation, "offered the node sockets to the socket keeper"),
                Err(e) => warn!(error = %e, "handoff refused"),
            }
        }
    }

    fn fetch_from_keeper(&self) -> Option<handoff::Held> {
        match handoff::fetch(&self.cfg.keeper_path(), &self.cfg.xds_path(), &self.cfg.cni_path(), false) {
            Ok(Some(h)) => {
                info!(generation = h.generation, "taking the node sockets from the socket keeper");
                Some(h)
            }
            Ok(None) => None,
            // Also when the keeper holds nothing yet: it then closes the connection.
            Err(e) => {
                info!(error = %e, "no node sockets from the socket keeper");
                None
            }
        }
    }

    fn fetch_handoff(&mut self) {
        match handoff::fetch(&self.cfg.handoff_path(), &self.cfg.xds_path(), &self.cfg.cni_path(), false) {
            Ok(Some(h)) => {
                if self.held.as_ref().map(|x| x.generation) != Some(h.generation) {
                    info!(generation = h.generation, "holding the owner's node sockets for the takeover");
                }
                self.held = Some(h);
                self.handoff_at = Instant::now() + HANDOFF_REFRESH;
            }
            Ok(None) => self.handoff_at = Instant::now() + HANDOFF_RETRY,
            Err(e) => {
                warn!(error = %e, "handoff from the owner failed");
                self.handoff_at = Instant::now() + HANDOFF_RETRY;
            }
        }
    }
}

/// The listeners systemd kept in its fd store across a restart, held like sockets handed
/// off by a previous generation: each must be the listener bound at its path, and the
/// paths' inodes now are what the takeover checks again.
fn held_from_systemd(cfg: &Config, fds: (Option<OwnedFd>, Option<OwnedFd>)) -> Option<handoff::Held> {
    let (Some(xds), Some(cni)) = fds else { return None };
    let ids = listen::listener_at("xds.sock from systemd", &xds, &cfg.xds_path())
        .and_then(|x| Ok((x, listen::listener_at("cni.sock from systemd", &cni, &cfg.cni_path())?)));
    match ids {
        Ok(((xds_dev, xds_ino), (cni_dev, cni_ino))) => {
            info!("holding the node sockets systemd kept in its fd store");
            let offer = shared_proto::control::HandoffOffer { xds_dev, xds_ino, cni_dev, cni_ino, ..Default::default() };
            Some(handoff::Held { generation: 0, xds, cni, offer })
        }
        Err(e) => {
            warn!(error = %e, "the sockets from systemd's fd store are not this node's; binding fresh ones at takeover");
            None
        }
    }
}

/// Makes `dir` (creating it) owned by `owner` with `mode`, for the worker.
pub fn prepare_dir(dir: &std::path::Path, owner: Option<(u32, u32)>, mode: u32) -> anyhow::Result<()> {
    prepare_dir_checked(dir, owner, mode, false)
}

/// The run dir: ours, or refused. Replacing stale sockets in it is safe only while no
/// other uid can write there.
pub fn prepare_run_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    prepare_dir_checked(dir, None, 0o755, true)
}

fn prepare_dir_checked(dir: &std::path::Path, owner: Option<(u32, u32)>, mode: u32, must_be_ours: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("create {}: {e}", dir.display()))?;
    let m = std::fs::symlink_metadata(dir).map_err(|e| anyhow::anyhow!("lstat {}: {e}", dir.display()))?;
    if !m.is_dir() {
        anyhow::bail!("{} is not a directory (a symlink?); refusing to prepare it for the worker", dir.display());
    }
    use std::os::unix::fs::MetadataExt;
    if must_be_ours && (m.uid() != nix::unistd::geteuid().as_raw() || m.mode() & 0o022 != 0) {
        anyhow::bail!(
            "{} must be owned by this supervisor (uid {}) and writable by nobody else, but is owned by uid {} with mode {:o}; refusing to manage node sockets there",
            dir.display(),
            nix::unistd::geteuid(),
            m.uid(),
            m.mode() & 0o7777
        );
    }
    if m.mode() & 0o1002 == 0o1002 {
        // A shared sticky folder such as the host's /tmp: never chmod or give it away.
        // The worker can create its own socket there.
        return Ok(());
    }
    // chmod of a file owned by another uid needs CAP_FOWNER, which the supervisor does
    // not hold: set the mode while the folder is ours, then give it away.
    if m.mode() & 0o7777 != mode {
        if m.uid() != nix::unistd::geteuid().as_raw() {
            let me = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
            std::os::unix::fs::lchown(dir, Some(me.0), Some(me.1)).map_err(|e| anyhow::anyhow!("chown {}: {e}", dir.display()))?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(|e| anyhow::anyhow!("chmod {}: {e}", dir.display()))?;
    }
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid)).map_err(|e| anyhow::anyhow!("chown {}: {e}", dir.display()))?;
    }
    Ok(())
}
