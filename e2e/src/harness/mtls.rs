//! `ARG_MTLS=strict|permissive` (with `ARG_NODES=2`): pod-to-pod mTLS through both
//! nodes' Envoys while each node's agent rolls.
//!
//! Both Envoys run in network namespaces of their own ([`crate::datapath`]): node A's
//! client pods (namespaces with addresses on node A's pod subnet) call the services'
//! VIPs; node A's nftables redirect sends those calls to its Envoy's outbound listener,
//! which opens mTLS to node B's server pods with the calling pod's own SVID (the outbound
//! chain `pod|<uid>`); node B's nftables redirect hands each connection to its Envoy's
//! capture listener and the pod's inbound listener, which terminates the mTLS and
//! proxies TCP to the pod. Both nodes' agents run with identity from one test identity
//! provider (one trust domain, as one SPIRE server), node B's with
//! `--inbound-access-log`.
//!
//! Identity per connection: each server pod answers a request with the address its
//! connection came from (node B's Envoy's end of the proxied connection), node B's Envoy
//! logs each pod connection with that address (`upstream_local_address`), the pod's
//! address and the peer's SPIFFE ID, once the connection to the pod is made. The harness
//! joins every answered request to the log line of the connection that carried it and
//! checks that the peer was the calling pod itself ([`judge`]).
//!
//! The load: [`KEEPALIVE`] keep-alive connections per client pod (a request every
//! [`KEEPALIVE_PERIOD`] on each) and one thread per client pod opening a new connection
//! for each request every [`NEW_CONN_PERIOD`].
//!
//! Meanwhile: SVID rotations of every pod ([`rotate`]); and a client pod deleted and a
//! new pod added at its address, whose SVID the provider holds back for
//! [`REUSE_HOLD`] ([`reuse_ip`]): a wrong identity would show there.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use super::churn::{self, Cni, PodId, Pods};
use super::identity::{self, Mtls};
use super::two_node::NODE_B;
use crate::datapath::{Datapath, Serve, connect_in};
use crate::envoy::Envoy;
use crate::identity::IdentityProvider;
use crate::testing::try_wait_for;

/// The namespace the CNI calls name (`K8S_POD_NAMESPACE`), so the pods' SPIFFE IDs'.
pub const POD_NAMESPACE: &str = "churn";
/// Node A's client pods.
pub const CLIENTS: usize = 4;
/// Keep-alive connections per client pod: 52 in all.
pub const KEEPALIVE: usize = 13;
pub const KEEPALIVE_PERIOD: Duration = Duration::from_millis(200);
/// Each client pod opens a new connection for a request this often (16 a second in all).
pub const NEW_CONN_PERIOD: Duration = Duration::from_millis(250);
const SERVICES: usize = 3;
const SERVERS_PER_SERVICE: usize = 2;
/// The capture listeners inside each node's namespace.
const OUTBOUND_PORT: u16 = 15001;
const INBOUND_PORT: u16 = 15006;
const VIPS: &str = "10.96.0.0/16";
/// How long the provider holds the SVID of the pod that takes a reused address.
pub const REUSE_HOLD: Duration = Duration::from_millis(500);
/// Once node A's config shows a pod's outbound chain, its Envoy's workers take the
/// listener update a moment later: a connection accepted within this allowance may still
/// have gone plaintext (permissive).
const ARRIVAL_ALLOWANCE: f64 = 0.1;
/// A pod's new SVIDs must be in its Envoy's `/certs` this long after a rotation.
const ROTATION_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub mode: Mtls,
    /// ARG_MTLS_ROTATIONS (3).
    pub rotations: u32,
    /// ARG_MTLS_IP_REUSES (1).
    pub ip_reuses: u32,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub fn service(i: usize) -> String {
    format!("mtls-{i}")
}

fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, 0, 10 + i as u8)
}

fn client_name(k: usize) -> String {
    format!("client-{k}")
}

fn server_name(i: usize, j: usize) -> String {
    format!("{}-{j}", service(i))
}

/// The capture projection inside a node's namespace.
pub fn capture_json() -> String {
    json!({ "outbound": format!("0.0.0.0:{OUTBOUND_PORT}"), "inbound_port": INBOUND_PORT })
        .to_string()
}

/// A script in `dir` that runs `envoy` inside the namespace `ns` (`ip netns exec` execs
/// it in place, so the child's pid is Envoy's).
pub fn envoy_in(dir: &Path, ns: &str, envoy: &Path) -> Result<PathBuf> {
    let wrapper = dir.join("envoy-in-netns");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec ip netns exec '{ns}' '{}' \"$@\"\n",
            envoy.display()
        ),
    )
    .with_context(|| format!("write {}", wrapper.display()))?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    Ok(wrapper)
}

