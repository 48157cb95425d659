//! Pod storage: one JSON record per pod in `<state-dir>/pods/<uid>.json`, written
//! atomically; `reload()` returns what changed since the records the caller built from.
//!
//! Invariants:
//! - A record file is only ever created by `rename(2)` of a fsynced temp file in the same
//!   folder, followed by a fsync of the folder, so a reader sees a whole record or none.
//!   [`Storage::put_all`] writes a batch's records side by side and fsyncs the folder
//!   once, after the last rename.
//! - Bad data is data: a record that does not decode is moved to
//!   `<state-dir>/pods-quarantine/`, logged with its path and counted; it never stops the
//!   agent.
//! - `open` writes nothing: it runs in a standby too, while another generation owns the
//!   node and writes. It skips (and logs) a bad record and leaves temp files alone.
//!   `reload` runs at takeover, when this process owns the node and no other writer
//!   exists: it quarantines bad records and removes every temp file as a crash's leftover.
//! - [`Storage`] keeps the view it last loaded or wrote; `reload` diffs the folder against
//!   that view, which is exactly what the caller built its snapshot inputs from.
//! - A scan reads again only the records whose file changed since it last read them: the
//!   folder entry's inode, size, mtime and ctime ([`Stamp`]) equal to those of a file read
//!   before, whose ctime was [`SETTLE`] old by then, is that same file. Each write makes a
//!   new file (a new ctime), so a record rewritten, even onto a reused inode number, is
//!   read again. A standby's look at the owner's writes and the takeover's reload then
//!   cost a `stat` per record, not a read and a decode (at 700 records, 8 ms of the
//!   worker's one runtime thread at a surge's takeover).
//! - A record that cannot be read (EACCES, EIO: any error but NotFound) is quarantined
//!   like a corrupt one: one bad file must not crash-loop the worker and take every other
//!   pod's data plane down with it.
//!
//! Failed writes (ENOSPC, a read-only or unwritable folder, EIO):
//! - A failed `put` leaves nothing partial: its temp file is removed and the previous
//!   record, if any, is untouched (the rename never happened). The error names the path
//!   and the cause; the CNI ADD fails with it and the runtime retries.
//! - Each failure counts in `aether_storage_write_errors_total{op}` and `/ready` lists a
//!   `storage` problem naming it until a write succeeds again; nothing is cached, so the
//!   first write after space is freed succeeds and clears the problem. `/ready` stays 200:
//!   the owner still serves the proxy every pod it holds and answers DELs, and a 503
//!   would only stall a rolling update that could bring a healthy agent, freeing no space.
//! - [`Storage::remove_or_retry`] (a CNI DEL, the stale-record collection) takes the pod out
//!   of the view even when its file cannot be removed, and keeps the uid in a retry set:
//!   the pod is gone from the data plane, so the DEL succeeds (a failed DEL would make the
//!   runtime retry the whole chain and hold the sandbox's teardown, the IPAM release
//!   included, hostage to the agent's disk). The set is retried on a timer with backoff
//!   ([`Storage::start_upkeep`]) and after every successful write; a retry removes the
//!   file only while it still holds the removed pod's sandbox (an ADD of the same pod
//!   since then rewrote it and took the uid out of the set). `reload` leaves those records
//!   out, so the takeover diff does not bring the pod back.
//! - The retry set lives in memory: the folder that refuses the removal would refuse a
//!   tombstone too, and the worker has no other durable folder. A worker that restarts
//!   while the removal still fails loads the record again and serves the pod until the
//!   record goes: the owner's stale-record collection removes it once the API server has
//!   not listed the pod for its grace period, and an ADD of a pod given the same IP
//!   evicts it. Without API server access nothing else removes it; the log of the DEL
//!   names the record.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::health::Reporter;
use crate::metrics::{Metrics, OpLabel};
use aether_model::Pod;

/// The record layout written by this version.
pub const SCHEMA: u32 = 1;

/// Longest accepted pod uid (Kubernetes uids are 36 bytes).
const MAX_UID_LEN: usize = 128;

/// Records are small; anything bigger is not one of ours.
const MAX_RECORD_BYTES: u64 = 64 * 1024;

const TEMP_MARKER: &str = ".tmp.";

/// The `/ready` problem source of failed record writes and pending removals.
pub const PROBLEM: &str = "storage";

/// The first wait before a pending removal is retried, doubling to [`RETRY_MAX`]. An
/// unlink is cheap; the cap keeps a healed folder from holding a deleted pod's record
/// long, and the count of failures in the metric within reason.
pub const RETRY_BASE: Duration = Duration::from_millis(200);
pub const RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error(
        "pod uid {0:?} is not a safe file name (1-128 of [A-Za-z0-9_.-], no \"..\", not starting with '.')"
    )]
    InvalidUid(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Why a record file did not decode. Public for the fuzz target.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("record is {0} bytes, over the {MAX_RECORD_BYTES}-byte limit")]
    TooLarge(u64),
    #[error("not a pod record: {0}")]
    Json(String),
    #[error("schema {0} is not a known record schema (this version writes {SCHEMA})")]
    Schema(u32),
    #[error("uid {0:?} is not a safe file name")]
    InvalidUid(String),
    #[error("record uid {found:?} does not match its file name {expected:?}")]
    UidMismatch { expected: String, found: String },
}

/// The on-disk layout: the pod's fields next to a schema version.
#[derive(Serialize, Deserialize)]
struct Record {
    schema: u32,
    #[serde(flatten)]
    pod: Pod,
}

/// Whether `name` in the records folder is a pod's record (`<uid>.json`), not a temp
/// file or anything else.
pub fn is_record_name(name: &std::ffi::OsStr) -> bool {
    name.to_str()
        .and_then(|n| n.strip_suffix(".json"))
        .is_some_and(valid_uid)
}

/// Whether `uid` can be used as a file name: `[A-Za-z0-9_.-]`, 1 to 128 bytes, no `..`,
/// not starting with `.` (which would also collide with temp file names).
pub fn valid_uid(uid: &str) -> bool {
    !uid.is_empty()
        && uid.len() <= MAX_UID_LEN
        && !uid.starts_with('.')
        && !uid.contains("..")
        && uid
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// Encodes a pod as its record file contents.
pub fn encode_record(pod: &Pod) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(&RecordRef {
        schema: SCHEMA,
        pod,
    })
    .unwrap_or_default();
    out.push(b'\n');
    out
}

#[derive(Serialize)]
struct RecordRef<'a> {
    schema: u32,
    #[serde(flatten)]
    pod: &'a Pod,
}

/// Decodes a record file's contents. Records of a newer schema are read as far as this
/// version understands them: fields are only ever added, and a rollback must not drop
/// pods the newer agent stored.
pub fn decode_record(bytes: &[u8]) -> Result<Pod, RecordError> {
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(RecordError::TooLarge(bytes.len() as u64));
    }
    let record: Record =
        serde_json::from_slice(bytes).map_err(|e| RecordError::Json(e.to_string()))?;
    if record.schema == 0 {
        return Err(RecordError::Schema(0));
    }
    if !valid_uid(&record.pod.uid) {
        return Err(RecordError::InvalidUid(record.pod.uid));
    }
    Ok(record.pod)
}

/// A pod whose record was rewritten: the value the caller built from and the new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Updated {
    pub old: Pod,
    pub new: Pod,
}

/// What `reload` found changed since the view the caller built from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diff {
    pub added: Vec<Pod>,
    pub updated: Vec<Updated>,
    /// The removed pods, each with the value the caller built from.
    pub removed: Vec<Pod>,
}

