//! The worker's seccomp filter, installed by the supervisor in the forked child after
//! `PR_SET_NO_NEW_PRIVS` and before the exec, so the worker runs under it from its first
//! instruction and can never lift it.
//!
//! A deny list, not an allow list: the worker is a tokio/tonic program whose exact
//! syscall set moves with its dependencies, and a missing entry in an allow list would
//! kill the node's control plane. What it denies is what a compromised worker would
//! reach for beyond its sockets and folders, and nothing the worker uses:
//! - other processes: `ptrace`, `process_vm_readv`/`writev`, `pidfd_getfd`;
//! - namespaces and mounts: `unshare`, `setns`, `clone` with a `CLONE_NEW*` flag, `mount`,
//!   the new mount API, `pivot_root`, `chroot`;
//! - the kernel's wider surface: `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*`,
//!   key management, modules, kexec, `open_by_handle_at`, `personality`, `acct`,
//!   `swapon`/`swapoff`, `reboot`, `syslog`, `quotactl` (and `iopl`/`ioperm` on x86-64).
//!
//! Denied calls fail with EPERM. `clone3` fails with ENOSYS, as in container runtimes'
//! default profiles: its flags sit behind a pointer the filter cannot read, and the C
//! library then falls back to `clone`, whose flags it can. A foreign architecture (the
//! x32 ABI on x86-64 included) kills the process.

/// One BPF instruction (`struct sock_filter`).
pub type Insn = libc::sock_filter;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64

/// Syscall numbers at or above this on x86-64 are the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// `struct seccomp_data` offsets: nr, arch, then (after the instruction pointer) the
/// arguments; the low 32 bits of the first argument on a little-endian machine.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0_LOW: u32 = 16;

/// Every `CLONE_NEW*` flag: NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET,
/// NEWTIME.
const CLONE_NAMESPACES: u32 = 0x0002_0000 | 0x0200_0000 | 0x0400_0000 | 0x0800_0000 | 0x1000_0000 | 0x2000_0000 | 0x4000_0000 | 0x80;

/// The syscalls denied outright.
fn denied() -> Vec<libc::c_long> {
    let mut v = vec![
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_pidfd_getfd,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_open_tree,
        libc::SYS_move_mount,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_personality,
        libc::SYS_acct,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_syslog,
        libc::SYS_quotactl,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([libc::SYS_iopl, libc::SYS_ioperm]);
    v
}

fn stmt(code: u32, k: u32) -> Insn {
    Insn { code: code as u16, jt: 0, jf: 0, k }
}

fn jump(code: u32, k: u32, jt: u8, jf: u8) -> Insn {
    Insn { code: code as u16, jt, jf, k }
}

fn ret(action: u32) -> Insn {
    stmt(libc::BPF_RET | libc::BPF_K, action)
}

fn errno(e: i32) -> u32 {
    libc::SECCOMP_RET_ERRNO | (e as u32 & libc::SECCOMP_RET_DATA)
}

/// The worker's filter program.
pub fn worker_filter() -> Vec<Insn> {
    let load = |off: u32| stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, off);
    let eq = |k: u32, jt: u8, jf: u8| jump(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, k, jt, jf);
    let mut p = vec![
        load(OFF_ARCH),
        eq(AUDIT_ARCH, 1, 0),
        ret(libc::SECCOMP_RET_KILL_PROCESS),
        load(OFF_NR),
    ];
    if cfg!(target_arch = "x86_64") {
        p.push(jump(libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K, X32_SYSCALL_BIT, 0, 1));
        p.push(ret(libc::SECCOMP_RET_KILL_PROCESS));
    }
    for nr in denied() {
        p.push(eq(nr as u32, 0, 1));
        p.push(ret(errno(libc::EPERM)));
    }
    p.push(eq(libc::SYS_clone3 as u32, 0, 1));
    p.push(ret(errno(libc::ENOSYS)));
    // clone: allowed (threads), unless it asks for a new namespace. Last, because it
    // replaces the syscall number in the accumulator with the flags.
    p.push(eq(libc::SYS_clone as u32, 0, 3));
    p.push(load(OFF_ARG0_LOW));
    p.push(jump(libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K, CLONE_NAMESPACES, 0, 1));
    p.push(ret(errno(libc::EPERM)));
    p.push(ret(libc::SECCOMP_RET_ALLOW));
    p
}

