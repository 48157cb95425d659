//! Socket continuity without a proxy: the node sockets survive rolls and worker crashes,
//! a hung worker is replaced, and the handoff protocol refuses bad peers.
//! The same properties with a real Envoy connected are in worker/tests and the harness.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use aether_e2e::testing::{LocalNode, accepts, is_root, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    AddressFamily, Backlog, SockFlag, SockType, UnixAddr, accept, bind, listen, socket,
};
use nix::unistd::Pid;
use shared_proto::control::{HANDOFF_VERSION, HandoffBody, HandoffHello, HandoffOffer};
use shared_proto::{fdpass, handoff};

const T: Duration = Duration::from_secs(10);

fn fd_count(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn surge_rolls_keep_the_socket_inodes() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    let inodes = node.socket_inodes();
    for _ in 0..5 {
        let next = node.start_agent();
        next.wait_role("standby", T);
        // The standby's supervisor fetches the owner's sockets on its own schedule; a
        // standby with nothing to build can be Ready first.
        next.wait_log("holding the owner's node sockets", T);
        owner.signal(Signal::SIGTERM);
        owner.wait_exit(T);
        let ready = next.wait_role("owner", T);
        assert_eq!(
            ready["takeover"]["handed_off"],
            true,
            "takeover did not use the handed-off sockets:\n{}",
            next.log()
        );
        assert_eq!(
            node.socket_inodes(),
            inodes,
            "a roll replaced a node socket"
        );
        owner = next;
    }
}

#[test]
fn killing_the_whole_owner_generation_takes_the_fallback_bind_when_nothing_was_handed_off() {
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    // The owner predates the handoff: no handoff.sock to fetch from.
    std::fs::remove_file(node.run_dir.join("handoff.sock")).expect("remove handoff.sock");
    let inodes = node.socket_inodes();
    let next = node.start_agent();
    next.wait_role("standby", T);
    owner.kill_generation();
    assert!(
        !next.log().contains("holding the owner's node sockets"),
        "{}",
        next.log()
    );
    let ready = next.wait_role("owner", T);
    assert_eq!(
        ready["takeover"]["handed_off"], false,
        "nothing was handed off, so the sockets were bound fresh"
    );
    let _ = inodes; // Inode numbers are reused by the filesystem; handed_off tells the path.
    assert!(accepts(&node.xds_sock()) && accepts(&node.cni_sock()));
}

#[test]
fn a_killed_worker_is_respawned_with_the_same_sockets() {
    let mut node = LocalNode::new();
    // A watched registry file, as on a real node: its inotify instance makes the killed
    // worker's exit wait for a kernel grace period, which the respawn does not wait for.
    let registry = node.root.path().join("registry.json");
    std::fs::write(&registry, r#"{"services": []}"#).expect("registry file");
    node.registry_file = Some(registry);
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    let inodes = node.socket_inodes();
    for i in 1..=10 {
        let old = owner.worker_pid();
        kill(Pid::from_raw(old), Signal::SIGKILL).expect("kill worker");
        let ready = wait_for("a respawned worker serving", T, || {
            owner
                .ready()
                .filter(|(s, v)| {
                    *s == 200 && v["role"] == "owner" && v["pid"].as_i64() != Some(old as i64)
                })
                .map(|(_, v)| v)
        });
        assert_eq!(ready["takeover"]["respawn"], true);
        assert_eq!(
            node.socket_inodes(),
            inodes,
            "respawn {i} replaced a node socket"
        );
        assert!(accepts(&node.xds_sock()) && accepts(&node.cni_sock()));
    }
    // One respawn per kill, whichever came first: the control socket's end or SIGCHLD.
    // A worker replaced on its socket's end is still reaped when its SIGCHLD comes.
    let log = owner.log();
    assert_eq!(
        log.matches("worker exited unexpectedly; respawning")
            .count(),
        10,
        "{log}"
    );
    let by_socket = log.matches("how=\"closed its control socket\"").count();
    wait_for(
        "every worker replaced on its socket's end reaped",
        T,
        || {
            (owner
                .log()
                .matches("reaped a worker that was already replaced")
                .count()
                == by_socket)
                .then_some(())
        },
    );
}

#[test]
fn a_worker_that_stops_answering_is_killed_and_replaced() {
    let mut node = LocalNode::new();
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    let old = owner.worker_pid();
    let start = Instant::now();
    kill(Pid::from_raw(old), Signal::SIGSTOP).expect("stop worker");
    wait_for("a replacement worker", Duration::from_secs(15), || {
        owner
            .ready()
            .filter(|(s, v)| *s == 200 && v["pid"].as_i64() != Some(old as i64))
            .map(|_| ())
    });
    let took = start.elapsed();
    eprintln!("hung worker replaced after {took:?}");
    // 5 s heartbeat deadline, checked each 1 s heartbeat, plus the respawn backoff.
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "replaced after {took:?}"
    );
    assert!(owner.log().contains("missed heartbeats"));
}

