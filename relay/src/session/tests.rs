//! The session rules, one test per rule, and a property test: any sequence of
//! subscriptions, answers, ACKs, NACKs and switches leaves a model of Envoy holding
//! exactly what a model of the last agent serves.

use super::*;
use crate::wire::Resource;

const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
const LDS: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
const SDS: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

fn req(type_url: &str, subscribe: &[&str]) -> Framed<DeltaRequest> {
    Framed::of(DeltaRequest {
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    })
}

fn ack(type_url: &str, nonce: &str) -> Framed<DeltaRequest> {
    Framed::of(DeltaRequest {
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    })
}

fn nack(type_url: &str, nonce: &str) -> Framed<DeltaRequest> {
    Framed::of(DeltaRequest {
        type_url: type_url.into(),
        response_nonce: nonce.into(),
        error_detail: Bytes::from_static(b"\x08\x03"),
        ..Default::default()
    })
}

fn resp(
    type_url: &str,
    nonce: &str,
    res: &[(&str, &str)],
    removed: &[&str],
) -> Framed<DeltaResponse> {
    Framed::of(DeltaResponse {
        type_url: type_url.into(),
        nonce: nonce.into(),
        resources: res
            .iter()
            .map(|(n, v)| Resource {
                name: n.to_string(),
                version: v.to_string(),
            })
            .collect(),
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
    })
}

fn upstream(out: &[Send]) -> Vec<&DeltaRequest> {
    out.iter()
        .map(|s| match s {
            Send::Upstream(r) => &r.view,
            _ => panic!("expected requests to the current agent stream only: {out:?}"),
        })
        .collect()
}

/// The requests to the next agent stream (the overlap's), in order.
fn to_next(out: &[Send]) -> Vec<&DeltaRequest> {
    requests(out, true)
}

/// The requests to the current agent stream, in order.
fn to_current(out: &[Send]) -> Vec<&DeltaRequest> {
    requests(out, false)
}

fn requests(out: &[Send], next: bool) -> Vec<&DeltaRequest> {
    out.iter()
        .filter_map(|s| match s {
            Send::Next(r) if next => Some(&r.view),
            Send::Upstream(r) if !next => Some(&r.view),
            _ => None,
        })
        .collect()
}

#[test]
fn requests_and_answers_pass_through_as_they_came_while_up() {
    let mut s = Session::default();
    assert!(
        s.upstream_up().is_empty(),
        "nothing to re-state before Envoy asks"
    );
    let mut first = req(CDS, &[]);
    first.view.node = Bytes::from_static(b"\x0a\x02id");
    first = Framed::of(first.view);
    let out = s.on_envoy(first.clone());
    assert!(matches!(&out[..], [Send::Upstream(r)] if r.bytes == first.bytes));
    let answer = resp(CDS, "n1", &[("a", "1")], &[]);
    let out = s.on_agent(answer.clone());
    assert!(matches!(&out[..], [Send::Envoy(r)] if r.bytes == answer.bytes));
    let out = s.on_envoy(ack(CDS, "n1"));
    assert_eq!(upstream(&out)[0].response_nonce, "n1");
    assert_eq!(s.held(CDS), BTreeMap::from([("a".into(), "1".into())]));
}

#[test]
fn a_new_stream_restates_subscriptions_with_the_versions_envoy_acked_in_ads_order() {
    let mut s = Session::default();
    s.upstream_up();
    let mut first = req(LDS, &[]);
    first.view.node = Bytes::from_static(b"node");
    s.on_envoy(Framed::of(first.view));
    s.on_envoy(req(SDS, &["svid|a"]));
    s.on_envoy(req(CDS, &[]));
    s.on_envoy(req(EDS, &["c1"]));
    s.on_agent(resp(CDS, "c", &[("c1", "v1"), ("c2", "v1")], &[]));
    s.on_agent(resp(EDS, "e", &[("c1", "v7")], &[]));
    s.on_agent(resp(LDS, "l", &[("l1", "v3")], &[]));
    s.on_envoy(ack(CDS, "c"));
    s.on_envoy(ack(EDS, "e"));
    // LDS's answer is not ACKed yet: Envoy does not hold it.
    s.upstream_down();
    let out = s.upstream_up();
    let r = upstream(&out);
    let urls: Vec<&str> = r.iter().map(|r| r.type_url.as_str()).collect();
    assert_eq!(urls, [CDS, EDS, LDS, SDS]);
    assert_eq!(
        r[0].node,
        Bytes::from_static(b"node"),
        "the node on the first"
    );
    assert!(r[1..].iter().all(|r| r.node.is_empty()));
    assert!(
        r[0].resource_names_subscribe.is_empty(),
        "legacy wildcard kept as sent"
    );
    assert_eq!(r[0].initial_resource_versions.len(), 2);
    assert_eq!(r[1].resource_names_subscribe, ["c1"]);
    assert_eq!(r[1].initial_resource_versions["c1"], "v7");
    assert!(
        r[2].initial_resource_versions.is_empty(),
        "an unACKed answer is not held"
    );
    assert_eq!(r[3].resource_names_subscribe, ["svid|a"]);
    assert_eq!(s.counts.resumes, 1);
}

