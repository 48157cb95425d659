//! A real data path through a node's Envoy, in network namespaces this module creates
//! and deletes: the mTLS tests' traffic goes where a pod's would.
//!
//! - A **node** namespace, where the node's Envoy runs ([`crate::envoy::RigOptions::netns`]).
//!   It forwards (`ip_forward`), and an nftables rule redirects TCP to its pods' subnet
//!   and port 80 arriving from outside (prerouting) to the capture listener's inbound
//!   port, as a CNI redirect would. Envoy's own upstream connections leave through
//!   output and are not redirected.
//! - A **pod** namespace per server pod, joined to the node by a veth pair (the pod's
//!   address on `eth0`, the node's gateway address on its end, as CNI's `ptp` does), with
//!   a tiny server in it: [`Serve::Lines`] answers each line `L` with `<pod>: L` (the
//!   client speaks first, so that the TLS inspector sees its bytes), [`Serve::Http`]
//!   answers HTTP requests, optionally over mTLS it terminates itself, with the pod's name
//!   and the peer's SPIFFE ID.
//! - A **client** namespace, joined to the node by a veth pair and routed to the pod
//!   subnet through it.
//! - [`Datapath::link`] joins two nodes' namespaces, each routing the other's pod subnet.
//!
//! Everything is torn down on drop: servers stopped, namespaces deleted (their veths go
//! with them). The SVIDs come from [`TestCa`] (rcgen, ECDSA P-256, PKCS#8 key PEM), the
//! clients are rustls clients ([`tls_client`]) whose server check is the trust bundle
//! and not a DNS name, which SVIDs do not carry.
//!
//! `unsafe`: one `setns(2)` call in [`in_netns`], on a thread of its own, through `libc`
//! (the workspace's `nix` does not enable its `sched` feature).

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use aether_model::Svid;
use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, CustomExtension, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{
    WebPkiSupportedAlgorithms, ring, verify_tls12_signature, verify_tls13_signature,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{
    ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, ServerConfig,
    ServerConnection, SignatureScheme, StreamOwned,
};
use tokio_rustls::rustls;

use crate::testing::{Netns, is_root, unique_suffix};

/// The port the pods' servers listen on (the model's inbound target port).
pub const POD_PORT: u16 = aether_model::INBOUND_TARGET_PORT;

/// How long a client waits for a connect or an answer before it calls the attempt hung.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the data-path tests cannot run here (not root, or `ip` or `nft` missing); None
/// when they can.
pub fn missing() -> Option<String> {
    if !is_root() {
        return Some("not root: the data path needs network namespaces and nftables".into());
    }
    for tool in ["ip", "nft"] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Some(format!(
                "`{tool}` not found (Debian: iproute2, nftables; scripts/install-deps.sh)"
            ));
        }
    }
    None
}

/// Runs `f` on a fresh thread that has entered the network namespace `ns`, and returns
/// its result. Sockets made there stay in `ns` wherever they are used later.
pub fn in_netns<T: Send + 'static>(
    ns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<T> {
    let file = File::open(ns.path())?;
    std::thread::spawn(move || {
        // SAFETY: `file` is an open descriptor of a network namespace (a bind mount under
        // /run/netns) for the whole call; setns(2) with CLONE_NEWNET moves only this
        // thread, which ends after `f`, and touches no memory of ours.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(f())
    })
    .join()
    .map_err(|_| io::Error::other("the thread in the namespace panicked"))?
}

