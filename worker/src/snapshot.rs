//! The snapshot model: a pure function from inputs to the resources the proxy is served.
//!
//! No protobuf types here; the xDS adapter converts at the boundary. Versions are content
//! hashes per resource type, so the same inputs always give the same versions and a
//! reconnect to an identical snapshot is a no-op for Envoy.
//!
//! INTERFACE STUB (owned by the xDS work): keep `Inputs`, `Pod`, `Snapshot::holds_pod`
//! and `build` with these signatures; everything else may change.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::capture::CaptureProjection;
use crate::registry::RegistryView;

/// A pod on this node, as the CNI plugin reported it and storage keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub ips: Vec<IpAddr>,
}

/// Everything a snapshot is built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inputs {
    /// Local pods keyed by pod uid.
    pub pods: BTreeMap<String, Pod>,
    pub registry: RegistryView,
    pub capture: CaptureProjection,
}

/// The resources served to the proxy, with one content-hash version per type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub pods: BTreeMap<String, Pod>,
}

impl Snapshot {
    /// Whether this snapshot serves the pod (its inbound filter chain and cluster).
    pub fn holds_pod(&self, uid: &str, ips: &[IpAddr]) -> bool {
        self.pods.get(uid).is_some_and(|p| p.ips == ips)
    }
}

/// Builds the snapshot. Pure: no I/O, no clock, no randomness.
pub fn build(inputs: &Inputs) -> Snapshot {
    Snapshot { pods: inputs.pods.clone() }
}
