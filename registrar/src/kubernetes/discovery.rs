//! Discovery: Services and EndpointSlices, watched, written into etcd as registry services
//! with the source `kubernetes`.
//!
//! Every replica watches (so that a new leader starts with a warm cache); only the Lease
//! holder writes. The cache ([`Cache`]) turns watch events into the set of services they
//! touch; the writer makes etcd hold each touched service as the cache says, or removes it
//! when the cache no longer has it. A key stays dirty until its write succeeds, so an etcd
//! outage or a lost leadership delays writes and loses none.
//!
//! Converging after a gap: a relist (the first start, a 410 Gone, a reconnect) replaces a
//! kind's cache whole and dirties every service it had or has; becoming leader dirties
//! every cached service and every discovered service in etcd. A Service deleted while no
//! replica ran is thereby found in etcd and removed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use aether_model::ServiceKey;
use aether_model::check::Loopback;
use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;

use super::convert::{self, Converted, Skipped};
use super::lease::{self, Leadership};
use crate::store::Store;
use crate::values::Source;
use crate::writes::{self, WriteError};

/// Which namespaces discovery covers.
#[derive(Debug, Clone, Default)]
pub struct Namespaces {
    /// Only these, if any.
    pub include: BTreeSet<String>,
    /// Never these.
    pub exclude: BTreeSet<String>,
}

impl Namespaces {
    pub fn covers(&self, ns: &str) -> bool {
        (self.include.is_empty() || self.include.contains(ns)) && !self.exclude.contains(ns)
    }
}

/// What discovery covers and accepts.
#[derive(Debug, Clone)]
pub struct Config {
    pub namespaces: Namespaces,
    /// Whether loopback endpoint addresses are written (`--allow-loopback-endpoints`).
    pub loopback: Loopback,
    /// Counts the slice endpoints left out for their address, at each write of their
    /// service (`aether_registrar_discovery_endpoints_refused`).
    pub refused: prometheus_client::metrics::counter::Counter,
}

/// One kind's objects by their id, and the buffer of a relist in progress.
pub(super) struct Objects<Id, K> {
    pub current: BTreeMap<Id, K>,
    relisting: Option<BTreeMap<Id, K>>,
    /// A relist has completed at least once.
    pub synced: bool,
}

impl<Id, K> Default for Objects<Id, K> {
    fn default() -> Self {
        Self {
            current: BTreeMap::new(),
            relisting: None,
            synced: false,
        }
    }
}

impl<Id: Ord + Clone, K: Clone + PartialEq> Objects<Id, K> {
    /// Applies a watcher event, calling `changed(id, (old, new))` for every object added,
    /// modified or removed; objects `id_of` gives no id are ignored. A relist reports, at
    /// its end, every object that differs between the old set and the new one.
    pub fn apply(
        &mut self,
        event: Event<K>,
        id_of: impl Fn(&K) -> Option<Id>,
        mut changed: impl FnMut(&Id, (Option<&K>, Option<&K>)),
    ) {
        match event {
            Event::Apply(o) => {
                if let Some(k) = id_of(&o) {
                    let old = self.current.insert(k.clone(), o);
                    changed(&k, (old.as_ref(), self.current.get(&k)));
                }
            }
            Event::Delete(o) => {
                if let Some(k) = id_of(&o)
                    && let Some(old) = self.current.remove(&k)
                {
                    changed(&k, (Some(&old), None));
                }
            }
            Event::Init => self.relisting = Some(BTreeMap::new()),
            Event::InitApply(o) => {
                if let (Some(k), Some(buffer)) = (id_of(&o), self.relisting.as_mut()) {
                    buffer.insert(k, o);
                }
            }
            Event::InitDone => {
                let new = self.relisting.take().unwrap_or_default();
                let old = std::mem::replace(&mut self.current, new);
                for (k, o) in &old {
                    let now = self.current.get(k);
                    if now != Some(o) {
                        changed(k, (Some(o), now));
                    }
                }
                for (k, o) in &self.current {
                    if !old.contains_key(k) {
                        changed(k, (None, Some(o)));
                    }
                }
                self.synced = true;
            }
        }
    }
}

/// What the watches have delivered: Services and EndpointSlices of covered namespaces.
pub struct Cache {
    services: Objects<ServiceKey, KubeService>,
    /// Slices by their own namespace/name.
    slices: Objects<ServiceKey, EndpointSlice>,
    /// The slices of each service, by the slice's namespace/name.
    by_service: BTreeMap<ServiceKey, BTreeSet<ServiceKey>>,
    namespaces: Namespaces,
    loopback: Loopback,
}

