//! The local pods' SVIDs, from SPIRE's Delegated Identity API on the SPIRE agent's admin
//! socket (`--spiffe-broker-endpoint`).
//!
//! One `SubscribeToX509SVIDs` stream per local pod, named by the selectors `k8s:ns:<ns>`,
//! `k8s:pod-name:<name>` and `k8s:pod-uid:<uid>` (SPIRE issues the entries whose
//! selectors are a subset of these). Each SVID received, the first and every rotation,
//! becomes `SetPodSvid`; closing a pod's stream unsubscribes it and drops its SVID from
//! the node (`SetPodSvid { svid: None }`). Each stream reconnects on its own with the
//! shared jittered backoff and keeps its last SVID meanwhile, so a pod the provider holds
//! back delays nobody else. Owner and standby subscribe independently: two streams of the
//! same SVID. A `SubscribeToX509Bundles` stream on the same connection feeds the trust
//! bundle too, as the Workload API does (both come from the same SPIRE agent's cache).
//!
//! # One rule for every way pods come and go
//! One task watches the node's snapshots and, at each, diffs the pod uids in the node's
//! inputs against the open subscriptions ([`plan`]): it subscribes the pods added and
//! unsubscribes the pods gone. Every source of pods changes the inputs through
//! `Node::apply`, and every change to the pod set publishes a snapshot, so this one rule
//! is each of the events that name a pod:
//! - CNI ADD: `UpsertPod` adds the pod to the inputs, so it is subscribed;
//! - standby (or any) start: the pods loaded from storage are the first inputs, so every
//!   stored pod is subscribed;
//! - CNI DEL (and the owner's stale-record and eviction removals): `RemovePod` takes it
//!   out, so it is unsubscribed;
//! - the takeover reconcile: the storage diff arrives as `UpsertPod`s and `RemovePod`s,
//!   so the pods added during the overlap are subscribed and the removed ones dropped.
//!
//! Diffing the whole set rather than following single events also means that changes
//! arriving faster than the task runs are never lost, only merged. The task also looks
//! again every 10 s, for a change to the pod set that changed no resource (a pod with no
//! address) and so published no snapshot.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use aether_model::{Change, Svid};
use futures::StreamExt;
use spiffe::TrustDomain;
use spiffe::transport::{Endpoint, GrpcStatusCode, TransportError};
use spire_api::selectors::Selector;
use spire_api::{DelegateAttestationRequest, DelegatedIdentityClient, DelegatedIdentityError};
use tracing::{debug, error, info, warn};

use super::convert;
use super::link;
use super::placement::Verdict;
use crate::health::{PodHeld, Reporter};
use crate::metrics::{Metrics, SvidSourceLabel};
use crate::node::Node;

/// The problem source while pod subscriptions fail.
pub const PROBLEM: &str = "spiffe-broker";
/// The key of the bundle stream among the failing streams.
const BUNDLES: &str = "";
/// How often the pod set is diffed with no snapshot to say it changed.
const RESYNC: Duration = Duration::from_secs(10);

/// A pod as the broker's selectors name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodKey {
    pub namespace: String,
    pub name: String,
}

/// What to change so that the open subscriptions follow the node's pods.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub unsubscribe: Vec<String>,
    pub subscribe: Vec<String>,
}

/// The subscriptions to close (their pod is gone, or now has another name) and to open
/// (a pod without one), by uid.
pub fn plan(open: &BTreeMap<String, PodKey>, pods: &BTreeMap<String, PodKey>) -> Plan {
    let mut p = Plan::default();
    for (uid, key) in open {
        if pods.get(uid) != Some(key) {
            p.unsubscribe.push(uid.clone());
        }
    }
    for (uid, key) in pods {
        if open.get(uid) != Some(key) {
            p.subscribe.push(uid.clone());
        }
    }
    p
}

