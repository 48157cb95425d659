//! Wall-clock jumps of an hour each way (fault matrix row 20), applied to the real agent
//! with libfaketime: every timer and deadline runs on the monotonic clock, so a jump
//! changes none of them; only what is dated by the wall clock moves with it (log
//! timestamps, the SVID expiry check). ARCHITECTURE.md, "Wall clock", lists each reader.
//!
//! The supervisor runs with `LD_PRELOAD=libfaketime.so.1`. It passes its worker only the
//! variables it names (`RUST_LOG`, ...), so the worker is started through `worker-with-env`
//! (`--worker-bin`), which execs the real worker with the same variables. Both read the
//! offset from one file per generation, with no cache, so rewriting it jumps the wall
//! clock of a running agent; `FAKETIME_DONT_FAKE_MONOTONIC=1` leaves `CLOCK_MONOTONIC`
//! alone, as a real jump (settimeofday, an NTP step) does. A time namespace would not
//! do: it offsets only the monotonic and boot clocks.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{
    Agent, LocalNode, bin, identity_args, identity_provider_for_agents, pod_records, quarantined,
    wait_for,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const T: Duration = Duration::from_secs(10);
const HOUR: i64 = 3600;

/// Where Debian's `libfaketime` puts the library, per architecture.
fn libfaketime() -> Option<PathBuf> {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|a| PathBuf::from(format!("/usr/lib/{a}/faketime/libfaketime.so.1")))
        .find(|p| p.exists())
}

fn skip_without_libfaketime(name: &str) -> Option<PathBuf> {
    let lib = libfaketime();
    if lib.is_none() {
        eprintln!(
            "SKIPPED {name}: libfaketime is not installed (scripts/install-deps.sh installs the faketime package; CI runs it)"
        );
    }
    lib
}

/// One generation's wall-clock offset, read by libfaketime in its supervisor and worker
/// at every wall-clock read.
struct Clock {
    path: PathBuf,
}

impl Clock {
    /// Sets the offset (`+1h`, `-1h`, `+0`) with an atomic rename, so that a read never
    /// sees a half-written file.
    fn set(&self, spec: &str) {
        let tmp = self.path.with_extension("tmp");
        std::fs::write(&tmp, format!("{spec}\n"))
            .unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
            .expect("chmod the clock file");
        std::fs::rename(&tmp, &self.path)
            .unwrap_or_else(|e| panic!("rename to {}: {e}", self.path.display()));
    }
}

/// Starts a generation named `pod` whose supervisor and worker see the wall clock at
/// `spec` from the real one.
fn start_jumped(
    node: &mut LocalNode,
    lib: &Path,
    pod: &str,
    spec: &str,
    extra: &[String],
) -> (Agent, Clock) {
    let clock = Clock {
        path: node.root.path().join(format!("faketime-{pod}")),
    };
    clock.set(spec);
    let env = [
        format!("LD_PRELOAD={}", lib.display()),
        format!("FAKETIME_TIMESTAMP_FILE={}", clock.path.display()),
        "FAKETIME_NO_CACHE=1".to_string(),
        "FAKETIME_DONT_FAKE_MONOTONIC=1".to_string(),
    ];
    let worker_env = node.root.path().join(format!("worker-env-{pod}"));
    let text = std::iter::once(bin("aether-worker").display().to_string())
        .chain(env.iter().cloned())
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&worker_env, text + "\n")
        .unwrap_or_else(|e| panic!("write {}: {e}", worker_env.display()));
    std::fs::set_permissions(&worker_env, std::fs::Permissions::from_mode(0o644))
        .expect("chmod the worker's env file");
    let wrapper: Vec<&str> = std::iter::once("env")
        .chain(env.iter().map(String::as_str))
        .collect();
    let mut args = vec![
        format!("--worker-bin={}", bin("worker-with-env").display()),
        format!("--pod-name={pod}"),
    ];
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (node.start_agent_wrapped(&wrapper, &args), clock)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs_f64()
}

/// Unix seconds of an RFC 3339 UTC timestamp as tracing writes it
/// (`2026-12-01T04:00:00.123456Z`).
fn parse_utc(ts: &str) -> Option<f64> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min, s) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + min * 60) as f64 + s)
}

/// The timestamps (unix seconds) of the log lines past the first `skip` whose target
/// starts with `target` (`aether_supervisor`, `aether_worker`).
fn stamps(log: &str, skip: usize, target: &str) -> Vec<f64> {
    log.lines()
        .skip(skip)
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let ts = parse_utc(words.next()?)?;
            let _level = words.next()?;
            words.next()?.starts_with(target).then_some(ts)
        })
        .collect()
}

