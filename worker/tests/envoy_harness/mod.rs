//! A real Envoy against an in-process ADS server, for the xDS tests and the benchmark.
//!
//! Envoy comes from `ENVOY_BIN`, else the project virtualenv that
//! `scripts/install-envoy.sh` fills; without either the caller skips, loudly.
#![allow(dead_code)] // Each test crate that includes this uses a different part.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aether_worker::bootstrap::{self, Admin, AdsApi};
use aether_worker::metrics::{Metrics, TypeLabel};
use aether_worker::node::Node;
use aether_model::{Inputs, Snapshot};
use aether_worker::acks::Acks;
use aether_worker::xds;
use aether_worker::{capture, registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::task::JoinHandle;
pub use aether_worker::bootstrap::envoy_bin;

/// Returns the Envoy binary or makes the calling test return after saying why, loudly.
#[macro_export]
macro_rules! require_envoy {
    () => {
        match $crate::envoy_harness::envoy_bin() {
            Some(p) => p,
            None => {
                eprintln!(
                    "\n!!! SKIPPED {} ({}): no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN. CI installs it, so there this test runs. !!!\n",
                    module_path!(),
                    concat!(file!(), ":", line!())
                );
                return;
            }
        }
    };
}

/// Everything the worker logs, kept for assertions and echoed to stderr.
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

pub fn init_logs(filter: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_ansi(false)
        .with_writer(|| LogWriter)
        .try_init();
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Harness {
    pub dir: tempfile::TempDir,
    pub node: Arc<Node>,
    pub metrics: Arc<Metrics>,
    pub acks: Acks,
    pub registry_file: PathBuf,
    pub outbound: SocketAddr,
    pub inbound_port: u16,
    envoy: tokio::process::Child,
    tasks: Vec<JoinHandle<()>>,
    server: Option<Server>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        let _ = self.envoy.start_kill();
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
    fn start(sock: PathBuf, node: &Node, acks: Acks, metrics: Arc<Metrics>) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let snapshots = node.subscribe();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            rt.block_on(async move {
                // A stopped server leaves its socket file, as a dead process would.
                let _ = std::fs::remove_file(&sock);
                let listener = tokio::net::UnixListener::bind(&sock).unwrap();
                ready_tx.send(()).unwrap();
                tokio::select! {
                    r = xds::serve(listener, snapshots, Default::default(), acks, metrics, std::future::pending()) => r.expect("ADS server"),
                    _ = stopped => {}
                }
            });
            rt.shutdown_background();
        });
        ready.recv().expect("ADS server bound");
        Self { stop: Some(stop), thread: Some(thread) }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
        let _ = self.thread.take().map(|t| t.join());
    }
}

impl Harness {
    /// Starts the worker side (registry, capture, ADS server) and an Envoy bootstrapped
    /// from the project template, and waits until Envoy has ACKed the first snapshot.
    pub async fn start(envoy: &Path, registry_json: &str) -> Self {
        Self::start_with(envoy, registry_json, AdsApi::default()).await
    }

