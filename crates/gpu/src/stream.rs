//! Streams (owned, or borrowed from another library such as torch), events and stream memory
//! operations (cuStreamWriteValue / cuStreamWaitValue).

use std::time::Duration;

use cudarc::driver::sys;

use crate::device::Device;
use crate::driver::check;
use crate::error::{Error, Result};

/// A raw `CUstream` value: 0 is the legacy default stream. It may belong to torch or any other
/// library sharing the primary context; mori never destroys a stream through a handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamHandle(usize);

impl StreamHandle {
    /// Wraps a raw stream value, e.g. `torch.cuda.current_stream().cuda_stream`.
    pub fn from_raw(raw: usize) -> Self {
        Self(raw)
    }
    pub fn as_raw(&self) -> usize {
        self.0
    }
    pub(crate) fn raw(&self) -> sys::CUstream {
        self.0 as sys::CUstream
    }

    /// Blocks until all work enqueued on the stream has finished.
    pub fn synchronize(&self, device: Device) -> Result<()> {
        device.bind()?;
        // SAFETY: the stream belongs to device's context.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw())
        })
    }
}

/// A non-blocking stream created (and destroyed) by mori.
#[derive(Debug)]
pub struct Stream {
    device: Device,
    handle: StreamHandle,
}

impl Stream {
    pub fn new(device: Device) -> Result<Self> {
        Self::create(device, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    }

    /// A stream ordered with the legacy default stream (the one torch uses unless told
    /// otherwise): its work starts after work queued there earlier, and the reverse.
    pub fn new_blocking(device: Device) -> Result<Self> {
        Self::create(device, sys::CUstream_flags::CU_STREAM_DEFAULT as u32)
    }

    fn create(device: Device, flags: u32) -> Result<Self> {
        device.bind()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one stream handle; the context is current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut raw, flags)
        })?;
        Ok(Self {
            device,
            handle: StreamHandle(raw as usize),
        })
    }
    pub fn handle(&self) -> StreamHandle {
        self.handle
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn synchronize(&self) -> Result<()> {
        self.handle.synchronize(self.device)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by Stream::new and is destroyed once.
        if let Err(e) = check("cuStreamDestroy", unsafe {
            sys::cuStreamDestroy_v2(self.handle.raw())
        }) {
            tracing::warn!("destroying stream: {e}");
        }
    }
}

/// A CUDA event, optionally recording timestamps.
#[derive(Debug)]
pub struct Event {
    device: Device,
    raw: sys::CUevent,
}

// SAFETY: events are process-global driver handles, usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; the driver synchronises concurrent use.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(device: Device, timing: bool) -> Result<Self> {
        device.bind()?;
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT as u32
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one event handle; the context is current.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags)
        })?;
        Ok(Self { device, raw })
    }

    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        self.device.bind()?;
        // SAFETY: event and stream belong to the same context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw())
        })
    }

    /// Whether all work captured by the last `record` has completed.
    pub fn query(&self) -> Result<bool> {
        self.device.bind()?;
        // SAFETY: valid event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            status => check("cuEventQuery", status).map(|()| false),
        }
    }

    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Makes `stream` wait for this event.
    pub fn wait_on(&self, stream: StreamHandle) -> Result<()> {
        self.device.bind()?;
        // SAFETY: valid event and stream.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream.raw(), self.raw, 0)
        })
    }

    /// Time between `start` and this event (both recorded and completed).
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        let mut ms = 0f32;
        // SAFETY: both events are valid; the driver checks they completed.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw)
        })?;
        Ok(Duration::from_secs_f64(f64::from(ms) / 1e3))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is destroyed once.
        if let Err(e) = check("cuEventDestroy", unsafe {
            sys::cuEventDestroy_v2(self.raw)
        }) {
            tracing::warn!("destroying event: {e}");
        }
    }
}

/// Comparison used by [`stream_wait_value32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitCondition {
    /// `(int32)(*addr - value) >= 0`: wrap-around safe "at least".
    Geq,
    Eq,
    /// `(*addr & value) != 0`.
    And,
    /// `~(*addr | value) != 0`.
    Nor,
}

impl WaitCondition {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "geq" | ">=" => Self::Geq,
            "eq" | "==" => Self::Eq,
            "and" | "&" => Self::And,
            "nor" => Self::Nor,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown wait condition {other:?}: use 'geq', 'eq', 'and' or 'nor'"
                )));
            }
        })
    }
    fn flags(self) -> u32 {
        use sys::CUstreamWaitValue_flags::*;
        (match self {
            Self::Geq => CU_STREAM_WAIT_VALUE_GEQ,
            Self::Eq => CU_STREAM_WAIT_VALUE_EQ,
            Self::And => CU_STREAM_WAIT_VALUE_AND,
            Self::Nor => CU_STREAM_WAIT_VALUE_NOR,
        }) as u32
    }
}

/// Enqueues a 32-bit write of `value` to `addr` on `stream` (ordered after earlier work).
///
/// # Safety
/// `addr` must be a 4-byte aligned device (or mapped host) address valid until the write runs.
pub unsafe fn stream_write_value32(
    device: Device,
    stream: StreamHandle,
    addr: u64,
    value: u32,
) -> Result<()> {
    device.bind()?;
    // SAFETY: the caller guarantees addr.
    check("cuStreamWriteValue32", unsafe {
        sys::cuStreamWriteValue32_v2(stream.raw(), addr, value, 0)
    })
}

/// Enqueues a wait on `stream` until the 32-bit word at `addr` satisfies `cond` against `value`.
///
/// # Safety
/// `addr` must be a 4-byte aligned device (or mapped host) address valid until the wait ends.
pub unsafe fn stream_wait_value32(
    device: Device,
    stream: StreamHandle,
    addr: u64,
    value: u32,
    cond: WaitCondition,
) -> Result<()> {
    device.bind()?;
    // SAFETY: the caller guarantees addr.
    check("cuStreamWaitValue32", unsafe {
        sys::cuStreamWaitValue32_v2(stream.raw(), addr, value, cond.flags())
    })
}
