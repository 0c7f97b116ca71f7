//! Master metadata: where every key lives.
//!
//! The master of a UMBP pool keeps one [`Location`] per key: the peer holding the bytes, the
//! tier they are in and the value length. The index sits behind the [`MetadataStore`] trait so
//! that the in-memory [`MemoryStore`] (the default, embedded in the client process or in the
//! daemon) and the Redis backend (`crate::meta_redis::RedisStore`, feature `redis`) are
//! interchangeable. Every backend must pass
//! `conformance::conformance_suite` (compiled for this crate's tests and with the
//! `conformance` feature).
//!
//! Keys are immutable: [`MetadataStore::insert_if_absent`] never overwrites, so when several
//! clients put the same key at once, the first insert wins and the others see "already
//! exists".

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::error::Result;

/// A storage tier of a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Host memory (the peer's [`crate::DramArena`]).
    Dram,
    /// The peer's SSD log ([`crate::SsdLog`]).
    Ssd,
    /// Device memory (the embedded pool's [`crate::GpuArena`], feature `gpu`).
    Gpu,
}

/// Where the value of a key lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// Id of the peer holding the bytes.
    pub peer: u64,
    /// The fastest tier of that peer holding the bytes.
    pub tier: Tier,
    /// Value length in bytes.
    pub len: u64,
}

