//! Starts the real worker with environment variables the supervisor does not pass on (it
//! passes only those it names, such as `RUST_LOG`), for tests that must change the
//! worker's process environment, such as `LD_PRELOAD` of libfaketime.
//!
//! The supervisor starts it as its worker (`--worker-bin`), with the worker's command
//! line, descriptors and seccomp filters. It reads `<node>/worker-env-<pod name>`, where
//! `<node>` is the parent of `--state-dir`: the first line is the worker to run, each
//! further line a `NAME=value`. It then execs that worker with the same arguments and
//! descriptors, its environment plus those variables. The worker's own seccomp filter
//! forbids exec once it runs, so the wrapper is gone before the worker serves.

use std::ffi::CString;
use std::fs::File;
use std::path::PathBuf;
use std::process::ExitCode;

use nix::fcntl::AtFlags;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .find_map(|a| a.strip_prefix(name).map(str::to_string))
    };
    let (Some(state_dir), Some(pod)) = (flag("--state-dir="), flag("--pod-name=")) else {
        eprintln!("worker-with-env: no --state-dir= or --pod-name= in {args:?}");
        return ExitCode::from(2);
    };
    let Some(node) = PathBuf::from(&state_dir).parent().map(|p| p.to_path_buf()) else {
        eprintln!("worker-with-env: --state-dir={state_dir} has no parent folder");
        return ExitCode::from(2);
    };
    let path = node.join(format!("worker-env-{pod}"));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("worker-with-env: reading {}: {e}", path.display());
            return ExitCode::from(2);
        }
    };
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let Some(worker) = lines.next() else {
        eprintln!("worker-with-env: {} names no worker", path.display());
        return ExitCode::from(2);
    };
    let mut env: Vec<(String, String)> = std::env::vars().collect();
    for line in lines {
        let Some((name, value)) = line.split_once('=') else {
            eprintln!(
                "worker-with-env: {}: {line:?} is not NAME=value",
                path.display()
            );
            return ExitCode::from(2);
        };
        env.push((name.to_string(), value.to_string()));
    }
    let cstr = |s: String| CString::new(s).expect("no NUL in an argument or variable");
    let argv: Vec<CString> = args.into_iter().map(cstr).collect();
    let envp: Vec<CString> = env
        .into_iter()
        .map(|(k, v)| cstr(format!("{k}={v}")))
        .collect();
    // execveat of an opened file, as the supervisor starts its worker: the seccomp allow
    // list the supervisor installed has execveat, not execve.
    let image = match File::open(worker) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("worker-with-env: opening {worker}: {e}");
            return ExitCode::from(2);
        }
    };
    let e = nix::unistd::execveat(&image, c"", &argv, &envp, AtFlags::AT_EMPTY_PATH).unwrap_err();
    eprintln!("worker-with-env: exec {worker}: {e}");
    ExitCode::from(1)
}
