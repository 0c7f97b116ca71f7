//! Framing and message encoding between clients and the root.
//!
//! Every frame is a big-endian `u64` body length followed by the body; the body starts with
//! a one-byte tag. Integers are big-endian, strings and byte blobs are length-prefixed.
//! Frames flow only after the connection's mori-auth handshake (see [`HANDSHAKE_PURPOSE`]);
//! nothing here is parsed from an unauthenticated peer.

use std::io::{self, Read};
use std::net::SocketAddr;
use std::time::Duration;

use crate::error::Error;

/// The mori-auth purpose of every bootstrap connection: a proof made for another protocol
/// does not open a bootstrap connection, and the other way round.
pub(crate) const HANDSHAKE_PURPOSE: &str = "mori.bootstrap";

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

/// First frame of every client (after the handshake proved it holds the id's secret).
#[derive(Debug, PartialEq)]
pub(crate) struct Hello {
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
    let mut f = FrameBuf::new(TAG_HELLO, 16);
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
        TAG_HELLO => ClientMsg::Hello(Hello {
            rank: c.u32()?,
            world_size: c.u32()?,
            timeout: Duration::from_millis(c.u64()?),
        }),
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

    /// Bounded fuzzing of every decoder (`PROPTEST_CASES` runs more cases).
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn config() -> ProptestConfig {
            mori_testutil::fuzz_config(2000)
        }

        fn kind() -> impl Strategy<Value = OpKind> {
            prop_oneof![
                Just(OpKind::Connect),
                Just(OpKind::Allgather),
                Just(OpKind::Broadcast),
                Just(OpKind::Barrier),
            ]
        }

        fn addr() -> impl Strategy<Value = SocketAddr> {
            prop_oneof![
                (any::<[u8; 4]>(), any::<u16>()).prop_map(|(ip, p)| SocketAddr::from((ip, p))),
                (any::<[u8; 16]>(), any::<u16>(), any::<u32>()).prop_map(|(ip, p, scope)| {
                    std::net::SocketAddrV6::new(ip.into(), p, 0, scope).into()
                }),
            ]
        }

        fn error() -> impl Strategy<Value = Error> {
            let text = any::<String>;
            prop_oneof![
                text().prop_map(Error::InvalidId),
                text().prop_map(Error::InvalidArgument),
                (
                    text(),
                    any::<u64>(),
                    any::<u64>(),
                    prop::collection::vec(any::<u32>(), 0..20)
                )
                    .prop_map(|(op, seq, ms, missing)| Error::Timeout {
                        op,
                        seq,
                        waited: Duration::from_millis(ms),
                        missing: missing.into_iter().map(|r| r as usize).collect(),
                    }),
                (text(), any::<u32>(), text()).prop_map(|(op, rank, detail)| Error::PeerLost {
                    op,
                    rank: rank as usize,
                    detail
                }),
                text().prop_map(Error::Mismatch),
                (addr(), text()).prop_map(|(addr, detail)| Error::RootUnreachable { addr, detail }),
                (text(), text()).prop_map(|(context, msg)| Error::Io {
                    context,
                    source: io::Error::other(msg),
                }),
            ]
        }

