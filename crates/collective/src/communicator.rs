//! mori.ccl's host runtime: how a collective call becomes kernel launches on one rank. Every
//! rank plans from the same arguments, so all ranks agree on the launches (pieces, grids and the
//! signatures the kernels compare to catch mismatched calls) without talking to each other.
//!
//! [`plan_all_reduce`], [`plan_reduce_scatter`] and [`plan_exchange`] are pure (tested on the CPU);
//! [`Communicator`] launches their plans with its symmetric buffer and loaded kernels. The buffer
//! is allocated collectively by the caller (mori.shmem), [`Communicator::buffer_bytes`] long and
//! zeroed, and outlives the communicator.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use mori_gpu::StreamHandle;
use mori_gpu::jit::Module;
use mori_gpu::kernels::LaunchConfig;

use crate::across_nodes;
use crate::ccl::{CCL_MAX_RANKS, CclArgs};
use crate::error::{Error, Result};
use crate::launch::Kernel;
use crate::params::KernelParams;
use mori_shmem::Shmem;

/// `MAX_BLOCKS` of ccl.cu: the flag area holds this many blocks per phase.
pub const CCL_MAX_BLOCKS: u32 = 128;
/// Bytes of the state words at the start of the buffer (launch count, error bits).
pub const STATE_BYTES: u64 = 256;
/// `[parity][phase][block][source]` flags of u64 (epoch << 32 | signature).
pub const FLAGS_BYTES: u64 = 2 * 2 * CCL_MAX_BLOCKS as u64 * CCL_MAX_RANKS as u64 * 8;
/// Bytes per vector access: pieces and slices start on these boundaries.
pub const VECTOR: u64 = 16;
/// One block per this many bytes of a block-split segment (one 16-byte vector per thread of a
/// 512-thread block), up to `max_blocks`: a small call's blocks each move their share in one
/// round of loads and stores.
pub const BLOCK_BYTES: u64 = 8 << 10;

/// Sizes of a communicator (mori.ccl's `CclConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CclConfig {
    /// Receive area per parity; one launch moves at most `buffer_bytes / ranks` per peer.
    pub buffer_bytes: u64,
    /// All-reduces up to this many bytes use the one-shot algorithm (None: 4 MiB on 2 ranks,
    /// 256 KiB on more).
    pub one_shot_max_bytes: Option<u64>,
    /// Grid of the large calls.
    pub max_blocks: u32,
    pub threads: u32,
    /// How long a kernel waits for a peer before it records a timeout and returns.
    pub timeout: Duration,
}

impl Default for CclConfig {
    fn default() -> Self {
        Self {
            buffer_bytes: 64 << 20,
            one_shot_max_bytes: None,
            max_blocks: 128,
            threads: 512,
            timeout: Duration::from_secs(10),
        }
    }
}

impl CclConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.buffer_bytes < (1 << 16) || !self.buffer_bytes.is_multiple_of(4096) {
            return bad(format!(
                "buffer_bytes must be a multiple of 4096 and at least 64 KiB, got {}",
                self.buffer_bytes
            ));
        }
        if !(1..=CCL_MAX_BLOCKS).contains(&self.max_blocks) {
            return bad(format!(
                "max_blocks must be in 1..{CCL_MAX_BLOCKS}, got {}",
                self.max_blocks
            ));
        }
        if !self.threads.is_multiple_of(32) || !(32..=1024).contains(&self.threads) {
            return bad(format!(
                "threads must be a multiple of 32 in 32..1024, got {}",
                self.threads
            ));
        }
        if self.timeout.is_zero() {
            return bad("timeout must be positive".into());
        }
        Ok(())
    }
}

/// An enum whose variants have names (what Python passes): `parse` takes a name (or an alias),
/// `name` gives it back.
macro_rules! named {
    ($(#[$meta:meta])* $enum:ident, $what:literal { $($variant:ident = $name:literal $(| $alias:literal)*),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $enum {
            $($variant),+
        }

        impl $enum {
            pub fn parse(s: &str) -> Result<Self> {
                match s {
                    $($name $(| $alias)* => Ok(Self::$variant),)+
                    other => Err(Error::InvalidArgument(format!(
                        concat!("unsupported ", $what, " {:?}: use one of ", $($name, " "),+),
                        other
                    ))),
                }
            }

            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name),+
                }
            }
        }
    };
}

named!(
    /// A reduction; its discriminant is its code in the signatures.
    ReduceOp, "reduction" { Sum = "sum", Max = "max", Min = "min" }
);
named!(
    /// Element types the reductions take (the kernels' entry suffix is the short name).
    DType, "dtype" { F32 = "float32" | "f32", F16 = "float16" | "f16", Bf16 = "bfloat16" | "bf16" }
);
named!(
    /// The all-reduce algorithms.
    Algorithm, "all-reduce algorithm" { OneShot = "one_shot", TwoShot = "two_shot" }
);

