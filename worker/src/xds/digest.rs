//! The agent's side of the digest resume (`shared_proto::resume`): the digest of each
//! type of the current snapshot, whole and in buckets, as (name, wire version) pairs,
//! kept per snapshot and carried from one snapshot to the next by what changed, so that
//! answering a relay's offer costs a comparison of a few hundred numbers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aether_model::Snapshot;
use imbl::OrdMap;
use shared_proto::resume::{self, Buckets, Digest};

use super::kind::{KIND_COUNT, KINDS, Kind, from_type_url, type_url, wire_version};

/// Each type's digest, whole and in buckets, and the digest of the EDS names the
/// snapshot needs the proxy to subscribe to (its EDS clusters).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Of {
    pub whole: [Digest; KIND_COUNT],
    pub buckets: [Buckets; KIND_COUNT],
    pub eds_names: Digest,
}

/// The digests of the last snapshot asked about, and the names by bucket of the last
/// snapshot indexed (each under a lock of its own: an offer never waits for an index).
#[derive(Default)]
pub struct Digests {
    of: Mutex<Cached>,
    index: Mutex<Option<(Arc<Snapshot>, Index)>>,
}

/// One bucket's names, sorted, shared between the snapshots whose names in it are the
/// same.
pub type Bucket = Arc<Vec<String>>;

/// Each type's names by their bucket ([`resume::bucket`]), carried from one snapshot to
/// the next by what changed: a change copies the one bucket it touches (about 160 names
/// at 10,000 services), the others stay shared. A bucket resume then looks at the names
/// of the buckets the relay did not rely on, instead of hashing every name of the type:
/// at 10,000 services that walk cost about 0.65 ms of the runtime thread for each of CDS
/// and EDS (`cargo bench -p aether-e2e --bench resume`).
#[derive(Debug, Clone, Default)]
pub struct Index([Vec<Bucket>; KIND_COUNT]);

impl Index {
    /// From every name of `s`.
    fn full(s: &Snapshot) -> Index {
        let mut index = Index::default();
        for kind in KINDS {
            index.0[kind.index()] = full(s, kind).2;
        }
        index
    }

    /// This index, of `last`, carried to `s`; None when the history does not reach, or
    /// when so much changed that indexing every name costs less ([`worth_carrying`]).
    fn carried(&self, last: &Snapshot, s: &Snapshot) -> Option<Index> {
        if !worth_carrying(last, s) {
            return None;
        }
        let mut index = Index::default();
        for kind in KINDS {
            index.0[kind.index()] = self.kind_carried(last, s, kind)?;
        }
        Some(index)
    }

    /// The names of `kind` by bucket, carried from `last` to `s`: the buckets no change
    /// touched stay shared. None when the history does not reach.
    fn kind_carried(&self, last: &Snapshot, s: &Snapshot, kind: Kind) -> Option<Vec<Bucket>> {
        let mut sets = self.0[kind.index()].clone();
        for n in s.changed_since(last, kind)? {
            let names = Arc::make_mut(&mut sets[resume::bucket(n)]);
            let at = names.binary_search_by(|x| x.as_str().cmp(n));
            match (s.hashes(kind).contains_key(n), at) {
                (true, Err(i)) => names.insert(i, n.to_string()),
                (false, Ok(i)) => {
                    names.remove(i);
                }
                _ => {}
            }
        }
        Some(sets)
    }

    /// The names of `kind` by bucket (shared, not copied).
    pub fn of_kind(&self, kind: Kind) -> Vec<Bucket> {
        self.0[kind.index()].clone()
    }
}

/// [`resume::pair_hash`] of `name` at the wire version of `hash` ([`wire_version`]),
/// its 16 hex digits written on the stack: a snapshot walked whole (a cold owner's first
/// of the mesh) hashes every resource, 20,000 at 10,000 services, while the relay's offer
/// waits.
fn pair(name: &str, hash: u64) -> u64 {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    for (i, d) in digits.iter_mut().enumerate() {
        *d = HEX[((hash >> (60 - 4 * i)) & 0xf) as usize];
    }
    let version = std::str::from_utf8(&digits).expect("hex digits are ASCII");
    resume::pair_hash(name, version)
}

