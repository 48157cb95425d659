//! The etcd edge: connecting (optionally over TLS), paged range reads at one revision,
//! transactions guarded by the revision their plan was read at, and watches. Everything
//! here is I/O; what the keys and values mean is `keys`, `values` and `view`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Txn, TxnOp,
    WatchOptions, WatchStream,
};

use crate::keys::Layout;
use crate::plan::Op;

/// How to reach etcd (`--etcd`, `--etcd-ca`, `--etcd-cert`, `--etcd-key`).
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    pub endpoints: Vec<String>,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub connect_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--etcd-cert and --etcd-key go together; only {given} was given")]
    HalfIdentity { given: &'static str },
    #[error("etcd at {endpoints}: {what}: {source}")]
    Etcd {
        endpoints: String,
        what: String,
        source: etcd_client::Error,
    },
    #[error("etcd at {endpoints}: {what}: no answer within {after:?}")]
    Timeout {
        endpoints: String,
        what: String,
        after: Duration,
    },
}

impl StoreError {
    /// The etcd error's gRPC status, if it came with one.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            StoreError::Etcd {
                source: etcd_client::Error::GRpcStatus(s),
                ..
            } => Some(s),
            _ => None,
        }
    }

    /// Whether another attempt may succeed: etcd was unavailable, or the connection to
    /// one member could not be made or broke under the request (a member killed while
    /// answering it). Every request here may be sent again: reads change nothing, and a
    /// transaction is guarded by the revision its plan was read at, so one that did
    /// commit before its answer was lost fails its guard the second time, and the caller
    /// reads and plans again from what it wrote.
    fn retryable(&self) -> bool {
        self.status().is_some_and(|s| {
            s.code() == tonic::Code::Unavailable
                || std::error::Error::source(s)
                    .is_some_and(|e| e.downcast_ref::<tonic::transport::Error>().is_some())
        })
    }
}

/// Runs `request` until it succeeds, fails with an error that is not
/// [`StoreError::retryable`], or has been retried for [`RETRY_UNAVAILABLE_FOR`]; the
/// whole is bounded by `after`. `timeout` makes the error for that bound.
async fn retried<T, F: Future<Output = Result<T, StoreError>>>(
    after: Duration,
    timeout: impl FnOnce() -> StoreError,
    mut request: impl FnMut() -> F,
) -> Result<T, StoreError> {
    let start = tokio::time::Instant::now();
    let attempts = async {
        let mut pause = RETRY_PAUSE;
        loop {
            match request().await {
                Err(e) if e.retryable() && start.elapsed() + pause <= RETRY_UNAVAILABLE_FOR => {
                    tracing::debug!(error = %e, retry_in = ?pause, "etcd unavailable; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(RETRY_PAUSE_MAX);
                }
                other => return other,
            }
        }
    };
    tokio::time::timeout(after, attempts)
        .await
        .unwrap_or_else(|_| Err(timeout()))
}

/// What a transaction's plan was read from: a key, every key under a prefix, or a key
/// that must also still exist (a rewrite of a value read must not bring back a key
/// deleted since).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Guard {
    Key(String),
    Prefix(String),
    Present(String),
}

/// A key and its value, as read.
pub type Kv = (Vec<u8>, Vec<u8>);

/// Keys read per range request: a large registry is read in pages, all at one revision.
const PAGE: i64 = 1000;

/// Unary etcd requests give up after this long; the caller sees UNAVAILABLE.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a request answered UNAVAILABLE is tried again. The client balances its
/// requests over every endpoint and keeps sending some to a member that is down: a
/// connection that cannot be made fails the request sent on it, not the endpoint's
/// readiness, so the balancer never leaves it out. Another attempt goes to another
/// member. A member also answers UNAVAILABLE while the cluster elects a leader, which
/// takes about one election timeout. Past this, the caller sees the error (and, for a
/// watch stream, the client resumes elsewhere).
const RETRY_UNAVAILABLE_FOR: Duration = Duration::from_secs(2);
/// The pause before the first retry; it doubles up to [`RETRY_PAUSE_MAX`].
const RETRY_PAUSE: Duration = Duration::from_millis(5);
const RETRY_PAUSE_MAX: Duration = Duration::from_millis(200);

