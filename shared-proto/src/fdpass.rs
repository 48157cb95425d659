//! One protocol message per `SOCK_SEQPACKET` datagram, with its descriptors over
//! `SCM_RIGHTS`.
//!
//! Receiving is where fd-passing code usually leaks or trusts too much, so this module:
//! - receives with `MSG_CMSG_CLOEXEC`, so no descriptor can leak into an exec;
//! - wraps every received descriptor in an [`OwnedFd`] before looking at anything else,
//!   so that every error path below closes them by dropping;
//! - rejects a datagram cut short (`MSG_TRUNC`), control data cut short (`MSG_CTRUNC`,
//!   i.e. more descriptors than [`MAX_FDS`]), and any control message that is not
//!   `SCM_RIGHTS`;
//! - checks the descriptor count against what the decoded message expects.
//!
//! `nix` refuses to walk the control messages of a truncated message, which would leave
//! the descriptors that did arrive open, so `recvmsg(2)` is called through `libc` here.

use std::io::{IoSlice, IoSliceMut};
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use prost::Message;

use crate::control::{Body, Envelope, HandoffBody, HandoffEnvelope};

/// Largest encoded message either side accepts.
pub const MAX_MESSAGE: usize = 4096;
/// Most descriptors one message may carry before the control data counts as truncated.
/// The largest legitimate message (`Takeover`) carries three.
pub const MAX_FDS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("peer closed the connection")]
    Closed,
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    #[error("datagram truncated: larger than the {MAX_MESSAGE}-byte limit")]
    Truncated,
    #[error("control data truncated: more than {MAX_FDS} descriptors attached")]
    ControlTruncated,
    #[error("unexpected control message (level {level}, type {kind}); only SCM_RIGHTS is accepted")]
    UnexpectedControl { level: i32, kind: i32 },
    #[error("undecodable message: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("message has no body")]
    Empty,
    #[error("{message} carries {got} descriptors, expected {expected}")]
    FdCount {
        message: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("socket error: {0}")]
    Io(#[from] Errno),
}

impl Error {
    /// True for a non-blocking socket with nothing to read.
    pub fn would_block(&self) -> bool {
        matches!(self, Error::Io(Errno::EAGAIN))
    }
}

