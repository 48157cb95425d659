//! The registry view of services and endpoints, and the embedded registry that reads it
//! from a JSON file (`--registry-file`) and reloads it on change.
//!
//! # File schema
//!
//! The schema, its parsing and its validation are the model's
//! ([`aether_model::registry_file`]), shared with `aether-registrar apply`. Unknown
//! fields are rejected so a typo is an error, not a silently ignored setting. A service
//! is keyed by namespace and name; the same key twice is an error.
//!
//! # Reload
//!
//! The watcher reacts to inotify events on the file's directory (so atomic renames and
//! Kubernetes ConfigMap symlink swaps are seen) and also polls every [`POLL_INTERVAL`].
//! Each look is a `stat` first: the file is read again only when its size, mtime,
//! ctime or inode moved, so an idle 7 MB registry costs a stat per poll. Reading,
//! hashing and parsing run on the worker's heavy-work thread (`crate::heavy`), never on
//! the runtime's, ahead of the encoding warm-up waiting there, and parse only
//! the services whose text is new since the last load; the node gets those and the
//! removals, and its builder rebuilds them alone. A file over `--registry-max-bytes` is rejected unread.
//! A malformed, oversized or missing file keeps the last good view and logs an error
//! naming the file and, for JSON, the line and column; `registry_loaded` is set only by
//! a good load, so a standby with a broken registry file stays incomplete, visibly.
//! With no file configured the registry is empty and counts as loaded.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aether_model::registry_file::{Ignored, listed_twice, service_from_str, validate};
use aether_model::{Change, ServiceKey};
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::node::Node;

pub use aether_model::registry_file::{FileError, parse};

/// How often a watched file is re-read even without an inotify event.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The file with each service left unparsed: a scan, no allocation per field. Fields
/// it does not know are ignored (see `aether_model::registry_file`); those inside a
/// service are named in a warning when the service is parsed.
#[derive(Deserialize)]
struct RawDoc<'a> {
    #[serde(borrow, default)]
    services: Vec<&'a serde_json::value::RawValue>,
}

/// Runs the embedded registry: loads `path` into the node's inputs, marks the registry
/// gate, and reloads on change until the task is aborted. `None`: an empty registry,
/// loaded at once.
pub fn spawn_embedded(
    path: Option<PathBuf>,
    max_bytes: u64,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
) -> JoinHandle<()> {
    let watch = path.map(Watch::open);
    tokio::spawn(async move {
        let Some(watch) = watch else {
            node.set_gate(|g| g.registry_loaded = true);
            return;
        };
        watch_file(
            watch,
            "registry",
            max_bytes,
            &metrics,
            RegistryFile::default(),
            |changes: Vec<Change>| {
                node.apply(changes);
                node.set_gate(|g| g.registry_loaded = true);
            },
        )
        .await
    })
}

/// The registry file as a source: each good load becomes the changes from the last one.
///
/// A reload scans the file once, leaving each service's JSON unparsed, and hashes each
/// service's text: only a service whose text is new is parsed, validated and sent as an
/// upsert (the builder drops one that equals what it holds); a key the last load had and
/// this one lacks is a removal. An endpoint change in a 7 MB file parses one service.
#[derive(Default)]
struct RegistryFile {
    /// The key of each service text of the last good load, by the text's hash and length:
    /// its values are that load's services.
    texts: HashMap<(u64, usize), ServiceKey>,
}

impl FileSource for RegistryFile {
    type Output = Vec<Change>;

