//! The registry view of services and endpoints, and the embedded registry that reads it
//! from a JSON file (`--registry-file`) and reloads it on change.
//!
//! # File schema
//!
//! ```json
//! {
//!   "services": [
//!     {
//!       "name": "web",                 // DNS label: [a-z0-9]([-a-z0-9]*[a-z0-9])?, ≤ 63
//!       "namespace": "default",        // DNS label
//!       "ports": [80, 8080],           // service ports, 1..=65535, no repeats, ≥ 1
//!       "vip": "10.96.0.10",           // optional virtual IP
//!       "endpoints": [
//!         {
//!           "address": "10.0.0.5",     // IP of the endpoint
//!           "port": 8080,              // port on the endpoint, 1..=65535
//!           "service_port": 80,        // which service port it serves; optional when
//!                                      // the service has one port
//!           "node": "node-a",          // optional
//!           "pod": "web-5d8f",         // optional
//!           "state": "healthy"         // optional: "healthy" (default) or "draining"
//!         }
//!       ]
//!     }
//!   ]
//! }
//! ```
//! (JSON has no comments; they are explanation here.) Unknown fields are rejected so a
//! typo is an error, not a silently ignored setting. A service is keyed by namespace and
//! name; the same key twice is an error.
//!
//! # Reload
//!
//! The watcher reacts to inotify events on the file's directory (so atomic renames and
//! Kubernetes ConfigMap symlink swaps are seen) and also polls every
//! [`POLL_INTERVAL`], comparing a content hash, so a missed event only costs latency.
//! A malformed or missing file keeps the last good view and logs an error naming the file
//! and, for JSON, the line and column; `registry_loaded` is set only by a good load, so a
//! standby with a broken registry file stays incomplete, visibly. With no file configured
//! the registry is empty and counts as loaded.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::node::Node;
use crate::snapshot::fnv1a64;

