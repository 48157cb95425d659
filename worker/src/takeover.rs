//! The role and phase state machine of one worker. Pure: `step(state, event)` returns
//! the next state and the actions that [`crate::lifecycle`] hands on to the driver in
//! [`crate::agent`], so every rule here is tested without sockets, clocks or root.
//!
//! Phases: Building → StandbyComplete → Reconciling → Serving → Draining → Released.
//! - A standby is complete only when its gates really passed (no timeouts).
//! - An owner (Takeover received) serves once its gates passed or, for the registry and
//!   capture gates, timed out: nobody else serves the node then, so the first serve
//!   proceeds. Storage has no timeout; it is local.
//! - A takeover after a contended start reconciles with storage first; an uncontended
//!   start or a respawn runs no takeover step.
//! - The lenient client-certificate gate (pods' SVIDs on): a standby's readiness and an
//!   owner's first serve wait for the SVIDs of the pods it holds records for, at most
//!   `--pod-certificate-gate` from the moment storage is loaded, then proceed either way:
//!   a timeout costs those pods their QUIC twins until the SVIDs come, never the node's
//!   endpoints, so unlike the registry and capture gates it never holds a standby back.
//! - With pods' SVIDs on, a reconcile is followed by a short wait for the SVIDs of the
//!   pods it added ([`SvidWait`]); the driver bounds it (1 s) and then reports
//!   [`Event::SvidsReady`] either way.

use std::collections::BTreeSet;

use aether_model::Gates;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Building,
    StandbyComplete,
    Reconciling,
    Serving,
    Draining,
    /// A drained owner gave the node up: nothing in flight, no listener or lock
    /// descriptor left, only its open proxy streams until the successor serves.
    Released,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Building => "building",
            Phase::StandbyComplete => "standby-complete",
            Phase::Reconciling => "reconciling",
            Phase::Serving => "serving",
            Phase::Draining => "draining",
            Phase::Released => "released",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Registry,
    Capture,
    /// The agent's own SVID (identity on).
    Identity,
    /// The stored pods' SVIDs: the lenient client-certificate gate.
    PodCertificates,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Gates(Gates),
    /// A lone owner's first-serve gate timed out (registry 15 s, capture 10 s, the
    /// agent's SVID 5 s).
    GateTimedOut(Gate),
    Takeover {
        reconcile: bool,
    },
    ReconcileDone,
    /// The pods the reconcile added hold their SVIDs, or the bounded wait is over.
    SvidsReady,
    Drain,
    /// The CNI API finished its in-flight calls after a drain.
    Drained,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Tell the supervisor the new phase.
    Report(Phase),
    /// Arm the lone owner's gate timers.
    ArmGateTimers,
    /// Arm the client-certificate gate's timer (storage is loaded and a stored pod lacks
    /// its SVID); in a standby and an owner alike.
    ArmPodCertificateGate,
    /// The client-certificate gate is decided, once: `passed`, or timed out.
    PodCertificateGate { passed: bool },
    /// Apply the storage diff to the node (noting first which pods lack an SVID, for
    /// [`SvidWait`]).
    Reconcile,
    /// Wait, bounded, for the SVIDs of the pods the reconcile added ([`SvidWait`]).
    AwaitSvids,
    /// Accept on both sockets, start the owner-only writers and the metrics listener.
    Serve,
    /// Stop taking new CNI calls, finish in-flight ones (a worker that serves nothing
    /// exits at once).
    Drain,
    /// Stop accepting on `xds.sock` and close the lock and listener descriptors, so that
    /// the supervisor can hand the node on; the open proxy streams stay until the
    /// successor serves, then the worker exits.
    Release,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub phase: Phase,
    pub owner: bool,
    gates: Gates,
    registry_timed_out: bool,
    capture_timed_out: bool,
    identity_timed_out: bool,
    /// The client-certificate gate: its timer armed, and how it ended (latched: a pod
    /// added later without its SVID does not reopen it).
    pod_certs_armed: bool,
    pod_certs_passed: bool,
    pod_certs_timed_out: bool,
    /// The takeover asked for a reconcile that has not run yet.
    reconcile: bool,
    /// Pods get SVIDs: a reconcile is followed by [`Action::AwaitSvids`].
    pod_svids: bool,
    /// The reconcile is done and the SVID wait runs.
    awaiting_svids: bool,
}

