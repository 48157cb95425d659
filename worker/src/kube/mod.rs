//! The Kubernetes source: this node's pods and this node's object, watched through the
//! API server with kube-rs, and the owner's writes that follow from them.
//!
//! - **Pods** (field selector `spec.nodeName=<node>`): a pod with a deletion timestamp
//!   has its record rewritten as Terminating, which the proxy sees as DRAINING (and, with
//!   a registrar, its endpoints get a drain mark); a record whose pod a current, complete
//!   list no longer has is removed after `--stale-record-grace`, as a CNI DEL would.
//! - **Node** (field selector `metadata.name=<node>`): the owner removes the startup
//!   taint `aether.io/agent-not-ready:NoSchedule` once its CNI API serves and the proxy
//!   has ACKed a snapshot, with a JSON patch that tests the taint before removing it.
//!
//! Owner and standby both watch, from process start; only the owner writes, through the
//! [`Writer`] the driver hands over when it serves (a standby has none). A standby picks
//! up the Terminating records the old owner wrote through the takeover reconcile of
//! storage, like any other record change.
//!
//! The API server is never a gate: the agent serves from storage and the registry
//! whether or not it answers. While it does not (down, 403, bad credentials), the watches
//! retry with a jittered backoff (0.1 s to 30 s), `/ready` carries a `kubernetes`
//! problem naming the error, and the failures are logged and counted.

mod access;
mod owner;
mod stale;
mod taint;
mod view;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as KubeNode, Pod as KubePod};
use kube::api::Api;
use kube::runtime::watcher::Event;
use serde_json::Value;
use tracing::{error, info};

pub use access::{Access, AccessError, SERVICE_ACCOUNT_DIR};
pub use owner::Writer;
pub use view::{ApiPod, PodEvent, PodView};
pub use watch::PROBLEM;

use crate::health::Reporter;
use crate::metrics::Metrics;
use watch::{Step, Trouble, Watched, backoff};

/// The running Kubernetes source: the driver tells it when this worker owns the node.
pub struct Kube {
    owner: tokio::sync::watch::Sender<Option<Arc<Writer>>>,
    pods: tokio::sync::watch::Sender<PodView>,
    _task: tokio::task::JoinHandle<()>,
}

/// What the source needs besides the access.
pub struct Options {
    pub node_name: String,
    pub stale_grace: Duration,
}

impl Kube {
    /// Starts the watches (in a standby too). Nothing is written until [`Kube::serve`].
    pub fn spawn(
        access: Access,
        options: Options,
        metrics: Arc<Metrics>,
        problems: Reporter,
    ) -> Kube {
        let (owner, owner_rx) = tokio::sync::watch::channel(None);
        let pods = tokio::sync::watch::Sender::new(PodView::default());
        let task = tokio::spawn(run(
            access,
            options,
            metrics,
            Trouble::new(problems),
            owner_rx,
            pods.clone(),
        ));
        Kube {
            owner,
            pods,
            _task: task,
        }
    }

    /// This node's pods as the API server lists them, as the watch keeps them.
    pub fn pods(&self) -> tokio::sync::watch::Receiver<PodView> {
        self.pods.subscribe()
    }

    /// This worker serves the node: from now on it writes.
    pub fn serve(&self, writer: Writer) {
        self.owner.send_replace(Some(Arc::new(writer)));
    }