impl Diff {
    pub fn len(&self) -> usize {
        self.added.len() + self.updated.len() + self.removed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`Storage::remove_or_retry`] did.
#[derive(Debug)]
pub struct Removal {
    /// The pod's value in the view, None when the view had none.
    pub pod: Option<Pod>,
    /// Why the file is still there: its removal is retried later.
    pub deferred: Option<StorageError>,
}

pub struct Storage {
    pods_dir: PathBuf,
    quarantine_dir: PathBuf,
    metrics: Arc<Metrics>,
    /// The view, the retry set and the last failure. The lock also serialises writers so
    /// the view and the folder never disagree: a writer holds it through its file work.
    state: Mutex<State>,
    /// What the readers see: the view and the retry set as the last writer left them,
    /// behind a lock held only to copy a pointer. The CNI API reads the view on the
    /// worker's one runtime thread, which must not wait for a writer's fsyncs: a lookup
    /// stuck behind a burst's records stalled the whole worker, the proxy's reconnect
    /// at a takeover included, for up to 120 ms.
    shown: Mutex<Shown>,
    /// Where failures are reported, once [`Storage::start_upkeep`] ran.
    reporter: OnceLock<Reporter>,
    /// Wakes the retry task when a removal is deferred.
    retry_wake: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct Shown {
    view: Arc<BTreeMap<String, Pod>>,
    pending: Arc<Vec<String>>,
}

#[derive(Default)]
struct State {
    /// The last loaded or written records, by uid.
    view: BTreeMap<String, Pod>,
    /// What the last scan read from each settled record file, by file name.
    read: RecordCache,
    /// Pods taken out of the view whose files could not be removed yet, by uid.
    pending: BTreeMap<String, Pod>,
    /// The last write that failed, while no write has succeeded since.
    last_error: Option<String>,
}

/// The record files a scan read and may take again unread, by file name.
type RecordCache = std::collections::HashMap<String, (Stamp, Pod)>;

/// How old a record file's ctime must be, when a scan reads it, for a later scan to take
/// the same entry unread: any file made after that read has a later ctime, even on a
/// file system whose timestamps move in coarse ticks.
pub const SETTLE: Duration = Duration::from_secs(1);

/// What a folder entry showed of its file: a new file (every write makes one, by
/// `rename(2)`) differs in its ctime at least.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }

    /// Whether the file's ctime was [`SETTLE`] or more before `scan_start`.
    fn settled(&self, scan_start: SystemTime) -> bool {
        let (Ok(secs), Ok(nanos)) = (u64::try_from(self.ctime.0), u32::try_from(self.ctime.1))
        else {
            return false;
        };
        let ctime = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos);
        ctime + SETTLE <= scan_start
    }
}

/// Whether a scan may change the folder.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Read only: another generation may own the node and be writing (a standby's start).
    ReadOnly,
    /// This process owns the node: every temp file is a crash's leftover and every bad
    /// record is quarantined.
    Owner,
}

impl Storage {
    /// Opens (creating) `<state_dir>/pods` and loads every valid record.
    pub fn open(
        state_dir: &Path,
        metrics: std::sync::Arc<crate::metrics::Metrics>,
    ) -> anyhow::Result<Self> {
        let storage = Self {
            pods_dir: state_dir.join("pods"),
            quarantine_dir: state_dir.join("pods-quarantine"),
            metrics,
            state: Mutex::new(State::default()),
            shown: Mutex::new(Shown::default()),
            reporter: OnceLock::new(),
            retry_wake: Arc::new(tokio::sync::Notify::new()),
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&storage.pods_dir)
            .map_err(|source| StorageError::Io {
                op: "creating",
                path: storage.pods_dir.clone(),
                source,
            })?;
        let mut st = storage.lock();
        st.view = storage.scan(Scan::ReadOnly, &mut st.read)?;
        storage.show(&st);
        drop(st);
        Ok(storage)
    }

    /// Reports failed writes and pending removals to `/ready` from now on, and starts the
    /// task that retries pending removals (with backoff, [`RETRY_BASE`] doubling to
    /// [`RETRY_MAX`]). Call it once, inside the runtime; the task ends with the storage.
    pub fn start_upkeep(self: &Arc<Self>, reporter: Reporter) -> tokio::task::JoinHandle<()> {
        if self.reporter.set(reporter).is_ok() {
            let st = self.lock();
            self.report(&st);
        }
        let (weak, wake) = (Arc::downgrade(self), self.retry_wake.clone());
        tokio::spawn(retry_pending_removals(weak, wake))
    }

    /// The pods loaded by `open` or the last `reload`, as the last write left them (a
    /// write in progress is not waited for).
    pub fn pods(&self) -> Vec<Pod> {
        self.shown().view.values().cloned().collect()
    }

    /// The pod with this uid in the current view (a write in progress is not waited for).
    pub fn get(&self, uid: &str) -> Option<Pod> {
        self.shown().view.get(uid).cloned()
    }

    /// The uids whose record removal failed and is retried.
    pub fn pending_removals(&self) -> Vec<String> {
        self.shown().pending.to_vec()
    }

    fn shown(&self) -> Shown {
        let s = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        Shown {
            view: s.view.clone(),
            pending: s.pending.clone(),
        }
    }

    /// Shows the readers what `st` holds now. Called by every writer before it lets go of
    /// the state.
    fn show(&self, st: &State) {
        let shown = Shown {
            view: Arc::new(st.view.clone()),
            pending: Arc::new(st.pending.keys().cloned().collect()),
        };
        *self.shown.lock().unwrap_or_else(|e| e.into_inner()) = shown;
    }

    /// The folder holding the records.
    pub fn dir(&self) -> &Path {
        &self.pods_dir
    }

    /// Writes the pod's record, unless the view already holds exactly this pod. Returns
    /// whether it wrote. [`Storage::put_all`] of one pod.
    pub fn put(&self, pod: &Pod) -> Result<bool, StorageError> {
        self.put_all(std::slice::from_ref(pod))
            .pop()
            .expect("put_all answers once per pod")
    }

