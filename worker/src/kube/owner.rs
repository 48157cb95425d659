//! The owner's writes from what the Kubernetes API shows: Terminating marks, stale
//! records and the node's startup taint. Only a worker that serves the node runs this;
//! a standby has no [`Writer`] and writes nothing.
//!
//! Every storage or node change happens under the node's lifecycle lock, as CNI calls
//! do, and checks first that this worker is still the owner: a drain clears that flag
//! before the CNI API's fence takes the lock, so nothing is written after the fence.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use aether_model::{Change, Pod};
use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::api::{Api, Patch, PatchParams};
use serde_json::Value;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::stale::Stale;
use super::taint::{self, Decision};
use super::view::PodView;
use super::watch::{Backoff, Trouble, Watched, backoff, classify_client};
use crate::acks::Acks;
use crate::metrics::{Metrics, ResultLabel};
use crate::node::Node;
use crate::registrar::Marks;
use crate::storage::Storage;

/// What the owner writes with, handed over when it starts serving.
pub struct Writer {
    pub node: Arc<Node>,
    pub storage: Arc<Storage>,
    /// With a registrar: a terminating or stale pod's IPs are marked draining there.
    pub marks: Option<Marks>,
    /// The proxy's ACKs since serving began (the taint waits for the first).
    pub acks: Acks,
    pub serving_since: Instant,
    /// Cleared at drain; checked under the lifecycle lock before every write.
    pub active: AtomicBool,
}

impl Writer {
    pub fn new(node: Arc<Node>, storage: Arc<Storage>, marks: Option<Marks>, acks: Acks) -> Self {
        Self {
            node,
            storage,
            marks,
            acks,
            serving_since: Instant::now(),
            active: AtomicBool::new(true),
        }
    }

    fn active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }
}

/// What the owner loop reads and counts into.
pub struct Context {
    pub client: kube::Client,
    pub node_name: String,
    pub grace: Duration,
    pub pods: watch::Receiver<PodView>,
    pub node: watch::Receiver<Option<Vec<Value>>>,
    pub metrics: Arc<Metrics>,
    pub trouble: Trouble,
}

/// Runs the owner's writes until the future is dropped (at drain).
pub async fn run(w: Arc<Writer>, mut cx: Context) {
    let taint = tokio::spawn(remove_taint(
        w.clone(),
        Api::all(cx.client.clone()),
        cx.node_name.clone(),
        cx.node.clone(),
        cx.metrics.clone(),
        cx.trouble.clone(),
    ));
    let _abort = AbortOnDrop(taint);
    let mut stale = Stale::new(cx.grace);
    let mut snapshots = w.node.subscribe();
    info!(
        grace_ms = cx.grace.as_millis() as u64,
        "Kubernetes: the owner writes Terminating marks, collects stale records and removes the startup taint"
    );
    loop {
        mark_terminating(&w, &mut cx).await;
        collect_stale(&w, &mut cx, &mut stale).await;
        let due = stale.next_due().map(tokio::time::Instant::from_std);
        tokio::select! {
            changed = cx.pods.changed() => if changed.is_err() { return },
            // A CNI call changed the pods (a record to mark or to track).
            changed = snapshots.changed() => if changed.is_err() { return },
            () = async { tokio::time::sleep_until(due.expect("guarded")).await }, if due.is_some() => {}
        }
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Rewrites the record of every stored pod that has a deletion timestamp as
/// Terminating: the snapshot first (the proxy starts draining while the record's fsync
/// runs), then the record, then the registrar's drain marks. A record that fails to
/// write is tried again at the next change.
async fn mark_terminating(w: &Writer, cx: &mut Context) {
    let deleting: Vec<String> = cx
        .pods
        .borrow_and_update()
        .deleting()
        .map(String::from)
        .collect();
    if !deleting
        .iter()
        .any(|uid| w.storage.get(uid).is_some_and(|p| !p.terminating))
    {
        return;
    }
    let _lifecycle = w.node.lifecycle().await;
    if !w.active() {
        return;
    }
    let marked: Vec<Pod> = deleting
        .iter()
        .filter_map(|uid| w.storage.get(uid))
        .filter(|p| !p.terminating)
        .map(|p| Pod {
            terminating: true,
            ..p
        })
        .collect();
    w.node.apply(marked.iter().cloned().map(Change::UpsertPod));
    let writes = marked.iter().map(|p| {
        let (storage, record) = (w.storage.clone(), p.clone());
        tokio::task::spawn_blocking(move || storage.put(&record))
    });
    let written = futures::future::join_all(writes).await;
    for (pod, put) in marked.iter().zip(written) {
        match put
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            Ok(_) => {
                cx.metrics.kube_terminating_marks.inc();
                if let Some(marks) = &w.marks {
                    pod.ips.iter().for_each(|ip| marks.drain(*ip));
                }
                info!(uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), ips = ?pod.ips, "pod has a deletion timestamp; record marked Terminating, its endpoints drain");
            }
            Err(e) => {
                error!(uid = %pod.uid, dir = %w.storage.dir().display(), error = %e, "writing the Terminating mark of a pod record failed; the proxy drains it already, the record is retried at the next change")
            }
        }
    }
}

