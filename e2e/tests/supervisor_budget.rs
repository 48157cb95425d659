//! The supervisor's code budget by part (`scripts/supervisor-footprint.sh --lines`): the
//! pure lifecycle with its driver, `sys/`, and the rest of `supervisor/src` are each within
//! their budget, and the check fails, naming the part, when any budget is one line below
//! its count.

use std::process::{Command, Output};

use aether_e2e::testing::workspace_root;

fn lines(budgets: &str) -> Output {
    Command::new("bash")
        .arg(workspace_root().join("scripts/supervisor-footprint.sh"))
        .arg("--lines")
        .env("AETHER_SUPERVISOR_BUDGETS", budgets)
        .output()
        .expect("running scripts/supervisor-footprint.sh --lines")
}

/// Each part's line count and budget, from the script's `  part  N lines, budget B` lines.
fn parts(stdout: &str) -> Vec<(String, u64, u64)> {
    stdout
        .lines()
        .filter_map(|l| {
            let (part, rest) = l.trim().split_once(char::is_whitespace)?;
            let (count, rest) = rest.trim().split_once(" lines, budget ")?;
            let budget = rest.split_whitespace().next()?;
            Some((part.to_string(), count.parse().ok()?, budget.parse().ok()?))
        })
        .collect()
}

#[test]
fn each_part_of_the_supervisor_is_within_its_budget_and_a_lowered_budget_fails() {
    let out = lines("");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    let found = parts(&stdout);
    let names: Vec<&str> = found.iter().map(|(p, _, _)| p.as_str()).collect();
    assert_eq!(names, ["lifecycle+driver", "sys", "rest"], "{stdout}");
    for (part, count, budget) in &found {
        assert!(count <= budget, "{part}: {count} lines over {budget}");
        assert!(
            *count > 100,
            "{part}: {count} lines is too few; the count is broken"
        );
        let lowered = lines(&format!("{part}={}", count - 1));
        let err = String::from_utf8_lossy(&lowered.stderr);
        assert_eq!(lowered.status.code(), Some(1), "{part} lowered: {err}");
        assert!(
            err.contains(&format!("{part} ({count} lines, budget {})", count - 1)),
            "{part} lowered: {err}"
        );
    }
}
