//! One-sided RMA through libfabric (loaded at run time, see [`Library`]): reliable-datagram
//! endpoints, memory registration with remote keys, posted writes and reads addressed by
//! (remote key, offset), completions drained by [`Endpoint::poll`]. Posting never blocks: a
//! full queue answers [`Posted::WouldBlock`] and the caller polls, then retries.

pub mod ffi;
mod library;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr;
use std::time::{Duration, Instant};

pub use library::Library;
use library::keeping_signal_handlers;

use crate::error::{Error, Result};

/// What a provider offers for reliable-datagram RMA (`fi_getinfo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderInfo {
    /// e.g. `tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`.
    pub provider: String,
    /// The fabric (for IP providers the subnet, e.g. `127.0.0.1/32`).
    pub fabric: String,
    /// The domain (the NIC, e.g. `mlx5_0`, or the interface `lo`).
    pub domain: String,
    /// Registers CUDA device memory itself (`FI_HMEM`; whether a registration then succeeds
    /// also depends on how libfabric was built: see [`Endpoint::register_cuda`]).
    pub hmem: bool,
    /// The memory registration mode granted (`FI_MR_*` bits).
    pub mr_mode: i32,
    pub max_msg_size: usize,
    pub inject_size: usize,
}

/// Capabilities asked for: one-sided reads and writes, both directions.
const RMA_CAPS: u64 =
    ffi::FI_RMA | ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ | ffi::FI_REMOTE_WRITE;
/// Registration modes mori-net handles (it then uses what the provider granted).
const MR_MODES: i32 = ffi::FI_MR_LOCAL
    | ffi::FI_MR_VIRT_ADDR
    | ffi::FI_MR_ALLOCATED
    | ffi::FI_MR_PROV_KEY
    | ffi::FI_MR_ENDPOINT;

/// `fi_getinfo` hints for RDM endpoints with RMA; `provider` / `node` narrow them, `hmem`
/// asks for registration of device memory too.
struct Hints {
    lib: &'static Library,
    info: *mut ffi::fi_info,
}

impl Hints {
    fn new(lib: &'static Library, provider: Option<&str>, hmem: bool) -> Result<Hints> {
        // SAFETY: fi_dupinfo(NULL) allocates zeroed hints with every attribute structure.
        let info = unsafe { (lib.dupinfo)(ptr::null()) };
        if info.is_null() {
            return Err(Error::Unavailable("fi_allocinfo failed".into()));
        }
        let hints = Hints { lib, info };
        // SAFETY: `info` and its attribute structures were just allocated by libfabric.
        unsafe {
            (*info).caps = RMA_CAPS | if hmem { ffi::FI_HMEM } else { 0 };
            (*info).mode = ffi::FI_CONTEXT | ffi::FI_CONTEXT2;
            (*(*info).ep_attr).type_ = ffi::FI_EP_RDM;
            // A write completes once its bytes are at the target, not once they left here.
            (*(*info).tx_attr).op_flags = ffi::FI_DELIVERY_COMPLETE;
            (*(*info).domain_attr).mr_mode = MR_MODES | if hmem { ffi::FI_MR_HMEM } else { 0 };
            if let Some(p) = provider {
                let c = CString::new(p)
                    .map_err(|_| Error::InvalidArgument("provider name holds a NUL".into()))?;
                // fi_freeinfo frees it: it must come from malloc.
                (*(*info).fabric_attr).prov_name = libc::strdup(c.as_ptr());
            }
        }
        Ok(hints)
    }

    /// `fi_getinfo` for these hints (`node`: bind to that address).
    fn query(&self, node: Option<&str>) -> Result<InfoList> {
        let node = node
            .map(CString::new)
            .transpose()
            .map_err(|_| Error::InvalidArgument("node holds a NUL".into()))?;
        let mut out = ptr::null_mut();
        let flags = if node.is_some() { ffi::FI_SOURCE } else { 0 };
        // SAFETY: valid hints; out receives a list freed by InfoList.
        let ret = keeping_signal_handlers(|| unsafe {
            (self.lib.getinfo)(
                ffi::API_VERSION,
                node.as_ref().map_or(ptr::null(), |n| n.as_ptr()),
                ptr::null(),
                flags,
                self.info,
                &mut out,
            )
        });
        if ret != 0 {
            return Err(self.lib.fail("fi_getinfo", ret as isize));
        }
        Ok(InfoList {
            lib: self.lib,
            head: out,
        })
    }
}

