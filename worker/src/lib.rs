//! The unprivileged half of the Aether node agent.
//!
//! Data flows one way: sources (storage, registry, CNI calls, capture projection) convert
//! into the pure model (`aether-model`) and feed [`node`], which owns the snapshot inputs
//! and the incremental builder, and publishes each new snapshot on a watch channel;
//! adapters ([`xds`], [`health`], [`cni`]) read from it. Only the
//! xDS and CNI adapters know protobuf types. [`takeover`] is the pure role and phase
//! state machine; [`lifecycle`] wraps it with every other decision of the worker's life,
//! also pure; [`agent`] wires the worker and performs what the lifecycle decides.
#![forbid(unsafe_code)]

pub mod accept;
pub mod acks;
pub mod agent;
pub mod backoff;
pub mod bootstrap;
pub mod capture;
pub mod cni;
pub mod config;
pub mod conflist;
pub mod control;
pub mod fdcheck;
pub mod health;
pub mod heavy;
pub mod httpmini;
pub mod identity;
pub mod kube;
pub mod lifecycle;
pub mod lockwait;
pub mod metrics;
pub mod node;
pub mod registrar;
pub mod registry;
pub mod storage;
pub mod takeover;
#[cfg(test)]
pub(crate) mod test_rng;
pub mod writers;
pub mod xds;
