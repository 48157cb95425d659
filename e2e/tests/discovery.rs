//! Discovery and the taint guard: real etcd, two real `aether-registrar serve` replicas
//! watching the test Kubernetes API server (`aether_e2e::kube_api`), and, where the proxy
//! is involved, the real agent and a real Envoy on a node watching one of the replicas.
//!
//! The registrar's API user has exactly the chart's registrar rules. Each test states the
//! invariant it checks; each skips, saying so, where etcd or Envoy is not installed
//! (`scripts/test.sh` installs both).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::kube_api::{KubeApi, Rule};
use aether_e2e::registrar::{
    DISCOVERY_RULES, Etcd, LEASE_NAME as LEASE, LEASE_NAMESPACE as LEASE_NS,
    REGISTRAR_USER as USER, RegistrarProcess, TAINT_GUARD_RULES, dump, envoy_eds, expected_eds,
    registrar_bin,
};
use aether_e2e::testing::wait_for;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(20);
const TAINT: &str = "aether.io/agent-not-ready";

/// The API server, etcd, and the registrar's kubeconfig.
struct Cluster {
    api: KubeApi,
    etcd: Etcd,
    kubeconfig: String,
}

impl Cluster {
    fn start(test: &str) -> Option<Cluster> {
        let etcd = Etcd::start_or_skip(test)?;
        let api = KubeApi::start();
        // Exactly what the chart's registrar roles grant, with the taint guard on.
        api.grant(USER, DISCOVERY_RULES);
        api.grant(USER, TAINT_GUARD_RULES);
        let kubeconfig = api.kubeconfig(USER).display().to_string();
        Some(Cluster {
            api,
            etcd,
            kubeconfig,
        })
    }

    /// A registrar replica named `id` with a 2 s Lease, discovering unless `extra` says.
    fn replica(&self, id: &str, extra: &[&str]) -> RegistrarProcess {
        let mut args = vec![
            "--kubeconfig",
            &self.kubeconfig,
            "--lease-namespace",
            LEASE_NS,
            "--lease-name",
            LEASE,
            "--lease-duration",
            "2",
            "--leader-id",
            id,
        ];
        if !extra.contains(&"--discovery") {
            args.extend(["--discovery", "on"]);
        }
        args.extend_from_slice(extra);
        RegistrarProcess::tcp(&registrar_bin(), &self.etcd.endpoints(), &args)
    }

    fn holder(&self) -> Option<String> {
        self.api.lease(LEASE_NS, LEASE)?["spec"]["holderIdentity"]
            .as_str()
            .map(String::from)
    }
}

/// A slice endpoint's conditions.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cond {
    Ready,
    /// Terminating and still serving.
    Terminating,
    /// Terminating and no longer serving.
    TerminatingGone,
    NotReady,
}

fn service(ns: &str, name: &str) -> Value {
    json!({"metadata": {"namespace": ns, "name": name},
           "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
}

fn slice(ns: &str, name: &str, svc: &str, endpoints: &[(&str, &str, Cond)]) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, node, c)| {
            let (ready, serving, terminating) = match c {
                Cond::Ready => (true, true, false),
                Cond::Terminating => (false, true, true),
                Cond::TerminatingGone => (false, false, true),
                Cond::NotReady => (false, false, false),
            };
            json!({"addresses": [ip], "nodeName": node, "targetRef": {"kind": "Pod", "namespace": ns, "name": format!("{svc}-{ip}")},
                   "conditions": {"ready": ready, "serving": serving, "terminating": terminating}})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"namespace": ns, "name": name, "labels": {"kubernetes.io/service-name": svc}},
           "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": endpoints})
}

/// The registry as `dump` shows it: "namespace/name" to its endpoints, "address:port
/// state", sorted.
fn registry(addr: &str) -> BTreeMap<String, Vec<String>> {
    let d = dump(addr);
    let mut out = BTreeMap::new();
    for s in d["services"].as_array().into_iter().flatten() {
        let mut eps: Vec<String> = s["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                format!(
                    "{}:{} {}",
                    e["address"].as_str().unwrap_or("?"),
                    e["port"],
                    e["state"].as_str().unwrap_or("healthy")
                )
            })
            .collect();
        eps.sort();
        out.insert(
            format!(
                "{}/{}",
                s["namespace"].as_str().unwrap_or("?"),
                s["name"].as_str().unwrap_or("?")
            ),
            eps,
        );
    }
    out
}

