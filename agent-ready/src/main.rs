//! `agent-ready`: the exec probe for the agent's health socket.
//!
//! `agent-ready [--socket PATH] [--path /ready|/live] [--timeout-ms N]` sends one
//! HTTP/1.0 GET over the unix socket, prints the body, and exits 0 on a 200 answer and 1
//! otherwise. Standard library only: kubelet forks it every 2 s on every node, and a
//! test fails if its Cargo.toml ever gains a dependency.
//!
//! Run as deployed, the probe has the agent container's credentials: uid 0 with the
//! chart's capabilities, which do not include CAP_DAC_OVERRIDE. The health socket is the
//! worker's (mode 0600, uid 65532), so root's connect is refused. The probe then runs
//! itself again as the socket's owner, which the container's CAP_SETUID and CAP_SETGID
//! allow (the supervisor holds them to drop the worker to that same uid); the socket
//! stays private to the worker. See SECURITY.md, "The readiness probe".
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::Duration;

/// Set in the copy of the probe that runs as the socket's owner: it does not try again.
const AS_OWNER: &str = "AGENT_READY_AS_OWNER";

const USAGE: &str = "usage: agent-ready [--socket PATH] [--path /ready|/live] [--timeout-ms N]
  --socket      health socket (default /tmp/agent-health.sock)
  --path        /ready (default) or /live
  --timeout-ms  connect, write and read timeout (default 1000)
exit 0 when the agent answered 200, 1 otherwise; the answer's body is printed";

struct Args {
    socket: String,
    path: String,
    timeout: Duration,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        socket: "/tmp/agent-health.sock".into(),
        path: "/ready".into(),
        timeout: Duration::from_millis(1000),
    };
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        match flag.as_str() {
            "--socket" => a.socket = value("--socket")?,
            "--path" => {
                a.path = value("--path")?;
                if a.path != "/ready" && a.path != "/live" {
                    return Err(format!("--path {:?}: only /ready or /live", a.path));
                }
            }
            "--timeout-ms" => {
                let v = value("--timeout-ms")?;
                let ms: u64 = v
                    .parse()
                    .map_err(|_| format!("--timeout-ms {v:?} is not a number"))?;
                a.timeout = Duration::from_millis(ms.max(1));
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

enum Failed {
    /// The socket refused this uid: the probe may run again as the socket's owner.
    Denied(String),
    Other(String),
}

fn probe(a: &Args) -> Result<(u16, String), Failed> {
    let mut s = UnixStream::connect(&a.socket).map_err(|e| {
        let msg = format!("connect {}: {e}", a.socket);
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            Failed::Denied(msg)
        } else {
            Failed::Other(msg)
        }
    })?;
    exchange(a, &mut s).map_err(Failed::Other)
}

fn exchange(a: &Args, s: &mut UnixStream) -> Result<(u16, String), String> {
    s.set_read_timeout(Some(a.timeout))
        .and_then(|()| s.set_write_timeout(Some(a.timeout)))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET {} HTTP/1.0\r\n\r\n", a.path).as_bytes())
        .map_err(|e| format!("write {}: {e}", a.socket))?;
    let mut raw = Vec::new();
    s.take(64 * 1024)
        .read_to_end(&mut raw)
        .map_err(|e| format!("read {}: {e}", a.socket))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("malformed answer from {}", a.socket))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no status code in answer from {}", a.socket))?;
    Ok((status, body.to_string()))
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("agent-ready: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if e.is_empty() { 0 } else { 2 });
        }
    };
    match probe(&args) {
        Ok((status, body)) => {
            print!("{body}");
            if status == 200 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(Failed::Denied(e)) if std::env::var_os(AS_OWNER).is_none() => {
            match as_owner(&args.socket) {
                Ok(code) => code,
                Err(again) => {
                    println!("{e}; and as the socket's owner: {again}");
                    ExitCode::FAILURE
                }
            }
        }
        Err(Failed::Denied(e) | Failed::Other(e)) => {
            println!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs this probe again, with the same arguments, as the owner of the socket (or of its
/// folder, when the folder hides it), and answers what that run answers.
fn as_owner(socket: &str) -> Result<ExitCode, String> {
    let path = Path::new(socket);
    let folder = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let meta = std::fs::metadata(path)
        .or_else(|_| std::fs::metadata(folder))
        .map_err(|e| format!("stat {} and its folder: {e}", path.display()))?;
    if meta.uid() == 0 {
        return Err(format!("{} belongs to uid 0", path.display()));
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding this probe's binary: {e}"))?;
    // As uid 0, std clears the supplementary groups before it switches uid and gid.
    let status = Command::new(&exe)
        .args(std::env::args_os().skip(1))
        .env(AS_OWNER, "1")
        .uid(meta.uid())
        .gid(meta.gid())
        .status()
        .map_err(|e| {
            format!(
                "running {} as uid {} gid {}: {e}",
                exe.display(),
                meta.uid(),
                meta.gid()
            )
        })?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    })
}
