//! ADD latency, plugin start to answer: spawns the real `aether-cni` binary for each ADD
//! against the worker's real CNI service (storage writes with fsync, node update,
//! snapshot build) on a temp unix socket. Two proxies:
//! - `publish-ack`: a stand-in that ACKs each snapshot the moment the node publishes it;
//! - `envoy`: a real Envoy on the worker's ADS server (the xDS tests' [`WorkerRig`]), so each
//!   ADD answers after Envoy has ACKed LDS and CDS holding the pod; once over state of
//!   the world ADS, once over delta ADS, side by side. Without Envoy
//!   (`scripts/install-envoy.sh` or `ENVOY_BIN`) this part says so and is skipped.
//!
//! Prints the median and p99 of each, and of VERSION (process start and exit alone).
//!
//! Run: `cargo bench -p aether-e2e --bench add_latency` (it builds the plugin for its own
//! profile first, with the cargo that runs it). Env: `AETHER_BENCH_ADDS` (default
//! 300); `AETHER_BENCH_STATE_DIR` puts the records on a given filesystem (default a temp
//! dir under `/var/tmp`, disk-backed like `/var/lib/aether`); `AETHER_BENCH_LOG` (a tracing
//! filter, e.g. `aether_worker::xds=debug`) logs the worker to stderr, with the time from
//! each snapshot change to each push and from each push to its ACK.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, WorkerRig};
use aether_e2e::testing::{self, percentile};
use aether_model::Inputs;
use aether_worker::cni::{self, AckSource, CniService, PublishedAcks};
use aether_worker::metrics::Metrics;
use aether_worker::node::Node;
use aether_worker::storage::Storage;
use tokio::io::AsyncWriteExt;

fn report(what: &str, samples: &[Duration]) {
    let ms = |p: f64| percentile(samples, p).expect("samples").as_secs_f64() * 1e3;
    println!(
        "{what}: n={} median={:.2} ms p99={:.2} ms min={:.2} ms max={:.2} ms",
        samples.len(),
        ms(50.0),
        ms(99.0),
        ms(0.0),
        ms(100.0),
    );
}

/// The `aether-cni` binary, built for this benchmark's profile: `cargo bench -p aether-e2e`
/// builds only this package's targets, and the plugin is another package's binary. With
/// `AETHER_BIN_DIR` set, the binary there as it is.
fn plugin_bin() -> PathBuf {
    if std::env::var_os("AETHER_BIN_DIR").is_none() {
        let dir = testing::bin_dir();
        let profile = match dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") => "dev".to_string(),
            Some(p) => p.to_string(),
            None => panic!("no profile in the binary folder {}", dir.display()),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["build", "--quiet", "--profile", &profile, "-p", "aether-cni", "--bin", "aether-cni"])
            .current_dir(testing::workspace_root())
            .status()
            .expect("running cargo build for aether-cni");
        assert!(status.success(), "cargo build -p aether-cni --profile {profile}: {status}");
    }
    testing::bin("aether-cni")
}

async fn plugin(bin: &Path, env: &[(&str, String)], stdin: &[u8]) -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new(bin)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning aether-cni");
    let mut pipe = child.stdin.take().expect("stdin");
    pipe.write_all(stdin).await.expect("writing stdin");
    drop(pipe);
    let out = child.wait_with_output().await.expect("waiting for aether-cni");
    let elapsed = start.elapsed();
    assert!(out.status.success(), "aether-cni failed: {}", String::from_utf8_lossy(&out.stdout));
    elapsed
}

struct Target {
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    acks: Arc<dyn AckSource>,
}

/// Serves the CNI API for `target` and times `n` ADDs of distinct pods through the plugin.
async fn bench_adds(bin: &Path, what: &str, target: Target, n: usize) {
    let base = std::env::var_os("AETHER_BENCH_STATE_DIR")
        .map(Into::into)
        .unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"));
    let dir = tempfile::tempdir_in(&base).expect("temp state dir");
    let socket = dir.path().join("cni.sock");
    let storage = Arc::new(Storage::open(&dir.path().join("state"), target.metrics.clone()).expect("opening storage"));
    cni::load(&target.node, &storage);
    let service = CniService::new(target.node.clone(), storage.clone(), target.acks, target.metrics.clone());
    let listener = tokio::net::UnixListener::bind(&socket).expect("binding the socket");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop_signal = async move {
        let _ = stopped.await;
    };
    let server = tokio::spawn(cni::serve_with(listener, service, stop_signal, cni::DRAIN_BOUND));

    let mut adds = Vec::with_capacity(n);
    for i in 0..n {
        let uid = format!("bench-{i:05}");
        let ip = format!("10.{}.{}.{}", 100 + i / 62500, (i / 250) % 250, i % 250 + 1);
        let env = [
            ("CNI_COMMAND", "ADD".to_string()),
            ("CNI_CONTAINERID", format!("c{i:05}")),
            ("CNI_NETNS", format!("/var/run/netns/bench-{i}")),
            ("CNI_IFNAME", "eth0".into()),
            ("CNI_ARGS", format!("K8S_POD_NAMESPACE=bench;K8S_POD_NAME=p{i};K8S_POD_UID={uid}")),
        ];
        let conf = serde_json::json!({
            "cniVersion": "1.0.0", "name": "bench", "type": "aether-cni", "agentSocket": socket,
            "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}],
                           "ips": [{"address": format!("{ip}/16"), "interface": 0}]}
        })
        .to_string();
        adds.push(plugin(bin, &env, conf.as_bytes()).await);
    }
    assert_eq!(storage.pods().len(), n, "every ADD stored");
    let timeouts = target.metrics.cni_ack_timeouts.get();
    let _ = stop.send(());
    let _ = server.await;
    report(&format!("ADD, {what} (plugin start to answer; ACK timeouts: {timeouts})"), &adds);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("AETHER_BENCH_ADDS").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    if let Ok(filter) = std::env::var("AETHER_BENCH_LOG") {
        envoy::init_logs(&filter);
    }
    let bin = plugin_bin();

    let mut version = Vec::with_capacity(100);
    for _ in 0..100 {
        version.push(plugin(&bin, &[("CNI_COMMAND", "VERSION".into())], b"{}").await);
    }
    report("VERSION (process start to exit)", &version);

    let node = Node::new(Inputs::default());
    let acks: Arc<dyn AckSource> = Arc::new(PublishedAcks(node.clone()));
    bench_adds(&bin, "publish-ack proxy", Target { node, metrics: Metrics::new(), acks }, n).await;

    match envoy::envoy_bin() {
        None => println!("!!! SKIPPED the Envoy part: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN. !!!"),
        Some(envoy) => {
            // Side by side: the same ADDs with Envoy on state-of-the-world ADS (every
            // listener and cluster resent per ADD) and on delta ADS (only the pod's).
            for (api, name) in [(AdsApi::Sotw, "real Envoy, SotW ADS, ACKing LDS+CDS"), (AdsApi::Delta, "real Envoy, delta ADS, ACKing LDS+CDS")] {
                let h = WorkerRig::start(&envoy, &envoy::registry_json(&[]), api).await;
                let target = Target { node: h.node.clone(), metrics: h.metrics.clone(), acks: Arc::new(h.acks.clone()) };
                bench_adds(&bin, name, target, n).await;
            }
        }
    }
}
