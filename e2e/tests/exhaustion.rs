//! Exhaustion with the real agent: a worker out of descriptors backs off instead of
//! spinning and serves again once descriptors are free; the health socket, the metrics
//! port and `xds.sock` close connections past their caps at once and count them.
//!
//! The ADS subscription limits and the CNI server's caps at their own figures are tested
//! over the real transport in the worker (`worker/src/xds/server.rs`,
//! `worker/src/cni/transport_tests.rs`); 1,000 idle connections on `cni.sock` are the
//! `idle-connections` benchmark's.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use aether_e2e::testing::{
    LocalNode, free_port, http_get_unix, metric_sample, scrape_metrics, wait_for,
};

const T: Duration = Duration::from_secs(30);

fn start(node: &mut LocalNode, metrics: &str, nofile: Option<u32>) -> aether_e2e::testing::Agent {
    // With `nofile` the agent runs under that descriptor limit (soft and hard), which the
    // supervisor's worker inherits.
    let limit = nofile.map(|n| format!("--nofile={n}:{n}"));
    let wrapper: Vec<&str> = limit.iter().flat_map(|l| ["prlimit", l.as_str()]).collect();
    node.metrics = Some(metrics.parse().expect("a metrics address"));
    let agent = node.start_agent_wrapped(&wrapper, &[]);
    agent.wait_role("owner", T);
    wait_for("the owner's metrics port", T, || scrape_metrics(metrics));
    agent
}

/// Waits until a scrape shows `series` at `want` or more; returns its value.
fn wait_sample(addr: &str, series: &str, want: f64) -> f64 {
    wait_for(&format!("{series} >= {want}"), T, || {
        scrape_metrics(addr)
            .and_then(|t| metric_sample(&t, series))
            .filter(|v| *v >= want)
    })
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn cpu_time(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/<pid>/stat");
    // Fields after the command name, which is in parentheses and may hold spaces:
    // utime is field 14 and stime 15, summed over the process's threads.
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<u64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .map(|v| v.parse().expect("tick count"))
        .collect();
    // Clock ticks of USER_HZ, which Linux's user ABI fixes at 100 per second.
    Duration::from_millis((f[0] + f[1]) * 10)
}

#[test]
fn a_worker_out_of_descriptors_backs_off_under_five_percent_of_a_core_and_serves_again() {
    assert!(
        std::process::Command::new("prlimit")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "this test needs prlimit (util-linux) to start the agent with a low descriptor limit"
    );
    const NOFILE: u32 = 128;
    let mut node = LocalNode::new();
    let metrics = format!("127.0.0.1:{}", free_port([127, 0, 0, 1]).unwrap());
    let agent = start(&mut node, &metrics, Some(NOFILE));
    let worker = agent.worker_pid();
    let limits = std::fs::read_to_string(format!("/proc/{worker}/limits")).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.split_whitespace().nth(3) == Some("128")),
        "{limits}"
    );

    // Connections the worker accepts and keeps (an HTTP/2 client that has not spoken
    // yet), until it holds every descriptor it may have; a few more wait in the backlog
    // (fewer than its 8 places: past them a blocking connect would wait for the worker).
    let free = NOFILE as usize - open_fds(worker);
    let held: Vec<UnixStream> = (0..free + 4)
        .map(|_| UnixStream::connect(node.cni_sock()).expect("connect cni.sock"))
        .collect();
    wait_for("the worker at its descriptor limit", T, || {
        (open_fds(worker) == NOFILE as usize).then_some(())
    });
    // One waiting connection on each of the other listeners.
    let _waiting = (
        UnixStream::connect(&agent.health_sock).expect("connect the health socket"),
        TcpStream::connect(&metrics).expect("connect the metrics port"),
        UnixStream::connect(node.xds_sock()).expect("connect xds.sock"),
    );
    for socket in ["cni", "health", "metrics", "xds"] {
        agent.wait_log(&format!("accept failed; backing off (queued connections wait in the backlog) socket=\"{socket}\" kind=\"emfile\""), T);
    }

    // An observation window, not a synchronisation: all four listeners are readable and
    // every accept fails. A worker that retried at once would burn the whole core.
    let window = Duration::from_secs(2);
    let before = cpu_time(worker);
    std::thread::sleep(window);
    let used = cpu_time(worker) - before;
    eprintln!("the worker (pid {worker}) used {used:?} of CPU in {window:?} out of descriptors");
    assert!(
        used < window / 20,
        "the worker used {used:?} of CPU in {window:?} while out of descriptors: over 5 % of a core"
    );

    // Descriptors come back: the worker serves again, the same process.
    drop(held);
    let start = Instant::now();
    wait_for("the health socket answering again", T, || {
        http_get_unix(&agent.health_sock, "/ready")
            .ok()
            .filter(|(s, _)| *s == 200)
    });
    eprintln!(
        "served again {:?} after the connections closed",
        start.elapsed()
    );
    for socket in ["cni", "health", "metrics", "xds"] {
        let errors = wait_sample(
            &metrics,
            &format!("aether_accept_errors_total{{socket=\"{socket}\",kind=\"emfile\"}}"),
            1.0,
        );
        eprintln!("{socket}: {errors} failed accepts");
        // 10 ms doubling to 1 s: about a dozen tries over the test, never thousands.
        assert!(
            errors < 100.0,
            "{socket}: {errors} failed accepts in a few seconds: no backoff"
        );
    }
    agent.wait_log("accepting again socket=\"cni\"", T);
    assert_eq!(agent.worker_pid(), worker, "the worker was not replaced");
    let mut ads = UnixStream::connect(node.xds_sock()).unwrap();
    assert!(http2_settings(&mut ads), "xds.sock answers again");
}

