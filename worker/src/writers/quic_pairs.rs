//! The node's QUIC pairs: each local pod's TCP endpoint with its live QUIC twin, as the
//! owner advertises them to the registry (SetQuicPairs) and keeps them in
//! `<state-dir>/quic-pairs.json`.
//!
//! The file is one JSON object, `{"pairs": [{"pod", "tcp", "quic", "sni", "since"}]}`:
//! `pod` is `namespace/name`, `tcp` the pod's endpoint `IP:PORT`, `quic` the `HOST:PORT`
//! where an HTTP/3 client reaches the twin, `sni` the server name to send (empty if none)
//! and `since` the epoch second the twin started serving. Pairs are sorted by `tcp`, so an
//! equal set is equal bytes. A file past [`MAX_BYTES`] or [`MAX_PAIRS`], or one that does
//! not parse, is refused with an error naming the path; the owner moves it to
//! `<state-dir>/quic-pairs-quarantine/` (a standby leaves it where it is).
//!
//! Which pairs are advertised is [`advertise`], a pure function: a twin is advertised once
//! this agent has served it through the fetch window (`--quic-pair-window`), counted from
//! when this agent started serving, so the window restarts at every takeover; the pairs the
//! previous owner advertised (restored from the file) stay advertised, with their `since`,
//! while the window runs and their twin is still served.
//!
//! The rules of the owner-only writers hold: every agent restores the file at start; a
//! standby writes nothing, neither the file nor the registry; the owner re-reads the file
//! when it starts serving (the previous owner's last flush), writes each change, and its
//! final flush at drain lands before it releases the node lock.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_model::{INBOUND_TARGET_PORT, Inputs, ListenerKind, QUIC_TWINS, Snapshot};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::health::{QuicPairsStatus, Status};
use crate::metrics::{FileLabel, Metrics};
use crate::node::Node;

/// The file's name in the state folder.
pub const FILE: &str = "quic-pairs.json";
/// Where the owner moves a file it cannot read as pairs.
pub const QUARANTINE_DIR: &str = "quic-pairs-quarantine";
/// The most pairs a file may hold: the registrar's own ceiling per node
/// (`--quic-pairs-per-node` is at most 8,192).
pub const MAX_PAIRS: usize = 8192;
/// The most bytes a file may hold: [`MAX_PAIRS`] pairs of 512 bytes (the registrar's bound
/// on one pair).
pub const MAX_BYTES: u64 = (MAX_PAIRS * 512) as u64;
/// How long the writer waits after a change for more before it writes.
pub const COALESCE: Duration = Duration::from_millis(100);

/// One QUIC pair, as the file holds it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Pair {
    /// `namespace/name`.
    pub pod: String,
    /// The pod's TCP endpoint.
    pub tcp: SocketAddr,
    /// `HOST:PORT` where an HTTP/3 client reaches the twin.
    pub quic: String,
    /// The server name to send to the twin; empty if none.
    #[serde(default)]
    pub sni: String,
    /// Epoch seconds when the twin started serving.
    pub since: u64,
}

impl Pair {
    fn twin(&self) -> TwinKey {
        TwinKey {
            pod: self.pod.clone(),
            tcp: self.tcp,
            quic: self.quic.clone(),
            sni: self.sni.clone(),
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Doc {
    pairs: Vec<Pair>,
}

/// What makes a twin the same twin: its pod, its endpoint and where it is reached.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TwinKey {
    pub pod: String,
    pub tcp: SocketAddr,
    pub quic: String,
    pub sni: String,
}

/// A twin this owner serves, and since when (epoch milliseconds: the later of when the
/// twin first appeared in its snapshot and when it started serving).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    pub twin: TwinKey,
    pub served_since_ms: u64,
}

/// When the fetch window is, for the owner that started serving at `serving_since_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub length: Duration,
    pub serving_since_ms: u64,
}

impl Window {
    pub fn ends_ms(&self) -> u64 {
        self.serving_since_ms
            .saturating_add(self.length.as_millis() as u64)
    }
}

