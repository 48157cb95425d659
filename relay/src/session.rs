//! The session rules, pure: one Envoy stream and the succession of agent streams behind
//! it. No I/O and no clock; the driver (`relay.rs`) feeds it what arrives and sends what
//! it returns, in order.
//!
//! What it keeps, per type: what Envoy is subscribed to and the versions Envoy holds
//! (from the answers Envoy ACKed), never the resources. Each answer forwarded to Envoy is
//! remembered by nonce, with the names and versions it carried, until Envoy ACKs or NACKs
//! it; that is how the held versions stay Envoy's own.
//!
//! The rules:
//! - While an agent stream is up, Envoy's requests go to it as they came, and its answers
//!   go to Envoy as they came.
//! - When it ends, nothing is sent until the next is up; Envoy's subscription changes
//!   meanwhile are folded into the state, not queued as messages.
//! - On a new agent stream, one request per type Envoy uses re-states its subscriptions
//!   with the versions it holds, the node on the first, in ADS order (clusters, endpoints,
//!   listeners, routes, secrets, then the rest). The agent then sends only differences.
//! - Envoy's ACK or NACK of an answer from an earlier agent stream is absorbed: its
//!   versions count as held (an ACK), and nothing goes to the new stream, which never
//!   sent that nonce. Subscription changes riding on it are still passed on.
//! - An answer with no resources and no removals (a type unchanged across the switch) is
//!   ACKed by the relay itself and not forwarded.
//! - The overlap (`shared_proto::resume`, "Overlap"): the next agent stream may be
//!   re-stated while the current one still carries ([`Session::restate_next`]), once
//!   nothing forwarded to Envoy is unanswered ([`Session::quiet`]). Envoy's requests keep
//!   going to the current stream; its subscription changes go to the next one too. The
//!   switch ([`Session::switch_next`]) is sound only if nothing went to Envoy from the
//!   current stream after the re-statement ([`Session::next_holds`]); else the driver
//!   drops the next stream ([`Session::abandon_next`]) and re-states on a fresh one.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use bytes::Bytes;
use shared_proto::resume::{self, Buckets, Digest};

use crate::wire::{DeltaRequest, DeltaResponse, Framed};

/// ADS order for the re-statement: a resource's dependencies first.
pub const ORDER: [&str; 5] = [
    "type.googleapis.com/envoy.config.cluster.v3.Cluster",
    "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    "type.googleapis.com/envoy.config.listener.v3.Listener",
    "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
];

/// What the driver sends: requests of type `Q`, answers of type `A`.
#[derive(Debug, Clone)]
pub enum Send<Q = DeltaRequest, A = DeltaResponse> {
    /// To the agent, on the current stream.
    Upstream(Framed<Q>),
    /// To the agent, on the next stream, re-stated while the current one still carries.
    Next(Framed<Q>),
    /// To Envoy.
    Envoy(Framed<A>),
}

/// What the driver needs of a session core, for either ADS variant: incremental
/// ([`Session`]) or state of the world ([`crate::sotw::Session`]).
pub trait Core: Default + std::marker::Send + 'static {
    /// Envoy's requests.
    type Req: prost::Message + Default + std::fmt::Debug + std::marker::Send + 'static;
    /// The agent's answers.
    type Resp: prost::Message + Default + std::fmt::Debug + std::marker::Send + 'static;
    /// The gRPC method, on both sides.
    const PATH: &'static str;
    /// The variant, as metrics and logs name it: `delta` or `sotw`.
    const API: &'static str;
    fn on_envoy(&mut self, req: Framed<Self::Req>) -> Vec<Send<Self::Req, Self::Resp>>;
    fn on_agent(&mut self, resp: Framed<Self::Resp>) -> Vec<Send<Self::Req, Self::Resp>>;
    /// The digest resume offered on the next agent stream (`shared_proto::resume`), if
    /// any: the request header's value.
    fn offer(&mut self) -> Option<String> {
        None
    }
    /// The new agent stream is open; `matched` is its answer to the offer (None: the agent
    /// sent no answer, it takes the plain resume).
    fn upstream_up(&mut self, matched: Option<&str>) -> Vec<Send<Self::Req, Self::Resp>>;
    fn upstream_down(&mut self);
    fn counts(&self) -> Counts;

    /// Whether the variant takes the overlapping handover; the methods below serve it.
    const OVERLAP: bool = false;
    /// The nonce of an in-band handover answer ([`resume::HANDOVER_TYPE`]), which is
    /// never forwarded.
    fn handover_nonce(_resp: &Self::Resp) -> Option<&str> {
        None
    }
    /// The request that asks the next stream's agent to answer once it has answered the
    /// re-statement ([`resume::RESTATED_NONCE`]).
    fn restated_request() -> Framed<Self::Req> {
        unreachable!("only a variant with the overlap sends it")
    }
    /// The re-statement for the next agent stream, taken while the current one carries.
    fn restate_next(&mut self, _matched: Option<&str>) -> Vec<Send<Self::Req, Self::Resp>> {
        unreachable!("only a variant with the overlap re-states the next stream")
    }
    /// Nothing forwarded to Envoy is unanswered: what the session knows Envoy holds is
    /// what it holds.
    fn quiet(&self) -> bool {
        true
    }
    /// The next stream's re-statement still states what Envoy holds.
    fn next_holds(&self) -> bool {
        false
    }
    /// The next stream becomes the current one.
    fn switch_next(&mut self) {}
    /// The next stream is dropped.
    fn abandon_next(&mut self) {}
}

