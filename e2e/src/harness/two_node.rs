//! `ARG_NODES=2`: two local nodes sharing one registrar on etcd. Node A is the one the
//! harness rolls (in any mode), with the load through its Envoy; node B serves the services' endpoints
//! (loopback upstreams registered with node `node-b`), runs an Envoy of its own, and its
//! pods churn and drain: each of them is a registry endpoint, so its owner's CNI DEL sets
//! a drain mark at the registrar, and [`CrossDrain`] times how long node A's Envoy takes
//! to show that endpoint DRAINING. At the end both Envoys' EDS must equal the registrar's
//! view ([`eds_check`]).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};

use super::churn::{self, Cni, PodId, Pods};
use super::{Config, T_START};
use crate::envoy::{self, Envoy, admin_get};
use crate::registrar::{Etcd, RegistrarProcess, TestCa, envoy_eds, expected_eds, registrar_bin};
use crate::testing::{Agent, LocalNode, bin, percentile, try_wait_for};

/// The rolled node's `--node-name`.
pub const NODE_A: &str = "node-a";
/// The node of the services' endpoints and of the draining pods.
pub const NODE_B: &str = "node-b";
/// The service whose endpoints are node B's churned pods (namespace [`POD_NAMESPACE`]).
pub const POD_SERVICE: &str = "pods-b";
pub const POD_NAMESPACE: &str = "churn";
/// The port node B's pod endpoints are registered with; never dialled.
const POD_PORT: u16 = 8080;
/// Node B's pods are registered this many at a time: one registrar apply per batch.
const BATCH: usize = 10;
/// The services in one registrar apply of a mesh ([`SharedRegistry::apply`]).
const APPLY_CHUNK: usize = 1000;
/// How often node A's Envoy admin is read while a drain is on its way.
const DRAIN_POLL: Duration = Duration::from_millis(3);
/// The same at mesh scale, where one read of the drained cluster walks 10,000 clusters
/// on Envoy's main thread (25 to 40 ms at 10,000 services): read every few ms, it would
/// hold that thread, which also takes the xDS answers that the gate times. A drain's
/// sample is then late by up to this.
const MESH_POLL: Duration = Duration::from_millis(250);
/// A drain not seen by then is counted as lost.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// One etcd member and the registrar serving it on loopback TCP with TLS, as the chart
/// runs it with `registrar.tls.secretName`: every agent checks its certificate against
/// the test CA (`--registrar-ca`), and so do the harness's own commands (`--ca`). It takes
/// `--allow-loopback-endpoints`, as the upstreams are on loopback. Dropped last: etcd
/// after the registrar.
pub struct SharedRegistry {
    pub registrar: RegistrarProcess,
    _etcd: Etcd,
    _ca: TestCa,
    /// The CA certificate, where the workers (uid 65532 under root) can read it.
    ca_file: PathBuf,
    /// Where the registry files that the harness applies are written.
    dir: PathBuf,
}

impl SharedRegistry {
    /// Starts etcd (its data in a new folder in `etcd_dir`, else the temp dir) and the
    /// registrar; registry files and the CA certificate go to `dir`.
    pub fn start(dir: &Path, etcd_dir: Option<&Path>) -> Result<SharedRegistry> {
        if !Etcd::available() {
            bail!(
                "ARG_NODES=2 needs etcd at {} (Debian package etcd-server; scripts/test.sh installs it)",
                aether_registrar::testing::ETCD_BIN
            );
        }
        let etcd = Etcd::cluster_in(1, etcd_dir);
        let ca = TestCa::new("aether-registrar test CA");
        let (cert, key) = ca.leaf(
            "registrar",
            &["127.0.0.1"],
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        );
        // Node B's upstreams are loopback addresses, which a registrar refuses by default.
        let flags = [
            "--tls-cert",
            &cert.display().to_string(),
            "--tls-key",
            &key.display().to_string(),
            "--allow-loopback-endpoints",
        ]
        .map(str::to_owned);
        let registrar = RegistrarProcess::tcp(
            &registrar_bin(),
            &etcd.endpoints(),
            &flags.iter().map(String::as_str).collect::<Vec<_>>(),
        );
        let ca_file = dir.join("registrar-ca.crt");
        std::fs::copy(ca.ca_file(), &ca_file)
            .with_context(|| format!("copy the registrar's CA to {}", ca_file.display()))?;
        std::fs::set_permissions(
            &ca_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )?;
        Ok(SharedRegistry {
            registrar,
            _etcd: etcd,
            _ca: ca,
            ca_file,
            dir: dir.to_path_buf(),
        })
    }

