//! Bindings of mori-umbp and mori-umbpd: the embedded pool, the daemon client, the daemon.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use mori_umbp::{
    GpuTierConfig, LocalPool, PoolConfig, PoolStats, PutOutcome, SsdConfig, SsdIoMode, Tier,
};
use mori_umbpd::pages::advise_huge_pages;
use mori_umbpd::small_ops::{Held, MemorySink, Sink};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffer::host_buffer;
use crate::errors::{Error, Result};

/// The embedded KV-block pool (optional GPU tier, DRAM tier, optional SSD tier, in-process
/// index).
#[pyclass(frozen, module = "mori._core")]
pub struct UmbpPool {
    inner: Mutex<Option<LocalPool>>,
}

impl UmbpPool {
    /// The pool (None once closed), locked.
    fn pool(&self) -> Result<MutexGuard<'_, Option<LocalPool>>> {
        self.inner
            .lock()
            .map_err(|_| Error::InvalidArgument("the pool's lock is poisoned".into()))
    }

    fn with<T>(&self, f: impl FnOnce(&LocalPool) -> Result<T>) -> Result<T> {
        let guard = self.pool()?;
        f(guard
            .as_ref()
            .ok_or_else(|| Error::Closed("this umbp pool".into()))?)
    }
}

/// Borrows the bytes of (key, value) pairs (extracting `Vec<u8>` would copy byte by byte).
fn borrowed_pairs<'a>(
    items: &'a [(Bound<'_, PyBytes>, Bound<'_, PyBytes>)],
) -> Vec<(&'a [u8], &'a [u8])> {
    items
        .iter()
        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
        .collect()
}

fn stats_dict<'py>(py: Python<'py>, s: &PoolStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("keys", s.keys)?;
    d.set_item("dram_keys", s.dram_keys)?;
    d.set_item("ssd_keys", s.ssd_keys)?;
    d.set_item("gpu_keys", s.gpu_keys)?;
    d.set_item("dram_capacity_bytes", s.dram_capacity_bytes)?;
    d.set_item("dram_used_bytes", s.dram_used_bytes)?;
    d.set_item("dram_value_bytes", s.dram_value_bytes)?;
    d.set_item("gpu_capacity_bytes", s.gpu_capacity_bytes)?;
    d.set_item("gpu_used_bytes", s.gpu_used_bytes)?;
    d.set_item("gpu_value_bytes", s.gpu_value_bytes)?;
    d.set_item("ssd_live_bytes", s.ssd_live_bytes)?;
    d.set_item("ssd_disk_bytes", s.ssd_disk_bytes)?;
    d.set_item("hits_gpu", s.hits_gpu)?;
    d.set_item("hits_dram", s.hits_dram)?;
    d.set_item("hits_ssd", s.hits_ssd)?;
    d.set_item("misses", s.misses)?;
    d.set_item("evictions", s.evictions)?;
    d.set_item("gpu_demotions", s.gpu_demotions)?;
    d.set_item("demotions", s.demotions)?;
    d.set_item("promotions", s.promotions)?;
    d.set_item("corrupt_dropped", s.corrupt_dropped)?;
    d.set_item(
        "ssd_recovery_corrupt_records",
        s.ssd_recovery_corrupt_records,
    )?;
    d.set_item("ssd_recovery_skipped_bytes", s.ssd_recovery_skipped_bytes)?;
    d.set_item("dram_checksum_errors", s.dram_checksum_errors)?;
    d.set_item("dram_unsealed", s.dram_unsealed)?;
    d.set_item("ssd_io", s.ssd_io.map(|b| b.as_str()))?;
    Ok(d)
}

/// # Safety
/// `ptr` must address `len` bytes that stay valid (and, for `mutable`, writable and unaliased)
/// for the returned slice's use.
unsafe fn raw_slice<'a>(ptr: usize, len: usize) -> Result<&'a mut [u8]> {
    if len == 0 {
        return Ok(&mut []);
    }
    if ptr == 0 {
        return Err(Error::InvalidArgument("null buffer address".into()));
    }
    // SAFETY: guaranteed by the caller.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) })
}

