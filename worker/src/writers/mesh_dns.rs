//! The mesh-DNS snapshot and its heartbeat: the mesh's service names and VIPs from the
//! registry view, for a node-local resolver that reads files and never talks to the agent.
//!
//! `<state-dir>/mesh-dns.json`, one JSON object on one line:
//!
//! ```json
//! {"version":1,"services":{"api.prod.svc":"10.96.0.1","web.default.svc":"fd00::a"}}
//! ```
//!
//! - `version` is the schema, [`SCHEMA_VERSION`]; it changes only when a reader of the
//!   old schema would misread the new one. Readers ignore fields they do not know.
//! - `services` maps `<name>.<namespace>.svc` to the service's VIP (an IPv4 or IPv6
//!   address as text), keys in byte order. A service without a VIP is left out; the
//!   cluster's DNS suffix (`cluster.local`) is the resolver's to add.
//!
//! `<state-dir>/mesh-dns.heartbeat` is the owner's wall clock at the write, in
//! milliseconds since the Unix epoch, in decimal and a newline (`1767225600000\n`),
//! replaced by a rename like the snapshot but not fsynced. It is written when the owner
//! starts serving, every [`HEARTBEAT`], and at its drain, each time after the snapshot
//! was brought up to date, and not while the snapshot cannot be written: a heartbeat at
//! `T` says the snapshot held the owner's view as of `T`, and a reader that finds it older
//! than [`HEARTBEAT`] plus a second knows no agent keeps the snapshot current.
//!
//! The owner writes the snapshot only when its content changed: the writer follows the
//! node's snapshots, checks at most once per [`COALESCE`] while changes stream, and keeps
//! what the file holds to compare against (read back when it starts serving, since the
//! previous owner may have written since this process started). Every agent restores the
//! file at start; a missing or bad file is logged and ignored (the owner writes a good one).

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_model::RegistryView;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{error, info, warn};

use crate::metrics::{FileLabel, Metrics};
use crate::node::Node;

/// The snapshot's name in the state folder.
pub const FILE: &str = "mesh-dns.json";
/// The heartbeat's name in the state folder.
pub const HEARTBEAT_FILE: &str = "mesh-dns.heartbeat";
/// The schema [`Doc`] writes and reads.
pub const SCHEMA_VERSION: u32 = 1;
/// How often the owner writes the heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(5);
/// The least time between two checks (and so writes) of the snapshot while changes stream.
pub const COALESCE: Duration = Duration::from_millis(100);
/// Far above a mesh this agent serves (10,000 services are ~0.4 MB); a larger file is not
/// one of ours and is not read.
const MAX_BYTES: u64 = 64 << 20;

/// The snapshot as written: see the module header for the schema.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Doc {
    pub version: u32,
    pub services: BTreeMap<String, IpAddr>,
}

impl Doc {
    /// The names and VIPs of `registry`'s services that have a VIP.
    pub fn of(registry: &RegistryView) -> Doc {
        let services = registry
            .services
            .values()
            .filter_map(|s| Some((dns_name(&s.name, &s.namespace), s.vip?)))
            .collect();
        Doc {
            version: SCHEMA_VERSION,
            services,
        }
    }

    /// The file's bytes: compact JSON and a newline.
    pub fn encode(&self) -> Vec<u8> {
        // A map of strings to addresses always serializes.
        let mut out = serde_json::to_vec(self).unwrap_or_default();
        out.push(b'\n');
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Doc, DecodeError> {
        #[derive(serde::Deserialize)]
        struct Version {
            version: u32,
        }
        // The version first, so that a future schema is reported as such, not as bad JSON.
        let v: Version =
            serde_json::from_slice(bytes).map_err(|e| DecodeError::Json(e.to_string()))?;
        if v.version != SCHEMA_VERSION {
            return Err(DecodeError::Version(v.version));
        }
        serde_json::from_slice(bytes).map_err(|e| DecodeError::Json(e.to_string()))
    }
}

/// The name a service is known by in the snapshot: `<name>.<namespace>.svc`.
pub fn dns_name(name: &str, namespace: &str) -> String {
    format!("{name}.{namespace}.svc")
}

/// Why a snapshot file was not taken.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not a mesh-DNS snapshot: {0}")]
    Json(String),
    #[error("schema version {0}, this agent reads version {SCHEMA_VERSION}")]
    Version(u32),
}

