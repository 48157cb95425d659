//! The state-of-the-world rules, one test per rule, and a property test: any sequence of
//! subscriptions, answers, ACKs, NACKs and switches leaves a model of Envoy (with the
//! rules of state of the world: an answer of listeners or clusters is the whole set, one
//! of load assignments or secrets cannot remove anything) holding what a model of the
//! last agent serves.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use prost::Message;

use super::*;
use crate::wire::AnyView;

const CDS: &str = ORDER[0];
const EDS: &str = ORDER[1];
const LDS: &str = ORDER[2];
const SDS: &str = ORDER[4];

/// A resource's body as the tests write it: its name (field 1, as every ADS type has it)
/// and some content.
#[derive(Clone, PartialEq, prost::Message)]
struct Body {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    content: String,
}

fn any(type_url: &str, name: &str, content: &str) -> AnyView {
    AnyView {
        type_url: type_url.into(),
        value: Body {
            name: name.into(),
            content: content.into(),
        }
        .encode_to_vec()
        .into(),
    }
}

fn req(type_url: &str, version: &str, nonce: &str, names: &[&str]) -> Framed<SotwRequest> {
    Framed::of(SotwRequest {
        version_info: version.into(),
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
}

fn nack(type_url: &str, version: &str, nonce: &str, names: &[&str]) -> Framed<SotwRequest> {
    let mut r = req(type_url, version, nonce, names).view;
    r.error_detail = Bytes::from_static(b"\x08\x03");
    Framed::of(r)
}

fn resp(type_url: &str, version: &str, nonce: &str, res: &[(&str, &str)]) -> Framed<SotwResponse> {
    Framed::of(SotwResponse {
        version_info: version.into(),
        type_url: type_url.into(),
        nonce: nonce.into(),
        resources: res.iter().map(|(n, c)| any(type_url, n, c)).collect(),
    })
}

fn upstream(out: &[Out]) -> Vec<&SotwRequest> {
    out.iter()
        .map(|s| match s {
            Send::Upstream(r) => &r.view,
            _ => panic!("expected requests to the current agent stream only: {out:?}"),
        })
        .collect()
}

fn forwarded(out: &[Out]) -> bool {
    matches!(out, [Send::Envoy(_)])
}

/// A session with CDS (wildcard) and EDS (`a`, `b`) answered and ACKed on a first stream.
fn settled() -> Session {
    let mut s = Session::default();
    s.upstream_up();
    let mut first = req(CDS, "", "", &[]).view;
    first.node = Bytes::from_static(b"node");
    s.on_envoy(Framed::of(first));
    s.on_envoy(req(EDS, "", "", &["a", "b"]));
    assert!(forwarded(&s.on_agent(resp(
        CDS,
        "c1",
        "1",
        &[("a", "x"), ("b", "y")]
    ))));
    assert!(forwarded(&s.on_agent(resp(
        EDS,
        "e1",
        "2",
        &[("a", "1"), ("b", "1")]
    ))));
    s.on_envoy(req(CDS, "c1", "1", &[]));
    s.on_envoy(req(EDS, "e1", "2", &["a", "b"]));
    s
}

#[test]
fn requests_and_answers_pass_through_as_they_came_while_up() {
    let mut s = Session::default();
    assert!(
        s.upstream_up().is_empty(),
        "nothing to re-state before Envoy asks"
    );
    let first = req(LDS, "", "", &[]);
    let out = s.on_envoy(first.clone());
    assert!(matches!(&out[..], [Send::Upstream(r)] if r.bytes == first.bytes));
    let answer = resp(LDS, "v1", "1", &[("l", "x")]);
    let out = s.on_agent(answer.clone());
    assert!(matches!(&out[..], [Send::Envoy(r)] if r.bytes == answer.bytes));
    let ack = req(LDS, "v1", "1", &[]);
    let out = s.on_envoy(ack.clone());
    assert!(matches!(&out[..], [Send::Upstream(r)] if r.bytes == ack.bytes));
    assert_eq!(s.held(LDS).keys().collect::<Vec<_>>(), ["l"]);
}

#[test]
fn a_new_stream_restates_each_type_with_the_version_envoy_acked_and_no_nonce() {
    let mut s = settled();
    s.on_envoy(req(SDS, "", "", &["svid|p"]));
    s.on_envoy(req(LDS, "", "", &[]));
    // LDS answered, not ACKed yet: Envoy's version is still none.
    s.on_agent(resp(LDS, "l1", "3", &[("l", "x")]));
    s.upstream_down();
    let out = s.upstream_up();
    let r = upstream(&out);
    let got: Vec<(&str, &str, &str)> = r
        .iter()
        .map(|r| {
            (
                r.type_url.as_str(),
                r.version_info.as_str(),
                r.response_nonce.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (CDS, "c1", ""),
            (EDS, "e1", ""),
            (LDS, "", ""),
            (SDS, "", "")
        ]
    );
    assert_eq!(
        r[0].node,
        Bytes::from_static(b"node"),
        "the node on the first"
    );
    assert!(r[1..].iter().all(|r| r.node.is_empty()));
    assert_eq!(r[1].resource_names, ["a", "b"]);
    assert_eq!(r[3].resource_names, ["svid|p"]);
    assert_eq!(s.counts.resumes, 1);
}

#[test]
fn an_answer_envoy_already_holds_is_acked_by_the_relay_and_not_forwarded() {
    let mut s = settled();
    s.upstream_down();
    s.upstream_up();
    // The new owner answers each subscription with all of it: the same bytes.
    let out = s.on_agent(resp(CDS, "c1", "1", &[("a", "x"), ("b", "y")]));
    let r = upstream(&out);
    assert_eq!(
        (
            r[0].type_url.as_str(),
            r[0].response_nonce.as_str(),
            r[0].version_info.as_str()
        ),
        (CDS, "1", "c1")
    );
    assert!(
        r[0].resource_names.is_empty(),
        "the subscription as Envoy has it"
    );
    let out = s.on_agent(resp(EDS, "e1", "2", &[("b", "1"), ("a", "1")]));
    assert_eq!(upstream(&out)[0].resource_names, ["a", "b"]);
    assert_eq!(s.counts.self_acked, 2);
    // After the type settled, a change is forwarded as it came.
    assert!(forwarded(&s.on_agent(resp(EDS, "e2", "3", &[("a", "2")]))));
}

#[test]
fn an_answer_that_differs_in_one_resource_or_leaves_one_out_is_forwarded_whole() {
    let mut s = settled();
    s.upstream_down();
    s.upstream_up();
    assert!(forwarded(&s.on_agent(resp(
        EDS,
        "e2",
        "1",
        &[("a", "1"), ("b", "2")]
    ))));
    // Clusters: an answer without `b` removes it, so it goes to Envoy.
    assert!(forwarded(&s.on_agent(resp(CDS, "c2", "2", &[("a", "x")]))));
    assert_eq!(s.counts.self_acked, 0);
    // Load assignments: one without `b` removes nothing, and `a` is held.
    let mut s = settled();
    s.upstream_down();
    s.upstream_up();
    assert!(upstream(&s.on_agent(resp(EDS, "e1", "1", &[("a", "1")]))).len() == 1);
}

#[test]
fn acks_of_the_old_streams_nonces_are_absorbed_and_a_subscription_change_carries_the_new_nonce() {
    let mut s = settled();
    // An answer in flight when the stream ends: Envoy ACKs it on the next.
    s.on_agent(resp(EDS, "e2", "3", &[("a", "2")]));
    s.upstream_down();
    s.upstream_up();
    assert!(
        s.on_envoy(req(EDS, "e2", "3", &["a", "b"])).is_empty(),
        "absorbed"
    );
    assert_eq!(s.counts.absorbed, 1);
    let a_hash = s.held(EDS)["a"];
    // The new owner's answer is what Envoy now holds: ACKed by the relay.
    let out = s.on_agent(resp(EDS, "e2", "1", &[("a", "2"), ("b", "1")]));
    assert_eq!(upstream(&out)[0].response_nonce, "1");
    assert_eq!(s.held(EDS)["a"], a_hash);
    // Envoy subscribes to `c` on its last nonce, "3": the agent gets the change on its own
    // last nonce, which it would otherwise take for a stale request and ignore.
    let out = s.on_envoy(req(EDS, "e2", "3", &["a", "b", "c"]));
    let r = upstream(&out);
    assert_eq!(
        (r[0].response_nonce.as_str(), r[0].resource_names.clone()),
        ("1", vec!["a".to_string(), "b".into(), "c".into()])
    );
    // An answer forwarded on the new stream: Envoy's ACK of it will carry the
    // subscription; an older nonce meanwhile goes as it came (the agent ignores it).
    s.upstream_down();
    s.upstream_up();
    assert!(forwarded(&s.on_agent(resp(EDS, "e3", "1", &[("c", "1")]))));
    let old = req(EDS, "e2", "3", &["a"]);
    let out = s.on_envoy(old.clone());
    assert!(matches!(&out[..], [Send::Upstream(r)] if r.bytes == old.bytes));
    // A NACK of an old nonce: absorbed, nothing held.
    s.on_agent(resp(CDS, "c2", "2", &[("z", "1")]));
    s.upstream_down();
    s.upstream_up();
    assert!(s.on_envoy(nack(CDS, "c1", "2", &[])).is_empty());
    assert!(!s.held(CDS).contains_key("z"));
    assert_eq!(s.counts.nacks, 1);
}

#[test]
fn a_subscription_change_before_the_new_streams_first_answer_goes_without_a_nonce() {
    let mut s = settled();
    s.upstream_down();
    s.upstream_up();
    let out = s.on_envoy(req(EDS, "e1", "2", &["a", "b", "c"]));
    let r = upstream(&out);
    assert_eq!(r[0].response_nonce, "");
    assert_eq!(r[0].resource_names, ["a", "b", "c"]);
    // The same names again (an ACK-shaped request with nothing new): nothing to say.
    assert!(s.on_envoy(req(EDS, "e1", "2", &["c", "b", "a"])).is_empty());
}

#[test]
fn a_subscription_made_during_the_switch_is_restated_and_a_name_dropped_is_no_longer_held() {
    let mut s = settled();
    s.upstream_down();
    assert!(
        s.on_envoy(req(EDS, "e1", "2", &["a"])).is_empty(),
        "nothing sent while down"
    );
    assert!(s.on_envoy(req(EDS, "e1", "2", &["a", "b"])).is_empty());
    let out = s.upstream_up();
    assert_eq!(upstream(&out)[1].resource_names, ["a", "b"]);
    // Envoy dropped `b` when it unsubscribed: the same `b` goes to it again.
    assert!(forwarded(&s.on_agent(resp(
        EDS,
        "e1",
        "1",
        &[("a", "1"), ("b", "1")]
    ))));
}

#[test]
fn envoy_reconnecting_to_a_restarted_relay_gets_the_first_answers() {
    let mut s = Session::default();
    assert!(
        s.on_envoy(req(CDS, "c1", "", &[])).is_empty(),
        "no agent stream yet"
    );
    let out = s.upstream_up();
    assert_eq!(upstream(&out)[0].version_info, "c1");
    assert_eq!(s.counts.resumes, 0, "the first stream is not a resume");
    // The relay does not know what Envoy holds: even an empty answer goes to it.
    assert!(forwarded(&s.on_agent(resp(CDS, "c1", "1", &[]))));
}

#[test]
fn the_same_nonce_from_two_agents_counts_as_held_for_neither() {
    let mut s = settled();
    assert!(forwarded(&s.on_agent(resp(CDS, "c2", "3", &[("a", "x")]))));
    s.upstream_down();
    s.upstream_up();
    assert!(forwarded(&s.on_agent(resp(CDS, "c3", "3", &[("a", "z")]))));
    // Envoy's ACK of "3": of the first answer or of the second?
    s.on_envoy(req(CDS, "c2", "3", &[]));
    s.upstream_down();
    s.upstream_up();
    assert!(
        forwarded(&s.on_agent(resp(CDS, "c3", "1", &[("a", "z")]))),
        "not known as held: forwarded"
    );
}

/// A small random generator, so the property test needs no crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

type Map = BTreeMap<String, String>;

/// What a state-of-the-world server keeps of one type on a stream.
#[derive(Default)]
struct Client {
    names: Vec<String>,
    nonce: String,
    /// Complete types: the version last sent. Named types: what was sent, by name.
    version: String,
    sent: Map,
}

/// A model of the agent's state-of-the-world server (`worker/src/xds/stream.rs`): a
/// request without a nonce subscribes and is answered with everything subscribed to; a
/// request naming a nonce other than the type's last is stale and ignored, subscription
/// included; an ACK or NACK of the last takes its names. Listeners and clusters go whole
/// when their version changes; load assignments and secrets go when their content does.
#[derive(Default)]
struct Agent {
    snapshot: BTreeMap<String, Map>,
    client: BTreeMap<String, Client>,
    nonce: u64,
}

fn version_of(m: &Map) -> String {
    format!("{m:?}")
}

impl Agent {
    /// The next owner: the snapshot as it is, nonces from 1 again, no memory of the
    /// client.
    fn successor(self) -> Agent {
        Agent {
            snapshot: self.snapshot,
            ..Agent::default()
        }
    }

    fn handle(&mut self, r: &SotwRequest) -> Vec<Framed<SotwResponse>> {
        let c = self.client.entry(r.type_url.clone()).or_default();
        let answer = r.response_nonce.is_empty();
        if !answer && r.response_nonce != c.nonce {
            return Vec::new();
        }
        c.names = r.resource_names.clone();
        let names: BTreeSet<&String> = c.names.iter().collect();
        c.sent.retain(|n, _| names.contains(n));
        let url = r.type_url.clone();
        self.diff(&url, answer).into_iter().collect()
    }

    fn diff(&mut self, url: &str, answer: bool) -> Option<Framed<SotwResponse>> {
        let snap = self.snapshot.get(url).cloned().unwrap_or_default();
        let c = self.client.get_mut(url)?;
        let version = version_of(&snap);
        let res: Map = if complete(url) {
            if !answer && c.version == version {
                return None;
            }
            snap.clone()
        } else {
            let want: Map = snap
                .iter()
                .filter(|(n, v)| c.names.contains(n) && (answer || c.sent.get(*n) != Some(*v)))
                .map(|(n, v)| (n.clone(), v.clone()))
                .collect();
            if want.is_empty() && !answer {
                return None;
            }
            c.sent.extend(want.clone());
            want
        };
        c.version = version.clone();
        self.nonce += 1;
        c.nonce = self.nonce.to_string();
        Some(Framed::of(SotwResponse {
            version_info: version,
            type_url: url.into(),
            nonce: c.nonce.clone(),
            resources: res.iter().map(|(n, v)| any(url, n, v)).collect(),
        }))
    }
}

/// Envoy in state of the world: its subscription per type, what it holds, the version it
/// accepted last and the nonce it received last; an answer of a complete type replaces
/// what it holds, any other adds to it (it cannot remove); a name it stops subscribing
/// to is dropped.
#[derive(Default)]
struct Envoy {
    names: BTreeMap<String, Vec<String>>,
    held: BTreeMap<String, Map>,
    version: BTreeMap<String, String>,
    nonce: BTreeMap<String, String>,
    unanswered: Vec<(Framed<SotwResponse>, bool)>,
}

impl Envoy {
    fn receive(&mut self, answer: &SotwResponse, ok: bool) {
        self.nonce
            .insert(answer.type_url.clone(), answer.nonce.clone());
        if !ok {
            return;
        }
        let names = self
            .names
            .get(&answer.type_url)
            .cloned()
            .unwrap_or_default();
        let got: Map = answer
            .resources
            .iter()
            .map(|a| {
                let b = Body::decode(a.value.clone()).expect("a body");
                (b.name, b.content)
            })
            .collect();
        let t = self.held.entry(answer.type_url.clone()).or_default();
        if complete(&answer.type_url) {
            *t = got;
        } else {
            t.extend(got.into_iter().filter(|(n, _)| names.contains(n)));
        }
        self.version
            .insert(answer.type_url.clone(), answer.version_info.clone());
    }

    /// Its ACK (or NACK) of `answer`, with its subscription as it is now.
    fn reply(&self, answer: &SotwResponse, ok: bool) -> Framed<SotwRequest> {
        let url = &answer.type_url;
        let names: Vec<&str> = self.names[url].iter().map(String::as_str).collect();
        let version = self.version.get(url).cloned().unwrap_or_default();
        if ok {
            req(url, &version, &answer.nonce, &names)
        } else {
            nack(url, &version, &answer.nonce, &names)
        }
    }

    /// Subscribes to `names` of a named type (dropping what it no longer names).
    fn subscribe(&mut self, url: &str, names: Vec<String>) -> Framed<SotwRequest> {
        let set: BTreeSet<&String> = names.iter().collect();
        self.held
            .entry(url.into())
            .or_default()
            .retain(|n, _| set.contains(n));
        self.names.insert(url.into(), names.clone());
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        req(
            url,
            &self.version.get(url).cloned().unwrap_or_default(),
            &self.nonce.get(url).cloned().unwrap_or_default(),
            &names,
        )
    }
}

#[test]
fn any_sequence_of_switches_leaves_envoy_holding_the_last_agents_snapshot() {
    let urls = [CDS, EDS, LDS, SDS];
    let names = ["a", "b", "c", "d"];
    let mut suppressed = 0;
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut s = Session::default();
        let mut envoy = Envoy::default();
        let mut agent = Agent::default();
        let mut version = 0u64;
        let mut shuffle = |agent: &mut Agent, rng: &mut Rng| {
            for u in urls {
                let snap = agent.snapshot.entry(u.into()).or_default();
                for n in names {
                    match rng.next(6) {
                        0 => {
                            snap.remove(n);
                        }
                        1 => {
                            version += 1;
                            snap.insert(n.into(), format!("v{version}"));
                        }
                        _ => {}
                    }
                }
            }
        };
        let pick = |rng: &mut Rng| -> Vec<String> {
            names
                .iter()
                .filter(|_| rng.next(3) != 0)
                .map(|n| n.to_string())
                .collect()
        };
        shuffle(&mut agent, &mut rng);
        let mut to_agent: Vec<SotwRequest> = Vec::new();
        let mut to_envoy: Vec<Framed<SotwResponse>> = Vec::new();
        let route = |out: Vec<Out>, a: &mut Vec<SotwRequest>, e: &mut Vec<Framed<SotwResponse>>| {
            for o in out {
                match o {
                    Send::Upstream(r) => a.push(r.view),
                    Send::Envoy(r) => e.push(r),
                    Send::Next(_) => panic!("state of the world has no overlap"),
                }
            }
        };
        route(s.upstream_up(), &mut to_agent, &mut to_envoy);
        for u in urls {
            let sub = if complete(u) {
                Vec::new()
            } else {
                pick(&mut rng)
            };
            let r = envoy.subscribe(u, sub);
            route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
        }
        for _ in 0..60 {
            for r in std::mem::take(&mut to_agent) {
                for answer in agent.handle(&r) {
                    route(s.on_agent(answer), &mut to_agent, &mut to_envoy);
                }
            }
            for answer in std::mem::take(&mut to_envoy) {
                let ok = rng.next(10) != 0;
                envoy.receive(&answer.view, ok);
                envoy.unanswered.push((answer, ok));
            }
            if rng.next(2) == 0 {
                for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
                    let r = envoy.reply(&answer.view, ok);
                    route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
                }
            }
            match rng.next(6) {
                0 => {
                    s.upstream_down();
                    to_agent.clear();
                    agent = agent.successor();
                    if rng.next(2) == 0 {
                        shuffle(&mut agent, &mut rng);
                    }
                    route(s.upstream_up(), &mut to_agent, &mut to_envoy);
                }
                1 => {
                    shuffle(&mut agent, &mut rng);
                    for u in urls {
                        if let Some(a) = agent.diff(u, false) {
                            route(s.on_agent(a), &mut to_agent, &mut to_envoy);
                        }
                    }
                }
                2 => {
                    // Envoy ACKs an answer as it applies it: its replies go before a
                    // later request.
                    for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
                        let r = envoy.reply(&answer.view, ok);
                        route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
                    }
                    let u = if rng.next(2) == 0 { EDS } else { SDS };
                    let r = envoy.subscribe(u, pick(&mut rng));
                    route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
                }
                _ => {}
            }
        }
        // Settle: a last switch (NACKed content is sent again only then, as Envoy's own
        // reconnect would have it), every answer delivered and ACKed.
        s.upstream_down();
        agent = agent.successor();
        for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
            let r = envoy.reply(&answer.view, ok);
            route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
        }
        to_agent.clear();
        route(s.upstream_up(), &mut to_agent, &mut to_envoy);
        while !to_agent.is_empty() || !to_envoy.is_empty() {
            for r in std::mem::take(&mut to_agent) {
                for answer in agent.handle(&r) {
                    route(s.on_agent(answer), &mut to_agent, &mut to_envoy);
                }
            }
            for answer in std::mem::take(&mut to_envoy) {
                envoy.receive(&answer.view, true);
                let r = envoy.reply(&answer.view, true);
                route(s.on_envoy(r), &mut to_agent, &mut to_envoy);
            }
        }
        for u in urls {
            let snap = agent.snapshot.get(u).cloned().unwrap_or_default();
            let held = envoy.held.get(u).cloned().unwrap_or_default();
            if complete(u) {
                assert_eq!(
                    held, snap,
                    "seed {seed}, {u}: Envoy holds the last agent's set"
                );
                let known: Vec<String> = s.held(u).into_keys().collect();
                let want: Vec<String> = snap.into_keys().collect();
                assert_eq!(known, want, "seed {seed}, {u}: the session knows it");
            } else {
                let subscribed = &envoy.names[u];
                for (n, v) in &snap {
                    if subscribed.contains(n) {
                        assert_eq!(held.get(n), Some(v), "seed {seed}, {u}: {n} as served");
                    }
                }
                assert!(
                    held.keys().all(|n| subscribed.contains(n)),
                    "seed {seed}, {u}: only what Envoy subscribes to"
                );
            }
        }
        suppressed += s.counts.self_acked;
    }
    assert!(
        suppressed > 100,
        "answers Envoy held were ACKed by the relay: {suppressed}"
    );
}
