//! The chart's Grafana dashboard and alert rules against the real tools (issue 18):
//!
//! - a real Prometheus (Debian's `prometheus`, loopback only, a temporary storage folder,
//!   scraping every second) scrapes a live owner's metrics port, a real Envoy's stats
//!   through the chart's stats listener (`charts/aether-agent/files/envoy-stats-listener.yaml`),
//!   the xDS relay between them (`aether-xds-relay`, as `proxy.relay` deploys it: Envoy's ADS
//!   through it) and a real registrar's metrics port (on etcd, over TLS, holding its Lease on the test
//!   API server), and loads the chart's alert rules; after a CNI ADD and DEL, a registry
//!   change, HTTP/3 through a pod's QUIC twin (one request answered, three handshakes
//!   refused: the agent has workload identity from the test provider) and an operator's
//!   apply and dump through the registrar, every expression of
//!   `charts/aether-agent/dashboards/aether-agent.json` goes through Prometheus' query
//!   API: each must parse and return data, except those over kube-state-metrics
//!   (`kube_*`), which are only parsed;
//! - the checker itself fails a panel that names a metric no target exports, both on a
//!   fixed table and against the live Prometheus;
//! - `promtool check rules` and `promtool test rules` on the chart's rules and their unit
//!   tests, and the unit tests fail when a rule's threshold is broken (the agent's respawn
//!   loop, and the relay's alert without an agent made to fire on any dip).
//!
//! The live test needs root (the worker runs as its own uid), Envoy, Prometheus and etcd;
//! the promtool test needs promtool. Each skips loudly without them (CI installs them:
//! scripts/install-deps.sh, scripts/install-envoy.sh).

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use aether_e2e::envoy::{
    AdsApi, CONNECTED, Envoy, Relay, admin_get, encode, envoy_or_skip, exact_names, parse_stats,
};
use aether_e2e::harness::churn::{Cni, PodId};
use aether_e2e::harness::upstream;
use aether_e2e::identity::IdentityProvider;
use aether_e2e::kube_api::KubeApi;
use aether_e2e::quic::{self, Pem};
use aether_e2e::registrar::{
    DISCOVERY_RULES, Etcd, LEASE_NAME, LEASE_NAMESPACE, REGISTRAR_USER, RegistrarProcess, TestCa,
    apply_with, cli, registrar_bin,
};
use aether_e2e::testing::{
    HttpTarget, LocalNode, bin, free_port, identity_args, identity_provider_for_agents, is_root,
    mesh_registry_json, metric_sample, scrape_metrics, try_wait_for, wait_for, workspace_root,
};
use aether_model::{INBOUND_TARGET_PORT, twin_sni};
use aether_worker::bootstrap;
use serde_json::Value;

const T: Duration = Duration::from_secs(30);
/// The identity provider's trust domain.
const TD: &str = "aether.test";

/// What the test puts for Grafana's variables: a rate window that holds many 1 s scrapes,
/// and the chart's agent DaemonSet name for a release named `aether-agent`.
const VARIABLES: &[(&str, &str)] = &[("$__rate_interval", "30s"), ("$daemonset", "aether-agent")];

fn chart() -> PathBuf {
    workspace_root().join("charts/aether-agent")
}

