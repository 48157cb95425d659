//! Prometheus metrics of the worker, served on `--metrics-addr` by the owner only.
//!
//! One registry, no globals: every component gets the [`Metrics`] handle it counts into.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// lock_wait, bind, fd_passing, reconcile, svid_wait, first_serve
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TypeLabel {
    pub type_url: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CniLabel {
    pub op: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

/// A file of the state folder, by its name there (`mesh-dns.json`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabel {
    pub file: String,
}

/// A pod record write that failed: `write` (an ADD's record) or `remove` (a DEL's).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: String,
}

/// A Kubernetes resource the worker watches (`pods`, `nodes`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabel {
    pub resource: String,
}

/// A failed Kubernetes watch: the resource and why (`forbidden`, `unauthorized`, `gone`,
/// `unreachable`, `server`, `api`, `other`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KubeErrorLabel {
    pub resource: String,
    pub reason: String,
}

/// A listener of the worker: `health`, `metrics`, `xds`, `cni`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SocketLabel {
    pub socket: String,
}

/// A failed accept: the listener and why (`emfile`, `enfile`, `nomem`, `connection`,
/// `other`; see `crate::accept`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AcceptErrorLabel {
    pub socket: String,
    pub kind: String,
}

/// An ADS stream ended over a subscription limit: the type and which limit (`names`,
/// `name_length`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    pub type_url: String,
    pub limit: String,
}

/// Where an SVID came from: `agent` (the Workload API) or `pod` (the SPIFFE broker).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SvidSourceLabel {
    pub source: String,
}

pub struct Metrics {
    pub registry: Registry,
    pub takeover_phase_seconds: Family<PhaseLabel, Histogram>,
    pub generation: Gauge,
    pub worker_respawns: Gauge,
    pub xds_pushes: Family<TypeLabel, Counter>,
    pub xds_acks: Family<TypeLabel, Counter>,
    pub xds_nacks: Family<TypeLabel, Counter>,
    pub xds_streams: Gauge,
    pub xds_resources: Family<TypeLabel, Counter>,
    pub xds_initial_resources: Family<TypeLabel, Counter>,
    pub snapshot_seq: Gauge,
    pub cni_requests: Family<CniLabel, Counter>,
    pub cni_ack_timeouts: Counter,
    pub cni_refused_peers: Counter,
    pub storage_quarantined: Counter,
    pub storage_write_errors: Family<OpLabel, Counter>,
    pub registry_reload_errors: Counter,
    pub state_writes: Family<FileLabel, Counter>,
    pub state_write_errors: Family<FileLabel, Counter>,
    pub registrar_connected: Gauge,
    pub registrar_resyncs: Counter,
    pub registrar_changes: Counter,
    pub registry_revision: Gauge,
    pub registrar_drain_marks: Family<ResultLabel, Counter>,
    pub kube_connected: Family<ResourceLabel, Gauge>,
    pub kube_watch_errors: Family<KubeErrorLabel, Counter>,
    pub kube_relists: Family<ResourceLabel, Counter>,
    pub kube_terminating_marks: Counter,
    pub kube_taint_patches: Family<ResultLabel, Counter>,
    pub stale_records_removed: Counter,
    pub cni_evictions: Counter,
    pub accept_errors: Family<AcceptErrorLabel, Counter>,
    pub connections: Family<SocketLabel, Gauge>,
    pub connections_refused: Family<SocketLabel, Counter>,
    pub xds_subscription_refusals: Family<LimitLabel, Counter>,
    pub identity_svid_updates: Family<SvidSourceLabel, Counter>,
    pub identity_subscriptions: Gauge,
    pub identity_workload_api_connected: Gauge,
    pub pods_without_svid: Gauge,
    pub svids_expiring: Gauge,
    /// The last text exposition and when it was made (see [`Metrics::encode_cached`]).
    encoded: std::sync::Mutex<Option<(tokio::time::Instant, Arc<str>)>>,
}

