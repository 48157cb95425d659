//! The protobuf encoding of every resource the node serves, shared by all streams.
//!
//! Each entry is keyed by resource type and name and holds for as long as the resource's
//! content hash (its version) does: the same name and hash is the same content, so the
//! same bytes. A push therefore encodes only what changed since the resource was last
//! encoded; a state-of-the-world push of every listener and cluster, as each pod's ADD
//! sends, copies the rest. [`keep_warm`] encodes each snapshot as the node publishes it,
//! in a standby too, so that a new owner answers the proxy's reconnect with copies; it
//! looks only at what changed since the snapshot it warmed last. At 10,000 services a
//! standby's warm-up may still be encoding when the node is handed to it: a push never
//! waits for it (see [`Encoded::get`]).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, TryLockError};

use aether_model::Snapshot;
use envoy_types::pb::google::protobuf::Any;
use tokio::sync::watch;

use super::convert;
use super::kind::{KIND_COUNT, KINDS, Kind};

#[derive(Default)]
pub struct Encoded {
    /// Per [`Kind::index`]: name to (content hash, encoding).
    types: Mutex<[HashMap<String, (u64, Any)>; KIND_COUNT]>,
    /// The digests a relay's resume offer is answered from, kept by [`keep_warm`] for
    /// each snapshot, in a standby too: a surge's new owner answers the offer with a
    /// comparison instead of a digest of every resource (3 ms at 10,000 services idle,
    /// 6 ms in a roll).
    pub digests: super::digest::Digests,
}

/// Encodes one resource of `s`, if `s` has it.
fn convert_one(s: &Snapshot, kind: Kind, name: &str) -> Option<Any> {
    Some(match kind {
        Kind::Cluster => convert::cluster(s.clusters.get(name)?),
        Kind::Endpoint => convert::load_assignment(s.endpoints.get(name)?),
        Kind::Listener => convert::listener(s.listeners.get(name)?),
        Kind::Route => convert::route_config(s.routes.get(name)?),
        Kind::Secret => convert::secret(s.secrets.get(name)?),
    })
}

impl Encoded {
    /// Encodes whatever of `s` is not cached yet, and forgets what `s` no longer holds.
    /// With `since`, the snapshot warmed before, only the names changed in between are
    /// looked at (everything when the history does not reach back). The encoding itself
    /// runs without the lock, so a stream's push never waits for a large warm-up.
    pub fn warm(&self, s: &Snapshot, since: Option<&Snapshot>) {
        let missing = self.plan(s, since);
        self.fill(s, missing);
    }

    /// The first half of [`Encoded::warm`], under the lock: drops what `s` no longer
    /// holds (or holds at another version) and lists what to encode, as (type, name,
    /// hash).
    pub fn plan(&self, s: &Snapshot, since: Option<&Snapshot>) -> Vec<(Kind, String, u64)> {
        let mut missing = Vec::new();
        let mut types = self.types.lock().expect("encoded resources lock");
        for kind in KINDS {
            let current = s.hashes(kind);
            let changed = since.and_then(|old| s.changed_since(old, kind));
            let cache = &mut types[kind.index()];
            let mut look =
                |cache: &mut HashMap<String, (u64, Any)>, name: &str| match current.get(name) {
                    Some(hash) if cache.get(name).is_none_or(|(h, _)| h != hash) => {
                        missing.push((kind, name.to_string(), *hash))
                    }
                    Some(_) => {}
                    None => {
                        cache.remove(name);
                    }
                };
            match &changed {
                Some(names) => names.iter().for_each(|n| look(cache, n)),
                None => {
                    cache.retain(|name, (hash, _)| current.get(name) == Some(hash));
                    current.keys().for_each(|n| look(cache, n));
                }
            }
        }
        missing
    }

