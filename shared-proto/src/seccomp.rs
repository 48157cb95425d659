//! The worker's system-call policy, in one place for the two processes that apply it: the
//! supervisor installs [`worker_filters`] in the forked child before the exec, and the
//! worker, once running, adds [`exec_filter`] and its SIGSYS handler ([`confine`]).
//!
//! Four filters, because a seccompiler filter has one action on a match and one otherwise,
//! and the kernel applies the most severe action any installed filter returns (and, among
//! equal ones, the newest filter's, whose log flag then decides whether it is logged):
//! - the allow list: what the worker was measured to call (ARCHITECTURE.md, "The worker's
//!   system calls"), with argument rules for `socket`, `socketpair`, `ioctl`, `clone`,
//!   `prctl` and `seccomp`. Anything else fails with ENOSYS, as on a kernel without the
//!   call, so that a library falls back or reports an error instead of the worker dying;
//!   the kernel logs each such refusal;
//! - the expected refusal: `clone3` fails with ENOSYS too, unlogged, as at every thread
//!   start glibc tries it before `clone`, whose flags a filter can read;
//! - the kill set: what only a compromised worker calls (tracing, namespaces, mounts,
//!   `bpf`, socket families outside the allow list, TIOCSTI) raises SIGSYS (RET_TRAP);
//! - once the worker runs: `execve`, `execveat`, and replacing the SIGSYS handler.
//!
//! The SIGSYS handler writes the call and its first two arguments to the report pipe at
//! [`REPORT_FD`], whose read end the supervisor keeps, and the worker then dies of SIGSYS;
//! the supervisor names the call from that report ([`Killed`]).
//!
//! `unsafe` here: the handler, which reads the kernel's siginfo and ucontext and makes
//! only async-signal-safe raw calls, its installation, and owning the inherited pipe.

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

use libc::c_long;
use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

pub use seccompiler::{BpfProgram, sock_filter};

/// The worker's descriptor for the write end of the report pipe.
pub const REPORT_FD: RawFd = 4;

/// What a call outside the allow list returns.
pub const REFUSED: i32 = libc::ENOSYS;

/// One report: the call's number (i32) and its first two arguments (u64 each).
pub const REPORT_LEN: usize = 20;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("installing the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
    #[error("sigaction(SIGSYS): {0}")]
    Handler(nix::Error),
    #[error("prctl(PR_SET_NO_NEW_PRIVS): {0}")]
    NoNewPrivs(nix::Error),
    #[error("seccomp(SECCOMP_SET_MODE_FILTER): {0}")]
    Kernel(nix::Error),
}

/// The socket families the worker opens: unix sockets, IP, and AF_NETLINK, where glibc's
/// resolver reads the host's addresses (NETLINK_ROUTE only) to order a name's addresses
/// when it has more than one.
const FAMILIES: [i32; 4] = [
    libc::AF_UNIX,
    libc::AF_INET,
    libc::AF_INET6,
    libc::AF_NETLINK,
];

/// The ioctls the worker makes: `isatty` (TCGETS), tokio's FIONBIO, and FIONREAD in
/// glibc's resolver.
const IOCTLS: [libc::Ioctl; 3] = [libc::TCGETS, libc::FIONBIO, libc::FIONREAD];

/// Every `CLONE_NEW*` flag.
const CLONE_NAMESPACES: [i32; 8] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWCGROUP,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWTIME,
];

