//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection
//! does it: the holder renews `renewTime` every retry period; another replica takes the
//! Lease over once the record it last saw has not changed for a whole lease duration.
//! Expiry is judged by the local monotonic clock from when the record was seen to change,
//! never by comparing `renewTime` with the local wall clock, so clock skew between nodes
//! does not matter. Every write is a replace at the resourceVersion read (a 409 means
//! another replica wrote first).
//!
//! A leader stops writing as soon as its last successful renewal is older than the renew
//! deadline (two thirds of the lease duration): it gives the Lease up on its own before
//! any other replica may take it. On SIGTERM the leader releases the Lease, so that a
//! rolling update hands over without waiting for expiry.
//!
//! [`decide`] is the pure rule; [`run`] reads and writes the Lease and publishes whether
//! this replica leads.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;

/// The Lease and this replica's part in it.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's `holderIdentity`.
    pub identity: String,
    pub duration: Duration,
}

impl LeaseConfig {
    /// Between attempts to renew or acquire.
    pub fn retry_period(&self) -> Duration {
        (self.duration / 5).max(Duration::from_millis(50))
    }

    /// A leader whose last renewal is older than this stops leading.
    pub fn renew_deadline(&self) -> Duration {
        self.duration * 2 / 3
    }
}

/// What the record looked like when last seen, and when that was (local clock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub holder: String,
    pub renew_time: Option<Timestamp>,
    /// The holder's lease duration, as it wrote it.
    pub duration: Duration,
    /// When this replica first saw the record as it is.
    pub since: Instant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No Lease: create it, holding it.
    Create,
    /// Ours: renew it.
    Renew,
    /// Another's, expired or released: take it over.
    Acquire,
    /// Another's, live: wait.
    Follow { holder: String },
}

/// The record as seen now, keeping the time it was first seen if it has not changed.
pub fn observe(
    previous: Option<&Observed>,
    spec: &LeaseSpec,
    default_duration: Duration,
    now: Instant,
) -> Observed {
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let renew_time = spec.renew_time.as_ref().map(|t| t.0);
    let duration = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(default_duration, Duration::from_secs);
    let since = match previous {
        Some(p) if p.holder == holder && p.renew_time == renew_time => p.since,
        _ => now,
    };
    Observed {
        holder,
        renew_time,
        duration,
        since,
    }
}

/// What to do with the Lease as observed.
pub fn decide(me: &str, observed: Option<&Observed>, now: Instant) -> Decision {
    let Some(o) = observed else {
        return Decision::Create;
    };
    if o.holder == me {
        Decision::Renew
    } else if o.holder.is_empty() || now.duration_since(o.since) >= o.duration {
        Decision::Acquire
    } else {
        Decision::Follow {
            holder: o.holder.clone(),
        }
    }
}

fn micro_now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// `spec` as written by `me` holding the Lease; `acquired` when newly taken.
fn held(cfg: &LeaseConfig, spec: Option<&LeaseSpec>, acquired: bool) -> LeaseSpec {
    let mut s = spec.cloned().unwrap_or_default();
    let now = micro_now();
    if acquired {
        s.acquire_time = Some(now.clone());
        s.lease_transitions = Some(
            s.lease_transitions
                .unwrap_or(0)
                .saturating_add(i32::from(s.holder_identity.is_some())),
        );
    }
    s.holder_identity = Some(cfg.identity.clone());
    s.lease_duration_seconds =
        Some(i32::try_from(cfg.duration.as_secs().max(1)).unwrap_or(i32::MAX));
    s.renew_time = Some(now);
    s
}

/// Leadership as published: `Some(deadline)` while this replica leads, where `deadline`
/// is when its last renewal stops counting. A writer checks [`leads`] before each write,
/// so a leader stalled past its deadline writes nothing even before the flag is lowered.
pub type Leadership = watch::Receiver<Option<Instant>>;

/// Whether this replica leads now.
pub fn leads(l: &Leadership) -> bool {
    l.borrow().is_some_and(|deadline| Instant::now() < deadline)
}