/// Sends the HTTP/2 preface and waits for the server's first frame: true if it is
/// SETTINGS, false if the server closed the connection without a byte.
fn http2_settings(conn: &mut UnixStream) -> bool {
    conn.set_read_timeout(Some(T)).unwrap();
    // A connection closed at once may refuse the write; the read says what happened.
    let _ = conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0");
    let mut header = [0u8; 9];
    match conn.read(&mut header) {
        Ok(0) => false,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => false,
        Ok(n) => {
            conn.read_exact(&mut header[n..]).expect("frame header");
            assert_eq!(header[3], 0x04, "the server's first frame is SETTINGS");
            true
        }
        Err(e) => panic!("reading the server's first frame: {e}"),
    }
}

/// The whole answer to one request on `conn`, which the test then closes.
fn answer(mut conn: impl Read + Write, request: &[u8]) -> Vec<u8> {
    // A connection closed at once may refuse the write; the read says what happened.
    let _ = conn.write_all(request);
    let mut out = Vec::new();
    let _ = conn.read_to_end(&mut out);
    out
}

#[test]
fn connections_past_each_listeners_cap_are_closed_at_once_and_counted() {
    const CAP: usize = 64;
    let mut node = LocalNode::new();
    let metrics = format!("127.0.0.1:{}", free_port([127, 0, 0, 1]).unwrap());
    let agent = start(&mut node, &metrics, None);
    let read_timeout = Some(Duration::from_secs(10));

    // Metrics: 64 connections that sent half a request line are held (for up to 2 s
    // each); the 65th, a whole request, is closed without an answer. The worker accepts
    // in arrival order, so the 64 are in when the 65th comes.
    let held: Vec<TcpStream> = (0..CAP)
        .map(|_| {
            let mut c = TcpStream::connect(&metrics).unwrap();
            c.write_all(b"GET /met").unwrap();
            c
        })
        .collect();
    let past = TcpStream::connect(&metrics).unwrap();
    past.set_read_timeout(read_timeout).unwrap();
    assert_eq!(
        answer(past, b"GET /metrics HTTP/1.0\r\n\r\n"),
        b"",
        "the 65th metrics connection got an answer"
    );
    drop(held);
    wait_sample(
        &metrics,
        "aether_connections_refused_total{socket=\"metrics\"}",
        1.0,
    );

    // The health socket, the same way.
    let held: Vec<UnixStream> = (0..CAP)
        .map(|_| {
            let mut c = UnixStream::connect(&agent.health_sock).unwrap();
            c.write_all(b"GET /rea").unwrap();
            c
        })
        .collect();
    let past = UnixStream::connect(&agent.health_sock).unwrap();
    past.set_read_timeout(read_timeout).unwrap();
    assert_eq!(
        answer(past, b"GET /ready HTTP/1.0\r\n\r\n"),
        b"",
        "the 65th health connection got an answer"
    );
    drop(held);
    wait_sample(
        &metrics,
        "aether_connections_refused_total{socket=\"health\"}",
        1.0,
    );
    wait_for("/ready answering again", T, || {
        agent.ready().filter(|(s, _)| *s == 200)
    });

    // xds.sock: 64 HTTP/2 connections, each answered with SETTINGS and kept; the 65th is
    // closed without a byte.
    let held: Vec<UnixStream> = (0..CAP)
        .map(|i| {
            let mut c = UnixStream::connect(node.xds_sock()).unwrap();
            assert!(
                http2_settings(&mut c),
                "xds.sock connection {i} under the cap was closed"
            );
            c
        })
        .collect();
    let mut past = UnixStream::connect(node.xds_sock()).unwrap();
    assert!(
        !http2_settings(&mut past),
        "the 65th xds.sock connection was served"
    );
    assert_eq!(
        wait_sample(&metrics, "aether_connections{socket=\"xds\"}", CAP as f64),
        CAP as f64
    );
    wait_sample(
        &metrics,
        "aether_connections_refused_total{socket=\"xds\"}",
        1.0,
    );
    drop(held);
    wait_for("xds.sock serving again", T, || {
        let mut c = UnixStream::connect(node.xds_sock()).ok()?;
        http2_settings(&mut c).then_some(())
    });
    assert!(Path::new(&agent.health_sock).exists());
}
