//! Finding and loading NVRTC, and compiling one rendered source to a cubin.
//!
//! Search order: `MORI_NVRTC_PATH` (a file; when set, nothing else is tried), the directories registered with
//! [`add_search_dirs`] (the Python package registers the `nvidia-cuda-nvrtc` wheel's lib
//! folder), the CUDA toolkit (`CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda`), then the dynamic
//! loader's own path. NVRTC needs its builtins library; it is loaded first, globally, from the
//! same folder. cudarc then finds the already loaded library by its soname.

use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::sys;

use crate::error::{Error, Result};

/// NVRTC major version mori is built against (cudarc's `cuda-13000` bindings).
const NVRTC_MAJOR: u32 = 13;

static EXTRA_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Registers folders to search for libnvrtc before the toolkit and loader paths.
/// Has no effect once NVRTC has been loaded.
pub fn add_search_dirs(dirs: impl IntoIterator<Item = PathBuf>) {
    if let Ok(mut list) = EXTRA_DIRS.lock() {
        list.extend(dirs);
    }
}

fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = EXTRA_DIRS.lock().map(|l| l.clone()).unwrap_or_default();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(Path::new(&root).join("lib64"));
            dirs.push(Path::new(&root).join("lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs
}

/// Files in `dir` whose name starts with `prefix` (e.g. "libnvrtc.so.13"), shortest first.
fn matching_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort_by_key(|p| p.as_os_str().len());
    found
}

/// Opens `path` with RTLD_GLOBAL and keeps it loaded for the life of the process.
fn load_global(path: &Path) -> std::result::Result<(), String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
    let lib =
        unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| e.to_string())?;
    std::mem::forget(lib);
    Ok(())
}

/// Loads NVRTC once; later calls return the first outcome (as a fresh error).
pub fn ensure_nvrtc() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<PathBuf, Vec<String>>> = OnceLock::new();
    let outcome = LOADED.get_or_init(|| {
        let mut searched = Vec::new();
        let main_prefix = format!("libnvrtc.so.{NVRTC_MAJOR}");
        let builtins_prefix = format!("libnvrtc-builtins.so.{NVRTC_MAJOR}");
        // An explicit path is used exactly: falling back elsewhere would hide a wrong setting.
        if let Some(file) = std::env::var_os("MORI_NVRTC_PATH").map(PathBuf::from) {
            searched.push(format!("MORI_NVRTC_PATH={}", file.display()));
            if let Some(dir) = file.parent() {
                for b in matching_files(dir, &builtins_prefix).iter().take(1) {
                    let _ = load_global(b);
                }
            }
            return match load_global(&file) {
                Ok(()) => Ok(file),
                Err(e) => {
                    searched.push(format!("({e})"));
                    Err(searched)
                }
            };
        }
        for dir in candidate_dirs() {
            searched.push(dir.display().to_string());
            let Some(main) = matching_files(&dir, &main_prefix).into_iter().next() else {
                continue;
            };
            // The builtins must be resident before libnvrtc compiles anything.
            for b in matching_files(&dir, &builtins_prefix).iter().take(1) {
                if let Err(e) = load_global(b) {
                    tracing::debug!("could not preload {}: {e}", b.display());
                }
            }
            match load_global(&main) {
                Ok(()) => return Ok(main),
                Err(e) => searched.push(format!("({e})")),
            }
        }
        let soname = format!("libnvrtc.so.{NVRTC_MAJOR}");
        searched.push(format!("{soname} on the loader path"));
        match load_global(Path::new(&soname)) {
            Ok(()) => Ok(PathBuf::from(soname)),
            Err(_) => Err(searched),
        }
    });
    match outcome {
        Ok(path) => {
            tracing::debug!("NVRTC loaded from {}", path.display());
            Ok(())
        }
        Err(searched) => Err(Error::LibraryNotFound {
            library: "NVRTC 13 (libnvrtc.so.13)",
            searched: searched.clone(),
            hint: "Install it with `pip install nvidia-cuda-nvrtc==13.0.*`, install the CUDA 13 \
                   toolkit, or point MORI_NVRTC_PATH at libnvrtc.so.13.",
        }),
    }
}

fn check(call: &'static str, status: sys::nvrtcResult) -> Result<()> {
    if status == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string.
    let message = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(status)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::Nvrtc {
        call,
        code: status as i32,
        message,
    })
}

/// NVRTC's version as (major, minor).
pub fn version() -> Result<(i32, i32)> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// A program handle destroyed on drop.
struct Program(sys::nvrtcProgram);
impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

fn cstring(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidArgument(format!("{what} contains a NUL byte")))
}

/// Compiles `source` (named `name` in messages) with `headers` (include name, text) and
/// `options`, returning the cubin. The options must name a real architecture (`-arch=sm_XX`).
pub fn compile_to_cubin(
    name: &str,
    arch: &str,
    source: &str,
    headers: &[(&str, &str)],
    options: &[String],
) -> Result<Vec<u8>> {
    ensure_nvrtc()?;
    let c_source = cstring(source, "kernel source")?;
    let c_name = cstring(name, "kernel name")?;
    let header_texts = headers
        .iter()
        .map(|(_, t)| cstring(t, "header"))
        .collect::<Result<Vec<_>>>()?;
    let header_names = headers
        .iter()
        .map(|(n, _)| cstring(n, "header name"))
        .collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let mut raw = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live NUL-terminated string for the duration of the call.
    let created = unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            c_source.as_ptr(),
            c_name.as_ptr(),
            headers.len() as i32,
            text_ptrs.as_ptr(),
            name_ptrs.as_ptr(),
        )
    };
    check("nvrtcCreateProgram", created)?;
    let program = Program(raw);
    let c_options = options
        .iter()
        .map(|o| cstring(o, "compiler option"))
        .collect::<Result<Vec<_>>>()?;
    let option_ptrs: Vec<*const c_char> = c_options.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: the program is live and the options array outlives the call.
    let compiled = unsafe {
        sys::nvrtcCompileProgram(program.0, option_ptrs.len() as i32, option_ptrs.as_ptr())
    };
    if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        let log =
            program_log(&program).unwrap_or_else(|e| format!("(the log could not be read: {e})"));
        return Err(Error::Compile {
            kernel: name.to_string(),
            arch: arch.to_string(),
            log,
        });
    }
    let log = program_log(&program)?;
    if !log.trim().is_empty() {
        tracing::debug!("NVRTC log for {name}: {log}");
    }
    let mut size = 0usize;
    // SAFETY: writes one size_t for a compiled program.
    check("nvrtcGetCUBINSize", unsafe {
        sys::nvrtcGetCUBINSize(program.0, &mut size)
    })?;
    let mut cubin = vec![0u8; size];
    // SAFETY: cubin has exactly the size NVRTC reported.
    check("nvrtcGetCUBIN", unsafe {
        sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr() as *mut c_char)
    })?;
    if cubin.is_empty() {
        return Err(Error::Compile {
            kernel: name.to_string(),
            arch: arch.to_string(),
            log: "NVRTC produced no cubin; the options must name a real architecture (sm_XX)"
                .into(),
        });
    }
    Ok(cubin)
}

fn program_log(program: &Program) -> Result<String> {
    let mut size = 0usize;
    // SAFETY: writes one size_t.
    check("nvrtcGetProgramLogSize", unsafe {
        sys::nvrtcGetProgramLogSize(program.0, &mut size)
    })?;
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: log has the reported size (including the NUL).
    check("nvrtcGetProgramLog", unsafe {
        sys::nvrtcGetProgramLog(program.0, log.as_mut_ptr() as *mut c_char)
    })?;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).into_owned())
}
