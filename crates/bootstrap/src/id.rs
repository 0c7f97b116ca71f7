//! The 128-byte unique id that tells every rank where the root is and how to prove it belongs.
//!
//! Layout (all integers big-endian):
//!
//! | bytes    | content                                                     |
//! |----------|-------------------------------------------------------------|
//! | 0..6     | magic `b"MORIBS"`                                           |
//! | 6        | format version (1)                                          |
//! | 7        | address family: 4 or 6                                      |
//! | 8..24    | IP address (IPv4 uses the first 4 bytes, rest zero)         |
//! | 24..26   | TCP port                                                    |
//! | 26..30   | IPv6 scope id (zero for IPv4)                               |
//! | 30..46   | random secret: the key of the mori-auth handshake           |
//! | 46..128  | zero padding                                                |
//!
//! The secret never crosses the wire: every connection to the root starts with the mori-auth
//! challenge-response handshake (purpose `"mori.bootstrap"`) keyed by it, in which both sides
//! prove they hold it. Version 1 ids (whose secret clients sent in their hello) are refused.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::error::{Error, Result};

/// Size of a serialized [`UniqueId`] in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Size of the random secret carried by a [`UniqueId`].
pub(crate) const SECRET_BYTES: usize = 16;

/// The raw secret bytes carried by an id.
pub(crate) type RawSecret = [u8; SECRET_BYTES];

const MAGIC: &[u8; 6] = b"MORIBS";
/// 2: the secret is the handshake key (version 1 sent it in the hello).
const VERSION: u8 = 2;
const OFF_FAMILY: usize = 7;
const OFF_ADDR: usize = 8;
const OFF_PORT: usize = 24;
const OFF_SCOPE: usize = 26;
const OFF_SECRET: usize = 30;
const OFF_PADDING: usize = OFF_SECRET + SECRET_BYTES;

/// Opaque rendezvous id: the root's address plus a random secret.
///
/// Created once (by [`crate::create_unique_id`]) and shipped to every rank out of band,
/// for example through `torch.distributed` or an environment variable.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Builds an id for a root listening on `addr` with the given secret.
    pub(crate) fn new(addr: SocketAddr, secret: &RawSecret) -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[..MAGIC.len()].copy_from_slice(MAGIC);
        b[MAGIC.len()] = VERSION;
        match addr {
            SocketAddr::V4(a) => {
                b[OFF_FAMILY] = 4;
                b[OFF_ADDR..OFF_ADDR + 4].copy_from_slice(&a.ip().octets());
            }
            SocketAddr::V6(a) => {
                b[OFF_FAMILY] = 6;
                b[OFF_ADDR..OFF_ADDR + 16].copy_from_slice(&a.ip().octets());
                b[OFF_SCOPE..OFF_SCOPE + 4].copy_from_slice(&a.scope_id().to_be_bytes());
            }
        }
        b[OFF_PORT..OFF_PORT + 2].copy_from_slice(&addr.port().to_be_bytes());
        b[OFF_SECRET..OFF_PADDING].copy_from_slice(secret);
        UniqueId(b)
    }

    /// The raw 128 bytes, suitable for sending to other ranks.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Parses bytes produced by [`UniqueId::as_bytes`].
    ///
    /// Fails with [`Error::InvalidId`] on a wrong length, magic, version, address family,
    /// or non-zero padding.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bytes: [u8; UNIQUE_ID_BYTES] = b.try_into().map_err(|_| {
            Error::InvalidId(format!("expected {UNIQUE_ID_BYTES} bytes, got {}", b.len()))
        })?;
        if &bytes[..MAGIC.len()] != MAGIC {
            return Err(Error::InvalidId(
                "wrong magic (these bytes are not a mori bootstrap id)".into(),
            ));
        }
        if bytes[MAGIC.len()] != VERSION {
            return Err(Error::InvalidId(format!(
                "unsupported format version {} (this build understands {VERSION}; every rank \
                 needs the mori build of the process that created the id)",
                bytes[MAGIC.len()]
            )));
        }
        let addr_zero_tail = match bytes[OFF_FAMILY] {
            4 => &bytes[OFF_ADDR + 4..OFF_PORT],
            6 => &[][..],
            f => return Err(Error::InvalidId(format!("unknown address family {f}"))),
        };
        let scope_zero = bytes[OFF_FAMILY] == 6 || bytes[OFF_SCOPE..OFF_SECRET] == [0; 4];
        if addr_zero_tail.iter().any(|&x| x != 0)
            || !scope_zero
            || bytes[OFF_PADDING..].iter().any(|&x| x != 0)
        {
            return Err(Error::InvalidId("non-zero bytes in reserved fields".into()));
        }
        Ok(UniqueId(bytes))
    }

    /// The address of the root (rendezvous server).
    pub fn root_addr(&self) -> SocketAddr {
        let b = &self.0;
        let port = u16::from_be_bytes([b[OFF_PORT], b[OFF_PORT + 1]]);
        if b[OFF_FAMILY] == 4 {
            let ip = Ipv4Addr::new(
                b[OFF_ADDR],
                b[OFF_ADDR + 1],
                b[OFF_ADDR + 2],
                b[OFF_ADDR + 3],
            );
            SocketAddr::V4(SocketAddrV4::new(ip, port))
        } else {
            let mut octets = [0u8; 16];
            octets.copy_from_slice(&b[OFF_ADDR..OFF_ADDR + 16]);
            let mut scope = [0u8; 4];
            scope.copy_from_slice(&b[OFF_SCOPE..OFF_SECRET]);
            let ip = Ipv6Addr::from(octets);
            SocketAddr::V6(SocketAddrV6::new(ip, port, 0, u32::from_be_bytes(scope)))
        }
    }

    /// The raw secret bytes.
    pub(crate) fn raw_secret(&self) -> RawSecret {
        let mut s = [0u8; SECRET_BYTES];
        s.copy_from_slice(&self.0[OFF_SECRET..OFF_PADDING]);
        s
    }

    /// The key both ends of every bootstrap connection prove they hold.
    pub(crate) fn secret(&self) -> Result<mori_auth::Secret> {
        auth_secret(&self.raw_secret())
    }
}

