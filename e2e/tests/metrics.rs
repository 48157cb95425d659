//! The owner's `/metrics` by Prometheus' conventions, scraped from the real agent
//! (supervisor and worker, the worker as uid 65532 when run as root) with a real Envoy on
//! its `xds.sock` and pods added and deleted through the real `aether-cni` plugin: the
//! series dashboards and alerts are written against exist and hold sane values.
//!
//! Not a fault-matrix test. Its worker kill checks what the counter of respawns says of
//! the fault, and that the respawned worker still holds the pod it was given (no lost
//! pod) and not the one deleted (no phantom pod). Runs as any user; Envoy is needed, and
//! without it the test skips loudly.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aether_e2e::envoy::{Envoy, envoy_or_skip};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{
    Agent, LocalNode, bin, free_port, memory_kib, metric_sample, scrape_metrics, wait_for,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const T: Duration = Duration::from_secs(30);

/// The xDS types by the short name of `aether_xds_push_ack_seconds` and the type URL of
/// `aether_xds_pushes`.
const TYPES: [(&str, &str); 5] = [
    ("cds", "type.googleapis.com/envoy.config.cluster.v3.Cluster"),
    (
        "eds",
        "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
    ),
    (
        "lds",
        "type.googleapis.com/envoy.config.listener.v3.Listener",
    ),
    (
        "rds",
        "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
    ),
    (
        "sds",
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret",
    ),
];

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64()
}

/// The sample `series` in the latest scrape of `addr`, once there is one.
fn sample(addr: &str, series: &str) -> Option<f64> {
    scrape_metrics(addr).and_then(|t| metric_sample(&t, series))
}

/// The lines of a scrape that belong to the series this test is about.
fn new_series(text: &str) -> String {
    const NAMES: [&str; 10] = [
        "aether_build_info",
        "aether_worker_respawns",
        "aether_registry_reload_errors",
        "aether_cni_request_duration_seconds",
        "aether_xds_push_ack_seconds",
        "process_open_fds",
        "process_max_fds",
        "process_resident_memory_bytes",
        "process_cpu_seconds",
        "process_start_time_seconds",
    ];
    text.lines()
        .filter(|l| {
            NAMES
                .iter()
                .any(|n| l.starts_with(n) || l.starts_with(&format!("# TYPE {n} ")))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The worker's descriptors and soft descriptor limit, as the test sees them.
fn worker_fds(pid: i32) -> (usize, Option<u64>) {
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|r| r.split_whitespace().next()?.parse().ok());
    (open, soft)
}

fn write_inputs(root: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let registry = root.join("registry.json");
    let doc = serde_json::json!({ "services": [{ "name": "web", "namespace": "default", "ports": [80],
        "endpoints": [{ "address": "127.0.0.1", "port": 9, "pod": "web-0" }] }] });
    std::fs::write(&registry, doc.to_string()).expect("registry file");
    // Free capture ports, so that tests running beside this one do not clash on 15001 and 15006.
    let outbound = free_port(Ipv4Addr::LOCALHOST).expect("free port");
    let inbound = free_port(Ipv4Addr::UNSPECIFIED).expect("free port");
    let capture = root.join("capture.json");
    std::fs::write(
        &capture,
        serde_json::json!({ "outbound": format!("127.0.0.1:{outbound}"), "inbound_port": inbound })
            .to_string(),
    )
    .expect("capture file");
    (registry, capture)
}

fn start(node: &mut LocalNode, metrics: &str, capture: &Path) -> Agent {
    node.metrics = Some(metrics.parse().expect("a metrics address"));
    let capture = format!("--capture-file={}", capture.display());
    let agent = node.start_agent_with(&[&capture]);
    wait_for("the agent to serve as the owner", T, || {
        agent.serving_owner()
    });
    wait_for("the owner's metrics port", T, || scrape_metrics(metrics));
    agent
}

/// `aether_build_info`'s one sample: its labels (version, revision) and value.
fn build_info(text: &str) -> Option<(String, String, f64)> {
    let line = text.lines().find(|l| l.starts_with("aether_build_info{"))?;
    let (labels, value) = line.strip_prefix("aether_build_info{")?.rsplit_once("} ")?;
    let label = |k: &str| {
        labels
            .split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))?
            .strip_suffix('"')
            .map(str::to_string)
    };
    Some((label("version")?, label("revision")?, value.parse().ok()?))
}

