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
//! Run: `cargo bench -p aether-e2e --bench add_latency` (it first builds the plugin as it
//! ships, statically linked: `scripts/build-cni-plugin.sh`). Env: `AETHER_BENCH_ADDS` (default
//! 300); `AETHER_BENCH_STATE_DIR` puts the records on a given filesystem (default a temp
//! dir under `/var/tmp`, disk-backed like `/var/lib/aether`); `AETHER_BENCH_LOG` (a tracing
//! filter, e.g. `aether_worker::xds=debug`) logs the worker to stderr, with the time from
//! each snapshot change to each push and from each push to its ACK.
//! `AETHER_BENCH_BURST=1000` runs the burst instead: `AETHER_BENCH_ADDS` pods added one
//! at a time, then that many ADDs at once, with a real Envoy over delta ADS; it prints the
//! burst's total time, the per-call median and p99, and the snapshots published.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use aether_e2e::cni_burst;
use aether_e2e::envoy::{self, AdsApi, WorkerRig};
use aether_e2e::testing::{self, percentile};
use aether_model::Inputs;
use aether_worker::cni::{self, AckSource, CniService, PublishedAcks};
use aether_worker::metrics::Metrics;
use aether_worker::node::Node;
use aether_worker::storage::Storage;

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

/// The `aether-cni` binary as it ships, statically linked with the `cni-plugin` profile:
/// the runtime starts it for every ADD, so its start is part of what is measured.
/// `scripts/build-cni-plugin.sh` builds it and prints its path. With `AETHER_BIN_DIR`
/// set, the binary there as it is.
fn plugin_bin() -> PathBuf {
    if std::env::var_os("AETHER_BIN_DIR").is_some() {
        return testing::bin("aether-cni");
    }
    let script = testing::workspace_root().join("scripts/build-cni-plugin.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(out.status.success(), "{}: {}", script.display(), out.status);
    let path = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(
        path.lines()
            .last()
            .unwrap_or_else(|| panic!("{} printed no path", script.display())),
    )
}

async fn plugin(bin: &Path, env: &[(&str, String)], stdin: &[u8]) -> Duration {
    cni_burst::plugin(bin, env, stdin)
        .await
        .unwrap_or_else(|e| panic!("aether-cni failed: {e}"))
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
    let storage = Arc::new(
        Storage::open(&dir.path().join("state"), target.metrics.clone()).expect("opening storage"),
    );
    cni::load(&target.node, &storage);
    let service = CniService::new(
        target.node.clone(),
        storage.clone(),
        target.acks,
        target.metrics.clone(),
    );
    let listener = tokio::net::UnixListener::bind(&socket).expect("binding the socket");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop_signal = async move {
        let _ = stopped.await;
    };
    let server = tokio::spawn(cni::serve(
        listener,
        service,
        stop_signal,
        cni::Limits::default(),
    ));

    let mut adds = Vec::with_capacity(n);
    for i in 0..n {
        let (env, conf) = cni_burst::add_input(i, &socket);
        adds.push(plugin(bin, &env, conf.as_bytes()).await);
    }
    assert_eq!(storage.pods().len(), n, "every ADD stored");
    let timeouts = target.metrics.cni_ack_timeouts.get();
    let _ = stop.send(());
    let _ = server.await;
    report(
        &format!("ADD, {what} (plugin start to answer; ACK timeouts: {timeouts})"),
        &adds,
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("AETHER_BENCH_ADDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let burst: usize = std::env::var("AETHER_BENCH_BURST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
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
    bench_adds(
        &bin,
        "publish-ack proxy",
        Target {
            node,
            metrics: Metrics::new(),
            acks,
        },
        n,
    )
    .await;

    match envoy::envoy_bin() {
        None => println!(
            "!!! SKIPPED the Envoy part: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN. !!!"
        ),
        Some(envoy) if burst > 0 => {
            // A burst of concurrent ADDs on a node that already has `n` pods.
            let h = WorkerRig::start(&envoy, &envoy::registry_json(&[]), AdsApi::Delta).await;
            let b = cni_burst::run(&bin, &h, n, burst).await;
            assert!(
                b.failures.is_empty(),
                "{} ADDs failed, first: {:?}",
                b.failures.len(),
                b.failures.first()
            );
            report(
                &format!(
                    "burst of {burst} concurrent ADDs at {n} pods, real Envoy, delta ADS, per call"
                ),
                &b.calls,
            );
            println!(
                "burst of {burst} concurrent ADDs at {n} pods: {:.0} ms in all, {} snapshots published, every pod in Envoy {:.1} ms after the last answer",
                b.total.as_secs_f64() * 1e3,
                b.snapshots,
                b.all_in_envoy
                    .expect("every pod reached Envoy")
                    .as_secs_f64()
                    * 1e3
            );
        }
        Some(envoy) => {
            // Side by side: the same ADDs with Envoy on state-of-the-world ADS (every
            // listener and cluster resent per ADD) and on delta ADS (only the pod's).
            for (api, name) in [
                (AdsApi::Sotw, "real Envoy, SotW ADS, ACKing LDS+CDS"),
                (AdsApi::Delta, "real Envoy, delta ADS, ACKing LDS+CDS"),
            ] {
                let h = WorkerRig::start(&envoy, &envoy::registry_json(&[]), api).await;
                let target = Target {
                    node: h.node.clone(),
                    metrics: h.metrics.clone(),
                    acks: Arc::new(h.acks.clone()),
                };
                bench_adds(&bin, name, target, n).await;
            }
        }
    }
}
