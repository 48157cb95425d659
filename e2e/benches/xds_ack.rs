//! Registry-file change to Envoy ACK, with 100 services and 1,000 endpoints.
//!
//! `cargo bench -p aether-e2e --bench xds-ack` (release profile). Needs Envoy like the
//! xDS tests (`scripts/install-envoy.sh` or `ENVOY_BIN`). `BENCH_CHANGES` (default 100,
//! at least 50) sets the number of changes. Each change rewrites the file atomically and
//! times until the proxy has ACKed a snapshot with exactly the versions that file gives;
//! changes rotate through an endpoint turning draining or healthy (EDS), an endpoint
//! moving port (EDS), and a service added or removed (CDS, EDS, RDS). `BENCH_XDS_API`
//! (`sotw`, the default, or `delta`) picks the ADS variant Envoy speaks.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, WorkerRig, same_versions};
use aether_e2e::testing::percentile;
use aether_model::{self as snapshot, Inputs};
use aether_worker::registry;

const SERVICES: usize = 100;
const ENDPOINTS_PER_SERVICE: usize = 10;

struct Registry {
    draining: Vec<bool>,
    ports: Vec<u16>,
    extra: bool,
}

impl Registry {
    fn json(&self) -> String {
        let mut services = Vec::new();
        for s in 0..SERVICES {
            let eps: Vec<(SocketAddr, bool)> = (0..ENDPOINTS_PER_SERVICE)
                .map(|e| {
                    let i = s * ENDPOINTS_PER_SERVICE + e;
                    (
                        SocketAddr::new(
                            format!("10.1.{}.{}", s, e + 1).parse().unwrap(),
                            self.ports[i],
                        ),
                        self.draining[i],
                    )
                })
                .collect();
            services.push((
                format!("svc-{s:03}"),
                Some(format!("10.96.{}.{}", s / 250, s % 250 + 1)),
                eps,
            ));
        }
        if self.extra {
            services.push((
                "extra".to_string(),
                None,
                vec![(SocketAddr::new("10.2.0.1".parse().unwrap(), 8080), false)],
            ));
        }
        let refs: Vec<envoy::ServiceSpec<'_>> = services
            .iter()
            .map(|(n, v, e)| (n.as_str(), v.as_deref(), e.clone()))
            .collect();
        envoy::registry_json(&refs)
    }
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn summary(name: &str, v: &[Duration]) {
    let at = |p: f64| ms(percentile(v, p).expect("samples"));
    println!(
        "{name:<34} n={:<4} median {:>9}  p99 {:>9}  max {:>9}",
        v.len(),
        at(50.0),
        at(99.0),
        at(100.0)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and a debug
    // build's figures mean nothing, so do not run then.
    if !std::env::args().any(|a| a == "--bench") {
        println!("xds-ack: run with `cargo bench -p aether-e2e --bench xds-ack`; skipping");
        return;
    }
    let envoy = match envoy::envoy_bin() {
        Some(p) => p,
        None => {
            eprintln!("bench-xds: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
            std::process::exit(2);
        }
    };
    envoy::init_logs("warn");
    let changes: usize = std::env::var("BENCH_CHANGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
        .max(50);
    let n = SERVICES * ENDPOINTS_PER_SERVICE;
    let mut reg = Registry {
        draining: vec![false; n],
        ports: vec![8080; n],
        extra: false,
    };

    let api: AdsApi = match std::env::var("BENCH_XDS_API") {
        Ok(v) => v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}")),
        Err(_) => Default::default(),
    };
    let h = WorkerRig::start(&envoy, &reg.json(), api).await;
    println!(
        "xds-ack: {SERVICES} services, {n} endpoints, {changes} changes, ADS {}, Envoy {}",
        api.api_type(),
        envoy.display()
    );

    // The pure part alone: parse the file and build the snapshot.
    let mut pure = Vec::new();
    let inputs0 = h.node.inputs();
    let json0 = reg.json();
    for _ in 0..50 {
        let t = Instant::now();
        let mut inputs = inputs0.clone();
        inputs.registry = registry::parse(Path::new("bench"), json0.as_bytes()).unwrap();
        std::hint::black_box(snapshot::build(&inputs));
        pure.push(t.elapsed());
    }

    let mut total = Vec::new();
    let mut to_snapshot = Vec::new();
    let mut by_kind: [Vec<Duration>; 3] = Default::default();
    let mut snapshots = h.node.subscribe();
    for i in 0..changes {
        let kind = i % 3;
        match kind {
            0 => reg.draining[(i * 7) % n] ^= true,
            1 => {
                reg.ports[(i * 13) % n] = if reg.ports[(i * 13) % n] == 8080 {
                    9090
                } else {
                    8080
                }
            }
            _ => reg.extra = !reg.extra,
        }
        let json = reg.json();
        // The versions this file must produce, computed the way the worker will.
        let mut inputs: Inputs = h.node.inputs();
        inputs.registry =
            registry::parse(Path::new("bench"), json.as_bytes()).expect("bench registry is valid");
        let want = snapshot::build(&inputs);

        let t0 = Instant::now();
        h.write_registry(&json).await;
        tokio::time::timeout(
            Duration::from_secs(10),
            snapshots.wait_for(|s| same_versions(s, &want)),
        )
        .await
        .expect("snapshot built within 10 s")
        .unwrap();
        let built = t0.elapsed();
        assert!(
            h.acks
                .wait_until(|s| same_versions(s, &want), Duration::from_secs(10))
                .await,
            "change {i} not ACKed"
        );
        let acked = t0.elapsed();
        to_snapshot.push(built);
        total.push(acked);
        by_kind[kind].push(acked);
    }

    summary("parse + build (in-process)", &pure);
    summary("file change -> snapshot published", &to_snapshot);
    summary("file change -> Envoy ACK (all)", &total);
    summary("  endpoint draining toggle (EDS)", &by_kind[0]);
    summary("  endpoint port change (EDS)", &by_kind[1]);
    summary("  service add/remove (CDS+EDS+RDS)", &by_kind[2]);
    let nacks: u64 = [
        "Listener",
        "Cluster",
        "ClusterLoadAssignment",
        "RouteConfiguration",
    ]
    .iter()
    .map(|t| {
        let url = match *t {
            "Listener" => "type.googleapis.com/envoy.config.listener.v3.Listener",
            "Cluster" => "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            "ClusterLoadAssignment" => {
                "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
            }
            _ => "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
        };
        h.worker_counter("nacks", url)
    })
    .sum();
    assert_eq!(nacks, 0, "the benchmark's changes must all be accepted");
}
