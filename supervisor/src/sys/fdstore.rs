//! systemd's file descriptor store, for nodes where the agent runs as a systemd unit.
//!
//! `systemctl restart` is a delete-then-create: between the old process's exit and the
//! new one's bind, nothing listens on `xds.sock`, and the proxy's reconnect is refused.
//! With `FileDescriptorStoreMax=` in the unit, the owner hands systemd duplicates of its
//! two listening sockets (`FDSTORE=1`, names `xds` and `cni`); systemd keeps them open
//! across the restart, so connects queue in their backlog, and passes them to the next
//! start through `LISTEN_FDS`/`LISTEN_FDNAMES`. The next supervisor holds them like
//! sockets handed off by a previous generation: used at lock acquisition only if each is
//! still the listener bound at its path. Without systemd (no `NOTIFY_SOCKET`, no
//! `LISTEN_PID`) none of this runs.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use nix::sys::socket::{AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, sendmsg, socket};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FdStoreError {
    #[error("LISTEN_FDS={0:?} is not a count")]
    Count(String),
    #[error("LISTEN_FDS={0}: at most 16 expected (this agent stores two)")]
    TooMany(usize),
    #[error("descriptor {fd} ({name:?}) from systemd: {reason}")]
    Inherited { fd: RawFd, name: String, reason: String },
    #[error("NOTIFY_SOCKET={path:?}: {source}")]
    Address { path: std::ffi::OsString, source: nix::Error },
    #[error("socket for NOTIFY_SOCKET: {0}")]
    Socket(nix::Error),
    #[error("sending {message:?} to NOTIFY_SOCKET={path:?}: {source}")]
    Send { message: String, path: std::ffi::OsString, source: nix::Error },
}

/// The names under which the owner stores its listeners.
pub const XDS: &str = "xds";
pub const CNI: &str = "cni";

/// The descriptors systemd passed this process (`sd_listen_fds`): (fd, name) from fd 3
/// on, or an error naming the variable at fault. Empty unless `LISTEN_PID` is `pid`.
pub fn listen_fds(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    names: Option<&str>,
    pid: u32,
) -> Result<Vec<(RawFd, String)>, FdStoreError> {
    if listen_pid.and_then(|p| p.parse::<u32>().ok()) != Some(pid) {
        return Ok(Vec::new());
    }
    let n: usize = match listen_fds {
        Some(v) => v.parse().map_err(|_| FdStoreError::Count(v.to_string()))?,
        None => return Ok(Vec::new()),
    };
    if n > 16 {
        return Err(FdStoreError::TooMany(n));
    }
    let names: Vec<&str> = names.map(|v| v.split(':').collect()).unwrap_or_default();
    Ok((0..n).map(|i| (3 + i as RawFd, names.get(i).copied().unwrap_or("unknown").to_string())).collect())
}

/// Takes the listeners systemd passed at start: `xds` and `cni`, each a stream socket
/// (checked, and made close-on-exec). Descriptors under other names are closed. Reads
/// `LISTEN_*` from the environment; call before any descriptor is opened or closed.
pub fn take_listeners() -> Result<(Option<OwnedFd>, Option<OwnedFd>), FdStoreError> {
    let var = |k: &str| std::env::var(k).ok();
    let fds = listen_fds(
        var("LISTEN_PID").as_deref(),
        var("LISTEN_FDS").as_deref(),
        var("LISTEN_FDNAMES").as_deref(),
        std::process::id(),
    )?;
    let (mut xds, mut cni) = (None, None);
    for (fd, name) in fds {
        let owned = shared_proto::fdpass::take_inherited(fd, SockType::Stream)
            .map_err(|e| FdStoreError::Inherited { fd, name: name.clone(), reason: e.to_string() })?;
        match name.as_str() {
            XDS => xds = Some(owned),
            CNI => cni = Some(owned),
            // Not ours to keep: dropping closes it.
            _ => tracing::warn!(fd, name, "systemd passed a descriptor this agent does not use; closed"),
        }
    }
    Ok((xds, cni))
}

/// Stores the listeners in systemd's fd store, replacing any stored under the same
/// names. Returns false when not under systemd (no `NOTIFY_SOCKET`).
pub fn store(xds: BorrowedFd<'_>, cni: BorrowedFd<'_>) -> Result<bool, FdStoreError> {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return Ok(false) };
    let bytes = path.as_bytes();
    let addr = match bytes.strip_prefix(b"@") {
        Some(abstract_name) => UnixAddr::new_abstract(abstract_name),
        None => UnixAddr::new(bytes),
    }
    .map_err(|source| FdStoreError::Address { path: path.clone(), source })?;
    let sock = socket(AddressFamily::Unix, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None).map_err(FdStoreError::Socket)?;
    let send = |msg: String, fd: Option<BorrowedFd<'_>>| {
        let raw = fd.map(|f| [f.as_raw_fd()]);
        let cmsgs: Vec<ControlMessage<'_>> = raw.as_ref().map(|r| ControlMessage::ScmRights(r)).into_iter().collect();
        sendmsg(sock.as_raw_fd(), &[IoSlice::new(msg.as_bytes())], &cmsgs, MsgFlags::empty(), Some(&addr))
            .map(drop)
            .map_err(|source| FdStoreError::Send { message: msg.replace('\n', " "), path: path.clone(), source })
    };
    for (name, fd) in [(XDS, xds), (CNI, cni)] {
        send(format!("FDSTOREREMOVE=1\nFDNAME={name}"), None)?;
        send(format!("FDSTORE=1\nFDNAME={name}"), Some(fd))?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_fds_are_ours_only_when_listen_pid_is_our_pid() {
        type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<&'a str>, Result<Vec<(RawFd, String)>, &'a str>);
        let cases: Vec<Case> = vec![
            (None, Some("2"), Some("xds:cni"), Ok(vec![])),
            (Some("41"), Some("2"), Some("xds:cni"), Ok(vec![])),
            (Some("42"), None, None, Ok(vec![])),
            (Some("42"), Some("2"), Some("xds:cni"), Ok(vec![(3, "xds".into()), (4, "cni".into())])),
            (Some("42"), Some("2"), Some("cni"), Ok(vec![(3, "cni".into()), (4, "unknown".into())])),
            (Some("42"), Some("two"), None, Err("LISTEN_FDS=\"two\" is not a count")),
            (Some("42"), Some("99"), None, Err("LISTEN_FDS=99")),
        ];
        for (pid, n, names, want) in cases {
            let got = listen_fds(pid, n, names, 42);
            match want {
                Ok(v) => assert_eq!(got, Ok(v), "{pid:?} {n:?} {names:?}"),
                Err(e) => assert!(got.as_ref().is_err_and(|g| g.to_string().contains(e)), "{pid:?} {n:?}: {got:?}"),
            }
        }
    }
}
