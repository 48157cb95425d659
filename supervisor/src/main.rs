//! `aether-supervisor`: the privileged half of the Aether node agent.
//!
//! Small, synchronous and auditable: it holds the node lock, binds and holds the node
//! sockets, spawns the worker without privileges, and speaks a closed control protocol
//! with it. It never parses xDS, CNI or registry payloads. See SECURITY.md for the whole
//! surface, and `sys/` for every raw syscall.

mod chain;
mod config;
mod lifecycle;
mod monitor;
mod node;
mod report;
mod supervise;
mod sys;

use std::os::unix::process::CommandExt;

use clap::Parser;

use config::Config;
use shared_proto::flags::path_arg;

fn main() {
    let cfg = Config::parse();
    shared_proto::logging::init(&cfg.agent.log_format);
    match run(cfg) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "supervisor failed");
            std::process::exit(1);
        }
    }
}

/// What the supervisor needs when it runs as root, and why: the chart grants exactly
/// these (charts/aether-agent/templates/daemonset.yaml).
const REQUIRED_CAPS: &[(caps::Capability, &str)] = &[
    (
        caps::Capability::CAP_CHOWN,
        "chown(2) of the state and health folders and xds.sock's group",
    ),
    (
        caps::Capability::CAP_SETUID,
        "setresuid(2) to the worker user before exec",
    ),
    (
        caps::Capability::CAP_SETGID,
        "setgroups(2)/setresgid(2) to the worker group before exec",
    ),
    (
        caps::Capability::CAP_SETPCAP,
        "PR_CAPBSET_DROP to empty the worker's bounding set",
    ),
    (
        caps::Capability::CAP_KILL,
        "kill(2) of the worker, which runs under another uid",
    ),
];

fn run(cfg: Config) -> anyhow::Result<i32> {
    if cfg.keep_sockets {
        // The socket keeper is a program of its own, which needs no privilege.
        let exe = sys::spawn::beside_me("aether-keeper");
        let err = std::process::Command::new(&exe)
            .arg("--run-dir")
            .arg(&cfg.run_dir)
            .arg("--log-format")
            .arg(&cfg.agent.log_format)
            .exec();
        anyhow::bail!("cannot run the socket keeper {}: {err}", exe.display());
    }
    // Before any descriptor is opened: what systemd passed sits at fd 3 and up.
    let from_systemd = sys::fdstore::take_listeners().unwrap_or_else(|e| {
        tracing::error!(error = %e, "ignoring the descriptors systemd passed; the node sockets will be bound fresh");
        (None, None)
    });
    // Files and sockets are created no more open than 0700; each gets its exact mode
    // right after. Set before any thread exists, as umask is per process.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    // Signals are blocked before the lock thread starts, so that they reach the signalfd.
    let signals = sys::signals::block_and_open()?;
    let root = nix::unistd::geteuid().is_root();
    let worker_owner = root.then_some(cfg.worker_user);
    if root {
        sys::caps::require(REQUIRED_CAPS)?;
    }
    sys::dirs::prepare_run_dir(&cfg.run_dir)?;
    sys::dirs::prepare_state_dir(&cfg.state_dir, worker_owner)?;
    sys::dirs::prepare_dir(&cfg.health_dir, worker_owner, 0o700)?;
    let args = worker_args(&cfg);
    let env: Vec<(String, String)> = ["RUST_LOG", "RUST_BACKTRACE", "GLIBC_TUNABLES"]
        .into_iter()
        .chain(shared_proto::fault_hook_env!())
        .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
        .chain(
            std::env::var_os("GLIBC_TUNABLES")
                .is_none()
                .then(|| ("GLIBC_TUNABLES".into(), WORKER_MALLOC.into())),
        )
        .collect();
    let sup = supervise::Supervisor::new(cfg, signals, args, env, from_systemd)?;
    Ok(sup.run())
}

/// The worker's heap, unless the operator sets GLIBC_TUNABLES: one malloc arena, on
/// transparent huge pages. The kernel frees a killed worker's memory before it closes its
/// streams, and on 2 MiB pages that takes well under half the time (`bench-memory kill`);
/// glibc puts only its main arena on them.
const WORKER_MALLOC: &str = "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1";

/// The worker's command line: everything it needs, nothing from the environment.
fn worker_args(cfg: &Config) -> Vec<String> {
    let node = cfg.node_name.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into())
    });
    let pod = cfg
        .pod_name
        .clone()
        .unwrap_or_else(|| format!("aether-agent-{}", std::process::id()));
    let mut a = vec![
        "aether-worker".to_string(),
        "--control-fd=3".into(),
        format!("--run-dir={}", path_arg(&cfg.run_dir)),
        format!("--state-dir={}", path_arg(&cfg.state_dir)),
        format!("--health-dir={}", path_arg(&cfg.health_dir)),
        format!("--node-name={node}"),
        format!("--pod-name={pod}"),
    ];
    a.extend(cfg.agent.worker_args());
    a
}