/// The selectors that name the pod to SPIRE.
fn request(uid: &str, pod: &PodKey) -> Result<DelegateAttestationRequest, String> {
    let k8s = |value: String| Selector::Generic(("k8s".into(), value));
    DelegateAttestationRequest::for_selectors(vec![
        k8s(format!("ns:{}", pod.namespace)),
        k8s(format!("pod-name:{}", pod.name)),
        k8s(format!("pod-uid:{uid}")),
    ])
    .map_err(|e| e.to_string())
}

/// Subscribes the node's pods at the broker at `endpoint` until the task is aborted;
/// with `placement` (API access), only the pods it places on this node
/// ([`super::placement`]).
pub fn spawn(
    endpoint: Endpoint,
    endpoint_text: String,
    trust_domain: TrustDomain,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    problems: Reporter,
    placement: Option<PodViews>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // One connection for every stream, made at the first call and again after it breaks.
        let channel = match link::channel(&endpoint, true).await {
            Ok(c) => c,
            Err(e) => {
                error!(endpoint = %endpoint_text, error = %format!("{e:#}"), "SPIFFE broker: no channel; pods get no SVID");
                problems.set(
                    PROBLEM,
                    format!("SPIFFE broker {endpoint_text}: {e:#}; pods get no SVID"),
                );
                return;
            }
        };
        problems.identity(|s| s.broker = true);
        let client = DelegatedIdentityClient::new(channel);
        let shared = Arc::new(Shared {
            node,
            metrics,
            problems,
            trust_domain,
            endpoint_text,
            live: Mutex::new(BTreeMap::new()),
            failing: Mutex::new(BTreeMap::new()),
            open: Mutex::new(0),
            away: AtomicBool::new(false),
        });
        let _bundles = Aborting(tokio::spawn(bundles(client.clone(), shared.clone())));
        follow(client, shared, placement).await;
    })
}

/// Aborts its task when dropped: subscriptions end with the task that owns them.
struct Aborting(tokio::task::JoinHandle<()>);

impl Drop for Aborting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Subscription {
    key: PodKey,
    _task: Aborting,
}

