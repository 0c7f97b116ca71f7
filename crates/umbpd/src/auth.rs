//! Authentication of umbpd's connections: every TCP connection to a daemon's gRPC port proves
//! the deployment secret (mori-auth's HMAC challenge-response, purpose [`PURPOSE`]) before a
//! byte of HTTP/2 is read, in both directions — a client (or a peer, or a master) that lacks
//! the secret cannot call any RPC, and a client never talks to a daemon that lacks it.
//!
//! * Server side: [`crate::listener`] runs the handshake on each accepted connection and hands
//!   only authenticated ones to tonic.
//! * Client side: [`AuthConnector`] is the tower service tonic's channels connect through
//!   (`Endpoint::connect_with_connector`): it opens the TCP connection, runs the handshake and
//!   returns the stream wrapped for hyper. [`channel`] and [`lazy_channel`] build channels
//!   with it; the Rust client, the peer's link to its master and the master's links to its
//!   peers all use them.
//!
//! Where the secret comes from: the daemon's `secret_file` setting, else
//! [`Secret::deployment`] (`MORI_SECRET_FILE`, `MORI_SECRET`, else the per-user default file);
//! clients take one in [`crate::ClientOptions::secret`], else the deployment secret. Only the
//! secret's fingerprint is ever printed.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use mori_auth::Secret;
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The handshake purpose of umbpd's gRPC connections (a proof made for another mori protocol
/// is worthless here).
pub const PURPOSE: &str = "umbpd";

/// Errors tonic's connector may return (boxed, as tonic takes them).
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The daemon (or its peer) did not prove the secret, or refused ours.
#[derive(Debug, thiserror::Error)]
#[error("authenticating to umbpd at {addr} failed: {source}")]
pub struct HandshakeError {
    /// The address connected to.
    pub addr: String,
    /// What mori-auth reported.
    #[source]
    pub source: mori_auth::Error,
}

/// The secret of a daemon: `secret_file` if set, else the deployment secret. Returns it with
/// a description of where it came from (for the start-up line; never the secret itself).
pub fn load_secret(secret_file: Option<&Path>) -> Result<(Secret, String), mori_auth::Error> {
    if let Some(path) = secret_file {
        let s = Secret::from_file(path)?;
        return Ok((s, format!("secret_file {}", path.display())));
    }
    let from =
        if let Some(p) = std::env::var_os(mori_auth::ENV_SECRET_FILE).filter(|p| !p.is_empty()) {
            format!("{}={}", mori_auth::ENV_SECRET_FILE, Path::new(&p).display())
        } else if std::env::var_os(mori_auth::ENV_SECRET).is_some_and(|s| !s.is_empty()) {
            mori_auth::ENV_SECRET.to_string()
        } else {
            match Secret::user_default_path() {
                Ok(p) => format!("the per-user default {}", p.display()),
                Err(_) => "the per-user default".to_string(),
            }
        };
    Ok((Secret::deployment()?, from))
}

/// Connects tonic channels through the mori-auth handshake (see the module docs).
#[derive(Clone)]
pub struct AuthConnector {
    secret: Arc<Secret>,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for AuthConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConnector")
            .field("secret", &self.secret)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish()
    }
}

impl AuthConnector {
    /// A connector proving `secret`; a daemon that does not answer the handshake within
    /// `handshake_timeout` fails the connection.
    pub fn new(secret: Arc<Secret>, handshake_timeout: Duration) -> AuthConnector {
        AuthConnector {
            secret,
            handshake_timeout,
        }
    }
}

/// `host:port` of a URI (IPv6 brackets removed; port 80 when none is given, as for http).
fn host_port(uri: &Uri) -> Result<(String, u16), BoxError> {
    let host = uri
        .host()
        .ok_or_else(|| format!("no host in the address {uri}"))?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Ok((host, uri.port_u16().unwrap_or(80)))
}

/// Opens a TCP connection to `uri` and authenticates it.
async fn connect_authenticated(
    uri: Uri,
    secret: Arc<Secret>,
    handshake_timeout: Duration,
) -> Result<TokioIo<TcpStream>, BoxError> {
    let (host, port) = host_port(&uri)?;
    let addr = format!("{host}:{port}");
    let mut stream = TcpStream::connect((host.as_str(), port)).await?;
    stream.set_nodelay(true)?;
    let shake = mori_auth::connect_async(&mut stream, &secret, PURPOSE);
    match tokio::time::timeout(handshake_timeout, shake).await {
        Ok(Ok(_session)) => Ok(TokioIo::new(stream)),
        Ok(Err(source)) => Err(Box::new(HandshakeError { addr, source })),
        Err(_) => Err(Box::new(HandshakeError {
            addr,
            source: mori_auth::Error::Rejected(format!(
                "no answer to the handshake within {handshake_timeout:?}"
            )),
        })),
    }
}

impl tower_service::Service<Uri> for AuthConnector {
    type Response = TokioIo<TcpStream>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(connect_authenticated(
            uri,
            Arc::clone(&self.secret),
            self.handshake_timeout,
        ))
    }
}

/// A channel over `endpoint` that connects (now) through the handshake with `secret`.
pub async fn channel(
    endpoint: &Endpoint,
    secret: Arc<Secret>,
    handshake_timeout: Duration,
) -> Result<Channel, tonic::transport::Error> {
    endpoint
        .connect_with_connector(AuthConnector::new(secret, handshake_timeout))
        .await
}

/// [`channel`] connecting on first use (and again after a failure). Must be called inside a
/// tokio runtime.
pub fn lazy_channel(
    endpoint: &Endpoint,
    secret: Arc<Secret>,
    handshake_timeout: Duration,
) -> Channel {
    endpoint.connect_with_connector_lazy(AuthConnector::new(secret, handshake_timeout))
}

/// The [`HandshakeError`] somewhere in `e`'s chain of sources, if the failure was one.
pub fn handshake_failure<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a HandshakeError> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<HandshakeError>() {
            return Some(h);
        }
        cur = err.source();
    }
    None
}

/// `e` and its sources, joined by `: ` (tonic's transport errors say little by themselves).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        let s = err.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = err.source();
    }
    out
}
