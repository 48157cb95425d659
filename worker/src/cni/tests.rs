//! The service's handlers called directly (no transport), on tokio's paused clock. The
//! transport, the real plugin binary and the graceful stop are exercised in
//! `cni-plugin/tests/`.

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shared_proto::cni::CniRequest;
use shared_proto::cni::cni_server::Cni;
use tonic::{Code, Request};

use super::*;
use crate::acks::Acks;
use aether_model::{Inputs, Pod};

struct Fixture {
    _dir: tempfile::TempDir,
    node: Arc<Node>,
    storage: Arc<Storage>,
    metrics: Arc<Metrics>,
    service: CniService,
}

/// A service whose proxy never ACKs (`Acks` nobody publishes to), or one that ACKs each
/// snapshot as soon as it is published.
fn fixture(acking: bool) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new();
    let storage = Arc::new(Storage::open(dir.path(), metrics.clone()).unwrap());
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    let acks: Arc<dyn AckSource> = if acking {
        Arc::new(PublishedAcks(node.clone()))
    } else {
        Arc::new(Acks::default())
    };
    let service = CniService::new(node.clone(), storage.clone(), acks, metrics.clone());
    Fixture {
        _dir: dir,
        node,
        storage,
        metrics,
        service,
    }
}

fn req(uid: &str, container: &str, ips: &[&str]) -> CniRequest {
    CniRequest {
        container_id: container.into(),
        netns: format!("/var/run/netns/{container}"),
        ifname: "eth0".into(),
        pod_namespace: "default".into(),
        pod_name: format!("pod-{uid}"),
        pod_uid: uid.into(),
        ips: ips.iter().map(|s| s.to_string()).collect(),
        cni_args: String::new(),
        prev_result: Vec::new(),
    }
}

fn ips(v: &[&str]) -> Vec<IpAddr> {
    v.iter().map(|s| s.parse().unwrap()).collect()
}

fn stored(dir: &Path) -> Vec<String> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[tokio::test(start_paused = true)]
async fn add_answers_success_after_the_ack_timeout_and_counts_it() {
    let f = fixture(false);
    let start = tokio::time::Instant::now();
    let resp = f
        .service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .unwrap()
        .into_inner();
    assert!(!resp.acked);
    assert!(
        start.elapsed() >= ACK_TIMEOUT,
        "waited {:?}",
        start.elapsed()
    );
    assert_eq!(f.metrics.cni_ack_timeouts.get(), 1);
    assert_eq!(stored(f.storage.dir()), vec!["u1.json"]);
    assert!(
        f.node.snapshot().holds_pod("u1", &ips(&["10.1.0.5"])),
        "the pod is served even without an ACK"
    );
}

#[tokio::test(start_paused = true)]
async fn add_acked_answers_at_once() {
    let f = fixture(true);
    let start = tokio::time::Instant::now();
    let resp = f
        .service
        .add(Request::new(req("u1", "c1", &["10.1.0.5", "fd00::5"])))
        .await
        .unwrap()
        .into_inner();
    assert!(resp.acked);
    assert!(start.elapsed() < Duration::from_millis(1));
    assert_eq!(f.metrics.cni_ack_timeouts.get(), 0);
    assert_eq!(
        f.storage.get("u1").unwrap().ips,
        ips(&["10.1.0.5", "fd00::5"])
    );
}

