//! VMM allocations (cuMemCreate + reserve + map + set access) that can be exported to other
//! processes as POSIX file descriptors, and imported from them.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::Duration;

use cudarc::driver::sys;

use crate::device::Device;
use crate::driver::check;
use crate::error::{Error, Result};
use crate::fdpass;

fn allocation_prop(owner: Device) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct; all-zero is its documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = owner.ordinal() as i32;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop
}

/// Allocation granularity (bytes) for exportable memory on `device`.
pub fn granularity(device: Device) -> Result<usize> {
    let prop = allocation_prop(device);
    let mut g = 0usize;
    let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: writes one size_t; prop is fully initialised.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut g, &prop, option)
    })?;
    Ok(g)
}

/// A reserved range of device virtual addresses (no memory behind it); freed on drop.
#[derive(Debug)]
pub struct VaRange {
    base: u64,
    size: usize,
}

impl VaRange {
    /// Reserves `size` bytes of VA aligned to `alignment` (0 = the driver's default).
    pub fn reserve(size: usize, alignment: usize) -> Result<Self> {
        let mut base = 0u64;
        // SAFETY: writes one address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, alignment, 0, 0)
        })?;
        Ok(Self { base, size })
    }
    pub fn base(&self) -> u64 {
        self.base
    }
    pub fn len(&self) -> usize {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        // SAFETY: the range was reserved by us and is freed once (mappings inside it drop first).
        if let Err(e) = check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.base, self.size)
        }) {
            tracing::warn!("freeing VA range {:#x}: {e}", self.base);
        }
    }
}

/// Physical device memory (exportable as a file descriptor), created here or imported; released
/// on drop (the memory itself lives until every process that maps it has released it).
#[derive(Debug)]
pub struct PhysicalMemory {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    /// Device whose memory holds the bytes, in this process's numbering.
    owner_ordinal: usize,
}

impl PhysicalMemory {
    /// Creates `size` bytes (a multiple of [`granularity`]) on `device`.
    pub fn create(device: Device, size: usize) -> Result<Self> {
        device.bind()?;
        let prop = allocation_prop(device);
        let mut handle = 0;
        // SAFETY: writes one handle; prop is fully initialised.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        Ok(Self {
            handle,
            size,
            owner_ordinal: device.ordinal(),
        })
    }

    /// Imports memory another process exported as `fd` (`size` bytes on `owner_ordinal`).
    pub fn import(fd: OwnedFd, size: usize, owner_ordinal: usize) -> Result<Self> {
        let mut handle = 0;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX FDs the driver takes the descriptor value itself as the handle.
        let imported = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as isize as *mut c_void,
                kind,
            )
        };
        check("cuMemImportFromShareableHandle", imported)?;
        // The driver holds its own reference now; our copy of the descriptor can close.
        drop(fd);
        Ok(Self {
            handle,
            size,
            owner_ordinal,
        })
    }

    /// A POSIX file descriptor another process can import.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut raw: i32 = -1;
        let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        // SAFETY: for POSIX FDs the driver writes an int descriptor to the out-pointer.
        let status = unsafe {
            sys::cuMemExportToShareableHandle(
                &mut raw as *mut i32 as *mut c_void,
                self.handle,
                kind,
                0,
            )
        };
        check("cuMemExportToShareableHandle", status)?;
        // SAFETY: the driver created this descriptor for us; we now own it.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }

    pub fn len(&self) -> usize {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    pub fn owner_ordinal(&self) -> usize {
        self.owner_ordinal
    }
}

impl Drop for PhysicalMemory {
    fn drop(&mut self) {
        // SAFETY: the handle is ours and released once, after its mappings (which drop first).
        if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) }) {
            tracing::warn!("releasing physical memory: {e}");
        }
    }
}

/// `memory` mapped at `va`; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    va: u64,
    size: usize,
}

impl Mapping {
    /// Maps all of `memory` at `va` and grants each of `access` read/write access.
    ///
    /// # Safety
    /// `va .. va + memory.len()` must lie inside a [`VaRange`] that outlives the mapping and must
    /// not be mapped already.
    pub unsafe fn new(va: u64, memory: &PhysicalMemory, access: &[Device]) -> Result<Self> {
        // SAFETY: guaranteed by the caller; the handle covers memory.len() bytes.
        check("cuMemMap", unsafe {
            sys::cuMemMap(va, memory.size, 0, memory.handle, 0)
        })?;
        let mapping = Self {
            va,
            size: memory.size,
        };
        mapping.grant_access(access)?;
        Ok(mapping)
    }

