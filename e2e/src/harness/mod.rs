//! The agent-restart-gap harness: a local node (shared run and state dirs, a health dir
//! per generation), a registry of loopback HTTP services, a real Envoy from the project's
//! bootstrap template, steady load through it, pod churn through the real `aether-cni`
//! during every roll's overlap, and Envoy's admin stats polled every few milliseconds.
//!
//! With `ARG_NODES=2` ([`two_node`]) the registry lives in a registrar on etcd instead
//! of a file, the services' endpoints are on a second node with its own agent and Envoy,
//! and that node's pods drain while the first node rolls.
//!
//! With `ARG_IDENTITY` ([`identity`]) the rolled node runs with workload identity from a
//! test identity provider, and each roll also checks that every pod's SVID is served.
//!
//! With `ARG_MTLS` ([`mtls`]) both nodes run with identity, both Envoys in network
//! namespaces, and the load is node A's pods calling node B's over mTLS, each request's
//! identity checked at node B's Envoy; both nodes roll, in turn.
//!
//! See `e2e/agent-restart-gap.sh` for the environment it reads.

pub mod args;
pub mod changes;
pub mod churn;
pub mod identity;
pub mod load;
pub mod mtls;
pub mod report;
pub mod two_node;
pub mod upstream;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::envoy::{self, Envoy, Poller, Relay, RollTimes};
use crate::testing::{Agent, Keeper, LocalNode, bin, percentile, try_wait_for, workspace_root};
use churn::{Churn, Cni, Pods};
use two_node::{CrossDrain, PeerNode, SharedRegistry};

/// The seed's cluster figures for delete-then-create (Proposal 041).
pub const SEED_RECREATE: &str = "seed, delete-then-create on kind: median 6.30 s, p99 10.22 s";
pub const SEED_SURGE: &str = "seed, surge on kind: median 0.080 s, p99 0.242 s";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Surge,
    Recreate,
    WorkerCrash,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Surge => "surge",
            Mode::Recreate => "recreate",
            Mode::WorkerCrash => "worker-crash",
        }
    }

    /// The p99 gap bound when `ARG_BOUND` is unset: the issue's expected figures for the
    /// seed's backoff; recreate is the baseline and only guarded against hangs.
    pub fn default_bound(self) -> f64 {
        match self {
            Mode::Surge => 0.12,
            Mode::WorkerCrash => 0.25,
            Mode::Recreate => 15.0,
        }
    }
}

/// `ARG_RELAY`: whether Envoy talks to the node through the xDS relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RelayRuns {
    /// Envoy on the node's `xds.sock`, as before.
    #[default]
    Off,
    /// Every mode with `aether-xds-relay` between Envoy and the node.
    On,
    /// Each mode twice, side by side: without the relay, then with it.
    Both,
}

impl RelayRuns {
    /// The runs of each mode: false without the relay, true with it.
    pub fn runs(self) -> &'static [bool] {
        match self {
            RelayRuns::Off => &[false],
            RelayRuns::On => &[true],
            RelayRuns::Both => &[false, true],
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RelayRuns::Off => "off",
            RelayRuns::On => "1",
            RelayRuns::Both => "both",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub rolls: u32,
    pub modes: Vec<Mode>,
    pub all: bool,
    pub bound: Option<f64>,
    pub rps: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// ARG_XDS_API: the ADS variant Envoy speaks, delta (the default) or sotw.
    pub xds_api: envoy::AdsApi,
    pub results_dir: PathBuf,
    pub envoy: PathBuf,
    /// ARG_MESH_SERVICES: that many more services (10 endpoints each, never dialled) in
    /// the registry, to roll at mesh scale.
    pub mesh_services: usize,
    /// ARG_NODES: 1, or 2 (two nodes sharing one registrar; see [`two_node`]).
    pub nodes: u8,
    /// ARG_ETCD_DIR: where etcd keeps its data with two nodes; None: the temp dir.
    pub etcd_dir: Option<PathBuf>,
    /// ARG_IDENTITY: workload identity on the rolled node, in this mTLS mode (see
    /// [`identity`]); None: off.
    pub identity: Option<identity::Mtls>,
    /// ARG_MTLS: pod-to-pod mTLS load across the two nodes, both rolled (see [`mtls`]).
    pub mtls: Option<mtls::Settings>,
    /// ARG_POLL_PERIOD: how often the admin stats are polled (2 ms). Each poll costs
    /// Envoy's main thread a walk of its stats; a longer period loads it less, and
    /// Envoy's own log times the reconnects without polling ([`envoy::log_times`]).
    pub poll_period: Duration,
    /// ARG_NO_CHURN: no pod ADD/DEL during the rolls.
    pub no_churn: bool,
    /// ARG_KEEP_NODE: keep the node folders when the run passes.
    pub keep_node: bool,
    /// ARG_DEBUG_STATS: the xDS-related stats each roll moved, on stderr.
    pub debug_stats: bool,
    /// ARG_RELAY: Envoy through `aether-xds-relay`, on every run or side by side. Set at
    /// all, every run also times a registry change to Envoy's ACK ([`changes`]).
    pub relay: RelayRuns,
}

fn mode_name(modes: &[Mode], all: bool) -> &'static str {
    if all {
        "all"
    } else {
        modes.first().map_or("?", |m| m.name())
    }
}

/// "0.1s", "100ms", "1" (seconds): shared-proto's durations with bare seconds, positive.
pub fn parse_duration(s: &str) -> Result<Duration> {
    let d = shared_proto::duration::parse_duration_or_seconds(s).map_err(|e| anyhow!(e))?;
    if d.is_zero() {
        bail!("{s:?} must be a positive duration");
    }
    Ok(d)
}

impl Config {
    /// The gate's settings from its `ARG_*` variables ([`args`]), checked together.
    pub fn from_env() -> Result<Config> {
        Self::from_args(args::Args::from_env()?)
    }

    pub fn from_args(a: args::Args) -> Result<Config> {
        let args::Modes { modes, all } = a.mode;
        let (backoff_base, backoff_max) = (a.backoff_base, a.backoff_max);
        if backoff_max < backoff_base {
            bail!("ARG_BACKOFF_MAX ({backoff_max:?}) is below ARG_BACKOFF_BASE ({backoff_base:?})");
        }
        let (nodes, mesh_services) = (a.nodes, a.mesh_services);
        if let Some(dir) = &a.etcd_dir {
            if nodes != 2 {
                bail!(
                    "ARG_ETCD_DIR={} needs ARG_NODES=2: one node has no etcd (ARG_NODES is {nodes})",
                    dir.display()
                );
            }
            if !dir.is_dir() {
                bail!("ARG_ETCD_DIR={}: not a folder", dir.display());
            }
        }
        let results_dir = a
            .results_dir
            .unwrap_or_else(|| workspace_root().join("e2e/results"));
        let envoy = envoy::envoy_bin()
            .ok_or_else(|| anyhow!("no Envoy: run scripts/install-envoy.sh (e2e/agent-restart-gap.sh does) or set ENVOY_BIN"))?;
        let mut identity = a.identity;
        let mtls = match a.mtls {
            None => None,
            Some(mode) => {
                if nodes != 2 {
                    bail!(
                        "ARG_MTLS={} needs ARG_NODES=2: node A's pods call node B's (ARG_NODES is {nodes})",
                        mode.name()
                    );
                }
                if modes != [Mode::Surge] {
                    bail!(
                        "ARG_MTLS runs surge rolls of each node and one worker crash on each; ARG_MODE={} is not supported with it",
                        mode_name(&modes, all)
                    );
                }
                if identity.is_some_and(|i| i != mode) {
                    bail!(
                        "ARG_MTLS={} and ARG_IDENTITY={} disagree: ARG_MTLS sets identity on both nodes",
                        mode.name(),
                        identity.map_or("", |i| i.name())
                    );
                }
                if mesh_services > 0 {
                    bail!("ARG_MTLS does not combine with ARG_MESH_SERVICES");
                }
                identity = Some(mode);
                Some(mtls::Settings {
                    mode,
                    rotations: a.mtls_rotations,
                    ip_reuses: a.mtls_ip_reuses,
                })
            }
        };
        let relay = a.relay.unwrap_or_default();
        if relay != RelayRuns::Off {
            if mtls.is_some() {
                bail!(
                    "ARG_RELAY={} does not combine with ARG_MTLS: the relay stands before node A's Envoy, whose rolls ARG_MTLS plans apart",
                    relay.name()
                );
            }
            if a.xds_api != envoy::AdsApi::Delta {
                bail!(
                    "ARG_RELAY={} needs ARG_XDS_API=delta: the relay serves incremental ADS only",
                    relay.name()
                );
            }
        }
        Ok(Config {
            rolls: a.rolls,
            modes,
            all,
            bound: a.bound.map(|b| b.as_secs_f64()),
            rps: a.load_rps,
            backoff_base,
            backoff_max,
            xds_api: a.xds_api,
            results_dir,
            envoy,
            mesh_services,
            nodes,
            etcd_dir: a.etcd_dir,
            identity,
            mtls,
            poll_period: a.poll_period,
            no_churn: a.no_churn.is_some(),
            keep_node: a.keep_node.is_some(),
            debug_stats: a.debug_stats.is_some(),
            relay,
        })
    }

    pub fn bound(&self, mode: Mode) -> f64 {
        self.bound.unwrap_or(mode.default_bound())
    }
}

/// One roll's measurements.
#[derive(Debug, Clone, Default)]
pub struct Roll {
    pub gap: Option<f64>,
    pub served_gap: Option<f64>,
    /// Whether Envoy's connected_state was seen at 0 (else the gap fell between two polls
    /// and is recorded as that poll interval).
    pub observed: bool,
    pub stream_failures: u64,
    pub refused: u64,
    pub failed_requests: u64,
    pub adds: u64,
    pub dels: u64,
    pub lost: u64,
    /// From the roll's action (SIGTERM or SIGKILL) until the new owner's /ready says so.
    pub takeover: f64,
    /// From the action until Envoy's old stream ended (negative: before the action).
    pub stream_end_after_action: f64,
    /// From the action until the old generation's supervisor had exited (surge, recreate).
    pub old_exit_after_action: Option<f64>,
    /// Surge: from the standby's start until `agent-ready` passed for it.
    pub warmup: Option<f64>,
    /// Resources in the new owner's first answers on Envoy's reconnect (its log).
    pub reconnect_resources: Option<u64>,
    /// From Envoy's old stream's end to its first config update on the new one.
    pub unserved: Option<(Instant, Instant)>,
    /// The gap and the served gap minus the gap as Envoy's own log times them
    /// ([`envoy::log_times`]), when its config log is at debug.
    pub envoy_gap: Option<f64>,
    pub envoy_served_after_up: Option<f64>,
    /// ARG_IDENTITY: the new owner's takeover SVID wait (`/ready` `takeover.svid_wait_us`,
    /// in seconds) and how many pods its reconcile added were still without an SVID when
    /// that wait ended (`svid_wait_missed`).
    pub svid_wait: Option<f64>,
    pub svid_wait_missed: Option<u64>,
    /// ARG_IDENTITY, surge: the pod ADDed between the standby's Ready and the SIGTERM, and
    /// from the new owner serving until a `/certs` read (after Envoy's first update from
    /// the new owner) showed its SVID; None when none did within the takeover's 1 s wait.
    pub overlap_pod: Option<String>,
    pub overlap_svid: Option<f64>,
    /// ARG_IDENTITY: the pods whose SVID was looked for in `/certs` after the roll, and the
    /// misses, each naming the pod (the overlap pod's included).
    pub svid_checked: u64,
    pub svid_misses: Vec<String>,
    /// ARG_RELAY, behind the relay: from the agent stream's end to the next one open
    /// (`aether_relay_last_upstream_gap_seconds`).
    pub relay_gap: Option<f64>,
    /// ARG_RELAY, behind the relay: from the roll's action to the relay's sight of the
    /// agent stream's end (`aether_relay_last_upstream_end_timestamp_seconds`): a killed
    /// worker's memory torn down by the kernel, or the old owner's drain (its in-flight CNI
    /// calls, which wait for Envoy's ACK, and its final writes).
    pub relay_end_after_action: Option<f64>,
    /// ARG_RELAY: the registry change made at the roll's action, to Envoy's ACK of it; and
    /// one made after the roll, with none under way (the baseline).
    /// Each with its write's share ([`changes::Timed`]).
    pub change_during_roll: Option<changes::Timed>,
    pub change_no_roll: Option<changes::Timed>,
}

