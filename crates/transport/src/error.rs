//! Errors of the data plane.

/// Status codes carried on the wire (and by errors raised from them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    Ok = 0,
    UnknownRegion = 1,
    OutOfRange = 2,
    Busy = 3,
    Internal = 4,
    /// The target cannot reach the initiator's memory directly (same-host path); use TCP.
    DirectUnavailable = 5,
    /// The target region was registered read-only; nothing was written.
    ReadOnly = 6,
}

impl Code {
    pub fn from_u8(v: u8) -> Code {
        match v {
            0 => Code::Ok,
            1 => Code::UnknownRegion,
            2 => Code::OutOfRange,
            3 => Code::Busy,
            5 => Code::DirectUnavailable,
            6 => Code::ReadOnly,
            _ => Code::Internal,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The memory id is not registered (or was deregistered).
    #[error("{0}")]
    UnknownRegion(String),
    /// An offset/size lies outside its region; nothing was touched.
    #[error("{0}")]
    OutOfRange(String),
    /// The remote side refused or failed a request.
    #[error("remote engine {peer} failed the transfer: {message}")]
    Remote {
        peer: String,
        code: Code,
        message: String,
    },
    /// The connection to a peer broke; pending transfers on it fail with this.
    #[error("connection to {peer} lost: {detail}")]
    ConnectionLost { peer: String, detail: String },
    /// A transfer did not complete within its deadline.
    #[error("transfer to {peer} did not complete within {secs:.1}s")]
    Timeout { peer: String, secs: f64 },
    #[error("{0}")]
    InvalidArgument(String),
    /// A write to memory registered read-only (or a read into it); nothing was touched.
    #[error("{0}")]
    ReadOnly(String),
    /// A descriptor of an earlier instance of an engine (it restarted) or of a previous
    /// registration.
    #[error("{0}")]
    Stale(String),
    /// The peer did not prove the deployment secret, or is not who it should be.
    #[error("{0}")]
    Auth(String),
    /// Deregistration could not fence every access in flight: the memory must stay allocated.
    #[error("{0}")]
    StillInUse(String),
    #[error(transparent)]
    Gpu(#[from] mori_gpu::Error),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<mori_auth::Error> for Error {
    fn from(e: mori_auth::Error) -> Self {
        match e {
            mori_auth::Error::Io { context, source } => Error::Io { context, source },
            other => Error::Auth(other.to_string()),
        }
    }
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
