//! How far a NIC sits from a GPU in the PCIe tree, to pick the RDMA device a GPU's traffic
//! should use: GPUDirect RDMA is fastest when GPU and NIC share a PCIe switch, and slowest when
//! it has to cross the inter-socket link.

use crate::nics::{dir_name, pci_ancestor};
use crate::pci::{is_pci_bus_id, normalize_pci_bus_id, read_numa_node};
use crate::{GpuDistance, GpuInfo, NicInfo};
use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};

/// PCIe distance between two devices, nearest first (the derived order ranks them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PciDistance {
    /// Both sit below a common PCI bridge (a PCIe switch): traffic turns around there and never
    /// reaches the host bridge.
    SameSwitch,
    /// Same PCIe host bridge (root complex), no bridge in common below it (different root
    /// ports, or both on the root bus as in many VMs).
    SameRootComplex,
    /// Different host bridges of one NUMA node.
    SameNumaNode,
    /// Different NUMA nodes: traffic crosses the inter-socket link.
    OtherNumaNode,
    /// A device is missing from sysfs, or its NUMA node is unknown.
    Unknown,
}

impl PciDistance {
    /// The serialised name: "same_switch", "same_root_complex", "same_numa_node",
    /// "other_numa_node" or "unknown".
    pub fn name(self) -> &'static str {
        match self {
            PciDistance::SameSwitch => "same_switch",
            PciDistance::SameRootComplex => "same_root_complex",
            PciDistance::SameNumaNode => "same_numa_node",
            PciDistance::OtherNumaNode => "other_numa_node",
            PciDistance::Unknown => "unknown",
        }
    }
}

/// Where a PCI device sits in the sysfs device tree.
struct PciPlace {
    /// The `pciDDDD:BB` host-bridge directory above the device, as a full path: host bridges
    /// of different domains or VMBus channels (Hyper-V) then never compare equal by name alone.
    host_bridge: Option<PathBuf>,
    /// PCI functions between the host bridge and the device (root port first), device excluded.
    bridges: Vec<String>,
    numa_node: Option<i32>,
}

/// Finds `bus_id` under `<sysfs_root>/bus/pci/devices`; `None` if it is not there.
fn locate(sysfs_root: &Path, bus_id: &str) -> Option<PciPlace> {
    let id = normalize_pci_bus_id(bus_id);
    if !is_pci_bus_id(&id) {
        tracing::debug!(bus_id, "not a PCI bus id; distance unknown");
        return None;
    }
    // The bus/pci/devices entry links to the device's place in the tree under devices/.
    let link = sysfs_root.join("bus/pci/devices").join(&id);
    let device = match fs::canonicalize(&link) {
        Ok(path) => path,
        Err(e) => {
            tracing::debug!(path = %link.display(), error = %e, "PCI device not in sysfs");
            return None;
        }
    };
    let numa_node = read_numa_node(&device.join("numa_node"));
    let mut host_bridge = None;
    let mut functions = Vec::new();
    let mut prefix = PathBuf::new();
    for component in device.components() {
        prefix.push(component);
        let name = component.as_os_str().to_string_lossy();
        if host_bridge.is_none() {
            if is_host_bridge_dir(&name) {
                host_bridge = Some(prefix.clone());
            }
        } else if is_pci_bus_id(&name) {
            functions.push(normalize_pci_bus_id(&name));
        }
    }
    // The last function is the device itself, unless the link led somewhere unexpected.
    if functions.last() != Some(&id) {
        tracing::debug!(%id, path = %device.display(), "PCI device outside a host bridge tree");
        host_bridge = None;
    }
    functions.pop();
    Some(PciPlace {
        host_bridge,
        bridges: functions,
        numa_node,
    })
}

/// Whether `name` is a host-bridge directory, "pci" + domain + ":" + bus (e.g. "pci0000:17").
fn is_host_bridge_dir(name: &str) -> bool {
    let Some((domain, bus)) = name.strip_prefix("pci").and_then(|s| s.split_once(':')) else {
        return false;
    };
    let hex = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_hexdigit());
    hex(domain) && domain.len() <= 8 && hex(bus) && bus.len() == 2
}

