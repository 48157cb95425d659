//! Parsing and validation of what the runtime hands the plugin: the `CNI_*` environment
//! variables and the network config on stdin. Pure functions, no I/O, so that the table
//! tests and the fuzz target call them directly.
//!
//! Every error names the variable or config field at fault and carries the spec's code:
//! 4 for the environment, 6 for JSON that does not decode, 7 for the network config,
//! 1 for an unsupported `cniVersion`.

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::PathBuf;

use serde_json::{Map, Value};
use shared_proto::cni::{CniRequest, MAX_IPS, MAX_NETNS, NetnsProblem};

use crate::{CniError, SUPPORTED_VERSIONS, code};

/// The most stdin the plugin reads: a network config with its prevResult is a few KiB.
pub const MAX_STDIN: usize = 1024 * 1024;

/// Where the agent serves the CNI API unless the config's `agentSocket` says otherwise.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/aether/cni.sock";

/// `sun_path` holds 108 bytes including the terminating NUL.
const MAX_SOCKET_PATH: usize = 107;
const MAX_IFNAME: usize = 15;
const MAX_CNI_ARGS: usize = 16 * 1024;
const MAX_POD_FIELD: usize = 253;
const MAX_POD_UID: usize = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
    Version,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
            Command::Version => "VERSION",
        }
    }
}

/// The network config fields the plugin uses.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub cni_version: String,
    pub name: String,
    pub agent_socket: PathBuf,
    /// The previous result object, as the runtime passed it.
    pub prev_result: Option<Map<String, Value>>,
    /// The addresses of `prevResult.ips`, without prefix length.
    pub ips: Vec<IpAddr>,
}

/// A validated invocation: what to do, and the request for the agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Invocation {
    pub command: Command,
    pub config: Config,
    /// Empty for VERSION.
    pub request: CniRequest,
}

fn env_err(msg: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_ENV, msg)
}

fn config_err(msg: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_CONFIG, msg)
}

/// Reads one variable as UTF-8. Unset and empty are both `None`.
fn var(env: &impl Fn(&str) -> Option<OsString>, name: &str) -> Result<Option<String>, CniError> {
    match env(name) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => v
            .into_string()
            .map(Some)
            .map_err(|_| env_err(format!("{name} is not valid UTF-8"))),
    }
}

fn required(
    env: &impl Fn(&str) -> Option<OsString>,
    name: &str,
    command: Command,
) -> Result<String, CniError> {
    var(env, name)?.ok_or_else(|| {
        env_err(format!(
            "{name} is required for {} but is not set",
            command.as_str()
        ))
    })
}

/// Parses the environment and stdin of one invocation.
pub fn parse(
    env: &impl Fn(&str) -> Option<OsString>,
    stdin: &[u8],
) -> Result<Invocation, CniError> {
    let command = match var(env, "CNI_COMMAND")?.as_deref() {
        None => return Err(env_err("CNI_COMMAND is not set")),
        Some("ADD") => Command::Add,
        Some("DEL") => Command::Del,
        Some("CHECK") => Command::Check,
        Some("VERSION") => Command::Version,
        Some(other) => {
            return Err(env_err(format!(
                "CNI_COMMAND {:?} is not one of ADD, DEL, CHECK, VERSION",
                truncate(other)
            )));
        }
    };
    if command == Command::Version {
        // VERSION's stdin only names the runtime's version; the answer does not depend on it.
        let config = Config {
            cni_version: crate::DEFAULT_VERSION.into(),
            name: String::new(),
            agent_socket: PathBuf::from(DEFAULT_AGENT_SOCKET),
            prev_result: None,
            ips: Vec::new(),
        };
        return Ok(Invocation {
            command,
            config,
            request: CniRequest::default(),
        });
    }

    let container_id = required(env, "CNI_CONTAINERID", command)?;
    check_container_id(&container_id)?;
    let ifname = required(env, "CNI_IFNAME", command)?;
    check_ifname(&ifname)?;
    let netns = match command {
        Command::Add | Command::Check => required(env, "CNI_NETNS", command)?,
        // The sandbox may already be gone at DEL.
        _ => var(env, "CNI_NETNS")?.unwrap_or_default(),
    };
    check_netns(&netns)?;
    let cni_args = var(env, "CNI_ARGS")?.unwrap_or_default();
    let args = parse_cni_args(&cni_args)?;

    let config = parse_config(stdin)?;
    if command == Command::Check && matches!(config.cni_version.as_str(), "0.3.0" | "0.3.1") {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!(
                "cniVersion {} has no CHECK; CHECK needs 0.4.0 or later",
                config.cni_version
            ),
        ));
    }
    if matches!(command, Command::Add | Command::Check) {
        if config.prev_result.is_none() {
            return Err(config_err(format!(
                "prevResult is required for {}: aether-cni is a chained plugin and must follow the plugin that creates the interface",
                command.as_str()
            )));
        }
        if config.ips.is_empty() {
            return Err(config_err(
                "prevResult.ips is empty: the plugins before aether-cni assigned the pod no address",
            ));
        }
    }

    let request = CniRequest {
        container_id,
        netns,
        ifname,
        pod_namespace: args.namespace,
        pod_name: args.name,
        pod_uid: args.uid,
        ips: config.ips.iter().map(IpAddr::to_string).collect(),
        cni_args,
        prev_result: config
            .prev_result
            .as_ref()
            .and_then(|p| serde_json::to_vec(p).ok())
            .unwrap_or_default(),
    };
    Ok(Invocation {
        command,
        config,
        request,
    })
}

