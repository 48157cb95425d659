//! A flood of connection attempts and HTTP/2 streams on `xds.sock` and `cni.sock` (fault
//! matrix row 13), shared by the `flood` test and benchmark.
//!
//! One agent serves a real Envoy on `xds.sock`; the real plugin calls `cni.sock`. The
//! latencies the node's two clients see are measured without the flood (half before it,
//! half after, so that drift falls on both alike) and during it:
//!
//! - Envoy: a registry file change (an endpoint turning draining or healthy) to Envoy's
//!   ACK of its load assignment, timed from the agent's own log ([`ack_log`]);
//! - the plugin: one ADD, the real `aether-cni` process from start to exit (its pod
//!   deleted again, untimed).
//!
//! The flood, until `attempts` connections have been tried and the flooded samples taken:
//! threads that connect and close at once on each socket (some after sending the HTTP/2
//! preface); connections held open on `cni.sock` (under its cap, as a node's worth of
//! idle runtimes would) and cycles that fill `xds.sock` past its cap for a moment and let
//! go; and HTTP/2 connections that each open [`STREAMS_PER_CONNECTION`] streams at once,
//! past both sockets' stream caps; [`Config::rate`] paces the connecting threads. At the end one probe fills `cni.sock` past its cap
//! too, out of the measurement: a flood that held every slot of `cni.sock` would keep
//! the plugin out until it let go, which is what the cap is for.

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use crate::envoy::ack_log::{self, AgentLog};
use crate::envoy::{AdsApi, Envoy};
use crate::harness::churn::{Cni, PodId};
use crate::testing::{
    Agent, LocalNode, bin, memory_kib, metric_sample, percentile, scrape_metrics, wait_for,
};

/// Agent start, Envoy's first connect, a metrics sample.
const T: Duration = Duration::from_secs(30);
/// Streams each flooding HTTP/2 connection opens at once: past both stream caps (ADS 16,
/// CNI 64 per connection).
pub const STREAMS_PER_CONNECTION: u32 = 100;
/// `xds.sock`'s connection cap (`worker/src/xds/server.rs`, `MAX_CONNECTIONS`).
pub const XDS_CAP: usize = 64;
/// `cni.sock`'s connection cap (`worker/src/cni/mod.rs`, `MAX_CONNECTIONS`).
pub const CNI_CAP: usize = 2048;
/// The descriptor limit the agent runs under: the systemd unit's `LimitNOFILE`.
const AGENT_NOFILE: u32 = 8192;
/// The agent's log filter: the ADS server's push and ACK lines time Envoy's ACKs.
const AGENT_LOG: &str = ack_log::AGENT_LOG;
const ADS_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const CNI_ADD_PATH: &str = "/aether.cni.v1.Cni/Add";

/// How big a flood, and how many samples.
#[derive(Debug, Clone)]
pub struct Config {
    /// Connection attempts on the two sockets together, at least.
    pub attempts: u64,
    /// Samples of each latency without the flood (half before, half after) and at least
    /// as many during it.
    pub samples: usize,
    /// Connections held open on `cni.sock` during the flood.
    pub cni_held: usize,
    /// Threads connecting and closing, per socket.
    pub churners: usize,
    /// Threads opening HTTP/2 streams, per socket.
    pub streamers: usize,
    /// Connection attempts per second of the connect-and-close threads together; 0: as
    /// fast as they go, which on a small machine also takes the CPU the worker, Envoy and
    /// the plugin need.
    pub rate: u64,
    /// Connections per second of the stream-opening threads together (each opens
    /// [`STREAMS_PER_CONNECTION`] streams); 0: as fast as they go.
    pub stream_rate: u64,
    /// A line on stderr every this many attempts (0: none).
    pub progress_every: u64,
    /// The CPU weight of the flood's threads (cgroup v1 `cpu.shares`; the agent, Envoy
    /// and the plugin keep the default 1,024), or None to leave them beside the agent.
    /// On a node, a pod with no CPU request runs in kubelet's BestEffort cgroup, whose
    /// `cpu.shares` is 2 ([`BEST_EFFORT_SHARES`]): that is where a flooding workload sits.
    pub cpu_shares: Option<u64>,
}