/// A child process killed and reaped when dropped, also when the test fails.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `expr` of every target of every panel (rows' nested panels too), with its panel's title.
fn dashboard_exprs(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for p in panels.as_array().into_iter().flatten() {
            let title = p["title"].as_str().unwrap_or("(untitled)");
            for t in p["targets"].as_array().into_iter().flatten() {
                if let Some(e) = t["expr"].as_str() {
                    out.push((title.to_string(), e.to_string()));
                }
            }
            walk(&p["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// `expr` with Grafana's variables put in, or the name of one the test does not know.
fn substitute(expr: &str) -> Result<String, String> {
    let mut e = expr.to_string();
    for (var, value) in VARIABLES {
        e = e.replace(var, value);
    }
    match e.find('$') {
        Some(at) => Err(format!(
            "an unknown Grafana variable at '{}'",
            &e[at..e.len().min(at + 20)]
        )),
        None => Ok(e),
    }
}

/// The metric names in `expr`: the words outside quotes with one of the prefixes the
/// dashboard's sources use (the agent, Envoy, process metrics, kube-state-metrics), but
/// not label names: those in a selector's braces or in the list after `by`, `without`,
/// `on`, `ignoring` and `group_left`/`group_right` (Envoy's labels share its prefix).
fn metric_names(expr: &str) -> BTreeSet<String> {
    const PREFIXES: &[&str] = &["aether_", "envoy_", "process_", "kube_"];
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let mut names = BTreeSet::new();
    let mut word = String::new();
    let (mut quoted, mut braces, mut list_next, mut in_list) = (false, 0usize, false, false);
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            quoted = !quoted;
        }
        if !quoted && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            let label = braces > 0 || in_list;
            if !label && PREFIXES.iter().any(|p| word.starts_with(p)) {
                names.insert(word.clone());
            }
            list_next = !label && LABEL_LISTS.contains(&word.as_str());
            word.clear();
        }
        match c {
            _ if quoted => {}
            '{' => braces += 1,
            '}' => braces = braces.saturating_sub(1),
            '(' if list_next => (in_list, list_next) = (true, false),
            ')' => in_list = false,
            c if !c.is_whitespace() => list_next = false,
            _ => {}
        }
    }
    names
}

/// The metric family a series name belongs to (`aether_xds_nacks_total` to
/// `aether_xds_nacks`): Prometheus keeps a target's HELP and TYPE by family.
fn family(name: &str) -> &str {
    ["_total", "_bucket", "_sum", "_count", "_created"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// The metric names known: those Prometheus has samples of, and the families the live
/// targets declare in their exposition (`# TYPE` lines: a labelled counter has no sample
/// before its first event, but the owner exports its TYPE from the start).
struct Known {
    series: BTreeSet<String>,
    declared: BTreeSet<String>,
}

impl Known {
    fn has(&self, name: &str) -> bool {
        self.series.contains(name)
            || self.declared.contains(name)
            || self.declared.contains(family(name))
    }
}

/// Checks each dashboard expression with `query` (the number of series it returns, or
/// Prometheus' error): it must parse, and unless it is over kube-state-metrics (only
/// parsed) it must name only metrics the targets export and return data. Returns one line
/// per failing expression.
fn check(
    exprs: &[(String, String)],
    known: &Known,
    query: &mut dyn FnMut(&str) -> Result<usize, String>,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (panel, expr) in exprs {
        let e = match substitute(expr) {
            Ok(e) => e,
            Err(why) => {
                failures.push(format!("panel '{panel}': {why} in `{expr}`"));
                continue;
            }
        };
        let names = metric_names(&e);
        let kube = names.iter().any(|n| n.starts_with("kube_"));
        let unknown: Vec<&String> = names
            .iter()
            .filter(|n| !n.starts_with("kube_") && !known.has(n))
            .collect();
        match query(&e) {
            Err(why) => failures.push(format!("panel '{panel}': `{e}` is refused: {why}")),
            Ok(_) if !unknown.is_empty() => failures.push(format!(
                "panel '{panel}': `{e}` names metrics no target exports: {unknown:?}"
            )),
            Ok(0) if kube => {}
            Ok(0) => failures.push(format!("panel '{panel}': `{e}` returns no data")),
            Ok(_) => {}
        }
    }
    failures
}

/// One GET on loopback in HTTP `version` (`1.0`, so that Prometheus does not chunk its
/// answer; `1.1` for Envoy, which answers HTTP/1.0 with 426): (status, body).
fn http_get(version: &str, addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    aether_e2e::testing::http_get(
        HttpTarget::Tcp(addr),
        version,
        path,
        Duration::from_secs(10),
    )
}

/// A Prometheus HTTP API call: its `data`, or its error.
fn prom_api(addr: &str, path: &str) -> Result<Value, String> {
    let (status, body) = http_get("1.0", addr, path)
        .map_err(|e| format!("GET {path} from Prometheus at {addr}: {e}"))?;
    let v: Value = serde_json::from_str(&body)
        .map_err(|e| format!("GET {path}: status {status}, not JSON ({e}): {body}"))?;
    if v["status"] != "success" {
        return Err(format!(
            "{}: {}",
            v["errorType"].as_str().unwrap_or("?"),
            v["error"].as_str().unwrap_or(&body)
        ));
    }
    Ok(v["data"].clone())
}

/// An instant query: how many series it returns.
fn prom_query(addr: &str, expr: &str) -> Result<usize, String> {
    let data = prom_api(addr, &format!("/api/v1/query?query={}", encode(expr)))?;
    Ok(data["result"].as_array().map_or(0, Vec::len))
}

fn known(addr: &str, expositions: &[String]) -> Known {
    let names =
        prom_api(addr, "/api/v1/label/__name__/values").expect("metric names from Prometheus");
    Known {
        series: names
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect(),
        declared: expositions
            .iter()
            .flat_map(|t| t.lines())
            .filter_map(|l| {
                l.strip_prefix("# TYPE ")?
                    .split_whitespace()
                    .next()
                    .map(str::to_owned)
            })
            .collect(),
    }
}

/// The chart's stats listener and the admin cluster it routes to, as Envoy's
/// `--config-yaml` (merged into the bootstrap: repeated fields are appended), on `port`.
fn stats_listener_yaml(port: u16, admin: &Path) -> String {
    let file = chart().join("files/envoy-stats-listener.yaml");
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    let filled = text
        .replace("${STATS_ADDRESS}", "127.0.0.1")
        .replace("${STATS_PORT}", &port.to_string());
    assert!(
        !filled.contains("${"),
        "{} has a placeholder the test does not fill:\n{filled}",
        file.display()
    );
    let mut out = String::from("static_resources:\n  listeners:\n");
    let mut first = true;
    for line in filled
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
    {
        out.push_str(if first { "  - " } else { "    " });
        out.push_str(line);
        out.push('\n');
        first = false;
    }
    // The chart's envoy_admin cluster ("aether-agent.envoyBootstrap"), on this admin pipe.
    out.push_str(&format!(
        r#"  clusters:
  - name: envoy_admin
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: envoy_admin
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ pipe: {{ path: {} }} }} }}
"#,
        admin.display()
    ));
    out
}