#[test]
fn an_ack_of_the_old_streams_nonce_is_absorbed_and_counted_as_held() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &[]));
    s.on_agent(resp(CDS, "old", &[("a", "1")], &[]));
    s.upstream_down();
    s.upstream_up();
    let out = s.on_envoy(ack(CDS, "old"));
    assert!(
        out.is_empty(),
        "the new stream never sent that nonce: {out:?}"
    );
    assert_eq!(s.held(CDS)["a"], "1");
    assert_eq!(s.counts.absorbed, 1);
    // A NACK of an old nonce: absorbed, and nothing counted as held.
    s.on_agent(resp(CDS, "n2", &[("b", "1")], &[]));
    s.upstream_down();
    s.upstream_up();
    assert!(s.on_envoy(nack(CDS, "n2")).is_empty());
    assert!(!s.held(CDS).contains_key("b"));
    assert_eq!(s.counts.nacks, 1);
}

#[test]
fn a_subscription_made_during_the_switch_is_restated() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &["*"]));
    s.upstream_down();
    assert!(
        s.on_envoy(req(CDS, &["on-demand"])).is_empty(),
        "nothing sent while down"
    );
    assert!(s.on_envoy(req(SDS, &["svid|new"])).is_empty());
    let out = s.upstream_up();
    let r = upstream(&out);
    assert_eq!(r[0].resource_names_subscribe, ["*", "on-demand"]);
    assert_eq!(r[1].type_url, SDS);
    assert_eq!(r[1].resource_names_subscribe, ["svid|new"]);
}

#[test]
fn a_subscription_riding_on_an_absorbed_ack_is_passed_on_without_the_nonce() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &["*"]));
    s.on_agent(resp(CDS, "old", &[("a", "1")], &[]));
    s.upstream_down();
    s.upstream_up();
    let mut both = ack(CDS, "old").view;
    both.resource_names_subscribe = vec!["x".into()];
    let out = s.on_envoy(Framed::of(both));
    let r = upstream(&out);
    assert_eq!(r.len(), 1);
    assert!(r[0].response_nonce.is_empty());
    assert_eq!(r[0].resource_names_subscribe, ["x"]);
}

#[test]
fn an_unchanged_type_forwards_nothing_to_envoy_and_the_relay_acks_it() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &[]));
    let out = s.on_agent(resp(CDS, "empty", &[], &[]));
    let r = upstream(&out);
    assert_eq!(
        (r[0].response_nonce.as_str(), r[0].type_url.as_str()),
        ("empty", CDS)
    );
    assert_eq!(s.counts.self_acked, 1);
}

#[test]
fn a_removal_envoy_acked_is_no_longer_held() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(EDS, &["a", "b"]));
    s.on_agent(resp(EDS, "1", &[("a", "1"), ("b", "1")], &[]));
    s.on_envoy(ack(EDS, "1"));
    s.on_agent(resp(EDS, "2", &[], &["a"]));
    s.on_envoy(ack(EDS, "2"));
    assert_eq!(s.held(EDS).keys().collect::<Vec<_>>(), ["b"]);
}

#[test]
fn envoys_replies_to_two_answers_under_one_nonce_are_told_apart_by_their_order() {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &[]));
    s.on_agent(resp(CDS, "1", &[("a", "1")], &[]));
    s.on_envoy(ack(CDS, "1"));
    s.on_agent(resp(CDS, "2", &[("a", "2")], &[]));
    s.upstream_down();
    s.upstream_up();
    // The new owner's nonce "2" before Envoy's ACK of the old "2".
    s.on_agent(resp(CDS, "2", &[("a", "3")], &[]));
    // The old answer's ACK first, absorbed; then the new one's, passed on.
    assert!(s.on_envoy(ack(CDS, "2")).is_empty());
    assert_eq!(s.held(CDS)["a"], "2");
    assert_eq!(upstream(&s.on_envoy(ack(CDS, "2"))).len(), 1);
    assert_eq!(s.held(CDS)["a"], "3");
}

#[test]
fn envoy_reconnecting_to_a_restarted_relay_keeps_what_it_says_it_holds() {
    let mut s = Session::default();
    let mut first = req(CDS, &[]).view;
    first.initial_resource_versions = HashMap::from([("a".into(), "4".into())]);
    assert!(
        s.on_envoy(Framed::of(first)).is_empty(),
        "no agent stream yet"
    );
    let out = s.upstream_up();
    assert_eq!(upstream(&out)[0].initial_resource_versions["a"], "4");
    assert_eq!(s.counts.resumes, 0, "the first stream is not a resume");
}

/// A session whose Envoy holds `a`, `b` of CDS and `c1` of EDS, on a first stream.
fn holding() -> Session {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &[]));
    s.on_envoy(req(EDS, &["c1"]));
    s.on_agent(resp(CDS, "1", &[("a", "1"), ("b", "1")], &[]));
    s.on_agent(resp(EDS, "2", &[("c1", "1")], &[]));
    s.on_envoy(ack(CDS, "1"));
    s.on_envoy(ack(EDS, "2"));
    s.upstream_down();
    s
}

