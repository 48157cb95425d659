//! The registry's etcd loses a member while the agent rolls (issue 12 show 7): a
//! three-member etcd, a registrar given all three, node A (a [`NodeRig`]: real agents and
//! a real Envoy) surge-rolled under load while registry changes keep coming, and the etcd
//! leader killed in the middle of a roll. No request through either node's Envoy may
//! fail, nor any registry call for want of the killed member (the registrar sends such a
//! request again, to another member), and at the end each Envoy's EDS equals the
//! registrar's view at its final revision. Node B is a second local node (its own agent, `--node-name=node-b`, and
//! Envoy), never rolled, so that two proxies are compared.
//!
//! Skips, saying so, without Envoy or etcd (CI and `scripts/test.sh` install both).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, Envoy, NodeRig, envoy_or_skip};
use aether_e2e::harness::load::{self, Load};
use aether_e2e::registrar::{Etcd, RegistrarProcess, dump, envoy_eds, expected_eds, registrar_bin};
use aether_e2e::testing::{Agent, LocalNode, try_wait_for, wait_for};
use nix::sys::signal::Signal;
use serde_json::Value;
use shared_proto::registry as pb;

const T: Duration = Duration::from_secs(10);
/// Envoy start, first connect and first routed request.
const T_START: Duration = Duration::from_secs(30);
/// Surge rolls of node A; the etcd leader dies during the middle one.
const ROLLS: usize = 10;
const KILL_DURING: usize = 5;
/// Requests per second through each Envoy.
const RPS: u32 = 100;
const SERVICE: &str = NodeRig::SERVICE;
/// Services the registry changes touch, besides the rigs' own; their endpoints run on
/// `node-c` and are never dialled.
const CHURNED: usize = 4;
const CHURN_NODE: &str = "node-c";
/// A registry change every this often, from the start of the rolls to their end.
const CHURN_EVERY: Duration = Duration::from_millis(40);

/// The churned services as this test last asked the registrar to hold them.
struct Churned {
    ports: Vec<u16>,
    draining: Vec<bool>,
    marked: Vec<bool>,
}

impl Churned {
    const ENDPOINTS: usize = 3;

    fn key(s: usize) -> pb::ServiceKey {
        pb::ServiceKey {
            namespace: "default".into(),
            name: format!("churn-{s}"),
        }
    }

    fn address(s: usize, e: usize) -> String {
        Ipv4Addr::new(10, 90, s as u8, e as u8 + 1).to_string()
    }

    fn service(&self, s: usize) -> pb::Service {
        let endpoints = (0..Self::ENDPOINTS)
            .map(|e| {
                let k = s * Self::ENDPOINTS + e;
                let state = if self.draining[k] {
                    pb::EndpointState::Draining
                } else {
                    pb::EndpointState::Healthy
                };
                pb::Endpoint {
                    address: Self::address(s, e),
                    port: u32::from(self.ports[k]),
                    service_port: 80,
                    node: CHURN_NODE.into(),
                    pod: format!("churn-{s}-{e}"),
                    state: state as i32,
                    mtls: false,
                    quic: String::new(),
                    quic_sni: String::new(),
                }
            })
            .collect();
        pb::Service {
            key: Some(Self::key(s)),
            ports: vec![80],
            vip: String::new(),
            endpoints,
        }
    }
}

/// Registry changes through the registry API, in a thread of their own: a drain mark set
/// or removed (as node C's agent would), an endpoint's applied state or its port
/// changed, in turn. A call that fails is recorded and the next change made; the final
/// comparison is with what the registrar holds, not with what was asked.
struct Churn {
    stop: Arc<AtomicBool>,
    applied: Arc<AtomicU64>,
    failed: Arc<Mutex<Vec<(Instant, String)>>>,
    thread: Option<JoinHandle<()>>,
}

