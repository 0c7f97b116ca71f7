//! The `standalone` role: one [`LocalPool`] served over gRPC until SIGTERM or SIGINT.
//!
//! Shutdown: on the first SIGTERM/SIGINT the server stops accepting connections and lets
//! requests in flight finish (for at most [`SHUTDOWN_GRACE`]); then the pool is closed
//! (DRAM-only values are written to SSD and the log is sealed) and the close report is
//! printed to stdout.

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use mori_auth::Secret;
use mori_umbp::{CloseReport, LocalPool, RecoveryReport};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tonic::transport::Server;
use tracing::{info, warn};

use crate::config::Config;
use crate::listener::{Limits, ListenerStats, MAX_STREAMS_PER_CONNECTION};
use crate::proto::umbp_server::UmbpServer;
use crate::service::{DataPlane, SharedPool, UmbpService};

/// Largest gRPC message the daemon and the client send or accept: values up to 64 MiB
/// with room for batches of them.
pub const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// HTTP/2 flow control and framing of the daemon's and clients' connections: values of a
/// mebibyte and more move in frames of up to a mebibyte (the protocol's default is 16 KiB) under
/// windows that hold a whole batch message in flight (the defaults stop a stream every one or
/// two mebibytes for a window update).
pub const H2_MAX_FRAME_BYTES: u32 = 1 << 20;
/// See [`H2_MAX_FRAME_BYTES`].
pub const H2_STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// See [`H2_MAX_FRAME_BYTES`].
pub const H2_CONNECTION_WINDOW_BYTES: u32 = 64 << 20;

/// How long in-flight requests may run after a shutdown signal before the pool is closed
/// regardless.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Interval of the daemon's HTTP/2 keep-alive pings on idle connections; a peer that does not
/// answer within [`KEEPALIVE_TIMEOUT`] is dropped (and its connection slot freed).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors that stop the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Opening or closing the pool failed.
    #[error("pool: {0}")]
    Pool(#[from] mori_umbp::Error),
    /// An I/O operation of the daemon itself failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// A background task panicked or was cancelled.
    #[error("task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The deployment secret could not be loaded.
    #[error("authentication: {0}")]
    Secret(#[from] mori_auth::Error),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let context = context.into();
    move |source| DaemonError::Io { context, source }
}

/// Prints a line to stdout and flushes it (the daemon's report channel; logs go to stderr).
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout must not stop the daemon.
    let _ = writeln!(out, "umbpd: {line}");
    let _ = out.flush();
}

fn recovery_line(r: &RecoveryReport) -> String {
    format!(
        "recovered SSD log: segments={} records={} live_keys={} torn_tail_bytes_truncated={} \
         corrupt_records_dropped={} (bad_headers={} crc_mismatches={} resyncs={} \
         damaged_bytes_skipped={}) clean_shutdown={}",
        r.segments,
        r.records,
        r.live_keys,
        r.torn_tail_bytes_truncated,
        r.corrupt_records_dropped,
        r.bad_headers,
        r.crc_mismatches,
        r.resyncs,
        r.damaged_bytes_skipped,
        r.clean_shutdown
    )
}

/// The line printed after a clean close.
pub fn close_line(r: &CloseReport) -> String {
    format!(
        "closed: values_written={} values_already_on_ssd={} values_lost={}",
        r.values_written, r.values_already_on_ssd, r.values_lost
    )
}

/// Writes `addr` to `path` atomically (a temporary file renamed into place).
fn write_port_file(path: &Path, addr: SocketAddr) -> Result<(), DaemonError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, format!("{addr}\n"))
        .map_err(io_err(format!("writing {}", Path::new(&tmp).display())))?;
    std::fs::rename(&tmp, path).map_err(io_err(format!("renaming to {}", path.display())))
}

/// SIGTERM and SIGINT, installed before anything is published.
pub(crate) struct Signals {
    sigterm: tokio::signal::unix::Signal,
    sigint: tokio::signal::unix::Signal,
}

impl Signals {
    /// Installs the handlers.
    pub(crate) fn install() -> Result<Signals, DaemonError> {
        Ok(Signals {
            sigterm: signal(SignalKind::terminate()).map_err(io_err("installing SIGTERM"))?,
            sigint: signal(SignalKind::interrupt()).map_err(io_err("installing SIGINT"))?,
        })
    }
}

