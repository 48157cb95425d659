//! Benchmark: the agent's memory on a loaded node.
//!
//! `cargo build --release --workspace --bins && AETHER_BIN_DIR=target/release target/release/bench-memory [PODS]`
//! (default 110 pods; `BENCH_XDS_API=delta` for incremental ADS). A release agent with an
//! embedded registry of 100 services and 1,000 endpoints serves a real Envoy 1.40; PODS
//! pods are added through the real `aether-cni`, and once Envoy's config holds every
//! pod's listener and cluster the supervisor's and the worker's resident memory are read
//! from `/proc/<pid>/status`: `VmRSS` now and `VmHWM`, the peak. Envoy's own is printed
//! for scale. Then a standby is started beside the owner and measured the same way: the
//! surge roll's extra cost on the node.
//!
//! `target/release/bench-memory churn [CHANGES]` (default 300): the worker's memory under
//! registry-file churn, as its own process. A release agent alone serves a registry file
//! of 10,000 services of 10 endpoints (7 MB); the file is then rewritten atomically (a
//! rename) CHANGES times, one endpoint's state each, at most every 0.2 s and each once
//! the agent's `/ready` shows the new snapshot's EDS version. The worker's `VmRSS` is
//! printed at start and after each hundred changes.
//!
//! `target/release/bench-memory kill [ROUNDS]` (default 20): how long a killed worker's
//! streams outlive its SIGKILL. The kernel frees a process's memory before it closes its
//! sockets, so the xDS relay and Envoy see a crashed worker's streams end only after
//! that teardown. A release agent alone serves 10,000 services of 10 endpoints; each round
//! opens an HTTP/2 connection to `xds.sock` that the worker has accepted (its SETTINGS
//! frame read back), kills the worker with SIGKILL and times the connection's end, then
//! waits for the respawned worker. Printed per round: the worker's `Rss` and
//! `AnonHugePages` (`/proc/<pid>/smaps_rollup`), the kill-to-end time, and the time from
//! the kill until the respawned worker serves the mesh on `/ready` (its cold start). The supervisor
//! puts the worker's heap on transparent huge pages (`GLIBC_TUNABLES`, which it passes on
//! when set); `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` in the bench's environment gives
//! glibc's default for a side-by-side run.

use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::Duration;

use aether_e2e::envoy::{AdsApi, Envoy, EnvoyPods, envoy_bin};
use aether_e2e::harness::churn::{self, Cni, Pods};
use aether_e2e::testing::{LocalNode, bin};
use serde_json::json;

const SERVICES: usize = 100;
const ENDPOINTS_PER_SERVICE: usize = 10;

