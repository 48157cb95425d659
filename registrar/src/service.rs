//! The registry API served over etcd: the tonic service. Callers are identified and
//! authorized by the gate in front of it (`gate`), before their requests are decoded;
//! requests are checked (`authz::check_node`, `validate`), planned (`plan`) from what was read, and written in one etcd
//! transaction guarded by the read's revision, read and planned again if something
//! changed in between. Watch streams are etcd watches from an etcd revision, so every
//! replica serves the same stream and a client resumes on any of them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aether_model::check::Loopback;
use aether_model::{EndpointState, ServiceKey};
use etcd_client::EventType;
use shared_proto::registry::{
    self as pb, registry_server::Registry, watch_endpoints_response::Kind as ResponseKind,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::authz::{self, Method, Peer};
use crate::kept::Kept;
use crate::keys::Key;
use crate::metrics::Metrics;
use crate::plan::{self, MarkRefusal, MarkRequest, MarkTarget};
use crate::store::{Guard, Store, StoreError};
use crate::streams::{Registration, Replaced, StreamKey, Streams};
use crate::tokenreview::Buckets;
use crate::validate;
use crate::values::{self, EndpointValue, MarkValue, PairsValue, Source};
use crate::view::{self, Event, EventKind, Rejected};
use crate::writes::{self, WriteError};

/// A transaction whose guard keeps failing (the keys keep changing under it) is read and
/// planned this many times before the caller is told to retry.
const ATTEMPTS: usize = 8;

/// A broken etcd watch is re-created from the client's revision this many times before
/// the stream ends with UNAVAILABLE (the client then resumes, maybe on another replica).
const WATCH_RETRIES: u32 = 3;

pub struct Registrar {
    store: Store,
    streams: Arc<Streams>,
    cluster: Option<String>,
    shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
    /// Whether ApplyServices accepts loopback endpoints (`--allow-loopback-endpoints`).
    loopback: Loopback,
    /// Drain marks a node may still set (`--drain-marks-per-node`, `--drain-mark-burst`).
    marks: Mutex<Buckets<String>>,
    /// Which services have endpoints at an address, for drain marks naming no service and
    /// for the endpoints a node's QUIC pairs name; and the kept view, for full views.
    kept: Arc<Kept>,
    /// QUIC pairs a node may advertise (`--quic-pairs-per-node`).
    pairs_per_node: usize,
    /// SetQuicPairs calls a node may still make (`--quic-pair-sets-per-node`,
    /// `--quic-pair-set-burst`).
    pair_sets: Mutex<Buckets<String>>,
}

/// The bounds of the agents' writes, per node.
#[derive(Debug, Clone, Copy)]
pub struct AgentWrites {
    pub marks: MarkRate,
    pub pairs: PairLimits,
}

/// The bounds of SetQuicPairs: pairs per node, and calls per node.
#[derive(Debug, Clone, Copy)]
pub struct PairLimits {
    pub per_node: usize,
    pub rate: MarkRate,
}

impl PairLimits {
    /// The largest SetQuicPairs request `per_node` pairs make, gRPC framing included: each
    /// pair at most [`validate::QUIC_PAIR_BYTES_MAX`] bytes and its field tag and length,
    /// plus the node and instance.
    pub fn request_bytes(per_node: usize) -> usize {
        per_node * (validate::QUIC_PAIR_BYTES_MAX + 8) + 1024
    }
}

/// Endpoint rewrites per transaction when a node's pairs change: below etcd's default
/// `--max-txn-ops` (128) with the guards' compares.
const TWIN_OPS_PER_TXN: usize = 32;

/// How many drain marks a node may set: `per_second`, and `burst` at once.
#[derive(Debug, Clone, Copy)]
pub struct MarkRate {
    pub per_second: f64,
    pub burst: f64,
}

/// Nodes whose drain-mark budget is kept at most.
const MARK_NODES_MAX: usize = 65_536;

impl Registrar {
    /// `shutdown` turning true ends every open stream with UNAVAILABLE. `full_views_from_etcd`:
    /// keep no view, and read etcd for each full view.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        store: Store,
        cluster: Option<String>,
        streams_per_node: usize,
        writes: AgentWrites,
        shutdown: watch::Receiver<bool>,
        metrics: Arc<Metrics>,
        loopback: Loopback,
        full_views_from_etcd: bool,
    ) -> Self {
        let AgentWrites {
            marks: mark_rate,
            pairs: pair_limits,
        } = writes;
        Self {
            kept: Kept::spawn(store.clone(), !full_views_from_etcd),
            store,
            streams: Arc::new(Streams::new(streams_per_node)),
            marks: Mutex::new(Buckets::new(
                mark_rate.per_second,
                mark_rate.burst,
                MARK_NODES_MAX,
            )),
            pairs_per_node: pair_limits.per_node,
            pair_sets: Mutex::new(Buckets::new(
                pair_limits.rate.per_second,
                pair_limits.rate.burst,
                MARK_NODES_MAX,
            )),
            cluster,
            shutdown,
            metrics,
            loopback,
        }
    }

    /// The caller, as the gate (`crate::gate`) identified and authorized it before the
    /// body was read.
    fn authorize<T>(&self, req: &Request<T>, method: Method) -> Result<Peer, Status> {
        req.extensions().get::<Peer>().cloned().ok_or_else(|| {
            tracing::error!(method = ?method, "a call reached the service without passing the gate");
            Status::internal("the caller was not identified")
        })
    }

    /// The request speaks for `node`: a caller bound to another node is refused.
    fn check_node(peer: &Peer, method: Method, node: &str) -> Result<(), Status> {
        authz::check_node(peer, method, node).map_err(|e| {
            tracing::warn!(peer = %peer, method = ?method, node = %node, "refused: {e}");
            Status::permission_denied(e.to_string())
        })
    }
}

