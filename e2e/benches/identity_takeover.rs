//! The takeover with workload identity on and off, interleaved in one run.
//!
//! `cargo bench -p aether-e2e --bench identity-takeover` (release profile; the agent's
//! binaries are built for it first unless `AETHER_BIN_DIR` is set). Needs Envoy
//! (`scripts/install-envoy.sh` or `ENVOY_BIN`).
//!
//! Two local nodes, each with a real Envoy on its `xds.sock` and `BENCH_PODS` pods (10)
//! added through the real `aether-cni`: one whose agents run with identity from the test
//! identity provider (`--spiffe-endpoint`, `--spiffe-broker-endpoint`, permissive mTLS;
//! every pod holds its SVID), one without. The rolls alternate between them, one surge
//! roll on the identity node, one on the other, `ARG_ROLLS` (20) times each: start a
//! standby, wait until it is complete, SIGTERM the owner, wait until the standby serves
//! as owner and Envoy is on its stream. No pod is added during the overlap, so the
//! reconcile adds nothing and the takeover's SVID wait waits for nothing.
//!
//! Per mode, from the new owner's `/ready` (`takeover`, as `bench-takeover` reads it):
//! the takeover's own time (`total_us`: lock acquired to serving on the passed sockets)
//! and its SVID wait (`svid_wait_us`), median and p99, side by side with the difference.
//! The expectation: medians within 0.2 ms of each other, p99 of the total at most 2 ms.
//! The last stdout line is one JSON object.
//!
//! `BENCH_COMPARE=twins` compares the QUIC twins' cost instead: both nodes run with
//! identity, one also with `--quic-twin-addr` so that every pod holding its SVID has a
//! twin, the other without. Run it with `BENCH_PODS=110` (a full node); the expectation is
//! then medians within 0.5 ms.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use aether_e2e::envoy::{self, AdsApi, CONNECTED, NodeRig};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::testing::{
    self, identity_args, identity_provider_for_agents, percentile, try_wait_for,
};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(15);
const TD: &str = "example.org";

/// One node of the run.
struct Side {
    name: &'static str,
    rig: NodeRig,
    /// Per roll, from the new owner's `/ready`: (total, svid_wait) in ms.
    total: Vec<f64>,
    svid_wait: Vec<f64>,
    reconcile: Vec<f64>,
}

impl Side {
    fn new(
        name: &'static str,
        envoy_bin: &std::path::Path,
        args: &[String],
        pods: usize,
        net: u8,
    ) -> Side {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let rig = NodeRig::start_with(envoy_bin, AdsApi::Delta, &args);
        let cni = Cni {
            bin: testing::bin("aether-cni"),
            socket: rig.node.cni_sock(),
        };
        for n in 0..pods {
            let pod = PodId {
                uid: format!("{name}-pod-{n:03}-uid"),
                name: format!("{name}-{n}"),
            };
            let ip = Ipv4Addr::new(10, net, (1 + n / 250) as u8, (1 + n % 250) as u8);
            cni.call("ADD", &pod, Some(ip))
                .unwrap_or_else(|e| panic!("{name}: CNI ADD of {}: {e}", pod.uid));
        }
        Side {
            name,
            rig,
            total: Vec::new(),
            svid_wait: Vec::new(),
            reconcile: Vec::new(),
        }
    }

    /// One surge roll; the new owner's `/ready` as first seen serving.
    fn roll(&mut self) -> Value {
        let since = Instant::now();
        let next = self.rig.start_agent();
        next.wait_role("standby", T);
        self.rig.owner.signal(Signal::SIGTERM);
        let ready = try_wait_for(
            &format!("{}: {} to serve as owner", self.name, next.name),
            T,
            || next.serving_owner(),
        )
        .unwrap_or_else(|e| panic!("{e}\n{}", self.rig.where_to_look()));
        let mut old = std::mem::replace(&mut self.rig.owner, next);
        let status = old.wait_exit(T);
        assert!(
            status.success(),
            "{}: {} exited {status}",
            self.name,
            old.name
        );
        self.rig.wait_reconnected(since, self.name);
        try_wait_for("Envoy connected", T, || {
            (self.rig.envoy.stat(CONNECTED) == Some(1)).then_some(())
        })
        .expect("Envoy reconnected");
        let ms = |k: &str| {
            ready["takeover"][k]
                .as_f64()
                .unwrap_or_else(|| panic!("no takeover.{k} in /ready: {ready:#}"))
                / 1e3
        };
        self.total.push(ms("total_us"));
        self.svid_wait.push(ms("svid_wait_us"));
        self.reconcile.push(ms("reconcile_us"));
        assert_eq!(
            ready["takeover"]["svid_wait_missed"], 0,
            "{}: {ready:#}",
            self.name
        );
        ready
    }
}

