//! The ADS server for LDS, RDS, CDS and EDS, served on the `xds.sock` listening fd
//! handed over at takeover, in both variants of the protocol: state of the world
//! (`api_type: GRPC`, [`stream::StreamState`]) and incremental (`DELTA_GRPC`,
//! [`delta::DeltaState`]); the proxy's bootstrap picks one.
//!
//! One task per stream runs the protocol's state: it answers requests, pushes every
//! new snapshot from the node's watch channel, logs and counts ACKs and NACKs, and
//! publishes to [`Acks`] each snapshot the proxy has fully ACKed. Protobuf types stay in
//! this module ([`convert`] turns model resources into them).

pub mod convert;
pub mod delta;
pub mod encoded;
pub mod server;
pub mod stream;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Status, Streaming};

use crate::metrics::{Metrics, TypeLabel};
use crate::snapshot::Snapshot;
use encoded::Encoded;
use stream::Event;

/// What the proxy has ACKed, shared by every stream: the CNI ADD waits on it.
#[derive(Clone)]
pub struct Acks {
    /// The newest snapshot whose every resource type the proxy has ACKed.
    acked: watch::Sender<Option<Arc<Snapshot>>>,
}

impl Default for Acks {
    fn default() -> Self {
        Self { acked: watch::Sender::new(None) }
    }
}

impl Acks {
    /// Waits until the proxy has ACKed a snapshot for which `holds` is true.
    /// Returns false on timeout.
    pub async fn wait_until(&self, holds: impl Fn(&Snapshot) -> bool, timeout: Duration) -> bool {
        wait_for(self.acked.subscribe(), |s| s.as_deref().is_some_and(&holds), timeout).await
    }

    /// The newest fully ACKed snapshot, if any.
    pub fn latest(&self) -> Option<Arc<Snapshot>> {
        self.acked.borrow().clone()
    }

    /// Every fully ACKed snapshot from now on.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Snapshot>>> {
        self.acked.subscribe()
    }

    fn publish(&self, s: &Arc<Snapshot>) {
        self.acked.send_if_modified(|cur| {
            if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, s)) {
                false
            } else {
                *cur = Some(s.clone());
                true
            }
        });
    }
}

/// Waits until `rx`'s value satisfies `cond`, for at most `timeout`. False on timeout or
/// when the sender is gone.
pub async fn wait_for<T>(mut rx: watch::Receiver<T>, cond: impl FnMut(&T) -> bool, timeout: Duration) -> bool {
    matches!(tokio::time::timeout(timeout, rx.wait_for(cond)).await, Ok(Ok(_)))
}

/// Serves ADS on `listener` until `stop_accepting` resolves, then closes the listener
/// and returns. Streams already open keep being served (each connection is its own task)
/// until the proxy closes them or this process exits: a released owner keeps the proxy's
/// stream while its successor starts serving (see [`await_server`]).
pub async fn serve(
    listener: tokio::net::UnixListener,
    snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    acks: Acks,
    metrics: Arc<Metrics>,
    stop_accepting: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let ads = Arc::new(Ads { snapshots, encoded, acks, metrics, streams: AtomicU64::new(0) });
    // Without a shutdown signal tonic neither waits for nor signals open connections when
    // the incoming stream ends; it drops the listener and returns.
    tonic::transport::Server::builder()
        .add_service(server::AdsServer(ads))
        .serve_with_incoming(futures::StreamExt::take_until(UnixListenerStream::new(listener), stop_accepting))
        .await?;
    Ok(())
}

/// The HTTP/2 client connection preface followed by an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
/// GOAWAY, last stream 0, NO_ERROR: the polite end of a connection that opened none.
const H2_GOAWAY: &[u8] = b"\0\0\x08\x07\0\0\0\0\0\0\0\0\0\0\0\0\0";