impl Core for Session {
    type Req = DeltaRequest;
    type Resp = DeltaResponse;
    const PATH: &'static str = crate::wire::DELTA_PATH;
    const API: &'static str = "delta";
    fn on_envoy(&mut self, req: Framed<DeltaRequest>) -> Vec<Send> {
        Session::on_envoy(self, req)
    }
    fn on_agent(&mut self, resp: Framed<DeltaResponse>) -> Vec<Send> {
        Session::on_agent(self, resp)
    }
    fn offer(&mut self) -> Option<String> {
        Some(Session::offer(self))
    }
    fn upstream_up(&mut self, matched: Option<&str>) -> Vec<Send> {
        Session::upstream_up_matched(self, matched)
    }
    fn upstream_down(&mut self) {
        Session::upstream_down(self)
    }
    fn counts(&self) -> Counts {
        self.counts
    }
    const OVERLAP: bool = true;
    fn handover_nonce(resp: &DeltaResponse) -> Option<&str> {
        (resp.type_url == resume::HANDOVER_TYPE).then_some(resp.nonce.as_str())
    }
    fn restated_request() -> Framed<DeltaRequest> {
        Framed::of(DeltaRequest {
            type_url: resume::HANDOVER_TYPE.to_string(),
            ..Default::default()
        })
    }
    fn restate_next(&mut self, matched: Option<&str>) -> Vec<Send> {
        Session::restate_next(self, matched)
    }
    fn quiet(&self) -> bool {
        Session::quiet(self)
    }
    fn next_holds(&self) -> bool {
        Session::next_holds(self)
    }
    fn switch_next(&mut self) {
        Session::switch_next(self)
    }
    fn abandon_next(&mut self) {
        Session::abandon_next(self)
    }
}

impl Counts {
    /// What a re-statement added since `before` (its own counts only).
    fn since(&self, before: &Counts) -> Counts {
        Counts {
            resumes: self.resumes - before.resumes,
            digest_resumes: self.digest_resumes - before.digest_resumes,
            digest_types: self.digest_types - before.digest_types,
            bucket_types: self.bucket_types - before.bucket_types,
            version_types: self.version_types - before.version_types,
            names_types: self.names_types - before.names_types,
            ..Counts::default()
        }
    }

    /// Takes back a dropped re-statement's counts.
    fn take_back(&mut self, r: &Counts) {
        self.resumes -= r.resumes;
        self.digest_resumes -= r.digest_resumes;
        self.digest_types -= r.digest_types;
        self.bucket_types -= r.bucket_types;
        self.version_types -= r.version_types;
        self.names_types -= r.names_types;
    }
}

/// Counts the driver exports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Agent streams the session was re-stated on.
    pub resumes: u64,
    /// Of those, the ones whose agent answered the digest offer (delta).
    pub digest_resumes: u64,
    /// Types re-stated by their digest alone, by their bucket digests (the versions of
    /// the buckets not matched listed), and with all their versions listed.
    pub digest_types: u64,
    pub bucket_types: u64,
    pub version_types: u64,
    /// Types whose subscription was re-stated by the digest of its names
    /// ([`resume::RELIED`] in place of the names).
    pub names_types: u64,
    /// ACKs and NACKs of an earlier stream's answers, absorbed.
    pub absorbed: u64,
    /// Answers the relay ACKed itself instead of forwarding: empty (delta), or what Envoy
    /// already holds (state of the world).
    pub self_acked: u64,
    /// NACKs Envoy sent.
    pub nacks: u64,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct TypeState {
    /// Envoy asked for every resource of the type: by an empty first subscription (the
    /// legacy form) or by `*`.
    wildcard: bool,
    /// The legacy form: re-stated as an empty subscription, as Envoy sent it.
    legacy: bool,
    names: BTreeSet<String>,
    /// The digest of `names`, kept with them.
    names_digest: Digest,
    /// The versions Envoy holds, by name.
    held: BTreeMap<String, String>,
    /// The digest of `held`, kept with it, whole and in buckets.
    digest: Digest,
    buckets: Buckets,
}

