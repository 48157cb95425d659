//! The discovery documents clients read before they call: the server's version, the core
//! group's versions and resources, and the named groups (`authentication.k8s.io` for
//! TokenReview, and the groups of the stored resources). Legacy (unaggregated) discovery
//! only: a client asking for the aggregated form gets plain `application/json` and falls
//! back, as it does with an older server. And a skeleton of OpenAPI v3: what kubectl reads
//! before a create to learn that the server validates fields itself.

use serde_json::{Value, json};

use super::resource::Resource;

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

/// An APIResourceList: the resources of a group at v1 ("" for the core group), or None
/// for a group the server does not serve.
pub fn resources(group: &str) -> Option<Value> {
    let resources: Vec<Value> = if group == AUTHN {
        vec![
            json!({"name": "tokenreviews", "singularName": "tokenreview", "namespaced": false, "kind": "TokenReview", "verbs": ["create"]}),
        ]
    } else {
        Resource::ALL
            .into_iter()
            .filter(|r| r.group() == group)
            .map(api_resource)
            .collect()
    };
    if resources.is_empty() {
        return None;
    }
    Some(match group {
        // The core group's list carries no apiVersion, as the real server's does not.
        "" => json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": resources}),
        _ => {
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{group}/v1"), "resources": resources})
        }
    })
}

fn api_resource(r: Resource) -> Value {
    let mut out = json!({"name": r.plural(), "singularName": r.kind().to_ascii_lowercase(), "namespaced": r.namespaced(),
                         "kind": r.kind(), "verbs": r.verbs()});
    if !r.short_names().is_empty() {
        out["shortNames"] = json!(r.short_names());
    }
    if !r.categories().is_empty() {
        out["categories"] = json!(r.categories());
    }
    out
}

const AUTHN: &str = "authentication.k8s.io";

/// The named groups: TokenReview's, then those of the stored resources, each at v1 only.
fn group_names() -> Vec<&'static str> {
    let mut names = vec![AUTHN];
    for r in Resource::ALL {
        if !r.group().is_empty() && !names.contains(&r.group()) {
            names.push(r.group());
        }
    }
    names
}

fn api_group(name: &str) -> Value {
    let v1 = json!({"groupVersion": format!("{name}/v1"), "version": "v1"});
    json!({"name": name, "versions": [v1], "preferredVersion": v1})
}

pub fn groups() -> Value {
    let groups: Vec<Value> = group_names().into_iter().map(api_group).collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// The APIGroup document of a named group, or None for a group the server does not serve.
pub fn group(name: &str) -> Option<Value> {
    group_names().contains(&name).then(|| {
        let mut g = api_group(name);
        g["kind"] = json!("APIGroup");
        g["apiVersion"] = json!("v1");
        g
    })
}

/// The OpenAPI v3 index (`/openapi/v3`): a document per group version of the stored
/// resources.
pub fn openapi_index() -> Value {
    let mut paths = serde_json::Map::new();
    for group in openapi_groups() {
        let path = if group.is_empty() {
            "api/v1".to_owned()
        } else {
            format!("apis/{group}/v1")
        };
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash=0")}),
        );
    }
    json!({"paths": paths})
}

/// The OpenAPI v3 document of a group at v1, reduced to what kubectl reads before a
/// create or an apply: each resource's PATCH operation, with its group-version-kind and
/// the `fieldValidation` query parameter. That parameter tells kubectl the server
/// validates fields, so it sends `fieldValidation=Strict` instead of validating against
/// schemas, which this document does not have. None for a group without resources.
pub fn openapi(group: &str) -> Option<Value> {
    let mut paths = serde_json::Map::new();
    for r in Resource::ALL.into_iter().filter(|r| r.group() == group) {
        let root = if group.is_empty() {
            "/api/v1".to_owned()
        } else {
            format!("/apis/{group}/v1")
        };
        let scope = if r.namespaced() {
            "/namespaces/{namespace}"
        } else {
            ""
        };
        let gvk = json!({"group": group, "version": "v1", "kind": r.kind()});
        let patch = json!({"x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": "patch",
                           "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": true}}]});
        paths.insert(
            format!("{root}{scope}/{}/{{name}}", r.plural()),
            json!({"patch": patch}),
        );
    }
    (!paths.is_empty()).then(|| json!({"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": format!("v1.{MINOR}.0")}, "paths": paths}))
}

fn openapi_groups() -> Vec<&'static str> {
    let mut groups = vec![""];
    groups.extend(group_names().into_iter().filter(|g| *g != AUTHN));
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_resource_is_discoverable_in_its_group() {
        let listed: Vec<String> = groups()["groups"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| g["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(listed, [AUTHN, "discovery.k8s.io", "coordination.k8s.io"]);
        for r in Resource::ALL {
            let list = resources(r.group()).unwrap();
            let entry = list["resources"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == r.plural())
                .unwrap_or_else(|| panic!("{r:?} in {list}"));
            assert_eq!(
                (entry["kind"].as_str(), entry["namespaced"].as_bool()),
                (Some(r.kind()), Some(r.namespaced()))
            );
            let expected_group_version = if r.group().is_empty() {
                "v1".to_owned()
            } else {
                format!("{}/v1", r.group())
            };
            assert_eq!(list["groupVersion"], expected_group_version);
        }
        assert_eq!(resources("").unwrap().get("apiVersion"), None);
        assert_eq!(
            group("coordination.k8s.io").unwrap()["preferredVersion"]["groupVersion"],
            "coordination.k8s.io/v1"
        );
        assert!(group("apps").is_none() && resources("apps").is_none());
    }

    #[test]
    fn openapi_lists_a_patch_with_field_validation_per_resource() {
        let index = openapi_index();
        let listed: Vec<&String> = index["paths"].as_object().unwrap().keys().collect();
        assert_eq!(
            listed,
            [
                "api/v1",
                "apis/coordination.k8s.io/v1",
                "apis/discovery.k8s.io/v1"
            ]
        );
        assert_eq!(
            index["paths"]["apis/coordination.k8s.io/v1"]["serverRelativeURL"],
            "/openapi/v3/apis/coordination.k8s.io/v1?hash=0"
        );
        let leases = openapi("coordination.k8s.io").unwrap();
        let patch = &leases["paths"]["/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"]
            ["patch"];
        assert_eq!(
            patch["x-kubernetes-group-version-kind"],
            json!({"group": "coordination.k8s.io", "version": "v1", "kind": "Lease"})
        );
        assert_eq!(patch["parameters"][0]["name"], "fieldValidation");
        assert!(
            openapi("").unwrap()["paths"]
                .get("/api/v1/nodes/{name}")
                .is_some()
        );
        assert!(openapi(AUTHN).is_none());
    }
}
