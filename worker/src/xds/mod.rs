//! The ADS server for LDS, RDS, CDS and EDS, served on the `xds.sock` listening fd
//! handed over at takeover, in both variants of the protocol: incremental
//! (`DELTA_GRPC`, the bootstrap's default, [`delta::DeltaState`]) and state of the world
//! (`GRPC`, [`stream::StreamState`]); the proxy's bootstrap picks one.
//!
//! The modules form a one-way graph: [`kind`] is the vocabulary; [`protocol`] the pure
//! per-stream contract that [`stream`] and [`delta`] implement over [`encoded`]
//! resources; [`wire`] the decoded requests; [`server`] the only one that knows tonic.
//! Protobuf types stay in this module ([`convert`] turns model resources into them).

pub mod convert;
pub mod delta;
pub mod digest;
pub mod encoded;
pub mod kind;
pub mod probe;
pub mod protocol;
pub mod server;
pub mod stream;
pub mod tombstone;
pub mod wire;

pub use probe::await_server;
pub use server::serve;