impl Drop for Hints {
    fn drop(&mut self) {
        // SAFETY: allocated by fi_dupinfo, freed once.
        unsafe { (self.lib.freeinfo)(self.info) };
    }
}

/// A list returned by `fi_getinfo`, freed on drop.
struct InfoList {
    lib: &'static Library,
    head: *mut ffi::fi_info,
}

impl InfoList {
    fn iter(&self) -> impl Iterator<Item = &ffi::fi_info> {
        let mut p = self.head;
        std::iter::from_fn(move || {
            // SAFETY: a node of the list, alive while `self` is.
            let info = unsafe { p.as_ref()? };
            p = info.next;
            Some(info)
        })
    }
}

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.head.is_null() {
            // SAFETY: the list from fi_getinfo, freed once.
            unsafe { (self.lib.freeinfo)(self.head) };
        }
    }
}

fn c_string(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's attribute strings are NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn describe(info: &ffi::fi_info) -> ProviderInfo {
    // SAFETY: fi_getinfo fills every attribute pointer of the entries it returns.
    let (fabric, domain, ep, tx) = unsafe {
        (
            &*info.fabric_attr,
            &*info.domain_attr,
            &*info.ep_attr,
            &*info.tx_attr,
        )
    };
    ProviderInfo {
        provider: c_string(fabric.prov_name),
        fabric: c_string(fabric.name),
        domain: c_string(domain.name),
        hmem: info.caps & ffi::FI_HMEM != 0,
        mr_mode: domain.mr_mode,
        max_msg_size: ep.max_msg_size,
        inject_size: tx.inject_size,
    }
}

/// Every provider, fabric and domain offering reliable-datagram RMA here (each once: the
/// first of libfabric's entries for it, its preferred one).
pub fn providers() -> Result<Vec<ProviderInfo>> {
    let lib = Library::get()?;
    let listed = |hmem: bool| -> Result<Vec<ProviderInfo>> {
        match Hints::new(lib, None, hmem)?.query(None) {
            Ok(list) => Ok(list.iter().map(describe).collect()),
            Err(Error::Fabric { code, .. }) if code == libc::ENODATA => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    };
    let same = |a: &ProviderInfo, b: &ProviderInfo| {
        (&a.provider, &a.fabric, &a.domain) == (&b.provider, &b.fabric, &b.domain)
    };
    // Device memory is offered only to callers asking for it: a second query says where.
    let with_hmem = listed(true)?;
    let mut out: Vec<ProviderInfo> = Vec::new();
    for mut p in listed(false)? {
        if !out.iter().any(|q| same(q, &p)) {
            p.hmem = with_hmem.iter().any(|q| same(q, &p));
            out.push(p);
        }
    }
    Ok(out)
}

/// A peer's registered memory as the peer described it: what a write or read names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The base the peer's provider addresses the region by (its virtual address, or 0 when
    /// the provider addresses regions by offset).
    pub base: u64,
    pub len: u64,
    pub key: u64,
}

/// Memory registered with an endpoint's domain; deregistered on drop (before the endpoint).
pub struct Region<'e> {
    ep: &'e Endpoint,
    mr: *mut ffi::fid_mr,
    addr: u64,
    len: u64,
    /// Device memory (registered with `FI_HMEM`): operations always pass its descriptor.
    device: bool,
}

impl Region<'_> {
    /// What a peer needs to name this region.
    pub fn remote(&self) -> RemoteRegion {
        // SAFETY: a live registration.
        let key = unsafe { (*self.mr).key };
        RemoteRegion {
            base: if self.ep.mr_mode & ffi::FI_MR_VIRT_ADDR != 0 {
                self.addr
            } else {
                0
            },
            len: self.len,
            key,
        }
    }

    fn desc(&self) -> *mut c_void {
        // SAFETY: a live registration.
        unsafe { (*self.mr).mem_desc }
    }
}

impl Drop for Region<'_> {
    fn drop(&mut self) {
        // SAFETY: a live registration, closed once.
        let ret = unsafe { ((*(*self.mr).fid.ops).close)(&mut (*self.mr).fid) };
        if ret != 0 {
            tracing::warn!("fi_close(mr): {}", self.ep.lib.strerror(-ret));
        }
    }
}