#[test]
fn a_worker_that_keeps_dying_is_respawned_at_once_then_with_growing_delays() {
    let mut node = LocalNode::new();
    // A "worker" that exits at once, before it says anything: a crash loop.
    let agent = node.start_agent_with(&["--worker-bin=/bin/false"]);
    let delays = wait_for("five respawns", Duration::from_secs(10), || {
        let log = agent.log();
        let delays: Vec<u64> = log
            .lines()
            .filter(|l| l.contains("worker exited unexpectedly"))
            .map(|l| {
                let v = l
                    .split("respawn_in_ms=")
                    .nth(1)
                    .expect("respawn_in_ms in the log line");
                v.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .unwrap()
                    .parse()
                    .expect("a number")
            })
            .collect();
        (delays.len() >= 5).then_some(delays)
    });
    assert_eq!(delays[..5], [0, 100, 200, 400, 800], "respawn delays in ms");
}

/// A standby's handshake as an arbitrary peer would do it.
fn dial(path: &std::path::Path) -> OwnedFd {
    let s = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    nix::sys::socket::connect(
        std::os::fd::AsRawFd::as_raw_fd(&s),
        &UnixAddr::new(path).expect("addr"),
    )
    .expect("connect handoff.sock");
    s
}

#[test]
fn the_owner_refuses_bad_handoff_peers_and_leaks_nothing() {
    let mut node = LocalNode::new();
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    let handoff = node.run_dir.join("handoff.sock");
    let before = fd_count(owner.pid());
    let devnull = || File::open("/dev/null").expect("/dev/null");
    // Garbage, a hello with descriptors attached, a hello of another version.
    {
        let s = dial(&handoff);
        nix::sys::socket::send(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            b"\x00garbage\xff",
            nix::sys::socket::MsgFlags::empty(),
        )
        .expect("send");
        owner.wait_log("handoff refused", T);
    }
    let refusals = |a: &aether_e2e::testing::Agent| a.log().matches("handoff refused").count();
    {
        let s = dial(&handoff);
        let (f1, f2) = (devnull(), devnull());
        fdpass::send_handoff(
            s.as_fd(),
            HandoffBody::Hello(HandoffHello {
                version: HANDOFF_VERSION,
                keeper: false,
            }),
            &[f1.as_fd(), f2.as_fd()],
        )
        .expect("send");
        wait_for("second refusal", T, || {
            (refusals(&owner) >= 2).then_some(())
        });
    }
    {
        let s = dial(&handoff);
        fdpass::send_handoff(
            s.as_fd(),
            HandoffBody::Hello(HandoffHello {
                version: 99,
                keeper: false,
            }),
            &[],
        )
        .expect("send");
        wait_for("third refusal", T, || (refusals(&owner) >= 3).then_some(()));
    }
    let log = owner.log();
    assert!(
        log.contains("undecodable message")
            && log.contains("HandoffHello carries 2 descriptors")
            && log.contains("version 99"),
        "{log}"
    );
    // Unexpected descriptors are closed on a thread of their own (a lingering socket's
    // close may block), so the count comes back shortly after the refusal, not with it.
    let mut now = 0;
    let back = aether_e2e::testing::try_wait_for("the refused descriptors to be closed", T, || {
        now = fd_count(owner.pid());
        (now == before).then_some(())
    });
    assert!(
        back.is_ok(),
        "the owner leaked descriptors: {now} open, {before} before"
    );
    assert_eq!(owner.ready().expect("owner").1["role"], "owner");
}