/// What the subscription tasks and the task that follows the pods share.
struct Shared {
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    problems: Reporter,
    trust_domain: TrustDomain,
    endpoint_text: String,
    /// The subscription of each subscribed pod, by uid. A subscription applies an SVID
    /// only while it is its pod's, checked under this lock, and an unsubscribe drops the
    /// SVID under it: a stream being closed can never put its SVID back.
    live: Mutex<BTreeMap<String, u64>>,
    /// The streams that failed since they last worked, by uid (the bundle stream as
    /// [`BUNDLES`]): what the pod is called and why.
    failing: Mutex<BTreeMap<String, (String, String)>>,
    /// Open streams.
    open: Mutex<usize>,
    /// Some stream is failing (logged once until all work again).
    away: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// This node's pods as the API server lists them (`crate::kube::Kube::pods`).
pub type PodViews = tokio::sync::watch::Receiver<crate::kube::PodView>;

/// The pods the cross-check holds back, by uid: since when (unix seconds), whether
/// refused (else deferred), and why. Bounded by the node's pods.
type HeldBack = BTreeMap<String, (u64, bool, String)>;

/// The node's pods that may have their SVID: every one without `placement`, else those
/// it places here. `held` is updated to the pods held back (logged and counted when they
/// start to be).
fn placed_pods(
    shared: &Shared,
    placement: Option<&PodViews>,
    held: &mut HeldBack,
) -> BTreeMap<String, PodKey> {
    let now = super::checks::unix_now();
    let key = |p: &aether_model::Pod| PodKey {
        namespace: p.namespace.clone(),
        name: p.name.clone(),
    };
    let Some(views) = placement else {
        return shared.node.with_inputs(|i| {
            i.pods
                .iter()
                .map(|(uid, p)| (uid.clone(), key(p)))
                .collect()
        });
    };
    let view = views.borrow();
    let mut next = HeldBack::new();
    let placed = shared.node.with_inputs(|i| {
        let mut placed = BTreeMap::new();
        for (uid, p) in &i.pods {
            let (refused, why) = match super::placement::check(p, &view) {
                Verdict::Placed => {
                    placed.insert(uid.clone(), key(p));
                    continue;
                }
                Verdict::Deferred(why) => (false, why),
                Verdict::Refused(why) => (true, why),
            };
            let pod = format!("{}/{}", p.namespace, p.name);
            let since = match held.get(uid) {
                Some((since, was, _)) if *was == refused => *since,
                _ => {
                    if refused {
                        shared.metrics.pod_identity_refusals.inc();
                        warn!(uid = %uid, pod = %pod, why = %why, "SVID refused: the API server does not place this pod here as its ADD said");
                    } else {
                        info!(uid = %uid, pod = %pod, why = %why, "SVID deferred until the API server lists the pod on this node");
                    }
                    now
                }
            };
            next.insert(uid.clone(), (since, refused, why));
        }
        placed
    });
    *held = next;
    placed
}

/// `/ready`'s lists and the gauges of the pods held back.
fn report_held(shared: &Shared, held: &HeldBack) {
    let names: BTreeMap<String, String> = shared.node.with_inputs(|i| {
        held.keys()
            .filter_map(|uid| {
                let p = i.pods.get(uid)?;
                Some((uid.clone(), format!("{}/{}", p.namespace, p.name)))
            })
            .collect()
    });
    let list = |refused: bool| {
        let mut l: Vec<PodHeld> = held
            .iter()
            .filter(|(_, (_, r, _))| *r == refused)
            .map(|(uid, (since, _, why))| PodHeld {
                pod: names.get(uid).cloned().unwrap_or_else(|| uid.clone()),
                since: *since,
                why: why.clone(),
            })
            .collect();
        l.sort_by(|a, b| (a.since, &a.pod).cmp(&(b.since, &b.pod)));
        let count = l.len();
        l.truncate(super::checks::READY_LISTED);
        (l, count)
    };
    let (deferred, deferred_count) = list(false);
    let (refused, refused_count) = list(true);
    shared
        .metrics
        .pods_identity_deferred
        .set(deferred_count as i64);
    shared
        .metrics
        .pods_identity_refused
        .set(refused_count as i64);
    shared.problems.identity(|s| {
        s.pods_deferred = deferred;
        s.pods_deferred_count = deferred_count;
        s.pods_refused = refused;
        s.pods_refused_count = refused_count;
    });
}

/// Keeps one subscription per pod in the node's inputs (with `placement`, per pod it
/// places here), until the task is aborted.
async fn follow(
    client: DelegatedIdentityClient,
    shared: Arc<Shared>,
    mut placement: Option<PodViews>,
) {
    if placement.is_none() {
        info!(
            "no Kubernetes API access: pods' identities are not cross-checked with the API server; an SVID is requested on the CNI ADD's word"
        );
    }
    let mut snapshots = shared.node.subscribe();
    let mut subs: BTreeMap<String, Subscription> = BTreeMap::new();
    let mut next_id = 0u64;
    let mut held = HeldBack::new();
    let mut view_open = true;
    loop {
        let pods = placed_pods(&shared, placement.as_ref(), &mut held);
        report_held(&shared, &held);
        let open: BTreeMap<String, PodKey> = subs
            .iter()
            .map(|(uid, s)| (uid.clone(), s.key.clone()))
            .collect();
        let plan = plan(&open, &pods);
        for uid in plan.unsubscribe {
            let Some(sub) = subs.remove(&uid) else {
                continue;
            };
            {
                let mut live = lock(&shared.live);
                live.remove(&uid);
                shared.node.apply([Change::SetPodSvid {
                    uid: uid.clone(),
                    svid: None,
                }]);
            }
            // Dropping the task ends its stream: the provider sees the subscription close.
            drop(sub);
            shared.worked(&uid);
            let why = match held.get(&uid) {
                Some((_, true, _)) => "the API server does not place the pod here as its ADD said",
                Some((_, false, _)) => "the API server no longer lists the pod on this node",
                None => "the pod left the node",
            };
            info!(uid = %uid, pod = %format!("{}/{}", open[&uid].namespace, open[&uid].name), "SVID subscription closed: {why}");
        }
        for uid in plan.subscribe {
            next_id += 1;
            let key = pods[&uid].clone();
            lock(&shared.live).insert(uid.clone(), next_id);
            info!(uid = %uid, pod = %format!("{}/{}", key.namespace, key.name), "SVID subscription opened");
            let task = tokio::spawn(subscription(
                uid.clone(),
                key.clone(),
                next_id,
                client.clone(),
                shared.clone(),
            ));
            subs.insert(
                uid,
                Subscription {
                    key,
                    _task: Aborting(task),
                },
            );
        }
        // The view changed: a pod listed, its IPs written, or the watch (re)synced.
        let view_changed = async {
            match placement.as_mut().filter(|_| view_open) {
                Some(v) => v.changed().await.is_ok(),
                None => std::future::pending().await,
            }
        };
        let view_alive = tokio::select! {
            changed = snapshots.changed() => if changed.is_err() { return } else { true },
            alive = view_changed => alive,
            () = tokio::time::sleep(RESYNC) => true,
        };
        // The source is gone (the worker is ending): the last view stands.
        view_open &= view_alive;
    }
}

/// Counts an open stream for as long as it lives (its task may be aborted at any await).
struct OpenStream(Arc<Shared>);

impl OpenStream {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.count_open(1);
        Self(shared.clone())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.count_open(-1);
    }
}

