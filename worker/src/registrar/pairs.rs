//! The owner's QUIC pair sets: each set the owner decides
//! ([`crate::writers::quic_pairs`]) stated to the registrar with `SetQuicPairs`, the node's
//! whole set in one call. Only the owner starts this (from serving): a standby has no
//! sender and so writes nothing to the registry.
//!
//! A call states a state, so only the newest set matters: sets that arrive while a call is
//! in flight or while the registrar is unreachable are folded into the next call, which is
//! retried with the registrar client's backoff (and at most once a second, the registrar's
//! default rate per node). The first call restates what the owner restored, which the
//! registrar already holds from the previous owner: it writes nothing and pushes nothing.

use std::sync::Arc;
use std::time::Duration;

use shared_proto::registry as pb;
use shared_proto::registry::registry_client::RegistryClient;
use tokio::sync::watch;
use tonic::transport::Channel;
use tracing::{info, warn};

use super::{Address, Identity, backoff, connect, status_error};
use crate::health::{QuicPairsStatus, Status};
use crate::metrics::{Metrics, ResultLabel};
use crate::writers::QuicPairs;
use crate::writers::quic_pairs::Pair;

/// The least time between two calls: the registrar's default rate per node
/// (`--quic-pair-sets-per-node` 1).
const MIN_INTERVAL: Duration = Duration::from_secs(1);

fn to_pb(p: &Pair) -> pb::QuicPair {
    pb::QuicPair {
        tcp: p.tcp.to_string(),
        quic: p.quic.clone(),
        quic_sni: p.sni.clone(),
        pod: p.pod.clone(),
        since: i64::try_from(p.since).unwrap_or(i64::MAX),
    }
}

/// Starts the owner's pair-set writer; it ends once the pairs' final flush happened.
pub fn spawn(
    addrs: Vec<Address>,
    me: Identity,
    pairs: Arc<QuicPairs>,
    metrics: Arc<Metrics>,
    status: Arc<watch::Sender<Status>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut sets = pairs.sets();
        let mut client: Option<RegistryClient<Channel>> = None;
        let mut backoff = backoff();
        let mut attempt = 0usize;
        // The set the registrar last answered for.
        let mut stated: Option<Vec<Pair>> = None;
        loop {
            let Some(want) = sets.borrow_and_update().clone() else {
                if sets.changed().await.is_err() {
                    return;
                }
                continue;
            };
            if stated.as_ref() == Some(&want) {
                if sets.changed().await.is_err() {
                    return;
                }
                continue;
            }
            if pairs.released() {
                return;
            }
            let count = |result: &str| {
                metrics
                    .quic_pair_sets
                    .get_or_create(&ResultLabel {
                        result: result.into(),
                    })
                    .inc();
            };
            let addr = &addrs[attempt % addrs.len()];
            let outcome = async {
                let c = match &mut client {
                    Some(c) => c,
                    None => client.insert(connect(addr, &me).await?),
                };
                let request = me.request(pb::SetQuicPairsRequest {
                    node: me.node.clone(),
                    pairs: want.iter().map(to_pb).collect(),
                    instance: me.instance.clone(),
                })?;
                c.set_quic_pairs(request)
                    .await
                    .map(tonic::Response::into_inner)
                    .map_err(status_error)
            }
            .await;
            match outcome {
                Ok(r) => {
                    count(if r.changed { "changed" } else { "unchanged" });
                    info!(
                        pairs = want.len(),
                        changed = r.changed,
                        revision = r.revision,
                        endpoints_updated = r.endpoints_updated,
                        unmatched = r.unmatched,
                        "QUIC pairs stated to the registrar"
                    );
                    status.send_modify(|s| {
                        s.quic_pairs
                            .get_or_insert_with(QuicPairsStatus::default)
                            .registry_revision = Some(r.revision)
                    });
                    stated = Some(want);
                    backoff.reset();
                    tokio::time::sleep(MIN_INTERVAL).await;
                }
                Err(e) => {
                    count("failed");
                    status.send_modify(|s| {
                        s.quic_pairs
                            .get_or_insert_with(QuicPairsStatus::default)
                            .registry_failures += 1
                    });
                    warn!(registrar = %addr, pairs = want.len(), error = %format!("{e:#}"), "QUIC pairs: SetQuicPairs failed; retrying with the newest set");
                    client = None;
                    attempt += 1;
                    tokio::time::sleep(backoff.next_wait().max(MIN_INTERVAL)).await;
                }
            }
        }
    })
}
