//! Process-level rows of the fault matrix (`reliability-security.md`, section 5): a
//! stopped owner (row 3), restarts every 250 ms under load (row 21), a supervisor that
//! dies alone (row 22) and a start under `umask 000` (row 23). One test per row; each
//! names the row and the invariant it checks.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::net::IpAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, EnvoyPods, NodeRig, envoy_or_skip};
use aether_e2e::harness::churn::{self, Churn, Cni, Pods};
use aether_e2e::harness::load::{self, Load};
use aether_e2e::testing::{
    Agent, LocalNode, accepts, bin, flock_holders, http_get_unix, is_dead, is_root, pod_records,
    processes_with_open, quarantined, wait_for,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const T: Duration = Duration::from_secs(10);

fn signal(pid: i32, sig: Signal) {
    kill(Pid::from_raw(pid), sig).unwrap_or_else(|e| panic!("{sig} to pid {pid}: {e}"));
}

/// The state letter of `/proc/<pid>/stat` (R, S, T, Z, ...), None once the pid is gone.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Stops a generation's supervisor and worker (SIGSTOP) and waits until both are stopped;
/// returns their pids.
fn stop_generation(agent: &Agent, what: &str) -> (i32, i32) {
    let (sup, worker) = (agent.pid(), agent.worker_pid());
    signal(sup, Signal::SIGSTOP);
    signal(worker, Signal::SIGSTOP);
    wait_for(what, T, || {
        (proc_state(sup) == Some('T') && proc_state(worker) == Some('T')).then_some(())
    });
    (sup, worker)
}

/// Every dial of a [`Dialer`] succeeded, and there were some.
fn assert_no_failed_dials(dials: &BTreeMap<String, u64>) {
    let bad: BTreeMap<&String, &u64> = dials.iter().filter(|(k, _)| !k.ends_with(" ok")).collect();
    assert!(
        bad.is_empty() && !dials.is_empty(),
        "connects that failed: {bad:?} (all: {dials:?})"
    );
}

/// A new agent, started once `draining` released the node lock, wins the lock at its start
/// (the generation `stopped` that waits for it is SIGSTOPped) and serves on the draining
/// owner's sockets, with no refused connect. Returns the new owner.
fn a_new_agent_takes_the_draining_owners_sockets(
    node: &mut LocalNode,
    draining: &mut Agent,
    stopped: (i32, i32),
    dialer: Dialer,
    inodes: (Option<u64>, Option<u64>),
) -> Agent {
    let next = node.start_agent();
    let ready = aether_e2e::testing::try_wait_for("the new agent to serve as owner", T, || {
        next.serving_owner()
    })
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n{}\nthe draining owner's log:\n{}",
            next.log(),
            draining.log()
        )
    });
    assert!(draining.wait_exit(T).success(), "{}", draining.log());
    let dials = dialer.stop();
    signal(stopped.1, Signal::SIGKILL);
    signal(stopped.0, Signal::SIGKILL);

    assert!(
        next.log().contains("uncontended=true"),
        "the new agent did not win the lock at its start:\n{}",
        next.log()
    );
    assert_eq!(
        ready["takeover"]["handed_off"],
        true,
        "the new owner bound fresh sockets:\n{}",
        next.log()
    );
    assert_eq!(node.socket_inodes(), inodes, "a node socket was replaced");
    assert_no_failed_dials(&dials);
    eprintln!("dials {dials:?}");
    next
}