/// Asserts that `process`'s log lines past the first `skip`, written while the real clock
/// went from `from` to now, carry the real time plus `offset` seconds (2 s of slack for
/// the file cache and the log's write): the jump reached that process.
fn assert_jumped(agent: &Agent, skip: usize, process: &str, from: f64, offset: i64) {
    let to = unix_now();
    let seen = stamps(&agent.log(), skip, process);
    assert!(
        !seen.is_empty(),
        "no {process} log line of {} past line {skip}:\n{}",
        agent.name,
        agent.log()
    );
    for ts in &seen {
        let shifted = ts - offset as f64;
        assert!(
            shifted >= from - 2.0 && shifted <= to + 2.0,
            "{process} of {} logged at {ts:.3}, not the real time {from:.3}..{to:.3} plus {offset} s:\n{}",
            agent.name,
            agent.log()
        );
    }
    eprintln!(
        "{} {process}: {} log lines at the real clock {offset:+} s",
        agent.name,
        seen.len()
    );
}

/// Asserts that the owner's `mesh-dns.heartbeat` (unix ms, written every 5 s) is dated on
/// the clock `offset` seconds from the real one: read after the jump has held 7 s, it was
/// written within the last 5 s.
fn assert_heartbeat(node: &LocalNode, offset: i64) {
    let path = node.state_dir.join("mesh-dns.heartbeat");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let ms: f64 = text
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{}: {text:?}: {e}", path.display()));
    let age = unix_now() + offset as f64 - ms / 1000.0;
    assert!(
        (-1.0..=7.0).contains(&age),
        "{} is {age:.1} s old by a clock {offset:+} s from the real one",
        path.display()
    );
}

fn lines(agent: &Agent) -> usize {
    agent.log().lines().count()
}

fn pod(n: u32) -> (PodId, Ipv4Addr) {
    (
        PodId {
            uid: format!("clock-pod-{n}-uid"),
            name: format!("clock-{n}"),
        },
        Ipv4Addr::new(10, 89, 0, n as u8 + 1),
    )
}

/// One CNI call through the real plugin, timed; panics with the plugin's output on failure.
fn cni_call(cni: &Cni, command: &str, pod: &PodId, ip: Option<Ipv4Addr>) -> Duration {
    let start = Instant::now();
    cni.call(command, pod, ip)
        .unwrap_or_else(|e| panic!("CNI {command} of {}: {e}", pod.uid));
    start.elapsed()
}

/// The uids of the decoded pod records; panics on a temp file or an undecodable record.
fn record_uids(node: &LocalNode) -> Vec<String> {
    let records: BTreeMap<_, _> = pod_records(&node.state_dir);
    records
        .into_iter()
        .map(|(file, r)| {
            r.map(|p| p.uid)
                .unwrap_or_else(|e| panic!("pod record {file}: {e}"))
        })
        .collect()
}

/// Whether the supervisor has logged `pid`'s end as a process: reaped after its
/// replacement (its control socket closed first, the usual order), or its exit as the
/// cause of the respawn.
fn reaped(log: &str, pid: i32) -> bool {
    let (status, respawn) = (format!("Pid({pid})"), format!("pid={pid} "));
    log.lines().any(|l| {
        (l.contains("reaped a worker that was already replaced") && l.contains(&status))
            || (l.contains("worker exited unexpectedly")
                && l.contains(&respawn)
                && l.contains("how=\"exited"))
    })
}

/// SIGSTOPs the serving worker, jumps `clock` to `spec` one second into the heartbeat's
/// wait when given, and returns how long the supervisor took to replace it.
fn hang_worker(owner: &Agent, clock: &Clock, jump_to: Option<&str>) -> Duration {
    let old = owner.worker_pid();
    let serving = owner.log().matches("worker serves the node").count();
    // The new worker's last line of a respawn: its mesh-DNS writer reads the file back once
    // it serves (the owner wrote the file at its start).
    let read_back = owner
        .log()
        .matches("mesh-DNS snapshot read back as serving starts")
        .count();
    let start = Instant::now();
    kill(Pid::from_raw(old), Signal::SIGSTOP).expect("stop the worker");
    if let Some(spec) = jump_to {
        // Holds the hang for a second before the jump, so that the heartbeat's deadline is
        // armed and pending when the clock moves.
        std::thread::sleep(Duration::from_secs(1));
        clock.set(spec);
    }
    wait_for(
        "a replacement worker serving",
        Duration::from_secs(20),
        || {
            owner
                .serving_owner()
                .filter(|v| v["pid"].as_i64() != Some(old as i64))
                .map(|_| ())
        },
    );
    let took = start.elapsed();
    // The supervisor logs the Serving report just after the worker's /ready says so, the
    // worker's mesh-DNS writer logs its read-back just after it starts serving, and the
    // supervisor logs the old worker's reaping whenever its SIGCHLD comes, which can be
    // after both; waits for all three, so that a log mark taken next follows every line of
    // this respawn.
    wait_for(
        "the supervisor and the new worker to log the replacement serving",
        T,
        || {
            let log = owner.log();
            (log.matches("worker serves the node").count() > serving
                && log
                    .matches("mesh-DNS snapshot read back as serving starts")
                    .count()
                    > read_back
                && reaped(&log, old))
            .then_some(())
        },
    );
    took
}

