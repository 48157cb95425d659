//! What a new owner's worker spends on a proxy's reconnect over delta ADS at mesh scale,
//! in one thread and without the transport: the proxy reports every resource version it
//! holds (`initial_resource_versions`), and the worker decodes each first request (as
//! its server does: into the lean wire type, then the protocol's request),
//! applies it, works out its answer, takes the proxy's ACK of it (asking after each
//! request, as its server does, whether the proxy now holds the snapshot: the CNI ADDs
//! wait on that) and frees the request. After a takeover the versions
//! match the worker's snapshot, so every answer is empty; this is the agent's share of
//! the served gap (README, "Mesh scale").
//!
//!   cargo bench -p aether-e2e --bench resume
//!   AETHER_BENCH_SERVICES=1000 AETHER_BENCH_ROUNDS=50 cargo bench -p aether-e2e --bench resume
//!   AETHER_BENCH_OBSERVED=20 cargo bench -p aether-e2e --bench resume
//!
//! With `AETHER_BENCH_OBSERVED=N` the worker serves on-demand clusters
//! (`--on-demand-clusters`) with the first N services' clusters observed: the proxy holds
//! and asks for those alone, as it does in that mode.
//!
//! Prints the median and p99 over the rounds of each step, per type, and the total, for
//! each kind of resume: `plain` (every version listed, as Envoy or a relay talking to an
//! owner without the digest resume does), and `digest` (the xDS relay's digest resume,
//! `shared_proto::resume`: the first requests carry no versions, and the worker answers
//! the relay's offer, the "offer" step, from its snapshot's digests, carried from the
//! last snapshot: `warm`, or computed from every resource: `cold`, a first snapshot), and
//! `buckets`: the proxy holds three services' clusters and load assignments at older
//! versions (pods came and went during the roll), so those two types miss their whole
//! digest and go by their bucket digests, the versions of the buckets that differ listed.
//! In the digest modes the relay also offers the EDS names by their digest, and the first
//! EDS request re-states the subscription as the one name relied on (`resume::RELIED`);
//! `buckets, warm` takes the snapshot's names by bucket (`Digests::index`, built off the
//! runtime thread before the roll); `buckets, cold` answers the offer from a first
//! snapshot's digests, as a respawned or recreated worker does, and takes the names by
//! bucket the digests' walk indexed, if any; `buckets, cold, a pod since` is that owner
//! once a pod has come since its first snapshot of the mesh, before the heavy-work thread
//! indexed the next: the offer's digests and the names by bucket are carried from the
//! snapshot before (`Digests::by_bucket`).

use std::sync::Arc;
use std::time::Instant;

use aether_e2e::testing::mesh_service;
use aether_model::{Builder, Change, Inputs, RegistryView, Snapshot, is_outbound_cluster};
use aether_worker::writers::Observed;
use aether_worker::xds::delta::DeltaState;
use aether_worker::xds::digest::{Digests, Resumed};
use aether_worker::xds::encoded::Encoded;
use aether_worker::xds::kind::{KINDS, Kind, type_url, wire_version};
use aether_worker::xds::protocol::Protocol;
use aether_worker::xds::wire::DeltaRequestWire;
use prost::Message;
use shared_proto::resume::{self, Buckets, Digest};