impl ReduceOp {
    pub(crate) fn code(self) -> u64 {
        self as u64
    }
}

impl DType {
    pub fn size(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// Operation codes in the signatures (kernels compare them across ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exchange {
    AllGather = 4,
    AllToAll = 5,
    Broadcast = 6,
}
const OP_ALL_REDUCE_ONE_SHOT: u64 = 1;
const OP_ALL_REDUCE_TWO_SHOT: u64 = 2;
const OP_REDUCE_SCATTER: u64 = 3;
/// Across nodes (after the exchanges' 4..6).
pub(crate) const OP_REDUCE_ACROSS_NODES: u64 = 7;
pub(crate) const OP_GATHER_ACROSS_NODES: u64 = 8;

/// A 64-bit mix of a call's parameters; ranks compare them on the GPU to catch mismatches.
pub fn signature(parts: &[u64]) -> u64 {
    const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = GOLDEN;
    for &p in parts {
        h ^= p
            .wrapping_add(GOLDEN)
            .wrapping_add(h << 6)
            .wrapping_add(h >> 2);
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
    }
    h
}

/// The all-reduce algorithm for `nbytes` on `world` ranks (`wanted` overrides).
pub fn choose_algorithm(
    nbytes: u64,
    world: usize,
    config: &CclConfig,
    wanted: Option<Algorithm>,
) -> Algorithm {
    if let Some(a) = wanted {
        return a;
    }
    let limit = config
        .one_shot_max_bytes
        .unwrap_or(if world == 2 { 4 << 20 } else { 256 << 10 });
    if nbytes <= limit {
        Algorithm::OneShot
    } else {
        Algorithm::TwoShot
    }
}

/// `[start, end)` pieces of `length` units, each at most `max_piece` and starting on a multiple
/// of `quantum`. Ranks that agree on `length` agree on the pieces.
pub fn split_pieces(length: u64, max_piece: u64, quantum: u64) -> Vec<(u64, u64)> {
    if length == 0 {
        return vec![(0, 0)];
    }
    let step = quantum.max(max_piece / quantum * quantum);
    (0..length)
        .step_by(step as usize)
        .map(|s| (s, length.min(s + step)))
        .collect()
}

/// Part `k` of `parts` of `length` bytes, on 16-byte boundaries.
pub fn part(length: u64, parts: u64, k: u64) -> (u64, u64) {
    let per = length.div_ceil(parts).div_ceil(VECTOR) * VECTOR;
    (length.min(k * per), length.min((k + 1) * per))
}

fn grid(nbytes: u64, config: &CclConfig) -> u32 {
    nbytes
        .div_ceil(BLOCK_BYTES)
        .clamp(1, u64::from(config.max_blocks)) as u32
}

/// One planned launch: the entry, its grid and the call-specific arguments (the communicator
/// fills in its buffer's).
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub entry: String,
    pub grid: u32,
    pub args: CclArgs,
}

/// Where a communicator's areas are, which plans need (slot sizes) and launches carry.
///
/// With several nodes (ranks `node * local_size ..` on each, consecutive) the load/store
/// kernels run among a node's ranks (`slot_bytes`: per rank of the node), and the cross-node
/// kernels among the ranks at one place on every node, through the shmem proxy, on slots of
/// `x_slot_bytes` per node in the proxy window ([`Geometry::window_bytes`]), not in the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub world: usize,
    pub rank: usize,
    pub nodes: usize,
    /// Bytes each rank of the node owns in a receive area.
    pub slot_bytes: u64,
    /// Across nodes: bytes each node owns in a send or receive slot area (0 on one node).
    pub x_slot_bytes: u64,
}

impl Geometry {
    /// One node.
    pub fn new(rank: usize, world: usize, config: &CclConfig) -> Result<Self> {
        Self::with_nodes(rank, world, 1, config)
    }

