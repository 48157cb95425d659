//! Taking the node once its lock is ours: the listeners (those held for the takeover if
//! each is still the socket bound at its path, else fresh ones, once no lock-less server
//! answers there), the generation record, and `handoff.sock` for the next generation.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Instant;

use nix::sys::socket::SockType;
use tracing::{info, warn};

use shared_proto::handoff::{self, Held, Listeners, PathIds};

use crate::config::Config;
use crate::lifecycle::{Took, micros};
use crate::sys::listen::{self, ListenError};
use crate::sys::lock::{self, LockError};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot bind the node sockets: {0}")]
    Listen(#[from] ListenError),
    #[error("cannot record the generation: {0}")]
    Lock(#[from] LockError),
}

/// The node, owned.
#[derive(Debug)]
pub struct Node {
    /// The read-only lock descriptor, shared with the worker.
    pub lock: File,
    pub listeners: Listeners,
    /// `handoff.sock`'s listener (non-blocking); none if it could not be bound.
    pub handoff: Option<OwnedFd>,
    /// The generation this supervisor took it as.
    pub generation: u64,
}

impl Node {
    /// The descriptors a Takeover carries, in its order.
    pub fn takeover_fds(&self) -> [BorrowedFd<'_>; 3] {
        [
            self.lock.as_fd(),
            self.listeners.xds.as_fd(),
            self.listeners.cni.as_fd(),
        ]
    }

    /// Unlocks the node, so that the standby takes it over now while the drained
    /// worker's proxy streams still serve. The listeners and `handoff.sock` stay open
    /// until this supervisor exits: a supervisor that won the lock at its start, ahead of
    /// the standby that waited for it (flock grants no order), holds no sockets and takes
    /// them from here, instead of waiting for every holder of them to exit and binding
    /// fresh ones, which refuses connects meanwhile.
    pub fn release(&self) {
        match self.lock.unlock() {
            Ok(()) => info!(
                "node lock released; the worker keeps its proxy streams until the successor serves"
            ),
            // Closing the descriptor releases it too, once the worker's copy is gone.
            Err(e) => {
                warn!(error = %e, "unlocking the node lock failed; it is released when the descriptor closes")
            }
        }
    }
}

pub enum Outcome {
    Taken(Node, Took),
    /// A server without the lock still answers on `path`.
    Blocked {
        lock: lock::Held,
        path: PathBuf,
    },
}

/// What taking the node needs: paths, owners and the generation record.
pub struct Taker {
    xds: PathBuf,
    cni: PathBuf,
    handoff: PathBuf,
    keeper: PathBuf,
    /// The supervisor's euid and egid.
    owner: (u32, u32),
    /// `xds.sock`'s group: the proxy connects as a member of the worker's group.
    xds_group: u32,
    generation: lock::Generation,
}

impl Taker {
    pub fn new(
        cfg: &Config,
        owner: (u32, u32),
        worker: Option<(u32, u32)>,
        generation: lock::Generation,
    ) -> Self {
        Self {
            xds: cfg.xds_path(),
            cni: cfg.cni_path(),
            handoff: cfg.handoff_path(),
            keeper: cfg.keeper_path(),
            owner,
            xds_group: worker.map_or(owner.1, |(_, gid)| gid),
            generation,
        }
    }

    pub fn take(
        &self,
        lock: lock::Held,
        held: Option<Held>,
        ask_keeper: bool,
        since: Instant,
    ) -> Result<Outcome, NodeError> {
        // No owner handed its sockets over (a delete-then-create roll, a killed generation,
        // or this supervisor won the lock over a waiting standby while the previous owner
        // drains): that owner, still draining, the one it took them from (released, still
        // draining, at `handoff-released.sock`) or the node's socket keeper may hold them.
        // Each source, and whether it is the keeper (which goes on holding what it offers).
        let released = released_path(&self.handoff);
        let sources = [
            (&self.handoff, "the draining owner", false),
            (&released, "the released owner", false),
            (&self.keeper, "the socket keeper", true),
        ];
        let (held, kept) = match held {
            Some(h) => (Some(h), false),
            None if ask_keeper => {
                let offer = sources
                    .iter()
                    .find_map(|&(path, from, kept)| Some((self.offer_from(path, from)?, kept)));
                offer.map_or((None, false), |(h, kept)| (Some(h), kept))
            }
            None => (None, false),
        };
        let held = held.filter(|h| match self.verify(&h.listeners) {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "handed-off sockets no longer match their paths; binding fresh ones");
                false
            }
        });
        let handed_off = held.is_some();
        let listeners = match held {
            Some(h) => h.listeners,
            None => match self.bind_fresh() {
                Ok(l) => l,
                Err(ListenError::LiveServer { path }) => {
                    return Ok(Outcome::Blocked { lock, path });
                }
                Err(e) => return Err(e.into()),
            },
        };
        let bind = since.elapsed();
        let generation = self.generation.bump(&lock.file)?;
        let handoff = match bind_handoff(&self.handoff, self.owner) {
            Ok(b) => {
                let _ = nix::fcntl::fcntl(
                    &b.fd,
                    nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
                );
                Some(b.fd)
            }
            Err(e) => {
                // Without it the next roll binds fresh sockets: slower, still correct.
                warn!(error = %e, "cannot open the handoff socket; the next generation will bind fresh sockets");
                None
            }
        };
        info!(
            generation,
            handed_off,
            bind_us = micros(bind),
            "this agent owns the node"
        );
        let took = Took {
            generation,
            handed_off,
            kept: handed_off && kept,
            uncontended: lock.uncontended,
            lock_wait: lock.waited,
            bind,
        };
        Ok(Outcome::Taken(
            Node {
                lock: lock.file,
                listeners,
                handoff,
                generation,
            },
            took,
        ))
    }

    fn verify(&self, l: &Listeners) -> Result<(), ListenError> {
        listen::verify_held(&l.xds, &self.xds, l.paths.xds)?;
        listen::verify_held(&l.cni, &self.cni, l.paths.cni)
    }

    /// The node sockets offered on `path` (`handoff.sock`, `handoff-released.sock` or
    /// `keeper.sock`), checked against the node's socket paths: `Ok(None)` when nothing
    /// there offers them. The one fetch of the supervisor, for a standby's warm hold and
    /// for a takeover.
    pub fn fetch(&self, path: &Path) -> Result<Option<Held>, handoff::HandoffError> {
        handoff::fetch(path, &self.xds, &self.cni, false)
    }

    /// The listeners offered on `path` by `from`, for a takeover.
    fn offer_from(&self, path: &Path, from: &str) -> Option<Held> {
        // An error also when the keeper holds nothing yet: it then closes the connection.
        let offered = self.fetch(path);
        let h = offered.inspect_err(|e| info!(error = %e, "no node sockets from {from}"));
        let h = h.ok()??;
        info!(
            generation = h.generation,
            "taking the node sockets from {from}"
        );
        Some(h)
    }

    fn bind_fresh(&self) -> Result<Listeners, ListenError> {
        for p in [&self.xds, &self.cni] {
            if listen::live_server(p)? {
                return Err(ListenError::LiveServer { path: p.clone() });
            }
        }
        // xds.sock: the proxy connects as a member of the worker's group (the chart gives
        // Envoy that supplementary group). cni.sock: only the runtime's CNI plugin, root.
        let x = listen::bind_fresh(
            &self.xds,
            SockType::Stream,
            0o660,
            (self.owner.0, self.xds_group),
        )?;
        let c = listen::bind_fresh(&self.cni, SockType::Stream, 0o600, self.owner)?;
        Ok(Listeners {
            xds: x.fd,
            cni: c.fd,
            paths: PathIds {
                xds: x.id,
                cni: c.id,
            },
        })
    }
}