/// A TCP connection made from inside `ns`.
pub fn connect_in(ns: &Netns, addr: SocketAddr) -> io::Result<TcpStream> {
    let s = in_netns(ns, move || TcpStream::connect_timeout(&addr, IO_TIMEOUT))??;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// Runs `ip netns exec <ns> <args>`, failing with its stderr.
fn exec_in(ns: &str, args: &[&str], stdin: Option<&str>) -> anyhow::Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    });
    let mut child = cmd
        .spawn()
        .with_context(|| format!("running {} in {ns}", args.join(" ")))?;
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .expect("piped stdin")
            .write_all(text.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{} in {ns} exited {}: {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn ip(ns: &Netns, args: &[&str]) -> anyhow::Result<()> {
    let (ok, _, err) = ns.ip(args);
    if !ok {
        bail!("ip -n {} {}: {}", ns.name, args.join(" "), err.trim());
    }
    Ok(())
}

// ---- topology ----

/// One node's namespaces: the node itself, its pods, and a client outside it.
pub struct Datapath {
    /// Pods first: their servers stop and their namespaces go before the node's.
    pods: Vec<PodNet>,
    pub client: Netns,
    pub client_ip: Ipv4Addr,
    pub node: Netns,
    /// The node's address on every pod veth: the pods' gateway (`<subnet>.1`).
    pub gateway: Ipv4Addr,
    /// The first three octets of the node's pod /24.
    pub subnet: [u8; 3],
    /// `tag` and a suffix unique to this run: the namespaces' names.
    pub name: String,
    links: u32,
}

/// A pod's namespace and its server.
pub struct PodNet {
    pub server: PodServer,
    pub ns: Netns,
    pub name: String,
    /// Its first address, the one its server listens on.
    pub ip: Ipv4Addr,
    /// Addresses added with [`Datapath::add_address`].
    pub more_ips: Vec<Ipv4Addr>,
    veth: String,
}

impl PodNet {
    /// Every address of the pod, the first first.
    pub fn ips(&self) -> Vec<Ipv4Addr> {
        std::iter::once(self.ip)
            .chain(self.more_ips.iter().copied())
            .collect()
    }
}

impl Datapath {
    /// A node namespace with pod subnet `<subnet>.0/24` (gateway `<subnet>.1`) and a client
    /// namespace at 10.250.0.2/24 routed to it through the node. `tag` keeps two nodes of
    /// one test apart in the namespaces' names.
    pub fn create(tag: &str, subnet: [u8; 3]) -> anyhow::Result<Datapath> {
        let name = format!("ae{tag}-{}", unique_suffix());
        let node = Netns::create(&format!("{name}-node"))?;
        let client = Netns::create(&format!("{name}-cli"))?;
        let gateway = Ipv4Addr::new(subnet[0], subnet[1], subnet[2], 1);
        let client_ip = Ipv4Addr::new(10, 250, 0, 2);
        let dp = Datapath {
            pods: Vec::new(),
            client,
            client_ip,
            node,
            gateway,
            subnet,
            name,
            links: 0,
        };
        exec_in(
            &dp.node.name,
            &["sysctl", "-qw", "net.ipv4.ip_forward=1"],
            None,
        )?;
        ip(
            &dp.node,
            &[
                "link",
                "add",
                "cli0",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &dp.client.name,
            ],
        )?;
        ip(&dp.node, &["addr", "add", "10.250.0.1/24", "dev", "cli0"])?;
        ip(&dp.node, &["link", "set", "cli0", "up"])?;
        ip(
            &dp.client,
            &["addr", "add", &format!("{client_ip}/24"), "dev", "eth0"],
        )?;
        ip(&dp.client, &["link", "set", "eth0", "up"])?;
        ip(
            &dp.client,
            &["route", "add", "default", "via", "10.250.0.1"],
        )?;
        Ok(dp)
    }

    /// Adds pod `name` at `<subnet>.<host>` with a server doing `serve`, and returns it.
    pub fn add_pod(&mut self, name: &str, host: u8, serve: Serve) -> anyhow::Result<&PodNet> {
        let [a, b, c] = self.subnet;
        let pod_ip = Ipv4Addr::new(a, b, c, host);
        let ns = Netns::create(&format!("{}-p{host}", self.name))?;
        let veth = format!("p{host}");
        ip(
            &self.node,
            &[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
            ],
        )?;
        // As CNI's ptp: the gateway address on every host end, a host route per pod.
        ip(
            &self.node,
            &["addr", "add", &format!("{}/32", self.gateway), "dev", &veth],
        )?;
        ip(&self.node, &["link", "set", &veth, "up"])?;
        ip(
            &self.node,
            &["route", "add", &format!("{pod_ip}/32"), "dev", &veth],
        )?;
        ip(
            &ns,
            &["addr", "add", &format!("{pod_ip}/24"), "dev", "eth0"],
        )?;
        ip(&ns, &["link", "set", "eth0", "up"])?;
        ip(
            &ns,
            &["route", "add", "default", "via", &self.gateway.to_string()],
        )?;
        let listener = in_netns(&ns, || TcpListener::bind((Ipv4Addr::UNSPECIFIED, POD_PORT)))??;
        let server = PodServer::start(name.to_string(), listener, serve);
        self.pods.push(PodNet {
            server,
            ns,
            name: name.to_string(),
            ip: pod_ip,
            more_ips: Vec::new(),
            veth,
        });
        Ok(self.pods.last().expect("just pushed"))
    }

    /// Gives pod `name` a further address `<subnet>.<host>` (routed to it like its first).
    pub fn add_address(&mut self, name: &str, host: u8) -> anyhow::Result<Ipv4Addr> {
        let [a, b, c] = self.subnet;
        let extra = Ipv4Addr::new(a, b, c, host);
        let i = self
            .pods
            .iter()
            .position(|p| p.name == name)
            .with_context(|| format!("no pod {name}"))?;
        ip(
            &self.pods[i].ns,
            &["addr", "add", &format!("{extra}/24"), "dev", "eth0"],
        )?;
        ip(
            &self.node,
            &[
                "route",
                "add",
                &format!("{extra}/32"),
                "dev",
                &self.pods[i].veth,
            ],
        )?;
        self.pods[i].more_ips.push(extra);
        Ok(extra)
    }

    /// Makes pod `name`'s connections leave from its address `src` (its default route's
    /// preferred source), as a pod with several addresses may.
    pub fn set_source(&self, name: &str, src: Ipv4Addr) -> anyhow::Result<()> {
        let gw = self.gateway.to_string();
        ip(
            &self.pod(name).ns,
            &[
                "route",
                "replace",
                "default",
                "via",
                &gw,
                "src",
                &src.to_string(),
            ],
        )
    }

    /// The agent's record of pod `name` (namespace `default`, uid `uid-NAME`, every address
    /// it has here); `no_quic_twin` is its CNI opt-out.
    pub fn pod_record(&self, name: &str, no_quic_twin: bool) -> aether_model::Pod {
        let p = self.pod(name);
        aether_model::Pod {
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            name: name.into(),
            container_id: format!("c-{name}"),
            netns: p.ns.path().display().to_string(),
            ifname: "eth0".into(),
            ips: p.ips().into_iter().map(IpAddr::V4).collect(),
            terminating: false,
            no_quic_twin,
        }
    }

    pub fn pod(&self, name: &str) -> &PodNet {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name} in the data path"))
    }

    /// The pod subnet as `a.b.c.0/24`.
    pub fn pod_cidr(&self) -> String {
        let [a, b, c] = self.subnet;
        format!("{a}.{b}.{c}.0/24")
    }

    /// Redirects TCP arriving from outside the node to its pods' port 80 to Envoy's
    /// inbound capture listener on `inbound_port`; with `outbound`, also TCP from its
    /// pods to `outbound.0` (a CIDR, the services' VIPs) port 80 to Envoy's outbound
    /// listener on port `outbound.1`. Prerouting only: Envoy's own connections are left
    /// alone.
    pub fn redirect(&self, inbound_port: u16, outbound: Option<(&str, u16)>) -> anyhow::Result<()> {
        let mut rules = format!(
            "    ip daddr {} tcp dport {POD_PORT} redirect to :{inbound_port}\n",
            self.pod_cidr()
        );
        if let Some((vips, port)) = outbound {
            rules.push_str(&format!(
                "    ip saddr {} ip daddr {vips} tcp dport 80 redirect to :{port}\n",
                self.pod_cidr()
            ));
        }
        let table = format!(
            "table ip aether_capture {{\n  chain prerouting {{\n    type nat hook prerouting priority dstnat; policy accept;\n{rules}  }}\n}}\n"
        );
        exec_in(&self.node.name, &["nft", "-f", "-"], Some(&table))
            .context("installing the capture redirect with nft")
    }

    /// Joins two nodes' namespaces with a veth pair (10.251.<n>.1 and .2) and routes each
    /// one's pod subnet through the other.
    pub fn link(a: &mut Datapath, b: &mut Datapath) -> anyhow::Result<()> {
        let n = a.links + b.links;
        let (wa, wb) = (format!("w{n}a"), format!("w{n}b"));
        let (ia, ib) = (format!("10.251.{n}.1"), format!("10.251.{n}.2"));
        ip(
            &a.node,
            &[
                "link",
                "add",
                &wa,
                "type",
                "veth",
                "peer",
                "name",
                &wb,
                "netns",
                &b.node.name,
            ],
        )?;
        ip(&a.node, &["addr", "add", &format!("{ia}/24"), "dev", &wa])?;
        ip(&b.node, &["addr", "add", &format!("{ib}/24"), "dev", &wb])?;
        ip(&a.node, &["link", "set", &wa, "up"])?;
        ip(&b.node, &["link", "set", &wb, "up"])?;
        ip(&a.node, &["route", "add", &b.pod_cidr(), "via", &ib])?;
        ip(&b.node, &["route", "add", &a.pod_cidr(), "via", &ia])?;
        a.links += 1;
        b.links += 1;
        Ok(())
    }

    /// A TCP connection from the client namespace.
    pub fn client_connect(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        connect_in(&self.client, addr)
    }
}

// ---- pod servers ----

/// What a pod's server does with each connection.
#[derive(Clone)]
pub enum Serve {
    /// Answers each line `L` with `<pod>: L`, until the peer closes.
    Lines,
    /// Answers each HTTP/1.1 request 200 with `<pod> peer=<the peer's SPIFFE ID or
    /// "none">`; with a config, over TLS it terminates itself (mTLS when the config asks
    /// for client certificates).
    Http(Option<Arc<ServerConfig>>),
    /// Answers each HTTP/1.1 request 200 with `<pod> from=<the connection's peer
    /// address>`, plaintext: behind the node's Envoy that address is the Envoy's end of
    /// the connection it proxies, which its access log names (`upstream_local_address`).
    HttpFrom,
}

/// A pod's server: an accept thread and a thread per connection; stopped when dropped.
pub struct PodServer {
    listener: Arc<TcpListener>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    served: Arc<AtomicU64>,
    peers: Arc<Mutex<Vec<String>>>,
    accept: Option<JoinHandle<()>>,
}

impl PodServer {
    fn start(name: String, listener: TcpListener, serve: Serve) -> PodServer {
        let listener = Arc::new(listener);
        let conns = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
        let served = Arc::new(AtomicU64::new(0));
        let peers = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let (listener, conns, served, peers) = (
                listener.clone(),
                conns.clone(),
                served.clone(),
                peers.clone(),
            );
            std::thread::spawn(move || {
                // Ends when the drop shuts the listener down (accept fails).
                while let Ok((s, _)) = listener.accept() {
                    if let Ok(c) = s.try_clone() {
                        conns.lock().unwrap().push(c);
                    }
                    let (name, serve, served, peers) =
                        (name.clone(), serve.clone(), served.clone(), peers.clone());
                    std::thread::spawn(move || {
                        let _ = match serve {
                            Serve::Lines => serve_lines(&name, s, &served),
                            Serve::Http(tls) => serve_http(&name, s, tls, &served, &peers),
                            Serve::HttpFrom => serve_http_from(&name, s, &served),
                        };
                    });
                }
            })
        };
        PodServer {
            listener,
            conns,
            served,
            peers,
            accept: Some(accept),
        }
    }

    /// How many lines or requests the server has answered.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }

    /// The peer SPIFFE IDs of the TLS connections it terminated ("none" without a client
    /// certificate), in order.
    pub fn peers(&self) -> Vec<String> {
        self.peers.lock().unwrap().clone()
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        // shutdown(2) on a listening socket wakes the blocked accept with an error.
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn serve_lines(name: &str, mut s: TcpStream, served: &AtomicU64) -> io::Result<()> {
    let mut buf = Vec::new();
    loop {
        let Some(line) = read_line(&mut s, &mut buf)? else {
            return Ok(());
        };
        // Counted before the answer goes out, so that a client holding it sees it counted.
        served.fetch_add(1, Ordering::SeqCst);
        s.write_all(format!("{name}: {line}\n").as_bytes())?;
    }
}

fn serve_http(
    name: &str,
    s: TcpStream,
    tls: Option<Arc<ServerConfig>>,
    served: &AtomicU64,
    peers: &Mutex<Vec<String>>,
) -> io::Result<()> {
    let peer;
    let mut io: Box<dyn ReadWrite> = match tls {
        Some(config) => {
            let mut stream =
                StreamOwned::new(ServerConnection::new(config).map_err(io::Error::other)?, s);
            while stream.conn.is_handshaking() {
                stream.conn.complete_io(&mut stream.sock)?;
            }
            peer = stream
                .conn
                .peer_certificates()
                .and_then(|c| c.first())
                .map_or_else(
                    || "none".to_string(),
                    |c| {
                        uri_sans(c)
                            .into_iter()
                            .next()
                            .unwrap_or_else(|| "no URI SAN".into())
                    },
                );
            peers.lock().unwrap().push(peer.clone());
            Box::new(stream)
        }
        None => {
            peer = "none".to_string();
            Box::new(s)
        }
    };
    let mut buf = Vec::new();
    loop {
        // The request head; the mesh's requests here carry no body.
        let mut head = String::new();
        loop {
            let Some(line) = read_line(&mut io, &mut buf)? else {
                return Ok(());
            };
            if line.trim_end_matches('\r').is_empty() {
                break;
            }
            head.push_str(&line);
        }
        let body = format!("{name} peer={peer}");
        served.fetch_add(1, Ordering::SeqCst);
        io.write_all(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )?;
        io.flush()?;
    }
}

fn serve_http_from(name: &str, mut s: TcpStream, served: &AtomicU64) -> io::Result<()> {
    let body = format!("{name} from={}", s.peer_addr()?);
    let mut buf = Vec::new();
    loop {
        loop {
            let Some(line) = read_line(&mut s, &mut buf)? else {
                return Ok(());
            };
            if line.trim_end_matches('\r').is_empty() {
                break;
            }
        }
        served.fetch_add(1, Ordering::SeqCst);
        s.write_all(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )?;
    }
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// The next `\n`-terminated line (without it) from `r`, keeping what follows in `buf`;
/// None at end of stream.
fn read_line(r: &mut (impl Read + ?Sized), buf: &mut Vec<u8>) -> io::Result<Option<String>> {
    loop {
        if let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            return Ok(Some(String::from_utf8_lossy(&line[..i]).into_owned()));
        }
        let mut chunk = [0u8; 4096];
        let n = r.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

// ---- clients ----

/// A client connection to a pod through the node, plaintext or TLS, kept open across
/// exchanges.
pub struct Conn {
    io: Box<dyn ReadWrite>,
    buf: Vec<u8>,
    /// The server's leaf certificate (DER), over TLS.
    pub server_leaf: Option<Vec<u8>>,
}

/// Why a client got no answer.
#[derive(Debug)]
pub struct Failure {
    /// The attempt hung until [`IO_TIMEOUT`] rather than being closed or refused.
    pub timed_out: bool,
    pub reason: String,
}

impl Failure {
    fn of(stage: &str, e: io::Error) -> Failure {
        Failure {
            timed_out: matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
            reason: format!("{stage}: {e}"),
        }
    }
}

impl Conn {
    /// Connects from `ns` to `addr`, over TLS with `tls` (the handshake completes here;
    /// in TLS 1.3 a server that refuses the client's certificate says so only after it,
    /// at the first read).
    pub fn open(
        ns: &Netns,
        addr: SocketAddr,
        tls: Option<Arc<ClientConfig>>,
    ) -> Result<Conn, Failure> {
        let s = connect_in(ns, addr).map_err(|e| Failure::of("connect", e))?;
        match tls {
            None => Ok(Conn {
                io: Box::new(s),
                buf: Vec::new(),
                server_leaf: None,
            }),
            Some(config) => {
                let conn = ClientConnection::new(config, ServerName::IpAddress(addr.ip().into()))
                    .map_err(|e| Failure {
                    timed_out: false,
                    reason: format!("TLS client: {e}"),
                })?;
                let mut stream = StreamOwned::new(conn, s);
                while stream.conn.is_handshaking() {
                    stream
                        .conn
                        .complete_io(&mut stream.sock)
                        .map_err(|e| Failure::of("TLS handshake", e))?;
                }
                let server_leaf = stream
                    .conn
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| c.to_vec());
                Ok(Conn {
                    io: Box::new(stream),
                    buf: Vec::new(),
                    server_leaf,
                })
            }
        }
    }

    /// Sends `line` and returns the answer line.
    pub fn ask(&mut self, line: &str) -> Result<String, Failure> {
        self.io
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| Failure::of("write", e))?;
        self.io.flush().map_err(|e| Failure::of("flush", e))?;
        match read_line(&mut self.io, &mut self.buf) {
            Ok(Some(answer)) => Ok(answer),
            Ok(None) => Err(Failure {
                timed_out: false,
                reason: "closed without an answer".into(),
            }),
            Err(e) => Err(Failure::of("read", e)),
        }
    }
}

/// One exchange on a new connection: the answer and the server's leaf certificate.
pub fn exchange(
    ns: &Netns,
    addr: SocketAddr,
    tls: Option<Arc<ClientConfig>>,
    line: &str,
) -> Result<(String, Option<Vec<u8>>), Failure> {
    let mut c = Conn::open(ns, addr, tls)?;
    let answer = c.ask(line)?;
    Ok((answer, c.server_leaf.take()))
}

/// An HTTP/1.1 GET from inside `ns` to `addr` with `host`: (status, body).
pub fn http_get_in(ns: &Netns, addr: SocketAddr, host: &str) -> io::Result<(u16, String)> {
    http_get(connect_in(ns, addr)?, host)
}

fn http_get(mut s: TcpStream, host: &str) -> io::Result<(u16, String)> {
    s.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, body.to_string()))
}

