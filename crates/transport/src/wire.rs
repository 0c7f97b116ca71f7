//! Frames of the TCP data plane (little-endian).
//!
//! hello:    "MIOH" | name_len u32 | name                      (each side, once)
//! request:  "MIOQ" | kind u8 | id u64 | items u32 | notify_len u32
//!           | items × (region u64, offset u64, len u64) | notify
//!           | kinds 1 (write): payload (items' bytes)
//!           | kinds 3, 4 (same-host write/read): initiator pid u32 | items × initiator address u64
//!             (the target copies straight from/to the initiator's memory; no payload)
//! response: "MIOR" | id u64 | code u8 | msg_len u32 | payload_len u64 | msg | read payload
//! The server checks every item of a request before touching memory; a refused write's payload
//! is read and discarded so the stream stays in step.

use std::io::{Read, Write};

use crate::error::{Code, Error, Result};

pub const HELLO: [u8; 4] = *b"MIOH";
pub const REQUEST: [u8; 4] = *b"MIOQ";
pub const RESPONSE: [u8; 4] = *b"MIOR";
pub const MAX_ITEMS: u32 = 1 << 20;
pub const MAX_NOTIFY: u32 = 64 << 10;
const MAX_NAME: u32 = 4096;
const MAX_MSG: u32 = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write = 1,
    Read = 2,
    /// Same host: the target pulls the bytes from the initiator's memory.
    DirectWrite = 3,
    /// Same host: the target pushes the bytes into the initiator's memory.
    DirectRead = 4,
}

impl Kind {
    pub fn is_direct(self) -> bool {
        matches!(self, Kind::DirectWrite | Kind::DirectRead)
    }
    /// The same operation through the TCP payload path.
    pub fn over_tcp(self) -> Kind {
        match self {
            Kind::DirectWrite => Kind::Write,
            Kind::DirectRead => Kind::Read,
            k => k,
        }
    }
}

/// Where the initiator's bytes are, for the same-host kinds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Direct {
    pub pid: u32,
    pub addrs: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    pub kind: Kind,
    pub id: u64,
    pub items: Vec<Item>,
    pub notify: Vec<u8>,
    /// Present exactly for the same-host kinds.
    pub direct: Option<Direct>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHeader {
    pub id: u64,
    pub code: Code,
    pub message: String,
    pub payload_len: u64,
}

fn bad(what: &str) -> Error {
    Error::io(
        what.to_string(),
        std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string()),
    )
}

fn read_array<const N: usize>(r: &mut impl Read) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn ioe(context: &str) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(context, e)
}

pub fn write_hello(w: &mut impl Write, name: &str) -> Result<()> {
    let mut out = HELLO.to_vec();
    out.extend_from_slice(&(name.len() as u32).to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    w.write_all(&out)
        .and_then(|()| w.flush())
        .map_err(ioe("sending hello"))
}

pub fn read_hello(r: &mut impl Read) -> Result<String> {
    let magic: [u8; 4] = read_array(r).map_err(ioe("reading hello"))?;
    if magic != HELLO {
        return Err(bad("not a mori.io peer (bad hello)"));
    }
    let len = u32::from_le_bytes(read_array(r).map_err(ioe("reading hello"))?);
    if len > MAX_NAME {
        return Err(bad("hello name too long"));
    }
    let mut name = vec![0u8; len as usize];
    r.read_exact(&mut name).map_err(ioe("reading hello"))?;
    String::from_utf8(name).map_err(|_| bad("hello name is not UTF-8"))
}

/// Header bytes of a request (the payload follows separately).
pub fn encode_request(h: &RequestHeader) -> Vec<u8> {
    let mut out = Vec::with_capacity(21 + h.items.len() * 24 + h.notify.len());
    out.extend_from_slice(&REQUEST);
    out.push(h.kind as u8);
    out.extend_from_slice(&h.id.to_le_bytes());
    out.extend_from_slice(&(h.items.len() as u32).to_le_bytes());
    out.extend_from_slice(&(h.notify.len() as u32).to_le_bytes());
    for it in &h.items {
        out.extend_from_slice(&it.region.to_le_bytes());
        out.extend_from_slice(&it.offset.to_le_bytes());
        out.extend_from_slice(&it.len.to_le_bytes());
    }
    out.extend_from_slice(&h.notify);
    if let Some(d) = &h.direct {
        out.extend_from_slice(&d.pid.to_le_bytes());
        for a in &d.addrs {
            out.extend_from_slice(&a.to_le_bytes());
        }
    }
    out
}

/// Reads a request header; `Ok(None)` at a clean end of stream.
pub fn read_request(r: &mut impl Read) -> Result<Option<RequestHeader>> {
    let mut magic = [0u8; 4];
    match r.read_exact(&mut magic) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("reading a request", e)),
    }
    if magic != REQUEST {
        return Err(bad("bad request magic"));
    }
    let fixed: [u8; 17] = read_array(r).map_err(ioe("reading a request"))?;
    let kind = match fixed[0] {
        1 => Kind::Write,
        2 => Kind::Read,
        3 => Kind::DirectWrite,
        4 => Kind::DirectRead,
        _ => return Err(bad("bad request kind")),
    };
    let word =
        |at: usize| u32::from_le_bytes([fixed[at], fixed[at + 1], fixed[at + 2], fixed[at + 3]]);
    let id = u64::from_le_bytes(fixed[1..9].try_into().map_err(|_| bad("short request"))?);
    let (n, notify_len) = (word(9), word(13));
    if n > MAX_ITEMS || notify_len > MAX_NOTIFY {
        return Err(bad("request too large"));
    }
    let mut raw = vec![0u8; n as usize * 24];
    r.read_exact(&mut raw)
        .map_err(ioe("reading request items"))?;
    let items = raw
        .chunks_exact(24)
        .map(|c| {
            let w = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
            Item {
                region: w(0),
                offset: w(1),
                len: w(2),
            }
        })
        .collect();
    let mut notify = vec![0u8; notify_len as usize];
    r.read_exact(&mut notify)
        .map_err(ioe("reading a request"))?;
    let direct = if kind.is_direct() {
        let pid = u32::from_le_bytes(read_array(r).map_err(ioe("reading a request"))?);
        let mut raw = vec![0u8; n as usize * 8];
        r.read_exact(&mut raw).map_err(ioe("reading a request"))?;
        let addrs = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
            .collect();
        Some(Direct { pid, addrs })
    } else {
        None
    };
    Ok(Some(RequestHeader {
        kind,
        id,
        items,
        notify,
        direct,
    }))
}

