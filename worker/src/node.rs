//! The one owner of the snapshot inputs and of the lifecycle lock.
//!
//! Every source changes the inputs through [`Node::apply`], the in-process change API:
//! CNI calls, the takeover reconcile, the registry feed and the capture projection each
//! send [`Change`]s, and the model's incremental [`Builder`] rebuilds only what they
//! touch. A new snapshot is published on a watch channel when a resource changed; the
//! adapters (xDS, health) only read that channel.

use std::sync::{Arc, Mutex, MutexGuard};

use aether_model::{Builder, Change, Gates, Inputs, Snapshot};
use tokio::sync::watch;

pub struct Node {
    builder: Mutex<Builder>,
    snapshots: watch::Sender<Arc<Snapshot>>,
    gates: watch::Sender<Gates>,
    /// Orders CNI Add/Del and the takeover reconcile. Held across the ACK wait of an Add
    /// only for the storage write and the snapshot change, never across the wait itself.
    lifecycle: tokio::sync::Mutex<()>,
}

impl Node {
    pub fn new(inputs: Inputs) -> Arc<Self> {
        // Without identity there is no SVID to wait for.
        let gates = Gates {
            agent_svid: !inputs.identity.enabled(),
            ..Gates::default()
        };
        let builder = Builder::new(inputs);
        let first = builder.snapshot().clone();
        Arc::new(Self {
            builder: Mutex::new(builder),
            snapshots: watch::Sender::new(first),
            gates: watch::Sender::new(gates),
            lifecycle: tokio::sync::Mutex::new(()),
        })
    }

    /// The latest snapshot and every later one.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.snapshots.subscribe()
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshots.borrow().clone()
    }

    /// Applies `changes` in order as one step: the builder rebuilds what they touch, and
    /// one snapshot is published if any resource changed. Returns the snapshot that holds
    /// the changes (the current one when nothing changed).
    pub fn apply(&self, changes: impl IntoIterator<Item = Change>) -> Arc<Snapshot> {
        let mut builder = lock(&self.builder);
        match builder.apply(changes) {
            Some(next) => {
                // Publishing while the builder is locked keeps snapshots in change order.
                self.snapshots.send_replace(next.clone());
                next
            }
            None => builder.snapshot().clone(),
        }
    }

    /// The local pod `uid`, if the inputs hold it.
    pub fn pod(&self, uid: &str) -> Option<aether_model::Pod> {
        lock(&self.builder).inputs().pods.get(uid).cloned()
    }

    /// A copy of the current inputs (at mesh scale a large copy: for tests and tools).
    pub fn inputs(&self) -> Inputs {
        lock(&self.builder).inputs().clone()
    }

    /// [`aether_model::Builder::registry_generation`]: equal numbers, the same registry.
    pub fn registry_generation(&self) -> u64 {
        lock(&self.builder).registry_generation()
    }

    /// Runs `f` on the current inputs without copying them. `f` runs under the builder's
    /// lock, so every change waits for it: keep it short and never call back into the node.
    pub fn with_inputs<R>(&self, f: impl FnOnce(&Inputs) -> R) -> R {
        f(lock(&self.builder).inputs())
    }

    pub fn gates(&self) -> watch::Receiver<Gates> {
        self.gates.subscribe()
    }

    pub fn set_gate(&self, set: impl FnOnce(&mut Gates)) {
        self.gates.send_if_modified(|g| {
            let before = *g;
            set(g);
            before != *g
        });
    }

    pub async fn lifecycle(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.lifecycle.lock().await
    }
}

/// A poisoned builder lock means a panic mid-change. The builder's state is plain data
/// that the next change builds on, so carry on rather than cascade the panic.
fn lock(m: &Mutex<Builder>) -> MutexGuard<'_, Builder> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
