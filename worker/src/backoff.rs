//! The worker's clients (the registrar, the Kubernetes API, the identity provider) back
//! off with [`shared_proto::backoff::Backoff`], jittered from a [`seed`] that differs
//! between processes and starts.

pub use shared_proto::backoff::Backoff;

/// A seed that differs between processes and starts.
pub fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ u64::from(std::process::id()).rotate_left(32)
}