/// The two nodes' namespaces: node A's client pods, node B's server pods, linked.
pub struct Net {
    pub a: Arc<Datapath>,
    pub b: Datapath,
}

impl Net {
    pub fn create() -> Result<Net> {
        if let Some(why) = crate::datapath::missing() {
            bail!("ARG_MTLS needs network namespaces: {why}");
        }
        let mut a = Datapath::create("ga", [10, 86, 0]).context("node A's namespaces")?;
        for k in 0..CLIENTS {
            a.add_pod(&client_name(k), 10 + k as u8, Serve::Lines)?;
        }
        let mut b = Datapath::create("gb", [10, 87, 0]).context("node B's namespaces")?;
        for i in 0..SERVICES {
            for j in 0..SERVERS_PER_SERVICE {
                b.add_pod(
                    &server_name(i, j),
                    10 + (i * SERVERS_PER_SERVICE + j) as u8,
                    Serve::HttpFrom,
                )?;
            }
        }
        Datapath::link(&mut a, &mut b)?;
        Ok(Net { a: Arc::new(a), b })
    }

    /// The services, each with its VIP and node B's server pods as mTLS endpoints
    /// (`--registry-file` schema).
    pub fn services(&self) -> Vec<Value> {
        (0..SERVICES)
            .map(|i| {
                let endpoints: Vec<Value> = (0..SERVERS_PER_SERVICE)
                    .map(|j| {
                        let name = server_name(i, j);
                        json!({ "address": self.b.pod(&name).ip.to_string(), "port": 80,
                                "node": NODE_B, "pod": name, "mtls": true })
                    })
                    .collect();
                json!({ "name": service(i), "namespace": "default", "ports": [80],
                        "vip": vip(i).to_string(), "endpoints": endpoints })
            })
            .collect()
    }

    /// Node A's redirect to its Envoy's capture listeners (inbound, and outbound for its
    /// pods' calls to the VIPs); node B's inbound.
    pub fn redirect(&self) -> Result<()> {
        self.a
            .redirect(INBOUND_PORT, Some((VIPS, OUTBOUND_PORT)))
            .context("node A's capture redirect")?;
        self.b
            .redirect(INBOUND_PORT, None)
            .context("node B's capture redirect")
    }

    /// Node B's server pods, as the CNI ADDs them.
    pub fn servers(&self) -> Vec<(PodId, Ipv4Addr)> {
        (0..SERVICES)
            .flat_map(|i| (0..SERVERS_PER_SERVICE).map(move |j| server_name(i, j)))
            .map(|name| {
                (
                    PodId {
                        uid: format!("srv-{name}-uid"),
                        name: name.clone(),
                    },
                    self.b.pod(&name).ip,
                )
            })
            .collect()
    }

    /// Server pod name to its address on the pod port, as node B's access log names it.
    fn server_addrs(&self) -> BTreeMap<String, String> {
        self.servers()
            .into_iter()
            .map(|(p, ip)| (p.name, format!("{ip}:80")))
            .collect()
    }
}

/// A client pod's namespace and the pod that currently lives in it.
pub struct Caller {
    /// The namespace's pod name in [`Net::a`].
    pub ns_pod: String,
    pub ip: Ipv4Addr,
    state: Mutex<CallerState>,
}

struct CallerState {
    pod: PodId,
    spiffe_id: String,
    /// Bumped when another pod takes the address: connections of the old one are dropped.
    epoch: u64,
    paused: bool,
    /// Requests in flight.
    active: usize,
}

impl Caller {
    pub fn new(k: usize, net: &Net, provider: &IdentityProvider) -> Caller {
        let ns_pod = client_name(k);
        let pod = PodId {
            uid: format!("cli-{k}-g0-uid"),
            name: format!("client-{k}-g0"),
        };
        Caller {
            ip: net.a.pod(&ns_pod).ip,
            ns_pod,
            state: Mutex::new(CallerState {
                spiffe_id: provider.pod_spiffe_id(POD_NAMESPACE, &pod.name),
                pod,
                epoch: 0,
                paused: false,
                active: 0,
            }),
        }
    }

    pub fn pod(&self) -> PodId {
        self.state.lock().unwrap().pod.clone()
    }
}