/// What an event asks of the writer.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Touched {
    pub services: BTreeSet<ServiceKey>,
}

fn object_key(meta: &kube::api::ObjectMeta) -> Option<ServiceKey> {
    convert::key(meta.namespace.as_deref(), meta.name.as_deref())
}

impl Cache {
    pub fn new(namespaces: Namespaces, loopback: Loopback) -> Self {
        Self {
            services: Objects::default(),
            slices: Objects::default(),
            by_service: BTreeMap::new(),
            namespaces,
            loopback,
        }
    }

    /// Both kinds have been listed at least once: the cache is the API's state.
    pub fn synced(&self) -> bool {
        self.services.synced && self.slices.synced
    }

    /// Every service the cache holds.
    pub fn keys(&self) -> impl Iterator<Item = &ServiceKey> {
        self.services.current.keys()
    }

    /// The registry service for `key` as the cache says, with the slice endpoints left out
    /// for their address, or why it is absent (None: no such Service).
    pub fn desired(&self, key: &ServiceKey) -> Option<Result<Converted, Skipped>> {
        let svc = self.services.current.get(key)?;
        let slices = self
            .by_service
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|k| self.slices.current.get(k));
        Some(convert::service(svc, slices, self.loopback))
    }

    pub fn on_service(&mut self, event: Event<KubeService>) -> Touched {
        let ns = self.namespaces.clone();
        let mut touched = Touched::default();
        self.services.apply(
            event,
            |s| object_key(&s.metadata).filter(|k| ns.covers(&k.namespace)),
            |k, _| {
                touched.services.insert(k.clone());
            },
        );
        touched
    }

    pub fn on_slice(&mut self, event: Event<EndpointSlice>) -> Touched {
        let ns = self.namespaces.clone();
        let mut changed: Vec<(ServiceKey, Option<ServiceKey>, Option<ServiceKey>)> = Vec::new();
        self.slices.apply(
            event,
            |s| object_key(&s.metadata).filter(|k| ns.covers(&k.namespace)),
            |k, (old, new)| {
                changed.push((
                    k.clone(),
                    old.and_then(convert::slice_service),
                    new.and_then(convert::slice_service),
                ));
            },
        );
        let mut touched = Touched::default();
        for (slice, old, new) in changed {
            if let Some(old) = old {
                if let Some(set) = self.by_service.get_mut(&old) {
                    set.remove(&slice);
                    if set.is_empty() {
                        self.by_service.remove(&old);
                    }
                }
                touched.services.insert(old);
            }
            if let Some(new) = new {
                self.by_service
                    .entry(new.clone())
                    .or_default()
                    .insert(slice);
                touched.services.insert(new);
            }
        }
        touched
    }
}

/// The writer's state: services to write, and whether etcd must be scanned for discovered
/// services the cache does not have.
#[derive(Debug, Default)]
struct Dirty {
    keys: BTreeSet<ServiceKey>,
    scan_etcd: bool,
}

/// How long the writer waits before trying again after etcd failed.
const RETRY: Duration = Duration::from_secs(1);

/// Watches Services and EndpointSlices and, while leading, writes them into etcd. Runs
/// until `stop` is set.
pub async fn run(
    client: kube::Client,
    store: Store,
    config: Config,
    mut leader: Leadership,
    mut stop: watch::Receiver<bool>,
) {
    let Config {
        namespaces,
        loopback,
        refused,
    } = config;
    // One namespace: watch it alone (a namespaced Role then suffices); else every one.
    let (services, slices) = match namespaces.include.iter().collect::<Vec<_>>().as_slice() {
        [ns] => (
            kube::Api::<KubeService>::namespaced(client.clone(), ns),
            kube::Api::<EndpointSlice>::namespaced(client, ns),
        ),
        _ => (kube::Api::all(client.clone()), kube::Api::all(client)),
    };
    let mut services = watched(
        "services",
        watcher::watcher(services, watcher::Config::default()),
    );
    let mut slices = watched(
        "endpointslices",
        watcher::watcher(slices, watcher::Config::default()),
    );
    let mut cache = Cache::new(namespaces, loopback);
    let mut dirty = Dirty::default();
    let mut was_leading = false;
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        // Take every event ready now before writing, so that a burst is written once.
        let mut took = 0;
        loop {
            let touched = if let Some(Some(e)) = services.next().now_or_never() {
                cache.on_service(e)
            } else if let Some(Some(e)) = slices.next().now_or_never() {
                cache.on_slice(e)
            } else {
                break;
            };
            dirty.keys.extend(touched.services);
            took += 1;
            if took >= 10_000 {
                break;
            }
        }
        let leading = lease::leads(&leader);
        if leading && !was_leading {
            dirty.keys.extend(cache.keys().cloned());
            dirty.scan_etcd = true;
        }
        was_leading = leading;
        if leading && cache.synced() && retry_at.is_none_or(|at| tokio::time::Instant::now() >= at)
        {
            retry_at = write(&store, &cache, &mut dirty, &leader, &refused)
                .await
                .err()
                .map(|()| tokio::time::Instant::now() + RETRY);
        }
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(e) = services.next() => dirty.keys.extend(cache.on_service(e).services),
            Some(e) = slices.next() => dirty.keys.extend(cache.on_slice(e).services),
            Ok(()) = leader.changed() => {}
            _ = retry => retry_at = None,
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// A watcher whose errors are logged and retried with kube-runtime's backoff.
pub(super) fn watched<K: Send + 'static>(
    what: &'static str,
    s: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
) -> impl Stream<Item = Event<K>> + Send + Unpin {
    Box::pin(s.default_backoff().filter_map(move |r| async move {
        match r {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!(resource = what, error = %e, "watching {what} failed; retrying with backoff");
                None
            }
        }
    }))
}

