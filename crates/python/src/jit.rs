//! Bindings of the JIT: the cache folder, the variant list, compiling one variant.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use mori_gpu::jit::KernelSpec;

use crate::errors::Error;

#[pyfunction]
pub fn jit_cache_dir() -> PathBuf {
    mori_gpu::jit::cache_dir()
}

/// Names of every kernel variant mori can compile.
#[pyfunction]
pub fn kernel_variants() -> Vec<String> {
    mori_gpu::kernels::variants()
        .into_iter()
        .map(|v| v.name)
        .collect()
}

fn compiled_dict<'py>(
    py: Python<'py>,
    compiled: &mori_gpu::jit::CompiledKernel,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("key", &compiled.key)?;
    out.set_item("path", &compiled.path)?;
    out.set_item("from_cache", compiled.from_cache)?;
    out.set_item("cubin_bytes", compiled.cubin.len())?;
    Ok(out)
}

fn compile_spec<'py>(
    py: Python<'py>,
    spec: &KernelSpec,
    arch: &str,
    cache_dir: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let dir = cache_dir.unwrap_or_else(mori_gpu::jit::cache_dir);
    let compiled = py
        .detach(|| mori_gpu::jit::compile_in(&dir, spec, arch))
        .map_err(Error::from)?;
    compiled_dict(py, &compiled)
}

/// Compiles variant `name` for `arch` (e.g. "sm_90") into the cache (default folder unless
/// `cache_dir` is given). Returns {"key", "path", "from_cache", "cubin_bytes"}.
#[pyfunction]
#[pyo3(signature = (name, arch, cache_dir=None))]
pub fn compile_variant<'py>(
    py: Python<'py>,
    name: &str,
    arch: &str,
    cache_dir: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let spec = mori_gpu::kernels::variants()
        .into_iter()
        .find(|v| v.name == name)
        .ok_or_else(|| Error::InvalidArgument(format!("no kernel variant named {name:?}")))?;
    compile_spec(py, &spec, arch, cache_dir)
}

/// Compiles a user's CUDA C++ `source` (mori's headers may be included) for `arch`.
#[pyfunction]
#[pyo3(signature = (name, source, arch, cache_dir=None))]
pub fn compile_source<'py>(
    py: Python<'py>,
    name: &str,
    source: &str,
    arch: &str,
    cache_dir: Option<PathBuf>,
) -> PyResult<Bound<'py, PyDict>> {
    let spec = KernelSpec {
        name: name.to_string(),
        file: name.to_string().into(),
        source: source.to_string().into(),
        defines: Vec::new(),
    };
    compile_spec(py, &spec, arch, cache_dir)
}
