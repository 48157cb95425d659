//! Tiny HTTP/1.1 upstream servers on loopback: std threads, keep-alive, always 200.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub struct Upstream {
    pub addr: SocketAddr,
    pub hits: Arc<AtomicU64>,
}

impl Upstream {
    /// Requests answered so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

/// Starts a server answering every request with 200 and `body`. Its threads live as long
/// as the process (the harness is a short-lived binary).
pub fn spawn(body: String) -> std::io::Result<Upstream> {
    spawn_on(SocketAddr::from(([127, 0, 0, 1], 0)), body)
}

/// [`spawn`] on `addr` (port 0 for any free one).
pub fn spawn_on(addr: SocketAddr, body: String) -> std::io::Result<Upstream> {
    let listener = TcpListener::bind(addr)?;
    let addr = listener.local_addr()?;
    let hits = Arc::new(AtomicU64::new(0));
    let h = hits.clone();
    std::thread::Builder::new()
        .name(format!("upstream-{}", addr.port()))
        .spawn(move || {
            for conn in listener.incoming().flatten() {
                let (body, hits) = (body.clone(), h.clone());
                let _ = std::thread::Builder::new()
                    .name("upstream-conn".into())
                    .spawn(move || serve(conn, &body, &hits));
            }
        })?;
    Ok(Upstream { addr, hits })
}

fn serve(conn: TcpStream, body: &str, hits: &AtomicU64) {
    let _ = conn.set_nodelay(true);
    let Ok(mut out) = conn.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(conn);
    loop {
        let mut content_length = 0u64;
        let mut close = false;
        let mut first = true;
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let l = line.trim_end();
            if l.is_empty() {
                if first {
                    continue; // stray CRLF between requests
                }
                break;
            }
            first = false;
            if let Some((k, v)) = l.split_once(':') {
                let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
                if k == "content-length" {
                    content_length = v.parse().unwrap_or(0);
                } else if k == "connection" && v.eq_ignore_ascii_case("close") {
                    close = true;
                }
            }
        }
        if content_length > 0
            && std::io::copy(
                &mut (&mut reader).take(content_length),
                &mut std::io::sink(),
            )
            .is_err()
        {
            return;
        }
        hits.fetch_add(1, Ordering::Relaxed);
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n{}\r\n{body}",
            body.len(),
            if close { "connection: close\r\n" } else { "" }
        );
        if out.write_all(resp.as_bytes()).is_err() || close {
            return;
        }
    }
}
