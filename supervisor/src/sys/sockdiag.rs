//! The kernel's own record of the file a unix socket is bound to: sock_diag
//! (`NETLINK_SOCK_DIAG`, `UNIX_DIAG_VFS`), asked for one socket by its inode.
//!
//! A listener's path proves nothing by itself: `getsockname` returns the name given at
//! bind even after that file was unlinked and replaced, and a device and inode recorded
//! from the path at start are the path's, not the socket's. The kernel keeps the dentry
//! the bind created; `UNIX_DIAG_VFS` reports its device and inode, so a path whose
//! `lstat` gives the same pair is the file this very socket is bound to. Unprivileged:
//! any process may ask about a socket in its network namespace; it needs `AF_NETLINK`.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto, socket,
};

use super::listen::FileId;

/// `SOCK_DIAG_BY_FAMILY`, `NLMSG_ERROR` and the request's flags (`NLM_F_REQUEST`, an
/// exact lookup rather than a dump).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
/// `UDIAG_SHOW_VFS` asks for the attribute `UNIX_DIAG_VFS`.
const UDIAG_SHOW_VFS: u32 = 0x2;
const UNIX_DIAG_VFS: u16 = 1;
/// `struct nlmsghdr`, `struct unix_diag_req` and `struct unix_diag_msg` sizes.
const NLMSG_HDR: usize = 16;
const REQ_LEN: usize = 24;
const MSG_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    #[error("sock_diag: {0} (the kernel's unix_diag, or AF_NETLINK for this process, is missing)")]
    Netlink(nix::Error),
    #[error("sock_diag answered with errno {0}")]
    Answer(nix::Error),
    #[error("sock_diag answer malformed: {0}")]
    Malformed(&'static str),
    #[error("the socket is not bound to a file")]
    NotBound,
}

/// The device and inode of the file `sock`, a unix socket, is bound to, as the kernel
/// records them. The inode is the low 32 bits (`struct unix_diag_vfs` is that wide).
pub fn bound_file(sock: BorrowedFd<'_>) -> Result<FileId, DiagError> {
    let ino = nix::sys::stat::fstat(sock)
        .map_err(DiagError::Netlink)?
        .st_ino as u32;
    let nl = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .map_err(DiagError::Netlink)?;
    sendto(
        nl.as_raw_fd(),
        &request(ino),
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )
    .map_err(DiagError::Netlink)?;
    // The kernel answers within the send: never wait for it.
    let mut buf = [0u8; 1024];
    let n = recv(nl.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT).map_err(DiagError::Netlink)?;
    parse(&buf[..n], ino)
}

fn request(ino: u32) -> [u8; NLMSG_HDR + REQ_LEN] {
    let mut r = [0u8; NLMSG_HDR + REQ_LEN];
    r[0..4].copy_from_slice(&((NLMSG_HDR + REQ_LEN) as u32).to_ne_bytes());
    r[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    r[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    r[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // unix_diag_req: family, protocol, pad, states (all), inode, what to show, and no
    // cookie (both words all ones).
    r[16] = libc::AF_UNIX as u8;
    r[20..24].copy_from_slice(&u32::MAX.to_ne_bytes());
    r[24..28].copy_from_slice(&ino.to_ne_bytes());
    r[28..32].copy_from_slice(&UDIAG_SHOW_VFS.to_ne_bytes());
    r[32..40].fill(0xff);
    r
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Reads the answer about socket `ino`: an error, or its `UNIX_DIAG_VFS` attribute.
fn parse(b: &[u8], ino: u32) -> Result<FileId, DiagError> {
    let len = u32_at(b, 0).ok_or(DiagError::Malformed("short header"))? as usize;
    let b = b
        .get(..len)
        .ok_or(DiagError::Malformed("truncated message"))?;
    match u16_at(b, 4) {
        Some(NLMSG_ERROR) => {
            let errno = u32_at(b, NLMSG_HDR).ok_or(DiagError::Malformed("short error"))? as i32;
            return Err(DiagError::Answer(nix::Error::from_raw(-errno)));
        }
        Some(SOCK_DIAG_BY_FAMILY) => {}
        _ => return Err(DiagError::Malformed("unexpected message type")),
    }
    if u32_at(b, NLMSG_HDR + 4) != Some(ino) {
        return Err(DiagError::Malformed("an answer about another socket"));
    }
    let mut at = NLMSG_HDR + MSG_LEN;
    while let (Some(alen), Some(kind)) = (u16_at(b, at), u16_at(b, at + 2).map(|k| k & 0x3fff)) {
        let alen = alen as usize;
        if alen < 4 {
            return Err(DiagError::Malformed("attribute length"));
        }
        if kind == UNIX_DIAG_VFS {
            let (vino, vdev) = (u32_at(b, at + 4), u32_at(b, at + 8));
            let (vino, vdev) = vino
                .zip(vdev)
                .ok_or(DiagError::Malformed("short UNIX_DIAG_VFS"))?;
            // The kernel's internal dev_t: 12 bits of major above 20 bits of minor.
            let dev = nix::sys::stat::makedev(u64::from(vdev >> 20), u64::from(vdev & 0xfffff));
            return Ok(FileId {
                dev,
                ino: u64::from(vino),
            });
        }
        at += alen.next_multiple_of(4);
    }
    Err(DiagError::NotBound)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::{UnixDatagram, UnixListener};

    use super::*;

    #[test]
    fn the_kernel_names_the_file_a_socket_was_bound_to_even_after_the_path_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let first = UnixListener::bind(&path).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        let bound = bound_file(first.as_fd()).unwrap();
        assert_eq!(
            bound,
            FileId {
                dev: m.dev(),
                ino: u64::from(m.ino() as u32)
            }
        );
        // Replaced at the same path: the first socket still says the first file.
        std::fs::remove_file(&path).unwrap();
        let second = UnixListener::bind(&path).unwrap();
        let m2 = std::fs::symlink_metadata(&path).unwrap();
        assert_ne!(m2.ino(), m.ino());
        assert_eq!(bound_file(first.as_fd()).unwrap(), bound);
        assert_eq!(
            bound_file(second.as_fd()).unwrap().ino,
            u64::from(m2.ino() as u32)
        );
        // A socket bound to no file has nothing to show.
        let (a, _b) = UnixDatagram::pair().unwrap();
        assert!(
            matches!(bound_file(a.as_fd()), Err(DiagError::NotBound)),
            "{:?}",
            bound_file(a.as_fd())
        );
    }

    #[test]
    fn malformed_answers_are_refused() {
        let mut err = vec![0u8; 36];
        err[0..4].copy_from_slice(&36u32.to_ne_bytes());
        err[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        err[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert!(matches!(
            parse(&err, 7),
            Err(DiagError::Answer(nix::Error::ENOENT))
        ));
        let mut other = vec![0u8; 32];
        other[0..4].copy_from_slice(&32u32.to_ne_bytes());
        other[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        other[20..24].copy_from_slice(&8u32.to_ne_bytes());
        assert!(matches!(parse(&other, 7), Err(DiagError::Malformed(_))));
        assert!(matches!(parse(&other, 8), Err(DiagError::NotBound)));
        assert!(matches!(
            parse(&other[..20], 8),
            Err(DiagError::Malformed(_))
        ));
        let mut bad_attr = other.clone();
        bad_attr.extend_from_slice(&[2, 0, 1, 0]);
        bad_attr[0..4].copy_from_slice(&36u32.to_ne_bytes());
        assert!(matches!(parse(&bad_attr, 8), Err(DiagError::Malformed(_))));
    }
}
