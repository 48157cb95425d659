//! The agent and the registrar together: real etcd, the real `aether-registrar` and the
//! real agent binaries (and a real Envoy where a test compares what the proxy got).
//!
//! Each test skips, saying so, where etcd is not installed (`scripts/test.sh` installs it).

use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::registrar::{
    Etcd, RegistrarProcess, TestCa, apply_doc, apply_with, dump, envoy_eds, expected_eds,
    registrar_bin,
};
use aether_e2e::testing::{Agent, LocalNode, bin, wait_for};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(15);

fn registry(services: &[(&str, &[(&str, &str)])]) -> Value {
    let services: Vec<Value> = services
        .iter()
        .map(|(name, eps)| {
            let endpoints: Vec<Value> =
                eps.iter().map(|(addr, node)| json!({ "address": addr, "port": 8080, "node": node, "pod": format!("{name}-{addr}") })).collect();
            json!({ "name": name, "namespace": "default", "ports": [80], "endpoints": endpoints })
        })
        .collect();
    json!({ "services": services })
}

/// `/ready`'s registrar section: (revision, full views).
fn registrar_view(a: &Agent) -> Option<(i64, u64)> {
    let (_, v) = a.ready()?;
    Some((
        v["registrar"]["revision"].as_i64()?,
        v["registrar"]["full_views"].as_u64()?,
    ))
}

fn wait_revision(a: &Agent, at_least: i64) -> (i64, u64) {
    wait_for(
        &format!("{} to reach registrar revision {at_least}", a.name),
        T,
        || registrar_view(a).filter(|(r, _)| *r >= at_least),
    )
}

fn count(log: &str, needle: &str) -> usize {
    log.matches(needle).count()
}

#[test]
fn owner_and_standby_each_keep_their_own_watch_through_the_overlap() {
    let Some(etcd) =
        Etcd::start_or_skip("owner_and_standby_each_keep_their_own_watch_through_the_overlap")
    else {
        return;
    };
    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    let rev = apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b")])]),
    );
    let flag = format!("--registrar={}", registrar.addr());
    let owner = node.start_agent_with(&[&flag]);
    owner.wait_role("owner", T);
    let standby = node.start_agent_with(&[&flag]);
    standby.wait_role("standby", T);
    // A change during the overlap reaches both over their own streams.
    let rev2 = apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b"), ("10.1.0.2", "node-b")])]),
    );
    assert!(rev2 > rev);
    for a in [&owner, &standby] {
        let (_, full_views) = wait_revision(a, rev2);
        assert_eq!(
            full_views, 1,
            "{}: one full view, then changes only",
            a.name
        );
        assert_eq!(
            count(&a.log(), "registrar stream open"),
            1,
            "{} reconnected during the overlap:\n{}",
            a.name,
            a.log()
        );
    }
    assert_eq!(
        count(&registrar.log(), "replace"),
        0,
        "a stream was replaced:\n{}",
        registrar.log()
    );

    // The owner and the standby go, so that their node's two streams (the most one node
    // may have) are closed before the next two agents of the same node come.
    drop((owner, standby));
    wait_for("both streams to close at the registrar", T, || {
        (count(&registrar.log(), "watch stream closed by the client") >= 2).then_some(())
    });

    // Two agents with an empty instance share the old key (cluster, node): each new
    // stream replaces the other's, as before the instance field.
    let mut a = LocalNode::new();
    let mut b = LocalNode::new();
    let old_a = a.start_agent_with(&[&flag, "--pod-name="]);
    wait_revision(&old_a, rev2);
    let old_b = b.start_agent_with(&[&flag, "--pod-name="]);
    wait_revision(&old_b, rev2);
    registrar.wait_log("replaced by a newer stream", T);
    drop((old_a, old_b));
}

