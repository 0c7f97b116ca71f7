//! `cargo bench -p mori-collective`: the host cost of one mori.ccl collective through the Rust
//! runtime (plan, pack, `cuLaunchKernel`) on one PE with its own GPU, no Python: what an eager
//! call costs below the bindings. Launches are timed in bursts of 128 with the stream drained
//! between bursts (outside the timing), so a full launch queue never stalls them. Verified: on
//! one PE an all-reduce leaves its input as it was, and the all-gather copies it, checked after
//! the timed calls. Without a GPU it says so and writes nothing (CI). See mori_testutil::bench.

mod common;

use std::time::Instant;

use common::{BURST, bursts, single_pe};
use mori_collective::communicator::{
    CclConfig, Communicator, DType, Exchange, ReduceOp, plan_all_reduce,
};
use mori_gpu::{DeviceBuffer, Stream};
use mori_testutil::bench::Bench;

const ELEMENTS: u64 = 1024;

fn main() {
    let Some((shmem, device)) = single_pe("ccl_launch") else {
        return;
    };
    let mut bench = Bench::new("ccl-launch");
    let config = CclConfig::default();
    let (comm, memory) = Communicator::create(&shmem, config).expect("communicator");
    let stream = Stream::new(device).expect("stream");
    let input = DeviceBuffer::new(device, (ELEMENTS * 2) as usize).expect("input");
    let gathered = DeviceBuffer::new(device, (ELEMENTS * 2) as usize).expect("output");
    // bf16 1.0 everywhere: a one-PE sum leaves it, a gather copies it.
    let ones: Vec<u8> = (0..ELEMENTS)
        .flat_map(|_| 0x3F80u16.to_le_bytes())
        .collect();
    // SAFETY: both buffers hold ELEMENTS bf16 values.
    unsafe { mori_gpu::copy_host_to_device(device, input.ptr(), &ones) }.expect("fill");

    bench.run_batched("all_reduce bf16 x 1024: plan only", 0, |iters| {
        let t0 = Instant::now();
        for _ in 0..iters {
            let plan = plan_all_reduce(
                comm.geometry(),
                comm.config(),
                input.ptr(),
                input.ptr(),
                ELEMENTS,
                DType::Bf16,
                ReduceOp::Sum,
                None,
            );
            std::hint::black_box(comm.prepare(plan));
        }
        t0.elapsed()
    });
    bench.run_batched("all_reduce bf16 x 1024: plan + launch", 0, |iters| {
        bursts(iters, &stream, || {
            // SAFETY: the input lives until the stream is drained, after each burst.
            unsafe {
                comm.all_reduce(
                    input.ptr(),
                    input.ptr(),
                    ELEMENTS,
                    DType::Bf16,
                    ReduceOp::Sum,
                    None,
                    stream.handle(),
                )
            }
            .expect("all_reduce")
        })
    });
    bench.run_batched("all_gather 2 KiB: plan + launch", 0, |iters| {
        bursts(iters, &stream, || {
            let seg = [(0, ELEMENTS * 2)];
            // SAFETY: as above, both buffers ELEMENTS * 2 bytes.
            unsafe {
                comm.exchange(
                    Exchange::AllGather,
                    input.ptr(),
                    gathered.ptr(),
                    &seg,
                    &seg,
                    0,
                    true,
                    stream.handle(),
                )
            }
            .expect("all_gather")
        })
    });
    stream.synchronize().expect("stream");
    for (what, buf) in [("all_reduce", &input), ("all_gather", &gathered)] {
        let mut got = vec![0u8; ones.len()];
        // SAFETY: the buffer holds that many bytes; the stream is drained.
        unsafe { mori_gpu::copy_device_to_host(device, &mut got, buf.ptr()) }.expect("read");
        assert!(got == ones, "{what} on one PE changed the values");
    }
    bench.config("pes", 1);
    bench.config("elements", ELEMENTS);
    bench.config("burst", BURST);
    bench.config("gpu", device.name().unwrap_or_default());
    drop(comm);
    memory.free(&shmem).expect("free");
    shmem.finalize().expect("finalize");
    bench.finish().expect("writing the record");
}