/// A random key of `bytes` bytes (1..=8) from the OS, never 0.
fn random_key(bytes: usize) -> Result<u64> {
    loop {
        let mut b = [0u8; 8];
        getrandom::fill(&mut b)
            .map_err(|e| Error::Unavailable(format!("no random bytes for a memory key: {e}")))?;
        let key = u64::from_le_bytes(b) & (u64::MAX >> (64 - 8 * bytes));
        if key != 0 {
            return Ok(key);
        }
    }
}

/// Wakes an [`Endpoint::wait`] from another thread.
pub struct Waker {
    lib: &'static Library,
    cq: *mut ffi::fid_cq,
}

// SAFETY: fi_cq_signal may be called from any thread; the queue outlives the waker (see
// `wake`).
unsafe impl Send for Waker {}
// SAFETY: as above; signalling takes no state of the waker.
unsafe impl Sync for Waker {}

impl Waker {
    /// Makes the endpoint's current or next `wait` return.
    ///
    /// # Safety
    /// The endpoint it came from must still be open.
    pub unsafe fn wake(&self) {
        // SAFETY: the caller guarantees the queue is alive; signal is thread-safe.
        let ret = unsafe { ((*(*self.cq).ops).signal)(self.cq) };
        if ret != 0 {
            tracing::debug!("fi_cq_signal: {}", self.lib.strerror(-ret));
        }
    }
}

/// Which way an operation moves bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rma {
    /// Local memory to the peer's.
    Write,
    /// The peer's memory to local.
    Read,
}

/// The outcome of posting an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Posted {
    /// In flight; its completion carries this id.
    Id(u64),
    /// The queue is full: poll, then post again.
    WouldBlock,
}

/// A finished operation: its id and its outcome.
#[derive(Debug)]
pub struct Completion {
    pub id: u64,
    pub result: Result<()>,
}

/// The provider's scratch space of one posted operation and its id; boxed so that its address
/// stays fixed until the completion hands it back.
#[repr(C)]
struct Op {
    ctx: ffi::fi_context2,
    id: u64,
    posted: Instant,
}

/// A reliable-datagram endpoint with its fabric, domain, completion queue and address vector.
/// Not shared between threads; progress is made by [`Endpoint::poll`] (software providers need
/// it called on the target side too).
pub struct Endpoint {
    lib: &'static Library,
    info: *mut ffi::fi_info,
    fabric: *mut ffi::fid_fabric,
    domain: *mut ffi::fid_domain,
    cq: *mut ffi::fid_cq,
    av: *mut ffi::fid_av,
    ep: *mut ffi::fid_ep,
    mr_mode: i32,
    /// Width of the provider's memory keys (bytes, at most 8).
    key_bytes: usize,
    provider: ProviderInfo,
    in_flight: RefCell<HashMap<u64, Box<Op>>>,
    /// The completion queue has a wait object ([`Endpoint::wait`] blocks in the provider).
    waits: bool,
    /// Operations already reported as timed out, kept until the provider hands them back.
    expired: RefCell<HashMap<u64, Box<Op>>>,
    /// Operations reported as timed out that the provider has since handed back: their
    /// buffers are the caller's again ([`Endpoint::take_released`]).
    released: RefCell<Vec<u64>>,
    next_id: Cell<u64>,
    timeout: Cell<Option<Duration>>,
    last_expiry_scan: Cell<Instant>,
}

