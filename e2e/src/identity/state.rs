//! What the test identity provider's gRPC services and the test's handle share: the
//! current SVIDs (the agent's and each pod's), the held pods and every open stream.
//!
//! An open stream is the sending half of an unbounded channel kept here under a key; the
//! gRPC response body is a [`Subscription`] over the receiving half, which removes its key
//! when dropped (the client cancelled or went away, or the server ended it). So the
//! streams counted here are exactly the ones still open, and every change wakes the
//! waiters of [`Shared::wait_until`]. Every send happens under the lock, so each stream
//! sees the SVIDs in the order they were minted.

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio_stream::Stream;
use tonic::Status;

use super::ca::{Ca, Svid};
use super::pb::spire::api::agent::delegatedidentity::v1 as delegated;
use super::pb::workload;

/// How long [`Shared::wait_until`] waits before it panics.
pub const WAIT: Duration = Duration::from_secs(10);

pub struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    pub ca: Ca,
}

pub type Sender<T> = UnboundedSender<Result<T, Status>>;

/// One pod, known from its first subscription on (it stays known after its streams
/// close, with its SVID, as a real agent caches it).
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub svid: Svid,
    /// Streams ever opened for the pod.
    pub opened: u64,
    /// Open streams, and the serial each was last sent (None: nothing yet, held).
    pub streams: BTreeMap<
        u64,
        (
            Sender<delegated::SubscribeToX509sviDsResponse>,
            Option<String>,
        ),
    >,
}

pub struct State {
    pub agent: Svid,
    pub agent_id: String,
    pub lifetime: Duration,
    pub pods: BTreeMap<String, Pod>,
    /// Pods (by uid) whose SVID is not sent until released; a uid may be held before its
    /// pod is known.
    pub held: BTreeSet<String>,
    /// Down: no new stream is opened (the listeners are closed too).
    pub down: bool,
    /// Both listeners are bound and served.
    pub listening: bool,
    next_stream: u64,
    /// Workload API FetchX509SVID streams.
    pub agent_streams: BTreeMap<u64, Sender<workload::X509svidResponse>>,
    /// Workload API FetchX509Bundles streams.
    pub bundle_streams: BTreeMap<u64, Sender<workload::X509BundlesResponse>>,
    /// Delegated Identity API SubscribeToX509Bundles streams.
    pub delegated_bundle_streams: BTreeMap<u64, Sender<delegated::SubscribeToX509BundlesResponse>>,
    /// SubscribeToX509SVIDs streams whose selectors name no pod: no entry can match them.
    pub unmatched_streams: BTreeMap<u64, Sender<delegated::SubscribeToX509sviDsResponse>>,
    /// The SPIFFE IDs allowed to call the Delegated Identity API (SPIRE's
    /// `authorized_delegates`); the agent's at start.
    pub authorized_delegates: BTreeSet<String>,
    /// The SPIFFE ID a caller of the admin socket attests to, by its unix uid (SPIRE's
    /// `unix:uid` selector); None: no entry matches that caller.
    pub callers: BTreeMap<u32, Option<String>>,
    /// The namespaces whose pods a registration entry matches; None: every namespace.
    pub pod_namespaces: Option<BTreeSet<String>>,
}

/// Where an open stream is kept.
#[derive(Clone, Debug)]
pub enum StreamKey {
    Agent(u64),
    Bundles(u64),
    DelegatedBundles(u64),
    Pod(String, u64),
    Unmatched(u64),
}

