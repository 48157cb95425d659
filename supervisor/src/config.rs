//! Command-line flags of `aether-supervisor`, each also read from its environment
//! variable. Parsed once at start; nothing reads the environment later.

use std::path::PathBuf;

use clap::Parser;
use shared_proto::flags::AgentFlags;

#[derive(Debug, Clone, Parser)]
#[command(
    name = "aether-supervisor",
    version,
    about = "Privileged half of the Aether node agent",
    long_about = "Holds the node lock (<run-dir>/agent.lock), owns the node sockets \
(xds.sock, cni.sock) and runs the unprivileged aether-worker with no capabilities.\n\n\
A second supervisor started beside a running one is a warm standby: its worker builds \
everything, it binds nothing, and it takes the node over the instant the first one's \
generation is gone. With only --run-dir, --state-dir and --health-dir pointed at writable \
folders it runs as an ordinary user: embedded registry, no identity, no Kubernetes.\n\n\
With --keep-sockets it is instead the node's socket keeper (see that flag)."
)]
pub struct Config {
    /// Folder of agent.lock, xds.sock, cni.sock and handoff.sock, shared by generations.
    #[arg(long, env = "AETHER_RUN_DIR", default_value = "/run/aether")]
    pub run_dir: PathBuf,
    /// Folder of the pod records and persisted state, shared by generations.
    #[arg(long, env = "AETHER_STATE_DIR", default_value = "/var/lib/aether")]
    pub state_dir: PathBuf,
    /// Folder of the worker's agent-health.sock; private to this generation (the pod's /tmp).
    #[arg(long, env = "AETHER_HEALTH_DIR", default_value = "/tmp")]
    pub health_dir: PathBuf,
    /// Worker executable [default: aether-worker beside this binary].
    #[arg(long, env = "AETHER_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// uid:gid the worker runs as when the supervisor runs as root; uid 0 and gid 0 are
    /// refused.
    #[arg(long, env = "AETHER_WORKER_USER", default_value = "65532:65532", value_parser = parse_user)]
    pub worker_user: (u32, u32),
    /// Node name [default: the hostname].
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Instance key of this agent [default: aether-agent-<pid>].
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Kubernetes API access from this kubeconfig (its current context) [default: the
    /// pod's service account when KUBERNETES_SERVICE_HOST is set, else no Kubernetes].
    /// With access, the worker watches this node's pods and node object; the owner marks
    /// deleting pods' records Terminating, collects stale records and removes the node's
    /// startup taint. The worker must be able to read the file (it runs as --worker-user).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Set by the kubelet in every pod: the API server's address for in-cluster access.
    #[arg(long, env = "KUBERNETES_SERVICE_HOST", hide = true)]
    pub kubernetes_service_host: Option<String>,
    #[arg(long, env = "KUBERNETES_SERVICE_PORT", hide = true, default_value_t = 443)]
    pub kubernetes_service_port: u16,
    /// The settings the worker acts on, passed on to it.
    #[command(flatten)]
    pub agent: AgentFlags,
    /// The aether-cni executable that re-asserts the conflist [default: aether-cni beside
    /// this binary]. Opened at start and run from that descriptor.
    #[arg(long, env = "AETHER_CNI_PLUGIN_BIN", requires = "cni_conf_dir")]
    pub cni_plugin_bin: Option<PathBuf>,
    /// Run as the node's socket keeper instead of an agent: hold duplicates of the
    /// owner's listening sockets (fetched over handoff.sock, refreshed every 2 s) and
    /// offer them on <run-dir>/keeper.sock to a new agent that finds no owner to take them
    /// from. Run it outside the agent's pod, beside it: across a delete-then-create roll
    /// the proxy's reconnect then waits in the kept socket's backlog instead of being
    /// refused. Takes no lock, starts no worker, needs no capability; only --run-dir and
    /// --log-format apply.
    #[arg(long, env = "AETHER_KEEP_SOCKETS")]
    pub keep_sockets: bool,
}

fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s.split_once(':').ok_or_else(|| format!("worker user {s:?} is not uid:gid"))?;
    let uid = u.parse().map_err(|_| format!("worker user {s:?}: uid {u:?} is not a number"))?;
    let gid = g.parse().map_err(|_| format!("worker user {s:?}: gid {g:?} is not a number"))?;
    if uid == 0 {
        return Err(format!("worker user {s:?}: the worker must not run as uid 0"));
    }
    if gid == 0 {
        return Err(format!("worker user {s:?}: the worker must not run as gid 0 (root's group owns files it must not write)"));
    }
    Ok((uid, gid))
}

/// How the worker reaches the Kubernetes API, as the flags and the environment say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeAccess {
    Kubeconfig(PathBuf),
    /// `HOST:PORT` of the API server (an IPv6 host in brackets).
    InCluster(String),
    None,
}

impl Config {
    /// A kubeconfig wins over the in-cluster environment.
    pub fn kube_access(&self) -> KubeAccess {
        match (&self.kubeconfig, &self.kubernetes_service_host) {
            (Some(k), _) => KubeAccess::Kubeconfig(k.clone()),
            (None, Some(h)) if !h.is_empty() => {
                let host = if h.contains(':') && !h.starts_with('[') { format!("[{h}]") } else { h.clone() };
                KubeAccess::InCluster(format!("{host}:{}", self.kubernetes_service_port))
            }
            (None, _) => KubeAccess::None,
        }
    }
}

impl Config {
    pub fn lock_path(&self) -> PathBuf {
        self.run_dir.join("agent.lock")
    }
    pub fn xds_path(&self) -> PathBuf {
        self.run_dir.join("xds.sock")
    }
    pub fn cni_path(&self) -> PathBuf {
        self.run_dir.join("cni.sock")
    }
    pub fn handoff_path(&self) -> PathBuf {
        self.run_dir.join("handoff.sock")
    }
    pub fn keeper_path(&self) -> PathBuf {
        self.run_dir.join("keeper.sock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_user_parsing() {
        assert_eq!(parse_user("65532:65532"), Ok((65532, 65532)));
        for bad in ["65532", "a:1", "1:b", "0:0", "65532:0", ""] {
            let err = parse_user(bad).expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn kube_access_prefers_a_kubeconfig_then_the_in_cluster_environment() {
        // Every field set on the command line, which wins over whatever environment the
        // test runs in (a CI job inside a pod has KUBERNETES_SERVICE_HOST).
        let parse = |args: &[&str]| {
            let mut c = Config::try_parse_from([&["aether-supervisor"], args].concat()).unwrap();
            if !args.iter().any(|a| a.starts_with("--kubernetes-service-port")) {
                c.kubernetes_service_port = 443;
            }
            if !args.iter().any(|a| a.starts_with("--kubeconfig")) {
                c.kubeconfig = None;
            }
            if !args.iter().any(|a| a.starts_with("--kubernetes-service-host")) {
                c.kubernetes_service_host = None;
            }
            c
        };
        let c = parse(&["--kubernetes-service-host=10.96.0.1", "--kubernetes-service-port=6443"]);
        assert_eq!(c.kube_access(), KubeAccess::InCluster("10.96.0.1:6443".into()));
        let c = parse(&["--kubernetes-service-host=fd00::1"]);
        assert_eq!(c.kube_access(), KubeAccess::InCluster("[fd00::1]:443".into()));
        let c = parse(&["--kubernetes-service-host=10.96.0.1", "--kubeconfig=/k"]);
        assert_eq!(c.kube_access(), KubeAccess::Kubeconfig("/k".into()));
        assert_eq!(parse(&[]).kube_access(), KubeAccess::None);
    }
}