    /// `world` ranks on `nodes` nodes of `world / nodes` consecutive ranks each.
    pub fn with_nodes(rank: usize, world: usize, nodes: usize, config: &CclConfig) -> Result<Self> {
        if world == 0 || world > CCL_MAX_RANKS || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "mori.ccl runs 1..{CCL_MAX_RANKS} ranks; got rank {rank} of {world}"
            )));
        }
        if nodes == 0 || !world.is_multiple_of(nodes) {
            return Err(Error::InvalidArgument(format!(
                "mori.ccl across nodes needs the same number of ranks on every node; got {world} \
                 ranks on {nodes} nodes"
            )));
        }
        let local = (world / nodes) as u64;
        Ok(Self {
            world,
            rank,
            nodes,
            slot_bytes: config.buffer_bytes / local / 256 * 256,
            x_slot_bytes: if nodes > 1 {
                (config.buffer_bytes / nodes as u64).min(X_SLOT_MAX_BYTES) / 256 * 256
            } else {
                0
            },
        })
    }

    /// Ranks per node.
    pub fn local_size(&self) -> usize {
        self.world / self.nodes
    }

    /// This rank's node and its place on it.
    pub fn node(&self) -> (usize, usize) {
        (self.rank / self.local_size(), self.rank % self.local_size())
    }

    /// The geometry the load/store kernels see: this rank's node alone.
    pub fn within_node(&self) -> Geometry {
        Geometry {
            world: self.local_size(),
            rank: self.node().1,
            nodes: 1,
            slot_bytes: self.slot_bytes,
            x_slot_bytes: 0,
        }
    }

    fn area(&self) -> u64 {
        self.slot_bytes * self.local_size() as u64
    }
    fn recv_offset(&self) -> u64 {
        STATE_BYTES + FLAGS_BYTES
    }
    fn gather_offset(&self) -> u64 {
        self.recv_offset() + 2 * self.area()
    }
    /// Across nodes: where a reduce-scatter's node-reduced parts wait for the cross-node step.
    pub fn staging_offset(&self) -> u64 {
        self.gather_offset() + 2 * self.area()
    }
    /// The symmetric buffer's size: state, flags, two parities of a receive and a gather area;
    /// across nodes also the reduce-scatter staging.
    pub fn buffer_bytes(&self) -> u64 {
        self.staging_offset() + self.nodes as u64 * self.x_slot_bytes
    }
    /// Across nodes, bytes of the proxy window the cross-node slots take: two parities of send
    /// slots, then of receive slots, then the signals (0 on one node).
    pub fn window_bytes(&self) -> u64 {
        if self.nodes == 1 {
            0
        } else {
            4 * self.nodes as u64 * self.x_slot_bytes + X_SIGNAL_BYTES
        }
    }
}

/// Across nodes: the signal words, `[parity][source node]` u64.
const X_SIGNAL_BYTES: u64 = 2 * CCL_MAX_RANKS as u64 * 8;

/// Across nodes: the most a cross-node slot holds (per node; larger calls go in pieces). The
/// slots are pinned host memory, four per node: 4 MiB keeps a communicator across 2 nodes at 32
/// MiB of the proxy window.
const X_SLOT_MAX_BYTES: u64 = 4 << 20;

/// The launches of an all-reduce of `count` elements from `input` to `output` (device
/// addresses; the same address is in place).
#[allow(clippy::too_many_arguments)]
pub fn plan_all_reduce(
    geo: &Geometry,
    config: &CclConfig,
    input: u64,
    output: u64,
    count: u64,
    dtype: DType,
    op: ReduceOp,
    algorithm: Option<Algorithm>,
) -> Vec<Launch> {
    let (es, n) = (dtype.size(), geo.world as u64);
    let algo = choose_algorithm(count * es, geo.world, config, algorithm);
    let quantum = VECTOR / es;
    let max_piece = match algo {
        Algorithm::OneShot => geo.slot_bytes / es,
        Algorithm::TwoShot => (geo.slot_bytes / es / quantum * quantum) * n,
    };
    let entry = format!(
        "ccl_all_reduce_{}_{}_{}",
        algo.name(),
        dtype.suffix(),
        op.name()
    );
    split_pieces(count, max_piece, quantum)
        .into_iter()
        .map(|(start, end)| {
            let length = end - start;
            let (count, total, out_stride, slice_count, grid, code) = match algo {
                Algorithm::OneShot => (
                    length,
                    0,
                    0,
                    0,
                    grid(length * es, config),
                    OP_ALL_REDUCE_ONE_SHOT,
                ),
                Algorithm::TwoShot => {
                    let slice = length.div_ceil(n).div_ceil(quantum) * quantum;
                    let g = grid(slice * es, config);
                    (slice, length, slice, slice, g, OP_ALL_REDUCE_TWO_SHOT)
                }
            };
            let sig = signature(&[code, es, op.code(), length, u64::from(grid)]);
            Launch {
                entry: entry.clone(),
                grid,
                args: CclArgs {
                    r#in: input + start * es,
                    out: output + start * es,
                    count,
                    total,
                    out_stride,
                    slice_count,
                    sig_send: [sig; CCL_MAX_RANKS],
                    sig_expect: [sig; CCL_MAX_RANKS],
                    ..CclArgs::default()
                },
            }
        })
        .collect()
}

/// The launches of a reduce-scatter: `output` (`m` elements) = the reduction over ranks of each
/// rank's `input[rank*m .. (rank+1)*m]`.
pub fn plan_reduce_scatter(
    geo: &Geometry,
    config: &CclConfig,
    input: u64,
    output: u64,
    m: u64,
    dtype: DType,
    op: ReduceOp,
) -> Vec<Launch> {
    reduce_scatter_range(geo, config, input, output, m, 0, m, dtype, op)
}

