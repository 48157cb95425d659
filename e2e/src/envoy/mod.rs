//! A real Envoy for the tests, the benchmarks and the restart-gap harness: where the binary
//! is, one process type started from the project's bootstrap template (rendered by
//! `aether_worker::bootstrap::render`) with its admin endpoint on a pipe, the admin
//! client, and readers for Envoy's stats and config dump. Built on them:
//!
//! - [`Poller`], the 2 ms stats poller, and [`analyze`], which times a roll from it;
//! - [`NodeRig`], a local node of real agent processes with an Envoy on its `xds.sock`;
//! - [`WorkerRig`], the worker's node, watchers and ADS server in this process with an
//!   Envoy on them, for the xDS tests and the benchmarks.
//!
//! Envoy comes from `ENVOY_BIN`, else the project virtualenv that
//! `scripts/install-envoy.sh` fills; without either, tests skip loudly
//! ([`envoy_or_skip`]).

pub mod ack_log;
pub mod log_times;
mod node_rig;
mod poller;
mod worker_rig;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use aether_worker::bootstrap::{self, Admin};
use serde_json::Value;

use crate::testing::{
    HttpTarget, LocalNode, Netns, http_get, try_wait_for, wait_for, workspace_root,
};

pub use aether_worker::bootstrap::AdsApi;
pub use node_rig::{NodeRig, Relay};
pub use poller::{
    CONNECT_FAIL, CONNECTED, POLL_PERIOD, Poller, RollTimes, STREAM_FAILURES, Sample, UPDATE_TIMES,
    analyze, poll_queries,
};
pub use worker_rig::{
    RigOptions, ServiceSpec, WorkerRig, captured_logs, init_logs, registry_json, same_versions,
};

/// The Envoy binary: `ENVOY_BIN` (which must name a file), else the one
/// `scripts/install-envoy.sh` installs into the project's `.venv`.
pub fn envoy_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "ENVOY_BIN={} is not a file", p.display());
        return Some(p);
    }
    let venv = workspace_root().join(".venv");
    if let Ok(libs) = std::fs::read_dir(venv.join("lib")) {
        for lib in libs.flatten() {
            let p = lib.path().join("site-packages/envoy/_bin/envoy");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let p = venv.join("bin/envoy");
    p.is_file().then_some(p)
}

/// The Envoy binary, or None after saying loudly why `test` is skipped.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let found = envoy_bin();
    if found.is_none() {
        eprintln!(
            "\n!!! SKIPPED {test}: no Envoy. Run scripts/install-envoy.sh or set ENVOY_BIN. CI installs it, so there this test runs. !!!\n"
        );
    }
    found
}

/// An Envoy process; killed when dropped.
pub struct Envoy {
    child: Child,
    pub admin: PathBuf,
    pub log: PathBuf,
}

impl Envoy {
    /// Renders the bootstrap into `dir` (admin pipe, config and log file there) and starts
    /// Envoy against `run_dir`'s xds.sock. As deployed, Envoy keeps no stats for the
    /// mesh's clusters and virtual hosts (the template's `stats_config`).
    pub fn start(
        bin: &Path,
        dir: &Path,
        run_dir: &Path,
        base: Duration,
        max: Duration,
        api: AdsApi,
    ) -> std::io::Result<Envoy> {
        Self::start_with_args(bin, dir, run_dir, (base, max), api, &[])
    }

