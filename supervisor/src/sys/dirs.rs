//! Preparing the run, state and health folders at start, before any worker exists.
//!
//! The run dir must be this supervisor's and writable by nobody else: it replaces stale
//! sockets there by path, which is safe only while no other uid can rename in it. The
//! state and health dirs are made the worker's, with an exact mode.
//!
//! The worker's state folder is also repaired inside. systemd re-owns a unit's
//! `StateDirectory=` tree to the unit's user (root) at every start whose top folder is not
//! that user's, and an operator may `chown -R` it: the worker then cannot open its own
//! records. A state folder found owned by this supervisor therefore has everything inside
//! that this supervisor owns given back to the worker, but only in a folder marked as
//! created for the worker ([`MARKER`]), so that a `--state-dir` pointed at a system folder
//! by mistake is never re-owned wholesale. The walk goes by descriptor and never follows a
//! symlink; it skips devices and any non-folder with a second hard link, so that nothing
//! outside the tree can be given to the worker through it.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, SFlag, fstat, fstatat};
use nix::unistd::{Gid, Uid, fchown, fchownat, getegid, geteuid};
use shared_proto::handoff::{PathError, check_folders_on_path};

/// Written by the supervisor, root's and empty, into a worker's state folder it found
/// empty: the folder is the worker's tree, which may be re-owned recursively.
pub const MARKER: &str = ".aether-worker-state";
/// The worker's tree is two levels deep (`pods/<uid>.json`); deeper is not walked.
const MAX_DEPTH: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a directory (a symlink?); refusing to prepare it for the worker")]
    NotADirectory { path: PathBuf },
    #[error(
        "{path} must be owned by this supervisor (uid {me}) and writable by nobody else, but is owned by uid {uid} with mode {mode:o}; refusing to manage node sockets there"
    )]
    NotOurs {
        path: PathBuf,
        me: u32,
        uid: u32,
        mode: u32,
    },
    #[error(transparent)]
    Path(#[from] PathError),
}

/// What to make of a folder's inside.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inside {
    Leave,
    /// The worker's state: re-owned when found re-owned (see the module header).
    WorkerTree,
}

/// Makes `dir` (creating it) owned by `owner` with `mode`, for the worker.
pub fn prepare_dir(dir: &Path, owner: Option<(u32, u32)>, mode: u32) -> Result<(), DirError> {
    prepare(dir, owner, mode, false, Inside::Leave)
}

/// The worker's state folder: [`prepare_dir`], and its inside given back to the worker
/// when the folder was found re-owned to this supervisor.
pub fn prepare_state_dir(dir: &Path, owner: Option<(u32, u32)>) -> Result<(), DirError> {
    prepare(dir, owner, 0o700, false, Inside::WorkerTree)
}

/// The run dir: ours, in folders only root or we can change, or refused.
pub fn prepare_run_dir(dir: &Path) -> Result<(), DirError> {
    // Before anything is created there, and again once each folder exists.
    check_folders_on_path(dir)?;
    prepare(dir, None, 0o755, true, Inside::Leave)?;
    Ok(check_folders_on_path(dir)?)
}

fn prepare(
    dir: &Path,
    owner: Option<(u32, u32)>,
    mode: u32,
    must_be_ours: bool,
    inside: Inside,
) -> Result<(), DirError> {
    std::fs::create_dir_all(dir).map_err(|source| DirError::Io {
        what: "create",
        path: dir.to_owned(),
        source,
    })?;
    prepare_at(&open_folder(dir)?, dir, owner, mode, must_be_ours, inside)
}

/// The folder itself, never through a symlink at its path. Every step of [`prepare_at`]
/// goes through this one descriptor: a symlink swapped in for the folder afterwards
/// changes nothing. O_PATH needs no read permission (the supervisor has no
/// CAP_DAC_OVERRIDE).
fn open_folder(dir: &Path) -> Result<OwnedFd, DirError> {
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    nix::fcntl::open(dir, flags, Mode::empty()).map_err(|e| match e {
        nix::Error::ENOTDIR | nix::Error::ELOOP => DirError::NotADirectory {
            path: dir.to_owned(),
        },
        e => DirError::Io {
            what: "open",
            path: dir.to_owned(),
            source: e.into(),
        },
    })
}