/// Spec: not empty, starts with an alphanumeric character, then `[A-Za-z0-9_.-]`. We also
/// refuse `..` anywhere: the id must never be able to name a path.
pub fn check_container_id(id: &str) -> Result<(), CniError> {
    if shared_proto::cni::valid_container_id(id) {
        Ok(())
    } else {
        Err(env_err(format!(
            "CNI_CONTAINERID {:?} is invalid: it must start with a letter or digit, hold only [A-Za-z0-9_.-], contain no \"..\" and be at most {} bytes",
            truncate(id),
            shared_proto::cni::MAX_CONTAINER_ID
        )))
    }
}

/// Spec: at most 15 bytes, not `.` or `..`, no `/`, `:` or whitespace.
pub fn check_ifname(name: &str) -> Result<(), CniError> {
    if name.len() > MAX_IFNAME {
        return Err(env_err(format!(
            "CNI_IFNAME {:?} is {} bytes, over the {MAX_IFNAME}-byte limit",
            truncate(name),
            name.len()
        )));
    }
    if name == "."
        || name == ".."
        || name
            .chars()
            .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
    {
        return Err(env_err(format!(
            "CNI_IFNAME {name:?} is invalid: no '/', ':' or whitespace, and not \".\" or \"..\""
        )));
    }
    Ok(())
}

fn check_netns(netns: &str) -> Result<(), CniError> {
    if netns.is_empty() {
        return Ok(());
    }
    match shared_proto::cni::check_netns(netns) {
        Ok(()) => Ok(()),
        Err(NetnsProblem::NotAbsolute) => Err(env_err(format!(
            "CNI_NETNS {:?} is not an absolute path of at most {MAX_NETNS} bytes",
            truncate(netns)
        ))),
        Err(NetnsProblem::ParentComponent) => Err(env_err(format!(
            "CNI_NETNS {:?} has a \"..\" component",
            truncate(netns)
        ))),
    }
}

/// The Kubernetes pod identity from `CNI_ARGS`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PodArgs {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// Parses `CNI_ARGS` (`KEY=VALUE;KEY=VALUE`). Unknown keys are ignored, as the spec's
/// `IgnoreUnknown` convention expects of plugins that do not use them.
pub fn parse_cni_args(args: &str) -> Result<PodArgs, CniError> {
    if args.len() > MAX_CNI_ARGS {
        return Err(env_err(format!(
            "CNI_ARGS is {} bytes, over the {MAX_CNI_ARGS}-byte limit",
            args.len()
        )));
    }
    let mut out = PodArgs::default();
    for entry in args.split(';').filter(|e| !e.is_empty()) {
        let Some((key, value)) = entry.split_once('=') else {
            return Err(env_err(format!(
                "CNI_ARGS entry {:?} is not KEY=VALUE",
                truncate(entry)
            )));
        };
        let (slot, max, what) = match key {
            "K8S_POD_NAMESPACE" => (&mut out.namespace, MAX_POD_FIELD, key),
            "K8S_POD_NAME" => (&mut out.name, MAX_POD_FIELD, key),
            "K8S_POD_UID" => (&mut out.uid, MAX_POD_UID, key),
            _ => continue,
        };
        let valid = value.len() <= max
            && !value.contains("..")
            && !value.starts_with('.')
            && value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !valid {
            return Err(env_err(format!(
                "CNI_ARGS {what} {:?} is invalid: at most {max} of [A-Za-z0-9_.-], no \"..\", not starting with '.'",
                truncate(value)
            )));
        }
        *slot = value.to_string();
    }
    Ok(out)
}