impl TypeState {
    fn subscribe(&mut self, name: &str) {
        if self.names.insert(name.to_string()) {
            self.names_digest.add(name, "");
        }
    }

    fn unsubscribe(&mut self, name: &str) {
        if self.names.remove(name) {
            self.names_digest.remove(name, "");
        }
    }

    fn hold(&mut self, name: String, version: String) {
        self.digest.add(&name, &version);
        self.buckets.add(&name, &version);
        if let Some(old) = self.held.insert(name.clone(), version) {
            self.digest.remove(&name, &old);
            self.buckets.remove(&name, &old);
        }
    }

    fn drop_held(&mut self, name: &str) {
        if let Some(old) = self.held.remove(name) {
            self.digest.remove(name, &old);
            self.buckets.remove(name, &old);
        }
    }

    /// The versions of a re-statement: none for a type matched whole, those outside
    /// `relied` and the [`resume::RELIED`] entry for one matched in buckets, else all.
    fn versions(&self, by_digest: bool, relied: u64) -> HashMap<String, String> {
        if by_digest {
            return HashMap::new();
        }
        let listed = self
            .held
            .iter()
            .filter(|(n, _)| relied == 0 || !resume::in_bitmap(relied, n));
        let mut out: HashMap<String, String> =
            listed.map(|(k, v)| (k.clone(), v.clone())).collect();
        if relied != 0 {
            out.insert(resume::RELIED.to_string(), format!("{relied:x}"));
        }
        out
    }
}

#[derive(Debug, Clone)]
struct Sent {
    stream: u64,
    type_url: String,
    resources: Vec<(String, String)>,
    removed: Vec<String>,
}

/// One Envoy stream's session.
#[derive(Debug, Default)]
pub struct Session {
    node: Bytes,
    types: BTreeMap<String, TypeState>,
    /// The current agent stream's number, counted from 1; 0 before the first.
    stream: u64,
    up: bool,
    /// The digests offered to the agent stream being opened, by type: whole, in
    /// buckets, and of the names subscribed.
    offered: BTreeMap<String, (Digest, Buckets, Digest)>,
    /// Answers forwarded and not yet ACKed or NACKed, by nonce, in the order forwarded.
    /// Agents count nonces from 1 on each stream, so an old agent's answer and a new
    /// one's may share one; Envoy replies to each answer once (a request naming a nonce
    /// is the reply to that answer), in the order received, so the oldest is the one
    /// replied to.
    sent: HashMap<String, VecDeque<Sent>>,
    /// The next agent stream's number, once it is re-stated while the current one
    /// carries (the overlap).
    next: Option<u64>,
    /// An answer went to Envoy from the current stream after the next one was re-stated.
    carried: bool,
    /// What the next stream's re-statement added to the counts: taken back if it is
    /// dropped, so that they count the streams switched to.
    next_counts: Counts,
    pub counts: Counts,
}

