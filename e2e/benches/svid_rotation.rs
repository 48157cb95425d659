//! A pod's SVID rotation to Envoy's ACK, with 110 local pods holding SVIDs.
//!
//! `cargo bench -p aether-e2e --bench svid-rotation` (release profile). Needs Envoy like
//! the xDS tests (`scripts/install-envoy.sh` or `ENVOY_BIN`). The rig is the worker's
//! node and ADS server in this process with a real Envoy; identity is on (permissive),
//! the bundle, the agent's SVID and every pod's SVID minted by a test CA. Each rotation
//! gives one pod a new SVID through the node's change API (what the identity client does
//! when the provider pushes one) and times until the proxy has ACKed a snapshot with
//! exactly that secret version. Then every pod rotates at once, and Envoy's admin
//! `/certs` must show each pod's new serial. `BENCH_ROTATIONS` (default 200, at least
//! 50) sets the count; `BENCH_XDS_API` (`delta`, the default, or `sotw`) the ADS variant.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use aether_e2e::datapath::TestCa;
use aether_e2e::envoy::{self, AdsApi, RigOptions, WorkerRig, same_versions};
use aether_e2e::testing::percentile;
use aether_model::{Change, Identity, Kind, MtlsMode, Pod};
use aether_worker::xds::kind::type_url;

const PODS: usize = 110;
const TRUST_DOMAIN: &str = "aether.test";

fn pod(i: usize) -> Pod {
    Pod {
        uid: format!("rot-{i:03}"),
        namespace: "bench".into(),
        name: format!("pod-{i:03}"),
        container_id: format!("c{i:03}"),
        netns: format!("/var/run/netns/rot-{i}"),
        ifname: "eth0".into(),
        ips: vec![IpAddr::from([10, 88, (i / 250) as u8, (i % 250 + 1) as u8])],
        terminating: false,
        no_quic_twin: false,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn summary(name: &str, v: &[Duration]) {
    let at = |p: f64| ms(percentile(v, p).expect("samples"));
    println!(
        "{name:<44} n={:<4} median {:>9}  p99 {:>9}  max {:>9}",
        v.len(),
        at(50.0),
        at(99.0),
        at(100.0)
    );
}

/// Every certificate serial Envoy's admin `/certs` lists.
fn envoy_serials(h: &WorkerRig) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(&h.admin("/certs")).expect("/certs is JSON");
    let mut out = Vec::new();
    for c in v["certificates"].as_array().into_iter().flatten() {
        for chain in c["cert_chain"].as_array().into_iter().flatten() {
            if let Some(s) = chain["serial_number"].as_str() {
                out.push(s.to_lowercase());
            }
        }
    }
    out
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "svid-rotation: run with `cargo bench -p aether-e2e --bench svid-rotation`; skipping"
        );
        return;
    }
    let Some(envoy) = envoy::envoy_bin() else {
        eprintln!("svid-rotation: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
        std::process::exit(2);
    };
    envoy::init_logs("warn");
    let rotations: usize = std::env::var("BENCH_ROTATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
        .max(50);
    let api: AdsApi = match std::env::var("BENCH_XDS_API") {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}")),
        Err(_) => AdsApi::Delta,
    };

    let ca = TestCa::new(TRUST_DOMAIN);
    let pods: Vec<Pod> = (0..PODS).map(pod).collect();
    let mut identity = Identity {
        trust_domain: Some(TRUST_DOMAIN.into()),
        mode: MtlsMode::Permissive,
        bundle: Some(ca.pem()),
        agent: Some(
            ca.mint_id(&format!("spiffe://{TRUST_DOMAIN}/aether/agent"))
                .svid,
        ),
        pods: Default::default(),
    };
    for p in &pods {
        identity
            .pods
            .insert(p.uid.clone(), ca.mint(&p.namespace, &p.name).svid);
    }
    let options = RigOptions {
        api,
        identity,
        ..RigOptions::default()
    };
    let h = WorkerRig::start_with(&envoy, r#"{"services":[]}"#, options).await;
    h.node.apply(pods.iter().cloned().map(Change::UpsertPod));
    let want = h.node.snapshot();
    assert!(
        h.acks
            .wait_until(|s| same_versions(s, &want), Duration::from_secs(60))
            .await,
        "110 pods with SVIDs ACKed"
    );
    println!(
        "svid-rotation: {PODS} pods with SVIDs ({} secrets), {rotations} rotations, ADS {}, Envoy {}",
        want.secrets.len(),
        api.api_type(),
        envoy.display()
    );

    // Minting is not the agent's work: every new SVID is made before its clock starts.
    let mut one = Vec::new();
    let listeners_before = h.stat("listener_manager.listener_modified");
    for i in 0..rotations {
        let p = &pods[(i * 37) % PODS];
        let svid = ca.mint(&p.namespace, &p.name).svid;
        let t0 = Instant::now();
        let next = h.node.apply([Change::SetPodSvid {
            uid: p.uid.clone(),
            svid: Some(svid),
        }]);
        assert!(
            h.acks
                .wait_until(|s| same_versions(s, &next), Duration::from_secs(10))
                .await,
            "rotation {i} not ACKed"
        );
        one.push(t0.elapsed());
        let changed = next.changed_since(&want, Kind::Listener).map(|n| n.len());
        assert!(
            changed.is_none_or(|n| n == 0),
            "a rotation changed no listener"
        );
    }

    // Every pod at once.
    let fresh: Vec<_> = pods
        .iter()
        .map(|p| (p.uid.clone(), ca.mint(&p.namespace, &p.name).svid))
        .collect();
    let t0 = Instant::now();
    let next = h
        .node
        .apply(fresh.iter().map(|(uid, s)| Change::SetPodSvid {
            uid: uid.clone(),
            svid: Some(s.clone()),
        }));
    assert!(
        h.acks
            .wait_until(|s| same_versions(s, &next), Duration::from_secs(30))
            .await,
        "the rotation of every pod not ACKed"
    );
    let all = t0.elapsed();

    // Envoy serves each pod's new certificate: /certs lists every new serial.
    let deadline = Instant::now() + Duration::from_secs(5);
    let missing = loop {
        let serials = envoy_serials(&h);
        let missing: Vec<&str> = fresh
            .iter()
            .filter(|(_, s)| !serials.contains(&s.serial))
            .map(|(u, _)| u.as_str())
            .collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        missing.is_empty(),
        "Envoy's /certs lacks the new serial of {} pods, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(3)]
    );
    let listeners_after = h.stat("listener_manager.listener_modified");

    summary("one pod's SVID rotation -> Envoy ACK", &one);
    println!(
        "{:<44} {}",
        "every pod's SVID rotates -> Envoy ACK",
        ms(all)
    );
    println!(
        "{:<44} {:?} -> {:?} (no listener drained or modified)",
        "listener_manager.listener_modified", listeners_before, listeners_after
    );
    assert_eq!(
        listeners_before, listeners_after,
        "a rotation modified a listener"
    );
    let nacks = h.worker_counter("nacks", type_url(Kind::Secret));
    println!("{:<44} {nacks}", "SDS NACKs");
    assert_eq!(nacks, 0);
}
