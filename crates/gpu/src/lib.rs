//! mori-gpu: the CUDA driver (through cudarc, loaded at run time), NVRTC JIT with an on-disk
//! cache, device and pinned memory, streams and events, and sharing device memory between
//! processes (legacy IPC handles, VMM allocations exported as file descriptors).
//!
//! Nothing here panics when the driver or NVRTC is missing: every entry point returns
//! [`Error::LibraryNotFound`] instead.

mod device;
mod driver;
mod error;
pub mod fdpass;
mod ipc;
pub mod jit;
pub mod kernels;
mod memory;
pub mod nvrtc;
mod stream;
mod vmm;

pub use device::Device;
pub use driver::{device_count, driver_version, ensure_driver};
pub use error::{Error, Result};
pub use ipc::{IPC_EXPORT_BYTES, IpcExport, IpcMapping};
pub use memory::{
    DeviceBuffer, PinnedBuffer, copy, copy_async, copy_device_to_host, copy_host_to_device,
    memset_async,
};
pub use stream::{
    Event, Stream, StreamHandle, WaitCondition, stream_wait_value32, stream_write_value32,
};
pub use vmm::{Mapping, PhysicalMemory, VaRange, VmmAllocation, granularity as vmm_granularity};