/// Parses the network config from stdin.
pub fn parse_config(bytes: &[u8]) -> Result<Config, CniError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        CniError::new(
            code::DECODING_FAILURE,
            format!("network config on stdin is not valid JSON: {e}"),
        )
    })?;
    let Value::Object(mut obj) = value else {
        return Err(config_err("network config on stdin is not a JSON object"));
    };
    let cni_version = match obj.get("cniVersion") {
        Some(Value::String(v)) => v.clone(),
        Some(_) => return Err(config_err("cniVersion is not a string")),
        None => return Err(config_err("cniVersion is required but missing")),
    };
    if !SUPPORTED_VERSIONS.contains(&cni_version.as_str()) {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            format!(
                "cniVersion {:?} is not supported; supported: {}",
                truncate(&cni_version),
                SUPPORTED_VERSIONS.join(", ")
            ),
        ));
    }
    let name = match obj.get("name") {
        Some(Value::String(v)) => v.clone(),
        Some(_) => return Err(config_err("name is not a string")),
        None => return Err(config_err("name is required but missing")),
    };
    let agent_socket = match obj.get("agentSocket") {
        None | Some(Value::Null) => PathBuf::from(DEFAULT_AGENT_SOCKET),
        Some(Value::String(p)) => {
            if !p.starts_with('/') || p.len() > MAX_SOCKET_PATH || p.contains('\0') {
                return Err(config_err(format!(
                    "agentSocket {:?} is not an absolute path of at most {MAX_SOCKET_PATH} bytes",
                    truncate(p)
                )));
            }
            PathBuf::from(p)
        }
        Some(_) => return Err(config_err("agentSocket is not a string")),
    };
    let prev_result = match obj.remove("prevResult") {
        None | Some(Value::Null) => None,
        Some(Value::Object(p)) => Some(p),
        Some(_) => return Err(config_err("prevResult is not a JSON object")),
    };
    let ips = match &prev_result {
        Some(p) => prev_result_ips(p)?,
        None => Vec::new(),
    };
    Ok(Config {
        cni_version,
        name,
        agent_socket,
        prev_result,
        ips,
    })
}

