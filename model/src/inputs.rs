//! Everything a snapshot is built from, and the gates the first serve waits for.

use std::collections::BTreeMap;

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
}