/// A type's digest, whole and in buckets, and its names by bucket: one walk of its
/// resources, each name's bucket and each pair hashed once.
fn full(s: &Snapshot, kind: Kind) -> (Digest, Buckets, Vec<Bucket>) {
    let (mut d, mut b) = (Digest::default(), Buckets::default());
    let mut names = vec![Vec::new(); resume::BUCKETS];
    // The map walks its names in order, so each bucket's come sorted.
    for (n, h) in s.hashes(kind) {
        let (at, p) = (resume::bucket(n), pair(n, *h));
        d.add_hash(p);
        b.add_hash(at, p);
        names[at].push(n.clone());
    }
    (d, b, names.into_iter().map(Arc::new).collect())
}

/// What a relay's offer matched: whole types, of the others the buckets (a bitmap), and
/// the types whose subscribed names are the snapshot's (EDS alone is offered so).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub whole: Vec<Kind>,
    pub buckets: Vec<(Kind, u64)>,
    pub names: Vec<Kind>,
}

/// What the proxy holds of a type a relay's offer matched, as of the answer.
#[derive(Debug, Clone)]
pub enum Resumed {
    /// The whole type: the snapshot's resources.
    Whole(OrdMap<String, u64>),
    /// The snapshot's resources (all of them, as of the answer) in the `matched` buckets;
    /// their names by bucket ([`Index::of_kind`]) if the snapshot's index was at hand.
    Buckets {
        hashes: OrdMap<String, u64>,
        matched: u64,
        by_bucket: Option<Vec<Bucket>>,
    },
    /// Not what the proxy holds but what it subscribes to: the snapshot's names of the
    /// type (EDS: its EDS clusters), when the relay re-states the subscription as
    /// [`resume::RELIED`].
    Names(Arc<Snapshot>),
}

impl Resumed {
    /// What the proxy holds, given the type's first request's `initial` versions: a whole
    /// match stands when the relay listed nothing; a bucket match, when it named the
    /// buckets it relies on (`resume::RELIED`, of those matched), holds the snapshot's
    /// resources in them and the versions listed besides. None: the relay did not take
    /// the match (what Envoy holds moved after the offer), and `initial` is complete.
    pub fn held(self, initial: &HashMap<String, String>) -> Option<OrdMap<String, u64>> {
        match self {
            Resumed::Whole(held) => initial.is_empty().then_some(held),
            Resumed::Names(_) => None,
            Resumed::Buckets {
                hashes,
                matched,
                by_bucket,
            } => {
                let relied = resume::relied(initial)? & matched;
                let listed = |name: &str| {
                    let v = initial.get(name).filter(|_| name != resume::RELIED)?;
                    u64::from_str_radix(v, 16).ok()
                };
                // The snapshot's, shared: only the names held otherwise are touched. The
                // buckets not relied on hold what the relay listed of them, which after
                // a roll is mostly the snapshot's own versions; removing every name of
                // them and inserting the listed ones cost a cold owner about a
                // millisecond per type at 10,000 services, on the thread that answers.
                let mut held = hashes.clone();
                let settle =
                    |held: &mut OrdMap<String, u64>, name: &String, ours: u64| match listed(name) {
                        Some(v) if v == ours => {}
                        Some(v) => {
                            held.insert(name.clone(), v);
                        }
                        None => {
                            held.remove(name);
                        }
                    };
                match &by_bucket {
                    // The names of the buckets not relied on, and no others.
                    Some(sets) => {
                        let not_relied = sets
                            .iter()
                            .enumerate()
                            .filter(|(b, _)| relied & (1 << b) == 0);
                        for name in not_relied.flat_map(|(_, set)| set.iter()) {
                            if let Some(ours) = hashes.get(name) {
                                settle(&mut held, name, *ours);
                            }
                        }
                    }
                    None => {
                        for (name, ours) in &hashes {
                            if !resume::in_bitmap(relied, name) {
                                settle(&mut held, name, *ours);
                            }
                        }
                    }
                }
                // Listed and not settled above: held as listed.
                for name in initial.keys() {
                    let settled = hashes.contains_key(name) && !resume::in_bitmap(relied, name);
                    if let Some(v) = listed(name).filter(|_| !settled)
                        && held.get(name) != Some(&v)
                    {
                        held.insert(name.clone(), v);
                    }
                }
                Some(held)
            }
        }
    }
}

