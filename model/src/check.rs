//! The checks a registry entry passes before it is stored or built into the proxy's
//! configuration, shared by both ends of the registry API: the registrar refuses what
//! fails them (apply) or leaves it out (discovery), and the agent drops what a registrar
//! sends that fails them. Pure; each error names the field and the value at fault.
//!
//! An endpoint or VIP address may not be unspecified (`0.0.0.0`, `::`), multicast,
//! broadcast or link-local (`169.254.0.0/16`, the cloud metadata address
//! `169.254.169.254` among them, and `fe80::/10`): none is a pod's or a service's, and a
//! proxy sent there would reach the node itself, every host of a segment, or the cloud's
//! metadata service. An IPv4-mapped IPv6 address is judged as its IPv4 address. Loopback
//! is a caller's choice ([`Loopback`]): the agent's own registry file and tests register
//! loopback upstreams, a cluster's registry never should.

use std::net::IpAddr;

use crate::registry_file::is_dns_label;
use crate::{Endpoint, ServiceKey};

/// A value that fails a check: `{field}: {message}`, as `services[3].endpoints[1].address:
/// 169.254.169.254 is link-local`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

impl Invalid {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Whether a loopback address (`127.0.0.0/8`, `::1`) is accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loopback {
    Allow,
    Refuse,
}

/// Why `a` may not be an endpoint's or a VIP's address; None when it may.
pub fn address_problem(a: IpAddr, loopback: Loopback) -> Option<&'static str> {
    let a = a.to_canonical();
    let problem = match a {
        IpAddr::V4(v4) if v4.is_unspecified() => "unspecified",
        IpAddr::V4(v4) if v4.is_link_local() => "link-local",
        IpAddr::V4(v4) if v4.is_multicast() => "multicast",
        IpAddr::V4(v4) if v4.is_broadcast() => "broadcast",
        IpAddr::V6(v6) if v6.is_unspecified() => "unspecified",
        IpAddr::V6(v6) if v6.is_unicast_link_local() => "link-local",
        IpAddr::V6(v6) if v6.is_multicast() => "multicast",
        a if a.is_loopback() && loopback == Loopback::Refuse => "loopback",
        _ => return None,
    };
    Some(problem)
}

/// An endpoint's or VIP's address, checked as the module header says.
pub fn address(field: &str, a: IpAddr, loopback: Loopback) -> Result<(), Invalid> {
    match address_problem(a, loopback) {
        None => Ok(()),
        Some("loopback") => Err(Invalid::new(
            field,
            format!("{a} is loopback (allowed only with --allow-loopback-endpoints)"),
        )),
        Some(problem) => Err(Invalid::new(field, format!("{a} is {problem}"))),
    }
}

/// A service key: namespace and name are DNS labels.
pub fn key(field: &str, k: &ServiceKey) -> Result<(), Invalid> {
    for (what, v) in [("namespace", &k.namespace), ("name", &k.name)] {
        if !is_dns_label(v) {
            return Err(Invalid::new(
                format!("{field}.{what}"),
                format!("{v:?} is not a DNS label"),
            ));
        }
    }
    Ok(())
}

/// A service's own fields: at least one port, none 0, none twice; a VIP, if any, that is
/// a usable address.
pub fn service_fields(
    field: &str,
    ports: &[u16],
    vip: Option<IpAddr>,
    loopback: Loopback,
) -> Result<(), Invalid> {
    if ports.is_empty() {
        return Err(Invalid::new(format!("{field}.ports"), "empty"));
    }
    for (k, p) in ports.iter().enumerate() {
        if *p == 0 {
            return Err(Invalid::new(format!("{field}.ports[{k}]"), "0"));
        }
        if ports[..k].contains(p) {
            return Err(Invalid::new(
                format!("{field}.ports[{k}]"),
                format!("{p} is listed twice"),
            ));
        }
    }
    if let Some(vip) = vip {
        address(&format!("{field}.vip"), vip, loopback)?;
    }
    Ok(())
}

