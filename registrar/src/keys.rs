//! The registry's etcd key layout under a prefix (`--etcd-prefix`):
//!
//! - `services/<namespace>/<name>`: the service's ports and VIP;
//! - `endpoints/<namespace>/<name>/<address>/<port>`: one endpoint;
//! - `marks/<namespace>/<name>/<address>`: the drain mark of every endpoint at an address;
//! - `quic-pairs/<node>`: a node's QUIC pairs, one whole set (SetQuicPairs).
//!
//! Namespaces and names are DNS labels, nodes DNS subdomains, and addresses are IPs in
//! their canonical text, so no segment holds a `/` and every key parses back into exactly one [`Key`]. Prefix scans
//! end in `/` so that `web` never matches `web2`.

use std::net::IpAddr;

use aether_model::ServiceKey;
use aether_model::registry_file::is_dns_label;

/// The default `--etcd-prefix`.
pub const DEFAULT_PREFIX: &str = "/aether/registry/";

/// Builds and parses the keys under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
}

/// What a key under the prefix names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    Service(ServiceKey),
    Endpoint {
        service: ServiceKey,
        address: IpAddr,
        port: u16,
    },
    Mark {
        service: ServiceKey,
        address: IpAddr,
    },
    QuicPairs {
        node: String,
    },
}

/// A DNS subdomain (RFC 1123, as Kubernetes names nodes): at most 253 characters, dot-
/// separated DNS labels.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key {key:?} is not under the prefix {prefix:?}")]
    OutsidePrefix { key: String, prefix: String },
    #[error("key {key:?}: {reason}")]
    Malformed { key: String, reason: String },
}

