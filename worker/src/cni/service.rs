//! The tonic service behind the CNI API: validates each request, converts it to the
//! model's [`Pod`] at the boundary, and changes storage and the node.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use shared_proto::cni::cni_server::Cni;
use shared_proto::cni::{
    AddResponse, CheckResponse, CniRequest, DelResponse, MAX_IPS, MAX_NETNS, NetnsProblem,
};
use tonic::{Request, Response, Status};

use super::ack_source::{ACK_TIMEOUT, AckSource};
use crate::metrics::{CniLabel, Metrics};
use crate::node::Node;
use crate::storage::{self, Storage};
use aether_model::{Change, Pod};

/// The longest an ADD takes to answer, from the moment the service reads it: committed
/// and ACKed, committed without the proxy's ACK (the ACK wait is cut to what is left), or
/// refused as busy (RESOURCE_EXHAUSTED, CNI code 11 at the plugin) when it is not
/// committed by then, as when it queues behind a batch that holds the lifecycle lock on
/// a starved node. A caller whose `grpc-timeout` ends sooner (the plugin sends what is
/// left of its own 10 s deadline) is answered [`ANSWER_MARGIN`] before it, so that it
/// reads the answer rather than its own timeout.
pub const ADD_BOUND: Duration = Duration::from_secs(5);
/// How long before the caller's `grpc-timeout` an ADD answers.
pub const ANSWER_MARGIN: Duration = Duration::from_millis(250);

/// How long an ADD may take: [`ADD_BOUND`], or less when the caller's `grpc-timeout`
/// (as gRPC writes it: up to 8 digits and a unit of H, M, S, m, u or n) ends sooner.
fn answer_within(metadata: &tonic::metadata::MetadataMap) -> Duration {
    let caller = metadata
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
            let n: u64 = if digits.len() <= 8 {
                digits.parse().ok()?
            } else {
                return None;
            };
            Some(match unit {
                "H" => Duration::from_secs(n * 3600),
                "M" => Duration::from_secs(n * 60),
                "S" => Duration::from_secs(n),
                "m" => Duration::from_millis(n),
                "u" => Duration::from_micros(n),
                "n" => Duration::from_nanos(n),
                _ => return None,
            })
        });
    match caller {
        Some(t) => ADD_BOUND.min(t.saturating_sub(ANSWER_MARGIN)),
        None => ADD_BOUND,
    }
}

/// Longest pod namespace or name (a DNS subdomain).
const MAX_NAME: usize = 253;
const MAX_IFNAME: usize = 15;

#[derive(Clone)]
pub struct CniService {
    inner: Arc<Inner>,
}

impl CniService {
    pub(super) fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }
}

struct Inner {
    /// ADDs waiting for the lifecycle lock; whoever takes it next commits them all.
    queue: std::sync::Mutex<Queue>,
    node: Arc<Node>,
    storage: Arc<Storage>,
    acks: Arc<dyn AckSource>,
    metrics: Arc<Metrics>,
    ack_timeout: Duration,
    /// Set under the lifecycle lock once the server has drained: from then on no call
    /// changes anything.
    drained: AtomicBool,
    /// With a registrar: a DEL marks the pod's registry endpoints draining.
    marks: Option<crate::registrar::Marks>,
}

impl CniService {
    pub fn new(
        node: Arc<Node>,
        storage: Arc<Storage>,
        acks: Arc<dyn AckSource>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self::build(node, storage, acks, metrics, ACK_TIMEOUT)
    }

    /// [`CniService::new`] with another ACK wait, for tests.
    #[cfg(any(test, feature = "testing"))]
    pub fn with_ack_timeout(
        node: Arc<Node>,
        storage: Arc<Storage>,
        acks: Arc<dyn AckSource>,
        metrics: Arc<Metrics>,
        ack_timeout: Duration,
    ) -> Self {
        Self::build(node, storage, acks, metrics, ack_timeout)
    }

