//! The state of one incremental (delta) ADS stream, per resource type: what the proxy
//! subscribed to, which version of each resource it holds, what it ACKed. No I/O, like
//! [`super::stream::StreamState`], whose rules it shares where the protocols agree.
//!
//! Why delta: in state of the world every LDS and CDS response is the whole set, and
//! the proxy re-reads every listener and cluster of it. With one listener and one
//! cluster per pod, a pod's ADD then costs the proxy time in proportion to the pods on
//! the node. A delta response carries only the resources that changed.
//!
//! Rules:
//! - Each resource's version is its content hash (hex); the proxy reports the versions it
//!   holds when it reconnects (`initial_resource_versions`), and only resources whose
//!   content differs are sent again.
//! - LDS and CDS are wildcard: a first request without names (or with `*`) subscribes
//!   to every resource of the type. EDS and RDS follow the names subscribed and
//!   unsubscribed.
//! - A resource the proxy holds that is no longer in the snapshot (or no longer
//!   subscribed to by name) is named in `removed_resources`. A pod's certificate is first
//!   overwritten with its tombstone ([`super::tombstone`]) and named only once the proxy
//!   has answered that: the proxy keeps a removed secret that a draining listener uses.
//! - A certificate subscribed to that is neither held nor in the snapshot is named in
//!   `removed_resources` at once, also in a first request, so that the proxy's on-demand
//!   fetch fails fast instead of waiting out its timeout.
//! - A fresh subscription is always answered, even by an empty response, so the proxy's
//!   initial fetch completes and a reconnect shows as a config update.
//! - A request whose nonce is not the last one sent for its type is stale and ignored. A
//!   request without a nonce only changes the subscription.
//! - `error_detail` set: a NACK. The rejected content is not resent; the next change is.
//!
//! Cost: a push compares only the names the snapshots in between changed
//! ([`Snapshot::changed_since`]), so one endpoint change at 10,000 services looks at one
//! load assignment, not 10,000. A fresh subscription, or a stream that fell behind the
//! snapshot history, compares everything once. What the proxy holds and has ACKed are
//! persistent maps: recording them per response copies nothing. A reconnect reports
//! every version the proxy holds; after a takeover those are the snapshot's, so what it
//! holds is built as the snapshot's own map, and the comparison walks only where the
//! two differ (`held_versions`, `compare_all`). At 10,000 services a reconnect takes
//! about 11 ms of the runtime thread, decoding included (`cargo bench -p aether-e2e
//! --bench resume`; the server frees large requests elsewhere). A relay's digest resume
//! takes what the proxy holds, and its EDS subscription ([`Names`]), as the snapshot's
//! own maps: 0.01 ms for an unchanged mesh, 1.5 ms with three services changed. A
//! proxy that holds few of them (on-demand clusters) gets a map of its own, and its
//! first push looks up the few names instead of walking the snapshot (`compare_few`).
//!
//! Limits: the names a stream subscribes to grow across its requests, so each request is
//! checked before it is applied ([`DeltaState::check_limits`]): at most
//! [`MAX_SUBSCRIBED_NAMES`] names per type, none longer than [`MAX_NAME_LEN`] bytes.
//! Past either the server ends the stream with RESOURCE_EXHAUSTED naming the limit.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use aether_model::{Snapshot, is_outbound_cluster};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use imbl::OrdMap;
use imbl::ordmap::DiffItem;

use shared_proto::resume;

use super::digest::Resumed;
use super::encoded::Encoded;
use super::kind::{KIND_COUNT, KINDS, Kind, from_type_url, type_url, wildcard, wire_version};
use super::protocol::{Event, Protocol};
use super::tombstone;
use crate::writers::Observed;

/// The most resource names one stream may subscribe to (or report holding) per type. A
/// node at 10,000 services subscribes to one load assignment per service port, so even
/// at three ports each it needs under a third of this.
pub const MAX_SUBSCRIBED_NAMES: usize = 100_000;
/// The longest resource name a request may carry. The model's longest are about 150
/// bytes (`outbound|<port>||<63-byte name>.<63-byte namespace>`, `inbound|<pod uid>`).
pub const MAX_NAME_LEN: usize = 512;

/// The limits on what one ADS stream may subscribe to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriptionLimits {
    /// Names per type and stream.
    pub max_names: usize,
    /// Bytes per name.
    pub max_name_len: usize,
}

impl Default for SubscriptionLimits {
    fn default() -> Self {
        Self {
            max_names: MAX_SUBSCRIBED_NAMES,
            max_name_len: MAX_NAME_LEN,
        }
    }
}

/// A request that would take its stream past a [`SubscriptionLimits`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("{}: subscribing to {names} resource names is over the limit of {max} per type and stream", type_url(*kind))]
    TooManyNames {
        kind: Kind,
        names: usize,
        max: usize,
    },
    #[error("{}: resource name {name:?} is {len} bytes, over the limit of {max}", type_url(*kind))]
    NameTooLong {
        kind: Kind,
        /// The name's first 64 bytes.
        name: String,
        len: usize,
        max: usize,
    },
}

impl LimitError {
    pub fn kind(&self) -> Kind {
        match self {
            Self::TooManyNames { kind, .. } | Self::NameTooLong { kind, .. } => *kind,
        }
    }

    /// Which limit, as the metric labels it.
    pub fn limit(&self) -> &'static str {
        match self {
            Self::TooManyNames { .. } => "names",
            Self::NameTooLong { .. } => "name_length",
        }
    }
}

impl SubscriptionLimits {
    /// Every name at most `max_name_len` bytes.
    pub fn check_lengths<'a>(
        &self,
        kind: Kind,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), LimitError> {
        match names.into_iter().find(|n| n.len() > self.max_name_len) {
            None => Ok(()),
            Some(n) => {
                let mut end = n.len().min(64);
                while !n.is_char_boundary(end) {
                    end -= 1;
                }
                Err(LimitError::NameTooLong {
                    kind,
                    name: n[..end].to_string(),
                    len: n.len(),
                    max: self.max_name_len,
                })
            }
        }
    }

    /// At most `max_names` names.
    pub fn check_count(&self, kind: Kind, names: usize) -> Result<(), LimitError> {
        if names > self.max_names {
            return Err(LimitError::TooManyNames {
                kind,
                names,
                max: self.max_names,
            });
        }
        Ok(())
    }
}

/// The names a type is subscribed to, kept as a persistent map whose values mean nothing,
/// so that a subscription re-stated by its names' digest ([`resume::RELIED`]) can share
/// the snapshot's own EDS map, whose keys are its EDS clusters
/// ([`Snapshot::eds_cluster_names`]): taking the subscription then costs nothing, and a
/// comparison with what the proxy holds or the snapshot needs walks only where they
/// differ ([`diff_keys`]). At 10,000 services building the set took about half a
/// millisecond of each such resume, and each of the two walks of the first answer as
/// much again.
#[derive(Debug, Default, Clone, PartialEq)]
struct Names(OrdMap<String, u64>);

impl Names {
    /// The keys of `map` as the names (a snapshot's map: shared, not copied).
    fn keys_of(map: &OrdMap<String, u64>) -> Self {
        Self(map.clone())
    }

    fn contains(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    /// Adds `name`; true when it was not there. A name already there leaves the map
    /// untouched, and so shared.
    fn insert(&mut self, name: String) -> bool {
        if self.0.contains_key(&name) {
            return false;
        }
        self.0.insert(name, 0);
        true
    }

    fn remove(&mut self, name: &str) -> bool {
        self.0.remove(name).is_some()
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn iter(&self) -> impl Iterator<Item = &String> {
        self.0.keys()
    }
}

impl FromIterator<String> for Names {
    fn from_iter<I: IntoIterator<Item = String>>(names: I) -> Self {
        Self(names.into_iter().map(|n| (n, 0u64)).collect())
    }
}

impl Extend<String> for Names {
    fn extend<I: IntoIterator<Item = String>>(&mut self, names: I) {
        for n in names {
            self.insert(n);
        }
    }
}

/// The keys of `a` not in `b` (`in_a`), or of `b` not in `a`: one walk of the maps'
/// difference, which skips the structure they share.
fn diff_keys<'a>(
    a: &'a OrdMap<String, u64>,
    b: &'a OrdMap<String, u64>,
    in_a: bool,
) -> impl Iterator<Item = &'a String> {
    a.diff(b).filter_map(move |d| match d {
        DiffItem::Remove(n, _) if in_a => Some(n),
        DiffItem::Add(n, _) if !in_a => Some(n),
        _ => None,
    })
}

#[derive(Debug, Default)]
struct TypeState {
    subscribed: bool,
    /// Subscribed to every resource of the type (LDS, CDS).
    wildcard: bool,
    /// Names subscribed to explicitly (EDS, RDS).
    names: Names,
    /// Content hash of each resource the proxy holds once it applies what was sent.
    holds: OrdMap<String, u64>,
    /// Answer the next `pending` even if nothing changed: a fresh subscription.
    answer: bool,
    /// Compare every resource at the next `pending`, not only what changed.
    full: bool,
    /// Names whose subscription changed since the last `pending`: compared then too.
    extra: BTreeSet<String>,
    /// SDS: pod certificates sent as their tombstone ([`tombstone`]) and not answered
    /// yet; once the proxy answers, they are compared again, and removed.
    tombstoned: BTreeSet<String>,
    /// The last response: its nonce and `holds` after it.
    sent: Option<(String, OrdMap<String, u64>)>,
    /// `holds` as of the last ACKed response.
    acked: OrdMap<String, u64>,
    /// EDS and RDS: names the snapshot needs (its EDS clusters, its listeners' route
    /// configurations) that the proxy has not subscribed to yet.
    unsubscribed_needed: BTreeSet<String>,
}

impl TypeState {
    /// Whether the proxy gets `name` of this type: named, or in the wildcard. With
    /// on-demand clusters, the wildcard CDS subscription leaves out the mesh's clusters,
    /// which the proxy names when it needs them.
    fn wants(&self, name: &str, lazy: bool) -> bool {
        self.names.contains(name) || (self.wildcard && !(lazy && is_outbound_cluster(name)))
    }
}

