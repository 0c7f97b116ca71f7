//! mori-shmem: symmetric memory across processes and GPUs.
//!
//! Each PE (one process, one GPU) reserves a heap of virtual addresses; collective allocations
//! return the same offset on every PE and are backed on demand with VMM memory that is
//! exported to every load/store-reachable peer (same node, P2P) and mapped there. Kernels reach
//! a peer's copy at `peer_base[pe] + offset` through the device API in
//! `kernels/shmem/mori_shmem.cuh`; the per-PE state reaches each module as its
//! `mori_shmem_state` constant, written when [`Shmem::load`] first loads the module in a session.
//! Peers that are not reachable by load/store (other nodes) keep a zero base; the device API
//! reaches them through the [`proxy`]: a ring of requests a host thread moves with mori.io.

mod alloc;
mod error;
mod heap;
pub mod proxy;
mod session;
mod state;

pub use alloc::SymmetricAllocator;
pub use error::{Error, Result};
pub use session::{NodeTeam, Registered, Shmem};
pub use state::{DeviceState, INTERNAL_BYTES, MAX_PES, STATE_SYMBOL};
