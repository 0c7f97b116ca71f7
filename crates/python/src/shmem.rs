//! Bindings of mori-shmem: the session, user modules, registered buffers.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use mori_gpu::jit::{Function, KernelSpec, Module};
use mori_gpu::kernels::{LaunchConfig, launch_packed};
use mori_gpu::{Device, StreamHandle};
use pyo3::prelude::*;

use crate::bootstrap::Bootstrap;
use crate::errors::{Error, Result};

pub(crate) fn finalized() -> Error {
    Error::InvalidArgument("this mori.shmem session was finalized".into())
}

/// This process's PE. `finalize()` ends it; methods then raise.
#[pyclass(frozen, module = "mori._core")]
pub struct Shmem {
    pub(crate) inner: Arc<Mutex<Option<mori_shmem::Shmem>>>,
}

impl Shmem {
    pub(crate) fn with<T>(&self, f: impl FnOnce(&mori_shmem::Shmem) -> Result<T>) -> Result<T> {
        let guard: MutexGuard<'_, _> = self.inner.lock().map_err(|_| finalized())?;
        f(guard.as_ref().ok_or_else(finalized)?)
    }
}

#[pymethods]
impl Shmem {
    /// `window_size`: the proxy window's least size in bytes (None: the default), see
    /// `mori_shmem::Shmem::init_with_window`.
    #[new]
    #[pyo3(signature = (bootstrap, device_ordinal, heap_size, window_size=None))]
    fn new(
        py: Python<'_>,
        bootstrap: &Bootstrap,
        device_ordinal: usize,
        heap_size: u64,
        window_size: Option<u64>,
    ) -> Result<Self> {
        let bs = bootstrap.inner.clone();
        let shmem = py.detach(|| -> Result<_> {
            Ok(mori_shmem::Shmem::init_with_window(
                bs,
                Device::get(device_ordinal)?,
                heap_size,
                window_size,
            )?)
        })?;
        Ok(Self {
            inner: Arc::new(Mutex::new(Some(shmem))),
        })
    }

    #[getter]
    fn my_pe(&self) -> Result<usize> {
        self.with(|s| Ok(s.my_pe()))
    }
    #[getter]
    fn n_pes(&self) -> Result<usize> {
        self.with(|s| Ok(s.n_pes()))
    }
    /// (first PE of this node, PEs on this node, this PE's index on the node)
    #[getter]
    fn node_team(&self) -> Result<(usize, usize, usize)> {
        self.with(|s| {
            let t = s.node_team();
            Ok((t.first_pe, t.n_pes, t.my_index))
        })
    }
    /// Every node's PEs, nodes ordered by their first PE.
    #[getter]
    fn nodes(&self) -> Result<Vec<Vec<usize>>> {
        self.with(|s| Ok(s.nodes().to_vec()))
    }
    #[getter]
    fn device(&self) -> Result<usize> {
        self.with(|s| Ok(s.device().ordinal()))
    }
    #[getter]
    fn heap_base(&self) -> Result<u64> {
        self.with(|s| Ok(s.heap_base()))
    }
    #[getter]
    fn heap_size(&self) -> Result<u64> {
        self.with(|s| Ok(s.heap_size()))
    }
    /// Base address of each PE's heap as mapped here (0 = not load/store reachable).
    #[getter]
    fn peer_bases(&self) -> Result<Vec<u64>> {
        self.with(|s| Ok(s.state().peer_base[..s.n_pes()].to_vec()))
    }

    fn malloc(&self, py: Python<'_>, size: u64, align: u64) -> Result<u64> {
        py.detach(|| self.with(|s| Ok(s.malloc(size, align)?)))
    }
    fn calloc(&self, py: Python<'_>, size: u64, align: u64) -> Result<u64> {
        py.detach(|| self.with(|s| Ok(s.calloc(size, align)?)))
    }
    fn free(&self, py: Python<'_>, offset: u64) -> Result<()> {
        py.detach(|| self.with(|s| Ok(s.free(offset)?)))
    }
    /// This PE's proxy window: (address, size); (0, 0) without a proxy.
    #[getter]
    fn window(&self) -> Result<(u64, u64)> {
        self.with(|s| Ok((s.state().window_base, s.state().window_size)))
    }
    fn window_calloc(&self, py: Python<'_>, size: u64, align: u64) -> Result<u64> {
        py.detach(|| self.with(|s| Ok(s.window_calloc(size, align)?)))
    }
    fn window_free(&self, py: Python<'_>, offset: u64) -> Result<()> {
        py.detach(|| self.with(|s| Ok(s.window_free(offset)?)))
    }
    /// (allocation start offset, allocation size, offset of addr) for a local heap address.
    fn locate(&self, addr: u64) -> Result<Option<(u64, u64, u64)>> {
        self.with(|s| Ok(s.locate(addr)))
    }
    fn peer_addr(&self, offset: u64, pe: usize) -> Result<Option<u64>> {
        self.with(|s| Ok(s.peer_addr(offset, pe)))
    }
    fn barrier_all(&self, py: Python<'_>) -> Result<()> {
        py.detach(|| self.with(|s| Ok(s.barrier_all()?)))
    }
    /// Raises the proxy's failure, if it failed.
    fn check(&self) -> Result<()> {
        self.with(|s| Ok(s.check()?))
    }
    /// Whether PEs this GPU cannot load/store are reached through the proxy.
    #[getter]
    fn has_proxy(&self) -> Result<bool> {
        self.with(|s| Ok(s.has_proxy()))
    }
    fn barrier_all_on_stream(&self, stream: usize) -> Result<()> {
        self.with(|s| Ok(s.barrier_all_on_stream(StreamHandle::from_raw(stream))?))
    }

