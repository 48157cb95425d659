//! A small CNI runtime: runs a plugin chain the way containerd and CRI-O do through
//! libcni, so that tests drive the real reference plugins and `aether-cni` together.
//!
//! - ADD runs the plugins in order. Each gets the chain's network config on stdin (its
//!   own plugin object, with the list's `name` and `cniVersion` added) and, from the
//!   second plugin on, the previous plugin's result as `prevResult`. The last result is
//!   the chain's.
//! - CHECK runs them in order and DEL in reverse, each with the result the ADD returned
//!   as `prevResult` (libcni's cached result), as the spec asks of a runtime.
//! - Each plugin is found by its `type` in the `CNI_PATH` folders and exec'd with the
//!   `CNI_*` variables and nothing else of the caller's environment.
//!
//! A chain can run its plugins inside a named network namespace (`ip netns exec`)
//! standing in for the node's own, so that the host side of what they build (a veth end,
//! a route) stays in a namespace the test created and deletes.

use std::ffi::OsString;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

/// The pod side of a call: what a runtime knows about the sandbox.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub container_id: String,
    /// The pod's network namespace (`CNI_NETNS`).
    pub netns: PathBuf,
    pub ifname: String,
    /// `CNI_ARGS` as key/value pairs, e.g. `K8S_POD_UID`.
    pub args: Vec<(String, String)>,
}

impl Sandbox {
    fn cni_args(&self) -> String {
        self.args
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";")
    }
}

/// A network config list: plugins run in order for ADD.
#[derive(Debug, Clone)]
pub struct Chain {
    pub name: String,
    pub cni_version: String,
    /// Each plugin's config object; `type` names the binary.
    pub plugins: Vec<Value>,
    /// Folders searched for plugin binaries, in order; also passed as `CNI_PATH`.
    pub cni_path: Vec<PathBuf>,
    /// Run each plugin inside this named network namespace instead of the caller's.
    pub host_netns: Option<String>,
}

/// One plugin's run within a chain call.
#[derive(Debug, Clone)]
pub struct Step {
    pub plugin: String,
    pub took: Duration,
}

/// What a successful chain call returned.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The last plugin's result (ADD); `Value::Null` for DEL and CHECK.
    pub result: Value,
    pub steps: Vec<Step>,
}

/// A plugin that failed: the chain stops there, as a runtime's does.
#[derive(Debug, Clone)]
pub struct PluginError {
    pub command: String,
    pub plugin: String,
    /// The CNI error code from the plugin's error JSON, when it printed one.
    pub code: Option<u64>,
    pub msg: String,
    pub stdout: String,
    pub stderr: String,
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of plugin {} failed", self.command, self.plugin)?;
        if let Some(code) = self.code {
            write!(f, " with CNI error {code}")?;
        }
        write!(f, ": {}", self.msg)?;
        if !self.stderr.trim().is_empty() {
            write!(f, " (stderr: {})", self.stderr.trim())?;
        }
        Ok(())
    }
}

impl std::error::Error for PluginError {}

impl Chain {
    /// ADD: every plugin in order, each result the next one's `prevResult`.
    pub fn add(&self, sandbox: &Sandbox) -> Result<Outcome, Box<PluginError>> {
        let mut prev: Option<Value> = None;
        let mut steps = Vec::new();
        for plugin in &self.plugins {
            let (out, step) = self.exec("ADD", plugin, sandbox, prev.as_ref())?;
            steps.push(step);
            let result: Value = serde_json::from_str(out.trim()).map_err(|e| {
                Box::new(PluginError {
                    command: "ADD".into(),
                    plugin: plugin_type(plugin).to_string(),
                    code: None,
                    msg: format!("its result is not JSON: {e}"),
                    stdout: out.clone(),
                    stderr: String::new(),
                })
            })?;
            prev = Some(result);
        }
        Ok(Outcome {
            result: prev.unwrap_or(Value::Null),
            steps,
        })
    }

    /// CHECK: every plugin in order, each with the ADD's result.
    pub fn check(&self, sandbox: &Sandbox, added: &Value) -> Result<Outcome, Box<PluginError>> {
        let mut steps = Vec::new();
        for plugin in &self.plugins {
            steps.push(self.exec("CHECK", plugin, sandbox, Some(added))?.1);
        }
        Ok(Outcome {
            result: Value::Null,
            steps,
        })
    }

    /// DEL: every plugin in reverse order, each with the ADD's result when the runtime
    /// still has it.
    pub fn del(
        &self,
        sandbox: &Sandbox,
        added: Option<&Value>,
    ) -> Result<Outcome, Box<PluginError>> {
        let mut steps = Vec::new();
        for plugin in self.plugins.iter().rev() {
            steps.push(self.exec("DEL", plugin, sandbox, added)?.1);
        }
        Ok(Outcome {
            result: Value::Null,
            steps,
        })
    }

    /// The stdin a plugin gets: its own object, the list's name and version, and the
    /// previous result.
    pub fn plugin_config(&self, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf: Map<String, Value> = plugin.as_object().cloned().unwrap_or_default();
        conf.insert("cniVersion".into(), Value::String(self.cni_version.clone()));
        conf.insert("name".into(), Value::String(self.name.clone()));
        match prev {
            Some(p) => conf.insert("prevResult".into(), p.clone()),
            None => conf.remove("prevResult"),
        };
        Value::Object(conf)
    }

