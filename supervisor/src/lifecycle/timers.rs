//! The lifecycle's clock: every deadline the supervisor waits for, in one place, and the
//! respawn backoff.

use std::time::{Duration, Instant};

use shared_proto::backoff::Backoff;

/// Each deadline, armed only in the phase named beside it (the lifecycle tests check
/// that after every step). The poll loop sleeps until the earliest one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Timers {
    /// Start a worker: none runs, and the supervisor is not draining.
    pub respawn: Option<Instant>,
    /// Send the next Ping: the worker has said Hello.
    pub ping: Option<Instant>,
    /// Kill the worker unless a Pong comes first: the worker has said Hello.
    pub heartbeat: Option<Instant>,
    /// Fetch the owner's listeners over `handoff.sock`: standby.
    pub fetch: Option<Instant>,
    /// Try to bind the node sockets again: the lock is ours, a lock-less server answers.
    pub retry: Option<Instant>,
    /// Check the node's CNI conflist: owner, with `--cni-conf-dir`.
    pub conflist: Option<Instant>,
    /// Kill a worker that has not finished its drain: draining.
    pub drain: Option<Instant>,
}

impl Timers {
    /// The earliest armed deadline.
    pub fn next(&self) -> Option<Instant> {
        [
            self.respawn,
            self.ping,
            self.heartbeat,
            self.fetch,
            self.retry,
            self.conflist,
            self.drain,
        ]
        .into_iter()
        .flatten()
        .min()
    }
}

/// Disarms `timer` and says so when it is due at `now`.
pub fn fire(timer: &mut Option<Instant>, now: Instant) -> bool {
    let due = timer.is_some_and(|t| t <= now);
    if due {
        *timer = None;
    }
    due
}

/// Respawn delays: at once after a healthy run (the node's sockets keep queueing the
/// proxy's reconnect meanwhile), then 0.1 s, 0.2 s, 0.4 s … up to 5 s while a worker keeps
/// dying before it gets anywhere.
pub fn respawn_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).at_once_first()
}
