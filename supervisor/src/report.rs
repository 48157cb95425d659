//! What the supervisor says about its lifecycle: a log line for each report and kill the
//! lifecycle decides on, and the status line systemd shows.

use nix::unistd::Pid;
use tracing::{error, info, warn};

use crate::lifecycle::{DRAIN_DEADLINE, HEARTBEAT_DEADLINE, Kill, Report};
use crate::supervise::Sys;
use crate::sys::notify;

pub fn report(r: &Report<Sys>) {
    match r {
        Report::Respawning {
            pid,
            how,
            ran,
            delay,
            respawns,
        } => error!(
            pid = pid.as_raw(),
            how = how.as_str(),
            ran_ms = ran.as_millis() as u64,
            respawn_in_ms = delay.as_millis() as u64,
            respawns,
            "worker exited unexpectedly; respawning"
        ),
        Report::ReplacedReaped { status } => {
            info!(status = %status, "reaped a worker that was already replaced")
        }
        Report::StandbyComplete => {
            info!("worker is a complete standby");
            notify::status(false, "standby: complete, waiting for the node lock");
        }
        Report::Serving { generation } => {
            info!(generation, "worker serves the node");
            notify::status(true, &format!("owner: generation {generation}, serving"));
        }
        Report::WorkerDraining => info!("worker is draining"),
        Report::DrainRequested { owner, successor } => info!(
            owner,
            successor, "drain requested; forwarding to the worker"
        ),
        Report::ExitedAfterDrain { status } => {
            info!(status = %status, "worker exited after drain; supervisor exits")
        }
        Report::ReleasedClosed => {
            info!("released worker closed its control socket; supervisor exits")
        }
        Report::LockIgnored => info!("node lock acquired while draining; not taking the node"),
        Report::HeldOrphaned => warn!(
            "no owner offers the node sockets any more and another process holds the node lock; closing the ones held, so that it can bind fresh ones"
        ),
        Report::LiveServer { path } => {
            warn!(path = %path.display(), "a server without the node lock still answers; waiting for it to go away")
        }
    }
}

/// A worker died of SIGSYS: its seccomp filter trapped a call of the kill set, which its
/// handler names on the report pipe (nothing if it died before installing the handler).
pub fn sigsys(pid: Pid, killed: Option<shared_proto::seccomp::Killed>) {
    match killed {
        Some(call) => {
            error!(pid = pid.as_raw(), syscall = %call, "the worker's seccomp filter killed it")
        }
        None => error!(
            pid = pid.as_raw(),
            "the worker died of SIGSYS without naming a system call"
        ),
    }
}

pub fn kill(pid: Pid, why: &Kill) {
    let pid = pid.as_raw();
    match why {
        Kill::MissedHeartbeats => error!(
            pid,
            "worker missed heartbeats for {HEARTBEAT_DEADLINE:?}; killing it"
        ),
        Kill::DrainDeadline => error!(
            pid,
            "worker did not finish draining in {DRAIN_DEADLINE:?}; killing it"
        ),
        Kill::NoHello => info!(
            pid,
            "drain requested before the worker said Hello; killing it"
        ),
        Kill::Violation(v) => error!(pid, error = %v, "killing the worker"),
        Kill::Malformed(e) => {
            error!(pid, error = %e, "malformed control message from the worker; killing it")
        }
        Kill::TakeoverNotSent(e) => {
            error!(pid, error = %e, "sending Takeover failed; killing the worker")
        }
        Kill::Dying => {}
    }
}
