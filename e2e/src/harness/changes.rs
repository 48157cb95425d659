//! `ARG_RELAY`: a registry change timed to Envoy's ACK of it, at the moment a roll starts
//! and again between rolls (the baseline), and the checks that go with the relay.
//!
//! The change flips the first service's second endpoint out of the registry and back in,
//! one flip per change, through one of two [`Target`]s:
//! - one node (`ARG_NODES=1`): the registry file, written beside itself first and renamed
//!   over it at the moment timed. The agent then re-reads and parses the whole file, which
//!   at 10,000 services is 30 to 50 ms of the sample;
//! - two nodes (`ARG_NODES=2`): the registrar both nodes watch, one `ApplyServices` of
//!   that service alone on a connection opened beforehand, timed from just before the
//!   call. The agent gets the one service on its watch: the cost is the change's, not
//!   the mesh's.
//!
//! Envoy's own log says when it accepted the load assignment
//! (`config:debug`), which is when it sends the ACK, whichever agent answered and whether
//! or not a relay stood between them; no admin query runs while a change is timed. Each
//! change is then checked in Envoy's config dump, outside the timing.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde_json::Value;
use shared_proto::registry::{self as pb, registry_client::RegistryClient};
use tonic::transport::Channel;

use crate::envoy::{Envoy, ack_log, log_times};
use crate::testing::try_wait_for;

/// How long a change may take to reach Envoy (a recreate roll without the relay waits out
/// Envoy's reconnect backoff, up to its max).
const ACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Envoy's log levels that time the changes, unless `AETHER_E2E_ENVOY_LOG` sets its own:
/// `config:debug` logs each accepted response.
pub fn envoy_log_args() -> Vec<String> {
    if std::env::var_os("AETHER_E2E_ENVOY_LOG").is_some() {
        return Vec::new();
    }
    [
        "--component-log-level",
        "config:debug",
        "--log-format",
        "[%H:%M:%S.%f][%t][%l][%n] %v",
    ]
    .map(String::from)
    .to_vec()
}

/// Where a change is made.
pub enum Target {
    /// The node's registry file: the registry with the first service whole, and without
    /// its second endpoint.
    File {
        path: PathBuf,
        staged: PathBuf,
        docs: [String; 2],
    },
    /// The registrar: the first service whole, and without its second endpoint.
    Registrar(Box<Registrar>),
}

/// A connection to the registrar, opened before the first change is timed.
pub struct Registrar {
    runtime: tokio::runtime::Runtime,
    client: RegistryClient<Channel>,
    services: [pb::Service; 2],
}

impl Target {
    /// The registry file at `path`, in `docs[0]` now; changes flip it to `docs[1]` and
    /// back.
    pub fn file(path: &Path, docs: [String; 2]) -> Target {
        Target::File {
            path: path.to_path_buf(),
            staged: path.with_extension("next"),
            docs,
        }
    }

    /// The registrar at `addr` (TLS checked against `ca`), holding `docs[0]`'s one
    /// service now (`--registry-file` schema); changes apply `docs[1]`'s and back.
    pub fn registrar(addr: &str, ca: &Path, docs: [String; 2]) -> Result<Target> {
        let service = |doc: &str| -> Result<pb::Service> {
            let view = aether_model::registry_file::parse(Path::new("(change)"), doc.as_bytes())?;
            let mut services = view.services.values();
            match (services.next(), services.next()) {
                (Some(s), None) => Ok(aether_registrar::values::model_service_to_pb(s)),
                _ => bail!("a registrar change is one service: {doc}"),
            }
        };
        let services = [service(&docs[0])?, service(&docs[1])?];
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("the registrar client's runtime")?;
        let client = runtime.block_on(aether_registrar::client::connect(
            addr,
            Duration::from_secs(5),
            Some(ca),
        ))?;
        Ok(Target::Registrar(Box::new(Registrar {
            runtime,
            client,
            services,
        })))
    }
}

/// The registry's two states and where the next change stands.
pub struct Changes {
    target: Target,
    /// Envoy's endpoints of the first service's cluster in each state (sorted, as
    /// [`crate::envoy::load_assignment_lines`] writes them).
    wants: [Vec<String>; 2],
    pub cluster: String,
    envoy_log: PathBuf,
    /// The state the file is in.
    at: usize,
    made: Option<Made>,
}

