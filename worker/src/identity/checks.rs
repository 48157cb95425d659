//! What the node's SVIDs say about its health, looked at after each change and every
//! 10 s: the pods without an SVID (in strict mode they have no inbound listener) and the
//! SVIDs past 80 % of their lifetime with no renewal. [`evaluate`] is pure, its clock
//! passed in; [`run`] turns its findings into gauges, `/ready` problems and log lines.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use aether_model::{Inputs, MtlsMode, Svid};
use tracing::{info, warn};

use crate::health::{PodWait, Reporter};
use crate::metrics::Metrics;
use crate::node::Node;

/// The problem source of a strict-mode pod without its SVID, one problem per pod.
pub const PROBLEM_NO_SVID: &str = "pod-svid";
/// The problem source of SVIDs near expiry.
pub const PROBLEM_EXPIRING: &str = "svid-expiry";
/// How often the findings are looked at again with no change to the node: expiry comes
/// with time alone.
const EVERY: Duration = Duration::from_secs(10);
/// How many pods a `/ready` problem list names before it counts the rest.
const LISTED: usize = 20;
/// How many pods `/ready`'s `identity.pods_without_svid` lists (the longest waiting).
pub const READY_LISTED: usize = 50;

/// The uids of the local pods without an SVID.
pub fn lacking_svids(inputs: &Inputs) -> BTreeSet<String> {
    inputs
        .pods
        .keys()
        .filter(|uid| !inputs.identity.pods.contains_key(*uid))
        .cloned()
        .collect()
}

/// A pod as logs and `/ready` name it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodName {
    pub uid: String,
    /// `namespace/name`.
    pub name: String,
}

/// One SVID past its renewal point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiring {
    /// `the agent (spiffe://...)` or `pod ns/name`.
    pub holder: String,
    pub not_after: u64,
    pub expired: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub without_svid: Vec<PodName>,
    pub with_svid: usize,
    pub expiring: Vec<Expiring>,
}

/// The findings at `now` (unix seconds). An SVID is expiring from [`Svid::renew_by`] on;
/// only the SVIDs the inputs hold count, so a renewal that came clears it.
pub fn evaluate(inputs: &Inputs, now: u64) -> Findings {
    let mut f = Findings::default();
    let expiring = |holder: String, s: &Svid| {
        (now >= s.renew_by()).then_some(Expiring {
            holder,
            not_after: s.not_after,
            expired: now >= s.not_after,
        })
    };
    if let Some(agent) = &inputs.identity.agent {
        f.expiring
            .extend(expiring(format!("the agent ({})", agent.spiffe_id), agent));
    }
    for (uid, pod) in &inputs.pods {
        match inputs.identity.pods.get(uid) {
            Some(s) => {
                f.with_svid += 1;
                f.expiring
                    .extend(expiring(format!("pod {}/{}", pod.namespace, pod.name), s));
            }
            None => f.without_svid.push(PodName {
                uid: uid.clone(),
                name: format!("{}/{}", pod.namespace, pod.name),
            }),
        }
    }
    f
}

/// Since when each pod of `without` has waited for its SVID (unix seconds): a pod already
/// waiting in `before` keeps its time, a new one starts at `now`, and a pod no longer
/// waiting is dropped. Bounded by the node's pods.
pub fn waits(
    before: &BTreeMap<String, u64>,
    without: &[PodName],
    now: u64,
) -> BTreeMap<String, u64> {
    without
        .iter()
        .map(|p| (p.uid.clone(), before.get(&p.uid).copied().unwrap_or(now)))
        .collect()
}

/// `/ready`'s list of the pods waiting for their SVID: the longest waiting first (then by
/// name), at most [`READY_LISTED`].
pub fn waiting_list(without: &[PodName], since: &BTreeMap<String, u64>) -> Vec<PodWait> {
    let mut list: Vec<PodWait> = without
        .iter()
        .map(|p| PodWait {
            pod: p.name.clone(),
            since: since.get(&p.uid).copied().unwrap_or_default(),
        })
        .collect();
    list.sort_by(|a, b| (a.since, &a.pod).cmp(&(b.since, &b.pod)));
    list.truncate(READY_LISTED);
    list
}

/// The `/ready` message of the expiring SVIDs, None when there are none.
pub fn expiring_message(expiring: &[Expiring], now: u64) -> Option<String> {
    if expiring.is_empty() {
        return None;
    }
    let mut parts: Vec<String> = expiring
        .iter()
        .take(LISTED)
        .map(|e| {
            if e.expired {
                format!("{} expired {} s ago", e.holder, now - e.not_after)
            } else {
                format!("{} expires in {} s", e.holder, e.not_after - now)
            }
        })
        .collect();
    if expiring.len() > LISTED {
        parts.push(format!("and {} more", expiring.len() - LISTED));
    }
    Some(format!(
        "SVIDs past 80 % of their lifetime with no renewal from the identity provider: {}",
        parts.join("; ")
    ))
}