/// A new bytes object of `len` bytes, not initialised, and the address of its contents: the
/// caller fills every byte before the object is returned to Python (or drops it), so a value
/// is read straight into the object Python gets. One large enough is hinted onto huge pages
/// (mori_umbpd::pages) before it is written.
fn uninit_bytes(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyBytes>, usize)> {
    let size = pyo3::ffi::Py_ssize_t::try_from(len).map_err(|_| {
        pyo3::exceptions::PyOverflowError::new_err(format!("a value of {len} bytes"))
    })?;
    // SAFETY: with a null source, PyBytes_FromStringAndSize allocates `size` bytes left
    // uninitialised and returns a new reference, or null with an exception set (checked by
    // from_owned_ptr_or_err).
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), size),
        )
    }?;
    let bytes = obj.cast_into::<PyBytes>()?;
    // SAFETY: `bytes` is a bytes object; its buffer lives as long as the object.
    let at = unsafe { pyo3::ffi::PyBytes_AsString(bytes.as_ptr()) } as usize;
    advise_huge_pages(at, len);
    Ok((bytes, at))
}

/// The GIL kept through a short same-host get (mori-umbpd's [`Held`]): the call lets it go
/// where it may block or once the daemon is late, through the C API, and it is taken back by
/// [`GilHeld::retake`] or on drop (a panic too). While it is let go, nothing of this thread
/// touches Python but through [`GilHeld::attached`] (pyo3 still counts the GIL as held here).
struct GilHeld<'py> {
    py: Python<'py>,
    /// This thread's state while the GIL is let go; null while it is kept.
    saved: std::cell::Cell<*mut pyo3::ffi::PyThreadState>,
}

impl<'py> GilHeld<'py> {
    /// `f` with the GIL kept for it (the call lets it go where it may block), taken back when
    /// `f` returns.
    fn keep_through<R>(py: Python<'py>, f: impl FnOnce(&Self) -> R) -> R {
        let held = GilHeld {
            py,
            saved: std::cell::Cell::new(std::ptr::null_mut()),
        };
        let out = f(&held);
        held.retake();
        out
    }

    /// Takes the GIL back if the call let it go.
    fn retake(&self) {
        let saved = self.saved.replace(std::ptr::null_mut());
        if !saved.is_null() {
            // SAFETY: `saved` is this thread's state, from the PyEval_SaveThread in `release`
            // that let the GIL go; this thread has not taken it back since (`saved` was set).
            unsafe { pyo3::ffi::PyEval_RestoreThread(saved) };
        }
    }

    /// `f` with the GIL: taken back for it when let go, and let go again after.
    fn attached<R>(&self, f: impl FnOnce(Python<'py>) -> R) -> R {
        let was_released = !self.saved.get().is_null();
        self.retake();
        let out = f(self.py);
        if was_released {
            self.release();
        }
        out
    }
}

impl Held for GilHeld<'_> {
    fn release(&self) {
        if self.saved.get().is_null() {
            // SAFETY: this thread holds the GIL (`py`, not let go since: `saved` is null);
            // until `retake` nothing of it touches Python (the type's contract).
            self.saved.set(unsafe { pyo3::ffi::PyEval_SaveThread() });
        }
    }
}

impl Drop for GilHeld<'_> {
    fn drop(&mut self) {
        self.retake();
    }
}

/// How a sink gets the GIL for a moment in the middle of a call.
trait Attach {
    fn attached<R>(&self, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R;
}

/// From a call that let the GIL go (`py.detach`): taken as any thread takes it.
#[derive(Default)]
struct Detached;

impl Attach for Detached {
    fn attached<R>(&self, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        Python::attach(f)
    }
}

impl Attach for &GilHeld<'_> {
    fn attached<R>(&self, f: impl for<'py> FnOnce(Python<'py>) -> R) -> R {
        GilHeld::attached(self, f)
    }
}

/// A [`Sink`] that reads a found value straight into a new bytes object, made with the GIL
/// as `A` takes it.
#[derive(Default)]
struct BytesSink<A: Attach = Detached> {
    attach: A,
    bytes: Option<Py<PyBytes>>,
    /// Why no bytes object could be made (raised instead of the call's own error).
    error: Option<PyErr>,
}

