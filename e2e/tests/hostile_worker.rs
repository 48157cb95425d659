//! A worker that turns hostile on its control socket, played by `stand-in-worker`, against
//! the real supervisor.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use aether_e2e::testing::{LocalNode, bin, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use shared_proto::control::{HANDOFF_VERSION, HandoffBody, HandoffHello};
use shared_proto::fdpass;

const T: Duration = Duration::from_secs(10);
const BOUND: Duration = Duration::from_millis(100);

fn threads(pid: i32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.flatten().collect::<Vec<_>>()).unwrap_or_default();
    tasks.iter().filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok()).map(|c| c.trim().to_string()).collect()
}

/// Gone, or a zombie waiting to be reaped.
fn dead(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
}

/// One standby handshake on `handoff.sock`; how long the owner took to offer.
fn handoff_answer(path: &std::path::Path) -> Duration {
    let s = socket(AddressFamily::Unix, SockType::SeqPacket, SockFlag::SOCK_CLOEXEC, None).expect("socket");
    let start = Instant::now();
    connect(std::os::fd::AsRawFd::as_raw_fd(&s), &UnixAddr::new(path).expect("addr")).expect("connect handoff.sock");
    fdpass::send_handoff(s.as_fd(), HandoffBody::Hello(HandoffHello { version: HANDOFF_VERSION, keeper: true }), &[]).expect("hello");
    let (body, fds) = fdpass::recv_handoff(s.as_fd(), false).expect("an offer");
    assert!(matches!(body, HandoffBody::Offer(_)) && fds.len() == 2);
    start.elapsed()
}

/// The worker passes the supervisor a TCP socket with SO_LINGER set and unsent data
/// whose peer never reads: closing it blocks for the linger time (5 s). The supervisor
/// kills the worker, answers its handoff socket and acts on SIGTERM, each within 100 ms,
/// while that close is still pending on a thread of its own. The supervisor is stopped
/// while the worker sends and closes its own copy, so that the supervisor's close is the
/// one that lingers.
#[test]
fn a_worker_passing_a_lingering_socket_is_killed_and_the_supervisor_stays_responsive() {
    let mut node = LocalNode::new();
    let stalled_peer = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = stalled_peer.local_addr().expect("addr").port();
    std::fs::create_dir_all(&node.state_dir).expect("state dir");
    std::fs::write(node.state_dir.join("stand-in-mode"), format!("linger {port}")).expect("mode");
    let worker_bin = format!("--worker-bin={}", bin("stand-in-worker").display());
    let mut agent = node.start_agent_with(&[&worker_bin]);
    let supervisor = Pid::from_raw(agent.pid());
    // Accepted, never read: the stand-in's sends fill the path and stay unsent.
    let (_stalled, _) = stalled_peer.accept().expect("the stand-in connects");
    let state = |name: &str| node.state_dir.join(name);
    wait_for("the stand-in armed", T, || state("stand-in-armed").exists().then_some(()));
    kill(supervisor, Signal::SIGSTOP).expect("SIGSTOP");
    std::fs::write(state("stand-in-go"), "").expect("go");
    let pid: i32 = wait_for("the stand-in to pass its socket", T, || std::fs::read_to_string(state("stand-in-sent")).ok()?.parse().ok());
    let start = Instant::now();
    kill(supervisor, Signal::SIGCONT).expect("SIGCONT");
    wait_for("the stand-in killed", T, || dead(pid).then_some(()));
    let killed_after = start.elapsed();
    let answered = handoff_answer(&node.run_dir.join("handoff.sock"));
    // The close is pending on a thread of its own (named once it first runs).
    let lingering = aether_e2e::testing::try_wait_for("the lingering close", Duration::from_secs(1), || {
        threads(agent.pid()).iter().any(|t| t == "fd-discard").then_some(())
    })
    .is_ok();
    eprintln!("killed {killed_after:?} after the supervisor went on; handoff answered in {answered:?}; close pending: {lingering}");
    let log = agent.log();
    assert!(log.contains("carries 1 descriptors, expected 0") && log.contains("killing it"), "{log}");
    assert!(killed_after < BOUND, "killed {killed_after:?} after the supervisor went on");
    assert!(answered < BOUND, "handoff.sock answered after {answered:?}");
    assert!(lingering, "the supervisor's close of the socket should still be pending:\n{log}");

    // The respawned stand-in is a quiet worker. It inherited nothing of the pending close
    // (its exec would otherwise be the close that lingers), so it serves at once.
    wait_for("a respawned worker serving", T, || agent.log().contains("worker serves the node").then_some(()));
    let respawned = start.elapsed();
    assert!(respawned < Duration::from_secs(1), "the respawned worker served {respawned:?} after the supervisor went on");
    // SIGTERM drains it and the supervisor exits.
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(T);
    let took = start.elapsed();
    assert!(status.success(), "{status:?}\n{}", agent.log());
    assert!(took < BOUND, "exited {took:?} after SIGTERM");
    assert!(threads(agent.pid()).is_empty());
}
