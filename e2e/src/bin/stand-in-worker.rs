//! A worker stand-in for the supervisor's tests: what a compromised worker could do on
//! its control socket, which the real worker never does.
//!
//! The supervisor starts it as it starts `aether-worker` (`--worker-bin`), with the
//! control socket at fd 3. It reads `<state-dir>/stand-in-mode`:
//! - `linger PORT`: says Hello, waits for Takeover, then connects to 127.0.0.1:PORT (a
//!   peer that never reads), fills the send path, sets SO_LINGER to 5 s and passes that
//!   socket to the supervisor on a Pong, where no descriptor is expected. It creates
//!   `<state-dir>/stand-in-armed` and `stand-in-done` first, and sends only once
//!   `stand-in-go` exists, so that a test can stop the supervisor meanwhile: the stand-in
//!   closes its own copy right after the send, and the supervisor's close is then the
//!   last one, the one that lingers. Then it writes `stand-in-sent` (its pid) and waits
//!   to be killed.
//! - anything else, or once `stand-in-done` exists: a quiet worker that answers pings,
//!   serves when handed the node and exits on Drain.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::PathBuf;

use nix::sys::socket::SockType;
use shared_proto::control::{Body, CONTROL_VERSION, Hello, Phase, Ping, Status};
use shared_proto::fdpass;

fn main() {
    let state_dir: PathBuf = std::env::args()
        .find_map(|a| a.strip_prefix("--state-dir=").map(PathBuf::from))
        .expect("--state-dir");
    let control = fdpass::take_inherited(3, SockType::SeqPacket).expect("the control socket at fd 3");
    let send = |body: Body| fdpass::send_control(control.as_fd(), body, &[]).expect("send");
    send(Body::Hello(Hello { version: CONTROL_VERSION }));
    let mode = std::fs::read_to_string(state_dir.join("stand-in-mode")).unwrap_or_default();
    let done = state_dir.join("stand-in-done");
    let port = mode.strip_prefix("linger ").filter(|_| !done.exists()).map(|p| p.trim().parse::<u16>().expect("a port"));
    loop {
        let (body, _fds) = match fdpass::recv_control(control.as_fd(), false) {
            Ok(m) => m,
            Err(fdpass::Error::Closed) => std::process::exit(0),
            Err(e) => panic!("{e}"),
        };
        match body {
            Body::Ping(p) => send(Body::Pong(Ping { seq: p.seq })),
            Body::Takeover(_) => match port {
                Some(port) => pass_a_lingering_socket(&control, port, &state_dir),
                None => send(Body::Status(Status { phase: Phase::Serving as i32 })),
            },
            Body::Drain(_) => std::process::exit(0),
            _ => {}
        }
    }
}

fn pass_a_lingering_socket(control: &std::os::fd::OwnedFd, port: u16, state_dir: &std::path::Path) -> ! {
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the stalled peer");
    client.set_nonblocking(true).expect("nonblocking");
    let chunk = vec![0u8; 64 * 1024];
    while client.write(&chunk).is_ok() {}
    client.set_nonblocking(false).expect("blocking");
    let linger = libc::linger { l_onoff: 1, l_linger: 5 };
    nix::sys::socket::setsockopt(&client, nix::sys::socket::sockopt::Linger, &linger).expect("SO_LINGER");
    std::fs::write(state_dir.join("stand-in-done"), "").expect("write stand-in-done");
    std::fs::write(state_dir.join("stand-in-armed"), "").expect("write stand-in-armed");
    while !state_dir.join("stand-in-go").exists() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    fdpass::send_control(control.as_fd(), Body::Pong(Ping { seq: 1 }), &[client.as_fd()]).expect("send the socket");
    drop(client);
    std::fs::write(state_dir.join("stand-in-sent"), std::process::id().to_string()).expect("write stand-in-sent");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}
