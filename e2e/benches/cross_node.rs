//! Cross-node propagation: a change applied through the registrar to the ACK by another
//! node's Envoy, at 1,000 services and 10,000 endpoints.
//!
//! `cargo build --release --workspace --bins && cargo bench -p aether-e2e --bench cross-node`
//! (release profile). Needs etcd (`/usr/bin/etcd`, Debian `etcd-server`) and Envoy
//! (`scripts/install-envoy.sh` or `ENVOY_BIN`). Env: `BENCH_CHANGES` (default 100, at
//! least 50), `BENCH_XDS_API` (`delta`, the default, or `sotw`).
//!
//! One etcd member and three registrars on it: a plain one that this process writes
//! through, as node A's side would, and the two that node B's agents watch as deployed,
//! over TLS: one authenticating agents by their node-bound tokens (`--token-review`, with
//! the test Kubernetes API server), one by their X.509-SVIDs (mutual TLS,
//! `--agent-spiffe-id spiffe://aether.test/aether-agent/{node}`, the agent's SVID from the
//! test identity provider's Workload API). Node B is run twice, side by side: two
//! [`NodeRig`]s (the real agent and a real Envoy each), one watching each registrar, so
//! that every change is timed to both Envoys in the same run. Every service's endpoints
//! run on `node-a`, so none is node B's own. Each change is one registry API call,
//! rotating through:
//! - a drain mark set or removed (`SetEndpointState` from node `node-a`, as node A's
//!   agent marks a deleted pod draining);
//! - an endpoint's applied state turned draining or healthy (`ApplyServices`);
//! - an endpoint moved to another port (`ApplyServices`: one removal and one upsert).
//!
//! A change is timed from just before the call to the moment each node B agent receives
//! its Envoy's ACK of the load assignment it pushed for it. The agent logs each push and
//! each ACK at debug level with their nonces (`aether_worker::xds::server`), and the
//! bench reads those lines' timestamps from the agent's log: Envoy applies a load
//! assignment on its main thread before it ACKs, and nothing polls that thread while a
//! change is timed. Polling Envoy's admin instead costs its main thread, the one that
//! runs xDS, about 2.5 ms per query at this size even for one cluster's endpoints
//! (`/config_dump?resource=dynamic_endpoint_configs&include_eds&name_regex=...`), and a
//! `/stats` query walks every stat of 1,000 clusters (the rig's stats poller is stopped
//! for that reason). Each change is then checked in Envoy with one such filtered query,
//! once the ACK is in, outside the timing: the service's endpoints must be what the
//! change made them. Unless `AETHER_E2E_AGENT_LOG` is set, the bench runs itself again
//! with it set to `info,aether_worker::xds::server=debug` for the agents it starts.
//!
//! The same lines split the time: the call returning (etcd committed), node B's agent
//! holding a snapshot with the change (the push's time less its `since_change_us`; the
//! registrar's watch, the stream to the agent, the agent's mirror and snapshot build),
//! and the push to the ACK (Envoy). The agent's `/ready` is checked after each change to
//! show `registrar.revision` at the change's revision (not polled while timing, since
//! every poll is work on the agent's one runtime thread).

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use aether_e2e::ack_loop::{Splits, check_applied};
use aether_e2e::envoy::ack_log::{AgentLog, ms, since, summary};
use aether_e2e::envoy::{AdsApi, NodeRig};
use aether_e2e::identity::{IdentityProvider, Options};
use aether_e2e::kube_api::KubeApi;
use aether_e2e::registrar::{
    AGENT_SA, Etcd, RegistrarProcess, TestCa, WorkerReadable, dump, envoy_eds, expected_eds,
    registrar_bin, token_review_api,
};
use aether_e2e::testing::{
    env_usize, free_port, identity_provider_for_agents_with, percentile, wait_for,
};
use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
use shared_proto::registry as pb;