/// What reading the snapshot file found.
#[derive(Debug)]
enum Read {
    Missing,
    Found(Doc),
    Bad(String),
}

fn read(path: &Path) -> Read {
    let bytes = match std::fs::metadata(path) {
        Ok(m) if m.len() > MAX_BYTES => {
            return Read::Bad(format!("{} bytes, more than {MAX_BYTES}", m.len()));
        }
        Ok(_) => std::fs::read(path),
        Err(e) => Err(e),
    };
    match bytes {
        Ok(b) => Doc::decode(&b).map_or_else(|e| Read::Bad(e.to_string()), Read::Found),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Read::Missing,
        Err(e) => Read::Bad(format!("unreadable: {e}")),
    }
}

/// An order-free fingerprint of the services' names and VIPs, cheap enough to take under
/// the builder's lock for every check: no allocation, ~10,000 short hashes at mesh scale.
/// Equal views give equal fingerprints; the keys are random per process, so a collision
/// that hides a change cannot be arranged by whoever names services.
fn fingerprint(keys: &std::hash::RandomState, registry: &RegistryView) -> u64 {
    let mut sum = 0u64;
    for s in registry.services.values() {
        let Some(vip) = s.vip else { continue };
        let mut h = keys.build_hasher();
        h.write(s.name.as_bytes());
        h.write_u8(0);
        h.write(s.namespace.as_bytes());
        h.write_u8(0);
        match vip {
            IpAddr::V4(a) => h.write(&a.octets()),
            IpAddr::V6(a) => h.write(&a.octets()),
        }
        sum = sum.wrapping_add(h.finish());
    }
    sum
}

/// What a check of the snapshot did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Unchanged,
    Written,
    /// The write failed (logged and counted); the next check tries again.
    Failed,
}

/// What the owner's writes have left on disk, as far as this process knows.
struct Written {
    /// What the snapshot file holds; None when it is missing or bad, or a write failed,
    /// so that the next check writes.
    doc: Option<Doc>,
    /// The fingerprint of the view `doc` was last compared with: a check whose view has
    /// the same one skips building the document.
    fingerprint: Option<u64>,
    /// The node's registry generation when `fingerprint` was taken: a check at the same
    /// generation skips the fingerprint, a walk of every service (at 10,000 services,
    /// under the builder's lock, after every pod's ADD and on the drain's path).
    generation: Option<u64>,
    /// Set by the drain's [`MeshDns::flush`]: nothing is written after it.
    stopped: bool,
}

/// The node's mesh-DNS files: restored by every agent, written by the owner alone.
pub struct MeshDns {
    dir: PathBuf,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    keys: std::hash::RandomState,
    /// Serializes writes: the writer task and the drain's flush share the temp names.
    written: Mutex<Written>,
    /// Tells the writer task to end once the drain has flushed.
    stop: watch::Sender<bool>,
}

impl MeshDns {
    /// Reads `<state_dir>/mesh-dns.json`; a missing or bad file is logged and ignored.
    /// Writes nothing: a standby calls it too.
    pub fn restore(state_dir: &Path, node: Arc<Node>, metrics: Arc<Metrics>) -> Arc<Self> {
        let mesh = Arc::new(Self {
            dir: state_dir.to_path_buf(),
            node,
            metrics,
            keys: std::hash::RandomState::new(),
            written: Mutex::new(Written {
                doc: None,
                fingerprint: None,
                generation: None,
                stopped: false,
            }),
            stop: watch::Sender::new(false),
        });
        mesh.reload("restored");
        mesh
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(FILE)
    }

    pub fn heartbeat_path(&self) -> PathBuf {
        self.dir.join(HEARTBEAT_FILE)
    }