/// Keeps trying to lead until `stop` is set; publishes leadership on `tx`. Releases the
/// Lease on the way out if held.
pub async fn run(
    api: Api<Lease>,
    cfg: LeaseConfig,
    tx: watch::Sender<Option<Instant>>,
    mut stop: watch::Receiver<bool>,
) {
    // Each request is bounded, so that a hung API server cannot keep a leader past its
    // deadline unnoticed.
    let bound = cfg.retry_period();
    let mut observed: Option<Observed> = None;
    let mut current: Option<Lease> = None;
    // The last successful write as leader; leading while it is within the renew deadline.
    let mut renewed: Option<Instant> = None;
    let mut said_follow = String::new();
    loop {
        let now = Instant::now();
        if renewed.is_some_and(|at| now.duration_since(at) >= cfg.renew_deadline()) {
            tracing::warn!(lease = %format!("{}/{}", cfg.namespace, cfg.name), "could not renew the Lease within the renew deadline; stopping as leader");
            renewed = None;
            tx.send_replace(None);
        }
        match tokio::time::timeout(bound, api.get_opt(&cfg.name))
            .await
            .unwrap_or_else(|_| Err(timed_out()))
        {
            Ok(lease) => {
                observed = lease.as_ref().map(|l| {
                    observe(
                        observed.as_ref(),
                        l.spec.as_ref().unwrap_or(&LeaseSpec::default()),
                        cfg.duration,
                        now,
                    )
                });
                current = lease;
            }
            Err(e) => {
                tracing::warn!(lease = %format!("{}/{}", cfg.namespace, cfg.name), error = %e, "reading the Lease failed")
            }
        }
        let write = match decide(&cfg.identity, observed.as_ref(), now) {
            Decision::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(cfg.name.clone()),
                        namespace: Some(cfg.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(held(&cfg, None, true)),
                };
                Some(
                    tokio::time::timeout(bound, api.create(&PostParams::default(), &lease))
                        .await
                        .unwrap_or_else(|_| Err(timed_out())),
                )
            }
            d @ (Decision::Renew | Decision::Acquire) => {
                let mut lease = current
                    .clone()
                    .expect("a decision to renew or acquire is made on a read Lease");
                lease.spec = Some(held(&cfg, lease.spec.as_ref(), d == Decision::Acquire));
                Some(
                    tokio::time::timeout(
                        bound,
                        api.replace(&cfg.name, &PostParams::default(), &lease),
                    )
                    .await
                    .unwrap_or_else(|_| Err(timed_out())),
                )
            }
            Decision::Follow { holder } => {
                if holder != said_follow {
                    tracing::info!(holder = %holder, "another replica holds the Lease; following");
                    said_follow = holder;
                }
                if renewed.take().is_some() {
                    tx.send_replace(None);
                }
                None
            }
        };
        match write {
            Some(Ok(lease)) => {
                if renewed.is_none() {
                    tracing::info!(lease = %format!("{}/{}", cfg.namespace, cfg.name), identity = %cfg.identity, "leading: this replica writes discovery and guards the taint");
                    said_follow.clear();
                }
                renewed = Some(now);
                observed = Some(observe(
                    None,
                    lease.spec.as_ref().unwrap_or(&LeaseSpec::default()),
                    cfg.duration,
                    now,
                ));
                current = Some(lease);
                tx.send_replace(Some(now + cfg.renew_deadline()));
            }
            Some(Err(kube::Error::Api(s))) if s.code == 409 => {
                tracing::debug!(message = %s.message, "another replica wrote the Lease first")
            }
            Some(Err(e)) => {
                tracing::warn!(lease = %format!("{}/{}", cfg.namespace, cfg.name), error = %e, "writing the Lease failed")
            }
            None => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(cfg.retry_period()) => {}
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    if renewed.is_some() {
        tx.send_replace(None);
        release(&api, &cfg, current).await;
    }
}

fn timed_out() -> kube::Error {
    kube::Error::Service(Box::new(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no answer from the API server within the retry period",
    )))
}

