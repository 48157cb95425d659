//! Health over HTTP/1.0 on `<health-dir>/agent-health.sock`, for `agent-ready`.
//!
//! Each generation has its own health dir (each pod its own /tmp), so kubelet's probe is
//! never answered by the other generation: a worker refuses, with a clear error, to
//! replace a health socket that still answers.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::httpmini::{self, Response};
use crate::takeover::Phase;

pub const SOCKET_NAME: &str = "agent-health.sock";

/// What `/ready` and `/live` report.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub role: &'static str,
    pub phase: &'static str,
    pub generation: u64,
    pub ready: bool,
    pub node: String,
    pub pod: String,
    pub pid: u32,
    /// The gates not yet passed (`storage`, `registry`, `capture`, `agent-svid`); empty
    /// when complete.
    pub waiting_for: Vec<&'static str>,
    /// Degraded conditions this worker knows; they never turn a serving owner's
    /// readiness off.
    pub problems: Vec<Problem>,
    /// The registrar view this worker holds, when it watches a registrar.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registrar: Option<RegistrarStatus>,
    /// Whether `aether-cni` is chained in the node's first conflist, when the worker was
    /// given `--cni-conf-dir` (see `conflist`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cni: Option<CniStatus>,
    /// Where workload identity stands, when it is on (`--spiffe-endpoint`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<IdentityStatus>,
    /// Takeover timings in microseconds, once this worker took the node over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub takeover: Option<TakeoverTimes>,
    /// The lenient client-certificate gate, when pods get SVIDs and the gate is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_certificate_gate: Option<PodCertificateGate>,
    /// The node's QUIC pairs and their fetch window, when the node has twins
    /// (`--quic-twin-addr`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quic_pairs: Option<QuicPairsStatus>,
    /// The versions of the latest snapshot, one content hash per resource type, as the
    /// xDS server answers with them (`system_version_info`); absent before the first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xds_versions: Option<XdsVersions>,
}

/// Where the QUIC pairs stand (`crate::writers::quic_pairs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct QuicPairsStatus {
    /// `--quic-pair-window`.
    pub window_ms: u64,
    /// `standby` (no window: this agent serves nothing), `running` or `passed`.
    pub window: &'static str,
    /// When this agent started serving, which starts the window (Unix ms); absent in a
    /// standby.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_started_unix_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_ends_unix_ms: Option<u64>,
    /// Pairs restored from the file (at start; again when serving started).
    pub restored: usize,
    /// Twins this owner serves.
    pub live: usize,
    /// Pairs advertised (and in the file).
    pub advertised: usize,
    /// The registry's answer to the last SetQuicPairs this agent made, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub registry_revision: Option<i64>,
    /// SetQuicPairs calls that failed since this agent started.
    pub registry_failures: u64,
}

/// The latest snapshot's version of each resource type.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct XdsVersions {
    pub clusters: String,
    pub endpoints: String,
    pub listeners: String,
    pub routes: String,
    pub secrets: String,
}

impl XdsVersions {
    pub fn of(s: &aether_model::Snapshot) -> Self {
        use aether_model::Kind;
        Self {
            clusters: s.version(Kind::Cluster).into(),
            endpoints: s.version(Kind::Endpoint).into(),
            listeners: s.version(Kind::Listener).into(),
            routes: s.version(Kind::Route).into(),
            secrets: s.version(Kind::Secret).into(),
        }
    }
}

/// Where the client-certificate gate stands (`--pod-certificate-gate`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PodCertificateGate {
    /// `waiting`, `passed` (every stored pod held its SVID) or `timed-out`.
    pub state: &'static str,
    pub bound_ms: u64,
    /// From the moment storage was loaded to the gate's outcome.
    pub waited_ms: u64,
    /// From the same moment to the first readiness (a complete standby, or an owner
    /// serving); absent until then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_after_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TakeoverTimes {
    pub lock_wait_us: u64,
    pub bind_us: u64,
    pub fd_passing_us: u64,
    pub reconcile_us: u64,
    /// The wait for the SVIDs of the pods the reconcile added (at most 1 s; 0 without it).
    pub svid_wait_us: u64,
    /// Pods the reconcile added that still had no SVID when the wait ended.
    pub svid_wait_missed: usize,
    pub first_serve_us: u64,
    /// Lock acquired to serving on the passed descriptors.
    pub total_us: u64,
    pub handed_off: bool,
    pub respawn: bool,
}