/// How often a watched file is re-read even without an inotify event.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// Services of the mesh, sorted by namespace then name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryView {
    pub services: Vec<Service>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub ports: Vec<u16>,
    pub vip: Option<IpAddr>,
    pub endpoints: Vec<Endpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub address: IpAddr,
    pub port: u16,
    /// The service port this endpoint serves (resolved from the file).
    pub service_port: u16,
    pub node: String,
    pub pod: String,
    pub state: EndpointState,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointState {
    #[default]
    Healthy,
    Draining,
}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}:{column}: {message}")]
    Json { path: PathBuf, line: usize, column: usize, message: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

impl FileError {
    pub(crate) fn json(path: &Path, e: &serde_json::Error) -> Self {
        Self::Json { path: path.to_owned(), line: e.line(), column: e.column(), message: e.to_string() }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    #[serde(default)]
    services: Vec<FileService>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileService {
    name: String,
    namespace: String,
    ports: Vec<u16>,
    #[serde(default)]
    vip: Option<IpAddr>,
    #[serde(default)]
    endpoints: Vec<FileEndpoint>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEndpoint {
    address: IpAddr,
    port: u16,
    #[serde(default)]
    service_port: Option<u16>,
    #[serde(default)]
    node: String,
    #[serde(default)]
    pod: String,
    #[serde(default)]
    state: EndpointState,
}

/// Parses and validates a registry file's content.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RegistryView, FileError> {
    let doc: FileDoc = serde_json::from_slice(bytes).map_err(|e| FileError::json(path, &e))?;
    let invalid = |message: String| FileError::Invalid { path: path.to_owned(), message };
    let mut keys = BTreeSet::new();
    let mut services = Vec::with_capacity(doc.services.len());
    for (i, s) in doc.services.into_iter().enumerate() {
        let at = format!("services[{i}] ({}.{})", s.name, s.namespace);
        for (what, v) in [("name", &s.name), ("namespace", &s.namespace)] {
            if !is_dns_label(v) {
                return Err(invalid(format!("{at}: {what} {v:?} is not a DNS label")));
            }
        }
        if !keys.insert((s.namespace.clone(), s.name.clone())) {
            return Err(invalid(format!("{at}: service listed twice")));
        }
        if s.ports.is_empty() {
            return Err(invalid(format!("{at}: ports is empty")));
        }
        let mut seen = BTreeSet::new();
        for p in &s.ports {
            if *p == 0 || !seen.insert(*p) {
                return Err(invalid(format!("{at}: port {p} is 0 or listed twice")));
            }
        }
        let mut endpoints = Vec::with_capacity(s.endpoints.len());
        for (j, e) in s.endpoints.into_iter().enumerate() {
            let eat = format!("{at}.endpoints[{j}]");
            if e.port == 0 {
                return Err(invalid(format!("{eat}: port is 0")));
            }
            let service_port = match (e.service_port, s.ports.as_slice()) {
                (Some(p), ports) if ports.contains(&p) => p,
                (Some(p), _) => return Err(invalid(format!("{eat}: service_port {p} is not a port of the service"))),
                (None, [only]) => *only,
                (None, _) => return Err(invalid(format!("{eat}: service_port is required for a service with several ports"))),
            };
            endpoints.push(Endpoint {
                address: e.address,
                port: e.port,
                service_port,
                node: e.node,
                pod: e.pod,
                state: e.state,
            });
        }
        services.push(Service { name: s.name, namespace: s.namespace, ports: s.ports, vip: s.vip, endpoints });
    }
    services.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(RegistryView { services })
}

fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Runs the embedded registry: loads `path` into the node's inputs, marks the registry
/// gate, and reloads on change until the task is aborted. `None`: an empty registry,
/// loaded at once.
pub fn spawn_embedded(path: Option<PathBuf>, node: Arc<Node>, metrics: Arc<Metrics>) -> JoinHandle<()> {
    let watch = path.map(Watch::open);
    tokio::spawn(async move {
        let Some(watch) = watch else {
            node.update(|i| i.registry = RegistryView::default());
            node.set_gate(|g| g.registry_loaded = true);
            return;
        };
        let path = watch.path().to_path_buf();
        watch_file(watch, "registry", &metrics, |bytes| {
            let view = parse(&path, bytes)?;
            node.update(|i| i.registry = view);
            node.set_gate(|g| g.registry_loaded = true);
            Ok(())
        })
        .await
    })
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

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// Calls `apply` with the file's content at start and after every change of it, until
/// the task is aborted. Errors (unreadable file, `apply` rejecting the content) are logged
/// with the file's name and counted; the caller keeps its last good state.
pub(crate) async fn watch_file(
    watch: Watch,
    what: &'static str,
    metrics: &Metrics,
    mut apply: impl FnMut(&[u8]) -> Result<(), FileError>,
) {
    let Watch { path, mut events } = watch;
    let path = path.as_path();
    if events.is_none() {
        tracing::warn!(file = %path.display(), "{what}: no inotify on the file's directory; polling every {POLL_INTERVAL:?}");
    }
    // The hash of the content last applied, or last rejected, so neither is redone.
    let mut last_good: Option<u64> = None;
    let mut last_bad: Option<u64> = None;
    let mut unreadable = false;
    loop {
        match std::fs::read(path) {
            Ok(bytes) => {
                unreadable = false;
                let h = fnv1a64(&bytes);
                if last_good != Some(h) && last_bad != Some(h) {
                    match apply(&bytes) {
                        Ok(()) => {
                            tracing::info!(file = %path.display(), hash = format!("{h:016x}"), "{what} file loaded");
                            last_good = Some(h);
                            last_bad = None;
                        }
                        Err(e) => {
                            metrics.registry_reload_errors.inc();
                            tracing::error!(file = %path.display(), error = %e, "{what} file rejected; keeping the last good {what}");
                            last_bad = Some(h);
                        }
                    }
                }
            }
            // Reported once per failure streak, not on every poll.
            Err(e) if !unreadable => {
                unreadable = true;
                metrics.registry_reload_errors.inc();
                let e = FileError::Read { path: path.to_owned(), source: e };
                tracing::error!(file = %path.display(), error = %e, "{what} file unreadable; keeping the last good {what}");
            }
            Err(_) => {}
        }
        match events.as_mut() {
            Some(ev) => ev.next(POLL_INTERVAL).await,
            None => tokio::time::sleep(POLL_INTERVAL).await,
        }
    }
}

/// inotify on a file's directory, reporting events that may change the file: on its
/// name, or on a `..`-prefixed name (a Kubernetes ConfigMap swaps its `..data` symlink).
/// Other names (a writer's temp file) do not wake the reload.
struct DirEvents {
    fd: tokio::io::unix::AsyncFd<InotifyFd>,
    name: std::ffi::OsString,
}

struct InotifyFd(nix::sys::inotify::Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl DirEvents {
    fn new(file: &Path) -> Option<Self> {
        use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify};
        let name = file.file_name()?.to_owned();
        let dir = match file.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok()?;
        // Not IN_MODIFY: a writer mid-write would make us read half a file.
        let flags = F::IN_CLOSE_WRITE | F::IN_MOVED_TO | F::IN_MOVED_FROM | F::IN_CREATE | F::IN_DELETE | F::IN_ATTRIB;
        ino.add_watch(dir, flags).ok()?;
        // `AsyncFd::new` is deprecated for `unsafe fn register`, whose safety condition
        // (the fd stays open and the same while registered) holds here: the `Inotify` owns
        // it and lives inside the `AsyncFd`. This crate forbids unsafe, so keep `new`.
        #[allow(deprecated)]
        let fd = tokio::io::unix::AsyncFd::new(InotifyFd(ino)).ok()?;
        Some(Self { fd, name })
    }

    /// Returns after the next relevant event, or after `max`.
    async fn next(&mut self, max: Duration) {
        use nix::sys::inotify::AddWatchFlags as F;
        let relevant = |e: &nix::sys::inotify::InotifyEvent| {
            e.mask.contains(F::IN_Q_OVERFLOW)
                || e.name.as_ref().is_none_or(|n| *n == self.name || n.as_encoded_bytes().starts_with(b".."))
        };
        let wait = async {
            loop {
                let Ok(mut guard) = self.fd.readable().await else { return };
                let mut hit = false;
                loop {
                    match guard.get_inner().0.read_events() {
                        Ok(ev) if !ev.is_empty() => hit |= ev.iter().any(relevant),
                        Ok(_) | Err(nix::errno::Errno::EAGAIN) => break,
                        Err(_) => return,
                    }
                }
                guard.clear_ready();
                if hit {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(max, wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, expected: Result<&str, &str>) {
        let got = parse(Path::new("/etc/aether/registry.json"), json.as_bytes());
        match (got, expected) {
            (Ok(view), Ok(want)) => {
                let s: Vec<String> = view
                    .services
                    .iter()
                    .map(|s| {
                        let eps: Vec<String> = s
                            .endpoints
                            .iter()
                            .map(|e| format!("{}:{}@{}:{:?}", e.address, e.port, e.service_port, e.state))
                            .collect();
                        format!("{}.{} {:?} {:?} [{}]", s.name, s.namespace, s.ports, s.vip, eps.join(" "))
                    })
                    .collect();
                assert_eq!(s.join("\n"), want);
            }
            (Err(e), Err(want)) => assert!(e.to_string().contains(want), "error {e:?} lacks {want:?}"),
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn parses_and_sorts_services() {
        check(
            r#"{"services":[
                {"name":"web","namespace":"prod","ports":[80],"endpoints":[{"address":"10.0.0.1","port":8080}]},
                {"name":"api","namespace":"prod","ports":[80,81],"vip":"10.96.0.1","endpoints":[
                  {"address":"10.0.0.2","port":9000,"service_port":81,"state":"draining","node":"n","pod":"p"}]}
            ]}"#,
            Ok("api.prod [80, 81] Some(10.96.0.1) [10.0.0.2:9000@81:Draining]\nweb.prod [80] None [10.0.0.1:8080@80:Healthy]"),
        );
        check("{}", Ok(""));
    }

    #[test]
    fn rejects_bad_input_with_location() {
        check("{\"services\": [\n  {\"name\": }", Err("/etc/aether/registry.json:2:12"));
        check(r#"{"services":[{"name":"web","namespace":"d","ports":[80],"prots":1}]}"#, Err("unknown field `prots`"));
        check(r#"{"services":[{"name":"Web","namespace":"d","ports":[80]}]}"#, Err("name \"Web\" is not a DNS label"));
        check(r#"{"services":[{"name":"w","namespace":"d","ports":[80]},{"name":"w","namespace":"d","ports":[81]}]}"#, Err("listed twice"));
        check(r#"{"services":[{"name":"w","namespace":"d","ports":[80,80]}]}"#, Err("port 80 is 0 or listed twice"));
        check(r#"{"services":[{"name":"w","namespace":"d","ports":[]}]}"#, Err("ports is empty"));
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80,81],"endpoints":[{"address":"10.0.0.1","port":1}]}]}"#,
            Err("services[0] (w.d).endpoints[0]: service_port is required"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":1,"service_port":90}]}]}"#,
            Err("service_port 90 is not a port"),
        );
        check(
            r#"{"services":[{"name":"w","namespace":"d","ports":[80],"endpoints":[{"address":"10.0.0.1","port":1,"state":"gone"}]}]}"#,
            Err("unknown variant `gone`"),
        );
    }

    #[tokio::test]
    async fn reloads_on_change_and_keeps_last_good_on_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("registry.json");
        let good = r#"{"services":[{"name":"web","namespace":"d","ports":[80]}]}"#;
        std::fs::write(&path, good).unwrap();
        let node = Node::new(Default::default());
        let metrics = Metrics::new();
        let task = spawn_embedded(Some(path.clone()), node.clone(), metrics.clone());
        let mut gates = node.gates();
        tokio::time::timeout(Duration::from_secs(5), gates.wait_for(|g| g.registry_loaded)).await.unwrap().unwrap();
        assert_eq!(node.inputs().registry.services.len(), 1);

        std::fs::write(&path, "{ nope").unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while metrics.registry_reload_errors.get() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "malformed file not noticed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(node.inputs().registry.services.len(), 1, "last good view kept");

        let two = r#"{"services":[{"name":"web","namespace":"d","ports":[80]},{"name":"api","namespace":"d","ports":[80]}]}"#;
        let tmp = dir.path().join("registry.json.tmp");
        std::fs::write(&tmp, two).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let mut snaps = node.subscribe();
        tokio::time::timeout(Duration::from_secs(5), snaps.wait_for(|s| s.clusters.items.len() == 2))
            .await
            .expect("renamed file reloaded")
            .unwrap();
        task.abort();
    }

    #[tokio::test]
    async fn no_file_is_an_empty_loaded_registry_and_a_missing_file_is_not_loaded() {
        let node = Node::new(Default::default());
        spawn_embedded(None, node.clone(), Metrics::new()).await.unwrap();
        assert!(node.gates().borrow().registry_loaded);

        let dir = tempfile::tempdir().unwrap();
        let node = Node::new(Default::default());
        let metrics = Metrics::new();
        let task = spawn_embedded(Some(dir.path().join("absent.json")), node.clone(), metrics.clone());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!node.gates().borrow().registry_loaded);
        assert_eq!(metrics.registry_reload_errors.get(), 1);
        std::fs::write(dir.path().join("absent.json"), "{}").unwrap();
        let mut gates = node.gates();
        tokio::time::timeout(Duration::from_secs(5), gates.wait_for(|g| g.registry_loaded)).await.unwrap().unwrap();
        task.abort();
    }
}
