//! The control transport rejects malformed messages and never leaks a descriptor.
//!
//! Each test counts `/proc/self/fd` before and after; nextest runs every test in its own
//! process, so no other test's descriptors disturb the count.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use prost::Message;
use shared_proto::control::{Body, Drain, Envelope, Takeover};
use shared_proto::fdpass::{self, Error, MAX_FDS, MAX_MESSAGE};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .count()
}

fn pair() -> (OwnedFd, OwnedFd) {
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair")
}

fn files(n: usize) -> Vec<File> {
    (0..n)
        .map(|_| File::open("/dev/null").expect("open /dev/null"))
        .collect()
}

fn takeover() -> Body {
    Body::Takeover(Takeover {
        generation: 7,
        ..Default::default()
    })
}

/// Sends `body` with `nfds` descriptors attached and returns what the receiver made of it,
/// checking that no descriptor outlives the exchange.
fn exchange(body: Body, nfds: usize) -> Result<(Body, usize), String> {
    let before = open_fds();
    let result = {
        let (a, b) = pair();
        let attach = files(nfds);
        let borrowed: Vec<BorrowedFd<'_>> = attach.iter().map(|f| f.as_fd()).collect();
        fdpass::send_control(a.as_fd(), body, &borrowed).map_err(|e| format!("send: {e}"))?;
        drop(attach);
        fdpass::recv_control(b.as_fd(), false)
            .map(|(body, fds)| (body, fds.len()))
            .map_err(|e| e.to_string())
    };
    // Rejected descriptors are closed on a thread of their own (`fdpass::discard`).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while open_fds() != before && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(
        open_fds(),
        before,
        "descriptor leak after exchanging a message with {nfds} fds"
    );
    result
}

#[test]
fn takeover_with_three_fds_is_accepted() {
    let (body, n) = exchange(takeover(), 3).expect("valid takeover");
    assert_eq!(n, 3);
    assert!(matches!(body, Body::Takeover(t) if t.generation == 7));
}

#[test]
fn wrong_descriptor_counts_are_rejected_and_closed() {
    // (message, attached fds, what the error must say)
    let cases: Vec<(Body, usize, &str)> = vec![
        (takeover(), 2, "Takeover carries 2 descriptors, expected 3"),
        (takeover(), 0, "Takeover carries 0 descriptors, expected 3"),
        (takeover(), 4, "Takeover carries 4 descriptors, expected 3"),
        (
            Body::Drain(Drain::default()),
            1,
            "Drain carries 1 descriptors, expected 0",
        ),
        (takeover(), MAX_FDS + 3, "control data truncated"),
    ];
    for (body, nfds, want) in cases {
        let err = exchange(body, nfds).expect_err("must be rejected");
        assert!(
            err.contains(want),
            "with {nfds} fds: got {err:?}, want {want:?}"
        );
    }
}

#[test]
fn oversized_and_garbage_datagrams_are_rejected() {
    let before = open_fds();
    let (a, b) = pair();
    // Bypass `send`'s own size check to put a too-large datagram on the wire.
    let big = vec![0u8; MAX_MESSAGE + 100];
    nix::sys::socket::send(
        a.as_fd().as_raw_fd_compat(),
        &big,
        nix::sys::socket::MsgFlags::empty(),
    )
    .expect("send");
    let err = fdpass::recv_control(b.as_fd(), false).expect_err("oversized");
    assert!(matches!(err, Error::Truncated), "{err}");

    nix::sys::socket::send(
        a.as_fd().as_raw_fd_compat(),
        b"\xff\xff\xff",
        nix::sys::socket::MsgFlags::empty(),
    )
    .expect("send");
    let err = fdpass::recv_control(b.as_fd(), false).expect_err("garbage");
    assert!(matches!(err, Error::Decode(_)), "{err}");

    // An envelope without a body is not a message either.
    nix::sys::socket::send(
        a.as_fd().as_raw_fd_compat(),
        &Envelope { body: None }.encode_to_vec(),
        nix::sys::socket::MsgFlags::empty(),
    )
    .expect("send");
    let err = fdpass::recv_control(b.as_fd(), false).expect_err("empty");
    assert!(matches!(err, Error::Closed | Error::Empty), "{err}");
    drop((a, b));
    assert_eq!(open_fds(), before);
}

#[test]
fn closed_peer_and_empty_socket_are_told_apart() {
    let (a, b) = pair();
    let err = fdpass::recv_control(b.as_fd(), true).expect_err("nothing sent");
    assert!(err.would_block(), "{err}");
    drop(a);
    let err = fdpass::recv_control(b.as_fd(), false).expect_err("peer gone");
    assert!(matches!(err, Error::Closed), "{err}");
}

