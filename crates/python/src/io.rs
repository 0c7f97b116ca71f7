//! Bindings of mori-io: the engine, descriptors (as bytes) and transfers.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use mori_io::{EngineConfig, EngineDesc, Location, MemoryDesc, Op, Status};
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

    /// `*_ptr` are contiguous int64 arrays of `count` items, kept alive by the caller.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (write, local, local_offsets_ptr, remote, remote_offsets_ptr, sizes_ptr, count, notify=None))]
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
    ) -> Result<Transfer> {
        let (local, remote) = (
            MemoryDesc::from_bytes(local)?,
            MemoryDesc::from_bytes(remote)?,
        );
        let op = if write { Op::Write } else { Op::Read };
        py.detach(|| {
            // SAFETY: mori.io passes contiguous int64 arrays of `count` items that it keeps alive.
            let (lo, ro, sz) = unsafe {
                (
                    host_u64s(local_offsets_ptr, count)?,
                    host_u64s(remote_offsets_ptr, count)?,
                    host_u64s(sizes_ptr, count)?,
                )
            };
            Ok(Transfer {
                inner: self
                    .inner
                    .transfer(op, &local, lo, &remote, ro, sz, notify)?,
            })
        })
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

    /// Calls `callback()` (with the GIL) once the transfer finishes, from mori's thread.
    fn add_done_callback(&self, callback: Py<PyAny>) {
        self.inner.on_done(Box::new(move || {
            Python::attach(|py| {
                if let Err(e) = callback.call0(py) {
                    e.print(py);
                }
            })
        }));
    }
}