    fn build(
        node: Arc<Node>,
        storage: Arc<Storage>,
        acks: Arc<dyn AckSource>,
        metrics: Arc<Metrics>,
        ack_timeout: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                queue: Default::default(),
                node,
                storage,
                acks,
                metrics,
                ack_timeout,
                drained: AtomicBool::new(false),
                marks: None,
            }),
        }
    }

    /// A DEL also asks `marks` to set the pod's registry endpoints draining. Call before
    /// the service is shared.
    pub fn with_drain_marks(mut self, marks: crate::registrar::Marks) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.marks = Some(marks);
        }
        self
    }

    /// Waits for any change in progress, then refuses every later one.
    pub(super) async fn fence(&self) {
        let _lifecycle = self.inner.node.lifecycle().await;
        self.inner.drained.store(true, Ordering::SeqCst);
    }

    /// Counts the call and observes how long it took since `started`.
    fn count<T>(&self, op: &str, r: &Result<T, Status>, started: tokio::time::Instant) {
        self.inner
            .metrics
            .observe_cni(op, r.is_ok(), started.elapsed());
        let result = match r {
            Ok(_) => "ok",
            Err(s) if s.code() == tonic::Code::InvalidArgument => "invalid",
            Err(s) if s.code() == tonic::Code::Unavailable => "unavailable",
            Err(s) if s.code() == tonic::Code::ResourceExhausted => "busy",
            Err(_) => "error",
        };
        self.inner
            .metrics
            .cni_requests
            .get_or_create(&CniLabel {
                op: op.into(),
                result: result.into(),
            })
            .inc();
    }
}

#[tonic::async_trait]
impl Cni for CniService {
    async fn add(&self, request: Request<CniRequest>) -> Result<Response<AddResponse>, Status> {
        let started = tokio::time::Instant::now();
        let answer_by = started + answer_within(request.metadata());
        let r = self
            .inner
            .clone()
            .add(request.into_inner(), answer_by)
            .await;
        self.count("add", &r, started);
        r.map(Response::new)
    }

    async fn del(&self, request: Request<CniRequest>) -> Result<Response<DelResponse>, Status> {
        let started = tokio::time::Instant::now();
        let r = self.inner.clone().del(request.into_inner()).await;
        self.count("del", &r, started);
        r.map(Response::new)
    }

    async fn check(&self, request: Request<CniRequest>) -> Result<Response<CheckResponse>, Status> {
        let started = tokio::time::Instant::now();
        let r = self.inner.check(request.into_inner());
        self.count("check", &r, started);
        r.map(Response::new)
    }
}