impl Digests {
    /// The digests of each type of `s`: from the last snapshot's and what changed since,
    /// or, without a history that reaches it or with most of it changed (a cold owner's
    /// first snapshot of the mesh), from every resource, indexing `s`'s names by bucket in
    /// the same walk.
    pub fn of(&self, s: &Arc<Snapshot>) -> Of {
        let mut cache = self.of.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(of) = cached_or_carried(&mut cache, s, None) {
            return of;
        }
        let out = {
            let mut out = Of::default();
            let mut index = Index::default();
            for kind in KINDS {
                let (d, b, names) = full(s, kind);
                out.whole[kind.index()] = d;
                out.buckets[kind.index()] = b;
                index.0[kind.index()] = names;
            }
            out.eds_names = resume::names_digest(s.eds_cluster_names());
            // Never waits for an index under way: that one is carried, and `index`
            // comes back to `s` after.
            if let Ok(mut at) = self.index.try_lock()
                && !at.as_ref().is_some_and(|(last, _)| Arc::ptr_eq(last, s))
            {
                *at = Some((s.clone(), index));
            }
            out
        };
        *cache = Some((s.clone(), out));
        out
    }

    /// Whether the digests of `s` are at hand.
    #[cfg(test)]
    pub(crate) fn holds(&self, s: &Arc<Snapshot>) -> bool {
        let cache = self.of.lock().unwrap_or_else(|e| e.into_inner());
        cache.as_ref().is_some_and(|(last, _)| Arc::ptr_eq(last, s))
    }

    /// Indexes `s`'s names by bucket: carried from the last snapshot indexed, or, without
    /// a history that reaches it, from every name (which [`Digests::of`] has done already
    /// for a snapshot it computed from every resource). Off the runtime thread, after the
    /// snapshot's digests ([`crate::xds::encoded::keep_warm`]).
    pub fn index(&self, s: &Arc<Snapshot>) {
        let mut cache = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let index = match cache.as_ref() {
            Some((last, _)) if Arc::ptr_eq(last, s) => return,
            Some((last, index)) => index.carried(last, s),
            None => None,
        };
        let index = index.unwrap_or_else(|| Index::full(s));
        *cache = Some((s.clone(), index));
    }

    /// The names of `kind` by bucket in `s`: if `s` is indexed, or a few changes past the
    /// snapshot that is, carried here; never waits for an index under way.
    pub fn by_bucket(&self, s: &Arc<Snapshot>, kind: Kind) -> Option<Vec<Bucket>> {
        let cache = self.index.try_lock().ok()?;
        let (last, index) = cache.as_ref()?;
        if Arc::ptr_eq(last, s) {
            return Some(index.of_kind(kind));
        }
        // A snapshot published since the last indexed (a pod came or went as the relay's
        // stream opened) and not indexed yet on the heavy-work thread: this type's few
        // touched buckets are copied here. Without them the resume hashed every name's
        // bucket, about 2 ms a type on a busy node at 10,000 services.
        if !worth_carrying(last, s) {
            return None;
        }
        index.kind_carried(last, s, kind)
    }

    /// The answer to a relay's offer: the types whose digest equals `s`'s, of the others
    /// offered in buckets the buckets that do (if any), and EDS if the names offered are
    /// those of `s`'s EDS clusters. Computes `s`'s digests if they are not at hand, or
    /// waits for the walk under way ([`Digests::of`]): off the runtime thread.
    pub fn matched(&self, s: &Arc<Snapshot>, offer: &str) -> Answer {
        answer(self.of(s), offer)
    }

