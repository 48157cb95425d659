//! `aether-cni install <dest-dir>`: the chart's install-cni init container, with no shell.
//!
//! The plugin copies its own executable into the host's CNI bin folder so that the
//! container runtime never executes a half-written binary: the copy goes to a temporary
//! name in the same folder, is synced and made 0755, and only then renamed over
//! `aether-cni`; the folder is synced after the rename. The temporary name carries the
//! pod's name because during a surge roll two pods of the DaemonSet run this on one node,
//! and both may be pid 1 of their own namespace and share the node's hostname.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The name the runtime executes, from the conflist's `"type": "aether-cni"`.
pub const PLUGIN_NAME: &str = "aether-cni";

/// The installed plugin's mode: the runtime (root) executes it; nobody writes it.
const MODE: u32 = 0o755;

/// The longest instance name that keeps the temporary name within NAME_MAX (255 bytes).
/// A pod name may have 253; a DaemonSet's pods have at most 63 plus a 6-character suffix.
const MAX_INSTANCE: usize = 255 - ".aether-cni..tmp".len();

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "instance name {0:?} must be 1 to 239 of [A-Za-z0-9._-] and not start with '.' (it names the temporary file)"
    )]
    BadInstance(String),
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> InstallError + use<> {
    let path = path.to_path_buf();
    move |source| InstallError::Io {
        action,
        path,
        source,
    }
}

/// The temporary name in `dest_dir` for the copy made by `instance` (the pod's name).
pub fn temp_path(dest_dir: &Path, instance: &str) -> PathBuf {
    dest_dir.join(format!(".{PLUGIN_NAME}.{instance}.tmp"))
}

fn check_instance(instance: &str) -> Result<(), InstallError> {
    let ok = !instance.is_empty()
        && instance.len() <= MAX_INSTANCE
        && !instance.starts_with('.')
        && instance
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(InstallError::BadInstance(instance.to_string()))
    }
}

/// Copies `source` to `<dest_dir>/aether-cni` atomically (see the module header) and
/// returns the installed path. On failure the temporary file is removed and an existing
/// `aether-cni` is left as it was.
pub fn install(source: &Path, dest_dir: &Path, instance: &str) -> Result<PathBuf, InstallError> {
    check_instance(instance)?;
    let target = dest_dir.join(PLUGIN_NAME);
    let tmp = temp_path(dest_dir, instance);
    let mut src = File::open(source).map_err(io_err("opening the plugin to install", source))?;
    // A copy left by an earlier run of this pod (killed mid-copy) is replaced. Removing
    // first and then creating with O_EXCL never follows a symlink planted at that name.
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("removing the stale temporary file", &tmp)(e)),
    }
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o700)
        .open(&tmp)
        .map_err(io_err("creating the temporary file", &tmp))?;
    let written = (|| {
        io::copy(&mut src, &mut out).map_err(io_err("copying the plugin to", &tmp))?;
        out.set_permissions(fs::Permissions::from_mode(MODE))
            .map_err(io_err("chmod 0755 of", &tmp))?;
        out.sync_all().map_err(io_err("fsync of", &tmp))?;
        drop(out);
        fs::rename(&tmp, &target).map_err(io_err("renaming the temporary file over", &target))
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename is durable once the folder's entry is.
    File::open(dest_dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync of the folder", dest_dir))?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn source(dir: &Path, content: &[u8]) -> PathBuf {
        let path = dir.join("source-plugin");
        fs::write(&path, content).unwrap();
        path
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    /// The folder's names other than the source, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "source-plugin")
            .collect();
        names.sort();
        names
    }

    #[test]
    fn installs_a_0755_copy_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let src = source(dir.path(), b"new plugin");
        let installed = install(&src, dir.path(), "agent-x7k2p").unwrap();
        assert_eq!(installed, dir.path().join("aether-cni"));
        assert_eq!(fs::read(&installed).unwrap(), b"new plugin");
        assert_eq!(mode(&installed), 0o755);
        assert_eq!(names(dir.path()), ["aether-cni"]);
    }

    #[test]
    fn replaces_the_old_plugin_by_rename() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("aether-cni");
        fs::write(&old, b"old plugin").unwrap();
        // A runtime that opened the old binary keeps reading the old inode.
        let held = File::open(&old).unwrap();
        let src = source(dir.path(), b"new plugin");
        install(&src, dir.path(), "agent-b").unwrap();
        assert_eq!(fs::read(&old).unwrap(), b"new plugin");
        assert_eq!(io::read_to_string(held).unwrap(), "old plugin");
        assert_eq!(names(dir.path()), ["aether-cni"]);
    }

    #[test]
    fn a_stale_temporary_file_or_symlink_is_replaced_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let src = source(dir.path(), b"new plugin");
        fs::write(temp_path(dir.path(), "agent-a"), b"half a plugin").unwrap();
        install(&src, dir.path(), "agent-a").unwrap();
        assert_eq!(names(dir.path()), ["aether-cni"]);

        let victim = dir.path().join("victim");
        fs::write(&victim, b"not to be written").unwrap();
        symlink(&victim, temp_path(dir.path(), "agent-c")).unwrap();
        install(&src, dir.path(), "agent-c").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"not to be written");
        assert_eq!(names(dir.path()), ["aether-cni", "victim"]);
    }

    #[test]
    fn failures_name_the_path_and_leave_the_old_plugin() {
        let dir = tempfile::tempdir().unwrap();
        let src = source(dir.path(), b"new plugin");
        let missing = dir.path().join("no-such-folder");
        let e = install(&src, &missing, "agent-a").unwrap_err().to_string();
        assert!(
            e.contains("creating the temporary file") && e.contains("no-such-folder"),
            "{e}"
        );

        fs::write(dir.path().join("aether-cni"), b"old plugin").unwrap();
        let e = install(&dir.path().join("no-such-source"), dir.path(), "agent-a")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("opening the plugin to install") && e.contains("no-such-source"),
            "{e}"
        );
        // The target is a folder: the rename fails, and the temporary file goes with it.
        let blocked = tempfile::tempdir().unwrap();
        fs::create_dir(blocked.path().join("aether-cni")).unwrap();
        fs::write(blocked.path().join("aether-cni").join("x"), b"").unwrap();
        let e = install(&src, blocked.path(), "agent-a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("renaming the temporary file over"), "{e}");
        assert!(!temp_path(blocked.path(), "agent-a").exists());
        assert_eq!(
            fs::read(dir.path().join("aether-cni")).unwrap(),
            b"old plugin"
        );
    }

    #[test]
    fn instance_names_that_are_no_pod_name_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = source(dir.path(), b"new plugin");
        for bad in [
            "",
            "../x",
            "a/b",
            ".hidden",
            "a b",
            &"a".repeat(MAX_INSTANCE + 1),
        ] {
            let e = install(&src, dir.path(), bad).unwrap_err();
            assert!(matches!(e, InstallError::BadInstance(_)), "{bad:?}: {e}");
        }
        assert_eq!(names(dir.path()), Vec::<String>::new());
        install(&src, dir.path(), &"a".repeat(MAX_INSTANCE)).unwrap();
    }
}
