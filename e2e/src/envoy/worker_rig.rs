//! The worker's pieces in this process (node, registry and capture watchers, the ADS
//! server on a runtime of its own) with a real Envoy on them, for the xDS tests and the
//! benchmarks; plus the worker's log capture and registry JSON for them.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use aether_model::{Identity, Inputs, Snapshot};
use aether_worker::acks::Acks;
use aether_worker::bootstrap::{DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_MAX};
use aether_worker::metrics::{Metrics, TypeLabel};
use aether_worker::node::Node;
use aether_worker::writers::Observed;
use aether_worker::xds;
use aether_worker::{capture, registry};
use serde_json::Value;
use tokio::task::JoinHandle;

use super::{AdsApi, Envoy};
use crate::testing::free_port;

/// Everything the worker logs (after [`init_logs`]), kept for assertions and echoed to
/// stderr.
pub fn captured_logs() -> String {
    String::from_utf8_lossy(&log_buffer().lock().unwrap()).into_owned()
}

fn log_buffer() -> &'static Mutex<Vec<u8>> {
    static BUF: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    BUF.get_or_init(|| Mutex::new(Vec::new()))
}

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        log_buffer().lock().unwrap().extend_from_slice(b);
        std::io::stderr().write_all(b)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the process's log subscriber with `filter` (a tracing filter), writing into
/// [`captured_logs`]; a second call is a no-op.
pub fn init_logs(filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_writer(|| LogWriter)
        .try_init();
}

/// The worker side in-process and a real Envoy on its ADS socket, in a temp dir; Envoy
/// is killed and the server stopped when dropped.
pub struct WorkerRig {
    pub dir: tempfile::TempDir,
    pub node: Arc<Node>,
    pub metrics: Arc<Metrics>,
    pub acks: Acks,
    pub registry_file: PathBuf,
    /// Envoy's outbound listener.
    pub outbound: SocketAddr,
    pub inbound_port: u16,
    pub envoy: Envoy,
    /// The relay between Envoy and the server, with [`RigOptions::relay`].
    pub relay: Option<super::Relay>,
    /// With on-demand clusters: the observed upstreams, kept in `dir`.
    pub observed: Option<Arc<Observed>>,
    /// How long the registry and capture files took to land, and Envoy from its start to
    /// its ACK of the first snapshot.
    pub loaded: Duration,
    pub envoy_synced: Duration,
    tasks: Vec<JoinHandle<()>>,
    server: Option<Server>,
}

/// How the rig's worker side runs.
#[derive(Debug, Clone, Default)]
pub struct RigOptions {
    pub api: AdsApi,
    /// `--on-demand-clusters` (delta ADS only).
    pub on_demand: bool,
    /// Run Envoy inside this named network namespace (`ip netns exec`), as the node's
    /// proxy of a [`crate::datapath::Datapath`]; its ADS and admin sockets are files in the
    /// rig's temp dir, which work across namespaces.
    pub netns: Option<String>,
    /// Where the outbound listener binds; 127.0.0.1 when unset. A data path that
    /// redirects pods' connections to it needs an address they can be redirected to
    /// (0.0.0.0).
    pub outbound_ip: Option<IpAddr>,
    /// The node's initial identity inputs (trust domain, mode, bundle, SVIDs); off by
    /// default.
    pub identity: Identity,
    /// The node's QUIC twins (`--quic-twin-addr`); none by default.
    pub quic_twins: Option<aether_model::QuicTwins>,
    /// `aether-xds-relay` between Envoy and the ADS server (Envoy dials the relay's socket,
    /// the relay the server's), as the proxy pod runs it with `proxy.relay.enabled`.
    pub relay: bool,
}

impl Drop for WorkerRig {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.server.take();
    }
}

/// The ADS server on a runtime of its own, so that stopping it closes every connection
/// and stream at once, as a process exit would.
struct Server {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(
        sock: PathBuf,
        node: &Node,
        acks: Acks,
        metrics: Arc<Metrics>,
        observed: Option<Arc<Observed>>,
    ) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let snapshots = node.subscribe();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                // A stopped server leaves its socket file, as a dead process would.
                let _ = std::fs::remove_file(&sock);
                let listener = tokio::net::UnixListener::bind(&sock).unwrap();
                ready_tx.send(()).unwrap();
                tokio::select! {
                    r = xds::server::serve(listener, snapshots, Default::default(), acks, metrics, observed, std::future::pending(), Default::default(), Default::default(), Default::default()) => r.expect("ADS server"),
                    _ = stopped => {}
                }
            });
            rt.shutdown_background();
        });
        ready.recv().expect("ADS server bound");
        Self {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        let _ = self.thread.take().map(|t| t.join());
    }
}