/// Waits until the registry's services in the namespaces of `want` are `want`.
fn wait_registry(addr: &str, what: &str, want: &BTreeMap<String, Vec<String>>) {
    let namespaces: Vec<&str> = want
        .keys()
        .filter_map(|k| k.split_once('/'))
        .map(|(ns, _)| ns)
        .collect();
    let mut last = BTreeMap::new();
    let done = aether_e2e::testing::try_wait_for(what, T, || {
        last = registry(addr);
        last.retain(|k, _| {
            k.split_once('/')
                .is_some_and(|(ns, _)| namespaces.contains(&ns))
        });
        (last == *want).then_some(())
    });
    assert!(
        done.is_ok(),
        "{what}: the registry holds {last:#?}, want {want:#?}"
    );
}

fn eps(list: &[(&str, &str)]) -> Vec<String> {
    let mut v: Vec<String> = list
        .iter()
        .map(|(ip, state)| format!("{ip}:8080 {state}"))
        .collect();
    v.sort();
    v
}

/// The node's Envoy holds exactly what the registrar holds, with `cluster` as `want`.
fn wait_envoy(rig: &NodeRig, registrar: &str, cluster: &str, want: &[&str]) {
    let want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    let mut last = BTreeMap::new();
    let done = aether_e2e::testing::try_wait_for(
        &format!("Envoy's EDS for {cluster} to be {want:?}"),
        T,
        || {
            let (_, body) = rig.envoy.get("/config_dump?include_eds").ok()?;
            last = envoy_eds(&serde_json::from_str(&body).ok()?);
            let from_registrar = expected_eds(&dump(registrar));
            (last.get(cluster) == Some(&want) && last == from_registrar).then_some(())
        },
    );
    assert!(
        done.is_ok(),
        "Envoy's EDS is {last:#?}\n{}",
        rig.where_to_look()
    );
}

