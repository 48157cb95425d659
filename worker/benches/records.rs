//! A scan of the pod records folder, as a standby's look at the owner's writes and the
//! takeover's reload make it: every record read and decoded (a fresh `Storage::open`),
//! against the same folder scanned again once its files are settled, when each entry's
//! `stat` shows the file read before and the record is taken unread (`storage::SETTLE`).
//!
//!   cargo bench -p aether-worker --bench records
//!   AETHER_BENCH_ROUNDS=200 cargo bench -p aether-worker --bench records
//!
//! Prints, per folder size (110 pods, a node's default maximum; 700, what the gate's churn
//! leaves after 20 rolls; 2,000), the median, p90 and maximum over the rounds of each,
//! and their ratio. The folder is on the temp dir's file system, in the page cache.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use aether_model::Pod;
use aether_worker::metrics::Metrics;
use aether_worker::storage::{SETTLE, Storage};

fn pod(i: usize) -> Pod {
    Pod {
        uid: format!("pod-{i:05}-uid"),
        namespace: "churn".into(),
        name: format!("churn-{i}"),
        container_id: format!("ctr-pod-{i:05}-uid"),
        netns: "/proc/self/ns/net".into(),
        ifname: "eth0".into(),
        ips: vec![IpAddr::from([10, 88, (i / 250) as u8, (i % 250) as u8 + 1])],
        terminating: false,
        no_quic_twin: false,
    }
}

fn summary(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((p * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)];
    (at(0.5), at(0.9), v[v.len() - 1])
}

fn main() {
    let rounds: usize = std::env::var("AETHER_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    println!("pod records scan, {rounds} rounds each, ms (median / p90 / max)");
    println!(
        "{:>6} {:>26} {:>26} {:>8}",
        "pods", "every record read", "settled, taken unread", "ratio"
    );
    for n in [110, 700, 2000] {
        let dir = tempfile::tempdir().expect("a temp dir");
        let owner = Storage::open(dir.path(), Metrics::new()).expect("open the folder");
        let pods: Vec<Pod> = (0..n).map(pod).collect();
        for r in owner.put_all(&pods) {
            r.expect("write a record");
        }
        let written = Instant::now();
        let mut full = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            let s = Storage::open(dir.path(), Metrics::new()).expect("open the folder");
            full.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(s.pods().len(), n);
        }
        // Setup, not synchronisation: a record is taken unread only once its file is
        // SETTLE old when read.
        std::thread::sleep((SETTLE + Duration::from_millis(50)).saturating_sub(written.elapsed()));
        let metrics = Metrics::new();
        let standby = Storage::open(dir.path(), metrics.clone()).expect("open the folder");
        standby
            .follow()
            .expect("a first look, which reads every record");
        let mut unread = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t = Instant::now();
            let diff = standby.follow().expect("a look");
            unread.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(diff.is_empty());
        }
        let (a, b) = (summary(&mut full), summary(&mut unread));
        println!(
            "{n:>6} {:>26} {:>26} {:>7.1}x",
            format!("{:.3} / {:.3} / {:.3}", a.0, a.1, a.2),
            format!("{:.3} / {:.3} / {:.3}", b.0, b.1, b.2),
            a.0 / b.0
        );
    }
}
