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
use crate::session::{Send, Session};
use crate::wire::{DELTA_PATH, DeltaRequest, DeltaResponse, Framed, RawCodec};

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

type ToEnvoy = mpsc::Sender<Result<Framed<DeltaResponse>, Status>>;

/// Runs one Envoy stream's session until Envoy goes, or the grace without an agent ends
/// it.
pub async fn session(relay: Arc<Relay>, mut envoy: Streaming<Framed<DeltaRequest>>, tx: ToEnvoy) {
    let m = &relay.metrics;
    m.envoy_streams.fetch_add(1, Relaxed);
    let _gone = Defer(|| {
        relay.metrics.envoy_streams.fetch_sub(1, Relaxed);
    });
    let mut s = Session::default();
    let mut recorded = crate::session::Counts::default();
    let mut failures = 0u32;
    let mut down_since = Instant::now();
    loop {
        // Re-stated at once: the requests wait in the queue while the stream opens, and
        // Envoy's requests meanwhile go behind them, in order.
        let (up_tx, up_rx) = mpsc::channel(UPSTREAM_QUEUE);
        let mut ok = queue(&up_tx, s.upstream_up());
        let connect = open(&relay, up_rx);
        tokio::pin!(connect);
        let grace_end = tokio::time::Instant::from_std(down_since + relay.grace);
        let mut answers = loop {
            tokio::select! {
                opened = &mut connect => match opened {
                    Ok(a) if ok => break Some(a),
                    Ok(_) => break None,
                    Err(e) => {
                        failures += 1;
                        m.upstream_failures.fetch_add(1, Relaxed);
                        tracing::warn!(upstream = %relay.upstream.display(), error = %format!("{e:#}"), failures, "relay: the agent's ADS stream did not open");
                        break None;
                    }
                },
                req = envoy.message() => match req {
                    Ok(Some(req)) => ok &= queue(&up_tx, s.on_envoy(req)),
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
        };
        if let Some(answers) = answers.take() {
            failures = 0;
            m.upstream_streams.fetch_add(1, Relaxed);
            m.upstream_connected.store(1, Relaxed);
            m.record(&s.counts, &mut recorded);
            let gap = down_since.elapsed();
            m.note_gap(gap);
            tracing::info!(
                gap_ms = gap.as_secs_f64() * 1e3,
                resumes = s.counts.resumes,
                "relay: agent stream open"
            );
            let ended = pump(&mut s, &mut envoy, answers, &up_tx, &tx).await;
            m.upstream_connected.store(0, Relaxed);
            m.record(&s.counts, &mut recorded);
            down_since = Instant::now();
            match ended {
                Ended::Envoy => return,
                Ended::Agent(why) => {
                    m.switches.fetch_add(1, Relaxed);
                    tracing::info!(why, "relay: the agent's stream ended; opening the next");
                }
            }
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
}

/// Relays both ways until one side ends.
async fn pump(
    s: &mut Session,
    envoy: &mut Streaming<Framed<DeltaRequest>>,
    mut answers: Streaming<Framed<DeltaResponse>>,
    up: &mpsc::Sender<Framed<DeltaRequest>>,
    tx: &ToEnvoy,
) -> Ended {
    loop {
        let out = tokio::select! {
            req = envoy.message() => match req {
                Ok(Some(req)) => s.on_envoy(req),
                _ => return Ended::Envoy,
            },
            answer = answers.message() => match answer {
                Ok(Some(a)) => s.on_agent(a),
                Ok(None) => return Ended::Agent("closed"),
                Err(_) => return Ended::Agent("reset"),
            },
        };
        for o in out {
            match o {
                Send::Upstream(r) => {
                    if up.try_send(r).is_err() {
                        return Ended::Agent("queue full");
                    }
                }
                Send::Envoy(a) => {
                    if tx.send(Ok(a)).await.is_err() {
                        return Ended::Envoy;
                    }
                }
            }
        }
    }
}

/// Queues requests for the agent stream being opened; false when the queue is full.
fn queue(up: &mpsc::Sender<Framed<DeltaRequest>>, out: Vec<Send>) -> bool {
    out.into_iter().all(|o| match o {
        Send::Upstream(r) => up.try_send(r).is_ok(),
        // The session answers Envoy only from the agent's answers.
        Send::Envoy(_) => true,
    })
}

/// Opens an agent stream over the node's socket. The connect waits in the socket's
/// backlog until an owner accepts.
async fn open(
    relay: &Relay,
    requests: mpsc::Receiver<Framed<DeltaRequest>>,
) -> anyhow::Result<Streaming<Framed<DeltaResponse>>> {
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
    let answers = grpc
        .streaming(
            tonic::Request::new(ReceiverStream::new(requests)),
            http::uri::PathAndQuery::from_static(DELTA_PATH),
            RawCodec::<DeltaRequest, DeltaResponse>::default(),
        )
        .await?;
    Ok(answers.into_inner())
}

/// Runs a closure when dropped.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Envoy's side: the ADS service on the relay's socket. Only the incremental variant is
/// served; state of the world is refused with UNIMPLEMENTED, which Envoy reports.
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
        if req.uri().path() != DELTA_PATH {
            return Box::pin(async move {
                Ok(
                    Status::unimplemented("the relay serves incremental (delta) ADS only")
                        .into_http(),
                )
            });
        }
        Box::pin(async move {
            let mut grpc =
                tonic::server::Grpc::new(RawCodec::<DeltaResponse, DeltaRequest>::default())
                    .max_decoding_message_size(relay.max_message);
            Ok(grpc.streaming(Delta(relay), req).await)
        })
    }
}

struct Delta(Arc<Relay>);

impl tonic::server::StreamingService<Framed<DeltaRequest>> for Delta {
    type Response = Framed<DeltaResponse>;
    type ResponseStream = ReceiverStream<Result<Framed<DeltaResponse>, Status>>;
    type Future = std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<Self::ResponseStream>, Status>>
                + std::marker::Send,
        >,
    >;

    fn call(&mut self, request: tonic::Request<Streaming<Framed<DeltaRequest>>>) -> Self::Future {
        let relay = self.0.clone();
        Box::pin(async move {
            let (tx, rx) = mpsc::channel(ENVOY_QUEUE);
            tokio::spawn(session(relay, request.into_inner(), tx));
            Ok(tonic::Response::new(ReceiverStream::new(rx)))
        })
    }
}