impl WorkerRig {
    /// Starts the worker side (registry, capture, ADS server) and an Envoy bootstrapped
    /// from the project template speaking `api`, and waits until Envoy has ACKed the first
    /// snapshot. Call it on a multi-threaded runtime: the admin reads block their thread.
    pub async fn start(envoy_bin: &Path, registry_json: &str, api: AdsApi) -> Self {
        Self::start_with(
            envoy_bin,
            registry_json,
            RigOptions {
                api,
                ..RigOptions::default()
            },
        )
        .await
    }

    /// [`Self::start`] with every option.
    pub async fn start_with(envoy_bin: &Path, registry_json: &str, options: RigOptions) -> Self {
        let api = options.api;
        let dir = tempfile::Builder::new().prefix("axds").tempdir().unwrap();
        let registry_file = dir.path().join("registry.json");
        std::fs::write(&registry_file, registry_json).unwrap();
        // Two distinct ports: the first is held while the second is chosen (two calls of
        // free_port may return the same one, which the capture file refuses).
        let held = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let outbound = SocketAddr::new(
            options
                .outbound_ip
                .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            held.local_addr().unwrap().port(),
        );
        let inbound_port = free_port(Ipv4Addr::LOCALHOST).unwrap();
        drop(held);
        let capture_file = dir.path().join("capture.json");
        std::fs::write(
            &capture_file,
            format!(r#"{{"outbound":"{outbound}","inbound_port":{inbound_port}}}"#),
        )
        .unwrap();

        let node = Node::new(Inputs {
            on_demand_clusters: options.on_demand,
            identity: options.identity,
            quic_twins: options.quic_twins,
            ..Inputs::default()
        });
        let observed = options.on_demand.then(|| Observed::restore(dir.path()));
        let metrics = Metrics::new();
        let t0 = Instant::now();
        let acks = Acks::default();
        let tasks = vec![
            registry::spawn_embedded(
                Some(registry_file.clone()),
                u64::MAX,
                node.clone(),
                metrics.clone(),
            ),
            capture::spawn(Some(capture_file), node.clone(), metrics.clone()),
        ];
        let mut gates = node.gates();
        tokio::time::timeout(
            Duration::from_secs(30),
            gates.wait_for(|g| g.registry_loaded && g.capture_landed),
        )
        .await
        .expect("registry and capture land")
        .unwrap();
        let loaded = t0.elapsed();

        let server = Server::start(
            dir.path().join("xds.sock"),
            &node,
            acks.clone(),
            metrics.clone(),
            observed.clone(),
        );
        let t1 = Instant::now();
        let bin = match &options.netns {
            Some(ns) => netns_wrapper(dir.path(), ns, envoy_bin),
            None => envoy_bin.to_path_buf(),
        };
        let relay = options
            .relay
            .then(|| super::Relay::start(&dir.path().join("relay"), dir.path()));
        let envoy = Envoy::start(
            &bin,
            dir.path(),
            relay.as_ref().map_or(dir.path(), |r| r.dir.as_path()),
            DEFAULT_BACKOFF_BASE,
            DEFAULT_BACKOFF_MAX,
            api,
        )
        .expect("spawn envoy");

        let mut h = Self {
            dir,
            node,
            metrics,
            acks,
            registry_file,
            outbound,
            inbound_port,
            envoy,
            relay,
            observed,
            loaded,
            envoy_synced: Duration::ZERO,
            tasks,
            server: Some(server),
        };
        if !h.wait_acked_current(Duration::from_secs(120)).await {
            panic!(
                "Envoy did not ACK the first snapshot within 120 s; its log:\n{}",
                h.envoy.log_text()
            );
        }
        h.envoy_synced = t1.elapsed();
        h
    }

    /// Stops the ADS server (every stream closes) and starts a new one on the same socket
    /// path with fresh [`Acks`], which it returns and the rig uses from then on.
    pub fn restart_server(&mut self) -> Acks {
        self.server.take();
        self.acks = Acks::default();
        self.server = Some(Server::start(
            self.dir.path().join("xds.sock"),
            &self.node,
            self.acks.clone(),
            self.metrics.clone(),
            self.observed.clone(),
        ));
        self.acks.clone()
    }

    /// Waits until Envoy has ACKed the node's current snapshot (every type's version).
    pub async fn wait_acked_current(&self, timeout: Duration) -> bool {
        let want = self.node.snapshot();
        self.acks
            .wait_until(|s| same_versions(s, &want), timeout)
            .await
    }

    /// Replaces the registry file atomically, as a ConfigMap update would, and returns
    /// once the node has built a snapshot from it, so that [`Self::wait_acked_current`]
    /// waits for the new content and not the one before. Every caller writes a registry
    /// that changes the snapshot.
    pub async fn write_registry(&self, json: &str) {
        let mut snapshots = self.node.subscribe();
        snapshots.borrow_and_update();
        let tmp = self.dir.path().join(".registry.json.tmp");
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(&tmp, &self.registry_file).unwrap();
        tokio::time::timeout(Duration::from_secs(10), snapshots.changed())
            .await
            .expect("the node did not rebuild its snapshot from the new registry file within 10 s")
            .expect("the node is gone");
    }

    /// GET `path` from Envoy's admin endpoint; the body of its 200 answer.
    pub fn admin(&self, path: &str) -> String {
        let (status, body) = self.envoy.get(path).expect("Envoy's admin socket");
        assert_eq!(status, 200, "admin {path}: status {status}: {body}");
        body
    }

    /// One counter or gauge from Envoy's admin `/stats`.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.envoy.stat(name)
    }

