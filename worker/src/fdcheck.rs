//! Checks on the descriptors of a `Takeover`: the lock is the regular file `agent.lock`
//! under the run dir, and each listener is a listening unix stream socket bound to its
//! path under the run dir.

use std::os::fd::OwnedFd;
use std::path::Path;

use shared_proto::fdcheck::{FdError, check_listener, check_regular_file_at};

/// The three descriptors of a `Takeover`, checked.
pub struct TakeoverFds {
    pub lock: OwnedFd,
    pub xds: OwnedFd,
    pub cni: OwnedFd,
}

pub fn check(run_dir: &Path, mut fds: Vec<OwnedFd>) -> Result<TakeoverFds, FdError> {
    // The transport guarantees exactly three.
    let cni = fds.pop().expect("three descriptors");
    let xds = fds.pop().expect("three descriptors");
    let lock = fds.pop().expect("three descriptors");
    check_regular_file_at("node lock", &lock, &run_dir.join("agent.lock"))?;
    check_listener("xds.sock", &xds, &run_dir.join("xds.sock"))?;
    check_listener("cni.sock", &cni, &run_dir.join("cni.sock"))?;
    Ok(TakeoverFds { lock, xds, cni })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    fn listener(dir: &Path, name: &str) -> OwnedFd {
        OwnedFd::from(UnixListener::bind(dir.join(name)).expect("bind"))
    }

    #[test]
    fn accepts_the_right_descriptors_and_names_the_wrong_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let lock =
            || OwnedFd::from(std::fs::File::create(d.join("agent.lock")).expect("lock file"));
        let ok = check(
            d,
            vec![lock(), listener(d, "xds.sock"), listener(d, "cni.sock")],
        );
        assert!(ok.is_ok(), "{:?}", ok.err());

        let other = tempfile::tempdir().expect("tempdir");
        let cases: Vec<(Vec<OwnedFd>, &str)> = vec![
            (
                vec![
                    listener(other.path(), "l"),
                    listener(other.path(), "x1.sock"),
                    listener(other.path(), "c1.sock"),
                ],
                "node lock: descriptor is not a regular file",
            ),
            (
                vec![lock(), lock(), listener(other.path(), "c2")],
                "xds.sock: descriptor is not a socket",
            ),
            (
                vec![
                    lock(),
                    OwnedFd::from(UnixDatagram::bind(other.path().join("dg")).expect("dgram")),
                    lock(),
                ],
                "xds.sock: descriptor is not a stream socket",
            ),
            (
                vec![lock(), listener(other.path(), "xds.sock"), lock()],
                "xds.sock: socket is bound to",
            ),
        ];
        for (fds, want) in cases {
            let err = check(d, fds).err().expect("must be rejected").to_string();
            assert!(err.contains(want), "got {err:?}, want {want:?}");
        }
        // A connected, non-listening stream socket.
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("pair");
        let err = check(d, vec![lock(), OwnedFd::from(a), lock()])
            .err()
            .expect("rejected")
            .to_string();
        assert!(err.contains("not listening"), "{err}");
    }

    /// The lock must be this run dir's `agent.lock` itself: a regular file elsewhere, or
    /// the one a new file replaced at that path, takes no lock another agent would meet.
    #[test]
    fn the_lock_must_be_the_run_dirs_agent_lock() {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let other = tempfile::tempdir().expect("tempdir");
        let sockets = |n: &str| {
            (
                listener(d, &format!("xds{n}.sock")),
                listener(d, &format!("cni{n}.sock")),
            )
        };
        std::fs::write(d.join("agent.lock"), "").expect("the lock file");
        let elsewhere = OwnedFd::from(
            std::fs::File::create(other.path().join("agent.lock")).expect("another file"),
        );
        let replaced =
            OwnedFd::from(std::fs::File::open(d.join("agent.lock")).expect("open the lock"));
        std::fs::write(other.path().join("new"), "").expect("a new file");
        std::fs::rename(other.path().join("new"), d.join("agent.lock"))
            .expect("put it in the lock's place");
        let want = format!(
            "node lock: the descriptor is not the file at {}",
            d.join("agent.lock").display()
        );
        for (what, lock) in [
            ("a file elsewhere", elsewhere),
            ("the replaced lock", replaced),
        ] {
            // The listeners' paths do not matter here: the lock is checked first.
            let (x, c) = sockets(what.split(' ').nth(1).unwrap_or("x"));
            let err = check(d, vec![lock, x, c])
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.starts_with(&want), "{what}: got {err:?}, want {want:?}");
        }
        let current =
            OwnedFd::from(std::fs::File::open(d.join("agent.lock")).expect("open the lock"));
        let err = check(
            d,
            vec![current, listener(d, "xds.sock"), listener(d, "cni.sock")],
        )
        .err();
        assert!(err.is_none(), "the lock at the path now: {err:?}");
    }
}
