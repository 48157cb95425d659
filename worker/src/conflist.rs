//! Whether `aether-cni` is chained in the node's CNI configuration (`--cni-conf-dir`),
//! as `/ready` reports it, for a standby as for the owner.
//!
//! Read-only: the owner's supervisor repairs the file (it runs `aether-cni chain`); the
//! worker only looks, so that a standby can say before it takes the node over that pods
//! started now would run without the mesh. The rules are the ones the repair follows,
//! from one module (`shared_proto::conflist`): the runtime's configuration is the first
//! `*.conf`, `*.conflist` or `*.json` by name, dotfiles included, as libcni chooses it,
//! opened without following a symlink or blocking, at most 1 MiB, and chained when its
//! `plugins` list holds an entry of type `aether-cni`. A look is a folder listing and one
//! small read, every few seconds, on a blocking thread.

use std::path::{Path, PathBuf};
use std::time::Duration;

use shared_proto::conflist::{PLUGIN_TYPE, chained, primary};

use crate::health::{CniStatus, Reporter};

/// The source name of the problem `/ready` shows while the entry is missing.
pub const PROBLEM: &str = "cni";
/// How often the folder is looked at: the owner's supervisor re-asserts every 5 s.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// One look at the folder: the status, and why it is not chained when it is not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub status: CniStatus,
    pub problem: Option<String>,
}

/// Looks at `dir` once. Never writes.
pub fn observe(dir: &Path) -> Observation {
    let status = |file: Option<&Path>, chained| CniStatus {
        conf_dir: dir.display().to_string(),
        file: file.map(|f| f.display().to_string()),
        chained,
    };
    let path = match primary(dir) {
        Ok(Some(p)) => p,
        Ok(None) => {
            return Observation {
                status: status(None, false),
                problem: Some(format!(
                    "{}: no network configuration yet (the primary CNI has not written one)",
                    dir.display()
                )),
            };
        }
        Err(e) => {
            return Observation {
                status: status(None, false),
                problem: Some(e.to_string()),
            };
        }
    };
    match chained(&path) {
        Ok(true) => Observation {
            status: status(Some(&path), true),
            problem: None,
        },
        Ok(false) => Observation {
            status: status(Some(&path), false),
            problem: Some(format!(
                "{} does not chain {PLUGIN_TYPE}: pods started now run without the mesh until the node's owner re-asserts it",
                path.display()
            )),
        },
        Err(why) => Observation {
            status: status(Some(&path), false),
            problem: Some(why.to_string()),
        },
    }
}