#[test]
fn the_owner_refuses_a_peer_of_another_uid() {
    if !is_root() {
        eprintln!(
            "SKIPPED the_owner_refuses_a_peer_of_another_uid: needs root to connect as another uid (CI runs as root)"
        );
        return;
    }
    let mut node = LocalNode::new();
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    let handoff = node.run_dir.join("handoff.sock");
    assert_eq!(
        hello_as_uid_65534(&handoff),
        "b''",
        "the owner answered a foreign uid"
    );
    owner.wait_log("runs as uid 65534", T);
}

/// Limitation 8 of SECURITY.md, closed: a same-uid peer that connects to `handoff.sock`
/// (or `keeper.sock`) and never speaks holds a parked slot, not the owner's loop. With
/// twice `Parked::MAX` silent peers queued ahead of it, a standby's fetch gets the offer
/// at its first try (the old owner waited 500 ms on each silent peer in turn, so the
/// fetch timed out), and the oldest silent peers are closed to keep the bound.
#[test]
fn silent_handoff_peers_hold_up_neither_the_owner_nor_the_keeper() {
    let mut node = LocalNode::new();
    let keeper = node.start_keeper();
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    keeper.wait_log_count("keeping the owner's node sockets", 1, T);
    let (xds, cni) = (node.xds_sock(), node.cni_sock());
    for (name, pid) in [("handoff.sock", owner.pid()), ("keeper.sock", keeper.pid())] {
        let path = node.run_dir.join(name);
        let silent: Vec<OwnedFd> = (0..2 * handoff::Parked::MAX).map(|_| dial(&path)).collect();
        let started = Instant::now();
        let held = handoff::fetch(&path, &xds, &cni, false);
        let took = started.elapsed();
        let held = held.unwrap_or_else(|e| {
            panic!(
                "{name}: the fetch behind {} silent peers failed after {took:?}: {e}",
                silent.len()
            )
        });
        assert!(held.is_some(), "{name}: no offer");
        // The silent peers were accepted in the order they connected, then the fetch
        // (and perhaps the keeper's own fetch on handoff.sock): the oldest were closed
        // to make room, the newest still wait, and nothing answered them.
        let open: Vec<bool> = silent
            .iter()
            .map(|s| {
                let mut b = [0u8; 8];
                let got = nix::sys::socket::recv(
                    std::os::fd::AsRawFd::as_raw_fd(s),
                    &mut b,
                    nix::sys::socket::MsgFlags::MSG_DONTWAIT,
                );
                assert!(
                    matches!(got, Ok(0) | Err(nix::errno::Errno::EAGAIN)),
                    "{name}: a silent peer got {got:?}"
                );
                got.is_err()
            })
            .collect();
        let parked = open.iter().filter(|o| **o).count();
        assert!(
            (1..handoff::Parked::MAX).contains(&parked),
            "{name}: {parked} silent peers still parked: {open:?}"
        );
        assert!(
            !open[0] && *open.last().unwrap(),
            "{name}: not the oldest closed first: {open:?}"
        );
        assert!(
            fd_count(pid) < 64,
            "{name}: the owner holds {} descriptors",
            fd_count(pid)
        );
        eprintln!(
            "{name}: offer fetched in {took:?} behind {} silent peers",
            silent.len()
        );
    }
    assert_eq!(owner.ready().expect("owner").1["role"], "owner");
}