/// A standby that holds the owner's sockets (fetched over `handoff.sock`).
fn standby_holding_the_sockets(node: &mut LocalNode) -> Agent {
    let standby = node.start_agent();
    standby.wait_role("standby", T);
    standby.wait_log("holding the owner's node sockets", T);
    standby
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// Fault matrix row 3: the owner generation (its supervisor and its worker) is stopped
/// with SIGSTOP for 10 s while a standby waits, its lock still held. Invariant: no two
/// owners and no write by the standby. The standby stays a standby throughout (every
/// `/ready` says so), binds nothing and writes nothing in the run folder or the state
/// folder and its subfolders (inotify; the stopped owner cannot write, so any event is
/// the standby's). The standby's own health socket is in its own `--health-dir`, not in
/// either folder, so nothing is excluded. Once the stopped owner is killed, the standby
/// takes the node over; the test prints how long that took.
#[test]
fn a_stopped_owner_keeps_the_standby_waiting_and_writing_nothing_until_it_is_killed() {
    use nix::sys::inotify::{AddWatchFlags as F, InitFlags, Inotify};
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let standby = standby_holding_the_sockets(&mut node);
    let (sup, worker) = (owner.pid(), owner.worker_pid());
    let inodes = node.socket_inodes();

    let watch =
        Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify_init");
    let mask = F::IN_CREATE
        | F::IN_MODIFY
        | F::IN_MOVED_TO
        | F::IN_DELETE
        | F::IN_ATTRIB
        | F::IN_CLOSE_WRITE;
    let mut watched = BTreeMap::new();
    let mut dirs = vec![node.run_dir.clone(), node.state_dir.clone()];
    dirs.extend(
        std::fs::read_dir(&node.state_dir)
            .expect("state folder")
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.path()),
    );
    for dir in &dirs {
        let wd = watch
            .add_watch(dir, mask)
            .unwrap_or_else(|e| panic!("inotify watch on {}: {e}", dir.display()));
        watched.insert(wd, dir.clone());
    }
    assert!(
        dirs.contains(&node.state_dir.join("pods")),
        "the pods folder is watched too: {dirs:?}"
    );
    let events = |what: &str| -> Vec<String> {
        match watch.read_events() {
            Ok(ev) => ev
                .iter()
                .map(|e| {
                    format!(
                        "{:?} {}/{}",
                        e.mask,
                        watched[&e.wd].display(),
                        e.name
                            .as_ref()
                            .map(|n| n.to_string_lossy())
                            .unwrap_or_default()
                    )
                })
                .collect(),
            Err(nix::errno::Errno::EAGAIN) => Vec::new(),
            Err(e) => panic!("{what}: reading inotify events: {e}"),
        }
    };

    stop_generation(&owner, "both owner processes stopped");
    // What was queued before both stopped may be the owner's own (its heartbeat file).
    let before = events("before the stop");
    let stopped = Instant::now();
    let mut answers = 0;
    let mut seen = Vec::new();
    // Hold the owner stopped for 10 s, asking the standby its role all along.
    while stopped.elapsed() < Duration::from_secs(10) {
        let (status, v) = standby
            .ready()
            .unwrap_or_else(|| panic!("the standby's /ready did not answer:\n{}", standby.log()));
        assert_eq!(
            (status, v["role"].as_str()),
            (200, Some("standby")),
            "the standby changed role while the owner was stopped: {v}"
        );
        answers += 1;
        seen.extend(events("while the owner was stopped"));
        std::thread::sleep(Duration::from_millis(100));
    }
    seen.extend(events("while the owner was stopped"));
    assert!(
        seen.is_empty(),
        "the standby wrote to the node while the owner was stopped: {seen:#?}\n{}",
        standby.log()
    );
    assert_eq!(
        node.socket_inodes(),
        inodes,
        "a node socket was replaced while the owner was stopped"
    );
    assert_eq!(
        proc_state(sup),
        Some('T'),
        "the owner's supervisor stayed stopped"
    );
    assert!(
        !standby.log().contains("node lock acquired"),
        "the standby took the lock from a stopped owner:\n{}",
        standby.log()
    );

    let killed = Instant::now();
    signal(worker, Signal::SIGKILL);
    signal(sup, Signal::SIGKILL);
    let (mut locked, mut serving) = (None, None);
    wait_for("the standby to serve as owner after the kill", T, || {
        if locked.is_none() && standby.log().contains("node lock acquired") {
            locked = Some(killed.elapsed());
        }
        serving = standby.serving_owner().map(|v| (killed.elapsed(), v));
        serving.as_ref().map(|_| ())
    });
    let (took, ready) = serving.expect("serving");
    owner.wait_exit(T);
    assert!(
        accepts(&node.xds_sock()) && accepts(&node.cni_sock()),
        "the new owner accepts on both node sockets"
    );
    eprintln!(
        "row 3: owner stopped 10 s: {answers} /ready answers all standby, 0 inotify events on {} folders ({} queued before the stop, discarded); after SIGKILL: lock acquired in {}, serving owner in {} (handed_off {})",
        dirs.len(),
        before.len(),
        locked.map(ms).unwrap_or_else(|| "?".into()),
        ms(took),
        ready["takeover"]["handed_off"]
    );
}

