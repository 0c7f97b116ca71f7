//! Bindings of mori-gpu: devices, memory, streams, sharing and the copy kernels.
//!
//! Functions taking raw addresses (`ptr`, `stream`) are private API: the Python layer
//! (`mori.gpu`) derives them from live tensors/buffers that it keeps referenced for the call.

use std::path::PathBuf;
use std::time::Duration;

use mori_gpu as g;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{Error, Result};

#[pyfunction]
pub fn driver_version(py: Python<'_>) -> Result<(i32, i32)> {
    Ok(py.detach(g::driver_version)?)
}

#[pyfunction]
pub fn device_count(py: Python<'_>) -> Result<usize> {
    Ok(py.detach(g::device_count)?)
}

#[pyfunction]
pub fn nvrtc_version(py: Python<'_>) -> Result<(i32, i32)> {
    Ok(py.detach(g::nvrtc::version)?)
}

/// Folders to search for libnvrtc before the CUDA toolkit (e.g. the PyPI wheel's lib folder).
#[pyfunction]
pub fn add_nvrtc_search_dirs(dirs: Vec<PathBuf>) {
    g::nvrtc::add_search_dirs(dirs);
}

fn device(ordinal: usize) -> Result<g::Device> {
    Ok(g::Device::get(ordinal)?)
}

/// Runs `f` on device `ordinal` with the GIL released.
fn on_device<T: Send>(
    py: Python<'_>,
    ordinal: usize,
    f: impl FnOnce(g::Device) -> g::Result<T> + Send,
) -> Result<T> {
    py.detach(|| Ok(f(device(ordinal)?)?))
}

/// Facts about one device, as a dict.
#[pyfunction]
pub fn device_info<'py>(py: Python<'py>, ordinal: usize) -> PyResult<Bound<'py, PyDict>> {
    let (name, arch, sms, mem, bus) = py
        .detach(|| -> Result<_> {
            let d = device(ordinal)?;
            Ok((
                d.name()?,
                d.arch()?,
                d.multiprocessor_count()?,
                d.total_memory()?,
                d.pci_bus_id()?,
            ))
        })
        .map_err(PyErr::from)?;
    let info = PyDict::new(py);
    info.set_item("ordinal", ordinal)?;
    info.set_item("name", name)?;
    info.set_item("arch", arch)?;
    info.set_item("multiprocessor_count", sms)?;
    info.set_item("total_memory", mem)?;
    info.set_item("pci_bus_id", bus)?;
    Ok(info)
}

#[pyfunction]
pub fn can_access_peer(py: Python<'_>, ordinal: usize, peer: usize) -> Result<bool> {
    py.detach(|| Ok(device(ordinal)?.can_access_peer(&device(peer)?)?))
}

#[pyfunction]
pub fn enable_peer_access(py: Python<'_>, ordinal: usize, peer: usize) -> Result<()> {
    py.detach(|| Ok(device(ordinal)?.enable_peer_access(&device(peer)?)?))
}

#[pyfunction]
pub fn synchronize(py: Python<'_>, ordinal: usize) -> Result<()> {
    on_device(py, ordinal, |d| d.synchronize())
}

#[pyfunction]
pub fn stream_synchronize(py: Python<'_>, ordinal: usize, stream: usize) -> Result<()> {
    on_device(py, ordinal, |d| {
        g::StreamHandle::from_raw(stream).synchronize(d)
    })
}

/// Device memory allocated with cuMemAlloc, freed when the object is collected.
#[pyclass(frozen, module = "mori._core")]
pub struct DeviceBuffer {
    inner: g::DeviceBuffer,
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize, nbytes: usize) -> Result<Self> {
        let inner = on_device(py, device_ordinal, |d| g::DeviceBuffer::new(d, nbytes))?;
        Ok(Self { inner })
    }
    #[getter]
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }
    #[getter]
    fn device(&self) -> usize {
        self.inner.device().ordinal()
    }
}

/// Page-locked host memory, freed when the object is collected.
#[pyclass(frozen, module = "mori._core")]
pub struct PinnedBuffer {
    inner: g::PinnedBuffer,
}

#[pymethods]
impl PinnedBuffer {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize, nbytes: usize) -> Result<Self> {
        let inner = on_device(py, device_ordinal, |d| g::PinnedBuffer::new(d, nbytes))?;
        Ok(Self { inner })
    }
    #[getter]
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }
}

/// Copies `data` to device address `ptr` (synchronous).
#[pyfunction]
pub fn memcpy_htod(py: Python<'_>, device_ordinal: usize, ptr: u64, data: &[u8]) -> Result<()> {
    // SAFETY: mori.gpu passes the address of a live allocation at least len(data) long.
    on_device(py, device_ordinal, |d| unsafe {
        g::copy_host_to_device(d, ptr, data)
    })
}