    /// [`Digests::matched`] if `s`'s digests are at hand, or carried here from the last
    /// snapshot's by at most [`CARRY_AT_HAND`] changed names (a pod came or went as the
    /// relay's stream opened), without waiting: `None` while a walk holds them, or when
    /// more changed (a cold owner's first snapshot of the mesh).
    pub fn matched_at_hand(&self, s: &Arc<Snapshot>, offer: &str) -> Option<Answer> {
        let of = cached_or_carried(&mut *self.of.try_lock().ok()?, s, Some(CARRY_AT_HAND))?;
        Some(answer(of, offer))
    }

    /// Runs `f` while holding the digests' lock, as a walk of every resource does.
    #[cfg(test)]
    pub(crate) fn while_walking<T>(&self, f: impl FnOnce() -> T) -> T {
        let _walking = self.of.lock().unwrap_or_else(|e| e.into_inner());
        f()
    }
}

/// The answer to `offer` from a snapshot's digests (see [`Digests::matched`]).
fn answer(of: Of, offer: &str) -> Answer {
    let Of {
        whole,
        buckets,
        eds_names,
    } = of;
    let mut answer = Answer::default();
    let offered = resume::parse_offer(offer);
    for (url, digest) in &offered {
        if let Some(kind) = from_type_url(url)
            && whole[kind.index()].encode() == *digest
        {
            answer.whole.push(kind);
        }
    }
    for (url, encoded) in &offered {
        if let Some(kind) = url
            .strip_suffix(resume::BUCKETS_SUFFIX)
            .and_then(from_type_url)
            && !answer.whole.contains(&kind)
        {
            let m = buckets[kind.index()].matched(encoded);
            if m != 0 {
                answer.buckets.push((kind, m));
            }
        }
        if url
            .strip_suffix(resume::NAMES_SUFFIX)
            .and_then(from_type_url)
            == Some(Kind::Endpoint)
            && eds_names.encode() == *encoded
        {
            answer.names.push(Kind::Endpoint);
        }
    }
    answer
}

/// How many changed names a relay's offer carries the digests over on the runtime thread
/// ([`Digests::matched_at_hand`]): a few microseconds each, where the blocking pool's
/// round trip costs more.
pub const CARRY_AT_HAND: usize = 256;

/// The last snapshot's digests, as [`Digests`] keeps them.
type Cached = Option<(Arc<Snapshot>, Of)>;

/// `s`'s digests from `cache`: the cached ones if they are `s`'s, else carried from them
/// by what changed (by at most `within` names, when given) and kept in their place. None
/// when there is nothing cached, or `s` is too far from it.
fn cached_or_carried(cache: &mut Cached, s: &Arc<Snapshot>, within: Option<usize>) -> Option<Of> {
    let (last, of) = cache.as_ref()?;
    if Arc::ptr_eq(last, s) {
        return Some(*of);
    }
    if within.is_some_and(|n| changed_names(last, s).is_none_or(|c| c > n)) {
        return None;
    }
    let carried = carry(last, of, s)?;
    *cache = Some((s.clone(), carried));
    Some(carried)
}

/// The names of every type changed from `last` to `s`; None when the history does not
/// reach.
fn changed_names(last: &Snapshot, s: &Snapshot) -> Option<usize> {
    KINDS.into_iter().map(|k| s.changes_since(last, k)).sum()
}

