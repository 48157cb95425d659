//! The identity churn soak: pods ADDed and DELeted one after another on a real data path,
//! each calling an mTLS service while it lives, through a real Envoy, with its own SVID.
//!
//! `cargo bench -p aether-e2e --bench identity-churn` (release profile; root, `nft` and
//! Envoy, as the data-path tests). Node 1 runs the worker's node and ADS server in this
//! process with Envoy in its network namespace (identity on, permissive, SVIDs minted by a
//! test CA); `BENCH_SLOTS` pod namespaces (default 8) take turns: each cycle deletes the
//! pod in one slot and adds a new pod (a new uid, a new SVID) at the same IP, so every
//! address is reused by a new pod over and over. The new pod calls the service `web` on
//! node 2, a TLS server that requires a client certificate and answers with the SPIFFE ID
//! it saw: the answer must be the new pod's own ID, every time (never the previous pod's
//! at that IP, never the agent's). `BENCH_CYCLES` (default 5000) sets the count.
//!
//! Printed: the cycles' call latencies; the pod certificates Envoy's admin `/certs` lists,
//! which must come back to the live pods' count; and Envoy's `server.memory_allocated` (what
//! tcmalloc hands out; RSS would keep freed pages) after a warm-up, at the middle and at
//! the end, with its slope per cycle. Fails on a wrong identity, a failed call, leftover
//! certificates, or a second half that grows more than 1 KiB a cycle.
//!
//! Envoy holds a removed listener, and the filter chains an in-place update replaced, for
//! `--drain-time-s` (600 s by default, as the chart runs it), and an idle upstream
//! connection for the mTLS pools' 60 s idle timeout: memory is flat only once both windows
//! have passed. `AETHER_E2E_ENVOY_DRAIN_S` sets Envoy's drain time for the run; with the
//! default, the slope is what each churned pod costs until its drain ends.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use aether_e2e::datapath::{self, Datapath, Serve, TestCa};
use aether_e2e::envoy::{self, AdsApi, RigOptions, WorkerRig, envoy_or_skip};
use aether_e2e::testing::percentile;
use aether_model::{Change, Identity, MtlsMode, Pod};

const TD: &str = "aether.test";
const BOUND: Duration = Duration::from_secs(10);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a count"))
        })
        .unwrap_or(default)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// The pod certificates Envoy's admin `/certs` lists: each distinct SPIFFE ID under
