//! The worker's lifecycle: the takeover phases of [`takeover::step`] and every decision
//! around them (what a Takeover records, the takeover's timings, whether a drain has
//! calls to wait for, whether a released owner waits for its successor, what `/ready`
//! shows). `Lifecycle::step(event)` returns the actions for the driver in
//! [`crate::agent`] to perform, as the supervisor's lifecycle does.
//!
//! Pure: no clock, no socket, no log. The driver stamps the time into the events that
//! need it, and the lines it logs and the metrics it counts come back as [`Note`]s, so
//! every rule here is tested without tokio.

use std::time::{Duration, Instant};

use aether_model::Gates;
use shared_proto::control::Takeover;

use crate::health::{Status, TakeoverTimes};
use crate::takeover::{self, Gate, Phase, State};

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The node's first-serve gates, as they stand now.
    Gates(Gates),
    /// A lone owner's gate timer fired; `passed`: the gate had passed by then.
    GateTimedOut { gate: Gate, passed: bool },
    /// The supervisor's Takeover, its descriptors checked; `at` and `now_us` (the shared
    /// monotonic clock of `sent_at_us`) when it was received.
    Takeover {
        msg: Takeover,
        at: Instant,
        now_us: u64,
    },
    /// The takeover reconcile applied the storage diff, or failed; it took `took`.
    ReconcileDone { took: Duration },
    /// The wait for the SVIDs of the pods the reconcile added is over: it took `took`, and
    /// `missed` of those pods still had none.
    SvidsAwaited { took: Duration, missed: usize },
    /// The answer to [`Action::Serve`]: both sockets are served from `at` (`now_us`).
    Served { at: Instant, now_us: u64 },
    /// The supervisor asked for a drain; `successor`: a standby will take the node.
    Drain { successor: bool },
    /// The CNI API finished its in-flight calls after the drain.
    Drained,
    /// The released owner is done with the proxy's streams (its successor serves, or the
    /// bound passed).
    StreamsDone,
    /// The control channel to the supervisor ended.
    ControlEnded,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Tell the supervisor the new phase.
    Report(Phase),
    /// Arm the lone owner's gate timers.
    ArmGateTimers,
    /// Arm the client-certificate gate's timer (`--pod-certificate-gate`), answered by
    /// [`Event::GateTimedOut`] for [`Gate::PodCertificates`].
    ArmPodCertificateGate,
    /// Note which pods lack an SVID, then apply the storage diff to the node.
    Reconcile,
    /// Wait, bounded, for the SVIDs of the pods the reconcile added.
    AwaitSvids,
    /// Accept on both sockets, start the owner-only writers and the metrics listener;
    /// `tidy`: clean up the pod records folder, which no reconcile's reload did. Answered
    /// with [`Event::Served`].
    Serve { tidy: bool },
    /// Stop the Kubernetes writes and the CNI API's new calls; the calls in flight finish.
    Drain,
    /// Close the `xds.sock` listener and the lock, flush the owner's writers, then keep
    /// the proxy's streams until the successor serves (when `await_successor`) and
    /// answer [`Event::StreamsDone`].
    Release { await_successor: bool },
    /// End the process with this code.
    Exit(i32),
    /// Log, and count, what happened.
    Note(Note),
}

/// What the driver logs and counts.
#[derive(Debug, Clone, PartialEq)]
pub enum Note {
    /// A gate timed out before it passed, while the worker did not serve yet.
    GateTimedOut(Gate),
    /// The client-certificate gate is decided: `passed` (every stored pod holds its
    /// SVID), or timed out (those pods have no twin until theirs comes).
    PodCertificateGate {
        passed: bool,
    },
    TakeoverReceived {
        msg: Takeover,
        fd_passing_us: u64,
    },
    SvidWait {
        took: Duration,
        missed: usize,
    },
    /// Serving started: the takeover's times, complete.
    Serving {
        taken: Taken,
        first_serve: Duration,
    },
    Drained {
        successor: bool,
    },
    Exiting,
}

