use std::collections::BTreeSet;
use std::net::IpAddr;

use super::*;
use crate::{Endpoint, KINDS, Pod, QuicTwins, RegistryView, Svid};

fn svc(
    name: &str,
    ns: &str,
    ports: &[u16],
    vip: Option<&str>,
    eps: &[(&str, u16, u16, bool)],
) -> Service {
    Service {
        name: name.into(),
        namespace: ns.into(),
        ports: ports.to_vec(),
        vip: vip.map(|v| v.parse().unwrap()),
        endpoints: eps
            .iter()
            .map(|(a, p, sp, draining)| Endpoint {
                address: a.parse().unwrap(),
                port: *p,
                service_port: *sp,
                node: "n1".into(),
                pod: "p".into(),
                state: if *draining {
                    EndpointState::Draining
                } else {
                    EndpointState::Healthy
                },
                mtls: false,
            })
            .collect(),
    }
}

fn pod(uid: &str, ips: &[&str]) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "default".into(),
        name: format!("pod-{uid}"),
        container_id: "c".into(),
        netns: "/proc/1/ns/net".into(),
        ifname: "eth0".into(),
        ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
        terminating: false,
        no_quic_twin: false,
    }
}

fn terminating(mut p: Pod) -> Pod {
    p.terminating = true;
    p
}

fn inputs(services: Vec<Service>, pods: Vec<Pod>) -> Inputs {
    Inputs {
        pods: pods.into_iter().map(|p| (p.uid.clone(), p)).collect(),
        registry: RegistryView::new(services),
        capture: CaptureProjection::default(),
        on_demand_clusters: false,
        inbound_access_log: None,
        identity: Identity::default(),
        quic_twins: None,
    }
}

fn svid(id: &str, serial: &str) -> Svid {
    Svid {
        spiffe_id: format!("spiffe://td/{id}"),
        chain_pem: format!("CHAIN {id} {serial}"),
        key_pem: format!("KEY {id} {serial}"),
        serial: serial.into(),
        not_before: 0,
        not_after: 100,
    }
}

fn identity(mode: MtlsMode) -> Identity {
    Identity {
        trust_domain: Some("td".into()),
        mode,
        bundle: Some("CA".into()),
        agent: Some(svid("agent", "a1")),
        pods: Default::default(),
    }
}