/// kubelet's `cpu.shares` for BestEffort pods (`MinShares` in kubelet's cgroup manager).
pub const BEST_EFFORT_SHARES: u64 = 2;

/// A cgroup v1 `cpu` group of its own for the flood's threads, removed when dropped.
struct CpuGroup {
    path: PathBuf,
}

impl CpuGroup {
    const ROOT: &str = "/sys/fs/cgroup/cpu";

    fn new(shares: u64) -> CpuGroup {
        let path = Path::new(Self::ROOT).join(format!("aether-flood-{}", std::process::id()));
        let made = std::fs::create_dir(&path)
            .and_then(|()| std::fs::write(path.join("cpu.shares"), shares.to_string()));
        if let Err(e) = made {
            panic!(
                "the flood's cgroup {} (cgroup v1 cpu controller, as root): {e}; set cpu_shares to None to flood without it",
                path.display()
            );
        }
        CpuGroup { path }
    }

    /// Moves the calling thread into the group.
    fn join(&self) {
        let tid = nix::unistd::gettid().as_raw();
        let tasks = self.path.join("tasks");
        std::fs::write(&tasks, tid.to_string())
            .unwrap_or_else(|e| panic!("moving thread {tid} into {}: {e}", tasks.display()));
    }
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        // Its threads have exited (Flood::stop joins them), so the group is empty.
        if let Err(e) = std::fs::remove_dir(&self.path) {
            eprintln!("removing the flood's cgroup {}: {e}", self.path.display());
        }
    }
}

/// What one socket's flood saw from the client side.
#[derive(Debug, Default)]
pub struct SocketCounts {
    pub attempts: AtomicU64,
    /// Connections closed by the worker before any byte (past the connection cap).
    pub closed_at_once: AtomicU64,
    pub streams_opened: AtomicU64,
    /// RST_STREAM with REFUSED_STREAM: streams past the per-connection cap.
    pub streams_refused: AtomicU64,
    /// Connections the worker ended with GOAWAY.
    pub goaways: AtomicU64,
}

impl SocketCounts {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Everything a run measured.
#[derive(Debug)]
pub struct Report {
    pub base_add: Vec<Duration>,
    pub flood_add: Vec<Duration>,
    pub base_ack: Vec<Duration>,
    pub flood_ack: Vec<Duration>,
    /// Calls and changes that failed, with or without the flood.
    pub failures: Vec<String>,
    pub xds: SocketCounts,
    pub cni: SocketCounts,
    pub flood_time: Duration,
    /// The worker's VmHWM before the flood and at the end, KiB.
    pub hwm_before_kib: u64,
    pub hwm_kib: u64,
    /// `aether_connections_refused_total{socket}` at the end, by socket.
    pub refused_xds: f64,
    pub refused_cni: f64,
    /// `aether_connections_rate_limited_total{socket}` at the end, by socket: connections
    /// closed at once because the flooding process was past its connection rate.
    pub rate_limited_xds: f64,
    pub rate_limited_cni: f64,
    /// `aether_accept_errors_total`, all sockets and kinds, at the end.
    pub accept_errors: f64,
    /// Whether the same worker served throughout.
    pub same_worker: bool,
    /// [`Config::rate`] and [`Config::stream_rate`].
    pub rate: u64,
    pub stream_rate: u64,
    /// [`Config::cpu_shares`].
    pub cpu_shares: Option<u64>,
}

fn rate(r: u64) -> String {
    if r == 0 {
        "no rate (as fast as the threads go)".into()
    } else {
        format!("{r}/s")
    }
}

impl Report {
    /// Percentile `p` of `v` in milliseconds.
    pub fn ms(v: &[Duration], p: f64) -> f64 {
        percentile(v, p).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    }

