//! The driver: Envoy's ADS streams served on the relay's socket, each with its own
//! succession of agent streams behind it. Every decision is the session's
//! ([`crate::session`]); this file moves bytes and keeps time.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tonic::codec::Streaming;
use tonic::transport::Endpoint;

use crate::metrics::Metrics;
use crate::session::{Core, Send};
use crate::wire::{DELTA_PATH, Framed, RawCodec, SOTW_PATH};
use shared_proto::resume;

/// Requests queued for an agent stream while it opens. Past it the stream is dropped
/// and a new one re-states the session, which has folded every request in: nothing is
/// lost, the queue stays bounded.
pub const UPSTREAM_QUEUE: usize = 1024;
/// Answers queued for Envoy: the relay reads the agent no faster than Envoy takes.
const ENVOY_QUEUE: usize = 16;
/// Connect attempts made at once before backing off: a roll's new owner answers from
/// the socket's backlog, so a refused connect means the socket file itself is missing.
const QUICK_RETRIES: u32 = 3;
const BACKOFF_BASE: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What every session needs.
pub struct Relay {
    pub upstream: PathBuf,
    pub grace: Duration,
    pub max_message: usize,
    pub metrics: Arc<Metrics>,
}

type ToEnvoy<C> = mpsc::Sender<Result<Framed<<C as Core>::Resp>, Status>>;
type Requests<C> = Streaming<Framed<<C as Core>::Req>>;
type Answers<C> = Streaming<Framed<<C as Core>::Resp>>;
type Queue<C> = mpsc::Sender<Framed<<C as Core>::Req>>;

/// Runs one Envoy stream's session until Envoy goes, or the grace without an agent ends
/// it.
pub async fn session<C: Core>(relay: Arc<Relay>, mut envoy: Requests<C>, tx: ToEnvoy<C>) {
    let m = &relay.metrics;
    m.envoy_streams.fetch_add(1, Relaxed);
    match C::API {
        "sotw" => &m.sotw_streams,
        _ => &m.delta_streams,
    }
    .fetch_add(1, Relaxed);
    let _gone = Defer(|| {
        relay.metrics.envoy_streams.fetch_sub(1, Relaxed);
    });
    let mut s = C::default();
    let mut recorded = crate::session::Counts::default();
    let mut failures = 0u32;
    let mut down_since = Instant::now();
    // The next agent stream, opened and re-stated while the old one still carried (an
    // overlapping handover): no time without one.
    let mut carried_over: Option<(Answers<C>, Queue<C>)> = None;
    loop {
        let overlapped = carried_over.is_some();
        let opened = match carried_over.take() {
            Some(next) => Some(next),
            None => {
                // The stream opens with the digest offer in its request header; the
                // agent's answer is in its response header, read before anything is
                // sent. Envoy's requests meanwhile are folded into the session, and the
                // re-statement that follows carries them.
                let (up_tx, up_rx) = mpsc::channel(UPSTREAM_QUEUE);
                let connect = open::<C>(&relay, up_rx, s.offer());
                tokio::pin!(connect);
                let grace_end = tokio::time::Instant::from_std(down_since + relay.grace);
                loop {
                    tokio::select! {
                        opened = &mut connect => match opened {
                            Ok(o) => {
                                if queue::<C>(&up_tx, s.upstream_up(o.matched.as_deref())) {
                                    break Some((o.answers, up_tx));
                                }
                                break None;
                            }
                            Err(e) => {
                                failures += 1;
                                m.upstream_failures.fetch_add(1, Relaxed);
                                tracing::warn!(upstream = %relay.upstream.display(), error = %format!("{e:#}"), failures, "relay: the agent's ADS stream did not open");
                                break None;
                            }
                        },
                        req = envoy.message() => match req {
                            Ok(Some(req)) => {
                                let folded = s.on_envoy(req);
                                debug_assert!(folded.is_empty(), "nothing is sent while no agent stream is up");
                            }
                            Ok(None) => return,
                            Err(e) => {
                                tracing::info!(error = %e, "relay: Envoy's stream ended");
                                return;
                            }
                        },
                        () = tokio::time::sleep_until(grace_end) => {
                            m.grace_ends.fetch_add(1, Relaxed);
                            tracing::error!(grace = ?relay.grace, upstream = %relay.upstream.display(), "relay: no agent answered within the grace; ending Envoy's stream so that its own signals show it");
                            let _ = tx.send(Err(Status::unavailable(format!("no control plane at {} for {:?}", relay.upstream.display(), relay.grace)))).await;
                            return;
                        }
                    }
                }
            }
        };
        if let Some((mut answers, up_tx)) = opened {
            failures = 0;
            m.upstream_streams.fetch_add(1, Relaxed);
            m.upstream_connected.store(1, Relaxed);
            m.record(&s.counts(), &mut recorded);
            // An overlap's switch leaves no time without an agent stream.
            let gap = if overlapped {
                Duration::ZERO
            } else {
                down_since.elapsed()
            };
            m.note_gap(gap);
            tracing::info!(
                api = C::API,
                gap_ms = gap.as_secs_f64() * 1e3,
                resumes = s.counts().resumes,
                "relay: agent stream open"
            );
            let ended = pump::<C>(&mut s, &mut envoy, &mut answers, &up_tx, &tx).await;
            m.record(&s.counts(), &mut recorded);
            let why = match ended {
                Ended::Envoy => return,
                Ended::Agent(why) => why,
                Ended::HandedOver => {
                    match overlap::<C>(&relay, &mut s, &mut envoy, &tx, &mut answers, &up_tx).await
                    {
                        Overlapped::Switched { next, overlapped } => {
                            // The old stream closes as its queue and answers drop here.
                            m.switches.fetch_add(1, Relaxed);
                            m.overlap_switches.fetch_add(u64::from(overlapped), Relaxed);
                            m.note_end();
                            carried_over = Some(*next);
                            continue;
                        }
                        Overlapped::Envoy => return,
                        Overlapped::Broken(why) => why,
                    }
                }
            };
            m.upstream_connected.store(0, Relaxed);
            down_since = Instant::now();
            m.note_end();
            m.switches.fetch_add(1, Relaxed);
            tracing::info!(why, "relay: the agent's stream ended; opening the next");
        }
        s.upstream_down();
        if failures > QUICK_RETRIES {
            let wait = BACKOFF_BASE
                .saturating_mul(1 << (failures - QUICK_RETRIES).min(7))
                .min(BACKOFF_MAX);
            tokio::time::sleep(wait).await;
        }
    }
}

