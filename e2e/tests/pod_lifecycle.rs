//! The pod lifecycle across agent generations, through the real `aether-cni` binary on
//! the node's cni.sock, as a container runtime calls it:
//!
//! - surge rolls while other threads keep issuing ADDs and DELs: no call fails (calls
//!   during the switch wait in the plugin's retry loop), and after each roll the new
//!   owner's storage, its snapshot (CHECK) and the real Envoy's config hold exactly the
//!   pods whose ADD answered success and whose DEL has not: no lost pod, no phantom;
//! - a SIGTERM while an ADD waits for an ACK that never comes: the ADD still answers
//!   success, its record is whole, and the owner exits within its drain bound.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{Envoy, EnvoyPods};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{
    Agent, LocalNode, Netns, bin, is_root, pod_records, quarantined, unique_suffix, wait_for,
};
use aether_worker::cni::{ACK_TIMEOUT, DRAIN_BOUND};
use nix::sys::signal::Signal;

const T: Duration = Duration::from_secs(10);

/// Every call the churn made, and the pods it believes the node holds.
#[derive(Default)]
struct Ledger {
    next: u32,
    /// ADD answered success and no DEL issued since: uid to pod.
    live: BTreeMap<String, (PodId, Ipv4Addr)>,
    /// DEL answered success, with the time it did.
    deleted: Vec<(PodId, Ipv4Addr, Instant)>,
    calls: Vec<Call>,
    failures: Vec<String>,
}

struct Call {
    op: &'static str,
    start: Instant,
    end: Instant,
    ok: bool,
}

impl Ledger {
    fn new_pod(&mut self) -> (PodId, Ipv4Addr) {
        self.next += 1;
        let n = self.next;
        // 10.88.0.0/16 minus .0.x: unique per pod for the whole test.
        let ip = Ipv4Addr::new(10, 88, (1 + n / 250) as u8, (1 + n % 250) as u8);
        (
            PodId {
                uid: format!("roll-pod-{n:05}-uid"),
                name: format!("roll-{n}"),
            },
            ip,
        )
    }

    fn ok_calls_since(&self, t: Instant) -> usize {
        self.calls.iter().filter(|c| c.ok && c.start >= t).count()
    }
}

/// How many pods the churn keeps before it starts deleting the oldest: pods outlive
/// several rolls, so each takeover carries pods added by earlier generations.
const POOL: usize = 8;

/// The churn: `threads` threads besides the test's own, each issuing ADD, then DEL of the
/// oldest pod once the pool is full, back to back. More than one keeps several calls in
/// flight across each switch.
struct Churn {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

const CHURN_THREADS: usize = 3;

impl Churn {
    fn start(cni: Arc<Cni>, ledger: Arc<Mutex<Ledger>>, threads: usize) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|i| {
                let (cni, ledger, s) = (cni.clone(), ledger.clone(), stop.clone());
                std::thread::Builder::new()
                    .name(format!("cni-churn-{i}"))
                    .spawn(move || churn(&cni, &ledger, &s))
                    .expect("spawn churn")
            })
            .collect();
        Churn { stop, threads }
    }

    /// Stops after the calls in flight.
    fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("churn thread panicked");
        }
    }
}

