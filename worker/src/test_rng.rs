//! A small deterministic generator for the unit tests' random sequences (xorshift64*),
//! so a failing seed reproduces and no random crate is needed.

pub struct Rng(pub u64);

impl Rng {
    /// The next number below `n` (`n` ≥ 1).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}
