//! One log setup for both processes, so that the supervisor's `--log-format`, passed on to
//! its worker, means the same in each: `RUST_LOG` filters (default `info`), text or
//! flattened JSON on stderr, colour only on a terminal (log files and the kubelet's log
//! get plain text).
//!
//! `RUST_LOG` is a list of `target=level` directives with an optional bare default level
//! (`info,aether_worker::xds::server=debug`), parsed as tracing-subscriber's `Targets`.
//! That is the form the chart, the unit and the tests use; `EnvFilter`'s span and field
//! filters are not taken, because `EnvFilter` links a regex engine into the supervisor
//! (about a quarter MiB of its resident code, against its 4 MiB budget).

use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The filter for a `RUST_LOG` value: `info` when unset or empty, an error naming the
/// value when it does not parse.
pub fn filter(spec: Option<&str>) -> Result<Targets, String> {
    match spec.map(str::trim) {
        None | Some("") => Ok(Targets::new().with_default(tracing::Level::INFO)),
        Some(s) => s.parse::<Targets>().map_err(|e| format!("RUST_LOG={s:?} is not a list of target=level directives ({e}); logging at info")),
    }
}

/// Installs the global subscriber. `format` is `json` or anything else for text.
pub fn init(format: &str) {
    let spec = std::env::var("RUST_LOG").ok();
    let (targets, problem) = match filter(spec.as_deref()) {
        Ok(t) => (t, None),
        Err(e) => (filter(None).expect("the default filter"), Some(e)),
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(ansi);
    if format == "json" {
        builder.json().flatten_event(true).finish().with(targets).init();
    } else {
        builder.finish().with(targets).init();
    }
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    #[test]
    fn rust_log_directives_set_the_default_and_per_target_levels() {
        let t = filter(Some("info,aether_worker::xds::server=debug")).unwrap();
        assert!(t.would_enable("aether_worker::xds::server", &Level::DEBUG));
        assert!(t.would_enable("aether_worker::xds::server::delta", &Level::DEBUG), "a target's children");
        assert!(!t.would_enable("aether_worker::cni", &Level::DEBUG));
        assert!(t.would_enable("aether_worker::cni", &Level::INFO));
        let default = filter(None).unwrap();
        assert!(default.would_enable("anything", &Level::INFO) && !default.would_enable("anything", &Level::DEBUG));
        assert_eq!(format!("{:?}", filter(Some(" ")).unwrap()), format!("{default:?}"));
        assert!(filter(Some("warn")).unwrap().would_enable("x", &Level::WARN));
        assert!(!filter(Some("warn")).unwrap().would_enable("x", &Level::INFO));
    }

    #[test]
    fn a_bad_rust_log_is_an_error_naming_it() {
        let e = filter(Some("aether=loud")).unwrap_err();
        assert!(e.contains("RUST_LOG=\"aether=loud\""), "{e}");
    }
}
