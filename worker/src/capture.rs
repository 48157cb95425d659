//! The capture projection: which ports and CIDRs the node proxy captures.
//!
//! INTERFACE STUB (owned by the xDS work).

use std::net::SocketAddr;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureProjection {
    /// Where the proxy's outbound listener binds.
    pub outbound: SocketAddr,
    /// The port of the proxy's inbound listener.
    pub inbound_port: u16,
    pub excluded_cidrs: Vec<String>,
}

impl Default for CaptureProjection {
    fn default() -> Self {
        Self { outbound: "127.0.0.1:15001".parse().expect("literal address"), inbound_port: 15006, excluded_cidrs: Vec::new() }
    }
}
