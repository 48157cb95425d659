//! Spawning the worker: fork, drop every privilege, exec from a pinned descriptor.
//!
//! Everything the child needs (argv, envp, uid, the capability plan) is prepared before
//! the fork, because the child of a multi-threaded process may only make
//! async-signal-safe calls until it execs. In the child, in this order:
//! 1. stdin from /dev/null, the control socket at fd 3, the write end of the SIGSYS report
//!    pipe at fd 4 (every other descriptor of the supervisor is close-on-exec, so nothing
//!    else is inherited);
//! 2. an empty signal mask and a session of its own: no controlling terminal, so neither
//!    TIOCSTI nor `/dev/tty` reaches the terminal that started the supervisor, and a
//!    terminal's ^C reaches the supervisor only, which forwards it as a drain request;
//! 3. supplementary groups cleared, then gid and uid switched (when root);
//! 4. every capability set cleared: bounding and ambient included;
//! 5. `PR_SET_NO_NEW_PRIVS`;
//! 6. a parent-death signal (after the credentials: changing them clears it);
//! 7. the worker's seccomp filters (`seccomp.rs`), which no_new_privs allows without a
//!    capability and which the worker cannot lift; the allow list admits no call the
//!    steps above make, so they come last;
//! 8. `execveat(fd, "", AT_EMPTY_PATH)` of the executable opened at supervisor start, so
//!    the worker is the binary the supervisor started with, whatever happens to the path.
//!
//! A failing step writes its number and errno to a close-on-exec pipe and exits 127; the
//! parent turns that into an error naming the step.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::unistd::{ForkResult, Pid, fork};

