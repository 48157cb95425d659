//! Pods' mTLS through a real Envoy 1.40 on a real data path: inbound on one node, and
//! outbound from one node's pods to another's ([`outbound`]).
//!
//! Each test builds a [`Datapath`] (a node namespace with an nftables capture redirect, a
//! pod namespace with a line server at 10.77.0.2:80, a client namespace routed through the
//! node), runs the worker side in-process with Envoy inside the node namespace
//! ([`WorkerRig`] with `netns`), and feeds the node SVIDs minted by a test CA
//! ([`TestCa`], trust domain `aether.test`) through `Change::SetPodSvid` and friends.
//! Clients in the client namespace connect to the pod's address; the node redirects them
//! to Envoy's capture listener, which hands each to the pod's listener. Each scenario runs
//! over state-of-the-world and over delta ADS. Without root, `nft` or Envoy each test says
//! so loudly and returns.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aether_e2e::datapath::{
    self, Conn, Datapath, Failure, Serve, TestCa, TestSvid, exchange, pod_addr, tls_client,
    uri_sans,
};
use aether_e2e::envoy::{self, AdsApi, RigOptions, WorkerRig, envoy_or_skip, registry_json};
use aether_e2e::testing::try_wait_for;
use aether_model::{Change, Identity, MtlsMode};
use tokio_rustls::rustls::ClientConfig;

const TD: &str = "aether.test";
const UID: &str = "uid-web";
const LISTENER: &str = "inbound|uid-web";
const SDS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const TYPES: [&str; 5] = [
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    SDS,
];
/// How long Envoy may take to take a change or a listener to start serving before a test
/// fails; milliseconds are expected.
const BOUND: Duration = Duration::from_secs(10);

/// One node's data path with Envoy on it. The rig is declared first so that it drops
/// first: Envoy dies before its namespace is deleted.
struct Case {
    rig: WorkerRig,
    dp: Datapath,
    ca: TestCa,
    /// The pod's SVID as the node holds it (or will, when held back).
    web: TestSvid,
    agent: TestSvid,
    /// A workload of the trust domain calling the pod.
    client: TestSvid,
}

impl Case {
    /// Envoy in the node's namespace with `identity` (None: identity off), the pod `web`
    /// added, and everything ACKed. None (after saying why) when the test cannot run here.
    async fn start(test: &str, api: AdsApi, identity: Option<(MtlsMode, bool)>) -> Option<Case> {
        let what = format!("{test} over {api:?}");
        let envoy_bin = envoy_or_skip(&what)?;
        if let Some(why) = datapath::missing() {
            eprintln!(
                "\n!!! SKIPPED {what}: {why}. CI runs as root with nftables, so there this test runs. !!!\n"
            );
            return None;
        }
        envoy::init_logs("info");
        let mut dp = Datapath::create("m", [10, 77, 0]).expect("the data path's namespaces");
        dp.add_pod("web", 2, Serve::Lines).expect("the pod web");
        let ca = TestCa::new(TD);
        let (web, agent, client) = (
            ca.mint("default", "web"),
            ca.mint("aether-system", "agent"),
            ca.mint("default", "client"),
        );
        let identity = match identity {
            None => Identity::default(),
            Some((mode, pod_svid)) => Identity {
                trust_domain: Some(TD.into()),
                mode,
                bundle: Some(ca.pem()),
                agent: Some(agent.svid.clone()),
                pods: pod_svid
                    .then(|| (UID.to_string(), web.svid.clone()))
                    .into_iter()
                    .collect(),
            },
        };
        let options = RigOptions {
            api,
            netns: Some(dp.node.name.clone()),
            identity,
            ..RigOptions::default()
        };
        let rig = WorkerRig::start_with(&envoy_bin, &registry_json(&[]), options).await;
        dp.redirect(rig.inbound_port, None)
            .expect("the capture redirect");
        let pod = dp.pod_record("web", false);
        let case = Case {
            rig,
            dp,
            ca,
            web,
            agent,
            client,
        };
        case.apply([Change::UpsertPod(pod)]).await;
        Some(case)
    }

    /// Applies `changes` and waits until Envoy has ACKed the result, secrets included.
    async fn apply(&self, changes: impl IntoIterator<Item = Change>) {
        self.rig.node.apply(changes);
        assert!(
            self.rig.wait_acked_current(BOUND).await,
            "Envoy did not ACK the snapshot within {BOUND:?}{}",
            self.context()
        );
    }

    fn web(&self) -> SocketAddr {
        pod_addr(self.dp.pod("web").ip)
    }

    fn served(&self) -> u64 {
        self.dp.pod("web").server.served()
    }

