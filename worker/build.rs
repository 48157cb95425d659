//! Derives the commit the worker is built from, for `aether_build_info{revision}`, the same
//! way on every build path (`cargo build`, `scripts/build-image.sh`, `scripts/test.sh`), so
//! that a second build of the same tree by any of them is a no-op.
//!
//! The revision is `git rev-parse HEAD`, with `-dirty` when the tree differed from it when
//! this script last ran, or `unknown` outside git; an `AETHER_REVISION` set in the
//! environment wins (a build from an exported tree). The script runs again when the
//! checked-out commit moves (HEAD, or the branch it names) or when that variable changes,
//! never for a change elsewhere in the tree.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-env-changed=AETHER_REVISION");
    let revision = match std::env::var("AETHER_REVISION") {
        Ok(r) if !r.is_empty() => r,
        _ => from_git().unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo::rustc-env=AETHER_REVISION={revision}");
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn from_git() -> Option<String> {
    let commit = git(&["rev-parse", "HEAD"])?;
    // HEAD in this checkout's git folder (a worktree has its own), and the branch it
    // names, loose or packed, in the folder the worktrees share.
    let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"])
        .map(PathBuf::from)
        .unwrap_or_else(|| git_dir.clone());
    let mut watched = vec![git_dir.join("HEAD"), common.join("packed-refs")];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(common.join(branch));
    }
    for path in watched.iter().filter(|p| Path::exists(p)) {
        println!("cargo::rerun-if-changed={}", path.display());
    }
    let clean = Command::new("git")
        .args(["diff", "--quiet", "HEAD"])
        .status()
        .is_ok_and(|s| s.success());
    Some(if clean {
        commit
    } else {
        format!("{commit}-dirty")
    })
}
