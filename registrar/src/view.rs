//! What the registry's etcd keys mean as the API's messages: a full view from a range
//! read, a change batch from a watch response, and a client's view built from them (for
//! `aether-registrar dump` and the tests), rendered as sorted JSON.
//!
//! Pure: keys and values in, messages and the rejected keys out. A key that does not
//! parse or a value that does not decode is data, not a crash: it comes back as a
//! [`Rejected`] for the caller to log, and the rest of the view or batch goes on.

use std::collections::BTreeMap;
use std::net::IpAddr;

use aether_model::{EndpointState, ServiceKey};
use bytes::Bytes;
use serde::Serialize;
use shared_proto::registry as pb;

use crate::keys::{Key, Layout};
use crate::values::{self, EndpointValue, MarkValue, ServiceValue};

/// A key skipped because it or its value is corrupt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub key: String,
    pub error: String,
}

impl Rejected {
    fn new(key: &[u8], error: impl std::fmt::Display) -> Self {
        Self {
            key: String::from_utf8_lossy(key).into_owned(),
            error: error.to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Put,
    Delete,
}

/// One etcd watch event, as plain bytes.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    pub kind: EventKind,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

/// The registry at `revision` from every key under the prefix. Endpoints of a service
/// that has no service key are left out (and reported), as a client that applies changes
/// leaves them out; every write of the registrar puts or deletes a service together with
/// its endpoints, so only a hand edit of etcd makes one.
pub fn full_view<'a>(
    layout: &Layout,
    revision: i64,
    kvs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> (pb::FullView, Vec<Rejected>) {
    let mut rejected = Vec::new();
    type Endpoints = BTreeMap<(IpAddr, u16), EndpointValue>;
    let mut services: BTreeMap<ServiceKey, (ServiceValue, Endpoints)> = BTreeMap::new();
    let mut endpoints: Vec<(ServiceKey, IpAddr, u16, EndpointValue, &[u8])> = Vec::new();
    let mut marks: BTreeMap<(ServiceKey, IpAddr), MarkValue> = BTreeMap::new();
    for (key, value) in kvs {
        let text = String::from_utf8_lossy(key);
        match layout.parse(key) {
            Err(e) => rejected.push(Rejected::new(key, e)),
            Ok(Key::Service(s)) => match values::decode::<ServiceValue>(&text, "service", value) {
                Ok(v) => {
                    services.insert(s, (v, BTreeMap::new()));
                }
                Err(e) => rejected.push(Rejected::new(key, e)),
            },
            Ok(Key::Endpoint {
                service,
                address,
                port,
            }) => match values::decode::<EndpointValue>(&text, "endpoint", value) {
                Ok(v) => endpoints.push((service, address, port, v, key)),
                Err(e) => rejected.push(Rejected::new(key, e)),
            },
            Ok(Key::Mark { service, address }) => {
                match values::decode::<MarkValue>(&text, "drain mark", value) {
                    Ok(v) => {
                        marks.insert((service, address), v);
                    }
                    Err(e) => rejected.push(Rejected::new(key, e)),
                }
            }
            // A node's pairs reach clients on its endpoints (`quic`, `quic_sni`), which
            // the registrar writes from them; the set itself is not part of the view.
            Ok(Key::QuicPairs { .. }) => {}
        }
    }
    for (service, address, port, v, key) in endpoints {
        match services.get_mut(&service) {
            Some((_, eps)) => {
                eps.insert((address, port), v);
            }
            None => rejected.push(Rejected::new(
                key,
                format!("endpoint of {service}, which has no service key"),
            )),
        }
    }
    let view = pb::FullView {
        revision,
        services: services
            .iter()
            .map(|(k, (v, eps))| {
                let mut s = values::service_to_pb(k, v);
                s.endpoints = eps
                    .iter()
                    .map(|((a, p), e)| values::endpoint_to_pb(*a, *p, e))
                    .collect();
                s
            })
            .collect(),
        marks: marks
            .iter()
            .map(|((s, a), m)| values::mark_to_pb(s, *a, m))
            .collect(),
        resync: false,
        reason: String::new(),
    };
    (view, rejected)
}

/// What one watch event means for a client; None for a key clients do not see (a node's
/// QUIC pairs, which reach them as the endpoint upserts written with the set).
pub fn change(layout: &Layout, ev: &Event<'_>) -> Result<Option<pb::Change>, Rejected> {
    use pb::change::Kind;
    let key = layout.parse(ev.key).map_err(|e| Rejected::new(ev.key, e))?;
    let text = String::from_utf8_lossy(ev.key);
    let kind = match (key, ev.kind) {
        (Key::Service(s), EventKind::Put) => {
            let v = values::decode::<ServiceValue>(&text, "service", ev.value)
                .map_err(|e| Rejected::new(ev.key, e))?;
            Kind::ServiceUpserted(values::service_to_pb(&s, &v))
        }
        (Key::Service(s), EventKind::Delete) => Kind::ServiceRemoved(values::key_to_pb(&s)),
        (
            Key::Endpoint {
                service,
                address,
                port,
            },
            EventKind::Put,
        ) => {
            let v = values::decode::<EndpointValue>(&text, "endpoint", ev.value)
                .map_err(|e| Rejected::new(ev.key, e))?;
            Kind::EndpointUpserted(pb::EndpointUpsert {
                service: Some(values::key_to_pb(&service)),
                endpoint: Some(values::endpoint_to_pb(address, port, &v)),
            })
        }
        (
            Key::Endpoint {
                service,
                address,
                port,
            },
            EventKind::Delete,
        ) => Kind::EndpointRemoved(pb::EndpointRemoval {
            service: Some(values::key_to_pb(&service)),
            address: address.to_string(),
            port: u32::from(port),
        }),
        (Key::Mark { service, address }, EventKind::Put) => {
            let v = values::decode::<MarkValue>(&text, "drain mark", ev.value)
                .map_err(|e| Rejected::new(ev.key, e))?;
            Kind::StateChanged(values::mark_to_pb(&service, address, &v))
        }
        // A removed mark reads as HEALTHY, set by no node.
        (Key::Mark { service, address }, EventKind::Delete) => Kind::StateChanged(pb::DrainMark {
            service: Some(values::key_to_pb(&service)),
            address: address.to_string(),
            state: values::state_to_pb(EndpointState::Healthy),
            node: String::new(),
        }),
        (Key::QuicPairs { .. }, _) => return Ok(None),
    };
    Ok(Some(pb::Change { kind: Some(kind) }))
}

/// The changes of one watch response, which bring a view to `revision`. Empty when the
/// response held only keys clients do not see.
pub fn batch<'a>(
    layout: &Layout,
    revision: i64,
    events: impl IntoIterator<Item = Event<'a>>,
) -> (pb::ChangeBatch, Vec<Rejected>) {
    let mut rejected = Vec::new();
    let changes = events
        .into_iter()
        .filter_map(|ev| change(layout, &ev).map_err(|r| rejected.push(r)).ok()?)
        .collect();
    (pb::ChangeBatch { revision, changes }, rejected)
}

/// Every key under the prefix and its value, in etcd's order: what the registrar keeps
/// of etcd ([`crate::kept`]).
pub type Keys = imbl::OrdMap<Bytes, Bytes>;

/// One service's share of a full view: the service with its endpoints (None while it has
/// no service key) and its drain marks.
#[derive(Debug, Clone, Default, PartialEq)]
struct Part {
    service: Option<pb::Service>,
    marks: Vec<pb::DrainMark>,
}

/// A full view kept by service, so that the view after a few changes rebuilds only the
/// services they touched: [`full_view`] of one service's keys (its service key, its
/// endpoints, its marks) is that service's share of the full view of every key, since
/// [`full_view`] groups endpoints and marks by service and sorts services by key.
#[derive(Debug, Default)]
pub struct Parts {
    revision: i64,
    by_service: BTreeMap<ServiceKey, Part>,
}

impl Parts {
    /// Every part, from every key at `revision`.
    pub fn build(layout: &Layout, revision: i64, keys: &Keys) -> (Parts, Vec<Rejected>) {
        let (full, rejected) = full_view(
            layout,
            revision,
            keys.iter().map(|(k, v)| (k.as_ref(), v.as_ref())),
        );
        let mut by_service: BTreeMap<ServiceKey, Part> = BTreeMap::new();
        for s in full.services {
            let key = service_key(&s.key).expect("full_view names every service");
            by_service.entry(key).or_default().service = Some(s);
        }
        for m in full.marks {
            let key = service_key(&m.service).expect("full_view names every mark's service");
            by_service.entry(key).or_default().marks.push(m);
        }
        (
            Parts {
                revision,
                by_service,
            },
            rejected,
        )
    }

    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Rebuilds the parts of the services in `touched` from `keys` at `revision`; the
    /// corrupt entries among their keys.
    pub fn update(
        &mut self,
        layout: &Layout,
        revision: i64,
        keys: &Keys,
        touched: impl IntoIterator<Item = ServiceKey>,
    ) -> Vec<Rejected> {
        use std::ops::Bound;
        let mut rejected = Vec::new();
        for s in touched {
            let service = layout.service(&s);
            let mut kvs: Vec<(&[u8], &[u8])> = Vec::new();
            if let Some((k, v)) = keys.get_key_value(service.as_bytes()) {
                kvs.push((k, v));
            }
            for prefix in [layout.endpoints_of(&s), layout.marks_of(&s)] {
                let end = crate::store::prefix_end(prefix.as_bytes());
                let range: (Bound<&[u8]>, Bound<&[u8]>) =
                    (Bound::Included(prefix.as_bytes()), Bound::Excluded(&end));
                kvs.extend(
                    keys.range::<_, [u8]>(range)
                        .map(|(k, v)| (k.as_ref(), v.as_ref())),
                );
            }
            let (full, r) = full_view(layout, revision, kvs);
            rejected.extend(r);
            let part = Part {
                service: full.services.into_iter().next(),
                marks: full.marks,
            };
            if part.service.is_none() && part.marks.is_empty() {
                self.by_service.remove(&s);
            } else {
                self.by_service.insert(s, part);
            }
        }
        self.revision = revision;
        rejected
    }

