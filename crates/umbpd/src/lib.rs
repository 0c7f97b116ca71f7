//! `umbpd`, the UMBP daemon, and its Rust client.
//!
//! * [`config`] — settings from a TOML file, `UMBP_*` environment variables and flags.
//! * [`service`] — the gRPC service `umbp.v1.Umbp` (see `proto/umbp.proto`) over a
//!   [`mori_umbp::LocalPool`].
//! * [`server`] — the `standalone` role: serve until SIGTERM/SIGINT, then close the pool.
//! * [`client`] — a blocking client with the same calls.
//! * [`proto`] — the generated prost messages and tonic client/server.
//!
//! The roles `master` and `peer` are accepted by the configuration but not built yet.

#![warn(missing_docs)]

pub mod client;
pub mod config;
pub mod server;
pub mod service;

/// Messages and the tonic client and server generated from `proto/umbp.proto`.
#[allow(missing_docs)]
pub mod proto {
    tonic::include_proto!("umbp.v1");
}

pub use client::{Client, ClientError, ClientOptions};
pub use config::{Cli, Config, ConfigError, Role};
