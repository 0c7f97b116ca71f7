//! Bindings of mori-collective: mori.ep's and mori.ccl's kernels launched with their typed
//! parameter structs, filled from Python values (positional in struct order, or by field name).

use std::sync::{Arc, Mutex};

use mori_collective::KernelParams;
use mori_collective::communicator::{
    Algorithm, CclConfig, CclMemory, Communicator, DType, Exchange, Launch, ReduceOp, node_count,
};
use mori_collective::ep_buffers::{Ep, EpMemory};
use mori_collective::ep_runtime;
use mori_collective::params::CType;
use mori_collective::{Packed, Packer, Value};
use mori_gpu::StreamHandle;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::errors::Result;
use crate::shmem::{Shmem, finalized};

/// Sets field `index` of `packer` from `obj`, converted to the field's C type.
fn set(packer: &mut Packer, index: usize, obj: &Bound<'_, PyAny>) -> Result<()> {
    let field = packer.layout().fields[index];
    let bad = |e: PyErr| mori_collective::Error::Field {
        entry: packer.entry(),
        field: field.name.to_string(),
        problem: match field.len {
            1 => format!("({}): {e}", field.ty.c_name()),
            n => format!("({}[{n}]): {e}", field.ty.c_name()),
        },
    };
    let elements: Vec<u64>;
    let value = match (field.ty, field.len) {
        (CType::U64, n) if n > 1 => {
            elements = obj.extract().map_err(bad)?;
            Value::U64s(&elements)
        }
        (CType::Ptr, _) => Value::Ptr(obj.extract().map_err(bad)?),
        (CType::I32, _) => Value::I32(obj.extract().map_err(bad)?),
        (CType::U32, _) => Value::U32(obj.extract().map_err(bad)?),
        (CType::I64, _) => Value::I64(obj.extract().map_err(bad)?),
        (CType::U64, _) => Value::U64(obj.extract().map_err(bad)?),
        (CType::F32, _) => Value::F32(obj.extract().map_err(bad)?),
    };
    Ok(packer.set(index, value)?)
}

/// The parameters of `packer`'s entry from `fields` (struct order) and `named` (by name).
fn pack(
    mut packer: Packer,
    fields: &Bound<'_, PyTuple>,
    named: Option<&Bound<'_, PyDict>>,
) -> Result<Packed> {
    let layout = packer.layout();
    if fields.len() > layout.fields.len() {
        return Err(mori_collective::Error::Arity {
            entry: packer.entry(),
            expected: layout.fields.len(),
            got: fields.len(),
            fields: layout.describe(),
        }
        .into());
    }
    for (i, obj) in fields.iter().enumerate() {
        set(&mut packer, i, &obj)?;
    }
    for (name, obj) in named.into_iter().flatten() {
        let name: String = name
            .extract()
            .map_err(|e: PyErr| crate::errors::Error::InvalidArgument(e.to_string()))?;
        let (i, _) = layout
            .field(&name)
            .ok_or_else(|| mori_collective::Error::UnknownField {
                entry: packer.entry(),
                field: name.clone(),
                fields: layout.describe(),
            })?;
        set(&mut packer, i, &obj)?;
    }
    Ok(packer.finish()?)
}

/// The parameter bytes one launch of `entry` passes (what `Kernel.__call__` hands the driver).
#[pyfunction]
#[pyo3(signature = (entry, *fields, **named))]
pub fn kernel_params<'py>(
    py: Python<'py>,
    entry: &str,
    fields: &Bound<'py, PyTuple>,
    named: Option<&Bound<'py, PyDict>>,
) -> Result<Bound<'py, PyBytes>> {
    let packed = pack(mori_collective::packer(entry)?, fields, named)?;
    Ok(PyBytes::new(py, packed.bytes()))
}

/// mori.ccl's host runtime for one rank (`mori_collective::communicator`): each collective is
/// planned and launched in Rust, one call from Python. `create` makes it with the memory it
/// launches on, freed by `destroy`; `CclRuntime(...)` only plans: each call then returns its
/// launches (entry, grid, parameter bytes) instead of launching them.
#[pyclass(frozen, module = "mori._core")]
pub struct CclRuntime {
    session: Option<Arc<Mutex<Option<mori_shmem::Shmem>>>>,
    inner: Communicator,
    /// What `create` allocated (None once destroyed); None for a planner.
    memory: Option<Mutex<Option<CclMemory>>>,
}

