//! The change-to-ACK loop of the discovery benches (`cross_node`, `discovery_ack`): after
//! each change, the agent's log gives when its stream held the change, pushed it and got
//! Envoy's ACK ([`Exchange`]); [`check_applied`] then checks, outside the timing, that
//! Envoy holds what the change made and the agent's view is at the change's revision, and
//! [`Splits`] keeps the figures.

use std::time::{Duration, SystemTime};

use crate::envoy::NodeRig;
use crate::envoy::ack_log::{self, Exchange, Shown, since};

/// One node's change-to-ACK figures, split where the agent's log splits them.
#[derive(Debug, Default)]
pub struct Splits {
    /// The change made to the agent's stream holding it.
    pub to_snapshot: Vec<Duration>,
    /// The stream holding it to the push (the agent).
    pub to_push: Vec<Duration>,
    /// The push to Envoy's ACK.
    pub to_ack: Vec<Duration>,
    /// The change made to Envoy's ACK.
    pub total: Vec<Duration>,
}

impl Splits {
    /// Records `ex`, of a change made at `wall0`.
    pub fn push(&mut self, wall0: SystemTime, ex: &Exchange) {
        self.to_snapshot.push(since(wall0, ex.snapshot));
        self.to_push.push(since(ex.snapshot, ex.pushed));
        self.to_ack.push(since(ex.pushed, ex.acked));
        self.total.push(since(wall0, ex.acked));
    }
}

/// Outside the timing: `rig`'s Envoy holds `want` (sorted) for `cluster` within a second,
/// and its agent's `/ready` shows `revision` or later; panics naming `what` (the change and
/// the node) otherwise. True when Envoy's config dump showed it only after the ACK.
pub fn check_applied(
    rig: &NodeRig,
    what: &str,
    cluster: &str,
    want: &[String],
    revision: i64,
) -> bool {
    let late = match ack_log::wait_endpoints(&rig.envoy, cluster, want) {
        Ok(Shown::AtAck) => false,
        Ok(Shown::Later) => true,
        Err(got) => panic!(
            "{what} to {cluster} ACKed but not in Envoy: it holds {got:?}, want {want:?}\n{}",
            rig.where_to_look()
        ),
    };
    let view = rig
        .owner
        .ready()
        .and_then(|(_, v)| v["registrar"]["revision"].as_i64());
    assert!(
        view.is_some_and(|r| r >= revision),
        "{what}: the agent's /ready shows revision {view:?}, not {revision}"
    );
    late
}
