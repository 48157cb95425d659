//! Renders the one Envoy bootstrap template (`deploy/envoy/bootstrap.yaml.tmpl`) for the
//! end-to-end tests, benchmarks and harness (`e2e/src/envoy/`). The chart fills the same
//! template with its own tooling; the placeholders are documented in the template.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The template, as shipped.
pub const TEMPLATE: &str = include_str!("../../deploy/envoy/bootstrap.yaml.tmpl");

/// The seed's ADS reconnect backoff: 0.1 s base, 1 s max.
pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(100);
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Where Envoy's admin endpoint listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admin {
    /// A unix socket path.
    Pipe(PathBuf),
    /// A loopback address.
    Tcp(SocketAddr),
}

/// Which variant of ADS the proxy speaks; the agent serves both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdsApi {
    /// State of the world (`api_type: GRPC`): every LDS and CDS response is the whole set.
    Sotw,
    /// Incremental (`api_type: DELTA_GRPC`), the default: a response carries only what
    /// changed, so a pod's ADD costs the proxy the same on a node of 10 pods or 300, and
    /// one endpoint change sends one load assignment however large the mesh.
    #[default]
    Delta,
}

impl AdsApi {
    pub fn api_type(self) -> &'static str {
        match self {
            AdsApi::Sotw => "GRPC",
            AdsApi::Delta => "DELTA_GRPC",
        }
    }
}

impl std::str::FromStr for AdsApi {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sotw" | "GRPC" => Ok(AdsApi::Sotw),
            "delta" | "DELTA_GRPC" => Ok(AdsApi::Delta),
            other => Err(format!(
                "ADS variant {other:?}: expected sotw (GRPC) or delta (DELTA_GRPC)"
            )),
        }
    }
}

/// The template with every placeholder filled.
pub fn render(
    run_dir: &Path,
    admin: &Admin,
    node_id: &str,
    backoff_base: Duration,
    backoff_max: Duration,
    api: AdsApi,
) -> String {
    let admin = match admin {
        Admin::Pipe(p) => format!("{{ pipe: {{ path: {} }} }}", yaml_str(&p.to_string_lossy())),
        Admin::Tcp(a) => {
            format!(
                "{{ socket_address: {{ address: {}, port_value: {} }} }}",
                yaml_str(&a.ip().to_string()),
                a.port()
            )
        }
    };
    // The template appends `/xds.sock` to the run dir unquoted: run dirs are plain paths.
    TEMPLATE
        .replace(
            "${AETHER_RUN_DIR}",
            run_dir.to_string_lossy().trim_end_matches('/'),
        )
        .replace("${ENVOY_ADMIN_ADDRESS}", &admin)
        .replace("${ENVOY_NODE_ID}", &yaml_str(node_id))
        .replace("${ADS_BACKOFF_BASE}", &seconds(backoff_base))
        .replace("${ADS_BACKOFF_MAX}", &seconds(backoff_max))
        .replace("${ADS_API_TYPE}", api.api_type())
}

/// A protobuf JSON/YAML duration: seconds with up to nanosecond decimals.
fn seconds(d: Duration) -> String {
    let s = format!("{}.{:09}", d.as_secs(), d.subsec_nanos());
    format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
}

/// A double-quoted YAML scalar (JSON string syntax is valid YAML).
fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_every_placeholder() {
        let out = render(
            Path::new("/run/aether/"),
            &Admin::Pipe("/tmp/x/admin.sock".into()),
            "node-1",
            DEFAULT_BACKOFF_BASE,
            Duration::from_millis(1500),
            AdsApi::Delta,
        );
        let body: String = out
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(!body.contains("${"), "unfilled placeholder in:\n{body}");
        assert!(body.contains("pipe: { path: /run/aether/xds.sock }"));
        assert!(body.contains("address: { pipe: { path: \"/tmp/x/admin.sock\" } }"));
        assert!(body.contains("id: \"node-1\""));
        assert!(body.contains("base_interval: 0.1s") && body.contains("max_interval: 1.5s"));
        assert!(body.contains("api_type: DELTA_GRPC"));
        let tcp = render(
            Path::new("/r"),
            &Admin::Tcp("127.0.0.1:15000".parse().unwrap()),
            "n",
            DEFAULT_BACKOFF_BASE,
            DEFAULT_BACKOFF_MAX,
            AdsApi::Sotw,
        );
        assert!(tcp.contains("socket_address: { address: \"127.0.0.1\", port_value: 15000 }"));
        assert!(tcp.contains("max_interval: 1s"));
        assert!(tcp.contains("api_type: GRPC"));
    }
}
