//! The node's QUIC pairs with the real binaries: agent processes (supervisor and worker)
//! with identity from the test provider, a real Envoy in a node network namespace serving
//! the pods' twins on 10.250.0.1 (UDP), pods in namespaces of their own answering HTTP,
//! real `aether-cni` ADDs, and the real registrar on real etcd over mutual TLS (each agent
//! by its per-node SVID).
//!
//! - [`after_the_window_the_pair_is_in_the_file_and_the_registry_and_an_http3_client_reaches_the_pod`]:
//!   once the fetch window has passed, `quic-pairs.json` lists each pod; a real HTTP/3
//!   client (aioquic, `e2e/quic/h3_client.py`) with a client SVID, connecting where the
//!   file says with its `sni`, gets the pod's answer; etcd holds the pair and the
//!   registrar's endpoint carries it.
//! - [`surge_rolls_under_http3_load_keep_every_twin_and_only_owners_write_pairs`]:
//!   `QUIC_PAIRS_ROLLS` surge rolls (3; the full form 20) under HTTP/3 load on fresh
//!   connections: no failed request; each twin's filter chain, and the twins' listener's
//!   version and `last_updated`, unchanged by every roll in Envoy's config dump; fanotify
//!   on the state folder names every writer of `quic-pairs.json`, each the owner of the
//!   time and never a standby; the registrar's log names the instance of every
//!   `SetQuicPairs`, each the owner of the time; `/ready` shows the window restart at
//!   each takeover while the restored pairs stay in etcd (the key's `mod_revision`
//!   unchanged). A pod added during the first overlap (the proxy subscribes its twin's
//!   secret on the old owner's stream) is served by the new owner on Envoy's new stream:
//!   its twin answers after the roll and is advertised after the new owner's window.
//!
//! Without root, Envoy, etcd or the Python client each test says so loudly and returns.

use std::collections::BTreeMap;
use std::io::{Read, Write as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_e2e::datapath::{Datapath, Serve};
use aether_e2e::envoy::Envoy;
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::identity::{IdentityProvider, Options};
use aether_e2e::quic;
use aether_e2e::registrar::{Etcd, RegistrarProcess, registrar_bin};
use aether_e2e::testing::{
    Agent, LocalNode, bin, identity_args, identity_provider_for_agents_with, is_root, wait_for,
};
use base64::Engine as _;
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(20);
const TD: &str = "aether.test";
const NODE: &str = "test-node";
const REGISTRAR_ID: &str = "spiffe://aether.test/ns/aether-system/sa/aether-registrar";
const OPS_ID: &str = "spiffe://aether.test/ops";
const NODE_AGENT_ID: &str = "spiffe://aether.test/aether-agent/{node}";
const CLIENT_ID: &str = "spiffe://aether.test/ns/clients/sa/h3";
/// The namespace the CNI calls name, so the pods' `pod` field.
const POD_NS: &str = "churn";
const TWIN_PORT: u16 = 15443;
const PAIRS: &str = "quic-pairs.json";
/// etcd key of the node's set (`registrar/src/keys.rs`, the default prefix).
const PAIRS_KEY: &str = "/aether/registry/quic-pairs/test-node";

fn twin_addr() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 250, 0, 1)), TWIN_PORT)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    path.display().to_string()
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Why this machine cannot run the tests, if it cannot.
fn missing(test: &str) -> Option<(PathBuf, Etcd)> {
    let envoy = quic::envoy_or_skip(test)?;
    let etcd = Etcd::start_or_skip(test)?;
    Some((envoy, etcd))
}

/// A pod of the node: its CNI identity, its address, its name as the pairs write it.
struct TestPod {
    id: PodId,
    ip: Ipv4Addr,
}

impl TestPod {
    fn new(dp: &Datapath, name: &str) -> TestPod {
        TestPod {
            id: PodId {
                uid: format!("qp-{name}-uid"),
                name: name.into(),
            },
            ip: dp.pod(name).ip,
        }
    }

    fn pod(&self) -> String {
        format!("{POD_NS}/{}", self.id.name)
    }

    fn sni(&self) -> String {
        aether_model::twin_sni(&self.id.uid)
    }

    fn tcp(&self) -> String {
        format!("{}:80", self.ip)
    }
}

