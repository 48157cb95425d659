//! The xDS vocabulary shared by both protocols: each resource kind's type URL, and a
//! resource's version on the wire.

pub use aether_model::{KIND_COUNT, KINDS, Kind};

pub fn type_url(k: Kind) -> &'static str {
    match k {
        Kind::Cluster => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        Kind::Endpoint => "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        Kind::Listener => "type.googleapis.com/envoy.config.listener.v3.Listener",
        Kind::Route => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
        Kind::Secret => "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
    }
}

pub fn from_type_url(url: &str) -> Option<Kind> {
    KINDS.into_iter().find(|k| type_url(*k) == url)
}

/// LDS and CDS are wildcard subscriptions; EDS, RDS and SDS are requested by name.
pub fn wildcard(k: Kind) -> bool {
    matches!(k, Kind::Cluster | Kind::Listener)
}

/// A resource's version on the wire (delta xDS): its content hash in hex.
pub fn wire_version(hash: u64) -> String {
    format!("{hash:016x}")
}
