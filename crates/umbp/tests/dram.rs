//! Tests of the DRAM page arena: a randomized model test, fragmentation and coalescing,
//! accounting, NoSpace and LRU order.

use mori_testutil::Lcg;
use std::collections::HashMap;

use mori_umbp::{DramArena, Error};

fn key(i: u64) -> Vec<u8> {
    format!("blk-{i}").into_bytes()
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 17 + j * 3) as u8).collect()
}

fn pages(len: usize, page: usize) -> usize {
    len.div_ceil(page)
}

fn check(a: &DramArena, model: &HashMap<Vec<u8>, Vec<u8>>) {
    let page = a.page_bytes();
    assert_eq!(a.len(), model.len());
    assert_eq!(a.used_bytes() + a.free_bytes(), a.capacity_bytes());
    let used: usize = model.values().map(|v| pages(v.len(), page) * page).sum();
    assert_eq!(a.used_bytes(), used);
    assert_eq!(a.value_bytes(), model.values().map(Vec::len).sum::<usize>());
    assert!(a.largest_free_bytes() <= a.free_bytes());
    for (k, v) in model {
        assert_eq!(a.get(k).unwrap(), Some(v.as_slice()));
    }
    // No two values overlap.
    let mut runs: Vec<(usize, usize)> = model
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| (a.value_offset(k).unwrap(), pages(v.len(), page) * page))
        .collect();
    runs.sort_unstable();
    for w in runs.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {w:?}");
    }
}

#[test]
fn model_random_ops() {
    for seed in 1..=4 {
        let page = 64;
        let mut a = DramArena::new(64 * page, page).unwrap();
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        let mut rng = Lcg(seed);
        let mut nospace = 0;
        for step in 0..5000 {
            let i = rng.below(40);
            let k = key(i);
            match rng.below(10) {
                0..=3 => {
                    let v = value(rng.next(), rng.below(6 * page as u64) as usize);
                    match a.put(&k, &v) {
                        Ok(()) => {
                            assert!(model.insert(k.clone(), v).is_none(), "step {step}");
                        }
                        Err(Error::AlreadyExists) => assert!(model.contains_key(&k)),
                        Err(Error::NoSpace { needed, available }) => {
                            assert!(!model.contains_key(&k));
                            assert_eq!(needed as usize, pages(v.len(), page) * page);
                            assert_eq!(available as usize, a.largest_free_bytes());
                            assert!(available < needed);
                            nospace += 1;
                        }
                        Err(e) => panic!("step {step}: {e}"),
                    }
                }
                4..=6 => {
                    assert_eq!(a.get(&k).unwrap(), model.get(&k).map(Vec::as_slice));
                    let mut buf = vec![0u8; 6 * page];
                    let n = a.get_into(&k, &mut buf).unwrap();
                    assert_eq!(n, model.get(&k).map(Vec::len));
                    if let Some(n) = n {
                        assert_eq!(&buf[..n], model[&k].as_slice());
                    }
                }
                7 => {
                    assert_eq!(a.get_touch(&k).unwrap(), model.get(&k).map(Vec::as_slice));
                }
                _ => assert_eq!(a.remove(&k), model.remove(&k).is_some()),
            }
            assert_eq!(a.contains(&k), model.contains_key(&k));
            if step % 25 == 0 {
                check(&a, &model);
            }
        }
        check(&a, &model);
        assert!(nospace > 0, "seed {seed}: the arena should fill up");
        let keys: Vec<_> = model.keys().cloned().collect();
        for k in keys {
            assert!(a.remove(&k));
        }
        assert_eq!(a.free_bytes(), a.capacity_bytes());
        assert_eq!(a.free_runs(), 1, "all runs coalesce back into one");
        assert_eq!(a.largest_free_bytes(), a.capacity_bytes());
    }
}

#[test]
fn fragmentation_and_coalescing() {
    let page = 4096;
    let mut a = DramArena::new(16 * page, page).unwrap();
    // Eight 2-page values fill the arena.
    for i in 0..8 {
        a.put(&key(i), &value(i, 2 * page - 1)).unwrap();
    }
    assert_eq!(a.free_bytes(), 0);
    assert!(matches!(
        a.put(b"x", &[1]),
        Err(Error::NoSpace {
            needed: 4096,
            available: 0
        })
    ));
    // Free every other value: 8 free pages in 4 separate runs of 2.
    for i in (0..8).step_by(2) {
        assert!(a.remove(&key(i)));
    }
    assert_eq!(a.free_bytes(), 8 * page);
    assert_eq!(a.free_runs(), 4);
    assert_eq!(a.largest_free_bytes(), 2 * page);
    // Enough free bytes in total, but no contiguous run of 3 pages.
    match a.put(b"big", &vec![7u8; 3 * page]) {
        Err(Error::NoSpace { needed, available }) => {
            assert_eq!(needed, 3 * page as u64);
            assert_eq!(available, 2 * page as u64);
        }
        r => panic!("expected NoSpace, got {r:?}"),
    }
    // Freeing value 1 merges the runs [0,2) [2,4) [4,6) into one of 6 pages.
    assert!(a.remove(&key(1)));
    assert_eq!(a.free_runs(), 3);
    assert_eq!(a.largest_free_bytes(), 6 * page);
    // Freeing value 3 merges [0,6) [6,8) [8,10).
    assert!(a.remove(&key(3)));
    assert_eq!(a.free_runs(), 2);
    assert_eq!(a.largest_free_bytes(), 10 * page);
    // First fit: the big value goes to the start of the arena.
    let big = vec![7u8; 3 * page];
    a.put(b"big", &big).unwrap();
    assert_eq!(a.value_offset(b"big"), Some(0));
    assert_eq!(a.get(b"big").unwrap(), Some(big.as_slice()));
    assert_eq!(a.used_bytes(), 7 * page);
    assert_eq!(a.free_bytes(), 9 * page);
    // Remove everything: one run again.
    for k in [key(5), key(7), b"big".to_vec()] {
        assert!(a.remove(&k));
    }
    assert!(!a.remove(b"big"));
    assert_eq!(a.free_runs(), 1);
    assert_eq!(a.free_bytes(), a.capacity_bytes());
    assert_eq!(a.used_bytes(), 0);
    assert!(a.is_empty());
}