    /// What the snapshot file holds, as far as this process knows.
    pub fn on_disk(&self) -> Option<Doc> {
        lock(&self.written).doc.clone()
    }

    /// Takes what the file holds now as the content to compare with.
    fn reload(&self, what: &str) {
        let path = self.path();
        let doc = match read(&path) {
            Read::Found(doc) => {
                info!(file = %path.display(), services = doc.services.len(), "mesh-DNS snapshot {what}");
                Some(doc)
            }
            Read::Missing => {
                info!(file = %path.display(), "no mesh-DNS snapshot yet; the owner writes one");
                None
            }
            Read::Bad(e) => {
                warn!(file = %path.display(), error = %e, "mesh-DNS snapshot ignored; the owner writes a good one");
                None
            }
        };
        let mut w = lock(&self.written);
        w.doc = doc;
        w.fingerprint = None;
        w.generation = None;
    }

    /// Writes the snapshot if the node's view changed since the last write: true when it
    /// wrote. Nothing after the drain's flush.
    pub fn check(&self) -> bool {
        let mut w = lock(&self.written);
        !w.stopped && self.write_if_changed(&mut w) == Outcome::Written
    }

    /// Brings the snapshot up to date, then writes the heartbeat; no heartbeat while the
    /// snapshot cannot be written, so that its age shows the snapshot is behind. Nothing
    /// after the drain's flush.
    pub fn beat(&self) {
        let mut w = lock(&self.written);
        if !w.stopped && self.write_if_changed(&mut w) != Outcome::Failed {
            self.write_heartbeat();
        }
    }

    /// The drained owner's last write, before it releases the node: the snapshot if it
    /// changed, and the heartbeat. The writer task ends and nothing is written after it.
    pub fn flush(&self) {
        let mut w = lock(&self.written);
        if w.stopped {
            return;
        }
        w.stopped = true;
        let start = std::time::Instant::now();
        let outcome = self.write_if_changed(&mut w);
        let beat = outcome != Outcome::Failed && self.write_heartbeat();
        self.stop.send_replace(true);
        let took_us = start.elapsed().as_micros() as u64;
        info!(snapshot = ?outcome, heartbeat = beat, took_us, services = w.doc.as_ref().map_or(0, |d| d.services.len()), "mesh-DNS snapshot flushed before release");
    }

    fn write_if_changed(&self, w: &mut Written) -> Outcome {
        // Read before the fingerprint: a registry that moves meanwhile gets a later
        // number, and the next check takes it again.
        let generation = self.node.registry_generation();
        if w.fingerprint.is_some() && w.generation == Some(generation) {
            return Outcome::Unchanged;
        }
        let known = w.fingerprint;
        let built = self.node.with_inputs(|i| {
            let fp = fingerprint(&self.keys, &i.registry);
            (known != Some(fp)).then(|| (fp, Doc::of(&i.registry)))
        });
        let Some((fp, doc)) = built else {
            w.generation = Some(generation);
            return Outcome::Unchanged;
        };
        if w.doc.as_ref() == Some(&doc) {
            (w.fingerprint, w.generation) = (Some(fp), Some(generation));
            return Outcome::Unchanged;
        }
        if !self.write(FILE, &doc.encode(), Durability::Synced) {
            // Unknown content now: the next check writes again.
            (w.doc, w.fingerprint, w.generation) = (None, None, None);
            return Outcome::Failed;
        }
        w.doc = Some(doc);
        (w.fingerprint, w.generation) = (Some(fp), Some(generation));
        Outcome::Written
    }

    fn write_heartbeat(&self) -> bool {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        self.write(
            HEARTBEAT_FILE,
            format!("{ms}\n").as_bytes(),
            Durability::ReplaceOnly,
        )
    }

    /// One atomic write of `name` in the state folder, counted; a failure is logged with
    /// the path and counted.
    fn write(&self, name: &str, bytes: &[u8], durability: Durability) -> bool {
        let label = FileLabel {
            file: name.to_string(),
        };
        match write_atomically(&self.dir, name, bytes, durability) {
            Ok(()) => {
                self.metrics.state_writes.get_or_create(&label).inc();
                true
            }
            Err(e) => {
                self.metrics.state_write_errors.get_or_create(&label).inc();
                error!(file = %self.dir.join(name).display(), error = %e, "mesh-DNS: write failed; retried at the next change or heartbeat");
                false
            }
        }
    }
}