    /// Writes the records of `pods` as one group commit, with one result per pod, in
    /// order, each what [`Storage::put`] of it alone would return. Every record is written
    /// as `put` writes it (a fsynced temp file renamed into place), on up to [`WRITERS`]
    /// threads at once, and the folder is fsynced once, after the last rename, instead of
    /// once per record: a burst of ADDs pays one folder fsync, and its file fsyncs run
    /// side by side rather than one after another. A uid named twice is written in a
    /// second round, after the first, so the result is that of the puts in order.
    pub fn put_all(&self, pods: &[Pod]) -> Vec<Result<bool, StorageError>> {
        let mut results: Vec<Option<Result<bool, StorageError>>> =
            pods.iter().map(|_| None).collect();
        let mut st = self.lock();
        // Each round takes the first of each uid still to write; a repeat waits for the next.
        let mut left: Vec<usize> = (0..pods.len()).collect();
        while !left.is_empty() {
            let mut seen = BTreeSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) = left
                .into_iter()
                .partition(|&i| seen.insert(pods[i].uid.as_str()));
            let answers = self.put_round(&mut st, round.iter().map(|&i| &pods[i]).collect());
            for (i, answer) in round.into_iter().zip(answers) {
                results[i] = Some(answer);
            }
            left = later;
        }
        self.show(&st);
        results
            .into_iter()
            .map(|r| r.expect("every pod is in a round"))
            .collect()
    }

    /// One round of [`Storage::put_all`]: `pods` has no uid twice.
    fn put_round(&self, st: &mut State, pods: Vec<&Pod>) -> Vec<Result<bool, StorageError>> {
        let mut results: Vec<Option<Result<bool, StorageError>>> = pods
            .iter()
            .map(|pod| {
                if !valid_uid(&pod.uid) {
                    Some(Err(StorageError::InvalidUid(pod.uid.clone())))
                } else if st.view.get(&pod.uid) == Some(*pod) {
                    Some(Ok(false))
                } else {
                    None
                }
            })
            .collect();
        let todo: Vec<usize> = (0..pods.len()).filter(|&i| results[i].is_none()).collect();
        let jobs: Vec<(PathBuf, PathBuf, Vec<u8>)> = todo
            .iter()
            .map(|&i| {
                (
                    self.temp_path(&pods[i].uid),
                    self.record_path(&pods[i].uid),
                    encode_record(pods[i]),
                )
            })
            .collect();
        let written = write_all_synced(&jobs);
        // The renames are durable only once the folder is synced: one fsync for them all.
        let synced = if written.iter().any(Result::is_ok) {
            sync_dir_io(&self.pods_dir)
        } else {
            Ok(())
        };
        let mut any_ok = false;
        for ((i, (tmp, _, _)), w) in todo.into_iter().zip(&jobs).zip(written) {
            let pod = pods[i];
            let result = match (w, &synced) {
                (Ok(()), Ok(())) => Ok(()),
                (Ok(()), Err(e)) => Err(StorageError::Io {
                    op: "syncing",
                    path: self.pods_dir.clone(),
                    source: std::io::Error::new(e.kind(), e.to_string()),
                }),
                (Err(e), _) => {
                    // Best effort: a leftover temp file is also removed by the owner's next reload or tidy.
                    let _ = fs::remove_file(tmp);
                    Err(e)
                }
            };
            results[i] = Some(match result {
                Ok(()) => {
                    // The record now holds this pod: a removal pending for an earlier one is void.
                    st.pending.remove(&pod.uid);
                    st.view.insert(pod.uid.clone(), pod.clone());
                    any_ok = true;
                    Ok(true)
                }
                Err(e) => {
                    self.failed(st, "write", &e);
                    Err(e)
                }
            });
        }
        if any_ok {
            self.succeeded(st);
        }
        results
            .into_iter()
            .map(|r| r.expect("every pod has a result"))
            .collect()
    }

    /// Removes the pod's record. Returns the removed value, or None when there was none.
    /// On failure the record and the view are left as they were.
    pub fn remove(&self, uid: &str) -> Result<Option<Pod>, StorageError> {
        if !valid_uid(uid) {
            return Err(StorageError::InvalidUid(uid.to_string()));
        }
        let mut st = self.lock();
        if let Err(e) = self.remove_file(uid) {
            self.failed(&mut st, "remove", &e);
            return Err(e);
        }
        st.pending.remove(uid);
        let removed = st.view.remove(uid);
        self.succeeded(&mut st);
        self.show(&st);
        Ok(removed)
    }

    /// Removes the pod's record, or, when its file cannot be removed, takes the pod out of
    /// the view anyway and retries the removal later (see the module doc). Errs only for
    /// an invalid uid, or when the view does not hold the pod whose file failed to go.
    pub fn remove_or_retry(&self, uid: &str) -> Result<Removal, StorageError> {
        if !valid_uid(uid) {
            return Err(StorageError::InvalidUid(uid.to_string()));
        }
        let mut st = self.lock();
        match self.remove_file(uid) {
            Ok(()) => {
                st.pending.remove(uid);
                let pod = st.view.remove(uid);
                self.succeeded(&mut st);
                self.show(&st);
                Ok(Removal {
                    pod,
                    deferred: None,
                })
            }
            Err(e) => {
                self.failed(&mut st, "remove", &e);
                let Some(pod) = st.view.remove(uid) else {
                    return Err(e);
                };
                tracing::warn!(
                    uid = %uid, path = %self.record_path(uid).display(), error = %e,
                    "pod record could not be removed; the pod is out of the view, the removal is retried"
                );
                st.pending.insert(uid.to_string(), pod.clone());
                self.report(&st);
                self.show(&st);
                self.retry_wake.notify_one();
                Ok(Removal {
                    pod: Some(pod),
                    deferred: Some(e),
                })
            }
        }
    }

    /// Retries every pending removal now. Returns how many are still pending.
    pub fn retry_pending(&self) -> usize {
        let mut st = self.lock();
        self.drain_pending(&mut st);
        self.report(&st);
        self.show(&st);
        st.pending.len()
    }

    fn remove_file(&self, uid: &str) -> Result<(), StorageError> {
        let path = self.record_path(uid);
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.pods_dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StorageError::Io {
                op: "removing",
                path,
                source,
            }),
        }
    }

    /// Removes the pending records that still hold the removed pod's sandbox.
    fn drain_pending(&self, st: &mut State) {
        let pending = std::mem::take(&mut st.pending);
        let (mut removed, mut failed) = (false, None);
        for (uid, pod) in pending {
            let path = self.record_path(&uid);
            match read_record(&path, &uid) {
                Err(ReadError::Vanished) => continue,
                Ok(now) if now.container_id != pod.container_id => {
                    tracing::info!(uid = %uid, path = %path.display(), "a pending record removal is void: the record was rewritten for another sandbox");
                    continue;
                }
                // The same sandbox's record, or one that no longer reads: it goes.
                _ => {}
            }
            match self.remove_file(&uid) {
                Ok(()) => {
                    removed = true;
                    tracing::info!(uid = %uid, path = %path.display(), "removed the record of a deleted pod whose earlier removal failed");
                }
                Err(e) => {
                    self.metrics
                        .storage_write_errors
                        .get_or_create(&OpLabel {
                            op: "remove".into(),
                        })
                        .inc();
                    failed = Some(e.to_string());
                    st.pending.insert(uid, pod);
                }
            }
        }
        // A removal that went through is a write that succeeded.
        match failed {
            Some(e) => st.last_error = Some(e),
            None if removed => st.last_error = None,
            None => {}
        }
    }

    /// Counts a failed write and reports it until a write succeeds.
    fn failed(&self, st: &mut State, op: &str, e: &StorageError) {
        self.metrics
            .storage_write_errors
            .get_or_create(&OpLabel { op: op.into() })
            .inc();
        st.last_error = Some(e.to_string());
        self.report(st);
    }

    /// A write succeeded: the folder takes writes again, so the pending removals are
    /// retried now, and the report clears unless one still fails.
    fn succeeded(&self, st: &mut State) {
        st.last_error = None;
        if !st.pending.is_empty() {
            self.drain_pending(st);
        }
        self.report(st);
    }

    fn report(&self, st: &State) {
        let Some(reporter) = self.reporter.get() else {
            return;
        };
        let pending = (!st.pending.is_empty()).then(|| {
            let uids: Vec<&str> = st.pending.keys().map(String::as_str).collect();
            format!(
                "removal of the records of deleted pod uid(s) {} pending retry",
                uids.join(", ")
            )
        });
        let last = st.last_error.as_ref().map(|e| {
            format!(
                "pod records in {} cannot be written: {e}",
                self.pods_dir.display()
            )
        });
        match (last, pending) {
            (None, None) => reporter.clear(PROBLEM),
            (Some(a), Some(b)) => reporter.set(PROBLEM, format!("{a}; {b}")),
            (Some(m), None) | (None, Some(m)) => reporter.set(PROBLEM, m),
        }
    }

    /// Re-reads the folder and returns what changed since the view the caller built from
    /// (the records `open`, the last `reload`, `put` and `remove` left), then adopts the
    /// folder as the new view. Call it only while this process owns the node: it removes
    /// every temp file as a crash's leftover.
    pub fn reload(&self) -> Result<Diff, StorageError> {
        let mut st = self.lock();
        self.drain_pending(&mut st);
        self.report(&st);
        let mut now = self.scan(Scan::Owner, &mut st.read)?;
        // A deleted pod whose file is still there is not back.
        for (uid, pod) in &st.pending {
            if now
                .get(uid)
                .is_some_and(|p| p.container_id == pod.container_id)
            {
                now.remove(uid);
            }
        }
        let diff = self.adopt(&mut st, now);
        // The retry set may have changed above, even with the view unchanged.
        self.show(&st);
        Ok(diff)
    }

    /// A standby's look at the owner's writes: re-reads the folder as `open` does (read
    /// only: temp files and bad records stay where they are) and returns what changed
    /// since the last look, adopting the folder as the view. Writes nothing, so it may
    /// run while another generation owns the node; not once this process writes.
    pub fn follow(&self) -> Result<Diff, StorageError> {
        self.follow_at(SystemTime::now())
    }

    /// [`Storage::follow`], its scan as if started at `at`.
    fn follow_at(&self, at: SystemTime) -> Result<Diff, StorageError> {
        let mut st = self.lock();
        let now = self.scan_at(Scan::ReadOnly, &mut st.read, at)?;
        let diff = self.adopt(&mut st, now);
        // An unchanged view is shown already.
        if !diff.is_empty() {
            self.show(&st);
        }
        Ok(diff)
    }

    /// Makes `now` the view; what changed from the old one. The caller shows it.
    fn adopt(&self, st: &mut State, now: BTreeMap<String, Pod>) -> Diff {
        let mut diff = Diff::default();
        for (uid, old) in st.view.iter() {
            match now.get(uid) {
                None => diff.removed.push(old.clone()),
                Some(new) if new != old => diff.updated.push(Updated {
                    old: old.clone(),
                    new: new.clone(),
                }),
                Some(_) => {}
            }
        }
        for (uid, new) in now.iter() {
            if !st.view.contains_key(uid) {
                diff.added.push(new.clone());
            }
        }
        st.view = now;
        diff
    }

    /// The owner's clean-up of what `open` left in place: quarantines bad records and
    /// removes temp files, with the view unchanged (neither is a pod). For an owner that
    /// served without a takeover reconcile (a lone agent), whose `reload` never ran.
    pub fn tidy(&self) -> Result<(), StorageError> {
        let mut st = self.lock();
        self.scan(Scan::Owner, &mut st.read).map(|_| ())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The view is plain data, rewritten whole by each scan; a panic mid-update cannot
        // leave it half-changed in a way the next scan does not repair.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record_path(&self, uid: &str) -> PathBuf {
        self.pods_dir.join(format!("{uid}.json"))
    }

    fn temp_path(&self, uid: &str) -> PathBuf {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        self.pods_dir.join(format!(
            ".{uid}.json{TEMP_MARKER}{}.{seq}",
            std::process::id()
        ))
    }

    /// Every record in the folder: read, or taken from `cache` when its entry shows the
    /// file read before ([`Stamp`]); as the owner, quarantines bad ones and removes temp
    /// files. Leaves in `cache` the settled files it holds now.
    fn scan(
        &self,
        mode: Scan,
        cache: &mut RecordCache,
    ) -> Result<BTreeMap<String, Pod>, StorageError> {
        self.scan_at(mode, cache, SystemTime::now())
    }

    /// [`Storage::scan`], as if it started at `started`.
    fn scan_at(
        &self,
        mode: Scan,
        cache: &mut RecordCache,
        started: SystemTime,
    ) -> Result<BTreeMap<String, Pod>, StorageError> {
        let io = |op, source| StorageError::Io {
            op,
            path: self.pods_dir.clone(),
            source,
        };
        let timer = std::time::Instant::now();
        let mut pods = BTreeMap::new();
        let mut next = RecordCache::with_capacity(cache.len());
        let (mut read, mut unread) = (0u64, 0u64);
        for entry in fs::read_dir(&self.pods_dir).map_err(|e| io("reading", e))? {
            let entry = entry.map_err(|e| io("reading", e))?;
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                tracing::warn!(path = %path.display(), "ignoring a file with a non-UTF-8 name in the pod records folder");
                continue;
            };
            if name.starts_with('.') && name.contains(TEMP_MARKER) {
                if mode == Scan::Owner {
                    self.remove_temp(&path);
                }
                continue;
            }
            let Some(uid) = name.strip_suffix(".json") else {
                tracing::warn!(path = %path.display(), "ignoring a file that is not a pod record (no .json suffix)");
                continue;
            };
            if !entry.file_type().map_err(|e| io("reading", e))?.is_file() {
                tracing::warn!(path = %path.display(), "ignoring a non-file entry in the pod records folder");
                continue;
            }
            // Before the read: a file replaced in between is read again next time.
            let stamp = entry.metadata().ok().map(|m| Stamp::of(&m));
            if let Some(s) = stamp
                && let Some((known, pod)) = cache.remove(&name)
                && known == s
            {
                unread += 1;
                pods.insert(pod.uid.clone(), pod.clone());
                next.insert(name, (s, pod));
                continue;
            }
            read += 1;
            match read_record(&path, uid) {
                Ok(pod) => {
                    if let Some(s) = stamp.filter(|s| s.settled(started)) {
                        next.insert(name, (s, pod.clone()));
                    }
                    pods.insert(pod.uid.clone(), pod);
                }
                Err(ReadError::Vanished) => {}
                Err(ReadError::Bad(why)) => self.bad_record(mode, &path, &name, &why, "is corrupt"),
                Err(ReadError::Io(source)) => {
                    self.bad_record(mode, &path, &name, &source, "cannot be read")
                }
            }
        }
        *cache = next;
        self.metrics.storage_records_read.inc_by(read);
        self.metrics.storage_records_unread.inc_by(unread);
        tracing::debug!(
            dir = %self.pods_dir.display(), read, unread,
            took_us = timer.elapsed().as_micros() as u64,
            "pod records scanned"
        );
        Ok(pods)
    }

    /// A bad record: quarantined by the owner, skipped (and left in place) otherwise.
    fn bad_record(
        &self,
        mode: Scan,
        path: &Path,
        name: &str,
        why: &dyn std::fmt::Display,
        what: &str,
    ) {
        match mode {
            Scan::Owner => self.quarantine(path, name, why, what),
            Scan::ReadOnly => tracing::warn!(
                path = %path.display(), error = %why,
                "pod record {what}; skipped (the node's owner quarantines it at takeover)"
            ),
        }
    }

    fn remove_temp(&self, path: &Path) {
        match fs::remove_file(path) {
            Ok(()) => {
                tracing::info!(path = %path.display(), "removed a temp file left by an interrupted record write")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not remove a leftover temp file")
            }
        }
    }

    /// Moves a record that is no pod (`what`: why, for the log) out of the folder.
    fn quarantine(&self, path: &Path, name: &str, why: &dyn std::fmt::Display, what: &str) {
        self.metrics.storage_quarantined.inc();
        let stamp = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let target = self.quarantine_dir.join(format!("{name}.{stamp}"));
        let moved = fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.quarantine_dir)
            .and_then(|()| fs::rename(path, &target))
            .and_then(|()| sync_dir_io(&self.pods_dir));
        match moved {
            Ok(()) => tracing::error!(
                path = %path.display(), quarantined = %target.display(), error = %why,
                "pod record {what}; moved it to quarantine"
            ),
            Err(e) => tracing::error!(
                path = %path.display(), error = %why, move_error = %e,
                "pod record {what} and could not be moved to quarantine; ignoring it"
            ),
        }
    }
}