    /// [`Envoy::start`] with `extra` arguments after the common ones (e.g. `--config-yaml`
    /// to merge more into the bootstrap).
    pub fn start_with_args(
        bin: &Path,
        dir: &Path,
        run_dir: &Path,
        (base, max): (Duration, Duration),
        api: AdsApi,
        extra: &[&std::ffi::OsStr],
    ) -> std::io::Result<Envoy> {
        let admin = dir.join("envoy-admin.sock");
        let config = bootstrap::render(
            run_dir,
            &Admin::Pipe(admin.clone()),
            "test-node",
            base,
            max,
            api,
        );
        let config_path = dir.join("envoy.yaml");
        std::fs::write(&config_path, config)?;
        let log = dir.join("envoy.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin);
        cmd.arg("-c").arg(&config_path).args([
            "--disable-hot-restart",
            "--concurrency",
            "2",
            "--log-level",
            "info",
            // Access logs (a pod's inbound, with --inbound-access-log) reach their file
            // within 100 ms rather than Envoy's default 10 s.
            "--file-flush-interval-msec",
            "100",
        ]);
        // AETHER_E2E_ENVOY_DRAIN_S sets `--drain-time-s` (Envoy's default, 600 s, as the
        // chart runs it, holds a removed listener that long): for soaks that measure what
        // Envoy keeps once drains end.
        if let Ok(seconds) = std::env::var("AETHER_E2E_ENVOY_DRAIN_S") {
            cmd.args(["--drain-time-s", &seconds]);
        }
        // AETHER_E2E_ENVOY_LOG sets component log levels (e.g. `config:debug,http2:debug`),
        // logged with microsecond timestamps, to trace a roll inside Envoy.
        if let Ok(levels) = std::env::var("AETHER_E2E_ENVOY_LOG") {
            cmd.args([
                "--component-log-level",
                &levels,
                "--log-format",
                "[%H:%M:%S.%f][%t][%l][%n] %v",
            ]);
        }
        // Its log's clock in UTC, as the harness reads it against the wall clock.
        let child = cmd
            .args(extra)
            .env("TZ", "UTC")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        Ok(Envoy { child, admin, log })
    }

    /// An Envoy against `node`'s xds.sock with the seed's ADS backoff (0.1 s base, 1 s
    /// max), in `<node>/envoy/`. With `netns`, Envoy runs inside that namespace, so its
    /// listeners (the inbound one binds 0.0.0.0) stay out of the machine's own. None when
    /// no Envoy is installed.
    pub fn start_on(node: &LocalNode, netns: Option<&Netns>) -> Option<Envoy> {
        let envoy = envoy_bin()?;
        let dir = node.root.path().join("envoy");
        std::fs::create_dir_all(&dir).expect("envoy dir");
        let bin = match netns {
            // `ip netns exec` execs Envoy in place (no fork), so the child's pid is Envoy's.
            Some(ns) => {
                let wrapper = dir.join("envoy-in-netns");
                let script = format!(
                    "#!/bin/sh\nexec ip netns exec '{}' '{}' \"$@\"\n",
                    ns.name,
                    envoy.display()
                );
                std::fs::write(&wrapper, script).expect("write the netns wrapper");
                std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
                    .expect("chmod wrapper");
                wrapper
            }
            None => envoy,
        };
        let envoy = Envoy::start(
            &bin,
            &dir,
            &node.run_dir,
            bootstrap::DEFAULT_BACKOFF_BASE,
            bootstrap::DEFAULT_BACKOFF_MAX,
            AdsApi::default(),
        )
        .expect("start Envoy");
        Some(envoy)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_none()
    }

    /// GET `path` from the admin endpoint: (status, body).
    pub fn get(&self, path: &str) -> std::io::Result<(u16, String)> {
        admin_get(&self.admin, path)
    }

    /// The counters and gauges named (exactly), a missing one as 0 (Envoy creates some
    /// lazily, and `usedonly` leaves out those never written); None while the admin does
    /// not answer 200.
    pub fn stats(&self, names: &[&str]) -> Option<BTreeMap<String, u64>> {
        let got = self.query_stats(names)?;
        Some(
            names
                .iter()
                .map(|n| {
                    (
                        n.to_string(),
                        got.iter().find(|(k, _)| k == n).map_or(0, |(_, v)| *v),
                    )
                })
                .collect(),
        )
    }

    /// One counter or gauge by exact name; None when Envoy has no such stat or its admin
    /// does not answer 200.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.query_stats(&[name])?
            .into_iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    fn query_stats(&self, names: &[&str]) -> Option<Vec<(String, u64)>> {
        match self.get(&format!("/stats?filter={}", exact_names(names))) {
            Ok((200, body)) => Some(parse_stats(&body)),
            _ => None,
        }
    }

    /// Waits until Envoy holds an ADS stream and has taken a listener update on it.
    pub fn wait_connected(&self, timeout: Duration) {
        wait_for(
            &format!("Envoy connected to the agent (log {})", self.log.display()),
            timeout,
            || {
                (self.stat(CONNECTED) == Some(1)
                    && self
                        .stat("listener_manager.lds.update_success")
                        .unwrap_or(0)
                        >= 1)
                    .then_some(())
            },
        );
    }

    /// Everything Envoy has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET from Envoy's admin over its pipe: (status, body), through the tests' one client
/// ([`crate::testing::http_get`]) in HTTP/1.1 (Envoy's admin answers HTTP/1.0 with 426).
pub fn admin_get(sock: &Path, path: &str) -> std::io::Result<(u16, String)> {
    http_get(HttpTarget::Unix(sock), "1.1", path, Duration::from_secs(5))
}

/// Percent-encodes a query value.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A percent-encoded regex matching exactly `names` (which may hold regex syntax, such as
/// the `|` of `cluster.outbound|80||web.default.update_success`).
pub fn exact_names(names: &[&str]) -> String {
    let escape = |n: &str| -> String {
        n.chars()
            .flat_map(|c| {
                if "\\.|()[]{}^$*+?".contains(c) {
                    vec!['\\', c]
                } else {
                    vec![c]
                }
            })
            .collect()
    };
    encode(&format!(
        "^({})$",
        names
            .iter()
            .map(|n| escape(n))
            .collect::<Vec<_>>()
            .join("|")
    ))
}

/// Parses Envoy's text stats (`name: value` lines); histograms are left out.
pub fn parse_stats(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(k, v)| v.trim().parse().ok().map(|v| (k.trim().to_string(), v)))
        .collect()
}

// ---- config_dump readers ----

fn dump_of<'a>(dump: &'a Value, kind: &str) -> Option<&'a Value> {
    dump["configs"].as_array()?.iter().find(|c| {
        c["@type"]
            .as_str()
            .is_some_and(|t| t.rsplit('.').next() == Some(kind))
    })
}

