//! Inventory and health: what the `gpus`, `system` and `drivers` sections of NodeInventory
//! v1 mean for a node: its devices (stable GPU names) and atoms, its inventory labels, its
//! hardware identifiers, and its health conditions.
//!
//! # Health table
//!
//! Every condition below has the NoSchedule effect: while `true`, its type is in
//! `noScheduleReasons`. Each is recomputed from every `gpus` report, so it clears (with its
//! reason, in the same transaction) as soon as the evidence is gone.
//!
//! | evidence (per GPU, since driver load) | condition | what clears it |
//! | --- | --- | --- |
//! | GPU count differs from the pool's hardware profile | `GpuCountMismatch` | the right number of GPUs reported |
//! | XID 48 (double-bit ECC), 63 (row remap pending), 74 (NVLink), 92 (high SBE rate), 94 (contained ECC); or volatile uncorrectable ECC errors | `GpuNeedsReset` | `gpu.reset` (the driver reloads, the counters restart) |
//! | XID 79 (fallen off the bus), 95 (uncontained ECC), 119/120 (GSP errors) | `GpuNeedsReboot` | `node.reboot` |
//! | XID 64 (row remap failed), or 60+ retired pages | `GpuNeedsPerson` | a person replaces the GPU |
//!
//! Application XIDs (13, 31, 43, 45: a workload's own fault) set nothing.

use serde::Deserialize;
use std::collections::BTreeMap;

use crate::axes::ConditionStatus;

/// XIDs a GPU reset recovers from.
pub const RESET_XIDS: &[u32] = &[48, 63, 74, 92, 94];
/// XIDs only a reboot recovers from.
pub const REBOOT_XIDS: &[u32] = &[79, 95, 119, 120];
/// XIDs that need a person (hardware replacement).
pub const PERSON_XIDS: &[u32] = &[64];
/// NVIDIA's RMA threshold for retired pages on one GPU.
pub const RETIRED_PAGES_LIMIT: u64 = 60;

/// The label prefix the Inventory controller owns; operators' labels never use it.
pub const INVENTORY_LABEL_PREFIX: &str = "inventory.bettercompute.io/";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct XidCount {
    xid: u32,
    #[serde(default)]
    count: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EccErrors {
    #[serde(default)]
    volatile_uncorrectable: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GpuReport {
    index: u32,
    uuid: String,
    pci_bus_id: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    memory_mi_b: Option<u64>,
    #[serde(default)]
    serial: Option<String>,
    #[serde(default)]
    ecc_errors: EccErrors,
    #[serde(default)]
    retired_pages: u64,
    #[serde(default)]
    xid_errors: Vec<XidCount>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct GpusSection {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    driver_version: Option<String>,
    #[serde(default)]
    cuda_version: Option<String>,
    devices: Vec<GpuReport>,
}

/// The kind of every device today. Devices are stored with a kind so that other kinds (NICs,
/// GPU partitions) can join them without a new table.
pub const GPU_DEVICE_KIND: &str = "gpu";

/// One GPU as the control plane names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// `gpu0`, `gpu1`, … in PCI bus order: stable across reboots and driver reloads, unlike
    /// the driver's index.
    pub name: String,
    pub uuid: String,
    pub pci_bus_id: String,
    pub model: String,
    pub memory_mib: u64,
    pub serial: Option<String>,
    /// The schedulable unit on it (one whole GPU).
    pub atom: String,
    /// No health evidence against it.
    pub healthy: bool,
}

/// A condition the report implies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionReport {
    pub kind: &'static str,
    pub status: ConditionStatus,
    pub reason: String,
    pub message: String,
}

/// What a node's inventory says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryFacts {
    pub devices: Vec<Device>,
    pub labels: BTreeMap<String, String>,
    pub conditions: Vec<ConditionReport>,
}

/// Why a section could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inventory section `{section}` is malformed: {message}")]
pub struct InventoryError {
    pub section: &'static str,
    pub message: String,
}

