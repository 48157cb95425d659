//! Discovery to Envoy: an EndpointSlice change in the Kubernetes API to the ACK by a
//! node's Envoy, through the registrar's discovery, at 1,000 Services.
//!
//! `cargo build --release --workspace --bins && cargo bench -p aether-e2e --bench discovery-ack`
//! (release profile). Needs etcd (`/usr/bin/etcd`, Debian `etcd-server`) and Envoy
//! (`scripts/install-envoy.sh` or `ENVOY_BIN`). Env: `BENCH_CHANGES` (default 100, at
//! least 50), `BENCH_SERVICES` (default 1,000) for a shorter run.
//!
//! The test Kubernetes API server (`aether_e2e::kube_api`), one etcd member, one
//! `aether-registrar serve` with discovery on (it takes the Lease and leads; its API user
//! has exactly the chart's discovery and Lease rules), and a node: a [`NodeRig`] (the real
//! agent and a real Envoy) watching the registrar. Each Service has one EndpointSlice of
//! 10 endpoints on `node-a`, so none is the node's own (`test-node`). Each change is one
//! write of a slice to the API server, rotating through:
//! - an endpoint turning terminating (Envoy holds it draining), and later ready again;
//! - an endpoint added (a scale up), and later removed (a scale down).
//!
//! A change is timed from just before the write to the moment the node's agent receives
//! Envoy's ACK of the load assignment it pushed for it, read from the agent's log
//! ([`ack_log`] says why the log and not Envoy's admin). The split: the registrar's
//! "discovered service written" line (logged once etcd committed the write), the agent
//! holding a snapshot with the change (the push's time less its `since_change_us`), and
//! the push to the ACK. After the ACK, outside the timing, Envoy's config dump filtered to
//! the service's cluster must show what the change made, and the agent's `/ready` the
//! revision the registrar wrote.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant, SystemTime};

use aether_e2e::ack_loop::{Splits, check_applied};
use aether_e2e::envoy::ack_log::{AgentLog, field, ms, parse_utc, since, summary};
use aether_e2e::envoy::{AdsApi, NodeRig};
use aether_e2e::kube_api::KubeApi;
use aether_e2e::registrar::{
    DISCOVERY_RULES, LEASE_NAME as LEASE, LEASE_NAMESPACE as LEASE_NS, REGISTRAR_USER as USER,
    RegistrarProcess, dump, envoy_eds, expected_eds, registrar_bin,
};
use aether_e2e::testing::{env_usize, percentile, try_wait_for, wait_for};
use serde_json::{Value, json};

const ENDPOINTS_PER_SERVICE: usize = 10;
const NAMESPACE: &str = "bench";
/// The node every endpoint runs on: not the rig's (`test-node`).
const NODE_A: &str = "node-a";
/// Changes made before the measured ones (one of each kind; the first ones pay for cold
/// caches).
const WARMUP: usize = 4;
/// How long one change may take to be ACKed.
const T_CHANGE: Duration = Duration::from_secs(10);
/// How long the registrar and the node may take to take in every Service.
const T_START: Duration = Duration::from_secs(120);
const TARGET: Duration = Duration::from_millis(50);

/// What the bench has put into the API server, to know what Envoy must show.
struct Mesh {
    /// Per Service, the endpoint that is terminating, if one is.
    terminating: Vec<Option<usize>>,
    /// Per Service, whether its slice has the scaled-up endpoint (one more than
    /// [`ENDPOINTS_PER_SERVICE`]).
    scaled: Vec<bool>,
}

impl Mesh {
    fn new(services: usize) -> Self {
        assert!(
            services <= 30_000,
            "BENCH_SERVICES={services}: addresses run out above 30,000"
        );
        Mesh {
            terminating: vec![None; services],
            scaled: vec![false; services],
        }
    }

    fn name(s: usize) -> String {
        format!("svc-{s}")
    }

    /// Envoy's cluster for Service `s` (its one port, 80).
    fn cluster(s: usize) -> String {
        aether_model::outbound_cluster_name(80, &Self::name(s), NAMESPACE)
    }