/// Sends one message with `fds` attached. Retries on `EINTR`.
pub fn send<M: Message>(
    sock: BorrowedFd<'_>,
    msg: &M,
    fds: &[BorrowedFd<'_>],
) -> Result<(), Error> {
    let bytes = msg.encode_to_vec();
    if bytes.len() > MAX_MESSAGE {
        return Err(Error::TooLarge(bytes.len()));
    }
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    loop {
        match sendmsg::<()>(
            sock.as_raw_fd(),
            &[IoSlice::new(&bytes)],
            &cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(_) => return Ok(()),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Receives one datagram and every descriptor attached to it, undecoded.
/// `nonblocking` adds `MSG_DONTWAIT`.
pub fn recv_raw(sock: BorrowedFd<'_>, nonblocking: bool) -> Result<(Vec<u8>, Vec<OwnedFd>), Error> {
    // One byte more than the limit, so that an oversized datagram shows as MSG_TRUNC
    // even on kernels that do not report the full length.
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    // SAFETY: CMSG_SPACE is a pure size computation on a constant.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * mem::size_of::<RawFd>()) as u32) } as usize;
    // u64 elements keep the buffer aligned for cmsghdr.
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = [IoSliceMut::new(&mut buf)];
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
    let mut hdr: libc::msghdr = unsafe { mem::zeroed() };
    hdr.msg_iov = iov.as_mut_ptr().cast();
    hdr.msg_iovlen = 1;
    hdr.msg_control = cbuf.as_mut_ptr().cast();
    hdr.msg_controllen = space as _;
    let mut flags = libc::MSG_CMSG_CLOEXEC;
    if nonblocking {
        flags |= libc::MSG_DONTWAIT;
    }
    let n = loop {
        // SAFETY: hdr points at iov and cbuf, which outlive the call and whose lengths
        // are the ones given; the kernel writes within them.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut hdr, flags) };
        if n >= 0 {
            break n as usize;
        }
        match Errno::last() {
            Errno::EINTR => continue,
            e => return Err(e.into()),
        }
    };
    // Take ownership of every delivered descriptor first, so any error below closes them
    // (off this thread: see `discard`).
    let mut fds = Unwanted(Vec::new());
    let mut foreign = None;
    // SAFETY: hdr was filled in by a successful recvmsg; CMSG_FIRSTHDR/CMSG_NXTHDR walk
    // the control buffer within msg_controllen as the kernel wrote it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            let (level, kind) = ((*c).cmsg_level, (*c).cmsg_type);
            if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..len / mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    // The kernel just installed this descriptor for us; nobody else owns it.
                    fds.0.push(OwnedFd::from_raw_fd(fd));
                }
            } else {
                foreign = Some((level, kind));
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    if hdr.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::ControlTruncated);
    }
    if hdr.msg_flags & libc::MSG_TRUNC != 0 || n > MAX_MESSAGE {
        return Err(Error::Truncated);
    }
    if let Some((level, kind)) = foreign {
        return Err(Error::UnexpectedControl { level, kind });
    }
    if n == 0 && fds.0.is_empty() {
        return Err(Error::Closed);
    }
    buf.truncate(n);
    Ok((buf, std::mem::take(&mut fds.0)))
}

/// Descriptors received but not (yet) accepted: dropped, they are discarded.
struct Unwanted(Vec<OwnedFd>);

impl Drop for Unwanted {
    fn drop(&mut self) {
        discard(std::mem::take(&mut self.0));
    }
}

/// Closes descriptors a peer sent that the receiver does not accept, without blocking the
/// caller. The last close of a socket with SO_LINGER and unsent data blocks for the linger
/// time (a TTY with pending output can block too); a worker that passes the supervisor
/// such a socket must not stall its event loop, which then kills that worker at once.
///
/// A thread of their own takes a descriptor table of its own (`unshare(CLONE_FILES)`), so
/// that it holds the only copies once the caller has closed the shared ones, which is not
/// the last close of any and returns at once. The last close then blocks that thread
/// only. A fork meanwhile (the supervisor spawning the next worker) copies none of them,
/// so no child's exec can be the close that blocks. Where the thread cannot unshare, it
/// closes them in the shared table, as a last resort the caller does.
pub fn discard(fds: Vec<OwnedFd>) {
    if fds.is_empty() {
        return;
    }
    let shared: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let mut keep = shared.clone();
    keep.sort_unstable();
    let (unshared_tx, unshared_rx) = std::sync::mpsc::sync_channel::<bool>(1);
    let (closed_tx, closed_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let spawned = std::thread::Builder::new()
        .name("fd-discard".into())
        .spawn(move || {
            // SAFETY: unshare takes no pointer; CLONE_FILES only gives this thread a private
            // copy of the descriptor table.
            let private = unsafe { libc::unshare(libc::CLONE_FILES) } == 0;
            if unshared_tx.send(private).is_err() || !private || closed_rx.recv().is_err() {
                return drop(fds);
            }
            // This table's copies of everything else: none is the last one.
            let mut from = 0;
            for &fd in keep.iter().chain([&RawFd::MAX]) {
                if fd > from {
                    // SAFETY: close_range takes plain integers; it closes only this thread's
                    // private copies, which no Rust value here owns (`fds` is outside the ranges).
                    unsafe {
                        libc::syscall(
                            libc::SYS_close_range,
                            from as libc::c_uint,
                            (fd - 1) as libc::c_uint,
                            0,
                        )
                    };
                }
                from = fd.saturating_add(1);
            }
            // The last copies: a lingering close blocks here.
            drop(fds);
        });
    if spawned.is_ok() && unshared_rx.recv() == Ok(true) {
        for fd in shared {
            // SAFETY: each is the shared table's entry of a descriptor whose `OwnedFd` moved
            // to the thread, which after unsharing closes only its own table's copy; each
            // entry is closed once, here, and nothing else in this process uses it.
            unsafe { libc::close(fd) };
        }
        let _ = closed_tx.send(());
    }
}

/// Receives one supervisor/worker message and checks its descriptor count.
pub fn recv_control(
    sock: BorrowedFd<'_>,
    nonblocking: bool,
) -> Result<(Body, Vec<OwnedFd>), Error> {
    let (bytes, fds) = recv_raw(sock, nonblocking)?;
    let fds = Unwanted(fds);
    let body = Envelope::decode(bytes.as_slice())?
        .body
        .ok_or(Error::Empty)?;
    check_count(body.name(), body.expected_fds(), fds).map(|fds| (body, fds))
}

/// Receives one handoff message and checks its descriptor count.
pub fn recv_handoff(
    sock: BorrowedFd<'_>,
    nonblocking: bool,
) -> Result<(HandoffBody, Vec<OwnedFd>), Error> {
    let (bytes, fds) = recv_raw(sock, nonblocking)?;
    let fds = Unwanted(fds);
    let body = HandoffEnvelope::decode(bytes.as_slice())?
        .body
        .ok_or(Error::Empty)?;
    let name = match body {
        HandoffBody::Hello(_) => "HandoffHello",
        HandoffBody::Offer(_) => "HandoffOffer",
    };
    check_count(name, body.expected_fds(), fds).map(|fds| (body, fds))
}

fn check_count(
    message: &'static str,
    expected: usize,
    mut fds: Unwanted,
) -> Result<Vec<OwnedFd>, Error> {
    if fds.0.len() != expected {
        // Dropping `fds` discards every one of them.
        return Err(Error::FdCount {
            message,
            got: fds.0.len(),
            expected,
        });
    }
    Ok(std::mem::take(&mut fds.0))
}

/// Sends a supervisor/worker message.
pub fn send_control(sock: BorrowedFd<'_>, body: Body, fds: &[BorrowedFd<'_>]) -> Result<(), Error> {
    send(sock, &Envelope { body: Some(body) }, fds)
}

/// Sends a handoff message.
pub fn send_handoff(
    sock: BorrowedFd<'_>,
    body: HandoffBody,
    fds: &[BorrowedFd<'_>],
) -> Result<(), Error> {
    send(sock, &HandoffEnvelope { body: Some(body) }, fds)
}

/// A close-on-exec duplicate of `fd` numbered `min` or above (`F_DUPFD_CLOEXEC`); the
/// original is closed when the caller drops it.
pub fn dup_at_or_above(fd: &OwnedFd, min: RawFd) -> Result<OwnedFd, Error> {
    let raw = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(min))?;
    // SAFETY: F_DUPFD_CLOEXEC just returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Takes ownership of a socket a process inherited at `fd` (the worker's control socket at
/// fd 3, a `SOCK_SEQPACKET`; the supervisor's listeners from systemd, `SOCK_STREAM`),
/// after checking that it is an open socket of type `kind`. It is marked close-on-exec.
pub fn take_inherited(fd: RawFd, kind: nix::sys::socket::SockType) -> Result<OwnedFd, Error> {
    // F_GETFD fails with EBADF when nothing is open at `fd`; only then could taking
    // ownership below alias nothing, so check first.
    nix::fcntl::fcntl(
        // SAFETY: the borrow lives only for this call, and `fd` is checked open by it.
        unsafe { BorrowedFd::borrow_raw(fd) },
        nix::fcntl::FcntlArg::F_GETFD,
    )?;
    // SAFETY: `fd` is open (checked above) and was handed to this process at exec for it
    // to own; nothing else in the process refers to it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    if nix::sys::socket::getsockopt(&owned, nix::sys::socket::sockopt::SockType)? != kind {
        return Err(Error::Io(Errno::ENOTSOCK));
    }
    nix::fcntl::fcntl(
        &owned,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )?;
    Ok(owned)
}
