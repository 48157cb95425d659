//! `aether-keeper`, the node's socket keeper: a process outside the agent's pod that holds
//! duplicates of the node's listening sockets, so that the sockets stay open while no
//! agent runs at all.
//!
//! A surge roll hands the sockets from generation to generation and a worker crash keeps
//! them in the supervisor; a delete-then-create roll has neither, and without a keeper
//! the proxy's reconnect meets a socket file nobody listens on and is refused (each
//! refusal doubles Envoy's backoff). With a keeper, that connect waits in the backlog of
//! the kept listener, and the new agent, finding no owner on `handoff.sock`, takes the
//! kept sockets from `keeper.sock` and accepts it.
//!
//! The keeper speaks the handoff protocol on both sides (`shared_proto::handoff`): as a
//! standby would, it fetches the owner's offer every [`REFRESH`]; as an owner would, it
//! offers what it holds to a same-uid peer on `<run-dir>/keeper.sock`. It never accepts
//! on the node sockets, takes no lock, starts no worker and needs no capability: it runs
//! as the supervisors' uid (the handoff talks only to a peer of its own uid) with every
//! capability dropped. `aether-supervisor --keep-sockets` execs it. An offer it holds is
//! only as good as the checks the taker runs: the taking supervisor verifies each fd
//! against its path exactly as for a handoff.

use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Parser;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::SockType;
use shared_proto::handoff::{self, BindError, Held};
use tracing::{info, warn};

#[derive(Debug, Parser)]
#[command(
    name = "aether-keeper",
    version,
    about = "The node's socket keeper: holds the Aether agent's listening sockets while no agent runs",
    long_about = "Holds duplicates of the owner's listening sockets (xds.sock and cni.sock, \
fetched over <run-dir>/handoff.sock and refreshed every 2 s) and offers them on \
<run-dir>/keeper.sock to a new agent that finds no owner to take them from. Run it outside \
the agent's pod, beside it, as the agents' supervisors' uid and with no capability: across \
a delete-then-create roll the proxy's reconnect then waits in the kept socket's backlog \
instead of being refused. It takes no lock and starts no worker."
)]
struct Config {
    /// The agents' run folder (agent.lock, xds.sock, cni.sock, handoff.sock); keeper.sock
    /// is bound there. It must exist or be creatable, be owned by this uid and be writable
    /// by nobody else.
    #[arg(long, env = "AETHER_RUN_DIR", default_value = "/run/aether")]
    run_dir: PathBuf,
    /// Log format: text or json.
    #[arg(long, env = "AETHER_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

fn main() {
    let cfg = Config::parse();
    shared_proto::logging::init(&cfg.log_format);
    // Before any other thread exists: capabilities are per thread.
    if let Err(e) = drop_capabilities() {
        tracing::error!(error = %e, "socket keeper failed: cannot drop its capabilities");
        std::process::exit(1);
    }
    match run(&cfg) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            tracing::error!(error = %e, "socket keeper failed");
            std::process::exit(1);
        }
    }
}

/// The keeper needs no capability, whoever starts it: root running
/// `aether-supervisor --keep-sockets` by hand passes on a full set. Every set is emptied
/// (`shared_proto::caps::keep_only` of nothing), and no_new_privs is set, so that nothing
/// it execs could gain one back.
fn drop_capabilities() -> Result<(), caps::errors::CapsError> {
    shared_proto::caps::keep_only(&[])?;
    nix::sys::prctl::set_no_new_privs()
        .map_err(|e| caps::errors::CapsError::from(format!("PR_SET_NO_NEW_PRIVS: {e}")))
}

/// The run folder, created 0755 when missing, must be this uid's and writable by nobody
/// else, and lie in folders only root or this uid can change (checked before and after
/// the creation): keeper.sock is bound there and the node sockets are checked against its
/// paths.
fn check_run_dir(dir: &Path, me: u32) -> Result<(), KeeperError> {
    let err = |source| KeeperError::RunDir {
        path: dir.to_owned(),
        source,
    };
    handoff::check_folders_on_path(dir)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(err)?;
    let m = std::fs::symlink_metadata(dir).map_err(err)?;
    if !m.is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(KeeperError::NotOurs {
            path: dir.to_owned(),
            me,
            uid: m.uid(),
            mode: m.mode() & 0o7777,
        });
    }
    Ok(handoff::check_folders_on_path(dir)?)
}

/// How often the keeper fetches the owner's sockets again (a new owner may have bound
/// fresh ones).
const REFRESH: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
enum KeeperError {
    #[error("cannot open keeper.sock: {0}")]
    Bind(#[from] BindError),
    #[error("run folder {path}: {source}")]
    RunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "run folder {path} must be owned by uid {me} and writable by nobody else, but is owned by uid {uid} with mode {mode:o}; refusing to keep the node sockets there"
    )]
    NotOurs {
        path: PathBuf,
        me: u32,
        uid: u32,
        mode: u32,
    },
    #[error(transparent)]
    Path(#[from] handoff::PathError),
    #[error("signals: {0}")]
    Signals(nix::Error),
    #[error("keeper.sock: {0}")]
    NonBlocking(nix::Error),
    #[error("poll: {0}")]
    Poll(nix::Error),
}