impl<A: Attach> Sink for BytesSink<A> {
    fn buffer(&mut self, len: usize) -> std::io::Result<&mut [u8]> {
        // With the GIL: the object replaced (a get retried on another path) is dropped here.
        let bytes = &mut self.bytes;
        let made = self.attach.attached(|py| {
            uninit_bytes(py, len).map(|(b, at)| {
                *bytes = Some(b.unbind());
                at
            })
        });
        match made {
            Ok(at) => {
                // SAFETY: `at` addresses the `len` bytes of the object just made, which only
                // `self` references until the caller returns it filled.
                unsafe { raw_slice(at, len) }
                    .map_err(|_| std::io::Error::other("a bytes object without a buffer"))
            }
            Err(e) => {
                self.error = Some(e);
                Err(std::io::Error::other(format!(
                    "no bytes object of {len} bytes"
                )))
            }
        }
    }
}

impl<A: Attach> Drop for BytesSink<A> {
    /// Its Python objects go with the GIL, also when a get unwinds while it is let go.
    fn drop(&mut self) {
        let (bytes, error) = (self.bytes.take(), self.error.take());
        if bytes.is_some() || error.is_some() {
            self.attach.attached(|_| drop((bytes, error)));
        }
    }
}

impl<A: Attach> BytesSink<A> {
    /// The call's outcome as Python sees it: the filled bytes object when `found`.
    fn finish<'py>(
        mut self,
        py: Python<'py>,
        found: std::result::Result<Option<usize>, mori_umbpd::ClientError>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        match found.map_err(Error::from)? {
            None => Ok(None),
            Some(_) => self
                .bytes
                .take()
                .map(|b| Some(b.into_bound(py)))
                .ok_or_else(|| {
                    Error::InvalidArgument(
                        "a found value was not read into its bytes object".into(),
                    )
                    .into()
                }),
        }
    }
}

/// The byte ranges `offsets[i] .. offsets[i] + sizes[i]` of `n` items in a buffer of `len`
/// bytes, each checked to lie inside it.
fn host_ranges(
    n: usize,
    len: usize,
    offsets: &[u64],
    sizes: &[u64],
) -> Result<Vec<std::ops::Range<usize>>> {
    if offsets.len() != n || sizes.len() != n {
        return Err(Error::InvalidArgument(format!(
            "keys, offsets and sizes differ in length ({n}, {}, {})",
            offsets.len(),
            sizes.len()
        )));
    }
    offsets
        .iter()
        .zip(sizes)
        .enumerate()
        .map(|(i, (&o, &s))| {
            let end = o
                .checked_add(s)
                .filter(|&e| e <= len as u64)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "item {i}: [{o}, {o}+{s}) lies outside the buffer of {len} bytes"
                    ))
                })?;
            Ok(o as usize..end as usize)
        })
        .collect()
}

/// The address of a CUDA buffer of `len` bytes (null only when empty).
fn device_address(ptr: usize, len: usize) -> Result<u64> {
    if ptr == 0 && len > 0 {
        return Err(Error::InvalidArgument("null device buffer address".into()));
    }
    Ok(ptr as u64)
}

