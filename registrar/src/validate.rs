//! Checks of the API's requests before anything is written, each error naming the field
//! and value at fault (`services[2].endpoints[0].port: 0`), as INVALID_ARGUMENT says it.
//! Addresses are checked by the model's [`check`], the same function the agents use on
//! what they receive.

use std::collections::HashSet;
use std::net::IpAddr;

use aether_model::check::{self, Loopback};
use aether_model::{Endpoint, Service, ServiceKey};
use shared_proto::registry as pb;

use crate::values;

pub use aether_model::check::Invalid;

fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    Invalid::new(field, message)
}

/// A service key: namespace and name are DNS labels.
pub fn service_key(field: &str, k: Option<&pb::ServiceKey>) -> Result<ServiceKey, Invalid> {
    let k = values::key_from_pb(k.ok_or_else(|| invalid(field, "missing"))?);
    check::key(field, &k)?;
    Ok(k)
}

/// An IP in any spelling; keys use its canonical one.
pub fn address(field: &str, a: &str) -> Result<IpAddr, Invalid> {
    a.parse()
        .map_err(|_| invalid(field, format!("{a:?} is not an IP address")))
}

/// An IP that an endpoint or a VIP may have: not link-local, multicast, broadcast or
/// unspecified, and loopback only when `loopback` allows it.
pub fn usable_address(field: &str, a: &str, loopback: Loopback) -> Result<IpAddr, Invalid> {
    let ip = address(field, a)?;
    check::address(field, ip, loopback)?;
    Ok(ip)
}

fn port(field: &str, p: u32) -> Result<u16, Invalid> {
    match u16::try_from(p) {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(invalid(field, p.to_string())),
    }
}

