//! The node's chained CNI conflist: which file the runtime uses, whether it chains
//! `aether-cni`, and the one way to change it.
//!
//! The runtime runs the plugins of the first network configuration in the folder. A
//! primary CNI that rewrites its conflist (an upgrade, a restart) drops the `aether-cni`
//! entry, and pods then start without the mesh. The node's owner therefore checks that
//! file at takeover and every few seconds, and appends the entry when it is missing: its
//! supervisor runs `aether-cni chain` ([`reassert`]) as a short-lived process of its own,
//! so the privileged supervisor never parses the file. A standby never writes. The worker
//! only looks ([`chained`]) to report it on `/ready`.
//!
//! The file is root's, in a root-owned folder; still it is opened with `O_NOFOLLOW` and
//! `O_NONBLOCK` (a FIFO under a configuration's name must not hang the reader), its type
//! checked before any read, read up to 1 MiB and parsed as JSON. A file that is not a
//! conflist is reported by name and left untouched. The rewrite is a temp file in the same
//! folder (`O_EXCL|O_NOFOLLOW`, the original's mode and owner), fsync, an atomic exchange
//! with the original, fsync of the folder: a reader sees the old file or the new one,
//! never a partial one (containerd #8607, istio #44167). The primary CNI may rewrite the
//! file meanwhile; see [`rewrite`] for how neither change is lost.
//!
//! [`remove`] is the one way back, for the chart's uninstall hook (`aether-cni
//! uninstall`): it takes the entry out of every configuration in the folder with the same
//! rewrite.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{RenameFlags, renameat2};
use serde_json::{Value, json};

/// The plugin type the entry names: the binary the chart installs in the CNI bin folder.
pub const PLUGIN_TYPE: &str = "aether-cni";
/// A conflist is a few KiB; a larger file is not one.
const MAX_BYTES: u64 = 1 << 20;
/// Our temp file; its name does not end in `.conf`, `.conflist` or `.json`, so the
/// runtime never reads it.
const TEMP_NAME: &str = ".aether-cni-conflist.tmp";
/// How often a rewrite starts over because the file changed under it before giving up
/// until the next check.
const ATTEMPTS: usize = 20;
const NOT_A_LIST: &str = "no \"plugins\" list: a single-plugin configuration cannot chain aether-cni; make it a .conflist";

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
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{}: {reason}; left untouched", path.display())]
    Invalid { path: PathBuf, reason: String },
    #[error("{}: rewritten by another writer {} times while the entry went in; trying again at the next check", path.display(), ATTEMPTS)]
    Busy { path: PathBuf },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> Error {
    let path = path.to_owned();
    move |source| Error::Io { what, path, source }
}

/// The network configurations in `dir`, in the order the runtime reads them. As libcni
/// chooses them (containernetworking/cni `libcni/conf.go`, `ConfFiles(dir, [".conf",
/// ".conflist", ".json"])`, which containerd's go-cni `loadFromConfDir` then sorts with
/// `sort.Strings` and takes the first of): every entry that is not a directory (a symlink
/// counts, whatever it points to) whose extension (`filepath.Ext`: from the last dot) is
/// one of the three, dotfiles included; sorted by the bytes of the name; a missing folder
/// holds none.
pub fn configurations(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("reading the CNI conf folder", dir)(e)),
    };
    let mut names: Vec<OsString> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err("reading the CNI conf folder", dir))?;
        let name = entry.file_name();
        let ext_ok = [".conf", ".conflist", ".json"]
            .iter()
            .any(|x| name.as_bytes().ends_with(x.as_bytes()));
        if ext_ok && !entry.file_type().is_ok_and(|t| t.is_dir()) {
            names.push(name);
        }
    }
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// The network configuration the runtime uses: the first of [`configurations`].
pub fn primary(dir: &Path) -> Result<Option<PathBuf>, Error> {
    Ok(configurations(dir)?.into_iter().next())
}

