//! `aether-registrar serve`: the wiring. Refuses plain TCP without `--insecure-listen`
//! before anything else, checks that etcd answers, binds, and serves until SIGTERM or
//! SIGINT, when open watch streams end with UNAVAILABLE (their clients resume on another
//! replica or after the restart). The socket file is left in place at exit; the next
//! start replaces it once nothing answers on it.

use std::time::Duration;

use anyhow::Context;
use shared_proto::registry::registry_server::RegistryServer;
use tokio::signal::unix::{SignalKind, signal};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};

use crate::authz::Policy;
use crate::cli::ServeArgs;
use crate::keys::Layout;
use crate::listen::{self, Bound, ListenAddr, ListenError};
use crate::service::{Registrar, Transport};
use crate::store::{EtcdOptions, Store};
use crate::tokenreview::Reviewer;

fn bound_kind(b: &Bound) -> bool {
    matches!(b, Bound::Tcp(_))
}

/// How long open connections get to close after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// How long the start waits for etcd to answer.
const ETCD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if let (ListenAddr::Tcp(a), false) = (&args.listen, args.insecure_listen || args.token_review) {
        return Err(ListenError::InsecureTcp(a.clone()).into());
    }
    if args.token_review && !matches!(args.listen, ListenAddr::Tcp(_)) {
        anyhow::bail!("--token-review is for a TCP --listen; a unix socket identifies callers by uid (--agent-uid, --operator-uid)");
    }
    if args.etcd_prefix.is_empty() {
        anyhow::bail!("--etcd-prefix is empty; the registry needs a prefix of its own");
    }
    let layout = Layout::new(&args.etcd_prefix);
    let opts = EtcdOptions {
        endpoints: args.etcd.clone(),
        ca: args.etcd_ca.clone(),
        cert: args.etcd_cert.clone(),
        key: args.etcd_key.clone(),
        connect_timeout: ETCD_CONNECT_TIMEOUT,
    };
    let store = Store::connect(&opts, layout).await?;
    let own_uid = nix::unistd::getuid().as_raw();
    let policy = Policy {
        agent_uids: args.agent_uids.clone(),
        operator_uids: if args.operator_uids.is_empty() { vec![own_uid] } else { args.operator_uids.clone() },
        agent_accounts: args.agent_accounts.clone(),
        operator_users: args.operator_users.clone(),
    };
    let reviewer = match args.token_review {
        true => Some(std::sync::Arc::new(Reviewer::connect(args.kubeconfig.as_deref(), args.token_audience.clone()).await?)),
        false => None,
    };
    let bound = listen::bind(&args.listen, args.insecure_listen || args.token_review, args.socket_mode).await?;
    let transport = match (bound_kind(&bound), reviewer) {
        (false, _) => Transport::Unix,
        (true, Some(r)) => {
            tracing::info!(listen = %args.listen, audience = %args.token_audience, agents = ?policy.agent_accounts, operators = ?policy.operator_users,
                "serving TCP to callers with a bearer token, checked with TokenReview");
            Transport::TokenTcp(r)
        }
        (true, None) => {
            tracing::warn!(listen = %args.listen, "serving plain TCP (--insecure-listen): callers are not authenticated and every caller may apply and delete services");
            Transport::InsecureTcp
        }
    };
    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let shutdown_seen = shutdown_rx.clone();
    let registrar = Registrar::new(store, policy.clone(), transport, args.cluster.clone(), shutdown_rx);
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let stop = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: stopping"),
            _ = int.recv() => tracing::info!("SIGINT: stopping"),
        }
        let _ = shutdown_tx.send(true);
    };
    tracing::info!(
        listen = %args.listen, etcd = %args.etcd.join(","), prefix = %args.etcd_prefix,
        agent_uids = ?policy.agent_uids, operator_uids = ?policy.operator_uids, cluster = ?args.cluster,
        "serving the registry API"
    );
    let server = tonic::transport::Server::builder().add_service(RegistryServer::new(registrar));
    let serving = async {
        match bound {
            Bound::Unix(l) => server.serve_with_incoming_shutdown(UnixListenerStream::new(l), stop).await,
            Bound::Tcp(l) => server.serve_with_incoming_shutdown(TcpListenerStream::new(l), stop).await,
        }
    };
    // A graceful HTTP/2 shutdown waits for every client to acknowledge it; a hung client
    // does not hold the exit up for longer than this.
    let mut stopping = shutdown_seen;
    let deadline = async move {
        let _ = stopping.wait_for(|s| *s).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = serving => served.with_context(|| format!("serving on {}", args.listen))?,
        _ = deadline => tracing::warn!("connections still open {SHUTDOWN_GRACE:?} after the signal; exiting without them"),
    }
    tracing::info!("stopped");
    Ok(())
}
