//! The worker's command line. The supervisor builds it; nothing here reads the
//! environment, which the supervisor clears.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    /// Kubernetes API access from a kubeconfig file (its current context).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubernetes API access from the pod's service account, to the API server at
    /// HOST:PORT (the supervisor passes KUBERNETES_SERVICE_HOST and _PORT, since this
    /// process's environment is cleared).
    #[arg(long, value_name = "HOST:PORT")]
    pub kube_in_cluster: Option<String>,
    /// How long a pod record must stay absent from the API server's complete pod list
    /// before the owner removes it (`60s`, `1500ms`, `2m`).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub stale_record_grace: Duration,
    /// "off" or an address; bound only once this worker owns the node.
    #[arg(long, default_value = "off")]
    pub metrics_addr: String,
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
}

/// A duration as `<number><unit>`, the unit one of `ms`, `s`, `m`; the number may have
/// a fraction.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let n: f64 = number.parse().map_err(|_| format!("duration {s:?}: expected a number and a unit (ms, s, m), as in 60s"))?;
    let seconds = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("duration {s:?}: unit {unit:?} is none of ms, s, m")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("duration {s:?}: {e}"))
}

impl Config {
    pub fn metrics_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        if self.metrics_addr == "off" {
            return Ok(None);
        }
        Ok(Some(self.metrics_addr.parse().map_err(|e| anyhow::anyhow!("--metrics-addr {:?}: {e}", self.metrics_addr))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_a_unit_and_errors_name_the_value() {
        for (text, want) in [("60s", 60_000), ("1500ms", 1500), ("2m", 120_000), ("0.5s", 500), ("0s", 0)] {
            assert_eq!(parse_duration(text), Ok(Duration::from_millis(want)), "{text}");
        }
        for bad in ["", "60", "s", "1h", "-1s", "1.2.3s"] {
            let e = parse_duration(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }
}
