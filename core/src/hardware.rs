//! `hardwareKey`: SHA-256 over a machine's normalised identifiers, and whether it is trusted.
//!
//! Firmware is full of placeholder values ("To Be Filled By O.E.M.", all-zero UUIDs), and two
//! machines sharing such a value must never be taken for one. So placeholders are dropped, and
//! the key is trusted (and then unique across nodes) only when at least two independent
//! identifiers survive.

use crate::DomainError;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};

/// The identifier kinds we know. Each counts once towards trust however many values it has
/// (a machine's MAC addresses are one kind of evidence, not four).
pub const IDENTIFIER_KINDS: &[&str] = &[
    "system-uuid",
    "board-serial",
    "chassis-serial",
    "system-serial",
    "mac",
    "tpm-ek",
];

/// Independent identifiers needed before a hardware key is trusted.
pub const MIN_TRUSTED_IDENTIFIERS: usize = 2;

/// Values vendors ship in place of a real identifier (compared after normalisation).
const PLACEHOLDERS: &[&str] = &[
    "",
    "to be filled by o.e.m.",
    "to be filled by oem",
    "default string",
    "not specified",
    "not applicable",
    "none",
    "null",
    "n/a",
    "na",
    "0",
    "00000000",
    "0123456789",
    "1234567890",
    "system serial number",
    "chassis serial number",
    "base board serial number",
    "serial",
    "unknown",
    "invalid",
    "empty",
    "xxxxxxxx",
];

/// The outcome of normalising a machine's identifiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HardwareKey {
    /// SHA-256 (hex) over the surviving identifiers; `None` when none survive.
    pub key: Option<String>,
    pub trusted: bool,
    /// The identifiers that survived, normalised, by kind (what the key was computed from).
    pub identifiers: BTreeMap<String, BTreeSet<String>>,
}

/// Normalises one value: trimmed, lower-case; a MAC as colon-separated hex pairs; a UUID
/// without braces.
fn normalise(kind: &str, raw: &str) -> Option<String> {
    let value = raw
        .trim()
        .trim_matches(|c| c == '{' || c == '}')
        .to_ascii_lowercase();
    if PLACEHOLDERS.contains(&value.as_str()) {
        return None;
    }
    // A value made of one repeated character (all zeros, all Fs, all dashes) is a placeholder.
    let significant: Vec<char> = value
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    if significant.is_empty() || significant.iter().all(|c| *c == significant[0]) {
        return None;
    }
    match kind {
        "mac" => {
            let hex: String = value.chars().filter(char::is_ascii_hexdigit).collect();
            if hex.len() != 12 {
                return None;
            }
            let bytes: Vec<String> = hex
                .as_bytes()
                .chunks(2)
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            // Locally administered or multicast addresses belong to virtual interfaces.
            let first = u8::from_str_radix(&bytes[0], 16).ok()?;
            if first & 0b11 != 0 {
                return None;
            }
            Some(bytes.join(":"))
        }
        "system-uuid" => {
            let hex: String = value.chars().filter(char::is_ascii_hexdigit).collect();
            (hex.len() == 32).then_some(hex)
        }
        _ => Some(value),
    }
}

/// The kind an identifier's name gives: `<kind>` or `<kind>:<anything>` (`mac:eth0`).
fn kind_of(name: &str) -> &str {
    name.split(':').next().unwrap_or_default()
}

/// Checks an identifier's name as an operator gives it (at enrolment): one of
/// [`IDENTIFIER_KINDS`], or `<kind>:<anything>`. A daemon's unknown names are ignored instead
/// (a newer daemon may report more), but an operator's typo would silently weaken a match.
pub fn validate_identifier_name(name: &str) -> Result<(), DomainError> {
    if IDENTIFIER_KINDS.contains(&kind_of(name)) {
        Ok(())
    } else {
        Err(DomainError::BadInput(format!(
            "`{name}` is not a machine identifier: expected one of {} (or `<kind>:<anything>`, such as `mac:eth0`)",
            IDENTIFIER_KINDS.join(", ")
        )))
    }
}

/// Whether two sets of normalised identifiers (as [`HardwareKey::identifiers`] holds them)
/// describe one machine, when they were gathered by different means: a BMC's report at
/// enrolment and the daemon's own inventory, which name different subsets of a machine's
/// identifiers (the BMC knows the host NICs it sees, the daemon every interface). A kind both
/// report agrees when they share a value and contradicts when they share none. One machine:
/// at least [`MIN_TRUSTED_IDENTIFIERS`] kinds agree (the bar a key's trust has) and none
/// contradicts, so a board swapped with its serial, or firmware's duplicated UUID, never
/// makes two machines one.
pub fn same_machine(
    a: &BTreeMap<String, BTreeSet<String>>,
    b: &BTreeMap<String, BTreeSet<String>>,
) -> bool {
    let mut agreeing = 0;
    for (kind, values) in a {
        let Some(others) = b.get(kind) else {
            continue;
        };
        if values.is_disjoint(others) {
            return false;
        }
        agreeing += 1;
    }
    agreeing >= MIN_TRUSTED_IDENTIFIERS
}

/// Computes the hardware key from identifiers named `<kind>` or `<kind>:<anything>` (e.g.
/// `mac:eth0`). Unknown kinds are ignored.
pub fn hardware_key(identifiers: &BTreeMap<String, String>) -> HardwareKey {
    hardware_key_of(
        identifiers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_str())),
    )
}

