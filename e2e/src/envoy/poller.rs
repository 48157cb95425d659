//! The admin stats poller that times each roll, and the roll analysis over what it saw.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{admin_get, exact_names, parse_stats};
use crate::pause::Pause;
use crate::testing::percentile;

/// 1 while Envoy holds an ADS stream.
pub const CONNECTED: &str = "control_plane.connected_state";
/// The xDS cluster of the template (`deploy/envoy/bootstrap.yaml.tmpl`).
pub const CONNECT_FAIL: &str = "cluster.xds_cluster.upstream_cx_connect_fail";
/// "Envoy accepted a config update": CDS and LDS `update_time`, gauges that Envoy sets
/// (to its wall clock in ms) together with `update_success` on every accepted response;
/// their sum moves with each update.
///
/// Checked live (`ARG_DEBUG_STATS=1` prints what a roll moves): a clean surge roll with
/// no pod change moves `update_attempt` by 2 (the failure below, then the new stream's
/// response), `update_failure` by 1, and `update_success` by 1 with `update_time`, for
/// CDS and LDS alike. So an accepted response counts even when its contents equal what
/// Envoy holds (the agent answers every new stream in full: an empty nonce is always
/// answered, see worker/src/xds/stream.rs), while `update_attempt` also counts failures
/// and would mark the stream's end as an "update". CDS is the first type the agent
/// pushes and LDS the second, so the sum moves at the first response of a new stream.
/// Being gauges, they come in the same read as `connected_state`, so the moment a roll
/// is seen connected again and the moment it is seen served are read alike.
pub const UPDATE_TIMES: [&str; 2] = [
    "cluster_manager.cds.update_time",
    "listener_manager.lds.update_time",
];
/// Envoy counts a CDS `update_failure` each time the ADS stream ends or a connect attempt
/// fails (a ConnectionFailure reported to every subscription). It marks a stream's end
/// even when the disconnected stretch was shorter than a poll and `connected_state` was
/// never seen at 0.
pub const STREAM_FAILURES: &str = "cluster_manager.cds.update_failure";

