//! detect_nics_in against a fake sysfs tree.

use mori_topology::{NicKind, detect_nics_in};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// A net interface directory with the given attribute files.
fn iface(root: &Path, name: &str, files: &[(&str, &str)], device: Option<&Path>) {
    let dir = root.join("class/net").join(name);
    fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        write(&dir.join(file), text);
    }
    if let Some(device) = device {
        symlink(device, dir.join("device")).unwrap();
    }
}

fn fake_sysfs(root: &Path) {
    let pci = root.join("devices/pci0000:00");
    let eth_dev = pci.join("0000:00:01.0/0000:18:00.0");
    let ib_dev = pci.join("0000:00:02.0/0000:3B:00.0");
    let other_ib_dev = pci.join("0000:00:02.0/0000:3c:00.0");
    let virtio_pci = pci.join("0000:00:03.0");
    let virtio_dev = virtio_pci.join("virtio0");
    write(&eth_dev.join("numa_node"), "0\n");
    write(&ib_dev.join("numa_node"), "1\n");
    write(&other_ib_dev.join("numa_node"), "1\n");
    write(&virtio_pci.join("numa_node"), "-1\n");
    fs::create_dir_all(&virtio_dev).unwrap();

    iface(
        root,
        "eth0",
        &[
            ("type", "1\n"),
            ("speed", "100000\n"),
            ("operstate", "up\n"),
        ],
        Some(&eth_dev),
    );
    iface(
        root,
        "ib0",
        &[
            ("type", "32\n"),
            ("speed", "400000\n"),
            ("operstate", "up\n"),
        ],
        Some(&ib_dev),
    );
    // Link down: the kernel reports -1.
    iface(
        root,
        "ens3",
        &[("type", "1\n"), ("speed", "-1\n"), ("operstate", "down\n")],
        Some(&virtio_dev),
    );
    // `speed` unreadable (the kernel answers EINVAL; here a directory stands in for that).
    iface(
        root,
        "eth1",
        &[("type", "1\n"), ("operstate", "down\n")],
        Some(&eth_dev),
    );
    fs::create_dir_all(root.join("class/net/eth1/speed")).unwrap();
    // Virtual: no device link.
    iface(
        root,
        "docker0",
        &[("type", "1\n"), ("operstate", "up\n")],
        None,
    );
    iface(
        root,
        "lo",
        &[("type", "772\n"), ("operstate", "unknown\n")],
        None,
    );

    let ib = root.join("class/infiniband");
    fs::create_dir_all(ib.join("mlx5_0")).unwrap();
    fs::create_dir_all(ib.join("mlx5_1")).unwrap();
    symlink(&ib_dev, ib.join("mlx5_0/device")).unwrap();
    symlink(&other_ib_dev, ib.join("mlx5_1/device")).unwrap();
}

#[test]
fn lists_physical_nics_only() {
    let tmp = tempfile::tempdir().unwrap();
    fake_sysfs(tmp.path());
    let nics = detect_nics_in(tmp.path());
    let names: Vec<&str> = nics.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["ens3", "eth0", "eth1", "ib0"]);
}

#[test]
fn ethernet_nic_fields() {
    let tmp = tempfile::tempdir().unwrap();
    fake_sysfs(tmp.path());
    let nics = detect_nics_in(tmp.path());
    let eth0 = nics.iter().find(|n| n.name == "eth0").unwrap();
    assert_eq!(eth0.kind, NicKind::Ethernet);
    assert_eq!(eth0.pci_bus_id.as_deref(), Some("0000:18:00.0"));
    assert_eq!(eth0.numa_node, Some(0));
    assert_eq!(eth0.speed_mbps, Some(100_000));
    assert_eq!(eth0.operstate, "up");
    assert!(eth0.rdma_devices.is_empty());
}

#[test]
fn infiniband_nic_has_its_rdma_device() {
    let tmp = tempfile::tempdir().unwrap();
    fake_sysfs(tmp.path());
    let nics = detect_nics_in(tmp.path());
    let ib0 = nics.iter().find(|n| n.name == "ib0").unwrap();
    assert_eq!(ib0.kind, NicKind::InfiniBand);
    assert_eq!(ib0.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
    assert_eq!(ib0.numa_node, Some(1));
    assert_eq!(ib0.speed_mbps, Some(400_000));
    assert_eq!(ib0.rdma_devices, ["mlx5_0"]);
}

#[test]
fn unknown_speed_and_numa_are_none() {
    let tmp = tempfile::tempdir().unwrap();
    fake_sysfs(tmp.path());
    let nics = detect_nics_in(tmp.path());
    let ens3 = nics.iter().find(|n| n.name == "ens3").unwrap();
    assert_eq!(ens3.speed_mbps, None);
    // virtio0 has no PCI name; its PCI parent does, with numa_node -1.
    assert_eq!(ens3.pci_bus_id.as_deref(), Some("0000:00:03.0"));
    assert_eq!(ens3.numa_node, None);
    assert_eq!(ens3.operstate, "down");

    let eth1 = nics.iter().find(|n| n.name == "eth1").unwrap();
    assert_eq!(eth1.speed_mbps, None);
    assert_eq!(eth1.numa_node, Some(0));
}

#[test]
fn missing_tree_gives_no_nics() {
    let tmp = tempfile::tempdir().unwrap();
    assert!(detect_nics_in(&tmp.path().join("nope")).is_empty());
}
