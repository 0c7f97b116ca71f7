//! render_text / to_json / lookups on hand-built topologies.

use mori_topology::{
    GpuDistance, GpuInfo, NicInfo, NicKind, NvmlStatus, PciDistance, PciPath, PeerLink, Topology,
    normalize_pci_bus_id,
};

fn gpu(index: u32, bus: &str, numa: i32) -> GpuInfo {
    GpuInfo {
        index,
        name: "NVIDIA H200".to_owned(),
        uuid: format!("GPU-0000000{index}"),
        pci_bus_id: bus.to_owned(),
        numa_node: Some(numa),
        memory_total_bytes: 150_754_820_096,
        compute_capability: Some((9, 0)),
    }
}

fn available() -> NvmlStatus {
    NvmlStatus::Available {
        driver_version: "580.65.06".to_owned(),
        cuda_driver_version: Some("13.0".to_owned()),
        nvml_version: "13.580.65.06".to_owned(),
    }
}

fn nvlinked_pair() -> Topology {
    Topology {
        nvml: available(),
        gpus: vec![gpu(0, "0000:18:00.0", 0), gpu(1, "0000:9a:00.0", 1)],
        links: vec![
            vec![PeerLink::SelfLink, PeerLink::NvLink { links: 18 }],
            vec![PeerLink::NvLink { links: 18 }, PeerLink::SelfLink],
        ],
        nics: vec![NicInfo {
            name: "ib0".to_owned(),
            kind: NicKind::InfiniBand,
            pci_bus_id: Some("0000:3b:00.0".to_owned()),
            numa_node: Some(0),
            speed_mbps: Some(400_000),
            rdma_devices: vec!["mlx5_0".to_owned()],
            operstate: "up".to_owned(),
            gpu_distances: vec![
                GpuDistance {
                    gpu: 0,
                    distance: PciDistance::SameSwitch,
                },
                GpuDistance {
                    gpu: 1,
                    distance: PciDistance::OtherNumaNode,
                },
            ],
        }],
    }
}

/// Three GPUs over PCIe: 0-1 share a switch, 2 is on the other socket, 1-2 unknown.
fn pcie_triple() -> Topology {
    let pix = PeerLink::Pcie {
        path: PciPath::SameSwitch,
    };
    let sys = PeerLink::Pcie {
        path: PciPath::CrossNuma,
    };
    let unknown = PeerLink::Unknown {
        reason: "query failed".to_owned(),
    };
    Topology {
        nvml: available(),
        gpus: vec![
            gpu(0, "0000:18:00.0", 0),
            gpu(1, "0000:19:00.0", 0),
            gpu(2, "0000:9a:00.0", 1),
        ],
        links: vec![
            vec![PeerLink::SelfLink, pix.clone(), sys.clone()],
            vec![pix, PeerLink::SelfLink, unknown.clone()],
            vec![sys, unknown, PeerLink::SelfLink],
        ],
        nics: Vec::new(),
    }
}

/// The matrix row for `label`, split into cells.
fn matrix_row<'a>(text: &'a str, label: &str) -> Vec<&'a str> {
    text.lines()
        .find(|l| l.starts_with(label) && !l.contains("NVIDIA"))
        .unwrap_or_else(|| panic!("no matrix row {label} in\n{text}"))
        .split_whitespace()
        .collect()
}

#[test]
fn render_nvlink_matrix() {
    let text = nvlinked_pair().render_text();
    assert!(text.contains("driver 580.65.06, CUDA 13.0"), "{text}");
    assert_eq!(matrix_row(&text, "GPU0"), ["GPU0", "X", "NV18"]);
    assert_eq!(matrix_row(&text, "GPU1"), ["GPU1", "NV18", "X"]);
    assert!(text.contains("0000:9a:00.0"), "{text}");
    assert!(text.contains("sm_90"), "{text}");
    assert!(text.contains("mlx5_0"), "{text}");
    assert!(text.contains("CUDA_DEVICE_ORDER=PCI_BUS_ID"), "{text}");
    let ib0 = text.lines().find(|l| l.contains("ib0")).unwrap();
    assert!(
        ib0.ends_with("rdma: mlx5_0  GPU0:switch GPU1:sys"),
        "{text}"
    );
    assert!(text.contains("NIC-to-GPU distance: switch = "), "{text}");
}

#[test]
fn render_nic_without_rdma_has_no_distances() {
    let mut topo = nvlinked_pair();
    let nic = &mut topo.nics[0];
    nic.name = "eth0".to_owned();
    nic.kind = NicKind::Ethernet;
    nic.rdma_devices.clear();
    nic.gpu_distances.clear();
    let text = topo.render_text();
    let eth0 = text.lines().find(|l| l.contains("eth0")).unwrap();
    assert!(eth0.ends_with("rdma: -"), "{text}");
    assert!(!text.contains("GPU0:"), "{text}");
    assert!(!text.contains("NIC-to-GPU distance"), "{text}");
}