/// Label values are at most 63 of `[A-Za-z0-9._-]`; anything else becomes `-`.
fn label_value(raw: &str) -> String {
    let mut value: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    value.truncate(crate::node::MAX_LABEL_PART_LEN);
    value
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// Reads the `gpus` section against the pool's expected GPU count (if it has one).
pub fn interpret_gpus(
    section: &serde_json::Value,
    expected_gpus: Option<u32>,
) -> Result<InventoryFacts, InventoryError> {
    let gpus: GpusSection =
        serde_json::from_value(section.clone()).map_err(|e| InventoryError {
            section: "gpus",
            message: e.to_string(),
        })?;
    let mut reports = gpus.devices;
    reports.sort_by(|a, b| a.pci_bus_id.cmp(&b.pci_bus_id));

    let mut needs_reset = Vec::new();
    let mut needs_reboot = Vec::new();
    let mut needs_person = Vec::new();
    let mut devices = Vec::with_capacity(reports.len());
    for (position, gpu) in reports.iter().enumerate() {
        let name = format!("gpu{position}");
        let xids: Vec<u32> = gpu
            .xid_errors
            .iter()
            .filter(|x| x.count > 0)
            .map(|x| x.xid)
            .collect();
        let mut healthy = true;
        for xid in &xids {
            let list = if RESET_XIDS.contains(xid) {
                &mut needs_reset
            } else if REBOOT_XIDS.contains(xid) {
                &mut needs_reboot
            } else if PERSON_XIDS.contains(xid) {
                &mut needs_person
            } else {
                continue;
            };
            list.push(format!("{name} (index {}): XID {xid}", gpu.index));
            healthy = false;
        }
        if gpu.ecc_errors.volatile_uncorrectable > 0 {
            needs_reset.push(format!(
                "{name}: {} uncorrectable ECC errors",
                gpu.ecc_errors.volatile_uncorrectable
            ));
            healthy = false;
        }
        if gpu.retired_pages >= RETIRED_PAGES_LIMIT {
            needs_person.push(format!("{name}: {} retired pages", gpu.retired_pages));
            healthy = false;
        }
        devices.push(Device {
            atom: format!("{name}/whole"),
            name,
            uuid: gpu.uuid.clone(),
            pci_bus_id: gpu.pci_bus_id.clone(),
            model: gpu
                .name
                .clone()
                .or_else(|| gpus.model.clone())
                .unwrap_or_else(|| "unknown".into()),
            memory_mib: gpu.memory_mi_b.unwrap_or(0),
            serial: gpu.serial.clone(),
            healthy,
        });
    }

    let count = devices.len();
    let mut labels = BTreeMap::from([(
        format!("{INVENTORY_LABEL_PREFIX}gpu-count"),
        count.to_string(),
    )]);
    if let Some(model) = gpus
        .model
        .as_deref()
        .or_else(|| devices.first().map(|d| d.model.as_str()))
    {
        labels.insert(
            format!("{INVENTORY_LABEL_PREFIX}gpu-model"),
            label_value(model),
        );
    }
    if let Some(driver) = &gpus.driver_version {
        labels.insert(
            format!("{INVENTORY_LABEL_PREFIX}gpu-driver"),
            label_value(driver),
        );
    }
    if let Some(cuda) = &gpus.cuda_version {
        labels.insert(format!("{INVENTORY_LABEL_PREFIX}cuda"), label_value(cuda));
    }

    let evidence = |kind: &'static str, found: Vec<String>, clear: &str| ConditionReport {
        kind,
        status: if found.is_empty() {
            ConditionStatus::False
        } else {
            ConditionStatus::True
        },
        reason: if found.is_empty() {
            "NoEvidence".into()
        } else {
            "GpuErrors".into()
        },
        message: if found.is_empty() {
            String::new()
        } else {
            format!("{}; cleared by {clear}", found.join("; "))
        },
    };
    let mut conditions = vec![
        evidence("GpuNeedsReset", needs_reset, "gpu.reset"),
        evidence("GpuNeedsReboot", needs_reboot, "node.reboot"),
        evidence("GpuNeedsPerson", needs_person, "replacing the GPU"),
    ];
    conditions.push(match expected_gpus {
        Some(expected) if expected as usize != count => ConditionReport {
            kind: "GpuCountMismatch",
            status: ConditionStatus::True,
            reason: format!("Expected{expected}Got{count}"),
            message: format!(
                "the pool expects {expected} GPUs per machine; this one reports {count}"
            ),
        },
        Some(expected) => ConditionReport {
            kind: "GpuCountMismatch",
            status: ConditionStatus::False,
            reason: format!("Expected{expected}Got{count}"),
            message: String::new(),
        },
        None => ConditionReport {
            kind: "GpuCountMismatch",
            status: ConditionStatus::Unknown,
            reason: "NoHardwareProfile".into(),
            message: "the pool sets no expected GPU count".into(),
        },
    });
    Ok(InventoryFacts {
        devices,
        labels,
        conditions,
    })
}

