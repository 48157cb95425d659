//! One resource's watch, kept alive: kube-runtime's watcher (list, then watch from the
//! list's resource version with bookmarks; a relist on `410 Gone`), with a jittered
//! backoff between failures, every failure classified, counted, logged and shown in
//! `/ready`, and a probe that says when the watch works again.
//!
//! The watcher reports failures but not recoveries: after a failure, a watch that
//! resumed from its resource version is silent until the next change. So once a failed
//! watch has been quiet for [`QUIET`], a one-item list with the same selector tells
//! whether the API server answers again.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use serde::de::DeserializeOwned;
use tracing::{error, info, warn};

use crate::health::Reporter;
use crate::metrics::{KubeErrorLabel, Metrics, ResourceLabel};

/// The problem source `/ready` names for the Kubernetes API.
pub const PROBLEM: &str = "kubernetes";
/// How long a failed watch must be quiet before the probe asks whether it is back.
pub const QUIET: Duration = Duration::from_secs(1);

/// The watch of one resource: what it is called in logs, metrics and RBAC, and its
/// field selector.
#[derive(Debug, Clone)]
pub struct Watched {
    /// `pods` or `nodes`: the RBAC resource.
    pub resource: &'static str,
    pub selector: String,
}

/// The `kubernetes` problem in `/ready`, made of one part per trouble spot (the pod
/// watch, the node watch, the taint patch, the client), so that one recovering does not
/// hide another.
#[derive(Clone)]
pub struct Trouble {
    reporter: Reporter,
    parts: Arc<Mutex<BTreeMap<&'static str, String>>>,
}

impl Trouble {
    pub fn new(reporter: Reporter) -> Self {
        Self {
            reporter,
            parts: Arc::default(),
        }
    }

    pub fn set(&self, part: &'static str, message: String) {
        let mut parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
        parts.insert(part, message);
        self.publish(&parts);
    }

    pub fn clear(&self, part: &'static str) {
        let mut parts = self.parts.lock().unwrap_or_else(|e| e.into_inner());
        if parts.remove(part).is_some() {
            self.publish(&parts);
        }
    }

    fn publish(&self, parts: &BTreeMap<&'static str, String>) {
        if parts.is_empty() {
            self.reporter.clear(PROBLEM);
        } else {
            let text: Vec<String> = parts.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            self.reporter.set(
                PROBLEM,
                format!("{} (serving from what the agent has)", text.join("; ")),
            );
        }
    }
}

pub use crate::backoff::{Backoff, seed};

/// The API clients' first wait after a failure.
pub const BACKOFF_BASE: Duration = Duration::from_millis(100);
/// The API clients' longest wait.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The API clients' backoff: 0.1 s doubling to 30 s, jittered, so that the agents of
/// many nodes do not retry in step against a recovering API server.
pub fn backoff() -> Backoff {
    Backoff::new(BACKOFF_BASE, BACKOFF_MAX).jittered(seed())
}

/// A failure, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The metric's `reason`: forbidden, unauthorized, gone, unreachable, server, api, other.
    pub reason: &'static str,
    /// One sentence for the log and `/ready`.
    pub message: String,
}

/// The RBAC the agent needs, for the messages of a 403.
pub const NEEDS: &str = "the agent needs pods: get, list, watch and nodes: get, list, watch, patch";

/// Classifies a failed request `verb` on `what`.
pub fn classify_client(verb: &str, what: &Watched, e: &kube::Error) -> Failure {
    match e {
        kube::Error::Api(status) => classify_status(verb, what, status.code, &status.message),
        kube::Error::HyperError(_) | kube::Error::Service(_) => Failure {
            reason: "unreachable",
            message: format!(
                "cannot reach the API server to {verb} {}: {}",
                what.resource,
                chain(e)
            ),
        },
        other => Failure {
            reason: "other",
            message: format!("{verb} {}: {}", what.resource, chain(other)),
        },
    }
}