impl Default for State {
    fn default() -> Self {
        Self {
            phase: Phase::Building,
            owner: false,
            gates: Gates::default(),
            registry_timed_out: false,
            capture_timed_out: false,
            identity_timed_out: false,
            pod_certs_armed: false,
            pod_certs_passed: false,
            pod_certs_timed_out: false,
            reconcile: false,
            pod_svids: false,
            awaiting_svids: false,
        }
    }
}

impl State {
    /// The initial state; `pod_svids` when the node's pods get SVIDs (identity on, with a
    /// broker), so that a takeover waits for those of the pods it adds.
    pub fn new(pod_svids: bool) -> Self {
        Self {
            pod_svids,
            ..Self::default()
        }
    }

    /// Standby completeness: every gate really passed, and the encodings of the loaded
    /// inputs are made, which a takeover answers the proxy with.
    pub fn complete(&self) -> bool {
        self.gates.registry_loaded
            && self.gates.capture_landed
            && self.gates.storage_loaded
            && self.gates.agent_svid
            && self.pod_certs_done()
            && self.gates.encodings_warm
    }

    /// The client-certificate gate passed or timed out.
    fn pod_certs_done(&self) -> bool {
        self.pod_certs_passed || self.pod_certs_timed_out
    }

    /// An owner's first serve: gates passed or, where allowed, timed out.
    fn may_first_serve(&self) -> bool {
        self.gates.storage_loaded
            && (self.gates.registry_loaded || self.registry_timed_out)
            && (self.gates.capture_landed || self.capture_timed_out)
            && (self.gates.agent_svid || self.identity_timed_out)
            && self.pod_certs_done()
    }

    /// The gates not yet passed, as `/ready` names them.
    pub fn waiting_for(&self) -> Vec<&'static str> {
        let g = &self.gates;
        [
            (g.storage_loaded, "storage"),
            (g.registry_loaded, "registry"),
            (g.capture_landed, "capture"),
            (g.agent_svid, "agent-svid"),
            (self.pod_certs_done(), "pod-certificates"),
            // Only a standby waits for it.
            (g.encodings_warm || self.owner, "encodings"),
        ]
        .into_iter()
        .filter_map(|(passed, name)| (!passed).then_some(name))
        .collect()
    }

    /// `GET /ready`: a complete standby, or an owner that serves.
    pub fn ready(&self) -> bool {
        matches!(self.phase, Phase::StandbyComplete | Phase::Serving)
    }
}

