//! The pods' QUIC twins through a real Envoy 1.40 on a real data path, reached by a real
//! HTTP/3 client (aioquic, `e2e/quic/h3_client.py`).
//!
//! A node namespace runs Envoy with the worker side in-process ([`WorkerRig`]) and the
//! twins on the node's client-facing address (10.250.0.1, UDP); a pod `web` answers
//! HTTP/1.1 at 10.77.0.2:80, a pod `raw` that opted out (`no_quic_twin`) at 10.77.0.3.
//! The client namespace sends HTTP/3 to the node naming a pod's twin by its server name,
//! with a client SVID of the trust domain, without one, and with SVIDs the trust domain
//! does not accept. Then a third pod's SVID is released late: its twin must serve within
//! 1 s. Without root, `nft` or Envoy the test says so loudly and returns.

use std::time::{Duration, Instant};

use aether_e2e::datapath::{Datapath, Serve, TestCa};
use aether_e2e::envoy::{self, WorkerRig, registry_json};
use aether_e2e::quic::{self, TD, TWIN_PORT, body, h3, pem_files, twin_chains};
use aether_model::{Change, twin_sni};

const BOUND: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http3_client_with_an_svid_reaches_the_pod_through_its_twin_and_others_are_refused() {
    let what = "QUIC twins";
    let Some(envoy_bin) = quic::envoy_or_skip(what) else {
        return;
    };
    envoy::init_logs("info");
    let mut dp = Datapath::create("q", [10, 77, 0]).expect("the data path's namespaces");
    dp.add_pod("web", 2, Serve::Http(None))
        .expect("the pod web");
    dp.add_pod("raw", 3, Serve::Http(None))
        .expect("the pod raw");
    dp.add_pod("late", 4, Serve::Http(None))
        .expect("the pod late");
    let ca = TestCa::new(TD);
    let (web, raw, late, agent, client) = (
        ca.mint("default", "web"),
        ca.mint("default", "raw"),
        ca.mint("default", "late"),
        ca.mint("aether-system", "agent"),
        ca.mint("default", "client"),
    );
    let twins = quic::twin_address(TWIN_PORT);
    let options = quic::twin_rig_options(&dp, &ca, &agent);
    let rig = WorkerRig::start_with(&envoy_bin, &registry_json(&[]), options).await;
    dp.redirect(rig.inbound_port, None)
        .expect("the capture redirect");
    rig.node.apply([
        Change::UpsertPod(dp.pod_record("web", false)),
        Change::UpsertPod(dp.pod_record("raw", true)),
        Change::UpsertPod(dp.pod_record("late", false)),
        Change::SetPodSvid {
            uid: "uid-web".into(),
            svid: Some(web.svid.clone()),
        },
        Change::SetPodSvid {
            uid: "uid-raw".into(),
            svid: Some(raw.svid.clone()),
        },
    ]);
    assert!(rig.wait_acked_current(BOUND).await, "Envoy did not ACK");
    assert_eq!(
        twin_chains(&rig),
        ["uid-web"],
        "one twin: raw opted out, late has no SVID yet"
    );

    let ns = dp.client.name.clone();
    let client_pem = pem_files(&client);
    // A listener Envoy has just taken reaches its workers a moment later: poll.
    let start = Instant::now();
    let ok = loop {
        let r = h3(
            Some(&ns),
            twins,
            &twin_sni("uid-web"),
            Some(&client_pem),
            3.0,
        );
        if r["ok"] == true || start.elapsed() > BOUND {
            break r;
        }
    };
    assert_eq!(ok["ok"], true, "through web's twin: {ok}");
    assert!(body(&ok).starts_with("web "), "web answers: {ok}");
    assert_eq!(
        ok["server_uri"][0], "spiffe://aether.test/ns/default/pod/web",
        "the twin presents web's SVID: {ok}"
    );
    eprintln!("HTTP/3 through web's twin: {}", body(&ok).trim());

    // Refused: no client certificate, another trust domain's SVID, and our CA's leaf
    // naming another trust domain.
    let foreign = pem_files(&TestCa::new("other.test").mint("default", "client"));
    let evil = pem_files(&ca.mint_id("spiffe://evil.test/ns/default/pod/x"));
    for (who, cert) in [
        ("no client certificate", None),
        ("another trust domain's SVID", Some(&foreign)),
        ("our CA naming another trust domain", Some(&evil)),
    ] {
        let r = h3(Some(&ns), twins, &twin_sni("uid-web"), cert, 2.0);
        assert_ne!(r["ok"], true, "{who}: served: {r}");
        assert!(
            r["responses"].as_array().is_none_or(|a| a.is_empty()),
            "{who}: got an answer: {r}"
        );
        eprintln!("{who}: refused ({})", r["error"]);
    }
    // Envoy counts each refusal where the dashboard and alerts read it: the QUIC close
    // code it sent, and the failed SAN check.
    let stats = rig.admin("/stats");
    let twin_stat = |name: &str| -> u64 {
        let key = format!("listener.{}_{}.{name}: ", twins.ip(), twins.port());
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&key)?.trim().parse().ok())
            .unwrap_or(0)
    };
    let close = "http3.downstream.tx.quic_connection_close_error_code_QUIC_TLS_CERTIFICATE";
    for (what, stat) in [
        ("no client certificate", format!("{close}_REQUIRED")),
        ("an unknown CA", format!("{close}_UNKNOWN")),
        (
            "a SPIFFE ID outside the trust domain",
            "ssl.fail_verify_san".into(),
        ),
    ] {
        assert!(
            twin_stat(&stat) >= 1,
            "{what}: {stat} not counted:\n{stats}"
        );
    }
    assert!(
        stats.contains("http.twin.downstream_rq_http3_total: 1"),
        "the HTTP/3 request is counted under the twins' stat prefix:\n{stats}"
    );
    // The opted-out pod has no twin: its server name selects no chain.
    let r = h3(
        Some(&ns),
        twins,
        &twin_sni("uid-raw"),
        Some(&client_pem),
        2.0,
    );
    assert_ne!(r["ok"], true, "raw opted out yet answered over HTTP/3: {r}");

    // The late pod's SVID arrives: its twin serves within 1 s.
    let released = Instant::now();
    rig.node.apply([Change::SetPodSvid {
        uid: "uid-late".into(),
        svid: Some(late.svid.clone()),
    }]);
    assert!(rig.wait_acked_current(BOUND).await, "Envoy did not ACK");
    let acked = released.elapsed();
    let served = loop {
        let r = h3(
            Some(&ns),
            twins,
            &twin_sni("uid-late"),
            Some(&client_pem),
            1.0,
        );
        if r["ok"] == true || released.elapsed() > BOUND {
            break r;
        }
    };
    let answered = released.elapsed();
    assert_eq!(served["ok"], true, "late's twin: {served}");
    assert!(body(&served).starts_with("late "), "late answers: {served}");
    // web's twin kept serving through the in-place update.
    let again = h3(
        Some(&ns),
        twins,
        &twin_sni("uid-web"),
        Some(&client_pem),
        3.0,
    );
    assert_eq!(
        again["ok"], true,
        "web's twin after late's was added: {again}"
    );
    eprintln!(
        "late SVID released -> twin ACKed by Envoy in {:.1} ms; first HTTP/3 answer {:.1} ms after release (a fresh Python client per attempt, ~0.2-0.4 s of it interpreter start)",
        acked.as_secs_f64() * 1e3,
        answered.as_secs_f64() * 1e3
    );
    assert!(
        acked < Duration::from_secs(1),
        "the twin was served {acked:?} after its SVID"
    );
    assert!(
        answered < Duration::from_secs(1) + Duration::from_millis(500),
        "first answer {answered:?} after the SVID"
    );
    assert_eq!(twin_chains(&rig), ["uid-late", "uid-web"]);

    // The pod's DEL takes its twin.
    rig.node.apply([Change::RemovePod("uid-web".into())]);
    assert!(rig.wait_acked_current(BOUND).await, "Envoy did not ACK");
    assert_eq!(twin_chains(&rig), ["uid-late"]);
    drop(raw);
}