/// Fault matrix row 22: the supervisor alone is SIGKILLed, not its worker. Invariant: no
/// generation is left without a supervisor, no two owners, no failed request. The worker
/// dies with it (PR_SET_PDEATHSIG), the lock goes with both, the standby takes over and
/// holds the lock alone, and Envoy, connected all along, is served again while the load
/// through it fails no request. Prints the time to the new owner.
#[test]
fn a_supervisor_killed_alone_takes_its_worker_and_the_standby_takes_over() {
    let test = "a_supervisor_killed_alone_takes_its_worker_and_the_standby_takes_over";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    let base = rig.stats(&[envoy::CONNECT_FAIL]);
    let load = Load::start(rig.outbound, vec![NodeRig::SERVICE.to_string()], 100);
    let standby = rig.start_agent();
    standby.wait_role("standby", T);
    standby.wait_log("holding the owner's node sockets", T);
    let (sup, worker) = (rig.owner.pid(), rig.owner.worker_pid());
    let lock = rig.node.run_dir.join("agent.lock");
    wait_for("20 requests through Envoy before the kill", T, || {
        (load.requests() >= 20).then_some(())
    });
    let quiet = Instant::now();

    let killed = Instant::now();
    signal(sup, Signal::SIGKILL);
    let mut old = std::mem::replace(&mut rig.owner, standby);
    old.wait_exit(T);
    wait_for(
        &format!("worker {worker} to die with its supervisor"),
        T,
        || is_dead(worker).then_some(()),
    );
    let worker_gone = killed.elapsed();
    let ready = wait_for("the standby to serve as owner", T, || {
        rig.owner.serving_owner()
    });
    let took = killed.elapsed();
    let (new_sup, new_worker) = (
        rig.owner.pid(),
        ready["pid"].as_i64().expect("worker pid in /ready") as i32,
    );
    assert_ne!(new_worker, worker);

    // Nothing of the killed generation holds the lock, or has the file open at all.
    let mine: BTreeSet<i32> = [new_sup, new_worker].into();
    let holders = flock_holders(&lock);
    assert!(
        !holders.is_empty() && holders.iter().all(|p| mine.contains(p)),
        "the node lock's holders {holders:?} are not the new owner's processes {mine:?}"
    );
    let open: BTreeSet<i32> = processes_with_open(&lock).into_iter().collect();
    assert!(
        open.contains(&new_sup),
        "the new owner's supervisor has {} open (open by {open:?})",
        lock.display()
    );
    assert!(
        open.is_subset(&mine),
        "{} is open in {open:?}, beyond the new owner's {mine:?}",
        lock.display()
    );
    assert!(
        is_dead(worker) && is_dead(sup),
        "a process of the killed generation is still alive"
    );

    let times = rig.wait_reconnected(quiet, "after the supervisor's kill");
    let now = rig.stats(&[envoy::CONNECTED, envoy::CONNECT_FAIL]);
    assert_eq!(
        now[envoy::CONNECTED],
        1,
        "Envoy is connected again\n{}",
        rig.where_to_look()
    );
    assert_eq!(
        now[envoy::CONNECT_FAIL],
        base[envoy::CONNECT_FAIL],
        "a connect to xds.sock was refused\n{}",
        rig.where_to_look()
    );
    let sent = load.requests();
    wait_for(
        "20 more requests through Envoy after the takeover",
        T,
        || (load.requests() >= sent + 20).then_some(()),
    );
    load::request(rig.outbound, NodeRig::SERVICE)
        .expect("a request through Envoy after the takeover");
    let (requests, failures) = stop_load(load);
    assert_eq!(
        failures,
        0,
        "{failures} of {requests} requests through Envoy failed\n{}",
        rig.where_to_look()
    );
    assert_eq!(
        ready["takeover"]["handed_off"],
        true,
        "the takeover used the held sockets:\n{}",
        rig.owner.log()
    );
    eprintln!(
        "row 22: supervisor SIGKILLed alone: its worker gone {} later ({}), new owner serving {} after the kill; {}; lock held by {holders:?} only; {requests} requests through Envoy, 0 failed, refused connects 0",
        ms(worker_gone),
        if proc_state(worker).is_some() {
            "a zombie not reaped yet"
        } else {
            "reaped"
        },
        ms(took),
        times.summary()
    );
    rig.pass();
}

/// Stops the load; (requests, failures), with the failures printed.
fn stop_load(load: Load) -> (u64, u64) {
    let c = load.stop();
    let (requests, failures) = (
        c.requests.load(Ordering::Relaxed),
        c.failures.load(Ordering::Relaxed),
    );
    for (_, host, what) in c.failure_log.lock().unwrap().iter() {
        eprintln!("failed request to {host}: {what}");
    }
    assert!(requests > 0, "the load sent no request");
    (requests, failures)
}

/// Dials each path in a loop (connect, then close) and counts how each connect ended.
struct Dialer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<BTreeMap<String, u64>>>,
}

impl Dialer {
    fn start(paths: Vec<PathBuf>) -> Dialer {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut counts = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                for p in &paths {
                    let name = p
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned();
                    let how = match UnixStream::connect(p) {
                        Ok(_) => "ok".to_string(),
                        Err(e) if e.kind() == ErrorKind::ConnectionRefused => "refused".into(),
                        Err(e) if e.kind() == ErrorKind::NotFound => "enoent".into(),
                        Err(e) => format!("{e}"),
                    };
                    *counts.entry(format!("{name} {how}")).or_insert(0) += 1;
                }
                // Pacing (about 250 dials a second per socket), not synchronisation.
                std::thread::sleep(Duration::from_millis(4));
            }
            counts
        });
        Dialer {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> BTreeMap<String, u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("dialer thread")
    }
}

/// One `/ready` answer that said serving owner: asked at `sent`, answered by `got`.
struct Seen {
    sent: Instant,
    got: Instant,
}

/// Asks every registered agent's `/ready` in a loop and keeps when each said it was the
/// serving owner.
struct OwnerWatch {
    agents: Arc<Mutex<Vec<(String, PathBuf)>>>,
    stop: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    thread: Option<JoinHandle<BTreeMap<String, Vec<Seen>>>>,
}

