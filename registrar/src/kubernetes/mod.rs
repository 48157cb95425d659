//! The registrar's side of the Kubernetes API: discovery of Services and EndpointSlices
//! into etcd ([`discovery`], converting with [`convert`]), the taint guard
//! ([`taint_guard`]), and the Lease that elects the one replica that does both
//! ([`lease`]). Every replica watches; only the leader writes.

pub mod convert;
pub mod discovery;
pub mod lease;
pub mod taint_guard;

use std::path::Path;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::store::Store;

/// A client from `kubeconfig`, or the pod's own service account (in cluster).
pub async fn client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let k = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(k, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| anyhow::anyhow!("--kubeconfig {}: {e}", path.display()))?
        }
        None => kube::Config::incluster().map_err(|e| {
            anyhow::anyhow!("no --kubeconfig and no service account mounted (in cluster): {e}")
        })?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// Whether the process runs in a pod with a service account mounted.
pub fn in_cluster() -> bool {
    std::env::var_os("KUBERNETES_SERVICE_HOST").is_some()
        && Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token").exists()
}

/// What runs against the API besides TokenReview.
pub struct Controllers {
    pub lease: lease::LeaseConfig,
    /// Discovery, with the namespaces it covers and the addresses it accepts.
    pub discovery: Option<discovery::Config>,
    pub taint_guard: Option<taint_guard::GuardConfig>,
}

/// Starts the Lease loop and the controllers on `set`; they stop when `stop` is set (the
/// leader then releases the Lease).
/// `leading` is set to 1 while this replica holds the Lease, 0 otherwise.
pub fn spawn(
    set: &mut JoinSet<()>,
    client: kube::Client,
    store: Store,
    c: Controllers,
    stop: watch::Receiver<bool>,
    leading: prometheus_client::metrics::gauge::Gauge,
) {
    let (tx, leader) = watch::channel(None);
    let mut seen = leader.clone();
    set.spawn(async move {
        while seen.changed().await.is_ok() {
            leading.set(i64::from(seen.borrow_and_update().is_some()));
        }
    });
    let api = kube::Api::namespaced(client.clone(), &c.lease.namespace);
    set.spawn(lease::run(api, c.lease, tx, stop.clone()));
    if let Some(config) = c.discovery {
        set.spawn(discovery::run(
            client.clone(),
            store,
            config,
            leader.clone(),
            stop.clone(),
        ));
    }
    if let Some(cfg) = c.taint_guard {
        set.spawn(taint_guard::run(client, cfg, leader, stop));
    }
}
