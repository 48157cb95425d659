//! The writes a request makes, decided from what was read: an apply's puts and deletes
//! for one service, a drain mark's put or delete with its node check, and the endpoint
//! rewrites that make a node's endpoints carry its QUIC pairs. Pure; the store performs
//! the plan in one etcd transaction guarded by the revision it read.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use aether_model::{EndpointState, Service, ServiceKey};

use crate::keys::Key;
use crate::keys::Layout;
use crate::values::{self, EndpointValue, MarkValue, PairsValue, ServiceValue, Source};

/// One write of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
    },
    Delete {
        key: String,
    },
    /// Every key starting with `prefix`.
    DeletePrefix {
        prefix: String,
    },
}

/// A write refused because another source owns the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owned {
    pub by: Source,
}

/// The source of a service as stored; None when absent. A value that does not decode
/// counts as a file's, so that either source may replace it.
pub fn stored_source(current_service: Option<&[u8]>) -> Option<Source> {
    current_service
        .map(|v| serde_json::from_slice::<ServiceValue>(v).map_or(Source::File, |s| s.source))
}

/// Whether `writer` may change or delete a service stored with `current`: Kubernetes
/// wins. Discovery may take over a file's service; a file may not touch a discovered one.
pub fn may_write(writer: Source, current_service: Option<&[u8]>) -> Result<(), Owned> {
    match (writer, stored_source(current_service)) {
        (Source::File, Some(Source::Kubernetes)) => Err(Owned {
            by: Source::Kubernetes,
        }),
        _ => Ok(()),
    }
}

/// The writes that make etcd hold `s` exactly, written by `writer`: its service value,
/// its endpoints, and no other endpoint of it. Each endpoint carries the QUIC twin its
/// node's pairs (`pairs`, by node) name for its address and port, so a pair set before
/// its endpoint existed applies when the endpoint appears. Values already equal are not
/// rewritten, so a repeated apply writes nothing and wakes no watcher. Drain marks are left alone: a
/// mark an agent set outlives every rewrite of its endpoint. The service comes first, so
/// a client applying the changes in order knows the service before its endpoints.
pub fn apply_service(
    layout: &Layout,
    s: &Service,
    writer: Source,
    current_service: Option<&[u8]>,
    current_endpoints: &BTreeMap<String, Vec<u8>>,
    pairs: &BTreeMap<String, PairsValue>,
) -> Result<Vec<Op>, Owned> {
    may_write(writer, current_service)?;
    let key = s.key();
    let mut ops = Vec::new();
    let value = values::encode(&ServiceValue {
        ports: s.ports.clone(),
        vip: s.vip,
        source: writer,
    });
    if current_service != Some(value.as_slice()) {
        ops.push(Op::Put {
            key: layout.service(&key),
            value,
        });
    }
    let wanted: BTreeMap<String, Vec<u8>> = s
        .endpoints
        .iter()
        .map(|e| {
            let v = EndpointValue {
                service_port: e.service_port,
                node: e.node.clone(),
                pod: e.pod.clone(),
                state: e.state,
                mtls: e.mtls,
                quic: String::new(),
                quic_sni: String::new(),
            }
            .with_twin(SocketAddr::new(e.address, e.port), pairs.get(&e.node));
            (layout.endpoint(&key, e.address, e.port), values::encode(&v))
        })
        .collect();
    for k in current_endpoints.keys() {
        if !wanted.contains_key(k) {
            ops.push(Op::Delete { key: k.clone() });
        }
    }
    for (k, v) in wanted {
        if current_endpoints.get(&k) != Some(&v) {
            ops.push(Op::Put { key: k, value: v });
        }
    }
    Ok(ops)
}

