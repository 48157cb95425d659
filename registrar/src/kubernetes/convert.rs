//! A Kubernetes Service and its EndpointSlices as one registry service. Pure.
//!
//! - **Ports:** the Service's TCP ports. An EndpointSlice names each of its ports after the
//!   Service port it serves (the EndpointSlice controller resolves named target ports
//!   into numbers per pod), so an endpoint's port is the slice port's number and its
//!   service port is the Service port of the same name.
//! - **VIP:** `spec.clusterIP`; none for a headless Service.
//! - **Endpoints:** the first address of each slice endpoint (consumers use only the first,
//!   as kube-proxy does), for each TCP port of the slice.
//! - **Conditions,** as Kubernetes defines them: `ready` (nil means true) and not
//!   `terminating` (nil means false) is healthy; `terminating` and `serving` (nil means
//!   as `ready`) is draining, so the proxy lets its connections finish; terminating and
//!   no longer serving, or not terminating and not ready (starting, or failing its
//!   probe), is left out. An agent's drain mark is a key of its own that discovery never
//!   writes, so it holds even while the slice still says ready.
//! - **Addresses:** one no endpoint may have (link-local, multicast, unspecified, and
//!   loopback unless allowed; `aether_model::check`) leaves its endpoint out, named in
//!   [`Converted::refused`] for the writer to log and count; the rest of the slice stands.
//! - **mTLS:** the Service annotation `aether.io/mtls: "true"` marks every endpoint.
//!
//! An endpoint listed by two slices (the controller moving it) is kept once; healthy wins.

use std::collections::BTreeMap;
use std::net::IpAddr;

use aether_model::check::{self, Invalid, Loopback};
use aether_model::registry_file::is_dns_label;
use aether_model::{Endpoint, EndpointState, Service, ServiceKey};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};

/// The label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The Service annotation that marks its endpoints as served with mTLS.
pub const MTLS_ANNOTATION: &str = "aether.io/mtls";

/// Why a Service is not in the registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skipped {
    #[error("type ExternalName: a DNS alias, no endpoints")]
    ExternalName,
    #[error("no TCP port")]
    NoTcpPort,
    #[error("namespace or name is not a DNS label")]
    NotDnsLabel,
}

/// The registry key of a Kubernetes object's namespace and name.
pub fn key(namespace: Option<&str>, name: Option<&str>) -> Option<ServiceKey> {
    Some(ServiceKey {
        namespace: namespace?.to_owned(),
        name: name?.to_owned(),
    })
}

/// The Service an EndpointSlice belongs to (its namespace and service-name label).
pub fn slice_service(slice: &EndpointSlice) -> Option<ServiceKey> {
    let name = slice.metadata.labels.as_ref()?.get(SERVICE_NAME_LABEL)?;
    key(slice.metadata.namespace.as_deref(), Some(name))
}

fn is_tcp(protocol: Option<&str>) -> bool {
    protocol.is_none_or(|p| p == "TCP")
}

/// The registry state of a slice endpoint with these conditions; None leaves it out.
pub fn state(c: Option<&EndpointConditions>) -> Option<EndpointState> {
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
    match (terminating, ready, serving) {
        (false, true, _) => Some(EndpointState::Healthy),
        (false, false, _) => None,
        (true, _, true) => Some(EndpointState::Draining),
        (true, _, false) => None,
    }
}

/// A registry service made of a Service and its slices, with the slice endpoints left out
/// for their address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Converted {
    pub service: Service,
    /// `endpointslice <ns>/<name> endpoints[i].addresses[0]`: why.
    pub refused: Vec<Invalid>,
}