/// The node this worker was handed, as its Takeover and the steps since describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub generation: u64,
    received: Instant,
    pub times: TakeoverTimes,
    /// The shared monotonic clock at which the supervisor acquired the lock, in µs.
    lock_acquired_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    phases: State,
    taken: Option<Taken>,
    /// The drain hands the node to a successor: the released owner keeps the proxy's
    /// streams until it serves.
    successor: bool,
    /// The takeover ran a reconcile, whose storage reload cleans up as `tidy` would.
    reconciled: bool,
    /// Serving started: a drain has CNI calls to wait for.
    served: bool,
}

impl Lifecycle {
    /// `pod_svids` as for [`State::new`].
    pub fn new(pod_svids: bool) -> Self {
        Self {
            phases: State::new(pod_svids),
            taken: None,
            successor: false,
            reconciled: false,
            served: false,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phases.phase
    }

    pub fn owner(&self) -> bool {
        self.phases.owner
    }

    pub fn taken(&self) -> Option<&Taken> {
        self.taken.as_ref()
    }

    /// Advances the lifecycle by one event.
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        let phase_event = match event {
            Event::Gates(g) => takeover::Event::Gates(g),
            Event::GateTimedOut { gate, passed } => {
                if !passed && self.phases.phase != Phase::Serving && gate != Gate::PodCertificates {
                    actions.push(Action::Note(Note::GateTimedOut(gate)));
                }
                takeover::Event::GateTimedOut(gate)
            }
            Event::Takeover { msg, at, now_us } => {
                let fd_passing_us = now_us.saturating_sub(msg.sent_at_us);
                self.taken = Some(Taken {
                    generation: msg.generation,
                    received: at,
                    times: TakeoverTimes {
                        lock_wait_us: msg.lock_wait_us,
                        bind_us: msg.bind_us,
                        fd_passing_us,
                        handed_off: msg.handed_off,
                        respawn: msg.respawn,
                        ..TakeoverTimes::default()
                    },
                    lock_acquired_us: msg.sent_at_us.saturating_sub(msg.bind_us),
                });
                let reconcile = !msg.uncontended && !msg.respawn;
                actions.push(Action::Note(Note::TakeoverReceived { msg, fd_passing_us }));
                takeover::Event::Takeover { reconcile }
            }
            Event::ReconcileDone { took } => {
                if let Some(t) = &mut self.taken {
                    t.times.reconcile_us = took.as_micros() as u64;
                }
                takeover::Event::ReconcileDone
            }
            Event::SvidsAwaited { took, missed } => {
                if let Some(t) = &mut self.taken {
                    t.times.svid_wait_us = took.as_micros() as u64;
                    t.times.svid_wait_missed = missed;
                }
                actions.push(Action::Note(Note::SvidWait { took, missed }));
                takeover::Event::SvidsReady
            }
            Event::Served { at, now_us } => {
                if let Some(t) = &mut self.taken {
                    let first_serve = at.saturating_duration_since(t.received);
                    t.times.first_serve_us = first_serve.as_micros() as u64;
                    t.times.total_us = now_us.saturating_sub(t.lock_acquired_us);
                    actions.push(Action::Note(Note::Serving {
                        taken: *t,
                        first_serve,
                    }));
                }
                return actions;
            }
            Event::Drain { successor } => {
                self.successor = successor;
                takeover::Event::Drain
            }
            Event::Drained => {
                actions.push(Action::Note(Note::Drained {
                    successor: self.successor,
                }));
                takeover::Event::Drained
            }
            Event::StreamsDone => return vec![Action::Note(Note::Exiting), Action::Exit(0)],
            Event::ControlEnded => return vec![Action::Exit(1)],
        };
        let (next, phase_actions) = takeover::step(self.phases, phase_event);
        self.phases = next;
        for action in phase_actions {
            actions.push(match action {
                takeover::Action::Report(phase) => Action::Report(phase),
                takeover::Action::ArmGateTimers => Action::ArmGateTimers,
                takeover::Action::ArmPodCertificateGate => Action::ArmPodCertificateGate,
                takeover::Action::PodCertificateGate { passed } => {
                    Action::Note(Note::PodCertificateGate { passed })
                }
                takeover::Action::Reconcile => {
                    self.reconciled = true;
                    Action::Reconcile
                }
                takeover::Action::AwaitSvids => Action::AwaitSvids,
                takeover::Action::Serve => {
                    self.served = true;
                    Action::Serve {
                        tidy: !self.reconciled,
                    }
                }
                // Nothing served: nothing in flight.
                takeover::Action::Drain if !self.served => Action::Exit(0),
                takeover::Action::Drain => Action::Drain,
                takeover::Action::Release => Action::Release {
                    await_successor: self.successor,
                },
            });
        }
        actions
    }

