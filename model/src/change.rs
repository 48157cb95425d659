//! One change to the snapshot inputs: what every source sends the node.

use crate::{CaptureProjection, Pod, Service, ServiceKey, Svid};

#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A local pod added or rewritten (keyed by its uid).
    UpsertPod(Pod),
    /// A local pod gone, by uid; a uid the inputs do not hold is no change.
    RemovePod(String),
    /// A mesh service added or replaced, endpoints included (keyed by namespace and name).
    UpsertService(Service),
    /// A mesh service gone; a key the inputs do not hold is no change.
    RemoveService(ServiceKey),
    SetCapture(CaptureProjection),
    /// The trust domain's CA certificates (PEM); `None` while the Workload API has not
    /// answered.
    SetBundle(Option<String>),
    /// The agent's own SVID (rotations included).
    SetAgentSvid(Option<Svid>),
    /// A local pod's SVID by pod uid (rotations included); `None` drops it.
    SetPodSvid {
        uid: String,
        svid: Option<Svid>,
    },
}
