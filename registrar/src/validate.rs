//! Checks of the API's requests before anything is written, each error naming the field
//! and value at fault (`services[2].endpoints[0].port: 0`), as INVALID_ARGUMENT says it.
//! Addresses are checked by the model's [`check`], the same function the agents use on
//! what they receive.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use aether_model::check::{self, Loopback};
use aether_model::registry_file::is_dns_label;
use aether_model::{Endpoint, Service, ServiceKey};
use shared_proto::registry as pb;

use crate::keys::is_dns_subdomain;
use crate::values::{self, PairValue, PairsValue};

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

/// The largest QUIC pair a node may advertise, as its protobuf encoding: room for a long
/// SNI and pod name, and a bound on the value a node's set makes in etcd
/// (`--quic-pairs-per-node` of these).
pub const QUIC_PAIR_BYTES_MAX: usize = 512;

/// A node's name, as a request names it and a `quic-pairs/<node>` key holds it: a DNS
/// subdomain, as Kubernetes names nodes.
pub fn node(field: &str, n: &str) -> Result<(), Invalid> {
    if n.is_empty() {
        return Err(invalid(field, "empty; the caller's node is required"));
    }
    if !is_dns_subdomain(n) {
        return Err(invalid(
            field,
            format!("{n:?} is not a DNS subdomain (a node's name)"),
        ));
    }
    Ok(())
}

/// Why a SetQuicPairs request was refused before anything was read.
#[derive(Debug, thiserror::Error)]
pub enum PairsRefused {
    #[error(
        "pairs: {count} pairs, more than the {max} a node may advertise (--quic-pairs-per-node)"
    )]
    TooMany { count: usize, max: usize },
    #[error("pairs[{index}]: {bytes} bytes, more than the {max} one pair may take")]
    TooLarge {
        index: usize,
        bytes: usize,
        max: usize,
    },
    #[error(transparent)]
    Invalid(#[from] Invalid),
}

impl PairsRefused {
    /// The refusal's reason in the refusals metric.
    pub fn reason(&self) -> &'static str {
        match self {
            PairsRefused::TooMany { .. } => "quic_pairs_per_node",
            PairsRefused::TooLarge { .. } => "quic_pair_bytes",
            PairsRefused::Invalid(_) => "quic_pairs_invalid",
        }
    }
}

/// `HOST:PORT` where HOST is an IP (`[IPv6]` bracketed) or a DNS name, port 1..=65535.
fn host_port(field: &str, s: &str) -> Result<(), Invalid> {
    let bad = |why: &str| invalid(field, format!("{s:?} is not HOST:PORT: {why}"));
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return match sa.port() {
            0 => Err(bad("port 0; ports are 1..=65535")),
            _ => Ok(()),
        };
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(bad("no port"));
    };
    match port.parse::<u16>() {
        Ok(p) if p != 0 && p.to_string() == port => {}
        _ => return Err(bad("the port is not 1..=65535")),
    }
    if host.parse::<IpAddr>().is_ok() {
        return Err(bad("an IPv6 address goes in brackets, as [fd00::1]:443"));
    }
    if !is_dns_subdomain(host) {
        return Err(bad("the host is neither an IP address nor a DNS name"));
    }
    Ok(())
}