#[test]
fn render_pcie_matrix() {
    let text = pcie_triple().render_text();
    assert_eq!(matrix_row(&text, "GPU0"), ["GPU0", "X", "PIX", "SYS"]);
    assert_eq!(matrix_row(&text, "GPU1"), ["GPU1", "PIX", "X", "?"]);
    assert!(text.contains("GPU1 -> GPU2: query failed"), "{text}");
    assert!(text.contains("NICs: none found"), "{text}");
}

#[test]
fn render_unavailable() {
    let topo = Topology {
        nvml: NvmlStatus::Unavailable {
            reason: "libnvidia-ml.so.1 could not be loaded".to_owned(),
        },
        gpus: Vec::new(),
        links: Vec::new(),
        nics: Vec::new(),
    };
    let text = topo.render_text();
    assert!(
        text.contains("No NVIDIA GPUs / NVML not found: libnvidia-ml.so.1 could not be loaded"),
        "{text}"
    );
    assert!(!text.contains("GPU interconnect"), "{text}");
}

#[test]
fn json_shape() {
    let topo = nvlinked_pair();
    let json: serde_json::Value = serde_json::from_str(&topo.to_json()).unwrap();
    assert_eq!(json["nvml"]["status"], "available");
    assert_eq!(json["nvml"]["cuda_driver_version"], "13.0");
    assert_eq!(json["gpus"][1]["pci_bus_id"], "0000:9a:00.0");
    assert_eq!(
        json["gpus"][0]["compute_capability"],
        serde_json::json!([9, 0])
    );
    assert_eq!(json["gpus"][0]["numa_node"], 0);
    assert_eq!(json["links"][0][0], serde_json::json!({ "kind": "self" }));
    assert_eq!(
        json["links"][0][1],
        serde_json::json!({ "kind": "nvlink", "links": 18 })
    );
    assert_eq!(json["nics"][0]["kind"], "infiniband");
    assert_eq!(
        json["nics"][0]["rdma_devices"],
        serde_json::json!(["mlx5_0"])
    );
    assert_eq!(
        json["nics"][0]["gpu_distances"],
        serde_json::json!([
            { "gpu": 0, "distance": "same_switch" },
            { "gpu": 1, "distance": "other_numa_node" },
        ])
    );

    let pcie: serde_json::Value = serde_json::from_str(&pcie_triple().to_json()).unwrap();
    assert_eq!(
        pcie["links"][0][1],
        serde_json::json!({ "kind": "pcie", "path": "PIX" })
    );
    assert_eq!(
        pcie["links"][1][2],
        serde_json::json!({ "kind": "unknown", "reason": "query failed" })
    );

    let unavailable = Topology {
        nvml: NvmlStatus::Unavailable {
            reason: "r".to_owned(),
        },
        gpus: Vec::new(),
        links: Vec::new(),
        nics: Vec::new(),
    };
    let v: serde_json::Value = serde_json::from_str(&unavailable.to_json()).unwrap();
    assert_eq!(
        v["nvml"],
        serde_json::json!({ "status": "unavailable", "reason": "r" })
    );
}

#[test]
fn json_round_trip() {
    for topo in [nvlinked_pair(), pcie_triple()] {
        let back: Topology = serde_json::from_str(&topo.to_json()).unwrap();
        assert_eq!(back, topo);
    }
}

#[test]
fn json_without_gpu_distances_still_reads() {
    let mut json: serde_json::Value = serde_json::from_str(&nvlinked_pair().to_json()).unwrap();
    let nic = json["nics"][0].as_object_mut().unwrap();
    nic.remove("gpu_distances");
    let back: Topology = serde_json::from_value(json).unwrap();
    assert!(back.nics[0].gpu_distances.is_empty());
    assert_eq!(back.nics[0].rdma_devices, ["mlx5_0"]);
}

#[test]
fn nvlink_count_and_bus_id_lookup() {
    let topo = nvlinked_pair();
    assert_eq!(topo.nvlink_count(0, 1), 18);
    assert_eq!(topo.nvlink_count(1, 0), 18);
    assert_eq!(topo.nvlink_count(0, 0), 0);
    assert_eq!(topo.nvlink_count(0, 7), 0);
    assert_eq!(pcie_triple().nvlink_count(0, 1), 0);

    assert_eq!(
        topo.gpu_by_pci_bus_id("00000000:9A:00.0").map(|g| g.index),
        Some(1)
    );
    assert_eq!(topo.gpu_by_pci_bus_id("18:00.0").map(|g| g.index), Some(0));
    assert!(topo.gpu_by_pci_bus_id("0000:3b:00.0").is_none());
    assert!(topo.gpu_by_pci_bus_id("").is_none());
}

#[test]
fn short_names_and_normalisation() {
    let all = [
        (PciPath::SameSwitch, "PIX"),
        (PciPath::MultipleSwitches, "PXB"),
        (PciPath::HostBridge, "PHB"),
        (PciPath::SameNuma, "NODE"),
        (PciPath::CrossNuma, "SYS"),
    ];
    for (path, name) in all {
        assert_eq!(path.short_name(), name);
        assert_eq!(serde_json::to_value(path).unwrap(), name);
    }
    assert_eq!(normalize_pci_bus_id("00000000:18:00.0"), "0000:18:00.0");
}