impl fmt::Debug for UniqueId {
    /// Shows only the root address; the secret stays out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UniqueId")
            .field("root", &self.root_addr())
            .finish_non_exhaustive()
    }
}

/// The handshake key made of an id's secret bytes.
pub(crate) fn auth_secret(raw: &RawSecret) -> Result<mori_auth::Secret> {
    mori_auth::Secret::new(raw.to_vec())
        .map_err(|e| Error::InvalidId(format!("the id's secret is unusable: {e}")))
}

/// Returns a fresh random secret.
pub(crate) fn random_secret() -> Result<RawSecret> {
    let mut s = [0u8; SECRET_BYTES];
    getrandom::fill(&mut s).map_err(|e| {
        Error::io(
            "drawing the random bootstrap secret",
            std::io::Error::other(e.to_string()),
        )
    })?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_v4_and_v6() {
        let secret = [7u8; SECRET_BYTES];
        for addr in ["127.0.0.1:4242", "[fe80::1%3]:80", "[::1]:65535"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let id = UniqueId::new(addr, &secret);
            let back = UniqueId::from_bytes(id.as_bytes()).unwrap();
            assert_eq!(back, id);
            assert_eq!(back.root_addr(), addr);
            assert_eq!(back.raw_secret(), secret);
        }
    }

    #[test]
    fn debug_hides_secret() {
        let id = UniqueId::new("10.1.2.3:99".parse().unwrap(), &[0xab; SECRET_BYTES]);
        let s = format!("{id:?}");
        assert!(s.contains("10.1.2.3:99"), "{s}");
        assert!(
            !s.contains("171") && !s.to_lowercase().contains("ab, "),
            "{s}"
        );
    }

    #[test]
    fn rejects_bad_fields() {
        let id = UniqueId::new("127.0.0.1:1".parse().unwrap(), &[1; SECRET_BYTES]);
        let mut b = *id.as_bytes();
        b[6] = 99;
        assert!(matches!(UniqueId::from_bytes(&b), Err(Error::InvalidId(_))));
        // A version 1 id (its secret was sent in the clear) is refused, not misread.
        b[6] = 1;
        assert!(matches!(UniqueId::from_bytes(&b), Err(Error::InvalidId(_))));
        let mut b = *id.as_bytes();
        b[OFF_FAMILY] = 5;
        assert!(matches!(UniqueId::from_bytes(&b), Err(Error::InvalidId(_))));
        let mut b = *id.as_bytes();
        b[UNIQUE_ID_BYTES - 1] = 1;
        assert!(matches!(UniqueId::from_bytes(&b), Err(Error::InvalidId(_))));
    }
}
