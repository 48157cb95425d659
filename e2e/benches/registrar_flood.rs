//! The registrar under an unauthenticated flood from one address: a real registrar
//! (`--token-review`, TLS on its port, its defaults for every limit) on a real etcd over
//! client TLS, reviewing tokens with the test Kubernetes API server, and a flooder process
//! at `nice -n 19` that opens `AETHER_REGISTRAR_FLOOD_CONNECTIONS` (50) TLS connections
//! from its own loopback address ([`FLOOD_SOURCE`], as another pod would), again as each
//! is closed, and keeps `AETHER_REGISTRAR_FLOOD_STREAMS` (200) ApplyServices calls going
//! on each, every one with a fresh bearer token (half of them random, half JWT-shaped for
//! the registrar's audience, forged) and a body of `AETHER_REGISTRAR_FLOOD_BODY` bytes
//! (1 MiB), for `AETHER_REGISTRAR_FLOOD_SECS` (30).
//!
//! Meanwhile a real agent (supervisor and worker, [`NodeRig`]) watches the registrar over
//! TLS with its node-bound token and serves a real Envoy, and an operator (a token the
//! registrar maps to `--operator-user`) turns one of the rig's endpoints draining or
//! healthy every 100 ms. Each change is timed from just before the call to the moment the
//! agent receives Envoy's ACK of the load assignment it pushed for it (the agent's own
//! log, as the `cross-node` bench times it): without the flood (the changes before and
//! after it) and during it.
//!
//! Prints the registrar's peak RSS (VmHWM), the TokenReviews the API server received,
//! the calls by status, the connections and refusals the registrar counted, and the
//! change-to-ACK latencies side by side. A real agent token is checked before and after:
//! the flood must not lock it out.
//!
//! `cargo bench -p aether-e2e --bench registrar-flood` (release profile; the agent's
//! binaries from `cargo build --release --workspace --bins`). `BENCH_CHANGES` (as many as
//! fit in the flood's seconds): the changes timed without the flood, half before it and
//! half after.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use aether_e2e::envoy::ack_log::{self, AgentLog, ms, since, summary};
use aether_e2e::envoy::{AdsApi, NodeRig};
use aether_e2e::registrar::{
    AGENT_SA, Etcd, REGISTRAR_SA, RegistrarProcess, TestCa, WorkerReadable, registrar_bin,
    token_review_api,
};
use aether_e2e::testing::{env_usize, percentile};
use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
use shared_proto::registry as pb;
use shared_proto::registry::registry_client::RegistryClient;
use tonic::transport::Channel;