/// The node: its namespaces and pods, the provider, etcd and the registrar, the agents'
/// folder, Envoy, the owner.
struct Rig {
    // Dropped in order: the agents and Envoy before the namespaces and the provider.
    owner: Agent,
    envoy: Envoy,
    node: LocalNode,
    registrar: RegistrarProcess,
    etcd: Etcd,
    dp: Datapath,
    idp: IdentityProvider,
    _idp_dir: tempfile::TempDir,
    certs: tempfile::TempDir,
    /// The operator's TLS flags for `aether-registrar` commands.
    ops: Vec<String>,
    client: (String, String),
    pods: Vec<TestPod>,
}

impl Rig {
    /// A node with the pods `names` (each also a registry service of one endpoint on this
    /// node; all but the last `later` ADDed, their twins in Envoy), agents run with
    /// `--quic-pair-window window`.
    fn start(test: &str, names: &[&str], later: usize, window: Duration) -> Option<Rig> {
        // Envoy::start_on finds the same binary.
        let (_envoy_bin, etcd) = missing(test)?;
        let mut options = Options::new(TD);
        options.agent_path = format!("/aether-agent/{NODE}");
        let (idp_dir, idp) = identity_provider_for_agents_with(options);
        let certs = tempfile::tempdir().unwrap();
        let c = certs.path();
        let bundle = write(c, "bundle.pem", &idp.ca_pem());
        let (cert, key) = idp.mint_server(REGISTRAR_ID, &[IpAddr::V4(Ipv4Addr::LOCALHOST)]);
        let (cert, key) = (write(c, "tls.crt", &cert), write(c, "tls.key", &key));
        let (ops_cert, ops_key) = idp.mint(OPS_ID);
        let ops = vec![
            "--ca".to_string(),
            bundle.clone(),
            "--cert".into(),
            write(c, "ops.crt", &ops_cert),
            "--key".into(),
            write(c, "ops.key", &ops_key),
        ];
        let (client_cert, client_key) = idp.mint(CLIENT_ID);
        let client = (
            write(c, "client.crt", &client_cert),
            write(c, "client.key", &client_key),
        );
        let listen = format!(
            "127.0.0.1:{}",
            aether_e2e::testing::free_port(Ipv4Addr::LOCALHOST).unwrap()
        );
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
            ],
        );
        let mut dp = Datapath::create("qp", [10, 79, 0]).expect("the data path's namespaces");
        for (i, name) in names.iter().enumerate() {
            dp.add_pod(name, 2 + i as u8, Serve::Http(None))
                .expect("a pod");
        }
        let pods: Vec<TestPod> = names.iter().map(|n| TestPod::new(&dp, n)).collect();
        let mut node = LocalNode::builder()
            .node_name(NODE)
            .keep_folder()
            .capture()
            .build()
            .expect("node folder");
        eprintln!("node folder: {}", node.root.path().display());
        // One service per pod, its endpoint the pod's on this node: what its pair names.
        let services: Vec<Value> = pods
            .iter()
            .map(|p| {
                json!({ "name": p.id.name, "namespace": POD_NS, "ports": [80], "endpoints": [
                    { "address": p.ip.to_string(), "port": 80, "node": NODE, "pod": p.id.name } ] })
            })
            .collect();
        let file = write(
            node.root.path(),
            "registry.json",
            &json!({ "services": services }).to_string(),
        );
        registrar_cli(&registrar, &ops, &["apply", "--file", &file]);
        node.args.extend([
            format!("--registrar={}", registrar.addr()),
            format!("--registrar-spiffe-id={REGISTRAR_ID}"),
            format!("--quic-twin-addr={}", twin_addr()),
            format!("--quic-pair-window={}ms", window.as_millis()),
        ]);
        node.args.extend(identity_args(&idp, "permissive"));
        let owner = node.start_owner(T).unwrap_or_else(|e| panic!("{e}"));
        let envoy = Envoy::start_on(&node, Some(&dp.node)).expect("Envoy");
        envoy.wait_connected(T);
        let rig = Rig {
            owner,
            envoy,
            node,
            registrar,
            etcd,
            dp,
            idp,
            _idp_dir: idp_dir,
            certs,
            ops,
            client,
            pods,
        };
        let now = &rig.pods[..rig.pods.len() - later];
        for p in now {
            rig.add(p);
        }
        let mut want: Vec<String> = now.iter().map(|p| p.id.uid.clone()).collect();
        want.sort();
        wait_for("every pod's twin in Envoy", T, || {
            (twin_chains(&rig.config_dump())
                .keys()
                .cloned()
                .collect::<Vec<_>>()
                == want)
                .then_some(())
        });
        Some(rig)
    }

    fn add(&self, pod: &TestPod) {
        let cni = Cni {
            bin: bin("aether-cni"),
            socket: self.node.cni_sock(),
        };
        cni.call("ADD", &pod.id, Some(pod.ip))
            .unwrap_or_else(|e| panic!("CNI ADD of {}: {e}\n{}", pod.id.uid, self.where_to_look()));
    }

    fn config_dump(&self) -> Value {
        let (status, body) = self.envoy.get("/config_dump").expect("Envoy admin");
        assert_eq!(status, 200, "Envoy /config_dump answered {status}");
        serde_json::from_str(&body).expect("config dump JSON")
    }

    fn pairs_file(&self) -> Option<Vec<Value>> {
        let text = std::fs::read_to_string(self.node.state_dir.join(PAIRS)).ok()?;
        let v: Value = serde_json::from_str(&text).ok()?;
        v["pairs"].as_array().cloned()
    }

    /// The pods `quic-pairs.json` lists.
    fn pods_in_file(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .pairs_file()
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p["pod"].as_str().map(String::from))
            .collect();
        v.sort();
        v
    }

    /// etcd's value of the node's pair set and its `mod_revision`, read through etcd's
    /// JSON gateway.
    fn etcd_pairs(&self) -> Option<(Value, i64)> {
        let url = self.etcd.client_urls()[0].clone();
        let addr = url.trim_start_matches("http://").to_string();
        let b64 = base64::engine::general_purpose::STANDARD;
        let body = json!({ "key": b64.encode(PAIRS_KEY) }).to_string();
        let mut s = std::net::TcpStream::connect(&addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "POST /v3/kv/range HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut raw = String::new();
        s.read_to_string(&mut raw).ok()?;
        let (_, json_body) = raw.split_once("\r\n\r\n")?;
        let v: Value = serde_json::from_str(json_body.trim()).ok()?;
        let kv = v["kvs"].as_array()?.first()?.clone();
        let value = b64.decode(kv["value"].as_str()?).ok()?;
        let rev = kv["mod_revision"].as_str()?.parse().ok()?;
        Some((serde_json::from_slice(&value).ok()?, rev))
    }

    fn etcd_pods(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .etcd_pairs()
            .map(|(v, _)| v["pairs"].as_array().cloned().unwrap_or_default())
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p["pod"].as_str().map(String::from))
            .collect();
        v.sort();
        v
    }

    /// One HTTP/3 GET from the client namespace to `quic` naming `sni`, with the client SVID.
    fn h3(&self, quic: &str, sni: &str) -> Value {
        let addr: SocketAddr = quic.parse().expect("quic is IP:PORT here");
        let cert = (Path::new(&self.client.0), Path::new(&self.client.1));
        quic::h3_with(Some(&self.dp.client.name), addr, sni, Some(cert), 3.0)
    }

    fn where_to_look(&self) -> String {
        format!(
            "node folder {} (gen*.log, envoy/envoy.log)",
            self.node.root.path().display()
        )
    }
}