impl Drop for Churn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn churn(cni: &Cni, ledger: &Mutex<Ledger>, stop: &AtomicBool) {
    let mut step = 0u64;
    while !stop.load(Ordering::SeqCst) {
        step += 1;
        // Chosen and taken out of `live` under one lock, so two threads never pick the
        // same pod. The live map is keyed by uid, which grows with the counter: the first
        // key is the oldest pod.
        let (op, pod, ip) = {
            let mut l = ledger.lock().unwrap();
            let oldest = (step.is_multiple_of(2) && l.live.len() >= POOL)
                .then(|| l.live.keys().next().cloned())
                .flatten();
            match oldest.and_then(|uid| l.live.remove(&uid)) {
                Some((pod, ip)) => ("DEL", pod, ip),
                None => {
                    let (pod, ip) = l.new_pod();
                    ("ADD", pod, ip)
                }
            }
        };
        let start = Instant::now();
        let r = cni.call(op, &pod, (op == "ADD").then_some(ip));
        let end = Instant::now();
        let mut l = ledger.lock().unwrap();
        l.calls.push(Call {
            op,
            start,
            end,
            ok: r.is_ok(),
        });
        match r {
            Ok(()) if op == "ADD" => {
                l.live.insert(pod.uid.clone(), (pod, ip));
            }
            Ok(()) => l.deleted.push((pod, ip, end)),
            Err(e) => l.failures.push(format!(
                "{op} {} failed after {:?}: {e}",
                pod.uid,
                end - start
            )),
        }
    }
}

/// Strips ANSI colour codes, should a log carry them.
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Storage must hold exactly `live`, each record whole and with the pod's address.
fn storage_mismatches(node: &LocalNode, live: &BTreeMap<String, (PodId, Ipv4Addr)>) -> Vec<String> {
    let mut bad = Vec::new();
    let records = pod_records(&node.state_dir);
    for (file, rec) in &records {
        let uid = file.strip_suffix(".json").unwrap_or(file);
        match rec {
            Err(e) => bad.push(format!("{file}: {e}")),
            Ok(pod) => match live.get(uid) {
                None => bad.push(format!(
                    "phantom record {file} (pod ips {:?}): no live ADD",
                    pod.ips
                )),
                Some((_, ip)) if pod.ips != vec![IpAddr::V4(*ip)] => bad.push(format!(
                    "record {file} holds {:?}, the ADD gave {ip}",
                    pod.ips
                )),
                Some(_) => {}
            },
        }
    }
    for uid in live.keys() {
        if !records.contains_key(&format!("{uid}.json")) {
            bad.push(format!(
                "lost record: {uid} answered ADD success, no DEL, but has no record"
            ));
        }
    }
    for q in quarantined(&node.state_dir) {
        bad.push(format!("quarantined record {q}"));
    }
    bad
}

fn logs(agents: &[&Agent]) -> String {
    agents
        .iter()
        .map(|a| {
            format!(
                "--- {} ({})\n{}",
                a.name,
                a.log_path.display(),
                plain(&a.log())
            )
        })
        .collect()
}

const ROLLS: usize = 5;

