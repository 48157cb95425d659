//! How the worker reaches the Kubernetes API: a kubeconfig file (`--kubeconfig`), or the
//! pod's service account at the API server that `KUBERNETES_SERVICE_HOST` and `_PORT`
//! name (the supervisor passes them on as flags, since the worker's environment is
//! cleared; `shared_proto::flags::AgentFlags::kube_access` chooses).
//! Both end as one `kube::Client`; nothing else in the worker reads credentials.

use std::path::{Path, PathBuf};

/// Where the service account's token and CA are mounted in a pod.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The API server and credentials the worker uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// A kubeconfig file: its current context's server, CA and user.
    Kubeconfig(PathBuf),
    /// In a pod: `https://HOST:PORT` with the service account's token and CA from
    /// `dir` ([`SERVICE_ACCOUNT_DIR`] in production).
    InCluster {
        host: String,
        port: u16,
        dir: PathBuf,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error(
        "KUBERNETES_SERVICE_HOST and _PORT give {0:?}: expected HOST:PORT (an IPv6 host in brackets) with a port in 1..=65535"
    )]
    BadAddress(String),
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "kubeconfig {path}: user {user:?} uses an {what}; the worker runs no credential plugin, give it a token or a client certificate"
    )]
    Plugin {
        path: PathBuf,
        user: String,
        what: &'static str,
    },
    #[error("in-cluster credentials in {dir}: {source}")]
    InCluster {
        dir: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("building the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

impl Access {
    /// The pod's service account, at the API server `HOST:PORT`.
    pub fn in_cluster(addr: &str) -> Result<Access, AccessError> {
        let (host, port) =
            parse_host_port(addr).ok_or_else(|| AccessError::BadAddress(addr.to_string()))?;
        Ok(Access::InCluster {
            host,
            port,
            dir: SERVICE_ACCOUNT_DIR.into(),
        })
    }

    /// Builds the client. Reads the credentials once; a service-account token file is
    /// re-read by the client as it rotates, and the in-cluster CA file too.
    pub async fn client(&self) -> Result<kube::Client, AccessError> {
        // ring, as everywhere in the workspace; kube-rs leaves the choice to the binary,
        // and an error here only means a provider is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let options = kube::config::KubeConfigOptions::default();
        let config = match self {
            Access::Kubeconfig(path) => {
                let err = |source| AccessError::Kubeconfig {
                    path: path.clone(),
                    source,
                };
                let kc = kube::config::Kubeconfig::read_from(path).map_err(err)?;
                refuse_plugins(path, &kc)?;
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(err)?
            }
            Access::InCluster { host, port, dir } => {
                let err = |source| AccessError::InCluster {
                    dir: dir.clone(),
                    source,
                };
                let kc = in_cluster_kubeconfig(host, *port, dir);
                let mut config = kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(err)?;
                // Re-read as the CA rotates, as the client does for the token.
                config.root_cert_file = Some(dir.join("ca.crt"));
                config
            }
        };
        kube::Client::try_from(config).map_err(AccessError::Client)
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Access::Kubeconfig(p) => write!(f, "kubeconfig {}", p.display()),
            Access::InCluster { host, port, dir } => write!(
                f,
                "in-cluster API server {}, service account {}",
                url(host, *port),
                dir.display()
            ),
        }
    }
}

fn url(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("https://[{host}]:{port}")
    } else {
        format!("https://{host}:{port}")
    }
}

/// `HOST:PORT`, `[V6]:PORT`; the host without brackets.
fn parse_host_port(s: &str) -> Option<(String, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    (!host.is_empty() && !host.contains(['/', ' ', '[', ']'])).then(|| (host.to_string(), port))
}

/// The service account as a kubeconfig, so that one loader reads both kinds of access.
fn in_cluster_kubeconfig(host: &str, port: u16, dir: &Path) -> kube::config::Kubeconfig {
    let doc = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "in-cluster", "cluster": { "server": url(host, port), "certificate-authority": dir.join("ca.crt") } }],
        "users": [{ "name": "service-account", "user": { "tokenFile": dir.join("token") } }],
        "contexts": [{ "name": "in-cluster", "context": { "cluster": "in-cluster", "user": "service-account" } }],
        "current-context": "in-cluster",
    });
    // The document above is a valid kubeconfig by construction.
    serde_json::from_value(doc).expect("in-cluster kubeconfig")
}

/// The worker never runs a credential plugin: it would be a process started by the
/// worker with whatever the kubeconfig names.
fn refuse_plugins(path: &Path, kc: &kube::config::Kubeconfig) -> Result<(), AccessError> {
    let context = kc
        .current_context
        .as_deref()
        .and_then(|c| kc.contexts.iter().find(|n| n.name == c));
    let user = context
        .and_then(|c| c.context.as_ref())
        .map(|c| c.user.clone())
        .unwrap_or_default();
    for u in kc
        .auth_infos
        .iter()
        .filter(|u| user.as_deref().is_none_or(|name| u.name == name))
    {
        let Some(info) = &u.auth_info else { continue };
        let what = if info.exec.is_some() {
            "exec credential plugin"
        } else if info.auth_provider.is_some() {
            "auth-provider plugin"
        } else {
            continue;
        };
        return Err(AccessError::Plugin {
            path: path.to_path_buf(),
            user: u.name.clone(),
            what,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_in_cluster_address_parses_and_errors_name_the_value() {
        let ic = |host: &str, port| Access::InCluster {
            host: host.into(),
            port,
            dir: SERVICE_ACCOUNT_DIR.into(),
        };
        assert_eq!(
            Access::in_cluster("10.96.0.1:443").unwrap(),
            ic("10.96.0.1", 443)
        );
        assert_eq!(
            Access::in_cluster("[fd00::1]:6443").unwrap(),
            ic("fd00::1", 6443)
        );
        assert_eq!(
            ic("fd00::1", 6443).to_string(),
            format!(
                "in-cluster API server https://[fd00::1]:6443, service account {SERVICE_ACCOUNT_DIR}"
            )
        );
        for bad in ["10.96.0.1", ":443", "h:0", "h:x", "a b:1"] {
            let e = Access::in_cluster(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_kubeconfig_with_a_credential_plugin_is_refused() {
        let kc = kube::config::Kubeconfig::from_yaml(
            "apiVersion: v1\nkind: Config\ncurrent-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n\
             clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n\
             users: [{name: u, user: {exec: {apiVersion: client.authentication.k8s.io/v1, command: /bin/true}}}]\n",
        )
        .unwrap();
        let e = refuse_plugins(Path::new("/k"), &kc)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/k") && e.contains("exec credential plugin") && e.contains("\"u\""),
            "{e}"
        );
    }

    #[tokio::test]
    async fn in_cluster_access_reads_the_service_account_files() {
        let dir = tempfile::tempdir().unwrap();
        let access = Access::InCluster {
            host: "127.0.0.1".into(),
            port: 6443,
            dir: dir.path().into(),
        };
        let Err(e) = access.client().await else {
            panic!("a client without a CA")
        };
        let e = e.to_string();
        assert!(
            e.contains(&dir.path().display().to_string()),
            "a missing CA names the folder: {e}"
        );
    }
}
