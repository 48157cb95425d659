//! Taking a pod out: its record, its place in the snapshot and its registry endpoints.
//! What a CNI DEL does once it has found the pod, and what the owner's stale-record
//! collection does for a pod whose DEL never came.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use aether_model::{Change, Pod};

use crate::node::Node;
use crate::registrar::Marks;
use crate::storage::{Storage, StorageError};

/// With a registrar, first makes the marks of `pod`'s IPs durable (see
/// [`crate::registrar::pending`]), so that they outlive this process even when it dies
/// right after the DEL is answered; then removes `pod`'s record, takes it out of the node,
/// and queues the marks. An IP that another local pod holds is not marked: the registry
/// keys endpoints by IP, and the mark would land on that pod. The caller holds the node's
/// lifecycle lock.
///
/// A record file that cannot be removed (a read-only or failing folder) does not keep the
/// pod: it leaves the view and the node all the same, and storage retries the removal
/// ([`Storage::remove_or_retry`]); the pod is gone from the data plane, which is what
/// the caller asked.
pub async fn remove_pod(
    node: &Node,
    storage: &Arc<Storage>,
    marks: Option<&Marks>,
    pod: &Pod,
) -> Result<(), StorageError> {
    let to_mark: Vec<IpAddr> = match marks {
        Some(_) => {
            let held: BTreeSet<IpAddr> = node.with_inputs(|i| {
                i.pods
                    .values()
                    .filter(|p| p.uid != pod.uid)
                    .flat_map(|p| p.ips.iter().copied())
                    .collect()
            });
            pod.ips
                .iter()
                .filter(|ip| !held.contains(ip))
                .copied()
                .collect()
        }
        None => Vec::new(),
    };
    if let Some(marks) = marks {
        marks.keep(&to_mark).await;
    }
    let (s, uid) = (storage.clone(), pod.uid.clone());
    match tokio::task::spawn_blocking(move || s.remove_or_retry(&uid)).await {
        Ok(result) => {
            if let Some(e) = result?.deferred {
                tracing::warn!(uid = %pod.uid, error = %e, "the pod is removed but its record is not yet; storage retries the removal");
            }
        }
        Err(e) => {
            return Err(StorageError::Io {
                op: "removing",
                path: storage.dir().join(&pod.uid),
                source: std::io::Error::other(e.to_string()),
            });
        }
    };
    node.apply([Change::RemovePod(pod.uid.clone())]);
    if let Some(marks) = marks {
        to_mark.into_iter().for_each(|ip| marks.drain(ip));
    }
    Ok(())
}
