//! The plugin's one conversation with the agent: connect to `agentSocket` and make one
//! call.
//!
//! During a takeover the socket path can be briefly missing (ENOENT) or refuse
//! (ECONNREFUSED), and the old owner can turn a call away while it drains (gRPC
//! `Unavailable`). All three are retried every ~10 ms for a bounded time, so that the
//! runtime never sees the switch; past the bound the answer is CNI code 11 (try again
//! later). So is a full listen backlog (EAGAIN: a burst or flood of connects not yet
//! accepted), after a connect that waits for room in the kernel. Every call is idempotent
//! on the agent side, so retrying a whole call is safe.
//!
//! The call carries what is left of the plugin's deadline as `grpc-timeout`: an agent too
//! busy to commit an ADD by then refuses it just before (RESOURCE_EXHAUSTED), and the
//! runtime reads code 11 with the agent's reason rather than this plugin's timeout.

use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex};

use hyper_util::rt::TokioIo;
use shared_proto::cni::cni_client::CniClient;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::input::Command;
use crate::{CniError, Invocation, Timeouts, code};

/// Makes the invocation's call, retrying a takeover in progress within `timeouts`.
pub async fn call(inv: &Invocation, timeouts: Timeouts) -> Result<(), CniError> {
    let socket = inv.config.agent_socket.as_path();
    let deadline = Instant::now() + timeouts.connect;
    loop {
        let started = Instant::now();
        let attempt = async {
            let channel = connect(socket, deadline, timeouts).await?;
            let mut client = CniClient::new(channel);
            // What is left of this attempt's deadline goes to the agent as `grpc-timeout`:
            // an agent too busy to commit the call in time refuses it before then, and the
            // runtime reads that refusal rather than this plugin's timeout.
            let mut request = tonic::Request::new(inv.request.clone());
            request.set_timeout(timeouts.call.saturating_sub(started.elapsed()));
            let answer = match inv.command {
                Command::Add => client.add(request).await.map(|_| ()),
                Command::Del => client.del(request).await.map(|_| ()),
                Command::Check => match client.check(request).await {
                    Ok(r) if r.get_ref().holds => Ok(()),
                    Ok(r) => {
                        return Err(Attempt::Fatal(CniError::new(
                            code::UNKNOWN_CONTAINER,
                            format!("the agent does not hold the pod: {}", r.get_ref().reason),
                        )));
                    }
                    Err(s) => Err(s),
                },
                Command::Version => Ok(()),
            };
            answer.map_err(|status| classify(inv.command, status))
        };
        let result = match tokio::time::timeout(timeouts.call, attempt).await {
            Ok(r) => r,
            Err(_) => {
                return Err(CniError::new(
                    code::TRY_AGAIN_LATER,
                    format!(
                        "agent at {} did not answer {} within {:?}",
                        socket.display(),
                        inv.command.as_str(),
                        timeouts.call
                    ),
                ));
            }
        };
        match result {
            Ok(()) => return Ok(()),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(e)) => {
                if Instant::now() + timeouts.retry_every > deadline {
                    return Err(e);
                }
                tokio::time::sleep(timeouts.retry_every).await;
            }
        }
    }
}

enum Attempt {
    /// Worth another try within the bound; carries the error to report past it.
    Retry(CniError),
    Fatal(CniError),
}

fn classify(command: Command, status: tonic::Status) -> Attempt {
    use tonic::Code;
    let msg = format!(
        "agent answered {}: {:?}: {}",
        command.as_str(),
        status.code(),
        status.message()
    );
    match status.code() {
        // The old owner is draining or a connection broke mid-call: the next owner answers.
        Code::Unavailable => Attempt::Retry(CniError::new(code::TRY_AGAIN_LATER, msg)),
        Code::ResourceExhausted | Code::DeadlineExceeded | Code::Aborted => {
            Attempt::Fatal(CniError::new(code::TRY_AGAIN_LATER, msg))
        }
        Code::InvalidArgument => Attempt::Fatal(CniError::new(code::INVALID_CONFIG, msg)),
        _ => Attempt::Fatal(CniError::new(code::AGENT_ERROR, msg)),
    }
}

