//! The ADS server against a real Envoy 1.40: ACKs, routing, registry changes, NACKs.
//!
//! Each test runs the worker side in-process (registry file, capture file, node, ADS on
//! `<tmp>/xds.sock`, see [`WorkerRig`]) and an Envoy bootstrapped from
//! `deploy/envoy/bootstrap.yaml.tmpl`. Without Envoy (see `scripts/install-envoy.sh`) each
//! test says so loudly and returns. Each scenario runs twice: over state-of-the-world ADS
//! and over incremental (delta) ADS.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, WorkerRig, envoy_or_skip, registry_json};
use aether_e2e::harness::load::get as http_get;
use aether_e2e::harness::upstream;
use aether_e2e::testing::wait_for;
use aether_model::{Change, Pod};

const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const RDS: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
const WEB: &str = "outbound|80||web.default";

/// The version Envoy's config_dump shows for the `outbound` route configuration: the
/// type's version in state of the world, the resource's own (its content hash) in delta.
fn route_version(s: &aether_model::Snapshot, api: AdsApi) -> String {
    match api {
        AdsApi::Sotw => s.routes.version.clone(),
        AdsApi::Delta => format!("{:016x}", s.routes.hashes["outbound"]),
    }
}
/// How long a registry change may take to reach Envoy before a test fails. The expected
/// figure is milliseconds; the bound is loose for loaded CI machines.
const BOUND: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_connects_and_acks_lds_cds_eds() {
    envoy_connects_and_acks_lds_cds_eds_over(AdsApi::Sotw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_connects_and_acks_lds_cds_eds_over_delta_ads() {
    envoy_connects_and_acks_lds_cds_eds_over(AdsApi::Delta).await
}

async fn envoy_connects_and_acks_lds_cds_eds_over(api: AdsApi) {
    let Some(envoy) = envoy_or_skip(&format!("envoy_connects_and_acks_lds_cds_eds over {api:?}"))
    else {
        return;
    };
    envoy::init_logs("info");
    let a = "127.0.0.1:18080".parse().unwrap();
    let h = WorkerRig::start(
        &envoy,
        &registry_json(&[("web", Some("10.96.0.10"), vec![(a, false)])]),
        api,
    )
    .await;
    let want = h.node.snapshot();

    // Envoy's view: connected, updates accepted, the versions we serve.
    assert_eq!(h.stat("control_plane.connected_state"), Some(1));
    for stat in [
        "listener_manager.lds.update_success",
        "cluster_manager.cds.update_success",
    ] {
        assert!(h.stat(stat).unwrap_or(0) >= 1, "{stat} not >= 1");
    }
    // The bootstrap keeps no stats for the mesh's clusters (its `stats_config`): the EDS
    // answer is checked in the config dump below instead.
    assert_eq!(
        h.stat(&format!("cluster.{WEB}.update_success")),
        None,
        "a stat of the mesh's cluster {WEB}"
    );
    for stat in [
        "listener_manager.lds.update_rejected",
        "cluster_manager.cds.update_rejected",
    ] {
        assert_eq!(h.stat(stat), Some(0), "{stat}");
    }
    let dump = h.config_dump();
    let (clusters, cds_version) = envoy::clusters(&dump);
    assert_eq!(cds_version, want.clusters.version);
    assert_eq!(clusters, vec![WEB.to_string()]);
    let (listeners, lds_version) = envoy::listeners(&dump);
    assert_eq!(lds_version, want.listeners.version);
    assert_eq!(
        listeners
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        vec!["outbound"]
    );
    assert_eq!(
        envoy::endpoints(&dump, WEB),
        Some(vec!["127.0.0.1:18080 HEALTHY".to_string()])
    );
    let (rds_version, domains) = envoy::route(&dump, "outbound").expect("route config outbound");
    assert_eq!(rds_version, route_version(&want, api));
    assert!(
        domains.contains(&"web.default.svc.cluster.local:80".to_string())
            && domains.contains(&"10.96.0.10:80".to_string())
    );

    // Our view: every type ACKed, nothing NACKed, one stream.
    for t in [LDS, CDS, EDS, RDS] {
        assert!(h.worker_counter("acks", t) >= 1, "no ACK counted for {t}");
        assert_eq!(h.worker_counter("nacks", t), 0, "NACK counted for {t}");
    }
    assert_eq!(h.metrics.xds_streams.get(), 1);

    // A local pod: Acks::wait_until sees it once Envoy holds its inbound chain and cluster.
    let ip: IpAddr = "10.244.0.7".parse().unwrap();
    let pod = Pod {
        uid: "uid-7".into(),
        namespace: "default".into(),
        name: "app-7".into(),
        container_id: "c7".into(),
        netns: "/var/run/netns/x".into(),
        ifname: "eth0".into(),
        ips: vec![ip],
        terminating: false,
        no_quic_twin: false,
    };
    assert!(!h.acks.latest().unwrap().holds_pod("uid-7", &[ip]));
    h.node.apply([Change::UpsertPod(pod.clone())]);
    assert!(
        h.acks
            .wait_until(|s| s.holds_pod("uid-7", &[ip]), Duration::from_secs(2))
            .await,
        "pod not ACKed within 2 s"
    );
    let dump = h.config_dump();
    let (listeners, _) = envoy::listeners(&dump);
    // The capture listener on the inbound port hands redirected connections to the pod's
    // own listener, on the pod's IP and the inbound target port.
    let inbound = &listeners
        .iter()
        .find(|(n, _)| n == "inbound")
        .expect("inbound listener")
        .1;
    assert_eq!(
        inbound["address"]["socket_address"]["port_value"],
        h.inbound_port
    );
    assert_eq!(inbound["use_original_dst"], true);
    let pod_listener = &listeners
        .iter()
        .find(|(n, _)| n == "inbound|uid-7")
        .expect("the pod's inbound listener")
        .1;
    assert_eq!(
        pod_listener["address"]["socket_address"]["address"],
        "10.244.0.7"
    );
    assert_eq!(pod_listener["bind_to_port"], false);
    let chain = &pod_listener["filter_chains"][0];
    assert_eq!(chain["name"], "uid-7");
    assert_eq!(
        chain["filter_chain_match"]["prefix_ranges"][0]["address_prefix"],
        "10.244.0.7"
    );
    assert!(
        envoy::clusters(&dump)
            .0
            .contains(&"inbound|uid-7".to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_requests_are_balanced_across_registry_endpoints() {
    outbound_requests_are_balanced_across_registry_endpoints_over(AdsApi::Sotw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbound_requests_are_balanced_across_registry_endpoints_over_delta_ads() {
    outbound_requests_are_balanced_across_registry_endpoints_over(AdsApi::Delta).await
}

async fn outbound_requests_are_balanced_across_registry_endpoints_over(api: AdsApi) {
    let Some(envoy) = envoy_or_skip(&format!(
        "outbound_requests_are_balanced_across_registry_endpoints over {api:?}"
    )) else {
        return;
    };
    envoy::init_logs("info");
    let (u1, u2) = (
        upstream::spawn("one".into()).expect("upstream"),
        upstream::spawn("two".into()).expect("upstream"),
    );
    let h = WorkerRig::start(
        &envoy,
        &registry_json(&[(
            "web",
            Some("10.96.0.10"),
            vec![(u1.addr, false), (u2.addr, false)],
        )]),
        api,
    )
    .await;

    let mut bodies = Vec::new();
    for host in [
        "web",
        "web.default",
        "web.default.svc.cluster.local",
        "web.default:80",
        "10.96.0.10:80",
    ] {
        for _ in 0..8 {
            let (status, body) = http_get(h.outbound, host).expect("request through Envoy");
            assert_eq!(status, 200, "Host {host}: {body}");
            bodies.push(body);
        }
    }
    assert!(
        u1.hits() > 0 && u2.hits() > 0,
        "not balanced: one={} two={}",
        u1.hits(),
        u2.hits()
    );
    assert_eq!(u1.hits() + u2.hits(), 40);
    assert!(bodies.iter().all(|b| b == "one" || b == "two"));

    let (status, _) = http_get(h.outbound, "nosuch.default").unwrap();
    assert_eq!(status, 404, "unknown host must not route");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_file_changes_reach_config_dump_within_bound() {
    registry_file_changes_reach_config_dump_within_bound_over(AdsApi::Sotw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_file_changes_reach_config_dump_within_bound_over_delta_ads() {
    registry_file_changes_reach_config_dump_within_bound_over(AdsApi::Delta).await
}

async fn registry_file_changes_reach_config_dump_within_bound_over(api: AdsApi) {
    let Some(envoy) = envoy_or_skip(&format!(
        "registry_file_changes_reach_config_dump_within_bound over {api:?}"
    )) else {
        return;
    };
    envoy::init_logs("info");
    let a = "127.0.0.1:18081".parse().unwrap();
    let b = "127.0.0.1:18082".parse().unwrap();
    let c = "127.0.0.1:18083".parse().unwrap();
    let x = "127.0.0.1:18090".parse().unwrap();
    let h = WorkerRig::start(
        &envoy,
        &registry_json(&[
            ("web", None, vec![(a, false), (b, false)]),
            ("api", None, vec![(x, false)]),
        ]),
        api,
    )
    .await;

    // Add an endpoint.
    h.write_registry(&registry_json(&[
        ("web", None, vec![(a, false), (b, false), (c, false)]),
        ("api", None, vec![(x, false)]),
    ]))
    .await;
    let t0 = Instant::now();
    wait_for("the added endpoint in config_dump", BOUND, || {
        web_eds(&h).filter(|e| e.len() == 3 && e.contains(&"127.0.0.1:18083 HEALTHY".to_string()))
    });
    let took = t0.elapsed();
    eprintln!("add endpoint reached config_dump in {took:?}");

    // Mark one draining. config_dump renders the host's health, where Envoy shows an
    // EDS DRAINING endpoint as UNHEALTHY; /clusters shows the EDS status itself.
    h.write_registry(&registry_json(&[
        ("web", None, vec![(a, false), (b, true), (c, false)]),
        ("api", None, vec![(x, false)]),
    ]))
    .await;
    let t0 = Instant::now();
    wait_for("the draining endpoint in config_dump", BOUND, || {
        web_eds(&h).filter(|e| e.contains(&"127.0.0.1:18082 UNHEALTHY".to_string()))
    });
    let took = t0.elapsed();
    assert_eq!(
        h.eds_health(WEB, "127.0.0.1:18082").as_deref(),
        Some("DRAINING")
    );
    assert_eq!(
        h.eds_health(WEB, "127.0.0.1:18081").as_deref(),
        Some("HEALTHY")
    );
    eprintln!("mark draining reached config_dump in {took:?}");

    // Remove a service: its cluster, endpoints and virtual host go.
    h.write_registry(&registry_json(&[(
        "web",
        None,
        vec![(a, false), (b, true), (c, false)],
    )]))
    .await;
    let t0 = Instant::now();
    wait_for("the removed service gone from config_dump", BOUND, || {
        let dump = h.config_dump();
        let (clusters, _) = envoy::clusters(&dump);
        let (_, domains) = envoy::route(&dump, "outbound")?;
        (!clusters.iter().any(|c| c.contains("api.default"))
            && !domains.iter().any(|d| d.starts_with("api")))
        .then_some(())
    });
    let took = t0.elapsed();
    eprintln!("remove service reached config_dump in {took:?}");
    assert!(
        h.wait_acked_current(BOUND).await,
        "final snapshot not ACKed"
    );
    assert_eq!(h.stat("cluster_manager.cds.update_rejected"), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_route_keeps_last_good_config_and_is_logged_and_counted() {
    nacked_route_keeps_last_good_config_and_is_logged_and_counted_over(AdsApi::Sotw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nacked_route_keeps_last_good_config_and_is_logged_and_counted_over_delta_ads() {
    nacked_route_keeps_last_good_config_and_is_logged_and_counted_over(AdsApi::Delta).await
}

async fn nacked_route_keeps_last_good_config_and_is_logged_and_counted_over(api: AdsApi) {
    let Some(envoy) = envoy_or_skip(&format!(
        "nacked_route_keeps_last_good_config_and_is_logged_and_counted over {api:?}"
    )) else {
        return;
    };
    envoy::init_logs("info");
    let (u1, u2) = (
        upstream::spawn("one".into()).expect("upstream"),
        upstream::spawn("two".into()).expect("upstream"),
    );
    let good = registry_json(&[(
        "web",
        Some("10.96.0.10"),
        vec![(u1.addr, false), (u2.addr, false)],
    )]);
    let h = WorkerRig::start(&envoy, &good, api).await;
    let good_routes = h.node.snapshot().routes.version.clone();
    let good_route_version = route_version(&h.node.snapshot(), api);
    assert_eq!(http_get(h.outbound, "10.96.0.10:80").unwrap().0, 200);

    // A second service claiming the same VIP: the builder passes it through, and Envoy
    // must reject the route configuration for the duplicate domain 10.96.0.10:80.
    let bad = registry_json(&[
        (
            "web",
            Some("10.96.0.10"),
            vec![(u1.addr, false), (u2.addr, false)],
        ),
        ("shadow", Some("10.96.0.10"), vec![(u1.addr, false)]),
    ]);
    h.write_registry(&bad).await;
    wait_for("an RDS NACK counted by the worker", BOUND, || {
        (h.worker_counter("nacks", RDS) >= 1).then_some(())
    });
    let bad_routes = h.node.snapshot().routes.version.clone();
    assert_ne!(bad_routes, good_routes);

    // Envoy rejected it and keeps the last good routes; traffic still flows.
    assert!(
        h.stat("http.outbound.rds.outbound.update_rejected")
            .unwrap_or(0)
            >= 1
    );
    let (rds_version, _) = envoy::route(&h.config_dump(), "outbound").unwrap();
    assert_eq!(
        rds_version, good_route_version,
        "Envoy's route config must stay the last good one"
    );
    for host in ["web", "10.96.0.10:80"] {
        for _ in 0..5 {
            let (status, body) = http_get(h.outbound, host).unwrap();
            assert_eq!(status, 200, "Host {host} after NACK: {body}");
        }
    }
    // Not re-sent in a loop: one NACK for one bad version.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(h.worker_counter("nacks", RDS), 1);
    // The acked view never claims the rejected routes.
    assert_ne!(h.acks.latest().unwrap().routes.version, bad_routes);

    // Visible in our logs (type, nonce, Envoy's error) and in Envoy's.
    let logs = envoy::captured_logs();
    let line = logs
        .lines()
        .find(|l| l.contains("NACK") && l.contains(RDS))
        .expect("a NACK log line for RDS");
    assert!(
        line.contains("WARN") && line.contains("nonce=") && line.contains("10.96.0.10:80"),
        "NACK line: {line}"
    );
    assert!(
        h.envoy.log_text().contains("rejected"),
        "Envoy logs the rejection"
    );

    // Fixing the registry gets a fresh ACK.
    h.write_registry(&good).await;
    assert!(
        h.wait_acked_current(BOUND).await,
        "fixed snapshot not ACKed"
    );
    assert_eq!(h.acks.latest().unwrap().routes.version, good_routes);
    assert_eq!(h.worker_counter("nacks", RDS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_to_an_identical_snapshot_changes_nothing_in_envoy() {
    reconnect_to_an_identical_snapshot_changes_nothing_in_envoy_over(AdsApi::Sotw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_to_an_identical_snapshot_changes_nothing_in_envoy_over_delta_ads() {
    reconnect_to_an_identical_snapshot_changes_nothing_in_envoy_over(AdsApi::Delta).await
}

async fn reconnect_to_an_identical_snapshot_changes_nothing_in_envoy_over(api: AdsApi) {
    let Some(envoy) = envoy_or_skip(&format!(
        "reconnect_to_an_identical_snapshot_changes_nothing_in_envoy over {api:?}"
    )) else {
        return;
    };
    envoy::init_logs("info");
    let u = upstream::spawn("one".into()).expect("upstream");
    let mut h = WorkerRig::start(
        &envoy,
        &registry_json(&[("web", Some("10.96.0.10"), vec![(u.addr, false)])]),
        api,
    )
    .await;
    let ip: IpAddr = "10.244.0.9".parse().unwrap();
    h.node.apply([Change::UpsertPod(Pod {
        uid: "uid-9".into(),
        namespace: "default".into(),
        name: "app-9".into(),
        container_id: "c9".into(),
        netns: "/var/run/netns/y".into(),
        ifname: "eth0".into(),
        ips: vec![ip],
        terminating: false,
        no_quic_twin: false,
    })]);
    assert!(h.wait_acked_current(BOUND).await);
    const UNCHANGED: [&str; 5] = [
        "listener_manager.listener_modified",
        "listener_manager.listener_removed",
        "listener_manager.total_listeners_draining",
        "cluster_manager.cluster_modified",
        "cluster_manager.cluster_removed",
    ];
    let mut before = Vec::new();
    for s in UNCHANGED {
        before.push(h.stat(s).unwrap_or_else(|| panic!("no stat {s}")));
    }
    let lds_before = h.stat("listener_manager.lds.update_success").unwrap();

    // The server goes away with its streams; a new one serves the same snapshot.
    let acks = h.restart_server();
    let want = h.node.snapshot();
    assert!(
        acks.wait_until(|s| envoy::same_versions(s, &want), Duration::from_secs(10))
            .await,
        "Envoy did not reconnect and ACK within 10 s; its log:\n{}",
        h.envoy.log_text()
    );
    assert_eq!(h.stat("control_plane.connected_state"), Some(1));
    // Over delta ADS the proxy's reconnect reports the versions it holds, which already
    // satisfies the wait above; the new stream's (empty) answer is applied just after.
    wait_for(
        "the new stream's LDS answer applied (lds.update_success moved)",
        BOUND,
        || (h.stat("listener_manager.lds.update_success")? > lds_before).then_some(()),
    );
    let mut after = Vec::new();
    for s in UNCHANGED {
        after.push(h.stat(s).unwrap());
    }
    assert_eq!(after, before, "{UNCHANGED:?}");
    assert_eq!(
        http_get(h.outbound, "web").unwrap(),
        (200, "one".to_string())
    );
}

fn web_eds(h: &WorkerRig) -> Option<Vec<String>> {
    envoy::endpoints(&h.config_dump(), WEB)
}

/// Resources the worker has sent Envoy, per type (CDS, EDS, LDS, RDS).
fn resources_sent(h: &WorkerRig) -> [u64; 4] {
    [CDS, EDS, LDS, RDS].map(|t| h.worker_counter("resources", t))
}

fn diff(a: [u64; 4], b: [u64; 4]) -> [u64; 4] {
    [0, 1, 2, 3].map(|i| b[i] - a[i])
}

/// CI's short version of the scale benchmark (`cargo bench -p aether-e2e --bench scale`
/// runs 10,000 services): over delta ADS, one endpoint change sends Envoy one load
/// assignment, whether it comes through the change API or the registry file; a pod's ADD
/// one listener and one cluster; a new server answering Envoy's reconnect nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_mesh_scale_a_change_sends_envoy_only_what_changed() {
    let Some(envoy) = envoy_or_skip("at_mesh_scale_a_change_sends_envoy_only_what_changed") else {
        return;
    };
    envoy::init_logs("info");
    let (services, endpoints) = (2_000, 10);
    let json = aether_e2e::testing::mesh_registry_json(services, endpoints, None, "");
    let mut h = WorkerRig::start(&envoy, &json, AdsApi::Delta).await;
    assert_eq!(
        h.stat("cluster_manager.active_clusters")
            .map(|n| n >= services as u64),
        Some(true),
        "Envoy holds the mesh"
    );

    // An endpoint turns draining, then healthy again: through the change API, then
    // through the file (each source ends where it started, so the two agree).
    for (i, s) in [17usize, 1_234, 1_999].into_iter().enumerate() {
        for draining in [Some(i), None] {
            let before = resources_sent(&h);
            h.node
                .apply([Change::UpsertService(aether_e2e::testing::mesh_service(
                    s, endpoints, draining,
                ))]);
            assert!(
                h.wait_acked_current(BOUND).await,
                "endpoint change {i} ACKed"
            );
            assert_eq!(
                diff(before, resources_sent(&h)),
                [0, 1, 0, 0],
                "change API: one load assignment (CDS, EDS, LDS, RDS)"
            );
        }
        for draining in [Some((s, i)), None] {
            let before = resources_sent(&h);
            h.write_registry(&aether_e2e::testing::mesh_registry_json(
                services, endpoints, draining, "",
            ))
            .await;
            assert!(h.wait_acked_current(BOUND).await);
            assert_eq!(
                diff(before, resources_sent(&h)),
                [0, 1, 0, 0],
                "registry file: one load assignment (CDS, EDS, LDS, RDS)"
            );
        }
    }

    let pod = |n: u8| Pod {
        uid: format!("uid-{n}"),
        namespace: "default".into(),
        name: format!("app-{n}"),
        container_id: format!("c{n}"),
        netns: "/var/run/netns/x".into(),
        ifname: "eth0".into(),
        ips: vec![format!("10.244.0.{n}").parse().unwrap()],
        terminating: false,
        no_quic_twin: false,
    };
    h.node.apply([Change::UpsertPod(pod(1))]);
    assert!(h.wait_acked_current(BOUND).await);
    let before = resources_sent(&h);
    h.node.apply([Change::UpsertPod(pod(2))]);
    assert!(h.wait_acked_current(BOUND).await);
    assert_eq!(
        diff(before, resources_sent(&h)),
        [1, 0, 1, 0],
        "a pod's ADD: one cluster and one listener (CDS, EDS, LDS, RDS)"
    );

    // A new server (as after a takeover) answers Envoy's reconnect with nothing it holds.
    let initial_before = [CDS, EDS, LDS, RDS].map(|t| h.worker_counter("initial_resources", t));
    let acks = h.restart_server();
    let want = h.node.snapshot();
    assert!(
        acks.wait_until(|s| envoy::same_versions(s, &want), BOUND)
            .await,
        "Envoy reconnected and ACKed"
    );
    wait_for("the reconnect's first answers of every type", BOUND, || {
        [CDS, EDS, LDS, RDS]
            .iter()
            .all(|t| h.worker_counter("pushes", t) > 0)
            .then_some(())
    });
    let initial = [CDS, EDS, LDS, RDS].map(|t| h.worker_counter("initial_resources", t));
    assert_eq!(
        diff(initial_before, initial),
        [0, 0, 0, 0],
        "the reconnect's first answers carry no resource"
    );
    let nacks: u64 = [CDS, EDS, LDS, RDS]
        .iter()
        .map(|t| h.worker_counter("nacks", t))
        .sum();
    assert_eq!(nacks, 0);
}

/// With on-demand clusters Envoy holds only the node's pods' clusters and the observed
/// upstreams; a pod's first call to any other service fetches its cluster (on-demand CDS
/// over the ADS stream) and succeeds, and the service becomes an observed upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_demand_a_first_call_to_a_service_envoy_does_not_hold_succeeds() {
    let Some(envoy) =
        envoy_or_skip("on_demand_a_first_call_to_a_service_envoy_does_not_hold_succeeds")
    else {
        return;
    };
    envoy::init_logs("info");
    let u = upstream::spawn("web".into()).expect("upstream");
    let json = registry_json(&[
        ("web", Some("10.96.0.10"), vec![(u.addr, false)]),
        ("api", None, vec![(u.addr, false)]),
    ]);
    let h = WorkerRig::start_with(
        &envoy,
        &json,
        aether_e2e::envoy::RigOptions {
            api: AdsApi::Delta,
            on_demand: true,
            ..Default::default()
        },
    )
    .await;
    let (clusters, _) = envoy::clusters(&h.config_dump());
    assert!(
        !clusters.iter().any(|c| c == WEB),
        "Envoy does not hold {WEB} before a call: {clusters:?}"
    );
    assert_eq!(
        http_get(h.outbound, "web").unwrap(),
        (200, "web".to_string()),
        "the first call succeeds"
    );
    let (clusters, _) = envoy::clusters(&h.config_dump());
    assert!(
        clusters.iter().any(|c| c == WEB),
        "Envoy holds {WEB} after the call: {clusters:?}"
    );
    assert!(
        !clusters.iter().any(|c| c == "outbound|80||api.default"),
        "nor any service its pods did not call"
    );
    let observed = h.observed.as_ref().expect("on-demand rig");
    assert!(observed.contains(WEB), "{:?}", observed.names());
    assert_eq!(observed.names().len(), 1);
    assert_eq!(
        http_get(h.outbound, "web").unwrap(),
        (200, "web".to_string()),
        "and every later call"
    );
}