/// Retries pending removals until none is left, then sleeps until one is deferred again.
async fn retry_pending_removals(storage: Weak<Storage>, wake: Arc<tokio::sync::Notify>) {
    let mut backoff =
        crate::backoff::Backoff::new(RETRY_BASE, RETRY_MAX).jittered(crate::backoff::seed());
    loop {
        let pending = storage.upgrade().map(|s| s.shown().pending.len());
        match pending {
            None => return,
            Some(0) => {
                backoff.reset();
                wake.notified().await;
            }
            Some(_) => {
                tokio::time::sleep(backoff.next_wait()).await;
                let Some(s) = storage.upgrade() else { return };
                // An unlink and a directory fsync: off the runtime's threads.
                let _ = tokio::task::spawn_blocking(move || s.retry_pending()).await;
            }
        }
    }
}

enum ReadError {
    /// Removed between listing and reading (the owner deleted the pod): not an error.
    Vanished,
    Bad(RecordError),
    Io(std::io::Error),
}

fn read_record(path: &Path, uid: &str) -> Result<Pod, ReadError> {
    let file = fs::File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ReadError::Vanished,
        _ => ReadError::Io(e),
    })?;
    let mut bytes = Vec::new();
    use std::io::Read;
    file.take(MAX_RECORD_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if !valid_uid(uid) {
        return Err(ReadError::Bad(RecordError::InvalidUid(uid.to_string())));
    }
    let pod = decode_record(&bytes).map_err(ReadError::Bad)?;
    if pod.uid != uid {
        return Err(ReadError::Bad(RecordError::UidMismatch {
            expected: uid.to_string(),
            found: pod.uid,
        }));
    }
    Ok(pod)
}

