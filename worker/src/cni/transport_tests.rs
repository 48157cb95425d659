//! The CNI server's limits over its real transport: a unix socket, HTTP/2 and a tonic
//! client, in this process.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shared_proto::cni::CniRequest;
use shared_proto::cni::cni_client::CniClient;
use tokio::net::UnixStream;
use tonic::Code;

use super::*;
use crate::accept::test_helpers::{MAX_CONCURRENT_STREAMS, h2_settings, until};
use crate::metrics::SocketLabel;
use aether_model::Inputs;

struct Server {
    _dir: tempfile::TempDir,
    path: PathBuf,
    metrics: Arc<Metrics>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// The CNI API with `limits` on a socket in a temp dir, its proxy ACKing every snapshot.
fn start(limits: Limits) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new();
    let storage = Arc::new(Storage::open(&dir.path().join("state"), metrics.clone()).unwrap());
    let node = Node::new(Inputs::default());
    load(&node, &storage);
    let service = CniService::new(
        node.clone(),
        storage,
        Arc::new(PublishedAcks(node)),
        metrics.clone(),
    );
    let path = dir.path().join("cni.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        service,
        async move {
            let _ = stopped.await;
        },
        limits,
    ));
    Server {
        _dir: dir,
        path,
        metrics,
        _stop: stop,
    }
}

async fn client(path: &Path) -> CniClient<tonic::transport::Channel> {
    let path = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move {
            UnixStream::connect(path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://cni.invalid")
        .connect_with_connector(connector)
        .await
        .unwrap();
    CniClient::new(channel).max_encoding_message_size(usize::MAX)
}

fn add(uid: &str, ip: &str) -> CniRequest {
    CniRequest {
        container_id: format!("c-{uid}"),
        netns: format!("/var/run/netns/{uid}"),
        ifname: "eth0".into(),
        pod_namespace: "default".into(),
        pod_name: uid.into(),
        pod_uid: uid.into(),
        ips: vec![ip.into()],
        ..Default::default()
    }
}

#[tokio::test]
async fn connections_past_the_cap_are_closed_at_once_and_a_freed_slot_serves_again() {
    let s = start(Limits {
        max_connections: 2,
        ..Limits::default()
    });
    let label = SocketLabel {
        socket: "cni".into(),
    };
    let mut first = UnixStream::connect(&s.path).await.unwrap();
    let mut second = UnixStream::connect(&s.path).await.unwrap();
    for conn in [&mut first, &mut second] {
        let settings = h2_settings(conn).await.expect("admitted under the cap");
        assert!(
            settings.contains(&(MAX_CONCURRENT_STREAMS, MAX_STREAMS_PER_CONNECTION)),
            "{settings:?}"
        );
    }
    let mut third = UnixStream::connect(&s.path).await.unwrap();
    assert_eq!(
        h2_settings(&mut third).await,
        None,
        "past the cap: closed without a byte"
    );
    assert_eq!(s.metrics.connections_refused.get_or_create(&label).get(), 1);
    assert_eq!(
        s.metrics.cni_refused_peers.get(),
        0,
        "a cap refusal is not a peer refusal"
    );

    drop(first);
    until("the closed connection's slot is given back", || {
        s.metrics.connections.get_or_create(&label).get() == 1
    })
    .await;
    let resp = client(&s.path)
        .await
        .add(add("u1", "10.0.0.1"))
        .await
        .expect("served once a slot is free");
    assert!(resp.into_inner().acked);
}

#[tokio::test]
async fn a_request_over_the_size_limit_is_refused_before_the_service() {
    let s = start(Limits::default());
    let mut cni = client(&s.path).await;
    // Within the limit: it reaches the service, which answers for its bad netns.
    let within = CniRequest {
        netns: "rel".into(),
        prev_result: vec![b' '; MAX_REQUEST - 1024],
        ..add("u1", "10.0.0.1")
    };
    let err = cni.add(within).await.expect_err("a bad netns");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let over = CniRequest {
        prev_result: vec![b' '; MAX_REQUEST + 1],
        ..add("u1", "10.0.0.1")
    };
    let err = cni.add(over).await.expect_err("over the size limit");
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(
        err.message().contains("the limit is: 2097152 bytes"),
        "{}",
        err.message()
    );
    assert!(
        !s.metrics
            .encode()
            .contains("aether_cni_requests_total{op=\"add\",result=\"ok\"}")
    );
}