/// The entry appended to the conflist's plugins.
pub fn entry(agent_socket: &Path) -> Value {
    json!({ "type": PLUGIN_TYPE, "agentSocket": agent_socket.to_string_lossy() })
}

/// Makes the node's first conflist chain `aether-cni`, appending `entry` when missing.
pub fn reassert(dir: &Path, entry: &Value) -> Result<Outcome, Error> {
    let Some(path) = primary(dir)? else {
        return Ok(Outcome::NoConflist);
    };
    let edit = |conf: &mut Value| {
        let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else {
            return Err(NOT_A_LIST.to_string());
        };
        if plugins.iter().any(is_ours) {
            return Ok(false);
        }
        plugins.push(entry.clone());
        Ok(true)
    };
    Ok(if rewrite(dir, &path, &edit, &mut |_| {})? {
        Outcome::Repaired(path)
    } else {
        Outcome::Chained(path)
    })
}

fn is_ours(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// Whether the configuration at `path` chains `aether-cni`; never writes. An error names
/// why the file is not a conflist.
pub fn chained(path: &Path) -> Result<bool, Error> {
    let conf = parse(&read(path)?.bytes, path)?;
    let Some(plugins) = conf.get("plugins").and_then(Value::as_array) else {
        return Err(Error::Invalid {
            path: path.to_owned(),
            reason: NOT_A_LIST.into(),
        });
    };
    Ok(plugins.iter().any(is_ours))
}

/// Removes every `aether-cni` entry from the network configurations in `dir` (all of
/// them, not only the runtime's first: a file that was first when the entry went in may
/// not be now), each rewritten like a re-assertion. For the uninstall only
/// (`aether-cni uninstall`), run while the node lock is held so that no owner appends it
/// again. A file that is not a conflist is logged by name and left untouched. Returns the
/// files rewritten.
pub fn remove(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let edit = |conf: &mut Value| {
        let Some(plugins) = conf.get_mut("plugins").and_then(Value::as_array_mut) else {
            return Ok(false);
        };
        let before = plugins.len();
        plugins.retain(|p| !is_ours(p));
        Ok(plugins.len() != before)
    };
    let mut rewritten = Vec::new();
    for path in configurations(dir)? {
        if let Err(e) = read(&path).and_then(|s| parse(&s.bytes, &path)) {
            tracing::warn!(error = %e, "not a conflist; left untouched");
            continue;
        }
        if rewrite(dir, &path, &edit, &mut |_| {})? {
            rewritten.push(path);
        }
    }
    Ok(rewritten)
}

/// One read of a configuration: which file it was, its bytes and its metadata.
struct Snapshot {
    id: (u64, u64),
    bytes: Vec<u8>,
    meta: fs::Metadata,
}

/// Opens without following a symlink and without blocking (a FIFO would block a plain
/// open until a writer came), checks that it is a regular file, reads at most
/// [`MAX_BYTES`].
fn read(path: &Path) -> Result<Snapshot, Error> {
    let invalid = |reason: &str| Error::Invalid {
        path: path.to_owned(),
        reason: reason.to_string(),
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err("opening (symlinks are refused)", path))?;
    let meta = file.metadata().map_err(io_err("fstat", path))?;
    if !meta.is_file() {
        return Err(invalid("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err("reading", path))?;
    if bytes.len() as u64 > MAX_BYTES {
        return Err(invalid(&format!("larger than {MAX_BYTES} bytes")));
    }
    Ok(Snapshot {
        id: (meta.dev(), meta.ino()),
        bytes,
        meta,
    })
}

fn parse(bytes: &[u8], path: &Path) -> Result<Value, Error> {
    serde_json::from_slice(bytes).map_err(|e| Error::Invalid {
        path: path.to_owned(),
        reason: format!("not JSON: {e}"),
    })
}

/// Where [`rewrite`] lets a test change the file under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The new version is in the temp file; the original is checked next.
    Written,
    /// The original was checked; the exchange is next.
    Checked,
}

/// Applies `edit` to the configuration at `path` (it returns whether it changed it, or
/// why the file is not a conflist), and puts the result in place. Returns whether it
/// wrote.
///
/// The primary CNI may rewrite the file meanwhile, by rename or in place. So, right
/// before the new version goes in, the file must still be the one read (same inode, same
/// bytes), or the edit starts over from what is there now. The new version then goes in
/// with `renameat2(RENAME_EXCHANGE)`, which leaves the replaced file at the temp name:
/// if that is not the one checked (a rewrite landed between the check and the exchange),
/// it is the newer version, and it goes back in with the edit applied. Either way the
/// file ends up holding both changes, after a few milliseconds at most. A file system
/// without the exchange gets a plain rename after the check.
fn rewrite(
    dir: &Path,
    path: &Path,
    edit: &dyn Fn(&mut Value) -> Result<bool, String>,
    hook: &mut dyn FnMut(Stage),
) -> Result<bool, Error> {
    let name = Path::new(
        path.file_name()
            .expect("a configuration's path ends in its name"),
    );
    let tmp = dir.join(TEMP_NAME);
    let folder = File::open(dir).map_err(io_err("opening the folder", dir))?;
    // What is at `path` and must still be there when the new version goes in.
    let mut expect = read(path)?;
    // A newer version that the exchange swapped out, to put back with the edit.
    let mut swapped_out: Option<Snapshot> = None;
    for _ in 0..ATTEMPTS {
        let from = swapped_out.as_ref().unwrap_or(&expect);
        let mut conf = parse(&from.bytes, path)?;
        let changed = edit(&mut conf).map_err(|reason| Error::Invalid {
            path: path.to_owned(),
            reason,
        })?;
        if !changed && swapped_out.is_none() {
            return Ok(false);
        }
        let bytes = if changed {
            let mut out = serde_json::to_vec_pretty(&conf).expect("a JSON value serializes");
            out.push(b'\n');
            out
        } else {
            from.bytes.clone()
        };
        let ours = write_temp(&tmp, &bytes, &from.meta)?;
        hook(Stage::Written);
        let now = settle(path, &expect).inspect_err(|_| drop(fs::remove_file(&tmp)))?;
        if (now.id, &now.bytes) != (expect.id, &expect.bytes) {
            let _ = fs::remove_file(&tmp);
            (expect, swapped_out) = (now, None);
            continue;
        }
        hook(Stage::Checked);
        match renameat2(
            &folder,
            Path::new(TEMP_NAME),
            &folder,
            name,
            RenameFlags::RENAME_EXCHANGE,
        ) {
            Ok(()) => {}
            Err(Errno::EINVAL | Errno::ENOSYS) => {
                fs::rename(&tmp, path)
                    .inspect_err(|_| drop(fs::remove_file(&tmp)))
                    .map_err(io_err("renaming over", path))?;
                folder
                    .sync_all()
                    .map_err(io_err("fsync of the folder", dir))?;
                return Ok(true);
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(io_err("exchanging with", path)(e.into()));
            }
        }
        let old = settle(&tmp, &expect);
        fs::remove_file(&tmp).map_err(io_err("removing the replaced file", &tmp))?;
        let old = old?;
        if (old.id, &old.bytes) == (expect.id, &expect.bytes) {
            folder
                .sync_all()
                .map_err(io_err("fsync of the folder", dir))?;
            return Ok(true);
        }
        expect = Snapshot {
            id: ours,
            bytes,
            meta: old.meta.clone(),
        };
        swapped_out = Some(old);
    }
    Err(Error::Busy {
        path: path.to_owned(),
    })
}

/// Reads `path`, which another writer may be rewriting in place: while it is neither
/// `expect` nor JSON (truncated, half written), again a little later, for up to 40 ms.
fn settle(path: &Path, expect: &Snapshot) -> Result<Snapshot, Error> {
    for _ in 0..20 {
        let s = read(path)?;
        if (s.id, &s.bytes) == (expect.id, &expect.bytes)
            || serde_json::from_slice::<Value>(&s.bytes).is_ok()
        {
            return Ok(s);
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    read(path)
}

/// Writes `bytes` to a fresh `tmp` with the mode and owner of `like`, synced. Returns the
/// new file's (dev, ino).
fn write_temp(tmp: &Path, bytes: &[u8], like: &fs::Metadata) -> Result<(u64, u64), Error> {
    // A leftover of a crash mid-write: ours by name. Unlinking a symlink removes the link.
    match fs::remove_file(tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(io_err("removing the leftover", tmp)(e));
        }
        _ => {}
    }
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(tmp)
            .map_err(io_err("creating", tmp))?;
        f.write_all(bytes).map_err(io_err("writing", tmp))?;
        std::os::unix::fs::fchown(&f, Some(like.uid()), Some(like.gid()))
            .map_err(io_err("fchown", tmp))?;
        f.set_permissions(fs::Permissions::from_mode(like.mode() & 0o7777))
            .map_err(io_err("fchmod", tmp))?;
        f.sync_all().map_err(io_err("fsync", tmp))?;
        let m = f.metadata().map_err(io_err("fstat", tmp))?;
        Ok((m.dev(), m.ino()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileTypeExt;

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
        v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn appends_the_entry_once_and_keeps_everything_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-ptp.conflist");
        fs::write(&path, PTP).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            reassert(dir.path(), &entry()).unwrap(),
            Outcome::Repaired(path.clone())
        );
        assert_eq!(plugin_types(&path), ["ptp", "portmap", "aether-cni"]);
        let v: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        let before: Value = serde_json::from_str(PTP).unwrap();
        assert_eq!(v["name"], before["name"]);
        assert_eq!(v["plugins"][0], before["plugins"][0]);
        assert_eq!(v["plugins"][2]["agentSocket"], "/run/aether/cni.sock");
        assert_eq!(
            fs::metadata(&path).unwrap().mode() & 0o7777,
            0o644,
            "mode kept"
        );
        assert!(!dir.path().join(TEMP_NAME).exists());

        // Chained already: not rewritten (same inode).
        let ino = fs::metadata(&path).unwrap().ino();
        assert_eq!(
            reassert(dir.path(), &entry()).unwrap(),
            Outcome::Chained(path.clone())
        );
        assert_eq!(fs::metadata(&path).unwrap().ino(), ino);
    }

    /// libcni's choice on a table of folder contents: (files, folders, the first).
    #[test]
    fn the_runtimes_choice_is_libcnis() {
        let cases: &[(&[&str], &[&str], Option<&str>)] = &[
            (&[], &[], None),
            (
                &[
                    "README",
                    "10-a.conflist.bak",
                    ".aether-cni-conflist.tmp",
                    "10-a.yaml",
                ],
                &[],
                None,
            ),
            (
                &["20-b.conflist", "10-a.conflist"],
                &[],
                Some("10-a.conflist"),
            ),
            // Dotfiles count: '.' sorts before the digits.
            (
                &["10-a.conflist", ".hidden.conflist"],
                &[],
                Some(".hidden.conflist"),
            ),
            (&["10-a.conflist", ".conf"], &[], Some(".conf")),
            // By bytes: "10" before "9", upper case before lower case, ".conf" before
            // ".conflist" of the same stem.
            (
                &["9-a.conflist", "10-a.conflist"],
                &[],
                Some("10-a.conflist"),
            ),
            (&["a.conflist", "B.conflist"], &[], Some("B.conflist")),
            (&["10-a.conflist", "10-a.conf"], &[], Some("10-a.conf")),
            (&["50.json", "60.conf"], &[], Some("50.json")),
            // Only the last extension counts; a folder never does.
            (
                &["10-a.json.conflist", "20.conf"],
                &["00.conflist"],
                Some("10-a.json.conflist"),
            ),
            (&["10-a.conf.json"], &[], Some("10-a.conf.json")),
            (&["10-A.CONF", "20.conf"], &[], Some("20.conf")),
        ];
        for (files, folders, want) in cases {
            let dir = tempfile::tempdir().unwrap();
            for f in *files {
                fs::write(dir.path().join(f), PTP).unwrap();
            }
            for d in *folders {
                fs::create_dir(dir.path().join(d)).unwrap();
            }
            let got = primary(dir.path()).unwrap();
            assert_eq!(
                got,
                want.map(|w| dir.path().join(w)),
                "{files:?} {folders:?}"
            );
        }
        // A symlink counts whatever it points to (then it is refused, below), and a name
        // that is not UTF-8 sorts by its bytes.
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("sub"), dir.path().join("05-link.conflist"))
            .unwrap();
        let odd = std::ffi::OsStr::from_bytes(b"\xff.conf");
        fs::write(dir.path().join(odd), PTP).unwrap();
        fs::write(dir.path().join("10-a.conflist"), PTP).unwrap();
        let names: Vec<_> = configurations(dir.path())
            .unwrap()
            .iter()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                std::ffi::OsStr::new("05-link.conflist"),
                std::ffi::OsStr::new("10-a.conflist"),
                odd
            ]
        );
        assert!(primary(&dir.path().join("missing")).unwrap().is_none());
        // Only the first is rewritten.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("20-b.conflist"), PTP).unwrap();
        fs::write(dir.path().join("10-a.conflist"), PTP).unwrap();
        assert_eq!(
            reassert(dir.path(), &entry()).unwrap(),
            Outcome::Repaired(dir.path().join("10-a.conflist"))
        );
        assert_eq!(
            plugin_types(&dir.path().join("20-b.conflist")),
            ["ptp", "portmap"]
        );
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("10-fifo.conflist");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.path().to_owned();
        std::thread::spawn(move || tx.send(reassert(&d, &entry()).map_err(|e| e.to_string())));
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(2))
            .expect("reassert blocked on a FIFO");
        let err = got.unwrap_err();
        assert!(
            err.contains("10-fifo.conflist") && err.contains("not a regular file"),
            "{err}"
        );
        assert!(fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo());
    }

    /// The primary CNI's rewrite, as it would do it: its own template (its change, no
    /// aether-cni), by rename or in place.
    fn primary_writes(path: &Path, n: usize, in_place: bool) {
        let conf = json!({"cniVersion": "1.0.0", "name": format!("net-{n}"), "plugins": [{"type": "ptp"}]});
        let bytes = serde_json::to_vec(&conf).unwrap();
        if in_place {
            fs::write(path, bytes).unwrap();
        } else {
            let tmp = path.with_extension("primary-tmp");
            fs::write(&tmp, bytes).unwrap();
            fs::rename(&tmp, path).unwrap();
        }
    }

    fn holds_both(path: &Path, n: usize) -> bool {
        let Ok(v) = serde_json::from_slice::<Value>(&fs::read(path).unwrap_or_default()) else {
            return false;
        };
        v["name"] == format!("net-{n}")
            && v["plugins"]
                .as_array()
                .is_some_and(|p| p.iter().any(is_ours))
    }

    #[test]
    fn a_rewrite_landing_during_the_reassertion_is_kept_with_the_entry() {
        for stage in [Stage::Written, Stage::Checked] {
            for in_place in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                let path = dir.path().join("10-ptp.conflist");
                primary_writes(&path, 0, false);
                let mut n = 0;
                let mut hook = |at: Stage| {
                    // The primary CNI rewrites the file twice, each time at `stage`.
                    if at == stage && n < 2 {
                        n += 1;
                        primary_writes(&path, n, in_place);
                    }
                };
                let e = entry();
                let edit = |conf: &mut Value| {
                    let plugins = conf["plugins"].as_array_mut().unwrap();
                    let missing = !plugins.iter().any(is_ours);
                    if missing {
                        plugins.push(e.clone());
                    }
                    Ok(missing)
                };
                assert!(rewrite(dir.path(), &path, &edit, &mut hook).unwrap());
                assert!(
                    holds_both(&path, 2),
                    "{stage:?} in_place={in_place}: {}",
                    fs::read_to_string(&path).unwrap()
                );
                assert!(!dir.path().join(TEMP_NAME).exists());
            }
        }
    }

    /// Two writers in a loop: the primary CNI rewriting its conflist, and the owner
    /// re-asserting. Once the primary stops, the file holds its last change and the entry
    /// within 100 ms.
    #[test]
    fn two_writers_in_a_loop_converge_to_both_changes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("10-ptp.conflist");
        primary_writes(&path, 0, false);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let owner = s.spawn(|| {
                let mut errors = 0;
                while !stop.load(Ordering::Relaxed) {
                    if reassert(dir.path(), &entry()).is_err() {
                        errors += 1;
                    }
                }
                errors
            });
            let rounds = 300;
            for n in 1..=rounds {
                primary_writes(&path, n, n % 3 == 0);
                std::thread::sleep(Duration::from_micros(300));
            }
            let done = Instant::now();
            while !holds_both(&path, rounds) {
                assert!(
                    done.elapsed() < Duration::from_millis(100),
                    "not converged: {}",
                    fs::read_to_string(&path).unwrap()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            let took = done.elapsed();
            stop.store(true, Ordering::Relaxed);
            // An in-place write can be read half-done: such a read is refused as not JSON,
            // and the next one goes through.
            let errors = owner.join().unwrap();
            eprintln!("converged {took:?} after the primary's last write; {errors} refused reads");
        });
        assert!(!dir.path().join(TEMP_NAME).exists());
    }

    #[test]
    fn bad_files_are_reported_by_name_and_left_untouched() {
        let cases: Vec<(&str, &[u8], &str)> = vec![
            ("10-broken.conflist", b"{\"plugins\": [", "not JSON"),
            (
                "10-single.conf",
                br#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#,
                "no \"plugins\" list",
            ),
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
        assert!(
            reassert(dir.path(), &entry())
                .unwrap_err()
                .to_string()
                .contains("larger than")
        );
    }

    #[test]
    fn a_symlink_is_refused_and_its_target_left_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere.txt");
        fs::write(&target, PTP).unwrap();
        let conf = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&target, conf.path().join("10-ptp.conflist")).unwrap();
        let err = reassert(conf.path(), &entry()).unwrap_err().to_string();
        assert!(
            err.contains("10-ptp.conflist") && err.contains("symlinks are refused"),
            "{err}"
        );
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
        assert!(matches!(
            reassert(dir.path(), &entry()).unwrap(),
            Outcome::Repaired(_)
        ));
        fs::copy(&first, &second).unwrap();
        fs::write(&plain, PTP).unwrap();
        fs::write(
            &single,
            r#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#,
        )
        .unwrap();
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
        assert_eq!(
            fs::metadata(&first).unwrap().mode() & 0o7777,
            0o644,
            "mode kept"
        );
        assert_eq!(
            fs::metadata(&plain).unwrap().ino(),
            plain_ino,
            "a file without the entry is not rewritten"
        );
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
        assert_eq!(
            fs::read_to_string(conf.path().join("20-broken.conflist")).unwrap(),
            "{\"plugins\": ["
        );
    }

    #[test]
    fn a_leftover_temp_file_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(TEMP_NAME), "half a conflist").unwrap();
        fs::write(dir.path().join("10-ptp.conflist"), PTP).unwrap();
        assert!(matches!(
            reassert(dir.path(), &entry()).unwrap(),
            Outcome::Repaired(_)
        ));
        assert!(!dir.path().join(TEMP_NAME).exists());
    }
}
