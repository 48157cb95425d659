//! The gate's settings, parsed with clap from the `ARG_*` environment variables that
//! `e2e/agent-restart-gap.sh` documents (each also a flag of the same meaning, which wins
//! over the variable). `agent-restart-gap --help` lists them with their meaning and
//! default.
//!
//! The formats are the ones the gate always read: a variable set to blanks counts as
//! unset (except the three that only need to be set), values are trimmed, and a duration
//! is a bare number of seconds (`0.12`) or carries a unit (`0.12s`, `120ms`), as
//! [`super::parse_duration`] reads it. A bad value is an error naming the variable.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, anyhow};
use clap::{CommandFactory, FromArgMatches, Parser};

use super::identity::Mtls;
use super::{Mode, RelayRuns, parse_duration};
use crate::envoy::AdsApi;

/// The variables that count as set whatever their value, the empty string included.
const PRESENCE: [&str; 3] = ["ARG_NO_CHURN", "ARG_KEEP_NODE", "ARG_DEBUG_STATS"];

/// `ARG_MODE`: one mode, or the three one after the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Modes {
    pub modes: Vec<Mode>,
    pub all: bool,
}

#[derive(Debug, Parser)]
#[command(
    name = "agent-restart-gap",
    about = "The end-to-end gate: rolls the node agent on a local node under a real Envoy and load, and measures how long Envoy is without a control plane",
    long_about = "The end-to-end gate: rolls the node agent on a local node under a real Envoy and load, and measures how long Envoy is without a control plane. Run it through e2e/agent-restart-gap.sh, which builds the release binaries and documents each setting at length. Each setting is an ARG_* environment variable (a blank one counts as unset) or the flag of the same meaning. Durations are seconds (0.12) or carry a unit (0.12s, 120ms)."
)]
pub struct Args {
    /// Rolls per mode (at least 1)
    #[arg(long, env = "ARG_ROLLS", value_name = "N", default_value = "20", value_parser = rolls)]
    pub rolls: u32,
    /// surge, recreate, worker-crash, or all (the three one after the other, each on its own
    /// local node)
    #[arg(long, env = "ARG_MODE", value_name = "MODE", default_value = "surge", value_parser = modes)]
    pub mode: Modes,
    /// 1, or 2: two local nodes share one registrar on etcd instead of a registry file
    #[arg(long, env = "ARG_NODES", value_name = "N", default_value = "1", value_parser = nodes)]
    pub nodes: u8,
    /// Workload identity on the rolled node, in this mTLS mode: permissive or strict
    /// [default: off]
    #[arg(long, env = "ARG_IDENTITY", value_name = "MODE", value_parser = mtls_mode)]
    pub identity: Option<Mtls>,
    /// Pod-to-pod mTLS load across two nodes while both roll: strict or permissive (needs
    /// ARG_NODES=2 and ARG_MODE=surge) [default: off]
    #[arg(long, env = "ARG_MTLS", value_name = "MODE", value_parser = mtls_mode)]
    pub mtls: Option<Mtls>,
    /// With ARG_MTLS: rotations of every pod's SVID
    #[arg(long, env = "ARG_MTLS_ROTATIONS", value_name = "N", default_value = "3", value_parser = whole::<u32>)]
    pub mtls_rotations: u32,
    /// With ARG_MTLS: client pods replaced by a new pod at the same address
    #[arg(long, env = "ARG_MTLS_IP_REUSES", value_name = "N", default_value = "1", value_parser = whole::<u32>)]
    pub mtls_ip_reuses: u32,
    /// Fail when the p99 gap exceeds it [default per mode: surge 0.12 s, worker-crash
    /// 0.25 s, recreate 15 s]
    #[arg(long, env = "ARG_BOUND", value_name = "DURATION", value_parser = duration)]
    pub bound: Option<Duration>,
    /// HTTP requests per second through Envoy
    #[arg(long, env = "ARG_LOAD_RPS", value_name = "N", default_value = "200", value_parser = whole::<u32>)]
    pub load_rps: u32,
    /// Envoy's ADS reconnect backoff base
    #[arg(long, env = "ARG_BACKOFF_BASE", value_name = "DURATION", default_value = "0.1s", value_parser = duration)]
    pub backoff_base: Duration,
    /// Envoy's ADS reconnect backoff max (not below the base)
    #[arg(long, env = "ARG_BACKOFF_MAX", value_name = "DURATION", default_value = "1s", value_parser = duration)]
    pub backoff_max: Duration,
    /// The ADS variant Envoy speaks: delta (DELTA_GRPC) or sotw (GRPC)
    #[arg(long, env = "ARG_XDS_API", value_name = "API", default_value = "delta", value_parser = xds_api)]
    pub xds_api: AdsApi,
    /// That many more services in the registry, 10 endpoints each, never dialled: rolls at
    /// mesh scale
    #[arg(long, env = "ARG_MESH_SERVICES", value_name = "N", default_value = "0", value_parser = whole::<usize>)]
    pub mesh_services: usize,
    /// How often the harness reads Envoy's admin stats (each read costs Envoy's main thread
    /// a walk of its stats)
    #[arg(long, env = "ARG_POLL_PERIOD", value_name = "DURATION", default_value = "2ms", value_parser = duration)]
    pub poll_period: Duration,
    /// Where the SVG plot goes [default: e2e/results in the workspace]
    #[arg(long, env = "ARG_RESULTS_DIR", value_name = "DIR")]
    pub results_dir: Option<PathBuf>,
    /// Envoy through the xDS relay (aether-xds-relay): 1 (every mode behind the relay), or
    /// both (each mode without the relay, then with it, side by side); a registry change
    /// is then timed to Envoy's ACK at each roll's start and between rolls: through the
    /// registry file, or with ARG_NODES=2 through the registrar [default: off]
    #[arg(long, env = "ARG_RELAY", value_name = "1|both", value_parser = relay, num_args = 0..=1, default_missing_value = "1")]
    pub relay: Option<RelayRuns>,
    /// With ARG_NODES=2: the folder etcd keeps its data in [default: a new folder in the
    /// temp dir, on the disk the agents write to]. A folder on another disk, or on a tmpfs
    /// (/dev/shm), takes etcd's WAL fsync out of the agents' disk queue, as a control
    /// plane's etcd on a disk of its own is
    #[arg(long, env = "ARG_ETCD_DIR", value_name = "DIR")]
    pub etcd_dir: Option<PathBuf>,
    /// Set (to anything, even empty): no pod ADD/DEL during the rolls
    #[arg(long, env = "ARG_NO_CHURN", value_name = "ANY", num_args = 0..=1, default_missing_value = "")]
    pub no_churn: Option<String>,
    /// Set (to anything, even empty): keep the local node folder (logs) even when the run
    /// passes
    #[arg(long, env = "ARG_KEEP_NODE", value_name = "ANY", num_args = 0..=1, default_missing_value = "")]
    pub keep_node: Option<String>,
    /// Set (to anything, even empty): print the xDS-related stats each roll moved
    #[arg(long, env = "ARG_DEBUG_STATS", value_name = "ANY", num_args = 0..=1, default_missing_value = "")]
    pub debug_stats: Option<String>,
}