#[test]
fn a_restarted_registrar_is_resumed_and_a_compacted_history_ends_in_a_full_view_equal_to_the_registrar()
 {
    let Some(envoy) = envoy_or_skip("a_restarted_registrar_is_resumed...") else {
        return;
    };
    let Some(etcd) = Etcd::start_or_skip("a_restarted_registrar_is_resumed...") else {
        return;
    };
    // The rig registers its loopback upstreams at the registrar.
    let mut registrar = RegistrarProcess::tcp(
        &registrar_bin(),
        &etcd.endpoints(),
        &["--allow-loopback-endpoints"],
    );
    let mut rig = NodeRig::start_from(&envoy, AdsApi::Delta, Some(registrar.addr()), &[]);
    let file = rig.node.root.path().join("more.json");
    let eds_equal = |rig: &NodeRig, addr: &str, what: &str| {
        let want = expected_eds(&dump(addr));
        assert!(
            want.values().any(|eps| !eps.is_empty()),
            "the registrar holds endpoints: {want:?}"
        );
        let mut got = Default::default();
        aether_e2e::testing::try_wait_for(what, T, || {
            got = envoy_eds(
                &serde_json::from_str(&rig.envoy.get("/config_dump?include_eds").ok()?.1).ok()?,
            );
            (got == want).then_some(())
        })
        .unwrap_or_else(|_| {
            panic!(
                "{what}: Envoy's EDS {got:#?}\nthe registrar's {want:#?}\n{}",
                rig.where_to_look()
            )
        });
    };
    eds_equal(
        &rig,
        registrar.addr(),
        "Envoy's EDS to equal the registrar's view",
    );

    // The registrar restarts mid-stream: the agent resumes from its revision.
    registrar.kill();
    registrar.restart();
    let rev = apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("api", &[("10.2.0.1", "node-b")])]),
    );
    let (_, full_views) = wait_revision(&rig.owner, rev);
    assert_eq!(
        full_views,
        1,
        "a restarted registrar must not cost a full resync:\n{}",
        rig.owner.log()
    );
    eds_equal(
        &rig,
        registrar.addr(),
        "Envoy's EDS after the registrar restart",
    );

    // Down again; meanwhile the registry changes and etcd compacts past the agent.
    registrar.kill();
    let other = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut last = 0;
    for i in 0..5 {
        last = apply_doc(
            other.addr(),
            &file,
            &registry(&[(
                "api",
                &[("10.2.0.1", "node-b"), (&format!("10.2.1.{i}"), "node-b")],
            )]),
        );
    }
    compact(&etcd.endpoints(), last);
    registrar.restart();
    let (_, full_views) = wait_revision(&rig.owner, last);
    assert_eq!(
        full_views,
        2,
        "a compacted history ends in one full view again:\n{}",
        rig.owner.log()
    );
    rig.owner.wait_log("resync", T);
    eds_equal(&rig, registrar.addr(), "Envoy's EDS after the resync");
    rig.pass();
}

/// Compacts etcd's history up to `revision`, as an operator's or etcd's own compaction.
fn compact(endpoints: &str, revision: i64) {
    let eps: Vec<String> = endpoints.split(',').map(String::from).collect();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let mut c = etcd_client::Client::connect(eps, None)
                .await
                .expect("connect to etcd");
            c.compact(revision, None).await.expect("compact etcd");
        });
}

#[test]
fn a_standby_stays_not_ready_while_the_registrar_is_down_and_completes_within_2s_of_its_return() {
    let Some(etcd) = Etcd::start_or_skip("a_standby_stays_not_ready...") else {
        return;
    };
    let mut registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b")])]),
    );
    let flag = format!("--registrar={}", registrar.addr());
    let owner = node.start_agent_with(&[&flag]);
    owner.wait_role("owner", T);
    let sockets = node.socket_inodes();
    registrar.kill();
    let standby = node.start_agent_with(&[&flag]);
    // Not ready, visibly, for as long as the registrar is away.
    let body = wait_for("the standby to report the registrar problem", T, || {
        standby.ready().filter(|(_, v)| {
            v["problems"]
                .as_array()
                .is_some_and(|p| p.iter().any(|p| p["source"] == "registrar"))
        })
    });
    assert_eq!(body.0, 503, "{}", body.1);
    assert!(
        body.1["waiting_for"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w == "registry"),
        "{}",
        body.1
    );
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        let (status, v) = standby.ready().expect("the standby answers /ready");
        assert_eq!(
            status, 503,
            "a standby without its registry must not be ready: {v}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(node.socket_inodes(), sockets, "the standby bound nothing");
    assert!(
        owner.serving_owner().is_some(),
        "the owner keeps serving from what it has"
    );
    registrar.restart();
    let back = Instant::now();
    wait_for(
        "the standby to become ready once the registrar is back",
        T,
        || standby.ready().filter(|(s, _)| *s == 200),
    );
    let took = back.elapsed();
    eprintln!("standby complete {took:?} after the registrar came back");
    assert!(
        took <= Duration::from_secs(2),
        "the standby took {took:?} (bound 2 s)"
    );
}