/// The pairs to advertise, sorted by `tcp`: each live twin served through the window (from
/// its own `served_since_ms`), and, while the window runs, each restored pair whose twin is
/// still live. A live twin that was restored keeps the restored `since`, so the set that
/// the previous owner advertised is restated byte for byte; another's `since` is when this
/// owner started serving it. A restored pair whose twin is gone is withdrawn at once.
pub fn advertise(live: &[Live], restored: &[Pair], window: Window, now_ms: u64) -> Vec<Pair> {
    let restored: BTreeMap<TwinKey, &Pair> = restored.iter().map(|p| (p.twin(), p)).collect();
    let running = now_ms < window.ends_ms();
    let length = window.length.as_millis() as u64;
    let mut out: Vec<Pair> = live
        .iter()
        .filter_map(|l| {
            let was = restored.get(&l.twin);
            let served = now_ms >= l.served_since_ms.saturating_add(length);
            (served || (running && was.is_some())).then(|| Pair {
                pod: l.twin.pod.clone(),
                tcp: l.twin.tcp,
                quic: l.twin.quic.clone(),
                sni: l.twin.sni.clone(),
                since: was.map_or(l.served_since_ms / 1000, |p| p.since),
            })
        })
        .collect();
    out.sort_by_key(|p| p.tcp);
    out
}

/// The first moment after `now_ms` at which [`advertise`] may answer otherwise with the
/// same twins: the window's end, or a live twin's own window ending. None: nothing waits.
pub fn next_change(live: &[Live], window: Window, now_ms: u64) -> Option<u64> {
    let length = window.length.as_millis() as u64;
    live.iter()
        .map(|l| l.served_since_ms.saturating_add(length))
        .chain(std::iter::once(window.ends_ms()))
        .filter(|t| *t > now_ms)
        .min()
}

/// The twins the snapshot serves, as pairs' keys: one per twin pod and address of the
/// pod's own (an address two pods claim is no pair's), reached at the twins' listener.
/// Empty when the listener's address is unspecified: clients could not be told where.
pub fn twins_of(snapshot: &Snapshot, inputs: &Inputs) -> Vec<TwinKey> {
    let Some(listener) = snapshot.listeners.get(QUIC_TWINS) else {
        return Vec::new();
    };
    let ListenerKind::QuicTwins { twins } = &listener.kind else {
        return Vec::new();
    };
    if listener.address.ip().is_unspecified() {
        return Vec::new();
    }
    let mut claims: BTreeMap<std::net::IpAddr, usize> = BTreeMap::new();
    for p in inputs.pods.values() {
        for ip in p.ips.iter().collect::<BTreeSet<_>>() {
            *claims.entry(*ip).or_default() += 1;
        }
    }
    let quic = listener.address.to_string();
    let mut out = Vec::new();
    for t in twins {
        let Some(pod) = inputs.pods.get(&t.pod_uid) else {
            continue;
        };
        for ip in pod.ips.iter().collect::<BTreeSet<_>>() {
            if claims.get(ip) == Some(&1) {
                out.push(TwinKey {
                    pod: format!("{}/{}", pod.namespace, pod.name),
                    tcp: SocketAddr::new(*ip, INBOUND_TARGET_PORT),
                    quic: quic.clone(),
                    sni: t.sni.clone(),
                });
            }
        }
    }
    out
}

