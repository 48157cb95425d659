//! `--listen`: a unix socket (`unix:///path`), whose callers are identified by their uid,
//! or plain TCP (`host:port`), which authenticates nobody and is refused unless
//! `--insecure-listen` says so. A stale socket file is replaced only when nothing answers
//! on it; a live server's socket or any other file is left alone.

use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Unix(PathBuf),
    Tcp(String),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Unix(p) => write!(f, "unix://{}", p.display()),
            ListenAddr::Tcp(a) => f.write_str(a),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(
        "--listen {0:?}: a unix socket needs an absolute path (unix:///run/aether/registrar.sock)"
    )]
    RelativeUnix(String),
    #[error("--listen {0:?}: neither unix:///path nor host:port")]
    Malformed(String),
    #[error(
        "--listen {0}: plain TCP authenticates no caller, and every caller could apply and delete services; \
         listen on a unix:///path socket, authenticate callers with --token-review or mutual TLS (--client-ca-bundle, --spiffe-endpoint), or pass --insecure-listen to accept that"
    )]
    InsecureTcp(String),
    #[error("{path} exists and is not a socket; not removed")]
    NotASocket { path: PathBuf },
    #[error("another server answers on {path}; not replaced")]
    Live { path: PathBuf },
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {source}")]
    Tcp {
        addr: String,
        source: std::io::Error,
    },
}

impl std::str::FromStr for ListenAddr {
    type Err = ListenError;

    fn from_str(s: &str) -> Result<Self, ListenError> {
        if let Some(rest) = s
            .strip_prefix("unix://")
            .or_else(|| s.strip_prefix("unix:"))
        {
            return if rest.starts_with('/') {
                Ok(ListenAddr::Unix(PathBuf::from(rest)))
            } else {
                Err(ListenError::RelativeUnix(s.into()))
            };
        }
        match s.rsplit_once(':') {
            Some((host, port))
                if !host.is_empty() && port.parse::<u16>().is_ok() && !s.contains('/') =>
            {
                Ok(ListenAddr::Tcp(s.into()))
            }
            _ => Err(ListenError::Malformed(s.into())),
        }
    }
}

pub enum Bound {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

/// Binds `addr`. Must run inside the runtime. A unix socket gets `mode`: reaching it is
/// not being allowed to call, which the peer's uid decides.
pub async fn bind(addr: &ListenAddr, insecure: bool, mode: u32) -> Result<Bound, ListenError> {
    match addr {
        ListenAddr::Tcp(a) if !insecure => Err(ListenError::InsecureTcp(a.clone())),
        ListenAddr::Tcp(a) => tokio::net::TcpListener::bind(a.as_str())
            .await
            .map(Bound::Tcp)
            .map_err(|source| ListenError::Tcp {
                addr: a.clone(),
                source,
            }),
        ListenAddr::Unix(path) => {
            remove_stale(path)?;
            let io = |what| {
                move |source| ListenError::Io {
                    path: path.clone(),
                    what,
                    source,
                }
            };
            let l = tokio::net::UnixListener::bind(path).map_err(io("bind"))?;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                .map_err(io("chmod"))?;
            Ok(Bound::Unix(l))
        }
    }
}

/// Removes `path` if it is a socket nobody answers on.
fn remove_stale(path: &Path) -> Result<(), ListenError> {
    let io = |what| {
        move |source| ListenError::Io {
            path: path.to_owned(),
            what,
            source,
        }
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io("stat")(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(ListenError::NotASocket {
            path: path.to_owned(),
        });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(ListenError::Live {
            path: path.to_owned(),
        }),
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "replacing a stale socket nobody answers on");
            std::fs::remove_file(path).map_err(io("remove the stale socket"))
        }
        Err(e) => Err(io("connect to the existing socket")(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            "unix:///run/r.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/run/r.sock".into())
        );
        assert_eq!(
            "127.0.0.1:7070".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("127.0.0.1:7070".into())
        );
        assert_eq!(
            "[::1]:7070".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("[::1]:7070".into())
        );
        assert_eq!(
            "localhost:7070".parse::<ListenAddr>().unwrap(),
            ListenAddr::Tcp("localhost:7070".into())
        );
        for bad in [
            "unix://run/r.sock",
            "7070",
            "host:port",
            "http://127.0.0.1:7070",
        ] {
            assert!(bad.parse::<ListenAddr>().is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn only_a_dead_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.sock");
        let addr = ListenAddr::Unix(path.clone());
        let live = bind(&addr, false, 0o666).await.unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o666
        );
        let e = bind(&addr, false, 0o666).await.err().unwrap().to_string();
        assert!(
            e.contains("another server answers on") && e.contains("r.sock"),
            "{e}"
        );
        drop(live);
        // The file stays when its listener closes; nothing answers on it now.
        assert!(path.exists());
        bind(&addr, false, 0o666).await.unwrap();

        let file = dir.path().join("plain");
        std::fs::write(&file, "x").unwrap();
        let e = bind(&ListenAddr::Unix(file.clone()), false, 0o666)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is not a socket; not removed"), "{e}");
        assert!(file.exists());

        let e = bind(&"127.0.0.1:0".parse().unwrap(), false, 0)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--insecure-listen"), "{e}");
    }
}