/// The listeners systemd kept in its fd store across a restart, held like sockets handed
/// off by a previous generation: each must be the listener bound at its path, by the
/// kernel's record of its bind (`listen::listener_at`), as again at the takeover. Refused
/// ones are also removed from the store: systemd's own copies would otherwise keep
/// taking connects at the paths, and a fresh bind would wait for them forever.
pub fn held_from_systemd(
    xds_path: &Path,
    cni_path: &Path,
    fds: (Option<OwnedFd>, Option<OwnedFd>),
) -> Option<Held> {
    let refused = match fds {
        (None, None) => return None,
        (Some(xds), Some(cni)) => {
            let ids = listen::listener_at("xds.sock from systemd", &xds, xds_path).and_then(|x| {
                Ok(PathIds {
                    xds: x,
                    cni: listen::listener_at("cni.sock from systemd", &cni, cni_path)?,
                })
            });
            match ids {
                Ok(paths) => {
                    info!("holding the node sockets systemd kept in its fd store");
                    return Some(Held {
                        generation: 0,
                        listeners: Listeners { xds, cni, paths },
                    });
                }
                Err(e) => e.to_string(),
            }
        }
        _ => "systemd passed one of the two".into(),
    };
    warn!(error = %refused, "the sockets from systemd's fd store are not this node's; binding fresh ones at takeover");
    if let Err(e) = crate::sys::fdstore::remove() {
        warn!(error = %e, "cannot remove them from systemd's fd store");
    }
    None
}

