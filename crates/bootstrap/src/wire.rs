//! Framing and message encoding between clients and the root.
//!
//! Every frame is a big-endian `u64` body length followed by the body; the body starts with
//! a one-byte tag. Integers are big-endian, strings and byte blobs are length-prefixed.

use std::io::{self, Read};
use std::net::SocketAddr;
use std::time::Duration;

use crate::error::Error;
use crate::id::{SECRET_BYTES, Secret};

/// Largest payload one rank may contribute to one operation.
pub(crate) const MAX_PAYLOAD: usize = 1 << 30;

/// Room for the fixed fields of any frame on top of its payload(s).
const FRAME_OVERHEAD: u64 = 64 * 1024;

/// Largest frame the root accepts from a client.
pub(crate) const MAX_CLIENT_FRAME: u64 = MAX_PAYLOAD as u64 + FRAME_OVERHEAD;

/// Largest frame a client accepts from the root in a session of `world_size` ranks
/// (an allgather reply carries one payload per rank).
pub(crate) fn max_root_frame(world_size: usize) -> u64 {
    (world_size as u64)
        .saturating_mul(MAX_PAYLOAD as u64 + 8)
        .saturating_add(FRAME_OVERHEAD)
}

const TAG_HELLO: u8 = 1;
const TAG_REQUEST: u8 = 2;
const TAG_GOODBYE: u8 = 3;
const TAG_REPLY: u8 = 10;
const TAG_FAIL: u8 = 11;

/// The collective operations; `Connect` is the rendezvous itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    Connect,
    Allgather,
    Broadcast,
    Barrier,
}

impl OpKind {
    /// Name used in errors and logs.
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::Connect => "connect",
            OpKind::Allgather => "allgather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        match self {
            OpKind::Connect => 0,
            OpKind::Allgather => 1,
            OpKind::Broadcast => 2,
            OpKind::Barrier => 3,
        }
    }

    fn from_code(c: u8) -> io::Result<OpKind> {
        Ok(match c {
            0 => OpKind::Connect,
            1 => OpKind::Allgather,
            2 => OpKind::Broadcast,
            3 => OpKind::Barrier,
            _ => return Err(bad(format!("unknown op kind {c}"))),
        })
    }
}

/// First message of every client: who it is and proof that it holds the id.
#[derive(Debug, PartialEq)]
pub(crate) struct Hello {
    pub secret: Secret,
    pub rank: u32,
    pub world_size: u32,
    pub timeout: Duration,
}

/// One rank's part of one collective operation.
#[derive(Debug, PartialEq)]
pub(crate) struct Request {
    pub kind: OpKind,
    pub seq: u64,
    /// Broadcast root (0 for other ops).
    pub root: u32,
    pub timeout: Duration,
    pub payload: Vec<u8>,
}

/// Messages a client sends.
#[derive(Debug, PartialEq)]
pub(crate) enum ClientMsg {
    Hello(Hello),
    Request(Request),
    /// Clean shutdown: the connection closing next is not a failure.
    Goodbye,
}

/// Messages the root sends.
#[derive(Debug)]
pub(crate) enum RootMsg {
    /// Successful completion of `kind #seq`; `parts` is per-op (see `Bootstrap`).
    Reply {
        kind: OpKind,
        seq: u64,
        parts: Vec<Vec<u8>>,
    },
    /// The operation (or the whole session) failed.
    Fail(Error),
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Builds one frame; the length prefix is filled in by [`FrameBuf::finish`].
struct FrameBuf(Vec<u8>);

impl FrameBuf {
    fn new(tag: u8, capacity: usize) -> FrameBuf {
        let mut v = Vec::with_capacity(capacity + 9);
        v.extend_from_slice(&[0u8; 8]);
        v.push(tag);
        FrameBuf(v)
    }
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_be_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_be_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 8) as u64;
        self.0[..8].copy_from_slice(&len.to_be_bytes());
        self.0
    }
}

/// Reads fields back out of a frame body.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad("truncated frame"));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_be_bytes(a))
    }
    fn u64(&mut self) -> io::Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = usize::try_from(self.u64()?).map_err(|_| bad("blob length overflows"))?;
        self.take(n)
    }
    fn string(&mut self) -> io::Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    fn end(&self) -> io::Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(bad("trailing bytes in frame"))
        }
    }
}

/// Encodes the hello frame.
pub(crate) fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut f = FrameBuf::new(TAG_HELLO, SECRET_BYTES + 16);
    f.0.extend_from_slice(&h.secret);
    f.u32(h.rank);
    f.u32(h.world_size);
    f.u64(millis(h.timeout));
    f.finish()
}