impl Session {
    /// A request from Envoy.
    pub fn on_envoy(&mut self, req: Framed<DeltaRequest>) -> Vec<Send> {
        let r = &req.view;
        if self.node.is_empty() && !r.node.is_empty() {
            self.node = r.node.clone();
        }
        let first = !self.types.contains_key(&r.type_url);
        // A type first asked for after the next stream's re-statement is not in it.
        self.carried |= first && self.next.is_some();
        let t = self.types.entry(r.type_url.clone()).or_default();
        if first {
            t.legacy = r.resource_names_subscribe.is_empty();
            t.wildcard = t.legacy;
            // Envoy reconnecting to a restarted relay says what it holds.
            for (k, v) in &r.initial_resource_versions {
                t.hold(k.clone(), v.clone());
            }
        }
        for n in &r.resource_names_subscribe {
            if n == "*" {
                t.wildcard = true;
            } else {
                t.subscribe(n);
            }
        }
        for n in &r.resource_names_unsubscribe {
            if n == "*" {
                t.wildcard = false;
                t.legacy = false;
            } else {
                t.unsubscribe(n);
            }
        }
        let mut from_earlier_stream = false;
        if !r.response_nonce.is_empty() {
            let nack = !r.error_detail.is_empty();
            if nack {
                self.counts.nacks += 1;
            }
            if let Some(s) = pop(&mut self.sent, &r.response_nonce) {
                if !nack {
                    let t = self.types.entry(s.type_url.clone()).or_default();
                    for n in &s.removed {
                        t.drop_held(n);
                    }
                    for (n, v) in s.resources {
                        t.hold(n, v);
                    }
                }
                from_earlier_stream = s.stream != self.stream;
            }
        }
        if !self.up {
            return Vec::new();
        }
        // The next stream, re-stated while this one carries, takes the subscription
        // changes made since.
        let next = (self.next.is_some()
            && !(r.resource_names_subscribe.is_empty() && r.resource_names_unsubscribe.is_empty()))
        .then(|| {
            Send::Next(Framed::of(DeltaRequest {
                type_url: r.type_url.clone(),
                resource_names_subscribe: r.resource_names_subscribe.clone(),
                resource_names_unsubscribe: r.resource_names_unsubscribe.clone(),
                ..Default::default()
            }))
        });
        if !from_earlier_stream {
            return std::iter::once(Send::Upstream(req)).chain(next).collect();
        }
        self.counts.absorbed += 1;
        if r.resource_names_subscribe.is_empty() && r.resource_names_unsubscribe.is_empty() {
            return Vec::new();
        }
        // The subscription change, without the nonce the agent never sent.
        std::iter::once(Send::Upstream(Framed::of(DeltaRequest {
            type_url: r.type_url.clone(),
            resource_names_subscribe: r.resource_names_subscribe.clone(),
            resource_names_unsubscribe: r.resource_names_unsubscribe.clone(),
            ..Default::default()
        })))
        .chain(next)
        .collect()
    }

    /// An answer from the agent.
    pub fn on_agent(&mut self, resp: Framed<DeltaResponse>) -> Vec<Send> {
        let r = &resp.view;
        if r.resources.is_empty() && r.removed_resources.is_empty() {
            self.counts.self_acked += 1;
            return vec![Send::Upstream(Framed::of(DeltaRequest {
                type_url: r.type_url.clone(),
                response_nonce: r.nonce.clone(),
                ..Default::default()
            }))];
        }
        self.carried |= self.next.is_some();
        self.sent
            .entry(r.nonce.clone())
            .or_default()
            .push_back(Sent {
                stream: self.stream,
                type_url: r.type_url.clone(),
                resources: r
                    .resources
                    .iter()
                    .map(|x| (x.name.clone(), x.version.clone()))
                    .collect(),
                removed: r.removed_resources.clone(),
            });
        vec![Send::Envoy(resp)]
    }

    /// The digest resume to offer the next agent stream: each type's digest of what
    /// Envoy holds (in buckets too from [`resume::BUCKETS_FROM`] resources), remembered
    /// until the stream is up.
    pub fn offer(&mut self) -> String {
        self.offer_from(resume::BUCKETS_FROM)
    }

    /// [`Session::offer`], in buckets from `from` resources.
    pub fn offer_from(&mut self, from: u64) -> String {
        self.offered = self
            .types
            .iter()
            .map(|(url, t)| (url.clone(), (t.digest, t.buckets, t.names_digest)))
            .collect();
        let types = self
            .offered
            .iter()
            .map(|(u, (d, b, _))| (u.as_str(), *d, b));
        let mut offer = resume::offer(types, from);
        // The names of a type subscribed by name, from as many as the buckets.
        for (url, (_, _, names)) in &self.offered {
            if names.count >= from.max(1) {
                offer.push(',');
                offer.push_str(&resume::names_entry(url, *names));
            }
        }
        offer
    }

    /// A new agent stream is open, without a digest resume: the re-statement of every
    /// type Envoy uses with the versions it holds.
    #[cfg(test)]
    pub fn upstream_up(&mut self) -> Vec<Send> {
        self.upstream_up_matched(None)
    }

    /// A new agent stream is open: the re-statement of every type Envoy uses. A type the
    /// agent `matched` by the digest offered (and whose digest has not moved since) goes
    /// without its versions: the agent takes Envoy to hold its snapshot's. Of a type it
    /// matched in buckets, the buckets whose digest has not moved either are relied on,
    /// and only the other buckets' versions go.
    pub fn upstream_up_matched(&mut self, matched: Option<&str>) -> Vec<Send> {
        self.stream += 1;
        self.up = true;
        self.next = None;
        self.restatement(matched, self.stream > 1)
    }

    /// The overlap: the re-statement for the next agent stream, sent on it
    /// ([`Send::Next`]) while the current one still carries. Taken once [`Session::quiet`].
    pub fn restate_next(&mut self, matched: Option<&str>) -> Vec<Send> {
        self.next = Some(self.stream + 1);
        self.carried = false;
        let before = self.counts;
        let out = self.restatement(matched, true);
        self.next_counts = self.counts.since(&before);
        out.into_iter()
            .map(|o| match o {
                Send::Upstream(r) => Send::Next(r),
                other => other,
            })
            .collect()
    }