#[test]
fn a_lone_agent_serves_after_the_15s_gate_without_the_registrar_then_loads_it() {
    let Some(etcd) = Etcd::start_or_skip("a_lone_agent_serves_after_the_15s_gate...") else {
        return;
    };
    let mut registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    let rev = apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b")])]),
    );
    registrar.kill();
    let start = Instant::now();
    let agent = node.start_agent_with(&[&format!("--registrar={}", registrar.addr())]);
    let body = wait_for(
        "the lone agent to serve without its registry",
        Duration::from_secs(25),
        || agent.serving_owner(),
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(14),
        "served after {took:?}, before the 15 s registry gate: {body}"
    );
    assert!(
        body["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["source"] == "registrar"),
        "{body}"
    );
    agent.wait_log("first-serve gate timed out", T);
    registrar.restart();
    wait_revision(&agent, rev);
    let body = agent.serving_owner().expect("still serving");
    assert!(
        body["problems"].as_array().unwrap().is_empty(),
        "the problem clears once loaded: {body}"
    );
}

fn cni(node: &LocalNode) -> Cni {
    Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    }
}

/// The registrar's marks, as `dump` lists them.
fn marks(addr: &str) -> Vec<Value> {
    dump(addr)["marks"].as_array().cloned().unwrap_or_default()
}

#[test]
fn drain_marks_from_an_owner_and_its_successor_leave_one_state_and_twenty_rolls_deregister_nothing()
{
    let Some(etcd) = Etcd::start_or_skip("drain_marks_from_an_owner_and_its_successor...") else {
        return;
    };
    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    // Two pods of this node (`test-node`, as LocalNode names it) and one of another node.
    let ip = Ipv4Addr::new(10, 77, 0, 5);
    let foreign = Ipv4Addr::new(10, 77, 0, 9);
    apply_doc(
        registrar.addr(),
        &file,
        &registry(&[
            (
                "web",
                &[("10.77.0.5", "test-node"), ("10.77.0.6", "test-node")],
            ),
            ("db", &[("10.77.0.9", "node-b")]),
        ]),
    );
    let flag = format!("--registrar={}", registrar.addr());
    let mut owner = node.start_agent_with(&[&flag]);
    owner.wait_role("owner", T);
    let before = dump(registrar.addr());
    let pod = PodId {
        uid: "mark-pod-uid".into(),
        name: "mark-pod".into(),
    };
    let cni = cni(&node);

    // The owner's DEL sets the mark.
    cni.call("ADD", &pod, Some(ip)).expect("ADD");
    cni.call("DEL", &pod, None).expect("DEL");
    let first = wait_for("the owner's drain mark", T, || {
        let m = marks(registrar.addr());
        (m.len() == 1).then_some(m)
    });
    assert_eq!(first[0]["address"], "10.77.0.5", "{first:?}");
    assert_eq!(first[0]["state"], "draining", "{first:?}");

    // A surge roll; the successor gets the same pod's DEL again (a runtime retry).
    let next = node.start_agent_with(&[&flag]);
    next.wait_role("standby", T);
    owner.signal(Signal::SIGTERM);
    owner.wait_exit(T);
    next.wait_role("owner", T);
    cni.call("ADD", &pod, Some(ip))
        .expect("ADD on the successor");
    cni.call("DEL", &pod, None).expect("DEL on the successor");
    next.wait_log("drain mark set", T);
    let second = marks(registrar.addr());
    assert_eq!(
        second.len(),
        1,
        "two writers of one mark leave one state: {second:?}"
    );
    assert_eq!(second[0]["state"], "draining");

    // A pod of this node at another node's endpoint address: the mark is refused, logged.
    let stray = PodId {
        uid: "stray-pod-uid".into(),
        name: "stray-pod".into(),
    };
    cni.call("ADD", &stray, Some(foreign)).expect("ADD");
    cni.call("DEL", &stray, None).expect("DEL");
    next.wait_log("drain mark refused by the registrar", T);
    registrar.wait_log("10.77.0.9", T);
    assert_eq!(
        marks(registrar.addr()).len(),
        1,
        "the refused mark changed nothing"
    );

    // Twenty surge rolls deregister nothing.
    let view = dump(registrar.addr());
    let mut current = next;
    for roll in 0..20 {
        let standby = node.start_agent_with(&[&flag]);
        standby.wait_role("standby", T);
        current.signal(Signal::SIGTERM);
        current.wait_exit(T);
        standby.wait_role("owner", T);
        assert_eq!(
            dump(registrar.addr()),
            view,
            "roll {roll} changed the registrar's view"
        );
        current = standby;
    }
    assert_ne!(before, view, "the mark is in the view the rolls kept");
}

