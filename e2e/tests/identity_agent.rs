//! Workload identity with real agent processes (supervisor and worker) and the test
//! identity provider (`aether_e2e::identity`, the SPIFFE Workload API and SPIRE's
//! Delegated Identity API on unix sockets):
//!
//! - the provider down at start: a lone agent serves once its bounded wait for its own SVID
//!   (5 s) is over and says so in `/ready`; a standby beside it stays not Ready, waiting
//!   for `agent-svid`, for as long as the provider is down, past that bound; once the
//!   provider is back the standby completes and the owner holds the provider's SVID;
//! - one pod's SVID held back for good (pods added through the real `aether-cni`, a real
//!   Envoy on the node): the held pod keeps its plaintext path in permissive mode (its
//!   inbound listener in Envoy's config dump has one chain and no TLS), standbys still
//!   complete, and takeovers are not slowed by it (it lacked its SVID before the
//!   reconcile, so the takeover's SVID wait is not for it), compared with takeovers
//!   without a held pod;
//! - pods ADDed to the old owner during the overlap: the takeover waits for the SVID of
//!   such a pod, and gets it; one whose SVID is held makes that takeover wait its bound
//!   (1 s) and say so (`svid_wait_missed`).
//!
//! Every wait polls with a deadline; the takeover's own figures are read from the new
//! owner's `/ready` (`takeover`).

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, Envoy, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::identity::IdentityProvider;
use aether_e2e::testing::{
    Agent, LocalNode, bin, identity_args, identity_provider_for_agents, open_identity_sockets,
    percentile, try_wait_for, wait_for,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const TD: &str = "example.org";
/// How long anything that must happen may take.
const T: Duration = Duration::from_secs(10);
/// A lone owner's wait for its own SVID (the worker's `IDENTITY_GATE`).
const IDENTITY_GATE: Duration = Duration::from_secs(5);
/// The takeover's wait for the SVIDs of the pods its reconcile added (the worker's
/// `SVID_WAIT`).
const SVID_WAIT: Duration = Duration::from_secs(1);
/// Surge takeovers per series in the held-pod test.
const ROLLS: usize = 5;
/// What "not taxed by the held pod" means for one takeover's SVID wait: far under its
/// 1 s bound (it measures microseconds when nothing is waited for).
const UNTAXED: Duration = Duration::from_millis(200);

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn problem<'a>(ready: &'a Value, source: &str) -> Option<&'a str> {
    ready["problems"]
        .as_array()?
        .iter()
        .find(|p| p["source"] == source)
        .and_then(|p| p["message"].as_str())
}

fn waiting_for(ready: &Value) -> Vec<String> {
    ready["waiting_for"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| w.as_str().map(String::from))
        .collect()
}

// ---- 1. the provider down at start ----------------------------------------------------