/// One answered request.
#[derive(Debug, Clone)]
pub struct Sample {
    pub caller_uid: String,
    pub caller_ip: Ipv4Addr,
    pub expected: String,
    pub server: String,
    /// The address the server pod saw its connection come from.
    pub from: String,
    /// When the answer was read, and when its client connection was opened (Unix s).
    pub at: f64,
    pub conn_opened: f64,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    requests: AtomicU64,
    failures: AtomicU64,
    conns: AtomicU64,
    samples: Mutex<Vec<Sample>>,
    failure_log: Mutex<Vec<String>>,
}

/// The load from node A's client pods.
pub struct Load {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    started: Instant,
}

/// What the load did.
pub struct LoadResult {
    pub requests: u64,
    pub failures: u64,
    pub conns: u64,
    pub samples: Vec<Sample>,
    pub failure_log: Vec<String>,
    pub seconds: f64,
}

impl Load {
    pub fn start(net: Arc<Datapath>, callers: &[Arc<Caller>]) -> Load {
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::new();
        for (k, c) in callers.iter().enumerate() {
            for t in 0..=KEEPALIVE {
                let keep = t < KEEPALIVE;
                let (net, c, shared) = (net.clone(), c.clone(), shared.clone());
                let svc = (k + t) % SERVICES;
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("mtls-{k}-{t}"))
                        .spawn(move || caller_loop(&net, &c, svc, keep, &shared))
                        .expect("spawn an mTLS load thread"),
                );
            }
        }
        Load {
            shared,
            threads,
            started: Instant::now(),
        }
    }

    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    pub fn stop(self) -> LoadResult {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        LoadResult {
            requests: self.shared.requests.load(Ordering::Relaxed),
            failures: self.shared.failures.load(Ordering::Relaxed),
            conns: self.shared.conns.load(Ordering::Relaxed),
            samples: std::mem::take(&mut self.shared.samples.lock().unwrap()),
            failure_log: std::mem::take(&mut self.shared.failure_log.lock().unwrap()),
            seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

struct Open {
    stream: TcpStream,
    epoch: u64,
    opened: f64,
    buf: Vec<u8>,
}

fn caller_loop(net: &Datapath, c: &Caller, svc: usize, keep: bool, shared: &Shared) {
    let period = if keep {
        KEEPALIVE_PERIOD
    } else {
        NEW_CONN_PERIOD
    };
    let host = format!("{}.default", service(svc));
    let target = SocketAddr::from((vip(svc), 80));
    let mut conn: Option<Open> = None;
    // Spread the threads' first requests over a period.
    std::thread::sleep(period.mul_f64(((svc * 7 + usize::from(keep)) % 10) as f64 / 10.0));
    while !shared.stop.load(Ordering::Relaxed) {
        let (pod, expected, epoch) = {
            let mut s = c.state.lock().unwrap();
            if s.paused {
                drop(s);
                conn = None;
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            s.active += 1;
            (s.pod.clone(), s.spiffe_id.clone(), s.epoch)
        };
        let result = request(net, c, target, &host, keep, epoch, &mut conn, shared);
        c.state.lock().unwrap().active -= 1;
        shared.requests.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok((server, from, opened)) => shared.samples.lock().unwrap().push(Sample {
                caller_uid: pod.uid,
                caller_ip: c.ip,
                expected,
                server,
                from,
                at: now(),
                conn_opened: opened,
            }),
            Err(e) => {
                conn = None;
                shared.failures.fetch_add(1, Ordering::Relaxed);
                let mut log = shared.failure_log.lock().unwrap();
                if log.len() < 20 {
                    log.push(format!("{:.3} {} -> {host}: {e}", now(), pod.name));
                }
            }
        }
        std::thread::sleep(period);
    }
}

/// One GET on the thread's connection (opened first when there is none or it belongs to
/// an earlier pod at the address): (server pod, the address it saw, when the connection
/// was opened).
#[allow(clippy::too_many_arguments)]
fn request(
    net: &Datapath,
    c: &Caller,
    target: SocketAddr,
    host: &str,
    keep: bool,
    epoch: u64,
    conn: &mut Option<Open>,
    shared: &Shared,
) -> Result<(String, String, f64), String> {
    if conn.as_ref().is_none_or(|o| o.epoch != epoch) {
        let stream =
            connect_in(&net.pod(&c.ns_pod).ns, target).map_err(|e| format!("connect: {e}"))?;
        shared.conns.fetch_add(1, Ordering::Relaxed);
        *conn = Some(Open {
            stream,
            epoch,
            opened: now(),
            buf: Vec::new(),
        });
    }
    let o = conn.as_mut().expect("just opened");
    let close = if keep { "" } else { "Connection: close\r\n" };
    o.stream
        .write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\n{close}\r\n").as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let (status, closing, body) = read_response(&mut o.stream, &mut o.buf)?;
    let opened = o.opened;
    if closing || !keep {
        *conn = None;
    }
    if status != 200 {
        return Err(format!("status {status}: {body}"));
    }
    let (server, from) = body
        .split_once(" from=")
        .ok_or_else(|| format!("unexpected answer {body:?}"))?;
    Ok((server.to_string(), from.to_string(), opened))
}

/// An HTTP/1.1 response with a content-length: (status, whether the server closes the
/// connection, body).
fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<(u16, bool, String), String> {
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed without an answer".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
    };
    let len: usize = header("content-length:")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let closing = header("connection:").is_some_and(|v| v == "close");
    while buf.len() < head_end + len {
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).map_err(|e| format!("read body: {e}"))?;
        if n == 0 {
            return Err("closed in the body".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + len]).into_owned();
    buf.drain(..head_end + len);
    Ok((status, closing, body))
}

/// Node B's access log, by (upstream local address, pod address): each connection's
/// (start, peer SPIFFE ID, TLS), sorted by start.
pub type AccessLog = BTreeMap<(String, String), Vec<(f64, Option<String>, bool)>>;

pub fn read_access_log(path: &Path) -> Result<AccessLog> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("read node B's access log {}", path.display()))?;
    let mut out: AccessLog = BTreeMap::new();
    let present = |v: &Value| {
        v.as_str()
            .filter(|s| !s.is_empty() && *s != "-")
            .map(str::to_string)
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("node B's access log line {line:?} is not JSON"))?;
        let (Some(local), Some(host)) = (
            present(&v["upstream_local_address"]),
            present(&v["upstream_host"]),
        ) else {
            continue;
        };
        let start: f64 = present(&v["start_time"])
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0);
        out.entry((local, host)).or_default().push((
            start,
            present(&v["peer_uri_san"]),
            present(&v["tls_version"]).is_some(),
        ));
    }
    for v in out.values_mut() {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    }
    Ok(out)
}

