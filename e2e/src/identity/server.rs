//! The test identity provider's listeners: the Workload API and the Delegated Identity API,
//! each a tonic server on its own unix socket, both driven by one `down` signal. Down:
//! tonic stops accepting and closes each connection once its streams have ended (the
//! handle ends them first), then the listeners are dropped, so that connects are refused;
//! the socket files stay, as a stopped agent leaves them. Up: the stale files are replaced
//! and both paths are listened on again.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use super::delegated::DelegatedApi;
use super::pb::spire::api::agent::delegatedidentity::v1::delegated_identity_server::DelegatedIdentityServer;
use super::pb::workload::spiffe_workload_api_server::SpiffeWorkloadApiServer;
use super::state::Shared;
use super::workload::WorkloadApi;

/// Binds a unix socket at `path`, first removing a socket file left there (but nothing
/// else: a regular file in the way is an error).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}

/// Serves both APIs on `listeners` until `down` turns true, then again on fresh listeners
/// at the same paths each time it turns false; runs until the runtime is dropped.
pub async fn serve(
    shared: Arc<Shared>,
    paths: [&Path; 2],
    mut listeners: Option<[UnixListener; 2]>,
    mut down: watch::Receiver<bool>,
) {
    loop {
        let [workload, delegated] = match listeners.take() {
            Some(l) => l,
            None => {
                if down.wait_for(|d| !*d).await.is_err() {
                    return;
                }
                let bind_or_panic = |p: &Path| {
                    bind(p).unwrap_or_else(|e| {
                        panic!("test identity provider: binding {}: {e}", p.display())
                    })
                };
                [bind_or_panic(paths[0]), bind_or_panic(paths[1])]
            }
        };
        shared.update(|s| s.listening = true);
        let until_down = |mut rx: watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|d| *d).await;
        };
        let workload_server = Server::builder()
            .add_service(SpiffeWorkloadApiServer::new(WorkloadApi {
                shared: shared.clone(),
            }))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(workload),
                until_down(down.clone()),
            );
        let delegated_server = Server::builder()
            .add_service(DelegatedIdentityServer::new(DelegatedApi {
                shared: shared.clone(),
            }))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(delegated),
                until_down(down.clone()),
            );
        let (a, b) = tokio::join!(workload_server, delegated_server);
        if let Err(e) = a.and(b) {
            panic!("test identity provider: serving: {e}");
        }
        shared.update(|s| s.listening = false);
    }
}
