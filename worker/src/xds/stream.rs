//! The state of one ADS stream (state of the world), per resource type: what the proxy
//! subscribed to, what was sent under which nonce, what it ACKed. No I/O: the server
//! feeds it requests and snapshots and sends what [`StreamState::pending`] returns.
//!
//! Rules:
//! - A request with an empty nonce subscribes (first request, or a reconnect that
//!   carries the version the proxy holds: not an ACK) and is always answered.
//! - A request whose nonce is not the last one sent for its type is stale and ignored.
//! - `error_detail` set: a NACK of the last response. The proxy keeps its last good
//!   config; so do we: the rejected version is not resent, the next snapshot is.
//! - Otherwise an ACK of the last response.
//! - LDS and CDS (wildcard) are resent in full whenever their version changes: a SotW
//!   response for them is the whole set.
//! - EDS and RDS (requested by name) carry only the requested resources whose content
//!   changed, or that were newly requested: in SotW the proxy keeps a named resource that
//!   a response omits. With 100 clusters, one endpoint change sends one load assignment.
//! - SDS: a pod certificate the proxy asks for that the snapshot no longer has is sent as
//!   its tombstone ([`super::tombstone`]), once: the proxy would keep the pod's key.
//! - Order of a push: CDS, EDS, LDS, RDS, so clusters exist before the listeners and
//!   routes that use them.

use std::collections::BTreeSet;
use std::sync::Arc;

use aether_model::Snapshot;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use imbl::OrdMap;

use super::encoded::Encoded;
use super::kind::{KIND_COUNT, KINDS, Kind, from_type_url, type_url, wildcard};
use super::protocol::{Event, Protocol};
use super::tombstone;

/// A response and the state the proxy holds once it applies it.
#[derive(Debug, Clone)]
struct Sent {
    nonce: String,
    version: String,
    /// Content hash of every resource of the type the proxy holds after this response
    /// (for EDS and RDS: the requested ones, including those sent earlier).
    holds: OrdMap<String, u64>,
}

#[derive(Debug, Default)]
struct TypeState {
    subscribed: bool,
    /// Requested names (EDS, RDS); unused for wildcard types.
    requested: BTreeSet<String>,
    /// Answer the next `pending` even if nothing changed: a fresh subscription.
    answer: bool,
    sent: Option<Sent>,
    acked: Option<Sent>,
}

pub struct StreamState {
    current: Arc<Snapshot>,
    encoded: Arc<Encoded>,
    nonce: u64,
    types: [TypeState; KIND_COUNT],
}

impl Protocol for StreamState {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    const NAME: &'static str = "sotw";

    fn new(current: Arc<Snapshot>, encoded: Arc<Encoded>) -> Self {
        Self {
            current,
            encoded,
            nonce: 0,
            types: Default::default(),
        }
    }

    fn on_demand(&mut self, _observed: Arc<crate::writers::Observed>) {
        tracing::warn!(
            "on-demand clusters need incremental ADS (DELTA_GRPC); this state-of-the-world stream gets every cluster"
        );
    }

    fn node_id(req: &DiscoveryRequest) -> Option<&str> {
        req.node.as_ref().map(|n| n.id.as_str())
    }

    fn describe(r: &DiscoveryResponse) -> (&str, &str, &str, usize) {
        (&r.type_url, &r.version_info, &r.nonce, r.resources.len())
    }

    fn current(&self) -> &Arc<Snapshot> {
        &self.current
    }

    fn set_snapshot(&mut self, s: Arc<Snapshot>) {
        self.current = s;
    }

    fn on_request(&mut self, req: &DiscoveryRequest) -> Event {
        let Some(kind) = from_type_url(&req.type_url) else {
            return Event::UnknownType {
                type_url: req.type_url.clone(),
            };
        };
        let t = &mut self.types[kind.index()];
        let requested: BTreeSet<String> = req.resource_names.iter().cloned().collect();
        if req.response_nonce.is_empty() {
            t.subscribed = true;
            t.requested = requested;
            t.answer = true;
            return Event::Subscribe {
                kind,
                version: req.version_info.clone(),
                holds_nothing: req.version_info.is_empty(),
            };
        }
        let Some(sent) = t.sent.clone().filter(|s| s.nonce == req.response_nonce) else {
            return Event::Stale {
                kind,
                nonce: req.response_nonce.clone(),
            };
        };
        t.subscribed = true;
        t.requested = requested;
        match &req.error_detail {
            Some(status) => Event::Nack {
                kind,
                rejected_version: sent.version,
                nonce: sent.nonce,
                message: status.message.clone(),
            },
            None => {
                t.acked = Some(sent.clone());
                Event::Ack {
                    kind,
                    version: sent.version,
                    nonce: sent.nonce,
                }
            }
        }
    }