#[pymethods]
impl UmbpPool {
    #[new]
    #[pyo3(signature = (dram_bytes, page_bytes, ssd_dir=None, ssd_bytes=0, segment_bytes=0, sync_writes=false, high_watermark=0.9, low_watermark=0.7, gpu_bytes=0, gpu_device=0, ssd_io="pread"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dram_bytes: usize,
        page_bytes: usize,
        ssd_dir: Option<PathBuf>,
        ssd_bytes: u64,
        segment_bytes: u64,
        sync_writes: bool,
        high_watermark: f64,
        low_watermark: f64,
        gpu_bytes: usize,
        gpu_device: usize,
        ssd_io: &str,
    ) -> Result<Self> {
        let io = match ssd_io {
            "pread" => SsdIoMode::Pread,
            "uring" => SsdIoMode::Uring,
            "auto" => SsdIoMode::Auto,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "ssd_io must be \"pread\", \"uring\" or \"auto\", got {other:?}"
                )));
            }
        };
        let mut cfg = match ssd_dir {
            Some(dir) => PoolConfig::with_ssd(
                dram_bytes,
                page_bytes,
                SsdConfig {
                    dir,
                    segment_bytes,
                    capacity_bytes: ssd_bytes,
                    sync_writes,
                    io,
                },
            ),
            None => PoolConfig::dram_only(dram_bytes, page_bytes),
        };
        cfg.high_watermark = high_watermark;
        cfg.low_watermark = low_watermark;
        cfg.gpu = (gpu_bytes > 0).then_some(GpuTierConfig {
            device: gpu_device,
            bytes: gpu_bytes,
        });
        let (pool, _report) = py.detach(|| LocalPool::open(cfg))?;
        Ok(Self {
            inner: Mutex::new(Some(pool)),
        })
    }

    /// True if stored, False if the key already existed (that is a success: keys are immutable).
    fn put(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> Result<bool> {
        py.detach(|| self.with(|p| Ok(p.put(key, value)? == PutOutcome::Stored)))
    }

    /// `put` from `len` bytes at host address `ptr` (a buffer mori.umbp keeps alive for the call).
    fn put_from(&self, py: Python<'_>, key: &[u8], ptr: usize, len: usize) -> Result<bool> {
        py.detach(|| {
            // SAFETY: mori.umbp passes a live contiguous buffer of len bytes.
            let value = unsafe { raw_slice(ptr, len)? };
            self.with(|p| Ok(p.put(key, value)? == PutOutcome::Stored))
        })
    }

    /// `put_from` of a numpy array, bytearray or memoryview, its address read through the
    /// buffer protocol.
    fn put_from_buffer(
        &self,
        py: Python<'_>,
        key: &[u8],
        buffer: &Bound<'_, PyAny>,
    ) -> Result<bool> {
        let view = host_buffer(buffer, false)
            .ok_or_else(|| Error::InvalidArgument("buffers must be C-contiguous".into()))?;
        // Held (exported) until the call returns: `buffer` can be neither freed nor resized.
        self.put_from(py, key, view.ptr(), view.len())
    }

    /// `put` from `len` bytes of CUDA memory at `ptr` on `device` (a tensor mori.umbp keeps
    /// alive for the call).
    fn put_from_device(
        &self,
        py: Python<'_>,
        key: &[u8],
        device: usize,
        ptr: usize,
        len: usize,
    ) -> Result<bool> {
        let src = device_address(ptr, len)?;
        py.detach(|| {
            self.with(|p| {
                // SAFETY: mori.umbp passes a live contiguous CUDA tensor of len bytes; its
                // writers ran on torch's default stream or were synchronised (documented).
                let outcome = unsafe { p.put_from_device(key, device, src, len)? };
                Ok(outcome == PutOutcome::Stored)
            })
        })
    }

    /// The value, read into the bytes object returned (its length from the index first; a
    /// value removed or replaced meanwhile is read again the plain way).
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let len = py.detach(|| self.with(|p| Ok(p.location(key)?.map(|l| l.len))))?;
        let Some(len) = len.and_then(|l| usize::try_from(l).ok()) else {
            return Ok(None);
        };
        let (bytes, at) = uninit_bytes(py, len)?;
        let read = py.detach(|| {
            // SAFETY: `at` addresses the len bytes of `bytes`, referenced only here.
            let out = unsafe { raw_slice(at, len)? };
            self.with(|p| Ok(p.get_into(key, out)?))
        });
        match read {
            Ok(Some(n)) if n == len => Ok(Some(bytes)),
            Ok(None) => Ok(None),
            _ => {
                drop(bytes); // partly written: never shown
                let v = py.detach(|| self.with(|p| Ok(p.get(key)?)))?;
                Ok(v.map(|v| PyBytes::new(py, &v)))
            }
        }
    }

    /// Copies the value into `len` bytes of CUDA memory at `ptr` on `device`; returns its
    /// length, or None.
    fn get_into_device(
        &self,
        py: Python<'_>,
        key: &[u8],
        device: usize,
        ptr: usize,
        len: usize,
    ) -> Result<Option<usize>> {
        let dst = device_address(ptr, len)?;
        py.detach(|| {
            // SAFETY: mori.umbp passes a live, contiguous CUDA tensor of len bytes.
            self.with(|p| Ok(unsafe { p.get_into_device(key, device, dst, len)? }))
        })
    }

    /// Copies the value into `len` writable bytes at `ptr`; returns its length, or None.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &[u8],
        ptr: usize,
        len: usize,
    ) -> Result<Option<usize>> {
        py.detach(|| {
            // SAFETY: mori.umbp passes a live, writable contiguous buffer of len bytes.
            let out = unsafe { raw_slice(ptr, len)? };
            self.with(|p| Ok(p.get_into(key, out)?))
        })
    }

    /// `get_into` of a numpy array, bytearray or memoryview, its address read through the
    /// buffer protocol (mori.umbp's address lookup in Python cost more than the call at 4 KiB).
    fn get_into_buffer(
        &self,
        py: Python<'_>,
        key: &[u8],
        buffer: &Bound<'_, PyAny>,
    ) -> Result<Option<usize>> {
        let view = host_buffer(buffer, true).ok_or_else(|| {
            Error::InvalidArgument("get_into needs a writable, C-contiguous buffer".into())
        })?;
        // Held (exported) until the call returns: `buffer` can be neither freed nor resized.
        self.get_into(py, key, view.ptr(), view.len())
    }

    fn exists(&self, key: &[u8]) -> Result<bool> {
        self.with(|p| Ok(p.exists(key)?))
    }

    /// `put_from` of many values in one call (one pool call, the GIL released): value `i` is
    /// `sizes[i]` bytes at `offsets[i]` of the `len`-byte host buffer at `ptr`.
    fn batch_put_from_host(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        ptr: usize,
        len: usize,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
    ) -> Result<Vec<bool>> {
        py.detach(|| {
            // SAFETY: mori.umbp passes a live contiguous buffer of len bytes, kept alive and
            // not written for the call.
            let buf: &[u8] = unsafe { raw_slice(ptr, len)? };
            let ranges = host_ranges(keys.len(), len, &offsets, &sizes)?;
            let pairs: Vec<(&[u8], &[u8])> = keys
                .iter()
                .zip(&ranges)
                .map(|(k, r)| (k.as_slice(), &buf[r.clone()]))
                .collect();
            self.with(|p| {
                Ok(p.batch_put(&pairs)?
                    .into_iter()
                    .map(|o| o == PutOutcome::Stored)
                    .collect())
            })
        })
    }

    /// `get_into` of many keys in one call (the GIL released): value `i` goes to
    /// `offsets[i]` of the `len`-byte writable host buffer at `ptr`, at most `sizes[i]` bytes
    /// (a longer value raises, as `get_into`). Returns each value's length, or None.
    fn batch_get_into_host(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        ptr: usize,
        len: usize,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
    ) -> Result<Vec<Option<usize>>> {
        py.detach(|| {
            // SAFETY: mori.umbp passes a live, writable contiguous buffer of len bytes.
            let buf = unsafe { raw_slice(ptr, len)? };
            let ranges = host_ranges(keys.len(), len, &offsets, &sizes)?;
            self.with(|p| {
                keys.iter()
                    .zip(ranges)
                    .map(|(k, r)| Ok(p.get_into(k, &mut buf[r])?))
                    .collect()
            })
        })
    }

    /// `items`: (key, value) pairs of `bytes`; values are borrowed, not copied.
    fn batch_put(
        &self,
        py: Python<'_>,
        items: Vec<(Bound<'_, PyBytes>, Bound<'_, PyBytes>)>,
    ) -> Result<Vec<bool>> {
        let refs = borrowed_pairs(&items);
        py.detach(|| {
            self.with(|p| {
                Ok(p.batch_put(&refs)?
                    .into_iter()
                    .map(|o| o == PutOutcome::Stored)
                    .collect())
            })
        })
    }

    /// The values in key order. When every key is a miss or in DRAM, each value is read
    /// into the bytes object returned (lengths from the index first; a value removed or
    /// replaced meanwhile is read again the plain way); otherwise one `batch_get` (whose SSD
    /// reads go out together).
    fn batch_get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let lens = py.detach(|| {
            self.with(|p| {
                let mut lens = Vec::with_capacity(refs.len());
                for k in &refs {
                    match p.location(k)? {
                        None => lens.push(None),
                        Some(l) if l.tier == Tier::Dram => lens.push(usize::try_from(l.len).ok()),
                        Some(_) => return Ok(None),
                    }
                }
                Ok(Some(lens))
            })
        })?;
        let Some(lens) = lens else {
            let values = py.detach(|| self.with(|p| Ok(p.batch_get(&refs)?)))?;
            return Ok(values
                .into_iter()
                .map(|v| v.map(|v| PyBytes::new(py, &v)))
                .collect());
        };
        let mut made = Vec::with_capacity(lens.len());
        for len in &lens {
            made.push(len.map(|len| uninit_bytes(py, len)).transpose()?);
        }
        let slots: Vec<Option<(usize, usize)>> = made
            .iter()
            .zip(&lens)
            .map(|(m, len)| m.as_ref().zip(*len).map(|((_, at), len)| (*at, len)))
            .collect();
        let read = py.detach(|| {
            self.with(|p| {
                let mut read = Vec::with_capacity(slots.len());
                for (k, slot) in refs.iter().zip(&slots) {
                    read.push(match slot {
                        // SAFETY: `at` addresses the len bytes of a bytes object made above,
                        // referenced only by `made` until it is returned.
                        Some((at, len)) => {
                            p.get_into(k, unsafe { raw_slice(*at, *len)? })
                                .ok()
                                .flatten()
                                == Some(*len)
                        }
                        None => false,
                    });
                }
                Ok(read)
            })
        })?;
        let mut out = Vec::with_capacity(made.len());
        for ((m, ok), k) in made.into_iter().zip(read).zip(&refs) {
            out.push(match m {
                Some((bytes, _)) if ok => Some(bytes),
                // A miss in the index, or a value that changed since: read as `get` does.
                _ => py
                    .detach(|| self.with(|p| Ok(p.get(k)?)))?
                    .map(|v| PyBytes::new(py, &v)),
            });
        }
        Ok(out)
    }

    /// How many leading keys of `keys` exist (the prefix-cache probe).
    fn batch_exists_prefix(&self, keys: Vec<Vec<u8>>) -> Result<usize> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        self.with(|p| Ok(p.batch_exists_prefix(&refs)?))
    }

    fn remove(&self, py: Python<'_>, key: &[u8]) -> Result<bool> {
        py.detach(|| self.with(|p| Ok(p.remove(key)?)))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|p| Ok(p.stats())).map_err(PyErr::from)?;
        stats_dict(py, &s)
    }

    /// Writes DRAM-only and GPU values to SSD (when there is one), seals the log and closes
    /// the pool.
    /// Returns (values written, values already on SSD, values lost).
    fn close(&self, py: Python<'_>) -> Result<(usize, usize, usize)> {
        let taken = self.pool()?.take();
        match taken {
            Some(pool) => {
                let r = py.detach(|| pool.close())?;
                Ok((r.values_written, r.values_already_on_ssd, r.values_lost))
            }
            None => Ok((0, 0, 0)),
        }
    }
}

