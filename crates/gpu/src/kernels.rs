//! mori's own kernels: the embedded sources, every variant the JIT may build, and typed
//! launchers. A new kernel file gets a `*_SRC` constant, a spec function, and an entry in
//! [`variants`].

use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::sys;

use crate::device::{Device, poisoned};
use crate::driver::check;
use crate::error::{Error, Result};
use crate::jit::{self, Function, KernelSpec};
use crate::memory::{DeviceBuffer, PinnedBuffer};
use crate::stream::{Event, StreamHandle};

/// Headers every kernel may include, by include name.
pub const HEADERS: &[(&str, &str)] = &[
    (
        "mori_device.cuh",
        include_str!("../../../kernels/common/mori_device.cuh"),
    ),
    (
        "mori_shmem.cuh",
        include_str!("../../../kernels/shmem/mori_shmem.cuh"),
    ),
    (
        "mori_ep.cuh",
        include_str!("../../../kernels/ep/mori_ep.cuh"),
    ),
];

// Kernel sources, embedded. Each is named once here and used by its spec functions below.
const COPY_SRC: &str = include_str!("../../../kernels/copy/copy.cu");
const COPY_BULK_SRC: &str = include_str!("../../../kernels/copy/copy_bulk.cu");
const GATHER_SCATTER_SRC: &str = include_str!("../../../kernels/copy/gather_scatter.cu");
const SHMEM_BARRIER_SRC: &str = include_str!("../../../kernels/shmem/barrier.cu");
const SHMEM_PROXY_SRC: &str = include_str!("../../../kernels/shmem/proxy.cu");
const EP_INTRANODE_SRC: &str = include_str!("../../../kernels/ep/intranode.cu");
const CCL_SRC: &str = include_str!("../../../kernels/collective/ccl.cu");
const EP_LOW_LATENCY_SRC: &str = include_str!("../../../kernels/ep/low_latency.cu");
const EP_INTERNODE_SRC: &str = include_str!("../../../kernels/ep/internode.cu");

/// Unroll depths the copy kernel is built with.
pub const COPY_UNROLLS: [u32; 3] = [2, 4, 8];
/// Chunk size (bytes) of the gather/scatter kernel.
pub const GATHER_SCATTER_CHUNK: u64 = 32 * 1024;
const GATHER_SCATTER_UNROLL: u32 = 4;
/// Items a gather/scatter batch may have to travel in the kernel's parameters (8 KiB of them:
/// parameters above 4 KiB need CUDA 12.1, which mori requires anyway) instead of a table copied
/// to the device before the launch.
pub const GATHER_SCATTER_INLINE: usize = 256;

fn copy_spec(unroll: u32) -> KernelSpec {
    KernelSpec {
        name: format!("copy/unroll{unroll}"),
        file: "copy/copy.cu".into(),
        source: COPY_SRC.into(),
        defines: vec![("MORI_COPY_UNROLL".into(), unroll.to_string())],
    }
}

/// Stage size and depth of the bulk-copy (TMA) kernel: 4 × 8 KiB of static shared memory.
const BULK_CHUNK: u32 = 8192;
const BULK_STAGES: u32 = 4;
/// The bulk kernel is driven by one thread; a block is one warp so the tail bytes spread wider.
const BULK_THREADS: u32 = 32;

fn copy_bulk_spec() -> KernelSpec {
    KernelSpec {
        name: "copy/bulk".into(),
        file: "copy/copy_bulk.cu".into(),
        source: COPY_BULK_SRC.into(),
        defines: vec![
            ("MORI_BULK_CHUNK".into(), BULK_CHUNK.to_string()),
            ("MORI_BULK_STAGES".into(), BULK_STAGES.to_string()),
        ],
    }
}

fn gather_scatter_spec() -> KernelSpec {
    KernelSpec {
        name: "copy/gather_scatter".into(),
        file: "copy/gather_scatter.cu".into(),
        source: GATHER_SCATTER_SRC.into(),
        defines: vec![
            ("MORI_GS_CHUNK".into(), format!("{GATHER_SCATTER_CHUNK}ull")),
            ("MORI_GS_UNROLL".into(), GATHER_SCATTER_UNROLL.to_string()),
            ("MORI_GS_INLINE".into(), GATHER_SCATTER_INLINE.to_string()),
        ],
    }
}