#[test]
fn received_descriptors_are_close_on_exec() {
    let (a, b) = pair();
    let f = files(3);
    let borrowed: Vec<BorrowedFd<'_>> = f.iter().map(|f| f.as_fd()).collect();
    fdpass::send_control(a.as_fd(), takeover(), &borrowed).expect("send");
    let (_, fds) = fdpass::recv_control(b.as_fd(), false).expect("recv");
    for fd in &fds {
        let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD).expect("F_GETFD");
        assert!(flags & libc_cloexec() != 0, "fd {fd:?} lacks FD_CLOEXEC");
    }
}

fn libc_cloexec() -> i32 {
    nix::fcntl::FdFlag::FD_CLOEXEC.bits()
}

trait RawCompat {
    fn as_raw_fd_compat(&self) -> i32;
}
impl RawCompat for BorrowedFd<'_> {
    fn as_raw_fd_compat(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.as_raw_fd()
    }
}

/// A peer that passes an unexpected TCP socket with SO_LINGER set and unsent data (its
/// remote end never reads) must not stall the receiver: that socket's last close blocks
/// for the linger time, and the supervisor's event loop is the receiver. The receive
/// answers at once, and the socket is closed off the receiving thread.
#[test]
fn an_unexpected_lingering_socket_does_not_block_the_receiver() {
    use std::io::Write;
    use std::time::{Duration, Instant};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (stalled, _) = listener.accept().unwrap();
    // Fill the send path: the remote end never reads.
    client.set_nonblocking(true).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    let mut queued = 0usize;
    loop {
        match client.write(&chunk) {
            Ok(n) => queued += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("write: {e}"),
        }
    }
    assert!(queued > 0);
    client.set_nonblocking(false).unwrap();
    nix::sys::socket::setsockopt(
        &client,
        nix::sys::socket::sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 5,
        },
    )
    .unwrap();

    let (a, b) = pair();
    // A Drain carries no descriptor: this one is unexpected.
    fdpass::send_control(a.as_fd(), Body::Drain(Drain::default()), &[client.as_fd()]).unwrap();
    drop(client); // the receiver's copy is now the last one
    let before = open_fds();
    let start = Instant::now();
    let err =
        fdpass::recv_control(b.as_fd(), false).expect_err("an unexpected descriptor is refused");
    let took = start.elapsed();
    // Out of the table at once (a fork now would copy nothing), though its close lingers.
    assert_eq!(
        open_fds(),
        before,
        "the refused socket is still in the descriptor table"
    );
    assert!(
        matches!(
            err,
            Error::FdCount {
                got: 1,
                expected: 0,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        took < Duration::from_millis(100),
        "the receive took {took:?}: the lingering close blocked it"
    );
    drop(stalled);
}

/// What systemd passes at start (`LISTEN_FDS`): a socket of the expected kind is taken,
/// and comes out close-on-exec; anything else (another socket type, a file, a number with
/// nothing open there) is refused, and a refused descriptor is closed with nothing else.
#[test]
fn an_inherited_descriptor_is_taken_only_when_it_is_the_expected_socket() {
    use nix::fcntl::{FcntlArg, FdFlag, fcntl};
    use std::os::fd::{AsRawFd, IntoRawFd};

    let dir = tempfile::tempdir().expect("tempdir");
    let listener = std::os::unix::net::UnixListener::bind(dir.path().join("s")).expect("bind");
    fcntl(&listener, FcntlArg::F_SETFD(FdFlag::empty())).expect("clear FD_CLOEXEC");
    let raw = listener.into_raw_fd();
    let taken = fdpass::take_inherited(raw, SockType::Stream).expect("a stream listener is taken");
    assert_eq!(taken.as_raw_fd(), raw);
    let flags = FdFlag::from_bits_truncate(fcntl(&taken, FcntlArg::F_GETFD).expect("F_GETFD"));
    assert!(
        flags.contains(FdFlag::FD_CLOEXEC),
        "taken without close-on-exec"
    );
    drop(taken);

    let before = open_fds();
    let (a, b) = pair();
    let seqpacket = a.into_raw_fd();
    assert!(matches!(
        fdpass::take_inherited(seqpacket, SockType::Stream),
        Err(Error::Io(nix::errno::Errno::ENOTSOCK))
    ));
    let file = File::open("/dev/null")
        .expect("open /dev/null")
        .into_raw_fd();
    assert!(matches!(
        fdpass::take_inherited(file, SockType::Stream),
        Err(Error::Io(nix::errno::Errno::ENOTSOCK))
    ));
    drop(b);
    assert_eq!(open_fds(), before, "a refused descriptor stayed open");
    // Nothing open at the number: refused before anything is owned.
    let unused = 4000;
    // SAFETY: borrowed for this one call, which only asks whether anything is open there.
    let borrowed = unsafe { BorrowedFd::borrow_raw(unused) };
    assert_eq!(
        fcntl(borrowed, FcntlArg::F_GETFD),
        Err(nix::errno::Errno::EBADF)
    );
    assert!(matches!(
        fdpass::take_inherited(unused, SockType::Stream),
        Err(Error::Io(nix::errno::Errno::EBADF))
    ));
    assert_eq!(open_fds(), before);
}
