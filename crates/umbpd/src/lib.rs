//! `umbpd`, the UMBP daemon, and its Rust client.
//!
//! * [`auth`] — every connection proves the deployment secret (mori-auth) before gRPC; the
//!   client-side connector. [`listener`] — the authenticated, bounded accept loop.
//! * [`cli`] — the `umbpd` command ([`run_cli`]), run by the binary and by the Python wheel.
//! * [`config`] — settings from a TOML file, `UMBP_*` environment variables and flags.
//! * [`claims`] — one put of a key at a time on a cluster peer, from store to publication.
//! * [`service`] — the gRPC service `umbp.v1.Umbp` (see `proto/umbp.proto`) over a
//!   [`mori_umbp::LocalPool`].
//! * [`server`] — the `standalone` role: serve until SIGTERM/SIGINT, then close the pool.
//! * [`master`] — the master's logic (index, liveness, routing, leases, eviction) with an
//!   injectable clock; [`master_server`] — the `master` role serving it over gRPC.
//! * [`peer`] — the `peer` role: a pool that registers, heartbeats and publishes its keys.
//! * [`client`] — a blocking client with the same calls; against a master it routes puts
//!   and gets to the peers.
//! * [`pages`] — huge-page hints for the memory a large value is read into for the caller.
//! * [`proto`] — the generated prost messages and tonic client/server.

#![warn(missing_docs)]

pub mod auth;
pub mod claims;
pub mod cli;
pub mod client;
pub mod config;
pub mod listener;
pub mod master;
pub mod master_server;
pub mod pages;
pub mod peer;
pub mod server;
pub mod service;
pub mod shm;
pub mod small_ops;

/// Messages and the tonic client and server generated from `proto/umbp.proto`.
#[allow(missing_docs)]
pub mod proto {
    tonic::include_proto!("umbp.v1");
}

pub use cli::run_cli;
pub use client::{Client, ClientError, ClientOptions};
pub use config::{Cli, Config, ConfigError, Role};
