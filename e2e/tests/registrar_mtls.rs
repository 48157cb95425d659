//! Agents by SVID: the real `aether-registrar` on real etcd with mutual TLS
//! (`--client-ca-bundle`), gRPC clients presenting X.509-SVIDs, the real agent with its
//! own SVID from the test identity provider (the Workload API double), and the test
//! Kubernetes API server answering TokenReviews.
//!
//! Each test skips, saying so, where etcd is not installed (`scripts/test.sh` installs it).

use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_e2e::datapath::tls_client_pem;
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::identity::{IdentityProvider, Options};
use aether_e2e::registrar::{Etcd, RegistrarProcess, registrar_bin};
use aether_e2e::testing::{
    Agent, LocalNode, bin, free_port, identity_provider_for_agents_with, metric_sample,
    scrape_metrics, wait_for,
};
use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    SanType,
};
use serde_json::{Value, json};
use shared_proto::registry as pb;
use shared_proto::registry::registry_client::RegistryClient;
use tonic::transport::Channel;

const T: Duration = Duration::from_secs(15);
const TD: &str = "aether.test";
const REGISTRAR_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-registrar";
const OPS_ID: &str = "spiffe://aether.test/ops";
/// One agent ID for every node: the node comes from the token.
const AGENT_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-agent";
/// Per-node agent IDs.
const NODE_AGENT_ID: &str = "spiffe://aether.test/aether-agent/{node}";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A CA of the test's own, beside the provider's in the bundle, for the certificates
/// SPIRE would never issue: two URI SANs, a past validity, another trust domain.
struct OddCa {
    key: KeyPair,
    cert: rcgen::Certificate,
}

impl OddCa {
    fn new() -> OddCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.subject_alt_names = vec![SanType::URI(format!("spiffe://{TD}").try_into().unwrap())];
        let cert = params.self_signed(&key).unwrap();
        OddCa { key, cert }
    }

    /// A leaf with `uris` as URI SANs, valid from `from` to `until` (epoch seconds).
    fn leaf(&self, uris: &[&str], from: u64, until: u64) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = uris
            .iter()
            .map(|u| SanType::URI((*u).to_owned().try_into().unwrap()))
            .collect();
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ClientAuth,
            ExtendedKeyUsagePurpose::ServerAuth,
        ];
        params.not_before = (UNIX_EPOCH + Duration::from_secs(from)).into();
        params.not_after = (UNIX_EPOCH + Duration::from_secs(until)).into();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path.display().to_string()
}

fn registry(services: &[(&str, &str, &str)]) -> Value {
    let services: Vec<Value> = services
        .iter()
        .map(|(name, addr, node)| {
            json!({ "name": name, "namespace": "default", "ports": [80],
                "endpoints": [{ "address": addr, "port": 8080, "node": node, "pod": format!("{name}-pod") }] })
        })
        .collect();
    json!({ "services": services })
}

/// `aether-registrar apply` as an operator presenting `cert`/`key` (its SVID).
fn apply_as(addr: &str, ca: &str, cert: &str, key: &str, file: &str) -> std::process::Output {
    std::process::Command::new(registrar_bin())
        .args([
            "apply",
            "--registrar",
            addr,
            "--ca",
            ca,
            "--cert",
            cert,
            "--key",
            key,
            "--file",
            file,
        ])
        .output()
        .unwrap()
}

/// What a call came to: Ok, or the status code and message (a failed handshake is a
/// transport error, which tonic reports as Unavailable or Unknown).
type Outcome = Result<(), (tonic::Code, String)>;

struct Caller {
    rt: tokio::runtime::Runtime,
    addr: String,
    bundle: String,
}

