//! `aether-cni`: a CNI spec 1.0 chained plugin that registers pods with the Aether node
//! agent over its CNI gRPC API (`aether.cni.v1`) on a unix socket.
//!
//! The plugin is untrusted input's first stop: the runtime's env and stdin are parsed and
//! validated here, in pure functions ([`input`]) that the table tests and the fuzz target
//! call directly, before anything talks to the agent. [`client`] is the only I/O beyond
//! stdin and stdout. Every failure becomes CNI error JSON on stdout ([`CniError`]) and a
//! non-zero exit; nothing here panics on input. One exception, as in istio-cni and
//! linkerd-cni: a DEL that cannot reach the agent succeeds (see [`execute`]), so that the
//! primary plugin, called after this one on DEL, still releases the pod's address.
//! [`install`] is the chart's installer: the binary copies itself into the host's CNI bin
//! folder, so the image needs no shell. [`uninstall`] is the chart's uninstall hook.
#![forbid(unsafe_code)]

pub mod client;
pub mod input;
pub mod install;
pub mod uninstall;

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use serde::Serialize;

pub use input::{Command, Invocation};

/// The CNI versions this plugin accepts in the network config. CHECK needs 0.4.0 or later.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// The version this plugin reports when no config names one.
pub const DEFAULT_VERSION: &str = "1.0.0";

/// Well-known error codes of the CNI spec (1.0, "Error" section).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Plugin-specific range (100+): the agent refused or failed the call.
    pub const AGENT_ERROR: u32 = 100;
}

/// A CNI error result: printed as JSON on stdout, with a non-zero exit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CNI error {code}: {msg}")]
pub struct CniError {
    pub code: u32,
    /// Names the variable or field at fault.
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The spec's error JSON for this error, reporting `cni_version`.
    pub fn to_json(&self, cni_version: &str) -> String {
        #[derive(Serialize)]
        struct Wire<'a> {
            #[serde(rename = "cniVersion")]
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            details: &'a str,
        }
        let wire = Wire {
            cni_version,
            code: self.code,
            msg: &self.msg,
            details: &self.details,
        };
        serde_json::to_string(&wire)
            .unwrap_or_else(|_| format!("{{\"code\":{},\"msg\":\"error\"}}", self.code))
    }
}

/// How long the plugin keeps retrying a missing or refusing socket (a takeover in
/// progress), and how long it waits for the agent's answer.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub connect: Duration,
    pub retry_every: Duration,
    pub call: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            retry_every: Duration::from_millis(10),
            call: Duration::from_secs(10),
        }
    }
}

/// Reads stdin up to [`input::MAX_STDIN`] bytes: one byte more is read so that a larger
/// input is refused rather than silently truncated.
pub fn read_stdin(mut reader: impl Read) -> Result<Vec<u8>, CniError> {
    let mut buf = Vec::new();
    reader
        .by_ref()
        .take(input::MAX_STDIN as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| {
            CniError::new(
                code::IO_FAILURE,
                format!("reading the network config from stdin: {e}"),
            )
        })?;
    if buf.len() > input::MAX_STDIN {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            format!(
                "network config on stdin is over the {}-byte limit",
                input::MAX_STDIN
            ),
        ));
    }
    Ok(buf)
}

/// The whole plugin: env and stdin in, result or error JSON out. Returns the exit code.
pub fn run(
    env: impl Fn(&str) -> Option<std::ffi::OsString>,
    stdin: impl Read,
    mut stdout: impl Write,
) -> ExitCode {
    // Before the config is parsed, errors report the default version.
    let mut version = DEFAULT_VERSION.to_string();
    let result = (|| {
        let bytes = read_stdin(stdin)?;
        let inv = input::parse(&env, &bytes)?;
        version = inv.config.cni_version.clone();
        execute(&inv, Timeouts::default())
    })();
    match result {
        Ok(out) => {
            if !out.is_empty() && writeln!(stdout, "{out}").is_err() {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = writeln!(stdout, "{}", e.to_json(&version));
            ExitCode::FAILURE
        }
    }
}

/// Runs a parsed invocation and returns what to print on success.
pub fn execute(inv: &Invocation, timeouts: Timeouts) -> Result<String, CniError> {
    match inv.command {
        Command::Version => Ok(version_json()),
        Command::Add | Command::Del | Command::Check => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| {
                    CniError::new(code::IO_FAILURE, format!("starting the I/O runtime: {e}"))
                })?;
            match runtime.block_on(client::call(inv, timeouts)) {
                Ok(()) => {}
                Err(e) if inv.command == Command::Del && del_goes_on(&e) => {
                    // DEL is best effort: aether-cni is last in the chain, so it is called
                    // first on DEL, and failing here would keep the primary plugin from
                    // releasing the pod's address. The agent collects the record later.
                    eprintln!(
                        "aether-cni: DEL of container {} returns success without the agent: {e}; the chain goes on, and the agent collects the pod's record later",
                        inv.request.container_id
                    );
                }
                Err(e) => return Err(e),
            }
            match inv.command {
                Command::Add => Ok(input::add_result(&inv.config)),
                _ => Ok(String::new()),
            }
        }
    }
}

/// Whether a failed DEL lets the chain go on: the agent could not be reached, did not
/// answer in time, or failed. A request the agent found invalid stays an error: retrying
/// it cannot help, and the runtime should see it.
fn del_goes_on(e: &CniError) -> bool {
    matches!(
        e.code,
        code::TRY_AGAIN_LATER | code::IO_FAILURE | code::AGENT_ERROR
    )
}

/// The VERSION command's answer.
pub fn version_json() -> String {
    serde_json::json!({ "cniVersion": DEFAULT_VERSION, "supportedVersions": SUPPORTED_VERSIONS })
        .to_string()
}

/// The supervisor that runs `chain` is root with five capabilities; the rewrite needs at
/// most CAP_CHOWN (to give the new file the original's owner when that is not root).
/// Every other capability goes, from every set, before the file is read.
pub fn keep_only_chown() -> Result<(), caps::errors::CapsError> {
    shared_proto::caps::keep_only(&[caps::Capability::CAP_CHOWN])
}

#[cfg(test)]
mod caps_tests {
    use caps::{CapSet, Capability};

    /// Capabilities are per thread: the test drops them on a thread of its own.
    #[test]
    fn chain_keeps_cap_chown_alone() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIPPED: needs root's capabilities to drop (CI runs as root)");
            return;
        }
        std::thread::spawn(|| {
            assert!(
                caps::has_cap(None, CapSet::Permitted, Capability::CAP_SETUID).unwrap(),
                "the test needs CAP_SETUID to start with"
            );
            super::keep_only_chown().unwrap();
            let only: caps::CapsHashSet = [Capability::CAP_CHOWN].into_iter().collect();
            for set in [CapSet::Effective, CapSet::Permitted, CapSet::Bounding] {
                assert_eq!(caps::read(None, set).unwrap(), only, "{set:?}");
            }
            assert!(caps::read(None, CapSet::Inheritable).unwrap().is_empty());
            assert!(caps::read(None, CapSet::Ambient).unwrap().is_empty());
        })
        .join()
        .unwrap();
    }
}