/// Why the file could not be read as pairs; each names the path.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: {bytes} bytes, more than the {max} a QUIC pairs file may hold")]
    TooLarge { path: String, bytes: u64, max: u64 },
    #[error("{path}: not a QUIC pairs file: {why}")]
    Corrupt { path: String, why: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl FileError {
    /// Whether the file itself is bad (to quarantine), not the read.
    pub fn is_bad_file(&self) -> bool {
        !matches!(self, FileError::Io { .. })
    }
}

/// Reads the pairs at `path`: none when there is no file.
pub fn read(path: &Path) -> Result<Vec<Pair>, FileError> {
    use std::io::Read;
    let p = || path.display().to_string();
    let io = |source| FileError::Io { path: p(), source };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(e)),
    };
    let bytes = file.metadata().map_err(io)?.len();
    if bytes > MAX_BYTES {
        return Err(FileError::TooLarge {
            path: p(),
            bytes,
            max: MAX_BYTES,
        });
    }
    let mut text = Vec::with_capacity(bytes as usize);
    file.take(MAX_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_BYTES {
        return Err(FileError::TooLarge {
            path: p(),
            bytes: text.len() as u64,
            max: MAX_BYTES,
        });
    }
    let corrupt = |why: String| FileError::Corrupt { path: p(), why };
    let doc: Doc = serde_json::from_slice(&text).map_err(|e| corrupt(e.to_string()))?;
    if doc.pairs.len() > MAX_PAIRS {
        return Err(corrupt(format!(
            "{} pairs, more than {MAX_PAIRS}",
            doc.pairs.len()
        )));
    }
    let mut seen = BTreeSet::new();
    for (i, pair) in doc.pairs.iter().enumerate() {
        let ok_pod = pair
            .pod
            .split_once('/')
            .is_some_and(|(ns, n)| !ns.is_empty() && !n.is_empty());
        if !ok_pod {
            return Err(corrupt(format!(
                "pairs[{i}].pod {:?} is not namespace/name",
                pair.pod
            )));
        }
        if pair
            .quic
            .rsplit_once(':')
            .is_none_or(|(h, port)| h.is_empty() || port.parse::<u16>().is_err())
        {
            return Err(corrupt(format!(
                "pairs[{i}].quic {:?} is not HOST:PORT",
                pair.quic
            )));
        }
        if !seen.insert(pair.tcp) {
            return Err(corrupt(format!(
                "pairs[{i}].tcp {} is listed twice",
                pair.tcp
            )));
        }
    }
    Ok(doc.pairs)
}

