//! CNI ADD latency with and without idle connections held on the worker's listeners:
//! 1,000 on `cni.sock` (HTTP/2 clients that sent their preface and then nothing) plus 100
//! on the metrics port (64 held until the worker's 2 s read timeout and reopened, the
//! rest refused at the cap and reopened). Each ADD runs the real `aether-cni` binary
//! against the worker's CNI server and metrics listener; the proxy is a stand-in that
//! ACKs each snapshot as it is published.
//!
//! Three processes, so that each one's descriptors stay its own: this one spawns the
//! plugins and times them; a child serves as the worker (the CNI server and the metrics
//! listener on one current-thread runtime, as in the worker); another child holds the
//! idle connections. (Spawning a process costs its parent about 0.3 µs per descriptor it
//! holds: 2,000 held by the spawner add some 0.7 ms to every ADD, which is the
//! benchmark's cost, not the worker's.)
//!
//! The runs alternate, in blocks of 50 ADDs: without, with, without, ..., so that drift
//! (CPU frequency, the page cache, other load) falls on both alike, and each pod is
//! deleted again after its ADD (untimed), so that the node stays the same size. Prints
//! the median and p99 with and without side by side, and each block's median. The
//! target: the median with the idle connections within 2 ms of the median without.
//!
//! Run: `cargo bench -p aether-e2e --bench idle-connections` (it builds the plugin for
//! its own profile first). Env: `AETHER_BENCH_ADDS` (ADDs with and without each, default
//! 300), `AETHER_BENCH_STATE_DIR` (default a temp dir under `/var/tmp`),
//! `AETHER_BENCH_IDLE` (`cni` or `metrics` holds only those idle connections, to tell
//! their costs apart; default both).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use aether_e2e::cni_burst;
use aether_e2e::testing::{self, percentile};
use aether_model::Inputs;
use aether_worker::cni::{self, AckSource, CniService, PublishedAcks};
use aether_worker::metrics::{Metrics, SocketLabel};
use aether_worker::node::Node;
use aether_worker::storage::Storage;

const IDLE_CNI: usize = 1000;
const IDLE_METRICS: usize = 100;
/// The metrics port's connection cap (`worker/src/agent.rs::serve_metrics`).
const METRICS_CAP: u64 = 64;
const BLOCK: usize = 50;
/// Which part this process plays: unset for the spawner, `worker` or `hold`.
const ROLE: &str = "AETHER_BENCH_ROLE";

/// The `aether-cni` binary, built for this benchmark's profile (see `add_latency`).
fn plugin_bin() -> PathBuf {
    if std::env::var_os("AETHER_BIN_DIR").is_none() {
        let dir = testing::bin_dir();
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(p) => p.to_string(),
            None => panic!("no profile in the binary folder {}", dir.display()),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "--quiet",
                "--profile",
                &profile,
                "-p",
                "aether-cni",
                "--bin",
                "aether-cni",
            ])
            .current_dir(testing::workspace_root())
            .status()
            .expect("running cargo build for aether-cni");
        assert!(
            status.success(),
            "cargo build -p aether-cni --profile {profile}: {status}"
        );
    }
    testing::bin("aether-cni")
}

/// Makes sure this process may hold `need` descriptors, raising its soft limit to the
/// hard one if it must.
fn raise_nofile(need: u64) {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let mut f = line.split_whitespace().skip(3);
    let (soft, hard): (u64, u64) = match (f.next(), f.next()) {
        (Some(s), Some(h)) => (s.parse().unwrap_or(u64::MAX), h.parse().unwrap_or(u64::MAX)),
        _ => panic!("cannot read {line:?}"),
    };
    assert!(
        hard >= need,
        "this benchmark needs {need} descriptors in one process; the hard limit is {hard}"
    );
    if soft < need {
        let status = Command::new("prlimit")
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

/// The worker process: the CNI server and the metrics listener on one current-thread
/// runtime. It prints `ready <cni.sock> <metrics address>`, then answers each line on
/// stdin with its counters (see [`Stats`]), and at the end of stdin stops, prints
/// `stopped` and exits.
fn worker_main() {
    raise_nofile(IDLE_CNI as u64 + 512);
    let base = std::env::var_os("AETHER_BENCH_STATE_DIR")
        .map(Into::into)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"));
    let dir = tempfile::tempdir_in(&base).expect("temp state dir");
    let socket = dir.path().join("cni.sock");
    let metrics = Metrics::new();
    let storage = Arc::new(
        Storage::open(&dir.path().join("state"), metrics.clone()).expect("opening storage"),
    );
    let node = Node::new(Inputs::default());
    cni::load(&node, &storage);
    let acks: Arc<dyn AckSource> = Arc::new(PublishedAcks(node.clone()));
    let service = CniService::new(node, storage.clone(), acks, metrics.clone());
    let metrics_addr = format!(
        "127.0.0.1:{}",
        testing::free_port([127, 0, 0, 1]).expect("a free port")
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (sock, m, addr) = (
        socket.clone(),
        metrics.clone(),
        metrics_addr.parse().expect("address"),
    );
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&sock).expect("binding the CNI socket");
            tokio::spawn(aether_worker::agent::serve_metrics(addr, m));
            let _ = cni::serve(
                listener,
                service,
                async move {
                    let _ = stopped.await;
                },
                cni::Limits::default(),
            )
            .await;
        });
    });
    testing::wait_for("the metrics port", Duration::from_secs(10), || {
        TcpStream::connect(&metrics_addr).ok()
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready {} {metrics_addr}", socket.display()).expect("stdout");
    out.flush().expect("stdout");
    for line in std::io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
        let gauge = |s: &str| {
            metrics
                .connections
                .get_or_create(&SocketLabel { socket: s.into() })
                .get()
        };
        let refused = metrics
            .connections_refused
            .get_or_create(&SocketLabel {
                socket: "metrics".into(),
            })
            .get();
        let stats = [
            gauge("cni") as u64,
            gauge("metrics") as u64,
            refused,
            storage.pods().len() as u64,
            metrics.cni_ack_timeouts.get(),
        ];
        writeln!(out, "{}", stats.map(|v| v.to_string()).join(" ")).expect("stdout");
        out.flush().expect("stdout");
    }
    let _ = stop.send(());
    let _ = server.join();
    writeln!(out, "stopped").expect("stdout");
}

