//! What this process keeps of etcd, from one etcd watch of the whole prefix: the address
//! index ([`AddrIndex`]: which services have an endpoint at an address, for drain marks
//! that name no service) and, unless `--full-views-from-etcd`, every key and its value
//! (the kept view, for full views).
//!
//! # The revision it is complete at
//! `synced` is the read it was built from, then each watch response's newest event, and
//! each progress notification (which etcd sends only once the watch has caught up). The
//! keys and the revision change together under one lock, so a copy taken under it is the
//! registry at exactly that revision. etcd sends a revision's events in one response.
//!
//! # Drain marks
//! A mark asks etcd for its current revision and waits, up to [`SYNC_WAIT`], for the
//! index to reach it (asking the watch for its progress), so that it never misses an
//! endpoint written before it was asked; an index that does not catch up in time, or not
//! started yet, is not used: the mark reads every endpoint, as without the index, and
//! says so in a warn line.
//!
//! # Full views
//! A watch stream that cannot resume gets the kept view as it is, at its revision, and
//! follows etcd's watch from the revision after: a copy of the map costs nothing (it is
//! an `imbl` map, shared until changed), and etcd is read once per process, not once per
//! stream (110,000 keys at 10,000 services). The view may be a few events behind etcd;
//! the stream's own watch sends them next. The message is built off the runtime
//! threads, one build at a time, by service ([`Parts`]): the watch notes the services
//! whose keys changed, and a build rebuilds only those (at 10,000 services a view after
//! a few changes takes about 27 ms, against 120 to 400 from every key). The last one is
//! kept: the streams that open at one revision (every node of a cluster after a
//! registrar restarts) share it. While the watch is broken (or before the first read)
//! there is no kept view, and a stream reads etcd as it did before.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_model::ServiceKey;
use bytes::Bytes;
use etcd_client::EventType;
use tokio::sync::{Notify, watch};

use crate::addrs::AddrIndex;
use crate::keys::Layout;
use crate::store::Store;
use crate::view::{self, Keys, Parts, Rejected};
use shared_proto::registry as pb;

/// How long a drain mark waits for the index to reach etcd's revision.
pub const SYNC_WAIT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct State {
    addrs: AddrIndex,
    /// None with `--full-views-from-etcd`.
    keys: Option<Keys>,
    /// The revision `keys` and `addrs` are complete at.
    revision: i64,
    /// Whether the watch follows etcd now: a broken one's keys are not served.
    live: bool,
    /// The services whose keys changed since the last full view was built; every
    /// service after a read.
    touched: Touched,
}

#[derive(Default)]
enum Touched {
    #[default]
    All,
    Some(BTreeSet<ServiceKey>),
}

/// A full view built from the kept view.
pub struct Built {
    pub view: Arc<pb::FullView>,
    /// The keys it was built from.
    pub keys: usize,
    /// How long its build took; zero for one built before for another stream.
    pub took: Duration,
    /// The corrupt entries it left out; empty for one built before (they were logged
    /// then).
    pub rejected: Vec<Rejected>,
}

/// The index and the view, shared by the watch task, drain marks and watch streams.
pub struct Kept {
    state: Mutex<State>,
    synced: watch::Sender<i64>,
    progress: Notify,
    keep_keys: bool,
    /// The full view by service, as last built, with the view it made; held while one
    /// is built.
    last: tokio::sync::Mutex<Option<(Parts, Arc<pb::FullView>)>>,
}