impl Caller {
    fn client(
        &self,
        id: Option<(&str, &str)>,
    ) -> Result<RegistryClient<Channel>, (tonic::Code, String)> {
        let config = tls_client_pem(&self.bundle, id);
        let endpoint = tonic::transport::Endpoint::from_static("http://registrar.invalid")
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(5));
        self.rt
            .block_on(shared_proto::registry_tls::channel(
                endpoint, &self.addr, config,
            ))
            .map(RegistryClient::new)
            .map_err(|e| (tonic::Code::Unavailable, format!("{e:?}")))
    }

    fn request<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        req
    }

    /// A watch of `node`'s stream: Ok once its first message is a full view.
    fn watch(&self, id: Option<(&str, &str)>, token: Option<&str>, node: &str) -> Outcome {
        let mut c = self.client(id)?;
        let req = Caller::request(
            pb::WatchEndpointsRequest {
                cluster: String::new(),
                node: node.into(),
                instance: "test".into(),
                resume_revision: 0,
            },
            token,
        );
        self.rt.block_on(async {
            let mut s = c
                .watch_endpoints(req)
                .await
                .map_err(|s| (s.code(), s.message().to_owned()))?
                .into_inner();
            match s.message().await {
                Ok(Some(pb::WatchEndpointsResponse {
                    kind: Some(pb::watch_endpoints_response::Kind::Full(_)),
                })) => Ok(()),
                Ok(other) => Err((tonic::Code::Unknown, format!("{other:?}"))),
                Err(s) => Err((s.code(), s.message().to_owned())),
            }
        })
    }

    /// A drain mark of `address` speaking for `node`.
    fn mark(
        &self,
        id: Option<(&str, &str)>,
        token: Option<&str>,
        node: &str,
        address: &str,
    ) -> Outcome {
        let mut c = self.client(id)?;
        let req = Caller::request(
            pb::SetEndpointStateRequest {
                service: None,
                address: address.into(),
                state: pb::EndpointState::Draining as i32,
                node: node.into(),
                instance: "test".into(),
            },
            token,
        );
        self.rt
            .block_on(c.set_endpoint_state(req))
            .map(|_| ())
            .map_err(|s| (s.code(), s.message().to_owned()))
    }
}

impl Caller {
    /// A QUIC pair set of one pair, speaking for `node`.
    fn pairs(&self, id: Option<(&str, &str)>, token: Option<&str>, node: &str) -> Outcome {
        let mut c = self.client(id)?;
        let req = Caller::request(
            pb::SetQuicPairsRequest {
                node: node.into(),
                pairs: vec![pb::QuicPair {
                    tcp: "10.77.0.5:8080".into(),
                    quic: format!("{node}.example:4443"),
                    quic_sni: "web.prod.example".into(),
                    pod: "prod/web-0".into(),
                    since: 1,
                }],
                instance: "test".into(),
            },
            token,
        );
        self.rt
            .block_on(c.set_quic_pairs(req))
            .map(|_| ())
            .map_err(|s| (s.code(), s.message().to_owned()))
    }
}

fn refused_as(outcome: Outcome, codes: &[tonic::Code], what: &str) -> String {
    match outcome {
        Ok(()) => panic!("{what}: admitted"),
        Err((code, message)) => {
            assert!(codes.contains(&code), "{what}: {code:?} {message}");
            message
        }
    }
}