/// Whether what changed from `last` to `s` is few enough that carrying `last`'s digests
/// and index costs less than a walk of every resource of `s`. A carried name costs two
/// lookups, two pair hashes of formatted versions and, in the index, a copy: more than
/// a resource in the walk. A cold owner's first snapshot of the mesh follows one of its
/// stored pods alone, the mesh one step of 20,000 names at 10,000 services: carried,
/// its digests took 13 to 20 ms of the heavy-work thread while the relay's offer waited,
/// and its index then competed with the resume for the worker's one malloc arena.
fn worth_carrying(last: &Snapshot, s: &Snapshot) -> bool {
    let (mut changed, mut total) = (0, 0);
    for kind in KINDS {
        match s.changes_since(last, kind) {
            Some(n) => changed += n,
            None => return false,
        }
        total += s.hashes(kind).len();
    }
    changed * 4 <= total
}

/// The digests of `s` carried from `last`'s (`of`) by what changed between them; None
/// when the history does not reach, or when so much changed that a walk of every
/// resource costs less ([`worth_carrying`]).
fn carry(last: &Snapshot, of: &Of, s: &Snapshot) -> Option<Of> {
    if !worth_carrying(last, s) {
        return None;
    }
    let mut out = *of;
    for kind in KINDS {
        let (d, b) = (&mut out.whole[kind.index()], &mut out.buckets[kind.index()]);
        let (old, new) = (last.hashes(kind), s.hashes(kind));
        for n in s.changed_since(last, kind)? {
            if let Some(h) = old.get(n) {
                let v = wire_version(*h);
                d.remove(n, &v);
                b.remove(n, &v);
            }
            if let Some(h) = new.get(n) {
                let v = wire_version(*h);
                d.add(n, &v);
                b.add(n, &v);
            }
        }
    }
    // The EDS names follow the clusters that changed.
    for n in s.changed_since(last, Kind::Cluster)? {
        if last.needs_eds(n) {
            out.eds_names.remove(n, "");
        }
        if s.needs_eds(n) {
            out.eds_names.add(n, "");
        }
    }
    Some(out)
}