impl Status {
    pub fn new(node: &str, pod: &str) -> Self {
        Self {
            role: "standby",
            phase: Phase::Building.as_str(),
            generation: 0,
            ready: false,
            node: node.into(),
            pod: pod.into(),
            pid: std::process::id(),
            waiting_for: Vec::new(),
            problems: Vec::new(),
            registrar: None,
            cni: None,
            identity: None,
            pod_certificate_gate: None,
            quic_pairs: None,
            takeover: None,
            xds_versions: None,
        }
    }
}

/// Where the registrar view stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RegistrarStatus {
    /// The registrar revision the view is at (0: not loaded).
    pub revision: i64,
    pub services: usize,
    /// Full views received since start (the first one included).
    pub full_views: u64,
}

/// Whether the node's first conflist chains `aether-cni` (`crate::conflist` looks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CniStatus {
    pub conf_dir: String,
    /// The runtime's configuration file; None while the folder holds none.
    pub file: Option<String>,
    pub chained: bool,
}

/// Where workload identity stands (see `crate::identity`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IdentityStatus {
    pub trust_domain: String,
    /// `permissive` or `strict`.
    pub mtls: &'static str,
    /// The Workload API stream of the agent's own SVID: `connecting`, `connected` or
    /// `reconnecting`.
    pub workload_api: &'static str,
    /// The agent's SVID, once one came.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<SvidStatus>,
    /// Whether the trust bundle came.
    pub bundle: bool,
    /// Whether pods' SVIDs are fetched (`--spiffe-broker-endpoint`).
    pub broker: bool,
    /// Open SVID streams at the broker, one per local pod.
    pub subscriptions: usize,
    pub pods_with_svid: usize,
    /// The local pods without their own SVID, the longest waiting first, at most
    /// [`crate::identity::checks::READY_LISTED`]; `pods_without_svid_count` counts them all.
    /// Such a pod presents no identity: permissive, its calls go plaintext; strict, it
    /// has no inbound listener and its calls fail.
    pub pods_without_svid: Vec<PodWait>,
    pub pods_without_svid_count: usize,
    /// With API access: the local pods whose SVID waits until the API server lists them on
    /// this node, the longest waiting first, at most 50, with why; a count of them all.
    pub pods_deferred: Vec<PodHeld>,
    pub pods_deferred_count: usize,
    /// With API access: the local pods the API server lists with another name or other
    /// IPs than their ADD; they hold no SVID. At most 50, with why; a count of them all.
    pub pods_refused: Vec<PodHeld>,
    pub pods_refused_count: usize,
    /// SVIDs past 80 % of their lifetime with no renewal, the agent's included.
    pub svids_expiring: usize,
}

/// A pod whose SVID the API server cross-check holds back, as `/ready` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodHeld {
    /// `namespace/name`.
    pub pod: String,
    /// Unix seconds: since when.
    pub since: u64,
    pub why: String,
}

/// A pod waiting for its SVID, as `/ready` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PodWait {
    /// `namespace/name`.
    pub pod: String,
    /// Unix seconds: since when this agent has seen the pod without its SVID (its start,
    /// for a pod it found in storage).
    pub since: u64,
}

/// One SVID as `/ready` shows it: never the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SvidStatus {
    pub spiffe_id: String,
    /// The leaf's serial number, as Envoy's admin `/certs` prints it.
    pub serial: String,
    /// Unix seconds.
    pub not_after: u64,
}

/// A degraded condition, as `/ready` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub source: &'static str,
    pub message: String,
    /// Unix seconds at which the condition (from this source) began.
    pub since: u64,
}

/// The handle sources report through: their problems (one per source) and, for the
/// registrar client, where its view stands.
#[derive(Clone)]
pub struct Reporter(std::sync::Arc<watch::Sender<Status>>);