/// `aether-registrar <command> --registrar ADDR <ops TLS flags> <args>`: its stdout.
fn registrar_cli(r: &RegistrarProcess, ops: &[String], args: &[&str]) -> String {
    let out = std::process::Command::new(registrar_bin())
        .arg(args[0])
        .args(["--registrar", r.addr()])
        .args(ops)
        .args(&args[1..])
        .output()
        .expect("run aether-registrar");
    assert!(
        out.status.success(),
        "aether-registrar {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The twins' listener in a config dump: each filter chain by name (the pod uid) as JSON.
fn twin_chains(dump: &Value) -> BTreeMap<String, String> {
    twins_listener(dump)
        .map(|l| {
            l["active_state"]["listener"]["filter_chains"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    (
                        c["name"].as_str().unwrap_or_default().to_string(),
                        c.to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn twins_listener(dump: &Value) -> Option<Value> {
    dump["configs"]
        .as_array()?
        .iter()
        .flat_map(|c| {
            c["dynamic_listeners"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .find(|l| l["name"] == aether_model::QUIC_TWINS)
}

/// What the config dump says of the twins' listener: its version, `last_updated`, whether
/// a draining state exists, and each chain.
#[derive(Debug, Clone, PartialEq)]
struct TwinsListener {
    version: String,
    last_updated: String,
    draining: bool,
    warming: bool,
    chains: BTreeMap<String, String>,
}

fn twins_state(dump: &Value) -> TwinsListener {
    let l = twins_listener(dump).expect("the twins' listener in Envoy");
    TwinsListener {
        version: l["active_state"]["version_info"]
            .as_str()
            .unwrap_or_default()
            .into(),
        last_updated: l["active_state"]["last_updated"]
            .as_str()
            .unwrap_or_default()
            .into(),
        draining: !l["draining_state"].is_null(),
        warming: !l["warming_state"].is_null(),
        chains: twin_chains(dump),
    }
}

/// The dynamic secrets Envoy holds active, by name: (version, last_updated).
fn active_secrets(dump: &Value) -> BTreeMap<String, (String, String)> {
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| {
            c["dynamic_active_secrets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|s| {
            (
                s["name"].as_str().unwrap_or_default().to_string(),
                (
                    s["version_info"].as_str().unwrap_or_default().to_string(),
                    s["last_updated"].as_str().unwrap_or_default().to_string(),
                ),
            )
        })
        .collect()
}

fn quic_pairs_ready(a: &Agent) -> Option<Value> {
    let (_, v) = a.ready()?;
    Some(v["quic_pairs"].clone()).filter(|q| !q.is_null())
}

#[test]
fn after_the_window_the_pair_is_in_the_file_and_the_registry_and_an_http3_client_reaches_the_pod() {
    const WINDOW: Duration = Duration::from_secs(3);
    let test = "after_the_window_the_pair_is_in_the_file...";
    let Some(mut rig) = Rig::start(test, &["web", "api"], 0, WINDOW) else {
        return;
    };
    let q = quic_pairs_ready(&rig.owner).expect("/ready quic_pairs");
    let started = q["window_started_unix_ms"]
        .as_u64()
        .expect("window started");
    eprintln!("/ready quic_pairs with the twins served: {q}");
    // Within the window nothing is advertised (checked only while it surely runs).
    if unix_ms() + 500 < started + WINDOW.as_millis() as u64 {
        assert_eq!(q["window"], "running", "{q}");
        assert!(
            rig.pods_in_file().is_empty(),
            "advertised within the window: {:?}",
            rig.pairs_file()
        );
    }
    let mut want: Vec<String> = rig.pods.iter().map(TestPod::pod).collect();
    want.sort();
    wait_for(
        "quic-pairs.json to list every pod after the window",
        T,
        || (rig.pods_in_file() == want).then_some(()),
    );
    let listed_at = unix_ms();
    assert!(
        listed_at >= started + WINDOW.as_millis() as u64,
        "listed {} ms after the window started, before its end",
        listed_at - started
    );
    let pairs = rig.pairs_file().unwrap();
    for p in &rig.pods {
        let pair = pairs
            .iter()
            .find(|x| x["pod"] == p.pod())
            .unwrap_or_else(|| panic!("{} not in {pairs:?}", p.pod()));
        assert_eq!(pair["tcp"], p.tcp(), "{pair}");
        assert_eq!(pair["quic"], twin_addr().to_string(), "{pair}");
        assert_eq!(pair["sni"], p.sni(), "{pair}");
        let since = pair["since"].as_u64().expect("since");
        assert!(
            since * 1000 + 1000 >= started && since * 1000 <= listed_at,
            "since {since} outside [{started}, {listed_at}] ms: {pair}"
        );
        // The HTTP/3 client goes where the file says, with its sni.
        let quic = pair["quic"].as_str().unwrap();
        let sni = pair["sni"].as_str().unwrap();
        let r = rig.h3(quic, sni);
        assert_eq!(
            r["ok"],
            true,
            "HTTP/3 to {} at {quic} ({sni}): {r}",
            p.pod()
        );
        let body = r["responses"][0]["body"].as_str().unwrap_or_default();
        assert!(
            body.starts_with(&format!("{} ", p.id.name)),
            "{} answers: {r}",
            p.pod()
        );
        assert_eq!(
            r["server_uri"][0],
            rig.idp.pod_spiffe_id(POD_NS, &p.id.name),
            "the twin presents the pod's SVID: {r}"
        );
        eprintln!("HTTP/3 via quic-pairs.json to {}: {}", p.pod(), body.trim());
    }
    // The registry: etcd holds the set, and each pod's endpoint carries its twin.
    wait_for("etcd to hold the node's pairs", T, || {
        (rig.etcd_pods() == want).then_some(())
    });
    let (value, rev) = rig.etcd_pairs().unwrap();
    eprintln!("etcd {PAIRS_KEY} (mod_revision {rev}): {value}");
    for p in &rig.pods {
        let v = value["pairs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["pod"] == p.pod())
            .cloned()
            .unwrap();
        assert_eq!(v["tcp"], p.tcp());
        assert_eq!(v["quic"], twin_addr().to_string());
        assert_eq!(v["quic_sni"], p.sni());
    }
    let dump: Value =
        serde_json::from_str(&registrar_cli(&rig.registrar, &rig.ops, &["dump"])).expect("dump");
    for p in &rig.pods {
        let ep = dump["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == p.id.name.as_str())
            .and_then(|s| s["endpoints"].as_array()?.first().cloned())
            .unwrap_or_else(|| panic!("no endpoint of {} in {dump}", p.id.name));
        assert_eq!(ep["quic"], twin_addr().to_string(), "{ep}");
        assert_eq!(ep["quic_sni"], p.sni(), "{ep}");
    }
    let q = quic_pairs_ready(&rig.owner).unwrap();
    assert_eq!(q["window"], "passed", "{q}");
    assert_eq!(q["advertised"], rig.pods.len(), "{q}");
    assert!(q["registry_revision"].as_i64().is_some(), "{q}");
    rig.registrar.wait_log("instance=agent-gen1", T);
    rig.node.pass();
}

/// fanotify on the state folder: every modification of `quic-pairs.json` (or its temp
/// file), with the writer's pid. Needs CAP_SYS_ADMIN.
struct Writers {
    group: nix::sys::fanotify::Fanotify,
}

#[derive(Debug, Clone)]
struct FileWrite {
    pid: i32,
    path: String,
}

impl Writers {
    fn watch(dir: &Path) -> Writers {
        use nix::sys::fanotify::{EventFFlags, Fanotify, InitFlags, MarkFlags, MaskFlags};
        let folder = std::fs::File::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let group = Fanotify::init(
            InitFlags::FAN_CLASS_NOTIF | InitFlags::FAN_CLOEXEC | InitFlags::FAN_NONBLOCK,
            EventFFlags::O_RDONLY | EventFFlags::O_CLOEXEC | EventFFlags::O_LARGEFILE,
        )
        .expect("fanotify_init (root)");
        group
            .mark(
                MarkFlags::FAN_MARK_ADD,
                MaskFlags::FAN_MODIFY | MaskFlags::FAN_CLOSE_WRITE | MaskFlags::FAN_EVENT_ON_CHILD,
                folder.as_fd(),
                None::<&Path>,
            )
            .expect("fanotify_mark on the state folder");
        Writers { group }
    }

    /// Every write of the pairs file queued since the last call, in order.
    fn take(&mut self) -> Vec<FileWrite> {
        use nix::sys::fanotify::MaskFlags;
        let mut out = Vec::new();
        loop {
            let events = match self.group.read_events() {
                Ok(e) if e.is_empty() => break,
                Ok(e) => e,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("reading fanotify events: {e}"),
            };
            for ev in events {
                assert!(
                    !ev.mask().contains(MaskFlags::FAN_Q_OVERFLOW),
                    "the fanotify queue overflowed: writes were lost"
                );
                let Some(fd) = ev.fd() else { continue };
                let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
                let path = std::fs::read_link(format!("/proc/self/fd/{fd}"))
                    .map(|p| p.display().to_string())
                    .unwrap_or_default();
                if path.contains("quic-pairs") {
                    out.push(FileWrite {
                        pid: ev.pid(),
                        path,
                    });
                }
            }
        }
        out
    }
}

/// Checks that every writer in `writers` (in order) is one of `owners` (in the order they
/// owned the node), never going back to an earlier one; returns how many writes each made.
fn check_order(writers: &[String], owners: &[String], when: &str, look: &str) -> Vec<usize> {
    let mut counts = vec![0; owners.len()];
    let mut at = 0;
    for w in writers {
        let Some(i) = owners.iter().position(|o| o == w) else {
            panic!("{when}: {w} wrote and is not the owner of the time {owners:?}\n{look}");
        };
        assert!(
            i >= at,
            "{when}: {w} wrote after {} had taken over: {writers:?}\n{look}",
            owners[at]
        );
        at = i;
        counts[i] += 1;
    }
    counts
}

/// The instances the registrar's log names for each SetQuicPairs it took, in order.
fn registrar_callers(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("QUIC pairs set") || l.contains("QUIC pairs restated, unchanged"))
        .filter_map(|l| {
            l.split("instance=")
                .nth(1)?
                .split_whitespace()
                .next()
                .map(String::from)
        })
        .collect()
}

/// The HTTP/3 load in the client namespace (`e2e/quic/h3_load.py`), until stopped.
struct Load {
    child: std::process::Child,
    stop: PathBuf,
    progress: PathBuf,
}

impl Load {
    fn start(rig: &Rig, twins: &[&TestPod]) -> Load {
        let stop = rig.node.root.path().join("h3-load.stop");
        let progress = rig.node.root.path().join("h3-load.progress");
        let mut cmd = std::process::Command::new("ip");
        cmd.args(["netns", "exec", &rig.dp.client.name])
            .arg(quic::python())
            .arg(aether_e2e::testing::workspace_root().join("e2e/quic/h3_load.py"))
            .arg(twin_addr().ip().to_string())
            .arg(TWIN_PORT.to_string())
            .arg(&rig.client.0)
            .arg(&rig.client.1)
            .arg(&stop)
            .arg(format!("--progress={}", progress.display()));
        for t in twins {
            cmd.arg(format!("--twin={}={} ", t.sni(), t.id.name));
        }
        let child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start the HTTP/3 load");
        Load {
            child,
            stop,
            progress,
        }
    }

    /// Requests made so far (answered or failed).
    fn done(&self) -> u64 {
        std::fs::read_to_string(&self.progress)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Waits until `n` more requests have been made.
    fn wait_more(&self, n: u64, what: &str) {
        let from = self.done();
        wait_for(&format!("{n} more HTTP/3 requests {what}"), T, || {
            (self.done() >= from + n).then_some(())
        });
    }

    fn finish(self) -> Value {
        std::fs::write(&self.stop, b"").unwrap();
        let out = self.child.wait_with_output().expect("the HTTP/3 load");
        let text = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(text.trim()).unwrap_or_else(|e| {
            panic!(
                "the HTTP/3 load printed no JSON ({e}): {text}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

#[test]
fn surge_rolls_under_http3_load_keep_every_twin_and_only_owners_write_pairs() {
    const WINDOW: Duration = Duration::from_secs(5);
    let test = "surge_rolls_under_http3_load_keep_every_twin_and_only_owners_write_pairs";
    let rolls: usize = std::env::var("QUIC_PAIRS_ROLLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    if !is_root() {
        eprintln!("\n!!! SKIPPED {test}: fanotify needs root (CI runs as root) !!!\n");
        return;
    }
    let Some(mut rig) = Rig::start(test, &["web", "api", "late"], 1, WINDOW) else {
        return;
    };
    let look = rig.where_to_look();
    // "late" is added during the first overlap; web and api are there from the start.
    let late = rig.pods.pop().expect("late");
    let mut want: Vec<String> = rig.pods.iter().map(TestPod::pod).collect();
    want.sort();
    wait_for("quic-pairs.json and etcd to list web and api", T, || {
        (rig.pods_in_file() == want && rig.etcd_pods() == want).then_some(())
    });
    let mut writers = Writers::watch(&rig.node.state_dir);
    let load = Load::start(&rig, &rig.pods.iter().collect::<Vec<_>>());
    load.wait_more(4, "before the rolls");

    let mut owner_names = vec![rig.owner.name.clone()];
    let mut changed_chains = 0usize;
    let mut listener_changes = 0usize;
    let mut file_writes = Vec::new();
    let mut window_starts = vec![
        quic_pairs_ready(&rig.owner).unwrap()["window_started_unix_ms"]
            .as_u64()
            .unwrap(),
    ];
    let mut late_added = false;
    for roll in 1..=rolls {
        let w_pid = rig.owner.worker_pid();
        let next = rig.node.start_agent();
        next.wait_role("standby", T);
        let s_pid = next.worker_pid();
        let sq = quic_pairs_ready(&next).expect("the standby's /ready quic_pairs");
        assert_eq!(sq["window"], "standby", "roll {roll}: {sq}");
        assert!(sq["window_started_unix_ms"].is_null(), "roll {roll}: {sq}");
        if roll == 1 {
            // A pod added during the overlap: the old owner serves its twin, the proxy
            // subscribes its secret on the old stream.
            rig.add(&late);
            wait_for("late's twin in Envoy, served by the old owner", T, || {
                twin_chains(&rig.config_dump())
                    .contains_key(&late.id.uid)
                    .then_some(())
            });
            wait_for("late's secret active in Envoy", T, || {
                active_secrets(&rig.config_dump())
                    .keys()
                    .any(|n| n.contains(&late.id.uid))
                    .then_some(())
            });
            late_added = true;
        }
        let before = twins_state(&rig.config_dump());
        let secrets_before = active_secrets(&rig.config_dump());
        // The standby has written nothing: the file's writers so far are the owner's.
        let writes = writers.take();
        let names: Vec<String> = writes
            .iter()
            .map(|w| pid_name(w, &[(w_pid, &rig.owner.name), (s_pid, &next.name)]))
            .collect();
        check_order(
            &names,
            &owner_names[owner_names.len() - 1..],
            &format!("roll {roll}, beside the standby"),
            &look,
        );
        file_writes.extend(names);
        let callers = registrar_callers(&rig.registrar.log());
        assert!(
            !callers.contains(&format!("agent-{}", next.name)),
            "roll {roll}: the standby {} stated QUIC pairs to the registrar: {callers:?}",
            next.name
        );

        // Requests on new connections beside the standby, then across the handoff.
        load.wait_more(4, &format!("beside roll {roll}'s standby"));
        // What the registry and the file hold as the node passes on.
        let (_, rev_before) = rig.etcd_pairs().expect("the pairs in etcd");
        let (etcd_before, file_before) = (rig.etcd_pods(), rig.pods_in_file());
        rig.owner.signal(Signal::SIGTERM);
        let mut old = std::mem::replace(&mut rig.owner, next);
        let status = old
            .wait_exit_timeout(T)
            .unwrap_or_else(|e| panic!("roll {roll}: {e:#}"));
        assert!(
            status.success(),
            "roll {roll}: {} exited with {status}\n{look}",
            old.name
        );
        assert!(
            old.log().contains("QUIC pairs flushed before release"),
            "roll {roll}: {} did not flush its pairs\n{look}",
            old.name
        );
        let q = wait_for(
            &format!("roll {roll}: {} to serve", rig.owner.name),
            T,
            || {
                rig.owner.serving_owner()?;
                quic_pairs_ready(&rig.owner).filter(|q| q["window"] != "standby")
            },
        );
        owner_names.push(rig.owner.name.clone());
        // The window restarted at the takeover, and the restored pairs stay meanwhile.
        let start = q["window_started_unix_ms"].as_u64().unwrap();
        assert!(
            start > *window_starts.last().unwrap(),
            "roll {roll}: the window did not restart: {q}"
        );
        window_starts.push(start);
        if unix_ms() + 500 < start + WINDOW.as_millis() as u64 {
            assert_eq!(q["window"], "running", "roll {roll}: {q}");
            assert_eq!(
                q["restored"].as_u64().unwrap(),
                file_before.len() as u64,
                "roll {roll}: {q}"
            );
            assert_eq!(
                rig.pods_in_file(),
                file_before,
                "roll {roll}: the restored pairs in the file"
            );
            let (value, rev) = rig.etcd_pairs().expect("the pairs in etcd");
            assert_eq!(
                rev, rev_before,
                "roll {roll}: the node's pair set was rewritten in etcd at the takeover: {value}"
            );
            assert_eq!(
                rig.etcd_pods(),
                etcd_before,
                "roll {roll}: the restored pairs in etcd"
            );
        }
        assert!(
            want.iter().all(|p| rig.etcd_pods().contains(p)),
            "roll {roll}: a pair left etcd at the takeover"
        );

        // Envoy keeps every twin as it was: the listener not updated, not drained, each
        // chain the same. Envoy's new stream is served: wait for its ADS to connect.
        rig.envoy.wait_connected(T);
        let after = twins_state(&rig.config_dump());
        for (name, chain) in &before.chains {
            if after.chains.get(name) != Some(chain) {
                changed_chains += 1;
                eprintln!("roll {roll}: twin {name} changed");
            }
        }
        if after.version != before.version || after.last_updated != before.last_updated {
            listener_changes += 1;
        }
        assert_eq!(
            after, before,
            "roll {roll}: the twins' listener changed\n{look}"
        );
        assert!(!after.draining && !after.warming, "roll {roll}: {after:?}");
        // The secrets the proxy subscribed to (late's among them after roll 1) are served
        // by the new owner as the old one served them: none re-fetched, none missing.
        let secrets_after = active_secrets(&rig.config_dump());
        let late_secrets: Vec<&String> = secrets_before
            .keys()
            .filter(|n| n.contains(&late.id.uid))
            .collect();
        assert!(
            !late_secrets.is_empty(),
            "roll {roll}: no secret of the overlap pod in Envoy before the takeover"
        );
        for name in late_secrets {
            assert_eq!(
                secrets_after.get(name),
                secrets_before.get(name),
                "roll {roll}: the overlap pod's secret {name} after the takeover"
            );
        }
        if roll == 1 {
            // The new owner serves what the proxy asked for on the old stream.
            let r = rig.h3(&twin_addr().to_string(), &late.sni());
            assert_eq!(r["ok"], true, "roll 1: late's twin after the takeover: {r}");
        }
        // Writes since the standby was ready: the old owner's final flush (if any), then
        // the new owner's only.
        let writes = writers.take();
        let names: Vec<String> = writes
            .iter()
            .map(|w| pid_name(w, &[(w_pid, &old.name), (s_pid, &rig.owner.name)]))
            .collect();
        check_order(
            &names,
            &owner_names[owner_names.len() - 2..],
            &format!("roll {roll}, the handoff"),
            &look,
        );
        file_writes.extend(names);
        load.wait_more(4, &format!("after roll {roll}'s takeover"));
        drop(old);
    }
    // After the last owner's window, late is advertised, by that owner.
    let mut all = want.clone();
    if late_added {
        all.push(late.pod());
        all.sort();
    }
    wait_for(
        "late in quic-pairs.json and etcd after the window",
        T + WINDOW,
        || (rig.pods_in_file() == all && rig.etcd_pods() == all).then_some(()),
    );
    let r = rig.h3(&twin_addr().to_string(), &late.sni());
    assert_eq!(r["ok"], true, "late's twin at the end: {r}");
    let writes = writers.take();
    let names: Vec<String> = writes
        .iter()
        .map(|w| pid_name(w, &[(rig.owner.worker_pid(), &rig.owner.name)]))
        .collect();
    check_order(
        &names,
        &owner_names[owner_names.len() - 1..],
        "after the rolls",
        &look,
    );
    file_writes.extend(names);
    // The registry side: every SetQuicPairs came from the owner of the time, in order.
    let callers = registrar_callers(&rig.registrar.log());
    let owners: Vec<String> = owner_names.iter().map(|n| format!("agent-{n}")).collect();
    let per_owner = check_order(&callers, &owners, "SetQuicPairs callers", &look);
    let changed_sets = rig.registrar.log().matches("QUIC pairs set").count();

    let load = load.finish();
    eprintln!("HTTP/3 load: {load}");
    assert_eq!(load["failed"], 0, "failed HTTP/3 requests: {load}\n{look}");
    assert!(load["requests"].as_u64().unwrap() > 0, "{load}");
    let figures = json!({
        "rolls": rolls,
        "requests": load["requests"],
        "failed_requests": load["failed"],
        "twin_listener_changes": listener_changes,
        "twin_chain_changes": changed_chains,
        "file_writes": file_writes.len(),
        "file_writers": file_writes,
        "set_calls_per_owner": per_owner,
        "sets_changed_in_etcd": changed_sets,
        "window_starts_unix_ms": window_starts,
    });
    println!("{figures}");
    eprintln!("{figures}");
    rig.node.pass();
    let _ = rig.certs;
}

/// The generation whose worker made the write, or a name that says it is none of them.
fn pid_name(w: &FileWrite, known: &[(i32, &str)]) -> String {
    known.iter().find(|(p, _)| *p == w.pid).map_or_else(
        || format!("pid {} (no agent worker; wrote {})", w.pid, w.path),
        |(_, n)| n.to_string(),
    )
}