    fn parse(&mut self, path: &Path, bytes: &[u8]) -> Result<Vec<Change>, FileError> {
        let doc: RawDoc = serde_json::from_slice(bytes).map_err(|e| FileError::json(path, &e))?;
        let mut texts = HashMap::with_capacity(doc.services.len());
        let mut keys: HashSet<ServiceKey> = HashSet::with_capacity(doc.services.len());
        let mut upserts = Vec::new();
        let mut ignored = Ignored::default();
        for (i, raw) in doc.services.iter().enumerate() {
            let text = raw.get();
            let id = (file_hash(text.as_bytes()), text.len());
            let key = match self.texts.get(&id) {
                Some(key) => key.clone(),
                None => {
                    let offset = text.as_ptr() as usize - bytes.as_ptr() as usize;
                    let fs = service_from_str(text, i, &mut ignored)
                        .map_err(|e| FileError::json_at(path, bytes, offset, &e))?;
                    let service = validate(path, i, fs)?;
                    let key = service.key();
                    upserts.push(service);
                    key
                }
            };
            if !keys.insert(key.clone()) {
                return Err(listed_twice(path, i, &key.name, &key.namespace));
            }
            texts.insert(id, key);
        }
        if ignored.count > 0 {
            tracing::warn!(
                file = %path.display(),
                fields = %ignored,
                "registry file: fields this agent does not know, ignored (a newer release's, or a typo)"
            );
        }
        // Committed only now: a rejected file changes nothing.
        let removed = self
            .texts
            .values()
            .filter(|k| !keys.contains(*k))
            .map(|k| Change::RemoveService(k.clone()));
        let changes = removed
            .chain(upserts.into_iter().map(Change::UpsertService))
            .collect();
        self.texts = texts;
        Ok(changes)
    }
}

/// What a watched file turns into. `parse` runs on a blocking thread.
pub(crate) trait FileSource: Send + 'static {
    type Output: Send + 'static;
    fn parse(&mut self, path: &Path, bytes: &[u8]) -> Result<Self::Output, FileError>;
}

/// A watched file: its path and the inotify instance on its directory, if one could be
/// opened.
pub(crate) struct Watch {
    path: PathBuf,
    events: Option<DirEvents>,
}

impl Watch {
    /// Opens the inotify instance now, in the caller, before the watching task runs: the
    /// worker's watchers then hold lower descriptor numbers than what it opens later, and
    /// a dying process releases its files highest number first. Closing an inotify
    /// instance waits for a kernel grace period (about 10 ms on a busy node), so the
    /// sockets go before it (see the worker's main).
    pub(crate) fn open(path: PathBuf) -> Watch {
        let events = DirEvents::new(&path);
        Watch { path, events }
    }
}

/// What `stat` says of a file; a re-read happens only when it moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
    inode: u64,
    dev: u64,
}

impl Stat {
    fn of(m: &std::fs::Metadata) -> Self {
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        Self {
            size: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
            ctime_ns: ns(m.ctime(), m.ctime_nsec()),
            inode: m.ino(),
            dev: m.dev(),
        }
    }
}

/// One look at the file, done off the runtime thread.
enum Look<T> {
    /// Read and parsed; the content's hash.
    Parsed(T, u64),
    /// Read, but the content is what was last applied or rejected.
    Same,
    Rejected(FileError, u64),
    Unreadable(FileError),
}

