//! The CNI API stays compatible across one version: a request written by the previous
//! message layout (v0, before `prev_result`) and one written by a newer layout (with a
//! field this version does not know) both decode with the current message.
//!
//! The fixtures under `tests/fixtures/` are committed bytes, so a change to the current
//! message that breaks them shows here. `AETHER_REGENERATE_FIXTURES=1` rewrites them from
//! the hand-written layouts below; do that only when adding a new historical layout.
#![cfg(feature = "cni-api")]

use prost::Message;
use shared_proto::cni::CniRequest;

/// The v0 layout of `CniRequest`, kept by hand as the plugin of the previous version
/// encodes it.
#[derive(Clone, PartialEq, prost::Message)]
struct CniRequestV0 {
    #[prost(string, tag = "1")]
    container_id: String,
    #[prost(string, tag = "2")]
    netns: String,
    #[prost(string, tag = "3")]
    ifname: String,
    #[prost(string, tag = "4")]
    pod_namespace: String,
    #[prost(string, tag = "5")]
    pod_name: String,
    #[prost(string, tag = "6")]
    pod_uid: String,
    #[prost(string, repeated, tag = "7")]
    ips: Vec<String>,
    #[prost(string, tag = "8")]
    cni_args: String,
}

/// A layout one version ahead: the current fields plus ones this version does not know.
#[derive(Clone, PartialEq, prost::Message)]
struct CniRequestNext {
    #[prost(string, tag = "1")]
    container_id: String,
    #[prost(string, tag = "6")]
    pod_uid: String,
    #[prost(string, repeated, tag = "7")]
    ips: Vec<String>,
    #[prost(bytes = "vec", tag = "9")]
    prev_result: Vec<u8>,
    #[prost(string, tag = "10")]
    future_string: String,
    #[prost(uint64, tag = "11")]
    future_varint: u64,
    #[prost(message, optional, tag = "12")]
    future_message: Option<CniRequestV0>,
}

fn v0() -> CniRequestV0 {
    CniRequestV0 {
        container_id: "0123456789abcdef".into(),
        netns: "/var/run/netns/cni-1234".into(),
        ifname: "eth0".into(),
        pod_namespace: "default".into(),
        pod_name: "web-0".into(),
        pod_uid: "6f1c2d3e-0000-4000-8000-000000000001".into(),
        ips: vec!["10.1.0.5".into(), "fd00::5".into()],
        cni_args: "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=6f1c2d3e-0000-4000-8000-000000000001"
            .into(),
    }
}

fn next() -> CniRequestNext {
    CniRequestNext {
        container_id: "0123456789abcdef".into(),
        pod_uid: "uid-next".into(),
        ips: vec!["10.1.0.6".into()],
        prev_result: br#"{"cniVersion":"1.0.0"}"#.to_vec(),
        future_string: "unknown to this version".into(),
        future_varint: 42,
        future_message: Some(v0()),
    }
}

fn fixture(name: &str, current: Vec<u8>) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    if std::env::var_os("AETHER_REGENERATE_FIXTURES").is_some() {
        std::fs::write(&path, &current).unwrap();
    }
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("reading fixture {}: {e}", path.display()));
    assert_eq!(
        bytes,
        current,
        "fixture {} no longer matches its hand-written layout",
        path.display()
    );
    bytes
}

#[test]
fn previous_layout_decodes_with_current_message() {
    let bytes = fixture("cni_request_v0.bin", v0().encode_to_vec());
    let req = CniRequest::decode(bytes.as_slice()).expect("v0 bytes decode");
    let old = v0();
    assert_eq!(req.container_id, old.container_id);
    assert_eq!(req.netns, old.netns);
    assert_eq!(req.ifname, old.ifname);
    assert_eq!(req.pod_namespace, old.pod_namespace);
    assert_eq!(req.pod_name, old.pod_name);
    assert_eq!(req.pod_uid, old.pod_uid);
    assert_eq!(req.ips, old.ips);
    assert_eq!(req.cni_args, old.cni_args);
    assert!(
        req.prev_result.is_empty(),
        "a v0 plugin sends no prev_result"
    );
}

#[test]
fn newer_layout_decodes_with_unknown_fields_ignored() {
    let bytes = fixture("cni_request_next.bin", next().encode_to_vec());
    let req = CniRequest::decode(bytes.as_slice()).expect("newer bytes decode");
    assert_eq!(req.container_id, "0123456789abcdef");
    assert_eq!(req.pod_uid, "uid-next");
    assert_eq!(req.ips, vec!["10.1.0.6".to_string()]);
    assert_eq!(req.prev_result, br#"{"cniVersion":"1.0.0"}"#);
    assert_eq!(req.netns, "");
}

#[test]
fn current_message_decodes_as_previous_layout() {
    // The other direction of the skew: an old agent receiving a current request.
    let current = CniRequest {
        container_id: "c1".into(),
        pod_uid: "u1".into(),
        ips: vec!["10.0.0.1".into()],
        prev_result: b"{}".to_vec(),
        ..Default::default()
    };
    let old = CniRequestV0::decode(current.encode_to_vec().as_slice()).expect("decodes as v0");
    assert_eq!(
        (old.container_id.as_str(), old.pod_uid.as_str()),
        ("c1", "u1")
    );
    assert_eq!(old.ips, vec!["10.0.0.1".to_string()]);
}