/// Makes the record's final rename fail: a non-empty folder where the file would go.
fn block_record_path(storage: &Storage, uid: &str) {
    let path = storage.dir().join(format!("{uid}.json"));
    let _ = std::fs::remove_file(&path);
    std::fs::create_dir_all(path.join("blocker")).unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failed_record_write_answers_an_error_and_leaves_the_snapshot_as_it_was() {
    let f = fixture(true);
    // A new pod: not served after the failure.
    block_record_path(&f.storage, "u1");
    let err = f
        .service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .expect_err("write fails");
    assert_eq!(err.code(), Code::Internal);
    assert!(err.message().contains("u1"), "{}", err.message());
    assert!(
        !f.node.inputs().pods.contains_key("u1"),
        "a pod without a record is served"
    );

    // A pod re-added with new IPs: the snapshot keeps the IPs its record holds.
    f.service
        .add(Request::new(req("u2", "c2", &["10.1.0.6"])))
        .await
        .unwrap();
    block_record_path(&f.storage, "u2");
    f.service
        .add(Request::new(req("u2", "c2", &["10.1.0.7"])))
        .await
        .expect_err("write fails");
    assert_eq!(f.node.inputs().pods["u2"].ips, ips(&["10.1.0.6"]));
    assert_eq!(f.storage.get("u2").unwrap().ips, ips(&["10.1.0.6"]));
}

#[tokio::test(start_paused = true)]
async fn invalid_adds_write_nothing() {
    let f = fixture(true);
    let cases: Vec<(CniRequest, &str)> = vec![
        (req("../x", "c1", &["10.0.0.1"]), "pod_uid"),
        (req("u1", "c..1", &["10.0.0.1"]), "container_id"),
        (req("u1", "", &["10.0.0.1"]), "container_id"),
        (req("u1", "c1", &[]), "ips is empty"),
        (req("u1", "c1", &["10.0.0.1/24"]), "ips[0]"),
        (
            CniRequest {
                netns: "rel".into(),
                ..req("u1", "c1", &["10.0.0.1"])
            },
            "netns",
        ),
        (
            CniRequest {
                netns: "/var/run/netns/../../proc/1/ns/net".into(),
                ..req("u1", "c1", &["10.0.0.1"])
            },
            "netns \"/var/run/netns/../../proc/1/ns/net\" has a \"..\" component",
        ),
        (
            CniRequest {
                netns: "/..".into(),
                ..req("u1", "c1", &["10.0.0.1"])
            },
            "netns \"/..\" has a \"..\" component",
        ),
        (
            CniRequest {
                netns: format!("/{}", "n".repeat(5000)),
                ..req("u1", "c1", &["10.0.0.1"])
            },
            "at most 4096 bytes",
        ),
        (
            CniRequest {
                ips: (1..=17).map(|i| format!("10.0.0.{i}")).collect(),
                ..req("u1", "c1", &[])
            },
            "ips has 17 entries, over the limit of 16",
        ),
        (
            CniRequest {
                ifname: "0123456789abcdef".into(),
                ..req("u1", "c1", &["10.0.0.1"])
            },
            "ifname",
        ),
    ];
    for (r, field) in cases {
        let err = f.service.add(Request::new(r)).await.expect_err(field);
        assert_eq!(err.code(), Code::InvalidArgument, "{field}");
        assert!(
            err.message().contains(field),
            "{field:?} not in {:?}",
            err.message()
        );
    }
    assert!(stored(f.storage.dir()).is_empty());
    assert!(f.node.inputs().pods.is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_add_stores_each_ip_once_in_the_order_given_up_to_the_cap() {
    let f = fixture(true);
    let given = ["10.0.0.2", "fd00::1", "10.0.0.2", "10.0.0.1", "fd00::1"];
    f.service
        .add(Request::new(req("u1", "c1", &given)))
        .await
        .unwrap();
    assert_eq!(
        f.storage.get("u1").unwrap().ips,
        ips(&["10.0.0.2", "fd00::1", "10.0.0.1"])
    );
    // The cap admits its figure; a netns with dots that are not a component passes.
    let sixteen: Vec<String> = (1..=16).map(|i| format!("10.0.1.{i}")).collect();
    let sixteen: Vec<&str> = sixteen.iter().map(String::as_str).collect();
    let r = CniRequest {
        netns: "/var/run/netns/..cni..".into(),
        ..req("u2", "c2", &sixteen)
    };
    f.service.add(Request::new(r)).await.unwrap();
    assert_eq!(f.storage.get("u2").unwrap().ips.len(), 16);
}

#[tokio::test(start_paused = true)]
async fn del_removes_record_and_pod_and_tolerates_unknown_and_stale() {
    let f = fixture(true);
    let unknown = f
        .service
        .del(Request::new(req("nobody", "c0", &[])))
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.found);

    f.service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .unwrap();
    // The sandbox was replaced (new container id); a late DEL of the old one keeps the pod.
    f.service
        .add(Request::new(req("u1", "c2", &["10.1.0.6"])))
        .await
        .unwrap();
    let stale = f
        .service
        .del(Request::new(req("u1", "c1", &[])))
        .await
        .unwrap()
        .into_inner();
    assert!(!stale.found);
    assert!(f.node.snapshot().holds_pod("u1", &ips(&["10.1.0.6"])));

    let del = f
        .service
        .del(Request::new(req("u1", "c2", &[])))
        .await
        .unwrap()
        .into_inner();
    assert!(del.found);
    assert!(stored(f.storage.dir()).is_empty());
    assert!(!f.node.inputs().pods.contains_key("u1"));

    // Without a uid (a runtime passing no K8S_POD_UID), the container id finds the pod.
    f.service
        .add(Request::new(req("", "c3", &["10.1.0.7"])))
        .await
        .unwrap();
    assert!(f.storage.get("c3").is_some());
    assert!(
        f.service
            .del(Request::new(req("", "c3", &[])))
            .await
            .unwrap()
            .into_inner()
            .found
    );
    assert!(f.storage.pods().is_empty());
}

#[tokio::test(start_paused = true)]
async fn check_answers_whether_the_pod_is_held_with_those_ips() {
    let f = fixture(true);
    let check = |r| f.service.check(Request::new(r));
    let unknown = check(req("u1", "c1", &["10.1.0.5"]))
        .await
        .unwrap()
        .into_inner();
    assert!(!unknown.holds);
    assert!(unknown.reason.contains("not known"), "{}", unknown.reason);

    f.service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .unwrap();
    assert!(
        check(req("u1", "c1", &["10.1.0.5"]))
            .await
            .unwrap()
            .into_inner()
            .holds
    );
    let other = check(req("u1", "c1", &["10.1.0.9"]))
        .await
        .unwrap()
        .into_inner();
    assert!(!other.holds);
    assert!(other.reason.contains("holds ips"), "{}", other.reason);
}

#[tokio::test(start_paused = true)]
async fn the_lifecycle_lock_orders_adds() {
    let f = fixture(true);
    let held = f.node.lifecycle().await;
    let add = tokio::spawn({
        let s = f.service.clone();
        async move { s.add(Request::new(req("u1", "c1", &["10.1.0.5"]))).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        stored(f.storage.dir()).is_empty(),
        "nothing is written while the lock is held"
    );
    drop(held);
    assert!(add.await.unwrap().unwrap().into_inner().acked);
    assert_eq!(stored(f.storage.dir()), vec!["u1.json"]);
}

#[tokio::test(start_paused = true)]
async fn after_the_fence_calls_change_nothing() {
    let f = fixture(true);
    f.service.fence().await;
    let err = f
        .service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    assert!(stored(f.storage.dir()).is_empty());
    assert!(f.node.inputs().pods.is_empty());
}

fn pod(uid: &str, ip: &str) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "default".into(),
        name: format!("pod-{uid}"),
        container_id: format!("c-{uid}"),
        netns: format!("/var/run/netns/{uid}"),
        ifname: "eth0".into(),
        ips: ips(&[ip]),
        terminating: false,
        no_quic_twin: false,
    }
}

/// An owner's records in `dir` holding pod `a`, and a standby that loaded them and
/// follows them from now on.
struct Following {
    owner: Storage,
    storage: Arc<Storage>,
    node: Arc<Node>,
    added: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    stop: tokio::sync::watch::Sender<bool>,
    follower: tokio::task::JoinHandle<Followed>,
}

fn following(dir: &Path) -> Following {
    let owner = Storage::open(dir, Metrics::new()).unwrap();
    owner.put(&pod("a", "10.0.0.1")).unwrap();
    let storage = Arc::new(Storage::open(dir, Metrics::new()).unwrap());
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    let added = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let follower = tokio::spawn(follow(
        node.clone(),
        storage.clone(),
        added.clone(),
        stopped,
    ));
    Following {
        owner,
        storage,
        node,
        added,
        stop,
        follower,
    }
}

/// A standby follows the owner's records as they are written (inotify on the folder),
/// into its node, and names the pods it added; once stopped it ends and reads no more.
#[tokio::test]
async fn a_standby_follows_the_owners_records_until_it_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let Following {
        owner,
        node,
        added,
        stop,
        follower,
        ..
    } = following(dir.path());
    // Each step within 0.9 s: inside the follower's 1 s poll, so inotify woke it.
    let wait = |what: &'static str, node: Arc<Node>, check: fn(&Node) -> bool| async move {
        tokio::time::timeout(Duration::from_millis(900), async {
            let mut snapshots = node.subscribe();
            while !check(&node) {
                snapshots.changed().await.expect("the node lives");
            }
        })
        .await
        .unwrap_or_else(|_| panic!("the standby did not follow: {what}"));
    };
    // Let the follower start watching before the owner writes.
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    owner.put(&pod("b", "10.0.0.2")).unwrap();
    wait("the ADD of b", node.clone(), |n| n.pod("b").is_some()).await;
    owner.put(&pod("a", "10.0.0.9")).unwrap();
    wait("the rewrite of a", node.clone(), |n| {
        n.pod("a").is_some_and(|p| p.ips == ips(&["10.0.0.9"]))
    })
    .await;
    owner.remove("b").unwrap();
    wait("the DEL of b", node.clone(), |n| n.pod("b").is_none()).await;
    assert_eq!(
        added.lock().unwrap().iter().collect::<Vec<_>>(),
        ["b"],
        "the pods it added"
    );

    stop.send_replace(true);
    tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("the follower ends once stopped")
        .unwrap();
    owner.put(&pod("c", "10.0.0.3")).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(node.pod("c").is_none(), "a stopped follower read on");
}

