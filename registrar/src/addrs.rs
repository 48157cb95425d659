//! Which services have an endpoint at an address: an index this process keeps from its
//! etcd watch ([`crate::kept`]), so that a drain mark that names no service reads the
//! endpoints of the services at its address, not every endpoint of every service.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use aether_model::ServiceKey;

use crate::keys::{Key, Layout};

/// Endpoints by address: each service with the ports of its endpoints there.
#[derive(Debug, Default)]
pub struct AddrIndex {
    by_addr: HashMap<IpAddr, BTreeMap<ServiceKey, BTreeSet<u16>>>,
}

impl AddrIndex {
    /// Applies an etcd key that was put (`put`) or deleted; keys other than endpoints'
    /// are ignored.
    pub fn apply(&mut self, layout: &Layout, key: &[u8], put: bool) {
        if let Ok(key) = layout.parse(key) {
            self.apply_key(&key, put);
        }
    }

    /// [`AddrIndex::apply`] of a key parsed already.
    pub fn apply_key(&mut self, key: &Key, put: bool) {
        let Key::Endpoint {
            service,
            address,
            port,
        } = key
        else {
            return;
        };
        let (service, address, port) = (service.clone(), *address, *port);
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