fn unavailable(e: StoreError) -> Status {
    Status::unavailable(e.to_string())
}

fn log_rejected(rejected: &[Rejected]) {
    for r in rejected {
        tracing::warn!(key = %r.key, error = %r.error, "corrupt registry entry in etcd skipped");
    }
}

/// Why a watch stream ended.
enum End {
    ClientGone,
    /// The caller's client certificate passed its notAfter.
    Expired,
    Replaced,
    Shutdown,
    Failed(Status),
}

type WatchStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::WatchEndpointsResponse, Status>> + Send>>;

/// Each call, counted by method and status (`aether_registrar_calls`).
#[tonic::async_trait]
impl Registry for Registrar {
    type WatchEndpointsStream = WatchStream;

    async fn watch_endpoints(
        &self,
        req: Request<pb::WatchEndpointsRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let r = self.watch(req).await;
        self.metrics.call("WatchEndpoints", &r);
        r
    }

    async fn set_endpoint_state(
        &self,
        req: Request<pb::SetEndpointStateRequest>,
    ) -> Result<Response<pb::SetEndpointStateResponse>, Status> {
        let r = self.set_state(req).await;
        self.metrics.call("SetEndpointState", &r);
        r
    }

    async fn set_quic_pairs(
        &self,
        req: Request<pb::SetQuicPairsRequest>,
    ) -> Result<Response<pb::SetQuicPairsResponse>, Status> {
        let r = self.set_pairs(req).await;
        self.metrics.call("SetQuicPairs", &r);
        r
    }

    async fn apply_services(
        &self,
        req: Request<pb::ApplyServicesRequest>,
    ) -> Result<Response<pb::ApplyServicesResponse>, Status> {
        let r = self.apply(req).await;
        self.metrics.call("ApplyServices", &r);
        r
    }

    async fn delete_service(
        &self,
        req: Request<pb::DeleteServiceRequest>,
    ) -> Result<Response<pb::DeleteServiceResponse>, Status> {
        let r = self.delete(req).await;
        self.metrics.call("DeleteService", &r);
        r
    }
}

