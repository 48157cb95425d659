//! Rolls and crashes of the agent with a real Envoy connected through `xds.sock`: surge
//! rolls under steady load, a killed generation with nothing handed off, and worker
//! crashes with a CNI ADD waiting in the backlog (issue 3 test 5, issue 5 tests 1-3).
//!
//! Every piece is the one the `agent-restart-gap` harness uses: Envoy from the project's
//! bootstrap template with its admin on a pipe, the 2 ms admin stats poller and its roll
//! analysis, loopback upstreams, the open-loop load generator, and the real `aether-cni`.
//! Each test runs on its own local node ([`NodeRig`]) with free capture ports, so they run
//! in parallel.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, Envoy, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::harness::load::{self, Load};
use aether_e2e::testing::{LocalNode, bin, percentile, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

const T: Duration = Duration::from_secs(10);
/// Envoy start, first connect and first routed request.
const T_START: Duration = Duration::from_secs(30);
/// Requests per second through Envoy's outbound listener while the tests roll the agent.
const RPS: u32 = 100;
const SERVICE: &str = NodeRig::SERVICE;

/// Envoy stats that an identical snapshot served on a new stream must leave alone: any
/// move means Envoy replaced or drained a listener (or a cluster) it already had.
const NO_CHURN: [&str; 6] = [
    "listener_manager.listener_modified",
    "listener_manager.listener_removed",
    "listener_manager.total_listeners_draining",
    "listener_manager.listener_in_place_updated",
    "cluster_manager.cluster_modified",
    "cluster_manager.cluster_removed",
];
const WATCHED: [&str; 11] = [
    NO_CHURN[0],
    NO_CHURN[1],
    NO_CHURN[2],
    NO_CHURN[3],
    NO_CHURN[4],
    NO_CHURN[5],
    "listener_manager.total_filter_chains_draining",
    "cluster_manager.cluster_added",
    "listener_manager.listener_added",
    envoy::CONNECTED,
    envoy::CONNECT_FAIL,
];

/// Envoy is connected again and never had a connect to xds.sock refused.
fn assert_connected(rig: &NodeRig, now: &BTreeMap<String, u64>, what: &str) {
    assert_eq!(
        now[envoy::CONNECTED],
        1,
        "{what}: control_plane.connected_state did not return to 1"
    );
    assert_eq!(
        now[envoy::CONNECT_FAIL],
        0,
        "{what}: Envoy's connect to xds.sock failed (refused: a roll left no listener)\n{}",
        rig.where_to_look()
    );
}

/// Each listed stat's change from `before` to `after`, where it moved.
fn moved(
    names: &[&str],
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
) -> Vec<String> {
    names
        .iter()
        .filter(|n| before[**n] != after[**n])
        .map(|n| format!("{n}: {} -> {}", before[*n], after[*n]))
        .collect()
}

/// Stops the load and fails with every recorded failure, each placed in time relative
/// to the last action (roll or kill) that preceded it.
fn assert_no_failed_request(load: Load, actions: &[(String, Instant)], rig: &NodeRig) -> u64 {
    let counters = load.stop();
    let requests = counters.requests.load(std::sync::atomic::Ordering::Relaxed);
    let failures = counters.failures.load(std::sync::atomic::Ordering::Relaxed);
    let late = counters.late.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("load: {requests} requests, {failures} failed, {late} started late");
    if failures > 0 {
        let log = counters.failure_log.lock().unwrap();
        let (now, wall) = (Instant::now(), std::time::SystemTime::now());
        let placed: Vec<String> = log
            .iter()
            .map(|(t, host, what)| {
                let at = utc(wall - (now - *t));
                match actions.iter().rev().find(|(_, a)| a <= t) {
                    Some((name, a)) => format!(
                        "{at} ({:.1} ms after {name}): {host}: {what}",
                        (*t - *a).as_secs_f64() * 1000.0
                    ),
                    None => format!("{at} (before the first action): {host}: {what}"),
                }
            })
            .collect();
        // Where the requests went and what Envoy saw of them, to tell a proxy reset from
        // one on the way to an upstream.
        let hits: Vec<u64> = rig
            .upstreams
            .iter()
            .map(|u| u.hits.load(std::sync::atomic::Ordering::Relaxed))
            .collect();
        let re = r"^(http\.outbound\.downstream_(cx|rq)_|listener\.127|cluster\.outbound.*upstream_(cx|rq)_(destroy|reset|rx_reset|tx_reset|pending|timeout|retry|total|5xx|503)|listener_manager\.)";
        let stats = rig
            .envoy
            .get(&format!("/stats?filter={}", envoy::encode(re)))
            .map(|(_, b)| b)
            .unwrap_or_default();
        panic!(
            "{failures} of {requests} requests through Envoy failed:\n  {}\nupstream hits {hits:?} (sum {}, successful requests {})\nEnvoy stats:\n{}\n{}",
            placed.join("\n  "),
            hits.iter().sum::<u64>(),
            requests - failures,
            stats
                .lines()
                .filter(|l| !l.ends_with(": 0"))
                .collect::<Vec<_>>()
                .join("\n"),
            rig.where_to_look()
        );
    }
    assert!(requests > 0, "the load sent no request");
    requests
}

/// A wall-clock time as the agents' and Envoy's logs print it (UTC, HH:MM:SS.mmm).
fn utc(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:03}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        d.subsec_millis()
    )
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// Issue 3 test 5 and issue 5 test 1.
#[test]
fn twenty_surge_rolls_under_load_fail_no_request_and_keep_sockets_and_listeners() {
    twenty_surge_rolls(
        "twenty_surge_rolls_under_load_fail_no_request_and_keep_sockets_and_listeners",
        AdsApi::Sotw,
    );
}

