//! Writing one service, by either source: read what etcd holds, plan the difference
//! ([`plan`]), and commit it in one transaction guarded by the revision it was read at;
//! read and plan again when another writer got there first. The registry API's
//! ApplyServices and DeleteService calls (source: a file) and discovery (source:
//! Kubernetes) both write through here, so the precedence between them is one rule.

use std::collections::BTreeMap;

use aether_model::{Service, ServiceKey};

use crate::plan::{self, Owned};
use crate::store::{Guard, Store, StoreError};
use crate::values::{self, PairsValue, Source};

/// Plans read again after a guard failed, before giving up.
const ATTEMPTS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{key} is discovered from Kubernetes (source {by}); change it there, not with a file")]
    Owned { key: ServiceKey, by: Source },
    #[error(
        "{key}: {ops} writes in one transaction are more than etcd's --max-txn-ops allows (128 by default); raise it: {source}"
    )]
    TooManyOps {
        key: ServiceKey,
        ops: usize,
        source: StoreError,
    },
    #[error("{key} kept changing while being written; retry")]
    Contended { key: ServiceKey },
}

impl WriteError {
    fn owned(key: &ServiceKey, o: Owned) -> WriteError {
        WriteError::Owned {
            key: key.clone(),
            by: o.by,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The revision after it, or the one it was read at when nothing needed writing.
    pub revision: i64,
    /// Keys put or deleted (0: etcd already held it).
    pub writes: usize,
    /// The service was there before, with another source (discovery took it over).
    pub took_over: bool,
    /// The service was there before.
    pub existed: bool,
    /// Read-plan-commit rounds taken (a commit refused by a concurrent write goes again).
    pub attempts: usize,
    /// Time in the last round's commit: etcd's transaction, its fsync included.
    pub commit: std::time::Duration,
}

/// Makes etcd hold `s` exactly, as `writer` wrote it, in one transaction. Its endpoints
/// carry the QUIC twins their nodes' pairs name, read at the same revision; the
/// transaction is guarded by those pairs too, so a set written meanwhile is read again and
/// no endpoint is written with a replaced set's twin.
pub async fn apply(store: &Store, s: &Service, writer: Source) -> Result<Written, WriteError> {
    let layout = &store.layout;
    let key = s.key();
    let (service_key, endpoints) = (layout.service(&key), layout.endpoints_of(&key));
    for attempt in 1..=ATTEMPTS {
        let (read, kvs) = store.read_prefix(&endpoints, None).await?;
        let (_, current) = store.read_key(&service_key, Some(read)).await?;
        let current_endpoints: BTreeMap<String, Vec<u8>> = kvs
            .into_iter()
            .map(|(k, v)| (String::from_utf8_lossy(&k).into_owned(), v))
            .collect();
        let nodes: std::collections::BTreeSet<&str> = s
            .endpoints
            .iter()
            .map(|e| e.node.as_str())
            .filter(|n| crate::keys::is_dns_subdomain(n))
            .collect();
        let mut pairs = BTreeMap::new();
        let mut guards = vec![
            Guard::Key(service_key.clone()),
            Guard::Prefix(endpoints.clone()),
        ];
        for node in nodes {
            let pairs_key = layout.quic_pairs(node);
            if let (_, Some(v)) = store.read_key(&pairs_key, Some(read)).await? {
                match values::decode::<PairsValue>(&pairs_key, "QUIC pair set", &v) {
                    Ok(p) => {
                        pairs.insert(node.to_owned(), p);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "corrupt registry entry in etcd skipped")
                    }
                }
            }
            guards.push(Guard::Key(pairs_key));
        }
        let before = plan::stored_source(current.as_deref());
        let ops = plan::apply_service(
            layout,
            s,
            writer,
            current.as_deref(),
            &current_endpoints,
            &pairs,
        )
        .map_err(|o| WriteError::owned(&key, o))?;
        let written = |revision, commit| Written {
            revision,
            writes: ops.len(),
            took_over: before.is_some_and(|b| b != writer),
            existed: before.is_some(),
            attempts: attempt,
            commit,
        };
        if ops.is_empty() {
            return Ok(written(read, std::time::Duration::ZERO));
        }
        let committing = std::time::Instant::now();
        match store.commit(read, &guards, &ops).await {
            Ok(Some(revision)) => return Ok(written(revision, committing.elapsed())),
            Ok(None) => continue,
            Err(e)
                if e.status()
                    .is_some_and(|st| st.message().contains("too many operations")) =>
            {
                return Err(WriteError::TooManyOps {
                    key,
                    ops: ops.len(),
                    source: e,
                });
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(WriteError::Contended { key })
}

/// Removes a service with its endpoints and drain marks, as `writer`: a file may not
/// remove a discovered service, and discovery leaves a file's service alone.
pub async fn delete(
    store: &Store,
    key: &ServiceKey,
    writer: Source,
) -> Result<Written, WriteError> {
    let service_key = store.layout.service(key);
    for attempt in 1..=ATTEMPTS {
        let (read, current) = store.read_key(&service_key, None).await?;
        let ops = plan::delete_service(&store.layout, key, writer, current.as_deref())
            .map_err(|o| WriteError::owned(key, o))?;
        let written = |revision, commit| Written {
            revision,
            writes: ops.len(),
            took_over: false,
            existed: current.is_some(),
            attempts: attempt,
            commit,
        };
        if ops.is_empty() {
            return Ok(written(read, std::time::Duration::ZERO));
        }
        let committing = std::time::Instant::now();
        if let Some(revision) = store
            .commit(read, &[Guard::Key(service_key.clone())], &ops)
            .await?
        {
            return Ok(written(revision, committing.elapsed()));
        }
    }
    Err(WriteError::Contended { key: key.clone() })
}

/// Every service in etcd and its source, at one revision.
pub async fn sources(store: &Store) -> Result<BTreeMap<ServiceKey, Source>, StoreError> {
    let prefix = format!("{}services/", store.layout.prefix());
    let (_, kvs) = store.read_prefix(&prefix, None).await?;
    let mut out = BTreeMap::new();
    for (k, v) in kvs {
        match store.layout.parse(&k) {
            Ok(crate::keys::Key::Service(key)) => {
                out.insert(key, plan::stored_source(Some(&v)).unwrap_or_default());
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "corrupt registry entry in etcd skipped"),
        }
    }
    Ok(out)
}