/// A client of a `umbpd` daemon (gRPC). Calls release the GIL while they wait.
/// Shared memory a daemon on this host writes values into (`mori_umbpd::shm`).
#[pyclass(frozen, module = "mori._core")]
pub struct UmbpSharedBuffer {
    inner: mori_umbpd::shm::SharedBuffer,
}

#[pymethods]
impl UmbpSharedBuffer {
    /// The buffer's address in this process.
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// Has the daemon copy the value of `key` to `offset` (at most `cap` bytes): its length,
    /// or None when absent.
    fn get_into(&self, py: Python<'_>, key: &[u8], offset: u64, cap: u64) -> Result<Option<usize>> {
        py.detach(|| self.inner.get_into(key, offset, cap))
            .map_err(|s| mori_umbpd::ClientError::Rpc(s).into())
    }

    /// Has the daemon store the `len` bytes at `offset` under `key`: whether stored (False:
    /// the key was present).
    fn put_from(&self, py: Python<'_>, key: &[u8], offset: u64, len: u64) -> Result<bool> {
        py.detach(|| self.inner.put_from(key, offset, len))
            .map_err(|s| mori_umbpd::ClientError::Rpc(s).into())
    }
}

#[pyclass(frozen, module = "mori._core")]
pub struct UmbpRemote {
    inner: mori_umbpd::Client,
    /// Buffers registered with the client's IO engine, by handle (the region id).
    registered: Mutex<HashMap<u64, mori_io::MemoryDesc>>,
}

