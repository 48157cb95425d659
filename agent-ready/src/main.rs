//! `agent-ready`: the exec probe for the agent's health socket.
//!
//! `agent-ready [--socket PATH] [--path /ready|/live] [--timeout-ms N]` sends one
//! HTTP/1.0 GET over the unix socket, prints the body, and exits 0 on a 200 answer and 1
//! otherwise. Standard library only: kubelet forks it every 2 s on every node, and a
//! test fails if its Cargo.toml ever gains a dependency.
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

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
    let mut a = Args { socket: "/tmp/agent-health.sock".into(), path: "/ready".into(), timeout: Duration::from_millis(1000) };
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
                let ms: u64 = v.parse().map_err(|_| format!("--timeout-ms {v:?} is not a number"))?;
                a.timeout = Duration::from_millis(ms.max(1));
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

fn probe(a: &Args) -> Result<(u16, String), String> {
    let mut s = UnixStream::connect(&a.socket).map_err(|e| format!("connect {}: {e}", a.socket))?;
    s.set_read_timeout(Some(a.timeout)).and_then(|()| s.set_write_timeout(Some(a.timeout))).map_err(|e| e.to_string())?;
    s.write_all(format!("GET {} HTTP/1.0\r\n\r\n", a.path).as_bytes()).map_err(|e| format!("write {}: {e}", a.socket))?;
    let mut raw = Vec::new();
    s.take(64 * 1024).read_to_end(&mut raw).map_err(|e| format!("read {}: {e}", a.socket))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| format!("malformed answer from {}", a.socket))?;
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
            if status == 200 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e) => {
            println!("{e}");
            ExitCode::FAILURE
        }
    }
}