/// The writes that remove a service with its endpoints and marks, by `writer`. Discovery
/// removes only the services it wrote: a file's service of a name Kubernetes does not
/// have stays.
pub fn delete_service(
    layout: &Layout,
    key: &ServiceKey,
    writer: Source,
    current_service: Option<&[u8]>,
) -> Result<Vec<Op>, Owned> {
    may_write(writer, current_service)?;
    if writer == Source::Kubernetes && stored_source(current_service) == Some(Source::File) {
        return Ok(Vec::new());
    }
    Ok(vec![
        Op::Delete {
            key: layout.service(key),
        },
        Op::DeletePrefix {
            prefix: layout.endpoints_of(key),
        },
        Op::DeletePrefix {
            prefix: layout.marks_of(key),
        },
    ])
}

/// A service with endpoints at the address being marked, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkTarget {
    pub service: ServiceKey,
    /// The node of each endpoint of the service at the address (at least one).
    pub endpoint_nodes: Vec<String>,
    pub current: Option<MarkValue>,
}

/// A SetEndpointState from one agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkRequest<'a> {
    pub address: IpAddr,
    pub state: EndpointState,
    pub node: &'a str,
    pub instance: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkRefusal {
    /// No endpoint at the address in the services asked about.
    NotFound,
    /// Every service with an endpoint at the address has one on another node than the
    /// caller's; the first of them, for the log.
    OtherNode {
        service: ServiceKey,
        endpoint_node: String,
    },
}

/// A service a mark leaves alone: an endpoint of it at the address runs on another node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedTarget {
    pub service: ServiceKey,
    /// The node of the first such endpoint.
    pub endpoint_node: String,
}

/// What a mark writes, which services it marks, and which it leaves alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkPlan {
    pub ops: Vec<Op>,
    pub marked: Vec<ServiceKey>,
    pub skipped: Vec<SkippedTarget>,
}

/// The writes that give the targets on the caller's node the requested state, or why
/// none may be made. A target with an endpoint at the address on another node is skipped
/// and reported, never marked: a mark is keyed by service and address, so marking it
/// would drain the other node's endpoint too. One such service (an EndpointSlice listing
/// the pod's IP under another node, by mistake or on purpose) therefore cannot block the
/// drain of the caller's own services; only a request where every target is elsewhere is
/// refused. HEALTHY is the absence of a mark; a mark already holding the state (and the
/// caller's node) is not rewritten, so an owner and its successor setting the same state
/// leave one mark and one change.
pub fn set_marks(
    layout: &Layout,
    req: &MarkRequest<'_>,
    targets: &[MarkTarget],
) -> Result<MarkPlan, MarkRefusal> {
    if targets.is_empty() {
        return Err(MarkRefusal::NotFound);
    }
    let mut plan = MarkPlan {
        ops: Vec::new(),
        marked: Vec::new(),
        skipped: Vec::new(),
    };
    for t in targets {
        if let Some(other) = t.endpoint_nodes.iter().find(|n| n.as_str() != req.node) {
            plan.skipped.push(SkippedTarget {
                service: t.service.clone(),
                endpoint_node: other.clone(),
            });
            continue;
        }
        plan.marked.push(t.service.clone());
        let key = layout.mark(&t.service, req.address);
        match (req.state, &t.current) {
            (EndpointState::Healthy, None) => {}
            (EndpointState::Healthy, Some(_)) => plan.ops.push(Op::Delete { key }),
            (state, Some(m)) if m.state == state && m.node == req.node => {}
            (state, _) => {
                let v = MarkValue {
                    state,
                    node: req.node.to_owned(),
                    instance: req.instance.to_owned(),
                };
                plan.ops.push(Op::Put {
                    key,
                    value: values::encode(&v),
                });
            }
        }
    }
    if plan.marked.is_empty() {
        let first = plan.skipped.swap_remove(0);
        return Err(MarkRefusal::OtherNode {
            service: first.service,
            endpoint_node: first.endpoint_node,
        });
    }
    Ok(plan)
}