/// A DEL's drain mark outlives the owner that answered the DEL: with the registrar down,
/// the owner answers a pod's DEL, keeps the mark on disk (`<state-dir>/drain-marks/`) and
/// dies by SIGKILL, worker and supervisor, before it could write it; the next owner writes
/// it once the registrar is back, and forgets it then.
#[test]
fn a_drain_mark_outlives_the_owner_that_answered_the_del() {
    let Some(etcd) = Etcd::start_or_skip("a_drain_mark_outlives_the_owner...") else {
        return;
    };
    let mut registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    apply_doc(
        registrar.addr(),
        &file,
        &registry(&[("web", &[("10.77.0.5", "test-node")])]),
    );
    let flag = format!("--registrar={}", registrar.addr());
    let mut owner = node.start_agent_with(&[&flag]);
    owner.wait_role("owner", T);
    let pod = PodId {
        uid: "kept-mark-uid".into(),
        name: "kept-mark".into(),
    };
    let cni = cni(&node);
    cni.call("ADD", &pod, Some(Ipv4Addr::new(10, 77, 0, 5)))
        .expect("ADD");

    registrar.kill();
    cni.call("DEL", &pod, None)
        .expect("DEL with the registrar down");
    let kept = node.state_dir.join("drain-marks").join("10.77.0.5");
    assert!(
        kept.exists(),
        "the DEL was answered with its mark on disk at {}",
        kept.display()
    );
    owner.wait_log("drain mark", T);
    owner.kill_generation();

    registrar.restart();
    assert!(
        marks(registrar.addr()).is_empty(),
        "nothing wrote the mark before the next owner"
    );
    let next = node.start_agent_with(&[&flag]);
    next.wait_role("owner", T);
    next.wait_log("the marks a previous owner answered DELs for", T);
    let m = wait_for("the next owner to write the kept mark", T, || {
        let m = marks(registrar.addr());
        (m.len() == 1).then_some(m)
    });
    assert_eq!(m[0]["address"], "10.77.0.5", "{m:?}");
    assert_eq!(m[0]["state"], "draining", "{m:?}");
    wait_for("the written mark to leave the folder", T, || {
        (!kept.exists()).then_some(())
    });
}

#[test]
fn an_agent_given_two_registrar_replicas_resumes_on_the_other_without_a_full_resync() {
    let Some(etcd) = Etcd::start_or_skip("an_agent_given_two_registrar_replicas...") else {
        return;
    };
    let mut r1 = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let r2 = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    apply_doc(
        r1.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b")])]),
    );
    let agent = node.start_agent_with(&[&format!("--registrar={},{}", r1.addr(), r2.addr())]);
    agent.wait_role("owner", T);
    r1.wait_log("watch stream opened", T);
    r1.kill();
    let rev = apply_doc(
        r2.addr(),
        &file,
        &registry(&[("web", &[("10.1.0.1", "node-b"), ("10.1.0.3", "node-b")])]),
    );
    let (_, full_views) = wait_revision(&agent, rev);
    assert_eq!(
        full_views,
        1,
        "resumed on the other replica without a full view:\n{}",
        agent.log()
    );
    assert_eq!(
        count(&agent.log(), "registrar stream open"),
        2,
        "{}",
        agent.log()
    );
}