/// The provider every TLS config here uses.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn roots(ca_pem: &str) -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for der in pem_blocks(ca_pem, "CERTIFICATE") {
        roots
            .add(CertificateDer::from(der))
            .expect("a CA certificate");
    }
    roots
}

/// A TLS client that trusts `ca_pem` (the server's chain must lead to it; its name is
/// not checked: an SVID carries a URI SAN, not a DNS name) and presents `identity`'s
/// certificate when given.
pub fn tls_client(ca_pem: &str, identity: Option<&TestSvid>) -> Arc<ClientConfig> {
    let provider = provider();
    let verifier = BundleVerifier {
        roots: roots(ca_pem),
        algs: provider.signature_verification_algorithms,
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("rustls protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    Arc::new(match identity {
        Some(id) => builder
            .with_client_auth_cert(vec![id.leaf()], id.key())
            .expect("the client's SVID"),
        None => builder.with_no_client_auth(),
    })
}

/// [`tls_client`] with the client certificate given as PEM (chain, PKCS#8 key), speaking
/// HTTP/2 (ALPN `h2`): a gRPC client of a registrar with mutual TLS.
pub fn tls_client_pem(ca_pem: &str, identity: Option<(&str, &str)>) -> Arc<ClientConfig> {
    let provider = provider();
    let verifier = BundleVerifier {
        roots: roots(ca_pem),
        algs: provider.signature_verification_algorithms,
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("rustls protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let mut config = match identity {
        Some((chain, key)) => {
            let chain = pem_blocks(chain, "CERTIFICATE")
                .into_iter()
                .map(CertificateDer::from)
                .collect();
            let key = pem_blocks(key, "PRIVATE KEY").pop().expect("a PKCS#8 key");
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)))
                .expect("the client's certificate")
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// A TLS server presenting `identity` and requiring a client certificate that leads to
/// `ca_pem`.
pub fn mtls_server(ca_pem: &str, identity: &TestSvid) -> Arc<ServerConfig> {
    let provider = provider();
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca_pem)), provider.clone())
            .build()
            .expect("the client certificate verifier");
    Arc::new(
        ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("rustls protocol versions")
            .with_client_cert_verifier(verifier)
            .with_single_cert(vec![identity.leaf()], identity.key())
            .expect("the server's SVID"),
    )
}

