//! Preparing the run, state and health folders at start, before any worker exists.
//!
//! The run dir must be this supervisor's and writable by nobody else: it replaces stale
//! sockets there by path, which is safe only while no other uid can rename in it. The
//! state and health dirs are made the worker's, with an exact mode.

use std::os::unix::fs::{MetadataExt, PermissionsExt, lchown};
use std::path::{Path, PathBuf};

use nix::unistd::{getegid, geteuid};

#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("{what} {path}: {source}")]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{path} is not a directory (a symlink?); refusing to prepare it for the worker")]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} must be owned by this supervisor (uid {me}) and writable by nobody else, but is owned by uid {uid} with mode {mode:o}; refusing to manage node sockets there"
    )]
    NotOurs { path: PathBuf, me: u32, uid: u32, mode: u32 },
}

/// Makes `dir` (creating it) owned by `owner` with `mode`, for the worker.
pub fn prepare_dir(dir: &Path, owner: Option<(u32, u32)>, mode: u32) -> Result<(), DirError> {
    prepare(dir, owner, mode, false)
}

/// The run dir: ours, or refused.
pub fn prepare_run_dir(dir: &Path) -> Result<(), DirError> {
    prepare(dir, None, 0o755, true)
}

fn prepare(dir: &Path, owner: Option<(u32, u32)>, mode: u32, must_be_ours: bool) -> Result<(), DirError> {
    let io = |what| move |source| DirError::Io { what, path: dir.to_owned(), source };
    std::fs::create_dir_all(dir).map_err(io("create"))?;
    let m = std::fs::symlink_metadata(dir).map_err(io("lstat"))?;
    if !m.is_dir() {
        return Err(DirError::NotADirectory { path: dir.to_owned() });
    }
    let me = (geteuid().as_raw(), getegid().as_raw());
    if must_be_ours && (m.uid() != me.0 || m.mode() & 0o022 != 0) {
        return Err(DirError::NotOurs { path: dir.to_owned(), me: me.0, uid: m.uid(), mode: m.mode() & 0o7777 });
    }
    if m.mode() & 0o1002 == 0o1002 {
        // A shared sticky folder such as the host's /tmp: never chmod or give it away.
        // The worker can create its own socket there.
        return Ok(());
    }
    // chmod of a file owned by another uid needs CAP_FOWNER, which the supervisor does
    // not hold: set the mode while the folder is ours, then give it away.
    if m.mode() & 0o7777 != mode {
        if m.uid() != me.0 {
            lchown(dir, Some(me.0), Some(me.1)).map_err(io("chown"))?;
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(io("chmod"))?;
    }
    if let Some((uid, gid)) = owner {
        lchown(dir, Some(uid), Some(gid)).map_err(io("chown"))?;
    }
    Ok(())
}
