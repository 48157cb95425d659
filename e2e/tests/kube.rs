//! The agent with a Kubernetes API server: the real agent binaries against the test API
//! server (`aether_e2e::kube_api`), pods through the real CNI plugin, and a real Envoy
//! where the proxy is involved.
//!
//! Each agent generation gets its own API user (its own kubeconfig and bearer token), so
//! that the server's per-user request log and patch count tell which generation did
//! what: in a cluster both generations share the pod's service account, which would hide
//! a standby's write.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, Envoy, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::harness::two_node::eds_health;
use aether_e2e::kube_api::{KubeApi, Rule};
use aether_e2e::testing::{
    Agent, LocalNode, bin, free_port, identity_args, identity_provider_for_agents, scrape_metrics,
    try_wait_for, wait_for,
};
use serde_json::{Value, json};

const TAINT: &str = "aether.io/agent-not-ready";
/// Exactly what the chart's ClusterRole grants the agent.
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
const T: Duration = Duration::from_secs(15);
const NS: &str = "churn";

/// Kubeconfigs the worker can read: it runs as uid 65532 when the tests run as root, and
/// the test server keeps its own in a private folder.
struct Kubeconfigs(tempfile::TempDir);

impl Kubeconfigs {
    fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("aether-kubeconfigs-")
            .tempdir()
            .expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        Self(dir)
    }

    /// `--kubeconfig=PATH` for `user`, granted the agent's rules when `grant`.
    fn flag(&self, api: &KubeApi, user: &str, grant: bool) -> String {
        if grant {
            api.grant(user, AGENT_RULES);
        }
        let path = self.0.path().join(format!("{user}.kubeconfig"));
        std::fs::copy(api.kubeconfig(user), &path).expect("copy the kubeconfig");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        format!("--kubeconfig={}", path.display())
    }
}

fn node_object(name: &str, taints: &[Value]) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": {"taints": taints}})
}

fn taint(key: &str) -> Value {
    json!({"key": key, "effect": "NoSchedule"})
}

fn taint_keys(api: &KubeApi, node: &str) -> Vec<String> {
    let n = api.node(node).expect("the node");
    n["spec"]["taints"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t["key"].as_str().unwrap_or("").to_string())
        .collect()
}

fn pod_id(n: u32) -> PodId {
    PodId {
        uid: format!("kube-pod-{n:04}-uid"),
        name: format!("app-{n}"),
    }
}

/// The pod object the API server holds for `pod` on `node` (the CNI plugin passes the
/// same namespace, name and uid).
fn pod_object(pod: &PodId, node: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": pod.name, "namespace": NS, "uid": pod.uid},
           "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app:1"}]}})
}

fn cni(node: &LocalNode) -> Cni {
    Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    }
}

/// `inbound|<uid>`'s hosts in Envoy's `/clusters` with their health status.
fn inbound_health(envoy: &Envoy, pod: &PodId) -> Option<BTreeMap<String, String>> {
    eds_health(&envoy.admin, &format!("inbound|{}", pod.uid)).filter(|h| !h.is_empty())
}

fn wait_health(envoy: &Envoy, pod: &PodId, ip: Ipv4Addr, status: &str, timeout: Duration) {
    let want: BTreeMap<String, String> = [(format!("{ip}:80"), status.to_string())].into();
    let mut last = None;
    let got = aether_e2e::testing::try_wait_for(
        &format!("Envoy to serve pod {} as {status}", pod.uid),
        timeout,
        || {
            last = inbound_health(envoy, pod);
            (last.as_ref() == Some(&want)).then_some(())
        },
    );
    if let Err(e) = got {
        panic!("{e}: Envoy has {last:?}");
    }
}

