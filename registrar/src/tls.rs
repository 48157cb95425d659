//! `--tls-cert`/`--tls-key`: TLS on a TCP `--listen`, so that the callers' bearer tokens
//! and the registry they watch cross the network encrypted, and an agent can check whom
//! it talks to (`--registrar-ca`). TLS authenticates the registrar, not its callers:
//! they still present tokens (`--token-review`), or everyone may do everything
//! (`--insecure-listen`).
//!
//! The certificate and key are read at start, where a bad pair is an error naming the
//! file, and again at each handshake; when their bytes changed (a Kubernetes Secret
//! volume swaps both at once, a renewal in place writes one then the other) the new pair
//! is loaded. A pair
//! that does not load, or whose key does not match, is logged and the last good pair
//! stays, so a half-written renewal costs nothing. Handshakes run beside the accept
//! loop, each bounded by [`HANDSHAKE_TIMEOUT`], so a silent client holds up no other.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use shared_proto::registry_tls::{TlsError, read_pem};

use crate::conns::{Admitted, Conns};
use crate::metrics::Metrics;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

/// How long a client may take over its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How many handshakes may be in progress at once (`incoming`).
pub const MAX_HANDSHAKES: usize = 256;
/// The largest certificate chain or key file read.
const MAX_PEM: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error(transparent)]
    File(#[from] TlsError),
    #[error("{path}: holds no PEM certificate")]
    NoCertificate { path: PathBuf },
    #[error("{path}: holds no PEM private key: {source}")]
    NoKey {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("--tls-cert {cert} or --tls-key {key} cannot be read")]
    Unreadable { cert: PathBuf, key: PathBuf },
    #[error("--tls-key {key} does not fit --tls-cert {cert}: {source}")]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

/// The serving certificate, loaded again when its files change.
#[derive(Debug)]
pub struct Certs {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    /// The files' bytes last tried, and the last pair that loaded.
    current: Mutex<(Files, Arc<CertifiedKey>)>,
}

/// Both files as read: the certificate's and the key's bytes, or None where a read failed.
type Files = [Option<Vec<u8>>; 2];

impl Certs {
    /// Loads the pair; an error names the file at fault.
    pub fn load(cert: &Path, key: &Path, provider: Arc<CryptoProvider>) -> Result<Self, CertError> {
        let files = [read_pem(cert, MAX_PEM)?, read_pem(key, MAX_PEM)?];
        let loaded = parse_pair(cert, key, &files[0], &files[1], &provider)?;
        Ok(Certs {
            cert: cert.to_owned(),
            key: key.to_owned(),
            provider,
            current: Mutex::new((files.map(Some), loaded)),
        })
    }

    /// The pair to serve: the files' again if their bytes changed and they load. Two
    /// small reads per handshake, which comes once per connection; comparing the bytes,
    /// not the mtimes, misses no rewrite within a clock tick.
    fn refresh(&self) -> Arc<CertifiedKey> {
        let files = [
            read_pem(&self.cert, MAX_PEM).ok(),
            read_pem(&self.key, MAX_PEM).ok(),
        ];
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.0 != files {
            let loaded = match &files {
                [Some(c), Some(k)] => parse_pair(&self.cert, &self.key, c, k, &self.provider),
                _ => Err(CertError::Unreadable {
                    cert: self.cert.clone(),
                    key: self.key.clone(),
                }),
            };
            match loaded {
                Ok(pair) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    current.1 = pair;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "serving certificate not reloaded; the last good one stays")
                }
            }
            current.0 = files;
        }
        current.1.clone()
    }
}

impl ResolvesServerCert for Certs {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.refresh())
    }
}

fn parse_pair(
    cert: &Path,
    key: &Path,
    cert_pem: &[u8],
    key_pem: &[u8],
    provider: &CryptoProvider,
) -> Result<Arc<CertifiedKey>, CertError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: cert.to_owned(),
            source,
        })?;
    if chain.is_empty() {
        return Err(CertError::NoCertificate {
            path: cert.to_owned(),
        });
    }
    let secret = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| CertError::NoKey {
        path: key.to_owned(),
        source,
    })?;
    CertifiedKey::from_der(chain, secret, provider)
        .map(Arc::new)
        .map_err(|source| CertError::Mismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
            source,
        })
}

