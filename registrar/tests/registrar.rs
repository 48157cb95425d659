//! The registrar as deployed: the real binary over real sockets against a real etcd
//! (Debian's `/usr/bin/etcd`), started per test on loopback ports. Each test skips with
//! a loud message only when etcd is not installed.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use shared_proto::registry::{self as pb};
use support::*;
use tonic::Code;

macro_rules! etcd_or_skip {
    ($name:expr) => {
        match Etcd::start_or_skip($name) {
            Some(etcd) => etcd,
            None => return,
        }
    };
}

fn web(eps: &[(&str, u32, &str)]) -> pb::Service {
    svc("prod", "web", &[80], eps)
}

#[tokio::test]
async fn streams_are_keyed_by_cluster_node_and_instance() {
    let etcd = etcd_or_skip!("streams_are_keyed_by_cluster_node_and_instance");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    apply(addr, vec![web(&[("10.0.0.1", 8080, "n1")])]).await;

    // An owner and its standby on one node: distinct instances, a stream each.
    let mut owner = watch(addr, "c", "n1", "agent-a", 0).await;
    let mut standby = watch(addr, "c", "n1", "agent-b", 0).await;
    assert_eq!(next_full(&mut owner).await.services.len(), 1);
    assert_eq!(next_full(&mut standby).await.services.len(), 1);
    apply(
        addr,
        vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n1")])],
    )
    .await;
    for s in [&mut owner, &mut standby] {
        assert_eq!(describe(&next_changes(s).await), ["endpoint 10.0.0.2:8080"]);
    }

    // Agents that predate the instance field: the newer stream of (cluster, node) wins.
    let mut older = watch(addr, "c", "n2", "", 0).await;
    next_full(&mut older).await;
    let mut newer = watch(addr, "c", "n2", "", 0).await;
    next_full(&mut newer).await;
    let status = next(&mut older).await.expect_err("the older stream ends");
    assert_eq!(status.code(), Code::Aborted, "{status:?}");
    assert!(
        status
            .message()
            .contains("replaced by a newer stream for the same key"),
        "{status:?}"
    );
    reg.wait_log("replaced by a newer stream for the same key", WAIT);

    apply(addr, vec![web(&[("10.0.0.2", 8080, "n1")])]).await;
    for s in [&mut owner, &mut standby, &mut newer] {
        assert_eq!(
            describe(&next_changes(s).await),
            ["endpoint removed 10.0.0.1:8080"]
        );
    }
}

/// `--metrics-addr`: each call is counted by method and status, and each watch stream
/// while it is open and by why it ended; anything but `GET /metrics` is 404.
#[tokio::test]
async fn metrics_count_calls_by_status_and_watch_streams_open_and_ended() {
    let etcd = etcd_or_skip!("metrics_count_calls_by_status_and_watch_streams_open_and_ended");
    let dir = tempfile::tempdir().unwrap();
    let metrics_addr = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let reg = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("r.sock"),
        &["--metrics-addr", &metrics_addr],
    );
    let addr = reg.addr();
    let get = move |path: &str| {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&metrics_addr).expect("the metrics port answers");
        write!(
            c,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        out
    };
    apply(addr, vec![web(&[("10.0.0.1", 8080, "n1")])]).await;
    let bad = pb::Service {
        ports: vec![],
        ..web(&[("10.0.0.1", 8080, "n1")])
    };
    let e = client(addr)
        .await
        .apply_services(pb::ApplyServicesRequest {
            services: vec![bad],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut s = watch(addr, "c", "n1", "a", 0).await;
    next_full(&mut s).await;
    let text = get("/metrics");
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    for want in [
        "aether_registrar_calls_total{method=\"ApplyServices\",code=\"Ok\"} 1",
        "aether_registrar_calls_total{method=\"ApplyServices\",code=\"InvalidArgument\"} 1",
        "aether_registrar_calls_total{method=\"WatchEndpoints\",code=\"Ok\"} 1",
        "aether_registrar_watch_streams 1",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
    assert!(
        !text.contains("aether_registrar_leader"),
        "a replica that runs for no Lease exports no leader gauge:\n{text}"
    );
    drop(s);
    tokio::task::spawn_blocking(move || {
        aether_registrar::testing::wait_for("the closed stream to be counted", WAIT, || {
            let text = get("/metrics");
            (text.contains("aether_registrar_watch_streams 0")
                && text.contains("aether_registrar_watch_ends_total{result=\"client_gone\"} 1"))
            .then_some(())
        });
        assert!(get("/").starts_with("HTTP/1.1 404"));
    })
    .await
    .unwrap();
}

/// `--health-addr`, the kubelet's probes: `/live` is 200 for as long as the process runs;
/// `/ready` is 200 while etcd answers, 503 naming etcd's address while it does not (the
/// replica staying live), and 200 again once etcd is back; anything else is 404.
#[test]
fn the_probes_say_live_and_ready_while_etcd_answers_and_not_ready_without_it() {
    let mut etcd =
        etcd_or_skip!("the_probes_say_live_and_ready_while_etcd_answers_and_not_ready_without_it");
    let dir = tempfile::tempdir().unwrap();
    let health = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let _reg = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("r.sock"),
        &["--health-addr", &health],
    );
    let get = |path: &str| -> (u16, String) {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&health).expect("the probe port answers");
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            c,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).unwrap();
        let status = out
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        (
            status,
            out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned(),
        )
    };
    assert_eq!(get("/live").0, 200);
    // The probe port opens before the registry API listens: until then /ready says so.
    let (status, body) = aether_registrar::testing::wait_for("the registry API", WAIT, || {
        let (status, body) = get("/ready");
        (!body.contains("does not listen yet")).then_some((status, body))
    });
    assert!(
        status == 200 && body.starts_with("ready: etcd at revision"),
        "{status} {body}"
    );
    assert_eq!(get("/metrics").0, 404);
    etcd.kill(0);
    let body =
        aether_registrar::testing::wait_for("/ready to say etcd does not answer", WAIT, || {
            let (status, body) = get("/ready");
            (status == 503).then_some(body)
        });
    assert!(
        body.starts_with("not ready: etcd at ") && body.contains(&etcd.client_urls()[0]),
        "{body}"
    );
    assert_eq!(
        get("/live").0,
        200,
        "a replica without etcd is not ready, but live"
    );
    etcd.restart(0);
    aether_registrar::testing::wait_for("/ready once etcd is back", WAIT, || {
        (get("/ready").0 == 200).then_some(())
    });
}

#[tokio::test]
async fn a_corrupt_value_in_etcd_is_logged_with_its_key_and_skipped() {
    let etcd = etcd_or_skip!("a_corrupt_value_in_etcd_is_logged_with_its_key_and_skipped");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    let applied = apply(addr, vec![web(&[("10.0.0.1", 8080, "n1")])]).await;
    let mut s = watch(addr, "c", "n1", "a", 0).await;
    caught_up(&mut s, applied).await;

    let mut kv = etcd_client::Client::connect(etcd.client_urls(), None)
        .await
        .unwrap();
    let bad = "/aether/registry/endpoints/prod/web/10.0.0.9/8080";
    kv.put(bad, "{not json", None).await.unwrap();
    let batch = next_changes(&mut s).await;
    assert!(batch.changes.is_empty(), "{batch:?}");
    reg.wait_log(bad, WAIT);
    // The stream goes on, and a new stream's full view leaves the value out too.
    apply(
        addr,
        vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n1")])],
    )
    .await;
    let batch = next_changes(&mut s).await;
    // The apply removes the corrupt endpoint, absent from the request, and adds one.
    assert_eq!(
        describe(&batch),
        ["endpoint removed 10.0.0.9:8080", "endpoint 10.0.0.2:8080"]
    );
    kv.put(bad, "[]", None).await.unwrap();
    next_changes(&mut s).await;
    let full = next_full(&mut watch(addr, "c", "n1", "b", 0).await).await;
    let eps: Vec<&str> = full.services[0]
        .endpoints
        .iter()
        .map(|e| e.address.as_str())
        .collect();
    assert_eq!(eps, ["10.0.0.1", "10.0.0.2"]);
}

