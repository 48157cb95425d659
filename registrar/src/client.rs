//! The operator's commands (`apply`, `delete`, `dump`): one registry API call each, to
//! the first registrar of `--registrar` that answers.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use shared_proto::registry::{self as pb, registry_client::RegistryClient};
use shared_proto::registry_tls;
use tonic::transport::{Channel, Endpoint};

use crate::cli::ClientArgs;
use crate::values;
use crate::view::View;

/// The stream key `dump` watches under: its own process, so it replaces no agent's stream.
fn dump_key() -> pb::WatchEndpointsRequest {
    pb::WatchEndpointsRequest {
        cluster: String::new(),
        node: "aether-registrar-dump".into(),
        instance: format!("pid-{}", std::process::id()),
        resume_revision: 0,
    }
}

/// `ADDR` as a tonic endpoint: `unix:///path` as it is, `host:port` over HTTP/2.
pub fn endpoint(addr: &str, timeout: Duration) -> anyhow::Result<Endpoint> {
    let uri = if addr.starts_with("unix:") || addr.contains("://") {
        addr.to_owned()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)
        .with_context(|| format!("--registrar {addr:?} is neither unix:///path nor host:port"))?
        .connect_timeout(timeout)
        .timeout(timeout))
}

/// Connects to the first of the comma-separated addresses that answers; over TLS to a
/// `host:port`, checked against the CA certificates in `ca`, when it is given.
pub async fn connect(
    addrs: &str,
    timeout: Duration,
    ca: Option<&Path>,
) -> anyhow::Result<RegistryClient<Channel>> {
    connect_with(addrs, timeout, ca, None).await
}

/// [`connect`], presenting the client certificate `cert` (chain and key files) over TLS.
pub async fn connect_with(
    addrs: &str,
    timeout: Duration,
    ca: Option<&Path>,
    cert: Option<(&Path, &Path)>,
) -> anyhow::Result<RegistryClient<Channel>> {
    let client = cert.map(client_cert).transpose()?;
    let tls = ca
        .map(|ca| registry_tls::client_config_with(ca, client).context("--ca"))
        .transpose()?;
    let mut failures = Vec::new();
    for addr in addrs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let endpoint = endpoint(addr, timeout)?;
        let connected = match &tls {
            Some(config) if !addr.starts_with("unix:") => {
                registry_tls::channel(endpoint, addr, config.clone()).await
            }
            _ => endpoint.connect().await,
        };
        match connected {
            Ok(channel) => return Ok(RegistryClient::new(channel)),
            Err(e) => failures.push(format!("{addr}: {}", chain(&e))),
        }
    }
    if failures.is_empty() {
        anyhow::bail!("--registrar is empty");
    }
    anyhow::bail!("no registrar answers: {}", failures.join("; "))
}

/// The client certificate of `--cert` and `--key`; an error names the file.
fn client_cert((cert, key): (&Path, &Path)) -> anyhow::Result<registry_tls::ClientCert> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("--cert {}", cert.display()))?;
    anyhow::ensure!(
        !chain.is_empty(),
        "--cert {}: holds no PEM certificate",
        cert.display()
    );
    let key =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("--key {}", key.display()))?;
    Ok((chain, key))
}

/// The client certificate flags as a pair.
fn cert_of(args: &ClientArgs) -> Option<(&Path, &Path)> {
    args.cert.as_deref().zip(args.key.as_deref())
}

/// An error with its sources, which tonic's transport errors keep the cause in.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// `message` as a request, with `--token-file`'s token as its bearer credential (read at
/// each call: a projected token is rotated in place).
fn request<T>(args: &ClientArgs, message: T) -> anyhow::Result<tonic::Request<T>> {
    let mut req = tonic::Request::new(message);
    if let Some(path) = &args.token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("--token-file {}", path.display()))?;
        let value = format!("Bearer {}", token.trim()).parse().map_err(|_| {
            anyhow::anyhow!(
                "--token-file {}: the token is not a valid header value",
                path.display()
            )
        })?;
        req.metadata_mut().insert("authorization", value);
    }
    Ok(req)
}