impl Registrar {
    async fn watch(
        &self,
        req: Request<pb::WatchEndpointsRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let peer = self.authorize(&req, Method::WatchEndpoints)?;
        let req = req.into_inner();
        if req.node.is_empty() {
            return Err(Status::invalid_argument(
                "node: empty; a stream is keyed by cluster, node and instance",
            ));
        }
        // Else a caller could replace another node's stream (same key, empty instance).
        Self::check_node(&peer, Method::WatchEndpoints, &req.node)?;
        if let Some(c) = &self.cluster
            && !req.cluster.is_empty()
            && req.cluster != *c
        {
            return Err(Status::failed_precondition(format!(
                "cluster: this registrar serves cluster {c:?}, not {:?}",
                req.cluster
            )));
        }
        if req.resume_revision < 0 {
            return Err(Status::invalid_argument(format!(
                "resume_revision: {}",
                req.resume_revision
            )));
        }
        let key = StreamKey {
            cluster: req.cluster.clone(),
            node: req.node.clone(),
            instance: req.instance.clone(),
        };
        let (registration, replaced_rx, replaced) =
            self.streams.open(key.clone()).map_err(|e| {
                tracing::warn!(stream = %key, peer = %peer, open = ?e.open, "watch stream refused: the node has its most streams open");
                Metrics::count(&self.metrics.refusals, "watch_streams_per_node");
                Status::resource_exhausted(e.to_string())
            })?;
        if replaced {
            tracing::info!(stream = %key, "a newer stream replaces the open one of the same key");
        }
        tracing::info!(stream = %key, peer = %peer, resume_revision = req.resume_revision, "watch stream opened");
        let (tx, rx) = mpsc::channel(16);
        let pump = Pump {
            store: self.store.clone(),
            kept: self.kept.clone(),
            tx,
            replaced: replaced_rx,
            shutdown: self.shutdown.clone(),
            key,
            metrics: self.metrics.clone(),
            expires: peer.expires(),
        };
        tokio::spawn(pump.run(req.resume_revision, registration));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn set_state(
        &self,
        req: Request<pb::SetEndpointStateRequest>,
    ) -> Result<Response<pb::SetEndpointStateResponse>, Status> {
        let peer = self.authorize(&req, Method::SetEndpointState)?;
        let req = req.into_inner();
        let bad = |e: validate::Invalid| Status::invalid_argument(e.to_string());
        let address = validate::address("address", &req.address).map_err(bad)?;
        let state = values::state_from_pb(req.state).ok_or_else(|| {
            Status::invalid_argument(format!("state: {} is not a state", req.state))
        })?;
        if req.node.is_empty() {
            return Err(Status::invalid_argument(
                "node: empty; the caller's node is required",
            ));
        }
        Self::check_node(&peer, Method::SetEndpointState, &req.node)?;
        if !self
            .marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(&req.node, Instant::now())
        {
            tracing::warn!(node = %req.node, instance = %req.instance, peer = %peer, "SetEndpointState refused: the node is over its drain-mark rate");
            Metrics::count(&self.metrics.refusals, "drain_mark_rate");
            return Err(Status::resource_exhausted(format!(
                "node {:?} is over its drain-mark rate; retry later",
                req.node
            )));
        }
        let service = req
            .service
            .as_ref()
            .map(|k| validate::service_key("service", Some(k)))
            .transpose()
            .map_err(bad)?;
        let mark = MarkRequest {
            address,
            state,
            node: &req.node,
            instance: &req.instance,
        };
        for _ in 0..ATTEMPTS {
            let (revision, targets, guards) = self
                .mark_targets(service.as_ref(), address)
                .await
                .map_err(unavailable)?;
            let plan = match plan::set_marks(&self.store.layout, &mark, &targets) {
                Ok(plan) => plan,
                Err(MarkRefusal::NotFound) => {
                    let scope = service
                        .as_ref()
                        .map_or("any service".to_owned(), |s| s.to_string());
                    return Err(Status::not_found(format!(
                        "no endpoint at {address} in {scope}"
                    )));
                }
                Err(MarkRefusal::OtherNode {
                    service,
                    endpoint_node,
                }) => {
                    tracing::warn!(
                        caller_node = %req.node, instance = %req.instance, address = %address, service = %service,
                        endpoint_node = %endpoint_node, peer = %peer,
                        "SetEndpointState refused: the endpoint runs on another node than the caller's"
                    );
                    return Err(Status::permission_denied(format!(
                        "node {:?} may not set the state of {address} in {service}: that endpoint runs on node {endpoint_node:?}",
                        req.node
                    )));
                }
            };
            let skipped: Vec<pb::SkippedService> = plan
                .skipped
                .iter()
                .map(|s| pb::SkippedService {
                    service: Some(values::key_to_pb(&s.service)),
                    endpoint_node: s.endpoint_node.clone(),
                })
                .collect();
            let marked = u32::try_from(plan.marked.len()).unwrap_or(u32::MAX);
            let revision = if plan.ops.is_empty() {
                revision
            } else {
                match self
                    .store
                    .commit(revision, &guards, &plan.ops)
                    .await
                    .map_err(unavailable)?
                {
                    Some(revision) => {
                        let services: Vec<String> =
                            plan.marked.iter().map(ToString::to_string).collect();
                        tracing::info!(
                            node = %req.node, instance = %req.instance, address = %address, state = ?state,
                            services = %services.join(","), revision, "drain mark {}", if state == EndpointState::Healthy { "removed" } else { "set" }
                        );
                        revision
                    }
                    None => continue,
                }
            };
            for s in &plan.skipped {
                tracing::warn!(
                    caller_node = %req.node, instance = %req.instance, address = %address, service = %s.service,
                    endpoint_node = %s.endpoint_node, peer = %peer,
                    "SetEndpointState skipped a service: its endpoint at the address runs on another node than the caller's"
                );
            }
            return Ok(Response::new(pb::SetEndpointStateResponse {
                marked,
                revision,
                skipped,
            }));
        }
        Err(Status::aborted(format!(
            "the endpoints at {address} kept changing while being marked; retry"
        )))
    }

    async fn apply(
        &self,
        req: Request<pb::ApplyServicesRequest>,
    ) -> Result<Response<pb::ApplyServicesResponse>, Status> {
        let peer = self.authorize(&req, Method::ApplyServices)?;
        let services = validate::apply_request(req.get_ref(), self.loopback)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mut revision = 0;
        for s in &services {
            revision = revision.max(self.apply_one(s).await?);
        }
        tracing::info!(peer = %peer, services = services.len(), revision, "services applied");
        Ok(Response::new(pb::ApplyServicesResponse { revision }))
    }

    async fn delete(
        &self,
        req: Request<pb::DeleteServiceRequest>,
    ) -> Result<Response<pb::DeleteServiceResponse>, Status> {
        let peer = self.authorize(&req, Method::DeleteService)?;
        let key = validate::service_key("service", req.get_ref().service.as_ref())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let w = writes::delete(&self.store, &key, Source::File)
            .await
            .map_err(write_status)?;
        tracing::info!(peer = %peer, service = %key, deleted = w.existed, revision = w.revision, "service deleted");
        Ok(Response::new(pb::DeleteServiceResponse {
            deleted: w.existed,
            revision: w.revision,
        }))
    }
}

impl Registrar {
    /// A refusal of SetQuicPairs: logged, counted by `reason`, and `status` for the caller.
    fn refuse_pairs(
        &self,
        req: &pb::SetQuicPairsRequest,
        peer: &Peer,
        reason: &'static str,
        status: Status,
    ) -> Status {
        tracing::warn!(
            node = %req.node, instance = %req.instance, peer = %peer, reason,
            error = %status.message(), "SetQuicPairs refused"
        );
        Metrics::count(&self.metrics.refusals, reason);
        status
    }