/// The server configuration: TLS 1.2 and 1.3 with ring, HTTP/2 by ALPN, no client
/// certificate asked for.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, CertError> {
    let provider = provider();
    let certs = Certs::load(cert, key, provider.clone())?;
    Ok(config_with(Arc::new(certs), None, provider))
}

/// The crypto provider of every TLS session here: ring.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server configuration serving `certs`, asking callers for a certificate checked by
/// `clients` when given (mutual TLS, `crate::mtls`).
pub fn config_with(
    certs: Arc<dyn ResolvesServerCert>,
    clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    provider: Arc<CryptoProvider>,
) -> Arc<rustls::ServerConfig> {
    let builder = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports rustls's default protocol versions");
    let mut config = match clients {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    }
    .with_cert_resolver(certs);
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// The TLS sessions of `listener`'s connections, for tonic to serve. Each handshake runs
/// in a task of its own; one that fails or times out is logged with the peer's address
/// and dropped. At most `max_handshakes` run at once: a connection past that is closed at
/// once, so a flood of silent clients costs a bounded number of tasks and buffers, not
/// one per connection for [`HANDSHAKE_TIMEOUT`]. Before its handshake a connection is
/// admitted under the connection caps (`conns`), or closed. Ends when the stream is
/// dropped.
pub fn incoming(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    max_handshakes: usize,
    conns: Arc<Conns>,
    metrics: Arc<Metrics>,
) -> ReceiverStream<std::io::Result<TlsStream<Admitted<TcpStream>>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(max_handshakes));
    tokio::spawn(async move {
        let mut pause = Duration::from_millis(10);
        loop {
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, most likely: back off instead of spinning.
                    tracing::warn!(error = %e, retry_in = ?pause, "accept failed");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            pause = Duration::from_millis(10);
            let _ = tcp.set_nodelay(true);
            let Some(admission) = conns.admit(Some(peer.ip())) else {
                continue;
            };
            let tcp = Admitted::new(tcp, admission);
            let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                Metrics::count(&metrics.tls_handshakes, "over_cap");
                tracing::warn!(%peer, max_handshakes, "too many TLS handshakes in progress; connection closed");
                continue;
            };
            let (acceptor, tx, metrics) = (acceptor.clone(), tx.clone(), metrics.clone());
            tokio::spawn(async move {
                let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
                drop(permit);
                let result = match handshake {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(Ok(tls)).await;
                        "ok"
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "TLS handshake failed{}", plain_hint(&e));
                        if no_certificate(&e) {
                            Metrics::count(&metrics.refusals, "svid_missing");
                        }
                        "failed"
                    }
                    Err(_) => {
                        tracing::warn!(%peer, timeout = ?HANDSHAKE_TIMEOUT, "TLS handshake timed out");
                        "timeout"
                    }
                };
                Metrics::count(&metrics.tls_handshakes, result);
            });
        }
    });
    ReceiverStream::new(rx)
}

/// A client that presented no certificate to a registrar that requires one.
fn no_certificate(e: &std::io::Error) -> bool {
    matches!(
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::NoCertificatesPresented)
    )
}

