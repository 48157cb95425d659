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
//! Jobs run one at a time, in two lanes: a job sent with [`run_first`] (a look at a
//! changed file: the node's view of it waits for that job) runs before every job sent
//! with [`run`] (the encoding warm-up, which only saves later pushes their encoding)
//! that has not started yet; within a lane, in the order sent. At 10,000 services a
//! standby's first warm-up encodes every resource, and a registry change renamed into
//! place as it took over used to wait for all of it: the new owner served the file's
//! previous state for half a second and more (the change was then rolled back in the
//! proxy, which the old owner had already sent it to), and a change flipped back within
//! that time was never seen at all. The warm-up is sent in chunks
//! ([`crate::xds::encoded::keep_warm`]), so a look waits for one chunk at most.
//!
//! A job that panics is reported to its caller as [`Panicked`], as `spawn_blocking`
//! reports it, and the thread carries on.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, OnceLock, mpsc};

use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// Which of the two lanes a job goes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lane {
    /// Ahead of every background job not started yet.
    First,
    Background,
}

/// The job panicked (or the thread could not be started); its result is lost.
#[derive(Debug)]
pub struct Panicked;

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the heavy-work job panicked")
    }
}

/// Runs `f` on the heavy-work thread, behind the jobs sent before it, and waits for its
/// result without holding up the runtime.
pub async fn run<T, F>(f: F) -> Result<T, Panicked>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    send(Lane::Background, f).await
}

/// Runs `f` on the heavy-work thread ahead of the [`run`] jobs waiting there (after the
/// job running now and the [`run_first`] jobs sent before it), and waits for its result.
pub async fn run_first<T, F>(f: F) -> Result<T, Panicked>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    send(Lane::First, f).await
}

async fn send<T, F>(lane: Lane, f: F) -> Result<T, Panicked>
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
        .send((lane, job))
        .map_err(|_| Panicked)?;
    match rx.await {
        Ok(Ok(v)) => Ok(v),
        _ => Err(Panicked),
    }
}

/// The jobs received and not started, by lane: the thread's order, apart from the
/// channel that feeds it.
struct Queue<J> {
    first: VecDeque<J>,
    background: VecDeque<J>,
}

impl<J> Default for Queue<J> {
    fn default() -> Self {
        Self {
            first: VecDeque::new(),
            background: VecDeque::new(),
        }
    }
}

impl<J> Queue<J> {
    fn push(&mut self, lane: Lane, job: J) {
        match lane {
            Lane::First => self.first.push_back(job),
            Lane::Background => self.background.push_back(job),
        }
    }

    /// The job to start next.
    fn pop(&mut self) -> Option<J> {
        self.first
            .pop_front()
            .or_else(|| self.background.pop_front())
    }
}

/// Runs the jobs `rx` brings, each lane in order and the first lane ahead, until every
/// sender is gone and nothing is left.
fn serve<J: FnOnce()>(rx: &mpsc::Receiver<(Lane, J)>) {
    let mut queue = Queue::default();
    loop {
        // Everything sent while the last job ran, so that a first-lane job among it
        // overtakes the background jobs sent before it.
        while let Ok((lane, job)) = rx.try_recv() {
            queue.push(lane, job);
        }
        match queue.pop() {
            Some(job) => job(),
            None => match rx.recv() {
                Ok((lane, job)) => queue.push(lane, job),
                Err(_) => return,
            },
        }
    }
}

/// The thread's queue, started at first use. The thread lives as long as the process.
fn sender() -> &'static Mutex<mpsc::Sender<(Lane, Job)>> {
    static SENDER: OnceLock<Mutex<mpsc::Sender<(Lane, Job)>>> = OnceLock::new();
    SENDER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<(Lane, Job)>();
        let started = std::thread::Builder::new()
            .name("aether-heavy".into())
            .spawn(move || serve(&rx));
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
        assert!(run_first(|| panic!("a bug in a job")).await.is_err());
        assert_eq!(
            run(|| 7).await.unwrap(),
            7,
            "the thread outlives a panicking job"
        );
        assert_eq!(
            run_first(|| std::thread::current().id()).await.unwrap(),
            first
        );
    }

    /// The thread's order, on a thread of the test's own: while a job runs, background
    /// jobs and then first-lane jobs are sent; the first-lane ones run next, in the order
    /// sent, and the background ones after them, in theirs.
    #[test]
    fn first_lane_jobs_overtake_waiting_background_jobs_and_each_lane_keeps_its_order() {
        let (tx, rx) = mpsc::channel::<(Lane, Box<dyn FnOnce() + Send>)>();
        let order = Arc::new(Mutex::new(Vec::new()));
        let (started_tx, started) = mpsc::channel();
        let (release, released) = mpsc::channel::<()>();
        let job = |name: &'static str| -> Box<dyn FnOnce() + Send> {
            let order = order.clone();
            Box::new(move || order.lock().unwrap().push(name))
        };
        tx.send((
            Lane::Background,
            Box::new(move || {
                started_tx.send(()).unwrap();
                released.recv().unwrap();
            }),
        ))
        .unwrap();
        let thread = std::thread::spawn(move || serve(&rx));
        started.recv().unwrap();
        for (lane, name) in [
            (Lane::Background, "warm 1"),
            (Lane::Background, "warm 2"),
            (Lane::First, "look 1"),
            (Lane::Background, "warm 3"),
            (Lane::First, "look 2"),
        ] {
            tx.send((lane, job(name))).unwrap();
        }
        release.send(()).unwrap();
        drop(tx);
        thread.join().unwrap();
        assert_eq!(
            *order.lock().unwrap(),
            ["look 1", "look 2", "warm 1", "warm 2", "warm 3"]
        );
    }

    #[test]
    fn the_queue_pops_the_first_lane_before_the_background() {
        let mut q = Queue::default();
        assert_eq!(q.pop(), None::<u8>);
        q.push(Lane::Background, 1);
        q.push(Lane::First, 2);
        q.push(Lane::Background, 3);
        q.push(Lane::First, 4);
        let popped: Vec<u8> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(popped, [2, 4, 1, 3]);
    }
}
