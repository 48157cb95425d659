//! Re-asserts the node's chained CNI conflist (`--cni-conf-dir`), while this supervisor
//! owns the node.
//!
//! The runtime runs the plugins of the first network configuration in the folder, by
//! name (libcni sorts `*.conf`, `*.conflist` and `*.json`). A primary CNI that rewrites
//! its conflist (an upgrade, a restart) drops the `aether-cni` entry, and pods then start
//! without the mesh. The owner checks that file at takeover and every few seconds, and
//! appends the entry when it is missing. A standby never writes: two generations would
//! otherwise race on one node file.
//!
//! The file is root's, in a root-owned folder; still it is opened with `O_NOFOLLOW`, read
//! up to 1 MiB and parsed as JSON. A file that is not a conflist is reported by name and
//! left untouched. The rewrite is a temp file in the same folder (`O_EXCL|O_NOFOLLOW`,
//! the original's mode and owner), fsync, rename over the original, fsync of the folder:
//! a reader sees the old file or the new one, never a partial one (containerd #8607,
//! istio #44167).
//!
//! [`remove`] is the one way back, for the chart's uninstall hook (`--uninstall-cni`,
//! see `uninstall`): it takes the entry out of every configuration in the folder with the
//! same rewrite.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// The plugin type the entry names: the binary the chart installs in the CNI bin folder.
pub const PLUGIN_TYPE: &str = "aether-cni";
/// A conflist is a few KiB; a larger file is not one.
const MAX_BYTES: u64 = 1 << 20;
/// Our temp file; its name does not end in `.conf`, `.conflist` or `.json`, so the
/// runtime never reads it.
const TEMP_NAME: &str = ".aether-cni-conflist.tmp";

#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The folder holds no network configuration yet (the primary CNI has not written it).
    NoConflist,
    /// The first conflist already chains `aether-cni`: nothing written.
    Chained(PathBuf),
    /// The entry was missing and has been appended.
    Repaired(PathBuf),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: io::Error },
    #[error("{}: {reason}; left untouched", path.display())]
    Invalid { path: PathBuf, reason: String },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let path = path.to_owned();
    move |source| Error::Io { what, path, source }
}

/// The network configuration the runtime uses: the first `*.conf`, `*.conflist` or
/// `*.json` by name, as libcni orders them.
pub fn primary(dir: &Path) -> Result<Option<PathBuf>, Error> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(io_err("reading the CNI conf folder", dir))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.') && [".conf", ".conflist", ".json"].iter().any(|s| n.ends_with(s)))
        .collect();
    names.sort();
    Ok(names.first().map(|n| dir.join(n)))
}

/// The entry appended to the conflist's plugins.
pub fn entry(agent_socket: &Path) -> Value {
    json!({ "type": PLUGIN_TYPE, "agentSocket": agent_socket.to_string_lossy() })
}

/// Makes the node's first conflist chain `aether-cni`, appending `entry` when missing.
pub fn reassert(dir: &Path, entry: &Value) -> Result<Outcome, Error> {
    let Some(path) = primary(dir)? else { return Ok(Outcome::NoConflist) };
    let invalid = |reason: String| Error::Invalid { path: path.clone(), reason };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(io_err("opening (symlinks are refused)", &path))?;
    let meta = file.metadata().map_err(io_err("fstat", &path))?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1).read_to_end(&mut bytes).map_err(io_err("reading", &path))?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(invalid(format!("larger than {MAX_BYTES} bytes")));
    }
    let mut conf: Value = serde_json::from_slice(&bytes).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else {
        return Err(invalid(
            "no \"plugins\" list: a single-plugin configuration cannot chain aether-cni; make it a .conflist".into(),
        ));
    };
    if plugins.iter().any(|p| p.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)) {
        return Ok(Outcome::Chained(path));
    }
    plugins.push(entry.clone());
    let mut out = serde_json::to_vec_pretty(&conf).expect("a JSON value serializes");
    out.push(b'\n');
    write_atomically(dir, &path, &out, &meta)?;
    Ok(Outcome::Repaired(path))
}