/// A SetQuicPairs request's pairs, as the set stored for the node: at most `max` pairs,
/// each at most [`QUIC_PAIR_BYTES_MAX`] bytes; `tcp` an endpoint's `IP:PORT` (an address
/// [`usable_address`] accepts, port 1..=65535), never twice; `quic` `HOST:PORT`;
/// `quic_sni` a DNS name or empty (SNI carries no IP address); `pod` `namespace/name`;
/// `since` not negative.
pub fn quic_pairs(
    pairs: &[pb::QuicPair],
    max: usize,
    loopback: Loopback,
) -> Result<PairsValue, PairsRefused> {
    use prost::Message;
    if pairs.len() > max {
        return Err(PairsRefused::TooMany {
            count: pairs.len(),
            max,
        });
    }
    let mut seen: HashMap<SocketAddr, usize> = HashMap::with_capacity(pairs.len());
    let mut out = Vec::with_capacity(pairs.len());
    for (i, p) in pairs.iter().enumerate() {
        let at = format!("pairs[{i}]");
        let bytes = p.encoded_len();
        if bytes > QUIC_PAIR_BYTES_MAX {
            return Err(PairsRefused::TooLarge {
                index: i,
                bytes,
                max: QUIC_PAIR_BYTES_MAX,
            });
        }
        let field = format!("{at}.tcp");
        let tcp: SocketAddr = p.tcp.parse().map_err(|_| {
            invalid(
                &field,
                format!("{:?} is not IP:PORT ([IPv6]:PORT for IPv6)", p.tcp),
            )
        })?;
        if tcp.port() == 0 {
            return Err(
                invalid(&field, format!("{:?}: port 0; ports are 1..=65535", p.tcp)).into(),
            );
        }
        check::address(&field, tcp.ip(), loopback)?;
        if let Some(first) = seen.insert(tcp, i) {
            return Err(invalid(
                &field,
                format!("{tcp} is listed twice (pairs[{first}].tcp too)"),
            )
            .into());
        }
        if p.quic.is_empty() {
            return Err(invalid(
                format!("{at}.quic"),
                "empty; a pair names where its twin is reached",
            )
            .into());
        }
        host_port(&format!("{at}.quic"), &p.quic)?;
        if !p.quic_sni.is_empty() {
            let field = format!("{at}.quic_sni");
            if p.quic_sni.parse::<IpAddr>().is_ok() {
                return Err(invalid(
                    field,
                    format!("{:?} is an IP address; SNI carries a DNS name", p.quic_sni),
                )
                .into());
            }
            if !is_dns_subdomain(&p.quic_sni) {
                return Err(invalid(field, format!("{:?} is not a DNS name", p.quic_sni)).into());
            }
        }
        let pod_ok = p
            .pod
            .split_once('/')
            .is_some_and(|(ns, name)| is_dns_label(ns) && is_dns_subdomain(name));
        if !pod_ok {
            return Err(invalid(
                format!("{at}.pod"),
                format!("{:?} is not namespace/name", p.pod),
            )
            .into());
        }
        if p.since < 0 {
            return Err(invalid(
                format!("{at}.since"),
                format!("{} is before the epoch", p.since),
            )
            .into());
        }
        out.push(PairValue {
            tcp,
            quic: p.quic.clone(),
            quic_sni: p.quic_sni.clone(),
            pod: p.pod.clone(),
            since: p.since,
        });
    }
    Ok(PairsValue::new(out))
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
            quic: String::new(),
            quic_sni: String::new(),
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

    fn qp(tcp: &str, quic: &str, sni: &str, pod: &str) -> pb::QuicPair {
        pb::QuicPair {
            tcp: tcp.into(),
            quic: quic.into(),
            quic_sni: sni.into(),
            pod: pod.into(),
            since: 7,
        }
    }

    /// One check per rule: the pairs, then the error (the field and value it names) or
    /// the stored set's `tcp`s.
    fn check_pairs(pairs: Vec<pb::QuicPair>, want: Result<&str, &str>) {
        let got = quic_pairs(&pairs, 3, Loopback::Refuse);
        match (got, want) {
            (Ok(v), Ok(tcps)) => {
                let got: Vec<String> = v.pairs.iter().map(|p| p.tcp.to_string()).collect();
                assert_eq!(got.join(" "), tcps);
            }
            (Err(e), Err(needle)) => {
                assert!(e.to_string().contains(needle), "{e}\n lacks {needle}")
            }
            (got, want) => panic!("{pairs:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn quic_pairs_are_checked_and_each_error_names_the_value() {
        let ok = |tcp: &str| qp(tcp, "n1.example:4443", "web.prod.example", "prod/web-1");
        // Sorted by address, IPv6 canonical.
        check_pairs(
            vec![
                ok("10.0.0.2:80"),
                ok("[fd00:0::1]:443"),
                ok("10.0.0.1:8080"),
            ],
            Ok("10.0.0.1:8080 10.0.0.2:80 [fd00::1]:443"),
        );
        check_pairs(vec![], Ok(""));
        check_pairs(
            vec![qp("10.0.0.1:80", "[fd00::1]:443", "", "a/b")],
            Ok("10.0.0.1:80"),
        );
        check_pairs(
            vec![qp("10.0.0.1:80", "192.0.2.1:443", "", "a/b.c")],
            Ok("10.0.0.1:80"),
        );
        for (pair, needle) in [
            (ok("10.0.0.1"), r#"pairs[0].tcp: "10.0.0.1" is not IP:PORT"#),
            (
                ok("fd00::1:80"),
                r#"pairs[0].tcp: "fd00::1:80" is not IP:PORT"#,
            ),
            (ok("10.0.0.1:0"), "pairs[0].tcp: \"10.0.0.1:0\": port 0"),
            (
                ok("10.0.0.1:65536"),
                "pairs[0].tcp: \"10.0.0.1:65536\" is not IP:PORT",
            ),
            (ok("127.0.0.1:80"), "pairs[0].tcp: 127.0.0.1 is loopback"),
            (
                ok("169.254.0.1:80"),
                "pairs[0].tcp: 169.254.0.1 is link-local",
            ),
            (qp("10.0.0.1:80", "", "", "a/b"), "pairs[0].quic: empty"),
            (
                qp("10.0.0.1:80", "n1.example", "", "a/b"),
                r#"pairs[0].quic: "n1.example" is not HOST:PORT: no port"#,
            ),
            (
                qp("10.0.0.1:80", "n1.example:0", "", "a/b"),
                "the port is not 1..=65535",
            ),
            (qp("10.0.0.1:80", "fd00::1:443", "", "a/b"), "in brackets"),
            (
                qp("10.0.0.1:80", "N1_x:443", "", "a/b"),
                r#""N1_x:443" is not HOST:PORT: the host"#,
            ),
            (
                qp("10.0.0.1:80", "h:443", "10.0.0.1", "a/b"),
                r#"pairs[0].quic_sni: "10.0.0.1" is an IP address"#,
            ),
            (
                qp("10.0.0.1:80", "h:443", "Web_1", "a/b"),
                r#"pairs[0].quic_sni: "Web_1" is not a DNS name"#,
            ),
            (
                qp("10.0.0.1:80", "h:443", "", "web-1"),
                r#"pairs[0].pod: "web-1" is not namespace/name"#,
            ),
            (
                qp("10.0.0.1:80", "h:443", "", "a.b/web"),
                r#"pairs[0].pod: "a.b/web""#,
            ),
            (
                qp("10.0.0.1:80", "h:443", "", "a/b/c"),
                r#"pairs[0].pod: "a/b/c""#,
            ),
            (
                pb::QuicPair {
                    since: -1,
                    ..ok("10.0.0.1:80")
                },
                "pairs[0].since: -1 is before the epoch",
            ),
            (
                qp("10.0.0.1:80", "h:443", &"a".repeat(254), "a/b"),
                "pairs[0].quic_sni",
            ),
        ] {
            check_pairs(vec![pair], Err(needle));
        }
        check_pairs(
            vec![ok("10.0.0.1:80"), ok("10.0.0.2:80"), ok("10.0.0.1:80")],
            Err("pairs[2].tcp: 10.0.0.1:80 is listed twice (pairs[0].tcp too)"),
        );
        check_pairs(
            (1..=4).map(|i| ok(&format!("10.0.0.{i}:80"))).collect(),
            Err("4 pairs, more than the 3 a node may advertise"),
        );
        let e = quic_pairs(
            &[qp("10.0.0.1:80", "h:443", &"a".repeat(600), "a/b")],
            3,
            Loopback::Refuse,
        )
        .unwrap_err();
        assert_eq!(e.reason(), "quic_pair_bytes", "{e}");
        assert!(
            e.to_string()
                .contains("more than the 512 one pair may take"),
            "{e}"
        );
        for (n, ok) in [
            ("node-a", true),
            ("node-a.example", true),
            ("", false),
            ("Node_A", false),
            ("a/b", false),
        ] {
            assert_eq!(node("node", n).is_ok(), ok, "{n:?}");
        }
    }
}
