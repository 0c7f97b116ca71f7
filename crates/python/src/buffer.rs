//! The buffer protocol, which pyo3 leaves out under `abi3-py310`: `Py_buffer` and
//! `PyObject_GetBuffer` joined the stable ABI in Python 3.11, but CPython has exported both,
//! with this layout, since 3.3 (what the 3.11 stable ABI froze). One call gives the address of
//! a numpy array, bytearray or memoryview, where Python's `__array_interface__` builds a dict.

use pyo3::prelude::*;

mod ffi {
    use std::ffi::{c_char, c_int, c_void};

    use pyo3::ffi::PyObject;

    #[repr(C)]
    pub struct Buffer {
        pub buf: *mut c_void,
        pub obj: *mut PyObject,
        pub len: isize,
        pub itemsize: isize,
        pub readonly: c_int,
        pub ndim: c_int,
        pub format: *mut c_char,
        pub shape: *mut isize,
        pub strides: *mut isize,
        pub suboffsets: *mut isize,
        pub internal: *mut c_void,
    }

    /// `PyBUF_C_CONTIGUOUS | PyBUF_FORMAT`: C-contiguous, with shape, strides and format.
    pub const C_CONTIGUOUS_WITH_FORMAT: c_int = 0x0038 | 0x0004;
    /// `PyBUF_WRITABLE`.
    pub const WRITABLE: c_int = 0x0001;

    unsafe extern "C" {
        pub fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut Buffer, flags: c_int) -> c_int;
        pub fn PyBuffer_Release(view: *mut Buffer);
    }
}

/// A C-contiguous buffer an object exported, held until this is dropped (with the GIL held:
/// the raw pointers inside keep it on the thread that made it), so the object cannot be resized
/// or freed meanwhile (a bytearray refuses to resize while exported).
pub(crate) struct HostBuffer {
    view: ffi::Buffer,
    /// Items are native int64 (format `l` or `q`).
    pub native_int64: bool,
}

impl HostBuffer {
    pub fn ptr(&self) -> usize {
        self.view.buf as usize
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.view.len as usize
    }

    pub fn itemsize(&self) -> usize {
        self.view.itemsize as usize
    }

    pub fn ndim(&self) -> i32 {
        self.view.ndim
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the view from the successful PyObject_GetBuffer in `host_buffer`, released
        // once; `HostBuffer` is not Send, so this runs on the GIL-holding thread that made it.
        unsafe { ffi::PyBuffer_Release(&mut self.view) };
    }
}

/// `obj`'s data as a C-contiguous buffer (writable when asked), or None when it exports none
/// (not a buffer, not contiguous, read-only), with no Python error left set.
pub(crate) fn host_buffer(obj: &Bound<'_, PyAny>, writable: bool) -> Option<HostBuffer> {
    let flags = ffi::C_CONTIGUOUS_WITH_FORMAT | if writable { ffi::WRITABLE } else { 0 };
    let mut view = std::mem::MaybeUninit::<ffi::Buffer>::uninit();
    // SAFETY: the GIL is held (`obj` is bound); `view` is written by a successful call.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), flags) };
    if rc != 0 {
        drop(PyErr::take(obj.py())); // not a usable buffer: the caller converts it
        return None;
    }
    // SAFETY: filled in by the successful PyObject_GetBuffer above.
    let view = unsafe { view.assume_init() };
    let format = if view.format.is_null() {
        &b"B"[..]
    } else {
        // SAFETY: a non-null format is a NUL-terminated string owned by the view.
        unsafe { std::ffi::CStr::from_ptr(view.format) }.to_bytes()
    };
    let native_int64 = matches!(format, b"l" | b"q" | b"@l" | b"@q" | b"=q")
        || (cfg!(target_endian = "little") && format == b"<q");
    Some(HostBuffer { view, native_int64 })
}
