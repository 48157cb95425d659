//! Every privileged or raw syscall of the supervisor, one family a file. `unsafe` in
//! this crate lives only here, and each block says why it is sound.

pub mod caps;
pub mod dirs;
pub mod fdstore;
pub mod listen;
pub mod lock;
pub mod notify;
pub mod seccomp;
pub mod signals;
pub mod sockdiag;
pub mod spawn;