/// Writes `bytes` to `path` through the new file `tmp` in the folder `dir`: fsynced, renamed
/// into place, and the folder fsynced.
pub(crate) fn write_atomically(
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
    dir: &Path,
) -> Result<(), StorageError> {
    write_synced(tmp, path, bytes)?;
    sync_dir(dir)
}

/// At most this many records of one [`Storage::put_all`] are written at once: enough to
/// keep a disk's queue busy with fsyncs; more would only contend on the folder's lock.
pub const WRITERS: usize = 16;

/// [`write_synced`] of each `(tmp, path, bytes)`, on up to [`WRITERS`] threads, each taking
/// an equal run of the jobs (in this thread when there is one). One result per job, in
/// order.
fn write_all_synced(jobs: &[(PathBuf, PathBuf, Vec<u8>)]) -> Vec<Result<(), StorageError>> {
    let write = |chunk: &[(PathBuf, PathBuf, Vec<u8>)]| {
        chunk
            .iter()
            .map(|(tmp, path, bytes)| write_synced(tmp, path, bytes))
            .collect::<Vec<_>>()
    };
    if jobs.len() <= 1 {
        return write(jobs);
    }
    std::thread::scope(|scope| {
        let writers: Vec<_> = jobs
            .chunks(jobs.len().div_ceil(WRITERS))
            .map(|chunk| scope.spawn(move || write(chunk)))
            .collect();
        writers
            .into_iter()
            .flat_map(|w| w.join().expect("a record writer panicked"))
            .collect()
    })
}

/// Writes `bytes` to the new file `tmp`, fsyncs it and renames it to `path`. The rename
/// is durable once the folder is synced, which is the caller's.
fn write_synced(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<(), StorageError> {
    let io = |op, path: &Path, source| StorageError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(tmp)
        .map_err(|e| io("creating", tmp, e))?;
    file.write_all(bytes).map_err(|e| io("writing", tmp, e))?;
    file.sync_all().map_err(|e| io("syncing", tmp, e))?;
    drop(file);
    fs::rename(tmp, path).map_err(|e| io("renaming into place", path, e))
}

fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    sync_dir_io(dir).map_err(|source| StorageError::Io {
        op: "syncing",
        path: dir.to_path_buf(),
        source,
    })
}

