//! Workload identity (SPIFFE): the agent's own SVID and the trust bundle from the
//! Workload API ([`agent_svid`]), one SVID per local pod from SPIRE's Delegated Identity
//! API ([`pods`]), and what they say about the node's health ([`checks`]: pods without an
//! SVID, SVIDs near expiry). Each source converts what it receives into the model's
//! types ([`convert`]) and feeds the node through `Node::apply`; the builder turns them
//! into SDS secrets and the pods' mTLS. Keys stay in memory: the proxy gets them inline
//! over SDS, and nothing here writes a file.
//!
//! Identity is on when `--spiffe-endpoint` is set. Owner and standby run the same
//! clients from start: a standby is complete only once it holds the agent's SVID, and it
//! holds its pods' SVIDs before it takes the node over.

pub mod agent_svid;
pub mod checks;
pub mod convert;
mod link;
pub mod placement;
pub mod pods;

use std::sync::Arc;

use tracing::{info, warn};

use crate::config::IdentityConfig;
use crate::health::Reporter;
use crate::metrics::Metrics;
use crate::node::Node;

pub use checks::lacking_svids;

/// The identity tasks; they end when this is dropped.
pub struct Identity {
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Identity {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Starts the identity clients and checks for `node`, whose inputs carry `cfg`'s trust
/// domain and mode.
pub fn spawn(
    cfg: IdentityConfig,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    problems: Reporter,
    placement: Option<pods::PodViews>,
) -> Identity {
    info!(
        workload_api = %cfg.workload_api_text,
        broker = cfg.broker.as_ref().map_or("none", |b| b.1.as_str()),
        trust_domain = %cfg.trust_domain,
        mtls = cfg.mode.as_str(),
        "workload identity on"
    );
    problems.identity(|s| {
        s.trust_domain = cfg.trust_domain.to_string();
        s.mtls = cfg.mode.as_str();
        s.workload_api = "connecting";
    });
    let mut tasks = vec![
        agent_svid::spawn(
            cfg.workload_api,
            cfg.workload_api_text,
            cfg.trust_domain.clone(),
            node.clone(),
            metrics.clone(),
            problems.clone(),
        ),
        tokio::spawn(checks::run(
            node.clone(),
            cfg.mode,
            metrics.clone(),
            problems.clone(),
        )),
    ];
    match cfg.broker {
        Some((endpoint, text)) => tasks.push(pods::spawn(
            endpoint,
            text,
            cfg.trust_domain,
            node,
            metrics,
            problems,
            placement,
        )),
        None if cfg.mode == aether_model::MtlsMode::Strict => {
            warn!(
                "strict mTLS without --spiffe-broker-endpoint: no pod gets an SVID, so no pod has an inbound listener"
            );
        }
        None => info!(
            "no --spiffe-broker-endpoint: pods get no SVID of their own (permissive: their calls go plaintext; strict: they have no inbound listener)"
        ),
    }
    Identity { tasks }
}