struct Made {
    /// Envoy's log length when the change was made: its ACK comes after.
    offset: u64,
    /// Seconds since midnight (UTC, Envoy's log clock) when the file moved into place.
    t0: f64,
    /// Seconds the write itself took.
    write: f64,
}

/// A change timed to Envoy's ACK of it, and the write's share of that time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    /// From just before the write to Envoy's ACK.
    pub total: f64,
    /// The write: the rename over the registry file, or the registrar's `ApplyServices`
    /// call, which returns once etcd has committed the change (its WAL fsync included).
    /// The agents' watches may bring them the change before the call returns, so the rest
    /// (`total - write`) is a floor on the time from etcd to Envoy, not an exact split.
    pub write: f64,
}

impl Timed {
    /// The time from the write's return to Envoy's ACK.
    pub fn after_write(&self) -> f64 {
        self.total - self.write
    }
}

/// Seconds since midnight, UTC, of `t`.
fn of_day(t: SystemTime) -> f64 {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) / 1e9
}

impl Changes {
    /// `target` holds state 0 now, and state 1 is the same without the second endpoint of
    /// `cluster`'s service; `wants` are Envoy's endpoints in each.
    pub fn new(
        target: Target,
        wants: [Vec<String>; 2],
        cluster: String,
        envoy_log: &Path,
    ) -> Changes {
        Changes {
            target,
            wants,
            cluster,
            envoy_log: envoy_log.to_path_buf(),
            at: 0,
            made: None,
        }
    }

    /// Writes the next state beside the registry file: [`Changes::make`] puts it in place.
    /// The registrar's needs nothing staged.
    pub fn stage(&self) -> Result<()> {
        match &self.target {
            Target::File { staged, docs, .. } => std::fs::write(staged, &docs[1 - self.at])
                .with_context(|| format!("write {}", staged.display())),
            Target::Registrar(_) => Ok(()),
        }
    }

    /// Makes the change now: renames the staged state over the registry file, or applies
    /// the service at the registrar. Timed from just before: a clock read after can come
    /// late, when the harness is descheduled right after the rename while the agent and
    /// Envoy go on, and would make a change look faster than it was (even negative) on a
    /// busy machine.
    pub fn make(&mut self) -> Result<()> {
        let offset = std::fs::metadata(&self.envoy_log).map_or(0, |m| m.len());
        let before = SystemTime::now();
        match &mut self.target {
            Target::File { path, staged, .. } => {
                std::fs::rename(&*staged, &*path)
                    .with_context(|| format!("rename over {}", path.display()))?;
                let took = before.elapsed().unwrap_or_default();
                if took > Duration::from_millis(1) {
                    eprintln!(
                        "   (the registry change's rename took {:.1} ms: its sample is long by up to that)",
                        took.as_secs_f64() * 1e3
                    );
                }
            }
            // The call returns once etcd holds the change, which the agents' watches
            // may already have brought them: its time is part of the sample.
            Target::Registrar(r) => {
                let req = pb::ApplyServicesRequest {
                    services: vec![r.services[1 - self.at].clone()],
                };
                r.runtime
                    .block_on(r.client.apply_services(req))
                    .context("ApplyServices of the change at the registrar")?;
            }
        }
        let write = before.elapsed().unwrap_or_default().as_secs_f64();
        let t0 = of_day(before);
        self.at = 1 - self.at;
        self.made = Some(Made { offset, t0, write });
        Ok(())
    }