/// Checks the server's chain against the trust bundle, not its name.
#[derive(Debug)]
struct BundleVerifier {
    roots: RootCertStore,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for BundleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.algs)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.algs)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algs.supported_schemes()
    }
}

// ---- SVIDs ----

/// A test trust domain's CA: self-signed ECDSA P-256, minting X.509-SVIDs.
pub struct TestCa {
    pub trust_domain: String,
    key: KeyPair,
    cert: rcgen::Certificate,
}

/// An SVID as the node takes it, with its DER forms for rustls.
#[derive(Clone)]
pub struct TestSvid {
    pub svid: Svid,
    pub leaf_der: Vec<u8>,
    key_der: Vec<u8>,
}

impl TestSvid {
    pub fn leaf(&self) -> CertificateDer<'static> {
        CertificateDer::from(self.leaf_der.clone())
    }

    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl TestCa {
    pub fn new(trust_domain: &str) -> TestCa {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params.subject_alt_names = vec![SanType::URI(
            format!("spiffe://{trust_domain}")
                .try_into()
                .expect("a URI"),
        )];
        params.distinguished_name.push(
            DnType::CommonName,
            format!("aether data-path test CA ({trust_domain})"),
        );
        params.serial_number = Some(SerialNumber::from_slice(&next_serial()));
        let cert = params.self_signed(&key).expect("self-signing the CA");
        TestCa {
            trust_domain: trust_domain.to_string(),
            key,
            cert,
        }
    }

    /// The CA certificate, PEM: the trust bundle.
    pub fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A new SVID `spiffe://<trust domain>/ns/<ns>/pod/<pod>` with a serial of its own,
    /// valid from an hour ago for a day.
    pub fn mint(&self, ns: &str, pod: &str) -> TestSvid {
        self.mint_id(&format!("spiffe://{}/ns/{ns}/pod/{pod}", self.trust_domain))
    }

    /// [`Self::mint`] for any SPIFFE ID, also one outside this CA's trust domain.
    pub fn mint_id(&self, spiffe_id: &str) -> TestSvid {
        let spiffe_id = spiffe_id.to_string();
        let key = KeyPair::generate().expect("an SVID key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("SVID parameters");
        params.subject_alt_names = vec![SanType::URI(spiffe_id.clone().try_into().expect("a URI"))];
        // CA:false written as an empty critical basicConstraints SEQUENCE, as SPIRE does
        // (rcgen's ExplicitNoCa encodes the DEFAULT, which DER forbids).
        params.is_ca = IsCa::NoCa;
        let mut basic = CustomExtension::from_oid_content(&[2, 5, 29, 19], vec![0x30, 0x00]);
        basic.set_criticality(true);
        params.custom_extensions = vec![basic];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
            KeyUsagePurpose::KeyAgreement,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params
            .distinguished_name
            .push(DnType::OrganizationName, "SPIRE");
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs();
        let (not_before, not_after) = (now - 3600, now + 86_400);
        params.not_before = (SystemTime::UNIX_EPOCH + Duration::from_secs(not_before)).into();
        params.not_after = (SystemTime::UNIX_EPOCH + Duration::from_secs(not_after)).into();
        let serial = next_serial();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .expect("signing an SVID");
        TestSvid {
            svid: Svid {
                spiffe_id,
                chain_pem: cert.pem(),
                key_pem: key.serialize_pem(),
                serial: hex(&serial),
                not_before,
                not_after,
            },
            leaf_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        }
    }
}

/// 16 bytes, unique in the process; the first in 0x10..=0x7f, so the number is positive
/// and its hex (as Envoy's `/certs` prints it) has exactly 32 digits.
fn next_serial() -> [u8; 16] {
    static COUNTER: AtomicU64 = AtomicU64::new(1);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut serial = [0u8; 16];
    serial[..8].copy_from_slice(&(nanos ^ u64::from(std::process::id()) << 40).to_be_bytes());
    serial[8..].copy_from_slice(&count.to_be_bytes());
    serial[0] = 0x10 + serial[0] % 0x70;
    serial
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The DER bodies of the PEM blocks labelled `label` in `pem`.
pub fn pem_blocks(pem: &str, label: &str) -> Vec<Vec<u8>> {
    let (begin, end) = (
        format!("-----BEGIN {label}-----"),
        format!("-----END {label}-----"),
    );
    let mut out = Vec::new();
    let mut rest = pem;
    while let Some(i) = rest.find(&begin) {
        let after = &rest[i + begin.len()..];
        let Some(j) = after.find(&end) else { break };
        out.push(base64_decode(&after[..j]));
        rest = &after[j + end.len()..];
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for v in text.bytes().filter_map(value) {
        acc = acc << 6 | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

// ---- certificate fields ----

/// The next DER element of `input`: (tag, contents, what follows).
pub(crate) fn der_next(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&len0, rest) = rest.split_first()?;
    let (len, rest) = if len0 < 0x80 {
        (usize::from(len0), rest)
    } else {
        let n = usize::from(len0 & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        (
            rest[..n]
                .iter()
                .fold(0usize, |acc, b| acc << 8 | usize::from(*b)),
            &rest[n..],
        )
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// The elements of a DER TBSCertificate, after the certificate's outer SEQUENCE.
fn tbs_elements(cert_der: &[u8]) -> Vec<(u8, &[u8])> {
    let Some((0x30, cert, _)) = der_next(cert_der) else {
        return vec![];
    };
    let Some((0x30, mut tbs, _)) = der_next(cert) else {
        return vec![];
    };
    let mut out = Vec::new();
    while let Some((tag, body, rest)) = der_next(tbs) {
        out.push((tag, body));
        tbs = rest;
    }
    out
}

/// The URI SANs of a DER certificate.
pub fn uri_sans(cert_der: &[u8]) -> Vec<String> {
    const SAN_OID: &[u8] = &[0x55, 0x1d, 0x11];
    let mut out = Vec::new();
    let Some((_, exts)) = tbs_elements(cert_der)
        .into_iter()
        .find(|(tag, _)| *tag == 0xa3)
    else {
        return out;
    };
    let Some((0x30, mut exts, _)) = der_next(exts) else {
        return out;
    };
    while let Some((_, ext, rest)) = der_next(exts) {
        exts = rest;
        let Some((0x06, oid, mut fields)) = der_next(ext) else {
            continue;
        };
        if oid != SAN_OID {
            continue;
        }
        // [critical BOOLEAN] extnValue OCTET STRING { GeneralNames }
        while let Some((tag, body, rest)) = der_next(fields) {
            fields = rest;
            if tag != 0x04 {
                continue;
            }
            let Some((0x30, mut names, _)) = der_next(body) else {
                continue;
            };
            while let Some((tag, name, rest)) = der_next(names) {
                names = rest;
                if tag == 0x86 {
                    out.push(String::from_utf8_lossy(name).into_owned());
                }
            }
        }
    }
    out
}

/// The serial number of a DER certificate in lowercase hex, leading zero bytes dropped,
/// as Envoy's admin `/certs` prints it.
pub fn serial_hex(cert_der: &[u8]) -> Option<String> {
    let elements = tbs_elements(cert_der);
    let serial = elements.iter().find(|(tag, _)| *tag == 0x02)?.1;
    let first = serial.iter().position(|b| *b != 0).unwrap_or(serial.len());
    Some(hex(&serial[first..]))
}

/// An address on the pod port.
pub fn pod_addr(ip: Ipv4Addr) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), POD_PORT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svids_carry_their_spiffe_id_serial_and_key() {
        let ca = TestCa::new("aether.test");
        let a = ca.mint("default", "web");
        let b = ca.mint("default", "web");
        assert_eq!(a.svid.spiffe_id, "spiffe://aether.test/ns/default/pod/web");
        assert_eq!(uri_sans(&a.leaf_der), vec![a.svid.spiffe_id.clone()]);
        assert_eq!(
            serial_hex(&a.leaf_der).as_deref(),
            Some(a.svid.serial.as_str())
        );
        assert_eq!(a.svid.serial.len(), 32);
        assert_ne!(
            a.svid.serial, b.svid.serial,
            "each SVID has a serial of its own"
        );
        assert!(
            a.svid.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"),
            "PKCS#8"
        );
        assert_eq!(
            pem_blocks(&a.svid.chain_pem, "CERTIFICATE"),
            vec![a.leaf_der.clone()]
        );
        assert_eq!(
            pem_blocks(&a.svid.key_pem, "PRIVATE KEY"),
            vec![a.key_der.clone()]
        );
    }

    #[test]
    fn a_client_and_a_server_of_one_trust_domain_agree_and_a_foreign_client_is_refused() {
        let ca = TestCa::new("aether.test");
        let other = TestCa::new("other.test");
        let server = ca.mint("default", "web");
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let pod = PodServer::start(
            "web".into(),
            listener,
            Serve::Http(Some(mtls_server(&ca.pem(), &server))),
        );
        let ask = |id: Option<&TestSvid>| -> Result<Option<Vec<u8>>, String> {
            let s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
            let conn = ClientConnection::new(
                tls_client(&ca.pem(), id),
                ServerName::IpAddress(addr.ip().into()),
            )
            .unwrap();
            let mut stream = StreamOwned::new(conn, s);
            stream
                .write_all(b"GET / HTTP/1.1\r\nHost: web\r\n\r\n")
                .map_err(|e| e.to_string())?;
            let mut buf = Vec::new();
            read_line(&mut stream, &mut buf)
                .map_err(|e| e.to_string())?
                .ok_or("closed")?;
            Ok(stream
                .conn
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.to_vec()))
        };
        let client = ca.mint("default", "client");
        assert_eq!(ask(Some(&client)).unwrap(), Some(server.leaf_der.clone()));
        assert!(
            ask(Some(&other.mint("default", "client"))).is_err(),
            "a foreign client certificate is refused"
        );
        assert!(
            ask(None).is_err(),
            "a client without a certificate is refused"
        );
        assert_eq!(pod.served(), 1);
        assert_eq!(pod.peers(), vec![client.svid.spiffe_id.clone()]);
    }
}
