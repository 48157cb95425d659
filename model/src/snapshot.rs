//! The resources served to the proxy: what [`crate::Builder`] produces.
//!
//! Each resource type is a [`Resources`] map with a content hash per resource and one
//! version for the type, derived from those hashes alone, so the same inputs always give
//! the same versions however they were reached, and a reconnect to an identical snapshot
//! is a no-op for Envoy. The maps are persistent (`imbl`): a new snapshot shares every
//! resource a change did not touch with the one before, so publishing one is O(changed),
//! not O(mesh).

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use imbl::{OrdMap, OrdSet};
use serde::Serialize;

use crate::hash::{Fnv, content_hash};
use crate::identity::{InboundTls, NamedSecret, UpstreamTls};

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
/// The name of the node's one QUIC listener, whose filter chains are the pods' twins.
pub const QUIC_TWINS: &str = "quic-twins";
/// What every twin's server name ends with: a twin is chosen by `<pod uid>.twin.aether`.
pub const TWIN_SNI_SUFFIX: &str = ".twin.aether";

/// The server name (SNI) an HTTP/3 client sends to reach pod `uid`'s twin: the uid is
/// unique on the node (the pod records are keyed by it) and a Kubernetes uid is a valid
/// DNS label, so no two twins ever share a name and the name needs no escaping.
pub fn twin_sni(uid: &str) -> String {
    format!("{uid}{TWIN_SNI_SUFFIX}")
}

/// A resource type. The xDS adapter maps each to its type URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Cluster,
    Endpoint,
    Listener,
    Route,
    Secret,
}

/// How many resource kinds there are (the length of per-kind arrays).
pub const KIND_COUNT: usize = 5;

/// Push order: clusters exist before the listeners and routes that use them, and the
/// secrets both name arrive with them.
pub const KINDS: [Kind; KIND_COUNT] = [
    Kind::Cluster,
    Kind::Endpoint,
    Kind::Secret,
    Kind::Listener,
    Kind::Route,
];

impl Kind {
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn short(self) -> &'static str {
        match self {
            Kind::Cluster => "CDS",
            Kind::Endpoint => "EDS",
            Kind::Listener => "LDS",
            Kind::Route => "RDS",
            Kind::Secret => "SDS",
        }
    }
}

/// The resources of one type, keyed by resource name, with the content hash of each and
/// the version of them all.
#[derive(Debug, Clone)]
pub struct Resources<T> {
    pub items: OrdMap<String, Arc<T>>,
    /// Content hash of each item, by name.
    pub hashes: OrdMap<String, u64>,
    /// The wrapping sum of every entry's hash (name and content): order-free, so one
    /// insert or removal updates it in O(1).
    sum: u64,
    /// How many items [`Tally::tallied`] counts, kept as items come and go.
    tallied: usize,
    pub version: String,
}

/// What [`Resources`] counts of its items as they are put and removed: a question about
/// every item that would otherwise walk 10,000 clusters (the delta ADS adapter asks it
/// after each of the proxy's requests).
pub trait Tally {
    fn tallied(&self) -> bool {
        false
    }
}

fn entry_hash(name: &str, hash: u64) -> u64 {
    let mut h = Fnv::new();
    h.write(name.as_bytes());
    h.write(&[0]);
    h.write(&hash.to_le_bytes());
    h.0
}

fn version_of(sum: u64, len: usize) -> String {
    let mut h = Fnv::new();
    h.write(&sum.to_le_bytes());
    h.write(&(len as u64).to_le_bytes());
    format!("{:016x}", h.0)
}

impl<T: Serialize + Tally> Resources<T> {
    pub fn new(items: impl IntoIterator<Item = T>, name: impl Fn(&T) -> &str) -> Self {
        let mut r = Self::default();
        for item in items {
            let n = name(&item).to_string();
            r.put(n, item);
        }
        r.version = version_of(r.sum, r.hashes.len());
        r
    }

    /// Inserts or replaces `name`; true when its content changed.
    pub(crate) fn insert(&mut self, name: String, item: T) -> bool {
        let changed = self.put(name, item);
        if changed {
            self.version = version_of(self.sum, self.hashes.len());
        }
        changed
    }

    fn put(&mut self, name: String, item: T) -> bool {
        let hash = content_hash(&item);
        if self.hashes.get(&name) == Some(&hash) {
            return false;
        }
        if let Some(old) = self.hashes.insert(name.clone(), hash) {
            self.sum = self.sum.wrapping_sub(entry_hash(&name, old));
        }
        self.sum = self.sum.wrapping_add(entry_hash(&name, hash));
        self.tallied += usize::from(item.tallied());
        if let Some(old) = self.items.insert(name, Arc::new(item)) {
            self.tallied -= usize::from(old.tallied());
        }
        true
    }