    async fn set_pairs(
        &self,
        req: Request<pb::SetQuicPairsRequest>,
    ) -> Result<Response<pb::SetQuicPairsResponse>, Status> {
        let peer = self.authorize(&req, Method::SetQuicPairs)?;
        let req = req.into_inner();
        if let Err(e) = validate::node("node", &req.node) {
            let status = Status::invalid_argument(e.to_string());
            return Err(self.refuse_pairs(&req, &peer, "quic_pairs_invalid", status));
        }
        if let Err(e) = authz::check_node(&peer, Method::SetQuicPairs, &req.node) {
            let status = Status::permission_denied(e.to_string());
            return Err(self.refuse_pairs(&req, &peer, "quic_pairs_other_node", status));
        }
        let pairs = match validate::quic_pairs(&req.pairs, self.pairs_per_node, self.loopback) {
            Ok(p) => p,
            Err(e) => {
                let status = match e {
                    validate::PairsRefused::Invalid(_) => Status::invalid_argument(e.to_string()),
                    _ => Status::resource_exhausted(e.to_string()),
                };
                return Err(self.refuse_pairs(&req, &peer, e.reason(), status));
            }
        };
        if !self
            .pair_sets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(&req.node, Instant::now())
        {
            let status = Status::resource_exhausted(format!(
                "node {:?} is over its QUIC pair set rate (--quic-pair-sets-per-node); retry later with the whole set",
                req.node
            ));
            return Err(self.refuse_pairs(&req, &peer, "quic_pairs_rate", status));
        }
        let key = self.store.layout.quic_pairs(&req.node);
        let wanted = (!pairs.pairs.is_empty()).then(|| values::encode(&pairs));
        // First the set itself, unless etcd holds it already.
        let mut written = None;
        for _ in 0..ATTEMPTS {
            let (read, current) = self.store.read_key(&key, None).await.map_err(unavailable)?;
            let before = current
                .as_deref()
                .and_then(|v| values::decode::<PairsValue>(&key, "QUIC pair set", v).ok())
                .unwrap_or_default();
            if current == wanted {
                // Logged too, with the caller: who states the node's set is on record
                // whether or not it changed.
                tracing::info!(
                    node = %req.node, instance = %req.instance, peer = %peer, pairs = pairs.pairs.len(),
                    "QUIC pairs restated, unchanged"
                );
                written = Some((false, before));
                break;
            }
            let op = match &wanted {
                Some(value) => plan::Op::Put {
                    key: key.clone(),
                    value: value.clone(),
                },
                None => plan::Op::Delete { key: key.clone() },
            };
            if let Some(revision) = self
                .store
                .commit(read, &[Guard::Key(key.clone())], &[op])
                .await
                .map_err(unavailable)?
            {
                tracing::info!(
                    node = %req.node, instance = %req.instance, peer = %peer, pairs = pairs.pairs.len(),
                    before = before.pairs.len(), revision, "QUIC pairs set"
                );
                written = Some((true, before));
                break;
            }
        }
        let Some((changed, before)) = written else {
            return Err(Status::aborted(format!(
                "the QUIC pairs of node {:?} kept changing while being set; retry",
                req.node
            )));
        };
        // Then the node's endpoints at the pairs' addresses, old and new, carry the set.
        // Also when the set was unchanged: endpoints a writer left behind (a registrar
        // stopped between the two steps, or one that predates the pairs) are put right,
        // and ones already right are not rewritten.
        let ips: BTreeSet<IpAddr> = before
            .pairs
            .iter()
            .chain(&pairs.pairs)
            .map(|p| p.tcp.ip())
            .collect();
        let (revision, updated, unmatched) = self.twins(&req.node, &key, &ips).await?;
        if updated > 0 {
            tracing::info!(
                node = %req.node, instance = %req.instance, endpoints = updated, revision,
                "endpoints carry the node's QUIC pairs"
            );
        }
        Ok(Response::new(pb::SetQuicPairsResponse {
            revision,
            changed,
            endpoints_updated: u32::try_from(updated).unwrap_or(u32::MAX),
            unmatched: u32::try_from(unmatched).unwrap_or(u32::MAX),
        }))
    }

