//! A local node of real agent processes with a real Envoy on its `xds.sock`, routing one
//! service to two loopback upstreams, and the stats poller on Envoy's admin.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{AdsApi, CONNECTED, Envoy, Poller, RollTimes, analyze};
use crate::harness::load;
use crate::harness::upstream::{self, Upstream};
use crate::testing::{Agent, LocalNode, wait_for};

/// How long a roll may take to show in Envoy's stats.
const T: Duration = Duration::from_secs(10);
/// Envoy start, first connect and first routed request.
const T_START: Duration = Duration::from_secs(30);

/// A local node with one owner, a registry service ([`NodeRig::SERVICE`]) backed by two
/// loopback upstreams, and a real Envoy that has connected and routes to the service.
/// Each rig has free capture ports ([`crate::testing::NodeBuilder`]), so that tests using
/// one run in parallel.
///
/// Fields drop in order: the poller stops before Envoy goes, and the agents go before the
/// node folder does.
pub struct NodeRig {
    pub poller: Poller,
    pub envoy: Envoy,
    /// The xDS relay between Envoy and the node, when the rig has one.
    pub relay: Option<Relay>,
    pub owner: Agent,
    pub node: LocalNode,
    /// Envoy's outbound listener.
    pub outbound: SocketAddr,
    pub upstreams: Vec<Upstream>,
}

impl NodeRig {
    /// The one service of the registry.
    pub const SERVICE: &str = "web";

    pub fn start(envoy_bin: &Path, api: AdsApi) -> NodeRig {
        Self::start_with(envoy_bin, api, &[])
    }

    /// [`Self::start`], every agent started with `agent_args` too.
    pub fn start_with(envoy_bin: &Path, api: AdsApi, agent_args: &[&str]) -> NodeRig {
        Self::start_from(envoy_bin, api, None, agent_args)
    }

    /// [`Self::start_with`], the registry from the registrar at `registrar` (the rig's
    /// service applied to it) instead of a registry file. Its upstreams are on loopback,
    /// so that registrar must run with `--allow-loopback-endpoints`.
    pub fn start_from(
        envoy_bin: &Path,
        api: AdsApi,
        registrar: Option<&str>,
        agent_args: &[&str],
    ) -> NodeRig {
        Self::start_at(envoy_bin, api, registrar.map(|r| (r, &[][..])), agent_args)
    }

    /// [`Self::start`], with `aether-xds-relay` between Envoy and the node: Envoy's ADS
    /// cluster points at the relay's socket (`<node>/relay/xds.sock`), the relay at the
    /// node's `xds.sock`, its metrics on a port of the node's loopback address.
    pub fn start_relayed(envoy_bin: &Path, api: AdsApi) -> NodeRig {
        Self::start_inner(envoy_bin, api, None, &[], true)
    }

    /// [`Self::start_from`], the rig's service applied with the operator command's
    /// `apply_args` too (`--ca`, `--token-file` for a registrar with TLS and token
    /// review); the agents' own registrar flags go in `agent_args`.
    pub fn start_at(
        envoy_bin: &Path,
        api: AdsApi,
        registrar: Option<(&str, &[&str])>,
        agent_args: &[&str],
    ) -> NodeRig {
        Self::start_inner(envoy_bin, api, registrar, agent_args, false)
    }

    fn start_inner(
        envoy_bin: &Path,
        api: AdsApi,
        registrar: Option<(&str, &[&str])>,
        agent_args: &[&str],
        relayed: bool,
    ) -> NodeRig {
        let service = Self::SERVICE;
        // Kept when the test fails (a panic skips `pass`), so that the logs can be read.
        let mut builder = LocalNode::builder().keep_folder().capture();
        if relayed {
            // The agents' metrics show their side of each resume.
            builder = builder.metrics();
        }
        let mut node = builder.build().expect("node folder");
        let root = node.root.path().to_path_buf();
        eprintln!("node folder: {}", root.display());
        let upstreams: Vec<Upstream> = (0..2)
            .map(|i| upstream::spawn(format!("{service}-{i}\n")).expect("upstream"))
            .collect();
        let endpoints: Vec<_> = upstreams
            .iter()
            .enumerate()
            .map(|(i, u)| json!({ "address": u.addr.ip().to_string(), "port": u.addr.port(), "pod": format!("{service}-{i}") }))
            .collect();
        let registry = root.join("registry.json");
        let doc = json!({ "services": [{ "name": service, "namespace": "default", "ports": [80], "endpoints": endpoints }] });
        std::fs::write(&registry, doc.to_string()).expect("registry file");
        match registrar {
            Some((addr, apply_args)) => {
                crate::registrar::apply_with(addr, &registry, apply_args);
                node.args.push(format!("--registrar={addr}"));
            }
            None => node.registry_file = Some(registry),
        }
        node.args.extend(agent_args.iter().map(|a| a.to_string()));
        let outbound = node.outbound.expect("the capture listeners");
        eprintln!("outbound listener {outbound}");
        let owner = node.start_owner(T_START).unwrap_or_else(|e| panic!("{e}"));
        let relay = relayed.then(|| Relay::start(&root.join("relay"), &node.run_dir));
        let envoy = Envoy::start(
            envoy_bin,
            &root,
            relay.as_ref().map_or(&node.run_dir, |r| &r.dir),
            Duration::from_millis(100),
            Duration::from_secs(1),
            api,
        )
        .expect("start Envoy");
        let poller = Poller::start(envoy.admin.clone());
        let rig = NodeRig {
            node,
            owner,
            poller,
            envoy,
            relay,
            outbound,
            upstreams,
        };
        let warming = "listener_manager.total_listeners_warming";
        wait_for(
            &format!(
                "Envoy to connect, take its config and route {service} through {outbound} (log {})",
                rig.envoy.log.display()
            ),
            T_START,
            || {
                let s = rig.envoy.stats(&[CONNECTED, warming])?;
                (s[CONNECTED] == 1 && s[warming] == 0 && load::request(outbound, service).is_ok())
                    .then_some(())
            },
        );
        rig
    }

