//! The CNI API service (`aether.cni.v1`): Add, Del and Check, served on the `cni.sock`
//! listening fd handed over at takeover, and the takeover reconcile.
//!
//! Ordering: Add, Del and [`reconcile`] each change storage and the node inside the node's
//! lifecycle lock, so the folder and the snapshot inputs move together and the takeover
//! diff never interleaves with a call. An Add's ACK wait happens after the lock is
//! released. The change itself runs in a task of its own, so a caller that hangs up
//! mid-call cannot leave a record written but not in the snapshot.
//!
//! Peers: `cni.sock` is 0600, so only its owner (the supervisor's uid) and root can
//! connect; each accepted connection is checked again with SO_PEERCRED, so a socket
//! whose mode was opened by mistake still answers no one else.
//!
//! Graceful stop: on shutdown the server stops accepting, lets in-flight calls (with their
//! ACK wait) finish within [`DRAIN_BOUND`], then fences: it takes the lifecycle lock and
//! marks the service drained, so any call still queued is turned away as `Unavailable`
//! (the plugin retries against the next owner) instead of writing half a change.

mod ack_source;
mod records;
mod service;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use aether_model::Change;
use anyhow::Context;
use shared_proto::cni::cni_server::CniServer;
use tokio_stream::wrappers::UnixListenerStream;

use crate::acks::Acks;
use crate::metrics::Metrics;
use crate::node::Node;
use crate::storage::{Diff, Storage};

#[cfg(any(test, feature = "testing"))]
pub use ack_source::PublishedAcks;
pub use ack_source::{ACK_TIMEOUT, AckSource};
pub use records::remove_pod;
pub use service::CniService;

/// How long a draining server lets in-flight calls run after shutdown: an Add's ACK wait
/// plus its storage write, with room to spare.
pub const DRAIN_BOUND: Duration = Duration::from_secs(5);

/// Serves the CNI API on `listener` until `shutdown` resolves, then lets in-flight calls
/// finish (bounded) before returning. With `marks`, a DEL also marks the pod's registry
/// endpoints draining at the registrar.
pub async fn serve(
    listener: tokio::net::UnixListener,
    node: Arc<Node>,
    storage: Arc<Storage>,
    acks: Acks,
    metrics: Arc<Metrics>,
    marks: Option<crate::registrar::Marks>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let mut service = CniService::new(node, storage, Arc::new(acks), metrics);
    if let Some(marks) = marks {
        service = service.with_drain_marks(marks);
    }
    serve_service(listener, service, shutdown, DRAIN_BOUND).await
}

/// [`serve`] with any service configuration and drain bound, for tests.
#[cfg(any(test, feature = "testing"))]
pub async fn serve_with(
    listener: tokio::net::UnixListener,
    service: CniService,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_bound: Duration,
) -> anyhow::Result<()> {
    serve_service(listener, service, shutdown, drain_bound).await
}

async fn serve_service(
    listener: tokio::net::UnixListener,
    service: CniService,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_bound: Duration,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        // An error means the sender is gone without sending: it only drops after sending.
        let _ = rx.wait_for(|s| *s).await;
    };

    let fence = service.clone();
    let incoming = allowed_peers(listener, service.metrics().clone())?;
    let server = tonic::transport::Server::builder()
        .add_service(CniServer::new(service))
        .serve_with_incoming_shutdown(incoming, stopped(stop_rx.clone()));
    let drain_expired = async {
        stopped(stop_rx).await;
        tracing::info!(bound = ?drain_bound, "CNI API draining: no new calls, finishing in-flight ones");
        tokio::time::sleep(drain_bound).await;
    };
    let result = tokio::select! {
        r = server => r.context("serving the CNI API"),
        () = drain_expired => {
            tracing::warn!(bound = ?drain_bound, "in-flight CNI calls did not finish within the drain bound; abandoning them");
            Ok(())
        }
    };
    fence.fence().await;
    result
}