/// Encodes one request frame (borrowing the payload, so it is copied only once).
pub(crate) fn encode_request(
    kind: OpKind,
    seq: u64,
    root: u32,
    timeout: Duration,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = FrameBuf::new(TAG_REQUEST, payload.len() + 40);
    f.u8(kind.code());
    f.u64(seq);
    f.u32(root);
    f.u64(millis(timeout));
    f.bytes(payload);
    f.finish()
}

/// Encodes the goodbye frame.
pub(crate) fn encode_goodbye() -> Vec<u8> {
    FrameBuf::new(TAG_GOODBYE, 0).finish()
}

/// Decodes a frame body sent by a client.
pub(crate) fn decode_client(body: &[u8]) -> io::Result<ClientMsg> {
    let mut c = Cursor(body);
    let msg = match c.u8()? {
        TAG_HELLO => {
            let mut secret = [0u8; SECRET_BYTES];
            secret.copy_from_slice(c.take(SECRET_BYTES)?);
            ClientMsg::Hello(Hello {
                secret,
                rank: c.u32()?,
                world_size: c.u32()?,
                timeout: Duration::from_millis(c.u64()?),
            })
        }
        TAG_REQUEST => ClientMsg::Request(Request {
            kind: OpKind::from_code(c.u8()?)?,
            seq: c.u64()?,
            root: c.u32()?,
            timeout: Duration::from_millis(c.u64()?),
            payload: c.bytes()?.to_vec(),
        }),
        TAG_GOODBYE => ClientMsg::Goodbye,
        t => return Err(bad(format!("unexpected client frame tag {t}"))),
    };
    c.end()?;
    Ok(msg)
}

/// Encodes a successful reply; built once and written to every rank.
pub(crate) fn encode_reply(kind: OpKind, seq: u64, parts: &[&[u8]]) -> Vec<u8> {
    let size: usize = parts.iter().map(|p| p.len() + 8).sum();
    let mut f = FrameBuf::new(TAG_REPLY, size + 16);
    f.u8(kind.code());
    f.u64(seq);
    f.u32(parts.len() as u32);
    for p in parts {
        f.bytes(p);
    }
    f.finish()
}

const ERR_INVALID_ID: u8 = 1;
const ERR_INVALID_ARGUMENT: u8 = 2;
const ERR_TIMEOUT: u8 = 3;
const ERR_PEER_LOST: u8 = 4;
const ERR_MISMATCH: u8 = 5;
const ERR_ROOT_UNREACHABLE: u8 = 6;
const ERR_IO: u8 = 7;

/// Encodes an error for the client(s); built once and written to every affected rank.
pub(crate) fn encode_fail(err: &Error) -> Vec<u8> {
    let mut f = FrameBuf::new(TAG_FAIL, 256);
    match err {
        Error::InvalidId(s) => {
            f.u8(ERR_INVALID_ID);
            f.str(s);
        }
        Error::InvalidArgument(s) => {
            f.u8(ERR_INVALID_ARGUMENT);
            f.str(s);
        }
        Error::Timeout {
            op,
            seq,
            waited,
            missing,
        } => {
            f.u8(ERR_TIMEOUT);
            f.str(op);
            f.u64(*seq);
            f.u64(millis(*waited));
            f.u32(missing.len() as u32);
            for &r in missing {
                f.u32(r as u32);
            }
        }
        Error::PeerLost { op, rank, detail } => {
            f.u8(ERR_PEER_LOST);
            f.str(op);
            f.u32(*rank as u32);
            f.str(detail);
        }
        Error::Mismatch(s) => {
            f.u8(ERR_MISMATCH);
            f.str(s);
        }
        Error::RootUnreachable { addr, detail } => {
            f.u8(ERR_ROOT_UNREACHABLE);
            f.str(&addr.to_string());
            f.str(detail);
        }
        Error::Io { context, source } => {
            f.u8(ERR_IO);
            f.str(context);
            f.str(&source.to_string());
        }
    }
    f.finish()
}

