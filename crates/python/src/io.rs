//! Bindings of mori-io: the engine, descriptors (as bytes) and transfers.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mori_io::{Batch, EngineConfig, EngineDesc, FabricMode, Location, MemoryDesc, Op, Status};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyBytes;

use crate::buffer::host_buffer;
use crate::errors::{Error, Result};

fn location(device: i32) -> Location {
    Location::decode(device)
}

/// The address and length of `obj`'s data when it exports a one-dimensional, C-contiguous
/// buffer of native int64 (format `l` or `q`, 8-byte items: a numpy int64 array), else None
/// (with no Python error left set). The buffer is released at once: the address stays valid
/// while `obj` is alive and not resized (the caller keeps a reference).
fn int64_buffer(obj: &Bound<'_, PyAny>) -> Option<(*const u64, usize)> {
    let view = host_buffer(obj, false)?;
    (view.native_int64 && view.itemsize() == 8 && view.ndim() == 1)
        .then_some((view.ptr() as *const u64, view.len() / 8))
}

/// The address to listen on for `host`: an IP address as given, or a host name resolved to
/// its first IPv4 address (else its first address).
fn resolve_host(host: &str) -> Result<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    if host.is_empty() {
        return Err(Error::InvalidArgument("host must not be empty".into()));
    }
    let addrs: Vec<IpAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("host {host:?} cannot be resolved: {e}")))?
        .map(|a| a.ip())
        .collect();
    addrs
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| Error::InvalidArgument(format!("host {host:?} resolves to no address")))
}

#[pyclass(frozen, module = "mori._core")]
pub struct IoEngine {
    inner: Arc<mori_io::IoEngine>,
}

