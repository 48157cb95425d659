//! The node sockets: checking a path for a live server, binding a fresh listener, and
//! checking that a listener handed over by the previous generation, the socket keeper or
//! systemd is still the one bound at its path, by the kernel's record of its bind
//! (`sockdiag`).
//!
//! A path is replaced only when `lstat` shows a socket file whose server is gone; a
//! symlink, a regular file or anything else is refused and left untouched. Modes and
//! owners are set explicitly after bind, and the process umask is 0077 from start, so
//! the file is never more open than asked, even for an instant.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, listen, socket};

/// Connects queue here while no worker accepts (a respawn, a takeover in progress). The
/// node's clients are one Envoy and one plugin process per CNI call; a plugin that finds
/// the backlog full waits in the kernel (a blocking connect bounded by its timeout), so a
/// burst of 1,000 concurrent calls gets through all the same. A short backlog bounds how
/// many of a flood's connections a plugin's connect queues behind (the worker closes
/// those for their rate, pausing after two backlogs' worth: `PAUSE_EVERY` in
/// `worker/src/accept.rs`).
pub const BACKLOG: i32 = 8;

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error("refusing to replace {path}: it is a {kind}, not a socket; remove it by hand if it is stale")]
    NotASocket { path: PathBuf, kind: &'static str },
    #[error("{path}: a live server still answers there (a predecessor that holds no lock?)")]
    LiveServer { path: PathBuf },
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: io::Error },
    #[error(transparent)]
    Check(#[from] shared_proto::fdcheck::FdError),
    #[error("{path} is no longer a socket")]
    Gone { path: PathBuf },
    #[error("{path} was replaced since the handoff (inode {now} now, {then} then)")]
    Replaced { path: PathBuf, now: u64, then: u64 },
    #[error("{what}: the kernel cannot say which file it is bound to: {source}")]
    Diag { what: &'static str, source: super::sockdiag::DiagError },
    #[error("{what} is not bound to {path} any more: the kernel says inode {bound}, the path is inode {now}")]
    NotBoundThere { what: &'static str, path: PathBuf, bound: u64, now: u64 },
}

/// Which file a path named: its device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// A bound, listening socket and the identity of its path.
pub struct Bound {
    pub fd: OwnedFd,
    pub id: FileId,
}

/// Whether a server accepts on `path`. A refused dial (a stale file of a dead server) or
/// a missing path means no.
pub fn live_server(path: &Path) -> Result<bool, ListenError> {
    match UnixStream::connect(path) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNREFUSED) | Some(libc::ENOENT)) => Ok(false),
        Err(source) => Err(ListenError::Io { what: "dial", path: path.to_owned(), source }),
    }
}

/// What is at `path`: nothing, a socket file (replaceable), or something we refuse.
fn check_replaceable(path: &Path) -> Result<bool, ListenError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ListenError::Io { what: "lstat", path: path.to_owned(), source }),
        Ok(m) => {
            let t = m.file_type();
            if t.is_socket() {
                return Ok(true);
            }
            let kind = if t.is_symlink() {
                "symlink"
            } else if t.is_file() {
                "regular file"
            } else if t.is_dir() {
                "directory"
            } else {
                "special file"
            };
            Err(ListenError::NotASocket { path: path.to_owned(), kind })
        }
    }
}

/// Binds a fresh listening socket at `path` with exactly `mode` and `owner`, replacing a
/// stale socket file. `kind` is the socket type (stream for the node sockets, seqpacket
/// for the handoff socket). The caller has checked that no live server answers there.
pub fn bind_fresh(path: &Path, kind: SockType, mode: u32, owner: (u32, u32)) -> Result<Bound, ListenError> {
    let io_err = |what, source| ListenError::Io { what, path: path.to_owned(), source };
    if check_replaceable(path)? {
        // Only a socket file reaches here; unlink does not follow symlinks anyway.
        std::fs::remove_file(path).map_err(|e| io_err("remove stale socket", e))?;
    }
    let fd = socket(AddressFamily::Unix, kind, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| io_err("socket", e.into()))?;
    let addr = UnixAddr::new(path).map_err(|e| io_err("socket address", e.into()))?;
    bind(fd.as_raw_fd(), &addr).map_err(|e| io_err("bind", e.into()))?;
    std::os::unix::fs::chown(path, Some(owner.0), Some(owner.1)).map_err(|e| io_err("chown", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| io_err("chmod", e))?;
    listen(&fd, Backlog::new(BACKLOG).expect("backlog within SOMAXCONN range"))
        .map_err(|e| io_err("listen", e.into()))?;
    let m = std::fs::symlink_metadata(path).map_err(|e| io_err("lstat", e))?;
    Ok(Bound { fd, id: FileId { dev: m.dev(), ino: m.ino() } })
}

/// Checks that `fd` is a listening stream socket bound to `path`, and that `path` names
/// the very file its bind created: the device and inode the kernel records for the
/// socket (sock_diag) are the path's now. Returns that file's identity.
pub fn listener_at(what: &'static str, fd: &OwnedFd, path: &Path) -> Result<FileId, ListenError> {
    shared_proto::fdcheck::check_listener(what, fd, path)?;
    let bound = super::sockdiag::bound_file(fd.as_fd()).map_err(|source| ListenError::Diag { what, source })?;
    let m = std::fs::symlink_metadata(path).map_err(|source| ListenError::Io { what: "lstat", path: path.to_owned(), source })?;
    if !m.file_type().is_socket() {
        return Err(ListenError::Gone { path: path.to_owned() });
    }
    // The kernel reports the low 32 bits of the inode.
    if bound.dev != m.dev() || bound.ino != u64::from(m.ino() as u32) {
        return Err(ListenError::NotBoundThere { what, path: path.to_owned(), bound: bound.ino, now: m.ino() });
    }
    Ok(FileId { dev: m.dev(), ino: m.ino() })
}

/// Checks a listener handed over by the previous generation: [`listener_at`], and `path`
/// still names the file it was bound to (`then`, as the previous owner recorded it at
/// bind).
pub fn verify_held(fd: &OwnedFd, path: &Path, then: FileId) -> Result<(), ListenError> {
    let now = listener_at("held listener", fd, path)?;
    if now != then {
        return Err(ListenError::Replaced { path: path.to_owned(), now: now.ino, then: then.ino });
    }
    Ok(())
}