/// What the joined requests showed.
#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub joined: u64,
    pub wrong: u64,
    /// Wrong identities by kind: missing, foreign, reused-IP, agent, unjoined.
    pub wrong_kinds: BTreeMap<String, u64>,
    pub wrong_samples: Vec<String>,
    pub plaintext: u64,
    pub plaintext_pods: BTreeSet<String>,
    /// Plaintext on a connection opened after the calling pod's SVID had arrived.
    pub plaintext_after_svid: u64,
    /// Per pod: when the first request presenting its own SVID was answered.
    pub first_presenting: BTreeMap<String, f64>,
}

/// Joins each answered request to node B's log line of its connection and checks the
/// identity there. `arrivals`: when each calling pod's outbound chain showed in node A's
/// config; `previous`: per address, the SPIFFE IDs of the pods that had it before.
pub fn judge(
    samples: &[Sample],
    log: &AccessLog,
    servers: &BTreeMap<String, String>,
    agent_id: &str,
    arrivals: &BTreeMap<String, f64>,
    previous: &BTreeMap<Ipv4Addr, Vec<String>>,
) -> Verdict {
    let mut v = Verdict::default();
    for s in samples {
        let wrong = |kind: &str, what: String, v: &mut Verdict| {
            v.wrong += 1;
            *v.wrong_kinds.entry(kind.to_string()).or_default() += 1;
            if v.wrong_samples.len() < 10 {
                v.wrong_samples.push(format!(
                    "{kind}: {} ({}) -> {} over {}: {what}",
                    s.caller_uid, s.caller_ip, s.server, s.from
                ));
            }
        };
        let Some(pod_addr) = servers.get(&s.server) else {
            wrong("unjoined", "an unknown server answered".into(), &mut v);
            continue;
        };
        let line = log
            .get(&(s.from.clone(), pod_addr.clone()))
            .and_then(|lines| lines.iter().rev().find(|l| l.0 <= s.at + 0.01));
        let Some((_, peer, tls)) = line else {
            wrong(
                "unjoined",
                "no line of node B's access log names the connection".into(),
                &mut v,
            );
            continue;
        };
        v.joined += 1;
        if !tls {
            v.plaintext += 1;
            v.plaintext_pods.insert(s.caller_uid.clone());
            let arrived = arrivals.get(&s.caller_uid).copied();
            if arrived.is_some_and(|t| s.conn_opened > t + ARRIVAL_ALLOWANCE) {
                v.plaintext_after_svid += 1;
            }
            continue;
        }
        match peer.as_deref() {
            Some(p) if p == s.expected => {
                let first = v
                    .first_presenting
                    .entry(s.caller_uid.clone())
                    .or_insert(s.at);
                *first = first.min(s.at);
            }
            None => wrong("missing", "TLS without a peer SPIFFE ID".into(), &mut v),
            Some(p) if p == agent_id => wrong("agent", format!("presented {p}"), &mut v),
            Some(p)
                if previous
                    .get(&s.caller_ip)
                    .is_some_and(|ids| ids.iter().any(|i| i == p)) =>
            {
                wrong("reused-IP", format!("presented {p}"), &mut v)
            }
            Some(p) => wrong("foreign", format!("presented {p}"), &mut v),
        }
    }
    v
}

