//! Fault matrix row 7: SIGKILL at random moments while pod records are written.
//!
//! Client threads send ADD and DEL through the real `aether-cni` on the node's `cni.sock`
//! while the test SIGKILLs the worker again and again (200 kills by default), at random
//! delays after it serves, seeded and printed so that a failure can be replayed. The
//! worker writes each record as temp file, fsync, rename, folder fsync
//! (`worker/src/storage.rs`).
//!
//! How the kills are spread: the supervisor respawns a worker at once only after one that
//! reached Serving (a worker that keeps dying earlier waits 0.1 s doubling to 5 s), so
//! the test waits for the respawned worker to serve before it draws the next delay. Every
//! [`GENERATION_EVERY`]th kill, and the last, takes the whole generation (supervisor and
//! worker) while the next one waits as a standby, which then takes over and reloads the
//! records.
//!
//! Temp files: `Storage::open` leaves them (another generation may still be writing); the
//! owner removes them, by its takeover reload or, after a respawn, by `Storage::tidy` off
//! the runtime once it serves. So after each kill the test waits (at most 10 s) for the
//! killed worker's temp files to go, then checks that none of an earlier worker is left.
//!
//! Env: `AETHER_KILLS` (default 200), `AETHER_KILL_SEED` (default from the clock),
//! `AETHER_KILL_MAX_DELAY_MS` (default 120).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_e2e::envoy::{AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::testing::{bin, env_usize, pod_records, quarantined, try_wait_for, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// A respawned worker, or a new generation, serving again.
const T: Duration = Duration::from_secs(30);
/// The serving owner's removal of a killed worker's temp files (`Storage::tidy`).
const TIDY: Duration = Duration::from_secs(10);
/// Client threads, each with its own pods.
const CLIENTS: usize = 4;
/// Pods each client keeps before it deletes its oldest.
const POOL: usize = 4;
/// Every this many kills, the whole generation goes instead of the worker.
const GENERATION_EVERY: usize = 40;
/// The plugin's note on a DEL it let the chain go on with, without the agent's answer.
const DEL_WITHOUT_AGENT: &str = "returns success without the agent";

/// What the node must hold for a pod, from the last answer its calls received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// ADD answered success.
    Present,
    /// DEL answered success by the agent.
    Absent,
    /// The last call failed (or its DEL never reached the agent): the old state or the
    /// new one, whole.
    Either,
}

#[derive(Debug, Clone)]
struct PodState {
    ip: Ipv4Addr,
    want: Want,
    /// Bumped when a call starts and when it ends: equal before and after a read of the
    /// records means no call ran across it.
    seq: u64,
    in_flight: bool,
}

#[derive(Default)]
struct Ledger {
    pods: BTreeMap<String, PodState>,
    adds_ok: u64,
    dels_ok: u64,
    failed: u64,
    /// The first failed calls' answers, for the log.
    failures: Vec<String>,
}

/// One call's answer, as the runtime would see it.
enum Answer {
    Ok,
    /// The plugin exited 0 on a DEL that never reached the agent.
    NotReached,
    Failed(String),
}

