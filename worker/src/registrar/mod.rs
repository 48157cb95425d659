//! The registrar client: this node's view of the mesh registry, watched over the
//! registry API (`aether.registry.v1`), and the owner's drain marks.
//!
//! # The watch
//! One `WatchEndpoints` stream keyed by cluster, node and instance (this agent's pod
//! name), so an owner and its standby each keep their own stream for the whole overlap.
//! The first full view sets the registry gate; each later batch goes through the
//! [`Mirror`] to the node as upserts or removals of the services it touched, never as a
//! re-read of the whole view. When the stream ends the client reconnects with jittered
//! backoff (0.1 s doubling to 1 s), to the next of the `--registrar` addresses, and
//! resumes from its revision: the registrar sends only what changed since, or a full
//! view marked `resync` when it cannot. Until the first full view the gate stays shut:
//! a standby is not complete, and `/ready` names the problem.
//!
//! # QUIC pairs
//! [`pairs`] states the owner's QUIC pair set with `SetQuicPairs`, started only when the
//! owner serves.
//!
//! # Drain marks
//! [`Marks`] is the owner's handle: the CNI API, which only the owner serves, sends it a
//! deleted pod's IPs, and a task sets their endpoints DRAINING with `SetEndpointState`,
//! retrying while the registrar is unreachable. A standby holds no handle and so writes
//! nothing; nothing is deregistered on exit. The registrar marks only the services whose
//! endpoint at the address is on this node; the others it names in its answer, logged.

mod mirror;
pub mod pairs;
pub mod pending;
pub mod spiffe_tls;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hyper_util::rt::TokioIo;
use shared_proto::registry as pb;
use shared_proto::registry::registry_client::RegistryClient;
use shared_proto::registry_tls;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};
use tracing::{debug, info, warn};

use crate::backoff::{Backoff, seed};
use crate::health::{RegistrarStatus, Reporter};
use crate::metrics::Metrics;
use crate::node::Node;
pub use mirror::Mirror;

/// The problem source `/ready` names while the registrar cannot be reached.
pub const PROBLEM: &str = "registrar";
/// How long one connect attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One registrar address: `unix:///path` or `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    Tcp(String),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix://{}", p.display()),
            Address::Tcp(a) => f.write_str(a),
        }
    }
}

/// Parses `--registrar`: a comma-separated list of addresses, as a Service spreads them.
pub fn parse_addresses(list: &str) -> anyhow::Result<Vec<Address>> {
    let mut out = Vec::new();
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        if let Some(path) = a.strip_prefix("unix://") {
            anyhow::ensure!(
                path.starts_with('/'),
                "--registrar {a:?}: a unix address needs an absolute path (unix:///run/registrar.sock)"
            );
            out.push(Address::Unix(path.into()));
        } else {
            let (host, port) = a.rsplit_once(':').with_context(|| {
                format!("--registrar {a:?}: expected host:port or unix:///path")
            })?;
            anyhow::ensure!(
                !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0),
                "--registrar {a:?}: expected host:port with a port in 1..=65535"
            );
            out.push(Address::Tcp(a.to_owned()));
        }
    }
    anyhow::ensure!(!out.is_empty(), "--registrar {list:?}: no address");
    Ok(out)
}

/// Who this agent is to the registrar.
#[derive(Debug, Clone)]
pub struct Identity {
    pub cluster: String,
    pub node: String,
    pub instance: String,
    /// A bearer token to present (`--registrar-token-file`): the pod's projected
    /// service-account token, read again at each call since the kubelet rotates it.
    pub token_file: Option<PathBuf>,
    /// The CA bundle to check a TCP registrar's certificate against (`--registrar-ca`):
    /// with it, TCP addresses are spoken to over TLS. Read again at each connect, so a
    /// rotated bundle is picked up.
    pub ca_file: Option<PathBuf>,
    /// The registrar's SPIFFE ID (`--registrar-spiffe-id`): with it, TCP addresses are
    /// spoken to over mutual TLS with the agent's SVID, the registrar's certificate checked
    /// against the trust bundle and this ID.
    pub registrar_spiffe_id: Option<String>,
    /// The agent's SVID and the trust bundle as the node holds them (workload identity on).
    pub credentials: Option<Credentials>,
}

