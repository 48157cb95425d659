//! The mirror against the registrar's own model of the registry: whatever the order of
//! single-key changes, the services the node ends with equal a full view of the same
//! state.

use std::collections::BTreeMap;

use aether_model::{Change, EndpointState, Service, ServiceKey};
use shared_proto::registry as pb;

use super::mirror::Mirror;
use crate::test_rng::Rng;

fn key(ns: &str, name: &str) -> pb::ServiceKey {
    pb::ServiceKey {
        namespace: ns.into(),
        name: name.into(),
    }
}

fn ep(addr: &str, port: u32, node: &str, state: pb::EndpointState) -> pb::Endpoint {
    pb::Endpoint {
        address: addr.into(),
        port,
        service_port: 80,
        node: node.into(),
        pod: String::new(),
        state: state as i32,
        mtls: false,
        quic: String::new(),
        quic_sni: String::new(),
    }
}

fn service(name: &str, vip: &str, endpoints: Vec<pb::Endpoint>) -> pb::Service {
    pb::Service {
        key: Some(key("default", name)),
        ports: vec![80],
        vip: vip.into(),
        endpoints,
    }
}

fn change(kind: pb::change::Kind) -> pb::Change {
    pb::Change { kind: Some(kind) }
}

fn batch(revision: i64, changes: Vec<pb::change::Kind>) -> pb::ChangeBatch {
    pb::ChangeBatch {
        revision,
        changes: changes.into_iter().map(change).collect(),
    }
}

/// Applies `changes` to a map of services, as the node's builder would.
fn apply(node: &mut BTreeMap<ServiceKey, Service>, changes: Vec<Change>) {
    for c in changes {
        match c {
            Change::UpsertService(s) => {
                node.insert(s.key(), s);
            }
            Change::RemoveService(k) => {
                node.remove(&k);
            }
            other => panic!("the mirror sends services only, not {other:?}"),
        }
    }
}

#[test]
fn a_full_view_then_one_endpoint_upsert_touches_one_service() {
    let mut m = Mirror::default();
    let full = pb::FullView {
        revision: 7,
        services: vec![
            service(
                "a",
                "10.96.0.1",
                vec![ep("10.0.0.1", 8080, "n1", pb::EndpointState::Healthy)],
            ),
            service("b", "", vec![]),
        ],
        ..Default::default()
    };
    let (changes, skipped) = m.apply_full(full);
    assert!(skipped.is_empty());
    assert_eq!(changes.len(), 2);
    assert_eq!(m.revision(), 7);
    let (changes, _) = m.apply_batch(batch(
        8,
        vec![pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
            service: Some(key("default", "b")),
            endpoint: Some(ep("10.0.0.2", 8080, "n2", pb::EndpointState::Healthy)),
        })],
    ));
    let [Change::UpsertService(b)] = changes.as_slice() else {
        panic!("one upsert: {changes:?}")
    };
    assert_eq!((b.name.as_str(), b.endpoints.len()), ("b", 1));
    assert_eq!(m.revision(), 8);
}

#[test]
fn the_mtls_mark_reaches_the_node_from_a_full_view_and_from_an_upsert() {
    let mut m = Mirror::default();
    let marked = |addr: &str, mtls: bool| pb::Endpoint {
        mtls,
        ..ep(addr, 8080, "n1", pb::EndpointState::Healthy)
    };
    let (changes, skipped) = m.apply_full(pb::FullView {
        revision: 1,
        services: vec![service(
            "a",
            "",
            vec![marked("10.0.0.1", true), marked("10.0.0.2", false)],
        )],
        ..Default::default()
    });
    assert!(skipped.is_empty(), "{skipped:?}");
    let [Change::UpsertService(a)] = changes.as_slice() else {
        panic!("{changes:?}")
    };
    let marks: Vec<(String, bool)> = a
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
    // The mark set, then cleared, on one endpoint by single upserts.
    for (rev, mtls) in [(2, true), (3, false)] {
        let (changes, _) = m.apply_batch(batch(
            rev,
            vec![pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
                service: Some(key("default", "a")),
                endpoint: Some(marked("10.0.0.2", mtls)),
            })],
        ));
        let [Change::UpsertService(a)] = changes.as_slice() else {
            panic!("{changes:?}")
        };
        assert_eq!(
            a.endpoints.iter().map(|e| e.mtls).collect::<Vec<_>>(),
            [true, mtls],
            "revision {rev}"
        );
    }
    // A drain mark keeps the mTLS mark.
    let (changes, _) = m.apply_batch(batch(
        4,
        vec![pb::change::Kind::StateChanged(pb::DrainMark {
            service: Some(key("default", "a")),
            address: "10.0.0.1".into(),
            state: pb::EndpointState::Draining as i32,
            node: "n1".into(),
        })],
    ));
    let [Change::UpsertService(a)] = changes.as_slice() else {
        panic!("{changes:?}")
    };
    assert_eq!(
        (a.endpoints[0].state, a.endpoints[0].mtls),
        (EndpointState::Draining, true)
    );
}

