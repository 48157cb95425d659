//! The capture projection: which ports and CIDRs the node proxy captures.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureProjection {
    /// Where the proxy's outbound listener binds.
    pub outbound: SocketAddr,
    /// The port of the proxy's inbound listener.
    pub inbound_port: u16,
    /// For the traffic redirection that the CNI side installs; the snapshot ignores it.
    pub excluded_cidrs: Vec<String>,
}

impl Default for CaptureProjection {
    fn default() -> Self {
        Self {
            outbound: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 15001),
            inbound_port: 15006,
            excluded_cidrs: Vec::new(),
        }
    }
}
