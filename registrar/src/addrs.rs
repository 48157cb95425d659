//! Which services have an endpoint at an address: an index this process keeps from an
//! etcd watch of the endpoint keys, so that a drain mark that names no service reads the
//! endpoints of the services at its address, not every endpoint of every service.
//!
//! The index knows the revision it is complete at (`synced`): the read it was built
//! from, then each watch response's newest event, and each progress notification (which
//! etcd sends only once the watch has caught up). A mark asks etcd for its current
//! revision and waits, up to [`SYNC_WAIT`], for the index to reach it (asking the watch
//! for its progress), so that it never misses an endpoint written before it was asked;
//! an index that does not catch up in time, or not started yet, is not used: the mark
//! reads every endpoint, as without the index, and says so in a warn line.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aether_model::ServiceKey;
use etcd_client::EventType;
use tokio::sync::{Notify, watch};

use crate::keys::{Key, Layout};
use crate::store::Store;

/// How long a drain mark waits for the index to reach etcd's revision.
pub const SYNC_WAIT: Duration = Duration::from_secs(2);

/// Endpoints by address: each service with the ports of its endpoints there.
#[derive(Debug, Default)]
pub struct AddrIndex {
    by_addr: HashMap<IpAddr, BTreeMap<ServiceKey, BTreeSet<u16>>>,
}

impl AddrIndex {
    /// Applies an etcd key that was put (`put`) or deleted; keys other than endpoints'
    /// are ignored.
    pub fn apply(&mut self, layout: &Layout, key: &[u8], put: bool) {
        let Ok(Key::Endpoint {
            service,
            address,
            port,
        }) = layout.parse(key)
        else {
            return;
        };
        if put {
            self.by_addr
                .entry(address)
                .or_default()
                .entry(service)
                .or_default()
                .insert(port);
        } else if let Some(services) = self.by_addr.get_mut(&address) {
            if let Some(ports) = services.get_mut(&service) {
                ports.remove(&port);
                if ports.is_empty() {
                    services.remove(&service);
                }
            }
            if services.is_empty() {
                self.by_addr.remove(&address);
            }
        }
    }

    /// The services with an endpoint at `address`.
    pub fn services_at(&self, address: IpAddr) -> Vec<ServiceKey> {
        self.by_addr
            .get(&address)
            .map(|s| s.keys().cloned().collect())
            .unwrap_or_default()
    }
}

/// The index shared by the watch task and the drain marks.
pub struct Addrs {
    index: Mutex<AddrIndex>,
    synced: watch::Sender<i64>,
    progress: Notify,
}

impl Addrs {
    /// Starts the watch task; the index is usable once it has read the endpoints.
    pub fn spawn(store: Store) -> Arc<Addrs> {
        let addrs = Arc::new(Addrs {
            index: Mutex::default(),
            synced: watch::channel(0).0,
            progress: Notify::new(),
        });
        tokio::spawn(addrs.clone().run(store));
        addrs
    }

    /// The services at `address` as of a revision at least `revision`, or None if the
    /// index does not reach it within [`SYNC_WAIT`].
    pub async fn services_at(&self, address: IpAddr, revision: i64) -> Option<Vec<ServiceKey>> {
        let mut synced = self.synced.subscribe();
        if *synced.borrow() < revision {
            self.progress.notify_one();
        }
        tokio::time::timeout(SYNC_WAIT, synced.wait_for(|s| *s >= revision))
            .await
            .ok()?
            .ok()?;
        Some(
            self.index
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .services_at(address),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AddrIndex> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn run(self: Arc<Self>, store: Store) {
        let layout = store.layout.clone();
        let mut pause = Duration::from_millis(100);
        loop {
            match self.follow(&store, &layout).await {
                Ok(()) => pause = Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?pause, "the address index's etcd watch failed; drain marks read every endpoint until it is back");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// Reads every endpoint, then follows the watch until it breaks or is compacted.
    async fn follow(&self, store: &Store, layout: &Layout) -> Result<(), String> {
        let (revision, kvs) = store
            .read_prefix(&layout.all_endpoints(), None)
            .await
            .map_err(|e| e.to_string())?;
        {
            let mut index = AddrIndex::default();
            for (k, _) in &kvs {
                index.apply(layout, k, true);
            }
            *self.lock() = index;
        }
        self.synced.send_replace(revision);
        let mut stream = store.watch(revision + 1).await.map_err(|e| e.to_string())?;
        loop {
            let resp = tokio::select! {
                m = stream.message() => m.map_err(|e| e.to_string())?,
                _ = self.progress.notified() => {
                    stream.request_progress().await.map_err(|e| e.to_string())?;
                    continue;
                }
            };
            let Some(resp) = resp else {
                return Err("etcd ended the watch".into());
            };
            if resp.canceled() || resp.compact_revision() > 0 {
                return Ok(());
            }
            let events = resp.events();
            let newest = if events.is_empty() {
                // A progress notification says the watch has caught up to the header's
                // revision; the response that created the watch says nothing.
                if resp.created() {
                    continue;
                }
                resp.header().map_or(0, |h| h.revision())
            } else {
                let mut index = self.lock();
                let mut newest = 0;
                for e in events {
                    if let Some(kv) = e.kv() {
                        index.apply(layout, kv.key(), e.event_type() == EventType::Put);
                        newest = newest.max(kv.mod_revision());
                    }
                }
                newest
            };
            self.synced.send_if_modified(|s| {
                let moved = newest > *s;
                *s = (*s).max(newest);
                moved
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_follows_puts_and_deletes_of_endpoint_keys_only() {
        let layout = Layout::new("/aether/registry/");
        let key = |name: &str| ServiceKey {
            namespace: "prod".into(),
            name: name.into(),
        };
        let (web, db) = (key("web"), key("db"));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let mut index = AddrIndex::default();
        index.apply(&layout, layout.endpoint(&web, a, 80).as_bytes(), true);
        index.apply(&layout, layout.endpoint(&web, a, 8080).as_bytes(), true);
        index.apply(&layout, layout.endpoint(&db, a, 5432).as_bytes(), true);
        index.apply(&layout, layout.mark(&web, a).as_bytes(), true);
        index.apply(&layout, layout.service(&web).as_bytes(), true);
        assert_eq!(index.services_at(a), [db.clone(), web.clone()]);
        // One of web's two ports goes: web is still there.
        index.apply(&layout, layout.endpoint(&web, a, 80).as_bytes(), false);
        assert_eq!(index.services_at(a), [db.clone(), web.clone()]);
        index.apply(&layout, layout.endpoint(&web, a, 8080).as_bytes(), false);
        index.apply(&layout, layout.endpoint(&db, a, 5432).as_bytes(), false);
        assert!(index.services_at(a).is_empty());
        assert!(
            index.by_addr.is_empty(),
            "nothing is kept for an empty address"
        );
    }
}
