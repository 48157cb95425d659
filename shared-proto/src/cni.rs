//! The CNI gRPC API (`aether.cni.v1`) between the `aether-cni` plugin and the worker,
//! generated from `proto/aether/cni/v1/cni.proto` by `build.rs`.
//!
//! Backward compatible across one version in both directions: fields are only added,
//! and unknown fields are ignored on decode (see `tests/cni_compat.rs`).

tonic::include_proto!("aether.cni.v1");

/// Longest container id either side accepts.
pub const MAX_CONTAINER_ID: usize = 1024;

/// The container id rule both the plugin and the worker enforce: the CNI spec's (not
/// empty, starts with a letter or digit, then `[A-Za-z0-9_.-]`), at most
/// [`MAX_CONTAINER_ID`] bytes, and no `..` anywhere, so an id can never name a path.
pub fn valid_container_id(id: &str) -> bool {
    id.len() <= MAX_CONTAINER_ID
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        && !id.contains("..")
}
