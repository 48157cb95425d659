//! The machine's floor for the takeover's fd-passing step: one `Takeover` message with
//! three descriptors sent over a `SOCK_SEQPACKET` pair to a separate, idle process that
//! is blocked in `recvmsg`, as the standby worker is. Measures send to receive (the
//! receiver's wake-up included) against CLOCK_MONOTONIC, which both processes share.
//!
//! `cargo bench -p shared-proto --bench fd-passing-floor` (FLOOR_ROUNDS=N, default 500).
//! The sender pauses 1 to 8 ms between rounds so that the receiver is parked each time,
//! as a standby is; the pause does not count.
//!
//! Prints median, p90, p99 and max: the agent-side takeover cannot beat this figure's
//! tail on the same machine.

use std::io::{Read, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use nix::unistd::{ForkResult, fork, pipe};
use shared_proto::control::{Body, Takeover};
use shared_proto::fdpass;

fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `t`, which outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

fn main() {
    let rounds: usize = std::env::var("FLOOR_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let (parent_end, child_end) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .expect("socketpair");
    let (results_rx, results_tx) = pipe().expect("pipe");

    // SAFETY: the bench is single-threaded here; the child only uses async-signal-safe
    // syscalls through nix and std I/O on its own descriptors, then exits.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            drop(parent_end);
            drop(results_rx);
            let mut out = std::fs::File::from(results_tx);
            loop {
                match fdpass::recv_control(child_end.as_fd(), false) {
                    Ok((Body::Takeover(t), fds)) => {
                        let took = monotonic_ns().saturating_sub(t.sent_at_us);
                        drop(fds);
                        out.write_all(&took.to_le_bytes()).expect("write result");
                    }
                    _ => std::process::exit(0),
                }
            }
        }
        ForkResult::Parent { child } => {
            drop(child_end);
            drop(results_tx);
            let mut results = std::fs::File::from(results_rx);
            let fds: Vec<OwnedFd> = (0..3)
                .map(|_| {
                    // SAFETY: a fresh descriptor from dup(2) of stdin is owned by us alone.
                    unsafe { OwnedFd::from_raw_fd(libc::dup(0)) }
                })
                .collect();
            let mut seed = monotonic_ns() | 1;
            let mut took = Vec::with_capacity(rounds);
            for i in 0..rounds {
                // xorshift: a pause of 1 to 8 ms, so the receiver is parked.
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                std::thread::sleep(Duration::from_micros(1000 + seed % 7000));
                // sent_at carries CLOCK_MONOTONIC nanoseconds here, not wall-clock µs.
                let msg = Takeover {
                    generation: i as u64,
                    sent_at_us: monotonic_ns(),
                    ..Default::default()
                };
                let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
                fdpass::send_control(parent_end.as_fd(), Body::Takeover(msg), &borrowed)
                    .expect("send");
                let mut buf = [0u8; 8];
                results.read_exact(&mut buf).expect("read result");
                took.push(u64::from_le_bytes(buf) as f64 / 1e6);
                if (i + 1) % 100 == 0 {
                    eprintln!("fd-passing-floor: {}/{rounds}", i + 1);
                }
            }
            drop(parent_end);
            let _ = nix::sys::wait::waitpid(child, None);
            took.sort_by(f64::total_cmp);
            println!("fd passing to a parked process, {rounds} rounds (ms)");
            println!(
                "median {:.3}  p90 {:.3}  p99 {:.3}  max {:.3}",
                pct(&took, 0.5),
                pct(&took, 0.9),
                pct(&took, 0.99),
                took[took.len() - 1]
            );
        }
    }
}
