//! Inventory and health: what the sections of NodeInventory v1 mean for a node: its devices
//! (stable GPU names) and atoms, its inventory labels, its hardware identifiers, its health
//! conditions and how it compares with its pool's hardware profile ([`interpret`]).
//!
//! # Inventory labels
//!
//! Every section becomes labels under [`INVENTORY_LABEL_PREFIX`], replaced on every report
//! and owned by inventory (an operator's `labelNode` cannot set or remove them), so that
//! selectors and filters can ask for hardware the way Kubernetes' node-feature-discovery
//! labels (`feature.node.kubernetes.io/…`) or Ironic's inspection data allow:
//!
//! | section | labels |
//! | --- | --- |
//! | `gpus` | `gpu-count`, `gpu-model`, `gpu-memory-mib`, `gpu-driver`, `cuda` |
//! | `cpu` | `cpu-model`, `cpu-arch`, `cpu-sockets`, `cpu-cores`, `cpu-threads`, `numa-nodes` |
//! | `memory` | `memory-gib`, `memory-type`, `memory-speed-mts` |
//! | `disks` | `disk-count`, `disk-total-gib` |
//! | `drivers` | `driver-<name>` for each driver (`driver-nvidia`, `driver-ofed`, …), at most [`MAX_DRIVER_LABELS`] |
//!
//! Values are made label-safe (at most 63 of `[A-Za-z0-9._-]`, anything else `-`); a field a
//! section lacks (or reports with another type) gives no label. Only a malformed `gpus`
//! section is refused: the other sections describe and never decide, so a daemon that words
//! them differently loses a label, not its session.
//!
//! # Expectations
//!
//! | compared with the pool's | condition | `true` when |
//! | --- | --- | --- |
//! | expected GPU count | `GpuCountMismatch` | the `gpus` report has another number of GPUs |
//! | expected GPU model | `GpuModelMismatch` | a GPU is another model ([`model_matches`]), or there is none |
//! | expected driver version | `DriverVersionMismatch` | the driver (`gpus.driverVersion`, else `drivers.nvidia`) is another version ([`driver_matches`]), or there is none |
//!
//! All three are NoSchedule and clear with their evidence: the next report (or a change of
//! the pool's expectations, which re-reads the stored reports) that agrees. Without an
//! expectation they are `unknown` (`NoExpectation`).
//!
//! # Health table
//!
//! Every condition below has the NoSchedule effect: while `true`, its type is in
//! `noScheduleReasons`. Each is computed from every `gpus` report, which can raise it; what
//! clears it is its [`crate::clear::ClearRule`] (declared once, in `clear.rs`): only
//! `GpuCountMismatch` clears when a report no longer shows its evidence. The others clear
//! only on proof or by hand; a report without their evidence records that the evidence is
//! gone (`node.condition_evidence_gone`), and evidence that comes back restarts the proof.
//! Health remediation (`remediation.rs`, per pool) runs the commands that prove them.
//!
//! | evidence (per GPU, since driver load) | condition | what clears it (its `clearWhen`) |
//! | --- | --- | --- |
//! | GPU count differs from the pool's hardware profile | `GpuCountMismatch` | a `gpus` report with the right number of GPUs |
//! | XID 48 (double-bit ECC), 63 (row remap pending), 74 (NVLink), 92 (high SBE rate), 94 (contained ECC); or volatile uncorrectable ECC errors | `GpuNeedsReset` | `gpu.reset` (or `node.reboot`) succeeds on the node, then `diag.nvml` level ≥ 1 passes, both after the condition was raised |
//! | XID 79 (fallen off the bus), 95 (uncontained ECC), 119/120 (GSP errors) | `GpuNeedsReboot` | `node.reboot` succeeds, then `diag.nvml` level ≥ 1 passes |
//! | XID 64 (row remap failed), or 60+ retired pages; or remediation that gave up | `GpuNeedsPerson` | only an operator, by hand, with a reason (`clearNodeCondition`), after replacing the GPU |
//!
//! Any of them may also be cleared by hand by an operator, with a reason of their own; the
//! event names the operator and keeps the reason.
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
/// Driver labels per node at most: a machine has a handful of drivers worth selecting on,
/// and a daemon listing every kernel module must not grow a node by hundreds of labels.
pub const MAX_DRIVER_LABELS: usize = 16;

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
    /// Its GPUs, once it reported a `gpus` section (`None` before: nothing is known yet).
    pub devices: Option<Vec<Device>>,
    /// Every inventory label of the reported sections (the whole set: labels under the
    /// prefix that are not here are stale).
    pub labels: BTreeMap<String, String>,
    /// The conditions the reported sections decide.
    pub conditions: Vec<ConditionReport>,
}