    pub fn addr(&self) -> &str {
        self.registrar.addr()
    }

    /// The flags an agent takes to watch this registrar over TLS.
    pub fn agent_flags(&self) -> Vec<String> {
        vec![
            format!("--registrar={}", self.addr()),
            format!("--registrar-ca={}", self.ca_file.display()),
        ]
    }

    /// Upserts the services of `doc` (the `--registry-file` schema) from a file named
    /// `name`; the revision. A mesh (`ARG_MESH_SERVICES`) goes in applies of
    /// [`APPLY_CHUNK`] services: the registrar writes one etcd transaction per service,
    /// and 10,000 of them take longer than one call may, in more bytes than one call
    /// takes (`--max-apply-bytes`).
    pub fn apply(&self, name: &str, doc: &str) -> Result<i64> {
        let file = self.dir.join(name);
        let parsed: Value = serde_json::from_str(doc).context("the registry to apply")?;
        let services = parsed["services"].as_array().map_or(&[][..], Vec::as_slice);
        if services.len() <= APPLY_CHUNK {
            return apply(self.addr(), &self.ca_file, &file, doc);
        }
        let mut revision = 0;
        for (i, chunk) in services.chunks(APPLY_CHUNK).enumerate() {
            let part = json!({ "services": chunk }).to_string();
            revision = apply(self.addr(), &self.ca_file, &file, &part)
                .with_context(|| format!("services {} of {}", i * APPLY_CHUNK, services.len()))?;
        }
        Ok(revision)
    }

    /// The registry changes [`super::changes`] times, made at this registrar: `docs`
    /// are the one service's two states, the first of them applied already.
    pub fn change_target(&self, docs: [String; 2]) -> Result<super::changes::Target> {
        super::changes::Target::registrar(self.addr(), &self.ca_file, docs)
    }

    /// The registrar's view (`aether-registrar dump`).
    pub fn dump(&self) -> Result<Value> {
        serde_json::from_str(&cli(&[
            "dump",
            "--registrar",
            self.addr(),
            "--ca",
            &self.ca_file.display().to_string(),
        ])?)
        .context("aether-registrar dump is not JSON")
    }

    /// Copies the registrar's log into `dir` (its own folder goes with it).
    pub fn keep_log(&self, dir: &Path) {
        let _ = std::fs::write(dir.join("registrar.log"), self.registrar.log());
    }
}

