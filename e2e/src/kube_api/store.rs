//! What etcd and the watch cache are to a real API server: the objects, one
//! resourceVersion counter across all of them, the retained history of changes, and the
//! open watches that each change is sent to. No I/O: a watch is a channel sender, written
//! to under the caller's lock so that replay and live events never interleave.

use std::collections::{BTreeMap, VecDeque};
use std::time::SystemTime;

use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedSender;

use super::resource::Resource;
use super::selector::Selector;
use super::timestamps::rfc3339;

/// Which objects a list or a watch sees.
#[derive(Clone, Debug)]
pub struct Scope {
    pub resource: Resource,
    pub namespace: Option<String>,
    pub fields: Selector,
    pub labels: Selector,
}

impl Scope {
    #[cfg(test)]
    pub fn all(resource: Resource) -> Scope {
        Scope {
            resource,
            namespace: None,
            fields: Selector::default(),
            labels: Selector::default(),
        }
    }

    fn matches(&self, object: &Value) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| object["metadata"]["namespace"] == ns)
            && self.fields.matches_fields(object)
            && self.labels.matches_labels(object)
    }
}

/// A list or watch asked for a resourceVersion older than the retained history: the
/// server answers 410 Gone (reason Expired).
#[derive(Debug, PartialEq)]
pub struct Expired {
    pub requested: u64,
    pub oldest: u64,
}