/// Installs `prog` on the calling thread (and so on what it execs). Returns 0 or -1
/// with errno set. Needs `PR_SET_NO_NEW_PRIVS` first.
///
/// # Safety
/// `prog` must be a valid `sock_fprog` whose `filter` points at `len` instructions that
/// outlive the call; only raw syscalls, so it may run in a forked child.
pub unsafe fn install(prog: *const libc::sock_fprog) -> libc::c_int {
    // SAFETY: the caller guarantees `prog` is valid for the duration of the call; the
    // kernel copies the program.
    unsafe { libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, prog) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `check` in a forked child under the worker's filter; its exit code.
    fn in_filtered_child(check: fn() -> i32) -> i32 {
        let prog = worker_filter();
        let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_ptr() as *mut _ };
        // SAFETY: the child only makes raw syscalls and exits; the test harness's other
        // threads are not touched. `fprog` points into `prog`, alive in both processes.
        unsafe {
            match libc::fork() {
                0 => {
                    if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || install(&fprog) != 0 {
                        libc::_exit(100);
                    }
                    libc::_exit(check())
                }
                pid if pid > 0 => {
                    let mut status = 0;
                    libc::waitpid(pid, &mut status, 0);
                    assert!(libc::WIFEXITED(status), "child killed: status {status:#x}");
                    libc::WEXITSTATUS(status)
                }
                _ => panic!("fork failed"),
            }
        }
    }

    fn errno_of(rc: libc::c_long) -> i32 {
        if rc == -1 {
            // SAFETY: reading this thread's errno.
            unsafe { *libc::__errno_location() }
        } else {
            0
        }
    }

    #[test]
    fn the_filter_fits_and_is_well_formed() {
        let p = worker_filter();
        assert!(p.len() < 4096, "BPF_MAXINSNS");
        // Every jump lands inside the program.
        for (i, insn) in p.iter().enumerate() {
            if u32::from(insn.code) & 0x07 == libc::BPF_JMP {
                assert!(i + 1 + usize::from(insn.jt.max(insn.jf)) < p.len(), "jump at {i} leaves the program");
            }
        }
        assert_eq!(u32::from(p.last().unwrap().code), libc::BPF_RET | libc::BPF_K);
        assert_eq!(p.last().unwrap().k, libc::SECCOMP_RET_ALLOW);
    }

    #[test]
    fn denied_calls_fail_with_eperm_and_the_rest_work() {
        // Exit codes: 0 when every expectation held, else the number of the one that failed.
        let code = in_filtered_child(|| {
            // SAFETY: raw syscalls with harmless arguments; each fails or does nothing.
            unsafe {
                let expect = [
                    (errno_of(libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0)), libc::EPERM),
                    (errno_of(libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER)), libc::EPERM),
                    (errno_of(libc::syscall(libc::SYS_bpf, 0, 0, 0)), libc::EPERM),
                    (errno_of(libc::syscall(libc::SYS_io_uring_setup, 1, 0)), libc::EPERM),
                    (errno_of(libc::syscall(libc::SYS_clone3, 0, 0)), libc::ENOSYS),
                    (
                        match libc::syscall(libc::SYS_clone, libc::CLONE_NEWNET | libc::SIGCHLD, 0, 0, 0, 0) {
                            // Not denied: this is the new process; leave at once.
                            0 => libc::_exit(99),
                            rc => errno_of(rc),
                        },
                        libc::EPERM,
                    ),
                    // Allowed: a plain call, and a thread (clone3 refused, clone used).
                    (errno_of(libc::syscall(libc::SYS_getpid)), 0),
                ];
                for (i, (got, want)) in expect.iter().enumerate() {
                    if got != want {
                        return 1 + i as i32;
                    }
                }
                if std::thread::spawn(|| 7).join().ok() != Some(7) {
                    return 50;
                }
                0
            }
        });
        assert_eq!(code, 0, "expectation {code} failed under the filter (100: could not install it)");
    }
}
