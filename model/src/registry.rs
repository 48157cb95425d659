//! The registry view: the mesh's services and their endpoints.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::Change;

/// A service's identity. Ordered by namespace, then name: the order of the outbound
/// route's virtual hosts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub namespace: String,
    pub ports: Vec<u16>,
    pub vip: Option<IpAddr>,
    pub endpoints: Vec<Endpoint>,
}

impl Service {
    pub fn key(&self) -> ServiceKey {
        ServiceKey { namespace: self.namespace.clone(), name: self.name.clone() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub address: IpAddr,
    pub port: u16,
    /// The service port this endpoint serves.
    pub service_port: u16,
    pub node: String,
    pub pod: String,
    pub state: EndpointState,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EndpointState {
    #[default]
    Healthy,
    Draining,
}

/// Services of the mesh, by key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryView {
    pub services: BTreeMap<ServiceKey, Service>,
}

impl RegistryView {
    /// A view of `services`; a later service replaces an earlier one with the same key.
    pub fn new(services: impl IntoIterator<Item = Service>) -> Self {
        Self { services: services.into_iter().map(|s| (s.key(), s)).collect() }
    }

    /// The changes that turn this view into `next`: removals first, then every service
    /// that is new or differs. Unchanged services give no change.
    pub fn diff(&self, next: &RegistryView) -> Vec<Change> {
        // One merge of the two sorted maps: no lookups.
        let mut removed = Vec::new();
        let mut upserted = Vec::new();
        let (mut old, mut new) = (self.services.iter().peekable(), next.services.iter().peekable());
        loop {
            match (old.peek(), new.peek()) {
                (Some((ko, so)), Some((kn, sn))) => match ko.cmp(kn) {
                    std::cmp::Ordering::Less => {
                        removed.push(Change::RemoveService((*ko).clone()));
                        old.next();
                    }
                    std::cmp::Ordering::Greater => {
                        upserted.push(Change::UpsertService((*sn).clone()));
                        new.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if so != sn {
                            upserted.push(Change::UpsertService((*sn).clone()));
                        }
                        old.next();
                        new.next();
                    }
                },
                (Some((ko, _)), None) => {
                    removed.push(Change::RemoveService((*ko).clone()));
                    old.next();
                }
                (None, Some((_, sn))) => {
                    upserted.push(Change::UpsertService((*sn).clone()));
                    new.next();
                }
                (None, None) => break,
            }
        }
        removed.extend(upserted);
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, port: u16) -> Service {
        Service { name: name.into(), namespace: "d".into(), ports: vec![port], vip: None, endpoints: vec![] }
    }

    #[test]
    fn diff_names_only_what_changed() {
        let a = RegistryView::new([svc("a", 80), svc("b", 80), svc("c", 80)]);
        let b = RegistryView::new([svc("a", 80), svc("b", 81), svc("d", 80)]);
        assert_eq!(a.diff(&b), vec![
            Change::RemoveService(svc("c", 80).key()),
            Change::UpsertService(svc("b", 81)),
            Change::UpsertService(svc("d", 80)),
        ]);
        assert!(b.diff(&b).is_empty());
    }
}