/// Envoy on the node, its ADS cluster at `xds_dir`'s `xds.sock` (the relay's), with the
/// chart's stats listener on `stats_port` merged into the bootstrap.
fn start_envoy(
    envoy: &Path,
    node: &LocalNode,
    xds_dir: &Path,
    stats_port: u16,
) -> (Envoy, PathBuf) {
    let dir = node.root.path().join("envoy");
    std::fs::create_dir_all(&dir).expect("envoy dir");
    let admin = dir.join("envoy-admin.sock");
    let stats = stats_listener_yaml(stats_port, &admin);
    let envoy = Envoy::start_with_args(
        envoy,
        &dir,
        xds_dir,
        (
            bootstrap::DEFAULT_BACKOFF_BASE,
            bootstrap::DEFAULT_BACKOFF_MAX,
        ),
        AdsApi::default(),
        &["--config-yaml".as_ref(), stats.as_ref()],
    )
    .expect("start Envoy");
    (envoy, admin)
}

/// A registrar as the chart runs it with `registrar.tls.secretName` and
/// `registrar.metrics.enabled`: on etcd, serving TLS, its metrics on `metrics`, running
/// for the Lease on the test API server with discovery on (and so exporting
/// `aether_registrar_leader`); returns once it leads. Then an operator applies `file` and
/// dumps the registry through it, which opens and ends a watch. Returns it with the API
/// server and the CA, which must live as long as it does.
fn start_registrar(etcd: &Etcd, metrics: &str, file: &Path) -> (RegistrarProcess, KubeApi, TestCa) {
    let api = KubeApi::start();
    api.grant(REGISTRAR_USER, DISCOVERY_RULES);
    let kubeconfig = api.kubeconfig(REGISTRAR_USER).display().to_string();
    let ca = TestCa::new("registrar CA");
    let (cert, key) = ca.leaf(
        "registrar",
        &["127.0.0.1"],
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    );
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let args = [
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--metrics-addr",
        metrics,
        "--kubeconfig",
        &kubeconfig,
        "--lease-namespace",
        LEASE_NAMESPACE,
        "--lease-name",
        LEASE_NAME,
        "--leader-id",
        "dashboard-r1",
        "--discovery",
        "on",
    ];
    let registrar = RegistrarProcess::tcp(&registrar_bin(), &etcd.endpoints(), &args);
    registrar.wait_log("leading", T);
    let ca_file = ca.ca_file().display().to_string();
    apply_with(registrar.addr(), file, &["--ca", &ca_file]);
    let dump = cli(&["dump", "--registrar", registrar.addr(), "--ca", &ca_file]);
    assert!(
        dump.contains("\"services\""),
        "the registrar's dump holds no services: {dump}"
    );
    (registrar, api, ca)
}

/// Prometheus scraping each `(job, target, metrics path)` every second, with the chart's
/// alert rules.
fn start_prometheus(
    prometheus: &Path,
    dir: &Path,
    port: u16,
    jobs: &[(&str, &str, &str)],
) -> Running {
    let rules = chart().join("alerts/aether-agent.rules.yaml");
    let config = format!(
        r#"global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
  - {}
scrape_configs:
"#,
        rules.display()
    ) + &jobs
        .iter()
        .map(|(job, target, path)| format!("  - job_name: {job}\n    metrics_path: {path}\n    static_configs:\n      - targets: ['{target}']\n"))
        .collect::<String>();
    std::fs::write(dir.join("prometheus.yml"), config).expect("write prometheus.yml");
    let log = std::fs::File::create(dir.join("prometheus.log")).expect("prometheus log");
    let child = Command::new(prometheus)
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--log.level=warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    Running(child)
}