/// Row 20, heartbeats and deadlines. Invariants: a healthy worker is never killed when
/// the wall clock jumps an hour forward or back; a hung worker is still killed and
/// replaced within the heartbeat's bound (5 s without a Pong, pings every 1 s) when the
/// clock jumps while its deadline is pending, taking as long as with no jump; the ADD's
/// 2 s ACK wait (no proxy here, so it runs to its end) lasts 2 s at every offset; the
/// first respawn after a healthy run is immediate; CNI ADD and DEL work and their records
/// round-trip across the jumps and respawns (no lost pod, no phantom pod).
#[test]
fn heartbeats_and_deadlines_keep_their_length_across_wall_clock_jumps() {
    const NAME: &str = "heartbeats_and_deadlines_keep_their_length_across_wall_clock_jumps";
    let Some(lib) = skip_without_libfaketime(NAME) else {
        return;
    };
    let mut node = LocalNode::new();
    let (owner, clock) = start_jumped(&mut node, &lib, "clock-owner", "+0", &[]);
    owner.wait_role("owner", T);
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };

    // Baselines at the real time: an ADD's ACK wait, and a hung worker's replacement.
    let (p1, ip1) = pod(1);
    let add_base = cni_call(&cni, "ADD", &p1, Some(ip1));
    let hang_base = hang_worker(&owner, &clock, None);
    eprintln!("baseline: ADD {add_base:?}, hung worker replaced after {hang_base:?}");

    // Forward an hour; the jump shows in both processes' log lines.
    let (mark, from) = (lines(&owner), unix_now());
    clock.set("+1h");
    let (p2, ip2) = pod(2);
    let add_ahead = cni_call(&cni, "ADD", &p2, Some(ip2));
    assert_jumped(&owner, mark, "aether_worker", from, HOUR);
    let pid = owner.worker_pid();
    // Holds the jumped clock past the heartbeat's 5 s deadline: a deadline on the wall
    // clock would have passed at the jump.
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(
        owner.worker_pid(),
        pid,
        "a healthy worker was replaced an hour ahead:\n{}",
        owner.log()
    );
    assert_heartbeat(&node, HOUR);

    // Back two hours, to an hour behind.
    let (mark, from) = (lines(&owner), unix_now());
    clock.set("-1h");
    let (p3, ip3) = pod(3);
    let add_behind = cni_call(&cni, "ADD", &p3, Some(ip3));
    assert_jumped(&owner, mark, "aether_worker", from, -HOUR);
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(
        owner.worker_pid(),
        pid,
        "a healthy worker was replaced an hour behind:\n{}",
        owner.log()
    );
    assert_heartbeat(&node, -HOUR);
    assert_eq!(
        owner.log().matches("missed heartbeats").count(),
        1,
        "only the baseline's hung worker was killed:\n{}",
        owner.log()
    );

    // A hung worker while the clock jumps: back an hour (a wall-clock deadline would not
    // come for an hour), then forward two (it would have come at once).
    clock.set("+0");
    let (mark, from) = (lines(&owner), unix_now());
    let hang_back = hang_worker(&owner, &clock, Some("-1h"));
    assert_jumped(&owner, mark, "aether_supervisor", from, -HOUR);
    let (mark, from) = (lines(&owner), unix_now());
    let hang_forward = hang_worker(&owner, &clock, Some("+1h"));
    assert_jumped(&owner, mark, "aether_supervisor", from, HOUR);
    eprintln!(
        "ADD's ACK wait: {add_base:?} at the real time, {add_ahead:?} an hour ahead, {add_behind:?} an hour behind; \
         hung worker replaced after {hang_base:?} (no jump), {hang_back:?} (jump back 1 h while pending), \
         {hang_forward:?} (jump forward 2 h while pending)"
    );
    for (what, took) in [("ahead", add_ahead), ("behind", add_behind)] {
        assert!(
            took.abs_diff(add_base) < Duration::from_millis(1500),
            "an ADD an hour {what} took {took:?}, against {add_base:?} at the real time"
        );
    }
    for (what, took) in [("back", hang_back), ("forward", hang_forward)] {
        assert!(
            took >= Duration::from_secs(4) && took.abs_diff(hang_base) < Duration::from_secs(3),
            "a hung worker with the clock jumping {what} was replaced after {took:?}, against {hang_base:?} with no jump:\n{}",
            owner.log()
        );
    }
    let log = owner.log();
    assert_eq!(
        log.matches("missed heartbeats").count(),
        3,
        "one kill per hung worker:\n{log}"
    );
    let respawns: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("worker exited unexpectedly"))
        .map(|l| l.split("respawn_in_ms=").nth(1).unwrap_or("?"))
        .collect();
    assert!(
        respawns.len() == 3 && respawns.iter().all(|r| r.starts_with('0')),
        "each respawn after a healthy run is at once: {respawns:?}"
    );

    // The records written across the jumps and respawns are whole; a DEL at +1 h removes
    // its pod's, an ADD adds one.
    assert_eq!(
        record_uids(&node),
        [p1.uid.clone(), p2.uid.clone(), p3.uid.clone()],
        "the records after three ADDs"
    );
    cni_call(&cni, "DEL", &p2, None);
    let (p4, ip4) = pod(4);
    cni_call(&cni, "ADD", &p4, Some(ip4));
    assert_eq!(
        record_uids(&node),
        [p1.uid.clone(), p3.uid.clone(), p4.uid.clone()],
        "the records after a DEL and an ADD an hour ahead"
    );
    assert!(
        quarantined(&node.state_dir).is_empty(),
        "a record was quarantined: {:?}",
        quarantined(&node.state_dir)
    );
    let ready = owner.serving_owner().expect("the owner serves");
    assert_eq!(ready["takeover"]["respawn"], true, "{ready}");
}

