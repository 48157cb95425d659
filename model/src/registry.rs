//! The registry view: the mesh's services and their endpoints.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

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
        ServiceKey {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
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
    /// The endpoint accepts mTLS with SPIFFE SVIDs (its node's agent serves it mTLS):
    /// the proxy originates mTLS to it when identity is on.
    pub mtls: bool,
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
        Self {
            services: services.into_iter().map(|s| (s.key(), s)).collect(),
        }
    }
}
