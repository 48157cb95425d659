//! Owner-only persisted state: files in `<state-dir>` that describe the node to whoever
//! reads them after this process, written by the agent that owns the node and by no other.
//!
//! - [`observed`]: the observed upstreams (`observed-upstreams.json`), which the next
//!   owner serves the proxy's reconnect from.
//! - [`mesh_dns`]: the mesh-DNS snapshot (`mesh-dns.json`, service names to VIPs) and its
//!   heartbeat (`mesh-dns.heartbeat`), for a node-local resolver.
//! - [`quic_pairs`]: the node's QUIC pairs (`quic-pairs.json`), also advertised to the
//!   registry by the owner.
//!
//! Rules shared by all, from the design record: every agent restores what the files hold
//! at start; a standby writes nothing; the owner's writers start when it serves; a drained
//! owner's last write lands before it releases the node lock, so the successor reads it.
//! Every write is atomic: a temp file in the same folder renamed over the file, so a
//! reader sees the old content or the new, never a mix. Both documents are also durable
//! (fsync of the temp file before the rename, of the folder after); the heartbeat is not,
//! as a heartbeat means nothing after a machine crash.

pub mod mesh_dns;
pub mod observed;
pub mod quic_pairs;

pub use mesh_dns::MeshDns;
pub use observed::{FILE, FLUSH_DELAY, Observed, run_writer};
pub use quic_pairs::QuicPairs;
