//! What the proxy has ACKed, shared by every ADS stream: the CNI ADD waits on it. The
//! xDS adapter publishes; the CNI service and the takeover read.

use std::sync::Arc;
use std::time::Duration;

use aether_model::Snapshot;
use tokio::sync::watch;

/// What the proxy has ACKed, shared by every stream: the CNI ADD waits on it.
#[derive(Clone)]
pub struct Acks {
    /// The newest snapshot whose every resource type the proxy has ACKed.
    acked: watch::Sender<Option<Arc<Snapshot>>>,
    /// Whether a proxy started a stream holding no cluster (a fresh proxy, not one
    /// resuming).
    fresh: watch::Sender<bool>,
}

impl Default for Acks {
    fn default() -> Self {
        Self {
            acked: watch::Sender::new(None),
            fresh: watch::Sender::new(false),
        }
    }
}

impl Acks {
    /// Waits until the proxy has ACKed a snapshot for which `holds` is true.
    /// Returns false on timeout.
    pub async fn wait_until(&self, holds: impl Fn(&Snapshot) -> bool, timeout: Duration) -> bool {
        wait_for(
            self.acked.subscribe(),
            |s| s.as_deref().is_some_and(&holds),
            timeout,
        )
        .await
    }

    /// The newest fully ACKed snapshot, if any.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.acked.borrow().clone()
    }

    /// Every fully ACKed snapshot from now on.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Snapshot>>> {
        self.acked.subscribe()
    }

    /// Whether a proxy has started a stream holding no cluster, from now on.
    pub fn fresh(&self) -> watch::Receiver<bool> {
        self.fresh.subscribe()
    }

    pub(crate) fn fresh_proxy(&self) {
        self.fresh.send_if_modified(|f| !std::mem::replace(f, true));
    }

    pub(crate) fn publish(&self, s: &Arc<Snapshot>) {
        self.acked.send_if_modified(|cur| {
            if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, s)) {
                false
            } else {
                *cur = Some(s.clone());
                true
            }
        });
    }
}

/// Waits until `rx`'s value satisfies `cond`, for at most `timeout`. False on timeout or
/// when the sender is gone.
pub async fn wait_for<T>(
    mut rx: watch::Receiver<T>,
    cond: impl FnMut(&T) -> bool,
    timeout: Duration,
) -> bool {
    matches!(
        tokio::time::timeout(timeout, rx.wait_for(cond)).await,
        Ok(Ok(_))
    )
}