impl Roll {
    /// Behind the relay: the change at the roll's action, from the relay's next agent
    /// stream to Envoy's ACK (the change's time less the roll's action to the relay's
    /// sight of the old stream's end, and the relay's gap): the re-statement, the new
    /// owner's answers and Envoy's apply. Negative when the old owner sent the change
    /// before its stream ended.
    pub fn change_after_relay_serves(&self) -> Option<f64> {
        Some(self.change_during_roll?.total - self.relay_end_after_action? - self.relay_gap?)
    }
}

#[derive(Debug, Default)]
pub struct ModeResult {
    pub mode: Option<Mode>,
    pub rolls: Vec<Roll>,
    pub requests: u64,
    pub failed_requests: u64,
    pub late_requests: u64,
    pub failure_samples: Vec<String>,
    pub lost_pods: Vec<String>,
    pub stuck_dels: usize,
    pub cni_errors: Vec<String>,
    pub poll_max_interval: Duration,
    /// Median and worst time one admin poll took.
    pub poll_cost: (Duration, Duration),
    pub polls: u64,
    pub errors: Vec<String>,
    pub node_dir: Option<PathBuf>,
    pub bound: f64,
    /// From the first agent's start until it served as owner.
    pub cold_start: Option<f64>,
    /// The last owner's worker and Envoy, at the end (MiB): the worker's VmHWM, Envoy's VmRSS.
    pub worker_vmhwm_mib: Option<f64>,
    pub envoy_rss_mib: Option<f64>,
    /// No pod churn and delta ADS: a new owner's answers to Envoy's reconnect must be
    /// empty (it holds the same snapshot as the owner Envoy left).
    pub expect_empty_reconnects: bool,
    /// 1, or 2 with the figures below.
    pub nodes: u8,
    /// Two nodes: node B's drains as node A's Envoy saw them.
    pub cross_drain: Option<two_node::DrainReport>,
    /// Two nodes: whether both Envoys' EDS equalled the registrar's view at the end (and
    /// the difference when not).
    pub eds_equal_registrar: Option<Result<(), String>>,
    /// Two nodes: node B's folder, kept when anything failed.
    pub peer_dir: Option<PathBuf>,
    /// ARG_IDENTITY: the mTLS mode the rolled node ran with.
    pub identity: Option<identity::Mtls>,
    /// ARG_MTLS: what the pod-to-pod mTLS load showed.
    pub mtls: Option<mtls::Report>,
    /// ARG_RELAY set: the changes are timed, and this run is behind the relay or not.
    pub changes_on: bool,
    pub relay: bool,
    /// ARG_RELAY: Envoy's ADS streams that ended during the rolls (its xDS cluster's
    /// `upstream_rq_total`, each stream one request, read before and after: every stream
    /// after the first follows one that ended).
    pub envoy_stream_ends: Option<u64>,
    /// Behind the relay: the streams it opened to the agent, the first included.
    pub relay_upstream_streams: Option<u64>,
    /// Behind the relay: its switches made in overlap (the old owner still carrying), and
    /// the next streams it dropped and re-stated afresh because the old one carried a
    /// change after their re-statement.
    pub relay_overlap_switches: Option<u64>,
    pub relay_overlap_restarts: Option<u64>,
    /// A roll failed and ended the run: it is not in `rolls`, but it may have got as
    /// far as the relay's switch to its new owner.
    pub roll_failed: bool,
    /// ARG_RELAY: the NACKs Envoy sent (the agents' logs; behind the relay, its count, which
    /// includes those it absorbed, if higher).
    pub nacks: Option<u64>,
}

impl ModeResult {
    /// The mode's name, with ", relay" behind the relay.
    pub fn label(&self) -> String {
        let m = self.mode.map_or("?", Mode::name);
        if self.relay {
            format!("{m}, relay")
        } else {
            m.to_string()
        }
    }
    fn changes(&self, f: impl Fn(&Roll) -> Option<f64>) -> Vec<f64> {
        self.rolls.iter().filter_map(f).collect()
    }
    /// What the plot draws per roll: the gap; behind the relay, where Envoy's gap is 0,
    /// the relay's own time without an agent stream.
    pub fn plotted(&self) -> Vec<f64> {
        if self.relay {
            self.changes(|r| r.relay_gap)
        } else {
            self.gaps()
        }
    }
    pub fn gaps(&self) -> Vec<f64> {
        self.rolls.iter().filter_map(|r| r.gap).collect()
    }
    pub fn served_gaps(&self) -> Vec<f64> {
        self.rolls.iter().filter_map(|r| r.served_gap).collect()
    }
    fn sum(&self, f: impl Fn(&Roll) -> u64) -> u64 {
        self.rolls.iter().map(f).sum()
    }
    pub fn refused(&self) -> u64 {
        self.sum(|r| r.refused)
    }
    pub fn lost(&self) -> u64 {
        self.sum(|r| r.lost)
    }
    /// ARG_IDENTITY: the takeovers' SVID waits (s).
    pub fn svid_waits(&self) -> Vec<f64> {
        self.rolls.iter().filter_map(|r| r.svid_wait).collect()
    }
    /// ARG_IDENTITY, surge: the overlap pods' SVIDs in Envoy after the takeover (s).
    pub fn overlap_svids(&self) -> Vec<f64> {
        self.rolls.iter().filter_map(|r| r.overlap_svid).collect()
    }
    pub fn svid_misses(&self) -> usize {
        self.rolls.iter().map(|r| r.svid_misses.len()).sum()
    }

    /// Why this mode fails, one reason each; empty when it passes.
    pub fn failures(&self, want_rolls: u32) -> Vec<String> {
        let mut f: Vec<String> = self.errors.clone();
        let gaps = self.gaps();
        if (gaps.len() as u32) < want_rolls {
            f.push(format!(
                "{} of {want_rolls} rolls measured a gap",
                gaps.len()
            ));
        }
        if let Some(p99) = percentile(&gaps, 99.0)
            && p99 > self.bound
        {
            f.push(format!(
                "p99 gap {p99:.3} s exceeds ARG_BOUND {:.3} s",
                self.bound
            ));
        }
        if self.failed_requests > 0 {
            f.push(format!(
                "{} of {} requests failed",
                self.failed_requests, self.requests
            ));
        }
        if self.lost() > 0 {
            f.push(format!("{} acknowledged pod ADDs were lost", self.lost()));
        }
        // In every mode: in recreate the node's socket keeper holds the listener between
        // the generations.
        if self.refused() > 0 {
            f.push(format!(
                "Envoy had {} refused connects to xds.sock",
                self.refused()
            ));
        }
        let reconnect: u64 = self
            .rolls
            .iter()
            .filter_map(|r| r.reconnect_resources)
            .sum();
        if self.expect_empty_reconnects && reconnect > 0 {
            f.push(format!("the new owners sent {reconnect} resources on Envoy's reconnects, which held them already"));
        }
        if let Some(d) = &self.cross_drain {
            f.extend(d.failures());
        }
        for (i, r) in self.rolls.iter().enumerate() {
            for m in &r.svid_misses {
                f.push(format!("roll {}: {m}", i + 1));
            }
        }
        if let Some(Err(diff)) = &self.eds_equal_registrar {
            f.push(format!("EDS differs from the registrar's view: {diff}"));
        }
        if let Some(m) = &self.mtls {
            f.extend(m.failures());
        }
        if self.changes_on {
            let during = self
                .changes(|r| r.change_during_roll.map(|c| c.total))
                .len();
            if during < self.rolls.len() {
                f.push(format!(
                    "{during} of {} rolls timed their registry change to Envoy's ACK",
                    self.rolls.len()
                ));
            }
            match self.nacks {
                Some(0) => {}
                Some(n) => f.push(format!("Envoy sent {n} NACKs")),
                None => f.push("the NACKs were not counted".into()),
            }
        }
        if self.relay {
            match self.envoy_stream_ends {
                Some(0) => {}
                Some(n) => f.push(format!(
                    "Envoy's ADS stream ended {n} times behind the relay"
                )),
                None => f.push("Envoy's stream ends were not read".into()),
            }
            let want = self.rolls.len() as u64 + 1;
            // A failed roll (already a failure of its own) may have switched or not.
            let failed_roll = u64::from(self.roll_failed);
            match self.relay_upstream_streams {
                Some(n) if (want..=want + failed_roll).contains(&n) => {}
                n if self.roll_failed => f.push(format!(
                    "the relay opened {n:?} streams to the agent, not {want} or {} (one per completed roll, the first, and perhaps the failed roll's)",
                    want + 1
                )),
                n => f.push(format!(
                    "the relay opened {n:?} streams to the agent, not {want} (one per roll and the first)"
                )),
            }
        }
        f
    }

    /// The cross-node drains split in two: those whose way to node A's Envoy crossed one
    /// of its reconnects (from the old stream's end to the first update on the new one),
    /// and the rest, timed while node A's Envoy was served.
    pub fn drains_across_reconnects(&self) -> (Vec<f64>, Vec<f64>) {
        let Some(d) = &self.cross_drain else {
            return (vec![], vec![]);
        };
        let windows: Vec<(Instant, Instant)> =
            self.rolls.iter().filter_map(|r| r.unserved).collect();
        let (mut across, mut served) = (Vec::new(), Vec::new());
        for (s, (from, to)) in d.samples.iter().zip(&d.spans) {
            let crossed = windows.iter().any(|(down, up)| from < up && to > down);
            if crossed { &mut across } else { &mut served }.push(*s);
        }
        (across, served)
    }