    /// The second half of [`Encoded::warm`]: encodes `missing` (of `s`, as
    /// [`Encoded::plan`] listed it) without the lock, then caches what is still current.
    /// The warm-up sends a plan's list in chunks (see [`keep_warm`]).
    pub fn fill(&self, s: &Snapshot, missing: impl IntoIterator<Item = (Kind, String, u64)>) {
        let encoded: Vec<(Kind, String, u64, Any)> = missing
            .into_iter()
            .filter_map(|(kind, name, hash)| {
                let any = convert_one(s, kind, &name)?;
                Some((kind, name, hash, any))
            })
            .collect();
        if encoded.is_empty() {
            return;
        }
        let mut types = self.types.lock().expect("encoded resources lock");
        for (kind, name, hash, any) in encoded {
            // A push may have encoded a newer version meanwhile: keep the newer.
            if s.hashes(kind).get(&name) == Some(&hash) {
                types[kind.index()].insert(name, (hash, any));
            }
        }
    }

    /// The encodings of `names` (those `s` has), in name order, encoding and caching any
    /// that are missing or stale. A push never waits for the warm-up: while it holds the
    /// lock, the push encodes its resources itself and caches none.
    pub fn get(&self, s: &Snapshot, kind: Kind, names: &BTreeSet<&String>) -> Vec<Any> {
        let mut types = match self.types.try_lock() {
            Ok(types) => types,
            Err(TryLockError::WouldBlock) => {
                return names
                    .iter()
                    .filter_map(|name| convert_one(s, kind, name))
                    .collect();
            }
            Err(TryLockError::Poisoned(e)) => panic!("encoded resources lock: {e}"),
        };
        let cache = &mut types[kind.index()];
        let current = s.hashes(kind);
        names
            .iter()
            .filter_map(|name| {
                let hash = *current.get(*name)?;
                if let Some((h, any)) = cache.get(*name)
                    && *h == hash
                {
                    return Some(any.clone());
                }
                let any = convert_one(s, kind, name)?;
                cache.insert((*name).clone(), (hash, any.clone()));
                Some(any)
            })
            .collect()
    }

    /// How many resources are cached.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.types
            .lock()
            .expect("encoded resources lock")
            .iter()
            .map(HashMap::len)
            .sum()
    }
}

/// Resources a warm-up encodes in one job on the heavy-work thread: a registry look
/// waiting there runs after one such chunk, not after the whole warm-up (a standby's first
/// at 10,000 services encodes about 40,000 resources, 0.2 s on an idle machine and over
/// half a second on a busy one).
pub const WARM_CHUNK: usize = 1000;

/// How long an owner's first warm-up waits for the proxy's first ACK ([`WarmHold`]).
pub const FIRST_ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Holds an owner's first warm-up until the proxy has ACKed one of its snapshots, or a
/// proxy has started fresh (holding no cluster: it needs every resource), or
/// [`FIRST_ACK_WAIT`] has passed since the owner began to serve. An owner that took the node cold (a respawned worker,
/// a recreate's new agent) answers the proxy's reconnect, or the relay's resume, with
/// the few resources that changed, which it encodes itself; its warm-up (every
/// resource: at 10,000 services 0.2 s of a core idle, over 0.5 s busy) only competed for
/// the CPU with those answers. At 10,000 services behind the relay, a respawned worker's
/// answer to the relay's EDS re-statement took 6 to 27 ms with the warm-up running and 3
/// to 4 ms without. A standby warms at once: that is what its takeover answers from, and
/// once warm ([`WarmGate`]) it is not held after the takeover either.
pub struct WarmHold {
    pub status: watch::Receiver<crate::health::Status>,
    pub acks: watch::Receiver<Option<Arc<Snapshot>>>,
    pub fresh: watch::Receiver<bool>,
    pub done: bool,
    /// When the wait past serving ends, once the owner serves: kept across waits, since
    /// [`keep_warm`] leaves a wait for each snapshot published meanwhile.
    pub deadline: Option<tokio::time::Instant>,
}

