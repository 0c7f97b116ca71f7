//! Bindings of mori-io: the engine, descriptors (as bytes) and transfers.

use std::net::IpAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mori_io::{Batch, EngineConfig, EngineDesc, Location, MemoryDesc, Op, Status};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{Error, Result};
use crate::gpu::host_u64s;

fn location(device: i32) -> Location {
    Location::decode(device)
}

#[pyclass(frozen, module = "mori._core")]
pub struct IoEngine {
    inner: Arc<mori_io::IoEngine>,
}

#[pymethods]
impl IoEngine {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, host="127.0.0.1", port=0, connections_per_peer=2, timeout=30.0, chunk_bytes=4194304, same_host_direct=true, cuda_ipc=true, ce_threshold=None, ipc_blocks=0))]
    fn new(
        name: &str,
        host: &str,
        port: u16,
        connections_per_peer: usize,
        timeout: f64,
        chunk_bytes: u64,
        same_host_direct: bool,
        cuda_ipc: bool,
        ce_threshold: Option<u64>,
        ipc_blocks: u32,
    ) -> Result<Self> {
        let host: IpAddr = host
            .parse()
            .map_err(|_| Error::InvalidArgument(format!("{host:?} is not an IP address")))?;
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|_| Error::InvalidArgument("timeout must be a non-negative number".into()))?;
        let cfg = EngineConfig {
            host,
            port,
            connections_per_peer,
            timeout,
            chunk_bytes,
            same_host_direct,
            cuda_ipc,
            ce_threshold: ce_threshold.unwrap_or_else(mori_io::ce_threshold_from_env),
            ipc_blocks,
        };
        Ok(Self {
            inner: Arc::new(mori_io::IoEngine::new(name, cfg)?),
        })
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name().to_string()
    }

    #[getter]
    fn desc<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.desc().to_bytes())
    }

    /// Registers `nbytes` at `ptr` (device -1 = host memory); returns the memory descriptor.
    fn register<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        nbytes: u64,
        device: i32,
    ) -> Result<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(
            py,
            &self
                .inner
                .register(ptr, nbytes, location(device))?
                .to_bytes(),
        ))
    }

    fn deregister(&self, py: Python<'_>, mem: &[u8]) -> Result<()> {
        let mem = MemoryDesc::from_bytes(mem)?;
        py.detach(|| Ok(self.inner.deregister(&mem)?))
    }

    /// Connects to the engine described by `desc`; returns its name.
    fn connect(&self, py: Python<'_>, desc: &[u8]) -> Result<String> {
        let desc = EngineDesc::from_bytes(desc)?;
        py.detach(|| self.inner.connect(&desc))?;
        Ok(desc.name)
    }

    fn disconnect(&self, name: &str) -> Result<()> {
        Ok(self.inner.disconnect(name)?)
    }

    fn is_connected(&self, name: &str) -> bool {
        self.inner.is_connected(name)
    }

    /// `*_ptr` are contiguous int64 arrays of `count` items. With `keep` (the arrays, or an
    /// object holding them), the transfer reads them in place and keeps `keep` alive until it
    /// is done (the caller must not write them until then); without it they are copied.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (write, local, local_offsets_ptr, remote, remote_offsets_ptr, sizes_ptr, count, notify=None, keep=None))]
    fn transfer(
        &self,
        py: Python<'_>,
        write: bool,
        local: &[u8],
        local_offsets_ptr: usize,
        remote: &[u8],
        remote_offsets_ptr: usize,
        sizes_ptr: usize,
        count: usize,
        notify: Option<&[u8]>,
        keep: Option<Py<PyAny>>,
    ) -> Result<Transfer> {
        let (local, remote) = (
            MemoryDesc::from_bytes(local)?,
            MemoryDesc::from_bytes(remote)?,
        );
        let op = if write { Op::Write } else { Op::Read };
        let (lo, ro, sz) = (
            local_offsets_ptr as *const u64,
            remote_offsets_ptr as *const u64,
            sizes_ptr as *const u64,
        );
        let batch = match keep {
            // SAFETY: mori.io passes contiguous int64 arrays of `count` items held by `keep`,
            // and documents that they must not be written until the transfer is done.
            Some(keep) => unsafe { Batch::borrowed(lo, ro, sz, count, Box::new(keep))? },
            None => {
                // SAFETY: contiguous int64 arrays of `count` items, alive during this call.
                let (lo, ro, sz) = unsafe {
                    (
                        host_u64s(local_offsets_ptr, count)?,
                        host_u64s(remote_offsets_ptr, count)?,
                        host_u64s(sizes_ptr, count)?,
                    )
                };
                Batch::owned(lo.to_vec(), ro.to_vec(), sz.to_vec())?
            }
        };
        let run = || {
            self.inner
                .transfer_batch(op, &local, &remote, batch, notify)
        };
        // TCP and same-host submissions only check and queue (tens of µs): keeping the GIL is
        // cheaper than handing it over and waiting to get it back. A cuda_ipc submission may
        // open an IPC mapping or compile a kernel on first use: it runs detached.
        let inner = if remote.ipc.is_some() {
            py.detach(run)?
        } else {
            run()?
        };
        Ok(Transfer { inner })
    }

    /// Notifications received so far, as (engine name, tag) pairs; each is returned once.
    fn take_notifications<'py>(&self, py: Python<'py>) -> Vec<(String, Bound<'py, PyBytes>)> {
        self.inner
            .take_notifications()
            .into_iter()
            .map(|n| (n.from, PyBytes::new(py, &n.tag)))
            .collect()
    }
}