    pub fn json(&self, cfg: &Config, plot: &Path) -> Value {
        let mode = self.mode.expect("mode set");
        let g = report::summarize(&self.gaps());
        let s = report::summarize(&self.served_gaps());
        let excess: Vec<f64> = self
            .rolls
            .iter()
            .filter_map(|r| Some(r.served_gap? - r.gap?))
            .collect();
        let envoy_gap: Vec<f64> = self.rolls.iter().filter_map(|r| r.envoy_gap).collect();
        let envoy_served: Vec<f64> = self
            .rolls
            .iter()
            .filter_map(|r| r.envoy_served_after_up)
            .collect();
        let warmups: Vec<f64> = self.rolls.iter().filter_map(|r| r.warmup).collect();
        let reconnect: Option<u64> = self.rolls.iter().map(|r| r.reconnect_resources).sum();
        let r = |x: f64| (x * 1e6).round() / 1e6;
        let failures = self.failures(cfg.rolls);
        let mut v = json!({
            "mode": mode.name(),
            "rolls": self.rolls.len(),
            "gap_samples": g.n,
            "gap_median_s": r(g.median),
            "gap_p90_s": r(g.p90),
            "gap_p99_s": r(g.p99),
            "gap_max_s": r(g.max),
            "served_gap_median_s": r(s.median),
            "served_gap_p90_s": r(s.p90),
            "served_gap_p99_s": r(s.p99),
            "served_gap_max_s": r(s.max),
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "adds_during_overlap": self.sum(|r| r.adds),
            "dels_during_overlap": self.sum(|r| r.dels),
            "lost_adds": self.lost(),
            "refused_connects": self.refused(),
            "bound_s": self.bound,
            "backoff_base_s": cfg.backoff_base.as_secs_f64(),
            "backoff_max_s": cfg.backoff_max.as_secs_f64(),
            "load_rps": cfg.rps,
            "poll_max_interval_ms": r(self.poll_max_interval.as_secs_f64() * 1000.0),
            "poll_cost_median_ms": r(self.poll_cost.0.as_secs_f64() * 1000.0),
            "pass": failures.is_empty(),
            "failures": failures,
            "plot": plot.display().to_string(),
            "node_dir": self.node_dir.as_ref().map(|p| p.display().to_string()),
            "mesh_services": cfg.mesh_services,
            "cold_start_s": self.cold_start.map(r),
            "standby_warmup_median_s": percentile(&warmups, 50.0).map(r),
            "standby_warmup_p99_s": percentile(&warmups, 99.0).map(r),
            "served_minus_gap_median_s": percentile(&excess, 50.0).map(r),
            "served_minus_gap_p99_s": percentile(&excess, 99.0).map(r),
            "envoy_log_gap_median_s": percentile(&envoy_gap, 50.0).map(r),
            "envoy_log_gap_p99_s": percentile(&envoy_gap, 99.0).map(r),
            "envoy_log_served_minus_gap_median_s": percentile(&envoy_served, 50.0).map(r),
            "envoy_log_served_minus_gap_p99_s": percentile(&envoy_served, 99.0).map(r),
            "reconnect_resources": reconnect,
            "worker_vmhwm_mib": self.worker_vmhwm_mib.map(|m| (m * 10.0).round() / 10.0),
            "envoy_rss_mib": self.envoy_rss_mib.map(|m| (m * 10.0).round() / 10.0),
            "nodes": self.nodes,
        });
        if self.nodes == 2 {
            let drains = self
                .cross_drain
                .as_ref()
                .map(|d| d.samples.as_slice())
                .unwrap_or_default();
            let d = report::summarize(drains);
            let (across, served) = self.drains_across_reconnects();
            let extra = json!({
                "cross_node_drain_samples": d.n,
                "cross_node_drain_median_s": r(d.median),
                "cross_node_drain_p99_s": r(d.p99),
                "cross_node_drain_max_s": r(d.max),
                "cross_node_drain_across_reconnect": across.len(),
                "cross_node_drain_served_p99_s": percentile(&served, 99.0).map(r),
                "cross_node_drain_timeouts": self.cross_drain.as_ref().map_or(0, |d| d.timeouts.len()),
                "cross_node_drain_lost_in_peer_rolls": self.cross_drain.as_ref().map_or(0, |d| d.lost_in_peer_rolls.len()),
                "cross_node_drain_poll_cost_median_ms": self.cross_drain.as_ref().map(|d| r(d.poll_cost.0.as_secs_f64() * 1000.0)),
                "eds_equal_registrar": matches!(self.eds_equal_registrar, Some(Ok(()))),
                "peer_node_dir": self.peer_dir.as_ref().map(|p| p.display().to_string()),
            });
            v.as_object_mut()
                .expect("an object")
                .extend(extra.as_object().expect("an object").clone());
        }
        if let Some(mtls) = self.identity {
            let w = report::summarize(&self.svid_waits());
            let o = report::summarize(&self.overlap_svids());
            let ms = |x: f64| (x * 1e6).round() / 1e3;
            let overlap_rolls = self
                .rolls
                .iter()
                .filter(|r| r.overlap_pod.is_some())
                .count();
            let extra = json!({
                "identity": mtls.name(),
                "trust_domain": identity::TRUST_DOMAIN,
                "svid_pod_checks": self.sum(|r| r.svid_checked),
                "svid_misses": self.svid_misses(),
                "svid_wait_samples": w.n,
                "svid_wait_median_ms": (w.n > 0).then(|| ms(w.median)),
                "svid_wait_p99_ms": (w.n > 0).then(|| ms(w.p99)),
                "svid_wait_max_ms": (w.n > 0).then(|| ms(w.max)),
                "svid_wait_missed_pods": self.sum(|r| r.svid_wait_missed.unwrap_or(0)),
                "overlap_pods": overlap_rolls,
                "overlap_pod_svid_samples": o.n,
                "overlap_pod_svid_median_ms": (o.n > 0).then(|| ms(o.median)),
                "overlap_pod_svid_max_ms": (o.n > 0).then(|| ms(o.max)),
                "load_path": "plaintext to loopback upstreams (not pods)",
            });
            v.as_object_mut()
                .expect("an object")
                .extend(extra.as_object().expect("an object").clone());
        }
        if self.changes_on {
            let during =
                report::summarize(&self.changes(|r| r.change_during_roll.map(|c| c.total)));
            let quiet = report::summarize(&self.changes(|r| r.change_no_roll.map(|c| c.total)));
            let relay_gaps = report::summarize(&self.changes(|r| r.relay_gap));
            let ends = report::summarize(&self.changes(|r| r.relay_end_after_action));
            let after = report::summarize(&self.changes(Roll::change_after_relay_serves));
            let during_w =
                report::summarize(&self.changes(|r| r.change_during_roll.map(|c| c.write)));
            let quiet_w = report::summarize(&self.changes(|r| r.change_no_roll.map(|c| c.write)));
            let during_aw =
                report::summarize(&self.changes(|r| r.change_during_roll.map(|c| c.after_write())));
            let quiet_aw =
                report::summarize(&self.changes(|r| r.change_no_roll.map(|c| c.after_write())));
            let some = |s: &report::Summary, x: f64| (s.n > 0).then(|| r(x));
            let extra = json!({
                "relay": self.relay,
                "envoy_stream_ends": self.envoy_stream_ends,
                "relay_upstream_streams": self.relay_upstream_streams,
                "relay_overlap_switches": self.relay_overlap_switches,
                "relay_overlap_restarts": self.relay_overlap_restarts,
                "relay_upstream_gap_median_s": some(&relay_gaps, relay_gaps.median),
                "relay_upstream_gap_p99_s": some(&relay_gaps, relay_gaps.p99),
                "relay_upstream_gap_max_s": some(&relay_gaps, relay_gaps.max),
                "relay_upstream_end_after_roll_median_s": some(&ends, ends.median),
                "relay_upstream_end_after_roll_p99_s": some(&ends, ends.p99),
                "relay_upstream_end_after_roll_max_s": some(&ends, ends.max),
                "change_after_relay_serves_median_s": some(&after, after.median),
                "change_after_relay_serves_p99_s": some(&after, after.p99),
                "change_after_relay_serves_max_s": some(&after, after.max),
                "change_during_roll_samples": during.n,
                "change_during_roll_median_s": some(&during, during.median),
                "change_during_roll_p99_s": some(&during, during.p99),
                "change_during_roll_max_s": some(&during, during.max),
                "change_no_roll_samples": quiet.n,
                "change_no_roll_median_s": some(&quiet, quiet.median),
                "change_no_roll_p99_s": some(&quiet, quiet.p99),
                "change_during_roll_write_median_s": some(&during_w, during_w.median),
                "change_during_roll_write_p99_s": some(&during_w, during_w.p99),
                "change_no_roll_write_median_s": some(&quiet_w, quiet_w.median),
                "change_no_roll_write_p99_s": some(&quiet_w, quiet_w.p99),
                "change_during_roll_after_write_median_s": some(&during_aw, during_aw.median),
                "change_during_roll_after_write_p99_s": some(&during_aw, during_aw.p99),
                "change_no_roll_after_write_median_s": some(&quiet_aw, quiet_aw.median),
                "change_no_roll_after_write_p99_s": some(&quiet_aw, quiet_aw.p99),
                "nacks": self.nacks,
            });
            v.as_object_mut()
                .expect("an object")
                .extend(extra.as_object().expect("an object").clone());
        }
        if let Some(m) = &self.mtls {
            v.as_object_mut()
                .expect("an object")
                .extend(m.json().as_object().expect("an object").clone());
            v["load_path"] = json!(
                "pod to pod over mTLS: node A's client pods to node B's server pods through both Envoys"
            );
        }
        v
    }
}

const SERVICES: [&str; 3] = ["alpha", "bravo", "charlie"];
const T_START: Duration = Duration::from_secs(30);

