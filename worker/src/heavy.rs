//! One thread for the worker's large, repeated blocking work: parsing the registry file
//! and warming the encoding cache.
//!
//! Both allocate and free tens of MiB per run at mesh scale. On tokio's blocking pool
//! each run may land on a different thread, and glibc gives each new thread its own
//! malloc arena (up to eight per core), whose freed pages it keeps: the worker's RSS
//! climbed from 120 to 157 MiB over 300 registry-file changes at 10,000 services, while
//! the same run with a single arena stayed at 109 MiB. Running that work on one
//! long-lived thread keeps it in one arena, whose freed pages the next run reuses.
//!
//! Jobs run one at a time, in the order they were sent. A job that panics is reported to
//! its caller as [`Panicked`], as `spawn_blocking` reports it, and the thread carries on.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock, mpsc};

use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// The job panicked (or the thread could not be started); its result is lost.
#[derive(Debug)]
pub struct Panicked;

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the heavy-work job panicked")
    }
}

/// Runs `f` on the heavy-work thread and waits for its result without holding up the
/// runtime.
pub async fn run<T, F>(f: F) -> Result<T, Panicked>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    sender()
        .lock()
        .map_err(|_| Panicked)?
        .send(job)
        .map_err(|_| Panicked)?;
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        _ => Err(Panicked),
    }
}

/// The thread's queue, started at first use. The thread lives as long as the process.
fn sender() -> &'static Mutex<mpsc::Sender<Job>> {
    static SENDER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    SENDER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let started = std::thread::Builder::new()
            .name("aether-heavy".into())
            .spawn(move || {
                for job in rx {
                    job();
                }
            });
        if let Err(e) = started {
            // The receiver went with the failed spawn: every `run` then reports `Panicked`,
            // which its callers handle as a failed parse or warm-up.
            tracing::error!(error = %e, "starting the heavy-work thread failed");
        }
        Mutex::new(tx)
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jobs_run_on_one_thread_and_a_panic_is_reported() {
        let first = run(|| std::thread::current().id()).await.unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut waits = Vec::new();
        for i in 0..20 {
            let seen = seen.clone();
            waits.push(tokio::spawn(run(move || {
                seen.lock().unwrap().push(i);
                std::thread::current().id()
            })));
        }
        for w in waits {
            assert_eq!(
                w.await.unwrap().unwrap(),
                first,
                "every job on the one thread"
            );
        }
        assert_eq!(seen.lock().unwrap().len(), 20);
        assert!(run(|| panic!("a bug in a job")).await.is_err());
        assert_eq!(
            run(|| 7).await.unwrap(),
            7,
            "the thread outlives a panicking job"
        );
        assert_eq!(run(|| std::thread::current().id()).await.unwrap(), first);
    }
}