/// The registrar's count of refusals for `reason`.
fn refusals(metrics: &str, reason: &str) -> f64 {
    let text = scrape_metrics(metrics).expect("the registrar's metrics");
    metric_sample(
        &text,
        &format!("aether_registrar_refusals_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

/// An agent bound to node A, by its token beside one agent SPIFFE ID or by a per-node
/// `{node}` ID, watches and marks node A and is refused for node B; SVIDs from another
/// trust domain, expired, with two URI SANs, or none at all are refused at the handshake
/// or with UNAUTHENTICATED, each counted by its reason.
#[test]
fn agents_by_svid_speak_for_their_own_node_and_bad_svids_are_refused() {
    use aether_e2e::kube_api::{KubeApi, Rule};
    let Some(etcd) = Etcd::start_or_skip("agents_by_svid_speak_for_their_own_node...") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let provider = IdentityProvider::start(dir.path(), TD).unwrap();
    let odd = OddCa::new();
    let d = dir.path();
    let provider_ca = write(d, "provider-ca.pem", &provider.ca_pem());
    let bundle_text = format!("{}{}", provider.ca_pem(), odd.cert.pem());
    let bundle = write(d, "bundle.pem", &bundle_text);
    let (cert, key) = provider.mint_server(REGISTRAR_ID, &[IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let (cert, key) = (write(d, "tls.crt", &cert), write(d, "tls.key", &key));

    let api = KubeApi::start();
    let (registrar_sa, agent_sa) = (
        "system:serviceaccount:aether-system:aether-registrar",
        "system:serviceaccount:aether-system:aether-agent",
    );
    api.grant(
        registrar_sa,
        &[Rule {
            resource: "tokenreviews",
            verbs: &["create"],
        }],
    );
    api.bind_token_to_node(agent_sa, "node-a");
    let token = api.token(agent_sa);
    let kubeconfig = api.kubeconfig(registrar_sa).display().to_string();
    let metrics = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());
    let listen = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--client-ca-bundle",
            &bundle,
            "--trust-domain",
            TD,
            "--token-review",
            "--kubeconfig",
            &kubeconfig,
            "--agent-service-account",
            "aether-system/aether-agent",
            "--agent-spiffe-id",
            AGENT_ID,
            "--agent-spiffe-id",
            NODE_AGENT_ID,
            "--operator-spiffe-id",
            OPS_ID,
            "--discovery",
            "off",
            "--metrics-addr",
            &metrics,
        ],
    );
    let file = write(
        d,
        "registry.json",
        &registry(&[
            ("web", "10.77.0.5", "node-a"),
            ("db", "10.77.0.9", "node-b"),
        ])
        .to_string(),
    );
    let (ops_cert, ops_key) = provider.mint(OPS_ID);
    let (ops_cert, ops_key) = (
        write(d, "ops.crt", &ops_cert),
        write(d, "ops.key", &ops_key),
    );
    let out = apply_as(registrar.addr(), &provider_ca, &ops_cert, &ops_key, &file);
    assert!(out.status.success(), "the operator's SVID applies: {out:?}");
    // An agent's SVID may not apply.
    let (a_cert, a_key) = provider.mint("spiffe://aether.test/aether-agent/node-a");
    let (a_cert_f, a_key_f) = (write(d, "a.crt", &a_cert), write(d, "a.key", &a_key));
    let out = apply_as(registrar.addr(), &provider_ca, &a_cert_f, &a_key_f, &file);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("PermissionDenied"),
        "{out:?}"
    );

    let caller = Caller {
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
        addr: registrar.addr().to_owned(),
        bundle: provider.ca_pem(),
    };
    let denied = [tonic::Code::PermissionDenied];

    // By a {node} ID: node A's stream and marks; node B's refused.
    let node_a = Some((a_cert.as_str(), a_key.as_str()));
    caller
        .watch(node_a, None, "node-a")
        .expect("node A's watch by its {node} ID");
    caller
        .mark(node_a, None, "node-a", "10.77.0.5")
        .expect("node A's mark by its {node} ID");
    let why = refused_as(
        caller.watch(node_a, None, "node-b"),
        &denied,
        "node B's watch by node A's ID",
    );
    assert!(why.contains("SVID is bound to node \"node-a\""), "{why}");
    refused_as(
        caller.mark(node_a, None, "node-b", "10.77.0.9"),
        &denied,
        "node B's mark by node A's ID",
    );
    // QUIC pairs, the other agent write, are scoped the same way.
    caller
        .pairs(node_a, None, "node-a")
        .expect("node A's QUIC pairs by its {node} ID");
    let why = refused_as(
        caller.pairs(node_a, None, "node-b"),
        &denied,
        "node B's QUIC pairs by node A's ID",
    );
    assert!(why.contains("SVID is bound to node \"node-a\""), "{why}");

    // By the token beside the one agent ID: the same, and the ID alone names no node.
    let (s_cert, s_key) = provider.mint(AGENT_ID);
    let shared = Some((s_cert.as_str(), s_key.as_str()));
    caller
        .watch(shared, Some(&token), "node-a")
        .expect("node A's watch by SVID and token");
    caller
        .mark(shared, Some(&token), "node-a", "10.77.0.5")
        .expect("node A's mark by SVID and token");
    let why = refused_as(
        caller.mark(shared, Some(&token), "node-b", "10.77.0.9"),
        &denied,
        "node B's mark by node A's token",
    );
    assert!(why.contains("token is bound to node \"node-a\""), "{why}");
    caller
        .pairs(shared, Some(&token), "node-a")
        .expect("node A's QUIC pairs by SVID and token");
    let why = refused_as(
        caller.pairs(shared, Some(&token), "node-b"),
        &denied,
        "node B's QUIC pairs by node A's token",
    );
    assert!(why.contains("token is bound to node \"node-a\""), "{why}");
    assert_eq!(refusals(&metrics, "quic_pairs_other_node"), 2.0);
    let why = refused_as(
        caller.watch(shared, None, "node-a"),
        &denied,
        "the agent ID without a token",
    );
    assert!(why.contains("names no node"), "{why}");
    // Both sent: both must hold. Node B's {node} ID with node A's token is refused.
    let (b_cert, b_key) = provider.mint("spiffe://aether.test/aether-agent/node-b");
    let node_b = Some((b_cert.as_str(), b_key.as_str()));
    let why = refused_as(
        caller.watch(node_b, Some(&token), "node-b"),
        &denied,
        "SVID and token disagreeing",
    );
    assert!(
        why.contains("names node \"node-b\" but the token is bound to node \"node-a\""),
        "{why}"
    );
    // A token that does not hold fails the call whatever the SVID.
    refused_as(
        caller.watch(node_a, Some("not-a-token"), "node-a"),
        &[tonic::Code::Unauthenticated],
        "a bad token beside a good SVID",
    );

    // Refused at the handshake, or with UNAUTHENTICATED, and counted by reason.
    let handshake = [
        tonic::Code::Unavailable,
        tonic::Code::Unknown,
        tonic::Code::Unauthenticated,
        tonic::Code::Cancelled,
    ];
    let t = now();
    let (foreign_cert, foreign_key) =
        IdentityProvider::mint_foreign("other.test", "spiffe://other.test/aether-agent/node-a");
    let (odd_td_cert, odd_td_key) = odd.leaf(
        &["spiffe://other.test/aether-agent/node-a"],
        t - 60,
        t + 3600,
    );
    let (expired_cert, expired_key) = odd.leaf(
        &["spiffe://aether.test/aether-agent/node-a"],
        t - 7200,
        t - 3600,
    );
    let (two_cert, two_key) = odd.leaf(
        &[
            "spiffe://aether.test/aether-agent/node-a",
            "spiffe://aether.test/ops",
        ],
        t - 60,
        t + 3600,
    );
    for (what, id, reason) in [
        (
            "an SVID of a CA outside the bundle",
            (foreign_cert.as_str(), foreign_key.as_str()),
            "svid_untrusted",
        ),
        (
            "an SVID of another trust domain",
            (odd_td_cert.as_str(), odd_td_key.as_str()),
            "svid_trust_domain",
        ),
        (
            "an expired SVID",
            (expired_cert.as_str(), expired_key.as_str()),
            "svid_expired",
        ),
        (
            "an SVID with two URI SANs",
            (two_cert.as_str(), two_key.as_str()),
            "svid_uri_sans",
        ),
    ] {
        let before = refusals(&metrics, reason);
        let why = refused_as(caller.watch(Some(id), None, "node-a"), &handshake, what);
        eprintln!("{what}: {why}");
        // At least once: a channel may dial again after the server's alert.
        let after = refusals(&metrics, reason);
        assert!(
            after >= before + 1.0,
            "{what} counted as {reason}: {before} -> {after}"
        );
    }
    // No certificate, no token.
    let before = refusals(&metrics, "unauthenticated");
    let why = refused_as(
        caller.watch(None, None, "node-a"),
        &[tonic::Code::Unauthenticated],
        "no certificate",
    );
    assert!(why.contains("no client certificate"), "{why}");
    assert_eq!(refusals(&metrics, "unauthenticated"), before + 1.0);
    registrar.wait_log("TLS handshake failed", T);
}

/// `/ready`'s registrar section: (revision, full views).
fn registrar_view(a: &Agent) -> Option<(i64, u64)> {
    let (_, v) = a.ready()?;
    Some((
        v["registrar"]["revision"].as_i64()?,
        v["registrar"]["full_views"].as_u64()?,
    ))
}

fn cni(node: &LocalNode) -> Cni {
    Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    }
}

