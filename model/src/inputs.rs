//! Everything a snapshot is built from, and the gates the first serve waits for.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::{CaptureProjection, Identity, Pod, RegistryView};

/// Everything a snapshot is built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inputs {
    /// Local pods keyed by pod uid.
    pub pods: BTreeMap<String, Pod>,
    pub registry: RegistryView,
    pub capture: CaptureProjection,
    /// The proxy fetches outbound clusters on demand (`--on-demand-clusters`): the
    /// outbound listener carries Envoy's on-demand filter. Fixed for a worker's life.
    pub on_demand_clusters: bool,
    /// The file in the proxy's filesystem where each pod's inbound listener logs its
    /// connections (`--inbound-access-log`); None: no access log. Fixed for a worker's life.
    pub inbound_access_log: Option<String>,
    /// SVIDs, the trust bundle and the mTLS mode (the trust domain and the mode are fixed
    /// for a worker's life).
    pub identity: Identity,
    /// The node's QUIC twins (`--quic-twin-addr`); `None`: no twin. Fixed for a worker's
    /// life.
    pub quic_twins: Option<QuicTwins>,
}

/// Where the node's QUIC twins listen and how many there may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuicTwins {
    /// The one UDP address of every twin; the pod's chain is chosen by SNI
    /// ([`crate::twin_sni`]).
    pub address: SocketAddr,
    /// At most this many twins; the eligible pods past it (in uid order) get none, and
    /// the snapshot lists them in [`crate::Snapshot::twins_refused`].
    pub max: usize,
}

/// What the first serve and standby completeness wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gates {
    /// The registry view has loaded at least once (an absent registry file counts).
    pub registry_loaded: bool,
    /// The capture projection has landed (the embedded default counts).
    pub capture_landed: bool,
    /// Pods have been loaded from storage: the view the takeover diff is against.
    pub storage_loaded: bool,
    /// The agent holds its own SVID, or runs without identity.
    pub agent_svid: bool,
    /// Every local pod holds its own SVID, or pods get none (no broker). The lenient
    /// client-certificate gate waits for it, bounded (`--pod-certificate-gate`).
    pub pod_certificates: bool,
    /// The worker has made the resume digests and encodings of a snapshot of the loaded
    /// inputs: a standby's readiness waits for it, an owner's first serve does not.
    pub encodings_warm: bool,
}
