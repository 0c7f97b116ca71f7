//! UMBP (a tiered KV-block pool): the storage tiers of a peer, the master's metadata index,
//! and an embedded pool combining them in one process. No networking yet.
//!
//! A peer keeps immutable values (KV blocks) under byte-string keys in two tiers (three in the
//! embedded pool, with the GPU tier):
//!
//! * [`dram::DramArena`] — one contiguous, page-aligned host reservation (registered with the
//!   IO engine as one region; memory is used only where values are written) carved into
//!   fixed-size pages; each value occupies one run of contiguous pages. The page bookkeeping
//!   (allocation, least-recently-used order for eviction, pins, reservations) is
//!   [`pages::PageTable`], shared with the GPU tier.
//! * [`gpu::GpuArena`] (feature `gpu`) — the same pages in one device allocation, copied with
//!   the CUDA driver (through mori-gpu, loaded at run time).
//! * [`ssd::SsdLog`] — an append-only log of CRC-checked records in segment files on an SSD,
//!   with crash recovery (torn tails, corrupt records skipped by resynchronising on the next
//!   intact record), an exclusive lock on its directory, tombstones, capacity enforcement and
//!   compaction.
//!
//! The master knows where every key lives:
//!
//! * [`meta::MetadataStore`] — the key → [`meta::Location`] index behind a trait, with the
//!   in-memory, sharded [`meta::MemoryStore`] and a conformance suite every backend must pass.
//! * [`meta_redis::RedisStore`] (feature `redis`, on by default) — the same index in Redis or
//!   a Redis Cluster, shared by several masters.
//! * [`pool::LocalPool`] — the embedded pool: the index in front of an optional GPU arena, one
//!   DRAM arena and an optional SSD log, with watermark eviction, LRU demotion (GPU to DRAM,
//!   DRAM to SSD), promotion on SSD hits and restart persistence. What a client with no
//!   configuration runs in-process.
//!
//! Keys are immutable once written in every tier: a second `put` of a live key is
//! [`Error::AlreadyExists`] (in the pool: [`pool::PutOutcome::AlreadyExists`], a success);
//! a key can be written again after it was removed.
//!
//! No tier does internal locking for writes (`put`/`remove` take `&mut self`); the pool
//! (and later the daemon) wraps them in a lock. Reads take `&self`.

#![warn(missing_docs)]

mod crc;
pub mod dram;
mod error;
mod gang;
pub mod gpu;
pub mod meta;
#[cfg(feature = "redis")]
pub mod meta_redis;
pub mod pages;
pub mod pool;
pub mod ssd;
mod ssd_dir;
pub mod ssd_io;
mod ssd_scan;
mod uring;

pub use crc::{crc32c, crc32c_each};
pub use dram::DramArena;
pub use error::{Error, Result};
pub use gang::copy_split;
pub use gpu::GpuArena;
pub use meta::{Location, MemoryStore, MetadataStore, Tier};
#[cfg(feature = "redis")]
pub use meta_redis::{RedisOptions, RedisStore};
pub use pages::{PageTable, PinToken, Reserved};
pub use pool::{
    CloseReport, DramHolds, GpuTierConfig, LocalPool, PoolConfig, PoolStats, Progress, PutOutcome,
    PutReservation, ReadSlot, ReserveSlot, Residency, VerifyingReads,
};
pub use ssd::{CompactionReport, RecoveryReport, SsdConfig, SsdLog};
pub use ssd_io::{SsdIoBackend, SsdIoMode};
