//! A test identity provider: a test double of a SPIRE agent, for the tests of the agent's
//! workload identity. No SPIRE binary can be installed here; this one speaks the real
//! APIs on unix sockets, so that the real clients (the `spiffe` and `spire-api` crates,
//! Python's `spiffe`) talk to it as to SPIRE. Nothing shipped links it.
//!
//! - the SPIFFE Workload API (`SpiffeWorkloadAPI`, [`workload`]) on
//!   [`IdentityProvider::workload_socket`]: the caller is the agent and gets
//!   `spiffe://<trust-domain>/aether/agent` (configurable, [`Options::agent_path`]);
//! - SPIRE's Delegated Identity API (`spire.api.agent.delegatedidentity.v1`, [`delegated`])
//!   on [`IdentityProvider::delegated_socket`]: a pod, named by the selectors
//!   `k8s:ns:<namespace>`, `k8s:pod-name:<name>`, `k8s:pod-uid:<uid>`, gets
//!   `spiffe://<trust-domain>/ns/<namespace>/pod/<name>`. As SPIRE, it serves only callers
//!   whose attested SPIFFE ID is an authorized delegate, and sends no SVID for selectors
//!   that match no registration entry.
//!
//! The SVIDs are real X.509-SVIDs from a CA made at start ([`ca`]). The test drives the
//! provider: rotations pushed on the open streams, pods held back, the whole provider down
//! and up again on the same paths; and reads it: current serials (as Envoy's admin
//! `/certs` prints them) and the open streams per pod ([`state`] keeps them).
//!
//! It runs on its own thread with its own tokio runtime (as [`crate::kube_api`]), so every
//! method is a plain blocking call that works under any test, synchronous or async. The
//! ones that wait ([`IdentityProvider::set_down`], [`IdentityProvider::wait_for_streams`])
//! block the calling thread: from async code call them in a multi-thread runtime (or
//! `spawn_blocking`), so that the client's own connection tasks go on meanwhile.

#![forbid(unsafe_code)]

mod ca;
mod delegated;
mod server;
mod state;
mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::sync::{oneshot, watch};
use tonic::Status;

pub use ca::serial_hex;
pub use workload::HEADER as WORKLOAD_API_HEADER;

use ca::Ca;
use state::Shared;

/// The generated messages, servers and clients of both APIs (from `e2e/proto`).
// The vendored protos' comments become the docs, in their own style.
#[allow(clippy::doc_lazy_continuation)]
pub mod pb {
    /// The SPIFFE Workload API; its proto has no package.
    pub mod workload {
        tonic::include_proto!("_");
    }
    pub mod spire {
        pub mod api {
            pub mod agent {
                pub mod delegatedidentity {
                    pub mod v1 {
                        tonic::include_proto!("spire.api.agent.delegatedidentity.v1");
                    }
                }
            }
            pub mod types {
                tonic::include_proto!("spire.api.types");
            }
        }
    }
}

/// How an [`IdentityProvider`] starts.
#[derive(Clone, Debug)]
pub struct Options {
    /// A bare trust domain name, such as `example.org`.
    pub trust_domain: String,
    /// The path of the agent's SPIFFE ID (`/aether/agent`).
    pub agent_path: String,
    /// How long each minted SVID is valid (1 h); see also
    /// [`IdentityProvider::set_svid_lifetime`].
    pub svid_lifetime: Duration,
}

impl Options {
    pub fn new(trust_domain: &str) -> Options {
        Options {
            trust_domain: trust_domain.to_owned(),
            agent_path: "/aether/agent".to_owned(),
            svid_lifetime: Duration::from_secs(3600),
        }
    }
}