/// Removes every `aether-cni` entry from the network configurations in `dir` (all of
/// them, not only the runtime's first: a file that was first when the entry went in may
/// not be now), each rewritten atomically like a re-assertion. For the uninstall only
/// (`--uninstall-cni`), run while the node lock is held so that no owner appends it
/// again. A file that is not a conflist is logged by name and left untouched. Returns the
/// files rewritten.
pub fn remove(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut names: Vec<String> = match fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| !n.starts_with('.') && [".conf", ".conflist", ".json"].iter().any(|s| n.ends_with(s)))
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("reading the CNI conf folder", dir)(e)),
    };
    names.sort();
    let mut rewritten = Vec::new();
    for name in names {
        let path = dir.join(name);
        match read_conf(&path) {
            Ok((mut conf, meta)) => {
                let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else { continue };
                let before = plugins.len();
                plugins.retain(|p| p.get("type").and_then(Value::as_str) != Some(PLUGIN_TYPE));
                if plugins.len() == before {
                    continue;
                }
                let mut out = serde_json::to_vec_pretty(&conf).expect("a JSON value serializes");
                out.push(b'\n');
                write_atomically(dir, &path, &out, &meta)?;
                rewritten.push(path);
            }
            Err(e) => tracing::warn!(error = %e, "not a conflist; left untouched"),
        }
    }
    Ok(rewritten)
}

/// Opens (never through a symlink), reads (at most [`MAX_BYTES`]) and parses one file.
fn read_conf(path: &Path) -> Result<(Value, fs::Metadata), Error> {
    let invalid = |reason: String| Error::Invalid { path: path.to_owned(), reason };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err("opening (symlinks are refused)", path))?;
    let meta = file.metadata().map_err(io_err("fstat", path))?;
    if !meta.is_file() {
        return Err(invalid("not a regular file".into()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1).read_to_end(&mut bytes).map_err(io_err("reading", path))?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(invalid(format!("larger than {MAX_BYTES} bytes")));
    }
    let conf = serde_json::from_slice(&bytes).map_err(|e| invalid(format!("not JSON: {e}")))?;
    Ok((conf, meta))
}

