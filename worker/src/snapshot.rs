//! The snapshot model: a pure function from inputs to the resources the proxy is served.
//!
//! No protobuf types here; the xDS adapter converts at the boundary. Versions are content
//! hashes per resource type, so the same inputs always give the same versions and a
//! reconnect to an identical snapshot is a no-op for Envoy.
//!
//! What is built from what:
//! - one outbound HTTP listener (`outbound`) on the capture projection's outbound address,
//!   routing through the route configuration `outbound` (RDS);
//! - one virtual host per registry service, matching `name`, `name.namespace`,
//!   `name.namespace.svc.cluster.local`, each of those with `:port`, and `VIP:port`;
//!   a request whose `:authority` ends in `:port` goes to that port's cluster, any other
//!   to the service's first port;
//! - one EDS cluster per service port, `outbound|<port>||<name>.<namespace>`, and its load
//!   assignment, with draining endpoints marked DRAINING;
//! - while any local pod is served, the inbound capture listener `inbound` on the inbound
//!   capture port: it restores each redirected connection's original destination and hands
//!   it to the listener bound (virtually) to that address; what no pod listener takes ends
//!   in a filter chain with no cluster, which closes it;
//! - per local pod a virtual listener `inbound|<pod uid>` on the pod's IPs and
//!   [`INBOUND_TARGET_PORT`] (`bind_to_port: false`), whose one filter chain matches the
//!   pod's IPs as /32 (/128) prefixes and proxies TCP to the STATIC cluster
//!   `inbound|<pod uid>` (the pod's IPs on [`INBOUND_TARGET_PORT`]).
//!
//! Why a listener per pod rather than one filter chain per pod on the capture listener:
//! in state of the world every LDS response carries every listener, and Envoy rebuilds a
//! changed listener's whole filter chain manager (match tables and tries over every
//! chain) even for an in-place update. With one chain per pod on one listener, each ADD
//! cost Envoy time proportional to the pods on the node (about 45 ms at 280 pods,
//! measured from Envoy's debug log), which the CNI ADD waits for. Listeners that did not
//! change are only hashed and skipped, so with one per pod an ADD adds one small listener.
//!
//! Deliberate choices where inputs conflict, so that a realistic registry never produces
//! a snapshot the proxy rejects:
//! - A short name (`name`, `name:port`) claimed by services in two namespaces is ambiguous
//!   on a node-wide listener and is dropped from both; the qualified forms stay.
//! - A pod IP claimed by two local pods (a missed CNI DEL, then IP reuse) is served for
//!   neither, and the conflict is recorded in [`Snapshot::rejects`]: Envoy would reject
//!   the whole LDS update for two listeners on the same address.
//! - A `VIP:port` claimed by two services is passed through unchanged: which service owns
//!   it is the registry's call, not the builder's. Envoy NACKs that route configuration and
//!   keeps its last good one; the xDS tests use this as their injected bad resource.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::capture::CaptureProjection;
use crate::registry::{EndpointState, RegistryView};

/// The port inbound traffic to a pod is proxied to. Pods carry no port list yet, so the
/// inbound cluster targets one well-known application port.
pub const INBOUND_TARGET_PORT: u16 = 80;
/// The name of the outbound HTTP listener and of its route configuration.
pub const OUTBOUND: &str = "outbound";
/// The name of the inbound capture listener.
pub const INBOUND: &str = "inbound";
/// The cluster the capture listener's catch-all chain names. No such cluster is ever
/// served, so a redirected connection that no pod listener takes is closed.
pub const INBOUND_BLACKHOLE: &str = "inbound|blackhole";

/// A pod on this node, as the CNI plugin reported it and storage keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    pub ips: Vec<IpAddr>,
}

/// Everything a snapshot is built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Inputs {
    /// Local pods keyed by pod uid.
    pub pods: BTreeMap<String, Pod>,
    pub registry: RegistryView,
    pub capture: CaptureProjection,
}

/// The resources of one type, keyed by resource name, with the content hash of each and
/// the version of them all (a hash over the names and those hashes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resources<T> {
    pub version: String,
    pub items: BTreeMap<String, T>,
    /// Content hash of each item, by name: lets the xDS adapter send only what changed
    /// for the types requested by name (EDS, RDS).
    pub hashes: BTreeMap<String, u64>,
}

