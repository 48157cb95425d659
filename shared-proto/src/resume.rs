//! The digest resume between the xDS relay and the agent (both ours): instead of listing
//! every resource version Envoy holds on a new incremental ADS stream, the relay offers a
//! digest of them per type, and an agent whose snapshot has the same digest takes Envoy
//! to hold that snapshot's type, so an unchanged mesh costs the agent nothing to resume.
//!
//! Negotiation, per agent stream, before the relay sends its first request:
//! - the relay opens the stream with the request header [`HEADER`]:
//!   `TYPE_URL=COUNT:DIGEST` per type, comma-separated ([`offer`]);
//! - an agent that supports it answers with the response header [`HEADER`] naming the
//!   types whose digest equals its snapshot's, comma-separated (possibly none); one that
//!   does not (an older owner, mid-roll) sends no such header;
//! - for each named type the relay re-states the subscription without
//!   `initial_resource_versions`, and the agent takes Envoy to hold its snapshot's
//!   resources of the type as of the answer; every other type gets the plain versions.
//!
//! Envoy connected straight to the agent sends no such header and is served as ever.
//!
//! **Handover.** The header also marks the stream as a relay's: a released owner ends
//! it with [`HANDED_OVER`] as soon as its successor serves, instead of at its exit. A
//! relay that offers nothing (state of the world) sends the header empty.
//!
//! **Overlap (make-before-break).** A relay may also ask, per stream, for a handover
//! in which the old owner keeps carrying changes until the new owner has answered the
//! relay's re-statement: the request header [`HANDOVER_HEADER`] with the value
//! [`OVERLAP`]. An agent that does it answers with the same response header; one that
//! does not (an older owner, or state of the world) sends none, and the stream is ended
//! with [`HANDED_OVER`] as above. On a stream where both agreed:
//! - the old owner, once released, sends an answer of the type [`HANDOVER_TYPE`] with
//!   the nonce [`HANDED_OVER_NONCE`] (no resources; it is not forwarded to Envoy) and
//!   goes on serving the stream, until the relay closes its side, or
//!   [`HANDED_OVER`] after a bound;
//! - the relay opens its next stream (which the successor accepts from the socket's
//!   backlog) while the old one still carries, re-states the session on it once
//!   nothing forwarded to Envoy is unanswered, and then sends a request of the type
//!   [`HANDOVER_TYPE`]; the agent answers it with the nonce [`RESTATED_NONCE`] after
//!   every answer it owed before it;
//! - the relay switches at that answer: it forwards the new stream's answers, held back
//!   until then, and closes the old stream. If the old stream carried anything to Envoy
//!   after the re-statement was taken, the new owner's idea of what Envoy holds is stale:
//!   the relay drops that stream and re-states on a fresh one, the old one still
//!   carrying.
//!
//! **Buckets.** A type whose digest differs (a pod's listener and cluster came or went
//! during the roll) would list every version again, 10,000 at mesh scale. So a type of
//! [`BUCKETS_FROM`] pairs or more is also offered in [`BUCKETS`] buckets, by a hash of
//! the name ([`bucket`]), as the entry `TYPE_URL#buckets=COUNT:DIGEST.COUNT:DIGEST...`
//! ([`Buckets::encode`]). For a type it did not match whole, the agent answers the entry
//! `TYPE_URL#buckets=BITMAP` (hex) of the buckets whose digest equals its snapshot's.
//! The relay then lists the versions of the other buckets only, with the reserved entry
//! [`RELIED`] (an empty name, which no resource has) whose value is the bitmap of the
//! buckets it relies on: those matched whose digest has not moved since the offer (an
//! ACK folded in while the stream opened). The agent takes Envoy to hold its snapshot's
//! resources of those buckets, as of the answer, and the listed versions besides. An
//! agent or a relay without buckets skips the entries (no type is named `...#buckets`):
//! the type then goes by its whole digest, or its versions.
//!
//! **Names.** A type Envoy subscribes to by name would list every name again: EDS at mesh
//! scale names each of 10,000 clusters, 0.3 MB to encode, send and read back on every
//! resume. So a type of [`BUCKETS_FROM`] names or more is also offered by the digest of
//! its names (each paired with the empty version), as `TYPE_URL#names=COUNT:DIGEST`
//! ([`names_entry`]). An agent whose snapshot needs exactly those names (EDS: its EDS
//! clusters) answers the entry `TYPE_URL#names`. If the names have not moved since the
//! offer, the relay then re-states the subscription as the one name [`RELIED`] (with `*`
//! if Envoy subscribed to it), and the agent takes the subscription to be its
//! snapshot's names as of the answer. An agent without names skips the entry (no type
//! is named `...#names`); a relay without them never sends [`RELIED`] as a name.
//!
//! The digest of a set of (name, version) pairs is their count and the wrapping sum of a
//! hash of each pair: independent of order, and kept up to date pair by pair.

