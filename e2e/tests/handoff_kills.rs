//! Fault matrix row 2 (issue 17): SIGKILL of the old owner, the standby taking over, or
//! both, at each step of a surge handoff, with a real Envoy on `xds.sock` and steady
//! load through it. The agents are built with the test-only fault hooks (feature
//! `fault-hooks`, `shared-proto/src/fault.rs`): started with `AETHER_FAULT_HOOK=<step>`, a
//! process stops itself (SIGSTOP) the first time it reaches that step, the test kills the
//! victims there and resumes the survivor. A second test checks that the release binaries
//! carry no hook.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, NodeRig, envoy_or_skip};
use aether_e2e::harness::load::Load;
use aether_e2e::testing::{
    Agent, accepts, bin_dir, flock_holders, is_dead, percentile, processes_with_open, wait_for,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const T: Duration = Duration::from_secs(10);
/// The hooks' environment variable, which only a binary built with them contains.
const MARKER: &str = "AETHER_FAULT_HOOK";
/// Requests per second through Envoy's outbound listener during the sweep.
const RPS: u32 = 50;
/// The log line the hook writes before it stops its process.
const HELD_LOG: &str = "holding the owner's node sockets";
/// Every takeover lands within this much plus five times the run's median takeover of
/// the kill: a case that waits for a drained owner to exit (its 2 s bound) stands out
/// even when load slows every case alike.
const TAKEOVER_SLACK: Duration = Duration::from_millis(500);

/// Which process a step stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stops {
    /// The owning supervisor, while it answers a standby on `handoff.sock`.
    OwnerSupervisor,
    /// The standby's supervisor.
    StandbySupervisor,
    /// The standby's worker, once its supervisor has sent it the node.
    StandbyWorker,
}

/// One step of the handoff, named as its hook call site names it.
struct Step {
    name: &'static str,
    /// The issue's name for it.
    issue: &'static str,
    stops: Stops,
    /// The step comes after the owner was told to hand over (SIGTERM): the lock passes.
    after_sigterm: bool,
    /// A third agent started while the process is stopped gets the node sockets over
    /// `handoff.sock`: the supervisor that serves it is not the stopped one.
    third_fetches: bool,
}

const STEPS: [Step; 6] = [
    // The owner's supervisor read the standby's hello and has not sent its offer.
    Step {
        name: "handoff-offer",
        issue: "before the offer",
        stops: Stops::OwnerSupervisor,
        after_sigterm: false,
        third_fetches: false,
    },
    // The standby's supervisor received the offer (the owner's listeners) and holds it.
    Step {
        name: "handoff-held",
        issue: "after the offer",
        stops: Stops::StandbySupervisor,
        after_sigterm: false,
        third_fetches: true,
    },
    // The standby's supervisor has the lock, the listeners, the generation and
    // handoff.sock, and has not sent Takeover.
    Step {
        name: "take-node",
        issue: "after bind",
        stops: Stops::StandbySupervisor,
        after_sigterm: true,
        third_fetches: false,
    },
    // The standby's worker received Takeover with its three descriptors, unchecked.
    Step {
        name: "takeover",
        issue: "mid-Takeover",
        stops: Stops::StandbyWorker,
        after_sigterm: true,
        third_fetches: true,
    },
    // The worker applied the storage diff and has not reported the reconcile done.
    Step {
        name: "reconcile",
        issue: "mid-reconcile",
        stops: Stops::StandbyWorker,
        after_sigterm: true,
        third_fetches: true,
    },
    // The worker is about to accept on both sockets and report Serving.
    Step {
        name: "serve",
        issue: "before Serving",
        stops: Stops::StandbyWorker,
        after_sigterm: true,
        third_fetches: true,
    },
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Victim {
    /// The generation that owned the node when the handoff began (supervisor and worker).
    Owner,
    /// The generation taking the node over.
    Standby,
    /// Both: a third agent, a warm standby started while the step held, takes the node.
    Both,
}

/// Who owns the node once the victims are dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Survivor {
    Owner,
    Standby,
    Third,
}

