//! The generation handoff on `<run-dir>/handoff.sock`: the owning supervisor offers
//! duplicates of its listening sockets to a standby supervisor, so that the sockets the
//! proxy and the CNI plugin connect to stay open across a roll. A connect that arrives
//! while no worker accepts waits in the backlog instead of being refused.
//!
//! The exchange: the standby connects and sends `HandoffHello{version}`; the owner checks
//! the peer's uid (SO_PEERCRED, same uid as itself) and answers one `HandoffOffer` with
//! its generation, the device/inode of each socket path, and the two descriptors. The
//! standby checks the peer's uid too, checks each descriptor (a listening stream socket
//! bound to the expected path), holds them and never accepts on them. The messages and
//! their version (`HANDOFF_VERSION`, bumped on any change a peer of the other version
//! would misread) are in `shared-proto`'s `control.proto`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, accept4, connect, getsockopt, socket, sockopt};
use shared_proto::control::{HANDOFF_VERSION, HandoffBody, HandoffHello, HandoffOffer};
use shared_proto::fdcheck::{FdError, check_listener};
use shared_proto::fdpass;

use crate::sys::listen::FileId;

/// How long either side waits for the other's message.
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
        return Err(HandoffError::PeerUid { pid: cred.pid(), uid: cred.uid(), me });
    }
    Ok(())
}

/// Owner side: answers one standby on the accepted connection `conn`. Returns whether
/// the peer said it is the node's socket keeper.
pub fn serve_one(conn: OwnedFd, generation: u64, offer: &Listeners) -> Result<bool, HandoffError> {
    check_peer_uid(&conn)?;
    wait_readable(&conn, STEP_TIMEOUT)?;
    let keeper = match fdpass::recv_handoff(conn.as_fd(), true)? {
        (HandoffBody::Hello(h), _) if h.version == HANDOFF_VERSION => h.keeper,
        (HandoffBody::Hello(h), _) => return Err(HandoffError::Version { got: h.version, ours: HANDOFF_VERSION }),
        (HandoffBody::Offer(_), _) => return Err(HandoffError::OfferFromStandby),
    };
    shared_proto::fault_hook!("handoff-offer");
    let PathIds { xds, cni } = offer.paths;
    let msg = HandoffOffer { version: HANDOFF_VERSION, generation, xds_dev: xds.dev, xds_ino: xds.ino, cni_dev: cni.dev, cni_ino: cni.ino };
    fdpass::send_handoff(conn.as_fd(), HandoffBody::Offer(msg), &[offer.xds.as_fd(), offer.cni.as_fd()])?;
    Ok(keeper)
}

/// Owner side: accepts a pending connection on the (non-blocking) handoff listener.
pub fn accept(listener: &OwnedFd) -> Option<OwnedFd> {
    accept4(listener, SockFlag::SOCK_CLOEXEC).ok()
}

/// Standby side: fetches the owner's sockets (`keeper`: the caller is the node's socket
/// keeper). `Ok(None)` when no owner listens (none yet, or a predecessor that knows no
/// handoff).
pub fn fetch(handoff: &Path, xds_path: &Path, cni_path: &Path, keeper: bool) -> Result<Option<Held>, HandoffError> {
    let conn = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).map_err(HandoffError::Socket)?;
    let connect_err = |source| HandoffError::Connect { path: handoff.to_owned(), source };
    let addr = UnixAddr::new(handoff).map_err(connect_err)?;
    match connect(conn.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(Errno::ENOENT | Errno::ECONNREFUSED) => return Ok(None),
        Err(e) => return Err(connect_err(e)),
    }
    check_peer_uid(&conn)?;
    fdpass::send_handoff(conn.as_fd(), HandoffBody::Hello(HandoffHello { version: HANDOFF_VERSION, keeper }), &[])?;
    wait_readable(&conn, STEP_TIMEOUT)?;
    let (body, mut fds) = fdpass::recv_handoff(conn.as_fd(), true)?;
    let HandoffBody::Offer(offer) = body else { return Err(HandoffError::HelloFromOwner) };
    if offer.version != HANDOFF_VERSION {
        return Err(HandoffError::Version { got: offer.version, ours: HANDOFF_VERSION });
    }
    // recv_handoff checked there are exactly two.
    let (Some(cni), Some(xds)) = (fds.pop(), fds.pop()) else { unreachable!("an offer carries two descriptors") };
    check_listener("handed-off xds.sock", &xds, xds_path)?;
    check_listener("handed-off cni.sock", &cni, cni_path)?;
    let paths = PathIds {
        xds: FileId { dev: offer.xds_dev, ino: offer.xds_ino },
        cni: FileId { dev: offer.cni_dev, ino: offer.cni_ino },
    };
    Ok(Some(Held { generation: offer.generation, listeners: Listeners { xds, cni, paths } }))
}
