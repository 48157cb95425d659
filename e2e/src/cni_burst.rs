//! CNI ADDs through the real `aether-cni` binary against the worker's CNI service in this
//! process, with a real Envoy behind it ([`WorkerRig`]): one at a time, or a burst of
//! concurrent ones. The burst test and the ADD benchmarks share it.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_worker::cni;
use aether_worker::storage::Storage;
use tokio::io::AsyncWriteExt;

use crate::envoy::WorkerRig;

/// The CNI environment and network config of ADD number `i` against `socket`.
pub fn add_input(i: usize, socket: &Path) -> (Vec<(&'static str, String)>, String) {
    let uid = format!("bench-{i:05}");
    let env = vec![
        ("CNI_COMMAND", "ADD".to_string()),
        ("CNI_CONTAINERID", format!("c{i:05}")),
        ("CNI_NETNS", format!("/var/run/netns/bench-{i}")),
        ("CNI_IFNAME", "eth0".into()),
        (
            "CNI_ARGS",
            format!("K8S_POD_NAMESPACE=bench;K8S_POD_NAME=p{i};K8S_POD_UID={uid}"),
        ),
    ];
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "bench", "type": "aether-cni", "agentSocket": socket,
        "prevResult": {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": "/x"}],
                       "ips": [{"address": format!("{}/8", pod_ip(i)), "interface": 0}]}
    })
    .to_string();
    (env, conf)
}

/// The IP of ADD number `i`'s pod.
pub fn pod_ip(i: usize) -> std::net::IpAddr {
    std::net::Ipv4Addr::new(
        10,
        (100 + i / 62_500) as u8,
        ((i / 250) % 250) as u8,
        (i % 250 + 1) as u8,
    )
    .into()
}

/// Runs the plugin once; how long it took from start to exit, or its error output.
pub async fn plugin(bin: &Path, env: &[(&str, String)], stdin: &[u8]) -> Result<Duration, String> {
    let start = Instant::now();
    let mut child = tokio::process::Command::new(bin)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning {}: {e}", bin.display()))?;
    let mut pipe = child.stdin.take().expect("stdin is piped");
    pipe.write_all(stdin)
        .await
        .map_err(|e| format!("writing the plugin's stdin: {e}"))?;
    drop(pipe);
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| format!("waiting for the plugin: {e}"))?;
    let elapsed = start.elapsed();
    if !out.status.success() {
        return Err(format!(
            "{}: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    Ok(elapsed)
}

/// What a burst did.
#[derive(Debug)]
pub struct Burst {
    /// From the first plugin's start to the last one's exit.
    pub total: Duration,
    /// Each successful call, plugin start to exit.
    pub calls: Vec<Duration>,
    pub failures: Vec<String>,
    /// Snapshots the node published during the burst.
    pub snapshots: u64,
    /// From the last plugin's exit until Envoy had ACKed a snapshot holding every pod.
    pub all_in_envoy: Option<Duration>,
}

/// Serves the CNI API of `rig`'s node (its real ACKs from Envoy) on a temp socket, adds
/// `before` pods one at a time, then `burst` more at once, each through its own plugin
/// process.
pub async fn run(bin: &Path, rig: &WorkerRig, before: usize, burst: usize) -> Burst {
    let dir = tempfile::tempdir_in("/var/tmp").expect("temp state dir");
    let socket = dir.path().join("cni.sock");
    let storage = Arc::new(
        Storage::open(&dir.path().join("state"), rig.metrics.clone()).expect("opening storage"),
    );
    cni::load(&rig.node, &storage);
    let listener = tokio::net::UnixListener::bind(&socket).expect("binding the CNI socket");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let service = cni::CniService::new(
        rig.node.clone(),
        storage.clone(),
        Arc::new(rig.acks.clone()),
        rig.metrics.clone(),
    );
    let server = tokio::spawn(cni::serve(
        listener,
        service,
        async move {
            let _ = stopped.await;
        },
        cni::Limits::default(),
    ));
    for i in 0..before {
        let (env, conf) = add_input(i, &socket);
        plugin(bin, &env, conf.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("ADD {i} before the burst: {e}"));
    }

    let seq = rig.node.snapshot().seq;
    let start = Instant::now();
    let calls: Vec<_> = (before..before + burst)
        .map(|i| {
            let (env, conf) = add_input(i, &socket);
            let bin = bin.to_path_buf();
            tokio::spawn(async move {
                plugin(&bin, &env, conf.as_bytes())
                    .await
                    .map_err(|e| format!("ADD {i}: {e}"))
            })
        })
        .collect();
    let mut ok = Vec::new();
    let mut failures = Vec::new();
    for c in calls {
        match c.await.expect("plugin task") {
            Ok(d) => ok.push(d),
            Err(e) => failures.push(e),
        }
    }
    let total = start.elapsed();
    let snapshots = rig.node.snapshot().seq - seq;
    let done = Instant::now();
    let uids: Vec<(String, std::net::IpAddr)> = (0..before + burst)
        .map(|i| (format!("bench-{i:05}"), pod_ip(i)))
        .collect();
    let all = rig
        .acks
        .wait_until(
            move |s| uids.iter().all(|(uid, ip)| s.holds_pod(uid, &[*ip])),
            Duration::from_secs(30),
        )
        .await;
    let all_in_envoy = all.then(|| done.elapsed());
    let _ = stop.send(());
    let _ = server.await;
    Burst {
        total,
        calls: ok,
        failures,
        snapshots,
        all_in_envoy,
    }
}
