//! The worker's identity clients (`aether_worker::identity`) against the test identity
//! provider (`aether_e2e::identity`, the SPIFFE Workload API and SPIRE's Delegated
//! Identity API on unix sockets, real X.509-SVIDs): the agent's SVID and the bundle reach
//! the node's inputs and open the gate, rotations replace them, a provider that is down
//! at start or later is retried and reported in `/ready`, and the pods' subscriptions
//! follow the node's pod set (subscribed when a pod is added, closed when it is removed,
//! one held pod delaying nobody, two agents streaming the same SVID independently).
//!
//! In process: a `Node` fed by the identity clients, no supervisor. Every wait is on a
//! watch channel (the node's snapshots and gates, `/ready`'s status) or on the provider's
//! own stream count, bounded by [`WAIT`].

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use aether_e2e::identity::IdentityProvider;
use aether_model::{Change, Identity, Inputs, MtlsMode, Pod};
use aether_worker::config::IdentityConfig;
use aether_worker::health::{Reporter, Status};
use aether_worker::metrics::{Metrics, SvidSourceLabel};
use aether_worker::node::Node;
use spiffe::transport::Endpoint;
use tokio::sync::watch;

const TD: &str = "example.org";
/// How long anything that must happen may take.
const WAIT: Duration = Duration::from_secs(10);

/// One agent's node with its identity clients running.
struct Agent {
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    status: Arc<watch::Sender<Status>>,
    _identity: aether_worker::identity::Identity,
}

fn unix(path: &Path) -> (Endpoint, String) {
    let text = format!("unix://{}", path.display());
    (Endpoint::parse(&text).expect("a unix endpoint"), text)
}

/// An agent with `--trust-domain trust_domain --mtls mode` on `provider`'s sockets.
fn agent(provider: &IdentityProvider, trust_domain: &str, mode: MtlsMode) -> Agent {
    let identity = Identity {
        trust_domain: Some(trust_domain.into()),
        mode,
        ..Identity::default()
    };
    let node = Node::new(Inputs {
        identity,
        ..Inputs::default()
    });
    let metrics = Metrics::new();
    let status = Arc::new(watch::Sender::new(Status::new("node-1", "agent-1")));
    let (workload_api, workload_api_text) = unix(&provider.workload_socket());
    let cfg = IdentityConfig {
        workload_api,
        workload_api_text,
        broker: Some(unix(&provider.delegated_socket())),
        trust_domain: spiffe::TrustDomain::new(trust_domain).expect("a trust domain"),
        mode,
    };
    let identity = aether_worker::identity::spawn(
        cfg,
        node.clone(),
        metrics.clone(),
        Reporter::new(status.clone()),
        None,
    );
    Agent {
        node,
        metrics,
        status,
        _identity: identity,
    }
}

fn pod(uid: &str, name: &str, ip: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "shop".into(),
        name: name.into(),
        container_id: format!("c-{uid}"),
        netns: format!("/var/run/netns/{uid}"),
        ifname: "eth0".into(),
        ips: vec![ip.parse().expect("an IP")],
        terminating: false,
        no_quic_twin: false,
    }
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {WAIT:?}"))
}

impl Agent {
    /// Waits until the node's inputs satisfy `pred`.
    async fn until(&self, what: &str, pred: impl Fn(&Inputs) -> bool) {
        let mut snapshots = self.node.subscribe();
        within(what, async {
            while !self.node.with_inputs(&pred) {
                snapshots.changed().await.expect("the node lives");
            }
        })
        .await;
    }

    /// Waits until `/ready`'s status satisfies `pred`.
    async fn until_status(&self, what: &str, pred: impl Fn(&Status) -> bool) {
        let mut rx = self.status.subscribe();
        within(what, rx.wait_for(|s| pred(s)))
            .await
            .expect("the status lives");
    }

    fn problem(&self, source: &str) -> Option<String> {
        self.status
            .borrow()
            .problems
            .iter()
            .find(|p| p.source == source)
            .map(|p| p.message.clone())
    }

    fn pod_serial(&self, uid: &str) -> Option<String> {
        self.node
            .with_inputs(|i| i.identity.pods.get(uid).map(|s| s.serial.clone()))
    }

