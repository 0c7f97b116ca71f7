//! The challenge-response handshake (see the crate docs for the frames). The messages are
//! built and checked by pure functions; `accept`/`connect` and their async twins only move them.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};
use crate::secret::Secret;

const CLIENT_HELLO: &[u8; 4] = b"MAUC";
const SERVER_HELLO: &[u8; 4] = b"MAUS";
const ACCEPTED: &[u8; 4] = b"MAOK";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const MAC: usize = 32;
const MAX_PURPOSE: usize = 64;

type HmacSha256 = Hmac<Sha256>;

/// What both ends know once the handshake succeeded.
#[derive(Clone, PartialEq, Eq)]
pub struct Session {
    /// A key only the two ends know: HMAC(secret, "session" | purpose | nonces).
    pub key: [u8; 32],
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Session(..)")
    }
}

fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    getrandom::fill(&mut n)
        .map_err(|e| Error::Secret(format!("no random bytes from the OS: {e}")))?;
    Ok(n)
}

fn keyed(secret: &Secret, label: &[u8], purpose: &str, nc: &[u8], ns: &[u8]) -> HmacSha256 {
    // new_from_slice takes keys of any length for HMAC; it cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(secret.bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    m.update(b"mori-auth/1 ");
    m.update(label);
    m.update(&[0, purpose.len() as u8]);
    m.update(purpose.as_bytes());
    m.update(nc);
    m.update(ns);
    m
}

fn proof(secret: &Secret, label: &[u8], purpose: &str, nc: &[u8], ns: &[u8]) -> [u8; MAC] {
    keyed(secret, label, purpose, nc, ns)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a peer's proof.
fn verify(secret: &Secret, label: &[u8], purpose: &str, nc: &[u8], ns: &[u8], mac: &[u8]) -> bool {
    keyed(secret, label, purpose, nc, ns)
        .verify_slice(mac)
        .is_ok()
}

fn session(secret: &Secret, purpose: &str, nc: &[u8], ns: &[u8]) -> Session {
    Session {
        key: proof(secret, b"session", purpose, nc, ns),
    }
}

fn check_purpose(purpose: &str) -> Result<()> {
    if purpose.is_empty() || purpose.len() > MAX_PURPOSE {
        return Err(Error::Rejected(format!(
            "a handshake purpose must be 1..{MAX_PURPOSE} bytes"
        )));
    }
    Ok(())
}

fn client_hello(purpose: &str, nc: &[u8; NONCE]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + purpose.len() + NONCE);
    out.extend_from_slice(CLIENT_HELLO);
    out.push(VERSION);
    out.push(purpose.len() as u8);
    out.extend_from_slice(purpose.as_bytes());
    out.extend_from_slice(nc);
    out
}

fn server_hello(secret: &Secret, purpose: &str, nc: &[u8], ns: &[u8; NONCE]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + NONCE + MAC);
    out.extend_from_slice(SERVER_HELLO);
    out.extend_from_slice(ns);
    out.extend_from_slice(&proof(secret, b"server", purpose, nc, ns));
    out
}

/// Silently refused: the server learns nothing useful to tell an unauthenticated peer.
fn refused(why: &str) -> Error {
    Error::Rejected(format!("refused a connection: {why}"))
}

fn not_proven(purpose: &str) -> Error {
    Error::Rejected(format!(
        "the {purpose} peer did not prove the deployment secret (do both sides use the same \
         secret? see MORI_SECRET_FILE / MORI_SECRET)"
    ))
}

/// Checks the fixed part of a client hello; returns the purpose length it announces.
fn client_hello_head(head: &[u8; 6], purpose: &str) -> Result<usize> {
    if &head[..4] != CLIENT_HELLO || head[4] != VERSION {
        return Err(refused("not a mori handshake"));
    }
    let n = head[5] as usize;
    if n != purpose.len() {
        return Err(refused("another protocol"));
    }
    Ok(n)
}

/// The checks both I/O flavours run, written once: each takes the bytes read so far and
/// returns what to send next.
mod steps {
    use super::*;

    pub(super) fn server_reply(
        secret: &Secret,
        purpose: &str,
        got_purpose: &[u8],
        nc: &[u8],
    ) -> Result<([u8; NONCE], Vec<u8>)> {
        if got_purpose != purpose.as_bytes() {
            return Err(refused("another protocol"));
        }
        let ns = nonce()?;
        let reply = server_hello(secret, purpose, nc, &ns);
        Ok((ns, reply))
    }

