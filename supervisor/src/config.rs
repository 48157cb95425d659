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
    /// It must be this user's and writable by nobody else, and every folder on its path
    /// root's or this user's and writable by nobody else (unless sticky, as /tmp).
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
    /// The settings the worker acts on, passed on to it.
    #[command(flatten)]
    pub agent: AgentFlags,
    /// The aether-cni executable that re-asserts the conflist [default: aether-cni beside
    /// this binary]. Opened at start and run from that descriptor.
    #[arg(long, env = "AETHER_CNI_PLUGIN_BIN", requires = "cni_conf_dir")]
    pub cni_plugin_bin: Option<PathBuf>,
    /// Run as the node's socket keeper instead of an agent: execs `aether-keeper` (beside
    /// this binary) with --run-dir and --log-format; see `aether-keeper --help`. Takes no
    /// lock, starts no worker, needs no capability.
    #[arg(long, env = "AETHER_KEEP_SOCKETS")]
    pub keep_sockets: bool,
}

fn parse_user(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s
        .split_once(':')
        .ok_or_else(|| format!("worker user {s:?} is not uid:gid"))?;
    let uid = u
        .parse()
        .map_err(|_| format!("worker user {s:?}: uid {u:?} is not a number"))?;
    let gid = g
        .parse()
        .map_err(|_| format!("worker user {s:?}: gid {g:?} is not a number"))?;
    if uid == 0 {
        return Err(format!(
            "worker user {s:?}: the worker must not run as uid 0"
        ));
    }
    if gid == 0 {
        return Err(format!(
            "worker user {s:?}: the worker must not run as gid 0 (root's group owns files it must not write)"
        ));
    }
    Ok((uid, gid))
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
}
