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

/// A pair's hash: FNV-1a over the name, a separator and the version, then a 64-bit
/// finaliser (so that the sum of many mixes every bit).
pub fn pair_hash(name: &str, version: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes().chain([0xff]).chain(version.bytes()) {
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
        self.count += 1;
        self.sum = self.sum.wrapping_add(pair_hash(name, version));
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

/// The relay's offer: `TYPE_URL=COUNT:DIGEST,...`.
pub fn offer<'a>(digests: impl IntoIterator<Item = (&'a str, Digest)>) -> String {
    digests
        .into_iter()
        .map(|(t, d)| format!("{t}={}", d.encode()))
        .collect::<Vec<_>>()
        .join(",")
}

/// An offer read back: (type URL, `COUNT:DIGEST`) pairs; a malformed entry is left out.
pub fn parse_offer(header: &str) -> Vec<(&str, &str)> {
    header
        .split(',')
        .filter_map(|e| e.split_once('='))
        .collect()
}

/// The agent's answer read back: the type URLs it matched.
pub fn parse_matched(header: &str) -> Vec<&str> {
    header.split(',').filter(|t| !t.is_empty()).collect()
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
    fn an_offer_reads_back() {
        let o = offer([
            ("t/a", Digest::of([("x", "1")])),
            ("t/b", Digest::default()),
        ]);
        let parsed = parse_offer(&o);
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[1], ("t/b", "0:0000000000000000"));
        assert_eq!(parse_matched("t/a,t/b"), ["t/a", "t/b"]);
        assert!(parse_matched("").is_empty());
    }
}