/// The agent's SVID and the trust bundle, read from the node at each connect: a
/// connection made after a rotation presents the new SVID.
#[derive(Clone)]
pub struct Credentials(pub Arc<Node>);

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials")
    }
}

impl Credentials {
    fn current(&self) -> (Option<aether_model::Svid>, Option<String>) {
        self.0
            .with_inputs(|i| (i.identity.agent.clone(), i.identity.bundle.clone()))
    }
}

impl Identity {
    /// `message` as a request carrying this agent's token, if it has one.
    fn request<T>(&self, message: T) -> anyhow::Result<tonic::Request<T>> {
        let mut req = tonic::Request::new(message);
        if let Some(path) = &self.token_file {
            let token = std::fs::read_to_string(path)
                .with_context(|| format!("reading --registrar-token-file {}", path.display()))?;
            let value = format!("Bearer {}", token.trim()).parse().map_err(|_| {
                anyhow::anyhow!(
                    "--registrar-token-file {}: not a valid header value",
                    path.display()
                )
            })?;
            req.metadata_mut().insert("authorization", value);
        }
        Ok(req)
    }
}

/// Connects to `addr`, with HTTP/2 keepalives so a registrar that stops answering ends
/// the stream instead of holding it; over TLS to a TCP address when `me` has a CA file
/// or the registrar's SPIFFE ID, presenting the agent's SVID where it has one.
async fn connect(addr: &Address, me: &Identity) -> anyhow::Result<RegistryClient<Channel>> {
    let endpoint = |uri: String| -> anyhow::Result<Endpoint> {
        Ok(Endpoint::from_shared(uri)?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true))
    };
    let (svid, bundle) = me
        .credentials
        .as_ref()
        .map_or((None, None), Credentials::current);
    let channel = match (addr, &me.ca_file) {
        (Address::Tcp(a), _) if me.registrar_spiffe_id.is_some() => {
            let want = me.registrar_spiffe_id.as_deref().unwrap_or_default();
            let svid = svid.context(
                "the agent's SVID has not come from the Workload API yet (--registrar-spiffe-id needs it)",
            )?;
            let bundle =
                bundle.context("the trust bundle has not come from the Workload API yet")?;
            let config = spiffe_tls::client_config(&svid, &bundle, want)?;
            debug!(registrar = %a, serial = %svid.serial, "connecting with the agent's SVID");
            tokio::time::timeout(
                CONNECT_TIMEOUT,
                registry_tls::channel(endpoint("http://registrar.invalid".into())?, a, config),
            )
            .await??
        }
        (Address::Tcp(a), None) => {
            tokio::time::timeout(CONNECT_TIMEOUT, endpoint(format!("http://{a}"))?.connect())
                .await??
        }
        (Address::Tcp(a), Some(ca)) => {
            // With workload identity, the SVID the node holds now is the client certificate.
            let client = svid.as_ref().map(spiffe_tls::client_cert).transpose()?;
            let config = registry_tls::client_config_with(ca, client).context("--registrar-ca")?;
            tokio::time::timeout(
                CONNECT_TIMEOUT,
                registry_tls::channel(endpoint("http://registrar.invalid".into())?, a, config),
            )
            .await??
        }
        (Address::Unix(path), _) => {
            let path = path.clone();
            let connector = tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    tokio::net::UnixStream::connect(path)
                        .await
                        .map(TokioIo::new)
                }
            });
            tokio::time::timeout(
                CONNECT_TIMEOUT,
                endpoint("http://registrar.invalid".into())?.connect_with_connector(connector),
            )
            .await??
        }
    };
    Ok(RegistryClient::new(channel).max_decoding_message_size(256 << 20))
}