impl OwnerWatch {
    fn start() -> OwnerWatch {
        let agents: Arc<Mutex<Vec<(String, PathBuf)>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let rounds = Arc::new(AtomicU64::new(0));
        let (a, s, r) = (agents.clone(), stop.clone(), rounds.clone());
        let thread = std::thread::spawn(move || {
            let mut seen: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                let list = a.lock().unwrap().clone();
                for (name, sock) in list {
                    let sent = Instant::now();
                    let Ok((200, body)) = http_get_unix(&sock, "/ready") else {
                        continue;
                    };
                    let got = Instant::now();
                    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    if v["role"] == "owner" && v["phase"] == "serving" {
                        seen.entry(name).or_default().push(Seen { sent, got });
                    }
                }
                r.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(2));
            }
            seen
        });
        OwnerWatch {
            agents,
            stop,
            rounds,
            thread: Some(thread),
        }
    }

    fn add(&self, agent: &Agent) {
        self.agents
            .lock()
            .unwrap()
            .push((agent.name.clone(), agent.health_sock.clone()));
    }

    /// Stops; each agent's span of certain service: from the first answer saying serving
    /// owner to the last question that got one (phases only move forward, so the agent
    /// served throughout).
    fn stop(mut self) -> (BTreeMap<String, (Instant, Instant)>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let seen = self
            .thread
            .take()
            .expect("running")
            .join()
            .expect("owner watch thread");
        let spans = seen
            .into_iter()
            .map(|(name, s)| {
                let first = s.iter().map(|x| x.got).min().expect("one answer");
                let last = s.iter().map(|x| x.sent).max().expect("one answer");
                (name, (first, last))
            })
            .collect();
        (spans, self.rounds.load(Ordering::Relaxed))
    }
}

