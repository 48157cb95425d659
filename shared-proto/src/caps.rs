//! Dropping capabilities in a program that root starts with more than it needs: the
//! conflist check (`aether-cni chain`, CAP_CHOWN alone) and the socket keeper (none).

use caps::{CapSet, Capability, CapsHashSet};

/// Keeps only those of `keep` this thread holds, in every set: the bounding set loses the
/// rest while CAP_SETPCAP is still held, the ambient and inheritable sets are emptied,
/// and the effective and permitted sets become exactly what is kept. Capabilities are
/// per thread: call it before any other thread exists.
pub fn keep_only(keep: &[Capability]) -> Result<(), caps::errors::CapsError> {
    let kept: CapsHashSet = caps::read(None, CapSet::Permitted)?
        .into_iter()
        .filter(|c| keep.contains(c))
        .collect();
    if caps::has_cap(None, CapSet::Effective, Capability::CAP_SETPCAP)? {
        for cap in caps::read(None, CapSet::Bounding)?
            .into_iter()
            .filter(|c| !kept.contains(c))
        {
            caps::drop(None, CapSet::Bounding, cap)?;
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::set(None, CapSet::Effective, &kept)?;
    caps::set(None, CapSet::Permitted, &kept)
}