/// What a `gpus` section says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuFacts {
    pub devices: Vec<Device>,
    pub labels: BTreeMap<String, String>,
    pub conditions: Vec<ConditionReport>,
    /// The driver version NVML reported.
    pub driver_version: Option<String>,
}

/// Why a section could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("inventory section `{section}` is malformed: {message}")]
pub struct InventoryError {
    pub section: &'static str,
    pub message: String,
}

/// Label values are at most 63 of `[A-Za-z0-9._-]`; any run of other characters becomes
/// one `-` (`Intel(R) Xeon(R)` is `Intel-R-Xeon-R`).
fn label_value(raw: &str) -> String {
    let mut value = String::with_capacity(raw.len());
    for c in raw.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            value.push(c);
        } else if !value.ends_with('-') {
            value.push('-');
        }
    }
    value.truncate(crate::node::MAX_LABEL_PART_LEN);
    value
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// A label key's name part from free text: lower case `[a-z0-9-]`, at most `max` long.
fn label_name(raw: &str, max: usize) -> String {
    let mut name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    name.truncate(max);
    name.trim_matches('-').to_owned()
}

/// Whether a GPU's reported model is the model a pool expects: compared as labels spell
/// them, ignoring case, so `NVIDIA H100 80GB HBM3` and `nvidia-h100-80gb-hbm3` are one model.
/// Never a substring: an `H100 PCIe` is not the `H100 80GB HBM3` a pool of SXM boards expects.
pub fn model_matches(expected: &str, reported: &str) -> bool {
    label_value(expected).eq_ignore_ascii_case(&label_value(reported))
}

/// Whether a reported driver version is the one a pool expects: the same version, or one
/// that `expected` is a prefix of in whole components (`550` and `550.54` both accept
/// `550.54.15`; `55` does not), so a pool can pin a driver branch or an exact build.
pub fn driver_matches(expected: &str, reported: &str) -> bool {
    let (expected, reported) = (expected.trim(), reported.trim());
    reported == expected
        || reported
            .strip_prefix(expected)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// Reads every reported section (by name) against the pool's hardware profile: labels from
/// all of them, devices and health from `gpus`, and the comparisons with the profile.
pub fn interpret(
    sections: &BTreeMap<String, serde_json::Value>,
    profile: &crate::catalog::HardwareProfile,
) -> Result<InventoryFacts, InventoryError> {
    let gpus = sections
        .get("gpus")
        .map(|g| interpret_gpus(g, profile))
        .transpose()?;
    let mut labels = BTreeMap::new();
    let mut conditions = Vec::new();
    if let Some(cpu) = sections.get("cpu") {
        labels.extend(cpu_labels(cpu));
    }
    if let Some(memory) = sections.get("memory") {
        labels.extend(memory_labels(memory));
    }
    if let Some(disks) = sections.get("disks") {
        labels.extend(disk_labels(disks));
    }
    let drivers = sections.get("drivers");
    if let Some(drivers) = drivers {
        labels.extend(driver_labels(drivers));
    }
    let nvidia = gpus
        .as_ref()
        .and_then(|g| g.driver_version.clone())
        .or_else(|| {
            drivers
                .and_then(|d| d.get("nvidia"))
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned)
        });
    // Judged once something that reports the driver arrived; before that, nothing is known.
    if gpus.is_some() || drivers.is_some() {
        conditions.push(driver_condition(
            profile.driver_version.as_deref(),
            nvidia.as_deref(),
        ));
    }
    let devices = gpus.map(|g| {
        labels.extend(g.labels);
        conditions.extend(g.conditions);
        g.devices
    });
    Ok(InventoryFacts {
        devices,
        labels,
        conditions,
    })
}

