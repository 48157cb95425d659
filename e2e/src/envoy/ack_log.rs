//! Timing a change to Envoy's ACK from the agent's own log, for the benchmarks that
//! measure propagation at scale (cross-node, discovery-ack).
//!
//! The agent's ADS server logs each push and each ACK at debug level with their nonces
//! (`aether_worker::xds::server`); [`AgentLog`] reads those lines' timestamps. Envoy
//! applies a load assignment on its main thread before it ACKs, so the ACK is the moment
//! Envoy holds the change, and nothing has to poll that thread while a change is timed:
//! polling Envoy's admin instead costs the thread that runs xDS milliseconds per query
//! with 1,000 clusters. Each change is checked afterwards, outside the timing, with one
//! config dump query filtered to its cluster ([`wait_endpoints`]).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::Envoy;
use crate::testing::{percentile, try_wait_for};

/// The agents' log filter: the ADS server's push and ACK lines carry what is timed.
pub const AGENT_LOG: &str = "info,aether_worker::xds::server=debug";
pub const EDS: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

/// Runs this benchmark again with `AETHER_E2E_AGENT_LOG` set to [`AGENT_LOG`], and exits
/// with its status, unless it is set already. The node rig starts agents with the log
/// filter in that variable, read when each is spawned; setting it in this process would
/// take `unsafe` (`set_var`).
pub fn rerun_with_agent_log() {
    if std::env::var_os("AETHER_E2E_AGENT_LOG").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("this bench's path");
    let status = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("AETHER_E2E_AGENT_LOG", AGENT_LOG)
        .status()
        .expect("run the bench again");
    std::process::exit(status.code().unwrap_or(1));
}

/// A load assignment push and Envoy's ACK of it, as the agent logged them.
pub struct Exchange {
    /// When the agent's stream saw the snapshot with the change (the push's time less its
    /// `since_change_us`).
    pub snapshot: SystemTime,
    pub pushed: SystemTime,
    pub acked: SystemTime,
}

/// An agent's log, read from where the last change's lines ended.
pub struct AgentLog {
    path: PathBuf,
    offset: u64,
    partial: String,
    /// The push awaiting its ACK: nonce, time, `since_change_us`.
    push: Option<(String, SystemTime, Duration)>,
}

impl AgentLog {
    pub fn new(path: &Path) -> Self {
        let mut log = AgentLog {
            path: path.to_owned(),
            offset: 0,
            partial: String::new(),
            push: None,
        };
        log.skip_to_end();
        log
    }

    /// Forgets everything logged so far.
    pub fn skip_to_end(&mut self) {
        self.offset = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        self.partial.clear();
        self.push = None;
    }

    /// The first load assignment push logged since the last call with its ACK, once both
    /// are in the log.
    pub fn exchange(&mut self) -> Option<Exchange> {
        let mut f = std::fs::File::open(&self.path).ok()?;
        f.seek(SeekFrom::Start(self.offset)).ok()?;
        let mut new = String::new();
        self.offset += f.read_to_string(&mut new).ok()? as u64;
        self.partial.push_str(&new);
        let complete = self.partial.rfind('\n').map_or(0, |i| i + 1);
        let lines: Vec<String> = self.partial[..complete].lines().map(String::from).collect();
        self.partial.drain(..complete);
        for line in lines {
            if !line.contains(" DEBUG aether_worker::xds::server: ")
                || field(&line, "type_url") != Some(EDS)
            {
                continue;
            }
            let at = line.split(' ').next().and_then(parse_utc);
            let nonce = field(&line, "nonce");
            if line.contains(": push ") && self.push.is_none() {
                let since = field(&line, "since_change_us")
                    .and_then(|v| v.parse().ok())
                    .map(Duration::from_micros);
                let (Some(at), Some(nonce), Some(since)) = (at, nonce, since) else {
                    panic!("unreadable push line {line:?}")
                };
                self.push = Some((nonce.to_owned(), at, since));
            } else if line.contains(": ACK ")
                && let Some((pushed_nonce, pushed, since)) = &self.push
                && nonce == Some(pushed_nonce.as_str())
            {
                let acked = at.unwrap_or_else(|| panic!("unreadable ACK line {line:?}"));
                let ex = Exchange {
                    snapshot: *pushed - *since,
                    pushed: *pushed,
                    acked,
                };
                self.skip_to_end();
                return Some(ex);
            }
        }
        None
    }