/// The identifiers in the `system` section (and MACs from `network`), named as
/// [`crate::hardware::hardware_key`] expects.
pub fn identifiers(
    system: Option<&serde_json::Value>,
    network: Option<&serde_json::Value>,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    if let Some(system) = system {
        for (field, kind) in [
            ("systemUuid", "system-uuid"),
            ("boardSerial", "board-serial"),
            ("chassisSerial", "chassis-serial"),
        ] {
            if let Some(value) = system.get(field).and_then(serde_json::Value::as_str) {
                out.insert(kind.to_owned(), value.to_owned());
            }
        }
    }
    if let Some(interfaces) = network
        .and_then(|n| n.get("interfaces"))
        .and_then(serde_json::Value::as_array)
    {
        for interface in interfaces {
            if let (Some(name), Some(mac)) = (
                interface.get("name").and_then(|v| v.as_str()),
                interface.get("mac").and_then(|v| v.as_str()),
            ) {
                out.insert(format!("mac:{name}"), mac.to_owned());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpus(count: usize, xids: &[(usize, u32)]) -> serde_json::Value {
        let devices: Vec<_> = (0..count)
            .map(|i| {
                let xid_errors: Vec<_> = xids.iter().filter(|(g, _)| *g == i).map(|(_, x)| json!({"xid": x, "count": 1})).collect();
                json!({
                    "index": i, "uuid": format!("GPU-{i}"), "pciBusId": format!("00000000:{:02x}:00.0", 0x90 - i),
                    "name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "xidErrors": xid_errors,
                    "eccErrors": {"volatileUncorrectable": 0}, "retiredPages": 0,
                })
            })
            .collect();
        json!({"count": count, "model": "NVIDIA H100 80GB HBM3", "driverVersion": "550.54.15", "cudaVersion": "12.4", "devices": devices})
    }

    fn status(facts: &InventoryFacts, kind: &str) -> ConditionStatus {
        facts
            .conditions
            .iter()
            .find(|c| c.kind == kind)
            .map(|c| c.status)
            .expect("condition present")
    }

    #[test]
    fn gpus_are_named_in_bus_order_with_labels() {
        let facts = interpret_gpus(&gpus(8, &[]), Some(8)).expect("valid");
        assert_eq!(facts.devices.len(), 8);
        // Index 7 sits on the lowest bus, so it is gpu0.
        assert_eq!(facts.devices[0].uuid, "GPU-7");
        assert_eq!(facts.devices[0].atom, "gpu0/whole");
        assert_eq!(
            facts.labels["inventory.bettercompute.io/gpu-model"],
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(facts.labels["inventory.bettercompute.io/gpu-count"], "8");
        for kind in [
            "GpuNeedsReset",
            "GpuNeedsReboot",
            "GpuNeedsPerson",
            "GpuCountMismatch",
        ] {
            assert_eq!(status(&facts, kind), ConditionStatus::False, "{kind}");
        }
    }

    #[test]
    fn seven_of_eight_gpus_is_a_count_mismatch() {
        let facts = interpret_gpus(&gpus(7, &[]), Some(8)).expect("valid");
        assert_eq!(status(&facts, "GpuCountMismatch"), ConditionStatus::True);
        assert_eq!(
            facts
                .conditions
                .iter()
                .find(|c| c.kind == "GpuCountMismatch")
                .map(|c| c.reason.as_str()),
            Some("Expected8Got7")
        );
        assert_eq!(
            status(
                &interpret_gpus(&gpus(7, &[]), None).expect("valid"),
                "GpuCountMismatch"
            ),
            ConditionStatus::Unknown
        );
    }

    #[test]
    fn xids_map_to_their_remedy_and_application_xids_to_nothing() {
        let facts = interpret_gpus(&gpus(8, &[(0, 79), (1, 48), (2, 13), (3, 64)]), Some(8))
            .expect("valid");
        assert_eq!(status(&facts, "GpuNeedsReboot"), ConditionStatus::True);
        assert_eq!(status(&facts, "GpuNeedsReset"), ConditionStatus::True);
        assert_eq!(status(&facts, "GpuNeedsPerson"), ConditionStatus::True);
        assert_eq!(facts.devices.iter().filter(|d| !d.healthy).count(), 3);
        let only_app = interpret_gpus(&gpus(8, &[(2, 13), (5, 43)]), Some(8)).expect("valid");
        assert!(
            only_app
                .conditions
                .iter()
                .all(|c| c.status != ConditionStatus::True)
        );
    }

    #[test]
    fn malformed_sections_are_refused() {
        assert!(interpret_gpus(&json!({"devices": "many"}), Some(8)).is_err());
        assert!(interpret_gpus(&json!({}), Some(8)).is_err());
    }

    #[test]
    fn identifiers_come_from_system_and_network() {
        let ids = identifiers(
            Some(
                &json!({"systemUuid": "4c4c4544-0042-3510-8051-b7c04f4e3732", "boardSerial": "CN1"}),
            ),
            Some(&json!({"interfaces": [{"name": "eno1", "mac": "b8:ce:f6:00:00:01"}]})),
        );
        assert_eq!(ids.len(), 3);
        assert!(crate::hardware::hardware_key(&ids).trusted);
    }
}
