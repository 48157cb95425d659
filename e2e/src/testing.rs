//! Fixtures shared by the integration tests, the benchmarks and the harness, and the small
//! helpers they all use: waiting for a condition, free ports, percentiles.

use std::io::{Read, Write};
use std::net::IpAddr;
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

/// A built binary of the workspace, in [`bin_dir`]. `AETHER_CNI_BIN` names another
/// `aether-cni`: the gate sets it to the plugin as it ships (`scripts/build-cni-plugin.sh`),
/// which is built outside the release folder.
pub fn bin(name: &str) -> PathBuf {
    if name == "aether-cni"
        && let Some(p) = std::env::var_os("AETHER_CNI_BIN")
    {
        let p = PathBuf::from(p);
        assert!(p.exists(), "AETHER_CNI_BIN={} does not exist", p.display());
        return p;
    }
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} is not built; run `cargo build --workspace` first",
        p.display()
    );
    p
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The workspace root: where `scripts/install-envoy.sh` puts `.venv` and the harness its
/// results.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("e2e is inside the workspace")
        .to_path_buf()
}

/// Polls `cond` every 2 ms until it returns Some; an error naming `what` once `timeout`
/// has passed.
pub fn try_wait_for<T>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// [`try_wait_for`] for tests: panics at the deadline.
pub fn wait_for<T>(what: &str, timeout: Duration, cond: impl FnMut() -> Option<T>) -> T {
    try_wait_for(what, timeout, cond).unwrap_or_else(|e| panic!("{e}"))
}

/// A port on `ip` that nothing listens on right now.
pub fn free_port(ip: impl Into<IpAddr>) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind((ip.into(), 0))?
        .local_addr()?
        .port())
}

/// Nearest-rank percentile `p` (0 to 100) of `v`, in any order; None when `v` is empty.
pub fn percentile<T: Copy + PartialOrd>(v: &[T], p: f64) -> Option<T> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s.get(rank.min(s.len()).checked_sub(1)?).copied()
}

/// Where a test's HTTP GET goes.
#[derive(Clone, Copy, Debug)]
pub enum HttpTarget<'a> {
    Unix(&'a Path),
    /// `host:port`.
    Tcp(&'a str),
}

/// The tests' one HTTP client: a GET of `path` in HTTP/`version` (`1.0` for the agent's
/// servers, and for Prometheus, which then does not chunk; `1.1` for Envoy's admin, which
/// answers HTTP/1.0 with 426) with `Connection: close`, read to the end within `timeout`:
/// (status, body), a chunked body decoded. Status 0: no status line.
pub fn http_get(
    to: HttpTarget,
    version: &str,
    path: &str,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    fn exchange(mut s: impl Read + Write, request: &str) -> std::io::Result<Vec<u8>> {
        s.write_all(request.as_bytes())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        Ok(raw)
    }
    let host = match to {
        HttpTarget::Unix(_) => "localhost",
        HttpTarget::Tcp(addr) => addr,
    };
    let request = format!("GET {path} HTTP/{version}\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let raw = match to {
        HttpTarget::Unix(sock) => {
            let s = UnixStream::connect(sock)?;
            s.set_read_timeout(Some(timeout))?;
            exchange(s, &request)?
        }
        HttpTarget::Tcp(addr) => {
            let s = std::net::TcpStream::connect(addr)?;
            s.set_read_timeout(Some(timeout))?;
            exchange(s, &request)?
        }
    };
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    Ok((
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    ))
}

/// The payload of an HTTP/1.1 chunked body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// One HTTP/1.0 GET over a unix socket (the agent's health socket): (status, body).
pub fn http_get_unix(sock: &Path, path: &str) -> std::io::Result<(u16, String)> {
    http_get(HttpTarget::Unix(sock), "1.0", path, Duration::from_secs(2))
}

/// This test process's own loopback address (all of 127/8 is loopback on Linux), where its
/// nodes bind what they listen on in the machine's own network namespace: see
/// [`NodeBuilder`]. From the pid, never in 127.0/16 (etcd, the registrars and the
/// upstreams listen on 127.0.0.1).
pub fn node_loopback() -> std::net::Ipv4Addr {
    let pid = std::process::id();
    std::net::Ipv4Addr::new(
        127,
        1 + (pid / 64_000 % 250) as u8,
        (pid / 250 % 256) as u8,
        2 + (pid % 250) as u8,
    )
}

/// A port on `ip` that nothing listens on right now and that this process has not handed
/// out before: the nodes of one process share [`node_loopback`], and a port handed to one
/// node's Envoy is not bound until that Envoy starts.
pub fn node_port(ip: impl Into<IpAddr>) -> std::io::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let ip = ip.into();
    loop {
        let port = free_port(ip)?;
        let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if !handed.contains(&port) {
            handed.push(port);
            return Ok(port);
        }
    }
}

