//! PCI bus id spelling and sysfs PCI lookups.

use std::path::Path;

/// Normalises a PCI bus id to sysfs form, lower-case "dddd:bb:dd.f" (e.g. "0000:18:00.0").
///
/// Accepts NVML's "00000000:18:00.0", sysfs's "0000:18:00.0" and a domain-less "18:00.0", in
/// any case. A string that is not a bus id comes back trimmed and lower-cased, so comparisons
/// of normalised ids stay meaningful.
pub fn normalize_pci_bus_id(bus_id: &str) -> String {
    let trimmed = bus_id.trim().to_ascii_lowercase();
    parse(&trimmed).unwrap_or(trimmed)
}

/// Whether `name` is a PCI bus id (a sysfs directory name under /sys/bus/pci/devices).
pub(crate) fn is_pci_bus_id(name: &str) -> bool {
    parse(&name.to_ascii_lowercase()).is_some()
}

fn parse(s: &str) -> Option<String> {
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [domain, bus, devfn] => (u32::from_str_radix(domain, 16).ok()?, *bus, *devfn),
        [bus, devfn] => (0, *bus, *devfn),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    // Device is 5 bits and function 3 bits in PCI addressing.
    if dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// NUMA node from a sysfs `numa_node` file; -1 (no NUMA affinity) and unreadable give `None`.
pub(crate) fn read_numa_node(file: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(file).ok()?;
    text.trim().parse::<i32>().ok().filter(|n| *n >= 0)
}

/// NUMA node of the PCI device `bus_id` under `sysfs_root` (normally "/sys").
pub(crate) fn numa_node_of(sysfs_root: &Path, bus_id: &str) -> Option<i32> {
    if bus_id.is_empty() {
        return None;
    }
    read_numa_node(
        &sysfs_root
            .join("bus/pci/devices")
            .join(bus_id)
            .join("numa_node"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_common_spellings() {
        assert_eq!(normalize_pci_bus_id("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_pci_bus_id("0000:18:00.0"), "0000:18:00.0");
        assert_eq!(normalize_pci_bus_id("00000000:9A:00.0"), "0000:9a:00.0");
        assert_eq!(normalize_pci_bus_id(" 18:00.1\n"), "0000:18:00.1");
        assert_eq!(normalize_pci_bus_id("00000001:0B:1F.7"), "0001:0b:1f.7");
    }

    #[test]
    fn non_bus_ids_pass_through_lower_cased() {
        assert_eq!(normalize_pci_bus_id("Virtio0"), "virtio0");
        assert_eq!(normalize_pci_bus_id("0000:18:00"), "0000:18:00");
        assert_eq!(normalize_pci_bus_id("0000:18:20.0"), "0000:18:20.0"); // device > 0x1f
        assert!(!is_pci_bus_id("pci0000:00"));
        assert!(is_pci_bus_id("0000:00:03.0"));
    }

    #[test]
    fn numa_minus_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("numa_node");
        std::fs::write(&f, "-1\n").unwrap();
        assert_eq!(read_numa_node(&f), None);
        std::fs::write(&f, "1\n").unwrap();
        assert_eq!(read_numa_node(&f), Some(1));
        assert_eq!(read_numa_node(&dir.path().join("missing")), None);
    }
}