    pub(super) fn server_finish(
        secret: &Secret,
        purpose: &str,
        nc: &[u8],
        ns: &[u8],
        mac: &[u8],
    ) -> Result<Session> {
        if !verify(secret, b"client", purpose, nc, ns, mac) {
            return Err(refused("wrong proof"));
        }
        Ok(session(secret, purpose, nc, ns))
    }

    /// Checks the server's hello; returns the client's proof to send.
    pub(super) fn client_answer(
        secret: &Secret,
        purpose: &str,
        nc: &[u8],
        reply: &[u8; 4 + NONCE + MAC],
    ) -> Result<Vec<u8>> {
        if &reply[..4] != SERVER_HELLO {
            return Err(not_proven(purpose));
        }
        let (ns, mac) = reply[4..].split_at(NONCE);
        if !verify(secret, b"server", purpose, nc, ns, mac) {
            return Err(not_proven(purpose));
        }
        Ok(proof(secret, b"client", purpose, nc, ns).to_vec())
    }
}

/// Server side over a blocking stream. On error the caller drops the connection.
pub fn accept<S: std::io::Read + std::io::Write>(
    s: &mut S,
    secret: &Secret,
    purpose: &str,
) -> Result<Session> {
    check_purpose(purpose)?;
    let io = |e| Error::io("authenticating a peer", e);
    let mut head = [0u8; 6];
    s.read_exact(&mut head).map_err(io)?;
    let n = client_hello_head(&head, purpose)?;
    let mut rest = vec![0u8; n + NONCE];
    s.read_exact(&mut rest).map_err(io)?;
    let (got_purpose, nc) = rest.split_at(n);
    let (ns, reply) = steps::server_reply(secret, purpose, got_purpose, nc)?;
    s.write_all(&reply).and_then(|()| s.flush()).map_err(io)?;
    let mut mac = [0u8; MAC];
    s.read_exact(&mut mac).map_err(io)?;
    let sess = steps::server_finish(secret, purpose, nc, &ns, &mac)?;
    s.write_all(ACCEPTED).and_then(|()| s.flush()).map_err(io)?;
    Ok(sess)
}

/// Client side over a blocking stream.
pub fn connect<S: std::io::Read + std::io::Write>(
    s: &mut S,
    secret: &Secret,
    purpose: &str,
) -> Result<Session> {
    check_purpose(purpose)?;
    let io = |e| Error::io(format!("authenticating to the {purpose} peer"), e);
    let nc = nonce()?;
    s.write_all(&client_hello(purpose, &nc))
        .and_then(|()| s.flush())
        .map_err(io)?;
    let mut reply = [0u8; 4 + NONCE + MAC];
    s.read_exact(&mut reply).map_err(|e| closed(e, purpose))?;
    let answer = steps::client_answer(secret, purpose, &nc, &reply)?;
    s.write_all(&answer).and_then(|()| s.flush()).map_err(io)?;
    let mut ok = [0u8; 4];
    s.read_exact(&mut ok).map_err(|e| closed(e, purpose))?;
    if &ok != ACCEPTED {
        return Err(not_proven(purpose));
    }
    Ok(session(secret, purpose, &nc, &reply[4..4 + NONCE]))
}

/// A server that closes during the handshake has refused us (wrong secret or protocol).
fn closed(e: std::io::Error, purpose: &str) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof
        || e.kind() == std::io::ErrorKind::ConnectionReset
    {
        Error::Rejected(format!(
            "the {purpose} peer closed the connection during authentication (different \
             secrets? see MORI_SECRET_FILE / MORI_SECRET)"
        ))
    } else {
        Error::io(format!("authenticating to the {purpose} peer"), e)
    }
}

/// [`accept`] over a tokio stream.
#[cfg(feature = "tokio")]
pub async fn accept_async<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    purpose: &str,
) -> Result<Session> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    check_purpose(purpose)?;
    let io = |e| Error::io("authenticating a peer", e);
    let mut head = [0u8; 6];
    s.read_exact(&mut head).await.map_err(io)?;
    let n = client_hello_head(&head, purpose)?;
    let mut rest = vec![0u8; n + NONCE];
    s.read_exact(&mut rest).await.map_err(io)?;
    let (got_purpose, nc) = rest.split_at(n);
    let (ns, reply) = steps::server_reply(secret, purpose, got_purpose, nc)?;
    s.write_all(&reply).await.map_err(io)?;
    s.flush().await.map_err(io)?;
    let mut mac = [0u8; MAC];
    s.read_exact(&mut mac).await.map_err(io)?;
    let sess = steps::server_finish(secret, purpose, nc, &ns, &mac)?;
    s.write_all(ACCEPTED).await.map_err(io)?;
    s.flush().await.map_err(io)?;
    Ok(sess)
}