fn apply_file(
    addr: &str,
    dir: &std::path::Path,
    ns: &str,
    name: &str,
    ip: &str,
) -> std::process::Output {
    let file = dir.join(format!("{name}.json"));
    let doc = json!({"services": [{"name": name, "namespace": ns, "ports": [80], "endpoints": [{"address": ip, "port": 8080, "node": "node-f"}]}]});
    std::fs::write(&file, doc.to_string()).unwrap();
    std::process::Command::new(registrar_bin())
        .args([
            "apply",
            "--registrar",
            addr,
            "--file",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap()
}

#[test]
fn slices_reach_envoy_scale_and_termination_follow_a_drain_mark_holds_and_a_deletion_removes_the_service()
 {
    let test = "slices_reach_envoy_scale_and_termination_follow_a_drain_mark_holds_and_a_deletion_removes_the_service";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let Some(c) = Cluster::start(test) else {
        return;
    };
    // The rig registers its loopback upstreams at a replica.
    let r1 = c.replica("r1", &["--allow-loopback-endpoints"]);
    r1.wait_log("leading", T);
    let r2 = c.replica("r2", &["--allow-loopback-endpoints"]);
    r2.wait_log("another replica holds the Lease", T);
    let dir = tempfile::tempdir().unwrap();
    // A file's service of a name Kubernetes does not have, applied before discovery runs.
    assert!(
        apply_file(r1.addr(), dir.path(), "prod", "legacy", "10.9.0.1")
            .status
            .success()
    );

    c.api.put_service(service("prod", "shop"));
    c.api.put_endpoint_slice(slice(
        "prod",
        "shop-a",
        "shop",
        &[("10.1.0.1", "node-b", Cond::Ready)],
    ));
    c.api.put_endpoint_slice(slice(
        "prod",
        "shop-b",
        "shop",
        &[
            ("10.1.0.2", "node-c", Cond::Ready),
            ("10.1.0.9", "node-c", Cond::NotReady),
        ],
    ));
    // The node's agent watches the replica that does not lead: every replica serves watches.
    let mut rig = NodeRig::start_from(&envoy_bin, AdsApi::Delta, Some(r2.addr()), &[]);
    let cluster = aether_model::outbound_cluster_name(80, "shop", "prod");
    wait_envoy(
        &rig,
        r2.addr(),
        &cluster,
        &["10.1.0.1:8080 HEALTHY", "10.1.0.2:8080 HEALTHY"],
    );

    // Scaled up: a new endpoint in one slice.
    c.api.put_endpoint_slice(slice(
        "prod",
        "shop-b",
        "shop",
        &[
            ("10.1.0.2", "node-c", Cond::Ready),
            ("10.1.0.3", "node-c", Cond::Ready),
        ],
    ));
    wait_envoy(
        &rig,
        r2.addr(),
        &cluster,
        &[
            "10.1.0.1:8080 HEALTHY",
            "10.1.0.2:8080 HEALTHY",
            "10.1.0.3:8080 HEALTHY",
        ],
    );
    // A terminating endpoint turns draining.
    c.api.put_endpoint_slice(slice(
        "prod",
        "shop-a",
        "shop",
        &[("10.1.0.1", "node-b", Cond::Terminating)],
    ));
    wait_envoy(
        &rig,
        r2.addr(),
        &cluster,
        &[
            "10.1.0.1:8080 DRAINING",
            "10.1.0.2:8080 HEALTHY",
            "10.1.0.3:8080 HEALTHY",
        ],
    );

    // node-c's agent marks 10.1.0.2 draining (its pod is being deleted) while the slice
    // still says ready; a later rewrite of that slice does not undo the mark.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut client = rt
        .block_on(aether_registrar::client::connect(
            r1.addr(),
            Duration::from_secs(10),
            None,
        ))
        .unwrap();
    let mark = shared_proto::registry::SetEndpointStateRequest {
        service: Some(shared_proto::registry::ServiceKey {
            namespace: "prod".into(),
            name: "shop".into(),
        }),
        address: "10.1.0.2".into(),
        state: shared_proto::registry::EndpointState::Draining as i32,
        node: "node-c".into(),
        instance: "agent-c".into(),
    };
    rt.block_on(client.set_endpoint_state(mark))
        .expect("the drain mark");
    c.api.put_endpoint_slice(slice(
        "prod",
        "shop-b",
        "shop",
        &[
            ("10.1.0.2", "node-c", Cond::Ready),
            ("10.1.0.3", "node-c", Cond::Ready),
            ("10.1.0.4", "node-c", Cond::Ready),
        ],
    ));
    wait_envoy(
        &rig,
        r2.addr(),
        &cluster,
        &[
            "10.1.0.1:8080 DRAINING",
            "10.1.0.2:8080 DRAINING",
            "10.1.0.3:8080 HEALTHY",
            "10.1.0.4:8080 HEALTHY",
        ],
    );

    // Files and discovery: a file may not change a discovered service, and discovery left
    // the file's own service alone.
    let refused = apply_file(r1.addr(), dir.path(), "prod", "shop", "10.9.0.2");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("discovered from Kubernetes"),
        "{refused:?}"
    );
    // Kubernetes wins: a Service named as a file's service takes it over.
    assert!(
        apply_file(r1.addr(), dir.path(), "prod", "api", "10.9.0.3")
            .status
            .success()
    );
    c.api.put_service(service("prod", "api"));
    c.api.put_endpoint_slice(slice(
        "prod",
        "api-a",
        "api",
        &[("10.2.0.1", "node-b", Cond::Ready)],
    ));
    let mut want = BTreeMap::from([
        ("prod/api".to_owned(), eps(&[("10.2.0.1", "healthy")])),
        ("prod/legacy".to_owned(), eps(&[("10.9.0.1", "healthy")])),
        (
            "prod/shop".to_owned(),
            eps(&[
                ("10.1.0.1", "draining"),
                ("10.1.0.2", "draining"),
                ("10.1.0.3", "healthy"),
                ("10.1.0.4", "healthy"),
            ]),
        ),
    ]);
    wait_registry(r2.addr(), "the Service api to take over the file's", &want);
    r1.wait_log("now owns it", T);

    // Deleted in Kubernetes: gone from the registry and from Envoy.
    c.api.delete_service("prod", "shop");
    want.remove("prod/shop");
    wait_registry(
        r2.addr(),
        "the deleted Service to leave the registry",
        &want,
    );
    wait_for("Envoy to drop the deleted service's cluster", T, || {
        let (_, body) = rig.envoy.get("/config_dump?include_eds").ok()?;
        let eds = envoy_eds(&serde_json::from_str(&body).ok()?);
        (!eds.contains_key(&cluster) && eds == expected_eds(&dump(r2.addr()))).then_some(())
    });
    assert!(
        r2.log().matches("discovered service written").count() == 0,
        "the follower wrote:\n{}",
        r2.log()
    );
    rig.pass();
}

/// The state both sides of a failover test agree on: service `svc-<i>` has endpoints
/// Node A's drain mark, for every service at `address`, as its agent sends it.
fn mark_all(
    rt: &tokio::runtime::Runtime,
    registrar: &str,
    address: &str,
    node: &str,
) -> Result<shared_proto::registry::SetEndpointStateResponse, tonic::Status> {
    let mut client = rt
        .block_on(aether_registrar::client::connect(
            registrar,
            Duration::from_secs(10),
            None,
        ))
        .unwrap();
    let mark = shared_proto::registry::SetEndpointStateRequest {
        service: None,
        address: address.into(),
        state: shared_proto::registry::EndpointState::Draining as i32,
        node: node.into(),
        instance: format!("agent-{node}"),
    };
    rt.block_on(client.set_endpoint_state(mark))
        .map(tonic::Response::into_inner)
}

/// EndpointSlice spoof: whoever may write EndpointSlices in a namespace lists a node-A
/// pod's IP in a second Service's slice under node B. Node A's drain mark for that pod
/// still lands on node A's service, and the answer names the one it skipped; the
/// spoofed entry keeps its state. A slice endpoint at a link-local address is left out,
/// logged and counted, the rest of its slice written; one terminating and no longer
/// serving is left out, one terminating and still serving is draining.
#[test]
fn endpointslice_spoof_a_second_services_slice_cannot_block_node_as_drain_and_bad_endpoints_are_left_out()
 {
    let Some(c) = Cluster::start("endpointslice_spoof...") else {
        return;
    };
    let metrics_addr = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let r1 = c.replica("r1", &["--metrics-addr", &metrics_addr]);
    r1.wait_log("leading", T);
    let pod = "10.5.0.7";
    c.api.put_service(service("spoof", "shop"));
    c.api.put_endpoint_slice(slice(
        "spoof",
        "shop-a",
        "shop",
        &[
            (pod, "node-a", Cond::Ready),
            ("10.5.0.8", "node-a", Cond::Ready),
        ],
    ));
    c.api.put_service(service("spoof", "decoy"));
    c.api.put_endpoint_slice(slice(
        "spoof",
        "decoy-a",
        "decoy",
        &[
            (pod, "node-b", Cond::Ready),
            ("169.254.169.254", "node-b", Cond::Ready),
            ("10.5.0.20", "node-b", Cond::TerminatingGone),
            ("10.5.0.21", "node-b", Cond::Terminating),
        ],
    ));
    let mut want = BTreeMap::from([
        (
            "spoof/decoy".to_owned(),
            eps(&[(pod, "healthy"), ("10.5.0.21", "draining")]),
        ),
        (
            "spoof/shop".to_owned(),
            eps(&[(pod, "healthy"), ("10.5.0.8", "healthy")]),
        ),
    ]);
    wait_registry(r1.addr(), "both services, without the bad endpoints", &want);
    r1.wait_log("169.254.169.254 is link-local", T);
    let refused = aether_e2e::testing::scrape_metrics(&metrics_addr).and_then(|t| {
        aether_e2e::testing::metric_sample(&t, "aether_registrar_discovery_endpoints_refused_total")
    });
    assert!(
        refused.is_some_and(|n| n >= 1.0),
        "aether_registrar_discovery_endpoints_refused_total: {refused:?}"
    );

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answer = mark_all(&rt, r1.addr(), pod, "node-a").expect("node A's drain mark lands");
    assert_eq!(answer.marked, 1, "{answer:?}");
    let skipped: Vec<(String, String)> = answer
        .skipped
        .iter()
        .map(|s| {
            let k = s.service.as_ref().unwrap();
            (
                format!("{}/{}", k.namespace, k.name),
                s.endpoint_node.clone(),
            )
        })
        .collect();
    assert_eq!(
        skipped,
        [("spoof/decoy".to_owned(), "node-b".to_owned())],
        "{answer:?}"
    );
    want.insert(
        "spoof/shop".to_owned(),
        eps(&[(pod, "draining"), ("10.5.0.8", "healthy")]),
    );
    wait_registry(
        r1.addr(),
        "node A's service drained, the decoy untouched",
        &want,
    );
    let marks = dump(r1.addr())["marks"].clone();
    assert_eq!(
        marks.as_array().map(Vec::len),
        Some(1),
        "one mark, on node A's service: {marks}"
    );
    assert_eq!(
        (&marks[0]["namespace"], &marks[0]["name"], &marks[0]["node"]),
        (&json!("spoof"), &json!("shop"), &json!("node-a")),
        "{marks}"
    );
    r1.wait_log("SetEndpointState skipped a service", T);

    // Refused only where nothing at the address is on the caller's node.
    let refused = mark_all(&rt, r1.addr(), "10.5.0.8", "node-b").unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("node-a"), "{refused:?}");
}

