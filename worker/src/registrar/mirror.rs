//! The registrar's view as this agent holds it, and the model changes each message of
//! the watch stream turns into. Pure: no I/O, no clock.
//!
//! The registrar sends a full view, then changes one key at a time (a service's ports
//! and VIP, one endpoint, one drain mark). The mirror keeps them apart, as the registrar
//! stores them, and hands the node whole [`Service`]s for the keys a batch touched: the
//! model's builder then rebuilds those services alone. An endpoint's state as the node
//! sees it is DRAINING when either its applied state or a drain mark says so.
//!
//! What arrives is checked again as the registrar checks it (`aether_model::check`:
//! service keys, ports, VIPs and endpoint addresses; loopback is accepted, as an agent's
//! own registry file may hold it): an entry that fails is skipped and named, never built
//! into the proxy's configuration, so a registrar with bad data in its etcd, or one that
//! predates the checks, cannot point the proxy at link-local or multicast addresses.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use aether_model::check::{self, Loopback};
use aether_model::{Change, Endpoint, EndpointState, Service, ServiceKey};
use shared_proto::registry as pb;

/// A service's own fields, without its endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    ports: Vec<u16>,
    vip: Option<IpAddr>,
}

#[derive(Debug, Default, Clone)]
struct Entry {
    /// None until the service's own key is seen: endpoints may come first.
    meta: Option<Meta>,
    endpoints: BTreeMap<(IpAddr, u16), Endpoint>,
}

/// Something in a message that the mirror skipped; logged by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped(pub String);

#[derive(Debug, Default)]
pub struct Mirror {
    /// The registrar revision the view is at; 0 before the first full view.
    revision: i64,
    services: BTreeMap<ServiceKey, Entry>,
    /// The entries whose own key was seen (`meta` set): [`Mirror::services`], kept as
    /// they change, since a count over the view on every batch walked the mesh.
    with_meta: usize,
    marks: HashMap<(ServiceKey, IpAddr), EndpointState>,
}

impl Mirror {
    pub fn revision(&self) -> i64 {
        self.revision
    }

    pub fn loaded(&self) -> bool {
        self.revision > 0
    }

    /// How many services the view holds (with their own key seen).
    pub fn services(&self) -> usize {
        self.with_meta
    }

    /// Replaces the view with `full`. The changes remove the services that are gone and
    /// upsert every other one (the builder drops an upsert equal to what it holds).
    pub fn apply_full(&mut self, full: pb::FullView) -> (Vec<Change>, Vec<Skipped>) {
        let mut skipped = Vec::new();
        let mut next = Mirror {
            revision: full.revision,
            ..Mirror::default()
        };
        for s in full.services {
            let key = match service_key(s.key.as_ref()) {
                Ok(key) => key,
                Err(e) => {
                    skipped.push(Skipped(format!("a service: {e}")));
                    continue;
                }
            };
            let entry = next.services.entry(key.clone()).or_default();
            match meta(&s) {
                Ok(m) => {
                    next.with_meta += usize::from(entry.meta.is_none());
                    entry.meta = Some(m);
                }
                Err(e) => skipped.push(Skipped(format!("service {key}: {e}"))),
            }
            for e in &s.endpoints {
                match endpoint(e) {
                    Ok(ep) => {
                        entry.endpoints.insert((ep.address, ep.port), ep);
                    }
                    Err(msg) => skipped.push(Skipped(format!("service {key}: {msg}"))),
                }
            }
        }
        for m in full.marks {
            next.set_mark(&m, &mut skipped);
        }
        let mut changes: Vec<Change> = self
            .services
            .iter()
            .filter(|(k, e)| {
                e.meta.is_some() && next.services.get(*k).is_none_or(|n| n.meta.is_none())
            })
            .map(|(k, _)| Change::RemoveService(k.clone()))
            .collect();
        changes.extend(
            next.services
                .keys()
                .filter_map(|k| next.effective(k))
                .map(Change::UpsertService),
        );
        *self = next;
        (changes, skipped)
    }