/// The accepted connections whose peer is root or the socket's owner (the uid that
/// created it: the supervisor); any other is closed, logged and counted.
fn allowed_peers(
    listener: tokio::net::UnixListener,
    metrics: Arc<Metrics>,
) -> anyhow::Result<impl tokio_stream::Stream<Item = std::io::Result<tokio::net::UnixStream>>> {
    use std::os::unix::fs::MetadataExt;
    use tokio_stream::StreamExt;
    let owner = {
        let fd = std::os::fd::AsFd::as_fd(&listener).try_clone_to_owned().context("dup of the cni.sock listener")?;
        std::fs::File::from(fd).metadata().context("fstat of the cni.sock listener")?.uid()
    };
    Ok(UnixListenerStream::new(listener).filter_map(move |conn| match conn {
        Err(e) => Some(Err(e)),
        Ok(stream) => match stream.peer_cred() {
            Ok(c) if c.uid() == 0 || c.uid() == owner => Some(Ok(stream)),
            Ok(c) => {
                metrics.cni_refused_peers.inc();
                tracing::warn!(uid = c.uid(), pid = ?c.pid(), allowed = ?[0, owner], "CNI connection from an unexpected uid; closed");
                None
            }
            Err(e) => {
                metrics.cni_refused_peers.inc();
                tracing::warn!(error = %e, "SO_PEERCRED of a CNI connection failed; closed");
                None
            }
        },
    }))
}

/// Loads the stored pods into the node and opens the `storage_loaded` gate: the view the
/// takeover diff is against. Call it once, right after [`Storage::open`], before the
/// first snapshot is served (the worker's start does, and so do the tests). Returns how
/// many pods it loaded.
pub fn load(node: &Node, storage: &Storage) -> usize {
    let pods = storage.pods();
    let n = pods.len();
    node.apply(pods.into_iter().map(Change::UpsertPod));
    node.set_gate(|g| g.storage_loaded = true);
    tracing::info!(pods = n, dir = %storage.dir().display(), "loaded pods from storage");
    n
}

/// The takeover reconcile: applies the storage diff (what the previous owner added,
/// rewrote or removed during the overlap) to the node, under the lifecycle lock.
/// Returns how many pods changed.
///
/// It first waits for the `storage_loaded` gate ([`load`]): the diff is against the view
/// the node was built from. It reads the folder inline: a takeover step runs before
/// either socket is served, and the folder holds one small file per local pod.
pub async fn reconcile(node: &Node, storage: &Storage) -> anyhow::Result<usize> {
    node.gates()
        .wait_for(|g| g.storage_loaded)
        .await
        .context("waiting for pods to load from storage before the takeover reconcile")?;
    let _lifecycle = node.lifecycle().await;
    let diff = storage.reload().context("reloading pod storage for the takeover reconcile")?;
    if diff.is_empty() {
        return Ok(0);
    }
    log_diff(&diff);
    node.apply(changes(&diff));
    Ok(diff.len())
}

/// A storage diff as changes to the snapshot inputs.
fn changes(diff: &Diff) -> Vec<Change> {
    let removed = diff.removed.iter().map(|p| Change::RemovePod(p.uid.clone()));
    let added = diff.added.iter().chain(diff.updated.iter().map(|u| &u.new)).map(|p| Change::UpsertPod(p.clone()));
    removed.chain(added).collect()
}

fn log_diff(diff: &Diff) {
    for p in &diff.added {
        tracing::info!(uid = %p.uid, pod = %format!("{}/{}", p.namespace, p.name), "reconcile: pod added during the overlap");
    }
    for u in &diff.updated {
        tracing::info!(uid = %u.new.uid, pod = %format!("{}/{}", u.new.namespace, u.new.name), "reconcile: pod rewritten during the overlap");
    }
    for p in &diff.removed {
        tracing::info!(uid = %p.uid, pod = %format!("{}/{}", p.namespace, p.name), "reconcile: pod removed during the overlap");
    }
}

#[cfg(test)]
mod tests;
