//! The node lock: an exclusive `flock(2)` on `<run-dir>/agent.lock`.
//!
//! Holding it is owning the node. The kernel releases it when the last descriptor of its
//! open file description closes, however the owning generation died, so a standby that
//! blocks on it wakes the instant the node is free. The file also records the node
//! generation, written by each new owner.
//!
//! The lock is taken on a read-only descriptor, and that same descriptor goes to the
//! worker at takeover, so both hold one lock (a second open would get a lock of its own,
//! which conflicts with it). The worker can keep the node, but it cannot write or grow
//! the file. The generation is written through a second, write-only descriptor that the
//! supervisor keeps to itself.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("open lock file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lock file {path} was replaced while it was opened; refusing it")]
    Replaced { path: PathBuf },
    #[error("lock file {path} must be a regular file of uid {me}, but is {what}; refusing it")]
    NotOurs {
        path: PathBuf,
        me: u32,
        what: String,
    },
    #[error("lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("generation in {path}: {source}")]
    Generation {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The lock, once held.
#[derive(Debug)]
pub struct Held {
    /// Read-only; shared with the worker.
    pub file: File,
    /// Time spent blocked on the lock.
    pub waited: Duration,
    /// True when the lock was free at the first try: an uncontended start.
    pub uncontended: bool,
}

/// The write-only descriptor of the lock file, for the generation record.
#[derive(Debug)]
pub struct Generation {
    file: File,
    path: PathBuf,
}

/// Opens the lock file (creating it 0600, never through a symlink) twice: read-only, the
/// descriptor to lock and share with the worker, and write-only for [`Generation`]. Both
/// must name one file: a regular file of this process's uid. `O_NONBLOCK` keeps a FIFO at
/// the path from hanging the open. A mode that lets others open it (and hold the lock, or
/// stall a takeover) is set back to 0600.
pub fn open(path: &Path) -> Result<(File, Generation), LockError> {
    let open_err = |source| LockError::Open {
        path: path.to_owned(),
        source,
    };
    let flags = libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;
    let writer = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(flags)
        .open(path)
        .map_err(open_err)?;
    let reader = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(open_err)?;
    let (r, w) = (
        reader.metadata().map_err(open_err)?,
        writer.metadata().map_err(open_err)?,
    );
    if (r.dev(), r.ino()) != (w.dev(), w.ino()) {
        return Err(LockError::Replaced {
            path: path.to_owned(),
        });
    }
    let (me, mode) = (nix::unistd::geteuid().as_raw(), w.mode() & 0o7777);
    if !w.is_file() || w.uid() != me {
        let what = format!("{:?} of uid {} with mode {mode:o}", w.file_type(), w.uid());
        return Err(LockError::NotOurs {
            path: path.to_owned(),
            me,
            what,
        });
    }
    if mode != 0o600 {
        tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "the lock file's mode let others open it; set to 0600");
        writer
            .set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(open_err)?;
    }
    Ok((
        reader,
        Generation {
            file: writer,
            path: path.to_owned(),
        },
    ))
}

/// Starts the thread that blocks on the lock. When it gets the lock it sends it on the
/// returned channel and writes one byte to `wake`, which the event loop polls.
pub fn spawn_waiter(
    file: File,
    path: PathBuf,
    wake: UnixStream,
) -> mpsc::Receiver<Result<Held, LockError>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("node-lock".into())
        .spawn(move || {
            let start = Instant::now();
            let result = match file.try_lock() {
                Ok(()) => Ok(true),
                Err(std::fs::TryLockError::WouldBlock) => file.lock().map(|()| false),
                Err(std::fs::TryLockError::Error(e)) => Err(e),
            };
            let held = result
                .map(|uncontended| Held {
                    file,
                    waited: start.elapsed(),
                    uncontended,
                })
                .map_err(|source| LockError::Lock { path, source });
            // The receiver only goes away when the supervisor is exiting.
            let _ = tx.send(held);
            let _ = (&wake).write_all(b"L");
        })
        .expect("spawn the node-lock thread");
    rx
}