#[test]
fn a_type_the_agent_matched_by_digest_is_restated_without_its_versions() {
    let mut s = holding();
    let offer = s.offer();
    let none = Buckets::default();
    let want = resume::offer(
        [
            (CDS, Digest::of([("a", "1"), ("b", "1")]), &none),
            (EDS, Digest::of([("c1", "1")]), &none),
        ],
        resume::BUCKETS_FROM,
    );
    assert_eq!(offer, want, "each type's digest of what Envoy holds");
    let out = s.upstream_up_matched(Some(CDS));
    let r = upstream(&out);
    assert!(
        r[0].initial_resource_versions.is_empty(),
        "CDS: by its digest"
    );
    assert_eq!(r[1].initial_resource_versions.len(), 1, "EDS: not matched");
    assert_eq!(
        r[1].resource_names_subscribe,
        ["c1"],
        "subscriptions as ever"
    );
    assert_eq!(
        (
            s.counts.digest_resumes,
            s.counts.digest_types,
            s.counts.version_types
        ),
        (1, 1, 1)
    );
}

#[test]
fn a_subscription_whose_names_the_agent_matched_is_restated_as_the_one_name_relied_on() {
    let mut s = holding();
    let offer = s.offer_from(1);
    let entry = resume::names_entry(EDS, resume::names_digest(["c1"]));
    assert!(offer.split(',').any(|e| e == entry), "{offer}");
    assert!(
        !s.offer().contains(resume::NAMES_SUFFIX),
        "one name: below the threshold, listed"
    );
    s.offer_from(1);
    let answer = format!("{EDS}{}", resume::NAMES_SUFFIX);
    let out = s.upstream_up_matched(Some(&answer));
    let r = upstream(&out);
    assert_eq!(r[1].resource_names_subscribe, [resume::RELIED]);
    assert_eq!(
        r[0].resource_names_subscribe,
        Vec::<String>::new(),
        "CDS as ever"
    );
    assert_eq!(s.counts.names_types, 1);

    // Envoy names another cluster while the next stream opens: the names moved since the
    // offer, so they are listed, whatever the agent matched.
    s.upstream_down();
    s.offer_from(1);
    s.on_envoy(req(EDS, &["c2"]));
    let out = s.upstream_up_matched(Some(&answer));
    assert_eq!(upstream(&out)[1].resource_names_subscribe, ["c1", "c2"]);
    assert_eq!(s.counts.names_types, 1);
}

#[test]
fn a_type_matched_in_buckets_lists_only_the_versions_of_the_buckets_not_relied_on() {
    let (ba, bb) = (resume::bucket("a"), resume::bucket("b"));
    assert_ne!(ba, bb, "a and b in buckets of their own");
    let mut s = holding();
    assert!(
        !s.offer().contains(resume::BUCKETS_SUFFIX),
        "two resources: whole only"
    );
    let offer = s.offer_from(0);
    assert!(offer.contains(&format!("{CDS}{}=", resume::BUCKETS_SUFFIX)));
    // The agent matched every CDS bucket but a's: a's version goes, with the buckets
    // relied on; EDS was not matched, its versions go.
    let all_but_a = !(1u64 << ba);
    let answer = format!("{CDS}{}={all_but_a:x}", resume::BUCKETS_SUFFIX);
    let out = s.upstream_up_matched(Some(&answer));
    let r = upstream(&out);
    let want: HashMap<String, String> = [
        ("a".to_string(), "1".to_string()),
        (resume::RELIED.to_string(), format!("{all_but_a:x}")),
    ]
    .into();
    assert_eq!(r[0].initial_resource_versions, want);
    assert_eq!(r[1].initial_resource_versions.len(), 1, "EDS: not matched");
    assert_eq!(
        (
            s.counts.digest_types,
            s.counts.bucket_types,
            s.counts.version_types
        ),
        (0, 1, 1)
    );
    // b's bucket moved after the offer (an ACK folded in): not relied on, b listed.
    let mut s = holding();
    s.on_envoy(req(CDS, &[]));
    s.upstream_up();
    s.on_agent(resp(CDS, "9", &[("b", "2")], &[]));
    s.upstream_down();
    s.offer_from(0);
    s.on_envoy(ack(CDS, "9"));
    let out = s.upstream_up_matched(Some(&answer));
    let versions = &upstream(&out)[0].initial_resource_versions;
    let relied = all_but_a & !(1u64 << bb);
    assert_eq!(versions.get("b").map(String::as_str), Some("2"));
    assert_eq!(versions.get("a").map(String::as_str), Some("1"));
    assert_eq!(versions.get(resume::RELIED), Some(&format!("{relied:x}")));
}

