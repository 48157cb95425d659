//! `without-close-range CMD [ARG...]`: runs CMD with `close_range(2)` failing with ENOSYS,
//! as on Linux before 5.11, so that a test takes the supervisor's fallback for marking the
//! descriptors it inherited close-on-exec before it execs a worker
//! (`supervisor/src/sys/spawn.rs`). The refusal is a seccomp filter (with no_new_privs),
//! which CMD and its children inherit. Prints `without-close-range: close_range refused
//! (ENOSYS)` once the filter is in place, or exits 2 saying why it is not.

use std::os::unix::process::CommandExt;
use std::process::Command;

use seccompiler::{BpfProgram, SeccompAction, SeccompFilter};

fn fail(what: &str) -> ! {
    eprintln!("without-close-range: {what}");
    std::process::exit(2)
}

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let Some((cmd, rest)) = args.split_first() else {
        fail("usage: without-close-range CMD [ARG...]")
    };
    let arch = std::env::consts::ARCH
        .try_into()
        .unwrap_or_else(|e| fail(&format!("no seccomp architecture: {e}")));
    let rules = [(libc::SYS_close_range, vec![])].into_iter().collect();
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .unwrap_or_else(|e| fail(&format!("the filter: {e}")));
    let program: BpfProgram = filter
        .try_into()
        .unwrap_or_else(|e| fail(&format!("the filter: {e}")));
    seccompiler::apply_filter(&program)
        .unwrap_or_else(|e| fail(&format!("installing the filter: {e}")));
    // The premise, checked: a close_range of descriptors that cannot be open.
    // SAFETY: the range holds no open descriptor, so the call closes nothing either way.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, u32::MAX - 1, u32::MAX, 0) };
    let err = std::io::Error::last_os_error();
    if rc != -1 || err.raw_os_error() != Some(libc::ENOSYS) {
        fail(&format!("close_range was not refused: {rc} ({err})"));
    }
    eprintln!("without-close-range: close_range refused (ENOSYS)");
    let e = Command::new(cmd).args(rest).exec();
    fail(&format!("exec {}: {e}", cmd.to_string_lossy()))
}
