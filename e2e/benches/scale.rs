//! The agent at mesh scale: 10,000 services and 100,000 endpoints served to a real Envoy.
//!
//! `cargo bench -p aether-e2e --bench scale` (release profile). Needs Envoy
//! (`scripts/install-envoy.sh` or `ENVOY_BIN`). The worker's pieces run in this process
//! (the in-process rig), Envoy beside it. Env: `BENCH_SERVICES` (10000),
//! `BENCH_ENDPOINTS` (10 per service), `BENCH_CHANGES` (100, at least 20),
//! `BENCH_XDS_API` (`delta`, the default, or `sotw`).
//!
//! Prints, and checks where the issue of scale sets a rule:
//! - the registry file's load, and Envoy's initial sync (start to ACK of everything);
//! - one endpoint turning draining or healthy, to Envoy's ACK, through the in-process
//!   change API (`Node::apply`) and through the registry file (re-read, parsed off the
//!   runtime thread, diffed), median and p99; each change must send Envoy exactly one
//!   resource, the service's load assignment, and nothing else;
//! - a pod's ADD: exactly one listener and one cluster;
//! - this process's RSS (the worker's pieces run in it) before the registry-file changes
//!   and after each hundred of them (`BENCH_CHANGES=300` for the figure after 300);
//! - Envoy's RSS holding every cluster, and, over delta ADS, with on-demand clusters:
//!   a second Envoy whose pods' first call to a service it does not hold succeeds.

use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, RigOptions, WorkerRig, same_versions};
use aether_e2e::harness::{load, upstream};
use aether_e2e::testing::{memory_kib, mesh_registry_json, mesh_service, percentile};
use aether_model::{Change, KIND_COUNT, KINDS, Kind, Pod};
use aether_worker::xds::kind::type_url;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
        .unwrap_or(default)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn summary(name: &str, v: &[Duration]) {
    let at = |p: f64| ms(percentile(v, p).expect("samples"));
    println!(
        "{name:<46} n={:<4} median {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
        v.len(),
        at(50.0),
        at(99.0),
        at(100.0)
    );
}

/// Resources the worker has sent, by kind.
fn sent(rig: &WorkerRig) -> [u64; KIND_COUNT] {
    KINDS.map(|k| rig.worker_counter("resources", type_url(k)))
}

fn delta(before: [u64; KIND_COUNT], after: [u64; KIND_COUNT]) -> [u64; KIND_COUNT] {
    std::array::from_fn(|i| after[i] - before[i])
}

fn pod(n: u8) -> Pod {
    Pod {
        uid: format!("bench-pod-{n}"),
        namespace: "default".into(),
        name: format!("pod-{n}"),
        container_id: format!("c{n}"),
        netns: format!("/var/run/netns/p{n}"),
        ifname: "eth0".into(),
        ips: vec![std::net::Ipv4Addr::new(10, 244, 0, n).into()],
        terminating: false,
        no_quic_twin: false,
    }
}

/// This process's `VmRSS` in MiB: the in-process worker's, with the rig's.
fn own_rss() -> f64 {
    memory_kib(std::process::id() as i32).0 as f64 / 1024.0
}

/// Writes `json` (the mesh file with every endpoint healthy) to `path` with endpoint
/// `(service, endpoint)` draining or, with `draining` false, as it is.
fn write_with_state(
    path: &std::path::Path,
    json: &str,
    (service, endpoint): (usize, usize),
    endpoints: usize,
    draining: bool,
) {
    use std::io::Write as _;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    if draining {
        let ip = std::net::Ipv4Addr::from(0x0a40_0000u32 + (service * endpoints + endpoint) as u32);
        let at = json
            .find(&format!("\"address\":\"{ip}\","))
            .expect("the endpoint is in the file");
        let state = at + json[at..].find("\"healthy\"").expect("its state");
        let bytes = json.as_bytes();
        f.write_all(&bytes[..state]).unwrap();
        f.write_all(b"\"draining\"").unwrap();
        f.write_all(&bytes[state + "\"healthy\"".len()..]).unwrap();
    } else {
        f.write_all(json.as_bytes()).unwrap();
    }
    f.flush().unwrap();
}