/// Whether a write must survive a crash of the machine.
#[derive(Debug, Clone, Copy)]
enum Durability {
    /// fsync of the file before the rename and of the folder after: the snapshot.
    Synced,
    /// The rename alone: readers still see the old content or the new, never a mix, but
    /// a machine crash may lose the write. For the heartbeat, whose value means nothing
    /// after a crash, and whose drain write would otherwise add two fsyncs (~3 ms here)
    /// to the time the successor waits for the lock.
    ReplaceOnly,
}

/// A temp file beside `name` (this process's own name for it), written whole and renamed
/// over `name`; with [`Durability::Synced`], fsyncs of the file and the folder.
fn write_atomically(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    durability: Durability,
) -> Result<(), crate::storage::StorageError> {
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let path = dir.join(name);
    // Left by a write of this pid that failed halfway; creating the temp file needs it gone.
    let _ = std::fs::remove_file(&tmp);
    if let Durability::Synced = durability {
        return crate::storage::write_atomically(&tmp, &path, bytes, dir);
    }
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |op, path: &Path, source| crate::storage::StorageError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io("creating", &tmp, e))?;
    file.write_all(bytes).map_err(|e| io("writing", &tmp, e))?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(|e| io("renaming into place", &path, e))
}

/// The owner's writer, started when it serves and ended by the drain's
/// [`MeshDns::flush`]: reads back what the file holds, then writes the heartbeat every
/// [`HEARTBEAT`] and the snapshot after a change, checking at most once per [`COALESCE`].
pub async fn run_writer(mesh: Arc<MeshDns>) {
    let mut snapshots = mesh.node.subscribe();
    snapshots.borrow_and_update();
    let mut stop = mesh.stop.subscribe();
    // The previous owner may have written since this process restored the file: its last
    // write landed before the lock passed.
    if blocking(&mesh, |m| m.reload("read back as serving starts"))
        .await
        .is_none()
    {
        return;
    }
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut next_check = Instant::now();
    loop {
        // A drain that came before this task subscribed is no change it would see.
        if *stop.borrow() {
            return;
        }
        tokio::select! {
            // The first tick is at once: the new owner's first heartbeat.
            _ = heartbeat.tick() => {
                if blocking(&mesh, MeshDns::beat).await.is_none() {
                    return;
                }
                next_check = Instant::now() + COALESCE;
            }
            changed = snapshots.changed() => {
                if changed.is_err() {
                    return;
                }
                // A burst of snapshots is one check: the watch keeps only the newest.
                tokio::time::sleep_until(next_check).await;
                snapshots.borrow_and_update();
                if blocking(&mesh, MeshDns::check).await.is_none() {
                    return;
                }
                next_check = Instant::now() + COALESCE;
            }
            // The flush's one change, from false to true.
            _ = stop.changed() => return,
        }
    }
}

/// Runs `f` off the runtime thread: it takes the builder's lock and fsyncs.
async fn blocking<T: Send + 'static>(
    mesh: &Arc<MeshDns>,
    f: impl FnOnce(&MeshDns) -> T + Send + 'static,
) -> Option<T> {
    let m = mesh.clone();
    match tokio::task::spawn_blocking(move || f(&m)).await {
        Ok(v) => Some(v),
        Err(e) => {
            error!(error = %e, "mesh-DNS writer task failed; the snapshot is no longer kept current");
            None
        }
    }
}