    /// Nothing forwarded to Envoy is unanswered.
    pub fn quiet(&self) -> bool {
        self.sent.is_empty()
    }

    /// The next stream's re-statement still states what Envoy holds: nothing went to
    /// Envoy from the current stream after it (and nothing was unanswered when it was
    /// taken, [`Session::quiet`]).
    pub fn next_holds(&self) -> bool {
        self.next.is_some() && !self.carried
    }

    /// The next stream becomes the current one: what the current one sent is from an
    /// earlier stream from now on.
    pub fn switch_next(&mut self) {
        if let Some(next) = self.next.take() {
            self.stream = next;
            self.up = true;
        }
    }

    /// The next stream is dropped; a later one is re-stated afresh.
    pub fn abandon_next(&mut self) {
        if self.next.take().is_some() {
            self.counts
                .take_back(&std::mem::take(&mut self.next_counts));
        }
        self.carried = false;
    }

    /// The re-statement of every type Envoy uses, for a stream opened after the offer
    /// now taken; `resumed`: not the first agent stream.
    fn restatement(&mut self, matched: Option<&str>, resumed: bool) -> Vec<Send> {
        let offered = std::mem::take(&mut self.offered);
        if self.types.is_empty() {
            // Envoy has not asked yet: its first request goes as it came, node included.
            return Vec::new();
        }
        self.counts.resumes += u64::from(resumed);
        self.counts.digest_resumes += u64::from(resumed && matched.is_some());
        let buckets: BTreeMap<&str, u64> = matched
            .map(resume::parse_matched_buckets)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let whole: BTreeSet<&str> = matched
            .map(resume::parse_matched)
            .unwrap_or_default()
            .into_iter()
            .collect();
        let rank = |t: &str| ORDER.iter().position(|o| *o == t).unwrap_or(ORDER.len());
        let mut urls: Vec<&String> = self.types.keys().collect();
        urls.sort_by_key(|u| (rank(u), (*u).clone()));
        let mut out = Vec::with_capacity(urls.len());
        for (i, url) in urls.into_iter().enumerate() {
            let t = &self.types[url];
            let was = offered.get(url);
            // The names matched whose digest has not moved since the offer: relied on.
            let by_names = matched.is_some_and(|a| resume::names_matched(a, url))
                && was.map(|o| o.2) == Some(t.names_digest);
            let mut subscribe: Vec<String> = if by_names {
                vec![resume::RELIED.to_string()]
            } else {
                t.names.iter().cloned().collect()
            };
            if t.wildcard && !(t.legacy && subscribe.is_empty()) {
                subscribe.insert(0, "*".into());
            }
            let by_digest = whole.contains(url.as_str()) && was.map(|o| o.0) == Some(t.digest);
            // The buckets matched whose digest has not moved since the offer.
            let relied = match (buckets.get(url.as_str()), was) {
                (Some(m), Some((_, b, _))) => m & b.agree(&t.buckets),
                _ => 0,
            };
            if resumed {
                self.counts.names_types += u64::from(by_names);
                if by_digest {
                    self.counts.digest_types += 1;
                } else if relied != 0 {
                    self.counts.bucket_types += 1;
                } else {
                    self.counts.version_types += 1;
                }
            }
            out.push(Send::Upstream(Framed::of(DeltaRequest {
                node: if i == 0 {
                    self.node.clone()
                } else {
                    Bytes::new()
                },
                type_url: url.clone(),
                resource_names_subscribe: subscribe,
                initial_resource_versions: t.versions(by_digest, relied),
                ..Default::default()
            })));
        }
        out
    }

    /// The agent stream ended (and with it any overlap).
    pub fn upstream_down(&mut self) {
        self.up = false;
        self.abandon_next();
    }

    /// The versions Envoy holds of a type, as the session knows them.
    #[cfg(test)]
    pub fn held(&self, type_url: &str) -> BTreeMap<String, String> {
        self.types
            .get(type_url)
            .map(|t| t.held.clone())
            .unwrap_or_default()
    }
}

/// The oldest answer forwarded under `nonce` and not answered yet.
fn pop(sent: &mut HashMap<String, VecDeque<Sent>>, nonce: &str) -> Option<Sent> {
    let queue = sent.get_mut(nonce)?;
    let s = queue.pop_front();
    if queue.is_empty() {
        sent.remove(nonce);
    }
    s
}

#[cfg(test)]
mod tests;
