//! `cargo bench -p mori-net`: RMA throughput through libfabric over loopback (`tcp;ofi_rxm`),
//! 16 operations in flight, beside the same run's ceiling of that path: one TCP stream over
//! loopback between two threads (the writer streams every batch of a sample back to back, the
//! reader reads them into a buffer and answers one byte per sample). The
//! target endpoint makes progress on its own thread, as a remote host would. GB/s counts the
//! bytes of the operations once. See mori_testutil::bench for the method.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use mori_net::fabric::{Endpoint, Posted, RemoteRegion, Rma};
use mori_testutil::bench::Bench;

const PROVIDER: &str = "tcp;ofi_rxm";
const REGION: usize = 64 << 20;
const IN_FLIGHT: u64 = 16;

fn main() {
    let mut b = Bench::new("net");
    b.config("provider", PROVIDER);
    b.config("in_flight", IN_FLIGHT);
    if let Err(e) = mori_net::fabric::Library::get() {
        println!("  fabric cases skipped: {e}");
        b.config("fabric", format!("skipped: {e}"));
    } else {
        fabric_cases(&mut b);
    }
    stream_ceiling(&mut b);
    b.finish().expect("writing the record");
}

fn fabric_cases(b: &mut Bench) {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<(Vec<u8>, RemoteRegion)>();
    let target = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let ep =
                Endpoint::open(PROVIDER, Some("127.0.0.1"), None, false).expect("target endpoint");
            let mut buf = vec![1u8; REGION];
            // SAFETY: `buf` outlives the region (both dropped at the end of this thread).
            let region = unsafe { ep.register(buf.as_mut_ptr() as u64, REGION as u64) }.unwrap();
            tx.send((ep.name().unwrap(), region.remote())).unwrap();
            while !stop.load(Ordering::Relaxed) {
                ep.poll(&mut Vec::new()).expect("target progress");
            }
            drop(region);
            drop(buf);
        })
    };
    let (name, remote) = rx.recv().expect("the target's address");
    let ep = Endpoint::open(PROVIDER, Some("127.0.0.1"), None, false).expect("endpoint");
    let peer = ep.insert_peer(&name).unwrap();
    // The last 4 MiB of `local` are scratch for the checks, outside the timed slots.
    let scratch = (REGION - (4 << 20)) as u64;
    let mut local = vec![2u8; REGION];
    // SAFETY: `local` outlives the region; it is only touched through the engine or, between
    // operations, through this pointer.
    let lr = unsafe { ep.register(local.as_mut_ptr() as u64, REGION as u64) }.unwrap();
    let base = local.as_mut_ptr();
    let run_one = |write: bool, local_off: u64, remote_off: u64, len: u64| {
        let mut done = Vec::new();
        loop {
            let r = ep.post(
                if write { Rma::Write } else { Rma::Read },
                &lr,
                local_off,
                len,
                peer,
                &remote,
                remote_off,
            );
            if let Posted::Id(_) = r.expect("post") {
                break;
            }
            ep.poll(&mut done).expect("poll");
        }
        while ep.in_flight() > 0 {
            ep.poll(&mut done).expect("poll");
        }
        done.into_iter().for_each(|c| c.result.expect("operation"));
    };
    for (k, block) in [64u64 << 10, 1 << 20, 4 << 20].into_iter().enumerate() {
        let slots = scratch / block;
        // Each block size writes its own byte; its reads must bring exactly that back.
        let pattern = 0x40 + k as u8;
        for write in [true, false] {
            let fill = if write { pattern } else { 0xee };
            // SAFETY: nothing is in flight; the range lies in `local`.
            unsafe { std::ptr::write_bytes(base, fill, scratch as usize) };
            let case = format!(
                "fabric {} {} KiB",
                if write { "write" } else { "read" },
                block / 1024
            );
            b.run(&case, block * IN_FLIGHT, || {
                let mut done = Vec::new();
                let mut posted = 0;
                let mut next = 0u64;
                while posted < IN_FLIGHT {
                    let off = (next % slots) * block;
                    next += 1;
                    let r = ep.post(
                        if write { Rma::Write } else { Rma::Read },
                        &lr,
                        off,
                        block,
                        peer,
                        &remote,
                        off,
                    );
                    match r.expect("post") {
                        Posted::Id(_) => posted += 1,
                        Posted::WouldBlock => {
                            ep.poll(&mut done).expect("poll");
                        }
                    }
                }
                let deadline = Instant::now() + Duration::from_secs(30);
                while ep.in_flight() > 0 {
                    ep.poll(&mut done).expect("poll");
                    assert!(Instant::now() < deadline, "operations unfinished");
                }
                for c in done {
                    c.result.expect("operation");
                }
            });
            // The check: the first slot of the target (written by the write case) read into
            // scratch, or the first slot of local (filled by the read case).
            let (at, len) = if write {
                run_one(false, scratch, 0, block);
                (scratch, block)
            } else {
                (0, block)
            };
            // SAFETY: nothing is in flight; the range lies in `local`.
            let got = unsafe { std::slice::from_raw_parts(base.add(at as usize), len as usize) };
            assert!(got.iter().all(|&x| x == pattern), "{case}: wrong bytes");
        }
    }
    drop(lr);
    local.clear();
    stop.store(true, Ordering::Relaxed);
    target.join().expect("target thread");
}

fn stream_ceiling(b: &mut Bench) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (order_tx, order_rx) = mpsc::channel::<usize>();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; 4 << 20];
        while let Ok(mut left) = order_rx.recv() {
            while left > 0 {
                let n = left.min(buf.len());
                s.read_exact(&mut buf[..n]).unwrap();
                left -= n;
            }
            s.write_all(&[1]).unwrap(); // one byte back: the batch arrived
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let data = vec![3u8; 4 << 20];
    for block in [64usize << 10, 1 << 20, 4 << 20] {
        // A sample streams all its batches back to back and waits once: the ceiling of the
        // path itself, without a per-batch round trip (the fabric cases pay one per batch).
        b.run_batched(
            &format!("tcp stream ceiling {} KiB", block / 1024),
            (block as u64) * IN_FLIGHT,
            |iters| {
                let t0 = Instant::now();
                order_tx.send(block * (IN_FLIGHT * iters) as usize).unwrap();
                for _ in 0..IN_FLIGHT * iters {
                    s.write_all(&data[..block]).unwrap();
                }
                let mut ack = [0u8; 1];
                s.read_exact(&mut ack).unwrap();
                t0.elapsed()
            },
        );
    }
    drop(order_tx);
    drop(s);
    reader.join().unwrap();
}
