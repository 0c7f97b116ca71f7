//! Network interfaces from sysfs (`class/net`, `class/infiniband`).

use crate::pci::{is_pci_bus_id, normalize_pci_bus_id, read_numa_node};
use crate::{NicInfo, NicKind};
use std::fs;
use std::path::{Path, PathBuf};

/// ARPHRD_* values from the sysfs `type` file.
const ARPHRD_ETHER: u32 = 1;
const ARPHRD_INFINIBAND: u32 = 32;

/// Lists the physical NICs under `sysfs_root` (normally "/sys"), sorted by name.
///
/// Only interfaces with a `device` link are listed: that excludes `lo` and virtual ones
/// (bridges, veth, docker0, bonds, tunnels), which carry no hardware of their own.
/// A missing or unreadable tree yields an empty list.
pub fn detect_nics_in(sysfs_root: &Path) -> Vec<NicInfo> {
    let net_dir = sysfs_root.join("class/net");
    let entries = match fs::read_dir(&net_dir) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::debug!(dir = %net_dir.display(), error = %e, "cannot list network interfaces");
            return Vec::new();
        }
    };
    let rdma = rdma_devices(sysfs_root);
    let mut nics: Vec<NicInfo> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            nic_info(&entry.path(), name, &rdma)
        })
        .collect();
    nics.sort_by(|a, b| a.name.cmp(&b.name));
    nics
}

fn nic_info(dir: &Path, name: String, rdma: &[(String, PathBuf)]) -> Option<NicInfo> {
    if name == "lo" {
        return None;
    }
    // Following the link resolves to the device's directory under /sys/devices.
    let Ok(device) = fs::canonicalize(dir.join("device")) else {
        tracing::debug!(nic = %name, "no device link; virtual interface skipped");
        return None;
    };
    let pci_dir = pci_ancestor(&device);
    let pci_bus_id = pci_dir
        .as_deref()
        .and_then(dir_name)
        .map(|n| normalize_pci_bus_id(&n));
    // Non-PCI functions (e.g. virtio0) often lack numa_node; their PCI parent has it.
    let numa_node = read_numa_node(&device.join("numa_node")).or_else(|| {
        pci_dir
            .as_ref()
            .and_then(|d| read_numa_node(&d.join("numa_node")))
    });
    let kind = match read_trimmed(&dir.join("type")).and_then(|t| t.parse::<u32>().ok()) {
        Some(ARPHRD_ETHER) => NicKind::Ethernet,
        Some(ARPHRD_INFINIBAND) => NicKind::InfiniBand,
        _ => NicKind::Other,
    };
    // `speed` is -1 or fails with EINVAL while the link is down.
    let speed_mbps = read_trimmed(&dir.join("speed"))
        .and_then(|s| s.parse::<i64>().ok())
        .filter(|s| *s > 0)
        .and_then(|s| u64::try_from(s).ok());
    let operstate = read_trimmed(&dir.join("operstate")).unwrap_or_else(|| "unknown".to_owned());
    let rdma_devices = match &pci_dir {
        Some(pci) => rdma
            .iter()
            .filter(|(_, dev)| dev == pci)
            .map(|(ib, _)| ib.clone())
            .collect(),
        None => Vec::new(),
    };
    tracing::debug!(nic = %name, ?kind, ?pci_bus_id, ?rdma_devices, "found NIC");
    Some(NicInfo {
        name,
        kind,
        pci_bus_id,
        numa_node,
        speed_mbps,
        rdma_devices,
        operstate,
        // Filled by detect(), which knows the GPUs.
        gpu_distances: Vec::new(),
    })
}

/// RDMA devices (`class/infiniband/<dev>`) with the PCI directory of their device, sorted.
fn rdma_devices(sysfs_root: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = fs::read_dir(sysfs_root.join("class/infiniband")) else {
        return Vec::new();
    };
    let mut devices: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let device = fs::canonicalize(entry.path().join("device")).ok()?;
            let pci = pci_ancestor(&device)?;
            Some((entry.file_name().to_string_lossy().into_owned(), pci))
        })
        .collect();
    devices.sort();
    devices
}

/// The nearest directory at or above `device` named like a PCI bus id.
pub(crate) fn pci_ancestor(device: &Path) -> Option<PathBuf> {
    device
        .ancestors()
        .find(|p| dir_name(p).is_some_and(|n| is_pci_bus_id(&n)))
        .map(Path::to_path_buf)
}

pub(crate) fn dir_name(path: &Path) -> Option<String> {
    path.file_name().map(|n| n.to_string_lossy().into_owned())
}

fn read_trimmed(file: &Path) -> Option<String> {
    fs::read_to_string(file).ok().map(|s| s.trim().to_owned())
}
