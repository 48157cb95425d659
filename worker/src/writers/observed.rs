//! The observed upstreams: the mesh services (clusters) the node's pods have called, as
//! the proxy showed them by asking for their clusters on demand.
//!
//! - Every agent restores the set from `<state-dir>/observed-upstreams.json` at start,
//!   and again at takeover (the previous owner flushed it before the lock passed).
//! - Only the owner writes: [`run_writer`] starts when the worker serves, writes each
//!   change (batched over [`FLUSH_DELAY`]), and [`Observed::flush`] writes what is left
//!   when the owner drains, before it releases the node. A standby writes nothing.
//! - A file that does not parse is logged and ignored: the set only decides what the
//!   proxy gets up front, and the proxy asks again for anything missing.
//!
//! With `--on-demand-clusters` the proxy receives only these clusters (and the node's own
//! pods') with its wildcard subscription, and fetches any other on its first request to
//! it; the restored set makes a new owner's answer to the proxy's reconnect the same as
//! the old owner's.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;

/// How long the writer waits after a change for more before it writes.
pub const FLUSH_DELAY: Duration = Duration::from_millis(200);
/// The file's name in the state folder.
pub const FILE: &str = "observed-upstreams.json";
/// More names than any mesh this agent serves; a larger file is not one of ours.
const MAX_NAMES: usize = 200_000;

#[derive(serde::Serialize, serde::Deserialize)]
struct Doc {
    clusters: BTreeSet<String>,
}

/// The observed upstreams of the node, shared by the ADS streams (which add to it) and
/// the writer.
pub struct Observed {
    path: PathBuf,
    names: Mutex<BTreeSet<String>>,
    /// Bumped on every change; the writer waits on it.
    changes: watch::Sender<u64>,
    /// The change count last written; serializes writes.
    written: Mutex<u64>,
    /// Set, under `written`, by the drain's [`Observed::flush_final`]: the node is passing
    /// to the successor, so nothing more is written (an ADS stream still open until the
    /// successor serves may still add names; the proxy asks the successor for them again).
    released: std::sync::atomic::AtomicBool,
    /// The same, for waiters (tests, and the drain's log).
    flushed: watch::Sender<u64>,
}

impl Observed {
    /// Reads the set from `<state_dir>/observed-upstreams.json`; an absent file is an empty
    /// set, a bad one is logged and ignored.
    pub fn restore(state_dir: &Path) -> Arc<Self> {
        let path = state_dir.join(FILE);
        let names = read(&path);
        tracing::info!(file = %path.display(), clusters = names.len(), "observed upstreams restored");
        Arc::new(Self {
            path,
            names: Mutex::new(names),
            changes: watch::Sender::new(0),
            written: Mutex::new(0),
            released: std::sync::atomic::AtomicBool::new(false),
            flushed: watch::Sender::new(0),
        })
    }

    /// Merges what the file holds now (the previous owner's last flush) into the set.
    pub fn reload(&self) {
        let found = read(&self.path);
        let mut names = lock(&self.names);
        let before = names.len();
        names.extend(found);
        tracing::info!(file = %self.path.display(), added = names.len() - before, clusters = names.len(), "observed upstreams reloaded at takeover");
    }

    /// Records `cluster` as observed; true when it is new.
    pub fn insert(&self, cluster: &str) -> bool {
        let new = lock(&self.names).insert(cluster.to_string());
        if new {
            self.changes.send_modify(|n| *n += 1);
        }
        new
    }

    pub fn contains(&self, cluster: &str) -> bool {
        lock(&self.names).contains(cluster)
    }

    pub fn names(&self) -> BTreeSet<String> {
        lock(&self.names).clone()
    }

