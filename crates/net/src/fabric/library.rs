//! libfabric, loaded at run time: `MORI_LIBFABRIC_PATH` when set (exactly that file), else
//! `libfabric.so.1` from the loader path. Nothing links against it, so the wheel works without
//! it and says so when a fabric route is asked for.

use std::ffi::{CStr, CString, c_void};
use std::sync::OnceLock;

use super::ffi;
use crate::error::{Error, Result};

/// The exported entry points mori-net uses, at the symbol versions whose structure layouts
/// [`ffi`] mirrors.
pub struct Library {
    pub(crate) getinfo: ffi::GetInfoFn,
    pub(crate) freeinfo: ffi::FreeInfoFn,
    pub(crate) dupinfo: ffi::DupInfoFn,
    pub(crate) fabric: ffi::FabricFn,
    strerror: ffi::StrErrorFn,
    /// Where it was loaded from.
    pub path: String,
    /// `fi_version()` of the library (major << 16 | minor).
    pub version: u32,
}

// SAFETY: the library handle is never closed and holds only function pointers, which any
// thread may call (libfabric's getinfo/fabric calls are thread-safe).
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

impl Library {
    /// The process's libfabric, loaded once; the error says why it is not available.
    pub fn get() -> Result<&'static Library> {
        static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
        LIB.get_or_init(|| keeping_signal_handlers(Library::load).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|why| Error::Unavailable(why.clone()))
    }

    fn load() -> Result<Library> {
        let path = std::env::var("MORI_LIBFABRIC_PATH").unwrap_or_else(|_| "libfabric.so.1".into());
        let c_path = CString::new(path.clone())
            .map_err(|_| Error::InvalidArgument("MORI_LIBFABRIC_PATH holds a NUL byte".into()))?;
        // SAFETY: a NUL-terminated path; the handle is kept for the life of the process.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(Error::Unavailable(format!(
                "libfabric is not installed or not loadable ({path}: {}); install libfabric1 \
                 (Debian/Ubuntu) or libfabric (RHEL), or point MORI_LIBFABRIC_PATH at it",
                dl_error()
            )));
        }
        let sym = |name: &CStr, version: &CStr| -> Result<*mut c_void> {
            // SAFETY: a live handle and NUL-terminated names.
            let p = unsafe { libc::dlvsym(handle, name.as_ptr(), version.as_ptr()) };
            if p.is_null() {
                return Err(Error::Unavailable(format!(
                    "{path} has no {}@{} (libfabric older than 1.9?): {}",
                    name.to_string_lossy(),
                    version.to_string_lossy(),
                    dl_error()
                )));
            }
            Ok(p)
        };
        // SAFETY: each symbol has the signature of its declaration at that symbol version.
        let lib = unsafe {
            Library {
                getinfo: std::mem::transmute::<*mut c_void, ffi::GetInfoFn>(sym(
                    c"fi_getinfo",
                    c"FABRIC_1.3",
                )?),
                freeinfo: std::mem::transmute::<*mut c_void, ffi::FreeInfoFn>(sym(
                    c"fi_freeinfo",
                    c"FABRIC_1.3",
                )?),
                dupinfo: std::mem::transmute::<*mut c_void, ffi::DupInfoFn>(sym(
                    c"fi_dupinfo",
                    c"FABRIC_1.3",
                )?),
                fabric: std::mem::transmute::<*mut c_void, ffi::FabricFn>(sym(
                    c"fi_fabric",
                    c"FABRIC_1.1",
                )?),
                strerror: std::mem::transmute::<*mut c_void, ffi::StrErrorFn>(sym(
                    c"fi_strerror",
                    c"FABRIC_1.0",
                )?),
                path: path.clone(),
                version: {
                    let v = sym(c"fi_version", c"FABRIC_1.0")?;
                    std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> u32>(v)()
                },
            }
        };
        if lib.version < ffi::API_VERSION {
            return Err(Error::Unavailable(format!(
                "{path} is libfabric {}.{}; mori-net needs 1.13 or newer",
                lib.version >> 16,
                lib.version & 0xffff
            )));
        }
        tracing::debug!(path = %lib.path, version = lib.version, "libfabric loaded");
        Ok(lib)
    }

    /// libfabric's text for error number `err` (positive).
    pub fn strerror(&self, err: i32) -> String {
        // SAFETY: fi_strerror returns a static NUL-terminated string for any number.
        let p = unsafe { (self.strerror)(err) };
        if p.is_null() {
            return format!("error {err}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The error of a failed call named `call` (`ret` negative), e.g. "fi_domain: ...".
    pub(crate) fn fail(&self, call: &str, ret: isize) -> Error {
        let err = (-ret) as i32;
        Error::Fabric {
            call: call.to_string(),
            code: err,
            message: self.strerror(err),
        }
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated message.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        return "unknown reason".into();
    }
    // SAFETY: non-null, NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Runs `f` (a libfabric call that may initialise providers) and puts back every signal
/// handler it replaced. Some providers install handlers for SIGTERM, SIGSEGV and others when
/// they initialise (libfabric 1.17 on Debian: SIGINT, SIGILL, SIGABRT, SIGBUS, SIGSEGV,
/// SIGTERM), which would take over the embedding program's own (a daemon's clean shutdown on
/// SIGTERM, Python's KeyboardInterrupt); a library must not do that.
pub(crate) fn keeping_signal_handlers<T>(f: impl FnOnce() -> T) -> T {
    let signals: Vec<i32> = (1..=libc::SIGRTMAX())
        .filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP)
        .collect();
    let current = |sig: i32| {
        // SAFETY: all-zero bytes are a valid sigaction (no handler, empty mask).
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: with a null new action, sigaction only reads the current one into `old`.
        let ok = unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } == 0;
        ok.then_some(old)
    };
    let before: Vec<Option<libc::sigaction>> = signals.iter().map(|&s| current(s)).collect();
    let out = f();
    for (&sig, was) in signals.iter().zip(&before) {
        let (Some(was), Some(now)) = (was, current(sig)) else {
            continue;
        };
        if now.sa_sigaction != was.sa_sigaction || now.sa_flags != was.sa_flags {
            // SAFETY: restores the action read above for the same signal.
            unsafe { libc::sigaction(sig, was, std::ptr::null_mut()) };
            tracing::debug!("libfabric replaced the handler of signal {sig}: restored");
        }
    }
    out
}