    fn updates(&self, source: &str) -> u64 {
        self.metrics
            .identity_svid_updates
            .get_or_create(&SvidSourceLabel {
                source: source.into(),
            })
            .get()
    }
}

/// PEM without its line breaks, to compare encodings that differ only in line endings.
fn flat(pem: &str) -> String {
    pem.chars().filter(|c| !c.is_whitespace()).collect()
}

/// The provider's blocking calls, from a multi-thread test runtime.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_svid_and_bundle_reach_the_node_open_the_gate_and_follow_a_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let a = agent(&provider, TD, MtlsMode::Permissive);
    within(
        "the agent-svid gate",
        a.node.gates().wait_for(|g| g.agent_svid),
    )
    .await
    .unwrap();
    let first = provider.serial_of_agent();
    a.until("the agent's SVID", |i| {
        i.identity.agent.as_ref().is_some_and(|s| s.serial == first) && i.identity.bundle.is_some()
    })
    .await;
    let inputs = a.node.inputs();
    let svid = inputs.identity.agent.as_ref().unwrap();
    assert_eq!(svid.spiffe_id, provider.agent_spiffe_id());
    assert!(
        svid.chain_pem.starts_with("-----BEGIN CERTIFICATE-----")
            && svid.key_pem.starts_with("-----BEGIN PRIVATE KEY-----")
    );
    assert!(svid.not_after > svid.not_before && svid.renew_by() < svid.not_after);
    assert_eq!(
        flat(inputs.identity.bundle.as_deref().unwrap()),
        flat(&provider.ca_pem())
    );
    // The bundle reaches Envoy; the agent's SVID never does: no pod may present it.
    let snapshot = a.node.snapshot();
    assert!(snapshot.secrets.get(aether_model::BUNDLE_SECRET).is_some());
    assert!(
        !snapshot.secrets.items.values().any(|n| matches!(
            &n.secret,
            aether_model::Secret::Certificate { key_pem, .. } if *key_pem == svid.key_pem
        )),
        "a secret carries the agent's key"
    );
    a.until_status("/ready's identity", |s| {
        s.identity.as_ref().is_some_and(|i| {
            i.workload_api == "connected"
                && i.agent.as_ref().is_some_and(|x| x.serial == first)
                && i.bundle
        })
    })
    .await;
    assert_eq!(a.updates("agent"), 1);
    assert_eq!(a.metrics.identity_workload_api_connected.get(), 1);

    provider.rotate_all();
    let second = provider.serial_of_agent();
    assert_ne!(first, second);
    // No snapshot resource carries the agent's SVID, so its rotation builds none: wait on
    // /ready, then read the inputs.
    a.until_status("the rotated SVID on /ready", |s| {
        s.identity
            .as_ref()
            .is_some_and(|i| i.agent.as_ref().is_some_and(|x| x.serial == second))
    })
    .await;
    assert!(a.node.with_inputs(|i| {
        i.identity
            .agent
            .as_ref()
            .is_some_and(|s| s.serial == second)
    }));
    assert_eq!(a.updates("agent"), 2);
    assert!(
        a.problem("workload-api").is_none() && a.problem("trust-domain").is_none(),
        "{:?}",
        a.status.borrow().problems
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_down_at_start_keeps_the_gate_closed_until_it_comes_up_and_one_down_later_keeps_the_svid()
 {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    blocking(|| provider.set_down(true));
    let a = agent(&provider, TD, MtlsMode::Permissive);
    // The client tried, failed and said so; the gate is still closed.
    a.until_status("the Workload API problem", |s| {
        s.problems
            .iter()
            .any(|p| p.source == "workload-api" && p.message.contains("no SVID yet"))
    })
    .await;
    assert!(
        !a.node.gates().borrow().agent_svid,
        "the gate opened without an SVID"
    );
    assert!(a.node.with_inputs(|i| i.identity.agent.is_none()));
    assert_eq!(a.metrics.identity_workload_api_connected.get(), 0);

    blocking(|| provider.set_down(false));
    within(
        "the agent-svid gate after the provider came up",
        a.node.gates().wait_for(|g| g.agent_svid),
    )
    .await
    .unwrap();
    a.until_status("the problem cleared", |s| {
        !s.problems.iter().any(|p| p.source == "workload-api")
    })
    .await;
    let serial = provider.serial_of_agent();
    assert_eq!(
        a.node
            .with_inputs(|i| i.identity.agent.as_ref().map(|s| s.serial.clone())),
        Some(serial.clone())
    );

    // Down later: the last SVID stays served, /ready says so; back up, the same SVID is
    // sent again and the problem goes.
    blocking(|| provider.set_down(true));
    a.until_status("the Workload API problem while serving", |s| {
        s.problems
            .iter()
            .any(|p| p.source == "workload-api" && p.message.contains("serving the last SVID"))
    })
    .await;
    assert_eq!(
        a.node
            .with_inputs(|i| i.identity.agent.as_ref().map(|s| s.serial.clone())),
        Some(serial.clone())
    );
    blocking(|| provider.set_down(false));
    a.until_status("the problem cleared again", |s| {
        !s.problems.iter().any(|p| p.source == "workload-api")
            && s.identity
                .as_ref()
                .is_some_and(|i| i.workload_api == "connected")
    })
    .await;
    assert_eq!(a.updates("agent"), 1, "the same SVID again is no update");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_added_to_the_node_are_subscribed_and_a_removed_pods_subscription_closes() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let a = agent(&provider, TD, MtlsMode::Permissive);
    a.node.apply([
        Change::UpsertPod(pod("u1", "web-1", "10.1.0.5")),
        Change::UpsertPod(pod("u2", "web-2", "10.1.0.6")),
    ]);
    a.until("both pods' SVIDs", |i| i.identity.pods.len() == 2)
        .await;
    for (uid, name) in [("u1", "web-1"), ("u2", "web-2")] {
        let svid = a.node.with_inputs(|i| i.identity.pods[uid].clone());
        assert_eq!(svid.spiffe_id, provider.pod_spiffe_id("shop", name));
        assert_eq!(Some(svid.serial), provider.serial_of_pod(uid));
    }
    assert!(a.node.snapshot().secrets.get("spiffe|pod|u1").is_some());
    assert_eq!(
        provider.subscriptions(),
        [("u1".to_string(), 1), ("u2".to_string(), 1)]
    );
    a.until_status("two open subscriptions", |s| {
        s.identity.as_ref().is_some_and(|i| i.subscriptions == 2)
    })
    .await;
    assert_eq!(a.metrics.identity_subscriptions.get(), 2);
    assert_eq!(a.updates("pod"), 2);

    // A rotation of one pod reaches that pod only.
    let before = a.pod_serial("u2");
    provider.rotate_pod("u1");
    let rotated = provider.serial_of_pod("u1");
    a.until("u1's rotated SVID", |i| {
        i.identity.pods.get("u1").map(|s| &s.serial) == rotated.as_ref()
    })
    .await;
    assert_eq!(a.pod_serial("u2"), before);

    // DEL: the stream closes at the provider and the SVID leaves the inputs.
    a.node.apply([Change::RemovePod("u1".into())]);
    blocking(|| provider.wait_for_streams("u1", 0));
    a.until("u1's SVID gone", |i| !i.identity.pods.contains_key("u1"))
        .await;
    assert_eq!(
        provider.subscriptions(),
        [("u1".to_string(), 0), ("u2".to_string(), 1)]
    );
    a.until_status("one open subscription", |s| {
        s.identity.as_ref().is_some_and(|i| i.subscriptions == 1)
    })
    .await;
    assert!(a.pod_serial("u2").is_some());

    // The same uid back (a pod re-added): subscribed again.
    a.node
        .apply([Change::UpsertPod(pod("u1", "web-1", "10.1.0.5"))]);
    blocking(|| provider.wait_for_streams("u1", 1));
    a.until("u1's SVID again", |i| i.identity.pods.contains_key("u1"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_pod_delays_no_other_and_strict_mode_lists_it_until_its_svid_comes() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    provider.hold_pod("held");
    let a = agent(&provider, TD, MtlsMode::Strict);
    a.node.apply([
        Change::UpsertPod(pod("held", "slow", "10.1.0.7")),
        Change::UpsertPod(pod("u2", "fast", "10.1.0.8")),
    ]);
    a.until("the other pod's SVID", |i| {
        i.identity.pods.contains_key("u2")
    })
    .await;
    // The held pod's stream is open and has brought nothing.
    blocking(|| provider.wait_for_streams("held", 1));
    assert!(a.pod_serial("held").is_none());
    let listed = "pod shop/slow has no SVID yet: strict mTLS holds its inbound listener back";
    // Only the held pod is listed (the other one was too, until its SVID came).
    a.until_status("the strict-mode problem of the held pod alone", |s| {
        s.problems
            .iter()
            .filter(|p| p.source == "pod-svid")
            .map(|p| p.message.as_str())
            .eq([listed])
            && s.identity.as_ref().is_some_and(|i| {
                i.pods_without_svid_count == 1
                    && i.pods_without_svid.len() == 1
                    && i.pods_without_svid[0].pod == "shop/slow"
            })
    })
    .await;
    assert_eq!(a.metrics.pods_without_svid.get(), 1);

    provider.release_pod("held");
    a.until("the released pod's SVID", |i| {
        i.identity.pods.contains_key("held")
    })
    .await;
    a.until_status("the strict-mode problem gone", |s| {
        !s.problems.iter().any(|p| p.source == "pod-svid")
    })
    .await;
    assert_eq!(a.metrics.pods_without_svid.get(), 0);
    assert_eq!(a.metrics.pod_svid_missing_oldest_seconds.get(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_down_keeps_the_pods_svids_and_the_streams_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let a = agent(&provider, TD, MtlsMode::Permissive);
    a.node
        .apply([Change::UpsertPod(pod("u1", "web-1", "10.1.0.5"))]);
    a.until("the pod's SVID", |i| i.identity.pods.contains_key("u1"))
        .await;
    let serial = a.pod_serial("u1");

    blocking(|| provider.set_down(true));
    a.until_status("the broker problem", |s| {
        s.problems.iter().any(|p| p.source == "spiffe-broker")
    })
    .await;
    a.until_status("no open subscription", |s| {
        s.identity.as_ref().is_some_and(|i| i.subscriptions == 0)
    })
    .await;
    assert_eq!(a.pod_serial("u1"), serial, "the last SVID stays");

    blocking(|| provider.set_down(false));
    blocking(|| provider.wait_for_streams("u1", 1));
    a.until_status("the broker problem cleared", |s| {
        !s.problems.iter().any(|p| p.source == "spiffe-broker")
    })
    .await;
    assert_eq!(a.pod_serial("u1"), serial);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_on_one_node_stream_the_same_pod_svid_independently() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let owner = agent(&provider, TD, MtlsMode::Permissive);
    let standby = agent(&provider, TD, MtlsMode::Permissive);
    for a in [&owner, &standby] {
        a.node
            .apply([Change::UpsertPod(pod("u1", "web-1", "10.1.0.5"))]);
    }
    blocking(|| provider.wait_for_streams("u1", 2));
    for a in [&owner, &standby] {
        a.until("the pod's SVID", |i| i.identity.pods.contains_key("u1"))
            .await;
    }
    assert_eq!(owner.pod_serial("u1"), standby.pod_serial("u1"));
    // The owner's DEL closes its stream only.
    owner.node.apply([Change::RemovePod("u1".into())]);
    blocking(|| provider.wait_for_streams("u1", 1));
    provider.rotate_pod("u1");
    let rotated = provider.serial_of_pod("u1");
    standby
        .until("the standby's rotated SVID", |i| {
            i.identity.pods.get("u1").map(|s| &s.serial) == rotated.as_ref()
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_svid_outside_the_trust_domain_is_not_served_and_named_in_ready() {
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let a = agent(&provider, "other.org", MtlsMode::Permissive);
    a.until_status("the trust-domain problem", |s| {
        s.problems.iter().any(|p| p.source == "trust-domain")
    })
    .await;
    let message = a.problem("trust-domain").unwrap();
    assert!(
        message.contains(&provider.agent_spiffe_id()) && message.contains("other.org"),
        "{message}"
    );
    assert!(!a.node.gates().borrow().agent_svid);
    assert!(a.node.with_inputs(|i| i.identity.agent.is_none()));
}