/// Distance between two located devices; `Unknown` when either could not be located.
fn distance(a: Option<&PciPlace>, b: Option<&PciPlace>) -> PciDistance {
    let (Some(a), Some(b)) = (a, b) else {
        return PciDistance::Unknown;
    };
    if let (Some(ha), Some(hb)) = (&a.host_bridge, &b.host_bridge)
        && ha == hb
    {
        // Two devices can only share a root port through a switch below it (or as functions
        // of one card); either way their traffic stays below the host bridge.
        let shared = a
            .bridges
            .iter()
            .zip(&b.bridges)
            .take_while(|(x, y)| x == y)
            .count();
        return if shared > 0 {
            PciDistance::SameSwitch
        } else {
            PciDistance::SameRootComplex
        };
    }
    match (a.numa_node, b.numa_node) {
        (Some(x), Some(y)) if x == y => PciDistance::SameNumaNode,
        (Some(_), Some(_)) => PciDistance::OtherNumaNode,
        _ => PciDistance::Unknown,
    }
}

/// PCIe distance between the devices `a_bus_id` and `b_bus_id` (any common bus id spelling)
/// in the sysfs tree under `sysfs_root` (normally "/sys").
pub fn pci_distance_in(sysfs_root: &Path, a_bus_id: &str, b_bus_id: &str) -> PciDistance {
    distance(
        locate(sysfs_root, a_bus_id).as_ref(),
        locate(sysfs_root, b_bus_id).as_ref(),
    )
}

/// The RDMA devices of `nics` with their distance from the GPU at `gpu_bus_id`, nearest
/// first, ties by name; each device once. Reads the PCI tree under `sysfs_root`.
pub fn rdma_devices_by_distance(
    nics: &[NicInfo],
    sysfs_root: &Path,
    gpu_bus_id: &str,
) -> Vec<(String, PciDistance)> {
    let gpu = locate(sysfs_root, gpu_bus_id);
    let mut found: Vec<(String, PciDistance)> = nics
        .iter()
        .filter(|nic| !nic.rdma_devices.is_empty())
        .flat_map(|nic| {
            let place = nic
                .pci_bus_id
                .as_deref()
                .and_then(|id| locate(sysfs_root, id));
            let d = distance(gpu.as_ref(), place.as_ref());
            nic.rdma_devices.iter().map(move |dev| (dev.clone(), d))
        })
        .collect();
    found.sort_by(|(na, da), (nb, db)| da.cmp(db).then_with(|| na.cmp(nb)));
    // Several interfaces of one PCI function (e.g. IPoIB child interfaces) share its devices.
    found.dedup();
    found
}

/// The distance from the GPU at `gpu_bus_id` to the RDMA device `device` as the kernel lists
/// it (`class/infiniband/<device>`: InfiniBand, RoCE, iWARP and EFA devices; `class/cxi/<device>`:
/// Slingshot), whether or not it has a network interface (EFA and CXI devices have none).
pub fn rdma_device_distance_in(sysfs_root: &Path, device: &str, gpu_bus_id: &str) -> PciDistance {
    let place = ["class/infiniband", "class/cxi"].iter().find_map(|class| {
        let dev = fs::canonicalize(sysfs_root.join(class).join(device).join("device")).ok()?;
        let bus_id = dir_name(&pci_ancestor(&dev)?)?;
        locate(sysfs_root, &bus_id)
    });
    if place.is_none() {
        tracing::debug!(device, "RDMA device not found in sysfs; distance unknown");
    }
    distance(locate(sysfs_root, gpu_bus_id).as_ref(), place.as_ref())
}