/// The response header's value for `answer`.
pub fn header(answer: &Answer) -> String {
    let whole = answer.whole.iter().map(|k| type_url(*k).to_string());
    let buckets = answer
        .buckets
        .iter()
        .map(|(k, m)| format!("{}{}={m:x}", type_url(*k), resume::BUCKETS_SUFFIX));
    let names = answer
        .names
        .iter()
        .map(|k| format!("{}{}", type_url(*k), resume::NAMES_SUFFIX));
    whole
        .chain(buckets)
        .chain(names)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_model::{Builder, Change, Endpoint, EndpointState, Inputs, RegistryView, Service};

    fn svc(name: &str, ip: &str) -> Service {
        Service {
            name: name.into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: vec![Endpoint {
                address: ip.parse().unwrap(),
                port: 8080,
                service_port: 80,
                node: String::new(),
                pod: String::new(),
                state: EndpointState::Healthy,
                mtls: false,
            }],
        }
    }

    fn offer(of: &Of) -> String {
        resume::offer(
            KINDS
                .into_iter()
                .map(|k| (type_url(k), of.whole[k.index()], &of.buckets[k.index()])),
            0,
        )
    }

    /// `s`'s names of `kind` in each bucket, found by asking each name its bucket.
    fn by_filter(s: &Snapshot, kind: Kind) -> Vec<Bucket> {
        (0..resume::BUCKETS)
            .map(|b| {
                let names = s.hashes(kind).keys().filter(|n| resume::bucket(n) == b);
                let mut names: Vec<String> = names.cloned().collect();
                names.sort();
                Arc::new(names)
            })
            .collect()
    }

    #[test]
    fn a_pairs_hash_is_the_protocols_of_its_wire_version() {
        for h in [
            0,
            1,
            0xa,
            0xdead_beef,
            1 << 63,
            u64::MAX,
            0x0123_4567_89ab_cdef,
        ] {
            for n in ["", "outbound|80|s.d", "inbound|pod-00824-uid"] {
                assert_eq!(
                    pair(n, h),
                    resume::pair_hash(n, &wire_version(h)),
                    "{n} {h:x}"
                );
            }
        }
    }

    /// A builder of `n` services `s0`.. on one endpoint each.
    fn mesh(n: usize) -> Builder {
        Builder::new(Inputs {
            registry: RegistryView::new((0..n).map(|i| svc(&format!("s{i}"), "10.0.0.1"))),
            ..Default::default()
        })
    }

    /// An offer's answer is at hand, without the blocking pool, for the snapshot digested
    /// last and for one a few changes past it (carried on the spot, and kept); not for one
    /// with no digested past, nor while a walk holds the digests. Each answer at hand is
    /// the one [`Digests::matched`] gives.
    #[test]
    fn an_offers_answer_is_at_hand_for_the_last_digested_snapshot_and_one_a_few_changes_past() {
        let mut b = mesh(2000);
        let digests = Digests::default();
        let first = b.snapshot().clone();
        let o = offer(&digests.of(&first));
        assert_eq!(
            digests.matched_at_hand(&first, &o).as_ref(),
            Some(&digests.matched(&first, &o))
        );
        let next = b
            .apply([Change::UpsertService(svc("s3", "10.0.0.2"))])
            .unwrap();
        let at_hand = digests
            .matched_at_hand(&next, &o)
            .expect("carried on the spot");
        assert!(digests.holds(&next), "the carried digests are kept");
        let fresh = Digests::default();
        assert_eq!(at_hand, fresh.matched(&next, &o), "as from every resource");
        assert!(
            at_hand.whole.len() < KINDS.len(),
            "a changed service's types no longer match: {at_hand:?}"
        );

        let other = Builder::new(Inputs::default()).snapshot().clone();
        assert_eq!(
            digests.matched_at_hand(&other, &o),
            None,
            "no digested past"
        );
        digests.while_walking(|| {
            assert_eq!(
                digests.matched_at_hand(&next, &o),
                None,
                "a walk holds them"
            );
        });
        let many = b
            .apply(
                (0..CARRY_AT_HAND)
                    .map(|i| Change::UpsertService(svc(&format!("m{i}"), "10.0.0.4"))),
            )
            .unwrap();
        assert_eq!(
            digests.matched_at_hand(&many, &o),
            None,
            "more than {CARRY_AT_HAND} names changed: left to the blocking pool"
        );
    }

    #[test]
    fn digests_carried_by_what_changed_equal_digests_from_scratch_and_answer_an_offer() {
        let mut b = mesh(20);
        let digests = Digests::default();
        let first = b.snapshot().clone();
        let at_first = digests.of(&first);
        let next = b
            .apply([
                Change::UpsertService(svc("s3", "10.0.0.2")),
                Change::UpsertService(svc("new", "10.0.0.3")),
                Change::RemoveService(svc("s7", "10.0.0.1").key()),
            ])
            .unwrap();
        assert!(
            worth_carrying(&first, &next),
            "a few services changed of 20"
        );
        let carried = digests.of(&next);
        for k in KINDS {
            let (d, b, _) = full(&next, k);
            assert_eq!(carried.whole[k.index()], d, "{k:?}");
            assert_eq!(carried.buckets[k.index()], b, "{k:?}");
        }
        // The names by bucket likewise. The first snapshot's, without a history, came
        // with its digests; the next's are carried on demand before it is indexed.
        for k in KINDS {
            assert_eq!(
                digests.by_bucket(&first, k),
                Some(by_filter(&first, k)),
                "{k:?}"
            );
        }
        digests.index(&first);
        for k in KINDS {
            assert_eq!(
                digests.by_bucket(&next, k),
                Some(by_filter(&next, k)),
                "{k:?}, not indexed yet"
            );
        }
        digests.index(&next);
        for k in KINDS {
            assert_eq!(
                digests.by_bucket(&next, k),
                Some(by_filter(&next, k)),
                "{k:?}"
            );
            assert_eq!(Index::full(&next).of_kind(k), by_filter(&next, k), "{k:?}");
        }
        for k in [Kind::Cluster, Kind::Endpoint] {
            assert_ne!(
                Index::full(&first).of_kind(k),
                Index::full(&next).of_kind(k),
                "{k:?}"
            );
        }
        assert_ne!(carried.whole, at_first.whole);
        // The EDS names, carried by the clusters that changed (one service came, one went).
        assert_eq!(
            carried.eds_names,
            resume::names_digest(next.eds_cluster_names())
        );
        assert_ne!(carried.eds_names, at_first.eds_names);
        let eds = type_url(Kind::Endpoint);
        let names_of = |of: &Of| resume::names_entry(eds, of.eds_names);
        assert_eq!(
            digests.matched(&next, &names_of(&carried)).names,
            [Kind::Endpoint]
        );
        assert!(
            digests
                .matched(&next, &names_of(&at_first))
                .names
                .is_empty()
        );
        // Only EDS names are matched: the same digest offered for CDS is not.
        let cds = resume::names_entry(type_url(Kind::Cluster), carried.eds_names);
        assert!(digests.matched(&next, &cds).names.is_empty());
        let h = header(&digests.matched(&next, &names_of(&carried)));
        assert!(resume::names_matched(&h, eds), "{h}");
        // An offer of the first snapshot's digests, against the next: CDS and EDS
        // changed, the listeners and routes did not.
        let matched = digests.matched(&next, &offer(&at_first)).whole;
        assert!(!matched.contains(&Kind::Cluster) && !matched.contains(&Kind::Endpoint));
        assert_eq!(
            digests.matched(&next, &offer(&carried)).whole.len(),
            KIND_COUNT
        );
        assert_eq!(digests.matched(&next, "garbage"), Answer::default());
        // In buckets: each type not matched whole differs in the buckets of the names
        // that changed, and matches in the others.
        let answer = digests.matched(&next, &offer(&at_first));
        let mut differing = Vec::new();
        for k in KINDS {
            let (old, new) = (first.hashes(k), next.hashes(k));
            let differ = old
                .keys()
                .chain(new.keys())
                .filter(|n| old.get(*n) != new.get(*n))
                .fold(0u64, |m, n| m | 1 << resume::bucket(n));
            if differ != 0 {
                differing.push((k, !differ));
            }
        }
        assert!(differing.iter().any(|(k, _)| *k == Kind::Endpoint));
        assert_eq!(answer.buckets, differing);
        let h = header(&answer);
        assert_eq!(
            resume::parse_matched_buckets(&h).len(),
            differing.len(),
            "{h}"
        );
    }

    /// A cold owner's first snapshot of the mesh follows its first (the stored pods
    /// alone) by one step that changes nearly every name: it is walked whole, and indexed
    /// in the same walk, not carried name by name.
    #[test]
    fn a_snapshot_mostly_changed_is_walked_whole_and_indexed_with_its_digests() {
        let mut b = Builder::new(Inputs {
            registry: RegistryView::new([svc("s0", "10.0.0.1")]),
            ..Default::default()
        });
        let digests = Digests::default();
        let first = b.snapshot().clone();
        digests.of(&first);
        digests.index(&first);
        let mesh = (1..200).map(|i| Change::UpsertService(svc(&format!("s{i}"), "10.0.0.2")));
        let next = b.apply(mesh).unwrap();
        assert!(
            next.changed_since(&first, Kind::Cluster).is_some(),
            "the history reaches"
        );
        assert!(!worth_carrying(&first, &next));
        // The digests of `s` are those of a walk of every resource.
        let agree = |of: &Of, s: &Snapshot| {
            for k in KINDS {
                let (d, b, _) = full(s, k);
                assert_eq!(
                    (of.whole[k.index()], of.buckets[k.index()]),
                    (d, b),
                    "{k:?}"
                );
            }
        };
        let of = digests.of(&next);
        agree(&of, &next);
        for k in KINDS {
            let pairs: Vec<(String, String)> = next
                .hashes(k)
                .iter()
                .map(|(n, h)| (n.clone(), wire_version(*h)))
                .collect();
            let by_definition = Digest::of(pairs.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            assert_eq!(of.whole[k.index()], by_definition, "{k:?}");
            // Indexed with the digests: no call to `index` needed.
            assert_eq!(
                digests.by_bucket(&next, k),
                Some(by_filter(&next, k)),
                "{k:?}"
            );
        }
        assert_eq!(of.eds_names, resume::names_digest(next.eds_cluster_names()));
        // One more service: carried again, digests and index alike.
        let after = b
            .apply([Change::UpsertService(svc("late", "10.0.0.3"))])
            .unwrap();
        assert!(worth_carrying(&next, &after));
        let of = digests.of(&after);
        assert_eq!(
            digests.by_bucket(&after, Kind::Cluster),
            Some(by_filter(&after, Kind::Cluster)),
            "carried on demand"
        );
        digests.index(&after);
        agree(&of, &after);
        for k in KINDS {
            assert_eq!(
                digests.by_bucket(&after, k),
                Some(by_filter(&after, k)),
                "{k:?}"
            );
        }
    }

    #[test]
    fn a_bucket_resume_holds_the_snapshot_in_the_buckets_relied_on_and_what_is_listed() {
        let hashes: OrdMap<String, u64> = (0..200u64).map(|i| (format!("c{i}"), i)).collect();
        let in_b0: Vec<&String> = hashes.keys().filter(|n| resume::bucket(n) == 0).collect();
        let in_b1: Vec<&String> = hashes.keys().filter(|n| resume::bucket(n) == 1).collect();
        assert!(!in_b0.is_empty() && in_b1.len() >= 3);
        // Matched buckets 0 and 1; the relay relies on bucket 0 alone (1 moved) and lists
        // what Envoy holds in every other bucket: here, one of bucket 1's at version 99.
        // Without the snapshot's index, and with it.
        let sets: Vec<Bucket> = (0..resume::BUCKETS)
            .map(|b| {
                let names = hashes.keys().filter(|n| resume::bucket(n) == b).cloned();
                Arc::new(names.collect())
            })
            .collect();
        for by_bucket in [None, Some(sets)] {
            let resumed = Resumed::Buckets {
                hashes: hashes.clone(),
                matched: 0b11,
                by_bucket,
            };
            let mut initial = HashMap::from([
                (resume::RELIED.to_string(), "1".to_string()),
                (in_b1[0].clone(), wire_version(99)),
            ]);
            let held = resumed.clone().held(&initial).unwrap();
            let mut want: OrdMap<String, u64> =
                in_b0.iter().map(|n| ((*n).clone(), hashes[*n])).collect();
            want.insert(in_b1[0].clone(), 99);
            assert_eq!(held, want);
            // The common case after a roll: most of what is listed is at the snapshot's
            // own version (kept as shared), and a name the snapshot no longer has is
            // held as listed too; an unreadable version is not held.
            initial.insert(in_b1[1].clone(), wire_version(hashes[in_b1[1]]));
            initial.insert("gone".into(), wire_version(5));
            initial.insert(in_b1[2].clone(), "not hex".into());
            want.insert(in_b1[1].clone(), hashes[in_b1[1]]);
            want.insert("gone".into(), 5);
            assert_eq!(resumed.clone().held(&initial).unwrap(), want);
            for n in ["gone", in_b1[1].as_str(), in_b1[2].as_str()] {
                initial.remove(n);
            }
            // A relied bucket the agent did not match is not taken.
            initial.insert(resume::RELIED.to_string(), "4".to_string());
            assert_eq!(resumed.clone().held(&initial).unwrap().len(), 1);
            // No relied entry: the versions listed are all there is.
            assert!(resumed.held(&HashMap::new()).is_none());
        }
        let initial = HashMap::from([(resume::RELIED.to_string(), "1".to_string())]);
        let whole = Resumed::Whole(hashes.clone());
        assert_eq!(whole.clone().held(&HashMap::new()), Some(hashes));
        assert!(whole.held(&initial).is_none());
    }
}
