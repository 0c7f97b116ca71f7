//! GPUs and GPU-to-GPU links through NVML (loaded at run time by nvml-wrapper).

use crate::pci::{normalize_pci_bus_id, numa_node_of};
use crate::{GpuInfo, NvmlStatus, PciPath, PeerLink};
#[cfg(target_os = "linux")]
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml, cuda_driver_version_major, cuda_driver_version_minor};
use std::path::Path;

/// NVML_NVLINK_MAX_LINKS in nvml.h (18 since Hopper); nvml-wrapper does not re-export it.
const NVLINK_MAX_LINKS: u32 = 18;

/// What NVML said about the GPUs.
pub(crate) struct GpuReport {
    pub status: NvmlStatus,
    pub gpus: Vec<GpuInfo>,
    pub links: Vec<Vec<PeerLink>>,
}

impl GpuReport {
    fn unavailable(reason: String) -> Self {
        tracing::debug!(%reason, "NVML unavailable");
        GpuReport {
            status: NvmlStatus::Unavailable { reason },
            gpus: Vec::new(),
            links: Vec::new(),
        }
    }
}

/// Loads NVML, lists its GPUs and the link between every pair. NUMA nodes come from sysfs
/// under `sysfs_root`.
pub(crate) fn detect_gpus(sysfs_root: &Path) -> GpuReport {
    let nvml = match Nvml::init() {
        Ok(nvml) => nvml,
        Err(e) => return GpuReport::unavailable(init_failure(&e)),
    };
    let count = match nvml.device_count() {
        Ok(n) => n,
        Err(e) => {
            return GpuReport::unavailable(format!(
                "NVML loaded but nvmlDeviceGetCount failed: {e}"
            ));
        }
    };
    let status = NvmlStatus::Available {
        driver_version: nvml
            .sys_driver_version()
            .unwrap_or_else(|e| format!("unknown ({e})")),
        cuda_driver_version: nvml.sys_cuda_driver_version().ok().map(|v| {
            format!(
                "{}.{}",
                cuda_driver_version_major(v),
                cuda_driver_version_minor(v)
            )
        }),
        nvml_version: nvml
            .sys_nvml_version()
            .unwrap_or_else(|e| format!("unknown ({e})")),
    };

    let mut devices = Vec::new();
    let mut gpus = Vec::new();
    for index in 0..count {
        match nvml.device_by_index(index) {
            Ok(device) => {
                gpus.push(gpu_info(index, &device, sysfs_root));
                devices.push(device);
            }
            // E.g. a GPU the container may not open; it cannot be used by mori either.
            Err(e) => tracing::debug!(index, error = %e, "skipping GPU NVML cannot open"),
        }
    }
    let links = link_matrix(&nvml, &devices, &gpus);
    GpuReport {
        status,
        gpus,
        links,
    }
}

fn init_failure(e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(inner) => {
            format!("libnvidia-ml.so.1 could not be loaded ({inner})")
        }
        NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".to_owned(),
        NvmlError::NoPermission => "no permission to talk to the NVIDIA driver".to_owned(),
        other => format!("nvmlInit failed: {other}"),
    }
}

fn gpu_info(index: u32, device: &Device, sysfs_root: &Path) -> GpuInfo {
    let pci_bus_id = match device.pci_info() {
        Ok(info) => normalize_pci_bus_id(&info.bus_id),
        Err(e) => {
            tracing::debug!(index, error = %e, "no PCI info for GPU");
            String::new()
        }
    };
    GpuInfo {
        index,
        name: device.name().unwrap_or_else(|e| format!("unknown ({e})")),
        uuid: device.uuid().unwrap_or_default(),
        numa_node: numa_node_of(sysfs_root, &pci_bus_id),
        pci_bus_id,
        memory_total_bytes: device.memory_info().map(|m| m.total).unwrap_or(0),
        compute_capability: device
            .cuda_compute_capability()
            .ok()
            .map(|c| (c.major, c.minor)),
    }
}

