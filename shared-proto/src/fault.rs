//! Test-only fault hooks (feature `fault-hooks`): a process started with
//! `AETHER_FAULT_HOOK=<step>[,<step>...]` stops itself (SIGSTOP) the first time it reaches
//! each named step of the handoff, so that a test can SIGKILL the owner, the standby or
//! both at exactly that point (`e2e/tests/handoff_kills.rs`).
//!
//! Call sites use [`crate::fault_hook!`], which expands to nothing without the feature:
//! then neither this module, the variable's name nor any step name is in the binary
//! (`scripts/check-release-hooks.sh` checks the release binaries). Never enabled by a
//! production build.

use std::sync::{Mutex, OnceLock};

use nix::sys::signal::{Signal, raise};

/// The environment variable naming the steps to stop at; also the marker the release
/// check looks for.
pub const ENV: &str = "AETHER_FAULT_HOOK";

/// The steps still armed, read from [`ENV`] once; each fires once.
fn armed() -> &'static Mutex<Vec<String>> {
    static ARMED: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    ARMED.get_or_init(|| {
        let steps = std::env::var(ENV).unwrap_or_default();
        Mutex::new(
            steps
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        )
    })
}

/// Stops this process with SIGSTOP if `step` is armed (the first time only), after saying
/// so on stderr, which is the agent's log.
pub fn reached(step: &str) {
    let hit = {
        let mut steps = armed().lock().unwrap_or_else(|e| e.into_inner());
        steps
            .iter()
            .position(|s| s == step)
            .map(|i| steps.swap_remove(i))
            .is_some()
    };
    if hit {
        eprintln!(
            "fault hook: stopping at {step} (pid {})",
            std::process::id()
        );
        // Every thread stops with the process; SIGCONT resumes it here.
        if let Err(e) = raise(Signal::SIGSTOP) {
            eprintln!("fault hook: SIGSTOP at {step} failed: {e}");
        }
    }
}

/// Stops the process at `step` when the process was started with it in
/// `AETHER_FAULT_HOOK`; nothing at all without the `fault-hooks` feature.
#[macro_export]
macro_rules! fault_hook {
    ($step:literal) => {
        $crate::fault::reached($step)
    };
}

/// The names of the environment variables a supervisor passes on to its worker for the
/// hooks: [`ENV`], or none without the `fault-hooks` feature.
#[macro_export]
macro_rules! fault_hook_env {
    () => {
        [$crate::fault::ENV]
    };
}
