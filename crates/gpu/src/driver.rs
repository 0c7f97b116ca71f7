//! Loading the CUDA driver (libcuda) and checking every driver call.
//!
//! cudarc resolves driver symbols lazily and panics when the library is absent, so every entry
//! point of this crate first calls [`ensure_driver`], which turns a missing driver into
//! [`Error::LibraryNotFound`] and runs `cuInit` once.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result};

/// Library names the dynamic loader is asked for, in order.
const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Turns a driver status into a `Result`, naming `call` in the error.
pub(crate) fn check(call: &'static str, status: sys::CUresult) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(driver_error(call, status))
}

fn driver_error(call: &'static str, status: sys::CUresult) -> Error {
    let mut name_ptr: *const std::ffi::c_char = std::ptr::null();
    let mut text_ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName/String write a pointer to a static string (or leave it null).
    unsafe {
        sys::cuGetErrorName(status, &mut name_ptr);
        sys::cuGetErrorString(status, &mut text_ptr);
    }
    let read = |p: *const std::ffi::c_char| {
        if p.is_null() {
            "unknown".to_string()
        } else {
            // SAFETY: non-null pointers from the driver point to NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    Error::Driver {
        call,
        code: status as i32,
        name: read(name_ptr),
        message: read(text_ptr),
    }
}

/// Loads libcuda and runs `cuInit(0)` once per process; later calls return the first outcome.
pub fn ensure_driver() -> Result<()> {
    /// Why the driver is unusable; kept by value so each caller gets a fresh `Error`.
    #[derive(Clone, Copy)]
    enum Failure {
        NoLibrary,
        Init(sys::CUresult),
    }
    static INIT: OnceLock<std::result::Result<(), Failure>> = OnceLock::new();
    let outcome = INIT.get_or_init(|| {
        let found = DRIVER_LIBRARIES.iter().any(|name| {
            // SAFETY: loading libcuda runs its initialisers, which have no preconditions.
            unsafe { libloading::Library::new(*name) }.is_ok()
        });
        if !found {
            return Err(Failure::NoLibrary);
        }
        // SAFETY: the library is present, so cudarc can resolve cuInit.
        match unsafe { sys::cuInit(0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            status => Err(Failure::Init(status)),
        }
    });
    match *outcome {
        Ok(()) => Ok(()),
        Err(Failure::NoLibrary) => Err(Error::LibraryNotFound {
            library: "the NVIDIA driver library libcuda.so.1",
            searched: DRIVER_LIBRARIES.iter().map(|s| s.to_string()).collect(),
            hint: "Install the NVIDIA driver, or run on a machine with an NVIDIA GPU; \
                   CPU-only features of mori (bootstrap, JIT compilation) work without it.",
        }),
        Err(Failure::Init(status)) => Err(driver_error("cuInit", status)),
    }
}

/// The CUDA version the driver supports, as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(i32, i32)> {
    ensure_driver()?;
    let mut v = 0;
    // SAFETY: writes one int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok((v / 1000, (v % 1000) / 10))
}

/// Number of CUDA devices visible to this process.
pub fn device_count() -> Result<usize> {
    ensure_driver()?;
    let mut n = 0;
    // SAFETY: writes one int.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n.max(0) as usize)
}
