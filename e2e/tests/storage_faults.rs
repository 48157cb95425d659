//! Storage faults with the real agent (supervisor and worker, the worker as uid 65532)
//! and the real `aether-cni` plugin on the node's cni.sock (fault matrix row 9, issue 17):
//!
//! - the pod records folder full (a 256 KiB tmpfs and a ballast file): an ADD fails with
//!   an error naming the path and ENOSPC, leaves no temp file and every other record
//!   whole, is counted and shown in `/ready`; once the ballast is gone the next ADD
//!   succeeds in the same worker and the report clears;
//! - the folder read-only (the tmpfs remounted `ro`): the same;
//! - a DEL while the folder is read-only: the pod leaves the snapshot, the DEL succeeds,
//!   and once the folder is writable again the record goes with no further call;
//! - a record the worker cannot read (EACCES): quarantined, and the agent starts and
//!   serves the other pods.
//!
//! Each needs root (mounts, the worker's own uid); without it each skips loudly.

use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{
    Agent, LocalNode, bin, free_port, is_root, metric_sample, pod_records, quarantined,
    scrape_metrics, wait_for,
};

const T: Duration = Duration::from_secs(30);

/// The uid the supervisor runs its worker as (its default `--worker-user`).
const WORKER_UID: u32 = 65532;

fn skip_unless_root(name: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!(
        "SKIPPED {name}: needs root to mount a tmpfs and to run the worker as its own uid (CI runs as root)"
    );
    true
}

