//! Whether an HTTP/2 server answers on a unix socket: how a released owner sees its
//! successor serve on `xds.sock`.

use std::time::{Duration, Instant};

/// The HTTP/2 client connection preface followed by an empty SETTINGS frame.
pub(crate) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
/// GOAWAY, last stream 0, NO_ERROR: the polite end of a connection that opened none.
const H2_GOAWAY: &[u8] = b"\0\0\x08\x07\0\0\0\0\0\0\0\0\0\0\0\0\0";

/// Waits until an HTTP/2 server answers on the unix socket at `path`, for at most
/// `timeout`, and returns how long that took.
///
/// A connect to a listening socket completes into its backlog whether or not anybody
/// accepts, so connecting proves nothing; the server's first frame (its SETTINGS, which
/// an HTTP/2 server sends as soon as it takes a connection) does. A released owner calls
/// this on `xds.sock`, whose listener it no longer accepts on: the answer comes from the
/// successor, the moment it serves. No polling: the one connect waits in the backlog.
pub async fn await_server(path: &std::path::Path, timeout: Duration) -> std::io::Result<Duration> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let start = Instant::now();
    let probe = async {
        let mut conn = tokio::net::UnixStream::connect(path).await?;
        conn.write_all(H2_PREFACE).await?;
        let mut header = [0u8; 9];
        conn.read_exact(&mut header).await?;
        if header[3] != 0x04 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "{} answered a frame of type {:#04x}, not HTTP/2 SETTINGS",
                    path.display(),
                    header[3]
                ),
            ));
        }
        let _ = conn.write_all(H2_GOAWAY).await;
        Ok(start.elapsed())
    };
    tokio::time::timeout(timeout, probe)
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no server answered on {} within {timeout:?}",
                    path.display()
                ),
            ))
        })
}
