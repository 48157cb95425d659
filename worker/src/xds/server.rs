//! The ADS server: tonic's router for the service, routed by hand so that requests
//! decode into the lean [`super::wire`] types, and one task per stream that runs a
//! protocol's state ([`Protocol`]): it answers requests, pushes every new snapshot from
//! the node's watch channel, logs and counts ACKs and NACKs, and publishes to [`Acks`]
//! each snapshot the proxy has fully ACKed.
//!
//! The routing is what tonic generates for the service (`envoy-types`'
//! `AggregatedDiscoveryServiceServer`), with the request codec swapped.
//!
//! Limits ([`Limits`]): connections on `xds.sock` (counted where they are accepted,
//! `crate::accept`), HTTP/2 streams per connection, the size of a request, and what a
//! stream may subscribe to ([`SubscriptionLimits`]); a stream past the last ends with
//! RESOURCE_EXHAUSTED naming the limit.

use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use aether_model::{KIND_COUNT, Snapshot};
use futures::Stream;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::{Body, BoxFuture, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use shared_proto::resume;

use super::delta::{DeltaState, LimitError, SubscriptionLimits};
use super::digest::{Answer, Resumed};
use super::encoded::Encoded;
use super::kind::{self, Kind};
use super::protocol::{Event, Protocol};
use super::stream::StreamState;
use super::wire::{DeltaRequestWire, MAX_REQUEST, SotwRequestWire};
use crate::accept::{Acceptor, PeerRate};
use crate::acks::Acks;
use crate::metrics::{LimitLabel, Metrics, TypeLabel};
use crate::writers::Observed;

/// A protocol as served: the wire type its requests decode into, and the check of each
/// request against the subscription limits.
pub(super) trait Served: Protocol {
    type Wire: prost::Message + Default + Into<Self::Request> + Send + 'static;
    /// Whether `req` keeps the stream within `limits`; checked before it is applied.
    fn check_limits(
        &self,
        req: &Self::Request,
        limits: &SubscriptionLimits,
    ) -> Result<(), LimitError>;
    /// How many names `req` carries: what freeing it costs.
    fn names(req: &Self::Request) -> usize;
    /// Whether the protocol takes a relay's digest resume (incremental only).
    const DIGEST_RESUME: bool = false;
    /// The proxy holds `held` of `kind`, by a relay's digest.
    fn resume_held(&mut self, _kind: Kind, _held: Resumed) {}
    /// The in-band answer of the overlapping handover ([`resume::HANDOVER_TYPE`]) with
    /// `nonce`; None for a protocol without it (state of the world).
    fn handover_answer(_nonce: &str) -> Option<Self::Response> {
        None
    }
    /// Whether `req` is a relay's in-band request of the overlapping handover.
    fn is_handover(_req: &Self::Request) -> bool {
        false
    }
}

/// A request carrying more names than this is freed on a blocking thread, not before the
/// answer: a reconnect at 10,000 services reports 10,000 versions per type, and freeing
/// those 20,000 strings takes milliseconds on the runtime's one thread.
const FREE_OFF_THREAD: usize = 1024;

impl Served for StreamState {
    type Wire = SotwRequestWire;
    /// A state-of-the-world request names the type's whole subscription, so its own
    /// names are what is checked.
    fn check_limits(
        &self,
        req: &Self::Request,
        limits: &SubscriptionLimits,
    ) -> Result<(), LimitError> {
        let Some(kind) = kind::from_type_url(&req.type_url) else {
            return Ok(());
        };
        limits.check_lengths(kind, req.resource_names.iter().map(String::as_str))?;
        let names: std::collections::BTreeSet<&str> =
            req.resource_names.iter().map(String::as_str).collect();
        limits.check_count(kind, names.len())
    }

    fn names(req: &Self::Request) -> usize {
        req.resource_names.len()
    }
}

impl Served for DeltaState {
    type Wire = DeltaRequestWire;
    fn check_limits(
        &self,
        req: &Self::Request,
        limits: &SubscriptionLimits,
    ) -> Result<(), LimitError> {
        DeltaState::check_limits(self, req, limits)
    }

    fn names(req: &Self::Request) -> usize {
        req.resource_names_subscribe.len()
            + req.resource_names_unsubscribe.len()
            + req.initial_resource_versions.len()
    }

    const DIGEST_RESUME: bool = true;
    fn resume_held(&mut self, kind: Kind, held: Resumed) {
        DeltaState::resume_held(self, kind, held)
    }

    fn handover_answer(nonce: &str) -> Option<Self::Response> {
        Some(
            envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse {
                type_url: resume::HANDOVER_TYPE.to_string(),
                nonce: nonce.to_string(),
                ..Default::default()
            },
        )
    }

    fn is_handover(req: &Self::Request) -> bool {
        req.type_url == resume::HANDOVER_TYPE
    }
}

/// The most connections `xds.sock` holds open at once: one proxy per node, which opens
/// one, plus room for probes (a successor's readiness dial) and reconnects.
pub const MAX_CONNECTIONS: usize = 64;
/// The most HTTP/2 streams one connection may have open at once: the proxy uses one ADS
/// stream. A stream past it is refused by HTTP/2 (REFUSED_STREAM).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 16;

/// How fast one process may open connections on `xds.sock`: the whole cap at once, then
/// 20 a second. The proxy holds one and opens another only to reconnect.
pub const PEER_RATE: PeerRate = PeerRate {
    burst: MAX_CONNECTIONS as u32 + 64,
    per_second: 20,
};

/// The ADS server's limits; ARCHITECTURE.md ("Limits") lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub peer_rate: PeerRate,
    pub max_streams_per_connection: u32,
    /// The largest request, encoded (a larger one ends its stream with OUT_OF_RANGE).
    pub max_request: usize,
    pub subscriptions: SubscriptionLimits,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            peer_rate: PEER_RATE,
            max_streams_per_connection: MAX_STREAMS_PER_CONNECTION,
            max_request: MAX_REQUEST,
            subscriptions: SubscriptionLimits::default(),
        }
    }
}

