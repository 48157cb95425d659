//! The taint guard (`--taint-guard`): re-applies the startup taint
//! `aether.io/agent-not-ready:NoSchedule` to a node that has had no non-terminating Ready
//! agent pod for the grace period, so that a rebooted node, or one whose agent crash-loops,
//! schedules no pod that cannot get a CNI. The kubelet's `--register-with-taints` covers a
//! node's first start; the agent removes the taint as owner once it serves.
//!
//! The rule looks only at Ready agent pods, so it never taints a node during a surge roll
//! while either agent pod there is Ready, and it does not fight the agent: the agent
//! removes the taint only once it serves, which its pod's readiness then reports, and the
//! guard waits a whole grace period of no Ready pod before it taints.
//!
//! The grace of each node starts when this replica, as leader, first saw it without a Ready
//! agent pod, so a new leader waits a full grace before its first taint. The patch is a
//! JSON patch that `test`s the node's resourceVersion and then adds the taint: a node
//! changed since it was read answers 422 and is read again.
//!
//! [`Guard::plan`] is the pure rule; [`run`] watches and patches.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::time::Instant;

use super::discovery::{Objects, watched};
use super::lease::{self, Leadership};

pub const KEY: &str = "aether.io/agent-not-ready";
pub const EFFECT: &str = "NoSchedule";

/// The node an agent pod serves, if the pod is Ready and not terminating.
pub fn ready_on(pod: &Pod) -> Option<&str> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ready = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    ready.then_some(())?;
    pod.spec
        .as_ref()?
        .node_name
        .as_deref()
        .filter(|n| !n.is_empty())
}

/// Whether the node carries the startup taint.
pub fn tainted(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == KEY && t.effect == EFFECT))
}

/// The JSON patch adding the taint to `node` as read: a `test` of its resourceVersion,
/// then an `add` to the end of `spec.taints` (or of the list itself, when it has none).
pub fn patch(node: &Node) -> Value {
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    let taint = json!({ "key": KEY, "effect": EFFECT });
    let add = match node.spec.as_ref().and_then(|s| s.taints.as_ref()) {
        Some(_) => json!({ "op": "add", "path": "/spec/taints/-", "value": taint }),
        None => json!({ "op": "add", "path": "/spec/taints", "value": [taint] }),
    };
    json!([{ "op": "test", "path": "/metadata/resourceVersion", "value": rv }, add])
}

/// What the guard does now.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    /// Nodes to taint, with their patches.
    pub taint: Vec<(String, Value)>,
    /// When to look again (the next grace to end), if any node is waiting.
    pub wake: Option<Instant>,
}

/// When each node was first seen without a Ready agent pod.
#[derive(Debug)]
pub struct Guard {
    grace: Duration,
    unready_since: BTreeMap<String, Instant>,
}

impl Guard {
    pub fn new(grace: Duration) -> Self {
        Self {
            grace,
            unready_since: BTreeMap::new(),
        }
    }

    /// Forgets every grace in progress (leadership lost: the next leader starts afresh).
    pub fn reset(&mut self) {
        self.unready_since.clear();
    }

    /// The nodes to taint given every node and the nodes with a Ready agent pod.
    pub fn plan(
        &mut self,
        nodes: &BTreeMap<String, Node>,
        ready: &BTreeSet<String>,
        now: Instant,
    ) -> Plan {
        self.unready_since
            .retain(|n, _| nodes.contains_key(n) && !ready.contains(n));
        let mut plan = Plan::default();
        for (name, node) in nodes {
            if ready.contains(name) {
                continue;
            }
            let since = *self.unready_since.entry(name.clone()).or_insert(now);
            if tainted(node) {
                continue;
            }
            let due = since + self.grace;
            if now >= due {
                plan.taint.push((name.clone(), patch(node)));
            } else {
                plan.wake = Some(plan.wake.map_or(due, |w| w.min(due)));
            }
        }
        plan
    }
}

/// Where the agent pods are, and which nodes are guarded.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    pub grace: Duration,
    pub agent_namespace: String,
    pub agent_selector: String,
    /// A label selector for the guarded nodes ("" for all).
    pub node_selector: String,
}