#[test]
fn a_digest_mismatch_or_an_agent_without_the_feature_gets_the_plain_resume() {
    let plain = {
        let mut s = holding();
        let out = s.upstream_up();
        upstream(&out).into_iter().cloned().collect::<Vec<_>>()
    };
    // The agent matched nothing: every type as on the plain path.
    let mut s = holding();
    s.offer();
    assert_eq!(
        upstream(&s.upstream_up_matched(Some("")))
            .into_iter()
            .cloned()
            .collect::<Vec<_>>(),
        plain
    );
    assert_eq!(s.counts.digest_resumes, 1, "the agent answered the offer");
    // An agent that did not answer (an older owner): the plain resume.
    let mut s = holding();
    s.offer();
    let got: Vec<_> = upstream(&s.upstream_up_matched(None))
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(got, plain);
    assert_eq!((s.counts.resumes, s.counts.digest_resumes), (1, 0));
    // What Envoy holds moved after the offer (an ACK folded in while the stream
    // opened): the matched digest is stale, so the versions go.
    let mut s = holding();
    s.on_envoy(req(CDS, &[]));
    s.upstream_up();
    s.on_agent(resp(CDS, "9", &[("z", "1")], &[]));
    s.upstream_down();
    s.offer();
    s.on_envoy(ack(CDS, "9"));
    let out = s.upstream_up_matched(Some(CDS));
    assert_eq!(upstream(&out)[0].initial_resource_versions.len(), 3);
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

/// A model of a delta xDS server: a snapshot (name → version per type) and, per stream,
/// what it believes the client holds. It sends the differences between the two for the
/// names the client subscribes to (every name for a wildcard).
/// Per type: wildcard, the names subscribed, what the client holds.
type Client = (bool, BTreeSet<String>, BTreeMap<String, String>);

#[derive(Default)]
struct Agent {
    snapshot: BTreeMap<String, BTreeMap<String, String>>,
    client: BTreeMap<String, Client>,
    nonce: u64,
    /// Types the relay's digest offer matched: the client holds the snapshot's as of the
    /// match (the snapshot may move on before the type's first request), whole (None) or
    /// in the buckets of the bitmap.
    resumed: BTreeMap<String, (BTreeMap<String, String>, Option<u64>)>,
    /// Types whose names the offer matched: the snapshot's names as of the match, which
    /// a first request naming `RELIED` subscribes to.
    names: BTreeMap<String, BTreeSet<String>>,
}

impl Agent {
    /// The next owner: the snapshot as it is, nonces from 1 again (as the agent counts
    /// them per stream), no memory of the client.
    fn successor(self) -> Agent {
        Agent {
            snapshot: self.snapshot,
            ..Agent::default()
        }
    }

    fn handle(&mut self, r: &DeltaRequest) -> Vec<Framed<DeltaResponse>> {
        if !r.response_nonce.is_empty() && r.resource_names_subscribe.is_empty() {
            return Vec::new();
        }
        let fresh = !self.client.contains_key(&r.type_url);
        let c = self.client.entry(r.type_url.clone()).or_default();
        if fresh {
            c.0 = r.resource_names_subscribe.is_empty();
            c.2 = r
                .initial_resource_versions
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            match self.resumed.remove(&r.type_url) {
                Some((held, None)) if r.initial_resource_versions.is_empty() => c.2 = held,
                Some((held, Some(matched))) => {
                    // The buckets the relay relies on: the snapshot's, as of the answer;
                    // the rest as listed.
                    if let Some(relied) = resume::relied(&r.initial_resource_versions) {
                        c.2.remove(resume::RELIED);
                        let relied = relied & matched;
                        c.2.extend(
                            held.into_iter()
                                .filter(|(n, _)| resume::in_bitmap(relied, n)),
                        );
                    }
                }
                _ => {}
            }
        }
        let relied_names = self.names.remove(&r.type_url);
        for n in &r.resource_names_subscribe {
            if n == "*" {
                c.0 = true;
            } else if n == resume::RELIED && fresh {
                c.1.extend(
                    relied_names
                        .clone()
                        .expect("RELIED only after a names match"),
                );
            } else {
                c.1.insert(n.clone());
            }
        }
        for n in &r.resource_names_unsubscribe {
            c.1.remove(n);
            c.2.remove(n);
        }
        let url = r.type_url.clone();
        self.diff(&url).into_iter().collect()
    }

    /// Its answer to a digest offer: the types whose digest equals its snapshot's, and
    /// of the others offered in buckets, the buckets that do.
    fn answer_offer(&mut self, offer: &str) -> String {
        let mut matched = Vec::new();
        let offered = resume::parse_offer(offer);
        let pairs = |snap: &BTreeMap<String, String>| -> Vec<(String, String)> {
            snap.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
        };
        for (url, digest) in &offered {
            let snap = self.snapshot.get(*url).cloned().unwrap_or_default();
            let p = pairs(&snap);
            let ours = Digest::of(p.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            if ours.encode() == *digest {
                matched.push(url.to_string());
                self.resumed.insert(url.to_string(), (snap, None));
            }
        }
        for (entry, encoded) in &offered {
            let Some(url) = entry.strip_suffix(resume::BUCKETS_SUFFIX) else {
                continue;
            };
            if self.resumed.contains_key(url) {
                continue;
            }
            let snap = self.snapshot.get(url).cloned().unwrap_or_default();
            let p = pairs(&snap);
            let m = Buckets::of(p.iter().map(|(n, v)| (n.as_str(), v.as_str()))).matched(encoded);
            if m != 0 {
                matched.push(format!("{entry}={m:x}"));
                self.resumed.insert(url.to_string(), (snap, Some(m)));
            }
        }
        // The names: those of the snapshot's type.
        for (entry, encoded) in &offered {
            let Some(url) = entry.strip_suffix(resume::NAMES_SUFFIX) else {
                continue;
            };
            let names: BTreeSet<String> = self
                .snapshot
                .get(url)
                .map(|s| s.keys().cloned().collect())
                .unwrap_or_default();
            if resume::names_digest(names.iter().map(String::as_str)).encode() == *encoded {
                matched.push(entry.to_string());
                self.names.insert(url.to_string(), names);
            }
        }
        matched.join(",")
    }

    fn diff(&mut self, url: &str) -> Option<Framed<DeltaResponse>> {
        let snap = self.snapshot.get(url).cloned().unwrap_or_default();
        let c = self.client.get_mut(url)?;
        let wanted = |n: &String| c.0 || c.1.contains(n);
        let mut res = Vec::new();
        for (n, v) in &snap {
            if wanted(n) && c.2.get(n) != Some(v) {
                res.push(Resource {
                    name: n.clone(),
                    version: v.clone(),
                });
            }
        }
        let removed: Vec<String> =
            c.2.keys()
                .filter(|n| !snap.contains_key(*n) && wanted(n))
                .cloned()
                .collect();
        if res.is_empty() && removed.is_empty() {
            return None;
        }
        for r in &res {
            c.2.insert(r.name.clone(), r.version.clone());
        }
        for n in &removed {
            c.2.remove(n);
        }
        self.nonce += 1;
        Some(Framed::of(DeltaResponse {
            type_url: url.into(),
            nonce: format!("n{}", self.nonce),
            resources: res,
            removed_resources: removed,
        }))
    }
}

/// Moves a model agent's snapshot on: each name of each type removed, or given a new
/// version (counted in `version`), each with odds of 1 in `odds`.
fn move_on(
    agent: &mut Agent,
    rng: &mut Rng,
    version: &mut u64,
    urls: &[&str],
    names: &[&str],
    odds: u64,
) {
    for u in urls {
        let snap = agent.snapshot.entry((*u).into()).or_default();
        for n in names {
            match rng.next(odds) {
                0 => {
                    snap.remove(*n);
                }
                1 => {
                    *version += 1;
                    snap.insert((*n).into(), format!("v{version}"));
                }
                _ => {}
            }
        }
    }
}

/// Envoy, as far as holding resources goes: applies each answer and ACKs it (or, now
/// and then, NACKs it and keeps what it had); the ACK may be delayed.
#[derive(Default)]
struct Envoy {
    held: BTreeMap<String, BTreeMap<String, String>>,
    unanswered: Vec<(Framed<DeltaResponse>, bool)>,
}

impl Envoy {
    /// Takes an answer's resources and removals.
    fn apply(&mut self, answer: &DeltaResponse) {
        let t = self.held.entry(answer.type_url.clone()).or_default();
        for n in &answer.removed_resources {
            t.remove(n);
        }
        for r in &answer.resources {
            t.insert(r.name.clone(), r.version.clone());
        }
    }
}

/// Envoy's ACK (or NACK) of `answer`.
fn reply(answer: &DeltaResponse, ok: bool) -> Framed<DeltaRequest> {
    if ok {
        ack(&answer.type_url, &answer.nonce)
    } else {
        nack(&answer.type_url, &answer.nonce)
    }
}

#[test]
fn any_sequence_of_switches_leaves_envoy_holding_the_last_agents_snapshot() {
    let urls = [CDS, EDS, SDS];
    let names = ["a", "b", "c", "d"];
    let mut digest_types = 0;
    let mut bucket_types = 0;
    let mut names_types = 0;
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut s = Session::default();
        let mut envoy = Envoy::default();
        let mut agent = Agent::default();
        let mut version = 0u64;
        let mut shuffle =
            |agent: &mut Agent, rng: &mut Rng| move_on(agent, rng, &mut version, &urls, &names, 4);
        shuffle(&mut agent, &mut rng);
        let mut to_agent: Vec<DeltaRequest> = Vec::new();
        let mut to_envoy: Vec<Framed<DeltaResponse>> = Vec::new();
        let route =
            |out: Vec<Send>, a: &mut Vec<DeltaRequest>, e: &mut Vec<Framed<DeltaResponse>>| {
                for o in out {
                    match o {
                        Send::Upstream(r) => a.push(r.view),
                        Send::Envoy(r) => e.push(r),
                        Send::Next(_) => panic!("no overlap here"),
                    }
                }
            };
        route(s.upstream_up(), &mut to_agent, &mut to_envoy);
        for u in urls {
            // EDS by name, every name: re-stated by the names' digest when the
            // snapshot has them all.
            let sub: &[&str] = match u {
                CDS => &[],
                EDS => &names,
                _ => &["*"],
            };
            route(s.on_envoy(req(u, sub)), &mut to_agent, &mut to_envoy);
        }
        for _ in 0..60 {
            // Deliver what is in flight, in order, with ACKs now or later.
            for r in std::mem::take(&mut to_agent) {
                for answer in agent.handle(&r) {
                    route(s.on_agent(answer), &mut to_agent, &mut to_envoy);
                }
            }
            for answer in std::mem::take(&mut to_envoy) {
                let ok = rng.next(10) != 0;
                if ok {
                    envoy.apply(&answer.view);
                }
                envoy.unanswered.push((answer, ok));
            }
            if rng.next(2) == 0 {
                for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
                    route(
                        s.on_envoy(reply(&answer.view, ok)),
                        &mut to_agent,
                        &mut to_envoy,
                    );
                }
            }
            match rng.next(5) {
                0 => {
                    // A switch: a new agent with the snapshot moved on, and no memory of
                    // this client.
                    s.upstream_down();
                    to_agent.clear();
                    agent = agent.successor();
                    // Offered in buckets too, or whole only (the real threshold).
                    let offer = if rng.next(2) == 0 {
                        s.offer_from(0)
                    } else {
                        s.offer()
                    };
                    if rng.next(2) == 0 {
                        shuffle(&mut agent, &mut rng);
                    }
                    if rng.next(3) == 0 {
                        // Envoy's replies to earlier answers fold in while the stream
                        // opens: what it holds moves after the offer.
                        for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
                            let sent = s.on_envoy(reply(&answer.view, ok));
                            assert!(upstream(&sent).is_empty(), "nothing goes up while down");
                        }
                    }
                    // Mid-roll skew: an agent with the digest resume, or without.
                    let matched = (rng.next(3) != 0).then(|| agent.answer_offer(&offer));
                    let entries = |m: &String, names: bool| {
                        m.split(',')
                            .filter(|t| !t.is_empty() && t.ends_with(resume::NAMES_SUFFIX) == names)
                            .count()
                    };
                    digest_types += matched.as_ref().map_or(0, |m| entries(m, false));
                    names_types += matched.as_ref().map_or(0, |m| entries(m, true));
                    bucket_types += matched
                        .as_ref()
                        .map_or(0, |m| resume::parse_matched_buckets(m).len());
                    route(
                        s.upstream_up_matched(matched.as_deref()),
                        &mut to_agent,
                        &mut to_envoy,
                    );
                }
                1 => {
                    shuffle(&mut agent, &mut rng);
                    for u in urls {
                        if let Some(a) = agent.diff(u) {
                            route(s.on_agent(a), &mut to_agent, &mut to_envoy);
                        }
                    }
                }
                _ => {}
            }
        }
        // Settle: the NACKed answers are re-sent by a last switch (as Envoy's own retry
        // would ask), every answer delivered and ACKed.
        s.upstream_down();
        agent = agent.successor();
        for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
            route(
                s.on_envoy(reply(&answer.view, ok)),
                &mut to_agent,
                &mut to_envoy,
            );
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
                envoy.apply(&answer.view);
                route(
                    s.on_envoy(reply(&answer.view, true)),
                    &mut to_agent,
                    &mut to_envoy,
                );
            }
        }
        for u in urls {
            let want = agent.snapshot.get(u).cloned().unwrap_or_default();
            let got = envoy.held.get(u).cloned().unwrap_or_default();
            assert_eq!(
                got, want,
                "seed {seed}, {u}: Envoy holds the last agent's snapshot"
            );
            assert_eq!(s.held(u), want, "seed {seed}, {u}: the session knows it");
        }
    }
    assert!(
        digest_types > 100,
        "types resumed by digest: {digest_types}"
    );
    assert!(
        bucket_types > 20,
        "types resumed in buckets: {bucket_types}"
    );
    assert!(names_types > 20, "types resumed by names: {names_types}");
}