/// Sends a handoff hello to `path` as uid 65534 (the path opened to everyone first, so
/// that the connect succeeds and SO_PEERCRED is what refuses); returns what came back,
/// `b''` for nothing. Needs root and setpriv (util-linux).
fn hello_as_uid_65534(path: &std::path::Path) -> String {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let script = format!(
        // The peer may close before the hello is even sent: a broken pipe is a refusal too.
        "import socket;s=socket.socket(socket.AF_UNIX,socket.SOCK_SEQPACKET);s.connect({:?})\ntry:\n s.send(b'\\x0a\\x02\\x08\\x01');print(repr(s.recv(4096)))\nexcept (ConnectionResetError, BrokenPipeError): print(repr(b''))",
        path.display().to_string()
    );
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            &script,
        ])
        .output()
        .expect("run setpriv (util-linux)");
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn a_standby_refuses_bad_offers_then_binds_fresh_sockets() {
    let mut node = LocalNode::new();
    std::fs::create_dir_all(&node.run_dir).expect("run dir");
    // The test holds the node lock and plays a misbehaving owner on handoff.sock.
    let lock = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(node.run_dir.join("agent.lock"))
        .expect("lock");
    lock.lock().expect("flock");
    let handoff = node.run_dir.join("handoff.sock");
    let l = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&l),
        &UnixAddr::new(&handoff).expect("addr"),
    )
    .expect("bind");
    listen(&l, Backlog::new(8).expect("backlog")).expect("listen");
    let standby = node.start_agent();
    standby.wait_role("standby", T);
    let offer = HandoffOffer {
        version: HANDOFF_VERSION,
        generation: 9,
        ..Default::default()
    };
    let files: Vec<File> = (0..6)
        .map(|_| File::open("/dev/null").expect("/dev/null"))
        .collect();
    type Breaker<'a> = Box<dyn Fn(&OwnedFd) + 'a>;
    let bad: Vec<(&str, Breaker)> = vec![
        (
            "garbage",
            Box::new(|c: &OwnedFd| {
                nix::sys::socket::send(
                    std::os::fd::AsRawFd::as_raw_fd(c),
                    b"\xff\xff",
                    nix::sys::socket::MsgFlags::empty(),
                )
                .expect("send");
            }),
        ),
        (
            "wrong-typed fds",
            Box::new(|c: &OwnedFd| {
                fdpass::send_handoff(
                    c.as_fd(),
                    HandoffBody::Offer(offer.clone()),
                    &[files[0].as_fd(), files[1].as_fd()],
                )
                .expect("send");
            }),
        ),
        (
            "too many fds",
            Box::new(|c: &OwnedFd| {
                let fds: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
                fdpass::send_handoff(c.as_fd(), HandoffBody::Offer(offer.clone()), &fds)
                    .expect("send");
            }),
        ),
    ];
    let mut fds_after_first = None;
    for (i, (what, answer)) in bad.iter().enumerate() {
        let c = accept(&l).expect("standby dials");
        let mut hello = [0u8; 64];
        let _ = nix::sys::socket::recv(
            std::os::fd::AsRawFd::as_raw_fd(&c),
            &mut hello,
            nix::sys::socket::MsgFlags::empty(),
        );
        answer(&c);
        drop(c);
        wait_for(&format!("refusal {i} ({what})"), T, || {
            (standby
                .log()
                .matches("handoff from the owner failed")
                .count()
                > i)
                .then_some(())
        });
        let n = fd_count(standby.pid());
        match fds_after_first {
            None => fds_after_first = Some(n),
            Some(first) => assert_eq!(
                n, first,
                "standby supervisor leaked descriptors after {what}"
            ),
        }
    }
    let log = standby.log();
    assert!(
        log.contains("not a socket") && log.contains("control data truncated"),
        "{log}"
    );
    // The owner goes away; the standby binds fresh sockets.
    drop(l);
    drop(lock);
    let ready = standby.wait_role("owner", T);
    assert_eq!(ready["takeover"]["handed_off"], false);
    let _ = std::io::stderr().flush();
}

