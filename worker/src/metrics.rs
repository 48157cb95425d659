//! Prometheus metrics of the worker, served on `--metrics-addr` by the owner only.
//!
//! One registry, no globals: every component gets the [`Metrics`] handle it counts into.
//! The `process_*` metrics, Prometheus' conventional names with no prefix, sit in a
//! registry of their own and are read from `/proc/self` at each encoding.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
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

/// A file: of the state folder, by its name there (`mesh-dns.json`); or a watched input
/// file, by what it holds (`registry`, `capture`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FileLabel {
    pub file: String,
}

/// An xDS type by its short name: `cds`, `eds`, `lds`, `rds`, `sds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XdsTypeLabel {
    pub r#type: String,
}

/// What was built: the crate's version and the git commit (`AETHER_REVISION` at build
/// time, else `unknown`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    pub version: String,
    pub revision: String,
}

/// The commit the binary was built from, as `build.rs` derived it (`unknown` outside git).
pub const REVISION: &str = match option_env!("AETHER_REVISION") {
    Some(r) if !r.is_empty() => r,
    _ => "unknown",
};

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

/// Declares the worker's metrics once: each line is a field of [`Metrics`], its type, an
/// optional constructor (else `Default`), and its help text; the field's name is the
/// metric's name under the `aether_` prefix, and the exposition lists them in this order.
macro_rules! metrics {
    (@init) => {
        Default::default()
    };
    (@init $init:expr) => {
        $init
    };
    ($($name:ident: $ty:ty $(= $init:expr)?, $help:expr;)*) => {
        pub struct Metrics {
            pub registry: Registry,
            /// `process_*`, unprefixed: see [`ProcessCollector`].
            pub process: Registry,
            $(pub $name: $ty,)*
            /// The last text exposition and when it was made (see [`Metrics::encode_cached`]).
            encoded: std::sync::Mutex<Option<(tokio::time::Instant, Arc<str>)>>,
        }

        impl Metrics {
            /// Every metric made, and registered under its name in the table's order.
            fn declared() -> Self {
                let mut m = Self {
                    registry: Registry::with_prefix("aether"),
                    process: Registry::default(),
                    $($name: metrics!(@init $($init)?),)*
                    encoded: std::sync::Mutex::new(None),
                };
                $(m.registry.register(stringify!($name), $help, m.$name.clone());)*
                m
            }
        }
    };
}

