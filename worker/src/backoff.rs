//! Jittered exponential backoff for the worker's clients (the registrar, the Kubernetes
//! API): `base` doubling to `max`, each wait drawn in its upper half, so that the agents
//! of many nodes do not retry in step against a server that is coming back.

use std::time::Duration;

#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    next: Duration,
    seed: u64,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration, seed: u64) -> Self {
        Self {
            base,
            max,
            next: base,
            seed: seed | 1,
        }
    }

    pub fn reset(&mut self) {
        self.next = self.base;
    }

    pub fn next_wait(&mut self) -> Duration {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        let half = d / 2;
        half + Duration::from_nanos(self.seed % (half.as_nanos() as u64 + 1))
    }
}

/// A seed that differs between processes and starts.
pub fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ u64::from(std::process::id()).rotate_left(32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_stay_between_half_the_base_and_the_maximum_grow_and_reset() {
        let (base, max) = (Duration::from_millis(100), Duration::from_secs(1));
        let mut b = Backoff::new(base, max, 42);
        let waits: Vec<_> = (0..8).map(|_| b.next_wait()).collect();
        assert!(
            waits.iter().all(|w| *w >= base / 2 && *w <= max),
            "{waits:?}"
        );
        assert!(waits[0] <= base && waits[7] >= max / 2, "{waits:?}");
        b.reset();
        assert!(b.next_wait() <= base);
    }
}