/// How a [`LocalNode`] is set up: its agents' node name, whether its folder outlives it,
/// whether its agents serve metrics, whether Envoy's capture listeners get free ports, and
/// flags for every agent generation.
///
/// One loopback address scheme for every node: what a node listens on in the machine's own
/// network namespace (Envoy's outbound capture listener, the agents' metrics port) is on
/// [`node_loopback`], an address of the test process's own in 127/8, on a port from
/// [`node_port`]. Envoy binds its listeners with SO_REUSEPORT, so two Envoys that picked the
/// same address and port would silently share it, and one test's load would be answered,
/// and reset at exit, by another's Envoy: tests run in parallel under nextest, one process
/// each, so their addresses differ; the nodes of one process (the two-node gate, a test
/// with a peer node) share the address and never a port. The inbound capture port is free
/// on every address (Envoy binds it on 0.0.0.0).
#[derive(Default)]
pub struct NodeBuilder {
    node_name: Option<String>,
    keep: bool,
    metrics: bool,
    capture: bool,
    args: Vec<String>,
}

impl NodeBuilder {
    /// `--node-name` of its agents (else `test-node`).
    pub fn node_name(mut self, name: &str) -> Self {
        self.node_name = Some(name.into());
        self
    }

    /// The node folder stays after the node goes, so that a failure's logs can be read,
    /// unless [`LocalNode::pass`] says the test passed.
    pub fn keep_folder(mut self) -> Self {
        self.keep = true;
        self
    }

    /// Its agents serve metrics on a free port ([`LocalNode::metrics`]).
    pub fn metrics(mut self) -> Self {
        self.metrics = true;
        self
    }

    /// Envoy's capture listeners on free ports ([`LocalNode::capture`]).
    pub fn capture(mut self) -> Self {
        self.capture = true;
        self
    }

    /// Flags for every agent generation.
    pub fn args<S: ToString>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(|a| a.to_string()));
        self
    }

    pub fn build(self) -> std::io::Result<LocalNode> {
        let mut node = LocalNode::new();
        node.root.disable_cleanup(self.keep);
        if let Some(name) = self.node_name {
            node.node_name = name;
        }
        node.args = self.args;
        if self.metrics {
            let ip = node_loopback();
            node.metrics = Some((ip, node_port(ip)?).into());
        }
        if self.capture {
            node.capture()?;
        }
        Ok(node)
    }
}

/// A node: run and state dirs shared by the agent generations.
pub struct LocalNode {
    pub root: tempfile::TempDir,
    pub run_dir: PathBuf,
    pub state_dir: PathBuf,
    pub registry_file: Option<PathBuf>,
    /// `--node-name` of its agents (`test-node`).
    pub node_name: String,
    /// `--health-dir` of every generation; by default each has its own.
    pub health_dir: Option<PathBuf>,
    /// `--metrics-addr` of the generations started from now on; None: `off`.
    pub metrics: Option<std::net::SocketAddr>,
    /// Flags of every generation (before those a start is given).
    pub args: Vec<String>,
    /// Envoy's outbound capture listener, once [`LocalNode::capture`] chose it.
    pub outbound: Option<std::net::SocketAddr>,
    next: usize,
}