/// The calls allowed whatever their arguments, as measured.
const ALLOWED: &[c_long] = &[
    // Memory, threads and process start: the loader, glibc and Rust's runtime.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    // Seen refused (the kernel's audit log, 2026-12-05): glibc's realloc of a large
    // (mmapped) buffer, as the encodings and messages at 10,000 services grow, which
    // without it falls back to a new mapping and a copy of the whole buffer.
    libc::SYS_mremap,
    // Seen refused likewise: std's channel backs off with sched_yield (the heavy-work
    // thread's queue, the relay's runtime).
    libc::SYS_sched_yield,
    libc::SYS_set_tid_address,
    libc::SYS_set_robust_list,
    libc::SYS_rseq,
    libc::SYS_prlimit64,
    libc::SYS_sched_getaffinity,
    libc::SYS_getrandom,
    libc::SYS_futex,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_restart_syscall,
    libc::SYS_getpid,
    libc::SYS_gettid,
    // Signals. Not measured but part of the mechanism: rt_sigreturn ends any handler, and
    // tgkill raises abort(3)'s signal and the SIGSYS handler's.
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    // Not measured: the vDSO's calls become system calls where the clock source has no
    // vDSO support, and Rust's `Instant::now` panics if they fail.
    libc::SYS_clock_gettime,
    libc::SYS_gettimeofday,
    // Files: pod records and state, the health socket, watched files.
    libc::SYS_openat,
    libc::SYS_close,
    libc::SYS_read,
    libc::SYS_pread64,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_getdents64,
    libc::SYS_fcntl,
    libc::SYS_fsync,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_add_watch,
    // The event loop.
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_eventfd2,
    // Sockets (`socket` and `socketpair` by family, below).
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_shutdown,
    // glibc's resolver: parallel A and AAAA queries, its configuration files, the host name.
    libc::SYS_sendmmsg,
    libc::SYS_lseek,
    libc::SYS_uname,
    // The supervisor's exec of the worker; the worker's own filter kills it afterwards.
    libc::SYS_execveat,
];

/// The calls glibc makes on x86-64 in their older form; aarch64 has only the `*at` and
/// `p*` forms, which are listed there in their place (not measured on aarch64).
#[cfg(target_arch = "x86_64")]
const ALLOWED_ARCH: &[c_long] = &[
    libc::SYS_arch_prctl,
    libc::SYS_access,
    libc::SYS_mkdir,
    libc::SYS_rename,
    libc::SYS_unlink,
    libc::SYS_chmod,
    libc::SYS_poll,
    libc::SYS_epoll_wait,
];
#[cfg(target_arch = "aarch64")]
const ALLOWED_ARCH: &[c_long] = &[
    libc::SYS_faccessat,
    libc::SYS_mkdirat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlinkat,
    libc::SYS_fchmodat,
    libc::SYS_ppoll,
    libc::SYS_epoll_pwait,
];

/// The calls that kill the worker whatever their arguments.
const KILLED: &[(&str, c_long)] = &[
    ("ptrace", libc::SYS_ptrace),
    ("unshare", libc::SYS_unshare),
    ("setns", libc::SYS_setns),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("open_tree", libc::SYS_open_tree),
    ("move_mount", libc::SYS_move_mount),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("bpf", libc::SYS_bpf),
];

/// The calls that kill the worker for some arguments only (see [`kill_filter`]).
const KILLED_BY_ARGUMENT: &[(&str, c_long)] = &[
    ("socket", libc::SYS_socket),
    ("socketpair", libc::SYS_socketpair),
    ("clone", libc::SYS_clone),
    ("ioctl", libc::SYS_ioctl),
];

/// The calls the worker's own filter kills.
const KILLED_ONCE_RUNNING: &[(&str, c_long)] = &[
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("rt_sigaction", libc::SYS_rt_sigaction),
];

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, Error> {
    // Every argument compared here is an int or unsigned int (a family, a flag word whose
    // CLONE_* bits are all in its low half, an ioctl request, a signal): the kernel reads
    // only the low 32 bits, so the filter compares those.
    Ok(SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        op,
        value,
    )?)
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, Error> {
    Ok(SeccompRule::new(conditions)?)
}

fn compile(
    rules: Vec<(c_long, Vec<SeccompRule>)>,
    otherwise: SeccompAction,
    on_match: SeccompAction,
) -> Result<BpfProgram, Error> {
    let arch: seccompiler::TargetArch = std::env::consts::ARCH.try_into()?;
    Ok(SeccompFilter::new(rules.into_iter().collect(), otherwise, on_match, arch)?.try_into()?)
}