/// The state letter of `/proc/<pid>/stat` ('T' when stopped), None once gone.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
}

/// The children of `pid` (a supervisor's workers).
fn children(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        out.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    out
}

/// The number of open descriptors of `pid`.
fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
        .count()
}

/// The fewest descriptors `pid` shows over 10 looks 20 ms apart (a 200 ms window): a
/// health check or a probe in flight is not a leak.
fn settled_fd_count(pid: i32) -> usize {
    (0..10)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(20));
            fd_count(pid)
        })
        .min()
        .expect("ten samples")
}

/// SIGKILL of `pid` if it is still one of the agent's processes (its pid not reused).
fn kill_agent_process(pid: i32) {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if comm.starts_with("aether-") {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// SIGKILL of a generation whatever state it is in (a stopped worker answers no `/ready`,
/// so [`Agent::kill_generation`] cannot find it): its workers, then its supervisor.
fn kill_generation(agent: &mut Agent, known_worker: Option<i32>) {
    let sup = agent.pid();
    for w in children(sup).into_iter().chain(known_worker) {
        kill_agent_process(w);
    }
    kill_agent_process(sup);
    // A drained owner may have exited on its own just before.
    agent
        .wait_exit_timeout(T)
        .unwrap_or_else(|e| panic!("{e:#}"));
    if let Some(w) = known_worker {
        wait_for(&format!("{}'s worker {w} to die", agent.name), T, || {
            is_dead(w).then_some(())
        });
    }
}

/// Whether the file at `path` contains [`MARKER`]: `grep -aF`, as
/// `scripts/check-release-hooks.sh` searches, and fast where a byte scan in an
/// unoptimised test build is not.
fn has_marker(path: &Path) -> bool {
    let status = std::process::Command::new("grep")
        .args(["-qaF", MARKER])
        .arg(path)
        .status()
        .unwrap_or_else(|e| panic!("running grep on {}: {e}", path.display()));
    match status.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!("grep -qaF {MARKER} {} failed: {status}", path.display()),
    }
}

/// Starts the node's next agent with the rig's flags (its capture file among them), and
/// `hook` in its environment.
fn start(rig: &mut NodeRig, hook: Option<&str>) -> Agent {
    match hook {
        Some(step) => rig
            .node
            .start_agent_wrapped(&["env", &format!("AETHER_FAULT_HOOK={step}")], &[]),
        None => rig.node.start_agent_with(&[]),
    }
}

/// A surge roll from the rig's owner to `next` (SIGTERM), with Envoy reconnected to it.
fn roll_to(rig: &mut NodeRig, next: Agent, what: &str) {
    next.wait_role("standby", T);
    next.wait_log(HELD_LOG, T);
    let quiet = Instant::now();
    rig.owner.signal(Signal::SIGTERM);
    let mut old = std::mem::replace(&mut rig.owner, next);
    let status = old
        .wait_exit_timeout(T)
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert!(
        status.success(),
        "{what}: {} exited with {status} after SIGTERM:\n{}",
        old.name,
        old.log()
    );
    wait_for(&format!("{what}: {} to serve", rig.owner.name), T, || {
        rig.owner.serving_owner()
    });
    rig.wait_reconnected(quiet, what);
}

/// The supervisor's and the worker's descriptor counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fds {
    supervisor: usize,
    worker: usize,
}

fn fds_of(agent: &Agent) -> Fds {
    Fds {
        supervisor: settled_fd_count(agent.pid()),
        worker: settled_fd_count(agent.worker_pid()),
    }
}

/// Waits until `agent`'s counts are at most `bound`'s (a connection being closed may
/// linger a moment); the counts seen last either way.
fn fds_within(agent: &Agent, bound: Fds) -> Result<Fds, Fds> {
    let (sup, worker) = (agent.pid(), agent.worker_pid());
    let mut last = Fds {
        supervisor: fd_count(sup),
        worker: fd_count(worker),
    };
    aether_e2e::testing::try_wait_for("descriptor counts", T, || {
        last = Fds {
            supervisor: fd_count(sup),
            worker: fd_count(worker),
        };
        (last.supervisor <= bound.supervisor && last.worker <= bound.worker).then_some(())
    })
    .map(|()| last)
    .map_err(|_| last)
}