/// Runs the real plugin for `op` on `uid`, as a container runtime does.
fn plugin(socket: &Path, op: &str, uid: &str, ip: Ipv4Addr) -> Answer {
    let mut conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "kill-writes", "type": "aether-cni", "agentSocket": socket,
    });
    if op != "DEL" {
        conf["prevResult"] = serde_json::json!({
            "cniVersion": "1.0.0", "interfaces": [{ "name": "eth0", "sandbox": "/proc/self/ns/net" }],
            "ips": [{ "address": format!("{ip}/16"), "interface": 0 }],
        });
    }
    let child = Command::new(bin("aether-cni"))
        .env_clear()
        .env("CNI_COMMAND", op)
        .env("CNI_CONTAINERID", format!("ctr-{uid}"))
        .env("CNI_NETNS", "/proc/self/ns/net")
        .env("CNI_IFNAME", "eth0")
        .env(
            "CNI_ARGS",
            format!("K8S_POD_NAMESPACE=kill;K8S_POD_NAME={uid};K8S_POD_UID={uid}"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return Answer::Failed(format!("spawning aether-cni: {e}")),
    };
    let _ = child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(conf.to_string().as_bytes());
    let out = match child.wait_with_output() {
        Ok(o) => o,
        Err(e) => return Answer::Failed(format!("waiting for aether-cni: {e}")),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    match (
        out.status.success(),
        op == "DEL" && stderr.contains(DEL_WITHOUT_AGENT),
    ) {
        (true, false) => Answer::Ok,
        (true, true) => Answer::NotReached,
        (false, _) => Answer::Failed(format!(
            "{op} {uid}: {} {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            stderr.trim()
        )),
    }
}

/// A client: ADD new pods up to [`POOL`], then DEL the oldest; a pod whose last call
/// failed is deleted until the agent answers, as a runtime retries a DEL.
fn client(id: usize, socket: PathBuf, ledger: Arc<Mutex<Ledger>>, stop: Arc<AtomicBool>) {
    let mut mine: Vec<String> = Vec::new();
    let mut next = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let unsure = mine
            .iter()
            .find(|u| ledger.lock().unwrap().pods[*u].want == Want::Either)
            .cloned();
        let (op, uid) = match unsure {
            Some(uid) => ("DEL", uid),
            None if mine.len() >= POOL => ("DEL", mine[0].clone()),
            None => {
                next += 1;
                let uid = format!("kill-{id}-{next:05}");
                // 10.77.<client>.<n>/16 .. unique per pod for the whole test.
                let n = next as usize;
                let ip = Ipv4Addr::new(10, 77, (id * 60 + n / 250) as u8, (1 + n % 250) as u8);
                ledger.lock().unwrap().pods.insert(
                    uid.clone(),
                    PodState {
                        ip,
                        want: Want::Absent,
                        seq: 0,
                        in_flight: false,
                    },
                );
                mine.push(uid.clone());
                ("ADD", uid)
            }
        };
        let ip = {
            let mut l = ledger.lock().unwrap();
            let p = l.pods.get_mut(&uid).expect("a pod of this client");
            p.seq += 1;
            p.in_flight = true;
            p.ip
        };
        let answer = plugin(&socket, op, &uid, ip);
        let mut l = ledger.lock().unwrap();
        let want = match (&answer, op) {
            (Answer::Ok, "ADD") => {
                l.adds_ok += 1;
                Want::Present
            }
            (Answer::Ok, _) => {
                l.dels_ok += 1;
                mine.retain(|u| *u != uid);
                Want::Absent
            }
            (Answer::NotReached, _) => {
                l.failed += 1;
                Want::Either
            }
            (Answer::Failed(e), _) => {
                l.failed += 1;
                if l.failures.len() < 5 {
                    l.failures.push(e.clone());
                }
                Want::Either
            }
        };
        let p = l.pods.get_mut(&uid).expect("a pod of this client");
        p.want = want;
        p.seq += 1;
        p.in_flight = false;
    }
}

/// The pid in a temp file's name (`.<uid>.json.tmp.<pid>.<seq>`), if it is one.
fn temp_pid(name: &str) -> Option<i32> {
    let rest = &name[name.find(".tmp.")? + 5..];
    rest.split('.').next()?.parse().ok()
}

/// Checks the records against the ledger: the violations found, and the temp files of
/// other processes than `serving`. With `strict`, once the owner has tidied, those are
/// violations.
fn check(
    state_dir: &Path,
    ledger: &Mutex<Ledger>,
    serving: Option<i32>,
    strict: bool,
) -> (Vec<String>, usize) {
    let before = ledger.lock().unwrap().pods.clone();
    let records = pod_records(state_dir);
    let after = ledger.lock().unwrap().pods.clone();
    let mut bad = Vec::new();
    let mut held: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut leftovers = 0;
    for (name, record) in &records {
        if let Some(pid) = temp_pid(name) {
            if serving != Some(pid) {
                leftovers += 1;
                if strict {
                    bad.push(format!("temp file {name} of an earlier worker survived the takeover (serving: {serving:?})"));
                }
            }
            continue;
        }
        match record {
            // Removed between the listing and the read: a DEL in flight.
            Err(_) if !state_dir.join("pods").join(name).exists() => {}
            Err(why) => bad.push(format!("record {name} does not decode: {why}")),
            Ok(pod) if format!("{}.json", pod.uid) != *name => {
                bad.push(format!("record {name} holds pod uid {}", pod.uid))
            }
            Ok(pod) if !after.contains_key(&pod.uid) => bad.push(format!(
                "phantom record {name}: no call ever named pod {}",
                pod.uid
            )),
            Ok(pod) => {
                held.insert(pod.uid.clone(), pod.ips.clone());
            }
        }
    }
    for (uid, now) in &after {
        let settled = before.get(uid).is_some_and(|b| b.seq == now.seq) && !now.in_flight;
        let ips = held.get(uid);
        let whole = ips.is_none_or(|ips| ips == &[IpAddr::V4(now.ip)]);
        if !whole {
            bad.push(format!(
                "pod {uid}'s record holds {ips:?}, not its address {}",
                now.ip
            ));
        }
        match (settled, now.want, ips.is_some()) {
            (true, Want::Present, false) => bad.push(format!(
                "lost pod {uid}: its ADD answered success, no record"
            )),
            (true, Want::Absent, true) => bad.push(format!(
                "phantom pod {uid}: its DEL answered success, the record is there"
            )),
            _ => {}
        }
    }
    let q = quarantined(state_dir);
    if !q.is_empty() {
        bad.push(format!("records quarantined: {q:?}"));
    }
    (bad, leftovers)
}