/// Frees what `create` allocated, once: collective, with the GIL released.
fn free_once<M>(
    py: Python<'_>,
    memory: &Option<Mutex<Option<M>>>,
    session: &Option<Arc<Mutex<Option<mori_shmem::Shmem>>>>,
    free: impl FnOnce(M, &mori_shmem::Shmem) -> mori_collective::Result<()> + Send,
) -> Result<()>
where
    M: Send,
{
    let Some(slot) = memory else {
        return Ok(());
    };
    let Some(taken) = slot.lock().map_err(|_| finalized())?.take() else {
        return Ok(());
    };
    let session = session.as_ref().ok_or_else(finalized)?;
    py.detach(|| {
        let guard = session.lock().map_err(|_| finalized())?;
        let shmem = guard.as_ref().ok_or_else(finalized)?;
        Ok(free(taken, shmem)?)
    })
}

/// The lock on what `create` allocated, held while launching so it is not freed meanwhile
/// (None for a planner); `closed` once it was freed.
fn alive<'a, M>(
    memory: &'a Option<Mutex<Option<M>>>,
    closed: &str,
) -> Result<Option<std::sync::MutexGuard<'a, Option<M>>>> {
    let Some(slot) = memory else {
        return Ok(None);
    };
    let gone = || crate::errors::Error::Closed(closed.into());
    let guard = slot.lock().map_err(|_| gone())?;
    if guard.is_none() {
        return Err(gone());
    }
    Ok(Some(guard))
}

/// A launch as Python sees a planned one: entry, grid, the kernel's parameter bytes.
type PlannedLaunch = (String, u32, Vec<u8>);

impl CclRuntime {
    /// Launches `plan` on `stream` (None: only plans, and returns the launches).
    fn run(&self, plan: Vec<Launch>, stream: Option<usize>) -> Result<Option<Vec<PlannedLaunch>>> {
        let Some(stream) = stream else {
            return Ok(Some(
                self.inner
                    .prepare(plan)
                    .into_iter()
                    .map(|l| (l.entry, l.grid, l.args.packed().bytes().to_vec()))
                    .collect(),
            ));
        };
        match &self.session {
            Some(s) if s.lock().map_err(|_| finalized())?.is_some() => {}
            _ => return Err(finalized()),
        }
        let _alive = alive(&self.memory, "this mori.ccl Communicator")?;
        // SAFETY: mori.ccl checked every tensor the plan addresses (on this rank's GPU, the
        // sizes planned) and keeps them alive until the stream ran the kernels; the buffer
        // stays allocated until `destroy`, which waits for this GPU's work, and not while
        // `_alive` is held.
        unsafe { self.inner.launch(plan, StreamHandle::from_raw(stream)) }?;
        Ok(None)
    }
}

/// mori.ccl's CclConfig as Python passes it (`CclConfig._runtime_args`): buffer bytes, the
/// one-shot limit, max blocks, threads, timeout in seconds.
type CclConfigArgs = (u64, Option<u64>, u32, u32, f64);

fn ccl_config(args: CclConfigArgs) -> Result<CclConfig> {
    let (buffer_bytes, one_shot_max_bytes, max_blocks, threads, timeout_s) = args;
    let invalid = |m: String| mori_collective::Error::InvalidArgument(m);
    if timeout_s.is_nan() || timeout_s <= 0.0 {
        return Err(invalid(format!("timeout_s must be positive, got {timeout_s}")).into());
    }
    let timeout = std::time::Duration::try_from_secs_f64(timeout_s)
        .map_err(|_| invalid(format!("timeout_s {timeout_s} is too large")))?;
    let config = CclConfig {
        buffer_bytes,
        one_shot_max_bytes,
        max_blocks,
        threads,
        timeout,
    };
    config.validate()?;
    Ok(config)
}

/// Checks a communicator's sizes (mori.ccl's CclConfig) against the kernels' limits.
#[pyfunction]
pub fn ccl_check_config(config: CclConfigArgs) -> Result<()> {
    ccl_config(config).map(|_| ())
}

