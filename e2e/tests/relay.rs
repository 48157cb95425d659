//! `aether-xds-relay` between a real Envoy and the real agent: surge rolls and worker
//! crashes under load never end Envoy's ADS stream, a change made after each reaches
//! Envoy through the new owner, and no request fails; with incremental ADS and with state
//! of the world.

use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::envoy::ack_log::wait_endpoints;
use aether_e2e::envoy::{self, AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::harness::load::Load;
use aether_e2e::testing::wait_for;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;

const T: Duration = Duration::from_secs(10);
const RPS: u32 = 100;
const SERVICE: &str = NodeRig::SERVICE;
/// Envoy's connections to its ADS cluster (the relay's socket): one, for the whole test.
const ADS_CONNECTS: &str = "cluster.xds_cluster.upstream_cx_total";

/// Rewrites the rig's registry file with the upstreams in `on` only.
fn registry_with(rig: &NodeRig, on: &[usize]) -> Vec<String> {
    let endpoints: Vec<_> = on
        .iter()
        .map(|i| {
            let a = rig.upstreams[*i].addr;
            json!({ "address": a.ip().to_string(), "port": a.port(), "pod": format!("{SERVICE}-{i}") })
        })
        .collect();
    let doc = json!({ "services": [{ "name": SERVICE, "namespace": "default", "ports": [80], "endpoints": endpoints }] });
    let path = rig
        .node
        .registry_file
        .as_deref()
        .expect("the rig's registry file");
    write_atomically(path, &doc.to_string());
    let mut want: Vec<String> = on
        .iter()
        .map(|i| format!("{} HEALTHY", rig.upstreams[*i].addr))
        .collect();
    want.sort();
    want
}

fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write registry");
    std::fs::rename(&tmp, path).expect("rename registry");
}

#[test]
fn rolls_and_worker_crashes_behind_the_relay_never_end_envoys_stream() {
    rolls_and_crashes(
        "rolls_and_worker_crashes_behind_the_relay_never_end_envoys_stream",
        AdsApi::Delta,
    );
}

/// The same with a state-of-the-world bootstrap (`api_type: GRPC`).
#[test]
fn rolls_and_worker_crashes_behind_the_relay_never_end_a_sotw_envoys_stream() {
    rolls_and_crashes(
        "rolls_and_worker_crashes_behind_the_relay_never_end_a_sotw_envoys_stream",
        AdsApi::Sotw,
    );
}

