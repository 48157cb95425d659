//! The one owner of the snapshot inputs and of the lifecycle lock.
//!
//! CNI calls, the takeover reconcile, the registry feed and the capture projection all
//! change the inputs through [`Node::update`]; each change rebuilds the snapshot with the
//! pure [`snapshot::build`] and publishes it on a watch channel when it differs. Adapters
//! (xDS, health) only read that channel.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use crate::snapshot::{self, Inputs, Snapshot};

/// What the first serve and standby completeness wait for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gates {
    /// The registry view has loaded at least once (an absent registry file counts).
    pub registry_loaded: bool,
    /// The capture projection has landed (the embedded default counts).
    pub capture_landed: bool,
    /// Pods have been loaded from storage: the view the takeover diff is against.
    pub storage_loaded: bool,
}

pub struct Node {
    inputs: Mutex<Inputs>,
    snapshots: watch::Sender<Arc<Snapshot>>,
    gates: watch::Sender<Gates>,
    /// Orders CNI Add/Del and the takeover reconcile. Held across the ACK wait of an Add
    /// only for the storage write and the snapshot change, never across the wait itself.
    lifecycle: tokio::sync::Mutex<()>,
}

impl Node {
    pub fn new(inputs: Inputs) -> Arc<Self> {
        let first = Arc::new(snapshot::build(&inputs));
        Arc::new(Self {
            inputs: Mutex::new(inputs),
            snapshots: watch::Sender::new(first),
            gates: watch::Sender::new(Gates::default()),
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

    /// Changes the inputs, rebuilds, and publishes the snapshot if it changed.
    /// Returns the snapshot that holds the change.
    pub fn update(&self, change: impl FnOnce(&mut Inputs)) -> Arc<Snapshot> {
        let mut inputs = lock(&self.inputs);
        change(&mut inputs);
        let next = snapshot::build(&inputs);
        // Publishing while the inputs are locked keeps snapshots in input order.
        let mut published = None;
        self.snapshots.send_if_modified(|current| {
            if **current == next {
                published = Some(current.clone());
                false
            } else {
                let next = Arc::new(next);
                published = Some(next.clone());
                *current = next;
                true
            }
        });
        published.expect("send_if_modified ran the closure")
    }

    /// A copy of the current inputs.
    pub fn inputs(&self) -> Inputs {
        lock(&self.inputs).clone()
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

/// A poisoned inputs lock means a panic mid-update; the inputs are plain data and the
/// next update rebuilds from them, so carry on rather than cascade the panic.
fn lock(m: &Mutex<Inputs>) -> MutexGuard<'_, Inputs> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
