//! SPIRE's Delegated Identity API (`spire.api.agent.delegatedidentity.v1.DelegatedIdentity`)
//! of the test identity provider, a test double of a SPIRE agent's admin socket.
//!
//! - The caller is authorized as SPIRE authorizes it (`isCallerAuthorized` in SPIRE's
//!   `pkg/agent/api/delegatedidentity/v1/service.go`): attested by the unix uid of its
//!   connection, it must match an entry (else PERMISSION_DENIED "no identity issued") whose
//!   SPIFFE ID is listed in `authorized_delegates` (else PERMISSION_DENIED "caller not
//!   configured as an authorized delegate"). By default every uid attests to the agent's
//!   SPIFFE ID, the one authorized delegate; [`crate::identity::IdentityProvider`] changes
//!   both lists.
//! - `SubscribeToX509SVIDs` by selectors: a pod is named by the Kubernetes selectors
//!   `k8s:ns:<namespace>`, `k8s:pod-name:<name>` and `k8s:pod-uid:<uid>` (all three; other
//!   selectors are ignored) and gets `spiffe://<trust-domain>/ns/<namespace>/pod/<name>`,
//!   where a registration entry matches it (by default every namespace has one). A stream:
//!   the pod's current SVID at once (unless the pod is held), then one response per
//!   rotation. Selectors that match no entry (a pod not fully named, or in a namespace
//!   without an entry) get what SPIRE's cache sends then: a response with no SVID, at once,
//!   on a stream that stays open; the SVID follows if an entry comes to match, and a
//!   removed entry sends the empty response again. Subscribing by PID answers
//!   UNIMPLEMENTED; both PID and selectors, or neither, INVALID_ARGUMENT, as SPIRE.
//! - `SubscribeToX509Bundles`: a stream; the trust bundle at once, keyed by the trust
//!   domain's SPIFFE ID (`spiffe://<trust-domain>`) as released SPIRE agents key it.
//! - the JWT methods answer UNIMPLEMENTED.
//!
//! While the provider is down a call gets UNAVAILABLE.

use std::collections::BTreeMap;
use std::sync::Arc;

use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};

use super::ca::Svid;
use super::pb::spire::api::agent::delegatedidentity::v1::delegated_identity_server::DelegatedIdentity;
use super::pb::spire::api::agent::delegatedidentity::v1::{
    FetchJwtsviDsRequest, FetchJwtsviDsResponse, SubscribeToJwtBundlesRequest,
    SubscribeToJwtBundlesResponse, SubscribeToX509BundlesRequest, SubscribeToX509BundlesResponse,
    SubscribeToX509sviDsRequest, SubscribeToX509sviDsResponse, X509svidWithKey,
};
use super::pb::spire::api::types::{Selector, Spiffeid, X509svid};
use super::state::{Pod, Shared, StreamKey, Subscription};

pub struct DelegatedApi {
    pub shared: Arc<Shared>,
}