#[pymethods]
impl CclRuntime {
    /// A planner (it never launches): each call returns its launches for rank `rank` of
    /// `world` on `nodes` (every node's ranks, as many consecutive ranks on each), with the
    /// buffer at `base` and the proxy-window area at `x_base` (addresses written into the
    /// parameters only). `create` makes a runtime that launches.
    #[new]
    fn new(
        base: u64,
        x_base: u64,
        rank: usize,
        world: usize,
        nodes: Vec<Vec<usize>>,
        config: CclConfigArgs,
    ) -> Result<Self> {
        let config = ccl_config(config)?;
        let nodes = node_count(&nodes)?;
        // SAFETY: without a module the communicator never launches; the addresses are only
        // written into planned parameters.
        let inner = unsafe { Communicator::new(None, base, x_base, rank, world, nodes, config) }?;
        Ok(Self {
            session: None,
            inner,
            memory: None,
        })
    }

    /// Collective: loads the kernels, allocates the communicator's zeroed buffer on `session`'s
    /// heap (and across nodes its proxy-window area) and returns the runtime that launches on
    /// them (`mori_collective::communicator::Communicator::create`).
    #[staticmethod]
    fn create(py: Python<'_>, session: &Shmem, config: CclConfigArgs) -> Result<Self> {
        let config = ccl_config(config)?;
        let (inner, memory) =
            py.detach(|| session.with(|s| Ok(Communicator::create(s, config)?)))?;
        Ok(Self {
            session: Some(session.inner.clone()),
            inner,
            memory: Some(Mutex::new(Some(memory))),
        })
    }

    /// This rank's address of the symmetric buffer (launches done, u64, then the error bits).
    #[getter]
    fn base(&self) -> u64 {
        self.inner.base()
    }

    /// Collective: waits for this GPU's work, then frees what `create` allocated on every rank;
    /// later launches raise. A second call does nothing.
    fn destroy(&self, py: Python<'_>) -> Result<()> {
        free_once(py, &self.memory, &self.session, CclMemory::free)
    }

    /// Bytes each peer owns in a receive area (the most one launch moves per rank pair).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.inner.geometry().slot_bytes
    }

    /// Bytes of the symmetric buffer this communicator uses.
    #[getter]
    fn buffer_bytes_needed(&self) -> u64 {
        self.inner.geometry().buffer_bytes()
    }

    /// Bytes of the proxy window this communicator uses (its cross-node slots; 0 on one node).
    #[getter]
    fn window_bytes_needed(&self) -> u64 {
        self.inner.geometry().window_bytes()
    }

    /// An all-reduce of `count` elements, launched on `stream` (None: planned only).
    #[pyo3(signature = (stream, input, output, count, dtype, op, algorithm=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_reduce(
        &self,
        stream: Option<usize>,
        input: u64,
        output: u64,
        count: u64,
        dtype: &str,
        op: &str,
        algorithm: Option<&str>,
    ) -> Result<Option<Vec<PlannedLaunch>>> {
        let (dtype, op) = (DType::parse(dtype)?, ReduceOp::parse(op)?);
        let algorithm = algorithm.map(Algorithm::parse).transpose()?;
        let plan = self
            .inner
            .plan_all_reduce(input, output, count, dtype, op, algorithm)?;
        self.run(plan, stream)
    }

    /// A reduce-scatter into `m` elements per rank, launched on `stream` (None: planned only).
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter(
        &self,
        stream: Option<usize>,
        input: u64,
        output: u64,
        m: u64,
        dtype: &str,
        op: &str,
    ) -> Result<Option<Vec<PlannedLaunch>>> {
        let (dtype, op) = (DType::parse(dtype)?, ReduceOp::parse(op)?);
        let plan = self.inner.plan_reduce_scatter(input, output, m, dtype, op);
        self.run(plan, stream)
    }

    /// An all-gather of `nbytes` per rank into `output` in rank order, launched on `stream`
    /// (None: planned only).
    fn all_gather(
        &self,
        stream: Option<usize>,
        input: u64,
        output: u64,
        nbytes: u64,
    ) -> Result<Option<Vec<PlannedLaunch>>> {
        let plan = self.inner.plan_all_gather(input, output, nbytes)?;
        self.run(plan, stream)
    }

    /// A push exchange (`kind`: "all_gather", "all_to_all" or "broadcast"; one node): `send[p]` = (byte
    /// offset in input, bytes) for rank p, `recv[r]` = (byte offset in output, bytes) from rank
    /// r; launched on `stream` (None: planned only).
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        stream: Option<usize>,
        kind: &str,
        input: u64,
        output: u64,
        send: Vec<(u64, u64)>,
        recv: Vec<(u64, u64)>,
        extra: u64,
        agreed: bool,
    ) -> Result<Option<Vec<PlannedLaunch>>> {
        let kind = match kind {
            "all_gather" => Exchange::AllGather,
            "all_to_all" => Exchange::AllToAll,
            "broadcast" => Exchange::Broadcast,
            other => {
                return Err(mori_collective::Error::InvalidArgument(format!(
                    "unknown exchange {other:?}: use all_gather, all_to_all or broadcast"
                ))
                .into());
            }
        };
        let plan = self
            .inner
            .plan_exchange(kind, input, output, &send, &recv, extra, agreed)?;
        self.run(plan, stream)
    }
}

