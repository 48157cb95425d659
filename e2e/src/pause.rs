//! Holds a background thread's steps while the harness times something those steps
//! would disturb: node B's drains (they change node A's load assignments too, and Envoy's
//! log does not say whose it accepted), or the admin poller's reads (each walks Envoy's
//! stats on the main thread that takes the xDS answers being timed: 50 ms and more at
//! 10,000 services).

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// A step is either held back or in flight, never both: [`Pause::hold`] waits for the
/// step in flight to end.
#[derive(Default)]
pub struct Pause {
    /// (held, a step in flight).
    state: Mutex<(bool, bool)>,
    changed: Condvar,
}

impl Pause {
    /// Holds the next step, and waits up to `timeout` for the one in flight to end; false
    /// when it had not (what is timed next may then be disturbed by it).
    pub fn hold(&self, timeout: Duration) -> bool {
        let mut s = self.state.lock().unwrap();
        s.0 = true;
        let (_s, waited) = self
            .changed
            .wait_timeout_while(s, timeout, |s| s.1)
            .unwrap();
        !waited.timed_out()
    }

    pub fn release(&self) {
        self.state.lock().unwrap().0 = false;
        self.changed.notify_all();
    }

    /// The thread's step `f`: waits while held, and is in flight until it returns.
    pub fn during<R>(&self, f: impl FnOnce() -> R) -> R {
        {
            let s = self.state.lock().unwrap();
            self.changed.wait_while(s, |s| s.0).unwrap().1 = true;
        }
        let r = f();
        self.state.lock().unwrap().1 = false;
        self.changed.notify_all();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A step runs only while not held; a hold waits for the step in flight.
    #[test]
    fn a_hold_waits_for_the_step_in_flight_and_keeps_the_next_back() {
        let pause = Arc::new(Pause::default());
        let steps = Arc::new(AtomicU32::new(0));
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
        let worker = {
            let (pause, steps) = (pause.clone(), steps.clone());
            std::thread::spawn(move || {
                pause.during(|| {
                    entered_tx.send(()).unwrap();
                    finish_rx.recv().unwrap();
                    steps.fetch_add(1, Ordering::SeqCst);
                });
                pause.during(|| steps.fetch_add(1, Ordering::SeqCst));
            })
        };
        entered_rx.recv().unwrap();
        // The step in flight has not ended: a short hold gives up on it.
        assert!(!pause.hold(Duration::from_millis(20)));
        finish_tx.send(()).unwrap();
        assert!(
            pause.hold(Duration::from_secs(10)),
            "the step in flight ended"
        );
        assert_eq!(steps.load(Ordering::SeqCst), 1, "the next step is held");
        pause.release();
        worker.join().unwrap();
        assert_eq!(steps.load(Ordering::SeqCst), 2);
    }
}
