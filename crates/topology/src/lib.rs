//! Hardware topology of the node mori runs on: NVIDIA GPUs (through NVML), how each pair of GPUs
//! is connected (NVLink count or PCIe path), and the physical network interfaces (through sysfs).
//!
//! [`detect`] never fails: when NVML is missing (no driver, no GPU, a CPU-only CI box) the
//! result says so in [`NvmlStatus::Unavailable`] and still lists the NICs.
//!
//! GPU order: [`Topology::gpus`] is in **NVML order**, which is PCI bus order. CUDA's default
//! order ("fastest first") can differ unless `CUDA_DEVICE_ORDER=PCI_BUS_ID` is set, so
//! consumers that hold a CUDA device should match it here by PCI bus id
//! ([`Topology::gpu_by_pci_bus_id`]), not by index.
//!
//! NIC choice: [`rdma_devices_by_distance`] ranks RDMA devices by their PCIe distance
//! ([`PciDistance`]) from a GPU; [`Topology::nearest_rdma_device`] picks the first.

mod affinity;
mod nics;
mod nvml;
mod pci;
mod render;

use serde::{Deserialize, Serialize};
use std::path::Path;

pub use affinity::{
    PciDistance, nearest_fabric_domain, pci_distance_in, rdma_device_distance_in,
    rdma_device_of_fabric_domain, rdma_devices_by_distance,
};
pub use nics::detect_nics_in;
pub use pci::normalize_pci_bus_id;

/// Everything mori knows about the node's GPUs, their interconnect and its NICs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Whether NVML could be loaded, and its versions; or why not.
    pub nvml: NvmlStatus,
    /// GPUs in NVML (PCI bus) order; see the crate docs about CUDA order.
    pub gpus: Vec<GpuInfo>,
    /// `links[i][j]`: how `gpus[i]` reaches `gpus[j]`. Square, `gpus.len()` × `gpus.len()`.
    pub links: Vec<Vec<PeerLink>>,
    /// Physical network interfaces (those backed by a device), sorted by name.
    pub nics: Vec<NicInfo>,
}

/// Outcome of loading NVML.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum NvmlStatus {
    /// NVML initialised.
    Available {
        /// Kernel driver version, e.g. "580.65.06".
        driver_version: String,
        /// Highest CUDA version the driver supports, e.g. "13.0"; `None` if NVML could not say.
        cuda_driver_version: Option<String>,
        /// NVML library version.
        nvml_version: String,
    },
    /// NVML could not be used; `reason` says why (library missing, driver not loaded, ...).
    Unavailable {
        /// Human-readable cause.
        reason: String,
    },
}

/// One NVIDIA GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index (not necessarily the CUDA ordinal).
    pub index: u32,
    /// Product name, e.g. "NVIDIA H200".
    pub name: String,
    /// "GPU-…" UUID; empty if NVML could not report it.
    pub uuid: String,
    /// Normalised lower-case bus id, e.g. "0000:18:00.0"; empty if NVML could not report it.
    pub pci_bus_id: String,
    /// NUMA node the GPU is attached to (sysfs); `None` on single-node machines or if unknown.
    pub numa_node: Option<i32>,
    /// Total device memory in bytes (0 if unknown).
    pub memory_total_bytes: u64,
    /// CUDA compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: Option<(i32, i32)>,
}

/// How one GPU reaches another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PeerLink {
    /// The diagonal of the matrix.
    #[serde(rename = "self")]
    SelfLink,
    /// Connected by `links` active NVLinks (directly, or both through the NVSwitch fabric).
    #[serde(rename = "nvlink")]
    NvLink {
        /// Number of active NVLinks usable between the pair.
        links: u32,
    },
    /// No NVLink; traffic goes over PCIe along `path`.
    Pcie {
        /// Closest common ancestor in the PCIe tree.
        path: PciPath,
    },
    /// Neither NVLink nor the PCIe path could be determined.
    Unknown {
        /// Why the link is unknown.
        reason: String,
    },
}

/// PCIe path between two devices, named as in `nvidia-smi topo -m`. Serialised as the short name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PciPath {
    /// Through at most one PCIe switch (PIX).
    #[serde(rename = "PIX")]
    SameSwitch,
    /// Through several PCIe switches but no host bridge (PXB).
    #[serde(rename = "PXB")]
    MultipleSwitches,
    /// Through a PCIe host bridge, i.e. the CPU root complex (PHB).
    #[serde(rename = "PHB")]
    HostBridge,
    /// Across host bridges within one NUMA node (NODE).
    #[serde(rename = "NODE")]
    SameNuma,
    /// Across NUMA nodes over the SMP interconnect (SYS).
    #[serde(rename = "SYS")]
    CrossNuma,
}

