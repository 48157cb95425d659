//! The gRPC channel to an identity provider's socket and the reconnect backoff, shared by
//! the Workload API and broker clients.

use std::time::Duration;

use hyper_util::rt::TokioIo;
use spiffe::transport::Endpoint;
use tonic::transport::{Channel, Uri};

use crate::backoff::{Backoff, seed};

/// How long one connect may take. The provider is a local socket: it answers at once or
/// not at all.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// The reconnect backoff of every identity stream: 0.1 s doubling to 2 s, jittered. The
/// provider is on the node, so retrying often costs little, and a restarted SPIRE agent is
/// picked up within 2 s.
pub fn backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).jittered(seed())
}

/// A channel to `endpoint`, with HTTP/2 keepalives so that a provider that stops
/// answering ends the streams instead of holding them. `lazy`: connected at the first
/// call and again after the connection breaks (the broker's channel, shared by every pod
/// subscription); otherwise connected now (an error says the provider is unreachable).
pub async fn channel(endpoint: &Endpoint, lazy: bool) -> anyhow::Result<Channel> {
    let builder = |uri: String| {
        tonic::transport::Endpoint::from_shared(uri).map(|e| {
            e.connect_timeout(CONNECT_TIMEOUT)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
        })
    };
    match endpoint {
        Endpoint::Unix(path) => {
            let path = path.clone();
            let connector = tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    tokio::net::UnixStream::connect(path)
                        .await
                        .map(TokioIo::new)
                }
            });
            // The authority is not used on a unix socket; the Workload API's own clients
            // send `localhost`.
            let e = builder("http://localhost".into())?;
            Ok(if lazy {
                e.connect_with_connector_lazy(connector)
            } else {
                e.connect_with_connector(connector).await?
            })
        }
        Endpoint::Tcp { host, port } => {
            let host = if host.is_ipv6() {
                format!("[{host}]")
            } else {
                host.to_string()
            };
            let e = builder(format!("http://{host}:{port}"))?;
            Ok(if lazy {
                e.connect_lazy()
            } else {
                e.connect().await?
            })
        }
        // `Endpoint` is non-exhaustive; parsing makes no other kind today.
        other => anyhow::bail!("{other:?}: an endpoint kind this agent cannot connect to"),
    }
}