/// Waits until an HTTP/2 server answers on the unix socket at `path`, for at most
/// `timeout`, and returns how long that took.
///
/// A connect to a listening socket completes into its backlog whether or not anybody
/// accepts, so connecting proves nothing; the server's first frame (its SETTINGS, which
/// an HTTP/2 server sends as soon as it takes a connection) does. A released owner calls
/// this on `xds.sock`, whose listener it no longer accepts on: the answer comes from the
/// successor, the moment it serves. No polling: the one connect waits in the backlog.
pub async fn await_server(path: &std::path::Path, timeout: Duration) -> std::io::Result<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let start = Instant::now();
    let probe = async {
        let mut conn = tokio::net::UnixStream::connect(path).await?;
        conn.write_all(H2_PREFACE).await?;
        let mut header = [0u8; 9];
        conn.read_exact(&mut header).await?;
        if header[3] != 0x04 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} answered a frame of type {:#04x}, not HTTP/2 SETTINGS", path.display(), header[3]),
            ));
        }
        let _ = conn.write_all(H2_GOAWAY).await;
        Ok(start.elapsed())
    };
    tokio::time::timeout(timeout, probe).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no server answered on {} within {timeout:?}", path.display())))
    })
}

struct Ads {
    snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    acks: Acks,
    metrics: Arc<Metrics>,
    streams: AtomicU64,
}

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl Ads {
    fn open<P: Protocol>(&self, inbound: Streaming<P::Wire>) -> ResponseStream<P::Response> {
        let id = self.streams.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = mpsc::channel(16);
        let (snapshots, encoded) = (self.snapshots.clone(), self.encoded.clone());
        tokio::spawn(run_stream::<P>(id, inbound, tx, snapshots, encoded, self.acks.clone(), self.metrics.clone()));
        Box::pin(ReceiverStream::new(rx))
    }
}

/// What a stream task needs of a protocol's per-stream state: state of the world
/// ([`stream::StreamState`]) or incremental ([`delta::DeltaState`]). No I/O: the task
/// feeds it requests and snapshots, and sends what [`Protocol::pending`] returns.
trait Protocol: Send + 'static {
    /// The request as decoded off the wire (see [`server`]), turned into `Request`.
    type Wire: prost::Message + Default + Send + 'static;
    type Request: From<Self::Wire> + Send + 'static;
    type Response: prost::Message + Send + 'static;
    const NAME: &'static str;
    fn new(current: Arc<Snapshot>, encoded: Arc<Encoded>) -> Self;
    fn node_id(req: &Self::Request) -> Option<&str>;
    /// Applies one request from the proxy; what it meant, for logs and metrics.
    fn on_request(&mut self, req: &Self::Request) -> Event;
    fn current(&self) -> &Arc<Snapshot>;
    fn set_snapshot(&mut self, s: Arc<Snapshot>);
    /// The responses owed to the proxy now, in push order; marks them sent.
    fn pending(&mut self) -> Vec<Self::Response>;
    /// Whether the proxy has ACKed everything of the current snapshot that it uses.
    fn acked_current(&self) -> bool;
    /// (type URL, version, nonce, resource count) of a response, for logs and metrics.
    fn describe(resp: &Self::Response) -> (&str, &str, &str, usize);
}

/// Decrements the open-streams gauge however the stream task ends.
struct StreamGauge(Arc<Metrics>);

impl Drop for StreamGauge {
    fn drop(&mut self) {
        self.0.xds_streams.dec();
    }
}