/// `aether-registrar <args>`: its stdout, or an error with its stderr.
fn cli(args: &[&str]) -> Result<String> {
    let out = Command::new(registrar_bin())
        .args(args)
        .output()
        .context("run aether-registrar")?;
    if !out.status.success() {
        bail!(
            "aether-registrar {args:?} exited {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes `doc` to `file` and applies it at `addr` over TLS checked against `ca`; the
/// revision it printed.
fn apply(addr: &str, ca: &Path, file: &Path, doc: &str) -> Result<i64> {
    std::fs::write(file, doc).with_context(|| format!("write {}", file.display()))?;
    let out = cli(&[
        "apply",
        "--registrar",
        addr,
        "--ca",
        &ca.display().to_string(),
        "--file",
        &file.display().to_string(),
    ])?;
    out.rsplit_once("(revision ")
        .and_then(|(_, r)| r.trim_end().trim_end_matches(')').parse().ok())
        .ok_or_else(|| anyhow!("no revision in aether-registrar apply's output {out:?}"))
}

/// Node B: its own run and state folders, one agent generation (never rolled), an Envoy,
/// and its pods. Fields drop in order: Envoy, then the agent, then the folder.
pub struct PeerNode {
    pub envoy: Envoy,
    pub owner: Agent,
    pub cni: Arc<Cni>,
    pub pods: Arc<Mutex<Pods>>,
    pub node: LocalNode,
}

impl PeerNode {
    /// Starts node B's agent against the registrar and its Envoy, and waits until that
    /// Envoy routes `service` (whose endpoints are node B's upstreams) through its own
    /// outbound listener. With `netns` (ARG_MTLS: the namespace and the agents' further
    /// flags), Envoy runs in that namespace with the capture listeners inside it, and the
    /// wait is for its first listeners instead.
    pub fn start(
        cfg: &Config,
        registrar: &[String],
        service: &str,
        netns: Option<(&str, &[String])>,
    ) -> Result<PeerNode> {
        let mut node = LocalNode::builder()
            .keep_folder()
            .node_name(NODE_B)
            .args(registrar)
            .build()?;
        let root = node.root.path().to_path_buf();
        // ARG_MTLS: the capture listeners in node B's namespace.
        let outbound = match netns {
            Some((_, more)) => {
                node.capture_with(&super::mtls::capture_json())?;
                node.args.extend_from_slice(more);
                None
            }
            None => Some(node.capture()?),
        };
        let owner = node
            .start_owner(T_START)
            .with_context(|| format!("node B ({})", root.display()))?;
        let envoy_bin = match netns {
            Some((ns, _)) => super::mtls::envoy_in(&root, ns, &cfg.envoy)?,
            None => cfg.envoy.clone(),
        };
        let envoy = Envoy::start(
            &envoy_bin,
            &root,
            &node.run_dir,
            cfg.backoff_base,
            cfg.backoff_max,
            cfg.xds_api,
        )
        .context("start node B's Envoy")?;
        let routes = match outbound {
            Some(o) => format!("route {service} through {o}"),
            None => "take its first listeners".into(),
        };
        try_wait_for(&format!("node B's Envoy to {routes}"), T_START, || {
            (envoy.stat(envoy::CONNECTED) == Some(1)
                && match outbound {
                    None => envoy
                        .stat("listener_manager.lds.update_success")
                        .is_some_and(|n| n >= 1),
                    Some(o) => super::load::request(o, service).is_ok(),
                })
            .then_some(())
        })
        .with_context(|| format!("node B's Envoy log {}", envoy.log.display()))?;
        let cni = Arc::new(Cni {
            bin: bin("aether-cni"),
            socket: node.cni_sock(),
        });
        let pods = Arc::new(Mutex::new(Pods::on("b-", 89)));
        Ok(PeerNode {
            envoy,
            owner,
            cni,
            pods,
            node,
        })
    }

    pub fn dir(&self) -> PathBuf {
        self.node.root.path().to_path_buf()
    }
}

/// A registry endpoint of node B (`--registry-file` schema).
pub fn endpoint(address: &str, port: u16, pod: &str) -> Value {
    json!({ "address": address, "port": port, "node": NODE_B, "pod": pod })
}

/// What [`CrossDrain`] measured.
#[derive(Debug, Default)]
pub struct DrainReport {
    /// Per drained pod: from its DEL's success on node B until node A's Envoy showed the
    /// endpoint DRAINING (s).
    pub samples: Vec<f64>,
    /// Each sample's DEL answer and the read that showed it DRAINING.
    pub spans: Vec<(Instant, Instant)>,
    /// DELs whose drain node A's Envoy had not shown after [`DRAIN_TIMEOUT`].
    pub timeouts: Vec<String>,
    /// When each of those DELs was answered.
    pub timeout_dels: Vec<Instant>,
    /// ARG_MTLS: of those, the ones whose DEL was answered within 100 ms of one of node
    /// B's own rolls (its old worker got its SIGTERM or SIGKILL right after answering),
    /// reported apart. Each still fails the run: the mark is on disk before the DEL is
    /// answered, and the next owner writes it.
    pub lost_in_peer_rolls: Vec<String>,
    /// Anything else that kept a sample from being taken (an apply, an ADD or a DEL failed).
    pub errors: Vec<String>,
    /// Registrar applies of new pod endpoints.
    pub batches: u64,
    /// ARG_MTLS (node B rolled too): ADDs node B refused, as it does while its worker
    /// restarts.
    pub refused_adds: u64,
    /// Median and worst time one read of node A's `/clusters` took.
    pub poll_cost: (Duration, Duration),
}

impl DrainReport {
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.samples.is_empty() {
            f.push("no cross-node drain was measured".to_string());
        }
        if !self.timeouts.is_empty() {
            f.push(format!(
                "{} cross-node drains never showed at node A's Envoy within {DRAIN_TIMEOUT:?} (first: {})",
                self.timeouts.len(),
                self.timeouts[0]
            ));
        }
        if !self.errors.is_empty() {
            f.push(format!(
                "{} cross-node drain steps failed (first: {})",
                self.errors.len(),
                self.errors[0]
            ));
        }
        f
    }
}

/// Node B's pod churn with drains, timed at node A's Envoy, in a thread of its own: a
/// batch of new pods is registered at the registrar as endpoints of [`POD_SERVICE`] (node
/// B, their addresses; the previous batch's endpoints go), and once node A's Envoy holds
/// them all HEALTHY, each is ADDed on node B through the real `aether-cni`; then, one at
/// a time, each is DELeted and node A's Envoy admin is read every [`DRAIN_POLL`] (at
/// mesh scale, [`MESH_POLL`]) until
/// that endpoint shows DRAINING. A drain mark stays on its address, so every pod gets a
/// fresh one.
pub struct CrossDrain {
    stop: Arc<AtomicBool>,
    pause: Arc<Pause>,
    thread: Option<JoinHandle<DrainReport>>,
}

/// Holds node B's drains while `ARG_RELAY`'s registry change is timed at node A's Envoy
/// ([`super::changes`]): a drain, or a batch of new pod endpoints, changes that Envoy's
/// load assignments too. A step in flight runs from its registrar write or DEL until node
/// A's Envoy showed it, or gave up.
pub type Pause = crate::pause::Pause;

/// Holds node B's drains, waiting for the step in flight to show at node A's Envoy.
pub fn hold(pause: &Pause) {
    if !pause.hold(DRAIN_TIMEOUT) {
        eprintln!(
            "   (a cross-node drain step still in flight after {DRAIN_TIMEOUT:?}; the change is timed anyway)"
        );
    }
}

struct DrainCtx {
    registrar: String,
    /// The registrar's CA certificate, for `apply --ca`.
    ca_file: PathBuf,
    file: PathBuf,
    cni: Arc<Cni>,
    pods: Arc<Mutex<Pods>>,
    /// Node A's Envoy admin.
    admin: PathBuf,
    cluster: String,
    stop: Arc<AtomicBool>,
    /// Node B's agent rolls too (ARG_MTLS).
    node_b_rolls: bool,
    /// How often node A's Envoy admin is read while a drain is on its way.
    poll: Duration,
    pause: Arc<Pause>,
}

impl CrossDrain {
    /// `admin`: node A's Envoy admin socket; `mesh`: `ARG_MESH_SERVICES` is set.
    pub fn start(
        registry: &SharedRegistry,
        peer: &PeerNode,
        admin: PathBuf,
        node_b_rolls: bool,
        mesh: bool,
    ) -> CrossDrain {
        let stop = Arc::new(AtomicBool::new(false));
        let pause = Arc::new(Pause::default());
        let ctx = DrainCtx {
            registrar: registry.addr().to_string(),
            ca_file: registry.ca_file.clone(),
            file: registry.dir.join("pods-b.json"),
            cni: peer.cni.clone(),
            pods: peer.pods.clone(),
            admin,
            cluster: aether_model::outbound_cluster_name(80, POD_SERVICE, POD_NAMESPACE),
            stop: stop.clone(),
            node_b_rolls,
            poll: if mesh { MESH_POLL } else { DRAIN_POLL },
            pause: pause.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("cross-drain".into())
            .spawn(move || ctx.run())
            .expect("spawn the cross-node drain thread");
        CrossDrain {
            stop,
            pause,
            thread: Some(thread),
        }
    }

    /// What holds the drains while a change is timed.
    pub fn pause(&self) -> Arc<Pause> {
        self.pause.clone()
    }

    /// Stops after the batch in flight (every pod of it is deleted and timed).
    pub fn stop(mut self) -> DrainReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl DrainCtx {
    fn run(self) -> DrainReport {
        let mut report = DrainReport::default();
        let mut costs = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            let batch: Vec<(PodId, Ipv4Addr)> = {
                let mut p = self.pods.lock().unwrap();
                (0..BATCH).map(|_| p.new_pod()).collect()
            };
            if let Err(e) = self.pause.during(|| self.register(&batch, &mut costs)) {
                report.errors.push(format!("{e:#}"));
                // The registrar or the proxy is in trouble; do not spin.
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
            report.batches += 1;
            let mut added = Vec::new();
            for (pod, ip) in &batch {
                if churn::add_pod(&self.cni, &self.pods, pod, *ip) {
                    added.push((pod.clone(), *ip));
                } else if self.node_b_rolls {
                    // ARG_MTLS rolls node B too: while its worker restarts after a crash
                    // an ADD is refused (fail closed) and the runtime retries it; that
                    // pod is left out of the drains, and its DEL retried.
                    report.refused_adds += 1;
                } else {
                    report.errors.push(format!(
                        "ADD {} on node B failed: {:?}",
                        pod.uid,
                        self.pods.lock().unwrap().errors.last()
                    ));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            for (pod, ip) in added {
                self.pause
                    .during(|| self.drain_one(&pod, ip, &mut report, &mut costs));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        churn::settle(&self.cni, &self.pods, Duration::from_secs(5));
        report.poll_cost = (
            percentile(&costs, 50.0).unwrap_or_default(),
            percentile(&costs, 100.0).unwrap_or_default(),
        );
        report
    }

    /// DELetes `pod` on node B and times its endpoint to DRAINING at node A's Envoy.
    fn drain_one(
        &self,
        pod: &PodId,
        ip: Ipv4Addr,
        report: &mut DrainReport,
        costs: &mut Vec<Duration>,
    ) {
        let addr = format!("{ip}:{POD_PORT}");
        if !churn::del_one(&self.cni, &self.pods, pod.clone()) {
            report.errors.push(format!(
                "DEL {} on node B failed: {:?}",
                pod.uid,
                self.pods.lock().unwrap().errors.last()
            ));
            return;
        }
        let deleted = Instant::now();
        match self.wait_state(&addr, "DRAINING", costs) {
            Some(seen) => {
                report
                    .samples
                    .push(seen.saturating_duration_since(deleted).as_secs_f64());
                report.spans.push((deleted, seen));
            }
            None => {
                report.timeouts.push(format!("{} ({addr})", pod.uid));
                report.timeout_dels.push(deleted);
            }
        }
    }

    /// Registers `batch` as the endpoints of [`POD_SERVICE`] and waits until node A's
    /// Envoy holds them all HEALTHY.
    fn register(&self, batch: &[(PodId, Ipv4Addr)], costs: &mut Vec<Duration>) -> Result<()> {
        let endpoints: Vec<Value> = batch
            .iter()
            .map(|(p, ip)| endpoint(&ip.to_string(), POD_PORT, &p.name))
            .collect();
        let doc = json!({ "services": [{ "name": POD_SERVICE, "namespace": POD_NAMESPACE, "ports": [80], "endpoints": endpoints }] });
        apply(&self.registrar, &self.ca_file, &self.file, &doc.to_string())
            .context("register node B's pods at the registrar")?;
        for (_, ip) in batch {
            let addr = format!("{ip}:{POD_PORT}");
            if self.wait_state(&addr, "HEALTHY", costs).is_none() {
                bail!(
                    "node A's Envoy did not show the new endpoint {addr} of {} within {DRAIN_TIMEOUT:?}",
                    self.cluster
                );
            }
        }
        Ok(())
    }

    /// Reads node A's Envoy until `addr` of the pod cluster shows `state`; the midpoint
    /// of the read that first did.
    fn wait_state(&self, addr: &str, state: &str, costs: &mut Vec<Duration>) -> Option<Instant> {
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        loop {
            let t0 = Instant::now();
            let got = eds_health(&self.admin, &self.cluster);
            let t1 = Instant::now();
            costs.push(t1 - t0);
            if got
                .as_ref()
                .and_then(|m| m.get(addr))
                .is_some_and(|s| s == state)
            {
                return Some(t0 + (t1 - t0) / 2);
            }
            if t1 >= deadline {
                return None;
            }
            std::thread::sleep(self.poll);
        }
    }
}

/// The EDS health status of each host of `cluster` ("addr:port" to `HEALTHY`,
/// `DRAINING`, ...), from an Envoy's admin `/clusters?format=json`; None while the admin
/// does not answer or holds no such cluster. Filtered to that cluster: at 1,000 mesh
/// services the whole answer is 8 MB and takes Envoy's main thread about 0.4 s.
pub fn eds_health(admin: &Path, cluster: &str) -> Option<BTreeMap<String, String>> {
    let (status, body) = admin_get(
        admin,
        &format!(
            "/clusters?format=json&filter={}",
            envoy::exact_names(&[cluster])
        ),
    )
    .ok()?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    let c = v["cluster_statuses"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == cluster)?;
    Some(hosts(c).into_iter().collect())
}

/// Waits (at most `timeout`) until every Envoy's outbound EDS equals what the registrar's
/// view says it should be; Err names the Envoys that never did, with the difference.
///
/// Two readings of each Envoy must agree with the registrar: `/config_dump?include_eds`
/// (what EDS delivered, [`envoy_eds`], which reads the dump's UNHEALTHY as the DRAINING the
/// agent sent); and `/clusters` ([`clusters_eds`]), which keeps the EDS status itself.
pub fn eds_check(
    registry: &SharedRegistry,
    envoys: &[(&str, &Envoy)],
    timeout: Duration,
) -> Result<(), String> {
    let want = registry
        .dump()
        .map(|d| expected_eds(&d))
        .map_err(|e| format!("{e:#}"))?;
    let mut wrong = Vec::new();
    for (name, envoy) in envoys {
        let (mut dumped, mut active) = (BTreeMap::new(), BTreeMap::new());
        let equal = try_wait_for(
            &format!("{name}'s EDS to equal the registrar's view"),
            timeout,
            || {
                let (status, body) = envoy.get("/config_dump?include_eds").ok()?;
                dumped = envoy_eds(&serde_json::from_str(&body).ok().filter(|_| status == 200)?);
                active = clusters_eds(&envoy.admin)?;
                (dumped == want && active == want).then_some(())
            },
        );
        if equal.is_err() {
            if dumped != want {
                wrong.push(format!("{name}, config_dump: {}", eds_diff(&want, &dumped)));
            }
            if active != want {
                wrong.push(format!("{name}, /clusters: {}", eds_diff(&want, &active)));
            }
        }
    }
    if wrong.is_empty() {
        Ok(())
    } else {
        Err(wrong.join("; "))
    }
}

/// Every outbound cluster's hosts in an Envoy's `/clusters?format=json`, as
/// [`expected_eds`] writes them ("addr:port STATUS", sorted, the EDS status); None while
/// the admin does not answer.
pub fn clusters_eds(admin: &Path) -> Option<BTreeMap<String, Vec<String>>> {
    let (status, body) = admin_get(admin, "/clusters?format=json").ok()?;
    if status != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    Some(
        v["cluster_statuses"]
            .as_array()?
            .iter()
            .filter_map(|c| {
                let name = c["name"]
                    .as_str()
                    .filter(|n| aether_model::is_outbound_cluster(n))?;
                let mut hosts: Vec<String> = hosts(c)
                    .into_iter()
                    .map(|(a, s)| format!("{a} {s}"))
                    .collect();
                hosts.sort();
                Some((name.to_string(), hosts))
            })
            .collect(),
    )
}

/// A `/clusters?format=json` cluster's hosts: ("addr:port", EDS health status).
fn hosts(cluster: &Value) -> Vec<(String, String)> {
    cluster["host_statuses"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|h| {
            let sa = &h["address"]["socket_address"];
            (
                format!(
                    "{}:{}",
                    sa["address"].as_str().unwrap_or("?"),
                    sa["port_value"].as_u64().unwrap_or(0)
                ),
                h["health_status"]["eds_health_status"]
                    .as_str()
                    .unwrap_or("HEALTHY")
                    .to_string(),
            )
        })
        .collect()
}

/// The clusters on which two EDS views differ, each side's endpoints shown.
fn eds_diff(want: &BTreeMap<String, Vec<String>>, got: &BTreeMap<String, Vec<String>>) -> String {
    let mut names: Vec<&String> = want.keys().chain(got.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|n| want.get(*n) != got.get(*n))
        .map(|n| format!("{n}: registrar {:?}, Envoy {:?}", want.get(n), got.get(n)))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eds_diff_names_only_the_clusters_that_differ() {
        let m = |v: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
            v.iter()
                .map(|(k, e)| (k.to_string(), e.iter().map(|s| s.to_string()).collect()))
                .collect()
        };
        let want = m(&[("a", &["1 HEALTHY"]), ("b", &["2 DRAINING"])]);
        let got = m(&[("a", &["1 HEALTHY"]), ("b", &["2 HEALTHY"]), ("c", &[])]);
        assert_eq!(
            eds_diff(&want, &got),
            r#"b: registrar Some(["2 DRAINING"]), Envoy Some(["2 HEALTHY"]), c: registrar None, Envoy Some([])"#
        );
    }
}