/// The registrar's reconnect backoff: 0.1 s doubling to 1 s, jittered.
fn backoff() -> Backoff {
    Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).jittered(seed())
}

/// Watches the registrar at `addrs` until the task is aborted, feeding the node.
pub fn spawn(
    addrs: Vec<Address>,
    me: Identity,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    problems: Reporter,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut mirror = Mirror::default();
        let mut full_views = 0u64;
        let mut backoff = backoff();
        for attempt in 0usize.. {
            let addr = &addrs[attempt % addrs.len()];
            match watch_once(
                addr,
                &me,
                &mut mirror,
                &mut full_views,
                &node,
                &metrics,
                &problems,
            )
            .await
            {
                Ok(progressed) => {
                    if progressed {
                        backoff.reset();
                    }
                    warn!(registrar = %addr, revision = mirror.revision(), "registrar stream ended; reconnecting");
                    problems.set(
                        PROBLEM,
                        format!(
                            "registrar {addr}: stream ended at revision {}; reconnecting",
                            mirror.revision()
                        ),
                    );
                }
                Err((progressed, e)) => {
                    if progressed {
                        backoff.reset();
                    }
                    let state = if mirror.loaded() {
                        "serving the last view"
                    } else {
                        "registry not loaded"
                    };
                    warn!(registrar = %addr, revision = mirror.revision(), error = %format!("{e:#}"), "registrar unreachable; {state}");
                    problems.set(PROBLEM, format!("registrar {addr}: {e:#} ({state})"));
                }
            }
            metrics.registrar_connected.set(0);
            tokio::time::sleep(backoff.next_wait()).await;
        }
    })
}

/// One stream: connect, watch from the mirror's revision, apply until it ends. Says
/// whether anything arrived, so the backoff starts over after a stream that worked.
async fn watch_once(
    addr: &Address,
    me: &Identity,
    mirror: &mut Mirror,
    full_views: &mut u64,
    node: &Node,
    metrics: &Metrics,
    problems: &Reporter,
) -> Result<bool, (bool, anyhow::Error)> {
    let mut client = connect(addr, me)
        .await
        .map_err(|e| (false, e.context("connecting")))?;
    let request = pb::WatchEndpointsRequest {
        cluster: me.cluster.clone(),
        node: me.node.clone(),
        instance: me.instance.clone(),
        resume_revision: mirror.revision(),
    };
    let request = me.request(request).map_err(|e| (false, e))?;
    let mut stream = client
        .watch_endpoints(request)
        .await
        .map_err(|s| (false, watch_error(addr, me, s)))?
        .into_inner();
    metrics.registrar_connected.set(1);
    info!(registrar = %addr, resume_revision = mirror.revision(), instance = %me.instance, "registrar stream open");
    let mut progressed = false;
    // Timed for the full view's log line: the wait for a message (its transfer and
    // decoding included), the mirror's apply and the node's build.
    let mut since = std::time::Instant::now();
    loop {
        let message = match stream.message().await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(progressed),
            Err(s) => return Err((progressed, status_error(s))),
        };
        let arrived = std::time::Instant::now();
        let wait = arrived - since;
        progressed = true;
        let (changes, skipped, full) = match message.kind {
            Some(pb::watch_endpoints_response::Kind::Full(full)) => {
                if full.resync {
                    metrics.registrar_resyncs.inc();
                    warn!(registrar = %addr, reason = %full.reason, revision = full.revision, "registrar sent a full view again (resync)");
                }
                let (c, s) = mirror.apply_full(full);
                *full_views += 1;
                (c, s, true)
            }
            Some(pb::watch_endpoints_response::Kind::Changes(batch)) => {
                metrics.registrar_changes.inc_by(batch.changes.len() as u64);
                let (c, s) = mirror.apply_batch(batch);
                (c, s, false)
            }
            None => continue,
        };
        // Not built into the proxy's configuration; named, and counted.
        metrics
            .registrar_entries_dropped
            .inc_by(skipped.len() as u64);
        for s in skipped {
            warn!(registrar = %addr, entry = %s.0, "registrar entry dropped: {}", s.0);
        }
        let mirrored = arrived.elapsed();
        node.apply(changes);
        let built = arrived.elapsed() - mirrored;
        metrics.registry_revision.set(mirror.revision());
        problems.registrar(RegistrarStatus {
            revision: mirror.revision(),
            services: mirror.services(),
            full_views: *full_views,
        });
        if full {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            info!(
                registrar = %addr, revision = mirror.revision(), services = mirror.services(),
                wait_ms = ms(wait), mirror_ms = ms(mirrored), build_ms = ms(built),
                "registry loaded from the registrar"
            );
        }
        if mirror.loaded() {
            node.set_gate(|g| g.registry_loaded = true);
            problems.clear(PROBLEM);
        }
        since = std::time::Instant::now();
    }
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

