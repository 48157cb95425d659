//! The CNI API service (`aether.cni.v1`): Add, Del and Check, served on the `cni.sock`
//! listening fd handed over at takeover.
//!
//! INTERFACE STUB (owned by the pod-lifecycle work): keep `serve` and `reconcile` with
//! these signatures; the agent driver calls them.

use std::future::Future;
use std::sync::Arc;

use crate::metrics::Metrics;
use crate::node::Node;
use crate::storage::Storage;
use crate::xds::Acks;

/// Serves the CNI API on `listener` until `shutdown` resolves, then lets in-flight calls
/// finish (bounded) before returning.
pub async fn serve(
    listener: tokio::net::UnixListener,
    node: Arc<Node>,
    storage: Arc<Storage>,
    acks: Acks,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let _ = (listener, node, storage, acks, metrics);
    shutdown.await;
    Ok(())
}

/// The takeover reconcile: applies the storage diff (what the previous owner added,
/// rewrote or removed during the overlap) to the node, under the lifecycle lock.
/// Returns how many pods changed.
pub async fn reconcile(node: &Node, storage: &Storage) -> anyhow::Result<usize> {
    let _ = (node, storage);
    Ok(0)
}
