//! `--metrics-addr`: the registrar's Prometheus metrics, as OpenMetrics text on
//! `GET /metrics` (HTTP/1.1, served by [`crate::http`]). One registry, no globals: the
//! service, the watch streams, the TLS acceptor and the Lease count into the [`Metrics`]
//! handle they get.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    /// WatchEndpoints, SetEndpointState, ApplyServices, DeleteService
    pub method: String,
    /// The gRPC status code the call ended with at once: OK, or why it was refused.
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FromLabel {
    pub from: String,
}

/// A one-label set, made from its value.
pub trait Label:
    Clone + std::hash::Hash + Eq + EncodeLabelSet + std::fmt::Debug + Send + Sync + 'static
{
    fn new(value: &str) -> Self;
}

impl Label for ResultLabel {
    fn new(value: &str) -> Self {
        ResultLabel {
            result: value.into(),
        }
    }
}

impl Label for FromLabel {
    fn new(value: &str) -> Self {
        FromLabel { from: value.into() }
    }
}

impl Label for ReasonLabel {
    fn new(value: &str) -> Self {
        ReasonLabel {
            reason: value.into(),
        }
    }
}

pub struct Metrics {
    registry: Registry,
    /// Calls by method and the status they returned (a watch: its opening).
    pub calls: Family<CallLabels, Counter>,
    /// Watch streams open now.
    pub watch_streams: Gauge,
    /// Full views sent, by where they were built from: kept (the view this process keeps
    /// from its etcd watch) or etcd (read for the stream: the kept view was not live, or
    /// `--full-views-from-etcd`).
    pub full_views: Family<FromLabel, Counter>,
    /// Watch streams ended, by why: client_gone, replaced, shutdown, failed, expired (the
    /// caller's client certificate passed its notAfter).
    pub watch_ends: Family<ResultLabel, Counter>,
    /// TLS handshakes on the TCP listener: ok, failed, timeout, over_cap.
    pub tls_handshakes: Family<ResultLabel, Counter>,
    /// Connections to the registry API open now.
    pub connections: Gauge,
    /// Connections closed at once, by the cap they hit: total, per_source.
    pub connections_refused: Family<ResultLabel, Counter>,
    /// Calls refused before their handler, by reason: unauthenticated, permission_denied,
    /// too_large, review_rate, reviews_busy, review_failed, watch_streams_per_node,
    /// drain_mark_rate; with mutual TLS also the client certificates refused at the
    /// handshake or at a call: svid_untrusted, svid_expired, svid_uri_sans,
    /// svid_trust_domain, svid_malformed, svid_missing.
    pub refusals: Family<ReasonLabel, Counter>,
    /// Bearer tokens checked, by how: prefiltered, cached, rate_limited, busy,
    /// authenticated, refused, failed (the last three asked TokenReview).
    pub token_reviews: Family<ResultLabel, Counter>,
    /// Drain marks naming no service that read every endpoint, the address index being
    /// behind etcd.
    pub drain_mark_scans: Counter,
    /// 1 while this replica holds the Lease (discovery and the taint guard write). Exported
    /// only by a replica that takes part in the election, so that a sum of 0 over the
    /// replicas means that nobody writes.
    pub leader: Gauge,
    /// Slice endpoints discovery left out of a service it wrote, for an address no
    /// endpoint may have (link-local, multicast, unspecified, or loopback without
    /// --allow-loopback-endpoints); counted at each write of the service.
    pub discovery_endpoints_refused: Counter,
}

impl Metrics {
    /// `leasing`: this replica runs for the Lease (discovery or the taint guard is on).
    pub fn new(leasing: bool) -> Arc<Self> {
        let mut registry = Registry::with_prefix("aether_registrar");
        let calls = Family::<CallLabels, Counter>::default();
        registry.register(
            "calls",
            "Registry API calls by method and the status each returned",
            calls.clone(),
        );
        let watch_streams = Gauge::default();
        registry.register(
            "watch_streams",
            "Watch streams open now",
            watch_streams.clone(),
        );
        let full_views = Family::<FromLabel, Counter>::default();
        registry.register(
            "full_views",
            "Full views sent, by what they were built from: kept (the view kept from the registrar's etcd watch) or etcd (read for the stream)",
            full_views.clone(),
        );
        let watch_ends = Family::<ResultLabel, Counter>::default();
        registry.register(
            "watch_ends",
            "Watch streams ended, by why: client_gone, replaced, shutdown, failed, expired",
            watch_ends.clone(),
        );
        let tls_handshakes = Family::<ResultLabel, Counter>::default();
        registry.register(
            "tls_handshakes",
            "TLS handshakes on the TCP listener: ok, failed, timeout, over_cap",
            tls_handshakes.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "connections",
            "Connections to the registry API open now",
            connections.clone(),
        );
        let connections_refused = Family::<ResultLabel, Counter>::default();
        registry.register(
            "connections_refused",
            "Connections closed at once, by the cap they hit: total, per_source",
            connections_refused.clone(),
        );
        let refusals = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "refusals",
            "Calls refused before their handler ran or by a limit, by reason",
            refusals.clone(),
        );
        let token_reviews = Family::<ResultLabel, Counter>::default();
        registry.register(
            "token_reviews",
            "Bearer tokens checked, by how: prefiltered, cached, rate_limited, busy, authenticated, refused, failed",
            token_reviews.clone(),
        );
        let drain_mark_scans = Counter::default();
        registry.register(
            "drain_mark_scans",
            "Drain marks naming no service that read every endpoint, the address index being behind etcd",
            drain_mark_scans.clone(),
        );
        let leader = Gauge::default();
        if leasing {
            registry.register(
                "leader",
                "1 while this replica holds the Lease and writes",
                leader.clone(),
            );
        }
        let discovery_endpoints_refused = Counter::default();
        if leasing {
            registry.register(
                "discovery_endpoints_refused",
                "EndpointSlice endpoints left out of a written service for an address no endpoint may have",
                discovery_endpoints_refused.clone(),
            );
        }
        Arc::new(Metrics {
            registry,
            discovery_endpoints_refused,
            calls,
            watch_streams,
            full_views,
            watch_ends,
            tls_handshakes,
            connections,
            connections_refused,
            refusals,
            token_reviews,
            drain_mark_scans,
            leader,
        })
    }

    /// Counts a call of `method` that returned `result`.
    pub fn call<T>(&self, method: &str, result: &Result<T, tonic::Status>) {
        let code = match result {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        };
        self.calls
            .get_or_create(&CallLabels {
                method: method.into(),
                code: format!("{code:?}"),
            })
            .inc();
    }

    pub fn count<L: Label>(family: &Family<L, Counter>, value: &str) {
        family.get_or_create(&L::new(value)).inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics` on `listener` until the task is dropped; anything else is 404.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    crate::http::serve(listener, move |method, path| {
        let metrics = metrics.clone();
        async move {
            match (method, path.as_str()) {
                (hyper::Method::GET, "/metrics") => (
                    200,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    metrics.encode(),
                ),
                _ => (
                    404,
                    "text/plain; charset=utf-8",
                    "try GET /metrics\n".to_owned(),
                ),
            }
        }
    })
    .await
}
