//! A test Kubernetes API server: HTTPS on loopback, speaking the real wire protocol for
//! the resources the agent and the mesh registrar use (pods and nodes: list, watch, get,
//! patch; services, endpoint slices and leases: those and create, update, delete;
//! TokenReview), so that kube-rs and kubectl talk to it as to a cluster. No real API server can run
//! here; this one is a test double and nothing shipped links it.
//!
//! Each user has a bearer token (in the kubeconfig the server writes for it) and only the
//! RBAC rules granted to it; the server records every request per user. Objects are JSON
//! values; every write takes the next value of one resourceVersion counter and is sent to
//! the open watches whose scope it touches. The history of changes can be forgotten
//! ([`KubeApi::expire_history`]) to force 410 Gone, and the server can be taken down and
//! brought back on the same port ([`KubeApi::set_down`]).
//!
//! `resource` describes the resource types; `store` keeps objects, history and watches;
//! `selector`, `patch`, `write` and `timestamps` are the pure semantics of selectors,
//! patches, writes and timestamps; `access` the users; `status` and `discovery` the
//! documents; `server` the HTTPS front; `tls` the certificates.

#![forbid(unsafe_code)]

mod access;
mod discovery;
mod patch;
mod resource;
mod selector;
mod server;
mod status;
mod store;
mod timestamps;
mod tls;
mod write;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::SystemTime;

use serde_json::{Value, json};
use tokio::sync::{oneshot, watch};
use tokio_rustls::TlsAcceptor;

use resource::Resource;
use server::Shared;
use store::Store;

/// An RBAC rule: the verbs granted on a resource, cluster-wide. `resource` is "pods",
/// "nodes", "services", "endpointslices", "leases" or "tokenreviews" (the plural, in
/// whichever API group it lives); a verb "*" grants every verb.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub resource: &'static str,
    pub verbs: &'static [&'static str],
}