#[test]
fn a_drain_mark_turns_the_endpoint_draining_and_its_removal_turns_it_back() {
    let mut m = Mirror::default();
    m.apply_full(pb::FullView {
        revision: 1,
        services: vec![service(
            "a",
            "",
            vec![ep("10.0.0.1", 8080, "n1", pb::EndpointState::Healthy)],
        )],
        ..Default::default()
    });
    let mark = |state: pb::EndpointState, node: &str| {
        pb::change::Kind::StateChanged(pb::DrainMark {
            service: Some(key("default", "a")),
            address: "10.0.0.1".into(),
            state: state as i32,
            node: node.into(),
        })
    };
    let (changes, _) = m.apply_batch(batch(2, vec![mark(pb::EndpointState::Draining, "n1")]));
    let [Change::UpsertService(a)] = changes.as_slice() else {
        panic!("{changes:?}")
    };
    assert_eq!(a.endpoints[0].state, EndpointState::Draining);
    let (changes, _) = m.apply_batch(batch(3, vec![mark(pb::EndpointState::Healthy, "")]));
    let [Change::UpsertService(a)] = changes.as_slice() else {
        panic!("{changes:?}")
    };
    assert_eq!(a.endpoints[0].state, EndpointState::Healthy);
}

#[test]
fn a_resync_removes_the_services_it_no_longer_holds() {
    let mut m = Mirror::default();
    m.apply_full(pb::FullView {
        revision: 1,
        services: vec![service("a", "", vec![]), service("b", "", vec![])],
        ..Default::default()
    });
    let (changes, _) = m.apply_full(pb::FullView {
        revision: 9,
        services: vec![service("b", "", vec![])],
        resync: true,
        ..Default::default()
    });
    assert!(
        changes.contains(&Change::RemoveService(ServiceKey {
            namespace: "default".into(),
            name: "a".into()
        })),
        "{changes:?}"
    );
    assert_eq!(m.services(), 1);
}

#[test]
fn bad_entries_are_skipped_and_named_not_applied() {
    let mut m = Mirror::default();
    let (changes, skipped) = m.apply_full(pb::FullView {
        revision: 1,
        services: vec![
            service("a", "not-an-ip", vec![]),
            service(
                "b",
                "",
                vec![ep("10.0.0.300", 1, "n", pb::EndpointState::Healthy)],
            ),
        ],
        ..Default::default()
    });
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(skipped[0].0.contains("vip \"not-an-ip\""), "{skipped:?}");
    assert!(skipped[1].0.contains("10.0.0.300"), "{skipped:?}");
    // b stays, without the bad endpoint; a has no valid service record.
    assert_eq!(changes.len(), 1, "{changes:?}");
}

/// What the mirror hands the node for `services`, as "ns/name vip [addr:port ...]".
fn built(changes: Vec<Change>) -> Vec<String> {
    let mut node = BTreeMap::new();
    apply(&mut node, changes);
    node.values()
        .map(|s| {
            let eps: Vec<String> = s
                .endpoints
                .iter()
                .map(|e| format!("{}:{}", e.address, e.port))
                .collect();
            format!("{} {:?} [{}]", s.key(), s.vip, eps.join(" "))
        })
        .collect()
}

#[test]
fn entries_that_fail_the_registrars_checks_are_dropped_and_named_and_loopback_passes() {
    let mut m = Mirror::default();
    let mut bad_key = service("web", "", vec![]);
    bad_key.key = Some(key("default", "Web_1"));
    let mut bad_ports = service("ports", "", vec![]);
    bad_ports.ports = vec![80, 0];
    let (changes, skipped) = m.apply_full(pb::FullView {
        revision: 1,
        services: vec![
            bad_key,
            bad_ports,
            service("meta", "169.254.169.254", vec![]),
            service(
                "ok",
                "10.96.0.1",
                vec![
                    ep("10.0.0.1", 8080, "n", pb::EndpointState::Healthy),
                    ep("127.0.0.1", 8080, "n", pb::EndpointState::Healthy),
                    ep("::1", 8080, "n", pb::EndpointState::Healthy),
                    ep("169.254.169.254", 80, "n", pb::EndpointState::Healthy),
                    ep("fe80::1", 8080, "n", pb::EndpointState::Healthy),
                    ep("224.0.0.1", 8080, "n", pb::EndpointState::Healthy),
                    ep("0.0.0.0", 8080, "n", pb::EndpointState::Healthy),
                    ep("10.0.0.2", 0, "n", pb::EndpointState::Healthy),
                ],
            ),
        ],
        ..Default::default()
    });
    let skipped: Vec<&str> = skipped.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(
        skipped,
        [
            "a service: key.name: \"Web_1\" is not a DNS label",
            "service default/ports: service.ports[1]: 0",
            "service default/meta: service.vip: 169.254.169.254 is link-local",
            "service default/ok: endpoint 169.254.169.254:80.address: 169.254.169.254 is link-local",
            "service default/ok: endpoint fe80::1:8080.address: fe80::1 is link-local",
            "service default/ok: endpoint 224.0.0.1:8080.address: 224.0.0.1 is multicast",
            "service default/ok: endpoint 0.0.0.0:8080.address: 0.0.0.0 is unspecified",
            "service default/ok: endpoint 10.0.0.2:0.port: 0",
        ]
    );
    assert_eq!(
        built(changes),
        ["default/ok Some(10.96.0.1) [10.0.0.1:8080 127.0.0.1:8080 ::1:8080]"]
    );
    // In a batch: a bad endpoint upsert and a bad service upsert are dropped; the service
    // keeps what it had.
    let (changes, skipped) = m.apply_batch(batch(
        2,
        vec![
            pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
                service: Some(key("default", "ok")),
                endpoint: Some(ep("ff02::1", 8080, "n", pb::EndpointState::Healthy)),
            }),
            pb::change::Kind::ServiceUpserted(service("ok", "224.0.0.5", vec![])),
            pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
                service: Some(key("default", "ok")),
                endpoint: Some(ep("10.0.0.3", 8080, "n", pb::EndpointState::Healthy)),
            }),
        ],
    ));
    assert_eq!(skipped.len(), 2, "{skipped:?}");
    assert!(skipped[0].0.contains("ff02::1 is multicast"), "{skipped:?}");
    assert!(
        skipped[1].0.contains("224.0.0.5 is multicast"),
        "{skipped:?}"
    );
    assert_eq!(
        built(changes),
        ["default/ok Some(10.96.0.1) [10.0.0.1:8080 10.0.0.3:8080 127.0.0.1:8080 ::1:8080]"]
    );
}

