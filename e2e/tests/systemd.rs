//! The systemd unit as deployed (`deploy/systemd/aether-agent.service`): its folders
//! against systemd's re-own of the folders it manages, run under the unit's own
//! capabilities; and its watchdog, fed only while the worker answers heartbeats.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::os::unix::fs::{MetadataExt, PermissionsExt, lchown};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use aether_e2e::harness::churn::{self, Cni, PodId, Pods};
use aether_e2e::testing::{LocalNode, bin, is_root, wait_for};
use nix::sys::signal::Signal;

const T: Duration = Duration::from_secs(10);
const UNIT: &str = include_str!("../../deploy/systemd/aether-agent.service");
const WORKER: (u32, u32) = (65532, 65532);

/// The `[Service]` settings of the unit, the last value of each key.
fn service() -> BTreeMap<String, String> {
    let mut section = "";
    let mut out = BTreeMap::new();
    for line in UNIT.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if section == "[Service]" && !line.starts_with('#') && !line.is_empty() {
            let (k, v) = line.split_once('=').expect("key=value");
            out.insert(k.to_string(), v.to_string());
        }
    }
    out
}

/// The unit's folders under `prefix`: the ones systemd manages (with their mode) and the
/// supervisor's flags.
struct Layout {
    managed: Vec<(PathBuf, u32)>,
    run_dir: PathBuf,
    state_dir: PathBuf,
    health_dir: PathBuf,
}

impl Layout {
    fn of_unit(prefix: &Path) -> Layout {
        let s = service();
        let under = |p: &str| prefix.join(p.trim_start_matches('/'));
        let mut managed = Vec::new();
        for (key, base) in [("StateDirectory", "/var/lib"), ("RuntimeDirectory", "/run")] {
            let mode = u32::from_str_radix(&s[&format!("{key}Mode")], 8).expect("an octal mode");
            managed.extend(
                s[key]
                    .split_whitespace()
                    .map(|d| (under(&format!("{base}/{d}")), mode)),
            );
        }
        let argv: Vec<&str> = s["ExecStart"].split_whitespace().collect();
        let flag = |f: &str| {
            under(
                argv.iter()
                    .position(|a| *a == f)
                    .map(|i| argv[i + 1])
                    .unwrap_or_else(|| panic!("{f} in ExecStart")),
            )
        };
        Layout {
            managed,
            run_dir: flag("--run-dir"),
            state_dir: flag("--state-dir"),
            health_dir: flag("--health-dir"),
        }
    }

    /// What systemd does to the folders it manages at every start of the unit (v252's
    /// `setup_exec_directory`, src/core/execute.c, with `path_chown_recursive`,
    /// src/shared/chown-recursive.c): create each, set its mode, and unless its top
    /// folder is already the unit user's (root:root), re-own the whole tree to that user,
    /// symlinks themselves.
    fn systemd_starts(&self) {
        for (dir, mode) in &self.managed {
            std::fs::create_dir_all(dir).expect("create a managed folder");
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(*mode)).expect("chmod");
            let m = std::fs::symlink_metadata(dir).expect("lstat");
            if (m.uid(), m.gid()) != (0, 0) {
                chown_tree(dir, (0, 0));
            }
        }
    }

    /// The managed folder holding the worker's state.
    fn state_top(&self) -> &Path {
        let top = self
            .managed
            .iter()
            .find(|(d, _)| self.state_dir.starts_with(d));
        &top.expect("the state dir is inside a StateDirectory=").0
    }
}

fn chown_tree(p: &Path, (uid, gid): (u32, u32)) {
    lchown(p, Some(uid), Some(gid)).expect("lchown");
    if std::fs::symlink_metadata(p).expect("lstat").is_dir() {
        for e in std::fs::read_dir(p).expect("read_dir") {
            chown_tree(&e.expect("entry").path(), (uid, gid));
        }
    }
}

/// The supervisor's marker in the worker's state folder: root's by design.
const MARKER: &str = ".aether-worker-state";

