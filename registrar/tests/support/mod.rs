//! Helpers of the registrar's integration tests: API calls against a running registrar,
//! stream reads with a deadline, the CLI as a process.

#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use aether_registrar::view::View;
use shared_proto::registry::{
    self as pb, registry_client::RegistryClient, watch_endpoints_response::Kind,
};
use tonic::Streaming;
use tonic::transport::Channel;

pub use aether_registrar::testing::{Etcd, RegistrarProcess, TestCa};

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_aether-registrar"))
}

/// How long a test waits for a message it expects.
pub const WAIT: Duration = Duration::from_secs(10);

pub async fn client(addr: &str) -> RegistryClient<Channel> {
    aether_registrar::client::connect(addr, WAIT, None)
        .await
        .expect("the registrar answers")
}

pub fn svc(ns: &str, name: &str, ports: &[u32], eps: &[(&str, u32, &str)]) -> pb::Service {
    pb::Service {
        key: Some(pb::ServiceKey {
            namespace: ns.into(),
            name: name.into(),
        }),
        ports: ports.to_vec(),
        vip: String::new(),
        endpoints: eps
            .iter()
            .map(|(a, p, node)| pb::Endpoint {
                address: a.to_string(),
                port: *p,
                service_port: ports[0],
                node: node.to_string(),
                pod: format!("pod-{a}"),
                state: pb::EndpointState::Healthy as i32,
                mtls: false,
                quic: String::new(),
                quic_sni: String::new(),
            })
            .collect(),
    }
}

pub async fn apply(addr: &str, services: Vec<pb::Service>) -> i64 {
    client(addr)
        .await
        .apply_services(pb::ApplyServicesRequest { services })
        .await
        .expect("ApplyServices")
        .into_inner()
        .revision
}

pub async fn watch(
    addr: &str,
    cluster: &str,
    node: &str,
    instance: &str,
    resume_revision: i64,
) -> Streaming<pb::WatchEndpointsResponse> {
    let req = pb::WatchEndpointsRequest {
        cluster: cluster.into(),
        node: node.into(),
        instance: instance.into(),
        resume_revision,
    };
    client(addr)
        .await
        .watch_endpoints(req)
        .await
        .expect("WatchEndpoints")
        .into_inner()
}

/// The stream's next message, or its ending status; panics if none comes in time or
/// the stream ends cleanly.
pub async fn next(s: &mut Streaming<pb::WatchEndpointsResponse>) -> Result<Kind, tonic::Status> {
    match tokio::time::timeout(WAIT, s.message())
        .await
        .expect("a message within the deadline")
    {
        Ok(Some(m)) => Ok(m.kind.expect("a message has a kind")),
        Ok(None) => panic!("the stream ended without a status"),
        Err(status) => Err(status),
    }
}

pub async fn next_full(s: &mut Streaming<pb::WatchEndpointsResponse>) -> pb::FullView {
    match next(s).await {
        Ok(Kind::Full(f)) => f,
        other => panic!("expected a full view, got {other:?}"),
    }
}

/// A new stream's full view, then its change batches until the client's view is at
/// `revision` at least (a write acknowledged before the stream opened); the revision it
/// is then at. A full view comes from the registrar's kept view, which may be a few
/// events behind etcd (`registrar/src/kept.rs`, "Full views"): the stream's own watch
/// sends those events next.
pub async fn caught_up(s: &mut Streaming<pb::WatchEndpointsResponse>, revision: i64) -> i64 {
    let mut at = next_full(s).await.revision;
    while at < revision {
        at = next_changes(s).await.revision;
    }
    at
}

pub async fn next_changes(s: &mut Streaming<pb::WatchEndpointsResponse>) -> pb::ChangeBatch {
    match next(s).await {
        Ok(Kind::Changes(c)) => c,
        other => panic!("expected a change batch, got {other:?}"),
    }
}

/// Each change of a batch in a few words, for assertions.
pub fn describe(batch: &pb::ChangeBatch) -> Vec<String> {
    use pb::change::Kind as C;
    batch
        .changes
        .iter()
        .map(|c| match c.kind.as_ref().expect("a change has a kind") {
            C::ServiceUpserted(s) => format!("service {}", s.key.as_ref().unwrap().name),
            C::ServiceRemoved(k) => format!("service removed {}", k.name),
            C::EndpointUpserted(u) => {
                let e = u.endpoint.as_ref().unwrap();
                format!("endpoint {}:{}", e.address, e.port)
            }
            C::EndpointRemoved(r) => format!("endpoint removed {}:{}", r.address, r.port),
            C::StateChanged(m) => {
                let state = pb::EndpointState::try_from(m.state).unwrap().as_str_name();
                format!("mark {} {state} {:?}", m.address, m.node)
            }
        })
        .collect()
}

/// The registrar binary with `args`, to its exit.
pub fn cli(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .output()
        .expect("the registrar binary runs")
}

/// `aether-registrar dump` of the registrar at `addr`.
pub fn dump(addr: &str) -> String {
    let out = cli(&["dump", "--registrar", addr]);
    assert!(
        out.status.success(),
        "dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("dump prints UTF-8")
}

/// A full view rendered as `dump` renders it.
pub fn render(full: &pb::FullView) -> String {
    View::from_full(full)
        .expect("a well-formed full view")
        .to_json()
}
