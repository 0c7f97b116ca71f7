//! Descriptors exchanged out of band: an engine's address, a registered region's identity.
//! Both pack to a few bytes (little-endian, length-prefixed strings) with a format tag.

use std::net::SocketAddr;

use mori_transport::{Error, Location, Result};

// Engines (version 2) carry their same-host socket; regions (version 3) their key, instance,
// CUDA IPC export and fabric registration.
const ENGINE_TAG: &[u8; 4] = b"MIE2";
const MEMORY_TAG: &[u8; 4] = b"MIM4";
/// Most fabric registrations one descriptor carries (one per NIC the engine stripes over).
const MAX_FABRIC_NICS: usize = 16;

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Cursor<'a>(&'a [u8]);
impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::InvalidArgument("truncated descriptor".into()));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| bad())?,
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| bad())?,
        ))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > 4096 {
            return Err(bad());
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad())
    }
}

fn bad() -> Error {
    Error::InvalidArgument("malformed descriptor".into())
}

/// How to reach an engine. `instance` tells a restarted engine (same name and address) from
/// the one before it, so peers reconnect instead of reusing dead connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineDesc {
    pub name: String,
    pub addr: SocketAddr,
    pub instance: u64,
    /// Identifies the host (kernel boot id + host name): equal keys can use the same-host path.
    pub host: String,
    /// The engine's same-host Unix socket (empty: none).
    pub local: String,
}

impl EngineDesc {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = ENGINE_TAG.to_vec();
        put_str(&mut out, &self.name);
        put_str(&mut out, &self.addr.to_string());
        out.extend_from_slice(&self.instance.to_le_bytes());
        put_str(&mut out, &self.host);
        put_str(&mut out, &self.local);
        out
    }
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let mut c = Cursor(b);
        if c.take(4)? != ENGINE_TAG {
            return Err(Error::InvalidArgument("not an engine descriptor".into()));
        }
        let name = c.string()?;
        let addr = c.string()?.parse().map_err(|_| bad())?;
        let instance = c.u64()?;
        let host = c.string()?;
        let local = c.string()?;
        if !c.0.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            name,
            addr,
            instance,
            host,
            local,
        })
    }
}

/// A registered region as another engine names it. Holding it is what lets a peer of the
/// deployment reach the region: the key is random, and the instance ties it to one run of
/// the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryDesc {
    pub engine: String,
    /// The owning engine's instance.
    pub instance: u64,
    pub id: u64,
    pub key: u64,
    pub len: u64,
    pub location: Location,
    /// False: registered read-only (peers may only read it).
    pub writable: bool,
    /// GPU regions exported for CUDA IPC at registration: what a same-host peer needs to map
    /// the region (IPC handle, device, lease slot). Absent: peers use TCP.
    pub ipc: Option<Vec<u8>>,
    /// The region's registrations with its engine's fabric endpoints, one per NIC in the order
    /// of the engine's hello. Empty: no fabric route to it.
    pub fabric: Vec<FabricDesc>,
}

/// How a peer names a region on the fabric: the base its provider addresses it by, and its
/// memory key masked with a value only holders of the deployment secret compute
/// (`fabric::mask`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricDesc {
    pub base: u64,
    pub masked_key: u64,
}

impl MemoryDesc {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = MEMORY_TAG.to_vec();
        put_str(&mut out, &self.engine);
        out.extend_from_slice(&self.instance.to_le_bytes());
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&self.key.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.location.encode().to_le_bytes());
        out.push(u8::from(self.writable));
        match &self.ipc {
            Some(ipc) => {
                out.push(1);
                out.extend_from_slice(&(ipc.len() as u32).to_le_bytes());
                out.extend_from_slice(ipc);
            }
            None => out.push(0),
        }
        out.push(self.fabric.len() as u8);
        for f in &self.fabric {
            out.extend_from_slice(&f.base.to_le_bytes());
            out.extend_from_slice(&f.masked_key.to_le_bytes());
        }
        out
    }
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let mut c = Cursor(b);
        if c.take(4)? != MEMORY_TAG {
            return Err(Error::InvalidArgument("not a memory descriptor".into()));
        }
        let engine = c.string()?;
        let instance = c.u64()?;
        let id = c.u64()?;
        let key = c.u64()?;
        let len = c.u64()?;
        let location = Location::decode(c.u32()? as i32);
        let writable = match c.take(1)?[0] {
            0 => false,
            1 => true,
            _ => return Err(bad()),
        };
        let ipc = match c.take(1)?[0] {
            0 => None,
            1 => {
                let n = c.u32()? as usize;
                if n > 16 << 10 {
                    return Err(bad());
                }
                Some(c.take(n)?.to_vec())
            }
            _ => return Err(bad()),
        };
        let nics = c.take(1)?[0] as usize;
        if nics > MAX_FABRIC_NICS {
            return Err(bad());
        }
        let mut fabric = Vec::with_capacity(nics);
        for _ in 0..nics {
            fabric.push(FabricDesc {
                base: c.u64()?,
                masked_key: c.u64()?,
            });
        }
        if !c.0.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            engine,
            instance,
            id,
            key,
            len,
            location,
            writable,
            ipc,
            fabric,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_reject_garbage() {
        let e = EngineDesc {
            name: "prefill-0".into(),
            addr: "127.0.0.1:4000".parse().unwrap(),
            instance: 99,
            host: "boot|node".into(),
            local: "/run/user/0/mori/io-1.sock".into(),
        };
        assert_eq!(EngineDesc::from_bytes(&e.to_bytes()).unwrap(), e);
        let m = MemoryDesc {
            engine: "decode".into(),
            instance: 5,
            id: 7,
            key: 0x1234_5678_9abc_def0,
            len: 1 << 40,
            location: Location::Cuda(3),
            writable: true,
            ipc: None,
            fabric: Vec::new(),
        };
        assert_eq!(MemoryDesc::from_bytes(&m.to_bytes()).unwrap(), m);
        let h = MemoryDesc {
            location: Location::Host,
            writable: false,
            ..m.clone()
        };
        assert_eq!(MemoryDesc::from_bytes(&h.to_bytes()).unwrap(), h);
        let g = MemoryDesc {
            ipc: Some(b"MIOC-blob".to_vec()),
            fabric: vec![
                FabricDesc {
                    base: 0x7f00_0000_1000,
                    masked_key: 0xfeed_beef_0bad_cafe,
                },
                FabricDesc {
                    base: 0x1000,
                    masked_key: 7,
                },
            ],
            ..m.clone()
        };
        assert_eq!(MemoryDesc::from_bytes(&g.to_bytes()).unwrap(), g);
        let mut trailing = g.to_bytes();
        trailing.push(0);
        assert!(MemoryDesc::from_bytes(&trailing).is_err());
        let full = g.to_bytes();
        assert!(MemoryDesc::from_bytes(&full[..full.len() - 1]).is_err());
        assert!(EngineDesc::from_bytes(b"nope").is_err());
        assert!(MemoryDesc::from_bytes(&m.to_bytes()[..10]).is_err());
        assert!(MemoryDesc::from_bytes(&e.to_bytes()).is_err());
    }
}