impl Endpoint {
    /// Opens an endpoint of `provider` (e.g. `tcp;ofi_rxm`), bound to `node` (an address of
    /// this host) when given, on `domain` (a NIC, e.g. `mlx5_1`) when given, else on the first
    /// matching domain. `hmem`: prefer a domain that registers device memory (falling back to
    /// one that does not; [`ProviderInfo::hmem`] says which was opened).
    pub fn open(
        provider: &str,
        node: Option<&str>,
        domain: Option<&str>,
        hmem: bool,
    ) -> Result<Endpoint> {
        let lib = Library::get()?;
        let wanted = |info: &&ffi::fi_info| domain.is_none_or(|d| describe(info).domain == d);
        let mut info = ptr::null_mut();
        for ask_hmem in [true, false] {
            if ask_hmem && !hmem {
                continue;
            }
            match Hints::new(lib, Some(provider), ask_hmem)?.query(node) {
                Ok(list) => {
                    if let Some(first) = list.iter().find(wanted) {
                        // SAFETY: an entry of a live list; fi_dupinfo copies it for the
                        // endpoint's lifetime.
                        info = unsafe { (lib.dupinfo)(first) };
                        if info.is_null() {
                            return Err(Error::Unavailable("fi_dupinfo failed".into()));
                        }
                        break;
                    }
                }
                Err(Error::Fabric { code, .. }) if ask_hmem && code == libc::ENODATA => {}
                Err(e) => return Err(e),
            }
        }
        if info.is_null() {
            return Err(Error::Unavailable(match domain {
                Some(d) => format!("no {provider} domain {d:?} offers RMA here"),
                None => format!("no {provider} domain offers RMA here"),
            }));
        }
        // SAFETY: fi_dupinfo copied every attribute structure.
        let provider_info = describe(unsafe { &*info });
        // SAFETY: as above.
        let key_bytes = unsafe { (*(*info).domain_attr).mr_key_size }.clamp(1, 8);
        let mut e = Endpoint {
            lib,
            info,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            cq: ptr::null_mut(),
            av: ptr::null_mut(),
            ep: ptr::null_mut(),
            mr_mode: provider_info.mr_mode,
            key_bytes,
            provider: provider_info,
            in_flight: RefCell::new(HashMap::new()),
            waits: false,
            expired: RefCell::new(HashMap::new()),
            released: RefCell::new(Vec::new()),
            next_id: Cell::new(1),
            timeout: Cell::new(None),
            last_expiry_scan: Cell::new(Instant::now()),
        };
        keeping_signal_handlers(|| e.setup())?;
        Ok(e)
    }

    /// Fabric, domain, completion queue, address vector, endpoint; bound and enabled. On
    /// error, Drop closes whatever was opened.
    fn setup(&mut self) -> Result<()> {
        let lib = self.lib;
        let check = |call: &str, ret: i32| {
            if ret == 0 {
                Ok(())
            } else {
                Err(lib.fail(call, ret as isize))
            }
        };
        // SAFETY: every pointer passed is either `self.info` (alive) or an object opened just
        // before; each call follows the header's inline definition through the ops table.
        unsafe {
            check(
                "fi_fabric",
                (lib.fabric)((*self.info).fabric_attr, &mut self.fabric, ptr::null_mut()),
            )?;
            check(
                "fi_domain",
                ((*(*self.fabric).ops).domain)(
                    self.fabric,
                    self.info,
                    &mut self.domain,
                    ptr::null_mut(),
                ),
            )?;
            // A queue with a wait object when the provider has one (waiting blocks in the
            // provider, which wakes on peers' traffic), else one that is only polled.
            for wait_obj in [ffi::FI_WAIT_UNSPEC, ffi::FI_WAIT_NONE] {
                let mut cq_attr = ffi::fi_cq_attr {
                    size: 0,
                    flags: 0,
                    format: ffi::FI_CQ_FORMAT_DATA,
                    wait_obj,
                    signaling_vector: 0,
                    wait_cond: 0,
                    wait_set: ptr::null_mut(),
                };
                let ret = ((*(*self.domain).ops).cq_open)(
                    self.domain,
                    &mut cq_attr,
                    &mut self.cq,
                    ptr::null_mut(),
                );
                if ret == 0 {
                    self.waits = wait_obj != ffi::FI_WAIT_NONE;
                    break;
                }
                self.cq = ptr::null_mut();
                if wait_obj == ffi::FI_WAIT_NONE {
                    check("fi_cq_open", ret)?;
                }
            }
            let mut av_attr = ffi::fi_av_attr {
                type_: ffi::FI_AV_TABLE,
                rx_ctx_bits: 0,
                count: 0,
                ep_per_node: 0,
                name: ptr::null(),
                map_addr: ptr::null_mut(),
                flags: 0,
            };
            check(
                "fi_av_open",
                ((*(*self.domain).ops).av_open)(
                    self.domain,
                    &mut av_attr,
                    &mut self.av,
                    ptr::null_mut(),
                ),
            )?;
            check(
                "fi_endpoint",
                ((*(*self.domain).ops).endpoint)(
                    self.domain,
                    self.info,
                    &mut self.ep,
                    ptr::null_mut(),
                ),
            )?;
            let ep_fid = &mut (*self.ep).fid as *mut ffi::fid;
            check(
                "fi_ep_bind(cq)",
                ((*(*ep_fid).ops).bind)(
                    ep_fid,
                    &mut (*self.cq).fid,
                    ffi::FI_TRANSMIT | ffi::FI_RECV,
                ),
            )?;
            check(
                "fi_ep_bind(av)",
                ((*(*ep_fid).ops).bind)(ep_fid, &mut (*self.av).fid, 0),
            )?;
            check(
                "fi_enable",
                ((*(*ep_fid).ops).control)(ep_fid, ffi::FI_ENABLE, ptr::null_mut()),
            )?;
        }
        Ok(())
    }

