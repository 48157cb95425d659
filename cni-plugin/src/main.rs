//! `aether-cni`: the CNI plugin binary. All logic lives in the library so that tests and
//! the fuzz target reach it; this only wires the process's args, env, stdin and stdout.
//!
//! The runtime executes a plugin with no arguments (CNI spec 1.0), so an argument can only
//! come from a person, the chart or the agent's supervisor:
//! - `aether-cni install <dest-dir>` copies this executable into the host's CNI bin folder
//!   (the install-cni init container; [`aether_cni::install`]);
//! - `aether-cni chain --cni-conf-dir D --agent-socket S` appends the `aether-cni` entry to
//!   the runtime's conflist in D when it is missing: the node owner's supervisor runs it
//!   at takeover and every 5 s (`shared_proto::conflist::reassert`);
//! - `aether-cni uninstall --run-dir R --cni-conf-dir D --cni-bin-dir B` waits for the node
//!   lock, then takes the entry out of D and the plugin out of B (the chart's uninstall
//!   hook; [`aether_cni::uninstall`]).
//!
//! `chain` and `uninstall` log to stderr in `--log-format`, text (the default) or json, as
//! the agent does.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use shared_proto::conflist::{self, Outcome};

const USAGE: &str = "usage: aether-cni install <dest-dir>
       aether-cni chain --cni-conf-dir <dir> --agent-socket <path> [--log-format text|json]
       aether-cni uninstall --run-dir <dir> --cni-conf-dir <dir> --cni-bin-dir <dir> [--log-format text|json]
Run with no arguments, it is the CNI plugin (CNI spec 1.0: the command in CNI_COMMAND, the
network configuration on stdin).";

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    match args.first().and_then(|a| a.to_str()) {
        None => aether_cni::run(
            |name: &str| std::env::var_os(name),
            std::io::stdin().lock(),
            std::io::stdout().lock(),
        ),
        Some("install") => install(&args[1..]),
        Some(cmd @ ("chain" | "uninstall")) => match Flags::parse(&args[1..]) {
            Ok(flags) => {
                shared_proto::logging::init(flags.log_format.as_deref().unwrap_or("text"));
                let result = if cmd == "chain" {
                    chain(&flags)
                } else {
                    uninstall(&flags)
                };
                result.unwrap_or_else(|e| {
                    tracing::error!(error = %e, "aether-cni {cmd} failed");
                    ExitCode::FAILURE
                })
            }
            Err(e) => usage(&e),
        },
        Some("--help" | "-h" | "help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Some(other) => usage(&format!("unknown command {other:?}")),
    }
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("aether-cni: {problem}\n{USAGE}");
    ExitCode::from(2)
}

/// `install <dest-dir>`: the temporary file is named after POD_NAME (the chart sets it),
/// or this process's id when run by hand.
fn install(args: &[OsString]) -> ExitCode {
    let [dest] = args else {
        return usage("install takes one folder");
    };
    let instance = match std::env::var("POD_NAME") {
        Ok(name) if !name.is_empty() => name,
        _ => format!("pid{}", std::process::id()),
    };
    match aether_cni::install::install(Path::new("/proc/self/exe"), Path::new(dest), &instance) {
        Ok(installed) => {
            println!("installed {}", installed.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("aether-cni install: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Silent while the file chains the entry or the primary CNI has not written one yet (the
/// agent's `/ready` reports that); a warning when the entry had to go back in.
fn chain(f: &Flags) -> Result<ExitCode, String> {
    aether_cni::keep_only_chown().map_err(|e| format!("dropping capabilities: {e}"))?;
    let (dir, socket) = (
        need(&f.cni_conf_dir, "--cni-conf-dir")?,
        need(&f.agent_socket, "--agent-socket")?,
    );
    match conflist::reassert(dir, &conflist::entry(socket)).map_err(|e| e.to_string())? {
        Outcome::Repaired(p) => {
            tracing::warn!(file = %p.display(), "the CNI conflist lacked aether-cni (rewritten by another writer?); appended it")
        }
        Outcome::Chained(_) | Outcome::NoConflist => {}
    }
    Ok(ExitCode::SUCCESS)
}

fn uninstall(f: &Flags) -> Result<ExitCode, String> {
    let run_dir = need(&f.run_dir, "--run-dir")?;
    let (conf, bin) = (
        need(&f.cni_conf_dir, "--cni-conf-dir")?,
        need(&f.cni_bin_dir, "--cni-bin-dir")?,
    );
    let bound = aether_cni::uninstall::LOCK_BOUND;
    aether_cni::uninstall::run(run_dir, conf, bin, bound).map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}

/// The flags of `chain` and `uninstall`, each `--name value` or `--name=value`.
#[derive(Default)]
struct Flags {
    run_dir: Option<PathBuf>,
    cni_conf_dir: Option<PathBuf>,
    cni_bin_dir: Option<PathBuf>,
    agent_socket: Option<PathBuf>,
    log_format: Option<String>,
}

impl Flags {
    fn parse(args: &[OsString]) -> Result<Self, String> {
        let mut f = Flags::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let arg = arg
                .to_str()
                .ok_or_else(|| format!("{arg:?} is not UTF-8"))?;
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) => (n, Some(OsString::from(v))),
                None => (arg, None),
            };
            let value = inline
                .or_else(|| it.next().cloned())
                .ok_or_else(|| format!("{name} needs a value"))?;
            let path = || Some(PathBuf::from(&value));
            match name {
                "--run-dir" => f.run_dir = path(),
                "--cni-conf-dir" => f.cni_conf_dir = path(),
                "--cni-bin-dir" => f.cni_bin_dir = path(),
                "--agent-socket" => f.agent_socket = path(),
                "--log-format" => f.log_format = Some(value.to_string_lossy().into_owned()),
                other => return Err(format!("unknown flag {other:?}")),
            }
        }
        match f.log_format.as_deref() {
            None | Some("text" | "json") => Ok(f),
            Some(other) => Err(format!("--log-format {other:?}: expected text or json")),
        }
    }
}

fn need<'a>(v: &'a Option<PathBuf>, name: &str) -> Result<&'a Path, String> {
    v.as_deref().ok_or_else(|| format!("{name} is required"))
}