/// The services of an ApplyServices request, checked as the registry file's are: DNS
/// labels, ports 1..=65535 without repeats, a VIP that is an IP, endpoints whose
/// `service_port` is a port of the service (0 means the only one), no endpoint twice,
/// no service twice; endpoint addresses and VIPs that [`usable_address`] accepts.
pub fn apply_request(
    req: &pb::ApplyServicesRequest,
    loopback: Loopback,
) -> Result<Vec<Service>, Invalid> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(req.services.len());
    for (i, s) in req.services.iter().enumerate() {
        let at = format!("services[{i}]");
        let key = service_key(&format!("{at}.key"), s.key.as_ref())?;
        if !seen.insert(key.clone()) {
            return Err(invalid(&at, format!("{key} is listed twice")));
        }
        if s.ports.is_empty() {
            return Err(invalid(format!("{at}.ports"), "empty"));
        }
        let mut ports = Vec::with_capacity(s.ports.len());
        for (k, p) in s.ports.iter().enumerate() {
            let p = port(&format!("{at}.ports[{k}]"), *p)?;
            if ports.contains(&p) {
                return Err(invalid(
                    format!("{at}.ports[{k}]"),
                    format!("{p} is listed twice"),
                ));
            }
            ports.push(p);
        }
        let vip = if s.vip.is_empty() {
            None
        } else {
            Some(usable_address(&format!("{at}.vip"), &s.vip, loopback)?)
        };
        let mut endpoints = Vec::with_capacity(s.endpoints.len());
        let mut at_ports = HashSet::new();
        for (j, e) in s.endpoints.iter().enumerate() {
            let eat = format!("{at}.endpoints[{j}]");
            let addr = usable_address(&format!("{eat}.address"), &e.address, loopback)?;
            let p = port(&format!("{eat}.port"), e.port)?;
            if !at_ports.insert((addr, p)) {
                return Err(invalid(&eat, format!("{addr} port {p} is listed twice")));
            }
            let service_port = match (e.service_port, ports.as_slice()) {
                (0, [only]) => *only,
                (0, _) => {
                    return Err(invalid(
                        format!("{eat}.service_port"),
                        "0, but the service has several ports",
                    ));
                }
                (sp, _) => match u16::try_from(sp) {
                    Ok(sp) if ports.contains(&sp) => sp,
                    _ => {
                        return Err(invalid(
                            format!("{eat}.service_port"),
                            format!("{sp} is not a port of the service"),
                        ));
                    }
                },
            };
            let state = values::state_from_pb(e.state).ok_or_else(|| {
                invalid(
                    format!("{eat}.state"),
                    format!("{} is not a state", e.state),
                )
            })?;
            endpoints.push(Endpoint {
                address: addr,
                port: p,
                service_port,
                node: e.node.clone(),
                pod: e.pod.clone(),
                state,
                mtls: e.mtls,
            });
        }
        out.push(Service {
            name: key.name,
            namespace: key.namespace,
            ports,
            vip,
            endpoints,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(ns: &str, name: &str, ports: &[u32], eps: Vec<pb::Endpoint>) -> pb::Service {
        pb::Service {
            key: Some(pb::ServiceKey {
                namespace: ns.into(),
                name: name.into(),
            }),
            ports: ports.to_vec(),
            vip: String::new(),
            endpoints: eps,
        }
    }

    fn ep(address: &str, port: u32, service_port: u32) -> pb::Endpoint {
        pb::Endpoint {
            address: address.into(),
            port,
            service_port,
            node: "n".into(),
            pod: String::new(),
            state: 0,
            mtls: false,
        }
    }

    fn check(services: Vec<pb::Service>, want: Result<&str, &str>) {
        let got = apply_request(&pb::ApplyServicesRequest { services }, Loopback::Refuse);
        match (got, want) {
            (Ok(s), Ok(w)) => {
                let text: Vec<String> = s
                    .iter()
                    .map(|s| {
                        let eps: Vec<String> = s
                            .endpoints
                            .iter()
                            .map(|e| format!("{}:{}@{}", e.address, e.port, e.service_port))
                            .collect();
                        format!(
                            "{}/{} {:?} [{}]",
                            s.namespace,
                            s.name,
                            s.ports,
                            eps.join(" ")
                        )
                    })
                    .collect();
                assert_eq!(text.join("; "), w);
            }
            (Err(e), Err(w)) => assert_eq!(e.to_string(), w),
            (got, w) => panic!("got {got:?}, want {w:?}"),
        }
    }

    #[test]
    fn good_services_pass_and_a_zero_service_port_means_the_only_port() {
        check(
            vec![svc(
                "d",
                "web",
                &[80],
                vec![ep("10.0.0.1", 8080, 0), ep("fd00::1", 8080, 80)],
            )],
            Ok("d/web [80] [10.0.0.1:8080@80 fd00::1:8080@80]"),
        );
        check(vec![], Ok(""));
    }

    #[test]
    fn the_mtls_mark_is_read_from_the_request() {
        let marked = pb::Endpoint {
            mtls: true,
            ..ep("10.0.0.1", 8080, 80)
        };
        let got = apply_request(
            &pb::ApplyServicesRequest {
                services: vec![svc(
                    "d",
                    "web",
                    &[80],
                    vec![marked, ep("10.0.0.2", 8080, 80)],
                )],
            },
            Loopback::Refuse,
        )
        .unwrap();
        let marks: Vec<(String, bool)> = got[0]
            .endpoints
            .iter()
            .map(|e| (e.address.to_string(), e.mtls))
            .collect();
        assert_eq!(
            marks,
            [
                ("10.0.0.1".to_owned(), true),
                ("10.0.0.2".to_owned(), false)
            ]
        );
    }

    #[test]
    fn errors_name_the_field_and_the_value() {
        let mut no_key = svc("d", "web", &[80], vec![]);
        no_key.key = None;
        let mut bad_vip = svc("d", "web", &[80], vec![]);
        bad_vip.vip = "10.96.0".into();
        let mut bad_state = ep("10.0.0.1", 1, 80);
        bad_state.state = 9;
        for (services, want) in [
            (
                vec![
                    svc("d", "a", &[80], vec![]),
                    svc("d", "b", &[80], vec![]),
                    svc("d", "c", &[80], vec![ep("10.0.0.1", 0, 80)]),
                ],
                "services[2].endpoints[0].port: 0",
            ),
            (vec![no_key], "services[0].key: missing"),
            (
                vec![svc("D", "web", &[80], vec![])],
                "services[0].key.namespace: \"D\" is not a DNS label",
            ),
            (
                vec![svc("d", "web", &[], vec![])],
                "services[0].ports: empty",
            ),
            (
                vec![svc("d", "web", &[80, 70000], vec![])],
                "services[0].ports[1]: 70000",
            ),
            (
                vec![svc("d", "web", &[80, 80], vec![])],
                "services[0].ports[1]: 80 is listed twice",
            ),
            (
                vec![bad_vip],
                "services[0].vip: \"10.96.0\" is not an IP address",
            ),
            (
                vec![svc("d", "web", &[80], vec![ep("10.0.0.x", 1, 80)])],
                "services[0].endpoints[0].address: \"10.0.0.x\" is not an IP address",
            ),
            (
                vec![svc("d", "web", &[80, 81], vec![ep("10.0.0.1", 1, 0)])],
                "services[0].endpoints[0].service_port: 0, but the service has several ports",
            ),
            (
                vec![svc("d", "web", &[80], vec![ep("10.0.0.1", 1, 90)])],
                "services[0].endpoints[0].service_port: 90 is not a port of the service",
            ),
            (
                vec![svc(
                    "d",
                    "web",
                    &[80],
                    vec![ep("10.0.0.1", 1, 80), ep("10.0.0.1", 1, 80)],
                )],
                "services[0].endpoints[1]: 10.0.0.1 port 1 is listed twice",
            ),
            (
                vec![svc("d", "web", &[80], vec![bad_state])],
                "services[0].endpoints[0].state: 9 is not a state",
            ),
            (
                vec![
                    svc("d", "web", &[80], vec![]),
                    svc("d", "web", &[81], vec![]),
                ],
                "services[1]: d/web is listed twice",
            ),
        ] {
            check(services, Err(want));
        }
    }

    #[test]
    fn unusable_addresses_are_refused_naming_the_field_and_loopback_only_when_allowed() {
        let eps = |a: &[&str]| a.iter().map(|a| ep(a, 8080, 80)).collect::<Vec<_>>();
        let mut vip = svc("d", "web", &[80], vec![]);
        vip.vip = "169.254.169.254".into();
        for (services, want) in [
            (
                vec![
                    svc("d", "a", &[80], vec![]),
                    svc("d", "b", &[80], vec![]),
                    svc("d", "c", &[80], vec![]),
                    svc("d", "web", &[80], eps(&["10.0.0.1", "169.254.169.254"])),
                ],
                "services[3].endpoints[1].address: 169.254.169.254 is link-local",
            ),
            (
                vec![svc("d", "web", &[80], eps(&["fe80::1"]))],
                "services[0].endpoints[0].address: fe80::1 is link-local",
            ),
            (
                vec![svc("d", "web", &[80], eps(&["224.0.0.251"]))],
                "services[0].endpoints[0].address: 224.0.0.251 is multicast",
            ),
            (
                vec![svc("d", "web", &[80], eps(&["::"]))],
                "services[0].endpoints[0].address: :: is unspecified",
            ),
            (
                vec![svc("d", "web", &[80], eps(&["0.0.0.0"]))],
                "services[0].endpoints[0].address: 0.0.0.0 is unspecified",
            ),
            (vec![vip], "services[0].vip: 169.254.169.254 is link-local"),
            (
                vec![svc("d", "web", &[80], eps(&["127.0.0.1"]))],
                "services[0].endpoints[0].address: 127.0.0.1 is loopback (allowed only with --allow-loopback-endpoints)",
            ),
        ] {
            check(services, Err(want));
        }
        let loopback = pb::ApplyServicesRequest {
            services: vec![svc("d", "web", &[80], eps(&["127.0.0.1", "::1"]))],
        };
        assert_eq!(
            apply_request(&loopback, Loopback::Allow).unwrap()[0]
                .endpoints
                .len(),
            2
        );
        let link_local = pb::ApplyServicesRequest {
            services: vec![svc("d", "web", &[80], eps(&["169.254.169.254"]))],
        };
        assert!(
            apply_request(&link_local, Loopback::Allow).is_err(),
            "the flag allows loopback only"
        );
    }
}
