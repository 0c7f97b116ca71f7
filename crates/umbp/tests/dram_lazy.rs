//! The DRAM arena reserves its capacity without using memory: creating a large arena leaves the
//! process's resident set (VmRSS) nearly unchanged; memory is used as values are written.
//! (Its own test binary with one test, so nothing else allocates while the resident set is
//! measured.)

use mori_umbp::{DramArena, LocalPool, PoolConfig};

/// The resident set of this process, in bytes (VmRSS of /proc/self/status).
fn vm_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("VmRSS in kB");
    kib << 10
}

const MIB: u64 = 1 << 20;

#[test]
fn large_dram_tiers_use_memory_only_where_values_are_written() {
    arena();
    embedded_pool();
}

fn arena() {
    let before = vm_rss();
    let mut arena = DramArena::new(2 << 30, 4096).unwrap();
    let reserved = vm_rss();
    assert!(
        reserved.saturating_sub(before) < 32 * MIB,
        "a 2 GiB arena grew the resident set by {} MiB",
        (reserved - before) / MIB
    );

    // 32 values of 1 MiB: the resident set grows by about what was written, no more.
    for i in 0..32u8 {
        arena.put(&[i], &vec![i ^ 0x5a; 1 << 20]).unwrap();
    }
    let written = vm_rss();
    let grown = written.saturating_sub(reserved);
    assert!(
        (24 * MIB..96 * MIB).contains(&grown),
        "writing 32 MiB grew the resident set by {} MiB",
        grown / MIB
    );
    for i in 0..32u8 {
        let v = arena.get(&[i]).unwrap().unwrap();
        assert!(
            v.len() == 1 << 20 && v.iter().all(|&b| b == i ^ 0x5a),
            "value {i}"
        );
    }
    // Unwritten pages read as zeros (the pool relies on nothing else, but the arena says so).
    let (ptr, len) = arena.region();
    assert_eq!(len, 2 << 30);
    // SAFETY: the last byte of the arena's mapping, valid while `arena` lives; no value is
    // stored there (32 MiB were written from the start), so nothing else borrows it.
    assert_eq!(unsafe { *ptr.add(len - 1) }, 0);
    drop(arena);
}

fn embedded_pool() {
    let before = vm_rss();
    let (pool, _) = LocalPool::open(PoolConfig::dram_only(4 << 30, 4096)).unwrap();
    let opened = vm_rss();
    assert!(
        opened.saturating_sub(before) < 32 * MIB,
        "a pool with 4 GiB of DRAM grew the resident set by {} MiB",
        (opened - before) / MIB
    );
    pool.put(b"k", &[7u8; 4096]).unwrap();
    assert_eq!(pool.get(b"k").unwrap().as_deref(), Some(&[7u8; 4096][..]));
    drop(pool);
}
