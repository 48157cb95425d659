//! The owner's re-assertion of the node's CNI conflist (`--cni-conf-dir`), run as a
//! process of its own: `aether-cni chain`, which appends the `aether-cni` entry to the
//! runtime's conflist when it is missing (`shared_proto::conflist`). The supervisor never
//! opens or parses the file, so a hostile or stuck file costs it nothing.
//!
//! The executable is opened at start and run from that descriptor (`/proc/self/fd/N`), as
//! root with the supervisor's capabilities and an empty environment. At most one runs; one
//! still running at the next check is killed, and one still running when the supervisor
//! dies dies with it (`sys::spawn::die_with_me`). It logs for itself, on the supervisor's
//! stderr; its exit is reaped with the worker's (SIGCHLD).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use tracing::{error, warn};

use crate::lifecycle::CONFLIST_EVERY;

pub struct Chain {
    exe: File,
    path: PathBuf,
    conf_dir: PathBuf,
    agent_socket: PathBuf,
    log_format: String,
    /// The check that runs: its pid, since when, and whether it was killed.
    running: Option<(Pid, Instant, bool)>,
}

impl Chain {
    pub fn open(
        exe: &Path,
        conf_dir: &Path,
        agent_socket: &Path,
        log_format: &str,
    ) -> std::io::Result<Self> {
        let file = File::open(exe).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("opening the conflist re-asserter {}: {e}", exe.display()),
            )
        })?;
        Ok(Self {
            exe: file,
            path: exe.to_owned(),
            conf_dir: conf_dir.to_owned(),
            agent_socket: agent_socket.to_owned(),
            log_format: log_format.to_owned(),
            running: None,
        })
    }

    /// Starts a check, unless one runs; kills one that has run for [`CONFLIST_EVERY`].
    pub fn check(&mut self) {
        if let Some((pid, since, killed)) = &mut self.running {
            if !*killed && since.elapsed() >= CONFLIST_EVERY {
                warn!(
                    pid = pid.as_raw(),
                    "the conflist check has run for {CONFLIST_EVERY:?}; killing it"
                );
                *killed = kill(*pid, Signal::SIGKILL).is_ok();
            }
            return;
        }
        let mut cmd = Command::new(format!("/proc/self/fd/{}", self.exe.as_raw_fd()));
        let child = crate::sys::spawn::die_with_me(&mut cmd)
            .arg0("aether-cni")
            .arg("chain")
            .arg("--cni-conf-dir")
            .arg(&self.conf_dir)
            .arg("--agent-socket")
            .arg(&self.agent_socket)
            .arg("--log-format")
            .arg(&self.log_format)
            .env_clear()
            .stdin(Stdio::null())
            .spawn();
        match child {
            // Dropping the handle neither waits nor kills: SIGCHLD reaps it.
            Ok(c) => self.running = Some((Pid::from_raw(c.id() as i32), Instant::now(), false)),
            Err(e) => {
                error!(error = %e, exe = %self.path.display(), "cannot run the conflist check")
            }
        }
    }

    /// Whether the child reaped with `status` was the check; logs how a failed one ended.
    pub fn reaped(&mut self, status: &WaitStatus) -> bool {
        let ours = self
            .running
            .is_some_and(|(pid, ..)| status.pid() == Some(pid));
        if ours {
            self.running = None;
            if !matches!(status, WaitStatus::Exited(_, 0)) {
                error!(status = ?status, conf_dir = %self.conf_dir.display(), "the conflist check failed (its own log line says why)");
            }
        }
        ours
    }
}