/// The strict-mode problem of one pod.
pub fn no_svid_message(pod: &PodName) -> String {
    format!(
        "pod {} has no SVID yet: strict mTLS holds its inbound listener back",
        pod.name
    )
}

/// Looks at the node after each change and every [`EVERY`], until the task is aborted.
pub async fn run(node: Arc<Node>, mode: MtlsMode, metrics: Arc<Metrics>, problems: Reporter) {
    let mut snapshots = node.subscribe();
    // Pods already logged as held back (strict), and the expiring holders already warned of.
    let mut logged: BTreeMap<String, String> = BTreeMap::new();
    let mut warned: BTreeSet<String> = BTreeSet::new();
    // Since when each pod without its SVID has waited, by uid.
    let mut since: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        let now = unix_now();
        let f = node.with_inputs(|i| evaluate(i, now));
        since = waits(&since, &f.without_svid, now);
        let oldest = since.values().min().map_or(0, |s| now.saturating_sub(*s));
        metrics.pods_without_svid.set(f.without_svid.len() as i64);
        metrics.pod_svid_missing_oldest_seconds.set(oldest as i64);
        metrics.svids_expiring.set(f.expiring.len() as i64);
        let waiting = waiting_list(&f.without_svid, &since);
        problems.identity(|s| {
            s.pods_with_svid = f.with_svid;
            s.pods_without_svid = waiting;
            s.pods_without_svid_count = f.without_svid.len();
            s.svids_expiring = f.expiring.len();
        });
        if mode == MtlsMode::Strict {
            let now_lacking: BTreeMap<String, String> = f
                .without_svid
                .iter()
                .map(|p| (p.uid.clone(), p.name.clone()))
                .collect();
            for p in &f.without_svid {
                if !logged.contains_key(&p.uid) {
                    warn!(uid = %p.uid, pod = %p.name, "pod has no SVID yet: strict mTLS holds its inbound listener back until it comes");
                }
            }
            for (uid, name) in &logged {
                if !now_lacking.contains_key(uid) {
                    info!(uid = %uid, pod = %name, "pod's SVID came (or the pod left): strict mTLS hold over");
                }
            }
            logged = now_lacking;
            let mut listed: Vec<String> = f
                .without_svid
                .iter()
                .take(LISTED)
                .map(no_svid_message)
                .collect();
            if f.without_svid.len() > LISTED {
                listed.push(format!("and {} more pods have no SVID yet: strict mTLS holds their inbound listeners back", f.without_svid.len() - LISTED));
            }
            problems.set_each(PROBLEM_NO_SVID, listed);
        }
        match expiring_message(&f.expiring, now) {
            Some(message) => {
                let holders: BTreeSet<String> =
                    f.expiring.iter().map(|e| e.holder.clone()).collect();
                if holders != warned {
                    warn!(svids = %message, "SVIDs near expiry");
                }
                warned = holders;
                problems.set(PROBLEM_EXPIRING, message);
            }
            None => {
                if !warned.is_empty() {
                    info!("no SVID is near expiry any more");
                }
                warned.clear();
                problems.clear(PROBLEM_EXPIRING);
            }
        }
        tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(EVERY) => {}
        }
    }
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use aether_model::{Identity, Pod};

    use super::*;

    fn svid(id: &str, not_before: u64, not_after: u64) -> Svid {
        Svid {
            spiffe_id: id.into(),
            chain_pem: String::new(),
            key_pem: String::new(),
            serial: "01".into(),
            not_before,
            not_after,
        }
    }

    fn inputs(pods: &[(&str, Option<Svid>)], agent: Option<Svid>) -> Inputs {
        let mut i = Inputs {
            identity: Identity {
                trust_domain: Some("t".into()),
                agent,
                ..Identity::default()
            },
            ..Inputs::default()
        };
        for (uid, s) in pods {
            let pod = Pod {
                uid: uid.to_string(),
                namespace: "ns".into(),
                name: format!("p-{uid}"),
                container_id: "c".into(),
                netns: "/n".into(),
                ifname: "eth0".into(),
                ips: vec![],
                terminating: false,
                no_quic_twin: false,
            };
            i.pods.insert(uid.to_string(), pod);
            if let Some(s) = s {
                i.identity.pods.insert(uid.to_string(), s.clone());
            }
        }
        i
    }

    #[test]
    fn pods_without_an_svid_are_found_by_uid() {
        let i = inputs(
            &[("a", Some(svid("x", 0, 100))), ("b", None), ("c", None)],
            None,
        );
        assert_eq!(lacking_svids(&i), ["b", "c"].map(String::from).into());
        let f = evaluate(&i, 0);
        assert_eq!(f.with_svid, 1);
        assert_eq!(
            f.without_svid,
            vec![
                PodName {
                    uid: "b".into(),
                    name: "ns/p-b".into()
                },
                PodName {
                    uid: "c".into(),
                    name: "ns/p-c".into()
                }
            ]
        );
        assert_eq!(
            no_svid_message(&f.without_svid[0]),
            "pod ns/p-b has no SVID yet: strict mTLS holds its inbound listener back"
        );
    }

    /// The clock is passed in: an SVID valid 1000..2000 renews by 1800.
    #[test]
    fn svids_expire_from_eighty_percent_of_their_lifetime_until_renewed() {
        let agent = svid("spiffe://t/agent", 1000, 2000);
        let i = inputs(
            &[
                ("a", Some(svid("spiffe://t/a", 1000, 2000))),
                ("b", Some(svid("spiffe://t/b", 1500, 2500))),
            ],
            Some(agent),
        );
        let holders = |now| {
            evaluate(&i, now)
                .expiring
                .into_iter()
                .map(|e| (e.holder, e.expired))
                .collect::<Vec<_>>()
        };
        assert!(holders(1799).is_empty());
        assert_eq!(
            holders(1800),
            [
                ("the agent (spiffe://t/agent)".to_string(), false),
                ("pod ns/p-a".to_string(), false)
            ]
        );
        assert_eq!(holders(2000).len(), 2, "b renews by 2300");
        assert!(holders(2000).iter().all(|(_, expired)| *expired));
        assert_eq!(holders(2300).len(), 3);
        let f = evaluate(&i, 1900);
        assert_eq!(
            expiring_message(&f.expiring, 1900).unwrap(),
            "SVIDs past 80 % of their lifetime with no renewal from the identity provider: the agent (spiffe://t/agent) expires in 100 s; pod ns/p-a expires in 100 s"
        );
        let f = evaluate(&i, 2010);
        assert!(
            expiring_message(&f.expiring, 2010)
                .unwrap()
                .contains("pod ns/p-a expired 10 s ago")
        );
        // A renewal clears it.
        let renewed = inputs(
            &[
                ("a", Some(svid("spiffe://t/a", 1900, 2900))),
                ("b", Some(svid("spiffe://t/b", 1500, 2500))),
            ],
            Some(svid("spiffe://t/agent", 1900, 2900)),
        );
        assert!(evaluate(&renewed, 1900).expiring.is_empty());
        assert_eq!(expiring_message(&[], 1900), None);
    }

    fn named(uid: &str) -> PodName {
        PodName {
            uid: uid.into(),
            name: format!("ns/{uid}"),
        }
    }

    /// A pod keeps the time it started waiting while it waits; one whose SVID came
    /// leaves, and comes back with a new time. `/ready` lists the longest waiting first,
    /// at most fifty of them.
    #[test]
    fn waits_keep_their_start_and_ready_lists_the_longest_fifty() {
        let first = waits(&BTreeMap::new(), &[named("a"), named("b")], 100);
        assert_eq!(
            first,
            BTreeMap::from([("a".into(), 100), ("b".into(), 100)])
        );
        let later = waits(&first, &[named("b"), named("c")], 130);
        assert_eq!(
            later,
            BTreeMap::from([("b".into(), 100), ("c".into(), 130)])
        );
        let back = waits(&later, &[named("a"), named("b")], 160);
        assert_eq!(back["a"], 160, "a's SVID came and went: a new wait");
        assert_eq!(
            waiting_list(&[named("a"), named("b")], &back),
            [
                PodWait {
                    pod: "ns/b".into(),
                    since: 100
                },
                PodWait {
                    pod: "ns/a".into(),
                    since: 160
                }
            ]
        );
        let many: Vec<PodName> = (0..60).map(|n| named(&format!("p{n:02}"))).collect();
        let since: BTreeMap<String, u64> = many
            .iter()
            .enumerate()
            .map(|(n, p)| (p.uid.clone(), 1000 - n as u64))
            .collect();
        let list = waiting_list(&many, &since);
        assert_eq!(list.len(), READY_LISTED);
        assert_eq!(list[0].pod, "ns/p59", "the longest waiting first");
        assert_eq!(list[49].pod, "ns/p10");
    }

    #[test]
    fn a_long_list_names_twenty_and_counts_the_rest() {
        let e: Vec<Expiring> = (0..25)
            .map(|n| Expiring {
                holder: format!("pod ns/p{n}"),
                not_after: 100,
                expired: false,
            })
            .collect();
        let m = expiring_message(&e, 90).unwrap();
        assert!(
            m.contains("pod ns/p19 ") && !m.contains("pod ns/p20 ") && m.ends_with("and 5 more"),
            "{m}"
        );
    }
}