    /// The figures side by side.
    pub fn print(&self) {
        let row = |name: &str, base: &[Duration], flood: &[Duration]| {
            println!(
                "{name:<28} unflooded n={:<4} p50 {:>8.2} ms  p99 {:>8.2} ms | flooded n={:<4} p50 {:>8.2} ms  p99 {:>8.2} ms | p99 x{:.2}",
                base.len(),
                Self::ms(base, 50.0),
                Self::ms(base, 99.0),
                flood.len(),
                Self::ms(flood, 50.0),
                Self::ms(flood, 99.0),
                Self::ms(flood, 99.0) / Self::ms(base, 99.0)
            );
        };
        row("plugin ADD", &self.base_add, &self.flood_add);
        row(
            "registry change -> Envoy ACK",
            &self.base_ack,
            &self.flood_ack,
        );
        let attempts =
            SocketCounts::get(&self.xds.attempts) + SocketCounts::get(&self.cni.attempts);
        println!(
            "flood: {attempts} connection attempts in {:.1} s ({:.0}/s; connect-and-close paced at {}, stream connections at {}; flood threads' CPU weight: {}); worker VmHWM {:.1} MiB before, {:.1} MiB after; same worker throughout: {}",
            self.flood_time.as_secs_f64(),
            attempts as f64 / self.flood_time.as_secs_f64(),
            rate(self.rate),
            rate(self.stream_rate),
            self.cpu_shares
                .map_or("the agent's (same cgroup)".to_string(), |s| format!(
                    "cpu.shares {s} against 1,024"
                )),
            self.hwm_before_kib as f64 / 1024.0,
            self.hwm_kib as f64 / 1024.0,
            self.same_worker
        );
        for (name, c, refused, limited) in [
            (
                "xds.sock",
                &self.xds,
                self.refused_xds,
                self.rate_limited_xds,
            ),
            (
                "cni.sock",
                &self.cni,
                self.refused_cni,
                self.rate_limited_cni,
            ),
        ] {
            println!(
                "{name}: {} attempts, {} closed at once by the client's count; by the worker's, {} at the connection cap and {} past the flooding process's rate; {} streams opened, {} refused (REFUSED_STREAM), {} GOAWAYs",
                SocketCounts::get(&c.attempts),
                SocketCounts::get(&c.closed_at_once),
                refused,
                limited,
                SocketCounts::get(&c.streams_opened),
                SocketCounts::get(&c.streams_refused),
                SocketCounts::get(&c.goaways)
            );
        }
        println!(
            "accept errors (aether_accept_errors_total, all kinds): {}; failed calls and changes: {}",
            self.accept_errors,
            self.failures.len()
        );
        for f in self.failures.iter().take(10) {
            println!("  failed: {f}");
        }
    }
}

/// One agent with its metrics on a free port and the ADS log lines on, a registry file
/// with one service, and a real Envoy on its `xds.sock`.
struct Rig {
    envoy: Envoy,
    agent: Agent,
    node: LocalNode,
    metrics: String,
    registry: PathBuf,
    draining: bool,
}

impl Rig {
    fn start(envoy_bin: &Path) -> Rig {
        // Free ports for Envoy's capture listeners, so that runs in parallel do not clash,
        // and for the agent's metrics.
        let mut node = LocalNode::builder()
            .capture()
            .metrics()
            .build()
            .expect("node folder");
        let root = node.root.path().to_path_buf();
        let registry = root.join("registry.json");
        std::fs::write(&registry, registry_doc(false)).expect("registry file");
        node.registry_file = Some(registry.clone());
        let metrics = node.metrics.expect("a metrics address").to_string();
        // Its log filter the ADS lines, and its descriptor limit the systemd unit's.
        let (log, nofile) = (
            format!("RUST_LOG={AGENT_LOG}"),
            format!("--nofile={AGENT_NOFILE}:{AGENT_NOFILE}"),
        );
        let wrapper = ["env", &log, "prlimit", &nofile];
        let agent = node.start_agent_wrapped(&wrapper, &[]);
        wait_for(&format!("{} to serve as owner", agent.name), T, || {
            agent.serving_owner()
        });
        wait_for("the owner's metrics port", T, || scrape_metrics(&metrics));
        let envoy = Envoy::start(
            envoy_bin,
            &root,
            &node.run_dir,
            Duration::from_millis(100),
            Duration::from_secs(1),
            AdsApi::default(),
        )
        .expect("start Envoy");
        envoy.wait_connected(T);
        Rig {
            envoy,
            agent,
            node,
            metrics,
            registry,
            draining: false,
        }
    }