metrics! {
    takeover_phase_seconds: Family<PhaseLabel, Histogram> = Family::new_with_constructor(phase_histogram),
        "Duration of each takeover phase";
    generation: Gauge,
        "Node generation this agent owns (0 while standby)";
    worker_respawns: Counter,
        "Times the supervisor respawned a worker of this generation";
    build_info: Family<BuildLabel, Gauge>,
        "1, labelled with the version and the git revision (unknown when the build did not say) of the worker";
    xds_pushes: Family<TypeLabel, Counter>,
        "xDS responses sent, by type";
    xds_acks: Family<TypeLabel, Counter>,
        "xDS ACKs received, by type";
    xds_nacks: Family<TypeLabel, Counter>,
        "xDS NACKs received, by type";
    xds_push_ack_seconds: Family<XdsTypeLabel, Histogram> = Family::new_with_constructor(push_ack_histogram),
        "Time from an xDS response sent on a stream to the proxy's ACK of it, by type (cds, eds, lds, rds, sds)";
    xds_streams: Gauge,
        "Open ADS streams";
    xds_resources: Family<TypeLabel, Counter>,
        "xDS resources sent, with delta removals, by type";
    xds_initial_resources: Family<TypeLabel, Counter>,
        "xDS resources in each stream's first response of a type (a reconnect to an identical snapshot over delta ADS sends none)";
    xds_digest_resumes: Family<TypeLabel, Counter>,
        "Types of a new delta ADS stream resumed by the xDS relay's digest (the proxy holds the snapshot's resources of the type, without listing their versions), by type";
    xds_offers_waiting: Gauge,
        "xDS relay digest offers waiting for the snapshot's digests (a cold owner's first computes them from every resource, off the runtime thread)";
    xds_bucket_resumes: Family<TypeLabel, Counter>,
        "Types of a new delta ADS stream resumed in part by the xDS relay's bucket digests (the proxy holds the snapshot's resources in the buckets matched, and lists its versions of the others), by type";
    xds_names_resumes: Family<TypeLabel, Counter>,
        "Types of a new delta ADS stream whose subscription the xDS relay re-stated by the digest of its names (the proxy subscribes to the snapshot's names of the type, without listing them), by type";
    snapshot_seq: Gauge,
        "Snapshots this worker has built since it started (one per change step)";
    cni_requests: Family<CniLabel, Counter>,
        "CNI API calls, by operation and result";
    cni_request_duration_seconds: Family<CniLabel, Histogram> = Family::new_with_constructor(cni_histogram),
        "Time the worker took to answer a CNI API call, by operation (add, del, check) and result (ok, error)";
    cni_ack_timeouts: Counter,
        "CNI ADDs answered before the proxy ACKed (2 s best-effort wait)";
    cni_refused_peers: Counter,
        "Connections to cni.sock closed because the peer's uid is neither root nor the socket's owner";
    storage_quarantined: Counter,
        "Pod records moved to quarantine";
    storage_records_read: Counter,
        "Pod records a scan of the folder read and decoded (a standby's look at the owner's writes, the takeover's reload)";
    storage_records_unread: Counter,
        "Pod records a scan took without reading: the folder entry showed the file it had read before";
    storage_write_errors: Family<OpLabel, Counter>,
        "Pod record writes and removals that failed, by op (write, remove; the log and /ready name the path and cause)";
    registry_reload_errors: Family<FileLabel, Counter>,
        "Watched file loads rejected or unreadable, by file (registry, capture); the last good content is kept";
    state_writes: Family<FileLabel, Counter>,
        "Owner-only state files written (atomically), by file";
    state_write_errors: Family<FileLabel, Counter>,
        "Owner-only state file writes that failed, by file (the log names the path)";
    registrar_connected: Gauge,
        "1 while a registrar watch stream is open";
    registrar_resyncs: Counter,
        "Full views the registrar sent again because a resume was not possible";
    registrar_changes: Counter,
        "Single-key changes received from the registrar";
    registrar_entries_dropped: Counter,
        "Entries received from the registrar that failed validation and were not built into the proxy's configuration (each named in a warn line)";
    registry_revision: Gauge,
        "The registrar revision this agent's registry view is at";
    registrar_drain_marks: Family<ResultLabel, Counter>,
        "Drain marks sent by the owner, by result (set, not_found, refused, retry)";
    kube_connected: Family<ResourceLabel, Gauge>,
        "1 while the Kubernetes watch of the resource is current";
    kube_watch_errors: Family<KubeErrorLabel, Counter>,
        "Kubernetes watch failures, by resource and reason";
    kube_relists: Family<ResourceLabel, Counter>,
        "Complete lists of a Kubernetes resource after the first (an expired resource version)";
    kube_terminating_marks: Counter,
        "Pod records the owner rewrote as Terminating (the pod has a deletion timestamp)";
    kube_taint_patches: Family<ResultLabel, Counter>,
        "Node patches removing the startup taint, by result (removed, conflict, forbidden, error)";
    stale_records_removed: Counter,
        "Pod records removed because the API server no longer had their pod for the grace period";
    cni_evictions: Counter,
        "Older pod records a CNI ADD evicted because they held the new pod's IP";
    accept_errors: Family<AcceptErrorLabel, Counter>,
        "Failed accepts, by listener and kind (each but connection backs off 10 ms doubling to 1 s)";
    connections: Family<SocketLabel, Gauge>,
        "Connections open on each listener";
    connections_refused: Family<SocketLabel, Counter>,
        "Connections closed at once because their listener was at its connection cap";
    connections_rate_limited: Family<SocketLabel, Counter>,
        "Connections closed at once because their peer process opened connections faster than its rate";
    xds_subscription_refusals: Family<LimitLabel, Counter>,
        "ADS streams ended with RESOURCE_EXHAUSTED over a subscription limit, by type and limit (names, name_length)";
    identity_svid_updates: Family<SvidSourceLabel, Counter>,
        "New SVIDs received, by source (agent: the Workload API; pod: the SPIFFE broker)";
    identity_subscriptions: Gauge,
        "Open SVID streams at the SPIFFE broker, one per local pod";
    identity_workload_api_connected: Gauge,
        "1 while the Workload API stream of the agent's own SVID is open";
    pods_without_svid: Gauge,
        "Local pods without an SVID (in strict mTLS mode they have no inbound listener)";
    pod_svid_missing_oldest_seconds: Gauge,
        "How long the local pod waiting longest for its SVID has waited (0: none waits)";
    pods_identity_deferred: Gauge,
        "Local pods whose SVID waits until the API server lists them on this node";
    pods_identity_refused: Gauge,
        "Local pods refused an SVID: the API server lists them with another name or other IPs than their ADD";
    pod_identity_refusals: Counter,
        "Times a local pod was refused an SVID by the API server cross-check";
    svids_expiring: Gauge,
        "SVIDs held past 80 % of their lifetime with no renewal (the agent's and the pods')";
    quic_twins: Gauge,
        "Local pods with a QUIC twin in the snapshot (filter chains of the node's QUIC listener)";
    quic_twins_refused: Gauge,
        "Local pods that would have a QUIC twin but are past --quic-twin-max";
    pod_certificate_gate: Family<ResultLabel, Counter>,
        "Outcomes of the lenient client-certificate gate (result: passed, timed_out)";
    pod_certificate_gate_seconds: Gauge<f64, std::sync::atomic::AtomicU64>,
        "How long the last client-certificate gate waited for the stored pods' SVIDs";
    quic_pairs_advertised: Gauge,
        "QUIC pairs the owner advertises (in quic-pairs.json and its last SetQuicPairs set)";
    quic_pair_sets: Family<ResultLabel, Counter>,
        "SetQuicPairs calls the owner made, by result (changed, unchanged, failed)";
}