/// The poller's two queries: the counters, then the gauges. In that order a stream that
/// ends between the two reads shows as `connected_state` 0 with the old counters, a
/// clean observation of the end; the other order would show the failure counted while
/// still connected, and the gap would be read as falling between two polls. The gauges
/// hold both ends of what a roll times after the stream's end: `connected_state` and the
/// update times.
///
/// Envoy's admin walks every stat it has, on its main thread, to answer a `/stats` query,
/// and that thread is also the one that runs xDS. With 70 pods (about 15,000 stats) a
/// plain filtered query took 12.5 ms of main-thread time here, so a poller using it keeps
/// the main thread busy and delays the very config handling it times. `type=` walks one
/// kind of stat and `usedonly` skips those never written (a counter still at 0 is then
/// absent and reads as 0): these two together took 3.3 ms at 70 pods, measured as the
/// main thread's CPU time per query (`/proc/<envoy>/task/<envoy>/stat`).
pub fn poll_queries() -> [String; 2] {
    [
        format!(
            "/stats?usedonly&type=Counters&filter={}",
            exact_names(&[CONNECT_FAIL, STREAM_FAILURES])
        ),
        format!(
            "/stats?usedonly&type=Gauges&filter={}",
            exact_names(&[CONNECTED, UPDATE_TIMES[0], UPDATE_TIMES[1]])
        ),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Midpoint of the admin request that read these values.
    pub t: Instant,
    /// Midpoint of the poll before this one.
    pub prev_t: Instant,
    pub connected: bool,
    pub updates: u64,
    pub failures: u64,
    pub connect_fail: u64,
}

impl Sample {
    fn values(&self) -> (bool, u64, u64, u64) {
        (
            self.connected,
            self.updates,
            self.failures,
            self.connect_fail,
        )
    }
}

#[derive(Default)]
struct PollState {
    /// Every sample whose values differ from the one before, plus the first.
    changes: Vec<Sample>,
    last: Option<Sample>,
    polls: u64,
    max_interval: Duration,
    errors: u64,
    /// How long each poll took (both queries).
    durations: Vec<Duration>,
}

/// How often the poller reads Envoy's stats unless told otherwise.
pub const POLL_PERIOD: Duration = Duration::from_millis(2);

/// Polls the admin stats in a dedicated thread about every 2 ms (or every `period`), with
/// the two cheap queries of [`poll_queries`]; a poll that takes longer than that is
/// followed by the next one after a short pause, so the poller never keeps Envoy's main
/// thread busy.
pub struct Poller {
    state: Arc<Mutex<PollState>>,
    pause: Arc<Pause>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    pub fn start(admin: PathBuf) -> Poller {
        Self::start_every(admin, POLL_PERIOD)
    }

    pub fn start_every(admin: PathBuf, period: Duration) -> Poller {
        let state = Arc::new(Mutex::new(PollState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let pause = Arc::new(Pause::default());
        let (st, sp, pp) = (state.clone(), stop.clone(), pause.clone());
        let [counters, gauges] = poll_queries();
        let thread = std::thread::Builder::new()
            .name("admin-poller".into())
            .spawn(move || {
                realtime_priority();
                let mut prev: Option<Instant> = None;
                while !sp.load(Ordering::Relaxed) {
                    let (t0, got, t1) = pp.during(|| {
                        let t0 = Instant::now();
                        let got = admin_get(&admin, &counters)
                            .and_then(|c| Ok((c, admin_get(&admin, &gauges)?)));
                        (t0, got, Instant::now())
                    });
                    let t = t0 + (t1 - t0) / 2;
                    let mut s = st.lock().unwrap();
                    s.durations.push(t1 - t0);
                    match got {
                        Ok(((200, c), (200, g))) => {
                            let stats: Vec<_> =
                                parse_stats(&c).into_iter().chain(parse_stats(&g)).collect();
                            let get = |n: &str| {
                                stats
                                    .iter()
                                    .find(|(k, _)| k == n)
                                    .map(|(_, v)| *v)
                                    .unwrap_or(0)
                            };
                            let sample = Sample {
                                t,
                                prev_t: prev.unwrap_or(t),
                                connected: get(CONNECTED) == 1,
                                updates: UPDATE_TIMES.iter().map(|n| get(n)).sum(),
                                failures: get(STREAM_FAILURES),
                                connect_fail: get(CONNECT_FAIL),
                            };
                            let changed = s.last.is_none_or(|l| l.values() != sample.values());
                            if changed {
                                s.changes.push(sample);
                            }
                            s.last = Some(sample);
                            s.polls += 1;
                            if let Some(p) = prev {
                                s.max_interval = s.max_interval.max(t - p);
                            }
                            prev = Some(t);
                        }
                        _ => s.errors += 1,
                    }
                    drop(s);
                    // About one poll per 2 ms; never back to back, so the poller does
                    // not itself keep Envoy's main thread busy.
                    let spent = t0.elapsed();
                    std::thread::sleep(
                        period.saturating_sub(spent).max(Duration::from_micros(200)),
                    );
                }
            })
            .expect("spawn poller");
        Poller {
            state,
            pause,
            stop,
            thread: Some(thread),
        }
    }

    /// What holds the reads (from the next one on, after the one in flight): the
    /// samples then miss that stretch, while a stream that ended in it still shows in the
    /// cumulative counters of the next read.
    pub fn pause(&self) -> Arc<Pause> {
        self.pause.clone()
    }

    pub fn last(&self) -> Option<Sample> {
        self.state.lock().unwrap().last
    }

    /// Resets the worst poll interval (call once measurements start).
    pub fn reset_interval(&self) {
        let mut s = self.state.lock().unwrap();
        s.max_interval = Duration::ZERO;
        s.durations.clear();
    }

    pub fn max_interval(&self) -> Duration {
        self.state.lock().unwrap().max_interval
    }

    /// Median and worst time one poll took since the last reset.
    pub fn poll_cost(&self) -> (Duration, Duration) {
        let d = self.state.lock().unwrap().durations.clone();
        (
            percentile(&d, 50.0).unwrap_or_default(),
            percentile(&d, 100.0).unwrap_or_default(),
        )
    }

    pub fn polls_and_errors(&self) -> (u64, u64) {
        let s = self.state.lock().unwrap();
        (s.polls, s.errors)
    }

    /// Changes recorded at or after `since`, with the last sample before it first.
    pub fn since(&self, since: Instant) -> (Option<Sample>, Vec<Sample>) {
        let s = self.state.lock().unwrap();
        let idx = s.changes.partition_point(|x| x.t < since);
        (
            idx.checked_sub(1).map(|i| s.changes[i]),
            s.changes[idx..].to_vec(),
        )
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.pause.release();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs the calling thread under SCHED_FIFO when allowed (root), so that the load
/// generator, the CNI calls and the agents starting up on a small machine do not
/// stretch the poll interval. Without the privilege the poller runs as is.
fn realtime_priority() {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: sched_setscheduler with pid 0 changes only the calling thread and reads
    // `param`, a valid sched_param on the stack, during the call.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if rc != 0 {
        eprintln!(
            "   (admin poller runs without SCHED_FIFO: {})",
            std::io::Error::last_os_error()
        );
    }
}

/// One roll as seen from Envoy's stats.
#[derive(Debug, Clone, Copy)]
pub struct RollTimes {
    /// When the old stream ended: the first sample showing `connected_state` 0, or, when
    /// the disconnected stretch fell between two polls, the poll before the one that
    /// counted the failure (so the gap is then an upper bound, one poll interval).
    pub down: Instant,
    /// First sample connected again after the last disconnected one.
    pub up: Instant,
    /// First sample whose update counter moved after the old stream's end.
    pub served: Instant,
    /// Whether `connected_state` 0 was seen at all.
    pub observed: bool,
    /// Stream ends and failed connects Envoy counted (1 for a clean roll).
    pub stream_failures: u64,
    pub connect_fail: u64,
}

impl RollTimes {
    /// `connected_state` 0 until 1 again.
    pub fn gap(&self) -> Duration {
        self.up - self.down
    }

    /// The old stream's end until the first config update on the new one.
    pub fn served_gap(&self) -> Duration {
        self.served - self.down
    }

    /// "gap X ms, served gap Y ms", saying when the gap fell between two polls.
    pub fn summary(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let note = if self.observed {
            ""
        } else {
            " (between two polls)"
        };
        format!(
            "gap {:.1} ms{note}, served gap {:.1} ms",
            ms(self.gap()),
            ms(self.served_gap())
        )
    }
}

/// Reads a roll from the changes since the roll began (`before`: the last change before
/// it): Some once Envoy has lost its stream, regained it, taken a config update on the
/// new one, and is connected now.
pub fn analyze(before: Option<Sample>, changes: &[Sample]) -> Option<RollTimes> {
    let base = before.or_else(|| changes.first().copied())?;
    let first_end = changes
        .iter()
        .position(|s| !s.connected || s.failures > base.failures)?;
    let end = changes[first_end];
    let prev = if first_end > 0 {
        changes[first_end - 1]
    } else {
        base
    };
    // Updates seen together with the end came from the old stream when connected_state
    // shows 0 (nothing is applied without a stream); when it does not, the new stream is
    // already up in that sample and its updates count as served.
    let (down, base_updates, observed) = if end.connected {
        (end.prev_t, prev.updates, false)
    } else {
        (end.t, end.updates, true)
    };
    let up = match changes.iter().rposition(|s| !s.connected) {
        Some(last_down) if last_down >= first_end => {
            changes[last_down + 1..].iter().find(|s| s.connected)?.t
        }
        _ => end.t,
    };
    let served = changes[first_end..]
        .iter()
        .find(|s| s.updates > base_updates)?
        .t;
    let last = changes.last()?;
    if !last.connected {
        return None;
    }
    Some(RollTimes {
        down,
        up,
        served,
        observed,
        stream_failures: last.failures.saturating_sub(base.failures),
        connect_fail: last.connect_fail.saturating_sub(base.connect_fail),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(vals: &[(u64, bool, u64, u64)]) -> Vec<Sample> {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        vals.iter()
            .map(|&(ms, connected, updates, failures)| Sample {
                t: at(ms),
                prev_t: at(ms.saturating_sub(2)),
                connected,
                updates,
                failures,
                connect_fail: 0,
            })
            .collect()
    }

    #[test]
    fn observed_gap_and_served_gap() {
        let s = seq(&[
            (0, true, 10, 0),
            (100, false, 10, 1),
            (150, true, 10, 1),
            (152, true, 12, 1),
        ]);
        let r = analyze(Some(s[0]), &s[1..]).unwrap();
        assert!(r.observed);
        assert_eq!((r.up - r.down).as_millis(), 50);
        assert_eq!((r.served - r.down).as_millis(), 52);
        assert_eq!(r.stream_failures, 1);
    }

    #[test]
    fn gap_between_two_polls_is_bounded_by_the_interval() {
        let s = seq(&[(0, true, 10, 0), (100, true, 11, 1)]);
        let r = analyze(Some(s[0]), &s[1..]).unwrap();
        assert!(!r.observed);
        assert_eq!((r.up - r.down).as_millis(), 2);
        assert_eq!((r.served - r.down).as_millis(), 2);
    }

    #[test]
    fn incomplete_until_served_and_connected() {
        let s = seq(&[(0, true, 10, 0), (100, false, 10, 1), (150, true, 10, 1)]);
        assert!(analyze(Some(s[0]), &s[1..]).is_none());
        let s = seq(&[
            (0, true, 10, 0),
            (100, false, 10, 1),
            (150, true, 10, 1),
            (160, false, 10, 2),
        ]);
        assert!(analyze(Some(s[0]), &s[1..]).is_none());
        let s = seq(&[(0, true, 10, 0), (5, true, 11, 0)]);
        assert!(
            analyze(Some(s[0]), &s[1..]).is_none(),
            "an update on the old stream is no roll"
        );
    }

    #[test]
    fn failed_connects_end_at_the_last_disconnect() {
        let s = seq(&[
            (0, true, 10, 0),
            (100, false, 10, 1),
            (140, true, 10, 1),
            (142, false, 10, 2),
            (300, true, 10, 2),
            (303, true, 12, 2),
        ]);
        let r = analyze(Some(s[0]), &s[1..]).unwrap();
        assert_eq!((r.up - r.down).as_millis(), 200);
        assert_eq!((r.served - r.down).as_millis(), 203);
        assert_eq!(r.stream_failures, 2);
    }
}