fn rolls_and_crashes(test: &str, api: AdsApi) {
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start_relayed(&envoy_bin, api);
    let cluster = format!("outbound|80||{SERVICE}.default");
    let base = rig.stats(&[ADS_CONNECTS, envoy::CONNECTED]);
    assert_eq!(base[ADS_CONNECTS], 1, "Envoy connected to the relay once");
    let relay = rig.relay.as_ref().expect("a relayed rig");
    assert_eq!(
        relay.metric("aether_relay_upstream_streams_total"),
        Some(1.0)
    );
    let t0 = Instant::now();
    let load = Load::start(rig.outbound, vec![SERVICE.to_string()], RPS);
    let rolls = 3u32;
    let crashes = 2u32;
    for i in 1..=rolls + crashes {
        let mut killed = None;
        if i <= rolls {
            surge_roll(&mut rig, &[], i);
        } else {
            let old = rig.owner.worker_pid();
            let killed_at = unix_now();
            kill(Pid::from_raw(old), Signal::SIGKILL).expect("SIGKILL the worker");
            wait_for(&format!("crash {i}: a respawned worker serving"), T, || {
                rig.owner
                    .serving_owner()
                    .filter(|v| v["pid"].as_i64().is_some_and(|p| p != i64::from(old)))
            });
            killed = Some(killed_at);
        }
        relay_on_the_new_owner(&rig, &format!("switch {i}"), i + 1);
        if let Some(killed_at) = killed {
            // The relay saw the killed worker's stream end after the kill (once the
            // kernel had torn down its memory), and says when.
            let ended = rig
                .relay
                .as_ref()
                .and_then(|r| r.metric("aether_relay_last_upstream_end_timestamp_seconds"))
                .expect("the relay's last upstream end");
            assert!(
                (killed_at..=unix_now()).contains(&ended),
                "crash {i}: the relay's stream ended at {ended}, not between the kill ({killed_at}) and now"
            );
        }
        // A change after the switch reaches Envoy through the new owner.
        let on: &[usize] = if i % 2 == 1 { &[0] } else { &[0, 1] };
        let want = registry_with(&rig, on);
        wait_endpoints(&rig.envoy, &cluster, &want).unwrap_or_else(|got| {
            panic!(
                "switch {i}: Envoy shows {got:?}, not {want:?}\n{}",
                rig.where_to_look()
            )
        });
    }
    registry_with(&rig, &[0, 1]);
    let counters = load.stop();
    let requests = counters.requests.load(std::sync::atomic::Ordering::Relaxed);
    let failures = counters.failures.load(std::sync::atomic::Ordering::Relaxed);
    let end = rig.stats(&[ADS_CONNECTS, envoy::CONNECTED]);
    let (_, changes) = rig.poller.since(t0);
    let drops = changes.iter().filter(|s| !s.connected).count();
    let relay = rig.relay.as_ref().expect("a relayed rig");
    let switches = relay.metric("aether_relay_switches_total");
    let resumes = ["digest", "plain"]
        .iter()
        .map(|k| relay.metric(&format!("aether_relay_resumes_total{{kind=\"{k}\"}}")))
        .sum::<Option<f64>>();
    let gap = relay.metric("aether_relay_last_upstream_gap_seconds");
    let self_acked = relay.metric("aether_relay_self_acked_total");
    eprintln!(
        "{api:?}: {rolls} surge rolls and {crashes} worker crashes behind the relay: {requests} requests, {failures} failed; Envoy ADS connects {} -> {}, connected_state drops {drops}; relay switches {switches:?}, resumes {resumes:?}, answers Envoy held ACKed by the relay {self_acked:?}, last gap {gap:?} s",
        base[ADS_CONNECTS], end[ADS_CONNECTS]
    );
    assert_eq!(
        end[ADS_CONNECTS],
        base[ADS_CONNECTS],
        "Envoy reconnected to the relay: its stream ended\n{}",
        rig.where_to_look()
    );
    assert_eq!(drops, 0, "Envoy's control_plane.connected_state went to 0");
    assert_eq!(end[envoy::CONNECTED], 1);
    assert_eq!(failures, 0, "requests failed\n{}", rig.where_to_look());
    assert!(requests > 0);
    assert_eq!(switches, Some(f64::from(rolls + crashes)));
    assert_eq!(resumes, Some(f64::from(rolls + crashes)));
    let kind = |k: &str| relay.metric(&format!("aether_relay_resumes_total{{kind=\"{k}\"}}"));
    let (by_digest, plain) = (kind("digest"), kind("plain"));
    eprintln!("resumes by digest {by_digest:?}, plain {plain:?}");
    let overlaps = relay.metric("aether_relay_overlap_switches_total");
    eprintln!(
        "switches in overlap {overlaps:?}, fresh re-statements {:?}",
        relay.metric("aether_relay_overlap_restarts_total")
    );
    match api {
        // Every owner answers the relay's digest offer, and hands a surge roll over in
        // overlap; a killed worker cannot.
        AdsApi::Delta => {
            assert_eq!(by_digest, Some(f64::from(rolls + crashes)));
            assert_eq!(
                overlaps,
                Some(f64::from(rolls)),
                "each surge roll in overlap"
            );
        }
        // State of the world has no digest and no overlap: each of its resumes is plain.
        AdsApi::Sotw => {
            assert_eq!(plain, Some(f64::from(rolls + crashes)));
            assert_eq!(overlaps, Some(0.0));
        }
    }
    let variant = match api {
        AdsApi::Delta => "delta",
        AdsApi::Sotw => "sotw",
    };
    assert_eq!(
        relay.metric(&format!(
            "aether_relay_envoy_streams_total{{api=\"{variant}\"}}"
        )),
        Some(1.0),
        "Envoy's one stream, of its bootstrap's variant"
    );
    // Each switch: the types Envoy already held were answered by the relay, not resent.
    assert!(
        self_acked.is_some_and(|n| n >= f64::from(rolls + crashes)),
        "{self_acked:?}"
    );
    rig.pass();
}

