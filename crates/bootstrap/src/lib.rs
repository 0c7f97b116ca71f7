//! Bootstrap for mori ranks: rendezvous of `world_size` processes (possibly on several hosts)
//! and small collective byte exchanges (allgather, broadcast, barrier) over TCP.
//!
//! One process calls [`create_unique_id`], which starts a root (rendezvous server) on
//! background threads and returns a 128-byte [`UniqueId`]. The id travels to every rank out
//! of band; each rank then calls [`Bootstrap::connect`]. Every operation has a timeout:
//! a rank that dies or never arrives produces an error on the others within the timeout
//! ([`Error::Timeout`] naming the missing ranks, or [`Error::PeerLost`] naming the lost one),
//! never a hang.
//!
//! # Security
//!
//! The id carries a random 16-byte secret. Every connection to the root opens with the
//! mori-auth handshake (HMAC-SHA256 challenge-response, purpose `"mori.bootstrap"`) keyed by
//! it: both sides prove they hold the secret, which itself never crosses the wire. The root
//! parses nothing from a peer that fails (it drops the connection, counting and logging it at
//! debug level), gives each new connection 10 s for the handshake and hello, and runs each
//! handshake on its own thread, so silent or hostile connectors cannot hold up real ranks.
//! Anyone holding the id can join, so ship it like a password.
//!
//! # Environment
//!
//! | variable              | meaning                                                        |
//! |-----------------------|----------------------------------------------------------------|
//! | `MORI_BOOTSTRAP_ADDR` | IP or `IP:port` the root listens on (wins over everything)     |
//! | `MORI_SOCKET_IFNAME`  | interface whose first IPv4 address the root listens on         |
//!
//! Default: the first up, non-loopback, non-`docker*` interface with an IPv4 address, else
//! 127.0.0.1; the port is chosen by the OS. No traffic goes anywhere but the chosen address.

#![warn(missing_docs)]

mod addr;
mod auth;
mod client;
mod error;
mod id;
mod root;
mod wire;

use std::net::{IpAddr, SocketAddr};

pub use addr::{ENV_BOOTSTRAP_ADDR, ENV_SOCKET_IFNAME};
pub use client::Bootstrap;
pub use error::{Error, Result};
pub use id::{UNIQUE_ID_BYTES, UniqueId};

/// Starts the root on background threads of this process and returns its id.
///
/// The listen address comes from the environment (see the crate docs). The root serves one
/// session: it stops once the rendezvous has completed or failed and every joined rank has
/// disconnected; if no rank ever connects, it lives until the process exits.
pub fn create_unique_id() -> Result<UniqueId> {
    root::spawn(addr::listen_addr_from_env()?)
}

/// Like [`create_unique_id`], but listens on `addr` (port chosen by the OS) and ignores the
/// environment. `addr` must be a concrete address of this host, not `0.0.0.0` or `::`.
pub fn create_unique_id_on(addr: IpAddr) -> Result<UniqueId> {
    addr::check_listen_ip(addr, "create_unique_id_on")?;
    root::spawn(SocketAddr::new(addr, 0))
}
