//! Why a standby waits. A standby's supervisor blocks on the node lock; normally the
//! owner's supervisor holds it, and the wait is the design. When something else holds it
//! (an operator's `flock`, a stuck tool), nothing would ever say so: this task names the
//! holder, from the kernel's lock table (`/proc/locks`), in a warn line and as a `/ready`
//! problem (`node-lock`), and clears the problem once this worker owns the node.
//!
//! Read only; it needs no privilege (`/proc/locks` and `/proc/<pid>/comm` are world
//! readable). A holder in another pid namespace shows as pid 0 and is named as such.
//!
//! Reading `/proc/locks` is not free: the kernel takes its file-lock semaphore for writing
//! (an RCU grace period, 8 to 27 ms measured here), and every `flock` on the node, the
//! supervisors' lock and release at a takeover included, waits meanwhile. So a standby
//! looks only once it has waited [`EVERY`], which a standby behind an agent seldom does
//! (a respawned worker never: its supervisor already holds the lock), and off the
//! runtime thread.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::watch;
use tracing::warn;

use crate::health::{Reporter, Status};

/// How long a standby waits before it first looks, and then between looks.
const EVERY: Duration = Duration::from_secs(5);
/// The supervisor's `comm` (the kernel keeps the first 15 bytes of the name).
const SUPERVISOR_COMM: &str = "aether-supervis";

/// One lock of `/proc/locks`: who holds it and on which file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub pid: u32,
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
}

/// The locks granted in a `/proc/locks` text (waiters, `->` lines, left out). A line the
/// kernel's format does not explain is skipped.
pub fn parse_locks(text: &str) -> Vec<Held> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let _index = fields.next()?;
            let kind = fields.next()?;
            if kind == "->" {
                return None;
            }
            let (_mode, _access) = (fields.next()?, fields.next()?);
            let pid = fields.next()?.parse().ok()?;
            let mut id = fields.next()?.split(':');
            let major = u32::from_str_radix(id.next()?, 16).ok()?;
            let minor = u32::from_str_radix(id.next()?, 16).ok()?;
            let inode = id.next()?.parse().ok()?;
            Some(Held {
                pid,
                major,
                minor,
                inode,
            })
        })
        .collect()
}

/// The pid holding a lock on `lock_file`, by its device and inode.
fn holder(lock_file: &Path) -> std::io::Result<Option<u32>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(lock_file)?;
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let locks = std::fs::read_to_string("/proc/locks")?;
    Ok(parse_locks(&locks)
        .into_iter()
        .find(|h| (h.major, h.minor, h.inode) == (major, minor, meta.ino()))
        .map(|h| h.pid))
}

/// The message for a holder that is not an agent's supervisor; `None` for one that is.
pub fn describe(lock_file: &Path, pid: u32, comm: Option<&str>) -> Option<String> {
    match (pid, comm) {
        (_, Some(SUPERVISOR_COMM)) => None,
        (0, _) => Some(format!(
            "the node lock {} is held by a process outside this pid namespace; waiting for it to exit",
            lock_file.display()
        )),
        (pid, Some(comm)) => Some(format!(
            "the node lock {} is held by pid {pid} ({comm}), which is not an Aether agent; waiting for it to exit",
            lock_file.display()
        )),
        (pid, None) => Some(format!(
            "the node lock {} is held by pid {pid}; waiting for it to exit",
            lock_file.display()
        )),
    }
}

/// What a look at the lock says: why this standby waits, when it is not the design.
fn look(lock_file: &Path) -> Option<String> {
    match holder(lock_file) {
        Ok(Some(pid)) => {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok();
            describe(lock_file, pid, comm.as_deref().map(str::trim))
        }
        // Free, or the file is not there yet: the supervisor is about to lock it.
        Ok(None) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!(
            "cannot tell who holds the node lock {}: {e}",
            lock_file.display()
        )),
    }
}

/// Looks every [`EVERY`], the first after one, while this worker is not the owner.
pub fn spawn(
    run_dir: &Path,
    mut status: watch::Receiver<Status>,
    problems: Reporter,
) -> tokio::task::JoinHandle<()> {
    let lock_file: PathBuf = run_dir.join("agent.lock");
    tokio::spawn(async move {
        let mut said: Option<String> = None;
        let mut next = tokio::time::Instant::now() + EVERY;
        loop {
            if status.borrow_and_update().role == "owner" {
                problems.clear("node-lock");
                return;
            }
            // Any change of the status is a new chance to see this worker own the node.
            tokio::select! {
                _ = tokio::time::sleep_until(next) => next += EVERY,
                changed = status.changed() => if changed.is_err() { return } else { continue },
            }
            let file = lock_file.clone();
            let Ok(now) = tokio::task::spawn_blocking(move || look(&file)).await else {
                return;
            };
            if now != said {
                match &now {
                    Some(message) => {
                        warn!(lock = %lock_file.display(), "{message}");
                        problems.set("node-lock", message.clone());
                    }
                    None => problems.clear("node-lock"),
                }
                said = now;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granted_locks_are_read_and_waiters_and_odd_lines_skipped() {
        let text = "\
1: FLOCK  ADVISORY  WRITE 4242 00:1a:1234567 0 EOF
1: -> FLOCK  ADVISORY  WRITE 4343 00:1a:1234567 0 EOF
2: POSIX  ADVISORY  READ 17 fd:01:99 0 EOF
garbage
3: FLOCK  ADVISORY  WRITE notapid 00:1a:1 0 EOF
";
        assert_eq!(
            parse_locks(text),
            [
                Held {
                    pid: 4242,
                    major: 0,
                    minor: 0x1a,
                    inode: 1234567
                },
                Held {
                    pid: 17,
                    major: 0xfd,
                    minor: 1,
                    inode: 99
                }
            ]
        );
    }

    #[test]
    fn an_agent_holder_is_the_design_anything_else_is_named() {
        let lock = Path::new("/run/aether/agent.lock");
        assert_eq!(describe(lock, 10, Some("aether-supervis")), None);
        let other = describe(lock, 10, Some("flock")).expect("named");
        assert!(
            other.contains("/run/aether/agent.lock") && other.contains("pid 10 (flock)"),
            "{other}"
        );
        assert!(
            describe(lock, 0, None)
                .expect("named")
                .contains("outside this pid namespace")
        );
    }

    #[test]
    fn the_holder_of_a_real_flock_is_found_by_device_and_inode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        let file = std::fs::File::create(&path).unwrap();
        assert_eq!(holder(&path).unwrap(), None, "nobody holds it yet");
        file.lock().unwrap();
        assert_eq!(holder(&path).unwrap(), Some(std::process::id()));
        file.unlock().unwrap();
        assert_eq!(holder(&path).unwrap(), None);
    }
}