fn run(cfg: &Config) -> Result<i32, KeeperError> {
    let me = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    check_run_dir(&cfg.run_dir, me.0)?;
    // keeper.sock is created no more open than 0700, then set to 0600.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().map_err(KeeperError::Signals)?;
    let signals = SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(KeeperError::Signals)?;
    let path = cfg.run_dir.join("keeper.sock");
    let listener = handoff::bind_fresh(&path, SockType::SeqPacket, 0o600, me)?;
    nix::fcntl::fcntl(
        &listener.fd,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map_err(KeeperError::NonBlocking)?;
    info!(path = %path.display(), "socket keeper started; fetching the owner's sockets over handoff.sock");
    let mut held: Option<Held> = None;
    let mut parked = handoff::Parked::default();
    let mut next_fetch = Instant::now();
    loop {
        if next_fetch <= Instant::now() {
            fetch(cfg, &mut held);
            next_fetch = Instant::now() + REFRESH;
        }
        let wait = next_fetch.saturating_duration_since(Instant::now()) + Duration::from_millis(1);
        let mut fds = vec![
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(listener.fd.as_fd(), PollFlags::POLLIN),
        ];
        fds.extend(parked.fds().map(|fd| PollFd::new(fd, PollFlags::POLLIN)));
        match poll(
            &mut fds,
            PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(KeeperError::Poll(e)),
        }
        let readable = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
        if readable(&fds[0]) {
            while let Ok(Some(info)) = signals.read_signal() {
                if matches!(
                    Signal::try_from(info.ssi_signo as i32),
                    Ok(Signal::SIGTERM | Signal::SIGINT)
                ) {
                    info!("socket keeper stopping");
                    return Ok(0);
                }
            }
        }
        if fds[1..].iter().any(readable) {
            drop(fds);
            for e in parked.accept_all(&listener.fd) {
                warn!(error = %e, "keeper offer refused");
            }
            let Some(h) = &held else {
                // Closing the connection tells the peer there is nothing to take.
                if parked.fds().next().is_some() {
                    warn!("an agent asked for the node sockets before the keeper held any");
                }
                parked.clear();
                continue;
            };
            for answer in parked.answer_ready(h.generation, &h.listeners) {
                match answer {
                    Ok(_) => info!(
                        generation = h.generation,
                        "offered the kept node sockets to an agent"
                    ),
                    Err(e) => warn!(error = %e, "keeper offer refused"),
                }
            }
        }
    }
}

/// Takes the owner's current offer, if an owner answers. With none (the node between
/// generations) the keeper keeps what it holds: that is what it is for.
fn fetch(cfg: &Config, held: &mut Option<Held>) {
    let at = |name| cfg.run_dir.join(name);
    match handoff::fetch(&at("handoff.sock"), &at("xds.sock"), &at("cni.sock"), true) {
        Ok(Some(h)) => {
            let changed = held.as_ref().is_none_or(|old| {
                (old.listeners.paths, old.generation) != (h.listeners.paths, h.generation)
            });
            if changed {
                info!(
                    generation = h.generation,
                    "keeping the owner's node sockets"
                );
            }
            *held = Some(h);
        }
        Ok(None) => {}
        Err(e) => warn!(error = %e, "fetching the owner's sockets failed; keeping what is held"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// Capabilities are per thread: the test drops them on a thread of its own.
    #[test]
    fn the_keeper_drops_every_capability() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root's capabilities to drop (CI runs as root)");
            return;
        }
        std::thread::spawn(|| {
            assert!(
                !caps::read(None, caps::CapSet::Permitted)
                    .unwrap()
                    .is_empty(),
                "the test needs a capability to start with"
            );
            drop_capabilities().unwrap();
            for set in [
                caps::CapSet::Effective,
                caps::CapSet::Permitted,
                caps::CapSet::Inheritable,
                caps::CapSet::Ambient,
                caps::CapSet::Bounding,
            ] {
                assert!(caps::read(None, set).unwrap().is_empty(), "{set:?}");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_run_folder_is_created_and_one_that_others_can_write_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let run = dir.path().join("run/aether");
        check_run_dir(&run, me).expect("a missing folder is created");
        assert!(run.is_dir());
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_run_dir(&run, me)
            .expect_err("a world-writable folder")
            .to_string();
        assert!(
            err.contains(&run.display().to_string()) && err.contains("777"),
            "{err}"
        );
        let err = check_run_dir(&run, me + 1)
            .expect_err("another uid's folder")
            .to_string();
        assert!(err.contains(&format!("uid {}", me + 1)), "{err}");
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        assert!(
            check_run_dir(&file, me).is_err(),
            "a regular file was taken for the run folder"
        );
        // A run folder in a folder that others may write is refused by that folder's
        // name, before anything is created in it.
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = check_run_dir(&open.join("run"), me)
            .expect_err("a run folder in a 0777 folder")
            .to_string();
        assert!(
            err.contains(&format!("lies in {}", open.display())),
            "{err}"
        );
        assert!(
            !open.join("run").exists(),
            "the refused run folder was created"
        );
    }
}