/// Watches nodes and agent pods and, while leading, taints nodes without a Ready agent.
pub async fn run(
    client: kube::Client,
    cfg: GuardConfig,
    mut leader: Leadership,
    mut stop: watch::Receiver<bool>,
) {
    let nodes_api: Api<Node> = Api::all(client.clone());
    let pods_api: Api<Pod> = Api::namespaced(client, &cfg.agent_namespace);
    let mut node_events = watched(
        "nodes",
        watcher::watcher(
            nodes_api.clone(),
            watcher::Config::default().labels(&cfg.node_selector),
        ),
    );
    let mut pod_events = watched(
        "pods",
        watcher::watcher(
            pods_api,
            watcher::Config::default().labels(&cfg.agent_selector),
        ),
    );
    let (mut nodes, mut pods) = (
        Objects::<String, Node>::default(),
        Objects::<String, Pod>::default(),
    );
    let mut guard = Guard::new(cfg.grace);
    tracing::info!(grace = ?cfg.grace, agents = %format!("{} {}", cfg.agent_namespace, cfg.agent_selector), nodes = %cfg.node_selector, "taint guard watching");
    loop {
        while let Some(Some(e)) = node_events.next().now_or_never() {
            nodes.apply(e, id, |_, _| {});
        }
        while let Some(Some(e)) = pod_events.next().now_or_never() {
            pods.apply(e, id, |_, _| {});
        }
        let mut wake: Option<Instant> = None;
        if !lease::leads(&leader) {
            guard.reset();
        } else if nodes.synced && pods.synced {
            let ready: BTreeSet<String> = pods
                .current
                .values()
                .filter_map(ready_on)
                .map(str::to_owned)
                .collect();
            let plan = guard.plan(&nodes.current, &ready, Instant::now());
            wake = plan.wake;
            for (node, patch) in plan.taint {
                if !lease::leads(&leader) {
                    break;
                }
                taint(&nodes_api, &node, patch, cfg.grace, &mut nodes).await;
            }
        }
        let sleep = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(e) = node_events.next() => nodes.apply(e, id, |_, _| {}),
            Some(e) = pod_events.next() => pods.apply(e, id, |_, _| {}),
            Ok(()) = leader.changed() => {}
            _ = sleep => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

async fn taint(
    api: &Api<Node>,
    node: &str,
    patch: Value,
    grace: Duration,
    nodes: &mut Objects<String, Node>,
) {
    let p: json_patch::Patch = match serde_json::from_value(patch) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(node, error = %e, "the taint's JSON patch does not decode; not patching");
            return;
        }
    };
    match api
        .patch(node, &PatchParams::default(), &Patch::Json::<()>(p))
        .await
    {
        Ok(n) => {
            tracing::warn!(node, taint = %format!("{KEY}:{EFFECT}"), grace = ?grace, "tainted a node with no Ready agent pod for the grace period");
            nodes.current.insert(node.to_owned(), n);
        }
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => {
            tracing::info!(node, code = s.code, message = %s.message, "the node changed under the taint patch; reading it again");
            match api.get_opt(node).await {
                Ok(Some(n)) => {
                    nodes.current.insert(node.to_owned(), n);
                }
                Ok(None) => {
                    nodes.current.remove(node);
                }
                Err(e) => tracing::warn!(node, error = %e, "reading the node failed"),
            }
        }
        Err(e) => {
            tracing::warn!(node, error = %e, "tainting the node failed; trying again at the next change")
        }
    }
}