/// Calls `apply` with what `source` makes of the file at start and after every change
/// of it, until the task is aborted. Errors (an unreadable or oversized file, content
/// the source rejects) are logged with the file's name and counted; the caller keeps
/// its last good state.
pub(crate) async fn watch_file<S: FileSource>(
    watch: Watch,
    what: &'static str,
    max_bytes: u64,
    metrics: &Metrics,
    source: S,
    mut apply: impl FnMut(S::Output),
) {
    let Watch { path, mut events } = watch;
    if events.is_none() {
        tracing::warn!(file = %path.display(), "{what}: no inotify on the file's directory; polling every {POLL_INTERVAL:?}");
    }
    let path: Arc<Path> = path.into();
    let mut source = Some(source);
    // What stat said at the last look, and the hash of the content last applied or
    // rejected, so neither is redone.
    let mut seen: Option<Stat> = None;
    let mut hashes: (Option<u64>, Option<u64>) = (None, None);
    let mut unreadable = false;
    loop {
        let stat = std::fs::metadata(&path).map(|m| Stat::of(&m));
        let moved = match &stat {
            Ok(s) => seen != Some(*s),
            Err(_) => true,
        };
        if moved {
            seen = stat.as_ref().ok().copied();
            let (p, mut src, known) = (
                path.clone(),
                source.take().expect("source is back after each look"),
                hashes,
            );
            // On the heavy-work thread, not the blocking pool, and ahead of the encoding
            // warm-up waiting there: see `crate::heavy`.
            let looked = crate::heavy::run_first(move || {
                let look = look(&p, &stat, max_bytes, known, &mut src);
                (look, src)
            })
            .await;
            let look = match looked {
                Ok((look, src)) => {
                    source = Some(src);
                    look
                }
                // A panic in parsing is a bug; the source went with it, so stop watching.
                Err(e) => {
                    tracing::error!(file = %path.display(), error = %e, "{what} file watcher failed; keeping the last good {what}");
                    return;
                }
            };
            match look {
                Look::Parsed(out, h) => {
                    unreadable = false;
                    apply(out);
                    tracing::info!(file = %path.display(), hash = format!("{h:016x}"), "{what} file loaded");
                    hashes = (Some(h), None);
                }
                Look::Same => unreadable = false,
                Look::Rejected(e, h) => {
                    unreadable = false;
                    metrics.reload_error(what);
                    tracing::error!(file = %path.display(), error = %e, "{what} file rejected; keeping the last good {what}");
                    hashes.1 = Some(h);
                }
                // Reported once per failure streak, not on every poll.
                Look::Unreadable(e) => {
                    seen = None;
                    if !unreadable {
                        unreadable = true;
                        metrics.reload_error(what);
                        tracing::error!(file = %path.display(), error = %e, "{what} file unreadable; keeping the last good {what}");
                    }
                }
            }
        }
        match events.as_mut() {
            Some(ev) => {
                ev.next(POLL_INTERVAL).await;
            }
            None => tokio::time::sleep(POLL_INTERVAL).await,
        }
    }
}

/// A fast hash of a file's content, to skip content already applied or rejected: FNV-1a's
/// steps over 8-byte words instead of bytes (eight times fewer multiplications; a 7 MB
/// registry hashes in about a millisecond). Not a resource version: only compared with
/// itself, within one process.
pub fn file_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        h ^= u64::from_le_bytes(w.try_into().expect("chunks of 8"));
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    for b in words.remainder() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^ bytes.len() as u64
}

/// Reads the file (unless it is over `max_bytes`), and parses it unless its content is
/// the last good or last bad one (`known`).
fn look<S: FileSource>(
    path: &Path,
    stat: &std::io::Result<Stat>,
    max_bytes: u64,
    known: (Option<u64>, Option<u64>),
    source: &mut S,
) -> Look<S::Output> {
    let read = |source: std::io::Error| FileError::Read {
        path: path.to_owned(),
        source,
    };
    match stat {
        Err(e) => return Look::Unreadable(read(std::io::Error::new(e.kind(), e.to_string()))),
        Ok(s) if s.size > max_bytes => {
            let h = file_hash(&s.size.to_le_bytes()) ^ s.inode;
            if known.1 == Some(h) {
                return Look::Same;
            }
            return Look::Rejected(
                FileError::TooLarge {
                    path: path.to_owned(),
                    size: s.size,
                    limit: max_bytes,
                },
                h,
            );
        }
        Ok(_) => {}
    }
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => return Look::Unreadable(read(e)),
    };
    if bytes.len() as u64 > max_bytes {
        let size = bytes.len() as u64;
        return Look::Rejected(
            FileError::TooLarge {
                path: path.to_owned(),
                size,
                limit: max_bytes,
            },
            file_hash(&bytes),
        );
    }
    let h = file_hash(&bytes);
    if known.0 == Some(h) || known.1 == Some(h) {
        return Look::Same;
    }
    match source.parse(path, &bytes) {
        Ok(out) => Look::Parsed(out, h),
        Err(e) => Look::Rejected(e, h),
    }
}