/// `DriverVersionMismatch` for the NVIDIA driver a machine reports (if any).
fn driver_condition(expected: Option<&str>, reported: Option<&str>) -> ConditionReport {
    let condition = |status, reason: &str, message: String| ConditionReport {
        kind: crate::clear::DRIVER_VERSION_MISMATCH,
        status,
        reason: reason.to_owned(),
        message,
    };
    match (expected, reported) {
        (None, _) => condition(
            ConditionStatus::Unknown,
            "NoExpectation",
            "the pool expects no driver version".into(),
        ),
        (Some(expected), None) => condition(
            ConditionStatus::True,
            "NoDriver",
            format!("the pool expects NVIDIA driver {expected}; this machine reports none"),
        ),
        (Some(expected), Some(reported)) if !driver_matches(expected, reported) => condition(
            ConditionStatus::True,
            "UnexpectedVersion",
            format!("the pool expects NVIDIA driver {expected}; this machine runs {reported}"),
        ),
        (Some(_), Some(_)) => condition(ConditionStatus::False, "AsExpected", String::new()),
    }
}

/// `GpuModelMismatch` for a machine's GPUs.
fn model_condition(expected: Option<&str>, devices: &[Device]) -> ConditionReport {
    let condition = |status, reason: &str, message: String| ConditionReport {
        kind: crate::clear::GPU_MODEL_MISMATCH,
        status,
        reason: reason.to_owned(),
        message,
    };
    let Some(expected) = expected else {
        return condition(
            ConditionStatus::Unknown,
            "NoExpectation",
            "the pool expects no GPU model".into(),
        );
    };
    if devices.is_empty() {
        return condition(
            ConditionStatus::True,
            "NoGpus",
            format!("the pool expects {expected} GPUs; this machine reports none"),
        );
    }
    // The GPUs of each other model, named: "gpu3 is NVIDIA A100-SXM4-80GB".
    let mut others: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for device in devices
        .iter()
        .filter(|d| !model_matches(expected, &d.model))
    {
        others
            .entry(device.model.as_str())
            .or_default()
            .push(device.name.as_str());
    }
    if others.is_empty() {
        return condition(ConditionStatus::False, "AsExpected", String::new());
    }
    let found: Vec<String> = others
        .iter()
        .map(|(model, names)| {
            let verb = if names.len() == 1 { "is" } else { "are" };
            format!("{} {verb} {model}", names.join(", "))
        })
        .collect();
    condition(
        ConditionStatus::True,
        "UnexpectedModel",
        format!("the pool expects {expected}; {}", found.join("; ")),
    )
}

/// An integer field of a section, if it is one.
fn uint(section: &serde_json::Value, field: &str) -> Option<u64> {
    section.get(field).and_then(serde_json::Value::as_u64)
}

/// A text field of a section as a label value, if it is text that leaves one.
fn text(section: &serde_json::Value, field: &str) -> Option<String> {
    section
        .get(field)
        .and_then(serde_json::Value::as_str)
        .map(label_value)
        .filter(|v| !v.is_empty())
}

fn labelled(pairs: Vec<(&str, Option<String>)>) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .filter_map(|(name, value)| Some((format!("{INVENTORY_LABEL_PREFIX}{name}"), value?)))
        .collect()
}

/// The `cpu` section: model, architecture, sockets, cores, threads and NUMA nodes.
fn cpu_labels(cpu: &serde_json::Value) -> BTreeMap<String, String> {
    let sockets = uint(cpu, "sockets");
    let cores = sockets.zip(uint(cpu, "coresPerSocket")).map(|(s, c)| s * c);
    let threads = cores.zip(uint(cpu, "threadsPerCore")).map(|(c, t)| c * t);
    labelled(vec![
        ("cpu-model", text(cpu, "model")),
        ("cpu-arch", text(cpu, "architecture")),
        ("cpu-sockets", sockets.map(|v| v.to_string())),
        ("cpu-cores", cores.map(|v| v.to_string())),
        ("cpu-threads", threads.map(|v| v.to_string())),
        ("numa-nodes", uint(cpu, "numaNodes").map(|v| v.to_string())),
    ])
}

/// The `memory` section: total size in GiB, type and speed.
fn memory_labels(memory: &serde_json::Value) -> BTreeMap<String, String> {
    labelled(vec![
        (
            "memory-gib",
            uint(memory, "totalBytes").map(|b| (b >> 30).to_string()),
        ),
        ("memory-type", text(memory, "type")),
        (
            "memory-speed-mts",
            uint(memory, "speedMTs").map(|v| v.to_string()),
        ),
    ])
}

