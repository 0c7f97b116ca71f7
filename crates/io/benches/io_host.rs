//! `cargo bench -p mori-io`: the host side of mori.io between two engines of this process over
//! loopback — submitting a 10 000-block batch (the call returning, not the data moving), and
//! whole transfers (submission to completion) over TCP, the same-host socket with direct
//! copies, and the fabric route (libfabric's `tcp;ofi_rxm` over loopback, when libfabric is
//! installed). See mori_testutil::bench for the method and where the record goes.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use mori_io::{EngineConfig, FabricMode, IoEngine, Location, MemoryDesc, Op, Route, Secret};
use mori_testutil::bench::Bench;

const REGION: usize = 64 << 20;
const WAIT: Duration = Duration::from_secs(30);

fn engine(name: &str, secret: &Secret, same_host_direct: bool, fabric: FabricMode) -> IoEngine {
    let cfg = EngineConfig {
        host: IpAddr::from([127, 0, 0, 1]),
        same_host_direct,
        cuda_ipc: false,
        fabric,
        fabric_provider: Some("tcp;ofi_rxm".into()),
        secret: Some(secret.clone()),
        ..EngineConfig::default()
    };
    IoEngine::new(name, cfg).expect("engine")
}

/// Registers a buffer of `len` bytes (kept alive by the returned Vec).
fn region(e: &IoEngine, len: usize, fill: u8) -> (Vec<u8>, MemoryDesc) {
    let mut buf = vec![fill; len];
    let mem = e
        .register(buf.as_mut_ptr() as u64, len as u64, Location::Host)
        .expect("register");
    (buf, mem)
}

fn main() {
    let mut b = Bench::new("io");
    let secret = Secret::random().expect("secret");
    let fabric = match mori_net::fabric::providers() {
        Ok(_) => FabricMode::Always,
        Err(e) => {
            b.config("fabric", format!("not measured: {e}"));
            FabricMode::Off
        }
    };
    let target = engine("bench-target", &secret, true, fabric);
    let (_tbuf, tmem) = region(&target, REGION, 1);
    b.config("region_bytes", REGION);
    let mut routes = vec![
        (Route::Tcp, false, FabricMode::Off),
        (Route::Direct, true, FabricMode::Off),
    ];
    if fabric != FabricMode::Off {
        routes.push((Route::Fabric, false, fabric));
    }
    for (expected, direct, mode) in routes {
        let route = expected.name();
        let me = engine(&format!("bench-{route}"), &secret, direct, mode);
        me.connect(&target.desc()).expect("connect");
        let (lbuf, lmem) = region(&me, REGION, 2);

        // Submission of 10 000 × 4 KiB, waited for outside the timed part.
        let n = 10_000u64;
        let offs: Vec<u64> = (0..n).map(|i| i * 4096).collect();
        let sizes = vec![4096u64; n as usize];
        b.run_batched(&format!("{route} submit 10000 x 4 KiB"), 0, |iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t0 = Instant::now();
                let t = me
                    .transfer(Op::Read, &lmem, &offs, &tmem, &offs, &sizes, None)
                    .expect("submit");
                spent += t0.elapsed();
                assert!(t.wait(Some(WAIT)).expect("transfer"), "unfinished");
            }
            spent
        });

        // Whole transfers: submission to completion.
        for (blocks, block) in [(1u64, 4096u64), (128, 65536), (8, 1 << 20)] {
            let offs: Vec<u64> = (0..blocks).map(|i| i * (block + 512)).collect();
            let sizes = vec![block; blocks as usize];
            for op in [Op::Read, Op::Write] {
                let name = format!(
                    "{route} {} {blocks} x {} KiB",
                    if op == Op::Read { "read" } else { "write" },
                    block / 1024
                );
                b.run(&name, blocks * block, || {
                    let t = me
                        .transfer(op, &lmem, &offs, &tmem, &offs, &sizes, None)
                        .expect("submit");
                    assert_eq!(t.route(), expected, "{name}: the route measured");
                    assert!(t.wait(Some(WAIT)).expect("transfer"), "unfinished");
                });
            }
        }
        // The last read moved the target's bytes (all 1) over ours (all 2).
        // SAFETY: no transfer is in flight; the engine wrote through the registered pointer.
        let first = unsafe { std::ptr::read_volatile(lbuf.as_ptr()) };
        assert_eq!(first, 1, "{route}: the reads landed");
    }
    b.finish().expect("writing the record");
}