/// The QUIC twins' series: a pod with its own SVID on a loopback address, answering HTTP on
/// the inbound target port, gets a twin; an HTTP/3 client with an SVID of the trust domain
/// is answered through it, and three are refused in the handshake (no client certificate,
/// another CA, an ID outside the trust domain). Returns once the owner advertises the pair.
fn http3_through_a_twin(cni: &Cni, idp: &IdentityProvider, metrics: &str, twins: SocketAddr) {
    let pod = PodId {
        uid: "dash-h3-uid".into(),
        name: "dash-h3".into(),
    };
    let ip = Ipv4Addr::new(127, 0, 91, 2);
    let _server = upstream::spawn_on((ip, INBOUND_TARGET_PORT).into(), "dash-h3".into())
        .unwrap_or_else(|e| panic!("an HTTP server on {ip}:{INBOUND_TARGET_PORT}: {e}"));
    cni.call("ADD", &pod, Some(ip))
        .unwrap_or_else(|e| panic!("ADD {}: {e}", pod.uid));
    wait_for("the pod's twin in the owner's snapshot", T, || {
        (metric_sample(&scrape_metrics(metrics)?, "aether_quic_twins")? >= 1.0).then_some(())
    });
    let sni = twin_sni(&pod.uid);
    let (cert, key) = idp.mint(&format!("spiffe://{TD}/ns/default/sa/dashboard-client"));
    let client = Pem::new(&cert, &key);
    // Envoy takes the listener a moment after its ACK: poll.
    let answered = try_wait_for("an HTTP/3 answer through the twin", T, || {
        let r = quic::h3(None, twins, &sni, Some(&client), 3.0);
        (r["ok"] == true).then_some(r)
    })
    .unwrap_or_else(|e| {
        let r = quic::h3(None, twins, &sni, Some(&client), 3.0);
        panic!("{e}; the last attempt: {r}")
    });
    assert!(
        quic::body(&answered).starts_with("dash-h3"),
        "the pod answers through its twin: {answered}"
    );
    let (cert, key) = IdentityProvider::mint_foreign("other.test", "spiffe://other.test/ns/x/sa/y");
    let foreign = Pem::new(&cert, &key);
    let (cert, key) = idp.mint("spiffe://evil.test/ns/default/sa/x");
    let outside = Pem::new(&cert, &key);
    for (who, cert) in [
        ("no client certificate", None),
        ("another CA's SVID", Some(&foreign)),
        ("our CA naming another trust domain", Some(&outside)),
    ] {
        let r = quic::h3(None, twins, &sni, cert, 2.0);
        assert_ne!(r["ok"], true, "{who}: served through the twin: {r}");
    }
    wait_for("the owner to advertise the pod's QUIC pair", T, || {
        (metric_sample(&scrape_metrics(metrics)?, "aether_quic_pairs_advertised")? >= 1.0)
            .then_some(())
    });
}

fn tool_or_skip(name: &str, test: &str) -> Option<PathBuf> {
    let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(name))
        .find(|p| p.is_file());
    if found.is_none() {
        eprintln!(
            "\n!!! SKIPPED {test}: no {name} on PATH (Debian's prometheus package; scripts/install-deps.sh installs it, so CI runs this test) !!!\n"
        );
    }
    found
}