impl LocalNode {
    pub fn new() -> Self {
        let root = tempfile::Builder::new()
            .prefix("aether-node-")
            .tempdir()
            .expect("tempdir");
        // The worker runs as another uid when the tests run as root: it must be able to
        // reach its own folders below this one.
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod tempdir");
        let run_dir = root.path().join("run");
        let state_dir = root.path().join("state");
        Self {
            run_dir,
            state_dir,
            registry_file: None,
            node_name: "test-node".into(),
            health_dir: None,
            metrics: None,
            args: Vec::new(),
            outbound: None,
            next: 0,
            root,
        }
    }

    /// A node set up by a [`NodeBuilder`].
    pub fn builder() -> NodeBuilder {
        NodeBuilder::default()
    }

    /// Envoy's capture listeners on free ports ([`NodeBuilder`] says where), so that the
    /// nodes of tests running in parallel do not clash on the default 15001 and 15006: a
    /// capture file in the node folder, passed to every generation from now on. Returns the
    /// outbound listener's address.
    pub fn capture(&mut self) -> std::io::Result<std::net::SocketAddr> {
        let ip = node_loopback();
        let outbound = std::net::SocketAddr::from((ip, node_port(ip)?));
        let inbound_port = node_port(std::net::Ipv4Addr::UNSPECIFIED)?;
        self.capture_with(
            &serde_json::json!({ "outbound": outbound.to_string(), "inbound_port": inbound_port })
                .to_string(),
        )?;
        self.outbound = Some(outbound);
        Ok(outbound)
    }

    /// A capture file holding `doc`, passed to every generation from now on.
    pub fn capture_with(&mut self, doc: &str) -> std::io::Result<()> {
        let path = self.root.path().join("capture.json");
        std::fs::write(&path, doc)?;
        self.args.push(format!("--capture-file={}", path.display()));
        Ok(())
    }

    /// Starts the next generation and waits until it serves as the owner; the error
    /// carries its log.
    pub fn start_owner(&mut self, timeout: Duration) -> anyhow::Result<Agent> {
        let agent = self.start_agent();
        try_wait_for(
            &format!("{} to serve as owner", agent.name),
            timeout,
            || agent.serving_owner(),
        )
        .map_err(|e| anyhow::anyhow!("{e}; {} log:\n{}", agent.name, agent.log()))?;
        Ok(agent)
    }