/// What the proxy holds by its first request's `initial_resource_versions` (unreadable
/// versions left out), built from the snapshot's own map of `current` hashes: after a
/// takeover the two mostly agree, so the result shares the snapshot's structure, and the
/// first push's comparison skips what they share ([`compare_all`]) instead of looking up
/// every name. Inserting 10,000 names one by one would cost milliseconds before the
/// first answer. A proxy that reports less than half of the snapshot (with on-demand
/// clusters it holds the node's own and the observed ones, a few dozen of 10,000) gets a
/// map of its own instead: taking 10,000 names out of the shared one, one by one, cost
/// about 9 ms on each of the CDS and EDS requests of a reconnect.
fn held_versions(
    current: &OrdMap<String, u64>,
    initial: &HashMap<String, String>,
) -> OrdMap<String, u64> {
    // A bucket resume's entry names no resource (`resume::RELIED`).
    let parse = |name: &String, v: &String| {
        u64::from_str_radix(v, 16)
            .ok()
            .filter(|_| name != resume::RELIED)
    };
    if initial.len() < current.len() / 2 {
        return initial
            .iter()
            .filter_map(|(name, v)| Some((name.clone(), parse(name, v)?)))
            .collect();
    }
    let held_as_current =
        |name: &String, hash: &u64| initial.get(name).and_then(|v| parse(name, v)) == Some(*hash);
    // Not held, or at another version: out, before what is held goes in.
    let differ: Vec<&String> = current
        .iter()
        .filter(|(n, h)| !held_as_current(n, h))
        .map(|(n, _)| n)
        .collect();
    let mut holds = current.clone();
    for name in &differ {
        holds.remove(*name);
    }
    if current.len() - differ.len() < initial.len() {
        for (name, version) in initial {
            if let Some(v) = parse(name, version)
                && current.get(name) != Some(&v)
            {
                holds.insert(name.clone(), v);
            }
        }
    }
    holds
}

/// A full comparison of what the proxy holds with the snapshot's `hashes`: what to send
/// (wanted, and not held at that version) and what to remove (held, but not wanted or
/// not in the snapshot). Walks the two maps' difference, which skips the structure they
/// share, plus, when some names are not wanted, what is held and unchanged.
fn compare_all(
    t: &TypeState,
    hashes: &OrdMap<String, u64>,
    lazy: bool,
) -> (BTreeSet<String>, Vec<String>) {
    if let Some(unnamed) = wanted_unnamed(t, hashes, lazy)
        && (t.names.len() + t.holds.len() + unnamed.len()) * 4 <= hashes.len()
    {
        return compare_few(t, hashes, lazy, unnamed);
    }
    let (mut to_send, mut removed) = (BTreeSet::new(), Vec::new());
    for d in t.holds.diff(hashes) {
        match d {
            DiffItem::Add(n, _) | DiffItem::Update { new: (n, _), .. } if t.wants(n, lazy) => {
                to_send.insert(n.clone());
            }
            DiffItem::Add(..) => {}
            DiffItem::Update { old: (n, _), .. } | DiffItem::Remove(n, _) => {
                removed.push(n.clone())
            }
        }
    }
    // Held but not wanted (also when unchanged): only a type that is not a plain
    // wildcard can have those: one walk of the difference of `holds` and `names`
    // instead of a lookup per name.
    if !t.wildcard || lazy {
        let unnamed = diff_keys(&t.holds, &t.names.0, true);
        removed.extend(
            unnamed
                .filter(|n| !(t.wildcard && !(lazy && is_outbound_cluster(n))))
                .cloned(),
        );
        removed.sort();
        removed.dedup();
    }
    (to_send, removed)
}

/// What the type wants of `hashes` beyond the names it subscribed to, when that can be
/// had without a walk of the whole map: nothing for a named subscription; for CDS with
/// on-demand clusters, whose wildcard leaves out the mesh's `outbound|` clusters, the keys
/// on either side of their range. None for a plain wildcard, which wants everything.
fn wanted_unnamed<'a>(
    t: &TypeState,
    hashes: &'a OrdMap<String, u64>,
    lazy: bool,
) -> Option<Vec<(&'a String, &'a u64)>> {
    match (t.wildcard, lazy) {
        (false, _) => Some(Vec::new()),
        // Every key from "outbound|" up to "outbound}" ('}' follows '|') starts with "outbound|".
        (true, true) => {
            use std::ops::Bound::{Excluded, Included, Unbounded};
            let below = hashes.range::<_, str>((Unbounded, Excluded("outbound|")));
            Some(
                below
                    .chain(hashes.range::<_, str>((Included("outbound}"), Unbounded)))
                    .collect(),
            )
        }
        (true, false) => None,
    }
}

/// [`compare_all`] from a lookup per name the proxy holds or the type wants (`unnamed`,
/// from [`wanted_unnamed`], and its subscribed names), for when those are few beside the
/// snapshot. After a reconnect with on-demand clusters at 10,000 services a walk of the
/// whole map cost 2 to 3 ms on each of CDS and EDS, for a few dozen names.
fn compare_few(
    t: &TypeState,
    hashes: &OrdMap<String, u64>,
    lazy: bool,
    unnamed: Vec<(&String, &u64)>,
) -> (BTreeSet<String>, Vec<String>) {
    let changed = |n: &String, h: &u64| t.holds.get(n) != Some(h);
    let mut to_send: BTreeSet<String> = unnamed
        .into_iter()
        .filter(|(n, h)| changed(n, h))
        .map(|(n, _)| n.clone())
        .collect();
    for n in t.names.iter() {
        if let Some(h) = hashes.get(n)
            && changed(n, h)
        {
            to_send.insert(n.clone());
        }
    }
    let removed = t
        .holds
        .keys()
        .filter(|n| !(t.wants(n, lazy) && hashes.contains_key(*n)))
        .cloned()
        .collect();
    (to_send, removed)
}

/// Whether the snapshot needs the proxy to hold `name` of `kind`, given the clusters it
/// holds (`clusters`: it asks EDS for those).
fn needed(s: &Snapshot, kind: Kind, name: &str, clusters: &OrdMap<String, u64>) -> bool {
    match kind {
        Kind::Endpoint => s.needs_eds(name) && clusters.contains_key(name),
        Kind::Route => s.rds_names().any(|n| n == name),
        Kind::Secret => s.sds_names().contains(name),
        Kind::Cluster | Kind::Listener => s.hashes(kind).contains_key(name),
    }
}

pub struct DeltaState {
    current: Arc<Snapshot>,
    /// The snapshot the last `pending` compared against: what every type's `holds`
    /// reflects.
    synced: Option<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    nonce: u64,
    types: [TypeState; KIND_COUNT],
    /// With on-demand clusters: the node's observed upstreams, which this stream adds to.
    observed: Option<Arc<Observed>>,
    /// Types a relay's digest resumed (`super::digest`), whole or in buckets: what the
    /// proxy holds, taken at the type's first request with its `initial_resource_versions`.
    resumed: [Option<Resumed>; KIND_COUNT],
    /// Types whose names a relay's digest matched: the snapshot whose names the type's
    /// first request stands for when it names [`shared_proto::resume::RELIED`].
    names_from: [Option<Arc<Snapshot>>; KIND_COUNT],
}

impl DeltaState {
    /// Whether `req` keeps the stream within `limits`: no name in it longer than the
    /// limit, and its type's names (those subscribed so far plus the new ones, or the
    /// versions a first request reports holding) no more than the limit. Checked before
    /// the request is applied, so a refused request changes nothing. A type not served
    /// is ignored by [`Protocol::on_request`] and holds nothing, so it is not checked.
    pub fn check_limits(
        &self,
        req: &DeltaDiscoveryRequest,
        limits: &SubscriptionLimits,
    ) -> Result<(), LimitError> {
        let Some(kind) = from_type_url(&req.type_url) else {
            return Ok(());
        };
        let named = req
            .resource_names_subscribe
            .iter()
            .chain(&req.resource_names_unsubscribe);
        limits.check_lengths(
            kind,
            named
                .chain(req.initial_resource_versions.keys())
                .map(String::as_str),
        )?;
        let t = &self.types[kind.index()];
        if !t.subscribed {
            limits.check_count(kind, req.initial_resource_versions.len())?;
        }
        if t.names.len() + req.resource_names_subscribe.len() <= limits.max_names {
            return Ok(());
        }
        let new: BTreeSet<&str> = req
            .resource_names_subscribe
            .iter()
            .map(String::as_str)
            .filter(|n| *n != "*" && !t.names.contains(n))
            .collect();
        limits.check_count(kind, t.names.len() + new.len())
    }

    /// The proxy holds `held` of `kind` (a snapshot's, by a relay's digest): taken at the
    /// type's first request as [`Resumed::held`] says. [`Resumed::Names`] is the type's
    /// subscription instead, taken when the first request relies on it.
    pub fn resume_held(&mut self, kind: Kind, held: Resumed) {
        match held {
            Resumed::Names(s) => self.names_from[kind.index()] = Some(s),
            held => self.resumed[kind.index()] = Some(held),
        }
    }

    /// Whether the wildcard CDS subscription leaves the mesh's clusters out.
    fn lazy(&self, kind: Kind) -> bool {
        kind == Kind::Cluster && self.observed.is_some()
    }

    /// Whether the proxy acked every resource of `kind` the snapshot needs it to hold,
    /// compared name by name.
    fn acked_in_full(&self, kind: Kind) -> bool {
        let s = &*self.current;
        let t = &self.types[kind.index()];
        let current = s.hashes(kind);
        let acked = |n: &str| t.acked.get(n).is_some_and(|h| current.get(n) == Some(h));
        match kind {
            Kind::Listener | Kind::Cluster => {
                let lazy = self.lazy(kind);
                t.acked.keys().all(|n| current.contains_key(n))
                    && current
                        .keys()
                        .filter(|n| !lazy || t.wants(n, lazy))
                        .all(|n| acked(n))
            }
            // With on-demand clusters the proxy holds a few of them: walk those.
            Kind::Endpoint if self.observed.is_some() => self.types[Kind::Cluster.index()]
                .acked
                .keys()
                .filter(|c| s.needs_eds(c))
                .all(|c| acked(c)),
            Kind::Endpoint => s.eds_cluster_names().all(acked),
            Kind::Route => s.rds_names().all(acked),
            Kind::Secret => s.sds_names().into_iter().all(acked),
        }
    }
}

