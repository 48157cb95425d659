//! Mutual TLS with SPIFFE X.509-SVIDs: the registrar's own certificate and the trust
//! bundle its callers' certificates are checked against, from a SPIFFE Workload API
//! socket (`--spiffe-endpoint`, both rotated live by the `spiffe` crate's `X509Source`)
//! or from files (`--tls-cert`/`--tls-key`, `--client-ca-bundle`, each read again when
//! its bytes change).
//!
//! A client certificate is checked at the handshake: its chain against the bundle as it
//! is now, its validity, the clientAuth purpose, exactly one URI SAN, a `spiffe://` one,
//! in `--trust-domain` when one is set. A refused certificate fails the handshake, is
//! logged with the peer's address and counted (`refusals{reason="svid_*"}`). What the
//! caller may do is the gate's (`crate::gate`) and `crate::authz`'s, from the SVID that
//! [`ClientSvid::parse`] reads back out of the session.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use shared_proto::registry_tls::read_pem;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

use crate::metrics::Metrics;

/// The largest bundle file read.
const MAX_BUNDLE: u64 = 1 << 20;
/// How long the start waits for the Workload API's first SVID.
pub const WORKLOAD_API_TIMEOUT: Duration = Duration::from_secs(30);

/// What is wrong with a certificate as an X.509-SVID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SvidError {
    #[error("the certificate does not parse: {0}")]
    Parse(String),
    #[error("the certificate carries {0} URI SANs; an X.509-SVID carries exactly one")]
    UriSans(usize),
    #[error("the URI SAN {0:?} is not a SPIFFE ID (spiffe://TRUST-DOMAIN/PATH)")]
    NotSpiffe(String),
    #[error("the SPIFFE ID {id:?} is not in trust domain {trust_domain:?}")]
    TrustDomain { id: String, trust_domain: String },
}

impl SvidError {
    /// The `refusals` reason it is counted under.
    pub fn reason(&self) -> &'static str {
        match self {
            SvidError::Parse(_) | SvidError::NotSpiffe(_) => "svid_malformed",
            SvidError::UriSans(_) => "svid_uri_sans",
            SvidError::TrustDomain { .. } => "svid_trust_domain",
        }
    }
}

/// A caller's X.509-SVID, read from its leaf certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSvid {
    pub spiffe_id: String,
    /// The leaf's serial number in lowercase hex.
    pub serial: String,
    /// The leaf's notAfter, in seconds since the Unix epoch.
    pub not_after: u64,
}

impl ClientSvid {
    /// The SVID of leaf certificate `der`: exactly one URI SAN, a SPIFFE ID.
    pub fn parse(der: &[u8]) -> Result<ClientSvid, SvidError> {
        let (_, cert) =
            X509Certificate::from_der(der).map_err(|e| SvidError::Parse(e.to_string()))?;
        let mut uris = Vec::new();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                if let GeneralName::URI(u) = name {
                    uris.push((*u).to_owned());
                }
            }
        }
        let [id] = uris.as_slice() else {
            return Err(SvidError::UriSans(uris.len()));
        };
        if trust_domain_of(id).is_none() {
            return Err(SvidError::NotSpiffe(id.clone()));
        }
        let serial = cert
            .raw_serial()
            .iter()
            .skip_while(|b| **b == 0)
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        Ok(ClientSvid {
            spiffe_id: id.clone(),
            serial: if serial.is_empty() {
                "0".into()
            } else {
                serial
            },
            not_after: u64::try_from(cert.validity().not_after.timestamp()).unwrap_or(0),
        })
    }
}

/// The trust domain of a SPIFFE ID `spiffe://TD/PATH` (a path is required).
pub fn trust_domain_of(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let (td, path) = rest.split_once('/')?;
    (!td.is_empty() && !path.is_empty()).then_some(td)
}

/// Where the bundle and the serving certificate come from.
pub enum Source {
    /// `--client-ca-bundle`, read again when its bytes change.
    Files(BundleFile),
    /// `--spiffe-endpoint`: the Workload API, followed by the `spiffe` crate.
    Workload {
        source: Arc<spiffe::X509Source>,
        trust_domain: spiffe::TrustDomain,
    },
}

/// The bundle file's CA certificates: the last bytes read and the store they made.
pub struct BundleFile {
    path: PathBuf,
    current: Mutex<(Vec<u8>, Arc<RootCertStore>)>,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("--client-ca-bundle {path}: {why}")]
    Bad { path: PathBuf, why: String },
}

impl BundleFile {
    /// Loads the bundle; an error names the file.
    pub fn load(path: &Path) -> Result<BundleFile, BundleError> {
        let bytes = read_pem(path, MAX_BUNDLE).map_err(|e| BundleError::Bad {
            path: path.to_owned(),
            why: e.to_string(),
        })?;
        let roots = roots_from_pem(path, &bytes)?;
        Ok(BundleFile {
            path: path.to_owned(),
            current: Mutex::new((bytes, roots)),
        })
    }

