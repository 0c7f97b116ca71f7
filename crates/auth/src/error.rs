/// Why a handshake or a secret failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer did not prove the deployment secret (or spoke another protocol).
    #[error("{0}")]
    Rejected(String),
    /// The secret could not be loaded or is unfit (too short, readable by others, ...).
    #[error("{0}")]
    Secret(String),
    /// The connection failed during the handshake.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