#[test]
fn a_live_owner_serves_the_conventional_series_with_sane_values() {
    const NAME: &str = "a_live_owner_serves_the_conventional_series_with_sane_values";
    if envoy_or_skip(NAME).is_none() {
        return;
    }
    let started = now_s();
    let mut node = LocalNode::new();
    let (registry, capture) = write_inputs(node.root.path());
    node.registry_file = Some(registry);
    let addr = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("free port")
    );
    let owner = start(&mut node, &addr, &capture);
    let envoy = Envoy::start_on(&node, None).expect("Envoy, found above");
    envoy.wait_connected(T);

    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let kept = (
        PodId {
            uid: "metrics-kept-uid".into(),
            name: "kept".into(),
        },
        Ipv4Addr::new(10, 87, 0, 2),
    );
    let gone = (
        PodId {
            uid: "metrics-gone-uid".into(),
            name: "gone".into(),
        },
        Ipv4Addr::new(10, 87, 0, 3),
    );
    for (pod, ip) in [&kept, &gone] {
        cni.call("ADD", pod, Some(*ip))
            .unwrap_or_else(|e| panic!("ADD {}: {e}\n{}", pod.uid, owner.log()));
    }
    cni.call("DEL", &gone.0, None)
        .unwrap_or_else(|e| panic!("DEL {}: {e}\n{}", gone.0.uid, owner.log()));

    // The text is made at most once a second: wait for one made after the DEL and the
    // ACK of each type pushed.
    let text = wait_for(
        "a scrape with the DEL and every pushed type's ACK timed",
        T,
        || {
            let t = scrape_metrics(&addr)?;
            let del = metric_sample(
                &t,
                "aether_cni_request_duration_seconds_count{op=\"del\",result=\"ok\"}",
            )?;
            let acked = TYPES.iter().all(|(short, url)| {
                let pushed = metric_sample(
                    &t,
                    &format!("aether_xds_pushes_total{{type_url=\"{url}\"}}"),
                )
                .unwrap_or(0.0);
                pushed == 0.0
                    || metric_sample(
                        &t,
                        &format!("aether_xds_push_ack_seconds_count{{type=\"{short}\"}}"),
                    )
                    .unwrap_or(0.0)
                        > 0.0
            });
            (del >= 1.0 && acked).then_some(t)
        },
    );
    eprintln!(
        "--- the new series, from the first worker:\n{}\n---",
        new_series(&text)
    );
    let get = |series: &str| {
        metric_sample(&text, series).unwrap_or_else(|| panic!("no {series} in the scrape:\n{text}"))
    };

    let (version, revision, one) =
        build_info(&text).unwrap_or_else(|| panic!("no aether_build_info:\n{text}"));
    assert_eq!(
        (version.as_str(), one),
        (env!("CARGO_PKG_VERSION"), 1.0),
        "aether_build_info"
    );
    assert!(
        !revision.is_empty(),
        "aether_build_info has an empty revision"
    );

    // Two ADDs and a DEL, each answered ok, each timed within the worker's bounds.
    let count = |op: &str| {
        get(&format!(
            "aether_cni_request_duration_seconds_count{{op=\"{op}\",result=\"ok\"}}"
        ))
    };
    assert_eq!(
        (count("add"), count("del")),
        (2.0, 1.0),
        "CNI calls timed, by op"
    );
    for op in ["add", "del"] {
        let sum = get(&format!(
            "aether_cni_request_duration_seconds_sum{{op=\"{op}\",result=\"ok\"}}"
        ));
        // An ADD waits at most 2 s for the ACK; either is far below 10 s on any machine.
        assert!(
            sum > 0.0 && sum / count(op) < 10.0,
            "{op}: {sum} s over {} calls",
            count(op)
        );
        let inf = get(&format!(
            "aether_cni_request_duration_seconds_bucket{{le=\"+Inf\",op=\"{op}\",result=\"ok\"}}"
        ));
        assert_eq!(inf, count(op), "{op}: the +Inf bucket holds every call");
    }
    assert!(
        metric_sample(
            &text,
            "aether_cni_request_duration_seconds_count{op=\"add\",result=\"error\"}"
        )
        .is_none(),
        "no failed call"
    );

    // Every type pushed has its push-to-ACK time; CDS, EDS and LDS at least are pushed.
    let mut timed = Vec::new();
    for (short, url) in TYPES {
        let pushed = metric_sample(
            &text,
            &format!("aether_xds_pushes_total{{type_url=\"{url}\"}}"),
        )
        .unwrap_or(0.0);
        if pushed == 0.0 {
            continue;
        }
        let n = get(&format!(
            "aether_xds_push_ack_seconds_count{{type=\"{short}\"}}"
        ));
        let sum = get(&format!(
            "aether_xds_push_ack_seconds_sum{{type=\"{short}\"}}"
        ));
        assert!(
            n > 0.0 && n <= pushed,
            "{short}: {n} ACKs timed for {pushed} pushes"
        );
        assert!(
            sum >= 0.0 && sum / n < 10.0,
            "{short}: mean push to ACK {} s",
            sum / n
        );
        timed.push(format!("{short} {n} (mean {:.2} ms)", sum / n * 1e3));
    }
    for short in ["cds", "eds", "lds"] {
        assert!(
            timed.iter().any(|t| t.starts_with(short)),
            "{short} never pushed and ACKed: {timed:?}\n{text}"
        );
    }

    // The process metrics, against what the test reads of the worker itself.
    let worker = owner.worker_pid();
    let (fds, soft) = worker_fds(worker);
    let open = get("process_open_fds");
    assert!(
        open > 0.0 && (open - fds as f64).abs() <= 16.0_f64.max(fds as f64 / 2.0),
        "process_open_fds {open}, /proc/{worker}/fd has {fds}"
    );
    if let Some(soft) = soft {
        assert_eq!(
            get("process_max_fds"),
            soft as f64,
            "process_max_fds, the worker's soft limit"
        );
    }
    let rss = get("process_resident_memory_bytes");
    let (vm_rss_kib, _) = memory_kib(worker);
    let seen = vm_rss_kib as f64 * 1024.0;
    assert!(
        rss > 1024.0 * 1024.0 && rss > seen / 2.0 && rss < seen * 2.0,
        "process_resident_memory_bytes {rss}, VmRSS {seen}"
    );
    let cpu = get("process_cpu_seconds_total");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    assert!(
        cpu > 0.0 && cpu <= (now_s() - started) * cores + 1.0,
        "process_cpu_seconds_total {cpu}"
    );
    let start1 = get("process_start_time_seconds");
    // The boot time the kernel reports is whole seconds and may drift from the wall clock
    // by a few; the worker started after this test did.
    assert!(
        start1 > started - 10.0 && start1 < now_s() + 10.0,
        "process_start_time_seconds {start1}, test started {started}"
    );

    assert_eq!(get("aether_worker_respawns_total"), 0.0, "no respawn yet");
    for file in ["registry", "capture"] {
        assert_eq!(
            get(&format!(
                "aether_registry_reload_errors_total{{file=\"{file}\"}}"
            )),
            0.0,
            "{file} loaded"
        );
    }

    // A worker killed: the supervisor's next one counts it, and holds the same pods.
    kill(Pid::from_raw(worker), Signal::SIGKILL).expect("SIGKILL the worker");
    let respawned = wait_for("a new worker serving", T, || {
        owner
            .serving_owner()
            .filter(|v| v["pid"].as_i64() != Some(worker as i64))
    });
    let text = wait_for("the new worker's metrics to count the respawn", T, || {
        scrape_metrics(&addr)
            .filter(|t| metric_sample(t, "aether_worker_respawns_total") == Some(1.0))
    });
    eprintln!(
        "--- the new series, after the worker was killed:\n{}\n---",
        new_series(&text)
    );
    let start2 =
        metric_sample(&text, "process_start_time_seconds").expect("process_start_time_seconds");
    assert!(
        start2 >= start1,
        "the new worker ({}) started at {start2}, before the old one at {start1}",
        respawned["pid"]
    );
    cni.call("CHECK", &kept.0, Some(kept.1))
        .unwrap_or_else(|e| {
            panic!(
                "the respawned worker lost {}: {e}\n{}",
                kept.0.uid,
                owner.log()
            )
        });
    assert!(
        cni.call("CHECK", &gone.0, Some(gone.1)).is_err(),
        "the respawned worker holds {}, deleted before",
        gone.0.uid
    );

    // A capture file it cannot take: counted under its own file, the registry's untouched.
    // Renamed into place, so the watcher sees one broken file, never a half-written one.
    let broken = capture.with_extension("broken");
    std::fs::write(&broken, "{ not json").expect("write a broken capture file");
    std::fs::rename(&broken, &capture).expect("rename the broken capture file into place");
    wait_for("the rejected capture file counted", T, || {
        (sample(
            &addr,
            "aether_registry_reload_errors_total{file=\"capture\"}",
        ) == Some(1.0))
        .then_some(())
    });
    assert_eq!(
        sample(
            &addr,
            "aether_registry_reload_errors_total{file=\"registry\"}"
        ),
        Some(0.0),
        "the registry file loaded"
    );
    eprintln!(
        "cni: 2 ADD and 1 DEL timed; push to ACK: {}; worker {worker}: {open} fds (/proc says {fds}), {:.1} MiB resident, {cpu:.2} s CPU, started {:+.1} s from the test's start (the kernel's boot time is whole seconds); respawned as {}",
        timed.join(", "),
        rss / 1048576.0,
        start1 - started,
        respawned["pid"]
    );
}