/// mori.ep's host runtime for one rank (`mori_collective::ep_runtime`): each operation's
/// launches filled in Rust from typed parameter structs, one call from Python. `create` makes
/// it with the memory it launches with (`mori_collective::ep_buffers::Ep`), freed by
/// `destroy`; `EpRuntime(...)` only plans: each call then returns its launches (entry, grid,
/// block, shared bytes, parameter bytes) instead of making them.
#[pyclass(frozen, module = "mori._core")]
pub struct EpRuntime {
    session: Option<Arc<Mutex<Option<mori_shmem::Shmem>>>>,
    inner: ep_runtime::EpRuntime,
    /// What `create` allocated (None once destroyed); None for a planner.
    memory: Option<Mutex<Option<EpMemory>>>,
}

/// Held while a runtime made by `create` launches: its memory is not freed meanwhile.
type Alive<'a> = Option<std::sync::MutexGuard<'a, Option<EpMemory>>>;

/// A launch as Python sees a planned EP one.
type PlannedEp = Option<Vec<(&'static str, u32, u32, u32, Vec<u8>)>>;

impl EpRuntime {
    /// The stream to launch on (None: plan only), after checking the session is alive, and
    /// the guard that keeps `create`'s memory from being freed while the launches are made.
    fn stream(&self, stream: Option<usize>) -> Result<(Option<StreamHandle>, Alive<'_>)> {
        let alive = self.alive()?;
        let Some(stream) = stream else {
            return Ok((None, alive));
        };
        match &self.session {
            Some(s) if s.lock().map_err(|_| finalized())?.is_some() => {}
            _ => return Err(finalized()),
        }
        Ok((Some(StreamHandle::from_raw(stream)), alive))
    }

    /// The lock on the memory `create` allocated (None for a planner); an error once
    /// destroyed.
    fn alive(&self) -> Result<Alive<'_>> {
        alive(&self.memory, "this mori.ep Buffer")
    }

    fn owned<T>(&self, f: impl FnOnce(&EpMemory) -> T) -> Result<T> {
        match self.alive()?.as_deref() {
            Some(Some(memory)) => Ok(f(memory)),
            _ => Err(crate::errors::Error::InvalidArgument(
                "this EP runtime is a planner (EpRuntime(...)): only EpRuntime.create's has memory"
                    .into(),
            )),
        }
    }

    fn layout(&self, base: u64, num_tokens: u32) -> ep_runtime::Layout {
        let s = self.inner_shape();
        ep_runtime::Layout {
            base,
            num_tokens: u64::from(num_tokens),
            num_ranks: u64::from(s.num_ranks),
            num_experts: u64::from(s.num_experts),
        }
    }

    fn inner_shape(&self) -> &ep_runtime::EpShape {
        self.inner.shape()
    }
}

