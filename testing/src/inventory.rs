//! The simulated machine behind a [`FakeDaemon`](crate::daemon::FakeDaemon): its hardware
//! identifiers and the seven NodeInventory v1 sections (`system`, `gpus`, `cpu`, `memory`,
//! `network`, `disks`, `drivers`), all derived from one seed.
//!
//! The same seed always gives the same machine (the same system UUID, board serial, MACs,
//! GPU UUIDs and PCI bus ids), so two daemons built from one seed are one machine joining
//! twice, and a daemon's inventory hashes stay the same across its sessions.
//!
//! The identifiers a daemon sends with its join are exactly the identifying fields of its
//! inventory (`system.systemUuid`, `boardSerial`, `chassisSerial` and each interface's MAC
//! in `network`), because the control plane derives the hardware key from both and they
//! must agree for a re-join to be recognised as the same machine.

use crate::daemon::DaemonKnobs;
use bc_core::protocol::{INVENTORY_SECTIONS, section_hash};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The identifier names a daemon sends with its join, from which the control plane derives
/// the hardware key (`bc_core::hardware`), as `bc_core::health::identifiers` reads them from
/// the inventory.
pub const SYSTEM_UUID: &str = "system-uuid";
pub const BOARD_SERIAL: &str = "board-serial";
pub const CHASSIS_SERIAL: &str = "chassis-serial";

/// The identifier name of an interface's MAC address: `mac:<interface>`.
pub fn mac_identifier(interface: &str) -> String {
    format!("mac:{interface}")
}

/// The management interface, and the compute fabric's interfaces (one per GPU of an HGX
/// board).
const MANAGEMENT_INTERFACE: &str = "eno1";
const COMPUTE_INTERFACES: usize = 8;

fn compute_interface(i: usize) -> String {
    format!("ibp{i}")
}

/// The PCI buses the eight GPUs of an HGX H100 board sit on.
const HGX_GPU_BUSES: [u8; 8] = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb];

/// Mellanox/NVIDIA's organisationally unique identifier, the first three bytes of every
/// simulated MAC address.
const NIC_OUI: [u8; 3] = [0xb8, 0xce, 0xf6];

/// The XIDs NVIDIA documents as needing a GPU reset or a reboot; reported with `critical`.
const CRITICAL_XIDS: &[u32] = &[48, 63, 64, 74, 79, 92, 94, 95, 119, 120];

/// The simulated driver stack (the NVIDIA driver is a knob, `DaemonKnobs::driver_version`;
/// this is its default).
pub const NVIDIA_DRIVER: &str = "550.54.15";
const CUDA_VERSION: &str = "12.4";
const KERNEL: &str = "5.15.0-105-generic";

/// One simulated machine: its seed, hostname and hardware identifiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    pub seed: u64,
    pub hostname: String,
    /// `system-uuid`, `board-serial`, `chassis-serial` and `mac:<interface>` of every
    /// interface, unless the knobs replaced them. The inventory reports exactly these: an
    /// identifier left out of a replacement is absent (null) there too.
    pub identifiers: BTreeMap<String, String>,
}

impl Machine {
    /// The machine a seed stands for; `hostname` and `identifiers` replace the derived ones.
    pub fn new(
        seed: u64,
        hostname: Option<String>,
        identifiers: Option<BTreeMap<String, String>>,
    ) -> Machine {
        let hostname = hostname
            .unwrap_or_else(|| format!("gpu-{}", hex::encode(&derive(seed, "hostname")[..3])));
        let identifiers = identifiers.unwrap_or_else(|| {
            let mut ids = BTreeMap::from([
                (
                    SYSTEM_UUID.to_owned(),
                    uuid_from(seed, "system-uuid").to_string(),
                ),
                (
                    BOARD_SERIAL.to_owned(),
                    serial(seed, "board-serial", "BSN", 10),
                ),
                (
                    CHASSIS_SERIAL.to_owned(),
                    serial(seed, "chassis-serial", "C", 12),
                ),
            ]);
            let interfaces = std::iter::once(MANAGEMENT_INTERFACE.to_owned())
                .chain((0..COMPUTE_INTERFACES).map(compute_interface));
            for interface in interfaces {
                let mac = mac(seed, &mac_identifier(&interface));
                ids.insert(mac_identifier(&interface), mac);
            }
            ids
        });
        Machine {
            seed,
            hostname,
            identifiers,
        }
    }

    /// The seven inventory sections, by name.
    pub fn inventory(&self, knobs: &DaemonKnobs) -> BTreeMap<String, Value> {
        let sections = BTreeMap::from([
            ("system".to_owned(), self.system()),
            ("gpus".to_owned(), self.gpus(knobs)),
            ("cpu".to_owned(), cpu()),
            ("memory".to_owned(), memory()),
            ("network".to_owned(), self.network()),
            ("disks".to_owned(), self.disks()),
            ("drivers".to_owned(), drivers(knobs)),
        ]);
        debug_assert!(
            INVENTORY_SECTIONS
                .iter()
                .all(|name| sections.contains_key(*name))
        );
        sections
    }

