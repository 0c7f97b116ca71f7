//! The error type shared by every bootstrap operation.

use std::net::SocketAddr;
use std::time::Duration;

/// Everything that can go wrong while bootstrapping or running a bootstrap collective.
///
/// The `Display` text is meant for a human reading a log: it names the operation
/// (for example `allgather #7`), the ranks involved, how long was waited and the
/// root address where relevant.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The bytes are not a valid unique id, or this rank and the root do not share the id's
    /// secret (the handshake failed: a stale id, or an id of another job).
    #[error("invalid bootstrap unique id: {0}")]
    InvalidId(String),

    /// A caller-supplied argument is out of range (rank >= world_size, world_size == 0,
    /// broadcast root out of range, payload too large, bad environment variable, ...).
    #[error("invalid bootstrap argument: {0}")]
    InvalidArgument(String),

    /// Not every rank arrived at an operation before its deadline.
    ///
    /// `op` is the operation kind (`connect`, `allgather`, `broadcast`, `barrier`), `seq` its
    /// per-rank sequence number, `missing` the ranks that had not arrived (empty when unknown,
    /// e.g. when the root itself stopped answering).
    #[error("{}", timeout_message(op, *seq, *waited, missing))]
    Timeout {
        /// Operation kind.
        op: String,
        /// Sequence number of the operation (0 for `connect`).
        seq: u64,
        /// How long was waited before giving up.
        waited: Duration,
        /// Ranks that had not arrived; empty if unknown.
        missing: Vec<usize>,
    },

    /// A rank disconnected (died, crashed, or left the session) while the session was alive.
    ///
    /// `op` names the operation during which the loss was noticed, with its sequence
    /// number, e.g. `allgather #7`.
    #[error("bootstrap {op} failed: rank {rank} was lost ({detail})")]
    PeerLost {
        /// Operation (with sequence number) during which the loss was noticed.
        op: String,
        /// The rank that was lost.
        rank: usize,
        /// What was observed (EOF, connection reset, left early, ...).
        detail: String,
    },

    /// The rendezvous root could not be reached, or went away.
    #[error("bootstrap root at {addr} is unreachable: {detail}")]
    RootUnreachable {
        /// Address of the root taken from the unique id.
        addr: SocketAddr,
        /// What went wrong.
        detail: String,
    },

    /// Ranks disagree: different op kinds at the same sequence number, different
    /// world sizes, a duplicate rank, or different broadcast roots.
    #[error("bootstrap ranks disagree: {0}")]
    Mismatch(String),

    /// An I/O error outside the cases above.
    #[error("bootstrap I/O error while {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Human label of an operation: `connect` has no sequence number worth showing.
pub(crate) fn op_label(op: &str, seq: u64) -> String {
    if op == "connect" {
        op.to_string()
    } else {
        format!("{op} #{seq}")
    }
}

fn timeout_message(op: &str, seq: u64, waited: Duration, missing: &[usize]) -> String {
    let label = op_label(op, seq);
    if missing.is_empty() {
        format!(
            "bootstrap {label} timed out after {waited:.1?}: the root did not answer \
             (it may be frozen, overloaded or gone)"
        )
    } else {
        format!(
            "bootstrap {label} timed out after {waited:.1?}: rank(s) {missing:?} never arrived \
             (dead, hung, or calling a different sequence of bootstrap ops?)"
        )
    }
}

impl Error {
    /// A copy of this error, used to report a connection that broke earlier to every later
    /// call. `std::io::Error` is not `Clone`, so `Io` keeps its kind and message.
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::InvalidId(s) => Error::InvalidId(s.clone()),
            Error::InvalidArgument(s) => Error::InvalidArgument(s.clone()),
            Error::Timeout {
                op,
                seq,
                waited,
                missing,
            } => Error::Timeout {
                op: op.clone(),
                seq: *seq,
                waited: *waited,
                missing: missing.clone(),
            },
            Error::PeerLost { op, rank, detail } => Error::PeerLost {
                op: op.clone(),
                rank: *rank,
                detail: detail.clone(),
            },
            Error::RootUnreachable { addr, detail } => Error::RootUnreachable {
                addr: *addr,
                detail: detail.clone(),
            },
            Error::Mismatch(s) => Error::Mismatch(s.clone()),
            Error::Io { context, source } => Error::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
        }
    }

    /// Shorthand for an [`Error::Io`].
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