fn phase_histogram() -> Histogram {
    // 10 µs to ~10 s: the takeover steps are microseconds, the lock wait can be minutes.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(1e-5, 4.0, 11))
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut m = Self {
            registry: Registry::with_prefix("aether"),
            takeover_phase_seconds: Family::new_with_constructor(phase_histogram),
            generation: Gauge::default(),
            worker_respawns: Gauge::default(),
            xds_pushes: Family::default(),
            xds_acks: Family::default(),
            xds_nacks: Family::default(),
            xds_streams: Gauge::default(),
            xds_resources: Family::default(),
            xds_initial_resources: Family::default(),
            snapshot_seq: Gauge::default(),
            cni_requests: Family::default(),
            cni_ack_timeouts: Counter::default(),
            cni_refused_peers: Counter::default(),
            storage_quarantined: Counter::default(),
            storage_write_errors: Family::default(),
            registry_reload_errors: Counter::default(),
            state_writes: Family::default(),
            state_write_errors: Family::default(),
            registrar_connected: Gauge::default(),
            registrar_resyncs: Counter::default(),
            registrar_changes: Counter::default(),
            registry_revision: Gauge::default(),
            registrar_drain_marks: Family::default(),
            kube_connected: Family::default(),
            kube_watch_errors: Family::default(),
            kube_relists: Family::default(),
            kube_terminating_marks: Counter::default(),
            kube_taint_patches: Family::default(),
            stale_records_removed: Counter::default(),
            cni_evictions: Counter::default(),
            accept_errors: Family::default(),
            connections: Family::default(),
            connections_refused: Family::default(),
            xds_subscription_refusals: Family::default(),
            identity_svid_updates: Family::default(),
            identity_subscriptions: Gauge::default(),
            identity_workload_api_connected: Gauge::default(),
            pods_without_svid: Gauge::default(),
            svids_expiring: Gauge::default(),
            encoded: std::sync::Mutex::new(None),
        };
        let r = &mut m.registry;
        r.register("takeover_phase_seconds", "Duration of each takeover phase", m.takeover_phase_seconds.clone());
        r.register("generation", "Node generation this agent owns (0 while standby)", m.generation.clone());
        r.register("worker_respawns", "Times the supervisor respawned a worker of this generation", m.worker_respawns.clone());
        r.register("xds_pushes", "xDS responses sent, by type", m.xds_pushes.clone());
        r.register("xds_acks", "xDS ACKs received, by type", m.xds_acks.clone());
        r.register("xds_nacks", "xDS NACKs received, by type", m.xds_nacks.clone());
        r.register("xds_streams", "Open ADS streams", m.xds_streams.clone());
        r.register("xds_resources", "xDS resources sent, with delta removals, by type", m.xds_resources.clone());
        r.register(
            "xds_initial_resources",
            "xDS resources in each stream's first response of a type (a reconnect to an identical snapshot over delta ADS sends none)",
            m.xds_initial_resources.clone(),
        );
        r.register("snapshot_seq", "Snapshots this worker has built since it started (one per change step)", m.snapshot_seq.clone());
        r.register("cni_requests", "CNI API calls, by operation and result", m.cni_requests.clone());
        r.register("cni_ack_timeouts", "CNI ADDs answered before the proxy ACKed (2 s best-effort wait)", m.cni_ack_timeouts.clone());
        r.register("cni_refused_peers", "Connections to cni.sock closed because the peer's uid is neither root nor the socket's owner", m.cni_refused_peers.clone());
        r.register("storage_quarantined", "Pod records moved to quarantine", m.storage_quarantined.clone());
        r.register(
            "storage_write_errors",
            "Pod record writes and removals that failed, by op (write, remove; the log and /ready name the path and cause)",
            m.storage_write_errors.clone(),
        );
        r.register("registry_reload_errors", "Registry or capture file reloads rejected", m.registry_reload_errors.clone());
        r.register("state_writes", "Owner-only state files written (atomically), by file", m.state_writes.clone());
        r.register("state_write_errors", "Owner-only state file writes that failed, by file (the log names the path)", m.state_write_errors.clone());
        r.register("registrar_connected", "1 while a registrar watch stream is open", m.registrar_connected.clone());
        r.register("registrar_resyncs", "Full views the registrar sent again because a resume was not possible", m.registrar_resyncs.clone());
        r.register("registrar_changes", "Single-key changes received from the registrar", m.registrar_changes.clone());
        r.register("registry_revision", "The registrar revision this agent's registry view is at", m.registry_revision.clone());
        r.register("registrar_drain_marks", "Drain marks sent by the owner, by result (set, not_found, refused, retry)", m.registrar_drain_marks.clone());
        r.register("kube_connected", "1 while the Kubernetes watch of the resource is current", m.kube_connected.clone());
        r.register("kube_watch_errors", "Kubernetes watch failures, by resource and reason", m.kube_watch_errors.clone());
        r.register("kube_relists", "Complete lists of a Kubernetes resource after the first (an expired resource version)", m.kube_relists.clone());
        r.register("kube_terminating_marks", "Pod records the owner rewrote as Terminating (the pod has a deletion timestamp)", m.kube_terminating_marks.clone());
        r.register("kube_taint_patches", "Node patches removing the startup taint, by result (removed, conflict, forbidden, error)", m.kube_taint_patches.clone());
        r.register("stale_records_removed", "Pod records removed because the API server no longer had their pod for the grace period", m.stale_records_removed.clone());
        r.register("cni_evictions", "Older pod records a CNI ADD evicted because they held the new pod's IP", m.cni_evictions.clone());
        r.register("accept_errors", "Failed accepts, by listener and kind (each but connection backs off 10 ms doubling to 1 s)", m.accept_errors.clone());
        r.register("connections", "Connections open on each listener", m.connections.clone());
        r.register("connections_refused", "Connections closed at once because their listener was at its connection cap", m.connections_refused.clone());
        r.register(
            "xds_subscription_refusals",
            "ADS streams ended with RESOURCE_EXHAUSTED over a subscription limit, by type and limit (names, name_length)",
            m.xds_subscription_refusals.clone(),
        );
        r.register("identity_svid_updates", "New SVIDs received, by source (agent: the Workload API; pod: the SPIFFE broker)", m.identity_svid_updates.clone());
        r.register("identity_subscriptions", "Open SVID streams at the SPIFFE broker, one per local pod", m.identity_subscriptions.clone());
        r.register("identity_workload_api_connected", "1 while the Workload API stream of the agent's own SVID is open", m.identity_workload_api_connected.clone());
        r.register("pods_without_svid", "Local pods without an SVID (in strict mTLS mode they have no inbound listener)", m.pods_without_svid.clone());
        r.register("svids_expiring", "SVIDs held past 80 % of their lifetime with no renewal (the agent's and the pods')", m.svids_expiring.clone());
        Arc::new(m)
    }

    pub fn observe_phase(&self, phase: &str, seconds: f64) {
        self.takeover_phase_seconds.get_or_create(&PhaseLabel { phase: phase.to_string() }).observe(seconds);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// [`Metrics::encode`], made at most once per `max_age`: every scrape within it gets
    /// the same text, so a flood of connections to the metrics port costs a copy of a
    /// reference each, not an encoding of every metric.
    pub fn encode_cached(&self, max_age: std::time::Duration) -> Arc<str> {
        let now = tokio::time::Instant::now();
        let mut cached = self.encoded.lock().unwrap_or_else(|e| e.into_inner());
        match &*cached {
            Some((at, text)) if now.duration_since(*at) < max_age => text.clone(),
            _ => {
                let text: Arc<str> = self.encode().into();
                *cached = Some((now, text.clone()));
                text
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_cached_text_is_made_again_only_once_it_is_older_than_its_age() {
        let m = Metrics::new();
        let age = Duration::from_secs(1);
        let first = m.encode_cached(age);
        assert!(first.contains("aether_cni_evictions_total 0"), "{first}");
        m.cni_evictions.inc();
        tokio::time::advance(Duration::from_millis(999)).await;
        let cached = m.encode_cached(age);
        assert!(Arc::ptr_eq(&first, &cached), "made again within its age");
        tokio::time::advance(Duration::from_millis(1)).await;
        let fresh = m.encode_cached(age);
        assert!(fresh.contains("aether_cni_evictions_total 1"), "{fresh}");
    }
}