/// A seeded xorshift64*: the kill delays of a run, replayable from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// The serving owner's worker pid once it is not `old`.
fn serving_worker(rig: &NodeRig, old: i32) -> i32 {
    wait_for("a new worker serving", T, || {
        let v = rig.owner.serving_owner()?;
        let pid = v["pid"].as_i64()? as i32;
        (pid != old).then_some(pid)
    })
}

/// Fault matrix row 7. Invariants, after every kill and at the end: every record
/// decodes and nothing is quarantined; no temp file of a dead worker survives its
/// successor's clean-up once it serves; a pod whose ADD answered success has its record
/// with that address (no lost pod), one whose DEL the agent answered has none (no phantom
/// pod), and one whose call failed has the old state or the new one, whole; at the end
/// the owner's snapshot (the plugin's CHECK) holds exactly the pods with records.
#[test]
fn random_sigkills_during_adds_and_dels_leave_whole_records_that_match_every_answer() {
    const NAME: &str =
        "random_sigkills_during_adds_and_dels_leave_whole_records_that_match_every_answer";
    let Some(envoy_bin) = envoy_or_skip(NAME) else {
        return;
    };
    let kills = env_usize("AETHER_KILLS", 200);
    let max_delay = env_usize("AETHER_KILL_MAX_DELAY_MS", 120) as u64;
    let seed = std::env::var("AETHER_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    eprintln!(
        "{kills} kills, delays 0 to {max_delay} ms after serving; replay with AETHER_KILL_SEED={seed}"
    );
    let mut rng = Rng(seed);

    // A real Envoy ACKs each ADD's snapshot: without a proxy every ADD would wait out
    // the 2 s ACK timeout.
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    let state_dir = rig.node.state_dir.clone();
    let socket = rig.node.cni_sock();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (s, l, st) = (socket.clone(), ledger.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("cni-client-{i}"))
                .spawn(move || client(i, s, l, st))
                .expect("spawn a client")
        })
        .collect();

    let start = Instant::now();
    let mut worker = rig.owner.worker_pid();
    let mut violations = Vec::new();
    let (mut generations, mut leftover_max) = (0, 0);
    let mut note = |violations: &mut Vec<String>,
                    k: usize,
                    what: &str,
                    (bad, leftovers): (Vec<String>, usize)| {
        violations.extend(bad.into_iter().map(|v| format!("{what} {k}: {v}")));
        leftover_max = leftover_max.max(leftovers);
    };
    for k in 1..=kills {
        // Holding the serving state for a random time, then the kill: the delay is the
        // fault's random moment, not a wait for anything.
        std::thread::sleep(Duration::from_millis(rng.below(max_delay + 1)));
        let whole = k % GENERATION_EVERY == 0 || k == kills;
        if whole {
            // A surge roll cut short: the next generation waits as a standby, and the
            // owner's whole generation dies instead of handing off.
            let next = rig.start_agent();
            next.wait_role("standby", T);
            rig.owner.kill_generation();
            note(
                &mut violations,
                k,
                "kill (generation)",
                check(&state_dir, &ledger, None, false),
            );
            rig.owner = next;
            generations += 1;
        } else {
            kill(Pid::from_raw(worker), Signal::SIGKILL).expect("SIGKILL the worker");
            note(
                &mut violations,
                k,
                "kill",
                check(&state_dir, &ledger, None, false),
            );
        }
        worker = serving_worker(&rig, worker);
        let w = worker;
        let tidied = try_wait_for("the killed worker's temp files removed", TIDY, || {
            pod_records(&state_dir)
                .keys()
                .all(|n| temp_pid(n).is_none_or(|p| p == w))
                .then_some(())
        });
        if let Err(e) = tidied {
            violations.push(format!(
                "after kill {k}: {e}: {:?}",
                pod_records(&state_dir)
                    .keys()
                    .filter(|n| temp_pid(n).is_some())
                    .collect::<Vec<_>>()
            ));
        }
        note(
            &mut violations,
            k,
            "after kill",
            check(&state_dir, &ledger, Some(worker), true),
        );
        if !violations.is_empty() {
            break;
        }
        if k % 20 == 0 {
            let l = ledger.lock().unwrap();
            eprintln!(
                "{k} kills in {:?}: {} ADDs and {} DELs answered, {} calls failed",
                start.elapsed(),
                l.adds_ok,
                l.dels_ok,
                l.failed
            );
        }
    }
    let killing = start.elapsed();
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.join().expect("a client panicked");
    }
    assert!(
        violations.is_empty(),
        "seed {seed}: {} violations, first ones:\n{}\n(logs in {})",
        violations.len(),
        violations
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n"),
        rig.where_to_look()
    );

    // The runtime deletes every pod whose last call failed, until the agent answers.
    let unsure: Vec<(String, Ipv4Addr)> = ledger
        .lock()
        .unwrap()
        .pods
        .iter()
        .filter(|(_, p)| p.want == Want::Either)
        .map(|(u, p)| (u.clone(), p.ip))
        .collect();
    for (uid, ip) in &unsure {
        wait_for(&format!("the agent to answer the DEL of {uid}"), T, || {
            matches!(plugin(&socket, "DEL", uid, *ip), Answer::Ok).then_some(())
        });
        ledger
            .lock()
            .unwrap()
            .pods
            .get_mut(uid)
            .expect("a known pod")
            .want = Want::Absent;
    }
    // The last kill took a whole generation: its successor's reload left no temp file.
    let (last, _) = check(&state_dir, &ledger, Some(worker), true);
    assert!(
        last.is_empty(),
        "seed {seed}: at the end:\n{}",
        last.join("\n")
    );
    let records = pod_records(&state_dir);
    assert!(
        records.keys().all(|n| temp_pid(n).is_none()),
        "temp files left with no write in flight: {:?}",
        records.keys()
    );

    // The owner's snapshot agrees with its records: CHECK finds every recorded pod, and
    // none of the last deleted ones.
    let pods = ledger.lock().unwrap().pods.clone();
    let present: Vec<_> = pods
        .iter()
        .filter(|(_, p)| p.want == Want::Present)
        .collect();
    assert_eq!(
        records.len(),
        present.len(),
        "records {:?} against the pods whose ADD answered last",
        records.keys()
    );
    for (uid, p) in &present {
        if let Answer::Failed(e) = plugin(&socket, "CHECK", uid, p.ip) {
            panic!("seed {seed}: CHECK of live pod {uid}: {e}");
        }
    }
    for (uid, p) in pods
        .iter()
        .filter(|(_, p)| p.want == Want::Absent)
        .rev()
        .take(50)
    {
        match plugin(&socket, "CHECK", uid, p.ip) {
            Answer::Failed(e) => assert!(
                e.contains("is not known to the agent"),
                "seed {seed}: CHECK of deleted {uid}: {e}"
            ),
            _ => panic!(
                "seed {seed}: phantom pod {uid}: CHECK found it in the owner's snapshot after its DEL"
            ),
        }
    }
    let l = ledger.lock().unwrap();
    eprintln!(
        "{kills} kills ({generations} of a whole generation) in {killing:?}: {} ADDs and {} DELs answered, {} calls failed, {} pods at the end, at most {leftover_max} temp files of a killed worker found right after a kill; seed {seed}",
        l.adds_ok,
        l.dels_ok,
        l.failed,
        present.len()
    );
    assert!(
        l.adds_ok > kills as u64 / 2,
        "only {} ADDs answered success over {kills} kills: the kills hit too little traffic",
        l.adds_ok
    );
    for f in &l.failures {
        eprintln!("a failed call: {f}");
    }
    drop(l);
    rig.pass();
}
