//! The mori-auth handshake that opens every bootstrap connection, run under a deadline.
//!
//! Both ends prove they hold the id's secret (HMAC challenge-response over fresh nonces, purpose
//! [`HANDSHAKE_PURPOSE`]); the secret itself never crosses the wire. The root parses no frame
//! from a peer that has not passed, and a client talks to no root that has not proven itself.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use mori_auth::Secret;

use crate::error::Error;
use crate::wire::HANDSHAKE_PURPOSE;

/// A borrowed TCP stream whose reads and writes must all be done by `deadline`: a peer that
/// trickles one byte at a time cannot stretch a handshake past it. Counts the bytes received.
pub(crate) struct Timed<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
    received: usize,
}

impl<'a> Timed<'a> {
    pub(crate) fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        Timed {
            stream,
            deadline,
            received: 0,
        }
    }

    /// Time left before the deadline; an error once it has passed.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(deadline_passed());
        }
        Ok(left)
    }
}

fn deadline_passed() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the handshake deadline passed")
}

/// A socket timeout shows up as `WouldBlock` on Unix; call it what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        deadline_passed()
    } else {
        e
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut s = self.stream;
        let n = s.read(buf).map_err(timed_out)?;
        self.received += n;
        Ok(n)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut s = self.stream;
        s.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut s = self.stream;
        s.flush()
    }
}

/// The root's side: `Ok` once the peer has proven the secret. On error the caller drops the
/// connection without reading anything else from it.
pub(crate) fn accept(
    stream: &TcpStream,
    secret: &Secret,
    deadline: Instant,
) -> mori_auth::Result<()> {
    mori_auth::accept(&mut Timed::new(stream, deadline), secret, HANDSHAKE_PURPOSE).map(drop)
}

/// Why a rank's handshake with the root failed.
#[derive(Debug)]
pub(crate) enum ClientFailure {
    /// The root closed the connection before it said anything: it is over its limit of
    /// connections in authentication (or going away). Worth another connection.
    Dropped(String),
    /// The root answered but the two sides do not share the secret, or the connection failed:
    /// final.
    Failed(Error),
}

/// A rank's side: `Ok` once the root at `addr` has proven the secret and accepted ours.
pub(crate) fn connect(
    stream: &TcpStream,
    secret: &Secret,
    addr: SocketAddr,
    deadline: Instant,
) -> Result<(), ClientFailure> {
    let started = Instant::now();
    let mut timed = Timed::new(stream, deadline);
    let res = mori_auth::connect(&mut timed, secret, HANDSHAKE_PURPOSE);
    let silent = timed.received == 0;
    let Err(e) = res else { return Ok(()) };
    let closed = |k: io::ErrorKind| {
        matches!(
            k,
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
        )
    };
    Err(match e {
        mori_auth::Error::Rejected(why) if silent => ClientFailure::Dropped(why),
        mori_auth::Error::Io { source, .. } if silent && closed(source.kind()) => {
            ClientFailure::Dropped(source.to_string())
        }
        mori_auth::Error::Rejected(why) => ClientFailure::Failed(Error::InvalidId(format!(
            "the root at {addr} and this rank do not share the id's secret (a stale id from an \
             earlier run, or an id of another job): {why}"
        ))),
        mori_auth::Error::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut => {
            ClientFailure::Failed(Error::RootUnreachable {
                addr,
                detail: format!(
                    "no answer while authenticating within {:.1?} (is the root's process \
                     frozen?)",
                    started.elapsed()
                ),
            })
        }
        mori_auth::Error::Io { context, source } => ClientFailure::Failed(Error::RootUnreachable {
            addr,
            detail: format!("{context}: {source}"),
        }),
        mori_auth::Error::Secret(why) => ClientFailure::Failed(Error::io(
            "authenticating to the bootstrap root",
            io::Error::other(why),
        )),
    })
}
