//! The ADS server (state of the world) for LDS, RDS, CDS and EDS, served on the
//! `xds.sock` listening fd handed over at takeover.
//!
//! INTERFACE STUB (owned by the xDS work): keep `Acks`, `Acks::wait_until` and `serve`
//! with these signatures; the agent driver and the CNI service call them.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::snapshot::Snapshot;

/// What the proxy has ACKed, shared by every stream: the CNI ADD waits on it.
#[derive(Clone)]
pub struct Acks {
    /// The newest snapshot whose every resource type the proxy has ACKed.
    acked: watch::Sender<Option<Arc<Snapshot>>>,
}

impl Default for Acks {
    fn default() -> Self {
        Self { acked: watch::Sender::new(None) }
    }
}

impl Acks {
    /// Waits until the proxy has ACKed a snapshot for which `holds` is true.
    /// Returns false on timeout.
    pub async fn wait_until(&self, holds: impl Fn(&Snapshot) -> bool, timeout: Duration) -> bool {
        let mut rx = self.acked.subscribe();
        let wait = rx.wait_for(|s| s.as_deref().is_some_and(&holds));
        matches!(tokio::time::timeout(timeout, wait).await, Ok(Ok(_)))
    }
}

/// Serves ADS on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::UnixListener,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    acks: Acks,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let _ = (listener, snapshots, acks, metrics);
    shutdown.await;
    Ok(())
}
