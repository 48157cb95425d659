//! The agent's side of the digest resume (`shared_proto::resume`): the digest of each
//! type of the current snapshot, as (name, wire version) pairs, kept per snapshot and
//! carried from one snapshot to the next by what changed, so that answering a relay's
//! offer costs a comparison of five numbers.

use std::sync::{Arc, Mutex};

use aether_model::Snapshot;
use shared_proto::resume::{self, Digest};

use super::kind::{KIND_COUNT, KINDS, Kind, from_type_url, type_url, wire_version};

/// The digests of the last snapshot asked about.
#[derive(Default)]
pub struct Digests(Mutex<Option<(Arc<Snapshot>, [Digest; KIND_COUNT])>>);

fn full(s: &Snapshot, kind: Kind) -> Digest {
    let mut d = Digest::default();
    for (n, h) in s.hashes(kind) {
        d.add(n, &wire_version(*h));
    }
    d
}

impl Digests {
    /// The digest of each type of `s`: from the last snapshot's and what changed since,
    /// or, without a history that reaches it, from every resource.
    pub fn of(&self, s: &Arc<Snapshot>) -> [Digest; KIND_COUNT] {
        let mut cache = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((last, d)) = cache.as_ref()
            && Arc::ptr_eq(last, s)
        {
            return *d;
        }
        let mut out = [Digest::default(); KIND_COUNT];
        for kind in KINDS {
            let carried = cache.as_ref().and_then(|(last, d)| {
                let changed = s.changed_since(last, kind)?;
                let mut d = d[kind.index()];
                let (old, new) = (last.hashes(kind), s.hashes(kind));
                for n in changed {
                    if let Some(h) = old.get(n) {
                        d.remove(n, &wire_version(*h));
                    }
                    if let Some(h) = new.get(n) {
                        d.add(n, &wire_version(*h));
                    }
                }
                Some(d)
            });
            out[kind.index()] = carried.unwrap_or_else(|| full(s, kind));
        }
        *cache = Some((s.clone(), out));
        out
    }

    /// The answer to a relay's offer: the types whose digest equals `s`'s, as the
    /// response header names them.
    pub fn matched(&self, s: &Arc<Snapshot>, offer: &str) -> Vec<Kind> {
        let ours = self.of(s);
        resume::parse_offer(offer)
            .into_iter()
            .filter_map(|(url, digest)| {
                let kind = from_type_url(url)?;
                (ours[kind.index()].encode() == digest).then_some(kind)
            })
            .collect()
    }
}

/// The response header's value for `kinds`.
pub fn header(kinds: &[Kind]) -> String {
    kinds
        .iter()
        .map(|k| type_url(*k))
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

    fn offer(ds: &[Digest; KIND_COUNT]) -> String {
        resume::offer(KINDS.into_iter().map(|k| (type_url(k), ds[k.index()])))
    }

    #[test]
    fn digests_carried_by_what_changed_equal_digests_from_scratch_and_answer_an_offer() {
        let mut b = Builder::new(Inputs {
            registry: RegistryView::new((0..20).map(|i| svc(&format!("s{i}"), "10.0.0.1"))),
            ..Default::default()
        });
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
        let carried = digests.of(&next);
        for k in KINDS {
            assert_eq!(carried[k.index()], full(&next, k), "{k:?}");
        }
        assert_ne!(carried, at_first);
        // An offer of the first snapshot's digests, against the next: CDS and EDS
        // changed, the listeners and routes did not.
        let matched = digests.matched(&next, &offer(&at_first));
        assert!(!matched.contains(&Kind::Cluster) && !matched.contains(&Kind::Endpoint));
        assert_eq!(digests.matched(&next, &offer(&carried)).len(), KIND_COUNT);
        assert!(digests.matched(&next, "garbage").is_empty());
    }
}