    fn pending(&mut self) -> Vec<DiscoveryResponse> {
        let mut out = Vec::new();
        for kind in KINDS {
            let t = &mut self.types[kind.index()];
            if !t.subscribed {
                continue;
            }
            let current = self.current.hashes(kind);
            let v = self.current.version(kind);
            // Pod certificates the proxy asks for that the snapshot no longer has: it gets
            // their tombstone, as it keeps whatever a response omits.
            let mut tombstones: Vec<&String> = Vec::new();
            let (holds, to_send): (OrdMap<String, u64>, BTreeSet<&String>) = if wildcard(kind) {
                let changed = t.sent.as_ref().is_none_or(|s| s.version != v);
                if !(changed || t.answer) {
                    continue;
                }
                (current.clone(), current.keys().collect())
            } else {
                let mut holds: OrdMap<String, u64> = current
                    .iter()
                    .filter(|(n, _)| t.requested.contains(*n))
                    .map(|(n, h)| (n.clone(), *h))
                    .collect();
                let before = t.sent.as_ref().map(|s| &s.holds);
                let to_send: BTreeSet<&String> = current
                    .iter()
                    .filter(|(n, h)| {
                        t.requested.contains(*n)
                            && (t.answer || before.and_then(|b| b.get(*n)) != Some(*h))
                    })
                    .map(|(n, _)| n)
                    .collect();
                if kind == Kind::Secret {
                    for n in &t.requested {
                        if tombstone::applies_to(n) && !current.contains_key(n) {
                            holds.insert(n.clone(), tombstone::HASH);
                            if t.answer || before.and_then(|b| b.get(n)) != Some(&tombstone::HASH) {
                                tombstones.push(n);
                            }
                        }
                    }
                }
                if to_send.is_empty() && tombstones.is_empty() && !t.answer {
                    // Nothing the proxy asked for changed; forget what it stopped asking for.
                    if let Some(s) = t.sent.as_mut() {
                        s.holds = holds;
                    }
                    continue;
                }
                (holds, to_send)
            };
            t.answer = false;
            self.nonce += 1;
            let nonce = self.nonce.to_string();
            out.push(DiscoveryResponse {
                version_info: v.to_string(),
                resources: self
                    .encoded
                    .get(&self.current, kind, &to_send)
                    .into_iter()
                    .chain(tombstones.iter().map(|n| tombstone::encode(n)))
                    .collect(),
                type_url: type_url(kind).to_string(),
                nonce: nonce.clone(),
                ..Default::default()
            });
            t.sent = Some(Sent {
                nonce,
                version: v.to_string(),
                holds,
            });
        }
        out
    }