    /// Polls [`AgentLog::exchange`] until it has one; an error naming `what` after
    /// `timeout`.
    pub fn wait(&mut self, what: &str, timeout: Duration) -> anyhow::Result<Exchange> {
        try_wait_for(what, timeout, || self.exchange())
            .map_err(|e| anyhow::anyhow!("{e} (the agents' log filter must hold {AGENT_LOG:?})"))
    }
}

/// The value of `name=` in a log line, without quotes.
pub fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let start = line.find(&format!(" {name}="))? + name.len() + 2;
    let rest = &line[start..];
    Some(rest[..rest.find(' ').unwrap_or(rest.len())].trim_matches('"'))
}

/// A log line's UTC timestamp (`2026-01-02T03:04:05.123456Z`, tracing's default).
pub fn parse_utc(ts: &str) -> Option<SystemTime> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let num = |s: &str| s.parse::<i64>().ok();
    let mut d = date.split('-');
    let (y, m, day) = (num(d.next()?)?, num(d.next()?)?, num(d.next()?)?);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':');
    let (h, min, sec) = (num(t.next()?)?, num(t.next()?)?, num(t.next()?)?);
    let nanos: u64 = format!("{frac:0<9}").get(..9)?.parse().ok()?;
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let secs = u64::try_from(days * 86_400 + h * 3_600 + min * 60 + sec).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_nanos(nanos))
}

/// The time from `t0` to `t`; zero if `t` is earlier.
pub fn since(t0: SystemTime, t: SystemTime) -> Duration {
    t.duration_since(t0).unwrap_or_default()
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Prints one row of figures: count, median, p99 and max of `v`.
pub fn summary(name: &str, v: &[Duration]) {
    let at = |p: f64| ms(percentile(v, p).expect("samples"));
    println!(
        "{name:<48} n={:<4} median {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms",
        v.len(),
        at(50.0),
        at(99.0),
        at(100.0)
    );
}

/// The admin path that dumps only `cluster`'s load assignment.
pub fn eds_query(cluster: &str) -> String {
    let escaped: String = cluster
        .chars()
        .flat_map(|c| {
            if "\\.|()[]{}^$*+?".contains(c) {
                vec!['\\', c]
            } else {
                vec![c]
            }
        })
        .collect();
    format!(
        "/config_dump?resource=dynamic_endpoint_configs&include_eds&name_regex={}",
        super::encode(&format!("^{escaped}$"))
    )
}

/// The endpoints of one load assignment in a filtered config dump, as
/// [`super::endpoints`] writes them; None when the dump does not hold `cluster`.
pub fn endpoints_of(dump: &Value, cluster: &str) -> Option<Vec<String>> {
    let configs = dump["configs"].as_array()?;
    let config = configs
        .iter()
        .map(|c| &c["endpoint_config"])
        .find(|c| c["cluster_name"] == cluster)?;
    Some(super::load_assignment_lines(config))
}

/// When Envoy's config dump first showed a change after its ACK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// At the first query.
    AtAck,
    /// At a later one.
    Later,
}

/// Waits up to a second for Envoy's config dump, filtered to `cluster`, to show `want`
/// (sorted, as [`endpoints_of`] writes them). Err: what it showed last, if anything.
pub fn wait_endpoints(
    envoy: &Envoy,
    cluster: &str,
    want: &[String],
) -> Result<Shown, Option<Vec<String>>> {
    let query = eds_query(cluster);
    let mut got = None;
    let mut shown = Shown::AtAck;
    let done = try_wait_for(
        &format!("{cluster} in Envoy's config dump"),
        Duration::from_secs(1),
        || {
            got = envoy
                .get(&query)
                .ok()
                .and_then(|(_, b)| endpoints_of(&serde_json::from_str(&b).ok()?, cluster));
            if got.as_deref() == Some(want) {
                return Some(());
            }
            shown = Shown::Later;
            None
        },
    );
    done.map(|()| shown).map_err(|_| got)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_fields_and_timestamps_are_read() {
        let line = r#"2026-01-02T03:04:05.123456Z DEBUG aether_worker::xds::server: push type_url="t" nonce=7 since_change_us=250"#;
        assert_eq!(field(line, "nonce"), Some("7"));
        assert_eq!(field(line, "type_url"), Some("t"));
        assert_eq!(field(line, "absent"), None);
        let at = parse_utc("2026-01-02T03:04:05.123456Z").unwrap();
        assert_eq!(
            at.duration_since(UNIX_EPOCH).unwrap(),
            Duration::from_secs(1_767_323_045) + Duration::from_micros(123_456)
        );
        assert_eq!(parse_utc("1970-01-01T00:00:00Z"), Some(UNIX_EPOCH));
        assert_eq!(parse_utc("not a time"), None);
    }
}
