//! detect() on a machine without NVIDIA GPUs / NVML (this CI box) must report, not panic.

use mori_topology::{NvmlStatus, detect};

#[test]
fn detect_without_nvml_reports_unavailable() {
    let topo = detect();
    let NvmlStatus::Unavailable { reason } = &topo.nvml else {
        // A machine with a working NVML runs this too; then the matrix must be square.
        assert_eq!(topo.links.len(), topo.gpus.len());
        assert!(topo.links.iter().all(|row| row.len() == topo.gpus.len()));
        return;
    };
    assert!(!reason.is_empty());
    assert!(topo.gpus.is_empty());
    assert!(topo.links.is_empty());
    let text = topo.render_text();
    assert!(text.contains("No NVIDIA GPUs / NVML not found"), "{text}");
    assert!(text.contains(reason.as_str()), "{text}");
    let json: serde_json::Value = serde_json::from_str(&topo.to_json()).unwrap();
    assert_eq!(json["nvml"]["status"], "unavailable");
}
