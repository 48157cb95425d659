//! The CNI gRPC API (`aether.cni.v1`) between the `aether-cni` plugin and the worker,
//! generated from `proto/aether/cni/v1/cni.proto` by `build.rs`.
//!
//! Backward compatible across one version in both directions: fields are only added,
//! and unknown fields are ignored on decode (see `tests/cni_compat.rs`).

tonic::include_proto!("aether.cni.v1");
