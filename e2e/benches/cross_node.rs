//! Cross-node propagation: a change applied through the registrar to the ACK by another
//! node's Envoy, at 1,000 services and 10,000 endpoints.
//!
//! `cargo build --release --workspace --bins && cargo bench -p aether-e2e --bench cross-node`
//! (release profile). Needs etcd (`/usr/bin/etcd`, Debian `etcd-server`) and Envoy
//! (`scripts/install-envoy.sh` or `ENVOY_BIN`). Env: `BENCH_CHANGES` (default 100, at
//! least 50), `BENCH_XDS_API` (`delta`, the default, or `sotw`).
//!
//! One etcd member, one registrar, and node B: a [`NodeRig`] (the real agent and a real
//! Envoy) watching the registrar. Every service's endpoints run on `node-a`, so none is
//! node B's own. Each change is one registry API call made from this process, as node A's
//! side would make it, rotating through:
//! - a drain mark set or removed (`SetEndpointState` from node `node-a`, as node A's
//!   agent marks a deleted pod draining);
//! - an endpoint's applied state turned draining or healthy (`ApplyServices`);
//! - an endpoint moved to another port (`ApplyServices`: one removal and one upsert).
//!
//! A change is timed from just before the call to the moment node B's Envoy shows it:
//! the changed service's load assignment read back from Envoy's admin
//! (`/config_dump?resource=dynamic_endpoint_configs&include_eds&name_regex=<cluster>`)
//! equals what the change makes it. Envoy applies a load assignment on its main thread
//! and then ACKs it, so what its config dump shows is what it ACKed. The filtered dump
//! builds one cluster's endpoints, not 1,000 (about a tenth of a millisecond of Envoy's
//! main thread, printed as "poll cost"); a whole `include_eds` dump or a `/stats` query
//! walks every cluster, and the rig's stats poller is stopped for the same reason.
//!
//! The registrar's share is timed too: from the call to the agent's `/ready` showing
//! `registrar.revision` at the change's revision (etcd's commit, the registrar's watch,
//! the stream to the agent, the agent's mirror and its snapshot build), polled every
//! 0.5 ms on the agent's health socket in a thread of its own.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, NodeRig};
use aether_e2e::registrar::{Etcd, RegistrarProcess, dump, envoy_eds, expected_eds, registrar_bin};
use aether_e2e::testing::{http_get_unix, percentile, wait_for};
use serde_json::Value;
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
/// How long one change may take to show in Envoy.
const T_CHANGE: Duration = Duration::from_secs(10);

/// What the bench has put into the registry, to know what Envoy must show.
struct Mesh {
    ports: Vec<u16>,
    applied_draining: Vec<bool>,
    marked: Vec<bool>,
}

impl Mesh {
    fn new() -> Self {
        let n = SERVICES * ENDPOINTS_PER_SERVICE;
        Mesh { ports: vec![8080; n], applied_draining: vec![false; n], marked: vec![false; n] }
    }

    fn name(s: usize) -> String {
        format!("svc-{s}")
    }

