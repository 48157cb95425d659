//! Pod churn through the real `aether-cni` binary, called as a container runtime calls a
//! chained plugin: `CNI_*` env, the network config with a `prevResult` on stdin.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A netns path that exists; the plugin and the agent only check that it is absolute
/// (no interface is touched by a chained plugin that follows the real one).
const NETNS: &str = "/proc/self/ns/net";

pub struct Cni {
    pub bin: PathBuf,
    pub socket: PathBuf,
}

impl Cni {
    fn config(&self, ip: Option<Ipv4Addr>) -> String {
        let mut conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "aether-e2e",
            "type": "aether-cni",
            "agentSocket": self.socket,
        });
        if let Some(ip) = ip {
            conf["prevResult"] = serde_json::json!({
                "cniVersion": "1.0.0",
                "interfaces": [{ "name": "eth0", "sandbox": NETNS }],
                "ips": [{ "address": format!("{ip}/16"), "interface": 0, "gateway": gateway(ip) }],
            });
        }
        conf.to_string()
    }

    /// Runs one ADD (with `ip`) or DEL (without): Ok, or the plugin's error output.
    pub fn call(&self, command: &str, pod: &PodId, ip: Option<Ipv4Addr>) -> Result<(), String> {
        let mut child = Command::new(&self.bin)
            .env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("ctr-{}", pod.uid))
            .env("CNI_NETNS", NETNS)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", self.bin.parent().unwrap_or(Path::new("/")))
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=churn;K8S_POD_NAME={};K8S_POD_UID={}",
                    pod.name, pod.uid
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", self.bin.display()))?;
        let conf = self.config(ip);
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(conf.as_bytes())
            .map_err(|e| format!("stdin: {e}"))?;
        let out = child.wait_with_output().map_err(|e| format!("wait: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{command} {} exited {}: {}{}",
                pod.uid,
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodId {
    pub uid: String,
    pub name: String,
}

/// The first address of `ip`'s /16, the pod network's gateway.
fn gateway(ip: Ipv4Addr) -> String {
    let [a, b, ..] = ip.octets();
    Ipv4Addr::new(a, b, 0, 1).to_string()
}

pub struct Pods {
    next: u32,
    /// Pod uids start with it: two nodes' pods stay apart in logs and storage.
    prefix: String,
    /// The pod network is 10.<net>.0.0/16.
    net: u8,
    /// ADD answered success, no DEL since.
    pub live: BTreeMap<PodId, Ipv4Addr>,
    /// ADD or DEL failed: the runtime calls DEL until it succeeds; such a pod's state is
    /// unknown until then and is not checked.
    pub pending_del: Vec<PodId>,
    pub adds_ok: u64,
    pub adds_failed: u64,
    pub dels_ok: u64,
    pub dels_failed: u64,
    pub errors: Vec<String>,
}

impl Default for Pods {
    /// The node's pods on 10.88.0.0/16.
    fn default() -> Self {
        Pods::on("", 88)
    }
}

impl Pods {
    /// Pods whose uids start with `prefix`, on 10.`net`.0.0/16: a second node's pods get
    /// their own addresses, so that a drain mark names one node's pod only.
    pub fn on(prefix: &str, net: u8) -> Pods {
        Pods {
            next: 0,
            prefix: prefix.to_string(),
            net,
            live: BTreeMap::new(),
            pending_del: Vec::new(),
            adds_ok: 0,
            adds_failed: 0,
            dels_ok: 0,
            dels_failed: 0,
            errors: Vec::new(),
        }
    }

    /// The next pod and its address, not yet added.
    pub fn new_pod(&mut self) -> (PodId, Ipv4Addr) {
        self.next += 1;
        let n = self.next;
        // 10.<net>.0.0/16 minus .0.x: unique per pod, never the gateway.
        let ip = Ipv4Addr::new(10, self.net, (1 + n / 250) as u8, (1 + n % 250) as u8);
        (
            PodId {
                uid: format!("{}pod-{n:05}-uid", self.prefix),
                name: format!("{}churn-{n}", self.prefix),
            },
            ip,
        )
    }

    fn note_err(&mut self, e: String) {
        if self.errors.len() < 20 {
            self.errors.push(e);
        }
    }
}

/// ADDs one new pod; the pod when the plugin answered success.
pub fn add_one(cni: &Cni, pods: &Mutex<Pods>) -> Option<PodId> {
    let (pod, ip) = pods.lock().unwrap().new_pod();
    add_pod(cni, pods, &pod, ip).then_some(pod)
}

/// ADDs `pod` (from [`Pods::new_pod`]) at `ip`; whether the plugin answered success.
pub fn add_pod(cni: &Cni, pods: &Mutex<Pods>, pod: &PodId, ip: Ipv4Addr) -> bool {
    let r = cni.call("ADD", pod, Some(ip));
    let mut p = pods.lock().unwrap();
    match r {
        Ok(()) => {
            p.adds_ok += 1;
            p.live.insert(pod.clone(), ip);
            true
        }
        Err(e) => {
            p.adds_failed += 1;
            p.note_err(e);
            p.pending_del.push(pod.clone());
            false
        }
    }
}

/// DELs `pod`; on failure it stays pending.
pub fn del_one(cni: &Cni, pods: &Mutex<Pods>, pod: PodId) -> bool {
    pods.lock().unwrap().live.remove(&pod);
    let r = cni.call("DEL", &pod, None);
    let mut p = pods.lock().unwrap();
    match r {
        Ok(()) => {
            p.dels_ok += 1;
            p.pending_del.retain(|x| x != &pod);
            true
        }
        Err(e) => {
            p.dels_failed += 1;
            p.note_err(e);
            if !p.pending_del.contains(&pod) {
                p.pending_del.push(pod);
            }
            false
        }
    }
}

/// Retries pending DELs until none is left or `timeout` passes; the ones left.
pub fn settle(cni: &Cni, pods: &Mutex<Pods>, timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        let pending = pods.lock().unwrap().pending_del.clone();
        if pending.is_empty() || Instant::now() > deadline {
            return pending.len();
        }
        for pod in pending {
            del_one(cni, pods, pod);
        }
    }
}

/// Churn while a roll's overlap lasts: ADD a pod, every second step DEL the oldest pod
/// this churn added, pending DELs retried in between.
pub struct Churn {
    stop: Arc<AtomicBool>,
    /// The steps' ADDs made so far, answered or not.
    calls: Arc<AtomicU64>,
    thread: Option<JoinHandle<(u64, u64)>>,
}

impl Churn {
    /// `enabled` false: no calls (a debugging aid, `ARG_NO_CHURN`).
    pub fn start(cni: Arc<Cni>, pods: Arc<Mutex<Pods>>, enabled: bool) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let calls = Arc::new(AtomicU64::new(0));
        let made = calls.clone();
        let thread = std::thread::Builder::new()
            .name("churn".into())
            .spawn(move || {
                let (mut adds, mut dels) = (0u64, 0u64);
                let mut mine: Vec<PodId> = Vec::new();
                let mut step = 0u64;
                while enabled && !s.load(Ordering::Relaxed) {
                    step += 1;
                    let pending = pods.lock().unwrap().pending_del.clone();
                    for pod in pending {
                        del_one(&cni, &pods, pod);
                    }
                    if let Some(pod) = add_one(&cni, &pods) {
                        adds += 1;
                        mine.push(pod);
                    }
                    made.fetch_add(1, Ordering::Relaxed);
                    if step.is_multiple_of(2)
                        && !mine.is_empty()
                        && del_one(&cni, &pods, mine.remove(0))
                    {
                        dels += 1;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                (adds, dels)
            })
            .expect("spawn churn");
        Churn {
            stop,
            calls,
            thread: Some(thread),
        }
    }

    /// The ADDs made so far (a step's DEL follows its ADD), answered or not.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Stops after the call in flight; (successful ADDs, successful DELs).
    pub fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().unwrap_or((0, 0)))
            .unwrap_or((0, 0))
    }
}
