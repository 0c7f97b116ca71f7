//! Frames of the mori.io data plane (little-endian), after the mori-auth handshake.
//!
//! hello:    "MIOH" | version u8 | instance u64 | name_len u32 | name | endpoints u32
//!           | endpoints × (len u32 | address)
//!           (each side, once; the engine's libfabric endpoint addresses, one per NIC it stripes
//!           over, in order; none when it has no fabric endpoint)
//! request:  "MIOQ" | kind u8 | id u64 | region u64 | key u64 | items u32 | notify_len u32
//!           | items × (offset u64, len u64) | notify
//!           | kind 1 (write): payload (items' bytes)
//!           | kinds 3, 4 (same-host write/read, Unix connections only): items × initiator
//!             address u64 — addresses in the initiator's own memory; the target learns who
//!             the initiator is from the kernel (SO_PEERCRED), never from the frame
//! response: "MIOR" | id u64 | code u8 | msg_len u32 | payload_len u64 | msg | read payload
//! Every request names one region of the target and that region's key. The server checks
//! every item before touching memory; a refused write's payload is read and discarded so the
//! stream stays in step.

use std::io::{Read, Write};

use crate::error::{Code, Error, Result};

pub const HELLO: [u8; 4] = *b"MIOH";
pub const REQUEST: [u8; 4] = *b"MIOQ";
pub const RESPONSE: [u8; 4] = *b"MIOR";
/// 3: the hello carries the fabric endpoint address. 4: a list of them (one per NIC).
pub const VERSION: u8 = 4;
pub const MAX_ITEMS: u32 = 1 << 20;
pub const MAX_NOTIFY: u32 = 64 << 10;
const MAX_NAME: u32 = 4096;
/// Longest fabric endpoint address in a hello (libfabric's are at most a few dozen bytes).
const MAX_FABRIC_NAME: u32 = 1024;
/// Most fabric endpoints (NICs) one engine stripes over.
pub const MAX_FABRIC_ENDPOINTS: u32 = 16;
const MAX_MSG: u32 = 64 << 10;
/// Items read per step, so a header that claims many items costs memory only as they arrive.
const ITEMS_PER_READ: usize = 4096;

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
    /// Whether the request changes the target's memory.
    pub fn writes_target(self) -> bool {
        matches!(self, Kind::Write | Kind::DirectWrite)
    }
    /// The same operation through the payload path.
    pub fn over_tcp(self) -> Kind {
        match self {
            Kind::DirectWrite => Kind::Write,
            Kind::DirectRead => Kind::Read,
            k => k,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub offset: u64,
    pub len: u64,
}

/// Who an engine is: its name and the instance that tells it from an earlier engine of the
/// same name (a restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub name: String,
    pub instance: u64,
    /// The addresses of the engine's fabric endpoints (libfabric `fi_getname`), one per NIC in
    /// the order its descriptors list their registrations; empty when it has none. Sent only
    /// after the peer proved the secret: what a forged descriptor cannot redirect.
    pub fabric: Vec<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    pub kind: Kind,
    pub id: u64,
    /// The target's region and its key.
    pub region: u64,
    pub key: u64,
    pub items: Vec<Item>,
    pub notify: Vec<u8>,
    /// The initiator's address of each item, exactly for the same-host kinds.
    pub direct: Option<Vec<u64>>,
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

fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

pub fn write_hello(w: &mut impl Write, me: &Hello) -> Result<()> {
    let mut out = HELLO.to_vec();
    out.push(VERSION);
    out.extend_from_slice(&me.instance.to_le_bytes());
    out.extend_from_slice(&(me.name.len() as u32).to_le_bytes());
    out.extend_from_slice(me.name.as_bytes());
    out.extend_from_slice(&(me.fabric.len() as u32).to_le_bytes());
    for address in &me.fabric {
        out.extend_from_slice(&(address.len() as u32).to_le_bytes());
        out.extend_from_slice(address);
    }
    w.write_all(&out)
        .and_then(|()| w.flush())
        .map_err(ioe("sending hello"))
}

pub fn read_hello(r: &mut impl Read) -> Result<Hello> {
    let head: [u8; 17] = read_array(r).map_err(ioe("reading hello"))?;
    if head[..4] != HELLO {
        return Err(bad("not a mori.io peer (bad hello)"));
    }
    if head[4] != VERSION {
        return Err(bad(&format!(
            "the peer speaks mori.io wire version {}, this engine {VERSION}",
            head[4]
        )));
    }
    let instance = le64(&head, 5);
    let len = le32(&head, 13);
    if len > MAX_NAME {
        return Err(bad("hello name too long"));
    }
    let mut name = vec![0u8; len as usize];
    r.read_exact(&mut name).map_err(ioe("reading hello"))?;
    let name = String::from_utf8(name).map_err(|_| bad("hello name is not UTF-8"))?;
    let endpoints = u32::from_le_bytes(read_array(r).map_err(ioe("reading hello"))?);
    if endpoints > MAX_FABRIC_ENDPOINTS {
        return Err(bad("hello lists too many fabric endpoints"));
    }
    let mut fabric = Vec::with_capacity(endpoints as usize);
    for _ in 0..endpoints {
        let len = u32::from_le_bytes(read_array(r).map_err(ioe("reading hello"))?);
        if len > MAX_FABRIC_NAME {
            return Err(bad("hello fabric address too long"));
        }
        let mut address = vec![0u8; len as usize];
        r.read_exact(&mut address).map_err(ioe("reading hello"))?;
        fabric.push(address);
    }
    Ok(Hello {
        name,
        instance,
        fabric,
    })
}

/// Header bytes of a request (the payload follows separately).
pub fn encode_request(h: &RequestHeader) -> Vec<u8> {
    let direct = h.direct.as_ref().map_or(0, Vec::len);
    let mut out = Vec::with_capacity(45 + h.items.len() * 16 + h.notify.len() + direct * 8);
    out.extend_from_slice(&REQUEST);
    out.push(h.kind as u8);
    out.extend_from_slice(&h.id.to_le_bytes());
    out.extend_from_slice(&h.region.to_le_bytes());
    out.extend_from_slice(&h.key.to_le_bytes());
    out.extend_from_slice(&(h.items.len() as u32).to_le_bytes());
    out.extend_from_slice(&(h.notify.len() as u32).to_le_bytes());
    for it in &h.items {
        out.extend_from_slice(&it.offset.to_le_bytes());
        out.extend_from_slice(&it.len.to_le_bytes());
    }
    out.extend_from_slice(&h.notify);
    for a in h.direct.iter().flatten() {
        out.extend_from_slice(&a.to_le_bytes());
    }
    out
}

/// Reads `n` little-endian records of `size` bytes, a bounded number at a time.
fn read_records<T>(
    r: &mut impl Read,
    n: usize,
    size: usize,
    parse: impl Fn(&[u8]) -> T,
) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(n.min(ITEMS_PER_READ));
    let mut raw = vec![0u8; n.min(ITEMS_PER_READ) * size];
    let mut left = n;
    while left > 0 {
        let k = left.min(ITEMS_PER_READ);
        r.read_exact(&mut raw[..k * size])
            .map_err(ioe("reading a request"))?;
        out.extend(raw[..k * size].chunks_exact(size).map(&parse));
        left -= k;
    }
    Ok(out)
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
    let fixed: [u8; 33] = read_array(r).map_err(ioe("reading a request"))?;
    let kind = match fixed[0] {
        1 => Kind::Write,
        2 => Kind::Read,
        3 => Kind::DirectWrite,
        4 => Kind::DirectRead,
        _ => return Err(bad("bad request kind")),
    };
    let (id, region, key) = (le64(&fixed, 1), le64(&fixed, 9), le64(&fixed, 17));
    let (n, notify_len) = (le32(&fixed, 25), le32(&fixed, 29));
    if n > MAX_ITEMS || notify_len > MAX_NOTIFY {
        return Err(bad("request too large"));
    }
    let items = read_records(r, n as usize, 16, |c| Item {
        offset: le64(c, 0),
        len: le64(c, 8),
    })?;
    let mut notify = vec![0u8; notify_len as usize];
    r.read_exact(&mut notify)
        .map_err(ioe("reading a request"))?;
    let direct = if kind.is_direct() {
        Some(read_records(r, n as usize, 8, |c| le64(c, 0))?)
    } else {
        None
    };
    Ok(Some(RequestHeader {
        kind,
        id,
        region,
        key,
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
            region: 3,
            key: 0xdead_beef_0bad_cafe,
            items: vec![
                Item { offset: 5, len: 9 },
                Item {
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
            direct: Some(vec![1, 2]),
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
        let me = Hello {
            name: "engine-a".into(),
            instance: 42,
            fabric: vec![vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1], vec![2, 0, 0x1f, 0x91]],
        };
        let mut hello = Vec::new();
        write_hello(&mut hello, &me).unwrap();
        assert_eq!(read_hello(&mut hello.as_slice()).unwrap(), me);
        for cut in 0..hello.len() {
            assert!(
                read_hello(&mut &hello[..cut]).is_err(),
                "a hello cut at {cut}"
            );
        }
        let none = Hello {
            fabric: Vec::new(),
            ..me.clone()
        };
        let mut hello = Vec::new();
        write_hello(&mut hello, &none).unwrap();
        assert_eq!(read_hello(&mut hello.as_slice()).unwrap(), none);
        assert!(read_hello(&mut b"XXXX".as_slice()).is_err());
        // A count past the limit is refused before anything is allocated for it.
        let mut many = Vec::new();
        write_hello(&mut many, &none).unwrap();
        let at = many.len() - 4;
        many[at..].copy_from_slice(&(MAX_FABRIC_ENDPOINTS + 1).to_le_bytes());
        assert!(read_hello(&mut many.as_slice()).is_err());
    }

    #[test]
    fn a_header_claiming_many_items_fails_on_its_short_body() {
        let mut bytes = encode_request(&RequestHeader {
            kind: Kind::Read,
            id: 1,
            region: 1,
            key: 1,
            items: vec![],
            notify: vec![],
            direct: None,
        });
        bytes[29..33].copy_from_slice(&MAX_ITEMS.to_le_bytes());
        assert!(read_request(&mut bytes.as_slice()).is_err());
    }
}