    /// Flips the endpoint and times the change to Envoy's ACK of its load assignment.
    fn change(&mut self, log: &mut AgentLog) -> Result<Duration, String> {
        self.draining = !self.draining;
        let tmp = self.registry.with_extension("json.tmp");
        log.skip_to_end();
        let t0 = SystemTime::now();
        std::fs::write(&tmp, registry_doc(self.draining))
            .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &self.registry)
            .map_err(|e| format!("renaming to {}: {e}", self.registry.display()))?;
        let ex = log
            .wait(
                "Envoy's ACK of the changed load assignment",
                Duration::from_secs(10),
            )
            .map_err(|e| format!("{e:#}"))?;
        Ok(ack_log::since(t0, ex.acked))
    }
}

fn registry_doc(draining: bool) -> String {
    let state = if draining { "draining" } else { "healthy" };
    json!({ "services": [{ "name": "web", "namespace": "default", "ports": [80], "endpoints": [
        { "address": "127.0.0.1", "port": 9, "state": state },
        { "address": "127.0.0.1", "port": 10, "state": "healthy" },
    ]}]})
    .to_string()
}

/// The sum of every sample of metric `name` in `text`.
fn sum(text: &str, name: &str) -> f64 {
    // 0.0 + : an empty float sum is -0.0.
    0.0 + text
        .lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
}

/// Raises this process's soft descriptor limit to its hard one if it is under `need`.
fn raise_nofile(need: u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files in /proc/self/limits");
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(3)
        .take(2)
        .map(|v| v.parse().unwrap_or(u64::MAX))
        .collect();
    let (soft, hard) = (f[0], f[1]);
    assert!(
        hard >= need,
        "the flood needs {need} descriptors in this process; the hard limit is {hard}"
    );
    if soft < need {
        let status = std::process::Command::new("prlimit")
            .args([
                "--pid",
                &std::process::id().to_string(),
                &format!("--nofile={hard}:{hard}"),
            ])
            .status()
            .expect("running prlimit");
        assert!(status.success(), "prlimit --nofile={hard}: {status}");
    }
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;
const FRAME_SETTINGS: u8 = 0x4;
const FRAME_GOAWAY: u8 = 0x7;
const REFUSED_STREAM: u32 = 0x7;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A gRPC request's headers for `path`, HPACK without the dynamic table or Huffman.
fn grpc_headers(path: &str) -> Vec<u8> {
    let mut h = vec![0x83, 0x86]; // :method POST, :scheme http (static table)
    let literal = |h: &mut Vec<u8>, value: &str| {
        h.push(value.len() as u8);
        h.extend_from_slice(value.as_bytes());
    };
    h.push(0x04); // :path, literal value, not indexed
    literal(&mut h, path);
    h.push(0x01); // :authority
    literal(&mut h, "localhost");
    for (name, value) in [("content-type", "application/grpc"), ("te", "trailers")] {
        h.push(0x00);
        literal(&mut h, name);
        literal(&mut h, value);
    }
    h
}

/// Reads frames until `want` streams were refused, the connection ended, or a quiet
/// 500 ms: (streams refused, a GOAWAY came, any byte came).
fn read_refusals(conn: &mut UnixStream, want: u64) -> (u64, bool, bool) {
    let _ = conn.set_read_timeout(Some(Duration::from_millis(500)));
    let (mut refused, mut any) = (0, false);
    let mut header = [0u8; 9];
    while refused < want {
        if conn.read_exact(&mut header).is_err() {
            return (refused, false, any);
        }
        any = true;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0u8; len];
        if conn.read_exact(&mut payload).is_err() {
            return (refused, false, any);
        }
        match header[3] {
            FRAME_RST_STREAM
                if payload.len() == 4
                    && u32::from_be_bytes(payload[..4].try_into().unwrap_or_default())
                        == REFUSED_STREAM =>
            {
                refused += 1
            }
            FRAME_GOAWAY => return (refused, true, any),
            _ => {}
        }
    }
    (refused, false, any)
}