/// Waits until node A's outbound listener holds the pod's chain (`pod|<uid>`): its SVID
/// arrived there. When that read was made (Unix s), or None by `timeout`.
pub fn wait_chain(envoy: &Envoy, uid: &str, timeout: Duration) -> Option<f64> {
    let needle = format!("\"pod|{uid}\"");
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, dump)) = envoy.get("/config_dump?resource=dynamic_listeners")
            && dump.contains(&needle)
        {
            return Some(now());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One rotation of every pod's SVID (and the agent's), checked: the client pods' new
/// serials in node A's `/certs` and the server pods' in node B's within
/// [`ROTATION_DEADLINE`].
pub fn rotate(provider: &IdentityProvider, envoys: [(&Envoy, &[PodId]); 2]) -> Result<Duration> {
    let start = Instant::now();
    provider.rotate_all();
    for (envoy, pods) in envoys {
        let missing =
            identity::missing_svids(envoy, provider, pods, Instant::now() + ROTATION_DEADLINE)?;
        if !missing.is_empty() {
            bail!(
                "rotation: {} not in its Envoy within {ROTATION_DEADLINE:?}",
                missing.join("; ")
            );
        }
    }
    Ok(start.elapsed())
}

/// A client pod deleted and a new pod added at its address (in its namespace, standing
/// in for the new sandbox), its SVID held by the provider for [`REUSE_HOLD`] after the
/// ADD. Permissive: the new pod calls at once (plaintext until its SVID arrives). Strict:
/// it calls once its outbound chain is in node A's config. Returns (the new pod, when its
/// SVID was released, when its chain showed in node A's config).
pub fn reuse_ip(
    c: &Caller,
    generation: u32,
    mode: Mtls,
    cni: &Cni,
    pods: &Mutex<Pods>,
    provider: &IdentityProvider,
    envoy: &Envoy,
) -> Result<(PodId, f64, f64)> {
    {
        c.state.lock().unwrap().paused = true;
    }
    try_wait_for(
        "the old pod's requests in flight to end",
        Duration::from_secs(10),
        || (c.state.lock().unwrap().active == 0).then_some(()),
    )?;
    let old = c.pod();
    if !churn::del_one(cni, pods, old.clone()) {
        bail!(
            "DEL {} failed: {:?}",
            old.uid,
            pods.lock().unwrap().errors.last()
        );
    }
    let k = c.ns_pod.trim_start_matches("client-");
    let new = PodId {
        uid: format!("cli-{k}-g{generation}-uid"),
        name: format!("client-{k}-g{generation}"),
    };
    provider.hold_pod(&new.uid);
    if !churn::add_pod(cni, pods, &new, c.ip) {
        bail!(
            "ADD {} at {} failed: {:?}",
            new.uid,
            c.ip,
            pods.lock().unwrap().errors.last()
        );
    }
    {
        let mut s = c.state.lock().unwrap();
        s.spiffe_id = provider.pod_spiffe_id(POD_NAMESPACE, &new.name);
        s.pod = new.clone();
        s.epoch += 1;
        s.paused = mode == Mtls::Strict;
    }
    std::thread::sleep(REUSE_HOLD);
    let released = now();
    provider.release_pod(&new.uid);
    let arrived = wait_chain(envoy, &new.uid, Duration::from_secs(10));
    c.state.lock().unwrap().paused = false;
    let arrived = arrived.with_context(|| {
        format!(
            "the new pod {} at {}: its outbound chain never showed in node A's config",
            new.uid, c.ip
        )
    })?;
    Ok((new, released, arrived))
}