    /// Makes the endpoints on `node` at `ips` carry the pairs stored at `pairs_key`, in
    /// transactions of [`TWIN_OPS_PER_TXN`] rewrites, each guarded by the endpoints it
    /// rewrites (still there, unchanged) and the set (unchanged: a newer set makes its own
    /// call, which puts its endpoints right). The revision after, the endpoints rewritten
    /// and the pairs that match no endpoint on the node.
    async fn twins(
        &self,
        node: &str,
        pairs_key: &str,
        ips: &BTreeSet<IpAddr>,
    ) -> Result<(i64, usize, usize), Status> {
        let layout = &self.store.layout;
        let mut updated = 0;
        'read: for _ in 0..ATTEMPTS {
            let current = self.store.revision().await.map_err(unavailable)?;
            let (_, stored) = self
                .store
                .read_key(pairs_key, Some(current))
                .await
                .map_err(unavailable)?;
            let pairs = stored
                .as_deref()
                .and_then(|v| values::decode::<PairsValue>(pairs_key, "QUIC pair set", v).ok())
                .unwrap_or_default();
            let mut kvs = Vec::new();
            let mut scanned = false;
            for ip in ips {
                match self.kept.services_at(*ip, current).await {
                    Some(services) => {
                        for s in services {
                            let (_, mut found) = self
                                .store
                                .read_prefix(&layout.endpoints_at(&s, *ip), Some(current))
                                .await
                                .map_err(unavailable)?;
                            kvs.append(&mut found);
                        }
                    }
                    None => {
                        tracing::warn!(address = %ip, revision = current, "the address index is behind etcd; these QUIC pairs read every endpoint");
                        let (_, all) = self
                            .store
                            .read_prefix(&layout.all_endpoints(), Some(current))
                            .await
                            .map_err(unavailable)?;
                        kvs = all;
                        scanned = true;
                        break;
                    }
                }
            }
            if scanned {
                kvs.retain(|(k, _)| {
                    matches!(layout.parse(k), Ok(Key::Endpoint { address, .. }) if ips.contains(&address))
                });
            }
            let plan = plan::twins(layout, node, &pairs, &kvs);
            let mut revision = current;
            for chunk in plan.ops.chunks(TWIN_OPS_PER_TXN) {
                let mut guards = vec![Guard::Key(pairs_key.to_owned())];
                guards.extend(chunk.iter().filter_map(|op| match op {
                    plan::Op::Put { key, .. } => Some(Guard::Present(key.clone())),
                    _ => None,
                }));
                match self
                    .store
                    .commit(current, &guards, chunk)
                    .await
                    .map_err(unavailable)?
                {
                    Some(r) => {
                        revision = r;
                        updated += chunk.len();
                    }
                    None => continue 'read,
                }
            }
            return Ok((revision, updated, plan.unmatched));
        }
        Err(Status::aborted(format!(
            "the endpoints of node {node:?} kept changing while taking its QUIC pairs; retry"
        )))
    }
}

