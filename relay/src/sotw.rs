//! The session rules for state-of-the-world ADS, pure, as [`crate::session`] is for
//! incremental ADS: one Envoy stream and the succession of agent streams behind it.
//!
//! What it keeps, per type: Envoy's subscription (the names of its last request), the
//! `version_info` Envoy last ACKed, and what Envoy holds: each resource's name and a hash
//! of its bytes, from the answers Envoy ACKed (each answer forwarded is remembered by
//! nonce until Envoy ACKs or NACKs it). Never the resources.
//!
//! State of the world differs from delta in what an answer means: for listeners and
//! clusters an answer is the type's whole set (what it leaves out, Envoy removes); for
//! load assignments, routes and secrets it carries some of the names subscribed to and
//! Envoy keeps the others (it cannot remove one that way). A new agent stream answers a
//! subscription with everything subscribed to, whatever `version_info` says.
//!
//! The rules:
//! - While an agent stream is up, Envoy's requests go to it as they came, and its answers
//!   go to Envoy as they came.
//! - When it ends, nothing is sent until the next is up; Envoy's requests meanwhile are
//!   folded into the state (its subscription, its ACKs), not queued.
//! - On a new agent stream, one request per type Envoy uses re-states its subscription
//!   with the `version_info` it last ACKed and no nonce, the node on the first, in ADS
//!   order (clusters, endpoints, listeners, routes, secrets, then the rest).
//! - Until an answer of a type has been forwarded on the new stream, an answer that Envoy
//!   already holds is ACKed by the relay itself and not forwarded: every resource in it
//!   held at the same bytes and, for listeners and clusters, no other held.
//! - Envoy's ACK or NACK of an answer from an earlier agent stream is absorbed (an ACK's
//!   resources count as held): the new stream never sent that nonce, and an agent ignores
//!   a request naming a nonce it did not send last, subscription included. A subscription
//!   change riding on it is passed on with the nonce of the new stream's last answer of
//!   the type (none before one), unless an answer was forwarded on the new stream since,
//!   whose ACK will carry it.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use bytes::Bytes;

use crate::session::{Core, Counts, ORDER, Send};
use crate::wire::{Framed, SOTW_PATH, SotwRequest, SotwResponse};

type Out = Send<SotwRequest, SotwResponse>;

