//! Signals arrive on a `signalfd`, so the event loop handles them like any other input.
//! They are blocked before any thread starts (every thread inherits the mask), and the
//! worker gets a clean mask back before exec.

use nix::sys::signal::{SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};

pub fn handled() -> SigSet {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(s);
    }
    set
}

/// Blocks the handled signals for this thread (call before spawning threads) and returns
/// the descriptor they arrive on.
pub fn block_and_open() -> nix::Result<SignalFd> {
    let set = handled();
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None)?;
    SignalFd::with_flags(&set, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
}
