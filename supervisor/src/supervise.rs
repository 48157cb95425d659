//! The supervisor's driver: one thread, `poll(2)` over the signal descriptor, the lock
//! thread's wake-up, the worker's control socket and the owner's handoff listener. It
//! turns what it reads into [`Event`]s for the lifecycle and performs the [`Action`]s it
//! returns, at once and in order; every decision is the lifecycle's. No async runtime.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, kill};
use nix::sys::signalfd::SignalFd;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use shared_proto::control::Body;
use shared_proto::fdpass;
use tracing::{error, info, warn};

use crate::chain::Chain;
use crate::config::Config;
use crate::lifecycle::{Action, Event, Lifecycle, Report, Resources};
use crate::node::{self, Node, Outcome, Taker};
use crate::report;
use crate::sys::lock::{self, LockError};
use crate::sys::spawn::{self, Image, Plan, SpawnError};
use crate::sys::{notify, seccomp};
use shared_proto::handoff::{self, Held};

/// At most this many control messages are read per wake-up, so that a flooding worker
/// cannot starve signals and the handoff listener.
const CONTROL_BATCH: usize = 16;

/// The resources of the real process, as the lifecycle holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sys;

impl Resources for Sys {
    type Pid = Pid;
    type Control = OwnedFd;
    type Lock = lock::Held;
    type Held = Held;
    type Node = Node;
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("the lock thread's wake-up socket: {0}")]
    Wake(std::io::Error),
    #[error(transparent)]
    Chain(std::io::Error),
}

pub struct Supervisor {
    core: Lifecycle<Sys>,
    image: Image,
    plan: Plan,
    taker: Taker,
    cfg: Config,
    signals: SignalFd,
    /// Readable once the lock thread has a result; `None` after its end closed, so that
    /// poll does not keep reporting the hang-up.
    lock_wake: Option<UnixStream>,
    lock_rx: mpsc::Receiver<Result<lock::Held, LockError>>,
    conflist: Option<Chain>,
    /// The read end of each unreaped worker's SIGSYS report pipe.
    sigsys: Vec<(Pid, OwnedFd)>,
    /// systemd's `WatchdogSec=` watches this process.
    watchdog: bool,
    /// The node after its release: its listeners and `handoff.sock` still offered to
    /// whoever takes the node next, until this supervisor exits (`Node::release`).
    released: Option<Node>,
    /// Accepted `handoff.sock` connections waiting for their peer's Hello.
    parked: handoff::Parked,
}

impl Supervisor {
    pub fn new(
        cfg: Config,
        signals: SignalFd,
        worker_args: Vec<String>,
        env: Vec<(String, String)>,
        from_systemd: (Option<OwnedFd>, Option<OwnedFd>),
    ) -> Result<Self, StartError> {
        let held = node::held_from_systemd(&cfg.xds_path(), &cfg.cni_path(), from_systemd);
        let root = nix::unistd::geteuid().is_root();
        let worker_path = cfg
            .worker_bin
            .clone()
            .unwrap_or_else(|| spawn::beside_me("aether-worker"));
        let image = Image::open(&worker_path)?;
        let plan = Plan::new(worker_args, env, root.then_some(cfg.worker_user))?;
        let owner = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let (lock_file, generation) = lock::open(&cfg.lock_path())?;
        let taker = Taker::new(&cfg, owner, plan.drop_to, generation);
        let (lock_wake, wake_w) = UnixStream::pair().map_err(StartError::Wake)?;
        lock_wake.set_nonblocking(true).map_err(StartError::Wake)?;
        let lock_rx = lock::spawn_waiter(lock_file, cfg.lock_path(), wake_w);
        let exe = cfg
            .cni_plugin_bin
            .clone()
            .unwrap_or_else(|| spawn::beside_me("aether-cni"));
        let conflist = cfg
            .agent
            .cni_conf_dir
            .as_ref()
            .map(|dir| Chain::open(&exe, dir, &cfg.cni_path(), &cfg.agent.log_format))
            .transpose()
            .map_err(StartError::Chain)?;
        let core = Lifecycle::new(Instant::now(), held, conflist.is_some());
        let watchdog = notify::watchdog_enabled();
        Ok(Self {
            core,
            image,
            plan,
            taker,
            cfg,
            signals,
            lock_wake: Some(lock_wake),
            lock_rx,
            conflist,
            watchdog,
            sigsys: Vec::new(),
            released: None,
            parked: handoff::Parked::default(),
        })
    }

    /// Runs until the lifecycle exits. Returns the exit code.
    pub fn run(mut self) -> i32 {
        info!(worker = %self.image.path.display(), uid = ?self.plan.drop_to, "supervisor started; waiting for the node lock");
        notify::status(false, "standby: waiting for the node lock");
        loop {
            self.feed(Event::Tick);
            if let Some(code) = self.core.exit_code() {
                return code;
            }
            if let Err(e) = self.wait_and_dispatch() {
                error!(error = %e, "poll failed");
                return 1;
            }
        }
    }

