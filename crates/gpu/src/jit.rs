//! The kernel JIT: render a kernel variant, compile it with NVRTC for one architecture, keep the
//! cubin in an on-disk cache, and load it once per device.
//!
//! Cache layout: `<cache dir>/<key>/kernel.cubin` (+ `meta.txt`), where key =
//! sha256(rendered source, headers, arch, NVRTC version, options). An entry is written in a
//! private temporary folder and published with one `rename`, so processes compiling the same
//! kernel at once never see a half-written entry: the first rename wins and the others
//! discard their copy.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use sha2::{Digest, Sha256};

use crate::device::{Device, poisoned};
use crate::driver::check;
use crate::error::{Error, Result};
use crate::kernels::HEADERS;
use crate::nvrtc;

const CUBIN_FILE: &str = "kernel.cubin";
const META_FILE: &str = "meta.txt";
const ELF_MAGIC: &[u8] = b"\x7fELF";

/// One compilable configuration of a kernel source file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelSpec {
    /// Variant name, e.g. `copy/unroll4`. Within a process a name stands for one rendered
    /// source: loaded modules are looked up by name, so different code needs a different name.
    pub name: String,
    /// Source path relative to `kernels/` (e.g. `copy/copy.cu`), or a user-chosen name.
    pub file: Cow<'static, str>,
    /// The source text (embedded in the binary, or given by a user).
    pub source: Cow<'static, str>,
    /// `#define`s that specialise the source.
    pub defines: Vec<(String, String)>,
}

impl KernelSpec {
    /// The exact text handed to NVRTC: the specialising defines, then the source.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(self.source.len() + 256);
        for (k, v) in &self.defines {
            out.push_str(&format!("#define {k} {v}\n"));
        }
        out.push_str(&format!("#line 1 \"{}\"\n", self.file));
        out.push_str(&self.source);
        out
    }
}

/// NVRTC options for `arch` (e.g. `sm_90`).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("-arch={arch}"),
        "-std=c++17".into(),
        "-lineinfo".into(),
        "-DMORI_NVRTC=1".into(),
    ]
}

/// The cache key of a rendered source under the given compiler inputs.
pub fn cache_key(
    rendered: &str,
    headers: &[(&str, &str)],
    arch: &str,
    nvrtc_version: (i32, i32),
    options: &[String],
) -> String {
    let mut h = Sha256::new();
    // Length-prefix each field so that different splits never hash alike.
    let mut field = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    field(rendered.as_bytes());
    for (name, text) in headers {
        field(name.as_bytes());
        field(text.as_bytes());
    }
    field(arch.as_bytes());
    field(format!("{}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    for o in options {
        field(o.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Where compiled kernels are kept: `MORI_JIT_CACHE_DIR`, else `$XDG_CACHE_HOME/mori/jit`,
/// else `~/.cache/mori/jit`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MORI_JIT_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("mori").join("jit")
}

/// A compiled kernel variant.
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    pub key: String,
    pub cubin: Arc<Vec<u8>>,
    /// The published cache entry (folder).
    pub path: PathBuf,
    /// True when the cubin came from the disk cache rather than NVRTC.
    pub from_cache: bool,
}

/// Compiles `spec` for `arch` into the cache at `dir`, or reads it from there.
pub fn compile_in(dir: &Path, spec: &KernelSpec, arch: &str) -> Result<CompiledKernel> {
    let version = nvrtc::version()?;
    let options = compile_options(arch);
    let rendered = spec.render();
    let key = cache_key(&rendered, HEADERS, arch, version, &options);
    let entry = dir.join(&key);
    if let Some(cubin) = read_entry(&entry)? {
        tracing::debug!(
            "JIT cache hit for {} ({arch}): {}",
            spec.name,
            entry.display()
        );
        return Ok(CompiledKernel {
            key,
            cubin: Arc::new(cubin),
            path: entry,
            from_cache: true,
        });
    }
    let started = std::time::Instant::now();
    let cubin = nvrtc::compile_to_cubin(&spec.name, arch, &rendered, HEADERS, &options)?;
    tracing::debug!(
        "compiled {} for {arch} in {:.0?}",
        spec.name,
        started.elapsed()
    );
    let meta = format!(
        "variant {}\nfile {}\narch {arch}\nnvrtc {}.{}\noptions {}\n",
        spec.name,
        spec.file,
        version.0,
        version.1,
        options.join(" ")
    );
    let path = publish(dir, &key, &cubin, &meta)?;
    // Whichever process won the publish, its bytes come from identical inputs.
    Ok(CompiledKernel {
        key,
        cubin: Arc::new(cubin),
        path,
        from_cache: false,
    })
}

/// Compiles `spec` for `arch` using the default cache folder.
pub fn compile(spec: &KernelSpec, arch: &str) -> Result<CompiledKernel> {
    compile_in(&cache_dir(), spec, arch)
}

/// Reads a published entry; a damaged one is moved aside (and later replaced) rather than used.
fn read_entry(entry: &Path) -> Result<Option<Vec<u8>>> {
    let file = entry.join(CUBIN_FILE);
    match std::fs::read(&file) {
        Ok(bytes) if bytes.starts_with(ELF_MAGIC) => Ok(Some(bytes)),
        Ok(_) => {
            tracing::warn!(
                "JIT cache entry {} is not a cubin; recompiling",
                file.display()
            );
            discard(entry)?;
            Ok(None)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if entry.exists() {
                tracing::warn!(
                    "JIT cache entry {} has no cubin; recompiling",
                    entry.display()
                );
                discard(entry)?;
            }
            Ok(None)
        }
        Err(e) => Err(Error::io(format!("reading {}", file.display()), e)),
    }
}

/// Moves a bad entry out of the way with a rename (atomic), then deletes it.
fn discard(entry: &Path) -> Result<()> {
    let trash = temp_sibling(entry, "trash")?;
    match std::fs::rename(entry, &trash) {
        Ok(()) => {
            let _ = std::fs::remove_dir_all(&trash);
            Ok(())
        }
        // Someone else discarded or replaced it first.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::CacheCorrupt {
            path: entry.to_path_buf(),
            detail: format!("could not remove it: {e}"),
        }),
    }
}