/// `/ns/default/pod/` (a pod's inbound and outbound secrets hold the same SVID).
fn pod_certificates(rig: &WorkerRig) -> usize {
    let certs: serde_json::Value =
        serde_json::from_str(&rig.admin("/certs")).expect("/certs is JSON");
    let mut ids = std::collections::BTreeSet::new();
    for c in certs["certificates"].as_array().into_iter().flatten() {
        for chain in c["cert_chain"].as_array().into_iter().flatten() {
            for san in chain["subject_alt_names"].as_array().into_iter().flatten() {
                if let Some(uri) = san["uri"].as_str()
                    && uri.starts_with(&format!("spiffe://{TD}/ns/default/pod/"))
                {
                    ids.insert(uri.to_string());
                }
            }
        }
    }
    ids.len()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Some(envoy_bin) = envoy_or_skip("identity-churn") else {
        return;
    };
    if let Some(why) = datapath::missing() {
        eprintln!("identity-churn: skipped: {why}");
        return;
    }
    let slots = env_usize("BENCH_SLOTS", 8).clamp(1, 200);
    let cycles = env_usize("BENCH_CYCLES", 5000).max(slots * 4);
    let warmup = cycles / 10;
    envoy::init_logs("warn");

    let ca = TestCa::new(TD);
    let (agent, web) = (ca.mint("aether-system", "agent"), ca.mint("default", "web"));
    let mut dp1 = Datapath::create("c", [10, 77, 0]).expect("node 1's namespaces");
    for s in 0..slots {
        dp1.add_pod(&format!("slot{s}"), s as u8 + 2, Serve::Lines)
            .expect("a pod namespace");
    }
    let mut dp2 = Datapath::create("w", [10, 88, 0]).expect("node 2's namespaces");
    dp2.add_pod(
        "web",
        2,
        Serve::Http(Some(datapath::mtls_server(&ca.pem(), &web))),
    )
    .expect("pod web");
    Datapath::link(&mut dp1, &mut dp2).expect("the link between the nodes");
    let registry = serde_json::json!({"services": [
        {"name": "web", "namespace": "default", "ports": [80], "vip": "10.96.0.10",
         "endpoints": [{"address": "10.88.0.2", "port": 80, "mtls": true}]},
    ]})
    .to_string();
    let rig = WorkerRig::start_with(
        &envoy_bin,
        &registry,
        RigOptions {
            api: AdsApi::Delta,
            netns: Some(dp1.node.name.clone()),
            outbound_ip: Some(IpAddr::from([0, 0, 0, 0])),
            identity: Identity {
                trust_domain: Some(TD.into()),
                mode: MtlsMode::Permissive,
                bundle: Some(ca.pem()),
                agent: Some(agent.svid.clone()),
                pods: Default::default(),
            },
            ..RigOptions::default()
        },
    )
    .await;
    dp1.redirect(
        rig.inbound_port,
        Some(("10.96.0.0/16", rig.outbound.port())),
    )
    .expect("node 1's capture redirect");

    let mut live: Vec<Option<String>> = vec![None; slots];
    let mut calls = Vec::with_capacity(cycles);
    let mut memory = Vec::new();
    let allocated = |rig: &WorkerRig| rig.stat("server.memory_allocated").unwrap_or(0);
    let started = Instant::now();
    for i in 0..cycles {
        let s = i % slots;
        let slot = format!("slot{s}");
        let uid = format!("churn-{i:05}");
        let name = format!("churn-{i}");
        let svid = ca.mint("default", &name);
        let mut changes = Vec::new();
        if let Some(old) = live[s].take() {
            changes.push(Change::RemovePod(old.clone()));
            changes.push(Change::SetPodSvid {
                uid: old,
                svid: None,
            });
        }
        let p = dp1.pod(&slot);
        changes.push(Change::UpsertPod(Pod {
            uid: uid.clone(),
            namespace: "default".into(),
            name: name.clone(),
            container_id: format!("c-{uid}"),
            netns: p.ns.path().display().to_string(),
            ifname: "eth0".into(),
            ips: p.ips().into_iter().map(IpAddr::V4).collect(),
            terminating: false,
            no_quic_twin: false,
        }));
        changes.push(Change::SetPodSvid {
            uid: uid.clone(),
            svid: Some(svid.svid.clone()),
        });
        rig.node.apply(changes);
        assert!(
            rig.wait_acked_current(BOUND).await,
            "cycle {i}: Envoy did not ACK the new pod"
        );
        live[s] = Some(uid);
        let t = Instant::now();
        let ns = &dp1.pod(&slot).ns;
        let (status, body) =
            datapath::http_get_in(ns, SocketAddr::from(([10, 96, 0, 10], 80)), "web.default")
                .unwrap_or_else(|e| panic!("cycle {i}: {slot} -> web: {e}"));
        calls.push(t.elapsed());
        assert_eq!(
            (status, body.as_str()),
            (200, format!("web peer={}", svid.svid.spiffe_id).as_str()),
            "cycle {i}: the pod at {slot}'s IP was not served with its own identity"
        );
        if i + 1 == warmup || i + 1 == warmup + (cycles - warmup) / 2 || i + 1 == cycles {
            memory.push((i + 1, allocated(&rig)));
        }
        if (i + 1) % 500 == 0 {
            eprintln!(
                "identity-churn: {} cycles in {:.1} s; pod certificates in /certs: {}",
                i + 1,
                started.elapsed().as_secs_f64(),
                pod_certificates(&rig)
            );
        }
    }
    let live_certs = pod_certificates(&rig);
    let live_pods = live.iter().flatten().count();
    // Every pod deleted: its certificates must leave.
    let mut last = Vec::new();
    for slot in &mut live {
        if let Some(old) = slot.take() {
            last.push(Change::RemovePod(old.clone()));
            last.push(Change::SetPodSvid {
                uid: old,
                svid: None,
            });
        }
    }
    rig.node.apply(last);
    assert!(rig.wait_acked_current(BOUND).await, "the last deletes");
    let left = pod_certificates(&rig);

    calls.sort();
    let drain =
        std::env::var("AETHER_E2E_ENVOY_DRAIN_S").unwrap_or_else(|_| "600 (default)".into());
    println!(
        "identity-churn: {cycles} ADD/call/DEL cycles over {slots} reused IPs in {:.1} s, every call with the pod's own identity; Envoy --drain-time-s {drain}",
        started.elapsed().as_secs_f64()
    );
    println!(
        "  call through Envoy with a new pod's SVID: p50 {} p99 {} max {}",
        ms(percentile(&calls, 50.0).expect("calls")),
        ms(percentile(&calls, 99.0).expect("calls")),
        ms(*calls.last().expect("calls"))
    );
    println!(
        "  pod certificates in /certs: {live_certs} with {live_pods} pods live, {left} after the last deletes"
    );
    let [(c0, m0), (c1, m1), (c2, m2)] = memory[..] else {
        panic!("three memory samples, got {memory:?}")
    };
    let slope =
        |(a, ma): (usize, u64), (b, mb): (usize, u64)| (mb as f64 - ma as f64) / (b - a) as f64;
    println!(
        "  Envoy server.memory_allocated: {:.1} MiB after {c0} cycles (warm-up), {:.1} MiB after {c1}, {:.1} MiB after {c2}; slope {:+.0} B/cycle then {:+.0} B/cycle",
        m0 as f64 / 1048576.0,
        m1 as f64 / 1048576.0,
        m2 as f64 / 1048576.0,
        slope((c0, m0), (c1, m1)),
        slope((c1, m1), (c2, m2)),
    );
    assert_eq!(
        live_certs, live_pods,
        "/certs lists pod certificates beyond the live pods'"
    );
    assert_eq!(left, 0, "pod certificates left after every pod's delete");
    assert!(
        slope((c1, m1), (c2, m2)) < 1024.0,
        "Envoy's allocated memory grows more than 1 KiB a cycle in the second half"
    );
    drop(rig);
}