    /// Removes `name`; true when it was there.
    pub(crate) fn remove(&mut self, name: &str) -> bool {
        let Some(old) = self.hashes.remove(name) else {
            return false;
        };
        if let Some(item) = self.items.remove(name) {
            self.tallied -= usize::from(item.tallied());
        }
        self.sum = self.sum.wrapping_sub(entry_hash(name, old));
        self.version = version_of(self.sum, self.hashes.len());
        true
    }

    pub fn get(&self, name: &str) -> Option<&T> {
        self.items.get(name).map(|a| &**a)
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// How many items [`Tally::tallied`] counts.
    pub fn tallied(&self) -> usize {
        self.tallied
    }
}

impl<T: Serialize> Default for Resources<T> {
    fn default() -> Self {
        Self {
            items: OrdMap::new(),
            hashes: OrdMap::new(),
            sum: 0,
            tallied: 0,
            version: version_of(0, 0),
        }
    }
}

/// Same names with the same content hashes.
impl<T> PartialEq for Resources<T> {
    fn eq(&self, other: &Self) -> bool {
        self.version == other.version && self.hashes == other.hashes
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
    /// HTTP connection manager whose routes come over RDS; with `on_demand`, a route to a
    /// cluster the proxy does not hold fetches it first (on-demand CDS over ADS).
    HttpOutbound {
        route_config: String,
        on_demand: bool,
        /// Identity is on: each connection names its calling pod's certificate for the
        /// upstream TLS of mTLS-capable endpoints; one from a source no pod of
        /// `pod_certificates` has names a secret never served. Left out of the content hash
        /// when false.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        source_certificates: bool,
        /// The local pods holding their own SVID, by uid, with their IPs: a connection from
        /// one of those IPs names that pod's certificate ([`crate::pod_secret_name`]).
        /// Sorted by uid; left out of the content hash when empty.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        pod_certificates: Vec<(String, Vec<IpAddr>)>,
        /// Permissive mTLS: the IPs of local pods whose own SVID has not arrived. Their
        /// connections name no certificate, so they go plaintext; they never present
        /// another's. Sorted; left out of the content hash when empty.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        plaintext_sources: Vec<IpAddr>,
    },
    /// The inbound capture listener: hands each redirected connection to the listener of
    /// its original destination; closes the rest.
    InboundCapture,
    /// A local pod's virtual listener (not bound; reached through the capture listener),
    /// on the pod's IPs and [`INBOUND_TARGET_PORT`]: `address` is the first IP, the
    /// chain holds them all.
    InboundPod { chain: InboundChain },
    /// The node's QUIC listener (UDP, bound): one filter chain per twin, chosen by its
    /// server name, terminating QUIC and HTTP/3 with the pod's SVID, a client SVID of the
    /// trust domain required, and forwarding over HTTP to the pod's inbound cluster.
    /// Sorted by pod uid; never empty (no twin: no listener).
    QuicTwins { twins: Vec<Twin> },
}

/// One pod's QUIC twin: a filter chain of the [`QUIC_TWINS`] listener.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Twin {
    pub pod_uid: String,
    /// The server name that selects this chain ([`twin_sni`]).
    pub sni: String,
    /// The pod's certificate (SDS name): the TCP inbound's, so a rotation reaches new
    /// handshakes as a secret update, never a listener one.
    pub certificate: String,
    /// The pod's inbound cluster: the TCP inbound's target.
    pub cluster: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InboundChain {
    pub pod_uid: String,
    /// Matched as host prefixes (/32 or /128). Never empty: an empty match would take
    /// every connection.
    pub ips: Vec<IpAddr>,
    pub cluster: String,
    /// mTLS termination with the pod's SVID; `None`: plaintext only (identity off, or a
    /// permissive pod whose SVID has not arrived). Left out of the content hash when
    /// `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<InboundTls>,
    /// Where the proxy writes one access log line per connection to the pod
    /// (`--inbound-access-log`); `None`: no access log. Left out of the content hash when
    /// `None`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access_log: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteConfig {
    pub name: String,
    /// Shared with the builder's per-service cache: a route rebuilt after one service
    /// changed copies the other virtual hosts' pointers, not their domains.
    pub virtual_hosts: Vec<Arc<VirtualHost>>,
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
    /// The endpoints marked mTLS-capable are reached over mTLS. Left out of the content
    /// hash when `None`, so a cluster without it hashes as before identity existed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_tls: Option<UpstreamTls>,
}

/// Counts the clusters with upstream TLS: any one of them needs the trust bundle.
impl Tally for Cluster {
    fn tallied(&self) -> bool {
        self.upstream_tls.is_some()
    }
}

impl Tally for Listener {}
impl Tally for RouteConfig {}
impl Tally for LoadAssignment {}
impl Tally for crate::identity::NamedSecret {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ClusterKind {
    /// Endpoints come over EDS under the cluster's own name.
    Eds,
    /// Endpoints are part of the cluster. `draining`: every endpoint is served with
    /// health status DRAINING (a terminating pod). Left out of the content hash when
    /// false, so a pod that is not terminating hashes as it did before the flag existed
    /// and an agent of either version serves it at the same version.
    Static {
        endpoints: Vec<SocketAddr>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        draining: bool,
    },
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
    /// The endpoint accepts mTLS (the registry marks it). Left out of the content hash
    /// when false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub mtls: bool,
}

/// The names of the resources of each kind that one step added, changed or removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changed(pub [BTreeSet<String>; KIND_COUNT]);

impl Changed {
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(BTreeSet::is_empty)
    }