/// A standby that followed every write of the owner's is handed the node without a read
/// of the folder; a write its follow has not read (its event still queued at the
/// takeover) makes the reconcile read the folder and apply it.
#[tokio::test]
async fn a_takeover_after_a_complete_follow_reads_nothing_and_one_after_a_missed_write_reads() {
    for missed in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let Following {
            owner,
            storage,
            node,
            stop,
            follower,
            ..
        } = following(dir.path());
        // The follower's first look, at once, then the owner's write, followed.
        let mut snapshots = node.subscribe();
        owner.put(&pod("b", "10.0.0.2")).unwrap();
        tokio::time::timeout(Duration::from_secs(5), async {
            while node.pod("b").is_none() {
                snapshots.changed().await.expect("the node lives");
            }
        })
        .await
        .expect("the standby follows the owner's write");
        // The node is handed over: the follower stops, and then (or not) the previous
        // owner's last write, whose event no look read.
        stop.send_replace(true);
        let followed = tokio::time::timeout(Duration::from_secs(5), follower)
            .await
            .expect("the follower ends once stopped")
            .unwrap();
        if missed {
            owner.put(&pod("c", "10.0.0.3")).unwrap();
        }
        node.set_gate(|g| g.storage_loaded = true);
        let got = reconcile(&node, &storage, Some(followed)).await.unwrap();
        if missed {
            assert_eq!(got, Reconciled::Read(1), "a queued event makes it read");
            assert!(node.pod("c").is_some(), "the missed write is applied");
        } else {
            assert_eq!(got, Reconciled::Followed, "nothing to read");
            // The owner's scan once serving finds the view it followed.
            assert_eq!(check_followed(&node, &storage).await.unwrap(), 0);
        }
        assert!(node.pod("b").is_some());
    }
}

