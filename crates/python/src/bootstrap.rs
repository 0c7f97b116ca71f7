//! Bindings of mori-bootstrap.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{Error, Result};

fn duration(seconds: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        Error::InvalidArgument(format!(
            "timeout must be a non-negative number of seconds, got {seconds}"
        ))
    })
}

/// A fresh 128-byte unique id; this process hosts the rendezvous root it names.
#[pyfunction]
pub fn get_unique_id(py: Python<'_>) -> Result<Py<PyBytes>> {
    let id = py.detach(mori_bootstrap::create_unique_id)?;
    Ok(PyBytes::new(py, id.as_bytes()).unbind())
}

/// The rendezvous root address encoded in a unique id, as "host:port".
#[pyfunction]
pub fn unique_id_root_addr(unique_id: &[u8]) -> Result<String> {
    Ok(mori_bootstrap::UniqueId::from_bytes(unique_id)?
        .root_addr()
        .to_string())
}

#[pyclass(frozen, module = "mori._core")]
pub struct Bootstrap {
    /// Shared with a shmem session built on this bootstrap.
    pub(crate) inner: Arc<mori_bootstrap::Bootstrap>,
}

#[pymethods]
impl Bootstrap {
    #[new]
    #[pyo3(signature = (unique_id, rank, world_size, timeout))]
    fn new(
        py: Python<'_>,
        unique_id: &[u8],
        rank: usize,
        world_size: usize,
        timeout: f64,
    ) -> Result<Self> {
        let id = mori_bootstrap::UniqueId::from_bytes(unique_id)?;
        let timeout = duration(timeout)?;
        let inner =
            py.detach(|| mori_bootstrap::Bootstrap::connect(&id, rank, world_size, timeout))?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    #[getter]
    fn timeout(&self) -> f64 {
        self.inner.timeout().as_secs_f64()
    }

    #[setter]
    fn set_timeout(&self, seconds: f64) -> Result<()> {
        self.inner.set_timeout(duration(seconds)?);
        Ok(())
    }

    fn allgather(&self, py: Python<'_>, data: &[u8]) -> Result<Vec<Py<PyBytes>>> {
        let parts = py.detach(|| self.inner.allgather(data))?;
        Ok(parts.iter().map(|p| PyBytes::new(py, p).unbind()).collect())
    }

    fn broadcast(&self, py: Python<'_>, data: &[u8], root: usize) -> Result<Py<PyBytes>> {
        let out = py.detach(|| self.inner.broadcast(data, root))?;
        Ok(PyBytes::new(py, &out).unbind())
    }

    fn barrier(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| self.inner.barrier())?)
    }

    /// Drops the connection without a goodbye, as a crashed rank would (for fault tests).
    fn _abort_connection(&self) {
        self.inner.abort_connection_for_test();
    }
}
