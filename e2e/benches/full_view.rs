//! Full views at mesh scale: how long a node waits for the registrar's whole view when
//! its watch stream opens without a revision to resume from (a worker's first start, a
//! respawn after a crash, a new pod at a recreate roll), alone and as a herd (every node
//! of a cluster reconnecting at once, after a registrar replica restarts).
//!
//! `cargo build --release --workspace --bins && cargo bench -p aether-e2e --bench full-view`
//! (release profile). Needs etcd (`/usr/bin/etcd`, Debian `etcd-server`). Env:
//! `BENCH_SERVICES` (10,000, 10 endpoints each), `BENCH_ROUNDS` (20), `BENCH_HERD` (20).
//!
//! One etcd member, two registrars on it: one serving full views from the view it keeps
//! (the default), one reading them from etcd at each stream (`--full-views-from-etcd`,
//! the registrar before the kept view). Each round opens one stream on each, in turns,
//! and times it from the call to the full view decoded, as the worker's client does it;
//! then `BENCH_HERD` streams at once on each. Every view must hold every service and
//! endpoint, and a change applied after it must reach the stream as the next batch, at
//! the revision after the view's. Prints the times side by side, the view's size, and
//! each registrar's RSS and peak RSS.

use std::time::{Duration, Instant};

use aether_e2e::registrar::{Etcd, RegistrarProcess, registrar_bin};
use aether_e2e::testing::{env_usize, memory_kib, percentile};
use prost::Message as _;
use shared_proto::registry::{
    self as pb, registry_client::RegistryClient, watch_endpoints_response::Kind as ResponseKind,
};
use tonic::transport::Channel;

const NAMESPACE: &str = "bench";
const ENDPOINTS: usize = 10;
/// Services per ApplyServices call: below the registrar's `--max-apply-bytes`.
const CHUNK: usize = 500;