/// The real agent with its own SVID (a per-node `{node}` ID from the Workload API double)
/// and `--registrar-spiffe-id`: it loads node A's registry and sets its pods' drain marks.
/// After a rotation a new connection presents the new serial; at the old certificate's
/// notAfter the registrar ends the stream, and the agent resumes from its revision on a
/// new connection with no new full view.
#[test]
fn an_agent_by_its_svid_watches_and_marks_and_a_rotation_costs_its_watch_no_full_view() {
    let Some(etcd) = Etcd::start_or_skip("an_agent_by_its_svid_watches_and_marks...") else {
        return;
    };
    let mut options = Options::new(TD);
    options.agent_path = "/aether-agent/test-node".into();
    let (_idp_dir, provider) = identity_provider_for_agents_with(options);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bundle = write(d, "bundle.pem", &provider.ca_pem());
    let (cert, key) = provider.mint_server(REGISTRAR_ID, &[IpAddr::V4(Ipv4Addr::LOCALHOST)]);
    let (cert, key) = (write(d, "tls.crt", &cert), write(d, "tls.key", &key));
    let (ops_cert, ops_key) = provider.mint(OPS_ID);
    let (ops_cert, ops_key) = (
        write(d, "ops.crt", &ops_cert),
        write(d, "ops.key", &ops_key),
    );
    // The agent's first SVID lives 12 s, so that it expires within the test.
    const LIFETIME: u64 = 12;
    provider.set_svid_lifetime(Duration::from_secs(LIFETIME));
    let minted = now();
    provider.rotate_all();
    let metrics = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());
    let listen = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--client-ca-bundle",
            &bundle,
            "--trust-domain",
            TD,
            "--agent-spiffe-id",
            NODE_AGENT_ID,
            "--operator-spiffe-id",
            OPS_ID,
            "--metrics-addr",
            &metrics,
        ],
    );
    let mut node = LocalNode::new();
    let file = write(
        node.root.path(),
        "registry.json",
        &registry(&[
            ("web", "10.78.0.5", "test-node"),
            ("db", "10.78.0.9", "node-b"),
        ])
        .to_string(),
    );
    let out = apply_as(registrar.addr(), &bundle, &ops_cert, &ops_key, &file);
    assert!(out.status.success(), "{out:?}");
    let flags = [
        format!("--registrar={}", registrar.addr()),
        format!("--registrar-spiffe-id={REGISTRAR_ID}"),
        format!(
            "--spiffe-endpoint=unix://{}",
            provider.workload_socket().display()
        ),
        format!("--trust-domain={TD}"),
    ];
    let agent = node.start_agent_with(&flags.iter().map(String::as_str).collect::<Vec<_>>());
    agent.wait_role("owner", T);
    let first_serial = provider.serial_of_agent();
    let (rev, full) = wait_for("the agent to load the registry over mutual TLS", T, || {
        registrar_view(&agent).filter(|(r, _)| *r >= 1)
    });
    assert_eq!(full, 1, "one full view");
    registrar.wait_log(&format!("(serial {first_serial}) (node test-node)"), T);

    // Its own pod's drain mark lands.
    let cni = cni(&node);
    let pod = PodId {
        uid: "svid-pod-uid".into(),
        name: "svid-pod".into(),
    };
    cni.call("ADD", &pod, Some(Ipv4Addr::new(10, 78, 0, 5)))
        .expect("ADD");
    cni.call("DEL", &pod, None).expect("DEL");
    agent.wait_log("drain mark set", T);

    // A rotation: the open stream keeps its connection; the next connection presents the
    // new serial. This one lives an hour.
    provider.set_svid_lifetime(Duration::from_secs(3600));
    provider.rotate_all();
    let second_serial = provider.serial_of_agent();
    assert_ne!(first_serial, second_serial);
    // A change reaches the agent on the old stream meanwhile.
    let file2 = write(
        node.root.path(),
        "registry2.json",
        &registry(&[
            ("web", "10.78.0.5", "test-node"),
            ("db", "10.78.0.9", "node-b"),
            ("api", "10.78.0.7", "node-b"),
        ])
        .to_string(),
    );
    let out = apply_as(registrar.addr(), &bundle, &ops_cert, &ops_key, &file2);
    assert!(out.status.success(), "{out:?}");
    // At the first SVID's notAfter the stream ends; the agent resumes with the new one.
    wait_for(
        "the stream to end at the old SVID's notAfter and resume with the new serial",
        Duration::from_secs(LIFETIME + 15),
        || {
            let log = registrar.log();
            (log.contains("watch stream ended: the client certificate expired")
                && log.contains(&format!("(serial {second_serial}) (node test-node)")))
            .then_some(())
        },
    );
    assert!(
        now() >= minted + LIFETIME - 1,
        "the stream ended at the notAfter ({}), not before ({})",
        minted + LIFETIME,
        now()
    );
    let text = scrape_metrics(&metrics).expect("the registrar's metrics");
    assert_eq!(
        metric_sample(
            &text,
            "aether_registrar_watch_ends_total{result=\"expired\"}"
        ),
        Some(1.0),
        "{text}"
    );
    // The resumed stream is served from the revision: still one full view, and it sees
    // what comes next.
    let out = apply_as(registrar.addr(), &bundle, &ops_cert, &ops_key, &file);
    assert!(out.status.success(), "{out:?}");
    let (after, full) = wait_for("the resumed stream to carry the next change", T, || {
        registrar_view(&agent).filter(|(r, _)| *r > rev + 1)
    });
    assert_eq!(
        full, 1,
        "0 new full views after the rotation (revision {after})"
    );
}