pub fn encode_response(h: &ResponseHeader) -> Vec<u8> {
    let msg = h.message.as_bytes();
    let msg = &msg[..msg.len().min(MAX_MSG as usize)];
    let mut out = Vec::with_capacity(25 + msg.len());
    out.extend_from_slice(&RESPONSE);
    out.extend_from_slice(&h.id.to_le_bytes());
    out.push(h.code as u8);
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&h.payload_len.to_le_bytes());
    out.extend_from_slice(msg);
    out
}

pub fn read_response(r: &mut impl Read) -> Result<ResponseHeader> {
    let magic: [u8; 4] = read_array(r).map_err(ioe("reading a response"))?;
    if magic != RESPONSE {
        return Err(bad("bad response magic"));
    }
    let fixed: [u8; 21] = read_array(r).map_err(ioe("reading a response"))?;
    let id = u64::from_le_bytes(fixed[0..8].try_into().map_err(|_| bad("short response"))?);
    let code = Code::from_u8(fixed[8]);
    let msg_len = u32::from_le_bytes(fixed[9..13].try_into().map_err(|_| bad("short response"))?);
    let payload_len = u64::from_le_bytes(
        fixed[13..21]
            .try_into()
            .map_err(|_| bad("short response"))?,
    );
    if msg_len > MAX_MSG {
        return Err(bad("response message too long"));
    }
    let mut msg = vec![0u8; msg_len as usize];
    r.read_exact(&mut msg).map_err(ioe("reading a response"))?;
    Ok(ResponseHeader {
        id,
        code,
        message: String::from_utf8_lossy(&msg).into_owned(),
        payload_len,
    })
}

/// Reads and drops `n` bytes (a refused request's payload, an abandoned response's).
pub fn discard(r: &mut impl Read, mut n: u64) -> Result<()> {
    let mut sink = [0u8; 64 << 10];
    while n > 0 {
        let k = n.min(sink.len() as u64) as usize;
        r.read_exact(&mut sink[..k])
            .map_err(ioe("discarding payload"))?;
        n -= k as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let req = RequestHeader {
            kind: Kind::Read,
            id: 77,
            items: vec![
                Item {
                    region: 3,
                    offset: 5,
                    len: 9,
                },
                Item {
                    region: 4,
                    offset: 0,
                    len: 1 << 33,
                },
            ],
            notify: b"done".to_vec(),
            direct: None,
        };
        let bytes = encode_request(&req);
        assert_eq!(read_request(&mut bytes.as_slice()).unwrap().unwrap(), req);
        let direct = RequestHeader {
            kind: Kind::DirectWrite,
            direct: Some(Direct {
                pid: 42,
                addrs: vec![1, 2],
            }),
            ..req.clone()
        };
        assert_eq!(
            read_request(&mut encode_request(&direct).as_slice())
                .unwrap()
                .unwrap(),
            direct
        );
        assert!(read_request(&mut [].as_slice()).unwrap().is_none());
        let resp = ResponseHeader {
            id: 9,
            code: Code::OutOfRange,
            message: "no".into(),
            payload_len: 12,
        };
        assert_eq!(
            read_response(&mut encode_response(&resp).as_slice()).unwrap(),
            resp
        );
        let mut hello = Vec::new();
        write_hello(&mut hello, "engine-a").unwrap();
        assert_eq!(read_hello(&mut hello.as_slice()).unwrap(), "engine-a");
        assert!(read_hello(&mut b"XXXX".as_slice()).is_err());
    }
}
