//! The QUIC twins' test and bench tools: SVIDs as PEM files for the Python clients, one HTTP/3 GET through the real client
//! (`e2e/quic/h3_client.py`), and the twins Envoy holds.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use aether_model::{Identity, MtlsMode, QuicTwins};
use serde_json::Value;

use crate::datapath::{Datapath, TestCa, TestSvid};
use crate::envoy::{AdsApi, RigOptions, WorkerRig};
use crate::testing::workspace_root;

/// The test CA's trust domain.
pub const TD: &str = "aether.test";
/// The twins' UDP port on the node's client-facing address.
pub const TWIN_PORT: u16 = 15443;

/// Where the twins listen: the data path node's client-facing address (UDP).
pub fn twin_address(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 250, 0, 1)), port)
}

/// A worker rig in `dp`'s node namespace with identity on (permissive, `ca`'s bundle,
/// `agent` as the agent's SVID) and the QUIC twins at [`twin_address`]`(TWIN_PORT)`.
pub fn twin_rig_options(dp: &Datapath, ca: &TestCa, agent: &TestSvid) -> RigOptions {
    RigOptions {
        api: AdsApi::Delta,
        netns: Some(dp.node.name.clone()),
        identity: Identity {
            trust_domain: Some(TD.into()),
            mode: MtlsMode::Permissive,
            bundle: Some(ca.pem()),
            agent: Some(agent.svid.clone()),
            ..Identity::default()
        },
        quic_twins: Some(QuicTwins {
            address: twin_address(TWIN_PORT),
            max: 16,
        }),
        ..RigOptions::default()
    }
}

/// Envoy's binary when this machine can run a QUIC test named `what`: Envoy, the data
/// path (root, nftables) and the Python client. Otherwise says loudly why and returns
/// None.
pub fn envoy_or_skip(what: &str) -> Option<PathBuf> {
    let envoy = crate::envoy::envoy_or_skip(what)?;
    if let Some(why) = crate::datapath::missing() {
        eprintln!("\n!!! SKIPPED {what}: {why}. CI runs as root with nftables. !!!\n");
        return None;
    }
    if !python().exists() {
        eprintln!(
            "\n!!! SKIPPED {what}: no .venv/bin/python with aioquic (scripts/install-pytools.sh) !!!\n"
        );
        return None;
    }
    Some(envoy)
}

/// The project virtualenv's Python, which has aioquic (`scripts/install-pytools.sh`).
pub fn python() -> PathBuf {
    workspace_root().join(".venv/bin/python")
}

/// A client certificate as PEM files the Python client loads.
pub struct Pem {
    _dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub fn pem_files(s: &TestSvid) -> Pem {
    Pem::new(&s.svid.chain_pem, &s.svid.key_pem)
}

impl Pem {
    /// The chain and key (PEM) in files of a fresh folder.
    pub fn new(chain_pem: &str, key_pem: &str) -> Pem {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&cert, chain_pem).unwrap();
        std::fs::write(&key, key_pem).unwrap();
        Pem {
            _dir: dir,
            cert,
            key,
        }
    }
}

/// One HTTP/3 GET from the network namespace `ns` (None: this process's) to `addr` naming
/// `sni`, with `cert` when given; the client's JSON outcome.
pub fn h3(
    ns: Option<&str>,
    addr: SocketAddr,
    sni: &str,
    cert: Option<&Pem>,
    timeout_s: f64,
) -> Value {
    h3_with(
        ns,
        addr,
        sni,
        cert.map(|p| (p.cert.as_path(), p.key.as_path())),
        timeout_s,
    )
}

/// [`h3`] with the client certificate and key as files (PEM) of the caller's.
pub fn h3_with(
    ns: Option<&str>,
    addr: SocketAddr,
    sni: &str,
    cert: Option<(&Path, &Path)>,
    timeout_s: f64,
) -> Value {
    let python = python();
    let script = workspace_root().join("e2e/quic/h3_client.py");
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&python);
            c
        }
        None => std::process::Command::new(&python),
    };
    cmd.arg(&script)
        .arg(addr.ip().to_string())
        .arg(addr.port().to_string())
        .arg(sni);
    if let Some((cert, key)) = cert {
        cmd.arg(cert).arg(key);
    }
    cmd.arg(format!("--timeout={timeout_s}"));
    let out = cmd.output().expect("running the HTTP/3 client");
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "the HTTP/3 client printed no JSON ({e}): {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The first response's body.
pub fn body(r: &Value) -> String {
    r["responses"][0]["body"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The twins' filter chains Envoy holds, by name (the pod uid), from its config dump.
pub fn twin_chains(rig: &WorkerRig) -> Vec<String> {
    listeners(&rig.config_dump()).0
}

/// Envoy's dynamic listeners in a config dump: (the twins' chain names, the other
/// listeners' names).
pub fn listeners(dump: &Value) -> (Vec<String>, Vec<String>) {
    let (mut twins, mut others) = (Vec::new(), Vec::new());
    for c in dump["configs"].as_array().into_iter().flatten() {
        for l in c["dynamic_listeners"].as_array().into_iter().flatten() {
            let name = l["name"].as_str().unwrap_or_default().to_string();
            if name == aether_model::QUIC_TWINS {
                for ch in l["active_state"]["listener"]["filter_chains"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    twins.push(ch["name"].as_str().unwrap_or_default().to_string());
                }
            } else {
                others.push(name);
            }
        }
    }
    (twins, others)
}
