//! A pod on this node.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

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
    /// The pod has a deletion timestamp in the Kubernetes API (the owner's pod watch
    /// rewrote its record): its inbound endpoints are served DRAINING. Records written
    /// before this field existed read as false, and a false one is not written, so such
    /// records stay byte for byte what they were.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub terminating: bool,
    /// The pod opted out of a QUIC twin (`AETHER_QUIC_TWIN=off` in its CNI arguments): its
    /// inbound target does not speak HTTP, so an HTTP/3 twin could not serve it. Left out
    /// of the record when false, like `terminating`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_quic_twin: bool,
}