/// The allow list: a match is allowed, anything else fails with [`REFUSED`].
pub fn allow_filter() -> Result<BpfProgram, Error> {
    use SeccompCmpOp::{Eq, MaskedEq};
    let mut rules: Vec<(c_long, Vec<SeccompRule>)> = ALLOWED
        .iter()
        .chain(ALLOWED_ARCH)
        .map(|&nr| (nr, vec![]))
        .collect();
    let family = |f: i32| rule(vec![cond(0, Eq, f as u64)?]);
    let netlink_route = rule(vec![
        cond(0, Eq, libc::AF_NETLINK as u64)?,
        cond(2, Eq, libc::NETLINK_ROUTE as u64)?,
    ])?;
    let mut sockets = [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6]
        .iter()
        .map(|&f| family(f))
        .collect::<Result<Vec<_>, _>>()?;
    sockets.push(netlink_route);
    rules.push((libc::SYS_socket, sockets));
    rules.push((libc::SYS_socketpair, vec![family(libc::AF_UNIX)?]));
    rules.push((
        libc::SYS_ioctl,
        IOCTLS
            .iter()
            .map(|&r| rule(vec![cond(1, Eq, r)?]))
            .collect::<Result<_, _>>()?,
    ));
    // Threads only: CLONE_THREAD set and no namespace flag. No fork, so the worker has no
    // child process that would outlive it.
    let namespaces = CLONE_NAMESPACES.iter().fold(0, |all, &f| all | f as u64);
    let thread = libc::CLONE_THREAD as u64;
    rules.push((
        libc::SYS_clone,
        vec![rule(vec![
            cond(0, MaskedEq(thread), thread)?,
            cond(0, MaskedEq(namespaces), 0)?,
        ])?],
    ));
    // Thread names, and what the worker needs to add its own filter.
    let prctls = [libc::PR_SET_NAME, libc::PR_SET_NO_NEW_PRIVS];
    rules.push((
        libc::SYS_prctl,
        prctls
            .iter()
            .map(|&o| rule(vec![cond(0, Eq, o as u64)?]))
            .collect::<Result<_, _>>()?,
    ));
    rules.push((
        libc::SYS_seccomp,
        vec![rule(vec![cond(
            0,
            Eq,
            u64::from(libc::SECCOMP_SET_MODE_FILTER),
        )?])?],
    ));
    compile(
        rules,
        SeccompAction::Errno(REFUSED as u32),
        SeccompAction::Allow,
    )
}

/// The kill set: a match raises SIGSYS, anything else is left to the allow list.
pub fn kill_filter() -> Result<BpfProgram, Error> {
    use SeccompCmpOp::{Eq, MaskedEq, Ne};
    let mut rules: Vec<(c_long, Vec<SeccompRule>)> =
        KILLED.iter().map(|&(_, nr)| (nr, vec![])).collect();
    let other_family = || {
        rule(
            FAMILIES
                .iter()
                .map(|&f| cond(0, Ne, f as u64))
                .collect::<Result<_, _>>()?,
        )
    };
    rules.push((libc::SYS_socket, vec![other_family()?]));
    rules.push((libc::SYS_socketpair, vec![other_family()?]));
    let namespace = |f: i32| rule(vec![cond(0, MaskedEq(f as u64), f as u64)?]);
    rules.push((
        libc::SYS_clone,
        CLONE_NAMESPACES
            .iter()
            .map(|&f| namespace(f))
            .collect::<Result<_, _>>()?,
    ));
    rules.push((
        libc::SYS_ioctl,
        vec![rule(vec![cond(1, Eq, libc::TIOCSTI)?])?],
    ));
    compile(rules, SeccompAction::Allow, SeccompAction::Trap)
}

/// What the worker adds once it runs: exec, and a new SIGSYS disposition (which would let
/// it survive the kill set), raise SIGSYS.
pub fn exec_filter() -> Result<BpfProgram, Error> {
    use SeccompCmpOp::{Eq, Ne};
    let sigsys = rule(vec![
        cond(0, Eq, libc::SIGSYS as u64)?,
        // A query (no new action) is harmless. The action is a pointer: all 64 bits.
        SeccompCondition::new(1, SeccompCmpArgLen::Qword, Ne, 0)?,
    ])?;
    let rules = vec![
        (libc::SYS_execve, vec![]),
        (libc::SYS_execveat, vec![]),
        (libc::SYS_rt_sigaction, vec![sigsys]),
    ];
    compile(rules, SeccompAction::Allow, SeccompAction::Trap)
}