/// The endpoint rewrites that make every endpoint on `node` among `endpoints` (keys and
/// values as read) carry the twin `pairs` names for its address and port, and no twin
/// where `pairs` names none; endpoints on other nodes are left alone (their own node's
/// pairs apply). Also how many pairs matched no endpoint on the node. Values already
/// right are not rewritten, so a restated set writes nothing.
pub fn twins(
    layout: &Layout,
    node: &str,
    pairs: &PairsValue,
    endpoints: &[(Vec<u8>, Vec<u8>)],
) -> TwinPlan {
    let mut plan = TwinPlan::default();
    let mut matched = std::collections::BTreeSet::new();
    for (k, v) in endpoints {
        let Ok(Key::Endpoint { address, port, .. }) = layout.parse(k) else {
            continue;
        };
        let text = String::from_utf8_lossy(k).into_owned();
        // A corrupt endpoint is skipped here as everywhere; its next write replaces it.
        let Ok(current) = values::decode::<EndpointValue>(&text, "endpoint", v) else {
            continue;
        };
        if current.node != node {
            continue;
        }
        let at = SocketAddr::new(address, port);
        if pairs.twin(at).is_some() {
            matched.insert(at);
        }
        let wanted = current.clone().with_twin(at, Some(pairs));
        if wanted != current {
            plan.ops.push(Op::Put {
                key: text,
                value: values::encode(&wanted),
            });
        }
    }
    plan.unmatched = pairs.pairs.len() - matched.len();
    plan
}