/// The listeners an agent stored in "systemd's" fd store (this test's NOTIFY_SOCKET):
/// FDSTORE=1 messages by FDNAME, once both `xds` and `cni` arrived.
fn fd_store(
    notify: &std::os::unix::net::UnixDatagram,
) -> std::collections::BTreeMap<String, OwnedFd> {
    let mut stored = std::collections::BTreeMap::new();
    let deadline = Instant::now() + T;
    while !(stored.contains_key("xds") && stored.contains_key("cni")) {
        assert!(
            Instant::now() < deadline,
            "no FDSTORE of both listeners within {T:?}; got {:?}",
            stored.keys()
        );
        let Ok((bytes, mut fds)) = fdpass::recv_raw(notify.as_fd(), false) else {
            continue;
        };
        let msg = String::from_utf8_lossy(&bytes).into_owned();
        let name = msg
            .lines()
            .find_map(|l| l.strip_prefix("FDNAME="))
            .map(String::from);
        if msg.lines().any(|l| l == "FDSTORE=1") {
            assert_eq!(fds.len(), 1, "FDSTORE carries one descriptor: {msg:?}");
            stored.insert(
                name.expect("FDSTORE names its descriptor"),
                fds.pop().unwrap(),
            );
        }
    }
    stored
}

#[test]
fn a_restart_under_systemd_keeps_the_sockets_in_its_fd_store_and_refuses_no_connect() {
    let mut node = LocalNode::new();
    let (mut a, notify) = node.start_agent_notifying();
    a.wait_role("owner", T);
    let stored = fd_store(&notify);
    let inodes = node.socket_inodes();

    // `systemctl restart`: the whole generation dies; the store (this test) keeps the
    // listeners open, so a connect meanwhile waits in the backlog instead of being refused.
    a.kill_generation();
    let mut waiting = std::os::unix::net::UnixStream::connect(node.xds_sock())
        .expect("a connect while no agent runs must queue, not be refused");

    // The next start gets them as systemd passes them.
    let b = start_with_stored(&mut node, &stored, &[]);
    b.wait_role("owner", T);
    assert!(
        b.log().contains("systemd kept in its fd store"),
        "{}",
        b.log()
    );
    assert_eq!(
        node.socket_inodes(),
        inodes,
        "the restart rebound a node socket"
    );

    // The connect made during the restart is served: the worker's HTTP/2 server answers
    // the client preface with a SETTINGS frame.
    use std::io::Read;
    waiting
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .expect("write the preface");
    waiting.set_read_timeout(Some(T)).expect("timeout");
    let mut frame = [0u8; 9];
    waiting
        .read_exact(&mut frame)
        .expect("the new owner answers the connect queued during the restart");
    assert_eq!(frame[3], 0x4, "a SETTINGS frame, got header {frame:?}");
}

/// Runs "systemd's" fd store for whatever arrives on `notify` within its read timeout:
/// FDSTORE=1 keeps the descriptor under its FDNAME, FDSTOREREMOVE=1 closes what is kept
/// under it.
fn serve_fd_store(
    notify: &std::os::unix::net::UnixDatagram,
    stored: &mut std::collections::BTreeMap<String, OwnedFd>,
) {
    while let Ok((bytes, mut fds)) = fdpass::recv_raw(notify.as_fd(), false) {
        let msg = String::from_utf8_lossy(&bytes).into_owned();
        let Some(name) = msg
            .lines()
            .find_map(|l| l.strip_prefix("FDNAME="))
            .map(String::from)
        else {
            continue;
        };
        if msg.lines().any(|l| l == "FDSTOREREMOVE=1") {
            stored.remove(&name);
        }
        if msg.lines().any(|l| l == "FDSTORE=1") {
            stored.insert(name, fds.pop().expect("FDSTORE carries a descriptor"));
        }
    }
}