/// The expected refusal: `clone3` fails with ENOSYS, anything else is left to the others.
pub fn quiet_filter() -> Result<BpfProgram, Error> {
    compile(
        vec![(libc::SYS_clone3, vec![])],
        SeccompAction::Allow,
        SeccompAction::Errno(REFUSED as u32),
    )
}

/// A filter for the supervisor to install.
pub struct Filter {
    pub program: BpfProgram,
    /// Whether the kernel logs what this filter refuses or traps (SECCOMP_FILTER_FLAG_LOG).
    pub log: bool,
}

/// The filters the supervisor installs before the exec, in order.
pub fn worker_filters() -> Result<[Filter; 3], Error> {
    Ok([
        Filter {
            program: allow_filter()?,
            log: true,
        },
        Filter {
            program: quiet_filter()?,
            log: false,
        },
        Filter {
            program: kill_filter()?,
            log: true,
        },
    ])
}

/// Installs `filter` on the calling thread (and so on what it execs, and the threads it
/// starts afterwards), with the kernel's log of every call it refuses or traps where the
/// filter asks for it (`SECCOMP_FILTER_FLAG_LOG`: audit records of type SECCOMP, with the
/// pid, the call's number and the action). Returns 0, or -1 with errno set. Needs
/// `PR_SET_NO_NEW_PRIVS` first; a raw call, so it may run in a forked child.
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

/// The whole policy for a process that no supervisor starts under [`worker_filters`] (the
/// xDS relay): `no_new_privs`, the SIGSYS handler (reporting nowhere: the kernel's audit
/// record names the call), the supervisor's three filters and [`exec_filter`], all on the
/// calling thread. Call it before any other thread starts: threads inherit the filters.
pub fn confine_alone() -> Result<(), Error> {
    nix::sys::prctl::set_no_new_privs().map_err(Error::NoNewPrivs)?;
    handle_sigsys(None)?;
    let [allow, quiet, kill] = worker_filters()?;
    let exec = Filter {
        program: exec_filter()?,
        log: true,
    };
    for filter in [allow, quiet, kill, exec] {
        if install(&filter) != 0 {
            return Err(Error::Kernel(nix::Error::last()));
        }
    }
    Ok(())
}

/// A call that killed the worker, as its SIGSYS handler reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Killed {
    pub nr: i32,
    pub args: [u64; 2],
}

impl Killed {
    pub fn decode(report: &[u8]) -> Option<Self> {
        let report: &[u8; REPORT_LEN] = report.get(..REPORT_LEN)?.try_into().ok()?;
        let word = |at: usize| u64::from_ne_bytes(report[at..at + 8].try_into().expect("8 bytes"));
        Some(Self {
            nr: i32::from_ne_bytes(report[..4].try_into().expect("4 bytes")),
            args: [word(4), word(12)],
        })
    }

    fn encode(&self) -> [u8; REPORT_LEN] {
        let mut b = [0u8; REPORT_LEN];
        b[..4].copy_from_slice(&self.nr.to_ne_bytes());
        b[4..12].copy_from_slice(&self.args[0].to_ne_bytes());
        b[12..].copy_from_slice(&self.args[1].to_ne_bytes());
        b
    }

    /// The call's name, if it is one the policy kills.
    pub fn name(&self) -> Option<&'static str> {
        KILLED
            .iter()
            .chain(KILLED_BY_ARGUMENT)
            .chain(KILLED_ONCE_RUNNING)
            .find(|&&(_, nr)| nr == c_long::from(self.nr))
            .map(|&(name, _)| name)
    }
}