#[test]
fn with_the_provider_down_a_lone_agent_serves_after_its_bound_a_standby_waits_and_both_recover() {
    let (_dir, idp) = identity_provider_for_agents(TD);
    idp.set_down(true);
    let mut node = LocalNode::new();
    let args = identity_args(&idp, "permissive");

    // A lone agent: not serving before its bounded wait is over, serving after it.
    let started = Instant::now();
    let owner = node.start_agent_with(&strs(&args));
    let v = wait_for(
        "the lone agent to serve without its SVID",
        IDENTITY_GATE + T,
        || owner.serving_owner(),
    );
    let took = started.elapsed();
    eprintln!("lone agent serving {took:?} after its start, with the provider down");
    assert!(
        took >= IDENTITY_GATE,
        "served {took:?} after its start, before its {IDENTITY_GATE:?} wait for its SVID was over:\n{v:#}"
    );
    // ... and says so: the gate it served without, the identity status, the problem, the log.
    assert_eq!(waiting_for(&v), ["agent-svid"], "{v:#}");
    let identity = &v["identity"];
    assert!(
        identity["agent"].is_null() && identity["bundle"] == false,
        "no SVID or bundle yet: {identity:#}"
    );
    assert_ne!(identity["workload_api"], "connected", "{identity:#}");
    let message = problem(&v, "workload-api")
        .unwrap_or_else(|| panic!("no workload-api problem in /ready: {v:#}"));
    assert!(
        message.contains("no SVID yet")
            && message.contains(&idp.workload_socket().display().to_string()),
        "{message}"
    );
    let log = owner.log();
    assert!(
        log.lines()
            .any(|l| l.contains("first-serve gate timed out") && l.contains("gate=Identity")),
        "{log}"
    );

    // A standby beside it: every gate but the agent's SVID passes...
    let standby = node.start_agent_with(&strs(&args));
    wait_for("the standby to wait for its SVID alone", T, || {
        standby
            .ready()
            .filter(|(s, v)| {
                *s == 503 && v["role"] == "standby" && waiting_for(v) == ["agent-svid"]
            })
            .map(|_| ())
    });
    // ... and it stays not Ready while the provider is down, past the bound after which
    // a lone owner serves: a standby's gates do not time out.
    let until = Instant::now() + IDENTITY_GATE + Duration::from_millis(1500);
    let mut looks = 0;
    while Instant::now() < until {
        let (status, v) = standby.ready().expect("the standby answers /ready");
        assert!(
            status == 503
                && v["role"] == "standby"
                && waiting_for(&v).contains(&"agent-svid".to_string()),
            "the standby turned Ready (or stopped waiting for agent-svid) with the provider down: {status} {v:#}\n{}",
            standby.log()
        );
        assert!(
            problem(&v, "workload-api").is_some_and(|m| m.contains("no SVID yet")),
            "{v:#}"
        );
        looks += 1;
        // The poll's pace, not a synchronisation: the standby must stay so the whole time.
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "the standby stayed not Ready for {:?} ({looks} looks) with the provider down",
        IDENTITY_GATE + Duration::from_millis(1500)
    );
    assert_eq!(
        owner.serving_owner().map(|v| v["role"].clone()),
        Some(json!("owner")),
        "the owner kept serving"
    );

    // The provider comes back: the standby completes and the owner holds the SVID.
    let back = Instant::now();
    idp.set_down(false);
    open_identity_sockets(&idp);
    let v = standby.wait_role("standby", T);
    eprintln!(
        "the standby completed {:?} after the provider came back",
        back.elapsed()
    );
    assert_eq!(v["phase"], "standby-complete");
    assert!(waiting_for(&v).is_empty(), "{v:#}");
    let serial = idp.serial_of_agent();
    for (who, agent) in [("owner", &owner), ("standby", &standby)] {
        let v = try_wait_for(&format!("the {who} holding the provider's SVID"), T, || {
            agent.ready().map(|(_, v)| v).filter(|v| {
                v["identity"]["agent"]["serial"] == serial.as_str()
                    && v["identity"]["workload_api"] == "connected"
                    && v["identity"]["bundle"] == true
                    && problem(v, "workload-api").is_none()
            })
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}: {:#}\n{}",
                agent.ready().map(|r| r.1).unwrap_or_default(),
                agent.log()
            )
        });
        assert_eq!(
            v["identity"]["agent"]["spiffe_id"],
            idp.agent_spiffe_id().as_str()
        );
        assert!(waiting_for(&v).is_empty(), "{who}: {v:#}");
    }
    assert_eq!(
        owner.serving_owner().map(|v| v["role"].clone()),
        Some(json!("owner"))
    );

    // And the node rolls on as usual: the complete standby takes over.
    let mut owner = owner;
    owner.signal(Signal::SIGTERM);
    assert!(owner.wait_exit(T).success(), "{}", owner.log());
    let v = standby.wait_role("owner", T);
    assert_eq!(v["identity"]["agent"]["serial"], serial.as_str());
}

// ---- pods, Envoy and takeovers --------------------------------------------------------

/// A node with a real Envoy whose agents run with identity from `idp` (permissive).
fn identity_rig(test: &str, idp: &IdentityProvider) -> Option<NodeRig> {
    let envoy = envoy_or_skip(test)?;
    Some(NodeRig::start_with(
        &envoy,
        AdsApi::Delta,
        &strs(&identity_args(idp, "permissive")),
    ))
}

