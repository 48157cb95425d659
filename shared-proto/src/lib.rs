//! Messages shared by the Aether processes.
//!
//! - [`backoff`]: exponential backoff, exact or jittered, for every retry loop.
//! - [`control`]: the closed protocol between the supervisor and its worker, and between
//!   an owning supervisor and a standby supervisor (the generation handoff).
//! - [`duration`]: durations with a unit (`60s`, `100ms`, `2m`), or optionally bare seconds,
//!   for the agent's flags and the test harness's settings.
//! - [`fdpass`]: one message per `SOCK_SEQPACKET` datagram with its file descriptors
//!   attached over `SCM_RIGHTS`, received with `MSG_CMSG_CLOEXEC`, truncation rejected.
//! - `conflist` (feature `conflist`): the node's CNI conflist, as the runtime chooses it,
//!   and its atomic rewrite; for `aether-cni` and the worker, never the supervisor.
//! - `cni` (feature `cni-api`): the CNI gRPC API between `aether-cni` and the worker.
//! - `handoff` (feature `handoff`): the generation handoff of the node's listening
//!   sockets on `handoff.sock` (and `keeper.sock`), both ends, and the fresh bind of a
//!   socket file; for the supervisor and the socket keeper.
//! - `caps` (feature `caps`): dropping every capability but a named few, for the
//!   programs root starts with more than they need (`aether-cni chain`, `aether-keeper`).
//! - `flags` (feature `flags`): the agent's settings the supervisor passes on to the
//!   worker, defined once for both.
//! - `logging` (feature `logging`): the log setup both processes share.
//! - `registry` (feature `registry-api`): the registry gRPC API between agents and a
//!   registrar.
//! - `registry_tls` (feature `registry-tls`): TLS to a registrar, the client's side.
//! - `seccomp` (feature `seccomp`): the worker's system-call policy, which the supervisor
//!   installs before the exec and the worker completes once running, and the SIGSYS
//!   report that names the call that killed a worker.
//! - `fault` (feature `fault-hooks`, tests only): stops a process at a named handoff step
//!   ([`fault_hook!`]); without the feature the macros expand to nothing.
//!
//! `unsafe` in this crate lives only in [`fdpass`], around `recvmsg(2)` and the control
//! message walk, where `nix` cannot hand back the descriptors of a truncated message, and
//! in `seccomp`, in the SIGSYS handler and its installation.

pub mod backoff;
#[cfg(feature = "caps")]
pub mod caps;
#[cfg(feature = "cni-api")]
pub mod cni;
#[cfg(feature = "conflist")]
pub mod conflist;
pub mod control;
pub mod duration;
#[cfg(feature = "fault-hooks")]
pub mod fault;
pub mod fdcheck;
pub mod fdpass;
#[cfg(feature = "flags")]
pub mod flags;
#[cfg(feature = "handoff")]
pub mod handoff;
#[cfg(feature = "logging")]
pub mod logging;
#[cfg(feature = "registry-api")]
pub mod registry;
#[cfg(feature = "registry-tls")]
pub mod registry_tls;
pub mod resume;
#[cfg(feature = "seccomp")]
pub mod seccomp;

/// Without the `fault-hooks` feature: nothing, so that no step name is in the binary.
#[cfg(not(feature = "fault-hooks"))]
#[macro_export]
macro_rules! fault_hook {
    ($step:literal) => {};
}

/// Without the `fault-hooks` feature: no variable to pass on.
#[cfg(not(feature = "fault-hooks"))]
#[macro_export]
macro_rules! fault_hook_env {
    () => {
        [] as [&str; 0]
    };
}