/// Idle HTTP/2 clients on `cni.sock`: the preface and an empty SETTINGS frame, then
/// nothing (the server's frames stay unread in the socket buffer).
fn idle_cni(socket: &Path) -> Vec<UnixStream> {
    (0..IDLE_CNI)
        .map(|i| {
            let mut c = UnixStream::connect(socket)
                .unwrap_or_else(|e| panic!("idle connection {i} to cni.sock: {e}"));
            c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
                .expect("preface");
            c
        })
        .collect()
}

/// Keeps `IDLE_METRICS` connections open on the metrics port until `stop`: each one the
/// worker closes (its read timeout, or the cap) is opened again, checked every 50 ms;
/// `opened` counts them all.
fn hold_metrics(
    addr: String,
    stop: Arc<AtomicBool>,
    opened: Arc<AtomicU64>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let connect = || {
            let c = TcpStream::connect(&addr).expect("connect the metrics port");
            c.set_nonblocking(true).expect("nonblocking");
            opened.fetch_add(1, Ordering::Relaxed);
            c
        };
        let mut held: Vec<TcpStream> = (0..IDLE_METRICS).map(|_| connect()).collect();
        while !stop.load(Ordering::Relaxed) {
            for c in held.iter_mut() {
                let mut b = [0u8; 1];
                let closed = match c.peek(&mut b) {
                    Ok(n) => n == 0,
                    Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                };
                if closed {
                    *c = connect();
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    })
}

/// The holder process: `AETHER_BENCH_ROLE=hold <cni.sock> <metrics address> <cni|metrics|both>`.
/// It opens its idle connections, prints `ready`, and at the end of stdin prints how many
/// metrics connections it opened in all and exits.
fn hold_main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, metrics, which] = &args[..] else {
        panic!("hold needs <cni.sock> <metrics address> <which>, got {args:?}")
    };
    raise_nofile((IDLE_CNI + IDLE_METRICS) as u64 + 512);
    let cni = if which != "metrics" {
        idle_cni(Path::new(socket))
    } else {
        Vec::new()
    };
    let (stop, opened) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let holder =
        (which != "cni").then(|| hold_metrics(metrics.clone(), stop.clone(), opened.clone()));
    println!("ready");
    let _ = std::io::stdin().lock().lines().count();
    stop.store(true, Ordering::Relaxed);
    if let Some(h) = holder {
        h.join().expect("the metrics holder");
    }
    drop(cni);
    println!("opened {}", opened.load(Ordering::Relaxed));
}

/// A child process of this benchmark, spoken to over its stdin and stdout.
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(role: &str, args: &[&str]) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this benchmark's binary"))
            .env(ROLE, role)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the {role} process: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        Self {
            child,
            stdin,
            stdout,
        }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.stdout
            .read_line(&mut l)
            .expect("reading a child's stdout");
        assert!(!l.is_empty(), "the child process ended early");
        l.trim_end().to_string()
    }

    /// Closes stdin; the last line the child prints, once it has exited.
    fn finish(mut self) -> String {
        drop(self.stdin.take());
        let last = self.line();
        let status = self.child.wait().expect("waiting for a child");
        assert!(status.success(), "a child process failed: {status}");
        last
    }
}

/// The worker's counters.
#[derive(Debug)]
struct Stats {
    open_cni: u64,
    open_metrics: u64,
    refused_metrics: u64,
    pods: u64,
    ack_timeouts: u64,
}

fn stats(worker: &mut Peer) -> Stats {
    writeln!(worker.stdin.as_mut().expect("the worker's stdin"), "stats")
        .expect("asking the worker");
    let v: Vec<u64> = worker
        .line()
        .split(' ')
        .map(|n| n.parse().expect("a counter"))
        .collect();
    Stats {
        open_cni: v[0],
        open_metrics: v[1],
        refused_metrics: v[2],
        pods: v[3],
        ack_timeouts: v[4],
    }
}

