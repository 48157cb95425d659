//! Generates the gRPC APIs with protox, a pure-Rust protobuf compiler: there is no
//! `protoc` on build machines. Each only when its feature is on; the supervisor builds
//! this crate with neither and links no gRPC stack.
//! - `cni-api`: the CNI API (`aether.cni.v1`), between `aether-cni` and the worker;
//! - `registry-api`: the registry API (`aether.registry.v1`), between agents and a
//!   registrar.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=build.rs");
    for (feature, proto) in [
        ("CNI_API", "aether/cni/v1/cni.proto"),
        ("REGISTRY_API", "aether/registry/v1/registry.proto"),
    ] {
        if std::env::var_os(format!("CARGO_FEATURE_{feature}")).is_none() {
            continue;
        }
        let fds = protox::compile([proto], ["proto"])?;
        tonic_prost_build::configure()
            .build_server(true)
            .build_client(true)
            .compile_fds(fds)?;
    }
    Ok(())
}