/// The `disks` section: how many, and their total size in GiB.
fn disk_labels(disks: &serde_json::Value) -> BTreeMap<String, String> {
    let Some(devices) = disks.get("devices").and_then(serde_json::Value::as_array) else {
        return BTreeMap::new();
    };
    let total: u64 = devices
        .iter()
        .filter_map(|d| uint(d, "sizeBytes"))
        .fold(0, u64::saturating_add);
    labelled(vec![
        ("disk-count", Some(devices.len().to_string())),
        ("disk-total-gib", Some((total >> 30).to_string())),
    ])
}

/// The `drivers` section (driver name → version): one label per driver, in name order.
fn driver_labels(drivers: &serde_json::Value) -> BTreeMap<String, String> {
    const PREFIX: &str = "driver-";
    let Some(map) = drivers.as_object() else {
        return BTreeMap::new();
    };
    let mut labels = BTreeMap::new();
    for (name, version) in map {
        let name = label_name(name, crate::node::MAX_LABEL_PART_LEN - PREFIX.len());
        let value = version.as_str().map(label_value).unwrap_or_default();
        if name.is_empty() || value.is_empty() {
            continue;
        }
        labels.insert(format!("{INVENTORY_LABEL_PREFIX}{PREFIX}{name}"), value);
        if labels.len() == MAX_DRIVER_LABELS {
            break;
        }
    }
    labels
}

