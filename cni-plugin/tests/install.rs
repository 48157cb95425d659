//! The real `aether-cni install`, as the chart's install-cni init container runs it: the
//! binary copies its own executable (/proc/self/exe) into the bin folder, and the copy
//! answers the runtime as the plugin does.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_aether-cni");

fn install(dest: &Path, pod: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("install")
        .arg(dest)
        .stdin(Stdio::null())
        .env_remove("POD_NAME");
    if let Some(pod) = pod {
        cmd.env("POD_NAME", pod);
    }
    cmd.output().unwrap()
}

#[test]
fn installs_its_own_executable_which_then_serves_as_the_plugin() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("aether-cni"), b"an older plugin").unwrap();
    let out = install(dir.path(), Some("aether-agent-x7k2p"));
    assert!(out.status.success(), "{out:?}");
    let installed = dir.path().join("aether-cni");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("installed {}", installed.display())
    );
    assert_eq!(
        fs::read(&installed).unwrap(),
        fs::read(BIN).unwrap(),
        "the copy is not the binary itself"
    );
    assert_eq!(
        fs::metadata(&installed).unwrap().permissions().mode() & 0o7777,
        0o755
    );
    let left: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["aether-cni"], "a temporary file was left behind");

    // The copy is the plugin: VERSION from the runtime's env, no arguments.
    let version = Command::new(&installed)
        .env("CNI_COMMAND", "VERSION")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(version.status.success(), "{version:?}");
    assert!(
        String::from_utf8_lossy(&version.stdout).contains("\"supportedVersions\""),
        "{version:?}"
    );
}

#[test]
fn without_pod_name_it_installs_too_and_bad_calls_fail_naming_the_fault() {
    let dir = tempfile::tempdir().unwrap();
    let out = install(dir.path(), None);
    assert!(out.status.success(), "{out:?}");
    assert!(dir.path().join("aether-cni").exists());

    let missing = dir.path().join("no-such-folder");
    let out = install(&missing, Some("agent-a"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no-such-folder"),
        "{out:?}"
    );

    let out = install(dir.path(), Some("../escape"));
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("../escape"),
        "{out:?}"
    );

    let out = Command::new(BIN)
        .arg("install")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("usage: aether-cni install <dest-dir>"),
        "{out:?}"
    );
}