/// The relay itself killed under load and restarted: Envoy reconnects to it with its own
/// backoff, as it does to the agent without a relay, and gets the registry change made
/// while no relay ran; no request fails (the data path never waits on xDS). The relay
/// confines itself with its seccomp filters, read in its `/proc` status.
#[test]
fn envoy_reconnects_to_a_restarted_relay_and_is_served() {
    let test = "envoy_reconnects_to_a_restarted_relay_and_is_served";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start_relayed(&envoy_bin, AdsApi::Delta);
    let cluster = format!("outbound|80||{SERVICE}.default");
    let dir = rig.relay.as_ref().expect("a relayed rig").dir.clone();
    let pid = rig.relay.as_ref().expect("a relayed rig").pid();
    // The relay confines itself before its first thread: no_new_privs and the worker's four
    // seccomp filters (an allow list), under which it has just served Envoy.
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the relay's status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        (
            field("NoNewPrivs"),
            field("Seccomp"),
            field("Seccomp_filters")
        ),
        ("1".into(), "2".into(), "4".into()),
        "the relay's confinement in /proc/{pid}/status:\n{status}"
    );
    // Killed under load, with a registry change made while no relay runs.
    let load = Load::start(rig.outbound, vec![SERVICE.to_string()], RPS);
    wait_for("requests through Envoy", T, || {
        (load.requests() > 0).then_some(())
    });
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("SIGKILL the relay");
    drop(rig.relay.take());
    // The socket file is left behind by the kill: the new relay replaces it.
    assert!(
        dir.join("xds.sock").exists(),
        "a killed relay leaves its socket file"
    );
    let want = registry_with(&rig, &[1]);
    rig.relay = Some(aether_e2e::envoy::Relay::start(&dir, &rig.node.run_dir));
    // Envoy's connects before the new relay listened were refused and count as connects
    // too, so "reconnected" is the new relay holding Envoy's stream with Envoy connected.
    let relay = rig.relay.as_ref().expect("the new relay");
    wait_for("Envoy to reconnect to the new relay", T, || {
        let s = rig.envoy.stats(&[ADS_CONNECTS, envoy::CONNECTED])?;
        (s[ADS_CONNECTS] >= 2
            && s[envoy::CONNECTED] == 1
            && relay.metric("aether_relay_envoy_streams")? == 1.0)
            .then_some(())
    });
    wait_endpoints(&rig.envoy, &cluster, &want)
        .unwrap_or_else(|got| panic!("Envoy shows {got:?}, not {want:?}\n{}", rig.where_to_look()));
    // And the next change, through the new relay's stream.
    let want = registry_with(&rig, &[0, 1]);
    wait_endpoints(&rig.envoy, &cluster, &want)
        .unwrap_or_else(|got| panic!("Envoy shows {got:?}, not {want:?}\n{}", rig.where_to_look()));
    let counters = load.stop();
    let requests = counters.requests.load(std::sync::atomic::Ordering::Relaxed);
    let failures = counters.failures.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("the relay killed and restarted under load: {requests} requests, {failures} failed");
    assert!(requests > 0);
    assert_eq!(failures, 0, "requests failed\n{}", rig.where_to_look());
    rig.pass();
}

/// One surge roll: a ready standby, the owner's SIGTERM and clean exit, the new owner
/// serving.
fn surge_roll(rig: &mut NodeRig, extra: &[&str], i: u32) {
    let next = rig.node.start_agent_with(extra);
    wait_for(&format!("roll {i}: a ready standby"), T, || {
        next.ready()
            .filter(|(s, v)| *s == 200 && v["role"] == "standby")
            .map(|_| ())
    });
    rig.owner.signal(Signal::SIGTERM);
    let mut old = std::mem::replace(&mut rig.owner, next);
    let status = old.wait_exit_timeout(T).expect("the old owner exits");
    assert!(status.success(), "roll {i}: {status}\n{}", old.log());
    wait_for(&format!("roll {i}: the new owner serving"), T, || {
        rig.owner.serving_owner()
    });
}

/// The relay on its `streams`th agent stream, connected: it has switched to the new owner.
fn relay_on_the_new_owner(rig: &NodeRig, what: &str, streams: u32) {
    let relay = rig.relay.as_ref().expect("a relayed rig");
    wait_for(&format!("{what}: the relay on the new owner"), T, || {
        (relay.metric("aether_relay_upstream_streams_total")? == f64::from(streams)
            && relay.metric("aether_relay_upstream_connected")? == 1.0)
            .then_some(())
    });
}

/// One roll to the owner's metrics: the new owner serving and the relay on it.
fn roll(rig: &mut NodeRig, extra: &[&str], i: u32) {
    surge_roll(rig, extra, i);
    relay_on_the_new_owner(rig, &format!("roll {i}"), i + 1);
}

/// The owner's metric `series` (name and labels, as printed), once it serves metrics.
fn owner_metric(rig: &NodeRig, series: &str) -> Option<f64> {
    let addr = rig
        .node
        .metrics
        .expect("a relayed rig's agents serve metrics");
    let text = aether_e2e::testing::scrape_metrics(&addr.to_string())?;
    aether_e2e::testing::metric_sample(&text, series)
}