impl Args {
    /// From the process's environment and command line.
    pub fn from_env() -> Result<Args> {
        let blank = |name: &str| {
            std::env::var_os(name).is_some_and(|v| v.to_string_lossy().trim().is_empty())
        };
        Self::parse_with(
            |name| !PRESENCE.contains(&name) && blank(name),
            std::env::args_os(),
        )
    }

    /// Parses `argv` (the program name first) over the environment, but for the variables
    /// `unset` names, which count as unset. `--help` prints the help and exits.
    pub fn parse_with(
        unset: impl Fn(&str) -> bool,
        argv: impl IntoIterator<Item = impl Into<OsString> + Clone>,
    ) -> Result<Args> {
        let cmd = Args::command().mut_args(|a| match a.get_env().and_then(|n| n.to_str()) {
            Some(n) if unset(n) => a.env(None::<&'static str>),
            _ => a,
        });
        let matches = match cmd.try_get_matches_from(argv) {
            Ok(m) => m,
            Err(e) if !e.use_stderr() => e.exit(),
            Err(e) => return Err(named(e)),
        };
        Args::from_arg_matches(&matches).map_err(named)
    }
}

/// A clap error as the gate reported bad settings before: `ARG_X="value": why`.
fn named(e: clap::Error) -> anyhow::Error {
    use clap::error::{ContextKind, ContextValue};
    let cmd = Args::command();
    let context = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    let arg = context(ContextKind::InvalidArg).and_then(|shown| {
        cmd.get_arguments().find(|a| {
            a.get_long()
                .is_some_and(|l| shown.starts_with(&format!("--{l} ")))
        })
    });
    match (
        arg.and_then(|a| a.get_env()),
        context(ContextKind::InvalidValue),
    ) {
        (Some(env), Some(value)) => {
            let why = std::error::Error::source(&e)
                .map_or_else(|| e.kind().to_string(), |s| s.to_string());
            anyhow!("{}={value:?}: {why}", env.to_string_lossy())
        }
        _ => anyhow!("{}", e.render().to_string().trim_end()),
    }
}

fn whole<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.trim()
        .parse()
        .map_err(|_| "not a whole number".to_string())
}

