//! The open WatchEndpoints streams of this process, keyed by (cluster, node, instance):
//! a new stream with the key of an open one replaces it. An agent's owner and its
//! standby carry distinct instances and keep a stream each; an agent that reconnects
//! before its old connection is noticed dead replaces its own stale stream.

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

#[derive(Default)]
pub struct Streams {
    open: Mutex<Open>,
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

impl Streams {
    /// Registers a stream under `key`. The receiver fires when a newer stream takes the
    /// key; the second value says whether this one replaced an open stream.
    pub fn open(
        self: &Arc<Self>,
        key: StreamKey,
    ) -> (Registration, oneshot::Receiver<Replaced>, bool) {
        let (tx, rx) = oneshot::channel();
        let mut open = self.open.lock().expect("streams lock");
        open.last_id += 1;
        let id = open.last_id;
        let replaced = match open
            .by_key
            .insert(key.clone(), OpenStream { id, replace: tx })
        {
            Some(old) => old.replace.send(Replaced).is_ok(),
            None => false,
        };
        (
            Registration {
                streams: self.clone(),
                key,
                id,
            },
            rx,
            replaced,
        )
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
        let (owner, mut owner_rx, replaced) = streams.open(key("agent-a"));
        assert!(!replaced);
        let (standby, mut standby_rx, replaced) = streams.open(key("agent-b"));
        assert!(!replaced, "another instance is another key");
        assert!(owner_rx.try_recv().is_err() && standby_rx.try_recv().is_err());

        let (old, mut old_rx, _) = streams.open(key(""));
        let (new, _new_rx, replaced) = streams.open(key(""));
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
}