/// The stored record of `uid`, if any.
fn record(node: &LocalNode, uid: &str) -> Option<Value> {
    let text =
        std::fs::read_to_string(node.state_dir.join("pods").join(format!("{uid}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

fn stored_uids(node: &LocalNode) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(node.state_dir.join("pods"))
        .map(|r| {
            r.filter_map(|e| {
                e.ok()?
                    .file_name()
                    .to_str()?
                    .strip_suffix(".json")
                    .map(String::from)
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A capture file with free ports, so that Envoys of tests running in parallel do not
/// clash: `--capture-file=...`.
fn capture_flag(node: &LocalNode) -> String {
    let outbound = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("free port")
    );
    let inbound = free_port(Ipv4Addr::UNSPECIFIED).expect("free port");
    let path = node.root.path().join("capture.json");
    std::fs::write(
        &path,
        json!({ "outbound": outbound, "inbound_port": inbound }).to_string(),
    )
    .expect("capture file");
    format!("--capture-file={}", path.display())
}

fn start_envoy(envoy: &Path, node: &LocalNode) -> Envoy {
    let e = Envoy::start(
        envoy,
        node.root.path(),
        &node.run_dir,
        Duration::from_millis(100),
        Duration::from_secs(1),
        AdsApi::Delta,
    )
    .expect("start Envoy");
    e.wait_connected(T);
    e
}

/// The `kubernetes` problem in `/ready`, if any.
fn kube_problem(agent: &Agent) -> Option<String> {
    let (_, v) = agent.ready()?;
    v["problems"]
        .as_array()?
        .iter()
        .find(|p| p["source"] == "kubernetes")
        .map(|p| p["message"].as_str().unwrap_or("").to_string())
}

fn serving(agent: &Agent) -> Value {
    wait_for(&format!("{} to serve as owner", agent.name), T, || {
        agent.serving_owner()
    })
}

/// Where `needle` first appears in `text` (for ordering log lines).
fn at(text: &str, needle: &str) -> usize {
    text.find(needle)
        .unwrap_or_else(|| panic!("{needle:?} not in the log:\n{text}"))
}

// --- Show 1: Terminating marks --------------------------------------------------------

#[test]
fn a_pod_marked_for_deletion_turns_draining_in_envoy_from_the_owners_write() {
    let Some(envoy) =
        envoy_or_skip("a_pod_marked_for_deletion_turns_draining_in_envoy_from_the_owners_write")
    else {
        return;
    };
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[taint(TAINT)]));
    let mut rig = NodeRig::start_from(&envoy, AdsApi::Delta, None, &[&owner_kc]);
    let cni = cni(&rig.node);
    let (pod, ip) = (pod_id(1), Ipv4Addr::new(10, 91, 0, 5));
    api.put_pod(pod_object(&pod, "test-node"));
    cni.call("ADD", &pod, Some(ip)).expect("ADD");
    wait_health(&rig.envoy, &pod, ip, "HEALTHY", T);

    let start = Instant::now();
    api.mark_pod_deleting(NS, &pod.name);
    wait_health(&rig.envoy, &pod, ip, "DRAINING", T);
    eprintln!(
        "deletion timestamp to DRAINING in Envoy: {:?}",
        start.elapsed()
    );
    wait_for("the record's Terminating mark", T, || {
        (record(&rig.node, &pod.uid)?["terminating"] == true).then_some(())
    });
    rig.owner.wait_log("record marked Terminating", T);
    // The pod is still served (its connections finish); only its endpoint drains.
    assert!(rig.config_dump().contains(&format!("inbound|{}", pod.uid)));

    // Its DEL and the API's removal end it as usual.
    cni.call("DEL", &pod, None).expect("DEL");
    api.delete_pod(NS, &pod.name);
    wait_for("Envoy to drop the pod's cluster", T, || {
        inbound_health(&rig.envoy, &pod).is_none().then_some(())
    });
    assert!(record(&rig.node, &pod.uid).is_none());
    rig.pass();
}

#[test]
fn a_deletion_during_a_surge_roll_is_served_draining_by_the_new_owner() {
    let Some(envoy) =
        envoy_or_skip("a_deletion_during_a_surge_roll_is_served_draining_by_the_new_owner")
    else {
        return;
    };
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let (gen1_kc, gen2_kc) = (kc.flag(&api, "gen1", true), kc.flag(&api, "gen2", true));
    api.put_node(node_object("test-node", &[]));
    let mut rig = NodeRig::start_from(&envoy, AdsApi::Delta, None, &[&gen1_kc]);
    let cni = cni(&rig.node);
    let (pod, ip) = (pod_id(2), Ipv4Addr::new(10, 91, 0, 6));
    api.put_pod(pod_object(&pod, "test-node"));
    cni.call("ADD", &pod, Some(ip)).expect("ADD");
    wait_health(&rig.envoy, &pod, ip, "HEALTHY", T);

    // The surge pod starts beside the owner: a standby with its own watches, by its own
    // kubeconfig in place of gen1's.
    rig.node.args.retain(|a| *a != gen1_kc);
    let gen2 = rig.node.start_agent_with(&[&gen2_kc]);
    gen2.wait_role("standby", T);
    wait_for("both generations to watch pods", T, || {
        (api.watchers("pods") >= 2).then_some(())
    });

    // The deletion arrives during the overlap: the owner writes, the standby does not.
    api.mark_pod_deleting(NS, &pod.name);
    wait_health(&rig.envoy, &pod, ip, "DRAINING", T);
    // The snapshot goes first, the record's fsync while the proxy applies it.
    wait_for("the record's Terminating mark", T, || {
        (record(&rig.node, &pod.uid)?["terminating"] == true).then_some(())
    });
    assert!(
        !gen2.log().contains("record marked Terminating"),
        "the standby wrote:\n{}",
        gen2.log()
    );

    // The roll: the old owner goes, the standby takes over and serves it as draining.
    let since = Instant::now();
    std::thread::sleep(Duration::from_millis(50));
    rig.owner.signal(nix::sys::signal::Signal::SIGTERM);
    serving(&gen2);
    rig.owner.wait_exit(T);
    rig.wait_reconnected(since, "the surge roll");
    // Taken from the owner's record while a standby, or else at the takeover's reconcile.
    gen2.wait_log("pod rewritten during the overlap", T);
    wait_health(&rig.envoy, &pod, ip, "DRAINING", T);
    // What Envoy holds now is the new owner's: its snapshot has the pod draining.
    assert!(gen2.log().contains(&pod.uid));
    assert_eq!(
        api.patches("gen2"),
        0,
        "no startup taint on this node: nobody patches"
    );
    rig.pass();
}

#[test]
fn with_a_registrar_terminating_and_stale_pods_get_drain_marks_from_the_owner() {
    use aether_e2e::registrar::{Etcd, RegistrarProcess, apply_doc, dump, registrar_bin};
    let Some(etcd) = Etcd::start_or_skip(
        "with_a_registrar_terminating_and_stale_pods_get_drain_marks_from_the_owner",
    ) else {
        return;
    };
    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    // Two pods of this node are a service's endpoints at the registrar.
    let (terminating, stale) = (
        (pod_id(60), Ipv4Addr::new(10, 91, 6, 10)),
        (pod_id(61), Ipv4Addr::new(10, 91, 6, 11)),
    );
    let endpoints: Vec<Value> = [&terminating, &stale]
        .iter()
        .map(|(p, ip)| json!({ "address": ip.to_string(), "port": 8080, "node": "test-node", "pod": p.name }))
        .collect();
    let doc = json!({ "services": [{ "name": "web", "namespace": "default", "ports": [80], "endpoints": endpoints }] });
    apply_doc(
        registrar.addr(),
        &node.root.path().join("registry.json"),
        &doc,
    );
    let owner = node.start_agent_with(&[
        &format!("--registrar={}", registrar.addr()),
        &owner_kc,
        "--stale-record-grace=1s",
    ]);
    serving(&owner);
    let cni = cni(&node);
    for (p, _) in [&terminating, &stale] {
        api.put_pod(pod_object(p, "test-node"));
    }
    std::thread::scope(|s| {
        for (p, ip) in [&terminating, &stale] {
            let cni = &cni;
            s.spawn(move || cni.call("ADD", p, Some(*ip)).expect("ADD"));
        }
    });
    let marked = |ip: Ipv4Addr| {
        dump(registrar.addr())["marks"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| m["address"] == ip.to_string() && m["state"] == "draining")
    };
    assert!(!marked(terminating.1) && !marked(stale.1));

    // A deletion timestamp: the Terminating mark, and the registrar's drain mark.
    api.mark_pod_deleting(NS, &terminating.0.name);
    wait_for("the terminating pod's drain mark", T, || {
        marked(terminating.1).then_some(())
    });
    // A pod gone from the API with no DEL: collected after the grace, and marked.
    api.delete_pod(NS, &stale.0.name);
    wait_for("the stale pod's drain mark", T, || {
        marked(stale.1).then_some(())
    });
    assert!(record(&node, &stale.0.uid).is_none());
    assert_eq!(owner.log().matches("drain mark set").count(), 2);
    node.root.disable_cleanup(false);
}

// --- Show 2: stale records ------------------------------------------------------------

#[test]
fn a_stale_record_is_collected_after_the_grace_and_a_reused_ip_is_served_for_the_new_pod() {
    let Some(envoy) = envoy_or_skip(
        "a_stale_record_is_collected_after_the_grace_and_a_reused_ip_is_served_for_the_new_pod",
    ) else {
        return;
    };
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[]));
    let grace = Duration::from_secs(1);
    let mut rig = NodeRig::start_from(
        &envoy,
        AdsApi::Delta,
        None,
        &[&owner_kc, "--stale-record-grace=1s"],
    );
    let cni = cni(&rig.node);
    let pods: Vec<(PodId, Ipv4Addr)> = (0..3)
        .map(|i| (pod_id(10 + i), Ipv4Addr::new(10, 91, 1, 10 + i as u8)))
        .collect();
    for (p, ip) in &pods {
        api.put_pod(pod_object(p, "test-node"));
        cni.call("ADD", p, Some(*ip)).expect("ADD");
    }
    for (p, ip) in &pods {
        wait_health(&rig.envoy, p, *ip, "HEALTHY", T);
    }
    // Nothing is collected while the API server lists the pods.
    std::thread::sleep(grace + Duration::from_millis(500));
    assert_eq!(stored_uids(&rig.node).len(), 3);

    // Pod 0 is gone from the API and its DEL never came: collected after the grace.
    let (gone, _) = &pods[0];
    let deleted = Instant::now();
    api.delete_pod(NS, &gone.name);
    wait_for("the stale record to be removed", T, || {
        record(&rig.node, &gone.uid).is_none().then_some(())
    });
    let took = deleted.elapsed();
    assert!(
        took >= grace,
        "removed after {took:?}, before the {grace:?} grace"
    );
    wait_for("Envoy to drop the stale pod", T, || {
        inbound_health(&rig.envoy, gone).is_none().then_some(())
    });
    rig.owner.wait_log("stale pod record removed", T);
    eprintln!("API deletion to stale record removed: {took:?} (grace {grace:?})");

    // Pod 1's DEL is lost too, and its IP goes to a new pod before the grace is over:
    // the new pod's ADD evicts the old record and the new pod is served.
    let (old, reused) = &pods[1];
    api.delete_pod(NS, &old.name);
    let new = pod_id(20);
    api.put_pod(pod_object(&new, "test-node"));
    cni.call("ADD", &new, Some(*reused))
        .expect("ADD of the new pod on the reused IP");
    wait_health(&rig.envoy, &new, *reused, "HEALTHY", T);
    assert!(
        inbound_health(&rig.envoy, old).is_none(),
        "the old pod is still served"
    );
    assert!(record(&rig.node, &old.uid).is_none());
    rig.owner
        .wait_log("evicted an older pod record holding the new pod's IP", T);

    // Pod 2, still listed, was never touched.
    assert_eq!(
        stored_uids(&rig.node),
        vec![pods[2].0.uid.clone(), new.uid.clone()]
    );
    rig.pass();
}

// --- Show 3: the startup taint ----------------------------------------------------------

#[test]
fn the_taint_goes_only_once_the_owner_serves_and_envoy_acked_and_a_standby_never_patches() {
    let Some(envoy_bin) = envoy_or_skip(
        "the_taint_goes_only_once_the_owner_serves_and_envoy_acked_and_a_standby_never_patches",
    ) else {
        return;
    };
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let (gen1_kc, gen2_kc) = (kc.flag(&api, "gen1", true), kc.flag(&api, "gen2", true));
    let other = taint("node.kubernetes.io/not-ready");
    api.put_node(node_object("test-node", &[other.clone(), taint(TAINT)]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    let capture = capture_flag(&node);
    let mut gen1 = node.start_agent_with(&[&capture, &gen1_kc]);
    serving(&gen1);
    wait_for("the owner to watch its node", T, || {
        (api.watchers("nodes") >= 1).then_some(())
    });

    // Serving, but no proxy has ACKed anything: the taint stays.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        taint_keys(&api, "test-node"),
        ["node.kubernetes.io/not-ready", TAINT]
    );
    assert_eq!(api.patches("gen1"), 0);

    let envoy = start_envoy(&envoy_bin, &node);
    wait_for("the owner to remove the startup taint", T, || {
        (taint_keys(&api, "test-node") == ["node.kubernetes.io/not-ready"]).then_some(())
    });
    assert_eq!(api.patches("gen1"), 1, "one JSON patch");
    // The log line follows the patch's answer.
    gen1.wait_log("removed the node's startup taint", T);
    let log = gen1.log();
    assert!(at(&log, "serving the node") < at(&log, "the proxy ACKed its first snapshot"));
    assert!(
        at(&log, "the proxy ACKed its first snapshot")
            < at(&log, "removed the node's startup taint")
    );

    // A standby, with the taint back on the node, watches and never patches.
    let gen2 = node.start_agent_with(&[&capture, &gen2_kc]);
    gen2.wait_role("standby", T);
    wait_for("both generations to watch the node", T, || {
        (api.watchers("nodes") >= 2).then_some(())
    });
    api.put_node(node_object("test-node", &[taint(TAINT)]));
    wait_for("the owner to remove the re-applied taint", T, || {
        taint_keys(&api, "test-node").is_empty().then_some(())
    });
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(api.patches("gen2"), 0, "the standby patched the node");
    assert!(
        api.requests("gen2").iter().all(|r| !r.starts_with("PATCH")),
        "{:?}",
        api.requests("gen2")
    );

    // After the roll the new owner removes it, once Envoy ACKed it.
    gen1.signal(nix::sys::signal::Signal::SIGTERM);
    serving(&gen2);
    gen1.wait_exit(T);
    gen2.wait_log("the proxy ACKed its first snapshot", T);
    api.put_node(node_object("test-node", &[taint(TAINT)]));
    wait_for("the new owner to remove the taint", T, || {
        taint_keys(&api, "test-node").is_empty().then_some(())
    });
    assert_eq!(api.patches("gen2"), 1);
    drop(envoy);
    node.root.disable_cleanup(false);
}

#[test]
fn the_taint_removal_survives_a_conflicting_concurrent_patch() {
    let Some(envoy_bin) =
        envoy_or_skip("the_taint_removal_survives_a_conflicting_concurrent_patch")
    else {
        return;
    };
    let api = std::sync::Arc::new(KubeApi::start());
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    let other = taint("node.kubernetes.io/unreachable");
    api.put_node(node_object("test-node", &[other.clone(), taint(TAINT)]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    let capture = capture_flag(&node);
    let owner = node.start_agent_with(&[&capture, &owner_kc]);
    serving(&owner);
    wait_for("the owner to watch its node", T, || {
        (api.watchers("nodes") >= 1).then_some(())
    });

    // Another writer keeps changing the node's taints while the owner patches: a taint
    // comes and goes in front of the startup taint (which the writer puts back each time),
    // so the index the owner read is often stale by the time its patch arrives.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = std::thread::spawn({
        let (api, stop, other) = (api.clone(), stop.clone(), other.clone());
        move || {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                n += 1;
                let taints = if n.is_multiple_of(2) {
                    vec![other.clone(), taint(TAINT)]
                } else {
                    vec![taint(TAINT)]
                };
                api.put_node(node_object("test-node", &taints));
                std::thread::sleep(Duration::from_micros(200));
            }
            // It ends with the other taint in place and the startup taint behind it.
            api.put_node(node_object("test-node", &[other.clone(), taint(TAINT)]));
            n
        }
    });
    let envoy = start_envoy(&envoy_bin, &node);
    owner.wait_log(
        "the node's taints changed under the patch; reading the node again",
        T,
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let rewrites = writer.join().unwrap();
    wait_for("the owner to remove the startup taint", T, || {
        (taint_keys(&api, "test-node") == ["node.kubernetes.io/unreachable"]).then_some(())
    });
    let conflicts = owner
        .log()
        .matches("the node's taints changed under the patch")
        .count();
    eprintln!(
        "{rewrites} concurrent rewrites, {conflicts} conflicts, {} patches",
        api.patches("owner")
    );
    assert!(
        api.patches("owner") > conflicts,
        "a conflict, then a patch that removed it"
    );
    assert_eq!(
        api.node("test-node").unwrap()["spec"]["taints"],
        json!([other]),
        "the other taint is untouched"
    );
    drop(envoy);
    node.root.disable_cleanup(false);
}

// --- Show 4: watch restarts -------------------------------------------------------------

#[test]
fn after_a_410_the_agent_relists_and_ends_with_the_right_view() {
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    let owner = node.start_agent_with(&[&owner_kc, "--stale-record-grace=1s"]);
    serving(&owner);
    let cni = cni(&node);
    let pods: Vec<PodId> = (0..3).map(|i| pod_id(30 + i)).collect();
    for p in &pods {
        api.put_pod(pod_object(p, "test-node"));
    }
    // No proxy ACKs here: each ADD waits out its 2 s, so they run side by side.
    std::thread::scope(|s| {
        for (i, p) in pods.iter().enumerate() {
            let cni = &cni;
            s.spawn(move || {
                cni.call("ADD", p, Some(Ipv4Addr::new(10, 91, 2, 10 + i as u8)))
                    .expect("ADD")
            });
        }
    });
    wait_for("the pod watch", T, || {
        (api.watchers("pods") >= 1).then_some(())
    });
    let lists_before = pod_lists(&api, "owner");

    // While the agent cannot see it: pod 0 gets a deletion timestamp, pod 1 goes (its DEL
    // lost), and the history of both is forgotten.
    api.set_down(true);
    api.mark_pod_deleting(NS, &pods[0].name);
    api.delete_pod(NS, &pods[1].name);
    api.expire_history();
    api.set_down(false);

    owner.wait_log("Kubernetes watch history expired (410 Gone); relisting", T);
    wait_for("the Terminating mark from the relisted view", T, || {
        (record(&node, &pods[0].uid)?["terminating"] == true).then_some(())
    });
    wait_for("the stale record to go", T, || {
        record(&node, &pods[1].uid).is_none().then_some(())
    });
    assert_eq!(
        stored_uids(&node),
        vec![pods[0].uid.clone(), pods[2].uid.clone()]
    );
    assert_eq!(
        record(&node, &pods[2].uid).unwrap().get("terminating"),
        None
    );
    assert!(
        pod_lists(&api, "owner") > lists_before,
        "relisted: {:?}",
        api.requests("owner")
    );
    wait_for("the problem to clear", T, || {
        kube_problem(&owner).is_none().then_some(())
    });
    node.root.disable_cleanup(false);
}

/// The pod lists (not watches) `user` has sent.
fn pod_lists(api: &KubeApi, user: &str) -> usize {
    api.requests(user)
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
        .count()
}

#[test]
fn with_the_api_server_down_for_10s_the_agent_keeps_serving_and_catches_up() {
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    let owner = node.start_agent_with(&[&owner_kc]);
    serving(&owner);
    let cni = cni(&node);
    let (a, b) = (pod_id(40), pod_id(41));
    api.put_pod(pod_object(&a, "test-node"));
    cni.call("ADD", &a, Some(Ipv4Addr::new(10, 91, 3, 10)))
        .expect("ADD");
    wait_for("the pod watch", T, || {
        (api.watchers("pods") >= 1).then_some(())
    });
    let pid = owner.worker_pid();

    api.set_down(true);
    let down = Instant::now();
    wait_for("/ready to name the API server", T, || kube_problem(&owner));
    // It keeps serving: CNI calls work and /ready stays 200. (No proxy ACKs here, so the
    // ADD answers after its 2 s wait, meanwhile.)
    api.put_pod(pod_object(&b, "test-node"));
    let add = std::thread::spawn({
        let (cni, b) = (
            Cni {
                bin: cni.bin.clone(),
                socket: cni.socket.clone(),
            },
            b.clone(),
        );
        move || cni.call("ADD", &b, Some(Ipv4Addr::new(10, 91, 3, 11)))
    });
    api.mark_pod_deleting(NS, &a.name);
    let problem = kube_problem(&owner).expect("the problem");
    assert!(problem.contains("cannot reach the API server"), "{problem}");
    assert_eq!(owner.ready().expect("ready").0, 200);
    add.join()
        .unwrap()
        .expect("ADD while the API server is down");
    std::thread::sleep(Duration::from_secs(10).saturating_sub(down.elapsed()));
    assert!(
        record(&node, &a.uid).unwrap().get("terminating").is_none(),
        "nothing known while down"
    );

    api.set_down(false);
    let up = Instant::now();
    wait_for("the agent to catch up", T, || {
        (record(&node, &a.uid)?["terminating"] == true).then_some(())
    });
    wait_for("the problem to clear", T, || {
        kube_problem(&owner).is_none().then_some(())
    });
    eprintln!(
        "caught up {:?} after the API server came back",
        up.elapsed()
    );
    assert_eq!(owner.worker_pid(), pid, "the worker was never restarted");
    assert!(record(&node, &b.uid).is_some());
    node.root.disable_cleanup(false);
}

#[test]
fn a_403_is_a_clear_log_line_and_a_metric_and_no_crash_loop() {
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let denied_kc = kc.flag(&api, "denied", false);
    api.put_node(node_object("test-node", &[taint(TAINT)]));
    let mut node = LocalNode::new();
    node.root.disable_cleanup(true);
    let metrics = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("free port")
    );
    node.metrics = Some(metrics.parse().expect("a metrics address"));
    let owner = node.start_agent_with(&[&denied_kc]);
    // The API server is not a gate: the owner serves.
    serving(&owner);
    let pid = owner.worker_pid();
    owner.wait_log(
        "403 Forbidden: the API server denies `list pods` (fieldSelector spec.nodeName=test-node)",
        T,
    );
    owner.wait_log(
        "403 Forbidden: the API server denies `list nodes` (fieldSelector metadata.name=test-node)",
        T,
    );
    let problem = wait_for("/ready to name the 403", T, || {
        kube_problem(&owner).filter(|p| p.contains("403"))
    });
    assert!(
        problem.contains("pods: get, list, watch and nodes: get, list, watch, patch"),
        "{problem}"
    );
    let text = wait_for("the metric", T, || {
        let t = scrape_metrics(&metrics)?;
        t.contains(r#"aether_kube_watch_errors_total{resource="pods",reason="forbidden"}"#)
            .then_some(t)
    });
    assert!(
        text.contains(r#"aether_kube_connected{resource="pods"} 0"#),
        "{text}"
    );

    // No crash loop: the same worker a while later, its retries backed off.
    let cni = cni(&node);
    cni.call("ADD", &pod_id(50), Some(Ipv4Addr::new(10, 91, 4, 10)))
        .expect("ADD without API access");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(owner.worker_pid(), pid);
    let lists = api
        .requests("denied")
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/pods?"))
        .count();
    assert!(
        (2..=20).contains(&lists),
        "{lists} pod lists in ~4 s: the retries do not back off"
    );
    assert!(
        !owner.log().contains("worker exited unexpectedly"),
        "{}",
        owner.log()
    );
    assert_eq!(
        taint_keys(&api, "test-node"),
        [TAINT],
        "nothing was patched"
    );
    node.root.disable_cleanup(false);
}

// ---- SVIDs only for pods the API server places here -----------------------------------

/// The pods of `provider` with an open SVID stream.
fn subscribed(provider: &aether_e2e::identity::IdentityProvider) -> Vec<String> {
    provider
        .subscriptions()
        .into_iter()
        .filter(|(_, streams)| *streams > 0)
        .map(|(uid, _)| uid)
        .collect()
}

/// The `namespace/name`s of one of `/ready`'s identity lists (`pods_deferred`,
/// `pods_refused`).
fn listed(agent: &Agent, list: &str) -> Vec<String> {
    let Some((_, v)) = agent.ready() else {
        return vec![];
    };
    let mut names: Vec<String> = v["identity"][list]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["pod"].as_str().map(String::from))
        .collect();
    names.sort();
    names
}

/// One run with the test API server, whose pods follow the kubelet's order: the pod
/// exists with its node at the ADD, and its podIP appears about a second after the ADD
/// returns.
/// - placed: listed here before its ADD, its podIP written 1 s after: gets its SVID (the
///   positive control);
/// - unlisted (no pod object anywhere) and elsewhere (listed on another node): their ADDs
///   succeed, no SVID stream is ever opened, and `/ready` lists them as deferred;
/// - wrong-ip: listed here, subscribed at its ADD, then its podIP is written as another
///   address: its stream closes, its certificate leaves Envoy, `/ready` lists it refused;
/// - late: its ADD comes before the API server lists it; once listed it gets its SVID,
///   and keeps it when its podIP is written 2 s later.
#[test]
fn svids_go_only_to_pods_the_api_server_places_on_this_node() {
    let Some(envoy) = envoy_or_skip("svids_go_only_to_pods_the_api_server_places_on_this_node")
    else {
        return;
    };
    let api = KubeApi::start();
    let kc = Kubeconfigs::new();
    let owner_kc = kc.flag(&api, "owner", true);
    api.put_node(node_object("test-node", &[]));
    let (_idp_dir, idp) = identity_provider_for_agents("example.org");
    let mut args = identity_args(&idp, "permissive");
    args.push(owner_kc);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rig = NodeRig::start_from(&envoy, AdsApi::Delta, None, &args);
    let cni = cni(&rig.node);
    let ip = |n: u8| Ipv4Addr::new(10, 92, 0, n);
    let (placed, unlisted, elsewhere, wrong_ip, late) =
        (pod_id(11), pod_id(12), pod_id(13), pod_id(14), pod_id(15));

    api.put_pod(pod_object(&placed, "test-node"));
    api.put_pod(pod_object(&elsewhere, "other-node"));
    api.put_pod(pod_object(&wrong_ip, "test-node"));
    for (p, n) in [
        (&placed, 11),
        (&unlisted, 12),
        (&elsewhere, 13),
        (&wrong_ip, 14),
        (&late, 15),
    ] {
        cni.call("ADD", p, Some(ip(n)))
            .unwrap_or_else(|e| panic!("ADD of {}: {e}\n{}", p.name, rig.where_to_look()));
    }
    // The kubelet writes the podIPs after the ADDs return.
    std::thread::sleep(Duration::from_secs(1));
    api.set_pod_ips(NS, &placed.name, &[ip(11).into()]);
    api.set_pod_ips(NS, &wrong_ip.name, &[ip(99).into()]);

    let serial_in_envoy = |p: &PodId| {
        let serial = idp.serial_of_pod(&p.uid)?;
        let serials = aether_e2e::harness::identity::envoy_serials(&rig.envoy).ok()?;
        Some(serials.contains(&serial))
    };
    wait_for("the placed pod's certificate in Envoy", T, || {
        (serial_in_envoy(&placed) == Some(true)).then_some(())
    });
    let mut last = (vec![], vec![], vec![]);
    try_wait_for("the cross-check's verdicts in /ready", T, || {
        last = (
            subscribed(&idp),
            listed(&rig.owner, "pods_deferred"),
            listed(&rig.owner, "pods_refused"),
        );
        let want = (
            vec![placed.uid.clone()],
            vec![
                format!("{NS}/{}", unlisted.name),
                format!("{NS}/{}", elsewhere.name),
                format!("{NS}/{}", late.name),
            ],
            vec![format!("{NS}/{}", wrong_ip.name)],
        );
        (last == want).then_some(())
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}: (subscribed, deferred, refused) = {last:?}\n{}",
            rig.where_to_look()
        )
    });
    let v = rig.owner.ready().expect("/ready").1;
    assert_eq!(v["identity"]["pods_deferred_count"], 3, "{v:#}");
    assert_eq!(v["identity"]["pods_refused_count"], 1, "{v:#}");
    let why = v["identity"]["pods_refused"][0]["why"]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.contains("10.92.0.99") && why.contains("10.92.0.14"),
        "{why}"
    );
    for p in [&unlisted, &elsewhere, &late] {
        assert_eq!(idp.serial_of_pod(&p.uid), None, "{}: subscribed", p.name);
    }
    // wrong-ip was subscribed at its ADD (listed, no podIP yet), and no longer is: its
    // certificate is out of Envoy.
    assert!(
        idp.serial_of_pod(&wrong_ip.uid).is_some(),
        "wrong-ip was never subscribed"
    );
    wait_for("wrong-ip's certificate out of Envoy", T, || {
        (serial_in_envoy(&wrong_ip) == Some(false)).then_some(())
    });
    // The late pod: listed now, its SVID follows; its podIP 2 s later keeps it.
    let listed_at = Instant::now();
    api.put_pod(pod_object(&late, "test-node"));
    wait_for("the late pod's certificate in Envoy", T, || {
        (serial_in_envoy(&late) == Some(true)).then_some(())
    });
    eprintln!(
        "late pod listed to its certificate in Envoy: {:?}",
        listed_at.elapsed()
    );
    std::thread::sleep(Duration::from_secs(2).saturating_sub(listed_at.elapsed()));
    api.set_pod_ips(NS, &late.name, &[ip(15).into()]);
    wait_for("the late pod no longer deferred", T, || {
        (!listed(&rig.owner, "pods_deferred").contains(&format!("{NS}/{}", late.name)))
            .then_some(())
    });
    assert!(subscribed(&idp).contains(&late.uid));
    assert_eq!(serial_in_envoy(&late), Some(true));
    assert_eq!(
        listed(&rig.owner, "pods_refused"),
        vec![format!("{NS}/{}", wrong_ip.name)]
    );
    rig.pass();
}
