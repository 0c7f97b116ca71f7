//! mori-collective: the host runtime of mori.ep and mori.ccl. Today: the kernels' parameters
//! as typed `#[repr(C)]` structs, one per parameter list ([`ep`], [`ccl`]), the one source of
//! truth for what a launch passes. Tests check each struct against its CUDA signature, by
//! parsing `kernels/` (`tests/signatures.rs`) and by compiling static_asserts with NVRTC
//! (`tests/nvrtc_layout.rs`).

pub mod across_nodes;
pub mod ccl;
pub mod communicator;
pub mod ep;
pub mod ep_buffers;
pub mod ep_internode;
pub mod ep_runtime;
mod error;
pub mod host;
mod launch;
pub mod params;

pub use error::{Error, Result};
pub use launch::Kernel;
pub use params::{DevicePtr, KernelParams, Layout, Packed, Packer, Value};

/// The layout of every parameter struct.
pub fn layouts() -> [&'static Layout; 12] {
    [
        ep::EpPrepare::layout(),
        ep::EpDispatch::layout(),
        ep::EpExportReceived::layout(),
        ep::EpCombineSend::layout(),
        ep::EpCombineReduce::layout(),
        ep::EpLlDispatchSend::layout(),
        ep::EpLlDispatchRecv::layout(),
        ep::EpLlCombineSend::layout(),
        ep::EpLlCombineRecv::layout(),
        ep::EpLlRoute::layout(),
        ep::EpInternodeArgs::layout(),
        ccl::CclArgs::layout(),
    ]
}

/// `entry`'s name (as a static string) and parameter layout.
pub fn lookup(entry: &str) -> Result<(&'static str, &'static Layout)> {
    layouts()
        .into_iter()
        .find_map(|l| l.entries.iter().find(|e| **e == entry).map(|e| (*e, l)))
        .ok_or_else(|| Error::UnknownEntry(entry.to_string()))
}

/// A [`Packer`] for `entry`.
pub fn packer(entry: &str) -> Result<Packer> {
    let (entry, layout) = lookup(entry)?;
    Ok(Packer::new(entry, layout))
}
