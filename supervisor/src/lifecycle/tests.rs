//! Every phase and timer of the lifecycle, on a fake clock and fake resources: each step
//! is one event at a given millisecond and the actions it must return, written the way
//! the driver would log them. After every step the timers are checked against the phase.

use std::time::{Duration, Instant};

use shared_proto::control::{Body, CONTROL_VERSION, Hello, Phase as WorkerStatus, Ping, Status};

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fake;

impl Resources for Fake {
    type Pid = u32;
    type Control = &'static str;
    type Lock = &'static str;
    type Held = &'static str;
    type Node = &'static str;
}

type E = Event<Fake>;

fn hello() -> E {
    Event::Message(Body::Hello(Hello {
        version: CONTROL_VERSION,
    }))
}
fn status(p: WorkerStatus) -> E {
    Event::Message(Body::Status(Status { phase: p as i32 }))
}
fn pong(seq: u64) -> E {
    Event::Message(Body::Pong(Ping { seq }))
}
fn spawned(pid: u32) -> E {
    Event::Spawned {
        pid,
        control: "ctl",
    }
}
fn exited(pid: u32, code: i32) -> E {
    Event::Exited {
        pid,
        code,
        status: format!("exit {code}"),
    }
}
fn took(generation: u64, handed_off: bool) -> E {
    let t = Took {
        generation,
        handed_off,
        kept: false,
        uncontended: false,
        lock_wait: Duration::from_millis(3),
        bind: Duration::from_millis(1),
    };
    Event::Took("node", t)
}
/// Handed off by the socket keeper.
fn took_kept(generation: u64) -> E {
    let Event::Took(node, t) = took(generation, true) else {
        unreachable!()
    };
    Event::Took(node, Took { kept: true, ..t })
}

/// The lifecycle on a clock that starts at 0 ms.
struct Clock {
    lc: Lifecycle<Fake>,
    t0: Instant,
}

impl Clock {
    fn new(held: Option<&'static str>, conflist: bool) -> Self {
        let t0 = Instant::now();
        Self {
            lc: Lifecycle::new(t0, held, conflist),
            t0,
        }
    }

    /// A standby whose worker (pid 1) said Hello at 0 ms.
    fn standby() -> Self {
        let mut c = Self::new(None, false);
        c.step(0, Event::Tick, &["spawn", "fetch"]);
        c.step(0, spawned(1), &[]);
        c.step(0, hello(), &[]);
        c.step(0, Event::Fetched(None), &[]);
        c
    }

    /// An owner (generation 7, handed off) whose worker (pid 1) was sent the node at 0 ms.
    fn owner(conflist: bool) -> Self {
        let mut c = Self::new(Some("held"), conflist);
        c.step(0, Event::Tick, &["spawn", "fetch"]);
        c.step(0, spawned(1), &[]);
        c.step(0, hello(), &[]);
        c.step(0, Event::Fetched(None), &[]);
        c.step(
            0,
            Event::LockAcquired("lock"),
            &["take lock held=held keeper=false"],
        );
        c.step(
            0,
            took(7, true),
            &[
                "takeover gen=7 respawn=false handed_off=true respawns=0",
                "store listeners",
            ],
        );
        c
    }

    /// An owner (generation 7) that bound fresh sockets, its worker (pid 1) sent the node
    /// at 0 ms: no standby can hold them, so only a fetch makes a successor.
    fn fresh_owner(conflist: bool) -> Self {
        let mut c = Self::new(None, conflist);
        c.step(0, Event::Tick, &["spawn", "fetch"]);
        c.step(0, spawned(1), &[]);
        c.step(0, hello(), &[]);
        c.step(0, Event::Fetched(None), &[]);
        c.step(
            0,
            Event::LockAcquired("lock"),
            &["take lock held=none keeper=true"],
        );
        c.step(
            0,
            took(7, false),
            &[
                "takeover gen=7 respawn=false handed_off=false respawns=0",
                "store listeners",
            ],
        );
        c
    }