    fn address(s: usize, e: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 100 + (s / 250) as u8, (s % 250) as u8, e as u8 + 1)
    }

    fn endpoints(&self, s: usize) -> usize {
        ENDPOINTS_PER_SERVICE + usize::from(self.scaled[s])
    }

    fn service(s: usize) -> Value {
        let vip = Ipv4Addr::new(10, 96, (s / 250) as u8, (s % 250) as u8 + 1);
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": NAMESPACE, "name": Self::name(s)},
               "spec": {"clusterIP": vip.to_string(), "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}})
    }

    /// Service `s`'s one EndpointSlice as the EndpointSlice controller would write it.
    fn slice(&self, s: usize) -> Value {
        let endpoints: Vec<Value> = (0..self.endpoints(s))
            .map(|e| {
                let terminating = self.terminating[s] == Some(e);
                json!({"addresses": [Self::address(s, e).to_string()], "nodeName": NODE_A,
                       "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": format!("{}-{e}", Self::name(s))},
                       "conditions": {"ready": !terminating, "serving": true, "terminating": terminating}})
            })
            .collect();
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"namespace": NAMESPACE, "name": format!("{}-a", Self::name(s)), "labels": {"kubernetes.io/service-name": Self::name(s)}},
               "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "endpoints": endpoints})
    }

    /// Service `s`'s endpoints as Envoy's config dump should show them, as
    /// `ack_log::endpoints_of` writes them (a DRAINING host shows as UNHEALTHY there).
    fn expected(&self, s: usize) -> Vec<String> {
        let mut out: Vec<String> = (0..self.endpoints(s))
            .map(|e| {
                let health = if self.terminating[s] == Some(e) {
                    "UNHEALTHY"
                } else {
                    "HEALTHY"
                };
                format!("{}:8080 {health}", Self::address(s, e))
            })
            .collect();
        out.sort();
        out
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Terminating,
    Added,
    Ready,
    Removed,
}

impl Kind {
    /// In the order made: each Service's endpoint turns terminating and ready again, and
    /// another Service scales up and down, with the other kind's change in between.
    const ALL: [Kind; 4] = [Kind::Terminating, Kind::Added, Kind::Ready, Kind::Removed];

    fn label(self) -> &'static str {
        match self {
            Kind::Terminating => "  endpoint turns terminating (draining)",
            Kind::Added => "  endpoint added (scale up)",
            Kind::Ready => "  endpoint ready again",
            Kind::Removed => "  endpoint removed (scale down)",
        }
    }
}

/// Service `s`'s endpoints in `eds` (as `expected_eds` writes a registrar's view), as
/// [`Mesh::expected`] writes them.
fn held(eds: &BTreeMap<String, Vec<String>>, s: usize) -> Option<Vec<String>> {
    let mut eps: Vec<String> = eds
        .get(&Mesh::cluster(s))?
        .iter()
        .map(|e| e.replace(" DRAINING", " UNHEALTHY"))
        .collect();
    eps.sort();
    Some(eps)
}

/// The registrar's log from where the last change began.
struct RegistrarLog {
    seen: usize,
}

impl RegistrarLog {
    fn skip_to_end(&mut self, registrar: &RegistrarProcess) {
        self.seen = registrar.log().len();
    }

    /// When the registrar logged that etcd holds its write of `service`
    /// ("namespace/name") since the last skip, and at which revision.
    fn written(&self, registrar: &RegistrarProcess, service: &str) -> Option<(SystemTime, i64)> {
        let log = registrar.log();
        let line = log.get(self.seen..)?.lines().find(|l| {
            l.contains(" discovered service written ") && field(l, "service") == Some(service)
        })?;
        let at = line.split(' ').next().and_then(parse_utc);
        let revision = field(line, "revision").and_then(|r| r.parse().ok());
        Some((
            at.unwrap_or_else(|| panic!("unreadable registrar line {line:?}")),
            revision.unwrap_or_else(|| panic!("no revision in {line:?}")),
        ))
    }
}