fn prepare_at(
    fd: &OwnedFd,
    dir: &Path,
    owner: Option<(u32, u32)>,
    mode: u32,
    must_be_ours: bool,
    inside: Inside,
) -> Result<(), DirError> {
    let io = |what| {
        move |source| DirError::Io {
            what,
            path: dir.to_owned(),
            source,
        }
    };
    let nix_io = |what| {
        move |e: nix::Error| DirError::Io {
            what,
            path: dir.to_owned(),
            source: e.into(),
        }
    };
    let st = fstat(fd).map_err(nix_io("fstat"))?;
    let (uid, m) = (st.st_uid, st.st_mode & 0o7777);
    let me = (geteuid().as_raw(), getegid().as_raw());
    if must_be_ours && (uid != me.0 || m & 0o022 != 0) {
        return Err(DirError::NotOurs {
            path: dir.to_owned(),
            me: me.0,
            uid,
            mode: m,
        });
    }
    if m & 0o1002 == 0o1002 {
        // A shared sticky folder such as the host's /tmp: never chmod or give it away.
        // The worker can create its own socket there.
        return Ok(());
    }
    let chown = |(u, g): (u32, u32)| {
        fchownat(
            fd,
            "",
            Some(Uid::from_raw(u)),
            Some(Gid::from_raw(g)),
            AtFlags::AT_EMPTY_PATH,
        )
        .map_err(nix_io("chown"))
    };
    // chmod of a file owned by another uid needs CAP_FOWNER, which the supervisor does
    // not hold: set the mode while the folder is ours, then give it away.
    if m != mode {
        if uid != me.0 {
            chown(me)?;
        }
        // O_PATH allows no fchmod; /proc/self/fd reaches the same inode.
        let by_fd = format!("/proc/self/fd/{}", fd.as_raw_fd());
        std::fs::set_permissions(by_fd, std::fs::Permissions::from_mode(mode))
            .map_err(io("chmod"))?;
    }
    if let Some(to) = owner {
        // Found ours (or just made ours): the inside is readable now, and no longer once
        // the folder is the worker's (no CAP_DAC_READ_SEARCH).
        if inside == Inside::WorkerTree && uid == me.0 && to.0 != me.0 {
            reown_worker_tree(fd, dir, me.0, to).map_err(nix_io("re-own the inside of"))?;
        }
        chown(to)?;
    }
    Ok(())
}

/// Marks an empty state folder as the worker's, or gives everything inside a marked one
/// that `me` owns to `to`.
fn reown_worker_tree(folder: &OwnedFd, dir: &Path, me: u32, to: (u32, u32)) -> nix::Result<()> {
    let top = openat(
        folder,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let names = entries(&top)?;
    let marked = fstatat(&top, MARKER, AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| st.st_uid == me && kind(&st) == SFlag::S_IFREG);
    if names.is_empty() {
        let flags =
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        return match openat(&top, MARKER, flags, Mode::S_IRUSR) {
            Ok(_) | Err(nix::Error::EEXIST) => Ok(()),
            Err(e) => Err(e),
        };
    }
    if !marked {
        let (uid, gid) = to;
        tracing::warn!(
            dir = %dir.display(),
            "the state folder is this supervisor's but not marked as made for the worker; its inside is left as it is (if the worker cannot read it: chown -R {uid}:{gid} it)"
        );
        return Ok(());
    }
    let mut count = 0;
    walk(&top, names, me, to, 0, &mut count)?;
    if count > 0 {
        tracing::warn!(dir = %dir.display(), count, "the worker's state had been re-owned (by systemd or by hand); given back to the worker");
    }
    Ok(())
}

fn kind(st: &nix::sys::stat::FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
}

/// The names in `dir`, but for `.`, `..` and the marker.
fn entries(dir: &OwnedFd) -> nix::Result<Vec<CString>> {
    let mut d = Dir::from_fd(nix::unistd::dup(dir)?)?;
    let names = d
        .iter()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_owned());
    Ok(names
        .filter(|n| ![&b"."[..], b"..", MARKER.as_bytes()].contains(&n.as_bytes()))
        .collect())
}

