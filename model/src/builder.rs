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
    BUNDLE_SECRET, CaptureProjection, Change, Changed, Cluster, ClusterKind, EndpointState,
    INBOUND, INBOUND_TARGET_PORT, Identity, InboundChain, InboundTls, Inputs, Kind, LbEndpoint,
    Listener, ListenerKind, LoadAssignment, MtlsMode, NamedSecret, OUTBOUND, Pod, QUIC_TWINS,
    Resources, Route, RouteConfig, Secret, Service, ServiceKey, Snapshot, Twin, UpstreamTls,
    VirtualHost, inbound_cluster_name, inbound_listener_name, inbound_secret_name,
    outbound_cluster_name, pod_secret_name, twin_sni,
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
    /// Pods with at least one IP of their own: each has a cluster, and a listener unless
    /// strict mTLS holds it back until the pod's SVID arrives.
    served: BTreeSet<String>,
    /// The secret names each pod produced (its outbound and inbound certificates).
    pod_secrets: BTreeMap<String, Vec<String>>,
    /// Permissive mTLS: the IPs of each pod without its own SVID, whose outbound
    /// connections go plaintext (the outbound listener's `plaintext_sources`).
    plaintext_sources: BTreeMap<String, Vec<IpAddr>>,
    /// The IPs of each pod holding its own SVID, whose outbound connections name its
    /// certificate (the outbound listener's `pod_certificates`).
    certified_sources: BTreeMap<String, Vec<IpAddr>>,
    /// Moves on with every change to the registry's services: a reader of the registry
    /// alone (the mesh-DNS snapshot) skips a walk of it when this has not moved.
    registry_generation: u64,
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
            short_claims
                .entry(k.name.clone())
                .or_default()
                .insert(k.namespace.clone());
        }

        let mut listeners = Vec::new();
        let mut clusters = Vec::new();
        let mut secrets = node_secrets(&inputs.identity);
        let mut served = BTreeSet::new();
        let mut pod_secrets = BTreeMap::new();
        let mut plaintext_sources = BTreeMap::new();
        let mut certified_sources = BTreeMap::new();
        let mut held_back = imbl::OrdSet::new();
        for (uid, pod) in &inputs.pods {
            if let Some(r) = pod_resources(
                pod,
                &ip_claims,
                &inputs.identity,
                inputs.inbound_access_log.as_deref(),
            ) {
                if r.held_back {
                    held_back.insert(uid.clone());
                }
                if !r.plaintext_sources.is_empty() {
                    plaintext_sources.insert(uid.clone(), r.plaintext_sources);
                }
                if !r.certified_sources.is_empty() {
                    certified_sources.insert(uid.clone(), r.certified_sources);
                }
                listeners.extend(r.listener);
                clusters.push(r.cluster);
                pod_secrets.insert(
                    uid.clone(),
                    r.secrets.iter().map(|s| s.name.clone()).collect(),
                );
                secrets.extend(r.secrets);
                served.insert(uid.clone());
            }
        }
        if !served.is_empty() {
            listeners.push(inbound_listener(&inputs.capture));
        }
        let (twins, twins_refused) = quic_twins(&inputs, &ip_claims);
        listeners.extend(twins);
        listeners.push(outbound_listener(
            &inputs,
            &plaintext_sources,
            &certified_sources,
        ));

        let mut vhosts = BTreeMap::new();
        let mut service_clusters = BTreeMap::new();
        let mut assignments = Vec::new();
        for (k, s) in &inputs.registry.services {
            vhosts.insert(k.clone(), Arc::new(virtual_host(s, &short_claims)));
            let mut names = Vec::new();
            for (c, a) in service_resources(s, &inputs.identity) {
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
            secrets: Resources::new(secrets, |s| &s.name),
            rejects: rejects(&ip_claims),
            held_back,
            twins_refused,
            lineage: LINEAGE.fetch_add(1, Ordering::Relaxed),
            seq: 0,
            history: Arc::default(),
        };
        Self {
            inputs,
            snapshot: Arc::new(snapshot),
            ip_claims,
            short_claims,
            vhosts,
            service_clusters,
            served,
            pod_secrets,
            plaintext_sources,
            certified_sources,
            registry_generation: 0,
        }
    }

    pub fn inputs(&self) -> &Inputs {
        &self.inputs
    }

    /// A number that moves on with every change to the registry's services (from 0 at
    /// [`Builder::new`]); equal numbers mean the same registry (a batch that changes a
    /// service and changes it back moves it too).
    pub fn registry_generation(&self) -> u64 {
        self.registry_generation
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
        let mut node_identity = false;
        for change in changes {
            match change {
                Change::UpsertPod(pod) => {
                    if self.inputs.pods.get(&pod.uid) == Some(&pod) {
                        continue;
                    }
                    ips.extend(pod.ips.iter().copied());
                    for ip in &pod.ips {
                        self.ip_claims
                            .entry(*ip)
                            .or_default()
                            .insert(pod.uid.clone());
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
                    self.short_claims
                        .entry(k.name.clone())
                        .or_default()
                        .insert(k.namespace.clone());
                    self.inputs.registry.services.insert(k.clone(), s);
                    self.registry_generation += 1;
                    services.insert(k);
                }
                Change::RemoveService(k) => {
                    if self.inputs.registry.services.remove(&k).is_some() {
                        self.registry_generation += 1;
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
                Change::SetBundle(b) => {
                    if self.inputs.identity.bundle != b {
                        // Whether a pod's listener terminates mTLS depends on the bundle.
                        if self.inputs.identity.bundle.is_some() != b.is_some() {
                            pods.extend(self.inputs.pods.keys().cloned());
                        }
                        self.inputs.identity.bundle = b;
                        node_identity = true;
                    }
                }
                // No resource carries the agent's SVID: nothing to rebuild.
                Change::SetAgentSvid(a) => self.inputs.identity.agent = a,
                Change::SetPodSvid { uid, svid } => {
                    let pods_svids = &mut self.inputs.identity.pods;
                    let changed = match svid {
                        Some(v) => pods_svids.insert(uid.clone(), v.clone()).as_ref() != Some(&v),
                        None => pods_svids.remove(&uid).is_some(),
                    };
                    if changed {
                        pods.insert(uid);
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
        if node_identity {
            let now = node_secrets(&self.inputs.identity);
            let changed_now = match now.iter().find(|n| n.name == BUNDLE_SECRET) {
                Some(n) => s.secrets.insert(BUNDLE_SECRET.to_string(), n.clone()),
                None => s.secrets.remove(BUNDLE_SECRET),
            };
            if changed_now {
                changed.note(Kind::Secret, BUNDLE_SECRET);
            }
        }
        let any_served_before = !self.served.is_empty();
        // Every touched pod's old secrets go first, then the new ones are put: what a pod
        // no longer has (its SVID, or the pod) leaves.
        let mut stale_secrets = BTreeSet::new();
        let mut new_secrets = Vec::new();
        let mut held_changed = false;
        let mut sources_changed = false;
        for uid in &pods {
            let name = inbound_listener_name(uid);
            let built = self.inputs.pods.get(uid).and_then(|p| {
                pod_resources(
                    p,
                    &self.ip_claims,
                    &self.inputs.identity,
                    self.inputs.inbound_access_log.as_deref(),
                )
            });
            stale_secrets.extend(self.pod_secrets.remove(uid).unwrap_or_default());
            let (plaintext, certified) = built
                .as_ref()
                .map(|r| (r.plaintext_sources.clone(), r.certified_sources.clone()))
                .unwrap_or_default();
            sources_changed |= replace_sources(&mut self.plaintext_sources, uid, plaintext);
            sources_changed |= replace_sources(&mut self.certified_sources, uid, certified);
            let was_held = s.held_back.contains(uid);
            match built {
                Some(r) => {
                    if r.held_back != was_held {
                        if r.held_back {
                            s.held_back.insert(uid.clone());
                        } else {
                            s.held_back.remove(uid);
                        }
                        held_changed = true;
                    }
                    match r.listener {
                        Some(l) => {
                            if s.listeners.insert(name.clone(), l) {
                                changed.note(Kind::Listener, &name);
                            }
                        }
                        None => {
                            if s.listeners.remove(&name) {
                                changed.note(Kind::Listener, &name);
                            }
                        }
                    }
                    if s.clusters.insert(r.cluster.name.clone(), r.cluster) {
                        changed.note(Kind::Cluster, &name);
                    }
                    if !r.secrets.is_empty() {
                        self.pod_secrets.insert(
                            uid.clone(),
                            r.secrets.iter().map(|s| s.name.clone()).collect(),
                        );
                    }
                    new_secrets.extend(r.secrets);
                    self.served.insert(uid.clone());
                }
                None => {
                    if was_held {
                        s.held_back.remove(uid);
                        held_changed = true;
                    }
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
        for secret in &new_secrets {
            stale_secrets.remove(&secret.name);
        }
        for gone in &stale_secrets {
            if s.secrets.remove(gone) {
                changed.note(Kind::Secret, gone);
            }
        }
        for secret in new_secrets {
            let n = secret.name.clone();
            if s.secrets.insert(n.clone(), secret) {
                changed.note(Kind::Secret, &n);
            }
        }
        let any_served = !self.served.is_empty();
        if any_served && (capture || !any_served_before) {
            if s.listeners
                .insert(INBOUND.to_string(), inbound_listener(&self.inputs.capture))
            {
                changed.note(Kind::Listener, INBOUND);
            }
        } else if !any_served && any_served_before && s.listeners.remove(INBOUND) {
            changed.note(Kind::Listener, INBOUND);
        }
        // The twins: one listener for all of them, rebuilt whole when a pod changed (at
        // most `--quic-twin-max` chains). A rotated SVID leaves it as it was: a chain
        // names the pod's certificate, not its content.
        if !pods.is_empty() && self.inputs.quic_twins.is_some() {
            let (twins, refused) = quic_twins(&self.inputs, &self.ip_claims);
            let changed_now = match twins {
                Some(l) => s.listeners.insert(QUIC_TWINS.to_string(), l),
                None => s.listeners.remove(QUIC_TWINS),
            };
            if changed_now {
                changed.note(Kind::Listener, QUIC_TWINS);
            }
            if refused != s.twins_refused {
                s.twins_refused = refused;
                held_changed = true;
            }
        }
        if (capture || sources_changed)
            && s.listeners.insert(
                OUTBOUND.to_string(),
                outbound_listener(
                    &self.inputs,
                    &self.plaintext_sources,
                    &self.certified_sources,
                ),
            )
        {
            changed.note(Kind::Listener, OUTBOUND);
        }

        // Services: the changed ones, and those sharing a short name with them.
        let mut affected = services.clone();
        for k in &services {
            if let Some(namespaces) = self.short_claims.get(&k.name) {
                affected.extend(namespaces.iter().map(|ns| ServiceKey {
                    namespace: ns.clone(),
                    name: k.name.clone(),
                }));
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
                    for (c, a) in service_resources(svc, &self.inputs.identity) {
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
        if route_changed
            && s.routes
                .insert(OUTBOUND.to_string(), route_config(&self.vhosts))
        {
            changed.note(Kind::Route, OUTBOUND);
        }

        let rejects = rejects(&self.ip_claims);
        if changed.is_empty() && rejects == s.rejects && !held_changed {
            return None;
        }
        s.rejects = rejects;
        s.seq += 1;
        let mut history: Vec<Arc<Changed>> = s
            .history
            .iter()
            .skip((s.history.len() + 1).saturating_sub(HISTORY))
            .cloned()
            .collect();
        history.push(Arc::new(changed));
        s.history = Arc::new(history);
        self.snapshot = Arc::new(s);
        Some(self.snapshot.clone())
    }

    fn unclaim(&mut self, uid: &str, old_ips: &[IpAddr], touched: &mut BTreeSet<IpAddr>) {
        let keep: BTreeSet<IpAddr> = self
            .inputs
            .pods
            .get(uid)
            .map(|p| p.ips.iter().copied().collect())
            .unwrap_or_default();
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

/// Sets pod `uid`'s entry of `map` to `ips` (none: no entry); says whether it changed.
fn replace_sources(map: &mut BTreeMap<String, Vec<IpAddr>>, uid: &str, ips: Vec<IpAddr>) -> bool {
    let before = match ips.is_empty() {
        true => map.remove(uid),
        false => map.insert(uid.to_string(), ips.clone()),
    };
    before.unwrap_or_default() != ips
}

/// The outbound listener; `plaintext` holds the IPs of the pods (by uid) whose
/// connections go plaintext for want of their own SVID (permissive), `certified` those of
/// the pods whose connections name their own certificate.
fn outbound_listener(
    inputs: &Inputs,
    plaintext: &BTreeMap<String, Vec<IpAddr>>,
    certified: &BTreeMap<String, Vec<IpAddr>>,
) -> Listener {
    let sources: BTreeSet<IpAddr> = plaintext.values().flatten().copied().collect();
    Listener {
        name: OUTBOUND.to_string(),
        address: inputs.capture.outbound,
        kind: ListenerKind::HttpOutbound {
            route_config: OUTBOUND.to_string(),
            on_demand: inputs.on_demand_clusters,
            source_certificates: inputs.identity.enabled(),
            pod_certificates: certified
                .iter()
                .map(|(uid, ips)| (uid.clone(), ips.clone()))
                .collect(),
            plaintext_sources: sources.into_iter().collect(),
        },
    }
}

/// The node's own secret: the trust bundle, once it arrived. The agent's SVID is never
/// one: it is the agent's own, and no pod may present it.
fn node_secrets(id: &Identity) -> Vec<NamedSecret> {
    let (Some(td), Some(ca)) = (&id.trust_domain, &id.bundle) else {
        return vec![];
    };
    vec![NamedSecret {
        name: BUNDLE_SECRET.to_string(),
        secret: Secret::Validation {
            ca_pem: ca.clone(),
            spiffe_prefix: format!("spiffe://{td}/"),
        },
    }]
}

/// What one local pod contributes to the snapshot.
struct PodResources {
    /// `None`: strict mTLS and the pod's SVID (or the bundle) has not arrived.
    listener: Option<Listener>,
    /// The listener is held back for the SVID (strict).
    held_back: bool,
    cluster: Cluster,
    /// The pod's certificates: outbound and inbound, each named by its uid.
    secrets: Vec<NamedSecret>,
    /// Permissive, the pod's SVID not yet there: its IPs, whose outbound connections go
    /// plaintext.
    plaintext_sources: Vec<IpAddr>,
    /// The pod's SVID there: its IPs, whose outbound connections name its certificate.
    certified_sources: Vec<IpAddr>,
}

fn inbound_listener(c: &CaptureProjection) -> Listener {
    Listener {
        name: INBOUND.to_string(),
        address: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), c.inbound_port),
        kind: ListenerKind::InboundCapture,
    }
}

/// A pod's listener, cluster and secrets, on the IPs it alone claims; `None` when it has
/// none. A terminating pod keeps them (its open connections finish, and new ones still
/// reach it while it is the only endpoint), its endpoints marked draining.
///
/// With identity on, a pod whose SVID and the trust bundle are there terminates mTLS
/// (and, permissive, also serves plaintext on the same port); one whose SVID is late
/// keeps its plaintext path (permissive) or gets no listener (strict: fail closed). Its
/// certificate secrets are its own SVID and exist only with it: meanwhile a permissive
/// pod's outbound connections go plaintext (its IPs are returned as plaintext sources),
/// and a strict pod's fail their handshake. Never another identity.
fn pod_resources(
    pod: &Pod,
    claims: &BTreeMap<IpAddr, BTreeSet<String>>,
    id: &Identity,
    access_log: Option<&str>,
) -> Option<PodResources> {
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
            endpoints: ips
                .iter()
                .map(|ip| SocketAddr::new(*ip, INBOUND_TARGET_PORT))
                .collect(),
            draining: pod.terminating,
        },
        upstream_tls: None,
    };
    let own = id.pods.get(uid).filter(|_| id.enabled());
    let certificate = |name: String, svid: &crate::Svid| NamedSecret {
        name,
        secret: Secret::Certificate {
            chain_pem: svid.chain_pem.clone(),
            key_pem: svid.key_pem.clone(),
        },
    };
    let mut secrets: Vec<NamedSecret> = match own {
        Some(svid) => vec![certificate(pod_secret_name(uid), svid)],
        None => vec![],
    };
    let certified_sources = match own {
        Some(_) => ips.clone(),
        None => vec![],
    };
    let tls = match own {
        Some(svid) if id.bundle.is_some() => {
            secrets.push(certificate(inbound_secret_name(uid), svid));
            Some(InboundTls {
                certificate: inbound_secret_name(uid),
                plaintext: id.mode == MtlsMode::Permissive,
            })
        }
        _ => None,
    };
    let fail_closed = id.enabled() && id.mode == MtlsMode::Strict && tls.is_none();
    let plaintext_sources = match own {
        None if id.enabled() && id.mode == MtlsMode::Permissive => ips.clone(),
        _ => vec![],
    };
    let listener = (!fail_closed).then(|| Listener {
        name: inbound_listener_name(uid),
        address: SocketAddr::new(first, INBOUND_TARGET_PORT),
        kind: ListenerKind::InboundPod {
            chain: InboundChain {
                pod_uid: uid.to_string(),
                ips,
                cluster,
                tls,
                access_log: access_log.map(str::to_string),
            },
        },
    });
    Some(PodResources {
        listener,
        held_back: fail_closed,
        cluster: c,
        secrets,
        plaintext_sources,
        certified_sources,
    })
}

/// The node's QUIC twins listener (`None` when no pod has a twin) and the pods past the
/// bound. A pod has a twin when twins are on, it did not opt out, it is served on an IP of
/// its own, and its inbound terminates mTLS: its own SVID and the trust bundle are there.
/// Past `max` (in uid order) a pod gets none.
fn quic_twins(
    inputs: &Inputs,
    claims: &BTreeMap<IpAddr, BTreeSet<String>>,
) -> (Option<Listener>, Vec<String>) {
    let Some(q) = inputs.quic_twins else {
        return (None, vec![]);
    };
    let id = &inputs.identity;
    if !id.enabled() || id.bundle.is_none() {
        return (None, vec![]);
    }
    let eligible = inputs.pods.values().filter(|p| {
        !p.no_quic_twin
            && id.pods.contains_key(&p.uid)
            && p.ips
                .iter()
                .any(|ip| claims.get(ip).is_some_and(|c| c.len() == 1))
    });
    let mut twins = Vec::new();
    let mut refused = Vec::new();
    for p in eligible {
        if twins.len() < q.max {
            twins.push(Twin {
                pod_uid: p.uid.clone(),
                sni: twin_sni(&p.uid),
                certificate: inbound_secret_name(&p.uid),
                cluster: inbound_cluster_name(&p.uid),
            });
        } else {
            refused.push(p.uid.clone());
        }
    }
    let listener = (!twins.is_empty()).then(|| Listener {
        name: QUIC_TWINS.to_string(),
        address: q.address,
        kind: ListenerKind::QuicTwins { twins },
    });
    (listener, refused)
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
        routes.push(Route {
            authority_port: Some(*port),
            cluster: outbound_cluster_name(*port, &s.name, &s.namespace),
        });
    }
    if let Some(first) = s.ports.first() {
        routes.push(Route {
            authority_port: None,
            cluster: outbound_cluster_name(*first, &s.name, &s.namespace),
        });
    }
    VirtualHost {
        name: qualified,
        domains,
        routes,
    }
}

/// A service's EDS cluster and load assignment per port. With identity on, a port with
/// an endpoint marked mTLS-capable gets upstream mTLS for those endpoints; the others
/// stay plaintext.
fn service_resources(s: &Service, id: &Identity) -> Vec<(Cluster, LoadAssignment)> {
    s.ports
        .iter()
        .map(|port| {
            let name = outbound_cluster_name(*port, &s.name, &s.namespace);
            let endpoints: Vec<LbEndpoint> = s
                .endpoints
                .iter()
                .filter(|e| e.service_port == *port)
                .map(|e| LbEndpoint {
                    address: SocketAddr::new(e.address, e.port),
                    draining: e.state == EndpointState::Draining,
                    mtls: e.mtls && id.enabled(),
                })
                .collect();
            let upstream_tls = endpoints.iter().any(|e| e.mtls).then(|| UpstreamTls {
                plaintext_without_certificate: id.mode == MtlsMode::Permissive,
            });
            (
                Cluster {
                    name: name.clone(),
                    kind: ClusterKind::Eds,
                    upstream_tls,
                },
                LoadAssignment {
                    cluster: name,
                    endpoints,
                },
            )
        })
        .collect()
}

fn route_config(vhosts: &BTreeMap<ServiceKey, Arc<VirtualHost>>) -> RouteConfig {
    RouteConfig {
        name: OUTBOUND.to_string(),
        virtual_hosts: vhosts.values().cloned().collect(),
    }
}

fn rejects(claims: &BTreeMap<IpAddr, BTreeSet<String>>) -> Vec<String> {
    claims
        .iter()
        .filter(|(_, uids)| uids.len() > 1)
        .map(|(ip, uids)| {
            format!(
                "pod IP {ip} is claimed by pods {}; served for none of them",
                uids.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect()
}

#[cfg(test)]
mod tests;
