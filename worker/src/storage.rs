//! Pod storage: one JSON record per pod in `<state-dir>/pods/`, written atomically;
//! `reload()` returns what changed since the records the caller built from.
//!
//! INTERFACE STUB (owned by the pod-lifecycle work): keep `Storage::open` and
//! `Storage::pods` with these signatures; the agent driver calls them.

use std::path::Path;

use crate::snapshot::Pod;

pub struct Storage {}

impl Storage {
    /// Opens (creating) `<state_dir>/pods` and loads every valid record.
    pub fn open(state_dir: &Path, metrics: std::sync::Arc<crate::metrics::Metrics>) -> anyhow::Result<Self> {
        let _ = (state_dir, metrics);
        Ok(Self {})
    }

    /// The pods loaded by `open` or the last `reload`.
    pub fn pods(&self) -> Vec<Pod> {
        Vec::new()
    }
}