impl Reporter {
    pub fn registrar(&self, now: RegistrarStatus) {
        self.0.send_if_modified(|s| {
            let changed = s.registrar != Some(now);
            s.registrar = Some(now);
            changed
        });
    }

    /// Where the node's CNI chaining stands.
    pub fn cni(&self, now: CniStatus) {
        self.0.send_if_modified(|s| {
            let changed = s.cni.as_ref() != Some(&now);
            s.cni = Some(now);
            changed
        });
    }

    /// Changes the identity status in place (starting from the default when it has none).
    pub fn identity(&self, change: impl FnOnce(&mut IdentityStatus)) {
        self.0.send_if_modified(|s| {
            let mut next = s.identity.clone().unwrap_or_default();
            change(&mut next);
            let changed = s.identity.as_ref() != Some(&next);
            s.identity = Some(next);
            changed
        });
    }

    pub fn new(status: std::sync::Arc<watch::Sender<Status>>) -> Self {
        Self(status)
    }

    /// Sets `source`'s problem; it keeps its `since` while the source stays in trouble.
    pub fn set(&self, source: &'static str, message: String) {
        self.0.send_if_modified(
            |s| match s.problems.iter_mut().find(|p| p.source == source) {
                Some(p) if p.message == message => false,
                Some(p) => {
                    p.message = message;
                    true
                }
                None => {
                    let since = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs());
                    s.problems.push(Problem {
                        source,
                        message,
                        since,
                    });
                    true
                }
            },
        );
    }

    /// Sets `source`'s problems to `messages`, one problem each (for conditions listed one
    /// per pod); a message that stays keeps its `since`. An empty list clears them.
    pub fn set_each(&self, source: &'static str, messages: Vec<String>) {
        self.0.send_if_modified(|s| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let old: Vec<&Problem> = s.problems.iter().filter(|p| p.source == source).collect();
            let new: Vec<Problem> = messages
                .into_iter()
                .map(|message| {
                    let since = old
                        .iter()
                        .find(|p| p.message == message)
                        .map_or(now, |p| p.since);
                    Problem {
                        source,
                        message,
                        since,
                    }
                })
                .collect();
            if old.len() == new.len() && old.iter().zip(&new).all(|(a, b)| *a == b) {
                return false;
            }
            s.problems.retain(|p| p.source != source);
            s.problems.extend(new);
            true
        });
    }

    pub fn clear(&self, source: &'static str) {
        self.0.send_if_modified(|s| {
            let before = s.problems.len();
            s.problems.retain(|p| p.source != source);
            before != s.problems.len()
        });
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error(
        "{path}: another agent's health server still answers there; each generation needs its own --health-dir"
    )]
    Live { path: PathBuf },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: PathBuf },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Binds the health socket, replacing only a stale socket file.
pub fn bind(dir: &Path) -> Result<UnixListener, HealthError> {
    let path = dir.join(SOCKET_NAME);
    let io = |what, source| HealthError::Io {
        what,
        path: path.clone(),
        source,
    };
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(&path).is_ok() {
                return Err(HealthError::Live { path });
            }
            std::fs::remove_file(&path).map_err(|e| io("remove stale socket", e))?;
        }
        Ok(_) => return Err(HealthError::NotASocket { path }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("lstat", e)),
    }
    let l = UnixListener::bind(&path).map_err(|e| io("bind", e))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io("chmod", e))?;
    Ok(l)
}

pub fn respond(status: &Status, path: &str) -> Response {
    let body = (serde_json::to_string(status).unwrap_or_else(|_| "{}".into()) + "\n").into();
    match path {
        "/ready" => Response {
            status: if status.ready { 200 } else { 503 },
            content_type: "application/json",
            body,
        },
        "/live" => Response {
            status: 200,
            content_type: "application/json",
            body,
        },
        _ => Response {
            status: 404,
            content_type: "text/plain",
            body: format!("no such path {path:?}; try /ready or /live\n").into(),
        },
    }
}