/// [`connect`] over a tokio stream.
#[cfg(feature = "tokio")]
pub async fn connect_async<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    secret: &Secret,
    purpose: &str,
) -> Result<Session> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    check_purpose(purpose)?;
    let io = |e| Error::io(format!("authenticating to the {purpose} peer"), e);
    let nc = nonce()?;
    s.write_all(&client_hello(purpose, &nc)).await.map_err(io)?;
    s.flush().await.map_err(io)?;
    let mut reply = [0u8; 4 + NONCE + MAC];
    s.read_exact(&mut reply)
        .await
        .map_err(|e| closed(e, purpose))?;
    let answer = steps::client_answer(secret, purpose, &nc, &reply)?;
    s.write_all(&answer).await.map_err(io)?;
    s.flush().await.map_err(io)?;
    let mut ok = [0u8; 4];
    s.read_exact(&mut ok)
        .await
        .map_err(|e| closed(e, purpose))?;
    if &ok != ACCEPTED {
        return Err(not_proven(purpose));
    }
    Ok(session(secret, purpose, &nc, &reply[4..4 + NONCE]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    fn secret(s: &str) -> Secret {
        Secret::new(format!("{s}-padding-to-16-bytes").into_bytes()).unwrap()
    }

    /// Runs a server handshake on a thread and a client one here.
    fn pair(
        server: Secret,
        sp: &'static str,
        client: Secret,
        cp: &'static str,
    ) -> (Result<Session>, Result<Session>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            // The refusing side closes at once, as the servers do.
            accept(&mut s, &server, sp)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let cr = connect(&mut c, &client, cp);
        drop(c);
        (t.join().unwrap(), cr)
    }

    #[test]
    fn same_secret_same_purpose_agree_on_a_session_key() {
        let (s, c) = pair(secret("a"), "mori.io", secret("a"), "mori.io");
        assert_eq!(s.unwrap(), c.unwrap());
    }

    #[test]
    fn a_wrong_secret_fails_on_both_sides() {
        let (s, c) = pair(secret("a"), "mori.io", secret("b"), "mori.io");
        // The client sees the bad server proof first and hangs up; the server then fails.
        assert!(s.is_err(), "{s:?}");
        let msg = c.unwrap_err().to_string();
        assert!(msg.contains("did not prove"), "{msg}");
    }

    #[test]
    fn a_proof_for_another_protocol_is_refused() {
        let (s, c) = pair(secret("a"), "umbpd", secret("a"), "mori.io");
        assert!(s.is_err() && c.is_err());
    }

    #[test]
    fn garbage_and_replayed_proofs_are_refused() {
        let key = secret("a");
        // Garbage first bytes.
        let mut junk: &[u8] = b"GET / HTTP/1.1\r\n\r\n";
        let mut sink = Vec::new();
        let mut rw = ReadWrite(&mut junk, &mut sink);
        assert!(accept(&mut rw, &key, "mori.io").is_err());
        assert!(sink.is_empty(), "nothing is sent to a non-mori peer");
        // A client proof recorded from one session does not pass in another: the server's
        // nonce differs every time.
        let nc = [7u8; NONCE];
        let ns_old = [1u8; NONCE];
        let old_mac = proof(&key, b"client", "mori.io", &nc, &ns_old);
        let mut input = client_hello("mori.io", &nc);
        input.extend_from_slice(&old_mac);
        let mut r: &[u8] = &input;
        let mut out = Vec::new();
        let res = accept(&mut ReadWrite(&mut r, &mut out), &key, "mori.io");
        assert!(matches!(res, Err(Error::Rejected(_))), "{res:?}");
    }

    #[cfg(feature = "tokio")]
    #[tokio::test]
    async fn async_and_sync_sides_interoperate() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            accept(&mut s, &secret("a"), "umbpd")
        });
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let cs = connect_async(&mut c, &secret("a"), "umbpd").await.unwrap();
        assert_eq!(t.join().unwrap().unwrap(), cs);
    }

    /// A stream made of a reader and a writer.
    struct ReadWrite<'a, R, W>(&'a mut R, &'a mut W);
    impl<R: std::io::Read, W> std::io::Read for ReadWrite<'_, R, W> {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(b)
        }
    }
    impl<R, W: std::io::Write> std::io::Write for ReadWrite<'_, R, W> {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.1.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.1.flush()
        }
    }
}
