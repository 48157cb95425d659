//! The SPIFFE Workload API (`SpiffeWorkloadAPI`, no proto package) of the test identity
//! provider, a test double of a SPIRE agent's Workload API socket: the caller always gets
//! the agent's identity (no attestation).
//!
//! - `FetchX509SVID`: a stream; the current SVID at once, then one response per rotation.
//! - `FetchX509Bundles`: a stream; the trust bundle at once (it never changes).
//! - the JWT methods answer UNIMPLEMENTED.
//!
//! As SPIRE, every call must carry the metadata header `workload.spiffe.io: true`, else
//! INVALID_ARGUMENT. While the provider is down a call gets UNAVAILABLE.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::ca::Svid;
use super::pb::workload::spiffe_workload_api_server::SpiffeWorkloadApi;
use super::pb::workload::{
    JwtBundlesRequest, JwtBundlesResponse, JwtsvidRequest, JwtsvidResponse, ValidateJwtsvidRequest,
    ValidateJwtsvidResponse, X509BundlesRequest, X509BundlesResponse, X509svid, X509svidRequest,
    X509svidResponse,
};
use super::state::{Shared, StreamKey, Subscription};

/// The header every Workload API call carries.
pub const HEADER: &str = "workload.spiffe.io";

pub struct WorkloadApi {
    pub shared: Arc<Shared>,
}

/// The FetchX509SVID response for `svid`: one SVID (leaf DER, PKCS#8 key, the bundle).
pub fn svid_response(svid: &Svid, bundle: &[u8]) -> X509svidResponse {
    X509svidResponse {
        svids: vec![X509svid {
            spiffe_id: svid.spiffe_id.clone(),
            x509_svid: svid.cert_der.clone(),
            x509_svid_key: svid.key_der.clone(),
            bundle: bundle.to_vec(),
            hint: String::new(),
        }],
        crl: Vec::new(),
        federated_bundles: Default::default(),
    }
}

fn check_header<T>(request: &Request<T>) -> Result<(), Status> {
    match request.metadata().get(HEADER) {
        Some(v) if v == "true" => Ok(()),
        // SPIRE's words.
        _ => Err(Status::invalid_argument(
            "security header missing from request",
        )),
    }
}

#[tonic::async_trait]
impl SpiffeWorkloadApi for WorkloadApi {
    type FetchX509SVIDStream = Subscription<X509svidResponse>;
    type FetchX509BundlesStream = Subscription<X509BundlesResponse>;
    type FetchJWTBundlesStream = tokio_stream::Empty<Result<JwtBundlesResponse, Status>>;

    async fn fetch_x509svid(
        &self,
        request: Request<X509svidRequest>,
    ) -> Result<Response<Self::FetchX509SVIDStream>, Status> {
        check_header(&request)?;
        let shared = self.shared.clone();
        let (id, rx) = self.shared.update(|s| {
            if s.down {
                return Err(Status::unavailable("the test identity provider is down"));
            }
            let (id, tx, rx) = s.open();
            let _ = tx.send(Ok(svid_response(&s.agent, self.shared.ca.der())));
            s.agent_streams.insert(id, tx);
            Ok((id, rx))
        })?;
        Ok(Response::new(Subscription::new(
            rx,
            StreamKey::Agent(id),
            shared,
        )))
    }

    async fn fetch_x509_bundles(
        &self,
        request: Request<X509BundlesRequest>,
    ) -> Result<Response<Self::FetchX509BundlesStream>, Status> {
        check_header(&request)?;
        let shared = self.shared.clone();
        let (id, rx) = self.shared.update(|s| {
            if s.down {
                return Err(Status::unavailable("the test identity provider is down"));
            }
            let (id, tx, rx) = s.open();
            let bundles = [(
                format!("spiffe://{}", self.shared.ca.trust_domain()),
                self.shared.ca.der().to_vec(),
            )]
            .into();
            let _ = tx.send(Ok(X509BundlesResponse {
                crl: Vec::new(),
                bundles,
            }));
            s.bundle_streams.insert(id, tx);
            Ok((id, rx))
        })?;
        Ok(Response::new(Subscription::new(
            rx,
            StreamKey::Bundles(id),
            shared,
        )))
    }

    async fn fetch_jwtsvid(
        &self,
        request: Request<JwtsvidRequest>,
    ) -> Result<Response<JwtsvidResponse>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "the test identity provider serves X.509-SVIDs only",
        ))
    }

    async fn fetch_jwt_bundles(
        &self,
        request: Request<JwtBundlesRequest>,
    ) -> Result<Response<Self::FetchJWTBundlesStream>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "the test identity provider serves X.509-SVIDs only",
        ))
    }

    async fn validate_jwtsvid(
        &self,
        request: Request<ValidateJwtsvidRequest>,
    ) -> Result<Response<ValidateJwtsvidResponse>, Status> {
        check_header(&request)?;
        Err(Status::unimplemented(
            "the test identity provider serves X.509-SVIDs only",
        ))
    }
}