/// A session on its first agent stream holding CDS `a` at 1 (wildcard) and subscribed to
/// EDS `x`, every answer ACKed.
fn carrying() -> Session {
    let mut s = Session::default();
    s.upstream_up();
    s.on_envoy(req(CDS, &[]));
    s.on_envoy(req(EDS, &["x"]));
    s.on_agent(resp(CDS, "1", &[("a", "1")], &[]));
    assert!(!s.quiet(), "an answer is unanswered");
    s.on_envoy(ack(CDS, "1"));
    assert!(s.quiet());
    s
}

#[test]
fn the_next_stream_is_restated_while_the_current_one_carries_and_takes_later_subscriptions() {
    let mut s = carrying();
    s.offer();
    let out = s.restate_next(None);
    assert!(
        to_current(&out).is_empty(),
        "nothing to the current stream: {out:?}"
    );
    let next = to_next(&out);
    assert_eq!(
        next.iter().map(|r| r.type_url.as_str()).collect::<Vec<_>>(),
        [CDS, EDS],
        "every type, in ADS order"
    );
    assert_eq!(
        next[0].initial_resource_versions,
        HashMap::from([("a".to_string(), "1".to_string())])
    );
    assert_eq!(next[1].resource_names_subscribe, ["x"]);
    assert!(s.next_holds());

    // Envoy's requests still go to the current stream; a subscription change goes to the
    // next one too, without the nonce.
    let out = s.on_envoy(req(EDS, &["y"]));
    assert_eq!(to_current(&out)[0].resource_names_subscribe, ["y"]);
    let next = to_next(&out);
    assert_eq!(next.len(), 1);
    assert_eq!(next[0].resource_names_subscribe, ["y"]);
    assert!(next[0].response_nonce.is_empty());
    let out = s.on_envoy(ack(EDS, "2"));
    assert!(
        to_next(&out).is_empty(),
        "an ACK is the current stream's alone"
    );
    assert!(
        s.next_holds(),
        "nothing went to Envoy since the re-statement"
    );

    // An answer of the current stream forwarded after the re-statement makes it stale.
    let out = s.on_agent(resp(EDS, "3", &[("y", "1")], &[]));
    assert!(
        matches!(out[..], [Send::Envoy(_)]),
        "still forwarded: {out:?}"
    );
    assert!(!s.next_holds());
    assert_eq!(s.counts.resumes, 1);
    s.abandon_next();
    assert_eq!(
        (s.counts.resumes, s.counts.version_types),
        (0, 0),
        "a dropped re-statement is not counted"
    );
    // An empty answer goes nowhere near Envoy, and would not have.
    s.on_envoy(ack(EDS, "3"));
    s.offer();
    s.restate_next(None);
    s.on_agent(resp(CDS, "4", &[], &[]));
    assert!(
        s.next_holds(),
        "an answer the relay ACKs itself changes nothing Envoy holds"
    );
}

