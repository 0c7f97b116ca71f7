//! Moving bytes between a socket and registered memory (host memory directly, device memory
//! through a bounce buffer and the CUDA driver).

use std::io::{Read, Write};

use mori_gpu::Device;

use crate::error::{Error, Result};
use crate::registry::{Location, Region};

/// Bounce-buffer size for device memory.
const STAGING: usize = 4 << 20;

/// Reads `len` bytes from `r` into `region` at `offset`. The caller holds the region's use
/// guard and has checked the range.
pub fn receive_into(r: &mut impl Read, region: &Region, offset: u64, len: u64) -> Result<()> {
    region.check(offset, len)?;
    let addr = region.addr + offset;
    match region.location {
        Location::Host => {
            // SAFETY: the range lies inside a registered region (checked above), which stays
            // valid while the caller's use guard is held (the registration contract).
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len as usize) };
            r.read_exact(dst)
                .map_err(|e| Error::io("receiving payload", e))
        }
        Location::Cuda(ordinal) => {
            let device = Device::get(ordinal as usize)?;
            through_staging(len, |chunk, at| {
                r.read_exact(chunk)
                    .map_err(|e| Error::io("receiving payload", e))?;
                // SAFETY: device range inside the registered region, guard held by the caller.
                unsafe {
                    if region.independent {
                        own_stream_copy(device, addr + at, chunk.as_ptr() as u64, chunk.len())
                    } else {
                        Ok(mori_gpu::copy_host_to_device(device, addr + at, chunk)?)
                    }
                }
            })
        }
    }
}

/// Writes `len` bytes of `region` at `offset` to `w`.
pub fn send_from(w: &mut impl Write, region: &Region, offset: u64, len: u64) -> Result<()> {
    region.check(offset, len)?;
    let addr = region.addr + offset;
    match region.location {
        Location::Host => {
            // SAFETY: as in receive_into; the bytes are only read.
            let src = unsafe { std::slice::from_raw_parts(addr as *const u8, len as usize) };
            w.write_all(src)
                .map_err(|e| Error::io("sending payload", e))
        }
        Location::Cuda(ordinal) => {
            let device = Device::get(ordinal as usize)?;
            through_staging(len, |chunk, at| {
                // SAFETY: device range inside the registered region, guard held by the caller.
                unsafe {
                    if region.independent {
                        own_stream_copy(device, chunk.as_mut_ptr() as u64, addr + at, chunk.len())?
                    } else {
                        mori_gpu::copy_device_to_host(device, chunk, addr + at)?
                    }
                };
                w.write_all(chunk)
                    .map_err(|e| Error::io("sending payload", e))
            })
        }
    }
}

thread_local! {
    /// Each data-plane thread's own non-blocking stream per device, for independent regions.
    static OWN_STREAMS: std::cell::RefCell<Vec<(Device, mori_gpu::Stream)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Copies `len` bytes between host and device memory (unified addressing) on this thread's own
/// non-blocking stream (an independent region's copies wait for no kernel), and returns once
/// they have arrived.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping.
unsafe fn own_stream_copy(device: Device, dst: u64, src: u64, len: usize) -> Result<()> {
    OWN_STREAMS.with(|streams| {
        let mut streams = streams.borrow_mut();
        let at = match streams.iter().position(|(d, _)| *d == device) {
            Some(i) => i,
            None => {
                streams.push((device, mori_gpu::Stream::new(device)?));
                streams.len() - 1
            }
        };
        let stream = &streams[at].1;
        // SAFETY: forwarded contract; the copy is waited for before the ranges may change.
        unsafe { mori_gpu::copy_async(device, dst, src, len, stream.handle())? };
        Ok(stream.synchronize()?)
    })
}

/// Moves `len` bytes of device memory through one host bounce buffer, at most `STAGING` bytes
/// at a time: `step(chunk, at)` moves the chunk at byte `at` of the range.
fn through_staging(len: u64, mut step: impl FnMut(&mut [u8], u64) -> Result<()>) -> Result<()> {
    let mut staging = vec![0u8; (len as usize).min(STAGING)];
    let mut done = 0u64;
    while done < len {
        let k = ((len - done) as usize).min(STAGING);
        step(&mut staging[..k], done)?;
        done += k as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn through_staging_steps_over_the_range_in_order() {
        for len in [
            0,
            1,
            STAGING as u64 - 1,
            STAGING as u64,
            2 * STAGING as u64 + 3,
        ] {
            let mut steps = Vec::new();
            through_staging(len, |chunk, at| {
                steps.push((at, chunk.len() as u64));
                Ok(())
            })
            .unwrap();
            let mut next = 0;
            for &(at, n) in &steps {
                assert_eq!(at, next, "len {len}");
                assert!(n > 0 && n <= STAGING as u64, "len {len}");
                next += n;
            }
            assert_eq!(next, len);
        }
    }
}
