//! The node sockets: checking a path for a live server, and checking that a listener
//! handed over by the previous generation, the socket keeper or systemd is still the one
//! bound at its path, by the kernel's record of its bind (`sockdiag`).
//!
//! Binding a fresh listener is `shared_proto::handoff::bind_fresh`, which the socket
//! keeper uses too: a path is replaced only when `lstat` shows a socket file (and this
//! supervisor has found its server gone, [`live_server`]); a symlink, a regular file or
//! anything else is refused and left untouched. Modes and owners are set explicitly after
//! bind, and the process umask is 0077 from start, so the file is never more open than
//! asked, even for an instant.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

pub use shared_proto::handoff::{BindError, Bound, FileId, bind_fresh};

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(transparent)]
    Bind(#[from] BindError),
    #[error("{path}: a live server still answers there (a predecessor that holds no lock?)")]
    LiveServer { path: PathBuf },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(transparent)]
    Check(#[from] shared_proto::fdcheck::FdError),
    #[error("{path} is no longer a socket")]
    Gone { path: PathBuf },
    #[error("{path} was replaced since the handoff (inode {now} now, {then} then)")]
    Replaced { path: PathBuf, now: u64, then: u64 },
    #[error("{what}: the kernel cannot say which file it is bound to: {source}")]
    Diag {
        what: &'static str,
        source: super::sockdiag::DiagError,
    },
    #[error(
        "{what} is not bound to {path} any more: the kernel says inode {bound}, the path is inode {now}"
    )]
    NotBoundThere {
        what: &'static str,
        path: PathBuf,
        bound: u64,
        now: u64,
    },
}

/// Whether a server accepts on `path`. A refused dial (a stale file of a dead server) or
/// a missing path means no.
pub fn live_server(path: &Path) -> Result<bool, ListenError> {
    match UnixStream::connect(path) {
        Ok(_) => Ok(true),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ECONNREFUSED) | Some(libc::ENOENT)
            ) =>
        {
            Ok(false)
        }
        Err(source) => Err(ListenError::Io {
            what: "dial",
            path: path.to_owned(),
            source,
        }),
    }
}

/// Checks that `fd` is a listening stream socket bound to `path`, and that `path` names
/// the very file its bind created: the device and inode the kernel records for the
/// socket (sock_diag) are the path's now. Returns that file's identity.
pub fn listener_at(what: &'static str, fd: &OwnedFd, path: &Path) -> Result<FileId, ListenError> {
    shared_proto::fdcheck::check_listener(what, fd, path)?;
    let bound = super::sockdiag::bound_file(fd.as_fd())
        .map_err(|source| ListenError::Diag { what, source })?;
    let m = std::fs::symlink_metadata(path).map_err(|source| ListenError::Io {
        what: "lstat",
        path: path.to_owned(),
        source,
    })?;
    if !m.file_type().is_socket() {
        return Err(ListenError::Gone {
            path: path.to_owned(),
        });
    }
    // The kernel reports the low 32 bits of the inode.
    if bound.dev != m.dev() || bound.ino != u64::from(m.ino() as u32) {
        return Err(ListenError::NotBoundThere {
            what,
            path: path.to_owned(),
            bound: bound.ino,
            now: m.ino(),
        });
    }
    Ok(FileId {
        dev: m.dev(),
        ino: m.ino(),
    })
}

/// Checks a listener handed over by the previous generation: [`listener_at`], and `path`
/// still names the file it was bound to (`then`, as the previous owner recorded it at
/// bind).
pub fn verify_held(fd: &OwnedFd, path: &Path, then: FileId) -> Result<(), ListenError> {
    let now = listener_at("held listener", fd, path)?;
    if now != then {
        return Err(ListenError::Replaced {
            path: path.to_owned(),
            now: now.ino,
            then: then.ino,
        });
    }
    Ok(())
}