#[test]
fn surge_rolls_under_cni_churn_lose_no_pod_and_fail_no_call() {
    const NAME: &str = "surge_rolls_under_cni_churn_lose_no_pod_and_fail_no_call";
    let mut node = LocalNode::new();
    // Envoy's inbound listener binds 0.0.0.0: as root it runs in a namespace of its own.
    let netns = is_root().then(|| {
        Netns::create(&format!("aether-test-{}", unique_suffix())).expect("netns for Envoy")
    });
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let Some(envoy) = Envoy::start_on(&node, netns.as_ref()) else {
        eprintln!(
            "SKIPPED {NAME}: no Envoy (set ENVOY_BIN or run scripts/install-envoy.sh); the pods must be checked in a real proxy's config (CI installs Envoy)"
        );
        return;
    };
    envoy.wait_connected(T);

    let cni = Arc::new(Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    });
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let mut retired: Vec<Agent> = Vec::new();

    for roll in 1..=ROLLS {
        let calls_before = ledger.lock().unwrap().calls.len();
        let roll_start = Instant::now();
        let churn = Churn::start(cni.clone(), ledger.clone(), CHURN_THREADS);
        // Some calls against the old owner first.
        wait_for("churn calls against the old owner", T, || {
            (ledger.lock().unwrap().ok_calls_since(roll_start) >= 4).then_some(())
        });
        let standby = node.start_agent();
        standby.wait_role("standby", T);
        let term = Instant::now();
        owner.signal(Signal::SIGTERM);
        let status = owner.wait_exit(T);
        let exited = Instant::now();
        assert!(
            status.success(),
            "roll {roll}: old owner exits cleanly after SIGTERM:\n{}",
            plain(&owner.log())
        );
        let ready = standby.wait_role("owner", T);
        assert_eq!(ready["generation"], roll as u64 + 1);
        let serving = Instant::now();
        // Some calls answered by the new owner, started after it serves.
        wait_for("churn calls against the new owner", T, || {
            (ledger.lock().unwrap().ok_calls_since(serving) >= 4).then_some(())
        });
        churn.stop();
        retired.push(std::mem::replace(&mut owner, standby));

        let l = ledger.lock().unwrap();
        let all_logs = || {
            logs(
                &retired
                    .iter()
                    .chain(std::iter::once(&owner))
                    .collect::<Vec<_>>(),
            )
        };
        assert!(
            l.failures.is_empty(),
            "roll {roll}: CNI calls failed (a call during the switch must wait in the plugin's retry loop):\n{}\n{}",
            l.failures.join("\n"),
            all_logs()
        );
        let calls = &l.calls[calls_before..];
        let adds_before_exit = calls
            .iter()
            .filter(|c| c.op == "ADD" && c.ok && c.end < exited)
            .count();
        let during_drain = calls
            .iter()
            .filter(|c| c.ok && c.end >= term && c.end < exited)
            .count();
        let spanning = calls
            .iter()
            .filter(|c| c.start < exited && c.end > exited)
            .count();
        let slowest = calls
            .iter()
            .max_by_key(|c| c.end - c.start)
            .expect("calls were made");
        let rel = |t: Instant| {
            if t >= exited {
                (t - exited).as_secs_f64() * 1e3
            } else {
                -(exited - t).as_secs_f64() * 1e3
            }
        };
        let slowest_desc = format!(
            "slowest {} {:.0} ms ({:+.0} to {:+.0} ms around the old owner's exit)",
            slowest.op,
            (slowest.end - slowest.start).as_secs_f64() * 1e3,
            rel(slowest.start),
            rel(slowest.end)
        );
        let dels = calls.iter().filter(|c| c.op == "DEL").count();
        eprintln!(
            "roll {roll}: {} calls ({} ADD, {dels} DEL), {adds_before_exit} ADDs answered before the old owner exited, {during_drain} answered during its drain, {spanning} spanning its exit, {slowest_desc}; SIGTERM to exit {:.0} ms, exit to new owner serving {:.0} ms; {} live pods",
            calls.len(),
            calls.len() - dels,
            (exited - term).as_secs_f64() * 1e3,
            (serving - exited).as_secs_f64() * 1e3,
            l.live.len()
        );

        // Storage: exactly the live pods, each record whole.
        let bad = storage_mismatches(&node, &l.live);
        assert!(
            bad.is_empty(),
            "roll {roll}: storage does not match the answered calls:\n{}\n{}",
            bad.join("\n"),
            all_logs()
        );

        // Envoy, now on the new owner's stream: the same pods, nothing else.
        let live_ips: BTreeMap<String, IpAddr> = l
            .live
            .iter()
            .map(|(u, (_, ip))| (u.clone(), IpAddr::V4(*ip)))
            .collect();
        let want = EnvoyPods::expected(live_ips.iter());
        if let Err(seen) = EnvoyPods::wait_until(&envoy, &want, Duration::from_secs(5)) {
            panic!(
                "roll {roll}: Envoy's config does not match the answered calls: {}\n{}",
                seen.diff(&want),
                all_logs()
            );
        }

        // The new owner's own snapshot, through the plugin's CHECK: it holds every live
        // pod, and none of those deleted during this roll.
        for (pod, ip) in l.live.values() {
            if let Err(e) = cni.call("CHECK", pod, Some(*ip)) {
                panic!(
                    "roll {roll}: CHECK of live pod {}: {e}\n{}",
                    pod.uid,
                    all_logs()
                );
            }
        }
        for (pod, ip, _) in l.deleted.iter().filter(|(_, _, t)| *t >= roll_start) {
            match cni.call("CHECK", pod, Some(*ip)) {
                Ok(()) => panic!(
                    "roll {roll}: the new owner still holds {} after its DEL answered success\n{}",
                    pod.uid,
                    all_logs()
                ),
                Err(e) => {
                    assert!(
                        e.contains("is not known to the agent"),
                        "roll {roll}: CHECK of deleted {}: {e}",
                        pod.uid
                    )
                }
            }
        }

        // A DEL the agent answered as "unknown pod" was, here, a pod whose ADD had
        // succeeded: the owner had lost it.
        let log = all_logs();
        let lost: Vec<&str> = log
            .lines()
            .filter(|line| line.contains("CNI DEL of a pod the agent does not know"))
            .collect();
        assert!(
            lost.is_empty(),
            "roll {roll}: DEL found no pod for an ADD that had succeeded:\n{}",
            lost.join("\n")
        );
    }

    // Clean up through the plugin; the node ends empty everywhere.
    let live: Vec<(PodId, Ipv4Addr)> = ledger.lock().unwrap().live.values().cloned().collect();
    for (pod, _) in &live {
        cni.call("DEL", pod, None)
            .unwrap_or_else(|e| panic!("final DEL of {}: {e}", pod.uid));
    }
    let bad = storage_mismatches(&node, &BTreeMap::new());
    assert!(
        bad.is_empty(),
        "storage after the final DELs:\n{}",
        bad.join("\n")
    );
    if let Err(seen) = EnvoyPods::wait_until(&envoy, &EnvoyPods::default(), Duration::from_secs(5))
    {
        panic!(
            "Envoy after the final DELs: {}",
            seen.diff(&EnvoyPods::default())
        );
    }
    let l = ledger.lock().unwrap();
    let (adds, dels) = (
        l.calls.iter().filter(|c| c.op == "ADD").count(),
        l.calls.iter().filter(|c| c.op == "DEL").count(),
    );
    eprintln!(
        "{ROLLS} rolls: {adds} ADDs and {dels} DELs through aether-cni, none failed; no lost or phantom pod"
    );
    drop(envoy);
}