    /// The test passed: the node folder can go.
    pub fn pass(&mut self) {
        self.root.disable_cleanup(false);
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

    /// Starts the next generation as systemd would start a `Type=notify` unit: with
    /// `NOTIFY_SOCKET` set to a datagram socket in the node folder, which is returned to
    /// read what the agent notifies (200 ms read timeout).
    pub fn start_agent_notifying(&mut self) -> (Agent, std::os::unix::net::UnixDatagram) {
        let path = self
            .root
            .path()
            .join(format!("notify-{}.sock", self.next + 1));
        let notify = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
        notify
            .set_read_timeout(Some(Duration::from_millis(200)))
            .expect("read timeout");
        let env = format!("NOTIFY_SOCKET={}", path.display());
        (self.start_agent_wrapped(&["env", &env], &[]), notify)
    }

    /// Starts the node's socket keeper (`aether-supervisor --keep-sockets`, as the contract
    /// names it: it execs `aether-keeper`, under the same pid), which lives
    /// across the agent generations the way a keeper outside the agent's pod would.
    pub fn start_keeper(&self) -> Keeper {
        let log_path = self.root.path().join("keeper.log");
        let log = std::fs::File::create(&log_path).expect("keeper log file");
        let child = Command::new(bin("aether-supervisor"))
            .arg("--keep-sockets")
            .arg("--run-dir")
            .arg(&self.run_dir)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn the socket keeper");
        Keeper { child, log_path }
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
        let health_dir = self
            .health_dir
            .clone()
            .unwrap_or_else(|| self.root.path().join(format!("health-{name}")));
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
            .arg(match self.metrics {
                Some(addr) => format!("--metrics-addr={addr}"),
                None => "--metrics-addr=off".into(),
            })
            .arg(format!("--node-name={}", self.node_name))
            .args(&self.args)
            .args(extra)
            // AETHER_E2E_AGENT_LOG sets the agents' log filter (e.g. `info,aether_worker::xds=debug`).
            .env("RUST_LOG", std::env::var("AETHER_E2E_AGENT_LOG").unwrap_or_else(|_| "info".into()))
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        if let Some(r) = &self.registry_file {
            cmd.arg("--registry-file").arg(r);
        }
        // The instance key, unless `extra` sets one (an empty one is the pre-instance key).
        if !extra
            .iter()
            .copied()
            .chain(self.args.iter().map(String::as_str))
            .any(|a| a.starts_with("--pod-name"))
        {
            cmd.arg(format!("--pod-name=agent-{name}"));
        }
        let child = cmd.spawn().expect("spawn aether-supervisor");
        Agent {
            name,
            child,
            health_sock: health_dir.join("agent-health.sock"),
            log_path,
            exited: None,
        }
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
        wait_for(
            &format!("{} to be a ready {role}", self.name),
            timeout,
            || {
                self.ready()
                    .filter(|(s, v)| *s == 200 && v["role"] == role)
                    .map(|(_, v)| v)
            },
        )
    }

    /// `/ready`'s body while this generation is the serving owner.
    pub fn serving_owner(&self) -> Option<Value> {
        self.ready()
            .filter(|(s, v)| *s == 200 && v["role"] == "owner" && v["phase"] == "serving")
            .map(|(_, v)| v)
    }

    pub fn worker_pid(&self) -> i32 {
        self.ready()
            .and_then(|(_, v)| v["pid"].as_i64())
            .expect("worker pid from /ready") as i32
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits until the log holds `needle`; at the deadline, panics with the log's last
    /// lines, so that a failure says what the agent did instead.
    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        let what = format!("{:?} in {}'s log", needle, self.name);
        if let Err(e) = try_wait_for(&what, timeout, || self.log().contains(needle).then_some(())) {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "{e}; its last lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// SIGKILL of the whole generation: worker and supervisor at once.
    pub fn kill_generation(&mut self) {
        let worker = self.ready().and_then(|(_, v)| v["pid"].as_i64());
        if let Some(w) = worker {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(w as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        self.signal(nix::sys::signal::Signal::SIGKILL);
        self.wait_exit(Duration::from_secs(5));
        // The worker's files, the node lock among them, close when it dies, which the
        // supervisor's exit does not wait for.
        if let Some(w) = worker {
            wait_for("the killed worker to die", Duration::from_secs(5), || {
                process_gone(w as i32).then_some(())
            });
        }
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        if let Some(s) = self.exited {
            return s;
        }
        let s = wait_for(&format!("{} to exit", self.name), timeout, || {
            self.child.try_wait().ok().flatten()
        });
        self.exited = Some(s);
        s
    }
}

/// Whether `pid` is gone, or a zombie whose other threads have all exited: either way
/// its files are closed (they are released with the last thread, not the leader).
pub fn process_gone(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    let zombie = stat
        .rsplit(')')
        .next()
        .is_some_and(|r| r.trim_start().starts_with('Z'));
    zombie && std::fs::read_dir(format!("/proc/{pid}/task")).map_or(true, |d| d.count() <= 1)
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.exited.is_none() && self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The node's socket keeper process; killed when dropped.
pub struct Keeper {
    child: Child,
    pub log_path: PathBuf,
}

impl Keeper {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Waits until the keeper's log has `needle` `count` times or more.
    pub fn wait_log_count(&self, needle: &str, count: usize, timeout: Duration) {
        wait_for(
            &format!("{count} x {needle:?} in the keeper's log"),
            timeout,
            || (self.log().matches(needle).count() >= count).then_some(()),
        )
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a server accepts a connection on `path`.
pub fn accepts(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

/// The kB fields `keys` (e.g. `"VmRSS:"`) of `/proc/<pid>/<file>` (`status`,
/// `smaps_rollup`), in KiB, in the order asked.
pub fn proc_kib<const N: usize>(pid: i32, file: &str, keys: [&str; N]) -> [u64; N] {
    let path = format!("/proc/{pid}/{file}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    keys.map(|key| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {path}"))
    })
}

/// A process's `VmRSS` and `VmHWM` (its peak) from `/proc/<pid>/status`, in KiB.
pub fn memory_kib(pid: i32) -> (u64, u64) {
    let [rss, hwm] = proc_kib(pid, "status", ["VmRSS:", "VmHWM:"]);
    (rss, hwm)
}

/// The model's service `s` of [`mesh_registry_json`], with endpoint `draining` marked: what
/// the in-process change API gets for the same change as the file.
pub fn mesh_service(s: usize, endpoints: usize, draining: Option<usize>) -> aether_model::Service {
    aether_model::Service {
        name: format!("svc-{s:05}"),
        namespace: "mesh".into(),
        ports: vec![80],
        vip: None,
        endpoints: (0..endpoints)
            .map(|e| aether_model::Endpoint {
                address: std::net::Ipv4Addr::from(0x0a40_0000u32 + (s * endpoints + e) as u32)
                    .into(),
                port: 8080,
                service_port: 80,
                node: String::new(),
                pod: String::new(),
                state: if draining == Some(e) {
                    aether_model::EndpointState::Draining
                } else {
                    aether_model::EndpointState::Healthy
                },
                mtls: false,
            })
            .collect(),
    }
}

/// A registry file (`--registry-file` schema) for a mesh of `services` services in
/// namespace `mesh`, one port 80, `endpoints` endpoints each on port 8080 (addresses in
/// 10.64.0.0/10, never dialled); `draining` marks one endpoint (service, endpoint).
/// About 700 bytes a service at 10 endpoints: 7 MB for 10,000.
pub fn mesh_registry_json(
    services: usize,
    endpoints: usize,
    draining: Option<(usize, usize)>,
    extra: &str,
) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(services * (80 + endpoints * 64) + extra.len() + 32);
    out.push_str("{\"services\":[");
    for s in 0..services {
        if s > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            "{{\"name\":\"svc-{s:05}\",\"namespace\":\"mesh\",\"ports\":[80],\"endpoints\":["
        );
        for e in 0..endpoints {
            let i = s * endpoints + e;
            let ip = std::net::Ipv4Addr::from(0x0a40_0000u32 + i as u32);
            let state = if draining == Some((s, e)) {
                "draining"
            } else {
                "healthy"
            };
            let _ = write!(
                out,
                "{}{{\"address\":\"{ip}\",\"port\":8080,\"state\":\"{state}\"}}",
                if e > 0 { "," } else { "" }
            );
        }
        out.push_str("]}");
    }
    if !extra.is_empty() {
        if services > 0 {
            out.push(',');
        }
        out.push_str(extra);
    }
    out.push_str("]}");
    out
}

/// Lines of `/proc/<pid>/status` as (key, value).
pub fn proc_status(pid: i32) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        })
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
                anyhow::bail!(
                    "{} did not exit within {timeout:?}; log:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A short suffix unlikely to repeat across concurrent test processes and runs: the pid
/// and the clock, mixed.
pub fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let mut x = (nanos as u64) ^ ((std::process::id() as u64) << 32);
    // splitmix64's finaliser, so that nearby inputs give unrelated outputs.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    format!("{:08x}", x as u32)
}

/// A named network namespace (`ip netns add`), deleted when dropped, also when the test
/// fails: a namespace is a kernel object that outlives the test process.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Creates `name` with its loopback up. Needs root.
    pub fn create(name: &str) -> anyhow::Result<Netns> {
        run_ip(&["netns", "add", name])?;
        let ns = Netns {
            name: name.to_string(),
        };
        run_ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The path a CNI runtime passes as `CNI_NETNS`.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// `ip -n <name> <args>`: (success, stdout, stderr).
    pub fn ip(&self, args: &[&str]) -> (bool, String, String) {
        match Command::new("ip")
            .arg("-n")
            .arg(&self.name)
            .args(args)
            .output()
        {
            Ok(o) => (
                o.status.success(),
                String::from_utf8_lossy(&o.stdout).into_owned(),
                String::from_utf8_lossy(&o.stderr).into_owned(),
            ),
            Err(e) => (false, String::new(), format!("running ip: {e}")),
        }
    }

    /// The names of the links in the namespace.
    pub fn links(&self) -> Vec<String> {
        let (_, out, _) = self.ip(&["-j", "link", "show"]);
        serde_json::from_str::<Value>(&out)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|l| l["ifname"].as_str().map(str::to_string))
            .collect()
    }

    /// The addresses (`ip/len`) on `ifname` in the namespace.
    pub fn addrs(&self, ifname: &str) -> Vec<String> {
        let (_, out, _) = self.ip(&["-j", "addr", "show", "dev", ifname]);
        serde_json::from_str::<Value>(&out)
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| {
                Some(format!(
                    "{}/{}",
                    a["local"].as_str()?,
                    a["prefixlen"].as_u64()?
                ))
            })
            .collect()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run_ip(&["netns", "del", &self.name]) {
            eprintln!("!! could not delete network namespace {}: {e:#}", self.name);
        }
    }
}