use super::{caps, seccomp};

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("open worker executable {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("argument contains a NUL byte: {0:?}")]
    Nul(String),
    #[error("fork: {0}")]
    Fork(Errno),
    #[error("control socket: {0}")]
    Socket(Errno),
    #[error("worker setup failed at {step}: {errno}")]
    Child { step: &'static str, errno: Errno },
    #[error(transparent)]
    Filter(#[from] shared_proto::seccomp::Error),
}

const STEPS: [&str; 16] = [
    "(none)",
    "stdin from /dev/null",
    "control socket to fd 3",
    "setgroups([])",
    "setresgid",
    "setresuid",
    "capset(CAP_SETPCAP only)",
    "PR_CAPBSET_DROP",
    "PR_CAP_AMBIENT_CLEAR_ALL",
    "capset(empty)",
    "PR_SET_NO_NEW_PRIVS",
    "PR_SET_PDEATHSIG",
    "execveat",
    "seccomp filter",
    "setsid",
    "report pipe to fd 4",
];

/// The worker executable, opened once at start and exec'd from its descriptor.
pub struct Image {
    file: File,
    pub path: PathBuf,
}

impl Image {
    pub fn open(path: &Path) -> Result<Self, SpawnError> {
        let file = File::open(path).map_err(|source| SpawnError::Open {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self {
            file,
            path: path.to_owned(),
        })
    }
}

/// Everything the child does, decided before the fork.
pub struct Plan {
    argv: Vec<CString>,
    envp: Vec<CString>,
    /// uid and gid to switch to; None when not running as root.
    pub drop_to: Option<(u32, u32)>,
    /// Whether the bounding set can be emptied (CAP_SETPCAP held).
    pub drop_bounding: bool,
    last_cap: u32,
    /// The worker's seccomp programs, built once.
    filters: [shared_proto::seccomp::Filter; 3],
}

impl Plan {
    pub fn new(
        argv: Vec<String>,
        env: Vec<(String, String)>,
        drop_to: Option<(u32, u32)>,
    ) -> Result<Self, SpawnError> {
        let cstr = |s: String| CString::new(s.clone()).map_err(|_| SpawnError::Nul(s));
        Ok(Self {
            argv: argv.into_iter().map(cstr).collect::<Result<_, _>>()?,
            envp: env
                .into_iter()
                .map(|(k, v)| cstr(format!("{k}={v}")))
                .collect::<Result<_, _>>()?,
            drop_to,
            drop_bounding: caps::can_drop_bounding(),
            last_cap: caps::last_cap(),
            filters: shared_proto::seccomp::worker_filters()?,
        })
    }
}

/// Starts a worker: a fresh `SOCK_SEQPACKET` pair, the worker's end as its fd 3, and a
/// pipe for its SIGSYS report, the write end as its fd 4. Returns its pid, the
/// supervisor's end of the pair and the read end of the pipe (both non-blocking) once the
/// exec has succeeded.
pub fn start(image: &Image, plan: &Plan) -> Result<(Pid, OwnedFd, OwnedFd), SpawnError> {
    use nix::fcntl::OFlag;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    let (mine, theirs) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(SpawnError::Socket)?;
    nix::fcntl::fcntl(&mine, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_NONBLOCK))
        .map_err(SpawnError::Socket)?;
    let (sigsys_r, sigsys_w) =
        nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).map_err(SpawnError::Socket)?;
    let pid = spawn(image, plan, &theirs, &sigsys_w)?;
    Ok((pid, mine, sigsys_r))
}

/// Forks and execs the worker with `control` as its fd 3 and `sigsys` as its fd 4.
/// Returns its pid once the exec has succeeded.
fn spawn(
    image: &Image,
    plan: &Plan,
    control: &OwnedFd,
    sigsys: &OwnedFd,
) -> Result<Pid, SpawnError> {
    // Without close_range (Linux before 5.11) the child marks each descriptor up to the
    // soft limit one by one: no descriptor at or past it can be open, unless the limit
    // was lowered after it was opened.
    let fd_limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(4096, |(soft, _)| {
            i32::try_from(soft).unwrap_or(i32::MAX).max(4096)
        });
    let devnull = File::open("/dev/null").map_err(|source| SpawnError::Open {
        path: "/dev/null".into(),
        source,
    })?;
    let (report_r, report_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(SpawnError::Fork)?;
    let argv: Vec<*const libc::c_char> = plan
        .argv
        .iter()
        .map(|s| s.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let envp: Vec<*const libc::c_char> = plan
        .envp
        .iter()
        .map(|s| s.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let parent = nix::unistd::getpid();
    // SAFETY: the child runs only `child_setup`, which makes raw async-signal-safe
    // syscalls on data prepared above and never returns (it execs or _exits).
    match unsafe { fork() }.map_err(SpawnError::Fork)? {
        ForkResult::Child => {
            // SAFETY: see child_setup's contract; all pointers outlive the call because
            // the child never returns from it.
            unsafe {
                child_setup(&ChildArgs {
                    image: image.file.as_raw_fd(),
                    control: control.as_raw_fd(),
                    sigsys: sigsys.as_raw_fd(),
                    devnull: devnull.as_raw_fd(),
                    report: report_w.as_raw_fd(),
                    argv: argv.as_ptr(),
                    envp: envp.as_ptr(),
                    drop_to: plan.drop_to,
                    drop_bounding: plan.drop_bounding,
                    last_cap: plan.last_cap,
                    filters: &plan.filters,
                    parent: parent.as_raw(),
                    fd_limit,
                })
            }
        }
        ForkResult::Parent { child } => {
            drop(report_w);
            let mut buf = [0u8; 5];
            let n = loop {
                match nix::unistd::read(&report_r, &mut buf) {
                    Err(Errno::EINTR) => continue,
                    other => break other.unwrap_or(0),
                }
            };
            if n == 0 {
                return Ok(child); // EOF: the exec closed the pipe.
            }
            let _ = nix::sys::wait::waitpid(child, None);
            let step = STEPS
                .get(buf[0] as usize)
                .copied()
                .unwrap_or("unknown step");
            let errno = Errno::from_raw(i32::from_ne_bytes([buf[1], buf[2], buf[3], buf[4]]));
            Err(SpawnError::Child { step, errno })
        }
    }
}

struct ChildArgs {
    image: i32,
    control: i32,
    sigsys: i32,
    devnull: i32,
    report: i32,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    drop_to: Option<(u32, u32)>,
    drop_bounding: bool,
    last_cap: u32,
    filters: *const [shared_proto::seccomp::Filter; 3],
    parent: i32,
    fd_limit: i32,
}

/// Runs in the forked child. Never returns.
///
/// # Safety
/// Must be called only in the child of `fork`, with `argv`/`envp` NULL-terminated
/// arrays of valid C strings and every descriptor open.
unsafe fn child_setup(a: &ChildArgs) -> ! {
    // SAFETY: (whole body) raw syscalls on integers and on the stack-held or pre-fork
    // buffers described in ChildArgs; no allocation, no locks.
    unsafe {
        // Move every descriptor we use above fd 3 first, so that placing the control
        // socket at fd 3 cannot clobber one of them.
        let high = |fd: i32| libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10);
        let report = high(a.report);
        let fail = |step: u8| -> ! {
            let e = (*libc::__errno_location()).to_ne_bytes();
            let msg = [step, e[0], e[1], e[2], e[3]];
            libc::write(
                if report >= 0 { report } else { a.report },
                msg.as_ptr().cast(),
                msg.len(),
            );
            libc::_exit(127)
        };
        let (image, control, sigsys, devnull) = (
            high(a.image),
            high(a.control),
            high(a.sigsys),
            high(a.devnull),
        );
        if report < 0 || image < 0 || control < 0 || sigsys < 0 || devnull < 0 {
            fail(2);
        }
        if libc::dup2(devnull, 0) < 0 {
            fail(1);
        }
        // dup2 gives the new descriptor no close-on-exec flag: fd 3 is inherited.
        if libc::dup2(control, 3) < 0 {
            fail(2);
        }
        if libc::dup2(sigsys, shared_proto::seccomp::REPORT_FD) < 0 {
            fail(15);
        }
        // Nothing beyond fds 0-4 survives the exec, whatever the supervisor inherited
        // without close-on-exec from whoever started it.
        if libc::syscall(
            libc::SYS_close_range,
            5u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        ) != 0
        {
            for fd in 5..a.fd_limit {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        if libc::setsid() < 0 {
            fail(14);
        }
        if let Some((uid, gid)) = a.drop_to {
            // Keep the permitted set across setresuid for one more step: emptying the
            // bounding set below needs CAP_SETPCAP.
            libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0);
            if libc::setgroups(0, std::ptr::null()) != 0 {
                fail(3);
            }
            if libc::setresgid(gid, gid, gid) != 0 {
                fail(4);
            }
            if libc::setresuid(uid, uid, uid) != 0 {
                fail(5);
            }
            if a.drop_bounding && caps::set_only(Some(caps::CAP_SETPCAP)) != 0 {
                fail(6);
            }
        }
        if a.drop_bounding && caps::drop_bounding(a.last_cap) != 0 {
            fail(7);
        }
        if caps::clear_ambient() != 0 {
            fail(8);
        }
        if caps::set_only(None) != 0 {
            fail(9);
        }
        libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0);
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            fail(10);
        }
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
            fail(11);
        }
        if libc::getppid() != a.parent {
            // The supervisor died between fork and here: the death signal came too late.
            libc::_exit(127);
        }
        for prog in &*a.filters {
            if seccomp::install(prog) != 0 {
                fail(13);
            }
        }
        libc::syscall(
            libc::SYS_execveat,
            image,
            c"".as_ptr(),
            a.argv,
            a.envp,
            libc::AT_EMPTY_PATH,
        );
        fail(12)
    }
}

/// The default path of a sibling executable (`aether-worker`, `aether-cni`): beside the
/// supervisor's own.
pub fn beside_me(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Makes the process `cmd` starts die with the supervisor: a parent-death SIGKILL, set in
/// the child before the exec and kept across it (the executable is neither set-uid nor
/// file-capable), and an exit if the supervisor is already gone by then. A conflist check
/// that hangs then cannot outlive a killed supervisor.
pub fn die_with_me(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    let parent = nix::unistd::getpid().as_raw();
    // SAFETY: the closure runs in the forked child and makes only async-signal-safe
    // syscalls (prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(127);
            }
            Ok(())
        })
    }
}
