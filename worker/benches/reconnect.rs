//! A proxy's reconnect as the worker's transport sees it: a new connection to the ADS
//! server on a unix socket, the HTTP/2 handshake, the first delta CDS request carrying a
//! `Node` the size of Envoy's (516 extensions, about 61 KB: what Envoy 1.40 sends on
//! every new stream), and the server's first answer. The server runs on a current-thread
//! runtime of its own, as the worker runs it, and the client on another thread; nothing
//! else runs. This is the agent's share of a roll's served gap minus gap with the
//! transport included (README, "Mesh scale"); Envoy's own share is the rest.
//!
//!   cargo bench -p aether-worker --bench reconnect
//!   AETHER_BENCH_ROUNDS=1000 cargo bench -p aether-worker --bench reconnect
//!
//! Prints, for the Envoy-sized `Node` and for a bare one, the median, p90, p99 and
//! maximum over the rounds of the connect to the first answer, and of its parts; then the
//! request's encoding and decoding alone, so that the transport's share is the rest.

use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_model::{Inputs, build};
use aether_worker::accept::PeerRate;
use aether_worker::acks::Acks;
use aether_worker::metrics::Metrics;
use aether_worker::xds::kind::{self, Kind};
use aether_worker::xds::server::{Limits, serve};
use aether_worker::xds::wire::DeltaRequestWire;
use envoy_types::pb::envoy::config::core::v3::{Extension, Node};
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use prost::Message;

fn envoy_sized_node() -> Node {
    // Names, categories and type URLs of the lengths Envoy's own list has.
    let extensions = (0..516)
        .map(|i| Extension {
            name: format!("envoy.extensions.filters.http.example_{i:03}"),
            category: "envoy.filters.http".into(),
            type_urls: vec![format!(
                "envoy.extensions.filters.http.example_{i:03}.v3.Config"
            )],
            ..Default::default()
        })
        .collect();
    Node {
        id: "node-1".into(),
        cluster: "proxy".into(),
        extensions,
        ..Default::default()
    }
}

fn first_request(node: &Node) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(node.clone()),
        type_url: kind::type_url(Kind::Cluster).into(),
        ..Default::default()
    }
}

/// The connect to the first answer, and its three parts: the connection (the HTTP/2
/// handshake included), the stream's opening (the server's response headers) and the
/// first answer.
async fn reconnect(path: &std::path::Path, request: DeltaDiscoveryRequest) -> [Duration; 4] {
    let start = Instant::now();
    let path = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://xds.invalid")
        .connect_with_connector(connector)
        .await
        .expect("connect");
    let connected = start.elapsed();
    let mut client = AggregatedDiscoveryServiceClient::new(channel);
    let requests =
        tokio_stream::StreamExt::chain(tokio_stream::iter([request]), tokio_stream::pending());
    let mut answers = client
        .delta_aggregated_resources(requests)
        .await
        .expect("open the stream")
        .into_inner();
    let opened = start.elapsed();
    let first = answers
        .message()
        .await
        .expect("first answer")
        .expect("an answer");
    assert_eq!(first.type_url, kind::type_url(Kind::Cluster));
    let total = start.elapsed();
    [total, connected, opened - connected, total - opened]
}

fn figures(mut d: Vec<Duration>) -> String {
    d.sort();
    let at = |q: f64| d[((d.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
    format!(
        "median {:.3} ms, p90 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0)
    )
}

fn main() {
    let rounds: usize = std::env::var("AETHER_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("xds.sock");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server_path = path.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::UnixListener::bind(&server_path).expect("bind");
            let (_keep, snapshots) =
                tokio::sync::watch::channel(Arc::new(build(&Inputs::default())));
            ready_tx.send(()).expect("ready");
            // One client reconnecting in a loop: no per-peer rate limit, and the connections
            // of rounds past, which the server may not have seen close yet, do not count.
            let limits = Limits {
                peer_rate: PeerRate {
                    burst: 1 << 20,
                    per_second: 1 << 20,
                },
                max_connections: 1 << 16,
                ..Limits::default()
            };
            serve(
                listener,
                snapshots,
                Arc::default(),
                Acks::default(),
                Metrics::new(),
                None,
                std::future::pending(),
                limits,
                Default::default(),
                Default::default(),
            )
            .await
            .expect("serve");
        });
    });
    ready_rx.recv().expect("server up");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let big = envoy_sized_node();
    let bare = Node {
        id: "node-1".into(),
        ..Default::default()
    };
    println!(
        "reconnect: {rounds} rounds each; the Envoy-sized first request is {} bytes, the bare one {}",
        first_request(&big).encoded_len(),
        first_request(&bare).encoded_len()
    );
    for (what, node) in [("Envoy-sized Node", &big), ("bare Node", &bare)] {
        let took: Vec<[Duration; 4]> = rt.block_on(async {
            let mut took = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                took.push(reconnect(&path, first_request(node)).await);
            }
            took
        });
        for (i, part) in [
            "connect to the first CDS answer",
            "  the connection",
            "  the stream's opening",
            "  the first answer",
        ]
        .iter()
        .enumerate()
        {
            println!(
                "reconnect, {what}: {part}: {}",
                figures(took.iter().map(|t| t[i]).collect())
            );
        }
        // The request's two codec steps alone, in this thread: the client's encoding, and
        // the server's decoding into the wire type that skips the node's extensions by
        // length (as the worker decodes it) and into the generated type (as it would
        // without the wire type). What the reconnect costs beyond them is the transport.
        let request = first_request(node);
        let bytes = request.encode_to_vec();
        let time = |f: &mut dyn FnMut()| -> Vec<Duration> {
            (0..rounds)
                .map(|_| {
                    let t = Instant::now();
                    f();
                    t.elapsed()
                })
                .collect()
        };
        let encode = time(&mut || drop(std::hint::black_box(request.encode_to_vec())));
        let decode_wire = time(&mut || {
            drop(std::hint::black_box(
                DeltaRequestWire::decode(bytes.as_slice()).expect("decodes"),
            ))
        });
        let decode_full = time(&mut || {
            drop(std::hint::black_box(
                DeltaDiscoveryRequest::decode(bytes.as_slice()).expect("decodes"),
            ))
        });
        println!(
            "reconnect, {what}: the client's encoding alone: {}",
            figures(encode)
        );
        println!(
            "reconnect, {what}: the server's decoding alone (the worker's wire type): {}",
            figures(decode_wire)
        );
        println!(
            "reconnect, {what}: the same into the generated type, for comparison: {}",
            figures(decode_full)
        );
    }
}