impl std::fmt::Display for Killed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a0, a1] = self.args;
        match self.name() {
            Some(n @ ("socket" | "socketpair")) => write!(f, "{n}(family {})", a0 as i32),
            Some(n @ ("clone" | "unshare")) => write!(f, "{n}(flags {:#x})", a0 as u32),
            Some("ioctl") => write!(f, "ioctl(request {:#x}, TIOCSTI)", a1 as u32),
            Some("ptrace") => write!(f, "ptrace(request {})", a0 as i32),
            Some("rt_sigaction") => write!(f, "rt_sigaction(signal {})", a0 as i32),
            Some(n) => f.write_str(n),
            None => write!(f, "system call {}", self.nr),
        }
    }
}

/// Where the handler writes its report; -1 for nowhere.
static REPORT: AtomicI32 = AtomicI32::new(-1);

/// Takes the report pipe the supervisor left at [`REPORT_FD`], if one is there (marked
/// close-on-exec).
pub fn take_report() -> Option<OwnedFd> {
    // F_GETFD fails with EBADF when nothing is open at the descriptor; only then could
    // owning it below alias nothing.
    // SAFETY: the borrow lives only for this call.
    let fd = unsafe { BorrowedFd::borrow_raw(REPORT_FD) };
    nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).ok()?;
    // SAFETY: open (checked above), and handed to this process at exec for it to own;
    // nothing else in the process refers to it.
    let fd = unsafe { OwnedFd::from_raw_fd(REPORT_FD) };
    let st = nix::sys::stat::fstat(&fd).ok()?;
    if nix::sys::stat::SFlag::from_bits_truncate(st.st_mode) & nix::sys::stat::SFlag::S_IFMT
        != nix::sys::stat::SFlag::S_IFIFO
    {
        return None;
    }
    nix::fcntl::fcntl(
        &fd,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .ok()?;
    Some(fd)
}

/// The worker's half, called once at start: installs the SIGSYS handler, reporting on
/// `report`, then [`exec_filter`] on every thread.
pub fn confine(report: Option<OwnedFd>) -> Result<(), Error> {
    handle_sigsys(report)?;
    seccompiler::apply_filter_all_threads(&exec_filter()?)?;
    Ok(())
}

/// Installs the SIGSYS handler, which reports on `report` (kept open for the life of the
/// process) and then lets SIGSYS end the process.
pub fn handle_sigsys(report: Option<OwnedFd>) -> Result<(), Error> {
    use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
    REPORT.store(report.map_or(-1, IntoRawFd::into_raw_fd), Ordering::SeqCst);
    // SA_RESETHAND: the handler runs once, then the default action (death) applies.
    // SA_NODEFER: SIGSYS stays unblocked in the handler, so its own signal is delivered.
    let flags =
        SaFlags::SA_SIGINFO | SaFlags::SA_RESETHAND | SaFlags::SA_NODEFER | SaFlags::SA_ONSTACK;
    let action = SigAction::new(SigHandler::SigAction(on_sigsys), flags, SigSet::empty());
    // SAFETY: `on_sigsys` is async-signal-safe (raw calls on a stack buffer and an
    // atomic), and nothing else in the process handles SIGSYS.
    unsafe { sigaction(Signal::SIGSYS, &action) }.map_err(Error::Handler)?;
    Ok(())
}

/// The kernel's `siginfo_t` for a seccomp SIGSYS on a 64-bit target (`_sigsys` in
/// `<asm-generic/siginfo.h>`); libc does not expose it.
#[repr(C)]
struct SigsysInfo {
    _signo: i32,
    _errno: i32,
    _code: i32,
    _pad: i32,
    _call_addr: *mut c_void,
    syscall: i32,
    _arch: u32,
}

/// The first two arguments of the trapped call, from the registers the kernel saved.
///
/// # Safety
/// `ctx` must be the ucontext the kernel passed to an SA_SIGINFO handler.
unsafe fn args_of(ctx: *const c_void) -> [u64; 2] {
    // SAFETY: the caller guarantees `ctx` points at a live ucontext_t.
    let mc = unsafe { &(*ctx.cast::<libc::ucontext_t>()).uc_mcontext };
    #[cfg(target_arch = "x86_64")]
    return [
        mc.gregs[libc::REG_RDI as usize] as u64,
        mc.gregs[libc::REG_RSI as usize] as u64,
    ];
    #[cfg(target_arch = "aarch64")]
    return [mc.regs[0], mc.regs[1]];
}