/// One pod's SVID stream, reconnecting until its task is aborted (the pod left).
async fn subscription(
    uid: String,
    pod: PodKey,
    id: u64,
    client: DelegatedIdentityClient,
    shared: Arc<Shared>,
) {
    let name = format!("{}/{}", pod.namespace, pod.name);
    let mut backoff = link::backoff();
    let mut held: Option<Svid> = None;
    loop {
        let why = match request(&uid, &pod) {
            Err(e) => e,
            Ok(req) => match client.stream_x509_svids(req).await {
                Err(e) => why_failed(&e),
                Ok(stream) => {
                    let _open = OpenStream::new(&shared);
                    shared.worked(&uid);
                    let mut stream = std::pin::pin!(stream);
                    loop {
                        match stream.next().await {
                            Some(Ok(x)) => {
                                backoff.reset();
                                shared.receive(&uid, &name, id, &x, &mut held);
                            }
                            // SPIRE's answer for selectors that match no registration
                            // entry (none yet, or one deleted): no SVID, on a stream that
                            // stays open and brings the SVID once an entry matches.
                            Some(Err(DelegatedIdentityError::EmptyResponse)) => {
                                backoff.reset();
                                shared.unmatched(&uid, &name, id, &mut held);
                            }
                            Some(Err(e)) => break why_failed(&e),
                            None => break "stream ended".to_string(),
                        }
                    }
                }
            },
        };
        shared.failed(&uid, &name, why);
        tokio::time::sleep(backoff.next_wait()).await;
    }
}

/// Why a stream failed, as `/ready` and the log say it: a refusal of the agent as a delegate
/// names the setting that fixes it.
fn why_failed(e: &DelegatedIdentityError) -> String {
    match e {
        DelegatedIdentityError::Transport(TransportError::Status(s))
            if s.code() == GrpcStatusCode::PermissionDenied =>
        {
            format!(
                "{e}: the SPIFFE broker does not accept this agent as a delegate; list the agent's SPIFFE ID in the SPIRE agent's authorized_delegates, and register an entry for the agent"
            )
        }
        _ => e.to_string(),
    }
}