fn pod(n: u32) -> (PodId, Ipv4Addr) {
    (
        PodId {
            uid: format!("idpod-{n:03}-uid"),
            name: format!("idpod-{n}"),
        },
        Ipv4Addr::new(10, 88, 3, n as u8),
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

/// A pod's inbound listener as Envoy holds it: its filter chains by name, each with
/// whether it has a transport socket (TLS).
type Chains = Vec<(String, bool)>;

/// The chains of every pod's inbound listener (`inbound|<uid>`) in Envoy's config dump,
/// by uid; None while the admin does not answer.
fn inbound_chains(envoy: &Envoy) -> Option<BTreeMap<String, Chains>> {
    let (status, body) = envoy.get("/config_dump").ok()?;
    let dump: Value = serde_json::from_str(&body).ok().filter(|_| status == 200)?;
    let mut out = BTreeMap::new();
    for config in dump["configs"].as_array().into_iter().flatten() {
        for l in config["dynamic_listeners"].as_array().into_iter().flatten() {
            let Some(uid) = l["name"].as_str().and_then(|n| n.strip_prefix("inbound|")) else {
                continue;
            };
            let chains = l["active_state"]["listener"]["filter_chains"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| {
                    (
                        c["name"].as_str().unwrap_or("?").to_string(),
                        !c["transport_socket"].is_null(),
                    )
                })
                .collect();
            out.insert(uid.to_string(), chains);
        }
    }
    Some(out)
}

/// Permissive with its SVID: an mTLS chain and a plaintext one.
fn mtls_and_plaintext(uid: &str) -> Chains {
    vec![
        (format!("{uid}|mtls"), true),
        (format!("{uid}|plaintext"), false),
    ]
}

/// Without its SVID: the plaintext chain alone.
fn plaintext_only(uid: &str) -> Chains {
    vec![(uid.to_string(), false)]
}

/// Waits until Envoy's pod listeners are exactly `want`.
fn wait_chains(rig: &NodeRig, want: &BTreeMap<String, Chains>, what: &str) {
    let mut last = None;
    if try_wait_for(what, T, || {
        let seen = inbound_chains(&rig.envoy);
        let done = seen.as_ref() == Some(want);
        last = seen;
        done.then_some(())
    })
    .is_err()
    {
        panic!(
            "{what}: Envoy's pod listeners are {last:#?}, want {want:#?}\n{}",
            rig.where_to_look()
        );
    }
}

/// Waits until the agent's `/ready` counts `with` pods holding an SVID and `without`
/// lacking one.
fn wait_svid_counts(agent: &Agent, with: u64, without: u64, within: Duration) -> Value {
    let mut last = Value::Null;
    try_wait_for(
        &format!(
            "{}: {with} pods with an SVID, {without} without",
            agent.name
        ),
        within,
        || {
            let v = agent.ready()?.1;
            let done = v["identity"]["pods_with_svid"] == with
                && v["identity"]["pods_without_svid_count"] == without
                && v["identity"]["pods_without_svid"].as_array().map(Vec::len)
                    == Some(without as usize);
            last = v;
            done.then(|| last.clone())
        },
    )
    .unwrap_or_else(|e| panic!("{e}: /ready {last:#}\n{}", agent.log()))
}

/// One takeover as the new owner's `/ready` reports it.
#[derive(Debug, Clone)]
struct Taken {
    total: Duration,
    svid_wait: Duration,
    missed: u64,
    ready: Value,
}

/// A surge roll: a standby, complete; `overlap` (the old owner still serves); SIGTERM of
/// the owner; the new owner serving and Envoy on its stream. The new owner's `/ready` as
/// first seen serving.
fn surge(rig: &mut NodeRig, overlap: impl FnOnce(&NodeRig, &Agent)) -> Taken {
    let since = Instant::now();
    let next = rig.start_agent();
    next.wait_role("standby", T);
    overlap(rig, &next);
    rig.owner.signal(Signal::SIGTERM);
    let ready = wait_for(&format!("{} to serve as owner", next.name), T, || {
        next.serving_owner()
    });
    let mut old = std::mem::replace(&mut rig.owner, next);
    let status = old.wait_exit(T);
    assert!(
        status.success(),
        "{} exited {status}:\n{}",
        old.name,
        old.log()
    );
    rig.wait_reconnected(since, "a surge roll");
    let us = |k: &str| {
        Duration::from_micros(
            ready["takeover"][k]
                .as_u64()
                .unwrap_or_else(|| panic!("no takeover.{k} in /ready: {ready:#}")),
        )
    };
    Taken {
        total: us("total_us"),
        svid_wait: us("svid_wait_us"),
        missed: ready["takeover"]["svid_wait_missed"]
            .as_u64()
            .expect("svid_wait_missed"),
        ready,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn series(name: &str, t: &[Taken]) {
    let waits: Vec<Duration> = t.iter().map(|x| x.svid_wait).collect();
    let totals: Vec<Duration> = t.iter().map(|x| x.total).collect();
    let at = |v: &[Duration], p| ms(percentile(v, p).expect("samples"));
    eprintln!(
        "{name:<28} {} takeovers: svid_wait median {} max {} | takeover total median {} max {}",
        t.len(),
        at(&waits, 50.0),
        at(&waits, 100.0),
        at(&totals, 50.0),
        at(&totals, 100.0)
    );
}

// ---- 2. one pod's SVID held back for good ---------------------------------------------

#[test]
fn a_pod_whose_svid_never_comes_keeps_its_plaintext_path_and_taxes_no_takeover() {
    let (_dir, idp) = identity_provider_for_agents(TD);
    let Some(mut rig) = identity_rig(
        "a_pod_whose_svid_never_comes_keeps_its_plaintext_path_and_taxes_no_takeover",
        &idp,
    ) else {
        return;
    };
    let (b, c, held) = (pod(1), pod(2), pod(3));

    // Two pods with their SVIDs: both serve mTLS and plaintext.
    add(&rig, &b);
    add(&rig, &c);
    let mut want: BTreeMap<String, Chains> = [&b, &c]
        .iter()
        .map(|p| (p.0.uid.clone(), mtls_and_plaintext(&p.0.uid)))
        .collect();
    wait_chains(&rig, &want, "both pods' listeners with mTLS");
    wait_svid_counts(&rig.owner, 2, 0, T);

    // Takeovers without a held pod, for comparison.
    let mut without = Vec::new();
    for i in 1..=ROLLS {
        let t = surge(&mut rig, |_, _| {});
        assert_eq!(t.missed, 0, "roll {i}: {:#}", t.ready);
        without.push(t);
    }

    // A third pod whose SVID the provider holds back for good.
    idp.hold_pod(&held.0.uid);
    add(&rig, &held);
    idp.wait_for_streams(&held.0.uid, 1);
    want.insert(held.0.uid.clone(), plaintext_only(&held.0.uid));
    wait_chains(
        &rig,
        &want,
        "the held pod's listener, plaintext only, beside the others' mTLS",
    );
    let v = wait_svid_counts(&rig.owner, 2, 1, T);
    assert_eq!(v["identity"]["subscriptions"], 3, "{v:#}");

    let mut with = Vec::new();
    for i in 1..=ROLLS {
        let t = surge(&mut rig, |_, standby| {
            // The standby completed although it has subscribed the held pod too and has
            // nothing for it.
            idp.wait_for_streams(&held.0.uid, 2);
            // Its other two pods' SVIDs arrive on their own streams, maybe after it
            // completed: waits for them, then it is still a complete standby.
            let v = wait_svid_counts(standby, 2, 1, T);
            assert_eq!(v["phase"], "standby-complete", "roll {i}: {v:#}");
        });
        // Permissive: the held pod keeps its plaintext path under the new owner too.
        wait_chains(
            &rig,
            &want,
            &format!("roll {i}: the pods' listeners under the new owner"),
        );
        idp.wait_for_streams(&held.0.uid, 1);
        assert_eq!(
            t.missed, 0,
            "roll {i}: the takeover counted the held pod as one it added: {:#}",
            t.ready
        );
        with.push(t);
    }
    series("without a held pod", &without);
    series("with a held pod", &with);
    for (i, t) in with.iter().enumerate() {
        assert!(
            t.svid_wait < UNTAXED,
            "takeover {} with a held pod (lacking its SVID before the reconcile) waited {} for SVIDs; want under {}: {:#}\n{}",
            i + 1,
            ms(t.svid_wait),
            ms(UNTAXED),
            t.ready,
            rig.where_to_look()
        );
    }
    let log = rig.owner.log();
    assert!(
        !log.contains("serving before every pod it added has its SVID"),
        "{log}"
    );

    // Released, the pod's SVID comes and its listener gains the mTLS chain.
    idp.release_pod(&held.0.uid);
    want.insert(held.0.uid.clone(), mtls_and_plaintext(&held.0.uid));
    wait_chains(&rig, &want, "the released pod's listener with mTLS");
    wait_svid_counts(&rig.owner, 3, 0, T);
    rig.pass();
}

// ---- 2b. pods ADDed during the overlap -------------------------------------------------

#[test]
fn a_takeover_waits_for_the_svids_of_pods_added_during_the_overlap_up_to_its_bound() {
    let (_dir, idp) = identity_provider_for_agents(TD);
    let Some(mut rig) = identity_rig(
        "a_takeover_waits_for_the_svids_of_pods_added_during_the_overlap_up_to_its_bound",
        &idp,
    ) else {
        return;
    };
    let (b, o1, o2) = (pod(11), pod(12), pod(13));
    add(&rig, &b);
    let mut want: BTreeMap<String, Chains> =
        [(b.0.uid.clone(), mtls_and_plaintext(&b.0.uid))].into();
    wait_chains(&rig, &want, "the first pod's listener with mTLS");

    // A pod ADDed to the old owner after the standby completed: the new owner learns of it
    // in its reconcile, subscribes it, and waits for its SVID before it serves.
    let t = surge(&mut rig, |rig, _| add(rig, &o1));
    eprintln!(
        "pod added during the overlap, SVID not held: svid_wait {}, takeover total {}",
        ms(t.svid_wait),
        ms(t.total)
    );
    assert_eq!(
        t.missed,
        0,
        "the pod added during the overlap had no SVID when the new owner served: {:#}\n{}",
        t.ready,
        rig.owner.log()
    );
    assert!(
        t.svid_wait < SVID_WAIT,
        "{}: {:#}",
        ms(t.svid_wait),
        t.ready
    );
    assert!(
        rig.owner
            .log()
            .contains("takeover: the pods it added hold their SVIDs"),
        "{}",
        rig.owner.log()
    );
    // Right after the takeover /ready counts it (the counts follow the same snapshot).
    wait_svid_counts(&rig.owner, 2, 0, Duration::from_secs(1));
    want.insert(o1.0.uid.clone(), mtls_and_plaintext(&o1.0.uid));
    wait_chains(&rig, &want, "the overlap pod's listener with mTLS");

    // The same with a pod whose SVID is held: the takeover waits its whole bound, then
    // serves and says how many of the pods it added still lack one.
    idp.hold_pod(&o2.0.uid);
    let t = surge(&mut rig, |rig, _| add(rig, &o2));
    eprintln!(
        "pod added during the overlap, SVID held: svid_wait {}, takeover total {}",
        ms(t.svid_wait),
        ms(t.total)
    );
    assert_eq!(t.missed, 1, "{:#}", t.ready);
    assert!(
        t.svid_wait >= SVID_WAIT - Duration::from_millis(50) && t.svid_wait < SVID_WAIT * 3,
        "the wait for a held pod added during the overlap took {}, want its {SVID_WAIT:?} bound: {:#}",
        ms(t.svid_wait),
        t.ready
    );
    assert!(
        t.total >= t.svid_wait,
        "the takeover's total includes its SVID wait: {:#}",
        t.ready
    );
    assert!(
        rig.owner
            .log()
            .contains("takeover: serving before every pod it added has its SVID"),
        "{}",
        rig.owner.log()
    );
    wait_svid_counts(&rig.owner, 2, 1, T);
    want.insert(o2.0.uid.clone(), plaintext_only(&o2.0.uid));
    wait_chains(
        &rig,
        &want,
        "the held overlap pod's listener, plaintext only",
    );

    // Released, its SVID reaches the new owner.
    idp.release_pod(&o2.0.uid);
    want.insert(o2.0.uid.clone(), mtls_and_plaintext(&o2.0.uid));
    wait_chains(&rig, &want, "the released pod's listener with mTLS");
    wait_svid_counts(&rig.owner, 3, 0, T);
    rig.pass();
}

// ---- 3. SPIRE's refusals ----------------------------------------------------------------

/// Waits until the owner's `spiffe-broker` problem contains `needle`; returns `/ready`.
fn wait_broker_problem(agent: &Agent, needle: &str) -> Value {
    let mut last = Value::Null;
    try_wait_for(
        &format!("a spiffe-broker problem naming {needle:?}"),
        T,
        || {
            let v = agent.ready()?.1;
            let found = problem(&v, "spiffe-broker").is_some_and(|m| m.contains(needle));
            last = v;
            found.then(|| last.clone())
        },
    )
    .unwrap_or_else(|e| panic!("{e}: /ready {last:#}\n{}", agent.log()))
}

/// The identity provider refuses what SPIRE refuses: an agent that is not an authorized
/// delegate gets no pod SVID and no bundle, and `/ready` names the setting that fixes it;
/// once authorized, it gets them by itself. A pod that no registration entry matches gets
/// SPIRE's empty answer: no SVID, on a stream the agent keeps open; an entry that comes
/// brings the SVID on that stream, one that goes withdraws it from Envoy.
#[test]
fn spire_refusals_leave_pods_without_svids_say_why_and_end_without_a_restart() {
    let (_dir, idp) = identity_provider_for_agents(TD);
    idp.set_authorized_delegates(&["spiffe://example.org/someone-else"]);
    idp.set_pod_namespaces(Some(&["elsewhere"]));
    let Some(mut rig) = identity_rig(
        "spire_refusals_leave_pods_without_svids_say_why_and_end_without_a_restart",
        &idp,
    ) else {
        return;
    };
    let p = pod(21);
    let uid = p.0.uid.clone();
    add(&rig, &p);

    // Not a delegate: nothing is subscribed, and /ready says what to configure.
    let v = wait_broker_problem(&rig.owner, "authorized_delegates");
    assert_eq!(idp.streams_opened(&uid), 0, "{v:#}");
    wait_svid_counts(&rig.owner, 0, 1, T);
    let only_plaintext: BTreeMap<String, Chains> = [(uid.clone(), plaintext_only(&uid))].into();
    wait_chains(&rig, &only_plaintext, "the pod's listener, plaintext only");

    // Authorized (the agent reconnects on its own), but no entry matches the pod: SPIRE's
    // empty answer, on one stream that stays open.
    idp.set_authorized_delegates(&[&idp.agent_spiffe_id()]);
    let v = wait_broker_problem(&rig.owner, "no registration entry");
    idp.wait_for_streams(&uid, 1);
    assert_eq!(v["identity"]["pods_without_svid_count"], 1, "{v:#}");

    // An entry comes: the SVID arrives on that stream and the problem clears.
    idp.set_pod_namespaces(None);
    let with_mtls: BTreeMap<String, Chains> = [(uid.clone(), mtls_and_plaintext(&uid))].into();
    wait_chains(
        &rig,
        &with_mtls,
        "the pod's listener with mTLS once an entry matches",
    );
    let v = wait_svid_counts(&rig.owner, 1, 0, T);
    assert!(problem(&v, "spiffe-broker").is_none(), "{v:#}");

    // The entry goes: the SVID is withdrawn from Envoy; it comes back with the entry.
    idp.set_pod_namespaces(Some(&["elsewhere"]));
    wait_chains(
        &rig,
        &only_plaintext,
        "the pod's listener once its entry is gone",
    );
    wait_broker_problem(&rig.owner, "no registration entry");
    wait_svid_counts(&rig.owner, 0, 1, T);
    idp.set_pod_namespaces(None);
    wait_chains(
        &rig,
        &with_mtls,
        "the pod's listener once the entry is back",
    );
    assert_eq!(
        idp.streams_opened(&uid),
        1,
        "the agent re-subscribed instead of keeping its stream\n{}",
        rig.owner.log()
    );
    rig.pass();
}