/// The real `agent-ready` probe against a generation's own health socket.
fn agent_ready(sock: &Path) -> bool {
    Command::new(bin("agent-ready"))
        .arg("--socket")
        .arg(sock)
        .args(["--timeout-ms", "500"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The local node a mode runs on.
struct Bench {
    node: LocalNode,
    /// The node's socket keeper: across a recreate roll it holds the listeners.
    _keeper: Keeper,
    owner: Agent,
    envoy: Envoy,
    /// ARG_RELAY: the relay between Envoy and the node (ended after Envoy).
    relay: Option<Relay>,
    /// ARG_RELAY: the registry change timed at each roll.
    changes: Option<changes::Changes>,
    /// ARG_RELAY: what is held while a change is timed.
    quiet: Quiet,
    /// Envoy's outbound listener (none with ARG_MTLS: the pods carry the load).
    outbound: Option<SocketAddr>,
    cni: Arc<Cni>,
    pods: Arc<Mutex<Pods>>,
    lost_ever: BTreeSet<String>,
    cold_start: Duration,
    /// Two nodes: node B, then the registrar and etcd (dropped in that order).
    peer: Option<PeerNode>,
    registry: Option<SharedRegistry>,
    /// ARG_IDENTITY: the identity provider beside the node (dropped after the agents).
    identity: Option<identity::NodeIdentity>,
    /// ARG_MTLS: the namespaces (dropped after the Envoys), the client pods, the record.
    gate: Option<mtls::Gate>,
    /// ARG_NO_CHURN and ARG_DEBUG_STATS.
    no_churn: bool,
    debug_stats: bool,
}

impl Bench {
    fn start_agent(&mut self) -> Agent {
        self.node.start_agent()
    }
}

/// How often Envoy's stats are read at most behind the relay at mesh scale (see
/// [`run_mode`]).
const MESH_RELAY_POLL: Duration = Duration::from_secs(1);

fn setup(node: LocalNode, cfg: &Config, relayed: bool) -> Result<Bench> {
    let mut node = node;
    let root = node.root.path().to_path_buf();
    // ARG_MTLS: node A's client pods and node B's server pods in namespaces of their own.
    let net = cfg.mtls.map(|_| mtls::Net::create()).transpose()?;
    // Three services, each backed by two real HTTP servers on loopback (with two nodes,
    // node B's endpoints); with ARG_MTLS node B's server pods instead.
    let mut services = net.as_ref().map(mtls::Net::services).unwrap_or_default();
    for name in SERVICES.iter().filter(|_| net.is_none()) {
        let mut endpoints = Vec::new();
        for i in 0..2 {
            let u = upstream::spawn(format!("{name}-{i}\n")).context("upstream server")?;
            endpoints.push(if cfg.nodes == 2 {
                two_node::endpoint(&u.addr.ip().to_string(), u.addr.port(), &format!("{name}-{i}"))
            } else {
                json!({ "address": u.addr.ip().to_string(), "port": u.addr.port(), "pod": format!("{name}-{i}") })
            });
        }
        services.push(
            json!({ "name": name, "namespace": "default", "ports": [80], "endpoints": endpoints }),
        );
    }
    let registry = root.join("registry.json");
    let render = |services: &[Value]| -> Result<String> {
        Ok(if cfg.mesh_services > 0 {
            let real: Vec<String> = services.iter().map(|s| s.to_string()).collect();
            crate::testing::mesh_registry_json(cfg.mesh_services, 10, None, &real.join(","))
        } else {
            serde_json::to_string_pretty(&json!({ "services": services }))?
        })
    };
    let doc = render(&services)?;
    // ARG_RELAY: the change is the first service without its second endpoint, and back.
    let change_docs = match cfg.relay {
        RelayRuns::Off => None,
        _ => {
            let mut fewer = services.clone();
            let endpoints = |s: &Value| -> Vec<String> {
                let mut v: Vec<String> = s["endpoints"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| {
                        format!(
                            "{}:{} HEALTHY",
                            e["address"].as_str().unwrap_or("?"),
                            e["port"]
                        )
                    })
                    .collect();
                v.sort();
                v
            };
            if let Some(eps) = fewer[0]["endpoints"].as_array_mut() {
                eps.truncate(1);
            }
            let wants = [endpoints(&services[0]), endpoints(&fewer[0])];
            // One node: the whole registry file; two: the one service at the registrar.
            let docs = if cfg.nodes == 2 {
                [&services[0], &fewer[0]].map(|s| json!({ "services": [s] }).to_string())
            } else {
                [doc.clone(), render(&fewer)?]
            };
            Some((docs, wants))
        }
    };
    // Free capture ports, so that runs in parallel do not clash on 15001 (ARG_MTLS: the
    // listeners are in node A's namespace).
    let outbound = match net {
        Some(_) => {
            node.capture_with(&mtls::capture_json())?;
            None
        }
        None => Some(node.capture()?),
    };
    let node_identity = match cfg.identity {
        Some(mtls) => {
            let id = identity::NodeIdentity::start(&root, mtls)?;
            node.args.extend(id.agent_args());
            Some(id)
        }
        None => None,
    };
    let (registry, peer) = if cfg.nodes == 2 {
        // One registrar for both nodes, holding what the file would; node B starts first,
        // as a node already in the mesh.
        let shared = SharedRegistry::start(&root, cfg.etcd_dir.as_deref())?;
        shared
            .apply("registry.json", &doc)
            .context("apply the services at the registrar")?;
        eprintln!(
            "   registrar {} (TLS) on etcd; node A {}",
            shared.addr(),
            root.display()
        );
        // ARG_MTLS: node B's agents with identity too, logging their pods' connections.
        let peer_flags: Vec<String> = node_identity
            .iter()
            .filter(|_| net.is_some())
            .flat_map(|id| id.agent_args())
            .chain(net.iter().map(|_| {
                format!(
                    "--inbound-access-log={}",
                    root.join("node-b-inbound-access.log").display()
                )
            }))
            .collect();
        let netns = net
            .as_ref()
            .map(|n| (n.b.node.name.as_str(), peer_flags.as_slice()));
        let peer = PeerNode::start(cfg, &shared.agent_flags(), SERVICES[0], netns)
            .inspect_err(|_| shared.keep_log(&root))?;
        eprintln!("   node B {}", peer.dir().display());
        node.node_name = two_node::NODE_A.into();
        node.args.extend(shared.agent_flags());
        (Some(shared), Some(peer))
    } else {
        std::fs::write(&registry, doc)?;
        node.registry_file = Some(registry);
        (None, None)
    };

    let cold = Instant::now();
    let first = node
        .start_owner(T_START)
        .context("the first agent to own the node")?;
    let cold_start = cold.elapsed();
    // As the chart runs it, outside the agent's pod; it fetches the owner's sockets.
    let keeper = node.start_keeper();
    try_wait_for(
        "the socket keeper to hold the owner's sockets",
        T_START,
        || {
            keeper
                .log()
                .contains("keeping the owner's node sockets")
                .then_some(())
        },
    )
    .with_context(|| format!("keeper log:\n{}", keeper.log()))?;
    let envoy_bin = match &net {
        Some(n) => mtls::envoy_in(&root, &n.a.node.name, &cfg.envoy)?,
        None => cfg.envoy.clone(),
    };
    // ARG_RELAY: behind the relay, Envoy's ADS cluster points at the relay's socket.
    let relay = relayed.then(|| Relay::start(&root.join("relay"), &node.run_dir));
    let log_args = if change_docs.is_some() {
        changes::envoy_log_args()
    } else {
        Vec::new()
    };
    let log_args: Vec<&std::ffi::OsStr> = log_args.iter().map(std::ffi::OsStr::new).collect();
    let envoy = Envoy::start_with_args(
        &envoy_bin,
        &root,
        relay.as_ref().map_or(&node.run_dir, |r| &r.dir),
        (cfg.backoff_base, cfg.backoff_max),
        cfg.xds_api,
        &log_args,
    )
    .context("start Envoy")?;
    let changes = match change_docs {
        Some((docs, wants)) => {
            let target = match &registry {
                Some(shared) => shared.change_target(docs)?,
                None => changes::Target::file(&root.join("registry.json"), docs),
            };
            Some(changes::Changes::new(
                target,
                wants,
                format!("outbound|80||{}.default", SERVICES[0]),
                &envoy.log,
            ))
        }
        None => None,
    };
    try_wait_for(
        "Envoy to connect and take its first config",
        T_START,
        || {
            let stats = envoy.stats(&[envoy::CONNECTED, envoy::UPDATE_TIMES[1]])?;
            (stats[envoy::CONNECTED] == 1 && stats[envoy::UPDATE_TIMES[1]] > 0).then_some(())
        },
    )
    .with_context(|| format!("Envoy log {}", envoy.log.display()))?;
    for s in SERVICES.iter().filter(|_| outbound.is_some()) {
        let outbound = outbound.expect("the capture listeners");
        try_wait_for(
            &format!("service {s} to answer through Envoy's outbound listener {outbound}"),
            T_START,
            || load::request(outbound, s).ok(),
        )
        .with_context(|| format!("Envoy log {}", envoy.log.display()))?;
    }
    let cni = Arc::new(Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    });
    let pods = Arc::new(Mutex::new(Pods::default()));
    // A few pods that live through every roll.
    for _ in 0..5 {
        if churn::add_one(&cni, &pods).is_none() {
            bail!(
                "ADD before the first roll failed: {:?}",
                pods.lock().unwrap().errors
            );
        }
    }
    let gate = match (net, cfg.mtls, &node_identity, &peer) {
        (Some(net), Some(settings), Some(id), Some(p)) => {
            let gate = mtls::Gate::start(
                settings,
                net,
                root.join("node-b-inbound-access.log"),
                &id.provider,
                (&cni, &pods, &envoy),
                (&p.cni, &p.pods, &p.envoy),
            )
            .with_context(|| {
                format!(
                    "ARG_MTLS setup; node A's Envoy log {}, node B's {}",
                    envoy.log.display(),
                    p.envoy.log.display()
                )
            })?;
            eprintln!(
                "   mTLS ({}): {} client pods on node A calling {} server pods on node B through both Envoys; node B's access log {}",
                settings.mode.name(),
                gate.callers.len(),
                gate.net.servers().len(),
                gate.access_log.display()
            );
            Some(gate)
        }
        _ => None,
    };
    if let Some(id) = &node_identity {
        // Before the first roll, the first owner serves each of them with its SVID.
        let live: Vec<churn::PodId> = pods.lock().unwrap().live.keys().cloned().collect();
        let missing = identity::missing_svids(
            &envoy,
            &id.provider,
            &live,
            Instant::now() + Duration::from_secs(10),
        )?;
        if !missing.is_empty() {
            let certs = identity::envoy_serials(&envoy)
                .map(|s| s.len().to_string())
                .unwrap_or_else(|e| format!("? ({e})"));
            bail!(
                "before the first roll, 10 s after the ADDs: {} (Envoy's /certs lists {certs} certificates); logs: {}, {}",
                missing.join("; "),
                first.log_path.display(),
                envoy.log.display()
            );
        }
        eprintln!(
            "   identity: {} mTLS, trust domain {}, provider sockets in {}; the first {} pods' SVIDs are in Envoy's /certs",
            id.mtls.name(),
            identity::TRUST_DOMAIN,
            root.join("identity").display(),
            live.len()
        );
    }
    Ok(Bench {
        node,
        _keeper: keeper,
        owner: first,
        envoy,
        relay,
        changes,
        quiet: Quiet::default(),
        outbound,
        cni,
        pods,
        lost_ever: BTreeSet::new(),
        cold_start,
        peer,
        registry,
        identity: node_identity,
        gate,
        no_churn: cfg.no_churn,
        debug_stats: cfg.debug_stats,
    })
}

/// Runs one mode on a fresh local node. The node's folder is kept (and named in the
/// result) when anything failed.
pub fn run_mode(cfg: &Config, mode: Mode, relay: bool) -> ModeResult {
    let mut res = ModeResult {
        mode: Some(mode),
        relay,
        changes_on: cfg.relay != RelayRuns::Off,
        bound: cfg.bound(mode),
        // A registry change made at the roll reaches Envoy on the reconnect (its load
        // assignment): only a roll without churn or changes sends nothing.
        expect_empty_reconnects: cfg.no_churn
            && cfg.xds_api == envoy::AdsApi::Delta
            && cfg.relay == RelayRuns::Off,
        nodes: cfg.nodes,
        identity: cfg.identity,
        ..Default::default()
    };
    // Kept unless the mode passes, so that a setup error or a panic leaves the logs.
    let node = LocalNode::builder()
        .keep_folder()
        .build()
        .expect("the node folder");
    let root = node.root.path().to_path_buf();
    eprintln!(
        "== {}{}{}{}: {} rolls, load {} rps, ADS backoff {:?}/{:?}, p99 gap bound {:.3} s, node {}",
        mode.name(),
        if relay {
            ", Envoy behind the xDS relay"
        } else {
            ""
        },
        if cfg.nodes == 2 {
            ", two nodes (node A rolled, node B's pods draining)"
        } else {
            ""
        },
        cfg.identity
            .map(|m| format!(", workload identity ({} mTLS)", m.name()))
            .unwrap_or_default(),
        cfg.rolls,
        cfg.rps,
        cfg.backoff_base,
        cfg.backoff_max,
        res.bound,
        root.display()
    );
    if mode == Mode::Recreate {
        eprintln!(
            "   recreate = the DaemonSet's delete-then-create without the cluster's pod start cost \
             (no image pull, no scheduling, no kubelet sync); for context, {SEED_RECREATE}"
        );
    }
    let mut bench = match setup(node, cfg, relay) {
        Ok(b) => b,
        Err(e) => {
            res.errors.push(format!("setup: {e:#}"));
            eprintln!("!! setup failed: {e:#}\n!! node kept at {}", root.display());
            res.node_dir = Some(root);
            return res;
        }
    };
    res.cold_start = Some(bench.cold_start.as_secs_f64());
    // Behind the relay at mesh scale Envoy's stats are read no more often than
    // MESH_RELAY_POLL: each read walks them on Envoy's main thread, 60 to 75 ms at 10,000
    // services, which read every few ms would hold the thread that takes the xDS answers
    // timed. Envoy's gap is 0 there, and its stream ends are counted from its cumulative
    // stats before and after the rolls; a stream that did end is still seen.
    let poll_period = if relay && cfg.mesh_services > 0 {
        cfg.poll_period.max(MESH_RELAY_POLL)
    } else {
        cfg.poll_period
    };
    let mut poller = Poller::start_every(bench.envoy.admin.clone(), poll_period);
    std::thread::sleep(Duration::from_millis(50));
    poller.reset_interval();
    // Envoy's own timing of the rolls' reconnects starts from here in its log.
    let log_from = std::fs::metadata(&bench.envoy.log)
        .map(|m| m.len())
        .unwrap_or(0);
    let hosts: Vec<String> = SERVICES.iter().map(|s| s.to_string()).collect();
    // ARG_MTLS: the pods' mTLS load instead of the plaintext load to loopback upstreams.
    let load = bench
        .gate
        .is_none()
        .then_some(bench.outbound)
        .flatten()
        .map(|outbound| load::Load::start(outbound, hosts, cfg.rps));
    let mtls_load = bench
        .gate
        .as_ref()
        .map(|g| mtls::Load::start(g.net.a.clone(), &g.callers));
    let failures = || {
        load.as_ref().map_or(0, load::Load::failures)
            + mtls_load.as_ref().map_or(0, mtls::Load::failures)
    };
    let drain = bench
        .registry
        .as_ref()
        .zip(bench.peer.as_ref())
        .map(|(r, p)| {
            let admin = bench.envoy.admin.clone();
            CrossDrain::start(r, p, admin, bench.gate.is_some(), cfg.mesh_services > 0)
        });
    if bench.changes.is_some() {
        bench.quiet = Quiet {
            drains: drain.as_ref().map(CrossDrain::pause),
            polls: bench.relay.is_some().then(|| poller.pause()),
        };
    }
    // ARG_MTLS: node B rolls too, timed on its own Envoy.
    let mut peer_poller = bench
        .gate
        .as_ref()
        .and(bench.peer.as_ref())
        .map(|p| Poller::start_every(p.envoy.admin.clone(), cfg.poll_period));
    std::thread::sleep(Duration::from_millis(300));
    // ARG_RELAY: Envoy's ADS streams so far, read once before the rolls and once after
    // (each read walks Envoy's stats on its main thread).
    let streams_before = res
        .changes_on
        .then(|| bench.envoy.stat(ADS_STREAMS))
        .flatten();

    for step in plan(cfg, mode) {
        match step {
            Step::Roll {
                node_b,
                mode: m,
                i,
                of,
            } => {
                let label = format!(
                    "{}{}",
                    if cfg.mtls.is_some() {
                        if node_b { "node B " } else { "node A " }
                    } else {
                        ""
                    },
                    m.name()
                );
                let failed_before = failures();
                let result = match (&peer_poller, node_b) {
                    (Some(p), true) => peer_roll(&mut bench, p, m),
                    _ => roll(&mut bench, &poller, m),
                };
                match result {
                    Ok(mut r) => {
                        r.failed_requests = failures() - failed_before;
                        log_roll(&label, i, of, m, &r, bench.identity.is_some());
                        if let (Some(g), true) = (bench.gate.as_mut(), node_b) {
                            g.report.peer_windows.extend(r.unserved);
                        }
                        match bench.gate.as_mut() {
                            Some(g) if m == Mode::WorkerCrash => {
                                g.report.crash_gaps.extend(r.gap);
                                g.report
                                    .errors
                                    .extend(r.svid_misses.iter().map(|x| format!("{label}: {x}")));
                                if r.lost > 0 || r.refused > 0 {
                                    g.report.errors.push(format!(
                                        "{label}: {} lost adds, {} refused connects",
                                        r.lost, r.refused
                                    ));
                                }
                            }
                            Some(g) if node_b => {
                                g.report.peer_rolls += 1;
                                res.rolls.push(r);
                            }
                            _ => res.rolls.push(r),
                        }
                    }
                    Err(e) => {
                        eprintln!("[{label} {i}/{of}] FAILED: {e:#}");
                        res.errors.push(format!("{label} roll {i}: {e:#}"));
                        res.roll_failed = true;
                        break;
                    }
                }
                if !bench.envoy.alive() {
                    res.errors.push(format!(
                        "Envoy exited; its log: {}",
                        bench.envoy.log.display()
                    ));
                    break;
                }
                if let Some(p) = bench.peer.as_mut().filter(|_| cfg.mtls.is_some())
                    && !p.envoy.alive()
                {
                    res.errors.push(format!(
                        "node B's Envoy exited; its log: {}",
                        p.envoy.log.display()
                    ));
                    break;
                }
                std::thread::sleep(Duration::from_millis(150));
            }
            Step::Rotate => {
                let (Some(g), Some(id), Some(p)) = (&mut bench.gate, &bench.identity, &bench.peer)
                else {
                    continue;
                };
                let (clients, servers) = g.pods();
                match mtls::rotate(
                    &id.provider,
                    [(&bench.envoy, &clients), (&p.envoy, &servers)],
                ) {
                    Ok(took) => {
                        g.report.rotations += 1;
                        g.report.rotation_s.push(took.as_secs_f64());
                        eprintln!(
                            "   mTLS: rotation {}: every pod's new SVID in its Envoy within {:.0} ms",
                            g.report.rotations,
                            took.as_secs_f64() * 1000.0
                        );
                    }
                    Err(e) => g.report.errors.push(format!("{e:#}")),
                }
            }
            Step::Reuse => {
                let (Some(g), Some(id)) = (&mut bench.gate, &bench.identity) else {
                    continue;
                };
                if let Err(e) = g.reuse(&bench.cni, &bench.pods, &id.provider, &bench.envoy) {
                    eprintln!("   mTLS: IP reuse FAILED: {e:#}");
                    g.report.errors.push(format!("IP reuse: {e:#}"));
                }
            }
        }
    }
    if let Some(p) = &mut peer_poller {
        p.stop();
    }
    // ARG_MTLS: node B's rolls, for the drains lost across them.
    let peer_windows: Vec<(Instant, Instant)> = bench
        .gate
        .as_ref()
        .map(|g| g.report.peer_windows.clone())
        .unwrap_or_default();
    res.cross_drain = drain.map(CrossDrain::stop).map(|mut d| {
        let margin = Duration::from_millis(100);
        let lost: Vec<String> = d
            .timeouts
            .iter()
            .zip(&d.timeout_dels)
            .filter(|(_, at)| {
                peer_windows
                    .iter()
                    .any(|(from, to)| **at + margin >= *from && **at <= *to + margin)
            })
            .map(|(t, _)| t.clone())
            .collect();
        d.lost_in_peer_rolls = lost;
        d
    });
    if res.changes_on {
        let after = bench.envoy.stat(ADS_STREAMS);
        res.envoy_stream_ends = streams_before.zip(after).map(|(b, a)| a.saturating_sub(b));
        let relay_metric = |name: &str| {
            bench
                .relay
                .as_ref()
                .and_then(|r| r.metric(name))
                .map(|v| v as u64)
        };
        res.relay_upstream_streams = relay_metric("aether_relay_upstream_streams_total");
        res.relay_overlap_switches = relay_metric("aether_relay_overlap_switches_total");
        res.relay_overlap_restarts = relay_metric("aether_relay_overlap_restarts_total");
        let logged = agent_nacks(&root);
        res.nacks = Some(logged.max(relay_metric("aether_relay_nacks_total").unwrap_or(0)));
    }
    std::thread::sleep(Duration::from_millis(300));
    envoy_log_times(&bench.envoy.log, log_from, &mut res.rolls);
    res.poll_max_interval = poller.max_interval();
    res.poll_cost = poller.poll_cost();
    res.polls = poller.polls_and_errors().0;
    poller.stop();
    if let Some(counters) = load.map(load::Load::stop) {
        res.requests = counters.requests.load(std::sync::atomic::Ordering::Relaxed);
        res.failed_requests = counters.failures.load(std::sync::atomic::Ordering::Relaxed);
        res.late_requests = counters.late.load(std::sync::atomic::Ordering::Relaxed);
        let t0 = counters.failure_log.lock().unwrap().first().map(|f| f.0);
        res.failure_samples = counters
            .failure_log
            .lock()
            .unwrap()
            .iter()
            .take(10)
            .map(|(t, h, w)| {
                format!(
                    "+{:.3}s {h}: {w}",
                    t0.map(|t0| (*t - t0).as_secs_f64()).unwrap_or(0.0)
                )
            })
            .collect();
    }
    if let (Some(l), Some(g), Some(id)) = (mtls_load, &mut bench.gate, &bench.identity) {
        let l = l.stop();
        res.requests = l.requests;
        res.failed_requests = l.failures;
        res.failure_samples = l.failure_log.iter().take(10).cloned().collect();
        g.report.crash_bound = Mode::WorkerCrash.default_bound();
        mtls::finish(
            &mut g.report,
            l,
            &g.access_log,
            &g.net,
            &id.provider.agent_spiffe_id(),
            &g.arrivals,
            &g.previous,
            &g.released,
        );
        res.mtls = Some(g.report.clone());
    }
    res.stuck_dels = churn::settle(&bench.cni, &bench.pods, Duration::from_secs(5));
    res.cni_errors = bench.pods.lock().unwrap().errors.clone();
    res.lost_pods = bench.lost_ever.iter().cloned().collect();
    if let Some(pid) = bench.owner.ready().and_then(|(_, v)| v["pid"].as_i64()) {
        res.worker_vmhwm_mib = Some(crate::testing::memory_kib(pid as i32).1 as f64 / 1024.0);
    }
    res.envoy_rss_mib = Some(crate::testing::memory_kib(bench.envoy.pid()).0 as f64 / 1024.0);
    if let (Some(registry), Some(peer)) = (&bench.registry, &bench.peer) {
        let envoys = [
            ("node A's Envoy", &bench.envoy),
            ("node B's Envoy", &peer.envoy),
        ];
        res.eds_equal_registrar = Some(two_node::eds_check(
            registry,
            &envoys,
            Duration::from_secs(10),
        ));
    }
    if res.failures(cfg.rolls).is_empty() && !cfg.keep_node {
        bench.node.pass();
        if let Some(peer) = &mut bench.peer {
            peer.node.pass();
        }
    } else {
        if let Some(registry) = &bench.registry {
            registry.keep_log(&root);
        }
        res.peer_dir = bench.peer.as_ref().map(PeerNode::dir);
        res.node_dir = Some(root);
    }
    drop(bench);
    res
}

/// Envoy's ADS streams: each gRPC stream to the xDS cluster is one upstream request.
const ADS_STREAMS: &str = "cluster.xds_cluster.upstream_rq_total";

/// The NACKs the node's agents logged (each generation's log in the node folder).
fn agent_nacks(root: &Path) -> u64 {
    let Ok(dir) = std::fs::read_dir(root) else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("gen") && n.ends_with(".log")
        })
        .map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap_or_default()
                .matches("NACK: the proxy rejected")
                .count() as u64
        })
        .sum()
}