/// A write's error as the API says it.
fn write_status(e: WriteError) -> Status {
    match e {
        WriteError::Store(e) => unavailable(e),
        e @ (WriteError::Owned { .. } | WriteError::TooManyOps { .. }) => {
            Status::failed_precondition(e.to_string())
        }
        e @ WriteError::Contended { .. } => Status::aborted(e.to_string()),
    }
}

impl Registrar {
    /// The services with endpoints at `address` (only `service`, when given), each with
    /// its endpoints' nodes and its current mark, at one revision; and the keys the plan
    /// depends on.
    async fn mark_targets(
        &self,
        service: Option<&ServiceKey>,
        address: IpAddr,
    ) -> Result<(i64, Vec<MarkTarget>, Vec<Guard>), StoreError> {
        let layout = &self.store.layout;
        // The services to read: the one named, or those the address index finds at the
        // address as of etcd's current revision, read at that revision; without either,
        // every endpoint.
        let (candidates, at) = match service {
            Some(s) => (Some(vec![s.clone()]), None),
            None => {
                let current = self.store.revision().await?;
                match self.kept.services_at(address, current).await {
                    Some(found) => (Some(found), Some(current)),
                    None => {
                        tracing::warn!(address = %address, revision = current, "the address index is behind etcd; this drain mark reads every endpoint");
                        self.metrics.drain_mark_scans.inc();
                        (None, None)
                    }
                }
            }
        };
        let (revision, kvs) = match candidates {
            None => {
                self.store
                    .read_prefix(&layout.all_endpoints(), None)
                    .await?
            }
            Some(services) => {
                let mut revision = at;
                let mut kvs = Vec::new();
                for s in &services {
                    let (r, mut found) = self
                        .store
                        .read_prefix(&layout.endpoints_at(s, address), revision)
                        .await?;
                    revision = Some(r);
                    kvs.append(&mut found);
                }
                match revision {
                    Some(r) => (r, kvs),
                    None => (self.store.revision().await?, kvs),
                }
            }
        };
        let mut nodes: BTreeMap<ServiceKey, Vec<String>> = BTreeMap::new();
        for (k, v) in &kvs {
            match layout.parse(k) {
                Ok(Key::Endpoint {
                    service,
                    address: a,
                    ..
                }) if a == address => {
                    let text = String::from_utf8_lossy(k);
                    match values::decode::<EndpointValue>(&text, "endpoint", v) {
                        Ok(e) => nodes.entry(service).or_default().push(e.node),
                        Err(e) => {
                            tracing::warn!(key = %text, error = %e, "corrupt registry entry in etcd skipped")
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "corrupt registry entry in etcd skipped"),
            }
        }
        let mut targets = Vec::with_capacity(nodes.len());
        let mut guards = Vec::with_capacity(2 * nodes.len());
        for (s, endpoint_nodes) in nodes {
            let mark_key = layout.mark(&s, address);
            let (_, current) = self.store.read_key(&mark_key, Some(revision)).await?;
            // A corrupt mark is replaced as if absent.
            let current =
                current.and_then(|v| values::decode::<MarkValue>(&mark_key, "drain mark", &v).ok());
            guards.push(Guard::Prefix(layout.endpoints_at(&s, address)));
            guards.push(Guard::Key(mark_key));
            targets.push(MarkTarget {
                service: s,
                endpoint_nodes,
                current,
            });
        }
        Ok((revision, targets, guards))
    }

    /// Makes etcd hold `s` exactly, in one transaction; the revision after it.
    async fn apply_one(&self, s: &aether_model::Service) -> Result<i64, Status> {
        let started = std::time::Instant::now();
        let w = writes::apply(&self.store, s, Source::File)
            .await
            .map_err(write_status)?;
        if w.writes > 0 {
            tracing::info!(
                service = %s.key(), writes = w.writes, endpoints = s.endpoints.len(), revision = w.revision,
                attempts = w.attempts, took_ms = started.elapsed().as_secs_f64() * 1e3,
                commit_ms = w.commit.as_secs_f64() * 1e3,
                "service applied"
            );
        }
        Ok(w.revision)
    }
}

/// One watch stream: a full view unless resuming, then a batch per etcd watch response.
struct Pump {
    store: Store,
    kept: Arc<Kept>,
    tx: mpsc::Sender<Result<pb::WatchEndpointsResponse, Status>>,
    replaced: oneshot::Receiver<Replaced>,
    shutdown: watch::Receiver<bool>,
    key: StreamKey,
    metrics: Arc<Metrics>,
    /// The caller's certificate's notAfter, seconds since the epoch.
    expires: Option<u64>,
}

impl Pump {
    async fn run(mut self, resume_revision: i64, registration: Registration) {
        self.metrics.watch_streams.inc();
        // A stream lives no longer than the client certificate it was opened under.
        let expiry = self.expires.map(|at| {
            let left = std::time::UNIX_EPOCH + Duration::from_secs(at);
            left.duration_since(std::time::SystemTime::now())
                .unwrap_or_default()
        });
        let end = match expiry {
            Some(left) => tokio::select! {
                end = self.pump(resume_revision) => end,
                _ = tokio::time::sleep(left) => End::Expired,
            },
            None => self.pump(resume_revision).await,
        };
        self.metrics.watch_streams.dec();
        let why = match &end {
            End::ClientGone => "client_gone",
            End::Expired => "expired",
            End::Replaced => "replaced",
            End::Shutdown => "shutdown",
            End::Failed(_) => "failed",
        };
        Metrics::count(&self.metrics.watch_ends, why);
        let key = &self.key;
        let status = match end {
            End::ClientGone => {
                tracing::info!(stream = %key, "watch stream closed by the client");
                None
            }
            End::Expired => {
                tracing::info!(stream = %key, "watch stream ended: the client certificate expired");
                Some(Status::unauthenticated(
                    "the client certificate expired: reconnect with the rotated SVID and resume from your revision",
                ))
            }
            End::Replaced => {
                tracing::info!(stream = %key, "watch stream ended: replaced by a newer stream for the same key");
                Some(Status::aborted(format!(
                    "replaced by a newer stream for the same key ({key})"
                )))
            }
            End::Shutdown => Some(Status::unavailable(
                "the registrar is shutting down; resume from your revision on another replica",
            )),
            End::Failed(status) => {
                tracing::warn!(stream = %key, error = %status.message(), "watch stream failed");
                Some(status)
            }
        };
        if let Some(status) = status {
            let _ = self.tx.send(Err(status)).await;
        }
        // Unregistered only once the stream has ended, so a newer stream of the key is
        // never unregistered by the one it replaced.
        drop(registration);
    }

    async fn send(&mut self, kind: ResponseKind) -> Result<(), End> {
        let msg = Ok(pb::WatchEndpointsResponse { kind: Some(kind) });
        tokio::select! {
            sent = self.tx.send(msg) => sent.map_err(|_| End::ClientGone),
            _ = &mut self.replaced => Err(End::Replaced),
            _ = self.shutdown.wait_for(|s| *s) => Err(End::Shutdown),
        }
    }

    async fn pump(&mut self, resume_revision: i64) -> End {
        match self.pump_inner(resume_revision).await {
            Ok(never) => match never {},
            Err(end) => end,
        }
    }

    async fn pump_inner(&mut self, resume_revision: i64) -> Result<std::convert::Infallible, End> {
        let failed = |e: StoreError| End::Failed(unavailable(e));
        // The revision the client's view is at; 0 until it has one.
        let mut last = 0;
        let mut resync = None;
        // A full view after a compaction must be past it: the kept view may not have
        // seen it yet.
        let mut floor = 0;
        if resume_revision > 0 {
            let current = self.store.revision().await.map_err(failed)?;
            if resume_revision > current {
                resync = Some(format!(
                    "cannot resume after revision {resume_revision}: the store is at revision {current}, so it is not the store the client read"
                ));
            } else {
                last = resume_revision;
            }
        }
        loop {
            if last == 0 {
                let t = Instant::now();
                let (revision, kept, keys, read, built, mut full) =
                    match self.kept.full_view(&self.store.layout, floor).await {
                        Some(b) => {
                            log_rejected(&b.rejected);
                            let full = Arc::unwrap_or_clone(b.view);
                            (full.revision, true, b.keys, Duration::ZERO, b.took, full)
                        }
                        None => {
                            let (revision, kvs) = self
                                .store
                                .read_prefix(self.store.layout.prefix(), None)
                                .await
                                .map_err(failed)?;
                            let read = t.elapsed();
                            let (full, rejected) = view::full_view(
                                &self.store.layout,
                                revision,
                                kvs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())),
                            );
                            log_rejected(&rejected);
                            (revision, false, kvs.len(), read, t.elapsed() - read, full)
                        }
                    };
                if let Some(reason) = resync.take() {
                    tracing::info!(stream = %self.key, revision, reason = %reason, "sending a full view again");
                    full.resync = true;
                    full.reason = reason;
                }
                let services = full.services.len();
                self.send(ResponseKind::Full(full)).await?;
                Metrics::count(&self.metrics.full_views, if kept { "kept" } else { "etcd" });
                tracing::info!(
                    stream = %self.key,
                    revision,
                    services,
                    keys,
                    from = if kept { "kept view" } else { "etcd" },
                    read_ms = read.as_secs_f64() * 1e3,
                    build_ms = built.as_secs_f64() * 1e3,
                    total_ms = t.elapsed().as_secs_f64() * 1e3,
                    "full view sent"
                );
                last = revision;
            }
            match self.follow(last).await? {
                Follow::Compacted {
                    compact_revision,
                    at,
                } => {
                    floor = compact_revision;
                    resync = Some(format!(
                        "cannot resume after revision {at}: etcd compacted its history up to revision {compact_revision}"
                    ));
                    last = 0;
                }
            }
        }
    }

