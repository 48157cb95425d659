//! The snapshot builder: pure, incremental, and checked against a build from scratch.
//!
//! [`Builder::new`] builds everything from the inputs; [`Builder::apply`] takes
//! [`Change`]s and rebuilds only what they touch: a service's virtual host, clusters and
//! load assignments, a pod's listener and cluster. A service whose endpoints changed
//! rebuilds its load assignments and nothing else; the outbound route is rebuilt only
//! when a virtual host changed. Both paths produce the same resources and versions
//! (the property tests below check it).
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
//!   `inbound|<pod uid>` (the pod's IPs on [`INBOUND_TARGET_PORT`]), whose endpoints are
//!   DRAINING while the pod is terminating (it has a deletion timestamp).
//!
//! Why a listener per pod rather than one filter chain per pod on the capture listener:
//! in state of the world every LDS response carries every listener, and Envoy rebuilds a
//! changed listener's whole filter chain manager even for an in-place update, so each ADD
//! would cost Envoy time proportional to the pods on the node. Listeners that did not
//! change are only hashed and skipped, so with one per pod an ADD adds one small listener.
//!
//! Deliberate choices where inputs conflict, so that a realistic registry never produces
//! a snapshot the proxy rejects:
//! - A short name (`name`, `name:port`) claimed by services in two namespaces is ambiguous
//!   on a node-wide listener and is dropped from both; the qualified forms stay.
//! - A pod IP claimed by two local pods (a missed CNI DEL, then IP reuse) is served for
//!   neither, and the conflict is recorded in [`Snapshot::rejects`]: Envoy would reject
//!   the whole LDS update for two listeners on the same address. (The worker's CNI ADD
//!   evicts the older record before it adds the new pod, so this is a last line.)
//! - A `VIP:port` claimed by two services is passed through unchanged: which service owns
//!   it is the registry's call, not the builder's. Envoy NACKs that route configuration and
//!   keeps its last good one; the xDS tests use this as their injected bad resource.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::snapshot::HISTORY;
use crate::{
    CaptureProjection, Change, Changed, Cluster, ClusterKind, EndpointState, INBOUND, InboundChain, INBOUND_TARGET_PORT,
    Inputs, Kind, LbEndpoint, Listener, ListenerKind, LoadAssignment, OUTBOUND, Pod, Resources, Route, RouteConfig, Service,
    ServiceKey, Snapshot, VirtualHost, inbound_cluster_name, inbound_listener_name, outbound_cluster_name,
};

/// Builds the snapshot of `inputs` from scratch. Pure: no I/O, no clock, no randomness.
pub fn build(inputs: &Inputs) -> Snapshot {
    Builder::new(inputs.clone()).snapshot().as_ref().clone()
}

/// Distinguishes builders, so that a snapshot's history is only read against snapshots
/// of the same sequence.
static LINEAGE: AtomicU64 = AtomicU64::new(1);

/// The snapshot inputs with the snapshot built from them, and what the incremental path
/// needs to know which resources a change touches.
pub struct Builder {
    inputs: Inputs,
    snapshot: Arc<Snapshot>,
    /// Each pod IP and the pods that claim it.
    ip_claims: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Each service name and the namespaces that have it.
    short_claims: BTreeMap<String, BTreeSet<String>>,
    vhosts: BTreeMap<ServiceKey, Arc<VirtualHost>>,
    /// The cluster (and load assignment) names each service produced.
    service_clusters: BTreeMap<ServiceKey, Vec<String>>,
    /// Pods with at least one IP of their own: each has a listener and a cluster.
    served: BTreeSet<String>,
}

