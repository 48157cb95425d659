//! The registrar under an unauthenticated flood from one address: a real registrar
//! (`--token-review`, TLS on its port, its defaults for every limit) on a real etcd over
//! client TLS, reviewing tokens with the test Kubernetes API server, and a flooder process
//! at `nice -n 19` that opens `AETHER_REGISTRAR_FLOOD_CONNECTIONS` (50) TLS connections,
//! again as each is closed, and keeps `AETHER_REGISTRAR_FLOOD_STREAMS` (200) ApplyServices
//! calls going on each, every one with a fresh bearer token (half of them random, half
//! JWT-shaped for the registrar's audience, forged) and a body of
//! `AETHER_REGISTRAR_FLOOD_BODY` bytes (1 MiB), for `AETHER_REGISTRAR_FLOOD_SECS` (30).
//!
//! Prints the registrar's peak RSS (VmHWM), the TokenReviews the API server received,
//! the calls by status, and the connections and refusals the registrar counted. A real
//! agent token is checked before and after: the flood must not lock it out.
//!
//! `cargo bench -p aether-e2e --bench registrar-flood` (release profile).

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aether_e2e::kube_api::{KubeApi, Rule};
use aether_e2e::registrar::{Etcd, RegistrarProcess, TestCa, registrar_bin};
use aether_e2e::testing::env_usize;
use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
use shared_proto::registry as pb;