/// What a mode's run does, in order.
enum Step {
    Roll {
        /// ARG_MTLS: node B's agent rather than node A's.
        node_b: bool,
        mode: Mode,
        i: u32,
        of: u32,
    },
    /// ARG_MTLS: every pod's SVID rotated.
    Rotate,
    /// ARG_MTLS: a client pod's address taken by a new pod.
    Reuse,
}

/// ARG_ROLLS rolls in `mode`; with ARG_MTLS, ARG_ROLLS surge rolls of node A, then as
/// many of node B, then a worker crash on each, the rotations and IP reuses spread
/// evenly between the rolls.
fn plan(cfg: &Config, mode: Mode) -> Vec<Step> {
    let n = cfg.rolls;
    let Some(m) = cfg.mtls else {
        return (1..=n)
            .map(|i| Step::Roll {
                node_b: false,
                mode,
                i,
                of: n,
            })
            .collect();
    };
    let total = 2 * n;
    let after = |count: u32, k: u32| (1..=count).filter(|q| q * total / (count + 1) == k).count();
    let mut steps = Vec::new();
    for k in 0..=total {
        if k > 0 {
            steps.push(Step::Roll {
                node_b: k > n,
                mode: Mode::Surge,
                i: if k > n { k - n } else { k },
                of: n,
            });
        }
        steps.extend((0..after(m.rotations, k)).map(|_| Step::Rotate));
        steps.extend((0..after(m.ip_reuses, k)).map(|_| Step::Reuse));
    }
    for node_b in [false, true] {
        steps.push(Step::Roll {
            node_b,
            mode: Mode::WorkerCrash,
            i: 1,
            of: 1,
        });
    }
    steps
}

/// One roll of node B's agent (surge or worker crash), timed on its Envoy with `poller`;
/// its server pods' SVIDs must still be in its Envoy after it.
fn peer_roll(b: &mut Bench, poller: &Poller, mode: Mode) -> Result<Roll> {
    let peer = b.peer.as_mut().ok_or_else(|| anyhow!("no node B"))?;
    let start = Instant::now();
    let action;
    let mut old_exit = None;
    let mut warmup = None;
    match mode {
        Mode::Surge => {
            let next = peer.node.start_agent();
            try_wait_for(
                &format!("agent-ready to pass for node B's standby {}", next.name),
                T_START,
                || agent_ready(&next.health_sock).then_some(()),
            )
            .with_context(|| format!("{} log:\n{}", next.name, next.log()))?;
            warmup = Some(start.elapsed().as_secs_f64());
            action = Instant::now();
            peer.owner.signal(Signal::SIGTERM);
            let old = std::mem::replace(&mut peer.owner, next);
            exit_of(old)?;
            old_exit = Some(action.elapsed().as_secs_f64());
            try_wait_for(
                &format!("node B's {} to serve as owner", peer.owner.name),
                T_START,
                || peer.owner.serving_owner(),
            )?;
        }
        Mode::WorkerCrash => {
            let pid = peer
                .owner
                .ready()
                .and_then(|(_, v)| v["pid"].as_i64())
                .ok_or_else(|| anyhow!("no worker pid in node B's /ready"))?;
            action = Instant::now();
            kill(Pid::from_raw(pid as i32), Signal::SIGKILL).context("SIGKILL node B's worker")?;
            try_wait_for(
                "node B's respawned worker to serve as owner",
                T_START,
                || {
                    peer.owner
                        .serving_owner()
                        .filter(|v| v["pid"].as_i64().is_some_and(|p| p != pid))
                },
            )?;
        }
        Mode::Recreate => bail!("node B is rolled in surge or worker-crash only"),
    }
    let takeover = action.elapsed().as_secs_f64();
    let times = wait_served(poller, start, T_START)?;
    let mut r = Roll {
        gap: Some(times.gap().as_secs_f64()),
        served_gap: Some(times.served_gap().as_secs_f64()),
        observed: times.observed,
        stream_failures: times.stream_failures,
        refused: times.connect_fail,
        takeover,
        stream_end_after_action: if times.down >= action {
            (times.down - action).as_secs_f64()
        } else {
            -(action - times.down).as_secs_f64()
        },
        old_exit_after_action: old_exit,
        warmup,
        unserved: Some((times.down, times.served)),
        ..Default::default()
    };
    if let (Some(g), Some(id)) = (&b.gate, &b.identity) {
        let (_, servers) = g.pods();
        r.svid_checked = servers.len() as u64;
        for m in identity::missing_svids(
            &peer.envoy,
            &id.provider,
            &servers,
            times.up + identity::PODS_DEADLINE,
        )? {
            r.svid_misses.push(format!(
                "node B: {m} {:?} after the new owner served",
                identity::PODS_DEADLINE
            ));
        }
    }
    Ok(r)
}