/// The watch call's error; a registrar that serves TLS drops a plain HTTP/2 client at its
/// preface, so that case says what probably happened.
fn watch_error(addr: &Address, me: &Identity, s: tonic::Status) -> anyhow::Error {
    let plain = matches!(addr, Address::Tcp(_))
        && me.ca_file.is_none()
        && me.registrar_spiffe_id.is_none()
        && registry_tls::looks_like_plain_to_tls(&s);
    let e = status_error(s);
    if plain {
        e.context("a registrar serving TLS drops plain HTTP/2: set --registrar-ca to its CA")
    } else {
        e
    }
}

/// The owner's drain marks: a deleted pod's IPs, set DRAINING at the registrar.
#[derive(Clone)]
pub struct Marks {
    tx: mpsc::UnboundedSender<IpAddr>,
    pending: Arc<pending::Pending>,
}

impl Marks {
    /// Asks for `ip`'s endpoints on this node to be marked draining, from memory: a mark
    /// that a later DEL asks for again durably (the Terminating marks of the Kubernetes
    /// watch).
    pub fn drain(&self, ip: IpAddr) {
        let _ = self.tx.send(ip);
    }

    /// Makes the marks of `ips` durable ([`pending`]) before they are asked for with
    /// [`Self::drain`]: once this returns, they outlive this process. A failed write is
    /// logged with the folder, and the marks are then kept in memory only.
    pub async fn keep(&self, ips: &[IpAddr]) {
        if ips.is_empty() {
            return;
        }
        let (pending, list) = (self.pending.clone(), ips.to_vec());
        match tokio::task::spawn_blocking(move || pending.add(&list)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(dir = %self.pending.dir().display(), addresses = ?ips, error = %e, "drain marks: cannot keep the marks on disk; they are kept in memory only")
            }
            Err(e) => {
                warn!(addresses = ?ips, error = %e, "drain marks: the write of the pending marks did not finish; they are kept in memory only")
            }
        }
    }

    /// Starts the writer, with the marks a previous owner left in `<state_dir>`'s pending
    /// folder. Only the owner calls this (from serving): a standby has no handle and
    /// writes nothing.
    pub fn spawn(
        addrs: Vec<Address>,
        me: Identity,
        metrics: Arc<Metrics>,
        state_dir: &std::path::Path,
    ) -> Self {
        let pending = Arc::new(pending::Pending::new(state_dir));
        let (tx, rx) = mpsc::unbounded_channel();
        let restored = pending.restore();
        if !restored.is_empty() {
            info!(dir = %pending.dir().display(), marks = restored.len(), addresses = ?restored,
                "drain marks: writing the marks a previous owner answered DELs for and did not write");
            restored.into_iter().for_each(|ip| {
                let _ = tx.send(ip);
            });
        }
        tokio::spawn(mark_writer(addrs, me, metrics, pending.clone(), rx));
        Self { tx, pending }
    }
}

