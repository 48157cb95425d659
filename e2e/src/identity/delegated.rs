//! SPIRE's Delegated Identity API (`spire.api.agent.delegatedidentity.v1.DelegatedIdentity`)
//! of the test identity provider, a test double of a SPIRE agent's admin socket: the
//! caller is trusted as an authorized delegate (no caller attestation).
//!
//! - `SubscribeToX509SVIDs` by selectors: a pod is named by the Kubernetes selectors
//!   `k8s:ns:<namespace>`, `k8s:pod-name:<name>` and `k8s:pod-uid:<uid>` (all three; other
//!   selectors are ignored) and gets `spiffe://<trust-domain>/ns/<namespace>/pod/<name>`.
//!   A stream: the pod's current SVID at once (unless the pod is held), then one response
//!   per rotation. Subscribing by PID answers UNIMPLEMENTED; both PID and selectors, or
//!   neither, INVALID_ARGUMENT, as SPIRE.
//! - `SubscribeToX509Bundles`: a stream; the trust bundle at once, keyed by the trust
//!   domain's SPIFFE ID (`spiffe://<trust-domain>`) as released SPIRE agents key it.
//! - the JWT methods answer UNIMPLEMENTED.
//!
//! While the provider is down a call gets UNAVAILABLE.

use std::collections::BTreeMap;
use std::sync::Arc;

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

/// Sends `pod`'s current SVID on each of its streams that has not had it yet.
pub fn push(pod: &mut Pod, trust_domain: &str) {
    let response = svid_response(&pod.svid, trust_domain);
    for (tx, sent) in pod.streams.values_mut() {
        if sent.as_deref() != Some(pod.svid.serial.as_str()) {
            let _ = tx.send(Ok(response.clone()));
            *sent = Some(pod.svid.serial.clone());
        }
    }
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
        let pod = pod_from_selectors(&request.selectors).map_err(Status::invalid_argument)?;
        let shared = self.shared.clone();
        let trust_domain = self.shared.ca.trust_domain();
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
                    streams: BTreeMap::new(),
                };
                s.pods.insert(pod.uid.clone(), known);
            }
            let (id, tx, rx) = s.open();
            let held = s.held.contains(&pod.uid);
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
            if !held {
                push(known, trust_domain);
            }
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
        _request: Request<SubscribeToX509BundlesRequest>,
    ) -> Result<Response<Self::SubscribeToX509BundlesStream>, Status> {
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
