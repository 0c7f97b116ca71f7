use thiserror::Error;

/// Errors of mori-net.
#[derive(Debug, Error)]
pub enum Error {
    /// The fabric is not available here (libfabric missing or too old, no provider).
    #[error("fabric unavailable: {0}")]
    Unavailable(String),
    /// A libfabric call failed.
    #[error("{call}: {message} (error {code})")]
    Fabric {
        call: String,
        code: i32,
        message: String,
    },
    /// An operation did not complete within the endpoint's timeout (a peer or link that went
    /// away without the provider noticing).
    #[error("timed out: {0}")]
    Timeout(String),
    /// A request names memory outside a registered region, or an unknown peer.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, Error>;
