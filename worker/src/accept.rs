//! Accepting on the worker's four listeners (the health socket, the metrics port,
//! `xds.sock` and `cni.sock`), one loop shape for all of them.
//!
//! A failed accept backs off, 10 ms doubling to 1 s, reset by the next success. Out of
//! descriptors (EMFILE, ENFILE) a listener with a queued connection stays readable, and
//! retrying at once would spin the worker's one runtime thread for as long as the
//! shortage lasts; the queued connections wait in the backlog instead. Errors that
//! belong to one connection (it was reset or aborted before the accept) consume it, so
//! they are retried at once. Every failure is counted
//! (`aether_accept_errors_total{socket,kind}`).
//!
//! Each listener also caps the connections it holds open. One accepted past the cap is
//! closed at once and counted (`aether_connections_refused_total{socket}`); the open
//! ones are a gauge (`aether_connections{socket}`). The limits themselves are set where
//! each listener is served and listed in ARCHITECTURE.md ("Limits").
//!
//! On the node's unix sockets each peer process also has a connection rate
//! ([`PeerRate`]: a token bucket per process id, from SO_PEERCRED). The node's clients
//! open few connections each: the plugin is a new process for every call and opens one,
//! Envoy holds one. A process that connects over and over (a flood) has its connections
//! past its rate closed right after the accept, before any task or HTTP/2 work is spent
//! on them, and counted (`aether_connections_rate_limited_total{socket}`). Closing them
//! at once also keeps the listen backlog short, so the next plugin's connection does not
//! wait behind thousands of the flood's. After 16 of them in a row the loop
//! pauses for 1 ms ([`PAUSE_EVERY`]), so a flood gets a bounded share of the worker's one
//! thread instead of all of it.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::metrics::{AcceptErrorLabel, Metrics, SocketLabel};

/// Connections closed at once in a row after which an accept loop yields to the
/// runtime's other tasks.
const YIELD_EVERY: u32 = 16;

/// Connections closed in a row for their peer's rate after which an accept loop pauses
/// for [`RATE_PAUSE`]: two listen backlogs' worth (`shared_proto::handoff::BACKLOG`, the node sockets' backlog, is 8). A
/// flood refills the backlog as fast as it is emptied, so accepting at full speed only
/// turns the flood's connects into the worker's CPU time; paused, the flood waits on a
/// full backlog (on its own CPU time), and a legitimate connect waits at most one pause
/// and one backlog behind it, often no pause (measured against 8 and 16 in a row with
/// backlogs of 8, 16 and 64: README, "Measured", the flood).
const PAUSE_EVERY: u32 = 16;
/// See [`PAUSE_EVERY`]. The runtime's timer resolution is 1 ms.
const RATE_PAUSE: Duration = Duration::from_millis(1);

/// The first delay after a failed accept.
pub const BACKOFF_FIRST: Duration = Duration::from_millis(10);
/// The longest delay between two attempts while accepts keep failing.
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// While accepts keep failing, or connections keep being refused, a log line at most
/// this often (each failure is counted all the same).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The delays between failed accepts: [`BACKOFF_FIRST`], doubling to [`BACKOFF_MAX`],
/// back to the first after a success.
fn backoff() -> Backoff {
    Backoff::new(BACKOFF_FIRST, BACKOFF_MAX)
}

/// Why an accept failed, as `aether_accept_errors_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// EMFILE: the process is at its descriptor limit (RLIMIT_NOFILE).
    Emfile,
    /// ENFILE: the system is at its descriptor limit.
    Enfile,
    /// ENOBUFS or ENOMEM: the kernel could not allocate the socket.
    NoMem,
    /// The connection was reset or aborted before it was accepted; it is gone from the
    /// queue, so the next accept can go ahead at once.
    Connection,
    Other,
}

impl ErrorKind {
    pub fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EMFILE) => Self::Emfile,
            Some(libc::ENFILE) => Self::Enfile,
            Some(libc::ENOBUFS | libc::ENOMEM) => Self::NoMem,
            Some(libc::ECONNABORTED | libc::ECONNRESET | libc::EPROTO) => Self::Connection,
            _ => Self::Other,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Emfile => "emfile",
            Self::Enfile => "enfile",
            Self::NoMem => "nomem",
            Self::Connection => "connection",
            Self::Other => "other",
        }
    }

    /// Whether the next attempt waits: everything but a lost connection would fail
    /// again at once.
    pub fn backs_off(self) -> bool {
        self != Self::Connection
    }
}

