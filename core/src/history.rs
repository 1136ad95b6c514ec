//! A node's history as data: what the events of each version carry so that the node at any
//! past version can be rebuilt from the log, and the fold that rebuilds it.
//!
//! Every version of a node is written by one transaction, with one event per [`Change`]. The
//! first event of each version carries a [`Rebuild`] step: the whole record for the first
//! version and every [`SNAPSHOT_EVERY`]th after it, otherwise an RFC 6902 JSON Patch from the
//! previous version's record to this one's. Rebuilding version `v` therefore reads the
//! events of at most [`SNAPSHOT_EVERY`] versions, from [`snapshot_base`]`(v)` to `v`, and
//! applies them in order ([`fold`]); the cost does not grow with the node's age.
//!
//! The record's JSON form (its serde form, camelCase) is a storage contract from here on: a
//! field added to [`NodeRecord`] later needs `#[serde(default)]`, so that old snapshots and
//! patches still read.
//!
//! Each change event also carries its structured detail ([`change_detail`]): the whole
//! condition, taint, label, reason, cordon or drain it touched, typed, instead of only the
//! rendered `from`/`to` strings.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::event::{Axis, Change, EventType};
use crate::node::NodeRecord;

/// A full snapshot every this many versions. The constant bounds the rebuild: at most 32
/// versions' events are read and at most 31 patches applied, whatever the node's age, while
/// a snapshot (a record is ~1–4 KiB of JSON with its labels and conditions) is written once
/// per 32 changes, so snapshots add ~30–120 bytes per change on average against patches of
/// ~100–300 bytes. Halving it halves the fold and doubles the snapshots' share; at 32 the
/// fold of a worst case is a single indexed range read of ~32–100 rows and well under a
/// millisecond of patching.
pub const SNAPSHOT_EVERY: i64 = 32;

/// Whether version `v` is written with a full snapshot (the first version, and every
/// [`SNAPSHOT_EVERY`]th after it).
pub fn is_snapshot_version(v: i64) -> bool {
    v >= 1 && (v - 1) % SNAPSHOT_EVERY == 0
}

/// The version whose snapshot a rebuild of `v` starts from.
pub fn snapshot_base(v: i64) -> i64 {
    if v < 1 {
        return v;
    }
    (v - 1) / SNAPSHOT_EVERY * SNAPSHOT_EVERY + 1
}

/// What a version's first event carries to rebuild the node at that version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Rebuild {
    /// The whole record, in its serde (camelCase) form.
    Snapshot(Value),
    /// RFC 6902 operations from the previous version's record to this one's.
    Patch(json_patch::Patch),
}

impl Rebuild {
    /// The step that writes `after` over `before`: a snapshot where `after.version` is a
    /// snapshot version (or there is no `before`: a new node), a patch otherwise.
    pub fn between(
        before: Option<&NodeRecord>,
        after: &NodeRecord,
    ) -> Result<Rebuild, HistoryError> {
        let after_json = to_json(after)?;
        match before {
            Some(before) if !is_snapshot_version(after.version) => Ok(Rebuild::Patch(
                json_patch::diff(&to_json(before)?, &after_json),
            )),
            _ => Ok(Rebuild::Snapshot(after_json)),
        }
    }

    /// Reads the step out of an event's `data` (`data.rebuild`); `None` where the event
    /// carries none (not the first event of its version, or written before history was
    /// recorded).
    pub fn from_event_data(data: &Value) -> Result<Option<Rebuild>, HistoryError> {
        match data.get("rebuild") {
            None | Some(Value::Null) => Ok(None),
            Some(raw) => serde_json::from_value(raw.clone())
                .map(Some)
                .map_err(|e| HistoryError::Corrupt(format!("a rebuild step does not read: {e}"))),
        }
    }
}

fn to_json(record: &NodeRecord) -> Result<Value, HistoryError> {
    serde_json::to_value(record)
        .map_err(|e| HistoryError::Corrupt(format!("a node record does not serialise: {e}")))
}

/// Why a node could not be rebuilt at a version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HistoryError {
    /// The version's events were written before the control plane recorded rebuild steps
    /// (or the node was written without events): its history cannot be rebuilt there.
    #[error(
        "version {version} of this node was recorded before node history carried rebuild data; \
         it cannot be rebuilt (versions from the node's first snapshot after the upgrade on can)"
    )]
    NotRecorded { version: i64 },
    /// The log has no event for a version between the snapshot and the target: the log is
    /// not what this code wrote.
    #[error("the event log has no event for version {version} of this node")]
    Missing { version: i64 },
    /// A step does not read or does not apply.
    #[error("{0}")]
    Corrupt(String),
}