/// One endpoint on its own: a usable address, a port and a service port that are not 0.
/// Whether the service port is one of the service's is the caller's to check, since an
/// endpoint may arrive before its service.
pub fn endpoint(field: &str, e: &Endpoint, loopback: Loopback) -> Result<(), Invalid> {
    address(&format!("{field}.address"), e.address, loopback)?;
    if e.port == 0 {
        return Err(Invalid::new(format!("{field}.port"), "0"));
    }
    if e.service_port == 0 {
        return Err(Invalid::new(format!("{field}.service_port"), "0"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EndpointState;

    fn check_address(a: &str, loopback: Loopback, want: Result<(), &str>) {
        let got = address("a", a.parse().unwrap(), loopback).map_err(|e| e.to_string());
        assert_eq!(got, want.map_err(String::from), "{a} ({loopback:?})");
    }

    #[test]
    fn addresses_that_no_pod_or_service_has_are_refused_and_named() {
        use Loopback::*;
        for (a, want) in [
            ("10.1.0.1", Ok(())),
            ("fd00::1", Ok(())),
            ("2001:db8::1", Ok(())),
            ("169.254.169.254", Err("a: 169.254.169.254 is link-local")),
            ("169.254.0.1", Err("a: 169.254.0.1 is link-local")),
            ("fe80::1", Err("a: fe80::1 is link-local")),
            ("febf::1", Err("a: febf::1 is link-local")),
            (
                "::ffff:169.254.169.254",
                Err("a: ::ffff:169.254.169.254 is link-local"),
            ),
            ("224.0.0.1", Err("a: 224.0.0.1 is multicast")),
            ("239.255.255.250", Err("a: 239.255.255.250 is multicast")),
            ("ff02::1", Err("a: ff02::1 is multicast")),
            ("0.0.0.0", Err("a: 0.0.0.0 is unspecified")),
            ("::", Err("a: :: is unspecified")),
            ("255.255.255.255", Err("a: 255.255.255.255 is broadcast")),
        ] {
            check_address(a, Refuse, want);
            check_address(a, Allow, want);
        }
        for a in ["127.0.0.1", "127.252.1.2", "::1", "::ffff:127.0.0.1"] {
            check_address(a, Allow, Ok(()));
            let e = address("x", a.parse().unwrap(), Refuse)
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!("x: {a} is loopback (allowed only with --allow-loopback-endpoints)")
            );
        }
        // Next to link-local, not in it.
        check_address("169.253.255.255", Refuse, Ok(()));
        check_address("fec0::1", Refuse, Ok(()));
    }

    #[test]
    fn keys_ports_vips_and_endpoints_name_the_field_at_fault() {
        let k = |ns: &str, n: &str| ServiceKey {
            namespace: ns.into(),
            name: n.into(),
        };
        assert_eq!(key("s", &k("prod", "web")), Ok(()));
        assert_eq!(
            key("s", &k("prod", "Web")).unwrap_err().to_string(),
            "s.name: \"Web\" is not a DNS label"
        );
        assert_eq!(
            key("s", &k("", "web")).unwrap_err().to_string(),
            "s.namespace: \"\" is not a DNS label"
        );
        let vip = |v: &str| Some(v.parse().unwrap());
        let fields = |ports: &[u16], v| {
            service_fields("s", ports, v, Loopback::Refuse).map_err(|e| e.to_string())
        };
        assert_eq!(fields(&[80, 443], vip("10.96.0.1")), Ok(()));
        assert_eq!(fields(&[], None), Err("s.ports: empty".into()));
        assert_eq!(fields(&[80, 0], None), Err("s.ports[1]: 0".into()));
        assert_eq!(
            fields(&[80, 80], None),
            Err("s.ports[1]: 80 is listed twice".into())
        );
        assert_eq!(
            fields(&[80], vip("224.0.0.9")),
            Err("s.vip: 224.0.0.9 is multicast".into())
        );
        let ep = |a: &str, port, service_port| Endpoint {
            address: a.parse().unwrap(),
            port,
            service_port,
            node: String::new(),
            pod: String::new(),
            state: EndpointState::Healthy,
            mtls: false,
        };
        let e = |e: &Endpoint, l| endpoint("e", e, l).map_err(|e| e.to_string());
        assert_eq!(e(&ep("10.0.0.1", 8080, 80), Loopback::Refuse), Ok(()));
        assert_eq!(e(&ep("127.0.0.1", 8080, 80), Loopback::Allow), Ok(()));
        assert_eq!(
            e(&ep("fe80::2", 8080, 80), Loopback::Allow),
            Err("e.address: fe80::2 is link-local".into())
        );
        assert_eq!(
            e(&ep("10.0.0.1", 0, 80), Loopback::Refuse),
            Err("e.port: 0".into())
        );
        assert_eq!(
            e(&ep("10.0.0.1", 8080, 0), Loopback::Refuse),
            Err("e.service_port: 0".into())
        );
    }
}
