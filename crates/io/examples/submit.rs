//! Rust-side cost of submitting a 10 000-block batch (the call returning, not the data moving):
//! the engine part of `benches/io_submit.py`, without Python.
//!
//!     cargo run --release -p mori-io --example submit [-- TRIALS [tcp|direct] [throughput]]
//!
//! A target engine runs in a child process (this binary, re-run with `target`); this process
//! times `transfer_batch` of 10 000 × 4 KiB blocks (borrowed arrays, as from numpy), each
//! submission right after the previous transfer finished, and prints p50 / p99 in µs. With
//! `throughput` it also prints the median GB/s of a few batch shapes (TRIALS transfers each),
//! to check that cheaper submission did not cost bandwidth.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mori_io::{Batch, EngineConfig, EngineDesc, IoEngine, Location, MemoryDesc, Op};

const N: usize = 10_000;
const BLOCK: u64 = 4096;

fn config(direct: bool) -> EngineConfig {
    EngineConfig {
        timeout: Duration::from_secs(60),
        same_host_direct: direct,
        ..EngineConfig::default()
    }
}

fn target() {
    let eng = IoEngine::new("submit-target", config(true)).expect("engine");
    let buf = vec![0u8; (N * BLOCK as usize).max(128 << 20)];
    let mem = eng
        .register(buf.as_ptr() as u64, buf.len() as u64, Location::Host)
        .expect("register");
    println!(
        "{} {}",
        hex::encode(eng.desc().to_bytes()),
        hex::encode(mem.to_bytes())
    );
    std::io::stdout().flush().expect("stdout");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line); // until the parent is done
}

fn pct(xs: &mut [f64], q: f64) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((q * xs.len() as f64) as usize).min(xs.len() - 1)]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("target") {
        return target();
    }
    let trials: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(300);
    let routes: Vec<&str> = match args.get(2).map(String::as_str) {
        Some("both") | None => vec!["tcp", "direct"],
        Some(r) => vec![r],
    };
    let throughput = args.get(3).map(String::as_str) == Some("throughput");
    let mut child = Command::new(&args[0])
        .arg("target")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("target process");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("target descriptors");
    let mut parts = line.split_whitespace();
    let desc = EngineDesc::from_bytes(&hex::decode(parts.next().expect("desc")).expect("hex"))
        .expect("desc");
    let remote = MemoryDesc::from_bytes(&hex::decode(parts.next().expect("mem")).expect("hex"))
        .expect("mem");

    let local = vec![0u8; (N * BLOCK as usize).max(128 << 20)];
    let offs: Vec<u64> = (0..N as u64).map(|i| i * BLOCK).collect();
    let sizes = vec![BLOCK; N];
    for route in routes {
        let eng = IoEngine::new(&format!("submit-client-{route}"), config(route == "direct"))
            .expect("engine");
        eng.connect(&desc).expect("connect");
        let mem = eng
            .register(local.as_ptr() as u64, local.len() as u64, Location::Host)
            .expect("register");
        for op in [Op::Write, Op::Read] {
            let submit = || {
                // SAFETY: `offs` and `sizes` outlive every transfer (each is waited for) and
                // are not written.
                let batch = unsafe {
                    Batch::borrowed(
                        offs.as_ptr(),
                        offs.as_ptr(),
                        sizes.as_ptr(),
                        N,
                        Box::new(()),
                    )
                }
                .expect("batch");
                eng.transfer_batch(op, &mem, &remote, batch, None)
                    .expect("submit")
            };
            for _ in 0..10 {
                submit().wait(None).expect("transfer");
            }
            let mut times = Vec::with_capacity(trials);
            for _ in 0..trials {
                let t0 = Instant::now();
                let t = submit();
                times.push(t0.elapsed().as_secs_f64() * 1e6);
                t.wait(None).expect("transfer");
                assert_eq!(t.route().name(), route);
            }
            let p50 = pct(&mut times, 0.5);
            let p99 = pct(&mut times, 0.99);
            println!(
                "{route:>6} {op:?} {N} blocks: submit p50 {p50:7.1} µs, p99 {p99:7.1} µs ({trials} trials)"
            );
        }
        if throughput {
            let shapes = [
                (8192usize, 4096u64),
                (1024, 65536),
                (128, 1 << 20),
                (1, 32 << 20),
            ];
            for (n, block) in shapes {
                let offs: Vec<u64> = (0..n as u64).map(|i| i * block).collect();
                let sizes = vec![block; n];
                for op in [Op::Write, Op::Read] {
                    let mut rates: Vec<f64> = (0..trials.max(1))
                        .map(|_| {
                            let t0 = Instant::now();
                            eng.transfer(op, &mem, &offs, &remote, &offs, &sizes, None)
                                .expect("submit")
                                .wait(None)
                                .expect("transfer");
                            (n as u64 * block) as f64 / t0.elapsed().as_secs_f64() / 1e9
                        })
                        .collect();
                    let gbps = pct(&mut rates, 0.5);
                    println!(
                        "{route:>6} {op:?} {n} x {} KiB: {gbps:.2} GB/s",
                        block >> 10
                    );
                }
            }
        }
        eng.deregister(&mem).expect("deregister");
    }
    drop(child.stdin.take());
    let _ = child.wait();
}
