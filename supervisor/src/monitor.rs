//! The supervisor's side of the control protocol: a closed state machine over the
//! worker's messages, after OpenSSH's privilege-separation monitor. Each worker message
//! is permitted only in the phases listed in [`Monitor::on_message`]; anything else is a
//! violation, and the supervisor ends the connection (kills the worker) with a logged
//! error. Pure: no I/O, so every rule is unit-tested.

use shared_proto::control::{Body, CONTROL_VERSION, Phase};

/// Where the conversation with one worker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerPhase {
    /// Spawned; the first message must be Hello.
    AwaitHello,
    Building,
    StandbyComplete,
    /// Takeover sent; the worker reconciles and starts serving.
    TakeoverSent,
    Serving,
    /// Drain sent; the worker finishes in-flight work and exits.
    Draining,
    /// The drained owner's worker has no call in flight and no listener or lock
    /// descriptor left; it keeps its open proxy streams until the successor serves.
    Released,
}

/// What a permitted message means for the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    Hello,
    StandbyComplete,
    Reconciling,
    Serving,
    Draining,
    /// The supervisor may release the node lock now.
    Released,
    Pong(u64),
    /// A status that crossed our Takeover or Drain on the wire; nothing to do.
    Crossed,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("control protocol violation in phase {phase:?}: {detail}")]
pub struct Violation {
    pub phase: WorkerPhase,
    pub detail: String,
}

#[derive(Debug)]
pub struct Monitor {
    phase: WorkerPhase,
    /// Takeover was sent: only such a worker ever holds the node, so only it may report
    /// `Released`.
    took_over: bool,
}

impl Default for Monitor {
    fn default() -> Self {
        Self {
            phase: WorkerPhase::AwaitHello,
            took_over: false,
        }
    }
}

impl Monitor {
    pub fn phase(&self) -> WorkerPhase {
        self.phase
    }

    /// Checks one worker message against the phase and advances.
    pub fn on_message(&mut self, body: &Body) -> Result<Notice, Violation> {
        use WorkerPhase::*;
        let deny = |phase, detail: String| Err(Violation { phase, detail });
        match (self.phase, body) {
            (AwaitHello, Body::Hello(h)) if h.version == CONTROL_VERSION => {
                self.phase = Building;
                Ok(Notice::Hello)
            }
            (AwaitHello, Body::Hello(h)) => deny(
                self.phase,
                format!(
                    "worker speaks version {}, supervisor {CONTROL_VERSION}",
                    h.version
                ),
            ),
            (AwaitHello, other) => deny(self.phase, format!("{} before Hello", other.name())),
            (_, Body::Hello(_)) => deny(self.phase, "second Hello".into()),
            (_, Body::Pong(p)) => Ok(Notice::Pong(p.seq)),
            (phase, Body::Status(s)) => {
                let to = Phase::try_from(s.phase).unwrap_or(Phase::Unspecified);
                match (phase, to) {
                    (Building, Phase::StandbyComplete) => {
                        self.phase = StandbyComplete;
                        Ok(Notice::StandbyComplete)
                    }
                    (TakeoverSent, Phase::Reconciling) => Ok(Notice::Reconciling),
                    (TakeoverSent, Phase::Serving) => {
                        self.phase = Serving;
                        Ok(Notice::Serving)
                    }
                    (Draining, Phase::Draining) => Ok(Notice::Draining),
                    (Draining, Phase::Released) if self.took_over => {
                        self.phase = Released;
                        Ok(Notice::Released)
                    }
                    // A status sent before our Takeover or Drain reached the worker: the
                    // messages crossed. Accepted, and the phase stays where we moved it.
                    (TakeoverSent, Phase::StandbyComplete) => Ok(Notice::StandbyComplete),
                    (Draining, Phase::StandbyComplete | Phase::Reconciling | Phase::Serving) => {
                        Ok(Notice::Crossed)
                    }
                    (phase, to) => deny(phase, format!("status {to:?} not permitted")),
                }
            }
            (phase, other) => deny(
                phase,
                format!("{} is a supervisor-to-worker message", other.name()),
            ),
        }
    }

    /// Takeover may be sent once, after Hello, and not while draining.
    pub fn may_send_takeover(&self) -> bool {
        matches!(
            self.phase,
            WorkerPhase::Building | WorkerPhase::StandbyComplete
        )
    }

    pub fn takeover_sent(&mut self) {
        debug_assert!(self.may_send_takeover());
        self.phase = WorkerPhase::TakeoverSent;
        self.took_over = true;
    }

    /// Drain may be sent once the worker has said Hello.
    pub fn may_send_drain(&self) -> bool {
        !matches!(
            self.phase,
            WorkerPhase::AwaitHello | WorkerPhase::Draining | WorkerPhase::Released
        )
    }