/// Looks at `dir` now and every [`INTERVAL`], and reports each change to `/ready`.
pub fn spawn(dir: PathBuf, reporter: Reporter) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last: Option<Observation> = None;
        loop {
            let d = dir.clone();
            let now = tokio::task::spawn_blocking(move || observe(&d))
                .await
                .expect("the conflist look does not panic");
            if last.as_ref() != Some(&now) {
                match &now.problem {
                    Some(p) => {
                        tracing::warn!(conf_dir = %dir.display(), problem = %p, "aether-cni is not chained");
                        reporter.set(PROBLEM, p.clone());
                    }
                    None => {
                        tracing::info!(
                            file = now.status.file.as_deref().unwrap_or(""),
                            "aether-cni is chained in the node's conflist"
                        );
                        reporter.clear(PROBLEM);
                    }
                }
                reporter.cni(now.status.clone());
                last = Some(now);
            }
            tokio::time::sleep(INTERVAL).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    const PTP: &str =
        r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp"},{"type":"portmap"}]}"#;
    const CHAINED: &str = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp"},{"type":"aether-cni","agentSocket":"/run/aether/cni.sock"}]}"#;

    /// One case: the files in the folder (name, body; a body starting with "->" is a
    /// symlink to that target), then the file and chained state `/ready` must show, and
    /// a part of the problem, if any.
    fn check(files: &[(&str, &str)], file: Option<&str>, chained: bool, problem: Option<&str>) {
        let dir = tempfile::tempdir().unwrap();
        for (name, body) in files {
            match body.strip_prefix("->") {
                Some(target) => std::os::unix::fs::symlink(target, dir.path().join(name)).unwrap(),
                None => fs::write(dir.path().join(name), body).unwrap(),
            }
        }
        let before: Vec<_> = files
            .iter()
            .map(|(n, _)| {
                fs::symlink_metadata(dir.path().join(n))
                    .unwrap()
                    .modified()
                    .unwrap()
            })
            .collect();
        let got = observe(dir.path());
        let want_file = file.map(|f| dir.path().join(f).display().to_string());
        assert_eq!(
            got.status,
            CniStatus {
                conf_dir: dir.path().display().to_string(),
                file: want_file,
                chained
            },
            "{files:?}"
        );
        match (problem, &got.problem) {
            (None, None) => {}
            (Some(want), Some(p)) => {
                assert!(p.contains(want), "{files:?}: problem {p:?} lacks {want:?}")
            }
            (want, got) => panic!("{files:?}: problem {got:?}, want one containing {want:?}"),
        }
        let after: Vec<_> = files
            .iter()
            .map(|(n, _)| {
                fs::symlink_metadata(dir.path().join(n))
                    .unwrap()
                    .modified()
                    .unwrap()
            })
            .collect();
        assert_eq!(before, after, "a look wrote a file");
    }

    #[test]
    fn the_runtimes_first_conflist_decides() {
        check(&[], None, false, Some("no network configuration yet"));
        check(
            &[("10-ptp.conflist", CHAINED)],
            Some("10-ptp.conflist"),
            true,
            None,
        );
        check(
            &[("10-ptp.conflist", PTP)],
            Some("10-ptp.conflist"),
            false,
            Some("does not chain aether-cni"),
        );
        // Only the first by name counts, as for the runtime and the supervisor.
        check(
            &[("20-b.conflist", CHAINED), ("10-a.conflist", PTP)],
            Some("10-a.conflist"),
            false,
            Some("10-a.conflist does not chain"),
        );
        check(
            &[("20-b.conflist", PTP), ("10-a.json", CHAINED)],
            Some("10-a.json"),
            true,
            None,
        );
        // Other suffixes and the supervisor's temp file do not count.
        check(
            &[
                ("README", "x"),
                (".aether-cni-conflist.tmp", PTP),
                ("99-z.conf", CHAINED),
            ],
            Some("99-z.conf"),
            true,
            None,
        );
        // A dotfile does, as for libcni, and sorts before digits.
        check(
            &[(".hidden.conflist", PTP), ("99-z.conf", CHAINED)],
            Some(".hidden.conflist"),
            false,
            Some("does not chain"),
        );
    }

    #[test]
    fn bad_files_are_named_and_never_chained() {
        check(
            &[("10-broken.conflist", "{\"plugins\": [")],
            Some("10-broken.conflist"),
            false,
            Some("not JSON"),
        );
        check(
            &[(
                "10-single.conf",
                r#"{"cniVersion":"1.0.0","name":"n","type":"bridge"}"#,
            )],
            Some("10-single.conf"),
            false,
            Some("no \"plugins\" list"),
        );
        check(
            &[
                ("elsewhere.txt", CHAINED),
                ("10-link.conflist", "->elsewhere.txt"),
            ],
            Some("10-link.conflist"),
            false,
            Some("symlinks are refused"),
        );
        let big = " ".repeat((1 << 20) + 1);
        check(
            &[("10-big.conflist", big.as_str())],
            Some("10-big.conflist"),
            false,
            Some("larger than"),
        );
    }

    #[test]
    fn a_missing_folder_is_a_problem_not_a_crash() {
        let got = observe(Path::new("/nonexistent/aether-test/net.d"));
        assert!(!got.status.chained && got.status.file.is_none());
        assert!(
            got.problem
                .unwrap()
                .contains("/nonexistent/aether-test/net.d")
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ready_follows_the_folder_and_clears_the_problem_once_chained() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("10-ptp.conflist");
        fs::write(&conf, PTP).unwrap();
        let status = std::sync::Arc::new(tokio::sync::watch::Sender::new(
            crate::health::Status::new("n", "p"),
        ));
        let mut rx = status.subscribe();
        let task = spawn(dir.path().to_owned(), Reporter::new(status.clone()));
        rx.wait_for(|s| s.cni.as_ref().is_some_and(|c| !c.chained))
            .await
            .unwrap();
        assert_eq!(
            rx.borrow()
                .problems
                .iter()
                .filter(|p| p.source == PROBLEM)
                .count(),
            1
        );
        // The owner's supervisor appends the entry; the next look sees it.
        fs::write(&conf, CHAINED).unwrap();
        rx.wait_for(|s| s.cni.as_ref().is_some_and(|c| c.chained))
            .await
            .unwrap();
        assert!(
            rx.borrow().problems.iter().all(|p| p.source != PROBLEM),
            "{:?}",
            rx.borrow().problems
        );
        task.abort();
    }
}