enum Ended {
    Envoy,
    Agent(&'static str),
    /// The agent handed the node over in-band: its stream carries on while the next one
    /// opens ([`overlap`]).
    HandedOver,
}

/// Relays both ways until one side ends, or the agent hands over in-band.
async fn pump<C: Core>(
    s: &mut C,
    envoy: &mut Requests<C>,
    answers: &mut Answers<C>,
    up: &Queue<C>,
    tx: &ToEnvoy<C>,
) -> Ended {
    loop {
        let out = tokio::select! {
            req = envoy.message() => match req {
                Ok(Some(req)) => s.on_envoy(req),
                _ => return Ended::Envoy,
            },
            answer = answers.message() => match answer {
                Ok(Some(a)) if C::handover_nonce(&a.view) == Some(resume::HANDED_OVER_NONCE) => {
                    return Ended::HandedOver;
                }
                Ok(Some(a)) => s.on_agent(a),
                Ok(None) => return Ended::Agent("closed"),
                Err(e) if e.message() == resume::HANDED_OVER => {
                    return Ended::Agent("handed over");
                }
                Err(_) => return Ended::Agent("reset"),
            },
        };
        if let Err(e) = deliver::<C>(out, up, None, tx).await {
            return e;
        }
    }
}

/// Sends what the session returned: requests to the current agent stream (and to the
/// next one in an overlap), answers to Envoy.
async fn deliver<C: Core>(
    out: Vec<Send<C::Req, C::Resp>>,
    up: &Queue<C>,
    next: Option<&Queue<C>>,
    tx: &ToEnvoy<C>,
) -> Result<(), Ended> {
    for o in out {
        match o {
            Send::Upstream(r) => {
                if up.try_send(r).is_err() {
                    return Err(Ended::Agent("queue full"));
                }
            }
            Send::Next(r) => {
                // Only an overlap's re-statement makes these, and its queue is open.
                if let Some(next) = next {
                    let _ = next.try_send(r);
                }
            }
            Send::Envoy(a) => {
                if tx.send(Ok(a)).await.is_err() {
                    return Err(Ended::Envoy);
                }
            }
        }
    }
    Ok(())
}

/// Next streams re-stated afresh in one overlap before the relay gives it up and
/// switches the plain way.
const OVERLAP_ATTEMPTS: u32 = 4;
/// Answers of the next stream held back until the switch, and their bytes; past either
/// the overlap is given up (the session stays whole: the plain switch re-states
/// everything). The bytes are those of one answer of the largest size taken.
const HELD_BACK_MAX: usize = 4096;
const HELD_BACK_BYTES: usize = 256 << 20;

enum Overlapped<C: Core> {
    /// The next stream serves; the old one is to be closed. `overlapped`: the next one
    /// was re-stated while the old one carried (else the successor lacks the overlap, or
    /// the old stream ended first, and the switch was the plain one, onto the stream
    /// already open).
    Switched {
        next: Box<(Answers<C>, Queue<C>)>,
        overlapped: bool,
    },
    Envoy,
    /// No switch in overlap: the plain one follows, as after a stream's end.
    Broken(&'static str),
}

impl<C: Core> From<Ended> for Overlapped<C> {
    /// A delivery that failed: Envoy gone, or an agent stream's queue full.
    fn from(e: Ended) -> Self {
        match e {
            Ended::Envoy => Overlapped::Envoy,
            _ => Overlapped::Broken("queue full"),
        }
    }
}

/// The overlapping handover (`shared_proto::resume`, "Overlap"): the old agent stream
/// `old` carries on (its answers to Envoy, Envoy's requests to it) while the next one
/// opens, in the socket's backlog until the successor accepts. The next stream is
/// re-stated once nothing forwarded to Envoy is unanswered; its answers are held back
/// until its agent says it has answered the re-statement, and then forwarded at the
/// switch. If the old stream carried a change to Envoy after the re-statement, the next
/// stream is dropped and a fresh one re-stated.
async fn overlap<C: Core>(
    relay: &Relay,
    s: &mut C,
    envoy: &mut Requests<C>,
    tx: &ToEnvoy<C>,
    old: &mut Answers<C>,
    old_up: &Queue<C>,
) -> Overlapped<C> {
    let m = &relay.metrics;
    tracing::debug!(
        "relay: the agent handed the node over; its stream carries on while the next opens"
    );
    for _ in 0..OVERLAP_ATTEMPTS {
        let (next_tx, next_rx) = mpsc::channel(UPSTREAM_QUEUE);
        let connect = open::<C>(relay, next_rx, s.offer());
        tokio::pin!(connect);
        let mut next: Option<(Answers<C>, Option<String>)> = None;
        let mut restated = false;
        let mut held_back: Vec<Framed<C::Resp>> = Vec::new();
        let mut held_bytes = 0usize;
        loop {
            tokio::select! {
                opened = &mut connect, if next.is_none() => match opened {
                    Ok(o) if o.overlap => next = Some((o.answers, o.matched)),
                    // A successor without the overlap (mid-roll skew).
                    Ok(o) => return plain_switch::<C>(s, o.answers, o.matched, next_tx),
                    Err(e) => {
                        m.upstream_failures.fetch_add(1, Relaxed);
                        tracing::warn!(upstream = %relay.upstream.display(), error = %format!("{e:#}"), "relay: the next agent stream did not open in the overlap");
                        return Overlapped::Broken("the next stream did not open");
                    }
                },
                req = envoy.message() => match req {
                    Ok(Some(req)) => {
                        let out = s.on_envoy(req);
                        let next_q = restated.then_some(&next_tx);
                        if let Err(e) = deliver::<C>(out, old_up, next_q, tx).await {
                            return e.into();
                        }
                    }
                    _ => return Overlapped::Envoy,
                },
                answer = old.message() => match answer {
                    Ok(Some(a)) if C::handover_nonce(&a.view).is_some() => {}
                    Ok(Some(a)) => {
                        let out = s.on_agent(a);
                        if let Err(e) = deliver::<C>(out, old_up, None, tx).await {
                            return e.into();
                        }
                    }
                    // The old owner ended its side first (its bound, or its exit).
                    _ => {
                        return match next.take() {
                            Some((answers, _)) if restated && s.next_holds() => {
                                switch::<C>(s, held_back, answers, next_tx, tx).await
                            }
                            Some((answers, matched)) if !restated => {
                                plain_switch::<C>(s, answers, matched, next_tx)
                            }
                            _ => Overlapped::Broken("the old stream ended in the overlap"),
                        };
                    }
                },
                answer = async { next.as_mut().expect("guarded").0.message().await }, if next.is_some() => match answer {
                    Ok(Some(a)) if C::handover_nonce(&a.view) == Some(resume::RESTATED_NONCE) => {
                        if s.next_holds() {
                            let (answers, _) = next.take().expect("guarded");
                            return switch::<C>(s, held_back, answers, next_tx, tx).await;
                        }
                        m.overlap_restarts.fetch_add(1, Relaxed);
                        tracing::debug!("relay: the old stream carried a change after the next one's re-statement; re-stating on a fresh one");
                        s.abandon_next();
                        break;
                    }
                    Ok(Some(a)) => {
                        held_bytes += a.bytes.len();
                        held_back.push(a);
                        if held_back.len() > HELD_BACK_MAX || held_bytes > HELD_BACK_BYTES {
                            return Overlapped::Broken("too much held back");
                        }
                    }
                    _ => {
                        tracing::debug!("relay: the next agent stream ended in the overlap; opening another");
                        s.abandon_next();
                        break;
                    }
                },
            }
            // The re-statement, once the next stream is open and Envoy has answered
            // everything forwarded to it: then the session states what Envoy holds.
            if !restated
                && s.quiet()
                && let Some((_, matched)) = &mut next
            {
                let matched = matched.take();
                let mut out = s.restate_next(matched.as_deref());
                out.push(Send::Next(C::restated_request()));
                let all = out.into_iter().all(|o| match o {
                    Send::Next(r) => next_tx.try_send(r).is_ok(),
                    _ => true,
                });
                if !all {
                    return Overlapped::Broken("queue full");
                }
                restated = true;
            }
        }
    }
    Overlapped::Broken("the overlap did not settle")
}

/// The plain switch, onto the stream already opened in the overlap: the session
/// re-stated on it as after a stream's end.
fn plain_switch<C: Core>(
    s: &mut C,
    answers: Answers<C>,
    matched: Option<String>,
    up: Queue<C>,
) -> Overlapped<C> {
    s.upstream_down();
    if !queue::<C>(&up, s.upstream_up(matched.as_deref())) {
        return Overlapped::Broken("queue full");
    }
    Overlapped::Switched {
        next: Box::new((answers, up)),
        overlapped: false,
    }
}

/// The overlap's switch: the next stream becomes the current one, and its answers held
/// back go to Envoy in the order they came.
async fn switch<C: Core>(
    s: &mut C,
    held_back: Vec<Framed<C::Resp>>,
    answers: Answers<C>,
    up: Queue<C>,
    tx: &ToEnvoy<C>,
) -> Overlapped<C> {
    s.switch_next();
    tracing::info!(
        held_back = held_back.len(),
        "relay: switched to the next agent stream with the old one still carrying (overlap)"
    );
    for a in held_back {
        if let Err(e) = deliver::<C>(s.on_agent(a), &up, None, tx).await {
            return e.into();
        }
    }
    Overlapped::Switched {
        next: Box::new((answers, up)),
        overlapped: true,
    }
}

/// Queues requests for the agent stream being opened; false when the queue is full.
fn queue<C: Core>(up: &Queue<C>, out: Vec<Send<C::Req, C::Resp>>) -> bool {
    out.into_iter().all(|o| match o {
        Send::Upstream(r) => up.try_send(r).is_ok(),
        // The session answers Envoy only from the agent's answers, and re-states a next
        // stream only in an overlap.
        Send::Envoy(_) | Send::Next(_) => true,
    })
}

/// An agent stream just opened.
struct Opened<C: Core> {
    answers: Answers<C>,
    /// The agent's answer to the digest offer.
    matched: Option<String>,
    /// The agent takes the overlapping handover on this stream.
    overlap: bool,
}

/// Opens an agent stream over the node's socket. The connect waits in the socket's
/// backlog until an owner accepts.
async fn open<C: Core>(
    relay: &Relay,
    requests: mpsc::Receiver<Framed<C::Req>>,
    offer: Option<String>,
) -> anyhow::Result<Opened<C>> {
    let path = relay.upstream.clone();
    let connector = tower::service_fn(move |_: http::Uri| {
        let path = path.clone();
        async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    let channel = Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(connector)
        .await?;
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(relay.max_message);
    grpc.ready().await?;
    let mut request = tonic::Request::new(ReceiverStream::new(requests));
    // The header marks the stream as a relay's even with nothing offered: the owner ends
    // it at a handover ([`resume::HANDED_OVER`]), or hands over in-band.
    if let Ok(value) = offer.unwrap_or_default().parse() {
        request.metadata_mut().insert(resume::HEADER, value);
    }
    if C::OVERLAP {
        request.metadata_mut().insert(
            resume::HANDOVER_HEADER,
            tonic::metadata::MetadataValue::from_static(resume::OVERLAP),
        );
    }
    let answers = grpc
        .streaming(
            request,
            http::uri::PathAndQuery::from_static(C::PATH),
            RawCodec::<C::Req, C::Resp>::default(),
        )
        .await?;
    let header = |name: &str| {
        answers
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let matched = header(resume::HEADER);
    let overlap = C::OVERLAP && header(resume::HANDOVER_HEADER).as_deref() == Some(resume::OVERLAP);
    Ok(Opened {
        answers: answers.into_inner(),
        matched,
        overlap,
    })
}

/// Runs a closure when dropped.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Envoy's side: the ADS service on the relay's socket, both variants: incremental and
/// state of the world, each relayed to the same method of the agent.
#[derive(Clone)]
pub struct AdsServer(pub Arc<Relay>);

impl tonic::server::NamedService for AdsServer {
    const NAME: &'static str = crate::wire::ADS_SERVICE;
}

impl<B> tower::Service<http::Request<B>> for AdsServer
where
    B: http_body::Body + std::marker::Send + 'static,
    B::Error:
        Into<Box<dyn std::error::Error + std::marker::Send + Sync>> + std::marker::Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<Self::Response, Self::Error>>
                + std::marker::Send,
        >,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let relay = self.0.clone();
        match req.uri().path() {
            DELTA_PATH => Box::pin(serve::<crate::session::Session, B>(relay, req)),
            SOTW_PATH => Box::pin(serve::<crate::sotw::Session, B>(relay, req)),
            _ => Box::pin(async move {
                Ok(Status::unimplemented("not an ADS method the relay serves").into_http())
            }),
        }
    }
}

async fn serve<C: Core, B>(
    relay: Arc<Relay>,
    req: http::Request<B>,
) -> Result<http::Response<tonic::body::Body>, std::convert::Infallible>
where
    B: http_body::Body + std::marker::Send + 'static,
    B::Error:
        Into<Box<dyn std::error::Error + std::marker::Send + Sync>> + std::marker::Send + 'static,
{
    let mut grpc = tonic::server::Grpc::new(RawCodec::<C::Resp, C::Req>::default())
        .max_decoding_message_size(relay.max_message);
    Ok(grpc
        .streaming(Stream::<C>(relay, std::marker::PhantomData), req)
        .await)
}

struct Stream<C>(Arc<Relay>, std::marker::PhantomData<fn() -> C>);

impl<C: Core> tonic::server::StreamingService<Framed<C::Req>> for Stream<C> {
    type Response = Framed<C::Resp>;
    type ResponseStream = ReceiverStream<Result<Framed<C::Resp>, Status>>;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<Self::ResponseStream>, Status>>
                + std::marker::Send,
        >,
    >;

    fn call(&mut self, request: tonic::Request<Streaming<Framed<C::Req>>>) -> Self::Future {
        let relay = self.0.clone();
        Box::pin(async move {
            let (tx, rx) = mpsc::channel(ENVOY_QUEUE);
            tokio::spawn(session::<C>(relay, request.into_inner(), tx));
            Ok(tonic::Response::new(ReceiverStream::new(rx)))
        })
    }
}
