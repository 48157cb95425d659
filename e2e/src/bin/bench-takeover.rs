//! Benchmark: the agent-side takeover and the standby-to-owner time seen from outside.
//!
//! `cargo run --release -p aether-e2e --bin bench-takeover -- [ROLLS]` (default 50).
//! Per roll: start a standby, wait until it is a complete standby, end the owner
//! (alternately SIGTERM, and SIGKILL of the whole generation), then poll the standby's
//! `/ready` until it answers as owner and both sockets accept. Prints:
//! - agent-side takeover: lock acquired to serving on the passed descriptors, as the
//!   worker reports it in `/ready` (`takeover.total_us`), and its parts;
//! - outside view: from the signal to `/ready` = owner and both sockets accepting.

use std::time::{Duration, Instant};

use aether_e2e::testing::{LocalNode, accepts};
use nix::sys::signal::Signal;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[i.min(v.len() - 1)]
}

fn main() {
    let rolls: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let t = Duration::from_secs(10);
    let mut node = LocalNode::new();
    let mut owner = node.start_agent();
    owner.wait_role("owner", t);
    let (mut total, mut fdpass, mut bind) = (Vec::new(), Vec::new(), Vec::new());
    let (mut outside_term, mut outside_kill) = (Vec::new(), Vec::new());
    for i in 0..rolls {
        let next = node.start_agent();
        next.wait_role("standby", t);
        let kill = i % 2 == 1;
        let start = Instant::now();
        if kill {
            owner.kill_generation();
        } else {
            owner.signal(Signal::SIGTERM);
        }
        let ready = aether_e2e::testing::wait_for("new owner", t, || {
            next.ready()
                .filter(|(s, v)| *s == 200 && v["role"] == "owner")
                .filter(|_| accepts(&node.xds_sock()) && accepts(&node.cni_sock()))
                .map(|(_, v)| v)
        });
        let outside = start.elapsed().as_secs_f64() * 1e3;
        if kill {
            outside_kill.push(outside)
        } else {
            outside_term.push(outside)
        }
        let tk = &ready["takeover"];
        total.push(tk["total_us"].as_f64().unwrap_or(f64::NAN) / 1e3);
        fdpass.push(tk["fd_passing_us"].as_f64().unwrap_or(f64::NAN) / 1e3);
        bind.push(tk["bind_us"].as_f64().unwrap_or(f64::NAN) / 1e3);
        eprintln!(
            "roll {:>3}/{rolls}: {} takeover {:.3} ms, outside {:.1} ms, handed_off={}",
            i + 1,
            if kill { "SIGKILL" } else { "SIGTERM" },
            total[i],
            outside,
            tk["handed_off"]
        );
        owner.wait_exit(t);
        owner = next;
    }
    println!("takeovers: {rolls}");
    println!("{:<44} {:>9} {:>9}", "figure (ms)", "median", "p99");
    for (name, v) in [
        ("agent-side takeover (lock -> serving)", &mut total),
        ("  of which bind or handoff check", &mut bind),
        ("  of which fd passing", &mut fdpass),
        (
            "outside: SIGTERM -> owner, sockets accept",
            &mut outside_term,
        ),
        (
            "outside: SIGKILL -> owner, sockets accept",
            &mut outside_kill,
        ),
    ] {
        if !v.is_empty() {
            println!("{:<44} {:>9.3} {:>9.3}", name, pct(v, 50.0), pct(v, 99.0));
        }
    }
}
