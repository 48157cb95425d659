//! The Aether node agent's model: the plain data a snapshot is built from, and the pure
//! builder that turns it into the resources the proxy is served.
//!
//! Sources (the registry file, a registrar client, the capture projection, pod storage,
//! CNI calls) convert into these types; the worker's `node` owns one [`Builder`] and
//! feeds it [`Change`]s; the xDS adapter converts the [`Snapshot`]'s resources into
//! protobuf. This crate knows no runtime, no protobuf and no files, and its own test
//! (`tests/structure.rs`) keeps it that way as a Cargo rule.
#![forbid(unsafe_code)]

mod builder;
mod capture;
mod change;
pub mod check;
pub mod hash;
mod identity;
mod inputs;
mod pod;
mod registry;
pub mod registry_file;
mod snapshot;

pub use builder::{Builder, build};
pub use capture::CaptureProjection;
pub use change::Change;
pub use identity::{
    BUNDLE_SECRET, INBOUND_SECRET_PREFIX, Identity, InboundTls, MtlsMode, NO_SVID_SECRET_PREFIX,
    NamedSecret, POD_SECRET_PREFIX, Secret, Svid, UpstreamTls, inbound_secret_name,
    pod_secret_name,
};
pub use inputs::{Gates, Inputs, QuicTwins};
pub use pod::Pod;
pub use registry::{Endpoint, EndpointState, RegistryView, Service, ServiceKey};
pub use snapshot::{
    Changed, Cluster, ClusterKind, INBOUND, INBOUND_BLACKHOLE, INBOUND_TARGET_PORT, InboundChain,
    KIND_COUNT, KINDS, Kind, LbEndpoint, Listener, ListenerKind, LoadAssignment, OUTBOUND,
    QUIC_TWINS, Resources, Route, RouteConfig, Snapshot, TWIN_SNI_SUFFIX, Twin, VirtualHost,
    inbound_cluster_name, inbound_listener_name, is_outbound_cluster, outbound_cluster_name,
    twin_sni,
};
