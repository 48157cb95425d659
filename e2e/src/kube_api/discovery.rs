//! The discovery documents clients read before they call: the server's version, the core
//! group's versions and resources, and the named groups (only `authentication.k8s.io`,
//! for TokenReview). Legacy (unaggregated) discovery only: a client asking for the
//! aggregated form gets plain `application/json` and falls back, as it does with an older
//! server.

use serde_json::{Value, json};

/// The Kubernetes version the server claims: the minor of the kubectl that
/// scripts/install-tools.sh installs, so that kubectl prints no skew warning.
pub const MINOR: &str = "34";

pub fn version() -> Value {
    json!({"major": "1", "minor": MINOR, "gitVersion": format!("v1.{MINOR}.0"), "gitCommit": "0000000000000000000000000000000000000000",
           "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0", "compiler": "gc",
           "platform": "linux/amd64"})
}

pub fn core_versions(server_address: &str) -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"],
           "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]})
}

pub fn core_resources() -> Value {
    let verbs = ["get", "list", "watch", "patch"];
    json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        {"name": "nodes", "singularName": "node", "namespaced": false, "kind": "Node", "verbs": verbs, "shortNames": ["no"]},
        {"name": "pods", "singularName": "pod", "namespaced": true, "kind": "Pod", "verbs": verbs, "shortNames": ["po"], "categories": ["all"]},
    ]})
}

const AUTHN: &str = "authentication.k8s.io";

fn authn_group() -> Value {
    let v1 = json!({"groupVersion": format!("{AUTHN}/v1"), "version": "v1"});
    json!({"name": AUTHN, "versions": [v1], "preferredVersion": v1})
}

pub fn groups() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [authn_group()]})
}

pub fn authn() -> Value {
    let mut g = authn_group();
    g["kind"] = json!("APIGroup");
    g["apiVersion"] = json!("v1");
    g
}

pub fn authn_resources() -> Value {
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{AUTHN}/v1"), "resources": [
        {"name": "tokenreviews", "singularName": "tokenreview", "namespaced": false, "kind": "TokenReview", "verbs": ["create"]},
    ]})
}
