//! GPU tier: device memory carved into fixed-size pages (feature `gpu`).
//!
//! A [`GpuArena`] is one device allocation (`cuMemAlloc`, through mori-gpu) of
//! `capacity_bytes` on one CUDA device, with the DRAM tier's bookkeeping: it dereferences to
//! its [`crate::PageTable`] (first-fit runs of pages, LRU order, pins, reservations). Only the
//! storage and the copies differ from [`crate::DramArena`]: values move with `cuMemcpy` and unified
//! addressing, so the other end of a copy may be host memory (pageable or pinned) or device
//! memory of any device. Copies are synchronous (`mori_gpu::copy`): they run on the legacy
//! default stream, after the work queued there, and return once the bytes have arrived.
//!
//! Every CUDA failure is `Error::Gpu`: what was being done, on which device, and the driver
//! call that failed. A missing driver or device fails [`GpuArena::new`], never panics.
//!
//! Without the `gpu` feature, `GpuArena` is an empty enum — no value of it can exist — whose
//! [`GpuArena::new`] fails: the pool is the same code either way, and refuses a GPU tier when
//! it opens.

use crate::error::Result;

#[cfg(feature = "gpu")]
pub use with_cuda::GpuArena;
#[cfg(feature = "gpu")]
pub(crate) use with_cuda::copy_on_device;
#[cfg(not(feature = "gpu"))]
pub use without_cuda::GpuArena;

impl GpuArena {
    /// The value of `key`, copied to host memory. Not a use.
    pub fn read(&self, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let Some((_, len)) = self.locate(key) else {
            return Ok(None);
        };
        let mut out = vec![0u8; len];
        self.read_into(key, &mut out)?;
        Ok(Some(out))
    }

    /// Copies the value of `key` into the front of `out` and returns its length; `out` must be
    /// at least as long as the value ([`crate::Error::InvalidArgument`] otherwise). Not a use.
    pub fn read_into(&self, key: &[u8], out: &mut [u8]) -> Result<Option<usize>> {
        // SAFETY: `out` is a live, writable host slice of out.len() bytes.
        unsafe { self.copy_out(key, out.as_mut_ptr() as u64, out.len()) }
    }
}

#[cfg(feature = "gpu")]
mod with_cuda {
    use std::ops::{Deref, DerefMut};

    use mori_gpu::{Device, DeviceBuffer};
    use tracing::debug;

    use crate::error::{Error, Result};
    use crate::pages::PageTable;
    use crate::pool::too_small;

    /// Device-memory page arena: the GPU tier of the embedded pool. See the module docs.
    pub struct GpuArena {
        mem: Backing,
        pages: PageTable,
    }