    /// What `/ready` shows of the lifecycle.
    pub fn show(&self, s: &mut Status) {
        s.role = if self.phases.owner {
            "owner"
        } else {
            "standby"
        };
        s.phase = self.phases.phase.as_str();
        s.ready = self.phases.ready();
        s.waiting_for = self.phases.waiting_for();
        if let Some(t) = &self.taken {
            s.generation = t.generation;
            s.takeover = Some(t.times);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::takeover::tests::all_gates;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A Takeover sent at 1,000 µs on the shared clock, after a 300 µs bind.
    fn takeover(uncontended: bool, respawn: bool) -> Takeover {
        Takeover {
            generation: 7,
            respawn,
            handed_off: true,
            lock_wait_us: 40,
            bind_us: 300,
            sent_at_us: 1_000,
            uncontended,
            respawns: 2,
        }
    }

    /// The fake clock: `t0` is when the Takeover arrived, at 1,250 µs.
    struct Clock {
        t0: Instant,
    }

    impl Clock {
        fn new() -> Self {
            Self { t0: Instant::now() }
        }
        fn received(&self, msg: Takeover) -> Event {
            Event::Takeover {
                msg,
                at: self.t0,
                now_us: 1_250,
            }
        }
        fn served_after(&self, d: Duration) -> Event {
            Event::Served {
                at: self.t0 + d,
                now_us: 1_250 + d.as_micros() as u64,
            }
        }
    }

    /// Feeds `events` to `l`; returns every action, in order.
    /// A lifecycle (`svids` as [`Lifecycle::new`] takes it) with every gate open that has
    /// received `takeover`.
    fn open_and_taken(svids: bool, takeover: Event) -> Lifecycle {
        let mut l = Lifecycle::new(svids);
        run(&mut l, [Event::Gates(all_gates()), takeover]);
        l
    }

    fn run(l: &mut Lifecycle, events: impl IntoIterator<Item = Event>) -> Vec<Action> {
        events.into_iter().flat_map(|e| l.step(e)).collect()
    }

    /// The actions without the notes.
    fn effects(actions: &[Action]) -> Vec<Action> {
        actions
            .iter()
            .filter(|a| !matches!(a, Action::Note(_)))
            .cloned()
            .collect()
    }

    fn notes(actions: &[Action]) -> Vec<Note> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Note(n) => Some(n.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn gates_complete_a_standby_and_show_in_ready() {
        let mut l = Lifecycle::new(false);
        let mut s = Status::new("n", "p");
        let partial = Gates {
            registry_loaded: true,
            ..Gates::default()
        };
        assert_eq!(l.step(Event::Gates(partial)), []);
        l.show(&mut s);
        assert_eq!((s.role, s.phase, s.ready), ("standby", "building", false));
        assert_eq!(
            s.waiting_for,
            [
                "storage",
                "capture",
                "agent-svid",
                "pod-certificates",
                "encodings"
            ]
        );
        assert_eq!(
            l.step(Event::Gates(all_gates())),
            [
                Action::Note(Note::PodCertificateGate { passed: true }),
                Action::Report(Phase::StandbyComplete)
            ]
        );
        l.show(&mut s);
        assert_eq!((s.phase, s.ready), ("standby-complete", true));
        assert!(s.waiting_for.is_empty() && s.takeover.is_none() && s.generation == 0);
    }

    #[test]
    fn a_gate_timeout_is_noted_only_when_the_gate_had_not_passed_before_serving() {
        let mut l = Lifecycle::new(false);
        let timed_out = |gate, passed| Event::GateTimedOut { gate, passed };
        assert_eq!(l.step(timed_out(Gate::Registry, true)), []);
        assert_eq!(
            l.step(timed_out(Gate::Capture, false)),
            [Action::Note(Note::GateTimedOut(Gate::Capture))]
        );
        // A lone owner: storage and the agent's SVID passed, the rest times out.
        let mut l = Lifecycle::new(false);
        l.step(timed_out(Gate::Capture, false));
        let clock = Clock::new();
        let storage_only = Gates {
            storage_loaded: true,
            agent_svid: true,
            pod_certificates: true,
            ..Gates::default()
        };
        let actions = run(
            &mut l,
            [
                Event::Gates(storage_only),
                clock.received(takeover(true, false)),
                timed_out(Gate::Registry, false),
            ],
        );
        assert_eq!(
            effects(&actions),
            [
                Action::ArmGateTimers,
                Action::Serve { tidy: true },
                Action::Report(Phase::Serving)
            ]
        );
        assert_eq!(
            notes(&actions),
            [
                Note::PodCertificateGate { passed: true },
                Note::TakeoverReceived {
                    msg: takeover(true, false),
                    fd_passing_us: 250
                },
                Note::GateTimedOut(Gate::Registry)
            ],
            "{actions:?}"
        );
        // Once serving, a late timer says nothing.
        assert_eq!(l.step(timed_out(Gate::Identity, false)), []);
    }

    /// Storage loaded, every other gate passed, one stored pod without its SVID.
    fn lacking_one() -> Gates {
        Gates {
            pod_certificates: false,
            ..all_gates()
        }
    }

    #[test]
    fn the_certificate_gate_arms_at_storage_and_a_standby_is_ready_when_it_passes() {
        let mut l = Lifecycle::new(true);
        let mut s = Status::new("n", "p");
        // Before storage is loaded no pod is known: nothing armed, nothing decided.
        assert_eq!(
            l.step(Event::Gates(Gates {
                storage_loaded: false,
                ..lacking_one()
            })),
            []
        );
        assert_eq!(
            l.step(Event::Gates(lacking_one())),
            [Action::ArmPodCertificateGate]
        );
        l.show(&mut s);
        assert_eq!((s.phase, s.ready), ("building", false));
        assert_eq!(s.waiting_for, ["pod-certificates"]);
        // Armed once only.
        assert_eq!(l.step(Event::Gates(lacking_one())), []);
        assert_eq!(
            l.step(Event::Gates(all_gates())),
            [
                Action::Note(Note::PodCertificateGate { passed: true }),
                Action::Report(Phase::StandbyComplete)
            ]
        );
        l.show(&mut s);
        assert!(s.ready && s.waiting_for.is_empty());
        // Latched: a pod added later without its SVID reopens nothing, and a late timer
        // says nothing.
        assert_eq!(l.step(Event::Gates(lacking_one())), []);
        l.show(&mut s);
        assert!(s.ready && s.waiting_for.is_empty());
        assert_eq!(
            l.step(Event::GateTimedOut {
                gate: Gate::PodCertificates,
                passed: false
            }),
            []
        );
    }

    #[test]
    fn the_certificate_gate_never_holds_a_standby_or_a_first_serve_past_its_bound() {
        // A standby: the timeout makes it ready, and is noted once.
        let mut l = Lifecycle::new(true);
        l.step(Event::Gates(lacking_one()));
        let timed_out = Event::GateTimedOut {
            gate: Gate::PodCertificates,
            passed: false,
        };
        assert_eq!(
            l.step(timed_out.clone()),
            [
                Action::Note(Note::PodCertificateGate { passed: false }),
                Action::Report(Phase::StandbyComplete)
            ]
        );
        let mut s = Status::new("n", "p");
        l.show(&mut s);
        assert!(s.ready && s.waiting_for.is_empty(), "{:?}", s.waiting_for);
        assert_eq!(l.step(timed_out.clone()), []);

        // A lone owner: it waits for the gate, then serves at its timeout.
        let clock = Clock::new();
        let mut l = Lifecycle::new(true);
        let actions = run(
            &mut l,
            [
                Event::Gates(lacking_one()),
                clock.received(takeover(true, false)),
            ],
        );
        assert_eq!(
            effects(&actions),
            [Action::ArmPodCertificateGate, Action::ArmGateTimers]
        );
        assert_eq!(
            effects(&l.step(timed_out)),
            [Action::Serve { tidy: true }, Action::Report(Phase::Serving)]
        );

        // An owner whose stored pods all hold their SVIDs serves at once.
        let mut l = Lifecycle::new(true);
        l.step(Event::Gates(all_gates()));
        let actions = l.step(clock.received(takeover(true, false)));
        assert_eq!(
            effects(&actions),
            [
                Action::ArmGateTimers,
                Action::Serve { tidy: true },
                Action::Report(Phase::Serving)
            ]
        );
    }

    #[test]
    fn a_takeover_records_its_times_and_reconciles_only_after_a_contended_start() {
        let clock = Clock::new();
        let mut l = Lifecycle::new(false);
        l.step(Event::Gates(all_gates()));
        let actions = l.step(clock.received(takeover(false, false)));
        assert_eq!(
            actions,
            [
                Action::Note(Note::TakeoverReceived {
                    msg: takeover(false, false),
                    fd_passing_us: 250
                }),
                Action::ArmGateTimers,
                Action::Report(Phase::Reconciling),
                Action::Reconcile,
            ]
        );
        let t = l.taken().unwrap();
        assert_eq!(
            t.times,
            TakeoverTimes {
                lock_wait_us: 40,
                bind_us: 300,
                fd_passing_us: 250,
                handed_off: true,
                ..TakeoverTimes::default()
            }
        );
        assert_eq!((t.generation, t.lock_acquired_us), (7, 700));
        let mut s = Status::new("n", "p");
        l.show(&mut s);
        assert_eq!((s.role, s.phase, s.generation), ("owner", "reconciling", 7));
        assert_eq!(s.takeover, Some(t.times));

        // An uncontended start and a respawn run no reconcile: they serve at once.
        for msg in [takeover(true, false), takeover(false, true)] {
            let mut l = Lifecycle::new(false);
            l.step(Event::Gates(all_gates()));
            assert_eq!(
                effects(&l.step(clock.received(msg.clone()))),
                [
                    Action::ArmGateTimers,
                    Action::Serve { tidy: true },
                    Action::Report(Phase::Serving)
                ],
                "{msg:?}"
            );
            assert_eq!(l.taken().unwrap().times.respawn, msg.respawn);
        }
        // A fd passing clock that went backwards counts 0.
        let mut l = Lifecycle::new(false);
        l.step(Event::Takeover {
            msg: takeover(true, false),
            at: clock.t0,
            now_us: 10,
        });
        assert_eq!(l.taken().unwrap().times.fd_passing_us, 0);
    }

    #[test]
    fn the_reconcile_is_timed_and_its_reload_replaces_the_tidy() {
        let clock = Clock::new();
        let mut l = open_and_taken(false, clock.received(takeover(false, false)));
        assert_eq!(
            l.step(Event::ReconcileDone { took: ms(3) }),
            [
                Action::Serve { tidy: false },
                Action::Report(Phase::Serving)
            ]
        );
        assert_eq!(l.taken().unwrap().times.reconcile_us, 3_000);
        // A late second answer changes the time but serves nothing again.
        assert_eq!(l.step(Event::ReconcileDone { took: ms(4) }), []);
    }

    #[test]
    fn the_svid_wait_is_timed_and_noted_and_then_serves() {
        let clock = Clock::new();
        let mut l = Lifecycle::new(true);
        let actions = run(
            &mut l,
            [
                Event::Gates(all_gates()),
                clock.received(takeover(false, false)),
                Event::ReconcileDone { took: ms(3) },
            ],
        );
        assert_eq!(effects(&actions).last(), Some(&Action::AwaitSvids));
        assert_eq!(
            l.step(Event::SvidsAwaited {
                took: ms(1_000),
                missed: 2
            }),
            [
                Action::Note(Note::SvidWait {
                    took: ms(1_000),
                    missed: 2
                }),
                Action::Serve { tidy: false },
                Action::Report(Phase::Serving)
            ]
        );
        let times = l.taken().unwrap().times;
        assert_eq!((times.svid_wait_us, times.svid_wait_missed), (1_000_000, 2));
    }

    #[test]
    fn serving_completes_the_takeovers_times() {
        let clock = Clock::new();
        let mut l = open_and_taken(false, clock.received(takeover(true, false)));
        let actions = l.step(clock.served_after(ms(2)));
        let t = *l.taken().unwrap();
        assert_eq!((t.times.first_serve_us, t.times.total_us), (2_000, 2_550));
        assert_eq!(
            actions,
            [Action::Note(Note::Serving {
                taken: t,
                first_serve: ms(2)
            })]
        );
        let mut s = Status::new("n", "p");
        l.show(&mut s);
        assert_eq!((s.phase, s.ready), ("serving", true));
        assert_eq!(s.takeover, Some(t.times));
        // Served without a takeover (never sent by the driver): nothing to time.
        assert_eq!(Lifecycle::new(false).step(clock.served_after(ms(1))), []);
    }

    #[test]
    fn a_drain_before_serving_exits_at_once() {
        let mut l = Lifecycle::new(false);
        l.step(Event::Gates(all_gates()));
        assert_eq!(
            l.step(Event::Drain { successor: true }),
            [Action::Report(Phase::Draining), Action::Exit(0)]
        );
        // An owner still waiting for its gates has served nothing either.
        let mut l = Lifecycle::new(false);
        l.step(Clock::new().received(takeover(true, false)));
        assert_eq!(
            l.step(Event::Drain { successor: false }),
            [Action::Report(Phase::Draining), Action::Exit(0)]
        );
    }

    #[test]
    fn a_served_owner_drains_releases_and_waits_for_its_successor_only_when_it_has_one() {
        for successor in [true, false] {
            let clock = Clock::new();
            let mut l = open_and_taken(false, clock.received(takeover(true, false)));
            run(&mut l, [clock.served_after(ms(1))]);
            assert_eq!(
                l.step(Event::Drain { successor }),
                [Action::Report(Phase::Draining), Action::Drain]
            );
            assert_eq!(
                l.step(Event::Drained),
                [
                    Action::Note(Note::Drained { successor }),
                    Action::Release {
                        await_successor: successor
                    },
                    Action::Report(Phase::Released)
                ]
            );
            let mut s = Status::new("n", "p");
            l.show(&mut s);
            assert_eq!((s.role, s.phase, s.ready), ("owner", "released", false));
            assert_eq!(
                l.step(Event::StreamsDone),
                [Action::Note(Note::Exiting), Action::Exit(0)]
            );
        }
    }

    #[test]
    fn the_last_drain_names_the_successor() {
        let clock = Clock::new();
        let mut l = open_and_taken(false, clock.received(takeover(true, false)));
        run(
            &mut l,
            [
                Event::Drain { successor: false },
                Event::Drain { successor: true },
            ],
        );
        assert_eq!(
            effects(&l.step(Event::Drained)),
            [
                Action::Release {
                    await_successor: true
                },
                Action::Report(Phase::Released)
            ]
        );
    }

    #[test]
    fn the_end_of_the_control_channel_exits_with_1_in_any_phase() {
        let clock = Clock::new();
        let mut l = Lifecycle::new(false);
        assert_eq!(l.step(Event::ControlEnded), [Action::Exit(1)]);
        run(
            &mut l,
            [
                Event::Gates(all_gates()),
                clock.received(takeover(true, false)),
            ],
        );
        assert_eq!(l.step(Event::ControlEnded), [Action::Exit(1)]);
    }
}