/// Watch responses are one transaction's events at most; a service of many endpoints
/// makes a large one.
const MAX_WATCH_MESSAGE: usize = 64 << 20;

#[derive(Clone)]
pub struct Store {
    client: Client,
    endpoints: String,
    pub layout: Layout,
}

fn read(path: &Path) -> Result<Vec<u8>, StoreError> {
    std::fs::read(path).map_err(|source| StoreError::ReadFile {
        path: path.to_owned(),
        source,
    })
}

/// The first key after every key that starts with `prefix` (etcd's range end).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl Store {
    /// Connects lazily (the client dials on first use) and checks that etcd answers.
    pub async fn connect(opts: &EtcdOptions, layout: Layout) -> Result<Store, StoreError> {
        let endpoints = opts.endpoints.join(",");
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(opts.connect_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if opts.ca.is_some() || opts.cert.is_some() || opts.key.is_some() {
            let mut tls = etcd_client::TlsOptions::new();
            if let Some(ca) = &opts.ca {
                tls = tls.ca_certificate(etcd_client::Certificate::from_pem(read(ca)?));
            }
            match (&opts.cert, &opts.key) {
                (Some(c), Some(k)) => {
                    tls = tls.identity(etcd_client::Identity::from_pem(read(c)?, read(k)?))
                }
                (Some(_), None) => {
                    return Err(StoreError::HalfIdentity {
                        given: "--etcd-cert",
                    });
                }
                (None, Some(_)) => {
                    return Err(StoreError::HalfIdentity {
                        given: "--etcd-key",
                    });
                }
                (None, None) => {}
            }
            connect = connect.with_tls(tls);
        }
        let client = Client::connect(&opts.endpoints, Some(connect))
            .await
            .map_err(|source| StoreError::Etcd {
                endpoints: endpoints.clone(),
                what: "connect".into(),
                source,
            })?;
        let store = Store {
            client,
            endpoints,
            layout,
        };
        store.revision_within(opts.connect_timeout).await?;
        Ok(store)
    }

    fn err(&self, what: impl Into<String>) -> impl FnOnce(etcd_client::Error) -> StoreError + '_ {
        let what = what.into();
        move |source| StoreError::Etcd {
            endpoints: self.endpoints.clone(),
            what,
            source,
        }
    }

    /// `request`, retried while etcd is unavailable ([`retried`]), within `after`.
    async fn timed<T, F: Future<Output = Result<T, StoreError>>>(
        &self,
        what: &str,
        after: Duration,
        request: impl FnMut() -> F,
    ) -> Result<T, StoreError> {
        retried(
            after,
            || StoreError::Timeout {
                endpoints: self.endpoints.clone(),
                what: what.into(),
                after,
            },
            request,
        )
        .await
    }

    /// The store's current revision.
    pub async fn revision(&self) -> Result<i64, StoreError> {
        self.revision_within(REQUEST_TIMEOUT).await
    }

    /// [`Store::revision`], given up on after `after`.
    pub async fn revision_within(&self, after: Duration) -> Result<i64, StoreError> {
        let what = format!("read the revision under {}", self.layout.prefix());
        let what = &what;
        self.timed(what, after, || async move {
            // One key, counted: etcd's header carries the store's revision whatever the
            // range. A count over the whole prefix made etcd walk its index of every key
            // (etcd 3.4 collects a range's revisions before counting them), and every
            // drain mark, QUIC pair set, resumed stream and `/ready` reads the revision:
            // at 10,000 services, under pod churn, that kept etcd at half a core.
            let opts = GetOptions::new().with_count_only();
            let resp = self
                .client
                .clone()
                .get(self.layout.prefix(), Some(opts))
                .await
                .map_err(self.err(what.clone()))?;
            Ok(resp.header().map_or(0, |h| h.revision()))
        })
        .await
    }

    /// Every key under `prefix` and its value, read in pages at one revision (`at`, or
    /// the current one), which is returned with them.
    pub async fn read_prefix(
        &self,
        prefix: &str,
        at: Option<i64>,
    ) -> Result<(i64, Vec<Kv>), StoreError> {
        let what = format!("read {prefix}");
        let what = &what;
        self.timed(what, REQUEST_TIMEOUT, || async move {
            let end = prefix_end(prefix.as_bytes());
            let mut from = prefix.as_bytes().to_vec();
            let mut revision = at.unwrap_or(0);
            let mut out = Vec::new();
            loop {
                let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
                if revision > 0 {
                    opts = opts.with_revision(revision);
                }
                let mut resp = self
                    .client
                    .clone()
                    .get(from.clone(), Some(opts))
                    .await
                    .map_err(self.err(what.clone()))?;
                if revision == 0 {
                    revision = resp.header().map_or(0, |h| h.revision());
                }
                let more = resp.more();
                let kvs = resp.take_kvs();
                let last = kvs.last().map(|kv| kv.key().to_vec());
                out.extend(kvs.into_iter().map(|kv| kv.into_key_value()));
                match (more, last) {
                    (true, Some(mut last)) => {
                        last.push(0);
                        from = last;
                    }
                    _ => return Ok((revision, out)),
                }
            }
        })
        .await
    }

    /// One key's value, if any, and the revision it was read at (`at`, or the current
    /// one).
    pub async fn read_key(
        &self,
        key: &str,
        at: Option<i64>,
    ) -> Result<(i64, Option<Vec<u8>>), StoreError> {
        let what = format!("read {key}");
        let what = &what;
        self.timed(what, REQUEST_TIMEOUT, || async move {
            let opts = at.map(|r| GetOptions::new().with_revision(r));
            let mut resp = self
                .client
                .clone()
                .get(key, opts)
                .await
                .map_err(self.err(what.clone()))?;
            let revision = at.unwrap_or_else(|| resp.header().map_or(0, |h| h.revision()));
            Ok((
                revision,
                resp.take_kvs()
                    .into_iter()
                    .next()
                    .map(|kv| kv.into_key_value().1),
            ))
        })
        .await
    }

    /// Performs `ops` in one transaction if no key in `guarded` changed after
    /// `read_revision` (a key created since counts; one deleted does not). The new
    /// revision, or None when a guard failed and the caller should read and plan again.
    pub async fn commit(
        &self,
        read_revision: i64,
        guarded: &[Guard],
        ops: &[Op],
    ) -> Result<Option<i64>, StoreError> {
        let names: Vec<&str> = guarded
            .iter()
            .map(|g| match g {
                Guard::Key(k) | Guard::Prefix(k) | Guard::Present(k) => k.as_str(),
            })
            .collect();
        let what = format!("transaction on {}", names.join(", "));
        let what = &what;
        self.timed(what, REQUEST_TIMEOUT, || async move {
            let compares: Vec<Compare> = guarded
                .iter()
                .flat_map(|g| match g {
                    Guard::Key(k) => vec![Compare::mod_revision(
                        k.as_str(),
                        CompareOp::Less,
                        read_revision + 1,
                    )],
                    Guard::Prefix(p) => vec![
                        Compare::mod_revision(p.as_str(), CompareOp::Less, read_revision + 1)
                            .with_prefix(),
                    ],
                    Guard::Present(k) => vec![
                        Compare::mod_revision(k.as_str(), CompareOp::Less, read_revision + 1),
                        Compare::version(k.as_str(), CompareOp::Greater, 0),
                    ],
                })
                .collect();
            let txn_ops: Vec<TxnOp> = ops
                .iter()
                .map(|op| match op {
                    Op::Put { key, value } => TxnOp::put(key.as_str(), value.clone(), None),
                    Op::Delete { key } => TxnOp::delete(key.as_str(), None),
                    Op::DeletePrefix { prefix } => {
                        TxnOp::delete(prefix.as_str(), Some(DeleteOptions::new().with_prefix()))
                    }
                })
                .collect();
            let resp = self
                .client
                .clone()
                .txn(Txn::new().when(compares).and_then(txn_ops))
                .await
                .map_err(self.err(what.clone()))?;
            Ok(resp
                .succeeded()
                .then(|| resp.header().map_or(0, |h| h.revision())))
        })
        .await
    }

    /// Watches every key under the prefix from `start_revision` on.
    pub async fn watch(&self, start_revision: i64) -> Result<WatchStream, StoreError> {
        let what = format!(
            "watch {} from revision {start_revision}",
            self.layout.prefix()
        );
        let what = &what;
        self.timed(what, REQUEST_TIMEOUT, || async move {
            let opts = WatchOptions::new()
                .with_prefix()
                .with_start_revision(start_revision);
            let mut client = self
                .client
                .watch_client()
                .max_decoding_message_size(MAX_WATCH_MESSAGE);
            client
                .watch(self.layout.prefix(), Some(opts))
                .await
                .map_err(self.err(what.clone()))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(status: tonic::Status) -> StoreError {
        StoreError::Etcd {
            endpoints: "http://m0,http://m1".into(),
            what: "read /k".into(),
            source: etcd_client::Error::GRpcStatus(status),
        }
    }

    fn timeout() -> StoreError {
        StoreError::Timeout {
            endpoints: "http://m0,http://m1".into(),
            what: "read /k".into(),
            after: REQUEST_TIMEOUT,
        }
    }

    /// Runs `retried` over answers that fail `failures` times with `status` first; the
    /// result, the attempts made, and the (paused) time it took.
    async fn check(
        failures: usize,
        status: fn() -> tonic::Status,
        after: Duration,
    ) -> (Result<u8, StoreError>, usize, Duration) {
        let start = tokio::time::Instant::now();
        let mut attempts = 0;
        let result = retried(after, timeout, || {
            attempts += 1;
            let answer = if attempts <= failures {
                Err(etcd(status()))
            } else {
                Ok(7)
            };
            async move { answer }
        })
        .await;
        (result, attempts, start.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn an_unavailable_member_is_tried_again_and_other_errors_are_not() {
        // A request sent to a member that is down, twice: the third attempt goes through.
        let unavailable = || tonic::Status::unavailable("tcp connect error");
        let (result, attempts, took) = check(2, unavailable, REQUEST_TIMEOUT).await;
        assert_eq!((result.ok(), attempts), (Some(7), 3));
        assert_eq!(took, RETRY_PAUSE * 3, "5 ms, then 10 ms");

        // A connection that broke under the request (its member was killed): tonic says
        // Unknown, "transport error", with the transport error as the source.
        let transport = tonic::transport::Endpoint::from_static("http://127.0.0.1:1")
            .connect()
            .await
            .expect_err("nothing listens on port 1");
        let mut broken = tonic::Status::unknown("transport error");
        broken.set_source(std::sync::Arc::new(transport));
        assert!(etcd(broken).retryable());
        assert!(!etcd(tonic::Status::unknown("no transport error under it")).retryable());

        // etcd's own refusals are answers, not outages.
        let (result, attempts, _) = check(
            1,
            || tonic::Status::failed_precondition("too many operations in txn request"),
            REQUEST_TIMEOUT,
        )
        .await;
        assert_eq!(attempts, 1);
        assert!(
            matches!(result, Err(ref e) if e.status().is_some_and(|s| s.code() == tonic::Code::FailedPrecondition)),
            "{result:?}"
        );

        // An outage that lasts: the error, once the retries have had their time.
        let (result, attempts, took) = check(usize::MAX, unavailable, REQUEST_TIMEOUT).await;
        assert!(
            result.as_ref().is_err_and(StoreError::retryable),
            "{result:?}"
        );
        assert!(
            took <= RETRY_UNAVAILABLE_FOR && took >= RETRY_UNAVAILABLE_FOR - RETRY_PAUSE_MAX,
            "{took:?}"
        );
        assert!(attempts > 10, "{attempts} attempts");

        // The request's own bound comes first when it is shorter.
        let (result, _, took) = check(usize::MAX, unavailable, Duration::from_millis(100)).await;
        assert!(
            matches!(result, Err(StoreError::Timeout { .. })),
            "{result:?}"
        );
        assert_eq!(took, Duration::from_millis(100));
    }

    #[test]
    fn a_prefix_ends_at_its_successor() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