/// Advances the state machine by one event.
pub fn step(mut s: State, event: Event) -> (State, Vec<Action>) {
    let mut actions = Vec::new();
    match event {
        Event::Gates(g) => {
            s.gates = g;
            // Storage loaded: the pods it holds records for are known. Before that no
            // pod lacks anything, which proves nothing.
            if g.storage_loaded && !s.pod_certs_done() {
                if g.pod_certificates {
                    s.pod_certs_passed = true;
                    actions.push(Action::PodCertificateGate { passed: true });
                } else if !s.pod_certs_armed {
                    s.pod_certs_armed = true;
                    actions.push(Action::ArmPodCertificateGate);
                }
            }
        }
        Event::GateTimedOut(Gate::PodCertificates) => {
            if !s.pod_certs_done() {
                s.pod_certs_timed_out = true;
                actions.push(Action::PodCertificateGate { passed: false });
            }
        }
        Event::GateTimedOut(Gate::Registry) => s.registry_timed_out = true,
        Event::GateTimedOut(Gate::Capture) => s.capture_timed_out = true,
        Event::GateTimedOut(Gate::Identity) => s.identity_timed_out = true,
        Event::Takeover { reconcile } => {
            if s.owner || matches!(s.phase, Phase::Draining | Phase::Released) {
                return (s, actions);
            }
            s.owner = true;
            s.reconcile = reconcile;
            actions.push(Action::ArmGateTimers);
        }
        Event::ReconcileDone if s.phase == Phase::Reconciling && s.reconcile => {
            s.reconcile = false;
            if s.pod_svids {
                s.awaiting_svids = true;
                actions.push(Action::AwaitSvids);
            } else {
                s.phase = Phase::Serving;
                actions.extend([Action::Serve, Action::Report(Phase::Serving)]);
            }
            return (s, actions);
        }
        Event::ReconcileDone => {}
        Event::SvidsReady if s.phase == Phase::Reconciling && s.awaiting_svids => {
            s.awaiting_svids = false;
            s.phase = Phase::Serving;
            actions.extend([Action::Serve, Action::Report(Phase::Serving)]);
            return (s, actions);
        }
        Event::SvidsReady => {}
        Event::Drain => {
            if !matches!(s.phase, Phase::Draining | Phase::Released) {
                s.phase = Phase::Draining;
                actions.extend([Action::Report(Phase::Draining), Action::Drain]);
            }
            return (s, actions);
        }
        Event::Drained => {
            if s.phase == Phase::Draining && s.owner {
                s.phase = Phase::Released;
                actions.extend([Action::Release, Action::Report(Phase::Released)]);
            }
            return (s, actions);
        }
    }
    // Progress the phase as far as the state allows.
    // Not collapsed into match guards: an owner that may not serve yet must stop in its
    // arm, not fall through to the standby arms below.
    #[allow(clippy::collapsible_match)]
    match s.phase {
        Phase::Building | Phase::StandbyComplete if s.owner => {
            if s.may_first_serve() {
                if s.reconcile {
                    s.phase = Phase::Reconciling;
                    actions.extend([Action::Report(Phase::Reconciling), Action::Reconcile]);
                } else {
                    s.phase = Phase::Serving;
                    actions.extend([Action::Serve, Action::Report(Phase::Serving)]);
                }
            }
        }
        Phase::Building if s.complete() => {
            s.phase = Phase::StandbyComplete;
            actions.push(Action::Report(Phase::StandbyComplete));
        }
        _ => {}
    }
    (s, actions)
}

/// The takeover's wait for SVIDs, by the pods it is for: those that lack an SVID after
/// the reconcile and did not lack one just before it, that is, the pods the reconcile
/// added (a rewritten pod keeps its SVID). A pod that was already waiting for its SVID
/// before the takeover (its provider holds it back) does not hold the takeover up: the
/// previous owner served without it too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SvidWait {
    baseline: BTreeSet<String>,
}

impl SvidWait {
    /// `lacking`: the uids of the pods without an SVID just before the reconcile.
    pub fn new(lacking: BTreeSet<String>) -> Self {
        Self { baseline: lacking }
    }