/// NVLinks of one GPU: how many go to each other GPU, and how many end elsewhere.
struct NvLinkCounts {
    to_gpu: Vec<u32>,
    /// Links whose far end is no GPU here: on HGX boards these reach the NVSwitches.
    to_other: u32,
}

fn nvlink_counts(device: &Device, own: usize, gpus: &[GpuInfo]) -> NvLinkCounts {
    let mut counts = NvLinkCounts {
        to_gpu: vec![0; gpus.len()],
        to_other: 0,
    };
    for l in 0..NVLINK_MAX_LINKS {
        let link = device.link_wrapper_for(l);
        // NotSupported / InvalidArg just mean there is no such link.
        if !matches!(link.is_active(), Ok(true)) {
            continue;
        }
        let remote = match link.remote_pci_info() {
            Ok(info) => normalize_pci_bus_id(&info.bus_id),
            Err(e) => {
                tracing::debug!(gpu = own, link = l, error = %e, "active NVLink, no remote PCI info");
                continue;
            }
        };
        match gpus
            .iter()
            .position(|g| !g.pci_bus_id.is_empty() && g.pci_bus_id == remote)
        {
            // A loopback link carries no peer traffic.
            Some(peer) if peer == own => {}
            Some(peer) => counts.to_gpu[peer] += 1,
            None => {
                tracing::debug!(gpu = own, link = l, %remote, "NVLink to a non-GPU (NVSwitch?)");
                counts.to_other += 1;
            }
        }
    }
    counts
}

fn link_matrix(nvml: &Nvml, devices: &[Device], gpus: &[GpuInfo]) -> Vec<Vec<PeerLink>> {
    let counts: Vec<NvLinkCounts> = devices
        .iter()
        .enumerate()
        .map(|(i, d)| nvlink_counts(d, i, gpus))
        .collect();
    (0..devices.len())
        .map(|i| {
            (0..devices.len())
                .map(|j| {
                    if i == j {
                        return PeerLink::SelfLink;
                    }
                    // Both ends should agree; take the larger in case one side failed to read.
                    let direct = counts[i].to_gpu[j].max(counts[j].to_gpu[i]);
                    // GPUs on a shared NVSwitch fabric reach each other at the narrower
                    // side's link count, as nvidia-smi reports them.
                    let switched = counts[i].to_other.min(counts[j].to_other);
                    match direct.max(switched) {
                        0 => pcie_link(nvml, &devices[i], &devices[j]),
                        links => PeerLink::NvLink { links },
                    }
                })
                .collect()
        })
        .collect()
}

#[cfg(target_os = "linux")]
fn pcie_link(nvml: &Nvml, a: &Device, b: &Device) -> PeerLink {
    match nvml.topology_common_ancestor(a, b) {
        Ok(level) => PeerLink::Pcie {
            path: pci_path(level),
        },
        Err(e) => PeerLink::Unknown {
            reason: format!("no active NVLink; PCIe topology query failed: {e}"),
        },
    }
}

#[cfg(not(target_os = "linux"))]
fn pcie_link(_nvml: &Nvml, _a: &Device, _b: &Device) -> PeerLink {
    PeerLink::Unknown {
        reason: "no active NVLink; NVML reports the PCIe path only on Linux".to_owned(),
    }
}

#[cfg(target_os = "linux")]
fn pci_path(level: TopologyLevel) -> PciPath {
    match level {
        // Two GPUs on one board (e.g. K80) sit behind the board's own switch.
        TopologyLevel::Internal | TopologyLevel::Single => PciPath::SameSwitch,
        TopologyLevel::Multiple => PciPath::MultipleSwitches,
        TopologyLevel::HostBridge => PciPath::HostBridge,
        TopologyLevel::Node => PciPath::SameNuma,
        TopologyLevel::System => PciPath::CrossNuma,
    }
}