    /// The identifiers a BMC knows of the machine, which an enrolment gives: the system UUID,
    /// the serials and the host's management NIC (the BMC does not see the compute fabric).
    /// A subset of what the daemon reports, so their hardware keys differ.
    pub fn bmc_identifiers(&self) -> Vec<(String, String)> {
        let management = mac_identifier(MANAGEMENT_INTERFACE);
        [
            SYSTEM_UUID,
            BOARD_SERIAL,
            CHASSIS_SERIAL,
            management.as_str(),
        ]
        .iter()
        .filter_map(|name| {
            self.identifier(name)
                .map(|value| ((*name).to_owned(), value.to_owned()))
        })
        .collect()
    }

    fn identifier(&self, name: &str) -> Option<&str> {
        self.identifiers.get(name).map(String::as_str)
    }

    fn system(&self) -> Value {
        json!({
            "hostname": self.hostname,
            "vendor": "Supermicro",
            "product": "SYS-821GE-TNHR",
            "systemUuid": self.identifier(SYSTEM_UUID),
            "boardSerial": self.identifier(BOARD_SERIAL),
            "chassisSerial": self.identifier(CHASSIS_SERIAL),
            "biosVendor": "American Megatrends International, LLC.",
            "biosVersion": "2.1",
            "architecture": "x86_64",
            "os": { "name": "Ubuntu", "version": "22.04.4 LTS", "kernel": KERNEL },
        })
    }

    fn gpus(&self, knobs: &DaemonKnobs) -> Value {
        let count = knobs.gpu_count;
        let mut xids: Vec<BTreeMap<u32, u64>> = vec![BTreeMap::new(); count as usize];
        for (i, xid) in knobs.xid_errors.iter().enumerate() {
            if let Some(slot) = xids.get_mut(i % count.max(1) as usize) {
                *slot.entry(*xid).or_default() += 1;
            }
        }
        let devices: Vec<Value> = (0..count)
            .map(|index| {
                let bus = HGX_GPU_BUSES[index as usize % HGX_GPU_BUSES.len()];
                let domain = index as usize / HGX_GPU_BUSES.len();
                let xid_errors: Vec<Value> = xids[index as usize]
                    .iter()
                    .map(|(xid, count)| json!({ "xid": xid, "count": count, "critical": CRITICAL_XIDS.contains(xid) }))
                    .collect();
                json!({
                    "index": index,
                    "uuid": format!("GPU-{}", uuid_from(self.seed, &format!("gpu:{index}"))),
                    "pciBusId": format!("{domain:08x}:{bus:02x}:00.0"),
                    "name": knobs.gpu_model,
                    "serial": serial(self.seed, &format!("gpu-serial:{index}"), "1654923", 6),
                    "memoryMiB": knobs.gpu_memory_mib,
                    "vbiosVersion": "96.00.99.00.01",
                    "powerLimitWatts": 700,
                    "eccMode": "enabled",
                    "eccErrors": { "volatileUncorrectable": 0, "aggregateUncorrectable": 0 },
                    "retiredPages": 0,
                    "xidErrors": xid_errors,
                })
            })
            .collect();
        // A machine without GPUs has no NVIDIA driver loaded: NVML reports nothing but the
        // empty list, which is what bcd sends then.
        if count == 0 {
            return json!({ "count": 0, "devices": [] });
        }
        json!({
            "count": count,
            "model": knobs.gpu_model,
            "driverVersion": knobs.driver_version,
            "cudaVersion": CUDA_VERSION,
            "devices": devices,
            "diagnostics": self.diagnostics(knobs),
        })
    }

    /// The result of the daemon's last GPU diagnostic (`dcgmi diag -r 2`).
    fn diagnostics(&self, knobs: &DaemonKnobs) -> Value {
        if !knobs.fail_diagnostics {
            return json!({ "tool": "dcgmi", "level": 2, "result": "pass", "failures": [] });
        }
        let gpu = u32::from(derive(self.seed, "failing-gpu")[0]) % knobs.gpu_count.max(1);
        json!({
            "tool": "dcgmi",
            "level": 2,
            "result": "fail",
            "failures": [{
                "gpu": gpu,
                "test": "memory",
                "message": format!("GPU {gpu}: memory test found uncorrectable errors; replace the GPU"),
            }],
        })
    }