#[test]
fn a_type_first_asked_for_after_the_restatement_makes_it_stale() {
    let mut s = carrying();
    s.offer();
    s.restate_next(None);
    s.on_envoy(req(SDS, &["cert"]));
    assert!(!s.next_holds(), "the re-statement lacks the type");
}

#[test]
fn after_an_overlap_switch_the_old_streams_nonces_are_earlier_and_the_next_ones_pass() {
    let mut s = carrying();
    // An answer forwarded before the re-statement, answered only after the switch (the
    // driver waits for quiet; the rule holds either way).
    s.on_agent(resp(CDS, "7", &[("b", "1")], &[]));
    s.offer();
    s.restate_next(None);
    s.switch_next();
    assert_eq!(s.counts.resumes, 1);
    let out = s.on_envoy(ack(CDS, "7"));
    assert!(out.is_empty(), "absorbed: {out:?}");
    assert_eq!(s.counts.absorbed, 1);
    assert_eq!(s.held(CDS).get("b").map(String::as_str), Some("1"));
    // The new stream's answers pass both ways.
    let out = s.on_agent(resp(CDS, "1", &[("c", "1")], &[]));
    assert!(matches!(out[..], [Send::Envoy(_)]));
    let out = s.on_envoy(ack(CDS, "1"));
    assert_eq!(upstream(&out)[0].response_nonce, "1");
    assert!(!s.next_holds(), "no next stream any more");
}