/// Fault matrix row 21: supervisor generations restarted every 250 ms, 20 times, as a
/// shell loop would (`start next; sleep 0.25; kill -TERM previous`), with a real Envoy on
/// `xds.sock`, requests through it, and CNI ADDs and DELs through the real plugin all
/// along. Invariants: never two owners at once (every live agent's `/ready` polled: no
/// two spans of certain service overlap), no refused connect on `xds.sock` or `cni.sock`
/// (a dialer in a loop; Envoy's own connect failures), no failed request through Envoy, no
/// lost or phantom pod (the final records and Envoy's view are exactly the pods whose
/// ADD succeeded and that were not DELed), no crash (every generation exits 0 on its
/// SIGTERM, no worker respawn), and the node converges on one serving owner whose
/// endpoints Envoy holds.
#[test]
fn restarts_every_250_ms_under_load_converge_with_one_owner_and_no_lost_pod() {
    let test = "restarts_every_250_ms_under_load_converge_with_one_owner_and_no_lost_pod";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    let base = rig.stats(&[envoy::CONNECT_FAIL]);
    let load = Load::start(rig.outbound, vec![NodeRig::SERVICE.to_string()], 100);
    let cni = Arc::new(Cni {
        bin: bin("aether-cni"),
        socket: rig.node.cni_sock(),
    });
    let pods = Arc::new(Mutex::new(Pods::default()));
    let churn = Churn::start(cni.clone(), pods.clone(), true);
    let dialer = Dialer::start(vec![rig.node.xds_sock(), rig.node.cni_sock()]);
    let watch = OwnerWatch::start();
    watch.add(&rig.owner);

    let mut old: Vec<Agent> = Vec::new();
    let started = Instant::now();
    for _ in 0..20 {
        let tick = Instant::now();
        let next = rig.start_agent();
        watch.add(&next);
        // The fault itself: the next restart comes 250 ms after this one.
        std::thread::sleep(Duration::from_millis(250).saturating_sub(tick.elapsed()));
        rig.owner.signal(Signal::SIGTERM);
        old.push(std::mem::replace(&mut rig.owner, next));
    }
    let restarts = started.elapsed();
    let last = &rig.owner;
    let ready = wait_for(
        &format!("the last generation {} to serve as owner", last.name),
        Duration::from_secs(30),
        || last.serving_owner(),
    );
    let converged = started.elapsed();
    for a in &mut old {
        let status = a.wait_exit_timeout(T).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            status.success(),
            "{} exited with {status} after its SIGTERM:\n{}",
            a.name,
            a.log()
        );
    }
    // A last stretch of churn and load on the final owner.
    let (adds0, tail) = (pods.lock().unwrap().adds_ok, Instant::now());
    wait_for("CNI ADDs and requests after convergence", T, || {
        (pods.lock().unwrap().adds_ok >= adds0 + 5
            && load.requests() >= 20
            && tail.elapsed() >= Duration::from_millis(300))
        .then_some(())
    });
    let (adds, dels) = churn.stop();
    let left = churn::settle(&cni, &pods, T);
    let dials = dialer.stop();
    let (spans, rounds) = watch.stop();
    let (requests, failures) = stop_load(load);

    // Never two owners.
    let names: Vec<&String> = spans.keys().collect();
    for (i, a) in names.iter().enumerate() {
        for b in &names[i + 1..] {
            let (sa, sb) = (spans[*a], spans[*b]);
            assert!(
                sa.0.max(sb.0) >= sa.1.min(sb.1),
                "{a} and {b} were both serving owners at once\n{}",
                rig.where_to_look()
            );
        }
    }
    assert!(
        spans.contains_key(&rig.owner.name),
        "the watch saw the final owner serve ({} rounds)",
        rounds
    );
    // The lock is the final owner's alone: its supervisor or its worker holds it.
    let holders = flock_holders(&rig.node.run_dir.join("agent.lock"));
    let mine = [
        rig.owner.pid(),
        ready["pid"].as_i64().unwrap_or_default() as i32,
    ];
    assert!(
        !holders.is_empty() && holders.iter().all(|p| mine.contains(p)),
        "the node lock is held by {holders:?}, not by the final owner {mine:?}"
    );
    // No refused connect.
    let bad: BTreeMap<&String, &u64> = dials.iter().filter(|(k, _)| !k.ends_with(" ok")).collect();
    assert!(
        bad.is_empty(),
        "connects that failed: {bad:?} (all: {dials:?})\n{}",
        rig.where_to_look()
    );
    let now = rig.stats(&[envoy::CONNECTED, envoy::CONNECT_FAIL]);
    assert_eq!(
        now[envoy::CONNECT_FAIL],
        base[envoy::CONNECT_FAIL],
        "Envoy's connect to xds.sock failed\n{}",
        rig.where_to_look()
    );
    assert_eq!(
        now[envoy::CONNECTED],
        1,
        "Envoy is connected to the final owner"
    );
    assert_eq!(
        failures,
        0,
        "{failures} of {requests} requests through Envoy failed\n{}",
        rig.where_to_look()
    );
    // No crash loop.
    for a in old.iter().chain([&rig.owner]) {
        assert!(
            !a.log().contains("respawning"),
            "{} respawned a worker:\n{}",
            a.name,
            a.log()
        );
    }
    // No lost pod, no phantom pod: records and Envoy's view.
    assert_eq!(
        left,
        0,
        "DELs still failing after {T:?}: {:?}",
        pods.lock().unwrap().errors
    );
    let p = pods.lock().unwrap();
    let live: BTreeMap<String, IpAddr> = p
        .live
        .iter()
        .map(|(id, ip)| (id.uid.clone(), IpAddr::V4(*ip)))
        .collect();
    let records: BTreeSet<String> = pod_records(&rig.node.state_dir)
        .into_iter()
        .map(|(name, rec)| {
            rec.map(|pod| pod.uid)
                .unwrap_or_else(|e| panic!("record {name}: {e}"))
        })
        .collect();
    let want: BTreeSet<String> = live.keys().cloned().collect();
    assert_eq!(
        records,
        want,
        "the final records are not the pods ADDed and not DELed\n{}",
        rig.where_to_look()
    );
    let expected = EnvoyPods::expected(live.iter());
    if let Err(seen) = EnvoyPods::wait_until(&rig.envoy, &expected, T) {
        panic!(
            "Envoy's pods are not the live ones: {}\n{}",
            seen.diff(&expected),
            rig.where_to_look()
        );
    }
    // Envoy's endpoints of the rig's service come from the final owner.
    let cluster = format!("outbound|80||{}.default", NodeRig::SERVICE);
    let (_, dump) = rig
        .envoy
        .get(&envoy::ack_log::eds_query(&cluster))
        .expect("Envoy's config dump");
    let eps = envoy::ack_log::endpoints_of(
        &serde_json::from_str(&dump).expect("config dump JSON"),
        &cluster,
    )
    .unwrap_or_default();
    let addrs: BTreeSet<String> = eps
        .iter()
        .map(|e| e.split(' ').next().unwrap_or_default().to_string())
        .collect();
    let want_eps: BTreeSet<String> = rig.upstreams.iter().map(|u| u.addr.to_string()).collect();
    assert_eq!(
        addrs,
        want_eps,
        "Envoy's endpoints of {cluster}: {eps:?}\n{}",
        rig.where_to_look()
    );
    let total = p.adds_ok + p.adds_failed;
    let owners = spans.len();
    // Generations that won the lock at their start while the one before still drained.
    let raced = old
        .iter()
        .chain([&rig.owner])
        .skip(1)
        .filter(|a| a.log().contains("waited_ms=0 uncontended=true"))
        .count();
    eprintln!(
        "row 21: 20 restarts in {} (every 250 ms), the last generation serving {} after the first start (generation {}, handed_off {}); {owners} generations seen serving, none at once ({rounds} watch rounds), {raced} of them won the lock at their start; CNI: {adds} ADDs and {dels} DELs by the churn, {}/{total} ADDs answered success ({:.1} %), {} pods live, all in records and in Envoy; dials {dials:?}; {requests} requests through Envoy, 0 failed",
        ms(restarts),
        ms(converged),
        ready["generation"],
        ready["takeover"]["handed_off"],
        p.adds_ok,
        100.0 * p.adds_ok as f64 / total.max(1) as f64,
        live.len()
    );
    drop(p);
    rig.pass();
}