/// The addresses of `prevResult.ips[].address` (`"10.1.0.5/24"`), without prefix length.
fn prev_result_ips(prev: &Map<String, Value>) -> Result<Vec<IpAddr>, CniError> {
    let ips = match prev.get("ips") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(config_err("prevResult.ips is not an array")),
    };
    if ips.len() > MAX_IPS {
        return Err(config_err(format!(
            "prevResult.ips has {} entries, over the limit of {MAX_IPS}",
            ips.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::with_capacity(ips.len());
    for (i, entry) in ips.iter().enumerate() {
        let Some(address) = entry.get("address").and_then(Value::as_str) else {
            return Err(config_err(format!(
                "prevResult.ips[{i}].address is missing or not a string"
            )));
        };
        let bad = || {
            config_err(format!(
                "prevResult.ips[{i}].address {:?} is not an IP address with a prefix length",
                truncate(address)
            ))
        };
        let (ip, prefix) = address.split_once('/').ok_or_else(bad)?;
        let ip: IpAddr = ip.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        if prefix > if ip.is_ipv4() { 32 } else { 128 } {
            return Err(bad());
        }
        if seen.insert(ip) {
            out.push(ip);
        }
    }
    Ok(out)
}

/// ADD's answer: the previous result, passed on unchanged, in the config's version.
pub fn add_result(config: &Config) -> String {
    let mut result = config.prev_result.clone().unwrap_or_default();
    result.insert(
        "cniVersion".into(),
        Value::String(config.cni_version.clone()),
    );
    serde_json::to_string(&result).unwrap_or_default()
}

/// Keeps error messages readable when the input is huge.
fn truncate(s: &str) -> &str {
    const MAX: usize = 128;
    if s.len() <= MAX {
        return s;
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            vars.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    const CONF: &str = r#"{"cniVersion":"1.0.0","name":"k8s","type":"aether-cni",
        "prevResult":{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/x"}],
        "ips":[{"address":"10.1.0.5/24","interface":0},{"address":"fd00::5/64","interface":0}]}}"#;

    fn add_env() -> Vec<(&'static str, &'static str)> {
        vec![
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_NETNS", "/var/run/netns/x"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=u-1",
            ),
        ]
    }

    /// One table: an env change or a config, and the code and message fragment expected.
    #[test]
    fn bad_input_table() {
        fn check(over: &[(&'static str, &'static str)], conf: &str, code: u32, fragment: &str) {
            let mut vars = add_env();
            for (k, v) in over {
                vars.retain(|(key, _)| key != k);
                if !v.is_empty() {
                    vars.push((k, v));
                }
            }
            let err = parse(&env(&vars), conf.as_bytes()).expect_err(fragment);
            assert_eq!(err.code, code, "{fragment}: {err:?}");
            assert!(
                err.msg.contains(fragment),
                "{fragment:?} not in {:?}",
                err.msg
            );
        }
        check(&[("CNI_COMMAND", "")], CONF, 4, "CNI_COMMAND is not set");
        check(&[("CNI_COMMAND", "GC2")], CONF, 4, "CNI_COMMAND \"GC2\"");
        check(
            &[("CNI_CONTAINERID", "")],
            CONF,
            4,
            "CNI_CONTAINERID is required",
        );
        check(
            &[("CNI_CONTAINERID", "a..b")],
            CONF,
            4,
            "CNI_CONTAINERID \"a..b\"",
        );
        check(&[("CNI_CONTAINERID", "-abc")], CONF, 4, "CNI_CONTAINERID");
        check(&[("CNI_CONTAINERID", "a/b")], CONF, 4, "CNI_CONTAINERID");
        check(
            &[("CNI_IFNAME", "0123456789abcdef")],
            CONF,
            4,
            "CNI_IFNAME \"0123456789abcdef\" is 16 bytes",
        );
        check(&[("CNI_IFNAME", "a/b")], CONF, 4, "CNI_IFNAME");
        check(&[("CNI_IFNAME", "")], CONF, 4, "CNI_IFNAME is required");
        check(
            &[("CNI_NETNS", "")],
            CONF,
            4,
            "CNI_NETNS is required for ADD",
        );
        check(&[("CNI_NETNS", "relative")], CONF, 4, "CNI_NETNS");
        check(
            &[("CNI_NETNS", "/var/run/netns/../../etc")],
            CONF,
            4,
            "CNI_NETNS \"/var/run/netns/../../etc\" has a \"..\" component",
        );
        check(
            &[("CNI_NETNS", "/..")],
            CONF,
            4,
            "CNI_NETNS \"/..\" has a \"..\" component",
        );
        check(
            &[("CNI_ARGS", "K8S_POD_UID=../etc")],
            CONF,
            4,
            "K8S_POD_UID",
        );
        check(&[("CNI_ARGS", "novalue")], CONF, 4, "CNI_ARGS entry");
        check(&[], "{", 6, "not valid JSON");
        check(&[], "[]", 7, "not a JSON object");
        check(&[], r#"{"name":"k"}"#, 7, "cniVersion is required");
        check(
            &[],
            r#"{"cniVersion":"9.9.9","name":"k"}"#,
            1,
            "cniVersion \"9.9.9\"",
        );
        check(&[], r#"{"cniVersion":"1.0.0"}"#, 7, "name is required");
        check(
            &[],
            r#"{"cniVersion":"1.0.0","name":"k"}"#,
            7,
            "prevResult is required for ADD",
        );
        check(
            &[],
            r#"{"cniVersion":"1.0.0","name":"k","prevResult":{"ips":[]}}"#,
            7,
            "prevResult.ips is empty",
        );
        check(
            &[],
            r#"{"cniVersion":"1.0.0","name":"k","prevResult":{"ips":[{"address":"10.0.0.1"}]}}"#,
            7,
            "prevResult.ips[0].address",
        );
        check(
            &[],
            r#"{"cniVersion":"1.0.0","name":"k","prevResult":{"ips":[{"address":"10.0.0.1/33"}]}}"#,
            7,
            "prevResult.ips[0].address",
        );
        check(
            &[],
            r#"{"cniVersion":"1.0.0","name":"k","agentSocket":"rel.sock","prevResult":{}}"#,
            7,
            "agentSocket \"rel.sock\"",
        );
        check(
            &[("CNI_COMMAND", "CHECK")],
            &CONF.replace("1.0.0", "0.3.1"),
            1,
            "CHECK needs 0.4.0",
        );
        let ips = |n: usize| {
            let entries: Vec<String> = (0..n)
                .map(|i| format!(r#"{{"address":"10.0.0.{}/24"}}"#, i + 1))
                .collect();
            format!(
                r#"{{"cniVersion":"1.0.0","name":"k","prevResult":{{"ips":[{}]}}}}"#,
                entries.join(",")
            )
        };
        check(
            &[],
            &ips(17),
            7,
            "prevResult.ips has 17 entries, over the limit of 16",
        );
    }

    #[test]
    fn netns_names_with_dots_that_are_not_parent_components_pass() {
        for netns in [
            "/var/run/netns/cni-1",
            "/var/run/netns/..x",
            "/var/run/netns/x..",
            "/proc/1/ns/net",
            "/a/./b",
        ] {
            check_netns(netns).unwrap_or_else(|e| panic!("{netns}: {e:?}"));
        }
    }

    #[test]
    fn prev_result_ips_are_deduplicated_in_order_up_to_the_cap() {
        let entries: Vec<String> = ["10.0.0.2", "fd00::1", "10.0.0.2", "10.0.0.1", "fd00::1"]
            .iter()
            .map(|a| format!(r#"{{"address":"{a}/8"}}"#))
            .collect();
        let conf = format!(
            r#"{{"cniVersion":"1.0.0","name":"k","prevResult":{{"ips":[{}]}}}}"#,
            entries.join(",")
        );
        let ips: Vec<String> = parse_config(conf.as_bytes())
            .unwrap()
            .ips
            .iter()
            .map(IpAddr::to_string)
            .collect();
        assert_eq!(ips, ["10.0.0.2", "fd00::1", "10.0.0.1"]);
        let sixteen: Vec<String> = (0..16)
            .map(|i| format!(r#"{{"address":"10.0.0.{}/8"}}"#, i + 1))
            .collect();
        let conf = format!(
            r#"{{"cniVersion":"1.0.0","name":"k","prevResult":{{"ips":[{}]}}}}"#,
            sixteen.join(",")
        );
        assert_eq!(
            parse_config(conf.as_bytes()).unwrap().ips.len(),
            16,
            "the cap admits its figure"
        );
    }

    #[test]
    fn add_builds_the_request() {
        let inv = parse(&env(&add_env()), CONF.as_bytes()).unwrap();
        assert_eq!(inv.command, Command::Add);
        let r = &inv.request;
        assert_eq!(
            (r.container_id.as_str(), r.ifname.as_str(), r.netns.as_str()),
            ("abc123", "eth0", "/var/run/netns/x")
        );
        assert_eq!(
            (
                r.pod_namespace.as_str(),
                r.pod_name.as_str(),
                r.pod_uid.as_str()
            ),
            ("default", "web-0", "u-1")
        );
        assert_eq!(r.ips, vec!["10.1.0.5", "fd00::5"]);
        assert_eq!(inv.config.agent_socket, PathBuf::from(DEFAULT_AGENT_SOCKET));
        let prev: Value = serde_json::from_slice(&r.prev_result).unwrap();
        assert_eq!(prev["ips"][0]["address"], "10.1.0.5/24");
        let out: Value = serde_json::from_str(&add_result(&inv.config)).unwrap();
        assert_eq!(out["cniVersion"], "1.0.0");
        assert_eq!(out["interfaces"][0]["name"], "eth0");
    }

    #[test]
    fn del_needs_neither_netns_nor_prev_result() {
        let vars = [
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_IFNAME", "eth0"),
        ];
        let inv = parse(&env(&vars), br#"{"cniVersion":"1.0.0","name":"k"}"#).unwrap();
        assert_eq!(inv.command, Command::Del);
        assert!(inv.request.ips.is_empty());
    }

    #[test]
    fn version_ignores_the_rest() {
        let inv = parse(&env(&[("CNI_COMMAND", "VERSION")]), b"garbage").unwrap();
        assert_eq!(inv.command, Command::Version);
    }
}