    fn ms(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    fn step(&mut self, ms: u64, event: E, want: &[&str]) {
        let what = format!("{event:?}");
        let got: Vec<String> = self
            .lc
            .step(event, self.ms(ms))
            .iter()
            .map(|a| self.show(a))
            .collect();
        assert_eq!(got, want, "at {ms} ms, {what}, in {}", self.phase());
        self.invariants();
    }

    /// A tick at each of `ms`: each must do nothing.
    fn quiet(&mut self, ms: &[u64]) {
        for &m in ms {
            self.step(m, Event::Tick, &[]);
        }
    }

    fn phase(&self) -> String {
        match &self.lc.phase {
            Phase::Standby { held } => format!("standby held={held:?}"),
            Phase::Taking { .. } => "taking".into(),
            Phase::Blocked { .. } => "blocked".into(),
            Phase::Owning(_) => "owning".into(),
            Phase::Draining { node } => format!("draining node={}", node.is_some()),
            Phase::Exiting(code) => format!("exiting {code}"),
        }
    }

    fn next_ms(&self) -> Option<u64> {
        self.lc
            .timers()
            .next()
            .map(|t| t.duration_since(self.t0).as_millis() as u64)
    }

    fn show(&self, a: &Action<Fake>) -> String {
        match a {
            Action::Spawn => "spawn".into(),
            Action::Send(Body::Ping(p)) => format!("ping {}", p.seq),
            Action::Send(Body::Drain(d)) => format!("drain successor={}", d.successor),
            Action::Send(b) => format!("send {}", b.name()),
            Action::SendTakeover(t) => {
                format!(
                    "takeover gen={} respawn={} handed_off={} respawns={}",
                    t.generation, t.respawn, t.handed_off, t.respawns
                )
            }
            Action::Kill { pid, why } => match why {
                Kill::Violation(_) => format!("kill {pid} violation"),
                Kill::Malformed(_) => format!("kill {pid} malformed"),
                why => format!("kill {pid} {why:?}"),
            },
            Action::TakeNode {
                lock,
                held,
                ask_keeper,
                since,
            } => {
                assert!(*since <= self.t0 + Duration::from_secs(3600));
                format!(
                    "take {lock} held={} keeper={ask_keeper}",
                    held.unwrap_or("none")
                )
            }
            Action::FetchHandoff => "fetch".into(),
            Action::ReassertConflist => "conflist".into(),
            Action::StoreListeners => "store listeners".into(),
            Action::Watchdog => "watchdog".into(),
            Action::Release(node) => format!("release {node}"),
            Action::Report(r) => match r {
                Report::Respawning {
                    pid,
                    delay,
                    respawns,
                    how,
                    ..
                } => {
                    format!(
                        "respawning {pid} in {}ms #{respawns} ({how})",
                        delay.as_millis()
                    )
                }
                Report::LiveServer { path } => format!("live server {}", path.display()),
                r => format!("{r:?}"),
            },
        }
    }

    /// Each timer is armed only in its phase (see [`Timers`]).
    fn invariants(&self) {
        let (t, lc) = (self.lc.timers(), &self.lc);
        let phase = self.phase();
        let draining = matches!(&lc.phase, Phase::Draining { .. });
        if t.respawn.is_some() {
            assert!(
                lc.worker.is_none() && !draining,
                "respawn armed with a worker or draining: {phase}"
            );
        }
        if t.ping.is_some() || t.heartbeat.is_some() {
            let w = lc
                .worker
                .as_ref()
                .unwrap_or_else(|| panic!("heartbeat armed without a worker: {phase}"));
            assert_ne!(
                w.monitor.phase(),
                WorkerPhase::AwaitHello,
                "heartbeat before Hello"
            );
        }
        assert!(
            t.fetch.is_none() || matches!(&lc.phase, Phase::Standby { .. }),
            "fetch armed in {phase}"
        );
        assert!(
            t.retry.is_none() || matches!(&lc.phase, Phase::Blocked { .. }),
            "retry armed in {phase}"
        );
        assert!(
            t.conflist.is_none() || matches!(&lc.phase, Phase::Owning(_)),
            "conflist armed in {phase}"
        );
        assert!(
            t.drain.is_none() || draining,
            "drain deadline armed in {phase}"
        );
        if let Phase::Exiting(_) = &lc.phase {
            assert_eq!(*t, Timers::default(), "timers armed while exiting");
        }
    }
}

#[test]
fn a_standby_starts_its_worker_and_keeps_fetching_the_owners_listeners() {
    let mut c = Clock::new(None, true);
    assert_eq!(c.next_ms(), Some(0));
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, spawned(1), &[]);
    // No owner answers: again in 200 ms.
    c.step(0, Event::Fetched(None), &[]);
    assert_eq!(c.next_ms(), Some(200));
    c.quiet(&[199]);
    c.step(200, Event::Tick, &["fetch"]);
    // An owner offers: kept, and fetched again every 2 s (the owner may bind new ones).
    c.step(200, Event::Fetched(Some("h1")), &[]);
    assert_eq!(c.phase(), "standby held=Some(\"h1\")");
    c.step(2200, Event::Tick, &["fetch"]);
    // An owner that stops answering does not take away what is held.
    c.step(2200, Event::Fetched(None), &[]);
    assert_eq!(c.phase(), "standby held=Some(\"h1\")");
    c.step(2400, Event::Tick, &["fetch"]);
    c.step(2400, Event::Fetched(Some("h2")), &[]);
    assert_eq!(c.phase(), "standby held=Some(\"h2\")");
    // A standby never checks the conflist, whatever the flags.
    c.quiet(&[2401, 4399]);
}