/// Every file under `p` whose owner is not `owner`, but for the marker.
fn not_owned_by(p: &Path, owner: (u32, u32)) -> Vec<PathBuf> {
    if p.file_name().is_some_and(|n| n == MARKER) {
        return vec![];
    }
    let m = std::fs::symlink_metadata(p).expect("lstat");
    let mut out = if (m.uid(), m.gid()) == owner {
        vec![]
    } else {
        vec![p.to_owned()]
    };
    if m.is_dir() {
        for e in std::fs::read_dir(p).expect("read_dir") {
            out.extend(not_owned_by(&e.expect("entry").path(), owner));
        }
    }
    out
}

/// `setpriv` with exactly the unit's credentials: root, its capability bounding set,
/// no inheritable set, no_new_privs.
fn as_the_unit() -> Vec<String> {
    let s = service();
    assert_eq!(s["NoNewPrivileges"], "yes");
    let caps: Vec<String> = s["CapabilityBoundingSet"]
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        "--inh-caps=-all".into(),
        "--no-new-privs".into(),
        format!("--bounding-set=-all,{}", caps.join(",")),
    ]
}

/// CHECK of each pod: Ok when the agent holds every one.
fn check_all(cni: &Cni, pods: &Mutex<Pods>) -> Result<(), String> {
    let live: Vec<(PodId, Ipv4Addr)> = pods
        .lock()
        .unwrap()
        .live
        .iter()
        .map(|(p, ip)| (p.clone(), *ip))
        .collect();
    assert!(!live.is_empty());
    live.iter()
        .try_for_each(|(p, ip)| cni.call("CHECK", p, Some(*ip)))
}

/// The Show of the unit's layout: systemd re-owns a managed folder's tree to root at a
/// start whose top folder is not root's. The worker's folders are subfolders of
/// root-owned ones, so systemd's re-own never reaches them; and when the whole state
/// tree is re-owned anyway (by hand, or by systemd under an older layout that handed the
/// top folder to the worker), the supervisor gives it back. Either way the restarted
/// worker reads its pod records.
#[test]
fn the_worker_reads_its_records_after_systemd_re_owns_the_state_folder() {
    if !is_root() {
        eprintln!(
            "SKIPPED the_worker_reads_its_records_after_systemd_re_owns_the_state_folder: needs root to run as the unit does (CI runs as root)"
        );
        return;
    }
    let mut node = LocalNode::new();
    let layout = Layout::of_unit(node.root.path());
    node.run_dir = layout.run_dir.clone();
    node.state_dir = layout.state_dir.clone();
    node.health_dir = Some(layout.health_dir.clone());
    let wrapper = as_the_unit();
    let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let pods = Mutex::new(Pods::default());

    layout.systemd_starts();
    let mut a = node.start_agent_wrapped(&wrapper, &[]);
    a.wait_role("owner", T);
    for _ in 0..3 {
        assert!(
            churn::add_one(&cni, &pods).is_some(),
            "ADD failed: {:?}\n{}",
            pods.lock().unwrap().errors,
            a.log()
        );
    }
    check_all(&cni, &pods).expect("the owner holds its pods");
    assert_eq!(
        not_owned_by(&layout.state_dir, WORKER),
        Vec::<PathBuf>::new(),
        "the worker's state is the worker's"
    );
    for (dir, _) in &layout.managed {
        let m = std::fs::symlink_metadata(dir).expect("lstat");
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o7777),
            (0, 0, 0o755),
            "{} stays systemd's, root's",
            dir.display()
        );
    }
    a.signal(Signal::SIGTERM);
    assert!(a.wait_exit(T).success(), "{}", a.log());

    // `systemctl restart`: systemd finds its folders root's and re-owns nothing.
    layout.systemd_starts();
    assert_eq!(
        not_owned_by(&layout.state_dir, WORKER),
        Vec::<PathBuf>::new(),
        "systemd's start re-owned the worker's state"
    );
    let mut b = node.start_agent_wrapped(&wrapper, &[]);
    b.wait_role("owner", T);
    check_all(&cni, &pods)
        .unwrap_or_else(|e| panic!("the restarted worker lost its records: {e}\n{}", b.log()));
    assert!(!b.log().contains("had been re-owned"), "{}", b.log());
    b.signal(Signal::SIGTERM);
    assert!(b.wait_exit(T).success(), "{}", b.log());

    // The whole tree re-owned to root, as systemd does to a tree whose top is not root's.
    chown_tree(layout.state_top(), (0, 0));
    layout.systemd_starts();
    assert_eq!(
        not_owned_by(&layout.state_dir, (0, 0)),
        Vec::<PathBuf>::new(),
        "re-owned to root"
    );
    let c = node.start_agent_wrapped(&wrapper, &[]);
    c.wait_role("owner", T);
    check_all(&cni, &pods).unwrap_or_else(|e| {
        panic!(
            "the worker could not read its re-owned records: {e}\n{}",
            c.log()
        )
    });
    assert!(c.log().contains("had been re-owned"), "{}", c.log());
    assert_eq!(
        not_owned_by(&layout.state_dir, WORKER),
        Vec::<PathBuf>::new(),
        "all of the worker's state is the worker's again"
    );
    assert_eq!(
        std::fs::symlink_metadata(layout.state_dir.join(MARKER))
            .expect("the marker")
            .uid(),
        0
    );
}