impl Layout {
    /// A layout under `prefix`, which gets a trailing `/` if it lacks one.
    pub fn new(prefix: &str) -> Self {
        let mut prefix = prefix.to_owned();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        Self { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn service(&self, s: &ServiceKey) -> String {
        format!("{}services/{}/{}", self.prefix, s.namespace, s.name)
    }

    pub fn endpoint(&self, s: &ServiceKey, address: IpAddr, port: u16) -> String {
        format!(
            "{}endpoints/{}/{}/{address}/{port}",
            self.prefix, s.namespace, s.name
        )
    }

    pub fn mark(&self, s: &ServiceKey, address: IpAddr) -> String {
        format!("{}marks/{}/{}/{address}", self.prefix, s.namespace, s.name)
    }

    /// A node's QUIC pairs.
    pub fn quic_pairs(&self, node: &str) -> String {
        format!("{}quic-pairs/{node}", self.prefix)
    }

    /// Every endpoint of a service.
    pub fn endpoints_of(&self, s: &ServiceKey) -> String {
        format!("{}endpoints/{}/{}/", self.prefix, s.namespace, s.name)
    }

    /// The endpoints of a service at one address.
    pub fn endpoints_at(&self, s: &ServiceKey, address: IpAddr) -> String {
        format!(
            "{}endpoints/{}/{}/{address}/",
            self.prefix, s.namespace, s.name
        )
    }

    /// Every endpoint of every service.
    pub fn all_endpoints(&self) -> String {
        format!("{}endpoints/", self.prefix)
    }

    /// Every mark of a service.
    pub fn marks_of(&self, s: &ServiceKey) -> String {
        format!("{}marks/{}/{}/", self.prefix, s.namespace, s.name)
    }

    /// Parses a key read from etcd.
    pub fn parse(&self, key: &[u8]) -> Result<Key, KeyError> {
        let text = String::from_utf8_lossy(key);
        let malformed = |reason: &str| KeyError::Malformed {
            key: text.to_string(),
            reason: reason.to_owned(),
        };
        let Some(rest) = text.strip_prefix(self.prefix.as_str()) else {
            return Err(KeyError::OutsidePrefix {
                key: text.to_string(),
                prefix: self.prefix.clone(),
            });
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let service = |ns: &str, name: &str| -> Result<ServiceKey, KeyError> {
            if !is_dns_label(ns) || !is_dns_label(name) {
                return Err(malformed("namespace or name is not a DNS label"));
            }
            Ok(ServiceKey {
                namespace: ns.to_owned(),
                name: name.to_owned(),
            })
        };
        let address = |a: &str| -> Result<IpAddr, KeyError> {
            match a.parse::<IpAddr>() {
                // A non-canonical spelling would never be found again by the key builders.
                Ok(ip) if ip.to_string() == a => Ok(ip),
                Ok(_) => Err(malformed("the address is not in its canonical form")),
                Err(_) => Err(malformed("the address is not an IP")),
            }
        };
        match parts.as_slice() {
            ["services", ns, name] => Ok(Key::Service(service(ns, name)?)),
            ["endpoints", ns, name, a, port] => {
                let port = match port.parse::<u16>() {
                    Ok(p) if p != 0 && p.to_string() == *port => p,
                    _ => return Err(malformed("the port is not 1..=65535")),
                };
                Ok(Key::Endpoint {
                    service: service(ns, name)?,
                    address: address(a)?,
                    port,
                })
            }
            ["marks", ns, name, a] => Ok(Key::Mark {
                service: service(ns, name)?,
                address: address(a)?,
            }),
            ["quic-pairs", node] if is_dns_subdomain(node) => Ok(Key::QuicPairs {
                node: (*node).to_owned(),
            }),
            ["quic-pairs", _] => Err(malformed("the node is not a DNS subdomain")),
            _ => Err(malformed(
                "not services/<ns>/<name>, endpoints/<ns>/<name>/<address>/<port>, marks/<ns>/<name>/<address> or quic-pairs/<node>",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> ServiceKey {
        ServiceKey {
            namespace: "prod".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn keys_round_trip() {
        let l = Layout::new("/aether/registry");
        assert_eq!(l.prefix(), "/aether/registry/");
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(l.service(&web()), "/aether/registry/services/prod/web");
        assert_eq!(
            l.endpoint(&web(), v4, 8080),
            "/aether/registry/endpoints/prod/web/10.0.0.1/8080"
        );
        assert_eq!(
            l.mark(&web(), v6),
            "/aether/registry/marks/prod/web/fd00::1"
        );
        for (key, want) in [
            (l.service(&web()), Key::Service(web())),
            (
                l.endpoint(&web(), v6, 80),
                Key::Endpoint {
                    service: web(),
                    address: v6,
                    port: 80,
                },
            ),
            (
                l.mark(&web(), v4),
                Key::Mark {
                    service: web(),
                    address: v4,
                },
            ),
            (
                l.quic_pairs("node-a.example"),
                Key::QuicPairs {
                    node: "node-a.example".into(),
                },
            ),
        ] {
            assert_eq!(l.parse(key.as_bytes()), Ok(want), "{key}");
        }
        assert!(
            l.endpoint(&web(), v4, 80)
                .starts_with(&l.endpoints_at(&web(), v4))
        );
        assert!(
            l.endpoint(&web(), v4, 80)
                .starts_with(&l.endpoints_of(&web()))
        );
        let web2 = ServiceKey {
            namespace: "prod".into(),
            name: "web2".into(),
        };
        assert!(
            !l.endpoint(&web2, v4, 80)
                .starts_with(&l.endpoints_of(&web()))
        );
    }

    #[test]
    fn malformed_keys_are_errors_naming_the_key() {
        let l = Layout::new(DEFAULT_PREFIX);
        for (key, reason) in [
            ("/other/services/a/b", "not under the prefix"),
            ("/aether/registry/services/a", "not services/"),
            ("/aether/registry/services/A/b", "DNS label"),
            ("/aether/registry/endpoints/a/b/10.0.0.1/0", "port"),
            ("/aether/registry/endpoints/a/b/10.0.0.1/080", "port"),
            ("/aether/registry/endpoints/a/b/10.0.0.x/80", "not an IP"),
            ("/aether/registry/marks/a/b/fd00:0::1", "canonical"),
            ("/aether/registry/marks/a/b/10.0.0.1/extra", "not services/"),
            ("/aether/registry/quic-pairs/Node_A", "not a DNS subdomain"),
            ("/aether/registry/quic-pairs/a/b", "quic-pairs/<node>"),
        ] {
            let e = l.parse(key.as_bytes()).expect_err(key).to_string();
            assert!(e.contains(reason) && e.contains(key), "{key}: {e}");
        }
    }
}