/// How the daemon authenticates connections: its secret, the listener's limits and counters
/// (see [`crate::auth`], [`crate::listener`]).
#[derive(Clone, Debug)]
pub struct Security {
    /// The deployment secret (every connection, in and out, proves it).
    pub secret: Arc<Secret>,
    /// The listener's limits.
    pub limits: Limits,
    /// The listener's counters.
    pub stats: Arc<ListenerStats>,
    /// A same-host connection without a request for this long is closed.
    pub same_host_idle_timeout: Duration,
}

impl Security {
    /// Loads the secret of `cfg` (`secret_file`, else the deployment secret) and says its
    /// fingerprint (never the secret).
    pub fn load(cfg: &Config) -> Result<Security, DaemonError> {
        let (secret, from) = crate::auth::load_secret(cfg.secret_file.value.as_deref())?;
        let fingerprint = secret.fingerprint();
        say(&format!(
            "authentication: deployment secret fingerprint {fingerprint} (from {from})"
        ));
        info!(%fingerprint, from = %from, "deployment secret loaded");
        Ok(Security {
            secret: Arc::new(secret),
            limits: Limits {
                max_connections: usize::try_from(cfg.max_connections.value).unwrap_or(usize::MAX),
                handshake_timeout: cfg.handshake_timeout.value,
            },
            stats: Arc::new(ListenerStats::default()),
            same_host_idle_timeout: cfg.same_host_idle_timeout.value,
        })
    }
}

/// A gRPC server running in the background.
pub(crate) struct Serving {
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stop: tokio::sync::oneshot::Sender<()>,
    /// The bound address.
    pub(crate) addr: SocketAddr,
}

/// Binds `listen`. Every role binds before it opens anything else (the pool, the metadata
/// backend), so a busy or unusable address fails at once and leaves nothing behind.
pub(crate) async fn bind(listen: SocketAddr) -> Result<TcpListener, DaemonError> {
    TcpListener::bind(listen)
        .await
        .map_err(io_err(format!("binding {listen}")))
}

/// Serves `routes` on the bound `listener` in the background, to authenticated connections
/// only (message size limits applied by the caller on each service), and small ops
/// ([`crate::small_ops`]) by `small_ops` when the role serves them.
pub(crate) fn start_serving(
    listener: TcpListener,
    routes: tonic::service::Routes,
    security: &Security,
    small_ops: Option<crate::small_ops::Responder>,
) -> Result<Serving, DaemonError> {
    let addr = listener
        .local_addr()
        .map_err(io_err("reading the bound address"))?;
    let incoming = crate::listener::incoming(
        listener,
        Arc::clone(&security.secret),
        security.limits,
        Arc::clone(&security.stats),
        small_ops,
    );
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            .max_frame_size(H2_MAX_FRAME_BYTES)
            .initial_stream_window_size(H2_STREAM_WINDOW_BYTES)
            .initial_connection_window_size(H2_CONNECTION_WINDOW_BYTES)
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .add_routes(routes)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = stop_rx.await;
            }),
    );
    Ok(Serving { server, stop, addr })
}

/// Publishes the address (port file, stdout line).
pub(crate) fn announce(cfg: &Config, addr: SocketAddr) -> Result<(), DaemonError> {
    if let Some(path) = &cfg.port_file.value {
        write_port_file(path, addr)?;
    }
    say(&format!("listening on {addr}"));
    info!(%addr, role = cfg.role.value.as_str(), "serving");
    Ok(())
}

impl Signals {
    /// Waits for SIGTERM or SIGINT (and says which arrived).
    pub(crate) async fn recv(&mut self) {
        tokio::select! {
            _ = self.sigterm.recv() => say("received SIGTERM, shutting down"),
            _ = self.sigint.recv() => say("received SIGINT, shutting down"),
        }
    }
}

impl Serving {
    /// Serves until SIGTERM/SIGINT (then stops accepting and lets requests in flight finish
    /// for at most [`SHUTDOWN_GRACE`]) or until the server fails. `Ok(())` after a signal.
    pub(crate) async fn until_signal(mut self, signals: &mut Signals) -> Result<(), DaemonError> {
        let serve_result = tokio::select! {
            _ = signals.recv() => None,
            res = &mut self.server => Some(res),
        };
        if let Some(res) = serve_result {
            res??;
            return Ok(());
        }
        let _ = self.stop.send(());
        match tokio::time::timeout(SHUTDOWN_GRACE, &mut self.server).await {
            Ok(res) => {
                if let Err(e) = res? {
                    warn!(error = %e, "gRPC server ended with an error during shutdown");
                }
            }
            Err(_) => {
                warn!(
                    grace = ?SHUTDOWN_GRACE,
                    "requests still in flight after the grace period; closing anyway"
                );
                self.server.abort();
            }
        }
        Ok(())
    }
}