/// Row 20 with a surge handoff (row 1's roll): an owner an hour ahead hands the node to a
/// standby an hour behind. Invariants: one owner at a time (the old one exits before the
/// new one serves), the node sockets kept (same inodes, handed off), no lost pod and no
/// phantom pod (the new owner holds exactly the records the old one wrote, and its own
/// ADD and DEL round-trip), and the takeover's own timings stay sane (each generation's
/// two processes share one offset).
#[test]
fn a_surge_handoff_from_an_hour_ahead_to_an_hour_behind_keeps_one_owner_and_the_pods() {
    const NAME: &str =
        "a_surge_handoff_from_an_hour_ahead_to_an_hour_behind_keeps_one_owner_and_the_pods";
    let Some(lib) = skip_without_libfaketime(NAME) else {
        return;
    };
    let mut node = LocalNode::new();
    let from = unix_now();
    let (mut owner, _ahead) = start_jumped(&mut node, &lib, "clock-ahead", "+1h", &[]);
    owner.wait_role("owner", T);
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let pods: Vec<_> = (1..=3).map(pod).collect();
    std::thread::scope(|s| {
        for (p, ip) in &pods {
            let cni = &cni;
            s.spawn(move || cni_call(cni, "ADD", p, Some(*ip)));
        }
    });
    assert_jumped(&owner, 0, "aether_supervisor", from, HOUR);
    assert_jumped(&owner, 0, "aether_worker", from, HOUR);
    let written = record_uids(&node);
    assert_eq!(written.len(), 3, "three ADDs, three records: {written:?}");

    let from = unix_now();
    let (standby, _behind) = start_jumped(&mut node, &lib, "clock-behind", "-1h", &[]);
    standby.wait_role("standby", T);
    assert_jumped(&standby, 0, "aether_supervisor", from, -HOUR);
    assert_jumped(&standby, 0, "aether_worker", from, -HOUR);
    let inodes = node.socket_inodes();
    owner.signal(Signal::SIGTERM);
    let status = owner.wait_exit(T);
    assert!(
        status.success(),
        "the owner an hour ahead exits cleanly after SIGTERM: {status}\n{}",
        owner.log()
    );
    let ready = standby.wait_role("owner", T);
    eprintln!(
        "takeover an hour behind from an hour ahead: {}",
        ready["takeover"]
    );
    assert_eq!(
        ready["takeover"]["handed_off"],
        true,
        "the standby took the handed-off sockets:\n{}",
        standby.log()
    );
    assert_eq!(
        node.socket_inodes(),
        inodes,
        "the handoff replaced a node socket"
    );
    assert_eq!(ready["generation"], 2);
    let total = ready["takeover"]["total_us"].as_u64().expect("total_us");
    assert!(
        total < 10_000_000,
        "lock to serving took {total} µs by the new generation's clock"
    );
    assert_eq!(
        record_uids(&node),
        written,
        "the new owner's records are the old one's"
    );

    // The new owner's own calls round-trip.
    cni_call(&cni, "DEL", &pods[0].0, None);
    let (p4, ip4) = pod(4);
    cni_call(&cni, "ADD", &p4, Some(ip4));
    let mut want: Vec<String> = written[1..].to_vec();
    want.push(p4.uid.clone());
    want.sort();
    assert_eq!(
        record_uids(&node),
        want,
        "the records after a DEL and an ADD an hour behind"
    );
    assert!(
        quarantined(&node.state_dir).is_empty(),
        "a record was quarantined: {:?}",
        quarantined(&node.state_dir)
    );
    assert!(
        standby.serving_owner().is_some(),
        "the new owner serves:\n{}",
        standby.log()
    );
}

