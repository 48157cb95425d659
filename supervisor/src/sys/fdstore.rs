//! systemd's file descriptor store, for nodes where the agent runs as a systemd unit.
//!
//! `systemctl restart` is a delete-then-create: between the old process's exit and the
//! new one's bind, nothing listens on `xds.sock`, and the proxy's reconnect is refused.
//! With `FileDescriptorStoreMax=` in the unit, the owner hands systemd duplicates of its
//! two listening sockets (`FDSTORE=1`, names `xds` and `cni`); systemd keeps them open
//! across the restart, so connects queue in their backlog, and passes them to the next
//! start through `LISTEN_FDS`/`LISTEN_FDNAMES`. The next supervisor holds them like
//! sockets handed off by a previous generation: used at lock acquisition only if the
//! kernel says each is still the socket bound at its path (`listen::listener_at`).
//! Without systemd (no `NOTIFY_SOCKET`, no `LISTEN_PID`) none of this runs. The protocol
//! itself is the `sd-notify` crate's.

use std::os::fd::{BorrowedFd, OwnedFd, RawFd};

use nix::sys::socket::SockType;
use sd_notify::NotifyState;

#[derive(Debug, thiserror::Error)]
pub enum FdStoreError {
    #[error("LISTEN_PID/LISTEN_FDS/LISTEN_FDNAMES: {0}")]
    Listen(std::io::Error),
    #[error("LISTEN_FDS={0}: at most {MAX} expected (this agent stores two)")]
    TooMany(usize),
    #[error("descriptor {fd} ({name:?}) from systemd: {reason}")]
    Inherited {
        fd: RawFd,
        name: String,
        reason: String,
    },
    #[error("{name:?} in systemd's fd store: {source}")]
    Store {
        name: &'static str,
        source: std::io::Error,
    },
}

/// The names under which the owner stores its listeners.
pub const XDS: &str = "xds";
pub const CNI: &str = "cni";
/// More than this many descriptors from systemd is not this unit's store.
const MAX: usize = 16;

/// Takes the listeners systemd passed at start: `xds` and `cni`, each a stream socket
/// (checked, and made close-on-exec). Descriptors under other names are closed. Reads
/// `LISTEN_*` from the environment (only when `LISTEN_PID` is this process); call before
/// any descriptor is opened or closed.
pub fn take_listeners() -> Result<(Option<OwnedFd>, Option<OwnedFd>), FdStoreError> {
    let fds = sd_notify::listen_fds_with_names().map_err(FdStoreError::Listen)?;
    if fds.len() > MAX {
        return Err(FdStoreError::TooMany(fds.len()));
    }
    let (mut xds, mut cni) = (None, None);
    for (fd, name) in fds {
        let owned = shared_proto::fdpass::take_inherited(fd, SockType::Stream).map_err(|e| {
            FdStoreError::Inherited {
                fd,
                name: name.clone(),
                reason: e.to_string(),
            }
        })?;
        match name.as_str() {
            XDS => xds = Some(owned),
            CNI => cni = Some(owned),
            // Not ours to keep: dropping closes it.
            _ => tracing::warn!(
                fd,
                name,
                "systemd passed a descriptor this agent does not use; closed"
            ),
        }
    }
    Ok((xds, cni))
}

/// Removes whatever is stored under both names, closing systemd's copies.
pub fn remove() -> Result<(), FdStoreError> {
    for name in [XDS, CNI] {
        sd_notify::notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(name)])
            .map_err(|source| FdStoreError::Store { name, source })?;
    }
    Ok(())
}

/// Stores the listeners in systemd's fd store, replacing any stored under the same
/// names. Returns false when not under systemd (no `NOTIFY_SOCKET`).
pub fn store(xds: BorrowedFd<'_>, cni: BorrowedFd<'_>) -> Result<bool, FdStoreError> {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return Ok(false);
    }
    for (name, fd) in [(XDS, xds), (CNI, cni)] {
        let err = |source| FdStoreError::Store { name, source };
        sd_notify::notify(&[NotifyState::FdStoreRemove, NotifyState::FdName(name)]).map_err(err)?;
        sd_notify::notify_with_fds(&[NotifyState::FdStore, NotifyState::FdName(name)], &[fd])
            .map_err(err)?;
    }
    Ok(true)
}