impl Builder {
    /// Builds everything from `inputs`.
    pub fn new(inputs: Inputs) -> Self {
        let mut ip_claims: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
        for pod in inputs.pods.values() {
            for ip in &pod.ips {
                ip_claims.entry(*ip).or_default().insert(pod.uid.clone());
            }
        }
        let mut short_claims: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for k in inputs.registry.services.keys() {
            short_claims.entry(k.name.clone()).or_default().insert(k.namespace.clone());
        }

        let mut listeners = vec![outbound_listener(&inputs.capture, inputs.on_demand_clusters)];
        let mut clusters = Vec::new();
        let mut served = BTreeSet::new();
        for (uid, pod) in &inputs.pods {
            if let Some((l, c)) = pod_resources(pod, &ip_claims) {
                listeners.push(l);
                clusters.push(c);
                served.insert(uid.clone());
            }
        }
        if !served.is_empty() {
            listeners.push(inbound_listener(&inputs.capture));
        }

        let mut vhosts = BTreeMap::new();
        let mut service_clusters = BTreeMap::new();
        let mut assignments = Vec::new();
        for (k, s) in &inputs.registry.services {
            vhosts.insert(k.clone(), Arc::new(virtual_host(s, &short_claims)));
            let mut names = Vec::new();
            for (c, a) in service_resources(s) {
                names.push(c.name.clone());
                clusters.push(c);
                assignments.push(a);
            }
            service_clusters.insert(k.clone(), names);
        }
        let route = route_config(&vhosts);

        let snapshot = Snapshot {
            listeners: Resources::new(listeners, |l| &l.name),
            routes: Resources::new([route], |r| &r.name),
            clusters: Resources::new(clusters, |c| &c.name),
            endpoints: Resources::new(assignments, |a| &a.cluster),
            rejects: rejects(&ip_claims),
            lineage: LINEAGE.fetch_add(1, Ordering::Relaxed),
            seq: 0,
            history: Arc::default(),
        };
        Self { inputs, snapshot: Arc::new(snapshot), ip_claims, short_claims, vhosts, service_clusters, served }
    }