/// A small tmpfs on the pod records folder, the worker's; unmounted when dropped, also
/// when the test fails.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path) -> Tmpfs {
        std::fs::create_dir_all(at).expect("create the pods folder");
        let opts = format!("size=256k,mode=0700,uid={WORKER_UID},gid={WORKER_UID}");
        run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &opts,
                "aether-e2e-pods",
                &at.display().to_string(),
            ],
        );
        Tmpfs(at.to_path_buf())
    }

    fn remount(&self, mode: &str) {
        run(
            "mount",
            &[
                "-o",
                &format!("remount,{mode}"),
                &self.0.display().to_string(),
            ],
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let path = self.0.display().to_string();
        let ok = Command::new("umount")
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Something still has it open: detach it now, the kernel frees it later.
            let _ = Command::new("umount").args(["-l", &path]).status();
        }
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node whose agent serves metrics on a port of its own.
struct Rig {
    metrics: String,
    cni: Cni,
}

impl Rig {
    fn new(node: &LocalNode) -> Rig {
        let port = free_port(Ipv4Addr::LOCALHOST).expect("a free port");
        Rig {
            metrics: format!("127.0.0.1:{port}"),
            cni: Cni {
                bin: bin("aether-cni"),
                socket: node.cni_sock(),
            },
        }
    }

    fn start(&self, node: &mut LocalNode) -> Agent {
        node.metrics = Some(self.metrics.parse().expect("a metrics address"));
        let agent = node.start_agent();
        wait_for("the agent to serve as the owner", T, || {
            agent.serving_owner()
        });
        wait_for("the owner's metrics port", T, || {
            scrape_metrics(&self.metrics)
        });
        agent
    }

    fn sample(&self, series: &str) -> f64 {
        scrape_metrics(&self.metrics)
            .and_then(|t| metric_sample(&t, series))
            .unwrap_or(0.0)
    }

    fn write_errors(&self, op: &str) -> f64 {
        self.sample(&format!("aether_storage_write_errors_total{{op=\"{op}\"}}"))
    }
}

fn pod(n: u8) -> (PodId, Ipv4Addr) {
    (
        PodId {
            uid: format!("storage-pod-{n}-uid"),
            name: format!("storage-{n}"),
        },
        Ipv4Addr::new(10, 89, 0, 10 + n),
    )
}

fn add(cni: &Cni, (pod, ip): &(PodId, Ipv4Addr)) -> Result<(), String> {
    cni.call("ADD", pod, Some(*ip))
}

/// Whether the worker's snapshot holds the pod, asked with a CNI CHECK.
fn served(cni: &Cni, (pod, ip): &(PodId, Ipv4Addr)) -> bool {
    cni.call("CHECK", pod, Some(*ip)).is_ok()
}

/// The `storage` problem in `/ready`, with the status code it came with.
fn storage_problem(agent: &Agent) -> (u16, Option<String>) {
    let (status, body) = agent.ready().expect("/ready answers");
    let problem = body["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["source"] == "storage");
    (
        status,
        problem
            .and_then(|p| p["message"].as_str())
            .map(str::to_owned),
    )
}

/// The records folder: each record decodes and no temp file is there; returns the uids.
fn whole_records(state_dir: &Path) -> Vec<String> {
    let records = pod_records(state_dir);
    let mut uids = Vec::new();
    for (name, decoded) in &records {
        if name == BALLAST {
            continue;
        }
        match decoded {
            Ok(p) => uids.push(p.uid.clone()),
            Err(e) => {
                panic!("{name} in the records folder is not a whole record ({e}): {records:?}")
            }
        }
    }
    uids
}

const BALLAST: &str = "ballast";

/// Fills the file system of `dir` with a ballast file until it is full (ENOSPC).
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join(BALLAST);
    let mut f = std::fs::File::create(&path).expect("create the ballast");
    let chunk = vec![0u8; 4096];
    loop {
        match f.write_all(&chunk).and_then(|()| f.sync_all()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => return path,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
}

/// Checks a failed ADD of `new` under a fault whose error text includes `cause`: the
/// plugin's error names the records folder and the cause, nothing partial is left, the
/// pod is not served, the metric counts the failure, `/ready` reports it and stays 200.
fn assert_add_fails_cleanly(
    node: &LocalNode,
    rig: &Rig,
    agent: &Agent,
    new: &(PodId, Ipv4Addr),
    held: &[&str],
    cause: &str,
) {
    let before = rig.write_errors("write");
    let err = add(&rig.cni, new).expect_err("ADD while storage fails");
    let pods_dir = node.state_dir.join("pods").display().to_string();
    assert!(
        err.contains(&pods_dir) && err.contains(cause),
        "the ADD's error names the path and the cause ({cause}): {err}"
    );
    assert!(
        !served(&rig.cni, new),
        "a pod whose record failed is not served"
    );
    assert_eq!(
        whole_records(&node.state_dir),
        held,
        "nothing partial, the other records whole"
    );
    // A scrape may be served from the exposition cache for a moment: poll.
    wait_for(
        "aether_storage_write_errors_total{op=\"write\"} to count the failure",
        T,
        || (rig.write_errors("write") > before).then_some(()),
    );
    let (status, problem) = storage_problem(agent);
    assert_eq!(status, 200, "failing storage does not turn readiness off");
    let problem = problem.expect("/ready reports the failing storage");
    assert!(
        problem.contains(cause) && problem.contains(&pods_dir),
        "{problem}"
    );
}

/// How a test breaks the records folder.
enum Fault {
    /// ENOSPC: a ballast file fills the tmpfs.
    Full,
    /// The tmpfs remounted read-only.
    ReadOnly,
}

/// A failed ADD under `fault`, then the fault mended: the first ADD after it succeeds in
/// the same worker and `/ready` clears.
fn add_fails_cleanly_then_recovers(test: &str, fault: Fault) {
    if skip_unless_root(test) {
        return;
    }
    let mut node = LocalNode::new();
    let tmpfs = Tmpfs::mount(&node.state_dir.join("pods"));
    let rig = Rig::new(&node);
    let agent = rig.start(&mut node);
    let worker = agent.worker_pid();
    let (a, b) = (pod(1), pod(2));
    add(&rig.cni, &a).expect("ADD before the fault");

    let (cause, mend): (&str, Box<dyn FnOnce() + '_>) = match fault {
        Fault::Full => {
            let ballast = fill(&tmpfs.0);
            (
                "No space left on device",
                Box::new(move || std::fs::remove_file(&ballast).expect("remove the ballast")),
            )
        }
        Fault::ReadOnly => {
            tmpfs.remount("ro");
            ("Read-only file system", Box::new(|| tmpfs.remount("rw")))
        }
    };
    assert_add_fails_cleanly(&node, &rig, &agent, &b, &[a.0.uid.as_str()], cause);
    assert!(
        served(&rig.cni, &a),
        "the pods already there are still served"
    );

    mend();
    add(&rig.cni, &b).expect("the first ADD after the fault is mended succeeds");
    assert!(served(&rig.cni, &b));
    assert_eq!(agent.worker_pid(), worker, "no restart");
    assert_eq!(storage_problem(&agent).1, None, "the report clears");
    assert_eq!(
        whole_records(&node.state_dir),
        [a.0.uid.as_str(), b.0.uid.as_str()]
    );
    drop(agent);
}

/// Fault matrix row 9 (ENOSPC on the state folder). Invariants: no phantom pod (a pod
/// whose record could not be written is not served and its ADD fails with the path and
/// the cause), nothing partial (no temp file, the other records whole), no cached error
/// (the first ADD after space is freed succeeds in the same worker, and `/ready` clears).
#[test]
fn a_full_records_folder_fails_the_add_cleanly_and_the_next_add_after_space_is_freed_succeeds() {
    add_fails_cleanly_then_recovers("storage_faults::enospc", Fault::Full);
}

/// Fault matrix row 9 (a read-only state folder). Invariants as for ENOSPC: no phantom
/// pod, nothing partial, no cached error once the folder is writable again.
#[test]
fn a_read_only_records_folder_fails_the_add_cleanly_and_the_next_add_after_rw_succeeds() {
    add_fails_cleanly_then_recovers("storage_faults::read_only", Fault::ReadOnly);
}

/// Fault matrix row 9 (a read-only state folder at a DEL). Invariants: no phantom pod (the
/// deleted pod leaves the snapshot at once, though its record cannot be removed), the DEL
/// succeeds (the pod is gone from the data plane; a failed DEL would hold the runtime's
/// teardown hostage to the agent's disk), and the record goes once the folder is writable
/// again, with no further call, while the other pod's record stays whole.
#[test]
fn a_del_while_the_folder_is_read_only_takes_the_pod_out_and_the_record_goes_once_writable() {
    if skip_unless_root("storage_faults::del_read_only") {
        return;
    }
    let mut node = LocalNode::new();
    let tmpfs = Tmpfs::mount(&node.state_dir.join("pods"));
    let rig = Rig::new(&node);
    let agent = rig.start(&mut node);
    let (a, b) = (pod(1), pod(2));
    add(&rig.cni, &a).expect("ADD a");
    add(&rig.cni, &b).expect("ADD b");

    tmpfs.remount("ro");
    rig.cni
        .call("DEL", &a.0, None)
        .expect("DEL succeeds while the record cannot be removed");
    assert!(!served(&rig.cni, &a), "the deleted pod left the snapshot");
    assert!(served(&rig.cni, &b), "the other pod is still served");
    assert!(
        tmpfs.0.join(format!("{}.json", a.0.uid)).exists(),
        "the record is still there (read-only)"
    );
    wait_for(
        "aether_storage_write_errors_total{op=\"remove\"} to count the failure",
        T,
        || (rig.write_errors("remove") >= 1.0).then_some(()),
    );
    let (status, problem) = storage_problem(&agent);
    assert_eq!(status, 200);
    let problem = problem.expect("/ready reports the pending removal");
    assert!(
        problem.contains(&a.0.uid) && problem.contains("pending"),
        "{problem}"
    );

    // Stay read-only for 2 s: the timer's retries (0.2 s doubling) fail meanwhile, and
    // each failure counts.
    std::thread::sleep(Duration::from_secs(2));
    assert!(tmpfs.0.join(format!("{}.json", a.0.uid)).exists());
    wait_for("the failed retries to count", T, || {
        (rig.write_errors("remove") >= 2.0).then_some(())
    });

    tmpfs.remount("rw");
    let writable = std::time::Instant::now();
    // The retry backs off to 10 s at most; three times that is room on a loaded machine.
    wait_for("the retry to remove the deleted pod's record", T, || {
        (!tmpfs.0.join(format!("{}.json", a.0.uid)).exists()).then_some(())
    });
    eprintln!(
        "storage_faults: the record went {} ms after the folder became writable; {} failed removals counted",
        writable.elapsed().as_millis(),
        rig.write_errors("remove")
    );
    wait_for("the storage report to clear", T, || {
        storage_problem(&agent).1.is_none().then_some(())
    });
    assert_eq!(whole_records(&node.state_dir), [b.0.uid.as_str()]);
    assert!(!served(&rig.cni, &a), "the deleted pod stays out");
    drop(agent);
}

/// Fault matrix row 9 (a record the worker cannot read: EACCES to its uid). Invariants:
/// no crash loop (the agent starts and serves), no lost pod but the unreadable one (the
/// other pods are served), and the unreadable record is quarantined, logged with its path
/// and the error, and counted.
#[test]
fn an_unreadable_record_is_quarantined_and_the_agent_serves_the_other_pods() {
    if skip_unless_root("storage_faults::unreadable_record") {
        return;
    }
    let mut node = LocalNode::new();
    let rig = Rig::new(&node);
    let mut first = rig.start(&mut node);
    let (a, b, c) = (pod(1), pod(2), pod(3));
    add(&rig.cni, &a).expect("ADD a");
    add(&rig.cni, &b).expect("ADD b");
    first.kill_generation();

    // The worker owns the record; mode 000 refuses even its owner without
    // CAP_DAC_OVERRIDE, which the worker does not have.
    let locked = node.state_dir.join(format!("pods/{}.json", b.0.uid));
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000))
        .expect("chmod 000 the record");

    let agent = rig.start(&mut node);
    assert!(served(&rig.cni, &a), "the readable pod is served");
    assert!(!served(&rig.cni, &b), "the unreadable record is no pod");
    assert!(!locked.exists(), "the unreadable record left the folder");
    let moved = quarantined(&node.state_dir);
    assert!(
        moved.len() == 1 && moved[0].starts_with(&format!("{}.json.", b.0.uid)),
        "{moved:?}"
    );
    wait_for(
        "aether_storage_quarantined_total to count the record",
        T,
        || (rig.sample("aether_storage_quarantined_total") == 1.0).then_some(()),
    );
    let log = agent.log();
    assert!(
        log.lines().any(|l| l.contains("cannot be read")
            && l.contains(&locked.display().to_string())
            && l.contains("Permission denied")),
        "the log names the record and the error:\n{log}"
    );
    add(&rig.cni, &c).expect("ADD after the quarantine");
    assert!(served(&rig.cni, &c));
    drop(agent);
}