/// Serves ADS on `listener` until `stop_accepting` resolves, then closes the listener
/// and returns. Streams already open keep being served (each connection is its own task)
/// until the proxy closes them or this process exits: a released owner keeps the proxy's
/// stream while its successor starts serving (see [`super::probe::await_server`]); a
/// relay's streams end earlier, through `handover` ([`Handover`]).
///
/// With `observed` (`--on-demand-clusters`), an incremental stream's wildcard CDS
/// subscription carries the node's own clusters and the observed upstreams, and the proxy
/// asks for any other by name.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: tokio::net::UnixListener,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    acks: Acks,
    metrics: Arc<Metrics>,
    observed: Option<Arc<Observed>>,
    stop_accepting: impl Future<Output = ()> + Send + 'static,
    limits: Limits,
    resume: Resume,
    handover: Handover,
) -> anyhow::Result<()> {
    let incoming = Acceptor::new(listener, "xds", limits.max_connections, metrics.clone())
        .with_peer_rate(limits.peer_rate)
        .incoming(|_| true);
    let ads = Arc::new(Ads {
        snapshots,
        encoded,
        acks,
        metrics,
        observed,
        limits,
        streams: AtomicU64::new(0),
        resume,
        handover,
    });
    // Without a shutdown signal tonic neither waits for nor signals open connections when
    // the incoming stream ends; it drops the listener and returns.
    tonic::transport::Server::builder()
        .max_concurrent_streams(limits.max_streams_per_connection)
        .add_service(AdsServer(ads))
        .serve_with_incoming(futures::StreamExt::take_until(incoming, stop_accepting))
        .await?;
    Ok(())
}

struct Ads {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    acks: Acks,
    metrics: Arc<Metrics>,
    observed: Option<Arc<Observed>>,
    limits: Limits,
    streams: AtomicU64,
    resume: Resume,
    handover: Handover,
}

/// Whether the server takes the xDS relay's digest resume (`shared_proto::resume`):
/// `Digest` unless `--xds-digest-resume=false`, which answers as an owner without it,
/// and without the overlapping handover ([`Handover`]): an owner of the previous version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resume {
    #[default]
    Digest,
    Plain,
}

/// How a released owner hands the relays' streams over, so that each relay re-states its
/// session on the successor at once. A relay that asked for the overlap
/// ([`resume::HANDOVER_HEADER`]) is told in-band as soon as this owner is released
/// ([`Handover::begin_overlap`]) and keeps its stream, which this owner goes on serving,
/// until it has re-stated on the successor and closes it (at most [`OVERLAP_BOUND`]).
/// Any other relay's stream is ended once the successor serves
/// ([`Handover::end_relay_streams`]). Without it a relay sees the end only
/// when this process's exit closes the socket, which the kernel does after it has torn
/// down the process's memory: 5 to 12 ms for a 120 MiB worker at 10,000 services, in
/// which no owner serves the relay.
///
/// A relay's stream is one that opens with the resume header ([`resume::HEADER`], empty
/// when it offers no digest). A relay opens each agent stream on a connection of its own,
/// so its next stream reaches the successor, never this process. A proxy connected
/// straight to the agent keeps its stream until this process exits, as ever: it
/// reconnects after its backoff, and might reuse the connection to this process.
#[derive(Clone)]
pub struct Handover {
    ending: watch::Sender<bool>,
    overlap: watch::Sender<bool>,
    /// The relays' streams still open.
    open: watch::Sender<usize>,
}

impl Default for Handover {
    fn default() -> Self {
        Self {
            ending: watch::Sender::new(false),
            overlap: watch::Sender::new(false),
            open: watch::Sender::new(0),
        }
    }
}

/// How long a relay gets to close its side of an ended stream before this process goes
/// on (a relay that does not read keeps nothing waiting longer).
const HANDOVER_BOUND: std::time::Duration = std::time::Duration::from_millis(500);
/// How long a released owner goes on serving a relay's stream in an overlap: past it the
/// stream ends with [`resume::HANDED_OVER`], as without the overlap.
pub const OVERLAP_BOUND: std::time::Duration = std::time::Duration::from_secs(2);

impl Handover {
    /// This owner is released and a successor is coming: the relays that asked for the
    /// overlap are told in-band, and their streams carry on.
    pub fn begin_overlap(&self) {
        self.overlap.send_replace(true);
    }

    /// Ends every relay's stream with UNAVAILABLE ([`resume::HANDED_OVER`]) and waits,
    /// for at most [`HANDOVER_BOUND`], until each relay has closed its side: then each
    /// has the end, and this process may exit. Returns how many streams were open and
    /// whether all closed in time. A relay stream that opens later ends at once.
    pub async fn end_relay_streams(&self) -> (usize, bool) {
        let open = *self.open.borrow();
        self.ending.send_replace(true);
        let mut left = self.open.subscribe();
        let bound = OVERLAP_BOUND + HANDOVER_BOUND;
        let closed = tokio::time::timeout(bound, left.wait_for(|n| *n == 0)).await;
        (open, matches!(closed, Ok(Ok(_))))
    }

    /// A relay's stream opens, taking the overlap or not: counted until the returned
    /// guard drops.
    fn relay_stream(&self, overlap: bool) -> RelayStream {
        self.open.send_modify(|n| *n += 1);
        RelayStream {
            ending: self.ending.subscribe(),
            overlap: overlap.then(|| self.overlap.subscribe()),
            open: self.open.clone(),
        }
    }
}

/// A relay's stream, as its task holds it: told when the node is handed over.
struct RelayStream {
    ending: watch::Receiver<bool>,
    /// The relay takes the overlap.
    overlap: Option<watch::Receiver<bool>>,
    open: watch::Sender<usize>,
}

