//! The model is pure as a Cargo rule: nothing it depends on, directly or not, is a
//! runtime, a gRPC stack or protobuf. Read from `cargo metadata`'s resolved graph.

use std::collections::{BTreeMap, BTreeSet};

const FORBIDDEN: [&str; 6] = ["tokio", "tonic", "prost", "envoy-types", "hyper", "mio"];

#[test]
fn the_model_depends_on_no_runtime_grpc_or_protobuf() {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--manifest-path"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let names: BTreeMap<&str, &str> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    // Normal (non-dev, non-build) edges of the resolved graph.
    let edges: BTreeMap<&str, Vec<&str>> = meta["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let deps = n["deps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k["kind"].is_null())
                })
                .map(|d| d["pkg"].as_str().unwrap())
                .collect();
            (n["id"].as_str().unwrap(), deps)
        })
        .collect();
    let root = names
        .iter()
        .find(|(_, n)| **n == "aether-model")
        .map(|(id, _)| *id)
        .expect("aether-model in the graph");
    let mut seen = BTreeSet::new();
    let mut todo = vec![root];
    while let Some(id) = todo.pop() {
        if seen.insert(id) {
            todo.extend(edges.get(id).into_iter().flatten().copied());
        }
    }
    let reached: BTreeSet<&str> = seen.iter().map(|id| names[id]).collect();
    assert!(
        reached.contains("imbl"),
        "the walk reaches the model's dependencies: {reached:?}"
    );
    let bad: Vec<&&str> = FORBIDDEN.iter().filter(|f| reached.contains(**f)).collect();
    assert!(
        bad.is_empty(),
        "aether-model must stay pure, but depends on {bad:?} (all: {reached:?})"
    );
}
