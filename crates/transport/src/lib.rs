//! mori-transport: the data plane of mori.io. Registered memory regions (host or CUDA), the
//! wire format, transfer completion, and the TCP transport (any host). Same-host transports
//! (shared memory, CUDA IPC) plug in beside TCP later.

mod access;
mod error;
pub mod registry;
pub mod tcp;
pub mod transfer;
pub mod wire;

pub use error::{Code, Error, Result};
pub use registry::{Location, Region, Registry, UseGuard};
pub use transfer::{Failure, FailureKind, Status, Transfer};