impl Churn {
    fn start(registrar: &str) -> Churn {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the registry client");
        // Each call may take as long as the registrar's own etcd requests (10 s): while
        // etcd elects a leader a call waits rather than fails, and an election on a busy
        // machine can take seconds.
        let mut client = rt
            .block_on(aether_registrar::client::connect(
                registrar,
                Duration::from_secs(10),
                None,
            ))
            .expect("connect to the registrar");
        let n = CHURNED * Churned::ENDPOINTS;
        let mut want = Churned {
            ports: vec![8080; n],
            draining: vec![false; n],
            marked: vec![false; n],
        };
        let services = (0..CHURNED).map(|s| want.service(s)).collect();
        rt.block_on(client.apply_services(pb::ApplyServicesRequest { services }))
            .expect("apply the churned services");
        let stop = Arc::new(AtomicBool::new(false));
        let applied = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(Vec::new()));
        let (st, ap, fa) = (stop.clone(), applied.clone(), failed.clone());
        let thread = std::thread::Builder::new()
            .name("registry-churn".into())
            .spawn(move || {
                let mut i = 0usize;
                while !st.load(Ordering::Relaxed) {
                    let s = i % CHURNED;
                    let k = s * Churned::ENDPOINTS + (i / CHURNED) % Churned::ENDPOINTS;
                    let result = match i % 3 {
                        0 => {
                            want.marked[k] ^= true;
                            let state = if want.marked[k] {
                                pb::EndpointState::Draining
                            } else {
                                pb::EndpointState::Healthy
                            };
                            let req = pb::SetEndpointStateRequest {
                                service: Some(Churned::key(s)),
                                address: Churned::address(s, k % Churned::ENDPOINTS),
                                state: state as i32,
                                node: CHURN_NODE.into(),
                                instance: "churn".into(),
                            };
                            rt.block_on(client.set_endpoint_state(req)).map(|_| ())
                        }
                        step => {
                            if step == 1 {
                                want.draining[k] ^= true;
                            } else {
                                want.ports[k] = if want.ports[k] == 8080 { 9090 } else { 8080 };
                            }
                            let req = pb::ApplyServicesRequest {
                                services: vec![want.service(s)],
                            };
                            rt.block_on(client.apply_services(req)).map(|_| ())
                        }
                    };
                    match result {
                        Ok(()) => {
                            ap.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(status) => fa.lock().unwrap().push((
                            Instant::now(),
                            format!("{:?}: {}", status.code(), status.message()),
                        )),
                    }
                    i += 1;
                    std::thread::sleep(CHURN_EVERY);
                }
            })
            .expect("spawn the churn thread");
        Churn {
            stop,
            applied,
            failed,
            thread: Some(thread),
        }
    }

    fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }

    /// Stops the changes; (applied, failed calls).
    fn stop(mut self) -> (u64, Vec<(Instant, String)>) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the churn thread");
        }
        (self.applied(), self.failed.lock().unwrap().clone())
    }
}

/// Node B: a second local node watching the registrar, with its own Envoy routing
/// [`SERVICE`] through its own outbound listener; never rolled. Fields drop in order:
/// Envoy, the agent, the folder.
struct PeerNode {
    envoy: Envoy,
    _owner: Agent,
    node: LocalNode,
    outbound: SocketAddr,
}

impl PeerNode {
    fn start(envoy_bin: &std::path::Path, registrar: &str) -> PeerNode {
        let mut node = LocalNode::builder()
            .keep_folder()
            .node_name("node-b")
            .capture()
            .args([format!("--registrar={registrar}")])
            .build()
            .expect("node B's folder");
        let root = node.root.path().to_path_buf();
        let outbound = node.outbound.expect("the capture listeners");
        let owner = node
            .start_owner(T_START)
            .unwrap_or_else(|e| panic!("node B: {e}"));
        let envoy = Envoy::start(
            envoy_bin,
            &root,
            &node.run_dir,
            Duration::from_millis(100),
            Duration::from_secs(1),
            AdsApi::Delta,
        )
        .expect("start node B's Envoy");
        wait_for(
            &format!(
                "node B's Envoy to route {SERVICE} through {outbound} (log {})",
                envoy.log.display()
            ),
            T_START,
            || load::request(outbound, SERVICE).is_ok().then_some(()),
        );
        PeerNode {
            envoy,
            _owner: owner,
            node,
            outbound,
        }
    }
}