/// The running provider; stops on Drop (its socket files stay in the caller's dir).
pub struct IdentityProvider {
    shared: Arc<Shared>,
    workload_socket: PathBuf,
    delegated_socket: PathBuf,
    down: watch::Sender<bool>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl IdentityProvider {
    /// Starts a provider for `trust_domain` with the default [`Options`], its sockets in
    /// `dir` (`workload.sock`, `delegated.sock`). Returns once both accept connections.
    pub fn start(dir: &Path, trust_domain: &str) -> anyhow::Result<IdentityProvider> {
        IdentityProvider::start_with(dir, Options::new(trust_domain))
    }

    pub fn start_with(dir: &Path, options: Options) -> anyhow::Result<IdentityProvider> {
        if !options.agent_path.starts_with('/') || options.agent_path.len() < 2 {
            bail!(
                "the agent path {:?} must start with '/' and name something",
                options.agent_path
            );
        }
        let ca = Ca::new(&options.trust_domain)?;
        let agent_id = format!("spiffe://{}{}", options.trust_domain, options.agent_path);
        let shared = Arc::new(Shared::new(ca, agent_id, options.svid_lifetime)?);
        let workload_socket = dir.join("workload.sock");
        let delegated_socket = dir.join("delegated.sock");
        for p in [&workload_socket, &delegated_socket] {
            // sockaddr_un holds 108 bytes with the terminating NUL.
            if p.as_os_str().len() > 107 {
                bail!("{} is too long for a unix socket path", p.display());
            }
        }
        let (down, down_rx) = watch::channel(false);
        let (stop, stop_rx) = oneshot::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let thread = {
            let shared = shared.clone();
            let paths = [workload_socket.clone(), delegated_socket.clone()];
            std::thread::Builder::new()
                .name("identity-provider".into())
                .spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("the identity provider's runtime");
                    runtime.block_on(async move {
                        // Bound inside the runtime: a tokio listener needs its reactor.
                        let listeners = match (server::bind(&paths[0]), server::bind(&paths[1])) {
                            (Ok(a), Ok(b)) => [a, b],
                            (Err(e), _) | (_, Err(e)) => {
                                let _ = started_tx.send(Err(e));
                                return;
                            }
                        };
                        let _ = started_tx.send(Ok(()));
                        tokio::select! {
                            _ = server::serve(shared, [&paths[0], &paths[1]], Some(listeners), down_rx) => {}
                            _ = stop_rx => {}
                        }
                    });
                })
                .context("spawning the identity provider's thread")?
        };
        started_rx
            .recv()
            .context("the identity provider's thread ended")?
            .context("binding the identity provider's sockets")?;
        let provider = IdentityProvider {
            shared,
            workload_socket,
            delegated_socket,
            down,
            stop: Some(stop),
            thread: Some(thread),
        };
        provider.shared.wait_until("listening", |s| s.listening);
        Ok(provider)
    }

    /// The Workload API socket (for a client: `unix:<path>`).
    pub fn workload_socket(&self) -> PathBuf {
        self.workload_socket.clone()
    }

    /// The Delegated Identity API socket (for a client: `unix:<path>`).
    pub fn delegated_socket(&self) -> PathBuf {
        self.delegated_socket.clone()
    }

    pub fn trust_domain(&self) -> &str {
        self.shared.ca.trust_domain()
    }

    /// The trust bundle: the CA certificate, PEM.
    pub fn ca_pem(&self) -> String {
        self.shared.ca.pem()
    }

    /// The trust bundle: the CA certificate, DER (what both APIs send).
    pub fn ca_der(&self) -> Vec<u8> {
        self.shared.ca.der().to_vec()
    }

    /// The agent's SPIFFE ID.
    pub fn agent_spiffe_id(&self) -> String {
        self.shared.lock().agent_id.clone()
    }

    /// The SPIFFE ID a pod gets: `spiffe://<trust-domain>/ns/<namespace>/pod/<name>`.
    pub fn pod_spiffe_id(&self, namespace: &str, name: &str) -> String {
        format!("spiffe://{}/ns/{namespace}/pod/{name}", self.trust_domain())
    }

    /// The lifetime of the SVIDs minted from now on (rotations, new pods, [`Self::mint`]).
    pub fn set_svid_lifetime(&self, lifetime: Duration) {
        self.shared.update(|s| s.lifetime = lifetime);
    }

    /// New SVIDs (new keys, new serials) for the agent and every known pod, sent on their
    /// open streams (a held pod's when released).
    pub fn rotate_all(&self) {
        let td = self.trust_domain();
        self.shared.update(|s| {
            s.agent = self.shared.mint(s, &s.agent_id);
            let response = workload::svid_response(&s.agent, self.shared.ca.der());
            for tx in s.agent_streams.values() {
                let _ = tx.send(Ok(response.clone()));
            }
            let uids: Vec<String> = s.pods.keys().cloned().collect();
            for uid in uids {
                rotate(&self.shared, s, &uid, td);
            }
        });
    }

    /// A new SVID for the pod, sent on its open streams (when released if held). Panics if
    /// no subscription ever named the pod.
    pub fn rotate_pod(&self, uid: &str) {
        let td = self.trust_domain();
        self.shared.update(|s| {
            assert!(
                s.pods.contains_key(uid),
                "test identity provider: no pod with uid {uid} was ever subscribed"
            );
            rotate(&self.shared, s, uid, td);
        });
    }

    /// From now on the pod's SVID is sent on none of its streams (new or open) until
    /// [`Self::release_pod`]. The pod need not be known yet.
    pub fn hold_pod(&self, uid: &str) {
        self.shared.update(|s| s.held.insert(uid.to_owned()));
    }

    /// Ends [`Self::hold_pod`]: each open stream of the pod that has not had the current
    /// SVID gets it now.
    pub fn release_pod(&self, uid: &str) {
        let td = self.trust_domain();
        self.shared.update(|s| {
            s.held.remove(uid);
            sync(s, uid, td);
        });
    }

    /// The SPIFFE IDs allowed to call the Delegated Identity API, as SPIRE's
    /// `authorized_delegates` (the agent's alone at start). Checked on each new call.
    pub fn set_authorized_delegates(&self, ids: &[&str]) {
        self.shared.update(|s| {
            s.authorized_delegates = ids.iter().map(|id| (*id).to_owned()).collect();
        });
    }

    /// The SPIFFE ID that a Delegated Identity caller with unix uid `uid` attests to (None:
    /// no entry matches it). A uid never set attests to the agent's SPIFFE ID.
    pub fn set_caller_entry(&self, uid: u32, spiffe_id: Option<&str>) {
        self.shared.update(|s| {
            s.callers.insert(uid, spiffe_id.map(str::to_owned));
        });
    }

    /// The namespaces whose pods a registration entry matches (None: every namespace, as at
    /// start). Each open stream of a pod that gains or loses its entry gets its SVID, or a
    /// response with none, as SPIRE's cache sends them.
    pub fn set_pod_namespaces(&self, namespaces: Option<&[&str]>) {
        let td = self.trust_domain();
        self.shared.update(|s| {
            s.pod_namespaces = namespaces.map(|n| n.iter().map(|x| (*x).to_owned()).collect());
            let uids: Vec<String> = s.pods.keys().cloned().collect();
            for uid in uids {
                sync(s, &uid, td);
            }
        });
    }

    /// Down: every open stream ends with UNAVAILABLE, new calls get UNAVAILABLE, then
    /// both listeners close (connects are refused; the socket files stay). Up: both paths
    /// are listened on again. The CA, the SVIDs and the holds are kept. Returns once done.
    pub fn set_down(&self, down: bool) {
        if down {
            self.shared.update(|s| {
                s.down = true;
                s.close_all(&Status::unavailable(
                    "the test identity provider is going down",
                ));
            });
            self.down.send_replace(true);
            self.shared
                .wait_until("going down", |s| !s.listening && s.open_streams() == 0);
        } else {
            self.shared.update(|s| s.down = false);
            self.down.send_replace(false);
            self.shared.wait_until("listening again", |s| s.listening);
        }
    }

    /// The serial number of the pod's current SVID as Envoy's admin `/certs` prints it
    /// (lowercase hex); None if no subscription ever named the pod.
    pub fn serial_of_pod(&self, uid: &str) -> Option<String> {
        self.shared
            .lock()
            .pods
            .get(uid)
            .map(|p| p.svid.serial.clone())
    }

    /// The serial number of the agent's current SVID, as [`Self::serial_of_pod`].
    pub fn serial_of_agent(&self) -> String {
        self.shared.lock().agent.serial.clone()
    }

    /// Each pod ever subscribed (by uid, sorted) with its open SubscribeToX509SVIDs streams
    /// (0 once all closed).
    pub fn subscriptions(&self) -> Vec<(String, usize)> {
        self.shared
            .lock()
            .pods
            .iter()
            .map(|(uid, p)| (uid.clone(), p.streams.len()))
            .collect()
    }

    /// How many SubscribeToX509SVIDs streams were ever opened for the pod (0 if none).
    pub fn streams_opened(&self, uid: &str) -> u64 {
        self.shared.lock().pods.get(uid).map_or(0, |p| p.opened)
    }

    /// Open Workload API FetchX509SVID streams (the agent's own).
    pub fn agent_streams(&self) -> usize {
        self.shared.lock().agent_streams.len()
    }

    /// Blocks until the pod has exactly `n` open streams; panics after 10 s. See the module
    /// doc on calling it from async code.
    pub fn wait_for_streams(&self, uid: &str, n: usize) {
        self.shared
            .wait_until(&format!("{n} open streams for pod {uid}"), |s| {
                s.pods.get(uid).map_or(0, |p| p.streams.len()) == n
            });
    }

    /// Blocks until the Workload API has exactly `n` open FetchX509SVID streams; panics
    /// after 10 s.
    pub fn wait_for_agent_streams(&self, n: usize) {
        self.shared
            .wait_until(&format!("{n} open FetchX509SVID streams"), |s| {
                s.agent_streams.len() == n
            });
    }

    /// An SVID from this provider's CA for `spiffe_id` (a test client's): the certificate
    /// chain (the leaf alone) and the PKCS#8 key, both PEM. Not tracked by the provider.
    pub fn mint(&self, spiffe_id: &str) -> (String, String) {
        let svid = {
            let s = self.shared.lock();
            self.shared.mint(&s, spiffe_id)
        };
        (svid.cert_pem, svid.key_pem)
    }

    /// [`Self::mint`] with IP address SANs too: a server certificate (the registrar's)
    /// that clients checking the SPIFFE ID and clients checking the address both accept.
    pub fn mint_server(&self, spiffe_id: &str, ips: &[std::net::IpAddr]) -> (String, String) {
        let lifetime = self.shared.lock().lifetime;
        let svid = self
            .shared
            .ca
            .mint_with_ips(spiffe_id, lifetime, ips)
            .unwrap_or_else(|e| panic!("minting {spiffe_id}: {e:#}"));
        (svid.cert_pem, svid.key_pem)
    }

    /// An SVID from a fresh CA of another trust domain (for tests that expect refusal):
    /// the chain (the leaf alone) and the PKCS#8 key, both PEM; valid for 1 h.
    pub fn mint_foreign(trust_domain: &str, spiffe_id: &str) -> (String, String) {
        let ca = Ca::new(trust_domain).unwrap_or_else(|e| panic!("a CA for {trust_domain}: {e:#}"));
        let svid = ca
            .mint(spiffe_id, Duration::from_secs(3600))
            .unwrap_or_else(|e| panic!("minting {spiffe_id}: {e:#}"));
        (svid.cert_pem, svid.key_pem)
    }
}

/// A new SVID for pod `uid`, pushed unless held.
fn rotate(shared: &Shared, s: &mut state::State, uid: &str, trust_domain: &str) {
    let id = s.pods[uid].svid.spiffe_id.clone();
    let svid = shared.mint(s, &id);
    s.pods.get_mut(uid).expect("checked by the caller").svid = svid;
    sync(s, uid, trust_domain);
}

/// Brings pod `uid`'s open streams (if the pod is known) to what they should have.
fn sync(s: &mut state::State, uid: &str, trust_domain: &str) {
    let held = s.held.contains(uid);
    let Some(entry) = s.pods.get(uid).map(|p| s.has_entry(&p.namespace)) else {
        return;
    };
    let pod = s.pods.get_mut(uid).expect("found above");
    delegated::push(pod, trust_domain, entry, held);
}

impl Drop for IdentityProvider {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            // A panic on the provider's thread has been printed already; don't turn it into
            // a second one (possibly during an unwind) here.
            let _ = thread.join();
        }
    }
}
