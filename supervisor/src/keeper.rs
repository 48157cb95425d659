//! The node's socket keeper (`aether-supervisor --keep-sockets`): a process outside the
//! agent's pod that holds duplicates of the node's listening sockets, so that the
//! sockets stay open while no agent runs at all.
//!
//! A surge roll hands the sockets from generation to generation and a worker crash keeps
//! them in the supervisor; a delete-then-create roll has neither, and without a keeper
//! the proxy's reconnect meets a socket file nobody listens on and is refused (each
//! refusal doubles Envoy's backoff). With a keeper, that connect waits in the backlog of
//! the kept listener, and the new agent, finding no owner on `handoff.sock`, takes the
//! kept sockets from `keeper.sock` and accepts it.
//!
//! The keeper speaks the handoff protocol on both sides (see [`crate::handoff`]): as a
//! standby would, it fetches the owner's offer every [`REFRESH`]; as an owner would, it
//! offers what it holds to a same-uid peer on `<run-dir>/keeper.sock`. It never accepts
//! on the node sockets, takes no lock, starts no worker and needs no capability. An
//! offer it holds is only as good as the checks the taker runs: the taking supervisor
//! verifies each fd against its path exactly as for a handoff.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::SockType;
use tracing::{info, warn};

use crate::config::Config;
use crate::handoff::{self, Held};
use crate::sys::listen::{self, ListenError};

/// How often the keeper fetches the owner's sockets again (a new owner may have bound
/// fresh ones).
pub const REFRESH: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("cannot open keeper.sock: {0}")]
    Bind(#[from] ListenError),
    #[error("keeper.sock: {0}")]
    NonBlocking(nix::Error),
    #[error("poll: {0}")]
    Poll(nix::Error),
}

pub fn run(cfg: &Config, signals: SignalFd) -> Result<i32, KeeperError> {
    let me = (nix::unistd::geteuid().as_raw(), nix::unistd::getegid().as_raw());
    let path = cfg.keeper_path();
    let listener = listen::bind_fresh(&path, SockType::SeqPacket, 0o600, me)?;
    nix::fcntl::fcntl(&listener.fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).map_err(KeeperError::NonBlocking)?;
    info!(path = %path.display(), "socket keeper started; fetching the owner's sockets over handoff.sock");
    let mut held: Option<Held> = None;
    let mut next_fetch = Instant::now();
    loop {
        if next_fetch <= Instant::now() {
            fetch(cfg, &mut held);
            next_fetch = Instant::now() + REFRESH;
        }
        let wait = next_fetch.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
        let mut fds = [PollFd::new(signals.as_fd(), PollFlags::POLLIN), PollFd::new(listener.fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(KeeperError::Poll(e)),
        }
        let readable = |f: &PollFd| f.revents().is_some_and(|r| r.intersects(PollFlags::POLLIN));
        if readable(&fds[0]) {
            while let Ok(Some(info)) = signals.read_signal() {
                if matches!(Signal::try_from(info.ssi_signo as i32), Ok(Signal::SIGTERM | Signal::SIGINT)) {
                    info!("socket keeper stopping");
                    return Ok(0);
                }
            }
        }
        if readable(&fds[1]) {
            while let Some(conn) = handoff::accept(&listener.fd) {
                let Some(h) = &held else {
                    // Closing the connection tells the peer there is nothing to take.
                    warn!("an agent asked for the node sockets before the keeper held any");
                    continue;
                };
                match handoff::serve_one(conn, h.generation, &h.listeners) {
                    Ok(_) => info!(generation = h.generation, "offered the kept node sockets to an agent"),
                    Err(e) => warn!(error = %e, "keeper offer refused"),
                }
            }
        }
    }
}

/// Takes the owner's current offer, if an owner answers. With none (the node between
/// generations) the keeper keeps what it holds: that is what it is for.
fn fetch(cfg: &Config, held: &mut Option<Held>) {
    match handoff::fetch(&cfg.handoff_path(), &cfg.xds_path(), &cfg.cni_path(), true) {
        Ok(Some(h)) => {
            let changed = held.as_ref().is_none_or(|old| (old.listeners.paths, old.generation) != (h.listeners.paths, h.generation));
            if changed {
                info!(generation = h.generation, "keeping the owner's node sockets");
            }
            *held = Some(h);
        }
        Ok(None) => {}
        Err(e) => warn!(error = %e, "fetching the owner's sockets failed; keeping what is held"),
    }
}