    /// The full view the parts make.
    pub fn view(&self) -> pb::FullView {
        pb::FullView {
            revision: self.revision,
            services: self
                .by_service
                .values()
                .filter_map(|p| p.service.clone())
                .collect(),
            marks: self
                .by_service
                .values()
                .flat_map(|p| p.marks.iter().cloned())
                .collect(),
            resync: false,
            reason: String::new(),
        }
    }
}

/// The service a key belongs to, if it is a service's, an endpoint's or a mark's.
pub fn owner(key: &Key) -> Option<&ServiceKey> {
    match key {
        Key::Service(s) => Some(s),
        Key::Endpoint { service, .. } | Key::Mark { service, .. } => Some(service),
        Key::QuicPairs { .. } => None,
    }
}

/// A client's view of the registry: a full view with the change batches after it
/// applied. Equal views render to equal bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub revision: i64,
    services: BTreeMap<ServiceKey, ViewService>,
    marks: BTreeMap<(ServiceKey, IpAddr), (EndpointState, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct ViewService {
    ports: Vec<u16>,
    vip: Option<IpAddr>,
    endpoints: BTreeMap<(IpAddr, u16), EndpointValue>,
}

/// A message the registrar would not send: a field out of range or a missing key.
#[derive(Debug, thiserror::Error)]
#[error("unexpected message from the registrar: {0}")]
pub struct BadMessage(String);

fn service_key(k: &Option<pb::ServiceKey>) -> Result<ServiceKey, BadMessage> {
    k.as_ref()
        .map(values::key_from_pb)
        .ok_or_else(|| BadMessage("a service key is missing".into()))
}

fn ip(s: &str) -> Result<IpAddr, BadMessage> {
    s.parse()
        .map_err(|_| BadMessage(format!("address {s:?} is not an IP")))
}

fn port(p: u32) -> Result<u16, BadMessage> {
    u16::try_from(p).map_err(|_| BadMessage(format!("port {p} is out of range")))
}

fn state(s: i32) -> Result<EndpointState, BadMessage> {
    values::state_from_pb(s).ok_or_else(|| BadMessage(format!("state {s} is not defined")))
}

impl View {
    /// The view a full view describes.
    pub fn from_full(full: &pb::FullView) -> Result<Self, BadMessage> {
        let mut view = View {
            revision: full.revision,
            ..Default::default()
        };
        for s in &full.services {
            let key = service_key(&s.key)?;
            view.upsert_service(key.clone(), s)?;
            for e in &s.endpoints {
                view.upsert_endpoint(&key, e)?;
            }
        }
        for m in &full.marks {
            view.set_mark(m)?;
        }
        Ok(view)
    }

    /// Applies one batch of changes.
    pub fn apply(&mut self, batch: &pb::ChangeBatch) -> Result<(), BadMessage> {
        use pb::change::Kind;
        for c in &batch.changes {
            match &c.kind {
                Some(Kind::ServiceUpserted(s)) => self.upsert_service(service_key(&s.key)?, s)?,
                Some(Kind::ServiceRemoved(k)) => {
                    self.services.remove(&values::key_from_pb(k));
                }
                Some(Kind::EndpointUpserted(u)) => {
                    let e = u
                        .endpoint
                        .as_ref()
                        .ok_or_else(|| BadMessage("an endpoint upsert has no endpoint".into()))?;
                    self.upsert_endpoint(&service_key(&u.service)?, e)?;
                }
                Some(Kind::EndpointRemoved(r)) => {
                    if let Some(s) = self.services.get_mut(&service_key(&r.service)?) {
                        s.endpoints.remove(&(ip(&r.address)?, port(r.port)?));
                    }
                }
                Some(Kind::StateChanged(m)) => self.set_mark(m)?,
                None => return Err(BadMessage("a change has no kind".into())),
            }
        }
        self.revision = batch.revision;
        Ok(())
    }

    fn upsert_service(&mut self, key: ServiceKey, s: &pb::Service) -> Result<(), BadMessage> {
        let ports = s
            .ports
            .iter()
            .map(|p| port(*p))
            .collect::<Result<Vec<_>, _>>()?;
        let vip = if s.vip.is_empty() {
            None
        } else {
            Some(ip(&s.vip)?)
        };
        let entry = self.services.entry(key).or_insert_with(|| ViewService {
            ports: Vec::new(),
            vip: None,
            endpoints: BTreeMap::new(),
        });
        entry.ports = ports;
        entry.vip = vip;
        Ok(())
    }

    /// An endpoint of a service the view does not hold is dropped, as the full view
    /// drops it.
    fn upsert_endpoint(&mut self, key: &ServiceKey, e: &pb::Endpoint) -> Result<(), BadMessage> {
        let v = EndpointValue {
            service_port: port(e.service_port)?,
            node: e.node.clone(),
            pod: e.pod.clone(),
            state: state(e.state)?,
            mtls: e.mtls,
            quic: e.quic.clone(),
            quic_sni: e.quic_sni.clone(),
        };
        let at = (ip(&e.address)?, port(e.port)?);
        if let Some(s) = self.services.get_mut(key) {
            s.endpoints.insert(at, v);
        }
        Ok(())
    }

    /// A HEALTHY mark with no node is a removed mark.
    fn set_mark(&mut self, m: &pb::DrainMark) -> Result<(), BadMessage> {
        let at = (service_key(&m.service)?, ip(&m.address)?);
        let st = state(m.state)?;
        if st == EndpointState::Healthy && m.node.is_empty() {
            self.marks.remove(&at);
        } else {
            self.marks.insert(at, (st, m.node.clone()));
        }
        Ok(())
    }

    /// The view as pretty JSON, sorted: `services` in the registry file's schema, each
    /// endpoint with its effective state (a DRAINING mark on its address overrides
    /// HEALTHY) and `"mtls": true` when it is marked so (left out when false, the file's
    /// default), `quic` and `quic_sni` where the endpoint has a QUIC twin (left out when
    /// empty), then `marks`. The revision is left out, so that the views of two
    /// replicas, or of a client and the registrar, compare byte for byte.
    pub fn to_json(&self) -> String {
        #[derive(Serialize)]
        struct Doc<'a> {
            services: Vec<DocService<'a>>,
            marks: Vec<DocMark<'a>>,
        }
        #[derive(Serialize)]
        struct DocService<'a> {
            name: &'a str,
            namespace: &'a str,
            ports: &'a [u16],
            #[serde(skip_serializing_if = "Option::is_none")]
            vip: Option<IpAddr>,
            endpoints: Vec<DocEndpoint<'a>>,
        }
        #[derive(Serialize)]
        struct DocEndpoint<'a> {
            address: IpAddr,
            port: u16,
            service_port: u16,
            node: &'a str,
            pod: &'a str,
            state: EndpointState,
            #[serde(skip_serializing_if = "std::ops::Not::not")]
            mtls: bool,
            #[serde(skip_serializing_if = "str::is_empty")]
            quic: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            quic_sni: &'a str,
        }
        #[derive(Serialize)]
        struct DocMark<'a> {
            namespace: &'a str,
            name: &'a str,
            address: IpAddr,
            state: EndpointState,
            node: &'a str,
        }
        let doc = Doc {
            services: self
                .services
                .iter()
                .map(|(k, s)| DocService {
                    name: &k.name,
                    namespace: &k.namespace,
                    ports: &s.ports,
                    vip: s.vip,
                    endpoints: s
                        .endpoints
                        .iter()
                        .map(|((address, port), e)| {
                            let marked = matches!(
                                self.marks.get(&(k.clone(), *address)),
                                Some((EndpointState::Draining, _))
                            );
                            let state = if marked {
                                EndpointState::Draining
                            } else {
                                e.state
                            };
                            DocEndpoint {
                                address: *address,
                                port: *port,
                                service_port: e.service_port,
                                node: &e.node,
                                pod: &e.pod,
                                state,
                                mtls: e.mtls,
                                quic: &e.quic,
                                quic_sni: &e.quic_sni,
                            }
                        })
                        .collect(),
                })
                .collect(),
            marks: self
                .marks
                .iter()
                .map(|((k, address), (state, node))| DocMark {
                    namespace: &k.namespace,
                    name: &k.name,
                    address: *address,
                    state: *state,
                    node,
                })
                .collect(),
        };
        let mut out = serde_json::to_string_pretty(&doc).expect("a view serializes");
        out.push('\n');
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::DEFAULT_PREFIX;

    fn layout() -> Layout {
        Layout::new(DEFAULT_PREFIX)
    }

    fn k(s: &str) -> Vec<u8> {
        format!("{DEFAULT_PREFIX}{s}").into_bytes()
    }

    const WEB: &str = r#"{"ports":[80],"vip":"10.96.0.1"}"#;
    const EP: &str = r#"{"service_port":80,"node":"n1","pod":"web-1","state":"healthy"}"#;
    /// An endpoint marked mTLS-capable, as the registrar stores it.
    const EP_MTLS: &str =
        r#"{"service_port":80,"node":"n1","pod":"web-1","state":"healthy","mtls":true}"#;
    /// An endpoint with a QUIC twin, as the registrar writes it from its node's pairs.
    const EP_QUIC: &str = r#"{"service_port":80,"node":"n1","pod":"web-1","state":"healthy","quic":"n1.example:4443","quic_sni":"web-1.d.example"}"#;
    const PAIRS: &str = r#"{"pairs":[{"tcp":"10.0.0.1:8080","quic":"n1.example:4443","quic_sni":"web-1.d.example","pod":"d/web-1","since":1}]}"#;
    const MARK: &str = r#"{"state":"draining","node":"n1","instance":"agent-a"}"#;

    /// A full view kept by service and rebuilt only for the services a batch touched is
    /// the full view of every key, after every batch of random puts and deletes:
    /// services, endpoints (some of a service with no service key), marks, corrupt
    /// values, a node's QUIC pairs and a key of no layout, over names that share
    /// prefixes (`web`, `web2`).
    #[test]
    fn parts_rebuilt_for_the_touched_services_make_the_full_view_of_every_key() {
        let layout = layout();
        let names = ["d/web", "d/web2", "d/db", "e/web"];
        let mut next = {
            let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
            move |n: usize| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % n as u64) as usize
            }
        };
        let mut keys = Keys::new();
        let (mut parts, _) = Parts::build(&layout, 0, &keys);
        let mut rebuilt = 0;
        for revision in 1..=400 {
            let mut touched = std::collections::BTreeSet::new();
            for _ in 0..1 + next(4) {
                let name = names[next(names.len())];
                let key = match next(5) {
                    0 => k(&format!("services/{name}")),
                    1 | 2 => k(&format!(
                        "endpoints/{name}/10.0.0.{}/{}",
                        1 + next(12),
                        8080 + next(2)
                    )),
                    3 => k(&format!("marks/{name}/10.0.0.{}", 1 + next(12))),
                    _ => k(["quic-pairs/n1", "stray/x"][next(2)]),
                };
                let value = match (next(12), key.windows(9).any(|w| w == b"services/")) {
                    (0, _) => "{not json",
                    (_, true) => WEB,
                    _ if key.windows(6).any(|w| w == b"marks/") => MARK,
                    _ if key.windows(10).any(|w| w == b"quic-pairs") => PAIRS,
                    _ => [EP, EP_MTLS, EP_QUIC][next(3)],
                };
                if let Some(s) = layout.parse(&key).ok().as_ref().and_then(owner) {
                    touched.insert(s.clone());
                }
                let key = Bytes::from(key);
                if next(3) == 0 {
                    keys.remove(&key);
                } else {
                    keys.insert(key, Bytes::from_static(value.as_bytes()));
                }
            }
            rebuilt += touched.len();
            parts.update(&layout, revision, &keys, touched);
            let (whole, _) = full_view(
                &layout,
                revision,
                keys.iter().map(|(k, v)| (k.as_ref(), v.as_ref())),
            );
            assert_eq!(parts.view(), whole, "at revision {revision}");
            assert_eq!(Parts::build(&layout, revision, &keys).0.view(), whole);
        }
        let whole = parts.view();
        assert!(
            !whole.services.is_empty() && !whole.marks.is_empty() && rebuilt < 400 * names.len(),
            "the walk reached services and marks, rebuilding {rebuilt} parts"
        );
    }

    #[test]
    fn a_full_view_groups_endpoints_under_services_and_skips_what_is_corrupt() {
        let kvs: Vec<(Vec<u8>, &str)> = vec![
            (k("endpoints/d/web/10.0.0.2/8080"), EP),
            (k("endpoints/d/web/10.0.0.10/8080"), EP),
            (k("endpoints/d/gone/10.0.0.3/8080"), EP),
            (k("endpoints/d/web/10.0.0.4/8080"), "{not json"),
            (k("marks/d/web/10.0.0.2"), MARK),
            (k("services/d/web"), WEB),
            (k("services/d/bad"), r#"{"ports":"80"}"#),
            (k("stray"), "{}"),
        ];
        let (view, rejected) = full_view(
            &layout(),
            42,
            kvs.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())),
        );
        assert_eq!(view.revision, 42);
        assert_eq!(view.services.len(), 1);
        let web = &view.services[0];
        assert_eq!(
            (web.ports.as_slice(), web.vip.as_str()),
            ([80].as_slice(), "10.96.0.1")
        );
        // Sorted by address as an IP, not as text.
        let eps: Vec<&str> = web.endpoints.iter().map(|e| e.address.as_str()).collect();
        assert_eq!(eps, ["10.0.0.2", "10.0.0.10"]);
        assert_eq!(view.marks.len(), 1);
        assert_eq!(view.marks[0].state, pb::EndpointState::Draining as i32);
        let mut keys: Vec<&str> = rejected.iter().map(|r| r.key.as_str()).collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "/aether/registry/endpoints/d/gone/10.0.0.3/8080",
                "/aether/registry/endpoints/d/web/10.0.0.4/8080",
                "/aether/registry/services/d/bad",
                "/aether/registry/stray"
            ]
        );
    }

    /// One check per mapping: the event, then the change as its debug text.
    fn check(kind: EventKind, key: &str, value: &str, want: &str) {
        let key = k(key);
        let got = change(
            &layout(),
            &Event {
                kind,
                key: &key,
                value: value.as_bytes(),
            },
        );
        let got = match got {
            Ok(Some(c)) => format!("{:?}", c.kind.unwrap()),
            Ok(None) => "nothing".to_owned(),
            Err(r) => format!("rejected {}: {}", r.key, r.error),
        };
        assert!(got.contains(want), "{got}\n lacks {want}");
    }

    #[test]
    fn watch_events_map_to_changes() {
        use EventKind::*;
        check(
            Put,
            "services/d/web",
            WEB,
            r#"ServiceUpserted(Service { key: Some(ServiceKey { namespace: "d", name: "web" }), ports: [80], vip: "10.96.0.1", endpoints: [] })"#,
        );
        check(
            Delete,
            "services/d/web",
            "",
            r#"ServiceRemoved(ServiceKey { namespace: "d", name: "web" })"#,
        );
        check(
            Put,
            "endpoints/d/web/10.0.0.1/8080",
            EP,
            r#"EndpointUpserted(EndpointUpsert { service: Some(ServiceKey { namespace: "d", name: "web" }), endpoint: Some(Endpoint { address: "10.0.0.1", port: 8080, service_port: 80, node: "n1", pod: "web-1", state: Healthy, mtls: false, quic: "", quic_sni: "" }) })"#,
        );
        check(
            Put,
            "endpoints/d/web/10.0.0.1/8080",
            EP_MTLS,
            r#"endpoint: Some(Endpoint { address: "10.0.0.1", port: 8080, service_port: 80, node: "n1", pod: "web-1", state: Healthy, mtls: true, quic: "", quic_sni: "" }) })"#,
        );
        check(
            Delete,
            "endpoints/d/web/10.0.0.1/8080",
            "",
            r#"EndpointRemoved(EndpointRemoval { service: Some(ServiceKey { namespace: "d", name: "web" }), address: "10.0.0.1", port: 8080 })"#,
        );
        check(
            Put,
            "marks/d/web/10.0.0.1",
            MARK,
            r#"StateChanged(DrainMark { service: Some(ServiceKey { namespace: "d", name: "web" }), address: "10.0.0.1", state: Draining, node: "n1" })"#,
        );
        check(
            Delete,
            "marks/d/web/10.0.0.1",
            "",
            r#"StateChanged(DrainMark { service: Some(ServiceKey { namespace: "d", name: "web" }), address: "10.0.0.1", state: Healthy, node: "" })"#,
        );
        check(
            Put,
            "marks/d/web/10.0.0.1",
            "[]",
            "rejected /aether/registry/marks/d/web/10.0.0.1: value of",
        );
        check(
            Put,
            "services/d",
            WEB,
            "rejected /aether/registry/services/d: key",
        );
        // A node's pairs are not sent as such: its endpoints carry them.
        check(Put, "quic-pairs/n1", PAIRS, "nothing");
        check(Delete, "quic-pairs/n1", "", "nothing");
        check(
            Put,
            "endpoints/d/web/10.0.0.1/8080",
            EP_QUIC,
            r#"mtls: false, quic: "n1.example:4443", quic_sni: "web-1.d.example" }"#,
        );
    }

    #[test]
    fn a_client_view_from_changes_equals_the_full_view_read_after_them() {
        let l = layout();
        let before: Vec<(Vec<u8>, &str)> = vec![
            (k("services/d/web"), WEB),
            (k("endpoints/d/web/10.0.0.1/8080"), EP),
        ];
        let (full, _) = full_view(
            &l,
            5,
            before.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())),
        );
        let mut view = View::from_full(&full).unwrap();

        let (k1, k2, k3, k4) = (
            k("endpoints/d/web/10.0.0.2/8080"),
            k("marks/d/web/10.0.0.1"),
            k("services/d/api"),
            k("endpoints/d/api/10.0.0.9/81"),
        );
        let ep_api = r#"{"service_port":81}"#;
        let events = [
            Event {
                kind: EventKind::Put,
                key: &k1,
                value: EP.as_bytes(),
            },
            Event {
                kind: EventKind::Put,
                key: &k2,
                value: MARK.as_bytes(),
            },
            Event {
                kind: EventKind::Put,
                key: &k3,
                value: br#"{"ports":[81]}"#,
            },
            Event {
                kind: EventKind::Put,
                key: &k4,
                value: ep_api.as_bytes(),
            },
        ];
        let (b, rejected) = batch(&l, 6, events);
        assert!(rejected.is_empty());
        view.apply(&b).unwrap();
        let k5 = k("services/d/api");
        let k6 = k("endpoints/d/api/10.0.0.9/81");
        let (b, _) = batch(
            &l,
            7,
            [
                Event {
                    kind: EventKind::Delete,
                    key: &k5,
                    value: b"",
                },
                Event {
                    kind: EventKind::Delete,
                    key: &k6,
                    value: b"",
                },
            ],
        );
        view.apply(&b).unwrap();
        assert_eq!(view.revision, 7);

        let after: Vec<(Vec<u8>, &str)> = vec![
            (k("services/d/web"), WEB),
            (k("endpoints/d/web/10.0.0.1/8080"), EP),
            (k("endpoints/d/web/10.0.0.2/8080"), EP),
            (k("marks/d/web/10.0.0.1"), MARK),
        ];
        let (full, _) = full_view(
            &l,
            7,
            after.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())),
        );
        let fresh = View::from_full(&full).unwrap();
        assert_eq!(view, fresh);
        let json = fresh.to_json();
        assert_eq!(json, view.to_json());
        // The mark makes 10.0.0.1 draining in the services; 10.0.0.2 stays healthy.
        let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
        let states: Vec<&str> = doc["services"][0]["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["state"].as_str().unwrap())
            .collect();
        assert_eq!(states, ["draining", "healthy"]);
        assert_eq!(doc["marks"][0]["node"], "n1");

        // A removed mark (HEALTHY, no node) leaves the view.
        let (b, _) = batch(
            &l,
            8,
            [Event {
                kind: EventKind::Delete,
                key: &k2,
                value: b"",
            }],
        );
        view.apply(&b).unwrap();
        assert!(view.to_json().contains("\"marks\": []"));
    }

    #[test]
    fn the_mtls_mark_reaches_the_full_view_the_changes_and_the_dump() {
        let l = layout();
        let kvs: Vec<(Vec<u8>, &str)> = vec![
            (k("services/d/web"), WEB),
            (k("endpoints/d/web/10.0.0.1/8080"), EP),
            (k("endpoints/d/web/10.0.0.2/8080"), EP_MTLS),
        ];
        let (full, rejected) =
            full_view(&l, 3, kvs.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())));
        assert!(rejected.is_empty(), "{rejected:?}");
        let marks: Vec<(&str, bool)> = full.services[0]
            .endpoints
            .iter()
            .map(|e| (e.address.as_str(), e.mtls))
            .collect();
        assert_eq!(marks, [("10.0.0.1", false), ("10.0.0.2", true)]);

        // A client that follows the changes holds the mark, and loses it when it goes.
        let mut view = View::from_full(&pb::FullView {
            revision: 1,
            services: vec![values::service_to_pb(
                &web_key(),
                &serde_json::from_str(WEB).unwrap(),
            )],
            ..Default::default()
        })
        .unwrap();
        let (k1, k2) = (
            k("endpoints/d/web/10.0.0.1/8080"),
            k("endpoints/d/web/10.0.0.2/8080"),
        );
        let (b, _) = batch(
            &l,
            3,
            [
                Event {
                    kind: EventKind::Put,
                    key: &k1,
                    value: EP.as_bytes(),
                },
                Event {
                    kind: EventKind::Put,
                    key: &k2,
                    value: EP_MTLS.as_bytes(),
                },
            ],
        );
        view.apply(&b).unwrap();
        assert_eq!(view, View::from_full(&full).unwrap());
        let json = view.to_json();
        let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
        let eps = doc["services"][0]["endpoints"].as_array().unwrap();
        assert_eq!(eps[1]["mtls"], true, "{json}");
        assert!(
            eps[0].get("mtls").is_none(),
            "false is the file's default and left out: {json}"
        );
        // The dump reads back as a registry file with the mark.
        let file = serde_json::json!({ "services": doc["services"] }).to_string();
        let parsed =
            aether_model::registry_file::parse(std::path::Path::new("dump"), file.as_bytes())
                .unwrap();
        let eps = &parsed.services.values().next().unwrap().endpoints;
        assert_eq!(
            eps.iter().map(|e| e.mtls).collect::<Vec<_>>(),
            [false, true]
        );

        let (b, _) = batch(
            &l,
            4,
            [Event {
                kind: EventKind::Put,
                key: &k2,
                value: EP.as_bytes(),
            }],
        );
        view.apply(&b).unwrap();
        assert!(!view.to_json().contains("mtls"), "{}", view.to_json());
    }

    fn web_key() -> ServiceKey {
        ServiceKey {
            namespace: "d".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn the_dump_services_are_a_registry_file() {
        let l = layout();
        let kvs: Vec<(Vec<u8>, &str)> = vec![
            (k("services/d/web"), WEB),
            (k("endpoints/d/web/10.0.0.1/8080"), EP),
        ];
        let (full, _) = full_view(&l, 1, kvs.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())));
        let doc: serde_json::Value =
            serde_json::from_str(&View::from_full(&full).unwrap().to_json()).unwrap();
        let file = serde_json::json!({ "services": doc["services"] }).to_string();
        let parsed =
            aether_model::registry_file::parse(std::path::Path::new("dump"), file.as_bytes())
                .unwrap();
        assert_eq!(parsed.services.len(), 1);
    }

    /// A node's pair set is in etcd beside the endpoints it names: the full view leaves it
    /// out (without calling it corrupt), the endpoints carry their twins, and the dump
    /// prints them where set.
    #[test]
    fn twins_reach_the_full_view_and_the_dump_and_the_pair_set_stays_out() {
        let l = layout();
        let kvs: Vec<(Vec<u8>, &str)> = vec![
            (k("services/d/web"), WEB),
            (k("endpoints/d/web/10.0.0.1/8080"), EP_QUIC),
            (k("endpoints/d/web/10.0.0.2/8080"), EP),
            (k("quic-pairs/n1"), PAIRS),
        ];
        let (full, rejected) =
            full_view(&l, 3, kvs.iter().map(|(k, v)| (k.as_slice(), v.as_bytes())));
        assert!(rejected.is_empty(), "{rejected:?}");
        let twins: Vec<(&str, &str, &str)> = full.services[0]
            .endpoints
            .iter()
            .map(|e| (e.address.as_str(), e.quic.as_str(), e.quic_sni.as_str()))
            .collect();
        assert_eq!(
            twins,
            [
                ("10.0.0.1", "n1.example:4443", "web-1.d.example"),
                ("10.0.0.2", "", "")
            ]
        );
        // A pair set alone makes an empty batch, which the pump does not send.
        let key = k("quic-pairs/n1");
        let (b, rejected) = batch(
            &l,
            4,
            [Event {
                kind: EventKind::Put,
                key: &key,
                value: PAIRS.as_bytes(),
            }],
        );
        assert!(b.changes.is_empty() && rejected.is_empty(), "{b:?}");
        let view = View::from_full(&full).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&view.to_json()).unwrap();
        let eps = doc["services"][0]["endpoints"].as_array().unwrap();
        assert_eq!(eps[0]["quic"], "n1.example:4443");
        assert_eq!(eps[0]["quic_sni"], "web-1.d.example");
        assert!(eps[1].get("quic").is_none() && eps[1].get("quic_sni").is_none());
        // A client following an upsert that clears the twin loses it.
        let mut view = view;
        let ep = k("endpoints/d/web/10.0.0.1/8080");
        let (b, _) = batch(
            &l,
            5,
            [Event {
                kind: EventKind::Put,
                key: &ep,
                value: EP.as_bytes(),
            }],
        );
        view.apply(&b).unwrap();
        assert!(!view.to_json().contains("quic"), "{}", view.to_json());
    }
}