/// Reads the `gpus` section against the pool's hardware profile.
pub fn interpret_gpus(
    section: &serde_json::Value,
    profile: &crate::catalog::HardwareProfile,
) -> Result<GpuFacts, InventoryError> {
    let expected_gpus = profile.gpu_count;
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
    if let Some(memory) = devices.first().map(|d| d.memory_mib).filter(|m| *m > 0) {
        labels.insert(
            format!("{INVENTORY_LABEL_PREFIX}gpu-memory-mib"),
            memory.to_string(),
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
        evidence(crate::clear::GPU_NEEDS_RESET, needs_reset, "gpu.reset"),
        evidence(crate::clear::GPU_NEEDS_REBOOT, needs_reboot, "node.reboot"),
        evidence(
            crate::clear::GPU_NEEDS_PERSON,
            needs_person,
            "replacing the GPU",
        ),
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
    conditions.push(model_condition(profile.gpu_model.as_deref(), &devices));
    Ok(GpuFacts {
        devices,
        labels,
        conditions,
        driver_version: gpus.driver_version,
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
    use crate::catalog::HardwareProfile;
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

    fn expect(gpu_count: Option<u32>) -> HardwareProfile {
        HardwareProfile {
            gpu_count,
            ..HardwareProfile::default()
        }
    }

    fn status(facts: &GpuFacts, kind: &str) -> ConditionStatus {
        facts
            .conditions
            .iter()
            .find(|c| c.kind == kind)
            .map(|c| c.status)
            .expect("condition present")
    }

    #[test]
    fn gpus_are_named_in_bus_order_with_labels() {
        let facts = interpret_gpus(&gpus(8, &[]), &expect(Some(8))).expect("valid");
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
        let facts = interpret_gpus(&gpus(7, &[]), &expect(Some(8))).expect("valid");
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
                &interpret_gpus(&gpus(7, &[]), &expect(None)).expect("valid"),
                "GpuCountMismatch"
            ),
            ConditionStatus::Unknown
        );
    }

    #[test]
    fn xids_map_to_their_remedy_and_application_xids_to_nothing() {
        let facts = interpret_gpus(
            &gpus(8, &[(0, 79), (1, 48), (2, 13), (3, 64)]),
            &expect(Some(8)),
        )
        .expect("valid");
        assert_eq!(status(&facts, "GpuNeedsReboot"), ConditionStatus::True);
        assert_eq!(status(&facts, "GpuNeedsReset"), ConditionStatus::True);
        assert_eq!(status(&facts, "GpuNeedsPerson"), ConditionStatus::True);
        assert_eq!(facts.devices.iter().filter(|d| !d.healthy).count(), 3);
        let only_app =
            interpret_gpus(&gpus(8, &[(2, 13), (5, 43)]), &expect(Some(8))).expect("valid");
        assert!(
            only_app
                .conditions
                .iter()
                .all(|c| c.status != ConditionStatus::True)
        );
    }

    #[test]
    fn malformed_sections_are_refused() {
        assert!(interpret_gpus(&json!({"devices": "many"}), &expect(Some(8))).is_err());
        assert!(interpret_gpus(&json!({}), &expect(Some(8))).is_err());
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

    /// The seven sections as a daemon sends them (the FakeDaemon's machine).
    fn sections(driver: &str) -> BTreeMap<String, serde_json::Value> {
        BTreeMap::from([
            ("gpus".to_owned(), {
                let mut g = gpus(8, &[]);
                g["driverVersion"] = json!(driver);
                g
            }),
            (
                "cpu".to_owned(),
                json!({"model": "Intel(R) Xeon(R) Platinum 8480+", "architecture": "x86_64",
                       "sockets": 2, "coresPerSocket": 56, "threadsPerCore": 2, "numaNodes": 2}),
            ),
            (
                "memory".to_owned(),
                json!({"totalBytes": 2_199_023_255_552_u64, "type": "DDR5", "speedMTs": 4800}),
            ),
            (
                "disks".to_owned(),
                json!({"devices": [{"name": "nvme0n1", "sizeBytes": 960_197_124_096_u64},
                                   {"name": "nvme1n1", "sizeBytes": 3_840_755_982_336_u64}]}),
            ),
            (
                "drivers".to_owned(),
                json!({"nvidia": driver, "ofed": "MLNX_OFED_LINUX-24.01-0.3.3.1",
                       "kernel": "5.15.0-105-generic", "weird name!": "1", "empty": ""}),
            ),
        ])
    }

    fn condition<'a>(facts: &'a InventoryFacts, kind: &str) -> &'a ConditionReport {
        facts
            .conditions
            .iter()
            .find(|c| c.kind == kind)
            .expect("condition present")
    }

    #[test]
    fn every_section_becomes_labels_under_the_inventory_prefix() {
        let facts = interpret(&sections("550.54.15"), &HardwareProfile::default()).expect("valid");
        let label = |name: &str| {
            facts
                .labels
                .get(&format!("{INVENTORY_LABEL_PREFIX}{name}"))
                .map(String::as_str)
        };
        assert_eq!(label("cpu-model"), Some("Intel-R-Xeon-R-Platinum-8480"));
        assert_eq!(label("cpu-arch"), Some("x86_64"));
        assert_eq!(label("cpu-sockets"), Some("2"));
        assert_eq!(label("cpu-cores"), Some("112"));
        assert_eq!(label("cpu-threads"), Some("224"));
        assert_eq!(label("numa-nodes"), Some("2"));
        assert_eq!(label("memory-gib"), Some("2048"));
        assert_eq!(label("memory-type"), Some("DDR5"));
        assert_eq!(label("memory-speed-mts"), Some("4800"));
        assert_eq!(label("disk-count"), Some("2"));
        assert_eq!(label("disk-total-gib"), Some("4471"));
        assert_eq!(label("driver-nvidia"), Some("550.54.15"));
        assert_eq!(label("driver-ofed"), Some("MLNX_OFED_LINUX-24.01-0.3.3.1"));
        assert_eq!(label("driver-kernel"), Some("5.15.0-105-generic"));
        assert_eq!(label("driver-weird-name"), Some("1"));
        assert_eq!(
            label("driver-empty"),
            None,
            "an empty version gives no label"
        );
        assert_eq!(label("gpu-count"), Some("8"));
        assert_eq!(label("gpu-memory-mib"), Some("81559"));
        for key in facts.labels.keys() {
            assert!(key.starts_with(INVENTORY_LABEL_PREFIX), "{key}");
            crate::node::validate_label_key(key).expect("a valid key");
        }
        for value in facts.labels.values() {
            crate::node::validate_label_value(value).expect("a valid value");
        }
        assert_eq!(facts.devices.as_ref().map(Vec::len), Some(8));
    }

    #[test]
    fn sections_other_than_gpus_never_refuse_and_drivers_are_bounded() {
        let odd = BTreeMap::from([
            ("cpu".to_owned(), json!({"model": 7, "sockets": "two"})),
            ("memory".to_owned(), json!("lots")),
            ("disks".to_owned(), json!({"devices": "many"})),
            (
                "drivers".to_owned(),
                serde_json::Value::Object(
                    (0..100)
                        .map(|i| (format!("mod{i:03}"), json!("1.0")))
                        .collect(),
                ),
            ),
        ]);
        let facts = interpret(&odd, &HardwareProfile::default()).expect("never refused");
        assert_eq!(facts.labels.len(), MAX_DRIVER_LABELS);
        assert_eq!(facts.devices, None, "no gpus section: nothing known");
        // Only the driver is judged (the drivers section reports it).
        assert_eq!(
            facts.conditions.iter().map(|c| c.kind).collect::<Vec<_>>(),
            vec!["DriverVersionMismatch"]
        );
        let none = interpret(&BTreeMap::new(), &HardwareProfile::default()).expect("valid");
        assert!(none.labels.is_empty() && none.conditions.is_empty());
    }

    #[test]
    fn the_driver_is_compared_with_the_pools_by_whole_components() {
        assert!(driver_matches("550", "550.54.15"));
        assert!(driver_matches("550.54", "550.54.15"));
        assert!(driver_matches("550.54.15", "550.54.15"));
        assert!(!driver_matches("55", "550.54.15"));
        assert!(!driver_matches("550.54.1", "550.54.15"));
        assert!(!driver_matches("535", "550.54.15"));
        let pinned = |v: &str| HardwareProfile {
            driver_version: Some(v.into()),
            ..HardwareProfile::default()
        };
        let facts = interpret(&sections("550.54.15"), &pinned("535")).expect("valid");
        let c = condition(&facts, "DriverVersionMismatch");
        assert_eq!(
            (c.status, c.reason.as_str(), c.message.as_str()),
            (
                ConditionStatus::True,
                "UnexpectedVersion",
                "the pool expects NVIDIA driver 535; this machine runs 550.54.15"
            )
        );
        let facts = interpret(&sections("550.54.15"), &pinned("550")).expect("valid");
        assert_eq!(
            condition(&facts, "DriverVersionMismatch").status,
            ConditionStatus::False
        );
        let facts = interpret(&sections("550.54.15"), &HardwareProfile::default()).expect("valid");
        assert_eq!(
            condition(&facts, "DriverVersionMismatch").status,
            ConditionStatus::Unknown
        );
        // No driver at all (no GPUs, no NVIDIA driver listed) against a pinned one.
        let bare = BTreeMap::from([("gpus".to_owned(), json!({"count": 0, "devices": []}))]);
        let facts = interpret(&bare, &pinned("550")).expect("valid");
        assert_eq!(
            condition(&facts, "DriverVersionMismatch").reason,
            "NoDriver"
        );
    }

    #[test]
    fn every_gpu_must_be_the_pools_model() {
        assert!(model_matches(
            "nvidia-h100-80gb-hbm3",
            "NVIDIA H100 80GB HBM3"
        ));
        assert!(!model_matches("NVIDIA H100", "NVIDIA H100 80GB HBM3"));
        let expecting = |m: &str| HardwareProfile {
            gpu_model: Some(m.into()),
            ..HardwareProfile::default()
        };
        let mut mixed = sections("550.54.15");
        mixed.get_mut("gpus").expect("gpus")["devices"][0]["name"] = json!("NVIDIA A100-SXM4-80GB");
        let facts = interpret(&mixed, &expecting("NVIDIA H100 80GB HBM3")).expect("valid");
        let c = condition(&facts, "GpuModelMismatch");
        assert_eq!(c.status, ConditionStatus::True);
        // Device 0 sits on the highest bus, so it is the last name.
        assert_eq!(
            c.message,
            "the pool expects NVIDIA H100 80GB HBM3; gpu7 is NVIDIA A100-SXM4-80GB"
        );
        let facts =
            interpret(&sections("550.54.15"), &expecting("nvidia-h100-80gb-hbm3")).expect("valid");
        assert_eq!(
            condition(&facts, "GpuModelMismatch").status,
            ConditionStatus::False
        );
        let none = BTreeMap::from([("gpus".to_owned(), json!({"count": 0, "devices": []}))]);
        let facts = interpret(&none, &expecting("NVIDIA H100 80GB HBM3")).expect("valid");
        assert_eq!(condition(&facts, "GpuModelMismatch").reason, "NoGpus");
        let facts = interpret(&none, &HardwareProfile::default()).expect("valid");
        assert_eq!(
            condition(&facts, "GpuModelMismatch").status,
            ConditionStatus::Unknown
        );
        assert_eq!(facts.devices, Some(Vec::new()));
    }
}
