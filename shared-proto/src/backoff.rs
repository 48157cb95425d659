//! Exponential backoff, one type for every retry loop of the agent: the supervisor's
//! respawns, the worker's accept loops and its clients (the registrar, the Kubernetes API,
//! the identity provider). Pure: no clock, no runtime; the caller sleeps.
//!
//! A wait starts at `base` and doubles up to `max`; [`Backoff::reset`] starts over.
//! Two options: [`Backoff::at_once_first`], where the first wait after a reset is zero (a
//! healthy worker's successor starts at once), and [`Backoff::jittered`], where each wait
//! is drawn in its upper half, so that the agents of many nodes do not retry in step
//! against a server that is coming back.

use std::time::Duration;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    /// The wait after a reset: `base`, or zero with [`Backoff::at_once_first`].
    first: Duration,
    next: Duration,
    /// The xorshift state of [`Backoff::jittered`]; `None` waits exactly.
    seed: Option<u64>,
}

impl Backoff {
    /// Waits of `base`, doubling up to `max`.
    pub const fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            first: base,
            next: base,
            seed: None,
        }
    }

    /// The first wait, and the first after each reset, is zero; then `base` doubling.
    pub const fn at_once_first(mut self) -> Self {
        self.first = Duration::ZERO;
        self.next = Duration::ZERO;
        self
    }

    /// Each wait drawn between its half and itself, from `seed` (see [`seed`]).
    pub const fn jittered(mut self, seed: u64) -> Self {
        self.seed = Some(seed | 1);
        self
    }

    /// The wait before the next attempt; the one after doubles.
    pub fn next_wait(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).max(self.base).min(self.max);
        let Some(seed) = &mut self.seed else {
            return d;
        };
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let half = d / 2;
        half + Duration::from_nanos(*seed % (half.as_nanos() as u64 + 1))
    }

    /// An attempt got somewhere: the next wait is the first again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn waits(b: &mut Backoff, n: usize) -> Vec<u128> {
        (0..n).map(|_| b.next_wait().as_millis()).collect()
    }

    #[test]
    fn waits_double_from_the_base_to_the_maximum_and_a_reset_starts_over() {
        let mut b = Backoff::new(MS(10), MS(1000));
        let all = [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000];
        assert_eq!(waits(&mut b, 10), all);
        b.reset();
        assert_eq!(waits(&mut b, 2), [10, 20]);
    }

    #[test]
    fn at_once_first_waits_nothing_first_and_after_each_reset() {
        let mut b = Backoff::new(MS(100), MS(5000)).at_once_first();
        let all = [0, 100, 200, 400, 800, 1600, 3200, 5000, 5000];
        assert_eq!(waits(&mut b, 9), all);
        b.reset();
        assert_eq!(waits(&mut b, 2), [0, 100]);
    }

    #[test]
    fn jittered_waits_stay_in_the_upper_half_of_each_exact_wait_and_reset() {
        let (base, max) = (MS(100), MS(1000));
        let mut exact = Backoff::new(base, max);
        let mut b = Backoff::new(base, max).jittered(42);
        let got: Vec<_> = (0..8).map(|_| (exact.next_wait(), b.next_wait())).collect();
        assert!(got.iter().all(|(e, j)| *j >= *e / 2 && j <= e), "{got:?}");
        assert!(got.iter().any(|(e, j)| j != e), "no jitter: {got:?}");
        b.reset();
        assert!(b.next_wait() <= base);
    }
}