impl UmbpRemote {
    /// The registered buffers, locked.
    fn registered(&self) -> Result<MutexGuard<'_, HashMap<u64, mori_io::MemoryDesc>>> {
        self.registered
            .lock()
            .map_err(|_| Error::InvalidArgument("the client's lock is poisoned".into()))
    }

    fn mem(&self, handle: u64) -> Result<mori_io::MemoryDesc> {
        self.registered()?
            .get(&handle)
            .cloned()
            .ok_or_else(|| Error::InvalidArgument(format!("no registered buffer {handle}")))
    }
}

#[pymethods]
impl UmbpRemote {
    /// Connects to the daemon at `addr`, proving the deployment secret: `secret` (bytes),
    /// else the file `secret_file` (mode 0600), else `MORI_SECRET_FILE` / `MORI_SECRET` / the
    /// per-user default.
    #[new]
    #[pyo3(signature = (addr, secret=None, secret_file=None))]
    fn new(
        py: Python<'_>,
        addr: &str,
        secret: Option<Bound<'_, PyBytes>>,
        secret_file: Option<PathBuf>,
    ) -> Result<Self> {
        let bad = |e: mori_auth::Error| Error::InvalidArgument(e.to_string());
        let secret = match (secret, secret_file) {
            (Some(_), Some(_)) => {
                return Err(Error::InvalidArgument(
                    "give secret or secret_file, not both".into(),
                ));
            }
            (Some(s), None) => Some(mori_auth::Secret::new(s.as_bytes().to_vec()).map_err(bad)?),
            (None, Some(p)) => Some(mori_auth::Secret::from_file(&p).map_err(bad)?),
            (None, None) => None,
        };
        let opts = mori_umbpd::ClientOptions {
            secret,
            ..mori_umbpd::ClientOptions::default()
        };
        Ok(Self {
            inner: py.detach(|| mori_umbpd::Client::connect_with(addr, &opts))?,
            registered: Mutex::new(HashMap::new()),
        })
    }

