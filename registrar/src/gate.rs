//! The gate in front of the registry API: a tower layer that identifies the caller from
//! the request's headers and the connection's credentials (the unix peer's uid, or the
//! bearer token by TokenReview), authorizes the method (`authz::authorize`), and answers
//! UNAUTHENTICATED or PERMISSION_DENIED before the service reads a byte of the body. An
//! admitted request carries its [`Peer`] in its extensions for the handler, which still
//! checks the node a request names (`authz::check_node`) once it has decoded it.
//!
//! The body of an admitted request is capped by method: a watch, a drain mark and a
//! delete at [`BodyLimits::small`], an apply at [`BodyLimits::apply`]; past the cap the
//! call ends with RESOURCE_EXHAUSTED. A path that is no method of the API is answered
//! UNIMPLEMENTED here, identifying nobody.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use tonic::Status;
use tonic::body::Body;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo, UdsConnectInfo};

use crate::authz::{self, Method, Peer, Policy, SvidIdentity, TokenIdentity};
use crate::metrics::Metrics;
use crate::mtls::ClientSvid;
use crate::tokenreview::{ReviewError, Reviewer};

/// The path prefix of the API's methods.
const SERVICE_PATH: &str = "/aether.registry.v1.Registry/";

/// How callers reach this registrar, which decides how they are identified.
#[derive(Clone)]
pub enum Transport {
    Unix,
    InsecureTcp,
    /// TCP whose callers present a bearer token, checked with TokenReview.
    TokenTcp(Arc<Reviewer>),
    /// Mutual TLS: callers present an X.509-SVID, checked at the handshake
    /// (`crate::mtls`); with a reviewer, a caller without one may present a bearer token
    /// instead, and one that sends both must pass with each.
    Mtls(Option<Arc<Reviewer>>),
}

/// The largest request body, gRPC framing included, per method.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    /// WatchEndpoints, SetEndpointState, DeleteService.
    pub small: usize,
    /// ApplyServices.
    pub apply: usize,
    /// SetQuicPairs: a node's whole set.
    pub pairs: usize,
}

pub struct Gate {
    pub transport: Transport,
    pub policy: Policy,
    pub limits: BodyLimits,
    pub metrics: Arc<Metrics>,
}

/// The method a request path names.
pub fn method(path: &str) -> Option<Method> {
    match path.strip_prefix(SERVICE_PATH)? {
        "WatchEndpoints" => Some(Method::WatchEndpoints),
        "SetEndpointState" => Some(Method::SetEndpointState),
        "SetQuicPairs" => Some(Method::SetQuicPairs),
        "ApplyServices" => Some(Method::ApplyServices),
        "DeleteService" => Some(Method::DeleteService),
        _ => None,
    }
}