/// [`bind`], waiting up to `bound` for a live server there to go away: a respawned
/// worker can start while its crashed predecessor, already dead to the supervisor, is
/// still being torn down by the kernel and holds its listener for a few milliseconds more.
/// A server still answering after `bound` is another agent's: the error says so.
pub async fn bind_after_predecessor(
    dir: &Path,
    bound: Duration,
) -> Result<UnixListener, HealthError> {
    let start = std::time::Instant::now();
    loop {
        match bind(dir) {
            Err(HealthError::Live { .. }) if start.elapsed() < bound => {
                tokio::time::sleep(Duration::from_millis(2)).await
            }
            other => return other,
        }
    }
}

/// The most connections the health socket holds open at once. kubelet's probes come one
/// at a time, each answered at once; a connection that sends nothing is closed after
/// [`httpmini::READ_TIMEOUT`].
pub const MAX_CONNECTIONS: usize = 64;

/// Answers health requests until the process exits.
pub async fn serve(
    listener: UnixListener,
    status: watch::Receiver<Status>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) {
    let mut acceptor = crate::accept::Acceptor::new(listener, "health", MAX_CONNECTIONS, metrics);
    loop {
        let conn = acceptor.next().await;
        let snapshot = status.borrow().clone();
        tokio::spawn(httpmini::serve_one(conn, move |path| {
            respond(&snapshot, path)
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_listed_one_per_pod_keep_their_since_and_leave_other_sources_alone() {
        let status = std::sync::Arc::new(watch::Sender::new(Status::new("n", "p")));
        let r = Reporter::new(status.clone());
        let mut rx = status.subscribe();
        r.set("registrar", "away".into());
        r.set_each("pod-svid", vec!["a".into(), "b".into()]);
        rx.borrow_and_update();
        // A problem's since stays while it lasts: pretend "a" began long ago.
        status.send_modify(|s| {
            s.problems
                .iter_mut()
                .filter(|p| p.message == "a")
                .for_each(|p| p.since = 7)
        });
        rx.borrow_and_update();
        r.set_each("pod-svid", vec!["a".into(), "b".into()]);
        assert!(
            !rx.has_changed().unwrap(),
            "the same list again is no change"
        );
        r.set_each("pod-svid", vec!["a".into(), "c".into()]);
        assert!(rx.has_changed().unwrap());
        let got: Vec<(&str, String, bool)> = status
            .borrow()
            .problems
            .iter()
            .map(|p| (p.source, p.message.clone(), p.since == 7))
            .collect();
        assert_eq!(
            got,
            [
                ("registrar", "away".into(), false),
                ("pod-svid", "a".into(), true),
                ("pod-svid", "c".into(), false)
            ]
        );
        r.set_each("pod-svid", vec![]);
        assert_eq!(status.borrow().problems.len(), 1);
        r.identity(|s| s.subscriptions = 3);
        assert_eq!(
            status.borrow().identity.as_ref().map(|i| i.subscriptions),
            Some(3)
        );
    }

    #[tokio::test]
    async fn a_health_server_that_keeps_answering_is_refused_after_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let _other = std::os::unix::net::UnixListener::bind(dir.path().join(SOCKET_NAME)).unwrap();
        let start = std::time::Instant::now();
        let err = bind_after_predecessor(dir.path(), Duration::from_millis(50))
            .await
            .expect_err("another agent answers");
        assert!(matches!(err, HealthError::Live { .. }), "{err}");
        assert!(
            start.elapsed() >= Duration::from_millis(50),
            "gave up after {:?}",
            start.elapsed()
        );
    }

    #[tokio::test]
    async fn a_predecessor_going_away_within_the_bound_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SOCKET_NAME);
        let predecessor = std::os::unix::net::UnixListener::bind(&path).unwrap();
        // The predecessor's teardown, as the kernel finishes a dying worker.
        let gone = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            drop(predecessor);
        });
        let listener = bind_after_predecessor(dir.path(), Duration::from_secs(5))
            .await
            .expect("bound once the predecessor is gone");
        gone.join().unwrap();
        // The path now leads to the new listener.
        let _client = tokio::net::UnixStream::connect(&path)
            .await
            .expect("connect");
        tokio::time::timeout(Duration::from_secs(5), listener.accept())
            .await
            .expect("accepted in time")
            .expect("accept");
    }
}