/// How a relay's stream is handed over.
enum HandedOver {
    /// Told in-band; the stream carries on.
    Overlap,
    /// Ended with [`resume::HANDED_OVER`].
    End,
}

impl Drop for RelayStream {
    fn drop(&mut self) {
        self.open.send_modify(|n| *n -= 1);
    }
}

/// Resolves once the node is handed over, for a relay's stream; never for another.
async fn handed_over(relay: &mut Option<RelayStream>) -> HandedOver {
    let Some(r) = relay else {
        return std::future::pending().await;
    };
    let overlap = async {
        let told = match &mut r.overlap {
            Some(o) => o.wait_for(|e| *e).await.is_ok(),
            None => false,
        };
        if !told {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        // An owner with a successor tells the relay in-band before it would end the
        // stream: the overlap first when both are set.
        biased;
        () = overlap => HandedOver::Overlap,
        ended = async { r.ending.wait_for(|e| *e).await.is_ok() } => {
            if !ended {
                // The handover is gone with the server: nothing will end the stream.
                std::future::pending::<()>().await;
            }
            HandedOver::End
        }
    }
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl Ads {
    /// A new stream; with a relay's digest offer, also the response header's value (the
    /// types it matched).
    async fn open<P: Served>(
        &self,
        inbound: Streaming<P::Wire>,
        offer: Option<&str>,
        overlap: bool,
    ) -> (ResponseStream<P::Response>, Option<String>, bool) {
        let id = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        let mut resumed = Vec::new();
        let mut answer = None;
        if let Some(offer) = offer.filter(|_| P::DIGEST_RESUME && self.resume == Resume::Digest) {
            let snapshot = self.snapshots.borrow().clone();
            let (matched, waited) = self.matched(&snapshot, offer).await;
            answer = Some(super::digest::header(&matched));
            for kind in &matched.whole {
                let label = TypeLabel {
                    type_url: kind::type_url(*kind).to_string(),
                };
                self.metrics.xds_digest_resumes.get_or_create(&label).inc();
                resumed.push((*kind, Resumed::Whole(snapshot.hashes(*kind).clone())));
            }
            for (kind, m) in matched.buckets {
                let label = TypeLabel {
                    type_url: kind::type_url(kind).to_string(),
                };
                self.metrics.xds_bucket_resumes.get_or_create(&label).inc();
                let hashes = snapshot.hashes(kind).clone();
                let by_bucket = self.encoded.digests.by_bucket(&snapshot, kind);
                resumed.push((
                    kind,
                    Resumed::Buckets {
                        hashes,
                        matched: m,
                        by_bucket,
                    },
                ));
            }
            for kind in matched.names {
                let label = TypeLabel {
                    type_url: kind::type_url(kind).to_string(),
                };
                self.metrics.xds_names_resumes.get_or_create(&label).inc();
                resumed.push((kind, Resumed::Names(snapshot.clone())));
            }
            tracing::info!(stream = id, matched = ?answer, waited_us = waited.as_micros() as u64, "ADS stream: the relay offered a digest resume");
        }
        let (tx, rx) = mpsc::channel(16);
        let (snapshots, encoded) = (self.snapshots.clone(), self.encoded.clone());
        let observed = self.observed.clone();
        let (acks, metrics, limits) = (
            self.acks.clone(),
            self.metrics.clone(),
            self.limits.subscriptions,
        );
        // A relay's stream: handed over in-band (the overlap, when it asks and the
        // protocol has it) or ended at the handover.
        // An owner without the digest resume answers as an older one: no overlap either.
        let overlap = overlap
            && offer.is_some()
            && P::handover_answer("").is_some()
            && self.resume == Resume::Digest;
        let relay = offer.is_some().then(|| self.handover.relay_stream(overlap));
        tokio::spawn(run_stream::<P>(
            id, inbound, tx, snapshots, encoded, observed, acks, metrics, limits, resumed, relay,
        ));
        (Box::pin(ReceiverStream::new(rx)), answer, overlap)
    }

    /// The answer to a relay's offer, and how long it waited for the snapshot's digests.
    /// A cold owner's first snapshot has none yet: the heavy-work thread walks every
    /// resource (10 to 20 ms at 10,000 services), and the walk is waited for on the
    /// blocking pool, so that this thread goes on serving the CNI calls and streams that
    /// queued while no owner served.
    async fn matched(&self, snapshot: &Arc<Snapshot>, offer: &str) -> (Answer, Duration) {
        if let Some(answer) = self.encoded.digests.matched_at_hand(snapshot, offer) {
            return (answer, Duration::ZERO);
        }
        let started = Instant::now();
        let waiting = Held::on(&self.metrics.xds_offers_waiting);
        let (encoded, s, o) = (self.encoded.clone(), snapshot.clone(), offer.to_string());
        let matched = tokio::task::spawn_blocking(move || encoded.digests.matched(&s, &o)).await;
        drop(waiting);
        let answer = matched.unwrap_or_else(|e| {
            // Nothing matched: the relay re-states every version it holds.
            tracing::error!(error = %e, "the resume digests failed; answering the relay's offer with a plain resume");
            Answer::default()
        });
        (answer, started.elapsed())
    }
}

/// One up on a gauge while held: down again however the holder ends (a stream task, an
/// offer's wait whose call is dropped).
struct Held(Gauge);

impl Held {
    fn on(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_stream<P: Served>(
    id: u64,
    mut inbound: Streaming<P::Wire>,
    tx: mpsc::Sender<Result<P::Response, Status>>,
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    observed: Option<Arc<Observed>>,
    acks: Acks,
    metrics: Arc<Metrics>,
    limits: SubscriptionLimits,
    resumed: Vec<(Kind, Resumed)>,
    mut relay: Option<RelayStream>,
) {
    let _open = Held::on(&metrics.xds_streams);
    let mut st = P::new(snapshots.borrow_and_update().clone(), encoded);
    for (kind, held) in resumed {
        st.resume_held(kind, held);
    }
    if let Some(o) = observed {
        st.on_demand(o);
    }
    let mut snapshots_open = true;
    let mut node_id = String::new();
    // When the snapshot last changed, for the debug log, and when each type's last
    // response went out (by nonce), for the log's push and ACK lines and the push-to-ACK
    // histogram.
    let mut changed_at = Instant::now();
    let mut pushed_at: [Option<(String, Instant)>; KIND_COUNT] = Default::default();
    let mut answered = [false; KIND_COUNT];
    // The overlap: the relay was told in-band that the node is handed over, and this
    // stream carries on until it closes its side or the bound passes; and the relay asked
    // to be told once its re-statement is answered.
    let overlap = relay.as_ref().is_some_and(|r| r.overlap.is_some());
    let mut handing: Option<tokio::time::Instant> = None;
    let mut restated = false;
    // A stream is logged at info from its first request naming a node: a client that
    // opens streams by the thousand and never speaks (a flood) must not fill the log.
    tracing::debug!(stream = id, protocol = P::NAME, "ADS stream opened");
    loop {
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(wire)) => {
                    let req: P::Request = wire.into();
                    if overlap && P::is_handover(&req) {
                        // Answered after what the requests before it are owed, below.
                        restated = true;
                    } else {
                    if let Some(node) = P::node_id(&req) {
                        if node_id.is_empty() {
                            tracing::info!(stream = id, node, protocol = P::NAME, "ADS stream opened");
                        }
                        node_id = node.to_string();
                    }
                    if let Err(e) = st.check_limits(&req, &limits) {
                        let label = LimitLabel { type_url: kind::type_url(e.kind()).to_string(), limit: e.limit().to_string() };
                        metrics.xds_subscription_refusals.get_or_create(&label).inc();
                        tracing::warn!(stream = id, node = %node_id, protocol = P::NAME, error = %e, "ADS stream refused: over a subscription limit");
                        end_with(&tx, Status::resource_exhausted(format!("{} ADS stream refused: {e}", P::NAME))).await;
                        return;
                    }
                    let ev = st.on_request(&req);
                    // A proxy starting fresh needs every resource: the node's encoding
                    // warm-up may go ahead (`encoded::WarmHold`).
                    if matches!(ev, Event::Subscribe { kind: Kind::Cluster, holds_nothing: true, .. }) {
                        acks.fresh_proxy();
                    }
                    record(id, &node_id, ev, &metrics, &pushed_at);
                    if P::names(&req) > FREE_OFF_THREAD {
                        tokio::task::spawn_blocking(move || drop(req));
                    }
                    }
                }
                Ok(None) => {
                    if node_id.is_empty() {
                        tracing::debug!(stream = id, "ADS stream closed by the proxy");
                    } else {
                        tracing::info!(stream = id, node = %node_id, "ADS stream closed by the proxy");
                    }
                    return;
                }
                Err(status) => {
                    if node_id.is_empty() {
                        tracing::debug!(stream = id, %status, "ADS stream ended");
                    } else {
                        tracing::info!(stream = id, node = %node_id, %status, "ADS stream ended");
                    }
                    // A request refused before it reached the stream (too large, not
                    // decodable) ends it with its status, so the proxy sees why.
                    end_with(&tx, status).await;
                    return;
                }
            },
            changed = snapshots.changed(), if snapshots_open => match changed {
                Ok(()) => {
                    let next = snapshots.borrow_and_update().clone();
                    if next.rejects != st.current().rejects {
                        for r in &next.rejects {
                            tracing::warn!(stream = id, "snapshot leaves out: {r}");
                        }
                    }
                    st.set_snapshot(next);
                    changed_at = Instant::now();
                }
                // The node is gone; keep serving what the proxy has.
                Err(_) => snapshots_open = false,
            },
            how = handed_over(&mut relay), if handing.is_none() => match how {
                HandedOver::Overlap => {
                    tracing::info!(stream = id, node = %node_id, "ADS stream: the node is handed over; the relay's stream carries on until it has re-stated its session on the successor");
                    let Some(told) = P::handover_answer(resume::HANDED_OVER_NONCE) else { return };
                    if tx.send(Ok(told)).await.is_err() {
                        return;
                    }
                    handing = Some(tokio::time::Instant::now() + OVERLAP_BOUND);
                }
                HandedOver::End => {
                    tracing::info!(stream = id, node = %node_id, "ADS stream: the node is handed over; ending the relay's stream, which re-states its session on the successor");
                    end_with(&tx, Status::unavailable(resume::HANDED_OVER)).await;
                    // The relay closes its side once it has the end.
                    let _ = tokio::time::timeout(HANDOVER_BOUND, async {
                        while let Ok(Some(_)) = inbound.message().await {}
                    })
                    .await;
                    return;
                }
            },
            () = async { tokio::time::sleep_until(handing.expect("guarded")).await }, if handing.is_some() => {
                tracing::warn!(stream = id, node = %node_id, bound = ?OVERLAP_BOUND, "ADS stream: the relay kept the handed-over stream past the bound; ending it");
                end_with(&tx, Status::unavailable(resume::HANDED_OVER)).await;
                // The relay closes its side once it has the end.
                let _ = tokio::time::timeout(HANDOVER_BOUND, async {
                    while let Ok(Some(_)) = inbound.message().await {}
                })
                .await;
                return;
            }
            () = tx.closed() => {
                if node_id.is_empty() {
                    tracing::debug!(stream = id, "ADS stream dropped");
                } else {
                    tracing::info!(stream = id, node = %node_id, "ADS stream dropped");
                }
                return;
            }
        }
        let pending = st.pending();
        let pushed = !pending.is_empty();
        for resp in pending {
            let (type_url, version, nonce, resources) = P::describe(&resp);
            tracing::debug!(
                stream = id,
                type_url,
                version,
                nonce,
                resources,
                since_change_us = changed_at.elapsed().as_micros() as u64,
                "push"
            );
            let label = TypeLabel {
                type_url: type_url.to_string(),
            };
            if let Some(k) = kind::from_type_url(type_url) {
                pushed_at[k.index()] = Some((nonce.to_string(), Instant::now()));
                if !std::mem::replace(&mut answered[k.index()], true) {
                    metrics
                        .xds_initial_resources
                        .get_or_create(&label)
                        .inc_by(resources as u64);
                    // A proxy reconnecting to a snapshot it holds gets none over delta ADS.
                    tracing::info!(stream = id, node = %node_id, type_url, resources, "first answer of the type on this stream");
                }
            }
            metrics.xds_pushes.get_or_create(&label).inc();
            metrics
                .xds_resources
                .get_or_create(&label)
                .inc_by(resources as u64);
            if tx.send(Ok(resp)).await.is_err() {
                return;
            }
        }
        if std::mem::take(&mut restated) {
            let Some(answer) = P::handover_answer(resume::RESTATED_NONCE) else {
                return;
            };
            if tx.send(Ok(answer)).await.is_err() {
                return;
            }
        }
        if st.acked_current() {
            acks.publish(st.current());
        }
        // The worker runs on one thread: what was just queued goes out only when this task
        // lets the connection's task run. Without this, the next request already read
        // (a resume's next type: at 10,000 services, 8 ms of names) was worked through
        // first, and the proxy got this answer that much later, instead of applying it
        // meanwhile.
        if pushed {
            tokio::task::yield_now().await;
        }
    }
}

/// Ends a stream with `status`. A proxy that reads no responses would keep the task, and
/// what it holds, waiting for room in the channel; it gets a second.
async fn end_with<T>(tx: &mpsc::Sender<Result<T, Status>>, status: Status) {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), tx.send(Err(status))).await;
}