/// The master's key → [`Location`] index. Implementations are shared between threads and do
/// their own locking; every method is atomic on its own (there are no multi-call
/// transactions). `conformance::conformance_suite` (feature `conformance`) checks the full
/// contract.
pub trait MetadataStore: Send + Sync {
    /// Inserts `key -> loc` unless `key` is present; `Ok(false)` if the key already exists
    /// (the first put wins; the stored location is left unchanged).
    fn insert_if_absent(&self, key: &[u8], loc: Location) -> Result<bool>;
    /// The location of `key`.
    fn get(&self, key: &[u8]) -> Result<Option<Location>>;
    /// The locations of `keys`, in the same order (duplicates and misses allowed).
    fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Location>>>;
    /// Compare-and-set on the tier: if `key` exists with tier `from`, sets its tier to `to`
    /// and returns `Ok(true)`; otherwise (missing key, other tier) changes nothing and returns
    /// `Ok(false)`. Peer and length are never changed.
    fn update_tier(&self, key: &[u8], from: Tier, to: Tier) -> Result<bool>;
    /// Removes `key`, returning its location if it was present.
    fn remove(&self, key: &[u8]) -> Result<Option<Location>>;
    /// Removes every key held by `peer` (a dead peer's keys become misses); returns how many.
    fn remove_peer(&self, peer: u64) -> Result<usize>;
    /// Number of keys.
    fn len(&self) -> Result<usize>;
    /// Whether there are no keys.
    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

/// Number of shards of a [`MemoryStore`].
pub const MEMORY_STORE_SHARDS: usize = 16;

type Shard = HashMap<Vec<u8>, Location>;

/// In-memory [`MetadataStore`]: [`MEMORY_STORE_SHARDS`] hash maps, each behind its own
/// `RwLock`, selected by a hash of the key. Lookups take read locks only, so concurrent and
/// batched lookups do not serialise; [`MetadataStore::batch_get`] takes each shard's lock
/// once per batch. Never returns an error (a poisoned lock is recovered: every mutation is a
/// single map operation, so no shard can be left half-updated).
pub struct MemoryStore {
    shards: Vec<RwLock<Shard>>,
    hasher: RandomState,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: usize = (0..self.shards.len()).map(|i| self.read(i).len()).sum();
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("keys", &keys)
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore {
            shards: (0..MEMORY_STORE_SHARDS)
                .map(|_| RwLock::new(HashMap::new()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        // The top bits, so the choice is independent of the bucket bits the maps use.
        (self.hasher.hash_one(key) >> 32) as usize % self.shards.len()
    }

    fn read(&self, i: usize) -> RwLockReadGuard<'_, Shard> {
        self.shards[i]
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, i: usize) -> RwLockWriteGuard<'_, Shard> {
        self.shards[i]
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl MetadataStore for MemoryStore {
    fn insert_if_absent(&self, key: &[u8], loc: Location) -> Result<bool> {
        let mut shard = self.write(self.shard_of(key));
        if shard.contains_key(key) {
            return Ok(false);
        }
        shard.insert(key.to_vec(), loc);
        Ok(true)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Location>> {
        Ok(self.read(self.shard_of(key)).get(key).cloned())
    }

    fn batch_get(&self, keys: &[&[u8]]) -> Result<Vec<Option<Location>>> {
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for (i, k) in keys.iter().enumerate() {
            by_shard[self.shard_of(k)].push(i);
        }
        let mut out = vec![None; keys.len()];
        for (s, idxs) in by_shard.iter().enumerate() {
            if idxs.is_empty() {
                continue;
            }
            let shard = self.read(s);
            for &i in idxs {
                out[i] = shard.get(keys[i]).cloned();
            }
        }
        Ok(out)
    }

    fn update_tier(&self, key: &[u8], from: Tier, to: Tier) -> Result<bool> {
        let mut shard = self.write(self.shard_of(key));
        match shard.get_mut(key) {
            Some(loc) if loc.tier == from => {
                loc.tier = to;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn remove(&self, key: &[u8]) -> Result<Option<Location>> {
        Ok(self.write(self.shard_of(key)).remove(key))
    }

    fn remove_peer(&self, peer: u64) -> Result<usize> {
        let mut removed = 0;
        for s in 0..self.shards.len() {
            let mut shard = self.write(s);
            let before = shard.len();
            shard.retain(|_, loc| loc.peer != peer);
            removed += before - shard.len();
        }
        Ok(removed)
    }

    fn len(&self) -> Result<usize> {
        Ok((0..self.shards.len()).map(|s| self.read(s).len()).sum())
    }
}

/// The contract every [`MetadataStore`] backend must meet, as a reusable test.
#[cfg(any(test, feature = "conformance"))]
pub mod conformance {
    use std::collections::HashSet;
    use std::fmt::Debug;
    use std::sync::Barrier;

    use super::{Location, MetadataStore, Tier};
    use crate::error::Result;

    /// Keys written by the suite all start with this prefix.
    pub const KEY_PREFIX: &[u8] = b"umbp-conformance/";

    fn ok<T>(r: Result<T>, what: &str) -> T {
        match r {
            Ok(v) => v,
            Err(e) => panic!("{what}: unexpected error: {e}"),
        }
    }

    fn eq<T: PartialEq + Debug>(got: T, want: T, what: &str) {
        assert!(got == want, "{what}: got {got:?}, want {want:?}");
    }

    fn key(name: &str) -> Vec<u8> {
        let mut k = KEY_PREFIX.to_vec();
        k.extend_from_slice(name.as_bytes());
        k
    }

    fn loc(peer: u64, tier: Tier, len: u64) -> Location {
        Location { peer, tier, len }
    }

    /// Every tier in turn (and not in step with the other patterns of `i` the tests use).
    fn tier_of(i: u64) -> Tier {
        [Tier::Dram, Tier::Ssd, Tier::Gpu][(i / 3 % 3) as usize]
    }

    /// Checks every method's contract on `store`, which must be empty on entry (a Redis
    /// backend should be given a fresh namespace); it is empty again when the suite returns.
    /// Panics with a description of the first violation. Includes races: several threads
    /// calling `insert_if_absent` on the same keys (exactly one wins per key) and `remove` on
    /// the same keys (exactly one gets the location per key).
    pub fn conformance_suite(store: &dyn MetadataStore) {
        eq(
            ok(store.len(), "len"),
            0,
            "the store must be empty on entry",
        );
        empty_store(store);
        insert_and_get(store);
        binary_keys(store);
        batch_get(store);
        update_tier(store);
        remove(store);
        remove_peer(store);
        race_insert(store);
        race_remove(store);
        eq(ok(store.len(), "len"), 0, "len at the end of the suite");
        eq(
            ok(store.is_empty(), "is_empty"),
            true,
            "is_empty at the end of the suite",
        );
    }

    fn empty_store(store: &dyn MetadataStore) {
        let k = key("missing");
        eq(ok(store.get(&k), "get"), None, "get on an empty store");
        eq(
            ok(store.remove(&k), "remove"),
            None,
            "remove on an empty store",
        );
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Ssd), "update_tier"),
            false,
            "update_tier of a missing key",
        );
        eq(
            ok(store.remove_peer(1), "remove_peer"),
            0,
            "remove_peer on an empty store",
        );
        eq(
            ok(store.batch_get(&[]), "batch_get"),
            vec![],
            "batch_get of no keys",
        );
        eq(
            ok(store.batch_get(&[&k, &k]), "batch_get"),
            vec![None, None],
            "batch_get of missing keys",
        );
        eq(
            ok(store.get(&k), "get"),
            None,
            "a miss must not create the key",
        );
        eq(ok(store.len(), "len"), 0, "len after misses");
    }

    fn insert_and_get(store: &dyn MetadataStore) {
        let k = key("first-wins");
        let first = loc(1, Tier::Dram, 100);
        eq(
            ok(store.insert_if_absent(&k, first.clone()), "insert"),
            true,
            "first insert",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(first.clone()),
            "get after insert",
        );
        eq(ok(store.len(), "len"), 1, "len after one insert");
        eq(
            ok(store.is_empty(), "is_empty"),
            false,
            "is_empty with one key",
        );
        let second = loc(2, Tier::Ssd, 200);
        eq(
            ok(store.insert_if_absent(&k, second.clone()), "insert"),
            false,
            "second insert",
        );
        eq(
            ok(store.insert_if_absent(&k, first.clone()), "insert"),
            false,
            "same location again",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(first.clone()),
            "the first insert must win",
        );
        eq(ok(store.len(), "len"), 1, "len after a refused insert");
        eq(
            ok(store.remove(&k), "remove"),
            Some(first),
            "remove returns the location",
        );
        eq(ok(store.len(), "len"), 0, "len after remove");
        // A removed key can be inserted again, with a new location.
        eq(
            ok(store.insert_if_absent(&k, second.clone()), "insert"),
            true,
            "insert after remove",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(second.clone()),
            "get after reinsert",
        );
        eq(
            ok(store.remove(&k), "remove"),
            Some(second),
            "remove after reinsert",
        );
    }

    fn binary_keys(store: &dyn MetadataStore) {
        // Prefixes, NUL and high bytes, the empty suffix and a long key are all distinct keys.
        let mut long = key("long/");
        long.extend((0..4096u32).map(|i| (i * 7 + 3) as u8));
        let keys: Vec<Vec<u8>> = vec![
            key(""),
            key("a"),
            key("a\0"),
            key("a\0b"),
            [key("a"), vec![0xff, 0x00, 0x80]].concat(),
            long,
        ];
        for (i, k) in keys.iter().enumerate() {
            let l = loc(i as u64, Tier::Dram, i as u64 * 10);
            eq(
                ok(store.insert_if_absent(k, l), "insert"),
                true,
                "insert of a binary key",
            );
        }
        eq(ok(store.len(), "len"), keys.len(), "len after binary keys");
        for (i, k) in keys.iter().enumerate() {
            let got = ok(store.get(k), "get");
            eq(
                got,
                Some(loc(i as u64, Tier::Dram, i as u64 * 10)),
                "binary key lookup",
            );
        }
        for (i, k) in keys.iter().enumerate() {
            let got = ok(store.remove(k), "remove");
            eq(
                got,
                Some(loc(i as u64, Tier::Dram, i as u64 * 10)),
                "binary key removal",
            );
        }
        eq(ok(store.len(), "len"), 0, "len after removing binary keys");
    }

    fn batch_get(store: &dyn MetadataStore) {
        let n = 300u64;
        let keys: Vec<Vec<u8>> = (0..n).map(|i| key(&format!("batch/{i}"))).collect();
        for (i, k) in keys
            .iter()
            .enumerate()
            .filter(|(i, _)| !i.is_multiple_of(3))
        {
            ok(
                store.insert_if_absent(k, loc(i as u64 % 5, tier_of(i as u64), i as u64)),
                "insert",
            );
        }
        let expect = |i: usize| {
            (!i.is_multiple_of(3)).then(|| loc(i as u64 % 5, tier_of(i as u64), i as u64))
        };
        // Reverse order, with duplicates and misses interleaved.
        let mut order: Vec<usize> = (0..n as usize).rev().collect();
        order.extend([7, 7, 0, 299, 0]);
        let refs: Vec<&[u8]> = order.iter().map(|&i| keys[i].as_slice()).collect();
        let got = ok(store.batch_get(&refs), "batch_get");
        eq(got.len(), order.len(), "batch_get result length");
        for (j, &i) in order.iter().enumerate() {
            eq(got[j].clone(), expect(i), "batch_get entry");
            eq(
                ok(store.get(&keys[i]), "get"),
                expect(i),
                "get agrees with batch_get",
            );
        }
        for (i, k) in keys.iter().enumerate() {
            eq(
                ok(store.remove(k), "remove"),
                expect(i),
                "remove after batch_get",
            );
        }
    }

    fn update_tier(store: &dyn MetadataStore) {
        let k = key("tier");
        eq(
            ok(store.insert_if_absent(&k, loc(3, Tier::Dram, 64)), "insert"),
            true,
            "insert",
        );
        eq(
            ok(store.update_tier(&k, Tier::Ssd, Tier::Dram), "update_tier"),
            false,
            "update_tier with the wrong `from`",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(loc(3, Tier::Dram, 64)),
            "after a failed CAS",
        );
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Ssd), "update_tier"),
            true,
            "update_tier with the right `from`",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(loc(3, Tier::Ssd, 64)),
            "after a CAS",
        );
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Ssd), "update_tier"),
            false,
            "the same CAS again",
        );
        eq(
            ok(store.update_tier(&k, Tier::Ssd, Tier::Ssd), "update_tier"),
            true,
            "a CAS to the same tier succeeds when `from` matches",
        );
        eq(
            ok(store.update_tier(&k, Tier::Ssd, Tier::Dram), "update_tier"),
            true,
            "CAS back",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(loc(3, Tier::Dram, 64)),
            "after CAS back",
        );
        // The GPU tier round-trips like the others (a value demoted GPU -> DRAM).
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Gpu), "update_tier"),
            true,
            "CAS to the GPU tier",
        );
        eq(
            ok(store.get(&k), "get"),
            Some(loc(3, Tier::Gpu, 64)),
            "after a CAS to the GPU tier",
        );
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Ssd), "update_tier"),
            false,
            "a CAS from DRAM of a GPU location",
        );
        eq(
            ok(store.update_tier(&k, Tier::Gpu, Tier::Dram), "update_tier"),
            true,
            "CAS from the GPU tier",
        );
        eq(ok(store.len(), "len"), 1, "update_tier does not add keys");
        ok(store.remove(&k), "remove");
        eq(
            ok(store.update_tier(&k, Tier::Dram, Tier::Ssd), "update_tier"),
            false,
            "update_tier of a removed key",
        );
        eq(
            ok(store.get(&k), "get"),
            None,
            "update_tier must not create the key",
        );
    }

    fn remove(store: &dyn MetadataStore) {
        let a = key("rm/a");
        let b = key("rm/b");
        ok(store.insert_if_absent(&a, loc(1, Tier::Dram, 1)), "insert");
        ok(store.insert_if_absent(&b, loc(1, Tier::Ssd, 2)), "insert");
        eq(
            ok(store.remove(&a), "remove"),
            Some(loc(1, Tier::Dram, 1)),
            "remove a",
        );
        eq(ok(store.remove(&a), "remove"), None, "remove a twice");
        eq(ok(store.get(&a), "get"), None, "get a after remove");
        eq(
            ok(store.get(&b), "get"),
            Some(loc(1, Tier::Ssd, 2)),
            "b is untouched",
        );
        eq(ok(store.len(), "len"), 1, "len after one remove");
        eq(
            ok(store.remove(&b), "remove"),
            Some(loc(1, Tier::Ssd, 2)),
            "remove b",
        );
        eq(ok(store.len(), "len"), 0, "len after removes");
    }

    fn remove_peer(store: &dyn MetadataStore) {
        let n = 200u64;
        let peer_of = |i: u64| 7 + i % 3; // peers 7, 8, 9
        let keys: Vec<Vec<u8>> = (0..n).map(|i| key(&format!("peer/{i}"))).collect();
        for (i, k) in keys.iter().enumerate() {
            let i = i as u64;
            ok(
                store.insert_if_absent(k, loc(peer_of(i), tier_of(i), i)),
                "insert",
            );
        }
        let of_8 = (0..n).filter(|&i| peer_of(i) == 8).count();
        eq(
            ok(store.remove_peer(8), "remove_peer"),
            of_8,
            "remove_peer count",
        );
        eq(
            ok(store.remove_peer(8), "remove_peer"),
            0,
            "remove_peer twice",
        );
        eq(
            ok(store.remove_peer(1234), "remove_peer"),
            0,
            "remove_peer of an unknown peer",
        );
        eq(
            ok(store.len(), "len"),
            n as usize - of_8,
            "len after remove_peer",
        );
        for (i, k) in keys.iter().enumerate() {
            let i = i as u64;
            let got = ok(store.get(k), "get");
            if peer_of(i) == 8 {
                eq(got, None, "a removed peer's key is a miss");
                // and can be inserted again (for another peer)
                eq(
                    ok(store.insert_if_absent(k, loc(10, Tier::Dram, i)), "insert"),
                    true,
                    "reinsert after remove_peer",
                );
            } else {
                eq(
                    got.map(|l| l.peer),
                    Some(peer_of(i)),
                    "other peers' keys stay",
                );
            }
        }
        for p in [7, 9, 10] {
            ok(store.remove_peer(p), "remove_peer");
        }
        eq(ok(store.len(), "len"), 0, "len after removing every peer");
    }

    const RACE_THREADS: u64 = 4;
    const RACE_KEYS: u64 = 500;

    fn race_insert(store: &dyn MetadataStore) {
        let keys: Vec<Vec<u8>> = (0..RACE_KEYS).map(|i| key(&format!("race/{i}"))).collect();
        let barrier = Barrier::new(RACE_THREADS as usize);
        let wins: Vec<HashSet<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..RACE_THREADS)
                .map(|t| {
                    let (keys, barrier) = (&keys, &barrier);
                    s.spawn(move || {
                        let mut won = HashSet::new();
                        barrier.wait();
                        // Half the threads go forwards, half backwards, to meet in the middle.
                        let order: Vec<usize> = if t % 2 == 0 {
                            (0..keys.len()).collect()
                        } else {
                            (0..keys.len()).rev().collect()
                        };
                        for i in order {
                            let l = loc(100 + t, Tier::Dram, i as u64);
                            if ok(store.insert_if_absent(&keys[i], l), "racing insert") {
                                won.insert(i);
                            }
                        }
                        won
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(w) => w,
                    Err(_) => panic!("a racing insert thread panicked"),
                })
                .collect()
        });
        for (i, k) in keys.iter().enumerate() {
            let winners: Vec<u64> = (0..RACE_THREADS)
                .filter(|&t| wins[t as usize].contains(&i))
                .collect();
            assert!(
                winners.len() == 1,
                "key {i}: winners {winners:?}, want exactly one"
            );
            let want = loc(100 + winners[0], Tier::Dram, i as u64);
            eq(
                ok(store.get(k), "get"),
                Some(want),
                "the winner's location is stored",
            );
        }
        eq(
            ok(store.len(), "len"),
            RACE_KEYS as usize,
            "len after the race",
        );
    }

    fn race_remove(store: &dyn MetadataStore) {
        // Continues from race_insert: every race key is present.
        let keys: Vec<Vec<u8>> = (0..RACE_KEYS).map(|i| key(&format!("race/{i}"))).collect();
        let barrier = Barrier::new(RACE_THREADS as usize);
        let got: Vec<HashSet<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..RACE_THREADS)
                .map(|_| {
                    let (keys, barrier) = (&keys, &barrier);
                    s.spawn(move || {
                        let mut mine = HashSet::new();
                        barrier.wait();
                        for (i, k) in keys.iter().enumerate() {
                            if ok(store.remove(k), "racing remove").is_some() {
                                mine.insert(i);
                            }
                        }
                        mine
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(w) => w,
                    Err(_) => panic!("a racing remove thread panicked"),
                })
                .collect()
        });
        for i in 0..RACE_KEYS as usize {
            let n = got.iter().filter(|g| g.contains(&i)).count();
            eq(n, 1, "threads that removed one key");
        }
        eq(ok(store.len(), "len"), 0, "len after the remove race");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_store_conformance() {
        conformance::conformance_suite(&MemoryStore::new());
    }

    #[test]
    fn memory_store_conformance_is_repeatable_on_one_store() {
        let s = MemoryStore::default();
        conformance::conformance_suite(&s);
        conformance::conformance_suite(&s);
    }

    #[test]
    fn keys_spread_over_shards() {
        let s = MemoryStore::new();
        let mut used = [false; MEMORY_STORE_SHARDS];
        for i in 0..1000u32 {
            used[s.shard_of(&i.to_le_bytes())] = true;
        }
        assert!(used.iter().all(|&u| u), "some shard never chosen: {used:?}");
    }

    #[test]
    fn store_is_object_safe_and_shareable() {
        fn assert_send_sync<T: Send + Sync + ?Sized>() {}
        assert_send_sync::<dyn MetadataStore>();
        assert_send_sync::<MemoryStore>();
        let s: std::sync::Arc<dyn MetadataStore> = std::sync::Arc::new(MemoryStore::new());
        let loc = Location {
            peer: 0,
            tier: Tier::Ssd,
            len: 3,
        };
        assert!(matches!(s.insert_if_absent(b"k", loc.clone()), Ok(true)));
        assert!(matches!(s.get(b"k"), Ok(Some(l)) if l == loc));
    }
}
