//! mori-io: the IO engine for one-sided KV-cache transfer. Engines exchange [`EngineDesc`]s and
//! [`MemoryDesc`]s out of band, register memory once per region, and move batches of blocks
//! (arrays of offsets and sizes) with reads and writes that complete as [`Transfer`]s.
//!
//! Every connection proves the deployment secret ([`Secret`]) in both directions, and every
//! request names a region and its random key, so only descriptors that were handed out reach
//! memory, and a descriptor of a restarted engine is refused.
//!
//! Routes, chosen per transfer by memory location and peer: cuda_ipc (same host, the peer
//! region is GPU memory: this engine's GPU copies through an IPC mapping), the same-host direct
//! path (host memory on both sides, over the peer's Unix socket), fabric (host memory, a peer
//! on another host, both engines with a libfabric endpoint: one-sided RMA, see [`FabricMode`]),
//! and TCP (anything else, and the fallback when a faster route is unavailable). Each route is a
//! plane behind one trait (`plane.rs`); a batch goes to the first that reaches the peer's region.

mod desc;
mod engine;
mod fabric;
mod plane;

pub use desc::{EngineDesc, FabricDesc, MemoryDesc};
pub use engine::{EngineConfig, IoEngine, Notification, Op};
pub use fabric::{FabricMode, mask as fabric_key_mask};
pub use mori_auth::Secret;
pub use mori_transport::cuda_ipc::{DEFAULT_CE_THRESHOLD, ce_threshold_from_env, parse_bytes};
pub use mori_transport::{
    Batch, Error, Failure, FailureKind, KeepAlive, Location, Result, Route, Status, Transfer,
};