/// `10.3.<i>.1..=n`.
fn numbered(i: usize, n: usize) -> Value {
    let ips: Vec<String> = (1..=n).map(|e| format!("10.3.{i}.{e}")).collect();
    let list: Vec<(&str, &str, Cond)> = ips
        .iter()
        .map(|ip| (ip.as_str(), "node-b", Cond::Ready))
        .collect();
    slice("churn", &format!("svc-{i}-a"), &format!("svc-{i}"), &list)
}

fn numbered_want(counts: &BTreeMap<usize, usize>) -> BTreeMap<String, Vec<String>> {
    counts
        .iter()
        .map(|(i, n)| {
            let ips: Vec<String> = (1..=*n).map(|e| format!("10.3.{i}.{e}")).collect();
            (
                format!("churn/svc-{i}"),
                eps(&ips
                    .iter()
                    .map(|ip| (ip.as_str(), "healthy"))
                    .collect::<Vec<_>>()),
            )
        })
        .collect()
}

#[test]
fn a_killed_leader_hands_the_lease_to_the_other_replica_and_no_change_is_lost() {
    let Some(c) = Cluster::start(
        "a_killed_leader_hands_the_lease_to_the_other_replica_and_no_change_is_lost",
    ) else {
        return;
    };
    let mut r1 = c.replica("r1", &[]);
    r1.wait_log("leading", T);
    let metrics_addr = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let r2 = c.replica("r2", &["--metrics-addr", &metrics_addr]);
    r2.wait_log("another replica holds the Lease", T);
    let leading = || {
        aether_e2e::testing::scrape_metrics(&metrics_addr)
            .and_then(|t| aether_e2e::testing::metric_sample(&t, "aether_registrar_leader"))
    };
    assert_eq!(
        leading(),
        Some(0.0),
        "the follower's aether_registrar_leader"
    );
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for i in 0..10 {
        c.api.put_service(service("churn", &format!("svc-{i}")));
        c.api.put_endpoint_slice(numbered(i, 1));
        counts.insert(i, 1);
    }
    wait_registry(r2.addr(), "the first services", &numbered_want(&counts));

    // Changes keep coming while the leader dies mid-stream and after: each one must land.
    let killed_at = Instant::now();
    for step in 0..40 {
        let i = step % 10;
        *counts.get_mut(&i).unwrap() += 1;
        c.api.put_endpoint_slice(numbered(i, counts[&i]));
        if step == 5 {
            r1.kill();
        }
    }
    r2.wait_log("leading", T);
    let took_over = killed_at.elapsed();
    assert_eq!(c.holder().as_deref(), Some("r2"));
    wait_for(
        "the new leader's aether_registrar_leader to say 1",
        T,
        || (leading() == Some(1.0)).then_some(()),
    );
    wait_registry(
        r2.addr(),
        "etcd to equal the API after the failover",
        &numbered_want(&counts),
    );
    // And the new leader writes the next change too.
    c.api.delete_service("churn", "svc-0");
    counts.remove(&0);
    wait_registry(
        r2.addr(),
        "the next change after the failover",
        &numbered_want(&counts),
    );
    let lease = c.api.lease(LEASE_NS, LEASE).unwrap();
    assert_eq!(lease["spec"]["leaseTransitions"], 1, "{lease}");
    eprintln!("the follower led {took_over:?} after the leader was killed (lease 2 s)");
    assert!(
        took_over < Duration::from_secs(10),
        "took over after {took_over:?}"
    );
}

