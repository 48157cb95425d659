//! The ADS gRPC service, routed by hand so that requests decode into lean wire types.
//!
//! Envoy sends its whole node description on the first request of every stream, and
//! Envoy 1.40's is about 60 KB, nearly all of it the `extensions` list. Decoded with the
//! generated `DiscoveryRequest` that is thousands of strings to build on the path of a
//! reconnect (0.65 to 0.74 ms of the new owner's first answer, measured in the worker
//! during surge rolls). The agent reads only the node's id, so the wire types below
//! keep every request field but give the node its id and cluster only; prost skips the
//! rest by length. Each request is then turned into the generated type, with that
//! trimmed node, and the protocol code works on the generated types as before.
//!
//! The routing is what tonic generates for the service (`envoy-types`'
//! `AggregatedDiscoveryServiceServer`), with the request codec swapped.

use std::convert::Infallible;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tonic::codegen::{Body, BoxFuture, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use super::{Ads, Protocol, ResponseStream, delta::DeltaState, stream::StreamState};

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
        Node { id: self.id, cluster: self.cluster, ..Node::default() }
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

/// The ADS service for tonic's router.
#[derive(Clone)]
pub(super) struct AdsServer(pub(super) Arc<Ads>);

impl NamedService for AdsServer {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

/// One streaming method of the service, for either protocol.
struct Method<P>(Arc<Ads>, PhantomData<fn() -> P>);

impl<P: Protocol> StreamingService<P::Wire> for Method<P> {
    type Response = P::Response;
    type ResponseStream = ResponseStream<P::Response>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<P::Wire>>) -> Self::Future {
        let ads = self.0.clone();
        Box::pin(async move { Ok(Response::new(ads.open::<P>(request.into_inner()))) })
    }
}

/// Serves one call of `P`'s method: requests decode into `P::Wire`.
fn streaming<P: Protocol, B>(ads: Arc<Ads>, req: http::Request<B>) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    Box::pin(async move {
        let mut grpc =
            Grpc::new(ProstCodec::<P::Response, P::Wire>::default()).apply_max_message_size_config(Some(MAX_REQUEST), None);
        Ok(grpc.streaming(Method::<P>(ads, PhantomData), req).await)
    })
}

impl<B> tonic::codegen::Service<http::Request<B>> for AdsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let ads = self.0.clone();
        match req.uri().path() {
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources" => streaming::<StreamState, B>(ads, req),
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources" => streaming::<DeltaState, B>(ads, req),
            _ => Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(Status::GRPC_STATUS, (tonic::Code::Unimplemented as i32).into());
                headers.insert(http::header::CONTENT_TYPE, tonic::metadata::GRPC_CONTENT_TYPE);
                Ok(response)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::{Extension, Locality};
    use prost::Message;

    use super::*;

    fn node() -> Node {
        Node {
            id: "node-1".into(),
            cluster: "aether".into(),
            locality: Some(Locality { zone: "z".into(), ..Locality::default() }),
            extensions: (0..50)
                .map(|i| Extension { name: format!("envoy.ext.{i}"), category: "c".into(), ..Extension::default() })
                .collect(),
            ..Node::default()
        }
    }

    #[test]
    fn a_sotw_request_keeps_every_field_the_agent_reads_and_the_node_id_only() {
        let full = DiscoveryRequest {
            version_info: "v1".into(),
            node: Some(node()),
            resource_names: vec!["a".into(), "b".into()],
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            response_nonce: "7".into(),
            error_detail: Some(RpcStatus { code: 3, message: "bad".into(), details: vec![] }),
            ..DiscoveryRequest::default()
        };
        let lean: DiscoveryRequest = SotwRequestWire::decode(full.encode_to_vec().as_slice()).unwrap().into();
        let want = DiscoveryRequest {
            node: Some(Node { id: "node-1".into(), cluster: "aether".into(), ..Node::default() }),
            ..full
        };
        assert_eq!(lean, want);
    }

    #[test]
    fn a_delta_request_keeps_every_field_the_agent_reads_and_the_node_id_only() {
        let full = DeltaDiscoveryRequest {
            node: Some(node()),
            type_url: "type.googleapis.com/envoy.config.listener.v3.Listener".into(),
            resource_names_subscribe: vec!["x".into()],
            resource_names_unsubscribe: vec!["y".into()],
            initial_resource_versions: [("x".to_string(), "00ff".to_string())].into(),
            response_nonce: "3".into(),
            error_detail: Some(RpcStatus { code: 3, message: "bad".into(), details: vec![] }),
            ..DeltaDiscoveryRequest::default()
        };
        let lean: DeltaDiscoveryRequest = DeltaRequestWire::decode(full.encode_to_vec().as_slice()).unwrap().into();
        let want = DeltaDiscoveryRequest {
            node: Some(Node { id: "node-1".into(), cluster: "aether".into(), ..Node::default() }),
            ..full
        };
        assert_eq!(lean, want);
    }
}
