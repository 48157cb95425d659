//! The open WatchEndpoints streams of this process, keyed by (cluster, node, instance):
//! a new stream with the key of an open one replaces it. An agent's owner and its
//! standby carry distinct instances and keep a stream each; an agent that reconnects
//! before its old connection is noticed dead replaces its own stale stream. A node
//! (cluster and node) has at most `per_node` streams of distinct instances open: a new
//! instance past that is refused, so a caller cannot open streams without bound by
//! varying the free-form `instance`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamKey {
    pub cluster: String,
    pub node: String,
    /// Empty for agents that predate the field: the key is then (cluster, node).
    pub instance: String,
}

impl fmt::Display for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cluster {:?}, node {:?}, instance {:?}",
            self.cluster, self.node, self.instance
        )
    }
}

/// Told to a stream that a newer one took its key.
#[derive(Debug)]
pub struct Replaced;

pub struct Streams {
    open: Mutex<Open>,
    per_node: usize,
}

/// A new instance's stream refused: the node has `per_node` streams open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node {node:?} already has {} watch streams open (instances {open:?}), the most one node may have", open.len())]
pub struct OverCap {
    pub node: String,
    pub open: Vec<String>,
}

#[derive(Default)]
struct Open {
    last_id: u64,
    by_key: HashMap<StreamKey, OpenStream>,
}

struct OpenStream {
    id: u64,
    replace: oneshot::Sender<Replaced>,
}

/// A registered stream; dropping it unregisters it unless a newer one took its key.
pub struct Registration {
    streams: Arc<Streams>,
    key: StreamKey,
    id: u64,
}

impl Default for Streams {
    fn default() -> Self {
        Streams::new(usize::MAX)
    }
}

/// An open stream's registration, the receiver told when a newer stream takes its key,
/// and whether it replaced an open stream.
pub type Opened = (Registration, oneshot::Receiver<Replaced>, bool);

impl Streams {
    pub fn new(per_node: usize) -> Self {
        Streams {
            open: Mutex::default(),
            per_node,
        }
    }

    /// Registers a stream under `key`, or refuses a new instance past the node's cap. The
    /// receiver fires when a newer stream takes the key; the bool says whether this one
    /// replaced an open stream.
    pub fn open(self: &Arc<Self>, key: StreamKey) -> Result<Opened, OverCap> {
        let (tx, rx) = oneshot::channel();
        let mut open = self.open.lock().expect("streams lock");
        if !open.by_key.contains_key(&key) {
            let mut same_node: Vec<String> = open
                .by_key
                .keys()
                .filter(|k| k.cluster == key.cluster && k.node == key.node)
                .map(|k| k.instance.clone())
                .collect();
            if same_node.len() >= self.per_node {
                same_node.sort();
                return Err(OverCap {
                    node: key.node,
                    open: same_node,
                });
            }
        }
        open.last_id += 1;
        let id = open.last_id;
        let replaced = match open
            .by_key
            .insert(key.clone(), OpenStream { id, replace: tx })
        {
            Some(old) => old.replace.send(Replaced).is_ok(),
            None => false,
        };
        Ok((
            Registration {
                streams: self.clone(),
                key,
                id,
            },
            rx,
            replaced,
        ))
    }

    pub fn len(&self) -> usize {
        self.open.lock().expect("streams lock").by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut open = self.streams.open.lock().expect("streams lock");
        if open.by_key.get(&self.key).is_some_and(|s| s.id == self.id) {
            open.by_key.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(instance: &str) -> StreamKey {
        StreamKey {
            cluster: "c".into(),
            node: "n1".into(),
            instance: instance.into(),
        }
    }

    #[test]
    fn a_stream_is_replaced_only_by_one_with_its_whole_key() {
        let streams = Arc::new(Streams::default());
        let (owner, mut owner_rx, replaced) = streams.open(key("agent-a")).ok().unwrap();
        assert!(!replaced);
        let (standby, mut standby_rx, replaced) = streams.open(key("agent-b")).ok().unwrap();
        assert!(!replaced, "another instance is another key");
        assert!(owner_rx.try_recv().is_err() && standby_rx.try_recv().is_err());

        let (old, mut old_rx, _) = streams.open(key("")).ok().unwrap();
        let (new, _new_rx, replaced) = streams.open(key("")).ok().unwrap();
        assert!(replaced);
        assert!(
            old_rx.try_recv().is_ok(),
            "the older stream of the key is told"
        );
        // The replaced stream ending does not unregister its successor.
        drop(old);
        assert_eq!(streams.len(), 3);
        drop(new);
        drop(owner);
        drop(standby);
        assert!(streams.is_empty());
    }

    #[test]
    fn a_node_has_at_most_its_cap_of_instances_and_a_known_instance_replaces() {
        let streams = Arc::new(Streams::new(2));
        let (owner, mut owner_rx, _) = streams.open(key("agent-a")).ok().unwrap();
        let (_standby, _, _) = streams.open(key("agent-b")).ok().unwrap();
        let e = streams.open(key("agent-c")).err().unwrap();
        assert_eq!(e.open, ["agent-a", "agent-b"]);
        assert!(
            e.to_string().contains("already has 2 watch streams open"),
            "{e}"
        );
        // Another node has its own cap.
        let other = StreamKey {
            node: "n2".into(),
            ..key("agent-c")
        };
        let _other = streams.open(other).ok().unwrap();
        // An open instance still replaces its own stream at the cap.
        let (_again, _, replaced) = streams.open(key("agent-a")).ok().unwrap();
        assert!(replaced && owner_rx.try_recv().is_ok());
        drop(owner);
        assert!(
            streams.open(key("agent-c")).is_err(),
            "agent-a's newer stream holds its place"
        );
    }
}