impl Kept {
    /// Starts the watch task; `keep_keys` false keeps the address index only.
    pub fn spawn(store: Store, keep_keys: bool) -> Arc<Kept> {
        let kept = Arc::new(Kept {
            state: Mutex::default(),
            synced: watch::channel(0).0,
            progress: Notify::new(),
            keep_keys,
            last: tokio::sync::Mutex::new(None),
        });
        tokio::spawn(kept.clone().run(store));
        kept
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The services at `address` as of a revision at least `revision`, or None if the
    /// index does not reach it within [`SYNC_WAIT`].
    pub async fn services_at(&self, address: IpAddr, revision: i64) -> Option<Vec<ServiceKey>> {
        let mut synced = self.synced.subscribe();
        if *synced.borrow() < revision {
            self.progress.notify_one();
        }
        tokio::time::timeout(SYNC_WAIT, synced.wait_for(|s| *s >= revision))
            .await
            .ok()?
            .ok()?;
        Some(self.lock().addrs.services_at(address))
    }

    /// A full view of the kept view at a revision of at least `floor`, while the watch
    /// follows etcd; None before the first read, while the watch is broken, or with
    /// `--full-views-from-etcd`. The last one built if the kept view has not moved
    /// since, else one built from the last by the services touched since.
    pub async fn full_view(&self, layout: &Layout, floor: i64) -> Option<Built> {
        let mut last = self.last.lock().await;
        let (revision, keys, touched) = {
            let mut state = self.lock();
            if !state.live || state.revision < floor {
                return None;
            }
            let keys = state.keys.clone()?;
            (
                state.revision,
                keys,
                std::mem::replace(&mut state.touched, Touched::Some(BTreeSet::new())),
            )
        };
        let n = keys.len();
        let parts = last.take().filter(|(p, _)| p.revision() <= revision);
        if let (Some((p, view)), Touched::Some(t)) = (&parts, &touched)
            && p.revision() == revision
            && t.is_empty()
        {
            let view = view.clone();
            *last = parts;
            return Some(Built {
                view,
                keys: n,
                took: Duration::ZERO,
                rejected: Vec::new(),
            });
        }
        let layout = layout.clone();
        let t = Instant::now();
        let built = tokio::task::spawn_blocking(move || match (parts, touched) {
            (Some((mut parts, _)), Touched::Some(touched)) => {
                let rejected = parts.update(&layout, revision, &keys, touched);
                (parts, rejected)
            }
            _ => Parts::build(&layout, revision, &keys),
        })
        .await;
        let Ok((parts, rejected)) = built else {
            // The parts went with the build: the next one starts from every key.
            self.lock().touched = Touched::All;
            return None;
        };
        let view = Arc::new(parts.view());
        *last = Some((parts, view.clone()));
        Some(Built {
            view,
            keys: n,
            took: t.elapsed(),
            rejected,
        })
    }

    async fn run(self: Arc<Self>, store: Store) {
        let layout = store.layout.clone();
        let mut pause = Duration::from_millis(100);
        loop {
            let result = self.follow(&store, &layout).await;
            self.lock().live = false;
            match result {
                Ok(()) => pause = Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?pause, "the registrar's etcd watch of its kept view failed; drain marks read every endpoint and full views read etcd until it is back");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Reads every key, then follows the watch until it breaks or is compacted.
    async fn follow(&self, store: &Store, layout: &Layout) -> Result<(), String> {
        let (revision, kvs) = store
            .read_prefix(layout.prefix(), None)
            .await
            .map_err(|e| e.to_string())?;
        {
            let mut addrs = AddrIndex::default();
            for (k, _) in &kvs {
                addrs.apply(layout, k, true);
            }
            let keys = self.keep_keys.then(|| {
                kvs.into_iter()
                    .map(|(k, v)| (Bytes::from(k), Bytes::from(v)))
                    .collect()
            });
            *self.lock() = State {
                addrs,
                keys,
                revision,
                live: true,
                touched: Touched::All,
            };
        }
        self.synced.send_replace(revision);
        let mut stream = store.watch(revision + 1).await.map_err(|e| e.to_string())?;
        loop {
            let resp = tokio::select! {
                m = stream.message() => m.map_err(|e| e.to_string())?,
                _ = self.progress.notified() => {
                    stream.request_progress().await.map_err(|e| e.to_string())?;
                    continue;
                }
            };
            let Some(resp) = resp else {
                return Err("etcd ended the watch".into());
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                return Ok(());
            }
            let events = resp.events();
            if events.is_empty() && resp.created() {
                // The response that created the watch says nothing.
                continue;
            }
            let newest = {
                let mut state = self.lock();
                let State {
                    addrs,
                    keys,
                    touched,
                    ..
                } = &mut *state;
                // A progress notification says the watch has caught up to the header's
                // revision.
                let mut newest = if events.is_empty() {
                    resp.header().map_or(0, |h| h.revision())
                } else {
                    0
                };
                for e in events {
                    let Some(kv) = e.kv() else { continue };
                    let put = e.event_type() == EventType::Put;
                    let parsed = layout.parse(kv.key()).ok();
                    if let Some(key) = &parsed {
                        addrs.apply_key(key, put);
                    }
                    if let Some(keys) = keys {
                        if let (Touched::Some(t), Some(s)) =
                            (&mut *touched, parsed.as_ref().and_then(view::owner))
                        {
                            t.insert(s.clone());
                        }
                        let key = Bytes::copy_from_slice(kv.key());
                        if put {
                            keys.insert(key, Bytes::copy_from_slice(kv.value()));
                        } else {
                            keys.remove(&key);
                        }
                    }
                    newest = newest.max(kv.mod_revision());
                }
                state.revision = state.revision.max(newest);
                state.revision
            };
            self.synced.send_if_modified(|s| {
                let moved = newest > *s;
                *s = (*s).max(newest);
                moved
            });
        }
    }
}