fn run_ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("running ip {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        anyhow::bail!(
            "ip {} exited {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The pod records in `<state_dir>/pods/`, by file name: the decoded pod, or why the file
/// did not decode. Temp files (a write in progress or left by a crash) are listed too,
/// as errors, so that a test sees anything half-written.
pub fn pod_records(
    state_dir: &Path,
) -> std::collections::BTreeMap<String, Result<aether_model::Pod, String>> {
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(state_dir.join("pods")) else {
        return out;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let decoded = if name.starts_with('.') {
            Err("a temp file".to_string())
        } else {
            std::fs::read(entry.path())
                .map_err(|e| e.to_string())
                .and_then(|b| aether_worker::storage::decode_record(&b).map_err(|e| e.to_string()))
        };
        out.insert(name, decoded);
    }
    out
}

/// The files in `<state_dir>/pods-quarantine/`: records the agent could not decode.
pub fn quarantined(state_dir: &Path) -> Vec<String> {
    std::fs::read_dir(state_dir.join("pods-quarantine"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A test identity provider ([`crate::identity::IdentityProvider`]) that agents started as
/// processes can reach, in a fresh folder of its own (returned; it goes when dropped). The
/// worker runs as uid 65532 when the tests run as root, and a unix socket's connect needs
/// write permission on the socket file: the folder is opened to every uid and so are both
/// sockets ([`open_identity_sockets`]).
pub fn identity_provider_for_agents(
    trust_domain: &str,
) -> (tempfile::TempDir, crate::identity::IdentityProvider) {
    identity_provider_for_agents_with(crate::identity::Options::new(trust_domain))
}

/// [`identity_provider_for_agents`] started with `options` (the agent's SPIFFE ID path,
/// the SVIDs' lifetime).
pub fn identity_provider_for_agents_with(
    options: crate::identity::Options,
) -> (tempfile::TempDir, crate::identity::IdentityProvider) {
    let dir = tempfile::Builder::new()
        .prefix("aether-idp-")
        .tempdir()
        .expect("tempdir for the identity provider");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod the identity provider's folder");
    let provider = crate::identity::IdentityProvider::start_with(dir.path(), options)
        .expect("starting the test identity provider");
    open_identity_sockets(&provider);
    (dir, provider)
}

/// Opens both of the provider's socket files to every uid. Needed again after
/// `set_down(false)`, which binds fresh ones (with this process's umask); until then a
/// worker of another uid is refused with EACCES and retries on its own backoff.
pub fn open_identity_sockets(provider: &crate::identity::IdentityProvider) {
    for path in [provider.workload_socket(), provider.delegated_socket()] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
    }
}

/// The agent flags for workload identity from `provider`: its Workload API and Delegated
/// Identity API sockets, its trust domain, and `mtls` (`permissive` or `strict`).
pub fn identity_args(provider: &crate::identity::IdentityProvider, mtls: &str) -> Vec<String> {
    vec![
        format!(
            "--spiffe-endpoint=unix://{}",
            provider.workload_socket().display()
        ),
        format!(
            "--spiffe-broker-endpoint=unix://{}",
            provider.delegated_socket().display()
        ),
        format!("--trust-domain={}", provider.trust_domain()),
        format!("--mtls={mtls}"),
    ]
}

/// A whole number from the environment variable `name`, else `default` (benchmark knobs).
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The agent's binaries and the plugin, built for the calling benchmark's profile: `cargo
/// bench -p aether-e2e` builds only this package's targets. With `AETHER_BIN_DIR`, as
/// they are.
pub fn build_agent_bins() {
    if std::env::var_os("AETHER_BIN_DIR").is_some() {
        return;
    }
    let dir = bin_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(p) => p.to_string(),
        None => panic!("no profile in the binary folder {}", dir.display()),
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args(["build", "--quiet", "--profile", &profile]);
    for (p, b) in [
        ("aether-supervisor", "aether-supervisor"),
        ("aether-worker", "aether-worker"),
        ("aether-keeper", "aether-keeper"),
        ("aether-cni", "aether-cni"),
        ("aether-xds-relay", "aether-xds-relay"),
    ] {
        cmd.args(["-p", p, "--bin", b]);
    }
    let status = cmd
        .current_dir(workspace_root())
        .status()
        .expect("running cargo build");
    assert!(
        status.success(),
        "cargo build --profile {profile} of the agent's binaries: {status}"
    );
}

/// Whether `pid` has exited: gone from `/proc`, or a zombie nobody has reaped yet (a
/// process whose parent died is reparented, and its new parent may reap it late).
pub fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z')),
    }
}

/// The processes with a descriptor open on the file at `path` (same device and inode),
/// from `/proc/<pid>/fd`: the only ones that can hold or keep a flock on it. Other users'
/// processes are seen only by root.
pub fn processes_with_open(path: &Path) -> Vec<i32> {
    let Ok(want) = std::fs::metadata(path) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for proc_entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = proc_entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(proc_entry.path().join("fd")) else {
            continue;
        };
        let open = fds.flatten().any(|fd| {
            std::fs::metadata(fd.path())
                .is_ok_and(|m| m.dev() == want.dev() && m.ino() == want.ino())
        });
        if open {
            out.push(pid);
        }
    }
    out
}

