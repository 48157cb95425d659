//! Test support (feature `testing`), for this crate's tests and the end-to-end suite: a
//! real etcd, one member or a cluster of three, and the registrar binary, as processes in
//! temp dirs on loopback, killed on drop. Waiting is polling with a deadline.
//!
//! ```no_run
//! # use aether_registrar::testing::{Etcd, RegistrarProcess};
//! let Some(etcd) = Etcd::start_or_skip("my_test") else { return };
//! let dir = tempfile::tempdir().unwrap();
//! let registrar = RegistrarProcess::unix(std::path::Path::new("target/debug/aether-registrar"), &etcd.endpoints(), &dir.path().join("r.sock"), &[]);
//! // registrar.addr() is what `--registrar` and the agents take.
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Where Debian's `etcd-server` puts etcd.
pub const ETCD_BIN: &str = "/usr/bin/etcd";

/// Polls `cond` every 5 ms until it returns Some; panics naming `what` once `timeout` has
/// passed.
pub fn wait_for<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

/// A certificate authority made at run time, and the leaves it signs: for TLS to etcd
/// and to the registrar. PEM files in a temp dir of its own.
pub struct TestCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    dir: tempfile::TempDir,
    ca_file: PathBuf,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let mut params =
            rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).expect("a self-signed CA");
        let dir = tempfile::Builder::new()
            .prefix("aether-test-ca-")
            .tempdir()
            .expect("a temp dir for certificates");
        let ca_file = dir.path().join("ca.crt");
        std::fs::write(&ca_file, cert.pem()).expect("write the CA certificate");
        TestCa {
            cert,
            key,
            dir,
            ca_file,
        }
    }

    /// The CA certificate's PEM file (`<dir>/ca.crt`).
    pub fn ca_file(&self) -> PathBuf {
        self.ca_file.clone()
    }

    /// A leaf for `sans` (DNS names or IP addresses) with one extended key usage: its
    /// certificate and key as PEM.
    pub fn leaf_pem(
        &self,
        name: &str,
        sans: &[&str],
        usage: rcgen::ExtendedKeyUsagePurpose,
    ) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("a leaf key");
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("leaf parameters");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("a signed leaf");
        (cert.pem(), key.serialize_pem())
    }

    /// [`Self::leaf_pem`] written to `<dir>/<name>.crt` and `<dir>/<name>.key`.
    pub fn leaf(
        &self,
        name: &str,
        sans: &[&str],
        usage: rcgen::ExtendedKeyUsagePurpose,
    ) -> (PathBuf, PathBuf) {
        let (cert, key) = self.leaf_pem(name, sans, usage);
        let (c, k) = (
            self.dir.path().join(format!("{name}.crt")),
            self.dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&c, cert).expect("write the leaf");
        std::fs::write(&k, key).expect("write the leaf's key");
        (c, k)
    }
}

fn kill_and_reap(child: &mut Child) -> Option<ExitStatus> {
    let _ = child.kill();
    child.wait().ok()
}

/// One etcd member.
struct Member {
    name: String,
    client_url: String,
    /// Plain HTTP `/health`, also when clients must use TLS.
    health_url: String,
    peer_url: String,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A real etcd: one member, or a cluster whose members share `--initial-cluster` and
/// `--initial-cluster-token`. Members are killed on drop; the data lives in a temp dir.
pub struct Etcd {
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
    tls: Option<EtcdTls>,
    dir: tempfile::TempDir,
}

/// TLS for etcd's clients: its serving certificate and key, and the CA that signs the
/// client certificates it requires (`--client-cert-auth`). PEM files.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: PathBuf,
}

impl Etcd {
    /// Whether etcd is installed (Debian: `etcd-server`).
    pub fn available() -> bool {
        Path::new(ETCD_BIN).exists()
    }

    /// One member, or None with a loud message when etcd is not installed. `test` names
    /// the caller in the message.
    pub fn start_or_skip(test: &str) -> Option<Etcd> {
        Self::cluster_or_skip(test, 1)
    }

    /// A cluster of `members`, or None with a loud message when etcd is not installed.
    pub fn cluster_or_skip(test: &str, members: usize) -> Option<Etcd> {
        if !Self::available() {
            eprintln!(
                "SKIPPED {test}: {ETCD_BIN} is not installed (Debian package etcd-server; scripts/test.sh installs it)"
            );
            return None;
        }
        Some(Self::cluster(members))
    }

    /// A cluster of `members` (1 or more), each healthy before this returns.
    pub fn cluster(members: usize) -> Etcd {
        Self::cluster_with(members, None, None)
    }

