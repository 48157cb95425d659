//! `aether-cni uninstall`: takes `aether-cni` off the node once the agent is gone for good.
//!
//! Run by the chart's post-delete hook (one pod per node, after Helm deleted the agent's
//! DaemonSet), never by an agent and never on a signal: a roll sends SIGTERM too, and a
//! roll must leave the node's chain as it is. It waits for the node lock, so that no
//! owner is left to append the entry again (the agent being uninstalled may still be
//! draining), removes the entry from the CNI conf folder's configurations (the
//! same atomic rewrite as the owner's re-assertion), then the plugin binary, and exits holding the lock.
//! The entry goes first: an entry without its binary would fail every pod's ADD, a
//! binary without its entry is never run. Needs no capability: the files, their folders
//! and the lock are root's, and so is this process in the chart.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;

use shared_proto::conflist;
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("the node lock {}: {source}", path.display())]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: an agent still holds the node after {bound:?}; nothing removed", path.display())]
    Held { path: PathBuf, bound: Duration },
    #[error(transparent)]
    Conflist(#[from] conflist::Error),
    #[error("removing {}: {source}", path.display())]
    Binary {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How long to wait for the agent on this node to let the node go: its grace period
/// (30 s in the chart) and then some. Past it the run fails, and the pod's restart
/// tries again.
pub const LOCK_BOUND: Duration = Duration::from_secs(120);

/// What one run did.
#[derive(Debug, PartialEq, Eq)]
pub struct Removed {
    pub conflists: Vec<PathBuf>,
    pub binary: Option<PathBuf>,
}

/// Takes the node lock (waiting up to `bound`), removes the entry from every conflist
/// in `conf_dir` and `aether-cni` from `bin_dir`. The lock is released when the returned
/// file closes.
pub fn run(
    run_dir: &Path,
    conf_dir: &Path,
    bin_dir: &Path,
    bound: Duration,
) -> Result<(Removed, File), UninstallError> {
    let lock_path = run_dir.join("agent.lock");
    let file = open_lock(&lock_path).map_err(|source| UninstallError::Lock {
        path: lock_path.clone(),
        source,
    })?;
    let start = Instant::now();
    let mut said = false;
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < bound => {
                if !said {
                    info!(lock = %lock_path.display(), "an agent still holds the node; waiting for it to exit");
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(UninstallError::Held {
                    path: lock_path,
                    bound,
                });
            }
            Err(std::fs::TryLockError::Error(source)) => {
                return Err(UninstallError::Lock {
                    path: lock_path,
                    source,
                });
            }
        }
    }
    let conflists = conflist::remove(conf_dir)?;
    for path in &conflists {
        info!(file = %path.display(), "removed the aether-cni entry");
    }
    let plugin = bin_dir.join(conflist::PLUGIN_TYPE);
    let binary = match std::fs::remove_file(&plugin) {
        Ok(()) => {
            info!(file = %plugin.display(), "removed the plugin binary");
            Some(plugin)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(UninstallError::Binary {
                path: plugin,
                source,
            });
        }
    };
    if conflists.is_empty() && binary.is_none() {
        warn!(conf_dir = %conf_dir.display(), bin_dir = %bin_dir.display(), "nothing to remove: aether-cni was not installed here");
    }
    Ok((Removed { conflists, binary }, file))
}

/// The node lock file, as the supervisor makes it (0600, never through a symlink). Its
/// lock is the flock of this open file description, which conflicts with the agent's.
fn open_lock(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAINED: &str = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp"},{"type":"aether-cni","agentSocket":"/run/aether/cni.sock"}]}"#;

    #[test]
    fn waits_for_the_owner_then_removes_the_entry_and_the_binary() {
        let root = tempfile::tempdir().unwrap();
        let (run_dir, conf, bin) = (
            root.path().join("run"),
            root.path().join("net.d"),
            root.path().join("bin"),
        );
        for d in [&run_dir, &conf, &bin] {
            std::fs::create_dir(d).unwrap();
        }
        std::fs::write(conf.join("10-ptp.conflist"), CHAINED).unwrap();
        std::fs::write(bin.join("aether-cni"), "plugin").unwrap();
        std::fs::write(bin.join("ptp"), "other plugin").unwrap();

        // An owner holds the node: nothing may be removed until it lets go.
        let owner = open_lock(&run_dir.join("agent.lock")).unwrap();
        owner.lock().unwrap();
        let err = run_checked(&run_dir, &conf, &bin, Duration::from_millis(300)).unwrap_err();
        assert!(err.contains("an agent still holds the node"), "{err}");
        assert!(
            std::fs::read_to_string(conf.join("10-ptp.conflist"))
                .unwrap()
                .contains("aether-cni")
        );
        assert!(bin.join("aether-cni").exists());

        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(owner);
        });
        let started = Instant::now();
        let (removed, held) = run(&run_dir, &conf, &bin, Duration::from_secs(10)).unwrap();
        release.join().unwrap();
        assert!(
            started.elapsed() >= Duration::from_millis(150),
            "did not wait for the owner"
        );
        assert_eq!(
            removed,
            Removed {
                conflists: vec![conf.join("10-ptp.conflist")],
                binary: Some(bin.join("aether-cni"))
            }
        );
        assert!(
            !std::fs::read_to_string(conf.join("10-ptp.conflist"))
                .unwrap()
                .contains("aether-cni")
        );
        assert!(!bin.join("aether-cni").exists() && bin.join("ptp").exists());

        // A second run (a restarted pod) finds nothing left and succeeds.
        drop(held);
        let (again, _) = run(&run_dir, &conf, &bin, Duration::from_secs(1)).unwrap();
        assert_eq!(
            again,
            Removed {
                conflists: vec![],
                binary: None
            }
        );
    }

    fn run_checked(run_dir: &Path, conf: &Path, bin: &Path, bound: Duration) -> Result<(), String> {
        super::run(run_dir, conf, bin, bound)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