/// The pids `/proc/locks` shows holding a flock on the file at `path` (granted locks
/// only, not waiters), matched by inode.
pub fn flock_holders(path: &Path) -> Vec<i32> {
    let Ok(ino) = std::fs::metadata(path).map(|m| m.ino()) else {
        return Vec::new();
    };
    std::fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.contains("->"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
            (f.len() >= 6 && f[1] == "FLOCK" && f[5].rsplit(':').next() == Some(&ino.to_string()))
                .then(|| f[4].parse().ok())
                .flatten()
        })
        .collect()
}

/// One `GET /metrics` at `addr`: the exposition, or None if none came with status 200.
pub fn scrape_metrics(addr: &str) -> Option<String> {
    match http_get(
        HttpTarget::Tcp(addr),
        "1.0",
        "/metrics",
        Duration::from_secs(2),
    ) {
        Ok((200, body)) => Some(body),
        _ => None,
    }
}

/// The value of the sample `series` (name and labels, as printed) in a scrape's `text`.
pub fn metric_sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunk_joins_chunks_and_ignores_extensions() {
        assert_eq!(
            dechunk("4\r\nWiki\r\n5;x=y\r\npedia\r\n0\r\n\r\n"),
            "Wikipedia"
        );
        assert_eq!(dechunk("zz\r\n"), "");
    }

    #[test]
    fn percentile_is_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        assert_eq!(percentile::<f64>(&[], 50.0), None);
    }
}