/// Rebuilds the record at `target` from `steps`: `(version, step)` pairs in ascending
/// version order, one per version from [`snapshot_base`]`(target)` (or any earlier snapshot)
/// to `target`, where `None` means the version's events carry no step. Every version
/// rebuilt on the way is handed to `visit` (oldest first), so a caller that needs several
/// versions of one node folds once.
pub fn fold_visiting(
    target: i64,
    steps: &[(i64, Option<Rebuild>)],
    mut visit: impl FnMut(i64, &Value) -> Result<(), HistoryError>,
) -> Result<NodeRecord, HistoryError> {
    let mut doc: Option<Value> = None;
    let mut expected: Option<i64> = None;
    for (version, step) in steps {
        let version = *version;
        if version > target {
            break;
        }
        if let Some(expected) = expected
            && version != expected
        {
            return Err(HistoryError::Missing { version: expected });
        }
        match step {
            Some(Rebuild::Snapshot(snapshot)) => doc = Some(snapshot.clone()),
            Some(Rebuild::Patch(patch)) => {
                let Some(current) = doc.as_mut() else {
                    // A patch with nothing to apply it to: the snapshot it needs is missing.
                    return Err(HistoryError::NotRecorded { version });
                };
                json_patch::patch(current, patch).map_err(|e| {
                    HistoryError::Corrupt(format!(
                        "the patch of version {version} does not apply: {e}"
                    ))
                })?;
            }
            None => return Err(HistoryError::NotRecorded { version }),
        }
        if let Some(current) = &doc {
            visit(version, current)?;
        }
        expected = Some(version + 1);
    }
    if expected != Some(target + 1) {
        return Err(match expected {
            None => HistoryError::NotRecorded { version: target },
            Some(v) => HistoryError::Missing { version: v },
        });
    }
    let doc = doc.ok_or(HistoryError::NotRecorded { version: target })?;
    record_of(&doc, target)
}

/// [`fold_visiting`] without a visitor.
pub fn fold(target: i64, steps: &[(i64, Option<Rebuild>)]) -> Result<NodeRecord, HistoryError> {
    fold_visiting(target, steps, |_, _| Ok(()))
}

/// The record a folded document holds, checked to be the version it should be.
pub fn record_of(doc: &Value, version: i64) -> Result<NodeRecord, HistoryError> {
    let record: NodeRecord = serde_json::from_value(doc.clone()).map_err(|e| {
        HistoryError::Corrupt(format!("version {version} does not read as a node: {e}"))
    })?;
    if record.version != version {
        return Err(HistoryError::Corrupt(format!(
            "the fold to version {version} produced version {}",
            record.version
        )));
    }
    Ok(record)
}

/// Each inventory label a report changed, in key order, as a label change's detail is
/// (`{ key, value, previous }`; `value` is null for a label the report no longer has).
fn inventory_label_changes(before: Option<&NodeRecord>, after: &NodeRecord) -> Vec<Value> {
    let was = before.map(NodeRecord::inventory_labels).unwrap_or_default();
    let now = after.inventory_labels();
    crate::node::changed_label_keys(&was, &now)
        .into_iter()
        .map(|key| json!({ "key": key, "value": now.get(key), "previous": was.get(key) }))
        .collect()
}

