//! The worker's command line. The supervisor builds it; nothing here reads the
//! environment, which the supervisor clears.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

#[derive(Debug, Clone, Parser)]
#[command(name = "aether-worker", version, about = "Unprivileged half of the Aether node agent; started by aether-supervisor, not by hand")]
pub struct Config {
    /// The inherited control socket (SOCK_SEQPACKET) to the supervisor.
    #[arg(long, default_value_t = 3)]
    pub control_fd: i32,
    /// Used to check that handed-over sockets are bound where expected, and by a released
    /// owner to see its successor answer on `xds.sock`.
    #[arg(long)]
    pub run_dir: PathBuf,
    #[arg(long)]
    pub state_dir: PathBuf,
    #[arg(long)]
    pub health_dir: PathBuf,
    #[arg(long, default_value = "localhost")]
    pub node_name: String,
    #[arg(long, default_value = "aether-agent")]
    pub pod_name: String,
    #[arg(long)]
    pub registry_file: Option<PathBuf>,
    /// Largest registry file read, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub registry_max_bytes: u64,
    #[arg(long)]
    pub capture_file: Option<PathBuf>,
    /// The proxy fetches the mesh's clusters on demand (delta ADS only).
    #[arg(long)]
    pub on_demand_clusters: bool,
    /// Registrar addresses, comma-separated: `unix:///path` or `host:port`.
    #[arg(long)]
    pub registrar: Option<String>,
    /// A bearer token for the registrar (the pod's projected token), read at each call.
    #[arg(long)]
    pub registrar_token_file: Option<PathBuf>,
    /// The mesh cluster this node belongs to, as the registrar keys its watch streams.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    #[arg(long)]
    pub spiffe_endpoint: Option<String>,
    /// The node's CNI conf folder: `/ready` reports whether its first conflist chains
    /// aether-cni. Read only; the owner's supervisor repairs it.
    #[arg(long)]
    pub cni_conf_dir: Option<PathBuf>,
    /// "off" or an address; bound only once this worker owns the node.
    #[arg(long, default_value = "off")]
    pub metrics_addr: String,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

impl Config {
    pub fn metrics_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        if self.metrics_addr == "off" {
            return Ok(None);
        }
        Ok(Some(self.metrics_addr.parse().map_err(|e| anyhow::anyhow!("--metrics-addr {:?}: {e}", self.metrics_addr))?))
    }
}