#[test]
fn single_key_changes_in_any_order_end_where_a_full_view_of_the_same_state_does() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        // The registrar's store: services' own keys, endpoints, marks.
        let mut metas: BTreeMap<String, String> = BTreeMap::new();
        let mut endpoints: BTreeMap<(String, String), pb::Endpoint> = BTreeMap::new();
        let mut marks: BTreeMap<(String, String), ()> = BTreeMap::new();
        let mut mirror = Mirror::default();
        let mut node = BTreeMap::new();
        apply(
            &mut node,
            mirror
                .apply_full(pb::FullView {
                    revision: 1,
                    ..Default::default()
                })
                .0,
        );
        for rev in 2..200 {
            let name = format!("s{}", rng.below(6));
            let addr = format!("10.0.0.{}", rng.below(5));
            let kind = match rng.below(6) {
                0 => {
                    let vip = format!("10.96.0.{}", rng.below(3));
                    metas.insert(name.clone(), vip.clone());
                    pb::change::Kind::ServiceUpserted(service(&name, &vip, vec![]))
                }
                1 => {
                    metas.remove(&name);
                    pb::change::Kind::ServiceRemoved(key("default", &name))
                }
                2 | 3 => {
                    let state = if rng.below(2) == 0 {
                        pb::EndpointState::Healthy
                    } else {
                        pb::EndpointState::Draining
                    };
                    let e = ep(&addr, 8080, "n1", state);
                    endpoints.insert((name.clone(), addr.clone()), e.clone());
                    pb::change::Kind::EndpointUpserted(pb::EndpointUpsert {
                        service: Some(key("default", &name)),
                        endpoint: Some(e),
                    })
                }
                4 => {
                    endpoints.remove(&(name.clone(), addr.clone()));
                    pb::change::Kind::EndpointRemoved(pb::EndpointRemoval {
                        service: Some(key("default", &name)),
                        address: addr,
                        port: 8080,
                    })
                }
                _ => {
                    let draining = rng.below(2) == 0;
                    if draining {
                        marks.insert((name.clone(), addr.clone()), ());
                    } else {
                        marks.remove(&(name.clone(), addr.clone()));
                    }
                    let state = if draining {
                        pb::EndpointState::Draining
                    } else {
                        pb::EndpointState::Healthy
                    };
                    pb::change::Kind::StateChanged(pb::DrainMark {
                        service: Some(key("default", &name)),
                        address: addr,
                        state: state as i32,
                        node: if draining { "n1".into() } else { String::new() },
                    })
                }
            };
            apply(&mut node, mirror.apply_batch(batch(rev, vec![kind])).0);
            // The services with their own key, counted as they change.
            assert_eq!(
                mirror.services(),
                metas.len(),
                "seed {seed}, revision {rev}"
            );
        }
        // The same state as one full view, into a fresh mirror.
        let services = metas
            .iter()
            .map(|(name, vip)| {
                let eps = endpoints
                    .iter()
                    .filter(|((k, _), _)| k == name)
                    .map(|(_, e)| e.clone())
                    .collect();
                service(name, vip, eps)
            })
            .collect();
        let full_marks = marks
            .keys()
            .map(|(name, addr)| pb::DrainMark {
                service: Some(key("default", name)),
                address: addr.clone(),
                state: pb::EndpointState::Draining as i32,
                node: "n1".into(),
            })
            .collect();
        let mut fresh = Mirror::default();
        let mut expected = BTreeMap::new();
        apply(
            &mut expected,
            fresh
                .apply_full(pb::FullView {
                    revision: 200,
                    services,
                    marks: full_marks,
                    ..Default::default()
                })
                .0,
        );
        assert_eq!(node, expected, "seed {seed}");
        assert_eq!(mirror.revision(), 199);
    }
}
