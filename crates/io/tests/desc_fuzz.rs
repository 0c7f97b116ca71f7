//! Bounded fuzzing of the out-of-band descriptors: `EngineDesc::from_bytes` and
//! `MemoryDesc::from_bytes` never panic on arbitrary bytes, refuse damaged encodings, and read
//! back every valid value exactly (`PROPTEST_CASES` runs more cases).

use std::net::{SocketAddr, SocketAddrV6};

use mori_io::{EngineDesc, FabricDesc, Location, MemoryDesc};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    mori_testutil::fuzz_config(2000)
}

fn addr() -> impl Strategy<Value = SocketAddr> {
    prop_oneof![
        (any::<[u8; 4]>(), any::<u16>()).prop_map(SocketAddr::from),
        // The text form keeps the scope id but not the flow label.
        (any::<[u8; 16]>(), any::<u16>(), any::<u32>())
            .prop_map(|(ip, port, scope)| SocketAddrV6::new(ip.into(), port, 0, scope).into()),
    ]
}

/// Names up to the descriptor limit (4096 bytes) in UTF-8, mostly short.
fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => prop::collection::vec(any::<char>(), 0..24).prop_map(String::from_iter),
        1 => prop::collection::vec(b'a'..=b'z', 4000..=4096)
            .prop_map(|b| String::from_utf8(b).unwrap_or_default()),
    ]
}

fn engine() -> impl Strategy<Value = EngineDesc> {
    (name(), addr(), any::<u64>(), name(), name()).prop_map(
        |(name, addr, instance, host, local)| EngineDesc {
            name,
            addr,
            instance,
            host,
            local,
        },
    )
}

fn memory() -> impl Strategy<Value = MemoryDesc> {
    let location = prop_oneof![
        Just(Location::Host),
        (0..=i32::MAX as u32).prop_map(Location::Cuda)
    ];
    let ipc = prop::option::of(prop::collection::vec(any::<u8>(), 0..300));
    let fabric = prop::collection::vec(
        (any::<u64>(), any::<u64>()).prop_map(|(base, masked_key)| FabricDesc { base, masked_key }),
        0..4,
    );
    (
        name(),
        (any::<u64>(), any::<u64>(), any::<u64>()),
        any::<u64>(),
        location,
        any::<bool>(),
        (ipc, fabric),
    )
        .prop_map(
            |(engine, (instance, id, key), len, location, writable, (ipc, fabric))| MemoryDesc {
                engine,
                instance,
                id,
                key,
                len,
                location,
                writable,
                ipc,
                fabric,
            },
        )
}

/// Arbitrary bytes, often behind one of the two tags.
fn bytes() -> impl Strategy<Value = Vec<u8>> {
    let tail = prop::collection::vec(
        prop_oneof![any::<u8>(), Just(0u8), Just(0xff), Just(0x10)],
        0..128,
    );
    (prop::sample::select(vec![&b"MIE2"[..], b"MIM4", b""]), tail)
        .prop_map(|(tag, tail)| [tag, &tail[..]].concat())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn decoders_never_panic(b in bytes()) {
        if let Ok(e) = EngineDesc::from_bytes(&b) {
            prop_assert!(e.name.len() + e.host.len() <= b.len());
        }
        if let Ok(m) = MemoryDesc::from_bytes(&b) {
            prop_assert!(m.engine.len() <= b.len());
        }
    }

    #[test]
    fn engine_descriptors_round_trip(e in engine(), cut in any::<prop::sample::Index>()) {
        let b = e.to_bytes();
        prop_assert_eq!(EngineDesc::from_bytes(&b).unwrap(), e);
        prop_assert!(EngineDesc::from_bytes(&b[..cut.index(b.len())]).is_err());
        prop_assert!(MemoryDesc::from_bytes(&b).is_err());
    }

    #[test]
    fn memory_descriptors_round_trip(m in memory(), cut in any::<prop::sample::Index>()) {
        let b = m.to_bytes();
        prop_assert_eq!(MemoryDesc::from_bytes(&b).unwrap(), m.clone());
        // Every field is present (an absent one as a flag byte): any prefix fails.
        let short = &b[..cut.index(b.len())];
        prop_assert!(MemoryDesc::from_bytes(short).is_err());
        let mut long = b.clone();
        long.push(0);
        prop_assert!(MemoryDesc::from_bytes(&long).is_err());
        prop_assert!(EngineDesc::from_bytes(&b).is_err());
    }
}
