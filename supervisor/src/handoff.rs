//! The generation handoff on `<run-dir>/handoff.sock`: the owning supervisor offers
//! duplicates of its listening sockets to a standby supervisor, so that the sockets the
//! proxy and the CNI plugin connect to stay open across a roll. A connect that arrives
//! while no worker accepts waits in the backlog instead of being refused.
//!
//! The exchange: the standby connects and sends `HandoffHello{version}`; the owner checks
//! the peer's uid (SO_PEERCRED, same uid as itself) and answers one `HandoffOffer` with
//! its generation, the device/inode of each socket path, and the two descriptors. The
//! standby checks the peer's uid too, checks each descriptor (a listening stream socket
//! bound to the expected path), holds them and never accepts on them.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, accept4, connect, getsockopt, socket, sockopt};
use shared_proto::control::{HANDOFF_VERSION, HandoffBody, HandoffHello, HandoffOffer};
use shared_proto::fdpass;

/// How long either side waits for the other's message.
const STEP_TIMEOUT: Duration = Duration::from_millis(500);

/// Listening sockets received from the owning generation.
pub struct Held {
    pub generation: u64,
    pub xds: OwnedFd,
    pub cni: OwnedFd,
    pub offer: HandoffOffer,
}

impl Held {
    /// The (dev, ino) of the xds and cni socket paths, as the offer recorded them.
    pub fn ids(&self) -> [(u64, u64); 2] {
        [(self.offer.xds_dev, self.offer.xds_ino), (self.offer.cni_dev, self.offer.cni_ino)]
    }
}

fn wait_readable(fd: &OwnedFd, timeout: Duration) -> Result<(), String> {
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
    let ms = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, ms) {
        Ok(0) => Err(format!("peer sent nothing within {timeout:?}")),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("poll: {e}")),
    }
}

fn check_peer_uid(fd: &OwnedFd) -> Result<(), String> {
    let cred = getsockopt(fd, sockopt::PeerCredentials).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    let me = nix::unistd::geteuid().as_raw();
    if cred.uid() != me {
        return Err(format!("peer pid {} runs as uid {}, not {me}", cred.pid(), cred.uid()));
    }
    Ok(())
}

/// Owner side: answers one standby on the accepted connection `conn`. Returns whether
/// the peer said it is the node's socket keeper.
pub fn serve_one(conn: OwnedFd, generation: u64, xds: &OwnedFd, cni: &OwnedFd, ids: [(u64, u64); 2]) -> Result<bool, String> {
    check_peer_uid(&conn)?;
    wait_readable(&conn, STEP_TIMEOUT)?;
    let keeper = match fdpass::recv_handoff(conn.as_fd(), true).map_err(|e| e.to_string())? {
        (HandoffBody::Hello(h), _) if h.version == HANDOFF_VERSION => h.keeper,
        (HandoffBody::Hello(h), _) => return Err(format!("standby speaks handoff version {}, we speak {HANDOFF_VERSION}", h.version)),
        (HandoffBody::Offer(_), _) => return Err("standby sent an offer".into()),
    };
    let offer = HandoffOffer {
        version: HANDOFF_VERSION,
        generation,
        xds_dev: ids[0].0,
        xds_ino: ids[0].1,
        cni_dev: ids[1].0,
        cni_ino: ids[1].1,
    };
    fdpass::send_handoff(conn.as_fd(), HandoffBody::Offer(offer), &[xds.as_fd(), cni.as_fd()]).map_err(|e| e.to_string())?;
    Ok(keeper)
}

/// Owner side: accepts a pending connection on the (non-blocking) handoff listener.
pub fn accept(listener: &OwnedFd) -> Option<OwnedFd> {
    accept4(listener, SockFlag::SOCK_CLOEXEC).ok()
}

/// Standby side: fetches the owner's sockets (`keeper`: the caller is the node's socket
/// keeper). `Ok(None)` when no owner listens (none yet, or a predecessor that knows no
/// handoff).
pub fn fetch(handoff: &Path, xds_path: &Path, cni_path: &Path, keeper: bool) -> Result<Option<Held>, String> {
    let conn = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).map_err(|e| format!("socket: {e}"))?;
    let addr = UnixAddr::new(handoff).map_err(|e| format!("{}: {e}", handoff.display()))?;
    match connect(conn.as_raw_fd(), &addr) {
        Ok(()) => {}
        Err(nix::errno::Errno::ENOENT | nix::errno::Errno::ECONNREFUSED) => return Ok(None),
        Err(e) => return Err(format!("connect {}: {e}", handoff.display())),
    }
    check_peer_uid(&conn)?;
    fdpass::send_handoff(conn.as_fd(), HandoffBody::Hello(HandoffHello { version: HANDOFF_VERSION, keeper }), &[])
        .map_err(|e| e.to_string())?;
    wait_readable(&conn, STEP_TIMEOUT)?;
    let (body, mut fds) = fdpass::recv_handoff(conn.as_fd(), true).map_err(|e| e.to_string())?;
    let HandoffBody::Offer(offer) = body else { return Err("owner sent a hello".into()) };
    if offer.version != HANDOFF_VERSION {
        return Err(format!("owner speaks handoff version {}, we speak {HANDOFF_VERSION}", offer.version));
    }
    // recv_handoff checked there are exactly two.
    let cni = fds.pop().expect("two descriptors");
    let xds = fds.pop().expect("two descriptors");
    shared_proto::fdcheck::check_listener("handed-off xds.sock", &xds, xds_path).map_err(|e| e.to_string())?;
    shared_proto::fdcheck::check_listener("handed-off cni.sock", &cni, cni_path).map_err(|e| e.to_string())?;
    Ok(Some(Held { generation: offer.generation, xds, cni, offer }))
}
