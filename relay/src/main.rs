//! `aether-xds-relay`: keeps Envoy's ADS stream open while the node agent behind it
//! changes hands (a surge roll, a recreate roll, a worker crash).
#![forbid(unsafe_code)]

mod metrics;
mod relay;
mod session;
mod sotw;
mod wire;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::metrics::Metrics;
use crate::relay::{AdsServer, Relay};

/// Relays Envoy's ADS stream, incremental (delta) or state of the world, to the node
/// agent's `xds.sock`, and keeps it open across the agent's rolls.
///
/// Session rules: the relay keeps, per resource type, what Envoy is subscribed to and the
/// versions Envoy has ACKed (state of the world: the version_info, and a hash of each
/// resource Envoy holds), never the resources. When the agent's stream ends it opens the
/// next at once (the connect waits in the socket's backlog until the new owner accepts;
/// it backs off only after repeated failures) and re-states Envoy's subscriptions in ADS
/// order: delta with the versions Envoy holds, so the new owner sends only what changed;
/// state of the world with the version_info Envoy last ACKed, and an answer Envoy already
/// holds, resource for resource, is ACKed by the relay and not forwarded. Envoy's ACKs and
/// NACKs of the old stream's answers are absorbed; its subscription changes during the
/// switch are folded in and re-stated. Each agent stream has a connection of its own, so
/// that one a released owner ends at its handover is re-stated on the successor. Over
/// delta, the types and EDS names that match the new owner's snapshot go by their digests
/// instead of every version and name, and a released owner that says so in-band keeps
/// carrying changes while the relay opens and re-states the next stream (once Envoy has
/// answered all it was sent); the relay switches when the successor has answered the
/// re-statement, or re-states afresh if the old stream carried a change meanwhile.
/// Without any agent stream for --upstream-grace, it
/// ends Envoy's stream, so that Envoy's own control-plane signals show the outage.
///
/// The relay carries every pod's private key (SDS): its socket is 0660, it is not
/// dumpable, and it forwards each message as the bytes it received.
#[derive(Parser, Debug)]
#[command(name = "aether-xds-relay", version)]
struct Args {
    /// Where Envoy connects: unix:///PATH. A stale socket file (nothing listening) is
    /// replaced; a live one is an error.
    #[arg(long, env = "AETHER_RELAY_LISTEN")]
    listen: String,
    /// The node agent's ADS socket: unix:///PATH.
    #[arg(
        long,
        env = "AETHER_RELAY_UPSTREAM",
        default_value = "unix:///run/aether/xds.sock"
    )]
    upstream: String,
    /// Prometheus metrics on HOST:PORT, or `off`. Off by default: the proxy pod is
    /// hostNetwork, and the agent has 127.0.0.1:15090.
    #[arg(long, env = "AETHER_RELAY_METRICS_ADDR", default_value = "off")]
    metrics_addr: String,
    /// How long Envoy's stream is kept open without any agent stream (e.g. 30s, 500ms).
    #[arg(long, env = "AETHER_RELAY_UPSTREAM_GRACE", default_value = "30s", value_parser = shared_proto::flags::parse_duration)]
    upstream_grace: Duration,
    /// Log format: text or json.
    #[arg(long, env = "AETHER_RELAY_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

/// The largest message either side may send: answers at 10,000 services are tens of MiB.
const MAX_MESSAGE: usize = 256 << 20;

fn unix_path(flag: &str, v: &str) -> anyhow::Result<PathBuf> {
    match v.strip_prefix("unix://") {
        Some(p) if p.starts_with('/') => Ok(PathBuf::from(p)),
        _ => anyhow::bail!("--{flag} {v:?}: expected unix:///ABSOLUTE/PATH"),
    }
}

/// Binds the listening socket, replacing a stale file, mode 0660.
fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("{}: another relay is listening there", path.display());
        }
        std::fs::remove_file(path)
            .map_err(|e| anyhow::anyhow!("{}: removing the stale socket: {e}", path.display()))?;
        tracing::info!(path = %path.display(), "relay: replaced a stale socket file");
    }
    let l = tokio::net::UnixListener::bind(path)
        .map_err(|e| anyhow::anyhow!("{}: bind: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| anyhow::anyhow!("{}: chmod 0660: {e}", path.display()))?;
    Ok(l)
}

async fn serve_metrics(addr: std::net::SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("--metrics-addr {addr}: {e}"))?;
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let m = metrics.clone();
            tokio::spawn(async move {
                let svc =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let body = if req.uri().path() == "/metrics" {
                            m.render()
                        } else {
                            String::new()
                        };
                        let status = if body.is_empty() { 404 } else { 200 };
                        async move {
                            http::Response::builder()
                                .status(status)
                                .header("content-type", "text/plain; version=0.0.4")
                                .body(body)
                        }
                    });
                let io = hyper_util::rt::TokioIo::new(tcp);
                let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
                let _ = tokio::time::timeout(Duration::from_secs(10), conn).await;
            });
        }
    });
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    shared_proto::logging::init(&args.log_format);
    let outcome = confine().and_then(|()| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
            .block_on(run(args))
    });
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("aether-xds-relay: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Before any thread starts, so that every thread inherits it all. Every pod's private key
/// passes through: no core dump, no ptrace by the same uid. Then the worker's seccomp
/// policy (an allow list; the relay's calls, measured under strace, are a subset of it).
fn confine() -> anyhow::Result<()> {
    nix::sys::prctl::set_dumpable(false)
        .map_err(|e| anyhow::anyhow!("prctl(PR_SET_DUMPABLE): {e}"))?;
    shared_proto::seccomp::confine_alone()
        .map_err(|e| anyhow::anyhow!("confining the relay with its seccomp filters: {e}"))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let listen = unix_path("listen", &args.listen)?;
    let upstream = unix_path("upstream", &args.upstream)?;
    let metrics = Arc::new(Metrics::default());
    if args.metrics_addr != "off" {
        let addr = args
            .metrics_addr
            .parse()
            .map_err(|e| anyhow::anyhow!("--metrics-addr {:?}: {e}", args.metrics_addr))?;
        serve_metrics(addr, metrics.clone()).await?;
    }
    let listener = bind(&listen)?;
    tracing::info!(listen = %listen.display(), upstream = %upstream.display(), grace = ?args.upstream_grace, "relay: serving");
    let relay = Arc::new(Relay {
        upstream,
        grace: args.upstream_grace,
        max_message: MAX_MESSAGE,
        metrics,
    });
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tonic::transport::Server::builder()
        .add_service(AdsServer(relay))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            async move {
                term.recv().await;
            },
        )
        .await?;
    let _ = std::fs::remove_file(&listen);
    Ok(())
}