/// The trust bundle from the broker, reconnecting until the task is aborted.
async fn bundles(client: DelegatedIdentityClient, shared: Arc<Shared>) {
    let mut backoff = link::backoff();
    let mut held: Option<String> = None;
    loop {
        let why = match client.stream_x509_bundles().await {
            Err(e) => why_failed(&e),
            Ok(stream) => {
                shared.worked(BUNDLES);
                let mut stream = std::pin::pin!(stream);
                loop {
                    match stream.next().await {
                        Some(Ok(set)) => {
                            backoff.reset();
                            let Some(bundle) = set.get(&shared.trust_domain) else {
                                warn!(trust_domain = %shared.trust_domain, "the SPIFFE broker sent no bundle for the trust domain; keeping the last one");
                                continue;
                            };
                            let pem = convert::bundle_pem(&bundle);
                            if held.as_ref() != Some(&pem) {
                                debug!(trust_domain = %shared.trust_domain, authorities = bundle.authorities().len(), "trust bundle from the SPIFFE broker");
                                shared.node.apply([Change::SetBundle(Some(pem.clone()))]);
                                held = Some(pem);
                            }
                        }
                        Some(Err(e)) => break e.to_string(),
                        None => break "stream ended".to_string(),
                    }
                }
            }
        };
        shared.failed(BUNDLES, "trust bundles", why);
        tokio::time::sleep(backoff.next_wait()).await;
    }
}

impl Shared {
    /// Hands the node a pod's new SVID, if the subscription is still the pod's.
    fn receive(
        &self,
        uid: &str,
        name: &str,
        id: u64,
        x: &spiffe::X509Svid,
        held: &mut Option<Svid>,
    ) {
        if x.spiffe_id().trust_domain() != &self.trust_domain {
            let why = format!(
                "its SVID {} is not in --trust-domain {} and is not served",
                x.spiffe_id(),
                self.trust_domain
            );
            error!(uid = %uid, pod = %name, spiffe_id = %x.spiffe_id(), trust_domain = %self.trust_domain, "a pod's SVID is not in --trust-domain; it is not served");
            self.failed(uid, name, why);
            return;
        }
        let svid = match convert::svid(x) {
            Ok(s) => s,
            Err(e) => {
                self.failed(uid, name, format!("{e} (keeping the last SVID)"));
                return;
            }
        };
        self.worked(uid);
        if held.as_ref() == Some(&svid) {
            return;
        }
        {
            let live = lock(&self.live);
            if live.get(uid) != Some(&id) {
                return;
            }
            // Counted before the node has it: whoever sees the SVID sees it counted.
            self.metrics
                .identity_svid_updates
                .get_or_create(&SvidSourceLabel {
                    source: "pod".into(),
                })
                .inc();
            self.node.apply([Change::SetPodSvid {
                uid: uid.to_string(),
                svid: Some(svid.clone()),
            }]);
        }
        let first = held.is_none();
        if first {
            info!(uid = %uid, pod = %name, spiffe_id = %svid.spiffe_id, serial = %svid.serial, not_after = svid.not_after, "pod SVID");
        } else {
            debug!(uid = %uid, pod = %name, spiffe_id = %svid.spiffe_id, serial = %svid.serial, not_after = svid.not_after, "pod SVID rotated");
        }
        *held = Some(svid);
    }

    /// The broker has no registration entry for the pod: it has no SVID (one it had is
    /// dropped, since its entry is gone), and `/ready` says so, until an entry matches.
    fn unmatched(&self, uid: &str, name: &str, id: u64, held: &mut Option<Svid>) {
        if held.take().is_some() {
            let live = lock(&self.live);
            if live.get(uid) == Some(&id) {
                self.node.apply([Change::SetPodSvid {
                    uid: uid.to_string(),
                    svid: None,
                }]);
            }
            warn!(uid = %uid, pod = %name, "the SPIFFE broker no longer has a registration entry for the pod: its SVID is withdrawn");
        }
        self.failed(
            uid,
            name,
            "the SPIFFE broker has no registration entry matching the pod's selectors: no SVID until one matches (the stream stays open)".to_string(),
        );
    }

    fn count_open(&self, delta: isize) {
        // Published under the lock, so that two streams opening at once cannot leave the
        // older count last.
        let mut open = lock(&self.open);
        *open = open.saturating_add_signed(delta);
        let n = *open;
        self.metrics.identity_subscriptions.set(n as i64);
        self.problems.identity(|s| s.subscriptions = n);
    }

    /// The stream `key` works (or is gone).
    fn worked(&self, key: &str) {
        let mut failing = lock(&self.failing);
        if failing.remove(key).is_some() {
            self.report(&failing);
        }
    }