/// The request type the delta protocol applies.
type Request = <DeltaState as Protocol>::Request;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The proxy's first request of `kind` on a new stream, holding all of `s` that it
/// `holds` at the versions `version` gives, encoded; the versions listed are those of
/// the names `listed` (none: `relied` is the bucket resume's bitmap, else 0).
fn resume_request(
    s: &Snapshot,
    kind: Kind,
    holds: impl Fn(Kind, &str) -> bool,
    version: impl Fn(Kind, &str, u64) -> String,
    listed: impl Fn(&str) -> bool,
    relied: u64,
    names_relied: bool,
) -> Vec<u8> {
    let versions: std::collections::BTreeMap<&String, &u64> = s
        .hashes(kind)
        .iter()
        .filter(|(n, _)| holds(kind, n))
        .collect();
    let named = matches!(kind, Kind::Endpoint | Kind::Route | Kind::Secret);
    let mut initial: std::collections::HashMap<String, String> = versions
        .iter()
        .filter(|(n, _)| listed(n))
        .map(|(n, h)| ((*n).clone(), version(kind, n, **h)))
        .collect();
    if relied != 0 {
        initial.insert(resume::RELIED.into(), format!("{relied:x}"));
    }
    DeltaRequestWire {
        type_url: type_url(kind).into(),
        resource_names_subscribe: if named && names_relied {
            vec![resume::RELIED.into()]
        } else if named {
            versions.keys().map(|n| (*n).clone()).collect()
        } else {
            Vec::new()
        },
        initial_resource_versions: initial,
        ..Default::default()
    }
    .encode_to_vec()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    DigestWarm,
    DigestCold,
    Buckets,
    BucketsCold,
    BucketsLagging,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Plain => "plain",
            Mode::DigestWarm => "digest, warm",
            Mode::DigestCold => "digest, cold",
            Mode::Buckets => "buckets, warm",
            Mode::BucketsCold => "buckets, cold",
            Mode::BucketsLagging => "buckets, cold, a pod since",
        }
    }

    fn buckets(self) -> bool {
        matches!(
            self,
            Mode::Buckets | Mode::BucketsCold | Mode::BucketsLagging
        )
    }

    fn cold(self) -> bool {
        matches!(
            self,
            Mode::DigestCold | Mode::BucketsCold | Mode::BucketsLagging
        )
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let (services, rounds) = (
        env("AETHER_BENCH_SERVICES", 10_000),
        env("AETHER_BENCH_ROUNDS", 40).max(1),
    );
    let on_demand = std::env::var("AETHER_BENCH_OBSERVED").ok().map(|v| {
        v.parse::<usize>()
            .expect("AETHER_BENCH_OBSERVED is a count")
    });
    // The mesh, its last service added in a step of its own, so that the snapshot's
    // history reaches the one before (`buckets, cold, a pod since`).
    let mut builder = Builder::new(Inputs {
        registry: RegistryView::new((0..services - 1).map(|s| mesh_service(s, 10, None))),
        on_demand_clusters: on_demand.is_some(),
        ..Default::default()
    });
    let before = builder.snapshot().clone();
    let snapshot = builder
        .apply([Change::UpsertService(mesh_service(services - 1, 10, None))])
        .expect("one more service changes the snapshot");
    let encoded = Arc::new(Encoded::default());
    encoded.warm(&snapshot, None);
    // With on-demand clusters: the first N services' clusters observed, in a state folder
    // of the bench's own.
    let state = tempfile::tempdir().expect("a state folder");
    let observed = on_demand.map(|n| {
        let o = Observed::restore(state.path());
        for name in snapshot
            .hashes(Kind::Cluster)
            .keys()
            .filter(|c| is_outbound_cluster(c))
            .take(n)
        {
            o.insert(name);
        }
        o
    });
    let observed_names = observed.as_ref().map(|o| o.names());
    let holds = |kind: Kind, name: &str| match (&observed_names, kind) {
        (None, _) | (Some(_), Kind::Listener | Kind::Route | Kind::Secret) => true,
        (Some(o), Kind::Cluster) => !is_outbound_cluster(name) || o.contains(name),
        (Some(o), Kind::Endpoint) => o.contains(name),
    };
    // Buckets: the three services' clusters and load assignments the proxy holds at an
    // older version.
    let stale: std::collections::BTreeSet<String> = snapshot
        .hashes(Kind::Cluster)
        .keys()
        .filter(|c| is_outbound_cluster(c) && holds(Kind::Cluster, c))
        .take(3)
        .cloned()
        .collect();
    let stale_version = |kind: Kind, name: &str, h: u64| {
        let older = matches!(kind, Kind::Cluster | Kind::Endpoint) && stale.contains(name);
        wire_version(if older { h ^ 1 } else { h })
    };
    // The relay's offer of each type's digest of what the proxy holds, whole and in
    // buckets: as the snapshot, or with the stale versions.
    let offer_of = |version: &dyn Fn(Kind, &str, u64) -> String| {
        let per_type: Vec<(Kind, Digest, Buckets)> = KINDS
            .into_iter()
            .map(|k| {
                let held = snapshot.hashes(k).iter().filter(|(n, _)| holds(k, n));
                let pairs: Vec<(&String, String)> =
                    held.map(|(n, h)| (n, version(k, n, *h))).collect();
                let pairs = || pairs.iter().map(|(n, v)| (n.as_str(), v.as_str()));
                (k, Digest::of(pairs()), Buckets::of(pairs()))
            })
            .collect();
        let mut offer = resume::offer(
            per_type.iter().map(|(k, d, b)| (type_url(*k), *d, b)),
            resume::BUCKETS_FROM,
        );
        // The EDS subscription by its names' digest, as the relay offers it.
        let eds = snapshot.hashes(Kind::Endpoint).keys();
        let names =
            resume::names_digest(eds.filter(|n| holds(Kind::Endpoint, n)).map(String::as_str));
        offer.push(',');
        offer.push_str(&resume::names_entry(type_url(Kind::Endpoint), names));
        offer
    };
    let offer = offer_of(&|_, _, h| wire_version(h));
    let stale_offer = offer_of(&stale_version);
    let warm = Digests::default();
    warm.of(&snapshot);
    warm.index(&snapshot);
    println!(
        "resume over delta ADS: {services} services x 10 endpoints, {} clusters, {} load assignments; {rounds} rounds{}",
        snapshot.hashes(Kind::Cluster).len(),
        snapshot.hashes(Kind::Endpoint).len(),
        match on_demand {
            Some(n) => format!(
                "; on-demand clusters, {n} observed (the proxy holds those and the node's own)"
            ),
            None => String::new(),
        }
    );
    let mut summary = Vec::new();
    // The buckets' answer, as the relay reads it: per type, the buckets relied on.
    let bucket_answer = warm.matched(&snapshot, &stale_offer);
    let relied = |k: Kind| {
        bucket_answer
            .buckets
            .iter()
            .find(|(kind, _)| *kind == k)
            .map_or(0, |(_, m)| *m)
    };
    // The EDS names the relay offers by their digest are the snapshot's (not so with
    // on-demand clusters, where the proxy names a few): then the first EDS request
    // re-states them as the one name relied on.
    let names_matched = warm
        .matched(&snapshot, &offer)
        .names
        .contains(&Kind::Endpoint);
    for mode in [
        Mode::Plain,
        Mode::DigestWarm,
        Mode::DigestCold,
        Mode::Buckets,
        Mode::BucketsCold,
        Mode::BucketsLagging,
    ] {
        let requests: Vec<(Kind, Vec<u8>)> = KINDS
            .into_iter()
            .map(|k| {
                let r = relied(k);
                let by_names = names_matched && k == Kind::Endpoint;
                let current = |_: Kind, _: &str, h: u64| wire_version(h);
                let request = match mode {
                    Mode::Plain => resume_request(&snapshot, k, holds, current, |_| true, 0, false),
                    Mode::DigestWarm | Mode::DigestCold => {
                        resume_request(&snapshot, k, holds, current, |_| false, 0, by_names)
                    }
                    Mode::Buckets | Mode::BucketsCold | Mode::BucketsLagging => resume_request(
                        &snapshot,
                        k,
                        holds,
                        stale_version,
                        |n| r != 0 && !resume::in_bitmap(r, n),
                        r,
                        by_names,
                    ),
                };
                (k, request)
            })
            .collect();
        let bytes: usize = requests.iter().map(|(_, b)| b.len()).sum();
        // Per type: decode, apply, answer, free; and each round's total.
        let mut steps: Vec<[Vec<f64>; 5]> = KINDS.iter().map(|_| Default::default()).collect();
        let mut offers = Vec::new();
        let mut totals = Vec::new();
        let mut matched_types = 0;
        for _ in 0..rounds {
            // A lagging cold owner: its digests and names by bucket are of the snapshot
            // before, made as that one was published.
            let cold = Digests::default();
            if mode == Mode::BucketsLagging {
                cold.of(&before);
            }
            let start = Instant::now();
            let mut st = DeltaState::new(snapshot.clone(), encoded.clone());
            if let Some(o) = &observed {
                st.on_demand(o.clone());
            }
            if mode != Mode::Plain {
                // What the server does when the stream opens with the offer.
                let digests = if mode.cold() { &cold } else { &warm };
                let answer = if mode.buckets() {
                    digests.matched(&snapshot, &stale_offer)
                } else {
                    digests.matched(&snapshot, &offer)
                };
                matched_types = answer.whole.len() + answer.buckets.len();
                for k in answer.whole {
                    st.resume_held(k, Resumed::Whole(snapshot.hashes(k).clone()));
                }
                for (k, matched) in answer.buckets {
                    let hashes = snapshot.hashes(k).clone();
                    let by_bucket = digests.by_bucket(&snapshot, k);
                    st.resume_held(
                        k,
                        Resumed::Buckets {
                            hashes,
                            matched,
                            by_bucket,
                        },
                    );
                }
                for k in answer.names {
                    st.resume_held(k, Resumed::Names(snapshot.clone()));
                }
                offers.push(ms(start.elapsed()));
            }
            for (i, (_, bytes)) in requests.iter().enumerate() {
                let t0 = Instant::now();
                let req = Request::from(
                    DeltaRequestWire::decode(bytes.as_slice()).expect("the request decodes"),
                );
                let t1 = Instant::now();
                st.on_request(&req);
                let t2 = Instant::now();
                let answers = st.pending();
                let t3 = Instant::now();
                // What follows, as the server and the proxy do it: after every request the
                // server asks whether the proxy holds the snapshot (for the CNI ADDs waiting
                // on an ACK), and the proxy ACKs each answer.
                std::hint::black_box(st.acked_current());
                for a in &answers {
                    st.on_request(&Request {
                        type_url: a.type_url.clone(),
                        response_nonce: a.nonce.clone(),
                        ..Default::default()
                    });
                    std::hint::black_box(st.acked_current());
                }
                let t4 = Instant::now();
                drop(req);
                let t5 = Instant::now();
                // A reconnect to the same snapshot is answered empty; with the stale
                // versions, each of the two types with the three services' resources.
                let sent: usize = answers.iter().map(|a| a.resources.len()).sum();
                let removed: usize = answers.iter().map(|a| a.removed_resources.len()).sum();
                let kind = KINDS[i];
                let want = if mode.buckets() && matches!(kind, Kind::Cluster | Kind::Endpoint) {
                    stale.len()
                } else {
                    0
                };
                assert_eq!(
                    (sent, removed),
                    (want, 0),
                    "{} {}",
                    mode.name(),
                    kind.short()
                );
                for (k, d) in [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4]
                    .into_iter()
                    .enumerate()
                {
                    steps[i][k].push(ms(d));
                }
            }
            totals.push(ms(start.elapsed()));
        }
        println!(
            "\n{}: first requests {:.1} MB{}{}",
            mode.name(),
            bytes as f64 / 1e6,
            if mode != Mode::Plain && names_matched {
                ", EDS by its names' digest"
            } else {
                ""
            },
            if mode == Mode::Plain {
                String::new()
            } else {
                format!(
                    "; offer answered in {} ms, {matched_types} of {} types matched{}",
                    fmt(&mut offers),
                    KINDS.len(),
                    if mode.buckets() {
                        " (CDS and EDS in buckets)"
                    } else {
                        ""
                    }
                )
            }
        );
        println!(
            "{:<5} {:>15} {:>15} {:>15} {:>15} {:>15}   (ms, median / p99)",
            "type", "decode", "apply", "answer", "ACKs", "free"
        );
        for (i, kind) in KINDS.iter().enumerate() {
            let [d, a, p, k, f] = &mut steps[i];
            println!(
                "{:<5} {:>15} {:>15} {:>15} {:>15} {:>15}",
                kind.short(),
                fmt(d),
                fmt(a),
                fmt(p),
                fmt(k),
                fmt(f)
            );
        }
        let total = fmt(&mut totals);
        println!(
            "total per reconnect, median / p99: {total} ms (the server frees requests of over 1,024 names off its thread)"
        );
        summary.push((mode.name(), total));
    }
    println!("\nthe worker's cost of a resume, {services} services (ms, median / p99):");
    for (name, total) in summary {
        println!("  {name:<14} {total}");
    }
}

fn fmt(v: &mut [f64]) -> String {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    format!("{:6.2} / {:6.2}", at(0.5), at(0.99))
}