impl WarmHold {
    async fn wait(&mut self) {
        if self.done || self.status.borrow().role != "owner" {
            return;
        }
        let (status, acks, fresh, deadline) = (
            &mut self.status,
            &mut self.acks,
            &mut self.fresh,
            &mut self.deadline,
        );
        // The wait counts from when this owner serves: a respawned worker takes the node
        // at once and then loads the mesh (1.1 s at 10,000 services through the
        // registrar), and a wait counted from its start ran out just as it began to answer
        // the relay's resume, which the warm-up then competed with.
        let past_serving = async {
            let _ = status
                .wait_for(|s| !matches!(s.phase, "building" | "standby-complete" | "reconciling"))
                .await;
            let at = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + FIRST_ACK_WAIT);
            tokio::time::sleep_until(at).await;
        };
        tokio::select! {
            _ = acks.wait_for(Option::is_some) => {}
            _ = fresh.wait_for(|f| *f) => {}
            () = past_serving => {
                tracing::debug!(waited = ?FIRST_ACK_WAIT, "no proxy ACK yet: warming the encodings anyway");
            }
        }
        self.done = true;
    }
}

/// Encodes every snapshot the node publishes, until the node is gone, an owner's first
/// after the proxy's first ACK ([`WarmHold`]); sets the warm gate after the first of
/// loaded inputs ([`WarmGate`]). Also keeps the `snapshot_seq` gauge.
pub async fn keep_warm(
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    metrics: Arc<crate::metrics::Metrics>,
    mut hold: WarmHold,
    mut gate: WarmGate,
) {
    let mut last: Option<Arc<Snapshot>> = None;
    loop {
        // Read before the snapshot: a gate is set after the change it stands for was
        // published, so a snapshot taken after the gate reads loaded holds the loaded
        // inputs.
        let loaded = gate.loaded();
        let started = std::time::Instant::now();
        let s = snapshots.borrow_and_update().clone();
        metrics.snapshot_seq.set(s.seq as i64);
        // Not held: an owner's first offer comes right after its first snapshot, and a
        // digest already under way is waited for, not repeated (`Digests::of` locks).
        let (e, next) = (encoded.clone(), s.clone());
        if crate::heavy::run(move || {
            e.digests.of(&next);
        })
        .await
        .is_err()
        {
            tracing::error!("resume digests failed; a relay's offer computes them");
        }
        // The names by bucket, for a bucket resume.
        let (e, next) = (encoded.clone(), s.clone());
        if crate::heavy::run(move || e.digests.index(&next))
            .await
            .is_err()
        {
            tracing::error!("the resume index failed; a bucket resume walks every name");
        }
        // Only a cold owner's first warm-up is held ([`WarmHold`]): one that warmed as a
        // standby (a surge's new owner) encodes what changed since. The digests and the
        // bucket index are not held, since a relay's resume answers from them: a cold
        // owner indexes each snapshot published while it waits (a respawned worker
        // publishes the mesh 200 to 300 ms after its start, and the relay's offer follows
        // within milliseconds).
        if !gate.marked && !hold.done {
            tokio::select! {
                biased;
                () = hold.wait() => {}
                changed = snapshots.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
            }
        } else if gate.marked && snapshots.has_changed().unwrap_or(false) {
            // A snapshot published meanwhile: its digests first, then the warm-up of it.
            // Not before the first warm-up of loaded inputs: a standby's readiness waits
            // for that one, and under churn the next snapshot may always be on its way.
            continue;
        }
        // Off the runtime thread: a standby's first warm-up at mesh scale encodes every
        // resource and must not hold up its gates. On the heavy-work thread, not the
        // blocking pool, behind any file look waiting there, and a chunk at a time: see
        // `crate::heavy`.
        if warm_in_chunks(&encoded, &s, last.take(), WARM_CHUNK)
            .await
            .is_err()
        {
            tracing::error!("encoding warm-up failed; streams encode on demand");
        }
        if loaded && !gate.marked {
            // Failed or not, once: a failed warm-up leaves the streams to encode on demand,
            // which must not hold a standby back for good.
            gate.mark(&s, started.elapsed());
        }
        last = Some(s);
        if snapshots.changed().await.is_err() {
            return;
        }
    }
}