    /// The same, with Envoy speaking the given ADS variant.
    pub async fn start_with(envoy: &Path, registry_json: &str, api: AdsApi) -> Self {
        let dir = tempfile::Builder::new().prefix("axds").tempdir().unwrap();
        let registry_file = dir.path().join("registry.json");
        std::fs::write(&registry_file, registry_json).unwrap();
        let outbound: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let inbound_port = free_port();
        let capture_file = dir.path().join("capture.json");
        std::fs::write(&capture_file, format!(r#"{{"outbound":"{outbound}","inbound_port":{inbound_port}}}"#)).unwrap();

        let node = Node::new(Inputs::default());
        let metrics = Metrics::new();
        let acks = Acks::default();
        let tasks = vec![
            registry::spawn_embedded(Some(registry_file.clone()), u64::MAX, node.clone(), metrics.clone()),
            capture::spawn(Some(capture_file), node.clone(), metrics.clone()),
        ];
        let mut gates = node.gates();
        tokio::time::timeout(Duration::from_secs(5), gates.wait_for(|g| g.registry_loaded && g.capture_landed))
            .await
            .expect("registry and capture land")
            .unwrap();

        let server = Server::start(dir.path().join("xds.sock"), &node, acks.clone(), metrics.clone());

        let config = bootstrap::render(
            dir.path(),
            &Admin::Pipe(dir.path().join("admin.sock")),
            "test-node",
            bootstrap::DEFAULT_BACKOFF_BASE,
            bootstrap::DEFAULT_BACKOFF_MAX,
            api,
        );
        std::fs::write(dir.path().join("envoy.yaml"), config).unwrap();
        let log = std::fs::File::create(dir.path().join("envoy.log")).unwrap();
        let child = tokio::process::Command::new(envoy)
            .arg("-c")
            .arg(dir.path().join("envoy.yaml"))
            .args(["--disable-hot-restart", "--concurrency", "2", "--log-level", "info"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn envoy");

        let h = Self { dir, node, metrics, acks, registry_file, outbound, inbound_port, envoy: child, tasks, server: Some(server) };
        if !h.wait_acked_current(Duration::from_secs(20)).await {
            panic!("Envoy did not ACK the first snapshot within 20 s; its log:\n{}", h.envoy_log());
        }
        h
    }

    /// Stops the ADS server (every stream closes) and starts a new one on the same socket
    /// path with fresh [`Acks`], which it returns and the harness uses from then on.
    pub fn restart_server(&mut self) -> Acks {
        self.server.take();
        self.acks = Acks::default();
        self.server = Some(Server::start(self.dir.path().join("xds.sock"), &self.node, self.acks.clone(), self.metrics.clone()));
        self.acks.clone()
    }

    /// Waits until Envoy has ACKed the node's current snapshot (every type's version).
    pub async fn wait_acked_current(&self, timeout: Duration) -> bool {
        let want = self.node.snapshot();
        self.acks.wait_until(|s| same_versions(s, &want), timeout).await
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

    pub fn envoy_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// GET `path` from Envoy's admin endpoint over its pipe; the body. HTTP/1.1 with
    /// `Connection: close`: Envoy's admin answers HTTP/1.0 with 426.
    pub async fn admin(&self, path: &str) -> String {
        let mut s = UnixStream::connect(self.dir.path().join("admin.sock")).await.expect("admin socket");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8_lossy(&out).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        assert!(head.starts_with("HTTP/1.1 200 "), "admin {path}: {head}");
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(body) } else { body.to_string() }
    }

    /// One counter or gauge from Envoy's admin `/stats`.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let filter = format!("^{}$", regex_escape(name));
        let body = self.admin(&format!("/stats?format=json&filter={}", url_escape(&filter))).await;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        v["stats"].as_array()?.iter().find(|s| s["name"] == name)?["value"].as_u64()
    }

    pub async fn config_dump(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin("/config_dump?include_eds").await).expect("config_dump is JSON")
    }

    /// The EDS health status (`HEALTHY`, `DRAINING`, ...) Envoy holds for one host, from
    /// admin `/clusters`.
    pub async fn eds_health(&self, cluster: &str, addr: &str) -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(&self.admin("/clusters?format=json").await).ok()?;
        let c = v["cluster_statuses"].as_array()?.iter().find(|c| c["name"] == cluster)?;
        let host = c["host_statuses"].as_array()?.iter().find(|h| {
            let sa = &h["address"]["socket_address"];
            format!("{}:{}", sa["address"].as_str().unwrap_or(""), sa["port_value"].as_u64().unwrap_or(0)) == addr
        })?;
        Some(host["health_status"]["eds_health_status"].as_str().unwrap_or("HEALTHY").to_string())
    }

    pub fn worker_counter(&self, family: &str, type_url: &str) -> u64 {
        let label = TypeLabel { type_url: type_url.to_string() };
        match family {
            "acks" => self.metrics.xds_acks.get_or_create(&label).get(),
            "nacks" => self.metrics.xds_nacks.get_or_create(&label).get(),
            "pushes" => self.metrics.xds_pushes.get_or_create(&label).get(),
            _ => panic!("unknown family {family}"),
        }
    }
}

pub fn same_versions(a: &Snapshot, b: &Snapshot) -> bool {
    a.listeners.version == b.listeners.version
        && a.routes.version == b.routes.version
        && a.clusters.version == b.clusters.version
        && a.endpoints.version == b.endpoints.version
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn regex_escape(s: &str) -> String {
    s.chars().flat_map(|c| if "\\.|()[]{}^$*+?".contains(c) { vec!['\\', c] } else { vec![c] }).collect()
}

fn url_escape(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// Polls `check` until it returns `Some`, or panics naming `what` at the deadline.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return (v, start.elapsed());
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A loopback HTTP/1.1 server answering every request with its name; counts requests.
pub struct Upstream {
    pub name: String,
    pub addr: SocketAddr,
    pub hits: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start(name: &str) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(AtomicU64::new(0));
        let (h, body) = (hits.clone(), name.to_string());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else { return };
                let (h, body) = (h.clone(), body.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        while let Some(end) = find(&buf, b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            h.fetch_add(1, Ordering::SeqCst);
                            let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len());
                            if s.write_all(resp.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        Self { name: name.to_string(), addr, hits, task }
    }

    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::SeqCst)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// One HTTP/1.1 GET through `proxy` with the given Host; (status, body).
pub async fn http_get(proxy: SocketAddr, host: &str) -> std::io::Result<(u16, String)> {
    let fut = async {
        let mut s = TcpStream::connect(proxy).await?;
        s.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), fut).await.map_err(|_| std::io::Error::other("GET timed out"))?
}

/// A service for [`registry_json`]: name, VIP, and endpoints as (address, draining).
pub type ServiceSpec<'a> = (&'a str, Option<&'a str>, Vec<(SocketAddr, bool)>);

/// Registry JSON for services in namespace `default` with the one port 80.
pub fn registry_json(services: &[ServiceSpec<'_>]) -> String {
    let services: Vec<serde_json::Value> = services
        .iter()
        .map(|(name, vip, eps)| {
            let eps: Vec<serde_json::Value> = eps
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

// ---- config_dump readers ----

fn dump_of<'a>(dump: &'a serde_json::Value, kind: &str) -> Option<&'a serde_json::Value> {
    dump["configs"].as_array()?.iter().find(|c| c["@type"].as_str().is_some_and(|t| t.rsplit('.').next() == Some(kind)))
}

/// Names of the dynamic active clusters and the CDS version.
pub fn clusters(dump: &serde_json::Value) -> (Vec<String>, String) {
    let Some(c) = dump_of(dump, "ClustersConfigDump") else { return (vec![], String::new()) };
    let names = c["dynamic_active_clusters"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["cluster"]["name"].as_str().map(String::from)).collect())
        .unwrap_or_default();
    (names, c["version_info"].as_str().unwrap_or_default().to_string())
}

/// Active listeners by name, with the LDS version.
pub fn listeners(dump: &serde_json::Value) -> (Vec<(String, serde_json::Value)>, String) {
    let Some(c) = dump_of(dump, "ListenersConfigDump") else { return (vec![], String::new()) };
    let ls = c["dynamic_listeners"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| Some((x["name"].as_str()?.to_string(), x["active_state"]["listener"].clone())))
                .collect()
        })
        .unwrap_or_default();
    (ls, c["version_info"].as_str().unwrap_or_default().to_string())
}

/// The RDS route configuration `name`: (version, domains of every virtual host).
pub fn route(dump: &serde_json::Value, name: &str) -> Option<(String, Vec<String>)> {
    let c = dump_of(dump, "RoutesConfigDump")?;
    let r = c["dynamic_route_configs"].as_array()?.iter().find(|r| r["route_config"]["name"] == name)?;
    let domains = r["route_config"]["virtual_hosts"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .flat_map(|v| v["domains"].as_array().cloned().unwrap_or_default())
                .filter_map(|d| d.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    Some((r["version_info"].as_str().unwrap_or_default().to_string(), domains))
}

/// The EDS endpoints of `cluster` as "addr:port HEALTH", sorted.
pub fn endpoints(dump: &serde_json::Value, cluster: &str) -> Option<Vec<String>> {
    let c = dump_of(dump, "EndpointsConfigDump")?;
    let e = c["dynamic_endpoint_configs"].as_array()?.iter().find(|e| e["endpoint_config"]["cluster_name"] == cluster)?;
    let mut out: Vec<String> = e["endpoint_config"]["endpoints"]
        .as_array()
        .map(|locs| {
            locs.iter()
                .flat_map(|l| l["lb_endpoints"].as_array().cloned().unwrap_or_default())
                .map(|lb| {
                    let sa = &lb["endpoint"]["address"]["socket_address"];
                    format!(
                        "{}:{} {}",
                        sa["address"].as_str().unwrap_or("?"),
                        sa["port_value"].as_u64().unwrap_or(0),
                        lb["health_status"].as_str().unwrap_or("UNKNOWN")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    Some(out)
}
