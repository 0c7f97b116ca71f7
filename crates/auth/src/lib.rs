//! mori-auth: every connection mori opens proves, in both directions, that its peer holds the
//! deployment secret, before either side parses a request.
//!
//! The proof is an HMAC-SHA256 challenge-response over fresh nonces from both sides, bound to
//! the protocol that runs on the connection (the *purpose*, e.g. `"mori.io"`), so a proof made
//! for one protocol is worthless for another and the secret itself never crosses the wire:
//!
//! ```text
//! client → server   "MAUC" | version 1 | purpose_len u8 | purpose | client nonce (32)
//! server → client   "MAUS" | server nonce (32) | HMAC(secret, "server" | purpose | nonces)
//! client → server   HMAC(secret, "client" | purpose | nonces)
//! server → client   "MAOK"
//! ```
//!
//! A server that gets a wrong proof (or a wrong purpose, or garbage) closes the connection
//! without a word; a client that gets a wrong proof refuses the server. Timeouts are the
//! caller's (set them on the socket before the handshake).
//!
//! Where the secret comes from: [`Secret::deployment`] — `MORI_SECRET_FILE`, else
//! `MORI_SECRET`, else a per-user file (`$XDG_CONFIG_HOME/mori/secret`, created on first use,
//! mode 0600), so processes of one user on one host authenticate each other out of the box and
//! other users are shut out; hosts of one deployment share the file.

mod error;
mod handshake;
mod secret;

pub use error::{Error, Result};
pub use handshake::{Session, accept, connect};
#[cfg(feature = "tokio")]
pub use handshake::{accept_async, connect_async};
pub use secret::{ENV_SECRET, ENV_SECRET_FILE, MIN_SECRET_BYTES, Secret};