    /// Applies one batch of changes and moves the revision on. The changes hold one
    /// upsert or removal per service the batch touched.
    pub fn apply_batch(&mut self, batch: pb::ChangeBatch) -> (Vec<Change>, Vec<Skipped>) {
        let mut skipped = Vec::new();
        let mut touched = BTreeSet::new();
        for c in batch.changes {
            use pb::change::Kind;
            match c.kind {
                Some(Kind::ServiceUpserted(s)) => {
                    let key = match service_key(s.key.as_ref()) {
                        Ok(key) => key,
                        Err(e) => {
                            skipped.push(Skipped(format!("a service upsert: {e}")));
                            continue;
                        }
                    };
                    match meta(&s) {
                        Ok(m) => {
                            let entry = self.services.entry(key.clone()).or_default();
                            self.with_meta += usize::from(entry.meta.is_none());
                            entry.meta = Some(m);
                            touched.insert(key);
                        }
                        Err(e) => skipped.push(Skipped(format!("service {key}: {e}"))),
                    }
                }
                Some(Kind::ServiceRemoved(k)) => {
                    // A key that fails the checks was never taken in: nothing to remove.
                    if let Ok(key) = service_key(Some(&k)) {
                        if let Some(e) = self.services.get_mut(&key) {
                            self.with_meta -= usize::from(e.meta.take().is_some());
                        }
                        touched.insert(key);
                    }
                }
                Some(Kind::EndpointUpserted(u)) => {
                    let (key, e) = match (service_key(u.service.as_ref()), u.endpoint.as_ref()) {
                        (Ok(key), Some(e)) => (key, e),
                        (Err(why), _) => {
                            skipped.push(Skipped(format!("an endpoint upsert: {why}")));
                            continue;
                        }
                        (Ok(key), None) => {
                            skipped.push(Skipped(format!(
                                "service {key}: an endpoint upsert without an endpoint"
                            )));
                            continue;
                        }
                    };
                    match endpoint(e) {
                        Ok(ep) => {
                            self.services
                                .entry(key.clone())
                                .or_default()
                                .endpoints
                                .insert((ep.address, ep.port), ep);
                            touched.insert(key);
                        }
                        Err(msg) => skipped.push(Skipped(format!("service {key}: {msg}"))),
                    }
                }
                Some(Kind::EndpointRemoved(r)) => {
                    let Ok(key) = service_key(r.service.as_ref()) else {
                        continue;
                    };
                    let (Ok(addr), Ok(port)) = (r.address.parse::<IpAddr>(), u16::try_from(r.port))
                    else {
                        skipped.push(Skipped(format!(
                            "service {key}: endpoint removal {}:{}: not an address and port",
                            r.address, r.port
                        )));
                        continue;
                    };
                    if let Some(e) = self.services.get_mut(&key) {
                        e.endpoints.remove(&(addr, port));
                    }
                    touched.insert(key);
                }
                Some(Kind::StateChanged(m)) => {
                    if let Some(key) = self.set_mark(&m, &mut skipped) {
                        touched.insert(key);
                    }
                }
                None => skipped.push(Skipped("an empty change".into())),
            }
        }
        self.revision = self.revision.max(batch.revision);
        let changes = touched
            .into_iter()
            .map(|k| {
                let change = self
                    .effective(&k)
                    .map_or_else(|| Change::RemoveService(k.clone()), Change::UpsertService);
                // Forget what no longer holds anything, so removals do not pile up.
                if self
                    .services
                    .get(&k)
                    .is_some_and(|e| e.meta.is_none() && e.endpoints.is_empty())
                {
                    self.services.remove(&k);
                }
                change
            })
            .collect();
        (changes, skipped)
    }

    fn set_mark(&mut self, m: &pb::DrainMark, skipped: &mut Vec<Skipped>) -> Option<ServiceKey> {
        let key = service_key(m.service.as_ref()).ok()?;
        let Ok(addr) = m.address.parse::<IpAddr>() else {
            skipped.push(Skipped(format!(
                "service {key}: drain mark for {:?}: not an IP address",
                m.address
            )));
            return None;
        };
        match state(m.state) {
            EndpointState::Draining => self
                .marks
                .insert((key.clone(), addr), EndpointState::Draining),
            EndpointState::Healthy => self.marks.remove(&(key.clone(), addr)),
        };
        Some(key)
    }

    /// The service as the node gets it: endpoints in address order, drain marks applied.
    fn effective(&self, key: &ServiceKey) -> Option<Service> {
        let entry = self.services.get(key)?;
        let meta = entry.meta.as_ref()?;
        let endpoints = entry
            .endpoints
            .values()
            .map(|e| {
                let mut e = e.clone();
                if self.marks.get(&(key.clone(), e.address)) == Some(&EndpointState::Draining) {
                    e.state = EndpointState::Draining;
                }
                e
            })
            .collect();
        Some(Service {
            name: key.name.clone(),
            namespace: key.namespace.clone(),
            ports: meta.ports.clone(),
            vip: meta.vip,
            endpoints,
        })
    }

    /// The addresses of endpoints on `node` in the view: what this node's drain marks
    /// may name.
    pub fn addresses_on(&self, node: &str) -> BTreeSet<IpAddr> {
        self.services
            .values()
            .flat_map(|e| e.endpoints.values())
            .filter(|e| e.node == node)
            .map(|e| e.address)
            .collect()
    }
}

/// A service key whose namespace and name are DNS labels.
fn service_key(k: Option<&pb::ServiceKey>) -> Result<ServiceKey, String> {
    let k = k.ok_or("no service key")?;
    let key = ServiceKey {
        namespace: k.namespace.clone(),
        name: k.name.clone(),
    };
    check::key("key", &key).map_err(|e| e.to_string())?;
    Ok(key)
}

fn meta(s: &pb::Service) -> Result<Meta, String> {
    let ports = s
        .ports
        .iter()
        .map(|p| u16::try_from(*p).map_err(|_| format!("port {p} out of range")))
        .collect::<Result<Vec<_>, _>>()?;
    let vip = match s.vip.as_str() {
        "" => None,
        v => Some(
            v.parse::<IpAddr>()
                .map_err(|_| format!("vip {v:?} is not an IP address"))?,
        ),
    };
    check::service_fields("service", &ports, vip, Loopback::Allow).map_err(|e| e.to_string())?;
    Ok(Meta { ports, vip })
}

/// One endpoint, or why it is skipped (naming it by address and port).
fn endpoint(e: &pb::Endpoint) -> Result<Endpoint, String> {
    let at = format!("endpoint {}:{}", e.address, e.port);
    let address = e
        .address
        .parse::<IpAddr>()
        .map_err(|_| format!("{at}: not an IP address"))?;
    let port = u16::try_from(e.port).map_err(|_| format!("{at}: port out of range"))?;
    let service_port = u16::try_from(e.service_port)
        .map_err(|_| format!("{at}: service_port {} out of range", e.service_port))?;
    let ep = Endpoint {
        address,
        port,
        service_port,
        node: e.node.clone(),
        pod: e.pod.clone(),
        state: state(e.state),
        mtls: e.mtls,
    };
    check::endpoint(&at, &ep, Loopback::Allow).map_err(|e| e.to_string())?;
    Ok(ep)
}

fn state(s: i32) -> EndpointState {
    match pb::EndpointState::try_from(s) {
        Ok(pb::EndpointState::Draining) => EndpointState::Draining,
        _ => EndpointState::Healthy,
    }
}