/// Plain data; a panic while it was locked leaves it usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_model::{Change, Endpoint, EndpointState, Inputs, Service};

    fn service(name: &str, namespace: &str, vip: Option<&str>, endpoints: u8) -> Service {
        Service {
            name: name.into(),
            namespace: namespace.into(),
            ports: vec![80],
            vip: vip.map(|v| v.parse().unwrap()),
            endpoints: (0..endpoints)
                .map(|e| Endpoint {
                    address: IpAddr::from([10, 1, 0, e]),
                    port: 8080,
                    service_port: 80,
                    node: String::new(),
                    pod: String::new(),
                    state: EndpointState::Healthy,
                    mtls: false,
                })
                .collect(),
        }
    }

    fn node(services: Vec<Service>) -> Arc<Node> {
        Node::new(Inputs {
            registry: RegistryView::new(services),
            ..Inputs::default()
        })
    }

    fn writes(m: &Metrics, file: &str) -> u64 {
        m.state_writes
            .get_or_create(&FileLabel { file: file.into() })
            .get()
    }

    /// The file a registry gives, byte for byte.
    fn check(services: Vec<Service>, expected: &str) {
        let doc = Doc::of(&RegistryView::new(services));
        assert_eq!(
            String::from_utf8(doc.encode()).unwrap(),
            format!("{expected}\n")
        );
        assert_eq!(Doc::decode(&doc.encode()), Ok(doc), "round trip");
    }

    #[test]
    fn the_schema_is_sorted_names_to_vips_without_the_services_that_have_none() {
        check(vec![], r#"{"version":1,"services":{}}"#);
        check(
            vec![
                service("web", "default", Some("10.96.0.10"), 2),
                service("api", "prod", Some("10.96.0.1"), 0),
                service("headless", "default", None, 3),
                service("v6", "default", Some("fd00::a"), 1),
            ],
            r#"{"version":1,"services":{"api.prod.svc":"10.96.0.1","v6.default.svc":"fd00::a","web.default.svc":"10.96.0.10"}}"#,
        );
    }

    #[test]
    fn a_file_of_another_schema_or_no_schema_is_refused() {
        let bad = |text: &str| Doc::decode(text.as_bytes()).unwrap_err();
        assert_eq!(
            bad(r#"{"version":2,"services":{}}"#),
            DecodeError::Version(2)
        );
        assert!(matches!(bad("{ nope"), DecodeError::Json(_)));
        assert!(
            matches!(bad(r#"{"services":{}}"#), DecodeError::Json(_)),
            "no version"
        );
        assert!(matches!(
            bad(r#"{"version":1,"services":{"a.b.svc":"not an ip"}}"#),
            DecodeError::Json(_)
        ));
        let extra = Doc::decode(br#"{"version":1,"services":{"a.b.svc":"10.0.0.1"},"later":true}"#)
            .unwrap();
        assert_eq!(extra.services.len(), 1, "an unknown field is ignored");
    }

    #[test]
    fn restore_takes_a_good_file_and_ignores_a_missing_or_bad_one_writing_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let n = node(vec![service("web", "default", Some("10.96.0.10"), 1)]);
        let restore = || MeshDns::restore(dir.path(), n.clone(), Metrics::new());
        assert_eq!(restore().on_disk(), None, "missing");
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "a restore writes nothing"
        );
        for bad in ["{ nope", r#"{"version":9,"services":{}}"#, ""] {
            std::fs::write(dir.path().join(FILE), bad).unwrap();
            assert_eq!(restore().on_disk(), None, "{bad:?}");
            assert_eq!(
                std::fs::read_to_string(dir.path().join(FILE)).unwrap(),
                bad,
                "a bad file is left as it is"
            );
        }
        let good = Doc::of(&n.with_inputs(|i| i.registry.clone()));
        std::fs::write(dir.path().join(FILE), good.encode()).unwrap();
        assert_eq!(restore().on_disk(), Some(good));
        assert!(!dir.path().join(HEARTBEAT_FILE).exists());
    }

    #[test]
    fn the_snapshot_is_written_only_when_names_or_vips_change() {
        let dir = tempfile::tempdir().unwrap();
        let n = node(vec![
            service("web", "default", Some("10.96.0.10"), 1),
            service("db", "default", None, 1),
        ]);
        let m = Metrics::new();
        let mesh = MeshDns::restore(dir.path(), n.clone(), m.clone());
        let file = || std::fs::read_to_string(dir.path().join(FILE)).unwrap();
        assert!(mesh.check(), "first write");
        assert_eq!(
            file(),
            "{\"version\":1,\"services\":{\"web.default.svc\":\"10.96.0.10\"}}\n"
        );
        assert!(!mesh.check(), "nothing changed");
        // Endpoints, ports and services without a VIP are not in the file.
        n.apply([Change::UpsertService(service(
            "web",
            "default",
            Some("10.96.0.10"),
            5,
        ))]);
        n.apply([Change::UpsertService(service("db", "default", None, 3))]);
        n.apply([Change::UpsertService(service("cache", "default", None, 0))]);
        assert!(!mesh.check(), "no name or VIP changed");
        n.apply([Change::UpsertService(service(
            "db",
            "default",
            Some("10.96.0.20"),
            3,
        ))]);
        assert!(mesh.check(), "a VIP appeared");
        n.apply([Change::UpsertService(service(
            "web",
            "default",
            Some("10.96.0.11"),
            5,
        ))]);
        assert!(mesh.check(), "a VIP changed");
        n.apply([Change::RemoveService(aether_model::ServiceKey {
            namespace: "default".into(),
            name: "db".into(),
        })]);
        assert!(mesh.check(), "a service went");
        assert_eq!(
            file(),
            "{\"version\":1,\"services\":{\"web.default.svc\":\"10.96.0.11\"}}\n"
        );
        assert_eq!(writes(&m, FILE), 4);
        assert_eq!(writes(&m, HEARTBEAT_FILE), 0);

        // A new process that restores this file writes nothing for the same view.
        let again = MeshDns::restore(dir.path(), n.clone(), m.clone());
        assert!(!again.check(), "the restored content is the view's");
        assert_eq!(writes(&m, FILE), 4);
    }

    #[test]
    fn the_drain_flush_writes_the_last_change_and_a_heartbeat_then_nothing_more() {
        let dir = tempfile::tempdir().unwrap();
        let n = node(vec![service("web", "default", Some("10.96.0.10"), 1)]);
        let m = Metrics::new();
        let mesh = MeshDns::restore(dir.path(), n.clone(), m.clone());
        mesh.beat();
        assert_eq!(
            (writes(&m, FILE), writes(&m, HEARTBEAT_FILE)),
            (1, 1),
            "a heartbeat brings the snapshot up to date first"
        );
        n.apply([Change::UpsertService(service(
            "web",
            "default",
            Some("10.96.0.12"),
            1,
        ))]);
        let before = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis();
        mesh.flush();
        assert_eq!((writes(&m, FILE), writes(&m, HEARTBEAT_FILE)), (2, 2));
        let beat: u128 = std::fs::read_to_string(dir.path().join(HEARTBEAT_FILE))
            .unwrap()
            .trim_end()
            .parse()
            .unwrap();
        assert!(beat >= before, "the heartbeat is the wall clock in ms");
        assert_eq!(
            mesh.on_disk().unwrap().services["web.default.svc"].to_string(),
            "10.96.0.12"
        );
        n.apply([Change::UpsertService(service(
            "web",
            "default",
            Some("10.96.0.13"),
            1,
        ))]);
        assert!(!mesh.check());
        mesh.beat();
        mesh.flush();
        assert_eq!(
            (writes(&m, FILE), writes(&m, HEARTBEAT_FILE)),
            (2, 2),
            "nothing after the drain"
        );
        assert!(*mesh.stop.borrow(), "the writer is told to end");
    }

    #[test]
    fn a_failed_write_is_counted_and_retried_and_stops_the_heartbeat() {
        let dir = tempfile::tempdir().unwrap();
        let n = node(vec![service("web", "default", Some("10.96.0.10"), 1)]);
        let m = Metrics::new();
        // A folder in the snapshot's place: the rename over it fails.
        std::fs::create_dir_all(dir.path().join(FILE).join("in-the-way")).unwrap();
        let mesh = MeshDns::restore(dir.path(), n.clone(), m.clone());
        let errors = |file: &str| {
            m.state_write_errors
                .get_or_create(&FileLabel { file: file.into() })
                .get()
        };
        assert!(!mesh.check());
        assert_eq!(errors(FILE), 1);
        mesh.beat();
        assert_eq!(errors(FILE), 2, "retried at the heartbeat");
        assert!(
            !dir.path().join(HEARTBEAT_FILE).exists(),
            "no heartbeat over a snapshot that is behind"
        );
        std::fs::remove_dir_all(dir.path().join(FILE)).unwrap();
        mesh.beat();
        assert_eq!(
            (writes(&m, FILE), writes(&m, HEARTBEAT_FILE)),
            (1, 1),
            "the same view is written once the way is clear"
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            leftovers.len(),
            2,
            "no temp file left behind: {leftovers:?}"
        );
    }

    /// Paused time: the writer's heartbeats and coalesced checks, tick by tick.
    #[tokio::test(start_paused = true)]
    async fn the_writer_beats_every_five_seconds_and_coalesces_a_stream_of_changes() {
        let dir = tempfile::tempdir().unwrap();
        let n = node(vec![service("web", "default", Some("10.96.0.10"), 1)]);
        let m = Metrics::new();
        let mesh = MeshDns::restore(dir.path(), n.clone(), m.clone());
        let start = Instant::now();
        let writer = tokio::spawn(run_writer(mesh.clone()));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(
            (writes(&m, FILE), writes(&m, HEARTBEAT_FILE)),
            (1, 1),
            "at start: the snapshot and a heartbeat"
        );

        // A VIP change every 10 ms for a second: at most one write per 100 ms.
        for i in 0..100u8 {
            n.apply([Change::UpsertService(service(
                "web",
                "default",
                Some(&format!("10.96.1.{i}")),
                1,
            ))]);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(COALESCE * 2).await;
        let during = writes(&m, FILE) - 1;
        assert!(
            (8..=11).contains(&during),
            "{during} writes for 100 changes over 1 s"
        );
        assert_eq!(
            mesh.on_disk().unwrap().services["web.default.svc"].to_string(),
            "10.96.1.99",
            "the last change is written"
        );
        // An endpoint churn is checked but writes nothing.
        for e in 0..20 {
            n.apply([Change::UpsertService(service(
                "web",
                "default",
                Some("10.96.1.99"),
                e,
            ))]);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        assert_eq!(writes(&m, FILE) - 1, during);

        tokio::time::sleep_until(start + HEARTBEAT * 3 - Duration::from_millis(1)).await;
        assert_eq!(writes(&m, HEARTBEAT_FILE), 3, "at 0, 5 and 10 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert_eq!(writes(&m, HEARTBEAT_FILE), 4, "and at 15 s");

        mesh.flush();
        tokio::time::timeout(Duration::from_secs(1), writer)
            .await
            .expect("the writer ends after the flush")
            .unwrap();
        assert_eq!(writes(&m, HEARTBEAT_FILE), 5);
    }

    /// The cost of a check at mesh scale, under the builder's lock: the fingerprint for
    /// every check, the document only when the fingerprint moved.
    #[test]
    fn a_check_at_ten_thousand_services_is_cheap_when_no_vip_changed() {
        let services: Vec<Service> = (0..10_000u32)
            .map(|s| {
                service(
                    &format!("svc-{s:05}"),
                    "mesh",
                    Some(&std::net::Ipv4Addr::from(0x0a60_0000 + s).to_string()),
                    0,
                )
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let n = node(services);
        let mesh = MeshDns::restore(dir.path(), n.clone(), Metrics::new());
        let t = std::time::Instant::now();
        assert!(mesh.check());
        let first = t.elapsed();
        let t = std::time::Instant::now();
        for _ in 0..10 {
            assert!(!mesh.check());
        }
        let unchanged = t.elapsed() / 10;
        eprintln!(
            "10,000 services: first check and write {first:?}, a check with no change {unchanged:?}"
        );
        assert_eq!(mesh.on_disk().unwrap().services.len(), 10_000);
    }
}