/// Of a provider's fabric `domains` (libfabric names: `mlx5_0`, `rdmap16s27-rdm`, `cxi0`, ...),
/// the one whose RDMA device is nearest the GPU at `gpu_bus_id`, with its distance; ties go to
/// the first name in sort order. None when no domain's device is placed (`lo`, `eth0` of a
/// software provider, or a tree without those devices).
pub fn nearest_fabric_domain(
    sysfs_root: &Path,
    domains: impl IntoIterator<Item = String>,
    gpu_bus_id: &str,
) -> Option<(String, PciDistance)> {
    domains
        .into_iter()
        .map(|d| {
            let device = rdma_device_of_fabric_domain(&d);
            (rdma_device_distance_in(sysfs_root, device, gpu_bus_id), d)
        })
        .filter(|(distance, _)| *distance != PciDistance::Unknown)
        .min()
        .map(|(distance, d)| (d, distance))
}

/// Fills [`NicInfo::gpu_distances`] of every RDMA-capable NIC with its distance to each GPU.
pub(crate) fn fill_gpu_distances(sysfs_root: &Path, gpus: &[GpuInfo], nics: &mut [NicInfo]) {
    let places: Vec<(u32, Option<PciPlace>)> = gpus
        .iter()
        .map(|g| (g.index, locate(sysfs_root, &g.pci_bus_id)))
        .collect();
    for nic in nics.iter_mut().filter(|n| !n.rdma_devices.is_empty()) {
        let own = nic
            .pci_bus_id
            .as_deref()
            .and_then(|id| locate(sysfs_root, id));
        nic.gpu_distances = places
            .iter()
            .map(|(gpu, place)| GpuDistance {
                gpu: *gpu,
                distance: distance(place.as_ref(), own.as_ref()),
            })
            .collect();
    }
}

