//! Capability changes for the worker, done in the forked child before exec.
//!
//! Capabilities are per thread, and the child of `fork` has exactly one thread, so every
//! call here affects the whole worker. The child of a multi-threaded parent may only make
//! async-signal-safe calls: these functions do raw syscalls on stack data and never
//! allocate. The `caps` crate, which allocates, is used only before the fork, to decide
//! what the child can do.

use caps::{CapSet, Capability};

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Whether this process may empty a child's bounding set (needs CAP_SETPCAP).
pub fn can_drop_bounding() -> bool {
    caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP).unwrap_or(false)
}

/// The highest capability number this kernel knows.
pub fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Sets the calling thread's effective and permitted sets to exactly `only` (a capability
/// number below 32, or none) and its inheritable set to empty.
///
/// Returns the raw syscall result (0 or -1 with errno set).
pub fn set_only(only: Option<u32>) -> i32 {
    let bits = only.map_or(0, |c| 1u32 << c);
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [
        CapData {
            effective: bits,
            permitted: bits,
            inheritable: 0,
        },
        CapData {
            effective: 0,
            permitted: 0,
            inheritable: 0,
        },
    ];
    // SAFETY: capset(2) reads one header and two data structs (version 3); both live on
    // this stack frame for the duration of the call.
    unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) as i32 }
}

/// Drops every capability from the bounding set. Needs CAP_SETPCAP in the effective set.
pub fn drop_bounding(last_cap: u32) -> i32 {
    for cap in 0..=last_cap {
        // SAFETY: prctl(PR_CAPBSET_DROP, cap) takes integers only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } != 0 {
            return -1;
        }
    }
    0
}

/// Clears the ambient set. A kernel without ambient capabilities (EINVAL) has none.
pub fn clear_ambient() -> i32 {
    // SAFETY: prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL) takes integers only.
    let r = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if r != 0 && nix::errno::Errno::last() == nix::errno::Errno::EINVAL {
        0
    } else {
        r
    }
}

/// CAP_SETPCAP from <linux/capability.h>.
pub const CAP_SETPCAP: u32 = 8;

#[derive(Debug, thiserror::Error)]
pub enum CapsError {
    #[error("reading capabilities: {0}")]
    Read(caps::errors::CapsError),
    #[error("running as root without required capabilities: {}", .0.join(", "))]
    Missing(Vec<String>),
}

/// Fails, naming each missing capability and what it is for, unless the effective set
/// holds every one of `needed`.
pub fn require(needed: &[(Capability, &str)]) -> Result<(), CapsError> {
    let effective = caps::read(None, CapSet::Effective).map_err(CapsError::Read)?;
    let missing: Vec<String> = needed
        .iter()
        .filter(|(c, _)| !effective.contains(c))
        .map(|(c, why)| format!("{c} ({why})"))
        .collect();
    if !missing.is_empty() {
        return Err(CapsError::Missing(missing));
    }
    Ok(())
}