    impl std::fmt::Debug for GpuArena {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_tuple("GpuArena").field(&self.pages).finish()
        }
    }

    impl Deref for GpuArena {
        type Target = PageTable;

        fn deref(&self) -> &PageTable {
            &self.pages
        }
    }

    impl DerefMut for GpuArena {
        fn deref_mut(&mut self) -> &mut PageTable {
            &mut self.pages
        }
    }

    /// Where the tier's bytes live.
    enum Backing {
        Device(DeviceBuffer),
        /// Host memory standing in for the device in this crate's unit tests (CI has no
        /// GPU), so that the pool's GPU-tier logic is tested there too.
        #[cfg(test)]
        Emulated(Vec<u8>),
    }

    impl Backing {
        fn len(&self) -> usize {
            match self {
                Backing::Device(buf) => buf.len(),
                #[cfg(test)]
                Backing::Emulated(v) => v.len(),
            }
        }

        /// The range `offset..offset + len`, checked against the allocation.
        fn check(&self, offset: usize, len: usize) -> Result<()> {
            if offset.checked_add(len).is_none_or(|end| end > self.len()) {
                return Err(Error::InvalidArgument(format!(
                    "{len} bytes at {offset} lie outside the GPU tier ({} bytes)",
                    self.len()
                )));
            }
            Ok(())
        }

        /// Copies `len` bytes from `src` to `offset`.
        ///
        /// # Safety
        /// `src` must be readable for `len` bytes.
        unsafe fn write(&mut self, offset: usize, src: u64, len: usize) -> Result<()> {
            self.check(offset, len)?;
            match self {
                // SAFETY: the caller guarantees `src`; the destination lies in the allocation.
                Backing::Device(buf) => unsafe {
                    copy(buf.device(), buf.ptr() + offset as u64, src, len, "into")
                },
                #[cfg(test)]
                Backing::Emulated(v) => {
                    if len > 0 {
                        // SAFETY: the caller guarantees `src`; the destination is in `v`.
                        unsafe {
                            std::ptr::copy(src as *const u8, v.as_mut_ptr().add(offset), len)
                        };
                    }
                    Ok(())
                }
            }
        }

        /// Copies `len` bytes at `offset` to `dst`.
        ///
        /// # Safety
        /// `dst` must be writable for `len` bytes.
        unsafe fn read(&self, offset: usize, dst: u64, len: usize) -> Result<()> {
            self.check(offset, len)?;
            match self {
                // SAFETY: the caller guarantees `dst`; the source lies in the allocation.
                Backing::Device(buf) => unsafe {
                    copy(buf.device(), dst, buf.ptr() + offset as u64, len, "out of")
                },
                #[cfg(test)]
                Backing::Emulated(v) => {
                    if len > 0 {
                        // SAFETY: the caller guarantees `dst`; the source is in `v`.
                        unsafe { std::ptr::copy(v.as_ptr().add(offset), dst as *mut u8, len) };
                    }
                    Ok(())
                }
            }
        }
    }

    /// CUDA device `ordinal`, with errors naming what it is for.
    fn device(ordinal: usize, purpose: &str) -> Result<Device> {
        Device::get(ordinal).map_err(|source| Error::Gpu {
            context: format!("{purpose} on CUDA device {ordinal}"),
            source: Box::new(source),
        })
    }

    /// [`mori_gpu::copy`] for the GPU tier of `device` (`direction`: "into" or "out of").
    ///
    /// # Safety
    /// As [`mori_gpu::copy`].
    unsafe fn copy(device: Device, dst: u64, src: u64, len: usize, direction: &str) -> Result<()> {
        // SAFETY: guaranteed by the caller.
        unsafe { mori_gpu::copy(device, dst, src, len) }.map_err(|source| Error::Gpu {
            context: format!(
                "copying {len} bytes {direction} the GPU tier on CUDA device {}",
                device.ordinal()
            ),
            source: Box::new(source),
        })
    }

    /// Copies `len` bytes from `src` to `dst` in the context of CUDA device `ordinal` (a
    /// caller's device buffer staged through host memory).
    ///
    /// # Safety
    /// As [`mori_gpu::copy`].
    pub(crate) unsafe fn copy_on_device(
        ordinal: usize,
        dst: u64,
        src: u64,
        len: usize,
    ) -> Result<()> {
        let dev = device(ordinal, "the caller's buffer")?;
        // SAFETY: guaranteed by the caller.
        unsafe { mori_gpu::copy(dev, dst, src, len) }.map_err(|source| Error::Gpu {
            context: format!("copying {len} bytes of a buffer on CUDA device {ordinal}"),
            source: Box::new(source),
        })
    }

    impl GpuArena {
        /// Allocates an arena of `capacity_bytes` on CUDA device `device`; `capacity_bytes`
        /// must be a positive multiple of `page_bytes` (itself positive). Fails with
        /// [`Error::Gpu`] naming the device when there is no driver, no such device, or not
        /// enough device memory.
        pub fn new(device: usize, capacity_bytes: usize, page_bytes: usize) -> Result<GpuArena> {
            let pages = PageTable::new(capacity_bytes, page_bytes)?;
            let dev = self::device(device, "the GPU tier")?;
            let buf = DeviceBuffer::new(dev, capacity_bytes).map_err(|source| Error::Gpu {
                context: format!(
                    "allocating the GPU tier ({capacity_bytes} bytes) on CUDA device {device}"
                ),
                source: Box::new(source),
            })?;
            debug!(device, capacity_bytes, page_bytes, "GPU tier allocated");
            Ok(GpuArena {
                mem: Backing::Device(buf),
                pages,
            })
        }

        /// An arena in host memory, for the unit tests of the GPU tier's logic.
        #[cfg(test)]
        pub(crate) fn emulated(capacity_bytes: usize, page_bytes: usize) -> Result<GpuArena> {
            Ok(GpuArena {
                pages: PageTable::new(capacity_bytes, page_bytes)?,
                mem: Backing::Emulated(vec![0; capacity_bytes]),
            })
        }

        /// Copies `len` bytes at `src` (host or device memory) into the arena under `key`
        /// (counts as a use). A stored key gives [`Error::AlreadyExists`]; without a free run
        /// of enough contiguous pages, [`Error::NoSpace`]. Nothing is stored when the copy
        /// fails.
        ///
        /// # Safety
        /// `src` must be readable for `len` bytes.
        pub unsafe fn put_from(&mut self, key: &[u8], src: u64, len: usize) -> Result<()> {
            let offset = self.pages.insert(key, len)?;
            // SAFETY: guaranteed by the caller.
            if let Err(e) = unsafe { self.mem.write(offset, src, len) } {
                self.pages.remove(key);
                return Err(e);
            }
            Ok(())
        }

        /// Copies the value of `key` to `dst` (host or device memory of `cap` bytes, at least
        /// the value's length: [`Error::InvalidArgument`] otherwise) and returns its length.
        /// Not a use.
        ///
        /// # Safety
        /// `dst` must be writable for `cap` bytes.
        pub unsafe fn copy_out(&self, key: &[u8], dst: u64, cap: usize) -> Result<Option<usize>> {
            let Some((offset, len)) = self.pages.locate(key) else {
                return Ok(None);
            };
            if cap < len {
                return Err(too_small(cap, len as u64));
            }
            // SAFETY: guaranteed by the caller (len <= cap).
            unsafe { self.mem.read(offset, dst, len) }?;
            Ok(Some(len))
        }
    }
}