/// A standby's readiness waits for its first warm-up of loaded inputs: the node's other
/// gates are read here, and the warm gate set through `mark` once the resume digests,
/// the bucket index and the encodings of a snapshot of loaded inputs are made. At 10,000
/// services that warm-up encodes about 40,000 resources after the other gates pass (0.2 s
/// idle, over 0.5 s busy); a surge's old owner, stopped at the standby's readiness, then
/// handed the node over while its successor still encoded, on the same cores as the roll.
/// An owner never waits for it (its first serve does not read the gate).
pub struct WarmGate {
    pub gates: watch::Receiver<aether_model::Gates>,
    pub set: Box<dyn Fn() + Send>,
    pub marked: bool,
}

impl WarmGate {
    /// The inputs a snapshot must hold to be worth warming for a takeover: the registry,
    /// the stored pods and the capture projection.
    fn loaded(&self) -> bool {
        let g = self.gates.borrow();
        g.registry_loaded && g.storage_loaded && g.capture_landed
    }

    fn mark(&mut self, s: &Snapshot, took: std::time::Duration) {
        self.marked = true;
        (self.set)();
        tracing::info!(
            snapshot = s.seq,
            clusters = s.clusters.len(),
            load_assignments = s.endpoints.len(),
            took_ms = took.as_secs_f64() * 1e3,
            "encodings warm"
        );
    }
}

