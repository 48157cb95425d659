//! One change to the snapshot inputs: what every source sends the node.

use crate::{CaptureProjection, Pod, Service, ServiceKey};

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
}