    /// The drain began: nothing is written from now on. Returns at once; a write in
    /// progress holds the lifecycle lock, which the CNI API's fence waits for.
    pub fn stop(&self) {
        if let Some(w) = self.owner.send_replace(None) {
            w.active.store(false, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

async fn run(
    access: Access,
    options: Options,
    metrics: Arc<Metrics>,
    trouble: Trouble,
    mut owner: tokio::sync::watch::Receiver<Option<Arc<Writer>>>,
    pods_tx: tokio::sync::watch::Sender<PodView>,
) {
    let mut backoff = backoff();
    let client = loop {
        match access.client().await {
            Ok(c) => break c,
            Err(e) => {
                let wait = backoff.next_wait();
                error!(access = %access, error = %watch::chain(&e), retry_in_ms = wait.as_millis() as u64, "Kubernetes API client cannot be built");
                trouble.set("client", watch::chain(&e));
                tokio::time::sleep(wait).await;
            }
        }
    };
    trouble.clear("client");
    info!(access = %access, node = %options.node_name, "Kubernetes API: watching this node's pods and node object");

    let node_tx: tokio::sync::watch::Sender<Option<Vec<Value>>> =
        tokio::sync::watch::Sender::new(None);
    let pods = Watched {
        resource: "pods",
        selector: format!("spec.nodeName={}", options.node_name),
    };
    let nodes = Watched {
        resource: "nodes",
        selector: format!("metadata.name={}", options.node_name),
    };
    let pods_task = {
        let (tx, m, t) = (pods_tx.clone(), metrics.clone(), trouble.clone());
        tokio::spawn(watch::run(
            Api::<KubePod>::all(client.clone()),
            pods,
            m,
            t,
            move |step| {
                if let Some(e) = pod_event(step) {
                    let visible = !matches!(e, PodEvent::Init | PodEvent::Listed(..));
                    tx.send_if_modified(|v| {
                        v.apply(e);
                        visible
                    });
                }
            },
        ))
    };
    let node_task = {
        let (tx, m, t) = (node_tx.clone(), metrics.clone(), trouble.clone());
        tokio::spawn(watch::run(
            Api::<KubeNode>::all(client.clone()),
            nodes,
            m,
            t,
            move |step| match step {
                Step::Event(Event::Apply(n) | Event::InitApply(n)) => {
                    tx.send_replace(Some(owner::taints_of(&n)));
                }
                Step::Event(Event::Delete(_)) => {
                    tx.send_replace(None);
                }
                _ => {}
            },
        ))
    };
    let _tasks = (Abort(pods_task), Abort(node_task));

    loop {
        let writer = owner.borrow_and_update().clone();
        match writer {
            Some(w) => {
                let cx = owner::Context {
                    client: client.clone(),
                    node_name: options.node_name.clone(),
                    grace: options.stale_grace,
                    pods: pods_tx.subscribe(),
                    node: node_tx.subscribe(),
                    metrics: metrics.clone(),
                    trouble: trouble.clone(),
                };
                tokio::select! {
                    () = owner::run(w, cx) => {}
                    changed = owner.changed() => if changed.is_err() { return },
                }
            }
            None => {
                if owner.changed().await.is_err() {
                    return;
                }
            }
        }
    }
}

struct Abort(tokio::task::JoinHandle<()>);

impl Drop for Abort {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A pod watch step as the view's event: the boundary where Kubernetes' types end.
fn pod_event(step: Step<KubePod>) -> Option<PodEvent> {
    let convert = |p: &KubePod| -> Option<(String, ApiPod)> {
        let m = &p.metadata;
        let uid = m.uid.clone()?;
        Some((
            uid,
            ApiPod {
                namespace: m.namespace.clone().unwrap_or_default(),
                name: m.name.clone().unwrap_or_default(),
                deleting: m.deletion_timestamp.is_some(),
                ips: p
                    .status
                    .iter()
                    .flat_map(|s| s.pod_ips.iter().flatten())
                    .filter_map(|ip| ip.ip.parse().ok())
                    .collect(),
            },
        ))
    };
    Some(match step {
        Step::Event(Event::Init) => PodEvent::Init,
        Step::Event(Event::InitApply(p)) => {
            let (uid, pod) = convert(&p)?;
            PodEvent::Listed(uid, pod)
        }
        Step::Event(Event::InitDone) => PodEvent::InitDone,
        Step::Event(Event::Apply(p)) => {
            let (uid, pod) = convert(&p)?;
            PodEvent::Applied(uid, pod)
        }
        Step::Event(Event::Delete(p)) => PodEvent::Deleted(p.metadata.uid.clone()?),
        Step::Failed => PodEvent::Failed,
        Step::Resumed => PodEvent::Resumed,
    })
}
