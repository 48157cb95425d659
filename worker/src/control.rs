//! The worker's side of the control protocol with its supervisor.
//!
//! A closed state machine, like the supervisor's monitor: from the supervisor the worker
//! accepts `Ping` at any time, `Takeover` once (not while draining) and `Drain` once.
//! Anything else, or a malformed message, ends the conversation with a logged error and
//! the worker exits; the supervisor respawns it.

use std::os::fd::{AsFd, OwnedFd};

use shared_proto::control::{
    Body, CONTROL_VERSION, Hello, Phase as WirePhase, Ping, Status, Takeover,
};
use shared_proto::fdpass;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::takeover::Phase;

/// A supervisor message the worker acts on.
pub enum Command {
    Takeover(Takeover, Vec<OwnedFd>),
    /// `successor`: a standby holds the node's sockets (see [`shared_proto::control::Drain`]).
    Drain {
        successor: bool,
    },
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
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .map_err(fdpass::Error::from)?;
        // The deprecation concerns a borrowed descriptor closed behind tokio's back; this
        // AsyncFd owns the OwnedFd outright, and its safe replacement is `unsafe`.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(fd, Interest::READABLE)?;
        fdpass::send_control(
            fd.get_ref().as_fd(),
            Body::Hello(Hello {
                version: CONTROL_VERSION,
            }),
            &[],
        )?;
        Ok(Self {
            fd,
            took_over: false,
            drained: false,
        })
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
        fdpass::send_control(
            self.fd.get_ref().as_fd(),
            Body::Status(Status { phase: wire as i32 }),
            &[],
        )?;
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
                    return Ok(Command::Drain {
                        successor: d.successor,
                    });
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

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::fd::{AsRawFd, BorrowedFd};

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    use shared_proto::control::Drain;

    use super::*;

    /// The worker's `Control` on one end of a fresh pair; the supervisor's end, after
    /// reading the worker's Hello.
    fn connected() -> (Control, OwnedFd) {
        let (sup, worker) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let control = Control::new(worker).unwrap();
        match fdpass::recv_control(sup.as_fd(), false).unwrap() {
            (Body::Hello(h), fds) => assert_eq!((h.version, fds.len()), (CONTROL_VERSION, 0)),
            (other, _) => panic!("the first message was {}", other.name()),
        }
        (control, sup)
    }

    fn send(sup: &OwnedFd, body: Body, fds: &[BorrowedFd<'_>]) {
        fdpass::send_control(sup.as_fd(), body, fds).unwrap();
    }

    fn takeover(sup: &OwnedFd) {
        let files: Vec<File> = (0..3).map(|_| File::open("/dev/null").unwrap()).collect();
        let fds: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
        send(
            sup,
            Body::Takeover(Takeover {
                generation: 4,
                ..Default::default()
            }),
            &fds,
        );
    }

    fn violation(r: Result<Command, ControlError>) -> String {
        match r {
            Err(ControlError::Violation(v)) => v,
            Err(e) => panic!("not a violation: {e}"),
            Ok(_) => panic!("accepted"),
        }
    }

    /// Pings are answered with their sequence number on the way to a command; Takeover
    /// comes with its three descriptors, Drain with its successor flag; a phase goes out as
    /// its wire Status.
    #[tokio::test]
    async fn pings_are_answered_and_takeover_then_drain_come_through_once_each() {
        let (mut control, sup) = connected();
        send(&sup, Body::Ping(Ping { seq: 9 }), &[]);
        takeover(&sup);
        match control.next().await.unwrap() {
            Command::Takeover(t, fds) => assert_eq!((t.generation, fds.len()), (4, 3)),
            Command::Drain { .. } => panic!("Drain before Takeover"),
        }
        match fdpass::recv_control(sup.as_fd(), false).unwrap().0 {
            Body::Pong(Ping { seq }) => assert_eq!(seq, 9),
            other => panic!("answered a Ping with {}", other.name()),
        }
        control.report(Phase::Serving).unwrap();
        match fdpass::recv_control(sup.as_fd(), false).unwrap().0 {
            Body::Status(s) => assert_eq!(s.phase, WirePhase::Serving as i32),
            other => panic!("reported {}", other.name()),
        }
        send(&sup, Body::Drain(Drain { successor: true }), &[]);
        assert!(matches!(
            control.next().await.unwrap(),
            Command::Drain { successor: true }
        ));
        // Heartbeats go on while draining.
        send(&sup, Body::Ping(Ping { seq: 10 }), &[]);
        send(&sup, Body::Drain(Drain { successor: false }), &[]);
        assert!(
            violation(control.next().await)
                .starts_with("Drain not permitted (took over: true, draining: true")
        );
        assert!(matches!(
            fdpass::recv_control(sup.as_fd(), false).unwrap().0,
            Body::Pong(Ping { seq: 10 })
        ));
    }

    /// Everything out of turn ends the conversation: a second Takeover, a Takeover after
    /// Drain, and any message only the worker sends.
    #[tokio::test]
    async fn out_of_turn_messages_are_violations() {
        let (mut control, sup) = connected();
        takeover(&sup);
        assert!(matches!(
            control.next().await.unwrap(),
            Command::Takeover(..)
        ));
        takeover(&sup);
        assert!(
            violation(control.next().await)
                .starts_with("Takeover not permitted (took over: true, draining: false")
        );

        let (mut control, sup) = connected();
        send(&sup, Body::Drain(Drain { successor: false }), &[]);
        assert!(matches!(
            control.next().await.unwrap(),
            Command::Drain { successor: false }
        ));
        takeover(&sup);
        assert!(
            violation(control.next().await)
                .starts_with("Takeover not permitted (took over: false, draining: true")
        );

        for body in [
            Body::Hello(Hello {
                version: CONTROL_VERSION,
            }),
            Body::Pong(Ping { seq: 1 }),
            Body::Status(Status {
                phase: WirePhase::Serving as i32,
            }),
        ] {
            let name = body.name();
            let (mut control, sup) = connected();
            send(&sup, body, &[]);
            assert!(violation(control.next().await).starts_with(&format!("{name} not permitted")));
        }
    }

    /// A message with the wrong descriptor count, or bytes that are no message, is a
    /// transport error, and the descriptors that came with it are not kept.
    #[tokio::test]
    async fn a_malformed_message_is_a_transport_error() {
        let (mut control, sup) = connected();
        let file = File::open("/dev/null").unwrap();
        send(
            &sup,
            Body::Drain(Drain { successor: false }),
            &[file.as_fd()],
        );
        assert!(matches!(
            control.next().await,
            Err(ControlError::Transport(fdpass::Error::FdCount {
                got: 1,
                expected: 0,
                ..
            }))
        ));

        let (mut control, sup) = connected();
        nix::sys::socket::send(
            sup.as_raw_fd(),
            &[0xff, 0xff, 0xff],
            nix::sys::socket::MsgFlags::empty(),
        )
        .unwrap();
        assert!(matches!(
            control.next().await,
            Err(ControlError::Transport(_))
        ));
    }
}