fn phase_histogram() -> Histogram {
    // 10 µs to ~10 s: the takeover steps are microseconds, the lock wait can be minutes.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1e-5, 4.0, 11,
    ))
}

/// 1 ms to 10 s in 1-2.5-5 steps: an ADD is a record's fsync and the proxy's ACK (a few
/// ms), at most its 2 s ACK wait, and one stuck behind a slow disk shows past that.
const CNI_BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

fn cni_histogram() -> Histogram {
    Histogram::new(CNI_BUCKETS)
}

/// 100 µs to 10 s: a proxy on the node ACKs a small update within a millisecond, a
/// large one (thousands of clusters) within seconds.
fn push_ack_histogram() -> Histogram {
    Histogram::new([0.0001, 0.00025, 0.0005].into_iter().chain(CNI_BUCKETS))
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut m = Self::declared();
        m.build_info
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").into(),
                revision: REVISION.into(),
            })
            .set(1);
        // Both files' series from the start, so that the first error is an increase.
        for file in ["registry", "capture"] {
            let _ = m
                .registry_reload_errors
                .get_or_create(&FileLabel { file: file.into() });
        }
        m.process.register_collector(Box::new(ProcessCollector {
            proc_self: PathBuf::from("/proc/self"),
            proc_stat: PathBuf::from("/proc/stat"),
        }));
        Arc::new(m)
    }

    /// Counts a rejected or unreadable load of a watched file (`registry`, `capture`).
    pub fn reload_error(&self, file: &str) {
        self.registry_reload_errors
            .get_or_create(&FileLabel {
                file: file.to_string(),
            })
            .inc();
    }

    /// Rejected or unreadable loads of `file` so far.
    pub fn reload_errors(&self, file: &str) -> u64 {
        self.registry_reload_errors
            .get_or_create(&FileLabel {
                file: file.to_string(),
            })
            .get()
    }

    /// How long a CNI call of `op` took the worker; `ok` when it answered without a gRPC
    /// error.
    pub fn observe_cni(&self, op: &str, ok: bool, took: std::time::Duration) {
        let label = CniLabel {
            op: op.to_string(),
            result: if ok { "ok" } else { "error" }.to_string(),
        };
        self.cni_request_duration_seconds
            .get_or_create(&label)
            .observe(took.as_secs_f64());
    }

    /// How long the proxy took to ACK a response of the type `short` names (`CDS`, any case).
    pub fn observe_push_ack(&self, short: &str, took: std::time::Duration) {
        self.xds_push_ack_seconds
            .get_or_create(&XdsTypeLabel {
                r#type: short.to_ascii_lowercase(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn observe_phase(&self, phase: &str, seconds: f64) {
        self.takeover_phase_seconds
            .get_or_create(&PhaseLabel {
                phase: phase.to_string(),
            })
            .observe(seconds);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &self.process);
        let _ = encode_eof(&mut out);
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

/// The process metrics under Prometheus' conventional names (those of its client
/// libraries' process collectors), read at each encoding from `/proc/self` and
/// `/proc/stat`: plain reads, all within the worker's system-call filter. A value that
/// cannot be read is left out of that scrape. The start time is as exact as the kernel's
/// boot time there, which is whole seconds.
#[derive(Debug)]
struct ProcessCollector {
    proc_self: PathBuf,
    proc_stat: PathBuf,
}

/// What [`ProcessCollector`] reads.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    open_fds: Option<u64>,
    max_fds: Option<u64>,
    resident_bytes: Option<u64>,
    cpu_seconds: Option<f64>,
    start_time_seconds: Option<f64>,
}

/// `AT_CLKTCK`, the key of the clock tick rate in the auxiliary vector.
const AT_CLKTCK: u64 = 17;
/// The kernel's `USER_HZ` on every architecture the agent is built for, should the
/// auxiliary vector not say.
const DEFAULT_CLK_TCK: u64 = 100;

impl ProcessStats {
    fn read(proc_self: &Path, proc_stat: &Path) -> Self {
        let text = |name: &str| std::fs::read_to_string(proc_self.join(name)).ok();
        let tck = std::fs::read(proc_self.join("auxv"))
            .ok()
            .and_then(|a| clock_ticks(&a))
            .unwrap_or(DEFAULT_CLK_TCK) as f64;
        let stat = text("stat").and_then(|s| parse_stat(&s));
        let btime = std::fs::read_to_string(proc_stat)
            .ok()
            .and_then(|s| parse_btime(&s));
        Self {
            open_fds: std::fs::read_dir(proc_self.join("fd"))
                .ok()
                .map(|d| d.count() as u64),
            max_fds: text("limits").and_then(|l| parse_max_open_files(&l)),
            resident_bytes: text("status").and_then(|s| parse_vm_rss(&s)),
            cpu_seconds: stat.map(|s| (s.utime + s.stime) as f64 / tck),
            start_time_seconds: stat
                .zip(btime)
                .map(|(s, b)| b as f64 + s.starttime as f64 / tck),
        }
    }
}

/// The fields of `/proc/<pid>/stat` the collector uses, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    /// After boot.
    starttime: u64,
}