/// One HTTP/2 connection that opens [`STREAMS_PER_CONNECTION`] streams at once and
/// counts the refusals; past `cap` streams all but `cap` should be refused.
fn streams_once(path: &Path, request: &[u8], cap: u32, counts: &SocketCounts) {
    counts.attempts.fetch_add(1, Ordering::Relaxed);
    let Ok(mut conn) = UnixStream::connect(path) else {
        return;
    };
    let mut out = PREFACE.to_vec();
    out.extend(frame(FRAME_SETTINGS, 0, 0, &[]));
    for i in 0..STREAMS_PER_CONNECTION {
        out.extend(frame(FRAME_HEADERS, 0x4, 1 + 2 * i, request));
    }
    if conn.write_all(&out).is_err() {
        counts.closed_at_once.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let want = u64::from(STREAMS_PER_CONNECTION.saturating_sub(cap));
    let (refused, goaway, any) = read_refusals(&mut conn, want);
    if !any {
        counts.closed_at_once.fetch_add(1, Ordering::Relaxed);
        return;
    }
    counts.streams_opened.fetch_add(
        u64::from(STREAMS_PER_CONNECTION) - refused,
        Ordering::Relaxed,
    );
    counts.streams_refused.fetch_add(refused, Ordering::Relaxed);
    if goaway {
        counts.goaways.fetch_add(1, Ordering::Relaxed);
    }
}

/// Connect and close at once; every fourth sends the HTTP/2 preface first.
fn churn_once(path: &Path, n: u64, counts: &SocketCounts) {
    counts.attempts.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut c) = UnixStream::connect(path)
        && n.is_multiple_of(4)
    {
        let _ = c.write_all(PREFACE);
    }
}

/// Paces one thread at `per_thread` attempts a second (none when 0): sleeps until its
/// next slot, which holds the flood's rate, not a wait for anything.
struct Pace {
    every: Option<Duration>,
    next: Instant,
}

impl Pace {
    fn new(per_thread: f64) -> Pace {
        Pace {
            every: (per_thread > 0.0).then(|| Duration::from_secs_f64(1.0 / per_thread)),
            next: Instant::now(),
        }
    }

    fn wait(&mut self) {
        let Some(every) = self.every else { return };
        let now = Instant::now();
        if self.next > now {
            std::thread::sleep(self.next - now);
        }
        // A thread that fell behind does not burst to catch up.
        self.next = self.next.max(now) + every;
    }
}

/// The flood's threads; they stop when `stop` is set.
struct Flood {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Dropped after the threads are joined.
    _group: Option<Arc<CpuGroup>>,
}