    /// Of the pods lacking an SVID now, those the wait is for; the wait is over when none
    /// is left (or its bound passed).
    pub fn pending<'a>(
        &self,
        lacking_now: impl IntoIterator<Item = &'a String>,
    ) -> Vec<&'a String> {
        lacking_now
            .into_iter()
            .filter(|uid| !self.baseline.contains(*uid))
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn all_gates() -> Gates {
        Gates {
            registry_loaded: true,
            capture_landed: true,
            storage_loaded: true,
            agent_svid: true,
            pod_certificates: true,
            encodings_warm: true,
        }
    }

    /// The client-certificate gate's own actions, which its tests check; the others leave
    /// them out.
    fn is_cert_gate(a: &Action) -> bool {
        matches!(
            a,
            Action::PodCertificateGate { .. } | Action::ArmPodCertificateGate
        )
    }

    #[test]
    fn the_certificate_gate_waits_from_storage_and_is_decided_once() {
        let lacking = Gates {
            pod_certificates: false,
            ..all_gates()
        };
        let mut s = State::new(true);
        let (next, a) = step(s, Event::Gates(lacking));
        s = next;
        assert_eq!(a, [Action::ArmPodCertificateGate]);
        assert!(!s.complete() && s.waiting_for() == ["pod-certificates"]);
        let (next, a) = step(s, Event::GateTimedOut(Gate::PodCertificates));
        s = next;
        assert_eq!(
            a,
            [
                Action::PodCertificateGate { passed: false },
                Action::Report(Phase::StandbyComplete)
            ]
        );
        assert!(s.complete() && s.waiting_for().is_empty());
        // Decided: the SVIDs arriving later say nothing more.
        let (_, a) = step(s, Event::Gates(all_gates()));
        assert_eq!(a, []);
    }

    /// Feeds `events` from the default state; checks the final phase and every action.
    fn check(events: &[Event], phase: Phase, actions: &[Action]) {
        let mut s = State::default();
        let mut all = Vec::new();
        for e in events {
            let (next, a) = step(s, *e);
            s = next;
            all.extend(a.into_iter().filter(|a| !is_cert_gate(a)));
        }
        assert_eq!(s.phase, phase, "events {events:?}");
        assert_eq!(all, actions, "events {events:?}");
    }

    #[test]
    fn standby_completes_only_when_every_gate_passed() {
        let partial = Gates {
            registry_loaded: true,
            capture_landed: true,
            storage_loaded: false,
            agent_svid: true,
            pod_certificates: true,
            encodings_warm: true,
        };
        check(&[Event::Gates(partial)], Phase::Building, &[]);
        check(
            &[
                Event::GateTimedOut(Gate::Registry),
                Event::GateTimedOut(Gate::Capture),
            ],
            Phase::Building,
            &[],
        );
        check(
            &[Event::Gates(all_gates())],
            Phase::StandbyComplete,
            &[Action::Report(Phase::StandbyComplete)],
        );
    }

    #[test]
    fn a_standby_is_complete_once_warm_but_an_owner_serves_cold() {
        let cold = Gates {
            encodings_warm: false,
            ..all_gates()
        };
        let (s, a) = step(State::default(), Event::Gates(cold));
        assert_eq!(s.phase, Phase::Building);
        assert!(a.iter().all(is_cert_gate), "{a:?}");
        assert!(!s.ready() && s.waiting_for() == ["encodings"]);
        check(
            &[Event::Gates(cold), Event::Gates(all_gates())],
            Phase::StandbyComplete,
            &[Action::Report(Phase::StandbyComplete)],
        );
        // Handed the node cold, it serves at once: a push encodes what it needs itself.
        check(
            &[
                Event::Gates(cold),
                Event::Takeover { reconcile: true },
                Event::ReconcileDone,
            ],
            Phase::Serving,
            &[
                Action::ArmGateTimers,
                Action::Report(Phase::Reconciling),
                Action::Reconcile,
                Action::Serve,
                Action::Report(Phase::Serving),
            ],
        );
        let (s, _) = step(State::default(), Event::Takeover { reconcile: false });
        let (s, _) = step(s, Event::Gates(cold));
        assert!(s.ready() && s.waiting_for().is_empty());
    }

    #[test]
    fn complete_standby_takes_over_with_reconcile() {
        check(
            &[
                Event::Gates(all_gates()),
                Event::Takeover { reconcile: true },
                Event::ReconcileDone,
            ],
            Phase::Serving,
            &[
                Action::Report(Phase::StandbyComplete),
                Action::ArmGateTimers,
                Action::Report(Phase::Reconciling),
                Action::Reconcile,
                Action::Serve,
                Action::Report(Phase::Serving),
            ],
        );
    }

    #[test]
    fn uncontended_start_runs_no_takeover_step() {
        check(
            &[
                Event::Takeover { reconcile: false },
                Event::Gates(all_gates()),
            ],
            Phase::Serving,
            &[
                Action::ArmGateTimers,
                Action::Serve,
                Action::Report(Phase::Serving),
            ],
        );
    }

    #[test]
    fn lone_owner_serves_after_gate_timeouts_but_not_before_storage() {
        let storage_only = Gates {
            storage_loaded: true,
            agent_svid: true,
            pod_certificates: true,
            ..Gates::default()
        };
        check(
            &[
                Event::Takeover { reconcile: false },
                Event::Gates(storage_only),
                Event::GateTimedOut(Gate::Capture),
            ],
            Phase::Building,
            &[Action::ArmGateTimers],
        );
        check(
            &[
                Event::Takeover { reconcile: false },
                Event::Gates(storage_only),
                Event::GateTimedOut(Gate::Capture),
                Event::GateTimedOut(Gate::Registry),
            ],
            Phase::Serving,
            &[
                Action::ArmGateTimers,
                Action::Serve,
                Action::Report(Phase::Serving),
            ],
        );
    }

    #[test]
    fn the_agent_svid_gates_a_standby_and_times_out_only_for_a_lone_owner() {
        let no_svid = Gates {
            agent_svid: false,
            ..all_gates()
        };
        // A standby without its SVID is not complete, however long it waits.
        check(
            &[Event::Gates(no_svid), Event::GateTimedOut(Gate::Identity)],
            Phase::Building,
            &[],
        );
        check(
            &[Event::Gates(no_svid), Event::Gates(all_gates())],
            Phase::StandbyComplete,
            &[Action::Report(Phase::StandbyComplete)],
        );
        // A lone owner serves once the bounded wait is over.
        check(
            &[Event::Takeover { reconcile: false }, Event::Gates(no_svid)],
            Phase::Building,
            &[Action::ArmGateTimers],
        );
        check(
            &[
                Event::Takeover { reconcile: false },
                Event::Gates(no_svid),
                Event::GateTimedOut(Gate::Identity),
            ],
            Phase::Serving,
            &[
                Action::ArmGateTimers,
                Action::Serve,
                Action::Report(Phase::Serving),
            ],
        );
        let s = State {
            gates: no_svid,
            pod_certs_passed: true,
            ..State::default()
        };
        assert_eq!(s.waiting_for(), vec!["agent-svid"]);
    }

    #[test]
    fn with_pod_svids_a_reconcile_is_followed_by_the_svid_wait() {
        let run = |events: &[Event]| {
            let mut s = State::new(true);
            let mut all = Vec::new();
            for e in events {
                let (next, a) = step(s, *e);
                s = next;
                all.extend(a.into_iter().filter(|a| !is_cert_gate(a)));
            }
            (s.phase, all)
        };
        let takeover = [
            Event::Gates(all_gates()),
            Event::Takeover { reconcile: true },
            Event::ReconcileDone,
        ];
        let (phase, actions) = run(&takeover);
        assert_eq!(
            phase,
            Phase::Reconciling,
            "waits for the SVIDs before serving"
        );
        assert_eq!(
            actions,
            [
                Action::Report(Phase::StandbyComplete),
                Action::ArmGateTimers,
                Action::Report(Phase::Reconciling),
                Action::Reconcile,
                Action::AwaitSvids
            ]
        );
        let (phase, actions) = run(&[
            &takeover[..],
            &[Event::SvidsReady, Event::SvidsReady, Event::ReconcileDone],
        ]
        .concat());
        assert_eq!(phase, Phase::Serving);
        assert_eq!(
            actions[5..],
            [Action::Serve, Action::Report(Phase::Serving)],
            "served once"
        );
        // A wait that ends after a drain serves nothing.
        let (phase, actions) = run(&[&takeover[..], &[Event::Drain, Event::SvidsReady]].concat());
        assert_eq!(phase, Phase::Draining);
        assert!(!actions.contains(&Action::Serve), "{actions:?}");
        // No reconcile (uncontended start, respawn): no wait either; an early SvidsReady is
        // ignored.
        let (phase, actions) = run(&[
            Event::SvidsReady,
            Event::Takeover { reconcile: false },
            Event::Gates(all_gates()),
        ]);
        assert_eq!(phase, Phase::Serving);
        assert_eq!(
            actions,
            [
                Action::ArmGateTimers,
                Action::Serve,
                Action::Report(Phase::Serving)
            ]
        );
    }

    #[test]
    fn the_svid_wait_is_for_the_pods_the_reconcile_added_only() {
        let set = |uids: &[&str]| {
            uids.iter()
                .map(|u| u.to_string())
                .collect::<BTreeSet<String>>()
        };
        // Before the reconcile: "held" has no SVID (its provider holds it back).
        let wait = SvidWait::new(set(&["held"]));
        let check = |lacking_now: &[&str], want: &[&str]| {
            let now = set(lacking_now);
            let got: Vec<&str> = wait.pending(&now).into_iter().map(String::as_str).collect();
            assert_eq!(got, want, "lacking now {lacking_now:?}");
        };
        // Right after the reconcile added "new1" and "new2": both wait, "held" does not.
        check(&["held", "new1", "new2"], &["new1", "new2"]);
        check(&["held", "new2"], &["new2"]);
        // Every added pod has its SVID: over, though "held" still lacks one.
        check(&["held"], &[]);
        // "held" leaving changes nothing; a pod that lost its SVID counts as added.
        check(&[], &[]);
        check(&["old"], &["old"]);
        // Nothing lacked one before: every pod lacking one now is waited for.
        assert_eq!(SvidWait::default().pending(&set(&["a"])).len(), 1);
    }

    #[test]
    fn drain_is_final_and_blocks_takeover() {
        check(
            &[
                Event::Gates(all_gates()),
                Event::Drain,
                Event::Takeover { reconcile: true },
                Event::Drain,
            ],
            Phase::Draining,
            &[
                Action::Report(Phase::StandbyComplete),
                Action::Report(Phase::Draining),
                Action::Drain,
            ],
        );
    }

    #[test]
    fn a_drained_owner_releases_the_node_once_and_takes_nothing_back() {
        check(
            &[
                Event::Gates(all_gates()),
                Event::Takeover { reconcile: false },
                Event::Drain,
                Event::Drained,
                Event::Drained,
                Event::Drain,
                Event::Takeover { reconcile: false },
            ],
            Phase::Released,
            &[
                Action::Report(Phase::StandbyComplete),
                Action::ArmGateTimers,
                Action::Serve,
                Action::Report(Phase::Serving),
                Action::Report(Phase::Draining),
                Action::Drain,
                Action::Release,
                Action::Report(Phase::Released),
            ],
        );
        // A standby holds nothing to release.
        check(
            &[Event::Gates(all_gates()), Event::Drain, Event::Drained],
            Phase::Draining,
            &[
                Action::Report(Phase::StandbyComplete),
                Action::Report(Phase::Draining),
                Action::Drain,
            ],
        );
    }

    #[test]
    fn second_takeover_is_ignored_and_ready_follows_phase() {
        let (s, _) = step(State::default(), Event::Gates(all_gates()));
        assert!(s.ready() && !s.owner);
        let (s, _) = step(s, Event::Takeover { reconcile: false });
        assert!(s.ready() && s.owner && s.phase == Phase::Serving);
        let (s2, a) = step(s, Event::Takeover { reconcile: true });
        assert_eq!((s2, a), (s, vec![]));
        let (s, _) = step(s, Event::Drain);
        assert!(!s.ready());
    }
}
