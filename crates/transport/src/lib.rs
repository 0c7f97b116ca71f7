//! mori-transport: the data plane of mori.io. Registered memory regions (with keys), the
//! wire format, transfer completion, the serving side (authenticated TCP and same-host Unix
//! connections), client connections, the same-host direct copy, and the cuda_ipc path (same
//! host, GPU memory: the initiator's GPU copies through a CUDA IPC mapping of the peer's
//! region).

mod access;
pub mod batch;
pub mod connection;
pub mod cuda_ipc;
pub mod direct;
mod error;
pub mod notify;
pub mod registry;
pub mod server;
pub mod stream;
pub mod transfer;
pub mod wire;

pub use batch::{Batch, KeepAlive};
pub use error::{Code, Error, Result};
/// The user's private directory for same-host sockets (0700, ownership checked).
pub use mori_gpu::fdpass::private_dir;
pub use notify::Notifications;
pub use registry::{Location, Region, Registry, UseGuard};
pub use transfer::{Failure, FailureKind, Finished, Route, Status, Transfer};