fn temp_sibling(entry: &Path, tag: &str) -> Result<PathBuf> {
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).map_err(|e| {
        Error::io(
            "drawing a random name",
            std::io::Error::other(e.to_string()),
        )
    })?;
    let name = entry
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("entry");
    let parent = entry.parent().unwrap_or(Path::new("."));
    Ok(parent.join(format!(
        ".{tag}-{name}-{}-{}",
        std::process::id(),
        hex::encode(nonce)
    )))
}

/// Writes `cubin` + `meta` as entry `key` under `dir` with an atomic rename. Returns the entry.
pub fn publish(dir: &Path, key: &str, cubin: &[u8], meta: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating the JIT cache {}", dir.display()), e))?;
    let entry = dir.join(key);
    let tmp = temp_sibling(&entry, "tmp")?;
    let write = || -> std::io::Result<()> {
        std::fs::create_dir(&tmp)?;
        for (name, bytes) in [(CUBIN_FILE, cubin), (META_FILE, meta.as_bytes())] {
            let mut f = std::fs::File::create(tmp.join(name))?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        Ok(())
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(Error::io(
            format!("writing JIT cache entry {}", tmp.display()),
            e,
        ));
    }
    match std::fs::rename(&tmp, &entry) {
        Ok(()) => Ok(entry),
        // rename(2) onto a non-empty directory fails: another process published first.
        Err(e) if entry.join(CUBIN_FILE).exists() => {
            tracing::debug!("lost the publish race for {key} ({e}); using the winner's entry");
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(entry)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(Error::io(
                format!("publishing JIT cache entry {}", entry.display()),
                e,
            ))
        }
    }
}

/// A kernel entry point loaded on one device. Valid for the life of the process.
#[derive(Debug, Clone, Copy)]
pub struct Function {
    device: Device,
    raw: sys::CUfunction,
}
// SAFETY: CUfunction handles are process-global and immutable once loaded.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    pub fn device(&self) -> Device {
        self.device
    }
    pub(crate) fn raw(&self) -> sys::CUfunction {
        self.raw
    }
}

/// A module loaded on one device. Modules are never unloaded: the set of variants is small
/// and fixed, and user kernels are few.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    device: Device,
    raw: sys::CUmodule,
}
// SAFETY: module handles are process-global and immutable once loaded.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl PartialEq for Module {
    fn eq(&self, other: &Self) -> bool {
        self.raw == other.raw
    }
}
impl Eq for Module {}
impl std::hash::Hash for Module {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.raw as usize).hash(state);
    }
}

impl Module {
    pub fn device(&self) -> Device {
        self.device
    }

    /// The kernel `entry` (an `extern "C"` name).
    pub fn function(&self, entry: &str) -> Result<Function> {
        let c_entry = std::ffi::CString::new(entry)
            .map_err(|_| Error::InvalidArgument("entry name contains NUL".into()))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the module is loaded; writes one function handle.
        check("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut raw, self.raw, c_entry.as_ptr())
        })?;
        Ok(Function {
            device: self.device,
            raw,
        })
    }

    /// Device address and size of the global variable `name`, or None if the module has none.
    pub fn global(&self, name: &str) -> Result<Option<(u64, usize)>> {
        let c_name = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument("global name contains NUL".into()))?;
        let (mut ptr, mut size) = (0u64, 0usize);
        // SAFETY: the module is loaded; writes an address and a size.
        match unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, &mut size, self.raw, c_name.as_ptr()) } {
            sys::CUresult::CUDA_ERROR_NOT_FOUND => Ok(None),
            status => check("cuModuleGetGlobal", status).map(|()| Some((ptr, size))),
        }
    }
}

