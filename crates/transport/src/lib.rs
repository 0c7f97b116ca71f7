//! mori-transport: the data plane of mori.io. Registered memory regions (host or CUDA), the
//! wire format, transfer completion, the TCP transport (any host) and its same-host direct
//! path (the target copies straight between processes), and the cuda_ipc path (same host, GPU
//! memory: the initiator's GPU copies through a CUDA IPC mapping of the peer's region).

mod access;
pub mod batch;
pub mod cuda_ipc;
pub mod direct;
mod error;
pub mod registry;
pub mod tcp;
pub mod transfer;
pub mod wire;

pub use batch::{Batch, KeepAlive};
pub use error::{Code, Error, Result};
pub use registry::{Location, Region, Registry, UseGuard};
pub use transfer::{Failure, FailureKind, Finished, Route, Status, Transfer};