    /// LDS and CDS in full, and the EDS, RDS and SDS resources the snapshot's clusters
    /// and listeners refer to.
    fn acked_current(&self) -> bool {
        let s = &*self.current;
        KINDS.into_iter().all(|kind| {
            let acked = self.types[kind.index()].acked.as_ref();
            match kind {
                Kind::Listener | Kind::Cluster => {
                    acked.is_some_and(|a| a.version == s.version(kind))
                }
                Kind::Endpoint | Kind::Route | Kind::Secret => {
                    let current = s.hashes(kind);
                    let held = |n: &str| {
                        acked
                            .and_then(|a| a.holds.get(n))
                            .is_some_and(|h| current.get(n) == Some(h))
                    };
                    match kind {
                        Kind::Endpoint => s.eds_cluster_names().all(held),
                        Kind::Secret => s.sds_names().into_iter().all(held),
                        _ => s.rds_names().all(held),
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_model::{Endpoint, EndpointState, Inputs, RegistryView, Service, build};
    use envoy_types::pb::google::rpc::Status;

    fn snap(endpoints: usize) -> Arc<Snapshot> {
        let eps = (0..endpoints)
            .map(|i| Endpoint {
                address: format!("10.0.0.{}", i + 1).parse().unwrap(),
                port: 8080,
                service_port: 80,
                node: String::new(),
                pod: String::new(),
                state: EndpointState::Healthy,
                mtls: false,
            })
            .collect();
        let svc = Service {
            name: "web".into(),
            namespace: "d".into(),
            ports: vec![80],
            vip: None,
            endpoints: eps,
        };
        Arc::new(build(&Inputs {
            registry: RegistryView::new([svc]),
            ..Default::default()
        }))
    }

    const CLA: &str = "outbound|80||web.d";

    fn req(
        kind: Kind,
        version: &str,
        nonce: &str,
        names: &[&str],
        error: Option<&str>,
    ) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            type_url: type_url(kind).into(),
            response_nonce: nonce.into(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            error_detail: error.map(|m| Status {
                code: 13,
                message: m.into(),
                details: vec![],
            }),
            ..Default::default()
        }
    }

    /// (type, version, nonce, resource count) of each pending response.
    fn sent(st: &mut StreamState) -> Vec<(&'static str, String, String, usize)> {
        st.pending()
            .into_iter()
            .map(|r| {
                (
                    from_type_url(&r.type_url).unwrap().short(),
                    r.version_info,
                    r.nonce,
                    r.resources.len(),
                )
            })
            .collect()
    }

    /// One pod with its SVID (strict), or none: the pod's certificates and the bundle.
    fn snap_with_pod(pod: bool) -> Arc<Snapshot> {
        let svid = aether_model::Svid {
            spiffe_id: "spiffe://t/ns/d/pod/p".into(),
            chain_pem: "CHAIN".into(),
            key_pem: "KEY".into(),
            serial: "01".into(),
            not_before: 0,
            not_after: 1,
        };
        let p = aether_model::Pod {
            uid: "u".into(),
            namespace: "d".into(),
            name: "p".into(),
            container_id: "c".into(),
            netns: "/n".into(),
            ifname: "eth0".into(),
            ips: vec!["10.0.0.2".parse().unwrap()],
            terminating: false,
            no_quic_twin: false,
        };
        Arc::new(build(&Inputs {
            pods: pod.then(|| ("u".to_string(), p)).into_iter().collect(),
            identity: aether_model::Identity {
                trust_domain: Some("t".into()),
                mode: aether_model::MtlsMode::Strict,
                bundle: Some("CA".into()),
                agent: None,
                pods: [("u".to_string(), svid)].into(),
            },
            ..Default::default()
        }))
    }

    /// The names of a response's resources, and which carry the tombstone's certificate.
    fn secrets(r: &DiscoveryResponse) -> Vec<(String, bool)> {
        use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
        r.resources
            .iter()
            .map(|a| {
                let s: tls::Secret = prost::Message::decode(a.value.as_slice()).unwrap();
                use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
                let dead = match s.r#type {
                    Some(tls::secret::Type::TlsCertificate(c)) => {
                        c.certificate_chain.is_some_and(|d| {
                            d.specifier == Some(Specifier::InlineString(tombstone::CERT_PEM.into()))
                        })
                    }
                    _ => false,
                };
                (s.name, dead)
            })
            .collect()
    }

    /// State of the world cannot remove a secret: a deleted pod's certificates that the
    /// proxy still asks for are answered with the tombstone, once; the pod back gets its
    /// own again; the trust bundle is untouched.
    #[test]
    fn a_deleted_pods_certificates_are_answered_with_the_tombstone() {
        let names = ["spiffe|bundle", "spiffe|inbound|u", "spiffe|pod|u"];
        let mut st = StreamState::new(snap_with_pod(true), Arc::default());
        st.on_request(&req(Kind::Secret, "", "", &names, None));
        let out = st.pending();
        assert_eq!(
            secrets(&out[0]),
            names.map(|n| (n.to_string(), false)).to_vec()
        );
        st.on_request(&req(Kind::Secret, "v", &out[0].nonce, &names, None));

        st.set_snapshot(snap_with_pod(false));
        let out = st.pending();
        assert_eq!(out.len(), 1);
        assert_eq!(
            secrets(&out[0]),
            vec![
                ("spiffe|inbound|u".to_string(), true),
                ("spiffe|pod|u".to_string(), true)
            ]
        );
        st.on_request(&req(Kind::Secret, "v", &out[0].nonce, &names, None));
        assert!(st.pending().is_empty(), "the tombstone goes once");

        // A reconnect asking for them again gets the tombstones (and the bundle).
        let mut again = StreamState::new(snap_with_pod(false), Arc::default());
        again.on_request(&req(Kind::Secret, "", "", &names, None));
        let out = again.pending();
        assert_eq!(
            secrets(&out[0]),
            vec![
                ("spiffe|bundle".to_string(), false),
                ("spiffe|inbound|u".to_string(), true),
                ("spiffe|pod|u".to_string(), true)
            ]
        );

        st.set_snapshot(snap_with_pod(true));
        let out = st.pending();
        assert_eq!(
            secrets(&out[0]),
            vec![
                ("spiffe|inbound|u".to_string(), false),
                ("spiffe|pod|u".to_string(), false)
            ]
        );
    }

    #[test]
    fn subscribe_ack_push_nack_and_reconnect() {
        let s1 = snap(1);
        let mut st = StreamState::new(s1.clone(), Arc::default());
        assert!(sent(&mut st).is_empty(), "nothing before a subscription");

        assert!(matches!(
            st.on_request(&req(Kind::Cluster, "", "", &[], None)),
            Event::Subscribe {
                holds_nothing: true,
                ..
            }
        ));
        assert!(matches!(
            st.on_request(&req(Kind::Listener, "", "", &[], None)),
            Event::Subscribe { .. }
        ));
        let cv1 = s1.clusters.version.clone();
        let lv1 = s1.listeners.version.clone();
        assert_eq!(
            sent(&mut st),
            vec![
                ("CDS", cv1.clone(), "1".into(), 1),
                ("LDS", lv1.clone(), "2".into(), 1)
            ]
        );
        assert!(sent(&mut st).is_empty(), "nothing twice");

        assert!(matches!(
            st.on_request(&req(Kind::Cluster, &cv1, "1", &[], None)),
            Event::Ack { .. }
        ));
        assert!(matches!(
            st.on_request(&req(Kind::Listener, &lv1, "2", &[], None)),
            Event::Ack { .. }
        ));
        assert!(!st.acked_current(), "EDS and RDS still owed");
        st.on_request(&req(Kind::Endpoint, "", "", &[CLA], None));
        st.on_request(&req(Kind::Route, "", "", &["outbound"], None));
        let ev1 = s1.endpoints.version.clone();
        let rv1 = s1.routes.version.clone();
        assert_eq!(
            sent(&mut st),
            vec![
                ("EDS", ev1.clone(), "3".into(), 1),
                ("RDS", rv1.clone(), "4".into(), 1)
            ]
        );
        st.on_request(&req(Kind::Endpoint, &ev1, "3", &[CLA], None));
        assert!(!st.acked_current());
        st.on_request(&req(Kind::Route, &rv1, "4", &["outbound"], None));
        assert!(st.acked_current());

        // An endpoint change pushes EDS only; a stale ACK of the old nonce is ignored.
        let s2 = snap(2);
        st.set_snapshot(s2.clone());
        assert!(!st.acked_current());
        let ev2 = s2.endpoints.version.clone();
        assert_eq!(sent(&mut st), vec![("EDS", ev2.clone(), "5".into(), 1)]);
        assert!(matches!(
            st.on_request(&req(Kind::Endpoint, &ev1, "3", &[CLA], None)),
            Event::Stale { .. }
        ));

        // NACK: nothing resent, not acked; the next snapshot goes out.
        let ev = st.on_request(&req(
            Kind::Endpoint,
            &ev1,
            "5",
            &[CLA],
            Some("bad endpoint"),
        ));
        assert_eq!(
            ev,
            Event::Nack {
                kind: Kind::Endpoint,
                rejected_version: ev2,
                nonce: "5".into(),
                message: "bad endpoint".into()
            }
        );
        assert!(sent(&mut st).is_empty());
        assert!(!st.acked_current());
        let s3 = snap(3);
        st.set_snapshot(s3.clone());
        assert_eq!(
            sent(&mut st),
            vec![("EDS", s3.endpoints.version.clone(), "6".into(), 1)]
        );
        st.on_request(&req(
            Kind::Endpoint,
            &s3.endpoints.version,
            "6",
            &[CLA],
            None,
        ));
        assert!(st.acked_current());

        // Back to an already-acked snapshot's versions: acked at once.
        st.set_snapshot(s1.clone());
        assert_eq!(sent(&mut st).len(), 1);
        st.set_snapshot(s3.clone());
        assert_eq!(sent(&mut st).len(), 1);

        // A new stream (reconnect) that carries versions but no nonce: not an ACK, answered.
        let mut st = StreamState::new(s3.clone(), Arc::default());
        let ev = st.on_request(&req(Kind::Cluster, &s3.clusters.version, "", &[], None));
        assert!(matches!(
            ev,
            Event::Subscribe {
                holds_nothing: false,
                ..
            }
        ));
        assert!(!st.acked_current());
        assert_eq!(sent(&mut st).len(), 1);
    }

    #[test]
    fn eds_and_rds_send_only_changed_resources() {
        let two = |draining: bool| {
            let ep = |a: &str, d: bool| Endpoint {
                address: a.parse().unwrap(),
                port: 80,
                service_port: 80,
                node: String::new(),
                pod: String::new(),
                state: if d {
                    EndpointState::Draining
                } else {
                    EndpointState::Healthy
                },
                mtls: false,
            };
            let svc = |n: &str, e: Endpoint| Service {
                name: n.into(),
                namespace: "d".into(),
                ports: vec![80],
                vip: None,
                endpoints: vec![e],
            };
            let registry = RegistryView::new([
                svc("a", ep("10.0.0.1", false)),
                svc("b", ep("10.0.0.2", draining)),
            ]);
            Arc::new(build(&Inputs {
                registry,
                ..Default::default()
            }))
        };
        let names = ["outbound|80||a.d", "outbound|80||b.d"];
        let s1 = two(false);
        let mut st = StreamState::new(s1.clone(), Arc::default());
        for k in [Kind::Cluster, Kind::Listener] {
            st.on_request(&req(k, "", "", &[], None));
        }
        st.on_request(&req(Kind::Endpoint, "", "", &names, None));
        st.on_request(&req(Kind::Route, "", "", &["outbound"], None));
        let first = sent(&mut st);
        assert_eq!(
            first.iter().map(|r| (r.0, r.3)).collect::<Vec<_>>(),
            vec![("CDS", 2), ("EDS", 2), ("LDS", 1), ("RDS", 1)]
        );
        for (k, (_, v, n, _)) in [Kind::Cluster, Kind::Endpoint, Kind::Listener, Kind::Route]
            .into_iter()
            .zip(first)
        {
            let names: &[&str] = match k {
                Kind::Endpoint => &names,
                Kind::Route => &["outbound"],
                _ => &[],
            };
            st.on_request(&req(k, &v, &n, names, None));
        }
        assert!(st.acked_current());

        // One endpoint of b drains: one load assignment goes, and acked only once ACKed.
        let s2 = two(true);
        st.set_snapshot(s2.clone());
        let push = sent(&mut st);
        assert_eq!(
            push,
            vec![("EDS", s2.endpoints.version.clone(), "5".into(), 1)]
        );
        assert!(!st.acked_current());
        st.on_request(&req(
            Kind::Endpoint,
            &s2.endpoints.version,
            "5",
            &names,
            None,
        ));
        assert!(st.acked_current());

        // A reconnect-style re-subscription is answered in full.
        st.on_request(&req(
            Kind::Endpoint,
            &s2.endpoints.version,
            "",
            &names,
            None,
        ));
        assert_eq!(sent(&mut st)[0].3, 2);
    }

    #[test]
    fn eds_sends_only_requested_names_and_resends_on_name_change() {
        let mut st = StreamState::new(snap(1), Arc::default());
        st.on_request(&req(Kind::Endpoint, "", "", &["nope"], None));
        assert_eq!(sent(&mut st)[0].3, 0);
        st.on_request(&req(Kind::Endpoint, "x", "1", &["nope", CLA], None));
        assert_eq!(sent(&mut st)[0].3, 1);
        st.on_request(&req(Kind::Endpoint, "x", "2", &["nope", CLA], None));
        assert!(sent(&mut st).is_empty());
        let unknown = DiscoveryRequest {
            type_url: "type.googleapis.com/bogus".into(),
            ..Default::default()
        };
        assert!(matches!(st.on_request(&unknown), Event::UnknownType { .. }));
    }
}
