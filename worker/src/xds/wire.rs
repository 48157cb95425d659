//! ADS requests as decoded off the wire: every field the agent reads, with the node
//! trimmed to its id and cluster.
//!
//! Envoy sends its whole node description on the first request of every stream, and
//! Envoy 1.40's is about 60 KB, nearly all of it the `extensions` list. Decoded with the
//! generated `DiscoveryRequest` that is thousands of strings to build on the path of a
//! reconnect. The agent reads only the node's id, so these types give the node its id
//! and cluster only, and prost skips the rest by length. Each request is then turned into
//! the generated type, with that trimmed node.

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::rpc::Status as RpcStatus;

/// ADS requests are small, but the first carries the node; a full snapshot of 1,000
/// endpoints is well under this too.
pub const MAX_REQUEST: usize = 16 << 20;

/// The node as the agent reads it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeId {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(string, tag = "2")]
    pub cluster: String,
}

impl NodeId {
    fn into_node(self) -> Node {
        Node {
            id: self.id,
            cluster: self.cluster,
            ..Node::default()
        }
    }
}

/// `envoy.service.discovery.v3.DiscoveryRequest` with the node trimmed to [`NodeId`];
/// `resource_locators` (xdstp, tag 7) is not served and is skipped.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SotwRequestWire {
    #[prost(string, tag = "1")]
    pub version_info: String,
    #[prost(message, optional, tag = "2")]
    pub node: Option<NodeId>,
    #[prost(string, repeated, tag = "3")]
    pub resource_names: Vec<String>,
    #[prost(string, tag = "4")]
    pub type_url: String,
    #[prost(string, tag = "5")]
    pub response_nonce: String,
    #[prost(message, optional, tag = "6")]
    pub error_detail: Option<RpcStatus>,
}

impl From<SotwRequestWire> for DiscoveryRequest {
    fn from(w: SotwRequestWire) -> Self {
        DiscoveryRequest {
            version_info: w.version_info,
            node: w.node.map(NodeId::into_node),
            resource_names: w.resource_names,
            type_url: w.type_url,
            response_nonce: w.response_nonce,
            error_detail: w.error_detail,
            ..DiscoveryRequest::default()
        }
    }
}

/// `envoy.service.discovery.v3.DeltaDiscoveryRequest` with the node trimmed to
/// [`NodeId`]; the xdstp locators (tags 8 and 9) are skipped.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DeltaRequestWire {
    #[prost(message, optional, tag = "1")]
    pub node: Option<NodeId>,
    #[prost(string, tag = "2")]
    pub type_url: String,
    #[prost(string, repeated, tag = "3")]
    pub resource_names_subscribe: Vec<String>,
    #[prost(string, repeated, tag = "4")]
    pub resource_names_unsubscribe: Vec<String>,
    #[prost(map = "string, string", tag = "5")]
    pub initial_resource_versions: std::collections::HashMap<String, String>,
    #[prost(string, tag = "6")]
    pub response_nonce: String,
    #[prost(message, optional, tag = "7")]
    pub error_detail: Option<RpcStatus>,
}

impl From<DeltaRequestWire> for DeltaDiscoveryRequest {
    fn from(w: DeltaRequestWire) -> Self {
        DeltaDiscoveryRequest {
            node: w.node.map(NodeId::into_node),
            type_url: w.type_url,
            resource_names_subscribe: w.resource_names_subscribe,
            resource_names_unsubscribe: w.resource_names_unsubscribe,
            initial_resource_versions: w.initial_resource_versions,
            response_nonce: w.response_nonce,
            error_detail: w.error_detail,
            ..DeltaDiscoveryRequest::default()
        }
    }
}

#[cfg(test)]
mod tests;