/// Gives `me`'s entries under `dir` to `to`, children before their folder (the folder's
/// new owner shuts this supervisor out of it).
fn walk(
    dir: &OwnedFd,
    names: Vec<CString>,
    me: u32,
    to: (u32, u32),
    depth: usize,
    count: &mut usize,
) -> nix::Result<()> {
    let (uid, gid) = (Some(Uid::from_raw(to.0)), Some(Gid::from_raw(to.1)));
    for name in names {
        let is_dir = fstatat(dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .is_ok_and(|st| kind(&st) == SFlag::S_IFDIR);
        // The descriptor fixes which file is checked and changed.
        let how = OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | if is_dir {
                OFlag::O_DIRECTORY
            } else {
                OFlag::O_PATH
            };
        let fd = match openat(dir, name.as_c_str(), how, Mode::empty()) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(name = ?name, error = %e, "cannot open an entry of the worker's state; left as it is");
                continue;
            }
        };
        let st = fstat(&fd)?;
        if st.st_uid != me {
            continue;
        }
        match kind(&st) {
            SFlag::S_IFDIR if is_dir && depth + 1 < MAX_DEPTH => {
                walk(&fd, entries(&fd)?, me, to, depth + 1, count)?;
                fchown(&fd, uid, gid)?;
            }
            k if k == SFlag::S_IFDIR
                || k == SFlag::S_IFBLK
                || k == SFlag::S_IFCHR
                || st.st_nlink != 1 =>
            {
                tracing::warn!(name = ?name, "a device, a hard-linked file or a folder nested too deep in the worker's state; left as it is");
                continue;
            }
            _ => fchownat(&fd, "", uid, gid, AtFlags::AT_EMPTY_PATH)?,
        }
        *count += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, lchown, symlink};
    use std::path::Path;

    use super::*;

    const WORKER: (u32, u32) = (65532, 65532);

    fn owner(p: &Path) -> (u32, u32) {
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.uid(), m.gid())
    }

    /// `chown -R 0:0`, symlinks themselves, as systemd re-owns a `StateDirectory=` tree.
    /// A new folder with `mode` (the umask aside).
    fn folder(p: &Path, mode: u32) {
        std::fs::create_dir(p).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn chown_tree_to_root(p: &Path) {
        lchown(p, Some(0), Some(0)).unwrap();
        if std::fs::symlink_metadata(p).unwrap().is_dir() {
            for e in std::fs::read_dir(p).unwrap() {
                chown_tree_to_root(&e.unwrap().path());
            }
        }
    }

    /// A symlink at the folder's path is refused by name for every folder, and neither
    /// it nor its target is touched.
    #[test]
    fn a_symlinked_run_state_or_health_folder_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        folder(&target, 0o755);
        let link = tmp.path().join("link");
        symlink(&target, &link).unwrap();
        let results = [
            prepare_run_dir(&link),
            prepare_state_dir(&link, None),
            prepare_dir(&link, None, 0o700),
        ];
        for r in results {
            match r {
                Err(DirError::NotADirectory { path }) => assert_eq!(path, link),
                other => panic!("a symlinked folder was accepted: {other:?}"),
            }
        }
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(std::fs::metadata(&target).unwrap().mode() & 0o7777, 0o755);
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
    }

    /// A symlink swapped in for the folder after it was opened changes nothing: the mode
    /// and the owner go to the folder that was opened, and the symlink's target is left as
    /// it was.
    #[test]
    fn a_symlink_swapped_in_after_the_open_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, moved, victim) = (
            tmp.path().join("health"),
            tmp.path().join("moved"),
            tmp.path().join("victim"),
        );
        folder(&dir, 0o755);
        folder(&victim, 0o755);
        let fd = open_folder(&dir).unwrap();
        std::fs::rename(&dir, &moved).unwrap();
        symlink(&victim, &dir).unwrap();
        let worker = geteuid().is_root().then_some(WORKER);
        prepare_at(&fd, &dir, worker, 0o700, false, Inside::Leave).unwrap();
        assert_eq!(std::fs::metadata(&moved).unwrap().mode() & 0o7777, 0o700);
        assert_eq!(std::fs::metadata(&victim).unwrap().mode() & 0o7777, 0o755);
        if let Some(w) = worker {
            assert_eq!(owner(&moved), w);
            assert_eq!(owner(&victim), (0, 0));
        }
    }

    /// A folder of another owner whose mode is wrong is taken back (chown to the
    /// supervisor), set to its mode, then given to the worker: another uid's 0755 folder
    /// ends 0700 and the worker's. Without CAP_FOWNER, as under the chart, the chmod works
    /// only because of the chown back; the test drops it on a thread of its own.
    #[test]
    fn a_folder_of_another_owner_with_the_wrong_mode_ends_with_its_mode_and_the_workers() {
        if !geteuid().is_root() {
            eprintln!("SKIPPED: chown to other uids needs root (CI runs as root)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let health = tmp.path().join("health");
        folder(&health, 0o755);
        lchown(&health, Some(1000), Some(1000)).unwrap();
        let prepared = std::thread::scope(|s| {
            s.spawn(|| {
                caps::drop(None, caps::CapSet::Effective, caps::Capability::CAP_FOWNER).unwrap();
                prepare_dir(&health, Some(WORKER), 0o700)
            })
            .join()
            .unwrap()
        });
        prepared.unwrap();
        let m = std::fs::symlink_metadata(&health).unwrap();
        assert_eq!(
            (m.mode() & 0o7777, m.uid(), m.gid()),
            (0o700, WORKER.0, WORKER.1)
        );
        // Already right: left as it is.
        prepare_dir(&health, Some(WORKER), 0o700).unwrap();
        assert_eq!(owner(&health), WORKER);
    }

    /// A run dir in a folder another user owns, or that others may write, is refused,
    /// naming the folder, also when a symlink leads there or lies in such a folder; a
    /// root's symlink in a root's folder (as `/var/run`) leads to a run dir that passes.
    #[test]
    fn a_run_dir_in_a_folder_another_user_can_change_is_refused() {
        if !geteuid().is_root() {
            eprintln!("SKIPPED: giving folders to other uids needs root (CI runs as root)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let at = |p: &str| tmp.path().join(p);
        folder(&at("theirs"), 0o755);
        lchown(at("theirs"), Some(1000), Some(1000)).unwrap();
        folder(&at("open"), 0o777);
        folder(&at("good"), 0o755);
        symlink(at("theirs"), at("to-theirs")).unwrap();
        symlink(at("good"), at("theirs/to-good")).unwrap();
        symlink(at("good"), at("var-run")).unwrap();
        for (run_dir, unsafe_folder) in [
            ("theirs/run", "theirs"),
            ("open/run", "open"),
            ("to-theirs/run", "theirs"),
            ("theirs/to-good/run", "theirs"),
        ] {
            match prepare_run_dir(&at(run_dir)) {
                Err(e @ DirError::Path(PathError::UnsafeFolder { .. })) => {
                    let DirError::Path(PathError::UnsafeFolder { folder, .. }) = &e else {
                        unreachable!()
                    };
                    assert_eq!(folder, &at(unsafe_folder), "{run_dir}: {e}");
                    assert!(
                        e.to_string()
                            .contains(&at(unsafe_folder).display().to_string()),
                        "{e}"
                    );
                }
                other => panic!("{run_dir} was accepted: {other:?}"),
            }
            assert!(
                !at(run_dir).exists(),
                "{run_dir} was created before it was refused"
            );
        }
        prepare_run_dir(&at("var-run/run")).unwrap();
        prepare_run_dir(&at("good/run")).unwrap();
        let sticky = at("sticky");
        folder(&sticky, 0o1777);
        prepare_run_dir(&sticky.join("run")).unwrap();
    }

    #[test]
    fn a_state_folder_re_owned_to_root_is_given_back_to_the_worker_and_nothing_outside_it() {
        if !geteuid().is_root() {
            eprintln!("SKIPPED: re-owning to the worker's uid needs root (CI runs as root)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        prepare_state_dir(&state, Some(WORKER)).unwrap();
        assert_eq!(owner(&state), WORKER);
        assert_eq!(
            owner(&state.join(MARKER)),
            (0, 0),
            "the marker is the supervisor's"
        );
        // What the worker writes, and what a compromised one could plant: a symlink and a
        // hard link to files outside, and a folder nested deeper than its layout.
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, "root's").unwrap();
        std::fs::create_dir_all(state.join("pods")).unwrap();
        std::fs::write(state.join("pods/a.json"), "{}").unwrap();
        std::fs::write(state.join("mesh-dns.json"), "{}").unwrap();
        symlink(&outside, state.join("pods/link")).unwrap();
        std::fs::hard_link(&outside, state.join("hard")).unwrap();
        let deep: PathBuf = (0..MAX_DEPTH).fold(state.join("d"), |p, i| p.join(i.to_string()));
        std::fs::create_dir_all(&deep).unwrap();
        // systemd's re-own at the next start, then the supervisor's preparation.
        chown_tree_to_root(&state);
        prepare_state_dir(&state, Some(WORKER)).unwrap();
        for p in [
            "",
            "pods",
            "pods/a.json",
            "mesh-dns.json",
            "pods/link",
            "d",
            "d/0",
        ] {
            assert_eq!(owner(&state.join(p)), WORKER, "{p:?}");
        }
        assert_eq!(
            owner(&outside),
            (0, 0),
            "a link's target outside the tree stays root's"
        );
        assert_eq!(
            owner(&state.join("hard")),
            (0, 0),
            "a hard-linked file stays root's"
        );
        assert_eq!(owner(&state.join(MARKER)), (0, 0));
        assert_eq!(
            owner(&deep),
            (0, 0),
            "deeper than the worker's layout is not walked"
        );
        // A folder that was not made for the worker (no marker) keeps its inside.
        let other = tmp.path().join("other");
        std::fs::create_dir_all(other.join("pods")).unwrap();
        prepare_state_dir(&other, Some(WORKER)).unwrap();
        assert_eq!(owner(&other), WORKER);
        assert_eq!(owner(&other.join("pods")), (0, 0));
        // A sticky shared folder is left alone altogether.
        let shared = tmp.path().join("shared");
        folder(&shared, 0o1777);
        prepare_state_dir(&shared, Some(WORKER)).unwrap();
        assert_eq!(owner(&shared), (0, 0));
        assert!(!shared.join(MARKER).exists());
    }
}