/// The on-stream barrier of mori.shmem.
pub fn shmem_barrier_spec() -> KernelSpec {
    KernelSpec {
        name: "shmem/barrier".into(),
        file: "shmem/barrier.cu".into(),
        source: SHMEM_BARRIER_SRC.into(),
        defines: Vec::new(),
    }
}

/// The shmem proxy's kernel: applies updates from PEs on other nodes to this PE's heap.
pub fn shmem_proxy_spec() -> KernelSpec {
    KernelSpec {
        name: "shmem/proxy".into(),
        file: "shmem/proxy.cu".into(),
        source: SHMEM_PROXY_SRC.into(),
        defines: Vec::new(),
    }
}

/// mori.ep's intranode (NVLink) layout/notify/dispatch/combine kernels.
pub fn ep_intranode_spec() -> KernelSpec {
    KernelSpec {
        name: "ep/intranode".into(),
        file: "ep/intranode.cu".into(),
        source: EP_INTRANODE_SRC.into(),
        defines: Vec::new(),
    }
}

/// mori.ep's normal mode across nodes (NVLink within a node, the shmem proxy between nodes).
pub fn ep_internode_spec() -> KernelSpec {
    KernelSpec {
        name: "ep/internode".into(),
        file: "ep/internode.cu".into(),
        source: EP_INTERNODE_SRC.into(),
        defines: Vec::new(),
    }
}

/// mori.ep's low-latency (decode) dispatch/combine kernels.
pub fn ep_low_latency_spec() -> KernelSpec {
    KernelSpec {
        name: "ep/low_latency".into(),
        file: "ep/low_latency.cu".into(),
        source: EP_LOW_LATENCY_SRC.into(),
        defines: Vec::new(),
    }
}

/// mori.ccl's collectives (all-reduce, reduce-scatter, all-gather, all-to-all, broadcast).
pub fn ccl_spec() -> KernelSpec {
    KernelSpec {
        name: "collective/ccl".into(),
        file: "collective/ccl.cu".into(),
        source: CCL_SRC.into(),
        defines: Vec::new(),
    }
}

/// Every kernel variant mori may compile. `mori precompile` and CI build all of them.
pub fn variants() -> Vec<KernelSpec> {
    let mut all: Vec<KernelSpec> = COPY_UNROLLS.iter().map(|&u| copy_spec(u)).collect();
    all.push(copy_bulk_spec());
    all.push(gather_scatter_spec());
    all.push(shmem_barrier_spec());
    all.push(shmem_proxy_spec());
    all.push(ep_intranode_spec());
    all.push(ep_low_latency_spec());
    all.push(ep_internode_spec());
    all.push(ccl_spec());
    all
}

/// Grid and block shape of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: u32,
    pub block: u32,
    pub shared_mem_bytes: u32,
}

/// Shared memory a block gets without opting in through cuFuncSetAttribute.
const DEFAULT_SHARED_LIMIT: u32 = 48 * 1024;