/// The bearer token of the `authorization` header, if any.
fn bearer(req: &http::request::Parts) -> Option<&str> {
    req.headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// The source address of a TCP connection, plain or TLS.
pub fn source(ext: &http::Extensions) -> Option<IpAddr> {
    ext.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
        .map(|a| a.ip())
}

impl Gate {
    /// Who the caller is, or why it is refused (UNAUTHENTICATED, or RESOURCE_EXHAUSTED /
    /// UNAVAILABLE when TokenReview cannot be asked now).
    async fn identify(&self, req: &http::request::Parts, method: Method) -> Result<Peer, Status> {
        match &self.transport {
            Transport::InsecureTcp => Ok(Peer::InsecureTcp),
            Transport::Unix => Ok(req
                .extensions
                .get::<UdsConnectInfo>()
                .and_then(|i| i.peer_cred)
                .map_or(Peer::UnixUnknown, |c| Peer::Unix { uid: c.uid() })),
            Transport::TokenTcp(reviewer) => {
                let source = source(&req.extensions);
                let Some(token) = bearer(req) else {
                    tracing::warn!(method = ?method, source = ?source, "refused: no bearer token");
                    Metrics::count(&self.metrics.refusals, "unauthenticated");
                    return Err(Status::unauthenticated(
                        "no bearer token: send the pod's projected service-account token (audience aether-registrar) as `authorization: Bearer <token>`",
                    ));
                };
                self.review(reviewer, token, source, method)
                    .await
                    .map(Peer::Token)
            }
            Transport::Mtls(reviewer) => {
                let source = source(&req.extensions);
                let refused = |reason: &str, why: String| {
                    tracing::warn!(method = ?method, source = ?source, "refused: {why}");
                    Metrics::count(&self.metrics.refusals, reason);
                    Status::unauthenticated(why)
                };
                let unauthenticated = |why: String| refused("unauthenticated", why);
                let leaf = req
                    .extensions
                    .get::<TlsConnectInfo<TcpConnectInfo>>()
                    .and_then(|i| i.peer_certs())
                    .and_then(|c| c.first().cloned());
                let token = bearer(req);
                let token = match (token, reviewer) {
                    (Some(t), Some(r)) => Some(self.review(r, t, source, method).await?),
                    (Some(_), None) => {
                        return Err(unauthenticated(
                            "a bearer token was sent but this registrar checks none (no --token-review): both credentials must hold, so send the SVID alone".into(),
                        ));
                    }
                    (None, _) => None,
                };
                let Some(leaf) = leaf else {
                    return match (token, reviewer) {
                        (Some(t), _) => Ok(Peer::Token(t)),
                        (None, Some(_)) => Err(unauthenticated(
                            "no client certificate and no bearer token: present the agent's X.509-SVID, or send the pod's projected service-account token".into(),
                        )),
                        (None, None) => Err(unauthenticated(
                            "no client certificate: present an X.509-SVID from the trust bundle".into(),
                        )),
                    };
                };
                // Checked at the handshake; read again here for the ID and the expiry.
                let svid = ClientSvid::parse(&leaf)
                    .map_err(|e| unauthenticated(format!("the client certificate: {e}")))?;
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                if svid.not_after <= now {
                    return Err(refused(
                        "svid_expired",
                        format!(
                            "the client certificate of {} (serial {}) expired at {} (epoch seconds): reconnect with the rotated SVID",
                            svid.spiffe_id, svid.serial, svid.not_after
                        ),
                    ));
                }
                let node = self.policy.agent_id(&svid.spiffe_id).flatten();
                Ok(Peer::Svid(Box::new(SvidIdentity {
                    spiffe_id: svid.spiffe_id,
                    serial: svid.serial,
                    not_after: svid.not_after,
                    node,
                    token,
                })))
            }
        }
    }

    /// Reviews `token`; a refusal is counted and answered with its status.
    async fn review(
        &self,
        reviewer: &Reviewer,
        token: &str,
        source: Option<IpAddr>,
        method: Method,
    ) -> Result<TokenIdentity, Status> {
        reviewer.review(token, source).await.map_err(|e| {
            tracing::warn!(method = ?method, source = ?source, "refused: {e}");
            let (reason, status) = match e {
                ReviewError::Refused(why) => ("unauthenticated", Status::unauthenticated(why)),
                e @ ReviewError::Failed(_) => ("review_failed", Status::unavailable(e.to_string())),
                e @ ReviewError::RateLimited => {
                    ("review_rate", Status::resource_exhausted(e.to_string()))
                }
                e @ ReviewError::Busy => ("reviews_busy", Status::unavailable(e.to_string())),
            };
            Metrics::count(&self.metrics.refusals, reason);
            status
        })
    }

    /// The caller, authorized for the method the path names.
    pub async fn admit(&self, req: &http::request::Parts) -> Result<(Peer, Method), Status> {
        let Some(method) = method(req.uri.path()) else {
            return Err(Status::unimplemented(format!(
                "{}: no such method",
                req.uri.path()
            )));
        };
        let counted = |status: Status| {
            self.metrics
                .call(method.name(), &Err::<(), _>(status.clone()));
            status
        };
        let peer = self.identify(req, method).await.map_err(counted)?;
        authz::authorize(&self.policy, &peer, method).map_err(|e| {
            tracing::warn!(peer = %peer, method = ?method, "refused: {e}");
            Metrics::count(&self.metrics.refusals, "permission_denied");
            counted(Status::permission_denied(e.to_string()))
        })?;
        Ok((peer, method))
    }

    fn limit(&self, method: Method) -> usize {
        match method {
            Method::ApplyServices => self.limits.apply,
            Method::SetQuicPairs => self.limits.pairs,
            _ => self.limits.small,
        }
    }
}

/// The layer of [`Gate`], for `tonic::transport::Server::layer`.
#[derive(Clone)]
pub struct GateLayer(pub Arc<Gate>);

impl<S> tower_layer::Layer<S> for GateLayer {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> GateService<S> {
        GateService {
            gate: self.0.clone(),
            inner,
        }
    }
}

#[derive(Clone)]
pub struct GateService<S> {
    gate: Arc<Gate>,
    inner: S,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S> tower_service::Service<http::Request<Body>> for GateService<S>
where
    S: tower_service::Service<http::Request<Body>, Response = http::Response<Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call; the fresh one the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let gate = self.gate.clone();
        Box::pin(async move {
            // The body stays out of the future while the caller is identified.
            let (mut parts, body) = req.into_parts();
            match gate.admit(&parts).await {
                Ok((peer, method)) => {
                    let limit = gate.limit(method);
                    parts.extensions.insert(peer);
                    let body = Body::new(Capped {
                        inner: body,
                        left: limit,
                        limit,
                        method,
                        metrics: gate.metrics.clone(),
                    });
                    inner.call(http::Request::from_parts(parts, body)).await
                }
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

/// A request body that ends with RESOURCE_EXHAUSTED once it passes `limit` bytes.
struct Capped {
    inner: Body,
    left: usize,
    limit: usize,
    method: Method,
    metrics: Arc<Metrics>,
}

impl http_body::Body for Capped {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(data) = f.data_ref()
        {
            if data.len() > self.left {
                self.left = 0;
                let method = self.method;
                tracing::warn!(method = ?method, limit = self.limit, "refused: the request body is over the method's limit");
                Metrics::count(&self.metrics.refusals, "too_large");
                let status = Status::resource_exhausted(format!(
                    "the request is over {} bytes, the limit of {method:?}",
                    self.limit
                ));
                self.metrics
                    .call(method.name(), &Err::<(), _>(status.clone()));
                return Poll::Ready(Some(Err(status)));
            }
            self.left -= data.len();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower_layer::Layer;
    use tower_service::Service;

    /// Counts the requests it is handed and reads their bodies to the end.
    #[derive(Clone, Default)]
    struct Inner {
        calls: Arc<AtomicUsize>,
    }

    impl Service<http::Request<Body>> for Inner {
        type Response = http::Response<Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<Body>) -> Self::Future {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                use http_body_util::BodyExt;
                let peer = req.extensions().get::<Peer>().cloned();
                let status = match req.into_body().collect().await {
                    Ok(_) => Status::ok(format!("{peer:?}")),
                    Err(s) => s,
                };
                Ok(status.into_http())
            })
        }
    }

    fn request(method: &str, uid: Option<u32>, body: usize) -> http::Request<Body> {
        let mut req = http::Request::builder()
            .uri(format!("http://x{SERVICE_PATH}{method}"))
            .body(Body::new(http_body_util::Full::new(Bytes::from(vec![
                0u8;
                body
            ]))))
            .unwrap();
        if let Some(uid) = uid {
            // A unix socket's credentials as tonic records them, taken from a real pair.
            let (a, _b) = tokio::net::UnixStream::pair().unwrap();
            let mut info = tonic::transport::server::Connected::connect_info(&a);
            info.peer_cred = info.peer_cred.filter(|c| c.uid() == uid);
            req.extensions_mut().insert(info);
        }
        req
    }

    fn code(resp: &http::Response<Body>) -> tonic::Code {
        Status::from_header_map(resp.headers()).map_or(tonic::Code::Ok, |s| s.code())
    }

    /// A refused caller's request never reaches the service, and is counted.
    #[tokio::test]
    async fn callers_are_refused_before_the_service_sees_the_request() {
        let me = nix::unistd::getuid().as_raw();
        let metrics = Metrics::new(false);
        let gate = |agents: Vec<u32>, operators: Vec<u32>| {
            GateLayer(Arc::new(Gate {
                transport: Transport::Unix,
                policy: Policy {
                    agent_uids: agents,
                    operator_uids: operators,
                    ..Default::default()
                },
                limits: BodyLimits {
                    small: 64,
                    apply: 1024,
                    pairs: 1024,
                },
                metrics: metrics.clone(),
            }))
        };
        let inner = Inner::default();
        // An agent may watch but not apply; the apply never reaches the service.
        let mut svc = gate(vec![me], vec![]).layer(inner.clone());
        let resp = svc
            .call(request("ApplyServices", Some(me), 10))
            .await
            .unwrap();
        assert_eq!(code(&resp), tonic::Code::PermissionDenied);
        assert_eq!(inner.calls.load(Ordering::SeqCst), 0);
        // Without credentials nobody is anybody.
        let resp = svc.call(request("WatchEndpoints", None, 10)).await.unwrap();
        assert_eq!(code(&resp), tonic::Code::PermissionDenied);
        assert_eq!(inner.calls.load(Ordering::SeqCst), 0);
        let resp = svc.call(request("Nothing", Some(me), 10)).await.unwrap();
        assert_eq!(code(&resp), tonic::Code::Unimplemented);
        assert_eq!(inner.calls.load(Ordering::SeqCst), 0);
        // Admitted: the service gets the peer in the request's extensions.
        let resp = svc
            .call(request("WatchEndpoints", Some(me), 10))
            .await
            .unwrap();
        assert_eq!(code(&resp), tonic::Code::Ok);
        assert_eq!(inner.calls.load(Ordering::SeqCst), 1);
        let text = metrics.encode();
        for want in [
            "aether_registrar_refusals_total{reason=\"permission_denied\"} 2",
            "aether_registrar_calls_total{method=\"ApplyServices\",code=\"PermissionDenied\"} 1",
            "aether_registrar_calls_total{method=\"WatchEndpoints\",code=\"PermissionDenied\"} 1",
        ] {
            assert!(text.contains(want), "{want} not in\n{text}");
        }
    }

    /// A watch's body is capped at the small limit, an apply's at its own.
    #[tokio::test]
    async fn bodies_are_capped_by_method() {
        let me = nix::unistd::getuid().as_raw();
        let metrics = Metrics::new(false);
        let inner = Inner::default();
        let mut svc = GateLayer(Arc::new(Gate {
            transport: Transport::Unix,
            policy: Policy {
                operator_uids: vec![me],
                ..Default::default()
            },
            limits: BodyLimits {
                small: 64,
                apply: 1024,
                pairs: 1024,
            },
            metrics: metrics.clone(),
        }))
        .layer(inner.clone());
        for (method, size, want) in [
            ("WatchEndpoints", 64, tonic::Code::Ok),
            ("WatchEndpoints", 65, tonic::Code::ResourceExhausted),
            ("SetEndpointState", 65, tonic::Code::ResourceExhausted),
            ("ApplyServices", 1000, tonic::Code::Ok),
            ("ApplyServices", 1025, tonic::Code::ResourceExhausted),
        ] {
            let resp = svc.call(request(method, Some(me), size)).await.unwrap();
            assert_eq!(code(&resp), want, "{method} {size}");
        }
        let text = metrics.encode();
        assert!(
            text.contains("aether_registrar_refusals_total{reason=\"too_large\"} 3"),
            "{text}"
        );
    }
}