/// A node's name, or a pod's namespace/name.
fn id<K: kube::Resource>(o: &K) -> Option<String> {
    let m = o.meta();
    let name = m.name.as_deref()?;
    Some(
        m.namespace
            .as_ref()
            .map_or_else(|| name.to_owned(), |ns| format!("{ns}/{name}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, taints: Option<Value>) -> Node {
        let mut v = json!({"metadata": {"name": name, "resourceVersion": "7"}, "spec": {}});
        if let Some(t) = taints {
            v["spec"]["taints"] = t;
        }
        serde_json::from_value(v).unwrap()
    }

    fn pod(node: &str, ready: bool, deleting: bool) -> Pod {
        let mut v = json!({"metadata": {"name": "agent", "namespace": "mesh"}, "spec": {"nodeName": node, "containers": []},
            "status": {"conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}});
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2026-11-30T00:00:00Z");
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn an_agent_pod_counts_only_ready_and_not_terminating() {
        assert_eq!(ready_on(&pod("n1", true, false)), Some("n1"));
        assert_eq!(ready_on(&pod("n1", false, false)), None);
        assert_eq!(
            ready_on(&pod("n1", true, true)),
            None,
            "a terminating pod does not count, Ready or not"
        );
        assert_eq!(ready_on(&pod("", true, false)), None);
    }

    #[test]
    fn a_node_is_tainted_after_a_whole_grace_without_a_ready_agent() {
        let grace = Duration::from_secs(30);
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut g = Guard::new(grace);
        let nodes: BTreeMap<String, Node> = [
            ("n1".into(), node("n1", None)),
            (
                "n2".into(),
                node("n2", Some(json!([{"key": "other", "effect": "NoExecute"}]))),
            ),
        ]
        .into();
        let ready_n2: BTreeSet<String> = ["n2".into()].into();
        // n1 has no Ready agent from t0: it waits for the grace.
        assert_eq!(
            g.plan(&nodes, &ready_n2, t0),
            Plan {
                taint: vec![],
                wake: Some(at(30))
            }
        );
        assert_eq!(g.plan(&nodes, &ready_n2, at(29)).taint, vec![]);
        assert_eq!(
            g.plan(&nodes, &ready_n2, at(30)).taint,
            vec![("n1".to_owned(), patch(&nodes["n1"]))]
        );
        // A Ready agent on n1 in between restarts its grace.
        let mut g = Guard::new(grace);
        g.plan(&nodes, &ready_n2, t0);
        let both: BTreeSet<String> = ["n1".into(), "n2".into()].into();
        assert_eq!(g.plan(&nodes, &both, at(20)), Plan::default());
        assert_eq!(g.plan(&nodes, &ready_n2, at(40)).wake, Some(at(70)));
        // An already tainted node is left alone; n2 loses its agent and waits its own grace.
        let tainted_nodes: BTreeMap<String, Node> = [
            (
                "n1".into(),
                node("n1", Some(json!([{"key": KEY, "effect": EFFECT}]))),
            ),
            ("n2".into(), nodes["n2"].clone()),
        ]
        .into();
        let none = BTreeSet::new();
        let mut g = Guard::new(grace);
        assert_eq!(
            g.plan(&tainted_nodes, &none, t0),
            Plan {
                taint: vec![],
                wake: Some(at(30))
            }
        );
        assert_eq!(
            g.plan(&tainted_nodes, &none, at(30)).taint,
            vec![("n2".to_owned(), patch(&tainted_nodes["n2"]))]
        );
        // reset(): a new leader starts every grace afresh.
        g.reset();
        assert_eq!(g.plan(&tainted_nodes, &none, at(31)).taint, vec![]);
    }

    #[test]
    fn the_patch_tests_the_resource_version_and_adds_the_taint() {
        assert_eq!(
            patch(&node("n1", None)),
            json!([{"op": "test", "path": "/metadata/resourceVersion", "value": "7"}, {"op": "add", "path": "/spec/taints", "value": [{"key": KEY, "effect": EFFECT}]}])
        );
        assert_eq!(
            patch(&node("n1", Some(json!([])))).as_array().unwrap()[1],
            json!({"op": "add", "path": "/spec/taints/-", "value": {"key": KEY, "effect": EFFECT}})
        );
        let mut doc = serde_json::to_value(node(
            "n1",
            Some(json!([{"key": "other", "effect": "NoExecute"}])),
        ))
        .unwrap();
        let p: json_patch::Patch =
            serde_json::from_value(patch(&node("n1", Some(json!([]))))).unwrap();
        json_patch::patch(&mut doc, &p).unwrap();
        let n: Node = serde_json::from_value(doc).unwrap();
        assert!(tainted(&n));
        assert_eq!(
            n.spec.unwrap().taints.unwrap().len(),
            2,
            "the other taint stays"
        );
    }
}
