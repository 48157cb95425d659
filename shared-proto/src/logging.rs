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
        Some(s) => s.parse::<Targets>().map_err(|e| {
            format!(
                "RUST_LOG={s:?} is not a list of target=level directives ({e}); logging at info"
            )
        }),
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
    subscriber(targets, format, ansi, std::io::stderr).init();
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
}

/// Text or flattened JSON lines on `writer`, filtered by `targets` alone.
fn subscriber<W>(
    targets: Targets,
    format: &str,
    ansi: bool,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    // The builder's own level (info by default) would hide what `targets` lets through.
    let builder = tracing_subscriber::fmt()
        .with_max_level(tracing::level_filters::LevelFilter::TRACE)
        .with_writer(writer)
        .with_ansi(ansi);
    if format == "json" {
        Box::new(builder.json().flatten_event(true).finish().with(targets))
    } else {
        Box::new(builder.finish().with(targets))
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
        assert!(
            t.would_enable("aether_worker::xds::server::delta", &Level::DEBUG),
            "a target's children"
        );
        assert!(!t.would_enable("aether_worker::cni", &Level::DEBUG));
        assert!(t.would_enable("aether_worker::cni", &Level::INFO));
        let default = filter(None).unwrap();
        assert!(
            default.would_enable("anything", &Level::INFO)
                && !default.would_enable("anything", &Level::DEBUG)
        );
        assert_eq!(
            format!("{:?}", filter(Some(" ")).unwrap()),
            format!("{default:?}")
        );
        assert!(
            filter(Some("warn"))
                .unwrap()
                .would_enable("x", &Level::WARN)
        );
        assert!(
            !filter(Some("warn"))
                .unwrap()
                .would_enable("x", &Level::INFO)
        );
    }

    /// What a subscriber wrote.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_subscriber_writes_what_the_directives_enable_and_nothing_else() {
        for format in ["text", "json"] {
            let out = Captured::default();
            let writer = out.clone();
            let sub = subscriber(
                filter(Some("info,aether_worker::xds::server=debug")).unwrap(),
                format,
                false,
                move || writer.clone(),
            );
            tracing::subscriber::with_default(sub, || {
                tracing::debug!(target: "aether_worker::xds::server", "pushed");
                tracing::debug!(target: "aether_worker::cni", "hidden");
                tracing::info!(target: "aether_worker::cni", "served");
            });
            let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
            assert!(
                text.contains("pushed") && text.contains("served"),
                "{format}: {text}"
            );
            assert!(!text.contains("hidden"), "{format}: {text}");
        }
    }

    #[test]
    fn a_bad_rust_log_is_an_error_naming_it() {
        let e = filter(Some("aether=loud")).unwrap_err();
        assert!(e.contains("RUST_LOG=\"aether=loud\""), "{e}");
    }
}