/// `WatchdogSec=`: the supervisor sends `WATCHDOG=1` for each heartbeat its worker
/// answers, none while the worker is stopped, and again once the killed worker's
/// replacement answers.
#[test]
fn the_watchdog_hears_from_the_supervisor_only_while_its_worker_answers() {
    let mut node = LocalNode::new();
    let path = node.root.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    notify
        .set_read_timeout(Some(Duration::from_millis(50)))
        .expect("read timeout");
    // Every WATCHDOG=1, timed as it arrives.
    let pets = std::sync::Arc::new(Mutex::new(Vec::<Instant>::new()));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (pets, done) = (pets.clone(), done.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(n) = notify.recv(&mut buf)
                    && String::from_utf8_lossy(&buf[..n])
                        .lines()
                        .any(|l| l == "WATCHDOG=1")
                {
                    pets.lock().unwrap().push(Instant::now());
                }
            }
        })
    };
    let count = || pets.lock().unwrap().len();
    let env = format!("NOTIFY_SOCKET={}", path.display());
    let a = node.start_agent_wrapped(&["env", &env, "WATCHDOG_USEC=30000000"], &[]);
    a.wait_role("owner", T);
    wait_for("two WATCHDOG=1 from a healthy worker", T, || {
        (count() >= 2).then_some(())
    });
    let worker = a.worker_pid();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker), Signal::SIGSTOP)
        .expect("SIGSTOP the worker");
    let stopped = Instant::now();
    // The supervisor kills the silent worker after 5 s, and its replacement answers.
    wait_for("a new worker", Duration::from_secs(15), || {
        a.ready()
            .and_then(|(_, v)| v["pid"].as_i64())
            .filter(|p| *p as i32 != worker)
    });
    let respawned = Instant::now();
    let before = count();
    wait_for("WATCHDOG=1 from the new worker", T, || {
        (count() > before).then_some(())
    });
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().expect("the notify reader");
    // At most one answer was in flight when the worker stopped; nothing came from then on
    // until its replacement ran.
    let pets = pets.lock().unwrap();
    let silent: Vec<_> = pets
        .iter()
        .filter(|t| **t > stopped + Duration::from_millis(1100) && **t < respawned)
        .collect();
    assert!(
        silent.is_empty(),
        "WATCHDOG=1 while the worker was stopped: {:?} after the stop",
        silent
            .iter()
            .map(|t| t.duration_since(stopped))
            .collect::<Vec<_>>()
    );
    assert!(
        respawned.duration_since(stopped) >= Duration::from_secs(4),
        "the worker was replaced too soon to tell"
    );
    assert!(a.log().contains("missed heartbeats"), "{}", a.log());
}
