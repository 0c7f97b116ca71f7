//! Compiles proto/umbp.proto without protoc: protox parses it into a FileDescriptorSet,
//! tonic-prost-build generates the prost messages and the tonic client and server.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/umbp.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