/// Held sockets whose owner is gone, while the lock stays another's for a second: that
/// holder has no sockets and waits for every copy of the old ones to close, so the
/// standby closes its own. An owner answering again in between starts the count afresh.
#[test]
fn a_standby_closes_held_sockets_once_no_owner_offers_them_for_a_second() {
    let mut c = Clock::standby();
    c.step(0, Event::Fetched(Some("h1")), &[]);
    c.step(2000, Event::NoOwner, &[]);
    c.step(2200, Event::Fetched(None), &[]);
    c.step(2400, Event::NoOwner, &[]);
    c.step(3000, Event::NoOwner, &[]);
    assert_eq!(c.phase(), "standby held=Some(\"h1\")");
    c.step(3400, Event::NoOwner, &["HeldOrphaned"]);
    assert_eq!(c.phase(), "standby held=None");
    // Then the lock: nothing held, so the keeper is asked and fresh sockets bound.
    c.step(
        3500,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
}

#[test]
fn heartbeats_start_at_hello_ping_every_second_and_kill_after_five_silent_seconds() {
    let mut c = Clock::new(None, false);
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, spawned(1), &[]);
    c.step(
        0,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(0, took(1, false), &["store listeners"]);
    // Before Hello: no ping and no deadline, however long it takes.
    c.quiet(&[1000, 5000, 10_000]);
    c.step(
        10_000,
        hello(),
        &["takeover gen=1 respawn=false handed_off=false respawns=0"],
    );
    c.quiet(&[10_999]);
    c.step(11_000, Event::Tick, &["ping 1"]);
    c.step(11_002, pong(1), &["watchdog"]);
    c.step(12_000, Event::Tick, &["ping 2"]);
    // A late answer to an older ping still counts.
    c.step(12_100, pong(1), &["watchdog"]);
    c.step(13_000, Event::Tick, &["ping 3"]);
    c.step(14_000, Event::Tick, &["ping 4"]);
    c.step(15_000, Event::Tick, &["ping 5"]);
    c.step(16_000, Event::Tick, &["ping 6"]);
    // Five seconds after the last pong (12.1 s).
    c.step(17_000, Event::Tick, &["ping 7"]);
    c.quiet(&[17_099]);
    c.step(17_100, Event::Tick, &["kill 1 MissedHeartbeats"]);
    // Nothing it says counts any more; a kill that did not take is repeated a deadline on.
    c.step(17_200, pong(7), &[]);
    c.step(18_000, Event::Tick, &["ping 8"]);
    c.step(22_100, Event::Tick, &["kill 1 MissedHeartbeats"]);
    c.step(
        22_200,
        exited(1, 137),
        &["respawning 1 in 0ms #1 (exited: exit 137)"],
    );
    assert_eq!(c.lc.timers().heartbeat, None);
}

/// `WATCHDOG=1` follows the worker's answers, not the supervisor's clock: nothing before
/// the first Pong, nothing while the worker is silent, dying or being replaced, and again
/// from the replacement's first Pong. A unit whose worker cannot answer for `WatchdogSec`
/// is restarted by systemd.
#[test]
fn the_watchdog_is_told_only_while_the_worker_answers_heartbeats() {
    let mut c = Clock::owner(false);
    // Hello alone is not an answer.
    c.quiet(&[999]);
    c.step(1000, Event::Tick, &["ping 1"]);
    c.step(1001, pong(1), &["watchdog"]);
    c.step(2000, Event::Tick, &["ping 2"]);
    c.step(2001, pong(2), &["watchdog"]);
    // Silent from here: pings go on, the watchdog hears nothing.
    for s in 3..=7 {
        c.step(s * 1000, Event::Tick, &[&format!("ping {s}")]);
    }
    c.step(7001, Event::Tick, &["kill 1 MissedHeartbeats"]);
    // Killed: a late answer is no sign of life.
    c.step(7002, pong(7), &[]);
    c.step(
        7003,
        exited(1, 137),
        &["respawning 1 in 0ms #1 (exited: exit 137)"],
    );
    // Respawns that die before they answer tell it nothing either.
    c.step(7003, Event::Tick, &["spawn"]);
    c.step(7003, spawned(2), &[]);
    c.step(
        7010,
        exited(2, 1),
        &["respawning 2 in 100ms #2 (exited: exit 1)"],
    );
    c.step(7110, Event::Tick, &["spawn"]);
    c.step(7110, spawned(3), &[]);
    c.step(
        7120,
        hello(),
        &["takeover gen=7 respawn=true handed_off=true respawns=2"],
    );
    c.quiet(&[8119]);
    c.step(8120, Event::Tick, &["ping 1"]);
    c.step(8121, pong(1), &["watchdog"]);
    // A drained worker that still answers keeps it told until the supervisor exits.
    c.step(
        8200,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
    c.step(9120, Event::Tick, &["ping 2"]);
    c.step(9121, pong(2), &["watchdog"]);
}

#[test]
fn a_pong_for_a_ping_never_sent_is_a_violation() {
    let mut c = Clock::owner(false);
    c.step(1000, Event::Tick, &["ping 1"]);
    c.step(1001, pong(2), &["kill 1 violation"]);
    let mut c = Clock::standby();
    c.step(1, pong(0), &["kill 1 violation"]);
}

#[test]
fn respawn_backoff_doubles_to_five_seconds_and_resets_after_a_healthy_run() {
    let mut c = Clock::new(None, false);
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, Event::Fetched(None), &[]);
    let mut now = 0;
    let mut pid = 0;
    // A worker that dies at once, before it says anything: e2e/tests/continuity.rs
    // expects these delays in the log.
    for (n, delay) in [0, 100, 200, 400, 800, 1600, 3200, 5000, 5000]
        .into_iter()
        .enumerate()
    {
        pid += 1;
        c.step(now, spawned(pid), &[]);
        let want = format!("respawning {pid} in {delay}ms #{} (exited: exit 1)", n + 1);
        c.step(now + 5, exited(pid, 1), &[&want]);
        now += 5 + delay;
        if delay > 0 {
            c.step(now - 1, Event::Tick, &[]);
        }
        c.step(now, Event::Tick, &["spawn"]);
        // Keep the standby's fetch timer out of the way.
        c.lc.timers.fetch = None;
    }
    // One that ran a minute is not a crash loop.
    pid += 1;
    c.step(now, spawned(pid), &[]);
    now += 60_000;
    c.step(
        now,
        exited(pid, 1),
        &[&format!("respawning {pid} in 0ms #10 (exited: exit 1)")],
    );
    c.step(now, Event::Tick, &["spawn"]);
    pid += 1;
    c.step(now, spawned(pid), &[]);
    c.step(
        now + 1,
        exited(pid, 1),
        &[&format!("respawning {pid} in 100ms #11 (exited: exit 1)")],
    );
    // Nor is one that reached StandbyComplete (or Serving).
    c.step(now + 101, Event::Tick, &["spawn"]);
    pid += 1;
    c.step(now + 101, spawned(pid), &[]);
    c.step(now + 102, hello(), &[]);
    c.step(
        now + 103,
        status(WorkerStatus::StandbyComplete),
        &["StandbyComplete"],
    );
    c.step(
        now + 104,
        exited(pid, 1),
        &[&format!("respawning {pid} in 0ms #12 (exited: exit 1)")],
    );
    // A failed spawn waits the backoff too, and is not counted as a respawn.
    c.step(now + 104, Event::Tick, &["spawn"]);
    c.step(now + 104, Event::SpawnFailed, &[]);
    assert_eq!(c.next_ms(), Some(now + 204));
}

#[test]
fn a_worker_that_closes_its_control_socket_is_killed_respawned_at_once_and_reaped_later() {
    let mut c = Clock::owner(false);
    c.step(
        10,
        Event::ControlClosed,
        &[
            "kill 1 Dying",
            "respawning 1 in 0ms #1 (closed its control socket)",
        ],
    );
    c.step(10, Event::Tick, &["spawn"]);
    c.step(10, spawned(2), &[]);
    // The first worker's SIGCHLD comes after its replacement started.
    c.step(
        30,
        exited(1, 137),
        &["ReplacedReaped { status: \"exit 137\" }"],
    );
    // The replacement gets the node, flagged as a respawn.
    c.step(
        40,
        hello(),
        &["takeover gen=7 respawn=true handed_off=true respawns=1"],
    );
    assert_eq!(c.phase(), "owning");
}

#[test]
fn the_lock_takes_the_node_with_the_held_listeners_and_the_worker_gets_it_at_hello() {
    let mut c = Clock::new(Some("from-systemd"), true);
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, spawned(1), &[]);
    c.step(0, Event::Fetched(Some("held")), &[]);
    c.step(
        50,
        Event::LockAcquired("lock"),
        &["take lock held=held keeper=false"],
    );
    assert_eq!(c.phase(), "taking");
    // The worker has not said Hello: the Takeover waits for it. The conflist check
    // runs at once, after the Takeover would have gone.
    c.step(51, took(3, true), &["store listeners"]);
    assert_eq!(c.next_ms(), Some(51));
    c.step(51, Event::Tick, &["conflist"]);
    c.step(
        60,
        hello(),
        &["takeover gen=3 respawn=false handed_off=true respawns=0"],
    );
    c.step(70, status(WorkerStatus::Reconciling), &[]);
    c.step(
        80,
        status(WorkerStatus::Serving),
        &["Serving { generation: 3 }"],
    );
    // Every 5 s while it owns the node.
    c.step(1060, Event::Tick, &["ping 1"]);
    c.step(1061, pong(1), &["watchdog"]);
    c.step(2060, Event::Tick, &["ping 2"]);
    c.step(2061, pong(2), &["watchdog"]);
    c.step(3060, Event::Tick, &["ping 3"]);
    c.step(3061, pong(3), &["watchdog"]);
    c.step(4060, Event::Tick, &["ping 4"]);
    c.step(4061, pong(4), &["watchdog"]);
    c.step(5051, Event::Tick, &["conflist"]);
    c.step(5060, Event::Tick, &["ping 5"]);
    // A serving worker cannot go back to being a standby.
    c.step(
        5061,
        status(WorkerStatus::StandbyComplete),
        &["kill 1 violation"],
    );
}