/// The structured detail of one change, for the event's `data.change`: the whole element
/// the change touched, as it is after the change (or as it was, for a removal), typed.
///
/// - conditions: `{ condition, previous }` (the whole condition after and before);
/// - taints: `{ taint, previous }`; labels: `{ key, value, previous }`, and for a report's
///   inventory labels `{ labels: [{ key, value, previous }] }`, each label it changed;
/// - `noScheduleReasons`: `{ reason }` (the entry added, or the one removed, with who set
///   it, since when and its detail);
/// - cordon and drain: `{ cordon }`, `{ drain }`; maintenance: `{ maintenance, reason }`;
/// - `provisionState`: `{ from, to, failedFrom }`; connectivity: `{ from, to, since }`;
/// - the counters (generations, GPU count): `{ from, to }` as numbers; lifecycle and the
///   hardware key: `{ hostname, deletedAt, hardwareKeyTrusted }` as they apply.
pub fn change_detail(change: &Change, before: Option<&NodeRecord>, after: &NodeRecord) -> Value {
    let key = change.key.as_deref();
    let number = |s: &Option<String>| s.as_deref().and_then(|s| s.parse::<i64>().ok());
    match change.axis {
        Axis::Conditions => {
            let find = |n: &NodeRecord| {
                n.conditions
                    .iter()
                    .find(|c| Some(c.kind.as_str()) == key)
                    .cloned()
            };
            json!({ "condition": find(after), "previous": before.and_then(find) })
        }
        Axis::Taints => {
            let find = |n: &NodeRecord| {
                n.taints
                    .iter()
                    .find(|t| Some(t.key.as_str()) == key)
                    .cloned()
            };
            json!({ "taint": find(after), "previous": before.and_then(find) })
        }
        Axis::Labels if change.event_type == EventType::NodeInventoryLabelsChanged => {
            json!({ "labels": inventory_label_changes(before, after) })
        }
        Axis::Labels => {
            let find = |n: &NodeRecord| key.and_then(|k| n.labels.get(k).cloned());
            json!({ "key": key, "value": find(after), "previous": before.and_then(find) })
        }
        Axis::NoScheduleReasons => {
            let find = |n: &NodeRecord| {
                n.no_schedule_reasons
                    .iter()
                    .find(|r| Some(r.key.to_string().as_str()) == key)
                    .cloned()
            };
            let reason = find(after).or_else(|| before.and_then(find));
            json!({ "reason": reason })
        }
        Axis::Cordoned => match change.event_type {
            EventType::NodeDrainStarted => json!({ "drain": after.drain }),
            EventType::NodeDrained | EventType::NodeDrainFinished => {
                json!({ "drain": before.and_then(|b| b.drain.clone()) })
            }
            EventType::NodeUncordoned => json!({ "cordon": before.and_then(|b| b.cordon.clone()) }),
            _ => json!({ "cordon": after.cordon }),
        },
        Axis::Maintenance => json!({
            "maintenance": after.maintenance,
            "reason": after
                .maintenance_reason
                .clone()
                .or_else(|| before.and_then(|b| b.maintenance_reason.clone())),
        }),
        Axis::ProvisionState => json!({
            "from": before.map(|b| b.provision_state),
            "to": after.provision_state,
            "failedFrom": after.failed_from,
        }),
        Axis::Connectivity => json!({
            "from": before.map(|b| b.connectivity),
            "to": after.connectivity,
            "since": after.connectivity_since,
        }),
        Axis::Generation | Axis::ObservedGeneration | Axis::IdentityGeneration => {
            json!({ "from": number(&change.from), "to": number(&change.to) })
        }
        Axis::Inventory => match change.event_type {
            EventType::NodeGpuCountChanged => {
                json!({ "from": number(&change.from), "to": number(&change.to) })
            }
            _ => json!({ "hardwareKeyTrusted": after.hardware_key_trusted }),
        },
        Axis::Lifecycle => json!({
            "hostname": after.hostname,
            "provisionState": after.provision_state,
            "deletedAt": after.deleted_at,
        }),
        Axis::Power => json!({ "from": before.map(|b| b.power), "to": after.power }),
        Axis::Command => Value::Null,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Actor;
    use crate::axes::{ConditionStatus, Connectivity, ProvisionState, TaintEffect};
    use crate::node::tests::{node, t0};
    use crate::provision::ProvisionMove;
    use chrono::Duration;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn snapshot_versions_bound_the_fold() {
        assert!(is_snapshot_version(1));
        assert!(!is_snapshot_version(2));
        assert!(is_snapshot_version(1 + SNAPSHOT_EVERY));
        assert_eq!(snapshot_base(1), 1);
        assert_eq!(snapshot_base(SNAPSHOT_EVERY), 1);
        assert_eq!(snapshot_base(SNAPSHOT_EVERY + 1), SNAPSHOT_EVERY + 1);
        assert_eq!(
            snapshot_base(2 * SNAPSHOT_EVERY + 5),
            2 * SNAPSHOT_EVERY + 1
        );
        for v in 1..200 {
            let base = snapshot_base(v);
            assert!(is_snapshot_version(base) && base <= v && v - base < SNAPSHOT_EVERY);
        }
    }

    /// One real transition of the domain, as operators, controllers and the gateway make them.
    #[derive(Debug, Clone)]
    enum Op {
        Cordon(u8),
        Uncordon,
        Drain(Option<i64>),
        FinishDrain,
        Taint(u8, u8, u8),
        Untaint(u8),
        Label(u8, u8),
        Unlabel(u8),
        Condition(u8, u8, bool),
        Connectivity(u8),
        Move(u8),
        Generation,
        Observe,
        Revoke,
        HardwareKey(u8, bool),
        Delete,
        Advance(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3).prop_map(Op::Cordon),
            Just(Op::Uncordon),
            proptest::option::of(1i64..48).prop_map(Op::Drain),
            Just(Op::FinishDrain),
            (0u8..3, 0u8..3, 0u8..3).prop_map(|(k, v, e)| Op::Taint(k, v, e)),
            (0u8..3).prop_map(Op::Untaint),
            (0u8..4, 0u8..3).prop_map(|(k, v)| Op::Label(k, v)),
            (0u8..4).prop_map(Op::Unlabel),
            (0u8..3, 0u8..3, any::<bool>()).prop_map(|(k, s, ns)| Op::Condition(k, s, ns)),
            (0u8..4).prop_map(Op::Connectivity),
            (0u8..14).prop_map(Op::Move),
            Just(Op::Generation),
            Just(Op::Observe),
            Just(Op::Revoke),
            (0u8..3, any::<bool>()).prop_map(|(k, t)| Op::HardwareKey(k, t)),
            Just(Op::Delete),
            (1u16..600).prop_map(Op::Advance),
        ]
    }

    /// Applies `op` as the server does (its errors are refusals that change nothing).
    fn apply(n: &mut NodeRecord, op: &Op, now: &mut chrono::DateTime<chrono::Utc>) -> Vec<Change> {
        let alice = Actor::User("alice".into());
        let ctl = Actor::Controller("health".into());
        let at = *now;
        let result = match op {
            Op::Cordon(r) => n.cordon(&format!("reason {r}"), &alice, at),
            Op::Uncordon => Ok(n.uncordon()),
            Op::Drain(h) => n.drain("drain", h.map(|h| at + Duration::hours(h)), &alice, at),
            Op::FinishDrain => Ok(n.finish_drain("released")),
            Op::Taint(k, v, e) => n.taint(
                &format!("t{k}"),
                &format!("v{v}"),
                [
                    TaintEffect::NoSchedule,
                    TaintEffect::PreferNoSchedule,
                    TaintEffect::NoExecute,
                ][usize::from(*e)],
                &alice,
                at,
            ),
            Op::Untaint(k) => n.untaint(&format!("t{k}")),
            Op::Label(k, v) => {
                n.update_labels(&BTreeMap::from([(format!("l{k}"), format!("v{v}"))]), &[])
            }
            Op::Unlabel(k) => n.update_labels(&BTreeMap::new(), &[format!("l{k}")]),
            Op::Condition(k, s, ns) => n.set_condition(
                ["GpuCountMismatch", "XidCritical", "EccUncorrectable"][usize::from(*k)],
                [
                    ConditionStatus::True,
                    ConditionStatus::False,
                    ConditionStatus::Unknown,
                ][usize::from(*s)],
                "Evidence",
                if *s == 0 { "" } else { "seen" },
                *ns,
                &ctl,
                at,
            ),
            Op::Connectivity(c) => {
                Ok(n.set_connectivity(Connectivity::ALL[usize::from(*c)], &ctl, at))
            }
            Op::Move(m) => {
                let action = ProvisionMove::ALL[usize::from(*m) % ProvisionMove::ALL.len()];
                n.apply_move(action, Some("step"))
            }
            Op::Generation => Ok(n.bump_generation("spec")),
            Op::Observe => n.report_observed_generation(n.generation),
            Op::Revoke => n.revoke_identity("compromised"),
            Op::HardwareKey(k, t) => Ok(n.set_hardware_key(Some(format!("{k:064}")), *t)),
            Op::Delete => n.delete(at),
            Op::Advance(s) => {
                *now += Duration::seconds(i64::from(*s));
                Ok(Vec::new())
            }
        };
        result.unwrap_or_default()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// Random histories of real transitions, written as the server writes them (a
        /// version per non-empty change, a step per version): the fold rebuilds the record
        /// of every version exactly, from the snapshot at or before it, and every change has
        /// a structured detail.
        #[test]
        fn the_fold_rebuilds_every_version(ops in proptest::collection::vec(op(), 1..120)) {
            let mut now = t0();
            let mut record = node(ProvisionState::Adopting);
            let mut versions = vec![record.clone()];
            let mut steps = vec![(1, Some(Rebuild::between(None, &record).expect("step")))];
            for op in &ops {
                let before = record.clone();
                let changes = apply(&mut record, op, &mut now);
                if changes.is_empty() {
                    // Nothing changed: no version, and the server writes nothing (a refusal, a
                    // request already satisfied, or a refresh that is no change).
                    record = before;
                    continue;
                }
                for change in &changes {
                    prop_assert!(!change_detail(change, Some(&before), &record).is_null());
                }
                record.version = before.version + 1;
                record.updated_at = now;
                steps.push((record.version, Some(Rebuild::between(Some(&before), &record).expect("step"))));
                versions.push(record.clone());
            }
            for expected in &versions {
                let v = expected.version;
                let from = usize::try_from(snapshot_base(v) - 1).expect("index");
                let rebuilt = fold(v, &steps[from..]).expect("rebuilds");
                prop_assert_eq!(&rebuilt, expected);
                // From any earlier snapshot, too.
                prop_assert_eq!(&fold(v, &steps).expect("rebuilds from the first"), expected);
            }
        }
    }

    #[test]
    fn a_gap_or_an_unrecorded_version_is_an_error_never_a_wrong_node() {
        let mut n = node(ProvisionState::Adopted);
        let first = Rebuild::between(None, &n).expect("step");
        let before = n.clone();
        n.cordon("rack", &Actor::System, t0()).expect("valid");
        n.version = 2;
        let second = Rebuild::between(Some(&before), &n).expect("step");
        let before2 = n.clone();
        n.uncordon();
        n.version = 3;
        let third = Rebuild::between(Some(&before2), &n).expect("step");

        assert_eq!(
            fold(
                3,
                &[
                    (1, Some(first.clone())),
                    (2, Some(second.clone())),
                    (3, Some(third.clone()))
                ]
            )
            .expect("whole"),
            n
        );
        assert_eq!(
            fold(3, &[(1, Some(first.clone())), (3, Some(third.clone()))]),
            Err(HistoryError::Missing { version: 2 })
        );
        assert_eq!(
            fold(
                3,
                &[
                    (1, None),
                    (2, Some(second.clone())),
                    (3, Some(third.clone()))
                ]
            ),
            Err(HistoryError::NotRecorded { version: 1 })
        );
        assert_eq!(
            fold(3, &[(2, Some(second)), (3, Some(third))]),
            Err(HistoryError::NotRecorded { version: 2 })
        );
        assert_eq!(
            fold(3, &[(1, Some(first))]),
            Err(HistoryError::Missing { version: 2 })
        );
        assert_eq!(fold(1, &[]), Err(HistoryError::NotRecorded { version: 1 }));
    }

    #[test]
    fn steps_read_back_from_event_data() {
        let n = node(ProvisionState::Adopted);
        let step = Rebuild::between(None, &n).expect("step");
        let data = json!({ "version": 1, "rebuild": step });
        assert_eq!(Rebuild::from_event_data(&data).expect("reads"), Some(step));
        assert_eq!(
            Rebuild::from_event_data(&json!({ "version": 1 })).expect("reads"),
            None
        );
        assert!(Rebuild::from_event_data(&json!({ "rebuild": { "patch": 3 } })).is_err());
    }

    #[test]
    fn a_condition_change_carries_the_whole_condition() {
        let mut n = node(ProvisionState::Adopted);
        let before = n.clone();
        let changes = n
            .set_condition(
                "XidCritical",
                ConditionStatus::True,
                "Xid79",
                "gpu3 fell off the bus",
                true,
                &Actor::Controller("health".into()),
                t0(),
            )
            .expect("valid");
        let detail = change_detail(&changes[0], Some(&before), &n);
        assert_eq!(detail["condition"]["message"], "gpu3 fell off the bus");
        assert_eq!(detail["condition"]["setBy"], "controller:health");
        assert!(detail["previous"].is_null());
        let reason = change_detail(&changes[1], Some(&before), &n);
        assert_eq!(reason["reason"]["key"], "XidCritical");
        assert_eq!(reason["reason"]["detail"], "gpu3 fell off the bus");
    }
}