#[pymethods]
impl IoEngine {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (name, host="127.0.0.1", port=0, connections_per_peer=2, timeout=30.0, chunk_bytes=4194304, same_host_direct=true, cuda_ipc=true, ce_threshold=None, ipc_blocks=0, secret=None, handshake_timeout=10.0, max_connections=1024, fabric=None, fabric_provider=None, fabric_nic=None, fabric_gpu=None))]
    fn new(
        name: &str,
        host: &str,
        port: i64,
        connections_per_peer: usize,
        timeout: f64,
        chunk_bytes: u64,
        same_host_direct: bool,
        cuda_ipc: bool,
        ce_threshold: Option<u64>,
        ipc_blocks: u32,
        secret: Option<&[u8]>,
        handshake_timeout: f64,
        max_connections: usize,
        fabric: Option<&str>,
        fabric_provider: Option<String>,
        fabric_nic: Option<String>,
        fabric_gpu: Option<u32>,
    ) -> Result<Self> {
        let fabric = match fabric {
            Some(mode) => FabricMode::parse(mode)?,
            None => FabricMode::from_env()?,
        };
        let handshake_timeout = Duration::try_from_secs_f64(handshake_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                Error::InvalidArgument("handshake_timeout must be a positive number".into())
            })?;
        if max_connections == 0 {
            return Err(Error::InvalidArgument(
                "max_connections must be positive".into(),
            ));
        }
        let host = resolve_host(host)?;
        let port = u16::try_from(port)
            .map_err(|_| Error::InvalidArgument(format!("port must be in 0..65535, got {port}")))?;
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "timeout must be a positive number of seconds, got {timeout}"
            )));
        }
        let timeout = Duration::try_from_secs_f64(timeout)
            .map_err(|_| Error::InvalidArgument(format!("timeout {timeout} s is too large")))?;
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
            secret: secret
                .map(|s| mori_io::Secret::new(s.to_vec()))
                .transpose()
                .map_err(|e| Error::InvalidArgument(format!("secret: {e}")))?,
            handshake_timeout,
            max_connections,
            fabric,
            fabric_provider,
            fabric_nic,
            fabric_gpu,
            ..EngineConfig::default()
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

    #[getter]
    fn fabric_provider(&self) -> Option<String> {
        self.inner.fabric_provider().map(str::to_string)
    }

    #[getter]
    fn fabric_nic(&self) -> Option<String> {
        let nics = self.inner.fabric_nics();
        (!nics.is_empty()).then(|| nics.join(","))
    }

    /// Registers `nbytes` at `ptr` (device -1 = host memory); returns the memory descriptor.
    /// Read-only memory (`writable=False`) is refused as the target of writes and reads.
    #[pyo3(signature = (ptr, nbytes, device, writable=true))]
    fn register<'py>(
        &self,
        py: Python<'py>,
        ptr: u64,
        nbytes: u64,
        device: i32,
        writable: bool,
    ) -> Result<Bound<'py, PyBytes>> {
        let desc = if writable {
            self.inner.register(ptr, nbytes, location(device))?
        } else {
            self.inner
                .register_read_only(ptr, nbytes, location(device))?
        };
        Ok(PyBytes::new(py, &desc.to_bytes()))
    }

    /// Connections the engine's server has open now (served or in their handshake).
    #[getter]
    fn served_connections(&self) -> usize {
        self.inner.served_connections()
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

    /// Starts a batch whose three arrays are 1-D, C-contiguous int64 buffers (numpy int64
    /// arrays): they are read in place and kept alive by the transfer until it is done (the
    /// caller must not write them until then). Returns None, before doing anything, when an
    /// array is something else (a list, a tensor, another dtype): the caller converts it and
    /// calls again.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (write, local, local_offsets, remote, remote_offsets, sizes, notify=None))]
    fn submit(
        &self,
        py: Python<'_>,
        write: bool,
        local: &[u8],
        local_offsets: &Bound<'_, PyAny>,
        remote: &[u8],
        remote_offsets: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        notify: Option<&[u8]>,
    ) -> Result<Option<Transfer>> {
        let (Some(lo), Some(ro), Some(sz)) = (
            int64_buffer(local_offsets),
            int64_buffer(remote_offsets),
            int64_buffer(sizes),
        ) else {
            return Ok(None);
        };
        if lo.1 != sz.1 || ro.1 != sz.1 {
            return Err(Error::InvalidArgument(format!(
                "offset and size arrays differ in length ({}, {}, {})",
                lo.1, ro.1, sz.1
            )));
        }
        let (local, remote) = (
            MemoryDesc::from_bytes(local)?,
            MemoryDesc::from_bytes(remote)?,
        );
        let op = if write { Op::Write } else { Op::Read };
        let keep: Box<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> = Box::new((
            local_offsets.clone().unbind(),
            remote_offsets.clone().unbind(),
            sizes.clone().unbind(),
        ));
        // SAFETY: three int64 buffers of `sz.1` items (int64_buffer), kept alive by `keep` (the
        // objects that export them); mori.io documents that they must not be written until
        // the transfer is done.
        let batch = unsafe { Batch::borrowed(lo.0, ro.0, sz.0, sz.1, keep)? };
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
        Ok(Some(Transfer { inner }))
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
pub fn io_memory_desc_info(mem: &[u8]) -> Result<(String, u64, u64, i32, bool, bool, bool)> {
    let m = MemoryDesc::from_bytes(mem)?;
    Ok((
        m.engine,
        m.id,
        m.len,
        m.location.encode(),
        m.ipc.is_some(),
        m.writable,
        !m.fabric.is_empty(),
    ))
}

/// Parses an engine descriptor into (name, "host:port").
#[pyfunction]
pub fn io_engine_desc_info(desc: &[u8]) -> Result<(String, String)> {
    let d = EngineDesc::from_bytes(desc)?;
    Ok((d.name, d.addr.to_string()))
}

/// A transfer in flight (`mori.io.Transfer`): `wait(timeout)`, `done()`, `status`, `route`,
/// or `await` it.
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

    /// The path the bytes take: "tcp", "direct" (same-host process_vm copy), "local" (payloads
    /// over the same-host socket), "cuda_ipc" or "fabric" (libfabric RMA).
    #[getter]
    fn route(&self) -> &'static str {
        self.inner.route().name()
    }

    /// `await transfer`: resolves when it is done, raises its failure (mori.io's `_await`
    /// helper makes the asyncio future; a task on the completion runtime settles it).
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        static AWAIT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        AWAIT.import(slf.py(), "mori.io", "_await")?.call1((slf,))
    }

    fn __repr__(&self) -> String {
        format!("Transfer({}, {})", self.status(), self.route())
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