/// Issue 18's dashboard check. Invariant: every dashboard expression parses, names only
/// metrics the live owner, Envoy, registrar or xDS relay exports, and returns data (those over
/// kube-state-metrics are only parsed), so that no panel is silently empty; and the alert
/// rules load into a real Prometheus.
#[test]
fn every_dashboard_expression_returns_data_from_a_live_owner_envoy_and_registrar() {
    let test = "every_dashboard_expression_returns_data_from_a_live_owner_envoy_and_registrar";
    if !is_root() {
        eprintln!(
            "\n!!! SKIPPED {test}: needs root (the supervisor runs its worker as its own uid; CI runs as root) !!!\n"
        );
        return;
    }
    let Some(envoy) = envoy_or_skip(test) else {
        return;
    };
    let Some(prometheus) = tool_or_skip("prometheus", test) else {
        return;
    };
    let Some(etcd) = Etcd::start_or_skip(test) else {
        return;
    };
    let started = Instant::now();
    let dashboard_file = chart().join("dashboards/aether-agent.json");
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(&dashboard_file).expect("read the dashboard"),
    )
    .unwrap_or_else(|e| panic!("{} is not JSON: {e}", dashboard_file.display()));
    let exprs = dashboard_exprs(&dashboard);
    assert!(
        exprs.len() >= 10,
        "{} has only {} expressions",
        dashboard_file.display(),
        exprs.len()
    );

    let mut node = LocalNode::new();
    let registry = node.root.path().join("registry.json");
    std::fs::write(&registry, mesh_registry_json(2, 2, None, "")).expect("registry file");
    node.registry_file = Some(registry.clone());
    // Envoy runs in the machine's own network namespace here: the capture listeners get
    // free loopback ports instead of the default 15001 and 15006, which other tests' Envoys
    // may hold.
    let capture_file = node.root.path().join("capture.json");
    let capture = |outbound: &str, inbound: u16| {
        format!(r#"{{"outbound": "{outbound}", "inbound_port": {inbound}}}"#)
    };
    // Two distinct ports: the first is held while the second is chosen.
    let held = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("a free port");
    let outbound = held.local_addr().expect("its address").to_string();
    let inbound = free_port(Ipv4Addr::LOCALHOST).expect("a free port");
    drop(held);
    std::fs::write(&capture_file, capture(&outbound, inbound)).expect("capture file");
    let metrics = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("a free port")
    );
    node.metrics = Some(metrics.parse().expect("a metrics address"));
    // Workload identity from the test provider, and the QUIC twins on a free loopback UDP
    // port, advertised as pairs after a short window.
    let (_idp_dir, idp) = identity_provider_for_agents(TD);
    let twins = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|s| s.local_addr())
        .expect("a free UDP port");
    let mut args = vec![
        format!("--capture-file={}", capture_file.display()),
        format!("--quic-twin-addr={twins}"),
        "--quic-pair-window=1s".to_string(),
    ];
    args.extend(identity_args(&idp, "permissive"));
    let agent = node.start_agent_with(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_for("the agent to serve as the owner", T, || {
        agent.serving_owner()
    });
    wait_for("the owner's metrics port", T, || scrape_metrics(&metrics));

    // The relay between Envoy and the node, as proxy.relay deploys it, its metrics on.
    let relay = Relay::start(&node.root.path().join("relay"), &node.run_dir);
    let stats_port = free_port(Ipv4Addr::LOCALHOST).expect("a free port");
    let (_envoy, admin) = start_envoy(&envoy, &node, &relay.dir, stats_port);
    wait_for("Envoy connected to the agent through the relay", T, || {
        let (status, body) = admin_get(
            &admin,
            &format!("/stats?filter={}", exact_names(&[CONNECTED])),
        )
        .ok()?;
        (status == 200
            && parse_stats(&body)
                .iter()
                .any(|(k, v)| k == CONNECTED && *v == 1))
        .then_some(())
    });
    let envoy_stats = format!("127.0.0.1:{stats_port}");
    let (status, body) = wait_for("the stats listener", T, || {
        http_get("1.1", &envoy_stats, "/stats/prometheus").ok()
    });
    assert_eq!(
        status, 200,
        "GET /stats/prometheus on the stats listener: {body}"
    );
    assert!(
        body.contains("envoy_control_plane_connected_state"),
        "the stats listener's answer has no connected_state:\n{body}"
    );
    let (status, _) = http_get("1.1", &envoy_stats, "/server_info").expect("GET /server_info");
    assert_eq!(
        status, 404,
        "the stats listener answers more of the admin interface than /stats/prometheus"
    );

    // Series the dashboard shows: CNI calls, pushes and ACKs, a registry change, a rejected
    // registry file (a reload error), a failed pod record write and an Envoy NACK.
    let cni = Cni {
        bin: bin("aether-cni"),
        socket: node.cni_sock(),
    };
    let pods: Vec<(PodId, Ipv4Addr)> = (1..=2)
        .map(|n| {
            (
                PodId {
                    uid: format!("dash-pod-{n}-uid"),
                    name: format!("dash-{n}"),
                },
                Ipv4Addr::new(10, 91, 0, n),
            )
        })
        .collect();
    for (pod, ip) in &pods {
        cni.call("ADD", pod, Some(*ip))
            .unwrap_or_else(|e| panic!("ADD {}: {e}", pod.uid));
    }
    cni.call("DEL", &pods[0].0, None)
        .unwrap_or_else(|e| panic!("DEL {}: {e}", pods[0].0.uid));
    let seq = |text: &str| metric_sample(text, "aether_snapshot_seq").unwrap_or(0.0);
    let before = seq(&scrape_metrics(&metrics).expect("scrape the owner"));
    std::fs::write(&registry, mesh_registry_json(3, 2, None, "")).expect("registry change");
    wait_for("a snapshot built from the registry change", T, || {
        (seq(&scrape_metrics(&metrics)?) > before).then_some(())
    });
    std::fs::write(&registry, "{ not json").expect("a rejected registry file");
    wait_for("the rejected registry file to be counted", T, || {
        let text = scrape_metrics(&metrics)?;
        text.lines()
            .any(|l| l.starts_with("aether_registry_reload_errors_total") && !l.ends_with(" 0"))
            .then_some(())
    });
    // The records folder read-only to the worker (its own uid): the ADD fails, counted.
    let records = node.state_dir.join("pods");
    let mode = std::fs::metadata(&records)
        .expect("the pod records folder")
        .permissions()
        .mode();
    std::fs::set_permissions(&records, std::fs::Permissions::from_mode(0o555))
        .expect("chmod the records folder");
    let refused = (
        PodId {
            uid: "dash-pod-3-uid".into(),
            name: "dash-3".into(),
        },
        Ipv4Addr::new(10, 91, 0, 3),
    );
    let add = cni.call("ADD", &refused.0, Some(refused.1));
    std::fs::set_permissions(&records, std::fs::Permissions::from_mode(mode))
        .expect("restore the records folder");
    assert!(
        add.is_err(),
        "an ADD with the records folder read-only succeeded"
    );
    wait_for("the failed record write to be counted", T, || {
        (metric_sample(
            &scrape_metrics(&metrics)?,
            "aether_storage_write_errors_total{op=\"write\"}",
        )? >= 1.0)
            .then_some(())
    });
    // An outbound capture address that is on no interface: Envoy cannot bind the listener
    // and rejects the update (a NACK); the good capture afterwards is ACKed again.
    std::fs::write(&capture_file, capture("192.0.2.1:15001", inbound))
        .expect("an unbindable capture address");
    wait_for("Envoy's NACK of the unbindable listener", T, || {
        scrape_metrics(&metrics)?
            .lines()
            .any(|l| l.starts_with("aether_xds_nacks_total") && !l.ends_with(" 0"))
            .then_some(())
    });
    std::fs::write(&capture_file, capture(&outbound, inbound)).expect("the capture file again");
    http3_through_a_twin(&cni, &idp, &metrics, twins);

    // The registrar's row: services applied and dumped through a live registrar.
    let registrar_metrics = format!(
        "127.0.0.1:{}",
        free_port(Ipv4Addr::LOCALHOST).expect("a free port")
    );
    let applied = node.root.path().join("registrar-services.json");
    std::fs::write(&applied, mesh_registry_json(2, 2, None, "")).expect("the services to apply");
    let (_registrar, _api, _ca) = start_registrar(&etcd, &registrar_metrics, &applied);
    wait_for("the registrar's metrics port", T, || {
        scrape_metrics(&registrar_metrics)
    });

    let prom_dir = node.root.path().join("prometheus");
    std::fs::create_dir_all(&prom_dir).expect("prometheus dir");
    let prom_port = free_port(Ipv4Addr::LOCALHOST).expect("a free port");
    let prom = format!("127.0.0.1:{prom_port}");
    let jobs = [
        ("aether-agent", metrics.as_str(), "/metrics"),
        ("envoy", envoy_stats.as_str(), "/stats/prometheus"),
        ("aether-registrar", registrar_metrics.as_str(), "/metrics"),
        ("aether-xds-relay", relay.metrics.as_str(), "/metrics"),
    ];
    let _prometheus = start_prometheus(&prometheus, &prom_dir, prom_port, &jobs);
    let log = || std::fs::read_to_string(prom_dir.join("prometheus.log")).unwrap_or_default();
    try_wait_for("Prometheus ready", T, || {
        http_get("1.0", &prom, "/-/ready")
            .ok()
            .filter(|(s, _)| *s == 200)
    })
    .unwrap_or_else(|e| panic!("{e}; its log:\n{}", log()));
    // Three scrapes of each target, all after the traffic above, so that every rate() over
    // the window has at least two samples.
    let up = |job: &str| {
        prom_api(
            &prom,
            &format!(
                "/api/v1/query?query={}",
                encode(&format!("count_over_time(up{{job=\"{job}\"}}[30s])"))
            ),
        )
    };
    wait_for("every target scraped at least three times", T, || {
        jobs.iter()
            .map(|(job, _, _)| job)
            .all(|j| {
                up(j)
                    .ok()
                    .and_then(|d| {
                        d["result"][0]["value"][1]
                            .as_str()
                            .and_then(|v| v.parse::<f64>().ok())
                    })
                    .is_some_and(|n| n >= 3.0)
            })
            .then_some(())
    });
    let targets = prom_api(&prom, "/api/v1/targets").expect("targets");
    for t in targets["activeTargets"].as_array().into_iter().flatten() {
        assert_eq!(t["health"], "up", "a scrape target is down: {t}");
    }
    let rules = prom_api(&prom, "/api/v1/rules").expect("rules");
    let loaded: Vec<&str> = rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["name"].as_str())
        .collect();
    // Every alert the rules file declares, and nothing else.
    let declared = std::fs::read_to_string(chart().join("alerts/aether-agent.rules.yaml"))
        .expect("the chart's alert rules")
        .lines()
        .filter(|l| l.trim_start().starts_with("- alert:"))
        .count();
    assert!(declared >= 10, "found {declared} alerts in the rules file");
    assert_eq!(
        loaded.len(),
        declared,
        "the chart's alert rules as Prometheus loaded them: {loaded:?}"
    );

    // Every expression, polled until all pass (a scrape may land just before a series
    // appears) or the deadline; then the last outcome is the verdict.
    let expositions = || {
        let owner = scrape_metrics(&metrics).expect("scrape the owner");
        let envoy = http_get("1.1", &envoy_stats, "/stats/prometheus")
            .expect("scrape Envoy")
            .1;
        let registrar = scrape_metrics(&registrar_metrics).expect("scrape the registrar");
        let relay = scrape_metrics(&relay.metrics).expect("scrape the relay");
        [owner, envoy, registrar, relay]
    };
    let deadline = Instant::now() + T;
    let failures = loop {
        let known = known(&prom, &expositions());
        let outcome = check(&exprs, &known, &mut |e| prom_query(&prom, e));
        if outcome.is_empty() || Instant::now() > deadline {
            break outcome;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        failures.is_empty(),
        "{} of {} dashboard expressions fail against the live owner, Envoy, registrar and relay:\n{}",
        failures.len(),
        exprs.len(),
        failures.join("\n")
    );

    // The checker fails a panel naming a metric that does not exist, here too.
    let bad = vec![(
        "Owner's generation".to_string(),
        "max by (instance) (aether_generations)".to_string(),
    )];
    let bad_failures = check(&bad, &known(&prom, &expositions()), &mut |e| {
        prom_query(&prom, e)
    });
    assert_eq!(
        bad_failures.len(),
        1,
        "a panel over aether_generations (no such metric) passed: {bad_failures:?}"
    );
    assert!(
        bad_failures[0].contains("aether_generations"),
        "{}",
        bad_failures[0]
    );

    let kube = exprs
        .iter()
        .filter(|(_, e)| metric_names(e).iter().any(|n| n.starts_with("kube_")))
        .count();
    println!(
        "dashboard: {} expressions, {} returned data, {} over kube-state-metrics parsed only; {} alert rules loaded; {:.1} s",
        exprs.len(),
        exprs.len() - kube,
        kube,
        loaded.len(),
        started.elapsed().as_secs_f64()
    );
    println!(
        "a panel over a metric that does not exist: {}",
        bad_failures[0]
    );
}