    /// The provider, fabric and domain this endpoint runs on.
    pub fn provider(&self) -> &ProviderInfo {
        &self.provider
    }

    /// This endpoint's address, for peers' [`Endpoint::insert_peer`].
    pub fn name(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; 256];
        let mut len = buf.len();
        // SAFETY: a live endpoint; getname writes at most `len` bytes and sets `len`.
        let ret = unsafe {
            ((*(*self.ep).cm).getname)(&mut (*self.ep).fid, buf.as_mut_ptr().cast(), &mut len)
        };
        if ret != 0 {
            return Err(self.lib.fail("fi_getname", ret as isize));
        }
        buf.truncate(len);
        Ok(buf)
    }

    /// Adds a peer by its [`Endpoint::name`]; returns the handle operations address it by.
    pub fn insert_peer(&self, name: &[u8]) -> Result<u64> {
        let mut addr: ffi::fi_addr_t = ffi::FI_ADDR_UNSPEC;
        // SAFETY: a live address vector; one address of the provider's format.
        let ret = unsafe {
            ((*(*self.av).ops).insert)(
                self.av,
                name.as_ptr().cast(),
                1,
                &mut addr,
                0,
                ptr::null_mut(),
            )
        };
        if ret != 1 {
            return Err(Error::InvalidArgument(format!(
                "fi_av_insert took {ret} of 1 peer addresses (not an address of {}?)",
                self.provider.provider
            )));
        }
        Ok(addr)
    }

    /// Registers `len` bytes at `addr` for local use and remote reads and writes.
    ///
    /// # Safety
    /// The memory must stay valid (and not be freed) until the returned region is dropped;
    /// peers holding its [`Region::remote`] may read and write it meanwhile.
    pub unsafe fn register(&self, addr: u64, len: u64) -> Result<Region<'_>> {
        let access = ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ | ffi::FI_REMOTE_WRITE;
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.register_with(addr, len, access, None) }
    }

    /// Registers `len` bytes at `addr` as a source and destination of this endpoint's own
    /// operations only: peers cannot reach it, whatever key they try.
    ///
    /// # Safety
    /// As [`Endpoint::register`].
    pub unsafe fn register_local(&self, addr: u64, len: u64) -> Result<Region<'_>> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.register_with(addr, len, ffi::FI_READ | ffi::FI_WRITE, None) }
    }

    /// Registers `len` bytes of CUDA device memory (of device `ordinal`) at `addr` with the
    /// NIC itself (`FI_HMEM`), for peers' reads and, if `writable`, writes. Fails when the
    /// endpoint's domain does not offer `FI_HMEM`, or when libfabric was built without CUDA
    /// (its providers then refuse CUDA memory: `fi_mr_regattr` answers an error).
    ///
    /// # Safety
    /// As [`Endpoint::register`].
    pub unsafe fn register_cuda(
        &self,
        addr: u64,
        len: u64,
        ordinal: u32,
        writable: bool,
    ) -> Result<Region<'_>> {
        if !self.provider.hmem {
            return Err(Error::Unavailable(format!(
                "domain {} of {} does not register device memory (no FI_HMEM)",
                self.provider.domain, self.provider.provider
            )));
        }
        let mut access = ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ;
        if writable {
            access |= ffi::FI_REMOTE_WRITE;
        }
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.register_with(addr, len, access, Some(ordinal)) }
    }

    /// Registers `len` bytes at `addr` that peers may only read (their writes fail at the
    /// provider); this side may still write from it.
    ///
    /// # Safety
    /// As [`Endpoint::register`].
    pub unsafe fn register_read_only(&self, addr: u64, len: u64) -> Result<Region<'_>> {
        let access = ffi::FI_READ | ffi::FI_WRITE | ffi::FI_REMOTE_READ;
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.register_with(addr, len, access, None) }
    }

    /// `cuda`: the memory is on that CUDA device (registered through `fi_mr_regattr`).
    ///
    /// # Safety
    /// As [`Endpoint::register`].
    unsafe fn register_with(
        &self,
        addr: u64,
        len: u64,
        access: u64,
        cuda: Option<u32>,
    ) -> Result<Region<'_>> {
        let len_usize =
            usize::try_from(len).map_err(|_| Error::InvalidArgument("region too large".into()))?;
        // Without FI_MR_PROV_KEY the key is ours to choose: an unguessable one, as wide as the
        // provider's keys are (a peer can only reach a region whose key it was given).
        let requested_key = if self.mr_mode & ffi::FI_MR_PROV_KEY != 0 {
            0
        } else {
            random_key(self.key_bytes)?
        };
        let mut mr = ptr::null_mut();
        let (call, ret) = match cuda {
            // SAFETY: the caller guarantees the memory; a live domain.
            None => ("fi_mr_reg", unsafe {
                ((*(*self.domain).mr).reg)(
                    &mut (*self.domain).fid,
                    addr as *const c_void,
                    len_usize,
                    access,
                    0,
                    requested_key,
                    0,
                    &mut mr,
                    ptr::null_mut(),
                )
            }),
            Some(ordinal) => {
                // SAFETY: a live domain's registration ops table, read only up to its size.
                let ops = unsafe { &*(*self.domain).mr };
                if ops.size < std::mem::size_of::<ffi::fi_ops_mr>() {
                    return Err(Error::Unavailable(format!(
                        "{} has no fi_mr_regattr",
                        self.provider.provider
                    )));
                }
                let iov = libc::iovec {
                    iov_base: addr as *mut c_void,
                    iov_len: len_usize,
                };
                let attr = ffi::fi_mr_attr {
                    mr_iov: &iov,
                    iov_count: 1,
                    access,
                    offset: 0,
                    requested_key,
                    context: ptr::null_mut(),
                    auth_key_size: 0,
                    auth_key: ptr::null_mut(),
                    iface: ffi::FI_HMEM_CUDA,
                    device: u64::from(ordinal),
                    hmem_data: ptr::null_mut(),
                    page_size: 0,
                    base_mr: ptr::null(),
                    sub_mr_cnt: 0,
                };
                // SAFETY: the caller guarantees the memory; a live domain whose ops table
                // reaches regattr (checked above); attr and iov outlive the call.
                ("fi_mr_regattr", unsafe {
                    (ops.regattr)(&mut (*self.domain).fid, &attr, 0, &mut mr)
                })
            }
        };
        if ret != 0 {
            return Err(self.lib.fail(call, ret as isize));
        }
        let region = Region {
            ep: self,
            mr,
            addr,
            len,
            device: cuda.is_some(),
        };
        if self.mr_mode & ffi::FI_MR_ENDPOINT != 0 {
            // SAFETY: a live registration and endpoint (fi_mr_bind, then fi_mr_enable).
            unsafe {
                let fid = &mut (*mr).fid as *mut ffi::fid;
                let ret = ((*(*fid).ops).bind)(fid, &mut (*self.ep).fid, 0);
                if ret != 0 {
                    return Err(self.lib.fail("fi_mr_bind", ret as isize));
                }
                let ret = ((*(*fid).ops).control)(fid, ffi::FI_ENABLE, ptr::null_mut());
                if ret != 0 {
                    return Err(self.lib.fail("fi_mr_enable", ret as isize));
                }
            }
        }
        Ok(region)
    }

    /// Posts `op` of `len` bytes between `local` at `local_offset` and the peer's `remote` at
    /// `remote_offset` ([`Rma::Write`]: local to remote). Both ranges are checked against their
    /// regions first.
    #[allow(clippy::too_many_arguments)]
    pub fn post(
        &self,
        op: Rma,
        local: &Region<'_>,
        local_offset: u64,
        len: u64,
        peer: u64,
        remote: &RemoteRegion,
        remote_offset: u64,
    ) -> Result<Posted> {
        let inside =
            |off: u64, region_len: u64| off.checked_add(len).is_some_and(|e| e <= region_len);
        if !inside(local_offset, local.len) || !inside(remote_offset, remote.len) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at local {local_offset} / remote {remote_offset} lie outside the \
                 regions ({} / {} bytes)",
                local.len, remote.len
            )));
        }
        if !std::ptr::eq(local.ep, self) {
            return Err(Error::InvalidArgument(
                "the local region belongs to another endpoint".into(),
            ));
        }
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let mut scratch = Box::new(Op {
            ctx: ffi::fi_context2 {
                internal: [ptr::null_mut(); 8],
            },
            id,
            posted: Instant::now(),
        });
        let ctx = (&mut *scratch as *mut Op).cast::<c_void>();
        let buf = (local.addr + local_offset) as *mut c_void;
        let desc = if self.mr_mode & ffi::FI_MR_LOCAL != 0 || local.device {
            local.desc()
        } else {
            ptr::null_mut()
        };
        let addr = remote.base + remote_offset;
        // SAFETY: a live endpoint; the local range lies in a live registration (checked
        // above); `scratch` stays boxed in `in_flight` until its completion is read.
        let ret = unsafe {
            let rma = (*self.ep).rma;
            if op == Rma::Write {
                ((*rma).write)(
                    self.ep,
                    buf,
                    len as usize,
                    desc,
                    peer,
                    addr,
                    remote.key,
                    ctx,
                )
            } else {
                ((*rma).read)(
                    self.ep,
                    buf,
                    len as usize,
                    desc,
                    peer,
                    addr,
                    remote.key,
                    ctx,
                )
            }
        };
        match ret {
            0 => {
                self.in_flight.borrow_mut().insert(id, scratch);
                Ok(Posted::Id(id))
            }
            r if r == -ffi::FI_EAGAIN => Ok(Posted::WouldBlock),
            r => Err(self.lib.fail(
                if op == Rma::Write {
                    "fi_write"
                } else {
                    "fi_read"
                },
                r,
            )),
        }
    }

    /// Operations posted and neither completed nor reported as timed out.
    pub fn in_flight(&self) -> usize {
        self.in_flight.borrow().len()
    }

    /// An operation not completed `timeout` after it was posted is reported by
    /// [`Endpoint::poll`] as failed ([`Error::Timeout`]) — a peer or link that went away
    /// without the provider noticing (TCP keeps retrying for minutes). The provider may still
    /// complete it later: a read that timed out can still land in its local range, so do not
    /// reuse that range until the endpoint is closed. None (the default): no timeout.
    pub fn set_timeout(&self, timeout: Option<Duration>) {
        self.timeout.set(timeout);
    }

    /// Moves operations older than the timeout to `expired`, reporting each once.
    fn expire(&self, out: &mut Vec<Completion>) -> usize {
        let Some(timeout) = self.timeout.get() else {
            return 0;
        };
        let now = Instant::now();
        // A scan per millisecond at most: the table may hold many operations.
        if now.duration_since(self.last_expiry_scan.get()) < Duration::from_millis(1) {
            return 0;
        }
        self.last_expiry_scan.set(now);
        let mut in_flight = self.in_flight.borrow_mut();
        let late: Vec<u64> = in_flight
            .iter()
            .filter(|(_, op)| now.duration_since(op.posted) >= timeout)
            .map(|(&id, _)| id)
            .collect();
        for id in &late {
            if let Some(op) = in_flight.remove(id) {
                self.expired.borrow_mut().insert(*id, op);
                out.push(Completion {
                    id: *id,
                    result: Err(Error::Timeout(format!(
                        "operation {id} unfinished after {timeout:?} on {}",
                        self.provider.provider
                    ))),
                });
            }
        }
        late.len()
    }

    /// Ids of operations reported as timed out whose completion (or error) has arrived since:
    /// the provider no longer uses their buffers. Each id is returned once.
    pub fn take_released(&self) -> Vec<u64> {
        std::mem::take(&mut *self.released.borrow_mut())
    }

    /// Makes progress and moves finished operations into `out`; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>) -> Result<usize> {
        self.complete(out, None)
    }

    /// As [`Endpoint::poll`], but when nothing is finished waits up to `timeout` for a
    /// completion, making progress meanwhile (serving peers' operations as they arrive, on
    /// providers that need it), or until a [`Waker`] wakes it. Where the provider's queue has
    /// no wait object, polls once and sleeps briefly instead.
    pub fn wait(&self, out: &mut Vec<Completion>, timeout: Duration) -> Result<usize> {
        if self.waits {
            return self.complete(out, Some(timeout));
        }
        let n = self.complete(out, None)?;
        if n == 0 {
            std::thread::sleep(timeout.min(Duration::from_micros(100)));
        }
        Ok(n)
    }

    /// Something another thread can wake [`Endpoint::wait`] with (None: the provider's queue
    /// has no wait object, and `wait` never sleeps long).
    pub fn waker(&self) -> Option<Waker> {
        self.waits.then_some(Waker {
            lib: self.lib,
            cq: self.cq,
        })
    }

    /// Reads completions (blocking up to `timeout` when given) into `out`.
    fn complete(&self, out: &mut Vec<Completion>, timeout: Option<Duration>) -> Result<usize> {
        const BATCH: usize = 16;
        let mut entries: [std::mem::MaybeUninit<ffi::fi_cq_data_entry>; BATCH] =
            [const { std::mem::MaybeUninit::uninit() }; BATCH];
        let buf = entries.as_mut_ptr().cast();
        // SAFETY: a live completion queue; it writes at most BATCH entries of the queue's
        // format (FI_CQ_FORMAT_DATA). sread only on a queue opened with a wait object.
        let n = unsafe {
            match timeout {
                None => ((*(*self.cq).ops).read)(self.cq, buf, BATCH),
                Some(t) => {
                    let ms = t.as_millis().clamp(1, i32::MAX as u128) as i32;
                    let n = ((*(*self.cq).ops).sread)(self.cq, buf, BATCH, ptr::null(), ms);
                    // Timed out or woken: nothing finished.
                    if [ffi::FI_ETIMEDOUT, ffi::FI_ECANCELED, libc::EINTR as isize].contains(&-n) {
                        -ffi::FI_EAGAIN
                    } else {
                        n
                    }
                }
            }
        };
        let expired = self.expire(out);
        if n > 0 {
            let mut reported = expired;
            for e in &entries[..n as usize] {
                // SAFETY: the first n entries were written.
                let ctx = unsafe { e.assume_init_ref() }.op_context.cast::<Op>();
                if let Some(id) = self.finish(ctx)? {
                    out.push(Completion { id, result: Ok(()) });
                    reported += 1;
                }
            }
            return Ok(reported);
        }
        if n == -ffi::FI_EAGAIN || n == 0 {
            return Ok(expired);
        }
        if n != -ffi::FI_EAVAIL {
            return Err(self.lib.fail("fi_cq_read", n));
        }
        // SAFETY: zeroed is a valid fi_cq_err_entry (no err_data buffer offered).
        let mut err: ffi::fi_cq_err_entry = unsafe { std::mem::zeroed() };
        // SAFETY: a live completion queue and one entry to fill.
        let r = unsafe { ((*(*self.cq).ops).readerr)(self.cq, &mut err, 0) };
        if r != 1 {
            return Err(self.lib.fail("fi_cq_readerr", r.min(-1)));
        }
        let Some(id) = self.finish(err.op_context.cast::<Op>())? else {
            return Ok(expired); // reported already, as timed out
        };
        out.push(Completion {
            id,
            result: Err(Error::Fabric {
                call: "completion".into(),
                code: err.err,
                message: format!(
                    "{} (provider error {})",
                    self.lib.strerror(err.err),
                    err.prov_errno
                ),
            }),
        });
        Ok(expired + 1)
    }

    /// The id of a completed operation, whose scratch space is released; None for one
    /// reported as timed out already.
    fn finish(&self, ctx: *const Op) -> Result<Option<u64>> {
        if ctx.is_null() {
            return Err(Error::InvalidArgument(
                "a completion without an operation context".into(),
            ));
        }
        // SAFETY: every context posted is a boxed Op kept in `in_flight` or `expired` until
        // here.
        let id = unsafe { (*ctx).id };
        if self.in_flight.borrow_mut().remove(&id).is_some() {
            return Ok(Some(id));
        }
        if self.expired.borrow_mut().remove(&id).is_some() {
            self.released.borrow_mut().push(id);
            return Ok(None);
        }
        Err(Error::InvalidArgument(format!(
            "completion of unknown operation {id}"
        )))
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // Children before parents: endpoint, address vector, completion queue, domain, fabric.
        let fids: [*mut ffi::fid; 5] = [
            self.ep.cast(),
            self.av.cast(),
            self.cq.cast(),
            self.domain.cast(),
            self.fabric.cast(),
        ];
        for fid in fids {
            if fid.is_null() {
                continue;
            }
            // SAFETY: each object was opened by this endpoint and is closed once (the fid is
            // the first member of each object structure).
            let ret = unsafe { ((*(*fid).ops).close)(fid) };
            if ret != 0 {
                tracing::warn!("fi_close: {}", self.lib.strerror(-ret));
            }
        }
        for ops in [self.in_flight.get_mut(), self.expired.get_mut()] {
            if !ops.is_empty() {
                // Their scratch space may still be referenced by a provider that did not
                // flush them on close: never free it.
                std::mem::forget(std::mem::take(ops));
            }
        }
        // SAFETY: fi_dupinfo's copy, freed once.
        unsafe { (self.lib.freeinfo)(self.info) };
    }
}