        /// Arbitrary bytes, often behind a valid tag so the decoders get past the first byte.
        fn body() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..256),
                (
                    prop::sample::select(vec![
                        TAG_HELLO,
                        TAG_REQUEST,
                        TAG_GOODBYE,
                        TAG_REPLY,
                        TAG_FAIL
                    ]),
                    0u8..12,
                    prop::collection::vec(any::<u8>(), 0..256),
                )
                    .prop_map(|(tag, sub, rest)| {
                        let mut b = vec![tag, sub];
                        b.extend(rest);
                        b
                    }),
            ]
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn decoders_never_panic_on_arbitrary_bodies(b in body()) {
                let _ = decode_client(&b);
                let _ = decode_root(&b);
            }

            #[test]
            fn read_frame_respects_its_limit_and_the_frame_end(
                input in prop::collection::vec(any::<u8>(), 0..64),
                max in 0u64..48,
            ) {
                let mut r = &input[..];
                let res = read_frame(&mut r, max);
                let consumed = input.len() - r.len();
                match res {
                    Ok(Some(body)) => {
                        prop_assert!(body.len() as u64 <= max);
                        // Exactly the length prefix and the body, nothing beyond.
                        prop_assert_eq!(consumed, 8 + body.len());
                        prop_assert_eq!(&input[8..consumed], &body[..]);
                    }
                    Ok(None) => prop_assert!(input.is_empty()),
                    Err(_) => {
                        // Never reads past what the prefix announced, nor a body over the limit.
                        if input.len() >= 8 {
                            let len = u64::from_be_bytes(input[..8].try_into().unwrap());
                            prop_assert!(len > max || (input.len() as u64) < 8 + len);
                            prop_assert!(consumed as u64 <= 8 + len.min(max));
                        }
                    }
                }
            }

            #[test]
            fn huge_counts_with_short_bodies_are_errors(
                kind in kind(),
                seq in any::<u64>(),
                n in 1u32..,
                rest in prop::collection::vec(any::<u8>(), 0..64),
            ) {
                // A reply announcing up to 2^32 parts, with a few bytes behind it.
                let mut b = vec![TAG_REPLY, kind.code()];
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&n.to_be_bytes());
                b.extend_from_slice(&rest);
                if n > 8 {
                    prop_assert!(decode_root(&b).is_err());
                }
                // A timeout error naming up to 2^32 missing ranks.
                let mut f = vec![TAG_FAIL, ERR_TIMEOUT, 0, 0, 0, 0, 0, 0, 0, 0];
                f.extend_from_slice(&[0; 16]);
                f.extend_from_slice(&n.to_be_bytes());
                f.extend_from_slice(&rest);
                if n > 16 {
                    prop_assert!(decode_root(&f).is_err());
                }
                // A blob whose length exceeds the frame.
                let mut q = vec![TAG_REQUEST, 1];
                q.extend_from_slice(&[0; 20]);
                q.extend_from_slice(&(u64::from(n) << 20).to_be_bytes());
                q.extend_from_slice(&rest);
                prop_assert!(decode_client(&q).is_err());
            }

            #[test]
            fn client_messages_round_trip_and_truncations_fail(
                rank in any::<u32>(),
                world_size in any::<u32>(),
                ms in any::<u64>(),
                kind in kind(),
                seq in any::<u64>(),
                payload in prop::collection::vec(any::<u8>(), 0..300),
                cut in any::<prop::sample::Index>(),
            ) {
                let hello = Hello { rank, world_size, timeout: Duration::from_millis(ms) };
                let frames = [
                    (encode_hello(&hello), ClientMsg::Hello(hello)),
                    (
                        encode_request(kind, seq, rank, Duration::from_millis(ms), &payload),
                        ClientMsg::Request(Request {
                            kind,
                            seq,
                            root: rank,
                            timeout: Duration::from_millis(ms),
                            payload: payload.clone(),
                        }),
                    ),
                    (encode_goodbye(), ClientMsg::Goodbye),
                ];
                for (frame, msg) in frames {
                    let body = read_frame(&mut &frame[..], MAX_CLIENT_FRAME).unwrap().unwrap();
                    prop_assert_eq!(decode_client(&body).unwrap(), msg);
                    // Any strict prefix of a body, or any extra byte, is refused.
                    let short = &body[..cut.index(body.len())];
                    prop_assert!(decode_client(short).is_err());
                    let mut long = body.clone();
                    long.push(0);
                    prop_assert!(decode_client(&long).is_err());
                }
            }

            #[test]
            fn replies_round_trip(
                kind in kind(),
                seq in any::<u64>(),
                parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..10),
                cut in any::<prop::sample::Index>(),
            ) {
                let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                let frame = encode_reply(kind, seq, &refs);
                let body = read_frame(&mut &frame[..], max_root_frame(parts.len())).unwrap().unwrap();
                match decode_root(&body).unwrap() {
                    RootMsg::Reply { kind: k, seq: s, parts: p } => {
                        prop_assert_eq!((k, s), (kind, seq));
                        prop_assert_eq!(p, parts);
                    }
                    RootMsg::Fail(e) => prop_assert!(false, "decoded a failure: {e}"),
                }
                prop_assert!(decode_root(&body[..cut.index(body.len())]).is_err());
            }

            #[test]
            fn failures_round_trip(err in error(), cut in any::<prop::sample::Index>()) {
                let frame = encode_fail(&err);
                let body = read_frame(&mut &frame[..], u64::MAX).unwrap().unwrap();
                match decode_root(&body).unwrap() {
                    RootMsg::Fail(back) => prop_assert_eq!(back.to_string(), err.to_string()),
                    RootMsg::Reply { .. } => prop_assert!(false, "decoded a reply"),
                }
                prop_assert!(decode_root(&body[..cut.index(body.len())]).is_err());
            }

            #[test]
            fn mutated_frames_never_panic(
                kind in kind(),
                payload in prop::collection::vec(any::<u8>(), 0..64),
                flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            ) {
                let frames = [
                    encode_request(kind, 3, 1, Duration::from_secs(1), &payload),
                    encode_reply(kind, 3, &[&payload, &payload]),
                    encode_fail(&Error::Timeout {
                        op: "barrier".into(),
                        seq: 3,
                        waited: Duration::from_secs(1),
                        missing: vec![1, 2],
                    }),
                ];
                for mut f in frames {
                    for (at, x) in &flips {
                        let i = at.index(f.len());
                        f[i] ^= x;
                    }
                    if let Ok(Some(body)) = read_frame(&mut &f[..], 1 << 16) {
                        let _ = decode_client(&body);
                        let _ = decode_root(&body);
                    }
                }
            }
        }
    }
}