impl Flood {
    fn start(
        node: &LocalNode,
        cfg: &Config,
        xds: Arc<SocketCounts>,
        cni: Arc<SocketCounts>,
    ) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let group = cfg.cpu_shares.map(|shares| Arc::new(CpuGroup::new(shares)));
        let churn_pace = cfg.rate as f64 / (2 * cfg.churners).max(1) as f64;
        let stream_pace = cfg.stream_rate as f64 / (2 * cfg.streamers).max(1) as f64;
        let mut spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            let group = group.clone();
            let f = move || {
                if let Some(g) = group {
                    g.join();
                }
                f()
            };
            threads.push(
                std::thread::Builder::new()
                    .name(name)
                    .spawn(f)
                    .expect("spawn a flood thread"),
            );
        };
        for (sock, counts, cap, request) in [
            (node.xds_sock(), xds.clone(), 16, grpc_headers(ADS_PATH)),
            (node.cni_sock(), cni.clone(), 64, grpc_headers(CNI_ADD_PATH)),
        ] {
            let name = sock
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            for i in 0..cfg.churners {
                let (sock, counts, stop) = (sock.clone(), counts.clone(), stop.clone());
                spawn(
                    format!("churn-{name}-{i}"),
                    Box::new(move || {
                        let (mut n, mut pace) = (0u64, Pace::new(churn_pace));
                        while !stop.load(Ordering::Relaxed) {
                            pace.wait();
                            n += 1;
                            churn_once(&sock, n, &counts);
                        }
                    }),
                );
            }
            for i in 0..cfg.streamers {
                let (sock, counts, stop, request) =
                    (sock.clone(), counts.clone(), stop.clone(), request.clone());
                spawn(
                    format!("streams-{name}-{i}"),
                    Box::new(move || {
                        let mut pace = Pace::new(stream_pace);
                        while !stop.load(Ordering::Relaxed) {
                            pace.wait();
                            streams_once(&sock, &request, cap, &counts);
                        }
                    }),
                );
            }
        }
        // cni.sock: connections held open under the cap, as idle runtimes would hold them.
        let (sock, counts, stop2, held) =
            (node.cni_sock(), cni.clone(), stop.clone(), cfg.cni_held);
        spawn(
            "hold-cni".into(),
            Box::new(move || {
                let conns: Vec<UnixStream> = (0..held)
                    .filter_map(|_| {
                        counts.attempts.fetch_add(1, Ordering::Relaxed);
                        let mut c = UnixStream::connect(&sock).ok()?;
                        c.write_all(PREFACE).ok()?;
                        Some(c)
                    })
                    .collect();
                while !stop2.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                drop(conns);
            }),
        );
        // xds.sock: past its cap for 300 ms, then let go for 300 ms, over and over. These
        // are the stated durations of each state, not waits for anything.
        let (sock, counts, stop3) = (node.xds_sock(), xds.clone(), stop.clone());
        spawn(
            "hold-xds".into(),
            Box::new(move || {
                while !stop3.load(Ordering::Relaxed) {
                    let conns: Vec<UnixStream> = (0..XDS_CAP + 16)
                        .filter_map(|_| {
                            counts.attempts.fetch_add(1, Ordering::Relaxed);
                            UnixStream::connect(&sock).ok()
                        })
                        .collect();
                    std::thread::sleep(Duration::from_millis(300));
                    drop(conns);
                    std::thread::sleep(Duration::from_millis(300));
                }
            }),
        );
        Flood {
            stop,
            threads,
            _group: group,
        }
    }

    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("a flood thread panicked");
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One measured round: an ADD through the plugin (timed), its DEL (untimed), and a
/// registry change to Envoy's ACK (timed).
fn round(
    rig: &mut Rig,
    cni: &Cni,
    log: &mut AgentLog,
    i: usize,
    adds: &mut Vec<Duration>,
    acks: &mut Vec<Duration>,
    failures: &mut Vec<String>,
) {
    let pod = PodId {
        uid: format!("flood-{i:05}"),
        name: format!("flood-{i}"),
    };
    let ip = Ipv4Addr::new(10, 88, (1 + i / 250) as u8, (1 + i % 250) as u8);
    let t = Instant::now();
    match cni.call("ADD", &pod, Some(ip)) {
        Ok(()) => adds.push(t.elapsed()),
        Err(e) => failures.push(format!("ADD {}: {e}", pod.uid)),
    }
    if let Err(e) = cni.call("DEL", &pod, None) {
        failures.push(format!("DEL {}: {e}", pod.uid));
    }
    match rig.change(log) {
        Ok(d) => acks.push(d),
        Err(e) => failures.push(format!("registry change {i}: {e}")),
    }
}