#[test]
fn a_stream_end_in_the_overlap_drops_the_next_stream() {
    let mut s = carrying();
    s.offer();
    s.restate_next(None);
    s.upstream_down();
    assert!(!s.next_holds());
    let out = s.on_envoy(req(EDS, &["z"]));
    assert!(out.is_empty(), "folded in while down: {out:?}");
}

/// What is in flight in the overlap's property test: requests to the current and to the
/// next agent, answers to Envoy.
#[derive(Default)]
struct InFlight {
    current: Vec<DeltaRequest>,
    next: Vec<DeltaRequest>,
    envoy: Vec<Framed<DeltaResponse>>,
}

impl InFlight {
    fn route(&mut self, out: Vec<Send>) {
        for o in out {
            match o {
                Send::Upstream(r) => self.current.push(r.view),
                Send::Next(r) => self.next.push(r.view),
                Send::Envoy(r) => self.envoy.push(r),
            }
        }
    }

    /// Envoy applies what it was sent and will ACK it (never a NACK here: a NACKed
    /// answer is re-sent only by a re-statement, which the plain property test covers).
    fn deliver(&mut self, envoy: &mut Envoy) {
        for answer in std::mem::take(&mut self.envoy) {
            envoy.apply(&answer.view);
            envoy.unanswered.push((answer, true));
        }
    }

    /// Envoy's ACKs reach the session.
    fn acks(&mut self, s: &mut Session, envoy: &mut Envoy) {
        for (answer, ok) in std::mem::take(&mut envoy.unanswered) {
            self.route(s.on_envoy(reply(&answer.view, ok)));
        }
    }

    /// The current agent answers the requests it was sent.
    fn answers(&mut self, s: &mut Session, agent: &mut Agent) {
        for r in std::mem::take(&mut self.current) {
            for a in agent.handle(&r) {
                self.route(s.on_agent(a));
            }
        }
    }