    pub fn inputs(&self) -> &Inputs {
        &self.inputs
    }

    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// Applies `changes` in order and rebuilds what they touch. Returns the new snapshot,
    /// or `None` when no resource changed (the current one stands).
    pub fn apply(&mut self, changes: impl IntoIterator<Item = Change>) -> Option<Arc<Snapshot>> {
        let mut pods = BTreeSet::new();
        let mut ips = BTreeSet::new();
        let mut services = BTreeSet::new();
        let mut capture = false;
        for change in changes {
            match change {
                Change::UpsertPod(pod) => {
                    if self.inputs.pods.get(&pod.uid) == Some(&pod) {
                        continue;
                    }
                    ips.extend(pod.ips.iter().copied());
                    for ip in &pod.ips {
                        self.ip_claims.entry(*ip).or_default().insert(pod.uid.clone());
                    }
                    pods.insert(pod.uid.clone());
                    if let Some(old) = self.inputs.pods.insert(pod.uid.clone(), pod) {
                        self.unclaim(&old.uid, &old.ips, &mut ips);
                    }
                }
                Change::RemovePod(uid) => {
                    if let Some(old) = self.inputs.pods.remove(&uid) {
                        self.unclaim(&old.uid, &old.ips, &mut ips);
                        pods.insert(uid);
                    }
                }
                Change::UpsertService(s) => {
                    let k = s.key();
                    if self.inputs.registry.services.get(&k) == Some(&s) {
                        continue;
                    }
                    self.short_claims.entry(k.name.clone()).or_default().insert(k.namespace.clone());
                    self.inputs.registry.services.insert(k.clone(), s);
                    services.insert(k);
                }
                Change::RemoveService(k) => {
                    if self.inputs.registry.services.remove(&k).is_some() {
                        if let Some(ns) = self.short_claims.get_mut(&k.name) {
                            ns.remove(&k.namespace);
                            if ns.is_empty() {
                                self.short_claims.remove(&k.name);
                            }
                        }
                        services.insert(k);
                    }
                }
                Change::SetCapture(c) => {
                    if self.inputs.capture != c {
                        self.inputs.capture = c;
                        capture = true;
                    }
                }
            }
        }

        let mut s = self.snapshot.as_ref().clone();
        let mut changed = Changed::default();

        // Pods: the changed ones, and every pod sharing an IP with them (a conflict that
        // appears or clears changes what those serve).
        for ip in &ips {
            if let Some(uids) = self.ip_claims.get(ip) {
                pods.extend(uids.iter().cloned());
            }
        }
        let any_served_before = !self.served.is_empty();
        for uid in &pods {
            let name = inbound_listener_name(uid);
            let built = self.inputs.pods.get(uid).and_then(|p| pod_resources(p, &self.ip_claims));
            match built {
                Some((l, c)) => {
                    if s.listeners.insert(name.clone(), l) {
                        changed.note(Kind::Listener, &name);
                    }
                    if s.clusters.insert(c.name.clone(), c) {
                        changed.note(Kind::Cluster, &name);
                    }
                    self.served.insert(uid.clone());
                }
                None => {
                    if s.listeners.remove(&name) {
                        changed.note(Kind::Listener, &name);
                    }
                    if s.clusters.remove(&inbound_cluster_name(uid)) {
                        changed.note(Kind::Cluster, &inbound_cluster_name(uid));
                    }
                    self.served.remove(uid);
                }
            }
        }
        let any_served = !self.served.is_empty();
        if any_served && (capture || !any_served_before) {
            if s.listeners.insert(INBOUND.to_string(), inbound_listener(&self.inputs.capture)) {
                changed.note(Kind::Listener, INBOUND);
            }
        } else if !any_served && any_served_before && s.listeners.remove(INBOUND) {
            changed.note(Kind::Listener, INBOUND);
        }
        if capture && s.listeners.insert(OUTBOUND.to_string(), outbound_listener(&self.inputs.capture, self.inputs.on_demand_clusters)) {
            changed.note(Kind::Listener, OUTBOUND);
        }

        // Services: the changed ones, and those sharing a short name with them.
        let mut affected = services.clone();
        for k in &services {
            if let Some(namespaces) = self.short_claims.get(&k.name) {
                affected.extend(namespaces.iter().map(|ns| ServiceKey { namespace: ns.clone(), name: k.name.clone() }));
            }
        }
        let mut route_changed = false;
        for k in &affected {
            let old = self.service_clusters.remove(k).unwrap_or_default();
            match self.inputs.registry.services.get(k) {
                Some(svc) => {
                    let vh = virtual_host(svc, &self.short_claims);
                    if self.vhosts.get(k).is_none_or(|v| **v != vh) {
                        self.vhosts.insert(k.clone(), Arc::new(vh));
                        route_changed = true;
                    }
                    let mut names = Vec::new();
                    for (c, a) in service_resources(svc) {
                        let name = c.name.clone();
                        if s.clusters.insert(name.clone(), c) {
                            changed.note(Kind::Cluster, &name);
                        }
                        if s.endpoints.insert(name.clone(), a) {
                            changed.note(Kind::Endpoint, &name);
                        }
                        names.push(name);
                    }
                    for gone in old.iter().filter(|n| !names.contains(n)) {
                        remove_service_cluster(&mut s, &mut changed, gone);
                    }
                    self.service_clusters.insert(k.clone(), names);
                }
                None => {
                    route_changed |= self.vhosts.remove(k).is_some();
                    for gone in &old {
                        remove_service_cluster(&mut s, &mut changed, gone);
                    }
                }
            }
        }
        if route_changed && s.routes.insert(OUTBOUND.to_string(), route_config(&self.vhosts)) {
            changed.note(Kind::Route, OUTBOUND);
        }

        let rejects = rejects(&self.ip_claims);
        if changed.is_empty() && rejects == s.rejects {
            return None;
        }
        s.rejects = rejects;
        s.seq += 1;
        let mut history: Vec<Arc<Changed>> = s.history.iter().skip((s.history.len() + 1).saturating_sub(HISTORY)).cloned().collect();
        history.push(Arc::new(changed));
        s.history = Arc::new(history);
        self.snapshot = Arc::new(s);
        Some(self.snapshot.clone())
    }

    fn unclaim(&mut self, uid: &str, old_ips: &[IpAddr], touched: &mut BTreeSet<IpAddr>) {
        let keep: BTreeSet<IpAddr> = self.inputs.pods.get(uid).map(|p| p.ips.iter().copied().collect()).unwrap_or_default();
        for ip in old_ips.iter().filter(|ip| !keep.contains(ip)) {
            touched.insert(*ip);
            if let Some(uids) = self.ip_claims.get_mut(ip) {
                uids.remove(uid);
                if uids.is_empty() {
                    self.ip_claims.remove(ip);
                }
            }
        }
    }
}