impl PciPath {
    /// The `nvidia-smi topo -m` abbreviation: "PIX", "PXB", "PHB", "NODE" or "SYS".
    pub fn short_name(self) -> &'static str {
        match self {
            PciPath::SameSwitch => "PIX",
            PciPath::MultipleSwitches => "PXB",
            PciPath::HostBridge => "PHB",
            PciPath::SameNuma => "NODE",
            PciPath::CrossNuma => "SYS",
        }
    }
}

/// Link-layer type of a NIC (sysfs `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NicKind {
    /// ARPHRD_ETHER (1); includes RoCE-capable Ethernet ports.
    Ethernet,
    /// ARPHRD_INFINIBAND (32), i.e. an IPoIB interface.
    #[serde(rename = "infiniband")]
    InfiniBand,
    /// Any other link type.
    Other,
}

/// One physical network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicInfo {
    /// Interface name, e.g. "eth0", "ib0".
    pub name: String,
    /// Link-layer type.
    pub kind: NicKind,
    /// Normalised PCI bus id of the backing device, if it sits on PCI.
    pub pci_bus_id: Option<String>,
    /// NUMA node of the backing device, if known.
    pub numa_node: Option<i32>,
    /// Link speed in Mb/s; `None` when down or not reported.
    pub speed_mbps: Option<u64>,
    /// RDMA devices on the same PCI function, e.g. `["mlx5_0"]`.
    pub rdma_devices: Vec<String>,
    /// sysfs `operstate`: "up", "down", "unknown", ...
    pub operstate: String,
    /// PCIe distance to each GPU of [`Topology::gpus`], for NICs with RDMA devices (GPUDirect
    /// RDMA traffic takes this path). Empty for other NICs and from [`detect_nics_in`], which
    /// knows no GPUs.
    #[serde(default)]
    pub gpu_distances: Vec<GpuDistance>,
}

/// How far a NIC is from one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDistance {
    /// NVML index of the GPU ([`GpuInfo::index`]).
    pub gpu: u32,
    /// PCIe distance between the GPU and the NIC.
    pub distance: PciDistance,
}

/// Probes NVML and sysfs (`/sys`) and returns what could be found. Never fails: a missing
/// piece is recorded as a reason ([`NvmlStatus::Unavailable`], [`PeerLink::Unknown`]).
pub fn detect() -> Topology {
    let sysfs = Path::new("/sys");
    let nvml::GpuReport {
        status,
        gpus,
        links,
    } = nvml::detect_gpus(sysfs);
    let mut nics = detect_nics_in(sysfs);
    affinity::fill_gpu_distances(sysfs, &gpus, &mut nics);
    tracing::debug!(gpus = gpus.len(), nics = nics.len(), "topology detected");
    Topology {
        nvml: status,
        gpus,
        links,
        nics,
    }
}

impl Topology {
    /// Human-readable report: NVML status, GPU list, an `nvidia-smi topo -m`-like matrix and
    /// the NICs.
    pub fn render_text(&self) -> String {
        render::render_text(self)
    }

    /// The whole topology as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        // Serialising these plain structs cannot fail; keep a valid JSON answer regardless.
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
    }

    /// Number of NVLinks between `gpus[a]` and `gpus[b]`; 0 for no NVLink, out-of-range
    /// indices or `a == b`.
    pub fn nvlink_count(&self, a: usize, b: usize) -> u32 {
        match self.links.get(a).and_then(|row| row.get(b)) {
            Some(PeerLink::NvLink { links }) => *links,
            _ => 0,
        }
    }

    /// The GPU at `bus_id`, in any common spelling ("00000000:18:00.0", "0000:18:00.0",
    /// "18:00.0", any case). Use this to map a CUDA device to its entry here.
    pub fn gpu_by_pci_bus_id(&self, bus_id: &str) -> Option<&GpuInfo> {
        let wanted = normalize_pci_bus_id(bus_id);
        self.gpus
            .iter()
            .find(|g| !g.pci_bus_id.is_empty() && g.pci_bus_id == wanted)
    }

    /// The RDMA device of [`Topology::nics`] nearest the GPU at `gpu_bus_id` (any common
    /// spelling; it need not be in [`Topology::gpus`], so a CUDA bus id works without NVML),
    /// with its distance; reads the PCI tree in `/sys`. `None` when no NIC has RDMA devices.
    pub fn nearest_rdma_device(&self, gpu_bus_id: &str) -> Option<(String, PciDistance)> {
        rdma_devices_by_distance(&self.nics, Path::new("/sys"), gpu_bus_id)
            .into_iter()
            .next()
    }
}