/// The registry service of `svc` with the endpoints of `slices` (those of other Services
/// are ignored); loopback addresses pass only with `Loopback::Allow`.
pub fn service<'a>(
    svc: &KubeService,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    loopback: Loopback,
) -> Result<Converted, Skipped> {
    let (namespace, name) = (
        svc.metadata.namespace.clone().unwrap_or_default(),
        svc.metadata.name.clone().unwrap_or_default(),
    );
    if !is_dns_label(&namespace) || !is_dns_label(&name) {
        return Err(Skipped::NotDnsLabel);
    }
    let spec = svc.spec.clone().unwrap_or_default();
    if spec.type_.as_deref() == Some("ExternalName") {
        return Err(Skipped::ExternalName);
    }
    // Service port by its name ("" for the one unnamed port).
    let mut by_name: BTreeMap<String, u16> = BTreeMap::new();
    let mut ports = Vec::new();
    for p in spec.ports.iter().flatten() {
        let Ok(number) = u16::try_from(p.port) else {
            continue;
        };
        if number == 0 || !is_tcp(p.protocol.as_deref()) || ports.contains(&number) {
            continue;
        }
        ports.push(number);
        by_name.insert(p.name.clone().unwrap_or_default(), number);
    }
    if ports.is_empty() {
        return Err(Skipped::NoTcpPort);
    }
    let mut refused = Vec::new();
    let vip = spec
        .cluster_ip
        .as_deref()
        .and_then(|ip| ip.parse::<IpAddr>().ok())
        .filter(|ip| {
            let field = format!("service {namespace}/{name} spec.clusterIP");
            check::address(&field, *ip, loopback)
                .map_err(|e| refused.push(e))
                .is_ok()
        });
    let mtls = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MTLS_ANNOTATION))
        .is_some_and(|v| v == "true");
    let own = ServiceKey { namespace, name };
    let mut endpoints: BTreeMap<(IpAddr, u16), Endpoint> = BTreeMap::new();
    for slice in slices {
        if slice_service(slice).as_ref() != Some(&own)
            || !matches!(slice.address_type.as_str(), "IPv4" | "IPv6")
        {
            continue;
        }
        // Each endpoint once, whatever the number of ports: (address, state, node, pod).
        let mut usable = Vec::new();
        for (i, e) in slice.endpoints.iter().flatten().enumerate() {
            let Some(state) = state(e.conditions.as_ref()) else {
                continue;
            };
            let Some(first) = e.addresses.first() else {
                continue;
            };
            let field = || {
                format!(
                    "endpointslice {}/{} endpoints[{i}].addresses[0]",
                    slice.metadata.namespace.as_deref().unwrap_or_default(),
                    slice.metadata.name.as_deref().unwrap_or_default()
                )
            };
            let Ok(address) = first.parse::<IpAddr>() else {
                refused.push(Invalid::new(
                    field(),
                    format!("{first:?} is not an IP address"),
                ));
                continue;
            };
            if let Err(e) = check::address(&field(), address, loopback) {
                refused.push(e);
                continue;
            }
            let pod = e
                .target_ref
                .as_ref()
                .filter(|r| r.kind.as_deref() == Some("Pod"))
                .and_then(|r| r.name.clone())
                .unwrap_or_default();
            usable.push((address, state, e.node_name.clone().unwrap_or_default(), pod));
        }
        for sp in slice.ports.iter().flatten() {
            let (Some(port), true) = (
                sp.port
                    .and_then(|p| u16::try_from(p).ok())
                    .filter(|p| *p != 0),
                is_tcp(sp.protocol.as_deref()),
            ) else {
                continue;
            };
            let Some(&service_port) = by_name.get(sp.name.as_deref().unwrap_or("")) else {
                continue;
            };
            for (address, state, node, pod) in &usable {
                let endpoint = Endpoint {
                    address: *address,
                    port,
                    service_port,
                    node: node.clone(),
                    pod: pod.clone(),
                    state: *state,
                    mtls,
                };
                match endpoints.get(&(*address, port)) {
                    Some(kept) if kept.state == EndpointState::Healthy => {}
                    _ => {
                        endpoints.insert((*address, port), endpoint);
                    }
                }
            }
        }
    }
    Ok(Converted {
        service: Service {
            name: own.name,
            namespace: own.namespace,
            ports,
            vip,
            endpoints: endpoints.into_values().collect(),
        },
        refused,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(v: serde_json::Value) -> KubeService {
        serde_json::from_value(v).unwrap()
    }

    fn slice(v: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(v).unwrap()
    }

    fn web() -> KubeService {
        svc(json!({
            "metadata": {"namespace": "prod", "name": "web"},
            "spec": {"clusterIP": "10.96.0.10", "ports": [
                {"name": "http", "port": 80, "targetPort": "http-alt"},
                {"name": "grpc", "port": 9090, "targetPort": 9091},
                {"name": "dns", "port": 53, "protocol": "UDP"},
            ]}
        }))
    }

    fn endpoint(ip: &str, node: &str, conditions: serde_json::Value) -> serde_json::Value {
        json!({"addresses": [ip], "nodeName": node, "conditions": conditions, "targetRef": {"kind": "Pod", "name": format!("web-{ip}")}})
    }

    fn web_slice(name: &str, endpoints: Vec<serde_json::Value>) -> EndpointSlice {
        slice(json!({
            "metadata": {"namespace": "prod", "name": name, "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "grpc", "port": 9091}, {"name": "dns", "port": 5353, "protocol": "UDP"}],
            "endpoints": endpoints,
        }))
    }

    fn show(s: &Service) -> Vec<String> {
        s.endpoints
            .iter()
            .map(|e| {
                format!(
                    "{}:{}>{} {} {} {:?}",
                    e.address, e.port, e.service_port, e.node, e.pod, e.state
                )
            })
            .collect()
    }

    #[test]
    fn two_slices_make_one_service_with_named_target_ports_resolved() {
        let a = web_slice(
            "web-a",
            vec![endpoint("10.1.0.1", "n1", json!({"ready": true}))],
        );
        let b = web_slice("web-b", vec![endpoint("10.1.0.2", "n2", json!({}))]);
        let s = service(&web(), [&a, &b], Loopback::Refuse).unwrap().service;
        assert_eq!(
            (
                s.namespace.as_str(),
                s.name.as_str(),
                s.ports.clone(),
                s.vip
            ),
            (
                "prod",
                "web",
                vec![80, 9090],
                Some("10.96.0.10".parse().unwrap())
            )
        );
        assert_eq!(
            show(&s),
            [
                "10.1.0.1:8080>80 n1 web-10.1.0.1 Healthy",
                "10.1.0.1:9091>9090 n1 web-10.1.0.1 Healthy",
                "10.1.0.2:8080>80 n2 web-10.1.0.2 Healthy",
                "10.1.0.2:9091>9090 n2 web-10.1.0.2 Healthy",
            ]
        );
        assert!(s.endpoints.iter().all(|e| !e.mtls));
    }

    #[test]
    fn conditions_map_to_healthy_draining_or_absent() {
        use EndpointState::*;
        let cases = [
            (json!({}), Some(Healthy)),
            (
                json!({"ready": true, "serving": true, "terminating": false}),
                Some(Healthy),
            ),
            (json!({"ready": true}), Some(Healthy)),
            // Terminating and still serving: draining, connections finish.
            (
                json!({"ready": false, "serving": true, "terminating": true}),
                Some(Draining),
            ),
            // publishNotReadyAddresses: ready stays true while terminating; serving
            // unset defers to it.
            (json!({"ready": true, "terminating": true}), Some(Draining)),
            (json!({"terminating": true}), Some(Draining)),
            // Terminating and no longer serving: out.
            (
                json!({"ready": false, "serving": false, "terminating": true}),
                None,
            ),
            (json!({"ready": false, "terminating": true}), None),
            (json!({"serving": false, "terminating": true}), None),
            // Not terminating: ready decides.
            (json!({"ready": false, "serving": false}), None),
            (json!({"ready": false, "serving": true}), None),
        ];
        for (c, want) in cases {
            let c: EndpointConditions = serde_json::from_value(c.clone()).unwrap();
            assert_eq!(state(Some(&c)), want, "{c:?}");
        }
        assert_eq!(state(None), Some(Healthy));
    }

    #[test]
    fn other_services_slices_headless_external_and_udp_only_services() {
        let mut other = web_slice("api-a", vec![endpoint("10.1.0.9", "n1", json!({}))]);
        other.metadata.labels = Some([(SERVICE_NAME_LABEL.to_owned(), "api".to_owned())].into());
        let mut fqdn = web_slice("web-f", vec![endpoint("10.1.0.8", "n1", json!({}))]);
        fqdn.address_type = "FQDN".into();
        assert!(
            service(&web(), [&other, &fqdn], Loopback::Refuse)
                .unwrap()
                .service
                .endpoints
                .is_empty()
        );

        let headless = svc(
            json!({"metadata": {"namespace": "prod", "name": "web"}, "spec": {"clusterIP": "None", "ports": [{"port": 80}]}}),
        );
        let unnamed = slice(
            json!({"metadata": {"namespace": "prod", "name": "w", "labels": {SERVICE_NAME_LABEL: "web"}}, "addressType": "IPv6",
            "ports": [{"port": 8080}], "endpoints": [{"addresses": ["fd00::1"]}]}),
        );
        let s = service(&headless, [&unnamed], Loopback::Refuse)
            .unwrap()
            .service;
        assert_eq!(
            (s.vip, show(&s)),
            (None, vec!["fd00::1:8080>80   Healthy".to_owned()])
        );

        let external = svc(
            json!({"metadata": {"namespace": "prod", "name": "ext"}, "spec": {"type": "ExternalName", "externalName": "example.com"}}),
        );
        assert_eq!(
            service(&external, [], Loopback::Refuse),
            Err(Skipped::ExternalName)
        );
        let udp = svc(
            json!({"metadata": {"namespace": "prod", "name": "dns"}, "spec": {"ports": [{"port": 53, "protocol": "UDP"}]}}),
        );
        assert_eq!(service(&udp, [], Loopback::Refuse), Err(Skipped::NoTcpPort));
        let bad = svc(
            json!({"metadata": {"namespace": "Prod", "name": "web"}, "spec": {"ports": [{"port": 80}]}}),
        );
        assert_eq!(
            service(&bad, [], Loopback::Refuse),
            Err(Skipped::NotDnsLabel)
        );
    }

    #[test]
    fn an_endpoint_in_two_slices_is_kept_once_and_healthy_wins_and_the_annotation_marks_mtls() {
        let old = web_slice(
            "web-a",
            vec![endpoint(
                "10.1.0.1",
                "n1",
                json!({"ready": false, "serving": true, "terminating": true}),
            )],
        );
        let new = web_slice(
            "web-b",
            vec![endpoint("10.1.0.1", "n1", json!({"ready": true}))],
        );
        for order in [[&old, &new], [&new, &old]] {
            let s = service(&web(), order, Loopback::Refuse).unwrap().service;
            assert_eq!(
                show(&s),
                [
                    "10.1.0.1:8080>80 n1 web-10.1.0.1 Healthy",
                    "10.1.0.1:9091>9090 n1 web-10.1.0.1 Healthy"
                ]
            );
        }
        let mut marked = web();
        marked.metadata.annotations =
            Some([(MTLS_ANNOTATION.to_owned(), "true".to_owned())].into());
        assert!(
            service(&marked, [&new], Loopback::Refuse)
                .unwrap()
                .service
                .endpoints
                .iter()
                .all(|e| e.mtls)
        );
    }

    #[test]
    fn endpoints_at_unusable_addresses_are_left_out_and_named_and_the_slice_stands() {
        let a = web_slice(
            "web-a",
            vec![
                endpoint("169.254.169.254", "n1", json!({})),
                endpoint("10.1.0.1", "n1", json!({})),
                endpoint("224.0.0.1", "n1", json!({})),
                endpoint("127.0.0.1", "n1", json!({})),
                endpoint("0.0.0.0", "n1", json!({})),
                // Left out for its conditions first: not reported.
                endpoint("169.254.0.9", "n1", json!({"ready": false})),
            ],
        );
        let six = slice(json!({
            "metadata": {"namespace": "prod", "name": "web-6", "labels": {SERVICE_NAME_LABEL: "web"}},
            "addressType": "IPv6",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": ["fe80::1"]}, {"addresses": ["fd00::1"]}],
        }));
        let c = service(&web(), [&a, &six], Loopback::Refuse).unwrap();
        assert_eq!(
            show(&c.service),
            [
                "10.1.0.1:8080>80 n1 web-10.1.0.1 Healthy",
                "10.1.0.1:9091>9090 n1 web-10.1.0.1 Healthy",
                "fd00::1:8080>80   Healthy",
            ]
        );
        let refused: Vec<String> = c.refused.iter().map(ToString::to_string).collect();
        assert_eq!(
            refused,
            [
                "endpointslice prod/web-a endpoints[0].addresses[0]: 169.254.169.254 is link-local",
                "endpointslice prod/web-a endpoints[2].addresses[0]: 224.0.0.1 is multicast",
                "endpointslice prod/web-a endpoints[3].addresses[0]: 127.0.0.1 is loopback (allowed only with --allow-loopback-endpoints)",
                "endpointslice prod/web-a endpoints[4].addresses[0]: 0.0.0.0 is unspecified",
                "endpointslice prod/web-6 endpoints[0].addresses[0]: fe80::1 is link-local",
            ],
            "each once, though the slice has two TCP ports"
        );
        let allowed = service(&web(), [&a], Loopback::Allow).unwrap();
        assert!(
            allowed
                .service
                .endpoints
                .iter()
                .any(|e| e.address.is_loopback())
        );
        assert_eq!(allowed.refused.len(), 3);
        // A VIP no service may have is dropped and named; the endpoints stand.
        let mut odd = web();
        odd.spec.as_mut().unwrap().cluster_ip = Some("169.254.1.1".into());
        let c = service(&odd, [&a], Loopback::Refuse).unwrap();
        assert_eq!(c.service.vip, None);
        assert_eq!(
            c.refused[0].to_string(),
            "service prod/web spec.clusterIP: 169.254.1.1 is link-local"
        );
    }
}
