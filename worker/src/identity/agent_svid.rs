//! The agent's own SVID and the trust bundle, from the SPIFFE Workload API
//! (`--spiffe-endpoint`).
//!
//! One `FetchX509SVID` stream: the provider sends the current SVID and bundles at once and
//! again at each rotation. Each message becomes `SetAgentSvid` and `SetBundle` when it
//! differs from what the node holds; the first SVID opens the `agent_svid` gate. The SVID
//! must be in `--trust-domain`: one from another trust domain is not served, and is a
//! `/ready` problem and an error naming both. When the stream ends or the provider is
//! unreachable, the client reconnects with the shared jittered backoff, says so in
//! `/ready` and the log, and the node keeps the last SVID (the expiry check warns as it
//! ages).
//!
//! The stream is the `spiffe` crate's `WorkloadApiClient::stream_x509_contexts`, the
//! client its `X509Source` runs on, driven here rather than through `X509Source`: the
//! source reconnects on its own schedule and signals nothing when a reconnect brings
//! back the material it already had, so `/ready` could not tell when the provider came
//! back, and the retries could not follow the agent's shared backoff.

use std::sync::Arc;

use aether_model::{Change, Svid};
use futures::StreamExt;
use spiffe::transport::Endpoint;
use spiffe::{TrustDomain, WorkloadApiClient, X509Context};
use tracing::{error, info, warn};

use super::convert;
use super::link;
use crate::health::{Reporter, SvidStatus};
use crate::metrics::{Metrics, SvidSourceLabel};
use crate::node::Node;

/// The problem source while the Workload API cannot be reached or sends nothing usable.
pub const PROBLEM: &str = "workload-api";
/// The problem source while the agent's SVID is outside `--trust-domain`.
pub const PROBLEM_TRUST_DOMAIN: &str = "trust-domain";

/// What this client last handed the node.
#[derive(Default)]
struct Held {
    svid: Option<Svid>,
    bundle: Option<String>,
    /// The foreign SPIFFE ID last refused, so that its error is logged once.
    refused: Option<String>,
}

/// Follows the Workload API at `endpoint` until the task is aborted, feeding the node.
pub fn spawn(
    endpoint: Endpoint,
    endpoint_text: String,
    trust_domain: TrustDomain,
    node: Arc<Node>,
    metrics: Arc<Metrics>,
    problems: Reporter,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut held = Held::default();
        let mut backoff = link::backoff();
        loop {
            let (progressed, why) = match watch_once(
                &endpoint,
                &trust_domain,
                &mut held,
                &node,
                &metrics,
                &problems,
            )
            .await
            {
                Ok(progressed) => (progressed, "stream ended".to_string()),
                Err((progressed, e)) => (progressed, format!("{e:#}")),
            };
            metrics.identity_workload_api_connected.set(0);
            problems.identity(|s| s.workload_api = "reconnecting");
            if progressed {
                backoff.reset();
            }
            let state = if held.svid.is_some() {
                "serving the last SVID"
            } else {
                "no SVID yet"
            };
            warn!(endpoint = %endpoint_text, error = %why, "Workload API unreachable; {state}; reconnecting");
            problems.set(
                PROBLEM,
                format!("Workload API {endpoint_text}: {why} ({state}; reconnecting)"),
            );
            tokio::time::sleep(backoff.next_wait()).await;
        }
    })
}