impl Protocol for DeltaState {
    type Request = DeltaDiscoveryRequest;
    type Response = DeltaDiscoveryResponse;
    const NAME: &'static str = "delta";

    fn new(current: Arc<Snapshot>, encoded: Arc<Encoded>) -> Self {
        Self {
            current,
            synced: None,
            encoded,
            nonce: 0,
            types: Default::default(),
            observed: None,
            resumed: Default::default(),
            names_from: Default::default(),
        }
    }

    fn node_id(req: &DeltaDiscoveryRequest) -> Option<&str> {
        req.node.as_ref().map(|n| n.id.as_str())
    }

    fn describe(r: &DeltaDiscoveryResponse) -> (&str, &str, &str, usize) {
        (
            &r.type_url,
            &r.system_version_info,
            &r.nonce,
            r.resources.len() + r.removed_resources.len(),
        )
    }

    fn on_demand(&mut self, observed: Arc<Observed>) {
        self.observed = Some(observed);
    }

    fn current(&self) -> &Arc<Snapshot> {
        &self.current
    }

    fn set_snapshot(&mut self, s: Arc<Snapshot>) {
        self.current = s;
    }

    fn on_request(&mut self, req: &DeltaDiscoveryRequest) -> Event {
        let Some(kind) = from_type_url(&req.type_url) else {
            return Event::UnknownType {
                type_url: req.type_url.clone(),
            };
        };
        let current = self.current.clone();
        let lazy = self.lazy(kind);
        let clusters = self.types[Kind::Cluster.index()].holds.clone();
        let resumed = self.resumed[kind.index()].take();
        let names_from = self.names_from[kind.index()].take();
        let t = &mut self.types[kind.index()];
        let first = !t.subscribed;
        if first {
            t.subscribed = true;
            t.answer = true;
            t.full = true;
            t.wildcard = wildcard(kind) && req.resource_names_subscribe.is_empty();
            // A reconnect: the proxy keeps what it held on the old stream, as it lists
            // it, or as the relay's digest said (the snapshot's, shared).
            let initial = &req.initial_resource_versions;
            t.holds = match resumed.and_then(|r| r.held(initial)) {
                Some(held) => held,
                None => held_versions(current.hashes(kind), initial),
            };
            t.acked = t.holds.clone();
            if lazy
                && t.wildcard
                && let Some(o) = &self.observed
            {
                // The proxy gets what the node's pods called before, up front.
                t.names.extend(o.names());
            }
        }
        let at_once = first && !lazy;
        if at_once {
            // A fresh subscription names everything at once: one sorted build of the set
            // instead of an insert per name (10,000 EDS names on a reconnect at scale).
            t.wildcard |= req.resource_names_subscribe.iter().any(|n| n == "*");
            let relied = resume::RELIED;
            let listed = req
                .resource_names_subscribe
                .iter()
                .filter(|n| *n != "*" && *n != relied)
                .cloned();
            t.names = Names::default();
            // A relay's re-statement by the names' digest: the snapshot's names, as
            // matched, shared with it (the keys of its EDS map are its EDS clusters).
            if req.resource_names_subscribe.iter().any(|n| n == relied) {
                match (&names_from, kind) {
                    (Some(s), Kind::Endpoint) => {
                        t.names = Names::keys_of(s.hashes(Kind::Endpoint));
                    }
                    _ => tracing::warn!(
                        type_url = %req.type_url,
                        "a re-statement relies on names no digest matched: taken as listed"
                    ),
                }
            }
            t.names.extend(listed);
            if kind == Kind::Secret {
                // Named, not held and not in the snapshot (a certificate asked for on
                // demand after a reconnect, of a pod gone meanwhile): said so at once.
                let unknown = t.names.iter().filter(|n| {
                    !current.secrets.hashes.contains_key(*n) && !t.holds.contains_key(*n)
                });
                t.extra.extend(unknown.cloned());
            }
        }
        for n in req.resource_names_subscribe.iter().filter(|_| !at_once) {
            if n == "*" {
                t.wildcard = true;
                t.full = true;
            } else if lazy
                && is_outbound_cluster(n)
                && current.clusters.hashes.contains_key(n)
                && let Some(o) = &self.observed
            {
                // A pod's first call to a service: on-demand CDS.
                if o.insert(n) {
                    tracing::info!(cluster = %n, "observed upstream: the proxy asked for it on demand");
                }
                if t.names.insert(n.clone()) {
                    t.extra.insert(n.clone());
                    t.answer |= !t.holds.contains_key(n);
                }
            } else if t.names.insert(n.clone()) {
                t.unsubscribed_needed.remove(n);
                // A first subscription compares everything anyway.
                if !first {
                    t.extra.insert(n.clone());
                    t.answer |= !t.holds.contains_key(n);
                }
            }
        }
        for n in &req.resource_names_unsubscribe {
            if n == "*" {
                t.wildcard = false;
                t.full = true;
            } else {
                t.names.remove(n);
                if !t.wildcard {
                    // The proxy drops what it no longer asks for.
                    t.holds.remove(n);
                    t.acked.remove(n);
                    if needed(&current, kind, n, &clusters) {
                        t.unsubscribed_needed.insert(n.clone());
                    }
                }
            }
        }
        if first || req.response_nonce.is_empty() {
            return Event::Subscribe {
                kind,
                version: format!("{} held", req.initial_resource_versions.len()),
                holds_nothing: first && t.holds.is_empty(),
            };
        }
        let Some((nonce, holds)) = t.sent.clone().filter(|(n, _)| *n == req.response_nonce) else {
            return Event::Stale {
                kind,
                nonce: req.response_nonce.clone(),
            };
        };
        // The proxy has the tombstones of the last response: their names can go now.
        t.extra.append(&mut t.tombstoned);
        match &req.error_detail {
            Some(status) => Event::Nack {
                kind,
                rejected_version: current.version(kind).to_string(),
                nonce,
                message: status.message.clone(),
            },
            None => {
                t.acked = holds;
                Event::Ack {
                    kind,
                    version: current.version(kind).to_string(),
                    nonce,
                }
            }
        }
    }

    fn pending(&mut self) -> Vec<DeltaDiscoveryResponse> {
        let mut out = Vec::new();
        let current = self.current.clone();
        let synced = self.synced.replace(current.clone());
        // The clusters this push sends or removes: the EDS the proxy needs follows them.
        let mut cluster_moves: BTreeSet<String> = BTreeSet::new();
        for kind in KINDS {
            let lazy = self.lazy(kind);
            let clusters = self.types[Kind::Cluster.index()].holds.clone();
            let t = &mut self.types[kind.index()];
            if !t.subscribed {
                continue;
            }
            let hashes = current.hashes(kind);
            // The names to compare: what changed since the last look, or everything.
            let changed = if t.full {
                None
            } else {
                synced
                    .as_ref()
                    .and_then(|old| current.changed_since(old, kind))
            };
            let (to_send, mut removed): (BTreeSet<String>, Vec<String>) = match &changed {
                Some(names) => {
                    let mut to_send = BTreeSet::new();
                    let mut removed = Vec::new();
                    for n in names
                        .iter()
                        .copied()
                        .chain(t.extra.iter().map(String::as_str))
                    {
                        let now = hashes.get(n).filter(|_| t.wants(n, lazy));
                        match (now, t.holds.get(n)) {
                            (Some(h), held) if held != Some(h) => {
                                to_send.insert(n.to_string());
                            }
                            (None, Some(_)) => removed.push(n.to_string()),
                            // Named, newly, but not in the snapshot: say so at once, so
                            // that an on-demand request fails fast instead of timing out.
                            (None, None)
                                if t.extra.contains(n)
                                    && t.names.contains(n)
                                    && !hashes.contains_key(n) =>
                            {
                                removed.push(n.to_string())
                            }
                            _ => {}
                        }
                    }
                    removed.sort();
                    removed.dedup();
                    (to_send, removed)
                }
                None => {
                    let (to_send, mut removed) = compare_all(t, hashes, lazy);
                    let unknown = t.extra.iter().filter(|n| {
                        t.names.contains(n) && !hashes.contains_key(*n) && !t.holds.contains_key(*n)
                    });
                    removed.extend(unknown.cloned());
                    removed.sort();
                    removed.dedup();
                    (to_send, removed)
                }
            };
            // A pod certificate the proxy holds goes as its tombstone first, and only then
            // by name: the proxy keeps a removed secret that something still uses.
            let mut tombstones = Vec::new();
            if kind == Kind::Secret {
                removed.retain(|n| {
                    let first = tombstone::applies_to(n)
                        && t.holds.get(n).is_some_and(|h| *h != tombstone::HASH);
                    if first {
                        tombstones.push(n.clone());
                    }
                    !first
                });
            }
            // What the snapshot needs of EDS, RDS and SDS that the proxy has not asked for.
            // (Secrets are named by listeners and clusters both: always compared in full;
            // there are a few per local pod.)
            let refer = match kind {
                Kind::Endpoint => Some(Kind::Cluster),
                Kind::Route | Kind::Secret => Some(Kind::Listener),
                Kind::Cluster | Kind::Listener => None,
            };
            if let Some(by) = refer {
                let referrers = if t.full {
                    None
                } else {
                    synced
                        .as_ref()
                        .and_then(|old| current.changed_since(old, by))
                };
                match (kind, referrers) {
                    (Kind::Endpoint, Some(changed)) => {
                        for c in changed
                            .into_iter()
                            .chain(cluster_moves.iter().map(String::as_str))
                        {
                            if needed(&current, kind, c, &clusters) && !t.names.contains(c) {
                                t.unsubscribed_needed.insert(c.to_string());
                            } else {
                                t.unsubscribed_needed.remove(c);
                            }
                        }
                    }
                    (Kind::Route, Some(listeners)) if listeners.is_empty() => {}
                    (Kind::Endpoint, None) => {
                        // The EDS clusters the proxy holds and has not named. A proxy
                        // holding a few of the snapshot's clusters (on-demand clusters)
                        // gets a lookup for each of those; any other, the snapshot's EDS
                        // clusters (the keys of its EDS map) it has not named, from one
                        // walk of the names' difference with that map, which skips what
                        // they share (all of it after a names resume).
                        t.unsubscribed_needed = if clusters.len() * 4 < current.clusters.len() {
                            let owed = |c: &&String| current.needs_eds(c) && !t.names.contains(c);
                            clusters.keys().filter(owed).cloned().collect()
                        } else {
                            let eds = current.hashes(Kind::Endpoint);
                            diff_keys(&t.names.0, eds, false)
                                .filter(|c| clusters.contains_key(*c))
                                .cloned()
                                .collect()
                        };
                    }
                    _ => {
                        let all: Vec<&str> = match kind {
                            Kind::Secret => current.sds_names().into_iter().collect(),
                            _ => current.rds_names().collect(),
                        };
                        t.unsubscribed_needed = all
                            .into_iter()
                            .filter(|n| !t.names.contains(n))
                            .map(String::from)
                            .collect();
                    }
                }
            }
            t.full = false;
            t.extra.clear();
            if to_send.is_empty() && removed.is_empty() && tombstones.is_empty() && !t.answer {
                continue;
            }
            t.answer = false;
            if kind == Kind::Cluster {
                cluster_moves.extend(to_send.iter().cloned());
                cluster_moves.extend(removed.iter().cloned());
            }
            for n in &to_send {
                t.holds.insert(n.clone(), hashes[n]);
            }
            for n in &removed {
                t.holds.remove(n);
            }
            for n in &tombstones {
                t.holds.insert(n.clone(), tombstone::HASH);
                t.tombstoned.insert(n.clone());
            }
            self.nonce += 1;
            let nonce = self.nonce.to_string();
            let names: BTreeSet<&String> = to_send.iter().collect();
            let resources = self
                .encoded
                .get(&current, kind, &names)
                .into_iter()
                .zip(&to_send)
                .map(|(any, name)| Resource {
                    name: name.clone(),
                    version: wire_version(hashes[name]),
                    resource: Some(any),
                    ..Default::default()
                })
                .chain(tombstones.iter().map(|n| Resource {
                    name: n.clone(),
                    version: wire_version(tombstone::HASH),
                    resource: Some(tombstone::encode(n)),
                    ..Default::default()
                }))
                .collect();
            out.push(DeltaDiscoveryResponse {
                system_version_info: current.version(kind).to_string(),
                resources,
                type_url: type_url(kind).to_string(),
                removed_resources: removed,
                nonce: nonce.clone(),
                ..Default::default()
            });
            t.sent = Some((nonce, t.holds.clone()));
        }
        out
    }