    /// [`Etcd::cluster`] with the members' data in a new folder in `parent` (another disk,
    /// a tmpfs), else in the temp dir.
    pub fn cluster_in(members: usize, parent: Option<&Path>) -> Etcd {
        Self::cluster_with(members, None, parent)
    }

    /// One member whose clients must use TLS with a client certificate.
    pub fn start_tls(tls: EtcdTls) -> Etcd {
        Self::cluster_with(1, Some(tls), None)
    }

    /// Ports come from [`free_port`], which another test may take before etcd binds them:
    /// a member that exits on `address already in use` makes the cluster start again on
    /// new ports, a few times.
    fn cluster_with(members: usize, tls: Option<EtcdTls>, parent: Option<&Path>) -> Etcd {
        let mut attempt = 1;
        loop {
            match Self::try_cluster(members, tls.clone(), parent) {
                Ok(etcd) => return etcd,
                Err(log) if attempt < 5 && log.contains("address already in use") => {
                    eprintln!(
                        "etcd: a port was taken before etcd bound it; starting again on new ports (attempt {attempt})"
                    );
                    attempt += 1;
                }
                Err(log) => panic!("{log}"),
            }
        }
    }

    fn try_cluster(
        members: usize,
        tls: Option<EtcdTls>,
        parent: Option<&Path>,
    ) -> Result<Etcd, String> {
        assert!(members >= 1);
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut builder = tempfile::Builder::new();
        builder.prefix("aether-etcd-");
        let dir = match parent {
            Some(p) => builder.tempdir_in(p),
            None => builder.tempdir(),
        }
        .unwrap_or_else(|e| panic!("a folder for etcd's data in {parent:?}: {e}"));
        let members: Vec<Member> = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client_url: format!("{scheme}://127.0.0.1:{}", free_port()),
                health_url: format!("http://127.0.0.1:{}", free_port()),
                peer_url: format!("http://127.0.0.1:{}", free_port()),
                data_dir: dir.path().join(format!("m{i}.etcd")),
                log: dir.path().join(format!("m{i}.log")),
                child: None,
            })
            .collect();
        let initial_cluster = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url))
            .collect::<Vec<_>>()
            .join(",");
        let token = format!("aether-test-{}", std::process::id());
        let mut etcd = Etcd {
            members,
            initial_cluster,
            token,
            tls,
            dir,
        };
        for i in 0..etcd.members.len() {
            etcd.spawn(i, "new");
        }
        for i in 0..etcd.members.len() {
            etcd.wait_started(i)?;
        }
        Ok(etcd)
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("etcd log file");
        let mut cmd = Command::new(ETCD_BIN);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.cert)
                .arg("--key-file")
                .arg(&tls.key);
            cmd.arg("--trusted-ca-file")
                .arg(&tls.client_ca)
                .arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", &m.name, "--data-dir"])
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &m.client_url, "--advertise-client-urls", &m.client_url])
            .args(["--listen-peer-urls", &m.peer_url, "--initial-advertise-peer-urls", &m.peer_url])
            .args(["--initial-cluster", &self.initial_cluster, "--initial-cluster-token", &self.token])
            .args(["--initial-cluster-state", state])
            .args(["--listen-metrics-urls", &m.health_url])
            // Short raft timers: a loopback cluster elects a leader in well under a second.
            .args(["--heartbeat-interval", "20", "--election-timeout", "200"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {ETCD_BIN}: {e}"));
        m.child = Some(child);
    }

    /// Waits until member `i` says it is healthy (it has a leader).
    pub fn wait_healthy(&mut self, i: usize) {
        if let Err(log) = self.wait_started(i) {
            panic!("{log}");
        }
    }

    /// [`Self::wait_healthy`], or the member's log if it exited first.
    fn wait_started(&mut self, i: usize) -> Result<(), String> {
        let url = self.members[i].health_url.clone();
        let what = format!(
            "etcd member {} at {url} to be healthy",
            self.members[i].name
        );
        wait_for(&what, Duration::from_secs(20), || {
            if let Some(c) = self.members[i].child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                let log = std::fs::read_to_string(&self.members[i].log).unwrap_or_default();
                return Some(Err(format!("etcd member {i} exited with {status}: {log}")));
            }
            health(&url).then_some(Ok(()))
        })
    }

    /// Member `i`'s metric `name` (a counter or gauge without labels), read from its
    /// plain-HTTP metrics URL; None if it does not answer or has no such line.
    pub fn metric(&self, i: usize, name: &str) -> Option<f64> {
        let body = get(
            &self.members[i].health_url,
            "/metrics",
            Duration::from_secs(5),
        )?;
        body.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok())?
        })
    }

    /// The client URLs, comma-separated: what `--etcd` takes.
    pub fn endpoints(&self) -> String {
        self.client_urls().join(",")
    }

    pub fn client_urls(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// Kills member `i` (SIGKILL), keeping its data.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            kill_and_reap(&mut c);
        }
    }

    /// Starts member `i` again on its data, after [`Etcd::kill`], and waits until it is
    /// healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i, "existing");
        self.wait_healthy(i);
    }

    /// What member `i` logged.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.members[i].log).unwrap_or_default()
    }

    /// The temp dir holding the members' data and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                kill_and_reap(&mut c);
            }
        }
    }
}