    /// The binary for a plugin `type`, from the first `CNI_PATH` folder holding it.
    pub fn find(&self, kind: &str) -> Option<PathBuf> {
        if kind.is_empty() || kind.contains('/') {
            return None;
        }
        self.cni_path
            .iter()
            .map(|d| d.join(kind))
            .find(|p| p.is_file())
    }

    fn exec(
        &self,
        command: &str,
        plugin: &Value,
        sandbox: &Sandbox,
        prev: Option<&Value>,
    ) -> Result<(String, Step), Box<PluginError>> {
        let kind = plugin_type(plugin).to_string();
        let fail = |msg: String| {
            Box::new(PluginError {
                command: command.into(),
                plugin: kind.clone(),
                code: None,
                msg,
                stdout: String::new(),
                stderr: String::new(),
            })
        };
        let exe = self.find(&kind).ok_or_else(|| {
            fail(format!(
                "no binary named {kind:?} in CNI_PATH {}",
                self.cni_path_var().to_string_lossy()
            ))
        })?;
        let mut cmd = match &self.host_netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        cmd.env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &sandbox.container_id)
            .env("CNI_NETNS", &sandbox.netns)
            .env("CNI_IFNAME", &sandbox.ifname)
            .env("CNI_ARGS", sandbox.cni_args())
            .env("CNI_PATH", self.cni_path_var())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let conf = self.plugin_config(plugin, prev).to_string();
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .map_err(|e| fail(format!("spawning {}: {e}", exe.display())))?;
        // The config is a few KiB, well under a pipe's buffer: writing it all before
        // reading the output cannot deadlock.
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let written = stdin.write_all(conf.as_bytes());
        drop(stdin);
        let out = child
            .wait_with_output()
            .map_err(|e| fail(format!("waiting for {}: {e}", exe.display())))?;
        let took = start.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            if let Err(e) = written {
                return Err(fail(format!(
                    "writing the network config to its stdin: {e}"
                )));
            }
            return Ok((stdout, Step { plugin: kind, took }));
        }
        let error: Option<Value> = serde_json::from_str(stdout.trim()).ok();
        let code = error
            .as_ref()
            .and_then(|e| e.get("code"))
            .and_then(Value::as_u64);
        let msg = error
            .as_ref()
            .and_then(|e| e.get("msg"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| format!("exited {} without an error result", out.status));
        Err(Box::new(PluginError {
            command: command.into(),
            plugin: kind,
            code,
            msg,
            stdout,
            stderr,
        }))
    }

    fn cni_path_var(&self) -> OsString {
        std::env::join_paths(&self.cni_path).unwrap_or_default()
    }
}

fn plugin_type(plugin: &Value) -> &str {
    plugin.get("type").and_then(Value::as_str).unwrap_or("")
}

/// The addresses of a CNI result's `ips`, as `(address, prefix length)`.
pub fn result_ips(result: &Value) -> Vec<(std::net::IpAddr, u8)> {
    result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|e| e.get("address").and_then(Value::as_str))
        .filter_map(|a| {
            let (ip, len) = a.split_once('/')?;
            Some((ip.parse().ok()?, len.parse().ok()?))
        })
        .collect()
}

/// Where Debian's `containernetworking-plugins` installs the reference plugins.
pub const DEBIAN_CNI_DIR: &str = "/usr/lib/cni";

/// Whether the reference plugin `kind` is installed.
pub fn reference_plugin(kind: &str) -> Option<PathBuf> {
    Some(Path::new(DEBIAN_CNI_DIR).join(kind)).filter(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain() -> Chain {
        Chain {
            name: "net".into(),
            cni_version: "1.0.0".into(),
            plugins: vec![
                serde_json::json!({"type": "a", "x": 1}),
                serde_json::json!({"type": "b"}),
            ],
            cni_path: vec![],
            host_netns: None,
        }
    }

    #[test]
    fn each_plugin_gets_the_list_name_and_version_and_the_previous_result() {
        let c = chain();
        let first = c.plugin_config(&c.plugins[0], None);
        assert_eq!(
            first,
            serde_json::json!({"type": "a", "x": 1, "name": "net", "cniVersion": "1.0.0"})
        );
        let prev = serde_json::json!({"ips": [{"address": "10.0.0.2/24"}]});
        let second = c.plugin_config(&c.plugins[1], Some(&prev));
        assert_eq!(second["prevResult"], prev);
        assert_eq!(second["type"], "b");
    }

    #[test]
    fn result_ips_reads_address_and_prefix() {
        let r = serde_json::json!({"ips": [{"address": "10.250.3.2/24"}, {"address": "fd00::2/64"}, {"address": "junk"}]});
        assert_eq!(
            result_ips(&r),
            vec![
                ("10.250.3.2".parse().unwrap(), 24),
                ("fd00::2".parse().unwrap(), 64)
            ]
        );
    }

    #[test]
    fn a_missing_plugin_is_an_error_naming_it() {
        let c = chain();
        let sb = Sandbox {
            container_id: "c".into(),
            netns: "/x".into(),
            ifname: "eth0".into(),
            args: vec![],
        };
        let e = c.add(&sb).unwrap_err();
        assert_eq!(e.plugin, "a");
        assert!(e.msg.contains("no binary named \"a\""), "{e}");
    }
}