    /// Steps the lifecycle and performs its actions; an action's answer is stepped at
    /// once, before the next action.
    fn feed(&mut self, event: Event<Sys>) {
        for action in self.core.step(event, Instant::now()) {
            if let Some(answer) = self.perform(action) {
                self.feed(answer);
            }
        }
    }

    fn perform(&mut self, action: Action<Sys>) -> Option<Event<Sys>> {
        match action {
            Action::Spawn => Some(match spawn::start(&self.image, &self.plan) {
                Ok((pid, control, sigsys)) => {
                    info!(pid = pid.as_raw(), "worker started");
                    self.sigsys.push((pid, sigsys));
                    Event::Spawned { pid, control }
                }
                Err(e) => {
                    error!(error = %e, worker = %self.image.path.display(), "spawning the worker failed");
                    Event::SpawnFailed
                }
            }),
            Action::Send(body) => {
                let w = self.core.worker()?;
                if let Err(e) = fdpass::send_control(w.control.as_fd(), body, &[]) {
                    warn!(pid = w.pid.as_raw(), error = %e, "sending to the worker failed");
                }
                None
            }
            Action::SendTakeover(mut msg) => {
                let (w, node) = (self.core.worker()?, self.core.node()?);
                msg.sent_at_us = shared_proto::control::monotonic_us();
                let sent = fdpass::send_control(
                    w.control.as_fd(),
                    Body::Takeover(msg),
                    &node.takeover_fds(),
                );
                sent.err().map(|e| Event::TakeoverNotSent(e.to_string()))
            }
            Action::Kill { pid, why } => {
                report::kill(pid, &why);
                // A failed kill is retried at the next heartbeat deadline. ESRCH: already gone.
                match kill(pid, Signal::SIGKILL) {
                    Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                    Err(e) => {
                        error!(pid = pid.as_raw(), error = %e, "kill(SIGKILL) of the worker failed")
                    }
                }
                None
            }
            Action::TakeNode {
                lock,
                held,
                ask_keeper,
                since,
            } => Some(match self.taker.take(lock, held, ask_keeper, since) {
                Ok(Outcome::Taken(node, took)) => {
                    shared_proto::fault_hook!("take-node");
                    notify::status(
                        false,
                        &format!("owner: generation {}, taking over", took.generation),
                    );
                    Event::Took(node, took)
                }
                Ok(Outcome::Blocked { lock, path }) => Event::Blocked { lock, path },
                Err(e) => {
                    error!(error = %e, "cannot take the node");
                    Event::TakeFailed
                }
            }),
            Action::FetchHandoff => Some(self.fetch_handoff()),
            Action::ReassertConflist => {
                if let Some(c) = &mut self.conflist {
                    c.check();
                }
                None
            }
            Action::StoreListeners => {
                let l = &self.core.node()?.listeners;
                match crate::sys::fdstore::store(l.xds.as_fd(), l.cni.as_fd()) {
                    Ok(true) => {
                        info!("node sockets stored in systemd's fd store (kept across a restart)")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        warn!(error = %e, "cannot store the node sockets in systemd's fd store")
                    }
                }
                None
            }
            Action::Watchdog => {
                if self.watchdog {
                    notify::watchdog();
                }
                None
            }
            Action::Release(node) => {
                node.release();
                self.released = Some(node);
                notify::status(false, "draining: node lock released");
                None
            }
            Action::Report(r) => {
                if let Report::Serving { .. } = r {
                    node::forget_released(&self.cfg.handoff_path());
                }
                report::report(&r);
                None
            }
        }
    }

    fn fetch_handoff(&self) -> Event<Sys> {
        match self.taker.fetch(&self.cfg.handoff_path()) {
            Ok(Some(h)) => {
                shared_proto::fault_hook!("handoff-held");
                let known = self.core.held().map(|old| old.generation);
                if known != Some(h.generation) {
                    info!(
                        generation = h.generation,
                        "holding the owner's node sockets for the takeover"
                    );
                }
                Event::Fetched(Some(h))
            }
            Ok(None) => Event::NoOwner,
            Err(e) => {
                warn!(error = %e, "handoff from the owner failed");
                Event::Fetched(None)
            }
        }
    }

