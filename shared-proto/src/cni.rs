//! The CNI gRPC API (`aether.cni.v1`) between the `aether-cni` plugin and the worker,
//! generated from `proto/aether/cni/v1/cni.proto` by `build.rs`.
//!
//! Backward compatible across one version in both directions: fields are only added,
//! and unknown fields are ignored on decode (see `tests/cni_compat.rs`).

tonic::include_proto!("aether.cni.v1");

/// Most addresses one pod's request may carry, on either side: a pod has one, or two
/// when dual-stack.
pub const MAX_IPS: usize = 16;

/// Longest netns path either side accepts.
pub const MAX_NETNS: usize = 4096;

/// What is wrong with a netns path, by the rule both sides enforce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetnsProblem {
    /// Empty, relative, longer than [`MAX_NETNS`] or holding a NUL.
    NotAbsolute,
    /// A `..` component: whoever reads a record later must not be walked out of the
    /// runtime's netns folder by it.
    ParentComponent,
}

/// The netns rule both the plugin and the worker enforce.
pub fn check_netns(netns: &str) -> Result<(), NetnsProblem> {
    if netns.is_empty()
        || netns.len() > MAX_NETNS
        || !netns.starts_with('/')
        || netns.contains('\0')
    {
        return Err(NetnsProblem::NotAbsolute);
    }
    if netns.split('/').any(|c| c == "..") {
        return Err(NetnsProblem::ParentComponent);
    }
    Ok(())
}

/// Longest container id either side accepts.
pub const MAX_CONTAINER_ID: usize = 1024;

/// The container id rule both the plugin and the worker enforce: the CNI spec's (not
/// empty, starts with a letter or digit, then `[A-Za-z0-9_.-]`), at most
/// [`MAX_CONTAINER_ID`] bytes, and no `..` anywhere, so an id can never name a path.
pub fn valid_container_id(id: &str) -> bool {
    id.len() <= MAX_CONTAINER_ID
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && !id.contains("..")
}
