//! A worker stand-in for the supervisor's tests: what a compromised worker could do on
//! its control socket or with its system calls, which the real worker never does.
//!
//! The supervisor starts it as it starts `aether-worker` (`--worker-bin`), with the
//! control socket at fd 3 and the SIGSYS report pipe at fd 4, and it confines itself as
//! the worker does (`shared_proto::seccomp::confine`). It reads `<state-dir>/stand-in-mode`
//! and, unless `<state-dir>/stand-in-done` exists, creates that and acts on the mode once:
//! - `linger PORT`: says Hello, waits for Takeover, then connects to 127.0.0.1:PORT (a
//!   peer that never reads), fills the send path, sets SO_LINGER to 5 s and passes that
//!   socket to the supervisor on a Pong, where no descriptor is expected. It creates
//!   `<state-dir>/stand-in-armed` first, and sends only once the test has opened the FIFO
//!   `<state-dir>/stand-in-go` for writing, so that a test can stop the supervisor
//!   meanwhile: the stand-in closes its own copy right after the send, and the
//!   supervisor's close is then the last one, the one that lingers. Then it writes
//!   `stand-in-sent` (its pid) and waits to be killed.
//! - `call NAME`: after Hello, makes the call NAME: `execve` (of /bin/true), `vsock` and
//!   `alg` (a socket of AF_VSOCK, AF_ALG), `unshare` (CLONE_NEWUSER), `ptrace`
//!   (PTRACE_TRACEME), `tiocsti` (opens `/dev/tty`, then injects a byte with TIOCSTI into
//!   the terminal it got, or into stdin), or `readlink` (outside the allow list). It
//!   prints `stand-in <pid>: <what>: <result>` for what returns.
//! - anything else, or once `stand-in-done` exists: a quiet worker that answers pings,
//!   serves when handed the node and exits on Drain.
//!
//! Run as `--cni-plugin-bin` instead, its first argument is `chain`: it is then a conflist
//! check that never ends. It prints `stand-in chain <pid>: started` and sleeps until it is
//! killed.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use nix::sys::socket::{AddressFamily, SockFlag, SockType};
use shared_proto::control::{Body, CONTROL_VERSION, Hello, Phase, Ping, Status};
use shared_proto::fdpass;

fn main() {
    if std::env::args().nth(1).as_deref() == Some("chain") {
        eprintln!("stand-in chain {}: started", std::process::id());
        loop {
            std::thread::park();
        }
    }
    let state_dir: PathBuf = std::env::args()
        .find_map(|a| a.strip_prefix("--state-dir=").map(PathBuf::from))
        .expect("--state-dir");
    let control =
        fdpass::take_inherited(3, SockType::SeqPacket).expect("the control socket at fd 3");
    shared_proto::seccomp::confine(shared_proto::seccomp::take_report())
        .expect("the worker's own seccomp filter");
    let send = |body: Body| fdpass::send_control(control.as_fd(), body, &[]).expect("send");
    send(Body::Hello(Hello {
        version: CONTROL_VERSION,
    }));
    let done = state_dir.join("stand-in-done");
    let mode = if done.exists() {
        String::new()
    } else {
        std::fs::read_to_string(state_dir.join("stand-in-mode")).unwrap_or_default()
    };
    if !mode.is_empty() {
        std::fs::write(&done, "").expect("write stand-in-done");
    }
    if let Some(call) = mode.strip_prefix("call ") {
        make(call.trim());
    }
    let port = mode
        .strip_prefix("linger ")
        .map(|p| p.trim().parse::<u16>().expect("a port"));
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
                None => send(Body::Status(Status {
                    phase: Phase::Serving as i32,
                })),
            },
            Body::Drain(_) => std::process::exit(0),
            _ => {}
        }
    }
}

/// Makes the call `name`; prints what each call that returns gave.
fn make(name: &str) {
    // One write per line: stderr is unbuffered, and a formatted line would go out in
    // pieces that the supervisor's own lines (on the same pipe) can split.
    let say = |what: &str, result: &dyn std::fmt::Debug| {
        use std::io::Write;
        let _ = std::io::stderr()
            .write_all(format!("stand-in {}: {what}: {result:?}\n", std::process::id()).as_bytes());
    };
    let socket = |family| {
        nix::sys::socket::socket(family, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None)
    };
    match name {
        "execve" => say(
            "execve",
            &nix::unistd::execve(c"/bin/true", &[c"true"], &[] as &[&std::ffi::CStr]),
        ),
        "vsock" => say("socket(AF_VSOCK)", &socket(AddressFamily::Vsock)),
        "alg" => say("socket(AF_ALG)", &socket(AddressFamily::Alg)),
        "unshare" => say(
            "unshare",
            &nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER),
        ),
        "ptrace" => say("ptrace", &nix::sys::ptrace::traceme()),
        "tiocsti" => {
            let tty = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/tty");
            say(
                "open /dev/tty",
                &tty.as_ref().map(|_| "opened").map_err(|e| e.raw_os_error()),
            );
            let fd = tty.as_ref().map_or(0, |t| t.as_raw_fd());
            // SAFETY: TIOCSTI reads one byte through its pointer, which points at a
            // static C string.
            let rc = unsafe { libc::ioctl(fd, libc::TIOCSTI, c"x".as_ptr()) };
            say(
                "TIOCSTI",
                &(rc, std::io::Error::last_os_error().raw_os_error()),
            );
        }
        "readlink" => say(
            "readlink",
            &std::fs::read_link("/proc/self/exe").map_err(|e| e.raw_os_error()),
        ),
        other => panic!("unknown call {other:?}"),
    }
}

fn pass_a_lingering_socket(control: &std::os::fd::OwnedFd, port: u16, state_dir: &Path) -> ! {
    let mut client =
        std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the stalled peer");
    client.set_nonblocking(true).expect("nonblocking");
    let chunk = vec![0u8; 64 * 1024];
    while client.write(&chunk).is_ok() {}
    client.set_nonblocking(false).expect("blocking");
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 5,
    };
    nix::sys::socket::setsockopt(&client, nix::sys::socket::sockopt::Linger, &linger)
        .expect("SO_LINGER");
    std::fs::write(state_dir.join("stand-in-armed"), "").expect("write stand-in-armed");
    // Opening a FIFO for reading returns once a writer has opened it: the test's go.
    drop(std::fs::File::open(state_dir.join("stand-in-go")).expect("open the stand-in-go FIFO"));
    fdpass::send_control(
        control.as_fd(),
        Body::Pong(Ping { seq: 1 }),
        &[client.as_fd()],
    )
    .expect("send the socket");
    drop(client);
    std::fs::write(
        state_dir.join("stand-in-sent"),
        std::process::id().to_string(),
    )
    .expect("write stand-in-sent");
    loop {
        std::thread::park();
    }
}