impl Inner {
    /// Commits the pod with the ADDs queued beside it, then waits for the proxy's ACK,
    /// answering by `answer_by` in every case (see [`ADD_BOUND`]).
    async fn add(
        self: Arc<Self>,
        req: CniRequest,
        answer_by: tokio::time::Instant,
    ) -> Result<AddResponse, Status> {
        let pod = pod_from_add(&req)?;
        let (done, result) = tokio::sync::oneshot::channel();
        let ticket = {
            let mut queue = lock(&self.queue);
            queue.next_ticket += 1;
            let ticket = queue.next_ticket;
            queue.adds.push(Queued {
                pod: pod.clone(),
                done,
                ticket,
                queued_at: tokio::time::Instant::now(),
            });
            ticket
        };
        // The commit runs in a task of its own: neither this ADD giving up at `answer_by`
        // nor a caller hanging up (which drops this handler) may cancel a batch between
        // its storage write and its snapshot update.
        tokio::spawn({
            let this = self.clone();
            async move { this.commit_queued().await }
        });
        match tokio::time::timeout_at(answer_by, result).await {
            Ok(Ok(committed)) => committed?,
            Ok(Err(_)) => {
                return Err(Status::internal(format!(
                    "the batch of the ADD of pod uid {} ended without an answer",
                    pod.uid
                )));
            }
            Err(_) => return Err(self.refuse_late(&pod, ticket)),
        }

        let wait = self
            .ack_timeout
            .min(answer_by.saturating_duration_since(tokio::time::Instant::now()));
        let acked = self.acks.wait_for_pod(&pod.uid, &pod.ips, wait).await;
        if !acked {
            self.metrics.cni_ack_timeouts.inc();
            tracing::warn!(
                uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), ips = ?pod.ips, timeout = ?wait,
                "proxy did not ACK a snapshot holding the pod in time; answering ADD anyway"
            );
        }
        Ok(AddResponse { acked })
    }

    /// The refusal of an ADD not committed by its answer time: a retryable
    /// RESOURCE_EXHAUSTED, which the plugin turns into CNI code 11 (try again later) at
    /// once. An ADD still queued is taken out, so it never lands after its caller has
    /// given up. One whose batch is still committing may land after this answer; the
    /// runtime's DEL of the failed sandbox takes it out again, and a retried ADD is
    /// idempotent.
    fn refuse_late(&self, pod: &Pod, ticket: u64) -> Status {
        let waited = {
            let mut queue = lock(&self.queue);
            let at = queue.adds.iter().position(|q| q.ticket == ticket);
            at.map(|i| (queue.adds.remove(i).queued_at.elapsed(), queue.adds.len()))
        };
        let why = match waited {
            Some((waited, behind)) => format!(
                "still queued after {waited:?} behind a batch that holds the node's lifecycle \
                 lock ({behind} more ADDs queued); it was taken out of the queue"
            ),
            None => "its batch is still committing; the pod may land, and the runtime's DEL \
                     of the failed sandbox takes it out"
                .to_string(),
        };
        tracing::warn!(uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), ips = ?pod.ips, "CNI ADD refused, not committed in time: {why}");
        Status::resource_exhausted(format!(
            "the agent is busy: the ADD of pod uid {} was not committed in time: {why}; try again",
            pod.uid
        ))
    }

    /// Commits every queued ADD: adds the pods to the snapshot and writes their records,
    /// both under the lifecycle lock,
    /// together with every other ADD that queued meanwhile (group commit): a burst of
    /// ADDs publishes one snapshot per batch and writes the batch's records in one
    /// [`Storage::put_all`], side by side with one fsync of the folder. The proxy starts applying
    /// the new snapshot while the fsyncs run; each ADD answers only once both are done,
    /// and a failed write takes its pod back out (restoring what the snapshot held
    /// before), so no answer ever claims a pod the storage does not hold. A crash in
    /// between leaves no record: the next owner's snapshot, built from storage, drops the
    /// pod, and the runtime retries the ADD it never saw succeed.
    ///
    /// A caller whose ADD an earlier holder of the lock committed finds the queue empty.
    ///
    /// An older pod holding one of a new pod's IPs (its DEL never reached the agent, and
    /// the IP was given out again) is evicted first, record and snapshot, and logged: the
    /// builder serves a contested IP for neither pod, and an ADD must never answer
    /// success while its pod is served for nobody. Its registry endpoints are not marked
    /// draining, as the IP is the new pod's now. After the change, each pod whose ADD is
    /// about to succeed is checked against the snapshot; one it does not serve is taken
    /// back out and its ADD fails.
    async fn commit_queued(&self) {
        let _lifecycle = self.node.lifecycle().await;
        let batch = std::mem::take(&mut lock(&self.queue).adds);
        if batch.is_empty() {
            return;
        }
        let started = tokio::time::Instant::now();
        let (size, oldest) = (batch.len(), batch[0].queued_at.elapsed());
        if let Err(refused) = self.check_not_drained() {
            for q in batch {
                let _ = q.done.send(Err(refused.clone()));
            }
            return;
        }
        let (batch, mut answers, evicted) = self.evict_conflicts(batch).await;
        let before: Vec<Option<Pod>> = batch.iter().map(|q| self.node.pod(&q.pod.uid)).collect();
        let removals = evicted.iter().map(|p| Change::RemovePod(p.uid.clone()));
        self.node
            .apply(removals.chain(batch.iter().map(|q| Change::UpsertPod(q.pod.clone()))));
        let records: Vec<Pod> = batch.iter().map(|q| q.pod.clone()).collect();
        let storage = self.storage.clone();
        let written: Vec<Result<bool, String>> =
            match tokio::task::spawn_blocking(move || storage.put_all(&records)).await {
                Ok(results) => results
                    .into_iter()
                    .map(|r| r.map_err(|e| e.to_string()))
                    .collect(),
                Err(e) => batch
                    .iter()
                    .map(|_| Err(format!("the record writer failed: {e}")))
                    .collect(),
            };
        let snapshot = self.node.snapshot();
        let mut rollback = Vec::new();
        for ((q, result), before) in batch.into_iter().zip(written).zip(before) {
            let pod = &q.pod;
            let failed = match result {
                Ok(written) if snapshot.holds_pod(&pod.uid, &pod.ips) => {
                    tracing::info!(uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), ips = ?pod.ips, written, "CNI ADD");
                    answers.push((q.done, Ok(())));
                    continue;
                }
                Ok(_) => {
                    // Its record is written; the rollback below restores what was before.
                    let why = format!(
                        "the snapshot would serve pod uid {} for nobody: {:?}",
                        pod.uid, snapshot.rejects
                    );
                    if let Err(e) = self.storage_restore(before.as_ref(), &pod.uid) {
                        tracing::error!(uid = %pod.uid, error = %e, "could not restore the pod's record after a refused ADD");
                    }
                    Status::internal(why)
                }
                Err(error) => Status::internal(format!(
                    "writing the record of pod uid {}: {error}",
                    pod.uid
                )),
            };
            rollback.push(match before {
                Some(old) => Change::UpsertPod(old),
                None => Change::RemovePod(pod.uid.clone()),
            });
            answers.push((q.done, Err(failed)));
        }
        if !rollback.is_empty() {
            self.node.apply(rollback);
        }
        for (done, answer) in answers {
            let _ = done.send(answer);
        }
        tracing::debug!(size, queued = ?oldest, took = ?started.elapsed(), "CNI ADD batch committed");
    }

    /// Evicts the older pods holding a new pod's IP: their records first, so a failure
    /// leaves them whole and fails the new pod's ADD instead. Within one batch a later
    /// ADD for an IP wins over an earlier one, which fails. Returns the ADDs to commit,
    /// the answers already decided, and the pods evicted (to take out of the snapshot).
    async fn evict_conflicts(
        &self,
        batch: Vec<Queued>,
    ) -> (Vec<Queued>, Vec<(Answer, Result<(), Status>)>, Vec<Pod>) {
        let mut holders: BTreeMap<IpAddr, BTreeSet<String>> = self.node.with_inputs(|i| {
            let mut m: BTreeMap<IpAddr, BTreeSet<String>> = BTreeMap::new();
            for p in i.pods.values() {
                for ip in &p.ips {
                    m.entry(*ip).or_default().insert(p.uid.clone());
                }
            }
            m
        });
        // Which batch entry (by position) each IP goes to, the later winning.
        let mut winner: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for (i, q) in batch.iter().enumerate() {
            for ip in &q.pod.ips {
                winner.insert(*ip, i);
            }
        }
        let mut answers = Vec::new();
        let mut keep: Vec<Option<Queued>> = Vec::with_capacity(batch.len());
        for (i, q) in batch.into_iter().enumerate() {
            if let Some(later) = q.pod.ips.iter().find(|ip| winner[*ip] != i) {
                let why = Status::aborted(format!(
                    "pod uid {}: a later ADD in the same batch took IP {later}",
                    q.pod.uid
                ));
                answers.push((q.done, Err(why)));
                keep.push(None);
            } else {
                keep.push(Some(q));
            }
        }
        let mut evicted: Vec<Pod> = Vec::new();
        for q in keep.iter_mut() {
            let Some(queued) = q else { continue };
            let stale: BTreeSet<String> = queued
                .pod
                .ips
                .iter()
                .flat_map(|ip| holders.get(ip).into_iter().flatten())
                .filter(|uid| **uid != queued.pod.uid && !evicted.iter().any(|e| &e.uid == *uid))
                .cloned()
                .collect();
            for uid in stale {
                let Some(old) = self.node.pod(&uid) else {
                    continue;
                };
                let (storage, id) = (self.storage.clone(), uid.clone());
                let removed = tokio::task::spawn_blocking(move || storage.remove(&id)).await;
                match removed
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string()))
                {
                    Ok(_) => {
                        self.metrics.cni_evictions.inc();
                        tracing::warn!(
                            evicted_uid = %old.uid, evicted_pod = %format!("{}/{}", old.namespace, old.name), evicted_ips = ?old.ips,
                            uid = %queued.pod.uid, pod = %format!("{}/{}", queued.pod.namespace, queued.pod.name), ips = ?queued.pod.ips,
                            "CNI ADD: evicted an older pod record holding the new pod's IP (its DEL never reached the agent)"
                        );
                        for ip in &old.ips {
                            if let Some(h) = holders.get_mut(ip) {
                                h.remove(&old.uid);
                            }
                        }
                        evicted.push(old);
                    }
                    Err(e) => {
                        let why = Status::internal(format!(
                            "pod uid {}: evicting the older record of pod uid {uid}, which holds its IP: {e}",
                            queued.pod.uid
                        ));
                        if let Some(q) = q.take() {
                            answers.push((q.done, Err(why)));
                        }
                        break;
                    }
                }
            }
        }
        (keep.into_iter().flatten().collect(), answers, evicted)
    }

    /// Puts back the record `before` (or removes the pod's) after a refused ADD.
    fn storage_restore(
        &self,
        before: Option<&Pod>,
        uid: &str,
    ) -> Result<(), crate::storage::StorageError> {
        match before {
            Some(old) => self.storage.put(old).map(|_| ()),
            None => self.storage.remove(uid).map(|_| ()),
        }
    }

    async fn del(self: Arc<Self>, req: CniRequest) -> Result<DelResponse, Status> {
        check_container_id(&req.container_id)?;
        if !req.pod_uid.is_empty() && !storage::valid_uid(&req.pod_uid) {
            return Err(Status::invalid_argument(format!(
                "pod_uid {:?} is not a valid pod uid",
                req.pod_uid
            )));
        }
        let change = tokio::spawn({
            let this = self.clone();
            async move { this.apply_del(req).await }
        });
        change
            .await
            .map_err(|e| Status::internal(format!("DEL: {e}")))?
    }

    async fn apply_del(&self, req: CniRequest) -> Result<DelResponse, Status> {
        // ADDs that queued before this DEL land first.
        self.commit_queued().await;
        let _lifecycle = self.node.lifecycle().await;
        self.check_not_drained()?;
        let known = if req.pod_uid.is_empty() {
            self.storage
                .pods()
                .into_iter()
                .find(|p| p.container_id == req.container_id)
        } else {
            self.storage
                .get(&req.pod_uid)
                .or_else(|| self.node.pod(&req.pod_uid))
        };
        let Some(pod) = known else {
            tracing::info!(uid = %req.pod_uid, container_id = %req.container_id, "CNI DEL of a pod the agent does not know");
            return Ok(DelResponse { found: false });
        };
        if pod.container_id != req.container_id {
            // A late DEL for a sandbox the pod has since replaced: the runtime can retry
            // the old sandbox's DEL after the new sandbox's ADD. Removing would drop the
            // live pod.
            tracing::info!(
                uid = %pod.uid, container_id = %req.container_id, current = %pod.container_id,
                "CNI DEL for a replaced sandbox; keeping the pod"
            );
            return Ok(DelResponse { found: false });
        }
        super::records::remove_pod(&self.node, &self.storage, self.marks.as_ref(), &pod)
            .await
            .map_err(|e| {
                Status::internal(format!("removing the record of pod uid {}: {e}", pod.uid))
            })?;
        tracing::info!(uid = %pod.uid, pod = %format!("{}/{}", pod.namespace, pod.name), "CNI DEL");
        Ok(DelResponse { found: true })
    }

    fn check(&self, req: CniRequest) -> Result<CheckResponse, Status> {
        check_container_id(&req.container_id)?;
        let uid = pod_uid(&req)?;
        let ips = parse_ips(&req.ips)?;
        let snapshot = self.node.snapshot();
        if snapshot.holds_pod(&uid, &ips) {
            return Ok(CheckResponse {
                holds: true,
                reason: String::new(),
            });
        }
        let reason = match self.node.pod(&uid).as_ref() {
            None => format!("pod_uid {uid} is not known to the agent"),
            Some(p) if p.container_id != req.container_id => {
                format!(
                    "pod_uid {uid} belongs to container_id {}, not {}",
                    p.container_id, req.container_id
                )
            }
            Some(p) if !same_set(&p.ips, &ips) => {
                format!("pod_uid {uid} holds ips {:?}, not {:?}", p.ips, ips)
            }
            Some(_) => format!(
                "pod_uid {uid} is stored but the snapshot does not serve it: {:?}",
                snapshot.rejects
            ),
        };
        Ok(CheckResponse {
            holds: false,
            reason,
        })
    }

    fn check_not_drained(&self) -> Result<(), Status> {
        if self.drained.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "agent is draining; retry against the next owner",
            ));
        }
        Ok(())
    }
}

