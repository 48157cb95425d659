//! The generation handoff on `<run-dir>/handoff.sock`: the owning supervisor offers
//! duplicates of its listening sockets to a standby supervisor, so that the sockets the
//! proxy and the CNI plugin connect to stay open across a roll. A connect that arrives
//! while no worker accepts waits in the backlog instead of being refused.
//!
//! The exchange: the standby connects and sends `HandoffHello{version}`; the owner checks
//! the peer's uid (SO_PEERCRED, same uid as itself), parks the connection until the Hello
//! is readable ([`Parked`]: no wait in the owner's loop) and answers one `HandoffOffer` with
//! its generation, the device/inode of each socket path, and the two descriptors. The
//! standby checks the peer's uid too, checks each descriptor (a listening stream socket
//! bound to the expected path), holds them and never accepts on them. The messages and
//! their version (`HANDOFF_VERSION`, bumped on any change a peer of the other version
//! would misread) are in this crate's `control.proto`.
//!
//! Both ends are here because two programs speak it: the supervisor (owner and standby)
//! and the node's socket keeper (`aether-keeper`), which fetches like a standby and
//! offers like an owner on `<run-dir>/keeper.sock`. So is the fresh bind of a socket
//! file ([`bind_fresh`]), which both use for their listeners.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept4, bind, connect, getsockopt,
    listen, socket, sockopt,
};

use crate::control::{HANDOFF_VERSION, HandoffBody, HandoffHello, HandoffOffer};
use crate::fdcheck::{FdError, check_listener};
use crate::fdpass;

/// Connects queue here while no worker accepts (a respawn, a takeover in progress). The
/// node's clients are one Envoy and one plugin process per CNI call; a plugin that finds
/// the backlog full waits in the kernel (a blocking connect bounded by its timeout), so a
/// burst of 1,000 concurrent calls gets through all the same. A short backlog bounds how
/// many of a flood's connections a plugin's connect queues behind (the worker closes
/// those for their rate, pausing after two backlogs' worth: `PAUSE_EVERY` in
/// `worker/src/accept.rs`).
pub const BACKLOG: i32 = 8;

/// A socket file that could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error(
        "refusing to replace {path}: it is a {kind}, not a socket; remove it by hand if it is stale"
    )]
    NotASocket { path: PathBuf, kind: &'static str },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
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

/// What is at `path`: nothing, a socket file (replaceable), or something we refuse.
fn check_replaceable(path: &Path) -> Result<bool, BindError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(BindError::Io {
            what: "lstat",
            path: path.to_owned(),
            source,
        }),
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
            Err(BindError::NotASocket {
                path: path.to_owned(),
                kind,
            })
        }
    }
}

/// Binds a fresh listening socket at `path` with exactly `mode` and `owner`, replacing a
/// stale socket file. `kind` is the socket type (stream for the node sockets, seqpacket
/// for the handoff socket). The caller has checked that no live server answers there.
pub fn bind_fresh(
    path: &Path,
    kind: SockType,
    mode: u32,
    owner: (u32, u32),
) -> Result<Bound, BindError> {
    let io_err = |what, source| BindError::Io {
        what,
        path: path.to_owned(),
        source,
    };
    if check_replaceable(path)? {
        // Only a socket file reaches here; unlink does not follow symlinks anyway.
        std::fs::remove_file(path).map_err(|e| io_err("remove stale socket", e))?;
    }
    let fd = socket(AddressFamily::Unix, kind, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| io_err("socket", e.into()))?;
    let addr = UnixAddr::new(path).map_err(|e| io_err("socket address", e.into()))?;
    bind(fd.as_raw_fd(), &addr).map_err(|e| io_err("bind", e.into()))?;
    std::os::unix::fs::chown(path, Some(owner.0), Some(owner.1)).map_err(|e| io_err("chown", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("chmod", e))?;
    listen(
        &fd,
        Backlog::new(BACKLOG).expect("backlog within SOMAXCONN range"),
    )
    .map_err(|e| io_err("listen", e.into()))?;
    let m = std::fs::symlink_metadata(path).map_err(|e| io_err("lstat", e))?;
    Ok(Bound {
        fd,
        id: FileId {
            dev: m.dev(),
            ino: m.ino(),
        },
    })
}

/// A run dir whose path another user could change.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error(
        "{path} lies in {folder}, owned by uid {uid} with mode {mode:o}: its owner or others could move or replace what is in it and redirect the node sockets; every folder on the run dir's path must be root's or uid {me}'s and writable by nobody else, unless sticky"
    )]
    UnsafeFolder {
        path: PathBuf,
        folder: PathBuf,
        me: u32,
        uid: u32,
        mode: u32,
    },
}