#[test]
fn sigterm_during_an_adds_ack_wait_lets_it_finish_then_exits_within_the_drain_bound() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    // No Envoy is connected: no ACK ever comes, so every ADD waits out ACK_TIMEOUT.
    let standby = node.start_agent();
    standby.wait_role("standby", T);

    let cni = Arc::new(Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    });
    let pod = PodId {
        uid: "sigterm-pod-uid".into(),
        name: "sigterm-0".into(),
    };
    let ip = Ipv4Addr::new(10, 88, 7, 7);
    let add = {
        let (cni, pod) = (cni.clone(), pod.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let r = cni.call("ADD", &pod, Some(ip));
            (r, start, Instant::now())
        })
    };
    // The agent logs "CNI ADD" once the record is written and the pod is in the
    // snapshot, right before the ACK wait.
    wait_for("the ADD to reach its ACK wait", T, || {
        plain(&owner.log())
            .lines()
            .any(|l| l.contains("CNI ADD") && l.contains(&pod.uid))
            .then_some(())
    });
    assert!(
        !add.is_finished(),
        "the ADD answered before its ACK wait ran out:\n{}",
        plain(&owner.log())
    );
    let term = Instant::now();
    owner.signal(Signal::SIGTERM);
    let status = owner
        .wait_exit_timeout(DRAIN_BOUND + Duration::from_secs(2))
        .expect("the owner exits");
    let exit_after = term.elapsed();
    let (result, add_start, add_end) = add.join().expect("ADD thread");
    let log = plain(&owner.log());

    assert!(
        result.is_ok(),
        "the ADD in flight at SIGTERM must answer success: {result:?}\n{log}"
    );
    assert!(status.success(), "owner exit status {status}:\n{log}");
    assert!(
        add_end <= Instant::now() && add_end - add_start >= ACK_TIMEOUT,
        "the ADD waited out the ACK bound"
    );
    assert!(
        log.contains("proxy did not ACK a snapshot holding the pod in time"),
        "the ADD ran its ACK wait out:\n{log}"
    );
    assert!(
        exit_after < DRAIN_BOUND,
        "the owner took {exit_after:?} from SIGTERM to exit; its drain bound is {DRAIN_BOUND:?}:\n{log}"
    );

    // The record is whole, with what the ADD carried.
    let records = pod_records(&node.state_dir);
    assert_eq!(
        records.len(),
        1,
        "one record, nothing half-written: {records:?}"
    );
    let rec = records
        .get(&format!("{}.json", pod.uid))
        .expect("the record")
        .as_ref()
        .expect("the record decodes");
    assert_eq!(
        (rec.ips.clone(), rec.container_id.as_str()),
        (vec![IpAddr::V4(ip)], format!("ctr-{}", pod.uid).as_str())
    );

    // The standby took over and serves the pod from that record.
    standby.wait_role("owner", T);
    cni.call("CHECK", &pod, Some(ip)).unwrap_or_else(|e| {
        panic!(
            "the new owner holds the pod: {e}\n{}",
            plain(&standby.log())
        )
    });
    eprintln!(
        "ADD answered success after {:.0} ms; SIGTERM {:.0} ms into it; owner exited {:.0} ms after SIGTERM (drain bound {DRAIN_BOUND:?})",
        (add_end - add_start).as_secs_f64() * 1e3,
        (term - add_start).as_secs_f64() * 1e3,
        exit_after.as_secs_f64() * 1e3
    );
}