    /// Waits for Envoy's log to show it accepted (and so ACKed) the change made last, then
    /// checks Envoy's config dump holds it; the seconds from the change to the ACK, and the
    /// write's share.
    pub fn acked(&mut self, envoy: &Envoy) -> Result<Timed> {
        let Some(made) = self.made.take() else {
            bail!("no change made");
        };
        let log = &self.envoy_log;
        // Only what Envoy logged since the change, read as it comes: the whole log is tens
        // of MB at 10,000 services, and reading it every 2 ms took a core from the agents
        // and Envoy while they carried the change.
        let mut f = std::fs::File::open(log)
            .and_then(|mut f| f.seek(SeekFrom::Start(made.offset)).map(|_| f))
            .with_context(|| format!("Envoy's log {}", log.display()))?;
        let mut since = Vec::new();
        let t = try_wait_for(
            "Envoy's log to show the registry change's load assignment accepted",
            ACK_TIMEOUT,
            || {
                f.read_to_end(&mut since).ok()?;
                // Whole lines only: a line half written may not say yet what it accepted.
                let whole = since.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
                log_times::eds_changes(&String::from_utf8_lossy(&since[..whole]))
                    .first()
                    .copied()
            },
        )
        .with_context(|| {
            format!(
                "Envoy's log {} (config:debug needed; AETHER_E2E_ENVOY_LOG, when set, must include it)",
                log.display()
            )
        })?;
        let want = &self.wants[self.at];
        if let Err(got) = ack_log::wait_endpoints(envoy, &self.cluster, want) {
            bail!(
                "Envoy ACKed a load assignment after the registry change, but {} holds {got:?}, not {want:?}",
                self.cluster
            );
        }
        Ok(Timed {
            total: log_times::after(made.t0, t),
            write: made.write,
        })
    }
}

impl Changes {
    /// After a roll, before the next change: Envoy's config dump shows the state the
    /// registry is in (the change made at the roll's action), now that the new owner
    /// serves it; waits up to 2 s. [`Changes::acked`] times the first load assignment
    /// Envoy accepted after the change, which in a surge is mostly the old owner's: a new
    /// owner that had not read the change yet answered the proxy's resume with the file's
    /// previous state, taking back what the old owner had sent (seen at 10,000 services),
    /// and the next change, back to that state, then changed nothing Envoy did not hold.
    pub fn holds_current(&self, envoy: &Envoy) -> Result<()> {
        let want = &self.wants[self.at];
        let query = ack_log::eds_query(&self.cluster);
        let mut got = None;
        try_wait_for(
            "Envoy to hold the registry's current state",
            Duration::from_secs(2),
            || {
                got = envoy
                    .get(&query)
                    .ok()
                    .and_then(|(_, b)| {
                        ack_log::endpoints_of(&serde_json::from_str(&b).ok()?, &self.cluster)
                    });
                (got.as_deref() == Some(want)).then_some(())
            },
        )
        .map_err(|_| {
            anyhow::anyhow!(
                "Envoy holds {got:?} for {}, not the registry's {want:?}: the new owner did not serve the change made at the roll",
                self.cluster
            )
        })
    }
}

/// Envoy's CDS and LDS versions (the config dump's `version_info` of each, the last
/// `system_version_info` Envoy accepted) against the serving owner's snapshot versions on
/// its `/ready` (`xds_versions`); waits up to 2 s for them to agree.
pub fn versions_agree(envoy: &Envoy, ready: impl Fn() -> Option<Value>) -> Result<()> {
    let mut last = (Value::Null, Value::Null);
    let agreed = try_wait_for(
        "Envoy's CDS and LDS versions to equal the owner's",
        Duration::from_secs(2),
        || {
            let (status, body) = envoy.get("/config_dump?mask=version_info").ok()?;
            let dump: Value = (status == 200)
                .then(|| serde_json::from_str(&body).ok())
                .flatten()?;
            let version = |kind: &str| {
                dump["configs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|c| c["@type"].as_str().is_some_and(|t| t.ends_with(kind)))
                    .map(|c| c["version_info"].clone())
                    .unwrap_or(Value::Null)
            };
            let envoy_v = serde_json::json!({
                "clusters": version(".ClustersConfigDump"),
                "listeners": version(".ListenersConfigDump"),
            });
            let owner = ready()?;
            let owner_v = serde_json::json!({
                "clusters": owner["xds_versions"]["clusters"],
                "listeners": owner["xds_versions"]["listeners"],
            });
            let same = envoy_v == owner_v && owner_v["clusters"].is_string();
            last = (envoy_v, owner_v);
            same.then_some(())
        },
    );
    agreed.map_err(|_| {
        anyhow::anyhow!(
            "Envoy's versions {} differ from the owner's snapshot {}",
            last.0,
            last.1
        )
    })
}