/// The checker on a fixed table: a panel naming a metric no target exports fails, as do a
/// misspelt one hidden behind `or`, an unknown variable, a refused expression and an empty
/// answer (a declared counter with no event yet included); a kube-state-metrics expression
/// is only parsed.
#[test]
fn the_dashboard_check_fails_a_panel_that_names_a_metric_that_does_not_exist() {
    let known = Known {
        series: ["aether_generation", "aether_xds_pushes_total"]
            .into_iter()
            .map(String::from)
            .collect(),
        declared: ["aether_generation", "aether_xds_pushes", "aether_xds_nacks"]
            .into_iter()
            .map(String::from)
            .collect(),
    };
    let answers: BTreeMap<&str, Result<usize, String>> = [
        ("max by (instance) (aether_generation)", Ok(1)),
        ("sum(rate(aether_xds_pushes_total[30s]))", Ok(1)),
        ("sum(rate(aether_xds_nacks_total[30s]))", Ok(0)),
        (
            "count by (node) (kube_pod_info{created_by_name=\"aether-agent\"})",
            Ok(0),
        ),
        ("max by (instance) (aether_generations)", Ok(0)),
        ("sum(rate(aether_xds_pushes_totl[30s])) or vector(0)", Ok(1)),
        ("sum(", Err("bad_data: unexpected end of input".into())),
        ("vector(1) and on() absent(up)", Ok(0)),
    ]
    .into_iter()
    .collect();
    let exprs: Vec<(String, String)> = answers
        .keys()
        .map(|e| (format!("panel of {e}"), e.to_string()))
        .chain([(
            "variables".to_string(),
            "rate(aether_generation[$__interval])".to_string(),
        )])
        .collect();
    let failures = check(&exprs, &known, &mut |e| {
        answers.get(e).cloned().unwrap_or(Ok(1))
    });
    let failed = |needle: &str| failures.iter().any(|f| f.contains(needle));
    assert!(
        failed("aether_generations"),
        "a missing metric passed: {failures:#?}"
    );
    assert!(
        failed("aether_xds_pushes_totl"),
        "a misspelt counter passed: {failures:#?}"
    );
    assert!(
        failed("`sum(` is refused"),
        "an expression Prometheus refused passed: {failures:#?}"
    );
    assert!(
        failed("`vector(1) and on() absent(up)` returns no data"),
        "an empty expression passed: {failures:#?}"
    );
    assert!(
        failed("`sum(rate(aether_xds_nacks_total[30s]))` returns no data"),
        "an empty counter passed: {failures:#?}"
    );
    assert!(
        failed("unknown Grafana variable"),
        "an unknown variable passed: {failures:#?}"
    );
    assert_eq!(failures.len(), 6, "{failures:#?}");
    assert_eq!(
        metric_names(
            r#"sum by (le, envoy_x) (rate(aether_cni_request_duration_seconds_bucket{op="aether_x", envoy_y="1"}[30s])) * on (pod) group_left (envoy_z) kube_pod_info or envoy_w"#
        ),
        [
            "aether_cni_request_duration_seconds_bucket",
            "envoy_w",
            "kube_pod_info"
        ]
        .into_iter()
        .map(String::from)
        .collect::<BTreeSet<_>>()
    );
}