#[test]
fn without_held_listeners_the_take_asks_the_socket_keeper() {
    let mut c = Clock::standby();
    c.step(
        10,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(
        11,
        took(1, false),
        &[
            "takeover gen=1 respawn=false handed_off=false respawns=0",
            "store listeners",
        ],
    );
}

#[test]
fn a_lockless_server_blocks_the_take_which_is_retried_every_20_ms_and_reported_once() {
    let mut c = Clock::standby();
    c.step(
        10,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(
        10,
        Event::Blocked {
            lock: "lock",
            path: "/run/xds.sock".into(),
        },
        &["live server /run/xds.sock"],
    );
    assert_eq!(c.phase(), "blocked");
    c.quiet(&[29]);
    c.step(30, Event::Tick, &["take lock held=none keeper=true"]);
    c.step(
        30,
        Event::Blocked {
            lock: "lock",
            path: "/run/xds.sock".into(),
        },
        &[],
    );
    c.step(50, Event::Tick, &["take lock held=none keeper=true"]);
    c.step(
        50,
        took(2, false),
        &[
            "takeover gen=2 respawn=false handed_off=false respawns=0",
            "store listeners",
        ],
    );
    // A failure other than a live server ends the supervisor.
    let mut c = Clock::standby();
    c.step(
        10,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(10, Event::TakeFailed, &[]);
    assert_eq!(c.lc.exit_code(), Some(1));
}

#[test]
fn a_drained_owner_forwards_drain_with_the_successor_flag_and_releases_the_node_on_released() {
    for (offered, keeper, successor) in [
        (Some(100), false, true),
        (Some(100), true, false),
        (None, false, false),
    ] {
        let mut c = Clock::fresh_owner(true);
        c.step(0, Event::Tick, &["conflist"]);
        c.step(
            50,
            status(WorkerStatus::Serving),
            &["Serving { generation: 7 }"],
        );
        if let Some(ms) = offered {
            c.step(ms, Event::Offered { keeper }, &[]);
        }
        let report = format!("DrainRequested {{ owner: true, successor: {successor} }}");
        c.step(
            900,
            Event::DrainRequested,
            &[&report, &format!("drain successor={successor}")],
        );
        assert_eq!(c.phase(), "draining node=true");
        // Heartbeats go on, conflist checks stop, and a second SIGTERM changes nothing.
        c.step(900, Event::DrainRequested, &[]);
        c.step(1000, Event::Tick, &["ping 1"]);
        c.step(1001, pong(1), &["watchdog"]);
        c.step(5000, Event::Tick, &["ping 2"]);
        c.step(5001, pong(2), &["watchdog"]);
        c.step(5020, status(WorkerStatus::Draining), &["WorkerDraining"]);
        c.step(5030, status(WorkerStatus::Released), &["release node"]);
        assert_eq!(c.phase(), "draining node=false");
        // Exit once the released worker closes its socket, not waiting for SIGCHLD.
        c.step(5040, Event::ControlClosed, &["ReleasedClosed"]);
        assert_eq!(c.lc.exit_code(), Some(0));
    }
    // A successor is fresh for 5 s.
    let mut c = Clock::owner(false);
    c.step(100, Event::Offered { keeper: false }, &[]);
    c.step(
        5100,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
}

/// Sockets handed over may be held by a standby of the previous owner as well, which
/// fetched them before this takeover: a drain within 5 s of it counts that standby as a
/// successor, so that the drained owner keeps offering them to whoever wins the lock.
/// Unless the socket keeper holds them: the sockets came from it, or it fetched them
/// since. Whoever wins the lock then takes them from the keeper, and a drain does not
/// wait for a successor that no one saw (a recreate roll soon after the last one).
#[test]
fn an_owner_that_took_handed_off_sockets_has_a_successor_for_5_s_unless_the_keeper_holds_them() {
    let mut c = Clock::owner(false);
    c.step(
        900,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: true }",
            "drain successor=true",
        ],
    );
    let mut c = Clock::owner(false);
    c.step(
        5000,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
    // The keeper fetched them: no successor, but a standby's fetch still makes one.
    let mut c = Clock::owner(false);
    c.step(100, Event::Offered { keeper: true }, &[]);
    c.step(
        900,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
    let mut c = Clock::owner(false);
    c.step(100, Event::Offered { keeper: true }, &[]);
    c.step(200, Event::Offered { keeper: false }, &[]);
    c.step(
        900,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: true }",
            "drain successor=true",
        ],
    );
    // Taken from the keeper.
    let mut c = Clock::standby();
    c.step(
        10,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(
        10,
        took_kept(8),
        &[
            "takeover gen=8 respawn=false handed_off=true respawns=0",
            "store listeners",
        ],
    );
    c.step(
        900,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
}

#[test]
fn the_drain_deadline_kills_the_worker_and_the_supervisor_exits_with_its_status() {
    let mut c = Clock::fresh_owner(false);
    c.step(
        100,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "drain successor=false",
        ],
    );
    // Still answering heartbeats, but not finishing.
    for s in 1..=25 {
        c.step(s * 1000, Event::Tick, &[&format!("ping {s}")]);
        c.step(s * 1000 + 1, pong(s), &["watchdog"]);
    }
    c.quiet(&[25_099]);
    c.step(25_100, Event::Tick, &["kill 1 DrainDeadline"]);
    // A closed socket while draining is not a crash: nothing is respawned.
    c.step(25_101, Event::ControlClosed, &[]);
    assert!(c.lc.control().is_none());
    c.step(
        25_102,
        exited(1, 137),
        &["ExitedAfterDrain { status: \"exit 137\" }"],
    );
    assert_eq!(c.lc.exit_code(), Some(137));
}

#[test]
fn a_drain_before_hello_kills_the_worker_and_one_without_a_worker_exits_at_once() {
    let mut c = Clock::new(None, false);
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, spawned(1), &[]);
    c.step(
        5,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: false, successor: false }",
            "kill 1 NoHello",
        ],
    );
    c.step(
        6,
        exited(1, 137),
        &["ExitedAfterDrain { status: \"exit 137\" }"],
    );
    assert_eq!(c.lc.exit_code(), Some(137));

    // Between a crash and its respawn: nothing to drain; an owner unlocks first.
    let mut c = Clock::fresh_owner(false);
    c.step(
        1,
        exited(1, 1),
        &["respawning 1 in 0ms #1 (exited: exit 1)"],
    );
    c.step(
        1,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: true, successor: false }",
            "release node",
        ],
    );
    assert_eq!(c.lc.exit_code(), Some(0));
}