async fn run_stream<P: Protocol>(
    id: u64,
    mut inbound: Streaming<P::Wire>,
    tx: mpsc::Sender<Result<P::Response, Status>>,
    mut snapshots: watch::Receiver<Arc<Snapshot>>,
    encoded: Arc<Encoded>,
    acks: Acks,
    metrics: Arc<Metrics>,
) {
    metrics.xds_streams.inc();
    let _gauge = StreamGauge(metrics.clone());
    let mut st = P::new(snapshots.borrow_and_update().clone(), encoded);
    let mut snapshots_open = true;
    let mut node_id = String::new();
    // For the debug log: when the snapshot last changed, and when each type's last
    // response went out (by nonce), so that push and ACK lines carry how long each took.
    let mut changed_at = Instant::now();
    let mut pushed_at: [Option<(String, Instant)>; 4] = Default::default();
    tracing::info!(stream = id, protocol = P::NAME, "ADS stream opened");
    loop {
        tokio::select! {
            msg = inbound.message() => match msg {
                Ok(Some(wire)) => {
                    let req = P::Request::from(wire);
                    if let Some(node) = P::node_id(&req) {
                        node_id = node.to_string();
                    }
                    record(id, &node_id, st.on_request(&req), &metrics, &pushed_at);
                }
                Ok(None) => {
                    tracing::info!(stream = id, node = %node_id, "ADS stream closed by the proxy");
                    return;
                }
                Err(status) => {
                    tracing::info!(stream = id, node = %node_id, %status, "ADS stream ended");
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
            () = tx.closed() => {
                tracing::info!(stream = id, node = %node_id, "ADS stream dropped");
                return;
            }
        }
        for resp in st.pending() {
            let (type_url, version, nonce, resources) = P::describe(&resp);
            tracing::debug!(stream = id, type_url, version, nonce, resources,
                since_change_us = changed_at.elapsed().as_micros() as u64, "push");
            if let Some(k) = stream::Kind::from_type_url(type_url) {
                pushed_at[k.index()] = Some((nonce.to_string(), Instant::now()));
            }
            metrics.xds_pushes.get_or_create(&TypeLabel { type_url: type_url.to_string() }).inc();
            if tx.send(Ok(resp)).await.is_err() {
                return;
            }
        }
        if st.acked_current() {
            acks.publish(st.current());
        }
    }
}

fn record(id: u64, node: &str, ev: Event, metrics: &Metrics, pushed_at: &[Option<(String, Instant)>; 4]) {
    let label = |k: stream::Kind| TypeLabel { type_url: k.type_url().to_string() };
    match ev {
        Event::Subscribe { kind, version } => {
            tracing::debug!(stream = id, node, type_url = kind.type_url(), held_version = %version, "subscribe")
        }
        Event::Ack { kind, version, nonce } => {
            metrics.xds_acks.get_or_create(&label(kind)).inc();
            let push_to_ack_us = pushed_at[kind.index()]
                .as_ref()
                .filter(|(n, _)| *n == nonce)
                .map(|(_, t)| t.elapsed().as_micros() as u64);
            tracing::debug!(stream = id, node, type_url = kind.type_url(), %version, %nonce, ?push_to_ack_us, "ACK");
        }
        Event::Nack { kind, rejected_version, nonce, message } => {
            metrics.xds_nacks.get_or_create(&label(kind)).inc();
            tracing::warn!(stream = id, node, type_url = kind.type_url(), %nonce, %rejected_version,
                error_detail = %message, "NACK: the proxy rejected {} and keeps its last good config", kind.short());
        }
        Event::Stale { kind, nonce } => {
            tracing::debug!(stream = id, node, type_url = kind.type_url(), %nonce, "stale nonce, ignored")
        }
        Event::UnknownType { type_url } => {
            tracing::debug!(stream = id, node, %type_url, "request for a type not served, ignored")
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{UnixListener, UnixStream};

    use super::*;
    use crate::snapshot::{Inputs, build};

    fn start(listener: UnixListener) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<anyhow::Result<()>>) {
        let (_tx, snapshots) = watch::channel(Arc::new(build(&Inputs::default())));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, snapshots, Arc::default(), Acks::default(), Metrics::new(), async move {
            let _ = stopped.await;
        }));
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
        let err = await_server(&path, Duration::from_millis(200)).await.expect_err("no socket file");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");

        // Bound and listening, but nobody accepts: the connect queues and nothing answers.
        let listener = UnixListener::bind(&path).unwrap();
        let err = await_server(&path, Duration::from_millis(200)).await.expect_err("nobody accepts");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");

        let (_stop, _task) = start(listener);
        await_server(&path, Duration::from_secs(5)).await.expect("the ADS server answers");
    }

    #[tokio::test]
    async fn await_server_refuses_a_socket_that_does_not_speak_http2() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("xds.sock");
        let listener = UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            conn.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await.unwrap();
        });
        let err = await_server(&path, Duration::from_secs(5)).await.expect_err("not HTTP/2");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "{err}");
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
        task.await.unwrap().expect("serve returns once it stops accepting");
        let refused = UnixStream::connect(&path).await.expect_err("the listener is closed");
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "{refused}");

        // The connection accepted before still answers: PING, then its ACK.
        open.write_all(b"\0\0\x08\x06\0\0\0\0\0aether!!").await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), read_until_frame(&mut open, 0x06, 0x01)).await.expect("PING ACK on the open connection");
    }
}