/// Removes the records that the API server has not listed for the grace period, the
/// way a CNI DEL would.
async fn collect_stale(w: &Writer, cx: &mut Context, stale: &mut Stale) {
    let records = w.storage.pods();
    let now = Instant::now();
    let due = stale.check(
        now,
        &cx.pods.borrow(),
        records.iter().map(|p| p.uid.as_str()),
    );
    if due.is_empty() {
        return;
    }
    let _lifecycle = w.node.lifecycle().await;
    if !w.active() {
        return;
    }
    for uid in due {
        let Some(pod) = w.storage.get(&uid) else {
            stale.forget(&uid);
            continue;
        };
        // Re-checked under the lock: the pod may have shown up meanwhile.
        if cx.pods.borrow().contains(&uid) {
            continue;
        }
        let absent_ms = stale
            .absent_for(&uid, now)
            .map_or(0, |d| d.as_millis() as u64);
        match crate::cni::remove_pod(&w.node, &w.storage, w.marks.as_ref(), &pod).await {
            Ok(()) => {
                stale.forget(&uid);
                cx.metrics.stale_records_removed.inc();
                warn!(uid = %uid, pod = %format!("{}/{}", pod.namespace, pod.name), ips = ?pod.ips, absent_ms,
                    "stale pod record removed: the API server has not listed its pod for the grace period and no CNI DEL came");
            }
            Err(e) => {
                error!(uid = %uid, error = %e, "removing a stale pod record failed; retried at the next change")
            }
        }
    }
}

/// Removes the startup taint once the proxy has ACKed a snapshot, and again whenever it
/// comes back while this worker owns the node.
async fn remove_taint(
    w: Arc<Writer>,
    api: Api<KubeNode>,
    name: String,
    mut node: watch::Receiver<Option<Vec<Value>>>,
    metrics: Arc<Metrics>,
    trouble: Trouble,
) {
    let what = Watched {
        resource: "nodes",
        selector: format!("metadata.name={name}"),
    };
    let count = |result: &str| {
        metrics
            .kube_taint_patches
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
    };
    let mut acked = w.acks.subscribe();
    if acked.wait_for(|s| s.is_some()).await.is_err() {
        return;
    }
    info!(
        after_serving_ms = w.serving_since.elapsed().as_millis() as u64,
        "the proxy ACKed its first snapshot; the startup taint may go"
    );
    let mut backoff = backoff();
    let mut fresh: Option<Vec<Value>> = None;
    let mut said_absent = false;
    // Conflicts in a row: the first is retried at once, later ones after the backoff,
    // so that a writer that keeps changing the node is not raced in a tight loop.
    let mut conflicts = 0u32;
    loop {
        let taints = fresh.take().or_else(|| node.borrow_and_update().clone());
        let patch = match taint::decide(
            taint::Owner {
                serving: w.active(),
                acked: true,
            },
            taints.as_deref(),
        ) {
            Decision::Remove { index, patch } => (index, patch),
            Decision::Absent => {
                if !said_absent {
                    info!(node = %name, "the node carries no startup taint");
                    said_absent = true;
                }
                if node.changed().await.is_err() {
                    return;
                }
                continue;
            }
            Decision::Wait(_) if taints.is_none() => {
                // The node watch has not delivered the node (yet): read it.
                match api.get(&name).await {
                    Ok(n) => fresh = Some(taints_of(&n)),
                    Err(e) => failed(&e, "get", &what, &trouble, &mut backoff, &count).await,
                }
                continue;
            }
            Decision::Wait(_) => return,
        };
        let (index, patch) = patch;
        let patch: json_patch::Patch = match serde_json::from_value(patch) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "the startup taint's JSON patch does not decode; not patching");
                return;
            }
        };
        match api
            .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(n) => {
                conflicts = 0;
                count("removed");
                trouble.clear("taint");
                backoff.reset();
                said_absent = true;
                info!(node = %name, taint = %format!("{}:{}", taint::KEY, taint::EFFECT), index,
                    since_serving_ms = w.serving_since.elapsed().as_millis() as u64, "removed the node's startup taint");
                fresh = Some(taints_of(&n));
            }
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => {
                count("conflict");
                conflicts += 1;
                info!(node = %name, code = s.code, message = %s.message, conflicts, "the node's taints changed under the patch; reading the node again");
                if conflicts > 1 {
                    tokio::time::sleep(backoff.next_wait()).await;
                }
                match api.get(&name).await {
                    Ok(n) => fresh = Some(taints_of(&n)),
                    Err(e) => failed(&e, "get", &what, &trouble, &mut backoff, &count).await,
                }
            }
            Err(e) => failed(&e, "patch", &what, &trouble, &mut backoff, &count).await,
        }
    }
}

/// A failed node request: counted, logged, shown, then the backoff.
async fn failed(
    e: &kube::Error,
    verb: &str,
    what: &Watched,
    trouble: &Trouble,
    backoff: &mut Backoff,
    count: &impl Fn(&str),
) {
    let f = classify_client(verb, what, e);
    count(if f.reason == "forbidden" {
        "forbidden"
    } else {
        "error"
    });
    let wait = backoff.next_wait();
    if f.reason == "forbidden" {
        error!(
            retry_in_ms = wait.as_millis() as u64,
            "Kubernetes API: {} (the startup taint stays)", f.message
        );
    } else {
        warn!(
            retry_in_ms = wait.as_millis() as u64,
            "startup taint: {}", f.message
        );
    }
    trouble.set("taint", f.message);
    tokio::time::sleep(wait).await;
}

/// The node's taints as JSON, as [`taint::decide`] reads them.
pub fn taints_of(n: &KubeNode) -> Vec<Value> {
    let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref());
    taints
        .into_iter()
        .flatten()
        .filter_map(|t| serde_json::to_value(t).ok())
        .collect()
}