    pub fn drain_sent(&mut self) {
        self.phase = WorkerPhase::Draining;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shared_proto::control::{Drain, Hello, Ping, Status, Takeover};

    fn status(p: Phase) -> Body {
        Body::Status(Status { phase: p as i32 })
    }
    fn hello() -> Body {
        Body::Hello(Hello {
            version: CONTROL_VERSION,
        })
    }

    /// Runs `script` (message, or an action by the supervisor) and checks each verdict.
    fn check(script: &[(&str, Option<Body>, bool)]) {
        let mut m = Monitor::default();
        for (i, (what, body, ok)) in script.iter().enumerate() {
            let got = match (what, body) {
                (w, None) if w.starts_with("send_takeover") => {
                    let ok = m.may_send_takeover();
                    if ok {
                        m.takeover_sent()
                    }
                    ok
                }
                (w, None) if w.starts_with("send_drain") => {
                    let ok = m.may_send_drain();
                    if ok {
                        m.drain_sent()
                    }
                    ok
                }
                (_, Some(b)) => m.on_message(b).is_ok(),
                _ => unreachable!(),
            };
            assert_eq!(got, *ok, "step {i} ({what}) in {:?}", m.phase());
        }
    }

    #[test]
    fn standby_then_takeover() {
        check(&[
            ("hello", Some(hello()), true),
            ("complete", Some(status(Phase::StandbyComplete)), true),
            ("pong", Some(Body::Pong(Ping { seq: 1 })), true),
            ("send_takeover", None, true),
            ("reconciling", Some(status(Phase::Reconciling)), true),
            ("serving", Some(status(Phase::Serving)), true),
            ("send_takeover", None, false),
            ("send_drain", None, true),
            ("draining", Some(status(Phase::Draining)), true),
            ("released", Some(status(Phase::Released)), true),
            ("released twice", Some(status(Phase::Released)), false),
        ]);
    }

    #[test]
    fn only_a_worker_that_took_the_node_over_may_release_it() {
        check(&[
            ("hello", Some(hello()), true),
            ("complete", Some(status(Phase::StandbyComplete)), true),
            ("send_drain", None, true),
            ("draining", Some(status(Phase::Draining)), true),
            (
                "released by a standby",
                Some(status(Phase::Released)),
                false,
            ),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            ("send_takeover", None, true),
            ("serving", Some(status(Phase::Serving)), true),
            (
                "released before the drain",
                Some(status(Phase::Released)),
                false,
            ),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            ("send_takeover", None, true),
            ("serving", Some(status(Phase::Serving)), true),
            ("send_drain", None, true),
            ("released", Some(status(Phase::Released)), true),
            ("send_drain again", None, false),
            ("serving after release", Some(status(Phase::Serving)), false),
        ]);
    }

    #[test]
    fn crossing_messages_are_tolerated() {
        check(&[
            ("hello", Some(hello()), true),
            ("send_takeover", None, true),
            (
                "complete, sent before takeover arrived",
                Some(status(Phase::StandbyComplete)),
                true,
            ),
            ("serving", Some(status(Phase::Serving)), true),
            ("send_drain", None, true),
            (
                "serving again, crossed the drain",
                Some(status(Phase::Serving)),
                true,
            ),
            ("draining", Some(status(Phase::Draining)), true),
            ("hello in drain", Some(hello()), false),
        ]);
    }

    #[test]
    fn lone_agent_takeover_before_complete() {
        check(&[
            ("hello", Some(hello()), true),
            ("send_takeover", None, true),
            ("serving", Some(status(Phase::Serving)), true),
        ]);
    }

    #[test]
    fn out_of_phase_messages_are_violations() {
        check(&[("pong first", Some(Body::Pong(Ping { seq: 1 })), false)]);
        check(&[(
            "old hello",
            Some(Body::Hello(Hello {
                version: CONTROL_VERSION + 1,
            })),
            false,
        )]);
        check(&[
            ("hello", Some(hello()), true),
            ("hello again", Some(hello()), false),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            (
                "serving without takeover",
                Some(status(Phase::Serving)),
                false,
            ),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            ("draining unasked", Some(status(Phase::Draining)), false),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            (
                "takeover from worker",
                Some(Body::Takeover(Takeover::default())),
                false,
            ),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            (
                "drain from worker",
                Some(Body::Drain(Drain::default())),
                false,
            ),
        ]);
        check(&[
            ("hello", Some(hello()), true),
            ("unspecified", Some(status(Phase::Unspecified)), false),
        ]);
        check(&[("send_drain before hello", None, false)]);
        check(&[
            ("hello", Some(hello()), true),
            ("send_drain", None, true),
            ("send_takeover", None, false),
        ]);
    }
}