/// The index of etcd's leader, asked of each member (its status names the leader).
fn leader(etcd: &Etcd) -> usize {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime for the etcd client");
    rt.block_on(async {
        for (i, url) in etcd.client_urls().iter().enumerate() {
            let mut c = etcd_client::Client::connect([url.as_str()], None)
                .await
                .expect("connect to an etcd member");
            let status = c.status().await.expect("etcd member status");
            if status.header().map(|h| h.member_id()) == Some(status.leader()) {
                return i;
            }
        }
        panic!("no etcd member says it is the leader")
    })
}

/// An EDS view read from a config dump (`envoy_eds` reads UNHEALTHY as DRAINING).
fn eds_of(envoy: &Envoy) -> Option<BTreeMap<String, Vec<String>>> {
    let (status, body) = envoy.get("/config_dump?include_eds").ok()?;
    Some(envoy_eds(
        &serde_json::from_str::<Value>(&body)
            .ok()
            .filter(|_| status == 200)?,
    ))
}

/// One surge roll of `rig`: the next generation starts, is a ready standby (its registry
/// view loaded from the registrar), the owner gets SIGTERM and exits cleanly, the new one
/// serves and Envoy is on it. `during` runs once the new generation is started.
fn roll(
    rig: &mut NodeRig,
    what: &str,
    actions: &mut Vec<(String, Instant)>,
    during: impl FnOnce(&mut Vec<(String, Instant)>),
) {
    let quiet = Instant::now();
    let next = rig.start_agent();
    during(actions);
    wait_for(
        &format!("{what}: {} to be a ready standby", next.name),
        T,
        || {
            next.ready()
                .filter(|(s, v)| *s == 200 && v["role"] == "standby")
                .map(|_| ())
        },
    );
    actions.push((format!("{what}: SIGTERM"), Instant::now()));
    rig.owner.signal(Signal::SIGTERM);
    let mut old = std::mem::replace(&mut rig.owner, next);
    let status = old
        .wait_exit_timeout(T)
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert!(
        status.success(),
        "{what}: {} exited with {status} after SIGTERM; log:\n{}",
        old.name,
        old.log()
    );
    wait_for(
        &format!("{what}: {} to serve as owner", rig.owner.name),
        T,
        || rig.owner.serving_owner(),
    );
    rig.wait_reconnected(quiet, what);
}

/// Each failure placed after the last action before it.
fn placed(failures: &[(Instant, String)], actions: &[(String, Instant)]) -> String {
    failures
        .iter()
        .map(
            |(t, what)| match actions.iter().rev().find(|(_, a)| a <= t) {
                Some((name, a)) => format!(
                    "{:.1} ms after {name}: {what}",
                    (*t - *a).as_secs_f64() * 1e3
                ),
                None => format!("before the first action: {what}"),
            },
        )
        .collect::<Vec<_>>()
        .join("\n  ")
}