    /// Every listener and cluster (and no removed one), and the EDS, RDS and SDS resources
    /// the snapshot's clusters and listeners refer to.
    ///
    /// Asked after every request, so the cheap answers come first: a type pushed since the
    /// snapshot changed is settled by what it holds, and only then are the other types
    /// (those not subscribed yet) compared with the snapshot, each stopping at its first
    /// miss. At 10,000 services one full comparison took a millisecond or more, and a
    /// reconnect asks eight times.
    fn acked_current(&self) -> bool {
        let in_sync = self
            .synced
            .as_ref()
            .is_some_and(|x| Arc::ptr_eq(x, &self.current));
        let mut compare = [false; KIND_COUNT];
        for kind in KINDS {
            let t = &self.types[kind.index()];
            if !(in_sync && t.subscribed && !t.full && t.extra.is_empty() && !t.answer) {
                compare[kind.index()] = true;
                continue;
            }
            // `holds` is the snapshot (what the proxy wants of it) as of the last push:
            // all of it acked, and nothing needed left unsubscribed.
            let acked_all = t.acked.ptr_eq(&t.holds) || t.acked == t.holds;
            let complete = match kind {
                Kind::Listener | Kind::Cluster => t.wildcard,
                Kind::Endpoint | Kind::Route | Kind::Secret => t.unsubscribed_needed.is_empty(),
            };
            if !(acked_all && complete) {
                return false;
            }
        }
        KINDS
            .into_iter()
            .filter(|k| compare[k.index()])
            .all(|kind| self.acked_in_full(kind))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_model::{
        Change, Endpoint, EndpointState, Inputs, Pod, RegistryView, Service, build,
    };
    use envoy_types::pb::google::rpc::Status;

    use crate::test_rng::Rng;
    use std::collections::BTreeMap;

    fn inputs(endpoints: usize, pods: usize) -> Inputs {
        let eps = (0..endpoints)
            .map(|i| Endpoint {
                address: format!("10.0.0.{}", i + 1).parse().unwrap(),
                port: 8080,
                service_port: 80,
                node: String::new(),
                pod: String::new(),
                state: EndpointState::Healthy,
                mtls: false,
            })
            .collect();
        let svc = Service {
            name: "web".into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: eps,
        };
        let mut i = Inputs {
            registry: RegistryView::new([svc]),
            ..Default::default()
        };
        for p in 0..pods {
            let pod = pod(
                format!("uid-{p}"),
                format!("p{p}"),
                &format!("10.244.0.{}", p + 1),
            );
            i.pods.insert(pod.uid.clone(), pod);
        }
        i
    }

    /// A running pod in namespace `d` with one address.
    fn pod(uid: String, name: String, ip: &str) -> Pod {
        Pod {
            container_id: format!("c-{uid}"),
            uid,
            namespace: "d".into(),
            name,
            netns: "/var/run/netns/x".into(),
            ifname: "eth0".into(),
            ips: vec![ip.parse().unwrap()],
            terminating: false,
            no_quic_twin: false,
        }
    }

    fn snap(endpoints: usize, pods: usize) -> Arc<Snapshot> {
        Arc::new(build(&inputs(endpoints, pods)))
    }

    const CLA: &str = "outbound|80||web.d";

    fn req(
        kind: Kind,
        nonce: &str,
        subscribe: &[&str],
        error: Option<&str>,
    ) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            type_url: type_url(kind).into(),
            response_nonce: nonce.into(),
            resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
            error_detail: error.map(|m| Status {
                code: 13,
                message: m.into(),
                details: vec![],
            }),
            ..Default::default()
        }
    }

    /// (type, nonce, names sent, names removed) of each pending response.
    fn sent(st: &mut DeltaState) -> Vec<(&'static str, String, Vec<String>, Vec<String>)> {
        st.pending()
            .into_iter()
            .map(|r| {
                let names = r.resources.iter().map(|x| x.name.clone()).collect();
                (
                    from_type_url(&r.type_url).unwrap().short(),
                    r.nonce,
                    names,
                    r.removed_resources,
                )
            })
            .collect()
    }

    /// Subscribes to all four types as the proxy does on a fresh stream and ACKs the
    /// answers; returns the state.
    fn subscribed(s: Arc<Snapshot>) -> DeltaState {
        let mut st = DeltaState::new(s.clone(), Arc::default());
        st.on_request(&req(Kind::Cluster, "", &[], None));
        st.on_request(&req(Kind::Listener, "", &[], None));
        st.on_request(&req(Kind::Endpoint, "", &[CLA], None));
        st.on_request(&req(Kind::Route, "", &["outbound"], None));
        for (kind, nonce, _, _) in sent(&mut st) {
            let k = KINDS.into_iter().find(|k| k.short() == kind).unwrap();
            st.on_request(&req(k, &nonce, &[], None));
        }
        assert!(st.acked_current());
        st
    }

    #[test]
    fn a_pod_add_sends_only_its_listener_and_cluster_and_a_del_removes_them() {
        let mut st = subscribed(snap(2, 20));
        let before = st.current().clone();
        st.set_snapshot(snap(2, 21));
        let out = sent(&mut st);
        assert_eq!(out.len(), 2, "{out:?}");
        let new_cluster: Vec<_> = st
            .current()
            .clusters
            .hashes
            .keys()
            .filter(|n| !before.clusters.hashes.contains_key(*n))
            .cloned()
            .collect();
        let new_listener: Vec<_> = st
            .current()
            .listeners
            .hashes
            .keys()
            .filter(|n| !before.listeners.hashes.contains_key(*n))
            .cloned()
            .collect();
        assert_eq!(out[0].0, "CDS");
        assert_eq!(out[0].2, new_cluster);
        assert_eq!(out[1].0, "LDS");
        assert_eq!(out[1].2, new_listener);
        assert!(!st.acked_current(), "not acked before the ACKs");
        st.on_request(&req(Kind::Cluster, &out[0].1, &[], None));
        st.on_request(&req(Kind::Listener, &out[1].1, &[], None));
        assert!(st.acked_current());

        st.set_snapshot(snap(2, 20));
        let out = sent(&mut st);
        assert_eq!(
            out.iter()
                .map(|o| (o.0, o.2.len(), o.3.clone()))
                .collect::<Vec<_>>(),
            vec![
                ("CDS", 0, new_cluster.clone()),
                ("LDS", 0, new_listener.clone())
            ]
        );
        assert!(
            !st.acked_current(),
            "a removal is not acked until the proxy says so"
        );
        st.on_request(&req(Kind::Cluster, &out[0].1, &[], None));
        st.on_request(&req(Kind::Listener, &out[1].1, &[], None));
        assert!(st.acked_current());
    }

    /// `snap(1, pods)` with identity on (strict) and every pod's SVID: each pod has its
    /// inbound and its outbound certificate, both named by its uid.
    fn snap_with_svids(pods: usize) -> Arc<Snapshot> {
        let mut i = inputs(1, pods);
        let svid = |p: &str| aether_model::Svid {
            spiffe_id: format!("spiffe://t/ns/d/pod/{p}"),
            chain_pem: format!("CHAIN {p}"),
            key_pem: format!("KEY {p}"),
            serial: "01".into(),
            not_before: 0,
            not_after: 1,
        };
        i.identity = aether_model::Identity {
            trust_domain: Some("t".into()),
            mode: aether_model::MtlsMode::Strict,
            bundle: Some("CA".into()),
            agent: None,
            pods: i.pods.keys().map(|u| (u.clone(), svid(u))).collect(),
        };
        Arc::new(build(&i))
    }

    /// (nonce, names sent with the tombstone's version, names sent otherwise, removed).
    type Sent = (String, Vec<String>, Vec<String>, Vec<String>);

    fn sent_tombstones(st: &mut DeltaState) -> Vec<Sent> {
        st.pending()
            .into_iter()
            .map(|r| {
                let (dead, live): (Vec<&Resource>, Vec<&Resource>) = r
                    .resources
                    .iter()
                    .partition(|x| x.version == wire_version(tombstone::HASH));
                let names = |v: Vec<&Resource>| v.iter().map(|x| x.name.clone()).collect();
                (
                    r.nonce.clone(),
                    names(dead),
                    names(live),
                    r.removed_resources,
                )
            })
            .collect()
    }

    /// A deleted pod's certificates are overwritten with the tombstone before they are
    /// removed by name, and removed only once the proxy has answered the tombstone; the
    /// trust bundle is removed as before. The same holds after a reconnect that reports
    /// the pod's certificates as held.
    #[test]
    fn a_deleted_pods_certificates_go_as_tombstones_then_by_name() {
        let with = snap_with_svids(2);
        let without = snap_with_svids(1);
        let gone: Vec<String> = with
            .secrets
            .hashes
            .keys()
            .filter(|n| !without.secrets.hashes.contains_key(*n))
            .cloned()
            .collect();
        assert_eq!(
            gone,
            vec![
                "spiffe|inbound|uid-1".to_string(),
                "spiffe|pod|uid-1".to_string()
            ]
        );
        let names: Vec<&str> = with.secrets.hashes.keys().map(String::as_str).collect();

        let mut st = DeltaState::new(with.clone(), Arc::default());
        st.on_request(&req(Kind::Secret, "", &names, None));
        let out = sent_tombstones(&mut st);
        assert_eq!(out.len(), 1);
        assert!(
            out[0].1.is_empty(),
            "no tombstone while the pods live: {out:?}"
        );
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));

        st.set_snapshot(without.clone());
        let out = sent_tombstones(&mut st);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].1, gone, "the tombstones");
        assert!(out[0].2.is_empty() && out[0].3.is_empty(), "{out:?}");
        assert!(
            sent_tombstones(&mut st).is_empty(),
            "nothing more before the proxy answers"
        );
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));
        let out = sent_tombstones(&mut st);
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(out[0].1.is_empty() && out[0].2.is_empty(), "{out:?}");
        assert_eq!(out[0].3, gone, "then removed by name");
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));
        assert!(sent_tombstones(&mut st).is_empty());

        // A reconnect to an agent that no longer has the pod: the proxy reports the
        // pod's certificates at their old versions.
        let mut st = DeltaState::new(without.clone(), Arc::default());
        let mut r = req(Kind::Secret, "", &names, None);
        r.initial_resource_versions = with
            .secrets
            .hashes
            .iter()
            .map(|(n, h)| (n.clone(), wire_version(*h)))
            .collect();
        st.on_request(&r);
        let out = sent_tombstones(&mut st);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].1, gone, "tombstones first: {out:?}");
        assert!(out[0].3.is_empty(), "{out:?}");
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));
        assert_eq!(sent_tombstones(&mut st)[0].3, gone);

        // The same pod back before the tombstone is answered: its certificates again.
        let mut st = DeltaState::new(with.clone(), Arc::default());
        st.on_request(&req(Kind::Secret, "", &names, None));
        let out = sent_tombstones(&mut st);
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));
        st.set_snapshot(without);
        let out = sent_tombstones(&mut st);
        st.set_snapshot(with);
        let back = sent_tombstones(&mut st);
        st.on_request(&req(Kind::Secret, &out[0].0, &[], None));
        st.on_request(&req(Kind::Secret, &back[0].0, &[], None));
        assert_eq!(back[0].2, gone, "the certificates sent again: {back:?}");
        assert!(sent_tombstones(&mut st).is_empty(), "and not removed");
    }

    /// A certificate named in a first request that is neither held nor in the snapshot
    /// (a pod gone while the proxy reconnected) is named removed at once.
    #[test]
    fn an_unknown_certificate_in_a_first_request_is_removed_at_once() {
        let s = snap_with_svids(1);
        let mut st = DeltaState::new(s.clone(), Arc::default());
        let mut names: Vec<&str> = s.secrets.hashes.keys().map(String::as_str).collect();
        names.push("spiffe|pod|10.244.0.9");
        st.on_request(&req(Kind::Secret, "", &names, None));
        let out = sent_tombstones(&mut st);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].3, vec!["spiffe|pod|10.244.0.9".to_string()]);
        assert!(
            out[0].1.is_empty(),
            "nothing held, so no tombstone: {out:?}"
        );
        assert_eq!(out[0].2.len(), s.secrets.hashes.len());
    }

    /// A first request says whether the proxy holds nothing of the type: a fresh proxy,
    /// not one resuming by its versions or by a relay's digests (the node's encoding
    /// warm-up waits for one or the other, `encoded::WarmHold`).
    #[test]
    fn a_first_request_says_whether_the_proxy_holds_nothing() {
        let s = snap(1, 2);
        let first = |st: &mut DeltaState, r: &DeltaDiscoveryRequest| match st.on_request(r) {
            Event::Subscribe { holds_nothing, .. } => holds_nothing,
            other => panic!("{other:?}"),
        };
        let cds = req(Kind::Cluster, "", &[], None);
        assert!(first(&mut DeltaState::new(s.clone(), Arc::default()), &cds));
        let mut resuming = cds.clone();
        resuming.initial_resource_versions = s
            .hashes(Kind::Cluster)
            .iter()
            .map(|(n, h)| (n.clone(), wire_version(*h)))
            .collect();
        assert!(!first(
            &mut DeltaState::new(s.clone(), Arc::default()),
            &resuming
        ));
        let mut relayed = DeltaState::new(s.clone(), Arc::default());
        relayed.resume_held(
            Kind::Cluster,
            Resumed::Whole(s.hashes(Kind::Cluster).clone()),
        );
        assert!(!first(&mut relayed, &cds));
    }

    #[test]
    fn a_reconnect_with_current_versions_gets_empty_answers_and_is_acked() {
        let s = snap(3, 5);
        let mut st = DeltaState::new(s.clone(), Arc::default());
        for kind in KINDS {
            let held = s.hashes(kind);
            let mut r = req(kind, "", &[], None);
            if matches!(kind, Kind::Endpoint | Kind::Route | Kind::Secret) {
                r.resource_names_subscribe = held.keys().cloned().collect();
            }
            r.initial_resource_versions = held
                .iter()
                .map(|(n, h)| (n.clone(), wire_version(*h)))
                .collect();
            st.on_request(&r);
        }
        let out = sent(&mut st);
        assert_eq!(
            out.len(),
            KINDS.len(),
            "each fresh subscription is answered"
        );
        assert!(
            out.iter().all(|o| o.2.is_empty() && o.3.is_empty()),
            "{out:?}"
        );
        assert!(
            st.acked_current(),
            "what the proxy held is the current snapshot"
        );
    }

    /// A relay's re-statement by the names' digest (EDS as the one name `RELIED`)
    /// subscribes to the snapshot's EDS clusters: with what the proxy holds matched whole,
    /// nothing goes and the snapshot counts as ACKed; a later endpoint change is pushed by
    /// name. Without a names match, `RELIED` stands for nothing.
    #[test]
    fn a_restatement_by_the_names_digest_subscribes_to_the_snapshots_eds_names() {
        let s = snap(3, 5);
        let mut st = DeltaState::new(s.clone(), Arc::default());
        for kind in KINDS {
            st.resume_held(kind, Resumed::Whole(s.hashes(kind).clone()));
        }
        st.resume_held(Kind::Endpoint, Resumed::Names(s.clone()));
        for kind in KINDS {
            let mut r = req(kind, "", &[], None);
            r.resource_names_subscribe = match kind {
                Kind::Endpoint => vec![resume::RELIED.into()],
                Kind::Route | Kind::Secret => s.hashes(kind).keys().cloned().collect(),
                Kind::Cluster | Kind::Listener => vec![],
            };
            st.on_request(&r);
        }
        let names = &st.types[Kind::Endpoint.index()].names;
        assert_eq!(names.iter().collect::<Vec<_>>(), [CLA]);
        assert!(
            names.0.ptr_eq(s.hashes(Kind::Endpoint)),
            "the names share the snapshot's EDS map"
        );
        let out = sent(&mut st);
        assert!(
            out.iter().all(|o| o.2.is_empty() && o.3.is_empty()),
            "{out:?}"
        );
        assert!(st.acked_current());
        for (kind, nonce, ..) in out {
            let k = KINDS.into_iter().find(|k| k.short() == kind).unwrap();
            st.on_request(&req(k, &nonce, &[], None));
        }
        st.set_snapshot(snap(4, 5));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().find(|o| o.0 == "EDS").map(|o| o.2.clone()),
            Some(vec![CLA.to_string()]),
            "{out:?}"
        );

        let mut plain = DeltaState::new(s.clone(), Arc::default());
        plain.on_request(&req(Kind::Endpoint, "", &[resume::RELIED, "x"], None));
        assert_eq!(
            plain.types[Kind::Endpoint.index()].names,
            Names::from_iter(["x".to_string()])
        );
    }

    #[test]
    fn a_reconnect_gets_what_changed_and_the_removal_of_what_is_gone() {
        let old = snap(3, 5);
        let mut st = DeltaState::new(snap(4, 4), Arc::default());
        let mut r = req(Kind::Cluster, "", &[], None);
        r.initial_resource_versions = old
            .clusters
            .hashes
            .iter()
            .map(|(n, h)| (n.clone(), wire_version(*h)))
            .collect();
        st.on_request(&r);
        let out = sent(&mut st);
        assert_eq!(out.len(), 1);
        assert!(
            out[0].2.is_empty(),
            "the clusters kept are unchanged (endpoints live in EDS): {out:?}"
        );
        assert_eq!(out[0].3.len(), 1, "the removed pod's cluster: {out:?}");
    }

    #[test]
    fn named_types_follow_subscribe_and_unsubscribe() {
        let mut st = subscribed(snap(2, 0));
        st.set_snapshot(snap(3, 0));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().map(|o| (o.0, o.2.clone())).collect::<Vec<_>>(),
            vec![("EDS", vec![CLA.to_string()])]
        );
        st.on_request(&req(Kind::Endpoint, &out[0].1, &[], None));
        let mut unsub = req(Kind::Endpoint, "", &[], None);
        unsub.resource_names_unsubscribe = vec![CLA.into()];
        st.on_request(&unsub);
        st.set_snapshot(snap(4, 0));
        assert!(sent(&mut st).is_empty(), "an unsubscribed name is not sent");
        st.on_request(&req(Kind::Endpoint, "", &[CLA], None));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().map(|o| (o.0, o.2.clone())).collect::<Vec<_>>(),
            vec![("EDS", vec![CLA.to_string()])]
        );
    }

    #[test]
    fn a_nack_is_not_resent_and_keeps_the_acked_view() {
        let mut st = subscribed(snap(2, 1));
        st.set_snapshot(snap(2, 2));
        let out = sent(&mut st);
        let ev = st.on_request(&req(Kind::Listener, &out[1].1, &[], Some("bad listener")));
        assert!(
            matches!(ev, Event::Nack { kind: Kind::Listener, ref message, .. } if message == "bad listener"),
            "{ev:?}"
        );
        st.on_request(&req(Kind::Cluster, &out[0].1, &[], None));
        assert!(!st.acked_current());
        assert!(
            sent(&mut st).is_empty(),
            "the rejected listener is not resent"
        );
        // The next change goes out, the rejected listener still not.
        st.set_snapshot(snap(3, 2));
        let out = sent(&mut st);
        assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), vec!["EDS"]);
    }

    #[test]
    fn stale_nonces_are_ignored() {
        let mut st = subscribed(snap(2, 1));
        st.set_snapshot(snap(2, 2));
        let first = sent(&mut st);
        st.set_snapshot(snap(2, 3));
        let second = sent(&mut st);
        assert!(matches!(
            st.on_request(&req(Kind::Listener, &first[1].1, &[], None)),
            Event::Stale { .. }
        ));
        assert!(matches!(
            st.on_request(&req(Kind::Listener, &second[1].1, &[], None)),
            Event::Ack { .. }
        ));
    }

    /// ACKs every response in `out`.
    fn ack_all(st: &mut DeltaState, out: &[(&'static str, String, Vec<String>, Vec<String>)]) {
        for (kind, nonce, _, _) in out {
            let k = KINDS.into_iter().find(|k| k.short() == *kind).unwrap();
            st.on_request(&req(k, nonce, &[], None));
        }
    }

    fn svc(name: &str, endpoints: &[(&str, bool)]) -> Service {
        Service {
            name: name.into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: endpoints
                .iter()
                .map(|(a, draining)| Endpoint {
                    address: a.parse().unwrap(),
                    port: 8080,
                    service_port: 80,
                    node: String::new(),
                    pod: String::new(),
                    state: if *draining {
                        EndpointState::Draining
                    } else {
                        EndpointState::Healthy
                    },
                    mtls: false,
                })
                .collect(),
        }
    }

    #[test]
    fn pushes_from_the_snapshot_history_send_exactly_what_changed() {
        let services: Vec<Service> = (0..200)
            .map(|i| svc(&format!("s{i}"), &[("10.0.0.1", false)]))
            .collect();
        let mut b = aether_model::Builder::new(Inputs {
            registry: RegistryView::new(services),
            ..Default::default()
        });
        let mut st = DeltaState::new(b.snapshot().clone(), Arc::default());
        st.on_request(&req(Kind::Cluster, "", &[], None));
        st.on_request(&req(Kind::Listener, "", &[], None));
        let eds: Vec<String> = b.snapshot().eds_cluster_names().map(String::from).collect();
        let eds: Vec<&str> = eds.iter().map(String::as_str).collect();
        st.on_request(&req(Kind::Endpoint, "", &eds, None));
        st.on_request(&req(Kind::Route, "", &["outbound"], None));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().map(|o| o.2.len()).sum::<usize>(),
            200 + 200 + 1 + 1,
            "the first answers carry everything"
        );
        ack_all(&mut st, &out);
        assert!(st.acked_current());

        // One endpoint turns draining: one load assignment, nothing else.
        st.set_snapshot(
            b.apply([Change::UpsertService(svc("s42", &[("10.0.0.1", true)]))])
                .unwrap(),
        );
        let out = sent(&mut st);
        assert_eq!(
            out.iter()
                .map(|o| (o.0, o.2.clone(), o.3.clone()))
                .collect::<Vec<_>>(),
            vec![("EDS", vec!["outbound|80||s42.d".to_string()], vec![])]
        );
        assert!(!st.acked_current());
        ack_all(&mut st, &out);
        assert!(st.acked_current());

        // Several steps at once (the stream fell behind): their union, once.
        st.set_snapshot(
            b.apply([Change::UpsertService(svc("s1", &[("10.0.0.2", false)]))])
                .unwrap(),
        );
        st.set_snapshot(
            b.apply([Change::UpsertPod(aether_model::Pod {
                uid: "u1".into(),
                namespace: "d".into(),
                name: "p".into(),
                container_id: "c".into(),
                netns: "/n".into(),
                ifname: "eth0".into(),
                ips: vec!["10.244.0.1".parse().unwrap()],
                terminating: false,
                no_quic_twin: false,
            })])
            .unwrap(),
        );
        st.set_snapshot(
            b.apply([Change::RemoveService(svc("s7", &[]).key())])
                .unwrap(),
        );
        let out = sent(&mut st);
        let got: Vec<_> = out
            .iter()
            .map(|o| (o.0, o.2.clone(), o.3.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "CDS",
                    vec!["inbound|u1".to_string()],
                    vec!["outbound|80||s7.d".to_string()]
                ),
                (
                    "EDS",
                    vec!["outbound|80||s1.d".to_string()],
                    vec!["outbound|80||s7.d".to_string()]
                ),
                (
                    "LDS",
                    vec!["inbound".to_string(), "inbound|u1".to_string()],
                    vec![]
                ),
                ("RDS", vec!["outbound".to_string()], vec![]),
            ]
        );
        ack_all(&mut st, &out);
        assert!(st.acked_current());
        // What the stream believes the proxy holds is exactly the snapshot.
        for kind in KINDS {
            let holds: Vec<&String> = st.types[kind.index()].holds.keys().collect();
            let want: Vec<&String> = st.current().hashes(kind).keys().collect();
            assert_eq!(holds, want, "{kind:?}");
        }
    }

    #[test]
    fn requests_past_the_subscription_limits_are_refused_and_change_nothing() {
        let limits = SubscriptionLimits {
            max_names: 3,
            max_name_len: 16,
        };
        let mut st = DeltaState::new(snap(1, 0), Arc::default());
        let admit = |st: &mut DeltaState, r: DeltaDiscoveryRequest| {
            st.check_limits(&r, &limits)?;
            st.on_request(&r);
            Ok::<(), LimitError>(())
        };
        admit(&mut st, req(Kind::Endpoint, "", &["a", "b"], None)).unwrap();
        // Names already subscribed and "*" do not count again; a repeated name counts once.
        admit(
            &mut st,
            req(Kind::Endpoint, "", &["a", "b", "c", "c", "*"], None),
        )
        .unwrap();
        let past =
            admit(&mut st, req(Kind::Endpoint, "", &["d", "a"], None)).expect_err("a fourth name");
        assert_eq!(
            past,
            LimitError::TooManyNames {
                kind: Kind::Endpoint,
                names: 4,
                max: 3
            }
        );
        assert_eq!(past.limit(), "names");
        assert_eq!(
            past.to_string(),
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment: subscribing to 4 resource names is over the limit of 3 per type and stream"
        );
        assert_eq!(
            st.types[Kind::Endpoint.index()].names.len(),
            3,
            "the refused request changed nothing"
        );
        // Each type counts its own names.
        admit(&mut st, req(Kind::Route, "", &["d", "e", "f"], None)).unwrap();
        // An unsubscribe makes room.
        let mut unsub = req(Kind::Endpoint, "", &[], None);
        unsub.resource_names_unsubscribe = vec!["a".into()];
        admit(&mut st, unsub).unwrap();
        admit(&mut st, req(Kind::Endpoint, "", &["d"], None)).unwrap();

        // Every name of a request is checked for length, unsubscribes and held versions too.
        let long = "x".repeat(17);
        let err = admit(&mut st, req(Kind::Route, "", &[&long], None)).expect_err("a 17-byte name");
        assert_eq!(
            err,
            LimitError::NameTooLong {
                kind: Kind::Route,
                name: long.clone(),
                len: 17,
                max: 16
            }
        );
        assert_eq!(err.limit(), "name_length");
        let mut unsub = req(Kind::Route, "", &[], None);
        unsub.resource_names_unsubscribe = vec![long.clone()];
        assert!(st.check_limits(&unsub, &limits).is_err());
        let mut held = req(Kind::Cluster, "", &[], None);
        held.initial_resource_versions = [(long.clone(), "1".to_string())].into();
        assert!(st.check_limits(&held, &limits).is_err());
        // A first request reporting more held resources than the limit.
        held.initial_resource_versions =
            (0..4).map(|i| (format!("c{i}"), "1".to_string())).collect();
        assert_eq!(
            st.check_limits(&held, &limits),
            Err(LimitError::TooManyNames {
                kind: Kind::Cluster,
                names: 4,
                max: 3
            })
        );
        // A type the agent does not serve holds nothing and is not checked.
        let mut other = req(Kind::Route, "", &[&long], None);
        other.type_url = "type.googleapis.com/envoy.service.runtime.v3.Runtime".into();
        assert_eq!(st.check_limits(&other, &limits), Ok(()));
    }

    #[test]
    fn the_default_name_limit_admits_its_figure_across_requests() {
        let limits = SubscriptionLimits::default();
        let names: Vec<String> = (0..MAX_SUBSCRIBED_NAMES)
            .map(|i| format!("outbound|80||service-{i}.namespace"))
            .collect();
        let (first, second) = names.split_at(MAX_SUBSCRIBED_NAMES / 2);
        let mut st = DeltaState::new(snap(1, 0), Arc::default());
        for half in [first, second] {
            let r = DeltaDiscoveryRequest {
                type_url: type_url(Kind::Endpoint).into(),
                resource_names_subscribe: half.to_vec(),
                ..Default::default()
            };
            assert_eq!(st.check_limits(&r, &limits), Ok(()));
            st.on_request(&r);
        }
        let one_more = req(
            Kind::Endpoint,
            "",
            &["outbound|80||one-more.namespace"],
            None,
        );
        assert!(matches!(
            st.check_limits(&one_more, &limits),
            Err(LimitError::TooManyNames { names: 100_001, .. })
        ));
        // The longest name the model makes passes the length limit.
        let longest = format!("outbound|65535||{}.{}", "n".repeat(63), "s".repeat(63));
        assert_eq!(
            limits.check_lengths(Kind::Cluster, [longest.as_str()]),
            Ok(())
        );
    }

    #[test]
    fn on_demand_clusters_come_when_named_and_are_recorded_as_observed() {
        let dir = tempfile::tempdir().unwrap();
        let observed = crate::writers::Observed::restore(dir.path());
        observed.insert("outbound|80||s1.d");
        let services: Vec<Service> = (0..5)
            .map(|i| svc(&format!("s{i}"), &[("10.0.0.1", false)]))
            .collect();
        let mut i = inputs(0, 1);
        i.registry = RegistryView::new(services);
        i.on_demand_clusters = true;
        let s = Arc::new(build(&i));
        let mut st = DeltaState::new(s.clone(), Arc::default());
        st.on_demand(observed.clone());
        st.on_request(&req(Kind::Cluster, "", &[], None));
        st.on_request(&req(Kind::Listener, "", &[], None));
        st.on_request(&req(Kind::Route, "", &["outbound"], None));
        let out = sent(&mut st);
        assert_eq!(out[0].0, "CDS");
        assert_eq!(
            out[0].2,
            vec!["inbound|uid-0".to_string(), "outbound|80||s1.d".to_string()],
            "the pod's cluster and the observed one"
        );
        ack_all(&mut st, &out);
        st.on_request(&req(Kind::Endpoint, "", &["outbound|80||s1.d"], None));
        let out = sent(&mut st);
        ack_all(&mut st, &out);
        assert!(
            st.acked_current(),
            "acked without the clusters the proxy never asked for"
        );

        // A pod calls s3: the proxy names its cluster on the CDS stream.
        st.on_request(&req(Kind::Cluster, "", &["outbound|80||s3.d"], None));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().map(|o| (o.0, o.2.clone())).collect::<Vec<_>>(),
            vec![("CDS", vec!["outbound|80||s3.d".to_string()])]
        );
        assert!(observed.contains("outbound|80||s3.d"));
        ack_all(&mut st, &out);
        assert!(!st.acked_current(), "the new cluster's endpoints are owed");
        st.on_request(&req(Kind::Endpoint, "", &["outbound|80||s3.d"], None));
        let out = sent(&mut st);
        assert_eq!(
            out.iter().map(|o| (o.0, o.2.clone())).collect::<Vec<_>>(),
            vec![("EDS", vec!["outbound|80||s3.d".to_string()])]
        );
        ack_all(&mut st, &out);
        assert!(st.acked_current());

        // A cluster the mesh does not have: answered as removed at once, not recorded.
        st.on_request(&req(Kind::Cluster, "", &["outbound|80||nope.d"], None));
        let out = sent(&mut st);
        assert_eq!(
            out.iter()
                .map(|o| (o.0, o.2.len(), o.3.clone()))
                .collect::<Vec<_>>(),
            vec![("CDS", 0, vec!["outbound|80||nope.d".to_string()])]
        );
        assert!(!observed.contains("outbound|80||nope.d"));
    }

    /// `acked_current` as it was before it looked at the cheap types first: each type in
    /// turn, the snapshot's needs of a type collected in full before the comparison.
    fn acked_walking_every_type(st: &DeltaState) -> bool {
        let s = &*st.current;
        let in_sync = st
            .synced
            .as_ref()
            .is_some_and(|x| Arc::ptr_eq(x, &st.current));
        KINDS.into_iter().all(|kind| {
            let t = &st.types[kind.index()];
            if in_sync && t.subscribed && !t.full && t.extra.is_empty() && !t.answer {
                let acked_all = t.acked.ptr_eq(&t.holds) || t.acked == t.holds;
                return acked_all
                    && match kind {
                        Kind::Listener | Kind::Cluster => t.wildcard,
                        Kind::Endpoint | Kind::Route | Kind::Secret => {
                            t.unsubscribed_needed.is_empty()
                        }
                    };
            }
            let current = s.hashes(kind);
            let lazy = st.lazy(kind);
            let clusters = &st.types[Kind::Cluster.index()].acked;
            let needed: Vec<&str> = match kind {
                Kind::Listener | Kind::Cluster => {
                    if t.acked.keys().any(|n| !current.contains_key(n)) {
                        return false;
                    }
                    current
                        .keys()
                        .map(String::as_str)
                        .filter(|n| !lazy || t.wants(n, lazy))
                        .collect()
                }
                Kind::Endpoint => s
                    .eds_cluster_names()
                    .filter(|c| st.observed.is_none() || clusters.contains_key(*c))
                    .collect(),
                Kind::Route => s.rds_names().collect(),
                Kind::Secret => s.sds_names().into_iter().collect(),
            };
            needed
                .iter()
                .all(|n| t.acked.get(*n).is_some_and(|h| current.get(*n) == Some(h)))
        })
    }

    /// A reconnect to a new owner (another builder, as a surge's standby is) with the
    /// versions the proxy held of the old owner's snapshot, then pods coming and going
    /// (several steps at once when the stream falls behind) and the proxy's ACKs coming
    /// late: once every answer is ACKed, the proxy holds exactly the new owner's listeners
    /// and clusters. (A 10,000-service surge once left a DEL'd pod's cluster in the proxy
    /// while its listener went.)
    #[test]
    fn a_reconnect_then_pod_churn_leaves_the_proxy_holding_the_snapshot() {
        let mut rng = Rng(0x3c6e_f372_fe94_f82b);
        let pod = |n: u64| {
            let ip = format!("10.88.{}.{}", n / 200, n % 200 + 1);
            pod(format!("pod-{n:05}-uid"), format!("churn-{n}"), &ip)
        };
        let versions = |s: &Snapshot, kind: Kind| -> BTreeMap<String, String> {
            s.hashes(kind)
                .iter()
                .map(|(n, h)| (n.clone(), wire_version(*h)))
                .collect()
        };
        for round in 0..200 {
            let (mut next_pod, mut live) = (0u64, Vec::new());
            let mut churn = |rng: &mut Rng, live: &mut Vec<u64>| -> Change {
                if live.len() > 3 && rng.below(2) == 0 {
                    let uid = live.remove(rng.below(live.len() as u64) as usize);
                    Change::RemovePod(pod(uid).uid)
                } else {
                    next_pod += 1;
                    live.push(next_pod);
                    Change::UpsertPod(pod(next_pod))
                }
            };
            let mut old = aether_model::Builder::new(inputs(2, 0));
            let mut new = aether_model::Builder::new(inputs(2, 0));
            // Both owners see the same pods; the proxy holds the old owner's snapshot,
            // a few steps behind the new owner's.
            for _ in 0..10 + rng.below(10) {
                let c = churn(&mut rng, &mut live);
                old.apply([c.clone()]);
                new.apply([c]);
            }
            let mut proxy = [Kind::Cluster, Kind::Listener].map(|k| versions(old.snapshot(), k));
            for _ in 0..rng.below(4) {
                new.apply([churn(&mut rng, &mut live)]);
            }
            let mut st = DeltaState::new(new.snapshot().clone(), Arc::default());
            for (i, kind) in [Kind::Cluster, Kind::Listener].into_iter().enumerate() {
                let mut r = req(kind, "", &[], None);
                r.initial_resource_versions = proxy[i].clone().into_iter().collect();
                st.on_request(&r);
            }
            let mut unacked: Vec<(Kind, String)> = Vec::new();
            let take = |st: &mut DeltaState,
                        proxy: &mut [BTreeMap<String, String>; 2],
                        unacked: &mut Vec<(Kind, String)>| {
                for r in st.pending() {
                    let kind = from_type_url(&r.type_url).unwrap();
                    let held = &mut proxy[usize::from(kind == Kind::Listener)];
                    for res in &r.resources {
                        held.insert(res.name.clone(), res.version.clone());
                    }
                    for gone in &r.removed_resources {
                        held.remove(gone);
                    }
                    unacked.push((kind, r.nonce));
                }
            };
            take(&mut st, &mut proxy, &mut unacked);
            for _ in 0..30 {
                match rng.below(3) {
                    0 if !unacked.is_empty() => {
                        let (kind, nonce) = unacked.remove(0);
                        st.on_request(&req(kind, &nonce, &[], None));
                    }
                    _ => {
                        let mut last = None;
                        for _ in 0..1 + rng.below(3) {
                            last = new.apply([churn(&mut rng, &mut live)]).or(last);
                        }
                        if let Some(s) = last {
                            st.set_snapshot(s);
                        }
                    }
                }
                take(&mut st, &mut proxy, &mut unacked);
            }
            while let Some((kind, nonce)) = (!unacked.is_empty()).then(|| unacked.remove(0)) {
                st.on_request(&req(kind, &nonce, &[], None));
                take(&mut st, &mut proxy, &mut unacked);
            }
            for (i, kind) in [Kind::Cluster, Kind::Listener].into_iter().enumerate() {
                assert_eq!(
                    proxy[i],
                    versions(st.current(), kind),
                    "round {round}: {kind:?}"
                );
            }
        }
    }

    /// `acked_current` settles the subscribed types by what they hold and compares only
    /// the others with the snapshot, each to its first miss: over random streams
    /// (subscriptions in any order, ACKs and NACKs, snapshot changes, with and without
    /// on-demand clusters) it answers as the walk over every type in full did.
    #[test]
    fn acked_current_agrees_with_a_comparison_of_every_type() {
        let mut rng = Rng(0x5851_f42d_4c95_7f2d);
        let dir = tempfile::tempdir().unwrap();
        let mut agreed = [0usize; 2];
        for round in 0..300 {
            let mut i = inputs(2, 1);
            i.on_demand_clusters = round % 2 == 1;
            let mut b = aether_model::Builder::new(i);
            let mut st = DeltaState::new(b.snapshot().clone(), Arc::default());
            if round % 2 == 1 {
                st.on_demand(crate::writers::Observed::restore(dir.path()));
            }
            let service = |n: u64| format!("outbound|80||s{n}.d");
            let mut unacked: Vec<(Kind, String)> = Vec::new();
            for step in 0..40 {
                match rng.below(6) {
                    0 | 1 => {
                        let kind = KINDS[rng.below(KINDS.len() as u64) as usize];
                        let named = [service(rng.below(12)), CLA.to_string()];
                        let names: Vec<&str> = match kind {
                            Kind::Cluster if rng.below(2) == 0 => vec![&named[0]],
                            Kind::Cluster | Kind::Listener => vec![],
                            Kind::Endpoint => named
                                .iter()
                                .take(1 + rng.below(2) as usize)
                                .map(String::as_str)
                                .collect(),
                            Kind::Route => vec!["outbound"],
                            Kind::Secret => vec!["bundle"],
                        };
                        st.on_request(&req(kind, "", &names, None));
                    }
                    2 | 3 if !unacked.is_empty() => {
                        let (kind, nonce) =
                            unacked.remove(rng.below(unacked.len() as u64) as usize);
                        let error = (rng.below(5) == 0).then_some("rejected");
                        st.on_request(&req(kind, &nonce, &[], error));
                    }
                    _ => {
                        let n = rng.below(12);
                        let change = match rng.below(3) {
                            0 => Change::RemoveService(svc(&format!("s{n}"), &[]).key()),
                            _ => Change::UpsertService(svc(
                                &format!("s{n}"),
                                &[("10.0.0.9", rng.below(2) == 0)],
                            )),
                        };
                        if let Some(s) = b.apply([change]) {
                            st.set_snapshot(s);
                        }
                    }
                }
                // As the server does after each event: push, then ask.
                for r in st.pending() {
                    unacked.push((from_type_url(&r.type_url).unwrap(), r.nonce));
                }
                // What EDS owes: the proxy's clusters' endpoints that it has not named.
                let (eds, held) = (
                    &st.types[Kind::Endpoint.index()],
                    &st.types[Kind::Cluster.index()].holds,
                );
                if eds.subscribed {
                    let owed: BTreeSet<String> = st
                        .current
                        .eds_cluster_names()
                        .filter(|c| held.contains_key(*c) && !eds.names.contains(c))
                        .map(String::from)
                        .collect();
                    assert_eq!(eds.unsubscribed_needed, owed, "round {round} step {step}");
                }
                let full = acked_walking_every_type(&st);
                assert_eq!(st.acked_current(), full, "round {round} step {step}");
                agreed[usize::from(full)] += 1;
            }
        }
        assert!(
            agreed[0] > 100 && agreed[1] > 100,
            "both answers come up often: {agreed:?}"
        );
    }

    /// A random map of up to 60 names out of 80, with hashes out of 3.
    fn random_map(rng: &mut Rng) -> OrdMap<String, u64> {
        (0..rng.below(60))
            .map(|_| (format!("n{:02}", rng.below(80)), rng.below(3)))
            .collect()
    }

    #[test]
    fn held_versions_is_what_the_request_reports_and_shares_the_snapshot_when_equal() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..500 {
            let current = random_map(&mut rng);
            let mut initial: HashMap<String, String> = match round % 3 {
                // The usual reconnect: exactly the snapshot.
                0 => current
                    .iter()
                    .map(|(n, h)| (n.clone(), wire_version(*h)))
                    .collect(),
                // A proxy holding a few of them (on-demand clusters): its own map.
                1 => current
                    .iter()
                    .step_by(4)
                    .map(|(n, h)| (n.clone(), wire_version(*h)))
                    .collect(),
                _ => random_map(&mut rng)
                    .iter()
                    .map(|(n, h)| (n.clone(), wire_version(*h)))
                    .collect(),
            };
            if round % 5 == 1 {
                initial.insert("n99".into(), "not hex".into());
            }
            let naive: OrdMap<String, u64> = initial
                .iter()
                .filter_map(|(n, v)| Some((n.clone(), u64::from_str_radix(v, 16).ok()?)))
                .collect();
            let got = held_versions(&current, &initial);
            assert_eq!(
                got, naive,
                "round {round}: current {current:?}, initial {initial:?}"
            );
            if round % 3 == 0 && !current.is_empty() {
                assert!(
                    got.ptr_eq(&current),
                    "round {round}: a reconnect to the same snapshot shares it"
                );
            }
        }
    }

    #[test]
    fn compare_all_matches_a_lookup_per_name() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for round in 0..500 {
            let hashes = random_map(&mut rng);
            let t = TypeState {
                wildcard: rng.below(2) == 0,
                names: (0..rng.below(40))
                    .map(|_| format!("n{:02}", rng.below(80)))
                    .collect(),
                // Half the time sharing the snapshot's structure, as after a reconnect.
                holds: if round % 2 == 0 {
                    hashes.update(format!("n{:02}", rng.below(80)), rng.below(3))
                } else {
                    random_map(&mut rng)
                },
                ..Default::default()
            };
            for lazy in [false, true] {
                // With on-demand clusters, keys on both sides of the `outbound|` range.
                let hashes = if lazy {
                    let outbound = hashes
                        .iter()
                        .map(|(n, h)| (format!("outbound|80||{n}"), *h));
                    let after = hashes.iter().map(|(n, h)| (format!("p|{n}"), *h));
                    outbound.chain(after).chain(hashes.clone()).collect()
                } else {
                    hashes.clone()
                };
                let to_send: BTreeSet<String> = hashes
                    .iter()
                    .filter(|(n, h)| t.wants(n, lazy) && t.holds.get(*n) != Some(*h))
                    .map(|(n, _)| n.clone())
                    .collect();
                let removed: Vec<String> = t
                    .holds
                    .keys()
                    .filter(|n| !(t.wants(n, lazy) && hashes.contains_key(*n)))
                    .cloned()
                    .collect();
                assert_eq!(
                    compare_all(&t, &hashes, lazy),
                    (to_send.clone(), removed.clone()),
                    "round {round}, lazy {lazy}: {t:?}"
                );
                // The lookup per name, whatever the sizes, wherever it applies.
                if let Some(unnamed) = wanted_unnamed(&t, &hashes, lazy) {
                    assert_eq!(
                        compare_few(&t, &hashes, lazy, unnamed),
                        (to_send, removed),
                        "round {round}, lazy {lazy}, by name: {t:?}"
                    );
                }
            }
        }
    }

    /// At mesh size, with what the proxy holds sharing the snapshot's structure (the
    /// snapshot's map with a few names edited, as [`held_versions`] builds it at a
    /// reconnect), the full comparison finds exactly the names that differ. The maps span
    /// many tree nodes, so the walk skips shared ones: imbl 6's `OrdMap::diff` lost or
    /// made up an item in about 1 walk in 20 of these (a pod's cluster removed in place of
    /// another, on a 10,000-service surge roll).
    #[test]
    fn compare_all_finds_every_difference_when_the_maps_share_structure() {
        let mut rng = Rng(0x6a09_e667_f3bc_c908);
        let name = |n: u64| format!("inbound|pod-{n:05}-uid");
        let mut snapshot: OrdMap<String, u64> = (0..3000u64).map(|n| (name(n * 2), 0u64)).collect();
        for round in 0..400 {
            // The snapshot moves on by a few steps, as a builder's does.
            for _ in 0..rng.below(8) {
                let n = name(rng.below(6000));
                if rng.below(2) == 0 {
                    snapshot.remove(&n);
                } else {
                    snapshot.insert(n, rng.below(3));
                }
            }
            let mut holds = snapshot.clone();
            for _ in 0..1 + rng.below(4) {
                let n = name(rng.below(6000));
                match rng.below(3) {
                    0 => drop(holds.remove(&n)),
                    _ => drop(holds.insert(n, rng.below(3))),
                }
            }
            let t = TypeState {
                wildcard: true,
                holds,
                ..Default::default()
            };
            let to_send: BTreeSet<String> = snapshot
                .iter()
                .filter(|(n, h)| t.holds.get(*n) != Some(*h))
                .map(|(n, _)| n.clone())
                .collect();
            let removed: Vec<String> = t
                .holds
                .keys()
                .filter(|n| !snapshot.contains_key(*n))
                .cloned()
                .collect();
            assert_eq!(
                compare_all(&t, &snapshot, false),
                (to_send, removed),
                "round {round}"
            );
        }
    }

    #[test]
    fn diff_keys_are_the_keys_of_one_map_missing_from_the_other_shared_or_not() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for round in 0..300 {
            let map = |rng: &mut Rng, n: u64| -> OrdMap<String, u64> {
                (0..rng.below(n))
                    .map(|_| (format!("n{:04}", rng.below(4 * n)), rng.below(3)))
                    .collect()
            };
            let a = map(&mut rng, 2_000);
            // Half the rounds: `b` is `a` edited (sharing its structure), values too;
            // the others, a map of its own.
            let b = if round % 2 == 0 {
                let mut b = a.clone();
                for _ in 0..rng.below(20) {
                    let n = format!("n{:04}", rng.below(8_000));
                    match rng.below(3) {
                        0 => b.remove(&n),
                        _ => b.insert(n, rng.below(3)),
                    };
                }
                b
            } else {
                map(&mut rng, 2_000)
            };
            for in_a in [true, false] {
                let (from, other) = if in_a { (&a, &b) } else { (&b, &a) };
                let got: Vec<&String> = diff_keys(&a, &b, in_a).collect();
                let want: Vec<&String> = from.keys().filter(|k| !other.contains_key(*k)).collect();
                assert_eq!(got, want, "round {round}, in_a {in_a}");
            }
        }
    }
}