fn log_roll(label: &str, i: u32, of: u32, mode: Mode, r: &Roll, identity: bool) {
    let ms = |x: Option<f64>| {
        x.map(|v| format!("{:.1} ms", v * 1000.0))
            .unwrap_or("-".into())
    };
    eprintln!(
        "[{label} {i}/{of}] gap {}{} served_gap {} stream_failures {} refused {} failed_requests {} adds {} dels {} lost {} | after the {}: stream end {:.0} ms, old exit {}, new owner on /ready {:.0} ms",
        ms(r.gap),
        if r.observed {
            ""
        } else {
            " (between two polls)"
        },
        ms(r.served_gap),
        r.stream_failures,
        r.refused,
        r.failed_requests,
        r.adds,
        r.dels,
        r.lost,
        if mode == Mode::WorkerCrash {
            "SIGKILL"
        } else {
            "SIGTERM"
        },
        r.stream_end_after_action * 1000.0,
        r.old_exit_after_action
            .map(|x| format!("{:.0} ms", x * 1000.0))
            .unwrap_or("-".into()),
        r.takeover * 1000.0
    );
    if r.relay_gap.is_some() || r.change_during_roll.is_some() {
        eprintln!(
            "   relay without an agent stream {} (it saw the end {} after the {signal}); registry change to Envoy's ACK: made at the {signal} {} ({} after the relay's next stream; written in {}), with no roll {} (written in {})",
            ms(r.relay_gap),
            ms(r.relay_end_after_action),
            ms(r.change_during_roll.map(|c| c.total)),
            ms(r.change_after_relay_serves()),
            ms(r.change_during_roll.map(|c| c.write)),
            ms(r.change_no_roll.map(|c| c.total)),
            ms(r.change_no_roll.map(|c| c.write)),
            signal = if mode == Mode::WorkerCrash {
                "SIGKILL"
            } else {
                "SIGTERM"
            },
        );
    }
    if identity {
        eprintln!(
            "   identity: takeover svid_wait {} (pods still without one: {}); overlap pod {} SVID in Envoy {} after the new owner served; {} of {} present pods' SVIDs in Envoy",
            r.svid_wait
                .map(|s| format!("{:.3} ms", s * 1000.0))
                .unwrap_or("-".into()),
            r.svid_wait_missed
                .map(|n| n.to_string())
                .unwrap_or("-".into()),
            r.overlap_pod.as_deref().unwrap_or("-"),
            r.overlap_svid
                .map(|s| format!("{:.1} ms", s * 1000.0))
                .unwrap_or("-".into()),
            (r.svid_checked as usize).saturating_sub(
                r.svid_misses
                    .iter()
                    .filter(|m| !m.starts_with("overlap pod"))
                    .count()
            ),
            r.svid_checked
        );
    }
}

/// Each roll's gap and served gap minus gap as Envoy's log times them, from `from` (a
/// byte offset) on: one reconnect per roll, in order, when its config log is at debug.
fn envoy_log_times(log: &Path, from: u64, rolls: &mut [Roll]) {
    let text = std::fs::read(log)
        .map(|b| String::from_utf8_lossy(b.get(from as usize..).unwrap_or_default()).into_owned())
        .unwrap_or_default();
    let seen = envoy::log_times::reconnects(&text);
    if seen.iter().all(|r| r.up.is_none()) {
        return;
    }
    if seen.len() != rolls.len() {
        eprintln!(
            "!! Envoy's log shows {} reconnects for {} rolls; its timing is left out",
            seen.len(),
            rolls.len()
        );
        return;
    }
    for (roll, r) in rolls.iter_mut().zip(seen) {
        roll.envoy_gap = r.gap();
        roll.envoy_served_after_up = r.served_after_up();
    }
}

/// Behind the relay: waits for the relay's next agent stream (its stream count past
/// `before.0` and connected); the roll's times, and the relay's time without an agent
/// stream. Envoy's own stream should not have ended: then its gap is 0, and its served gap
/// the relay's gap (from `action`); if it did end, the roll is timed as without the relay.
/// The relay's failed connects to `xds.sock` count with Envoy's as refused connects.
fn relay_switch(
    relay: &Relay,
    poller: &Poller,
    since: Instant,
    action: Instant,
    before: (f64, f64),
) -> Result<(RollTimes, RelaySwitch)> {
    try_wait_for(
        "the relay to open its stream to the new owner",
        T_START,
        || {
            (relay.metric("aether_relay_upstream_streams_total")? > before.0
                && relay.metric("aether_relay_upstream_connected")? == 1.0)
                .then_some(())
        },
    )
    .with_context(|| format!("relay log {}", relay.log.display()))?;
    let action_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64()
        - action.elapsed().as_secs_f64();
    let switch = RelaySwitch {
        gap: relay.metric("aether_relay_last_upstream_gap_seconds"),
        end_after_action: relay
            .metric("aether_relay_last_upstream_end_timestamp_seconds")
            .filter(|t| *t > 0.0)
            .map(|t| t - action_unix),
    };
    let gap = switch.gap;
    let relay_failed = relay
        .metric("aether_relay_upstream_failures_total")
        .map_or(0, |f| (f - before.1).max(0.0) as u64);
    let (base, changes) = poller.since(since);
    let Some(base) = base.or_else(|| changes.first().copied()) else {
        bail!("the admin poller has no sample of the roll");
    };
    if changes
        .iter()
        .any(|s| !s.connected || s.failures > base.failures)
    {
        let mut t = wait_served(poller, since, T_START)?;
        t.connect_fail += relay_failed;
        return Ok((t, switch));
    }
    let last = changes.last().copied().unwrap_or(base);
    let served = action + Duration::from_secs_f64(gap.unwrap_or(0.0));
    Ok((
        RollTimes {
            down: action,
            up: action,
            served,
            observed: true,
            stream_failures: 0,
            connect_fail: last.connect_fail.saturating_sub(base.connect_fail) + relay_failed,
        },
        switch,
    ))
}

/// A roll behind the relay, as the relay's metrics tell it.
#[derive(Debug, Default, Clone, Copy)]
struct RelaySwitch {
    /// From the agent stream's end to the next one open.
    gap: Option<f64>,
    /// From the roll's action to the agent stream's end.
    end_after_action: Option<f64>,
}

/// Waits until Envoy has lost its stream, regained it and taken a config update on the
/// new one; the stats timeline of the roll.
fn wait_served(poller: &Poller, since: Instant, timeout: Duration) -> Result<RollTimes> {
    try_wait_for(
        "Envoy to reconnect and take a config update from the new owner",
        timeout,
        || {
            let (before, changes) = poller.since(since);
            envoy::analyze(before, &changes)
        },
    )
}

/// With `ARG_DEBUG_STATS` set, the xDS-related stats that a roll moved, on stderr: how
/// the choice of stats in [`envoy`] was checked.
fn debug_stats(b: &Bench) -> Option<Vec<(String, u64)>> {
    if !b.debug_stats {
        return None;
    }
    let re = r"^(control_plane\.|cluster\.xds_cluster\.upstream_(cx|rq)_|cluster_manager\.cds\.|listener_manager\.lds\.)";
    let (_, body) = b
        .envoy
        .get(&format!("/stats?filter={}", envoy::encode(re)))
        .ok()?;
    Some(envoy::parse_stats(&body))
}

fn roll(b: &mut Bench, poller: &Poller, mode: Mode) -> Result<Roll> {
    let before_stats = debug_stats(b);
    let r = roll_inner(b, poller, mode);
    // Also when the roll failed between the hold and its release.
    b.quiet.release();
    if let (Some(before), Some(after)) = (before_stats, debug_stats(b)) {
        for (k, v) in &after {
            let old = before.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
            if old != Some(*v) {
                eprintln!(
                    "   stat {k}: {} -> {v}",
                    old.map(|o| o.to_string()).unwrap_or("-".into())
                );
            }
        }
    }
    r
}

fn roll_inner(b: &mut Bench, poller: &Poller, mode: Mode) -> Result<Roll> {
    // ARG_RELAY: the change is written beside the registry now and moved in at the action.
    if let Some(c) = &b.changes {
        c.stage()?;
    }
    let relay_before = b.relay.as_ref().map(|r| {
        (
            r.metric("aether_relay_upstream_streams_total")
                .unwrap_or(0.0),
            r.metric("aether_relay_upstream_failures_total")
                .unwrap_or(0.0),
        )
    });
    let start = Instant::now();
    let churn = Churn::start(b.cni.clone(), b.pods.clone(), !b.no_churn);
    // A poll is stamped with its request's midpoint: on a busy machine one that began
    // before `start` and saw the action's effect could carry a time before `start`, and
    // the roll's analysis would then wait for an end it already counted. One poll stamped
    // after `start` before the action rules that out.
    try_wait_for("a stats poll after the roll's start", T_START, || {
        poller.last().filter(|s| s.t > start)
    })?;
    let action;
    let mut old_exit = None;
    let mut warmup = None;
    // ARG_IDENTITY, surge: the pod ADDed between the standby's Ready and the SIGTERM, and
    // whether its ADD succeeded.
    let mut overlap: Option<(churn::PodId, bool)> = None;
    let serving: Value;
    match mode {
        Mode::Surge => {
            let started = Instant::now();
            let next = b.start_agent();
            let ready = try_wait_for(
                &format!("agent-ready to pass for standby {}", next.name),
                T_START,
                || agent_ready(&next.health_sock).then_some(()),
            );
            warmup = Some(started.elapsed().as_secs_f64());
            if let Err(e) = ready {
                let _ = churn.stop();
                return Err(e.context(format!("{} log:\n{}", next.name, next.log())));
            }
            if b.identity.is_some() {
                // The standby loaded storage before this ADD: the old owner answers it and
                // the new owner's takeover reconcile adds the pod, so the takeover's SVID
                // wait covers it.
                let (pod, ip) = b.pods.lock().unwrap().new_pod();
                let ok = churn::add_pod(&b.cni, &b.pods, &pod, ip);
                overlap = Some((pod, ok));
            }
            b.quiet.hold();
            action = Instant::now();
            b.owner.signal(Signal::SIGTERM);
            if let Some(c) = b.changes.as_mut() {
                c.make()?;
            }
            let old = std::mem::replace(&mut b.owner, next);
            exit_of(old)?;
            old_exit = Some(action.elapsed().as_secs_f64());
            serving = try_wait_for(
                &format!("{} to serve as owner", b.owner.name),
                T_START,
                || b.owner.serving_owner(),
            )?;
        }
        Mode::Recreate => {
            b.quiet.hold();
            action = Instant::now();
            b.owner.signal(Signal::SIGTERM);
            if let Some(c) = b.changes.as_mut() {
                c.make()?;
            }
            let next = b.start_agent_after_exit()?;
            old_exit = Some(action.elapsed().as_secs_f64());
            b.owner = next;
            serving = try_wait_for(
                &format!("{} to serve as owner", b.owner.name),
                T_START,
                || b.owner.serving_owner(),
            )?;
        }
        Mode::WorkerCrash => {
            let pid = b
                .owner
                .ready()
                .and_then(|(_, v)| v["pid"].as_i64())
                .ok_or_else(|| anyhow!("no worker pid in /ready"))?;
            b.quiet.hold();
            action = Instant::now();
            kill(Pid::from_raw(pid as i32), Signal::SIGKILL).context("SIGKILL the worker")?;
            if let Some(c) = b.changes.as_mut() {
                c.make()?;
            }
            serving = try_wait_for("the respawned worker to serve as owner", T_START, || {
                b.owner
                    .serving_owner()
                    .filter(|v| v["pid"].as_i64().is_some_and(|p| p != pid))
            })?;
        }
    }
    let serving_seen = Instant::now();
    let takeover = action.elapsed().as_secs_f64();
    let times = match (&b.relay, relay_before) {
        (Some(relay), Some(before)) => relay_switch(relay, poller, start, action, before),
        _ => wait_served(poller, start, T_START).map(|t| (t, RelaySwitch::default())),
    };
    let (mut adds, dels) = churn.stop();
    let (times, switch) = times?;
    let change_during_roll = match b.changes.as_mut() {
        Some(c) => Some(
            c.acked(&b.envoy)
                .context("the registry change made at the roll's action")?,
        ),
        None => None,
    };
    b.quiet.release();
    if overlap.as_ref().is_some_and(|(_, ok)| *ok) {
        adds += 1;
    }
    // The new owner served before Envoy could reconnect to it; the harness saw it on
    // /ready a little later (in surge only after the old generation had exited).
    let served_from = serving_seen.min(times.up);
    let mut overlap_svid = None;
    let mut svid_misses = Vec::new();
    if let (Some(id), Some((pod, ok))) = (&b.identity, &overlap) {
        if !ok {
            let err = b
                .pods
                .lock()
                .unwrap()
                .errors
                .last()
                .cloned()
                .unwrap_or_default();
            svid_misses.push(format!("overlap pod {}: its ADD failed: {err}", pod.uid));
        } else {
            // Read only now, after Envoy's first update from the new owner: before it,
            // /certs still shows what the old owner served.
            let deadline = served_from + identity::TAKEOVER_SVID_WAIT;
            match identity::wait_serial(&b.envoy, &id.provider, &pod.uid, deadline)? {
                Some(seen) if seen <= deadline => overlap_svid = Some(seen.saturating_duration_since(served_from).as_secs_f64()),
                late => svid_misses.push(format!(
                    "overlap pod {}: its SVID (serial {}) was not in Envoy's /certs within {:?} of the new owner serving{}",
                    pod.uid,
                    id.provider.serial_of_pod(&pod.uid).unwrap_or_else(|| "none: never subscribed".into()),
                    identity::TAKEOVER_SVID_WAIT,
                    late.map(|t| format!(" (first seen {:.0} ms after)", (t - served_from).as_secs_f64() * 1000.0)).unwrap_or_default()
                )),
            }
        }
    }
    let mut r = Roll {
        gap: Some(times.gap().as_secs_f64()),
        served_gap: Some(times.served_gap().as_secs_f64()),
        observed: times.observed,
        stream_failures: times.stream_failures,
        refused: times.connect_fail,
        adds,
        dels,
        takeover,
        stream_end_after_action: if times.down >= action {
            (times.down - action).as_secs_f64()
        } else {
            -(action - times.down).as_secs_f64()
        },
        old_exit_after_action: old_exit,
        warmup,
        reconnect_resources: (mode != Mode::WorkerCrash)
            .then(|| reconnect_resources(&b.owner.log())),
        unserved: Some((times.down, times.served)),
        relay_gap: switch.gap,
        relay_end_after_action: switch.end_after_action,
        change_during_roll,
        ..Default::default()
    };
    r.lost = check_pods(b)?;
    if b.changes.is_some() {
        // The new owner's snapshot is what Envoy holds, and a change with no roll under
        // way, the baseline, reaches Envoy.
        let owner = &b.owner;
        changes::versions_agree(&b.envoy, || owner.ready().map(|(_, v)| v))
            .with_context(|| format!("after the roll, {}", b.owner.name))?;
        let quiet = b.quiet.clone();
        if let Some(c) = b.changes.as_mut() {
            c.holds_current(&b.envoy)
                .with_context(|| format!("after the roll, {}", b.owner.name))?;
            c.stage()?;
            // Under the same churn as the roll's, so that the two samples differ by the
            // roll alone: the churn's CNI calls (plugin processes, record fsyncs) share
            // the cores and the disk with etcd and the agent.
            let churn = Churn::start(b.cni.clone(), b.pods.clone(), !b.no_churn);
            if !b.no_churn {
                try_wait_for(
                    "the churn's first two ADDs before the change between rolls",
                    T_START,
                    || (churn.calls() >= 2).then_some(()),
                )?;
            }
            quiet.hold();
            c.make()?;
            let acked = c.acked(&b.envoy);
            quiet.release();
            let (a, d) = churn.stop();
            r.adds += a;
            r.dels += d;
            r.change_no_roll = Some(acked.context("the registry change made between rolls")?);
        }
        r.lost += check_pods(b)?;
    }
    if let Some(id) = &b.identity {
        r.svid_wait = serving["takeover"]["svid_wait_us"]
            .as_f64()
            .map(|us| us / 1e6);
        r.svid_wait_missed = serving["takeover"]["svid_wait_missed"].as_u64();
        r.overlap_pod = overlap.map(|(pod, _)| pod.uid);
        r.overlap_svid = overlap_svid;
        r.svid_misses = svid_misses;
        let live: Vec<churn::PodId> = b.pods.lock().unwrap().live.keys().cloned().collect();
        r.svid_checked = live.len() as u64;
        let misses = identity::missing_svids(
            &b.envoy,
            &id.provider,
            &live,
            served_from + identity::PODS_DEADLINE,
        )?;
        for m in misses {
            eprintln!("   no SVID in Envoy: {m}");
            r.svid_misses.push(format!(
                "{m} {:?} after the new owner served",
                identity::PODS_DEADLINE
            ));
        }
    }
    Ok(r)
}