    /// A client of the trust domain, one without a certificate, one of another trust
    /// domain; each trusts this trust domain's CA for the server's certificate.
    fn mtls(&self) -> Arc<ClientConfig> {
        tls_client(&self.ca.pem(), Some(&self.client))
    }

    fn tls_without_certificate(&self) -> Arc<ClientConfig> {
        tls_client(&self.ca.pem(), None)
    }

    fn foreign(&self) -> Arc<ClientConfig> {
        tls_client(
            &self.ca.pem(),
            Some(&TestCa::new("other.test").mint("default", "client")),
        )
    }

    /// Signed by this trust domain's CA, but with a SPIFFE ID outside the trust domain:
    /// only the bundle's URI SAN prefix refuses it.
    fn outside_the_trust_domain(&self) -> Arc<ClientConfig> {
        tls_client(
            &self.ca.pem(),
            Some(&self.ca.mint_id("spiffe://evil.test/ns/default/pod/x")),
        )
    }

    /// One exchange from the client namespace to the pod.
    fn ask(
        &self,
        tls: Option<Arc<ClientConfig>>,
        line: &str,
    ) -> Result<(String, Option<Vec<u8>>), Failure> {
        exchange(&self.dp.client, self.web(), tls, line)
    }

    /// Polls until the pod answers the client over `tls` (a listener Envoy has just
    /// taken reaches its worker threads a moment later); the server's leaf certificate.
    fn wait_served(&self, tls: Option<Arc<ClientConfig>>, what: &str) -> Option<Vec<u8>> {
        let mut last = None;
        let got = try_wait_for(what, BOUND, || match self.ask(tls.clone(), "hello") {
            Ok((answer, leaf)) if answer == "web: hello" => Some(leaf),
            Ok((answer, _)) => {
                last = Some(format!("answer {answer:?}"));
                None
            }
            Err(f) => {
                last = Some(f.reason);
                None
            }
        });
        got.unwrap_or_else(|e| panic!("{e}; last attempt: {last:?}{}", self.context()))
    }

    /// The client over `tls` is closed or refused (not merely left hanging) and the pod
    /// answers nothing.
    fn assert_refused(&self, tls: Option<Arc<ClientConfig>>, who: &str) {
        let before = self.served();
        match self.ask(tls, "hello") {
            Ok((answer, _)) => panic!(
                "{who}: served ({answer:?}), expected refused{}",
                self.context()
            ),
            Err(f) => {
                assert!(
                    !f.timed_out,
                    "{who}: hung instead of being refused: {}{}",
                    f.reason,
                    self.context()
                );
                eprintln!("{who}: refused as expected ({})", f.reason);
            }
        }
        assert_eq!(
            self.served(),
            before,
            "{who}: the pod answered a refused client"
        );
    }