/// The launches of elements `[start, end)` of a reduce-scatter of `m` elements per rank:
/// `output` (the address of element `start`) = the reduction over ranks of each rank's
/// `input[rank*m + start .. rank*m + end]`.
#[allow(clippy::too_many_arguments)]
pub fn reduce_scatter_range(
    geo: &Geometry,
    config: &CclConfig,
    input: u64,
    output: u64,
    m: u64,
    start: u64,
    end: u64,
    dtype: DType,
    op: ReduceOp,
) -> Vec<Launch> {
    let (es, n) = (dtype.size(), geo.world as u64);
    let entry = format!("ccl_reduce_scatter_{}_{}", dtype.suffix(), op.name());
    split_pieces(end - start, geo.slot_bytes / es, VECTOR / es)
        .into_iter()
        .map(|(lo, hi)| {
            let length = hi - lo;
            // Slice r of this piece is input[r*m + start + lo .. r*m + start + hi]: stride m.
            let grid = grid(length * es, config);
            let sig = signature(&[OP_REDUCE_SCATTER, es, op.code(), length, m, u64::from(grid)]);
            Launch {
                entry: entry.clone(),
                grid,
                args: CclArgs {
                    r#in: input + (start + lo) * es,
                    out: output + lo * es,
                    count: m,
                    total: m * (n - 1) + length,
                    out_stride: 0,
                    slice_count: length,
                    sig_send: [sig; CCL_MAX_RANKS],
                    sig_expect: [sig; CCL_MAX_RANKS],
                    ..CclArgs::default()
                },
            }
        })
        .collect()
}

/// The push-exchange launches (`ccl_push`) of all-gather, all-to-all and broadcast: `send[p]` =
/// (byte offset in `input`, bytes) for rank p, `recv[r]` = (byte offset in `output`, bytes)
/// from rank r. `agreed`: every rank has the same longest segment, so all derive the same pieces
/// and grid from it; otherwise one launch on the full grid, which must fit one slot.
#[allow(clippy::too_many_arguments)]
pub fn plan_exchange(
    geo: &Geometry,
    config: &CclConfig,
    kind: Exchange,
    input: u64,
    output: u64,
    send: &[(u64, u64)],
    recv: &[(u64, u64)],
    extra: u64,
    agreed: bool,
) -> Result<Vec<Launch>> {
    let n = geo.world;
    if send.len() != n || recv.len() != n {
        return Err(Error::InvalidArgument(format!(
            "an exchange needs one send and one receive segment per rank ({n}), got {} and {}",
            send.len(),
            recv.len()
        )));
    }
    let longest = send.iter().chain(recv).map(|&(_, b)| b).max().unwrap_or(0);
    let (parts, grid) = if agreed {
        let parts = longest.div_ceil(geo.slot_bytes).max(1);
        (parts, grid(longest.div_ceil(parts).max(1), config))
    } else {
        if longest > geo.slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "an exchange with per-rank sizes moves at most {} bytes per rank pair per call \
                 (buffer_bytes / ranks); got {longest}",
                geo.slot_bytes
            )));
        }
        (1, config.max_blocks)
    };
    let kind = kind as u64;
    Ok((0..parts)
        .map(|k| {
            let mut args = CclArgs {
                r#in: input,
                out: output,
                ..CclArgs::default()
            };
            for p in 0..n {
                let (s_off, s_len) = send[p];
                let (lo, hi) = part(s_len, parts, k);
                args.send_offset[p] = s_off + lo;
                args.send_bytes[p] = hi - lo;
                args.sig_send[p] = signature(&[kind, extra, hi - lo, u64::from(grid), parts, k]);
                let (r_off, r_len) = recv[p];
                let (lo, hi) = part(r_len, parts, k);
                args.out_offset[p] = r_off + lo;
                args.recv_bytes[p] = hi - lo;
                args.sig_expect[p] = signature(&[kind, extra, hi - lo, u64::from(grid), parts, k]);
            }
            Launch {
                entry: "ccl_push".into(),
                grid,
                args,
            }
        })
        .collect())
}

/// The number of nodes of a shmem session's layout (`nodes`: every node's PEs), which mori.ccl
/// and mori.ep run on only when every node holds as many consecutive ranks.
pub fn node_count(nodes: &[Vec<usize>]) -> Result<usize> {
    let local = nodes.first().map_or(0, Vec::len);
    let regular = nodes
        .iter()
        .enumerate()
        .all(|(k, pes)| pes.iter().copied().eq(k * local..(k + 1) * local));
    if local == 0 || !regular {
        return Err(Error::InvalidArgument(format!(
            "mori.ccl and mori.ep need the same number of consecutive ranks on every node; the \
             nodes are {nodes:?}"
        )));
    }
    Ok(nodes.len())
}

/// What [`Communicator::create`] allocated: the symmetric buffer and, across nodes, the
/// proxy-window area (offsets, the same on every PE).
#[derive(Debug)]
pub struct CclMemory {
    offset: u64,
    window: Option<u64>,
}