fn p(v: &[f64], q: f64) -> f64 {
    percentile(v, q).unwrap_or(f64::NAN)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!(
            "identity-takeover: run with `cargo bench -p aether-e2e --bench identity-takeover`; skipping"
        );
        return;
    }
    let Some(envoy_bin) = envoy::envoy_bin() else {
        eprintln!("identity-takeover: no Envoy; run scripts/install-envoy.sh or set ENVOY_BIN");
        std::process::exit(2);
    };
    testing::build_agent_bins();
    let rolls = testing::env_usize("ARG_ROLLS", 20).max(1);
    let pods = testing::env_usize("BENCH_PODS", 10);

    let twins = match std::env::var("BENCH_COMPARE").as_deref() {
        Ok("twins") => true,
        Ok("identity") | Err(_) => false,
        Ok(other) => panic!("BENCH_COMPARE={other:?}: expected identity or twins"),
    };
    let (_idp_dir, idp) = identity_provider_for_agents(TD);
    let identity = identity_args(&idp, "permissive");
    let (mut on, mut off) = if twins {
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .and_then(|s| s.local_addr())
            .expect("a free UDP port")
            .port();
        let mut with_twins = identity.clone();
        with_twins.push(format!("--quic-twin-addr=127.0.0.1:{port}"));
        (
            Side::new("twins", &envoy_bin, &with_twins, pods, 88),
            Side::new("identity", &envoy_bin, &identity, pods, 89),
        )
    } else {
        (
            Side::new("identity", &envoy_bin, &identity, pods, 88),
            Side::new("plain", &envoy_bin, &[], pods, 89),
        )
    };
    // Every pod of the identity node holds its SVID before the first roll.
    for side in if twins { vec![&on, &off] } else { vec![&on] } {
        try_wait_for(
            &format!("every pod's SVID on the {} node", side.name),
            T,
            || {
                let v = side.rig.owner.ready()?.1;
                (v["identity"]["pods_with_svid"] == pods as u64
                    && v["identity"]["pods_without_svid_count"] == 0)
                    .then_some(())
            },
        )
        .expect("the pods' SVIDs");
    }
    if twins {
        // Every pod has its twin in Envoy before the first roll.
        try_wait_for("a twin for every pod", T, || {
            let dump = serde_json::from_str(&on.rig.config_dump()).ok()?;
            (aether_e2e::quic::listeners(&dump).0.len() == pods).then_some(())
        })
        .expect("the twins");
    }

    eprintln!("identity-takeover: {rolls} surge rolls per mode, interleaved; {pods} pods per node");
    for i in 1..=rolls {
        for side in [&mut on, &mut off] {
            side.roll();
            eprintln!(
                "roll {i:>3}/{rolls} {:<8} takeover {:>8.3} ms  svid_wait {:>7.3} ms  reconcile {:>7.3} ms",
                side.name,
                side.total.last().unwrap(),
                side.svid_wait.last().unwrap(),
                side.reconcile.last().unwrap()
            );
        }
    }

    let v = on
        .rig
        .owner
        .ready()
        .expect("the identity node's owner answers")
        .1;
    assert_eq!(
        v["identity"]["pods_with_svid"], pods as u64,
        "the identity node's pods kept their SVIDs: {v:#}"
    );

    println!(
        "identity-takeover: {rolls} surge rolls per mode, interleaved; {pods} pods per node; figures in ms from /ready's takeover times"
    );
    println!(
        "{:<34} {:>10} {:>10} {:>12}",
        "", on.name, off.name, "difference"
    );
    let row =
        |name: &str, a: f64, b: f64| println!("{name:<34} {a:>10.3} {b:>10.3} {:>+12.3}", a - b);
    row(
        "takeover total (lock->serving) p50",
        p(&on.total, 50.0),
        p(&off.total, 50.0),
    );
    row(
        "takeover total (lock->serving) p99",
        p(&on.total, 99.0),
        p(&off.total, 99.0),
    );
    row(
        "  of which svid_wait p50",
        p(&on.svid_wait, 50.0),
        p(&off.svid_wait, 50.0),
    );
    row(
        "  of which svid_wait p99",
        p(&on.svid_wait, 99.0),
        p(&off.svid_wait, 99.0),
    );
    row(
        "  of which reconcile p50",
        p(&on.reconcile, 50.0),
        p(&off.reconcile, 50.0),
    );
    row(
        "  of which reconcile p99",
        p(&on.reconcile, 99.0),
        p(&off.reconcile, 99.0),
    );
    let median_diff = p(&on.total, 50.0) - p(&off.total, 50.0);
    let p99_on = p(&on.total, 99.0);
    let (met, expectation) = if twins {
        (median_diff.abs() <= 0.5, "medians within 0.5 ms")
    } else {
        (
            median_diff.abs() <= 0.2 && p99_on <= 2.0,
            "medians within 0.2 ms, identity p99 <= 2 ms",
        )
    };
    println!(
        "expectation ({expectation}): {} (median difference {median_diff:+.3} ms, {} p99 {p99_on:.3} ms)",
        if met { "met" } else { "NOT met" },
        on.name
    );
    let r = |x: f64| (x * 1000.0).round() / 1000.0;
    println!(
        "{}",
        json!({
            "bench": "identity-takeover",
            "compare": if twins { "twins" } else { "identity" },
            "rolls_per_mode": rolls,
            "pods": pods,
            on.name: {"total_p50_ms": r(p(&on.total, 50.0)), "total_p99_ms": r(p(&on.total, 99.0)), "svid_wait_p50_ms": r(p(&on.svid_wait, 50.0)), "svid_wait_p99_ms": r(p(&on.svid_wait, 99.0))},
            off.name: {"total_p50_ms": r(p(&off.total, 50.0)), "total_p99_ms": r(p(&off.total, 99.0)), "svid_wait_p50_ms": r(p(&off.svid_wait, 50.0)), "svid_wait_p99_ms": r(p(&off.svid_wait, 99.0))},
            "total_p50_diff_ms": r(median_diff),
            "total_p99_diff_ms": r(p99_on - p(&off.total, 99.0)),
            "expectation_met": met,
        })
    );
    on.rig.pass();
    off.rig.pass();
}
