//! Errors of mori-collective; each names the entry point (and field) it is about.

/// What went wrong with a kernel's parameters or its launch.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no parameter struct in mori-collective declares the kernel {0:?}")]
    UnknownEntry(String),
    #[error("{entry} takes {expected} fields ({fields}), got {got}")]
    Arity {
        entry: &'static str,
        expected: usize,
        got: usize,
        fields: String,
    },
    #[error("{entry} has no field {field:?}; its fields: {fields}")]
    UnknownField {
        entry: &'static str,
        field: String,
        fields: String,
    },
    #[error("{entry}: field {field:?} {problem}")]
    Field {
        entry: &'static str,
        field: String,
        problem: String,
    },
    #[error("{entry}: missing fields: {fields}")]
    Missing { entry: &'static str, fields: String },
    #[error("{entry} was given the parameters of {given}")]
    WrongParams {
        entry: &'static str,
        given: &'static str,
    },
    #[error("{0}")]
    InvalidArgument(String),
    /// An operation that ran and failed (not a bad argument).
    #[error("{0}")]
    Failed(String),
    #[error(transparent)]
    Gpu(#[from] mori_gpu::Error),
    #[error("mori.shmem: {0}")]
    Shmem(#[from] mori_shmem::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