fn ep_shape(shape: (u32, u32, u32, u32, u32, u32)) -> ep_runtime::EpShape {
    ep_runtime::EpShape {
        num_ranks: shape.0,
        num_experts: shape.1,
        hidden: shape.2,
        topk: shape.3,
        max_tokens: shape.4,
        low_latency_max_tokens: shape.5,
    }
}

/// Bytes of mori.ep's areas across `nodes` nodes for `shape` (as `EpRuntime`'s): (count
/// vectors on the heap, flags on the heap, the proxy window area).
#[pyfunction]
pub fn ep_internode_sizes(shape: (u32, u32, u32, u32, u32, u32), nodes: u32) -> (u64, u64, u64) {
    let s = mori_collective::ep_internode::Internode::sizes(&ep_shape(shape), nodes);
    (s.counts_bytes, s.flags_bytes, s.window_bytes)
}

/// Bytes of one token's record between nodes in a dispatch of rows of `row_bytes` with
/// `scale_cols` FP8 scales (what crosses per token and destination node).
#[pyfunction]
pub fn ep_internode_record_bytes(
    shape: (u32, u32, u32, u32, u32, u32),
    nodes: u32,
    row_bytes: u64,
    scale_cols: u64,
) -> u64 {
    let shape = ep_shape(shape);
    mori_collective::ep_internode::Internode::geometry(&shape, nodes)
        .record_stride(&shape, row_bytes, scale_cols)
}

/// Bytes of one token's record in a low-latency dispatch to a rank on another node (the row as
/// sent, BF16 or FP8 and its scales, then the token's metadata).
#[pyfunction]
pub fn ep_ll_record_bytes(shape: (u32, u32, u32, u32, u32, u32), nodes: u32, fp8: bool) -> u64 {
    let shape = ep_shape(shape);
    mori_collective::ep_internode::Internode::geometry(&shape, nodes).ll_record_bytes(&shape, fp8)
}

/// Offsets in mori.ep's proxy window area of the low-latency mode's areas across `nodes` nodes:
/// (send records, received records, signals, weights out, weights in, partial rows out, partial
/// rows in); see `LlWindow`. For tests that write those areas as a peer would.
#[pyfunction]
pub fn ep_ll_window_offsets(
    shape: (u32, u32, u32, u32, u32, u32),
    nodes: u32,
) -> (u64, u64, u64, u64, u64, u64, u64) {
    let shape = ep_shape(shape);
    let w = mori_collective::ep_internode::Internode::geometry(&shape, nodes).ll_window(&shape);
    (w.send, w.recv, w.sig, w.wsend, w.wrecv, w.csend, w.crecv)
}

/// The low-latency FP8 options from Python's (round_scale, ue8m0, column-major scales).
fn ll_fp8(fp8: Option<(bool, bool, bool)>) -> Option<ep_runtime::LlFp8> {
    fp8.map(|(round_scale, ue8m0, column_major)| ep_runtime::LlFp8 {
        round_scale,
        ue8m0,
        column_major,
    })
}

fn planned(stream: Option<StreamHandle>, launches: Vec<ep_runtime::Planned>) -> PlannedEp {
    stream.is_none().then_some(launches)
}

