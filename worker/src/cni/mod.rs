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
//! Limits ([`Limits`]): connections open at once (counted where they are accepted,
//! `crate::accept`), HTTP/2 streams per connection and the size of a request.
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

use crate::accept::{Acceptor, PeerRate, Tracked};
use crate::metrics::Metrics;
use crate::node::Node;
use crate::storage::{Diff, Storage};

#[cfg(any(test, feature = "testing"))]
pub use ack_source::PublishedAcks;
pub use ack_source::{ACK_TIMEOUT, AckSource};
pub use records::remove_pod;
pub use service::{ADD_BOUND, ANSWER_MARGIN, CniService};

/// How long a draining server lets in-flight calls run after shutdown: an Add's ACK wait
/// plus its storage write, with room to spare.
pub const DRAIN_BOUND: Duration = Duration::from_secs(5);

/// The most connections `cni.sock` holds open at once. Each plugin process opens one for
/// its one call; a node's runtime can start many pods at once, and the burst benchmark
/// runs 1,000 concurrent ADDs, so this leaves twice that.
pub const MAX_CONNECTIONS: usize = 2048;
/// The most HTTP/2 streams (calls) one connection may have open at once; the plugin
/// makes one. A stream past it is refused by HTTP/2 (REFUSED_STREAM).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// The largest request, encoded; a larger one is refused with OUT_OF_RANGE before the
/// service sees it. A request is a few names, a path, the pod's IPs and the previous
/// plugin's result, a few KiB in practice. The plugin reads at most 1 MiB of network
/// config and re-encodes the result it holds (compact, but `1E2` becomes `100.0`), so
/// twice that admits every request the plugin accepts.
pub const MAX_REQUEST: usize = 2 << 20;

/// How fast one process may open connections on `cni.sock`: the whole cap at once,
/// then 100 a second. The plugin is a new process for each call and opens one.
pub const PEER_RATE: PeerRate = PeerRate {
    burst: MAX_CONNECTIONS as u32 + 64,
    per_second: 100,
};

/// The CNI server's limits; ARCHITECTURE.md ("Limits") lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub peer_rate: PeerRate,
    pub max_streams_per_connection: u32,
    pub max_request: usize,
    /// How long in-flight calls may take to finish once `shutdown` resolves.
    pub drain_bound: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            peer_rate: PEER_RATE,
            max_streams_per_connection: MAX_STREAMS_PER_CONNECTION,
            max_request: MAX_REQUEST,
            drain_bound: DRAIN_BOUND,
        }
    }
}

/// Serves the CNI API of `service` on `listener` until `shutdown` resolves, then lets
/// in-flight calls finish (within `limits.drain_bound`) before returning.
pub async fn serve(
    listener: tokio::net::UnixListener,
    service: CniService,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: Limits,
) -> anyhow::Result<()> {
    let drain_bound = limits.drain_bound;
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
    let incoming = allowed_peers(
        listener,
        service.metrics().clone(),
        limits.max_connections,
        limits.peer_rate,
    )?;
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams_per_connection)
        .add_service(CniServer::new(service).max_decoding_message_size(limits.max_request))
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
/// created it: the supervisor), at most `max_connections` open at once. A connection of
/// another peer is closed, logged and counted; one past the cap is closed and counted.
/// Accept errors back off (`crate::accept`).
fn allowed_peers(
    listener: tokio::net::UnixListener,
    metrics: Arc<Metrics>,
    max_connections: usize,
    peer_rate: PeerRate,
) -> anyhow::Result<
    impl tokio_stream::Stream<Item = std::io::Result<Tracked<tokio::net::UnixStream>>>,