#[test]
fn over_tcp_with_token_review_a_token_speaks_for_its_own_node_only() {
    use aether_e2e::kube_api::{KubeApi, Rule};
    let Some(etcd) = Etcd::start_or_skip("over_tcp_with_token_review...") else {
        return;
    };
    let api = KubeApi::start();
    let (registrar_sa, agent_sa) = (
        "system:serviceaccount:aether-system:aether-registrar",
        "system:serviceaccount:aether-system:aether-agent",
    );
    api.grant(
        registrar_sa,
        &[Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(agent_sa, "test-node");
    let mut node = LocalNode::new();
    let token_file = |user: &str| {
        let path = node
            .root
            .path()
            .join(format!("token-{}", user.replace(':', "_")));
        std::fs::write(&path, api.token(user)).unwrap();
        // The worker (uid 65532 when the test runs as root) reads the agent's.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path.display().to_string()
    };
    let (agent_token, ops_token) = (token_file(agent_sa), token_file("ops@example"));
    let listen = format!(
        "127.0.0.1:{}",
        aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap()
    );
    let kubeconfig = api.kubeconfig(registrar_sa).display().to_string();
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--token-review",
            "--kubeconfig",
            &kubeconfig,
            "--discovery",
            "off",
            "--agent-service-account",
            "aether-system/aether-agent",
            "--operator-user",
            "ops@example",
        ],
    );
    let file = node.root.path().join("registry.json");
    std::fs::write(
        &file,
        registry(&[
            ("web", &[("10.77.0.5", "test-node")]),
            ("db", &[("10.77.0.9", "node-b")]),
        ])
        .to_string(),
    )
    .unwrap();
    let apply = |token: Option<&str>| {
        let mut args = vec![
            "apply",
            "--registrar",
            registrar.addr(),
            "--file",
            file.to_str().unwrap(),
        ];
        args.extend(token.map(|t| ["--token-file", t]).into_iter().flatten());
        std::process::Command::new(registrar_bin())
            .args(&args)
            .output()
            .unwrap()
    };
    // Operators apply; no token, or an agent's, may not.
    let out = apply(None);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Unauthenticated"),
        "{out:?}"
    );
    let out = apply(Some(&agent_token));
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("PermissionDenied"),
        "{out:?}"
    );
    let out = apply(Some(&ops_token));
    assert!(out.status.success(), "{out:?}");

    // The agent on its token's node loads the registry and sets its pods' drain marks.
    let flags = [
        format!("--registrar={}", registrar.addr()),
        format!("--registrar-token-file={agent_token}"),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = node.start_agent_with(&flags);
    agent.wait_role("owner", T);
    wait_revision(&agent, 1);
    let cni = cni(&node);
    let pod = PodId {
        uid: "token-pod-uid".into(),
        name: "token-pod".into(),
    };
    cni.call("ADD", &pod, Some(Ipv4Addr::new(10, 77, 0, 5)))
        .expect("ADD");
    cni.call("DEL", &pod, None).expect("DEL");
    agent.wait_log("drain mark set", T);
    let dumped: Value = serde_json::from_str(&aether_e2e::registrar::cli(&[
        "dump",
        "--registrar",
        registrar.addr(),
        "--token-file",
        &ops_token,
    ]))
    .unwrap();
    assert_eq!(
        dumped["marks"].as_array().map(Vec::len),
        Some(1),
        "{dumped}"
    );

    // The same token on another node's agent: its watch is refused, and it says why.
    let mut other = LocalNode::new();
    other.node_name = "node-b".into();
    let stray = other.start_agent_with(&flags);
    let body = wait_for("the other node's agent to report the refusal", T, || {
        stray
            .ready()
            .filter(|(_, v)| v["problems"].to_string().contains("bound to node"))
    });
    assert_eq!(
        body.1["registrar"]["revision"].as_i64().unwrap_or(0),
        0,
        "it loaded nothing: {}",
        body.1
    );
    registrar.wait_log("bound to node", T);
}