/// Writes the dirty services while leading. Err(()) when etcd failed: the keys not
/// written stay dirty.
async fn write(
    store: &Store,
    cache: &Cache,
    dirty: &mut Dirty,
    leader: &Leadership,
    refused: &prometheus_client::metrics::counter::Counter,
) -> Result<(), ()> {
    if dirty.scan_etcd {
        match writes::sources(store).await {
            Ok(sources) => {
                let stale = sources
                    .into_iter()
                    .filter(|(k, s)| *s == Source::Kubernetes && cache.desired(k).is_none())
                    .map(|(k, _)| k);
                dirty.keys.extend(stale);
                dirty.scan_etcd = false;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the registry's services from etcd failed; trying again");
                return Err(());
            }
        }
    }
    while let Some(key) = dirty.keys.first().cloned() {
        if !lease::leads(leader) {
            return Ok(());
        }
        let result = match cache.desired(&key) {
            Some(Ok(Converted {
                service,
                refused: bad,
            })) => {
                for e in &bad {
                    tracing::warn!(service = %key, field = %e.field, error = %e.message, "EndpointSlice endpoint left out: {e}");
                }
                refused.inc_by(bad.len() as u64);
                writes::apply(store, &service, Source::Kubernetes)
                    .await
                    .map(|w| (w, Some(service.endpoints.len())))
            }
            Some(Err(skipped)) => {
                tracing::debug!(service = %key, reason = %skipped, "Service not in the mesh");
                writes::delete(store, &key, Source::Kubernetes)
                    .await
                    .map(|w| (w, None))
            }
            None => writes::delete(store, &key, Source::Kubernetes)
                .await
                .map(|w| (w, None)),
        };
        match result {
            Ok((w, endpoints)) => {
                dirty.keys.remove(&key);
                if w.took_over {
                    tracing::warn!(service = %key, "a file had applied this service; Kubernetes has one of the same name, which now owns it");
                }
                match (w.writes, endpoints) {
                    (0, _) => {}
                    (_, Some(endpoints)) => {
                        tracing::info!(service = %key, writes = w.writes, endpoints, revision = w.revision, "discovered service written")
                    }
                    (_, None) => {
                        tracing::info!(service = %key, revision = w.revision, "discovered service removed")
                    }
                }
            }
            Err(WriteError::Store(e)) => {
                tracing::warn!(service = %key, error = %e, "writing a discovered service failed; trying again");
                return Err(());
            }
            Err(e) => {
                // Not retried: the same write would fail the same way.
                tracing::error!(service = %key, error = %e, "a discovered service cannot be written");
                dirty.keys.remove(&key);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(ns: &str, name: &str) -> ServiceKey {
        ServiceKey {
            namespace: ns.into(),
            name: name.into(),
        }
    }

    fn svc(ns: &str, name: &str) -> KubeService {
        serde_json::from_value(
            json!({"metadata": {"namespace": ns, "name": name}, "spec": {"ports": [{"port": 80}]}}),
        )
        .unwrap()
    }

    fn slice(ns: &str, name: &str, service: &str, ip: &str) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name, "labels": {convert::SERVICE_NAME_LABEL: service}},
            "addressType": "IPv4", "ports": [{"port": 8080}], "endpoints": [{"addresses": [ip]}],
        }))
        .unwrap()
    }

    fn touched(keys: &[ServiceKey]) -> Touched {
        Touched {
            services: keys.iter().cloned().collect(),
        }
    }

    fn addresses(cache: &Cache, k: &ServiceKey) -> Vec<String> {
        cache
            .desired(k)
            .unwrap()
            .unwrap()
            .service
            .endpoints
            .iter()
            .map(|e| e.address.to_string())
            .collect()
    }

    #[test]
    fn events_touch_the_services_they_change_and_slices_find_their_service() {
        let mut c = Cache::new(Namespaces::default(), Loopback::Refuse);
        let web = key("prod", "web");
        assert!(!c.synced());
        for e in [
            Event::Init,
            Event::InitApply(svc("prod", "web")),
            Event::InitDone,
        ] {
            let t = c.on_service(e);
            if t != Touched::default() {
                assert_eq!(t, touched(std::slice::from_ref(&web)));
            }
        }
        assert_eq!(c.on_slice(Event::Init), Touched::default());
        assert_eq!(c.on_slice(Event::InitDone), Touched::default());
        assert!(c.synced());
        assert_eq!(
            c.on_slice(Event::Apply(slice("prod", "web-a", "web", "10.0.0.1"))),
            touched(std::slice::from_ref(&web))
        );
        assert_eq!(
            c.on_slice(Event::Apply(slice("prod", "web-b", "web", "10.0.0.2"))),
            touched(std::slice::from_ref(&web))
        );
        assert_eq!(addresses(&c, &web), ["10.0.0.1", "10.0.0.2"]);
        // A slice relabelled to another service touches both.
        let api = key("prod", "api");
        assert_eq!(
            c.on_slice(Event::Apply(slice("prod", "web-b", "api", "10.0.0.2"))),
            touched(&[api.clone(), web.clone()])
        );
        assert_eq!(addresses(&c, &web), ["10.0.0.1"]);
        assert!(c.desired(&api).is_none(), "no Service api: absent");
        assert_eq!(
            c.on_slice(Event::Delete(slice("prod", "web-a", "web", "10.0.0.1"))),
            touched(std::slice::from_ref(&web))
        );
        assert!(addresses(&c, &web).is_empty());
        assert_eq!(
            c.on_service(Event::Delete(svc("prod", "web"))),
            touched(std::slice::from_ref(&web))
        );
        assert!(c.desired(&web).is_none());
    }

    #[test]
    fn a_relist_touches_what_changed_while_the_watch_was_away() {
        let mut c = Cache::new(Namespaces::default(), Loopback::Refuse);
        let (a, b, d) = (key("n", "a"), key("n", "b"), key("n", "d"));
        for e in [
            Event::Init,
            Event::InitApply(svc("n", "a")),
            Event::InitApply(svc("n", "b")),
            Event::InitDone,
        ] {
            c.on_service(e);
        }
        // After a 410: a is unchanged, b was deleted and d created meanwhile.
        assert_eq!(c.on_service(Event::Init), Touched::default());
        assert_eq!(
            c.on_service(Event::InitApply(svc("n", "a"))),
            Touched::default()
        );
        assert_eq!(
            c.on_service(Event::InitApply(svc("n", "d"))),
            Touched::default()
        );
        assert!(
            c.desired(&b).is_some(),
            "the old view stands until the relist is done"
        );
        assert_eq!(
            c.on_service(Event::InitDone),
            touched(&[b.clone(), d.clone()])
        );
        assert!(c.desired(&b).is_none() && c.desired(&d).is_some() && c.desired(&a).is_some());
    }

    #[test]
    fn namespaces_are_included_or_excluded() {
        let ns = Namespaces {
            include: ["prod".into(), "kube-system".into()].into(),
            exclude: ["kube-system".into()].into(),
        };
        assert!(ns.covers("prod") && !ns.covers("kube-system") && !ns.covers("dev"));
        assert!(Namespaces::default().covers("anything"));
        let mut c = Cache::new(ns, Loopback::Refuse);
        assert_eq!(
            c.on_service(Event::Apply(svc("dev", "web"))),
            Touched::default()
        );
        assert_eq!(
            c.on_slice(Event::Apply(slice(
                "kube-system",
                "dns-a",
                "dns",
                "10.0.0.9"
            ))),
            Touched::default()
        );
        assert_eq!(
            c.on_service(Event::Apply(svc("prod", "web"))),
            touched(&[key("prod", "web")])
        );
    }
}