/// [`Encoded::warm`] as jobs on the heavy-work thread: the plan, then `chunk` resources
/// a job.
async fn warm_in_chunks(
    encoded: &Arc<Encoded>,
    s: &Arc<Snapshot>,
    since: Option<Arc<Snapshot>>,
    chunk: usize,
) -> Result<(), crate::heavy::Panicked> {
    let (e, next) = (encoded.clone(), s.clone());
    let mut missing = crate::heavy::run(move || e.plan(&next, since.as_deref())).await?;
    while !missing.is_empty() {
        let (e, next) = (encoded.clone(), s.clone());
        missing = crate::heavy::run(move || {
            let from = missing.len().saturating_sub(chunk.max(1));
            e.fill(&next, missing.drain(from..));
            missing
        })
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use aether_model::{Builder, Change, Inputs, Pod, build};

    fn pod(n: u8) -> Pod {
        Pod {
            uid: format!("uid-{n}"),
            namespace: "default".into(),
            name: format!("pod-{n}"),
            container_id: format!("c{n}"),
            netns: format!("/var/run/netns/c{n}"),
            ifname: "eth0".into(),
            ips: vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))],
            terminating: false,
            no_quic_twin: false,
        }
    }

    fn snapshot(pods: &[u8]) -> Snapshot {
        build(&Inputs {
            pods: pods.iter().map(|n| (format!("uid-{n}"), pod(*n))).collect(),
            ..Inputs::default()
        })
    }

    fn all(s: &Snapshot, kind: Kind) -> Vec<Any> {
        let names: Vec<&String> = s.hashes(kind).keys().collect();
        names
            .iter()
            .map(|n| convert_one(s, kind, n).unwrap())
            .collect()
    }

    #[test]
    fn cached_encodings_equal_fresh_ones_across_snapshots() {
        let encoded = Encoded::default();
        let (s1, s2) = (snapshot(&[1, 2]), snapshot(&[2, 3]));
        encoded.warm(&s1, None);
        let warmed = encoded.len();
        assert!(warmed > 0);
        for s in [&s1, &s2, &s1] {
            for kind in KINDS {
                let names: BTreeSet<&String> = s.hashes(kind).keys().collect();
                assert_eq!(encoded.get(s, kind, &names), all(s, kind), "{kind:?}");
            }
        }
    }

    #[test]
    fn a_push_encodes_without_waiting_for_a_warm_up_that_holds_the_lock() {
        let encoded = Arc::new(Encoded::default());
        let s = snapshot(&[1, 2]);
        let names: Vec<String> = s.hashes(Kind::Listener).keys().cloned().collect();
        let fresh = Encoded::default().get(&s, Kind::Listener, &names.iter().collect());
        let held = encoded.types.lock().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (e, s2) = (encoded.clone(), s.clone());
        std::thread::spawn(move || {
            let names: Vec<String> = s2.hashes(Kind::Listener).keys().cloned().collect();
            let _ = tx.send(e.get(&s2, Kind::Listener, &names.iter().collect()));
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the push waited for the lock");
        assert_eq!(got, fresh);
        drop(held);
        assert_eq!(encoded.len(), 0, "nothing cached while the lock was held");
    }

    #[test]
    fn warming_forgets_what_the_snapshot_no_longer_holds() {
        let encoded = Encoded::default();
        encoded.warm(&snapshot(&[1, 2, 3]), None);
        let three = encoded.len();
        encoded.warm(&snapshot(&[1]), None);
        let one = encoded.len();
        assert!(one < three, "{one} entries after shrinking from {three}");
        let s = snapshot(&[1]);
        let names: BTreeSet<&String> = s.hashes(Kind::Listener).keys().collect();
        assert_eq!(
            encoded.get(&s, Kind::Listener, &names),
            all(&s, Kind::Listener)
        );
        // A name that is not in the snapshot gives nothing.
        let ghost = "inbound|uid-9".to_string();
        assert!(
            encoded
                .get(&s, Kind::Listener, &BTreeSet::from([&ghost]))
                .is_empty()
        );
    }

    #[test]
    fn warming_from_a_snapshot_history_looks_only_at_what_changed_and_matches_a_full_warm() {
        let mut b = Builder::new(Inputs {
            pods: [1, 2]
                .iter()
                .map(|n| (format!("uid-{n}"), pod(*n)))
                .collect(),
            ..Inputs::default()
        });
        let (step, full) = (Encoded::default(), Encoded::default());
        let mut last = b.snapshot().clone();
        step.warm(&last, None);
        for change in [
            Change::UpsertPod(pod(3)),
            Change::RemovePod("uid-1".into()),
            Change::UpsertPod(pod(4)),
        ] {
            let s = b.apply([change]).unwrap();
            step.warm(&s, Some(&last));
            last = s;
        }
        full.warm(&last, None);
        assert_eq!(step.len(), full.len());
        for kind in KINDS {
            let names: BTreeSet<&String> = last.hashes(kind).keys().collect();
            assert_eq!(step.get(&last, kind, &names), all(&last, kind), "{kind:?}");
        }
    }

    /// The warm-up in chunks, as the worker runs it, caches what one whole warm does:
    /// from nothing, and from a snapshot history with something gone and something new.
    #[tokio::test]
    async fn a_warm_up_in_chunks_caches_what_a_whole_one_does() {
        let mut b = Builder::new(Inputs {
            pods: (1..=6).map(|n| (format!("uid-{n}"), pod(n))).collect(),
            ..Inputs::default()
        });
        let first = b.snapshot().clone();
        let (chunked, whole) = (Arc::new(Encoded::default()), Encoded::default());
        let planned = chunked.plan(&first, None).len();
        assert!(
            planned > 6,
            "{planned} resources: more than two chunks of 3"
        );
        // `plan` listed them without encoding any.
        assert_eq!(chunked.len(), 0);
        warm_in_chunks(&chunked, &first, None, 3).await.unwrap();
        whole.warm(&first, None);
        assert_eq!((chunked.len(), whole.len()), (planned, planned));
        assert!(
            chunked.plan(&first, None).is_empty(),
            "nothing left to encode"
        );
        let next = b
            .apply([Change::RemovePod("uid-2".into()), Change::UpsertPod(pod(7))])
            .unwrap();
        warm_in_chunks(&chunked, &next, Some(first.clone()), 3)
            .await
            .unwrap();
        whole.warm(&next, Some(&first));
        assert_eq!(chunked.len(), whole.len());
        for kind in KINDS {
            let names: BTreeSet<&String> = next.hashes(kind).keys().collect();
            assert_eq!(
                chunked.get(&next, kind, &names),
                all(&next, kind),
                "{kind:?}"
            );
        }
    }

    /// A standby warms at once; an owner's first warm-up waits for the proxy's first ACK
    /// (or a fresh proxy, or [`FIRST_ACK_WAIT`] from when it serves), and later ones do
    /// not wait.
    #[tokio::test(start_paused = true)]
    async fn an_owners_first_warm_up_waits_for_the_proxys_first_ack() {
        let (status_tx, status) = watch::channel(crate::health::Status::new("n", "p"));
        let (acks_tx, acks) = watch::channel(None);
        let (_fresh_tx, fresh) = watch::channel(false);
        let mut hold = WarmHold {
            status,
            acks,
            fresh,
            done: false,
            deadline: None,
        };
        let quick = std::time::Duration::from_millis(1);
        assert!(
            tokio::time::timeout(quick, hold.wait()).await.is_ok(),
            "a standby"
        );
        assert!(!hold.done, "a standby's takeover is still to come");

        status_tx.send_modify(|s| s.role = "owner");
        assert!(
            tokio::time::timeout(quick, hold.wait()).await.is_err(),
            "an owner with no ACK waits"
        );
        let waiting = tokio::spawn(async move {
            hold.wait().await;
            hold
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        acks_tx.send_replace(Some(Arc::new(snapshot(&[1]))));
        let mut hold = waiting.await.unwrap();
        assert!(hold.done);

        // Later snapshots do not wait, ACKed or not; nor does an owner that no proxy
        // ACKs, past FIRST_ACK_WAIT.
        acks_tx.send_replace(None);
        assert!(tokio::time::timeout(quick, hold.wait()).await.is_ok());
        let (_acks_tx, acks) = watch::channel(None);
        let (fresh_tx, fresh) = watch::channel(false);
        let mut lone = WarmHold {
            status: hold.status.clone(),
            acks: acks.clone(),
            fresh,
            done: false,
            deadline: None,
        };
        // ... counted from when it began to serve: a respawned worker's load of the mesh
        // does not use it up.
        let lone = tokio::spawn(async move {
            lone.wait().await;
            tokio::time::Instant::now()
        });
        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
        assert!(!lone.is_finished(), "not serving yet");
        let serving_at = tokio::time::Instant::now();
        status_tx.send_modify(|s| s.phase = "serving");
        assert_eq!(lone.await.unwrap() - serving_at, FIRST_ACK_WAIT);

        // A wait left for a snapshot published meanwhile and taken up again ends when the
        // first would have: the deadline is kept.
        let (_no_acks_tx, no_acks) = watch::channel(None);
        let (_not_fresh_tx, not_fresh) = watch::channel(false);
        let mut resumed = WarmHold {
            status: hold.status.clone(),
            acks: no_acks,
            fresh: not_fresh,
            done: false,
            deadline: None,
        };
        let from = tokio::time::Instant::now();
        let part = FIRST_ACK_WAIT / 3;
        assert!(tokio::time::timeout(part, resumed.wait()).await.is_err());
        assert!(tokio::time::timeout(part, resumed.wait()).await.is_err());
        resumed.wait().await;
        assert_eq!(tokio::time::Instant::now() - from, FIRST_ACK_WAIT);

        // A proxy that starts fresh needs every resource: the warm-up goes ahead.
        let mut fresh_start = WarmHold {
            status: hold.status.clone(),
            acks,
            fresh: fresh_tx.subscribe(),
            done: false,
            deadline: None,
        };
        assert!(
            tokio::time::timeout(quick, fresh_start.wait())
                .await
                .is_err()
        );
        fresh_tx.send_replace(true);
        assert!(
            tokio::time::timeout(quick, fresh_start.wait())
                .await
                .is_ok()
        );
        assert!(fresh_start.done);
    }

    /// A standby keeps each snapshot's resume digests and encodings at hand: what a
    /// surge's new owner answers the relay's offer and the proxy's reconnect from.
    #[tokio::test]
    async fn a_standby_keeps_each_snapshots_digests_and_encodings_at_hand() {
        let first = Arc::new(snapshot(&[1, 2]));
        let (tx, snapshots) = watch::channel(first.clone());
        let encoded = Arc::new(Encoded::default());
        let (_status_tx, status) = watch::channel(crate::health::Status::new("n", "p"));
        let (_acks_tx, acks) = watch::channel(None);
        let (_fresh_tx, fresh) = watch::channel(false);
        let hold = WarmHold {
            status,
            acks,
            fresh,
            done: false,
            deadline: None,
        };
        // The other gates not passed yet: the first snapshot is warmed, not marked.
        let (gates_tx, gates) = watch::channel(aether_model::Gates::default());
        let (warm_tx, mut warm) = watch::channel(false);
        let task = tokio::spawn(keep_warm(
            snapshots,
            encoded.clone(),
            crate::metrics::Metrics::new(),
            hold,
            WarmGate {
                gates,
                set: Box::new(move || {
                    warm_tx.send_replace(true);
                }),
                marked: false,
            },
        ));
        let at_hand =
            |s: &Arc<Snapshot>| encoded.digests.holds(s) && encoded.plan(s, None).is_empty();
        let wait = |s: Arc<Snapshot>| {
            let at_hand = &at_hand;
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(10), async {
                    while !at_hand(&s) {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                })
                .await
                .is_ok()
            }
        };
        assert!(wait(first.clone()).await, "the first snapshot");
        assert!(!*warm.borrow(), "warm before the inputs were loaded");
        // Loaded: the gate is set after the change is published, as the node does; the
        // warm gate follows that snapshot's warm-up.
        let next = Arc::new(snapshot(&[1, 2, 3]));
        assert!(!at_hand(&next));
        tx.send_replace(next.clone());
        gates_tx.send_replace(aether_model::Gates {
            registry_loaded: true,
            storage_loaded: true,
            capture_landed: true,
            ..Default::default()
        });
        tokio::time::timeout(std::time::Duration::from_secs(10), warm.wait_for(|w| *w))
            .await
            .expect("the warm gate set")
            .unwrap();
        assert!(
            at_hand(&next),
            "warm before the loaded snapshot was at hand"
        );
        task.abort();
    }

    /// Whether `s`'s resume digests and bucket index are at hand.
    fn indexed(e: &Encoded, s: &Arc<Snapshot>) -> bool {
        e.digests.holds(s) && e.digests.by_bucket(s, Kind::Cluster).is_some()
    }

    /// A cold owner's warm-up waits for the proxy's first ACK, but each snapshot published
    /// meanwhile gets its resume digests and bucket index at once: the relay's offer and
    /// the EDS re-statement that follows answer from them.
    #[tokio::test]
    async fn a_cold_owner_indexes_each_snapshot_while_its_warm_up_waits() {
        let first = Arc::new(snapshot(&[1, 2]));
        let (tx, snapshots) = watch::channel(first.clone());
        let encoded = Arc::new(Encoded::default());
        let mut owner = crate::health::Status::new("n", "p");
        owner.role = "owner";
        owner.phase = "serving";
        let (_status_tx, status) = watch::channel(owner);
        let (acks_tx, acks) = watch::channel(None);
        let (_fresh_tx, fresh) = watch::channel(false);
        let (_gates_tx, gates) = watch::channel(aether_model::Gates::default());
        let task = tokio::spawn(keep_warm(
            snapshots,
            encoded.clone(),
            crate::metrics::Metrics::new(),
            WarmHold {
                status,
                acks,
                fresh,
                done: false,
                deadline: None,
            },
            WarmGate {
                gates,
                set: Box::new(|| {}),
                marked: false,
            },
        ));
        let until = |f: &dyn Fn() -> bool| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !f() {
                assert!(std::time::Instant::now() < deadline, "timed out");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        let next = Arc::new(snapshot(&[1, 2, 3]));
        tokio::task::yield_now().await;
        tx.send_replace(next.clone());
        let (e, n) = (encoded.clone(), next.clone());
        tokio::task::spawn_blocking(move || until(&|| indexed(&e, &n)))
            .await
            .unwrap();
        assert!(indexed(&encoded, &next));
        // Held: well within FIRST_ACK_WAIT, nothing of the snapshot is encoded.
        assert!(!encoded.plan(&next, None).is_empty(), "warmed while held");
        // The proxy's first ACK ends the hold: the warm-up follows.
        acks_tx.send_replace(Some(next.clone()));
        let (e, n) = (encoded.clone(), next.clone());
        tokio::task::spawn_blocking(move || until(&|| e.plan(&n, None).is_empty()))
            .await
            .unwrap();
        task.abort();
    }
}