/// What a run with ARG_MTLS keeps beside the node: the namespaces (dropped last), the
/// client pods and what the run records for [`finish`].
pub struct Gate {
    pub settings: Settings,
    pub callers: Vec<Arc<Caller>>,
    /// Node B's inbound access log (`--inbound-access-log` of its agents).
    pub access_log: PathBuf,
    /// When each client pod's outbound chain showed in node A's config (Unix s).
    pub arrivals: BTreeMap<String, f64>,
    /// Per client address, the SPIFFE IDs of the pods that had it before.
    pub previous: BTreeMap<Ipv4Addr, Vec<String>>,
    /// Per pod at a reused address, when the provider released its SVID (Unix s).
    pub released: BTreeMap<String, f64>,
    pub report: Report,
    pub net: Net,
}

impl Gate {
    /// After the agents and Envoys serve: the redirects, node B's server pods and node
    /// A's client pods ADDed through the real plugin, their SVIDs in their Envoys, and one
    /// call from each client pod to each service answered.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        settings: Settings,
        net: Net,
        access_log: PathBuf,
        provider: &IdentityProvider,
        (cni_a, pods_a, envoy_a): (&Cni, &Mutex<Pods>, &Envoy),
        (cni_b, pods_b, envoy_b): (&Cni, &Mutex<Pods>, &Envoy),
    ) -> Result<Gate> {
        net.redirect()?;
        let servers = net.servers();
        for (pod, ip) in &servers {
            if !churn::add_pod(cni_b, pods_b, pod, *ip) {
                bail!(
                    "ADD of server pod {} on node B failed: {:?}",
                    pod.uid,
                    pods_b.lock().unwrap().errors.last()
                );
            }
        }
        let callers: Vec<Arc<Caller>> = (0..CLIENTS)
            .map(|k| Arc::new(Caller::new(k, &net, provider)))
            .collect();
        for c in &callers {
            let pod = c.pod();
            if !churn::add_pod(cni_a, pods_a, &pod, c.ip) {
                bail!(
                    "ADD of client pod {} on node A failed: {:?}",
                    pod.uid,
                    pods_a.lock().unwrap().errors.last()
                );
            }
        }
        let server_ids: Vec<PodId> = servers.into_iter().map(|(p, _)| p).collect();
        let missing = identity::missing_svids(
            envoy_b,
            provider,
            &server_ids,
            Instant::now() + Duration::from_secs(15),
        )?;
        if !missing.is_empty() {
            bail!("node B's server pods: {}", missing.join("; "));
        }
        let mut arrivals = BTreeMap::new();
        for c in &callers {
            let uid = c.pod().uid;
            let at = wait_chain(envoy_a, &uid, Duration::from_secs(15)).with_context(|| {
                format!("client pod {uid}: its outbound chain never showed in node A's config")
            })?;
            arrivals.insert(uid, at);
        }
        for c in &callers {
            for i in 0..SERVICES {
                let addr = SocketAddr::from((vip(i), 80));
                let host = format!("{}.default", service(i));
                let mut last = String::new();
                try_wait_for(
                    &format!("{} to call {host} through both Envoys", c.ns_pod),
                    Duration::from_secs(20),
                    || match crate::datapath::http_get_in(&net.a.pod(&c.ns_pod).ns, addr, &host) {
                        Ok((200, body)) if body.contains(" from=") => Some(()),
                        other => {
                            last = format!("{other:?}");
                            std::thread::sleep(Duration::from_millis(50));
                            None
                        }
                    },
                )
                .with_context(|| format!("last answer: {last}"))?;
            }
        }
        Ok(Gate {
            settings,
            callers,
            access_log,
            arrivals,
            previous: BTreeMap::new(),
            released: BTreeMap::new(),
            report: Report {
                mode: Some(settings.mode),
                rotations_wanted: settings.rotations,
                ip_reuses_wanted: settings.ip_reuses,
                ..Report::default()
            },
            net,
        })
    }

    /// The client pods now living, and node B's server pods.
    pub fn pods(&self) -> (Vec<PodId>, Vec<PodId>) {
        (
            self.callers.iter().map(|c| c.pod()).collect(),
            self.net.servers().into_iter().map(|(p, _)| p).collect(),
        )
    }

    /// One IP reuse ([`reuse_ip`]) of the next client pod's address, recorded.
    pub fn reuse(
        &mut self,
        cni: &Cni,
        pods: &Mutex<Pods>,
        provider: &IdentityProvider,
        envoy: &Envoy,
    ) -> Result<()> {
        let n = self.report.ip_reuses as usize;
        let c = self.callers[n % self.callers.len()].clone();
        let (old_id, old_uid) = {
            let s = c.state.lock().unwrap();
            (s.spiffe_id.clone(), s.pod.uid.clone())
        };
        let (new, released, arrived) = reuse_ip(
            &c,
            n as u32 + 1,
            self.settings.mode,
            cni,
            pods,
            provider,
            envoy,
        )?;
        self.previous.entry(c.ip).or_default().push(old_id);
        self.arrivals.insert(new.uid.clone(), arrived);
        self.released.insert(new.uid.clone(), released);
        self.report.ip_reuses += 1;
        eprintln!(
            "   mTLS: IP reuse {}: {old_uid} deleted, {} added at {}; its SVID released {:.0} ms after, its outbound chain in node A's config {:.0} ms after the release",
            self.report.ip_reuses,
            new.uid,
            c.ip,
            REUSE_HOLD.as_secs_f64() * 1000.0,
            (arrived - released) * 1000.0
        );
        Ok(())
    }
}

