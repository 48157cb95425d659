//! FNV-1a 64: the content hash behind every resource version. Stable across Rust
//! releases and runs (unlike `DefaultHasher`): two agents of different builds agree on
//! versions, which is what makes a takeover to an identical snapshot a no-op for Envoy.

use serde::Serialize;

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    h.write(bytes);
    h.0
}

/// The hash of a resource: FNV-1a 64 over its canonical JSON.
pub fn content_hash<T: Serialize>(item: &T) -> u64 {
    let mut h = Fnv::new();
    // Serializing plain data into a writer that cannot fail cannot fail.
    serde_json::to_writer(&mut h, item).expect("model types serialize");
    h.0
}

pub(crate) struct Fnv(pub(crate) u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

impl std::io::Write for Fnv {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Fnv::write(self, buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
