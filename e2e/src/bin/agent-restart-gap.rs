//! `agent-restart-gap`: rolls the node agent under a real Envoy and load, and measures
//! how long the proxy is without a control plane. Run it through
//! `e2e/agent-restart-gap.sh`, which builds the release binaries and installs Envoy.

use std::process::ExitCode;

use aether_e2e::harness::{self, Config};

fn main() -> ExitCode {
    let cfg = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("agent-restart-gap: {e:#}");
            return ExitCode::from(2);
        }
    };
    let results: Vec<_> = cfg
        .modes
        .iter()
        .map(|m| harness::run_mode(&cfg, *m))
        .collect();
    if harness::finish(&cfg, &results) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
