//! The capture projection: which ports and CIDRs the node proxy captures.
//!
//! The embedded default is outbound `127.0.0.1:15001` and inbound port `15006`. An
//! optional JSON file overrides it and is reloaded like the registry file (see
//! [`crate::registry`] for the reload rules):
//!
//! ```json
//! { "outbound": "127.0.0.1:15001", "inbound_port": 15006, "excluded_cidrs": ["10.0.0.0/8"] }
//! ```
//! Every field is optional and defaults as above; unknown fields are rejected.
//! The snapshot uses the two ports; the excluded CIDRs are for the traffic redirection
//! that the CNI side installs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aether_model::{CaptureProjection, Change};
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::node::Node;
use crate::registry::{FileError, FileSource, Watch, watch_file};

/// The capture file is tiny; anything near this is not one.
const MAX_BYTES: u64 = 1 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    outbound: Option<SocketAddr>,
    inbound_port: Option<u16>,
    excluded_cidrs: Option<Vec<String>>,
}

/// Parses and validates a capture file's content.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<CaptureProjection, FileError> {
    let doc: FileDoc = serde_json::from_slice(bytes).map_err(|e| FileError::json(path, &e))?;
    let d = CaptureProjection::default();
    let p = CaptureProjection {
        outbound: doc.outbound.unwrap_or(d.outbound),
        inbound_port: doc.inbound_port.unwrap_or(d.inbound_port),
        excluded_cidrs: doc.excluded_cidrs.unwrap_or_default(),
    };
    let invalid = |message: String| FileError::Invalid {
        path: path.to_owned(),
        message,
    };
    if p.outbound.port() == 0 || p.inbound_port == 0 {
        return Err(invalid("capture ports must not be 0".into()));
    }
    if p.outbound.port() == p.inbound_port {
        return Err(invalid(format!(
            "outbound and inbound capture share port {}",
            p.inbound_port
        )));
    }
    for c in &p.excluded_cidrs {
        if !is_cidr(c) {
            return Err(invalid(format!(
                "excluded_cidrs: {c:?} is not an address/prefix"
            )));
        }
    }
    Ok(p)
}

fn is_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else {
        return false;
    };
    match (addr.parse::<std::net::IpAddr>(), len.parse::<u8>()) {
        (Ok(std::net::IpAddr::V4(_)), Ok(l)) => l <= 32,
        (Ok(std::net::IpAddr::V6(_)), Ok(l)) => l <= 128,
        _ => false,
    }
}

/// Lands the capture projection in the node's inputs and marks the capture gate: the
/// embedded default at once when `path` is `None`, else the file's content, reloaded on
/// change until the task is aborted.
pub fn spawn(path: Option<PathBuf>, node: Arc<Node>, metrics: Arc<Metrics>) -> JoinHandle<()> {
    let watch = path.map(Watch::open);
    tokio::spawn(async move {
        let Some(watch) = watch else {
            node.apply([Change::SetCapture(CaptureProjection::default())]);
            node.set_gate(|g| g.capture_landed = true);
            return;
        };
        watch_file(
            watch,
            "capture",
            MAX_BYTES,
            &metrics,
            CaptureFile,
            |capture| {
                node.apply([Change::SetCapture(capture)]);
                node.set_gate(|g| g.capture_landed = true);
            },
        )
        .await
    })
}

struct CaptureFile;

impl FileSource for CaptureFile {
    type Output = CaptureProjection;

    fn parse(&mut self, path: &Path, bytes: &[u8]) -> Result<CaptureProjection, FileError> {
        parse(path, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(json: &str, expected: Result<(&str, u16, &[&str]), &str>) {
        let got = parse(Path::new("/etc/aether/capture.json"), json.as_bytes());
        match (got, expected) {
            (Ok(p), Ok((out, inb, cidrs))) => {
                assert_eq!(
                    (p.outbound.to_string().as_str(), p.inbound_port),
                    (out, inb)
                );
                assert_eq!(
                    p.excluded_cidrs,
                    cidrs.iter().map(|s| s.to_string()).collect::<Vec<_>>()
                );
            }
            (Err(e), Err(want)) => {
                assert!(e.to_string().contains(want), "error {e} lacks {want:?}")
            }
            (got, want) => panic!("got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn parse_cases() {
        check("{}", Ok(("127.0.0.1:15001", 15006, &[])));
        check(
            r#"{"outbound":"127.0.0.1:25001","inbound_port":25006,"excluded_cidrs":["10.0.0.0/8","fd00::/8"]}"#,
            Ok(("127.0.0.1:25001", 25006, &["10.0.0.0/8", "fd00::/8"])),
        );
        check(r#"{"inbound_port":15001}"#, Err("share port 15001"));
        check(
            r#"{"excluded_cidrs":["10.0.0.0/33"]}"#,
            Err("\"10.0.0.0/33\" is not"),
        );
        check(r#"{"outbound":"nope"}"#, Err("/etc/aether/capture.json:1:"));
    }
}
