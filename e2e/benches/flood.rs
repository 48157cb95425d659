//! Fault matrix row 13 at full size: 100,000 connection attempts and HTTP/2 stream floods
//! on `xds.sock` and `cni.sock` against one agent with a real Envoy, and the latencies of
//! the node's two real clients with and without it (`aether_e2e::flood`). Prints them
//! side by side, with the worker's peak RSS and the refusals per cap, and progress on
//! stderr. The flood lasts until it has made the attempts and the flooded samples are
//! taken, whichever comes last: unpaced, that is millions of attempts.
//!
//! `cargo bench -p aether-e2e --bench flood` (release profile; it builds the agent's
//! binaries for it). Needs Envoy (`scripts/install-envoy.sh` or `ENVOY_BIN`). Env:
//! `AETHER_FLOOD_ATTEMPTS` (default 100,000), `AETHER_FLOOD_SAMPLES` (default 1,000),
//! `AETHER_FLOOD_HELD` (connections held on `cni.sock`, default 1,000),
//! `AETHER_FLOOD_RATE` and `AETHER_FLOOD_STREAM_RATE` (connect-and-close attempts and
//! stream-opening connections a second; default 0, as fast as the flood's threads go),
//! `AETHER_FLOOD_CPU_SHARES` (the flood threads' cgroup `cpu.shares`; default 2, a
//! BestEffort pod's, as a flooding workload runs on a node; 0: in the agent's cgroup).

use aether_e2e::envoy::{self, envoy_or_skip};
use aether_e2e::flood::{self, Config, Report};
use aether_e2e::testing::{build_agent_bins, env_usize};

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and a debug
    // build's figures mean nothing, so do not run then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("flood: run with `cargo bench -p aether-e2e --bench flood`; skipping");
        return;
    }
    let Some(envoy_bin) = envoy_or_skip("the flood benchmark") else {
        std::process::exit(2)
    };
    envoy::init_logs("warn");
    build_agent_bins();
    let cfg = Config {
        attempts: env_usize("AETHER_FLOOD_ATTEMPTS", 100_000) as u64,
        samples: env_usize("AETHER_FLOOD_SAMPLES", 1_000),
        cni_held: env_usize("AETHER_FLOOD_HELD", 1_000),
        churners: 2,
        streamers: 2,
        rate: env_usize("AETHER_FLOOD_RATE", 0) as u64,
        stream_rate: env_usize("AETHER_FLOOD_STREAM_RATE", 0) as u64,
        progress_every: 50_000,
        cpu_shares: match env_usize(
            "AETHER_FLOOD_CPU_SHARES",
            flood::BEST_EFFORT_SHARES as usize,
        ) {
            0 => None,
            s => Some(s as u64),
        },
    };
    println!("flood: {cfg:?}, Envoy {}", envoy_bin.display());
    let r = flood::run(&envoy_bin, &cfg);
    r.print();
    let ratio = |b, f| Report::ms(f, 99.0) / Report::ms(b, 99.0);
    let (add, ack) = (
        ratio(&r.base_add, &r.flood_add),
        ratio(&r.base_ack, &r.flood_ack),
    );
    let verdict = |x: f64| if x <= 2.0 { "within" } else { "OVER" };
    println!(
        "target: flooded p99 <= 2x unflooded: ADD x{add:.2} {}, ACK x{ack:.2} {}; VmHWM <= 256 MiB: {}",
        verdict(add),
        verdict(ack),
        if r.hwm_kib <= 256 * 1024 { "yes" } else { "NO" }
    );
    if !r.failures.is_empty() {
        std::process::exit(1);
    }
}
