//! mori-net: one-sided RMA between hosts. The `fabric` backend drives libfabric, loaded at run
//! time (providers `verbs;ofi_rxm` for InfiniBand/RoCE, `efa`, `cxi`, and the software
//! `tcp;ofi_rxm`, which runs the same calls over TCP — what CI tests). See docs/net.md.

mod error;
pub mod fabric;

pub use error::{Error, Result};