/// [`hardware_key`] of `(name, value)` pairs, where a name may come more than once (an
/// operator listing a machine's MACs each as `mac`).
pub fn hardware_key_of<'a>(
    identifiers: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> HardwareKey {
    let mut by_kind: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (name, raw) in identifiers {
        let kind = kind_of(name);
        if !IDENTIFIER_KINDS.contains(&kind) {
            continue;
        }
        if let Some(value) = normalise(kind, raw) {
            by_kind.entry(kind.to_owned()).or_default().insert(value);
        }
    }
    if by_kind.is_empty() {
        return HardwareKey {
            key: None,
            trusted: false,
            identifiers: by_kind,
        };
    }
    let mut hasher = Sha256::new();
    for (kind, values) in &by_kind {
        for value in values {
            hasher.update(kind.as_bytes());
            hasher.update(b"=");
            hasher.update(value.as_bytes());
            hasher.update(b"\n");
        }
    }
    HardwareKey {
        key: Some(hex::encode(hasher.finalize())),
        trusted: by_kind.len() >= MIN_TRUSTED_IDENTIFIERS,
        identifiers: by_kind,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn placeholders_are_dropped_and_two_kinds_make_it_trusted() {
        let key = hardware_key(&ids(&[
            ("system-uuid", "00000000-0000-0000-0000-000000000000"),
            ("board-serial", "To Be Filled By O.E.M."),
            ("mac:eth0", "00:00:00:00:00:00"),
        ]));
        assert_eq!(key.key, None);
        assert!(!key.trusted);

        let one = hardware_key(&ids(&[(
            "system-uuid",
            "4C4C4544-0042-3510-8051-B7C04F4E3732",
        )]));
        assert!(one.key.is_some() && !one.trusted);

        let two = hardware_key(&ids(&[
            ("system-uuid", "{4C4C4544-0042-3510-8051-B7C04F4E3732}"),
            ("mac:eth0", "3C-EC-EF-12-34-56"),
            ("mac:eth1", "3c:ec:ef:12:34:57"),
            ("favourite-colour", "blue"),
        ]));
        assert!(two.trusted);
        assert_eq!(two.identifiers["mac"].len(), 2);
    }

    #[test]
    fn the_key_ignores_spelling_and_order() {
        let a = hardware_key(&ids(&[
            ("system-uuid", "4C4C4544-0042-3510-8051-B7C04F4E3732"),
            ("board-serial", " CN7016 "),
        ]));
        let b = hardware_key(&ids(&[
            ("board-serial", "cn7016"),
            ("system-uuid", "4c4c4544004235108051b7c04f4e3732"),
        ]));
        assert_eq!(a.key, b.key);
        let c = hardware_key(&ids(&[
            ("board-serial", "cn7017"),
            ("system-uuid", "4c4c4544004235108051b7c04f4e3732"),
        ]));
        assert_ne!(a.key, c.key);
    }

    #[test]
    fn a_bmc_report_and_a_daemon_inventory_of_one_machine_match() {
        let daemon = hardware_key(&ids(&[
            ("system-uuid", "4C4C4544-0042-3510-8051-B7C04F4E3732"),
            ("board-serial", "CN7016"),
            ("chassis-serial", "C0FFEE1234"),
            ("mac:eno1", "3c:ec:ef:12:34:56"),
            ("mac:ibp0", "b8:ce:f6:00:00:01"),
        ]))
        .identifiers;
        // The BMC's spelling and subset: the UUID with braces, the host NIC only.
        let bmc = hardware_key(&ids(&[
            ("system-uuid", "{4c4c4544-0042-3510-8051-b7c04f4e3732}"),
            ("mac", "3C-EC-EF-12-34-56"),
            ("system-serial", "SYS-123"),
        ]))
        .identifiers;
        assert!(same_machine(&bmc, &daemon));
        assert!(same_machine(&daemon, &bmc));
        // One kind in common is not enough evidence.
        let uuid_only = hardware_key(&ids(&[
            ("system-uuid", "4C4C4544-0042-3510-8051-B7C04F4E3732"),
            ("system-serial", "SYS-123"),
        ]))
        .identifiers;
        assert!(!same_machine(&uuid_only, &daemon));
        // A contradiction outweighs agreements: another machine with a copied UUID.
        let other = hardware_key(&ids(&[
            ("system-uuid", "4C4C4544-0042-3510-8051-B7C04F4E3732"),
            ("mac", "3c:ec:ef:12:34:56"),
            ("board-serial", "CN9999"),
        ]))
        .identifiers;
        assert!(!same_machine(&other, &daemon));
    }

    #[test]
    fn identifier_names_are_known_kinds() {
        for name in ["system-uuid", "mac", "mac:eth0", "tpm-ek", "system-serial"] {
            assert!(validate_identifier_name(name).is_ok(), "{name}");
        }
        for name in ["system_uuid", "", "serial", "favourite-colour"] {
            assert!(validate_identifier_name(name).is_err(), "{name}");
        }
    }

    #[test]
    fn virtual_macs_do_not_count() {
        // 0x02 in the first octet: locally administered (a bridge, a VM).
        let key = hardware_key(&ids(&[
            ("mac:br0", "02:42:ac:11:00:02"),
            ("board-serial", "CN7016"),
        ]));
        assert!(!key.trusted);
    }
}