/// Whether an answer of the type is the type's whole set (listeners, clusters).
fn complete(type_url: &str) -> bool {
    type_url == ORDER[0] || type_url == ORDER[2]
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct TypeState {
    /// The names of Envoy's last request, as sent.
    names: Vec<String>,
    /// The `version_info` Envoy last ACKed (or reported, on a first request).
    version: String,
    /// What Envoy holds: name → hash of the resource's bytes.
    held: BTreeMap<String, u64>,
    /// Whether `held` is what Envoy holds (of a complete type: all it holds): not before
    /// Envoy ACKed an answer of the type through this relay (Envoy reconnecting to a
    /// restarted relay holds what it held), nor after an answer whose ACK could not be
    /// told apart.
    known: bool,
    /// The last answer forwarded to Envoy: its nonce and agent stream.
    forwarded: Option<(String, u64)>,
    /// The last answer of the current agent stream, forwarded or ACKed by the relay: the
    /// nonce a subscription change sent for Envoy names.
    last_nonce: String,
    /// The names the current agent stream was last given.
    upstream_names: Vec<String>,
}

#[derive(Debug, Clone)]
struct Sent {
    stream: u64,
    version: String,
    /// Name and hash of each resource, or None when a name could not be read.
    resources: Option<Vec<(String, u64)>>,
    /// Another answer forwarded under the same type and nonce (agents count nonces from
    /// 1 on each stream) before Envoy answered this one: Envoy's reply cannot be told
    /// apart, so what it carried is not known to be held, nor not held.
    ambiguous: bool,
}

/// One Envoy stream's session (state of the world).
#[derive(Debug, Default)]
pub struct Session {
    node: Bytes,
    types: BTreeMap<String, TypeState>,
    /// The current agent stream's number, counted from 1; 0 before the first.
    stream: u64,
    up: bool,
    /// Answers forwarded and not yet ACKed or NACKed, by type and nonce, in the order
    /// forwarded (Envoy answers them in that order).
    sent: HashMap<(String, String), VecDeque<Sent>>,
    pub counts: Counts,
}

fn same_names(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && {
        let a: BTreeSet<&String> = a.iter().collect();
        let b: BTreeSet<&String> = b.iter().collect();
        a == b
    }
}

impl Session {
    /// A request from Envoy.
    pub fn on_envoy(&mut self, req: Framed<SotwRequest>) -> Vec<Out> {
        let r = &req.view;
        if self.node.is_empty() && !r.node.is_empty() {
            self.node = r.node.clone();
        }
        let stream = self.stream;
        let first = !self.types.contains_key(&r.type_url);
        let t = self.types.entry(r.type_url.clone()).or_default();
        if first {
            t.version = r.version_info.clone();
        }
        t.names = r.resource_names.clone();
        let latest = t
            .forwarded
            .as_ref()
            .is_some_and(|(n, s)| *n == r.response_nonce && *s == stream);
        let mut earlier = false;
        if !r.response_nonce.is_empty() {
            let nack = !r.error_detail.is_empty();
            if nack {
                self.counts.nacks += 1;
            }
            let key = (r.type_url.clone(), r.response_nonce.clone());
            if let Some(s) = pop(&mut self.sent, &key) {
                if s.ambiguous {
                    forget(t, &r.type_url, s.resources);
                } else if !nack {
                    hold(t, &r.type_url, s.version, s.resources);
                }
                earlier = s.stream != stream;
            } else {
                // Answered before (a later request names the nonce again): from an
                // earlier stream unless it is the current stream's last forwarded.
                earlier = t.forwarded.as_ref().is_none_or(|(_, s)| *s != stream);
            }
        }
        if !complete(&r.type_url) {
            // Envoy keeps only what it subscribes to (an answer's other names included):
            // a name subscribed to again is not held. (No names: nothing known as held.)
            let names: BTreeSet<&String> = t.names.iter().collect();
            t.held.retain(|n, _| names.contains(n));
        }
        if !self.up {
            return Vec::new();
        }
        if r.response_nonce.is_empty() || latest || !earlier {
            t.upstream_names = t.names.clone();
            return vec![Send::Upstream(req)];
        }
        self.counts.absorbed += 1;
        let forwarded_since = t.forwarded.as_ref().is_some_and(|(_, s)| *s == stream);
        if forwarded_since || same_names(&t.names, &t.upstream_names) {
            return Vec::new();
        }
        // The subscription change, with the nonce the agent sent last.
        t.upstream_names = t.names.clone();
        vec![Send::Upstream(Framed::of(SotwRequest {
            version_info: t.version.clone(),
            resource_names: t.names.clone(),
            type_url: r.type_url.clone(),
            response_nonce: t.last_nonce.clone(),
            ..Default::default()
        }))]
    }

    /// An answer from the agent.
    pub fn on_agent(&mut self, resp: Framed<SotwResponse>) -> Vec<Out> {
        let r = &resp.view;
        let stream = self.stream;
        let resources: Option<Vec<(String, u64)>> =
            r.resources.iter().map(|a| a.name_and_hash()).collect();
        let t = self.types.entry(r.type_url.clone()).or_default();
        t.last_nonce = r.nonce.clone();
        let fresh = t.forwarded.as_ref().is_none_or(|(_, s)| *s != stream);
        if fresh
            && t.known
            && let Some(res) = &resources
        {
            let held_all = res.iter().all(|(n, h)| t.held.get(n) == Some(h));
            let whole = !complete(&r.type_url) || t.held.len() == res.len();
            if held_all && whole {
                self.counts.self_acked += 1;
                t.upstream_names = t.names.clone();
                return vec![Send::Upstream(Framed::of(SotwRequest {
                    version_info: r.version_info.clone(),
                    resource_names: t.names.clone(),
                    type_url: r.type_url.clone(),
                    response_nonce: r.nonce.clone(),
                    ..Default::default()
                }))];
            }
        }
        t.forwarded = Some((r.nonce.clone(), stream));
        let key = (r.type_url.clone(), r.nonce.clone());
        let queue = self.sent.entry(key).or_default();
        // An earlier agent's answer under the same nonce, not answered yet: Envoy's
        // replies to the two cannot be told apart.
        let ambiguous = !queue.is_empty();
        for q in queue.iter_mut() {
            q.ambiguous = true;
        }
        queue.push_back(Sent {
            stream,
            version: r.version_info.clone(),
            resources,
            ambiguous,
        });
        vec![Send::Envoy(resp)]
    }

    /// A new agent stream is open: the re-statement of every type Envoy uses.
    pub fn upstream_up(&mut self) -> Vec<Out> {
        self.stream += 1;
        self.up = true;
        if self.types.is_empty() {
            return Vec::new();
        }
        self.counts.resumes += u64::from(self.stream > 1);
        let rank = |t: &str| ORDER.iter().position(|o| *o == t).unwrap_or(ORDER.len());
        let mut urls: Vec<String> = self.types.keys().cloned().collect();
        urls.sort_by_key(|u| (rank(u), u.clone()));
        let mut out = Vec::with_capacity(urls.len());
        for (i, url) in urls.into_iter().enumerate() {
            let t = self.types.get_mut(&url).expect("listed");
            t.last_nonce.clear();
            t.upstream_names = t.names.clone();
            out.push(Send::Upstream(Framed::of(SotwRequest {
                version_info: t.version.clone(),
                node: if i == 0 {
                    self.node.clone()
                } else {
                    Bytes::new()
                },
                resource_names: t.names.clone(),
                type_url: url,
                ..Default::default()
            })));
        }
        out
    }

    /// The agent stream ended.
    pub fn upstream_down(&mut self) {
        self.up = false;
    }

    /// What Envoy holds of a type, as the session knows it: name → hash.
    #[cfg(test)]
    pub fn held(&self, type_url: &str) -> BTreeMap<String, u64> {
        self.types
            .get(type_url)
            .map(|t| t.held.clone())
            .unwrap_or_default()
    }
}

/// The oldest answer forwarded under `key` and not answered yet.
fn pop(
    sent: &mut HashMap<(String, String), VecDeque<Sent>>,
    key: &(String, String),
) -> Option<Sent> {
    let queue = sent.get_mut(key)?;
    let s = queue.pop_front();
    if queue.is_empty() {
        sent.remove(key);
    }
    s
}

/// Envoy ACKed an answer: what it carried is held (all of it, for a complete type).
fn hold(t: &mut TypeState, type_url: &str, version: String, resources: Option<Vec<(String, u64)>>) {
    t.version = version;
    let Some(res) = resources else {
        forget_all(t);
        return;
    };
    if complete(type_url) {
        t.held = res.into_iter().collect();
    } else {
        t.held.extend(res);
    }
    t.known = true;
}

/// An answer Envoy may or may not hold: its names are no longer known as held.
fn forget(t: &mut TypeState, type_url: &str, resources: Option<Vec<(String, u64)>>) {
    match resources {
        Some(res) if !complete(type_url) => {
            for (n, _) in res {
                t.held.remove(&n);
            }
        }
        _ => forget_all(t),
    }
}

fn forget_all(t: &mut TypeState) {
    t.held.clear();
    t.known = false;
}

impl Core for Session {
    type Req = SotwRequest;
    type Resp = SotwResponse;
    const PATH: &'static str = SOTW_PATH;
    const API: &'static str = "sotw";
    fn on_envoy(&mut self, req: Framed<SotwRequest>) -> Vec<Out> {
        Session::on_envoy(self, req)
    }
    fn on_agent(&mut self, resp: Framed<SotwResponse>) -> Vec<Out> {
        Session::on_agent(self, resp)
    }
    fn upstream_up(&mut self, _matched: Option<&str>) -> Vec<Out> {
        Session::upstream_up(self)
    }
    fn upstream_down(&mut self) {
        Session::upstream_down(self)
    }
    fn counts(&self) -> Counts {
        self.counts
    }
}

#[cfg(test)]
mod tests;
