//! This node's pods as the API server lists them: the pure view the pod watch keeps,
//! fed with the watcher's events already converted at the boundary.
//!
//! A relist (the watcher's `Init` .. `InitDone`, after the first start or an expired
//! resource version) is collected aside and replaces the view whole at its end, so the
//! view is always one complete list plus the changes since. [`PodView::synced`] says
//! whether it is also current: a complete list has arrived and the watch has not failed
//! since (or has shown it resumed). Absence from a view that is not current proves
//! nothing, and the stale-record collector waits for a current one.

use std::collections::BTreeMap;

/// What the agent needs of a pod object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiPod {
    pub namespace: String,
    pub name: String,
    /// `metadata.deletionTimestamp` is set: the pod is terminating.
    pub deleting: bool,
    /// `status.podIPs`, which the kubelet writes after the pod's CNI ADD returns: empty
    /// until then (an entry that is no address is left out).
    pub ips: Vec<std::net::IpAddr>,
}

/// A watcher event about this node's pods, keyed by pod uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodEvent {
    /// A (re)list begins.
    Init,
    /// A pod of the list.
    Listed(String, ApiPod),
    /// The list is complete.
    InitDone,
    /// A pod added or changed.
    Applied(String, ApiPod),
    /// A pod gone from the API.
    Deleted(String),
    /// The watch failed; it will resume or relist.
    Failed,
    /// The watch is known to work again without a relist (resumed from its resource
    /// version, which misses nothing).
    Resumed,
}

#[derive(Debug, Default)]
pub struct PodView {
    pods: BTreeMap<String, ApiPod>,
    /// A relist in progress.
    relist: Option<BTreeMap<String, ApiPod>>,
    /// Complete lists received.
    lists: u64,
    failed: bool,
}

impl PodView {
    pub fn apply(&mut self, event: PodEvent) {
        match event {
            PodEvent::Init => self.relist = Some(BTreeMap::new()),
            PodEvent::Listed(uid, pod) => {
                self.relist.get_or_insert_default().insert(uid, pod);
            }
            PodEvent::InitDone => {
                self.pods = self.relist.take().unwrap_or_default();
                self.lists += 1;
                self.failed = false;
            }
            PodEvent::Applied(uid, pod) => {
                self.pods.insert(uid, pod);
                self.failed = false;
            }
            PodEvent::Deleted(uid) => {
                self.pods.remove(&uid);
                self.failed = false;
            }
            PodEvent::Failed => self.failed = true,
            PodEvent::Resumed => {
                if self.relist.is_none() {
                    self.failed = false;
                }
            }
        }
    }

    pub fn get(&self, uid: &str) -> Option<&ApiPod> {
        self.pods.get(uid)
    }

    pub fn get_key_value(&self, uid: &str) -> Option<(&str, &ApiPod)> {
        self.pods.get_key_value(uid).map(|(k, v)| (k.as_str(), v))
    }

    /// The pod named `namespace/name`, with its uid (a walk: for records whose ADD named
    /// no uid, which few runtimes send).
    pub fn find(&self, namespace: &str, name: &str) -> Option<(&str, &ApiPod)> {
        self.pods
            .iter()
            .find(|(_, p)| p.namespace == namespace && p.name == name)
            .map(|(k, v)| (k.as_str(), v))
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.pods.contains_key(uid)
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// Complete lists received since start (the first list, then each relist).
    pub fn lists(&self) -> u64 {
        self.lists
    }

    /// A complete list has arrived, no relist is half done, and the watch has not failed
    /// since its last sign of life.
    pub fn synced(&self) -> bool {
        self.lists > 0 && self.relist.is_none() && !self.failed
    }

    /// The uids of the pods with a deletion timestamp.
    pub fn deleting(&self) -> impl Iterator<Item = &str> {
        self.pods
            .iter()
            .filter(|(_, p)| p.deleting)
            .map(|(uid, _)| uid.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, deleting: bool) -> ApiPod {
        ApiPod {
            namespace: "default".into(),
            name: name.into(),
            deleting,
            ips: vec![],
        }
    }

    #[test]
    fn a_relist_replaces_the_view_at_its_end_and_only_then() {
        let mut v = PodView::default();
        assert!(!v.synced(), "nothing listed yet");
        for e in [
            PodEvent::Init,
            PodEvent::Listed("a".into(), pod("a", false)),
            PodEvent::Listed("b".into(), pod("b", false)),
        ] {
            v.apply(e);
        }
        assert!(
            !v.synced() && v.is_empty(),
            "a list half received is not the view"
        );
        v.apply(PodEvent::InitDone);
        assert!(v.synced() && v.contains("a") && v.contains("b") && v.lists() == 1);

        v.apply(PodEvent::Applied("c".into(), pod("c", false)));
        v.apply(PodEvent::Applied("a".into(), pod("a", true)));
        v.apply(PodEvent::Deleted("b".into()));
        assert_eq!(v.deleting().collect::<Vec<_>>(), ["a"]);
        assert!(!v.contains("b") && v.contains("c"));

        // 410: the watcher relists; while it does, the old view stands but is not current.
        v.apply(PodEvent::Failed);
        v.apply(PodEvent::Init);
        v.apply(PodEvent::Listed("c".into(), pod("c", false)));
        assert!(!v.synced() && v.contains("a"));
        v.apply(PodEvent::Resumed);
        assert!(!v.synced(), "a relist in progress is not resumed");
        v.apply(PodEvent::InitDone);
        assert!(v.synced() && !v.contains("a") && v.contains("c") && v.lists() == 2);
    }

    #[test]
    fn a_failed_watch_is_current_again_once_it_shows_life() {
        let mut v = PodView::default();
        v.apply(PodEvent::Init);
        v.apply(PodEvent::InitDone);
        v.apply(PodEvent::Failed);
        assert!(!v.synced());
        v.apply(PodEvent::Resumed);
        assert!(v.synced());
        v.apply(PodEvent::Failed);
        v.apply(PodEvent::Applied("a".into(), pod("a", false)));
        assert!(
            v.synced(),
            "an event after the failure shows the watch resumed"
        );
    }
}