/// The node sockets are bound, replaced and chowned by path, so every folder that
/// resolving the run dir `dir` goes through, each one holding a component of it as given
/// (a symlink included) and each one above what those resolve to, must be root's or this
/// process's euid's and writable by nobody else; a sticky one such as `/tmp` passes,
/// since others may add names there but not move ours, nor make us follow their symlinks
/// (`fs.protected_symlinks`). Folders not there yet are skipped: the caller checks again
/// once it has created them. After OpenSSH's `safe_path`. The supervisor and the socket
/// keeper both check their run dir with it.
pub fn check_folders_on_path(dir: &Path) -> Result<(), PathError> {
    let me = nix::unistd::geteuid().as_raw();
    let io = |what, path: &Path, source| PathError::Io {
        what,
        path: path.to_owned(),
        source,
    };
    let dir = std::path::absolute(dir).map_err(|e| io("resolve", dir, e))?;
    for holder in dir.ancestors().skip(1) {
        let real = match std::fs::canonicalize(holder) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            other => other.map_err(|e| io("resolve", holder, e))?,
        };
        for folder in real.ancestors() {
            let st = std::fs::metadata(folder).map_err(|e| io("stat", folder, e))?;
            let (uid, mode) = (st.uid(), st.mode() & 0o7777);
            if (uid != 0 && uid != me) || (mode & 0o022 != 0 && mode & 0o1000 == 0) {
                return Err(PathError::UnsafeFolder {
                    path: dir.clone(),
                    folder: folder.to_owned(),
                    me,
                    uid,
                    mode,
                });
            }
        }
    }
    Ok(())
}

/// How long a standby waits for the owner's offer.
const STEP_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("peer sent nothing within {0:?}")]
    Silent(Duration),
    #[error("poll: {0}")]
    Poll(Errno),
    #[error("SO_PEERCRED: {0}")]
    PeerCred(Errno),
    #[error("peer pid {pid} runs as uid {uid}, not {me}")]
    PeerUid { pid: i32, uid: u32, me: u32 },
    #[error(transparent)]
    Message(#[from] fdpass::Error),
    #[error("peer speaks handoff version {got}, we speak {ours}")]
    Version { got: u32, ours: u32 },
    #[error("the standby sent an offer")]
    OfferFromStandby,
    #[error("the owner sent a hello")]
    HelloFromOwner,
    #[error("socket: {0}")]
    Socket(Errno),
    #[error("{path}: {source}")]
    Connect { path: PathBuf, source: Errno },
    #[error(transparent)]
    Listener(#[from] FdError),
}

/// The node's two listeners and the identity of the paths they were bound at.
#[derive(Debug)]
pub struct Listeners {
    pub xds: OwnedFd,
    pub cni: OwnedFd,
    pub paths: PathIds,
}

/// The (dev, ino) of `xds.sock` and `cni.sock` when their listeners were bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathIds {
    pub xds: FileId,
    pub cni: FileId,
}

/// Listening sockets received from the owning generation (or kept by systemd, with
/// generation 0).
#[derive(Debug)]
pub struct Held {
    pub generation: u64,
    pub listeners: Listeners,
}

fn wait_readable(fd: &OwnedFd, timeout: Duration) -> Result<(), HandoffError> {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, ms) {
        Ok(0) => Err(HandoffError::Silent(timeout)),
        Ok(_) => Ok(()),
        Err(e) => Err(HandoffError::Poll(e)),
    }
}

fn check_peer_uid(fd: &OwnedFd) -> Result<(), HandoffError> {
    let cred = getsockopt(fd, sockopt::PeerCredentials).map_err(HandoffError::PeerCred)?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(HandoffError::PeerUid {
            pid: cred.pid(),
            uid: cred.uid(),
            me,
        });
    }
    Ok(())
}

/// Owner side: accepted connections whose peer has not spoken yet. The owner (the
/// supervisor, or the socket keeper on `keeper.sock`) parks each connection it accepts
/// and answers it once its Hello, or its end, is readable: a peer that connects and stays
/// silent holds a slot, never the event loop, which polls the parked descriptors with its
/// others ([`Parked::fds`]). A peer of another uid is refused at accept. At most
/// [`Parked::MAX`] wait; past that the oldest is closed (its peer, a standby, fetches
/// again 200 ms later).
#[derive(Debug, Default)]
pub struct Parked(std::collections::VecDeque<OwnedFd>);

impl Parked {
    pub const MAX: usize = 8;

    /// Accepts every connection queued on the non-blocking `listener` and parks it.
    /// Returns the refusals (a peer of another uid), for the caller to log.
    pub fn accept_all(&mut self, listener: &OwnedFd) -> Vec<HandoffError> {
        let mut refused = Vec::new();
        while let Some(conn) = accept(listener) {
            match check_peer_uid(&conn) {
                Err(e) => refused.push(e),
                Ok(()) => {
                    if self.0.len() == Self::MAX {
                        self.0.pop_front();
                    }
                    self.0.push_back(conn);
                }
            }
        }
        refused
    }