/// The digest resume across version skew: a roll to an owner without it (as an older
/// agent, mid-roll) gets the plain resume, every version listed; the roll after, to an
/// owner with it, resumes by digest alone: the new owner takes Envoy to hold its snapshot
/// (its digest matched), sends nothing, and Envoy's config is what it was, then follows a
/// change.
#[test]
fn a_roll_resumes_by_digest_and_one_to_an_owner_without_it_by_versions() {
    let test = "a_roll_resumes_by_digest_and_one_to_an_owner_without_it_by_versions";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start_relayed(&envoy_bin, AdsApi::Delta);
    let cluster = format!("outbound|80||{SERVICE}.default");
    let kind = |rig: &NodeRig, k: &str| {
        let relay = rig.relay.as_ref().expect("a relayed rig");
        relay
            .metric(&format!("aether_relay_resumes_total{{kind=\"{k}\"}}"))
            .unwrap_or(-1.0)
    };
    const CDS_DIGEST: &str = "aether_xds_digest_resumes_total{type_url=\"type.googleapis.com/envoy.config.cluster.v3.Cluster\"}";

    roll(&mut rig, &["--xds-digest-resume=false"], 1);
    assert_eq!((kind(&rig, "digest"), kind(&rig, "plain")), (0.0, 1.0));
    wait_for("the owner's metrics", T, || {
        owner_metric(&rig, "aether_xds_streams")
    });
    assert_eq!(
        owner_metric(&rig, CDS_DIGEST),
        None,
        "an owner without the digest resume takes none"
    );
    let want = registry_with(&rig, &[0]);
    wait_endpoints(&rig.envoy, &cluster, &want)
        .unwrap_or_else(|got| panic!("after the plain resume Envoy shows {got:?}, not {want:?}"));

    let before = dynamic_resources(&rig.config_dump());
    roll(&mut rig, &[], 2);
    assert_eq!((kind(&rig, "digest"), kind(&rig, "plain")), (1.0, 1.0));
    let relay = rig.relay.as_ref().expect("a relayed rig");
    let by_digest = relay.metric("aether_relay_resumed_types_total{kind=\"digest\"}");
    assert!(
        by_digest.is_some_and(|n| n >= 3.0),
        "CDS, EDS and LDS at least, by digest: {by_digest:?}"
    );
    wait_for("the new owner's digest resumes", T, || {
        owner_metric(&rig, CDS_DIGEST).filter(|n| *n == 1.0)
    });
    let sent = owner_metric(
        &rig,
        "aether_xds_initial_resources_total{type_url=\"type.googleapis.com/envoy.config.cluster.v3.Cluster\"}",
    );
    assert_eq!(sent, Some(0.0), "the new owner sent Envoy no cluster");
    assert_eq!(
        dynamic_resources(&rig.config_dump()),
        before,
        "Envoy's config is the new owner's snapshot: what it held, not updated"
    );
    let want = registry_with(&rig, &[0, 1]);
    wait_endpoints(&rig.envoy, &cluster, &want)
        .unwrap_or_else(|got| panic!("after the digest resume Envoy shows {got:?}, not {want:?}"));
    // Neither roll had the overlap on both sides: to the older owner the relay switched
    // the plain way onto the stream it had opened in the overlap; from it, at its end.
    assert_eq!(
        relay.metric("aether_relay_overlap_switches_total"),
        Some(0.0),
        "no switch in overlap across the skew"
    );
    eprintln!(
        "plain resume, then a digest resume: relay types by digest {by_digest:?}; the owner's CDS digest resumes 1, clusters sent 0"
    );
    rig.pass();
}

/// Each dynamic cluster, listener and route configuration in Envoy's config dump, with
/// its version and when it was last updated.
fn dynamic_resources(dump: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(dump).expect("config dump JSON");
    let mut out = Vec::new();
    for c in v["configs"].as_array().expect("configs") {
        let entries = [
            "dynamic_active_clusters",
            "dynamic_listeners",
            "dynamic_route_configs",
        ]
        .iter()
        .filter_map(|k| c[k].as_array())
        .flatten();
        for e in entries {
            let e = if e["active_state"].is_object() {
                &e["active_state"]
            } else {
                e
            };
            out.push(format!(
                "{} {} {}",
                e["version_info"],
                e["last_updated"],
                e.to_string().len()
            ));
        }
    }
    assert!(!out.is_empty(), "no dynamic resources in {dump}");
    out
}

/// The wall clock, in seconds since the Unix epoch (the relay's timestamps are).
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs_f64()
}