#[test]
fn a_registrar_down_while_services_change_and_a_410_both_converge_to_the_api() {
    let Some(c) =
        Cluster::start("a_registrar_down_while_services_change_and_a_410_both_converge_to_the_api")
    else {
        return;
    };
    let mut r1 = c.replica("r1", &[]);
    r1.wait_log("leading", T);
    let dir = tempfile::tempdir().unwrap();
    assert!(
        apply_file(r1.addr(), dir.path(), "churn", "legacy", "10.9.0.1")
            .status
            .success()
    );
    let mut counts: BTreeMap<usize, usize> = (0..4).map(|i| (i, 2)).collect();
    for (i, n) in &counts {
        c.api.put_service(service("churn", &format!("svc-{i}")));
        c.api.put_endpoint_slice(numbered(*i, *n));
    }
    let with_legacy = |counts: &BTreeMap<usize, usize>| {
        let mut w = numbered_want(counts);
        w.insert("churn/legacy".into(), eps(&[("10.9.0.1", "healthy")]));
        w
    };
    wait_registry(r1.addr(), "the services", &with_legacy(&counts));

    // Down: a Service deleted, one created, one's slice changed; the API forgets its
    // history meanwhile.
    let status = r1.terminate(T);
    assert!(status.success(), "{status:?}");
    assert_eq!(c.holder(), None, "the leader released the Lease at SIGTERM");
    c.api.delete_service("churn", "svc-1");
    c.api.delete_endpoint_slice("churn", "svc-1-a");
    c.api.put_service(service("churn", "svc-7"));
    c.api.put_endpoint_slice(numbered(7, 3));
    c.api.put_endpoint_slice(numbered(2, 5));
    c.api.expire_history();
    counts.remove(&1);
    counts.insert(7, 3);
    counts.insert(2, 5);
    r1.restart();
    r1.wait_log("leading", T);
    wait_registry(
        r1.addr(),
        "etcd to converge after the registrar was down",
        &with_legacy(&counts),
    );

    // A 410 under a running registrar: its watches end, the API changes and forgets its
    // history, and the watches' resume answers 410 Gone; the relist converges.
    c.api.set_down(true);
    c.api.delete_service("churn", "svc-3");
    counts.remove(&3);
    c.api.put_endpoint_slice(numbered(0, 4));
    counts.insert(0, 4);
    c.api.expire_history();
    c.api.set_down(false);
    wait_registry(
        r1.addr(),
        "etcd to converge after a 410",
        &with_legacy(&counts),
    );
}

