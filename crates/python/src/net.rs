//! mori-net for Python: what `mori check` reports about the fabric.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::Error;

/// Every libfabric provider, fabric and domain offering reliable-datagram RMA here, as dicts
/// (provider, fabric, domain, hmem, mr_mode, max_msg_size, inject_size); raises
/// `LibraryNotFoundError` where libfabric is not installed.
#[pyfunction]
pub fn fabric_providers(py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
    let net = |e: mori_net::Error| PyErr::from(Error::from(e));
    let list = py.detach(mori_net::fabric::providers).map_err(net)?;
    let lib = mori_net::fabric::Library::get().map_err(net)?;
    let mut out = Vec::with_capacity(list.len());
    for p in list {
        let d = PyDict::new(py);
        let set = |k: &str, v: Bound<'_, PyAny>| d.set_item(k, v);
        set("provider", p.provider.into_pyobject(py)?.into_any())?;
        set("fabric", p.fabric.into_pyobject(py)?.into_any())?;
        set("domain", p.domain.into_pyobject(py)?.into_any())?;
        set(
            "hmem",
            pyo3::types::PyBool::new(py, p.hmem).to_owned().into_any(),
        )?;
        set("mr_mode", p.mr_mode.into_pyobject(py)?.into_any())?;
        set("max_msg_size", p.max_msg_size.into_pyobject(py)?.into_any())?;
        set("inject_size", p.inject_size.into_pyobject(py)?.into_any())?;
        set("library", lib.path.clone().into_pyobject(py)?.into_any())?;
        out.push(d.unbind());
    }
    Ok(out)
}