/// The one place kernels are launched: checks the shape, binds the context, raises the
/// dynamic shared-memory limit when needed, and passes the parameters either as an array of
/// pointers (`args`) or as a packed buffer (`extra`).
///
/// # Safety
/// Exactly one of `args`/`extra` is non-null and it matches the kernel's parameter list.
unsafe fn launch_raw(
    function: Function,
    cfg: LaunchConfig,
    stream: StreamHandle,
    args: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<()> {
    if cfg.grid == 0 || cfg.block == 0 || cfg.block > 1024 {
        return Err(Error::InvalidArgument(format!(
            "invalid launch shape: grid {} block {}",
            cfg.grid, cfg.block
        )));
    }
    function.device().bind()?;
    if cfg.shared_mem_bytes > DEFAULT_SHARED_LIMIT {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: valid function handle of the bound context.
        let status =
            unsafe { sys::cuFuncSetAttribute(function.raw(), attr, cfg.shared_mem_bytes as i32) };
        check("cuFuncSetAttribute", status)?;
    }
    // SAFETY: the caller guarantees the parameters; the function belongs to the bound context.
    let status = unsafe {
        sys::cuLaunchKernel(
            function.raw(),
            cfg.grid,
            1,
            1,
            cfg.block,
            1,
            1,
            cfg.shared_mem_bytes,
            stream.raw() as sys::CUstream,
            args,
            extra,
        )
    };
    check("cuLaunchKernel", status)
}

/// Launches `function` with its parameters packed in `params` (each at its natural alignment,
/// as the C ABI lays out the parameter list).
///
/// # Safety
/// `params` must match the kernel's parameter list, and every pointer the kernel dereferences
/// must stay valid until it has run.
pub unsafe fn launch_packed(
    function: Function,
    cfg: LaunchConfig,
    stream: StreamHandle,
    params: &mut [u8],
) -> Result<()> {
    let mut size = params.len();
    let mut extra = [
        sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT as usize as *mut c_void,
        params.as_mut_ptr() as *mut c_void,
        sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT as usize as *mut c_void,
        &mut size as *mut usize as *mut c_void,
        sys::CU_LAUNCH_PARAM_END_AS_INT as usize as *mut c_void,
    ];
    // SAFETY: `extra` follows the driver's packed-buffer format; the caller guarantees params.
    unsafe {
        launch_raw(
            function,
            cfg,
            stream,
            std::ptr::null_mut(),
            extra.as_mut_ptr(),
        )
    }
}

/// Launches `function` with the kernel parameters `args` (pointers to each argument's value).
///
/// # Safety
/// `args` must match the kernel's parameter list in number, order and types, and every
/// pointer the kernel dereferences must stay valid until it has run.
pub unsafe fn launch(
    function: Function,
    cfg: LaunchConfig,
    stream: StreamHandle,
    args: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: forwarded contract.
    unsafe {
        launch_raw(
            function,
            cfg,
            stream,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
}

/// How an SM copy moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// Every thread loads and stores 16-byte vectors.
    Vector,
    /// One thread per block drives the bulk-copy (TMA) unit through shared memory (sm_90+).
    Bulk,
}

impl CopyMethod {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "vector" => Ok(Self::Vector),
            "bulk" => Ok(Self::Bulk),
            other => Err(Error::InvalidArgument(format!(
                "unknown copy method {other:?}: use 'vector' or 'bulk'"
            ))),
        }
    }
}

/// Shape of an SM copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyConfig {
    pub method: CopyMethod,
    /// Thread blocks; one per SM used.
    pub blocks: u32,
    /// Threads per block ([`CopyMethod::Vector`] only).
    pub threads: u32,
    /// One of [`COPY_UNROLLS`] ([`CopyMethod::Vector`] only).
    pub unroll: u32,
}

/// Enqueues an SM-driven copy of `len` bytes from `src` to `dst` on `stream`, run by `device`.
/// Either pointer may be a peer device's memory (peer access enabled, or an IPC/VMM mapping).
///
/// # Safety
/// Both ranges must be valid for `device`'s kernels until the copy has run, and must not overlap.
pub unsafe fn copy_async(
    device: Device,
    dst: u64,
    src: u64,
    len: u64,
    stream: StreamHandle,
    cfg: CopyConfig,
) -> Result<()> {
    if cfg.method == CopyMethod::Vector && !COPY_UNROLLS.contains(&cfg.unroll) {
        return Err(Error::InvalidArgument(format!(
            "copy unroll must be one of {COPY_UNROLLS:?}, got {}",
            cfg.unroll
        )));
    }
    if len == 0 {
        return Ok(());
    }
    let (f, block) = match cfg.method {
        CopyMethod::Vector => (
            jit::function(device, &copy_spec(cfg.unroll), "mori_copy")?,
            cfg.threads,
        ),
        CopyMethod::Bulk => (
            jit::function(device, &copy_bulk_spec(), "mori_copy_bulk")?,
            BULK_THREADS,
        ),
    };
    let (mut d, mut s, mut n) = (dst, src, len);
    let mut args = [
        &mut d as *mut u64 as *mut c_void,
        &mut s as *mut u64 as *mut c_void,
        &mut n as *mut u64 as *mut c_void,
    ];
    // SAFETY: both kernels take (dst, src, nbytes); the caller guarantees the ranges.
    unsafe {
        launch(
            f,
            LaunchConfig {
                grid: cfg.blocks,
                block,
                shared_mem_bytes: 0,
            },
            stream,
            &mut args,
        )
    }
}