impl Generation {
    /// Reads the previous owner's generation through the held lock and writes the next
    /// one. Returns the new one.
    pub fn bump(&self, lock: &File) -> Result<u64, LockError> {
        let err = |source| LockError::Generation {
            path: self.path.clone(),
            source,
        };
        let mut buf = [0u8; 64];
        // A corrupt or empty record counts as generation 0: the lock, not the number, is
        // what fences owners, and the number is only for operators.
        let n = lock.read_at(&mut buf, 0).unwrap_or(0);
        let previous: u64 = std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|t| t.lines().next()?.trim().parse().ok())
            .unwrap_or(0);
        // A forged u64::MAX must not overflow.
        let next = previous.saturating_add(1);
        // Write, then cut: killed in between, the record still starts with a number's line.
        let record = format!("{next}\n");
        self.file.write_all_at(record.as_bytes(), 0).map_err(err)?;
        self.file.set_len(record.len() as u64).map_err(err)?;
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bump(record: &str) -> u64 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        std::fs::write(&path, record).unwrap();
        let (lock, generation) = open(&path).unwrap();
        let next = generation.bump(&lock).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{next}\n"));
        next
    }

    #[test]
    fn the_generation_counts_up_and_saturates_on_a_forged_maximum() {
        assert_eq!(bump(""), 1);
        assert_eq!(bump("41\n"), 42);
        assert_eq!(bump("garbage"), 1);
        // A kill between the write and the cut leaves the old tail after the first line.
        assert_eq!(bump("7\n99\n"), 8);
        assert_eq!(bump(&u64::MAX.to_string()), u64::MAX);
    }

    #[test]
    fn the_shared_lock_descriptor_is_read_only_and_conflicts_with_a_second_open() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        let (lock, generation) = open(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        lock.lock().unwrap();
        // What the worker gets cannot write, truncate or grow the file.
        assert!((&lock).write_all(b"1").is_err());
        assert!(lock.set_len(1 << 30).is_err());
        assert!(lock.write_all_at(b"9", 100).is_err());
        // The flock is the description's: a second open of the file is another lock,
        // which conflicts; a duplicate of the descriptor (what the worker holds) is the
        // same one.
        let (other, _) = open(&path).unwrap();
        assert!(matches!(
            other.try_lock(),
            Err(std::fs::TryLockError::WouldBlock)
        ));
        let shared = lock.try_clone().unwrap();
        drop(lock);
        assert!(
            matches!(other.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
            "the duplicate keeps the lock"
        );
        assert_eq!(generation.bump(&shared).unwrap(), 1);
        drop(shared);
        other.try_lock().unwrap();
        // A symlink is never followed.
        let link = dir.path().join("link.lock");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(matches!(open(&link), Err(LockError::Open { .. })));
    }

    /// Only a regular file of the supervisor's uid is a lock file: a FIFO at the path is
    /// refused at once rather than hanging the open, a folder is refused by name, and a
    /// mode others could open is set back to 0600.
    #[test]
    fn a_lock_file_that_is_no_regular_file_is_refused_and_a_loose_mode_is_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.lock");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let err = open(&fifo).unwrap_err().to_string();
        assert!(err.contains("fifo.lock"), "{err}");
        let folder = dir.path().join("folder.lock");
        std::fs::create_dir(&folder).unwrap();
        let err = open(&folder).unwrap_err().to_string();
        assert!(err.contains("folder.lock"), "{err}");
        let loose = dir.path().join("agent.lock");
        std::fs::write(&loose, "3\n").unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o666)).unwrap();
        let (lock, generation) = open(&loose).unwrap();
        assert_eq!(std::fs::metadata(&loose).unwrap().mode() & 0o7777, 0o600);
        assert_eq!(generation.bump(&lock).unwrap(), 4);
        if nix::unistd::geteuid().is_root() {
            let theirs = dir.path().join("theirs.lock");
            std::fs::write(&theirs, "").unwrap();
            std::os::unix::fs::chown(&theirs, Some(1000), Some(1000)).unwrap();
            let err = open(&theirs).unwrap_err().to_string();
            assert!(
                err.contains("theirs.lock") && err.contains("uid 1000"),
                "{err}"
            );
        }
    }
}