/// Starts the next generation with `stored` passed as systemd passes its fd store: fds 3
/// and 4, `LISTEN_*` naming them; `env` goes before.
fn start_with_stored(
    node: &mut LocalNode,
    stored: &std::collections::BTreeMap<String, OwnedFd>,
    env: &[&str],
) -> aether_e2e::testing::Agent {
    // Inheritable copies for the shell, which moves them out of the way, then to 3 and 4,
    // and closes every other copy: the supervisor gets fds 3 and 4 alone, as from systemd.
    let copy = |n: &str| {
        let fd = stored[n].try_clone().expect("dup");
        nix::fcntl::fcntl(
            &fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .expect("clear FD_CLOEXEC");
        fd
    };
    let (x, c) = (copy("xds"), copy("cni"));
    let (x, c) = (
        std::os::fd::AsRawFd::as_raw_fd(&x),
        std::os::fd::AsRawFd::as_raw_fd(&c),
    );
    let script = format!(
        "export LISTEN_PID=$$ LISTEN_FDS=2 LISTEN_FDNAMES=xds:cni; exec 1000<&{x} 1001<&{c} {x}<&- {c}<&-; \
         exec \"$@\" 3<&1000 4<&1001 1000<&- 1001<&-"
    );
    let wrapper: Vec<&str> = ["env"]
        .iter()
        .chain(env)
        .chain(&["bash", "-c", &script, "bash"])
        .copied()
        .collect();
    node.start_agent_wrapped(&wrapper, &[])
}

/// What decides is the kernel's record of each stored listener's bind (sock_diag), not
/// its name: a listener whose path was replaced while no agent ran is bound to a file
/// that is gone, so the next start leaves it and binds fresh sockets, and the proxy's
/// dial of the path reaches the new owner.
#[test]
fn a_stored_listener_whose_path_was_replaced_meanwhile_is_not_used() {
    let mut node = LocalNode::new();
    let (mut a, notify) = node.start_agent_notifying();
    a.wait_role("owner", T);
    let mut stored = fd_store(&notify);
    a.kill_generation();
    // Another socket file at xds.sock, with nothing behind it: the path names the same
    // kind of file, and the stored socket still reports that name.
    std::fs::remove_file(node.xds_sock()).expect("remove xds.sock");
    drop(std::os::unix::net::UnixListener::bind(node.xds_sock()).expect("bind a stand-in"));
    let notify_path = notify
        .local_addr()
        .expect("address")
        .as_pathname()
        .expect("a path")
        .to_owned();
    let env = format!("NOTIFY_SOCKET={}", notify_path.display());
    let b = start_with_stored(&mut node, &stored, &[&env]);
    // The refused listeners leave the store (so that nothing holds cni.sock's backlog open
    // any more), and the fresh ones take their place.
    let ready = aether_e2e::testing::try_wait_for("the next start to own the node", T, || {
        serve_fd_store(&notify, &mut stored);
        b.ready()
            .filter(|(s, v)| *s == 200 && v["role"] == "owner")
            .map(|(_, v)| v)
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", b.log()));
    assert!(b.log().contains("not bound to"), "{}", b.log());
    assert_eq!(
        ready["takeover"]["handed_off"],
        false,
        "the stored listeners were used:\n{}",
        b.log()
    );
    assert!(
        accepts(&node.xds_sock()) && accepts(&node.cni_sock()),
        "the new owner does not answer at the paths"
    );
    wait_for("the fresh listeners in the store", T, || {
        serve_fd_store(&notify, &mut stored);
        (stored.len() == 2).then_some(())
    });
    let bound_to = |fd: &OwnedFd| {
        nix::sys::socket::getsockname::<UnixAddr>(std::os::fd::AsRawFd::as_raw_fd(fd)).ok()
    };
    assert_eq!(
        bound_to(&stored["xds"]).and_then(|a| a.path().map(|p| p.to_owned())),
        Some(node.xds_sock())
    );
}

/// The node's socket keeper holds the listeners while no agent runs at all (a
/// delete-then-create roll): a connect then waits in the backlog instead of being
/// refused, and the next agent takes the kept sockets and answers it.
#[test]
fn the_socket_keeper_holds_the_sockets_between_generations_and_the_next_agent_takes_them() {
    use std::io::{Read, Write};
    let mut node = LocalNode::new();
    let keeper = node.start_keeper();
    let mut owner = node.start_agent();
    owner.wait_role("owner", T);
    keeper.wait_log_count("keeping the owner's node sockets", 1, T);
    let inodes = node.socket_inodes();
    // Started as root through `aether-supervisor --keep-sockets`, it holds no capability.
    if aether_e2e::testing::is_root() {
        let status = aether_e2e::testing::proc_status(keeper.pid());
        for set in ["CapEff", "CapPrm", "CapBnd", "CapAmb", "NoNewPrivs"] {
            let got = status
                .iter()
                .find(|(k, _)| k == set)
                .map(|(_, v)| v.trim_start_matches('0'));
            assert_eq!(
                got,
                Some(if set == "NoNewPrivs" { "1" } else { "" }),
                "the keeper's {set}: {status:?}"
            );
        }
    }

    // A keeper is no successor: the owner does not wait for it at its drain.
    let drained = Instant::now();
    owner.signal(Signal::SIGTERM);
    owner.wait_exit(T);
    assert!(
        drained.elapsed() < Duration::from_secs(1),
        "the owner waited {:?} at its drain",
        drained.elapsed()
    );
    assert!(
        !owner.log().contains("the successor did not answer"),
        "{}",
        owner.log()
    );

    // Nobody runs: the connects queue in the kept listeners' backlogs.
    let mut queued = std::os::unix::net::UnixStream::connect(node.xds_sock())
        .expect("xds.sock refused a connect with no agent running");
    std::os::unix::net::UnixStream::connect(node.cni_sock())
        .expect("cni.sock refused a connect with no agent running");

    let next = node.start_agent();
    let ready = next.wait_role("owner", T);
    assert_eq!(
        ready["takeover"]["handed_off"],
        true,
        "the kept sockets were not used:\n{}",
        next.log()
    );
    assert!(
        next.log()
            .contains("taking the node sockets from the socket keeper"),
        "{}",
        next.log()
    );
    assert_eq!(node.socket_inodes(), inodes, "a node socket was replaced");
    // The connect made while no agent ran is served: HTTP/2 preface in, SETTINGS out.
    queued.set_read_timeout(Some(T)).expect("timeout");
    queued
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .expect("preface");
    let mut header = [0u8; 9];
    queued
        .read_exact(&mut header)
        .expect("the new owner answered the queued connect");
    assert_eq!(header[3], 0x04, "first frame is SETTINGS");
}

#[test]
fn the_socket_keeper_refuses_a_peer_of_another_uid_and_offers_nothing_before_it_holds_sockets() {
    let node = LocalNode::new();
    std::fs::create_dir_all(&node.run_dir).expect("run dir");
    let keeper = node.start_keeper();
    let path = node.run_dir.join("keeper.sock");
    // Logged once it listens (the file exists from its bind, a moment before).
    keeper.wait_log_count("socket keeper started", 1, T);
    // Holding nothing yet, it closes the connection: nothing to take.
    {
        let s = dial(&path);
        // The keeper may close before the hello is sent at all: the same answer.
        let hello = HandoffBody::Hello(HandoffHello {
            version: HANDOFF_VERSION,
            keeper: false,
        });
        if let Err(e) = fdpass::send_handoff(s.as_fd(), hello, &[]) {
            assert!(
                matches!(
                    e,
                    fdpass::Error::Io(nix::errno::Errno::EPIPE | nix::errno::Errno::ECONNRESET)
                ),
                "send: {e:?}"
            );
        }
        keeper.wait_log_count("before the keeper held any", 1, T);
        let got = fdpass::recv_handoff(s.as_fd(), false);
        // Closed, or reset as the keeper closed with the hello unread; not an offer.
        assert!(
            got.as_ref().is_err_and(|e| !e.would_block()),
            "the keeper offered something while holding nothing: {got:?}"
        );
    }
    if !is_root() {
        eprintln!(
            "SKIPPED the foreign-uid half: needs root to connect as another uid (CI runs as root)"
        );
        return;
    }
    let mut node = node;
    let owner = node.start_agent();
    owner.wait_role("owner", T);
    keeper.wait_log_count("keeping the owner's node sockets", 1, T);
    assert_eq!(
        hello_as_uid_65534(&path),
        "b''",
        "the keeper answered a foreign uid"
    );
    keeper.wait_log_count("runs as uid 65534", 1, T);
}

/// Fault matrix row 4: the node lock held by an unrelated process (util-linux `flock`,
/// not an agent). The agent waits as a standby: it binds no node socket and writes no
/// node file for as long as the lock is held, says why (its `/ready` and a warn line name
/// the holder), and takes the node over as soon as that process dies.
#[test]
fn a_lock_held_by_an_unrelated_process_keeps_the_agent_a_standby_until_it_dies() {
    let mut node = LocalNode::new();
    std::fs::create_dir_all(&node.run_dir).expect("run dir");
    let lock_path = node.run_dir.join("agent.lock");
    // `--no-fork`: flock execs the command itself, so the process that holds the lock is
    // the one the test kills (a forked child would inherit the lock and outlive it).
    let mut holder = std::process::Command::new("flock")
        .args(["--exclusive", "--no-fork"])
        .arg(&lock_path)
        .args(["sleep", "600"])
        .spawn()
        .expect("run flock (util-linux)");
    // Held once a non-blocking attempt of ours fails.
    wait_for("flock to hold the node lock", T, || {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .ok()?;
        f.try_lock().is_err().then_some(())
    });
    let agent = node.start_agent();
    agent.wait_role("standby", T);
    // It says why: /ready names the holder, and so does a warn line.
    let comm =
        std::fs::read_to_string(format!("/proc/{}/comm", holder.id())).expect("the holder's comm");
    let why = format!(
        "held by pid {} ({}), which is not an Aether agent",
        holder.id(),
        comm.trim()
    );
    let problem = wait_for("/ready to name the lock's holder", T, || {
        let (_, v) = agent.ready()?;
        let problems = v["problems"].as_array()?.clone();
        problems.into_iter().find(|p| p["source"] == "node-lock")
    });
    assert!(
        problem["message"]
            .as_str()
            .is_some_and(|m| m.contains(&why)),
        "{problem}"
    );
    agent.wait_log(&why, T);
    // A while as a standby (every read of /ready is one more chance to see it wrong).
    for _ in 0..20 {
        let (_, v) = agent.ready().expect("/ready answers");
        assert_eq!(
            v["role"], "standby",
            "the agent must not own the node while another process holds the lock: {v}"
        );
        for name in ["xds.sock", "cni.sock"] {
            assert!(
                !node.run_dir.join(name).exists(),
                "a standby bound {name} while the lock was held"
            );
        }
        assert_eq!(
            std::fs::read_to_string(&lock_path).unwrap_or_default(),
            "",
            "a standby wrote the lock file"
        );
    }
    let t0 = Instant::now();
    kill(Pid::from_raw(holder.id() as i32), Signal::SIGKILL).expect("kill flock");
    let _ = holder.wait();
    agent.wait_role("owner", T);
    assert!(
        node.run_dir.join("xds.sock").exists() && node.run_dir.join("cni.sock").exists(),
        "the new owner binds both sockets"
    );
    wait_for("the owner to stop reporting the lock", T, || {
        let (_, v) = agent.ready()?;
        v["problems"]
            .as_array()?
            .iter()
            .all(|p| p["source"] != "node-lock")
            .then_some(())
    });
    eprintln!(
        "lock released by the unrelated process's death; the agent owned the node {:?} later",
        t0.elapsed()
    );
}
