//! A worker that turns hostile, on its control socket or with its system calls, played by
//! `stand-in-worker`, against the real supervisor.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use aether_e2e::testing::{Agent, LocalNode, bin, is_root, process_gone as dead, wait_for};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
use nix::unistd::Pid;
use shared_proto::control::{HANDOFF_VERSION, HandoffBody, HandoffHello};
use shared_proto::fdpass;

const T: Duration = Duration::from_secs(10);
const BOUND: Duration = Duration::from_millis(100);

fn threads(pid: i32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().collect::<Vec<_>>())
        .unwrap_or_default();
    tasks
        .iter()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// Starts the next generation (under `wrapper`) with the stand-in as its worker, in `mode`
/// (see `stand-in-worker`), and the FIFO `stand-in-go` in its state folder.
fn stand_in(node: &mut LocalNode, mode: &str, wrapper: &[&str]) -> Agent {
    std::fs::create_dir_all(&node.state_dir).expect("state dir");
    std::fs::write(node.state_dir.join("stand-in-mode"), mode).expect("mode");
    let go = node.state_dir.join("stand-in-go");
    nix::unistd::mkfifo(&go, nix::sys::stat::Mode::from_bits_truncate(0o666))
        .expect("mkfifo stand-in-go");
    // Readable by the worker's uid whatever the umask.
    std::fs::set_permissions(&go, std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .expect("chmod stand-in-go");
    let worker_bin = format!("--worker-bin={}", bin("stand-in-worker").display());
    node.start_agent_wrapped(wrapper, &[&worker_bin])
}

const KILLED: &str = "the worker's seccomp filter killed it";

/// The supervisor's line about a worker its seccomp filter killed, once the respawned
/// stand-in (a quiet worker) serves the node.
fn killed_line(agent: &Agent) -> String {
    agent.wait_log(KILLED, T);
    agent.wait_log("worker serves the node", T);
    agent
        .log()
        .lines()
        .find(|l| l.contains(KILLED))
        .expect("the line")
        .to_string()
}

/// Each call of the named set kills the worker; the supervisor's log names the call (the
/// stand-in prints a line for a call that returns, so none must appear), and the
/// respawned worker serves.
#[test]
fn execve_a_foreign_socket_family_unshare_and_ptrace_each_kill_the_worker_and_the_supervisor_names_the_call()
 {
    let cases = [
        ("execve", "syscall=execve"),
        ("vsock", "syscall=socket(family 40)"),
        ("alg", "syscall=socket(family 38)"),
        ("unshare", "syscall=unshare(flags 0x10000000)"),
        ("ptrace", "syscall=ptrace(request 0)"),
    ];
    let wrong: Vec<String> = cases
        .iter()
        .filter_map(|(call, named)| {
            let mut node = LocalNode::new();
            let agent = stand_in(&mut node, &format!("call {call}"), &[]);
            let line = killed_line(&agent);
            let log = agent.log();
            (!line.contains(named) || log.contains("stand-in "))
                .then(|| format!("{call}: want {named:?} and no stand-in line:\n{log}"))
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The supervisor runs with a terminal as its controlling one, as when an operator starts
/// it from a root shell. The worker has no controlling terminal (its own session), so
/// `/dev/tty` gives it ENXIO, and TIOCSTI on any descriptor kills it before the kernel
/// looks at the descriptor: nothing reaches the terminal's input.
#[test]
fn a_worker_cannot_tiocsti_its_supervisors_terminal() {
    use nix::fcntl::OFlag;
    use nix::sys::termios::{SetArg, cfmakeraw, tcgetattr, tcsetattr};
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY).expect("posix_openpt");
    nix::pty::grantpt(&master).expect("grantpt");
    nix::pty::unlockpt(&master).expect("unlockpt");
    let tty = nix::pty::ptsname_r(&master).expect("ptsname");
    let terminal = std::os::unix::fs::OpenOptionsExt::custom_flags(
        std::fs::OpenOptions::new().read(true).write(true),
        libc::O_NOCTTY,
    )
    .open(&tty)
    .expect("open the terminal");
    // Raw: a single injected byte would be readable at once.
    let mut mode = tcgetattr(&terminal).expect("tcgetattr");
    cfmakeraw(&mut mode);
    tcsetattr(&terminal, SetArg::TCSANOW, &mode).expect("tcsetattr");
    let mut node = LocalNode::new();
    let script = format!("exec setsid --ctty \"$@\" <{tty}");
    let agent = stand_in(&mut node, "call tiocsti", &["sh", "-c", &script, "sh"]);
    let line = killed_line(&agent);
    let log = agent.log();
    // The premise: the terminal is the supervisor's controlling one (tty_nr in its stat).
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", agent.pid())).expect("stat");
    let tty_nr: u64 = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().nth(4))
        .and_then(|n| n.parse().ok())
        .expect("tty_nr");
    assert_ne!(
        tty_nr, 0,
        "the supervisor has no controlling terminal:\n{log}"
    );
    assert!(line.contains("TIOCSTI"), "{line}");
    assert!(
        log.contains(": open /dev/tty: Err(Some(6))"),
        "the worker opened a controlling terminal (want ENXIO):\n{log}"
    );
    assert!(!log.contains(": TIOCSTI: "), "TIOCSTI returned:\n{log}");
    let mut fds = [nix::poll::PollFd::new(
        terminal.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    let pending = nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).expect("poll");
    assert_eq!(pending, 0, "input reached the terminal");
}

/// A call outside the allow list fails with ENOSYS and the worker lives on, serving; the
/// kernel logs the refusal (an audit record of type 1326 with the pid and the call's
/// number) where this test may read the kernel log.
#[test]
fn a_call_outside_the_allow_list_fails_with_enosys_the_worker_serves_and_the_kernel_logs_it() {
    let mut node = LocalNode::new();
    let agent = stand_in(&mut node, "call readlink", &[]);
    agent.wait_log("worker serves the node", T);
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains(": readlink: "))
        .unwrap_or_else(|| panic!("no readlink line:\n{log}"));
    assert!(
        line.ends_with(&format!("Err(Some({}))", libc::ENOSYS)),
        "{line}"
    );
    assert!(
        !log.contains(KILLED) && !log.contains("respawning"),
        "{log}"
    );
    let pid: u32 = line
        .strip_prefix("stand-in ")
        .and_then(|r| r.split(':').next())
        .and_then(|p| p.parse().ok())
        .expect("the stand-in's pid");
    if !is_root() {
        eprintln!(
            "SKIPPED the kernel log check: reading it needs root (dmesg_restrict); CI runs as root"
        );
        return;
    }
    let logged =
        std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_logged").unwrap_or_default();
    if !logged.split_whitespace().any(|a| a == "errno") {
        eprintln!(
            "SKIPPED the kernel log check: this kernel does not log seccomp's errno action (kernel.seccomp.actions_logged: {logged:?})"
        );
        return;
    }
    if !std::process::Command::new("dmesg")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!(
            "SKIPPED the kernel log check: dmesg cannot read the kernel log here (no CAP_SYSLOG in this container?)"
        );
        return;
    }
    let record = format!("pid={pid} ");
    // glibc's readlink(3) is the readlink call on x86-64, readlinkat elsewhere.
    #[cfg(target_arch = "x86_64")]
    let readlink = format!("syscall={} ", libc::SYS_readlink);
    #[cfg(not(target_arch = "x86_64"))]
    let readlink = format!("syscall={} ", libc::SYS_readlinkat);
    wait_for("the kernel's record of the refusal", T, || {
        let out = std::process::Command::new("dmesg").output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .any(|l| {
                l.contains("type=1326")
                    && l.contains(&record)
                    && l.contains(&readlink)
                    && l.contains("code=0x50000")
            })
            .then_some(())
    });
}

/// One standby handshake on `handoff.sock`; how long the owner took to offer.
fn handoff_answer(path: &std::path::Path) -> Duration {
    let s = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .expect("socket");
    let start = Instant::now();
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&s),
        &UnixAddr::new(path).expect("addr"),
    )
    .expect("connect handoff.sock");
    fdpass::send_handoff(
        s.as_fd(),
        HandoffBody::Hello(HandoffHello {
            version: HANDOFF_VERSION,
            keeper: true,
        }),
        &[],
    )
    .expect("hello");
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
    let mut agent = stand_in(&mut node, &format!("linger {port}"), &[]);
    let supervisor = Pid::from_raw(agent.pid());
    // Accepted, never read: the stand-in's sends fill the path and stay unsent.
    let (_stalled, _) = stalled_peer.accept().expect("the stand-in connects");
    let state = |name: &str| node.state_dir.join(name);
    wait_for("the stand-in armed", T, || {
        state("stand-in-armed").exists().then_some(())
    });
    kill(supervisor, Signal::SIGSTOP).expect("SIGSTOP");
    // The stand-in is blocked opening the FIFO for reading; this open lets it go on.
    drop(
        std::fs::OpenOptions::new()
            .write(true)
            .open(state("stand-in-go"))
            .expect("go"),
    );
    let pid: i32 = wait_for("the stand-in to pass its socket", T, || {
        std::fs::read_to_string(state("stand-in-sent"))
            .ok()?
            .parse()
            .ok()
    });
    let start = Instant::now();
    kill(supervisor, Signal::SIGCONT).expect("SIGCONT");
    wait_for("the stand-in killed", T, || dead(pid).then_some(()));
    let killed_after = start.elapsed();
    let answered = handoff_answer(&node.run_dir.join("handoff.sock"));
    // The close is pending on a thread of its own (named once it first runs).
    let lingering =
        aether_e2e::testing::try_wait_for("the lingering close", Duration::from_secs(1), || {
            threads(agent.pid())
                .iter()
                .any(|t| t == "fd-discard")
                .then_some(())
        })
        .is_ok();
    eprintln!(
        "killed {killed_after:?} after the supervisor went on; handoff answered in {answered:?}; close pending: {lingering}"
    );
    let log = agent.log();
    assert!(
        log.contains("carries 1 descriptors, expected 0") && log.contains("killing it"),
        "{log}"
    );
    assert!(
        killed_after < BOUND,
        "killed {killed_after:?} after the supervisor went on"
    );
    assert!(answered < BOUND, "handoff.sock answered after {answered:?}");
    assert!(
        lingering,
        "the supervisor's close of the socket should still be pending:\n{log}"
    );

    // The respawned stand-in is a quiet worker. It inherited nothing of the pending close
    // (its exec would otherwise be the close that lingers), so it serves at once.
    wait_for("a respawned worker serving", T, || {
        agent.log().contains("worker serves the node").then_some(())
    });
    let respawned = start.elapsed();
    assert!(
        respawned < Duration::from_secs(1),
        "the respawned worker served {respawned:?} after the supervisor went on"
    );
    // SIGTERM drains it and the supervisor exits.
    let start = Instant::now();
    agent.signal(Signal::SIGTERM);
    let status = agent.wait_exit(T);
    let took = start.elapsed();
    assert!(status.success(), "{status:?}\n{}", agent.log());
    assert!(took < BOUND, "exited {took:?} after SIGTERM");
    assert!(threads(agent.pid()).is_empty());
}
