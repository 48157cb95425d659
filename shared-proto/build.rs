//! Generates the CNI API (`aether.cni.v1`) with protox, a pure-Rust protobuf compiler:
//! there is no `protoc` on build machines. Only when the `cni-api` feature is on; the
//! supervisor builds this crate without it and links no gRPC stack.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CNI_API").is_none() {
        return Ok(());
    }
    let fds = protox::compile(["aether/cni/v1/cni.proto"], ["proto"])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
