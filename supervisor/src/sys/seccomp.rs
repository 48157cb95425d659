//! The worker's seccomp filters (the policy is `shared_proto::seccomp`): installed in the
//! forked child after `PR_SET_NO_NEW_PRIVS` and before the exec, so the worker runs under
//! them from its first instruction and can never lift them; and the report of a worker
//! they killed.

use std::os::fd::OwnedFd;

use shared_proto::seccomp::{Filter, Killed, REPORT_LEN, sock_filter};

/// Installs `filter` on the calling thread (and so on what it execs), with the kernel's
/// log of every call it refuses or traps where the filter asks for it
/// (`SECCOMP_FILTER_FLAG_LOG`: audit records of type SECCOMP, with the pid, the call's
/// number and the action). Returns 0, or -1 with errno set. Needs `PR_SET_NO_NEW_PRIVS`
/// first; a raw call, so it may run in a forked child.
pub fn install(filter: &Filter) -> libc::c_long {
    let prog: &[sock_filter] = &filter.program;
    // seccompiler's `sock_filter` is the kernel's `struct sock_filter`, field for field.
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    let flags = if filter.log {
        libc::SECCOMP_FILTER_FLAG_LOG
    } else {
        0
    };
    // SAFETY: `fprog` points at `prog.len()` instructions that outlive the call; the
    // kernel copies the program.
    unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            flags,
            &fprog,
        )
    }
}

/// What a worker's SIGSYS handler wrote to its report pipe before it died, if anything.
pub fn report(pipe: &OwnedFd) -> Option<Killed> {
    let mut buf = [0u8; REPORT_LEN];
    let n = nix::unistd::read(pipe, &mut buf).ok()?;
    Killed::decode(&buf[..n])
}