    pub fn kind(&self, k: Kind) -> &BTreeSet<String> {
        &self.0[k.index()]
    }

    pub(crate) fn note(&mut self, k: Kind, name: &str) {
        self.0[k.index()].insert(name.to_string());
    }
}

/// How many steps a snapshot remembers: a reader that fell further behind compares
/// everything instead (see [`Snapshot::changed_since`]).
pub const HISTORY: usize = 64;

/// The resources served to the proxy, with one content-hash version per type.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub listeners: Resources<Listener>,
    pub routes: Resources<RouteConfig>,
    pub clusters: Resources<Cluster>,
    pub endpoints: Resources<LoadAssignment>,
    /// SDS secrets: the pods' and the agent's certificates and the trust bundle. Empty
    /// while identity is off.
    pub secrets: Resources<NamedSecret>,
    /// Inputs the builder left out, one sentence each, for logs.
    pub rejects: Vec<String>,
    /// Pods (by uid) whose inbound listener strict mTLS holds back until their SVID
    /// arrives: served otherwise (their cluster is there), listener-less by design.
    pub held_back: OrdSet<String>,
    /// Pods (by uid) that would have a QUIC twin but are past the node's bound
    /// (`--quic-twin-max`): they have none.
    pub twins_refused: Vec<String>,
    /// Which builder made this snapshot (unique per [`crate::Builder`] in a process) and
    /// its position in that builder's sequence.
    pub lineage: u64,
    pub seq: u64,
    /// What each of the last steps changed, oldest first; the last one made `seq`.
    pub(crate) history: Arc<Vec<Arc<Changed>>>,
}

/// Same resources and rejects; where a snapshot sits in its sequence does not count.
impl PartialEq for Snapshot {
    fn eq(&self, o: &Self) -> bool {
        self.listeners == o.listeners
            && self.routes == o.routes
            && self.clusters == o.clusters
            && self.endpoints == o.endpoints
            && self.secrets == o.secrets
            && self.rejects == o.rejects
            && self.held_back == o.held_back
            && self.twins_refused == o.twins_refused
    }
}

impl Snapshot {
    /// The version of the resources of `kind`.
    pub fn version(&self, k: Kind) -> &str {
        match k {
            Kind::Cluster => &self.clusters.version,
            Kind::Endpoint => &self.endpoints.version,
            Kind::Listener => &self.listeners.version,
            Kind::Route => &self.routes.version,
            Kind::Secret => &self.secrets.version,
        }
    }

    /// The content hash of every resource of `kind`, by name.
    pub fn hashes(&self, k: Kind) -> &OrdMap<String, u64> {
        match k {
            Kind::Cluster => &self.clusters.hashes,
            Kind::Endpoint => &self.endpoints.hashes,
            Kind::Listener => &self.listeners.hashes,
            Kind::Route => &self.routes.hashes,
            Kind::Secret => &self.secrets.hashes,
        }
    }

    /// The names of `kind` that may differ between `earlier` and this snapshot: what the
    /// steps in between changed. `None` when `earlier` is not of this snapshot's
    /// lineage, is newer, or lies beyond the remembered history; compare everything then.
    pub fn changed_since(&self, earlier: &Snapshot, k: Kind) -> Option<BTreeSet<&str>> {
        Some(
            self.steps_since(earlier)?
                .iter()
                .flat_map(|c| c.kind(k).iter().map(String::as_str))
                .collect(),
        )
    }