> {
    use std::os::unix::fs::MetadataExt;
    let owner = {
        let fd = std::os::fd::AsFd::as_fd(&listener)
            .try_clone_to_owned()
            .context("dup of the cni.sock listener")?;
        std::fs::File::from(fd)
            .metadata()
            .context("fstat of the cni.sock listener")?
            .uid()
    };
    let acceptor =
        Acceptor::new(listener, "cni", max_connections, metrics.clone()).with_peer_rate(peer_rate);
    Ok(acceptor.incoming(move |stream: &tokio::net::UnixStream| match stream.peer_cred() {
        Ok(c) if c.uid() == 0 || c.uid() == owner => true,
        Ok(c) => {
            metrics.cni_refused_peers.inc();
            tracing::warn!(uid = c.uid(), pid = ?c.pid(), allowed = ?[0, owner], "CNI connection from an unexpected uid; closed");
            false
        }
        Err(e) => {
            metrics.cni_refused_peers.inc();
            tracing::warn!(error = %e, "SO_PEERCRED of a CNI connection failed; closed");
            false
        }
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

/// What the takeover's reconcile did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reconciled {
    /// The folder read again, and this many pods changed from the standby's view.
    Read(usize),
    /// Nothing read: the standby had followed every write ([`Followed`]). The owner's scan
    /// (temp files, bad records, and a check of the view) comes after serving
    /// ([`check_followed`]).
    Followed,
}

/// The takeover's reconcile: the pods the previous owner added, changed or removed that
/// this process's view lacks, applied to the node before it serves. When the standby
/// followed every write (`followed` caught up), nothing is read.
pub async fn reconcile(
    node: &Node,
    storage: &Arc<Storage>,
    followed: Option<Followed>,
) -> anyhow::Result<Reconciled> {
    node.gates()
        .wait_for(|g| g.storage_loaded)
        .await
        .context("waiting for pods to load from storage before the takeover reconcile")?;
    let _lifecycle = node.lifecycle().await;
    if followed.as_ref().is_some_and(Followed::caught_up) {
        return Ok(Reconciled::Followed);
    }
    drop(followed);
    let diff = reload(storage)
        .await
        .context("the takeover reconcile's reload of pod storage")?;
    if diff.is_empty() {
        return Ok(Reconciled::Read(0));
    }
    log_diff(&diff, "reconcile");
    node.apply(changes(&diff));
    Ok(Reconciled::Read(diff.len()))
}

/// [`Storage::reload`] off the runtime thread, which meanwhile takes the registry's
/// changes and the proxy's streams: a stat of every record, a read of each that changed.
async fn reload(storage: &Arc<Storage>) -> anyhow::Result<Diff> {
    let s = storage.clone();
    Ok(tokio::task::spawn_blocking(move || s.reload())
        .await
        .context("the reload panicked")??)
}

/// After a [`Reconciled::Followed`] takeover, once serving: the owner's scan of the
/// records folder (temp files removed, bad records quarantined, as a reconcile's reload
/// does), whose view must be the one followed. A difference is applied and logged as an
/// error: the follow missed a write. The number of pods that differed.
pub async fn check_followed(node: &Node, storage: &Arc<Storage>) -> anyhow::Result<usize> {
    let _lifecycle = node.lifecycle().await;
    let diff = reload(storage)
        .await
        .context("the owner's scan of pod storage")?;
    if !diff.is_empty() {
        tracing::error!(pods = diff.len(), dir = %storage.dir().display(), "the standby's view of the pod records missed writes its follow should have read; applying them now");
        log_diff(&diff, "owner's scan");
        node.apply(changes(&diff));
    }
    Ok(diff.len())
}

/// How often a standby looks at the owner's pod records without an inotify event (none
/// arrives where the folder has no inotify; one may be missed on a queue overflow).
const FOLLOW_POLL: Duration = Duration::from_secs(1);

/// A standby follows the owner's pod records as the owner writes them: each ADD's and
/// DEL's record, and each Terminating mark, reaches the standby's snapshot before the
/// takeover, so its reconcile finds (nearly) nothing. Read only ([`Storage::follow`]),
/// woken by inotify on the records folder, until `stop` turns true: the agent sets it
/// when the node is handed over, before this process writes; a look waiting for the
/// lifecycle lock then reads nothing, and one under way is applied first. The uids it
/// added go into `added`: the takeover waits for their SVIDs as it does for those its
/// reconcile adds. Returns, once stopped, what the takeover's reconcile needs to know
/// whether the folder holds anything its looks have not read ([`Followed`]).
pub async fn follow(
    node: Arc<Node>,
    storage: Arc<Storage>,
    added: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Followed {
    let mut events =
        crate::registry::DirEvents::on(storage.dir(), Box::new(crate::storage::is_record_name));
    if events.is_none() {
        tracing::warn!(dir = %storage.dir().display(), "no inotify on the pod records folder; the standby looks at it every {FOLLOW_POLL:?}");
    }
    // Every relevant event read so far was followed by a complete look. False until the
    // first look, which comes at once: a record written between `Storage::open` and the
    // watch has no event.
    let mut caught_up = false;
    while !*stop.borrow() {
        // Under the lifecycle lock, which the takeover's reconcile takes too: a look that
        // began is applied before the reconcile reads the folder.
        let lifecycle = node.lifecycle().await;
        if *stop.borrow() {
            break;
        }
        // Off the runtime thread: the look stats every record.
        let s = storage.clone();
        let looked = tokio::task::spawn_blocking(move || s.follow()).await;
        caught_up = matches!(looked, Ok(Ok(_)));
        let Ok(looked) = looked else { break };
        match looked {
            Ok(diff) if diff.is_empty() => {}
            Ok(diff) => {
                log_diff(&diff, "standby");
                added
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(diff.added.iter().map(|p| p.uid.clone()));
                node.apply(changes(&diff));
            }
            Err(e) => {
                tracing::warn!(dir = %storage.dir().display(), error = %e, "the standby cannot read the owner's pod records; it takes them at the takeover")
            }
        }
        drop(lifecycle);
        let next = async {
            match &mut events {
                Some(e) => e.next(FOLLOW_POLL).await,
                None => {
                    tokio::time::sleep(FOLLOW_POLL).await;
                    false
                }
            }
        };
        tokio::select! {
            biased;
            _ = stop.changed() => break,
            event = next => {
                if event {
                    caught_up = false;
                }
            }
        }
    }
    Followed { events, caught_up }
}

/// What a stopped standby's [`follow`] leaves the takeover: its inotify watch on the
/// records folder, and whether every event read on it was followed by a complete look
/// (and one look came after the watch was made).
pub struct Followed {
    events: Option<crate::registry::DirEvents>,
    caught_up: bool,
}

impl Followed {
    /// Whether the standby's view is the folder's: its last look read the folder after
    /// every write the watch reported, and no event is queued now. Called once the node
    /// is handed over: the previous owner's writes all came before it released the node,
    /// and the kernel queues a rename's event before the rename returns, so a write the
    /// looks missed has its event here (or an overflow, which counts as one).
    fn caught_up(&self) -> bool {
        self.caught_up && self.events.as_ref().is_some_and(|e| !e.pending())
    }
}

impl Drop for Followed {
    fn drop(&mut self) {
        // Closing an inotify instance waits for an SRCU grace period, 10 to 20 ms on a
        // busy node: not on the runtime thread, in the middle of a takeover.
        if let (Some(e), Ok(rt)) = (self.events.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn_blocking(move || drop(e));
        }
    }
}

/// A storage diff as changes to the snapshot inputs.
fn changes(diff: &Diff) -> Vec<Change> {
    let removed = diff
        .removed
        .iter()
        .map(|p| Change::RemovePod(p.uid.clone()));
    let added = diff
        .added
        .iter()
        .chain(diff.updated.iter().map(|u| &u.new))
        .map(|p| Change::UpsertPod(p.clone()));
    removed.chain(added).collect()
}

/// One line per pod, `by` (the takeover's reconcile, or the standby following) first.
fn log_diff(diff: &Diff, by: &str) {
    for p in &diff.added {
        tracing::info!(uid = %p.uid, pod = %format!("{}/{}", p.namespace, p.name), "{by}: pod added during the overlap");
    }
    for u in &diff.updated {
        tracing::info!(uid = %u.new.uid, pod = %format!("{}/{}", u.new.namespace, u.new.name), "{by}: pod rewritten during the overlap");
    }
    for p in &diff.removed {
        tracing::info!(uid = %p.uid, pod = %format!("{}/{}", p.namespace, p.name), "{by}: pod removed during the overlap");
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod transport_tests;