fn same_set(a: &[IpAddr], b: &[IpAddr]) -> bool {
    a.len() == b.len() && a.iter().all(|ip| b.contains(ip))
}

/// The pod's key: its Kubernetes uid, or the container id for a runtime that passes none.
fn pod_uid(req: &CniRequest) -> Result<String, Status> {
    let uid = if req.pod_uid.is_empty() {
        &req.container_id
    } else {
        &req.pod_uid
    };
    if !storage::valid_uid(uid) {
        return Err(Status::invalid_argument(format!(
            "pod_uid {:?} is not a valid pod uid (1-128 of [A-Za-z0-9_.-], no \"..\")",
            uid
        )));
    }
    Ok(uid.clone())
}

fn check_container_id(id: &str) -> Result<(), Status> {
    if shared_proto::cni::valid_container_id(id) {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "container_id {id:?} is not a valid container id"
        )))
    }
}

/// The request's addresses, each once, in the order given. At most `MAX_IPS`: a pod has
/// one, or two when dual-stack; the cap bounds what one request can make the agent store
/// and compare.
fn parse_ips(ips: &[String]) -> Result<Vec<IpAddr>, Status> {
    if ips.is_empty() {
        return Err(Status::invalid_argument(
            "ips is empty: the pod has no address",
        ));
    }
    if ips.len() > MAX_IPS {
        return Err(Status::invalid_argument(format!(
            "ips has {} entries, over the limit of {MAX_IPS}",
            ips.len()
        )));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(ips.len());
    for (i, ip) in ips.iter().enumerate() {
        let ip: IpAddr = ip.parse().map_err(|_| {
            Status::invalid_argument(format!("ips[{i}] {ip:?} is not an IP address"))
        })?;
        if seen.insert(ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// Validates an Add and converts it to the model.
fn pod_from_add(req: &CniRequest) -> Result<Pod, Status> {
    check_container_id(&req.container_id)?;
    let uid = pod_uid(req)?;
    let ips = parse_ips(&req.ips)?;
    // The agent only stores the path, but whoever reads a record later must not be
    // walked out of the runtime's netns folder by it: no `..` component.
    let netns = req
        .netns
        .char_indices()
        .nth(128)
        .map_or(req.netns.as_str(), |(end, _)| &req.netns[..end]);
    match shared_proto::cni::check_netns(&req.netns) {
        Ok(()) => {}
        Err(NetnsProblem::NotAbsolute) => {
            return Err(Status::invalid_argument(format!(
                "netns {netns:?} is not an absolute path of at most {MAX_NETNS} bytes"
            )));
        }
        Err(NetnsProblem::ParentComponent) => {
            return Err(Status::invalid_argument(format!(
                "netns {netns:?} has a \"..\" component"
            )));
        }
    }
    if req.ifname.is_empty() || req.ifname.len() > MAX_IFNAME || req.ifname.contains('/') {
        return Err(Status::invalid_argument(format!(
            "ifname {:?} is not a valid interface name",
            req.ifname
        )));
    }
    for (field, value) in [
        ("pod_namespace", &req.pod_namespace),
        ("pod_name", &req.pod_name),
    ] {
        if value.len() > MAX_NAME || value.chars().any(|c| c.is_control()) {
            return Err(Status::invalid_argument(format!(
                "{field} {value:?} is not a valid Kubernetes name"
            )));
        }
    }
    Ok(Pod {
        uid,
        namespace: req.pod_namespace.clone(),
        name: req.pod_name.clone(),
        container_id: req.container_id.clone(),
        netns: req.netns.clone(),
        ifname: req.ifname.clone(),
        ips,
        terminating: false,
        no_quic_twin: !quic_twin_wanted(&req.cni_args)?,
    })
}

/// The CNI argument by which a pod opts out of a QUIC twin (its target does not speak
/// HTTP): `AETHER_QUIC_TWIN=off` in `CNI_ARGS`; `on`, or no such argument, keeps it.
pub const QUIC_TWIN_ARG: &str = "AETHER_QUIC_TWIN";

/// Whether the ADD's `CNI_ARGS` (`KEY=VALUE;...`) leave the pod its QUIC twin; a value
/// other than `on` or `off` is refused, naming it.
pub(super) fn quic_twin_wanted(cni_args: &str) -> Result<bool, Status> {
    let mut wanted = true;
    for entry in cni_args.split(';') {
        let Some((key, value)) = entry.split_once('=') else {
            continue;
        };
        if key == QUIC_TWIN_ARG {
            wanted = match value {
                "on" => true,
                "off" => false,
                other => {
                    return Err(Status::invalid_argument(format!(
                        "CNI_ARGS {QUIC_TWIN_ARG}={other:?}: expected on or off"
                    )));
                }
            }
        }
    }
    Ok(wanted)
}

/// Where an ADD's answer goes.
type Answer = tokio::sync::oneshot::Sender<Result<(), Status>>;

/// An ADD waiting for its batch.
struct Queued {
    pod: Pod,
    done: Answer,
    /// Names the ADD in the queue, for taking it out when it is refused.
    ticket: u64,
    queued_at: tokio::time::Instant,
}

/// The ADDs waiting for the lifecycle lock, oldest first.
#[derive(Default)]
struct Queue {
    adds: Vec<Queued>,
    next_ticket: u64,
}

/// The queue holds plain data; a panic while it was locked loses nothing worth refusing.
fn lock(m: &std::sync::Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