    fn network(&self) -> Value {
        let mut interfaces = vec![json!({
            "name": MANAGEMENT_INTERFACE,
            "mac": self.identifier(&mac_identifier(MANAGEMENT_INTERFACE)),
            "type": "ethernet",
            "speedMbps": 25_000,
            "role": "management",
        })];
        interfaces.extend((0..COMPUTE_INTERFACES).map(compute_interface).map(|name| {
            json!({
                "mac": self.identifier(&mac_identifier(&name)),
                "name": name,
                "type": "infiniband",
                "speedMbps": 400_000,
                "role": "compute",
            })
        }));
        json!({ "interfaces": interfaces })
    }

    fn disks(&self) -> Value {
        let mut devices = vec![json!({
            "name": "nvme0n1",
            "model": "SAMSUNG MZ1L2960HCJR-00A07",
            "serial": serial(self.seed, "disk:boot", "S6", 12),
            "sizeBytes": 960_197_124_096_u64,
            "role": "boot",
        })];
        devices.extend((1..=8).map(|i| {
            json!({
                "name": format!("nvme{i}n1"),
                "model": "SAMSUNG MZQL23T8HCLS-00A07",
                "serial": serial(self.seed, &format!("disk:{i}"), "S6", 12),
                "sizeBytes": 3_840_755_982_336_u64,
                "role": "data",
            })
        }));
        json!({ "devices": devices })
    }
}

fn cpu() -> Value {
    json!({
        "model": "Intel(R) Xeon(R) Platinum 8480+",
        "architecture": "x86_64",
        "sockets": 2,
        "coresPerSocket": 56,
        "threadsPerCore": 2,
        "numaNodes": 2,
    })
}

fn memory() -> Value {
    let dimm_bytes: u64 = 64 << 30;
    json!({ "totalBytes": 32 * dimm_bytes, "dimms": 32, "dimmSizeBytes": dimm_bytes, "type": "DDR5", "speedMTs": 4800 })
}

/// The loaded drivers by name; a machine without GPUs runs no NVIDIA stack.
fn drivers(knobs: &DaemonKnobs) -> Value {
    let mut drivers = json!({
        "ofed": "MLNX_OFED_LINUX-24.01-0.3.3.1",
        "kernel": KERNEL,
    });
    if knobs.gpu_count > 0 {
        drivers["nvidia"] = json!(knobs.driver_version);
        drivers["cuda"] = json!(CUDA_VERSION);
        drivers["fabricmanager"] = json!(knobs.driver_version);
    }
    drivers
}

/// The hash of every section, as `hello.inventoryHashes` carries them.
pub fn hashes(sections: &BTreeMap<String, Value>) -> BTreeMap<String, String> {
    sections
        .iter()
        .map(|(name, content)| (name.clone(), section_hash(content)))
        .collect()
}

/// 32 bytes that depend only on the seed and a label: the source of every derived value.
pub fn derive(seed: u64, label: &str) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"bc-fake-daemon\0");
    hasher.update(seed.to_le_bytes());
    hasher.update(label.as_bytes());
    hasher.finalize().into()
}

fn uuid_from(seed: u64, label: &str) -> uuid::Uuid {
    let bytes = derive(seed, label);
    let mut first = [0u8; 16];
    first.copy_from_slice(&bytes[..16]);
    uuid::Builder::from_random_bytes(first).into_uuid()
}

/// `prefix` followed by `digits` upper-case hex digits.
fn serial(seed: u64, label: &str, prefix: &str, digits: usize) -> String {
    let hex = hex::encode_upper(derive(seed, label));
    format!("{prefix}{}", &hex[..digits.min(hex.len())])
}