const ROLE: &str = "AETHER_REGISTRAR_FLOOD_ROLE";

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "registrar-flood: run with `cargo bench -p aether-e2e --bench registrar-flood`; skipping"
        );
        return;
    }
    if std::env::var(ROLE).as_deref() == Ok("flooder") {
        flooder();
        return;
    }
    if !Etcd::available() {
        eprintln!("registrar-flood: etcd is not installed (Debian package etcd-server)");
        std::process::exit(2);
    }
    let secs = env_usize("AETHER_REGISTRAR_FLOOD_SECS", 30);
    let ca = TestCa::new("registrar-flood CA");
    let (etcd_cert, etcd_key) = ca.leaf("etcd", &["127.0.0.1"], ServerAuth);
    let (client_cert, client_key) = ca.leaf("registrar", &[], ClientAuth);
    let (serve_cert, serve_key) = ca.leaf("registrar-serving", &["127.0.0.1"], ServerAuth);
    let etcd = Etcd::start_tls(aether_registrar::testing::EtcdTls {
        cert: etcd_cert,
        key: etcd_key,
        client_ca: ca.ca_file(),
    });
    let api = KubeApi::start();
    let (registrar_sa, agent_sa) = (
        "system:serviceaccount:aether-system:aether-registrar",
        "system:serviceaccount:aether-system:aether-agent",
    );
    api.grant(
        registrar_sa,
        &[Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(agent_sa, "node-a");
    let port = || aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap();
    let listen = format!("127.0.0.1:{}", port());
    let metrics_addr = format!("127.0.0.1:{}", port());
    let kubeconfig = api.kubeconfig(registrar_sa).display().to_string();
    let p = |p: &std::path::Path| p.display().to_string();
    let (ca_file, client_cert, client_key, serve_cert, serve_key) = (
        p(&ca.ca_file()),
        p(&client_cert),
        p(&client_key),
        p(&serve_cert),
        p(&serve_key),
    );
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--etcd-ca",
            &ca_file,
            "--etcd-cert",
            &client_cert,
            "--etcd-key",
            &client_key,
            "--tls-cert",
            &serve_cert,
            "--tls-key",
            &serve_key,
            "--token-review",
            "--kubeconfig",
            &kubeconfig,
            "--discovery",
            "off",
            "--agent-service-account",
            "aether-system/aether-agent",
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    let pid = registrar.pid().expect("the registrar runs");
    let reviews = || {
        api.requests(registrar_sa)
            .iter()
            .filter(|r| r.starts_with("POST /apis/authentication.k8s.io/v1/tokenreviews"))
            .count()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let agent_token = api.token(agent_sa);
    let agent_watch = || {
        rt.block_on(agent_call(&listen, &ca_file, &agent_token))
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    agent_watch().expect("the agent's watch before the flood");
    let rss_before = vm(pid, "VmRSS:");
    let reviews_before = reviews();

    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let out = std::process::Command::new("nice")
        .args(["-n", "19"])
        .arg(&exe)
        .arg("--bench")
        .env(ROLE, "flooder")
        .env("AETHER_REGISTRAR_FLOOD_ADDR", &listen)
        .env("AETHER_REGISTRAR_FLOOD_CA", &ca_file)
        .env("AETHER_REGISTRAR_FLOOD_SECS", secs.to_string())
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("the flooder runs");
    let flood_secs = started.elapsed().as_secs_f64();
    let flooder_report = String::from_utf8_lossy(&out.stdout).into_owned();
    let reviews_during = reviews() - reviews_before;
    let after = agent_watch();
    let peak = vm(pid, "VmHWM:");
    let metrics =
        aether_e2e::testing::scrape_metrics(&metrics_addr).expect("the registrar's metrics");
    println!("registrar-flood: {flood_secs:.1} s of flood from one address (flooder at nice 19)");
    print!("{flooder_report}");
    println!(
        "registrar RSS before the flood: {:.1} MiB; peak (VmHWM): {:.1} MiB",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    println!("TokenReviews the API server received during the flood: {reviews_during}");
    println!("agent's watch after the flood: {after:?}");
    for line in metrics.lines().filter(|l| {
        (l.starts_with("aether_registrar_connections_refused")
            || l.starts_with("aether_registrar_refusals")
            || l.starts_with("aether_registrar_token_reviews")
            || l.starts_with("aether_registrar_tls_handshakes")
            || l.starts_with("aether_registrar_calls"))
            && !l.starts_with('#')
    }) {
        println!("  {line}");
    }
}

/// A field of /proc/PID/status, in KiB.
fn vm(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

async fn agent_call(addr: &str, ca: &str, token: &str) -> Result<(), tonic::Status> {
    let mut c = aether_registrar::client::connect(
        addr,
        Duration::from_secs(10),
        Some(std::path::Path::new(ca)),
    )
    .await
    .map_err(|e| tonic::Status::unavailable(format!("{e:#}")))?;
    let mut req = tonic::Request::new(pb::WatchEndpointsRequest {
        node: "node-a".into(),
        instance: "bench".into(),
        ..Default::default()
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    c.watch_endpoints(req).await.map(drop)
}

/// A fresh token: random, or JWT-shaped for the registrar's audience and forged.
fn token(n: u64) -> String {
    use base64::Engine;
    let b64 = |v: serde_json::Value| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    };
    let salt = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), n);
    if n.is_multiple_of(2) {
        format!("flood-{salt:016x}")
    } else {
        format!(
            "{}.{}.{salt:016x}",
            b64(serde_json::json!({"alg": "RS256"})),
            b64(
                serde_json::json!({"aud": ["aether-registrar"], "sub": "flood", "exp": 4_000_000_000u64})
            )
        )
    }
}

/// The flood: runs for the given seconds and prints what it saw.
fn flooder() {
    let addr = std::env::var("AETHER_REGISTRAR_FLOOD_ADDR").unwrap();
    let ca = std::env::var("AETHER_REGISTRAR_FLOOD_CA").unwrap();
    let secs = env_usize("AETHER_REGISTRAR_FLOOD_SECS", 30) as u64;
    let connections = env_usize("AETHER_REGISTRAR_FLOOD_CONNECTIONS", 50);
    let streams = env_usize("AETHER_REGISTRAR_FLOOD_STREAMS", 200);
    let body = env_usize("AETHER_REGISTRAR_FLOOD_BODY", 1 << 20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let counts: Arc<std::sync::Mutex<std::collections::BTreeMap<String, u64>>> = Arc::default();
    let (connected, refused, serial) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let request = pb::ApplyServicesRequest {
        services: vec![pb::Service {
            vip: "x".repeat(body),
            ..Default::default()
        }],
    };
    rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..connections {
            let (addr, ca, counts, request) =
                (addr.clone(), ca.clone(), counts.clone(), request.clone());
            let (connected, refused, serial) = (connected.clone(), refused.clone(), serial.clone());
            tasks.spawn(async move {
                while Instant::now() < deadline {
                    let client = match aether_registrar::client::connect(
                        &addr,
                        Duration::from_secs(5),
                        Some(std::path::Path::new(&ca)),
                    )
                    .await
                    {
                        Ok(c) => c,
                        Err(_) => {
                            refused.fetch_add(1, Ordering::Relaxed);
                            // Paces the reconnects of a refused connection a little.
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    };
                    connected.fetch_add(1, Ordering::Relaxed);
                    let mut calls = tokio::task::JoinSet::new();
                    for _ in 0..streams {
                        let (mut client, counts, request, serial) = (
                            client.clone(),
                            counts.clone(),
                            request.clone(),
                            serial.clone(),
                        );
                        calls.spawn(async move {
                            while Instant::now() < deadline {
                                let n = serial.fetch_add(1, Ordering::Relaxed);
                                let mut req = tonic::Request::new(request.clone());
                                req.metadata_mut().insert(
                                    "authorization",
                                    format!("Bearer {}", token(n)).parse().unwrap(),
                                );
                                let code = match client.apply_services(req).await {
                                    Ok(_) => tonic::Code::Ok,
                                    Err(s) => s.code(),
                                };
                                *counts
                                    .lock()
                                    .unwrap()
                                    .entry(format!("{code:?}"))
                                    .or_default() += 1;
                                // A connection that broke ends this caller's loop; its
                                // owner opens another.
                                if code == tonic::Code::Unavailable {
                                    return;
                                }
                            }
                        });
                    }
                    while calls.join_next().await.is_some() {}
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    });
    let counts = counts.lock().unwrap();
    let total: u64 = counts.values().sum();
    println!(
        "flooder: {connections} connections x {streams} streams, {body}-byte bodies: {} connections served, {} refused or failed; {total} calls: {counts:?}",
        connected.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
}