fn row(name: &str, pid: i32) {
    let (rss, hwm) = aether_e2e::testing::memory_kib(pid);
    println!(
        "{name:<22} {:>9.1} {:>9.1}",
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
}

/// The worker's `VmRSS` in MiB.
fn worker_rss(agent: &aether_e2e::testing::Agent) -> f64 {
    aether_e2e::testing::memory_kib(agent.worker_pid()).0 as f64 / 1024.0
}

/// `bench-memory churn [CHANGES]`: see the module's comment.
fn churn(changes: usize) {
    const MESH: usize = 10_000;
    let t = Duration::from_secs(60);
    let mut node = LocalNode::new();
    let registry = node.root.path().join("registry.json");
    let write = |draining: Option<(usize, usize)>| {
        let next = registry.with_extension("json.next");
        std::fs::write(
            &next,
            aether_e2e::testing::mesh_registry_json(MESH, 10, draining, ""),
        )
        .expect("write the registry file");
        std::fs::rename(&next, &registry).expect("rename the registry file into place");
    };
    write(None);
    node.registry_file = Some(registry.clone());
    let agent = node.start_agent();
    agent.wait_role("owner", t);
    let eds = || -> Option<String> {
        let (_, v) = agent.ready()?;
        Some(v["xds_versions"]["endpoints"].as_str()?.to_string())
    };
    let mut version = aether_e2e::testing::wait_for("the first snapshot", t, eds);
    println!("bench-memory churn: {MESH} services x 10 endpoints, {changes} registry-file changes");
    println!("{:<22} {:>9}", "changes", "worker VmRSS (MiB)");
    println!("{:<22} {:>9.1}", 0, worker_rss(&agent));
    let mut last = std::time::Instant::now();
    for c in 1..=changes {
        // One endpoint drains, or stops draining: every change is a new EDS version.
        let draining = (c % 2 == 1).then_some(((c * 7) % MESH, 0));
        let wait = Duration::from_millis(200).saturating_sub(last.elapsed());
        std::thread::sleep(wait);
        last = std::time::Instant::now();
        write(draining);
        let before = version.clone();
        version = aether_e2e::testing::wait_for(&format!("change {c} on /ready"), t, || {
            eds().filter(|v| *v != before)
        });
        if c % 100 == 0 || c == changes {
            println!("{c:<22} {:>9.1}", worker_rss(&agent));
        }
    }
    let (_, hwm) = aether_e2e::testing::memory_kib(agent.worker_pid());
    println!("worker VmHWM {:.1} MiB", hwm as f64 / 1024.0);
}

/// `Rss` and `AnonHugePages` of `pid`, in MiB, from `/proc/<pid>/smaps_rollup`.
fn rss_and_huge(pid: i32) -> (f64, f64) {
    let [rss, huge] =
        aether_e2e::testing::proc_kib(pid, "smaps_rollup", ["Rss:", "AnonHugePages:"]);
    (rss as f64 / 1024.0, huge as f64 / 1024.0)
}

/// `bench-memory kill [ROUNDS]`: see the module's comment.
fn kill(rounds: usize) {
    use std::io::{Read, Write};
    const MESH: usize = 10_000;
    let t = Duration::from_secs(60);
    let mut node = LocalNode::new();
    let registry = node.root.path().join("registry.json");
    std::fs::write(
        &registry,
        aether_e2e::testing::mesh_registry_json(MESH, 10, None, ""),
    )
    .expect("write the registry file");
    node.registry_file = Some(registry);
    let agent = node.start_agent();
    // A worker that serves the mesh, other than `old`: its pid.
    let serving = |old: Option<i32>| {
        aether_e2e::testing::wait_for("a worker serving the mesh", t, || {
            let (status, v) = agent.ready()?;
            let built = v["xds_versions"]["endpoints"]
                .as_str()
                .is_some_and(|e| !e.is_empty());
            let pid = v["pid"].as_i64()? as i32;
            (status == 200 && v["role"] == "owner" && built && Some(pid) != old).then_some(pid)
        })
    };
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_else(|_| "(the supervisor's)".into());
    println!(
        "bench-memory kill: {MESH} services x 10 endpoints, {rounds} worker kills, GLIBC_TUNABLES {tunables}"
    );
    println!(
        "{:<6} {:>9} {:>14} {:>16} {:>18}",
        "round", "Rss MiB", "huge pages MiB", "kill to end ms", "kill to serving ms"
    );
    let mut pid = serving(None);
    let (mut ends, mut respawns) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 1..=rounds {
        let (rss, huge) = rss_and_huge(pid);
        let mut conn = std::os::unix::net::UnixStream::connect(node.xds_sock())
            .unwrap_or_else(|e| panic!("connect {}: {e}", node.xds_sock().display()));
        conn.set_read_timeout(Some(t)).expect("read timeout");
        // The client preface and an empty SETTINGS frame; the worker's SETTINGS frame
        // back shows that the worker, not the listen backlog, holds the connection.
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .expect("write the HTTP/2 preface");
        let mut header = [0u8; 9];
        conn.read_exact(&mut header)
            .expect("the worker's SETTINGS frame");
        assert_eq!(
            header[3], 4,
            "the worker's first frame is SETTINGS: {header:?}"
        );
        let start = std::time::Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap_or_else(|e| panic!("kill worker {pid}: {e}"));
        let mut buf = [0u8; 4096];
        loop {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("waiting for the end of the killed worker's connection: {e}"),
            }
        }
        let end = start.elapsed().as_secs_f64() * 1e3;
        // The respawned worker's cold start: the registry read, the first snapshot.
        pid = serving(Some(pid));
        let respawn = start.elapsed().as_secs_f64() * 1e3;
        println!("{round:<6} {rss:>9.1} {huge:>14.1} {end:>16.2} {respawn:>18.1}");
        ends.push(end);
        respawns.push(respawn);
    }
    for (what, v) in [("kill to end", &ends), ("kill to serving", &respawns)] {
        let q = |p| aether_e2e::testing::percentile(v, p).expect("samples");
        println!(
            "{what}: median {:.2} ms, p90 {:.2} ms, max {:.2} ms ({rounds} kills)",
            q(50.0),
            q(90.0),
            q(100.0)
        );
    }
}