/// The same over incremental ADS: a reconnect resumes from the versions Envoy holds.
#[test]
fn twenty_surge_rolls_over_delta_ads_fail_no_request_and_keep_sockets_and_listeners() {
    twenty_surge_rolls(
        "twenty_surge_rolls_over_delta_ads_fail_no_request_and_keep_sockets_and_listeners",
        AdsApi::Delta,
    );
}

fn twenty_surge_rolls(test: &str, api: AdsApi) {
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start(&envoy_bin, api);
    let inodes = rig.node.socket_inodes();
    assert!(
        inodes.0.is_some() && inodes.1.is_some(),
        "node sockets missing: {inodes:?}"
    );
    let base = rig.stats(&WATCHED);
    assert_eq!(
        base[envoy::CONNECT_FAIL],
        0,
        "Envoy failed to connect to xds.sock before any roll"
    );
    let load = Load::start(rig.outbound, vec![SERVICE.to_string()], RPS);
    let mut actions = Vec::new();
    let mut gaps = Vec::new();
    let mut served = Vec::new();
    let mut quiet = Instant::now();
    for i in 1..=20 {
        let start = Instant::now();
        let next = rig.start_agent();
        wait_for(
            &format!("roll {i}: {} to be a ready standby", next.name),
            T,
            || {
                next.ready()
                    .filter(|(s, v)| *s == 200 && v["role"] == "standby")
                    .map(|_| ())
            },
        );
        let action = Instant::now();
        actions.push((format!("roll {i} SIGTERM"), action));
        rig.owner.signal(Signal::SIGTERM);
        let mut old = std::mem::replace(&mut rig.owner, next);
        let status = old
            .wait_exit_timeout(T)
            .unwrap_or_else(|e| panic!("roll {i}: {e:#}"));
        assert!(
            status.success(),
            "roll {i}: {} exited with {status} after SIGTERM; log:\n{}",
            old.name,
            old.log()
        );
        let ready = wait_for(
            &format!("roll {i}: {} to serve as owner", rig.owner.name),
            T,
            || rig.owner.serving_owner(),
        );
        let took = action.elapsed();
        assert_eq!(
            ready["takeover"]["handed_off"],
            true,
            "roll {i}: the takeover did not use the handed-off sockets:\n{}",
            rig.owner.log()
        );
        let times = rig.wait_reconnected(quiet, &format!("roll {i}"));
        assert_eq!(
            rig.node.socket_inodes(),
            inodes,
            "roll {i} replaced a node socket"
        );
        let now = rig.stats(&WATCHED);
        assert_connected(&rig, &now, &format!("roll {i}"));
        let churn = moved(&NO_CHURN, &base, &now);
        assert!(
            churn.is_empty(),
            "roll {i}: the identical snapshot made Envoy change listeners or clusters: {churn:?}\n{}",
            rig.where_to_look()
        );
        eprintln!(
            "roll {i}: standby ready {} ms after start, new owner on /ready {} ms after SIGTERM, {}",
            ms(action - start),
            ms(took),
            times.summary()
        );
        gaps.push(times.gap().as_secs_f64());
        served.push(times.served_gap().as_secs_f64());
        drop(old);
        quiet = Instant::now();
    }
    // A last stretch of load on the final owner's config.
    let tail = Instant::now();
    wait_for("a few more requests after the last roll", T, || {
        (load.requests() >= 20 && tail.elapsed() >= Duration::from_millis(200)).then_some(())
    });
    let requests = assert_no_failed_request(load, &actions, &rig);
    let end = rig.stats(&WATCHED);
    assert_eq!(end[envoy::CONNECT_FAIL], 0);
    assert!(
        moved(&NO_CHURN, &base, &end).is_empty(),
        "{:?}",
        moved(&NO_CHURN, &base, &end)
    );
    let hits: Vec<u64> = rig
        .upstreams
        .iter()
        .map(|u| u.hits.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    assert!(
        hits.iter().all(|h| *h > 0),
        "both upstreams must serve the load: hits {hits:?}"
    );
    eprintln!(
        "20 surge rolls: {requests} requests, 0 failed, upstream hits {hits:?}; gap median {:.1} ms p99 {:.1} ms; served gap median {:.1} ms p99 {:.1} ms; refused connects 0",
        percentile(&gaps, 50.0).unwrap() * 1e3,
        percentile(&gaps, 99.0).unwrap() * 1e3,
        percentile(&served, 50.0).unwrap() * 1e3,
        percentile(&served, 99.0).unwrap() * 1e3
    );
    rig.pass();
}

/// Issue 5 test 2.
#[test]
fn killing_the_owner_generation_without_a_handoff_binds_fresh_sockets_and_envoy_reconnects() {
    let Some(envoy_bin) = envoy_or_skip(
        "killing_the_owner_generation_without_a_handoff_binds_fresh_sockets_and_envoy_reconnects",
    ) else {
        return;
    };
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    // The owner predates the handoff (as in continuity.rs): nothing to fetch sockets from.
    std::fs::remove_file(rig.node.run_dir.join("handoff.sock")).expect("remove handoff.sock");
    let base = rig.stats(&WATCHED);
    let load = Load::start(rig.outbound, vec![SERVICE.to_string()], RPS);
    let quiet = Instant::now();
    let next = rig.start_agent();
    next.wait_role("standby", T);
    assert!(
        !next.log().contains("holding the owner's node sockets"),
        "the standby got sockets from nowhere:\n{}",
        next.log()
    );
    let start = Instant::now();
    let actions = vec![("SIGKILL of the owner generation".to_string(), start)];
    rig.owner.kill_generation();
    let _killed = std::mem::replace(&mut rig.owner, next);
    let ready = rig.owner.wait_role("owner", T);
    let took = start.elapsed();
    assert_eq!(
        ready["takeover"]["handed_off"],
        false,
        "nothing was handed off, so the takeover must bind fresh sockets:\n{}",
        rig.owner.log()
    );
    rig.owner.wait_log("this agent owns the node", T);
    assert!(
        rig.owner.log().contains("handed_off=false"),
        "the new owner's log must say it bound fresh sockets:\n{}",
        rig.owner.log()
    );
    let times = rig.wait_reconnected(quiet, "after the kill");
    let now = rig.stats(&WATCHED);
    assert_eq!(
        now[envoy::CONNECTED],
        1,
        "control_plane.connected_state did not return to 1"
    );
    // Envoy kept routing on its last config while it had no control plane, and the new
    // owner's snapshot is the same one: nothing replaced, nothing drained.
    let churn = moved(&NO_CHURN, &base, &now);
    assert!(
        churn.is_empty(),
        "the identical snapshot made Envoy change listeners or clusters: {churn:?}\n{}",
        rig.where_to_look()
    );
    let after = Instant::now();
    wait_for("requests through Envoy after the reconnect", T, || {
        (load.requests() >= 20 && after.elapsed() >= Duration::from_millis(300)).then_some(())
    });
    load::request(rig.outbound, SERVICE).expect("a request after the reconnect");
    let requests = assert_no_failed_request(load, &actions, &rig);
    eprintln!(
        "killed generation, fallback bind: new owner on /ready {} ms after SIGKILL, {}, Envoy connect failures {} (refusals are expected on this path), {requests} requests, 0 failed",
        ms(took),
        times.summary(),
        now[envoy::CONNECT_FAIL] - base[envoy::CONNECT_FAIL]
    );
    rig.pass();
}

/// Whether `pid` has exited (gone or a zombie its parent has not reaped yet).
fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// Connections queued on the listener at `path` and not accepted yet: in
/// `/proc/net/unix` such a connection is listed under the listener's path with inode 0
/// (nothing has accepted it into a socket file yet).
fn queued_connects(path: &Path) -> usize {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/net/unix")
        .expect("/proc/net/unix")
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() == 8 && f[7] == want && f[6] == "0"
        })
        .count()
}