    /// The parked connections, for the caller's poll.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.0.iter().map(|c| c.as_fd())
    }

    /// Closes every parked connection: there is nothing to offer.
    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Answers each parked connection whose peer has sent something or hung up, with
    /// `offer`, without waiting; the others stay parked. One result per answered peer:
    /// whether it said it is the node's socket keeper, or why it was refused.
    pub fn answer_ready(
        &mut self,
        generation: u64,
        offer: &Listeners,
    ) -> Vec<Result<bool, HandoffError>> {
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd> = self
                .fds()
                .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            if poll(&mut fds, PollTimeout::ZERO).is_err() {
                return Vec::new();
            }
            fds.iter()
                .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        let mut answers = Vec::new();
        for (conn, ready) in std::mem::take(&mut self.0).into_iter().zip(ready) {
            match ready {
                true => answers.push(answer(conn, generation, offer)),
                false => self.0.push_back(conn),
            }
        }
        answers
    }
}

/// Answers the peer on `conn`, whose Hello (or end) is readable.
fn answer(conn: OwnedFd, generation: u64, offer: &Listeners) -> Result<bool, HandoffError> {
    let keeper = match fdpass::recv_handoff(conn.as_fd(), true)? {
        (HandoffBody::Hello(h), _) if h.version == HANDOFF_VERSION => h.keeper,
        (HandoffBody::Hello(h), _) => {
            return Err(HandoffError::Version {
                got: h.version,
                ours: HANDOFF_VERSION,
            });
        }
        (HandoffBody::Offer(_), _) => return Err(HandoffError::OfferFromStandby),
    };
    crate::fault_hook!("handoff-offer");
    let PathIds { xds, cni } = offer.paths;
    let msg = HandoffOffer {
        version: HANDOFF_VERSION,
        generation,
        xds_dev: xds.dev,
        xds_ino: xds.ino,
        cni_dev: cni.dev,
        cni_ino: cni.ino,
    };
    fdpass::send_handoff(
        conn.as_fd(),
        HandoffBody::Offer(msg),
        &[offer.xds.as_fd(), offer.cni.as_fd()],
    )?;
    Ok(keeper)
}

/// Accepts a pending connection on the (non-blocking) listener `listener`.
pub fn accept(listener: &OwnedFd) -> Option<OwnedFd> {
    accept4(listener, SockFlag::SOCK_CLOEXEC).ok()
}

/// Standby side: fetches the owner's sockets (`keeper`: the caller is the node's socket
/// keeper). `Ok(None)` when no owner listens (none yet, or a predecessor that knows no
/// handoff).
pub fn fetch(
    handoff: &Path,
    xds_path: &Path,
    cni_path: &Path,
    keeper: bool,
) -> Result<Option<Held>, HandoffError> {
    let conn = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(HandoffError::Socket)?;
    let connect_err = |source| HandoffError::Connect {
        path: handoff.to_owned(),
        source,
    };
    let addr = UnixAddr::new(handoff).map_err(connect_err)?;
    match connect(conn.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::ENOENT | Errno::ECONNREFUSED) => return Ok(None),
        Err(e) => return Err(connect_err(e)),
    }
    check_peer_uid(&conn)?;
    fdpass::send_handoff(
        conn.as_fd(),
        HandoffBody::Hello(HandoffHello {
            version: HANDOFF_VERSION,
            keeper,
        }),
        &[],
    )?;
    wait_readable(&conn, STEP_TIMEOUT)?;
    let (body, mut fds) = fdpass::recv_handoff(conn.as_fd(), true)?;
    let HandoffBody::Offer(offer) = body else {
        return Err(HandoffError::HelloFromOwner);
    };
    if offer.version != HANDOFF_VERSION {
        return Err(HandoffError::Version {
            got: offer.version,
            ours: HANDOFF_VERSION,
        });
    }
    // recv_handoff checked there are exactly two.
    let (Some(cni), Some(xds)) = (fds.pop(), fds.pop()) else {
        unreachable!("an offer carries two descriptors")
    };
    check_listener("handed-off xds.sock", &xds, xds_path)?;
    check_listener("handed-off cni.sock", &cni, cni_path)?;
    let paths = PathIds {
        xds: FileId {
            dev: offer.xds_dev,
            ino: offer.xds_ino,
        },
        cni: FileId {
            dev: offer.cni_dev,
            ino: offer.cni_ino,
        },
    };
    Ok(Some(Held {
        generation: offer.generation,
        listeners: Listeners { xds, cni, paths },
    }))
}