#[pymethods]
impl EpRuntime {
    /// A planner (it never launches): each call returns its launches. `shape`: (ranks,
    /// experts, hidden, topk, max tokens per rank, low-latency max tokens); `normal`: addresses
    /// (recv_x, recv_scales, recv_idx, recv_w, recv_src, rank_matrix[0], rank_matrix[1],
    /// expert_matrix[0], expert_matrix[1], comb, comb_w, counters, host_info); `low_latency`:
    /// (rows, meta, wts, comb, sent[0], sent[1], sent[2], state, chunks, route or 0) or None;
    /// across nodes `internode`: (nodes, ranks per node, counts, flags, relay, relay_w, window
    /// area). The addresses are only written into planned parameters, except `host_info`,
    /// which `wait_dispatched` polls (it must be 4-byte aligned readable memory that outlives
    /// the runtime). `create` makes a runtime that launches.
    #[new]
    #[pyo3(signature = (shape, normal, low_latency=None, internode=None))]
    fn new(
        shape: (u32, u32, u32, u32, u32, u32),
        normal: [u64; 13],
        low_latency: Option<[u64; 10]>,
        internode: Option<(u32, u32, u64, u64, u64, u64, u64)>,
    ) -> Result<Self> {
        let shape = ep_shape(shape);
        let n = normal;
        let normal = ep_runtime::NormalBuffers {
            recv_x: n[0],
            recv_scales: n[1],
            recv_idx: n[2],
            recv_w: n[3],
            recv_src: n[4],
            rank_matrix: [n[5], n[6]],
            expert_matrix: [n[7], n[8]],
            comb: n[9],
            comb_w: n[10],
            counters: n[11],
            host_info: n[12],
        };
        let ll = low_latency.map(|l| ep_runtime::LowLatencyBuffers {
            rows: l[0],
            meta: l[1],
            wts: l[2],
            comb: l[3],
            sent: [l[4], l[5], l[6]],
            state: l[7],
            chunks: l[8] as u32,
            route: l[9],
        });
        // SAFETY: without modules the runtime never launches.
        let mut inner = unsafe { ep_runtime::EpRuntime::new(shape, normal, ll, None) }?;
        if let Some((nodes, local_size, counts, flags, relay, relay_w, window)) = internode {
            let geo = ep_runtime::Internode {
                nodes,
                local_size,
                counts,
                flags,
                relay,
                relay_w,
                window,
            };
            // SAFETY: as above, a planner.
            inner = unsafe { inner.with_internode(geo, None) }?;
        }
        Ok(Self {
            session: None,
            inner,
            memory: None,
        })
    }

    /// Collective: allocates mori.ep's memory for `shape` on `session`'s heap (and, across
    /// nodes, its proxy window), loads the kernels and returns the runtime that launches with
    /// them (`mori_collective::ep_buffers::Ep::create`).
    #[staticmethod]
    fn create(
        py: Python<'_>,
        session: &Shmem,
        shape: (u32, u32, u32, u32, u32, u32),
    ) -> Result<Self> {
        let ep = py.detach(|| session.with(|s| Ok(Ep::create(s, ep_shape(shape))?)))?;
        let (inner, memory) = ep.into_parts();
        Ok(Self {
            session: Some(session.inner.clone()),
            inner,
            memory: Some(Mutex::new(Some(memory))),
        })
    }