/// Gives the Lease up: no holder, so that another replica acquires it at once.
async fn release(api: &Api<Lease>, cfg: &LeaseConfig, current: Option<Lease>) {
    let Some(mut lease) = current else { return };
    if let Some(spec) = lease.spec.as_mut() {
        spec.holder_identity = None;
        spec.renew_time = Some(micro_now());
    }
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => {
            tracing::info!(lease = %format!("{}/{}", cfg.namespace, cfg.name), "released the Lease")
        }
        Err(e) => {
            tracing::warn!(error = %e, "releasing the Lease failed; another replica takes it once it expires")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: &str, renew_secs: i64) -> LeaseSpec {
        LeaseSpec {
            holder_identity: (!holder.is_empty()).then(|| holder.to_owned()),
            renew_time: Some(MicroTime(Timestamp::from_second(renew_secs).unwrap())),
            lease_duration_seconds: Some(10),
            ..Default::default()
        }
    }

    #[test]
    fn a_replica_creates_renews_follows_and_takes_over_once_the_record_stood_still_a_lease_duration()
     {
        let t0 = Instant::now();
        let s = |d: u64| t0 + Duration::from_secs(d);
        assert_eq!(decide("a", None, t0), Decision::Create);

        let ours = observe(None, &spec("a", 100), Duration::from_secs(15), t0);
        assert_eq!(
            ours.duration,
            Duration::from_secs(10),
            "the holder's duration counts"
        );
        assert_eq!(
            decide("a", Some(&ours), s(60)),
            Decision::Renew,
            "our own Lease is renewed however old"
        );

        // b's record, seen at t0 and renewed at 5 s: the clock restarts at each change.
        let theirs = observe(None, &spec("b", 100), Duration::from_secs(15), t0);
        assert_eq!(
            decide("a", Some(&theirs), s(9)),
            Decision::Follow { holder: "b".into() }
        );
        let renewed = observe(
            Some(&theirs),
            &spec("b", 105),
            Duration::from_secs(15),
            s(5),
        );
        assert_eq!(renewed.since, s(5));
        assert_eq!(
            decide("a", Some(&renewed), s(14)),
            Decision::Follow { holder: "b".into() }
        );
        assert_eq!(decide("a", Some(&renewed), s(15)), Decision::Acquire);
        // The same record seen again keeps its first sighting.
        let same = observe(
            Some(&renewed),
            &spec("b", 105),
            Duration::from_secs(15),
            s(12),
        );
        assert_eq!(same.since, s(5));

        // A released Lease (no holder) is taken at once; so is one whose wall-clock
        // renewTime is far in the future (skew does not matter: only changes do).
        let released = observe(
            Some(&renewed),
            &spec("", 106),
            Duration::from_secs(15),
            s(6),
        );
        assert_eq!(decide("a", Some(&released), s(6)), Decision::Acquire);
        let future = observe(
            None,
            &spec("b", 100_000_000_000),
            Duration::from_secs(15),
            t0,
        );
        assert_eq!(decide("a", Some(&future), s(10)), Decision::Acquire);
    }

    #[test]
    fn a_leader_stops_before_another_may_take_over() {
        let cfg = LeaseConfig {
            namespace: "ns".into(),
            name: "l".into(),
            identity: "a".into(),
            duration: Duration::from_secs(15),
        };
        assert!(cfg.renew_deadline() < cfg.duration);
        assert!(
            cfg.retry_period() * 3 <= cfg.renew_deadline(),
            "several renewals fit in the deadline"
        );
        let taken = held(&cfg, Some(&spec("b", 100)), true);
        assert_eq!(
            (
                taken.holder_identity.as_deref(),
                taken.lease_transitions,
                taken.lease_duration_seconds
            ),
            (Some("a"), Some(1), Some(15))
        );
        let first = held(&cfg, None, true);
        assert_eq!(first.lease_transitions, Some(0));
    }
}
