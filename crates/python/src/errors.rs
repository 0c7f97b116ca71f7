//! The one place where Rust errors become Python exceptions. The exception classes are defined
//! in Python (`mori/errors.py`) so users can import and subclass them without the extension.

use pyo3::PyErr;

pyo3::import_exception!(mori.errors, MoriError);
pyo3::import_exception!(mori.errors, LibraryNotFoundError);
pyo3::import_exception!(mori.errors, CudaError);
pyo3::import_exception!(mori.errors, CompileError);
pyo3::import_exception!(mori.errors, InvalidArgumentError);
pyo3::import_exception!(mori.errors, ClosedError);
pyo3::import_exception!(mori.errors, BootstrapError);
pyo3::import_exception!(mori.errors, PeerLostError);
pyo3::import_exception!(mori.errors, MismatchError);
pyo3::import_exception!(mori.errors, TimeoutError);
pyo3::import_exception!(mori.errors, OutOfMemoryError);
pyo3::import_exception!(mori.errors, TransportError);
pyo3::import_exception!(mori.errors, AuthenticationError);
pyo3::import_exception!(mori.errors, StaleDescriptorError);
pyo3::import_exception!(mori.errors, StillInUseError);

/// Every error a binding can return.
#[derive(Debug)]
pub enum Error {
    Gpu(mori_gpu::Error),
    Bootstrap(mori_bootstrap::Error),
    Shmem(mori_shmem::Error),
    Io(mori_io::Error),
    Umbp(mori_umbp::Error),
    UmbpRemote(mori_umbpd::ClientError),
    /// Kernel parameters (a wrong field, an unknown entry point).
    Collective(mori_collective::Error),
    /// The fabric layer (libfabric missing, a provider call that failed).
    Net(mori_net::Error),
    /// A transfer that failed (what every waiter of it sees).
    TransferFailed(mori_io::Failure),
    InvalidArgument(String),
    /// A call on a closed object (what is closed).
    Closed(String),
}

impl From<mori_umbpd::ClientError> for Error {
    fn from(e: mori_umbpd::ClientError) -> Self {
        match e {
            // The client's own IO engine (registering memory, starting the engine).
            mori_umbpd::ClientError::Io(e) => Error::Io(e),
            e => Error::UmbpRemote(e),
        }
    }
}

impl From<mori_collective::Error> for Error {
    fn from(e: mori_collective::Error) -> Self {
        match e {
            mori_collective::Error::Gpu(g) => Error::Gpu(g),
            mori_collective::Error::Shmem(s) => Error::from(s),
            other => Error::Collective(other),
        }
    }
}

impl From<mori_umbp::Error> for Error {
    fn from(e: mori_umbp::Error) -> Self {
        Error::Umbp(e)
    }
}

impl From<mori_io::Error> for Error {
    fn from(e: mori_io::Error) -> Self {
        match e {
            mori_io::Error::Gpu(g) => Error::Gpu(g),
            other => Error::Io(other),
        }
    }
}

impl From<mori_shmem::Error> for Error {
    fn from(e: mori_shmem::Error) -> Self {
        match e {
            mori_shmem::Error::Gpu(g) => Error::Gpu(g),
            mori_shmem::Error::Bootstrap(b) => Error::Bootstrap(b),
            mori_shmem::Error::Io(e) => Error::Io(e),
            other => Error::Shmem(other),
        }
    }
}

impl From<mori_net::Error> for Error {
    fn from(e: mori_net::Error) -> Self {
        Error::Net(e)
    }
}

impl From<mori_gpu::Error> for Error {
    fn from(e: mori_gpu::Error) -> Self {
        Error::Gpu(e)
    }
}

