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
    // ARG_RELAY=both: each mode without the relay, then with it, back to back.
    let results: Vec<_> = cfg
        .modes
        .iter()
        .flat_map(|m| cfg.relay.runs().iter().map(move |r| (*m, *r)))
        .map(|(m, relay)| harness::run_mode(&cfg, m, relay))
        .collect();
    if harness::finish(&cfg, &results) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