/// Reads `nbytes` from device address `ptr` (synchronous).
#[pyfunction]
pub fn memcpy_dtoh(
    py: Python<'_>,
    device_ordinal: usize,
    ptr: u64,
    nbytes: usize,
) -> Result<Py<PyBytes>> {
    let mut out = vec![0u8; nbytes];
    // SAFETY: mori.gpu passes the address of a live allocation at least nbytes long.
    on_device(py, device_ordinal, |d| unsafe {
        g::copy_device_to_host(d, &mut out, ptr)
    })?;
    Ok(PyBytes::new(py, &out).unbind())
}

/// Enqueues a copy-engine copy (cuMemcpyAsync) of `nbytes` from `src` to `dst` on `stream`.
#[pyfunction]
pub fn copy_engine_async(
    py: Python<'_>,
    device_ordinal: usize,
    dst: u64,
    src: u64,
    nbytes: usize,
    stream: usize,
) -> Result<()> {
    let stream = g::StreamHandle::from_raw(stream);
    // SAFETY: mori.gpu passes addresses of live allocations covering nbytes.
    on_device(py, device_ordinal, |d| unsafe {
        g::copy_async(d, dst, src, nbytes, stream)
    })
}

/// Enqueues mori's SM copy kernel on `stream`, run by device `device_ordinal`.
#[pyfunction]
#[pyo3(signature = (device_ordinal, dst, src, nbytes, stream, blocks=None, threads=512, unroll=4, method="vector"))]
#[allow(clippy::too_many_arguments)]
pub fn copy_kernel_async(
    py: Python<'_>,
    device_ordinal: usize,
    dst: u64,
    src: u64,
    nbytes: u64,
    stream: usize,
    blocks: Option<u32>,
    threads: u32,
    unroll: u32,
    method: &str,
) -> Result<()> {
    let method = g::kernels::CopyMethod::parse(method)?;
    py.detach(|| {
        let d = device(device_ordinal)?;
        let blocks = match blocks {
            Some(b) => b,
            None => d.multiprocessor_count()?,
        };
        let cfg = g::kernels::CopyConfig {
            method,
            blocks,
            threads,
            unroll,
        };
        // SAFETY: mori.gpu passes addresses of live allocations covering nbytes.
        Ok(unsafe {
            g::kernels::copy_async(d, dst, src, nbytes, g::StreamHandle::from_raw(stream), cfg)
        }?)
    })
}

/// Reads `count` u64 values at host address `ptr` (a contiguous int64 numpy array).
///
/// # Safety
/// `ptr` must point to `count` readable, 8-byte aligned u64 values that outlive the slice.
pub(crate) unsafe fn host_u64s<'a>(ptr: usize, count: usize) -> Result<&'a [u64]> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr == 0 || !ptr.is_multiple_of(8) {
        return Err(Error::InvalidArgument(format!(
            "offset array address {ptr:#x} is null or not 8-byte aligned"
        )));
    }
    // SAFETY: guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts(ptr as *const u64, count) })
}

/// Batched gather/scatter copies on one device (one launch per batch).
#[pyclass(frozen, module = "mori._core")]
pub struct GatherScatter {
    inner: g::kernels::GatherScatter,
}

#[pymethods]
impl GatherScatter {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize) -> Result<Self> {
        let inner = on_device(py, device_ordinal, g::kernels::GatherScatter::new)?;
        Ok(Self { inner })
    }

    /// `*_offsets_ptr`/`sizes_ptr` are addresses of contiguous int64 arrays of `count` items,
    /// kept alive by the caller for the duration of this call.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (dst, dst_len, src, src_len, dst_offsets_ptr, src_offsets_ptr, sizes_ptr, count, stream, blocks))]
    fn enqueue(
        &self,
        py: Python<'_>,
        dst: u64,
        dst_len: u64,
        src: u64,
        src_len: u64,
        dst_offsets_ptr: usize,
        src_offsets_ptr: usize,
        sizes_ptr: usize,
        count: usize,
        stream: usize,
        blocks: u32,
    ) -> Result<()> {
        py.detach(|| {
            // SAFETY: mori.gpu passes contiguous int64 arrays of `count` items it keeps alive.
            let (d_off, s_off, sizes) = unsafe {
                (
                    host_u64s(dst_offsets_ptr, count)?,
                    host_u64s(src_offsets_ptr, count)?,
                    host_u64s(sizes_ptr, count)?,
                )
            };
            let regions = g::kernels::Regions {
                dst,
                dst_len,
                src,
                src_len,
            };
            // SAFETY: mori.gpu passes live regions of the stated sizes; items were bounds-checked.
            Ok(unsafe {
                self.inner.enqueue(
                    regions,
                    s_off,
                    d_off,
                    sizes,
                    g::StreamHandle::from_raw(stream),
                    blocks,
                )
            }?)
        })
    }
}

/// A non-blocking stream owned by mori.
#[pyclass(frozen, module = "mori._core")]
pub struct Stream {
    inner: g::Stream,
}

#[pymethods]
impl Stream {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize) -> Result<Self> {
        let inner = on_device(py, device_ordinal, g::Stream::new)?;
        Ok(Self { inner })
    }
    #[getter]
    fn handle(&self) -> usize {
        self.inner.handle().as_raw()
    }
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| self.inner.synchronize())?)
    }
}