const ROLE: &str = "AETHER_REGISTRAR_FLOOD_ROLE";
/// The flooder's own source address: the per-source budgets are what stop it, and the
/// agent and the operator (on 127.0.0.1) are other sources, as they would be in a cluster.
const FLOOD_SOURCE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
/// The operator's user name, as the test API server's TokenReview names it.
const OPERATOR: &str = "ops@example";
/// How often the operator changes the registry.
const CHANGE_EVERY: Duration = Duration::from_millis(100);
/// How long one change may take to be ACKed.
const T_CHANGE: Duration = Duration::from_secs(10);

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
    ack_log::rerun_with_agent_log();
    if !Etcd::available() {
        eprintln!("registrar-flood: etcd is not installed (Debian package etcd-server)");
        std::process::exit(2);
    }
    let Some(envoy_bin) = aether_e2e::envoy::envoy_bin() else {
        eprintln!("registrar-flood: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
        std::process::exit(2);
    };
    let secs = env_usize("AETHER_REGISTRAR_FLOOD_SECS", 30);
    // As many changes without the flood as during it, so that whatever else the machine
    // runs weighs on both alike.
    let quiet_changes = env_usize("BENCH_CHANGES", secs * 10).max(10);
    let ca = TestCa::new("registrar-flood CA");
    let (etcd_cert, etcd_key) = ca.leaf("etcd", &["127.0.0.1"], ServerAuth);
    let (client_cert, client_key) = ca.leaf("registrar", &[], ClientAuth);
    let (serve_cert, serve_key) = ca.leaf("registrar-serving", &["127.0.0.1"], ServerAuth);
    let etcd = Etcd::start_tls(aether_registrar::testing::EtcdTls {
        cert: etcd_cert,
        key: etcd_key,
        client_ca: ca.ca_file(),
    });
    // The rig's agents run as `test-node`.
    let (api, kubeconfig) = token_review_api("test-node");
    let port = || aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap();
    let listen = format!("127.0.0.1:{}", port());
    let metrics_addr = format!("127.0.0.1:{}", port());
    // Where the worker can read the CA and its token.
    let shared = WorkerReadable::new("aether-registrar-flood-");
    let ca_file = shared.put("ca.crt", &std::fs::read(ca.ca_file()).unwrap());
    let agent_token = api.token(AGENT_SA);
    let agent_token_file = shared.put("agent-token", agent_token.as_bytes());
    let ops_token = api.token(OPERATOR);
    let ops_token_file = shared.put("ops-token", ops_token.as_bytes());
    let p = |p: &Path| p.display().to_string();
    let (client_cert, client_key, serve_cert, serve_key) = (
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
            "--operator-user",
            OPERATOR,
            // The rig's upstreams are on loopback.
            "--allow-loopback-endpoints",
            "--metrics-addr",
            &metrics_addr,
        ],
    );
    let pid = registrar.pid().expect("the registrar runs");
    let reviews = || {
        api.requests(REGISTRAR_SA)
            .iter()
            .filter(|r| r.starts_with("POST /apis/authentication.k8s.io/v1/tokenreviews"))
            .count()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let agent_watch = || {
        rt.block_on(agent_call(&listen, &ca_file, &agent_token))
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    agent_watch().expect("the agent's watch before the flood");

    // The node: a real agent watching the registrar over TLS with its token, and Envoy
    // (the rig adds `--registrar`).
    let agent_flags = [
        format!("--registrar-ca={ca_file}"),
        format!("--registrar-token-file={agent_token_file}"),
    ];
    let apply_args = ["--ca", &ca_file, "--token-file", &ops_token_file];
    let mut rig = NodeRig::start_at(
        &envoy_bin,
        AdsApi::Delta,
        Some((&listen, &apply_args)),
        &agent_flags.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    // The stats poller reads Envoy's admin every 2 ms on the thread that runs xDS.
    rig.poller.stop();
    let mut operator = Operator {
        client: rt
            .block_on(aether_registrar::client::connect(
                &listen,
                Duration::from_secs(10),
                Some(Path::new(&ca_file)),
            ))
            .expect("the operator connects"),
        token: ops_token,
        upstreams: rig.upstreams.iter().map(|u| u.addr).collect(),
        draining: false,
        log: AgentLog::new(&rig.owner.log_path),
        next: Instant::now(),
    };
    let mut quiet: Vec<Timing> = (0..quiet_changes / 2)
        .map(|_| operator.change(&rt))
        .collect();

    let rss_before = vm(pid, "VmRSS:");
    let reviews_before = reviews();
    let cpu_before = cpu_secs(pid);
    let exe = std::env::current_exe().unwrap();
    let started = Instant::now();
    let mut flooder = std::process::Command::new("nice")
        .args(["-n", "19"])
        .arg(&exe)
        .arg("--bench")
        .env(ROLE, "flooder")
        .env("AETHER_REGISTRAR_FLOOD_ADDR", &listen)
        .env("AETHER_REGISTRAR_FLOOD_CA", &ca_file)
        .env("AETHER_REGISTRAR_FLOOD_SECS", secs.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("the flooder runs");
    let mut flooded = Vec::new();
    while flooder.try_wait().expect("the flooder's status").is_none() {
        flooded.push(operator.change(&rt));
    }
    let out = flooder.wait_with_output().expect("the flooder's report");
    let flood_secs = started.elapsed().as_secs_f64();
    let flooder_report = String::from_utf8_lossy(&out.stdout).into_owned();
    let reviews_during = reviews() - reviews_before;
    let registrar_cpu = cpu_secs(pid) - cpu_before;
    let after = agent_watch();
    let peak = vm(pid, "VmHWM:");
    quiet.extend((0..quiet_changes - quiet_changes / 2).map(|_| operator.change(&rt)));
    let metrics =
        aether_e2e::testing::scrape_metrics(&metrics_addr).expect("the registrar's metrics");
    println!(
        "registrar-flood: {flood_secs:.1} s of flood from {FLOOD_SOURCE} (flooder at nice 19)"
    );
    print!("{flooder_report}");
    println!(
        "registrar RSS before the flood: {:.1} MiB; peak (VmHWM): {:.1} MiB",
        rss_before as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    println!("TokenReviews the API server received during the flood: {reviews_during}");
    println!(
        "registrar CPU during the flood: {registrar_cpu:.1} s in {flood_secs:.1} s ({:.0}% of one core)",
        registrar_cpu / flood_secs * 100.0
    );
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
    println!(
        "operator change every {} ms -> the agent receives Envoy's ACK:",
        CHANGE_EVERY.as_millis()
    );
    let quiet = report("without the flood (before and after)", &quiet);
    let flooded = report("during the flood", &flooded);
    let p99 = |v: &[Duration]| percentile(v, 99.0).expect("samples");
    let bound = (p99(&quiet) * 2).max(Duration::from_millis(50));
    println!(
        "target: p99 during <= max(2 x p99 without, 50 ms) = {:.2} ms: {} ({:.2} ms)",
        ms(bound),
        if p99(&flooded) <= bound {
            "met"
        } else {
            "MISSED"
        },
        ms(p99(&flooded))
    );
    rig.pass();
}

/// The operator: one endpoint of the rig's service turned draining or healthy per change,
/// over its own TLS connection with its own token, paced at [`CHANGE_EVERY`].
struct Operator {
    client: RegistryClient<Channel>,
    token: String,
    upstreams: Vec<SocketAddr>,
    draining: bool,
    log: AgentLog,
    next: Instant,
}

impl Operator {
    /// One change, from just before the call to the agent's receipt of Envoy's ACK.
    fn change(&mut self, rt: &tokio::runtime::Runtime) -> Timing {
        std::thread::sleep(self.next.saturating_duration_since(Instant::now()));
        self.next = Instant::now() + CHANGE_EVERY;
        self.draining ^= true;
        let endpoints = self
            .upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| pb::Endpoint {
                address: u.ip().to_string(),
                port: u32::from(u.port()),
                service_port: 80,
                node: String::new(),
                pod: format!("{}-{i}", NodeRig::SERVICE),
                state: if i == 0 && self.draining {
                    pb::EndpointState::Draining
                } else {
                    pb::EndpointState::Healthy
                } as i32,
                mtls: false,
                quic: String::new(),
                quic_sni: String::new(),
            })
            .collect();
        let mut req = tonic::Request::new(pb::ApplyServicesRequest {
            services: vec![pb::Service {
                key: Some(pb::ServiceKey {
                    namespace: "default".into(),
                    name: NodeRig::SERVICE.into(),
                }),
                ports: vec![80],
                vip: String::new(),
                endpoints,
            }],
        });
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {}", self.token).parse().unwrap(),
        );
        self.log.skip_to_end();
        let (t0, wall0) = (Instant::now(), SystemTime::now());
        rt.block_on(self.client.apply_services(req))
            .expect("the operator's ApplyServices");
        let committed = t0.elapsed();
        let ex = self
            .log
            .wait(
                "the agent to log a load assignment push and its ACK",
                T_CHANGE,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        Timing {
            committed,
            held: since(wall0, ex.snapshot),
            acked: since(wall0, ex.acked),
        }
    }
}

/// One change's times from just before the call.
struct Timing {
    /// The call returned: the registrar committed it to etcd.
    committed: Duration,
    /// The agent held a snapshot with it (its watch, mirror and build).
    held: Duration,
    /// The agent received Envoy's ACK of it.
    acked: Duration,
}

/// Prints the three splits of `timings`, labelled `when`.
fn report(when: &str, timings: &[Timing]) -> Vec<Duration> {
    let split = |f: fn(&Timing) -> Duration| timings.iter().map(f).collect::<Vec<_>>();
    println!("{when}:");
    summary(
        "  call -> the call returns (etcd committed)",
        &split(|t| t.committed),
    );
    summary("  call -> the agent holds the change", &split(|t| t.held));
    let acked = split(|t| t.acked);
    summary("  call -> the agent has Envoy's ACK (total)", &acked);
    acked
}

/// The CPU time (user and system) process `pid` has used, in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let ticks: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse().ok())
        .collect();
    let hz: f64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0);
    ticks.iter().sum::<f64>() / hz
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
        node: "test-node".into(),
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
                    let client = match connect_from(&addr, Path::new(&ca)).await {
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

/// A registry client whose TLS connections come from [`FLOOD_SOURCE`].
async fn connect_from(addr: &str, ca: &Path) -> anyhow::Result<RegistryClient<Channel>> {
    let config = shared_proto::registry_tls::client_config(ca)?;
    let endpoint = aether_registrar::client::endpoint(addr, Duration::from_secs(5))?;
    let to: SocketAddr = addr.parse()?;
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let config = config.clone();
        async move {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::from((FLOOD_SOURCE, 0)))?;
            let tcp = socket.connect(to).await?;
            tcp.set_nodelay(true)?;
            let name = tokio_rustls::rustls::pki_types::ServerName::IpAddress(to.ip().into());
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    Ok(RegistryClient::new(
        endpoint.connect_with_connector(connector).await?,
    ))
}
