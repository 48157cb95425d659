//! Generates the two APIs of the test identity provider (`src/identity`) with protox, a
//! pure-Rust protobuf compiler (there is no `protoc` on build machines), servers and
//! clients both:
//! - the SPIFFE Workload API (`proto/workload.proto`, service `SpiffeWorkloadAPI`, no
//!   package);
//! - SPIRE's Delegated Identity API
//!   (`proto/spire/api/agent/delegatedidentity/v1/delegatedidentity.proto`, package
//!   `spire.api.agent.delegatedidentity.v1`, with the `spire.api.types` it imports).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=build.rs");
    let fds = protox::compile(
        [
            "workload.proto",
            "spire/api/agent/delegatedidentity/v1/delegatedidentity.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