/// Fault matrix row 21, the race its restarts found: with restarts this close, a new
/// supervisor can win the node lock at its start, ahead of the standby blocked on it
/// (flock grants no order), while the previous owner still drains. Holding no sockets,
/// it must take the draining owner's over `handoff.sock` rather than wait for every
/// holder of the old listeners to exit and bind fresh ones, which refuses connects
/// meanwhile. Invariant: no refused connect. The standby is kept from the lock with
/// SIGSTOP, so the new supervisor wins every time.
#[test]
fn a_new_agent_that_wins_the_lock_while_the_owner_drains_takes_its_sockets() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    // A standby that fetched the sockets makes the owner's drain wait for a successor.
    let standby = standby_holding_the_sockets(&mut node);
    let stopped = stop_generation(&standby, "the standby stopped");
    let inodes = node.socket_inodes();
    let dialer = Dialer::start(vec![node.xds_sock(), node.cni_sock()]);

    owner.signal(Signal::SIGTERM);
    owner.wait_log("node lock released", T);
    let next = a_new_agent_takes_the_draining_owners_sockets(
        &mut node, &mut owner, stopped, dialer, inodes,
    );
    // From the draining owner's handoff.sock: at its start, or when it took the node.
    let log = next.log();
    assert!(
        log.contains("holding the owner's node sockets")
            || log.contains("taking the node sockets from the draining owner"),
        "{log}"
    );
    eprintln!(
        "row 21 race: the new agent won the lock while the owner drained and took its sockets"
    );
}

/// Fault matrix row 21, the same race one step on: a standby that fetched the sockets
/// from one owner still holds them, and waits on the lock, when the next owner, which
/// took them handed off, drains before any standby fetched from it. That owner counts
/// the standby as a successor all the same (a takeover with handed-off sockets makes one
/// for 5 s), so it keeps offering the sockets after its release, and a new agent that
/// wins the lock takes them instead of waiting, forever here, for the stopped standby to
/// let its copies go. Invariant: no refused connect, and the node is served.
#[test]
fn a_new_agent_that_wins_the_lock_from_a_short_lived_owner_takes_its_sockets() {
    let mut node = LocalNode::new();
    let mut first = node.start_agent();
    first.wait_role("owner", T);
    let mut second = standby_holding_the_sockets(&mut node);
    let stale = standby_holding_the_sockets(&mut node);
    let stopped = stop_generation(&stale, "the stale standby stopped");
    let inodes = node.socket_inodes();
    let dialer = Dialer::start(vec![node.xds_sock(), node.cni_sock()]);

    first.signal(Signal::SIGTERM);
    let ready = wait_for("the second agent to serve as owner", T, || {
        second.serving_owner()
    });
    assert_eq!(ready["takeover"]["handed_off"], true, "{}", second.log());
    assert!(first.wait_exit(T).success(), "{}", first.log());
    // At once: no standby fetched from the second owner (the only other one is stopped).
    second.signal(Signal::SIGTERM);
    second.wait_log("node lock released", T);
    a_new_agent_takes_the_draining_owners_sockets(&mut node, &mut second, stopped, dialer, inodes);
    assert!(
        second.log().contains("successor=true"),
        "the short-lived owner did not wait for a successor:\n{}",
        second.log()
    );
    eprintln!(
        "row 21 race, one step on: the new agent won the lock from a short-lived owner and took its sockets"
    );
}

/// Fault matrix rows 21 and 22, the race once more with a kill: the owner generation dies
/// (SIGKILL) while a standby holds its sockets, and a new agent wins the lock at its
/// start, ahead of that standby (kept from it with SIGSTOP, then resumed). Nobody offers
/// the sockets any more, so the new owner waits for every copy of them to close, while
/// the standby, holding copies, waits for the lock: before the fix neither ever served.
/// Invariant: the node converges on one serving owner. The standby closes its copies once
/// no owner has offered them for a second, and the new agent binds fresh sockets (a crash
/// with no standby to hand over, so connects may be refused meanwhile).
#[test]
fn a_standby_holding_a_killed_owners_sockets_does_not_keep_the_new_owner_waiting() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let standby = standby_holding_the_sockets(&mut node);
    let (sup, worker) = stop_generation(&standby, "the standby stopped");
    owner.kill_generation();
    let next = node.start_agent();
    next.wait_log("a server without the node lock still answers", T);
    signal(sup, Signal::SIGCONT);
    signal(worker, Signal::SIGCONT);
    let resumed = Instant::now();
    let ready = aether_e2e::testing::try_wait_for("the new agent to serve as owner", T, || {
        next.serving_owner()
    })
    .unwrap_or_else(|e| panic!("{e}\n{}\nthe standby's log:\n{}", next.log(), standby.log()));
    let took = resumed.elapsed();
    assert!(
        next.log().contains("uncontended=true"),
        "the new agent did not win the lock at its start:\n{}",
        next.log()
    );
    assert_eq!(ready["takeover"]["handed_off"], false, "{}", next.log());
    assert!(
        standby.log().contains("closing the ones held"),
        "{}",
        standby.log()
    );
    let (status, v) = standby.ready().expect("the standby's /ready");
    assert_eq!((status, v["role"].as_str()), (200, Some("standby")), "{v}");
    // And it holds the new owner's sockets next.
    wait_for("the standby to fetch the new owner's sockets", T, || {
        (standby
            .log()
            .matches("holding the owner's node sockets")
            .count()
            >= 2)
            .then_some(())
    });
    assert!(
        accepts(&node.xds_sock()) && accepts(&node.cni_sock()),
        "the new owner accepts on both node sockets"
    );
    eprintln!(
        "row 21/22 race with a kill: the new owner served {} after the standby resumed",
        ms(took)
    );
}