#[test]
fn accounting_and_edge_values() {
    let mut a = DramArena::new(8 * 100, 100).unwrap();
    a.put(b"empty", b"").unwrap();
    assert_eq!(a.get(b"empty").unwrap(), Some(&b""[..]));
    assert_eq!(a.used_bytes(), 0);
    a.put(b"one", &[9u8; 100]).unwrap();
    a.put(b"onemore", &[8u8; 101]).unwrap();
    assert_eq!(a.used_bytes(), 300);
    assert_eq!(a.free_bytes(), 500);
    assert_eq!(a.value_bytes(), 201);
    assert!(matches!(a.put(b"one", b"z"), Err(Error::AlreadyExists)));
    let mut small = [0u8; 50];
    assert!(matches!(
        a.get_into(b"one", &mut small),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(a.get_into(b"nope", &mut small).unwrap(), None);
    assert!(matches!(
        a.put(b"huge", &[0u8; 900]),
        Err(Error::NoSpace { .. })
    ));
    assert_eq!(a.len(), 3);
    assert!(DramArena::new(1000, 300).is_err());
    assert!(DramArena::new(0, 4096).is_err());
    assert!(DramArena::new(4096, 0).is_err());
}

#[test]
fn region_is_aligned_and_holds_values() {
    let page = 4096;
    let mut a = DramArena::new(4 * page, page).unwrap();
    let (ptr, len) = a.region();
    assert_eq!(len, 4 * page);
    assert_eq!(ptr as usize % 4096, 0);
    a.put(b"a", &[1u8; 10]).unwrap();
    a.put(b"b", &[2u8; 10]).unwrap();
    let off = a.value_offset(b"b").unwrap();
    assert_eq!(off, page);
    let v = a.get(b"b").unwrap().unwrap();
    assert_eq!(v.as_ptr() as usize, ptr as usize + off);
}

#[test]
fn lru_order() {
    let mut a = DramArena::new(16 * 64, 64).unwrap();
    for i in 0..5 {
        a.put(&key(i), &value(i, 10)).unwrap();
    }
    assert_eq!(a.lru_victims(2), vec![key(0), key(1)]);
    // contains and get do not count as a use.
    assert!(a.contains(&key(0)));
    assert!(a.get(&key(0)).unwrap().is_some());
    assert_eq!(a.lru_victims(1), vec![key(0)]);
    // touch and get_touch do.
    assert!(a.touch(&key(0)));
    assert!(a.get_touch(&key(1)).unwrap().is_some());
    assert!(!a.touch(b"missing"));
    assert_eq!(
        a.lru_victims(10),
        vec![key(2), key(3), key(4), key(0), key(1)]
    );
    assert!(a.remove(&key(3)));
    assert_eq!(a.lru_victims(2), vec![key(2), key(4)]);
    // Re-putting a removed key makes it the most recent.
    a.put(&key(3), &value(3, 5)).unwrap();
    assert_eq!(a.lru_victims(10).last(), Some(&key(3)));
    assert_eq!(a.lru_victims(0), Vec::<Vec<u8>>::new());
}

/// A pinned run outlives a remove (freed with the last unpin) and is passed over as an
/// eviction victim; reserved runs count as used, become values only when committed, and
/// are freed (or given up) otherwise.
#[test]
fn pins_and_reservations_account_pages() {
    let mut a = DramArena::new(16 * 4096, 4096).unwrap();
    a.put(b"x", &[1; 5000]).unwrap();
    a.put(b"y", &[2; 100]).unwrap();
    let (off, len, t1) = a.pin(b"x").unwrap();
    let (_, _, t2) = a.pin(b"x").unwrap();
    assert_eq!((off, len), (0, 5000));
    assert!(a.is_pinned(b"x") && !a.is_pinned(b"y"));
    assert_eq!(a.lru_unpinned_victim(), Some(b"y".to_vec()));
    assert!(a.remove(b"x"));
    assert!(!a.contains(b"x"));
    assert_eq!(a.used_bytes(), 3 * 4096, "pinned pages stay allocated");
    a.unpin(t1);
    assert_eq!(a.used_bytes(), 3 * 4096);
    a.unpin(t2);
    assert_eq!((a.used_bytes(), a.pinned_runs()), (4096, 0));
    // An empty value pins nothing.
    a.put(b"e", b"").unwrap();
    let (_, _, t) = a.pin(b"e").unwrap();
    assert_eq!(a.pinned_runs(), 0);
    a.unpin(t);

    let r = a.reserve(9000).unwrap();
    assert_eq!((a.used_bytes(), a.reserved_bytes()), (4 * 4096, 3 * 4096));
    a.write_reserved(&r, 0, &[7; 9000]).unwrap();
    assert!(a.write_reserved(&r, 1, &[7; 9000]).is_err());
    let Err((_, r)) = a.commit_reserved(b"y", r) else {
        panic!("y is stored")
    };
    a.commit_reserved(b"z", r).unwrap();
    assert_eq!(a.get(b"z").unwrap(), Some(&[7u8; 9000][..]));
    assert_eq!(a.reserved_bytes(), 0);
    let r = a.reserve(4096).unwrap();
    a.release_reserved(r);
    let r = a.reserve(4096).unwrap();
    a.leak_reserved(r);
    assert_eq!((a.reserved_bytes(), a.leaked_bytes()), (0, 4096));
    assert_eq!(a.used_bytes(), 5 * 4096);
}

/// Every value carries the CRC-32C of its bytes: a byte changed behind the arena's back (here
/// through the raw region pointer, as a stray engine write would) makes every read of that
/// value a corruption error, never the wrong bytes; other values are unaffected. Values an
/// engine lands in a reserved run get their checksum at commit.
#[test]
fn values_are_checksummed_and_a_flipped_byte_is_caught() {
    let page = 4096;
    let mut a = DramArena::new(8 * page, page).unwrap();
    a.put(b"a", &[1u8; 5000]).unwrap();
    a.put(b"b", &[2u8; 100]).unwrap();
    assert_eq!(a.checksum(b"a"), Some(mori_umbp::crc32c(&[1u8; 5000])));
    let r = a.reserve(300).unwrap();
    let at = r.offset(page);
    let (base, _) = a.region();
    // SAFETY: the reserved run lies in the arena and nothing borrows it.
    unsafe { std::ptr::write_bytes(base.cast_mut().add(at), 9, 300) };
    a.commit_reserved(b"r", r).unwrap();
    assert_eq!(a.get(b"r").unwrap(), Some(&[9u8; 300][..]));

    let off = a.value_offset(b"a").unwrap();
    // SAFETY: inside the arena; no borrow of the arena's bytes is alive.
    unsafe { *base.cast_mut().add(off + 4321) ^= 0x20 };
    assert!(matches!(a.get(b"a"), Err(Error::Corrupt { .. })));
    assert!(matches!(a.get_touch(b"a"), Err(Error::Corrupt { .. })));
    let mut out = vec![0u8; 5000];
    assert!(matches!(
        a.get_into(b"a", &mut out),
        Err(Error::Corrupt { .. })
    ));
    assert_eq!(out, vec![0u8; 5000], "nothing copied out");
    assert_eq!(a.get(b"b").unwrap(), Some(&[2u8; 100][..]));
}

/// A value's pages hold the value and zeros: the slack of its last page never keeps bytes of
/// an earlier value (put, reserve and commit all clear it), so exposing whole pages leaks
/// nothing.
#[test]
fn the_slack_of_a_values_last_page_is_zero() {
    let page = 1024;
    let mut a = DramArena::new(4 * page, page).unwrap();
    let (base, _) = a.region();
    let slack = |a: &DramArena, k: &[u8]| {
        let (at, len) = a.locate(k).unwrap();
        let end = len.div_ceil(page) * page;
        // SAFETY: inside the arena; no borrow of these bytes is alive.
        unsafe { std::slice::from_raw_parts(base.add(at + len), end - len) }.to_vec()
    };
    a.put(b"old", &[0xAB; 4 * 1024]).unwrap();
    assert!(a.remove(b"old"));
    a.put(b"new", &[1; 1500]).unwrap();
    assert_eq!(slack(&a, b"new"), vec![0u8; 548]);
    let r = a.reserve(700).unwrap();
    let at = r.offset(page);
    // SAFETY: the reserved run's last page lies in the arena; nothing borrows it.
    let tail = unsafe { std::slice::from_raw_parts(base.add(at + 700), page - 700) };
    assert!(tail.iter().all(|&b| b == 0), "reserve clears the slack");
    // SAFETY: as above; a stray write into the slack while the run is exposed.
    unsafe { std::ptr::write_bytes(base.cast_mut().add(at + 800), 0xEE, 10) };
    a.commit_reserved(b"r", r).unwrap();
    assert_eq!(
        slack(&a, b"r"),
        vec![0u8; page - 700],
        "commit clears it again"
    );
}