/// A listening socket as [`Acceptor`] uses it.
pub trait Listen: Send + Sync + 'static {
    type Conn: Send + 'static;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Conn>>;
    /// The process that opened `conn`, where the socket family tells it.
    fn peer_pid(_conn: &Self::Conn) -> Option<i32> {
        None
    }
}

impl Listen for tokio::net::UnixListener {
    type Conn = tokio::net::UnixStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Conn>> {
        tokio::net::UnixListener::poll_accept(self, cx).map_ok(|(conn, _)| conn)
    }
    fn peer_pid(conn: &Self::Conn) -> Option<i32> {
        conn.peer_cred().ok()?.pid()
    }
}

impl Listen for tokio::net::TcpListener {
    type Conn = tokio::net::TcpStream;
    fn poll_accept(&self, cx: &mut Context<'_>) -> Poll<io::Result<Self::Conn>> {
        tokio::net::TcpListener::poll_accept(self, cx).map_ok(|(conn, _)| conn)
    }
}

/// How fast one peer process may open connections on a listener: `burst` at once, then
/// `per_second`. The burst covers a listener's whole connection cap, so one process can
/// still fill it (and tests do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerRate {
    pub burst: u32,
    pub per_second: u32,
}

/// Peers whose bucket is remembered; past it, those with a full bucket are forgotten
/// (they would start full anyway), and if none is, all are (a flood from thousands of
/// processes at once: each gets its burst again, and the connection cap still holds).
const MAX_PEERS: usize = 4096;

/// The token buckets of the peer processes seen lately.
#[derive(Debug)]
struct PeerBuckets {
    rate: PeerRate,
    /// By process id: tokens left, and when they were counted.
    peers: HashMap<i32, (f64, Instant)>,
}

impl PeerBuckets {
    fn new(rate: PeerRate) -> Self {
        Self {
            rate,
            peers: HashMap::new(),
        }
    }

    fn refilled(rate: PeerRate, (tokens, at): (f64, Instant), now: Instant) -> f64 {
        (tokens + now.duration_since(at).as_secs_f64() * f64::from(rate.per_second))
            .min(f64::from(rate.burst))
    }

    /// Whether process `pid` may open one more connection at `now` (and takes a token).
    fn admit(&mut self, pid: i32, now: Instant) -> bool {
        let rate = self.rate;
        if self.peers.len() >= MAX_PEERS && !self.peers.contains_key(&pid) {
            self.peers
                .retain(|_, b| Self::refilled(rate, *b, now) < f64::from(rate.burst));
            if self.peers.len() >= MAX_PEERS {
                self.peers.clear();
            }
        }
        let bucket = self
            .peers
            .entry(pid)
            .or_insert((f64::from(rate.burst), now));
        let tokens = Self::refilled(rate, *bucket, now);
        let admitted = tokens >= 1.0;
        *bucket = (if admitted { tokens - 1.0 } else { tokens }, now);
        admitted
    }
}

/// A log line about a repeated event at most every [`LOG_EVERY`], with the count since
/// the last one.
#[derive(Debug, Default)]
struct Throttled {
    since_logged: u64,
    logged: Option<Instant>,
}

impl Throttled {
    /// Counts one event at `now`; the count since the last line when a line is due.
    fn count(&mut self, now: Instant) -> Option<u64> {
        self.since_logged += 1;
        if self
            .logged
            .is_some_and(|at| now.duration_since(at) < LOG_EVERY)
        {
            return None;
        }
        self.logged = Some(now);
        Some(std::mem::take(&mut self.since_logged))
    }
}

/// One listener's accept loop state: its backoff and its connection cap.
pub struct Acceptor<L> {
    listener: L,
    socket: &'static str,
    backoff: Backoff,
    /// The current run of failed accepts: when it began, how many, when last logged.
    failing: Option<(Instant, u64, Instant)>,
    slots: Arc<Semaphore>,
    max_connections: usize,
    /// Connections refused at the cap: their counter, and the log line's throttle.
    refused: (Counter, Throttled),
    /// Each peer process's connection rate, where the listener has one; the connections
    /// closed over it: their counter, and the log line's throttle.
    peer_rate: Option<(PeerBuckets, Counter, Throttled)>,
    open: Gauge,
    metrics: Arc<Metrics>,
}