fn rolls(s: &str) -> Result<u32, String> {
    match whole(s)? {
        0 => Err("must be at least 1".into()),
        n => Ok(n),
    }
}

fn modes(s: &str) -> Result<Modes, String> {
    let one = |m| {
        Ok(Modes {
            modes: vec![m],
            all: false,
        })
    };
    match s.trim() {
        "surge" => one(Mode::Surge),
        "recreate" => one(Mode::Recreate),
        "worker-crash" => one(Mode::WorkerCrash),
        "all" => Ok(Modes {
            modes: vec![Mode::Surge, Mode::Recreate, Mode::WorkerCrash],
            all: true,
        }),
        _ => Err("one of surge, recreate, worker-crash, all".into()),
    }
}

fn relay(s: &str) -> Result<RelayRuns, String> {
    match s.trim() {
        "0" | "off" => Ok(RelayRuns::Off),
        "1" | "on" => Ok(RelayRuns::On),
        "both" => Ok(RelayRuns::Both),
        _ => Err("1 (behind the relay), both (without and with it), or 0".into()),
    }
}

fn nodes(s: &str) -> Result<u8, String> {
    match s.trim() {
        "1" => Ok(1),
        "2" => Ok(2),
        _ => Err("1 or 2".into()),
    }
}

fn mtls_mode(s: &str) -> Result<Mtls, String> {
    match s.trim() {
        "permissive" => Ok(Mtls::Permissive),
        "strict" => Ok(Mtls::Strict),
        _ => Err("permissive or strict".into()),
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| format!("{e:#}"))
}