/// `--spiffe-endpoint`: the registrar's own SVID and the bundle come from the Workload
/// API. An agent's SVID from the same provider is admitted; after a rotation the next
/// handshake serves the registrar's new SVID without a restart.
#[test]
fn the_registrar_takes_its_svid_and_bundle_from_the_workload_api_and_follows_a_rotation() {
    let Some(etcd) = Etcd::start_or_skip("the_registrar_takes_its_svid_and_bundle...") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut options = Options::new(TD);
    options.agent_path = "/ns/aether-system/sa/aether-registrar".into();
    let provider = IdentityProvider::start_with(dir.path(), options).unwrap();
    assert_eq!(provider.agent_spiffe_id(), REGISTRAR_ID);
    let listen = format!("127.0.0.1:{}", free_port(Ipv4Addr::LOCALHOST).unwrap());
    let endpoint = format!("unix://{}", provider.workload_socket().display());
    let registrar = RegistrarProcess::start(
        &registrar_bin(),
        &etcd.endpoints(),
        &listen,
        &[
            "--spiffe-endpoint",
            &endpoint,
            "--trust-domain",
            TD,
            "--agent-spiffe-id",
            NODE_AGENT_ID,
        ],
    );
    let caller = Caller {
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
        addr: registrar.addr().to_owned(),
        bundle: provider.ca_pem(),
    };
    let (a_cert, a_key) = provider.mint("spiffe://aether.test/aether-agent/node-a");
    let node_a = Some((a_cert.as_str(), a_key.as_str()));
    caller
        .watch(node_a, None, "node-a")
        .expect("node A's watch against the Workload API's bundle");
    registrar.wait_log("serving the SVID from the Workload API", T);
    refused_as(
        caller.watch(None, None, "node-a"),
        &[
            tonic::Code::Unavailable,
            tonic::Code::Unknown,
            tonic::Code::Cancelled,
        ],
        "no certificate, without --token-review: refused at the handshake",
    );
    let count = |log: &str| {
        log.matches("serving the SVID from the Workload API")
            .count()
    };
    let before = count(&registrar.log());
    provider.rotate_all();
    // The source takes the rotation from its stream; each new handshake serves what it holds.
    wait_for("the rotated SVID to be served", T, || {
        caller.watch(node_a, None, "node-a").ok()?;
        (count(&registrar.log()) > before).then_some(())
    });
}