/// Compiles (or finds) `spec` for `device` and loads it once per process and device.
pub fn load(device: Device, spec: &KernelSpec) -> Result<Module> {
    static MODULES: OnceLock<Mutex<HashMap<(usize, String), Module>>> = OnceLock::new();
    let modules = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    // A variant's name identifies its code (see KernelSpec::name), so launches skip rendering.
    let lookup = (device.ordinal(), spec.name.clone());
    let mut table = modules.lock().map_err(|_| poisoned())?;
    if let Some(module) = table.get(&lookup) {
        return Ok(*module);
    }
    let compiled = compile(spec, &device.arch()?)?;
    device.bind()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: the cubin is a complete ELF image that outlives the call.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut raw, compiled.cubin.as_ptr() as *const c_void)
    })?;
    load_every_function(raw)?;
    let module = Module { device, raw };
    table.insert(lookup, module);
    Ok(module)
}

/// Loads the code of every kernel in `module` now. Under lazy loading (CUDA_MODULE_LOADING=LAZY,
/// the default since CUDA 12.2) a kernel's code is loaded at its first launch, and that load may
/// wait for the context's running work (CUDA's documented lazy-loading deadlock): a first
/// launch queued behind a kernel that spins until other work lands (a shmem wait for a transfer
/// the proxy thread drives, a barrier) would then hold the context until the GPU wait times out.
fn load_every_function(module: sys::CUmodule) -> Result<()> {
    let mut count: std::ffi::c_uint = 0;
    // SAFETY: the module is loaded; writes one count.
    check("cuModuleGetFunctionCount", unsafe {
        sys::cuModuleGetFunctionCount(&mut count, module)
    })?;
    let mut functions = vec![std::ptr::null_mut(); count as usize];
    // SAFETY: `functions` has room for `count` handles.
    check("cuModuleEnumerateFunctions", unsafe {
        sys::cuModuleEnumerateFunctions(functions.as_mut_ptr(), count, module)
    })?;
    for f in functions {
        // SAFETY: a function handle of the loaded module.
        check("cuFuncLoad", unsafe { sys::cuFuncLoad(f) })?;
    }
    Ok(())
}

/// Compiles (or finds) `spec` for `device` and returns its entry point `entry`.
pub fn function(device: Device, spec: &KernelSpec, entry: &str) -> Result<Function> {
    load(device, spec)?.function(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(defines: &[(&str, &str)]) -> KernelSpec {
        KernelSpec {
            name: "test/v".into(),
            file: "test.cu".into(),
            source: "extern \"C\" __global__ void k() {}\n".into(),
            defines: defines
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    #[test]
    fn key_changes_with_every_input() {
        let opts = compile_options("sm_90");
        let base = cache_key(&spec(&[]).render(), HEADERS, "sm_90", (13, 0), &opts);
        assert_eq!(base.len(), 64);
        assert_eq!(
            base,
            cache_key(&spec(&[]).render(), HEADERS, "sm_90", (13, 0), &opts),
            "deterministic"
        );
        let variants = [
            cache_key(
                &spec(&[("A", "1")]).render(),
                HEADERS,
                "sm_90",
                (13, 0),
                &opts,
            ),
            cache_key(&spec(&[]).render(), &[], "sm_90", (13, 0), &opts),
            cache_key(&spec(&[]).render(), HEADERS, "sm_80", (13, 0), &opts),
            cache_key(&spec(&[]).render(), HEADERS, "sm_90", (13, 1), &opts),
            cache_key(
                &spec(&[]).render(),
                HEADERS,
                "sm_90",
                (13, 0),
                &compile_options("sm_100"),
            ),
        ];
        for v in variants {
            assert_ne!(v, base);
        }
    }

    #[test]
    fn render_puts_defines_before_source() {
        let text = spec(&[("MORI_X", "4")]).render();
        assert!(text.starts_with("#define MORI_X 4\n#line 1 \"test.cu\"\n"));
    }

    #[test]
    fn concurrent_publish_leaves_one_complete_entry() {
        let dir = tempfile::tempdir().unwrap();
        let cubin: Vec<u8> = [ELF_MAGIC, &[7u8; 100_000]].concat();
        let threads: Vec<_> = (0..16)
            .map(|_| {
                let (d, c) = (dir.path().to_path_buf(), cubin.clone());
                std::thread::spawn(move || publish(&d, "k", &c, "meta").unwrap())
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), dir.path().join("k"));
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("k")],
            "no temporary folders left behind"
        );
        assert_eq!(read_entry(&dir.path().join("k")).unwrap().unwrap(), cubin);
    }

    #[test]
    fn damaged_entry_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let entry = publish(dir.path(), "bad", b"not an elf", "meta").unwrap();
        assert!(read_entry(&entry).unwrap().is_none());
        assert!(!entry.exists());
        assert!(read_entry(&dir.path().join("missing")).unwrap().is_none());
    }
}
