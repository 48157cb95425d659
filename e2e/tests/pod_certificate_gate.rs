//! The lenient client-certificate gate (`--pod-certificate-gate`) and the QUIC twins
//! with real agent processes (supervisor and worker), a real Envoy, real `aether-cni`
//! ADDs and the test identity provider holding one stored pod's SVID back:
//!
//! - a standby beside the owner shows `pod-certificates` in `waiting_for`, then reports
//!   Ready within the gate's bound + 50 ms of loading its records, with a
//!   `pod-certificates` problem naming the held pod;
//! - a lone agent started on the same records serves within the bound + 50 ms, the held
//!   pod keeps its TCP inbound listener (permissive: plaintext) and has no twin;
//! - released, the held pod's SVID brings its twin into Envoy within 1 s.
//!
//! The bound is checked on the agent's own clock (`/ready`'s `pod_certificate_gate`:
//! `ready_after_ms` from the moment the records were loaded); every wait polls with a
//! deadline.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{bin, identity_args, identity_provider_for_agents, wait_for};
use serde_json::Value;

const TD: &str = "example.org";
const T: Duration = Duration::from_secs(10);
const GATE: Duration = Duration::from_secs(1);
const SLACK: Duration = Duration::from_millis(50);

fn pod(n: u32) -> (PodId, Ipv4Addr) {
    (
        PodId {
            uid: format!("gatepod-{n:03}-uid"),
            name: format!("gatepod-{n}"),
        },
        Ipv4Addr::new(10, 88, 4, n as u8),
    )
}

fn add(rig: &NodeRig, pod: &(PodId, Ipv4Addr)) {
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: rig.node.cni_sock(),
    };
    cni.call("ADD", &pod.0, Some(pod.1))
        .unwrap_or_else(|e| panic!("CNI ADD of {}: {e}\n{}", pod.0.uid, rig.where_to_look()));
}

fn waiting_for(ready: &Value) -> Vec<String> {
    ready["waiting_for"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w.as_str().map(String::from))
        .collect()
}

fn problem<'a>(ready: &'a Value, source: &str) -> Option<&'a str> {
    ready["problems"]
        .as_array()?
        .iter()
        .find(|p| p["source"] == source)
        .and_then(|p| p["message"].as_str())
}

/// Envoy's dynamic listeners: (the twins' chain names, the other listeners' names).
fn listeners(rig: &NodeRig) -> (Vec<String>, Vec<String>) {
    aether_e2e::quic::listeners(
        &serde_json::from_str(&rig.config_dump()).expect("config dump JSON"),
    )
}

/// Checks the gate's outcome in `/ready`: timed out, Ready within the bound + 50 ms, the
/// held pod named.
fn assert_gate_kept(who: &str, v: &Value, held: &str) {
    let g = &v["pod_certificate_gate"];
    assert_eq!(g["state"], "timed-out", "{who}: {v:#}");
    assert_eq!(g["bound_ms"], GATE.as_millis() as u64, "{who}: {v:#}");
    let after = g["ready_after_ms"].as_u64().expect("ready_after_ms");
    eprintln!(
        "{who}: gate waited {} ms, Ready {after} ms after the records were loaded (bound {} ms + 50)",
        g["waited_ms"],
        GATE.as_millis()
    );
    assert!(
        after <= (GATE + SLACK).as_millis() as u64,
        "{who}: Ready {after} ms after loading its records; the gate is {GATE:?}: {v:#}"
    );
    assert!(
        after >= GATE.as_millis() as u64,
        "{who}: Ready before the gate's bound with a pod's SVID held: {v:#}"
    );
    let p = problem(v, "pod-certificates").unwrap_or_else(|| panic!("{who}: no problem: {v:#}"));
    assert!(
        p.contains(held),
        "{who}: the problem does not name {held}: {p}"
    );
}

#[test]
fn the_certificate_gate_is_kept_to_its_bound_and_a_released_svid_brings_its_twin() {
    let (_dir, idp) = identity_provider_for_agents(TD);
    let Some(envoy) = envoy_or_skip("the client-certificate gate") else {
        return;
    };
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("a free UDP port")
        .port();
    let mut args = identity_args(&idp, "permissive");
    args.push(format!("--quic-twin-addr=127.0.0.1:{port}"));
    args.push(format!("--pod-certificate-gate={}ms", GATE.as_millis()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rig = NodeRig::start_with(&envoy, AdsApi::Delta, &args);
    let (with, held) = (pod(1), pod(2));
    idp.hold_pod(&held.0.uid);
    add(&rig, &with);
    add(&rig, &held);
    idp.wait_for_streams(&held.0.uid, 1);
    wait_for("the twin of the pod with its SVID alone", T, || {
        (listeners(&rig).0 == [with.0.uid.clone()]).then_some(())
    });

    // A standby: it waits for the held pod's SVID, then is Ready at the bound.
    let standby = rig.start_agent();
    wait_for("the standby to wait for pod-certificates", T, || {
        standby
            .ready()
            .filter(|(_, v)| waiting_for(v).contains(&"pod-certificates".to_string()))
            .map(|_| ())
    });
    let v = standby.wait_role("standby", T);
    assert_eq!(v["phase"], "standby-complete", "{v:#}");
    assert_gate_kept("standby", &v, &held.0.name);

    // A lone agent on the same records: both generations gone, then a fresh start.
    let mut standby = standby;
    standby.kill_generation();
    rig.owner.kill_generation();
    rig.owner = rig.start_agent();
    let v = rig.owner.wait_role("owner", T);
    assert_eq!(v["phase"], "serving", "{v:#}");
    assert_gate_kept("lone agent", &v, &held.0.name);
    // The held pod keeps its TCP inbound and has no twin.
    let held_listener = format!("inbound|{}", held.0.uid);
    wait_for("the new owner's listeners in Envoy", T, || {
        let (twins, others) = listeners(&rig);
        (twins == [with.0.uid.clone()] && others.contains(&held_listener)).then_some(())
    });

    // Released: its twin within 1 s.
    let released = Instant::now();
    idp.release_pod(&held.0.uid);
    let mut want = vec![with.0.uid.clone(), held.0.uid.clone()];
    want.sort();
    wait_for("the released pod's twin", T, || {
        let mut twins = listeners(&rig).0;
        twins.sort();
        (twins == want).then_some(())
    });
    let took = released.elapsed();
    eprintln!(
        "SVID released -> twin in Envoy's config dump: {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    assert!(
        took < Duration::from_secs(1),
        "the twin came {took:?} after the SVID"
    );
    let v = rig.owner.serving_owner().expect("the owner serves");
    wait_for("the pod-certificates problem to clear", T, || {
        rig.owner
            .serving_owner()
            .filter(|v| problem(v, "pod-certificates").is_none())
            .map(|_| ())
    });
    drop(v);
    rig.pass();
}