impl<L: Listen> Acceptor<L> {
    /// Accepts on `listener`, named `socket` in metrics and logs, holding at most
    /// `max_connections` open.
    pub fn new(
        listener: L,
        socket: &'static str,
        max_connections: usize,
        metrics: Arc<Metrics>,
    ) -> Self {
        let label = SocketLabel {
            socket: socket.into(),
        };
        let open = metrics.connections.get_or_create(&label).clone();
        let refused = metrics.connections_refused.get_or_create(&label).clone();
        Self {
            listener,
            socket,
            backoff: backoff(),
            failing: None,
            slots: Arc::new(Semaphore::new(max_connections)),
            max_connections,
            refused: (refused, Throttled::default()),
            peer_rate: None,
            open,
            metrics,
        }
    }

    /// Limits each peer process to `rate` (on sockets whose peer has a process id).
    pub fn with_peer_rate(mut self, rate: PeerRate) -> Self {
        let counter = self
            .metrics
            .connections_rate_limited
            .get_or_create(&SocketLabel {
                socket: self.socket.into(),
            })
            .clone();
        self.peer_rate = Some((PeerBuckets::new(rate), counter, Throttled::default()));
        self
    }

    /// Whether `conn`'s peer is within its rate; if not, `conn` is closed and counted.
    /// A peer with no process id passes.
    fn within_rate(&mut self, conn: L::Conn) -> Option<L::Conn> {
        let Some((buckets, counter, throttle)) = self.peer_rate.as_mut() else {
            return Some(conn);
        };
        let Some(pid) = L::peer_pid(&conn) else {
            return Some(conn);
        };
        let now = Instant::now();
        if buckets.admit(pid, now) {
            return Some(conn);
        }
        drop(conn);
        counter.inc();
        if let Some(closed) = throttle.count(now) {
            let rate = buckets.rate;
            tracing::warn!(
                socket = self.socket,
                pid,
                burst = rate.burst,
                per_second = rate.per_second,
                closed,
                "a process is opening connections faster than its rate; closing them at once"
            );
        }
        None
    }

