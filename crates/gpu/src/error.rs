//! The one error type of mori-gpu. Every driver/NVRTC failure names the call that failed.

use std::path::PathBuf;

/// Errors from the GPU runtime, the JIT and handle sharing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shared library (the driver's libcuda, NVRTC) could not be loaded.
    #[error("{library} could not be loaded (searched: {}). {hint}", searched.join(", "))]
    LibraryNotFound {
        library: &'static str,
        searched: Vec<String>,
        hint: &'static str,
    },

    /// A CUDA driver API call returned an error.
    #[error("{call} failed: {name} ({code}): {message}")]
    Driver {
        call: &'static str,
        code: i32,
        name: String,
        message: String,
    },

    /// An NVRTC call (other than compilation itself) failed.
    #[error("{call} failed: {message} ({code})")]
    Nvrtc {
        call: &'static str,
        code: i32,
        message: String,
    },

    /// NVRTC rejected a kernel; `log` is the compiler's output.
    #[error("compiling kernel {kernel} for {arch} failed:\n{log}")]
    Compile {
        kernel: String,
        arch: String,
        log: String,
    },

    /// The caller passed something the call cannot accept.
    #[error("{0}")]
    InvalidArgument(String),

    /// A file or socket operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// The JIT cache holds an entry it cannot use.
    #[error("JIT cache entry {path} is unusable: {detail}")]
    CacheCorrupt { path: PathBuf, detail: String },
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