    /// Sends a batch per etcd watch response from `last + 1` on, until the history the
    /// client needs is gone (compacted) or the stream ends.
    async fn follow(&mut self, mut last: i64) -> Result<Follow, End> {
        let mut retries = 0;
        'watch: loop {
            let mut stream = match self.store.watch(last + 1).await {
                Ok(s) => s,
                Err(e) if retries < WATCH_RETRIES => {
                    retries += 1;
                    tracing::warn!(stream = %self.key, error = %e, "etcd watch failed; retrying");
                    self.backoff(retries).await?;
                    continue 'watch;
                }
                Err(e) => return Err(End::Failed(unavailable(e))),
            };
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    _ = &mut self.replaced => return Err(End::Replaced),
                    _ = self.shutdown.wait_for(|s| *s) => return Err(End::Shutdown),
                    _ = self.tx.closed() => return Err(End::ClientGone),
                };
                let resp = match msg {
                    Ok(Some(resp)) => resp,
                    Ok(None) | Err(_) if retries < WATCH_RETRIES => {
                        retries += 1;
                        tracing::warn!(stream = %self.key, error = ?msg.err(), last, "etcd watch broke; watching again from the stream's revision");
                        self.backoff(retries).await?;
                        continue 'watch;
                    }
                    Ok(None) => {
                        return Err(End::Failed(Status::unavailable("etcd ended the watch")));
                    }
                    Err(e) => {
                        return Err(End::Failed(Status::unavailable(format!("etcd watch: {e}"))));
                    }
                };
                if resp.compact_revision() > 0 {
                    return Ok(Follow::Compacted {
                        compact_revision: resp.compact_revision(),
                        at: last,
                    });
                }
                if resp.canceled() {
                    return Err(End::Failed(Status::unavailable(format!(
                        "etcd canceled the watch: {}",
                        resp.cancel_reason()
                    ))));
                }
                let events = resp.events();
                let Some(revision) = events
                    .iter()
                    .filter_map(|e| e.kv())
                    .map(|kv| kv.mod_revision())
                    .max()
                else {
                    continue;
                };
                retries = 0;
                // The batch's revision is its newest event's, not the response header's:
                // etcd may split a long catch-up into responses that all carry the
                // store's current revision, and a client resuming from that would miss
                // the rest.
                let (batch, rejected) = view::batch(
                    &self.store.layout,
                    revision,
                    events.iter().filter_map(|e| {
                        let kv = e.kv()?;
                        let kind = match e.event_type() {
                            EventType::Put => EventKind::Put,
                            EventType::Delete => EventKind::Delete,
                        };
                        Some(Event {
                            kind,
                            key: kv.key(),
                            value: kv.value(),
                        })
                    }),
                );
                log_rejected(&rejected);
                // A response of keys clients do not see (a node's QUIC pair set, whose
                // endpoints come in their own transactions) sends nothing: a set that
                // matches no endpoint yet wakes no node. A client resuming from the
                // revision before it reads the same nothing again. One of corrupt
                // entries only still sends its (empty) batch, as it always did.
                if !batch.changes.is_empty() || !rejected.is_empty() {
                    self.send(ResponseKind::Changes(batch)).await?;
                }
                last = revision;
            }
        }
    }

    async fn backoff(&mut self, attempt: u32) -> Result<(), End> {
        let pause = Duration::from_millis(100) * 2u32.pow(attempt.min(5));
        tokio::select! {
            _ = tokio::time::sleep(pause) => Ok(()),
            _ = &mut self.replaced => Err(End::Replaced),
            _ = self.shutdown.wait_for(|s| *s) => Err(End::Shutdown),
            _ = self.tx.closed() => Err(End::ClientGone),
        }
    }
}

enum Follow {
    /// etcd no longer has the history after `at`.
    Compacted { compact_revision: i64, at: i64 },
}
