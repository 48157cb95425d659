//! Each ADS reconnect as Envoy's own log times it, in microseconds and without a poll:
//! the old stream's end, the new stream's start (where Envoy sets `connected_state` to 1)
//! and its first accepted CDS or LDS response (where it sets `update_time`). The admin
//! poller ([`super::Poller`]) samples the same three moments every few milliseconds, and
//! each of its samples costs Envoy's main thread, the one that runs xDS, a walk of its
//! stats; the log costs a few lines. Needs the log format the harness sets with
//! `AETHER_E2E_ENVOY_LOG`, and `config:debug` among its levels (the start and the accepts
//! are debug lines).

/// One reconnect, in seconds since midnight of the log's first line (Envoy's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reconnect {
    /// "gRPC config stream to xds_cluster closed".
    pub down: f64,
    /// "Establishing new gRPC bidi stream": the last before `served`.
    pub up: Option<f64>,
    /// The first "config for …Cluster/Listener… accepted" after `down`.
    pub served: Option<f64>,
}

impl Reconnect {
    /// The new stream's start until its first accepted config: what the harness calls the
    /// served gap minus the gap.
    pub fn served_after_up(&self) -> Option<f64> {
        Some(self.served? - self.up?)
    }

    pub fn gap(&self) -> Option<f64> {
        Some(self.up? - self.down)
    }
}

/// `[HH:MM:SS.ffffff]` at the start of `line`, in seconds.
fn time_of(line: &str) -> Option<f64> {
    let stamp = line.strip_prefix('[')?.split(']').next()?;
    let mut parts = stamp.split(':');
    let (h, m, s) = (
        parts.next()?.parse::<f64>().ok()?,
        parts.next()?.parse::<f64>().ok()?,
        parts.next()?.parse::<f64>().ok()?,
    );
    Some(h * 3600.0 + m * 60.0 + s)
}

/// Every reconnect in `log`, in order. A stream that ends again before it is served
/// (a failed connect) stays one reconnect, as the poller counts it.
pub fn reconnects(log: &str) -> Vec<Reconnect> {
    let mut out: Vec<Reconnect> = Vec::new();
    let (mut last, mut day) = (None::<f64>, 0.0);
    for line in log.lines() {
        let Some(mut t) = time_of(line) else { continue };
        // Past midnight the clock starts again.
        if last.is_some_and(|l| t + day < l - 43_200.0) {
            day += 86_400.0;
        }
        t += day;
        last = Some(t);
        let open = out.last_mut().filter(|r| r.served.is_none());
        if line.contains("gRPC config stream to xds_cluster closed") {
            if open.is_none() {
                out.push(Reconnect {
                    down: t,
                    up: None,
                    served: None,
                });
            }
        } else if line.contains("Establishing new gRPC bidi stream") {
            if let Some(r) = open {
                r.up = Some(t);
            }
        } else if let Some(r) = open
            && r.up.is_some()
            && line.contains(" accepted with ")
            && (line.contains("envoy.config.cluster.v3.Cluster ")
                || line.contains("envoy.config.listener.v3.Listener "))
        {
            r.served = Some(t);
        }
    }
    out
}

/// The times (seconds since midnight, Envoy's clock) at which Envoy accepted a delta EDS
/// response that added or removed a load assignment, in order. Envoy ACKs a response as
/// it accepts it, so these are the ACKs of endpoint changes; answers that carried nothing
/// (a new stream's first, over delta ADS) are left out.
pub fn eds_changes(log: &str) -> Vec<f64> {
    log.lines()
        .filter(|l| {
            l.contains("envoy.config.endpoint.v3.ClusterLoadAssignment accepted with ")
                && !l.contains(" accepted with 0 resources added, 0 removed")
        })
        .filter_map(time_of)
        .collect()
}

/// The seconds from `t0` to `t`, both seconds since midnight (a log's clock), across one
/// midnight either way.
pub fn after(t0: f64, t: f64) -> f64 {
    let d = t - t0;
    if d < -43_200.0 {
        d + 86_400.0
    } else if d > 43_200.0 {
        d - 86_400.0
    } else {
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
[23:59:59.900000][1][info][main] starting main dispatch loop
[23:59:59.990000][1][warning][config] DeltaAggregatedResources gRPC config stream to xds_cluster closed: 13, upstream_reset_after_response_started{connection_termination}
[23:59:59.990100][1][debug][config] gRPC update for type.googleapis.com/envoy.config.cluster.v3.Cluster failed
[23:59:59.995000][1][debug][config] Establishing new gRPC bidi stream to xds_cluster for rpc DeltaAggregatedResources(stream)
[00:00:00.001000][1][debug][config] Delta config for type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment accepted with 0 resources added, 0 removed
[00:00:00.002500][1][debug][config] Delta config for type.googleapis.com/envoy.config.cluster.v3.Cluster accepted with 1 resources added, 0 removed
[00:00:00.003000][1][debug][config] Delta config for type.googleapis.com/envoy.config.listener.v3.Listener accepted with 1 resources added, 0 removed
[00:00:01.000000][1][warning][config] StreamAggregatedResources gRPC config stream to xds_cluster closed: 14, upstream connect error
[00:00:01.010000][1][debug][config] Establishing new gRPC bidi stream to xds_cluster for rpc StreamAggregatedResources(stream)
[00:00:01.011000][1][warning][config] StreamAggregatedResources gRPC config stream to xds_cluster closed: 14, upstream connect error
[00:00:01.030000][1][debug][config] Establishing new gRPC bidi stream to xds_cluster for rpc StreamAggregatedResources(stream)
[00:00:01.034000][1][debug][config] gRPC config for type.googleapis.com/envoy.config.listener.v3.Listener accepted with 3 resources with version 7
[00:00:02.000000][1][warning][config] DeltaAggregatedResources gRPC config stream to xds_cluster closed: 13, upstream_reset_after_response_started{connection_termination}
";

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-9)
    }

    #[test]
    fn each_reconnect_from_the_streams_end_to_its_first_accepted_cds_or_lds() {
        let r = reconnects(LOG);
        assert_eq!(r.len(), 3, "{r:?}");
        // Across midnight; EDS's accept does not count, CDS's does.
        assert!(
            close(r[0].gap(), 0.005) && close(r[0].served_after_up(), 0.0075),
            "{:?}",
            r[0]
        );
        // A connect that failed: one reconnect, timed from its last start.
        assert!(
            close(r[1].gap(), 0.030) && close(r[1].served_after_up(), 0.004),
            "{:?}",
            r[1]
        );
        // Not reconnected when the log ends.
        assert_eq!((r[2].up, r[2].served), (None, None));
    }

    #[test]
    fn endpoint_changes_are_the_eds_accepts_that_carried_something() {
        let log = format!(
            "{LOG}[00:00:03.250000][1][debug][config] Delta config for type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment accepted with 1 resources added, 0 removed\n"
        );
        let t = eds_changes(&log);
        assert_eq!(t.len(), 1, "{t:?}");
        assert!((t[0] - 3.25).abs() < 1e-9);
        assert!((after(86_399.5, 0.25) - 0.75).abs() < 1e-9);
        assert!((after(0.25, 86_399.5) + 0.75).abs() < 1e-9);
        assert!((after(1.0, 1.5) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_log_without_the_debug_lines_times_nothing() {
        let info: String = LOG
            .lines()
            .filter(|l| !l.contains("][debug]["))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            reconnects(&info)
                .iter()
                .all(|r| r.gap().is_none() && r.served_after_up().is_none())
        );
        assert!(reconnects("no timestamps here\n").is_empty());
    }
}
