//! Legacy CUDA IPC: share a cuMemAlloc'd (or cudaMalloc'd) allocation with another process.

use cudarc::driver::sys;

use crate::device::Device;
use crate::driver::check;
use crate::error::{Error, Result};

/// Size of a driver IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;
/// Size of a serialised [`IpcExport`].
pub const IPC_EXPORT_BYTES: usize = IPC_HANDLE_BYTES + 16;

/// What another process needs to map a pointer of ours: the handle of the whole allocation
/// plus the pointer's offset inside it (allocators such as torch's sub-allocate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpcExport {
    pub handle: [u8; IPC_HANDLE_BYTES],
    /// Offset of the exported pointer from the allocation's base.
    pub offset: u64,
    /// Size of the whole allocation.
    pub allocation_size: u64,
}

impl IpcExport {
    /// Exports the allocation that contains `ptr` (a device pointer of `device`).
    pub fn new(device: Device, ptr: u64) -> Result<Self> {
        device.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes two out-values; the driver validates ptr.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        // SAFETY: CUipcMemHandle is plain bytes.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: base is the start of a cuMemAlloc allocation of the current context.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        let mut bytes = [0u8; IPC_HANDLE_BYTES];
        for (dst, src) in bytes.iter_mut().zip(handle.reserved.iter()) {
            *dst = *src as u8;
        }
        Ok(Self {
            handle: bytes,
            offset: ptr - base,
            allocation_size: size as u64,
        })
    }

    pub fn to_bytes(&self) -> [u8; IPC_EXPORT_BYTES] {
        let mut out = [0u8; IPC_EXPORT_BYTES];
        out[..IPC_HANDLE_BYTES].copy_from_slice(&self.handle);
        out[IPC_HANDLE_BYTES..IPC_HANDLE_BYTES + 8].copy_from_slice(&self.offset.to_le_bytes());
        out[IPC_HANDLE_BYTES + 8..].copy_from_slice(&self.allocation_size.to_le_bytes());
        out
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != IPC_EXPORT_BYTES {
            return Err(Error::InvalidArgument(format!(
                "an IPC export is {IPC_EXPORT_BYTES} bytes, got {}",
                b.len()
            )));
        }
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        handle.copy_from_slice(&b[..IPC_HANDLE_BYTES]);
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        Ok(Self {
            handle,
            offset: word(IPC_HANDLE_BYTES),
            allocation_size: word(IPC_HANDLE_BYTES + 8),
        })
    }
}

/// Another process's allocation mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    device: Device,
    base: u64,
    export: IpcExport,
}

impl IpcMapping {
    /// Maps `export` into `device`'s context (peer access is enabled lazily by the driver).
    pub fn open(device: Device, export: &IpcExport) -> Result<Self> {
        device.bind()?;
        // SAFETY: CUipcMemHandle is plain bytes.
        let mut handle: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (dst, src) in handle.reserved.iter_mut().zip(export.handle.iter()) {
            *dst = *src as std::ffi::c_char;
        }
        let mut base = 0u64;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: writes one pointer; the driver validates the handle.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut base, handle, flags)
        })?;
        Ok(Self {
            device,
            base,
            export: export.clone(),
        })
    }

    /// The exported pointer, as seen in this process.
    pub fn ptr(&self) -> u64 {
        self.base + self.export.offset
    }
    /// Bytes from [`ptr`](Self::ptr) to the end of the allocation.
    pub fn len(&self) -> usize {
        (self.export.allocation_size - self.export.offset) as usize
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn device(&self) -> Device {
        self.device
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let closed = self.device.bind().and_then(|()| {
            // SAFETY: base came from cuIpcOpenMemHandle and is closed once.
            check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.base)
            })
        });
        if let Err(e) = closed {
            tracing::warn!("closing IPC mapping {:#x}: {e}", self.base);
        }
    }
}
