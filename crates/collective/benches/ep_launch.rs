//! `cargo bench -p mori-collective --bench ep_launch`: the host cost of mori.ep's normal-mode
//! dispatch and combine through the Rust runtime ([`Ep`]) on one PE with its own GPU, no Python:
//! the launches alone (timed in bursts, the stream drained between them), and a dispatch up to
//! its received counts (what a caller waits for before it can size the expert inputs).
//! Verified after the timed calls, with data they did not see: the counts are what the routing
//! says, and combining the received rows gives back each token's row. Without a GPU it says so
//! and writes nothing (CI). See mori_testutil::bench.

mod common;

use std::time::{Duration, Instant};

use common::{BURST, bursts, single_pe};
use mori_collective::ep_buffers::Ep;
use mori_collective::ep_runtime::{EpShape, Layout};
use mori_gpu::{DeviceBuffer, Stream};
use mori_testutil::bench::Bench;

const TOKENS: u32 = 128;
const SMS: u32 = 24;
const WAIT: Duration = Duration::from_secs(30);

/// bf16 bits of `v` (exact for the small integers used here).
fn bf16(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

/// Token rows whose values depend on the token, the column and `salt`.
fn rows(shape: &EpShape, salt: u32) -> Vec<u8> {
    let h = shape.hidden;
    (0..TOKENS * h)
        .flat_map(|i| bf16(((i / h * 7 + i % h + salt) % 251) as f32))
        .collect()
}

fn main() {
    let Some((shmem, device)) = single_pe("ep_launch") else {
        return;
    };
    let mut bench = Bench::new("ep-launch");
    let shape = EpShape {
        num_ranks: 1,
        num_experts: 8,
        hidden: 2048,
        topk: 4,
        max_tokens: TOKENS,
        low_latency_max_tokens: 0,
    };
    let ep = Ep::create(&shmem, shape).expect("Ep::create");
    let rt = ep.runtime();
    let stream = Stream::new(device).expect("stream");
    let row_bytes = u64::from(shape.hidden) * 2;
    let n = u64::from(TOKENS);
    let x = DeviceBuffer::new(device, (n * row_bytes) as usize).expect("x");
    let out = DeviceBuffer::new(device, (n * row_bytes) as usize).expect("out");
    let topk = DeviceBuffer::new(device, (n * u64::from(shape.topk) * 8) as usize).expect("topk");
    let weights =
        DeviceBuffer::new(device, (n * u64::from(shape.topk) * 4) as usize).expect("weights");
    let layout_len = Layout::len(n, 1, u64::from(shape.num_experts));
    let area = DeviceBuffer::new(device, (layout_len * 4) as usize).expect("layout area");
    let layout = Layout {
        base: area.ptr(),
        num_tokens: n,
        num_ranks: 1,
        num_experts: u64::from(shape.num_experts),
    };
    // Token t goes to experts t, t+1, ... (mod experts): four distinct experts each.
    let ids: Vec<u8> = (0..n)
        .flat_map(|t| (0..u64::from(shape.topk)).map(move |j| (t + j) % 8))
        .flat_map(|e| (e as i64).to_le_bytes())
        .collect();
    let ones: Vec<u8> = (0..n * u64::from(shape.topk))
        .flat_map(|_| 1.0f32.to_le_bytes())
        .collect();
    // SAFETY: each buffer holds the bytes copied into it.
    unsafe {
        mori_gpu::copy_host_to_device(device, x.ptr(), &rows(&shape, 0)).expect("x");
        mori_gpu::copy_host_to_device(device, topk.ptr(), &ids).expect("topk");
        mori_gpu::copy_host_to_device(device, weights.ptr(), &ones).expect("weights");
    }
    // SAFETY (every dispatch/combine below): the per-call buffers live until the stream and
    // device are drained at the end.
    let dispatch = || unsafe {
        rt.dispatch(
            x.ptr(),
            row_bytes,
            0,
            0,
            topk.ptr(),
            weights.ptr(),
            TOKENS,
            &layout,
            0,
            SMS,
            true,
            Some(stream.handle()),
        )
        .expect("dispatch")
        .0
    };
    let combine = |y: u64, num_recv: u32| unsafe {
        rt.combine(
            y,
            false,
            Some(num_recv),
            TOKENS,
            &layout,
            out.ptr(),
            None,
            SMS,
            Some(stream.handle()),
        )
        .expect("combine");
    };
    let recv_x = ep.buffers().recv_x;
    bench.run_batched("dispatch bf16 128 x 2048 top-4: launch", 0, |iters| {
        bursts(iters, &stream, || {
            dispatch();
        })
    });
    bench.run_batched("dispatch: launch + wait for the counts", 0, |iters| {
        let t0 = Instant::now();
        for _ in 0..iters {
            let seq = dispatch();
            ep.wait_received(seq, WAIT)
                .expect("dispatch")
                .expect("no counts from the GPU");
        }
        t0.elapsed()
    });
    bench.run_batched("combine 128 rows: launch", 0, |iters| {
        bursts(iters, &stream, || combine(recv_x, TOKENS))
    });
    stream.synchronize().expect("stream");

    // Check with rows the timed calls did not see.
    let fresh = rows(&shape, 101);
    // SAFETY: x holds TOKENS rows.
    unsafe { mori_gpu::copy_host_to_device(device, x.ptr(), &fresh) }.expect("x");
    let got = ep
        .wait_received(dispatch(), WAIT)
        .expect("dispatch")
        .expect("no counts from the GPU");
    assert_eq!(got.rows, TOKENS, "one PE receives every token once");
    assert_eq!(
        got.per_expert,
        vec![TOKENS * shape.topk / shape.num_experts; shape.num_experts as usize],
        "rows per expert"
    );
    assert!(!got.bad_ids);
    assert_eq!(
        got.most_tokens, TOKENS,
        "the largest token count among the PEs"
    );
    combine(recv_x, got.rows);
    stream.synchronize().expect("stream");
    let mut back = vec![0u8; fresh.len()];
    // SAFETY: out holds TOKENS rows; the stream is drained.
    unsafe { mori_gpu::copy_device_to_host(device, &mut back, out.ptr()) }.expect("read");
    assert!(
        back == fresh,
        "combine of the received rows is not the tokens' rows"
    );

    bench.config("pes", 1);
    bench.config("tokens", TOKENS);
    bench.config("hidden", shape.hidden);
    bench.config("topk", shape.topk);
    bench.config("experts", shape.num_experts);
    bench.config("sms", SMS);
    bench.config("burst", BURST);
    bench.config("gpu", device.name().unwrap_or_default());
    ep.destroy(&shmem).expect("destroy");
    shmem.finalize().expect("finalize");
    bench.finish().expect("writing the record");
}