/// A standby follows the owner's pod records: a pod ADDed to the owner after the standby
/// was complete, and one DELeted, are in the standby's snapshot before the roll, so the
/// takeover's reconcile reads nothing: no event of a write its follow missed was queued.
/// (No Envoy: each call waits out its ACK bound.)
#[test]
fn a_standby_takes_the_owners_adds_and_dels_before_the_takeover() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let gone = PodId {
        uid: "follow-gone-uid".into(),
        name: "follow-gone".into(),
    };
    let (gone_ip, new_ip) = (Ipv4Addr::new(10, 88, 8, 1), Ipv4Addr::new(10, 88, 8, 2));
    cni.call("ADD", &gone, Some(gone_ip))
        .expect("ADD before the standby");
    let standby = node.start_agent();
    standby.wait_role("standby", T);

    let new = PodId {
        uid: "follow-new-uid".into(),
        name: "follow-new".into(),
    };
    cni.call("ADD", &new, Some(new_ip))
        .expect("ADD during the overlap");
    cni.call("DEL", &gone, Some(gone_ip))
        .expect("DEL during the overlap");
    let followed = |what: &str, uid: &str| {
        wait_for(
            &format!("the standby to take the owner's {what} of {uid}"),
            T,
            || {
                plain(&standby.log())
                    .lines()
                    .any(|l| {
                        l.contains(&format!("standby: pod {what} during the overlap"))
                            && l.contains(uid)
                    })
                    .then_some(())
            },
        )
    };
    followed("added", &new.uid);
    followed("removed", &gone.uid);

    owner.signal(Signal::SIGTERM);
    assert!(owner.wait_exit(T).success(), "{}", plain(&owner.log()));
    standby.wait_role("owner", T);
    // It followed both: the takeover reads nothing, and the owner's scan once serving
    // finds the folder as followed.
    standby.wait_log(
        "takeover reconcile: the standby had followed every write to the pod records",
        T,
    );
    let records = pod_records(&node.state_dir);
    assert_eq!(
        records.keys().collect::<Vec<_>>(),
        [&format!("{}.json", new.uid)],
        "the new owner's records"
    );
}