    /// The change count each write covered, from now on.
    pub fn flushed(&self) -> watch::Receiver<u64> {
        self.flushed.subscribe()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the set if it changed since the last write; [`run_writer`] calls it after
    /// each change. Nothing after [`Observed::flush_final`].
    pub fn flush(&self) -> std::io::Result<bool> {
        self.flush_inner(false)
    }

    /// The drained owner's last write, before the lock passes: [`Observed::flush`], after
    /// which this process writes the file no more.
    pub fn flush_final(&self) -> std::io::Result<bool> {
        self.flush_inner(true)
    }

    fn flush_inner(&self, last: bool) -> std::io::Result<bool> {
        use std::sync::atomic::Ordering;
        let mut written = lock(&self.written);
        if self.released.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if last {
            // Set before the write: a failed last write is not retried by the writer
            // task after the lock has passed either.
            self.released.store(true, Ordering::Relaxed);
        }
        let now = *self.changes.borrow();
        if now == *written {
            return Ok(false);
        }
        let doc = Doc {
            clusters: self.names(),
        };
        let bytes = serde_json::to_vec(&doc).map_err(std::io::Error::other)?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{FILE}.tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        crate::storage::write_atomically(&tmp, &self.path, &bytes, dir)
            .map_err(std::io::Error::other)?;
        *written = now;
        self.flushed.send_replace(now);
        Ok(true)
    }
}

fn read(path: &Path) -> BTreeSet<String> {
    match std::fs::read(path) {
        Ok(bytes) => match serde_json::from_slice::<Doc>(&bytes) {
            Ok(doc) if doc.clusters.len() <= MAX_NAMES => doc.clusters,
            Ok(doc) => {
                tracing::error!(file = %path.display(), clusters = doc.clusters.len(), max = MAX_NAMES, "observed upstreams: too many names; ignored");
                BTreeSet::new()
            }
            Err(e) => {
                tracing::error!(file = %path.display(), error = %e, "observed upstreams: not a valid file; ignored");
                BTreeSet::new()
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
        Err(e) => {
            tracing::error!(file = %path.display(), error = %e, "observed upstreams: unreadable; ignored");
            BTreeSet::new()
        }
    }
}

/// The owner's writer: writes the set after each change, [`FLUSH_DELAY`] later so that
/// a burst of first calls is one write. Runs until aborted.
pub async fn run_writer(observed: Arc<Observed>) {
    let mut changes = observed.changes.subscribe();
    // Changes made before the writer started count too (the flush skips a set already
    // written).
    changes.mark_changed();
    loop {
        if changes.changed().await.is_err() {
            return;
        }
        tokio::time::sleep(FLUSH_DELAY).await;
        changes.borrow_and_update();
        let o = observed.clone();
        match tokio::task::spawn_blocking(move || o.flush()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::error!(file = %observed.path().display(), error = %e, "observed upstreams: write failed; retried on the next change and at drain")
            }
            Err(e) => tracing::error!(error = %e, "observed upstreams: writer task failed"),
        }
    }
}

/// The set is plain data; a panic while it was locked leaves it usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_survives_a_flush_and_a_restore_and_a_bad_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let o = Observed::restore(dir.path());
        assert!(o.names().is_empty());
        assert!(!o.flush().unwrap(), "nothing to write");
        assert!(!dir.path().join(FILE).exists(), "no change, no file");
        assert!(o.insert("outbound|80||web.default"));
        assert!(!o.insert("outbound|80||web.default"));
        assert!(o.flush().unwrap());
        assert!(!o.flush().unwrap(), "written once");
        let again = Observed::restore(dir.path());
        assert_eq!(again.names(), o.names());

        std::fs::write(dir.path().join(FILE), "{ nope").unwrap();
        assert!(Observed::restore(dir.path()).names().is_empty());
        again.reload();
        assert_eq!(
            again.names().len(),
            1,
            "a bad file adds nothing and removes nothing"
        );
    }

    #[test]
    fn nothing_is_written_after_the_drains_final_flush() {
        let dir = tempfile::tempdir().unwrap();
        let o = Observed::restore(dir.path());
        o.insert("outbound|80||web.default");
        assert!(o.flush_final().unwrap(), "the last change is written");
        let before = std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        assert!(
            o.insert("outbound|80||late.default"),
            "a stream still open adds a name"
        );
        assert!(
            !o.flush().unwrap() && !o.flush_final().unwrap(),
            "but it is not written"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join(FILE)).unwrap(),
            before
        );
    }

    #[tokio::test]
    async fn the_writer_writes_a_burst_of_changes_once() {
        let dir = tempfile::tempdir().unwrap();
        let o = Observed::restore(dir.path());
        let mut flushed = o.flushed();
        let writer = tokio::spawn(run_writer(o.clone()));
        for i in 0..10 {
            o.insert(&format!("outbound|80||s{i}.default"));
        }
        tokio::time::timeout(Duration::from_secs(5), flushed.wait_for(|n| *n > 0))
            .await
            .expect("written")
            .unwrap();
        assert_eq!(*flushed.borrow(), 10, "one write covered the whole burst");
        assert_eq!(Observed::restore(dir.path()).names().len(), 10);
        writer.abort();
    }
}