    /// Compiles (cached) and loads user CUDA source for this session. `name` names the module
    /// in errors; the cache key also covers the source text.
    fn load_source(&self, py: Python<'_>, name: &str, source: &str) -> Result<ShmemModule> {
        // The variant name must change with the code (loaded modules are looked up by name).
        let digest = mori_gpu::jit::cache_key(source, &[], "", (0, 0), &[]);
        let spec = KernelSpec {
            name: format!("user/{name}/{}", &digest[..16]),
            file: name.to_string().into(),
            source: source.to_string().into(),
            defines: Vec::new(),
        };
        let module = py.detach(|| self.with(|s| Ok(s.load(&spec)?)))?;
        Ok(ShmemModule {
            session: self.inner.clone(),
            module,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Loads one of mori's own kernel variants (e.g. "ep/intranode") for this session.
    fn load_variant(&self, py: Python<'_>, name: &str) -> Result<ShmemModule> {
        let spec = mori_gpu::kernels::variants()
            .into_iter()
            .find(|v| v.name == name)
            .ok_or_else(|| Error::InvalidArgument(format!("no kernel variant named {name:?}")))?;
        let module = py.detach(|| self.with(|s| Ok(s.load(&spec)?)))?;
        Ok(ShmemModule {
            session: self.inner.clone(),
            module,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// Collective: maps every reachable PE's (ptr, len) buffer here (legacy IPC).
    fn register(&self, py: Python<'_>, ptr: u64, len: u64) -> Result<Registered> {
        let r = py.detach(|| self.with(|s| Ok(s.register(ptr, len)?)))?;
        Ok(Registered { inner: r })
    }

    /// Collective: waits for all PEs, then releases the heap (mappings, memory, sockets).
    fn finalize(&self, py: Python<'_>) -> Result<()> {
        let taken = self.inner.lock().map_err(|_| finalized())?.take();
        match taken {
            Some(s) => Ok(py.detach(|| s.finalize())?),
            None => Ok(()),
        }
    }

    #[getter]
    fn active(&self) -> bool {
        self.inner.lock().map(|g| g.is_some()).unwrap_or(false)
    }
}

/// A user module loaded for a shmem session.
#[pyclass(frozen, module = "mori._core")]
pub struct ShmemModule {
    pub(crate) session: Arc<Mutex<Option<mori_shmem::Shmem>>>,
    pub(crate) module: Module,
    functions: Mutex<HashMap<String, Function>>,
}

#[pymethods]
impl ShmemModule {
    /// Launches `entry` with its parameters packed in `params` (C layout).
    #[pyo3(signature = (entry, grid, block, params, shared_mem=0, stream=0))]
    fn launch(
        &self,
        entry: &str,
        grid: u32,
        block: u32,
        params: &[u8],
        shared_mem: u32,
        stream: usize,
    ) -> Result<()> {
        if self.session.lock().map_err(|_| finalized())?.is_none() {
            return Err(finalized());
        }
        let f = {
            let mut functions = self.functions.lock().map_err(|_| finalized())?;
            match functions.get(entry) {
                Some(f) => *f,
                None => {
                    let f = self.module.function(entry)?;
                    functions.insert(entry.to_string(), f);
                    f
                }
            }
        };
        let mut params = params.to_vec();
        let cfg = LaunchConfig {
            grid,
            block,
            shared_mem_bytes: shared_mem,
        };
        // SAFETY: mori.shmem packs params from the caller's arguments; matching them to the
        // kernel's signature is the caller's contract, as with any CUDA launch.
        Ok(unsafe { launch_packed(f, cfg, StreamHandle::from_raw(stream), &mut params) }?)
    }
}

/// A buffer registered on every PE; `peer(pe)` gives that PE's copy as mapped here.
#[pyclass(frozen, module = "mori._core")]
pub struct Registered {
    inner: mori_shmem::Registered,
}

#[pymethods]
impl Registered {
    fn peer(&self, pe: usize) -> Option<(u64, u64)> {
        self.inner.peer(pe)
    }
}