/// What the contract says a node path is: its kind, mode and owner.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
}

fn entry_of(path: &Path) -> Entry {
    let m =
        std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("lstat {}: {e}", path.display()));
    let t = m.file_type();
    let kind = if t.is_dir() {
        "dir"
    } else if t.is_socket() {
        "socket"
    } else if t.is_file() {
        "file"
    } else {
        "other"
    };
    Entry {
        kind,
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
    }
}

/// Every path below `dirs` (themselves included; a file is taken as it is), relative to `root`, with what it is;
/// the quarantine's contents are left out: they are records moved there as they were.
fn walk(root: &Path, dirs: &[PathBuf]) -> BTreeMap<String, Entry> {
    let mut out = BTreeMap::new();
    let mut todo: Vec<PathBuf> = dirs.to_vec();
    while let Some(p) = todo.pop() {
        let rel = p
            .strip_prefix(root)
            .expect("below the node folder")
            .to_string_lossy()
            .into_owned();
        // A writer's temporary file (`<name>.tmp.<pid>`) may be renamed between the
        // read_dir and the lstat: it was never a node path of its own. Any other path
        // that vanishes fails the test.
        if p.to_string_lossy().contains(".tmp.") && std::fs::symlink_metadata(&p).is_err() {
            continue;
        }
        let e = entry_of(&p);
        if e.kind == "dir" && !rel.ends_with("pods-quarantine") {
            todo.extend(
                std::fs::read_dir(&p)
                    .expect("read_dir")
                    .flatten()
                    .map(|d| d.path()),
            );
        }
        out.insert(rel, e);
    }
    out
}

/// The documented kind, mode and owner of a node path (SECURITY.md, "Paths the supervisor
/// writes" and "Socket modes and owners"; ARCHITECTURE.md for the worker's files), by its
/// path relative to the node folder; None for a path the contract does not name.
fn documented(rel: &str, me: (u32, u32), worker: (u32, u32)) -> Option<Entry> {
    let e = |kind, mode, (uid, gid): (u32, u32)| {
        Some(Entry {
            kind,
            mode,
            uid,
            gid,
        })
    };
    let name = rel.rsplit('/').next().unwrap_or(rel);
    match rel {
        "run" => e("dir", 0o755, me),
        "run/agent.lock" => e("file", 0o600, me),
        "run/xds.sock" => e("socket", 0o660, (me.0, worker.1)),
        // handoff-released.sock: the previous owner's handoff.sock, from a takeover until
        // the new owner's worker serves.
        "run/cni.sock" | "run/handoff.sock" | "run/handoff-released.sock" => e("socket", 0o600, me),
        "state" | "state/pods" | "state/pods-quarantine" => e("dir", 0o700, worker),
        "state/.aether-worker-state" => e("file", 0o400, me),
        "state/mesh-dns.json" | "state/mesh-dns.heartbeat" | "state/observed-upstreams.json" => {
            e("file", 0o600, worker)
        }
        // The runtime's conflist keeps the mode and owner it had (0644 root's, as made).
        "cni-conf/10-net.conflist" => e("file", 0o644, me),
        _ if rel.starts_with("health-gen") && !rel.contains('/') => e("dir", 0o700, worker),
        _ if rel.starts_with("health-gen") && name == "agent-health.sock" => {
            e("socket", 0o600, worker)
        }
        // Pod records and the worker's temp files (a write caught in progress).
        _ if rel.starts_with("state/pods/")
            && (name.ends_with(".json") || name.contains(".tmp.")) =>
        {
            e("file", 0o600, worker)
        }
        _ if rel.starts_with("state/")
            && !rel["state/".len()..].contains('/')
            && name.starts_with('.')
            && name.contains(".tmp.") =>
        {
            e("file", 0o600, worker)
        }
        _ => None,
    }
}

/// Paths every run must have made.
const REQUIRED: [&str; 14] = [
    "run",
    "run/agent.lock",
    "run/xds.sock",
    "run/cni.sock",
    "run/handoff.sock",
    "state",
    "state/.aether-worker-state",
    "state/pods",
    "state/pods-quarantine",
    "health-gen1",
    "health-gen2",
    "health-gen2/agent-health.sock",
    "cni-conf/10-net.conflist",
    "state/pods/umask-pod-uid.json",
];