/// The RDMA device behind a libfabric domain name: verbs names domains after the device
/// ("mlx5_0", with "-xrc" / "-dgram" for those endpoint types), efa appends "-rdm" or "-dgrm"
/// ("rdmap16s27-rdm"), cxi uses the device name ("cxi0"). Other names come back unchanged.
pub fn rdma_device_of_fabric_domain(domain: &str) -> &str {
    const SUFFIXES: [&str; 4] = ["-rdm", "-dgrm", "-dgram", "-xrc"];
    SUFFIXES
        .iter()
        .find_map(|s| domain.strip_suffix(s).filter(|d| !d.is_empty()))
        .unwrap_or(domain)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NicKind;
    use std::os::unix::fs::symlink;

    /// Creates the device directory `devices/<path>` with a `numa_node` file (when given) and
    /// its `bus/pci/devices/<last component>` link, as the kernel lays them out.
    fn device(root: &Path, path: &str, numa: Option<&str>) {
        let dir = root.join("devices").join(path);
        fs::create_dir_all(&dir).unwrap();
        if let Some(numa) = numa {
            fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        }
        let links = root.join("bus/pci/devices");
        fs::create_dir_all(&links).unwrap();
        let name = dir.file_name().unwrap().to_owned();
        symlink(&dir, links.join(name)).unwrap();
    }

    /// A two-socket HGX-like box:
    /// - socket 0, host bridge pci0000:17: a switch (18:00.0 up, 19:xx.0 down) with GPU
    ///   1a:00.0 and NIC 1b:00.0 (mlx5_0) below it; a second root port 17:02.0 with NIC
    ///   2a:00.0 (mlx5_1).
    /// - socket 0, host bridge pci0000:30: NIC 31:00.0 (mlx5_2).
    /// - socket 1, host bridge pci0000:9a: GPU 9c:00.0 behind root port 9a:01.0 and NIC
    ///   9d:00.0 (mlx5_3) behind root port 9a:02.0.
    /// - NIC 0000:40:00.0 (mlx5_4) with `numa_node` -1 on its own host bridge.
    fn hgx(root: &Path) {
        device(root, "pci0000:17/0000:17:01.0", Some("0"));
        device(root, "pci0000:17/0000:17:01.0/0000:18:00.0", Some("0"));
        device(
            root,
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0",
            Some("0"),
        );
        device(
            root,
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0",
            Some("0"),
        );
        device(
            root,
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0",
            Some("0"),
        );
        device(
            root,
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0",
            Some("0"),
        );
        device(root, "pci0000:17/0000:17:02.0", Some("0"));
        device(root, "pci0000:17/0000:17:02.0/0000:2a:00.0", Some("0"));
        device(root, "pci0000:30/0000:30:01.0", Some("0"));
        device(root, "pci0000:30/0000:30:01.0/0000:31:00.0", Some("0"));
        device(root, "pci0000:9a/0000:9a:01.0", Some("1"));
        device(root, "pci0000:9a/0000:9a:01.0/0000:9c:00.0", Some("1"));
        device(root, "pci0000:9a/0000:9a:02.0", Some("1"));
        device(root, "pci0000:9a/0000:9a:02.0/0000:9d:00.0", Some("1"));
        device(root, "pci0000:40/0000:40:00.0", Some("-1"));
    }

    const GPU0: &str = "00000000:1A:00.0"; // NVML spelling
    const GPU1: &str = "0000:9c:00.0";

    fn nic(name: &str, bus: &str, rdma: &[&str]) -> NicInfo {
        NicInfo {
            name: name.to_owned(),
            kind: NicKind::InfiniBand,
            pci_bus_id: Some(bus.to_owned()),
            numa_node: None,
            speed_mbps: None,
            rdma_devices: rdma.iter().map(|d| (*d).to_owned()).collect(),
            operstate: "up".to_owned(),
            gpu_distances: Vec::new(),
        }
    }

    fn hgx_nics() -> Vec<NicInfo> {
        vec![
            nic("eth0", "0000:31:00.0", &["mlx5_2"]),
            nic("ib0", "0000:1b:00.0", &["mlx5_0"]),
            // An IPoIB child interface of ib0: same function, same device.
            nic("ib0.8001", "0000:1b:00.0", &["mlx5_0"]),
            nic("ib1", "0000:2a:00.0", &["mlx5_1"]),
            nic("ib2", "0000:9d:00.0", &["mlx5_3"]),
            nic("ib3", "0000:40:00.0", &["mlx5_4"]),
            nic("ib4", "0000:77:00.0", &["mlx5_9"]), // not in sysfs
            nic("eno1", "0000:2a:00.0", &[]),        // no RDMA
        ]
    }

    /// EFA and CXI devices have no network interface: their distance comes from their own
    /// sysfs class entries.
    #[test]
    fn rdma_devices_without_an_interface_are_placed_by_their_class_entry() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        hgx(root);
        let class = |class: &str, name: &str, dev: &str| {
            let dir = root.join(class).join(name);
            fs::create_dir_all(&dir).unwrap();
            symlink(root.join("devices").join(dev), dir.join("device")).unwrap();
        };
        class(
            "class/infiniband",
            "rdmap27s0",
            "pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0",
        );
        class("class/cxi", "cxi0", "pci0000:9a/0000:9a:02.0/0000:9d:00.0");
        let d = |dev: &str, gpu: &str| rdma_device_distance_in(root, dev, gpu);
        assert_eq!(d("rdmap27s0", GPU0), PciDistance::SameSwitch);
        assert_eq!(d("rdmap27s0", GPU1), PciDistance::OtherNumaNode);
        assert_eq!(d("cxi0", GPU1), PciDistance::SameRootComplex);
        assert_eq!(d("cxi0", GPU0), PciDistance::OtherNumaNode);
        assert_eq!(d("mlx5_7", GPU0), PciDistance::Unknown);
        // A provider's domains, ranked for each GPU: libfabric's names map to the devices.
        class(
            "class/infiniband",
            "mlx5_3",
            "pci0000:9a/0000:9a:02.0/0000:9d:00.0",
        );
        let domains = || {
            ["lo", "mlx5_3", "rdmap27s0-rdm", "cxi0", "mlx5_7"]
                .map(String::from)
                .to_vec()
        };
        assert_eq!(
            nearest_fabric_domain(root, domains(), GPU0),
            Some(("rdmap27s0-rdm".into(), PciDistance::SameSwitch))
        );
        // GPU1: cxi0 and mlx5_3 sit behind the same root port: the tie goes to the first name.
        assert_eq!(
            nearest_fabric_domain(root, domains(), GPU1),
            Some(("cxi0".into(), PciDistance::SameRootComplex))
        );
        assert_eq!(nearest_fabric_domain(root, ["lo".to_string()], GPU0), None);
    }

    #[test]
    fn gpu_and_nic_behind_one_switch() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        let d = pci_distance_in(tmp.path(), GPU0, "0000:1b:00.0");
        assert_eq!(d, PciDistance::SameSwitch);
        assert_eq!(pci_distance_in(tmp.path(), "0000:1b:00.0", GPU0), d);
    }

    #[test]
    fn different_root_ports_of_one_host_bridge() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        assert_eq!(
            pci_distance_in(tmp.path(), GPU0, "0000:2a:00.0"),
            PciDistance::SameRootComplex
        );
        assert_eq!(
            pci_distance_in(tmp.path(), GPU1, "0000:9d:00.0"),
            PciDistance::SameRootComplex
        );
    }

    #[test]
    fn different_host_bridges_same_numa_node() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        assert_eq!(
            pci_distance_in(tmp.path(), GPU0, "0000:31:00.0"),
            PciDistance::SameNumaNode
        );
    }

    #[test]
    fn different_numa_nodes() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        assert_eq!(
            pci_distance_in(tmp.path(), GPU0, "0000:9d:00.0"),
            PciDistance::OtherNumaNode
        );
        assert_eq!(
            pci_distance_in(tmp.path(), GPU1, "0000:1b:00.0"),
            PciDistance::OtherNumaNode
        );
    }

    #[test]
    fn missing_device_or_numa_is_unknown() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        let root = tmp.path();
        assert_eq!(
            pci_distance_in(root, GPU0, "0000:77:00.0"),
            PciDistance::Unknown
        );
        assert_eq!(
            pci_distance_in(root, "0000:77:00.0", GPU0),
            PciDistance::Unknown
        );
        // numa_node -1: other host bridge, NUMA node not known.
        assert_eq!(
            pci_distance_in(root, GPU0, "0000:40:00.0"),
            PciDistance::Unknown
        );
        assert_eq!(pci_distance_in(root, "", GPU0), PciDistance::Unknown);
        assert_eq!(pci_distance_in(root, "eth0", GPU0), PciDistance::Unknown);
        assert_eq!(
            pci_distance_in(&root.join("nope"), GPU0, "0000:1b:00.0"),
            PciDistance::Unknown
        );
    }

    #[test]
    fn devices_on_the_root_bus_share_only_the_host_bridge() {
        // VMs often put devices straight on bus 0, with no root port above them.
        let tmp = tempfile::tempdir().unwrap();
        device(tmp.path(), "pci0000:00/0000:00:05.0", None);
        device(tmp.path(), "pci0000:00/0000:00:06.0", None);
        assert_eq!(
            pci_distance_in(tmp.path(), "0000:00:05.0", "0000:00:06.0"),
            PciDistance::SameRootComplex
        );
    }

    #[test]
    fn rdma_devices_sorted_nearest_first() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        let nics = hgx_nics();
        let ranked = rdma_devices_by_distance(&nics, tmp.path(), GPU0);
        let expected = [
            ("mlx5_0", PciDistance::SameSwitch),
            ("mlx5_1", PciDistance::SameRootComplex),
            ("mlx5_2", PciDistance::SameNumaNode),
            ("mlx5_3", PciDistance::OtherNumaNode),
            ("mlx5_4", PciDistance::Unknown),
            ("mlx5_9", PciDistance::Unknown),
        ];
        let got: Vec<(&str, PciDistance)> = ranked.iter().map(|(n, d)| (n.as_str(), *d)).collect();
        assert_eq!(got, expected);

        let ranked = rdma_devices_by_distance(&nics, tmp.path(), GPU1);
        assert_eq!(
            ranked[0],
            ("mlx5_3".to_owned(), PciDistance::SameRootComplex)
        );
        // Ties break by name.
        let other: Vec<&str> = ranked
            .iter()
            .filter(|(_, d)| *d == PciDistance::OtherNumaNode)
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(other, ["mlx5_0", "mlx5_1", "mlx5_2"]);
    }

    #[test]
    fn unknown_gpu_ranks_everything_unknown() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        let ranked = rdma_devices_by_distance(&hgx_nics(), tmp.path(), "0000:ee:00.0");
        assert_eq!(ranked.len(), 6);
        assert!(ranked.iter().all(|(_, d)| *d == PciDistance::Unknown));
        assert_eq!(ranked[0].0, "mlx5_0");
    }

    #[test]
    fn fills_distances_for_rdma_nics_only() {
        let tmp = tempfile::tempdir().unwrap();
        hgx(tmp.path());
        let gpu = |index: u32, bus: &str| GpuInfo {
            index,
            name: "NVIDIA H200".to_owned(),
            uuid: String::new(),
            pci_bus_id: normalize_pci_bus_id(bus),
            numa_node: None,
            memory_total_bytes: 0,
            compute_capability: None,
        };
        let gpus = [gpu(0, GPU0), gpu(1, GPU1), gpu(2, "")];
        let mut nics = hgx_nics();
        fill_gpu_distances(tmp.path(), &gpus, &mut nics);
        let of = |name: &str| -> Vec<(u32, PciDistance)> {
            nics.iter()
                .find(|n| n.name == name)
                .unwrap()
                .gpu_distances
                .iter()
                .map(|d| (d.gpu, d.distance))
                .collect()
        };
        assert_eq!(
            of("ib0"),
            [
                (0, PciDistance::SameSwitch),
                (1, PciDistance::OtherNumaNode),
                (2, PciDistance::Unknown)
            ]
        );
        assert_eq!(of("ib2")[1], (1, PciDistance::SameRootComplex));
        assert!(of("eno1").is_empty());
    }

    #[test]
    fn order_and_names() {
        assert!(PciDistance::SameSwitch < PciDistance::SameRootComplex);
        assert!(PciDistance::SameRootComplex < PciDistance::SameNumaNode);
        assert!(PciDistance::SameNumaNode < PciDistance::OtherNumaNode);
        assert!(PciDistance::OtherNumaNode < PciDistance::Unknown);
        for d in [
            PciDistance::SameSwitch,
            PciDistance::SameRootComplex,
            PciDistance::SameNumaNode,
            PciDistance::OtherNumaNode,
            PciDistance::Unknown,
        ] {
            let json = serde_json::to_value(d).unwrap();
            assert_eq!(json, d.name());
            assert_eq!(serde_json::from_value::<PciDistance>(json).unwrap(), d);
        }
    }

    #[test]
    fn host_bridge_dir_names() {
        assert!(is_host_bridge_dir("pci0000:17"));
        assert!(is_host_bridge_dir("pci10000:e0")); // VMD domain
        assert!(!is_host_bridge_dir("pci0000:1"));
        assert!(!is_host_bridge_dir("pci_express"));
        assert!(!is_host_bridge_dir("0000:17:00.0"));
    }

    #[test]
    fn fabric_domains_to_rdma_devices() {
        assert_eq!(rdma_device_of_fabric_domain("mlx5_0"), "mlx5_0");
        assert_eq!(rdma_device_of_fabric_domain("mlx5_0-xrc"), "mlx5_0");
        assert_eq!(rdma_device_of_fabric_domain("mlx5_0-dgram"), "mlx5_0");
        assert_eq!(rdma_device_of_fabric_domain("rdmap16s27-rdm"), "rdmap16s27");
        assert_eq!(
            rdma_device_of_fabric_domain("rdmap16s27-dgrm"),
            "rdmap16s27"
        );
        assert_eq!(rdma_device_of_fabric_domain("cxi0"), "cxi0");
        assert_eq!(rdma_device_of_fabric_domain("eth0"), "eth0");
        // Only a known suffix goes, and never the whole name.
        assert_eq!(rdma_device_of_fabric_domain("mlx5-bond"), "mlx5-bond");
        assert_eq!(rdma_device_of_fabric_domain("-rdm"), "-rdm");
    }
}