extern "C" fn on_sigsys(_signo: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: for an SA_SIGINFO handler the kernel passes a valid siginfo and ucontext; a
    // seccomp SIGSYS fills `_sigsys`. Only raw async-signal-safe calls follow.
    unsafe {
        let nr = (*info.cast::<SigsysInfo>()).syscall;
        let report = Killed {
            nr,
            args: args_of(ctx),
        }
        .encode();
        let fd = REPORT.load(Ordering::SeqCst);
        if fd >= 0 {
            libc::write(fd, report.as_ptr().cast(), report.len());
        }
        // SA_RESETHAND restored the default action, whose signal now ends the process.
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            libc::syscall(libc::SYS_gettid),
            libc::SIGSYS,
        );
        libc::_exit(128 + libc::SIGSYS)
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    enum Outcome {
        /// The call returned: 0, or the errno it failed with.
        Returned(i32),
        /// SIGSYS ended the process, and its handler reported this.
        Killed(String),
    }
    use Outcome::{Killed as K, Returned};

    /// Makes `call` in a forked child under all four filters and the SIGSYS handler.
    /// The child makes only raw calls: the filters are built before the fork.
    fn outcome(filters: &[BpfProgram], call: fn() -> c_long) -> Outcome {
        let (result_r, result_w) = nix::unistd::pipe().expect("pipe");
        let (report_r, report_w) = nix::unistd::pipe().expect("pipe");
        let progs: Vec<libc::sock_fprog> = filters
            .iter()
            .map(|p| libc::sock_fprog {
                len: p.len() as u16,
                filter: p.as_ptr() as *mut _,
            })
            .collect();
        // SAFETY: the child below makes raw calls only and leaves with _exit.
        match unsafe { libc::fork() } {
            // SAFETY: raw calls only (sigaction through nix builds its struct on the
            // stack); `progs` points into `filters`, alive in both processes.
            0 => unsafe {
                if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
                    || handle_sigsys(Some(report_w)).is_err()
                {
                    libc::_exit(100);
                }
                for p in &progs {
                    if libc::syscall(
                        libc::SYS_seccomp,
                        libc::SECCOMP_SET_MODE_FILTER,
                        0,
                        p as *const libc::sock_fprog,
                    ) != 0
                    {
                        libc::_exit(101);
                    }
                }
                let rc = call();
                let errno = if rc < 0 { *libc::__errno_location() } else { 0 };
                libc::write(result_w.as_raw_fd(), errno.to_ne_bytes().as_ptr().cast(), 4);
                libc::_exit(0)
            },
            pid if pid > 0 => {
                drop((result_w, report_w));
                let mut status = 0;
                // SAFETY: waiting for our own child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                let mut buf = [0u8; REPORT_LEN];
                if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGSYS {
                    let n = nix::unistd::read(&report_r, &mut buf).expect("read the report");
                    return K(Killed::decode(&buf[..n])
                        .map_or_else(|| "no report".into(), |k| k.to_string()));
                }
                assert!(
                    libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
                    "child status {status:#x}"
                );
                let n = nix::unistd::read(&result_r, &mut buf).expect("read the result");
                Returned(i32::from_ne_bytes(buf[..n].try_into().expect("4 bytes")))
            }
            _ => panic!("fork failed"),
        }
    }

    /// What is called, the call, and its expected outcome.
    type Case = (&'static str, fn() -> c_long, Outcome);

    fn check(cases: &[Case]) {
        let filters = [
            allow_filter().unwrap(),
            quiet_filter().unwrap(),
            kill_filter().unwrap(),
            exec_filter().unwrap(),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|(what, call, want)| {
                let got = outcome(&filters, *call);
                (got != *want).then(|| format!("{what}: got {got:?}, want {want:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "{wrong:#?}");
    }

    /// A raw call: every one in these tables has arguments that are harmless or refused.
    fn raw(nr: c_long, a: [c_long; 5]) -> c_long {
        // SAFETY: see above; no argument is a pointer the kernel would write through
        // except for calls that fail before reaching it.
        unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4]) }
    }

    #[test]
    fn the_allow_list_allows_what_the_worker_uses_and_refuses_the_rest_with_enosys() {
        use libc::*;
        check(&[
            ("getpid", || raw(SYS_getpid, [0; 5]).min(0), Returned(0)),
            (
                "a unix socket",
                || raw(SYS_socket, [AF_UNIX.into(), SOCK_STREAM.into(), 0, 0, 0]).min(0),
                Returned(0),
            ),
            (
                "a TCP socket",
                || {
                    raw(
                        SYS_socket,
                        [
                            AF_INET6.into(),
                            SOCK_STREAM.into(),
                            IPPROTO_TCP.into(),
                            0,
                            0,
                        ],
                    )
                    .min(0)
                },
                Returned(0),
            ),
            (
                "NETLINK_ROUTE",
                || {
                    raw(
                        SYS_socket,
                        [
                            AF_NETLINK.into(),
                            SOCK_RAW.into(),
                            NETLINK_ROUTE.into(),
                            0,
                            0,
                        ],
                    )
                    .min(0)
                },
                Returned(0),
            ),
            (
                "a unix socket pair",
                || {
                    raw(
                        SYS_socketpair,
                        [
                            AF_UNIX.into(),
                            SOCK_STREAM.into(),
                            0,
                            [0i32; 2].as_mut_ptr() as c_long,
                            0,
                        ],
                    )
                },
                Returned(0),
            ),
            ("sched_yield", || raw(SYS_sched_yield, [0; 5]), Returned(0)),
            // Allowed, so the kernel itself answers: an unaligned address.
            (
                "mremap",
                || raw(SYS_mremap, [1, 4096, 8192, 0, 0]),
                Returned(EINVAL),
            ),
            // Allowed, so the kernel itself answers: no such descriptor.
            (
                "isatty",
                || raw(SYS_ioctl, [-1, TCGETS as c_long, 0, 0, 0]),
                Returned(EBADF),
            ),
            (
                "FIONBIO",
                || raw(SYS_ioctl, [-1, FIONBIO as c_long, 0, 0, 0]),
                Returned(EBADF),
            ),
            (
                "PR_SET_NAME",
                || {
                    raw(
                        SYS_prctl,
                        [PR_SET_NAME.into(), c"t".as_ptr() as c_long, 0, 0, 0],
                    )
                },
                Returned(0),
            ),
            // Refused, not killed.
            ("kcmp", || raw(SYS_kcmp, [0; 5]), Returned(REFUSED)),
            (
                "personality",
                || raw(SYS_personality, [0xffff_ffff, 0, 0, 0, 0]),
                Returned(REFUSED),
            ),
            (
                "NETLINK_SOCK_DIAG",
                || {
                    raw(
                        SYS_socket,
                        [
                            AF_NETLINK.into(),
                            SOCK_RAW.into(),
                            NETLINK_SOCK_DIAG.into(),
                            0,
                            0,
                        ],
                    )
                },
                Returned(REFUSED),
            ),
            ("clone3", || raw(SYS_clone3, [0; 5]), Returned(REFUSED)),
            (
                "fork",
                || raw(SYS_clone, [SIGCHLD.into(), 0, 0, 0, 0]),
                Returned(REFUSED),
            ),
            (
                "socketpair(AF_INET)",
                || {
                    raw(
                        SYS_socketpair,
                        [AF_INET.into(), SOCK_STREAM.into(), 0, 0, 0],
                    )
                },
                Returned(REFUSED),
            ),
            (
                "FIOCLEX",
                || raw(SYS_ioctl, [-1, FIOCLEX as c_long, 0, 0, 0]),
                Returned(REFUSED),
            ),
            (
                "a SIGSYS query",
                || {
                    let mut old = [0u64; 4];
                    raw(
                        SYS_rt_sigaction,
                        [SIGSYS.into(), 0, old.as_mut_ptr() as c_long, 8, 0],
                    )
                },
                Returned(0),
            ),
            (
                "PR_SET_DUMPABLE",
                || raw(SYS_prctl, [PR_SET_DUMPABLE.into(), 1, 0, 0, 0]),
                Returned(REFUSED),
            ),
            (
                "seccomp(GET_ACTION_AVAIL)",
                || raw(SYS_seccomp, [2, 0, 0, 0, 0]),
                Returned(REFUSED),
            ),
        ]);
    }

    #[test]
    fn the_named_set_kills_and_the_report_names_the_call() {
        use libc::*;
        let k = |s: &str| K(s.into());
        check(&[
            (
                "execve",
                || raw(SYS_execve, [c"/bin/true".as_ptr() as c_long, 0, 0, 0, 0]),
                k("execve"),
            ),
            (
                "execveat",
                || {
                    raw(
                        SYS_execveat,
                        [0, c"".as_ptr() as c_long, 0, 0, AT_EMPTY_PATH.into()],
                    )
                },
                k("execveat"),
            ),
            (
                "ptrace",
                || raw(SYS_ptrace, [PTRACE_TRACEME.into(), 0, 0, 0, 0]),
                k("ptrace(request 0)"),
            ),
            (
                "unshare",
                || raw(SYS_unshare, [CLONE_NEWUSER.into(), 0, 0, 0, 0]),
                k("unshare(flags 0x10000000)"),
            ),
            (
                "clone(CLONE_NEWNET)",
                || raw(SYS_clone, [(CLONE_NEWNET | SIGCHLD).into(), 0, 0, 0, 0]),
                k("clone(flags 0x40000011)"),
            ),
            (
                "AF_VSOCK",
                || raw(SYS_socket, [AF_VSOCK.into(), SOCK_STREAM.into(), 0, 0, 0]),
                k("socket(family 40)"),
            ),
            (
                "AF_ALG",
                || raw(SYS_socket, [AF_ALG.into(), SOCK_SEQPACKET.into(), 0, 0, 0]),
                k("socket(family 38)"),
            ),
            (
                "AF_PACKET",
                || raw(SYS_socket, [AF_PACKET.into(), SOCK_RAW.into(), 0, 0, 0]),
                k("socket(family 17)"),
            ),
            (
                "socketpair(AF_ALG)",
                || raw(SYS_socketpair, [AF_ALG.into(), SOCK_STREAM.into(), 0, 0, 0]),
                k("socketpair(family 38)"),
            ),
            (
                "TIOCSTI",
                || {
                    raw(
                        SYS_ioctl,
                        [0, TIOCSTI as c_long, c"x".as_ptr() as c_long, 0, 0],
                    )
                },
                k("ioctl(request 0x5412, TIOCSTI)"),
            ),
            ("mount", || raw(SYS_mount, [0; 5]), k("mount")),
            ("bpf", || raw(SYS_bpf, [0; 5]), k("bpf")),
            ("setns", || raw(SYS_setns, [0; 5]), k("setns")),
            (
                "a new SIGSYS handler",
                || raw(SYS_rt_sigaction, [SIGSYS.into(), 1, 0, 8, 0]),
                k("rt_sigaction(signal 31)"),
            ),
        ]);
    }

    #[test]
    fn a_report_round_trips_and_unknown_calls_are_numbered() {
        let k = Killed {
            nr: libc::SYS_socket as i32,
            args: [40, 1],
        };
        assert_eq!(Killed::decode(&k.encode()), Some(k));
        assert_eq!(Killed::decode(&k.encode()[..REPORT_LEN - 1]), None);
        assert_eq!(
            Killed {
                nr: 9999,
                args: [0, 0]
            }
            .to_string(),
            "system call 9999"
        );
    }

    #[test]
    fn the_filters_fit_in_a_bpf_program() {
        for f in [
            allow_filter().unwrap(),
            quiet_filter().unwrap(),
            kill_filter().unwrap(),
            exec_filter().unwrap(),
        ] {
            assert!(f.len() < 4096, "{} instructions", f.len());
        }
    }
}
