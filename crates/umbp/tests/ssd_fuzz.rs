//! Bounded fuzzing of the SSD log's record decoding, reached the public way: a segment file
//! written by the log is damaged (garbage appended, bytes flipped, a range overwritten, the file
//! cut) and reopened. Recovery must not panic or fail, must keep exactly every key whose whole
//! history lies before the first damaged byte, and must never return a value that was not
//! written for its key (`PROPTEST_CASES` runs more cases).

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;

use mori_umbp::{Error, SsdConfig, SsdIoMode, SsdLog};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    // Each case writes and reopens a log on disk.
    mori_testutil::fuzz_config(300)
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8, Vec<u8>),
    Remove(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6, prop::collection::vec(any::<u8>(), 0..120)).prop_map(|(k, v)| Op::Put(k, v)),
        1 => (0u8..6).prop_map(Op::Remove),
    ]
}

#[derive(Clone, Debug)]
enum Damage {
    Append(Vec<u8>),
    Flip(Vec<(prop::sample::Index, u8)>),
    Overwrite(prop::sample::Index, Vec<u8>),
    Cut(prop::sample::Index),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 1..300).prop_map(Damage::Append),
        prop::collection::vec((any::<prop::sample::Index>(), 1u8..), 1..5).prop_map(Damage::Flip),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(any::<u8>(), 1..64)
        )
            .prop_map(|(at, b)| Damage::Overwrite(at, b)),
        any::<prop::sample::Index>().prop_map(Damage::Cut),
    ]
}

fn key(k: u8) -> Vec<u8> {
    format!("key-{k}").into_bytes()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn recovery_survives_any_damage(ops in prop::collection::vec(op(), 1..16), damage in damage()) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SsdConfig {
            dir: dir.path().to_path_buf(),
            segment_bytes: 1 << 20,
            capacity_bytes: 1 << 30,
            sync_writes: false,
            io: SsdIoMode::Pread,
        };
        // Write, remembering every value each key ever had, its final state, and where its
        // history ends in the file.
        let (mut log, _) = SsdLog::open(cfg.clone()).unwrap();
        let mut history: HashMap<Vec<u8>, Vec<Vec<u8>>> = HashMap::new();
        let mut last: HashMap<Vec<u8>, Option<Vec<u8>>> = HashMap::new();
        let mut ends: HashMap<Vec<u8>, u64> = HashMap::new();
        let segment = log.segment_ids()[0];
        let path = log.segment_path(segment);
        for op in &ops {
            let k = match op {
                // Keys are immutable while live: such a put is refused and changes nothing.
                Op::Put(k, _) if log.contains(&key(*k)) => {
                    prop_assert!(matches!(log.put(&key(*k), b"x"), Err(Error::AlreadyExists)));
                    continue;
                }
                Op::Put(k, v) => {
                    log.put(&key(*k), v).unwrap();
                    history.entry(key(*k)).or_default().push(v.clone());
                    last.insert(key(*k), Some(v.clone()));
                    *k
                }
                Op::Remove(k) => {
                    log.remove(&key(*k)).unwrap();
                    last.insert(key(*k), None);
                    *k
                }
            };
            ends.insert(key(k), fs::metadata(&path).unwrap().len());
        }
        prop_assert_eq!(log.segment_ids(), vec![segment]);
        drop(log);

        let len = fs::metadata(&path).unwrap().len();
        let file = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        let first_damage = match &damage {
            Damage::Append(junk) => {
                file.write_all_at(junk, len).unwrap();
                len
            }
            Damage::Flip(flips) if len > 0 => {
                let mut first = len;
                for (at, x) in flips {
                    let off = at.index(len as usize) as u64;
                    let mut b = [0u8];
                    file.read_exact_at(&mut b, off).unwrap();
                    file.write_all_at(&[b[0] ^ x], off).unwrap();
                    first = first.min(off);
                }
                first
            }
            Damage::Overwrite(at, bytes) if len > 0 => {
                let off = at.index(len as usize) as u64;
                file.write_all_at(bytes, off).unwrap();
                off
            }
            Damage::Cut(at) if len > 0 => {
                let off = at.index(len as usize) as u64;
                file.set_len(off).unwrap();
                off
            }
            _ => len,
        };
        drop(file);

        let (log, report) = SsdLog::open(cfg).unwrap();
        prop_assert!(report.records <= ops.len() as u64);
        for (k, final_state) in &last {
            let got = log.get(k);
            if ends[k] <= first_damage {
                let got = got.ok().flatten();
                prop_assert_eq!(got.as_ref(), final_state.as_ref(), "key {:?}", k);
            } else if let Ok(Some(v)) = got {
                let known = history.get(k).is_some_and(|h| h.contains(&v));
                prop_assert!(known, "key {:?} came back with a value never written", k);
            }
        }
        // Nothing but the keys that were written.
        for k in log.keys() {
            prop_assert!(history.contains_key(&k), "unknown key {:?}", k);
        }
    }
}
