//! Steady-state cost of the xDS relay: a service change to Envoy's ACK through
//! `aether-xds-relay` against direct, side by side, at 100 and at 10,000 services; and the
//! relay's memory and CPU.
//!
//! `cargo bench -p aether-e2e --bench relay-overhead` (release profile; the relay binary is
//! built for it first unless `AETHER_BIN_DIR` is set). Needs Envoy (`scripts/install-envoy.sh`
//! or `ENVOY_BIN`). Per size, two rigs of the worker side in-process, each with its own real
//! Envoy over delta ADS: one dialing the server, one through the relay. The changes
//! alternate between them (and which goes first), so the machine's noise falls on both:
//! each change turns one endpoint of one service draining or back through the node's
//! change API, and is timed until the server holds Envoy's ACK of exactly the new
//! snapshot's versions (through the relay, that ACK crossed it). `BENCH_SIZES` (default
//! `100,10000`) and `BENCH_CHANGES` (per rig, default 100) set the run; 10 endpoints a
//! service, as the scale bench. The relay's RSS and peak (`VmRSS`, `VmHWM`) and its CPU time
//! over the changes come from /proc. The last stdout line is one JSON object.

use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, RigOptions, WorkerRig, same_versions};
use aether_e2e::testing::{self, env_usize, mesh_registry_json, mesh_service, percentile};
use aether_model::Change;
use serde_json::{Value, json};

const ENDPOINTS: usize = 10;

fn ms(v: &[Duration], p: f64) -> f64 {
    percentile(v, p).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
}

/// `VmRSS` and `VmHWM` of `pid`, in MiB.
fn rss(pid: i32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib = |key: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
            .unwrap_or(f64::NAN)
    };
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}

/// User plus system CPU time of `pid`, in seconds.
fn cpu(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    // The fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let rest = &stat[stat.rfind(')').expect("stat") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks
        / nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .unwrap()
            .unwrap() as f64
}

/// One change on `rig`: service `touched` with endpoint `draining` draining (or none),
/// timed to Envoy's ACK of the new snapshot.
async fn change(rig: &WorkerRig, touched: usize, draining: Option<usize>) -> Duration {
    let t0 = Instant::now();
    rig.node.apply([Change::UpsertService(mesh_service(
        touched, ENDPOINTS, draining,
    ))]);
    let want = rig.node.snapshot();
    assert!(
        rig.acks
            .wait_until(|s| same_versions(s, &want), Duration::from_secs(10))
            .await,
        "a change to svc {touched} was not ACKed within 10 s"
    );
    t0.elapsed()
}

async fn size(envoy_bin: &std::path::Path, services: usize, changes: usize) -> Value {
    let json = mesh_registry_json(services, ENDPOINTS, None, "");
    let options = |relay| RigOptions {
        api: AdsApi::Delta,
        relay,
        ..RigOptions::default()
    };
    let direct = WorkerRig::start_with(envoy_bin, &json, options(false)).await;
    let relayed = WorkerRig::start_with(envoy_bin, &json, options(true)).await;
    let relay = relayed.relay.as_ref().expect("the relayed rig's relay");
    let pid = relay.pid();
    let (rss0, _) = rss(pid);
    let cpu0 = cpu(pid);
    eprintln!(
        "relay-overhead: {services} services synced (direct {:.0} ms, through the relay {:.0} ms); relay RSS {rss0:.1} MiB",
        direct.envoy_synced.as_secs_f64() * 1e3,
        relayed.envoy_synced.as_secs_f64() * 1e3
    );
    let (mut d, mut r) = (Vec::new(), Vec::new());
    for i in 0..changes {
        // Pairs of changes: one endpoint of a service turns draining, then back.
        let touched = ((i / 2) * 7919) % services;
        let draining = (i % 2 == 0).then_some(i % ENDPOINTS);
        if i % 2 == 0 {
            d.push(change(&direct, touched, draining).await);
            r.push(change(&relayed, touched, draining).await);
        } else {
            r.push(change(&relayed, touched, draining).await);
            d.push(change(&direct, touched, draining).await);
        }
    }
    let (rss1, hwm) = rss(pid);
    let cpu_s = cpu(pid) - cpu0;
    // No switch in steady state: the relay opened one stream to the server all along.
    let streams = relay.metric("aether_relay_upstream_streams_total");
    assert_eq!(streams, Some(1.0), "the relay's upstream streams");
    println!(
        "{services:>6} services, {changes} changes each: change -> ACK median {:.3} ms direct, {:.3} ms through the relay ({:+.3} ms); p99 {:.3} / {:.3} ms",
        ms(&d, 50.0),
        ms(&r, 50.0),
        ms(&r, 50.0) - ms(&d, 50.0),
        ms(&d, 99.0),
        ms(&r, 99.0)
    );
    println!(
        "{services:>6} services: relay RSS {rss0:.1} MiB synced, {rss1:.1} MiB after the changes, peak {hwm:.1} MiB; CPU {:.3} s over the changes ({:.3} ms a change)",
        cpu_s,
        cpu_s * 1e3 / changes as f64
    );
    json!({
        "services": services,
        "changes": changes,
        "direct_median_ms": ms(&d, 50.0),
        "direct_p99_ms": ms(&d, 99.0),
        "relay_median_ms": ms(&r, 50.0),
        "relay_p99_ms": ms(&r, 99.0),
        "median_diff_ms": ms(&r, 50.0) - ms(&d, 50.0),
        "relay_rss_mib": rss1,
        "relay_peak_mib": hwm,
        "relay_cpu_s": cpu_s,
        "relay_upstream_streams": streams,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "relay-overhead: run with `cargo bench -p aether-e2e --bench relay-overhead`; skipping"
        );
        return;
    }
    let Some(envoy_bin) = envoy::envoy_bin() else {
        eprintln!("relay-overhead: no Envoy; run scripts/install-envoy.sh or set ENVOY_BIN");
        std::process::exit(2);
    };
    testing::build_agent_bins();
    envoy::init_logs("warn");
    let changes = env_usize("BENCH_CHANGES", 100).max(10);
    let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
        .unwrap_or_else(|_| "100,10000".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|e| panic!("BENCH_SIZES: {s:?}: {e}"))
        })
        .collect();
    let mut out = Vec::new();
    for services in sizes {
        out.push(size(&envoy_bin, services, changes).await);
    }
    println!("{}", json!({"bench": "relay-overhead", "sizes": out}));
}