/// Two generations on a fresh node, each started by `sh` under `umask <mask>`: an owner
/// that takes a pod's ADD and re-asserts the CNI conflist, then, after a corrupt record was
/// planted, the next owner, which quarantines it. Returns the node's paths and the umask
/// the shell ran the supervisor under.
fn node_paths_under_umask(mask: &str) -> (BTreeMap<String, Entry>, String) {
    let mut node = LocalNode::new();
    let root = node.root.path().to_path_buf();
    let conf = root.join("cni-conf");
    std::fs::create_dir(&conf).expect("cni conf folder");
    let conflist = conf.join("10-net.conflist");
    std::fs::write(
        &conflist,
        r#"{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[{"type":"bridge"}]}"#,
    )
    .expect("conflist");
    std::fs::set_permissions(&conflist, std::fs::Permissions::from_mode(0o644))
        .expect("chmod conflist");
    let seen_mask = root.join("umask-seen");
    let script = format!(
        "umask {mask}; umask > '{}'; exec \"$@\"",
        seen_mask.display()
    );
    let conf_flag = format!("--cni-conf-dir={}", conf.display());
    let wrapper = ["sh", "-c", script.as_str(), "sh"];

    let mut first = node.start_agent_wrapped(&wrapper, &[&conf_flag]);
    first.wait_role("owner", T);
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let pod = churn::PodId {
        uid: "umask-pod-uid".into(),
        name: "umask-pod".into(),
    };
    cni.call("ADD", &pod, Some(std::net::Ipv4Addr::new(10, 88, 0, 7)))
        .unwrap_or_else(|e| panic!("ADD under umask {mask}: {e}\n{}", first.log()));
    wait_for("the owner to add aether-cni to the conflist", T, || {
        std::fs::read_to_string(&conflist)
            .ok()
            .filter(|t| t.contains("aether-cni"))
            .map(|_| ())
    });
    first.signal(Signal::SIGTERM);
    assert!(first.wait_exit(T).success(), "{}", first.log());

    let bad = node.state_dir.join("pods").join("corrupt-uid.json");
    std::fs::write(&bad, b"{not json").expect("plant a corrupt record");
    let second = node.start_agent_wrapped(&wrapper, &[&conf_flag]);
    second.wait_role("owner", T);
    // The first owner's handoff.sock, moved aside as the second bound its own, goes once
    // the second's worker serves: walked before that, it may vanish under the walk.
    let released = root.join("run").join("handoff-released.sock");
    wait_for(
        "handoff-released.sock removed once the new owner serves",
        T,
        || (!released.exists()).then_some(()),
    );
    wait_for("the corrupt record quarantined", T, || {
        (!quarantined(&node.state_dir).is_empty()).then_some(())
    });
    // The conflist's folder is the test's; only the file is the agent's to keep as it was.
    let dirs: Vec<PathBuf> = [
        "run",
        "state",
        "health-gen1",
        "health-gen2",
        "cni-conf/10-net.conflist",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    let paths = walk(&root, &dirs);
    let mask_seen = std::fs::read_to_string(&seen_mask)
        .expect("the shell's umask")
        .trim()
        .to_string();
    drop(second);
    (paths, mask_seen)
}

/// Fault matrix row 23: the agent started under `umask 000`. Invariant: exact modes and
/// owners, whatever the umask. Every socket (`xds.sock`, `cni.sock`, `handoff.sock`, the
/// health socket), folder (run, state, health, `pods/`, the quarantine) and file (the lock,
/// the marker, a pod record, the worker's state files, the re-asserted conflist) has the
/// mode and owner SECURITY.md states, under `umask 000` as under `umask 022`; nothing
/// the contract does not name appears.
#[test]
fn under_umask_000_every_node_path_has_its_documented_mode_and_owner() {
    let me = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    // As root the worker runs as 65532; otherwise as the caller.
    let worker = if is_root() { (65532, 65532) } else { me };
    let (open, open_mask) = node_paths_under_umask("000");
    let (usual, usual_mask) = node_paths_under_umask("022");
    assert_eq!(
        (open_mask.as_str(), usual_mask.as_str()),
        ("0000", "0022"),
        "the shell's umask before the exec"
    );
    for (mask, paths) in [("000", &open), ("022", &usual)] {
        let mut wrong = Vec::new();
        for (rel, got) in paths {
            match documented(rel, me, worker) {
                Some(want) if want == *got => {}
                Some(want) => wrong.push(format!(
                    "{rel}: {} {:04o} {}:{}, documented {} {:04o} {}:{}",
                    got.kind, got.mode, got.uid, got.gid, want.kind, want.mode, want.uid, want.gid
                )),
                None => wrong.push(format!(
                    "{rel}: {} {:04o} {}:{}, not in the contract",
                    got.kind, got.mode, got.uid, got.gid
                )),
            }
        }
        let missing: Vec<&str> = REQUIRED
            .iter()
            .filter(|r| !paths.contains_key(**r))
            .copied()
            .collect();
        assert!(
            wrong.is_empty() && missing.is_empty(),
            "under umask {mask}: {wrong:#?}; missing {missing:?}"
        );
    }
    let required = |m: &BTreeMap<String, Entry>| -> BTreeMap<String, Entry> {
        REQUIRED
            .iter()
            .map(|r| (r.to_string(), m[*r].clone()))
            .collect()
    };
    assert_eq!(
        required(&open),
        required(&usual),
        "modes under umask 000 differ from umask 022"
    );
    eprintln!(
        "row 23: {} paths under umask 000 and {} under umask 022, all as documented:",
        open.len(),
        usual.len()
    );
    for (rel, e) in &open {
        eprintln!("  {:06} {:04o} {}:{} {rel}", e.kind, e.mode, e.uid, e.gid);
    }
}
