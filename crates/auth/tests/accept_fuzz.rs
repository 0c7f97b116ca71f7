//! Bounded fuzzing of the server side of the handshake: `accept` on arbitrary client bytes
//! never panics and never accepts, and it says nothing beyond its own hello (never "MAOK") to a
//! peer that has not proven the secret (`PROPTEST_CASES` runs more cases).

use std::io::{Read, Write};

use mori_auth::{Secret, accept};
use proptest::prelude::*;

const PURPOSE: &str = "mori.fuzz";

fn config() -> ProptestConfig {
    mori_testutil::fuzz_config(2000)
}

/// A stream whose reads come from fixed bytes and whose writes are recorded.
struct Scripted<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}
impl Read for Scripted<'_> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(b)
    }
}
impl Write for Scripted<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn secret() -> Secret {
    Secret::new(b"a fixed secret for the fuzz tests".to_vec()).unwrap()
}

/// What a client sends: often a well-formed hello (so the proof check is reached), else junk.
fn client_bytes() -> impl Strategy<Value = Vec<u8>> {
    let hello = |purpose: Vec<u8>| {
        let mut h = b"MAUC\x01".to_vec();
        h.push(purpose.len() as u8);
        h.extend(purpose);
        h
    };
    prop_oneof![
        // The right hello, an arbitrary nonce and an arbitrary proof (or less).
        3 => prop::collection::vec(any::<u8>(), 0..80)
            .prop_map(move |rest| [hello(PURPOSE.as_bytes().to_vec()), rest].concat()),
        // Another purpose, or a damaged head.
        1 => (prop::collection::vec(any::<u8>(), 0..70), prop::collection::vec(any::<u8>(), 0..80))
            .prop_map(move |(p, rest)| [hello(p), rest].concat()),
        1 => (any::<prop::sample::Index>(), any::<u8>(), prop::collection::vec(any::<u8>(), 0..80))
            .prop_map(move |(at, x, rest)| {
                let mut b = [hello(PURPOSE.as_bytes().to_vec()), rest].concat();
                let i = at.index(6);
                b[i] ^= x.max(1);
                b
            }),
        1 => prop::collection::vec(any::<u8>(), 0..128),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn accept_never_panics_and_never_accepts(input in client_bytes()) {
        let mut s = Scripted { input: &input, output: Vec::new() };
        let res = accept(&mut s, &secret(), PURPOSE);
        prop_assert!(res.is_err(), "accepted {:?}", input);
        // At most the server's hello (magic, nonce, proof) went out, and never the accept.
        prop_assert!(s.output.is_empty() || (s.output.len() == 68 && s.output.starts_with(b"MAUS")));
        prop_assert!(!s.output.windows(4).any(|w| w == b"MAOK"));
    }
}