/// One GET /health on an etcd client URL (plain HTTP on loopback).
fn health(url: &str) -> bool {
    get(url, "/health", Duration::from_secs(1)).is_some_and(|b| b.contains("\"health\":\"true\""))
}

/// One plain-HTTP GET of `path` at `url` (`http://host:port`): the whole answer, headers
/// included, or None if it cannot be had within `timeout` per read.
fn get(url: &str, path: &str, timeout: Duration) -> Option<String> {
    let addr = url.strip_prefix("http://")?;
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .ok()?;
    let mut body = String::new();
    // What came before a timeout or a reset still counts, as before.
    let _ = s.read_to_string(&mut body);
    Some(body)
}

/// The `aether-registrar serve` binary as a process, its stderr in a log file. Killed on
/// drop.
pub struct RegistrarProcess {
    bin: PathBuf,
    args: Vec<String>,
    addr: String,
    log: PathBuf,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl RegistrarProcess {
    /// Serves on the unix socket `path`, with `extra` flags (e.g. `--agent-uid`); waits
    /// until it accepts.
    pub fn unix(bin: &Path, etcd: &str, path: &Path, extra: &[&str]) -> Self {
        Self::start(bin, etcd, &format!("unix://{}", path.display()), extra)
    }

    /// Serves plain TCP on a free loopback port (`--insecure-listen`); waits until it
    /// accepts.
    pub fn tcp(bin: &Path, etcd: &str, extra: &[&str]) -> Self {
        let mut args = vec!["--insecure-listen"];
        args.extend_from_slice(extra);
        Self::start(bin, etcd, &format!("127.0.0.1:{}", free_port()), &args)
    }

    /// Serves on `listen` (as `--listen` takes it); waits until it accepts.
    pub fn start(bin: &Path, etcd: &str, listen: &str, extra: &[&str]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("aether-registrar-")
            .tempdir()
            .expect("a temp dir for the registrar log");
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--etcd".into(),
            etcd.into(),
            "--listen".into(),
            listen.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut r = RegistrarProcess {
            bin: bin.to_owned(),
            args,
            addr: listen.to_owned(),
            log: dir.path().join("registrar.log"),
            child: None,
            _dir: dir,
        };
        r.spawn();
        r.wait_accepting();
        r
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("registrar log file");
        let child = Command::new(&self.bin)
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
    }

    fn wait_accepting(&mut self) {
        let addr = self.addr.clone();
        wait_for(
            &format!("the registrar to accept on {addr}"),
            Duration::from_secs(20),
            || {
                if let Some(c) = self.child.as_mut()
                    && let Ok(Some(status)) = c.try_wait()
                {
                    panic!("the registrar exited with {status}: {}", self.log());
                }
                let up = match addr.strip_prefix("unix://") {
                    Some(path) => std::os::unix::net::UnixStream::connect(path).is_ok(),
                    None => TcpStream::connect(&addr).is_ok(),
                };
                up.then_some(())
            },
        );
    }

    /// What clients take as `--registrar`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until its log contains `needle`.
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> String {
        wait_for(
            &format!("{needle:?} in the registrar's log"),
            timeout,
            || {
                let log = self.log();
                log.contains(needle).then_some(log)
            },
        )
    }

    /// SIGKILL, no goodbye to its streams.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_and_reap(&mut c);
        }
    }

    /// SIGTERM, then waits for the exit (at most `timeout`).
    pub fn terminate(&mut self, timeout: Duration) -> ExitStatus {
        let mut child = self.child.take().expect("the registrar is running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("a pid fits i32"));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM)
            .expect("SIGTERM to the registrar");
        wait_for("the registrar to exit after SIGTERM", timeout, || {
            child.try_wait().expect("waitpid")
        })
    }

    /// Starts it again with the same flags (after a kill, or killing it first) and waits
    /// until it accepts.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
        self.wait_accepting();
    }
}

impl Drop for RegistrarProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
