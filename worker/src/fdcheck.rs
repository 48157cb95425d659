//! Checks on the descriptors of a `Takeover`: the lock is a regular file, and each
//! listener is a listening unix stream socket bound to its path under the run dir.

use std::os::fd::OwnedFd;
use std::path::Path;

use shared_proto::fdcheck::{FdError, check_listener, check_regular_file};

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
    check_regular_file("node lock", &lock)?;
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
        let lock = || OwnedFd::from(std::fs::File::create(d.join("agent.lock")).expect("lock file"));
        let ok = check(d, vec![lock(), listener(d, "xds.sock"), listener(d, "cni.sock")]);
        assert!(ok.is_ok(), "{:?}", ok.err());

        let other = tempfile::tempdir().expect("tempdir");
        let cases: Vec<(Vec<OwnedFd>, &str)> = vec![
            (vec![listener(other.path(), "l"), listener(other.path(), "x1.sock"), listener(other.path(), "c1.sock")], "node lock: descriptor is not a regular file"),
            (vec![lock(), lock(), listener(other.path(), "c2")], "xds.sock: descriptor is not a socket"),
            (vec![lock(), OwnedFd::from(UnixDatagram::bind(other.path().join("dg")).expect("dgram")), lock()], "xds.sock: descriptor is not a stream socket"),
            (vec![lock(), listener(other.path(), "xds.sock"), lock()], "xds.sock: socket is bound to"),
        ];
        for (fds, want) in cases {
            let err = check(d, fds).err().expect("must be rejected").to_string();
            assert!(err.contains(want), "got {err:?}, want {want:?}");
        }
        // A connected, non-listening stream socket.
        let (a, _b) = std::os::unix::net::UnixStream::pair().expect("pair");
        let err = check(d, vec![lock(), OwnedFd::from(a), lock()]).err().expect("rejected").to_string();
        assert!(err.contains("not listening"), "{err}");
    }
}