fn main() {
    let Some((envoy_bin, etcd)) = aether_e2e::registrar::bench_start("discovery-ack") else {
        return;
    };
    let changes = env_usize("BENCH_CHANGES", 100).max(50);
    let services = env_usize("BENCH_SERVICES", 1_000).max(1);
    let api_type = AdsApi::default();

    let kube = KubeApi::start();
    kube.grant(USER, DISCOVERY_RULES);
    let kubeconfig = kube.kubeconfig(USER).display().to_string();
    let mut mesh = Mesh::new(services);
    for s in 0..services {
        kube.put_service(Mesh::service(s));
        kube.put_endpoint_slice(mesh.slice(s));
    }
    let t = Instant::now();
    let flags = [
        "--kubeconfig",
        &kubeconfig,
        "--discovery",
        "on",
        "--lease-namespace",
        LEASE_NS,
        "--lease-name",
        LEASE,
        "--lease-duration",
        "15",
        "--leader-id",
        "r1",
        // The rig registers its loopback upstreams at the registrar.
        "--allow-loopback-endpoints",
    ];
    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &flags);
    registrar.wait_log("leading", T_START);
    wait_for(
        "the registrar to write every Service into etcd",
        T_START,
        || {
            let eds = expected_eds(&dump(registrar.addr()));
            (0..services)
                .all(|s| held(&eds, s) == Some(mesh.expected(s)))
                .then_some(())
        },
    );
    println!(
        "discovery-ack: {services} Services, {} endpoints on {NODE_A}, in etcd {:.0} ms after the registrar started; ADS {}, Envoy {}",
        services * ENDPOINTS_PER_SERVICE,
        ms(t.elapsed()),
        api_type.api_type(),
        envoy_bin.display()
    );

    let t = Instant::now();
    let mut rig = NodeRig::start_from(&envoy_bin, api_type, Some(registrar.addr()), &[]);
    // The rig's stats poller walks every stat Envoy has, 1,000 clusters' worth, on the
    // thread that runs xDS, every 2 ms: it would delay what this measures.
    rig.poller.stop();
    let want = expected_eds(&dump(registrar.addr()));
    wait_for(
        "the node's Envoy to hold every service's endpoints",
        T_START,
        || {
            let (_, body) = rig.envoy.get("/config_dump?include_eds").ok()?;
            (envoy_eds(&serde_json::from_str(&body).ok()?) == want).then_some(())
        },
    );
    println!(
        "node: agent and Envoy started, Envoy holds all {} clusters' endpoints after {:.0} ms",
        want.len(),
        ms(t.elapsed())
    );

    let mut log = AgentLog::new(&rig.owner.log_path);
    let mut registrar_log = RegistrarLog { seen: 0 };
    let mut to_commit = Vec::new();
    let mut splits = Splits::default();
    let mut by_kind: [Vec<Duration>; 4] = Default::default();
    let mut late_in_dump = 0;
    for i in 0..WARMUP + changes {
        let kind = Kind::ALL[i % 4];
        // Consecutive pairs touch Services far apart; 7919 is prime to 1,000.
        let pair = i / 4;
        let s = match kind {
            Kind::Terminating | Kind::Ready => (pair * 7919) % services,
            Kind::Added | Kind::Removed => (pair * 7919 + services / 2) % services,
        };
        match kind {
            Kind::Terminating => mesh.terminating[s] = Some(pair % ENDPOINTS_PER_SERVICE),
            Kind::Ready => mesh.terminating[s] = None,
            Kind::Added => mesh.scaled[s] = true,
            Kind::Removed => mesh.scaled[s] = false,
        }
        let slice = mesh.slice(s);
        log.skip_to_end();
        registrar_log.skip_to_end(&registrar);
        let wall0 = SystemTime::now();
        kube.put_endpoint_slice(slice);
        let ex = log
            .wait(
                &format!("change {i}: the node's agent to log a load assignment push and its ACK"),
                T_CHANGE,
            )
            .unwrap_or_else(|e| {
                panic!(
                    "{e}\nregistrar log:\n{}\n{}",
                    registrar.log(),
                    rig.where_to_look()
                )
            });

        // Outside the timing: the registrar's write, Envoy holding what the change made,
        // and the agent's view at the write's revision.
        let key = format!("{NAMESPACE}/{}", Mesh::name(s));
        let (committed, revision) = try_wait_for(
            &format!("change {i}: the registrar's log to show {key} written"),
            Duration::from_secs(1),
            || registrar_log.written(&registrar, &key),
        )
        .unwrap_or_else(|e| panic!("{e}; registrar log:\n{}", registrar.log()));
        let (cluster, want) = (Mesh::cluster(s), mesh.expected(s));
        let what = format!("change {i}");
        late_in_dump += usize::from(check_applied(&rig, &what, &cluster, &want, revision));
        if i < WARMUP {
            continue;
        }
        to_commit.push(since(wall0, committed));
        splits.push(wall0, &ex);
        by_kind[i % 4].push(since(wall0, ex.acked));
    }

    summary("API write -> registrar committed to etcd", &to_commit);
    summary(
        "API write -> the node's agent holds the change",
        &splits.to_snapshot,
    );
    summary("  snapshot -> push (agent)", &splits.to_push);
    summary("  push -> ACK (Envoy, at the agent)", &splits.to_ack);
    summary(
        "API write -> the node's Envoy ACKed it (total)",
        &splits.total,
    );
    for (k, v) in Kind::ALL.iter().zip(&by_kind) {
        summary(k.label(), v);
    }
    let p99 = percentile(&splits.total, 99.0).expect("samples");
    println!(
        "target p99 <= {} ms: {} (p99 {:.2} ms over {} changes, after {WARMUP} unmeasured, {services} Services); changes not yet in Envoy's config dump at their ACK: {late_in_dump}",
        TARGET.as_millis(),
        if p99 <= TARGET { "met" } else { "MISSED" },
        ms(p99),
        splits.total.len()
    );

    // In the end Envoy's whole EDS equals the registrar's view, and that is what the API
    // server holds.
    let want = expected_eds(&dump(registrar.addr()));
    let (_, body) = rig
        .envoy
        .get("/config_dump?include_eds")
        .expect("Envoy's config dump");
    let got = envoy_eds(&serde_json::from_str(&body).expect("config dump is JSON"));
    assert!(
        got == want,
        "Envoy's EDS differs from the registrar's view at the end\n{}",
        rig.where_to_look()
    );
    for s in 0..services {
        assert_eq!(
            held(&want, s),
            Some(mesh.expected(s)),
            "the registrar holds what the API server has for {}",
            Mesh::name(s)
        );
    }
    println!(
        "at the end the node's Envoy holds exactly the registrar's view ({} clusters)",
        want.len()
    );
    rig.pass();
}