/// Fields 14, 15 and 22 of `/proc/<pid>/stat`, counted after the command's closing
/// parenthesis (the command may hold spaces and parentheses itself).
fn parse_stat(text: &str) -> Option<Stat> {
    let (_, rest) = text.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (the state).
    let field = |n: usize| f.get(n - 3)?.parse().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        starttime: field(22)?,
    })
}

/// The boot time in seconds since the epoch, from `/proc/stat`.
fn parse_btime(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The soft limit on open files from `/proc/<pid>/limits`; None when unlimited.
fn parse_max_open_files(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `VmRSS` of `/proc/<pid>/status`, in bytes.
fn parse_vm_rss(text: &str) -> Option<u64> {
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The clock tick rate from the auxiliary vector (native-endian pairs of words).
fn clock_ticks(auxv: &[u8]) -> Option<u64> {
    const W: usize = std::mem::size_of::<u64>();
    auxv.chunks_exact(2 * W).find_map(|pair| {
        let key = u64::from_ne_bytes(pair[..W].try_into().ok()?);
        let value = u64::from_ne_bytes(pair[W..].try_into().ok()?);
        (key == AT_CLKTCK && value > 0).then_some(value)
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        fn gauge<N: EncodeGaugeValue>(
            e: &mut DescriptorEncoder,
            name: &str,
            help: &str,
            v: N,
        ) -> Result<(), std::fmt::Error> {
            let g = ConstGauge::new(v);
            g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
        }
        let s = ProcessStats::read(&self.proc_self, &self.proc_stat);
        if let Some(v) = s.open_fds {
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors",
                v,
            )?;
        }
        if let Some(v) = s.max_fds {
            gauge(
                &mut encoder,
                "process_max_fds",
                "Maximum number of open file descriptors (the soft limit)",
                v,
            )?;
        }
        if let Some(v) = s.resident_bytes {
            gauge(
                &mut encoder,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                v,
            )?;
        }
        if let Some(v) = s.start_time_seconds {
            gauge(
                &mut encoder,
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                v,
            )?;
        }
        if let Some(v) = s.cpu_seconds {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                c.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_proc_files_parse_into_the_process_metrics() {
        let stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 9 0 123400 200000000 3000 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                utime: 250,
                stime: 50,
                starttime: 123400
            })
        );
        assert_eq!(parse_stat("4242 (cut"), None);
        assert_eq!(
            parse_btime("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"),
            Some(1_700_000_000)
        );
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
        assert_eq!(
            parse_max_open_files(
                "Max open files            unlimited            unlimited            files"
            ),
            None
        );
        assert_eq!(
            parse_vm_rss("Name:\tw\nVmRSS:\t   12345 kB\nVmHWM:\t 2 kB\n"),
            Some(12345 * 1024)
        );
        let mut auxv = Vec::new();
        for (k, v) in [(6u64, 4096u64), (AT_CLKTCK, 250), (0, 0)] {
            auxv.extend(k.to_ne_bytes());
            auxv.extend(v.to_ne_bytes());
        }
        assert_eq!(clock_ticks(&auxv), Some(250));
        assert_eq!(clock_ticks(&auxv[..16]), None);
    }

    #[test]
    fn this_process_reads_as_a_live_one() {
        let s = ProcessStats::read(Path::new("/proc/self"), Path::new("/proc/stat"));
        assert!(s.open_fds.is_some_and(|n| n >= 3), "{s:?}");
        assert!(
            s.max_fds.is_none_or(|n| n >= s.open_fds.unwrap_or(0)),
            "{s:?}"
        );
        assert!(s.resident_bytes.is_some_and(|b| b > 1 << 20), "{s:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64();
        // This test process started within the last day, and not in the future.
        assert!(
            s.start_time_seconds
                .is_some_and(|t| t <= now + 1.0 && t > now - 86_400.0),
            "{s:?} now {now}"
        );
        assert!(s.cpu_seconds.is_some_and(|c| c >= 0.0), "{s:?}");
    }

    #[test]
    fn the_exposition_has_the_conventional_names() {
        let m = Metrics::new();
        m.worker_respawns.inc();
        m.reload_error("capture");
        m.observe_cni("add", true, Duration::from_millis(3));
        m.observe_cni("del", false, Duration::from_secs(20));
        m.observe_push_ack("EDS", Duration::from_micros(700));
        let text = m.encode();
        for want in [
            "aether_worker_respawns_total 1\n",
            "aether_registry_reload_errors_total{file=\"capture\"} 1\n",
            "aether_registry_reload_errors_total{file=\"registry\"} 0\n",
            &format!(
                "aether_build_info{{version=\"{}\",revision=\"{REVISION}\"}} 1\n",
                env!("CARGO_PKG_VERSION")
            ),
            "aether_cni_request_duration_seconds_bucket{le=\"0.005\",op=\"add\",result=\"ok\"} 1\n",
            "aether_cni_request_duration_seconds_count{op=\"add\",result=\"ok\"} 1\n",
            "aether_cni_request_duration_seconds_bucket{le=\"10.0\",op=\"del\",result=\"error\"} 0\n",
            "aether_cni_request_duration_seconds_bucket{le=\"+Inf\",op=\"del\",result=\"error\"} 1\n",
            "aether_xds_push_ack_seconds_bucket{le=\"0.001\",type=\"eds\"} 1\n",
            "# TYPE process_cpu_seconds counter\n",
            "# TYPE process_open_fds gauge\n",
            "# TYPE process_resident_memory_bytes gauge\n",
            "# TYPE process_start_time_seconds gauge\n",
            "# TYPE process_max_fds gauge\n",
        ] {
            assert!(text.contains(want), "no {want:?} in\n{text}");
        }
        assert!(text.contains("\nprocess_cpu_seconds_total "), "{text}");
        let fds = text
            .lines()
            .find_map(|l| l.strip_prefix("process_open_fds "))
            .expect("process_open_fds");
        assert!(
            fds.parse::<u64>().is_ok_and(|n| n >= 3),
            "a whole number of descriptors: {fds}"
        );
        assert!(
            text.ends_with("# EOF\n") && text.matches("# EOF").count() == 1,
            "one EOF, at the end:\n{text}"
        );
        assert!(
            !text.contains("aether_process_"),
            "process metrics carry no prefix:\n{text}"
        );
    }

    /// Every metric's name, type and help text, in the exposition's order, as
    /// `metrics_exposition.txt` records them (the `# HELP` and `# TYPE` lines of a fresh
    /// worker's exposition; `AETHER_WRITE_FIXTURE=1` writes the file anew).
    #[test]
    fn every_metric_keeps_its_name_type_and_help_text() {
        let text = Metrics::new().encode();
        let got: String = text
            .lines()
            .filter(|l| l.starts_with("# HELP ") || l.starts_with("# TYPE "))
            .map(|l| format!("{l}\n"))
            .collect();
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/metrics_exposition.txt");
        if std::env::var_os("AETHER_WRITE_FIXTURE").is_some() {
            std::fs::write(&path, &got).unwrap();
        }
        let want = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            got, want,
            "the exposition's names, types or help texts changed"
        );
        assert!(want.lines().count() > 40, "{want}");
    }

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