fn xds_api(s: &str) -> Result<AdsApi, String> {
    s.trim().parse()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses as if the environment held exactly `vars`: each goes in as the flag whose
    /// variable it is, which is how this test reaches every name without touching the
    /// process's environment.
    fn parse(vars: &[(&str, &str)]) -> Result<Args> {
        let cmd = Args::command();
        let mut argv = vec!["agent-restart-gap".to_string()];
        for (name, value) in vars {
            if value.trim().is_empty() && !PRESENCE.contains(name) {
                continue;
            }
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == *name))
                .unwrap_or_else(|| panic!("no setting reads {name}"));
            argv.push(format!(
                "--{}={value}",
                arg.get_long().expect("a long flag")
            ));
        }
        Args::parse_with(|_| true, argv)
    }

    #[test]
    fn the_defaults_are_the_gates() {
        let a = parse(&[]).unwrap();
        assert_eq!(a.rolls, 20);
        assert_eq!(
            a.mode,
            Modes {
                modes: vec![Mode::Surge],
                all: false
            }
        );
        assert_eq!(a.nodes, 1);
        assert_eq!((a.identity, a.mtls), (None, None));
        assert_eq!((a.mtls_rotations, a.mtls_ip_reuses), (3, 1));
        assert_eq!(a.bound, None);
        assert_eq!(a.load_rps, 200);
        assert_eq!(a.backoff_base, Duration::from_millis(100));
        assert_eq!(a.backoff_max, Duration::from_secs(1));
        assert_eq!(a.xds_api, AdsApi::Delta);
        assert_eq!(a.mesh_services, 0);
        assert_eq!(a.poll_period, crate::envoy::POLL_PERIOD);
        assert_eq!(a.results_dir, None);
        assert_eq!((a.no_churn, a.keep_node, a.debug_stats), (None, None, None));
        assert_eq!(a.relay, None);
    }

    #[test]
    fn every_variable_is_read_in_its_format() {
        let a = parse(&[
            ("ARG_ROLLS", " 3 "),
            ("ARG_MODE", "all"),
            ("ARG_NODES", "2"),
            ("ARG_IDENTITY", "permissive"),
            ("ARG_MTLS", "strict"),
            ("ARG_MTLS_ROTATIONS", "2"),
            ("ARG_MTLS_IP_REUSES", "20"),
            ("ARG_BOUND", "1"),
            ("ARG_LOAD_RPS", "50"),
            ("ARG_BACKOFF_BASE", "250ms"),
            ("ARG_BACKOFF_MAX", "2"),
            ("ARG_XDS_API", "GRPC"),
            ("ARG_MESH_SERVICES", "10000"),
            ("ARG_POLL_PERIOD", "0.005s"),
            ("ARG_RESULTS_DIR", "/tmp/plots"),
            ("ARG_NO_CHURN", ""),
            ("ARG_KEEP_NODE", "1"),
            ("ARG_DEBUG_STATS", "0"),
            ("ARG_RELAY", "both"),
            ("ARG_ETCD_DIR", "/dev/shm"),
        ])
        .unwrap();
        assert_eq!(a.relay, Some(RelayRuns::Both));
        assert_eq!(
            parse(&[("ARG_RELAY", "1")]).unwrap().relay,
            Some(RelayRuns::On)
        );
        assert_eq!(
            parse(&[("ARG_RELAY", "0")]).unwrap().relay,
            Some(RelayRuns::Off)
        );
        // The bare flag is 1.
        let bare = Args::parse_with(|_| true, ["agent-restart-gap", "--relay"]).unwrap();
        assert_eq!(bare.relay, Some(RelayRuns::On));
        assert_eq!(a.rolls, 3);
        assert_eq!(
            a.mode.modes,
            [Mode::Surge, Mode::Recreate, Mode::WorkerCrash]
        );
        assert!(a.mode.all);
        assert_eq!(a.nodes, 2);
        assert_eq!(
            a.etcd_dir.as_deref(),
            Some(std::path::Path::new("/dev/shm"))
        );
        assert_eq!(
            (a.identity, a.mtls),
            (Some(Mtls::Permissive), Some(Mtls::Strict))
        );
        assert_eq!((a.mtls_rotations, a.mtls_ip_reuses), (2, 20));
        // A bare number is seconds, where the agent's own flags need a unit.
        assert_eq!(a.bound, Some(Duration::from_secs(1)));
        assert_eq!(a.load_rps, 50);
        assert_eq!(a.backoff_base, Duration::from_millis(250));
        assert_eq!(a.backoff_max, Duration::from_secs(2));
        assert_eq!(a.xds_api, AdsApi::Sotw);
        assert_eq!(a.mesh_services, 10_000);
        assert_eq!(a.poll_period, Duration::from_millis(5));
        assert_eq!(a.results_dir, Some(PathBuf::from("/tmp/plots")));
        // Set is set, whatever the value.
        assert!(a.no_churn.is_some() && a.keep_node.is_some() && a.debug_stats.is_some());
        // Blank is unset for the others.
        assert_eq!(parse(&[("ARG_ROLLS", "  ")]).unwrap().rolls, 20);
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (name, value, why) in [
            ("ARG_ROLLS", "x", "not a whole number"),
            ("ARG_ROLLS", "0", "at least 1"),
            ("ARG_MODE", "rolling", "one of surge"),
            ("ARG_NODES", "3", "1 or 2"),
            ("ARG_IDENTITY", "on", "permissive or strict"),
            ("ARG_MTLS", "off", "permissive or strict"),
            ("ARG_MTLS_ROTATIONS", "-1", "not a whole number"),
            ("ARG_MTLS_IP_REUSES", "one", "not a whole number"),
            ("ARG_BOUND", "fast", "expected a number of seconds"),
            ("ARG_LOAD_RPS", "1.5", "not a whole number"),
            ("ARG_BACKOFF_BASE", "0s", "positive"),
            ("ARG_BACKOFF_MAX", "1x", "expected a number of seconds"),
            ("ARG_XDS_API", "grpc", "expected sotw"),
            ("ARG_MESH_SERVICES", "many", "not a whole number"),
            ("ARG_POLL_PERIOD", "-2ms", "negative"),
            ("ARG_RELAY", "yes", "both (without and with it)"),
        ] {
            let e = format!("{:#}", parse(&[(name, value)]).unwrap_err());
            assert!(
                e.starts_with(&format!("{name}={value:?}: ")) && e.contains(why),
                "{name}={value:?}: {e}"
            );
        }
    }

    #[test]
    fn the_help_lists_every_variable_with_its_default() {
        let help = Args::command().render_long_help().to_string();
        for (name, default) in [
            ("ARG_ROLLS", Some("20")),
            ("ARG_MODE", Some("surge")),
            ("ARG_NODES", Some("1")),
            ("ARG_IDENTITY", None),
            ("ARG_MTLS", None),
            ("ARG_MTLS_ROTATIONS", Some("3")),
            ("ARG_MTLS_IP_REUSES", Some("1")),
            ("ARG_BOUND", None),
            ("ARG_LOAD_RPS", Some("200")),
            ("ARG_BACKOFF_BASE", Some("0.1s")),
            ("ARG_BACKOFF_MAX", Some("1s")),
            ("ARG_XDS_API", Some("delta")),
            ("ARG_MESH_SERVICES", Some("0")),
            ("ARG_POLL_PERIOD", Some("2ms")),
            ("ARG_RESULTS_DIR", None),
            ("ARG_NO_CHURN", None),
            ("ARG_KEEP_NODE", None),
            ("ARG_DEBUG_STATS", None),
            ("ARG_RELAY", None),
        ] {
            let at = help
                .find(&format!("[env: {name}="))
                .unwrap_or_else(|| panic!("{name} is not in the help:\n{help}"));
            // Up to the next setting's variable: this one's default comes after its own.
            let own = &help[at + 1..];
            let own = &own[..own.find("[env: ").unwrap_or(own.len())];
            if let Some(d) = default {
                assert!(
                    own.contains(&format!("[default: {d}]")),
                    "{name}'s default {d} is not in the help:\n{help}"
                );
            }
        }
    }

    #[test]
    fn etcd_dir_needs_two_nodes_and_a_folder() {
        let config = |vars: &[(&str, &str)]| {
            super::super::Config::from_args(parse(vars).unwrap()).map(|_| ())
        };
        let one = config(&[("ARG_ETCD_DIR", "/dev/shm")]).unwrap_err();
        assert!(
            one.to_string()
                .contains("ARG_ETCD_DIR=/dev/shm needs ARG_NODES=2"),
            "{one}"
        );
        let file = tempfile::NamedTempFile::new().unwrap();
        let path = file.path().display().to_string();
        let not_dir = config(&[("ARG_NODES", "2"), ("ARG_ETCD_DIR", &path)]).unwrap_err();
        assert_eq!(
            not_dir.to_string(),
            format!("ARG_ETCD_DIR={path}: not a folder")
        );
    }
}