#[test]
fn killing_the_etcd_leader_during_surge_rolls_fails_no_request_and_both_envoys_end_at_the_registrar_view()
 {
    let test = "killing_the_etcd_leader_during_surge_rolls...";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let Some(mut etcd) = Etcd::cluster_or_skip(test, 3) else {
        return;
    };
    let started = Instant::now();
    // The rig registers its loopback upstreams at the registrar.
    let registrar = RegistrarProcess::tcp(
        &registrar_bin(),
        &etcd.endpoints(),
        &["--allow-loopback-endpoints"],
    );
    let churn = Churn::start(registrar.addr());
    let mut rig = NodeRig::start_from(&envoy_bin, AdsApi::Delta, Some(registrar.addr()), &[]);
    let mut peer = PeerNode::start(&envoy_bin, registrar.addr());
    let loads = [
        (
            "node A",
            Load::start(rig.outbound, vec![SERVICE.into()], RPS),
        ),
        (
            "node B",
            Load::start(peer.outbound, vec![SERVICE.into()], RPS),
        ),
    ];
    eprintln!(
        "etcd (3 members), registrar, both nodes and their Envoys up after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let mut actions = Vec::new();
    let mut killed = None;
    let mut applied_at_kill = 0;
    for i in 1..=ROLLS {
        let t = Instant::now();
        roll(&mut rig, &format!("roll {i}"), &mut actions, |actions| {
            if i == KILL_DURING {
                let l = leader(&etcd);
                actions.push((format!("roll {i}: etcd leader m{l} killed"), Instant::now()));
                etcd.kill(l);
                killed = Some(l);
                applied_at_kill = churn.applied();
            }
        });
        eprintln!(
            "roll {i}: {:.0} ms, registry changes applied so far {}",
            t.elapsed().as_secs_f64() * 1e3,
            churn.applied()
        );
    }
    let killed = killed.expect("a member was killed");
    // Changes keep being applied with two members left. A transaction in flight at the
    // old leader when it died holds its call for etcd's request timeout (about 5 s,
    // "request timed out, possibly due to previous leader failure").
    wait_for(
        "registry changes applied with two etcd members",
        Duration::from_secs(20),
        || (churn.applied() >= applied_at_kill + 10).then_some(()),
    );
    let (applied, failed_calls) = churn.stop();

    let mut failed = Vec::new();
    for (name, load) in loads {
        let counters = load.stop();
        let (requests, failures) = (
            counters.requests.load(Ordering::Relaxed),
            counters.failures.load(Ordering::Relaxed),
        );
        eprintln!("{name}: {requests} requests through Envoy, {failures} failed");
        assert!(requests > 0, "{name}: the load sent no request");
        let log = counters.failure_log.lock().unwrap();
        if failures > 0 {
            failed.push(format!(
                "{name}: {failures} of {requests} failed:\n  {}",
                placed(
                    &log.iter()
                        .map(|(t, h, w)| (*t, format!("{h}: {w}")))
                        .collect::<Vec<_>>(),
                    &actions
                )
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "requests failed\n{}\n{}; node B {}",
        failed.join("\n"),
        rig.where_to_look(),
        peer.node.root.path().display()
    );

    // No registry call failed for want of the killed member: the registrar sends such a
    // request again, to another member. A call can still fail when etcd itself gives up
    // on it ("etcdserver: request timed out": a transaction the dead leader had taken, or
    // an election that a busy machine stretches past the registrar's 2 s of retries);
    // those are only counted.
    let lost_member: Vec<_> = failed_calls
        .iter()
        .filter(|(_, what)| {
            ["tcp connect error", "transport error", "connection"]
                .iter()
                .any(|m| what.contains(m))
        })
        .cloned()
        .collect();
    assert!(
        lost_member.is_empty(),
        "registry calls failed on the killed member:\n  {}\nregistrar log:\n{}",
        placed(&lost_member, &actions),
        registrar.log()
    );

    // Both Envoys end at the registrar's view at its final revision.
    let view = dump(registrar.addr());
    let want = expected_eds(&view);
    assert!(
        want.len() > CHURNED,
        "the registrar holds the churned services and the rigs' own: {want:?}"
    );
    for (name, envoy, dir) in [
        ("node A", &rig.envoy, rig.node.root.path()),
        ("node B", &peer.envoy, peer.node.root.path()),
    ] {
        let mut got = None;
        try_wait_for(
            &format!("{name}'s Envoy EDS to equal the registrar's"),
            T,
            || {
                got = eds_of(envoy);
                (got.as_ref() == Some(&want)).then_some(())
            },
        )
        .unwrap_or_else(|_| {
            panic!(
                "{name}: Envoy's EDS {got:#?}\nthe registrar's {want:#?}\n(folder {})",
                dir.display()
            )
        });
    }
    // What the member's death cost the registrar's watches, for the record.
    let log = registrar.log();
    eprintln!(
        "{ROLLS} surge rolls, etcd leader m{killed} killed during roll {KILL_DURING}: {applied} registry changes applied, {} failed{}; registrar: {} etcd watches broken and made again, {} streams failed; both Envoys equal the registrar's view ({} clusters, {} endpoints DRAINING); {:.1} s in all",
        failed_calls.len(),
        if failed_calls.is_empty() {
            String::new()
        } else {
            format!(" ({})", placed(&failed_calls, &actions))
        },
        log.matches("etcd watch broke").count()
            + log.matches("etcd watch failed; retrying").count(),
        log.matches("watch stream failed").count(),
        want.len(),
        want.values()
            .flatten()
            .filter(|e| e.ends_with(" DRAINING"))
            .count(),
        started.elapsed().as_secs_f64()
    );
    rig.pass();
    peer.node.root.disable_cleanup(false);
}