/// inotify on a directory, reporting events on the names it wants: for a watched file,
/// its name or a `..`-prefixed name (a Kubernetes ConfigMap swaps its `..data` symlink).
/// Other names (a writer's temp file) do not wake the reload.
pub(crate) struct DirEvents {
    fd: tokio::io::unix::AsyncFd<InotifyFd>,
    wanted: Box<dyn Fn(&std::ffi::OsStr) -> bool + Send + Sync>,
}

struct InotifyFd(nix::sys::inotify::Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl DirEvents {
    fn new(file: &Path) -> Option<Self> {
        let name = file.file_name()?.to_owned();
        let dir = match file.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        Self::on(
            dir,
            Box::new(move |n| n == name || n.as_encoded_bytes().starts_with(b"..")),
        )
    }

    /// Events in `dir` on the names `wanted` accepts.
    pub(crate) fn on(
        dir: &Path,
        wanted: Box<dyn Fn(&std::ffi::OsStr) -> bool + Send + Sync>,
    ) -> Option<Self> {
        use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify};
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok()?;
        // Not IN_MODIFY: a writer mid-write would make us read half a file.
        let flags = F::IN_CLOSE_WRITE
            | F::IN_MOVED_TO
            | F::IN_MOVED_FROM
            | F::IN_CREATE
            | F::IN_DELETE
            | F::IN_ATTRIB;
        ino.add_watch(dir, flags).ok()?;
        // `AsyncFd::new` is deprecated for `unsafe fn register`, whose safety condition
        // (the fd stays open and the same while registered) holds here: the `Inotify` owns
        // it and lives inside the `AsyncFd`. This crate forbids unsafe, so keep `new`.
        #[allow(deprecated)]
        let fd = tokio::io::unix::AsyncFd::new(InotifyFd(ino)).ok()?;
        Some(Self { fd, wanted })
    }

    /// Returns after the next relevant event (true), or after `max` (false).
    pub(crate) async fn next(&mut self, max: Duration) -> bool {
        let wait = async {
            loop {
                let Ok(mut guard) = self.fd.readable().await else {
                    // The fd is gone: as if an event came, so that the caller looks.
                    return true;
                };
                let hit = match drain(guard.get_inner(), &*self.wanted) {
                    Ok(hit) => hit,
                    Err(()) => return true,
                };
                guard.clear_ready();
                if hit {
                    return true;
                }
            }
        };
        tokio::time::timeout(max, wait).await.unwrap_or(false)
    }

    /// Whether a relevant event is queued now, without waiting: the events are read and
    /// consumed. True also on a queue overflow (events were lost) and when the queue
    /// cannot be read.
    pub(crate) fn pending(&self) -> bool {
        drain(self.fd.get_ref(), &*self.wanted).unwrap_or(true)
    }
}