/// Runs the whole thing against a fresh agent and Envoy.
pub fn run(envoy_bin: &Path, cfg: &Config) -> Report {
    raise_nofile((cfg.cni_held + CNI_CAP + XDS_CAP + 1024) as u64);
    let mut rig = Rig::start(envoy_bin);
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: rig.node.cni_sock(),
    };
    let mut log = AgentLog::new(&rig.agent.log_path);
    let worker = rig.agent.worker_pid();
    let (mut base_add, mut base_ack, mut flood_add, mut flood_ack, mut failures) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut i = 0;
    let half = cfg.samples.div_ceil(2);
    for _ in 0..half {
        i += 1;
        round(
            &mut rig,
            &cni,
            &mut log,
            i,
            &mut base_add,
            &mut base_ack,
            &mut failures,
        );
    }
    let hwm_before_kib = memory_kib(worker).1;

    let (xds, cni_counts) = (
        Arc::new(SocketCounts::default()),
        Arc::new(SocketCounts::default()),
    );
    let flood = Flood::start(&rig.node, cfg, xds.clone(), cni_counts.clone());
    let started = Instant::now();
    let attempts = || SocketCounts::get(&xds.attempts) + SocketCounts::get(&cni_counts.attempts);
    let mut next_progress = cfg.progress_every;
    let mut flooded = 0;
    while flooded < cfg.samples || attempts() < cfg.attempts {
        i += 1;
        flooded += 1;
        round(
            &mut rig,
            &cni,
            &mut log,
            i,
            &mut flood_add,
            &mut flood_ack,
            &mut failures,
        );
        if cfg.progress_every > 0 && attempts() >= next_progress {
            eprintln!(
                "flood: {} attempts in {:.1} s, {flooded} rounds measured, worker VmRSS {:.1} MiB",
                attempts(),
                started.elapsed().as_secs_f64(),
                memory_kib(worker).0 as f64 / 1024.0
            );
            next_progress = (attempts() / cfg.progress_every + 1) * cfg.progress_every;
        }
    }
    flood.stop();
    let flood_time = started.elapsed();

    // cni.sock past its cap, out of the measurement: every slot taken, and more. This
    // process spent its connection rate in the flood, so most of these are closed for
    // that; either way none is held past the cap.
    let closed_at_once = |t: &str| {
        [
            "aether_connections_refused_total{socket=\"cni\"}",
            "aether_connections_rate_limited_total{socket=\"cni\"}",
        ]
        .iter()
        .map(|m| metric_sample(t, m).unwrap_or(0.0))
        .sum::<f64>()
    };
    let before = wait_for("the owner's metrics", T, || scrape_metrics(&rig.metrics));
    let probe: Vec<UnixStream> = (0..CNI_CAP + 16)
        .filter_map(|_| {
            cni_counts.attempts.fetch_add(1, Ordering::Relaxed);
            UnixStream::connect(rig.node.cni_sock()).ok()
        })
        .collect();
    wait_for(
        "cni.sock's probe connections past the cap closed and counted",
        T,
        || {
            scrape_metrics(&rig.metrics)
                .filter(|t| closed_at_once(t) >= closed_at_once(&before) + 16.0)
        },
    );
    drop(probe);
    wait_for("cni.sock's connections closed", T, || {
        scrape_metrics(&rig.metrics)
            .and_then(|t| metric_sample(&t, "aether_connections{socket=\"cni\"}"))
            .filter(|v| *v < 16.0)
    });

    for _ in 0..half {
        i += 1;
        round(
            &mut rig,
            &cni,
            &mut log,
            i,
            &mut base_add,
            &mut base_ack,
            &mut failures,
        );
    }
    let text = wait_for("the owner's metrics", T, || scrape_metrics(&rig.metrics));
    let same_worker =
        rig.agent.serving_owner().and_then(|v| v["pid"].as_i64()) == Some(i64::from(worker));
    let hwm_kib = memory_kib(worker).1;
    let report = Report {
        base_add,
        flood_add,
        base_ack,
        flood_ack,
        failures,
        xds: Arc::try_unwrap(xds).unwrap_or_default(),
        cni: Arc::try_unwrap(cni_counts).unwrap_or_default(),
        flood_time,
        hwm_before_kib,
        hwm_kib,
        refused_xds: metric_sample(&text, "aether_connections_refused_total{socket=\"xds\"}")
            .unwrap_or(0.0),
        refused_cni: metric_sample(&text, "aether_connections_refused_total{socket=\"cni\"}")
            .unwrap_or(0.0),
        rate_limited_xds: metric_sample(
            &text,
            "aether_connections_rate_limited_total{socket=\"xds\"}",
        )
        .unwrap_or(0.0),
        rate_limited_cni: metric_sample(
            &text,
            "aether_connections_rate_limited_total{socket=\"cni\"}",
        )
        .unwrap_or(0.0),
        accept_errors: sum(&text, "aether_accept_errors_total"),
        same_worker,
        rate: cfg.rate,
        stream_rate: cfg.stream_rate,
        cpu_shares: cfg.cpu_shares,
    };
    if !rig.envoy.alive() {
        panic!("Envoy exited; log {}", rig.envoy.log.display());
    }
    report
}