/// The request header (the relay's offer) and the response header (the agent's answer).
pub const HEADER: &str = "aether-resume-digest";

/// A digest of (name, version) pairs, kept as pairs come and go.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Digest {
    pub count: u64,
    pub sum: u64,
}

/// The buckets a large type is offered in, as well as whole.
pub const BUCKETS: usize = 64;
/// The pairs from which a type is offered in buckets too: below it, listing the versions
/// costs about what the buckets would.
pub const BUCKETS_FROM: u64 = 256;
/// The suffix of a type URL that names its buckets, in an offer and in an answer.
pub const BUCKETS_SUFFIX: &str = "#buckets";
/// The suffix of a type URL that names its subscribed names, in an offer and in an
/// answer.
pub const NAMES_SUFFIX: &str = "#names";
/// The `initial_resource_versions` key of a bucket resume: the bitmap (hex) of the
/// buckets the relay relies on; and the one name of a subscription re-stated by its
/// names' digest. No resource is named by the empty string.
pub const RELIED: &str = "";

/// The message of the UNAVAILABLE status with which a released owner ends a relay's
/// stream once its successor serves (a stream that opened with [`HEADER`], empty when
/// nothing is offered): the relay re-states its session on its next stream, which it
/// opens on a connection of its own, so that it reaches the successor.
pub const HANDED_OVER: &str = "the node is handed over to the successor agent";

/// The request header with which a relay asks for the overlapping handover, and the
/// response header with which an agent that does it agrees; its value is [`OVERLAP`].
pub const HANDOVER_HEADER: &str = "aether-relay-handover";
pub const OVERLAP: &str = "overlap";
/// The type URL of the overlapping handover's in-band messages; no resource has it.
pub const HANDOVER_TYPE: &str = "type.aether.dev/aether.relay.Handover";
/// The nonce of the old owner's answer: the node is handed over, the stream carries on.
pub const HANDED_OVER_NONCE: &str = "handed-over";
/// The nonce of the new owner's answer to the relay's request: every answer owed to the
/// re-statement went before it.
pub const RESTATED_NONCE: &str = "restated";

/// A pair's hash: FNV-1a over the name, a separator and the version, then a 64-bit
/// finaliser (so that the sum of many mixes every bit).
pub fn pair_hash(name: &str, version: &str) -> u64 {
    fnv_mixed(name.bytes().chain([0xff]).chain(version.bytes()))
}

/// The bucket of a resource name.
pub fn bucket(name: &str) -> usize {
    (fnv_mixed(name.bytes()) % BUCKETS as u64) as usize
}