/// `--registrar-ca`: the agent speaks TLS to a registrar serving `--tls-cert`, checks its
/// certificate against the CA in the file, and loads the registry through it. An agent
/// trusting another CA, or none, loads nothing and says why on `/ready`; a CA file that
/// cannot be read stops the worker's start, naming the file.
#[test]
fn over_tls_an_agent_trusting_the_registrars_ca_loads_the_registry_and_one_trusting_another_says_why()
 {
    use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
    let Some(etcd) = Etcd::start_or_skip("over_tls_an_agent_trusting_the_registrars_ca...") else {
        return;
    };
    let (ca, other_ca) = (TestCa::new("registrar CA"), TestCa::new("another CA"));
    let (cert, key) = ca.leaf("registrar", &["127.0.0.1"], ServerAuth);
    let registrar = RegistrarProcess::tcp(
        &registrar_bin(),
        &etcd.endpoints(),
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    // Each node's copy of a CA where its worker (uid 65532 under root) can read it.
    let ca_copy = |node: &LocalNode, ca: &TestCa| {
        let path = node.root.path().join("registrar-ca.crt");
        std::fs::copy(ca.ca_file(), &path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path.display().to_string()
    };
    let mut node = LocalNode::new();
    let file = node.root.path().join("registry.json");
    std::fs::write(
        &file,
        registry(&[("web", &[("10.1.0.1", "node-b")])]).to_string(),
    )
    .unwrap();
    let rev = apply_with(
        registrar.addr(),
        &file,
        &["--ca", ca.ca_file().to_str().unwrap()],
    );
    let flags = [
        format!("--registrar={}", registrar.addr()),
        format!("--registrar-ca={}", ca_copy(&node, &ca)),
    ];
    let agent = node.start_agent_with(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    agent.wait_role("owner", T);
    wait_revision(&agent, rev);
    agent.wait_log("registrar stream open", T);

    let mut other = LocalNode::new();
    other.node_name = "node-b".into();
    let flags = [
        format!("--registrar={}", registrar.addr()),
        format!("--registrar-ca={}", ca_copy(&other, &other_ca)),
    ];
    let stray = other.start_agent_with(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    let (_, body) = wait_for(
        "the agent trusting another CA to report the refusal",
        T,
        || {
            stray
                .ready()
                .filter(|(_, v)| v["problems"].to_string().contains("UnknownIssuer"))
        },
    );
    eprintln!("the refused agent's /ready problems: {}", body["problems"]);
    assert_eq!(
        body["registrar"]["revision"].as_i64().unwrap_or(0),
        0,
        "it loaded nothing: {body}"
    );
    registrar.wait_log("TLS handshake failed", T);

    // No CA at all: plain HTTP/2 to the TLS port, which the problem names.
    let mut plain = LocalNode::new();
    plain.node_name = "node-d".into();
    let unverified = plain.start_agent_with(&[&format!("--registrar={}", registrar.addr())]);
    wait_for(
        "the agent without a CA to name the flag it lacks",
        T,
        || {
            unverified
                .ready()
                .filter(|(_, v)| v["problems"].to_string().contains("set --registrar-ca"))
        },
    );
    registrar.wait_log("the peer does not speak TLS", T);

    let mut third = LocalNode::new();
    third.node_name = "node-c".into();
    let missing = third.root.path().join("no-such-ca.crt");
    let flags = [
        format!("--registrar={}", registrar.addr()),
        format!("--registrar-ca={}", missing.display()),
    ];
    let broken = third.start_agent_with(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    broken.wait_log(&format!("--registrar-ca: {}", missing.display()), T);
}

/// A JWT-shaped token whose unverified claims name `aud`, signed by nobody.
fn forged_jwt(aud: &str, n: u32) -> String {
    use base64::Engine;
    let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    format!(
        "{}.{}.forged{n}",
        b64(json!({"alg": "RS256"})),
        b64(json!({"aud": [aud], "sub": "mallory", "exp": 4_000_000_000u64}))
    )
}

/// `--token-review` under a flood of tokens from one address: tokens that are not JWTs,
/// or whose claims name another audience, cost no TokenReview; an agent's token is
/// reviewed once and then answered from the cache; a refused token asked again is
/// answered from the cache; past the source's burst a new token is RESOURCE_EXHAUSTED
/// without a review. A megabyte apply with a made-up token is refused UNAUTHENTICATED,
/// its body never read. The API server counts the reviews; the registrar counts each
/// outcome.
#[test]
fn token_reviews_are_spent_only_on_plausible_tokens_and_bounded_per_source() {
    use aether_e2e::kube_api::{KubeApi, Rule};
    use shared_proto::registry::{self as pb, registry_client::RegistryClient};
    let Some(etcd) = Etcd::start_or_skip("token_reviews_are_spent_only_on_plausible_tokens...")
    else {
        return;
    };
    let api = KubeApi::start();
    let (registrar_sa, agent_sa) = (
        "system:serviceaccount:aether-system:aether-registrar",
        "system:serviceaccount:aether-system:aether-agent",
    );
    api.grant(
        registrar_sa,
        &[Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(agent_sa, "test-node");
    let listen = format!(
        "127.0.0.1:{}",
        aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap()
    );
    let metrics_addr = format!(
        "127.0.0.1:{}",
        aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap()
    );
    let kubeconfig = api.kubeconfig(registrar_sa).display().to_string();
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--token-review",
            "--kubeconfig",
            &kubeconfig,
            "--discovery",
            "off",
            "--agent-service-account",
            "aether-system/aether-agent",
            "--metrics-addr",
            &metrics_addr,
            // A burst of three and next to no refill within the test.
            "--token-reviews-per-source",
            "0.001",
            "--token-review-burst",
            "3",
        ],
    );
    let reviews = || {
        api.requests(registrar_sa)
            .iter()
            .filter(|r| r.starts_with("POST /apis/authentication.k8s.io/v1/tokenreviews"))
            .count()
    };
    let agent_token = api.token(agent_sa);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = format!("http://{}", registrar.addr());
    let call = |token: &str| {
        let (addr, token) = (addr.clone(), format!("Bearer {token}"));
        rt.block_on(async move {
            let channel = tonic::transport::Endpoint::from_shared(addr)
                .unwrap()
                .connect()
                .await
                .unwrap();
            let mut c =
                RegistryClient::with_interceptor(channel, move |mut req: tonic::Request<()>| {
                    req.metadata_mut()
                        .insert("authorization", token.parse().unwrap());
                    Ok(req)
                });
            c.watch_endpoints(pb::WatchEndpointsRequest {
                node: "test-node".into(),
                instance: "i".into(),
                ..Default::default()
            })
            .await
            .map(|_| ())
        })
    };
    let code = |r: Result<(), tonic::Status>| r.err().map_or(tonic::Code::Ok, |s| s.code());

    // The agent's token: one review, then the cache.
    for _ in 0..5 {
        assert_eq!(code(call(&agent_token)), tonic::Code::Ok);
    }
    assert_eq!(reviews(), 1);
    // Not JWTs, or for another audience: refused without a review.
    for i in 0..20 {
        let e = call(&format!("random-token-{i}")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("not a JWT"), "{e:?}");
    }
    let e = call(&forged_jwt("https://kubernetes.default.svc", 0)).unwrap_err();
    assert!(
        e.code() == tonic::Code::Unauthenticated && e.message().contains("audience"),
        "{e:?}"
    );
    assert_eq!(reviews(), 1);
    // Plausible forgeries are reviewed and refused, up to the burst; asked again, the
    // refusal comes from the cache; past the burst, no review at all.
    for i in 1..=2 {
        let e = call(&forged_jwt("aether-registrar", i)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    }
    assert_eq!(reviews(), 3);
    assert_eq!(
        code(call(&forged_jwt("aether-registrar", 1))),
        tonic::Code::Unauthenticated
    );
    assert_eq!(reviews(), 3);
    let e = call(&forged_jwt("aether-registrar", 3)).unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert_eq!(reviews(), 3);
    registrar.wait_log("too many token reviews from this address", T);

    // A megabyte apply under a made-up token: refused before its body is read.
    let big = rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut c = RegistryClient::with_interceptor(channel, |mut req: tonic::Request<()>| {
            req.metadata_mut()
                .insert("authorization", "Bearer made-up".parse().unwrap());
            Ok(req)
        });
        let vip = "x".repeat(1 << 20);
        c.apply_services(pb::ApplyServicesRequest {
            services: vec![pb::Service {
                vip,
                ..Default::default()
            }],
        })
        .await
    });
    assert_eq!(big.unwrap_err().code(), tonic::Code::Unauthenticated);
    assert_eq!(reviews(), 3);

    let text = aether_e2e::testing::scrape_metrics(&metrics_addr).expect("the registrar's metrics");
    for want in [
        "aether_registrar_token_reviews_total{result=\"prefiltered\"} 22",
        "aether_registrar_token_reviews_total{result=\"cached\"} 5",
        "aether_registrar_token_reviews_total{result=\"authenticated\"} 1",
        "aether_registrar_token_reviews_total{result=\"refused\"} 2",
        "aether_registrar_token_reviews_total{result=\"rate_limited\"} 1",
        "aether_registrar_refusals_total{reason=\"unauthenticated\"} 25",
        "aether_registrar_refusals_total{reason=\"review_rate\"} 1",
        "aether_registrar_calls_total{method=\"ApplyServices\",code=\"Unauthenticated\"} 1",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
}