async fn mark_writer(
    addrs: Vec<Address>,
    me: Identity,
    metrics: Arc<Metrics>,
    on_disk: Arc<pending::Pending>,
    mut rx: mpsc::UnboundedReceiver<IpAddr>,
) {
    let mut pending = BTreeSet::new();
    let mut backoff = backoff();
    let mut attempt = 0usize;
    let mut client: Option<RegistryClient<Channel>> = None;
    loop {
        if pending.is_empty() {
            match rx.recv().await {
                Some(ip) => pending.insert(ip),
                None => return,
            };
        }
        while let Ok(ip) = rx.try_recv() {
            pending.insert(ip);
        }
        let addr = &addrs[attempt % addrs.len()];
        let c = match &mut client {
            Some(c) => c,
            None => match connect(addr, &me).await {
                Ok(c) => client.insert(c),
                Err(e) => {
                    warn!(registrar = %addr, pending = pending.len(), error = %format!("{e:#}"), "drain marks: registrar unreachable; retrying");
                    attempt += 1;
                    tokio::time::sleep(backoff.next_wait()).await;
                    continue;
                }
            },
        };
        let ip = *pending.iter().next().expect("not empty");
        let request = pb::SetEndpointStateRequest {
            service: None,
            address: ip.to_string(),
            state: pb::EndpointState::Draining as i32,
            node: me.node.clone(),
            instance: me.instance.clone(),
        };
        let request = match me.request(request) {
            Ok(r) => r,
            Err(e) => {
                warn!(address = %ip, error = %format!("{e:#}"), "drain mark: no token to send; retrying");
                attempt += 1;
                tokio::time::sleep(backoff.next_wait()).await;
                continue;
            }
        };
        let result = match c.set_endpoint_state(request).await {
            Ok(r) => {
                let r = r.into_inner();
                info!(address = %ip, services = r.marked, revision = r.revision, "drain mark set");
                for s in &r.skipped {
                    let service = s
                        .service
                        .as_ref()
                        .map_or_else(String::new, |k| format!("{}/{}", k.namespace, k.name));
                    warn!(address = %ip, service = %service, endpoint_node = %s.endpoint_node,
                        "drain mark: the registrar left a service alone, whose endpoint at this address it places on another node");
                }
                "set"
            }
            Err(s) if s.code() == tonic::Code::NotFound => {
                debug!(address = %ip, "drain mark: no registry endpoint at this address");
                "not_found"
            }
            Err(s) if s.code() == tonic::Code::PermissionDenied => {
                warn!(address = %ip, error = %s.message(), "drain mark refused by the registrar");
                "refused"
            }
            Err(s) => {
                warn!(registrar = %addr, address = %ip, error = %status_error(s), "drain mark failed; retrying");
                metrics
                    .registrar_drain_marks
                    .get_or_create(&crate::metrics::ResultLabel {
                        result: "retry".into(),
                    })
                    .inc();
                client = None;
                attempt += 1;
                tokio::time::sleep(backoff.next_wait()).await;
                continue;
            }
        };
        metrics
            .registrar_drain_marks
            .get_or_create(&crate::metrics::ResultLabel {
                result: result.into(),
            })
            .inc();
        pending.remove(&ip);
        on_disk.done(ip);
        backoff.reset();
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn addresses_parse_and_errors_name_the_value() {
        let a = parse_addresses("unix:///run/r.sock, 127.0.0.1:7000,registrar.mesh:7000").unwrap();
        assert_eq!(
            a,
            vec![
                Address::Unix("/run/r.sock".into()),
                Address::Tcp("127.0.0.1:7000".into()),
                Address::Tcp("registrar.mesh:7000".into())
            ]
        );
        for bad in ["unix://relative", "nohostport", "host:0", "host:99999", ""] {
            let e = parse_addresses(bad).unwrap_err().to_string();
            assert!(e.contains("--registrar"), "{bad}: {e}");
        }
    }
}