/// Parses a memory descriptor into (engine, id, nbytes, device, exported for CUDA IPC).
#[pyfunction]
pub fn io_memory_desc_info(mem: &[u8]) -> Result<(String, u64, u64, i32, bool)> {
    let m = MemoryDesc::from_bytes(mem)?;
    Ok((m.engine, m.id, m.len, m.location.encode(), m.ipc.is_some()))
}

/// Parses an engine descriptor into (name, "host:port").
#[pyfunction]
pub fn io_engine_desc_info(desc: &[u8]) -> Result<(String, String)> {
    let d = EngineDesc::from_bytes(desc)?;
    Ok((d.name, d.addr.to_string()))
}

#[pyclass(frozen, module = "mori._core")]
pub struct Transfer {
    inner: mori_io::Transfer,
}

#[pymethods]
impl Transfer {
    /// Waits (GIL released); True when done, False when `timeout` passed first; raises on failure.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> Result<bool> {
        let timeout = timeout.map(|t| Duration::from_secs_f64(t.max(0.0)));
        py.detach(|| self.inner.wait(timeout))
            .map_err(Error::TransferFailed)
    }

    fn done(&self) -> bool {
        self.inner.done()
    }

    /// "pending", "done" or "failed".
    #[getter]
    fn status(&self) -> &'static str {
        match self.inner.status() {
            Status::Pending => "pending",
            Status::Done => "done",
            Status::Failed(_) => "failed",
        }
    }

    /// The path the bytes take: "tcp", "direct" (same-host process_vm copy) or "cuda_ipc".
    #[getter]
    fn route(&self) -> &'static str {
        self.inner.route().name()
    }

    /// Raises the failure if the transfer failed; None otherwise.
    fn raise_if_failed(&self) -> Result<()> {
        match self.inner.status() {
            Status::Failed(f) => Err(Error::TransferFailed(f)),
            _ => Ok(()),
        }
    }

    /// Calls `callback()` (with the GIL) once the transfer finishes. A task on mori.io's
    /// completion runtime (tokio) awaits the transfer and runs it, so connection threads never
    /// wait for the GIL.
    fn add_done_callback(&self, callback: Py<PyAny>) -> Result<()> {
        let finished = self.inner.finished();
        completion_runtime()?.spawn(async move {
            let _ = finished.await;
            // At interpreter shutdown there is nobody left to tell.
            Python::try_attach(|py| {
                if let Err(e) = callback.call0(py) {
                    e.print(py);
                }
            });
        });
        Ok(())
    }
}

/// The tokio runtime that completes Python awaitables and callbacks (one worker: every
/// callback needs the GIL anyway). Started on first use, kept for the life of the process.
fn completion_runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("mori-io-complete")
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| {
        Error::Io(mori_io::Error::Io {
            context: "starting the mori.io completion runtime".into(),
            source: std::io::Error::other(e.clone()),
        })
    })
}
