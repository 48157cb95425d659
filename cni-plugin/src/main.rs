//! `aether-cni`: the CNI plugin binary. All logic lives in the library so that tests and
//! the fuzz target reach it; this only wires the process's args, env, stdin and stdout.
//!
//! The runtime executes a plugin with no arguments (CNI spec 1.0), so an argument can only
//! come from a person or the chart: `aether-cni install <dest-dir>` copies this executable
//! into the host's CNI bin folder (the install-cni init container; [`aether_cni::install`]).
#![forbid(unsafe_code)]

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == "install") {
        return install(&args[1..]);
    }
    aether_cni::run(|name: &str| std::env::var_os(name), std::io::stdin().lock(), std::io::stdout().lock())
}

/// `install <dest-dir>`: the temporary file is named after POD_NAME (the chart sets it),
/// or this process's id when run by hand.
fn install(args: &[std::ffi::OsString]) -> ExitCode {
    let [dest] = args else {
        eprintln!("usage: aether-cni install <dest-dir>   (the plugin copies itself to <dest-dir>/aether-cni)");
        return ExitCode::from(2);
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