    /// The next accepted connection, whatever the cap. A failed accept is counted and,
    /// unless it lost only its own connection, waited out ([`Backoff`]).
    pub async fn accept(&mut self) -> L::Conn {
        loop {
            let result = std::future::poll_fn(|cx| self.listener.poll_accept(cx)).await;
            match result {
                Ok(conn) => {
                    tracing::trace!(socket = self.socket, "accepted");
                    self.backoff.reset();
                    if let Some((since, errors, _)) = self.failing.take() {
                        tracing::info!(
                            socket = self.socket,
                            errors,
                            after_ms = since.elapsed().as_millis() as u64,
                            "accepting again"
                        );
                    }
                    return conn;
                }
                Err(e) => {
                    let kind = ErrorKind::of(&e);
                    let label = AcceptErrorLabel {
                        socket: self.socket.into(),
                        kind: kind.as_str().into(),
                    };
                    self.metrics.accept_errors.get_or_create(&label).inc();
                    if !kind.backs_off() {
                        tracing::debug!(socket = self.socket, error = %e, "accept: the connection was gone; next");
                        continue;
                    }
                    let delay = self.backoff.next_wait();
                    let now = Instant::now();
                    let (since, errors, logged) = self.failing.get_or_insert((now, 0, now));
                    *errors += 1;
                    if *errors == 1 || now.duration_since(*logged) >= LOG_EVERY {
                        *logged = now;
                        tracing::warn!(socket = self.socket, kind = kind.as_str(), error = %e, errors = *errors,
                            failing_ms = now.duration_since(*since).as_millis() as u64, delay_ms = delay.as_millis() as u64,
                            "accept failed; backing off (queued connections wait in the backlog)");
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// `conn` holding one of the listener's connection slots until it is dropped, or
    /// None when all are taken: `conn` is then closed at once, and counted.
    pub fn admit<C>(&mut self, conn: C) -> Option<Tracked<C>> {
        match self.slots.clone().try_acquire_owned() {
            Ok(permit) => {
                self.open.inc();
                Some(Tracked {
                    conn,
                    _slot: Slot {
                        _permit: permit,
                        open: self.open.clone(),
                    },
                })
            }
            Err(_) => {
                drop(conn);
                self.refused.0.inc();
                if let Some(refused) = self.refused.1.count(Instant::now()) {
                    tracing::warn!(
                        socket = self.socket,
                        max = self.max_connections,
                        refused,
                        "connection cap reached; closing new connections at once"
                    );
                }
                None
            }
        }
    }

    /// The next connection under the cap; those past it are closed and counted.
    pub async fn next(&mut self) -> Tracked<L::Conn> {
        self.next_allowed(&mut |_| true).await
    }

    /// The next connection within its peer's rate, that `allow` lets through and under
    /// the cap. Every [`YIELD_EVERY`] connections closed at once in a row it lets the
    /// runtime's other tasks run: a flood would otherwise hold the worker's one thread
    /// for a whole cooperative budget (128 accepts) at a time, and the proxy's stream
    /// would wait behind it. When those were all closed for their peer's rate, every
    /// [`PAUSE_EVERY`] it pauses for [`RATE_PAUSE`] instead.
    async fn next_allowed(&mut self, allow: &mut impl FnMut(&L::Conn) -> bool) -> Tracked<L::Conn> {
        let (mut closed, mut over_rate) = (0, 0);
        loop {
            let conn = self.accept().await;
            let admitted = match self.within_rate(conn) {
                Some(conn) => {
                    over_rate = 0;
                    Some(conn).filter(|c| allow(c)).and_then(|c| self.admit(c))
                }
                None => {
                    over_rate += 1;
                    None
                }
            };
            if let Some(t) = admitted {
                return t;
            }
            closed += 1;
            if over_rate > 0 && over_rate % PAUSE_EVERY == 0 {
                tokio::time::sleep(RATE_PAUSE).await;
            } else if closed % YIELD_EVERY == 0 {
                tokio::task::yield_now().await;
            }
        }
    }

    /// The connections within their peer's rate and under the cap that `allow` lets
    /// through, as tonic's incoming stream. It never yields an error: failures are
    /// handled here, and tonic's own loop would retry a failed accept at once.
    pub fn incoming<F>(
        self,
        allow: F,
    ) -> impl Stream<Item = io::Result<Tracked<L::Conn>>> + Send + 'static
    where
        F: FnMut(&L::Conn) -> bool + Send + 'static,
    {
        futures::stream::unfold((self, allow), |(mut acceptor, mut allow)| async move {
            let t = acceptor.next_allowed(&mut allow).await;
            Some((Ok(t), (acceptor, allow)))
        })
    }
}

/// A connection holding one of its listener's slots, given back when it is dropped.
pub struct Tracked<C> {
    conn: C,
    _slot: Slot,
}

impl<C> Tracked<C> {
    pub fn get_ref(&self) -> &C {
        &self.conn
    }
}

struct Slot {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.dec();
    }
}

impl<C: AsyncRead + Unpin> AsyncRead for Tracked<C> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.conn).poll_read(cx, buf)
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for Tracked<C> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.conn).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.conn).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.conn.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.conn).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.conn).poll_shutdown(cx)
    }
}

/// tonic serves a tracked connection as it serves the connection itself.
impl<C: tonic::transport::server::Connected> tonic::transport::server::Connected for Tracked<C> {
    type ConnectInfo = C::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.conn.connect_info()
    }
}

/// For the transport tests of the servers behind these listeners.
#[cfg(test)]
pub(crate) mod test_helpers {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The client's HTTP/2 preface with an empty SETTINGS frame.
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

