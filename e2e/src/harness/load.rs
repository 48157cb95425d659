//! Steady open-loop HTTP load through Envoy's outbound listener. One connection per
//! request (`Connection: close`), so that a failure is always a real one: a refused or
//! reset connection, a timeout, or a non-2xx answer. Keep-alive would add false failures
//! from a server closing an idle connection while a request is in flight.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub failures: AtomicU64,
    /// Requests that started more than 50 ms behind their schedule (the load machine
    /// itself stalled).
    pub late: AtomicU64,
    /// The first failures, for the report: (when, host, what).
    pub failure_log: Mutex<Vec<(Instant, String, String)>>,
}

pub struct Load {
    pub counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(target: SocketAddr, hosts: Vec<String>, rps: u32) -> Load {
        let counters = Arc::new(Counters::default());
        let stop = Arc::new(AtomicBool::new(false));
        let rps = rps.max(1);
        let n = (rps / 25).clamp(1, 8);
        let interval = Duration::from_secs_f64(n as f64 / rps as f64);
        let start = Instant::now();
        let threads = (0..n)
            .map(|i| {
                let (counters, stop, hosts) = (counters.clone(), stop.clone(), hosts.clone());
                std::thread::Builder::new()
                    .name(format!("load-{i}"))
                    .spawn(move || {
                        let mut next = start + interval.mul_f64(i as f64 / n as f64);
                        let mut k = i as usize;
                        while !stop.load(Ordering::Relaxed) {
                            let now = Instant::now();
                            if next > now {
                                std::thread::sleep(next - now);
                            } else if now - next > Duration::from_millis(50) {
                                counters.late.fetch_add(1, Ordering::Relaxed);
                                next = now;
                            }
                            next += interval;
                            let host = &hosts[k % hosts.len()];
                            k += 1;
                            counters.requests.fetch_add(1, Ordering::Relaxed);
                            if let Err(what) = request(target, host) {
                                counters.failures.fetch_add(1, Ordering::Relaxed);
                                let mut log = counters.failure_log.lock().unwrap();
                                if log.len() < 50 {
                                    log.push((Instant::now(), host.clone(), what));
                                }
                            }
                        }
                    })
                    .expect("spawn load thread")
            })
            .collect();
        Load {
            counters,
            stop,
            threads,
        }
    }

    pub fn requests(&self) -> u64 {
        self.counters.requests.load(Ordering::Relaxed)
    }
    pub fn failures(&self) -> u64 {
        self.counters.failures.load(Ordering::Relaxed)
    }

    pub fn stop(mut self) -> Arc<Counters> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.counters.clone()
    }
}

/// One GET through the proxy; Ok on a 2xx answer.
pub fn request(target: SocketAddr, host: &str) -> Result<(), String> {
    let text = exchange(target, host)?;
    let status = status_of(&text);
    if (200..300).contains(&status) {
        Ok(())
    } else {
        let first = text.lines().next().unwrap_or("");
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        Err(format!(
            "status {status} ({first:?}, body {:?})",
            body.chars().take(120).collect::<String>()
        ))
    }
}

/// One GET through the proxy: (status, body) of whatever it answered.
pub fn get(target: SocketAddr, host: &str) -> Result<(u16, String), String> {
    let text = exchange(target, host)?;
    Ok((
        status_of(&text),
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    ))
}

/// Sends `GET /` with `Host: host` on a new connection and reads the answer to its end.
fn exchange(target: SocketAddr, host: &str) -> Result<String, String> {
    let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok();
    s.set_write_timeout(Some(Duration::from_secs(5))).ok();
    s.set_nodelay(true).ok();
    s.write_all(format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::with_capacity(512);
    s.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

fn status_of(text: &str) -> u16 {
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}