fn remove_service_cluster(s: &mut Snapshot, changed: &mut Changed, name: &str) {
    if s.clusters.remove(name) {
        changed.note(Kind::Cluster, name);
    }
    if s.endpoints.remove(name) {
        changed.note(Kind::Endpoint, name);
    }
}

fn outbound_listener(c: &CaptureProjection, on_demand: bool) -> Listener {
    Listener {
        name: OUTBOUND.to_string(),
        address: c.outbound,
        kind: ListenerKind::HttpOutbound { route_config: OUTBOUND.to_string(), on_demand },
    }
}

fn inbound_listener(c: &CaptureProjection) -> Listener {
    Listener {
        name: INBOUND.to_string(),
        address: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), c.inbound_port),
        kind: ListenerKind::InboundCapture,
    }
}

/// A pod's listener and cluster, on the IPs it alone claims; `None` when it has none. A
/// terminating pod keeps both (its open connections finish, and new ones still reach it
/// while it is the only endpoint), its endpoints marked draining.
fn pod_resources(pod: &Pod, claims: &BTreeMap<IpAddr, BTreeSet<String>>) -> Option<(Listener, Cluster)> {
    let uid = pod.uid.as_str();
    let ips: Vec<IpAddr> = pod
        .ips
        .iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter(|ip| claims.get(ip).is_some_and(|c| c.len() == 1))
        .copied()
        .collect();
    let first = *ips.first()?;
    let cluster = inbound_cluster_name(uid);
    let c = Cluster {
        name: cluster.clone(),
        kind: ClusterKind::Static {
            endpoints: ips.iter().map(|ip| SocketAddr::new(*ip, INBOUND_TARGET_PORT)).collect(),
            draining: pod.terminating,
        },
    };
    let l = Listener {
        name: inbound_listener_name(uid),
        address: SocketAddr::new(first, INBOUND_TARGET_PORT),
        kind: ListenerKind::InboundPod { chain: InboundChain { pod_uid: uid.to_string(), ips, cluster } },
    };
    Some((l, c))
}

/// Short names are namespace-relative; on a node-wide listener one claimed by two
/// namespaces is ambiguous.
fn virtual_host(s: &Service, short_claims: &BTreeMap<String, BTreeSet<String>>) -> VirtualHost {
    let qualified = format!("{}.{}", s.name, s.namespace);
    let mut hosts = Vec::new();
    if short_claims.get(&s.name).is_some_and(|ns| ns.len() == 1) {
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

    let mut routes = Vec::new();
    for port in s.ports.iter().skip(1) {
        routes.push(Route { authority_port: Some(*port), cluster: outbound_cluster_name(*port, &s.name, &s.namespace) });
    }
    if let Some(first) = s.ports.first() {
        routes.push(Route { authority_port: None, cluster: outbound_cluster_name(*first, &s.name, &s.namespace) });
    }
    VirtualHost { name: qualified, domains, routes }
}

/// A service's EDS cluster and load assignment per port.
fn service_resources(s: &Service) -> Vec<(Cluster, LoadAssignment)> {
    s.ports
        .iter()
        .map(|port| {
            let name = outbound_cluster_name(*port, &s.name, &s.namespace);
            let endpoints = s
                .endpoints
                .iter()
                .filter(|e| e.service_port == *port)
                .map(|e| LbEndpoint { address: SocketAddr::new(e.address, e.port), draining: e.state == EndpointState::Draining })
                .collect();
            (Cluster { name: name.clone(), kind: ClusterKind::Eds }, LoadAssignment { cluster: name, endpoints })
        })
        .collect()
}

fn route_config(vhosts: &BTreeMap<ServiceKey, Arc<VirtualHost>>) -> RouteConfig {
    RouteConfig { name: OUTBOUND.to_string(), virtual_hosts: vhosts.values().cloned().collect() }
}

fn rejects(claims: &BTreeMap<IpAddr, BTreeSet<String>>) -> Vec<String> {
    claims
        .iter()
        .filter(|(_, uids)| uids.len() > 1)
        .map(|(ip, uids)| {
            format!("pod IP {ip} is claimed by pods {}; served for none of them", uids.iter().cloned().collect::<Vec<_>>().join(", "))
        })
        .collect()
}

#[cfg(test)]
mod tests;