    /// The CA store: the file's again when its bytes changed and it loads, else the last
    /// good one (a half-written renewal costs nothing).
    fn roots(&self) -> Arc<RootCertStore> {
        let bytes = read_pem(&self.path, MAX_BUNDLE).ok();
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bytes) = bytes
            && bytes != current.0
        {
            match roots_from_pem(&self.path, &bytes) {
                Ok(roots) => {
                    tracing::info!(bundle = %self.path.display(), "client CA bundle reloaded");
                    current.1 = roots;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "client CA bundle not reloaded; the last good one stays")
                }
            }
            current.0 = bytes;
        }
        current.1.clone()
    }
}

fn roots_from_pem(path: &Path, pem: &[u8]) -> Result<Arc<RootCertStore>, BundleError> {
    let bad = |why: String| BundleError::Bad {
        path: path.to_owned(),
        why,
    };
    let mut roots = RootCertStore::empty();
    for (i, cert) in CertificateDer::pem_slice_iter(pem).enumerate() {
        let cert = cert.map_err(|e| bad(format!("not PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| bad(format!("certificate {i} is no usable CA certificate: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("holds no PEM certificate".into()));
    }
    Ok(Arc::new(roots))
}

impl Source {
    /// The CA certificates callers' chains must lead to, as they are now.
    fn roots(&self) -> Result<Arc<RootCertStore>, String> {
        match self {
            Source::Files(f) => Ok(f.roots()),
            Source::Workload {
                source,
                trust_domain,
            } => {
                let bundle = source
                    .try_bundle_for_trust_domain(trust_domain)
                    .ok_or_else(|| {
                        format!("the Workload API holds no bundle for trust domain {trust_domain}")
                    })?;
                let mut roots = RootCertStore::empty();
                for c in bundle.authorities() {
                    let _ = roots.add(CertificateDer::from(c.as_bytes().to_vec()));
                }
                Ok(Arc::new(roots))
            }
        }
    }
}

/// A CA store and the WebPKI verifier made from it.
type Verifying = (Arc<RootCertStore>, Arc<dyn ClientCertVerifier>);

/// Checks callers' certificates as X.509-SVIDs against the bundle as it is at each
/// handshake. `mandatory`: a caller without a certificate fails the handshake (no other
/// credential is accepted); otherwise it goes on to present a bearer token.
pub struct SvidVerifier {
    source: Source,
    trust_domain: Option<String>,
    mandatory: bool,
    provider: Arc<CryptoProvider>,
    metrics: Arc<Metrics>,
    /// The last store seen and the WebPKI verifier made from it.
    cache: Mutex<Option<Verifying>>,
}

impl std::fmt::Debug for SvidVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvidVerifier")
            .field("trust_domain", &self.trust_domain)
            .field("mandatory", &self.mandatory)
            .finish()
    }
}

impl SvidVerifier {
    pub fn new(
        source: Source,
        trust_domain: Option<String>,
        mandatory: bool,
        provider: Arc<CryptoProvider>,
        metrics: Arc<Metrics>,
    ) -> Self {
        SvidVerifier {
            source,
            trust_domain,
            mandatory,
            provider,
            metrics,
            cache: Mutex::new(None),
        }
    }

    fn webpki(&self) -> Result<Arc<dyn ClientCertVerifier>, rustls::Error> {
        let roots = self.source.roots().map_err(rustls::Error::General)?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((r, v)) = cache.as_ref()
            && (Arc::ptr_eq(r, &roots) || r.roots == roots.roots)
        {
            return Ok(v.clone());
        }
        let verifier: Arc<dyn ClientCertVerifier> =
            WebPkiClientVerifier::builder_with_provider(roots.clone(), self.provider.clone())
                .allow_unauthenticated()
                .build()
                .map_err(|e| rustls::Error::General(format!("the client CA bundle: {e}")))?;
        *cache = Some((roots, verifier.clone()));
        Ok(verifier)
    }

    fn refuse(&self, reason: &str) {
        Metrics::count(&self.metrics.refusals, reason);
    }
}

