//! mori-io: the IO engine for one-sided KV-cache transfer. Engines exchange [`EngineDesc`]s and
//! [`MemoryDesc`]s out of band, register memory once per region, and move batches of blocks
//! (arrays of offsets and sizes) with reads and writes that complete as [`Transfer`]s.
//!
//! Transports: TCP (any host) today; shared memory and CUDA IPC for same-host peers are the
//! next pieces (routing by memory location will choose among them, falling back to TCP).

mod desc;
mod engine;

pub use desc::{EngineDesc, MemoryDesc};
pub use engine::{EngineConfig, IoEngine, Notification, Op};
pub use mori_transport::{Error, Failure, FailureKind, Location, Result, Status, Transfer};