/// Classifies an answer with HTTP status `code` to `verb` on `what`.
pub fn classify_status(verb: &str, what: &Watched, code: u16, message: &str) -> Failure {
    let (reason, message) = match code {
        403 => (
            "forbidden",
            format!(
                "403 Forbidden: the API server denies `{verb} {}` (fieldSelector {}) to this agent's credentials ({message}); {NEEDS}",
                what.resource, what.selector
            ),
        ),
        401 => (
            "unauthorized",
            format!(
                "401 Unauthorized: the API server does not accept this agent's credentials to {verb} {} ({message})",
                what.resource
            ),
        ),
        410 => (
            "gone",
            format!(
                "410 Gone: the {} watch's resource version has expired; relisting ({message})",
                what.resource
            ),
        ),
        500..=599 => (
            "server",
            format!(
                "{verb} {}: the API server answered {code} ({message})",
                what.resource
            ),
        ),
        _ => (
            "api",
            format!(
                "{verb} {}: the API server answered {code} ({message})",
                what.resource
            ),
        ),
    };
    Failure { reason, message }
}

/// Classifies a watcher error.
pub fn classify(what: &Watched, e: &watcher::Error) -> Failure {
    match e {
        watcher::Error::InitialListFailed(c) => classify_client("list", what, c),
        watcher::Error::WatchStartFailed(c) | watcher::Error::WatchFailed(c) => {
            classify_client("watch", what, c)
        }
        watcher::Error::WatchError(status) => {
            classify_status("watch", what, status.code, &status.message)
        }
        watcher::Error::NoResourceVersion => Failure {
            reason: "other",
            message: format!("the {} list carried no resourceVersion", what.resource),
        },
    }
}

/// An error and its sources, outermost first.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

/// What a watch tells its owner.
#[derive(Debug)]
pub enum Step<K> {
    Event(watcher::Event<K>),
    /// The watch failed; it resumes or relists after a backoff.
    Failed,
    /// A failed watch works again (the probe answered) without having relisted.
    Resumed,
}

/// Runs the watch of `what` until the task is dropped, handing every step to `on`.
pub async fn run<K>(
    api: Api<K>,
    what: Watched,
    metrics: Arc<Metrics>,
    trouble: Trouble,
    mut on: impl FnMut(Step<K>),
) where
    K: kube::Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let label = ResourceLabel {
        resource: what.resource.to_string(),
    };
    let connected = metrics.kube_connected.get_or_create(&label).clone();
    let mut stream = std::pin::pin!(watcher(
        api.clone(),
        watcher::Config::default().fields(&what.selector)
    ));
    let mut backoff = backoff();
    let mut failing: Option<Failure> = None;
    let mut lists = 0u64;
    loop {
        let item = if failing.is_some() {
            tokio::select! {
                item = stream.next() => item,
                () = tokio::time::sleep(QUIET) => {
                    let probe = ListParams::default().fields(&what.selector).limit(1);
                    if api.list(&probe).await.is_ok() {
                        recovered(&what, &mut failing, &connected, &trouble);
                        on(Step::Resumed);
                    }
                    continue;
                }
            }
        } else {
            stream.next().await
        };
        let Some(item) = item else {
            // The watcher's stream never ends; if it did, nothing would feed the view.
            error!(resource = what.resource, "Kubernetes watch stream ended");
            return;
        };
        match item {
            Ok(event) => {
                if failing.is_some() && !matches!(event, watcher::Event::Init) {
                    recovered(&what, &mut failing, &connected, &trouble);
                }
                if matches!(event, watcher::Event::InitDone) {
                    lists += 1;
                    if lists > 1 {
                        metrics.kube_relists.get_or_create(&label).inc();
                    }
                    connected.set(1);
                }
                // `Init` comes before the list is even tried: only what the server sent
                // shows the watch works.
                if !matches!(event, watcher::Event::Init) {
                    backoff.reset();
                }
                on(Step::Event(event));
            }
            Err(e) => {
                let f = classify(&what, &e);
                metrics
                    .kube_watch_errors
                    .get_or_create(&KubeErrorLabel {
                        resource: what.resource.to_string(),
                        reason: f.reason.to_string(),
                    })
                    .inc();
                let wait = backoff.next_wait();
                match f.reason {
                    // An expired resource version: the watcher relists at once by design.
                    "gone" => info!(
                        resource = what.resource,
                        "Kubernetes watch history expired (410 Gone); relisting"
                    ),
                    "forbidden" | "unauthorized" => {
                        error!(
                            resource = what.resource,
                            reason = f.reason,
                            retry_in_ms = wait.as_millis() as u64,
                            "Kubernetes API: {}",
                            f.message
                        )
                    }
                    _ => warn!(
                        resource = what.resource,
                        reason = f.reason,
                        retry_in_ms = wait.as_millis() as u64,
                        "Kubernetes watch failed: {}",
                        f.message
                    ),
                }
                connected.set(0);
                if f.reason != "gone" {
                    trouble.set(what.resource, f.message.clone());
                    failing = Some(f);
                }
                on(Step::Failed);
                tokio::time::sleep(wait).await;
            }
        }
    }
}