const SERVICES: usize = 1_000;
const ENDPOINTS_PER_SERVICE: usize = 10;
const NAMESPACE: &str = "bench";
/// The node every endpoint runs on: not node B's (`test-node`, as the rig names it).
const NODE_A: &str = "node-a";
/// Endpoints 0-3 of a service take drain marks, 4-6 applied states, 7-9 port moves, so
/// that every change changes what Envoy holds.
const MARKED: std::ops::Range<usize> = 0..4;
const STATED: std::ops::Range<usize> = 4..7;
const MOVED: std::ops::Range<usize> = 7..10;
/// Changes made before the measured ones (the first ones pay for cold caches).
const WARMUP: usize = 3;
/// How long one change may take to be ACKed.
const T_CHANGE: Duration = Duration::from_secs(10);
/// The trust domain of the mutual-TLS registrar and the agent's SVID.
const TD: &str = "aether.test";
const REGISTRAR_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-registrar";
const OPS_ID: &str = "spiffe://aether.test/ops";
/// The operator user the token registrar's TokenReview names.
const OPERATOR: &str = "ops@example";

/// What the bench has put into the registry, to know what Envoy must show.
struct Mesh {
    ports: Vec<u16>,
    applied_draining: Vec<bool>,
    marked: Vec<bool>,
}

impl Mesh {
    fn new() -> Self {
        let n = SERVICES * ENDPOINTS_PER_SERVICE;
        Mesh {
            ports: vec![8080; n],
            applied_draining: vec![false; n],
            marked: vec![false; n],
        }
    }

    fn name(s: usize) -> String {
        format!("svc-{s}")
    }

    fn key(s: usize) -> pb::ServiceKey {
        pb::ServiceKey {
            namespace: NAMESPACE.into(),
            name: Self::name(s),
        }
    }

    /// Envoy's cluster for service `s` (its one port, 80).
    fn cluster(s: usize) -> String {
        aether_model::outbound_cluster_name(80, &Self::name(s), NAMESPACE)
    }

    fn address(s: usize, e: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 100 + (s / 250) as u8, (s % 250) as u8, e as u8 + 1)
    }

    fn service(&self, s: usize) -> pb::Service {
        let endpoints = (0..ENDPOINTS_PER_SERVICE)
            .map(|e| {
                let k = s * ENDPOINTS_PER_SERVICE + e;
                let state = if self.applied_draining[k] {
                    pb::EndpointState::Draining
                } else {
                    pb::EndpointState::Healthy
                };
                pb::Endpoint {
                    address: Self::address(s, e).to_string(),
                    port: u32::from(self.ports[k]),
                    service_port: 80,
                    node: NODE_A.into(),
                    pod: format!("{}-{e}", Self::name(s)),
                    state: state as i32,
                    mtls: false,
                    quic: String::new(),
                    quic_sni: String::new(),
                }
            })
            .collect();
        pb::Service {
            key: Some(Self::key(s)),
            ports: vec![80],
            vip: String::new(),
            endpoints,
        }
    }

    /// Service `s`'s endpoints as Envoy's config dump should show them, as
    /// `aether_e2e::envoy::endpoints` writes them. The dump renders a host's health, and
    /// an EDS DRAINING host's is UNHEALTHY (`/clusters` shows the EDS status itself, but
    /// for every cluster at once); the agent sends only HEALTHY and DRAINING.
    fn expected(&self, s: usize) -> Vec<String> {
        let mut out: Vec<String> = (0..ENDPOINTS_PER_SERVICE)
            .map(|e| {
                let k = s * ENDPOINTS_PER_SERVICE + e;
                let health = if self.applied_draining[k] || self.marked[k] {
                    "UNHEALTHY"
                } else {
                    "HEALTHY"
                };
                format!("{}:{} {health}", Self::address(s, e), self.ports[k])
            })
            .collect();
        out.sort();
        out
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Mark,
    State,
    Port,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Mark, Kind::State, Kind::Port];

    fn label(self) -> &'static str {
        match self {
            Kind::Mark => "  drain mark set/removed (SetEndpointState)",
            Kind::State => "  endpoint state (ApplyServices)",
            Kind::Port => "  endpoint port move (ApplyServices)",
        }
    }
}

