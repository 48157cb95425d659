//! `/ready` says whether the node's first conflist chains `aether-cni`, for a standby as
//! for the owner; the standby only looks, the owner's supervisor repairs.

use std::time::Duration;

use aether_e2e::testing::{LocalNode, wait_for};
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(10);

fn cni_problems(ready: &Value) -> Vec<String> {
    ready["problems"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["source"] == "cni")
        .map(|p| p["message"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn a_standby_reports_a_missing_entry_and_the_new_owner_reports_it_chained() {
    let mut node = LocalNode::new();
    let conf_dir = node.root.path().join("net.d");
    std::fs::create_dir(&conf_dir).unwrap();
    let conflist = conf_dir.join("10-ptp.conflist");
    let primary = r#"{"cniVersion":"1.0.0","name":"pods","plugins":[{"type":"ptp"}]}"#;
    std::fs::write(&conflist, primary).unwrap();
    let flag = format!("--cni-conf-dir={}", conf_dir.display());

    // An owner without the flag (it neither repairs nor reports), then a standby with it.
    let mut a = node.start_agent();
    let owner = a.wait_role("owner", T);
    assert!(
        owner.get("cni").is_none(),
        "no --cni-conf-dir, no cni field: {owner}"
    );
    let b = node.start_agent_with(&[flag.as_str()]);
    b.wait_role("standby", T);
    let standby = wait_for("the standby's cni report", T, || {
        b.ready().map(|(_, v)| v).filter(|v| v["cni"].is_object())
    });
    assert_eq!(standby["cni"]["chained"], false, "{standby}");
    assert_eq!(standby["cni"]["file"], conflist.to_string_lossy().as_ref());
    assert_eq!(
        standby["cni"]["conf_dir"],
        conf_dir.to_string_lossy().as_ref()
    );
    let problems = cni_problems(&standby);
    assert!(
        problems.len() == 1 && problems[0].contains("does not chain aether-cni"),
        "{standby}"
    );
    assert_eq!(
        b.ready().unwrap().0,
        200,
        "a cni problem does not hold a complete standby back"
    );
    assert_eq!(
        std::fs::read_to_string(&conflist).unwrap(),
        primary,
        "the standby wrote the conflist"
    );

    // Takeover: the new owner's supervisor appends the entry; its worker sees it chained.
    a.signal(Signal::SIGTERM);
    assert!(a.wait_exit(T).success());
    b.wait_role("owner", T);
    let owner = wait_for(
        "the new owner to report aether-cni chained",
        Duration::from_secs(15),
        || {
            b.ready()
                .map(|(_, v)| v)
                .filter(|v| v["cni"]["chained"] == true)
        },
    );
    assert!(cni_problems(&owner).is_empty(), "{owner}");

    // A standby started now sees the owner's entry.
    let c = node.start_agent_with(&[flag.as_str()]);
    c.wait_role("standby", T);
    let standby = wait_for("the second standby's cni report", T, || {
        c.ready().map(|(_, v)| v).filter(|v| v["cni"].is_object())
    });
    assert_eq!(standby["cni"]["chained"], true, "{standby}");
    assert!(cni_problems(&standby).is_empty(), "{standby}");
}