impl<T: Serialize> Resources<T> {
    fn new(items: BTreeMap<String, T>) -> Self {
        let hashes: BTreeMap<String, u64> = items.iter().map(|(k, v)| (k.clone(), content_hash(v))).collect();
        let mut all = Fnv::new();
        for (name, h) in &hashes {
            all.write(name.as_bytes());
            all.write(&[0]);
            all.write(&h.to_le_bytes());
        }
        Self { version: format!("{:016x}", all.0), items, hashes }
    }
}

impl<T: Serialize> Default for Resources<T> {
    fn default() -> Self {
        Self::new(BTreeMap::new())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Listener {
    pub name: String,
    pub address: SocketAddr,
    pub kind: ListenerKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ListenerKind {
    /// HTTP connection manager whose routes come over RDS.
    HttpOutbound { route_config: String },
    /// The inbound capture listener: hands each redirected connection to the listener of
    /// its original destination; closes the rest.
    InboundCapture,
    /// A local pod's virtual listener (not bound; reached through the capture listener),
    /// on the pod's IPs and [`INBOUND_TARGET_PORT`]: `address` is the first IP, the
    /// chain holds them all.
    InboundPod { chain: InboundChain },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InboundChain {
    pub pod_uid: String,
    /// Matched as host prefixes (/32 or /128). Never empty: an empty match would take
    /// every connection.
    pub ips: Vec<IpAddr>,
    pub cluster: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteConfig {
    pub name: String,
    pub virtual_hosts: Vec<VirtualHost>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VirtualHost {
    pub name: String,
    pub domains: Vec<String>,
    pub routes: Vec<Route>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    /// `Some(p)`: only requests whose `:authority` ends in `:p`. `None`: every request.
    pub authority_port: Option<u16>,
    pub cluster: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cluster {
    pub name: String,
    pub kind: ClusterKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ClusterKind {
    /// Endpoints come over EDS under the cluster's own name.
    Eds,
    /// Endpoints are part of the cluster.
    Static { endpoints: Vec<SocketAddr> },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoadAssignment {
    pub cluster: String,
    pub endpoints: Vec<LbEndpoint>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LbEndpoint {
    pub address: SocketAddr,
    pub draining: bool,
}

/// The resources served to the proxy, with one content-hash version per type.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub listeners: Resources<Listener>,
    pub routes: Resources<RouteConfig>,
    pub clusters: Resources<Cluster>,
    pub endpoints: Resources<LoadAssignment>,
    /// Inputs the builder left out, one sentence each, for logs.
    pub rejects: Vec<String>,
}

impl Snapshot {
    /// Whether this snapshot serves the pod (its inbound filter chain and cluster).
    pub fn holds_pod(&self, uid: &str, ips: &[IpAddr]) -> bool {
        if ips.is_empty() {
            return false;
        }
        let cluster = inbound_cluster_name(uid);
        let capture_ok = self.listeners.items.get(INBOUND).is_some_and(|l| l.kind == ListenerKind::InboundCapture);
        let chain_ok = self.listeners.items.get(&inbound_listener_name(uid)).is_some_and(|l| match &l.kind {
            ListenerKind::InboundPod { chain: c } => c.pod_uid == uid && c.cluster == cluster && same_set(&c.ips, ips),
            _ => false,
        });
        let cluster_ok = self.clusters.items.get(&cluster).is_some_and(|c| match &c.kind {
            ClusterKind::Static { endpoints } => ips.iter().all(|ip| endpoints.iter().any(|e| e.ip() == *ip)),
            ClusterKind::Eds => false,
        });
        capture_ok && chain_ok && cluster_ok
    }

    /// The names of the EDS clusters: what a proxy holding this snapshot asks EDS for.
    pub fn eds_cluster_names(&self) -> impl Iterator<Item = &str> {
        self.clusters.items.values().filter(|c| c.kind == ClusterKind::Eds).map(|c| c.name.as_str())
    }

    /// The route configurations the listeners refer to: what the proxy asks RDS for.
    pub fn rds_names(&self) -> impl Iterator<Item = &str> {
        self.listeners.items.values().filter_map(|l| match &l.kind {
            ListenerKind::HttpOutbound { route_config } => Some(route_config.as_str()),
            ListenerKind::InboundCapture | ListenerKind::InboundPod { .. } => None,
        })
    }
}

fn same_set(a: &[IpAddr], b: &[IpAddr]) -> bool {
    a.iter().collect::<BTreeSet<_>>() == b.iter().collect::<BTreeSet<_>>()
}

pub fn outbound_cluster_name(port: u16, name: &str, namespace: &str) -> String {
    format!("outbound|{port}||{name}.{namespace}")
}

pub fn inbound_cluster_name(uid: &str) -> String {
    format!("inbound|{uid}")
}

/// The name of a local pod's virtual inbound listener (a listener and a cluster may share
/// a name: they are different resource types).
pub fn inbound_listener_name(uid: &str) -> String {
    format!("inbound|{uid}")
}

/// Builds the snapshot. Pure: no I/O, no clock, no randomness.
pub fn build(inputs: &Inputs) -> Snapshot {
    let mut rejects = Vec::new();
    let mut listeners = BTreeMap::new();
    let mut routes = BTreeMap::new();
    let mut clusters = BTreeMap::new();
    let mut endpoints = BTreeMap::new();

    listeners.insert(
        OUTBOUND.to_string(),
        Listener {
            name: OUTBOUND.to_string(),
            address: inputs.capture.outbound,
            kind: ListenerKind::HttpOutbound { route_config: OUTBOUND.to_string() },
        },
    );

    // Short names are namespace-relative; on a node-wide listener one claimed by two
    // namespaces is ambiguous.
    let mut short_claims: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in &inputs.registry.services {
        short_claims.entry(&s.name).or_default().insert(&s.namespace);
    }

    let mut virtual_hosts = Vec::new();
    for s in &inputs.registry.services {
        let qualified = format!("{}.{}", s.name, s.namespace);
        let mut hosts = Vec::new();
        if short_claims.get(s.name.as_str()).is_some_and(|ns| ns.len() == 1) {
            hosts.push(s.name.clone());
        }
        hosts.push(qualified.clone());
        hosts.push(format!("{qualified}.svc.cluster.local"));

        let mut domains = Vec::new();
        let mut seen = BTreeSet::new();
        let mut push = |d: String| {
            if seen.insert(d.clone()) {
                domains.push(d);
            }
        };
        for h in &hosts {
            push(h.clone());
        }
        for port in &s.ports {
            for h in &hosts {
                push(format!("{h}:{port}"));
            }
            if let Some(vip) = s.vip {
                push(SocketAddr::new(vip, *port).to_string());
            }
        }

        let mut vroutes = Vec::new();
        for port in s.ports.iter().skip(1) {
            vroutes.push(Route { authority_port: Some(*port), cluster: outbound_cluster_name(*port, &s.name, &s.namespace) });
        }
        if let Some(first) = s.ports.first() {
            vroutes.push(Route { authority_port: None, cluster: outbound_cluster_name(*first, &s.name, &s.namespace) });
        }
        virtual_hosts.push(VirtualHost { name: qualified, domains, routes: vroutes });

        for port in &s.ports {
            let name = outbound_cluster_name(*port, &s.name, &s.namespace);
            clusters.insert(name.clone(), Cluster { name: name.clone(), kind: ClusterKind::Eds });
            let lb = s
                .endpoints
                .iter()
                .filter(|e| e.service_port == *port)
                .map(|e| LbEndpoint {
                    address: SocketAddr::new(e.address, e.port),
                    draining: e.state == EndpointState::Draining,
                })
                .collect();
            endpoints.insert(name.clone(), LoadAssignment { cluster: name, endpoints: lb });
        }
    }
    routes.insert(OUTBOUND.to_string(), RouteConfig { name: OUTBOUND.to_string(), virtual_hosts });

    // Inbound: each pod IP to exactly one pod.
    let mut ip_claims: BTreeMap<IpAddr, Vec<&str>> = BTreeMap::new();
    for pod in inputs.pods.values() {
        for ip in pod.ips.iter().collect::<BTreeSet<_>>() {
            ip_claims.entry(*ip).or_default().push(&pod.uid);
        }
    }
    for (ip, uids) in &ip_claims {
        if uids.len() > 1 {
            rejects.push(format!("pod IP {ip} is claimed by pods {}; served for none of them", uids.join(", ")));
        }
    }
    let mut any_pod = false;
    for (uid, pod) in &inputs.pods {
        let ips: Vec<IpAddr> = pod
            .ips
            .iter()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .filter(|ip| ip_claims.get(ip).is_some_and(|c| c.len() == 1))
            .copied()
            .collect();
        if ips.is_empty() {
            continue;
        }
        let cluster = inbound_cluster_name(uid);
        clusters.insert(
            cluster.clone(),
            Cluster {
                name: cluster.clone(),
                kind: ClusterKind::Static {
                    endpoints: ips.iter().map(|ip| SocketAddr::new(*ip, INBOUND_TARGET_PORT)).collect(),
                },
            },
        );
        let name = inbound_listener_name(uid);
        listeners.insert(
            name.clone(),
            Listener {
                name,
                address: SocketAddr::new(ips[0], INBOUND_TARGET_PORT),
                kind: ListenerKind::InboundPod { chain: InboundChain { pod_uid: uid.clone(), ips, cluster } },
            },
        );
        any_pod = true;
    }
    if any_pod {
        listeners.insert(
            INBOUND.to_string(),
            Listener {
                name: INBOUND.to_string(),
                address: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), inputs.capture.inbound_port),
                kind: ListenerKind::InboundCapture,
            },
        );
    }

    Snapshot {
        listeners: Resources::new(listeners),
        routes: Resources::new(routes),
        clusters: Resources::new(clusters),
        endpoints: Resources::new(endpoints),
        rejects,
    }
}

/// FNV-1a 64 over the canonical JSON of a resource. Stable across Rust releases and runs
/// (unlike `DefaultHasher`): two agents of different builds agree on versions, which is
/// what makes a takeover to an identical snapshot a no-op for Envoy.
fn content_hash<T: Serialize>(item: &T) -> u64 {
    let mut h = Fnv::new();
    // Serializing plain data into a writer that cannot fail cannot fail.
    serde_json::to_writer(&mut h, item).expect("model types serialize");
    h.0
}

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.write(bytes);
    h.0
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl std::io::Write for Fnv {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Fnv::write(self, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Endpoint, Service};

    fn svc(name: &str, ns: &str, ports: &[u16], vip: Option<&str>, eps: &[(&str, u16, u16, bool)]) -> Service {
        Service {
            name: name.into(),
            namespace: ns.into(),
            ports: ports.to_vec(),
            vip: vip.map(|v| v.parse().unwrap()),
            endpoints: eps
                .iter()
                .map(|(a, p, sp, draining)| Endpoint {
                    address: a.parse().unwrap(),
                    port: *p,
                    service_port: *sp,
                    node: "n1".into(),
                    pod: "p".into(),
                    state: if *draining { EndpointState::Draining } else { EndpointState::Healthy },
                })
                .collect(),
        }
    }

    fn pod(uid: &str, ips: &[&str]) -> Pod {
        Pod {
            uid: uid.into(),
            namespace: "default".into(),
            name: format!("pod-{uid}"),
            container_id: "c".into(),
            netns: "/proc/1/ns/net".into(),
            ifname: "eth0".into(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        }
    }

    fn inputs(services: Vec<Service>, pods: Vec<Pod>) -> Inputs {
        Inputs {
            pods: pods.into_iter().map(|p| (p.uid.clone(), p)).collect(),
            registry: RegistryView { services },
            capture: CaptureProjection::default(),
        }
    }

    /// A compact, readable rendering of a snapshot: one line per resource fact.
    fn render(s: &Snapshot) -> String {
        let mut out = Vec::new();
        for l in s.listeners.items.values() {
            match &l.kind {
                ListenerKind::HttpOutbound { route_config } => out.push(format!("L {} {} rds={route_config}", l.name, l.address)),
                ListenerKind::InboundCapture => out.push(format!("L {} {} capture", l.name, l.address)),
                ListenerKind::InboundPod { chain: c } => {
                    let ips: Vec<_> = c.ips.iter().map(|i| i.to_string()).collect();
                    out.push(format!("L {} {} chain {} [{}] -> {}", l.name, l.address, c.pod_uid, ips.join(","), c.cluster));
                }
            }
        }
        for r in s.routes.items.values() {
            for v in &r.virtual_hosts {
                out.push(format!("R {} vh {} [{}]", r.name, v.name, v.domains.join(",")));
                for rt in &v.routes {
                    out.push(format!("R {} vh {} {:?} -> {}", r.name, v.name, rt.authority_port, rt.cluster));
                }
            }
        }
        for c in s.clusters.items.values() {
            match &c.kind {
                ClusterKind::Eds => out.push(format!("C {} eds", c.name)),
                ClusterKind::Static { endpoints } => {
                    let e: Vec<_> = endpoints.iter().map(|e| e.to_string()).collect();
                    out.push(format!("C {} static [{}]", c.name, e.join(",")))
                }
            }
        }
        for a in s.endpoints.items.values() {
            let e: Vec<_> =
                a.endpoints.iter().map(|e| format!("{}{}", e.address, if e.draining { " DRAINING" } else { "" })).collect();
            out.push(format!("E {} [{}]", a.cluster, e.join(",")));
        }
        for r in &s.rejects {
            out.push(format!("! {r}"));
        }
        out.join("\n")
    }

    fn check(input: Inputs, expected: &str) {
        let got = render(&build(&input));
        let want: Vec<&str> = expected.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
        assert_eq!(got, want.join("\n"), "\n--- got ---\n{got}\n");
    }

    #[test]
    fn empty_inputs_give_only_the_outbound_listener_and_route() {
        check(
            inputs(vec![], vec![]),
            "L outbound 127.0.0.1:15001 rds=outbound",
        );
    }

    #[test]
    fn one_service_two_ports_with_vip_and_a_draining_endpoint() {
        check(
            inputs(
                vec![svc("web", "default", &[80, 8080], Some("10.96.0.10"), &[
                    ("10.0.0.1", 8000, 80, false),
                    ("10.0.0.2", 8000, 80, true),
                    ("10.0.0.1", 9000, 8080, false),
                ])],
                vec![],
            ),
            "
            L outbound 127.0.0.1:15001 rds=outbound
            R outbound vh web.default [web,web.default,web.default.svc.cluster.local,web:80,web.default:80,web.default.svc.cluster.local:80,10.96.0.10:80,web:8080,web.default:8080,web.default.svc.cluster.local:8080,10.96.0.10:8080]
            R outbound vh web.default Some(8080) -> outbound|8080||web.default
            R outbound vh web.default None -> outbound|80||web.default
            C outbound|8080||web.default eds
            C outbound|80||web.default eds
            E outbound|8080||web.default [10.0.0.1:9000]
            E outbound|80||web.default [10.0.0.1:8000,10.0.0.2:8000 DRAINING]
            ",
        );
    }

    #[test]
    fn short_name_in_two_namespaces_is_dropped_from_both() {
        check(
            inputs(vec![svc("api", "a", &[80], None, &[]), svc("api", "b", &[80], None, &[])], vec![]),
            "
            L outbound 127.0.0.1:15001 rds=outbound
            R outbound vh api.a [api.a,api.a.svc.cluster.local,api.a:80,api.a.svc.cluster.local:80]
            R outbound vh api.a None -> outbound|80||api.a
            R outbound vh api.b [api.b,api.b.svc.cluster.local,api.b:80,api.b.svc.cluster.local:80]
            R outbound vh api.b None -> outbound|80||api.b
            C outbound|80||api.a eds
            C outbound|80||api.b eds
            E outbound|80||api.a []
            E outbound|80||api.b []
            ",
        );
    }

    #[test]
    fn local_pods_get_inbound_chains_and_static_clusters() {
        check(
            inputs(vec![], vec![pod("u1", &["10.1.0.5"]), pod("u2", &["10.1.0.6", "fd00::6"])]),
            "
            L inbound 0.0.0.0:15006 capture
            L inbound|u1 10.1.0.5:80 chain u1 [10.1.0.5] -> inbound|u1
            L inbound|u2 10.1.0.6:80 chain u2 [10.1.0.6,fd00::6] -> inbound|u2
            L outbound 127.0.0.1:15001 rds=outbound
            C inbound|u1 static [10.1.0.5:80]
            C inbound|u2 static [10.1.0.6:80,[fd00::6]:80]
            ",
        );
    }

    #[test]
    fn a_pod_ip_claimed_twice_is_served_for_neither() {
        check(
            inputs(vec![], vec![pod("u1", &["10.1.0.5"]), pod("u2", &["10.1.0.5", "10.1.0.7"]), pod("u3", &[])]),
            "
            L inbound 0.0.0.0:15006 capture
            L inbound|u2 10.1.0.7:80 chain u2 [10.1.0.7] -> inbound|u2
            L outbound 127.0.0.1:15001 rds=outbound
            C inbound|u2 static [10.1.0.7:80]
            ! pod IP 10.1.0.5 is claimed by pods u1, u2; served for none of them
            ",
        );
    }

    #[test]
    fn holds_pod_needs_chain_and_cluster_with_the_same_ips() {
        let s = build(&inputs(vec![], vec![pod("u1", &["10.1.0.5", "10.1.0.6"])]));
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(s.holds_pod("u1", &[ip("10.1.0.6"), ip("10.1.0.5")]));
        assert!(!s.holds_pod("u1", &[ip("10.1.0.5")]));
        assert!(!s.holds_pod("u2", &[ip("10.1.0.5")]));
        assert!(!s.holds_pod("u1", &[]));
        assert!(!build(&inputs(vec![], vec![])).holds_pod("u1", &[ip("10.1.0.5")]));
    }

    #[test]
    fn versions_are_deterministic_and_change_only_for_the_changed_type() {
        let base = inputs(vec![svc("web", "default", &[80], None, &[("10.0.0.1", 80, 80, false)])], vec![]);
        let a = build(&base);
        assert_eq!(a, build(&base.clone()));
        // Pinned: a change here changes every version a running Envoy holds, so a rolled
        // agent would push a full update instead of a no-op. Change it deliberately.
        assert_eq!(
            [&a.listeners.version, &a.routes.version, &a.clusters.version, &a.endpoints.version],
            ["546b037b656f980c", "6a22535df4155941", "ded4fae22f691cd8", "5c261e5ed4702cea"]
        );

        // Endpoint change: only EDS.
        let mut b_in = base.clone();
        b_in.registry.services[0].endpoints[0].state = EndpointState::Draining;
        let b = build(&b_in);
        assert_eq!((a.listeners.version == b.listeners.version, a.routes.version == b.routes.version), (true, true));
        assert_eq!(a.clusters.version, b.clusters.version);
        assert_ne!(a.endpoints.version, b.endpoints.version);

        // VIP: only RDS.
        let mut c_in = base.clone();
        c_in.registry.services[0].vip = Some("10.96.0.1".parse().unwrap());
        let c = build(&c_in);
        assert_ne!(a.routes.version, c.routes.version);
        assert_eq!((a.listeners.version.clone(), a.clusters.version.clone(), a.endpoints.version.clone()),
                   (c.listeners.version, c.clusters.version, c.endpoints.version));

        // Pod: LDS and CDS, not RDS or EDS.
        let mut d_in = base.clone();
        d_in.pods.insert("u1".into(), pod("u1", &["10.1.0.5"]));
        let d = build(&d_in);
        assert_ne!(a.listeners.version, d.listeners.version);
        assert_ne!(a.clusters.version, d.clusters.version);
        assert_eq!((a.routes.version.clone(), a.endpoints.version.clone()), (d.routes.version, d.endpoints.version));

        // Capture port: LDS only.
        let mut e_in = base.clone();
        e_in.capture.outbound = "127.0.0.1:16001".parse().unwrap();
        let e = build(&e_in);
        assert_ne!(a.listeners.version, e.listeners.version);
        assert_eq!((a.routes.version.clone(), a.clusters.version.clone(), a.endpoints.version.clone()),
                   (e.routes.version, e.clusters.version, e.endpoints.version));
    }

    #[test]
    fn fnv1a64_matches_the_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
