//! The JSON values stored under the registry's keys, and their conversion to and from
//! the API's messages. Unknown fields are ignored on read, so a newer registrar's extra
//! fields do not make an older one skip the value.

use std::net::{IpAddr, SocketAddr};

use aether_model::{EndpointState, ServiceKey};
use serde::{Deserialize, Serialize};
use shared_proto::registry as pb;

/// `services/<ns>/<name>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceValue {
    pub ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vip: Option<IpAddr>,
    /// Who wrote the service. Stored only for a discovered one, so that the values that
    /// `apply` writes are the bytes they were before discovery existed.
    #[serde(default, skip_serializing_if = "Source::is_file")]
    pub source: Source,
}

/// Where a service in the registry comes from. Kubernetes wins: discovery takes over a
/// service of the same name that a file applied, and `apply` and `delete` refuse a
/// discovered one (it is changed in Kubernetes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// `aether-registrar apply` (the ApplyServices call).
    #[default]
    File,
    /// Discovered from a Kubernetes Service and its EndpointSlices.
    Kubernetes,
}

impl Source {
    pub fn is_file(&self) -> bool {
        *self == Source::File
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Source::File => "file",
            Source::Kubernetes => "kubernetes",
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `endpoints/<ns>/<name>/<address>/<port>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointValue {
    pub service_port: u16,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub state: EndpointState,
    /// The endpoint is served mTLS with SPIFFE SVIDs. Stored only when true, so that the
    /// values written before the field are unchanged byte for byte and read as false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mtls: bool,
    /// Where an HTTP/3 client reaches the endpoint's QUIC twin, from its node's QUIC
    /// pairs (written by the registrar, never by a source); stored only when set.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quic: String,
    /// The server name to send to the twin.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quic_sni: String,
}

impl EndpointValue {
    /// The value with the twin `pairs` name for `at` (none: no twin). Pairs belong to the
    /// endpoint's node; the caller passes that node's.
    pub fn with_twin(mut self, at: SocketAddr, pairs: Option<&PairsValue>) -> Self {
        let (quic, sni) = pairs
            .and_then(|p| p.twin(at))
            .map_or((String::new(), String::new()), |p| {
                (p.quic.clone(), p.quic_sni.clone())
            });
        self.quic = quic;
        self.quic_sni = sni;
        self
    }
}

/// `quic-pairs/<node>`: the node's whole set of QUIC pairs (SetQuicPairs), sorted by
/// `tcp`, no `tcp` twice. The set is a state: equal sets are equal bytes, so a restated
/// set is never rewritten.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairsValue {
    pub pairs: Vec<PairValue>,
}

/// One pair: a pod's TCP endpoint and its QUIC twin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PairValue {
    pub tcp: SocketAddr,
    pub quic: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub quic_sni: String,
    #[serde(default)]
    pub pod: String,
    #[serde(default)]
    pub since: i64,
}

impl PairsValue {
    /// Sorts by `tcp`; the caller has checked that no `tcp` repeats.
    pub fn new(mut pairs: Vec<PairValue>) -> Self {
        pairs.sort_by_key(|p| p.tcp);
        Self { pairs }
    }

    /// The pair whose `tcp` is `at`.
    pub fn twin(&self, at: SocketAddr) -> Option<&PairValue> {
        self.pairs
            .binary_search_by_key(&at, |p| p.tcp)
            .ok()
            .map(|i| &self.pairs[i])
    }
}

/// `marks/<ns>/<name>/<address>`. `instance` is the setter's pod, kept for the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MarkValue {
    pub state: EndpointState,
    #[serde(default)]
    pub node: String,
    #[serde(default)]
    pub instance: String,
}

#[derive(Debug, thiserror::Error)]
#[error("value of {key:?} is not a valid {what}: {message}")]
pub struct ValueError {
    pub key: String,
    pub what: &'static str,
    pub message: String,
}

/// Decodes the value stored at `key`.
pub fn decode<T: for<'de> Deserialize<'de>>(
    key: &str,
    what: &'static str,
    value: &[u8],
) -> Result<T, ValueError> {
    serde_json::from_slice(value).map_err(|e| ValueError {
        key: key.to_owned(),
        what,
        message: e.to_string(),
    })
}

/// The bytes stored for a value: compact JSON, so that equal values are equal bytes and
/// an unchanged value is never rewritten.
pub fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("registry values serialize")
}

pub fn state_to_pb(s: EndpointState) -> i32 {
    match s {
        EndpointState::Healthy => pb::EndpointState::Healthy as i32,
        EndpointState::Draining => pb::EndpointState::Draining as i32,
    }
}

/// The API's state; UNSPECIFIED reads as HEALTHY. None for a number the API does not
/// define.
pub fn state_from_pb(s: i32) -> Option<EndpointState> {
    match pb::EndpointState::try_from(s).ok()? {
        pb::EndpointState::Unspecified | pb::EndpointState::Healthy => Some(EndpointState::Healthy),
        pb::EndpointState::Draining => Some(EndpointState::Draining),
    }
}

pub fn key_to_pb(k: &ServiceKey) -> pb::ServiceKey {
    pb::ServiceKey {
        namespace: k.namespace.clone(),
        name: k.name.clone(),
    }
}

pub fn key_from_pb(k: &pb::ServiceKey) -> ServiceKey {
    ServiceKey {
        namespace: k.namespace.clone(),
        name: k.name.clone(),
    }
}

/// A service's ports and VIP as the API carries them (endpoints apart).
pub fn service_to_pb(key: &ServiceKey, v: &ServiceValue) -> pb::Service {
    pb::Service {
        key: Some(key_to_pb(key)),
        ports: v.ports.iter().map(|p| u32::from(*p)).collect(),
        vip: v.vip.map(|ip| ip.to_string()).unwrap_or_default(),
        endpoints: Vec::new(),
    }
}

pub fn endpoint_to_pb(address: IpAddr, port: u16, v: &EndpointValue) -> pb::Endpoint {
    pb::Endpoint {
        address: address.to_string(),
        port: u32::from(port),
        service_port: u32::from(v.service_port),
        node: v.node.clone(),
        pod: v.pod.clone(),
        state: state_to_pb(v.state),
        mtls: v.mtls,
        quic: v.quic.clone(),
        quic_sni: v.quic_sni.clone(),
    }
}

pub fn mark_to_pb(service: &ServiceKey, address: IpAddr, v: &MarkValue) -> pb::DrainMark {
    pb::DrainMark {
        service: Some(key_to_pb(service)),
        address: address.to_string(),
        state: state_to_pb(v.state),
        node: v.node.clone(),
    }
}

/// The model's service (as `aether-registrar apply` reads a registry file) in the API.
pub fn model_service_to_pb(s: &aether_model::Service) -> pb::Service {
    pb::Service {
        key: Some(key_to_pb(&s.key())),
        ports: s.ports.iter().map(|p| u32::from(*p)).collect(),
        vip: s.vip.map(|ip| ip.to_string()).unwrap_or_default(),
        endpoints: s
            .endpoints
            .iter()
            .map(|e| pb::Endpoint {
                address: e.address.to_string(),
                port: u32::from(e.port),
                service_port: u32::from(e.service_port),
                node: e.node.clone(),
                pod: e.pod.clone(),
                state: state_to_pb(e.state),
                mtls: e.mtls,
                quic: String::new(),
                quic_sni: String::new(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_the_documented_json() {
        let s = ServiceValue {
            ports: vec![80],
            vip: Some("10.96.0.1".parse().unwrap()),
            source: Source::File,
        };
        assert_eq!(
            String::from_utf8(encode(&s)).unwrap(),
            r#"{"ports":[80],"vip":"10.96.0.1"}"#
        );
        assert_eq!(
            String::from_utf8(encode(&ServiceValue {
                ports: vec![80, 81],
                vip: None,
                source: Source::File
            }))
            .unwrap(),
            r#"{"ports":[80,81]}"#
        );
        let discovered = ServiceValue {
            ports: vec![80],
            vip: None,
            source: Source::Kubernetes,
        };
        assert_eq!(
            String::from_utf8(encode(&discovered)).unwrap(),
            r#"{"ports":[80],"source":"kubernetes"}"#
        );
        assert_eq!(
            decode::<ServiceValue>("k", "service", br#"{"ports":[80]}"#)
                .unwrap()
                .source,
            Source::File
        );
        assert_eq!(
            decode::<ServiceValue>("k", "service", &encode(&discovered)).unwrap(),
            discovered
        );
        let e = EndpointValue {
            service_port: 80,
            node: "n".into(),
            pod: "p".into(),
            state: EndpointState::Draining,
            mtls: false,
            quic: String::new(),
            quic_sni: String::new(),
        };
        assert_eq!(
            String::from_utf8(encode(&e)).unwrap(),
            r#"{"service_port":80,"node":"n","pod":"p","state":"draining"}"#
        );
        let m = MarkValue {
            state: EndpointState::Draining,
            node: "n".into(),
            instance: "pod-x".into(),
        };
        assert_eq!(
            String::from_utf8(encode(&m)).unwrap(),
            r#"{"state":"draining","node":"n","instance":"pod-x"}"#
        );
        // Optional fields may be absent and unknown ones are ignored.
        let e: EndpointValue =
            decode("k", "endpoint", br#"{"service_port":80,"future":1}"#).unwrap();
        assert_eq!(e.state, EndpointState::Healthy);
        let err = decode::<MarkValue>("/p/marks/a/b/10.0.0.1", "drain mark", b"{oops")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/p/marks/a/b/10.0.0.1") && err.contains("drain mark"),
            "{err}"
        );
    }

    #[test]
    fn the_mtls_mark_round_trips_and_a_value_without_it_reads_false() {
        let plain = EndpointValue {
            service_port: 80,
            node: "n".into(),
            pod: "p".into(),
            state: EndpointState::Healthy,
            mtls: false,
            quic: String::new(),
            quic_sni: String::new(),
        };
        let marked = EndpointValue {
            mtls: true,
            ..plain.clone()
        };
        // Written only when set: an unmarked endpoint's value is the bytes it always was.
        assert_eq!(
            String::from_utf8(encode(&plain)).unwrap(),
            r#"{"service_port":80,"node":"n","pod":"p","state":"healthy"}"#
        );
        assert_eq!(
            String::from_utf8(encode(&marked)).unwrap(),
            r#"{"service_port":80,"node":"n","pod":"p","state":"healthy","mtls":true}"#
        );
        for v in [&plain, &marked] {
            assert_eq!(
                &decode::<EndpointValue>("k", "endpoint", &encode(v)).unwrap(),
                v
            );
        }
        // A value a registrar without the field wrote reads as not mTLS.
        let old: EndpointValue = decode(
            "k",
            "endpoint",
            br#"{"service_port":80,"node":"n","pod":"p","state":"healthy"}"#,
        )
        .unwrap();
        assert_eq!(old, plain);
        // And the API carries it both ways.
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(endpoint_to_pb(ip, 8080, &marked).mtls);
        assert!(!endpoint_to_pb(ip, 8080, &plain).mtls);
        let service = |mtls: bool| aether_model::Service {
            name: "web".into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: vec![aether_model::Endpoint {
                address: ip,
                port: 8080,
                service_port: 80,
                node: "n".into(),
                pod: "p".into(),
                state: EndpointState::Healthy,
                mtls,
            }],
        };
        assert!(model_service_to_pb(&service(true)).endpoints[0].mtls);
        assert!(!model_service_to_pb(&service(false)).endpoints[0].mtls);
    }

    #[test]
    fn states_convert_and_unspecified_reads_as_healthy() {
        assert_eq!(state_from_pb(0), Some(EndpointState::Healthy));
        assert_eq!(state_from_pb(1), Some(EndpointState::Healthy));
        assert_eq!(state_from_pb(2), Some(EndpointState::Draining));
        assert_eq!(state_from_pb(7), None);
        for s in [EndpointState::Healthy, EndpointState::Draining] {
            assert_eq!(state_from_pb(state_to_pb(s)), Some(s));
        }
    }
}