    /// Registers `len` bytes of host memory at `ptr` (kept alive by mori.umbp until
    /// `deregister`) with the client's IO engine; returns a handle.
    fn register(&self, py: Python<'_>, ptr: usize, len: usize) -> Result<u64> {
        if ptr == 0 || len == 0 {
            return Err(Error::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        // SAFETY: mori.umbp keeps the buffer (a live, writable, contiguous array of len bytes)
        // referenced until it calls deregister with the returned handle.
        let mem = py.detach(|| unsafe { self.inner.register(ptr as u64, len as u64) })?;
        let id = mem.id;
        self.registered()?.insert(id, mem);
        Ok(id)
    }

    fn deregister(&self, py: Python<'_>, handle: u64) -> Result<()> {
        let mem = self.mem(handle)?;
        py.detach(|| self.inner.deregister(&mem))?;
        self.registered()?.remove(&handle);
        Ok(())
    }

    /// Reads keys into a registered buffer; per key its length, or None.
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        handle: u64,
        offsets: Vec<u64>,
        capacities: Vec<u64>,
    ) -> Result<Vec<Option<u64>>> {
        let mem = self.mem(handle)?;
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        Ok(py.detach(|| {
            self.inner
                .batch_get_into(&refs, &mem, &offsets, &capacities)
        })?)
    }

    /// Stores keys with values read from a registered buffer.
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Vec<u8>>,
        handle: u64,
        offsets: Vec<u64>,
        lens: Vec<u64>,
    ) -> Result<Vec<bool>> {
        let mem = self.mem(handle)?;
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        Ok(py.detach(|| self.inner.batch_put_from(&refs, &mem, &offsets, &lens))?)
    }

    fn put(&self, py: Python<'_>, key: &[u8], value: &[u8]) -> Result<bool> {
        // The GIL kept as in `get`.
        Ok(GilHeld::keep_through(py, |held| {
            self.inner.put_held(key, value, held)
        })?)
    }

