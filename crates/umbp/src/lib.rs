//! UMBP (a tiered KV-block pool) — the storage tiers that one peer owns.
//!
//! This crate is the storage layer only; it has no networking and no master. A peer keeps
//! immutable values (KV blocks) under byte-string keys in two tiers:
//!
//! * [`dram::DramArena`] — one contiguous, 4096-byte aligned host allocation (so it can later
//!   be pinned and registered with the IO engine) carved into fixed-size pages; each value
//!   occupies one run of contiguous pages. Tracks least-recently-used order for eviction.
//! * [`ssd::SsdLog`] — an append-only log of CRC-checked records in segment files on an SSD,
//!   with crash recovery (torn tails, corrupt records), tombstones, capacity enforcement and
//!   compaction.
//!
//! Keys are immutable once written in both tiers: a second `put` of a live key is
//! [`Error::AlreadyExists`]; a key can be written again after it was removed.
//!
//! Neither tier does internal locking for writes (`put`/`remove` take `&mut self`); the daemon
//! wraps each tier in its own lock. Reads take `&self`.

#![warn(missing_docs)]

mod crc;
pub mod dram;
mod error;
pub mod ssd;

pub use crc::crc32c;
pub use dram::DramArena;
pub use error::{Error, Result};
pub use ssd::{CompactionReport, RecoveryReport, SsdConfig, SsdLog};