fn node(name: &str, taints: &[Value]) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {"taints": taints}})
}

fn agent_pod(name: &str, node: &str, ready: bool) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": LEASE_NS, "labels": {"app.kubernetes.io/name": "aether-agent", "app.kubernetes.io/component": "agent"}},
           "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "aether/agent"}]},
           "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

fn tainted(api: &KubeApi, node: &str) -> bool {
    api.node(node).expect("the node")["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| t["key"] == TAINT)
}

#[test]
fn a_node_whose_only_agent_pod_goes_not_ready_is_tainted_after_the_grace_and_no_sooner() {
    let Some(c) = Cluster::start(
        "a_node_whose_only_agent_pod_goes_not_ready_is_tainted_after_the_grace_and_no_sooner",
    ) else {
        return;
    };
    c.api.put_node(node(
        "n1",
        &[json!({"key": "other", "effect": "NoExecute"})],
    ));
    c.api.put_node(node("n2", &[]));
    c.api.put_pod(agent_pod("agent-n1", "n1", true));
    c.api.put_pod(agent_pod("agent-n2", "n2", true));
    // Not an agent: a Ready pod of another app on n1 does not count.
    let mut other = agent_pod("web-n1", "n1", true);
    other["metadata"]["labels"] = json!({"app": "web"});
    c.api.put_pod(other);
    let r1 = c.replica(
        "r1",
        &["--discovery", "off", "--taint-guard", "--taint-grace", "2"],
    );
    r1.wait_log("leading", T);
    r1.wait_log("taint guard watching", T);

    let went = Instant::now();
    c.api.put_pod(agent_pod("agent-n1", "n1", false));
    wait_for("n1 to be tainted", T, || {
        tainted(&c.api, "n1").then_some(())
    });
    let after = went.elapsed();
    assert!(
        after >= Duration::from_secs(2),
        "tainted {after:?} after its agent went NotReady, before the 2 s grace"
    );
    assert_eq!(c.api.patches(USER), 1, "one patch");
    let n1 = c.api.node("n1").unwrap();
    assert_eq!(
        n1["spec"]["taints"].as_array().unwrap().len(),
        2,
        "the other taint stays: {n1}"
    );
    assert!(!tainted(&c.api, "n2"));
    r1.wait_log("tainted a node with no Ready agent pod", T);
    eprintln!("n1 tainted {after:?} after its agent pod went NotReady (grace 2 s)");

    // A terminating agent pod counts as none, even Ready.
    let went = Instant::now();
    c.api.mark_pod_deleting(LEASE_NS, "agent-n2");
    wait_for("n2 to be tainted", T, || {
        tainted(&c.api, "n2").then_some(())
    });
    assert!(
        went.elapsed() >= Duration::from_secs(2),
        "{:?}",
        went.elapsed()
    );
    assert_eq!(c.api.patches(USER), 2);
}

/// What the chart's ClusterRole grants the agent.
const AGENT_RULES: &[Rule] = &[
    Rule {
        resource: "pods",
        verbs: &["get", "list", "watch"],
    },
    Rule {
        resource: "nodes",
        verbs: &["get", "list", "watch", "patch"],
    },
];

/// `--kubeconfig=PATH` for `user`, in a file the worker (uid 65532 when the tests run as
/// root) can read.
fn agent_kubeconfig(api: &KubeApi, user: &str, dir: &std::path::Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    api.grant(user, AGENT_RULES);
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join(format!("{user}.kubeconfig"));
    std::fs::copy(api.kubeconfig(user), &path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    format!("--kubeconfig={}", path.display())
}

#[test]
fn twenty_surge_rolls_never_taint_and_the_agent_and_the_guard_never_fight() {
    let test = "twenty_surge_rolls_never_taint_and_the_agent_and_the_guard_never_fight";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let Some(c) = Cluster::start(test) else {
        return;
    };
    // The kubelet registered the node with the startup taint; the first agent pod is not
    // Ready yet.
    c.api.put_node(node(
        "test-node",
        &[json!({"key": TAINT, "effect": "NoSchedule"})],
    ));
    c.api.put_pod(agent_pod("agent-0", "test-node", false));
    let r1 = c.replica(
        "r1",
        &["--discovery", "off", "--taint-guard", "--taint-grace", "1"],
    );
    r1.wait_log("taint guard watching", T);
    r1.wait_log("leading", T);
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = agent_kubeconfig(&c.api, "agent", dir.path());
    let mut rig = NodeRig::start_with(&envoy_bin, AdsApi::Delta, &[&kubeconfig]);
    // The owner removes the taint once Envoy ACKed; the guard leaves a tainted node alone.
    wait_for("the first owner to remove the startup taint", T, || {
        (!tainted(&c.api, "test-node")).then_some(())
    });
    c.api.put_pod(agent_pod("agent-0", "test-node", true));
    assert_eq!(c.api.patches("agent"), 1);

    let mut owner_gen = 0;
    for roll in 1..=20 {
        // Surge: the new pod is Ready (a warm standby) before the old one goes.
        let standby = rig.start_agent();
        standby.wait_role("standby", T);
        c.api
            .put_pod(agent_pod(&format!("agent-{roll}"), "test-node", true));
        c.api
            .mark_pod_deleting(LEASE_NS, &format!("agent-{owner_gen}"));
        let mut old = std::mem::replace(&mut rig.owner, standby);
        old.signal(nix::sys::signal::Signal::SIGTERM);
        old.wait_exit(T);
        rig.owner.wait_role("owner", T);
        c.api.delete_pod(LEASE_NS, &format!("agent-{owner_gen}"));
        owner_gen = roll;
        assert!(
            !tainted(&c.api, "test-node"),
            "roll {roll}: the node was tainted"
        );
    }
    assert_eq!(
        c.api.patches(USER),
        0,
        "the guard patched during the rolls:\n{}",
        r1.log()
    );
    assert_eq!(
        c.api.patches("agent"),
        1,
        "the agents patched again: someone re-applied the taint"
    );

    // And the guard was watching all along: with the node's agent gone (killed, its pod
    // NotReady), it taints the node after the grace.
    rig.owner.kill_generation();
    c.api
        .put_pod(agent_pod(&format!("agent-{owner_gen}"), "test-node", false));
    wait_for(
        "the guard to taint the node with no Ready agent pod",
        T,
        || tainted(&c.api, "test-node").then_some(()),
    );
    assert_eq!(c.api.patches(USER), 1);
    rig.pass();
}