    /// Keeps the GIL while a same-host get is answered within mori-umbpd's `hold_for()`
    /// (`GilHeld`): several Python threads' small gets then run one after another on the
    /// thread that has the GIL, without a handoff between CPUs per get.
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Option<Bound<'py, PyBytes>>> {
        GilHeld::keep_through(py, |held| {
            let mut sink = BytesSink {
                attach: held,
                bytes: None,
                error: None,
            };
            let found = self.inner.get_with_held(key, &mut sink, held);
            held.retake(); // before the sink's objects are handed to Python
            sink.finish(py, found)
        })
    }

    fn exists(&self, py: Python<'_>, key: &[u8]) -> Result<bool> {
        Ok(py.detach(|| self.inner.exists(key))?)
    }

    /// A buffer of `nbytes` shared with a daemon on this host, which copies values straight
    /// into it (`UmbpSharedBuffer.get_into`).
    fn shared_buffer(&self, py: Python<'_>, nbytes: usize) -> Result<UmbpSharedBuffer> {
        Ok(UmbpSharedBuffer {
            inner: py.detach(|| self.inner.shared_buffer(nbytes))?,
        })
    }

    /// Copies the value into `len` writable bytes at `ptr` (a small host buffer; mori.umbp
    /// sends larger registered ones over the data plane); its length, or None. Over small ops
    /// the answer is read from the socket straight into the buffer.
    fn get_into(
        &self,
        py: Python<'_>,
        key: &[u8],
        ptr: usize,
        len: usize,
    ) -> Result<Option<usize>> {
        // SAFETY: mori.umbp passes a live, writable contiguous buffer of `len` bytes, which it
        // keeps during the call.
        let mut sink = unsafe { MemorySink::new(ptr, len) };
        // The GIL kept as in `get`.
        Ok(GilHeld::keep_through(py, |held| {
            self.inner.get_with_held(key, &mut sink, held)
        })?)
    }

    fn batch_put(
        &self,
        py: Python<'_>,
        items: Vec<(Bound<'_, PyBytes>, Bound<'_, PyBytes>)>,
    ) -> Result<Vec<bool>> {
        let refs = borrowed_pairs(&items);
        Ok(py.detach(|| self.inner.batch_put(&refs))?)
    }

    /// Each found value is read into a new bytes object (over small ops straight from the
    /// socket).
    fn batch_get<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<Vec<u8>>,
    ) -> PyResult<Vec<Option<Bound<'py, PyBytes>>>> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut sinks: Vec<BytesSink> = keys.iter().map(|_| BytesSink::default()).collect();
        let found = py.detach(|| {
            let mut dyn_sinks: Vec<&mut dyn Sink> =
                sinks.iter_mut().map(|s| s as &mut dyn Sink).collect();
            self.inner.batch_get_with(&refs, &mut dyn_sinks)
        });
        match found {
            Ok(found) => sinks
                .into_iter()
                .zip(found)
                .map(|(sink, f)| sink.finish(py, Ok(f)))
                .collect(),
            // A sink that could not make its bytes object says why first.
            Err(e) => match sinks.iter_mut().find_map(|s| s.error.take()) {
                Some(why) => Err(why),
                None => Err(Error::from(e).into()),
            },
        }
    }

    fn batch_exists_prefix(&self, py: Python<'_>, keys: Vec<Vec<u8>>) -> Result<usize> {
        let refs: Vec<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        Ok(py.detach(|| self.inner.batch_exists_prefix(&refs))?)
    }

    fn remove(&self, py: Python<'_>, key: &[u8]) -> Result<bool> {
        Ok(py.detach(|| self.inner.remove(key))?)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.stats()).map_err(Error::from)?;
        stats_dict(py, &s)
    }
}

/// Parses a size as the daemon's flags do (`4096`, `64M`, `8GiB`; mori-umbpd's parser).
#[pyfunction]
pub fn parse_size(text: &str) -> Result<u64> {
    mori_umbpd::config::parse_size(text).map_err(Error::InvalidArgument)
}

/// None where the SSD tier can use io_uring (a ring is set up and makes a no-op round trip);
/// otherwise the kernel's reason.
#[pyfunction]
pub fn uring_unavailable(py: Python<'_>) -> Option<String> {
    py.detach(|| {
        mori_umbp::ssd_io::probe_uring()
            .err()
            .map(|e| e.to_string())
    })
}

/// Runs the `umbpd` daemon in this process with `argv` (the arguments after the program name)
/// until it stops, without the GIL, and returns its exit code. Logs follow `UMBP_LOG` meanwhile.
/// Errors are printed by the daemon and reflected in the code, as for the binary.
#[pyfunction]
pub fn umbpd_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    crate::with_log_filter(mori_umbpd::cli::log_filter(), || {
        py.detach(|| mori_umbpd::run_cli(argv))
    })
}
