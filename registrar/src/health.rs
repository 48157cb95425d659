//! `--health-addr`: the kubelet's probes, on plain HTTP/1.1 (the registry API may be TLS,
//! which an `httpGet` probe would have to trust; this port carries no registry data).
//!
//! - `GET /live`: 200 while the process answers at all.
//! - `GET /ready`: 200 once the registry API listens and etcd answers (its revision read
//!   within [`ETCD_CHECK`]); 503 before, after SIGTERM (so that the Service stops sending
//!   new callers while the open streams end), and while etcd does not answer, naming the
//!   error. A replica that cannot reach etcd cannot open a watch, so the Service sends
//!   agents to one that can.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::store::Store;

/// How long a readiness check waits for etcd (the chart's probe times out after 2 s).
pub const ETCD_CHECK: Duration = Duration::from_secs(1);

/// What `/ready` looks at.
pub struct Health {
    store: Store,
    /// The registry API listens.
    serving: AtomicBool,
    /// SIGTERM or SIGINT came: stopping.
    stopping: AtomicBool,
}

impl Health {
    pub fn new(store: Store) -> Arc<Self> {
        Arc::new(Health {
            store,
            serving: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        })
    }

    pub fn set_serving(&self) {
        self.serving.store(true, Ordering::SeqCst);
    }

    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// `/ready`'s answer: the status and why. etcd is asked only when nothing else stands
    /// in the way.
    pub async fn ready(&self) -> (u16, String) {
        let (serving, stopping) = (
            self.serving.load(Ordering::SeqCst),
            self.stopping.load(Ordering::SeqCst),
        );
        let etcd = match serving && !stopping {
            true => Some(
                self.store
                    .revision_within(ETCD_CHECK)
                    .await
                    .map_err(|e| e.to_string()),
            ),
            false => None,
        };
        verdict(serving, stopping, etcd)
    }
}

/// `/ready`'s answer from what it found: whether the API listens, whether SIGTERM came,
/// and etcd's revision or error (None: not asked).
fn verdict(serving: bool, stopping: bool, etcd: Option<Result<i64, String>>) -> (u16, String) {
    match (stopping, serving, etcd) {
        (true, _, _) => (503, "not ready: stopping (SIGTERM)\n".into()),
        (false, false, _) => (
            503,
            "not ready: the registry API does not listen yet\n".into(),
        ),
        (false, true, Some(Ok(revision))) => (200, format!("ready: etcd at revision {revision}\n")),
        (false, true, Some(Err(e))) => (503, format!("not ready: {e}\n")),
        (false, true, None) => (503, "not ready: etcd not asked\n".into()),
    }
}

/// Serves `/live` and `/ready` on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, health: Arc<Health>) {
    crate::http::serve(listener, move |method, path| {
        let health = health.clone();
        async move {
            let text = "text/plain; charset=utf-8";
            match (method, path.as_str()) {
                (hyper::Method::GET, "/live") => (200, text, "live\n".to_owned()),
                (hyper::Method::GET, "/ready") => {
                    let (status, body) = health.ready().await;
                    if status != 200 {
                        tracing::debug!(answer = %body.trim_end(), "readiness probe: not ready");
                    }
                    (status, text, body)
                }
                _ => (404, text, "try GET /ready or GET /live\n".to_owned()),
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::verdict;

    /// Ready only while the API listens, no SIGTERM came and etcd answered; each other
    /// answer is 503 and says why.
    #[test]
    fn ready_needs_the_listener_etcd_and_no_sigterm() {
        assert_eq!(
            verdict(true, false, Some(Ok(7))),
            (200, "ready: etcd at revision 7\n".into())
        );
        let not = |serving, stopping, etcd: Option<Result<i64, String>>, why: &str| {
            let (status, body) = verdict(serving, stopping, etcd);
            assert_eq!(status, 503, "{body}");
            assert!(body.contains(why), "{body:?} does not say {why:?}");
        };
        not(false, false, None, "does not listen yet");
        not(true, true, Some(Ok(7)), "stopping (SIGTERM)");
        not(false, true, None, "stopping (SIGTERM)");
        not(
            true,
            false,
            Some(Err("etcd at http://127.0.0.1:1: no answer within 1s".into())),
            "etcd at http://127.0.0.1:1",
        );
    }
}