fn promtool(promtool: &Path, args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new(promtool)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Issue 18's alert check. Invariant: the chart's rules pass `promtool check rules`, their
/// unit tests fire each alert on a faulty series and keep it quiet on a healthy one, and
/// those tests fail when a rule is broken (a threshold no respawn loop reaches).
#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests_catch_a_broken_rule() {
    let Some(promtool_bin) = tool_or_skip(
        "promtool",
        "the_alert_rules_pass_promtool_and_their_unit_tests_catch_a_broken_rule",
    ) else {
        return;
    };
    let alerts = chart().join("alerts");
    let (ok, out) = promtool(
        &promtool_bin,
        &["check", "rules", "aether-agent.rules.yaml"],
        &alerts,
    );
    assert!(ok, "promtool check rules:\n{out}");
    println!("{}", out.trim());
    let (ok, out) = promtool(
        &promtool_bin,
        &["test", "rules", "aether-agent.rules.test.yaml"],
        &alerts,
    );
    assert!(ok, "promtool test rules:\n{out}");
    println!("{}", out.trim());

    let broken = tempfile::tempdir().expect("tempdir");
    let rules =
        std::fs::read_to_string(alerts.join("aether-agent.rules.yaml")).expect("read the rules");
    std::fs::copy(
        alerts.join("aether-agent.rules.test.yaml"),
        broken.path().join("aether-agent.rules.test.yaml"),
    )
    .expect("copy the tests");
    // Each break: the rule's text, what it becomes, the alert the unit tests must fail on,
    // and what the broken rule would do.
    let unknown_arm = r#"
            or
            label_replace(increase(envoy_listener_http3_downstream_tx_quic_connection_close_error_code_QUIC_TLS_CERTIFICATE_UNKNOWN[10m]), "code", "unknown", "", "")"#;
    let breaks = [
        (
            "increase(aether_worker_respawns_total[15m]) > 3",
            "increase(aether_worker_respawns_total[15m]) > 30",
            "AetherWorkerRespawnLoop",
            "a respawn rule that never fires",
        ),
        // The relay's alert without an agent, made to fire on any scrape without an agent
        // stream (a roll's switch caught by a scrape) instead of on 2 minutes without one.
        (
            "max_over_time(aether_relay_upstream_connected[2m]) == 0",
            "min_over_time(aether_relay_upstream_connected[2m]) == 0",
            "AetherRelayWithoutAgent",
            "a relay rule that fires on one scrape without an agent",
        ),
        // The twins' handshake rule counting one close code only.
        (
            unknown_arm,
            "",
            "AetherQuicHandshakesRefused",
            "a QUIC handshake rule blind to clients of another CA",
        ),
    ];
    for (from, to, alert, what) in breaks {
        assert!(rules.contains(from), "{alert} no longer reads `{from}`");
        std::fs::write(
            broken.path().join("aether-agent.rules.yaml"),
            rules.replace(from, to),
        )
        .expect("write the broken rules");
        let (ok, out) = promtool(
            &promtool_bin,
            &["test", "rules", "aether-agent.rules.test.yaml"],
            broken.path(),
        );
        assert!(!ok, "the unit tests passed {what}:\n{out}");
        assert!(
            out.contains(alert),
            "the unit tests failed, but not on {alert}:\n{out}"
        );
        println!("{what}: promtool test rules fails on {alert}");
    }
}
