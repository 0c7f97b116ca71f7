//! The human-readable report printed by `mori check`.

use crate::{NicInfo, NvmlStatus, PciDistance, PeerLink, Topology};
use std::fmt::Write;

const LEGEND: &str = "Legend: X = self, NV# = # NVLinks, ? = unknown,
        PIX = at most one PCIe switch, PXB = several PCIe switches, PHB = PCIe host bridge,
        NODE = across host bridges in one NUMA node, SYS = across NUMA nodes";

const NIC_LEGEND: &str = "NIC-to-GPU distance: switch = behind one PCIe switch, \
host = same PCIe host bridge, node = same NUMA node, sys = across NUMA nodes, ? = unknown";

pub(crate) fn render_text(topo: &Topology) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail, so the fmt::Results below are ignored.
    match &topo.nvml {
        NvmlStatus::Available {
            driver_version,
            cuda_driver_version,
            nvml_version,
        } => {
            let cuda = cuda_driver_version.as_deref().unwrap_or("unknown");
            let _ = writeln!(
                out,
                "NVML: driver {driver_version}, CUDA {cuda}, NVML {nvml_version}"
            );
            if topo.gpus.is_empty() {
                let _ = writeln!(
                    out,
                    "No NVIDIA GPUs found (NVML is available but reports none)."
                );
            }
        }
        NvmlStatus::Unavailable { reason } => {
            let _ = writeln!(out, "No NVIDIA GPUs / NVML not found: {reason}");
        }
    }
    if !topo.gpus.is_empty() {
        render_gpus(&mut out, topo);
        render_matrix(&mut out, topo);
    }
    render_nics(&mut out, &topo.nics);
    out
}

fn render_gpus(out: &mut String, topo: &Topology) {
    let _ = writeln!(
        out,
        "\nGPUs (NVML order = PCI bus order; CUDA uses it only with CUDA_DEVICE_ORDER=PCI_BUS_ID):"
    );
    for gpu in &topo.gpus {
        let numa = gpu
            .numa_node
            .map_or_else(|| "-".to_owned(), |n| n.to_string());
        let cc = gpu
            .compute_capability
            .map_or_else(|| "sm_?".to_owned(), |(ma, mi)| format!("sm_{ma}{mi}"));
        let gib = gpu.memory_total_bytes as f64 / f64::from(1u32 << 30);
        let _ = writeln!(
            out,
            "  GPU{:<3} {:<24} {:<14} NUMA {:<3} {:>7.1} GiB  {:<7} {}",
            gpu.index, gpu.name, gpu.pci_bus_id, numa, gib, cc, gpu.uuid
        );
    }
}

fn cell(link: &PeerLink) -> String {
    match link {
        PeerLink::SelfLink => "X".to_owned(),
        PeerLink::NvLink { links } => format!("NV{links}"),
        PeerLink::Pcie { path } => path.short_name().to_owned(),
        PeerLink::Unknown { .. } => "?".to_owned(),
    }
}

fn render_matrix(out: &mut String, topo: &Topology) {
    let labels: Vec<String> = topo
        .gpus
        .iter()
        .map(|g| format!("GPU{}", g.index))
        .collect();
    let cells: Vec<Vec<String>> = topo
        .links
        .iter()
        .map(|row| row.iter().map(cell).collect())
        .collect();
    let width = labels
        .iter()
        .chain(cells.iter().flatten())
        .map(String::len)
        .max()
        .unwrap_or(0)
        + 2;

    let _ = writeln!(out, "\nGPU interconnect:");
    let _ = write!(out, "{:width$}", "");
    for label in &labels {
        let _ = write!(out, "{label:>width$}");
    }
    let _ = writeln!(out);
    for (label, row) in labels.iter().zip(&cells) {
        let _ = write!(out, "{label:<width$}");
        for c in row {
            let _ = write!(out, "{c:>width$}");
        }
        let _ = writeln!(out);
    }
    // Both directions come from the same query, so each unknown pair is listed once.
    for (i, row) in topo.links.iter().enumerate() {
        for (j, link) in row.iter().enumerate().skip(i + 1) {
            if let PeerLink::Unknown { reason } = link {
                let _ = writeln!(
                    out,
                    "  ? {} -> {}: {reason}",
                    labels[i],
                    labels.get(j).map_or("?", String::as_str)
                );
            }
        }
    }
    let _ = writeln!(out, "{LEGEND}");
}

fn render_nics(out: &mut String, nics: &[NicInfo]) {
    if nics.is_empty() {
        let _ = writeln!(out, "\nNICs: none found (physical interfaces only)");
        return;
    }
    let _ = writeln!(out, "\nNICs (physical only):");
    for nic in nics {
        let kind = match nic.kind {
            crate::NicKind::Ethernet => "ethernet",
            crate::NicKind::InfiniBand => "infiniband",
            crate::NicKind::Other => "other",
        };
        let pci = nic.pci_bus_id.as_deref().unwrap_or("-");
        let numa = nic
            .numa_node
            .map_or_else(|| "-".to_owned(), |n| n.to_string());
        let speed = nic
            .speed_mbps
            .map_or_else(|| "-".to_owned(), |s| format!("{s} Mb/s"));
        let rdma = if nic.rdma_devices.is_empty() {
            "-".to_owned()
        } else {
            nic.rdma_devices.join(",")
        };
        let _ = write!(
            out,
            "  {:<16} {:<10} {:<14} NUMA {:<3} {:>12}  {:<8} rdma: {}",
            nic.name, kind, pci, numa, speed, nic.operstate, rdma
        );
        let mut sep = "  ";
        for d in &nic.gpu_distances {
            let _ = write!(out, "{sep}GPU{}:{}", d.gpu, short_distance(d.distance));
            sep = " ";
        }
        let _ = writeln!(out);
    }
    if nics.iter().any(|n| !n.gpu_distances.is_empty()) {
        let _ = writeln!(out, "{NIC_LEGEND}");
    }
}

/// Short enough for one cell per GPU on a NIC's line.
fn short_distance(d: PciDistance) -> &'static str {
    match d {
        PciDistance::SameSwitch => "switch",
        PciDistance::SameRootComplex => "host",
        PciDistance::SameNumaNode => "node",
        PciDistance::OtherNumaNode => "sys",
        PciDistance::Unknown => "?",
    }
}