fn decode_fail(c: &mut Cursor<'_>) -> io::Result<Error> {
    Ok(match c.u8()? {
        ERR_INVALID_ID => Error::InvalidId(c.string()?),
        ERR_INVALID_ARGUMENT => Error::InvalidArgument(c.string()?),
        ERR_TIMEOUT => {
            let op = c.string()?;
            let seq = c.u64()?;
            let waited = Duration::from_millis(c.u64()?);
            let n = c.u32()?;
            let missing = (0..n)
                .map(|_| c.u32().map(|r| r as usize))
                .collect::<io::Result<_>>()?;
            Error::Timeout {
                op,
                seq,
                waited,
                missing,
            }
        }
        ERR_PEER_LOST => Error::PeerLost {
            op: c.string()?,
            rank: c.u32()? as usize,
            detail: c.string()?,
        },
        ERR_MISMATCH => Error::Mismatch(c.string()?),
        ERR_ROOT_UNREACHABLE => {
            let addr: SocketAddr = c
                .string()?
                .parse()
                .map_err(|_| bad("bad address in error frame"))?;
            Error::RootUnreachable {
                addr,
                detail: c.string()?,
            }
        }
        ERR_IO => {
            let context = c.string()?;
            Error::Io {
                context,
                source: io::Error::other(c.string()?),
            }
        }
        t => return Err(bad(format!("unknown error code {t}"))),
    })
}

/// Decodes a frame body sent by the root.
pub(crate) fn decode_root(body: &[u8]) -> io::Result<RootMsg> {
    let mut c = Cursor(body);
    let msg = match c.u8()? {
        TAG_REPLY => {
            let kind = OpKind::from_code(c.u8()?)?;
            let seq = c.u64()?;
            let n = c.u32()?;
            let parts = (0..n)
                .map(|_| c.bytes().map(<[u8]>::to_vec))
                .collect::<io::Result<_>>()?;
            RootMsg::Reply { kind, seq, parts }
        }
        TAG_FAIL => RootMsg::Fail(decode_fail(&mut c)?),
        t => return Err(bad(format!("unexpected root frame tag {t}"))),
    };
    c.end()?;
    Ok(msg)
}

/// Reads one frame body. Returns `Ok(None)` on a clean EOF before the first byte of a frame.
///
/// The body is read incrementally, so a bogus length cannot make us allocate it up front.
pub(crate) fn read_frame(r: &mut impl Read, max_len: u64) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 8];
    let mut got = 0;
    while got < len.len() {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u64::from_be_bytes(len);
    if len > max_len {
        return Err(bad(format!(
            "frame of {len} bytes exceeds the limit of {max_len} bytes"
        )));
    }
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body)?;
    if body.len() as u64 != len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(frame: &[u8]) -> Vec<u8> {
        read_frame(&mut &frame[..], u64::MAX).unwrap().unwrap()
    }

    #[test]
    fn client_messages_round_trip() {
        let hello = Hello {
            secret: [9; SECRET_BYTES],
            rank: 3,
            world_size: 8,
            timeout: Duration::from_millis(1500),
        };
        let f = encode_hello(&hello);
        assert_eq!(decode_client(&body(&f)).unwrap(), ClientMsg::Hello(hello));
        let f = encode_request(OpKind::Broadcast, 77, 2, Duration::from_secs(3), &[1, 2, 3]);
        let req = Request {
            kind: OpKind::Broadcast,
            seq: 77,
            root: 2,
            timeout: Duration::from_secs(3),
            payload: vec![1, 2, 3],
        };
        assert_eq!(decode_client(&body(&f)).unwrap(), ClientMsg::Request(req));
        assert_eq!(
            decode_client(&body(&encode_goodbye())).unwrap(),
            ClientMsg::Goodbye
        );
    }

    #[test]
    fn reply_and_fail_round_trip() {
        let f = encode_reply(OpKind::Allgather, 5, &[b"ab", b"", b"xyz"]);
        match decode_root(&body(&f)).unwrap() {
            RootMsg::Reply { kind, seq, parts } => {
                assert_eq!((kind, seq), (OpKind::Allgather, 5));
                assert_eq!(parts, vec![b"ab".to_vec(), vec![], b"xyz".to_vec()]);
            }
            other => panic!("{other:?}"),
        }
        let e = Error::Timeout {
            op: "barrier".into(),
            seq: 4,
            waited: Duration::from_millis(250),
            missing: vec![1, 3],
        };
        match decode_root(&body(&encode_fail(&e))).unwrap() {
            RootMsg::Fail(Error::Timeout {
                op,
                seq,
                waited,
                missing,
            }) => {
                assert_eq!((op.as_str(), seq), ("barrier", 4));
                assert_eq!((waited, missing), (Duration::from_millis(250), vec![1, 3]));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rejects_oversized_and_truncated_frames() {
        let f = encode_goodbye();
        assert!(read_frame(&mut &f[..], 0).is_err());
        assert!(read_frame(&mut &f[..f.len() - 1], 100).is_err());
        assert!(read_frame(&mut &[][..], 100).unwrap().is_none());
        assert!(decode_client(&[TAG_REQUEST, 9]).is_err());
    }
}