    /// Sends the HTTP/2 preface on `conn` and returns the server's SETTINGS (identifier,
    /// value), or None if the server closed the connection without a byte.
    pub async fn h2_settings(conn: &mut tokio::net::UnixStream) -> Option<Vec<(u16, u32)>> {
        // A connection closed at once may refuse the write; the read says what happened.
        let _ = conn.write_all(PREFACE).await;
        let mut header = [0u8; 9];
        match conn.read(&mut header[..1]).await {
            Ok(0) => return None,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Ok(_) => {}
            Err(e) => panic!("reading the server's first frame: {e}"),
        }
        conn.read_exact(&mut header[1..])
            .await
            .expect("frame header");
        assert_eq!(header[3], 0x04, "the server's first frame is SETTINGS");
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload)
            .await
            .expect("SETTINGS payload");
        Some(
            payload
                .chunks(6)
                .map(|c| {
                    (
                        u16::from_be_bytes([c[0], c[1]]),
                        u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
                    )
                })
                .collect(),
        )
    }

    /// SETTINGS_MAX_CONCURRENT_STREAMS.
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;

    /// Waits until `cond` holds, yielding to the runtime in between: for a server task's
    /// reaction to a closed connection, which nothing signals to the test.
    pub async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let waited = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while !cond() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "{what}: not within 10 s");
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn backoff_doubles_to_the_maximum_and_a_success_resets_it() {
        let mut b = backoff();
        let ms = |d: Duration| d.as_millis() as u64;
        let delays: Vec<u64> = (0..10).map(|_| ms(b.next_wait())).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        b.reset();
        assert_eq!(ms(b.next_wait()), 10);
    }

    #[test]
    fn error_kinds() {
        let check = |errno: i32, kind: &str, backs_off: bool| {
            let k = ErrorKind::of(&io::Error::from_raw_os_error(errno));
            assert_eq!(
                (k.as_str(), k.backs_off()),
                (kind, backs_off),
                "errno {errno}"
            );
        };
        check(libc::EMFILE, "emfile", true);
        check(libc::ENFILE, "enfile", true);
        check(libc::ENOBUFS, "nomem", true);
        check(libc::ENOMEM, "nomem", true);
        check(libc::ECONNABORTED, "connection", false);
        check(libc::EPROTO, "connection", false);
        check(libc::EINVAL, "other", true);
        assert_eq!(
            ErrorKind::of(&io::Error::other("no errno")),
            ErrorKind::Other
        );
    }

    /// A listener that answers each accept with the next scripted result, then never.
    struct Script {
        results: Mutex<VecDeque<io::Result<u32>>>,
        attempts: Mutex<u32>,
    }

    impl Script {
        fn new(results: impl IntoIterator<Item = io::Result<u32>>) -> Self {
            Self {
                results: Mutex::new(results.into_iter().collect()),
                attempts: Mutex::new(0),
            }
        }
    }

    impl Listen for Arc<Script> {
        type Conn = u32;
        fn poll_accept(&self, _cx: &mut Context<'_>) -> Poll<io::Result<u32>> {
            *self.attempts.lock().unwrap() += 1;
            match self.results.lock().unwrap().pop_front() {
                Some(r) => Poll::Ready(r),
                None => Poll::Pending,
            }
        }
        /// Connection n comes from process n / 100; those under 100 from none known.
        fn peer_pid(conn: &u32) -> Option<i32> {
            (*conn >= 100).then_some((*conn / 100) as i32)
        }
    }

    #[test]
    fn a_peer_gets_its_burst_then_its_rate_and_each_peer_has_its_own_bucket() {
        let mut b = PeerBuckets::new(PeerRate {
            burst: 3,
            per_second: 10,
        });
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let admitted = |b: &mut PeerBuckets, pid, at| (0..5).filter(|_| b.admit(pid, at)).count();
        assert_eq!(admitted(&mut b, 7, t0), 3, "the burst, then nothing");
        assert_eq!(
            admitted(&mut b, 8, t0),
            3,
            "another process has a bucket of its own"
        );
        assert_eq!(admitted(&mut b, 7, ms(99)), 0, "0.99 tokens refilled");
        assert_eq!(admitted(&mut b, 7, ms(250)), 2, "2.5 tokens at 10 a second");
        assert_eq!(
            admitted(&mut b, 7, ms(100_000)),
            3,
            "refilled up to the burst, no more"
        );
    }

    #[test]
    fn past_max_peers_full_buckets_are_forgotten_and_then_all_if_none_is_full() {
        let mut b = PeerBuckets::new(PeerRate {
            burst: 2,
            per_second: 1,
        });
        let t0 = Instant::now();
        for pid in 0..MAX_PEERS as i32 {
            assert!(b.admit(pid, t0), "peer {pid}'s first");
        }
        assert!(b.admit(0, t0) && !b.admit(0, t0), "peer 0 spent its burst");
        // A second later every bucket but peer 0's is full again: those are forgotten.
        let t1 = t0 + Duration::from_secs(1);
        assert!(
            b.admit(MAX_PEERS as i32, t1),
            "a new peer past the table's size"
        );
        assert_eq!(b.peers.len(), 2, "peer 0 and the new one");
        assert!(
            b.admit(0, t1) && !b.admit(0, t1),
            "peer 0 is remembered: one token refilled, not a fresh burst"
        );

        // None full: all are forgotten.
        let mut b = PeerBuckets::new(PeerRate {
            burst: 2,
            per_second: 1,
        });
        for pid in 0..MAX_PEERS as i32 {
            assert!(b.admit(pid, t0));
        }
        assert!(b.admit(-1, t0));
        assert_eq!(b.peers.len(), 1);
    }

    #[test]
    fn a_throttled_event_is_logged_at_first_and_then_once_per_interval_with_its_count() {
        let (mut t, t0) = (Throttled::default(), Instant::now());
        assert_eq!(t.count(t0), Some(1));
        assert_eq!(t.count(t0 + Duration::from_secs(1)), None);
        assert_eq!(t.count(t0 + LOG_EVERY - Duration::from_millis(1)), None);
        assert_eq!(
            t.count(t0 + LOG_EVERY),
            Some(3),
            "the two held back and this one"
        );
        assert_eq!(t.count(t0 + LOG_EVERY), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_of_connections_closed_at_once_lets_other_tasks_run() {
        let metrics = Metrics::new();
        // Process 1's first, 16 more past its rate, then process 2's.
        let mut script: Vec<io::Result<u32>> = (101..=117).map(Ok).collect();
        script.push(Ok(201));
        let mut a = Acceptor::new(Arc::new(Script::new(script)), "test", 16, metrics)
            .with_peer_rate(PeerRate {
                burst: 1,
                per_second: 0,
            });
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ran2 = ran.clone();
        tokio::spawn(async move { ran2.store(true, std::sync::atomic::Ordering::SeqCst) });
        // The scripted listener is always ready, so only the loop's own yield lets the
        // spawned task run on this one-thread runtime.
        assert_eq!(*a.next().await.get_ref(), 101);
        assert!(
            !ran.load(std::sync::atomic::Ordering::SeqCst),
            "nothing yielded yet"
        );
        assert_eq!(*a.next().await.get_ref(), 201);
        assert!(
            ran.load(std::sync::atomic::Ordering::SeqCst),
            "16 closed in a row: the loop yielded"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_of_connections_over_their_peers_rate_pauses_the_loop() {
        // Process 1's first, then `over` past its rate, then process 2's; the clock only
        // moves when the loop sleeps.
        let run = |over: u32| async move {
            let mut script: Vec<io::Result<u32>> = (101..=101 + over).map(Ok).collect();
            script.push(Ok(201));
            let mut a = Acceptor::new(Arc::new(Script::new(script)), "test", 16, Metrics::new())
                .with_peer_rate(PeerRate {
                    burst: 1,
                    per_second: 0,
                });
            assert_eq!(*a.next().await.get_ref(), 101);
            let t0 = Instant::now();
            assert_eq!(*a.next().await.get_ref(), 201);
            t0.elapsed()
        };
        assert_eq!(
            run(PAUSE_EVERY - 1).await,
            Duration::ZERO,
            "one short of a backlog: no pause"
        );
        assert_eq!(
            run(PAUSE_EVERY).await,
            RATE_PAUSE,
            "a backlog's worth in a row: one pause"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn connections_over_their_peers_rate_are_closed_and_counted_before_allow_sees_them() {
        let metrics = Metrics::new();
        // Process 1 opens three, process 2 one, and one from no known process.
        let script = Arc::new(Script::new([Ok(101), Ok(102), Ok(103), Ok(201), Ok(5)]));
        let a = Acceptor::new(script, "test", 16, metrics.clone()).with_peer_rate(PeerRate {
            burst: 2,
            per_second: 1,
        });
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let incoming = a.incoming(move |c| {
            seen2.lock().unwrap().push(*c);
            true
        });
        let mut incoming = std::pin::pin!(incoming);
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(
                *futures::StreamExt::next(&mut incoming)
                    .await
                    .unwrap()
                    .unwrap()
                    .get_ref(),
            );
        }
        assert_eq!(
            got,
            [101, 102, 201, 5],
            "103 is past process 1's burst of 2"
        );
        assert_eq!(
            *seen.lock().unwrap(),
            [101, 102, 201, 5],
            "allow never saw 103"
        );
        let label = SocketLabel {
            socket: "test".into(),
        };
        assert_eq!(
            metrics.connections_rate_limited.get_or_create(&label).get(),
            1
        );
        assert_eq!(metrics.connections_refused.get_or_create(&label).get(), 0);
    }

    fn errno(e: i32) -> io::Result<u32> {
        Err(io::Error::from_raw_os_error(e))
    }

    fn count(m: &Metrics, kind: &str) -> u64 {
        m.accept_errors
            .get_or_create(&AcceptErrorLabel {
                socket: "test".into(),
                kind: kind.into(),
            })
            .get()
    }

    #[tokio::test(start_paused = true)]
    async fn failed_accepts_wait_out_the_backoff_and_a_success_resets_it() {
        let metrics = Metrics::new();
        // Eight EMFILEs, a connection, then an ENFILE and one that was reset.
        let mut results: Vec<io::Result<u32>> = (0..8).map(|_| errno(libc::EMFILE)).collect();
        results.extend([Ok(1), errno(libc::ENFILE), errno(libc::ECONNABORTED), Ok(2)]);
        let script = Arc::new(Script::new(results));
        let mut a = Acceptor::new(script.clone(), "test", 4, metrics.clone());

        let start = Instant::now();
        assert_eq!(a.accept().await, 1);
        // 10 + 20 + 40 + 80 + 160 + 320 + 640 + 1000 ms: never a retry at once.
        assert_eq!(start.elapsed(), Duration::from_millis(2270));
        assert_eq!(*script.attempts.lock().unwrap(), 9);

        let start = Instant::now();
        assert_eq!(a.accept().await, 2);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(10),
            "the success reset the backoff; a lost connection waits nothing"
        );
        assert_eq!(
            (
                count(&metrics, "emfile"),
                count(&metrics, "enfile"),
                count(&metrics, "connection")
            ),
            (8, 1, 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn connections_past_the_cap_are_refused_and_counted_until_one_closes() {
        let metrics = Metrics::new();
        let mut a = Acceptor::new(Arc::new(Script::new([])), "test", 2, metrics.clone());
        let label = SocketLabel {
            socket: "test".into(),
        };
        let open = || metrics.connections.get_or_create(&label).get();
        let refused = || metrics.connections_refused.get_or_create(&label).get();

        let first = a.admit(1).expect("under the cap");
        let second = a.admit(2).expect("at the cap");
        assert!(a.admit(3).is_none(), "past the cap");
        assert_eq!((open(), refused()), (2, 1));
        drop(first);
        assert_eq!(open(), 1);
        let third = a.admit(4).expect("a slot was given back");
        assert_eq!(*third.get_ref(), 4);
        assert!(a.admit(5).is_none());
        assert_eq!((open(), refused()), (2, 2));
        drop((second, third));
        assert_eq!(open(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn incoming_skips_what_allow_refuses_and_what_the_cap_refuses() {
        let metrics = Metrics::new();
        let script = Arc::new(Script::new([Ok(1), Ok(2), Ok(3), Ok(4)]));
        let a = Acceptor::new(script, "test", 1, metrics.clone());
        let mut incoming = std::pin::pin!(a.incoming(|c| *c != 1));
        let got = futures::StreamExt::next(&mut incoming)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(*got.get_ref(), 2, "1 is not allowed");
        // 3 and 4 are past the cap while 2 is open; the stream waits for the next.
        let next = tokio::time::timeout(
            Duration::from_secs(1),
            futures::StreamExt::next(&mut incoming),
        )
        .await;
        assert!(next.is_err(), "nothing under the cap");
        assert_eq!(
            metrics
                .connections_refused
                .get_or_create(&SocketLabel {
                    socket: "test".into()
                })
                .get(),
            2
        );
    }
}