/// Reads every event queued on `fd`; whether one was relevant: on a name `wanted`
/// accepts, or an overflow. Err when the queue cannot be read.
fn drain(
    fd: &InotifyFd,
    wanted: &(dyn Fn(&std::ffi::OsStr) -> bool + Send + Sync),
) -> Result<bool, ()> {
    use nix::sys::inotify::AddWatchFlags as F;
    let mut hit = false;
    loop {
        match fd.0.read_events() {
            Ok(ev) if !ev.is_empty() => {
                hit |= ev.iter().any(|e| {
                    e.mask.contains(F::IN_Q_OVERFLOW) || e.name.as_ref().is_none_or(|n| wanted(n))
                })
            }
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => return Ok(hit),
            Err(_) => return Err(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_model::RegistryView;

    // Parsing and validation are tested beside them, in `aether_model::registry_file`.

    #[tokio::test]
    async fn reloads_on_change_and_keeps_last_good_on_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.json");
        let good = r#"{"services":[{"name":"web","namespace":"d","ports":[80]}]}"#;
        std::fs::write(&path, good).unwrap();
        let node = Node::new(Default::default());
        let metrics = Metrics::new();
        let task = spawn_embedded(Some(path.clone()), u64::MAX, node.clone(), metrics.clone());
        let mut gates = node.gates();
        tokio::time::timeout(
            Duration::from_secs(5),
            gates.wait_for(|g| g.registry_loaded),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(node.inputs().registry.services.len(), 1);

        std::fs::write(&path, "{ nope").unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while metrics.reload_errors("registry") == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "malformed file not noticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            node.inputs().registry.services.len(),
            1,
            "last good view kept"
        );

        let two = r#"{"services":[{"name":"web","namespace":"d","ports":[80]},{"name":"api","namespace":"d","ports":[80]}]}"#;
        let tmp = dir.path().join("registry.json.tmp");
        std::fs::write(&tmp, two).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let mut snaps = node.subscribe();
        tokio::time::timeout(
            Duration::from_secs(5),
            snaps.wait_for(|s| s.clusters.items.len() == 2),
        )
        .await
        .expect("renamed file reloaded")
        .unwrap();
        task.abort();
    }

    #[tokio::test]
    async fn a_file_over_the_size_cap_is_rejected_unread_and_the_last_good_view_stays() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.json");
        std::fs::write(
            &path,
            r#"{"services":[{"name":"web","namespace":"d","ports":[80]}]}"#,
        )
        .unwrap();
        let node = Node::new(Default::default());
        let metrics = Metrics::new();
        let task = spawn_embedded(Some(path.clone()), 200, node.clone(), metrics.clone());
        let mut gates = node.gates();
        tokio::time::timeout(
            Duration::from_secs(5),
            gates.wait_for(|g| g.registry_loaded),
        )
        .await
        .unwrap()
        .unwrap();

        let big: Vec<String> = (0..20)
            .map(|i| format!(r#"{{"name":"s{i}","namespace":"d","ports":[80]}}"#))
            .collect();
        std::fs::write(&path, format!(r#"{{"services":[{}]}}"#, big.join(","))).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while metrics.reload_errors("registry") == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "oversized file not noticed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            node.inputs().registry.services.len(),
            1,
            "last good view kept"
        );
        task.abort();

        let stat = std::fs::metadata(&path).map(|m| Stat::of(&m));
        let mut source = RegistryFile::default();
        match look(&path, &stat, 200, (None, None), &mut source) {
            Look::Rejected(e, _) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&path.display().to_string())
                        && msg.contains("over the limit of 200 bytes"),
                    "{msg}"
                );
            }
            _ => panic!("an oversized file must be rejected"),
        }
    }

    #[test]
    fn a_reload_sends_only_the_services_that_changed() {
        let mut source = RegistryFile::default();
        let p = Path::new("r.json");
        let one = r#"{"services":[{"name":"a","namespace":"d","ports":[80]},{"name":"b","namespace":"d","ports":[80]}]}"#;
        assert_eq!(source.parse(p, one.as_bytes()).unwrap().len(), 2);
        let two = r#"{"services":[{"name":"a","namespace":"d","ports":[80]},{"name":"b","namespace":"d","ports":[81]}]}"#;
        let changes = source.parse(p, two.as_bytes()).unwrap();
        assert!(
            matches!(changes.as_slice(), [Change::UpsertService(s)] if s.name == "b"),
            "{changes:?}"
        );
        assert!(source.parse(p, two.as_bytes()).unwrap().is_empty());
    }

    /// A file a newer release writes (fields this agent does not know, at the top and in
    /// an endpoint) loads: the endpoint is kept, the change applies. During a roll the
    /// older agent beside the newer one reads the same file.
    #[test]
    fn a_newer_files_unknown_fields_are_ignored_and_its_changes_apply() {
        let mut source = RegistryFile::default();
        let p = Path::new("r.json");
        let old = r#"{"services":[{"name":"a","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":80}]}]}"#;
        assert_eq!(source.parse(p, old.as_bytes()).unwrap().len(), 1);
        let newer = r#"{"generation":3,"services":[{"name":"a","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":80},{"address":"10.0.0.2","port":80,"quic":"10.0.0.2:4443","quic_sni":"a.d"}]}]}"#;
        let changes = source.parse(p, newer.as_bytes()).unwrap();
        assert!(
            matches!(changes.as_slice(), [Change::UpsertService(s)] if s.endpoints.len() == 2),
            "{changes:?}"
        );
    }

    /// The incremental reload (a scan, then only new service texts parsed) ends at the
    /// view a whole parse gives, and rejects what it rejects with the same message.
    #[test]
    fn the_incremental_reload_agrees_with_a_whole_parse() {
        let p = Path::new("/etc/aether/registry.json");
        let svc = |n: &str, port: u16, ep: &str| {
            format!(
                r#"{{"name":"{n}","namespace":"d","ports":[{port}],"endpoints":[{{"address":"{ep}","port":8080}}]}}"#
            )
        };
        let file = |svcs: &[String]| format!("{{\"services\": [\n{}\n]}}", svcs.join(",\n"));
        let steps = [
            file(&[
                svc("a", 80, "10.0.0.1"),
                svc("b", 80, "10.0.0.2"),
                svc("c", 80, "10.0.0.3"),
            ]),
            file(&[
                svc("a", 80, "10.0.0.1"),
                svc("b", 80, "10.0.0.9"),
                svc("c", 80, "10.0.0.3"),
            ]),
            // Reordered, one removed, one added.
            file(&[
                svc("c", 80, "10.0.0.3"),
                svc("d", 81, "10.0.0.4"),
                svc("a", 80, "10.0.0.1"),
            ]),
            // Rejected: a duplicate of an unchanged text, then a bad field, then bad JSON.
            file(&[svc("c", 80, "10.0.0.3"), svc("c", 80, "10.0.0.3")]),
            file(&[
                svc("c", 80, "10.0.0.3"),
                r#"{"name":"e","namespace":"d","ports":[0]}"#.into(),
            ]),
            file(&[
                svc("c", 80, "10.0.0.3"),
                r#"{"name":"e","namespace":"d","ports":[80],"prots":1}"#.into(),
            ]),
            "{\"services\": [\n  {\"name\": }".into(),
            // Back to a good file after the rejections.
            file(&[svc("a", 80, "10.0.0.1"), svc("c", 80, "10.0.0.7")]),
            file(&[]),
        ];
        let mut source = RegistryFile::default();
        let mut view = RegistryView::default();
        for (n, text) in steps.iter().enumerate() {
            let whole = parse(p, text.as_bytes());
            let step = source.parse(p, text.as_bytes());
            match (whole, step) {
                (Ok(want), Ok(changes)) => {
                    for c in changes {
                        match c {
                            Change::UpsertService(s) => {
                                view.services.insert(s.key(), s);
                            }
                            Change::RemoveService(k) => {
                                view.services.remove(&k);
                            }
                            other => panic!("step {n}: {other:?}"),
                        }
                    }
                    assert_eq!(view, want, "step {n}");
                }
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "step {n}"),
                (a, b) => panic!("step {n}: whole parse {a:?}, incremental {b:?}"),
            }
        }
    }

    #[tokio::test]
    async fn no_file_is_an_empty_loaded_registry_and_a_missing_file_is_not_loaded() {
        let node = Node::new(Default::default());
        spawn_embedded(None, u64::MAX, node.clone(), Metrics::new())
            .await
            .unwrap();
        assert!(node.gates().borrow().registry_loaded);

        let dir = tempfile::tempdir().unwrap();
        let node = Node::new(Default::default());
        let metrics = Metrics::new();
        let task = spawn_embedded(
            Some(dir.path().join("absent.json")),
            u64::MAX,
            node.clone(),
            metrics.clone(),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!node.gates().borrow().registry_loaded);
        assert_eq!(metrics.reload_errors("registry"), 1);
        std::fs::write(dir.path().join("absent.json"), "{}").unwrap();
        let mut gates = node.gates();
        tokio::time::timeout(
            Duration::from_secs(5),
            gates.wait_for(|g| g.registry_loaded),
        )
        .await
        .unwrap()
        .unwrap();
        task.abort();
    }
}
