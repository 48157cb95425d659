//! What the stream driver needs of a protocol's per-stream state: state of the world
//! ([`super::stream::StreamState`]) or incremental ([`super::delta::DeltaState`]). Pure:
//! no I/O and no transport; the server feeds it requests and snapshots and sends what
//! [`Protocol::pending`] returns.

use std::sync::Arc;

use aether_model::{Kind, Snapshot};

use super::encoded::Encoded;
use crate::writers::Observed;

pub trait Protocol: Send + 'static {
    type Request: Send + 'static;
    type Response: prost::Message + Send + 'static;
    const NAME: &'static str;
    fn new(current: Arc<Snapshot>, encoded: Arc<Encoded>) -> Self;
    /// The proxy fetches the mesh's clusters on demand and they are recorded in
    /// `observed`. Only the incremental protocol can; state of the world serves every
    /// cluster.
    fn on_demand(&mut self, _observed: Arc<Observed>) {}
    fn node_id(req: &Self::Request) -> Option<&str>;
    /// Applies one request from the proxy; what it meant, for logs and metrics.
    fn on_request(&mut self, req: &Self::Request) -> Event;
    fn current(&self) -> &Arc<Snapshot>;
    fn set_snapshot(&mut self, s: Arc<Snapshot>);
    /// The responses owed to the proxy now, in push order; marks them sent.
    fn pending(&mut self) -> Vec<Self::Response>;
    /// Whether the proxy has ACKed everything of the current snapshot that it uses.
    fn acked_current(&self) -> bool;
    /// (type URL, version, nonce, resource count) of a response, for logs and metrics.
    fn describe(resp: &Self::Response) -> (&str, &str, &str, usize);
}

/// What a request meant, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// First request for a type on this stream; `version` is what the proxy holds, and
    /// `holds_nothing` whether it holds nothing of the type (a proxy that starts fresh,
    /// not one resuming: by its versions, or by a relay's digests).
    Subscribe {
        kind: Kind,
        version: String,
        holds_nothing: bool,
    },
    Ack {
        kind: Kind,
        version: String,
        nonce: String,
    },
    Nack {
        kind: Kind,
        rejected_version: String,
        nonce: String,
        message: String,
    },
    /// A request answering an older response; superseded, ignored.
    Stale {
        kind: Kind,
        nonce: String,
    },
    UnknownType {
        type_url: String,
    },
}