/// Issue 5 test 3.
#[test]
fn killing_the_worker_ten_times_keeps_sockets_and_config_and_a_waiting_cni_add_completes() {
    let Some(envoy_bin) = envoy_or_skip(
        "killing_the_worker_ten_times_keeps_sockets_and_config_and_a_waiting_cni_add_completes",
    ) else {
        return;
    };
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    let cni = std::sync::Arc::new(Cni {
        bin: bin("aether-cni"),
        socket: rig.node.cni_sock(),
    });
    let pod = |n: u8| {
        (
            PodId {
                uid: format!("crash-pod-{n:02}-uid"),
                name: format!("crash-{n}"),
            },
            Ipv4Addr::new(10, 88, 7, n),
        )
    };
    // One pod before the crashes, so that the inbound listener exists and an ADD during a
    // crash only adds a filter chain to it.
    let (p0, ip0) = pod(0);
    cni.call("ADD", &p0, Some(ip0))
        .expect("ADD before the first crash");
    wait_for("the first pod in Envoy's config", T, || {
        rig.config_dump()
            .contains(&format!("\"inbound|{}\"", p0.uid))
            .then_some(())
    });
    let inodes = rig.node.socket_inodes();
    let load = Load::start(rig.outbound, vec![SERVICE.to_string()], RPS);
    let mut actions = Vec::new();
    let mut gaps = Vec::new();
    let mut add_latency = Vec::new();
    let mut live = vec![p0.uid.clone()];
    let mut quiet = Instant::now();
    for i in 1..=10u8 {
        // Odd kills carry a CNI ADD queued while the worker is down; even kills change
        // nothing, so Envoy must converge on exactly the config it had.
        let with_add = i % 2 == 1;
        let before = rig.stats(&WATCHED);
        let dump_before = rig.config_dump();
        let old = rig.owner.worker_pid();
        let start = Instant::now();
        actions.push((format!("kill {i} of worker {old}"), start));
        // For the ADD, the supervisor is paused across the kill so that no new worker can
        // exist until the plugin's connect is queued in cni.sock's backlog: the ADD then
        // certainly reaches the agent while its worker is down, with no timing luck. The
        // pause is a few milliseconds; the supervisor finds its worker dead on SIGCONT.
        let supervisor = Pid::from_raw(rig.owner.pid());
        if with_add {
            kill(supervisor, Signal::SIGSTOP).expect("SIGSTOP the supervisor");
        }
        kill(Pid::from_raw(old), Signal::SIGKILL).expect("SIGKILL the worker");
        wait_for(&format!("kill {i}: worker {old} to die"), T, || {
            is_dead(old).then_some(())
        });
        let add = with_add.then(|| {
            assert_eq!(
                queued_connects(&rig.node.cni_sock()),
                0,
                "kill {i}: connects already waiting on cni.sock"
            );
            let (p, ip) = pod(i);
            let cni = cni.clone();
            let t0 = Instant::now();
            let thread = std::thread::spawn(move || {
                let r = cni.call("ADD", &p, Some(ip));
                (p, r, t0.elapsed())
            });
            // Queued, not refused: the plugin would retry a refusal silently, so its
            // success alone would not show that the socket stayed open.
            wait_for(
                &format!("kill {i}: the ADD's connect queued in cni.sock's backlog"),
                T,
                || (queued_connects(&rig.node.cni_sock()) >= 1).then_some(()),
            );
            kill(supervisor, Signal::SIGCONT).expect("SIGCONT the supervisor");
            (thread, t0)
        });
        let ready = wait_for(&format!("kill {i}: a respawned worker serving"), T, || {
            rig.owner
                .serving_owner()
                .filter(|v| v["pid"].as_i64().is_some_and(|p| p != old as i64))
        });
        let respawned = start.elapsed();
        assert_eq!(
            ready["takeover"]["respawn"], true,
            "kill {i}: /ready {ready}"
        );
        let times = rig.wait_reconnected(quiet, &format!("kill {i}"));
        assert_eq!(
            rig.node.socket_inodes(),
            inodes,
            "kill {i}: the respawn replaced a node socket"
        );
        let mut note = String::new();
        if let Some((thread, t0)) = add {
            let (p, r, took) = thread.join().expect("ADD thread");
            r.unwrap_or_else(|e| {
                panic!(
                    "kill {i}: the ADD sent while the worker was down failed: {e}\n{}",
                    rig.where_to_look()
                )
            });
            assert!(
                rig.node
                    .state_dir
                    .join("pods")
                    .join(format!("{}.json", p.uid))
                    .is_file(),
                "kill {i}: pod {} not in storage",
                p.uid
            );
            assert!(
                rig.config_dump()
                    .contains(&format!("\"inbound|{}\"", p.uid)),
                "kill {i}: pod {} ADDed but not in Envoy's config",
                p.uid
            );
            note = format!(
                ", ADD started {} ms after the kill answered after {} ms",
                ms(t0 - start),
                ms(took)
            );
            add_latency.push(took.as_secs_f64());
            live.push(p.uid);
        }
        let now = rig.stats(&WATCHED);
        assert_connected(&rig, &now, &format!("kill {i}"));
        assert_eq!(
            now["listener_manager.total_listeners_draining"],
            0,
            "kill {i}: a listener is draining\n{}",
            rig.where_to_look()
        );
        // An ADD adds one cluster and one listener change (a pod listener added, or a
        // filter chain added in place to the inbound listener, depending on the snapshot
        // model); nothing is removed, replaced or drained. Anything more is a respawn that
        // changed config.
        let want_add = u64::from(with_add);
        let delta = |stat: &str| now[stat] - before[stat];
        let listener_changes =
            delta("listener_manager.listener_added") + delta("listener_manager.listener_modified");
        for (what, got, want) in [
            (
                "listener_added + listener_modified",
                listener_changes,
                want_add,
            ),
            (
                "listener_in_place_updated beyond listener_modified",
                delta("listener_manager.listener_in_place_updated")
                    .saturating_sub(delta("listener_manager.listener_modified")),
                0,
            ),
            (
                "listener_removed",
                delta("listener_manager.listener_removed"),
                0,
            ),
            (
                "total_listeners_draining",
                now["listener_manager.total_listeners_draining"],
                0,
            ),
            (
                "total_filter_chains_draining",
                now["listener_manager.total_filter_chains_draining"],
                0,
            ),
            (
                "cluster_added",
                delta("cluster_manager.cluster_added"),
                want_add,
            ),
            (
                "cluster_modified",
                delta("cluster_manager.cluster_modified"),
                0,
            ),
            (
                "cluster_removed",
                delta("cluster_manager.cluster_removed"),
                0,
            ),
        ] {
            assert_eq!(
                got,
                want,
                "kill {i}{}: {what} is {got}, expected {want}; watched stats that moved: {:?}\n{}",
                if with_add { " (with an ADD)" } else { "" },
                moved(&WATCHED, &before, &now),
                rig.where_to_look()
            );
        }
        if !with_add {
            assert_eq!(
                config_versions(&rig.config_dump()),
                config_versions(&dump_before),
                "kill {i}: Envoy did not converge on the same config versions"
            );
        }
        for uid in &live {
            assert!(
                rig.node
                    .state_dir
                    .join("pods")
                    .join(format!("{uid}.json"))
                    .is_file(),
                "kill {i}: pod {uid} left storage"
            );
        }
        eprintln!(
            "kill {i}: respawned worker on /ready {} ms after the kill, {}{note}",
            ms(respawned),
            times.summary()
        );
        gaps.push(times.gap().as_secs_f64());
        quiet = Instant::now();
    }
    let requests = assert_no_failed_request(load, &actions, &rig);
    assert!(
        rig.owner
            .log()
            .matches("worker exited unexpectedly; respawning")
            .count()
            >= 10,
        "{}",
        rig.owner.log()
    );
    eprintln!(
        "10 worker kills: gap median {:.1} ms p99 {:.1} ms; ADD while down answered median {:.1} ms max {:.1} ms; {requests} requests, 0 failed; refused connects 0",
        percentile(&gaps, 50.0).unwrap() * 1e3,
        percentile(&gaps, 99.0).unwrap() * 1e3,
        percentile(&add_latency, 50.0).unwrap() * 1e3,
        percentile(&add_latency, 100.0).unwrap() * 1e3
    );
    rig.pass();
}