/// The seed's rule: only the owner serves metrics. A standby given its own metrics address
/// binds nothing there while it waits for the lock; once it owns the node, it does.
#[test]
fn a_standby_binds_no_metrics_port_and_binds_it_once_it_owns_the_node() {
    let mut node = LocalNode::new();
    let (_, capture) = write_inputs(node.root.path());
    let owner_addr = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("free port")
    );
    let mut owner = start(&mut node, &owner_addr, &capture);
    let standby_addr = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("free port")
    );
    node.metrics = Some(standby_addr.parse().expect("a metrics address"));
    let capture_arg = format!("--capture-file={}", capture.display());
    let standby = node.start_agent_with(&[&capture_arg]);
    let ready = standby.wait_role("standby", T);
    assert_eq!(ready["phase"], "standby-complete", "{ready:#}");
    standby.wait_log("holding the owner's node sockets", T);
    assert!(
        std::net::TcpStream::connect(&standby_addr).is_err(),
        "a complete standby listens on its metrics address {standby_addr}\n{}",
        standby.log()
    );
    assert!(
        scrape_metrics(&owner_addr).is_some(),
        "the owner serves metrics"
    );

    owner.signal(Signal::SIGTERM);
    owner.wait_exit(T);
    wait_for("the new owner to serve", T, || standby.serving_owner());
    let text = wait_for("the new owner's metrics port", T, || {
        scrape_metrics(&standby_addr)
    });
    assert!(build_info(&text).is_some(), "{text}");
}