/// A pod as its selectors name it.
#[derive(Debug, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The pod named by `k8s:ns:`, `k8s:pod-name:` and `k8s:pod-uid:` selectors.
pub fn pod_from_selectors(selectors: &[Selector]) -> Result<PodRef, String> {
    let find = |key: &str| {
        let values: Vec<&str> = selectors
            .iter()
            .filter(|s| s.r#type == "k8s")
            .filter_map(|s| s.value.strip_prefix(key))
            .collect();
        match values.as_slice() {
            [one] if !one.is_empty() => Ok((*one).to_owned()),
            [] => Err(format!("no selector k8s:{key}<value>")),
            _ => Err(format!(
                "not exactly one non-empty selector k8s:{key}<value> in {values:?}"
            )),
        }
    };
    Ok(PodRef {
        namespace: find("ns:")?,
        name: find("pod-name:")?,
        uid: find("pod-uid:")?,
    })
}

/// The SubscribeToX509SVIDs response for `svid`.
pub fn svid_response(svid: &Svid, trust_domain: &str) -> SubscribeToX509sviDsResponse {
    let path = svid
        .spiffe_id
        .strip_prefix(&format!("spiffe://{trust_domain}"))
        .unwrap_or(&svid.spiffe_id);
    SubscribeToX509sviDsResponse {
        x509_svids: vec![X509svidWithKey {
            x509_svid: Some(X509svid {
                cert_chain: vec![svid.cert_der.clone()],
                id: Some(Spiffeid {
                    trust_domain: trust_domain.to_owned(),
                    path: path.to_owned(),
                }),
                expires_at: svid.expires_at,
                hint: String::new(),
            }),
            x509_svid_key: svid.key_der.clone(),
        }],
        federates_with: Vec::new(),
    }
}

/// What SPIRE sends for selectors that match no entry: no SVID.
pub fn no_svid() -> SubscribeToX509sviDsResponse {
    SubscribeToX509sviDsResponse::default()
}

/// The mark of a stream that was last sent [`no_svid`] (a serial is never empty).
const NO_SVID: &str = "";

/// Brings each of `pod`'s streams to what it should have: with an entry, the current SVID
/// unless the pod is held; without one, [`no_svid`]. Sends only what a stream lacks.
pub fn push(pod: &mut Pod, trust_domain: &str, entry: bool, held: bool) {
    let (mark, response) = match (entry, held) {
        (false, _) => (NO_SVID, no_svid()),
        (true, true) => return,
        (true, false) => (
            pod.svid.serial.as_str(),
            svid_response(&pod.svid, trust_domain),
        ),
    };
    for (tx, sent) in pod.streams.values_mut() {
        if sent.as_deref() != Some(mark) {
            let _ = tx.send(Ok(response.clone()));
            *sent = Some(mark.to_owned());
        }
    }
}

/// The unix uid of the request's caller, if its connection has one.
fn caller_uid<T>(request: &Request<T>) -> Option<u32> {
    request
        .extensions()
        .get::<UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map(|c| c.uid())
}

#[tonic::async_trait]
impl DelegatedIdentity for DelegatedApi {
    type SubscribeToX509SVIDsStream = Subscription<SubscribeToX509sviDsResponse>;
    type SubscribeToX509BundlesStream = Subscription<SubscribeToX509BundlesResponse>;
    type SubscribeToJWTBundlesStream =
        tokio_stream::Empty<Result<SubscribeToJwtBundlesResponse, Status>>;

    async fn subscribe_to_x509svi_ds(
        &self,
        request: Request<SubscribeToX509sviDsRequest>,
    ) -> Result<Response<Self::SubscribeToX509SVIDsStream>, Status> {
        let caller = caller_uid(&request);
        self.shared.lock().authorize_delegate(caller)?;
        let request = request.into_inner();
        match (request.pid, request.selectors.is_empty()) {
            (0, true) => {
                return Err(Status::invalid_argument(
                    "must provide either selectors or non-zero pid",
                ));
            }
            (0, false) => {}
            (_, true) => {
                return Err(Status::unimplemented(
                    "the test identity provider attests no PID: subscribe by selectors",
                ));
            }
            (_, false) => {
                return Err(Status::invalid_argument(
                    "cannot specify both pid and selectors",
                ));
            }
        }
        let shared = self.shared.clone();
        let trust_domain = self.shared.ca.trust_domain();
        let Ok(pod) = pod_from_selectors(&request.selectors) else {
            let (id, rx) = self.shared.update(|s| {
                if s.down {
                    return Err(Status::unavailable("the test identity provider is down"));
                }
                let (id, tx, rx) = s.open();
                let _ = tx.send(Ok(no_svid()));
                s.unmatched_streams.insert(id, tx);
                Ok((id, rx))
            })?;
            return Ok(Response::new(Subscription::new(
                rx,
                StreamKey::Unmatched(id),
                shared,
            )));
        };
        let (id, rx) = self.shared.update(|s| {
            if s.down {
                return Err(Status::unavailable("the test identity provider is down"));
            }
            if !s.pods.contains_key(&pod.uid) {
                let svid = self.shared.mint(
                    s,
                    &format!(
                        "spiffe://{trust_domain}/ns/{}/pod/{}",
                        pod.namespace, pod.name
                    ),
                );
                let known = Pod {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    svid,
                    opened: 0,
                    streams: BTreeMap::new(),
                };
                s.pods.insert(pod.uid.clone(), known);
            }
            let (id, tx, rx) = s.open();
            let held = s.held.contains(&pod.uid);
            let entry = s.has_entry(&pod.namespace);
            let known = s.pods.get_mut(&pod.uid).expect("inserted above");
            if (known.namespace.as_str(), known.name.as_str())
                != (pod.namespace.as_str(), pod.name.as_str())
            {
                return Err(Status::invalid_argument(format!(
                    "pod uid {} is {}/{}, not {}/{}",
                    pod.uid, known.namespace, known.name, pod.namespace, pod.name
                )));
            }
            known.streams.insert(id, (tx, None));
            known.opened += 1;
            push(known, trust_domain, entry, held);
            Ok((id, rx))
        })?;
        Ok(Response::new(Subscription::new(
            rx,
            StreamKey::Pod(pod.uid, id),
            shared,
        )))
    }

    async fn subscribe_to_x509_bundles(
        &self,
        request: Request<SubscribeToX509BundlesRequest>,
    ) -> Result<Response<Self::SubscribeToX509BundlesStream>, Status> {
        self.shared
            .lock()
            .authorize_delegate(caller_uid(&request))?;
        let shared = self.shared.clone();
        let (id, rx) = self.shared.update(|s| {
            if s.down {
                return Err(Status::unavailable("the test identity provider is down"));
            }
            let (id, tx, rx) = s.open();
            let ca_certificates = [(
                format!("spiffe://{}", self.shared.ca.trust_domain()),
                self.shared.ca.der().to_vec(),
            )]
            .into();
            let _ = tx.send(Ok(SubscribeToX509BundlesResponse { ca_certificates }));
            s.delegated_bundle_streams.insert(id, tx);
            Ok((id, rx))
        })?;
        Ok(Response::new(Subscription::new(
            rx,
            StreamKey::DelegatedBundles(id),
            shared,
        )))
    }

    async fn fetch_jwtsvi_ds(
        &self,
        _request: Request<FetchJwtsviDsRequest>,
    ) -> Result<Response<FetchJwtsviDsResponse>, Status> {
        Err(Status::unimplemented(
            "the test identity provider serves X.509-SVIDs only",
        ))
    }

    async fn subscribe_to_jwt_bundles(
        &self,
        _request: Request<SubscribeToJwtBundlesRequest>,
    ) -> Result<Response<Self::SubscribeToJWTBundlesStream>, Status> {
        Err(Status::unimplemented(
            "the test identity provider serves X.509-SVIDs only",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k8s(value: &str) -> Selector {
        Selector {
            r#type: "k8s".into(),
            value: value.into(),
        }
    }

    #[test]
    fn a_pod_is_named_by_namespace_name_and_uid() {
        let pod = pod_from_selectors(&[
            k8s("ns:default"),
            k8s("pod-name:web-1"),
            k8s("pod-uid:u1"),
            k8s("sa:web"),
        ])
        .unwrap();
        assert_eq!(
            pod,
            PodRef {
                namespace: "default".into(),
                name: "web-1".into(),
                uid: "u1".into()
            }
        );
        assert!(
            pod_from_selectors(&[k8s("ns:default"), k8s("pod-name:web-1")])
                .unwrap_err()
                .contains("pod-uid:")
        );
        assert!(
            pod_from_selectors(&[
                k8s("ns:a"),
                k8s("ns:b"),
                k8s("pod-name:w"),
                k8s("pod-uid:u")
            ])
            .is_err()
        );
        let unix = Selector {
            r#type: "unix".into(),
            value: "ns:default".into(),
        };
        assert!(pod_from_selectors(&[unix, k8s("pod-name:w"), k8s("pod-uid:u")]).is_err());
    }
}
