//! A minimal HTTP/1.0 responder for the health socket and the metrics port: one request
//! line, headers ignored, one response, close. Enough for `agent-ready`, kubelet exec
//! probes via that binary, and Prometheus; nothing here parses a body.
//!
//! A connection lives at most [`READ_TIMEOUT`] plus [`WRITE_TIMEOUT`]: a client that
//! sends nothing, or reads nothing, cannot hold one of its listener's few connection
//! slots (see `crate::accept`) for longer.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

/// The longest request line or header line accepted.
const MAX_LINE: usize = 1024;
/// How long the request line may take to arrive.
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the client may take to read the response.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    /// Shared, so that one cached text can answer many connections.
    pub body: Arc<str>,
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        400 => "Bad Request",
        _ => "Service Unavailable",
    }
}

/// Reads one request from `io` and answers it with `handle(path)`.
pub async fn serve_one<IO, F>(io: IO, handle: F)
where
    IO: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(&str) -> Response,
{
    let mut reader = BufReader::new(io);
    let mut line = String::new();
    let read = tokio::time::timeout(READ_TIMEOUT, async {
        let mut limited = (&mut reader).take(MAX_LINE as u64);
        limited.read_line(&mut line).await
    })
    .await;
    let response = match read {
        Ok(Ok(n)) if n > 0 => {
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next()) {
                (Some("GET"), Some(path)) => handle(path),
                (Some(_), Some(_)) => Response {
                    status: 405,
                    content_type: "text/plain",
                    body: "only GET\n".into(),
                },
                _ => Response {
                    status: 400,
                    content_type: "text/plain",
                    body: "bad request line\n".into(),
                },
            }
        }
        _ => return,
    };
    let head = format!(
        "HTTP/1.0 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    let io = reader.get_mut();
    let _ = tokio::time::timeout(WRITE_TIMEOUT, async {
        io.write_all(head.as_bytes()).await?;
        io.write_all(response.body.as_bytes()).await?;
        io.shutdown().await
    })
    .await;
}

use tokio::io::AsyncReadExt as _;