#[test]
fn a_draining_standby_closes_what_it_held_and_never_takes_the_node() {
    let mut c = Clock::standby();
    c.step(10, Event::Fetched(Some("held")), &[]);
    c.step(
        20,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: false, successor: false }",
            "drain successor=false",
        ],
    );
    assert_eq!(c.phase(), "draining node=false");
    assert!(c.lc.held().is_none() && c.lc.node().is_none());
    c.step(30, Event::LockAcquired("lock"), &["LockIgnored"]);
    c.step(40, status(WorkerStatus::Draining), &["WorkerDraining"]);
    // A standby's worker never had the node: it may not release it.
    c.step(50, status(WorkerStatus::Released), &["kill 1 violation"]);
    c.step(
        60,
        exited(1, 137),
        &["ExitedAfterDrain { status: \"exit 137\" }"],
    );
}

#[test]
fn lock_wake_ups_in_every_phase() {
    // Standby: take the node; Taking, Blocked and Owning cannot see a second one (the
    // lock thread reports once) and drop it; Draining ignores it.
    let mut c = Clock::standby();
    c.step(
        1,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(2, Event::LockAcquired("again"), &["LockIgnored"]);
    assert_eq!(c.phase(), "taking");
    c.step(
        3,
        Event::Blocked {
            lock: "lock",
            path: "/x".into(),
        },
        &["live server /x"],
    );
    c.step(4, Event::LockAcquired("again"), &["LockIgnored"]);
    assert_eq!(c.phase(), "blocked");
    c.step(23, Event::Tick, &["take lock held=none keeper=true"]);
    c.step(
        23,
        took(1, false),
        &[
            "takeover gen=1 respawn=false handed_off=false respawns=0",
            "store listeners",
        ],
    );
    c.step(24, Event::LockAcquired("again"), &["LockIgnored"]);
    assert_eq!(c.phase(), "owning");
    // A failed lock ends a standby, and nothing else.
    c.step(25, Event::LockFailed, &[]);
    assert_eq!(c.phase(), "owning");
    let mut c = Clock::standby();
    c.step(1, Event::LockFailed, &[]);
    assert_eq!(c.lc.exit_code(), Some(1));
    let mut c = Clock::standby();
    c.step(
        1,
        Event::DrainRequested,
        &[
            "DrainRequested { owner: false, successor: false }",
            "drain successor=false",
        ],
    );
    c.step(2, Event::LockFailed, &[]);
    assert_eq!(c.phase(), "draining node=false");
    // A node taken while draining (not possible with a driver that answers at once) is
    // released, not kept.
    let mut c = Clock::standby();
    c.step(
        1,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.lc.phase = Phase::Draining { node: None };
    c.step(2, took(1, false), &["release node"]);
}

#[test]
fn a_broken_control_message_or_a_violation_kills_once_and_nothing_after_counts() {
    let mut c = Clock::standby();
    c.step(
        1,
        Event::ControlBroken("HandoffHello carries 2 descriptors".into()),
        &["kill 1 malformed"],
    );
    c.step(2, Event::ControlBroken("again".into()), &[]);
    c.step(3, status(WorkerStatus::StandbyComplete), &[]);
    c.step(
        4,
        exited(1, 137),
        &["respawning 1 in 0ms #1 (exited: exit 137)"],
    );
    let mut c = Clock::standby();
    c.step(1, hello(), &["kill 1 violation"]);
    // Its socket's end then is a respawn, with no second kill.
    c.step(
        2,
        Event::ControlClosed,
        &["respawning 1 in 0ms #1 (closed its control socket)"],
    );
    // A Takeover that cannot be sent.
    let mut c = Clock::new(None, false);
    c.step(0, Event::Tick, &["spawn", "fetch"]);
    c.step(0, spawned(1), &[]);
    c.step(
        0,
        Event::LockAcquired("lock"),
        &["take lock held=none keeper=true"],
    );
    c.step(0, took(1, false), &["store listeners"]);
    c.step(
        1,
        hello(),
        &["takeover gen=1 respawn=false handed_off=false respawns=0"],
    );
    c.step(
        1,
        Event::TakeoverNotSent("EPIPE".into()),
        &["kill 1 TakeoverNotSent(\"EPIPE\")"],
    );
}

#[test]
fn the_earliest_timer_is_the_next_wake_up() {
    let mut c = Clock::owner(true);
    // conflist at 0, ping at 1000, heartbeat at 5000.
    assert_eq!(c.next_ms(), Some(0));
    c.step(0, Event::Tick, &["conflist"]);
    assert_eq!(c.next_ms(), Some(1000));
    let t = c.lc.timers();
    assert_eq!(
        (t.heartbeat, t.conflist),
        (Some(c.ms(5000)), Some(c.ms(5000)))
    );
    let mut b = respawn_backoff();
    let got: Vec<u128> = (0..9).map(|_| b.next_wait().as_millis()).collect();
    assert_eq!(got, [0, 100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    b.reset();
    assert_eq!(b.next_wait(), Duration::ZERO);
}
