//! The worker's side of the control protocol with its supervisor.
//!
//! A closed state machine, like the supervisor's monitor: from the supervisor the worker
//! accepts `Ping` at any time, `Takeover` once (not while draining) and `Drain` once.
//! Anything else, or a malformed message, ends the conversation with a logged error and
//! the worker exits; the supervisor respawns it.

use std::os::fd::{AsFd, OwnedFd};

use shared_proto::control::{Body, CONTROL_VERSION, Hello, Phase as WirePhase, Ping, Status, Takeover};
use shared_proto::fdpass;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::takeover::Phase;

/// A supervisor message the worker acts on.
pub enum Command {
    Takeover(Takeover, Vec<OwnedFd>),
    /// `successor`: a standby holds the node's sockets (see [`shared_proto::control::Drain`]).
    Drain { successor: bool },
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("control channel: {0}")]
    Transport(#[from] fdpass::Error),
    #[error("control protocol violation: {0}")]
    Violation(String),
    #[error("control channel: {0}")]
    Io(#[from] std::io::Error),
}

pub struct Control {
    fd: AsyncFd<OwnedFd>,
    took_over: bool,
    drained: bool,
}

impl Control {
    /// Wraps the inherited socket and says Hello.
    pub fn new(fd: OwnedFd) -> Result<Self, ControlError> {
        nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).map_err(fdpass::Error::from)?;
        // The deprecation concerns a borrowed descriptor closed behind tokio's back; this
        // AsyncFd owns the OwnedFd outright, and its safe replacement is `unsafe`.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        fdpass::send_control(fd.get_ref().as_fd(), Body::Hello(Hello { version: CONTROL_VERSION }), &[])?;
        Ok(Self { fd, took_over: false, drained: false })
    }

    pub fn report(&self, phase: Phase) -> Result<(), ControlError> {
        let wire = match phase {
            Phase::Building => WirePhase::Building,
            Phase::StandbyComplete => WirePhase::StandbyComplete,
            Phase::Reconciling => WirePhase::Reconciling,
            Phase::Serving => WirePhase::Serving,
            Phase::Draining => WirePhase::Draining,
            Phase::Released => WirePhase::Released,
        };
        fdpass::send_control(self.fd.get_ref().as_fd(), Body::Status(Status { phase: wire as i32 }), &[])?;
        Ok(())
    }

    /// Waits for the next command, answering heartbeats on the way.
    pub async fn next(&mut self) -> Result<Command, ControlError> {
        loop {
            let mut guard = self.fd.readable().await?;
            let received = fdpass::recv_control(guard.get_inner().as_fd(), true);
            let (body, fds) = match received {
                Err(e) if e.would_block() => {
                    guard.clear_ready();
                    continue;
                }
                other => other?,
            };
            drop(guard);
            match body {
                Body::Ping(Ping { seq }) => {
                    fdpass::send_control(self.fd.get_ref().as_fd(), Body::Pong(Ping { seq }), &[])?;
                }
                Body::Takeover(t) if !self.took_over && !self.drained => {
                    self.took_over = true;
                    return Ok(Command::Takeover(t, fds));
                }
                Body::Drain(d) if !self.drained => {
                    self.drained = true;
                    return Ok(Command::Drain { successor: d.successor });
                }
                other => {
                    return Err(ControlError::Violation(format!(
                        "{} not permitted (took over: {}, draining: {}, version {CONTROL_VERSION})",
                        other.name(),
                        self.took_over,
                        self.drained
                    )));
                }
            }
        }
    }
}