/// One item of a gather/scatter batch; the layout matches the kernel's `GatherScatterItem`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct DeviceItem {
    src_offset: u64,
    dst_offset: u64,
    size: u64,
    chunk_start: u64,
}

/// The parameter of `mori_gather_scatter_inline`; the layout matches `GatherScatterInline`.
#[repr(C)]
struct InlineTable {
    n_items: u64,
    n_chunks: u64,
    items: [DeviceItem; GATHER_SCATTER_INLINE],
}

/// Builds the kernel's item table, checking every item against the region sizes first, so a
/// bad batch touches no memory. Returns the number of chunks.
fn build_items(
    src_offsets: &[u64],
    dst_offsets: &[u64],
    sizes: &[u64],
    src_len: u64,
    dst_len: u64,
    out: &mut [DeviceItem],
) -> Result<u64> {
    let mut chunks = 0u64;
    for i in 0..sizes.len() {
        let (s, d, n) = (src_offsets[i], dst_offsets[i], sizes[i]);
        let fits = |off: u64, len: u64| off.checked_add(n).is_some_and(|end| end <= len);
        if !fits(s, src_len) || !fits(d, dst_len) {
            return Err(Error::InvalidArgument(format!(
                "gather/scatter item {i} (src offset {s}, dst offset {d}, size {n}) lies outside the \
                 source ({src_len} bytes) or destination ({dst_len} bytes)"
            )));
        }
        out[i] = DeviceItem {
            src_offset: s,
            dst_offset: d,
            size: n,
            chunk_start: chunks,
        };
        chunks += n.div_ceil(GATHER_SCATTER_CHUNK);
    }
    Ok(chunks)
}

/// Reusable state for batched gather/scatter copies on one device: a pinned staging table, its
/// device copy, and an event that says when the previous batch stopped reading them.
pub struct GatherScatter {
    device: Device,
    function: Function,
    inline: Function,
    state: Mutex<Option<Tables>>,
    done: Event,
}

struct Tables {
    staging: PinnedBuffer,
    table: DeviceBuffer,
    capacity: usize,
}

/// Source and destination of a batch: base pointers and the sizes of the regions behind them.
#[derive(Debug, Clone, Copy)]
pub struct Regions {
    pub dst: u64,
    pub dst_len: u64,
    pub src: u64,
    pub src_len: u64,
}

impl GatherScatter {
    pub fn new(device: Device) -> Result<Self> {
        Ok(Self {
            device,
            function: jit::function(device, &gather_scatter_spec(), "mori_gather_scatter")?,
            inline: jit::function(device, &gather_scatter_spec(), "mori_gather_scatter_inline")?,
            state: Mutex::new(None),
            done: Event::new(device, false)?,
        })
    }