/// Removes the port file after a clean shutdown.
pub(crate) fn remove_port_file(cfg: &Config) {
    if let Some(path) = &cfg.port_file.value
        && let Err(e) = std::fs::remove_file(path)
    {
        warn!(path = %path.display(), error = %e, "could not remove the port file");
    }
}

/// Opens the pool of the standalone and peer roles (printing the SSD recovery report).
pub(crate) async fn open_pool(
    pool_cfg: mori_umbp::PoolConfig,
) -> Result<Arc<SharedPool>, DaemonError> {
    let io_mode = pool_cfg.ssd.as_ref().map(|s| s.io);
    let (pool, recovery) = tokio::task::spawn_blocking(move || LocalPool::open(pool_cfg)).await??;
    if let Some(r) = &recovery {
        say(&recovery_line(r));
    }
    if let (Some(mode), Some(backend)) = (io_mode, pool.stats().ssd_io) {
        say(&format!("SSD I/O backend: {backend} (ssd_io = {mode})"));
    }
    Ok(Arc::new(SharedPool::new(pool)))
}

/// The `Umbp` service with the daemon's message size limits.
pub(crate) fn umbp_server<T: crate::proto::umbp_server::Umbp>(svc: T) -> UmbpServer<T> {
    UmbpServer::new(svc)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Runs the standalone daemon until a shutdown signal; returns the pool's close report.
pub async fn run_standalone(cfg: &Config) -> Result<CloseReport, DaemonError> {
    // Signal handlers first, so a signal right after the address is published is handled.
    let mut signals = Signals::install()?;
    let listener = bind(cfg.listen.value).await?;
    let security = Security::load(cfg)?;
    let shared = open_pool(cfg.pool_config()).await?;
    let data = start_data_plane(&shared, cfg, &security.secret);
    let mut service = UmbpService::new(Arc::clone(&shared), cfg.role.value.as_str())
        .with_data_plane(data.clone())
        .with_listener_stats(Arc::clone(&security.stats));
    // Clients on this host read values through shared memory of their own (crate::shm): the
    // socket starts when the first client asks for it.
    service = service.with_same_host(&security);
    let serving = start_serving(
        listener,
        tonic::service::Routes::new(umbp_server(service.clone())),
        &security,
        Some(crate::small_ops::Responder::Pool(service)),
    )?;
    announce(cfg, serving.addr)?;
    let served = serving.until_signal(&mut signals).await;
    stop_data_plane(data).await;
    // Close the pool even when the server failed by itself.
    let close = close_pool(&shared).await;
    served?;
    let report = close?;
    remove_port_file(cfg);
    Ok(report)
}

/// Starts the data plane of a pool (an IO engine that leases arena bytes per request) on the
/// listen address's IP, proving the daemon's secret; without it the daemon still serves the
/// byte path.
pub(crate) fn start_data_plane(
    shared: &SharedPool,
    cfg: &Config,
    secret: &Secret,
) -> Option<Arc<DataPlane>> {
    match DataPlane::start(shared, cfg.listen.value.ip(), secret) {
        Ok(d) => Some(Arc::new(d)),
        Err(e) => {
            warn!(error = %e, "the IO engine did not start: serving the byte path only");
            None
        }
    }
}

/// Stops the data plane before the pool closes. Leases end with the requests that hold
/// them (which the pool's close waits for); this drops the engine, off the runtime.
pub(crate) async fn stop_data_plane(data: Option<Arc<DataPlane>>) {
    if let Some(d) = data {
        let _ = tokio::task::spawn_blocking(move || drop(d)).await;
    }
}

/// Closes the pool on the blocking pool (waits for pool calls in flight).
pub(crate) async fn close_pool(shared: &Arc<SharedPool>) -> Result<CloseReport, DaemonError> {
    let shared = Arc::clone(shared);
    match tokio::task::spawn_blocking(move || shared.close()).await? {
        Some(res) => Ok(res?),
        None => Ok(CloseReport::default()),
    }
}