    /// The current agent sends what its snapshot's move changed.
    fn changes(&mut self, s: &mut Session, agent: &mut Agent, urls: &[&str]) {
        for u in urls {
            if let Some(a) = agent.diff(u) {
                self.route(s.on_agent(a));
            }
        }
    }
}

/// The overlap, as a property: an old agent carrying changes while the next one is
/// re-stated and its answers held back, switches when the re-statement holds and fresh
/// re-statements when the old one carried after it, Envoy's ACKs at any point: once all
/// is delivered and ACKed, Envoy holds exactly the last agent's snapshot, with no
/// re-statement to settle it, and the session knows it.
#[test]
fn any_sequence_of_overlapping_switches_leaves_envoy_holding_the_last_agents_snapshot() {
    let urls = [CDS, EDS, SDS];
    let names = ["a", "b", "c", "d"];
    let (mut switched, mut restarted) = (0, 0);
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut version = 0u64;
        let mut shuffle =
            |agent: &mut Agent, rng: &mut Rng| move_on(agent, rng, &mut version, &urls, &names, 5);
        let mut s = Session::default();
        let mut envoy = Envoy::default();
        let mut old = Agent::default();
        shuffle(&mut old, &mut rng);
        let mut w = InFlight::default();
        w.route(s.upstream_up());
        for u in urls {
            let sub: &[&str] = match u {
                EDS => &names[..2],
                SDS => &["*"],
                _ => &[],
            };
            w.route(s.on_envoy(req(u, sub)));
        }
        for _round in 0..4 {
            // Steady traffic on the current agent.
            for _ in 0..rng.next(6) {
                w.answers(&mut s, &mut old);
                w.deliver(&mut envoy);
                if rng.next(2) == 0 {
                    w.acks(&mut s, &mut envoy);
                }
                if rng.next(3) == 0 {
                    shuffle(&mut old, &mut rng);
                    w.changes(&mut s, &mut old, &urls);
                }
            }
            // The handover: the next agent starts from the old one's snapshot and moves
            // on its own (a roll's churn reaches only the new owner).
            let mut next = Agent {
                snapshot: old.snapshot.clone(),
                ..Agent::default()
            };
            if rng.next(2) == 0 {
                shuffle(&mut next, &mut rng);
            }
            let mut restated = false;
            let mut held_back: Vec<Framed<DeltaResponse>> = Vec::new();
            loop {
                match rng.next(6) {
                    // The old agent carries a change, answered to Envoy at once.
                    0 => {
                        shuffle(&mut old, &mut rng);
                        w.changes(&mut s, &mut old, &urls);
                        w.deliver(&mut envoy);
                    }
                    // Envoy's replies come in.
                    1 | 2 => {
                        w.acks(&mut s, &mut envoy);
                        w.answers(&mut s, &mut old);
                        w.deliver(&mut envoy);
                    }
                    // The next agent's own change, held back until the switch.
                    3 if restated => {
                        shuffle(&mut next, &mut rng);
                        for u in urls {
                            held_back.extend(next.diff(u));
                        }
                    }
                    // The re-statement, once quiet; then the next agent's answer to the
                    // relay's request: a switch if it holds, else a fresh stream.
                    _ => {
                        if !restated {
                            if !s.quiet() {
                                continue;
                            }
                            let offer = s.offer();
                            let matched = (rng.next(3) != 0).then(|| next.answer_offer(&offer));
                            w.route(s.restate_next(matched.as_deref()));
                            restated = true;
                        }
                        for r in std::mem::take(&mut w.next) {
                            held_back.extend(next.handle(&r));
                        }
                        if rng.next(2) == 0 {
                            continue;
                        }
                        if s.next_holds() {
                            s.switch_next();
                            switched += 1;
                            for a in std::mem::take(&mut held_back) {
                                w.route(s.on_agent(a));
                            }
                            w.deliver(&mut envoy);
                            break;
                        }
                        restarted += 1;
                        s.abandon_next();
                        next = next.successor();
                        held_back.clear();
                        w.next.clear();
                        restated = false;
                    }
                }
            }
            old = next;
            w.current.clear();
        }
        // Settle without a re-statement: every answer delivered and ACKed, the last
        // agent's changes with them.
        shuffle(&mut old, &mut rng);
        w.changes(&mut s, &mut old, &urls);
        w.deliver(&mut envoy);
        while !envoy.unanswered.is_empty() || !w.current.is_empty() {
            w.acks(&mut s, &mut envoy);
            w.answers(&mut s, &mut old);
            w.deliver(&mut envoy);
        }
        for u in urls {
            let c = old.client.get(u).cloned().unwrap_or_default();
            let want: BTreeMap<String, String> = old
                .snapshot
                .get(u)
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter(|(n, _)| c.0 || c.1.contains(n))
                .collect();
            let got = envoy.held.get(u).cloned().unwrap_or_default();
            assert_eq!(
                got, want,
                "seed {seed}, {u}: Envoy holds the last agent's snapshot"
            );
            assert_eq!(s.held(u), want, "seed {seed}, {u}: the session knows it");
        }
    }
    assert!(switched > 600, "overlap switches: {switched}");
    assert!(restarted > 50, "fresh re-statements: {restarted}");
}
