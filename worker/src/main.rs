//! `aether-worker`: the unprivileged half of the Aether node agent, started by
//! `aether-supervisor` with its control socket at fd 3, no capabilities and no_new_privs.
#![forbid(unsafe_code)]

use aether_worker::config::Config;

fn main() {
    let cfg = Config::from_args(std::env::args_os()).unwrap_or_else(|e| e.exit());
    shared_proto::logging::init(&cfg.agent.log_format);
    // Take the inherited control socket before anything else can open a descriptor, and
    // move it above the descriptors the worker opens at start. When a process dies, the
    // kernel releases its files newest number first, and closing an inotify instance (the
    // registry and capture watchers) waits for an SRCU grace period, about 10 ms on a busy
    // node. Numbered above the watchers, the control socket is released before them, so
    // the supervisor sees a crashed worker's end at once and respawns it instead of
    // waiting out the grace period for its SIGCHLD.
    let inherited =
        shared_proto::fdpass::take_inherited(cfg.control_fd, nix::sys::socket::SockType::SeqPacket);
    let control = match inherited.and_then(|fd| shared_proto::fdpass::dup_at_or_above(&fd, 64)) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(fd = cfg.control_fd, error = %e, "no control socket from the supervisor; aether-worker is started by aether-supervisor");
            std::process::exit(2);
        }
    };
    // The supervisor takes the control socket's close for the worker's death and kills it
    // at once; a second descriptor of it, closed only by the exit, keeps an error that
    // ends `run` (which drops its own) from being cut short before it is logged. Above 64
    // too, so that a crash still closes it before the watchers.
    let held_until_exit = match shared_proto::fdpass::dup_at_or_above(&control, 64) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::error!(error = %e, "cannot duplicate the control socket");
            std::process::exit(2);
        }
    };
    // Exec, and a new SIGSYS disposition, kill the worker from here on; the supervisor's
    // filters already hold the rest. Before the runtime, while this is the only thread.
    if let Err(e) = shared_proto::seccomp::confine(shared_proto::seccomp::take_report()) {
        tracing::error!(error = %e, "cannot install the worker's own seccomp filter");
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = match runtime.block_on(aether_worker::agent::run(cfg, control)) {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "worker failed");
            1
        }
    };
    // Do not wait for detached tasks (the proxy's ADS stream ends with the process).
    drop(held_until_exit);
    std::process::exit(code);
}
