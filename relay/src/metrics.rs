//! The relay's counters, in Prometheus' text format on `--metrics-addr`.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::session::Counts;

#[derive(Default)]
pub struct Metrics {
    pub envoy_streams: AtomicU64,
    /// Envoy streams opened, incremental and state of the world.
    pub delta_streams: AtomicU64,
    pub sotw_streams: AtomicU64,
    pub upstream_connected: AtomicU64,
    pub upstream_streams: AtomicU64,
    pub upstream_failures: AtomicU64,
    pub switches: AtomicU64,
    /// Switches made while the old agent stream still carried (the overlap), and next
    /// streams dropped because the old one carried after their re-statement.
    pub overlap_switches: AtomicU64,
    pub overlap_restarts: AtomicU64,
    pub grace_ends: AtomicU64,
    /// Microseconds without an agent stream, summed over every switch.
    pub without_upstream_us: AtomicU64,
    pub last_gap_us: AtomicU64,
    /// When the last agent stream ended, in microseconds since the Unix epoch.
    pub last_end_unix_us: AtomicU64,
    pub resumes: AtomicU64,
    pub digest_resumes: AtomicU64,
    pub digest_types: AtomicU64,
    pub bucket_types: AtomicU64,
    pub version_types: AtomicU64,
    pub names_types: AtomicU64,
    pub absorbed: AtomicU64,
    pub self_acked: AtomicU64,
    pub nacks: AtomicU64,
}

impl Metrics {
    pub fn note_gap(&self, gap: Duration) {
        let us = gap.as_micros() as u64;
        self.without_upstream_us.fetch_add(us, Relaxed);
        self.last_gap_us.store(us, Relaxed);
    }

    /// An agent stream ended now.
    pub fn note_end(&self) {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        self.last_end_unix_us
            .store(since_epoch.as_micros() as u64, Relaxed);
    }

    /// Adds what a session's counts gained since `before`, and moves `before` up.
    pub fn record(&self, now: &Counts, before: &mut Counts) {
        self.resumes
            .fetch_add(now.resumes - before.resumes, Relaxed);
        self.digest_resumes
            .fetch_add(now.digest_resumes - before.digest_resumes, Relaxed);
        self.digest_types
            .fetch_add(now.digest_types - before.digest_types, Relaxed);
        self.bucket_types
            .fetch_add(now.bucket_types - before.bucket_types, Relaxed);
        self.version_types
            .fetch_add(now.version_types - before.version_types, Relaxed);
        self.names_types
            .fetch_add(now.names_types - before.names_types, Relaxed);
        self.absorbed
            .fetch_add(now.absorbed - before.absorbed, Relaxed);
        self.self_acked
            .fetch_add(now.self_acked - before.self_acked, Relaxed);
        self.nacks.fetch_add(now.nacks - before.nacks, Relaxed);
        *before = *now;
    }

    pub fn render(&self) -> String {
        let g = |a: &AtomicU64| a.load(Relaxed);
        let rows: [(&str, &str, &str, String); 15] = [
            (
                "aether_relay_envoy_streams",
                "gauge",
                "Envoy ADS streams open on the relay's socket.",
                g(&self.envoy_streams).to_string(),
            ),
            (
                "aether_relay_upstream_connected",
                "gauge",
                "1 while the relay has an open ADS stream to the agent.",
                g(&self.upstream_connected).to_string(),
            ),
            (
                "aether_relay_upstream_streams_total",
                "counter",
                "ADS streams to the agent that the relay served Envoy from (a next stream dropped in an overlap is not counted).",
                g(&self.upstream_streams).to_string(),
            ),
            (
                "aether_relay_upstream_failures_total",
                "counter",
                "Agent ADS streams that failed to open.",
                g(&self.upstream_failures).to_string(),
            ),
            (
                "aether_relay_switches_total",
                "counter",
                "Agent streams that ended under an open Envoy stream (a roll, a worker crash).",
                g(&self.switches).to_string(),
            ),
            (
                "aether_relay_overlap_switches_total",
                "counter",
                "Switches made while the old agent stream still carried changes (the overlapping handover): no time without an agent stream.",
                g(&self.overlap_switches).to_string(),
            ),
            (
                "aether_relay_overlap_restarts_total",
                "counter",
                "Next agent streams dropped in an overlap because the old stream carried a change after their re-statement; each is re-stated afresh.",
                g(&self.overlap_restarts).to_string(),
            ),
            (
                "aether_relay_grace_ends_total",
                "counter",
                "Envoy streams ended after --upstream-grace without an agent.",
                g(&self.grace_ends).to_string(),
            ),
            (
                "aether_relay_without_upstream_seconds_total",
                "counter",
                "Time Envoy's streams spent without an agent stream.",
                format!("{:.6}", g(&self.without_upstream_us) as f64 / 1e6),
            ),
            (
                "aether_relay_last_upstream_gap_seconds",
                "gauge",
                "The last time from an agent stream's end (or the session's start) to the next one open.",
                format!("{:.6}", g(&self.last_gap_us) as f64 / 1e6),
            ),
            (
                "aether_relay_last_upstream_end_timestamp_seconds",
                "gauge",
                "When the last agent stream ended (Unix time; 0 before the first end): where a roll began, as the relay saw it.",
                format!("{:.6}", g(&self.last_end_unix_us) as f64 / 1e6),
            ),
            (
                "aether_relay_names_resumed_types_total",
                "counter",
                "Types whose subscription was re-stated on a new agent stream by the digest of its names instead of every name (EDS at mesh scale).",
                g(&self.names_types).to_string(),
            ),
            (
                "aether_relay_absorbed_total",
                "counter",
                "Envoy ACKs and NACKs of an earlier agent stream's answers, absorbed.",
                g(&self.absorbed).to_string(),
            ),
            (
                "aether_relay_self_acked_total",
                "counter",
                "Empty agent answers the relay ACKed without forwarding.",
                g(&self.self_acked).to_string(),
            ),
            (
                "aether_relay_nacks_total",
                "counter",
                "NACKs Envoy sent.",
                g(&self.nacks).to_string(),
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, value) in rows {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
            ));
        }
        let labelled = |out: &mut String, name: &str, help: &str, rows: &[(&str, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} counter\n"));
            for (label, v) in rows {
                out.push_str(&format!("{name}{{{label}}} {v}\n"));
            }
        };
        let (resumes, digest) = (g(&self.resumes), g(&self.digest_resumes));
        labelled(
            &mut out,
            "aether_relay_resumes_total",
            "Sessions re-stated on a new agent stream, by kind: digest (the agent answered the digest offer) or plain (it did not: an owner without it, or state of the world).",
            &[
                ("kind=\"digest\"", digest),
                ("kind=\"plain\"", resumes - digest),
            ],
        );
        labelled(
            &mut out,
            "aether_relay_resumed_types_total",
            "Types re-stated on a new agent stream, by kind: digest (by their digest alone), buckets (by the digests of the buckets matched, the others' versions listed) or versions (every version listed).",
            &[
                ("kind=\"digest\"", g(&self.digest_types)),
                ("kind=\"buckets\"", g(&self.bucket_types)),
                ("kind=\"versions\"", g(&self.version_types)),
            ],
        );
        let name = "aether_relay_envoy_streams_total";
        out.push_str(&format!(
            "# HELP {name} Envoy ADS streams opened, by variant: delta (incremental) or sotw (state of the world).\n# TYPE {name} counter\n{name}{{api=\"delta\"}} {}\n{name}{{api=\"sotw\"}} {}\n",
            g(&self.delta_streams),
            g(&self.sotw_streams)
        ));
        out
    }
}