    /// At most how many names of `kind` [`Snapshot::changed_since`] gives (a name changed
    /// by two steps counts twice), without collecting them: whether carrying what is
    /// known of `earlier` is worth it.
    pub fn changes_since(&self, earlier: &Snapshot, k: Kind) -> Option<usize> {
        Some(
            self.steps_since(earlier)?
                .iter()
                .map(|c| c.kind(k).len())
                .sum(),
        )
    }

    /// The steps from `earlier` to this snapshot, if remembered.
    fn steps_since(&self, earlier: &Snapshot) -> Option<&[Arc<Changed>]> {
        if earlier.lineage != self.lineage || earlier.seq > self.seq {
            return None;
        }
        let steps = (self.seq - earlier.seq) as usize;
        if steps > self.history.len() {
            return None;
        }
        Some(&self.history[self.history.len() - steps..])
    }

    /// Whether this snapshot serves the pod (its inbound listener and cluster; a pod whose
    /// listener strict mTLS holds back for its SVID counts without it: that is how it is
    /// served until the SVID comes, and its CNI ADD must not wait for the SVID, which the
    /// provider can attest only once the pod runs).
    pub fn holds_pod(&self, uid: &str, ips: &[IpAddr]) -> bool {
        if ips.is_empty() {
            return false;
        }
        let cluster = inbound_cluster_name(uid);
        let capture_ok = self
            .listeners
            .get(INBOUND)
            .is_some_and(|l| l.kind == ListenerKind::InboundCapture);
        let chain_ok = self
            .listeners
            .get(&inbound_listener_name(uid))
            .is_some_and(|l| match &l.kind {
                ListenerKind::InboundPod { chain: c } => {
                    c.pod_uid == uid && c.cluster == cluster && same_set(&c.ips, ips)
                }
                _ => false,
            });
        let cluster_ok = self.clusters.get(&cluster).is_some_and(|c| match &c.kind {
            ClusterKind::Static { endpoints, .. } => {
                ips.iter().all(|ip| endpoints.iter().any(|e| e.ip() == *ip))
            }
            ClusterKind::Eds => false,
        });
        let held = self.held_back.contains(uid)
            && !self
                .listeners
                .items
                .contains_key(&inbound_listener_name(uid));
        capture_ok && (chain_ok || held) && cluster_ok
    }

    /// Whether the proxy asks EDS for `name`: an EDS cluster of this snapshot has it.
    pub fn needs_eds(&self, name: &str) -> bool {
        self.clusters
            .get(name)
            .is_some_and(|c| c.kind == ClusterKind::Eds)
    }

    /// The names of the EDS clusters: what a proxy holding this snapshot asks EDS for.
    /// They are the keys of the EDS map (`endpoints.hashes`): each service cluster comes
    /// and goes with its load assignment.
    pub fn eds_cluster_names(&self) -> impl Iterator<Item = &str> {
        self.clusters
            .items
            .values()
            .filter(|c| c.kind == ClusterKind::Eds)
            .map(|c| c.name.as_str())
    }

    /// The secrets the listeners and clusters name: what the proxy asks SDS for before it
    /// serves them. (The calling pods' certificates on the outbound side are asked for
    /// on demand, at a connection's first handshake.)
    pub fn sds_names(&self) -> BTreeSet<&str> {
        let mut out = BTreeSet::new();
        for l in self.listeners.items.values() {
            match &l.kind {
                ListenerKind::InboundPod {
                    chain: InboundChain { tls: Some(t), .. },
                } => {
                    out.insert(t.certificate.as_str());
                    out.insert(crate::BUNDLE_SECRET);
                }
                ListenerKind::QuicTwins { twins } => {
                    out.extend(twins.iter().map(|t| t.certificate.as_str()));
                    out.insert(crate::BUNDLE_SECRET);
                }
                _ => {}
            }
        }
        if self.clusters.tallied() > 0 {
            out.insert(crate::BUNDLE_SECRET);
        }
        out
    }

    /// The route configurations the listeners refer to: what the proxy asks RDS for.
    pub fn rds_names(&self) -> impl Iterator<Item = &str> {
        self.listeners.items.values().filter_map(|l| match &l.kind {
            ListenerKind::HttpOutbound { route_config, .. } => Some(route_config.as_str()),
            ListenerKind::InboundCapture
            | ListenerKind::InboundPod { .. }
            | ListenerKind::QuicTwins { .. } => None,
        })
    }
}

fn same_set(a: &[IpAddr], b: &[IpAddr]) -> bool {
    a.iter().collect::<BTreeSet<_>>() == b.iter().collect::<BTreeSet<_>>()
}

/// Whether `cluster` is a mesh service's cluster (what on-demand mode fetches lazily), as
/// opposed to a local pod's.
pub fn is_outbound_cluster(cluster: &str) -> bool {
    cluster.starts_with("outbound|")
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