    /// This rank's addresses of what `create` allocated, by name: the normal mode's receive
    /// buffers (recv_x, recv_scales, recv_idx, recv_w, recv_src), comb_in, ll_rows (0 without
    /// the low-latency mode), and `nodes` with, across nodes, `window` (the area in the proxy
    /// window, at the same offset on every rank).
    fn areas(&self) -> Result<std::collections::HashMap<&'static str, u64>> {
        self.owned(|m| {
            let a = m.areas();
            let mut named = std::collections::HashMap::from([
                ("recv_x", a.normal.recv_x),
                ("recv_scales", a.normal.recv_scales),
                ("recv_idx", a.normal.recv_idx),
                ("recv_w", a.normal.recv_w),
                ("recv_src", a.normal.recv_src),
                ("comb_in", a.comb_in),
                ("ll_rows", a.low_latency.map_or(0, |l| l.rows)),
                ("nodes", u64::from(a.internode.map_or(1, |i| i.nodes))),
            ]);
            if let Some(geo) = a.internode {
                named.insert("window", geo.window);
            }
            named
        })
    }

    /// This rank's addresses of the symmetric allocations `create` made.
    fn heap_addresses(&self) -> Result<Vec<u64>> {
        self.owned(EpMemory::heap_addresses)
    }

    /// Waits, with the GIL released, for dispatch `seq`'s totals: [rows received (-1: the count
    /// exchange across nodes failed), rows per local expert..., bad ids, the most tokens any
    /// rank dispatched]; None after `timeout_s`.
    fn received(&self, py: Python<'_>, seq: i32, timeout_s: f64) -> Result<Option<Vec<i32>>> {
        self.owned(|_| ())?;
        if !self.wait_dispatched(py, seq, timeout_s)? {
            return Ok(None);
        }
        self.owned(|m| Some(m.published()))
    }

    /// The sequence number of the last dispatch without a host wait that saw out-of-range
    /// topk ids, or 0 (`mori_collective::ep_buffers::EpMemory::unwaited_bad_ids`).
    fn unwaited_bad_ids(&self) -> Result<i32> {
        self.owned(|m| m.unwaited_bad_ids())
    }

    /// Collective: waits for this GPU's work, then frees what `create` allocated on every rank;
    /// later launches raise. A second call does nothing.
    fn destroy(&self, py: Python<'_>) -> Result<()> {
        free_once(py, &self.memory, &self.session, EpMemory::free)
    }

    /// int32 elements of a normal dispatch's per-call layout area for `num_tokens` tokens.
    fn layout_len(&self, num_tokens: u64) -> u64 {
        self.inner.layout_len(num_tokens)
    }

    /// The routing layout only (no exchange), into the area at `layout`; `in_rank`: bool
    /// [n, ranks] to fill with whether each token goes to each rank, or 0.
    #[pyo3(name = "layout", signature = (stream, topk_idx, n, layout, in_rank=0))]
    fn py_layout(
        &self,
        stream: Option<usize>,
        topk_idx: u64,
        n: u32,
        layout: u64,
        in_rank: u64,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        let area = self.layout(layout, n);
        // SAFETY: mori.ep checked topk_idx ([n, topk] int64) and allocated the area and in_rank
        // for n tokens; all live until the stream ran the kernel.
        let l = unsafe { self.inner.layout(topk_idx, n, &area, in_rank, stream) }?;
        Ok(planned(stream, l))
    }

    /// A normal dispatch's launches; returns (the sequence number its totals are published
    /// with, the planned launches or None). `expert_counts`: int32 [experts] counts carried
    /// instead of the routing's, or 0. `host_wait` False (one node): nobody waits for the
    /// totals (export_received and combine then take num_recv None).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, x, row_bytes, scales, scale_cols, topk_idx, weights, n, layout, sms, expert_counts=0, host_wait=true))]
    fn dispatch(
        &self,
        stream: Option<usize>,
        x: u64,
        row_bytes: u64,
        scales: u64,
        scale_cols: u32,
        topk_idx: u64,
        weights: u64,
        n: u32,
        layout: u64,
        sms: u32,
        expert_counts: u64,
        host_wait: bool,
    ) -> Result<(i32, PlannedEp)> {
        let (stream, _alive) = self.stream(stream)?;
        let area = self.layout(layout, n);
        // SAFETY: mori.ep checked every tensor's dtype and shape and keeps them alive until
        // the stream ran the kernels.
        let (seq, l) = unsafe {
            self.inner.dispatch(
                x,
                row_bytes,
                scales,
                scale_cols,
                topk_idx,
                weights,
                n,
                &area,
                expert_counts,
                sms,
                host_wait,
                stream,
            )
        }?;
        Ok((seq, planned(stream, l)))
    }

    /// Waits, with the GIL released, until dispatch `seq`'s totals are published; False after
    /// `timeout_s`.
    fn wait_dispatched(&self, py: Python<'_>, seq: i32, timeout_s: f64) -> Result<bool> {
        let timeout = std::time::Duration::try_from_secs_f64(timeout_s).map_err(|_| {
            mori_collective::Error::InvalidArgument(format!(
                "timeout {timeout_s} s is not a duration"
            ))
        })?;
        // The pinned words it polls are create's memory: kept alive through the wait.
        let _alive = self.alive()?;
        Ok(py.detach(|| self.inner.wait_dispatched(seq, timeout)))
    }

    /// A normal combine's launches. `weights`: (received rows' f32 [num_recv, topk] weights,
    /// f32 [num_tokens, topk] output for their per-token sums), or None. `num_recv` None: the
    /// count is read on the GPU (after a dispatch without host_wait).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, y, y_on_heap, num_recv, num_tokens, layout, out, sms, weights=None))]
    fn combine(
        &self,
        stream: Option<usize>,
        y: u64,
        y_on_heap: bool,
        num_recv: Option<u32>,
        num_tokens: u32,
        layout: u64,
        out: u64,
        sms: u32,
        weights: Option<(u64, u64)>,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        let area = self.layout(layout, num_tokens);
        let weights = weights.map(|(weights, out)| ep_runtime::CombineWeights { weights, out });
        // SAFETY: as dispatch.
        let l = unsafe {
            self.inner.combine(
                y, y_on_heap, num_recv, num_tokens, &area, out, weights, sms, stream,
            )
        }?;
        Ok(planned(stream, l))
    }

    /// Copies the last dispatch's received rows into caller-owned tensors at `to` = (rows,
    /// scales, ids, weights, source indices, int32 [ranks, ranks] rank prefix matrix; 0: not
    /// wanted), padded to `rows` (`mori_collective::ep_runtime::EpRuntime::export_received`).
    /// `layout` = (the dispatch's layout area, its token count): where the rank matrix is, for
    /// the prefix matrix and for `num_recv` None (the count read on the GPU).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, row_bytes, scale_cols, k, num_recv, rows, to, layout=None))]
    fn export_received(
        &self,
        stream: Option<usize>,
        row_bytes: u64,
        scale_cols: u32,
        k: u32,
        num_recv: Option<u32>,
        rows: u32,
        to: (u64, u64, u64, u64, u64, u64),
        layout: Option<(u64, u32)>,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        let rank_matrix = layout.map_or(0, |(base, n)| self.layout(base, n).rank_matrix().0);
        let to = ep_runtime::ExportTo {
            x: to.0,
            scales: to.1,
            idx: to.2,
            w: to.3,
            src: to.4,
            rank_prefix: to.5,
            rank_matrix,
        };
        // SAFETY: mori.ep.deepep allocates every output for `rows` rows (the prefix [ranks,
        // ranks]) on this GPU and queues the copy on the
        // dispatch's stream, right after it; the layout area is the dispatch's, alive in its
        // handle.
        let l = unsafe {
            self.inner
                .export_received(row_bytes, scale_cols, k, num_recv, rows, to, stream)
        }?;
        Ok(planned(stream, l))
    }

    /// `fp8`: None for BF16, else (round_scale, ue8m0, column-major scales).
    fn ll_dispatch_send(
        &self,
        stream: Option<usize>,
        x: u64,
        topk_idx: u64,
        n: u32,
        fp8: Option<(bool, bool, bool)>,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        // SAFETY: as dispatch.
        let l = unsafe {
            self.inner
                .ll_dispatch_send(x, topk_idx, n, ll_fp8(fp8), stream)
        }?;
        Ok(planned(stream, l))
    }

    /// `fp8` as for ll_dispatch_send. `outputs`: (recv_x, recv_scales or 0, recv_count,
    /// src_info, layout_range, ids_pos, wait-time statistics or 0).
    fn ll_dispatch_recv(
        &self,
        stream: Option<usize>,
        fp8: Option<(bool, bool, bool)>,
        outputs: [u64; 7],
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        let out = ep_runtime::LlReceived {
            recv_x: outputs[0],
            recv_scales: outputs[1],
            recv_count: outputs[2],
            src_info: outputs[3],
            layout_range: outputs[4],
            ids_pos: outputs[5],
            wait_ns: outputs[6],
        };
        // SAFETY: as dispatch.
        let l = unsafe { self.inner.ll_dispatch_recv(ll_fp8(fp8), &out, stream) }?;
        Ok(planned(stream, l))
    }

    #[allow(clippy::too_many_arguments)]
    fn ll_combine_send(
        &self,
        stream: Option<usize>,
        y: u64,
        topk_idx: u64,
        weights: u64,
        n: u32,
        ids_pos: u64,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        // SAFETY: as dispatch.
        let l = unsafe {
            self.inner
                .ll_combine_send(y, topk_idx, weights, n, ids_pos, stream)
        }?;
        Ok(planned(stream, l))
    }

    fn ll_combine_recv(
        &self,
        stream: Option<usize>,
        topk_idx: u64,
        n: u32,
        out: u64,
        wait_ns: u64,
    ) -> Result<PlannedEp> {
        let (stream, _alive) = self.stream(stream)?;
        // SAFETY: as dispatch.
        let l = unsafe {
            self.inner
                .ll_combine_recv(topk_idx, n, out, wait_ns, stream)
        }?;
        Ok(planned(stream, l))
    }
}