/// Connects to the unix socket, retrying ENOENT, ECONNREFUSED and EAGAIN until
/// `deadline`. EAGAIN is a full listen backlog: a burst or a flood of connects that the
/// agent has not accepted yet. The plugin then waits in the kernel for room
/// ([`connect_waiting`]) rather than sleeping: a flood refills every slot the agent frees
/// within microseconds, so a connect that sleeps and tries again finds it full again.
async fn connect(socket: &Path, deadline: Instant, timeouts: Timeouts) -> Result<Channel, Attempt> {
    let stream = loop {
        let mut result = UnixStream::connect(socket).await;
        if matches!(&result, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            let (path, wait) = (
                socket.to_path_buf(),
                deadline.saturating_duration_since(Instant::now()),
            );
            result = match tokio::task::spawn_blocking(move || connect_waiting(&path, wait)).await {
                Ok(r) => r.and_then(UnixStream::from_std),
                Err(e) => Err(io::Error::other(format!(
                    "the connecting thread failed: {e}"
                ))),
            };
        }
        match result {
            Ok(s) => break s,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound
                        | io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::WouldBlock
                ) =>
            {
                if Instant::now() + timeouts.retry_every > deadline {
                    return Err(Attempt::Fatal(
                        CniError::new(
                            code::TRY_AGAIN_LATER,
                            format!(
                                "agentSocket {} is unreachable: no agent answered within {:?}",
                                socket.display(),
                                timeouts.connect
                            ),
                        )
                        .with_details(e.to_string()),
                    ));
                }
                tokio::time::sleep(timeouts.retry_every).await;
            }
            Err(e) => {
                return Err(Attempt::Fatal(CniError::new(
                    code::IO_FAILURE,
                    format!("connecting to agentSocket {}: {e}", socket.display()),
                )));
            }
        }
    };
    // tonic dials through a connector; hand it the stream already connected above, so the
    // retry policy stays in one place. The URI is required by the API and never resolved.
    let slot = Arc::new(Mutex::new(Some(stream)));
    let connector = tower::service_fn(move |_: Uri| {
        let stream = slot.lock().ok().and_then(|mut s| s.take());
        async move {
            stream
                .map(TokioIo::new)
                .ok_or_else(|| io::Error::other("agent connection already used"))
        }
    });
    Endpoint::from_static("http://aether-agent.invalid")
        .connect_with_connector(connector)
        .await
        .map_err(|e| {
            Attempt::Retry(CniError::new(
                code::TRY_AGAIN_LATER,
                format!(
                    "HTTP/2 handshake with agentSocket {}: {e}",
                    socket.display()
                ),
            ))
        })
}

/// A blocking connect that, while the listen backlog is full, waits in the kernel for at
/// most `wait` (SO_SNDTIMEO bounds a unix stream connect) and is woken when the agent
/// accepts. EAGAIN once `wait` has passed. The socket comes back non-blocking.
fn connect_waiting(
    socket: &Path,
    wait: std::time::Duration,
) -> io::Result<std::os::unix::net::UnixStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, UnixAddr, connect, setsockopt, sockopt::SendTimeout,
    };
    use std::os::fd::AsRawFd;
    // A zero SO_SNDTIMEO would wait forever.
    let wait = wait.max(std::time::Duration::from_millis(1));
    let fd = nix::sys::socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    setsockopt(
        &fd,
        SendTimeout,
        &nix::sys::time::TimeVal::new(wait.as_secs() as _, wait.subsec_micros() as _),
    )?;
    connect(fd.as_raw_fd(), &UnixAddr::new(socket)?)?;
    let stream = std::os::unix::net::UnixStream::from(fd);
    stream.set_nonblocking(true)?;
    Ok(stream)
}