fn recovered(
    what: &Watched,
    failing: &mut Option<Failure>,
    connected: &prometheus_client::metrics::gauge::Gauge,
    trouble: &Trouble,
) {
    if let Some(f) = failing.take() {
        info!(resource = what.resource, was = %f.message, "Kubernetes watch works again");
    }
    connected.set(1);
    trouble.clear(what.resource);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Watched {
        Watched {
            resource: "pods",
            selector: "spec.nodeName=n1".into(),
        }
    }

    #[test]
    fn failures_are_classified_and_a_403_names_the_verb_and_the_resource() {
        let cases = [
            (
                403,
                "forbidden",
                "403 Forbidden: the API server denies `list pods` (fieldSelector spec.nodeName=n1)",
            ),
            (401, "unauthorized", "401 Unauthorized"),
            (410, "gone", "410 Gone"),
            (503, "server", "answered 503"),
            (404, "api", "answered 404"),
        ];
        for (code, reason, text) in cases {
            let f = classify_status(
                "list",
                &pods(),
                code,
                "pods is forbidden: User \"x\" cannot list resource \"pods\"",
            );
            assert_eq!(f.reason, reason, "{code}");
            assert!(f.message.contains(text), "{code}: {}", f.message);
        }
        let f = classify_status("watch", &pods(), 403, "denied");
        assert!(
            f.message.contains("`watch pods`")
                && f.message.contains("(denied)")
                && f.message.contains(NEEDS),
            "{}",
            f.message
        );
    }

    #[test]
    fn the_backoff_stays_between_a_twentieth_of_a_second_and_thirty_seconds_and_resets() {
        let mut b = Backoff::new(BACKOFF_BASE, BACKOFF_MAX).jittered(7);
        let waits: Vec<_> = (0..12).map(|_| b.next_wait()).collect();
        assert!(
            waits
                .iter()
                .all(|w| *w >= BACKOFF_BASE / 2 && *w <= BACKOFF_MAX),
            "{waits:?}"
        );
        assert!(
            waits[0] <= BACKOFF_BASE && waits[11] >= BACKOFF_MAX / 2,
            "{waits:?}"
        );
        b.reset();
        assert!(b.next_wait() <= BACKOFF_BASE);
    }

    #[test]
    fn trouble_joins_its_parts_into_one_problem_and_clears_with_the_last() {
        let status = Arc::new(tokio::sync::watch::Sender::new(crate::health::Status::new(
            "n", "p",
        )));
        let t = Trouble::new(Reporter::new(status.clone()));
        let problems = || {
            status
                .borrow()
                .problems
                .iter()
                .map(|p| (p.source, p.message.clone()))
                .collect::<Vec<_>>()
        };
        t.set("pods", "a".into());
        t.set("nodes", "b".into());
        assert_eq!(
            problems(),
            [(
                PROBLEM,
                "nodes: b; pods: a (serving from what the agent has)".to_string()
            )]
        );
        t.clear("nodes");
        assert_eq!(
            problems(),
            [(
                PROBLEM,
                "pods: a (serving from what the agent has)".to_string()
            )]
        );
        t.clear("pods");
        assert!(problems().is_empty());
    }
}