/// The mTLS part of a run's result.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub mode: Option<Mtls>,
    pub requests: u64,
    pub failed: u64,
    pub conns: u64,
    pub seconds: f64,
    pub verdict: Verdict,
    pub rotations: u32,
    pub rotations_wanted: u32,
    pub rotation_s: Vec<f64>,
    pub ip_reuses: u32,
    pub ip_reuses_wanted: u32,
    /// Per new pod at a reused address: from its SVID's release to the first answered
    /// request that presented it (s).
    pub svid_to_first_mtls: Vec<f64>,
    pub peer_rolls: usize,
    /// Node B's rolls: from its Envoy's stream end (about the SIGTERM or SIGKILL) to its
    /// first update from the new owner.
    pub peer_windows: Vec<(Instant, Instant)>,
    /// The worker crashes' gaps, node A's then node B's (s).
    pub crash_gaps: Vec<f64>,
    pub crash_bound: f64,
    pub failure_log: Vec<String>,
    pub errors: Vec<String>,
}

impl Report {
    pub fn failures(&self) -> Vec<String> {
        let mut f = self.errors.clone();
        let v = &self.verdict;
        if self.requests == 0 || v.joined == 0 {
            f.push(format!(
                "mTLS: {} requests, {} joined to node B's access log",
                self.requests, v.joined
            ));
        }
        if self.failed > 0 {
            f.push(format!(
                "mtls_failed {} of {} (first: {})",
                self.failed,
                self.requests,
                self.failure_log.first().map_or("", String::as_str)
            ));
        }
        if v.wrong > 0 {
            f.push(format!(
                "mtls_wrong_identity {} {:?} (first: {})",
                v.wrong,
                v.wrong_kinds,
                v.wrong_samples.first().map_or("", String::as_str)
            ));
        }
        match self.mode {
            Some(Mtls::Strict) if v.plaintext > 0 => f.push(format!(
                "strict: mtls_plaintext {} from {:?}",
                v.plaintext, v.plaintext_pods
            )),
            Some(Mtls::Permissive) if v.plaintext_after_svid > 0 => f.push(format!(
                "permissive: {} plaintext requests on connections opened after the pod's SVID had arrived",
                v.plaintext_after_svid
            )),
            _ => {}
        }
        if self.rotations < self.rotations_wanted {
            f.push(format!(
                "{} of {} rotations done",
                self.rotations, self.rotations_wanted
            ));
        }
        if self.ip_reuses < self.ip_reuses_wanted {
            f.push(format!(
                "{} of {} IP reuses done",
                self.ip_reuses, self.ip_reuses_wanted
            ));
        }
        for g in &self.crash_gaps {
            if *g > self.crash_bound {
                f.push(format!(
                    "a worker crash's gap {g:.3} s exceeds {:.3} s",
                    self.crash_bound
                ));
            }
        }
        f
    }

    pub fn json(&self) -> Value {
        let v = &self.verdict;
        let r = |x: f64| (x * 1e6).round() / 1e6;
        let first = super::report::summarize(&self.svid_to_first_mtls);
        json!({
            "mtls": self.mode.map(Mtls::name),
            "mtls_requests": self.requests,
            "mtls_failed": self.failed,
            "mtls_wrong_identity": v.wrong,
            "mtls_wrong_identity_kinds": v.wrong_kinds,
            "mtls_plaintext": v.plaintext,
            "mtls_plaintext_pods": v.plaintext_pods,
            "mtls_plaintext_after_svid": v.plaintext_after_svid,
            "mtls_rotations": self.rotations,
            "mtls_ip_reuses": self.ip_reuses,
            "mtls_joined": v.joined,
            "mtls_connections_opened": self.conns,
            "mtls_keepalive_connections": CLIENTS * KEEPALIVE,
            "mtls_rps": if self.seconds > 0.0 { r(self.requests as f64 / self.seconds) } else { 0.0 },
            "mtls_peer_rolls": self.peer_rolls,
            "mtls_worker_crash_gaps_s": self.crash_gaps.iter().map(|g| r(*g)).collect::<Vec<_>>(),
            "mtls_svid_to_first_mtls_samples": first.n,
            "mtls_svid_to_first_mtls_p99_s": (first.n > 0).then(|| r(first.p99)),
            "mtls_svid_to_first_mtls_max_s": (first.n > 0).then(|| r(first.max)),
            "mtls_rotation_in_envoys_max_s": self.rotation_s.iter().copied().fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))).map(r),
        })
    }
}