/// The agent that owns the node after a case.
fn survivor_of<'a>(
    survivor: Survivor,
    owner: &'a Agent,
    standby: &'a Agent,
    third: &'a Option<Agent>,
) -> &'a Agent {
    match survivor {
        Survivor::Owner => owner,
        Survivor::Standby => standby,
        Survivor::Third => third.as_ref().expect("a third agent"),
    }
}

/// What one case showed.
struct Report {
    took: Option<Duration>,
    takeover_total_us: Option<u64>,
    refused: u64,
    failed: u64,
    fds: Fds,
}

/// Fault matrix row 2. For each handoff step and each victim (owner, standby, both):
/// the hooked process stops at the step, the victims are SIGKILLed there and the
/// survivor resumes. Invariants after each case: exactly one generation owns the node
/// (one live agent, which `/ready` shows as the serving owner, holds the flock and is the
/// only one with the lock file open: no two owners), both node sockets accept, Envoy is
/// connected with its listeners and clusters (over a new stream whenever its owner died
/// or handed over), no request through Envoy failed, no connect to `xds.sock` was
/// refused whenever a live process held the listeners, the survivor's descriptor
/// counts do not exceed the first owner's (no orphaned fds: across the 18 cases the
/// node passes through a dozen generations, each killed one at a different step), and
/// every takeover serves within [`TAKEOVER_SLACK`] plus five times the run's median
/// takeover of the kill (no agent waits for a drained owner to exit).
///
/// "Both" means a third agent, a warm standby started while the step held, takes the
/// node; so does killing the standby after the owner was told to hand over (the owner
/// has released the node by then and only drains). Without a third agent the node
/// would wait for the next agent to bind fresh sockets.
#[test]
fn sigkill_at_each_handoff_step_leaves_one_owner_serving_envoy() {
    let test = "sigkill_at_each_handoff_step_leaves_one_owner_serving_envoy";
    let Some(envoy_bin) = envoy_or_skip(test) else {
        return;
    };
    let hooked: Vec<PathBuf> = ["aether-supervisor", "aether-worker"]
        .iter()
        .map(|b| bin_dir().join(b))
        .collect();
    if let Some(bare) = hooked.iter().find(|p| !p.exists() || !has_marker(p)) {
        eprintln!(
            "\n!!! SKIPPED {test}: {} is built without the fault hooks. Build the binaries with the tests \
             (`cargo build --workspace --bins --tests`, as scripts/test.sh does), or pass \
             `--features aether-supervisor/fault-hooks,aether-worker/fault-hooks` to cargo build. !!!\n",
            bare.display()
        );
        return;
    }
    let mut rig = NodeRig::start(&envoy_bin, AdsApi::default());
    let lock = rig.node.run_dir.join("agent.lock");
    let baseline = {
        // A standby fetched once, as before every case; then it goes.
        let mut warm = start(&mut rig, None);
        warm.wait_log(HELD_LOG, T);
        let fds = fds_of(&rig.owner);
        kill_generation(&mut warm, None);
        fds
    };
    eprintln!("first owner's descriptors: {baseline:?}");
    let load = Load::start(rig.outbound, vec![NodeRig::SERVICE.to_string()], RPS);
    let mut lines = Vec::new();
    let mut takeovers = Vec::new();
    for step in &STEPS {
        for victim in [Victim::Owner, Victim::Standby, Victim::Both] {
            let what = format!("{} ({}), SIGKILL of {victim:?}", step.name, step.issue);
            let r = run_case(&mut rig, step, victim, &load, &lock, baseline, &what);
            let line = format!(
                "{what}: takeover {} (the new owner's own total {}), refused connects {}, failed requests {}, fds {:?}",
                r.took
                    .map_or("none: the owner kept the node".into(), |d| format!(
                        "{:.1} ms after the kill",
                        d.as_secs_f64() * 1e3
                    )),
                r.takeover_total_us
                    .map_or("-".into(), |us| format!("{:.1} ms", us as f64 / 1e3)),
                r.refused,
                r.failed,
                r.fds
            );
            eprintln!("{line}");
            lines.push(line);
            takeovers.extend(r.took.map(|d| (what.clone(), d)));
            assert_eq!(
                r.failed,
                0,
                "{what}: requests through Envoy failed\n{}",
                rig.where_to_look()
            );
        }
    }
    let counters = load.stop();
    let (requests, failures) = (
        counters.requests.load(std::sync::atomic::Ordering::Relaxed),
        counters.failures.load(std::sync::atomic::Ordering::Relaxed),
    );
    eprintln!(
        "\nrow 2 sweep, {} cases:\n  {}\nload: {requests} requests, {failures} failed",
        lines.len(),
        lines.join("\n  ")
    );
    let median = percentile(&takeovers.iter().map(|(_, d)| *d).collect::<Vec<_>>(), 50.0)
        .expect("cases with a takeover");
    let bound = TAKEOVER_SLACK + median * 5;
    let slow: Vec<_> = takeovers.iter().filter(|(_, d)| *d > bound).collect();
    eprintln!(
        "takeovers: median {median:?}, bound {bound:?}, slowest {:?}",
        takeovers.iter().map(|(_, d)| *d).max()
    );
    assert!(
        slow.is_empty(),
        "takeovers slower than {bound:?} (500 ms + 5 × the run's median {median:?}): {slow:?}"
    );
    assert!(requests > 0, "the load sent no request");
    assert_eq!(
        failures,
        0,
        "requests through Envoy failed: {:?}",
        counters.failure_log.lock().unwrap()
    );
    rig.pass();
}