/// A client that sent no TLS record at all, most likely plain HTTP/2: which flag it lacks.
fn plain_hint(e: &std::io::Error) -> &'static str {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) => {
            ": the peer does not speak TLS (an agent without --registrar-ca, or a command without --ca?)"
        }
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Whether `certs` serves the certificate in `pem`.
    fn serves(certs: &Certs, pem: &str) -> bool {
        certs.refresh().cert[0] == CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    #[test]
    fn a_changed_pair_is_served_and_a_broken_one_leaves_the_last_good_one() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let (c1, k1) = pair("one.example");
        std::fs::write(&cert, &c1).unwrap();
        std::fs::write(&key, &k1).unwrap();
        let certs = Certs::load(
            &cert,
            &key,
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .unwrap();
        assert!(serves(&certs, &c1));

        // A renewal half written (the new certificate, the old key) changes nothing.
        let (c2, k2) = pair("two.example");
        std::fs::write(&cert, &c2).unwrap();
        assert!(serves(&certs, &c1));
        // Once the key follows, the new pair is served.
        std::fs::write(&key, &k2).unwrap();
        assert!(serves(&certs, &c2));
        // A file gone leaves the last good pair too.
        std::fs::remove_file(&key).unwrap();
        assert!(serves(&certs, &c2));
    }

    /// A silent client holds the one handshake slot: the next connection is closed at
    /// once, and once the slot is free a real client completes its handshake.
    #[tokio::test]
    async fn connections_past_the_handshake_cap_are_closed_at_once() {
        use tokio::io::AsyncReadExt;
        use tokio_stream::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()])
            .unwrap()
            .self_signed(&ca)
            .unwrap();
        let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, ca.serialize_pem()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Metrics::new(false);
        let mut sessions = incoming(
            listener,
            server_config(&cert_file, &key_file).unwrap(),
            1,
            crate::conns::Conns::new(
                crate::conns::ConnLimits {
                    total: 16,
                    per_source: 16,
                },
                metrics.clone(),
            ),
            metrics.clone(),
        );

        let silent = TcpStream::connect(addr).await.unwrap();
        // The silent client's handshake task holds the slot once it is accepted; a
        // connection closed at once reads end-of-file.
        let mut refused = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), refused.read(&mut buf))
            .await
            .expect("closed at once")
            .unwrap_or(0);
        assert_eq!(n, 0, "the connection past the cap is closed");

        drop(silent);
        let ca_file = dir.path().join("ca.crt");
        std::fs::write(&ca_file, cert.pem()).unwrap();
        let config = shared_proto::registry_tls::client_config(&ca_file).unwrap();
        // The freed slot serves a real client (the silent one's task ends on its close).
        let client = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match shared_proto::registry_tls::connect(&addr.to_string(), config.clone()).await {
                    Ok(c) => break c,
                    Err(_) => tokio::task::yield_now().await,
                }
            }
        })
        .await
        .expect("a handshake once the slot is free");
        let served = tokio::time::timeout(Duration::from_secs(5), sessions.next())
            .await
            .expect("a session")
            .expect("the stream goes on");
        assert!(served.is_ok());
        drop(client);
        let text = metrics.encode();
        for want in [
            "aether_registrar_tls_handshakes_total{result=\"over_cap\"}",
            "aether_registrar_tls_handshakes_total{result=\"ok\"} 1",
        ] {
            assert!(text.contains(want), "{want} in {text}");
        }
    }

    #[test]
    fn a_bad_pair_at_start_names_the_file_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        let provider = || Arc::new(rustls::crypto::ring::default_provider());
        let err = |c: &Path, k: &Path| Certs::load(c, k, provider()).unwrap_err().to_string();
        assert!(
            err(&cert, &key).contains("tls.crt: No such file"),
            "{}",
            err(&cert, &key)
        );
        let (c1, k1) = pair("one.example");
        let (_, k2) = pair("two.example");
        std::fs::write(&cert, "not pem\n").unwrap();
        std::fs::write(&key, &k1).unwrap();
        assert!(
            err(&cert, &key).contains("tls.crt: holds no PEM certificate"),
            "{}",
            err(&cert, &key)
        );
        std::fs::write(&cert, &c1).unwrap();
        std::fs::write(&key, "not pem\n").unwrap();
        assert!(
            err(&cert, &key).contains("tls.key: holds no PEM private key"),
            "{}",
            err(&cert, &key)
        );
        std::fs::write(&key, &k2).unwrap();
        let e = err(&cert, &key);
        assert!(
            e.contains("does not fit --tls-cert") && e.contains("tls.key") && e.contains("tls.crt"),
            "{e}"
        );
    }
}