    /// Grants read/write access to the mapping for each of `devices`.
    pub fn grant_access(&self, devices: &[Device]) -> Result<()> {
        let descs: Vec<sys::CUmemAccessDesc> = devices
            .iter()
            .map(|d| {
                // SAFETY: plain C struct, zero is a valid start.
                let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                desc.location.id = d.ordinal() as i32;
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                desc
            })
            .collect();
        // SAFETY: the range is mapped; descs outlives the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.va, self.size, descs.as_ptr(), descs.len())
        })
    }

    pub fn va(&self) -> u64 {
        self.va
    }
    pub fn len(&self) -> usize {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by Mapping::new and is unmapped once.
        if let Err(e) = check("cuMemUnmap", unsafe { sys::cuMemUnmap(self.va, self.size) }) {
            tracing::warn!("unmapping {:#x}: {e}", self.va);
        }
    }
}

/// Exportable device memory at its own VA range: one [`PhysicalMemory`] in one [`Mapping`].
#[derive(Debug)]
pub struct VmmAllocation {
    device: Device,
    // Drop order matters: unmap, then release the memory, then free the VA.
    mapping: Mapping,
    memory: PhysicalMemory,
    _range: VaRange,
}

impl VmmAllocation {
    /// Allocates at least `len` bytes on `device` (rounded up to the granularity), mapped and
    /// accessible from `device`.
    pub fn new(device: Device, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate 0 bytes of VMM memory".into(),
            ));
        }
        device.bind()?;
        let g = granularity(device)?;
        Self::map(device, PhysicalMemory::create(device, len.div_ceil(g) * g)?)
    }

    /// Imports memory exported by another process as `fd` (`len` bytes, held on the device with
    /// ordinal `owner_ordinal` in *this* process's numbering) and maps it for `device`.
    pub fn import(device: Device, fd: OwnedFd, len: usize, owner_ordinal: usize) -> Result<Self> {
        device.bind()?;
        Self::map(device, PhysicalMemory::import(fd, len, owner_ordinal)?)
    }

    fn map(device: Device, memory: PhysicalMemory) -> Result<Self> {
        let range = VaRange::reserve(memory.len(), 0)?;
        // SAFETY: the range was just reserved for exactly this memory and outlives the mapping
        // (field order in VmmAllocation).
        let mapping = unsafe { Mapping::new(range.base(), &memory, &[device])? };
        Ok(Self {
            device,
            mapping,
            memory,
            _range: range,
        })
    }

    /// Grants read/write access to the mapping for each of `devices`.
    pub fn grant_access(&self, devices: &[Device]) -> Result<()> {
        self.mapping.grant_access(devices)
    }

    /// Exports the physical memory as a POSIX file descriptor another process can import.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        self.memory.export_fd()
    }

    /// Sends this allocation to the one process that calls [`receive`](Self::receive) on `path`.
    pub fn send(&self, path: &Path, timeout: Duration) -> Result<()> {
        let fd = self.export_fd()?;
        fdpass::serve_fd(
            path,
            fd.as_raw_fd(),
            &(self.len() as u64).to_le_bytes(),
            timeout,
        )
    }

    /// Receives an allocation sent with [`send`](Self::send) and maps it for `device`.
    /// `owner_ordinal` is the holder's ordinal in this process (for peer access bookkeeping).
    pub fn receive(
        device: Device,
        path: &Path,
        owner_ordinal: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let (fd, payload) = fdpass::receive_fd(path, timeout)?;
        let size: [u8; 8] = payload.as_slice().try_into().map_err(|_| {
            Error::InvalidArgument(format!(
                "VMM fd message carried {} bytes, expected 8",
                payload.len()
            ))
        })?;
        Self::import(device, fd, u64::from_le_bytes(size) as usize, owner_ordinal)
    }

    pub fn ptr(&self) -> u64 {
        self.mapping.va()
    }
    pub fn len(&self) -> usize {
        self.memory.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn owner_ordinal(&self) -> usize {
        self.memory.owner_ordinal()
    }
}