    /// Enqueues one launch that copies, for every i, `sizes[i]` bytes from
    /// `src + src_offsets[i]` to `dst + dst_offsets[i]`. Every item is bounds-checked against
    /// the region sizes before anything is enqueued. `blocks` = thread blocks to use.
    ///
    /// # Safety
    /// The regions must be valid for `device`'s kernels until the copy has run, and destination
    /// items must not overlap each other or any source item.
    pub unsafe fn enqueue(
        &self,
        regions: Regions,
        src_offsets: &[u64],
        dst_offsets: &[u64],
        sizes: &[u64],
        stream: StreamHandle,
        blocks: u32,
    ) -> Result<()> {
        let n = sizes.len();
        if src_offsets.len() != n || dst_offsets.len() != n {
            return Err(Error::InvalidArgument(format!(
                "offset and size arrays differ in length: {} src offsets, {} dst offsets, {n} sizes",
                src_offsets.len(),
                dst_offsets.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let grid = |chunks: u64| blocks.max(1).min(u32::try_from(chunks).unwrap_or(u32::MAX));
        let config = |chunks: u64| LaunchConfig {
            grid: grid(chunks),
            block: 512,
            shared_mem_bytes: 0,
        };
        if n <= GATHER_SCATTER_INLINE {
            let mut table = InlineTable {
                n_items: n as u64,
                n_chunks: 0,
                items: [DeviceItem::default(); GATHER_SCATTER_INLINE],
            };
            table.n_chunks = build_items(
                src_offsets,
                dst_offsets,
                sizes,
                regions.src_len,
                regions.dst_len,
                &mut table.items[..n],
            )?;
            if table.n_chunks == 0 {
                return Ok(());
            }
            let (mut dst, mut src) = (regions.dst, regions.src);
            let mut args = [
                &mut dst as *mut u64 as *mut c_void,
                &mut src as *mut u64 as *mut c_void,
                &mut table as *mut InlineTable as *mut c_void,
            ];
            // SAFETY: the arguments match mori_gather_scatter_inline (the driver copies the
            // table at the call); every item was bounds-checked.
            return unsafe { launch(self.inline, config(table.n_chunks), stream, &mut args) };
        }
        let mut state = self.state.lock().map_err(|_| poisoned())?;
        // The previous batch may still read the tables: wait for it before refilling them.
        self.done.synchronize()?;
        if state.as_ref().is_none_or(|t| t.capacity < n) {
            let capacity = n.next_power_of_two().max(256);
            let bytes = capacity * std::mem::size_of::<DeviceItem>();
            *state = Some(Tables {
                staging: PinnedBuffer::new(self.device, bytes)?,
                table: DeviceBuffer::new(self.device, bytes)?,
                capacity,
            });
        }
        let tables = state.as_mut().ok_or_else(poisoned)?;
        let staging_items = {
            let bytes = tables.staging.as_mut_slice();
            // SAFETY: the staging buffer holds `capacity` DeviceItems, is 16-byte aligned (pinned
            // allocations are page aligned) and DeviceItem is plain old data.
            unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut DeviceItem, n) }
        };
        let chunks = build_items(
            src_offsets,
            dst_offsets,
            sizes,
            regions.src_len,
            regions.dst_len,
            staging_items,
        )?;
        if chunks == 0 {
            return Ok(());
        }
        let table_bytes = n * std::mem::size_of::<DeviceItem>();
        // SAFETY: both buffers hold at least table_bytes and live in `state` until `done` fires.
        unsafe {
            crate::memory::copy_async(
                self.device,
                tables.table.ptr(),
                tables.staging.ptr(),
                table_bytes,
                stream,
            )?
        };
        let (mut dst, mut src, mut items, mut n_items, mut n_chunks) = (
            regions.dst,
            regions.src,
            tables.table.ptr(),
            n as u64,
            chunks,
        );
        let mut args = [
            &mut dst as *mut u64 as *mut c_void,
            &mut src as *mut u64 as *mut c_void,
            &mut items as *mut u64 as *mut c_void,
            &mut n_items as *mut u64 as *mut c_void,
            &mut n_chunks as *mut u64 as *mut c_void,
        ];
        // SAFETY: the arguments match mori_gather_scatter; every item was bounds-checked.
        unsafe { launch(self.function, config(chunks), stream, &mut args)? };
        self.done.record(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_a_source_and_unique_name() {
        let all = variants();
        for v in &all {
            assert!(!v.source.is_empty(), "{} has no source", v.name);
        }
        let mut names: Vec<_> = all.iter().map(|v| v.name.clone()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    #[test]
    fn item_table_prefix_and_bounds() {
        let mut out = vec![DeviceItem::default(); 4];
        let c = GATHER_SCATTER_CHUNK;
        let chunks = build_items(
            &[0, 10, 0, 5],
            &[0, 0, 100, 7],
            &[c + 1, 0, 3, c],
            10 * c,
            10 * c,
            &mut out,
        )
        .unwrap();
        assert_eq!(chunks, 4, "2 chunks + 0 + 1 + 1");
        assert_eq!(
            out.iter().map(|i| i.chunk_start).collect::<Vec<_>>(),
            vec![0, 2, 2, 3]
        );
        let err = build_items(&[0], &[u64::MAX], &[2], 100, 100, &mut out).unwrap_err();
        assert!(err.to_string().contains("item 0"), "{err}");
        let err = build_items(&[99], &[0], &[2], 100, 100, &mut out).unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }
}