fn wait_stats(worker: &mut Peer, what: &str, cond: impl Fn(&Stats) -> bool) {
    testing::wait_for(what, Duration::from_secs(30), || {
        cond(&stats(worker)).then_some(())
    });
}

/// `n` ADDs one after the other, numbered from `first`, each deleted again after it was
/// timed; each ADD's time, plugin start to exit.
async fn adds(bin: &Path, socket: &Path, first: usize, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in first..first + n {
        let (mut env, conf) = cni_burst::add_input(i, socket);
        out.push(
            cni_burst::plugin(bin, &env, conf.as_bytes())
                .await
                .unwrap_or_else(|e| panic!("ADD {i}: {e}")),
        );
        env[0].1 = "DEL".into();
        cni_burst::plugin(bin, &env, conf.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("DEL {i}: {e}"));
    }
    out
}

fn ms(samples: &[Duration], p: f64) -> f64 {
    percentile(samples, p).expect("samples").as_secs_f64() * 1e3
}

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("worker") => worker_main(),
        Ok("hold") => hold_main(),
        _ => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(spawner()),
    }
}

async fn spawner() {
    let n: usize = std::env::var("AETHER_BENCH_ADDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let which = std::env::var("AETHER_BENCH_IDLE")
        .ok()
        .filter(|w| w == "cni" || w == "metrics")
        .unwrap_or_else(|| "both".into());
    let bin = plugin_bin();
    let mut worker = Peer::spawn("worker", &[]);
    let ready = worker.line();
    let [_, socket, metrics_addr] = ready.split(' ').collect::<Vec<_>>()[..] else {
        panic!("the worker said {ready:?}")
    };
    let (socket, metrics_addr) = (PathBuf::from(socket), metrics_addr.to_string());
    // Warm-up: the page cache, the plugin binary, the state folder.
    adds(&bin, &socket, 0, 20).await;

    let (mut without, mut with) = (Vec::new(), Vec::new());
    let (mut medians, mut opened, mut refused) = (Vec::new(), 0u64, 0u64);
    let mut next = 100;
    for b in 0..2 * n.div_ceil(BLOCK) {
        let holder = (b % 2 == 1).then(|| {
            let mut h = Peer::spawn(
                "hold",
                &[socket.to_str().expect("UTF-8 path"), &metrics_addr, &which],
            );
            assert_eq!(h.line(), "ready");
            let (cni, metrics) = (which != "metrics", which != "cni");
            wait_stats(&mut worker, "the idle connections accepted", |s| {
                (!cni || s.open_cni >= IDLE_CNI as u64)
                    && (!metrics || s.open_metrics >= METRICS_CAP)
            });
            h
        });
        let refused_before = stats(&mut worker).refused_metrics;
        let block = adds(&bin, &socket, next, BLOCK).await;
        next += BLOCK;
        medians.push(format!(
            "{} {:.2}",
            if holder.is_some() { "with" } else { "without" },
            ms(&block, 50.0)
        ));
        match holder {
            Some(h) => {
                let s = stats(&mut worker);
                assert!(
                    which == "metrics" || s.open_cni >= IDLE_CNI as u64,
                    "{s:?}: idle connections on cni.sock were closed"
                );
                refused += s.refused_metrics - refused_before;
                with.extend(block);
                let last = h.finish();
                opened += last
                    .strip_prefix("opened ")
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("the holder said {last:?}"));
                wait_stats(&mut worker, "the idle connections closed", |s| {
                    s.open_cni == 0
                });
            }
            None => without.extend(block),
        }
    }
    let s = stats(&mut worker);
    assert_eq!(s.pods, 0, "every pod deleted again");
    assert_eq!(s.ack_timeouts, 0, "every ADD acked at once");
    worker.finish();

    println!(
        "CNI ADD through the plugin, {} with and {} without, in alternating blocks of {BLOCK} (plugin start to answer):",
        with.len(),
        without.len()
    );
    let row = |what: &str, s: &[Duration]| {
        println!(
            "  {what:<58} median {:>6.2} ms  p99 {:>6.2} ms  max {:>6.2} ms",
            ms(s, 50.0),
            ms(s, 99.0),
            ms(s, 100.0)
        )
    };
    row("without idle connections", &without);
    let held = match which.as_str() {
        "cni" => format!("{IDLE_CNI} idle on cni.sock"),
        "metrics" => format!("{IDLE_METRICS} idle on the metrics port"),
        _ => format!("{IDLE_CNI} idle on cni.sock + {IDLE_METRICS} on the metrics port"),
    };
    row(&format!("with {held}"), &with);
    println!("  block medians (ms): {}", medians.join(", "));
    let delta = ms(&with, 50.0) - ms(&without, 50.0);
    println!(
        "median with idle connections: {delta:+.2} ms; target within 2 ms: {}",
        if delta.abs() <= 2.0 { "met" } else { "NOT met" }
    );
    if which != "cni" {
        println!(
            "metrics port during the blocks with them: {METRICS_CAP} held, {refused} refused at the cap, {opened} opened by the holder in all"
        );
    }
}
