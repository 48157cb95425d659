//! The node's startup taint, `aether.io/agent-not-ready:NoSchedule`: when the owner
//! removes it, and the patch that does. Pure.
//!
//! The kubelet registers the node with the taint, so no pod that needs the mesh lands
//! before an agent serves it. The owner alone removes it, once its CNI API serves and the
//! proxy has ACKed a snapshot; a standby never touches the node. The patch is a JSON
//! patch that first `test`s the taint at the index it was read at (its key and effect,
//! which identify a taint: the API server refuses two taints with the same pair) and then
//! `remove`s it: if another writer moved the list meanwhile the test fails, the server
//! answers 422, and the owner reads the node again and retries. A strategic merge patch
//! could not remove one list item without that race. The test leaves out the taint's
//! other fields (`timeAdded`, `value`): their text is the server's, and a client that
//! parses and prints a timestamp again need not print the same text.

use serde_json::{Value, json};

pub const KEY: &str = "aether.io/agent-not-ready";
pub const EFFECT: &str = "NoSchedule";

/// What the owner knows when it decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// The CNI API accepts calls (this worker serves the node).
    pub serving: bool,
    /// The proxy has fully ACKed a snapshot since serving began.
    pub acked: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Not yet: what the owner waits for.
    Wait(&'static str),
    /// The node carries no startup taint.
    Absent,
    /// Send this JSON patch.
    Remove { index: usize, patch: Value },
}

/// The startup taint's index in the node's `spec.taints`, if it is there.
pub fn find(taints: &[Value]) -> Option<usize> {
    taints.iter().position(|t| {
        t.get("key").and_then(Value::as_str) == Some(KEY)
            && t.get("effect").and_then(Value::as_str) == Some(EFFECT)
    })
}

/// Whether the owner removes the taint now, given the node's taints as last read
/// (`None`: the node has not been read yet).
pub fn decide(owner: Owner, taints: Option<&[Value]>) -> Decision {
    if !owner.serving {
        return Decision::Wait("the CNI API to serve");
    }
    if !owner.acked {
        return Decision::Wait("the proxy to ACK its first snapshot");
    }
    let Some(taints) = taints else {
        return Decision::Wait("the node object");
    };
    match find(taints) {
        Some(index) => Decision::Remove {
            index,
            patch: removal(index),
        },
        None => Decision::Absent,
    }
}

/// `test` that the startup taint is at `index`, then `remove` it.
pub fn removal(index: usize) -> Value {
    let path = format!("/spec/taints/{index}");
    json!([
        { "op": "test", "path": format!("{path}/key"), "value": KEY },
        { "op": "test", "path": format!("{path}/effect"), "value": EFFECT },
        { "op": "remove", "path": path },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, effect: &str) -> Value {
        json!({ "key": key, "effect": effect })
    }

    /// One table: the owner's state and the node's taints, and the decision.
    #[test]
    fn the_owner_removes_the_taint_only_once_it_serves_and_the_proxy_acked() {
        let ours = taint(KEY, EFFECT);
        let other = taint("node.kubernetes.io/not-ready", "NoSchedule");
        let ready = Owner {
            serving: true,
            acked: true,
        };
        let cases: Vec<(Owner, Option<Vec<Value>>, Decision)> = vec![
            (
                Owner {
                    serving: false,
                    acked: true,
                },
                Some(vec![ours.clone()]),
                Decision::Wait("the CNI API to serve"),
            ),
            (
                Owner {
                    serving: true,
                    acked: false,
                },
                Some(vec![ours.clone()]),
                Decision::Wait("the proxy to ACK its first snapshot"),
            ),
            (ready, None, Decision::Wait("the node object")),
            (ready, Some(vec![]), Decision::Absent),
            (
                ready,
                Some(vec![other.clone(), taint(KEY, "NoExecute")]),
                Decision::Absent,
            ),
            (
                ready,
                Some(vec![ours.clone()]),
                Decision::Remove {
                    index: 0,
                    patch: removal(0),
                },
            ),
            (
                ready,
                Some(vec![other.clone(), ours.clone()]),
                Decision::Remove {
                    index: 1,
                    patch: removal(1),
                },
            ),
        ];
        for (owner, taints, want) in cases {
            assert_eq!(
                decide(owner, taints.as_deref()),
                want,
                "{owner:?} {taints:?}"
            );
        }
    }

    #[test]
    fn the_patch_tests_the_taints_key_and_effect_at_its_index_before_removing_it() {
        assert_eq!(
            removal(2),
            json!([
                { "op": "test", "path": "/spec/taints/2/key", "value": KEY },
                { "op": "test", "path": "/spec/taints/2/effect", "value": EFFECT },
                { "op": "remove", "path": "/spec/taints/2" },
            ])
        );
        // It is a JSON patch as the client sends it.
        let _: json_patch::Patch = serde_json::from_value(removal(0)).unwrap();
        // Applied to a list the other writer changed, it fails as a whole.
        let mut moved =
            json!({ "spec": { "taints": [taint("other", EFFECT), taint(KEY, EFFECT)] } });
        let ops: json_patch::Patch = serde_json::from_value(removal(0)).unwrap();
        assert!(json_patch::patch(&mut moved, &ops).is_err());
        let ops: json_patch::Patch = serde_json::from_value(removal(1)).unwrap();
        json_patch::patch(&mut moved, &ops).unwrap();
        assert_eq!(
            moved,
            json!({ "spec": { "taints": [taint("other", EFFECT)] } })
        );
    }
}
