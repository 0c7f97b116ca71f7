//! Device memory (cuMemAlloc), pinned host memory (cuMemHostAlloc) and plain copies.

use std::ffi::c_void;

use cudarc::driver::sys;

use crate::device::Device;
use crate::driver::check;
use crate::error::{Error, Result};
use crate::stream::StreamHandle;

/// A device allocation owned by this process, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Device,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (uninitialised) on `device`. `len` may not be 0.
    pub fn new(device: Device, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate 0 bytes of device memory".into(),
            ));
        }
        device.bind()?;
        let mut ptr = 0;
        // SAFETY: writes one device pointer; the context is current.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        Ok(Self { device, ptr, len })
    }

    pub fn device(&self) -> Device {
        self.device
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let freed = self.device.bind().and_then(|()| {
            // SAFETY: ptr came from cuMemAlloc and is freed exactly once.
            check("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) })
        });
        if let Err(e) = freed {
            tracing::warn!("leaking device allocation {:#x}: {e}", self.ptr);
        }
    }
}

/// Page-locked host memory, mapped into every context (portable), freed on drop.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access hands out only raw pointers/slices under the usual borrow rules.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory (zero-filled). `len` may not be 0.
    pub fn new(device: Device, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate 0 bytes of pinned memory".into(),
            ));
        }
        device.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: writes one host pointer; the context is current.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut ptr, len, flags)
        })?;
        // SAFETY: the allocation is len bytes long and exclusively ours.
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, len) };
        Ok(Self {
            ptr: ptr as *mut u8,
            len,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for len bytes and we hold the only mutable borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemHostAlloc and is freed exactly once.
        if let Err(e) = check("cuMemFreeHost", unsafe {
            sys::cuMemFreeHost(self.ptr as *mut c_void)
        }) {
            tracing::warn!("leaking pinned allocation {:p}: {e}", self.ptr);
        }
    }
}

/// Copies host bytes into device memory at `dst` and returns once they have arrived (other
/// processes and peers see them from then on).
///
/// # Safety
/// `dst` must be device memory (or a mapped peer/IPC/VMM address) valid for `src.len()` bytes.
pub unsafe fn copy_host_to_device(device: Device, dst: u64, src: &[u8]) -> Result<()> {
    if src.is_empty() {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: the caller guarantees dst; src is a live slice.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const c_void, src.len())
    })?;
    // From pageable memory cuMemcpyHtoD returns once the bytes are staged, possibly before
    // the DMA has written them: a peer told "done" right after could still see the old bytes
    // (or have its own later write overwritten by ours, as a zero-fill on a GPU shared by
    // eight processes did).
    // SAFETY: the null stream is the legacy default stream of the current context.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}

/// Copies device bytes at `src` into host memory (synchronous).
///
/// # Safety
/// `src` must be device memory (or a mapped address) valid for `dst.len()` bytes.
pub unsafe fn copy_device_to_host(device: Device, dst: &mut [u8], src: u64) -> Result<()> {
    if dst.is_empty() {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: the caller guarantees src; dst is a live mutable slice.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src, dst.len())
    })
}

/// Copies `len` bytes from `src` to `dst` and returns once they have arrived. Unified
/// addressing: either end may be host memory (pageable or pinned) or device memory of any
/// device. The copy runs on the legacy default stream, so it starts after work queued there
/// earlier (torch's default stream); work on other streams is the caller's to synchronise.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes, and the ranges must not overlap.
pub unsafe fn copy(device: Device, dst: u64, src: u64, len: usize) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: the caller guarantees both ranges; the context is current.
    check("cuMemcpy", unsafe { sys::cuMemcpy(dst, src, len) })?;
    // cuMemcpy may return before a device-to-device copy (or the DMA of a staged host-to-device
    // copy) has finished.
    // SAFETY: the null stream is the legacy default stream of the current context.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}

/// Enqueues a copy of `len` bytes on `stream` with the copy engine (unified addressing: any
/// combination of device, peer and pinned host pointers).
///
/// # Safety
/// Both ranges must stay valid until the copy has run.
pub unsafe fn copy_async(
    device: Device,
    dst: u64,
    src: u64,
    len: usize,
    stream: StreamHandle,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: the caller guarantees both ranges; the stream belongs to device's context.
    check("cuMemcpyAsync", unsafe {
        sys::cuMemcpyAsync(dst, src, len, stream.raw())
    })
}

/// Enqueues a byte fill of `len` bytes at `dst` on `stream`.
///
/// # Safety
/// `dst` must be valid device memory for `len` bytes until the fill has run.
pub unsafe fn memset_async(
    device: Device,
    dst: u64,
    value: u8,
    len: usize,
    stream: StreamHandle,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    device.bind()?;
    // SAFETY: as documented above.
    check("cuMemsetD8Async", unsafe {
        sys::cuMemsetD8Async(dst, value, len, stream.raw())
    })
}
