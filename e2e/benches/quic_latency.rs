//! The same GET over HTTP/3 through a pod's QUIC twin and over TCP mTLS through the pod's
//! inbound, through the same Envoy: median and p99 side by side, from one run.
//!
//! `cargo bench -p aether-e2e --bench quic-latency` (release profile; root, nftables, Envoy
//! and the project virtualenv's aioquic, as the QUIC twin test). The rig is the twin
//! test's: a node namespace with Envoy and the worker side in-process, identity on, a pod
//! `web` answering HTTP/1.1 with its own SVID and a twin, and a client namespace holding a
//! client SVID of the trust domain. Rounds alternate the two paths so that the machine's
//! noise falls on both; each round is one Python client (`e2e/quic/latency.py`, the same
//! interpreter and timer for both) on one connection, its warm-up untimed. A third line is
//! the HTTP/3 client's own floor: the same client against an aioquic server in its process,
//! without Envoy (pure-Python QUIC bounds the HTTP/3 figure, not the twin).
//! `BENCH_ROUNDS` (default 10) and `BENCH_REQUESTS` (per round, default 200) set the size.

use std::net::SocketAddr;
use std::time::Duration;

use aether_e2e::datapath::{self, Datapath, Serve, TestCa, pod_addr};
use aether_e2e::envoy::{self, WorkerRig, envoy_or_skip, registry_json};
use aether_e2e::quic::{self, TD, TWIN_PORT, pem_files};
use aether_e2e::testing::{env_usize, percentile, workspace_root};
use aether_model::{Change, twin_sni};

/// One round of `n` timed GETs on one connection: the latencies in microseconds, or the
/// client's error.
fn round(ns: &str, args: &[String], n: usize) -> Result<Vec<f64>, String> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(quic::python())
        .arg(workspace_root().join("e2e/quic/latency.py"))
        .args(args)
        .arg(format!("--n={n}"))
        .output()
        .expect("running e2e/quic/latency.py");
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "latency.py printed no JSON ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    if v["ok"] != true {
        return Err(format!("{} round failed: {}", args[0], v["error"]));
    }
    Ok(v["micros"]
        .as_array()
        .expect("micros")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect())
}

/// TLS handshakes the pod's inbound listener (`listener.IP_PORT.ssl.handshake`) completed.
fn inbound_handshakes(rig: &WorkerRig, pod: SocketAddr) -> u64 {
    let stat = format!("listener.{}_{}.ssl.handshake", pod.ip(), pod.port());
    rig.admin(&format!("/stats?filter=^{}$", stat.replace('.', "\\.")))
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{stat}: "))?.trim().parse().ok())
        .unwrap_or(0)
}

fn line(name: &str, v: &[f64]) -> (f64, f64) {
    let (m, p) = (
        percentile(v, 50.0).expect("samples"),
        percentile(v, 99.0).expect("samples"),
    );
    println!(
        "{name:<40} n={:<5} median {:>7.3} ms  p99 {:>7.3} ms",
        v.len(),
        m / 1e3,
        p / 1e3
    );
    (m, p)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let what = "the HTTP/3 against TCP mTLS latency bench";
    let Some(envoy_bin) = envoy_or_skip(what) else {
        return;
    };
    if let Some(why) = datapath::missing() {
        eprintln!("\n!!! SKIPPED {what}: {why} !!!\n");
        return;
    }
    assert!(
        quic::python().exists(),
        "{what} needs {} with aioquic (scripts/install-pytools.sh)",
        quic::python().display()
    );
    let rounds = env_usize("BENCH_ROUNDS", 10);
    let requests = env_usize("BENCH_REQUESTS", 200);
    envoy::init_logs("warn");
    let mut dp = Datapath::create("ql", [10, 78, 0]).expect("the data path's namespaces");
    dp.add_pod("web", 2, Serve::Http(None))
        .expect("the pod web");
    let ca = TestCa::new(TD);
    let (web, agent, client) = (
        ca.mint("default", "web"),
        ca.mint("aether-system", "agent"),
        ca.mint("default", "client"),
    );
    let options = quic::twin_rig_options(&dp, &ca, &agent);
    let rig = WorkerRig::start_with(&envoy_bin, &registry_json(&[]), options).await;
    dp.redirect(rig.inbound_port, None)
        .expect("the capture redirect");
    rig.node.apply([
        Change::UpsertPod(dp.pod_record("web", false)),
        Change::SetPodSvid {
            uid: "uid-web".into(),
            svid: Some(web.svid.clone()),
        },
    ]);
    assert!(
        rig.wait_acked_current(Duration::from_secs(10)).await,
        "Envoy did not ACK the pod and its twin"
    );
    let pem = pem_files(&client);
    let (cert, key) = (
        pem.cert.display().to_string(),
        pem.key.display().to_string(),
    );
    let twin = quic::twin_address(TWIN_PORT);
    let h3_args = [
        "h3".to_string(),
        twin.ip().to_string(),
        twin.port().to_string(),
        twin_sni("uid-web"),
        cert.clone(),
        key.clone(),
    ];
    let pod = pod_addr(dp.pod("web").ip);
    let tcp_args = [
        "tcp".to_string(),
        pod.ip().to_string(),
        pod.port().to_string(),
        "-".to_string(),
        cert,
        key,
    ];
    let floor_args = [
        "h3-floor".to_string(),
        "-".to_string(),
        "0".to_string(),
        twin_sni("uid-web"),
        tcp_args[4].clone(),
        tcp_args[5].clone(),
    ];
    let ns = dp.client.name.clone();
    // A listener Envoy has just taken reaches its worker threads a moment later: one short
    // round of each until both answer.
    for args in [&h3_args, &tcp_args] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while let Err(e) = round(&ns, args, 1) {
            assert!(std::time::Instant::now() < deadline, "{e}");
        }
    }
    let handshakes_before = inbound_handshakes(&rig, pod);
    let (mut h3, mut tcp, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds {
        h3.extend(round(&ns, &h3_args, requests).unwrap_or_else(|e| panic!("{e}")));
        tcp.extend(round(&ns, &tcp_args, requests).unwrap_or_else(|e| panic!("{e}")));
        floor.extend(round(&ns, &floor_args, requests).unwrap_or_else(|e| panic!("{e}")));
        eprintln!("round {}/{rounds} done", r + 1);
    }
    // Each TCP round is one TLS connection Envoy's inbound terminated: the path measured
    // is the proxy's, not a shortcut to the pod.
    let handshakes = inbound_handshakes(&rig, pod) - handshakes_before;
    assert!(
        handshakes >= rounds as u64,
        "Envoy's inbound terminated {handshakes} TLS connections for {rounds} TCP rounds"
    );
    println!(
        "the same GET to pod web through one Envoy, {rounds} interleaved rounds of {requests}:"
    );
    let (hm, hp) = line("HTTP/3 through the twin (QUIC, mTLS)", &h3);
    let (tm, tp) = line("HTTP/1.1 over TCP mTLS (the inbound)", &tcp);
    println!("HTTP/3 / TCP: median {:.2}x, p99 {:.2}x", hm / tm, hp / tp);
    let (fm, _) = line("HTTP/3 client floor (aioquic to aioquic)", &floor);
    println!(
        "the twin's path above the client's floor: median {:.3} ms (the floor also pays an aioquic server in the same process)",
        (hm - fm) / 1e3
    );
}