impl Expired {
    /// The real server's message for it.
    pub fn message(&self) -> String {
        format!(
            "too old resource version: {} ({})",
            self.requested, self.oldest
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ChangeType {
    Added,
    Modified,
    Deleted,
}

/// One write, as the history keeps it: the object after it (for a deletion, its last
/// state) and, for a modification, the object before, which a watch with a selector needs
/// to tell an object entering or leaving its scope.
struct Change {
    rv: u64,
    resource: Resource,
    kind: ChangeType,
    object: Value,
    previous: Option<Value>,
}

struct Watcher {
    scope: Scope,
    events: UnboundedSender<Value>,
}

/// How far back the history reaches before the oldest changes are forgotten on their own.
const MAX_HISTORY: usize = 10_000;

pub struct Store {
    rv: u64,
    objects: BTreeMap<(Resource, String), Value>,
    history: VecDeque<Change>,
    /// A list or watch from a resourceVersion below this is answered 410: the changes
    /// after it are no longer all retained.
    oldest: u64,
    watchers: BTreeMap<u64, Watcher>,
    next_watcher: u64,
    uid_prefix: u32,
    created: u64,
}

impl Store {
    /// An empty store; `uid_prefix` makes the uids it invents differ between servers.
    pub fn new(uid_prefix: u32) -> Store {
        Store {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            oldest: 1,
            watchers: BTreeMap::new(),
            next_watcher: 0,
            uid_prefix,
            created: 0,
        }
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// The key of an object: `namespace/name` for a namespaced resource (as etcd's key
    /// ends), `name` for a cluster-scoped one.
    pub fn key(resource: Resource, namespace: Option<&str>, name: &str) -> (Resource, String) {
        if resource.namespaced() {
            (
                resource,
                format!("{}/{name}", namespace.unwrap_or("default")),
            )
        } else {
            (resource, name.to_owned())
        }
    }

    pub fn get(&self, resource: Resource, namespace: Option<&str>, name: &str) -> Option<&Value> {
        self.objects.get(&Store::key(resource, namespace, name))
    }

    /// Every stored object of a resource, in key order.
    pub fn objects(&self, resource: Resource) -> impl Iterator<Item = &Value> {
        self.objects
            .range((resource, String::new())..)
            .take_while(move |((r, _), _)| *r == resource)
            .map(|(_, o)| o)
    }

    /// Creates or replaces the object named by its metadata: fills in kind, apiVersion, the
    /// namespace of a namespaced object ("default"), a uid and a creationTimestamp (kept from the object
    /// it replaces), sets the next resourceVersion and sends ADDED or MODIFIED. Returns the
    /// stored object.
    pub fn put(&mut self, resource: Resource, mut object: Value) -> Value {
        if !object.is_object() || !object["metadata"].is_object() {
            panic!(
                "a {} must be a JSON object with a metadata object: {object}",
                resource.kind()
            );
        }
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("a {} needs metadata.name: {object}", resource.kind()))
            .to_owned();
        object["kind"] = json!(resource.kind());
        object["apiVersion"] = json!(resource.api_version());
        if resource.namespaced() && object["metadata"]["namespace"].as_str().is_none() {
            object["metadata"]["namespace"] = json!("default");
        }
        let key = Store::key(resource, object["metadata"]["namespace"].as_str(), &name);
        let previous = self.objects.get(&key).cloned();
        for field in ["uid", "creationTimestamp"] {
            if object["metadata"][field].is_null() {
                object["metadata"][field] = match previous.as_ref() {
                    Some(p) => p["metadata"][field].clone(),
                    None if field == "uid" => json!(self.new_uid()),
                    None => json!(rfc3339(SystemTime::now())),
                };
            }
        }
        let kind = if previous.is_some() {
            ChangeType::Modified
        } else {
            ChangeType::Added
        };
        self.commit(key, kind, object, previous)
    }

    /// Replaces an existing object with `object` (already checked by the caller), with
    /// the next resourceVersion, and sends MODIFIED. Returns the stored object.
    pub fn replace(
        &mut self,
        resource: Resource,
        namespace: Option<&str>,
        name: &str,
        object: Value,
    ) -> Value {
        let key = Store::key(resource, namespace, name);
        let previous = self.objects.get(&key).cloned();
        assert!(previous.is_some(), "replace of an absent {key:?}");
        self.commit(key, ChangeType::Modified, object, previous)
    }

    /// Removes the object and sends DELETED with its last state at the deletion's
    /// resourceVersion. Returns that state, or None if there was no such object.
    pub fn delete(
        &mut self,
        resource: Resource,
        namespace: Option<&str>,
        name: &str,
    ) -> Option<Value> {
        let key = Store::key(resource, namespace, name);
        let object = self.objects.remove(&key)?;
        Some(self.commit(key, ChangeType::Deleted, object, None))
    }

    fn commit(
        &mut self,
        key: (Resource, String),
        kind: ChangeType,
        mut object: Value,
        previous: Option<Value>,
    ) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        if kind != ChangeType::Deleted {
            self.objects.insert(key.clone(), object.clone());
        }
        let change = Change {
            rv: self.rv,
            resource: key.0,
            kind,
            object: object.clone(),
            previous,
        };
        self.watchers
            .retain(|_, w| match event_for(&w.scope, &change) {
                Some(event) => w.events.send(event).is_ok(),
                None => !w.events.is_closed(),
            });
        self.history.push_back(change);
        while self.history.len() > MAX_HISTORY {
            let forgotten = self.history.pop_front().expect("history is not empty");
            self.oldest = forgotten.rv;
        }
        object
    }

    /// The objects in scope, in key order, and the resourceVersion of the list. A
    /// `resourceVersion` of None or 0 means now; an older one than the history holds is
    /// Expired; any other is served from now too.
    pub fn list(
        &self,
        scope: &Scope,
        resource_version: Option<u64>,
    ) -> Result<(Vec<Value>, u64), Expired> {
        if let Some(rv) = resource_version.filter(|rv| *rv != 0) {
            self.check_not_expired(rv)?;
        }
        let items = self
            .objects(scope.resource)
            .filter(|o| scope.matches(o))
            .cloned()
            .collect();
        Ok((items, self.rv))
    }

    fn check_not_expired(&self, rv: u64) -> Result<(), Expired> {
        if rv < self.oldest {
            return Err(Expired {
                requested: rv,
                oldest: self.oldest,
            });
        }
        Ok(())
    }

    /// Opens a watch and returns its id and the events to send before the live ones.
    /// From None (resourceVersion unset or "0"): a synthetic ADDED for every object in
    /// scope. From a resourceVersion: the retained changes after it, or Expired.
    /// `initial_events` (sendInitialEvents=true) sends the objects in scope as ADDED and
    /// then a bookmark annotated `k8s.io/initial-events-end`, whatever the start.
    pub fn watch(
        &mut self,
        scope: Scope,
        from: Option<u64>,
        initial_events: bool,
        events: UnboundedSender<Value>,
    ) -> Result<(u64, Vec<Value>), Expired> {
        let replay = match from.filter(|rv| *rv != 0) {
            _ if initial_events => {
                let mut out = self.current_as_added(&scope);
                let mut end = self.bookmark(scope.resource);
                end["object"]["metadata"]["annotations"] =
                    json!({"k8s.io/initial-events-end": "true"});
                out.push(end);
                out
            }
            None => self.current_as_added(&scope),
            Some(rv) => {
                self.check_not_expired(rv)?;
                self.history
                    .iter()
                    .filter(|c| c.rv > rv)
                    .filter_map(|c| event_for(&scope, c))
                    .collect()
            }
        };
        let id = self.next_watcher;
        self.next_watcher += 1;
        self.watchers.insert(id, Watcher { scope, events });
        Ok((id, replay))
    }

    fn current_as_added(&self, scope: &Scope) -> Vec<Value> {
        let (items, _) = self
            .list(scope, None)
            .expect("a list from now is never expired");
        items
            .into_iter()
            .map(|o| json!({"type": "ADDED", "object": o}))
            .collect()
    }

    pub fn unwatch(&mut self, id: u64) {
        self.watchers.remove(&id);
    }

    /// Open watches of a resource.
    pub fn watchers(&self, resource: Resource) -> usize {
        self.watchers
            .values()
            .filter(|w| w.scope.resource == resource)
            .count()
    }

    /// Open watches of every resource.
    pub fn all_watchers(&self) -> usize {
        self.watchers.len()
    }

    /// Ends every watch: their channels close once the last event is read.
    pub fn close_watches(&mut self) {
        self.watchers.clear();
    }

    /// Forgets every retained change: a list or watch from an older resourceVersion than
    /// the current one is Expired from now on.
    pub fn expire_history(&mut self) {
        self.history.clear();
        self.oldest = self.rv;
    }

    /// A BOOKMARK event at the current resourceVersion. Every change up to it has been
    /// sent to every open watch already (changes are sent as they are committed).
    pub fn bookmark(&self, resource: Resource) -> Value {
        json!({"type": "BOOKMARK", "object": {"kind": resource.kind(), "apiVersion": resource.api_version(),
                                              "metadata": {"resourceVersion": self.rv.to_string()}}})
    }

    fn new_uid(&mut self) -> String {
        self.created += 1;
        format!(
            "{:08x}-0000-4000-8000-{:012x}",
            self.uid_prefix, self.created
        )
    }
}

/// What a watch with `scope` sees of a change, as the API server's watch cache decides:
/// a modification that moves an object into the scope is ADDED, one that moves it out is
/// DELETED (the old object at the new resourceVersion).
fn event_for(scope: &Scope, change: &Change) -> Option<Value> {
    if scope.resource != change.resource {
        return None;
    }
    let now = scope.matches(&change.object);
    let (kind, object) = match change.kind {
        ChangeType::Added => (now.then_some("ADDED")?, change.object.clone()),
        ChangeType::Deleted => (now.then_some("DELETED")?, change.object.clone()),
        ChangeType::Modified => {
            let before = change.previous.as_ref().is_some_and(|p| scope.matches(p));
            match (before, now) {
                (true, true) => ("MODIFIED", change.object.clone()),
                (false, true) => ("ADDED", change.object.clone()),
                (true, false) => {
                    let mut old = change.previous.clone().expect("checked above");
                    old["metadata"]["resourceVersion"] = json!(change.rv.to_string());
                    ("DELETED", old)
                }
                (false, false) => return None,
            }
        }
    };
    Some(json!({"type": kind, "object": object}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

    fn pod(name: &str, node: &str) -> Value {
        json!({"metadata": {"name": name, "namespace": "ns"}, "spec": {"nodeName": node}})
    }

    fn on(node: &str) -> Scope {
        let mut s = Scope::all(Resource::Pods);
        s.fields = Selector::fields(Resource::Pods, &format!("spec.nodeName={node}")).unwrap();
        s
    }

    /// Each event as "TYPE name rv".
    fn summary(events: &[Value]) -> Vec<String> {
        events
            .iter()
            .map(|e| {
                format!(
                    "{} {} {}",
                    e["type"].as_str().unwrap(),
                    e["object"]["metadata"]["name"].as_str().unwrap_or("-"),
                    e["object"]["metadata"]["resourceVersion"].as_str().unwrap()
                )
            })
            .collect()
    }

    fn drain(rx: &mut UnboundedReceiver<Value>) -> Vec<Value> {
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    #[test]
    fn a_selector_watch_sees_objects_enter_and_leave_its_scope() {
        let mut s = Store::new(0);
        s.put(Resource::Pods, pod("a", "n1"));
        let (tx, mut rx) = unbounded_channel();
        let (_, replay) = s.watch(on("n1"), None, false, tx).unwrap();
        assert_eq!(summary(&replay), ["ADDED a 2"]);
        s.put(Resource::Pods, pod("b", "n2"));
        s.put(Resource::Pods, pod("b", "n1"));
        s.put(Resource::Pods, pod("a", "n2"));
        s.put(Resource::Nodes, json!({"metadata": {"name": "n1"}}));
        s.delete(Resource::Pods, Some("ns"), "b");
        let events = drain(&mut rx);
        assert_eq!(
            summary(&events),
            ["ADDED b 4", "DELETED a 5", "DELETED b 7"]
        );
        assert_eq!(
            events[1]["object"]["spec"]["nodeName"], "n1",
            "the object as it was in scope"
        );
    }

    #[test]
    fn a_watch_resumes_from_the_history_until_it_is_expired() {
        let mut s = Store::new(0);
        for (i, n) in ["a", "b", "c"].into_iter().enumerate() {
            s.put(Resource::Pods, pod(n, if i == 1 { "n2" } else { "n1" }));
        }
        let (tx, _rx) = unbounded_channel();
        let (_, replay) = s.watch(on("n1"), Some(2), false, tx.clone()).unwrap();
        assert_eq!(summary(&replay), ["ADDED c 4"]);
        assert_eq!(s.watchers(Resource::Pods), 1);
        assert_eq!(s.watchers(Resource::Nodes), 0);
        s.expire_history();
        assert_eq!(
            s.watch(on("n1"), Some(3), false, tx.clone()).unwrap_err(),
            Expired {
                requested: 3,
                oldest: 4
            }
        );
        assert_eq!(
            s.list(&on("n1"), Some(3)).unwrap_err().message(),
            "too old resource version: 3 (4)"
        );
        assert!(
            s.watch(on("n1"), Some(4), false, tx.clone())
                .unwrap()
                .1
                .is_empty()
        );
        let (items, rv) = s.list(&on("n1"), Some(0)).unwrap();
        assert_eq!((items.len(), rv), (2, 4));
        let (_, initial) = s.watch(on("n2"), Some(4), true, tx).unwrap();
        assert_eq!(summary(&initial), ["ADDED b 3", "BOOKMARK - 4"]);
        assert_eq!(
            initial[1]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
            "true"
        );
    }

    #[test]
    fn a_replaced_object_keeps_its_uid_and_creation_time() {
        let mut s = Store::new(7);
        let first = s.put(Resource::Pods, pod("a", "n1"));
        assert_eq!(
            first["metadata"]["uid"],
            "00000007-0000-4000-8000-000000000001"
        );
        assert_eq!(
            (first["kind"].as_str(), first["apiVersion"].as_str()),
            (Some("Pod"), Some("v1"))
        );
        let second = s.put(Resource::Pods, pod("a", "n2"));
        assert_eq!(second["metadata"]["uid"], first["metadata"]["uid"]);
        assert_eq!(
            second["metadata"]["creationTimestamp"],
            first["metadata"]["creationTimestamp"]
        );
        let defaulted = s.put(Resource::Pods, json!({"metadata": {"name": "x"}}));
        assert_eq!(defaulted["metadata"]["namespace"], "default");
    }

    #[test]
    fn objects_of_a_named_group_carry_its_api_version() {
        let mut s = Store::new(0);
        let slice = s.put(
            Resource::EndpointSlices,
            json!({"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}}}),
        );
        assert_eq!(
            (slice["kind"].as_str(), slice["apiVersion"].as_str()),
            (Some("EndpointSlice"), Some("discovery.k8s.io/v1"))
        );
        assert_eq!(slice["metadata"]["namespace"], "default");
        s.put(
            Resource::Leases,
            json!({"metadata": {"name": "web-1", "namespace": "default"}}),
        );
        assert_eq!(
            s.objects(Resource::EndpointSlices).count(),
            1,
            "the same name in another resource is another object"
        );
        let bookmark = s.bookmark(Resource::Leases);
        assert_eq!(
            (
                bookmark["object"]["kind"].as_str(),
                bookmark["object"]["apiVersion"].as_str()
            ),
            (Some("Lease"), Some("coordination.k8s.io/v1"))
        );
        let (tx, _rx) = unbounded_channel();
        s.watch(Scope::all(Resource::Services), None, false, tx)
            .unwrap();
        assert_eq!(
            (
                s.watchers(Resource::Services),
                s.watchers(Resource::Leases),
                s.all_watchers()
            ),
            (1, 0, 1)
        );
    }
}
