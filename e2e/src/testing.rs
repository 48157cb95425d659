//! Fixtures shared by the integration tests and the harness.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The directory holding the workspace's built binaries (target/debug or target/release).
pub fn bin_dir() -> PathBuf {
    if let Ok(d) = std::env::var("AETHER_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(p.exists(), "{} is not built; run `cargo build --workspace` first", p.display());
    p
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Polls `cond` every 2 ms until it returns Some or `timeout` passes.
pub fn wait_for<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One HTTP/1.0 GET over a unix socket: (status, body).
pub fn http_get_unix(sock: &Path, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = UnixStream::connect(sock)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}

/// A node: run and state dirs shared by the agent generations.
pub struct LocalNode {
    pub root: tempfile::TempDir,
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    pub registry_file: Option<PathBuf>,
    next: usize,
}

impl LocalNode {
    pub fn new() -> Self {
        let root = tempfile::Builder::new().prefix("aether-node-").tempdir().expect("tempdir");
        // The worker runs as another uid when the tests run as root: it must be able to
        // reach its own folders below this one.
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod tempdir");
        let run_dir = root.path().join("run");
        let state_dir = root.path().join("state");
        Self { run_dir, state_dir, registry_file: None, next: 0, root }
    }

    pub fn xds_sock(&self) -> PathBuf {
        self.run_dir.join("xds.sock")
    }
    pub fn cni_sock(&self) -> PathBuf {
        self.run_dir.join("cni.sock")
    }

    /// The inode of a path, if it exists.
    pub fn inode(path: &Path) -> Option<u64> {
        std::fs::symlink_metadata(path).ok().map(|m| m.ino())
    }

    pub fn socket_inodes(&self) -> (Option<u64>, Option<u64>) {
        (Self::inode(&self.xds_sock()), Self::inode(&self.cni_sock()))
    }

    /// Starts the next agent generation with its own health dir.
    pub fn start_agent(&mut self) -> Agent {
        self.start_agent_with(&[])
    }

    pub fn start_agent_with(&mut self, extra: &[&str]) -> Agent {
        self.start_agent_wrapped(&[], extra)
    }

    /// Starts the next generation under `wrapper` (e.g. `setpriv ...`), with `extra` flags.
    pub fn start_agent_wrapped(&mut self, wrapper: &[&str], extra: &[&str]) -> Agent {
        self.next += 1;
        let name = format!("gen{}", self.next);
        let health_dir = self.root.path().join(format!("health-{name}"));
        let log_path = self.root.path().join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).expect("log file");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin("aether-supervisor"));
                c
            }
            None => Command::new(bin("aether-supervisor")),
        };
        cmd.arg("--run-dir")
            .arg(&self.run_dir)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--health-dir")
            .arg(&health_dir)
            .arg("--metrics-addr=off")
            .arg(format!("--pod-name=agent-{name}"))
            .arg("--node-name=test-node")
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        if let Some(r) = &self.registry_file {
            cmd.arg("--registry-file").arg(r);
        }
        let child = cmd.spawn().expect("spawn aether-supervisor");
        Agent { name, child, health_sock: health_dir.join("agent-health.sock"), log_path, exited: None }
    }
}

impl Default for LocalNode {
    fn default() -> Self {
        Self::new()
    }
}

/// One agent generation.
pub struct Agent {
    pub name: String,
    pub child: Child,
    pub health_sock: PathBuf,
    pub log_path: PathBuf,
    exited: Option<ExitStatus>,
}

impl Agent {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// `GET /ready`: (status, body as JSON).
    pub fn ready(&self) -> Option<(u16, Value)> {
        let (status, body) = http_get_unix(&self.health_sock, "/ready").ok()?;
        Some((status, serde_json::from_str(&body).ok()?))
    }

    /// Waits until `/ready` answers 200 with `role`.
    pub fn wait_role(&self, role: &str, timeout: Duration) -> Value {
        wait_for(&format!("{} to be a ready {role}", self.name), timeout, || {
            self.ready().filter(|(s, v)| *s == 200 && v["role"] == role).map(|(_, v)| v)
        })
    }

    pub fn worker_pid(&self) -> i32 {
        self.ready().and_then(|(_, v)| v["pid"].as_i64()).expect("worker pid from /ready") as i32
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        wait_for(&format!("{:?} in {}'s log", needle, self.name), timeout, || self.log().contains(needle).then_some(()))
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// SIGKILL of the whole generation: worker and supervisor at once.
    pub fn kill_generation(&mut self) {
        let worker = self.ready().and_then(|(_, v)| v["pid"].as_i64());
        if let Some(w) = worker {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(w as i32), nix::sys::signal::Signal::SIGKILL);
        }
        self.signal(nix::sys::signal::Signal::SIGKILL);
        self.wait_exit(Duration::from_secs(5));
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        if let Some(s) = self.exited {
            return s;
        }
        let s = wait_for(&format!("{} to exit", self.name), timeout, || self.child.try_wait().ok().flatten());
        self.exited = Some(s);
        s
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.exited.is_none() && self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Whether a server accepts a connection on `path`.
pub fn accepts(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

/// Lines of `/proc/<pid>/status` as (key, value).
pub fn proc_status(pid: i32) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.to_string(), v.trim().to_string())))
        .collect()
}

impl Agent {
    /// Like [`Agent::wait_exit`], but an error instead of a panic on timeout.
    pub fn wait_exit_timeout(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        if let Some(s) = self.exited {
            return Ok(s);
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait()? {
                self.exited = Some(s);
                return Ok(s);
            }
            if Instant::now() >= deadline {
                anyhow::bail!("{} did not exit within {timeout:?}; log:\n{}", self.name, self.log());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