/// Fills the report from the load and node B's access log.
#[allow(clippy::too_many_arguments)]
pub fn finish(
    report: &mut Report,
    load: LoadResult,
    log_path: &Path,
    net: &Net,
    agent_id: &str,
    arrivals: &BTreeMap<String, f64>,
    previous: &BTreeMap<Ipv4Addr, Vec<String>>,
    released: &BTreeMap<String, f64>,
) {
    report.requests = load.requests;
    report.failed = load.failures;
    report.conns = load.conns;
    report.seconds = load.seconds;
    report.failure_log = load.failure_log;
    // Envoy flushes its access log every 100 ms (the harness's --file-flush-interval-msec).
    std::thread::sleep(Duration::from_millis(500));
    match read_access_log(log_path) {
        Ok(log) => {
            report.verdict = judge(
                &load.samples,
                &log,
                &net.server_addrs(),
                agent_id,
                arrivals,
                previous,
            );
            for (uid, at) in released {
                match report.verdict.first_presenting.get(uid) {
                    Some(first) => report.svid_to_first_mtls.push(first - at),
                    None => report.errors.push(format!(
                        "the pod {uid} at a reused address never answered presenting its own SVID"
                    )),
                }
            }
        }
        Err(e) => report.errors.push(format!("{e:#}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(from: &str, at: f64, expected: &str) -> Sample {
        Sample {
            caller_uid: "u1".into(),
            caller_ip: Ipv4Addr::new(10, 86, 0, 10),
            expected: expected.into(),
            server: "mtls-0-0".into(),
            from: from.into(),
            at,
            conn_opened: at - 1.0,
        }
    }

    /// Each request is judged by the log line of its own connection: the latest that
    /// started before its answer, on the same pair of addresses.
    #[test]
    fn requests_are_judged_by_their_own_connections_line() {
        let servers = BTreeMap::from([("mtls-0-0".to_string(), "10.87.0.10:80".to_string())]);
        let key = ("10.87.0.1:40000".to_string(), "10.87.0.10:80".to_string());
        let log: AccessLog = BTreeMap::from([(
            key,
            vec![
                (100.0, Some("spiffe://t/ns/churn/pod/old".into()), true),
                (200.0, Some("spiffe://t/ns/churn/pod/new".into()), true),
                (300.0, None, false),
            ],
        )]);
        let previous = BTreeMap::from([(
            Ipv4Addr::new(10, 86, 0, 10),
            vec!["spiffe://t/ns/churn/pod/old".to_string()],
        )]);
        let new = "spiffe://t/ns/churn/pod/new";
        let check = |samples: Vec<Sample>| {
            judge(
                &samples,
                &log,
                &servers,
                "spiffe://t/agent",
                &BTreeMap::new(),
                &previous,
            )
        };
        let v = check(vec![sample("10.87.0.1:40000", 250.0, new)]);
        assert_eq!((v.joined, v.wrong, v.plaintext), (1, 0, 0));
        let v = check(vec![sample("10.87.0.1:40000", 150.0, new)]);
        assert_eq!(
            v.wrong_kinds,
            BTreeMap::from([("reused-IP".to_string(), 1)])
        );
        let v = check(vec![sample("10.87.0.1:40000", 350.0, new)]);
        assert_eq!((v.plaintext, v.wrong), (1, 0));
        let v = check(vec![sample("10.87.0.1:40001", 250.0, new)]);
        assert_eq!(v.wrong_kinds, BTreeMap::from([("unjoined".to_string(), 1)]));
        let v = check(vec![sample(
            "10.87.0.1:40000",
            250.0,
            "spiffe://t/ns/churn/pod/x",
        )]);
        assert_eq!(v.wrong_kinds, BTreeMap::from([("foreign".to_string(), 1)]));
    }
}
