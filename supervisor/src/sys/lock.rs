//! The node lock: an exclusive `flock(2)` on `<run-dir>/agent.lock`.
//!
//! Holding it is owning the node. The kernel releases it when the last descriptor of its
//! open file description closes, however the owning generation died, so a standby that
//! blocks on it wakes the instant the node is free. The file also records the node
//! generation, written by each new owner.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("open lock file {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("lock {path}: {source}")]
    Lock { path: PathBuf, source: std::io::Error },
    #[error("generation in {path}: {source}")]
    Generation { path: PathBuf, source: std::io::Error },
}

/// The lock, once held.
pub struct Held {
    pub file: File,
    /// Time spent blocked on the lock.
    pub waited: Duration,
    /// True when the lock was free at the first try: an uncontended start.
    pub uncontended: bool,
}

/// Opens the lock file (never through a symlink) with mode 0600.
pub fn open(path: &Path) -> Result<File, LockError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| LockError::Open { path: path.to_owned(), source })
}

/// Starts the thread that blocks on the lock. When it gets the lock it sends it on the
/// returned channel and writes one byte to `wake`, which the event loop polls.
pub fn spawn_waiter(file: File, path: PathBuf, wake: UnixStream) -> mpsc::Receiver<Result<Held, LockError>> {
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
                .map(|uncontended| Held { file, waited: start.elapsed(), uncontended })
                .map_err(|source| LockError::Lock { path, source });
            // The receiver only goes away when the supervisor is exiting.
            let _ = tx.send(held);
            let _ = (&wake).write_all(b"L");
        })
        .expect("spawn the node-lock thread");
    rx
}

/// Reads the previous owner's generation and writes the next one. Returns the new one.
pub fn bump_generation(file: &mut File, path: &Path) -> Result<u64, LockError> {
    let err = |source| LockError::Generation { path: path.to_owned(), source };
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).map_err(err)?;
    // A corrupt or empty record counts as generation 0: the lock, not the number, is
    // what fences owners, and the number is only for operators.
    let _ = file.take(64).read_to_string(&mut text);
    let previous: u64 = text.trim().parse().unwrap_or(0);
    // A forged u64::MAX (the worker holds the lock fd) must not overflow.
    let next = previous.saturating_add(1);
    file.set_len(0).map_err(err)?;
    file.seek(SeekFrom::Start(0)).map_err(err)?;
    file.write_all(format!("{next}\n").as_bytes()).map_err(err)?;
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bump(record: &str) -> u64 {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.lock");
        std::fs::write(&path, record).unwrap();
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let next = bump_generation(&mut f, &path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{next}\n"));
        next
    }

    #[test]
    fn the_generation_counts_up_and_saturates_on_a_forged_maximum() {
        assert_eq!(bump(""), 1);
        assert_eq!(bump("41\n"), 42);
        assert_eq!(bump("garbage"), 1);
        assert_eq!(bump(&u64::MAX.to_string()), u64::MAX);
    }
}