    fn wait_and_dispatch(&mut self) -> nix::Result<()> {
        let timeout = match self.core.timers().next() {
            Some(d) => PollTimeout::try_from(
                d.saturating_duration_since(Instant::now()) + Duration::from_millis(1),
            )
            .unwrap_or(PollTimeout::MAX),
            None => PollTimeout::NONE,
        };
        let (sig, wake, ctl, hand) = {
            let mut fds = vec![PollFd::new(self.signals.as_fd(), PollFlags::POLLIN)];
            let optional = [
                self.lock_wake.as_ref().map(|w| w.as_fd()),
                self.core.control().map(|c| c.as_fd()),
                self.core
                    .node()
                    .or(self.released.as_ref())
                    .and_then(|n| n.handoff.as_ref())
                    .map(|h| h.as_fd()),
            ];
            let [wake_i, ctl_i, hand_i] = optional.map(|fd| {
                fd.map(|fd| {
                    fds.push(PollFd::new(fd, PollFlags::POLLIN));
                    fds.len() - 1
                })
            });
            let parked = fds.len();
            fds.extend(
                self.parked
                    .fds()
                    .map(|fd| PollFd::new(fd, PollFlags::POLLIN)),
            );
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(e),
            }
            let ready = |i: usize| fds[i].revents().is_some_and(|r| !r.is_empty());
            (
                ready(0),
                wake_i.is_some_and(ready),
                ctl_i.is_some_and(ready),
                hand_i.is_some_and(ready) || (parked..fds.len()).any(ready),
            )
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
            self.on_handoff_connections();
        }
        Ok(())
    }

    fn on_signals(&mut self) {
        while let Ok(Some(info)) = self.signals.read_signal() {
            match Signal::try_from(info.ssi_signo as i32) {
                Ok(Signal::SIGTERM | Signal::SIGINT) => self.feed(Event::DrainRequested),
                Ok(Signal::SIGCHLD) => self.reap(),
                _ => {}
            }
        }
    }

    fn reap(&mut self) {
        loop {
            let status = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(s) => s,
            };
            let Some(pid) = status.pid() else { continue };
            if self.conflist.as_mut().is_some_and(|c| c.reaped(&status)) {
                continue;
            }
            let sigsys = self
                .sigsys
                .iter()
                .position(|(p, _)| *p == pid)
                .map(|i| self.sigsys.swap_remove(i).1);
            if let WaitStatus::Signaled(_, Signal::SIGSYS, _) = status {
                report::sigsys(pid, sigsys.as_ref().and_then(seccomp::report));
            }
            let code = match status {
                WaitStatus::Exited(_, c) => c,
                WaitStatus::Signaled(_, s, _) => 128 + s as i32,
                _ => 1,
            };
            self.feed(Event::Exited {
                pid,
                code,
                status: format!("{status:?}"),
            });
        }
    }

    fn on_lock_wake(&mut self) {
        if let Some(w) = &self.lock_wake {
            let mut buf = [0u8; 8];
            // The lock thread writes one byte and ends: EOF (or an error) means it is gone
            // and there is nothing more to wait for.
            let gone = match (&*w).read(&mut buf) {
                Ok(n) => n == 0,
                Err(e) => !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ),
            };
            if gone {
                self.lock_wake = None;
            }
        }
        match self.lock_rx.try_recv() {
            Ok(Ok(held)) => {
                info!(
                    waited_ms = held.waited.as_millis() as u64,
                    uncontended = held.uncontended,
                    "node lock acquired"
                );
                self.feed(Event::LockAcquired(held));
            }
            Ok(Err(e)) => {
                error!(error = %e, "node lock failed");
                self.feed(Event::LockFailed);
            }
            Err(_) => {}
        }
    }

    /// Reads what the worker sent, a bounded batch at a time (poll is level-triggered:
    /// the rest wakes it again, after the signals and the handoff listener had a turn).
    fn on_control(&mut self) {
        for _ in 0..CONTROL_BATCH {
            let Some(w) = self.core.worker() else { return };
            let pid = w.pid;
            // The descriptors of a refused message are closed on a thread of their own
            // (`fdpass::discard`): a lingering close cannot hold up the kill.
            let event = match fdpass::recv_control(w.control.as_fd(), true) {
                Err(e) if e.would_block() => return,
                Err(fdpass::Error::Closed) => Event::ControlClosed,
                Err(e) => Event::ControlBroken(e.to_string()),
                Ok((body, _accepted)) => Event::Message(body),
            };
            let last = !matches!(event, Event::Message(_));
            self.feed(event);
            if last
                || self.core.control().is_none()
                || self.core.worker().map(|w| w.pid) != Some(pid)
            {
                return;
            }
        }
    }

    /// Accepts on `handoff.sock` and answers each parked peer whose Hello has come: no
    /// wait here, so a silent peer cannot hold up signals, heartbeats or the worker.
    fn on_handoff_connections(&mut self) {
        let mut offered = Vec::new();
        if let Some(node) = self.core.node().or(self.released.as_ref())
            && let Some(listener) = &node.handoff
        {
            let generation = node.generation;
            let refused = self.parked.accept_all(listener).into_iter().map(Err);
            for answer in refused.chain(self.parked.answer_ready(generation, &node.listeners)) {
                match answer {
                    Ok(keeper) => {
                        if keeper {
                            tracing::debug!(
                                generation,
                                "offered the node sockets to the socket keeper"
                            );
                        } else {
                            info!(generation, "offered the node sockets to a standby");
                        }
                        offered.push(keeper);
                    }
                    Err(e) => warn!(error = %e, "handoff refused"),
                }
            }
        }
        for keeper in offered {
            self.feed(Event::Offered { keeper });
        }
    }
}
