//! What the GPU cargo benches of mori-collective share: a one-PE shmem session on GPU 0 and
//! launches timed in bursts.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mori_bootstrap::{Bootstrap, create_unique_id_on};
use mori_gpu::{Device, Stream};
use mori_shmem::Shmem;

/// Launches between stream drains: a full launch queue would otherwise stall the timed calls.
pub const BURST: u64 = 128;

/// A one-PE shmem session on GPU 0, or None (said on stdout) where there is no GPU.
pub fn single_pe(bench: &str) -> Option<(Shmem, Device)> {
    let gpus = mori_gpu::device_count();
    if !matches!(gpus, Ok(n) if n > 0) {
        println!("{bench}: skipped (needs a GPU: {gpus:?})");
        return None;
    }
    let id = create_unique_id_on(IpAddr::from([127, 0, 0, 1])).expect("unique id");
    let boot = Bootstrap::connect(&id, 0, 1, Duration::from_secs(30)).expect("bootstrap");
    let device = Device::get(0).expect("GPU 0");
    let shmem = Shmem::init(Arc::new(boot), device, 1 << 30).expect("shmem");
    Some((shmem, device))
}

/// Runs `launch` `iters` times in bursts of [`BURST`], draining `stream` between bursts
/// (outside the timing); the launching time.
pub fn bursts(iters: u64, stream: &Stream, mut launch: impl FnMut()) -> Duration {
    let mut spent = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(BURST);
        let t0 = Instant::now();
        for _ in 0..n {
            launch();
        }
        spent += t0.elapsed();
        stream.synchronize().expect("stream");
        left -= n;
    }
    spent
}
