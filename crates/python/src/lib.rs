//! `mori._core`: the only crate that sees pyo3. Thin bindings over mori-gpu, mori-bootstrap
//! and mori-topology; every error crosses into Python through `errors.rs`.

mod bootstrap;
mod buffer;
mod collective;
mod errors;
mod gpu;
mod io;
mod jit;
mod net;
mod shmem;
mod umbp;

use std::io::IsTerminal;
use std::sync::OnceLock;

use pyo3::prelude::*;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, reload};

/// The filter of the subscriber `init_logging` installed (unset when the host had its own).
static LOG_FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// `MORI_LOG`, default: warnings.
fn mori_log_filter() -> EnvFilter {
    EnvFilter::try_from_env("MORI_LOG").unwrap_or_else(|_| EnvFilter::new("warn"))
}

/// Routes `tracing` output to stderr, filtered by `MORI_LOG` (swappable: see `with_log_filter`).
fn init_logging() {
    let (filter, handle) = reload::Layer::new(mori_log_filter());
    // A host program may already have installed a subscriber; keep theirs then.
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .try_init();
    if installed.is_ok() {
        let _ = LOG_FILTER.set(handle);
    }
}

/// Runs `f` with `filter` in place of `MORI_LOG`'s (so a program run through `_core`, such as
/// the `umbpd` daemon, keeps its own log variable), then puts `MORI_LOG`'s back.
fn with_log_filter<T>(filter: EnvFilter, f: impl FnOnce() -> T) -> T {
    let swap = |filter| {
        if let Some(handle) = LOG_FILTER.get()
            && let Err(e) = handle.reload(filter)
        {
            tracing::warn!(error = %e, "could not change the log filter");
        }
    };
    swap(filter);
    let out = f();
    swap(mori_log_filter());
    out
}

/// How this extension (and the daemon it runs, `mori.umbpd`) was built: "debug" or "release".
#[pyfunction]
fn build_profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

/// Hardware topology as JSON.
#[pyfunction]
fn topology_json(py: Python<'_>) -> String {
    py.detach(|| mori_topology::detect().to_json())
}

/// Hardware topology as a human-readable report.
#[pyfunction]
fn topology_text(py: Python<'_>) -> String {
    py.detach(|| mori_topology::detect().render_text())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(bootstrap::get_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(bootstrap::unique_id_root_addr, m)?)?;
    m.add_class::<bootstrap::Bootstrap>()?;
    m.add_function(wrap_pyfunction!(net::fabric_providers, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::driver_version, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::device_count, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::add_nvrtc_search_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::device_info, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::can_access_peer, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::enable_peer_access, m)?)?;
    m.add_function(wrap_pyfunction!(collective::ep_internode_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(collective::ep_internode_record_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(collective::ep_ll_record_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(collective::ep_ll_window_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::stream_synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::memcpy_htod, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::memcpy_dtoh, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::copy_engine_async, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::copy_kernel_async, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::ipc_export, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::stream_write_value32, m)?)?;
    m.add_function(wrap_pyfunction!(gpu::stream_wait_value32, m)?)?;
    m.add_class::<gpu::DeviceBuffer>()?;
    m.add_class::<gpu::PinnedBuffer>()?;
    m.add_class::<gpu::GatherScatter>()?;
    m.add_class::<gpu::Stream>()?;
    m.add_class::<gpu::Event>()?;
    m.add_class::<gpu::IpcMapping>()?;
    m.add_class::<gpu::VmmAllocation>()?;
    m.add_function(wrap_pyfunction!(jit::jit_cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(jit::kernel_variants, m)?)?;
    m.add_function(wrap_pyfunction!(jit::compile_variant, m)?)?;
    m.add_function(wrap_pyfunction!(jit::compile_source, m)?)?;
    m.add_class::<shmem::Shmem>()?;
    m.add_class::<shmem::ShmemModule>()?;
    m.add_class::<shmem::Registered>()?;
    m.add_class::<collective::CclRuntime>()?;
    m.add_class::<collective::EpRuntime>()?;
    m.add_function(wrap_pyfunction!(collective::ccl_check_config, m)?)?;
    m.add_function(wrap_pyfunction!(collective::kernel_params, m)?)?;
    m.add_class::<io::IoEngine>()?;
    m.add_class::<io::Transfer>()?;
    m.add_function(wrap_pyfunction!(io::io_memory_desc_info, m)?)?;
    m.add_function(wrap_pyfunction!(io::io_engine_desc_info, m)?)?;
    m.add_class::<umbp::UmbpPool>()?;
    m.add_class::<umbp::UmbpRemote>()?;
    m.add_class::<umbp::UmbpSharedBuffer>()?;
    m.add_function(wrap_pyfunction!(umbp::umbpd_main, m)?)?;
    m.add_function(wrap_pyfunction!(umbp::parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(umbp::uring_unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(build_profile, m)?)?;
    m.add_function(wrap_pyfunction!(topology_json, m)?)?;
    m.add_function(wrap_pyfunction!(topology_text, m)?)?;
    Ok(())
}