/// The running server. It runs on its own thread with its own tokio runtime, so that it
/// works under any test (synchronous or async, either runtime flavour); it stops on Drop.
pub struct KubeApi {
    shared: Arc<Shared>,
    ca_pem: String,
    dir: tempfile::TempDir,
    down: watch::Sender<bool>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl KubeApi {
    /// Starts the server on 127.0.0.1 and a free port, with a fresh CA. Returns once it
    /// accepts connections.
    pub fn start() -> KubeApi {
        let tls = tls::make();
        let acceptor = TlsAcceptor::from(tls.config.clone());
        let dir = tempfile::Builder::new()
            .prefix("kube-api")
            .tempdir()
            .expect("a temp dir for the test API server");
        let (down, down_rx) = watch::channel(false);
        let (stop, stop_rx) = oneshot::channel::<()>();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let uid_prefix = std::process::id()
            ^ SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
        let thread = std::thread::Builder::new()
            .name("kube-api".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("the test API server's runtime");
                runtime.block_on(async move {
                    let listener = server::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
                        .expect("binding the test API server on 127.0.0.1");
                    let address = listener
                        .local_addr()
                        .expect("a bound listener has an address");
                    let shared = Arc::new(Shared::new(address, Store::new(uid_prefix)));
                    started_tx
                        .send(shared.clone())
                        .expect("start() waits for this");
                    tokio::select! {
                        _ = server::serve(shared, listener, acceptor, down_rx) => {}
                        _ = stop_rx => {}
                    }
                });
            })
            .expect("spawning the test API server's thread");
        let shared = started_rx.recv().expect("the test API server started");
        shared.wait_until("listening", |s| s.listening);
        KubeApi {
            shared,
            ca_pem: tls.ca_pem,
            dir,
            down,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://{}", self.shared.address)
    }

    /// The CA certificate (PEM) that signed the server's certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Writes a kubeconfig for `user` (the server's URL, the CA, the user's bearer token)
    /// into the server's temp dir and returns its path. Creates the user if new; it has no
    /// rules until [`KubeApi::grant`].
    pub fn kubeconfig(&self, user: &str) -> PathBuf {
        let token = self.token(user);
        let config = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url(), "certificate-authority-data": tls::base64(self.ca_pem.as_bytes())}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user, "namespace": "default"}}],
            "current-context": "test",
        });
        let file: String = user
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = self.dir.path().join(format!("kubeconfig-{file}"));
        std::fs::write(&path, serde_json::to_vec_pretty(&config).expect("JSON"))
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        path
    }

    /// The bearer token of `user` (created if new).
    pub fn token(&self, user: &str) -> String {
        self.shared.lock().access.user(user).token.clone()
    }

    /// Grants `user` the rules, in addition to any granted before. Anything not granted is
    /// answered 403 Forbidden.
    pub fn grant(&self, user: &str, rules: &[Rule]) {
        let mut s = self.shared.lock();
        for rule in rules {
            let known =
                rule.resource == "tokenreviews" || Resource::from_plural(rule.resource).is_some();
            assert!(
                known,
                "the test API server has no resource {:?}",
                rule.resource
            );
            s.access.grant(user, rule.resource, rule.verbs);
        }
    }

    /// A TokenReview of `user`'s token says it is bound to `node`
    /// (`status.user.extra["authentication.kubernetes.io/node-name"]`).
    pub fn bind_token_to_node(&self, user: &str, node: &str) {
        self.shared.lock().access.user(user).node = Some(node.to_owned());
    }

    /// Creates or replaces a node (by `metadata.name`): the next resourceVersion, ADDED or
    /// MODIFIED to watchers.
    pub fn put_node(&self, node: Value) {
        self.plant(Resource::Nodes, node);
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .store
            .get(Resource::Nodes, None, name)
            .cloned()
    }

    /// Creates or replaces a pod (by `metadata.namespace`, "default" if unset, and
    /// `metadata.name`).
    pub fn put_pod(&self, pod: Value) {
        self.plant(Resource::Pods, pod);
    }

    /// What the kubelet does once the pod's CNI ADD has returned: writes
    /// `status.podIP` and `status.podIPs` (the pod must exist).
    pub fn set_pod_ips(&self, namespace: &str, name: &str, ips: &[std::net::IpAddr]) {
        let mut pod = self
            .pod(namespace, name)
            .unwrap_or_else(|| panic!("no pod {namespace}/{name} to write the IPs of"));
        let status = &mut pod["status"];
        if !status.is_object() {
            *status = serde_json::json!({});
        }
        status["podIP"] = ips.first().map(|ip| ip.to_string()).into();
        status["podIPs"] = ips
            .iter()
            .map(|ip| serde_json::json!({ "ip": ip.to_string() }))
            .collect();
        self.put_pod(pod);
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .store
            .get(Resource::Pods, Some(namespace), name)
            .cloned()
    }

    /// What a graceful delete does first: sets `metadata.deletionTimestamp` (now) and
    /// `metadata.deletionGracePeriodSeconds` (the pod's `terminationGracePeriodSeconds`, or
    /// 30): a MODIFIED event. Nothing happens to an absent pod or one already deleting.
    pub fn mark_pod_deleting(&self, namespace: &str, name: &str) {
        let mut s = self.shared.lock();
        let Some(mut pod) = s.store.get(Resource::Pods, Some(namespace), name).cloned() else {
            return;
        };
        if !pod["metadata"]["deletionTimestamp"].is_null() {
            return;
        }
        let grace = pod["spec"]["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(30);
        pod["metadata"]["deletionTimestamp"] = json!(timestamps::rfc3339(SystemTime::now()));
        pod["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        s.store.replace(Resource::Pods, Some(namespace), name, pod);
    }

    /// Removes a pod: a DELETED event. Nothing happens to an absent pod.
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .store
            .delete(Resource::Pods, Some(namespace), name);
    }

    /// Creates or replaces a Service (by `metadata.namespace`, "default" if unset, and
    /// `metadata.name`), as given: unlike a create over HTTP, nothing is defaulted (no
    /// cluster IP is allocated).
    pub fn put_service(&self, service: Value) {
        self.plant(Resource::Services, service);
    }

    pub fn service(&self, namespace: &str, name: &str) -> Option<Value> {
        self.get(Resource::Services, namespace, name)
    }

    /// Removes a Service: a DELETED event. Nothing happens to an absent one.
    pub fn delete_service(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .store
            .delete(Resource::Services, Some(namespace), name);
    }

    /// Creates or replaces an EndpointSlice (`discovery.k8s.io/v1`; by namespace and
    /// name, as [`KubeApi::put_service`]), as given.
    pub fn put_endpoint_slice(&self, slice: Value) {
        self.plant(Resource::EndpointSlices, slice);
    }

    pub fn endpoint_slice(&self, namespace: &str, name: &str) -> Option<Value> {
        self.get(Resource::EndpointSlices, namespace, name)
    }

    /// Removes an EndpointSlice: a DELETED event. Nothing happens to an absent one.
    pub fn delete_endpoint_slice(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .store
            .delete(Resource::EndpointSlices, Some(namespace), name);
    }

    /// Creates or replaces a Lease (`coordination.k8s.io/v1`; by namespace and name), for
    /// a test to plant an expired lease or one another holder owns. Its
    /// `spec.renewTime` and `spec.acquireTime` must be MicroTimes
    /// (`2026-11-30T23:59:59.123456Z`), as a real server would hold them; they are stored
    /// as given (an offset is converted to UTC, as the real server stores it).
    pub fn put_lease(&self, lease: Value) {
        let lease = write::canonical(Resource::Leases, lease).unwrap_or_else(|e| {
            panic!("put_lease: a real API server would refuse this Lease: {e}")
        });
        self.plant(Resource::Leases, lease);
    }

    pub fn lease(&self, namespace: &str, name: &str) -> Option<Value> {
        self.get(Resource::Leases, namespace, name)
    }

    /// Removes a Lease: a DELETED event. Nothing happens to an absent one.
    pub fn delete_lease(&self, namespace: &str, name: &str) {
        self.shared
            .lock()
            .store
            .delete(Resource::Leases, Some(namespace), name);
    }

    /// Stores an object a test gives, after checking that it is of the resource's kind if
    /// it says one.
    fn plant(&self, resource: Resource, object: Value) {
        for (field, expected) in [
            ("kind", resource.kind()),
            ("apiVersion", resource.api_version()),
        ] {
            if let Some(given) = object[field].as_str() {
                assert_eq!(
                    given,
                    expected,
                    "a {} given with {field} {given:?}: {object}",
                    resource.kind()
                );
            }
        }
        self.shared.lock().store.put(resource, object);
    }

    fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        self.shared
            .lock()
            .store
            .get(resource, Some(namespace), name)
            .cloned()
    }

    /// PATCH requests on nodes received from `user`, whatever their outcome.
    pub fn patches(&self, user: &str) -> usize {
        self.shared
            .lock()
            .access
            .get(user)
            .map_or(0, |u| u.node_patches)
    }

    /// `"METHOD /path?query"` for each request of `user`, in arrival order (unauthenticated
    /// requests belong to nobody).
    pub fn requests(&self, user: &str) -> Vec<String> {
        self.shared
            .lock()
            .access
            .get(user)
            .map_or_else(Vec::new, |u| u.requests.clone())
    }

    /// Forgets the history of changes: a watch or list from a resourceVersion older than
    /// the current one gets 410 Gone from now on. Open watches go on.
    pub fn expire_history(&self) {
        self.shared.lock().store.expire_history();
    }

    /// Down: ends every open watch, closes every connection and stops listening, so that
    /// connects are refused. Up: listens again on the same port. Returns once done.
    pub fn set_down(&self, down: bool) {
        self.down.send_replace(down);
        if down {
            self.shared.lock().store.close_watches();
            self.shared.wait_until("going down", |s| {
                !s.listening && s.connections == 0 && s.store.all_watchers() == 0
            });
        } else {
            self.shared.wait_until("listening again", |s| s.listening);
        }
    }

    /// Watch streams open now on a resource, by its plural ("pods", "nodes", "services",
    /// "endpointslices", "leases").
    pub fn watchers(&self, resource: &str) -> usize {
        let r = Resource::from_plural(resource).unwrap_or_else(|| {
            panic!("the test API server has no watchable resource {resource:?}")
        });
        self.shared.lock().store.watchers(r)
    }

    /// The current resourceVersion (the last write's).
    pub fn resource_version(&self) -> u64 {
        self.shared.lock().store.resource_version()
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            // A panic on the server thread has been printed already; don't turn it into a
            // second one (possibly during an unwind) here.
            let _ = thread.join();
        }
    }
}