    /// Starts the node's next generation with the rig's flags.
    pub fn start_agent(&mut self) -> Agent {
        self.node.start_agent()
    }

    /// The named Envoy stats (a missing one reads as 0: Envoy creates some lazily).
    pub fn stats(&self, names: &[&str]) -> BTreeMap<String, u64> {
        self.envoy.stats(names).unwrap_or_else(|| {
            panic!(
                "Envoy admin /stats did not answer 200\n{}",
                self.where_to_look()
            )
        })
    }

    pub fn config_dump(&self) -> String {
        let (status, body) = self
            .envoy
            .get("/config_dump")
            .expect("Envoy admin /config_dump");
        assert_eq!(status, 200, "Envoy /config_dump answered {status}");
        body
    }

    /// Waits until Envoy has lost its ADS stream since `since`, connected again and taken
    /// a config update on the new stream (the harness's roll analysis), and is connected.
    ///
    /// `since` must be a quiet moment before the action, not the action itself: a poll
    /// is stamped with the midpoint of its admin request, so on a busy machine a poll that
    /// already counts the stream's end can carry a time just before the kill, and the
    /// analysis would then wait for a second end that never comes.
    pub fn wait_reconnected(&self, since: Instant, what: &str) -> RollTimes {
        let mut changes = Vec::new();
        crate::testing::try_wait_for("Envoy to reconnect", T, || {
            let (before, c) = self.poller.since(since);
            changes = c;
            analyze(before, &changes)
        })
        .unwrap_or_else(|_| {
            panic!(
                "{what}: Envoy did not lose its stream, reconnect and take a config update within {T:?}; stats changes {changes:#?}\n{}",
                self.where_to_look()
            )
        })
    }

    /// Where the logs are, for a failure message.
    pub fn where_to_look(&self) -> String {
        format!(
            "node folder {} (gen*.log, envoy.log)",
            self.node.root.path().display()
        )
    }

    /// The test passed: the node folder can go.
    pub fn pass(&mut self) {
        self.node.pass();
    }
}

/// `aether-xds-relay` serving `<dir>/xds.sock` in front of a node's run dir; ended by
/// pid when dropped.
pub struct Relay {
    child: std::process::Child,
    pub dir: std::path::PathBuf,
    /// Its metrics, `HOST:PORT`.
    pub metrics: String,
    pub log: std::path::PathBuf,
}

impl Relay {
    pub fn start(dir: &Path, run_dir: &Path) -> Relay {
        std::fs::create_dir_all(dir).expect("relay dir");
        let ip = crate::testing::node_loopback();
        let port = crate::testing::node_port(ip).expect("free port");
        let metrics = SocketAddr::from((ip, port)).to_string();
        let log = dir.join("relay.log");
        let out = std::fs::File::create(&log).expect("relay log");
        let listen = dir.join("xds.sock");
        let child = std::process::Command::new(crate::testing::bin("aether-xds-relay"))
            .arg(format!("--listen=unix://{}", listen.display()))
            .arg(format!(
                "--upstream=unix://{}",
                run_dir.join("xds.sock").display()
            ))
            .arg(format!("--metrics-addr={metrics}"))
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone().expect("relay log"))
            .stderr(out)
            .spawn()
            .expect("start aether-xds-relay (cargo build --workspace first)");
        let relay = Relay {
            child,
            dir: dir.to_path_buf(),
            metrics,
            log,
        };
        wait_for("the relay to listen and serve its metrics", T, || {
            (listen.exists() && relay.metric("aether_relay_envoy_streams").is_some()).then_some(())
        });
        relay
    }

    /// One of its metrics, by exact name.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = crate::testing::scrape_metrics(&self.metrics)?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