fn main() {
    let first = std::env::args().nth(1);
    if first.as_deref() == Some("kill") {
        let rounds = std::env::args().nth(2).and_then(|s| s.parse().ok());
        return kill(rounds.unwrap_or(20));
    }
    if first.as_deref() == Some("churn") {
        let changes = std::env::args().nth(2).and_then(|s| s.parse().ok());
        return churn(changes.unwrap_or(300));
    }
    let pods_wanted: usize = first.and_then(|s| s.parse().ok()).unwrap_or(110);
    let api: AdsApi = match std::env::var("BENCH_XDS_API") {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}")),
        Err(_) => AdsApi::default(),
    };
    let envoy_path = envoy_bin().expect("no Envoy: run scripts/install-envoy.sh or set ENVOY_BIN");
    let t = Duration::from_secs(30);

    let mut node = LocalNode::new();
    let services: Vec<_> = (0..SERVICES)
        .map(|s| {
            let endpoints: Vec<_> = (0..ENDPOINTS_PER_SERVICE)
                .map(|e| json!({ "address": format!("10.{}.{}.{}", 1 + s / 250, s % 250, 1 + e), "port": 8080, "pod": format!("svc{s}-{e}") }))
                .collect();
            json!({ "name": format!("svc{s}"), "namespace": "bench", "ports": [80], "vip": format!("10.96.{}.{}", s / 250, 1 + s % 250), "endpoints": endpoints })
        })
        .collect();
    let registry = node.root.path().join("registry.json");
    std::fs::write(&registry, json!({ "services": services }).to_string())
        .expect("write the registry file");
    node.registry_file = Some(registry);

    let owner = node.start_agent();
    owner.wait_role("owner", t);
    let dir = node.root.path().join("envoy");
    std::fs::create_dir_all(&dir).expect("envoy dir");
    let envoy = Envoy::start(
        &envoy_path,
        &dir,
        &node.run_dir,
        Duration::from_millis(100),
        Duration::from_secs(1),
        api,
    )
    .expect("start Envoy");
    envoy.wait_connected(t);

    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let pods = Mutex::new(Pods::default());
    for i in 0..pods_wanted {
        churn::add_one(&cni, &pods)
            .unwrap_or_else(|| panic!("ADD {i} failed: {:?}", pods.lock().unwrap().errors));
        if (i + 1) % 50 == 0 {
            eprintln!("bench-memory: {}/{pods_wanted} pods added", i + 1);
        }
    }
    let live: Vec<(String, std::net::IpAddr)> = pods
        .lock()
        .unwrap()
        .live
        .iter()
        .map(|(p, ip): (_, &Ipv4Addr)| (p.uid.clone(), (*ip).into()))
        .collect();
    let want = EnvoyPods::expected(live.iter().map(|(u, ip)| (u, ip)));
    if let Err(seen) = EnvoyPods::wait_until(&envoy, &want, t) {
        panic!("Envoy does not hold every pod: {}", seen.diff(&want));
    }

    println!(
        "bench-memory: {SERVICES} services, {} endpoints, {pods_wanted} pods, ADS {}",
        SERVICES * ENDPOINTS_PER_SERVICE,
        api.api_type()
    );
    println!("{:<22} {:>9} {:>9}", "process (MiB)", "VmRSS", "VmHWM");
    row("owner supervisor", owner.pid());
    row("owner worker", owner.worker_pid());
    let standby = node.start_agent();
    standby.wait_role("standby", t);
    row("standby supervisor", standby.pid());
    row("standby worker", standby.worker_pid());
    row("envoy (for scale)", envoy.pid());
}