fn fnv_mixed(bytes: impl Iterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

impl Digest {
    pub fn add(&mut self, name: &str, version: &str) {
        self.add_hash(pair_hash(name, version));
    }

    /// [`Digest::add`] of a pair whose [`pair_hash`] is at hand.
    pub fn add_hash(&mut self, pair: u64) {
        self.count += 1;
        self.sum = self.sum.wrapping_add(pair);
    }

    pub fn remove(&mut self, name: &str, version: &str) {
        self.count -= 1;
        self.sum = self.sum.wrapping_sub(pair_hash(name, version));
    }

    /// `COUNT:DIGEST` (hex), as the header carries it.
    pub fn encode(&self) -> String {
        format!("{}:{:016x}", self.count, self.sum)
    }

    pub fn of<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Digest {
        let mut d = Digest::default();
        for (n, v) in pairs {
            d.add(n, v);
        }
        d
    }
}

/// A type's pairs in [`BUCKETS`] buckets, a digest each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets(pub [Digest; BUCKETS]);

impl Default for Buckets {
    fn default() -> Self {
        Buckets([Digest::default(); BUCKETS])
    }
}

impl Buckets {
    pub fn add(&mut self, name: &str, version: &str) {
        self.0[bucket(name)].add(name, version);
    }

    /// [`Buckets::add`] of a pair whose [`bucket`] and [`pair_hash`] are at hand.
    pub fn add_hash(&mut self, bucket: usize, pair: u64) {
        self.0[bucket].add_hash(pair);
    }

    pub fn remove(&mut self, name: &str, version: &str) {
        self.0[bucket(name)].remove(name, version);
    }

    /// `COUNT:DIGEST.COUNT:DIGEST...`, one per bucket in order.
    pub fn encode(&self) -> String {
        self.0
            .iter()
            .map(Digest::encode)
            .collect::<Vec<_>>()
            .join(".")
    }

    /// The bitmap of the buckets whose digest equals the offered one's (`encoded` as
    /// [`Buckets::encode`] writes it; a malformed offer matches nothing).
    pub fn matched(&self, encoded: &str) -> u64 {
        let offered: Vec<&str> = encoded.split('.').collect();
        if offered.len() != BUCKETS {
            return 0;
        }
        (0..BUCKETS)
            .filter(|b| self.0[*b].encode() == offered[*b])
            .fold(0, |m, b| m | 1 << b)
    }

    /// The bitmap of the buckets whose digest equals `other`'s.
    pub fn agree(&self, other: &Buckets) -> u64 {
        (0..BUCKETS)
            .filter(|b| self.0[*b] == other.0[*b])
            .fold(0, |m, b| m | 1 << b)
    }

    pub fn of<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Buckets {
        let mut d = Buckets::default();
        for (n, v) in pairs {
            d.add(n, v);
        }
        d
    }
}

/// Whether `name`'s bucket is in `bitmap`.
pub fn in_bitmap(bitmap: u64, name: &str) -> bool {
    bitmap & (1 << bucket(name)) != 0
}

/// The relay's offer: `TYPE_URL=COUNT:DIGEST` for each type, and
/// `TYPE_URL#buckets=...` too for a type of `from` pairs or more ([`BUCKETS_FROM`]).
pub fn offer<'a>(
    types: impl IntoIterator<Item = (&'a str, Digest, &'a Buckets)>,
    from: u64,
) -> String {
    let mut entries = Vec::new();
    for (t, d, b) in types {
        entries.push(format!("{t}={}", d.encode()));
        if d.count >= from {
            entries.push(format!("{t}{BUCKETS_SUFFIX}={}", b.encode()));
        }
    }
    entries.join(",")
}

/// The digest of a set of names: each paired with the empty version.
pub fn names_digest<'a>(names: impl IntoIterator<Item = &'a str>) -> Digest {
    Digest::of(names.into_iter().map(|n| (n, "")))
}

/// The offer's entry for the names of type `url`, whose digest is `digest`.
pub fn names_entry(url: &str, digest: Digest) -> String {
    format!("{url}{NAMES_SUFFIX}={}", digest.encode())
}

/// Whether the agent's `answer` matched the names of type `url`.
pub fn names_matched(answer: &str, url: &str) -> bool {
    parse_matched(answer)
        .into_iter()
        .any(|e| e.strip_suffix(NAMES_SUFFIX) == Some(url))
}

/// An offer read back: (type URL, `COUNT:DIGEST`) pairs, bucket entries as (type URL
/// with [`BUCKETS_SUFFIX`], buckets); a malformed entry is left out.
pub fn parse_offer(header: &str) -> Vec<(&str, &str)> {
    header
        .split(',')
        .filter_map(|e| e.split_once('='))
        .collect()
}