    /// The pod's listener as Envoy holds it: (active, warming).
    fn listener_state(&self) -> (bool, bool) {
        let dump = self.rig.config_dump();
        let l = dump["configs"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|c| {
                c["dynamic_listeners"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .find(|l| l["name"] == LISTENER);
        l.map_or((false, false), |l| {
            (!l["active_state"].is_null(), !l["warming_state"].is_null())
        })
    }

    fn wait_listener_active(&self) {
        let mut last = (false, false);
        try_wait_for("the pod's listener active", BOUND, || {
            last = self.listener_state();
            (last == (true, false)).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: (active, warming) = {last:?}{}", self.context()));
    }

    fn stats(&self, names: &[&str]) -> BTreeMap<String, u64> {
        self.rig
            .envoy
            .stats(names)
            .expect("Envoy's admin answers /stats")
    }

    /// No NACK counted for any type.
    fn assert_no_nacks(&self) {
        for t in TYPES {
            assert_eq!(
                self.rig.worker_counter("nacks", t),
                0,
                "NACK for {t}{}",
                self.context()
            );
        }
    }

    /// No file under the rig's temp dir (Envoy's bootstrap, log, sockets' folder) holds
    /// any private key the node was given, nor the clients' (their PEM body).
    fn assert_no_key_on_disk(&self, keys: &[&TestSvid]) {
        let bodies: Vec<String> = keys
            .iter()
            .map(|k| {
                k.svid
                    .key_pem
                    .lines()
                    .filter(|l| !l.starts_with("-----"))
                    .collect::<String>()
            })
            .collect();
        let mut files = 0;
        let mut stack = vec![self.rig.dir.path().to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir)
                .expect("read the rig's dir")
                .flatten()
            {
                let (path, kind) = (entry.path(), entry.file_type().expect("file type"));
                if kind.is_dir() {
                    stack.push(path);
                } else if kind.is_file() {
                    files += 1;
                    let text: String =
                        String::from_utf8_lossy(&std::fs::read(&path).expect("read a file"))
                            .split_whitespace()
                            .collect();
                    for (b, k) in bodies.iter().zip(keys) {
                        assert!(
                            !text.contains(b.as_str()),
                            "{} holds the private key of {}",
                            path.display(),
                            k.svid.spiffe_id
                        );
                    }
                }
            }
        }
        assert!(
            files >= 2,
            "the rig's dir holds Envoy's bootstrap and log, found {files} files"
        );
        // Envoy's own config dump redacts them too.
        let dump = self.rig.admin("/config_dump?include_eds");
        for (b, k) in bodies.iter().zip(keys) {
            assert!(
                !dump
                    .split_whitespace()
                    .collect::<String>()
                    .contains(b.as_str()),
                "config_dump shows the key of {}",
                k.svid.spiffe_id
            );
        }
    }

    /// Envoy's log tail and the worker's NACK lines, for a failure message.
    fn context(&self) -> String {
        let log = self.rig.envoy.log_text();
        let tail: Vec<&str> = log
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let nacks: Vec<String> = envoy::captured_logs()
            .lines()
            .filter(|l| l.contains("NACK"))
            .map(String::from)
            .collect();
        format!(
            "\n--- worker NACKs:\n{}\n--- Envoy log (tail):\n{}",
            nacks.join("\n"),
            tail.join("\n")
        )
    }
}

macro_rules! both_apis {
    ($sotw:ident, $delta:ident, $body:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $sotw() {
            $body(AdsApi::Sotw).await
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $delta() {
            $body(AdsApi::Delta).await
        }
    };
}

both_apis!(
    plaintext_reaches_the_pod_through_envoy,
    plaintext_reaches_the_pod_through_envoy_over_delta_ads,
    plaintext
);

/// Identity off: the rig itself. The client's connection to the pod's address goes
/// through Envoy's capture listener and the pod's listener (its cluster counts it).
async fn plaintext(api: AdsApi) {
    let Some(c) = Case::start("plaintext_reaches_the_pod_through_envoy", api, None).await else {
        return;
    };
    c.wait_listener_active();
    let upstream = format!("cluster.{LISTENER}.upstream_cx_total");
    let before = c.stats(&[&upstream])[&upstream];
    assert_eq!(c.wait_served(None, "the pod answers through Envoy"), None);
    let mut conn = Conn::open(&c.dp.client, c.web(), None).expect("a second connection");
    assert_eq!(conn.ask("again").expect("an answer"), "web: again");
    let after = c.stats(&[&upstream])[&upstream];
    assert!(
        after >= before + 2,
        "Envoy's pod cluster counted {} connections, expected 2 or more{}",
        after - before,
        c.context()
    );
    c.assert_no_nacks();
}

both_apis!(
    strict_serves_mtls_only,
    strict_serves_mtls_only_over_delta_ads,
    strict
);

/// Strict: a workload of the trust domain completes mTLS and sees the pod's SVID; a
/// plaintext client, a TLS client without a certificate and one of another trust domain
/// are refused.
async fn strict(api: AdsApi) {
    let Some(c) = Case::start(
        "strict_serves_mtls_only",
        api,
        Some((MtlsMode::Strict, true)),
    )
    .await
    else {
        return;
    };
    c.wait_listener_active();
    let leaf = c
        .wait_served(Some(c.mtls()), "mTLS to the pod")
        .expect("a server certificate");
    assert_eq!(
        leaf, c.web.leaf_der,
        "the server certificate is the pod's SVID"
    );
    assert_eq!(
        uri_sans(&leaf),
        vec!["spiffe://aether.test/ns/default/pod/web".to_string()]
    );

    c.assert_refused(None, "a plaintext client");
    c.assert_refused(
        Some(c.tls_without_certificate()),
        "a TLS client without a certificate",
    );
    c.assert_refused(Some(c.foreign()), "a client of another trust domain");
    c.assert_refused(
        Some(c.outside_the_trust_domain()),
        "a client of our CA with a SPIFFE ID outside the trust domain",
    );
    assert_eq!(
        c.ask(Some(c.mtls()), "still")
            .expect("mTLS after the refusals")
            .0,
        "web: still"
    );
    c.assert_no_nacks();
    c.assert_no_key_on_disk(&[&c.web, &c.agent, &c.client]);
}

both_apis!(
    permissive_serves_mtls_and_plaintext,
    permissive_serves_mtls_and_plaintext_over_delta_ads,
    permissive
);

/// Permissive: the same port serves mTLS and plaintext. A client without a certificate,
/// and one of another trust domain, are served when they speak plaintext; a TLS handshake
/// is still mTLS, so one that presents no certificate, or one of another trust domain,
/// is refused.
async fn permissive(api: AdsApi) {
    let Some(c) = Case::start(
        "permissive_serves_mtls_and_plaintext",
        api,
        Some((MtlsMode::Permissive, true)),
    )
    .await
    else {
        return;
    };
    c.wait_listener_active();
    let leaf = c
        .wait_served(Some(c.mtls()), "mTLS to the pod")
        .expect("a server certificate");
    assert_eq!(
        leaf, c.web.leaf_der,
        "the server certificate is the pod's SVID"
    );

    let before = c.served();
    assert_eq!(
        c.ask(None, "plaintext").expect("plaintext is served").0,
        "web: plaintext"
    );
    let mut conn = Conn::open(&c.dp.client, c.web(), None).expect("a second plaintext connection");
    assert_eq!(conn.ask("one more").expect("plaintext"), "web: one more");
    assert_eq!(
        conn.ask("two").expect("plaintext, same connection"),
        "web: two"
    );
    assert_eq!(c.served(), before + 3);

    // Fewer bytes than a TLS record header leave the inspector undecided, as a
    // server-first client would: after the listener filters' 1 s timeout the connection
    // goes on to the plaintext chain instead of being closed.
    let timeouts = || pre_cx_timeouts(&c.rig);
    let (timeouts_before, t0) = (timeouts(), Instant::now());
    assert_eq!(
        c.ask(None, "hi")
            .expect("a short plaintext message is served")
            .0,
        "web: hi"
    );
    let took = t0.elapsed();
    eprintln!("a 3-byte plaintext message was served after {took:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "served after {took:?}, expected the 1 s listener filter timeout"
    );
    assert_eq!(timeouts(), timeouts_before + 1, "downstream_pre_cx_timeout");

    c.assert_refused(
        Some(c.tls_without_certificate()),
        "a TLS client without a certificate",
    );
    c.assert_refused(Some(c.foreign()), "a TLS client of another trust domain");
    assert_eq!(
        c.ask(Some(c.mtls()), "still").expect("mTLS").0,
        "web: still"
    );
    c.assert_no_nacks();
}

/// Envoy's `downstream_pre_cx_timeout` summed over its listeners: connections whose
/// listener filters timed out.
fn pre_cx_timeouts(rig: &WorkerRig) -> u64 {
    envoy::parse_stats(&rig.admin("/stats?filter=downstream_pre_cx_timeout$"))
        .into_iter()
        .filter(|(k, _)| k.starts_with("listener.") && !k.contains("worker_"))
        .map(|(_, v)| v)
        .sum()
}

both_apis!(
    strict_pod_without_svid_has_no_listener_until_it_arrives,
    strict_pod_without_svid_has_no_listener_until_it_arrives_over_delta_ads,
    held_back
);

/// Strict, the pod's SVID held back: no pod listener, so the capture listener closes
/// every connection; the SVID arrives, the listener appears and serves mTLS.
async fn held_back(api: AdsApi) {
    let Some(c) = Case::start(
        "strict_pod_without_svid_has_no_listener_until_it_arrives",
        api,
        Some((MtlsMode::Strict, false)),
    )
    .await
    else {
        return;
    };
    assert!(
        c.rig.node.snapshot().listeners.get("inbound").is_some(),
        "the capture listener serves the pod's address"
    );
    assert_eq!(
        c.listener_state(),
        (false, false),
        "no listener for a strict pod without its SVID"
    );
    c.assert_refused(Some(c.mtls()), "an mTLS client before the SVID");
    c.assert_refused(None, "a plaintext client before the SVID");

    let t0 = Instant::now();
    c.apply([Change::SetPodSvid {
        uid: UID.into(),
        svid: Some(c.web.svid.clone()),
    }])
    .await;
    c.wait_listener_active();
    let leaf = c
        .wait_served(Some(c.mtls()), "mTLS once the SVID arrived")
        .expect("a server certificate");
    eprintln!(
        "the SVID's arrival to a served mTLS connection: {:?}",
        t0.elapsed()
    );
    assert_eq!(leaf, c.web.leaf_der);
    c.assert_refused(None, "a plaintext client after the SVID");
    c.assert_no_nacks();
}

both_apis!(
    rotation_keeps_the_listener_and_open_connections,
    rotation_keeps_the_listener_and_open_connections_over_delta_ads,
    rotation
);

/// A rotated SVID (a new serial) reaches Envoy over SDS alone: a new connection is served
/// with it within 1 s of `node.apply`, no listener is modified or drained, and a
/// connection opened before keeps working, and Envoy's admin `/certs` lists the new
/// serial.
async fn rotation(api: AdsApi) {
    let Some(c) = Case::start(
        "rotation_keeps_the_listener_and_open_connections",
        api,
        Some((MtlsMode::Strict, true)),
    )
    .await
    else {
        return;
    };
    c.wait_listener_active();
    c.wait_served(Some(c.mtls()), "mTLS to the pod");
    let mut before_conn = Conn::open(&c.dp.client, c.web(), Some(c.mtls()))
        .expect("a connection opened before the rotation");
    assert_eq!(before_conn.ask("before").expect("an answer"), "web: before");
    assert_eq!(
        before_conn.server_leaf.as_deref(),
        Some(&c.web.leaf_der[..])
    );

    let watched = [
        "listener_manager.listener_modified",
        "listener_manager.listener_removed",
        "listener_manager.listener_in_place_updated",
        "listener_manager.total_listeners_draining",
        "listener_manager.total_filter_chains_draining",
        "listener_manager.lds.update_success",
    ];
    let stats_before = c.stats(&watched);
    let rotated = c.ca.mint("default", "web");
    assert_ne!(rotated.svid.serial, c.web.svid.serial);

    assert!(
        c.rig.admin("/certs").contains(&c.web.svid.serial),
        "/certs lists the pod's serial before the rotation{}",
        c.context()
    );

    let t0 = Instant::now();
    c.rig.node.apply([Change::SetPodSvid {
        uid: UID.into(),
        svid: Some(rotated.svid.clone()),
    }]);
    let mut last = None;
    try_wait_for(
        "a new connection served with the new serial",
        Duration::from_secs(1),
        || {
            let leaf = c
                .ask(Some(c.mtls()), "hello")
                .ok()
                .and_then(|(_, leaf)| leaf);
            last = leaf.as_deref().and_then(datapath::serial_hex);
            leaf.filter(|l| *l == rotated.leaf_der)
        },
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}: last served serial {last:?}, want {}{}",
            rotated.svid.serial,
            c.context()
        )
    });
    let took = t0.elapsed();
    eprintln!("rotation: node.apply to a new connection served with the new serial in {took:?}");
    assert!(
        c.rig.wait_acked_current(BOUND).await,
        "the rotation not ACKed{}",
        c.context()
    );
    let certs = c.rig.admin("/certs");
    assert!(
        certs.contains(&rotated.svid.serial) && !certs.contains(&c.web.svid.serial),
        "/certs lists the new serial, not the old{}",
        c.context()
    );

    assert_eq!(
        c.stats(&watched),
        stats_before,
        "a rotation must not touch the listeners{}",
        c.context()
    );
    let (_, leaf) = c
        .ask(Some(c.mtls()), "hello")
        .expect("mTLS after the rotation");
    let leaf = leaf.expect("a server certificate");
    assert_eq!(
        datapath::serial_hex(&leaf).as_deref(),
        Some(rotated.svid.serial.as_str())
    );
    assert_eq!(uri_sans(&leaf), vec![rotated.svid.spiffe_id.clone()]);
    assert_eq!(
        before_conn
            .ask("after")
            .expect("the connection opened before the rotation still works"),
        "web: after"
    );
    c.assert_no_nacks();
    c.assert_no_key_on_disk(&[&c.web, &rotated, &c.agent, &c.client]);
}

both_apis!(
    outbound_mtls_presents_the_calling_pods_svid,
    outbound_mtls_presents_the_calling_pods_svid_over_delta_ads,
    outbound
);

/// Two nodes, each with its own Envoy and worker, joined by a link. Node 1 (permissive)
/// has the pods `client` (its SVID; addresses 10.77.0.2 and 10.77.0.4) and `other` (no
/// SVID of its own; 10.77.0.3). Their calls to a service VIP are redirected to node 1's
/// outbound listener, which originates mTLS to node 2's endpoints (marked mTLS-capable)
/// with the certificate of the pod whose IP the connection comes from, named by its uid. On node 2:
/// - `web` (10.88.0.2) terminates the mTLS itself (node 2 holds no SVID for it, so its
///   permissive listener passes the bytes through) and answers with the peer's SPIFFE ID;
/// - `api` (10.88.0.3) has its SVID on node 2, whose Envoy terminates the mTLS (a
///   handshake counted on the pod's listener) and hands the pod plaintext.
///
/// `other` presents no certificate until its own arrives: its calls go plaintext, which
/// `web` (mTLS only) refuses and `api`'s permissive listener takes; never the agent's
/// certificate. Then `other`'s own SVID arrives: its next connection presents it, and its
/// inbound listener serves mTLS with it. Last, `client` is deleted and a new pod takes
/// its IPs: its calls present its own SVID, never client's.
async fn outbound(api: AdsApi) {
    let what = format!("outbound_mtls_presents_the_calling_pods_svid over {api:?}");
    let Some(envoy_bin) = envoy_or_skip(&what) else {
        return;
    };
    if let Some(why) = datapath::missing() {
        eprintln!(
            "\n!!! SKIPPED {what}: {why}. CI runs as root with nftables, so there this test runs. !!!\n"
        );
        return;
    }
    envoy::init_logs("info");
    let ca = TestCa::new(TD);
    let (client, agent, web, api_svid) = (
        ca.mint("default", "client"),
        ca.mint("aether-system", "agent"),
        ca.mint("default", "web"),
        ca.mint("default", "api"),
    );
    let mut dp1 = Datapath::create("a", [10, 77, 0]).expect("node 1's namespaces");
    dp1.add_pod("client", 2, Serve::Lines).expect("pod client");
    dp1.add_pod("other", 3, Serve::Lines).expect("pod other");
    let client_second = dp1
        .add_address("client", 4)
        .expect("client's second address");
    let mut dp2 = Datapath::create("b", [10, 88, 0]).expect("node 2's namespaces");
    dp2.add_pod(
        "web",
        2,
        Serve::Http(Some(datapath::mtls_server(&ca.pem(), &web))),
    )
    .expect("pod web");
    dp2.add_pod("api", 3, Serve::Http(None)).expect("pod api");
    Datapath::link(&mut dp1, &mut dp2).expect("the link between the nodes");

    let registry = serde_json::json!({"services": [
        {"name": "web", "namespace": "default", "ports": [80], "vip": "10.96.0.10",
         "endpoints": [{"address": "10.88.0.2", "port": 80, "mtls": true}]},
        {"name": "api", "namespace": "default", "ports": [80], "vip": "10.96.0.11",
         "endpoints": [{"address": "10.88.0.3", "port": 80, "mtls": true}]},
    ]})
    .to_string();
    let identity = |pods: &[(&str, &TestSvid)]| Identity {
        trust_domain: Some(TD.into()),
        mode: MtlsMode::Permissive,
        bundle: Some(ca.pem()),
        agent: Some(agent.svid.clone()),
        pods: pods
            .iter()
            .map(|(uid, s)| (uid.to_string(), s.svid.clone()))
            .collect(),
    };
    let node2 = WorkerRig::start_with(
        &envoy_bin,
        &registry,
        RigOptions {
            api,
            netns: Some(dp2.node.name.clone()),
            identity: identity(&[("uid-api", &api_svid)]),
            ..RigOptions::default()
        },
    )
    .await;
    dp2.redirect(node2.inbound_port, None)
        .expect("node 2's capture redirect");
    node2.node.apply([
        Change::UpsertPod(dp2.pod_record("web", false)),
        Change::UpsertPod(dp2.pod_record("api", false)),
    ]);
    assert!(
        node2.wait_acked_current(BOUND).await,
        "node 2's Envoy did not ACK its pods"
    );

    let node1 = WorkerRig::start_with(
        &envoy_bin,
        &registry,
        RigOptions {
            api,
            netns: Some(dp1.node.name.clone()),
            outbound_ip: Some(IpAddr::from([0, 0, 0, 0])),
            identity: identity(&[("uid-client", &client)]),
            ..RigOptions::default()
        },
    )
    .await;
    dp1.redirect(
        node1.inbound_port,
        Some(("10.96.0.0/16", node1.outbound.port())),
    )
    .expect("node 1's capture redirect");
    node1.node.apply([
        Change::UpsertPod(dp1.pod_record("client", false)),
        Change::UpsertPod(dp1.pod_record("other", false)),
    ]);
    assert!(
        node1.wait_acked_current(BOUND).await,
        "node 1's Envoy did not ACK its pods"
    );

    let context = || {
        let tail = |rig: &WorkerRig| {
            rig.envoy
                .log_text()
                .lines()
                .rev()
                .take(30)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        };
        format!(
            "\n--- node 1 Envoy (tail):\n{}\n--- node 2 Envoy (tail):\n{}",
            tail(&node1),
            tail(&node2)
        )
    };
    let call = |pod: &str, host: &str, vip: [u8; 4]| {
        datapath::http_get_in(&dp1.pod(pod).ns, SocketAddr::from((vip, 80)), host)
            .unwrap_or_else(|e| panic!("{pod} -> {host}: {e}{}", context()))
    };
    // `client` calls from its second address first, then from its first.
    dp1.set_source("client", client_second)
        .expect("client's source address");

    // web: the peer the pod saw is the caller, call after call, interleaved on fresh
    // connections (each caller's upstream connections pool apart). `other` has no SVID of
    // its own: its calls go plaintext, which web, a TLS server that requires a client
    // certificate, refuses; it never presents the agent's or another pod's.
    let web_served = dp2.pod("web").server.served();
    for round in 0..3 {
        let (status, body) = call("client", "web.default", [10, 96, 0, 10]);
        assert_eq!(
            (status, body.as_str()),
            (200, format!("web peer={}", client.svid.spiffe_id).as_str()),
            "round {round}, client -> web{}",
            context()
        );
        let (status, body) = call("other", "web.default", [10, 96, 0, 10]);
        assert_ne!(
            status,
            200,
            "round {round}: other reached web without a certificate of its own: {body}{}",
            context()
        );
    }
    assert_eq!(dp2.pod("web").server.served(), web_served + 3);
    // web's handshakes (client's calls may share a pooled connection): client's alone.
    let peers = dp2.pod("web").server.peers();
    assert!(
        !peers.is_empty() && peers.iter().all(|p| *p == client.svid.spiffe_id),
        "web's handshakes: {peers:?}"
    );
    // Node 1's Envoy holds no trace of the agent's SVID: no secret, cluster or listener.
    let (_, dump) = node1
        .envoy
        .get("/config_dump?include_eds")
        .expect("node 1's config dump");
    let (_, certs) = node1.envoy.get("/certs").expect("node 1's /certs");
    assert!(
        !dump.contains("spiffe|agent") && !certs.contains(&agent.svid.spiffe_id),
        "node 1's Envoy holds the agent's SVID{}",
        context()
    );
    let web_cx = node2
        .stat("cluster.inbound|uid-web.upstream_cx_total")
        .unwrap_or(0);
    assert!(
        web_cx >= 1,
        "node 2's Envoy carried no connection to web (upstream_cx_total {web_cx})"
    );

    // api: node 2's Envoy terminates the mTLS on the pod's listener.
    let handshakes = || {
        node2
            .stat("listener.10.88.0.3_80.ssl.handshake")
            .unwrap_or(0)
    };
    // `other`'s call arrives in plaintext, which api's permissive listener takes.
    let before = handshakes();
    for pod in ["client", "other"] {
        let (status, body) = call(pod, "api.default", [10, 96, 0, 11]);
        assert_eq!(status, 200, "{pod} -> api: {body}{}", context());
        assert_eq!(
            body, "api peer=none",
            "api is reached in plaintext behind node 2's Envoy"
        );
    }
    let counted = handshakes() - before;
    assert_eq!(
        counted, 1,
        "node 2's api listener counted {counted} handshakes, expected client's alone"
    );

    // From its first address too, whose secret is also its inbound listener's server
    // certificate (see convert.rs: a warming SDS provider and the on-demand one for the
    // same name would never complete this handshake).
    dp1.set_source("client", dp1.pod("client").ip)
        .expect("client's source address");
    for round in 0..2 {
        let (status, body) = call("client", "web.default", [10, 96, 0, 10]);
        assert_eq!(
            (status, body.as_str()),
            (200, format!("web peer={}", client.svid.spiffe_id).as_str()),
            "round {round}, from 10.77.0.2{}",
            context()
        );
    }

    // `other`'s own SVID arrives: its next connection to web presents it (the time from
    // the release to that call's answer is printed), and its listener now terminates
    // mTLS with it.
    let other_svid = ca.mint("default", "other");
    let released = std::time::Instant::now();
    node1.node.apply([Change::SetPodSvid {
        uid: "uid-other".into(),
        svid: Some(other_svid.svid.clone()),
    }]);
    let want = format!("web peer={}", other_svid.svid.spiffe_id);
    let mut seen = Vec::new();
    try_wait_for("other's call presenting its own SVID", BOUND, || {
        let (status, body) = call("other", "web.default", [10, 96, 0, 10]);
        seen.push(format!("{status} {body}"));
        (status == 200 && body == want).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: answers {seen:?}{}", context()));
    eprintln!(
        "other's SVID released to its first call presenting it: {:.0} ms ({} calls)",
        released.elapsed().as_secs_f64() * 1e3,
        seen.len()
    );
    assert!(
        seen.iter().all(|a| !a.contains(&agent.svid.spiffe_id)),
        "{seen:?}"
    );
    assert!(
        node1.wait_acked_current(BOUND).await,
        "node 1's Envoy did not ACK other's SVID{}",
        context()
    );
    let other_addr = pod_addr(dp1.pod("other").ip);
    let mtls = tls_client(&ca.pem(), Some(&client));
    let mut last = None;
    let leaf = try_wait_for(
        "mTLS to other with its own certificate",
        BOUND,
        || match exchange(&dp1.client, other_addr, Some(mtls.clone()), "hello") {
            Ok((answer, leaf)) if answer == "other: hello" => leaf,
            r => {
                last = Some(format!("{r:?}"));
                None
            }
        },
    )
    .unwrap_or_else(|e| panic!("{e}: last {last:?}{}", context()));
    assert_eq!(
        leaf, other_svid.leaf_der,
        "other's listener presents its own SVID"
    );

    // A reused IP: `client` is deleted and a new pod takes its addresses (its network
    // namespace stands in for the new sandbox). Its certificate is named by its own uid,
    // so its calls use new upstream connections and present its own SVID, never the one
    // of `client`, whose pooled connection to web is still open.
    let (status, _) = call("client", "web.default", [10, 96, 0, 10]);
    assert_eq!(status, 200, "client's last call{}", context());
    let newcomer = ca.mint("default", "newcomer");
    let mut reused = dp1.pod_record("client", false);
    reused.uid = "uid-newcomer".into();
    reused.name = "newcomer".into();
    node1.node.apply([
        Change::RemovePod("uid-client".into()),
        Change::SetPodSvid {
            uid: "uid-client".into(),
            svid: None,
        },
        Change::UpsertPod(reused),
        Change::SetPodSvid {
            uid: "uid-newcomer".into(),
            svid: Some(newcomer.svid.clone()),
        },
    ]);
    assert!(
        node1.wait_acked_current(BOUND).await,
        "node 1's Envoy did not ACK the new pod at the reused IP{}",
        context()
    );
    let want = format!("web peer={}", newcomer.svid.spiffe_id);
    for round in 0..3 {
        let (status, body) = call("client", "web.default", [10, 96, 0, 10]);
        assert_eq!(
            (status, body.as_str()),
            (200, want.as_str()),
            "round {round}: the new pod at client's IP presented another identity{}",
            context()
        );
    }

    for rig in [&node1, &node2] {
        for t in TYPES {
            assert_eq!(
                rig.worker_counter("nacks", t),
                0,
                "NACK for {t}{}",
                context()
            );
        }
    }
    // Envoy dies before its namespace goes (the rigs were declared after the data paths).
    drop(node1);
    drop(node2);
}

both_apis!(
    a_deleted_pods_certificate_leaves_envoy_within_5s,
    a_deleted_pods_certificate_leaves_envoy_within_5s_over_delta_ads,
    deleted
);

/// A pod deleted while a client holds an mTLS connection to it: its listener drains (for
/// Envoy's `--drain-time-s`, 600 s by default), and Envoy keeps a removed secret that a
/// draining listener uses; state of the world cannot remove a secret at all. Within 5 s
/// of the removal no certificate Envoy lists (`/certs`) and no secret of its config dump
/// is the pod's: the agent overwrote them with its tombstone.
async fn deleted(api: AdsApi) {
    let Some(c) = Case::start(
        "a_deleted_pods_certificate_leaves_envoy_within_5s",
        api,
        Some((MtlsMode::Strict, true)),
    )
    .await
    else {
        return;
    };
    c.wait_listener_active();
    c.wait_served(Some(c.mtls()), "mTLS to the pod");
    let mut held = Conn::open(&c.dp.client, c.web(), Some(c.mtls())).expect("an mTLS connection");
    assert_eq!(held.ask("held").expect("an answer"), "web: held");
    let id = "spiffe://aether.test/ns/default/pod/web";
    let pods_certificate = |c: &Case| {
        let certs = c.rig.admin("/certs");
        let dump = c.rig.config_dump().to_string();
        let chain = serde_json::to_string(&c.web.svid.chain_pem).expect("JSON");
        let chain = chain.trim_matches('"');
        (certs.contains(id), dump.contains(chain))
    };
    assert_eq!(
        pods_certificate(&c),
        (true, true),
        "the control: Envoy lists the pod's certificate before the delete{}",
        c.context()
    );

    let start = Instant::now();
    c.apply([
        Change::SetPodSvid {
            uid: UID.into(),
            svid: None,
        },
        Change::RemovePod(UID.into()),
    ])
    .await;
    let mut last = (true, true);
    try_wait_for(
        "the pod's certificate out of Envoy",
        Duration::from_secs(5),
        || {
            last = pods_certificate(&c);
            (last == (false, false)).then_some(())
        },
    )
    .unwrap_or_else(|e| {
        panic!(
            "{e}: (in /certs, in the config dump) = {last:?}{}",
            c.context()
        )
    });
    let took = start.elapsed();
    // The listener still drains with the held connection: the case the tombstone is for.
    let dump = c.rig.config_dump();
    let draining = dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["dynamic_listeners"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .any(|l| l["name"] == LISTENER && !l["draining_state"].is_null());
    let tombstone_pem =
        serde_json::to_string(aether_worker::xds::tombstone::CERT_PEM).expect("JSON");
    let tombstone = dump.to_string().contains(tombstone_pem.trim_matches('"'));
    eprintln!(
        "{api:?}: the deleted pod's certificate left Envoy {} ms after the delete; its \
         listener draining: {draining}, the tombstone in its config: {tombstone}",
        took.as_millis()
    );
    assert!(
        draining && tombstone,
        "the pod's listener should still drain with the held connection, holding the \
         tombstone (draining {draining}, tombstone {tombstone}){}",
        c.context()
    );
    c.assert_no_nacks();
    drop(held);
}
