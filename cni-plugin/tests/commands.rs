//! The real `aether-cni chain` and `aether-cni uninstall`, as the node owner's supervisor
//! and the chart's uninstall hook run them: what each writes, what each leaves alone, and
//! how each fails.

use std::fs;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_aether-cni");
const PTP: &str = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp"}]}"#;

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn types(path: &Path) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn chain_appends_the_entry_once_and_says_so_in_the_log_format_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("10-ptp.conflist");
    let d = dir.path().to_str().unwrap();
    // No configuration yet: nothing to do, nothing said (the agent's /ready reports it).
    let out = run(&[
        "chain",
        "--cni-conf-dir",
        d,
        "--agent-socket",
        "/run/aether/cni.sock",
    ]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");

    fs::write(&conf, PTP).unwrap();
    let out = run(&[
        "chain",
        "--cni-conf-dir",
        d,
        "--agent-socket=/run/aether/cni.sock",
        "--log-format",
        "json",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(types(&conf), ["ptp", "aether-cni"]);
    let line: serde_json::Value = serde_json::from_slice(&out.stderr).expect("one JSON log line");
    assert_eq!(line["level"], "WARN", "{line}");
    assert!(
        line.to_string().contains("appended it") && line.to_string().contains("10-ptp.conflist"),
        "{line}"
    );

    // Chained already: the file is not rewritten (same inode) and nothing is said.
    let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(&conf).unwrap());
    let out = run(&[
        "chain",
        "--cni-conf-dir",
        d,
        "--agent-socket",
        "/run/aether/cni.sock",
    ]);
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&fs::metadata(&conf).unwrap()),
        ino
    );
}

#[test]
fn chain_fails_naming_the_file_and_leaves_it_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("10-single.conf");
    let single = r#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#;
    fs::write(&conf, single).unwrap();
    let out = run(&[
        "chain",
        "--cni-conf-dir",
        dir.path().to_str().unwrap(),
        "--agent-socket",
        "/s",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("10-single.conf") && err.contains("plugins") && err.contains("list"),
        "{err}"
    );
    assert_eq!(fs::read_to_string(&conf).unwrap(), single);
}

#[test]
fn bad_command_lines_get_the_usage_and_exit_2() {
    for args in [
        &["chain", "--cni-conf-dir"][..],
        &["chain", "--bogus", "x"],
        &["chain", "--agent-socket", "/s", "--log-format", "xml"],
        &["frobnicate"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("aether-cni chain --cni-conf-dir"),
            "{args:?}: {out:?}"
        );
    }
    // Asked for, the usage goes to stdout and the exit is 0.
    for help in ["--help", "-h", "help"] {
        let out = run(&[help]);
        assert_eq!(out.status.code(), Some(0), "{help}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("aether-cni chain --cni-conf-dir"),
            "{help}: {out:?}"
        );
    }
    // A missing required flag names it.
    let out = run(&["chain", "--agent-socket", "/s"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--cni-conf-dir is required"),
        "{out:?}"
    );
}

#[test]
fn uninstall_removes_the_entry_and_the_plugin_when_no_agent_holds_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let (run_dir, conf, bin) = (
        dir.path().join("run"),
        dir.path().join("net.d"),
        dir.path().join("bin"),
    );
    for d in [&run_dir, &conf, &bin] {
        fs::create_dir(d).unwrap();
    }
    fs::write(conf.join("10-ptp.conflist"), PTP).unwrap();
    let d = conf.to_str().unwrap();
    assert!(
        run(&["chain", "--cni-conf-dir", d, "--agent-socket", "/s"])
            .status
            .success()
    );
    fs::write(bin.join("aether-cni"), "plugin").unwrap();
    let out = run(&[
        "uninstall",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--cni-conf-dir",
        d,
        "--cni-bin-dir",
        bin.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(types(&conf.join("10-ptp.conflist")), ["ptp"]);
    assert!(!bin.join("aether-cni").exists());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("removed the plugin binary"),
        "{out:?}"
    );
}
