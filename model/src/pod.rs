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
}