#[pyclass(frozen, module = "mori._core")]
pub struct Event {
    inner: g::Event,
}

#[pymethods]
impl Event {
    #[new]
    #[pyo3(signature = (device_ordinal, timing=true))]
    fn new(py: Python<'_>, device_ordinal: usize, timing: bool) -> Result<Self> {
        let inner = on_device(py, device_ordinal, |d| g::Event::new(d, timing))?;
        Ok(Self { inner })
    }
    fn record(&self, stream: usize) -> Result<()> {
        Ok(self.inner.record(g::StreamHandle::from_raw(stream))?)
    }
    fn query(&self) -> Result<bool> {
        Ok(self.inner.query()?)
    }
    fn synchronize(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| self.inner.synchronize())?)
    }
    fn wait_on(&self, stream: usize) -> Result<()> {
        Ok(self.inner.wait_on(g::StreamHandle::from_raw(stream))?)
    }
    /// Milliseconds from `start` to this event.
    fn elapsed_ms(&self, start: &Event) -> Result<f64> {
        Ok(self.inner.elapsed_since(&start.inner)?.as_secs_f64() * 1e3)
    }
}

/// Exports the allocation holding device pointer `ptr` for another process (80 bytes).
#[pyfunction]
pub fn ipc_export(py: Python<'_>, device_ordinal: usize, ptr: u64) -> Result<Py<PyBytes>> {
    let export = on_device(py, device_ordinal, |d| g::IpcExport::new(d, ptr))?;
    Ok(PyBytes::new(py, &export.to_bytes()).unbind())
}

/// Another process's allocation mapped here through a legacy IPC handle.
#[pyclass(frozen, module = "mori._core")]
pub struct IpcMapping {
    inner: g::IpcMapping,
}

#[pymethods]
impl IpcMapping {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize, export: &[u8]) -> Result<Self> {
        let export = g::IpcExport::from_bytes(export)?;
        let inner = on_device(py, device_ordinal, |d| g::IpcMapping::open(d, &export))?;
        Ok(Self { inner })
    }
    #[getter]
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }
}

/// A VMM allocation (owned, or imported from another process through a file descriptor).
#[pyclass(frozen, module = "mori._core")]
pub struct VmmAllocation {
    inner: g::VmmAllocation,
}

#[pymethods]
impl VmmAllocation {
    #[new]
    fn new(py: Python<'_>, device_ordinal: usize, nbytes: usize) -> Result<Self> {
        let inner = on_device(py, device_ordinal, |d| g::VmmAllocation::new(d, nbytes))?;
        Ok(Self { inner })
    }

    /// Waits (up to `timeout` s) for one process to connect to the Unix socket `path`, and
    /// passes it this allocation's file descriptor.
    fn send(&self, py: Python<'_>, path: PathBuf, timeout: f64) -> Result<()> {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        Ok(py.detach(|| self.inner.send(&path, timeout))?)
    }

    /// Receives an allocation sent with `send` on `path` and maps it for `device_ordinal`.
    #[staticmethod]
    fn receive(
        py: Python<'_>,
        device_ordinal: usize,
        path: PathBuf,
        owner_ordinal: usize,
        timeout: f64,
    ) -> Result<Self> {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        let inner = on_device(py, device_ordinal, |d| {
            g::VmmAllocation::receive(d, &path, owner_ordinal, timeout)
        })?;
        Ok(Self { inner })
    }

    /// Grants these devices read/write access to the mapping.
    fn grant_access(&self, py: Python<'_>, device_ordinals: Vec<usize>) -> Result<()> {
        py.detach(|| {
            let devices = device_ordinals
                .into_iter()
                .map(device)
                .collect::<Result<Vec<_>>>()?;
            Ok(self.inner.grant_access(&devices)?)
        })
    }

    #[getter]
    fn ptr(&self) -> u64 {
        self.inner.ptr()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }
    #[getter]
    fn device(&self) -> usize {
        self.inner.device().ordinal()
    }
}

/// Enqueues a 32-bit write of `value` at `ptr` on `stream`.
#[pyfunction]
pub fn stream_write_value32(
    device_ordinal: usize,
    stream: usize,
    ptr: u64,
    value: u32,
) -> Result<()> {
    // SAFETY: mori.gpu passes a live, 4-byte aligned device address.
    Ok(unsafe {
        g::stream_write_value32(
            device(device_ordinal)?,
            g::StreamHandle::from_raw(stream),
            ptr,
            value,
        )
    }?)
}

/// Enqueues a wait on `stream` until the word at `ptr` satisfies `condition` against `value`.
#[pyfunction]
pub fn stream_wait_value32(
    device_ordinal: usize,
    stream: usize,
    ptr: u64,
    value: u32,
    condition: &str,
) -> Result<()> {
    let cond = g::WaitCondition::parse(condition)?;
    // SAFETY: mori.gpu passes a live, 4-byte aligned device address.
    Ok(unsafe {
        g::stream_wait_value32(
            device(device_ordinal)?,
            g::StreamHandle::from_raw(stream),
            ptr,
            value,
            cond,
        )
    }?)
}