impl Shared {
    pub fn new(ca: Ca, agent_id: String, lifetime: Duration) -> anyhow::Result<Shared> {
        let agent = ca.mint(&agent_id, lifetime)?;
        let state = State {
            agent,
            authorized_delegates: BTreeSet::from([agent_id.clone()]),
            callers: BTreeMap::new(),
            pod_namespaces: None,
            unmatched_streams: BTreeMap::new(),
            agent_id,
            lifetime,
            pods: BTreeMap::new(),
            held: BTreeSet::new(),
            down: false,
            listening: false,
            next_stream: 0,
            agent_streams: BTreeMap::new(),
            bundle_streams: BTreeMap::new(),
            delegated_bundle_streams: BTreeMap::new(),
        };
        Ok(Shared {
            state: Mutex::new(state),
            changed: Condvar::new(),
            ca,
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while the lock was held leaves the state as consistent as any
        // step leaves it; the tests should see that panic, not a second one here.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` under the lock, then wakes every waiter.
    pub fn update<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let r = f(&mut self.lock());
        self.changed.notify_all();
        r
    }

    /// Blocks the calling (non-server) thread until `done` holds; panics, naming `what`,
    /// after [`WAIT`].
    pub fn wait_until(&self, what: &str, done: impl Fn(&State) -> bool) {
        let deadline = Instant::now() + WAIT;
        let mut state = self.lock();
        while !done(&state) {
            let left = deadline
                .checked_duration_since(Instant::now())
                .unwrap_or_else(|| {
                    panic!("test identity provider: {what} did not happen within {WAIT:?}")
                });
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Mints an SVID with the current lifetime.
    pub fn mint(&self, state: &State, spiffe_id: &str) -> Svid {
        self.ca
            .mint(spiffe_id, state.lifetime)
            .unwrap_or_else(|e| panic!("test identity provider: minting {spiffe_id}: {e:#}"))
    }
}

impl State {
    /// A fresh channel and the id of its stream.
    pub fn open<T>(&mut self) -> (u64, Sender<T>, UnboundedReceiver<Result<T, Status>>) {
        self.next_stream += 1;
        let (tx, rx) = unbounded_channel();
        (self.next_stream, tx, rx)
    }

    pub fn remove(&mut self, key: &StreamKey) {
        match key {
            StreamKey::Agent(id) => drop(self.agent_streams.remove(id)),
            StreamKey::Bundles(id) => drop(self.bundle_streams.remove(id)),
            StreamKey::DelegatedBundles(id) => drop(self.delegated_bundle_streams.remove(id)),
            StreamKey::Unmatched(id) => drop(self.unmatched_streams.remove(id)),
            StreamKey::Pod(uid, id) => {
                if let Some(pod) = self.pods.get_mut(uid) {
                    pod.streams.remove(id);
                }
            }
        }
    }

    /// Ends every open stream with `status` (the client sees it as the stream's end).
    pub fn close_all(&mut self, status: &Status) {
        for tx in std::mem::take(&mut self.agent_streams).into_values() {
            let _ = tx.send(Err(status.clone()));
        }
        for tx in std::mem::take(&mut self.bundle_streams).into_values() {
            let _ = tx.send(Err(status.clone()));
        }
        for tx in std::mem::take(&mut self.delegated_bundle_streams).into_values() {
            let _ = tx.send(Err(status.clone()));
        }
        for tx in std::mem::take(&mut self.unmatched_streams).into_values() {
            let _ = tx.send(Err(status.clone()));
        }
        for pod in self.pods.values_mut() {
            for (tx, _) in std::mem::take(&mut pod.streams).into_values() {
                let _ = tx.send(Err(status.clone()));
            }
        }
    }

    /// Whether a registration entry matches the pods of `namespace`.
    pub fn has_entry(&self, namespace: &str) -> bool {
        self.pod_namespaces
            .as_ref()
            .is_none_or(|n| n.contains(namespace))
    }

    /// SPIRE's check of a Delegated Identity caller: attested by its unix uid, it must
    /// match an entry (else "no identity issued") whose SPIFFE ID is an authorized delegate
    /// (else "caller not configured as an authorized delegate"); both PERMISSION_DENIED,
    /// with SPIRE's messages. A uid without an entry of its own attests to the agent's ID.
    pub fn authorize_delegate(&self, uid: Option<u32>) -> Result<(), Status> {
        let Some(uid) = uid else {
            return Err(Status::unavailable("workload attestation failed"));
        };
        match self
            .callers
            .get(&uid)
            .cloned()
            .unwrap_or(Some(self.agent_id.clone()))
        {
            None => Err(Status::permission_denied("no identity issued")),
            Some(id) if self.authorized_delegates.contains(&id) => Ok(()),
            Some(_) => Err(Status::permission_denied(
                "caller not configured as an authorized delegate",
            )),
        }
    }

    /// Open streams, all kinds.
    pub fn open_streams(&self) -> usize {
        self.agent_streams.len()
            + self.bundle_streams.len()
            + self.delegated_bundle_streams.len()
            + self.unmatched_streams.len()
            + self.pods.values().map(|p| p.streams.len()).sum::<usize>()
    }
}

/// A gRPC response stream fed by the provider; unregisters itself when dropped.
pub struct Subscription<T> {
    rx: UnboundedReceiver<Result<T, Status>>,
    key: StreamKey,
    shared: Arc<Shared>,
}

impl<T> Subscription<T> {
    pub fn new(
        rx: UnboundedReceiver<Result<T, Status>>,
        key: StreamKey,
        shared: Arc<Shared>,
    ) -> Subscription<T> {
        Subscription { rx, key, shared }
    }
}

impl<T> Stream for Subscription<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl<T> Drop for Subscription<T> {
    fn drop(&mut self) {
        self.shared.update(|s| s.remove(&self.key));
    }
}
