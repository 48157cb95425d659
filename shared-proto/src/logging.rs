//! One log setup for both processes, so that the supervisor's `--log-format`, passed on to
//! its worker, means the same in each: `RUST_LOG` filters (default `info`), text or
//! flattened JSON on stderr, colour only on a terminal (log files and the kubelet's log
//! get plain text).

/// Installs the global subscriber. `format` is `json` or anything else for text.
pub fn init(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if format == "json" {
        builder.json().flatten_event(true).init();
    } else {
        builder.init();
    }
}