/// Where the previous owner's `handoff.sock` goes when the next one binds its own.
pub fn released_path(handoff: &Path) -> PathBuf {
    handoff.with_file_name("handoff-released.sock")
}

/// Binds this generation's `handoff.sock`, first moving the socket file there, the
/// previous owner's, to [`released_path`] rather than removing it. A released owner keeps
/// offering the node sockets until it exits; should this supervisor die before its worker
/// serves, the agent that takes the node next without sockets of its own takes them from
/// there, instead of waiting for that owner to exit and binding fresh ones (which refuses
/// the proxy's connects meanwhile).
fn bind_handoff(path: &Path, owner: (u32, u32)) -> Result<listen::Bound, ListenError> {
    if std::fs::symlink_metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        let released = released_path(path);
        if let Err(e) = std::fs::rename(path, &released) {
            // bind_fresh replaces it: a taker then finds the released owner's sockets no more.
            warn!(error = %e, from = %path.display(), to = %released.display(), "cannot move the previous handoff socket aside");
        }
    }
    Ok(listen::bind_fresh(path, SockType::SeqPacket, 0o600, owner)?)
}

/// Removes [`released_path`] once this generation's worker serves: its own `handoff.sock`
/// offers the node sockets, and the released owner exits as the proxy reconnects here.
pub fn forget_released(handoff: &Path) {
    let released = released_path(handoff);
    match std::fs::symlink_metadata(&released) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            if let Err(e) = std::fs::remove_file(&released) {
                warn!(error = %e, path = %released.display(), "cannot remove the released owner's handoff socket");
            }
        }
        Ok(_) => warn!(path = %released.display(), "not a socket; left as it is"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(error = %e, path = %released.display(), "cannot look at the released owner's handoff socket")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use nix::sys::socket::{AddressFamily, SockFlag, UnixAddr, connect, socket};

    use super::*;

    fn dial(path: &Path) -> nix::Result<OwnedFd> {
        let s = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )?;
        connect(s.as_raw_fd(), &UnixAddr::new(path)?)?;
        Ok(s)
    }

    fn nonblocking(fd: &OwnedFd) {
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        )
        .unwrap();
    }

    /// A new owner's `handoff.sock` moves the previous owner's aside, where it still
    /// answers: an agent that takes the node after the new owner died reaches it there.
    #[test]
    fn binding_handoff_sock_keeps_the_previous_owners_listener_reachable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handoff.sock");
        let me = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let old = bind_handoff(&path, me).unwrap();
        assert!(
            !released_path(&path).exists(),
            "nothing to move aside at the first bind"
        );
        let new = bind_handoff(&path, me).unwrap();
        nonblocking(&old.fd);
        nonblocking(&new.fd);
        let _a = dial(&released_path(&path)).expect("the released listener answers");
        assert!(
            handoff::accept(&old.fd).is_some(),
            "the dial at handoff-released.sock reached the old listener"
        );
        assert!(
            handoff::accept(&new.fd).is_none(),
            "the new listener got the dial meant for the old one"
        );
        let _b = dial(&path).expect("the new listener answers");
        assert!(
            handoff::accept(&new.fd).is_some(),
            "the dial at handoff.sock reached the new listener"
        );
        assert!(
            handoff::accept(&old.fd).is_none(),
            "the old listener still answers at handoff.sock"
        );
        // Once the old owner is gone its file refuses: a taker goes on to the socket keeper.
        drop(old);
        assert_eq!(
            dial(&released_path(&path)).err(),
            Some(nix::errno::Errno::ECONNREFUSED)
        );
        // The new generation serves: the file goes, the new handoff.sock stays.
        forget_released(&path);
        assert!(
            !released_path(&path).exists(),
            "handoff-released.sock left after the new owner serves"
        );
        assert!(dial(&path).is_ok(), "handoff.sock went with it");
    }

    /// Whatever else is at handoff-released.sock is not the supervisor's to remove.
    #[test]
    fn only_a_socket_file_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("handoff.sock");
        std::fs::write(released_path(&path), b"not a socket").unwrap();
        forget_released(&path);
        assert!(
            released_path(&path).exists(),
            "a regular file at handoff-released.sock was removed"
        );
        forget_released(&dir.path().join("missing/handoff.sock"));
    }
}