/// The owner's scan after a followed takeover applies what the view lacks (a write the
/// follow missed), and says how many pods differed.
#[tokio::test]
async fn the_owners_scan_after_a_followed_takeover_applies_what_the_view_lacks() {
    let dir = tempfile::tempdir().unwrap();
    let owner = Storage::open(dir.path(), Metrics::new()).unwrap();
    let storage = Arc::new(Storage::open(dir.path(), Metrics::new()).unwrap());
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    owner.put(&pod("a", "10.0.0.1")).unwrap();
    assert_eq!(check_followed(&node, &storage).await.unwrap(), 1);
    assert!(node.snapshot().holds_pod("a", &ips(&["10.0.0.1"])));
}

#[tokio::test(start_paused = true)]
async fn reconcile_applies_what_the_previous_owner_did() {
    let dir = tempfile::tempdir().unwrap();
    // The previous owner's storage before the overlap.
    let old = Storage::open(dir.path(), Metrics::new()).unwrap();
    old.put(&pod("a", "10.0.0.1")).unwrap();
    old.put(&pod("b", "10.0.0.2")).unwrap();

    // The standby builds from it, but has not opened the storage gate yet...
    let storage = Arc::new(Storage::open(dir.path(), Metrics::new()).unwrap());
    let node = Node::new(Inputs::default());
    node.apply(
        storage
            .pods()
            .into_iter()
            .map(aether_model::Change::UpsertPod),
    );
    let pending = tokio::spawn({
        let (node, storage) = (node.clone(), storage.clone());
        async move { reconcile(&node, &storage, None).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !pending.is_finished(),
        "reconcile waits for the storage gate"
    );

    // ...while the old owner serves ADD, DEL and a rewrite during the overlap.
    old.remove("a").unwrap();
    old.put(&pod("b", "10.0.0.3")).unwrap();
    old.put(&pod("c", "10.0.0.4")).unwrap();

    node.set_gate(|g| g.storage_loaded = true);
    assert_eq!(pending.await.unwrap().unwrap(), Reconciled::Read(3));
    let pods = node.inputs().pods;
    assert_eq!(pods.keys().collect::<Vec<_>>(), vec!["b", "c"]);
    assert_eq!(pods["b"], pod("b", "10.0.0.3"));
    assert!(node.snapshot().holds_pod("c", &ips(&["10.0.0.4"])));
}

#[tokio::test(start_paused = true)]
async fn reconcile_with_nothing_changed_is_zero() {
    let f = fixture(true);
    f.service
        .add(Request::new(req("u1", "c1", &["10.1.0.5"])))
        .await
        .unwrap();
    assert_eq!(
        reconcile(&f.node, &f.storage, None).await.unwrap(),
        Reconciled::Read(0)
    );
    assert!(f.node.inputs().pods.contains_key("u1"));
}

#[tokio::test]
async fn a_burst_of_adds_is_committed_in_batches_and_every_add_succeeds() {
    let f = fixture(true);
    let before = f.node.snapshot().seq;
    // One pod's write fails: its ADD alone errs, and its batch-mates are served.
    block_record_path(&f.storage, "u7");
    let calls: Vec<_> = (0..300)
        .map(|i| {
            let service = f.service.clone();
            let ip = format!("10.1.{}.{}", i / 200, i % 200 + 1);
            tokio::spawn(async move {
                service
                    .add(Request::new(req(
                        &format!("u{i}"),
                        &format!("c{i}"),
                        &[&ip],
                    )))
                    .await
            })
        })
        .collect();
    let mut failed = Vec::new();
    for (i, call) in calls.into_iter().enumerate() {
        match call.await.unwrap() {
            Ok(r) => assert!(r.into_inner().acked, "ADD {i} acked"),
            Err(e) => failed.push((i, e.code())),
        }
    }
    assert_eq!(failed, vec![(7, Code::Internal)]);
    let snapshots = f.node.snapshot().seq - before;
    assert!(
        snapshots < 300,
        "{snapshots} snapshots for 300 concurrent ADDs: they were not batched"
    );
    let s = f.node.snapshot();
    for i in (0..300).filter(|i| *i != 7) {
        assert!(
            s.holds_pod(
                &format!("u{i}"),
                &ips(&[&format!("10.1.{}.{}", i / 200, i % 200 + 1)])
            ),
            "pod u{i}"
        );
        assert!(f.storage.get(&format!("u{i}")).is_some(), "record u{i}");
    }
    assert!(
        !s.holds_pod("u7", &ips(&["10.1.0.8"])),
        "the pod whose record failed is taken back out"
    );
}

#[tokio::test(start_paused = true)]
async fn an_add_for_an_ip_an_older_record_holds_evicts_it_and_serves_the_new_pod() {
    let f = fixture(true);
    f.service
        .add(Request::new(req("old", "c1", &["10.1.0.5", "fd00::5"])))
        .await
        .unwrap();
    // The old pod's DEL never came; its IP is given to a new pod.
    let resp = f
        .service
        .add(Request::new(req("new", "c2", &["10.1.0.5"])))
        .await
        .unwrap()
        .into_inner();
    assert!(resp.acked);
    let s = f.node.snapshot();
    assert!(s.holds_pod("new", &ips(&["10.1.0.5"])), "{:?}", s.rejects);
    assert!(s.rejects.is_empty(), "{:?}", s.rejects);
    assert!(
        !f.node.inputs().pods.contains_key("old"),
        "the whole older pod is evicted, its other IPs too"
    );
    assert_eq!(stored(f.storage.dir()), vec!["new.json"]);
    assert_eq!(f.metrics.cni_evictions.get(), 1);
    // The same pod added again evicts nothing.
    f.service
        .add(Request::new(req("new", "c2", &["10.1.0.5"])))
        .await
        .unwrap();
    assert_eq!(f.metrics.cni_evictions.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn two_records_loaded_with_one_ip_are_both_evicted_by_the_next_add_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(dir.path(), Metrics::new()).unwrap());
    storage.put(&pod("a", "10.0.0.1")).unwrap();
    storage.put(&pod("b", "10.0.0.1")).unwrap();
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    assert!(!node.snapshot().rejects.is_empty(), "served for neither");
    let metrics = Metrics::new();
    let service = CniService::new(
        node.clone(),
        storage.clone(),
        Arc::new(PublishedAcks(node.clone())),
        metrics.clone(),
    );
    service
        .add(Request::new(req("c", "c3", &["10.0.0.1"])))
        .await
        .unwrap();
    assert!(node.snapshot().holds_pod("c", &ips(&["10.0.0.1"])));
    assert_eq!(
        storage
            .pods()
            .into_iter()
            .map(|p| p.uid)
            .collect::<Vec<_>>(),
        ["c"]
    );
    assert_eq!(metrics.cni_evictions.get(), 2);
}

#[tokio::test]
async fn in_one_batch_the_later_add_for_an_ip_wins_and_the_earlier_fails() {
    let f = fixture(true);
    // Queue both before either commits: hold the lifecycle lock while they queue.
    let held = f.node.lifecycle().await;
    let first = tokio::spawn({
        let s = f.service.clone();
        async move { s.add(Request::new(req("u1", "c1", &["10.1.0.5"]))).await }
    });
    tokio::task::yield_now().await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = tokio::spawn({
        let s = f.service.clone();
        async move { s.add(Request::new(req("u2", "c2", &["10.1.0.5"]))).await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(held);
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(
        first.expect_err("the earlier ADD loses").code(),
        Code::Aborted
    );
    assert!(second.unwrap().into_inner().acked);
    assert!(f.node.snapshot().holds_pod("u2", &ips(&["10.1.0.5"])));
    assert_eq!(stored(f.storage.dir()), vec!["u2.json"]);
}

#[tokio::test(start_paused = true)]
async fn reconcile_serves_a_record_the_previous_owner_marked_terminating_as_draining() {
    let dir = tempfile::tempdir().unwrap();
    let old = Storage::open(dir.path(), Metrics::new()).unwrap();
    old.put(&pod("a", "10.0.0.1")).unwrap();
    let storage = Arc::new(Storage::open(dir.path(), Metrics::new()).unwrap());
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    // The old owner's pod watch saw the deletion timestamp during the overlap.
    old.put(&Pod {
        terminating: true,
        ..pod("a", "10.0.0.1")
    })
    .unwrap();
    assert_eq!(
        reconcile(&node, &storage, None).await.unwrap(),
        Reconciled::Read(1)
    );
    let s = node.snapshot();
    assert!(
        s.holds_pod("a", &ips(&["10.0.0.1"])),
        "a terminating pod is still served"
    );
    assert_eq!(
        s.clusters.get("inbound|a").map(|c| c.kind.clone()),
        Some(aether_model::ClusterKind::Static {
            endpoints: vec!["10.0.0.1:80".parse().unwrap()],
            draining: true
        })
    );
}

/// Each call is timed under its op and result (tokio's clock, so the paused one here): an
/// ADD the proxy never ACKs takes its 2 s wait, one refused as invalid is an error.
#[tokio::test(start_paused = true)]
async fn each_call_is_timed_by_op_and_result() {
    let f = fixture(false);
    f.service
        .add(Request::new(req("u1", "c1", &["10.0.0.1"])))
        .await
        .expect("ADD after the ACK wait");
    f.service
        .add(Request::new(req("../x", "c2", &["10.0.0.2"])))
        .await
        .expect_err("an invalid uid");
    f.service
        .check(Request::new(req("u1", "c1", &["10.0.0.1"])))
        .await
        .expect("CHECK");
    f.service
        .del(Request::new(req("u1", "c1", &[])))
        .await
        .expect("DEL");
    let text = f.metrics.encode();
    let sample = |series: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    let series = |kind: &str, labels: &str| {
        sample(&format!(
            "aether_cni_request_duration_seconds_{kind}{{{labels}}}"
        ))
    };
    for (op, result) in [
        ("add", "ok"),
        ("add", "error"),
        ("check", "ok"),
        ("del", "ok"),
    ] {
        assert_eq!(
            series("count", &format!("op=\"{op}\",result=\"{result}\"")),
            1.0,
            "{op} {result}"
        );
    }
    let waited = series("sum", "op=\"add\",result=\"ok\"");
    assert!(
        (ACK_TIMEOUT.as_secs_f64()..ACK_TIMEOUT.as_secs_f64() + 0.1).contains(&waited),
        "the ADD took {waited} s"
    );
    assert_eq!(series("bucket", "le=\"1.0\",op=\"add\",result=\"ok\""), 0.0);
    assert_eq!(series("bucket", "le=\"2.5\",op=\"add\",result=\"ok\""), 1.0);
    assert!(
        series("sum", "op=\"add\",result=\"error\"") < 0.1,
        "an invalid ADD is answered at once"
    );
}

/// An ADD `timeout` header as the plugin sends it.
fn with_timeout(r: CniRequest, timeout: &str) -> Request<CniRequest> {
    let mut r = Request::new(r);
    r.metadata_mut()
        .insert("grpc-timeout", timeout.parse().unwrap());
    r
}

/// The queued ADD on a starved node: a batch holds the lifecycle lock (here, forever). The
/// ADD is refused as busy at [`service::ADD_BOUND`] (or its caller's `grpc-timeout` less
/// the margin), counted, and taken out of the queue: it never lands once the lock frees.
#[tokio::test(start_paused = true)]
async fn a_queued_add_is_refused_as_busy_by_its_bound_and_never_lands() {
    use service::{ADD_BOUND, ANSWER_MARGIN};
    for (timeout, bound) in [
        (None, ADD_BOUND),
        (Some("30S"), ADD_BOUND),
        (Some("1500m"), Duration::from_millis(1500) - ANSWER_MARGIN),
        (Some("bad"), ADD_BOUND),
    ] {
        let f = fixture(true);
        let held = f.node.lifecycle().await;
        let start = tokio::time::Instant::now();
        let request = req("u1", "c1", &["10.1.0.5"]);
        let request = match timeout {
            Some(t) => with_timeout(request, t),
            None => Request::new(request),
        };
        let err = f.service.add(request).await.unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted, "{timeout:?}: {err:?}");
        assert!(err.message().contains("still queued"), "{}", err.message());
        assert_eq!(start.elapsed(), bound, "{timeout:?}");
        drop(held);
        // The ADD's commit task takes the lock now and must find nothing to commit.
        f.service
            .del(Request::new(req("u2", "c2", &[])))
            .await
            .unwrap();
        assert!(stored(f.storage.dir()).is_empty(), "{timeout:?}");
        assert!(f.node.inputs().pods.is_empty(), "{timeout:?}");
        assert!(
            f.metrics
                .encode()
                .contains("aether_cni_requests_total{op=\"add\",result=\"busy\"} 1"),
            "{timeout:?}"
        );
    }
}

/// A committed ADD whose proxy does not ACK answers success by the caller's deadline: the
/// ACK wait is cut to what is left of it.
#[tokio::test(start_paused = true)]
async fn the_ack_wait_is_cut_to_the_callers_deadline() {
    let f = fixture(false);
    let start = tokio::time::Instant::now();
    let resp = f
        .service
        .add(with_timeout(req("u1", "c1", &["10.1.0.5"]), "1S"))
        .await
        .unwrap()
        .into_inner();
    assert!(!resp.acked);
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(1) - service::ANSWER_MARGIN
    );
    assert_eq!(stored(f.storage.dir()), vec!["u1.json"]);
}

#[test]
fn a_pod_opts_out_of_its_quic_twin_by_cni_argument_and_a_bad_value_is_named() {
    use super::service::quic_twin_wanted;
    for (args, wanted) in [
        ("", true),
        ("IgnoreUnknown=1;K8S_POD_NAME=web", true),
        ("K8S_POD_NAME=web;AETHER_QUIC_TWIN=off", false),
        ("AETHER_QUIC_TWIN=on", true),
    ] {
        assert_eq!(quic_twin_wanted(args).unwrap(), wanted, "{args:?}");
    }
    let e = quic_twin_wanted("AETHER_QUIC_TWIN=no").unwrap_err();
    assert!(
        e.message().contains("AETHER_QUIC_TWIN") && e.message().contains("\"no\""),
        "{e:?}"
    );
}
