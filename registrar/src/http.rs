//! The registrar's plain HTTP/1.1 ports (hyper): `--metrics-addr` ([`crate::metrics`])
//! and `--health-addr` ([`crate::health`]). Each listener holds at most
//! [`MAX_CONNECTIONS`] connections, one past it closed at once, and each connection
//! lasts at most 10 s.

use std::sync::Arc;
use std::time::Duration;

/// Connections a listener holds at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may last: a scrape or a probe.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves HTTP/1.1 on `listener` until the task is dropped, answering each request with
/// what `route` gives for its method and path: status, content type and body.
pub async fn serve<R, F>(listener: tokio::net::TcpListener, route: R)
where
    R: Fn(hyper::Method, String) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = (u16, &'static str, String)> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (tcp, _) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "http: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue;
        };
        let route = route.clone();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let answer = route(req.method().clone(), req.uri().path().to_owned());
                    async move {
                        let (status, content_type, body) = answer.await;
                        hyper::Response::builder()
                            .status(status)
                            .header("content-type", content_type)
                            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
                    }
                });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
            drop(slot);
        });
    }
}
