//! The registry as the registrar holds it, and as Envoy got it: the registrar's operator
//! commands (`aether-registrar apply`, `dump`) run as processes, and a comparison of a
//! dump with the EDS in Envoy's config dump.
//!
//! etcd and the registrar themselves start through `aether_registrar::testing`
//! ([`Etcd`], [`RegistrarProcess`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

pub use aether_registrar::testing::{Etcd, RegistrarProcess, TestCa};

use crate::testing::bin;

/// The registrar binary this build made.
pub fn registrar_bin() -> std::path::PathBuf {
    bin("aether-registrar")
}

/// Runs `aether-registrar <args>` and returns its stdout; panics with its stderr on failure.
pub fn cli(args: &[&str]) -> String {
    let out = Command::new(registrar_bin())
        .args(args)
        .output()
        .expect("run aether-registrar");
    assert!(
        out.status.success(),
        "aether-registrar {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Upserts the services of `file` (the `--registry-file` schema); returns the revision.
pub fn apply(addr: &str, file: &Path) -> i64 {
    apply_with(addr, file, &[])
}

/// [`apply`] with more flags, e.g. `--ca` or `--token-file`.
pub fn apply_with(addr: &str, file: &Path, extra: &[&str]) -> i64 {
    let file = file.display().to_string();
    let out = cli(&[&["apply", "--registrar", addr, "--file", &file], extra].concat());
    revision_in(&out)
}

/// Writes `doc` to `file` and applies it; returns the revision.
pub fn apply_doc(addr: &str, file: &Path, doc: &Value) -> i64 {
    std::fs::write(file, doc.to_string()).expect("write the registry file");
    apply(addr, file)
}

/// The `(revision N)` an operator command prints.
fn revision_in(out: &str) -> i64 {
    out.rsplit_once("(revision ")
        .and_then(|(_, r)| r.trim_end().trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no revision in aether-registrar's output {out:?}"))
}

/// The registrar's view: services with effective endpoint states, then drain marks.
pub fn dump(addr: &str) -> Value {
    serde_json::from_str(&cli(&["dump", "--registrar", addr])).expect("dump is JSON")
}

/// What a proxy's EDS should hold for `dump`: per outbound cluster (one per service
/// port), its endpoints as "addr:port HEALTH", sorted.
pub fn expected_eds(dump: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for s in dump["services"].as_array().into_iter().flatten() {
        let (name, ns) = (
            s["name"].as_str().unwrap_or_default(),
            s["namespace"].as_str().unwrap_or_default(),
        );
        let ports: Vec<u64> = s["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        for p in &ports {
            let mut eps: Vec<String> = s["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| {
                    e["service_port"]
                        .as_u64()
                        .or((ports.len() == 1).then_some(*p))
                        == Some(*p)
                })
                .map(|e| {
                    let health = if e["state"] == "draining" {
                        "DRAINING"
                    } else {
                        "HEALTHY"
                    };
                    format!(
                        "{}:{} {health}",
                        e["address"].as_str().unwrap_or("?"),
                        e["port"].as_u64().unwrap_or(0)
                    )
                })
                .collect();
            eps.sort();
            out.insert(
                aether_model::outbound_cluster_name(*p as u16, name, ns),
                eps,
            );
        }
    }
    out
}

/// Every outbound cluster's EDS in Envoy's `/config_dump?include_eds`, as
/// [`expected_eds`] writes it (UNHEALTHY read as the DRAINING the agent sent).
pub fn envoy_eds(config_dump: &Value) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let Some(configs) = config_dump["configs"].as_array() else {
        return out;
    };
    let names: Vec<String> = configs
        .iter()
        .filter(|c| {
            c["@type"]
                .as_str()
                .is_some_and(|t| t.ends_with("EndpointsConfigDump"))
        })
        .flat_map(|c| {
            c["dynamic_endpoint_configs"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|e| {
            e["endpoint_config"]["cluster_name"]
                .as_str()
                .map(String::from)
        })
        .filter(|n| aether_model::is_outbound_cluster(n))
        .collect();
    for n in names {
        if let Some(eps) = crate::envoy::endpoints(config_dump, &n) {
            // The config dump shows a host the agent sent as DRAINING as UNHEALTHY (the
            // agent sends nothing else but HEALTHY); `/clusters` keeps the EDS status.
            let mut eps: Vec<String> = eps
                .into_iter()
                .map(|e| e.replace(" UNHEALTHY", " DRAINING"))
                .collect();
            eps.sort();
            out.insert(n, eps);
        }
    }
    out
}

/// The registrar's API user in the discovery tests and benchmark, and its Lease.
pub const REGISTRAR_USER: &str = "system:serviceaccount:aether:aether-registrar";
pub const LEASE_NAMESPACE: &str = "aether";
pub const LEASE_NAME: &str = "aether-registrar";

/// What the chart's registrar ClusterRole and Role grant for discovery and its Lease.
pub const DISCOVERY_RULES: &[crate::kube_api::Rule] = &[
    crate::kube_api::Rule {
        resource: "services",
        verbs: &["get", "list", "watch"],
    },
    crate::kube_api::Rule {
        resource: "endpointslices",
        verbs: &["get", "list", "watch"],
    },
    crate::kube_api::Rule {
        resource: "leases",
        verbs: &["get", "create", "update"],
    },
];

/// What the chart adds for the taint guard.
pub const TAINT_GUARD_RULES: &[crate::kube_api::Rule] = &[
    crate::kube_api::Rule {
        resource: "pods",
        verbs: &["get", "list", "watch"],
    },
    crate::kube_api::Rule {
        resource: "nodes",
        verbs: &["get", "list", "watch", "patch"],
    },
];

/// The start of a registrar benchmark `name`: outside `cargo bench` (no `--bench`
/// argument: a debug build's figures mean nothing) it says so and returns None. Otherwise
/// it runs itself again with the agents' ACK log on (`ack_log::rerun_with_agent_log`),
/// and exits with 2 when Envoy or etcd is missing; Envoy's path and a started etcd.
pub fn bench_start(name: &str) -> Option<(std::path::PathBuf, Etcd)> {
    if !std::env::args().any(|a| a == "--bench") {
        println!("{name}: run with `cargo bench -p aether-e2e --bench {name}`; skipping");
        return None;
    }
    crate::envoy::ack_log::rerun_with_agent_log();
    let Some(envoy_bin) = crate::envoy::envoy_bin() else {
        eprintln!("{name}: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
        std::process::exit(2);
    };
    let Some(etcd) = Etcd::start_or_skip(name) else {
        std::process::exit(2)
    };
    Some((envoy_bin, etcd))
}

/// The registrar's service account, as the chart names it.
pub const REGISTRAR_SA: &str = "system:serviceaccount:aether-system:aether-registrar";
/// The agents' service account, as the chart names it.
pub const AGENT_SA: &str = "system:serviceaccount:aether-system:aether-agent";

/// The test API server as a registrar with `--token-review` needs it: [`REGISTRAR_SA`] may
/// create TokenReviews, and [`AGENT_SA`]'s token is bound to `node`. Returns it and the
/// registrar's kubeconfig (`--kubeconfig`).
pub fn token_review_api(node: &str) -> (crate::kube_api::KubeApi, String) {
    let api = crate::kube_api::KubeApi::start();
    api.grant(
        REGISTRAR_SA,
        &[crate::kube_api::Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(AGENT_SA, node);
    let kubeconfig = api.kubeconfig(REGISTRAR_SA).display().to_string();
    (api, kubeconfig)
}

/// A folder whose files a worker can read (uid 65532 when the tests run as root): the
/// folder 0755, each file 0644. Removed on drop.
pub struct WorkerReadable(tempfile::TempDir);

impl WorkerReadable {
    pub fn new(prefix: &str) -> WorkerReadable {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("a temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod the temp dir");
        WorkerReadable(dir)
    }

    /// Writes `bytes` to the file `name`; its path.
    pub fn put(&self, name: &str, bytes: &[u8]) -> String {
        use std::os::unix::fs::PermissionsExt;
        let path = self.0.path().join(name);
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
        path.display().to_string()
    }
}