/// Moves the file at `path` into `<state_dir>/quic-pairs-quarantine/`; the owner's only.
fn quarantine(state_dir: &Path, path: &Path, why: &FileError) {
    use std::os::unix::fs::DirBuilderExt;
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = state_dir.join(QUARANTINE_DIR);
    let target = dir.join(format!("{FILE}.{stamp}"));
    let moved = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .and_then(|()| std::fs::rename(path, &target))
        .and_then(|()| std::fs::File::open(state_dir)?.sync_all());
    match moved {
        Ok(()) => error!(
            path = %path.display(), quarantined = %target.display(), error = %why,
            "QUIC pairs file refused; moved it to quarantine (no pair restored)"
        ),
        Err(e) => error!(
            path = %path.display(), error = %why, move_error = %e,
            "QUIC pairs file refused and could not be moved to quarantine; no pair restored"
        ),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The node's pairs: restored by every agent, written by the owner alone.
pub struct QuicPairs {
    state_dir: PathBuf,
    path: PathBuf,
    window: Duration,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    status: Arc<watch::Sender<Status>>,
    inner: Mutex<Inner>,
    /// The set to advertise to the registry, once this agent serves; None before.
    sets: watch::Sender<Option<Vec<Pair>>>,
}

struct Inner {
    /// What the file held at start, or when serving started.
    restored: Vec<Pair>,
    /// When this agent started serving; None: a standby, or not yet.
    window: Option<Window>,
    /// When this owner first served each twin (epoch ms).
    first_served: BTreeMap<TwinKey, u64>,
    /// What the file holds as this owner last wrote or read it.
    written: Option<Vec<Pair>>,
    /// Set by the drain's final flush: nothing is written after it.
    released: bool,
}

impl QuicPairs {
    /// Restores the pairs from `<state_dir>/quic-pairs.json`. A bad file is logged and
    /// left in place: a standby writes nothing, the owner quarantines it when it serves.
    pub fn restore(
        state_dir: &Path,
        window: Duration,
        node: Arc<Node>,
        metrics: Arc<Metrics>,
        status: Arc<watch::Sender<Status>>,
    ) -> Arc<Self> {
        let path = state_dir.join(FILE);
        let restored = match read(&path) {
            Ok(p) => p,
            Err(e) => {
                error!(error = %e, "QUIC pairs file refused; restored none (the owner quarantines it when it serves)");
                Vec::new()
            }
        };
        info!(file = %path.display(), pairs = restored.len(), "QUIC pairs restored");
        if let Some(q) = node.with_inputs(|i| i.quic_twins)
            && q.address.ip().is_unspecified()
        {
            warn!(address = %q.address, "--quic-twin-addr has an unspecified IP: clients cannot be told where the twins are, so no QUIC pair is advertised");
        }
        let me = Arc::new(Self {
            state_dir: state_dir.to_path_buf(),
            path,
            window,
            node,
            metrics,
            status,
            inner: Mutex::new(Inner {
                written: Some(restored.clone()),
                restored,
                window: None,
                first_served: BTreeMap::new(),
                released: false,
            }),
            sets: watch::Sender::new(None),
        });
        me.show(&lock(&me.inner), 0);
        me
    }

    /// The sets to advertise to the registry (None until this agent serves).
    pub fn sets(&self) -> watch::Receiver<Option<Vec<Pair>>> {
        self.sets.subscribe()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The owner starts: reads the file again (the previous owner's final flush, or a
    /// respawned worker's own last write; a bad file is quarantined now), starts the
    /// window, and states the set it advertises. Blocking (a read and maybe a rename).
    pub fn start_serving(&self) {
        let restored = match read(&self.path) {
            Ok(p) => p,
            Err(e) => {
                if e.is_bad_file() {
                    quarantine(&self.state_dir, &self.path, &e);
                } else {
                    error!(error = %e, "QUIC pairs file unreadable at takeover; restored none");
                }
                Vec::new()
            }
        };
        let now = now_ms();
        let mut inner = lock(&self.inner);
        info!(
            pairs = restored.len(),
            window_ms = self.window.as_millis() as u64,
            "QUIC pairs: serving; the fetch window starts, restored pairs stay advertised while it runs"
        );
        inner.written = Some(restored.clone());
        inner.restored = restored;
        inner.window = Some(Window {
            length: self.window,
            serving_since_ms: now,
        });
        drop(inner);
        let _ = self.step(now);
    }

    /// Brings the file and the advertised set up to date at `now`: follows the twins the
    /// node serves, decides, writes the file if the set changed. Returns when to look
    /// again if nothing changes. Nothing as a standby or after the final flush. Blocking.
    pub fn step(&self, now: u64) -> Option<u64> {
        let (snapshot, twins) = {
            let snapshot = self.node.snapshot();
            let twins = self.node.with_inputs(|i| twins_of(&snapshot, i));
            (snapshot, twins)
        };
        drop(snapshot);
        let mut inner = lock(&self.inner);
        let window = inner.window?;
        if inner.released {
            return None;
        }
        let keep: BTreeSet<&TwinKey> = twins.iter().collect();
        inner.first_served.retain(|k, _| keep.contains(k));
        for t in &twins {
            inner
                .first_served
                .entry(t.clone())
                .or_insert(now.max(window.serving_since_ms));
        }
        let live: Vec<Live> = inner
            .first_served
            .iter()
            .map(|(twin, since)| Live {
                twin: twin.clone(),
                served_since_ms: *since,
            })
            .collect();
        let pairs = advertise(&live, &inner.restored, window, now);
        if inner.written.as_ref() != Some(&pairs) {
            match self.write(&pairs) {
                Ok(()) => {
                    info!(pairs = pairs.len(), file = %self.path.display(), "QUIC pairs written");
                    inner.written = Some(pairs.clone());
                }
                Err(e) => {
                    self.count_error();
                    error!(file = %self.path.display(), error = %e, "QUIC pairs: write failed; retried at the next change and at drain");
                }
            }
        }
        self.metrics.quic_pairs_advertised.set(pairs.len() as i64);
        self.sets.send_if_modified(|s| {
            let changed = s.as_ref() != Some(&pairs);
            *s = Some(pairs.clone());
            changed
        });
        self.show(&inner, pairs.len());
        next_change(&live, window, now)
    }

    /// The drained owner's last write, before the lock passes: the file brought up to date,
    /// after which this process writes neither the file nor the registry. Blocking.
    pub fn flush_final(&self) {
        let _ = self.step(now_ms());
        let mut inner = lock(&self.inner);
        inner.released = true;
        info!(
            pairs = inner.written.as_ref().map_or(0, Vec::len),
            "QUIC pairs flushed before release"
        );
    }

    /// Whether the final flush happened: the registry writer stops.
    pub fn released(&self) -> bool {
        lock(&self.inner).released
    }

    fn write(&self, pairs: &[Pair]) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(&Doc {
            pairs: pairs.to_vec(),
        })
        .map_err(std::io::Error::other)?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(format!(".{FILE}.tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        crate::storage::write_atomically(&tmp, &self.path, &bytes, dir)
            .map_err(std::io::Error::other)?;
        self.metrics
            .state_writes
            .get_or_create(&FileLabel { file: FILE.into() })
            .inc();
        Ok(())
    }

    fn count_error(&self) {
        self.metrics
            .state_write_errors
            .get_or_create(&FileLabel { file: FILE.into() })
            .inc();
    }

    fn show(&self, inner: &Inner, advertised: usize) {
        let window_ms = self.window.as_millis() as u64;
        let (started, ends) = match inner.window {
            Some(w) => (Some(w.serving_since_ms), Some(w.ends_ms())),
            None => (None, None),
        };
        let state = match inner.window {
            None => "standby",
            Some(w) if now_ms() < w.ends_ms() => "running",
            Some(_) => "passed",
        };
        self.status.send_modify(|s| {
            let q = s.quic_pairs.get_or_insert_with(QuicPairsStatus::default);
            q.window_ms = window_ms;
            q.window = state;
            q.window_started_unix_ms = started;
            q.window_ends_unix_ms = ends;
            q.restored = inner.restored.len();
            q.advertised = advertised;
            q.live = inner.first_served.len();
        });
    }
}

/// The owner's writer: steps at each snapshot and when the window (or a twin's) ends, a
/// burst of changes coalesced over [`COALESCE`]. Runs until aborted or released.
pub async fn run_writer(pairs: Arc<QuicPairs>) {
    let mut snapshots = pairs.node.subscribe();
    loop {
        let p = pairs.clone();
        let next = match tokio::task::spawn_blocking(move || p.step(now_ms())).await {
            Ok(next) => next,
            Err(e) => {
                error!(error = %e, "QUIC pairs: writer step failed");
                None
            }
        };
        if pairs.released() {
            return;
        }
        let wait = next.map(|t| Duration::from_millis(t.saturating_sub(now_ms())));
        tokio::select! {
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                tokio::time::sleep(COALESCE).await;
                snapshots.borrow_and_update();
            }
            () = async {
                match wait {
                    Some(w) => tokio::time::sleep(w).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

/// The pairs are plain data; a panic while they were locked leaves them usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(15);

    fn key(pod: &str, tcp: &str) -> TwinKey {
        TwinKey {
            pod: format!("ns/{pod}"),
            tcp: tcp.parse().unwrap(),
            quic: "10.0.0.1:15443".into(),
            sni: format!("{pod}.twin.aether"),
        }
    }

    fn live(pod: &str, tcp: &str, since_ms: u64) -> Live {
        Live {
            twin: key(pod, tcp),
            served_since_ms: since_ms,
        }
    }

    fn pair(pod: &str, tcp: &str, since: u64) -> Pair {
        let k = key(pod, tcp);
        Pair {
            pod: k.pod,
            tcp: k.tcp,
            quic: k.quic,
            sni: k.sni,
            since,
        }
    }

    fn window(serving_since_ms: u64) -> Window {
        Window {
            length: W,
            serving_since_ms,
        }
    }

    /// One decision: the advertised pods (in tcp order) with their `since`.
    fn check(live: &[Live], restored: &[Pair], w: Window, now_ms: u64, expected: &[(&str, u64)]) {
        let got: Vec<(String, u64)> = advertise(live, restored, w, now_ms)
            .into_iter()
            .map(|p| (p.pod, p.since))
            .collect();
        let want: Vec<(String, u64)> = expected
            .iter()
            .map(|(p, s)| (format!("ns/{p}"), *s))
            .collect();
        assert_eq!(got, want, "live {live:?} restored {restored:?} at {now_ms}");
    }

    #[test]
    fn a_lone_owner_advertises_a_twin_once_it_has_served_through_the_window() {
        let w = window(100_000);
        let l = [
            live("a", "10.1.0.2:80", 100_000),
            live("b", "10.1.0.3:80", 110_000),
        ];
        check(&l, &[], w, 100_000, &[]);
        check(&l, &[], w, 114_999, &[]);
        check(&l, &[], w, 115_000, &[("a", 100)]);
        check(&l, &[], w, 124_999, &[("a", 100)]);
        check(&l, &[], w, 125_000, &[("a", 100), ("b", 110)]);
    }

    #[test]
    fn restored_pairs_stay_while_the_window_runs_and_keep_their_since() {
        // The new owner started serving at 500 s; both twins live since then.
        let w = window(500_000);
        let l = [
            live("a", "10.1.0.2:80", 500_000),
            live("b", "10.1.0.3:80", 500_000),
        ];
        let restored = [pair("a", "10.1.0.2:80", 42)];
        // Restored a is stated at once, as the old owner had it; b waits for the window.
        check(&l, &restored, w, 500_000, &[("a", 42)]);
        check(&l, &restored, w, 514_999, &[("a", 42)]);
        // After the window both are served through it; a keeps its since: the set the
        // old owner wrote is restated byte for byte.
        check(&l, &restored, w, 515_000, &[("a", 42), ("b", 500)]);
    }

    #[test]
    fn a_restored_pair_whose_twin_is_gone_or_changed_is_withdrawn() {
        let w = window(500_000);
        let restored = [pair("a", "10.1.0.2:80", 42), pair("gone", "10.1.0.9:80", 7)];
        // a's twin now answers elsewhere: another twin, waiting for its window.
        let mut moved = live("a", "10.1.0.2:80", 500_000);
        moved.twin.quic = "10.0.0.1:16443".into();
        check(&[moved.clone()], &restored, w, 501_000, &[]);
        check(&[moved], &restored, w, 515_000, &[("a", 500)]);
    }

    #[test]
    fn the_window_restarts_at_each_takeover() {
        // A twin the first owner served for an hour; the successor serves from 3,600 s.
        let restored = [pair("a", "10.1.0.2:80", 0)];
        let w = window(3_600_000);
        let l = [
            live("a", "10.1.0.2:80", 3_600_000),
            live("new", "10.1.0.5:80", 3_600_000),
        ];
        // The new twin served 3,600 s by the old owner counts for nothing here: it had
        // not been advertised, and this owner has served it 1 s.
        check(&l, &restored, w, 3_601_000, &[("a", 0)]);
        check(&l, &restored, w, 3_615_000, &[("a", 0), ("new", 3_600)]);
    }

    #[test]
    fn a_zero_window_advertises_what_is_served() {
        let w = Window {
            length: Duration::ZERO,
            serving_since_ms: 1_000,
        };
        check(
            &[live("a", "10.1.0.2:80", 1_000)],
            &[],
            w,
            1_000,
            &[("a", 1)],
        );
    }

    #[test]
    fn the_next_change_is_the_earliest_window_end_still_ahead() {
        let w = window(100_000);
        let l = [
            live("a", "10.1.0.2:80", 100_000),
            live("b", "10.1.0.3:80", 103_000),
        ];
        assert_eq!(next_change(&l, w, 100_000), Some(115_000));
        assert_eq!(next_change(&l, w, 115_000), Some(118_000));
        assert_eq!(next_change(&l, w, 118_000), None);
        assert_eq!(next_change(&[], w, 100_000), Some(115_000));
    }

    /// A bad file: a standby leaves it where it is and writes nothing; the owner moves it to
    /// quarantine when it starts serving, and writes no file for an empty set.
    #[test]
    fn a_bad_file_is_left_by_a_standby_and_quarantined_by_the_owner() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        std::fs::write(&path, "{ not pairs").unwrap();
        let node = Node::new(Inputs::default());
        let status = Arc::new(watch::Sender::new(Status::new("n", "p")));
        let pairs = QuicPairs::restore(dir.path(), W, node, Metrics::new(), status.clone());
        assert_eq!(pairs.step(now_ms()), None, "a standby does not step");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"{ not pairs",
            "the standby left it"
        );
        assert!(!dir.path().join(QUARANTINE_DIR).exists());
        assert_eq!(
            status.borrow().quic_pairs.as_ref().unwrap().window,
            "standby"
        );
        pairs.start_serving();
        assert!(!path.exists(), "the owner moved it");
        let moved: Vec<_> = std::fs::read_dir(dir.path().join(QUARANTINE_DIR))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(moved.len(), 1);
        let q = status.borrow().quic_pairs.clone().unwrap();
        assert_eq!((q.window, q.restored, q.advertised), ("running", 0, 0));
        assert!(q.window_started_unix_ms.is_some());
        pairs.flush_final();
        assert!(pairs.released());
        assert!(!path.exists(), "an empty set as restored: nothing to write");
    }

    #[test]
    fn the_file_round_trips_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        assert_eq!(read(&path).unwrap(), vec![], "no file, no pairs");
        let pairs = vec![pair("a", "10.1.0.2:80", 42), pair("b", "[fd00::3]:80", 43)];
        std::fs::write(
            &path,
            serde_json::to_vec(&Doc {
                pairs: pairs.clone(),
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(read(&path).unwrap(), pairs);
        let text = std::fs::read_to_string(&path).unwrap();
        for field in ["\"pod\"", "\"tcp\"", "\"quic\"", "\"sni\"", "\"since\""] {
            assert!(text.contains(field), "{field} in {text}");
        }
        for (bad, names) in [
            ("{ nope", "not a QUIC pairs file"),
            (
                r#"{"pairs":[{"pod":"x","tcp":"10.0.0.1:80","quic":"h:1","since":1}]}"#,
                "pairs[0].pod",
            ),
            (
                r#"{"pairs":[{"pod":"a/b","tcp":"10.0.0.1","quic":"h:1","since":1}]}"#,
                "not a QUIC pairs file",
            ),
            (
                r#"{"pairs":[{"pod":"a/b","tcp":"10.0.0.1:80","quic":"h","since":1}]}"#,
                "pairs[0].quic",
            ),
            (
                r#"{"pairs":[{"pod":"a/b","tcp":"10.0.0.1:80","quic":"h:1","since":1},{"pod":"a/c","tcp":"10.0.0.1:80","quic":"h:1","since":1}]}"#,
                "pairs[1].tcp",
            ),
        ] {
            std::fs::write(&path, bad).unwrap();
            let e = read(&path).unwrap_err();
            assert!(e.is_bad_file(), "{bad}: {e}");
            let e = e.to_string();
            assert!(
                e.contains(&path.display().to_string()) && e.contains(names),
                "{bad}: {e}"
            );
        }
        let big = std::fs::File::create(&path).unwrap();
        big.set_len(MAX_BYTES + 1).unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("more than") && e.contains(FILE), "{e}");
    }
}