fn record(
    id: u64,
    node: &str,
    ev: Event,
    metrics: &Metrics,
    pushed_at: &[Option<(String, Instant)>; KIND_COUNT],
) {
    let label = |k: Kind| TypeLabel {
        type_url: kind::type_url(k).to_string(),
    };
    match ev {
        Event::Subscribe { kind, version, .. } => {
            tracing::debug!(stream = id, node, type_url = kind::type_url(kind), held_version = %version, "subscribe")
        }
        Event::Ack {
            kind,
            version,
            nonce,
        } => {
            metrics.xds_acks.get_or_create(&label(kind)).inc();
            // Only the type's latest response on the stream is timed: an ACK of an earlier
            // one, overtaken by a newer push, is not observed.
            let push_to_ack = pushed_at[kind.index()]
                .as_ref()
                .filter(|(n, _)| *n == nonce)
                .map(|(_, t)| t.elapsed());
            if let Some(took) = push_to_ack {
                metrics.observe_push_ack(kind.short(), took);
            }
            let push_to_ack_us = push_to_ack.map(|d| d.as_micros() as u64);
            tracing::debug!(stream = id, node, type_url = kind::type_url(kind), %version, %nonce, ?push_to_ack_us, "ACK");
        }
        Event::Nack {
            kind,
            rejected_version,
            nonce,
            message,
        } => {
            metrics.xds_nacks.get_or_create(&label(kind)).inc();
            tracing::warn!(stream = id, node, type_url = kind::type_url(kind), %nonce, %rejected_version,
                error_detail = %message, "NACK: the proxy rejected {} and keeps its last good config", kind.short());
        }
        Event::Stale { kind, nonce } => {
            tracing::debug!(stream = id, node, type_url = kind::type_url(kind), %nonce, "stale nonce, ignored")
        }
        Event::UnknownType { type_url } => {
            tracing::debug!(stream = id, node, %type_url, "request for a type not served, ignored")
        }
    }
}

