//! The worker's seccomp filters (the policy and its raw installation are
//! `shared_proto::seccomp`): installed in the forked child after `PR_SET_NO_NEW_PRIVS` and
//! before the exec, so the worker runs under them from its first instruction and can never
//! lift them; and the report of a worker they killed.

use std::os::fd::OwnedFd;

pub use shared_proto::seccomp::install;
use shared_proto::seccomp::{Killed, REPORT_LEN};

/// What a worker's SIGSYS handler wrote to its report pipe before it died, if anything.
pub fn report(pipe: &OwnedFd) -> Option<Killed> {
    let mut buf = [0u8; REPORT_LEN];
    let n = nix::unistd::read(pipe, &mut buf).ok()?;
    Killed::decode(&buf[..n])
}