#[cfg(not(feature = "gpu"))]
mod without_cuda {
    use std::ops::{Deref, DerefMut};

    use crate::error::{Error, Result};
    use crate::pages::PageTable;

    /// The GPU tier of a build without the `gpu` feature: no value of it can exist.
    #[derive(Debug)]
    pub enum GpuArena {}

    impl Deref for GpuArena {
        type Target = PageTable;

        fn deref(&self) -> &PageTable {
            match *self {}
        }
    }

    impl DerefMut for GpuArena {
        fn deref_mut(&mut self) -> &mut PageTable {
            match *self {}
        }
    }

    impl GpuArena {
        /// Fails: this build has no GPU support.
        pub fn new(device: usize, _capacity_bytes: usize, _page_bytes: usize) -> Result<GpuArena> {
            Err(Error::InvalidArgument(format!(
                "a GPU tier (CUDA device {device}) needs mori-umbp built with the `gpu` feature"
            )))
        }

        /// Never called: no arena exists.
        ///
        /// # Safety
        /// None needed.
        pub unsafe fn put_from(&mut self, _key: &[u8], _src: u64, _len: usize) -> Result<()> {
            match *self {}
        }

        /// Never called: no arena exists.
        ///
        /// # Safety
        /// None needed.
        pub unsafe fn copy_out(
            &self,
            _key: &[u8],
            _dst: u64,
            _cap: usize,
        ) -> Result<Option<usize>> {
            match *self {}
        }
    }
}