/// A compact, readable rendering of a snapshot: one line per resource fact.
fn render(s: &Snapshot) -> String {
    let mut out = Vec::new();
    for l in s.listeners.items.values() {
        match &l.kind {
            ListenerKind::HttpOutbound {
                route_config,
                on_demand,
                source_certificates,
                pod_certificates,
                plaintext_sources,
            } => out.push(format!(
                "L {} {} rds={route_config}{}{}{}{}",
                l.name,
                l.address,
                if *on_demand { " on-demand" } else { "" },
                if *source_certificates {
                    " source-certificates"
                } else {
                    ""
                },
                pod_certificates
                    .iter()
                    .map(|(uid, ips)| {
                        let ips: Vec<_> = ips.iter().map(|i| i.to_string()).collect();
                        format!(" {uid}-from [{}]", ips.join(","))
                    })
                    .collect::<String>(),
                match plaintext_sources.is_empty() {
                    true => String::new(),
                    false => format!(
                        " plaintext-from [{}]",
                        plaintext_sources
                            .iter()
                            .map(|i| i.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                }
            )),
            ListenerKind::InboundCapture => out.push(format!("L {} {} capture", l.name, l.address)),
            ListenerKind::QuicTwins { twins } => {
                for t in twins {
                    out.push(format!(
                        "L {} {} twin {} sni={} mtls={} -> {}",
                        l.name, l.address, t.pod_uid, t.sni, t.certificate, t.cluster
                    ));
                }
            }
            ListenerKind::InboundPod { chain: c } => {
                let ips: Vec<_> = c.ips.iter().map(|i| i.to_string()).collect();
                let tls = match &c.tls {
                    Some(t) => format!(
                        " mtls={}{}",
                        t.certificate,
                        if t.plaintext { "+plaintext" } else { "" }
                    ),
                    None => String::new(),
                };
                out.push(format!(
                    "L {} {} chain {} [{}] -> {}{tls}",
                    l.name,
                    l.address,
                    c.pod_uid,
                    ips.join(","),
                    c.cluster
                ));
            }
        }
    }
    for r in s.routes.items.values() {
        for v in &r.virtual_hosts {
            out.push(format!(
                "R {} vh {} [{}]",
                r.name,
                v.name,
                v.domains.join(",")
            ));
            for rt in &v.routes {
                out.push(format!(
                    "R {} vh {} {:?} -> {}",
                    r.name, v.name, rt.authority_port, rt.cluster
                ));
            }
        }
    }
    for c in s.clusters.items.values() {
        match &c.kind {
            ClusterKind::Eds => out.push(format!(
                "C {} eds{}",
                c.name,
                match &c.upstream_tls {
                    Some(t) if t.plaintext_without_certificate => {
                        " mtls, plaintext without a certificate".to_string()
                    }
                    Some(_) => " mtls".to_string(),
                    None => String::new(),
                }
            )),
            ClusterKind::Static {
                endpoints,
                draining,
            } => {
                let e: Vec<_> = endpoints.iter().map(|e| e.to_string()).collect();
                out.push(format!(
                    "C {} static [{}]{}",
                    c.name,
                    e.join(","),
                    if *draining { " DRAINING" } else { "" }
                ))
            }
        }
    }
    for a in s.endpoints.items.values() {
        let e: Vec<_> = a
            .endpoints
            .iter()
            .map(|e| {
                format!(
                    "{}{}{}",
                    e.address,
                    if e.draining { " DRAINING" } else { "" },
                    if e.mtls { " mtls" } else { "" }
                )
            })
            .collect();
        out.push(format!("E {} [{}]", a.cluster, e.join(",")));
    }
    for n in s.secrets.items.values() {
        out.push(format!("S {} {:?}", n.name, n.secret));
    }
    for r in &s.rejects {
        out.push(format!("! {r}"));
    }
    out.join("\n")
}

fn check(input: Inputs, expected: &str) {
    let got = render(&build(&input));
    let want: Vec<&str> = expected
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(got, want.join("\n"), "\n--- got ---\n{got}\n");
}

#[test]
fn empty_inputs_give_only_the_outbound_listener_and_route() {
    check(
        inputs(vec![], vec![]),
        "L outbound 127.0.0.1:15001 rds=outbound",
    );
}

#[test]
fn one_service_two_ports_with_vip_and_a_draining_endpoint() {
    check(
        inputs(
            vec![svc("web", "default", &[80, 8080], Some("10.96.0.10"), &[
                ("10.0.0.1", 8000, 80, false),
                ("10.0.0.2", 8000, 80, true),
                ("10.0.0.1", 9000, 8080, false),
            ])],
            vec![],
        ),
        "
        L outbound 127.0.0.1:15001 rds=outbound
        R outbound vh web.default [web,web.default,web.default.svc.cluster.local,web:80,web.default:80,web.default.svc.cluster.local:80,10.96.0.10:80,web:8080,web.default:8080,web.default.svc.cluster.local:8080,10.96.0.10:8080]
        R outbound vh web.default Some(8080) -> outbound|8080||web.default
        R outbound vh web.default None -> outbound|80||web.default
        C outbound|8080||web.default eds
        C outbound|80||web.default eds
        E outbound|8080||web.default [10.0.0.1:9000]
        E outbound|80||web.default [10.0.0.1:8000,10.0.0.2:8000 DRAINING]
        ",
    );
}

#[test]
fn short_name_in_two_namespaces_is_dropped_from_both() {
    check(
        inputs(
            vec![
                svc("api", "a", &[80], None, &[]),
                svc("api", "b", &[80], None, &[]),
            ],
            vec![],
        ),
        "
        L outbound 127.0.0.1:15001 rds=outbound
        R outbound vh api.a [api.a,api.a.svc.cluster.local,api.a:80,api.a.svc.cluster.local:80]
        R outbound vh api.a None -> outbound|80||api.a
        R outbound vh api.b [api.b,api.b.svc.cluster.local,api.b:80,api.b.svc.cluster.local:80]
        R outbound vh api.b None -> outbound|80||api.b
        C outbound|80||api.a eds
        C outbound|80||api.b eds
        E outbound|80||api.a []
        E outbound|80||api.b []
        ",
    );
}

#[test]
fn local_pods_get_inbound_chains_and_static_clusters() {
    check(
        inputs(
            vec![],
            vec![
                pod("u1", &["10.1.0.5"]),
                pod("u2", &["10.1.0.6", "fd00::6"]),
            ],
        ),
        "
        L inbound 0.0.0.0:15006 capture
        L inbound|u1 10.1.0.5:80 chain u1 [10.1.0.5] -> inbound|u1
        L inbound|u2 10.1.0.6:80 chain u2 [10.1.0.6,fd00::6] -> inbound|u2
        L outbound 127.0.0.1:15001 rds=outbound
        C inbound|u1 static [10.1.0.5:80]
        C inbound|u2 static [10.1.0.6:80,[fd00::6]:80]
        ",
    );
}

#[test]
fn a_terminating_pod_keeps_its_listener_and_its_endpoints_drain() {
    check(
        inputs(
            vec![],
            vec![
                terminating(pod("u1", &["10.1.0.5", "fd00::5"])),
                pod("u2", &["10.1.0.6"]),
            ],
        ),
        "
        L inbound 0.0.0.0:15006 capture
        L inbound|u1 10.1.0.5:80 chain u1 [10.1.0.5,fd00::5] -> inbound|u1
        L inbound|u2 10.1.0.6:80 chain u2 [10.1.0.6] -> inbound|u2
        L outbound 127.0.0.1:15001 rds=outbound
        C inbound|u1 static [10.1.0.5:80,[fd00::5]:80] DRAINING
        C inbound|u2 static [10.1.0.6:80]
        ",
    );
}

#[test]
fn marking_a_pod_terminating_changes_its_cluster_only_and_keeps_other_hashes() {
    let mut b = Builder::new(inputs(
        vec![],
        vec![pod("u1", &["10.1.0.5"]), pod("u2", &["10.1.0.6"])],
    ));
    let before = b.snapshot().clone();
    let s = b
        .apply([Change::UpsertPod(terminating(pod("u1", &["10.1.0.5"])))])
        .unwrap();
    let names = |k| {
        s.changed_since(&before, k)
            .unwrap()
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(Kind::Cluster), ["inbound|u1"]);
    assert!(
        names(Kind::Listener).is_empty()
            && names(Kind::Endpoint).is_empty()
            && names(Kind::Route).is_empty()
    );
    assert_eq!(
        s.hashes(Kind::Cluster).get("inbound|u2"),
        before.hashes(Kind::Cluster).get("inbound|u2")
    );
    assert!(
        s.holds_pod("u1", &["10.1.0.5".parse().unwrap()]),
        "a terminating pod is still served"
    );
    // Pinned: FNV-1a of `{"name":"inbound|u2","kind":{"Static":{"endpoints":["10.1.0.6:80"]}}}`,
    // the serialization before the flag existed. While false the flag stays out of the
    // hash, so versions match an agent that predates it and a roll onto this version
    // pushes nothing for such pods.
    assert_eq!(
        format!("{:016x}", before.hashes(Kind::Cluster)["inbound|u2"]),
        "f8bff699a9a6e002"
    );
}

#[test]
fn a_pod_ip_claimed_twice_is_served_for_neither() {
    check(
        inputs(
            vec![],
            vec![
                pod("u1", &["10.1.0.5"]),
                pod("u2", &["10.1.0.5", "10.1.0.7"]),
                pod("u3", &[]),
            ],
        ),
        "
        L inbound 0.0.0.0:15006 capture
        L inbound|u2 10.1.0.7:80 chain u2 [10.1.0.7] -> inbound|u2
        L outbound 127.0.0.1:15001 rds=outbound
        C inbound|u2 static [10.1.0.7:80]
        ! pod IP 10.1.0.5 is claimed by pods u1, u2; served for none of them
        ",
    );
}

#[test]
fn holds_pod_needs_chain_and_cluster_with_the_same_ips() {
    let s = build(&inputs(vec![], vec![pod("u1", &["10.1.0.5", "10.1.0.6"])]));
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    assert!(s.holds_pod("u1", &[ip("10.1.0.6"), ip("10.1.0.5")]));
    assert!(!s.holds_pod("u1", &[ip("10.1.0.5")]));
    assert!(!s.holds_pod("u2", &[ip("10.1.0.5")]));
    assert!(!s.holds_pod("u1", &[]));
    assert!(!build(&inputs(vec![], vec![])).holds_pod("u1", &[ip("10.1.0.5")]));
}

#[test]
fn versions_are_deterministic_and_change_only_for_the_changed_type() {
    let base = inputs(
        vec![svc(
            "web",
            "default",
            &[80],
            None,
            &[("10.0.0.1", 80, 80, false)],
        )],
        vec![],
    );
    let a = build(&base);
    assert_eq!(a, build(&base.clone()));
    // Pinned: a change here changes every version a running Envoy holds, so a rolled
    // agent would push a full update instead of a no-op. Change it deliberately.
    assert_eq!(
        [
            &a.listeners.version,
            &a.routes.version,
            &a.clusters.version,
            &a.endpoints.version
        ],
        [
            "ceae1dc10e4237f9",
            "758b7ccd96e733cb",
            "9915176c055220ce",
            "b204847993d13fe4"
        ]
    );

    let web = ServiceKey {
        namespace: "default".into(),
        name: "web".into(),
    };
    // Endpoint change: only EDS.
    let mut b_in = base.clone();
    b_in.registry.services.get_mut(&web).unwrap().endpoints[0].state = EndpointState::Draining;
    let b = build(&b_in);
    assert_eq!(
        (
            a.listeners.version == b.listeners.version,
            a.routes.version == b.routes.version
        ),
        (true, true)
    );
    assert_eq!(a.clusters.version, b.clusters.version);
    assert_ne!(a.endpoints.version, b.endpoints.version);

    // VIP: only RDS.
    let mut c_in = base.clone();
    c_in.registry.services.get_mut(&web).unwrap().vip = Some("10.96.0.1".parse().unwrap());
    let c = build(&c_in);
    assert_ne!(a.routes.version, c.routes.version);
    assert_eq!(
        (
            a.listeners.version.clone(),
            a.clusters.version.clone(),
            a.endpoints.version.clone()
        ),
        (c.listeners.version, c.clusters.version, c.endpoints.version)
    );

    // Pod: LDS and CDS, not RDS or EDS.
    let mut d_in = base.clone();
    d_in.pods.insert("u1".into(), pod("u1", &["10.1.0.5"]));
    let d = build(&d_in);
    assert_ne!(a.listeners.version, d.listeners.version);
    assert_ne!(a.clusters.version, d.clusters.version);
    assert_eq!(
        (a.routes.version.clone(), a.endpoints.version.clone()),
        (d.routes.version, d.endpoints.version)
    );

    // Capture port: LDS only.
    let mut e_in = base.clone();
    e_in.capture.outbound = "127.0.0.1:16001".parse().unwrap();
    let e = build(&e_in);
    assert_ne!(a.listeners.version, e.listeners.version);
    assert_eq!(
        (
            a.routes.version.clone(),
            a.clusters.version.clone(),
            a.endpoints.version.clone()
        ),
        (e.routes.version, e.clusters.version, e.endpoints.version)
    );
}

#[test]
fn an_endpoint_change_rebuilds_one_load_assignment_and_a_pod_its_listener_and_cluster() {
    let mut b = Builder::new(inputs(
        (0..50)
            .map(|i| {
                svc(
                    &format!("s{i}"),
                    "d",
                    &[80],
                    None,
                    &[("10.0.0.1", 80, 80, false)],
                )
            })
            .collect(),
        vec![pod("u1", &["10.1.0.1"])],
    ));
    let before = b.snapshot().clone();
    let s = b
        .apply([Change::UpsertService(svc(
            "s7",
            "d",
            &[80],
            None,
            &[("10.0.0.1", 80, 80, true)],
        ))])
        .unwrap();
    let names = |k| {
        s.changed_since(&before, k)
            .unwrap()
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(names(Kind::Endpoint), ["outbound|80||s7.d"]);
    assert!(
        names(Kind::Cluster).is_empty()
            && names(Kind::Route).is_empty()
            && names(Kind::Listener).is_empty()
    );

    let before = s;
    let s = b
        .apply([Change::UpsertPod(pod("u2", &["10.1.0.2"]))])
        .unwrap();
    let names = |k| {
        s.changed_since(&before, k)
            .unwrap()
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        (names(Kind::Listener), names(Kind::Cluster)),
        (
            vec!["inbound|u2".to_string()],
            vec!["inbound|u2".to_string()]
        )
    );
    assert!(names(Kind::Endpoint).is_empty() && names(Kind::Route).is_empty());

    assert!(
        b.apply([Change::UpsertPod(pod("u2", &["10.1.0.2"]))])
            .is_none(),
        "the same pod again changes nothing"
    );
    assert!(b.apply([Change::RemovePod("nobody".into())]).is_none());
}

#[test]
fn history_reaches_back_a_bounded_number_of_steps() {
    let mut b = Builder::new(Inputs::default());
    let first = b.snapshot().clone();
    for i in 0..crate::snapshot::HISTORY {
        b.apply([Change::UpsertPod(pod(
            &format!("u{i}"),
            &[&format!("10.1.{}.{}", i / 200, i % 200 + 1)],
        ))])
        .unwrap();
    }
    assert!(b.snapshot().changed_since(&first, Kind::Listener).is_some());
    b.apply([Change::RemovePod("u0".into())]).unwrap();
    assert!(
        b.snapshot().changed_since(&first, Kind::Listener).is_none(),
        "beyond the history: compare everything"
    );
    assert!(
        b.snapshot()
            .changed_since(&build(&Inputs::default()), Kind::Listener)
            .is_none(),
        "another lineage"
    );
}

/// A small deterministic generator (xorshift64*), so a failing seed reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random change over a small universe, so that conflicts (shared pod IPs, a service
/// name in two namespaces) and no-op changes come up often.
fn random_change(r: &mut Rng) -> Change {
    let ip = |r: &mut Rng| format!("10.1.0.{}", r.below(6) + 1);
    match r.below(13) {
        10 => Change::SetPodSvid {
            uid: format!("u{}", r.below(5)),
            svid: (r.below(4) != 0).then(|| svid("pod", ["1", "2"][r.below(2) as usize])),
        },
        11 => Change::SetAgentSvid(
            (r.below(4) != 0).then(|| svid("agent", ["a1", "a2"][r.below(2) as usize])),
        ),
        12 => Change::SetBundle(
            (r.below(4) != 0).then(|| ["CA", "CA2"][r.below(2) as usize].to_string()),
        ),
        0..=2 => {
            let n = r.below(3);
            let ips: Vec<String> = (0..n).map(|_| ip(r)).collect();
            let refs: Vec<&str> = ips.iter().map(String::as_str).collect();
            let mut p = pod(&format!("u{}", r.below(5)), &refs);
            p.no_quic_twin = r.below(4) == 0;
            Change::UpsertPod(if r.below(3) == 0 { terminating(p) } else { p })
        }
        3 => Change::RemovePod(format!("u{}", r.below(5))),
        4..=7 => {
            let name = ["web", "api", "db"][r.below(3) as usize];
            let ns = ["a", "b"][r.below(2) as usize];
            let ports: &[u16] = [&[80][..], &[80, 81][..], &[8080][..]][r.below(3) as usize];
            let vip = ["10.96.0.1", "10.96.0.2"].get(r.below(3) as usize).copied();
            let eps: Vec<(String, u16, u16, bool)> = (0..r.below(4))
                .map(|_| {
                    (
                        format!("10.0.0.{}", r.below(4) + 1),
                        8000 + r.below(2) as u16,
                        ports[r.below(ports.len() as u64) as usize],
                        r.below(2) == 0,
                    )
                })
                .collect();
            let eps: Vec<(&str, u16, u16, bool)> = eps
                .iter()
                .map(|(a, p, sp, d)| (a.as_str(), *p, *sp, *d))
                .collect();
            let mut s = svc(name, ns, ports, vip, &eps);
            for e in &mut s.endpoints {
                e.mtls = r.below(2) == 0;
            }
            Change::UpsertService(s)
        }
        8 => Change::RemoveService(ServiceKey {
            namespace: ["a", "b"][r.below(2) as usize].into(),
            name: ["web", "api", "db"][r.below(3) as usize].into(),
        }),
        _ => {
            let inbound_port = [15006, 16006][r.below(2) as usize];
            let outbound = ["127.0.0.1:15001", "127.0.0.1:16001"][r.below(2) as usize]
                .parse()
                .unwrap();
            Change::SetCapture(CaptureProjection {
                inbound_port,
                outbound,
                ..Default::default()
            })
        }
    }
}

#[test]
fn incremental_snapshots_equal_a_full_rebuild_for_random_change_sequences() {
    for seed in 1..=300u64 {
        let mut r = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        // Identity off, permissive and strict, in turn.
        let id = match seed % 3 {
            0 => Identity::default(),
            1 => identity(MtlsMode::Permissive),
            _ => identity(MtlsMode::Strict),
        };
        // QUIC twins on every other seed, bounded at 2 so that the bound is reached.
        let quic_twins = (seed % 2 == 0).then(|| QuicTwins {
            address: "127.0.0.1:15443".parse().unwrap(),
            max: 2,
        });
        let mut b = Builder::new(Inputs {
            identity: id,
            quic_twins,
            ..Default::default()
        });
        for step in 0..40 {
            let before = b.snapshot().clone();
            let (registry, generation) = (b.inputs().registry.clone(), b.registry_generation());
            let batch: Vec<Change> = (0..=r.below(4)).map(|_| random_change(&mut r)).collect();
            let published = b.apply(batch.clone());
            // The registry's generation moves whenever its services changed (and may
            // move for a batch that changed them back).
            assert!(
                b.registry_generation() != generation || b.inputs().registry == registry,
                "seed {seed} step {step}: the registry changed, its generation did not: {batch:?}"
            );
            let full = build(b.inputs());
            let now = b.snapshot();
            assert_eq!(
                **now,
                full,
                "seed {seed} step {step}: incremental differs from a full rebuild after {batch:?}\n--- incremental ---\n{}\n--- full ---\n{}",
                render(now),
                render(&full)
            );
            for k in KINDS {
                assert_eq!(
                    now.version(k),
                    full.version(k),
                    "seed {seed} step {step}: {k:?} version"
                );
            }
            let tls = |s: &Snapshot| {
                s.clusters
                    .items
                    .values()
                    .filter(|c| c.upstream_tls.is_some())
                    .count()
            };
            assert_eq!(
                (now.clusters.tallied(), full.clusters.tallied()),
                (tls(now), tls(&full)),
                "seed {seed} step {step}: clusters with upstream TLS"
            );
            // The keys of the EDS map are the EDS clusters: the delta ADS adapter takes
            // a subscription to every EDS cluster as that map.
            assert!(
                now.hashes(Kind::Endpoint)
                    .keys()
                    .map(String::as_str)
                    .eq(now.eds_cluster_names()),
                "seed {seed} step {step}: the load assignments are not the EDS clusters'"
            );
            match published {
                None => assert_eq!(
                    *before, **now,
                    "seed {seed} step {step}: nothing published, nothing changed"
                ),
                Some(s) => {
                    // Every resource whose content differs is named by the history.
                    for k in KINDS {
                        let named: BTreeSet<&str> =
                            s.changed_since(&before, k).expect("one step back");
                        let (old, new) = (before.hashes(k), s.hashes(k));
                        for n in old.keys().chain(new.keys()) {
                            if old.get(n) != new.get(n) {
                                assert!(
                                    named.contains(n.as_str()),
                                    "seed {seed} step {step}: {k:?} {n} changed unnamed"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

fn with_identity(mut i: Inputs, id: Identity) -> Inputs {
    i.identity = id;
    i
}

#[test]
fn identity_off_changes_no_resource_and_serves_no_secret() {
    let i = inputs(
        vec![svc(
            "web",
            "d",
            &[80],
            None,
            &[("10.0.0.1", 8080, 80, false)],
        )],
        vec![pod("u1", &["10.1.0.5"])],
    );
    let mut marked = i.clone();
    marked
        .registry
        .services
        .values_mut()
        .for_each(|s| s.endpoints.iter_mut().for_each(|e| e.mtls = true));
    let (plain, off) = (build(&i), build(&marked));
    assert!(off.secrets.is_empty());
    for k in KINDS {
        assert_eq!(
            plain.version(k),
            off.version(k),
            "{k:?}: an mTLS mark without identity changes nothing"
        );
    }
}

#[test]
fn permissive_pods_terminate_mtls_once_their_svid_arrives_and_keep_plaintext() {
    let mut id = identity(MtlsMode::Permissive);
    id.pods.insert("u1".into(), svid("ns/d/pod/one", "p1"));
    let i = with_identity(
        inputs(
            vec![svc(
                "web",
                "d",
                &[80],
                None,
                &[("10.0.0.1", 8080, 80, false), ("10.0.0.2", 8080, 80, false)],
            )],
            vec![pod("u1", &["10.1.0.5"]), pod("u2", &["10.1.0.6"])],
        ),
        id,
    );
    let mut i2 = i.clone();
    i2.registry
        .services
        .values_mut()
        .for_each(|s| s.endpoints[0].mtls = true);
    check(
        i2,
        "L inbound 0.0.0.0:15006 capture
         L inbound|u1 10.1.0.5:80 chain u1 [10.1.0.5] -> inbound|u1 mtls=spiffe|inbound|u1+plaintext
         L inbound|u2 10.1.0.6:80 chain u2 [10.1.0.6] -> inbound|u2
         L outbound 127.0.0.1:15001 rds=outbound source-certificates u1-from [10.1.0.5] plaintext-from [10.1.0.6]
         R outbound vh web.d [web,web.d,web.d.svc.cluster.local,web:80,web.d:80,web.d.svc.cluster.local:80]
         R outbound vh web.d None -> outbound|80||web.d
         C inbound|u1 static [10.1.0.5:80]
         C inbound|u2 static [10.1.0.6:80]
         C outbound|80||web.d eds mtls, plaintext without a certificate
         E outbound|80||web.d [10.0.0.1:8080 mtls,10.0.0.2:8080]
         S spiffe|bundle Secret::Validation(spiffe://td/)
         S spiffe|inbound|u1 Secret::Certificate(<redacted>)
         S spiffe|pod|u1 Secret::Certificate(<redacted>)",
    );
}

/// A pod presents its own identity or none: until its SVID arrives its connections go
/// plaintext (permissive); then its own certificate is served and its source leaves the
/// plaintext chain, in one step. No secret ever holds the agent's SVID.
#[test]
fn a_pod_without_its_svid_goes_plaintext_and_never_presents_the_agents() {
    let i = with_identity(
        inputs(vec![], vec![pod("u2", &["10.1.0.6", "fd00::6"])]),
        identity(MtlsMode::Permissive),
    );
    let agent = i.identity.agent.clone().expect("the agent's SVID");
    let holds_agent = |s: &Snapshot| {
        s.secrets.items.values().any(|n| {
            matches!(&n.secret, Secret::Certificate { key_pem, .. } if *key_pem == agent.key_pem)
        })
    };
    let plaintext = |s: &Snapshot| match &s.listeners.get(OUTBOUND).unwrap().kind {
        ListenerKind::HttpOutbound {
            plaintext_sources, ..
        } => plaintext_sources.clone(),
        _ => unreachable!(),
    };
    let mut b = Builder::new(i);
    let s = b.snapshot().clone();
    assert!(!holds_agent(&s), "no secret carries the agent's SVID");
    assert_eq!(s.secrets.len(), 1, "only the bundle: {:?}", s.secrets);
    assert_eq!(
        plaintext(&s),
        [
            "10.1.0.6".parse::<IpAddr>().unwrap(),
            "fd00::6".parse().unwrap()
        ]
    );
    // The agent's SVID rotates: nothing a pod uses changes.
    assert!(
        b.apply([Change::SetAgentSvid(Some(svid("agent", "a2")))])
            .is_none()
    );
    let s = b
        .apply([Change::SetPodSvid {
            uid: "u2".into(),
            svid: Some(svid("ns/d/pod/two", "p2")),
        }])
        .expect("the SVID changes the snapshot");
    assert!(plaintext(&s).is_empty(), "its own certificate from now on");
    assert!(s.secrets.get("spiffe|pod|u2").is_some());
    assert!(!holds_agent(&s));
    // Strict: no plaintext sources ever; the pod's connection fails instead.
    let strict = build(&with_identity(
        inputs(vec![], vec![pod("u2", &["10.1.0.6"])]),
        identity(MtlsMode::Strict),
    ));
    assert!(plaintext(&strict).is_empty());
}

#[test]
fn strict_mode_holds_a_pods_listener_back_until_its_svid_arrives() {
    let i = with_identity(
        inputs(vec![], vec![pod("u1", &["10.1.0.5"])]),
        identity(MtlsMode::Strict),
    );
    let mut b = Builder::new(i);
    let s = b.snapshot().clone();
    assert!(
        s.listeners.get("inbound|u1").is_none(),
        "fail closed: no listener without the SVID"
    );
    assert!(
        s.secrets.get("spiffe|pod|u1").is_none(),
        "no certificate for a pod without its own SVID"
    );
    // The pod is served as strict mode serves it until the SVID comes: its CNI ADD
    // succeeds (the provider attests a pod only once it runs).
    assert!(s.held_back.contains("u1"));
    assert!(s.holds_pod("u1", &["10.1.0.5".parse().unwrap()]));
    assert!(
        !s.holds_pod("u1", &["10.1.0.6".parse().unwrap()]),
        "not at an IP it does not have"
    );

    let s = b
        .apply([Change::SetPodSvid {
            uid: "u1".into(),
            svid: Some(svid("ns/d/pod/one", "p1")),
        }])
        .unwrap();
    match &s
        .listeners
        .get("inbound|u1")
        .expect("the SVID opens the listener")
        .kind
    {
        ListenerKind::InboundPod { chain } => assert_eq!(
            chain.tls,
            Some(InboundTls {
                certificate: "spiffe|inbound|u1".into(),
                plaintext: false
            })
        ),
        other => panic!("{other:?}"),
    }
    assert!(s.held_back.is_empty());
    assert!(s.holds_pod("u1", &["10.1.0.5".parse().unwrap()]));
}

#[test]
fn a_rotation_changes_one_secret_and_no_listener_or_cluster() {
    let mut id = identity(MtlsMode::Strict);
    id.pods.insert("u1".into(), svid("ns/d/pod/one", "p1"));
    let mut b = Builder::new(with_identity(
        inputs(
            vec![],
            vec![pod("u1", &["10.1.0.5"]), pod("u2", &["10.1.0.6"])],
        ),
        id,
    ));
    let before = b.snapshot().clone();
    let after = b
        .apply([Change::SetPodSvid {
            uid: "u1".into(),
            svid: Some(svid("ns/d/pod/one", "p2")),
        }])
        .unwrap();
    for k in [Kind::Listener, Kind::Cluster, Kind::Endpoint, Kind::Route] {
        assert_eq!(
            before.version(k),
            after.version(k),
            "{k:?} unchanged by a rotation"
        );
    }
    assert_eq!(
        after.changed_since(&before, Kind::Secret).unwrap(),
        BTreeSet::from(["spiffe|inbound|u1", "spiffe|pod|u1"])
    );
    assert!(
        b.apply([Change::SetPodSvid {
            uid: "u1".into(),
            svid: Some(svid("ns/d/pod/one", "p2"))
        }])
        .is_none(),
        "the same SVID again changes nothing"
    );
}

#[test]
fn removing_a_pod_removes_its_secrets() {
    let mut id = identity(MtlsMode::Permissive);
    id.pods.insert("u1".into(), svid("ns/d/pod/one", "p1"));
    let mut b = Builder::new(with_identity(
        inputs(vec![], vec![pod("u1", &["10.1.0.5", "fd00::5"])]),
        id,
    ));
    assert!(
        b.snapshot().secrets.get("spiffe|pod|u1").is_some(),
        "one outbound secret for the pod, named by its uid"
    );
    let s = b.apply([Change::RemovePod("u1".into())]).unwrap();
    assert!(
        s.secrets.get("spiffe|pod|u1").is_none() && s.secrets.get("spiffe|inbound|u1").is_none()
    );
    assert!(s.secrets.get(BUNDLE_SECRET).is_some());
}

/// A pod's outbound certificate is named by its uid, so a new pod at a reused IP names
/// another secret (and Envoy another upstream pool key): the outbound listener's chain for
/// that IP switches from the old pod's name to the new one's in one step, and the old
/// pod's secret leaves.
#[test]
fn a_new_pod_at_a_reused_ip_names_its_own_certificate_not_the_old_pods() {
    let mut id = identity(MtlsMode::Strict);
    id.pods.insert("u1".into(), svid("ns/d/pod/one", "p1"));
    let mut b = Builder::new(with_identity(
        inputs(vec![], vec![pod("u1", &["10.1.0.5"])]),
        id,
    ));
    let certified = |s: &Snapshot| match &s.listeners.get(OUTBOUND).unwrap().kind {
        ListenerKind::HttpOutbound {
            pod_certificates, ..
        } => pod_certificates.clone(),
        _ => unreachable!(),
    };
    let ip: IpAddr = "10.1.0.5".parse().unwrap();
    assert_eq!(certified(b.snapshot()), [("u1".to_string(), vec![ip])]);
    let s = b
        .apply([
            Change::RemovePod("u1".into()),
            Change::SetPodSvid {
                uid: "u1".into(),
                svid: None,
            },
            Change::UpsertPod(pod("u3", &["10.1.0.5"])),
        ])
        .unwrap();
    assert!(
        certified(&s).is_empty(),
        "no chain names a certificate before the new pod's SVID"
    );
    assert!(s.secrets.get("spiffe|pod|u1").is_none());
    let s = b
        .apply([Change::SetPodSvid {
            uid: "u3".into(),
            svid: Some(svid("ns/d/pod/three", "p3")),
        }])
        .unwrap();
    assert_eq!(certified(&s), [("u3".to_string(), vec![ip])]);
    assert!(s.secrets.get("spiffe|pod|u3").is_some());
    assert!(s.secrets.get("spiffe|pod|u1").is_none());
    assert_eq!(
        **b.snapshot(),
        build(b.inputs()),
        "incremental equals a fresh build"
    );
}

fn twins_on(i: Inputs, max: usize) -> Inputs {
    Inputs {
        quic_twins: Some(QuicTwins {
            address: "10.9.0.1:15443".parse().unwrap(),
            max,
        }),
        ..i
    }
}

fn twin_uids(s: &Snapshot) -> Vec<String> {
    match s.listeners.get(QUIC_TWINS).map(|l| &l.kind) {
        Some(ListenerKind::QuicTwins { twins }) => {
            twins.iter().map(|t| t.pod_uid.clone()).collect()
        }
        Some(other) => panic!("{QUIC_TWINS} is {other:?}"),
        None => vec![],
    }
}

#[test]
fn a_pod_gets_a_quic_twin_with_its_svid_unless_it_opted_out_and_loses_it_with_its_del() {
    let mut out = pod("u-out", &["10.1.0.3"]);
    out.no_quic_twin = true;
    let base = twins_on(
        with_identity(
            inputs(
                vec![],
                vec![pod("u1", &["10.1.0.1"]), pod("u2", &["10.1.0.2"]), out],
            ),
            identity(MtlsMode::Strict),
        ),
        10,
    );
    let mut b = Builder::new(base);
    // No SVID yet: no twin, no listener.
    assert_eq!(twin_uids(b.snapshot()), Vec::<String>::new());
    assert!(b.snapshot().listeners.get(QUIC_TWINS).is_none());
    let set = |uid: &str, serial: &str| Change::SetPodSvid {
        uid: uid.into(),
        svid: Some(svid(uid, serial)),
    };
    b.apply([set("u1", "1"), set("u-out", "1")]);
    let s = b.snapshot().clone();
    assert_eq!(twin_uids(&s), ["u1"], "the opted-out pod has none");
    let l = s.listeners.get(QUIC_TWINS).unwrap();
    assert_eq!(l.address, "10.9.0.1:15443".parse().unwrap());
    assert_eq!(
        l.kind,
        ListenerKind::QuicTwins {
            twins: vec![Twin {
                pod_uid: "u1".into(),
                sni: "u1.twin.aether".into(),
                certificate: inbound_secret_name("u1"),
                cluster: inbound_cluster_name("u1"),
            }]
        }
    );
    assert!(s.sds_names().contains(inbound_secret_name("u1").as_str()));
    // A rotation is a secret update: the twins' listener keeps its hash.
    let hash = s.hashes(Kind::Listener).get(QUIC_TWINS).copied();
    b.apply([set("u1", "2")]);
    assert_eq!(
        b.snapshot().hashes(Kind::Listener).get(QUIC_TWINS).copied(),
        hash
    );
    // The second pod's SVID adds its chain; its DEL takes it away; the last DEL the listener.
    b.apply([set("u2", "1")]);
    assert_eq!(twin_uids(b.snapshot()), ["u1", "u2"]);
    b.apply([Change::RemovePod("u1".into())]);
    assert_eq!(twin_uids(b.snapshot()), ["u2"]);
    b.apply([Change::RemovePod("u2".into())]);
    assert!(b.snapshot().listeners.get(QUIC_TWINS).is_none());
    // Without the trust bundle no inbound terminates mTLS: no twin either.
    b.apply([Change::UpsertPod(pod("u3", &["10.1.0.4"])), set("u3", "1")]);
    assert_eq!(twin_uids(b.snapshot()), ["u3"]);
    b.apply([Change::SetBundle(None)]);
    assert_eq!(twin_uids(b.snapshot()), Vec::<String>::new());
}

#[test]
fn twins_past_the_bound_are_refused_and_listed_and_twins_off_builds_none() {
    let pods: Vec<Pod> = (1..=4)
        .map(|i| pod(&format!("u{i}"), &[&format!("10.1.0.{i}")]))
        .collect();
    let mut id = identity(MtlsMode::Permissive);
    for p in &pods {
        id.pods.insert(p.uid.clone(), svid(&p.uid, "1"));
    }
    let plain = with_identity(inputs(vec![], pods), id);
    let s = build(&twins_on(plain.clone(), 3));
    assert_eq!(twin_uids(&s), ["u1", "u2", "u3"]);
    assert_eq!(s.twins_refused, ["u4"]);
    // Off: no listener, nothing refused, and every other resource as it was.
    let off = build(&plain);
    assert!(off.listeners.get(QUIC_TWINS).is_none() && off.twins_refused.is_empty());
    let on = build(&twins_on(plain, 10));
    assert_eq!(on.twins_refused, Vec::<String>::new());
    assert_eq!(on.clusters, off.clusters);
    assert_eq!(on.secrets, off.secrets);
    assert_eq!(on.listeners.len(), off.listeners.len() + 1);
}