impl ClientCertVerifier for SvidVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .webpki()
            .and_then(|v| v.verify_client_cert(end_entity, intermediates, now));
        if let Err(e) = &verified {
            self.refuse(match e {
                rustls::Error::InvalidCertificate(rustls::CertificateError::Expired)
                | rustls::Error::InvalidCertificate(rustls::CertificateError::ExpiredContext {
                    ..
                }) => "svid_expired",
                _ => "svid_untrusted",
            });
        }
        verified?;
        let svid = ClientSvid::parse(end_entity).and_then(|s| match &self.trust_domain {
            Some(td) if trust_domain_of(&s.spiffe_id) != Some(td.as_str()) => {
                Err(SvidError::TrustDomain {
                    id: s.spiffe_id,
                    trust_domain: td.clone(),
                })
            }
            _ => Ok(s),
        });
        match svid {
            Ok(_) => Ok(ClientCertVerified::assertion()),
            Err(e) => {
                self.refuse(e.reason());
                Err(rustls::Error::InvalidCertificate(
                    rustls::CertificateError::Other(rustls::OtherError(Arc::new(e))),
                ))
            }
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The registrar's own SVID from the Workload API, served at each handshake as it is
/// then: a rotated SVID is served from the next handshake on.
pub struct WorkloadCerts {
    source: Arc<spiffe::X509Source>,
    provider: Arc<CryptoProvider>,
    /// The SVID last converted, and its key.
    cache: Mutex<Option<(Arc<spiffe::X509Svid>, Arc<CertifiedKey>)>>,
}

impl std::fmt::Debug for WorkloadCerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkloadCerts")
    }
}

impl WorkloadCerts {
    pub fn new(source: Arc<spiffe::X509Source>, provider: Arc<CryptoProvider>) -> Self {
        WorkloadCerts {
            source,
            provider,
            cache: Mutex::new(None),
        }
    }
}

impl ResolvesServerCert for WorkloadCerts {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let svid = self.source.try_svid()?;
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((s, k)) = cache.as_ref()
            && Arc::ptr_eq(s, &svid)
        {
            return Some(k.clone());
        }
        let chain = svid
            .cert_chain()
            .iter()
            .map(|c| CertificateDer::from(c.as_bytes().to_vec()))
            .collect();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
            svid.private_key().as_bytes().to_vec(),
        ));
        match CertifiedKey::from_der(chain, key, &self.provider) {
            Ok(k) => {
                let k = Arc::new(k);
                tracing::info!(spiffe_id = %svid.spiffe_id(), "serving the SVID from the Workload API");
                *cache = Some((svid, k.clone()));
                Some(k)
            }
            Err(e) => {
                tracing::warn!(error = %e, "the SVID from the Workload API is unusable; the last one stays");
                cache.as_ref().map(|(_, k)| k.clone())
            }
        }
    }
}

/// Follows the Workload API at `endpoint` (`unix:///path`): returns once it has sent an
/// SVID and a bundle for `trust_domain`, or fails naming the endpoint.
pub async fn workload_source(
    endpoint: &str,
    trust_domain: &spiffe::TrustDomain,
) -> anyhow::Result<Arc<spiffe::X509Source>> {
    use anyhow::Context;
    let source = spiffe::X509SourceBuilder::new()
        .endpoint(endpoint)
        .initial_sync_timeout(WORKLOAD_API_TIMEOUT)
        .build()
        .await
        .with_context(|| {
            format!("--spiffe-endpoint {endpoint}: no SVID within {WORKLOAD_API_TIMEOUT:?}")
        })?;
    let svid = source
        .svid()
        .with_context(|| format!("--spiffe-endpoint {endpoint}: no SVID"))?;
    anyhow::ensure!(
        svid.spiffe_id().trust_domain() == trust_domain,
        "--spiffe-endpoint {endpoint}: the registrar's SVID {} is not in --trust-domain {trust_domain}",
        svid.spiffe_id()
    );
    anyhow::ensure!(
        source.try_bundle_for_trust_domain(trust_domain).is_some(),
        "--spiffe-endpoint {endpoint}: the Workload API sent no bundle for --trust-domain {trust_domain}"
    );
    tracing::info!(endpoint, spiffe_id = %svid.spiffe_id(), "the registrar's SVID from the Workload API");
    Ok(Arc::new(source))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(uris: &[&str]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = uris
            .iter()
            .map(|u| rcgen::SanType::URI((*u).to_owned().try_into().unwrap()))
            .collect();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn an_svid_carries_exactly_one_spiffe_uri_san() {
        let s = ClientSvid::parse(&leaf(&["spiffe://td/aether/agent"])).unwrap();
        assert_eq!(s.spiffe_id, "spiffe://td/aether/agent");
        assert!(s.not_after > 0 && !s.serial.is_empty());
        assert_eq!(
            ClientSvid::parse(&leaf(&["spiffe://td/a", "spiffe://td/b"])),
            Err(SvidError::UriSans(2))
        );
        assert_eq!(ClientSvid::parse(&leaf(&[])), Err(SvidError::UriSans(0)));
        assert_eq!(
            ClientSvid::parse(&leaf(&["https://td/a"])),
            Err(SvidError::NotSpiffe("https://td/a".into()))
        );
        assert!(matches!(
            ClientSvid::parse(b"not a certificate"),
            Err(SvidError::Parse(_))
        ));
        for (id, td) in [
            ("spiffe://td/a", Some("td")),
            ("spiffe://td", None),
            ("spiffe:///a", None),
        ] {
            assert_eq!(trust_domain_of(id), td, "{id}");
        }
    }
}