fn mac(seed: u64, label: &str) -> String {
    let bytes = derive(seed, label);
    let octets = [
        NIC_OUI[0], NIC_OUI[1], NIC_OUI[2], bytes[0], bytes[1], bytes[2],
    ];
    octets
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_is_the_same_machine() {
        let knobs = DaemonKnobs::default();
        let a = Machine::new(7, None, None);
        let b = Machine::new(7, None, None);
        assert_eq!(a, b);
        assert_eq!(hashes(&a.inventory(&knobs)), hashes(&b.inventory(&knobs)));
        let other = Machine::new(8, None, None);
        assert_ne!(a.identifiers, other.identifiers);
        assert_ne!(a.hostname, other.hostname);
        let ha = hashes(&a.inventory(&knobs));
        let hb = hashes(&other.inventory(&knobs));
        assert_ne!(ha["gpus"], hb["gpus"]);
        assert_eq!(
            ha["cpu"], hb["cpu"],
            "sections without per-machine data hash equal"
        );
    }

    #[test]
    fn every_section_is_present_and_hashes_are_stable() {
        let machine = Machine::new(42, Some("gpu-001".into()), None);
        let knobs = DaemonKnobs::default();
        let sections = machine.inventory(&knobs);
        let names: Vec<&str> = sections.keys().map(String::as_str).collect();
        let mut expected: Vec<&str> = INVENTORY_SECTIONS.to_vec();
        expected.sort_unstable();
        assert_eq!(names, expected);
        // Hashing is over canonical JSON: recomputing, or reparsing, gives the same hash.
        for (name, content) in &sections {
            let reparsed: Value =
                serde_json::from_str(&serde_json::to_string_pretty(content).expect("json"))
                    .expect("json");
            assert_eq!(section_hash(content), section_hash(&reparsed), "{name}");
        }
        assert_eq!(hashes(&sections), hashes(&machine.inventory(&knobs)));
        assert_eq!(sections["system"]["hostname"], "gpu-001");
    }

    #[test]
    fn knobs_show_in_the_gpus_section() {
        let machine = Machine::new(1, None, None);
        let healthy = machine.inventory(&DaemonKnobs::default());
        assert_eq!(healthy["gpus"]["count"], 8);
        assert_eq!(healthy["gpus"]["devices"].as_array().map(Vec::len), Some(8));
        assert_eq!(healthy["gpus"]["diagnostics"]["result"], "pass");
        let uuids: std::collections::BTreeSet<&str> = healthy["gpus"]["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["uuid"].as_str())
            .collect();
        assert_eq!(uuids.len(), 8, "GPU uuids are distinct");

        let sick = DaemonKnobs {
            gpu_count: 7,
            fail_diagnostics: true,
            xid_errors: vec![79, 79, 48],
            ..DaemonKnobs::default()
        };
        let inv = machine.inventory(&sick);
        assert_eq!(inv["gpus"]["count"], 7);
        assert_eq!(inv["gpus"]["diagnostics"]["result"], "fail");
        assert_eq!(inv["gpus"]["devices"][0]["xidErrors"][0]["xid"], 79);
        assert_eq!(inv["gpus"]["devices"][1]["xidErrors"][0]["xid"], 79);
        assert_eq!(inv["gpus"]["devices"][2]["xidErrors"][0]["xid"], 48);
        assert_eq!(inv["gpus"]["devices"][0]["xidErrors"][0]["critical"], true);
        // The GPUs that remain keep their identity.
        assert_eq!(
            inv["gpus"]["devices"][3]["uuid"],
            healthy["gpus"]["devices"][3]["uuid"]
        );
        assert_ne!(section_hash(&inv["gpus"]), section_hash(&healthy["gpus"]));
        assert_eq!(
            section_hash(&inv["system"]),
            section_hash(&healthy["system"])
        );
    }

    #[test]
    fn a_machine_without_gpus_reports_no_nvidia_stack_and_the_driver_is_a_knob() {
        let machine = Machine::new(2, None, None);
        let bare = machine.inventory(&DaemonKnobs {
            gpu_count: 0,
            ..DaemonKnobs::default()
        });
        assert_eq!(bare["gpus"], json!({ "count": 0, "devices": [] }));
        assert_eq!(bare["drivers"].get("nvidia"), None);
        assert_eq!(bare["drivers"]["kernel"], KERNEL);
        let older = machine.inventory(&DaemonKnobs {
            driver_version: "535.161.08".into(),
            ..DaemonKnobs::default()
        });
        assert_eq!(older["gpus"]["driverVersion"], "535.161.08");
        assert_eq!(older["drivers"]["nvidia"], "535.161.08");
    }

    #[test]
    fn the_join_identifiers_are_the_ones_the_inventory_reports() {
        let machine = Machine::new(5, None, None);
        let inv = machine.inventory(&DaemonKnobs::default());
        let from_inventory = bc_core::health::identifiers(inv.get("system"), inv.get("network"));
        assert_eq!(from_inventory, machine.identifiers);
        let key = bc_core::hardware::hardware_key(&machine.identifiers);
        assert!(key.trusted, "{key:?}");
        assert_eq!(
            key.key,
            bc_core::hardware::hardware_key(&from_inventory).key
        );
        assert_eq!(machine.identifiers.len(), 3 + 1 + COMPUTE_INTERFACES);
    }

    #[test]
    fn identifiers_can_be_set_to_simulate_the_same_machine() {
        let ids = BTreeMap::from([
            (SYSTEM_UUID.to_owned(), "u-1".to_owned()),
            (BOARD_SERIAL.to_owned(), "b-1".to_owned()),
        ]);
        let machine = Machine::new(3, None, Some(ids.clone()));
        assert_eq!(machine.identifiers, ids);
        let inv = machine.inventory(&DaemonKnobs::default());
        assert_eq!(inv["system"]["systemUuid"], "u-1");
        assert_eq!(inv["system"]["boardSerial"], "b-1");
        let from_inventory = bc_core::health::identifiers(inv.get("system"), inv.get("network"));
        assert_eq!(
            from_inventory, ids,
            "the inventory reports exactly the replaced identifiers"
        );
    }
}
