//! Checks on a received descriptor before anyone trusts it: both the worker (on
//! `Takeover`) and a standby supervisor (on a handoff offer) run them.

use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use nix::sys::socket::{
    AddressFamily, SockType, SockaddrLike, UnixAddr, getsockname, getsockopt, sockopt,
};
use nix::sys::stat::{SFlag, fstat};

#[derive(Debug, thiserror::Error)]
pub enum FdError {
    #[error("{what}: descriptor is not a {expected}")]
    WrongType {
        what: &'static str,
        expected: &'static str,
    },
    #[error("{what}: socket is not listening")]
    NotListening { what: &'static str },
    #[error("{what}: socket is bound to {got:?}, expected {expected}")]
    WrongPath {
        what: &'static str,
        got: Option<String>,
        expected: String,
    },
    #[error(
        "{what}: the descriptor is not the file at {path} (another file, or one put in its place since it was opened)"
    )]
    NotTheFile { what: &'static str, path: String },
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        source: nix::Error,
    },
}

/// Checks that `fd` is a listening unix stream socket bound to `path`.
pub fn check_listener(what: &'static str, fd: impl AsFd, path: &Path) -> Result<(), FdError> {
    let fd = fd.as_fd();
    let st = fstat(fd).map_err(|source| FdError::Sys { what, source })?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFSOCK {
        return Err(FdError::WrongType {
            what,
            expected: "socket",
        });
    }
    let kind =
        getsockopt(&fd, sockopt::SockType).map_err(|source| FdError::Sys { what, source })?;
    if kind != SockType::Stream {
        return Err(FdError::WrongType {
            what,
            expected: "stream socket",
        });
    }
    if !getsockopt(&fd, sockopt::AcceptConn).map_err(|source| FdError::Sys { what, source })? {
        return Err(FdError::NotListening { what });
    }
    let addr: UnixAddr =
        getsockname(fd.as_raw_fd()).map_err(|source| FdError::Sys { what, source })?;
    let got = addr.path();
    if addr.family() != Some(AddressFamily::Unix) || got != Some(path) {
        return Err(FdError::WrongPath {
            what,
            got: got.map(|p| p.display().to_string()),
            expected: path.display().to_string(),
        });
    }
    Ok(())
}

/// Checks that `fd` is the regular file at `path` (the node lock: a lock taken on any
/// other file would not keep a second agent from the node).
pub fn check_regular_file_at(
    what: &'static str,
    fd: impl AsFd,
    path: &Path,
) -> Result<(), FdError> {
    let st = fstat(fd.as_fd()).map_err(|source| FdError::Sys { what, source })?;
    if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(FdError::WrongType {
            what,
            expected: "regular file",
        });
    }
    let at = nix::sys::stat::stat(path).map_err(|source| FdError::Sys { what, source })?;
    if (at.st_dev, at.st_ino) != (st.st_dev, st.st_ino) {
        return Err(FdError::NotTheFile {
            what,
            path: path.display().to_string(),
        });
    }
    Ok(())
}
