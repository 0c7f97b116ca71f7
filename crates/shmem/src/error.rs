//! Errors of the symmetric heap.

/// Everything mori-shmem can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Gpu(#[from] mori_gpu::Error),
    #[error(transparent)]
    Bootstrap(#[from] mori_bootstrap::Error),
    /// Setting up the proxy's data plane (its mori.io engine).
    #[error(transparent)]
    Io(#[from] mori_io::Error),
    /// The proxy that reaches PEs on other nodes failed (a transfer, a lost peer, a misuse).
    #[error("mori.shmem proxy: {0}")]
    Proxy(String),
    /// The heap cannot hold the request.
    #[error(
        "symmetric heap exhausted: cannot allocate {requested} bytes (aligned to {align}); {free} of {capacity} bytes free, largest free block {largest} bytes. Raise MORI_SHMEM_HEAP_SIZE"
    )]
    OutOfMemory {
        requested: u64,
        align: u64,
        free: u64,
        capacity: u64,
        largest: u64,
    },
    /// PEs called a collective with different arguments.
    #[error("{0}")]
    Mismatch(String),
    #[error("{0}")]
    InvalidArgument(String),
    /// A shmem session is already active in this process (one per process).
    #[error("mori.shmem is already initialised in this process; call finalize() first")]
    AlreadyInitialized,
}

pub type Result<T> = std::result::Result<T, Error>;
