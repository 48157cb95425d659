//! TLS to a registrar, the client's side: the agents' watch (`--registrar-ca`) and the
//! operator's commands (`aether-registrar apply|delete|dump --ca`) verify the registrar's
//! serving certificate against a CA bundle in a PEM file, and speak HTTP/2 inside the
//! session (ALPN `h2`). The file is read again at each connect, so a rotated bundle is
//! picked up by the next reconnect. A caller with an X.509-SVID (an agent with workload
//! identity) presents it as its client certificate ([`client_config_with`]); callers
//! without one authenticate with their bearer tokens, which TLS keeps from the network.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// The largest CA bundle read: far above any real one.
const MAX_BUNDLE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {size} bytes, more than a CA bundle's {MAX_BUNDLE}")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{path}: not PEM: {source}")]
    Pem {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: holds no PEM certificate")]
    Empty { path: PathBuf },
    #[error("{path}: certificate {index} is no usable CA certificate: {source}")]
    BadCa {
        path: PathBuf,
        index: usize,
        source: rustls::Error,
    },
    #[error("the client certificate to present with {path}'s CAs is unusable: {source}")]
    ClientCert {
        path: PathBuf,
        source: rustls::Error,
    },
    #[error(
        "{addr:?}: {host:?} is neither a DNS name nor an IP address to check the registrar's certificate against"
    )]
    ServerName { addr: String, host: String },
}

/// Reads a PEM file of at most `max` bytes.
pub fn read_pem(path: &Path, max: u64) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let read = |source| TlsError::Read {
        path: path.to_owned(),
        source,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(read)?
        .take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(read)?;
    match bytes.len() as u64 > max {
        true => Err(TlsError::TooLarge {
            path: path.to_owned(),
            size: std::fs::metadata(path).map_or(max + 1, |m| m.len()),
        }),
        false => Ok(bytes),
    }
}

/// The client configuration that trusts the CA certificates in `ca`, and only those.
pub fn client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    client_config_with(ca, None)
}

/// A client certificate chain (leaf first) and its key.
pub type ClientCert = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// [`client_config`], presenting `client` as the client certificate when given (an
/// agent's X.509-SVID, to a registrar that asks for one).
pub fn client_config_with(
    ca: &Path,
    client: Option<ClientCert>,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let pem = read_pem(ca, MAX_BUNDLE)?;
    let mut roots = rustls::RootCertStore::empty();
    for (index, cert) in CertificateDer::pem_slice_iter(&pem).enumerate() {
        let cert = cert.map_err(|source| TlsError::Pem {
            path: ca.to_owned(),
            source,
        })?;
        roots.add(cert).map_err(|source| TlsError::BadCa {
            path: ca.to_owned(),
            index,
            source,
        })?;
    }
    if roots.is_empty() {
        return Err(TlsError::Empty {
            path: ca.to_owned(),
        });
    }
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports rustls's default protocol versions")
    .with_root_certificates(roots);
    let mut config = match client {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|source| TlsError::ClientCert {
                path: ca.to_owned(),
                source,
            })?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// The name the registrar's certificate must carry: the host of `host:port`, a DNS name
/// or an IP address (IPv6 in brackets).
pub fn server_name(addr: &str) -> Result<ServerName<'static>, TlsError> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    ServerName::try_from(bare.to_owned()).map_err(|_| TlsError::ServerName {
        addr: addr.to_owned(),
        host: host.to_owned(),
    })
}

/// A TCP connection to `addr` (`host:port`) and a TLS session on it, the registrar's
/// certificate checked against `config`'s CAs and `addr`'s host. A failed check is an
/// error naming it (`invalid peer certificate: UnknownIssuer`, `... NotValidForName`).
pub async fn connect(
    addr: &str,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let name = server_name(addr).map_err(std::io::Error::other)?;
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// A channel on `endpoint` whose connections go to `addr` over [`connect`]: the address in
/// `endpoint`'s URI is not dialled.
pub async fn channel(
    endpoint: tonic::transport::Endpoint,
    addr: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let addr = addr.to_owned();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let (addr, config) = (addr.clone(), config.clone());
        async move {
            connect(&addr, config)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    endpoint.connect_with_connector(connector).await
}

/// Whether a call's failure looks like a plain HTTP/2 client talking to a registrar that
/// serves TLS: the server drops the connection at the client's preface, after a TLS
/// alert that the client reads as a broken frame. The call then ends Cancelled, with an
/// HTTP/2 protocol error or with a bare transport error, depending on what the client saw
/// first.
pub fn looks_like_plain_to_tls(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Cancelled
        || ["h2 protocol error", "transport error"]
            .iter()
            .any(|m| status.message().contains(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_the_address_host() {
        for (addr, want) in [
            (
                "registrar.aether-system.svc:7800",
                "registrar.aether-system.svc",
            ),
            ("127.0.0.1:7800", "127.0.0.1"),
            ("[::1]:7800", "::1"),
        ] {
            let name = server_name(addr).unwrap();
            assert_eq!(name.to_str(), want, "{addr}");
        }
        let e = server_name("bad_host!:7800").unwrap_err().to_string();
        assert!(e.contains("\"bad_host!\""), "{e}");
    }

    #[test]
    fn a_bad_bundle_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        assert!(
            client_config(&missing)
                .unwrap_err()
                .to_string()
                .contains("missing.pem")
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let e = client_config(&empty).unwrap_err().to_string();
        assert!(e.contains("empty.pem: holds no PEM certificate"), "{e}");
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(
            &garbage,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let e = client_config(&garbage).unwrap_err().to_string();
        assert!(
            e.contains("garbage.pem: certificate 0 is no usable CA certificate"),
            "{e}"
        );
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; (MAX_BUNDLE + 1) as usize]).unwrap();
        let e = client_config(&big).unwrap_err().to_string();
        assert!(
            e.contains("big.pem") && e.contains("more than a CA bundle's"),
            "{e}"
        );
    }
}