fn status(args: &ClientArgs, what: &str, s: tonic::Status) -> anyhow::Error {
    // A registrar that serves TLS drops a plain HTTP/2 client at its preface: say what
    // probably happened.
    let plain = args.ca.is_none()
        && registry_tls::looks_like_plain_to_tls(&s)
        && !args.registrar.starts_with("unix:");
    let hint = if plain {
        " (a registrar serving TLS drops plain HTTP/2: pass --ca with its CA)"
    } else {
        ""
    };
    anyhow::anyhow!("{what}: {:?}: {}{hint}", s.code(), s.message())
}

pub async fn apply(args: &ClientArgs, file: &Path) -> anyhow::Result<()> {
    let bytes =
        std::fs::read(file).map_err(|source| aether_model::registry_file::FileError::Read {
            path: file.to_owned(),
            source,
        })?;
    let mut ignored = aether_model::registry_file::Ignored::default();
    let view = aether_model::registry_file::parse_noting(file, &bytes, &mut ignored)?;
    if ignored.count > 0 {
        // The registry's API has no field for them: said, not sent (a typo, or a newer
        // release's file).
        eprintln!(
            "warning: {}: fields not known to this release, ignored: {ignored}",
            file.display()
        );
    }
    let services: Vec<pb::Service> = view
        .services
        .values()
        .map(values::model_service_to_pb)
        .collect();
    let n = services.len();
    let mut client = connect_with(
        &args.registrar,
        Duration::from_secs(args.timeout),
        args.ca.as_deref(),
        cert_of(args),
    )
    .await?;
    let resp = client
        .apply_services(request(args, pb::ApplyServicesRequest { services })?)
        .await
        .map_err(|s| status(args, "ApplyServices", s))?
        .into_inner();
    println!(
        "applied {n} services from {} (revision {})",
        file.display(),
        resp.revision
    );
    Ok(())
}

pub async fn delete(args: &ClientArgs, service: &str) -> anyhow::Result<()> {
    let Some((namespace, name)) = service.split_once('/') else {
        anyhow::bail!("--service {service:?} is not NAMESPACE/NAME");
    };
    let key = pb::ServiceKey {
        namespace: namespace.into(),
        name: name.into(),
    };
    let mut client = connect_with(
        &args.registrar,
        Duration::from_secs(args.timeout),
        args.ca.as_deref(),
        cert_of(args),
    )
    .await?;
    let resp = client
        .delete_service(request(
            args,
            pb::DeleteServiceRequest { service: Some(key) },
        )?)
        .await
        .map_err(|s| status(args, "DeleteService", s))?
        .into_inner();
    if resp.deleted {
        println!("deleted {service} (revision {})", resp.revision);
    } else {
        println!(
            "{service} was not in the registry (revision {})",
            resp.revision
        );
    }
    Ok(())
}

pub async fn dump(args: &ClientArgs) -> anyhow::Result<()> {
    let mut client = connect_with(
        &args.registrar,
        Duration::from_secs(args.timeout),
        args.ca.as_deref(),
        cert_of(args),
    )
    .await?;
    let mut stream = client
        .watch_endpoints(request(args, dump_key())?)
        .await
        .map_err(|s| status(args, "WatchEndpoints", s))?
        .into_inner();
    let first = stream
        .message()
        .await
        .map_err(|s| status(args, "WatchEndpoints", s))?;
    let Some(pb::WatchEndpointsResponse {
        kind: Some(pb::watch_endpoints_response::Kind::Full(full)),
    }) = first
    else {
        anyhow::bail!("WatchEndpoints: the first message is not a full view: {first:?}");
    };
    print!("{}", View::from_full(&full)?.to_json());
    Ok(())
}