/// Row 20, certificate expiry (with row 19's check): SVID expiry is judged on the wall
/// clock, so it moves with a jump, and only the finding does. Invariants: an hour ahead,
/// the agent's one-hour SVID is flagged expired in `/ready` (problem `svid-expiry`,
/// `svids_expiring`) while the owner keeps serving on the same worker; back at the real
/// time and an hour behind, nothing is flagged (the agent does not judge `not_before`;
/// the proxy checks a peer's certificate on its own clock).
#[test]
fn svid_expiry_is_judged_on_the_jumped_wall_clock_and_flagged_an_hour_ahead() {
    const NAME: &str = "svid_expiry_is_judged_on_the_jumped_wall_clock_and_flagged_an_hour_ahead";
    let Some(lib) = skip_without_libfaketime(NAME) else {
        return;
    };
    let (_idp_dir, idp) = identity_provider_for_agents("clock.test");
    let mut node = LocalNode::new();
    let (owner, clock) = start_jumped(
        &mut node,
        &lib,
        "clock-identity",
        "+0",
        &identity_args(&idp, "permissive"),
    );
    let ready = owner.wait_role("owner", Duration::from_secs(20));
    let not_after = ready["identity"]["agent"]["not_after"]
        .as_u64()
        .expect("the agent's SVID in /ready");
    let lifetime = not_after as f64 - unix_now();
    assert!(
        (3500.0..=3600.0).contains(&lifetime),
        "the provider's SVIDs last an hour; this one {lifetime:.0} s more"
    );
    let expiring =
        |v: &serde_json::Value| v["identity"]["svids_expiring"].as_u64().unwrap_or(u64::MAX);
    assert_eq!(
        expiring(&ready),
        0,
        "nothing expiring at the real time: {ready}"
    );
    let pid = owner.worker_pid();

    clock.set("+1h");
    let from = unix_now();
    // The check runs after each change and every 10 s.
    let flagged = wait_for(
        "the SVID flagged expired an hour ahead",
        Duration::from_secs(25),
        || owner.serving_owner().filter(|v| expiring(v) >= 1),
    );
    let problem = flagged["problems"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["source"] == "svid-expiry").cloned())
        .unwrap_or_else(|| panic!("no svid-expiry problem: {flagged}"));
    let message = problem["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("the agent (") && message.contains("expired"),
        "{message}"
    );
    let since = problem["since"].as_f64().expect("since");
    assert!(
        (since - HOUR as f64 - from).abs() < 30.0,
        "the problem's since ({since}) is dated on the jumped clock, about {} ",
        from + HOUR as f64
    );
    assert!(
        owner.log().contains("SVIDs near expiry"),
        "the warning is logged:\n{}",
        owner.log()
    );
    eprintln!("an hour ahead: {message}");

    for spec in ["+0", "-1h"] {
        clock.set(spec);
        let v = wait_for(
            &format!("no SVID flagged at {spec}"),
            Duration::from_secs(25),
            || owner.serving_owner().filter(|v| expiring(v) == 0),
        );
        let problems = v["problems"].as_array().cloned().unwrap_or_default();
        assert!(
            problems.iter().all(|p| p["source"] != "svid-expiry"),
            "at {spec}: {v}"
        );
    }
    assert_eq!(
        owner.worker_pid(),
        pid,
        "the worker was replaced:\n{}",
        owner.log()
    );
}
