//! ADD latency, plugin start to answer: spawns the real `aether-cni` binary for each ADD
//! against the worker's real CNI service (storage writes with fsync, node update,
//! snapshot build) on a temp unix socket, with a proxy that ACKs each snapshot the moment
//! it is published. Prints the median and p99, and the same for VERSION (process start
//! and exit alone) for scale.
//!
//! Run: `cargo bench -p aether-cni --bench add_latency` (env `AETHER_BENCH_ADDS`, default
//! 300; `AETHER_BENCH_STATE_DIR` to put the records on a given filesystem, default a temp
//! dir under `/var/tmp`, which is disk-backed like `/var/lib/aether`).

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_worker::cni::{self, CniService, PublishedAcks};
use aether_worker::metrics::Metrics;
use aether_worker::node::Node;
use aether_worker::snapshot::Inputs;
use aether_worker::storage::Storage;
use tokio::io::AsyncWriteExt;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{what}: n={} median={:.2} ms p99={:.2} ms min={:.2} ms max={:.2} ms",
        samples.len(),
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
        ms(samples[0]),
        ms(samples[samples.len() - 1]),
    );
}

async fn plugin(env: &[(&str, String)], stdin: &[u8]) -> Duration {
    let start = Instant::now();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_aether-cni"))
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::var("AETHER_BENCH_ADDS").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
    let base = std::env::var_os("AETHER_BENCH_STATE_DIR").map(Into::into).unwrap_or_else(|| std::path::PathBuf::from("/var/tmp"));
    let dir = tempfile::tempdir_in(&base).expect("temp state dir");
    let socket = dir.path().join("cni.sock");

    let metrics = Metrics::new();
    let storage = Arc::new(Storage::open(&dir.path().join("state"), metrics.clone()).expect("opening storage"));
    let node = Node::new(Inputs::default());
    cni::load(&node, &storage);
    let service = CniService::new(node.clone(), storage.clone(), Arc::new(PublishedAcks(node.clone())), metrics.clone());
    let listener = tokio::net::UnixListener::bind(&socket).expect("binding the socket");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(cni::serve_with(listener, service, async move { let _ = stopped.await; }, cni::DRAIN_BOUND));

    let mut version = Vec::with_capacity(n);
    for _ in 0..n.min(100) {
        version.push(plugin(&[("CNI_COMMAND", "VERSION".into())], b"{}").await);
    }

    let mut adds = Vec::with_capacity(n);
    for i in 0..n {
        let uid = format!("bench-{i:05}");
        let ip = format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256);
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
        adds.push(plugin(&env, conf.as_bytes()).await);
    }
    assert_eq!(storage.pods().len(), n, "every ADD stored");
    assert_eq!(metrics.cni_ack_timeouts.get(), 0, "every ADD acked");

    println!("state dir: {}", dir.path().display());
    report("VERSION (process start to exit)", version);
    report("ADD (plugin start to answer, ACK on publish, fsynced record)", adds);
    let _ = stop.send(());
    let _ = server.await;
}