/// One case: the rig's owner serves and Envoy is connected to it; afterwards the
/// survivor is the rig's owner.
fn run_case(
    rig: &mut NodeRig,
    step: &Step,
    victim: Victim,
    load: &Load,
    lock: &Path,
    baseline: Fds,
    what: &str,
) -> Report {
    if step.stops == Stops::OwnerSupervisor {
        // The hook is read at start: roll the node to an owner started with it.
        let armed = start(rig, Some(step.name));
        roll_to(rig, armed, &format!("{what}: arming the owner"));
    }
    assert_eq!(
        rig.envoy.stat(envoy::CONNECTED),
        Some(1),
        "{what}: Envoy is not connected before the case"
    );
    let refused_before = rig.envoy.stat(envoy::CONNECT_FAIL).unwrap_or(0);
    let failed_before = load.failures();
    let (o_sup, o_worker) = (rig.owner.pid(), rig.owner.worker_pid());
    let generation = rig.owner.serving_owner().expect("the owner serves")["generation"].as_u64();
    let quiet = Instant::now();
    let mut b = start(
        rig,
        (step.stops != Stops::OwnerSupervisor).then_some(step.name),
    );
    let mut b_worker = None;
    if step.after_sigterm {
        b.wait_role("standby", T);
        b.wait_log(HELD_LOG, T);
        b_worker = Some(b.worker_pid());
        rig.owner.signal(Signal::SIGTERM);
    }
    let stopped = match step.stops {
        Stops::OwnerSupervisor => o_sup,
        Stops::StandbySupervisor => b.pid(),
        Stops::StandbyWorker => b_worker.expect("the standby's worker"),
    };
    wait_for(
        &format!("{what}: pid {stopped} to stop at the hook"),
        T,
        || (proc_state(stopped) == Some('T')).then_some(()),
    );
    let log = if step.stops == Stops::OwnerSupervisor {
        rig.owner.log()
    } else {
        b.log()
    };
    assert!(
        log.contains(&format!(
            "fault hook: stopping at {} (pid {stopped})",
            step.name
        )),
        "{what}: the hook did not say it stopped:\n{log}"
    );
    if !step.after_sigterm {
        // A warm standby: its worker answers even while its supervisor is stopped (the
        // supervisor spawns it before it first fetches).
        b.wait_role("standby", T);
        b_worker = Some(b.worker_pid());
    }
    // A warm standby where the victims leave no generation that can take the node.
    let mut third = None;
    if victim == Victim::Both || (victim == Victim::Standby && step.after_sigterm) {
        let c = start(rig, None);
        c.wait_role("standby", T);
        if step.third_fetches {
            c.wait_log(HELD_LOG, T);
        }
        third = Some(c);
    }

    let kill_at = Instant::now();
    if matches!(victim, Victim::Owner | Victim::Both) {
        kill_generation(&mut rig.owner, Some(o_worker));
    }
    if matches!(victim, Victim::Standby | Victim::Both) {
        kill_generation(&mut b, b_worker);
    }
    if !is_dead(stopped) {
        kill(Pid::from_raw(stopped), Signal::SIGCONT).expect("SIGCONT the survivor");
    }
    let survivor = match (victim, step.after_sigterm) {
        (Victim::Owner, _) => Survivor::Standby,
        (Victim::Standby, false) => Survivor::Owner,
        (Victim::Standby, true) | (Victim::Both, _) => Survivor::Third,
    };
    // Whether the new owner took the listeners it was handed (so none was ever closed).
    let held = match survivor {
        Survivor::Owner => true,
        Survivor::Standby => step.stops != Stops::OwnerSupervisor,
        // With the standby killed, the owner told to hand over still offers its sockets
        // until it exits (at handoff-released.sock once the standby bound handoff.sock).
        Survivor::Third => step.third_fetches || victim == Victim::Standby,
    };
    let new_owner = survivor_of(survivor, &rig.owner, &b, &third);
    let ready = wait_for(
        &format!("{what}: {} to serve as the one owner", new_owner.name),
        T,
        || new_owner.serving_owner(),
    );
    let took = (survivor != Survivor::Owner).then(|| kill_at.elapsed());
    if took.is_some_and(|d| d > TAKEOVER_SLACK) {
        eprintln!(
            "{what}: slow takeover ({took:?}); {}'s log:\n{}",
            new_owner.name,
            new_owner.log()
        );
    }
    let takeover_total_us = took.and_then(|_| ready["takeover"]["total_us"].as_u64());
    if survivor == Survivor::Owner {
        assert_eq!(
            ready["generation"].as_u64(),
            generation,
            "{what}: the owner's generation changed"
        );
    } else {
        assert_eq!(
            ready["takeover"]["handed_off"],
            held,
            "{what}: handed_off\n{}",
            new_owner.log()
        );
        assert!(
            ready["generation"].as_u64() > generation,
            "{what}: the new owner's generation {:?} is not past {generation:?}",
            ready["generation"]
        );
    }
    // An owner told to hand over and not killed exits on its own once released.
    if step.after_sigterm && victim == Victim::Standby {
        let status = rig
            .owner
            .wait_exit_timeout(T)
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert!(
            status.success(),
            "{what}: the drained owner exited with {status}:\n{}",
            rig.owner.log()
        );
    }
    let new_owner = survivor_of(survivor, &rig.owner, &b, &third);
    // The new owner is the one generation left: every other agent process is gone.
    let (sup, worker) = (new_owner.pid(), new_owner.worker_pid());
    for (name, pid) in [
        ("owner supervisor", o_sup),
        ("owner worker", o_worker),
        ("standby supervisor", b.pid()),
    ]
    .into_iter()
    .chain(b_worker.map(|w| ("standby worker", w)))
    {
        if pid != sup && pid != worker {
            wait_for(&format!("{what}: the {name} {pid} to be gone"), T, || {
                is_dead(pid).then_some(())
            });
        }
    }
    assert_eq!(
        flock_holders(lock),
        vec![sup],
        "{what}: the node lock's holders"
    );
    let open: BTreeSet<i32> = processes_with_open(lock).into_iter().collect();
    assert_eq!(
        open,
        BTreeSet::from([sup, worker]),
        "{what}: the processes with the lock file open"
    );
    assert!(
        accepts(&rig.node.xds_sock()),
        "{what}: xds.sock does not accept"
    );
    assert!(
        accepts(&rig.node.cni_sock()),
        "{what}: cni.sock does not accept"
    );

    // Envoy: a new stream whenever the old owner's went (killed or handed over).
    let owner_stream_ended = victim != Victim::Standby || step.after_sigterm;
    if owner_stream_ended {
        let times = rig.wait_reconnected(quiet, what);
        eprintln!("   {what}: Envoy {}", times.summary());
    } else {
        let (_, changes) = rig.poller.since(quiet);
        assert!(
            changes.iter().all(|s| s.connected),
            "{what}: Envoy lost the stream of the owner that kept the node: {changes:?}"
        );
    }
    wait_for(
        &format!(
            "{what}: Envoy connected with its listeners and the {} cluster",
            NodeRig::SERVICE
        ),
        T,
        || {
            (rig.envoy.stat(envoy::CONNECTED) == Some(1)).then_some(())?;
            let (_, body) = rig.envoy.get("/config_dump").ok()?;
            let dump: serde_json::Value = serde_json::from_str(&body).ok()?;
            let has_cluster = envoy::clusters(&dump)
                .0
                .iter()
                .any(|c| c.contains(NodeRig::SERVICE));
            (has_cluster && !envoy::listeners(&dump).0.is_empty()).then_some(())
        },
    );
    let refused = rig.envoy.stat(envoy::CONNECT_FAIL).unwrap_or(0) - refused_before;
    if held {
        assert_eq!(
            refused,
            0,
            "{what}: Envoy's connect to xds.sock was refused although a live process held the listener\n{}",
            rig.where_to_look()
        );
    }
    let fds = fds_within(new_owner, baseline).unwrap_or_else(|seen| {
        panic!("{what}: the owner's descriptors {seen:?} stay above the first owner's {baseline:?}: orphaned fds\n{}", rig.where_to_look())
    });
    let failed = load.failures() - failed_before;
    match survivor {
        Survivor::Owner => drop(b),
        Survivor::Standby => drop(std::mem::replace(&mut rig.owner, b)),
        Survivor::Third => drop(std::mem::replace(
            &mut rig.owner,
            third.expect("a third agent"),
        )),
    }
    Report {
        took,
        takeover_total_us,
        refused,
        failed,
        fds,
    }
}