/// Envoy's `VmRSS` in MiB.
fn envoy_rss(rig: &WorkerRig) -> f64 {
    memory_kib(rig.envoy.pid()).0 as f64 / 1024.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("scale: run with `cargo bench -p aether-e2e --bench scale`; skipping");
        return;
    }
    let Some(envoy) = aether_e2e::envoy::envoy_bin() else {
        eprintln!("scale: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN.");
        std::process::exit(2);
    };
    aether_e2e::envoy::init_logs(&std::env::var("BENCH_LOG").unwrap_or_else(|_| "warn".into()));
    let services = env("BENCH_SERVICES", 10_000);
    let endpoints = env("BENCH_ENDPOINTS", 10);
    let changes = env("BENCH_CHANGES", 100).max(20);
    let api: AdsApi = std::env::var("BENCH_XDS_API")
        .map(|v| v.parse().unwrap_or_else(|e| panic!("BENCH_XDS_API: {e}")))
        .unwrap_or_default();
    let json = mesh_registry_json(services, endpoints, None, "");
    println!(
        "scale: {services} services, {} endpoints, registry file {:.1} MB, ADS {}, Envoy {}",
        services * endpoints,
        json.len() as f64 / 1e6,
        api.api_type(),
        envoy.display()
    );

    // For comparison, in this thread: a whole parse of the file (what a reload cost
    // before it parsed only the services whose text changed) and the file hash.
    let (mut hashing, mut parsing) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        let t = Instant::now();
        std::hint::black_box(aether_worker::registry::file_hash(json.as_bytes()));
        hashing.push(t.elapsed());
        let t = Instant::now();
        std::hint::black_box(
            aether_worker::registry::parse(std::path::Path::new("bench"), json.as_bytes())
                .expect("valid registry"),
        );
        parsing.push(t.elapsed());
    }
    summary("registry file: hash of the whole file", &hashing);
    summary(
        "registry file: whole parse (not on a reload's path)",
        &parsing,
    );

    let rig = WorkerRig::start_with(
        &envoy,
        &json,
        RigOptions {
            api,
            on_demand: false,
            ..RigOptions::default()
        },
    )
    .await;
    println!(
        "registry file loaded (read, parse, build)        {:>8.1} ms",
        ms(rig.loaded)
    );
    println!(
        "Envoy initial sync (start to ACK of everything)   {:>8.1} ms",
        ms(rig.envoy_synced)
    );
    let rss_all = envoy_rss(&rig);
    println!("Envoy RSS holding every cluster                   {rss_all:>8.1} MiB");

    // One endpoint change at a time, through the change API, then through the file: an
    // endpoint turns draining, then healthy again, so each phase ends where it started
    // and the file and the node agree.
    let mut via_api = Vec::new();
    let mut via_file = Vec::new();
    // This process's RSS (the worker's pieces run in it) before the file changes and
    // after each hundred: what a reload leaves behind.
    let mut rss_after: Vec<(usize, f64)> = Vec::new();
    let changes = changes + changes % 2;
    for through_file in [false, true] {
        if through_file {
            rss_after.push((0, own_rss()));
        }
        for i in 0..changes {
            let touched = ((i / 2) * 7919 + usize::from(through_file) * 13) % services;
            let draining = (i % 2 == 0).then_some((touched, i % endpoints));
            let before = sent(&rig);
            let t0;
            if through_file {
                // The file with one endpoint's state changed, written from the first
                // file's text without a copy of it: the bench's own allocations stay out
                // of the RSS figures below.
                let tmp = rig.dir.path().join(".registry.json.tmp");
                write_with_state(
                    &tmp,
                    &json,
                    draining.map_or((touched, 0), |d| d),
                    endpoints,
                    draining.is_some(),
                );
                let mut snapshots = rig.node.subscribe();
                snapshots.borrow_and_update();
                t0 = Instant::now();
                std::fs::rename(&tmp, &rig.registry_file).unwrap();
                tokio::time::timeout(Duration::from_secs(10), snapshots.changed())
                    .await
                    .expect("the file change reached the node")
                    .unwrap();
            } else {
                t0 = Instant::now();
                rig.node.apply([Change::UpsertService(mesh_service(
                    touched,
                    endpoints,
                    draining.map(|(_, e)| e),
                ))]);
            }
            let want = rig.node.snapshot();
            assert!(
                rig.acks
                    .wait_until(|s| same_versions(s, &want), Duration::from_secs(10))
                    .await,
                "change {i} not ACKed within 10 s"
            );
            let took = t0.elapsed();
            if through_file {
                via_file.push(took);
                if (i + 1) % 100 == 0 {
                    rss_after.push((i + 1, own_rss()));
                }
            } else {
                via_api.push(took)
            }
            let d = delta(before, sent(&rig));
            let one_assignment = KINDS.map(|k| u64::from(k == Kind::Endpoint));
            assert_eq!(
                d, one_assignment,
                "change {i} must send exactly one load assignment (resources sent per kind, {KINDS:?}: {d:?})"
            );
        }
    }
    summary("endpoint change -> Envoy ACK, change API", &via_api);
    summary("endpoint change -> Envoy ACK, registry file", &via_file);
    for (n, rss) in &rss_after {
        println!("worker RSS after {n:>4} registry-file changes         {rss:>8.1} MiB");
    }
    println!(
        "each of the {} changes sent Envoy exactly one resource (its load assignment)",
        changes * 2
    );

    // A pod's ADD: its listener and its cluster. The first pod also brings the capture
    // listener, so the check is on the second.
    rig.node.apply([Change::UpsertPod(pod(1))]);
    let want = rig.node.snapshot();
    assert!(
        rig.acks
            .wait_until(|s| same_versions(s, &want), Duration::from_secs(10))
            .await
    );
    let before = sent(&rig);
    let t0 = Instant::now();
    rig.node.apply([Change::UpsertPod(pod(2))]);
    let want = rig.node.snapshot();
    assert!(
        rig.acks
            .wait_until(
                |s| s.holds_pod("bench-pod-2", &pod(2).ips) && same_versions(s, &want),
                Duration::from_secs(10)
            )
            .await
    );
    let took = t0.elapsed();
    let d = delta(before, sent(&rig));
    if api == AdsApi::Delta {
        let expect = KINDS.map(|k| u64::from(matches!(k, Kind::Cluster | Kind::Listener)));
        assert_eq!(
            d, expect,
            "a pod's ADD must send one cluster and one listener ({KINDS:?}: {d:?})"
        );
        println!(
            "pod ADD -> Envoy ACK                              {:>8.2} ms  (one listener and one cluster sent)",
            ms(took)
        );
    } else {
        // State of the world: every LDS and CDS response is the whole set.
        println!(
            "pod ADD -> Envoy ACK                              {:>8.2} ms  (resources sent, CDS EDS LDS RDS: {d:?})",
            ms(took)
        );
    }
    let nacks: u64 = KINDS
        .iter()
        .map(|k| rig.worker_counter("nacks", type_url(*k)))
        .sum();
    assert_eq!(nacks, 0, "Envoy rejected nothing");
    drop(rig);

    if api != AdsApi::Delta {
        println!(
            "on-demand clusters: delta ADS only; skipped for {}",
            api.api_type()
        );
        return;
    }
    // On-demand clusters: Envoy holds only what the pods call; the first call fetches it.
    let real = upstream::spawn("real\n".into()).expect("upstream");
    let extra = format!(
        r#"{{"name":"real","namespace":"mesh","ports":[80],"endpoints":[{{"address":"{}","port":{}}}]}}"#,
        real.addr.ip(),
        real.addr.port()
    );
    let json = mesh_registry_json(services, endpoints, None, &extra);
    let rig = WorkerRig::start_with(
        &envoy,
        &json,
        RigOptions {
            api,
            on_demand: true,
            ..RigOptions::default()
        },
    )
    .await;
    println!(
        "on-demand: Envoy initial sync                     {:>8.1} ms",
        ms(rig.envoy_synced)
    );
    let rss_lazy = envoy_rss(&rig);
    println!(
        "on-demand: Envoy RSS holding its pods' clusters   {rss_lazy:>8.1} MiB  ({:.0}% of every cluster's {rss_all:.1} MiB)",
        100.0 * rss_lazy / rss_all
    );
    let outbound = rig.outbound;
    let t0 = Instant::now();
    let first = tokio::task::spawn_blocking(move || load::get(outbound, "real.mesh"))
        .await
        .unwrap();
    let took = t0.elapsed();
    match first {
        Ok((200, body)) if body == "real\n" => {}
        other => panic!(
            "the first call to a service Envoy did not hold must succeed, got {other:?}; Envoy log:\n{}",
            rig.envoy.log_text()
        ),
    }
    println!(
        "on-demand: first call to a service not held       {:>8.2} ms  (200 from its upstream)",
        ms(took)
    );
    let observed = rig.observed.as_ref().expect("on-demand rig");
    assert!(
        observed.contains("outbound|80||real.mesh"),
        "the called service is an observed upstream"
    );
    println!("on-demand: observed upstreams now {:?}", observed.names());
}