    pub fn config_dump(&self) -> Value {
        serde_json::from_str(&self.admin("/config_dump?include_eds")).expect("config_dump is JSON")
    }

    /// The EDS health status (`HEALTHY`, `DRAINING`, ...) Envoy holds for one host, from
    /// admin `/clusters`.
    pub fn eds_health(&self, cluster: &str, addr: &str) -> Option<String> {
        let v: Value = serde_json::from_str(&self.admin("/clusters?format=json")).ok()?;
        let c = v["cluster_statuses"]
            .as_array()?
            .iter()
            .find(|c| c["name"] == cluster)?;
        let host = c["host_statuses"].as_array()?.iter().find(|h| {
            let sa = &h["address"]["socket_address"];
            format!(
                "{}:{}",
                sa["address"].as_str().unwrap_or(""),
                sa["port_value"].as_u64().unwrap_or(0)
            ) == addr
        })?;
        Some(
            host["health_status"]["eds_health_status"]
                .as_str()
                .unwrap_or("HEALTHY")
                .to_string(),
        )
    }

    /// The worker's xDS counter `family` (acks, nacks, pushes) for one type.
    pub fn worker_counter(&self, family: &str, type_url: &str) -> u64 {
        let label = TypeLabel {
            type_url: type_url.to_string(),
        };
        match family {
            "acks" => self.metrics.xds_acks.get_or_create(&label).get(),
            "nacks" => self.metrics.xds_nacks.get_or_create(&label).get(),
            "pushes" => self.metrics.xds_pushes.get_or_create(&label).get(),
            "resources" => self.metrics.xds_resources.get_or_create(&label).get(),
            "initial_resources" => self
                .metrics
                .xds_initial_resources
                .get_or_create(&label)
                .get(),
            _ => panic!("unknown family {family}"),
        }
    }
}

/// A script in `dir` that runs Envoy inside the network namespace `ns`. `ip netns exec`
/// execs Envoy in place (no fork), so the rig's child pid is Envoy's and killing it kills
/// Envoy.
fn netns_wrapper(dir: &Path, ns: &str, envoy_bin: &Path) -> PathBuf {
    let wrapper = dir.join("envoy-in-netns");
    let script = format!(
        "#!/bin/sh\nexec ip netns exec '{ns}' '{}' \"$@\"\n",
        envoy_bin.display()
    );
    std::fs::write(&wrapper, script).expect("write the netns wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
        .expect("chmod the netns wrapper");
    wrapper
}

/// Whether two snapshots carry the same version of every type. (A fully ACKed snapshot
/// is only published once the proxy holds the secrets its listeners and clusters name,
/// so equal SDS versions mean the proxy holds the current secrets.)
pub fn same_versions(a: &Snapshot, b: &Snapshot) -> bool {
    a.listeners.version == b.listeners.version
        && a.routes.version == b.routes.version
        && a.clusters.version == b.clusters.version
        && a.endpoints.version == b.endpoints.version
        && a.secrets.version == b.secrets.version
}

/// A service for [`registry_json`]: name, VIP, and endpoints as (address, draining).
pub type ServiceSpec<'a> = (&'a str, Option<&'a str>, Vec<(SocketAddr, bool)>);

/// Registry JSON for services in namespace `default` with the one port 80.
pub fn registry_json(services: &[ServiceSpec<'_>]) -> String {
    let services: Vec<Value> = services
        .iter()
        .map(|(name, vip, eps)| {
            let eps: Vec<Value> = eps
                .iter()
                .map(|(a, d)| {
                    serde_json::json!({"address": a.ip(), "port": a.port(),
                        "state": if *d { "draining" } else { "healthy" }})
                })
                .collect();
            let mut s = serde_json::json!({"name": name, "namespace": "default", "ports": [80], "endpoints": eps});
            if let Some(v) = vip {
                s["vip"] = serde_json::json!(v);
            }
            s
        })
        .collect();
    serde_json::json!({ "services": services }).to_string()
}