fn main() {
    let Some((envoy_bin, etcd)) = aether_e2e::registrar::bench_start("cross-node") else {
        return;
    };
    let changes = env_usize("BENCH_CHANGES", 100).max(50);
    let api: AdsApi = std::env::var("BENCH_XDS_API")
        .map(|v| v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}")))
        .unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the registry client");

    // The rig registers its loopback upstreams at the registrar.
    let registrar = RegistrarProcess::tcp(
        &registrar_bin(),
        &etcd.endpoints(),
        &["--allow-loopback-endpoints"],
    );
    let mut client = rt
        .block_on(aether_registrar::client::connect(
            registrar.addr(),
            Duration::from_secs(10),
            None,
        ))
        .expect("connect to the registrar");
    let mut mesh = Mesh::new();
    let t = Instant::now();
    let all: Vec<pb::Service> = (0..SERVICES).map(|s| mesh.service(s)).collect();
    rt.block_on(client.apply_services(pb::ApplyServicesRequest { services: all }))
        .expect("apply the mesh");
    println!(
        "cross-node: {SERVICES} services, {} endpoints on {NODE_A}, applied in {:.0} ms; ADS {}, Envoy {}",
        SERVICES * ENDPOINTS_PER_SERVICE,
        ms(t.elapsed()),
        api.api_type(),
        envoy_bin.display()
    );

    let t = Instant::now();
    let (_authenticated, mut watchers) = start_watchers(&envoy_bin, api, &etcd);
    let want = expected_eds(&dump(registrar.addr()));
    for w in &mut watchers {
        // The rig's stats poller walks every stat Envoy has, 1,000 clusters' worth, on the
        // thread that runs xDS, every 2 ms: it would delay what this measures.
        w.rig.poller.stop();
        wait_for(
            &format!(
                "node B's Envoy ({}) to hold every service's endpoints",
                w.label
            ),
            Duration::from_secs(60),
            || {
                let (_, body) = w.rig.envoy.get("/config_dump?include_eds").ok()?;
                (envoy_eds(&serde_json::from_str(&body).ok()?) == want).then_some(())
            },
        );
    }
    println!(
        "node B twice (token, mutual TLS): agents and Envoys started, each Envoy holds all {} clusters' endpoints after {:.0} ms",
        want.len(),
        ms(t.elapsed())
    );

    let mut to_commit = Vec::new();
    let mut by_kind: [[Vec<Duration>; 3]; 2] = Default::default();
    let mut late_in_dump = 0;
    for i in 0..WARMUP + changes {
        let kind = Kind::ALL[i % 3];
        // Consecutive changes touch services far apart; 7919 is prime to 1,000.
        let s = (i * 7919) % SERVICES;
        let round = i / (3 * SERVICES);
        let pick =
            |r: std::ops::Range<usize>| s * ENDPOINTS_PER_SERVICE + r.start + round % r.len();
        for w in &mut watchers {
            w.log.skip_to_end();
        }
        let (t0, wall0);
        let revision = match kind {
            Kind::Mark => {
                let k = pick(MARKED);
                mesh.marked[k] ^= true;
                let state = if mesh.marked[k] {
                    pb::EndpointState::Draining
                } else {
                    pb::EndpointState::Healthy
                };
                let req = pb::SetEndpointStateRequest {
                    service: Some(Mesh::key(s)),
                    address: Mesh::address(s, k % ENDPOINTS_PER_SERVICE).to_string(),
                    state: state as i32,
                    node: NODE_A.into(),
                    instance: "node-a-agent".into(),
                };
                (t0, wall0) = (Instant::now(), SystemTime::now());
                rt.block_on(client.set_endpoint_state(req))
                    .expect("SetEndpointState")
                    .into_inner()
                    .revision
            }
            Kind::State | Kind::Port => {
                if let Kind::State = kind {
                    let k = pick(STATED);
                    mesh.applied_draining[k] ^= true;
                } else {
                    let k = pick(MOVED);
                    mesh.ports[k] = if mesh.ports[k] == 8080 { 9090 } else { 8080 };
                }
                let req = pb::ApplyServicesRequest {
                    services: vec![mesh.service(s)],
                };
                (t0, wall0) = (Instant::now(), SystemTime::now());
                rt.block_on(client.apply_services(req))
                    .expect("ApplyServices")
                    .into_inner()
                    .revision
            }
        };
        let committed = t0.elapsed();
        let exchanges: Vec<_> = watchers
            .iter_mut()
            .map(|w| {
                w.log
                    .wait(
                        &format!(
                            "change {i}: node B's agent ({}) to log a load assignment push and its ACK",
                            w.label
                        ),
                        T_CHANGE,
                    )
                    .unwrap_or_else(|e| panic!("{e}\n{}", w.rig.where_to_look()))
            })
            .collect();

        // Outside the timing: each Envoy holds what the change made, and each agent's view
        // is at the change's revision.
        let (cluster, want) = (Mesh::cluster(s), mesh.expected(s));
        for w in &watchers {
            let what = format!("change {i} at node B ({})", w.label);
            late_in_dump += usize::from(check_applied(&w.rig, &what, &cluster, &want, revision));
        }
        if i < WARMUP {
            continue;
        }
        to_commit.push(committed);
        for (w, ex) in watchers.iter_mut().zip(&exchanges) {
            w.splits.push(wall0, ex);
        }
        for (k, ex) in exchanges.iter().enumerate() {
            by_kind[k][i % 3].push(since(wall0, ex.acked));
        }
    }

    summary("call -> the call returns (etcd committed)", &to_commit);
    for (k, w) in watchers.iter().enumerate() {
        println!("node B watching the registrar {}:", w.label);
        summary(
            "  call -> node B's agent holds the change",
            &w.splits.to_snapshot,
        );
        summary("    snapshot -> push (agent)", &w.splits.to_push);
        summary("    push -> ACK (Envoy, at the agent)", &w.splits.to_ack);
        summary("  call -> node B's Envoy ACKed it (total)", &w.splits.total);
        for kind in Kind::ALL {
            summary(kind.label(), &by_kind[k][kind as usize]);
        }
    }
    let p99 = |w: &Watcher| percentile(&w.splits.total, 99.0).expect("samples");
    let met = watchers.iter().all(|w| p99(w) <= Duration::from_millis(25));
    println!(
        "target p99 <= 25 ms: {} ({} over {} changes, after {WARMUP} unmeasured); changes not yet in Envoy's config dump at their ACK: {late_in_dump}",
        if met { "met" } else { "MISSED" },
        watchers
            .iter()
            .map(|w| format!("{}: p99 {:.2} ms", w.label, ms(p99(w))))
            .collect::<Vec<_>>()
            .join(", "),
        to_commit.len()
    );

    // In the end each Envoy's whole EDS equals the registrar's view, and that is what the
    // bench applied.
    let want = expected_eds(&dump(registrar.addr()));
    for w in &watchers {
        let (_, body) = w
            .rig
            .envoy
            .get("/config_dump?include_eds")
            .expect("Envoy's config dump");
        let got = envoy_eds(&serde_json::from_str(&body).expect("config dump is JSON"));
        assert!(
            got == want,
            "Envoy's EDS ({}) differs from the registrar's view at the end\n{}",
            w.label,
            w.rig.where_to_look()
        );
    }
    for s in 0..SERVICES {
        let applied = want.get(&Mesh::cluster(s)).map(|eps| {
            eps.iter()
                .map(|e| e.replace(" DRAINING", " UNHEALTHY"))
                .collect::<Vec<_>>()
        });
        assert_eq!(
            applied,
            Some(mesh.expected(s)),
            "the registrar holds what the bench applied for {}",
            Mesh::name(s)
        );
    }
    println!(
        "at the end both node B Envoys hold exactly the registrar's view ({} clusters)",
        want.len()
    );
    for mut w in watchers {
        w.rig.pass();
    }
}