/// The ADS service for tonic's router.
#[derive(Clone)]
struct AdsServer(Arc<Ads>);

impl NamedService for AdsServer {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

/// One streaming method of the service, for either protocol.
struct Method<P>(Arc<Ads>, PhantomData<fn() -> P>);

impl<P: Served> StreamingService<P::Wire> for Method<P> {
    type Response = P::Response;
    type ResponseStream = ResponseStream<P::Response>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<P::Wire>>) -> Self::Future {
        let ads = self.0.clone();
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let offer = header(resume::HEADER);
        let overlap = header(resume::HANDOVER_HEADER).as_deref() == Some(resume::OVERLAP);
        Box::pin(async move {
            let (stream, answer, overlap) = ads
                .open::<P>(request.into_inner(), offer.as_deref(), overlap)
                .await;
            let mut response = Response::new(stream);
            if let Some(value) = answer.and_then(|a| a.parse().ok()) {
                response.metadata_mut().insert(resume::HEADER, value);
            }
            if overlap {
                response.metadata_mut().insert(
                    resume::HANDOVER_HEADER,
                    tonic::metadata::MetadataValue::from_static(resume::OVERLAP),
                );
            }
            Ok(response)
        })
    }
}

/// Serves one call of `P`'s method: requests decode into `P::Wire`.
fn streaming<P: Served, B>(
    ads: Arc<Ads>,
    req: http::Request<B>,
) -> BoxFuture<http::Response<tonic::body::Body>, Infallible>
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    Box::pin(async move {
        let mut grpc = Grpc::new(ProstCodec::<P::Response, P::Wire>::default())
            .apply_max_message_size_config(Some(ads.limits.max_request), None);
        Ok(grpc.streaming(Method::<P>(ads, PhantomData), req).await)
    })
}

