//! CUDA devices and their primary contexts.
//!
//! mori always works in a device's primary context, the same one the CUDA runtime (and so
//! PyTorch) uses, so pointers and streams pass freely between mori and torch.

use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::driver::{check, device_count, ensure_driver};
use crate::error::{Error, Result};

/// A retained primary context. Context handles are process-wide and may be used from any thread.
#[derive(Clone, Copy)]
struct PrimaryContext(sys::CUcontext);
// SAFETY: a CUcontext is an opaque process-global handle; the driver synchronises its use.
unsafe impl Send for PrimaryContext {}
// SAFETY: as above.
unsafe impl Sync for PrimaryContext {}

/// One CUDA device of this process, with its primary context retained for the process lifetime.
#[derive(Clone, Copy)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
    ctx: PrimaryContext,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({})", self.ordinal)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.ordinal == other.ordinal
    }
}
impl Eq for Device {}

impl Device {
    /// Opens device `ordinal`, retaining its primary context on first use.
    pub fn get(ordinal: usize) -> Result<Device> {
        ensure_driver()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidArgument(format!(
                "CUDA device {ordinal} does not exist: this process sees {count} device(s)"
            )));
        }
        static CONTEXTS: OnceLock<Mutex<Vec<Option<Device>>>> = OnceLock::new();
        let table = CONTEXTS.get_or_init(|| Mutex::new(vec![None; count]));
        let mut table = table.lock().map_err(|_| poisoned())?;
        if let Some(dev) = table[ordinal] {
            return Ok(dev);
        }
        let mut raw = 0;
        // SAFETY: writes one CUdevice; ordinal was range-checked.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut raw, ordinal as i32)
        })?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: writes one context handle; it stays retained for the process lifetime.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, raw)
        })?;
        let dev = Device {
            ordinal,
            raw,
            ctx: PrimaryContext(ctx),
        };
        table[ordinal] = Some(dev);
        Ok(dev)
    }

    /// The device's index in this process (after CUDA_VISIBLE_DEVICES).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this device's primary context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: the context is retained for the process lifetime.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx.0)
        })
    }

    fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int for a valid device.
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut v, attr, self.raw)
        })?;
        Ok(v)
    }

    /// Compute capability as (major, minor), e.g. (9, 0) on H100/H200.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use sys::CUdevice_attribute::*;
        Ok((
            self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// The NVRTC architecture name for this device, e.g. `sm_90`.
    pub fn arch(&self) -> Result<String> {
        let (major, minor) = self.compute_capability()?;
        Ok(format!("sm_{major}{minor}"))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessor_count(&self) -> Result<u32> {
        Ok(
            self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                as u32,
        )
    }

    /// Marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the driver writes at most buf.len() bytes including the NUL.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.raw)
        })?;
        Ok(c_buf_to_string(&buf))
    }

    /// PCI bus id in the driver's format, e.g. "0000:18:00.0".
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 64];
        // SAFETY: the driver writes at most buf.len() bytes including the NUL.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.raw)
        })?;
        Ok(c_buf_to_string(&buf).to_lowercase())
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0;
        // SAFETY: writes one size_t.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut bytes, self.raw)
        })?;
        Ok(bytes)
    }

    /// Whether kernels on this device can load/store `peer`'s memory directly.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer == self {
            return Ok(true);
        }
        let mut v = 0;
        // SAFETY: writes one int for two valid devices.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut v, self.raw, peer.raw)
        })?;
        Ok(v != 0)
    }

    /// Lets this device's context map `peer`'s allocations (cudaMalloc-style memory).
    /// Enabling twice is not an error.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer == self {
            return Ok(());
        }
        if !self.can_access_peer(peer)? {
            return Err(Error::InvalidArgument(format!(
                "device {} cannot access device {} directly (no P2P path)",
                self.ordinal, peer.ordinal
            )));
        }
        self.bind()?;
        // SAFETY: both contexts are retained primary contexts.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.0, 0) } {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            status => check("cuCtxEnablePeerAccess", status),
        }
    }

    /// Waits for all work on this device's primary context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments; the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

fn c_buf_to_string(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

pub(crate) fn poisoned() -> Error {
    Error::InvalidArgument("an earlier panic poisoned mori-gpu's internal state".into())
}
