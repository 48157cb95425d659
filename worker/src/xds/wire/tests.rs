use envoy_types::pb::envoy::config::core::v3::{Extension, Locality};
use prost::Message;

use super::*;

fn node() -> Node {
    Node {
        id: "node-1".into(),
        cluster: "aether".into(),
        locality: Some(Locality {
            zone: "z".into(),
            ..Locality::default()
        }),
        extensions: (0..50)
            .map(|i| Extension {
                name: format!("envoy.ext.{i}"),
                category: "c".into(),
                ..Extension::default()
            })
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
        error_detail: Some(RpcStatus {
            code: 3,
            message: "bad".into(),
            details: vec![],
        }),
        ..DiscoveryRequest::default()
    };
    let lean: DiscoveryRequest = SotwRequestWire::decode(full.encode_to_vec().as_slice())
        .unwrap()
        .into();
    let want = DiscoveryRequest {
        node: Some(Node {
            id: "node-1".into(),
            cluster: "aether".into(),
            ..Node::default()
        }),
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
        error_detail: Some(RpcStatus {
            code: 3,
            message: "bad".into(),
            details: vec![],
        }),
        ..DeltaDiscoveryRequest::default()
    };
    let lean: DeltaDiscoveryRequest = DeltaRequestWire::decode(full.encode_to_vec().as_slice())
        .unwrap()
        .into();
    let want = DeltaDiscoveryRequest {
        node: Some(Node {
            id: "node-1".into(),
            cluster: "aether".into(),
            ..Node::default()
        }),
        ..full
    };
    assert_eq!(lean, want);
}
