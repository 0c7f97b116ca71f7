//! Two libfabric endpoints of this process over loopback (`tcp;ofi_rxm`, the software provider
//! that runs the same RMA calls as verbs/efa over TCP): random writes and reads, byte-exact,
//! with unaligned offsets and sizes from 1 byte to 4 MiB; ranges outside a region refused
//! before posting; a forged key fails its completion with the target's bytes untouched; a
//! local-only region refuses another process holding its key.
//!
//! Skips (printing why) where libfabric or the provider is missing, unless
//! `MORI_REQUIRE_LIBFABRIC=1` (scripts/test.sh installs it and sets that).

use std::time::{Duration, Instant};

use mori_net::Error;
use mori_net::fabric::{Completion, Endpoint, Posted, Region, RemoteRegion, Rma, providers};
use mori_testutil::{Lcg, random_seed};

const PROVIDER: &str = "tcp;ofi_rxm";

/// Both endpoints, or None (after printing why) where the fabric is unavailable.
fn pair() -> Option<(Endpoint, Endpoint)> {
    let open = || Endpoint::open(PROVIDER, Some("127.0.0.1"), None, false);
    match (open(), open()) {
        (Ok(a), Ok(b)) => Some((a, b)),
        (Err(e), _) | (_, Err(e)) => {
            if std::env::var("MORI_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1") {
                panic!("MORI_REQUIRE_LIBFABRIC=1 but: {e}");
            }
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Polls both endpoints until `id` completes on `a` (the target needs progress too).
fn wait(a: &Endpoint, b: &Endpoint, id: u64) -> Completion {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = Vec::new();
    loop {
        a.poll(&mut done).expect("poll");
        b.poll(&mut Vec::new()).expect("poll the target");
        if let Some(i) = done.iter().position(|c| c.id == id) {
            return done.swap_remove(i);
        }
        assert!(Instant::now() < deadline, "operation {id} did not complete");
    }
}

fn post_retrying(a: &Endpoint, b: &Endpoint, mut post: impl FnMut(&Endpoint) -> Posted) -> u64 {
    loop {
        match post(a) {
            Posted::Id(id) => return id,
            Posted::WouldBlock => {
                a.poll(&mut Vec::new()).expect("poll");
                b.poll(&mut Vec::new()).expect("poll");
            }
        }
    }
}

/// `b` added as `a`'s peer, `local` registered with `a` and `target` with `b`.
///
/// # Safety
/// Both buffers must outlive the regions returned (drop the regions first).
unsafe fn link<'e>(
    a: &'e Endpoint,
    b: &'e Endpoint,
    local: &mut [u8],
    target: &mut [u8],
) -> (u64, Region<'e>, Region<'e>) {
    let peer = a.insert_peer(&b.name().unwrap()).unwrap();
    // SAFETY: the caller keeps both buffers alive longer than the regions.
    unsafe {
        (
            peer,
            a.register(local.as_mut_ptr() as u64, local.len() as u64)
                .unwrap(),
            b.register(target.as_mut_ptr() as u64, target.len() as u64)
                .unwrap(),
        )
    }
}

#[test]
fn providers_list_the_tcp_provider() {
    match providers() {
        Ok(list) => {
            for p in &list {
                eprintln!("{p:?}");
            }
            assert!(
                list.iter().any(|p| p.provider == PROVIDER),
                "{PROVIDER} missing from {list:?}"
            );
        }
        Err(e) => {
            if std::env::var("MORI_REQUIRE_LIBFABRIC").is_ok_and(|v| v == "1") {
                panic!("MORI_REQUIRE_LIBFABRIC=1 but: {e}");
            }
            eprintln!("skipped: {e}");
        }
    }
}

#[test]
fn random_writes_and_reads_are_byte_exact() {
    let Some((a, b)) = pair() else { return };
    let seed = random_seed("random_writes_and_reads_are_byte_exact");
    let mut rng = Lcg(seed);
    const LEN: usize = 16 << 20;
    let mut local = rng.bytes(LEN);
    let mut target = rng.bytes(LEN);
    let want_target = target.clone();
    let peer = a.insert_peer(&b.name().unwrap()).unwrap();
    // SAFETY: both buffers outlive their regions (dropped at the end of the test, regions
    // first), and nothing else touches them while operations are in flight.
    let (lr, tr) = unsafe {
        (
            a.register(local.as_mut_ptr() as u64, LEN as u64).unwrap(),
            b.register(target.as_mut_ptr() as u64, LEN as u64).unwrap(),
        )
    };
    let remote: RemoteRegion = tr.remote();
    let mut expect_target = want_target;
    let mut expect_local = local.clone();
    for round in 0..200 {
        let max = if round % 10 == 0 { 4 << 20 } else { 70_000 };
        let len = 1 + rng.below(max) as usize;
        let lo = rng.below((LEN - len) as u64) as usize;
        let ro = rng.below((LEN - len) as u64) as usize;
        let write = round % 2 == 0;
        let id = post_retrying(&a, &b, |a| {
            a.post(
                if write { Rma::Write } else { Rma::Read },
                &lr,
                lo as u64,
                len as u64,
                peer,
                &remote,
                ro as u64,
            )
            .unwrap()
        });
        wait(&a, &b, id)
            .result
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        if write {
            expect_target[ro..ro + len].copy_from_slice(&expect_local[lo..lo + len]);
        } else {
            expect_local[lo..lo + len].copy_from_slice(&expect_target[ro..ro + len]);
        }
    }
    assert_eq!(a.in_flight(), 0);
    drop(lr);
    drop(tr);
    assert!(local == expect_local, "local bytes differ (seed {seed})");
    assert!(target == expect_target, "target bytes differ (seed {seed})");
}

#[test]
fn out_of_range_is_refused_before_posting() {
    let Some((a, b)) = pair() else { return };
    let mut local = vec![7u8; 1 << 20];
    let mut target = vec![1u8; 1 << 20];
    // SAFETY: both buffers outlive their regions, which are dropped first.
    let (peer, lr, tr) = unsafe { link(&a, &b, &mut local, &mut target) };
    let remote = tr.remote();
    for (lo, ro, len) in [
        (0, (1 << 20) - 10, 11),
        ((1 << 20) - 1, 0, 2),
        (0, u64::MAX, 1),
    ] {
        let err = a
            .post(Rma::Write, &lr, lo, len, peer, &remote, ro)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = a
            .post(Rma::Read, &lr, lo, len, peer, &remote, ro)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    assert_eq!(a.in_flight(), 0);
    // A region of another endpoint is not this endpoint's local memory.
    let err = a.post(Rma::Write, &tr, 0, 1, peer, &remote, 0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    drop((lr, tr));
    assert!(target.iter().all(|&x| x == 1) && local.iter().all(|&x| x == 7));
}

/// Keys are the target's random choice (or the provider's): a write or read naming a key the
/// target never handed out fails (writes complete only once delivered) and touches nothing;
/// the provider then drops the connection to that peer.
#[test]
fn forged_keys_fail_and_touch_nothing() {
    let mut real_key = None;
    for forged in [Some(0u64), Some(1), Some(u64::MAX), None] {
        let Some((a, b)) = pair() else { return };
        let mut local = vec![7u8; 1 << 16];
        let mut target = vec![1u8; 1 << 16];
        // SAFETY: both buffers outlive their regions, which are dropped first.
        let (peer, lr, tr) = unsafe { link(&a, &b, &mut local, &mut target) };
        let remote = tr.remote();
        assert_ne!(remote.key, 0, "an unguessable key");
        assert_ne!(Some(remote.key), real_key, "a fresh key per registration");
        real_key = Some(remote.key);
        let Some(flip) = forged else {
            // The control: the real key writes.
            let id = post_retrying(&a, &b, |a| {
                a.post(Rma::Write, &lr, 0, 16, peer, &remote, 100).unwrap()
            });
            wait(&a, &b, id).result.unwrap();
            drop((lr, tr));
            assert!(
                target[100..116].iter().all(|&x| x == 7),
                "the real key's write landed"
            );
            return;
        };
        let key = remote.key ^ flip ^ 0x10; // never the real key
        let bad = RemoteRegion { key, ..remote };
        let id = post_retrying(&a, &b, |a| {
            a.post(Rma::Write, &lr, 0, 4096, peer, &bad, 0).unwrap()
        });
        let w = wait(&a, &b, id).result;
        let id = post_retrying(&a, &b, |a| {
            a.post(Rma::Read, &lr, 8192, 4096, peer, &bad, 0).unwrap()
        });
        let r = wait(&a, &b, id).result;
        assert!(
            w.is_err() && r.is_err(),
            "forged key {key:#x}: write {w:?}, read {r:?}"
        );
        drop((lr, tr));
        assert!(
            target.iter().all(|&x| x == 1),
            "a forged key wrote the target"
        );
        assert!(
            local.iter().all(|&x| x == 7),
            "a forged key's read wrote the initiator"
        );
    }
}

/// The attacker of `a_local_only_region_refuses_peers_holding_its_key`, run as another process
/// (this test binary again, with `MORI_NET_ATTACK=NAME KEY BASE LEN ...`: the victim endpoint's
/// address, then key, base and length of each target region in turn). For each target it writes
/// 4 KiB of 0xA5 at offset 0, then reads 4 KiB back, and prints `@attack write=ok|err read=ok|err`.
#[test]
fn attacker_process() {
    let Ok(spec) = std::env::var("MORI_NET_ATTACK") else {
        return; // an ordinary test run: nothing to do
    };
    let f: Vec<&str> = spec.split_whitespace().collect();
    let ep = Endpoint::open(PROVIDER, Some("127.0.0.1"), None, false).expect("endpoint");
    let victim = ep
        .insert_peer(&hex::decode(f[0]).expect("hex"))
        .expect("peer");
    let mut buf = vec![0xA5u8; 8192];
    // SAFETY: `buf` outlives the region (dropped first, below).
    let lr = unsafe { ep.register(buf.as_mut_ptr() as u64, buf.len() as u64) }.expect("register");
    for t in f[1..].chunks(3) {
        let target = RemoteRegion {
            key: t[0].parse().unwrap(),
            base: t[1].parse().unwrap(),
            len: t[2].parse().unwrap(),
        };
        let run = |op: Rma, local_offset: u64| -> &'static str {
            let deadline = Instant::now() + Duration::from_secs(10);
            let id = loop {
                match ep.post(op, &lr, local_offset, 4096, victim, &target, 0) {
                    Ok(Posted::Id(id)) => break id,
                    Ok(Posted::WouldBlock) if Instant::now() < deadline => {
                        ep.poll(&mut Vec::new()).expect("poll");
                    }
                    _ => return "err",
                }
            };
            let mut done = Vec::new();
            while Instant::now() < deadline {
                ep.poll(&mut done).expect("poll");
                if let Some(c) = done.iter().find(|c| c.id == id) {
                    return if c.result.is_ok() { "ok" } else { "err" };
                }
            }
            "err"
        };
        let w = run(Rma::Write, 0);
        let r = run(Rma::Read, 4096);
        println!("\n@attack write={w} read={r}");
    }
    drop(lr);
    drop(buf);
}

/// Memory registered for local use only (what mori.io's staging slots are) is out of a peer's
/// reach even with its real key, while the same endpoint's operations use it. The attacker is
/// another process ([`attacker_process`]); as a control it first reaches an ordinary region of
/// the same endpoint with that region's key (so the attack itself works).
#[test]
fn a_local_only_region_refuses_peers_holding_its_key() {
    let Some((a, b)) = pair() else { return };
    let mut local = vec![7u8; 1 << 16];
    let mut slots = vec![1u8; 1 << 16];
    let mut open = vec![3u8; 1 << 16];
    // SAFETY: the buffers outlive their regions, which are dropped first.
    let (_, lr, tr) = unsafe { link(&a, &b, &mut local, &mut open) };
    // SAFETY: as above.
    let private = unsafe { b.register_local(slots.as_mut_ptr() as u64, slots.len() as u64) }
        .expect("register_local");
    // Its own endpoint writes from it to a peer's open region.
    let back = b.insert_peer(&a.name().unwrap()).unwrap();
    let id = post_retrying(&b, &a, |b| {
        b.post(Rma::Write, &private, 0, 64, back, &lr.remote(), 512)
            .unwrap()
    });
    wait(&b, &a, id).result.unwrap();
    let (open_r, stolen) = (tr.remote(), private.remote());
    let spec = format!(
        "{} {} {} {} {} {} {}",
        hex::encode(b.name().unwrap()),
        open_r.key,
        open_r.base,
        open_r.len,
        stolen.key,
        stolen.base,
        stolen.len
    );
    let mut child = mori_testutil::this_test("attacker_process")
        .env("MORI_NET_ATTACK", spec)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("attacker process");
    // Serve (the software provider needs the target's progress) until the attacker is done.
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the attacker did not finish");
        b.poll(&mut Vec::new()).expect("progress");
        std::thread::sleep(Duration::from_micros(50));
    }
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let said: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("@attack "))
        .collect();
    assert_eq!(
        said,
        ["write=ok read=ok", "write=err read=err"],
        "the control reaches the open region, the local-only one refuses: {out}"
    );
    drop((lr, tr, private));
    assert!(
        open[..4096].iter().all(|&x| x == 0xA5),
        "the control's write landed"
    );
    assert!(
        slots.iter().all(|&x| x == 1),
        "a peer wrote local-only memory"
    );
    assert!(
        local[..512].iter().all(|&x| x == 7) && local[512..576].iter().all(|&x| x == 1),
        "the owner's own write from local-only memory landed, nothing else changed"
    );
}