#[tokio::test]
async fn a_client_resumes_from_its_revision_across_a_registrar_restart_and_after_compaction_gets_a_resync()
 {
    let etcd = etcd_or_skip!(
        "a_client_resumes_from_its_revision_across_a_registrar_restart_and_after_compaction_gets_a_resync"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr().to_owned();
    let applied = apply(&addr, vec![web(&[("10.0.0.1", 8080, "n1")])]).await;

    let mut s = watch(&addr, "c", "n1", "a", 0).await;
    let at = caught_up(&mut s, applied).await;
    apply(
        &addr,
        vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n1")])],
    )
    .await;
    let first = next_changes(&mut s).await;
    assert!(first.revision > at);
    drop(s);

    // Reconnecting with the last revision: only what came after it.
    apply(&addr, vec![web(&[("10.0.0.2", 8080, "n1")])]).await;
    let mut s = watch(&addr, "c", "n1", "a", first.revision).await;
    let later = next_changes(&mut s).await;
    assert_eq!(describe(&later), ["endpoint removed 10.0.0.1:8080"]);

    // The registrar restarts mid-stream: the stream breaks, the client resumes.
    reg.restart();
    assert!(
        next(&mut s).await.is_err(),
        "the stream ends with its registrar"
    );
    let revision = apply(
        &addr,
        vec![web(&[("10.0.0.2", 8080, "n1"), ("10.0.0.3", 8080, "n1")])],
    )
    .await;
    let mut s = watch(&addr, "c", "n1", "a", later.revision).await;
    let batch = next_changes(&mut s).await;
    assert_eq!(
        (describe(&batch), batch.revision),
        (vec!["endpoint 10.0.0.3:8080".to_owned()], revision)
    );
    drop(s);

    // History compacted past the client's revision: a full view again, with the reason.
    let at = batch.revision;
    apply(
        &addr,
        vec![
            web(&[("10.0.0.4", 8080, "n1")]),
            svc("prod", "api", &[81], &[("10.0.1.1", 9000, "n2")]),
        ],
    )
    .await;
    let mut kv = etcd_client::Client::connect(etcd.client_urls(), None)
        .await
        .unwrap();
    let current = kv
        .get("/", Some(etcd_client::GetOptions::new().with_count_only()))
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    kv.compact(
        current,
        Some(etcd_client::CompactionOptions::new().with_physical()),
    )
    .await
    .unwrap();
    let mut s = watch(&addr, "c", "n1", "a", at).await;
    let full = next_full(&mut s).await;
    assert!(full.resync, "{full:?}");
    assert!(
        full.reason.contains("compacted")
            && full.reason.contains(&current.to_string())
            && full.reason.contains(&at.to_string()),
        "{}",
        full.reason
    );
    assert_eq!(full.revision, current);
    assert_eq!(
        render(&full),
        dump(&addr),
        "the resync's view is the registrar's state"
    );
    // And the stream goes on from the new revision.
    apply(&addr, vec![web(&[("10.0.0.5", 8080, "n1")])]).await;
    assert_eq!(
        describe(&next_changes(&mut s).await),
        ["endpoint removed 10.0.0.4:8080", "endpoint 10.0.0.5:8080"]
    );

    // A revision the store has not reached (another etcd's) is a resync too.
    let mut s = watch(&addr, "c", "n1", "a", current + 1000).await;
    let full = next_full(&mut s).await;
    assert!(
        full.resync && full.reason.contains("not the store the client read"),
        "{full:?}"
    );
}

#[tokio::test]
async fn a_client_resumes_on_another_replica_without_a_resync() {
    let etcd = etcd_or_skip!("a_client_resumes_on_another_replica_without_a_resync");
    let dir = tempfile::tempdir().unwrap();
    let mut first =
        RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r1.sock"), &[]);
    let second = RegistrarProcess::tcp(bin(), &etcd.endpoints(), &[]);
    let applied = apply(second.addr(), vec![web(&[("10.0.0.1", 8080, "n1")])]).await;

    let mut s = watch(first.addr(), "c", "n1", "a", 0).await;
    caught_up(&mut s, applied).await;
    apply(
        second.addr(),
        vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n1")])],
    )
    .await;
    let seen = next_changes(&mut s).await;
    first.kill();
    assert!(next(&mut s).await.is_err());

    let revision = apply(second.addr(), vec![web(&[("10.0.0.2", 8080, "n1")])]).await;
    // The client's address list: the dead replica first, as an agent would hold it.
    let both = format!("{},{}", first.addr(), second.addr());
    let req = pb::WatchEndpointsRequest {
        cluster: "c".into(),
        node: "n1".into(),
        instance: "a".into(),
        resume_revision: seen.revision,
    };
    let mut s = client(&both)
        .await
        .watch_endpoints(req)
        .await
        .unwrap()
        .into_inner();
    let batch = next_changes(&mut s).await;
    assert_eq!(
        (describe(&batch), batch.revision),
        (vec!["endpoint removed 10.0.0.1:8080".to_owned()], revision)
    );
}

/// A full view from the view the registrar keeps (the default) is the one a registrar
/// reading etcd for each stream (`--full-views-from-etcd`) sends at the same revision,
/// through applies, deletes, drain marks and keys written by hand (a corrupt value, an
/// endpoint of no service, a node's QUIC pairs); a stream opened on it goes on from the
/// revision after its view. Each registrar counts the full views by their source.
#[tokio::test]
async fn full_views_from_the_kept_view_equal_etcds_at_every_revision() {
    let etcd = etcd_or_skip!("full_views_from_the_kept_view_equal_etcds_at_every_revision");
    let dir = tempfile::tempdir().unwrap();
    let metrics = |n: u16| format!("127.0.0.1:{n}");
    let (km, em) = (
        metrics(aether_registrar::testing::free_port()),
        metrics(aether_registrar::testing::free_port()),
    );
    let kept = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("k.sock"),
        &["--metrics-addr", &km],
    );
    let from_etcd = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("e.sock"),
        &["--metrics-addr", &em, "--full-views-from-etcd"],
    );
    let mut kv = etcd_client::Client::connect(etcd.client_urls(), None)
        .await
        .unwrap();
    let db = |eps: &[(&str, u32, &str)]| svc("prod", "db", &[5432], eps);
    let key = |name: &str| pb::ServiceKey {
        namespace: "prod".into(),
        name: name.into(),
    };
    let mut revisions = Vec::new();
    revisions.push(
        apply(
            kept.addr(),
            vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n2")])],
        )
        .await,
    );
    revisions.push(apply(kept.addr(), vec![db(&[("10.0.1.1", 5432, "n1")])]).await);
    let marked = client(kept.addr())
        .await
        .set_endpoint_state(pb::SetEndpointStateRequest {
            service: Some(key("web")),
            address: "10.0.0.2".into(),
            state: pb::EndpointState::Draining as i32,
            node: "n2".into(),
            instance: "agent".into(),
        })
        .await
        .unwrap()
        .into_inner();
    revisions.push(marked.revision);
    for (key, value) in [
        (
            "/aether/registry/endpoints/prod/web/10.0.0.9/8080",
            "{not json",
        ),
        (
            "/aether/registry/endpoints/prod/gone/10.0.2.1/80",
            r#"{"service_port":80,"node":"n1","state":"healthy"}"#,
        ),
        ("/aether/registry/quic-pairs/n1", "{}"),
    ] {
        let put = kv.put(key, value, None).await.unwrap();
        revisions.push(put.header().unwrap().revision());
    }
    revisions.push(
        apply(
            kept.addr(),
            vec![web(&[("10.0.0.2", 8080, "n2"), ("10.0.0.3", 9090, "n3")])],
        )
        .await,
    );
    let deleted = client(kept.addr())
        .await
        .delete_service(pb::DeleteServiceRequest {
            service: Some(key("db")),
        })
        .await
        .unwrap()
        .into_inner();
    revisions.push(deleted.revision);
    assert!(revisions.windows(2).all(|w| w[0] < w[1]), "{revisions:?}");
    let last = *revisions.last().unwrap();

    // The kept view catches up with etcd; a view of it at `last` is etcd's at `last`.
    let mut n = 0;
    let (view, mut stream) = loop {
        n += 1;
        let mut s = watch(kept.addr(), "c", "n1", &format!("k{n}"), 0).await;
        let full = next_full(&mut s).await;
        assert!(full.revision <= last, "{} > {last}", full.revision);
        if full.revision == last {
            break (full, s);
        }
        assert!(
            n < 100,
            "the kept view stays at revision {} < {last}",
            full.revision
        );
    };
    let etcds = next_full(&mut watch(from_etcd.addr(), "c", "n1", "e", 0).await).await;
    assert_eq!(etcds.revision, last);
    assert_eq!(view, etcds, "the kept view's full view differs from etcd's");
    assert_eq!(
        view.services
            .iter()
            .map(|s| s.key.as_ref().unwrap().name.as_str())
            .collect::<Vec<_>>(),
        ["web"],
        "db deleted, gone has no service key"
    );
    assert_eq!(view.marks.len(), 1, "{:?}", view.marks);
    kept.wait_log("/aether/registry/endpoints/prod/gone/10.0.2.1/80", WAIT);

    // The stream goes on from the revision after its view.
    let next_revision = apply(kept.addr(), vec![web(&[("10.0.0.3", 9090, "n3")])]).await;
    let batch = next_changes(&mut stream).await;
    assert_eq!(
        (describe(&batch), batch.revision),
        (
            vec!["endpoint removed 10.0.0.2:8080".to_owned()],
            next_revision
        )
    );
    let text = metrics_text(&km);
    assert!(
        text.contains(&format!(
            "aether_registrar_full_views_total{{from=\"kept\"}} {n}"
        )),
        "{text}"
    );
    assert!(!text.contains("from=\"etcd\""), "{text}");
    let text = metrics_text(&em);
    assert!(
        text.contains("aether_registrar_full_views_total{from=\"etcd\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn drain_marks_are_states_set_only_by_the_endpoints_node() {
    let etcd = etcd_or_skip!("drain_marks_are_states_set_only_by_the_endpoints_node");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    let applied = apply(
        addr,
        vec![
            web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n2")]),
            svc("prod", "api", &[81], &[("10.0.0.1", 9000, "n1")]),
        ],
    )
    .await;
    let mut s = watch(addr, "c", "observer", "", 0).await;
    caught_up(&mut s, applied).await;

    let mark = |state: pb::EndpointState,
                node: &str,
                instance: &str,
                address: &str,
                service: Option<&str>| pb::SetEndpointStateRequest {
        service: service.map(|n| pb::ServiceKey {
            namespace: "prod".into(),
            name: n.into(),
        }),
        address: address.into(),
        state: state as i32,
        node: node.into(),
        instance: instance.into(),
    };
    let mut c = client(addr).await;
    // The owner marks its pod's address in one service, then its successor does the same.
    let a = c
        .set_endpoint_state(mark(
            pb::EndpointState::Draining,
            "n1",
            "agent-a",
            "10.0.0.1",
            Some("web"),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.marked, 1);
    let b = c
        .set_endpoint_state(mark(
            pb::EndpointState::Draining,
            "n1",
            "agent-b",
            "10.0.0.1",
            Some("web"),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (b.marked, b.revision),
        (1, a.revision),
        "the same state again writes nothing"
    );
    assert_eq!(
        describe(&next_changes(&mut s).await),
        ["mark 10.0.0.1 ENDPOINT_STATE_DRAINING \"n1\""]
    );
    let doc: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    assert_eq!(doc["marks"].as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(
        doc["services"][1]["endpoints"][0]["state"], "draining",
        "{doc}"
    );

    // Another node's endpoint: refused, and logged with both nodes.
    let e = c
        .set_endpoint_state(mark(
            pb::EndpointState::Draining,
            "n1",
            "agent-a",
            "10.0.0.2",
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let log = reg.wait_log("endpoint runs on another node", WAIT);
    let line = log
        .lines()
        .find(|l| l.contains("endpoint runs on another node"))
        .unwrap();
    for needle in [
        "caller_node=n1",
        "instance=agent-a",
        "address=10.0.0.2",
        "endpoint_node=n2",
    ] {
        assert!(line.contains(needle), "{needle} not in {line}");
    }
    let e = c
        .set_endpoint_state(mark(
            pb::EndpointState::Draining,
            "n1",
            "agent-a",
            "10.9.9.9",
            None,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // No service: every service with an endpoint at the address.
    let all = c
        .set_endpoint_state(mark(
            pb::EndpointState::Draining,
            "n1",
            "agent-a",
            "10.0.0.1",
            None,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.marked, 2);
    assert_eq!(
        describe(&next_changes(&mut s).await),
        ["mark 10.0.0.1 ENDPOINT_STATE_DRAINING \"n1\""],
        "only api's mark is new"
    );

    // HEALTHY removes the marks: a HEALTHY change with no node each.
    c.set_endpoint_state(mark(
        pb::EndpointState::Healthy,
        "n1",
        "agent-b",
        "10.0.0.1",
        None,
    ))
    .await
    .unwrap();
    assert_eq!(
        describe(&next_changes(&mut s).await),
        [
            "mark 10.0.0.1 ENDPOINT_STATE_HEALTHY \"\"",
            "mark 10.0.0.1 ENDPOINT_STATE_HEALTHY \"\""
        ]
    );
    let doc: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    assert!(doc["marks"].as_array().unwrap().is_empty(), "{doc}");
}

#[tokio::test]
async fn apply_and_delete_from_the_command_line() {
    let etcd = etcd_or_skip!("apply_and_delete_from_the_command_line");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    let file = dir.path().join("registry.json");
    let good = r#"{"services": [
      {"name": "web", "namespace": "prod", "ports": [80, 8080], "vip": "10.96.0.10", "endpoints": [
        {"address": "10.0.0.1", "port": 8080, "service_port": 80, "node": "n1", "pod": "web-1"},
        {"address": "10.0.0.2", "port": 8080, "service_port": 8080, "node": "n2", "pod": "web-2", "state": "draining"}]},
      {"name": "api", "namespace": "prod", "ports": [81]}
    ]}"#;
    std::fs::write(&file, good).unwrap();
    let out = cli(&[
        "apply",
        "--registrar",
        addr,
        "--file",
        file.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("applied 2 services"));

    // The dump's services are the file, as the agent's parser reads both.
    let services = |dump: &str| {
        let doc: serde_json::Value = serde_json::from_str(dump).unwrap();
        let text = serde_json::json!({ "services": doc["services"] }).to_string();
        aether_model::registry_file::parse(std::path::Path::new("dump"), text.as_bytes()).unwrap()
    };
    let want = aether_model::registry_file::parse(&file, good.as_bytes()).unwrap();
    assert_eq!(services(&dump(addr)), want);

    // A bad file: nothing applied, an error naming the file and the field, exit 1.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"services": [{"name": "web", "namespace": "prod", "ports": [80], "endpoints": [{"address": "10.0.0.1", "port": 0}]}]}"#).unwrap();
    let before = dump(addr);
    let out = cli(&[
        "apply",
        "--registrar",
        addr,
        "--file",
        bad.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("bad.json") && err.contains("services[0] (web.prod).endpoints[0]: port is 0"),
        "{err}"
    );
    assert_eq!(dump(addr), before);

    // A re-apply keeps drain marks and removes the endpoints the file no longer lists.
    let mut c = client(addr).await;
    c.set_endpoint_state(pb::SetEndpointStateRequest {
        service: None,
        address: "10.0.0.1".into(),
        state: pb::EndpointState::Draining as i32,
        node: "n1".into(),
        instance: "agent-a".into(),
    })
    .await
    .unwrap();
    let fewer = good.replace(
        r#",
        {"address": "10.0.0.2", "port": 8080, "service_port": 8080, "node": "n2", "pod": "web-2", "state": "draining"}"#,
        "",
    );
    assert_ne!(fewer, good);
    std::fs::write(&file, &fewer).unwrap();
    let out = cli(&[
        "apply",
        "--registrar",
        addr,
        "--file",
        file.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    let web = &doc["services"][1];
    assert_eq!(web["name"], "web");
    assert_eq!(web["endpoints"].as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(
        web["endpoints"][0]["state"], "draining",
        "the mark stays: {doc}"
    );
    assert_eq!(doc["marks"].as_array().unwrap().len(), 1, "{doc}");

    // Delete takes the service's endpoints and marks with it.
    let out = cli(&["delete", "--registrar", addr, "--service", "prod/web"]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("deleted prod/web"),
        "{out:?}"
    );
    let doc: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    assert_eq!(doc["services"].as_array().unwrap().len(), 1, "{doc}");
    assert!(doc["marks"].as_array().unwrap().is_empty(), "{doc}");
    let out = cli(&["delete", "--registrar", addr, "--service", "prod"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--service \"prod\" is not NAMESPACE/NAME"),
        "{out:?}"
    );
}

/// A registry file's `"mtls": true` goes through `aether-registrar apply` and etcd to a
/// watching client: in the change that adds the endpoint, in a later full view and in
/// the dump; a re-apply without it clears it.
#[tokio::test]
async fn the_mtls_mark_of_a_file_reaches_a_watching_client() {
    let etcd = etcd_or_skip!("the_mtls_mark_of_a_file_reaches_a_watching_client");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    let file = dir.path().join("registry.json");
    let doc = |mtls: bool| {
        serde_json::json!({ "services": [{ "name": "web", "namespace": "prod", "ports": [80], "endpoints": [
            { "address": "10.0.0.1", "port": 8080, "node": "n1", "pod": "web-1" },
            { "address": "10.0.0.2", "port": 8080, "node": "n2", "pod": "web-2", "mtls": mtls },
        ] }] })
        .to_string()
    };
    let apply_file = |text: String| {
        std::fs::write(&file, text).unwrap();
        let out = cli(&[
            "apply",
            "--registrar",
            addr,
            "--file",
            file.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let mut s = watch(addr, "c", "n1", "a", 0).await;
    assert!(next_full(&mut s).await.services.is_empty());

    apply_file(doc(true));
    let batch = next_changes(&mut s).await;
    assert_eq!(
        describe(&batch),
        [
            "service web",
            "endpoint 10.0.0.1:8080",
            "endpoint 10.0.0.2:8080"
        ]
    );
    let marks = |batch: &pb::ChangeBatch| -> Vec<(String, bool)> {
        batch
            .changes
            .iter()
            .filter_map(|c| match c.kind.as_ref()? {
                pb::change::Kind::EndpointUpserted(u) => {
                    u.endpoint.as_ref().map(|e| (e.address.clone(), e.mtls))
                }
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        marks(&batch),
        [
            ("10.0.0.1".to_owned(), false),
            ("10.0.0.2".to_owned(), true)
        ]
    );

    // A new client's full view and the dump carry it too; the dump reads back as the file.
    let full = next_full(&mut watch(addr, "c", "n1", "b", 0).await).await;
    let eps: Vec<(&str, bool)> = full.services[0]
        .endpoints
        .iter()
        .map(|e| (e.address.as_str(), e.mtls))
        .collect();
    assert_eq!(eps, [("10.0.0.1", false), ("10.0.0.2", true)]);
    let dumped: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    assert_eq!(
        dumped["services"][0]["endpoints"][1]["mtls"], true,
        "{dumped}"
    );
    let text = serde_json::json!({ "services": dumped["services"] }).to_string();
    let back =
        aether_model::registry_file::parse(std::path::Path::new("dump"), text.as_bytes()).unwrap();
    assert_eq!(
        back,
        aether_model::registry_file::parse(&file, doc(true).as_bytes()).unwrap()
    );

    // Cleared by a re-apply: that endpoint alone changes.
    apply_file(doc(false));
    let batch = next_changes(&mut s).await;
    assert_eq!(marks(&batch), [("10.0.0.2".to_owned(), false)], "{batch:?}");
    assert!(!dump(addr).contains("mtls"));
}

/// An invalid request over the API comes back INVALID_ARGUMENT naming the field.
#[tokio::test]
async fn apply_names_the_invalid_field() {
    let etcd = etcd_or_skip!("apply_names_the_invalid_field");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let services = vec![
        web(&[]),
        svc("prod", "a", &[80], &[]),
        svc("prod", "b", &[80], &[("10.0.0.1", 0, "n1")]),
    ];
    let e = client(reg.addr())
        .await
        .apply_services(pb::ApplyServicesRequest { services })
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "services[2].endpoints[0].port: 0")
    );
    assert!(
        dump(reg.addr()).contains("\"services\": []"),
        "nothing applied"
    );
}

/// Addresses no pod or service has are refused on apply, naming the field, and nothing
/// of the request is written; loopback is refused too, unless the registrar runs with
/// `--allow-loopback-endpoints`.
#[tokio::test]
async fn apply_refuses_link_local_multicast_unspecified_and_unless_allowed_loopback_addresses() {
    let etcd = etcd_or_skip!(
        "apply_refuses_link_local_multicast_unspecified_and_unless_allowed_loopback_addresses"
    );
    let dir = tempfile::tempdir().unwrap();
    let strict = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("s.sock"), &[]);
    let lenient = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("l.sock"),
        &["--allow-loopback-endpoints"],
    );
    let try_apply = |addr: String, services: Vec<pb::Service>| async move {
        client(&addr)
            .await
            .apply_services(pb::ApplyServicesRequest { services })
            .await
    };
    let first = || {
        vec![
            svc("prod", "a", &[80], &[("10.0.0.1", 8080, "n1")]),
            svc("prod", "b", &[80], &[]),
            svc("prod", "c", &[80], &[]),
        ]
    };
    for (addr, bad, want) in [
        (
            strict.addr(),
            "169.254.169.254",
            "services[3].endpoints[1].address: 169.254.169.254 is link-local",
        ),
        (
            lenient.addr(),
            "169.254.169.254",
            "services[3].endpoints[1].address: 169.254.169.254 is link-local",
        ),
        (
            lenient.addr(),
            "fe80::1",
            "services[3].endpoints[1].address: fe80::1 is link-local",
        ),
        (
            strict.addr(),
            "ff05::2",
            "services[3].endpoints[1].address: ff05::2 is multicast",
        ),
        (
            strict.addr(),
            "0.0.0.0",
            "services[3].endpoints[1].address: 0.0.0.0 is unspecified",
        ),
        (
            strict.addr(),
            "127.0.0.1",
            "services[3].endpoints[1].address: 127.0.0.1 is loopback (allowed only with --allow-loopback-endpoints)",
        ),
    ] {
        let mut services = first();
        services.push(svc(
            "prod",
            "web",
            &[80],
            &[("10.0.0.2", 8080, "n1"), (bad, 8080, "n1")],
        ));
        let e = try_apply(addr.to_owned(), services).await.unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (Code::InvalidArgument, want),
            "{bad} at {addr}"
        );
    }
    assert!(
        dump(strict.addr()).contains("\"services\": []"),
        "nothing of a refused request is written"
    );
    let loopback = vec![svc(
        "prod",
        "web",
        &[80],
        &[("127.0.0.1", 8080, "n1"), ("::1", 8080, "n1")],
    )];
    try_apply(lenient.addr().to_owned(), loopback)
        .await
        .expect("loopback with --allow-loopback-endpoints");
    assert!(dump(strict.addr()).contains("\"address\": \"::1\""));
}

#[test]
fn plain_tcp_without_insecure_listen_refuses_to_start() {
    // Refused before etcd is dialled: no etcd needed.
    let out = cli(&[
        "serve",
        "--etcd",
        "http://127.0.0.1:1",
        "--listen",
        "127.0.0.1:7999",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--listen 127.0.0.1:7999") && err.contains("--insecure-listen"),
        "{err}"
    );

    let help = String::from_utf8_lossy(&cli(&["serve", "--help"]).stdout).into_owned();
    for needle in [
        "--insecure-listen",
        "every caller may then do everything",
        "--allow-loopback-endpoints",
        "169.254.0.0/16",
        "--agent-uid",
        "--operator-uid",
        "unix:///path",
        "--tls-cert",
        "--tls-key",
        "without a restart",
    ] {
        assert!(
            help.contains(needle),
            "{needle} not in serve --help:\n{help}"
        );
    }
}

/// `--tls-cert`/`--tls-key` on TCP: a client that checks the registrar against its CA
/// (`--ca`) is served; one without TLS, or trusting another CA, is not. A renewed pair
/// written over the files is served from the next handshake on, with no restart, and a
/// bad pair at start is an error naming the file.
#[test]
fn over_tls_the_registrar_serves_clients_that_trust_its_ca_and_reloads_a_renewed_certificate() {
    use rcgen::ExtendedKeyUsagePurpose::ServerAuth;
    let etcd = etcd_or_skip!(
        "over_tls_the_registrar_serves_clients_that_trust_its_ca_and_reloads_a_renewed_certificate"
    );
    let (ca, other_ca) = (TestCa::new("registrar CA"), TestCa::new("another CA"));
    let (cert, key) = ca.leaf("registrar", &["127.0.0.1"], ServerAuth);
    let (cert_s, key_s) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let reg = RegistrarProcess::tcp(
        bin(),
        &etcd.endpoints(),
        &["--tls-cert", cert_s, "--tls-key", key_s],
    );
    let (ca_file, other_file) = (ca.ca_file(), other_ca.ca_file());
    let dump_with = |ca: Option<&std::path::Path>| {
        let mut args = vec!["dump", "--registrar", reg.addr(), "--timeout", "3"];
        args.extend(
            ca.map(|c| ["--ca", c.to_str().unwrap()])
                .into_iter()
                .flatten(),
        );
        cli(&args)
    };
    let out = dump_with(Some(&ca_file));
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"services\""),
        "{out:?}"
    );
    let out = dump_with(None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("pass --ca"),
        "plain HTTP/2 to the TLS port: {err}"
    );
    reg.wait_log("does not speak TLS", WAIT);
    let out = dump_with(Some(&other_file));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("UnknownIssuer"),
        "another CA: {err}"
    );

    // Renewed by the other CA, key first: the half-written pair is not served meanwhile.
    let (new_cert, new_key) = other_ca.leaf_pem("registrar", &["127.0.0.1"], ServerAuth);
    std::fs::write(&key, new_key).unwrap();
    assert!(
        dump_with(Some(&ca_file)).status.success(),
        "the last good pair stays while the key does not fit"
    );
    std::fs::write(&cert, new_cert).unwrap();
    let out = dump_with(Some(&other_file));
    assert!(
        out.status.success(),
        "the renewed certificate is served without a restart: {out:?}"
    );
    let err = String::from_utf8_lossy(&dump_with(Some(&ca_file)).stderr).into_owned();
    assert!(
        err.contains("UnknownIssuer"),
        "the old CA no longer fits: {err}"
    );
    let log = reg.wait_log("serving certificate reloaded", WAIT);
    assert!(
        log.contains("serving certificate not reloaded"),
        "the mismatch was logged: {log}"
    );

    // At start: a key that does not fit, and a unix socket, are refused with the reason.
    let (_, stray_key) = ca.leaf("stray", &["127.0.0.1"], ServerAuth);
    let listen = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let out = cli(&[
        "serve",
        "--etcd",
        &etcd.endpoints(),
        "--listen",
        &listen,
        "--insecure-listen",
        "--tls-cert",
        cert_s,
        "--tls-key",
        stray_key.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("does not fit --tls-cert") && err.contains("stray.key"),
        "{err}"
    );
    let out = cli(&[
        "serve",
        "--etcd",
        &etcd.endpoints(),
        "--listen",
        "unix:///tmp/aether-tls-test.sock",
        "--tls-cert",
        cert_s,
        "--tls-key",
        key_s,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--tls-cert is for a TCP --listen"),
        "{err}"
    );
}

/// The unix socket's callers are their uids: an agent uid may watch but not apply, any
/// other uid may do nothing. Run as the clients would be, under `setpriv`.
#[tokio::test]
async fn unix_socket_callers_are_authorized_by_uid() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "SKIPPED unix_socket_callers_are_authorized_by_uid: needs root to run clients as other uids (setpriv); authz::tests covers the decision"
        );
        return;
    }
    let etcd = etcd_or_skip!("unix_socket_callers_are_authorized_by_uid");
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let reg = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("r.sock"),
        &["--agent-uid", "65534"],
    );
    let file = dir.path().join("registry.json");
    std::fs::write(
        &file,
        r#"{"services": [{"name": "web", "namespace": "prod", "ports": [80]}]}"#,
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let as_uid = |uid: &str, args: &[&str]| {
        std::process::Command::new("setpriv")
            .args(["--reuid", uid, "--regid", uid, "--clear-groups", "--"])
            .arg(bin())
            .args(args)
            .output()
            .expect("setpriv runs")
    };
    let addr = reg.addr();
    let f = file.to_str().unwrap();

    let out = as_uid("65534", &["dump", "--registrar", addr]);
    assert!(
        out.status.success(),
        "an agent may watch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_uid("65534", &["apply", "--registrar", addr, "--file", f]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("PermissionDenied")
            && err.contains("uid 65534 may not call ApplyServices"),
        "{err}"
    );
    let out = as_uid("65533", &["dump", "--registrar", addr]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("uid 65533 may not call WatchEndpoints: neither an agent"),
        "{err}"
    );
    reg.wait_log("refused", WAIT);
    // The registrar's own uid (root here) is the default operator.
    let out = cli(&["apply", "--registrar", addr, "--file", f]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A registrar on a three-member etcd cluster serves through a member's restart.
#[tokio::test]
async fn a_three_member_cluster_serves_through_a_member_restart() {
    let Some(mut etcd) =
        Etcd::cluster_or_skip("a_three_member_cluster_serves_through_a_member_restart", 3)
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addr = reg.addr();
    let applied = apply(addr, vec![web(&[("10.0.0.1", 8080, "n1")])]).await;
    let mut s = watch(addr, "c", "n1", "a", 0).await;
    caught_up(&mut s, applied).await;
    etcd.kill(2);
    etcd.restart(2);
    apply(
        addr,
        vec![web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n1")])],
    )
    .await;
    let batch = tokio::time::timeout(Duration::from_secs(15), next_changes(&mut s))
        .await
        .expect("a batch after the restart");
    assert_eq!(describe(&batch), ["endpoint 10.0.0.2:8080"]);
}

/// SIGTERM ends open streams with UNAVAILABLE (their clients resume elsewhere) and the
/// process exits 0, leaving its socket file for the next start to replace.
// Multi-threaded: the client's connection must be driven while the test waits for the
// exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_streams_with_unavailable_and_exits_cleanly() {
    let etcd = etcd_or_skip!("sigterm_ends_streams_with_unavailable_and_exits_cleanly");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("r.sock");
    let mut reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &sock, &[]);
    let mut s = watch(reg.addr(), "c", "n1", "a", 0).await;
    next_full(&mut s).await;
    let status = reg.terminate(WAIT);
    assert!(status.success(), "{status}: {}", reg.log());
    let e = next(&mut s).await.expect_err("the stream ends");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("shutting down"), "{e:?}");
    assert!(sock.exists(), "no process unlinks its socket on exit");
    reg.restart();
    next_full(&mut watch(reg.addr(), "c", "n1", "a", 0).await).await;
}

/// etcd caps the writes of one transaction (`--max-txn-ops`, 128 by default); a service
/// whose apply needs more is refused whole, with the reason.
#[tokio::test]
async fn a_service_over_etcds_transaction_limit_is_refused_with_the_reason() {
    let etcd = etcd_or_skip!("a_service_over_etcds_transaction_limit_is_refused_with_the_reason");
    let dir = tempfile::tempdir().unwrap();
    let reg = RegistrarProcess::unix(bin(), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
    let addrs: Vec<String> = (0..200)
        .map(|i| format!("10.0.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let eps: Vec<(&str, u32, &str)> = addrs.iter().map(|a| (a.as_str(), 8080, "n1")).collect();
    let e = client(reg.addr())
        .await
        .apply_services(pb::ApplyServicesRequest {
            services: vec![web(&eps)],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("prod/web: 201 writes") && e.message().contains("--max-txn-ops"),
        "{e:?}"
    );
    apply(reg.addr(), vec![web(&eps[..100])]).await;
}

/// `--etcd-ca`, `--etcd-cert` and `--etcd-key`: the registrar reaches an etcd that serves
/// TLS and requires client certificates; without a client certificate it cannot start.
#[tokio::test]
async fn the_registrar_reaches_etcd_over_tls_with_a_client_certificate() {
    if !Etcd::available() {
        eprintln!(
            "SKIPPED the_registrar_reaches_etcd_over_tls_with_a_client_certificate: {} is not installed",
            aether_registrar::testing::ETCD_BIN
        );
        return;
    }
    use rcgen::ExtendedKeyUsagePurpose;
    let dir = tempfile::tempdir().unwrap();
    let test_ca = TestCa::new("aether test CA");
    let ca_file = test_ca.ca_file();
    let (server_cert, server_key) =
        test_ca.leaf("etcd", &["127.0.0.1"], ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) =
        test_ca.leaf("registrar", &[], ExtendedKeyUsagePurpose::ClientAuth);
    let etcd = Etcd::start_tls(aether_registrar::testing::EtcdTls {
        cert: server_cert,
        key: server_key,
        client_ca: ca_file.clone(),
    });
    assert!(etcd.endpoints().starts_with("https://"));

    let (ca, cert, key) = (
        ca_file.to_str().unwrap(),
        client_cert.to_str().unwrap(),
        client_key.to_str().unwrap(),
    );
    let reg = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("r.sock"),
        &["--etcd-ca", ca, "--etcd-cert", cert, "--etcd-key", key],
    );
    apply(reg.addr(), vec![web(&[("10.0.0.1", 8080, "n1")])]).await;
    let full = next_full(&mut watch(reg.addr(), "c", "n1", "a", 0).await).await;
    assert_eq!(full.services.len(), 1);

    // The CA alone: etcd refuses the handshake, and the start fails naming etcd.
    let sock = dir.path().join("r2.sock");
    let listen = format!("unix://{}", sock.display());
    let out = cli(&[
        "serve",
        "--etcd",
        &etcd.endpoints(),
        "--listen",
        &listen,
        "--etcd-ca",
        ca,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("etcd at {}", etcd.endpoints())),
        "{err}"
    );
}

/// `GET /metrics` on `addr`, the body.
fn metrics_text(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(addr).expect("the metrics port answers");
    write!(
        c,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    out
}

/// The SETTINGS the registrar's HTTP/2 server announces on a new connection, by id.
async fn h2_settings(addr: &str) -> std::collections::BTreeMap<u16, u32> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    loop {
        let mut head = [0u8; 9];
        tokio::time::timeout(WAIT, c.read_exact(&mut head))
            .await
            .expect("a frame in time")
            .unwrap();
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0u8; len];
        c.read_exact(&mut payload).await.unwrap();
        // A SETTINGS frame (type 4) that is not an ACK (flag 1).
        if head[3] == 4 && head[4] & 1 == 0 {
            return payload
                .chunks_exact(6)
                .map(|s| {
                    (
                        u16::from_be_bytes([s[0], s[1]]),
                        u32::from_be_bytes([s[2], s[3], s[4], s[5]]),
                    )
                })
                .collect();
        }
    }
}

/// The limits of `serve`: HTTP/2 announces its stream cap, window and header-list size;
/// a connection past the per-source cap is closed at once; a node's third instance of a
/// watch stream is refused while an open instance still replaces its own; a watch
/// request over `--max-request-bytes` ends with RESOURCE_EXHAUSTED; a node past its
/// drain-mark burst is RESOURCE_EXHAUSTED while another node is not. Each refusal is
/// counted.
#[tokio::test]
async fn connections_streams_and_bodies_past_their_limits_are_refused_and_counted() {
    let etcd =
        etcd_or_skip!("connections_streams_and_bodies_past_their_limits_are_refused_and_counted");
    let metrics_addr = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let reg = RegistrarProcess::tcp(
        bin(),
        &etcd.endpoints(),
        &[
            "--metrics-addr",
            &metrics_addr,
            "--max-connections-per-source",
            "3",
            "--max-concurrent-streams",
            "4",
            "--http2-window",
            "70000",
            "--max-request-bytes",
            "1024",
            // A burst of three drain marks per node and next to no refill in the test.
            "--drain-mark-burst",
            "3",
            "--drain-marks-per-node",
            "0.001",
        ],
    );
    let addr = reg.addr().to_owned();
    let m = metrics_addr.clone();
    let open_now = move |n: usize| {
        let m = m.clone();
        tokio::task::spawn_blocking(move || {
            aether_registrar::testing::wait_for("the open connections", WAIT, || {
                metrics_text(&m)
                    .contains(&format!("aether_registrar_connections {n}\n"))
                    .then_some(())
            })
        })
    };
    // The start's probe connections have closed.
    open_now(0).await.unwrap();

    let settings = h2_settings(&addr).await;
    assert_eq!(
        settings.get(&3),
        Some(&4),
        "MAX_CONCURRENT_STREAMS: {settings:?}"
    );
    assert_eq!(
        settings.get(&4),
        Some(&70000),
        "INITIAL_WINDOW_SIZE: {settings:?}"
    );
    assert_eq!(
        settings.get(&6),
        Some(&8192),
        "MAX_HEADER_LIST_SIZE: {settings:?}"
    );
    open_now(0).await.unwrap();

    // Three connections from 127.0.0.1 are held; the fourth is closed at once.
    let held: Vec<std::net::TcpStream> = (0..3)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    open_now(3).await.unwrap();
    let refused = std::net::TcpStream::connect(&addr).unwrap();
    refused.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = [0u8; 64];
    let n = std::io::Read::read(&mut &refused, &mut buf).unwrap_or(0);
    assert_eq!(
        n, 0,
        "the connection past the cap is closed before anything is said"
    );
    drop(held);
    open_now(0).await.unwrap();

    // One connection carries every stream below.
    let c = client(&addr).await;
    let req = |instance: &str| pb::WatchEndpointsRequest {
        cluster: "c".into(),
        node: "n1".into(),
        instance: instance.into(),
        resume_revision: 0,
    };
    let mut a = c
        .clone()
        .watch_endpoints(req("a"))
        .await
        .unwrap()
        .into_inner();
    next_full(&mut a).await;
    let mut b = c
        .clone()
        .watch_endpoints(req("b"))
        .await
        .unwrap()
        .into_inner();
    next_full(&mut b).await;
    let e = c.clone().watch_endpoints(req("c")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("already has 2 watch streams open"),
        "{e:?}"
    );
    reg.wait_log(
        "watch stream refused: the node has its most streams open",
        WAIT,
    );
    // The owner reconnecting under its own instance replaces its stream at the cap.
    let mut a2 = c
        .clone()
        .watch_endpoints(req("a"))
        .await
        .unwrap()
        .into_inner();
    next_full(&mut a2).await;
    assert_eq!(next(&mut a).await.unwrap_err().code(), Code::Aborted);

    // A watch request over 1024 bytes (of another node, under no stream cap).
    let e = c
        .clone()
        .watch_endpoints(pb::WatchEndpointsRequest {
            node: "n2".into(),
            ..req(&"x".repeat(2000))
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("over 1024 bytes"), "{e:?}");
    // An apply is not held to it.
    let many: Vec<(String, u32, &str)> = (1..60)
        .map(|i| (format!("10.0.1.{i}"), 8080, "n1"))
        .collect();
    let eps: Vec<(&str, u32, &str)> = many.iter().map(|(a, p, n)| (a.as_str(), *p, *n)).collect();
    apply(&addr, vec![web(&eps)]).await;

    // Drain marks: node n1's burst, then RESOURCE_EXHAUSTED; n2 has its own budget.
    let mark = |node: &str, i: u32| pb::SetEndpointStateRequest {
        service: None,
        address: if i == 0 {
            "10.0.2.1".into()
        } else {
            format!("10.0.1.{i}")
        },
        state: pb::EndpointState::Draining as i32,
        node: node.into(),
        instance: "a".into(),
    };
    for i in 1..=3 {
        c.clone().set_endpoint_state(mark("n1", i)).await.unwrap();
    }
    let e = c
        .clone()
        .set_endpoint_state(mark("n1", 4))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    reg.wait_log("the node is over its drain-mark rate", WAIT);
    let e = c
        .clone()
        .set_endpoint_state(mark("n2", 5))
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::PermissionDenied,
        "n2 is not rate-limited: {e:?}"
    );
    // A mark that names no service right after an apply finds the new endpoint through
    // the address index, which catches up with etcd first: no mark read every endpoint.
    apply(
        &addr,
        vec![svc("prod", "fresh", &[90], &[("10.0.2.1", 9090, "n3")])],
    )
    .await;
    let fresh = c
        .clone()
        .set_endpoint_state(mark("n3", 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fresh.marked, 1, "{fresh:?}");

    let text = metrics_text(&metrics_addr);
    for want in [
        "aether_registrar_connections_refused_total{result=\"per_source\"} 1",
        "aether_registrar_refusals_total{reason=\"watch_streams_per_node\"} 1",
        "aether_registrar_refusals_total{reason=\"too_large\"} 1",
        "aether_registrar_refusals_total{reason=\"drain_mark_rate\"} 1",
        "aether_registrar_drain_mark_scans_total 0",
        "aether_registrar_calls_total{method=\"WatchEndpoints\",code=\"ResourceExhausted\"} 2",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
}

fn pair(tcp: &str, quic: &str, sni: &str, pod: &str) -> pb::QuicPair {
    pb::QuicPair {
        tcp: tcp.into(),
        quic: quic.into(),
        quic_sni: sni.into(),
        pod: pod.into(),
        since: 1_764_900_000,
    }
}

fn set_pairs(node: &str, instance: &str, pairs: Vec<pb::QuicPair>) -> pb::SetQuicPairsRequest {
    pb::SetQuicPairsRequest {
        node: node.into(),
        pairs,
        instance: instance.into(),
    }
}

/// The one endpoint upsert of a batch: its address:port, quic and quic_sni.
fn twin_upsert(batch: &pb::ChangeBatch) -> (String, String, String) {
    use pb::change::Kind as C;
    assert_eq!(batch.changes.len(), 1, "{batch:?}");
    match batch.changes[0].kind.as_ref().unwrap() {
        C::EndpointUpserted(u) => {
            let e = u.endpoint.as_ref().unwrap();
            (
                format!("{}:{}", e.address, e.port),
                e.quic.clone(),
                e.quic_sni.clone(),
            )
        }
        other => panic!("expected an endpoint upsert, got {other:?}"),
    }
}

/// SetQuicPairs: a node's pairs reach watchers on that node's endpoints at the pairs'
/// addresses (as upserts, and in full views and the dump); the same set restated by a
/// successor sends nothing; a pair with no endpoint yet applies when the endpoint
/// appears; a removed pair sends its endpoint without a twin. Another node's pair for an
/// address leaves the endpoint alone. Bad sets, too large ones and calls past the node's
/// rate are refused and counted.
#[tokio::test]
async fn quic_pairs_reach_their_nodes_endpoints_and_a_restated_set_sends_nothing() {
    let etcd =
        etcd_or_skip!("quic_pairs_reach_their_nodes_endpoints_and_a_restated_set_sends_nothing");
    let dir = tempfile::tempdir().unwrap();
    let metrics_addr = format!("127.0.0.1:{}", aether_registrar::testing::free_port());
    let reg = RegistrarProcess::unix(
        bin(),
        &etcd.endpoints(),
        &dir.path().join("r.sock"),
        &[
            "--metrics-addr",
            &metrics_addr,
            "--quic-pairs-per-node",
            "3",
            "--quic-pair-sets-per-node",
            "0.001",
            "--quic-pair-set-burst",
            "5",
        ],
    );
    let addr = reg.addr();
    let applied = apply(
        addr,
        vec![
            web(&[("10.0.0.1", 8080, "n1"), ("10.0.0.2", 8080, "n2")]),
            svc("prod", "api", &[81], &[("10.0.0.1", 9000, "n1")]),
        ],
    )
    .await;
    let mut s = watch(addr, "c", "observer", "", 0).await;
    caught_up(&mut s, applied).await;
    let mut c = client(addr).await;

    // The owner of n1 advertises two pairs; one names an endpoint not registered yet.
    let owner_set = vec![
        pair(
            "10.0.0.1:8080",
            "n1.example:4443",
            "web-1.prod.example",
            "prod/web-1",
        ),
        pair("10.0.0.9:8080", "n1.example:4443", "", "prod/web-9"),
    ];
    let a = c
        .set_quic_pairs(set_pairs("n1", "agent-a", owner_set.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (a.changed, a.endpoints_updated, a.unmatched),
        (true, 1, 1),
        "{a:?}"
    );
    let b = next_changes(&mut s).await;
    assert_eq!(
        twin_upsert(&b),
        (
            "10.0.0.1:8080".into(),
            "n1.example:4443".into(),
            "web-1.prod.example".into()
        )
    );
    assert_eq!(b.revision, a.revision);

    // Its successor restates the same set: nothing is written or sent. The next batch
    // the watcher gets is the apply below, nothing before it.
    let again = c
        .set_quic_pairs(set_pairs("n1", "agent-b", owner_set.clone()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (again.changed, again.endpoints_updated, again.revision),
        (false, 0, a.revision),
        "{again:?}"
    );
    // Node n2 names n1's endpoint in its own set: n1's endpoint is not n2's to pair.
    let other = c
        .set_quic_pairs(set_pairs(
            "n2",
            "agent-x",
            vec![pair("10.0.0.1:8080", "evil.example:4443", "", "prod/web-1")],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (other.endpoints_updated, other.unmatched),
        (0, 1),
        "{other:?}"
    );
    // The pair without an endpoint applies when the endpoint appears; the endpoint with a
    // twin already is not rewritten by the apply.
    apply(
        addr,
        vec![web(&[
            ("10.0.0.1", 8080, "n1"),
            ("10.0.0.2", 8080, "n2"),
            ("10.0.0.9", 8080, "n1"),
        ])],
    )
    .await;
    assert_eq!(
        twin_upsert(&next_changes(&mut s).await),
        ("10.0.0.9:8080".into(), "n1.example:4443".into(), "".into())
    );

    // A new watcher's full view, and the dump, carry the twins where set.
    let mut fresh = watch(addr, "c", "late", "", 0).await;
    let full = next_full(&mut fresh).await;
    let twins: Vec<(String, String, String)> = full
        .services
        .iter()
        .flat_map(|s| {
            let name = s.key.as_ref().unwrap().name.clone();
            s.endpoints.iter().map(move |e| {
                (
                    format!("{name} {}:{}", e.address, e.port),
                    e.quic.clone(),
                    e.quic_sni.clone(),
                )
            })
        })
        .collect();
    assert_eq!(
        twins,
        [
            ("api 10.0.0.1:9000".into(), "".into(), "".into()),
            (
                "web 10.0.0.1:8080".into(),
                "n1.example:4443".into(),
                "web-1.prod.example".into()
            ),
            ("web 10.0.0.2:8080".into(), "".into(), "".into()),
            (
                "web 10.0.0.9:8080".into(),
                "n1.example:4443".into(),
                "".into()
            ),
        ]
    );
    let doc: serde_json::Value = serde_json::from_str(&dump(addr)).unwrap();
    let web_eps = &doc["services"][1]["endpoints"];
    assert_eq!(web_eps[0]["quic"], "n1.example:4443", "{doc}");
    assert_eq!(web_eps[0]["quic_sni"], "web-1.prod.example", "{doc}");
    assert!(web_eps[1].get("quic").is_none(), "{doc}");
    assert_eq!(dump(addr), render(&full), "the dump is the full view");

    // Removing a pair sends its endpoint without a twin.
    let removed = c
        .set_quic_pairs(set_pairs("n1", "agent-b", owner_set[1..].to_vec()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((removed.changed, removed.endpoints_updated), (true, 1));
    assert_eq!(
        twin_upsert(&next_changes(&mut s).await),
        ("10.0.0.1:8080".into(), "".into(), "".into())
    );

    // Refusals, each naming the value at fault, counted by reason.
    let bad = c
        .set_quic_pairs(set_pairs(
            "n1",
            "agent-b",
            vec![pair("10.0.0.1", "n1.example:4443", "", "prod/web-1")],
        ))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(
        bad.message().contains("pairs[0].tcp") && bad.message().contains("\"10.0.0.1\""),
        "{bad:?}"
    );
    let many = c
        .set_quic_pairs(set_pairs(
            "n1",
            "agent-b",
            (1..=4)
                .map(|i| pair(&format!("10.0.1.{i}:80"), "n1.example:4443", "", "prod/p"))
                .collect(),
        ))
        .await
        .unwrap_err();
    assert_eq!(many.code(), Code::ResourceExhausted, "{many:?}");
    assert!(many.message().contains("--quic-pairs-per-node"), "{many:?}");
    // n1's fourth and fifth sets (the burst), then the rate.
    let empty = c
        .set_quic_pairs(set_pairs("n1", "agent-b", vec![]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((empty.changed, empty.endpoints_updated), (true, 1));
    assert_eq!(
        twin_upsert(&next_changes(&mut s).await),
        ("10.0.0.9:8080".into(), "".into(), "".into())
    );
    c.set_quic_pairs(set_pairs("n1", "agent-b", vec![]))
        .await
        .unwrap();
    let rate = c
        .set_quic_pairs(set_pairs("n1", "agent-b", vec![]))
        .await
        .unwrap_err();
    assert_eq!(rate.code(), Code::ResourceExhausted, "{rate:?}");
    reg.wait_log("over its QUIC pair set rate", WAIT);

    let text = metrics_text(&metrics_addr);
    for want in [
        "aether_registrar_refusals_total{reason=\"quic_pairs_invalid\"} 1",
        "aether_registrar_refusals_total{reason=\"quic_pairs_per_node\"} 1",
        "aether_registrar_refusals_total{reason=\"quic_pairs_rate\"} 1",
        "aether_registrar_calls_total{method=\"SetQuicPairs\",code=\"Ok\"} 6",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
}

/// Reading the store's revision costs etcd what a read of one key costs, at 20,000 keys:
/// every drain mark (a pod's DEL), QUIC pair set, resumed stream and `/ready` reads it. A
/// count over the whole prefix made etcd collect every key's revision first; at 10,000
/// services, under the gate's pod churn, that kept etcd at half a core and slowed every
/// registry write. Measured by etcd's own allocation counter, over 50 reads of each.
#[tokio::test]
async fn reading_the_revision_does_not_walk_the_registry() {
    use aether_registrar::keys::Layout;
    use aether_registrar::store::{EtcdOptions, Store};
    use etcd_client::{Client, Txn, TxnOp};

    let etcd = etcd_or_skip!("reading_the_revision_does_not_walk_the_registry");
    let layout = Layout::new("/aether");
    let mut client = Client::connect(etcd.client_urls(), None).await.unwrap();
    for batch in 0..200 {
        let puts: Vec<TxnOp> = (0..100)
            .map(|i| TxnOp::put(format!("/aether/endpoints/k{batch:03}-{i:03}"), "v", None))
            .collect();
        client.txn(Txn::new().and_then(puts)).await.unwrap();
    }
    let opts = EtcdOptions {
        endpoints: etcd.client_urls(),
        ca: None,
        cert: None,
        key: None,
        connect_timeout: Duration::from_secs(5),
    };
    let store = Store::connect(&opts, layout).await.unwrap();
    let allocated = || {
        etcd.metric(0, "go_memstats_alloc_bytes_total")
            .expect("etcd's go_memstats_alloc_bytes_total")
    };
    // What 50 reads cost etcd: a read of one key outside the prefix (etcd allocates about
    // 0.5 MB per request whatever it reads), then the store's revision.
    let before = allocated();
    for _ in 0..50 {
        client.get("/elsewhere", None).await.unwrap();
    }
    let one_key = (allocated() - before) / 1e6;
    let before = allocated();
    let mut revisions = Vec::new();
    for _ in 0..50 {
        revisions.push(store.revision().await.unwrap());
    }
    let mb = (allocated() - before) / 1e6;
    // The revision is the store's: 200 transactions after etcd's first revision.
    assert!(revisions.iter().all(|r| *r == 201), "{revisions:?}");
    // A walk of 20,000 keys costs about 4 times a one-key read.
    assert!(
        mb < 1.5 * one_key,
        "etcd allocated {mb:.1} MB for 50 revision reads, {one_key:.1} MB for 50 reads of one key: the revision read walks every key under the prefix"
    );
    eprintln!(
        "etcd allocated {mb:.1} MB for 50 revision reads at 20,000 keys, {one_key:.1} MB for 50 reads of one key"
    );
}