/// What [`twins`] decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TwinPlan {
    /// One put per endpoint whose twin changes.
    pub ops: Vec<Op>,
    /// Pairs whose `tcp` is no endpoint on the node (yet).
    pub unmatched: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::DEFAULT_PREFIX;
    use aether_model::Endpoint;

    fn web() -> ServiceKey {
        ServiceKey {
            namespace: "d".into(),
            name: "web".into(),
        }
    }

    fn service(eps: &[(&str, u16)]) -> Service {
        Service {
            name: "web".into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: eps
                .iter()
                .map(|(a, p)| Endpoint {
                    address: a.parse().unwrap(),
                    port: *p,
                    service_port: 80,
                    node: "n1".into(),
                    pod: String::new(),
                    state: EndpointState::Healthy,
                    mtls: false,
                })
                .collect(),
        }
    }

    fn show(ops: &[Op]) -> Vec<String> {
        ops.iter()
            .map(|op| match op {
                Op::Put { key, .. } => format!("put {}", key.trim_start_matches(DEFAULT_PREFIX)),
                Op::Delete { key } => format!("delete {}", key.trim_start_matches(DEFAULT_PREFIX)),
                Op::DeletePrefix { prefix } => {
                    format!("delete {}*", prefix.trim_start_matches(DEFAULT_PREFIX))
                }
            })
            .collect()
    }

    /// Applies `ops` to a map standing for etcd.
    fn run(ops: &[Op], etcd: &mut BTreeMap<String, Vec<u8>>) {
        for op in ops {
            match op {
                Op::Put { key, value } => {
                    etcd.insert(key.clone(), value.clone());
                }
                Op::Delete { key } => {
                    etcd.remove(key);
                }
                Op::DeletePrefix { prefix } => etcd.retain(|k, _| !k.starts_with(prefix)),
            }
        }
    }

    #[test]
    fn apply_writes_only_the_difference_and_removes_absent_endpoints() {
        let l = Layout::new(DEFAULT_PREFIX);
        let mut etcd = BTreeMap::new();
        let first = apply_service(
            &l,
            &service(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)]),
            Source::File,
            None,
            &etcd,
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(
            show(&first),
            [
                "put services/d/web",
                "put endpoints/d/web/10.0.0.1/8080",
                "put endpoints/d/web/10.0.0.2/8080"
            ]
        );
        run(&first, &mut etcd);
        let eps = |etcd: &BTreeMap<String, Vec<u8>>| {
            etcd.iter()
                .filter(|(k, _)| k.starts_with(&l.endpoints_of(&web())))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        let svc = etcd.get(&l.service(&web())).cloned();
        assert!(
            apply_service(
                &l,
                &service(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)]),
                Source::File,
                svc.as_deref(),
                &eps(&etcd),
                &BTreeMap::new(),
            )
            .unwrap()
            .is_empty(),
            "the same apply writes nothing"
        );
        let mark = l.mark(&web(), "10.0.0.1".parse().unwrap());
        etcd.insert(mark.clone(), b"{}".to_vec());
        let second = apply_service(
            &l,
            &service(&[("10.0.0.2", 8080), ("10.0.0.3", 8080)]),
            Source::File,
            svc.as_deref(),
            &eps(&etcd),
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(
            show(&second),
            [
                "delete endpoints/d/web/10.0.0.1/8080",
                "put endpoints/d/web/10.0.0.3/8080"
            ]
        );
        run(&second, &mut etcd);
        assert!(etcd.contains_key(&mark), "an apply keeps drain marks");
        run(
            &delete_service(&l, &web(), Source::File, svc.as_deref()).unwrap(),
            &mut etcd,
        );
        assert!(etcd.is_empty(), "{etcd:?}");
    }

    #[test]
    fn apply_stores_the_mtls_mark_and_leaves_values_written_before_it_alone() {
        let l = Layout::new(DEFAULT_PREFIX);
        let (k1, k2) = (
            l.endpoint(&web(), "10.0.0.1".parse().unwrap(), 8080),
            l.endpoint(&web(), "10.0.0.2".parse().unwrap(), 8080),
        );
        // etcd as a registrar without the field left it.
        let old = br#"{"service_port":80,"node":"n1","pod":"","state":"healthy"}"#.to_vec();
        let current: BTreeMap<String, Vec<u8>> =
            [(k1.clone(), old.clone()), (k2.clone(), old.clone())].into();
        let svc = values::encode(&ServiceValue {
            ports: vec![80],
            vip: None,
            source: Source::File,
        });
        let plain = service(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)]);
        let apply_service = |l: &Layout,
                             s: &Service,
                             svc: Option<&Vec<u8>>,
                             current: &BTreeMap<String, Vec<u8>>| {
            apply_service(
                l,
                s,
                Source::File,
                svc.map(Vec::as_slice),
                current,
                &BTreeMap::new(),
            )
            .unwrap()
        };
        assert!(
            apply_service(&l, &plain, Some(&svc), &current).is_empty(),
            "unmarked endpoints are the bytes they were"
        );
        let mut marked = plain.clone();
        marked.endpoints[1].mtls = true;
        let ops = apply_service(&l, &marked, Some(&svc), &current);
        assert_eq!(show(&ops), ["put endpoints/d/web/10.0.0.2/8080"]);
        let Op::Put { value, .. } = &ops[0] else {
            unreachable!()
        };
        assert_eq!(
            value.as_slice(),
            br#"{"service_port":80,"node":"n1","pod":"","state":"healthy","mtls":true}"#
        );
        let after: BTreeMap<String, Vec<u8>> = [(k1, old), (k2, value.clone())].into();
        assert!(
            apply_service(&l, &marked, Some(&svc), &after).is_empty(),
            "the same apply writes nothing"
        );
        assert_eq!(
            show(&apply_service(&l, &plain, Some(&svc), &after)),
            ["put endpoints/d/web/10.0.0.2/8080"],
            "unmarking rewrites it"
        );
    }

    #[test]
    fn kubernetes_wins_over_a_file_and_discovery_removes_only_what_it_wrote() {
        let l = Layout::new(DEFAULT_PREFIX);
        let none = BTreeMap::new();
        let file_value = values::encode(&ServiceValue {
            ports: vec![80],
            vip: None,
            source: Source::File,
        });
        let discovered = values::encode(&ServiceValue {
            ports: vec![80],
            vip: None,
            source: Source::Kubernetes,
        });
        let s = service(&[("10.0.0.1", 8080)]);
        // A file may not change or delete a discovered service.
        assert_eq!(
            apply_service(
                &l,
                &s,
                Source::File,
                Some(&discovered),
                &none,
                &BTreeMap::new()
            ),
            Err(Owned {
                by: Source::Kubernetes
            })
        );
        assert_eq!(
            delete_service(&l, &web(), Source::File, Some(&discovered)),
            Err(Owned {
                by: Source::Kubernetes
            })
        );
        // Discovery takes over a file's service: the value is rewritten with its source.
        let ops = apply_service(
            &l,
            &s,
            Source::Kubernetes,
            Some(&file_value),
            &none,
            &BTreeMap::new(),
        )
        .unwrap();
        assert_eq!(
            show(&ops),
            ["put services/d/web", "put endpoints/d/web/10.0.0.1/8080"]
        );
        let Op::Put { value, .. } = &ops[0] else {
            unreachable!()
        };
        assert_eq!(value, &discovered);
        // Discovery deletes its own services, never a file's; a file deletes its own.
        assert!(
            delete_service(&l, &web(), Source::Kubernetes, Some(&file_value))
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            delete_service(&l, &web(), Source::Kubernetes, Some(&discovered))
                .unwrap()
                .len(),
            3
        );
        assert_eq!(
            delete_service(&l, &web(), Source::File, Some(&file_value))
                .unwrap()
                .len(),
            3
        );
        // A value that does not decode is anybody's.
        assert_eq!(stored_source(Some(b"{oops")), Some(Source::File));
        assert!(
            apply_service(
                &l,
                &s,
                Source::File,
                Some(b"{oops"),
                &none,
                &BTreeMap::new()
            )
            .is_ok()
        );
    }

    fn target(name: &str, nodes: &[&str], current: Option<(EndpointState, &str)>) -> MarkTarget {
        MarkTarget {
            service: ServiceKey {
                namespace: "d".into(),
                name: name.into(),
            },
            endpoint_nodes: nodes.iter().map(|n| n.to_string()).collect(),
            current: current.map(|(state, node)| MarkValue {
                state,
                node: node.into(),
                instance: "agent-a".into(),
            }),
        }
    }

    /// The plan as text: its writes, then "skip <service> (<node>)" for each skipped.
    fn check(state: EndpointState, targets: &[MarkTarget], want: Result<&[&str], MarkRefusal>) {
        let l = Layout::new(DEFAULT_PREFIX);
        let req = MarkRequest {
            address: "10.0.0.1".parse().unwrap(),
            state,
            node: "n1",
            instance: "agent-b",
        };
        let got = set_marks(&l, &req, targets).map(|plan| {
            let marked: Vec<&ServiceKey> = targets
                .iter()
                .map(|t| &t.service)
                .filter(|s| !plan.skipped.iter().any(|k| &k.service == *s))
                .collect();
            assert_eq!(plan.marked.iter().collect::<Vec<_>>(), marked);
            let mut lines = show(&plan.ops);
            lines.extend(
                plan.skipped
                    .iter()
                    .map(|s| format!("skip {} ({})", s.service, s.endpoint_node)),
            );
            lines
        });
        assert_eq!(
            got,
            want.map(|w| w.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        );
    }

    #[test]
    fn marks_are_states_checked_against_the_endpoints_node() {
        use EndpointState::*;
        check(
            Draining,
            &[target("web", &["n1"], None)],
            Ok(&["put marks/d/web/10.0.0.1"]),
        );
        // The same state again, from another instance of the node's agent: no write.
        check(
            Draining,
            &[target("web", &["n1"], Some((Draining, "n1")))],
            Ok(&[]),
        );
        check(
            Healthy,
            &[target("web", &["n1"], Some((Draining, "n1")))],
            Ok(&["delete marks/d/web/10.0.0.1"]),
        );
        check(Healthy, &[target("web", &["n1"], None)], Ok(&[]));
        check(Draining, &[], Err(MarkRefusal::NotFound));
        check(
            Draining,
            &[target("web", &["n1", "n2"], None)],
            Err(MarkRefusal::OtherNode {
                service: web(),
                endpoint_node: "n2".into(),
            }),
        );
        check(
            Draining,
            &[target("web", &[""], None)],
            Err(MarkRefusal::OtherNode {
                service: web(),
                endpoint_node: "".into(),
            }),
        );
    }

    #[test]
    fn a_service_on_another_node_is_skipped_and_named_and_blocks_no_other() {
        use EndpointState::*;
        // A second service lists the address under n2: the caller's own service is still
        // marked, the other is skipped, whatever the order.
        check(
            Draining,
            &[target("spoof", &["n2"], None), target("web", &["n1"], None)],
            Ok(&["put marks/d/web/10.0.0.1", "skip d/spoof (n2)"]),
        );
        check(
            Draining,
            &[
                target("api", &["n1"], None),
                target("spoof", &["n1", "n2"], None),
                target("web", &["n1"], Some((Draining, "n1"))),
            ],
            Ok(&["put marks/d/api/10.0.0.1", "skip d/spoof (n2)"]),
        );
        // A skipped service's mark is left as it is, even when asked for HEALTHY.
        check(
            Healthy,
            &[
                target("spoof", &["n2"], Some((Draining, "n2"))),
                target("web", &["n1"], Some((Draining, "n1"))),
            ],
            Ok(&["delete marks/d/web/10.0.0.1", "skip d/spoof (n2)"]),
        );
        // Nothing at the address on the caller's node: refused, naming the first.
        check(
            Draining,
            &[target("api", &["n3"], None), target("web", &["n2"], None)],
            Err(MarkRefusal::OtherNode {
                service: ServiceKey {
                    namespace: "d".into(),
                    name: "api".into(),
                },
                endpoint_node: "n3".into(),
            }),
        );
    }

    fn pairs(list: &[(&str, &str, &str)]) -> PairsValue {
        PairsValue::new(
            list.iter()
                .map(|(tcp, quic, sni)| values::PairValue {
                    tcp: tcp.parse().unwrap(),
                    quic: (*quic).into(),
                    quic_sni: (*sni).into(),
                    pod: "d/p".into(),
                    since: 1,
                })
                .collect(),
        )
    }

    /// The endpoint value stored for `node`, with a twin or without.
    fn ep_value(node: &str, quic: &str, sni: &str) -> Vec<u8> {
        values::encode(&EndpointValue {
            service_port: 80,
            node: node.into(),
            pod: String::new(),
            state: EndpointState::Healthy,
            mtls: false,
            quic: quic.into(),
            quic_sni: sni.into(),
        })
    }

    /// A node's pairs reach only its own endpoints at the pairs' address and port; a set
    /// already carried writes nothing; a removed pair clears its endpoint's twin.
    #[test]
    fn twins_follow_the_nodes_pairs_and_a_restated_set_writes_nothing() {
        let l = Layout::new(DEFAULT_PREFIX);
        let ip = |a: &str| a.parse::<IpAddr>().unwrap();
        let mut etcd: BTreeMap<String, Vec<u8>> = [
            (
                l.endpoint(&web(), ip("10.0.0.1"), 8080),
                ep_value("n1", "", ""),
            ),
            (
                l.endpoint(&web(), ip("10.0.0.1"), 9090),
                ep_value("n1", "", ""),
            ),
            (
                l.endpoint(&web(), ip("10.0.0.2"), 8080),
                ep_value("n2", "", ""),
            ),
            (l.mark(&web(), ip("10.0.0.1")), b"{}".to_vec()),
        ]
        .into();
        let kvs = |etcd: &BTreeMap<String, Vec<u8>>| -> Vec<(Vec<u8>, Vec<u8>)> {
            etcd.iter()
                .map(|(k, v)| (k.clone().into_bytes(), v.clone()))
                .collect()
        };
        let set = pairs(&[
            ("10.0.0.1:8080", "n1.example:4443", "web.d.example"),
            ("10.0.0.2:8080", "n1.example:4443", ""),
            ("10.0.0.3:8080", "n1.example:4443", ""),
        ]);
        let plan = twins(&l, "n1", &set, &kvs(&etcd));
        // 10.0.0.2 runs on n2: n1's pair for it is not n1's to apply. 10.0.0.3 has no
        // endpoint yet.
        assert_eq!(show(&plan.ops), ["put endpoints/d/web/10.0.0.1/8080"]);
        assert_eq!(plan.unmatched, 2);
        let Op::Put { value, .. } = &plan.ops[0] else {
            unreachable!()
        };
        assert_eq!(
            value.as_slice(),
            br#"{"service_port":80,"node":"n1","pod":"","state":"healthy","quic":"n1.example:4443","quic_sni":"web.d.example"}"#
        );
        run(&plan.ops, &mut etcd);
        assert_eq!(
            twins(&l, "n1", &set, &kvs(&etcd)),
            TwinPlan {
                ops: vec![],
                unmatched: 2
            }
        );
        // A changed SNI rewrites; a removed pair clears.
        let sni = pairs(&[("10.0.0.1:8080", "n1.example:4443", "other.d.example")]);
        assert_eq!(
            show(&twins(&l, "n1", &sni, &kvs(&etcd)).ops),
            ["put endpoints/d/web/10.0.0.1/8080"]
        );
        let cleared = twins(&l, "n1", &PairsValue::default(), &kvs(&etcd));
        assert_eq!(show(&cleared.ops), ["put endpoints/d/web/10.0.0.1/8080"]);
        run(&cleared.ops, &mut etcd);
        assert_eq!(
            etcd[&l.endpoint(&web(), ip("10.0.0.1"), 8080)],
            ep_value("n1", "", "")
        );
    }

    /// An apply gives each endpoint the twin its node's pairs name (a pair set before the
    /// endpoint existed applies when it appears), and keeps it on a later apply.
    #[test]
    fn apply_gives_endpoints_their_nodes_twins() {
        let l = Layout::new(DEFAULT_PREFIX);
        let by_node: BTreeMap<String, PairsValue> = [
            (
                "n1".to_owned(),
                pairs(&[("10.0.0.1:8080", "n1.example:4443", "s.example")]),
            ),
            (
                "n2".to_owned(),
                pairs(&[("10.0.0.2:8080", "n2.example:4443", "")]),
            ),
        ]
        .into();
        // Both endpoints are on n1 (`service` puts them there): n2's pair does not apply.
        let s = service(&[("10.0.0.1", 8080), ("10.0.0.2", 8080)]);
        let ops = apply_service(&l, &s, Source::File, None, &BTreeMap::new(), &by_node).unwrap();
        let mut etcd = BTreeMap::new();
        run(&ops, &mut etcd);
        let ip = |a: &str| a.parse::<IpAddr>().unwrap();
        assert_eq!(
            etcd[&l.endpoint(&web(), ip("10.0.0.1"), 8080)],
            ep_value("n1", "n1.example:4443", "s.example")
        );
        assert_eq!(
            etcd[&l.endpoint(&web(), ip("10.0.0.2"), 8080)],
            ep_value("n1", "", "")
        );
        let svc = etcd.get(&l.service(&web())).cloned();
        let eps: BTreeMap<String, Vec<u8>> = etcd
            .iter()
            .filter(|(k, _)| k.starts_with(&l.endpoints_of(&web())))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert!(
            apply_service(&l, &s, Source::File, svc.as_deref(), &eps, &by_node)
                .unwrap()
                .is_empty(),
            "the same apply keeps the twin and writes nothing"
        );
    }
}