    /// The stream `key` (a pod's uid, or [`BUNDLES`]) failed.
    fn failed(&self, key: &str, name: &str, why: String) {
        // A stream being closed with its pod reports nothing more.
        if key != BUNDLES && !lock(&self.live).contains_key(key) {
            return;
        }
        let mut failing = lock(&self.failing);
        debug!(uid = %key, stream = %name, error = %why, "SPIFFE broker stream failed; reconnecting");
        let now = (name.to_string(), why);
        if failing.get(key) != Some(&now) {
            failing.insert(key.to_string(), now);
            self.report(&failing);
        }
    }

    /// `/ready` and the log, when the set of failing streams changed.
    fn report(&self, failing: &BTreeMap<String, (String, String)>) {
        let Some((name, why)) = failing.values().next() else {
            if self.away.swap(false, Ordering::Relaxed) {
                info!(endpoint = %self.endpoint_text, "SPIFFE broker: every stream works again");
            }
            self.problems.clear(PROBLEM);
            return;
        };
        let n = failing.len();
        let message = format!(
            "SPIFFE broker {}: {n} stream(s) failing, {name} first: {why} (a stream that failed reconnects, keeping the SVID it had)",
            self.endpoint_text
        );
        // One warning while the broker is away, not one per pod and retry (those are debug).
        if !self.away.swap(true, Ordering::Relaxed) {
            warn!(endpoint = %self.endpoint_text, stream = %name, error = %why, "SPIFFE broker stream failing; reconnecting");
        }
        self.problems.set(PROBLEM, message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(list: &[(&str, &str)]) -> BTreeMap<String, PodKey> {
        list.iter()
            .map(|(uid, name)| {
                (
                    uid.to_string(),
                    PodKey {
                        namespace: "ns".into(),
                        name: name.to_string(),
                    },
                )
            })
            .collect()
    }

    fn check(
        open: &[(&str, &str)],
        now: &[(&str, &str)],
        unsubscribe: &[&str],
        subscribe: &[&str],
    ) {
        let got = plan(&pods(open), &pods(now));
        let want = Plan {
            unsubscribe: unsubscribe.iter().map(|u| u.to_string()).collect(),
            subscribe: subscribe.iter().map(|u| u.to_string()).collect(),
        };
        assert_eq!(got, want, "open {open:?}, pods {now:?}");
    }

    #[test]
    fn subscriptions_follow_the_pod_set() {
        // Start (storage load): every pod.
        check(&[], &[("u1", "a"), ("u2", "b")], &[], &["u1", "u2"]);
        // ADD, DEL, and a reconcile doing both at once.
        check(&[("u1", "a")], &[("u1", "a"), ("u3", "c")], &[], &["u3"]);
        check(&[("u1", "a"), ("u3", "c")], &[("u1", "a")], &["u3"], &[]);
        check(
            &[("u1", "a"), ("u2", "b")],
            &[("u2", "b"), ("u4", "d")],
            &["u1"],
            &["u4"],
        );
        // Nothing changed (an SVID landed, a service changed): nothing to do.
        check(&[("u1", "a")], &[("u1", "a")], &[], &[]);
        // A uid now under another name is subscribed again under it.
        check(&[("u1", "a")], &[("u1", "z")], &["u1"], &["u1"]);
    }

    #[test]
    fn a_pod_is_named_by_three_k8s_selectors() {
        let r = request(
            "0a1b",
            &PodKey {
                namespace: "shop".into(),
                name: "web-1".into(),
            },
        )
        .unwrap();
        let DelegateAttestationRequest::Selectors(s) = r else {
            panic!("{r:?}")
        };
        let got: Vec<String> = s.as_slice().iter().map(|s| format!("{s:?}")).collect();
        assert_eq!(got.len(), 3);
        for want in ["ns:shop", "pod-name:web-1", "pod-uid:0a1b"] {
            assert!(
                got.iter()
                    .any(|g| g.contains("\"k8s\"") && g.contains(&format!("\"{want}\""))),
                "{want} in {got:?}"
            );
        }
    }
}