/// One stream: connect, then apply each message until the stream ends. Says whether a
/// message came, so the backoff starts over after a stream that worked.
async fn watch_once(
    endpoint: &Endpoint,
    trust_domain: &TrustDomain,
    held: &mut Held,
    node: &Node,
    metrics: &Metrics,
    problems: &Reporter,
) -> Result<bool, (bool, anyhow::Error)> {
    let channel = link::channel(endpoint, false)
        .await
        .map_err(|e| (false, e.context("connecting")))?;
    let client = WorkloadApiClient::new_with_channel(endpoint.clone(), channel);
    let mut stream = client
        .stream_x509_contexts()
        .await
        .map_err(|e| (false, anyhow::Error::new(e).context("FetchX509SVID")))?;
    metrics.identity_workload_api_connected.set(1);
    let mut progressed = false;
    while let Some(message) = stream.next().await {
        let context = message.map_err(|e| (progressed, anyhow::Error::new(e)))?;
        if !progressed {
            info!("Workload API stream open");
            problems.identity(|s| s.workload_api = "connected");
        }
        progressed = true;
        apply(&context, trust_domain, held, node, metrics, problems);
    }
    Ok(progressed)
}

/// Hands the node what changed in `context`.
fn apply(
    context: &X509Context,
    trust_domain: &TrustDomain,
    held: &mut Held,
    node: &Node,
    metrics: &Metrics,
    problems: &Reporter,
) {
    let mut changes = Vec::new();
    match context.bundle_set().get(trust_domain) {
        Some(bundle) => {
            let pem = convert::bundle_pem(&bundle);
            if held.bundle.as_ref() != Some(&pem) {
                info!(trust_domain = %trust_domain, authorities = bundle.authorities().len(), "trust bundle from the Workload API");
                held.bundle = Some(pem.clone());
                changes.push(Change::SetBundle(Some(pem)));
            }
        }
        None => {
            warn!(trust_domain = %trust_domain, "the Workload API sent no bundle for the trust domain; keeping the last one")
        }
    }
    // What is wrong with this message's SVID, if anything but its trust domain.
    let mut unusable = None;
    // Published on /ready only once the node has the SVID: whoever sees it there finds it
    // in the node's inputs too.
    let mut published = None;
    match context.default_svid() {
        None => {
            unusable = Some(
                "the Workload API sent no SVID for the agent (keeping the last one)".to_string(),
            )
        }
        Some(x) if x.spiffe_id().trust_domain() != trust_domain => {
            let id = x.spiffe_id().to_string();
            if held.refused.as_ref() != Some(&id) {
                error!(spiffe_id = %id, trust_domain = %trust_domain, "the agent's SVID is not in --trust-domain; it is not served");
                held.refused = Some(id.clone());
            }
            problems.set(PROBLEM_TRUST_DOMAIN, format!("the agent's SVID {id} is not in --trust-domain {trust_domain}: it is not served"));
        }
        Some(x) => match convert::svid(x) {
            Ok(svid) => {
                held.refused = None;
                problems.clear(PROBLEM_TRUST_DOMAIN);
                if held.svid.as_ref() != Some(&svid) {
                    info!(spiffe_id = %svid.spiffe_id, serial = %svid.serial, not_after = svid.not_after, "the agent's SVID from the Workload API");
                    metrics
                        .identity_svid_updates
                        .get_or_create(&SvidSourceLabel {
                            source: "agent".into(),
                        })
                        .inc();
                    let status = SvidStatus {
                        spiffe_id: svid.spiffe_id.clone(),
                        serial: svid.serial.clone(),
                        not_after: svid.not_after,
                    };
                    published = Some(status);
                    held.svid = Some(svid.clone());
                    changes.push(Change::SetAgentSvid(Some(svid)));
                }
            }
            Err(e) => {
                warn!(error = %e, "the agent's SVID from the Workload API is unusable; keeping the last one");
                unusable = Some(format!("{e} (keeping the last SVID)"));
            }
        },
    }
    node.apply(changes);
    let bundle = held.bundle.is_some();
    problems.identity(|s| {
        s.bundle = bundle;
        if let Some(status) = published {
            s.agent = Some(status);
        }
    });
    match unusable {
        Some(why) => problems.set(PROBLEM, why),
        None => problems.clear(PROBLEM),
    }
    if held.svid.is_some() {
        node.set_gate(|g| g.agent_svid = true);
    }
}