/// The resources in an owner's first answers of each type on its streams, from its log
/// (`first answer of the type on this stream`, with `resources=N`).
fn reconnect_resources(log: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains("first answer of the type on this stream"))
        .filter_map(|l| {
            l.split("resources=")
                .nth(1)?
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Behind the relay, what is held while a change is timed ([`Quiet::hold`] until
/// [`Quiet::release`]): node B's drains (two nodes), so that Envoy's next load assignment
/// is the timed change's, and the admin poller's reads, each of which holds Envoy's main
/// thread (50 ms and more at 10,000 services). The relay's own metrics time its rolls,
/// and Envoy's stream ends are counted from its cumulative stats; a roll without the
/// relay is timed by the poller, which reads on through it.
#[derive(Clone, Default)]
struct Quiet {
    drains: Option<Arc<two_node::Pause>>,
    polls: Option<Arc<crate::pause::Pause>>,
}

impl Quiet {
    fn hold(&self) {
        if let Some(p) = &self.drains {
            two_node::hold(p);
        }
        if let Some(p) = &self.polls
            && !p.hold(Duration::from_secs(2))
        {
            eprintln!("   (an admin read still in flight after 2 s; the change is timed anyway)");
        }
    }

    fn release(&self) {
        for p in [&self.drains, &self.polls].into_iter().flatten() {
            p.release();
        }
    }
}

impl Bench {
    fn start_agent_after_exit(&mut self) -> Result<Agent> {
        let status = self.owner.wait_exit_timeout(Duration::from_secs(10))?;
        if !status.success() {
            bail!(
                "{} exited with {status} after SIGTERM; log:\n{}",
                self.owner.name,
                self.owner.log()
            );
        }
        Ok(self.start_agent())
    }
}

fn exit_of(mut old: Agent) -> Result<()> {
    let status = old.wait_exit_timeout(Duration::from_secs(10))?;
    if !status.success() {
        bail!(
            "{} exited with {status} after SIGTERM; log:\n{}",
            old.name,
            old.log()
        );
    }
    Ok(())
}

/// Every pod whose ADD succeeded and that was not deleted must be in the owner's storage
/// and in Envoy's config. Returns how many newly went missing (a pod is counted once).
fn check_pods(b: &mut Bench) -> Result<u64> {
    let left = churn::settle(&b.cni, &b.pods, Duration::from_secs(10));
    if left > 0 {
        eprintln!(
            "   {left} DELs still failing after 10 s: {:?}",
            b.pods.lock().unwrap().errors.last()
        );
    }
    let live = b.pods.lock().unwrap().live.clone();
    let pods_dir = b.node.state_dir.join("pods");
    // Allow the new owner's snapshot the same 2 s the CNI service gives an ACK: a pod the
    // new owner really lost stays missing.
    let deadline = Instant::now() + Duration::from_secs(2);
    let missing = loop {
        // Listeners only: a pod has one (`inbound|<uid>`); at mesh scale the whole dump is
        // tens of megabytes of clusters and load assignments.
        let (status, dump) = b
            .envoy
            .get("/config_dump?resource=dynamic_listeners")
            .context("Envoy /config_dump")?;
        if status != 200 {
            bail!("Envoy /config_dump answered {status}");
        }
        let missing: Vec<String> = live
            .keys()
            .filter_map(|p| {
                let stored = pods_dir.join(format!("{}.json", p.uid)).is_file();
                let served = dump.contains(&format!("\"inbound|{}\"", p.uid));
                match (stored, served) {
                    (true, true) => None,
                    (false, true) => Some(format!("{} (not in storage)", p.uid)),
                    (true, false) => Some(format!("{} (not in Envoy's config)", p.uid)),
                    (false, false) => Some(format!(
                        "{} (neither in storage nor in Envoy's config)",
                        p.uid
                    )),
                }
            })
            .collect();
        if missing.is_empty() || Instant::now() >= deadline {
            break missing;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut new = 0;
    for m in missing {
        let uid = m.split(' ').next().unwrap_or("").to_string();
        if !b.lost_ever.iter().any(|l| l.starts_with(&uid)) {
            eprintln!("   lost add: {m}");
            b.lost_ever.insert(m);
            new += 1;
        }
    }
    Ok(new)
}

/// Prints the table for the modes that ran, writes the plot, prints the JSON line(s);
/// returns whether everything passed.
pub fn finish(cfg: &Config, results: &[ModeResult]) -> bool {
    let _ = std::fs::create_dir_all(&cfg.results_dir);
    let plot_name = format!(
        "{}{}",
        if cfg.all {
            "all"
        } else {
            results[0].mode.expect("mode").name()
        },
        match cfg.relay {
            RelayRuns::Off => "",
            RelayRuns::On => "-relay",
            RelayRuns::Both => "-with-relay",
        }
    );
    let plot = cfg
        .results_dir
        .join(format!("agent-restart-gap-{plot_name}.svg"));
    let series: Vec<report::Series> = results
        .iter()
        .map(|r| report::Series {
            name: if r.relay {
                format!(
                    "{}: the relay without an agent stream",
                    r.mode.expect("mode").name()
                )
            } else {
                r.label()
            },
            values: r.plotted(),
            relayed: r.relay,
        })
        .collect();
    let title = format!(
        "agent-restart-gap: Envoy without a control plane per roll (ADS backoff {}s/{}s, {} rps)",
        cfg.backoff_base.as_secs_f64(),
        cfg.backoff_max.as_secs_f64(),
        cfg.rps
    );
    if let Err(e) = report::plot(&plot, &title, &series, cfg.backoff_base.as_secs_f64()) {
        eprintln!("!! {e}");
    }

    println!();
    println!(
        "agent-restart-gap: {} rolls per mode, ADS backoff {:?}/{:?}, load {} rps{}",
        cfg.rolls,
        cfg.backoff_base,
        cfg.backoff_max,
        cfg.rps,
        cfg.identity
            .map(|m| format!(", workload identity on ({} mTLS)", m.name()))
            .unwrap_or_default()
    );
    println!("{}", report::header());
    for r in results {
        let m = &r.label();
        let count =
            |f: &dyn Fn(&Roll) -> u64| r.rolls.iter().map(|x| f(x) as f64).collect::<Vec<_>>();
        println!("{}", report::row(&format!("{m}: gap (s)"), &r.gaps(), 4));
        println!(
            "{}",
            report::row(&format!("{m}: served gap (s)"), &r.served_gaps(), 4)
        );
        let excess: Vec<f64> = r
            .rolls
            .iter()
            .filter_map(|x| Some(x.served_gap? - x.gap?))
            .collect();
        println!(
            "{}",
            report::row(&format!("{m}: served gap minus gap (s)"), &excess, 4)
        );
        let envoy =
            |f: &dyn Fn(&Roll) -> Option<f64>| r.rolls.iter().filter_map(f).collect::<Vec<_>>();
        println!(
            "{}",
            report::row(
                &format!("{m}: Envoy's log: gap (s)"),
                &envoy(&|x| x.envoy_gap),
                4
            )
        );
        println!(
            "{}",
            report::row(
                &format!("{m}: Envoy's log: served minus gap (s)"),
                &envoy(&|x| x.envoy_served_after_up),
                4
            )
        );
        println!(
            "{}",
            report::row(
                &format!("{m}: takeover seen on /ready (s)"),
                &r.rolls.iter().map(|x| x.takeover).collect::<Vec<_>>(),
                4
            )
        );
        println!(
            "{}",
            report::row(
                &format!("{m}: refused connects per roll"),
                &count(&|x| x.refused),
                0
            )
        );
        println!(
            "{}",
            report::row(
                &format!("{m}: failed requests per roll"),
                &count(&|x| x.failed_requests),
                0
            )
        );
        println!(
            "{}",
            report::row(
                &format!("{m}: ADDs during overlap per roll"),
                &count(&|x| x.adds),
                0
            )
        );
        println!(
            "{}",
            report::row(&format!("{m}: lost adds per roll"), &count(&|x| x.lost), 0)
        );
        if r.changes_on {
            for (what, v) in [
                (
                    "relay without an agent stream (s)",
                    r.changes(|x| x.relay_gap),
                ),
                (
                    "change at the roll to ACK (s)",
                    r.changes(|x| x.change_during_roll.map(|c| c.total)),
                ),
                (
                    "roll's action to the relay's sight of its end (s)",
                    r.changes(|x| x.relay_end_after_action),
                ),
                (
                    "change's ACK after the relay's next stream (s)",
                    r.changes(Roll::change_after_relay_serves),
                ),
                (
                    "change with no roll to ACK (s)",
                    r.changes(|x| x.change_no_roll.map(|c| c.total)),
                ),
                (
                    "change at the roll: its write (s)",
                    r.changes(|x| x.change_during_roll.map(|c| c.write)),
                ),
                (
                    "change with no roll: its write (s)",
                    r.changes(|x| x.change_no_roll.map(|c| c.write)),
                ),
                (
                    "change at the roll: write to ACK (s)",
                    r.changes(|x| x.change_during_roll.map(|c| c.after_write())),
                ),
                (
                    "change with no roll: write to ACK (s)",
                    r.changes(|x| x.change_no_roll.map(|c| c.after_write())),
                ),
            ] {
                if !v.is_empty() || !r.relay {
                    println!("{}", report::row(&format!("{m}: {what}"), &v, 4));
                }
            }
        }
        if let Some(d) = &r.cross_drain {
            println!(
                "{}",
                report::row(&format!("{m}: cross-node drain (s)"), &d.samples, 4)
            );
            println!(
                "{}",
                report::row(
                    &format!("{m}: drain outside reconnects (s)"),
                    &r.drains_across_reconnects().1,
                    4
                )
            );
        }
        if r.identity.is_some() {
            let ms = |v: Vec<f64>| v.into_iter().map(|s| s * 1000.0).collect::<Vec<_>>();
            println!(
                "{}",
                report::row(
                    &format!("{m}: takeover svid_wait (ms)"),
                    &ms(r.svid_waits()),
                    3
                )
            );
            if r.rolls.iter().any(|x| x.overlap_pod.is_some()) {
                println!(
                    "{}",
                    report::row(
                        &format!("{m}: overlap pod SVID after takeover (ms)"),
                        &ms(r.overlap_svids()),
                        1
                    )
                );
            }
            println!(
                "{}",
                report::row(
                    &format!("{m}: SVID misses per roll"),
                    &count(&|x| x.svid_misses.len() as u64),
                    0
                )
            );
        }
    }
    println!("context: {SEED_SURGE}; {SEED_RECREATE}.");
    if results.iter().any(|r| r.mode == Some(Mode::Recreate)) {
        println!(
            "recreate here is delete-then-create without the cluster's pod start cost (no scheduling, image pull or kubelet sync)."
        );
    }
    for r in results {
        let m = &r.label();
        println!(
            "{m}: {} requests ({} failed, {} started late), admin polled {} times, a poll took {:.2} ms median ({:.2} ms worst), worst poll interval {:.2} ms",
            r.requests,
            r.failed_requests,
            r.late_requests,
            r.polls,
            r.poll_cost.0.as_secs_f64() * 1000.0,
            r.poll_cost.1.as_secs_f64() * 1000.0,
            r.poll_max_interval.as_secs_f64() * 1000.0
        );
        for f in &r.failure_samples {
            println!("{m}:   failed request {f}");
        }
        for l in &r.lost_pods {
            println!("{m}:   lost add {l}");
        }
        if r.stuck_dels > 0 {
            println!("{m}:   {} DELs never succeeded", r.stuck_dels);
        }
        if r.changes_on {
            println!(
                "{m}: Envoy's ADS stream ended {} times during the rolls; {} NACKs{}",
                r.envoy_stream_ends
                    .map_or("?".to_string(), |n| n.to_string()),
                r.nacks.map_or("?".to_string(), |n| n.to_string()),
                r.relay_upstream_streams
                    .map(|n| format!(
                        "; the relay opened {n} streams to the agent ({} switches in overlap, {} fresh re-statements)",
                        r.relay_overlap_switches.map_or("?".to_string(), |n| n.to_string()),
                        r.relay_overlap_restarts.map_or("?".to_string(), |n| n.to_string())
                    ))
                    .unwrap_or_default()
            );
        }
        for f in r.failures(cfg.rolls) {
            println!("{m}: FAIL {f}");
        }
        if !r.cni_errors.is_empty() && !r.failures(cfg.rolls).is_empty() {
            for e in r.cni_errors.iter().take(5) {
                println!("{m}:   CNI error {e}");
            }
        }
        if let Some(d) = &r.cross_drain {
            println!(
                "{m}: two nodes: {} drains of node B's pods timed at node A's Envoy ({} of them across its reconnect in a roll, {} never seen ({} of them DELs answered within 100 ms of a node B roll), {} steps failed, {} ADDs refused while node B's worker restarted, {} registrar applies), a /clusters read took {:.2} ms median ({:.2} ms worst)",
                d.samples.len(),
                r.drains_across_reconnects().0.len(),
                d.timeouts.len(),
                d.lost_in_peer_rolls.len(),
                d.errors.len(),
                d.refused_adds,
                d.batches,
                d.poll_cost.0.as_secs_f64() * 1000.0,
                d.poll_cost.1.as_secs_f64() * 1000.0
            );
        }
        if let Some(eq) = &r.eds_equal_registrar {
            println!(
                "{m}: both Envoys' EDS equal the registrar's view: {}",
                eq.is_ok()
            );
        }
        if let Some(mtls) = r.identity {
            let checks: u64 = r.rolls.iter().map(|x| x.svid_checked).sum();
            let overlap = r.rolls.iter().filter(|x| x.overlap_pod.is_some()).count();
            println!(
                "{m}: identity {} (trust domain {}, {}): after each roll every present pod's SVID serial must be in Envoy's /certs within {:?} of the new owner serving; {} pod checks over {} rolls, {} missed",
                mtls.name(),
                identity::TRUST_DOMAIN,
                if cfg.nodes == 2 {
                    "node A's agents"
                } else {
                    "every agent"
                },
                identity::PODS_DEADLINE,
                checks,
                r.rolls.len(),
                r.svid_misses()
            );
            if overlap > 0 {
                println!(
                    "{m}: identity: {overlap} overlap pods, one per roll, ADDed between the standby's Ready and the SIGTERM (the new owner's reconcile adds them; its takeover waits up to {:?} for their SVIDs); {} of them in /certs within {:?} of the new owner serving, timed from then to the first /certs read after Envoy's first update from the new owner (so the time includes Envoy's reconnect, the served gap)",
                    identity::TAKEOVER_SVID_WAIT,
                    r.overlap_svids().len(),
                    identity::TAKEOVER_SVID_WAIT
                );
            }
            println!(
                "{m}: identity: takeover svid_wait from the new owner's /ready; {} reconciled pods were still without an SVID when it ended (svid_wait_missed)",
                r.rolls
                    .iter()
                    .filter_map(|x| x.svid_wait_missed)
                    .sum::<u64>()
            );
            println!(
                "{m}: identity: {}{}",
                if r.mtls.is_some() {
                    "the load is the pods' mTLS load below"
                } else {
                    "the load is unchanged: plaintext through Envoy's outbound listener to loopback upstreams, which are not pods, so mTLS is not on its path"
                },
                if mtls == identity::Mtls::Permissive {
                    " (permissive pods keep their plaintext chain as well)"
                } else {
                    ""
                }
            );
        }
        if let Some(x) = &r.mtls {
            let v = &x.verdict;
            println!(
                "{m}: mTLS {}: {} requests from {} client pods ({} keep-alive connections, {} connections opened, {:.0} rps), {} failed; {} joined to node B's access log: {} wrong identity {:?}, {} plaintext from {:?} ({} on connections opened after the pod's SVID arrived)",
                x.mode.map_or("", identity::Mtls::name),
                x.requests,
                mtls::CLIENTS,
                mtls::CLIENTS * mtls::KEEPALIVE,
                x.conns,
                if x.seconds > 0.0 {
                    x.requests as f64 / x.seconds
                } else {
                    0.0
                },
                x.failed,
                v.joined,
                v.wrong,
                v.wrong_kinds,
                v.plaintext,
                v.plaintext_pods,
                v.plaintext_after_svid
            );
            println!(
                "{m}: mTLS: {} node B surge rolls, worker crash gaps {:?} s (bound {:.2} s), {} of {} rotations (new SVIDs in both Envoys within {:?} s), {} of {} IP reuses, SVID released to the first request presenting it {:?} s",
                x.peer_rolls,
                x.crash_gaps,
                x.crash_bound,
                x.rotations,
                x.rotations_wanted,
                x.rotation_s,
                x.ip_reuses,
                x.ip_reuses_wanted,
                x.svid_to_first_mtls
            );
            for w in &v.wrong_samples {
                println!("{m}:   wrong identity {w}");
            }
            for f in x.failure_log.iter().take(5) {
                println!("{m}:   failed mTLS request {f}");
            }
        }
        if let Some(d) = &r.node_dir {
            println!("{m}: node folder kept for inspection: {}", d.display());
        }
        if let Some(d) = &r.peer_dir {
            println!("{m}: node B's folder kept for inspection: {}", d.display());
        }
    }
    println!("plot: {}", plot.display());

    let lines: Vec<Value> = results.iter().map(|r| r.json(cfg, &plot)).collect();
    let pass = results.iter().all(|r| r.failures(cfg.rolls).is_empty());
    if results.len() > 1 {
        println!();
        println!(
            "{:<22} {:>6} {:>12} {:>12} {:>12} {:>12} {:>9} {:>8} {:>6}",
            "mode",
            "rolls",
            "gap median",
            "gap p99",
            "served p50",
            "served p99",
            "failed",
            "refused",
            "lost"
        );
        for (r, j) in results.iter().zip(&lines) {
            println!(
                "{:<22} {:>6} {:>10.1}ms {:>10.1}ms {:>10.1}ms {:>10.1}ms {:>9} {:>8} {:>6}",
                r.label(),
                r.rolls.len(),
                j["gap_median_s"].as_f64().unwrap_or(0.0) * 1000.0,
                j["gap_p99_s"].as_f64().unwrap_or(0.0) * 1000.0,
                j["served_gap_median_s"].as_f64().unwrap_or(0.0) * 1000.0,
                j["served_gap_p99_s"].as_f64().unwrap_or(0.0) * 1000.0,
                r.failed_requests,
                r.refused(),
                r.lost()
            );
        }
        if cfg.relay != RelayRuns::Off {
            println!();
            println!(
                "{:<22} {:>14} {:>14} {:>14} {:>12} {:>12} {:>14} {:>8} {:>6}",
                "registry change",
                "at roll p50",
                "at roll p99",
                "no roll p99",
                "relay gap p99",
                "end seen p99",
                "after next p99",
                "ends",
                "nacks"
            );
            let ms = |v: &Value| {
                v.as_f64()
                    .map_or("-".to_string(), |x| format!("{:.1}ms", x * 1000.0))
            };
            for (r, j) in results.iter().zip(&lines) {
                println!(
                    "{:<22} {:>14} {:>14} {:>14} {:>12} {:>12} {:>14} {:>8} {:>6}",
                    r.label(),
                    ms(&j["change_during_roll_median_s"]),
                    ms(&j["change_during_roll_p99_s"]),
                    ms(&j["change_no_roll_p99_s"]),
                    ms(&j["relay_upstream_gap_p99_s"]),
                    ms(&j["relay_upstream_end_after_roll_p99_s"]),
                    ms(&j["change_after_relay_serves_p99_s"]),
                    r.envoy_stream_ends
                        .map_or("?".to_string(), |n| n.to_string()),
                    r.nacks.map_or("?".to_string(), |n| n.to_string())
                );
            }
        }
        println!("plot: {}", plot.display());
        for j in &lines {
            println!("{j}");
        }
        let mut all = json!({
            "mode": if cfg.all { "all" } else { results[0].mode.expect("mode").name() },
            "pass": pass,
            "plot": plot.display().to_string(),
            "modes": lines,
        });
        if cfg.relay != RelayRuns::Off {
            all["relay"] = json!(cfg.relay.name());
        }
        println!("{all}");
    } else {
        println!("{}", lines[0]);
    }
    pass
}
