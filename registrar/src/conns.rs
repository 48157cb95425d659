//! Connection caps on the registry API's listener: at most `--max-connections` open at
//! once, and at most `--max-connections-per-source` from one source address (TCP). A
//! connection past either cap is closed at once, before a TLS handshake or an HTTP/2
//! preface, and counted (`aether_registrar_connections_refused`); the open ones are the
//! `aether_registrar_connections` gauge. An admitted connection holds its place until it
//! closes.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;

use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub total: usize,
    pub per_source: usize,
}

pub struct Conns {
    limits: ConnLimits,
    open: Mutex<Open>,
    metrics: Arc<Metrics>,
}

#[derive(Default)]
struct Open {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

/// A connection's place under the caps, given back when dropped.
pub struct Admission {
    conns: Arc<Conns>,
    source: Option<IpAddr>,
}

impl Conns {
    pub fn new(limits: ConnLimits, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Conns {
            limits,
            open: Mutex::default(),
            metrics,
        })
    }

    /// A place for a connection from `source` (None: a unix socket), or None past a cap,
    /// counted and logged.
    pub fn admit(self: &Arc<Self>, source: Option<IpAddr>) -> Option<Admission> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let refused = if open.total >= self.limits.total {
            Some("total")
        } else if source.is_some_and(|ip| {
            open.by_source.get(&ip).copied().unwrap_or(0) >= self.limits.per_source
        }) {
            Some("per_source")
        } else {
            None
        };
        if let Some(cap) = refused {
            drop(open);
            Metrics::count(&self.metrics.connections_refused, cap);
            tracing::warn!(source = ?source, cap, max_connections = self.limits.total, max_per_source = self.limits.per_source,
                "too many connections; connection closed");
            return None;
        }
        open.total += 1;
        if let Some(ip) = source {
            *open.by_source.entry(ip).or_default() += 1;
        }
        self.metrics.connections.inc();
        Some(Admission {
            conns: self.clone(),
            source,
        })
    }

    /// Connections open now, and from `source`.
    pub fn open(&self, source: IpAddr) -> (usize, usize) {
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        (
            open.total,
            open.by_source.get(&source).copied().unwrap_or(0),
        )
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut open = self.conns.open.lock().unwrap_or_else(|e| e.into_inner());
        open.total -= 1;
        if let Some(ip) = self.source
            && let Some(n) = open.by_source.get_mut(&ip)
        {
            *n -= 1;
            if *n == 0 {
                open.by_source.remove(&ip);
            }
        }
        self.conns.metrics.connections.dec();
    }
}

/// A connection with its place under the caps.
pub struct Admitted<IO> {
    io: IO,
    _admission: Admission,
}

impl<IO> Admitted<IO> {
    pub fn new(io: IO, admission: Admission) -> Self {
        Admitted {
            io,
            _admission: admission,
        }
    }
}

impl<IO: Connected> Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Plain TCP connections from `listener`, each admitted under the caps or closed.
pub fn tcp(
    listener: tokio::net::TcpListener,
    conns: Arc<Conns>,
) -> impl Stream<Item = io::Result<Admitted<tokio::net::TcpStream>>> {
    tokio_stream::wrappers::TcpListenerStream::new(listener).filter_map(move |accepted| {
        match accepted {
            Ok(tcp) => {
                let source = tcp.peer_addr().ok().map(|a| a.ip());
                conns.admit(source).map(|a| {
                    let _ = tcp.set_nodelay(true);
                    Ok(Admitted::new(tcp, a))
                })
            }
            Err(e) => Some(Err(e)),
        }
    })
}

/// Unix socket connections from `listener`, each admitted under the total cap or closed.
pub fn unix(
    listener: tokio::net::UnixListener,
    conns: Arc<Conns>,
) -> impl Stream<Item = io::Result<Admitted<tokio::net::UnixStream>>> {
    tokio_stream::wrappers::UnixListenerStream::new(listener).filter_map(move |accepted| {
        match accepted {
            Ok(s) => conns.admit(None).map(|a| Ok(Admitted::new(s, a))),
            Err(e) => Some(Err(e)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_past_each_cap_are_refused_counted_and_given_back_on_close() {
        let metrics = Metrics::new(false);
        let conns = Conns::new(
            ConnLimits {
                total: 3,
                per_source: 2,
            },
            metrics.clone(),
        );
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let a1 = conns.admit(Some(a)).unwrap();
        let _a2 = conns.admit(Some(a)).unwrap();
        assert!(conns.admit(Some(a)).is_none(), "a's third");
        let _b1 = conns.admit(Some(b)).unwrap();
        assert!(conns.admit(Some(b)).is_none(), "the fourth in all");
        assert!(conns.admit(None).is_none(), "a unix one too");
        assert_eq!(conns.open(a), (3, 2));
        drop(a1);
        assert_eq!(conns.open(a), (2, 1));
        let _a3 = conns.admit(Some(a)).unwrap();
        let text = metrics.encode();
        for want in [
            "aether_registrar_connections 3",
            "aether_registrar_connections_refused_total{result=\"per_source\"} 1",
            "aether_registrar_connections_refused_total{result=\"total\"} 2",
        ] {
            assert!(text.contains(want), "{want} not in\n{text}");
        }
    }
}