/// The release binaries carry no fault hook: no executable in `target/release` contains
/// the hooks' variable name (`scripts/check-release-hooks.sh` checks the same in
/// `scripts/test.sh`, after the end-to-end runs built them). The sweep above proves the
/// search finds the name where the hooks are built in.
#[test]
fn release_binaries_carry_no_fault_hook() {
    // target/<profile>/deps/<this test> is beside target/release.
    let exe = std::env::current_exe().expect("current_exe");
    let release = exe
        .ancestors()
        .nth(3)
        .expect("the target folder")
        .join("release");
    let bins: Vec<PathBuf> = std::fs::read_dir(&release)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.is_file()
                && p.extension().is_none()
                && p.metadata()
                    .is_ok_and(|m| m.permissions().mode() & 0o111 != 0)
        })
        .collect();
    if !bins
        .iter()
        .any(|p| p.ends_with("aether-supervisor") || p.ends_with("aether-worker"))
    {
        eprintln!(
            "\n!!! SKIPPED release_binaries_carry_no_fault_hook: no release build of the agent in {}. \
             Run `cargo build --release --workspace --bins` (scripts/test.sh's end-to-end runs do). !!!\n",
            release.display()
        );
        return;
    }
    let hooked: Vec<String> = bins
        .iter()
        .filter(|p| has_marker(p))
        .map(|p| p.display().to_string())
        .collect();
    eprintln!(
        "checked {} release binaries: {:?}",
        bins.len(),
        bins.iter()
            .map(|p| p.file_name().unwrap_or_default())
            .collect::<Vec<_>>()
    );
    assert!(
        hooked.is_empty(),
        "release binaries with the test-only fault hooks (AETHER_FAULT_HOOK): {hooked:?}"
    );
}