/// The agent's answer read back: the type URLs it matched whole, and bucket entries
/// as `TYPE_URL#buckets=BITMAP`.
pub fn parse_matched(header: &str) -> Vec<&str> {
    header.split(',').filter(|t| !t.is_empty()).collect()
}

/// The bucket entries of an answer: (type URL, bitmap of the buckets matched).
pub fn parse_matched_buckets(header: &str) -> Vec<(&str, u64)> {
    parse_matched(header)
        .into_iter()
        .filter_map(|e| {
            let (url, bitmap) = e.split_once('=')?;
            let url = url.strip_suffix(BUCKETS_SUFFIX)?;
            Some((url, u64::from_str_radix(bitmap, 16).ok()?))
        })
        .collect()
}

/// The bitmap a bucket resume relies on, from a re-statement's versions: the
/// [`RELIED`] entry; None without one.
pub fn relied(initial: &std::collections::HashMap<String, String>) -> Option<u64> {
    u64::from_str_radix(initial.get(RELIED)?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_kept_pair_by_pair_equals_one_built_at_once_in_any_order() {
        let mut d = Digest::default();
        d.add("b", "2");
        d.add("a", "1");
        d.add("c", "3");
        d.remove("b", "2");
        d.remove("a", "1");
        d.add("a", "9");
        assert_eq!(d, Digest::of([("c", "3"), ("a", "9")]));
        assert_ne!(d, Digest::of([("c", "3"), ("a", "1")]));
        assert_ne!(Digest::of([("ab", "c")]), Digest::of([("a", "bc")]));
    }

    #[test]
    fn buckets_match_where_their_pairs_agree_and_an_offer_with_them_reads_back() {
        let pairs: Vec<(String, String)> = (0..300)
            .map(|i| (format!("outbound|80||svc-{i}.mesh"), format!("{i:x}")))
            .collect();
        let mut ours = Buckets::of(pairs.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let theirs = ours;
        assert_eq!(ours.matched(&theirs.encode()), u64::MAX);
        // One pair at another version, one more: two buckets (or one) differ.
        ours.remove(&pairs[7].0, &pairs[7].1);
        ours.add(&pairs[7].0, "other");
        ours.add("new", "1");
        let m = ours.matched(&theirs.encode());
        let differ = [bucket(&pairs[7].0), bucket("new")];
        for b in 0..BUCKETS {
            assert_eq!(m & (1 << b) != 0, !differ.contains(&b), "bucket {b}");
        }
        assert_eq!(ours.matched("garbage"), 0);
        let whole = Digest::of(pairs.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let small = Digest::of([("x", "1")]);
        let o = offer(
            [
                ("t/big", whole, &theirs),
                ("t/small", small, &Buckets::default()),
            ],
            BUCKETS_FROM,
        );
        let parsed = parse_offer(&o);
        assert_eq!(parsed.len(), 3, "the small type is offered whole only: {o}");
        assert_eq!(parsed[1].0, "t/big#buckets");
        assert_eq!(theirs.matched(parsed[1].1), u64::MAX);
        assert_eq!(ours.agree(&theirs), m);
        let answer = format!("t/small,t/big{BUCKETS_SUFFIX}={m:x}");
        assert_eq!(parse_matched_buckets(&answer), [("t/big", m)]);
        let mut initial = std::collections::HashMap::new();
        assert_eq!(relied(&initial), None);
        initial.insert(RELIED.to_string(), format!("{m:x}"));
        assert_eq!(relied(&initial), Some(m));
    }

    #[test]
    fn an_offer_reads_back() {
        let none = Buckets::default();
        let o = offer(
            [
                ("t/a", Digest::of([("x", "1")]), &none),
                ("t/b", Digest::default(), &none),
            ],
            BUCKETS_FROM,
        );
        let parsed = parse_offer(&o);
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[1], ("t/b", "0:0000000000000000"));
        assert_eq!(parse_matched("t/a,t/b"), ["t/a", "t/b"]);
        assert!(parse_matched("").is_empty());
    }
}