fn write_atomically(dir: &Path, path: &Path, bytes: &[u8], like: &fs::Metadata) -> Result<(), Error> {
    let tmp = dir.join(TEMP_NAME);
    // A leftover of a crash mid-write: ours by name. Unlinking a symlink removes the link.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_err("removing the leftover", &tmp)(e)),
        _ => {}
    }
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
            .map_err(io_err("creating", &tmp))?;
        f.write_all(bytes).map_err(io_err("writing", &tmp))?;
        std::os::unix::fs::fchown(&f, Some(like.uid()), Some(like.gid())).map_err(io_err("fchown", &tmp))?;
        f.set_permissions(fs::Permissions::from_mode(like.mode() & 0o7777)).map_err(io_err("fchmod", &tmp))?;
        f.sync_all().map_err(io_err("fsync", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("renaming over", path))?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync of the folder", dir))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTP: &str = r#"{
  "cniVersion": "1.0.0",
  "name": "k8s-pod-network",
  "plugins": [
    { "type": "ptp", "ipam": { "type": "host-local", "subnet": "10.88.0.0/16" } },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}"#;

    fn entry() -> Value {
        super::entry(Path::new("/run/aether/cni.sock"))
    }

    fn plugin_types(path: &Path) -> Vec<String> {
        let v: Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
        v["plugins"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn appends_the_entry_once_and_keeps_everything_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-ptp.conflist");
        fs::write(&path, PTP).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(reassert(dir.path(), &entry()).unwrap(), Outcome::Repaired(path.clone()));
        assert_eq!(plugin_types(&path), ["ptp", "portmap", "aether-cni"]);
        let v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let before: Value = serde_json::from_str(PTP).unwrap();
        assert_eq!(v["name"], before["name"]);
        assert_eq!(v["plugins"][0], before["plugins"][0]);
        assert_eq!(v["plugins"][2]["agentSocket"], "/run/aether/cni.sock");
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o7777, 0o644, "mode kept");
        assert!(!dir.path().join(TEMP_NAME).exists());

        // Chained already: not rewritten (same inode).
        let ino = fs::metadata(&path).unwrap().ino();
        assert_eq!(reassert(dir.path(), &entry()).unwrap(), Outcome::Chained(path.clone()));
        assert_eq!(fs::metadata(&path).unwrap().ino(), ino);
    }

    #[test]
    fn the_runtimes_choice_is_the_first_name_and_hidden_or_other_files_do_not_count() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(reassert(dir.path(), &entry()).unwrap(), Outcome::NoConflist);
        fs::write(dir.path().join(".hidden.conflist"), PTP).unwrap();
        fs::write(dir.path().join("README"), "x").unwrap();
        assert_eq!(reassert(dir.path(), &entry()).unwrap(), Outcome::NoConflist);
        fs::write(dir.path().join("20-b.conflist"), PTP).unwrap();
        fs::write(dir.path().join("10-a.conflist"), PTP).unwrap();
        assert_eq!(reassert(dir.path(), &entry()).unwrap(), Outcome::Repaired(dir.path().join("10-a.conflist")));
        assert_eq!(plugin_types(&dir.path().join("20-b.conflist")), ["ptp", "portmap"], "only the first is the runtime's");
    }

    #[test]
    fn bad_files_are_reported_by_name_and_left_untouched() {
        let cases: Vec<(&str, &[u8], &str)> = vec![
            ("10-broken.conflist", b"{\"plugins\": [", "not JSON"),
            ("10-single.conf", br#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#, "no \"plugins\" list"),
        ];
        for (name, body, want) in cases {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(name);
            fs::write(&path, body).unwrap();
            let err = reassert(dir.path(), &entry()).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains(want), "{name}: {err}");
            assert_eq!(fs::read(&path).unwrap(), body, "{name} changed");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-big.conflist");
        fs::write(&path, vec![b' '; (MAX_BYTES + 1) as usize]).unwrap();
        assert!(reassert(dir.path(), &entry()).unwrap_err().to_string().contains("larger than"));
    }

    #[test]
    fn a_symlink_is_refused_and_its_target_left_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.txt");
        fs::write(&target, PTP).unwrap();
        let conf = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&target, conf.path().join("10-ptp.conflist")).unwrap();
        let err = reassert(conf.path(), &entry()).unwrap_err().to_string();
        assert!(err.contains("10-ptp.conflist") && err.contains("symlinks are refused"), "{err}");
        assert_eq!(fs::read_to_string(&target).unwrap(), PTP);
    }

    #[test]
    fn remove_takes_the_entry_out_of_every_conflist_and_leaves_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let first = dir.path().join("10-ptp.conflist");
        let second = dir.path().join("20-old.conflist");
        let plain = dir.path().join("30-plain.conflist");
        let single = dir.path().join("40-single.conf");
        fs::write(&first, PTP).unwrap();
        fs::set_permissions(&first, fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(reassert(dir.path(), &entry()).unwrap(), Outcome::Repaired(_)));
        fs::copy(&first, &second).unwrap();
        fs::write(&plain, PTP).unwrap();
        fs::write(&single, r#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#).unwrap();
        fs::write(dir.path().join(".hidden.conflist"), fs::read(&first).unwrap()).unwrap();
        let plain_ino = fs::metadata(&plain).unwrap().ino();

        let mut got = remove(dir.path()).unwrap();
        got.sort();
        assert_eq!(got, [first.clone(), second.clone()]);
        for path in [&first, &second, &plain] {
            assert_eq!(plugin_types(path), ["ptp", "portmap"], "{}", path.display());
        }
        let v: Value = serde_json::from_slice(&fs::read(&first).unwrap()).unwrap();
        let before: Value = serde_json::from_str(PTP).unwrap();
        assert_eq!(v, before, "everything else kept");
        assert_eq!(fs::metadata(&first).unwrap().mode() & 0o7777, 0o644, "mode kept");
        assert_eq!(fs::metadata(&plain).unwrap().ino(), plain_ino, "a file without the entry is not rewritten");
        assert!(fs::read_to_string(dir.path().join(".hidden.conflist")).unwrap().contains("aether-cni"), "hidden files are not the runtime's");
        assert!(!dir.path().join(TEMP_NAME).exists());
        // Twice is a no-op, and a missing folder is nothing to remove.
        assert!(remove(dir.path()).unwrap().is_empty());
        assert!(remove(&dir.path().join("missing")).unwrap().is_empty());
    }

    #[test]
    fn remove_leaves_bad_files_and_symlinks_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.txt");
        let chained = r#"{"plugins":[{"type":"ptp"},{"type":"aether-cni"}]}"#;
        fs::write(&target, chained).unwrap();
        let conf = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&target, conf.path().join("10-link.conflist")).unwrap();
        fs::write(conf.path().join("20-broken.conflist"), "{\"plugins\": [").unwrap();
        assert!(remove(conf.path()).unwrap().is_empty());
        assert_eq!(fs::read_to_string(&target).unwrap(), chained);
        assert_eq!(fs::read_to_string(conf.path().join("20-broken.conflist")).unwrap(), "{\"plugins\": [");
    }

    #[test]
    fn a_leftover_temp_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(TEMP_NAME), "half a conflist").unwrap();
        fs::write(dir.path().join("10-ptp.conflist"), PTP).unwrap();
        assert!(matches!(reassert(dir.path(), &entry()).unwrap(), Outcome::Repaired(_)));
        assert!(!dir.path().join(TEMP_NAME).exists());
    }
}