/// The `version_info` of every dynamic resource in a config dump, by resource name: the
/// agent's versions are content hashes, so equal versions mean the same config.
fn config_versions(dump: &str) -> BTreeMap<String, String> {
    let doc: Value = serde_json::from_str(dump).expect("config_dump is JSON");
    let mut out = BTreeMap::new();
    for config in doc["configs"].as_array().into_iter().flatten() {
        for key in [
            "dynamic_listeners",
            "dynamic_active_clusters",
            "dynamic_route_configs",
        ] {
            for r in config[key].as_array().into_iter().flatten() {
                let res = if key == "dynamic_listeners" {
                    &r["active_state"]
                } else {
                    r
                };
                let name = res["listener"]["name"]
                    .as_str()
                    .or(res["cluster"]["name"].as_str())
                    .or(res["route_config"]["name"].as_str())
                    .unwrap_or("?");
                out.insert(
                    format!("{key}/{name}"),
                    res["version_info"].as_str().unwrap_or("").to_string(),
                );
            }
        }
    }
    assert!(
        !out.is_empty(),
        "no dynamic resources in Envoy's config_dump"
    );
    out
}

/// Make before break: a surge roll hands the node over before the old owner ends Envoy's
/// stream. Drained, the old worker gives up the lock and keeps the stream until its
/// successor answers on `xds.sock`. The successor's worker is frozen (SIGSTOP) to hold
/// that moment open: the lock has passed, yet Envoy stays connected to the old owner.
/// Roll 1 thaws it within the wait: the stream moves to it at once. Roll 2 leaves it
/// frozen past the wait: the old owner exits anyway, and Envoy's reconnect waits in the
/// backlog until the thawed worker serves. Neither roll refuses a connect.
#[test]
fn the_old_owner_keeps_envoys_stream_until_its_successor_serves() {
    if envoy_or_skip("the_old_owner_keeps_envoys_stream_until_its_successor_serves").is_none() {
        return;
    }
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let envoy = Envoy::start_on(&node, None).expect("Envoy");
    envoy.wait_connected(T_START);
    let stat = |name: &str| envoy.stat(name).unwrap_or(0);
    let (ended, served) = (
        "cluster_manager.cds.update_failure",
        "cluster_manager.cds.update_success",
    );

    for (roll, thaw_in_time) in [(1, true), (2, false)] {
        let next = node.start_agent();
        next.wait_role("standby", T);
        next.wait_log("holding the owner's node sockets", T);
        let worker = Pid::from_raw(next.worker_pid());
        let (ended0, served0) = (stat(ended), stat(served));

        kill(worker, Signal::SIGSTOP).expect("SIGSTOP the successor's worker");
        let sigterm_at = Instant::now();
        owner.signal(Signal::SIGTERM);
        next.wait_log("node lock acquired", T);
        owner.wait_log("node lock released", T);
        // The node has passed; the proxy's stream has not.
        for _ in 0..2 {
            assert_eq!(
                stat(envoy::CONNECTED),
                1,
                "roll {roll}: Envoy lost its stream before the successor served"
            );
            assert_eq!(
                stat(ended),
                ended0,
                "roll {roll}: Envoy's stream ended before the successor served"
            );
            assert!(
                !is_dead(owner.pid()),
                "roll {roll}: the old owner exited before the successor served:\n{}",
                owner.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        if thaw_in_time {
            kill(worker, Signal::SIGCONT).expect("SIGCONT");
            owner.wait_exit(T);
            assert!(
                owner.log().contains("the successor serves on xds.sock"),
                "{}",
                owner.log()
            );
        } else {
            owner.wait_exit(T);
            // Its wait (2 s) starts after the SIGTERM.
            assert!(
                sigterm_at.elapsed() >= Duration::from_millis(1500),
                "roll {roll}: the old owner gave up after only {:?}",
                sigterm_at.elapsed()
            );
            assert!(
                owner.log().contains("the successor did not answer"),
                "{}",
                owner.log()
            );
            wait_for("Envoy's stream to end with the old owner", T, || {
                (stat(ended) > ended0).then_some(())
            });
            kill(worker, Signal::SIGCONT).expect("SIGCONT");
        }
        wait_for(
            &format!("roll {roll}: Envoy served by the successor"),
            T,
            || (stat(envoy::CONNECTED) == 1 && stat(served) > served0).then_some(()),
        );
        assert_eq!(
            stat(ended),
            ended0 + 1,
            "roll {roll}: one stream end, no failed reconnect"
        );
        assert_eq!(
            stat(envoy::CONNECT_FAIL),
            0,
            "roll {roll}: a connect to xds.sock was refused"
        );
        owner = next;
    }
}

/// On-demand clusters across rolls: the observed upstreams (the services the node's pods
/// called, which Envoy fetched on demand) survive 20 surge rolls unchanged, every new
/// owner serves Envoy's reconnect from them, and no standby, nor any owner after the
/// first write, writes the file: its inode and mtime stay, and inotify on the state
/// folder sees no write, create or rename of it.
#[test]
fn twenty_surge_rolls_keep_the_observed_upstreams_and_no_standby_writes_them() {
    use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify};
    use std::os::unix::fs::MetadataExt;
    let test = "twenty_surge_rolls_keep_the_observed_upstreams_and_no_standby_writes_them";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    // Starting the rig sends a request through Envoy: its first call to the service.
    let mut rig = NodeRig::start_with(&envoy_bin, AdsApi::Delta, &["--on-demand-clusters"]);
    let file = rig.node.state_dir.join("observed-upstreams.json");
    let cluster = format!("outbound|80||{SERVICE}.default");
    let content = wait_for("the owner to write the observed upstreams", T, || {
        let text = std::fs::read_to_string(&file).ok()?;
        let doc: Value = serde_json::from_str(&text).ok()?;
        (doc["clusters"] == serde_json::json!([cluster])).then_some(text)
    });
    let meta = std::fs::metadata(&file).unwrap();
    let (inode, mtime) = (meta.ino(), (meta.mtime(), meta.mtime_nsec()));
    let watch = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).unwrap();
    watch
        .add_watch(
            &rig.node.state_dir,
            F::IN_CLOSE_WRITE | F::IN_MOVED_TO | F::IN_CREATE | F::IN_DELETE | F::IN_MODIFY,
        )
        .unwrap();
    let look = rig.where_to_look();
    let writes = |when: &str| {
        let events = match watch.read_events() {
            Ok(e) => e,
            Err(nix::errno::Errno::EAGAIN) => Vec::new(),
            Err(e) => panic!("inotify: {e}"),
        };
        let touched: Vec<String> = events
            .iter()
            .filter_map(|e| e.name.as_ref().map(|n| n.to_string_lossy().into_owned()))
            .filter(|n| n.contains("observed-upstreams"))
            .collect();
        assert!(
            touched.is_empty(),
            "{when}: the observed upstreams were written: {touched:?}\n{look}"
        );
    };
    for i in 1..=20 {
        let next = rig.start_agent();
        wait_for(
            &format!("roll {i}: {} to be a ready standby", next.name),
            T,
            || {
                next.ready()
                    .filter(|(s, v)| *s == 200 && v["role"] == "standby")
                    .map(|_| ())
            },
        );
        writes(&format!("roll {i}, while {} was a standby", next.name));
        rig.owner.signal(Signal::SIGTERM);
        let mut old = std::mem::replace(&mut rig.owner, next);
        let status = old
            .wait_exit_timeout(T)
            .unwrap_or_else(|e| panic!("roll {i}: {e:#}"));
        assert!(
            status.success(),
            "roll {i}: {} exited with {status}; log:\n{}",
            old.name,
            old.log()
        );
        wait_for(
            &format!("roll {i}: {} to serve as owner", rig.owner.name),
            T,
            || rig.owner.serving_owner(),
        );
        wait_for(
            &format!("roll {i}: a request through Envoy to {SERVICE}"),
            T,
            || load::request(rig.outbound, SERVICE).ok(),
        );
        writes(&format!("roll {i}, after the takeover"));
        assert!(
            rig.owner.log().contains("observed upstreams restored"),
            "roll {i}: the new owner restored the set"
        );
    }
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(
        (meta.ino(), (meta.mtime(), meta.mtime_nsec())),
        (inode, mtime),
        "the file was rewritten"
    );
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        content,
        "the observed set changed"
    );
    let dump = rig.config_dump();
    assert!(dump.contains(&cluster), "Envoy still holds {cluster}");
    rig.pass();
}