impl From<mori_bootstrap::Error> for Error {
    fn from(e: mori_bootstrap::Error) -> Self {
        Error::Bootstrap(e)
    }
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        use mori_bootstrap::Error as B;
        match e {
            Error::Gpu(e) => gpu_error(e.to_string(), e),
            Error::Bootstrap(e) => {
                let msg = e.to_string();
                match e {
                    B::Timeout { .. } => TimeoutError::new_err(msg),
                    B::PeerLost { .. } | B::RootUnreachable { .. } => PeerLostError::new_err(msg),
                    B::Mismatch(_) => MismatchError::new_err(msg),
                    B::InvalidArgument(_) | B::InvalidId(_) => InvalidArgumentError::new_err(msg),
                    _ => BootstrapError::new_err(msg),
                }
            }
            Error::Shmem(e) => {
                let msg = e.to_string();
                match e {
                    mori_shmem::Error::OutOfMemory { .. } => OutOfMemoryError::new_err(msg),
                    mori_shmem::Error::Mismatch(_) => MismatchError::new_err(msg),
                    mori_shmem::Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
                    mori_shmem::Error::Proxy(_) => TransportError::new_err(msg),
                    _ => MoriError::new_err(msg),
                }
            }
            Error::Io(e) => {
                let msg = e.to_string();
                match e {
                    mori_io::Error::UnknownRegion(_)
                    | mori_io::Error::OutOfRange(_)
                    | mori_io::Error::ReadOnly(_)
                    | mori_io::Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
                    mori_io::Error::Timeout { .. } => TimeoutError::new_err(msg),
                    mori_io::Error::Auth(_) => AuthenticationError::new_err(msg),
                    mori_io::Error::Stale(_) => StaleDescriptorError::new_err(msg),
                    mori_io::Error::StillInUse(_) => StillInUseError::new_err(msg),
                    _ => TransportError::new_err(msg),
                }
            }
            Error::Net(e) => {
                let msg = e.to_string();
                match e {
                    mori_net::Error::Unavailable(_) => LibraryNotFoundError::new_err(msg),
                    mori_net::Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
                    mori_net::Error::Fabric { .. } => TransportError::new_err(msg),
                    mori_net::Error::Timeout(_) => TimeoutError::new_err(msg),
                }
            }
            Error::Umbp(e) => {
                let msg = e.to_string();
                match e {
                    mori_umbp::Error::NoSpace { .. } => OutOfMemoryError::new_err(msg),
                    mori_umbp::Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
                    // The GPU tier's device: the mori-gpu class, with the pool's context.
                    mori_umbp::Error::Gpu { source, .. } => gpu_error(msg, *source),
                    _ => MoriError::new_err(msg),
                }
            }
            Error::UmbpRemote(e) => {
                let msg = e.to_string();
                // gRPC status codes, by name (the daemon maps NoSpace and bad input to these).
                match e.code().map(|c| format!("{c:?}")).as_deref() {
                    Some("ResourceExhausted") => OutOfMemoryError::new_err(msg),
                    Some("InvalidArgument") => InvalidArgumentError::new_err(msg),
                    Some("DeadlineExceeded") => TimeoutError::new_err(msg),
                    Some("Unavailable" | "Cancelled" | "Unknown") | None => {
                        TransportError::new_err(msg)
                    }
                    _ => MoriError::new_err(msg),
                }
            }
            Error::TransferFailed(f) => match f.kind {
                mori_io::FailureKind::UnknownRegion
                | mori_io::FailureKind::OutOfRange
                | mori_io::FailureKind::ReadOnly => InvalidArgumentError::new_err(f.message),
                mori_io::FailureKind::Stale => StaleDescriptorError::new_err(f.message),
                mori_io::FailureKind::Timeout => TimeoutError::new_err(f.message),
                _ => TransportError::new_err(f.message),
            },
            Error::Collective(e @ mori_collective::Error::Failed(_)) => {
                MoriError::new_err(e.to_string())
            }
            // Every other mori-collective error is about the parameters given.
            Error::Collective(e) => InvalidArgumentError::new_err(e.to_string()),
            Error::InvalidArgument(msg) => InvalidArgumentError::new_err(msg),
            Error::Closed(what) => ClosedError::new_err(format!("{what} is closed")),
        }
    }
}

/// The exception of a mori-gpu error, with message `msg` (the error's own, or with context).
fn gpu_error(msg: String, e: mori_gpu::Error) -> PyErr {
    use mori_gpu::Error as G;
    match e {
        G::LibraryNotFound { .. } => LibraryNotFoundError::new_err(msg),
        G::Driver {
            call, code, name, ..
        } => CudaError::new_err((msg, call, code, name)),
        G::Nvrtc { call, code, .. } => CudaError::new_err((msg, call, code, "NVRTC")),
        G::Compile { kernel, log, .. } => CompileError::new_err((msg, kernel, log)),
        G::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        _ => MoriError::new_err(msg),
    }
}