impl<B> tonic::codegen::Service<http::Request<B>> for AdsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let ads = self.0.clone();
        match req.uri().path() {
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources" => {
                streaming::<StreamState, B>(ads, req)
            }
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources" => {
                streaming::<DeltaState, B>(ads, req)
            }
            _ => Box::pin(async move {
                let mut response = http::Response::new(tonic::body::Body::default());
                let headers = response.headers_mut();
                headers.insert(
                    Status::GRPC_STATUS,
                    (tonic::Code::Unimplemented as i32).into(),
                );
                headers.insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                Ok(response)
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{UnixListener, UnixStream};

    use super::*;
    use aether_model::{Inputs, build};

    use crate::xds::probe::{H2_PREFACE, await_server};

    fn start(
        listener: UnixListener,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<anyhow::Result<()>>,
    ) {
        let (_tx, snapshots) = watch::channel(Arc::new(build(&Inputs::default())));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            snapshots,
            Arc::default(),
            Acks::default(),
            Metrics::new(),
            None,
            async move {
                let _ = stopped.await;
            },
            Limits::default(),
            Resume::default(),
            Handover::default(),
        ));
        (stop, task)
    }

    /// Reads HTTP/2 frames until one of `kind` with `flags` arrives.
    async fn read_until_frame(conn: &mut UnixStream, kind: u8, flags: u8) {
        loop {
            let mut header = [0u8; 9];
            conn.read_exact(&mut header).await.expect("frame header");
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await.expect("frame payload");
            if header[3] == kind && header[4] & flags == flags {
                return;
            }
        }
    }

    #[tokio::test]
    async fn await_server_answers_only_once_someone_serves_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xds.sock");
        let err = await_server(&path, Duration::from_millis(200))
            .await
            .expect_err("no socket file");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");

        // Bound and listening, but nobody accepts: the connect queues and nothing answers.
        let listener = UnixListener::bind(&path).unwrap();
        let err = await_server(&path, Duration::from_millis(200))
            .await
            .expect_err("nobody accepts");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");

        let (_stop, _task) = start(listener);
        await_server(&path, Duration::from_secs(5))
            .await
            .expect("the ADS server answers");
    }

    #[tokio::test]
    async fn await_server_refuses_a_socket_that_does_not_speak_http2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xds.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                .await
                .unwrap();
        });
        let err = await_server(&path, Duration::from_secs(5))
            .await
            .expect_err("not HTTP/2");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
    }

    use crate::accept::test_helpers::{MAX_CONCURRENT_STREAMS, h2_settings, until};
    use crate::metrics::SocketLabel;
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;

    /// The ADS server with `limits` on a socket in `dir`, handed over through
    /// `handover`; its metrics.
    fn start_limited(
        dir: &std::path::Path,
        limits: Limits,
        handover: Handover,
    ) -> (
        std::path::PathBuf,
        Arc<Metrics>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let path = dir.join("xds.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, snapshots) = watch::channel(Arc::new(build(&Inputs::default())));
        let metrics = Metrics::new();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let m = metrics.clone();
        tokio::spawn(async move {
            let _keep = tx;
            serve(
                listener,
                snapshots,
                Arc::default(),
                Acks::default(),
                m,
                None,
                async move {
                    let _ = stopped.await;
                },
                limits,
                Resume::default(),
                handover,
            )
            .await
        });
        (path, metrics, stop)
    }

    async fn client(
        path: &std::path::Path,
    ) -> AggregatedDiscoveryServiceClient<tonic::transport::Channel> {
        let path = path.to_path_buf();
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        });
        let channel = tonic::transport::Endpoint::from_static("http://xds.invalid")
            .connect_with_connector(connector)
            .await
            .unwrap();
        AggregatedDiscoveryServiceClient::new(channel)
    }

    fn eds(names: &[&str]) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node: Some(Node {
                id: "proxy-1".into(),
                ..Default::default()
            }),
            type_url: kind::type_url(Kind::Endpoint).into(),
            resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        }
    }

    /// A cold owner's first offer waits for the snapshot's digests (the heavy-work
    /// thread's walk of every resource) off the runtime thread: on the same
    /// single-threaded runtime a proxy's stream is answered meanwhile, and the relay's
    /// once the walk is done, with the answer the digests give.
    #[tokio::test]
    async fn an_offer_waits_for_the_digests_off_the_runtime_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xds.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let snapshot = Arc::new(build(&Inputs::default()));
        let (_keep, snapshots) = watch::channel(snapshot.clone());
        let (encoded, metrics) = (Arc::<Encoded>::default(), Metrics::new());
        tokio::spawn(serve(
            listener,
            snapshots,
            encoded.clone(),
            Acks::default(),
            metrics.clone(),
            None,
            std::future::pending::<()>(),
            Limits::default(),
            Resume::Digest,
            Handover::default(),
        ));

        // The walk: holds the digests' lock until released (or for 10 s, and says so).
        let (release, released) = std::sync::mpsc::channel::<()>();
        let (walking_tx, walking) = tokio::sync::oneshot::channel();
        let walk = std::thread::spawn({
            let encoded = encoded.clone();
            move || {
                encoded.digests.while_walking(|| {
                    walking_tx.send(()).unwrap();
                    released.recv_timeout(Duration::from_secs(10)).is_ok()
                })
            }
        });
        walking.await.unwrap();

        let ads = client(&path).await;
        let open = |offer: Option<&'static str>| {
            let mut ads = ads.clone();
            async move {
                let (tx, rx) = mpsc::channel(4);
                tx.send(eds(&["a"])).await.unwrap();
                let mut request = tonic::Request::new(ReceiverStream::new(rx));
                if let Some(offer) = offer {
                    request
                        .metadata_mut()
                        .insert(resume::HEADER, offer.parse().unwrap());
                }
                let response = ads.delta_aggregated_resources(request).await.unwrap();
                let header = response.metadata().get(resume::HEADER).cloned();
                (tx, header, response.into_inner())
            }
        };
        let offer = "type.googleapis.com/envoy.config.cluster.v3.Cluster=0";
        let relay = tokio::spawn(open(Some(offer)));
        fn within<F: Future>(f: F) -> tokio::time::Timeout<F> {
            tokio::time::timeout(Duration::from_secs(10), f)
        }
        within(async {
            while metrics.xds_offers_waiting.get() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the relay's offer waits for the digests");

        let (_proxy_tx, header, mut proxy) =
            within(open(None)).await.expect("the proxy's stream opens");
        assert!(header.is_none(), "a proxy's stream has no resume header");
        assert!(
            within(proxy.message())
                .await
                .expect("answered")
                .unwrap()
                .is_some(),
            "the proxy's stream is answered while the offer waits"
        );
        assert!(!relay.is_finished(), "the offer waits for the walk");

        release.send(()).unwrap();
        assert!(walk.join().unwrap(), "the walk was released, not timed out");
        let (_relay_tx, header, _relay) = within(relay).await.expect("answered").unwrap();
        let expected = super::super::digest::header(&encoded.digests.matched(&snapshot, offer));
        assert_eq!(header.unwrap().to_str().unwrap(), expected);
        assert_eq!(metrics.xds_offers_waiting.get(), 0);
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_once_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let (path, metrics, _stop) = start_limited(
            dir.path(),
            Limits {
                max_connections: 2,
                ..Limits::default()
            },
            Handover::default(),
        );
        let label = SocketLabel {
            socket: "xds".into(),
        };
        let mut first = UnixStream::connect(&path).await.unwrap();
        let mut second = UnixStream::connect(&path).await.unwrap();
        for conn in [&mut first, &mut second] {
            let settings = h2_settings(conn).await.expect("admitted under the cap");
            assert!(
                settings.contains(&(MAX_CONCURRENT_STREAMS, MAX_STREAMS_PER_CONNECTION)),
                "{settings:?}"
            );
        }
        let mut third = UnixStream::connect(&path).await.unwrap();
        assert_eq!(
            h2_settings(&mut third).await,
            None,
            "past the cap: closed without a byte"
        );
        assert_eq!(metrics.connections_refused.get_or_create(&label).get(), 1);
        assert_eq!(metrics.connections.get_or_create(&label).get(), 2);

        drop(first);
        until("the closed connection's slot is given back", || {
            metrics.connections.get_or_create(&label).get() == 1
        })
        .await;
        let mut fourth = UnixStream::connect(&path).await.unwrap();
        assert!(
            h2_settings(&mut fourth).await.is_some(),
            "a slot was free again"
        );
    }

    #[tokio::test]
    async fn a_delta_stream_past_a_subscription_limit_ends_with_resource_exhausted_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let subscriptions = SubscriptionLimits {
            max_names: 3,
            max_name_len: 32,
        };
        let (path, metrics, _stop) = start_limited(
            dir.path(),
            Limits {
                subscriptions,
                ..Limits::default()
            },
            Handover::default(),
        );
        let mut ads = client(&path).await;

        let (tx, rx) = mpsc::channel(4);
        tx.send(eds(&["a", "b"])).await.unwrap();
        let mut responses = ads
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(
            responses.message().await.unwrap().is_some(),
            "a fresh subscription is answered"
        );
        tx.send(eds(&["c", "d"])).await.unwrap();
        let err = responses.message().await.expect_err("a fourth name");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert_eq!(
            err.message(),
            "delta ADS stream refused: type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment: subscribing to 4 resource names is over the limit of 3 per type and stream"
        );

        // A name over the length limit, on a new stream.
        let (tx, rx) = mpsc::channel(4);
        let long = "n".repeat(33);
        tx.send(eds(&[&long])).await.unwrap();
        let mut responses = ads
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let err = responses.message().await.expect_err("a 33-byte name");
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
        assert!(
            err.message().contains("is 33 bytes, over the limit of 32"),
            "{}",
            err.message()
        );

        let count = |limit: &str| {
            let label = LimitLabel {
                type_url: kind::type_url(Kind::Endpoint).into(),
                limit: limit.into(),
            };
            metrics
                .xds_subscription_refusals
                .get_or_create(&label)
                .get()
        };
        assert_eq!((count("names"), count("name_length")), (1, 1));
    }

    /// At a handover the relay's stream (it opened with the resume header) ends with
    /// UNAVAILABLE naming the handover, and the owner waits for the relay to close its
    /// side; a proxy's own stream is left to this process's exit and still answers.
    #[tokio::test]
    async fn a_handover_ends_the_relays_streams_and_leaves_the_proxys() {
        let dir = tempfile::tempdir().unwrap();
        let handover = Handover::default();
        let (path, _metrics, _stop) =
            start_limited(dir.path(), Limits::default(), handover.clone());
        let ads = client(&path).await;
        let open = |relay: bool| {
            let mut ads = ads.clone();
            async move {
                let (tx, rx) = mpsc::channel(4);
                tx.send(eds(&["a"])).await.unwrap();
                let mut request = tonic::Request::new(ReceiverStream::new(rx));
                if relay {
                    request
                        .metadata_mut()
                        .insert(resume::HEADER, "".parse().unwrap());
                }
                let responses = ads
                    .delta_aggregated_resources(request)
                    .await
                    .unwrap()
                    .into_inner();
                (tx, responses)
            }
        };
        let (relay_tx, mut relay) = open(true).await;
        let (proxy_tx, mut proxy) = open(false).await;
        for answers in [&mut relay, &mut proxy] {
            assert!(answers.message().await.unwrap().is_some(), "answered");
        }

        let ending = tokio::spawn({
            let handover = handover.clone();
            async move { handover.end_relay_streams().await }
        });
        let within = |f| tokio::time::timeout(Duration::from_secs(10), f);
        let err = within(relay.message())
            .await
            .expect("the relay's stream ends")
            .expect_err("with a status");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
        assert_eq!(err.message(), resume::HANDED_OVER);
        assert!(
            !ending.is_finished(),
            "the owner waits for the relay to close its side"
        );
        drop((relay_tx, relay));
        assert_eq!(ending.await.unwrap(), (1, true), "one relay stream, closed");

        // The proxy's stream still answers: a name the snapshot lacks is removed at once.
        proxy_tx.send(eds(&["b"])).await.unwrap();
        let answer = proxy
            .message()
            .await
            .unwrap()
            .expect("the proxy's stream answers");
        assert_eq!(answer.removed_resources, ["b"]);
        // A relay stream opened after the handover ends at once.
        let (_tx, mut late) = open(true).await;
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Err(e) = late.message().await {
                    return e;
                }
            }
        });
        let ended = ended.await.expect("a late relay stream ends at once");
        assert_eq!(ended.message(), resume::HANDED_OVER);
    }

    #[tokio::test]
    async fn a_relay_taking_the_overlap_is_told_in_band_and_served_until_it_closes_its_side() {
        let dir = tempfile::tempdir().unwrap();
        let handover = Handover::default();
        let (path, _metrics, _stop) =
            start_limited(dir.path(), Limits::default(), handover.clone());
        let ads = client(&path).await;
        let open = |overlap: bool| {
            let mut ads = ads.clone();
            async move {
                let (tx, rx) = mpsc::channel(4);
                tx.send(eds(&["a"])).await.unwrap();
                let mut request = tonic::Request::new(ReceiverStream::new(rx));
                request
                    .metadata_mut()
                    .insert(resume::HEADER, "".parse().unwrap());
                if overlap {
                    request
                        .metadata_mut()
                        .insert(resume::HANDOVER_HEADER, resume::OVERLAP.parse().unwrap());
                }
                let response = ads.delta_aggregated_resources(request).await.unwrap();
                let agreed = response
                    .metadata()
                    .get(resume::HANDOVER_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .map(String::from);
                (tx, response.into_inner(), agreed)
            }
        };
        let (tx, mut relay, agreed) = open(true).await;
        assert_eq!(agreed.as_deref(), Some(resume::OVERLAP), "the agent agrees");
        let (_plain_tx, mut plain, agreed) = open(false).await;
        assert_eq!(agreed, None, "only when asked");
        for answers in [&mut relay, &mut plain] {
            assert!(answers.message().await.unwrap().is_some(), "answered");
        }
        fn within<F: Future>(f: F) -> tokio::time::Timeout<F> {
            tokio::time::timeout(Duration::from_secs(10), f)
        }

        handover.begin_overlap();
        let told = within(relay.message())
            .await
            .expect("told in-band")
            .unwrap()
            .expect("an answer, not the end");
        assert_eq!(
            (
                told.type_url.as_str(),
                told.nonce.as_str(),
                told.resources.len()
            ),
            (resume::HANDOVER_TYPE, resume::HANDED_OVER_NONCE, 0)
        );
        // The successor serves: the other relay's stream ends, this one carries on.
        let ending = tokio::spawn({
            let handover = handover.clone();
            async move { handover.end_relay_streams().await }
        });
        let err = within(plain.message())
            .await
            .expect("the plain relay's stream ends")
            .expect_err("with a status");
        assert_eq!(err.message(), resume::HANDED_OVER);
        drop(plain);
        // Still served: a name the snapshot lacks is removed at once, and the relay's own
        // request is answered after what the requests before it were owed.
        tx.send(eds(&["b"])).await.unwrap();
        tx.send(DeltaDiscoveryRequest {
            type_url: resume::HANDOVER_TYPE.into(),
            ..Default::default()
        })
        .await
        .unwrap();
        let answer = within(relay.message()).await.unwrap().unwrap().unwrap();
        assert_eq!(answer.removed_resources, ["b"]);
        let restated = within(relay.message()).await.unwrap().unwrap().unwrap();
        assert_eq!(
            (restated.type_url.as_str(), restated.nonce.as_str()),
            (resume::HANDOVER_TYPE, resume::RESTATED_NONCE)
        );
        assert!(
            !ending.is_finished(),
            "the owner waits for the relay to close its side"
        );
        drop((tx, relay));
        assert_eq!(
            ending.await.unwrap(),
            (2, true),
            "two relay streams, both closed"
        );
    }

    #[tokio::test]
    async fn a_request_over_the_size_limit_ends_its_stream_with_out_of_range() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _metrics, _stop) = start_limited(
            dir.path(),
            Limits {
                max_request: 4096,
                ..Limits::default()
            },
            Handover::default(),
        );
        let mut ads = client(&path).await;
        let (tx, rx) = mpsc::channel(4);
        let mut big = eds(&["a"]);
        big.node.as_mut().unwrap().id = "n".repeat(5000);
        tx.send(big).await.unwrap();
        let mut responses = ads
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let err = responses.message().await.expect_err("over the size limit");
        assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
        assert!(
            err.message().contains("the limit is: 4096 bytes"),
            "{}",
            err.message()
        );
    }

    #[tokio::test]
    async fn stopping_closes_the_listener_and_keeps_open_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xds.sock");
        let (stop, task) = start(UnixListener::bind(&path).unwrap());
        let mut open = UnixStream::connect(&path).await.unwrap();
        open.write_all(H2_PREFACE).await.unwrap();
        read_until_frame(&mut open, 0x04, 0).await;

        stop.send(()).unwrap();
        task.await
            .unwrap()
            .expect("serve returns once it stops accepting");
        let refused = UnixStream::connect(&path)
            .await
            .expect_err("the listener is closed");
        assert_eq!(
            refused.kind(),
            std::io::ErrorKind::ConnectionRefused,
            "{refused}"
        );

        // The connection accepted before still answers: PING, then its ACK.
        open.write_all(b"\0\0\x08\x06\0\0\0\0\0aether!!")
            .await
            .unwrap();
        tokio::time::timeout(
            Duration::from_secs(5),
            read_until_frame(&mut open, 0x06, 0x01),
        )
        .await
        .expect("PING ACK on the open connection");
    }
}