fn sync_dir_io(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    pub(crate) fn pod(uid: &str, ip: &str) -> Pod {
        Pod {
            uid: uid.to_string(),
            namespace: "default".into(),
            name: format!("pod-{uid}"),
            container_id: format!("c-{uid}"),
            netns: format!("/var/run/netns/{uid}"),
            ifname: "eth0".into(),
            ips: vec![ip.parse::<IpAddr>().unwrap()],
            terminating: false,
            no_quic_twin: false,
        }
    }

    fn open(dir: &Path) -> (Storage, Arc<Metrics>) {
        let metrics = Metrics::new();
        (Storage::open(dir, metrics.clone()).unwrap(), metrics)
    }

    /// A second writer: what the other generation does to the folder during the overlap.
    fn other_writer(dir: &Path) -> Storage {
        Storage::open(dir, Metrics::new()).unwrap()
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<_> = fs::read_dir(dir)
            .map(|r| {
                r.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// A scan reads again a record whose file changed, and one written less than
    /// [`SETTLE`] before the scan that read it; it takes the others unread. A bad record
    /// is read every time.
    #[test]
    fn a_scan_reads_again_only_the_records_whose_file_changed() {
        let dir = tempfile::tempdir().unwrap();
        let owner = other_writer(dir.path());
        for i in 0..5 {
            owner
                .put(&pod(&format!("p{i}"), &format!("10.0.0.{i}")))
                .unwrap();
        }
        let (standby, m) = open(dir.path());
        let counts = || (m.storage_records_read.get(), m.storage_records_unread.get());
        assert_eq!(counts(), (5, 0));
        let look = |at: SystemTime| standby.follow_at(at).unwrap();
        let now = SystemTime::now();
        let settled = now + 2 * SETTLE;
        // Just written: read again.
        assert!(look(now).is_empty());
        assert_eq!(counts(), (10, 0));
        assert!(look(settled).is_empty());
        assert_eq!(counts(), (15, 0));
        // Read when settled: taken unread.
        assert!(look(settled).is_empty());
        assert_eq!(counts(), (15, 5));
        // A record rewritten is a new file: read, and its new content in the diff.
        owner.put(&pod("p1", "10.0.1.1")).unwrap();
        let diff = look(settled);
        assert_eq!(counts(), (16, 9));
        assert_eq!(diff.updated.len(), 1, "{diff:?}");
        assert_eq!(diff.updated[0].new, pod("p1", "10.0.1.1"));
        assert_eq!(standby.get("p1").unwrap().ips, pod("p1", "10.0.1.1").ips);
        // A record removed is gone from the view; the rewritten one is now taken unread.
        owner.remove("p2").unwrap();
        let diff = look(settled);
        assert_eq!(diff.removed, vec![pod("p2", "10.0.0.2")]);
        assert_eq!(counts(), (16, 13));
        // A bad record is never taken unread.
        fs::write(dir.path().join("pods/bad.json"), b"{not json").unwrap();
        assert!(look(settled).is_empty());
        assert!(look(settled).is_empty());
        assert_eq!(counts(), (18, 21));
    }

    #[test]
    fn put_then_open_round_trips_with_schema() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        assert!(s.put(&pod("a", "10.0.0.1")).unwrap());
        assert!(
            !s.put(&pod("a", "10.0.0.1")).unwrap(),
            "identical record is not rewritten"
        );
        let text = fs::read_to_string(dir.path().join("pods/a.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["schema"], SCHEMA);
        assert_eq!(json["uid"], "a");
        let (s2, _) = open(dir.path());
        assert_eq!(s2.pods(), vec![pod("a", "10.0.0.1")]);
        assert_eq!(
            names(&dir.path().join("pods")),
            vec!["a.json"],
            "no temp file left"
        );
    }

    /// One table for reload: what the other generation did, and the diff expected.
    /// The CNI API reads the view on the worker's one runtime thread: a writer in the
    /// middle of its file work (here, holding the state as `put_all` does through its
    /// fsyncs) must not hold it up, and what it reads is what the last write left.
    #[test]
    fn readers_do_not_wait_for_a_write_in_progress() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("a", "10.0.0.1")).unwrap();
        let s = Arc::new(s);
        let writing = s.lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = s.clone();
        std::thread::spawn(move || {
            let _ = tx.send((
                reader.get("a"),
                reader.pods().len(),
                reader.pending_removals(),
            ));
        });
        let (got, n, pending) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("a reader waited for the writer");
        drop(writing);
        assert_eq!(
            (got.map(|p| p.uid), n, pending),
            (Some("a".to_string()), 1, Vec::<String>::new())
        );
        // Each write shows its result: a put, a removal, and a reload.
        s.put(&pod("b", "10.0.0.2")).unwrap();
        assert_eq!(s.pods().len(), 2);
        s.remove("a").unwrap();
        assert!(s.get("a").is_none() && s.get("b").is_some());
        fs::remove_file(dir.path().join("pods/b.json")).unwrap();
        s.reload().unwrap();
        assert!(s.pods().is_empty());
    }

    /// A standby's `follow` sees what another process's storage writes, and writes
    /// nothing itself: the owner's temp file and a bad record stay where they are.
    #[test]
    fn follow_sees_the_owners_writes_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (owner, _) = open(dir.path());
        let (standby, _) = open(dir.path());
        assert!(standby.follow().unwrap().is_empty());
        owner.put(&pod("a", "10.0.0.1")).unwrap();
        owner.put(&pod("b", "10.0.0.2")).unwrap();
        let d = standby.follow().unwrap();
        assert_eq!(
            d.added.iter().map(|p| p.uid.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        owner.put(&pod("a", "10.0.0.9")).unwrap();
        owner.remove("b").unwrap();
        let d = standby.follow().unwrap();
        assert_eq!(
            (
                d.updated.len(),
                d.updated[0].new.ips[0].to_string(),
                d.removed.len(),
                d.removed[0].uid.as_str()
            ),
            (1, "10.0.0.9".to_string(), 1, "b")
        );
        assert_eq!(standby.get("a").unwrap().ips, owner.get("a").unwrap().ips);
        // An owner's write in progress and a corrupt record: left alone, not pods.
        let temp = dir.path().join(format!("pods/.c.json{TEMP_MARKER}1.1"));
        fs::write(&temp, b"{").unwrap();
        fs::write(dir.path().join("pods/d.json"), b"not json").unwrap();
        assert!(standby.follow().unwrap().is_empty());
        assert!(
            temp.exists() && dir.path().join("pods/d.json").exists(),
            "the standby changed the folder"
        );
        assert!(
            !dir.path().join("pods-quarantine").exists(),
            "the standby quarantined"
        );
        // Which names wake it: records only.
        for (name, record) in [
            ("a.json", true),
            (".a.json.tmp.1.1", false),
            ("a.json.1", false),
            ("../x.json", false),
        ] {
            assert_eq!(is_record_name(std::ffi::OsStr::new(name)), record, "{name}");
        }
    }

    #[test]
    fn reload_reports_added_updated_removed() {
        struct Case {
            name: &'static str,
            before: Vec<Pod>,
            change: fn(&Storage),
            expected: Diff,
        }
        let cases = [
            Case {
                name: "added",
                before: vec![pod("a", "10.0.0.1")],
                change: |o| {
                    o.put(&pod("b", "10.0.0.2")).unwrap();
                },
                expected: Diff {
                    added: vec![pod("b", "10.0.0.2")],
                    ..Default::default()
                },
            },
            Case {
                name: "updated",
                before: vec![pod("a", "10.0.0.1")],
                change: |o| {
                    o.put(&pod("a", "10.0.0.9")).unwrap();
                },
                expected: Diff {
                    updated: vec![Updated {
                        old: pod("a", "10.0.0.1"),
                        new: pod("a", "10.0.0.9"),
                    }],
                    ..Default::default()
                },
            },
            Case {
                name: "removed",
                before: vec![pod("a", "10.0.0.1"), pod("b", "10.0.0.2")],
                change: |o| {
                    o.remove("a").unwrap();
                },
                expected: Diff {
                    removed: vec![pod("a", "10.0.0.1")],
                    ..Default::default()
                },
            },
            Case {
                name: "all three",
                before: vec![pod("a", "10.0.0.1"), pod("b", "10.0.0.2")],
                change: |o| {
                    o.remove("a").unwrap();
                    o.put(&pod("b", "10.0.0.3")).unwrap();
                    o.put(&pod("c", "10.0.0.4")).unwrap();
                },
                expected: Diff {
                    added: vec![pod("c", "10.0.0.4")],
                    updated: vec![Updated {
                        old: pod("b", "10.0.0.2"),
                        new: pod("b", "10.0.0.3"),
                    }],
                    removed: vec![pod("a", "10.0.0.1")],
                },
            },
            Case {
                name: "nothing",
                before: vec![pod("a", "10.0.0.1")],
                change: |_| {},
                expected: Diff::default(),
            },
        ];
        for case in cases {
            let dir = tempfile::tempdir().unwrap();
            let (s, _) = open(dir.path());
            for p in &case.before {
                s.put(p).unwrap();
            }
            (case.change)(&other_writer(dir.path()));
            let diff = s.reload().unwrap();
            assert_eq!(diff, case.expected, "case {}", case.name);
            assert!(
                s.reload().unwrap().is_empty(),
                "case {}: a second reload finds nothing new",
                case.name
            );
        }
    }

    #[test]
    fn corrupt_and_truncated_records_are_quarantined_not_fatal() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("good", "10.0.0.1")).unwrap();
        let pods = dir.path().join("pods");
        let full = String::from_utf8(encode_record(&pod("trunc", "10.0.0.2"))).unwrap();
        fs::write(pods.join("trunc.json"), &full[..full.len() / 2]).unwrap();
        fs::write(pods.join("garbage.json"), b"\x00\xffnot json").unwrap();
        fs::write(
            pods.join("mismatch.json"),
            encode_record(&pod("other", "10.0.0.3")),
        )
        .unwrap();
        fs::write(pods.join("noschema.json"), br#"{"uid":"noschema"}"#).unwrap();

        let diff = s.reload().unwrap();
        assert!(diff.is_empty(), "bad records are not pods: {diff:?}");
        assert_eq!(s.pods(), vec![pod("good", "10.0.0.1")]);
        assert_eq!(names(&pods), vec!["good.json"]);
        let quarantined = names(&dir.path().join("pods-quarantine"));
        assert_eq!(quarantined.len(), 4, "{quarantined:?}");
        for name in [
            "garbage.json.",
            "mismatch.json.",
            "noschema.json.",
            "trunc.json.",
        ] {
            assert!(
                quarantined.iter().any(|q| q.starts_with(name)),
                "{name} in {quarantined:?}"
            );
        }
        assert_eq!(s.metrics.storage_quarantined.get(), 4);

        // At open (a standby's start, another generation may own the node) it is skipped
        // and left in place; the owner's reload quarantines it.
        fs::write(pods.join("late.json"), b"{").unwrap();
        let (s2, m2) = open(dir.path());
        assert_eq!(s2.pods(), vec![pod("good", "10.0.0.1")]);
        assert_eq!(
            names(&pods),
            vec!["good.json", "late.json"],
            "open moved a file"
        );
        assert_eq!(m2.storage_quarantined.get(), 0);
        assert!(s2.reload().unwrap().is_empty());
        assert_eq!(names(&pods), vec!["good.json"]);
        assert_eq!(m2.storage_quarantined.get(), 1);

        // A lone owner, which serves without a reconcile, tidies instead: the same moves,
        // and temp files go too; its view is unchanged.
        fs::write(pods.join("later.json"), b"{").unwrap();
        fs::write(pods.join(".x.json.tmp.4242.0"), b"{").unwrap();
        let (s3, m3) = open(dir.path());
        assert_eq!(names(&pods).len(), 3, "open moved a file");
        s3.tidy().unwrap();
        assert_eq!(names(&pods), vec!["good.json"]);
        assert_eq!(m3.storage_quarantined.get(), 1);
        assert_eq!(s3.pods(), vec![pod("good", "10.0.0.1")]);
    }

    #[test]
    fn temp_file_left_by_a_crash_mid_write_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("a", "10.0.0.1")).unwrap();
        let pods = dir.path().join("pods");
        // A crash between create and rename leaves a partial temp file behind.
        let crashed = pods.join(".b.json.tmp.4242.0");
        fs::write(&crashed, b"{\"schema\":1,\"uid\":\"b\",\"na").unwrap();

        // open, while another generation may be writing, leaves it: it may be theirs.
        let (s2, _) = open(dir.path());
        assert!(crashed.exists(), "a temp file may be another writer's");
        assert_eq!(s2.pods(), vec![pod("a", "10.0.0.1")]);

        // reload (this process owns the node) removes any temp file, and it is no pod.
        fs::write(&crashed, b"{").unwrap();
        assert!(s.reload().unwrap().is_empty());
        assert_eq!(names(&pods), vec!["a.json"]);
        assert_eq!(
            s.metrics.storage_quarantined.get(),
            0,
            "a temp file is not a corrupt record"
        );
    }

    #[test]
    fn unsafe_uids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        for uid in [
            "",
            "..",
            "../x",
            "a/b",
            ".hidden",
            "a..b",
            "a b",
            "é",
            &"x".repeat(129),
        ] {
            let mut p = pod("ok", "10.0.0.1");
            p.uid = uid.to_string();
            assert!(
                matches!(s.put(&p), Err(StorageError::InvalidUid(_))),
                "{uid:?}"
            );
            assert!(
                matches!(s.remove(uid), Err(StorageError::InvalidUid(_))),
                "{uid:?}"
            );
        }
        for uid in ["6f1c2d3e-0000-4000-8000-000000000001", "a.b_c-D"] {
            assert!(valid_uid(uid), "{uid}");
        }
        assert_eq!(names(&dir.path().join("pods")), Vec::<String>::new());
    }

    #[test]
    fn remove_of_unknown_pod_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        assert_eq!(s.remove("nope").unwrap(), None);
        s.put(&pod("a", "10.0.0.1")).unwrap();
        assert_eq!(s.remove("a").unwrap(), Some(pod("a", "10.0.0.1")));
        assert_eq!(s.get("a"), None);
    }

    #[test]
    fn the_terminating_mark_round_trips_and_is_absent_from_records_without_it() {
        let plain = encode_record(&pod("a", "10.0.0.1"));
        assert!(
            !String::from_utf8_lossy(&plain).contains("terminating"),
            "a record without the mark reads as before"
        );
        assert_eq!(decode_record(&plain), Ok(pod("a", "10.0.0.1")));
        let marked = Pod {
            terminating: true,
            ..pod("a", "10.0.0.1")
        };
        let bytes = encode_record(&marked);
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(json["terminating"], true);
        assert_eq!(decode_record(&bytes), Ok(marked.clone()));

        // A rewrite of the record is an update in the takeover diff.
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("a", "10.0.0.1")).unwrap();
        other_writer(dir.path()).put(&marked).unwrap();
        assert_eq!(
            s.reload().unwrap().updated,
            vec![Updated {
                old: pod("a", "10.0.0.1"),
                new: marked
            }]
        );
    }

    /// A `/ready` status and the reporter storage reports to.
    fn reporter() -> (
        Arc<tokio::sync::watch::Sender<crate::health::Status>>,
        Reporter,
    ) {
        let status = Arc::new(tokio::sync::watch::Sender::new(crate::health::Status::new(
            "n", "p",
        )));
        (status.clone(), Reporter::new(status))
    }

    fn storage_problem(
        status: &tokio::sync::watch::Sender<crate::health::Status>,
    ) -> Option<String> {
        status
            .borrow()
            .problems
            .iter()
            .find(|p| p.source == PROBLEM)
            .map(|p| p.message.clone())
    }

    fn write_errors(m: &Metrics, op: &str) -> u64 {
        m.storage_write_errors
            .get_or_create(&OpLabel { op: op.into() })
            .get()
    }

    /// The uid the agent runs its worker as when started as root.
    const WORKER_UID: u32 = 65532;
    const CHILD_DIR: &str = "AETHER_STORAGE_TEST_UNREADABLE_DIR";

    /// Fault matrix row 9 (storage), issue 17: a record the worker cannot read (EACCES)
    /// is quarantined like a corrupt one, and the storage opens with the other pods: no
    /// crash loop. Root reads any file, so as root the test runs its check in a copy of
    /// itself under the worker's uid.
    #[test]
    fn unreadable_record_is_quarantined_and_open_goes_on() {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        if let Ok(dir) = std::env::var(CHILD_DIR) {
            return check_unreadable_record_is_quarantined(Path::new(&dir));
        }
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("good", "10.0.0.1")).unwrap();
        s.put(&pod("locked", "10.0.0.2")).unwrap();
        let locked = dir.path().join("pods/locked.json");
        fs::set_permissions(&locked, fs::Permissions::from_mode(0o000)).unwrap();
        if !nix::unistd::geteuid().is_root() {
            return check_unreadable_record_is_quarantined(dir.path());
        }
        // The folder is the worker uid's, as the supervisor leaves it; the record is
        // root's with mode 000, so the worker uid meets EACCES.
        for p in [
            dir.path().to_path_buf(),
            dir.path().join("pods"),
            dir.path().join("pods/good.json"),
        ] {
            std::os::unix::fs::chown(&p, Some(WORKER_UID), Some(WORKER_UID)).unwrap();
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "storage::tests::unreadable_record_is_quarantined_and_open_goes_on",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD_DIR, dir.path())
            .uid(WORKER_UID)
            .gid(WORKER_UID)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "the check as uid {WORKER_UID} failed: {text}"
        );
        assert!(
            text.contains("1 passed"),
            "the check as uid {WORKER_UID} ran no test: {text}"
        );
        assert!(!locked.exists());
        assert_eq!(names(&dir.path().join("pods-quarantine")).len(), 1);
    }

    fn check_unreadable_record_is_quarantined(dir: &Path) {
        let err =
            fs::read(dir.join("pods/locked.json")).expect_err("the record must be unreadable here");
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        let (s, m) = open(dir);
        assert_eq!(s.pods(), vec![pod("good", "10.0.0.1")]);
        assert_eq!(
            m.storage_quarantined.get(),
            0,
            "open leaves the folder as it is"
        );
        assert!(s.reload().unwrap().is_empty());
        assert_eq!(m.storage_quarantined.get(), 1);
        assert_eq!(names(&dir.join("pods")), vec!["good.json"]);
        let quarantined = names(&dir.join("pods-quarantine"));
        assert!(
            quarantined.len() == 1 && quarantined[0].starts_with("locked.json."),
            "{quarantined:?}"
        );
    }

    /// Fault matrix row 9 (ENOSPC, read-only folder), issue 17: a write that fails leaves
    /// nothing partial (its temp file goes, the other records stay whole), is counted and
    /// reported until a write succeeds again, and the next write after the fault clears
    /// succeeds without a restart. The fault here is a rename onto a directory, which
    /// fails after the temp file was written, for root too.
    #[test]
    fn put_all_writes_every_record_once_and_skips_unchanged_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (s, m) = open(dir.path());
        let batch: Vec<Pod> = (0..40)
            .map(|i| pod(&format!("p{i:02}"), &format!("10.0.1.{i}")))
            .collect();
        let results = s.put_all(&batch);
        assert_eq!(results.len(), 40);
        assert!(results.iter().all(|r| matches!(r, Ok(true))), "{results:?}");
        let pods = dir.path().join("pods");
        let mut want: Vec<String> = batch.iter().map(|p| format!("{}.json", p.uid)).collect();
        want.sort();
        assert_eq!(names(&pods), want, "every record, no temp file");
        for p in &batch {
            assert_eq!(
                decode_record(&fs::read(pods.join(format!("{}.json", p.uid))).unwrap()),
                Ok(p.clone())
            );
        }
        assert_eq!(
            open(dir.path()).0.pods(),
            batch,
            "a fresh open reads the batch back"
        );

        let mut again = batch.clone();
        again[7].ips = vec!["10.0.2.7".parse().unwrap()];
        let results = s.put_all(&again);
        let wrote: Vec<usize> = (0..40)
            .filter(|&i| matches!(results[i], Ok(true)))
            .collect();
        assert_eq!(
            wrote,
            vec![7],
            "only the changed record is written: {results:?}"
        );
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(s.get(&again[7].uid), Some(again[7].clone()));
        assert_eq!(write_errors(&m, "write"), 0);
    }

    #[test]
    fn put_all_writes_a_uid_named_twice_in_order_and_fails_only_the_bad_records() {
        let dir = tempfile::tempdir().unwrap();
        let (s, m) = open(dir.path());
        let pods = dir.path().join("pods");
        fs::create_dir_all(pods.join("blocked.json/in-the-way")).unwrap();
        let batch = vec![
            pod("a", "10.0.0.1"),
            pod("blocked", "10.0.0.2"),
            pod("../escape", "10.0.0.3"),
            pod("b", "10.0.0.4"),
            pod("a", "10.0.0.5"),
        ];
        let results = s.put_all(&batch);
        assert!(matches!(results[0], Ok(true)), "{results:?}");
        let blocked = results[1]
            .as_ref()
            .expect_err("blocked.json is a directory")
            .to_string();
        assert!(
            blocked.contains(&pods.join("blocked.json").display().to_string()),
            "{blocked}"
        );
        assert!(
            matches!(results[2], Err(StorageError::InvalidUid(_))),
            "{results:?}"
        );
        assert!(matches!(results[3], Ok(true)), "{results:?}");
        assert!(
            matches!(results[4], Ok(true)),
            "the second `a` is written after the first: {results:?}"
        );
        assert_eq!(
            decode_record(&fs::read(pods.join("a.json")).unwrap()),
            Ok(pod("a", "10.0.0.5")),
            "the later `a` wins"
        );
        assert_eq!(s.get("a"), Some(pod("a", "10.0.0.5")));
        assert_eq!(s.get("blocked"), None, "a failed write is not in the view");
        assert_eq!(
            names(&pods),
            vec!["a.json", "b.json", "blocked.json"],
            "no temp file left"
        );
        assert_eq!(
            write_errors(&m, "write"),
            1,
            "the one failed write counts; an invalid uid is refused before any write"
        );
    }

    #[tokio::test]
    async fn failed_write_leaves_nothing_partial_and_is_reported_until_a_write_succeeds() {
        let dir = tempfile::tempdir().unwrap();
        let (s, m) = open(dir.path());
        let s = Arc::new(s);
        let (status, r) = reporter();
        let _upkeep = s.start_upkeep(r);
        s.put(&pod("a", "10.0.0.1")).unwrap();
        let pods = dir.path().join("pods");
        fs::create_dir_all(pods.join("b.json/in-the-way")).unwrap();

        let err = s
            .put(&pod("b", "10.0.0.2"))
            .expect_err("b.json is a directory")
            .to_string();
        assert!(
            err.contains(&pods.join("b.json").display().to_string()),
            "the error names the path: {err}"
        );
        assert!(
            err.contains("directory"),
            "the error names the cause: {err}"
        );
        assert_eq!(names(&pods), vec!["a.json", "b.json"], "no temp file left");
        assert_eq!(
            decode_record(&fs::read(pods.join("a.json")).unwrap()),
            Ok(pod("a", "10.0.0.1"))
        );
        assert_eq!(s.get("b"), None, "a failed write is not in the view");
        assert_eq!(write_errors(&m, "write"), 1);
        let problem = storage_problem(&status).expect("reported");
        assert!(problem.contains(&err), "{problem}");
        assert!(s.put(&pod("b", "10.0.0.2")).is_err());
        assert_eq!(write_errors(&m, "write"), 2, "each failure counts");

        fs::remove_dir_all(pods.join("b.json")).unwrap();
        assert!(
            s.put(&pod("b", "10.0.0.2")).unwrap(),
            "the first write after the fault succeeds"
        );
        assert_eq!(storage_problem(&status), None, "the report clears");
        assert_eq!(write_errors(&m, "write"), 2);
        assert_eq!(
            open(dir.path()).0.pods(),
            vec![pod("a", "10.0.0.1"), pod("b", "10.0.0.2")]
        );
    }

    /// Swaps the records folder for a file, so that every file operation in it fails
    /// (ENOTDIR, for root too); the guard puts the folder back.
    struct BrokenFolder(PathBuf);

    impl BrokenFolder {
        fn new(pods: &Path) -> Self {
            fs::rename(pods, pods.with_extension("away")).unwrap();
            fs::write(pods, b"not a folder").unwrap();
            Self(pods.to_path_buf())
        }
    }

    impl Drop for BrokenFolder {
        fn drop(&mut self) {
            let _ = fs::remove_file(&self.0);
            let _ = fs::rename(self.0.with_extension("away"), &self.0);
        }
    }

    /// Fault matrix row 9 (read-only folder), issue 17: a pod whose record cannot be
    /// removed leaves the view at once (no phantom in the snapshot), the failure is counted
    /// and reported, and the retry task removes the record once the folder heals, with no
    /// further call; the report then clears.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_record_that_cannot_be_removed_leaves_the_view_and_the_retry_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        let (s, m) = open(dir.path());
        let s = Arc::new(s);
        let (status, r) = reporter();
        let _upkeep = s.start_upkeep(r);
        s.put(&pod("a", "10.0.0.1")).unwrap();
        s.put(&pod("keep", "10.0.0.2")).unwrap();
        let pods = dir.path().join("pods");

        let broken = BrokenFolder::new(&pods);
        let removal = s.remove_or_retry("a").unwrap();
        assert_eq!(removal.pod, Some(pod("a", "10.0.0.1")));
        let why = removal.deferred.expect("the removal failed").to_string();
        assert!(
            why.contains(&pods.join("a.json").display().to_string()),
            "{why}"
        );
        assert_eq!(s.get("a"), None, "the pod left the view");
        assert_eq!(s.pending_removals(), vec!["a"]);
        assert!(write_errors(&m, "remove") >= 1);
        let problem = storage_problem(&status).expect("reported");
        assert!(
            problem.contains("deleted pod uid(s) a pending"),
            "{problem}"
        );
        // The strict removal (an eviction) fails and keeps the pod.
        assert!(s.remove("keep").is_err());
        assert_eq!(s.get("keep"), Some(pod("keep", "10.0.0.2")));
        drop(broken);

        assert!(
            pods.join("a.json").exists(),
            "still there while nothing retried"
        );
        wait(RETRY_MAX * 3, || s.pending_removals().is_empty());
        assert!(
            !pods.join("a.json").exists(),
            "the retry removed the record"
        );
        assert_eq!(names(&pods), vec!["keep.json"]);
        assert_eq!(storage_problem(&status), None, "the report clears");
    }

    /// A successful write drains the retry set; a pending removal of a pod that was added
    /// again since (a new sandbox) is void and leaves its new record alone.
    #[test]
    fn a_write_drains_pending_removals_and_a_new_add_voids_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _) = open(dir.path());
        s.put(&pod("a", "10.0.0.1")).unwrap();
        s.put(&pod("b", "10.0.0.2")).unwrap();
        let pods = dir.path().join("pods");
        let broken = BrokenFolder::new(&pods);
        assert!(s.remove_or_retry("a").unwrap().deferred.is_some());
        assert!(s.remove_or_retry("b").unwrap().deferred.is_some());
        drop(broken);
        let again = Pod {
            container_id: "c-b-new".into(),
            ..pod("b", "10.0.0.2")
        };
        assert!(s.put(&again).unwrap());
        assert_eq!(s.pending_removals(), Vec::<String>::new());
        assert_eq!(
            names(&pods),
            vec!["b.json"],
            "a's record went with the write"
        );
        assert_eq!(open(dir.path()).0.pods(), vec![again]);
    }

    /// Polls `cond` every 10 ms for up to `bound`.
    fn wait(bound: Duration, mut cond: impl FnMut() -> bool) {
        let start = std::time::Instant::now();
        while !cond() {
            assert!(start.elapsed() < bound, "not within {bound:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn newer_schema_with_extra_fields_still_loads() {
        let mut json: serde_json::Value =
            serde_json::from_slice(&encode_record(&pod("a", "10.0.0.1"))).unwrap();
        json["schema"] = 2.into();
        json["added_later"] = "x".into();
        assert_eq!(
            decode_record(&serde_json::to_vec(&json).unwrap()),
            Ok(pod("a", "10.0.0.1"))
        );
    }
}