/// One node B: its rig, its agent's log, and its figures.
struct Watcher {
    label: &'static str,
    rig: NodeRig,
    log: AgentLog,
    splits: Splits,
}

impl Watcher {
    fn new(label: &'static str, rig: NodeRig) -> Watcher {
        let log = AgentLog::new(&rig.owner.log_path);
        Watcher {
            label,
            rig,
            log,
            splits: Splits::default(),
        }
    }
}

/// What the two node B's watch through, held until the bench ends (each process is ended
/// on drop).
struct Authenticated {
    _by_token: RegistrarProcess,
    _by_svid: RegistrarProcess,
    _kube: KubeApi,
    _provider: IdentityProvider,
    _idp_dir: tempfile::TempDir,
    /// The files the workers read: their CA, token and bundle.
    _files: WorkerReadable,
}

/// The two authenticated registrars on `etcd` and a node B watching each: by token
/// (TLS, `--token-review`) and by SVID (mutual TLS).
fn start_watchers(envoy_bin: &Path, api: AdsApi, etcd: &Etcd) -> (Authenticated, Vec<Watcher>) {
    // Where the workers can read their CA, token and bundle.
    let files = WorkerReadable::new("aether-cross-node-");
    let listen = || format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());

    // By token: TLS with a test CA, TokenReview with the test API server.
    let ca = TestCa::new("cross-node CA");
    let (serve_cert, serve_key) = ca.leaf("registrar-serving", &["127.0.0.1"], ServerAuth);
    let (kube, kubeconfig) = token_review_api("test-node");
    let ca_file = files.put("ca.crt", &std::fs::read(ca.ca_file()).unwrap());
    let agent_token = files.put("agent-token", kube.token(AGENT_SA).as_bytes());
    let ops_token = files.put("ops-token", kube.token(OPERATOR).as_bytes());
    let token_addr = listen();
    let by_token = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &token_addr,
        &[
            "--tls-cert",
            &serve_cert.display().to_string(),
            "--tls-key",
            &serve_key.display().to_string(),
            "--token-review",
            "--kubeconfig",
            &kubeconfig,
            "--discovery",
            "off",
            "--agent-service-account",
            "aether-system/aether-agent",
            "--operator-user",
            OPERATOR,
            "--allow-loopback-endpoints",
        ],
    );
    let token_rig = NodeRig::start_at(
        envoy_bin,
        api,
        Some((&token_addr, &["--ca", &ca_file, "--token-file", &ops_token])),
        &[
            format!("--registrar-ca={ca_file}").as_str(),
            format!("--registrar-token-file={agent_token}").as_str(),
        ],
    );

    // By SVID: the registrar's certificate and the operator's from the identity provider,
    // whose Workload API gives the agent `spiffe://aether.test/aether-agent/test-node`.
    let mut options = Options::new(TD);
    options.agent_path = "/aether-agent/test-node".into();
    let (idp_dir, provider) = identity_provider_for_agents_with(options);
    let bundle = files.put("bundle.pem", provider.ca_pem().as_bytes());
    let (cert, key) = provider.mint_server(REGISTRAR_ID, &[IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let (cert, key) = (
        files.put("tls.crt", cert.as_bytes()),
        files.put("tls.key", key.as_bytes()),
    );
    let (ops_cert, ops_key) = provider.mint(OPS_ID);
    let (ops_cert, ops_key) = (
        files.put("ops.crt", ops_cert.as_bytes()),
        files.put("ops.key", ops_key.as_bytes()),
    );
    let mtls_addr = listen();
    let by_svid = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &mtls_addr,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--client-ca-bundle",
            &bundle,
            "--trust-domain",
            TD,
            "--agent-spiffe-id",
            "spiffe://aether.test/aether-agent/{node}",
            "--operator-spiffe-id",
            OPS_ID,
            "--allow-loopback-endpoints",
        ],
    );
    let svid_rig = NodeRig::start_at(
        envoy_bin,
        api,
        Some((
            &mtls_addr,
            &["--ca", &bundle, "--cert", &ops_cert, "--key", &ops_key],
        )),
        &[
            format!("--registrar-spiffe-id={REGISTRAR_ID}").as_str(),
            format!(
                "--spiffe-endpoint=unix://{}",
                provider.workload_socket().display()
            )
            .as_str(),
            format!("--trust-domain={TD}").as_str(),
        ],
    );
    (
        Authenticated {
            _by_token: by_token,
            _by_svid: by_svid,
            _kube: kube,
            _provider: provider,
            _idp_dir: idp_dir,
            _files: files,
        },
        vec![
            Watcher::new("by token (TLS)", token_rig),
            Watcher::new("by SVID (mutual TLS)", svid_rig),
        ],
    )
}
