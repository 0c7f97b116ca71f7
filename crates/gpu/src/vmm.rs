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

/// Physical memory mapped at a reserved virtual range, owned or imported; unmapped on drop.
#[derive(Debug)]
pub struct VmmAllocation {
    device: Device,
    /// Device whose memory holds the bytes.
    owner_ordinal: usize,
    handle: sys::CUmemGenericAllocationHandle,
    va: u64,
    size: usize,
}

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
        let size = len.div_ceil(g) * g;
        let prop = allocation_prop(device);
        let mut handle = 0;
        // SAFETY: writes one handle; prop is fully initialised.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        Self::map(device, device.ordinal(), handle, size)
    }

    /// Imports memory exported by another process as `fd` (`len` bytes, held on the device with
    /// ordinal `owner_ordinal` in *this* process's numbering) and maps it for `device`.
    pub fn import(device: Device, fd: OwnedFd, len: usize, owner_ordinal: usize) -> Result<Self> {
        device.bind()?;
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
        Self::map(device, owner_ordinal, handle, len)
    }

    /// Reserves a VA range, maps `handle` there and grants `device` read/write access.
    /// Releases the handle on failure.
    fn map(
        device: Device,
        owner_ordinal: usize,
        handle: sys::CUmemGenericAllocationHandle,
        size: usize,
    ) -> Result<Self> {
        let mut va = 0u64;
        // SAFETY: writes one address; size is a multiple of the granularity.
        let reserved = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, size, 0, 0, 0)
        });
        if let Err(e) = reserved {
            // SAFETY: handle is ours and unmapped.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // Built now so that Drop undoes whatever part of the mapping succeeded.
        let alloc = Self {
            device,
            owner_ordinal,
            handle,
            va,
            size,
        };
        // SAFETY: va..va+size is reserved by us and handle covers size bytes.
        check("cuMemMap", unsafe { sys::cuMemMap(va, size, 0, handle, 0) })?;
        alloc.grant_access(&[device])?;
        Ok(alloc)
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

    /// Exports the physical memory as a POSIX file descriptor another process can import.
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

    /// Sends this allocation to the one process that calls [`receive`](Self::receive) on `path`.
    pub fn send(&self, path: &Path, timeout: Duration) -> Result<()> {
        let fd = self.export_fd()?;
        fdpass::serve_fd(
            path,
            fd.as_raw_fd(),
            &(self.size as u64).to_le_bytes(),
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
        self.va
    }
    pub fn len(&self) -> usize {
        self.size
    }
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn owner_ordinal(&self) -> usize {
        self.owner_ordinal
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        // Each step is attempted even if an earlier one failed; failures are logged.
        // SAFETY: va/size/handle are ours; unmapping an unmapped range only returns an error.
        let steps = unsafe {
            [
                check("cuMemUnmap", sys::cuMemUnmap(self.va, self.size)),
                check(
                    "cuMemAddressFree",
                    sys::cuMemAddressFree(self.va, self.size),
                ),
                check("cuMemRelease", sys::cuMemRelease(self.handle)),
            ]
        };
        for e in steps.into_iter().filter_map(|r| r.err()) {
            tracing::warn!("releasing VMM allocation {:#x}: {e}", self.va);
        }
    }
}
