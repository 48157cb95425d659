//! The registry API (`aether.registry.v1`) between node agents and a registrar,
//! generated from `proto/aether/registry/v1/registry.proto` by `build.rs`.
//!
//! Backward compatible across one version: fields are only added, never removed,
//! renumbered or retyped. `tests/registry_compat.rs` checks the current file against
//! the committed v1 descriptor set.

tonic::include_proto!("aether.registry.v1");

/// The committed descriptor set of v1, the reference of the compatibility rule.
pub const V1_DESCRIPTOR_SET: &[u8] =
    include_bytes!("../proto/aether/registry/v1/registry.v1.binpb");