impl CclMemory {
    /// Collective: waits for this GPU's work, then frees the allocations on every PE (also when
    /// waiting failed: that error comes afterwards).
    pub fn free(self, shmem: &Shmem) -> Result<()> {
        let synced = shmem.device().synchronize();
        let freed = shmem.free(self.offset);
        let window = self.window.map_or(Ok(()), |w| shmem.window_free(w));
        synced?;
        freed?;
        Ok(window?)
    }
}

/// One rank's collectives: plans launched on its symmetric buffer with its loaded kernels.
pub struct Communicator {
    geo: Geometry,
    config: CclConfig,
    /// None: a planner only ([`Communicator::prepare`]; launching fails), for tests on the CPU.
    module: Option<Module>,
    /// The symmetric buffer (this rank's address), [`Geometry::buffer_bytes`] long.
    base: u64,
    /// Across nodes: the cross-node slots in the proxy window (this rank's address),
    /// [`Geometry::window_bytes`] long; 0 on one node.
    x_base: u64,
    kernels: Mutex<HashMap<String, Kernel>>,
}

impl Communicator {
    /// A communicator for `rank` of `world` on `nodes` nodes (consecutive ranks, as many on
    /// each) on the zeroed symmetric buffer at `base` (allocated collectively,
    /// [`Geometry::buffer_bytes`] long) and, across nodes, the zeroed proxy-window area at
    /// `x_base` ([`Geometry::window_bytes`] long), launching kernels from `module` (the
    /// `collective/ccl` variant loaded for the shmem session; None: plans are only prepared,
    /// never launched).
    ///
    /// # Safety
    /// `base` and `x_base` must stay allocated, on every rank, as long as launches of this
    /// communicator may run, and every rank's buffer and window area must be reachable at the
    /// same offsets (mori.shmem's symmetric heap and proxy window).
    pub unsafe fn new(
        module: Option<Module>,
        base: u64,
        x_base: u64,
        rank: usize,
        world: usize,
        nodes: usize,
        config: CclConfig,
    ) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            geo: Geometry::with_nodes(rank, world, nodes, &config)?,
            config,
            module,
            base,
            x_base,
            kernels: Mutex::new(HashMap::new()),
        })
    }

    /// Collective over the PEs of `shmem`: loads the kernels, allocates the zeroed symmetric
    /// buffer from the heap (and across nodes the cross-node slots from the proxy window) and
    /// returns this PE's communicator with what it allocated (free that with
    /// [`CclMemory::free`] once no launch of the communicator can run).
    pub fn create(shmem: &Shmem, config: CclConfig) -> Result<(Self, CclMemory)> {
        config.validate()?;
        let (rank, world) = (shmem.my_pe(), shmem.n_pes());
        let nodes = node_count(shmem.nodes())?;
        let geo = Geometry::with_nodes(rank, world, nodes, &config)?;
        // Kernels first: NVRTC may take a while on one PE, and the calloc's barrier then starts
        // every PE's first collective together.
        let module = shmem.load(&mori_gpu::kernels::ccl_spec())?;
        let window = match geo.window_bytes() {
            0 => None,
            n => Some(shmem.window_calloc(n, 256)?),
        };
        let offset = match shmem.calloc(geo.buffer_bytes(), 256) {
            Ok(offset) => offset,
            Err(e) => {
                // Collective like the calloc: every PE failed it alike.
                if let Some(w) = window {
                    let _ = shmem.window_free(w);
                }
                return Err(e.into());
            }
        };
        let memory = CclMemory { offset, window };
        // SAFETY: the allocations are symmetric, zeroed and live until `memory` is freed, which
        // its caller does after the communicator's last launch ran.
        let comm = unsafe {
            Self::new(
                Some(module),
                shmem.heap_base() + offset,
                window.map_or(0, |w| shmem.state().window_base + w),
                rank,
                world,
                nodes,
                config,
            )
        };
        match comm {
            Ok(comm) => Ok((comm, memory)),
            Err(e) => {
                let _ = memory.free(shmem);
                Err(e)
            }
        }
    }

    /// This rank's address of the symmetric buffer: launches done (u64), then the error bits
    /// (u32) at its start.
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    pub fn config(&self) -> &CclConfig {
        &self.config
    }

    /// `plan` with this communicator's buffer filled in: what each launch passes. Launches
    /// that name no team run among this rank's node.
    pub fn prepare(&self, plan: Vec<Launch>) -> Vec<Launch> {
        let timeout_ns = u64::try_from(self.config.timeout.as_nanos()).unwrap_or(u64::MAX);
        let local = self.geo.local_size() as u64;
        let first_of_node = self.geo.node().0 as u64 * local;
        plan.into_iter()
            .map(|mut l| {
                l.args.base = self.base;
                l.args.recv_offset = self.geo.recv_offset();
                l.args.gather_offset = self.geo.gather_offset();
                l.args.parity_stride = self.geo.area();
                l.args.slot_bytes = self.geo.slot_bytes;
                l.args.timeout_ns = timeout_ns;
                l.args.x_base = self.x_base;
                l.args.x_slot_bytes = self.geo.x_slot_bytes;
                if l.args.team_size == 0 {
                    (l.args.team_base, l.args.team_stride, l.args.team_size) =
                        (first_of_node, 1, local);
                }
                l
            })
            .collect()
    }

    /// The launches of an all-reduce (see [`plan_all_reduce`]; across nodes,
    /// [`across_nodes::all_reduce`]).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_all_reduce(
        &self,
        input: u64,
        output: u64,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Result<Vec<Launch>> {
        let (geo, config) = (&self.geo, &self.config);
        if geo.nodes == 1 {
            return Ok(plan_all_reduce(
                geo, config, input, output, count, dtype, op, algorithm,
            ));
        }
        across_nodes::all_reduce(geo, config, input, output, count, dtype, op, algorithm)
    }

    /// The launches of a reduce-scatter into `m` elements per rank.
    pub fn plan_reduce_scatter(
        &self,
        input: u64,
        output: u64,
        m: u64,
        dtype: DType,
        op: ReduceOp,
    ) -> Vec<Launch> {
        let (geo, config) = (&self.geo, &self.config);
        if geo.nodes == 1 {
            return plan_reduce_scatter(geo, config, input, output, m, dtype, op);
        }
        let staging = self.base + geo.staging_offset();
        across_nodes::reduce_scatter(geo, config, staging, input, output, m, dtype, op)
    }

    /// The launches of an all-gather of `nbytes` per rank into `output` in rank order.
    pub fn plan_all_gather(&self, input: u64, output: u64, nbytes: u64) -> Result<Vec<Launch>> {
        let (geo, config) = (&self.geo, &self.config);
        if geo.nodes > 1 {
            return across_nodes::all_gather(geo, config, input, output, nbytes);
        }
        let n = geo.world;
        let send = vec![(0, nbytes); n];
        let recv: Vec<(u64, u64)> = (0..n as u64).map(|r| (r * nbytes, nbytes)).collect();
        plan_exchange(
            geo,
            config,
            Exchange::AllGather,
            input,
            output,
            &send,
            &recv,
            0,
            true,
        )
    }

    /// The launches of an all-to-all or broadcast exchange (one node only).
    #[allow(clippy::too_many_arguments)]
    pub fn plan_exchange(
        &self,
        kind: Exchange,
        input: u64,
        output: u64,
        send: &[(u64, u64)],
        recv: &[(u64, u64)],
        extra: u64,
        agreed: bool,
    ) -> Result<Vec<Launch>> {
        if self.geo.nodes > 1 {
            return Err(Error::InvalidArgument(format!(
                "mori.ccl across nodes runs all_reduce, reduce_scatter and all_gather; {kind:?} \
                 needs every rank on one node (these ranks are on {} nodes)",
                self.geo.nodes
            )));
        }
        plan_exchange(
            &self.geo,
            &self.config,
            kind,
            input,
            output,
            send,
            recv,
            extra,
            agreed,
        )
    }

    /// Launches `plan` on `stream`, filling in this communicator's buffer.
    ///
    /// # Safety
    /// Every address in the plan must stay valid until its kernels have run.
    pub unsafe fn launch(&self, plan: Vec<Launch>, stream: StreamHandle) -> Result<()> {
        for Launch { entry, grid, args } in self.prepare(plan) {
            let kernel = self.kernel(&entry)?;
            let cfg = LaunchConfig {
                grid,
                block: self.config.threads,
                shared_mem_bytes: 0,
            };
            // SAFETY: the caller vouches for the plan's addresses; the buffer's for `new`'s.
            unsafe { kernel.launch(cfg, stream, args.packed())? };
        }
        Ok(())
    }

    fn kernel(&self, entry: &str) -> Result<Kernel> {
        let module = self.module.as_ref().ok_or_else(|| {
            Error::InvalidArgument("this communicator only plans: it has no kernels".into())
        })?;
        let mut kernels = self
            .kernels
            .lock()
            .map_err(|_| Error::InvalidArgument("the kernel table is poisoned".into()))?;
        if let Some(k) = kernels.get(entry) {
            return Ok(*k);
        }
        let k = Kernel::load(module, entry)?;
        kernels.insert(entry.to_string(), k);
        Ok(k)
    }

    /// All-reduce of `count` elements (see [`Communicator::plan_all_reduce`]).
    ///
    /// # Safety
    /// `input` and `output` must be device memory of `count` elements, valid until the
    /// kernels have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn all_reduce(
        &self,
        input: u64,
        output: u64,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
        stream: StreamHandle,
    ) -> Result<()> {
        let plan = self.plan_all_reduce(input, output, count, dtype, op, algorithm)?;
        // SAFETY: the caller's guarantee.
        unsafe { self.launch(plan, stream) }
    }

    /// Reduce-scatter into `m` elements per rank (see [`Communicator::plan_reduce_scatter`]).
    ///
    /// # Safety
    /// As [`Communicator::all_reduce`], `input` holding `world * m` elements.
    pub unsafe fn reduce_scatter(
        &self,
        input: u64,
        output: u64,
        m: u64,
        dtype: DType,
        op: ReduceOp,
        stream: StreamHandle,
    ) -> Result<()> {
        let plan = self.plan_reduce_scatter(input, output, m, dtype, op);
        // SAFETY: the caller's guarantee.
        unsafe { self.launch(plan, stream) }
    }

    /// All-gather of `nbytes` per rank (see [`Communicator::plan_all_gather`]).
    ///
    /// # Safety
    /// `input` (`nbytes`) and `output` (`world * nbytes`) must be device memory valid until the
    /// kernels have run.
    pub unsafe fn all_gather(
        &self,
        input: u64,
        output: u64,
        nbytes: u64,
        stream: StreamHandle,
    ) -> Result<()> {
        let plan = self.plan_all_gather(input, output, nbytes)?;
        // SAFETY: the caller's guarantee.
        unsafe { self.launch(plan, stream) }
    }

    /// A push exchange (see [`Communicator::plan_exchange`]).
    ///
    /// # Safety
    /// Every segment must lie in device memory valid until the kernels have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn exchange(
        &self,
        kind: Exchange,
        input: u64,
        output: u64,
        send: &[(u64, u64)],
        recv: &[(u64, u64)],
        extra: u64,
        agreed: bool,
        stream: StreamHandle,
    ) -> Result<()> {
        let plan = self.plan_exchange(kind, input, output, send, recv, extra, agreed)?;
        // SAFETY: the caller's guarantee.
        unsafe { self.launch(plan, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_ranks() -> (Geometry, CclConfig) {
        let config = CclConfig::default();
        (Geometry::new(0, 2, &config).unwrap(), config)
    }

    /// Values of mori.ccl's Python planner before it moved here: ranks of an old and a new
    /// build must agree on every signature.
    #[test]
    fn signatures_and_pieces_match_the_python_planner() {
        assert_eq!(signature(&[1, 4, 0, 1000, 1]), 0x5c45_9fd7_6154_783c);
        assert_eq!(signature(&[5, 3584, 4096, 2, 1, 0]), 0x4810_1e28_49ee_5a2a);
        assert_eq!(signature(&[]), 0x9e37_79b9_7f4a_7c15);
        assert_eq!(split_pieces(10, 4, 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(split_pieces(0, 8, 4), vec![(0, 0)]);
        assert_eq!(
            split_pieces(100, 33, 8),
            vec![(0, 32), (32, 64), (64, 96), (96, 100)]
        );
        assert_eq!(part(1000, 3, 0), (0, 336));
        assert_eq!(part(1000, 3, 2), (672, 1000));
        assert_eq!(part(5, 4, 3), (5, 5));
    }

    #[test]
    fn the_algorithm_follows_the_size_and_the_rank_count() {
        let c = CclConfig::default();
        assert_eq!(choose_algorithm(4 << 20, 2, &c, None), Algorithm::OneShot);
        assert_eq!(
            choose_algorithm((4 << 20) + 1, 2, &c, None),
            Algorithm::TwoShot
        );
        assert_eq!(choose_algorithm(256 << 10, 4, &c, None), Algorithm::OneShot);
        assert_eq!(
            choose_algorithm((256 << 10) + 2, 8, &c, None),
            Algorithm::TwoShot
        );
        let c = CclConfig {
            one_shot_max_bytes: Some(0),
            ..c
        };
        assert_eq!(choose_algorithm(2, 2, &c, None), Algorithm::TwoShot);
        assert_eq!(
            choose_algorithm(1 << 30, 2, &c, Some(Algorithm::OneShot)),
            Algorithm::OneShot
        );
    }

    #[test]
    fn a_large_all_reduce_is_cut_into_slot_sized_pieces_covering_it_once() {
        let (geo, config) = two_ranks();
        let count = 50_000_000u64; // bf16: 100 MB, two-shot, several pieces
        let plan = plan_all_reduce(
            &geo,
            &config,
            0x1000_0000,
            0x9000_0000,
            count,
            DType::Bf16,
            ReduceOp::Max,
            None,
        );
        assert!(plan.len() > 1);
        let mut next = 0x1000_0000u64;
        let mut elements = 0;
        for l in &plan {
            assert_eq!(l.entry, "ccl_all_reduce_two_shot_bf16_max");
            assert_eq!(l.args.r#in, next, "pieces are contiguous");
            assert_eq!(l.args.out - 0x9000_0000, l.args.r#in - 0x1000_0000);
            assert!(l.args.count * 2 <= geo.slot_bytes, "a slice fits one slot");
            assert!(l.grid >= 1 && l.grid <= config.max_blocks);
            next += l.args.total * 2;
            elements += l.args.total;
        }
        assert_eq!(elements, count);
    }

    #[test]
    fn ranks_with_different_calls_get_different_signatures() {
        let (geo, config) = two_ranks();
        let sig = |count, dtype, op| {
            plan_all_reduce(&geo, &config, 0, 0, count, dtype, op, None)[0]
                .args
                .sig_send[0]
        };
        let base = sig(1000, DType::F32, ReduceOp::Sum);
        assert_ne!(base, sig(1001, DType::F32, ReduceOp::Sum));
        assert_ne!(base, sig(1000, DType::F32, ReduceOp::Max));
        assert_ne!(base, sig(1000, DType::Bf16, ReduceOp::Sum));
        let peer = Geometry::new(1, 2, &config).unwrap();
        assert_eq!(
            plan_all_reduce(&peer, &config, 8, 8, 1000, DType::F32, ReduceOp::Sum, None)[0]
                .args
                .sig_expect[0],
            base,
            "the other rank expects what this one sends"
        );
    }

    #[test]
    fn an_exchange_with_unequal_sizes_must_fit_one_slot() {
        let (geo, config) = two_ranks();
        let big = geo.slot_bytes + 16;
        let send = [(0, 16), (16, big)];
        let recv = [(0, 16), (16, 16)];
        let e = plan_exchange(
            &geo,
            &config,
            Exchange::AllToAll,
            0,
            0,
            &send,
            &recv,
            4,
            false,
        );
        assert!(matches!(e, Err(Error::InvalidArgument(_))));
        let plan = plan_exchange(
            &geo,
            &config,
            Exchange::AllGather,
            0,
            0,
            &send,
            &recv,
            0,
            true,
        )
        .unwrap();
        assert_eq!(
            plan.len(),
            2,
            "the longest segment takes two slot-sized parts"
        );
        let sent: u64 = plan.iter().map(|l| l.args.send_bytes[1]).sum();
        assert_eq!(sent, big);
    }

    /// The buffer layout and limits this runtime assumes are the kernel's.
    #[test]
    fn constants_and_grids_match_the_kernel() {
        let src = include_str!("../../../kernels/collective/ccl.cu");
        assert!(src.contains(&format!("constexpr int MAX_BLOCKS = {CCL_MAX_BLOCKS};")));
        assert!(src.contains(&format!("constexpr int MAX_RANKS = {CCL_MAX_RANKS};")));
        // One u64 flag (epoch << 32 | signature) per [parity][phase][block][source].
        assert!(src.contains("u64* flags = reinterpret_cast<u64*>(a.base + FLAGS_OFFSET);"));
        let c = CclConfig::default();
        assert_eq!((grid(1, &c), grid(4096, &c), grid(64 << 10, &c)), (1, 1, 8));
        assert_eq!(grid(4 << 20, &c), c.max_blocks);
        let few = CclConfig { max_blocks: 8, ..c };
        assert_eq!(grid(1 << 20, &few), 8);
    }

    /// Pieces and parts cover their range once, on their boundaries.
    #[test]
    fn pieces_and_parts_cover_their_range() {
        for (length, max_piece, quantum) in
            [(1, 8, 8), (17, 8, 8), (64, 8, 8), (1000, 96, 8), (5, 3, 4)]
        {
            let pieces = split_pieces(length, max_piece, quantum);
            assert_eq!((pieces[0].0, pieces.last().unwrap().1), (0, length));
            assert!(pieces.windows(2).all(|w| w[0].1 == w[1].0));
            assert!(
                pieces
                    .iter()
                    .all(|&(a, b)| a % quantum == 0 && b - a <= quantum.max(max_piece))
            );
        }
        for length in [0, 1, 15, 16, 17, 1000, 4097] {
            for parts in [1, 2, 3, 7] {
                let got: Vec<_> = (0..parts).map(|k| part(length, parts, k)).collect();
                assert_eq!((got[0].0, got.last().unwrap().1), (0, length));
                assert!(got.windows(2).all(|w| w[0].1 == w[1].0));
                // Empty tail parts sit at the end.
                assert!(
                    got.iter()
                        .all(|&(a, b)| a % VECTOR == 0 || a == b && b == length)
                );
            }
        }
    }

    #[test]
    fn configs_outside_the_kernels_limits_are_refused() {
        for bad in [
            CclConfig {
                buffer_bytes: 4096,
                ..CclConfig::default()
            },
            CclConfig {
                max_blocks: CCL_MAX_BLOCKS + 1,
                ..CclConfig::default()
            },
            CclConfig {
                threads: 48,
                ..CclConfig::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(Geometry::new(0, CCL_MAX_RANKS + 1, &CclConfig::default()).is_err());
        assert!(Geometry::new(2, 2, &CclConfig::default()).is_err());
    }
}