/// Names of the dynamic active clusters and the CDS version.
pub fn clusters(dump: &Value) -> (Vec<String>, String) {
    let Some(c) = dump_of(dump, "ClustersConfigDump") else {
        return (vec![], String::new());
    };
    let names = c["dynamic_active_clusters"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x["cluster"]["name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    (
        names,
        c["version_info"].as_str().unwrap_or_default().to_string(),
    )
}

/// Active listeners by name, with the LDS version.
pub fn listeners(dump: &Value) -> (Vec<(String, Value)>, String) {
    let Some(c) = dump_of(dump, "ListenersConfigDump") else {
        return (vec![], String::new());
    };
    let ls = c["dynamic_listeners"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| {
                    Some((
                        x["name"].as_str()?.to_string(),
                        x["active_state"]["listener"].clone(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    (
        ls,
        c["version_info"].as_str().unwrap_or_default().to_string(),
    )
}

/// The RDS route configuration `name`: (version, domains of every virtual host).
pub fn route(dump: &Value, name: &str) -> Option<(String, Vec<String>)> {
    let c = dump_of(dump, "RoutesConfigDump")?;
    let r = c["dynamic_route_configs"]
        .as_array()?
        .iter()
        .find(|r| r["route_config"]["name"] == name)?;
    let domains = r["route_config"]["virtual_hosts"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .flat_map(|v| v["domains"].as_array().cloned().unwrap_or_default())
                .filter_map(|d| d.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    Some((
        r["version_info"].as_str().unwrap_or_default().to_string(),
        domains,
    ))
}

/// The EDS endpoints of `cluster` as "addr:port HEALTH", sorted.
pub fn endpoints(dump: &Value, cluster: &str) -> Option<Vec<String>> {
    let c = dump_of(dump, "EndpointsConfigDump")?;
    let e = c["dynamic_endpoint_configs"]
        .as_array()?
        .iter()
        .find(|e| e["endpoint_config"]["cluster_name"] == cluster)?;
    Some(load_assignment_lines(&e["endpoint_config"]))
}

/// A load assignment's endpoints (a `ClusterLoadAssignment` as the config dump shows it)
/// as "addr:port HEALTH", sorted.
pub fn load_assignment_lines(assignment: &Value) -> Vec<String> {
    let mut out: Vec<String> = assignment["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| l["lb_endpoints"].as_array().cloned().unwrap_or_default())
        .map(|lb| {
            let sa = &lb["endpoint"]["address"]["socket_address"];
            format!(
                "{}:{} {}",
                sa["address"].as_str().unwrap_or("?"),
                sa["port_value"].as_u64().unwrap_or(0),
                lb["health_status"].as_str().unwrap_or("UNKNOWN")
            )
        })
        .collect();
    out.sort();
    out
}

/// What Envoy serves for local pods, from `/config_dump`: per inbound filter chain (named
/// by pod uid) of the active `inbound|<uid>` listeners, its match prefixes (`ip/len`), and the
/// set of active `inbound|<uid>` clusters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct EnvoyPods {
    pub chains: BTreeMap<String, Vec<String>>,
    pub clusters: BTreeSet<String>,
}

impl EnvoyPods {
    /// Reads the config dump; None while the admin does not answer.
    pub fn read(envoy: &Envoy) -> Option<EnvoyPods> {
        let (status, body) = envoy.get("/config_dump").ok()?;
        if status != 200 {
            return None;
        }
        Some(Self::parse(&serde_json::from_str(&body).ok()?))
    }

    pub fn parse(dump: &Value) -> EnvoyPods {
        let mut out = EnvoyPods::default();
        for config in dump["configs"].as_array().into_iter().flatten() {
            for l in config["dynamic_listeners"].as_array().into_iter().flatten() {
                // Each pod has its own virtual listener `inbound|<uid>` (the capture
                // listener `inbound` only hands connections over).
                if !l["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("inbound|"))
                {
                    continue;
                }
                for chain in l["active_state"]["listener"]["filter_chains"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    let Some(name) = chain["name"].as_str() else {
                        continue;
                    };
                    let prefixes = chain["filter_chain_match"]["prefix_ranges"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|r| {
                            Some(format!(
                                "{}/{}",
                                r["address_prefix"].as_str()?,
                                r["prefix_len"].as_u64()?
                            ))
                        })
                        .collect();
                    out.chains.insert(name.to_string(), prefixes);
                }
            }
            for c in config["dynamic_active_clusters"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if let Some(name) = c["cluster"]["name"]
                    .as_str()
                    .filter(|n| n.starts_with("inbound|"))
                {
                    out.clusters.insert(name.to_string());
                }
            }
        }
        out
    }

    /// Polls the config dump until it shows exactly `want`, for at most `timeout`; the
    /// last view seen when it never did.
    pub fn wait_until(envoy: &Envoy, want: &EnvoyPods, timeout: Duration) -> Result<(), EnvoyPods> {
        let mut last = EnvoyPods::default();
        try_wait_for("Envoy's view of the local pods", timeout, || {
            let v = EnvoyPods::read(envoy)?;
            let done = v == *want;
            last = v;
            done.then_some(())
        })
        .map_err(|_| last)
    }

    /// What `want` has that `self` lacks, and the reverse, for a failure message.
    pub fn diff(&self, want: &EnvoyPods) -> String {
        let w: BTreeSet<_> = want.chains.iter().collect();
        let s: BTreeSet<_> = self.chains.iter().collect();
        format!(
            "chains missing {:?}, extra {:?}; clusters missing {:?}, extra {:?}",
            w.difference(&s).collect::<Vec<_>>(),
            s.difference(&w).collect::<Vec<_>>(),
            want.clusters.difference(&self.clusters).collect::<Vec<_>>(),
            self.clusters.difference(&want.clusters).collect::<Vec<_>>()
        )
    }

    /// The view Envoy should have for `pods` (uid to IP address): one /32 (or /128)
    /// chain and one cluster each.
    pub fn expected<'a>(pods: impl IntoIterator<Item = (&'a String, &'a IpAddr)>) -> EnvoyPods {
        let mut out = EnvoyPods::default();
        for (uid, ip) in pods {
            let len = if ip.is_ipv4() { 32 } else { 128 };
            out.chains.insert(uid.clone(), vec![format!("{ip}/{len}")]);
            out.clusters.insert(aether_model::inbound_cluster_name(uid));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_names_escape_regex_syntax() {
        assert_eq!(exact_names(&["a.b", "c|d"]), encode(r"^(a\.b|c\|d)$"));
    }
}