fn service(s: usize, port: u32) -> pb::Service {
    let endpoints = (0..ENDPOINTS)
        .map(|e| pb::Endpoint {
            address: std::net::Ipv4Addr::from(0x0a40_0000u32 + (s * ENDPOINTS + e) as u32)
                .to_string(),
            port,
            service_port: 80,
            node: format!("node-{}", s % 100),
            pod: format!("svc-{s:05}-{e}"),
            state: pb::EndpointState::Healthy as i32,
            mtls: false,
            quic: String::new(),
            quic_sni: String::new(),
        })
        .collect();
    pb::Service {
        key: Some(pb::ServiceKey {
            namespace: NAMESPACE.into(),
            name: format!("svc-{s:05}"),
        }),
        ports: vec![80],
        vip: String::new(),
        endpoints,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Side {
    label: &'static str,
    registrar: RegistrarProcess,
    client: RegistryClient<Channel>,
    alone: Vec<f64>,
    herd: Vec<f64>,
    herd_failed: usize,
}

fn request(node: String) -> pb::WatchEndpointsRequest {
    pb::WatchEndpointsRequest {
        cluster: String::new(),
        node,
        instance: "bench".into(),
        resume_revision: 0,
    }
}

type Stream = tonic::Streaming<pb::WatchEndpointsResponse>;

/// Opens a stream and waits for its full view: the view, the stream, and the time taken;
/// or the status the stream ended with.
async fn full_view(
    mut client: RegistryClient<Channel>,
    node: String,
) -> Result<(pb::FullView, Stream, Duration), tonic::Status> {
    let t = Instant::now();
    let mut stream = client.watch_endpoints(request(node)).await?.into_inner();
    let first = stream
        .message()
        .await?
        .ok_or_else(|| tonic::Status::unavailable("the stream ended before its full view"))?;
    match first.kind {
        Some(ResponseKind::Full(view)) => Ok((view, stream, t.elapsed())),
        other => panic!("the first message is not a full view: {other:?}"),
    }
}

fn check(label: &str, view: &pb::FullView, services: usize) {
    assert_eq!(
        view.services.len(),
        services,
        "{label}: services in the view"
    );
    let endpoints: usize = view.services.iter().map(|s| s.endpoints.len()).sum();
    assert_eq!(
        endpoints,
        services * ENDPOINTS,
        "{label}: endpoints in the view"
    );
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("full-view: run with `cargo bench -p aether-e2e --bench full-view`; skipping");
        return;
    }
    let Some(etcd) = Etcd::start_or_skip("full-view") else {
        std::process::exit(2)
    };
    let services = env_usize("BENCH_SERVICES", 10_000);
    let rounds = env_usize("BENCH_ROUNDS", 20);
    let herd = env_usize("BENCH_HERD", 20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime for the registry clients");
    let connect = |r: &RegistrarProcess| {
        rt.block_on(aether_registrar::client::connect(
            r.addr(),
            Duration::from_secs(60),
            None,
        ))
        .expect("connect to the registrar")
        .max_decoding_message_size(256 << 20)
    };
    // A herd comes from as many nodes, each on a connection of its own, here all from
    // one address.
    let per_source = (herd + 4).to_string();
    let mut sides: Vec<Side> = [
        ("kept view", &[][..]),
        ("from etcd", &["--full-views-from-etcd"][..]),
    ]
    .into_iter()
    .map(|(label, flags)| {
        let flags: Vec<&str> = [&["--max-connections-per-source", &per_source][..], flags].concat();
        let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &flags);
        let client = connect(&registrar);
        Side {
            label,
            registrar,
            client,
            alone: Vec::new(),
            herd: Vec::new(),
            herd_failed: 0,
        }
    })
    .collect();

    let t = Instant::now();
    let mut writer = sides[0].client.clone();
    let mut revision = 0;
    for chunk in (0..services).collect::<Vec<_>>().chunks(CHUNK) {
        let req = pb::ApplyServicesRequest {
            services: chunk.iter().map(|&s| service(s, 8080)).collect(),
        };
        revision = rt
            .block_on(writer.apply_services(req))
            .expect("ApplyServices")
            .into_inner()
            .revision;
    }
    println!(
        "full-view: {services} services, {} endpoints applied in {:.0} ms (etcd revision {revision})",
        services * ENDPOINTS,
        ms(t.elapsed())
    );

    let mut bytes = 0;
    let mut port = 8080;
    for round in 0..rounds {
        // Turns alternate which registrar goes first, so neither always follows the other.
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        for i in order {
            let side = &mut sides[i];
            let (view, mut stream, took) = rt
                .block_on(full_view(side.client.clone(), format!("round-{round}")))
                .unwrap_or_else(|e| panic!("{}: a full view: {e:?}", side.label));
            check(side.label, &view, services);
            bytes = view.encoded_len();
            side.alone.push(ms(took));
            // The view is whole at its revision: the next change is the stream's next batch.
            port = if port == 8080 { 9090 } else { 8080 };
            let applied = rt
                .block_on(writer.apply_services(pb::ApplyServicesRequest {
                    services: vec![service(round % services, port)],
                }))
                .expect("ApplyServices")
                .into_inner()
                .revision;
            let next = rt
                .block_on(async {
                    tokio::time::timeout(Duration::from_secs(10), stream.message()).await
                })
                .expect("the change within 10 s")
                .expect("the stream's next message")
                .expect("a next message");
            match next.kind {
                Some(ResponseKind::Changes(batch)) => {
                    assert!(
                        batch.revision == applied && applied > view.revision,
                        "{}: the change's batch is at revision {} after a view at {}; the apply was {applied}",
                        side.label,
                        batch.revision,
                        view.revision
                    );
                }
                other => panic!("{}: the next message is not a batch: {other:?}", side.label),
            }
        }
        if (round + 1) % 5 == 0 {
            eprintln!("full-view: {} of {rounds} rounds", round + 1);
        }
    }
    let memory = |sides: &[Side]| -> Vec<String> {
        sides
            .iter()
            .map(|s| {
                let pid = s.registrar.pid().expect("the registrar runs") as i32;
                let (rss, hwm) = memory_kib(pid);
                format!("{:.1} / {:.1}", rss as f64 / 1024.0, hwm as f64 / 1024.0)
            })
            .collect()
    };
    let before_herd = memory(&sides);
    for side in &sides {
        let log = side.registrar.log();
        if let Some(line) = log.lines().rev().find(|l| l.contains("full view sent")) {
            println!("{}: the last stream's log: {line}", side.label);
        }
    }
    for side in &mut sides {
        let clients: Vec<_> = (0..herd).map(|_| connect(&side.registrar)).collect();
        let t = Instant::now();
        let views = rt.block_on(async {
            let tasks: Vec<_> = clients
                .into_iter()
                .enumerate()
                .map(|(n, c)| tokio::spawn(full_view(c, format!("herd-{n}"))))
                .collect();
            let mut out = Vec::new();
            for task in tasks {
                out.push(task.await.expect("a herd stream"));
            }
            out
        });
        let mut failed = Vec::new();
        for v in &views {
            match v {
                Ok((view, _, took)) => {
                    check(side.label, view, services);
                    side.herd.push(ms(*took));
                }
                Err(status) => failed.push(format!("{:?}: {}", status.code(), status.message())),
            }
        }
        println!(
            "{}: {herd} streams at once, {} full views, the last in {:.0} ms; {} streams failed{}",
            side.label,
            side.herd.len(),
            ms(t.elapsed()),
            failed.len(),
            failed
                .first()
                .map(|f| format!(", the first with {f}"))
                .unwrap_or_default()
        );
        side.herd_failed = failed.len();
    }

    println!(
        "\nfull view, {services} services ({:.1} MB encoded), ms: median / p90 / max",
        bytes as f64 / 1e6
    );
    let row = |v: &[f64]| {
        format!(
            "{:.1} / {:.1} / {:.1}",
            percentile(v, 50.0).unwrap_or(f64::NAN),
            percentile(v, 90.0).unwrap_or(f64::NAN),
            percentile(v, 100.0).unwrap_or(f64::NAN)
        )
    };
    let line = |label: &str, cell: &dyn Fn(&Side) -> String| {
        let cells: Vec<String> = sides.iter().map(cell).collect();
        println!("| {label} | {} |", cells.join(" | "));
    };
    line("", &|s| s.label.to_owned());
    println!("|---|---|---|");
    line(&format!("one stream ({rounds} rounds)"), &|s| row(&s.alone));
    line(&format!("{herd} streams at once"), &|s| row(&s.herd));
    line("of them failed", &|s| s.herd_failed.to_string());
    println!(
        "| registrar RSS / peak, MiB, before the herds | {} |",
        before_herd.join(" | ")
    );
    println!(
        "| registrar RSS / peak, MiB, after | {} |",
        memory(&sides).join(" | ")
    );
    let a = percentile(&sides[0].alone, 50.0).unwrap_or(f64::NAN);
    let b = percentile(&sides[1].alone, 50.0).unwrap_or(f64::NAN);
    println!(
        "\none stream, median: {} {:.2}x faster than {}",
        sides[0].label,
        b / a,
        sides[1].label
    );
}