    fn key(s: usize) -> pb::ServiceKey {
        pb::ServiceKey { namespace: NAMESPACE.into(), name: Self::name(s) }
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
                let state = if self.applied_draining[k] { pb::EndpointState::Draining } else { pb::EndpointState::Healthy };
                pb::Endpoint {
                    address: Self::address(s, e).to_string(),
                    port: u32::from(self.ports[k]),
                    service_port: 80,
                    node: NODE_A.into(),
                    pod: format!("{}-{e}", Self::name(s)),
                    state: state as i32,
                }
            })
            .collect();
        pb::Service { key: Some(Self::key(s)), ports: vec![80], vip: String::new(), endpoints }
    }

    /// Service `s`'s endpoints as Envoy's EDS should hold them, as
    /// `aether_e2e::envoy::endpoints` writes them.
    fn expected(&self, s: usize) -> Vec<String> {
        let mut out: Vec<String> = (0..ENDPOINTS_PER_SERVICE)
            .map(|e| {
                let k = s * ENDPOINTS_PER_SERVICE + e;
                let health = if self.applied_draining[k] || self.marked[k] { "DRAINING" } else { "HEALTHY" };
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

/// The endpoints of one load assignment in a filtered config dump, as
/// `aether_e2e::envoy::endpoints` writes them; None when the dump does not hold `cluster`.
fn endpoints_of(dump: &Value, cluster: &str) -> Option<Vec<String>> {
    let configs = dump["configs"].as_array()?;
    let config = configs.iter().map(|c| &c["endpoint_config"]).find(|c| c["cluster_name"] == cluster)?;
    let mut out: Vec<String> = config["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["lb_endpoints"].as_array().cloned().unwrap_or_default())
        .map(|lb| {
            let sa = &lb["endpoint"]["address"]["socket_address"];
            format!(
                "{}:{} {}",
                sa["address"].as_str().unwrap_or("?"),
                sa["port_value"].as_u64().unwrap_or(0),
                lb["health_status"].as_str().unwrap_or("UNKNOWN")
            )
        })
        .collect();
    out.sort();
    Some(out)
}

/// The admin path that dumps only `cluster`'s load assignment.
fn eds_query(cluster: &str) -> String {
    let escaped: String = cluster.chars().flat_map(|c| if "\\.|()[]{}^$*+?".contains(c) { vec!['\\', c] } else { vec![c] }).collect();
    format!("/config_dump?resource=dynamic_endpoint_configs&include_eds&name_regex={}", envoy::encode(&format!("^{escaped}$")))
}

/// Every registrar revision the agent's `/ready` showed, with when it was first seen.
struct RevisionWatch {
    seen: Arc<Mutex<Vec<(i64, Instant)>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RevisionWatch {
    fn start(health_sock: PathBuf) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut last = -1;
            while !st.load(Ordering::Relaxed) {
                if let Ok((_, body)) = http_get_unix(&health_sock, "/ready") {
                    let now = Instant::now();
                    let rev = serde_json::from_str::<Value>(&body).ok().and_then(|v| v["registrar"]["revision"].as_i64());
                    if let Some(rev) = rev.filter(|r| *r != last) {
                        s.lock().unwrap().push((rev, now));
                        last = rev;
                    }
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        });
        RevisionWatch { seen, stop, thread: Some(thread) }
    }

    /// When the agent was first seen at `revision` or later.
    fn reached(&self, revision: i64) -> Option<Instant> {
        self.seen.lock().unwrap().iter().find(|(r, _)| *r >= revision).map(|(_, t)| *t)
    }
}

impl Drop for RevisionWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(name: &str, v: &[Duration]) {
    let at = |p: f64| ms(percentile(v, p).expect("samples"));
    println!("{name:<48} n={:<4} median {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms", v.len(), at(50.0), at(99.0), at(100.0));
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and a debug
    // build's figures mean nothing, so do not run then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("cross-node: run with `cargo bench -p aether-e2e --bench cross-node`; skipping");
        return;
    }
    let Some(envoy_bin) = envoy::envoy_bin() else {
        eprintln!("cross-node: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
        std::process::exit(2);
    };
    let Some(etcd) = Etcd::start_or_skip("cross-node") else { std::process::exit(2) };
    let changes: usize = std::env::var("BENCH_CHANGES").ok().and_then(|v| v.parse().ok()).unwrap_or(100).max(50);
    let api: AdsApi = std::env::var("BENCH_XDS_API").map(|v| v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}"))).unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime for the registry client");

    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &[]);
    let mut client =
        rt.block_on(aether_registrar::client::connect(registrar.addr(), Duration::from_secs(10))).expect("connect to the registrar");
    let mut mesh = Mesh::new();
    let t = Instant::now();
    let all: Vec<pb::Service> = (0..SERVICES).map(|s| mesh.service(s)).collect();
    rt.block_on(client.apply_services(pb::ApplyServicesRequest { services: all })).expect("apply the mesh");
    println!(
        "cross-node: {SERVICES} services, {} endpoints on {NODE_A}, applied in {:.0} ms; ADS {}, Envoy {}",
        SERVICES * ENDPOINTS_PER_SERVICE,
        ms(t.elapsed()),
        api.api_type(),
        envoy_bin.display()
    );

    let t = Instant::now();
    let mut rig = NodeRig::start_from(&envoy_bin, api, Some(registrar.addr()), &[]);
    // The rig's stats poller walks every stat Envoy has, 1,000 clusters' worth, on the
    // thread that runs xDS, every 2 ms: it would delay what this measures.
    rig.poller.stop();
    let want = expected_eds(&dump(registrar.addr()));
    wait_for("node B's Envoy to hold every service's endpoints", Duration::from_secs(60), || {
        let (_, body) = rig.envoy.get("/config_dump?include_eds").ok()?;
        (envoy_eds(&serde_json::from_str(&body).ok()?) == want).then_some(())
    });
    println!("node B: agent and Envoy started, Envoy holds all {} clusters' endpoints after {:.0} ms", want.len(), ms(t.elapsed()));

    let revisions = RevisionWatch::start(rig.owner.health_sock.clone());
    let mut poll_cost = Vec::new();
    let mut to_envoy = Vec::new();
    let mut to_agent = Vec::new();
    let mut to_commit = Vec::new();
    let mut by_kind: [Vec<Duration>; 3] = Default::default();
    for i in 0..WARMUP + changes {
        let kind = Kind::ALL[i % 3];
        // Consecutive changes touch services far apart; 7919 is prime to 1,000.
        let s = (i * 7919) % SERVICES;
        let round = i / (3 * SERVICES);
        let pick = |r: std::ops::Range<usize>| s * ENDPOINTS_PER_SERVICE + r.start + round % r.len();
        let t0;
        let revision = match kind {
            Kind::Mark => {
                let k = pick(MARKED);
                mesh.marked[k] ^= true;
                let state = if mesh.marked[k] { pb::EndpointState::Draining } else { pb::EndpointState::Healthy };
                let req = pb::SetEndpointStateRequest {
                    service: Some(Mesh::key(s)),
                    address: Mesh::address(s, k % ENDPOINTS_PER_SERVICE).to_string(),
                    state: state as i32,
                    node: NODE_A.into(),
                    instance: "node-a-agent".into(),
                };
                t0 = Instant::now();
                rt.block_on(client.set_endpoint_state(req)).expect("SetEndpointState").into_inner().revision
            }
            Kind::State | Kind::Port => {
                if let Kind::State = kind {
                    let k = pick(STATED);
                    mesh.applied_draining[k] ^= true;
                } else {
                    let k = pick(MOVED);
                    mesh.ports[k] = if mesh.ports[k] == 8080 { 9090 } else { 8080 };
                }
                let req = pb::ApplyServicesRequest { services: vec![mesh.service(s)] };
                t0 = Instant::now();
                rt.block_on(client.apply_services(req)).expect("ApplyServices").into_inner().revision
            }
        };
        let committed = t0.elapsed();
        let (cluster, want) = (Mesh::cluster(s), mesh.expected(s));
        let query = eds_query(&cluster);
        let shown = loop {
            let p0 = Instant::now();
            let got = rig.envoy.get(&query).ok().and_then(|(_, b)| serde_json::from_str::<Value>(&b).ok());
            let now = Instant::now();
            poll_cost.push(now - p0);
            let last = got.as_ref().and_then(|d| endpoints_of(d, &cluster));
            if last.as_ref() == Some(&want) {
                break now - t0;
            }
            assert!(t0.elapsed() < T_CHANGE, "change {i} to {cluster} not in Envoy after {T_CHANGE:?}: Envoy holds {last:?}, want {want:?}\n{}", rig.where_to_look());
        };
        let agent = wait_for(&format!("the agent at revision {revision}"), T_CHANGE, || revisions.reached(revision));
        if i < WARMUP {
            continue;
        }
        to_commit.push(committed);
        to_agent.push(agent.saturating_duration_since(t0));
        to_envoy.push(shown);
        by_kind[i % 3].push(shown);
    }
    drop(revisions);

    summary("poll cost (one filtered config_dump)", &poll_cost);
    summary("call -> etcd committed (the call returns)", &to_commit);
    summary("call -> node B's agent at the revision (/ready)", &to_agent);
    summary("call -> node B's Envoy holds it (ACK)", &to_envoy);
    for k in Kind::ALL {
        summary(k.label(), &by_kind[k as usize]);
    }
    let p99 = percentile(&to_envoy, 99.0).expect("samples");
    println!("target p99 <= 25 ms: {} (p99 {:.2} ms, {} changes after {WARMUP} unmeasured)", if p99 <= Duration::from_millis(25) { "met" } else { "MISSED" }, ms(p99), to_envoy.len());

    // In the end Envoy's whole EDS equals the registrar's view.
    let want = expected_eds(&dump(registrar.addr()));
    let (_, body) = rig.envoy.get("/config_dump?include_eds").expect("Envoy's config dump");
    let got = envoy_eds(&serde_json::from_str(&body).expect("config dump is JSON"));
    assert!(got == want, "Envoy's EDS differs from the registrar's view at the end\n{}", rig.where_to_look());
    for s in 0..SERVICES {
        assert_eq!(want.get(&Mesh::cluster(s)), Some(&mesh.expected(s)), "the registrar holds what the bench applied for {}", Mesh::name(s));
    }
    println!("at the end node B's Envoy holds exactly the registrar's view ({} clusters)", want.len());
    rig.pass();
}
