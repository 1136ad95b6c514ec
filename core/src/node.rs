//! The node: [`NodeRecord`] (everything the control plane knows) and the transitions an
//! operator or controller can make. The API view, `NodeDetail`, is composed from a record in
//! [`crate::view`].
//!
//! Transitions mutate a record in memory and return the [`Change`]s they made; they never
//! touch `version`. The storage layer writes the record with `version + 1` only when the list
//! is non-empty, and writes one event per change, all in one transaction. An empty list means
//! the request was already satisfied (cordoning a cordoned node), which is not an error.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

use crate::actor::Actor;
use crate::axes::{
    Adapter, ConditionStatus, Connectivity, Power, ProvisionState, Role, TaintEffect, Trust,
};
use crate::clear::{self, ClearRule, Proof, ProofEffect};
use crate::error::DomainError;
use crate::event::{Axis, Change, EventType};
use crate::ids::{NodeId, PoolId, SiteId, TenantId};
use crate::provision::{self, ProvisionMove};
use crate::reason::{NoScheduleReason, ReasonKey};

/// Why and by whom a node was cordoned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cordon {
    pub reason: String,
    pub by: Actor,
    pub at: DateTime<Utc>,
}

/// A drain under way: the node is cordoned and `draining` is in `noScheduleReasons` until its
/// allocations are released or the deadline passes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Drain {
    pub started_at: DateTime<Utc>,
    pub deadline: Option<DateTime<Utc>>,
}

/// An operator taint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: TaintEffect,
    pub added_by: Actor,
    pub added_at: DateTime<Utc>,
}

/// A typed condition, as in Kubernetes: a status plus the evidence for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    pub kind: String,
    pub status: ConditionStatus,
    pub reason: String,
    pub message: String,
    /// Whether this condition, while `true`, keeps work off the node (adds its type to
    /// `noScheduleReasons`).
    pub no_schedule: bool,
    pub set_by: Actor,
    pub last_transition_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// For a condition that clears only on proof or by hand ([`crate::clear::ClearRule`]):
    /// how far its proof is (which step is satisfied, by which command, when), and whether
    /// its evidence is gone. Kept after it clears, to show how it was cleared.
    pub proof: Option<crate::clear::Proof>,
}

/// The current (or last) gateway session; lives in its own row so heartbeats never bump the
/// node's `version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub epoch: i64,
    pub gateway_id: String,
    pub connected_at: DateTime<Utc>,
    pub disconnected_at: Option<DateTime<Utc>>,
    pub last_seen: DateTime<Utc>,
}

/// The keys whose value differs between two label sets (set, changed or removed), in key
/// order: what a report's `node.inventory_labels_changed` lists.
pub fn changed_label_keys<'a>(
    before: &'a BTreeMap<String, String>,
    after: &'a BTreeMap<String, String>,
) -> BTreeSet<&'a String> {
    before
        .keys()
        .chain(after.keys())
        .filter(|key| before.get(*key) != after.get(*key))
        .collect()
}

/// The controller that owns label `key`, if one does: `inventory` for keys under
/// [`crate::health::INVENTORY_LABEL_PREFIX`], which it sets from the node's reports; `None`
/// for an operator's label. Only the owner sets or removes an owned label.
pub fn label_owner(key: &str) -> Option<&'static str> {
    key.starts_with(crate::health::INVENTORY_LABEL_PREFIX)
        .then_some("inventory")
}

/// Everything the control plane knows about a node. Modules and node adapters get this;
/// the API gets [`crate::view::NodeDetail`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRecord {
    pub id: NodeId,
    pub hostname: String,
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub owner_tenant_id: Option<TenantId>,
    pub role: Role,
    pub trust: Trust,
    pub adapter: Adapter,
    /// Per-concern driver bindings (`power`, `boot`, `deploy`, …) from the pool's hardware
    /// profile.
    pub drivers: BTreeMap<String, String>,
    pub hardware_key: Option<String>,
    pub hardware_key_trusted: bool,
    pub generation: i64,
    pub observed_generation: i64,
    pub identity_generation: i64,
    pub version: i64,

    pub provision_state: ProvisionState,
    pub failed_from: Option<ProvisionState>,
    pub maintenance: bool,
    pub maintenance_reason: Option<String>,
    pub cordon: Option<Cordon>,
    pub drain: Option<Drain>,
    pub power: Power,
    pub connectivity: Connectivity,
    pub connectivity_since: DateTime<Utc>,
    /// Sorted by key; at most one entry per key.
    pub no_schedule_reasons: Vec<NoScheduleReason>,

    pub labels: BTreeMap<String, String>,
    /// Sorted by key; at most one taint per key.
    pub taints: Vec<Taint>,
    /// Sorted by kind; at most one condition per kind.
    pub conditions: Vec<Condition>,
    /// GPUs the last inventory reported; the unit capacity is counted in.
    pub gpu_count: i32,

    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub deleted_at: Option<DateTime<Utc>>,
}

/// What a new node starts as; the caller decides state, role and ownership.
#[derive(Debug, Clone)]
pub struct NewNode {
    pub hostname: String,
    pub site_id: SiteId,
    pub pool_id: Option<PoolId>,
    pub owner_tenant_id: Option<TenantId>,
    pub role: Role,
    pub trust: Trust,
    pub adapter: Adapter,
    pub drivers: BTreeMap<String, String>,
    pub provision_state: ProvisionState,
}

/// The longest hostname we accept: a fully qualified DNS name.
pub const MAX_HOSTNAME_LEN: usize = 253;
/// Kubernetes' limit for a label value and for the name part of a key; operators' tooling
/// already respects it.
pub const MAX_LABEL_PART_LEN: usize = 63;
/// The longest free-text reason (cordon, drain) we keep.
pub const MAX_REASON_LEN: usize = 1024;

impl NodeRecord {
    /// A node as it is first written, `version` 1, not yet connected.
    pub fn new(new: NewNode, now: DateTime<Utc>) -> Result<NodeRecord, DomainError> {
        validate_hostname(&new.hostname)?;
        Ok(NodeRecord {
            id: NodeId::generate(),
            hostname: new.hostname,
            site_id: new.site_id,
            pool_id: new.pool_id,
            owner_tenant_id: new.owner_tenant_id,
            role: new.role,
            trust: new.trust,
            adapter: new.adapter,
            drivers: new.drivers,
            hardware_key: None,
            hardware_key_trusted: false,
            generation: 0,
            observed_generation: 0,
            identity_generation: 1,
            version: 1,
            provision_state: new.provision_state,
            failed_from: None,
            maintenance: false,
            maintenance_reason: None,
            cordon: None,
            drain: None,
            power: Power::Unknown,
            connectivity: Connectivity::Disconnected,
            connectivity_since: now,
            no_schedule_reasons: Vec::new(),
            labels: BTreeMap::new(),
            taints: Vec::new(),
            conditions: Vec::new(),
            gpu_count: 0,
            created_at: now,
            updated_at: now,
            deleted_at: None,
        })
    }

    pub fn cordoned(&self) -> bool {
        self.cordon.is_some()
    }

    pub fn has_reason(&self, key: &ReasonKey) -> bool {
        self.no_schedule_reasons.iter().any(|r| &r.key == key)
    }

    /// `version` check: the caller passes the version it read.
    pub fn expect_version(&self, expected: i64) -> Result<(), DomainError> {
        if self.version == expected {
            Ok(())
        } else {
            Err(DomainError::Conflict {
                expected,
                current: self.version,
            })
        }
    }

    /// Moves `provisionState` along the state table. `fail` records `failedFrom` and turns
    /// maintenance on; `recover` goes back to `failedFrom` and turns maintenance off.
    pub fn apply_move(
        &mut self,
        action: ProvisionMove,
        reason: Option<&str>,
    ) -> Result<Vec<Change>, DomainError> {
        let from = self.provision_state;
        let to = provision::next_state(from, action, self.failed_from)?;
        let mut changes = vec![
            Change::new(
                EventType::NodeProvisionStateChanged,
                Axis::ProvisionState,
                Some(from.as_static_str()),
                Some(to.as_static_str()),
            )
            .with_detail(match reason {
                Some(reason) => format!("{action}: {reason}"),
                None => action.to_string(),
            }),
        ];
        self.provision_state = to;
        match action {
            ProvisionMove::Fail => {
                self.failed_from = Some(from);
                let why = reason.map_or_else(|| format!("{from} failed"), str::to_owned);
                changes.extend(self.set_maintenance(true, Some(why)));
            }
            ProvisionMove::Recover => {
                self.failed_from = None;
                changes.extend(self.set_maintenance(false, None));
            }
            _ => {}
        }
        Ok(changes)
    }

    fn set_maintenance(&mut self, on: bool, reason: Option<String>) -> Option<Change> {
        let was = self.maintenance;
        self.maintenance = on;
        self.maintenance_reason = reason.clone();
        (was != on).then(|| {
            let change = Change::new(
                if on {
                    EventType::NodeMaintenanceOn
                } else {
                    EventType::NodeMaintenanceOff
                },
                Axis::Maintenance,
                Some(was.to_string()),
                Some(on.to_string()),
            );
            match reason {
                Some(reason) => change.with_detail(reason),
                None => change,
            }
        })
    }

    /// `nodes.cordon`: no new work. Cordoning a cordoned node changes nothing.
    pub fn cordon(
        &mut self,
        reason: &str,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let reason = validate_reason(reason)?;
        if self.cordon.is_some() {
            return Ok(Vec::new());
        }
        self.cordon = Some(Cordon {
            reason: reason.clone(),
            by: by.clone(),
            at: now,
        });
        Ok(vec![
            Change::new(
                EventType::NodeCordoned,
                Axis::Cordoned,
                Some("false"),
                Some("true"),
            )
            .with_detail(reason),
        ])
    }

    /// `nodes.uncordon`: also ends a drain under way, and with it the `draining` reason.
    pub fn uncordon(&mut self) -> Vec<Change> {
        let mut changes = Vec::new();
        if self.drain.take().is_some() {
            changes.extend(self.remove_reason(&ReasonKey::Draining));
        }
        if self.cordon.take().is_some() {
            changes.push(Change::new(
                EventType::NodeUncordoned,
                Axis::Cordoned,
                Some("true"),
                Some("false"),
            ));
        }
        changes
    }

    /// `nodes.drain`: cordon, and keep `draining` in `noScheduleReasons` until the node's
    /// allocations are released or `deadline` passes. Draining again replaces the deadline.
    pub fn drain(
        &mut self,
        reason: &str,
        deadline: Option<DateTime<Utc>>,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        if let Some(deadline) = deadline
            && deadline <= now
        {
            return Err(DomainError::BadInput(format!(
                "the drain deadline {deadline} is not in the future"
            )));
        }
        let mut changes = self.cordon(reason, by, now)?;
        let started_at = self.drain.as_ref().map_or(now, |d| d.started_at);
        let detail = deadline.map_or_else(
            || "no deadline".to_owned(),
            |d| format!("deadline {}", d.to_rfc3339()),
        );
        let restarted = self.drain.as_ref().map(|d| d.deadline) != Some(deadline);
        self.drain = Some(Drain {
            started_at,
            deadline,
        });
        changes.extend(self.add_reason(ReasonKey::Draining, by, now, Some(detail.clone())));
        if restarted {
            changes.push(
                Change::new(
                    EventType::NodeDrainStarted,
                    Axis::Cordoned,
                    None::<String>,
                    None::<String>,
                )
                .with_detail(detail),
            );
        }
        Ok(changes)
    }

    /// The drain is over (deadline passed or allocations released): `draining` leaves
    /// `noScheduleReasons`; the node stays cordoned until an operator uncordons it.
    pub fn finish_drain(&mut self, why: &str) -> Vec<Change> {
        if self.drain.take().is_none() {
            return Vec::new();
        }
        let mut changes: Vec<Change> = self
            .remove_reason(&ReasonKey::Draining)
            .into_iter()
            .collect();
        changes.push(
            Change::new(
                EventType::NodeDrained,
                Axis::Cordoned,
                None::<String>,
                None::<String>,
            )
            .with_detail(why),
        );
        changes
    }

    /// Adds or replaces an operator taint. A NoSchedule or NoExecute taint adds `taint:<key>`
    /// to `noScheduleReasons`; a PreferNoSchedule one does not. (Evicting the work a NoExecute
    /// taint does not tolerate is the placer's, in the same transaction.)
    pub fn taint(
        &mut self,
        key: &str,
        value: &str,
        effect: TaintEffect,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        validate_label_key(key)?;
        validate_label_value(value)?;
        let previous = self
            .taints
            .iter()
            .position(|t| t.key == key)
            .map(|i| self.taints.remove(i));
        let unchanged = previous
            .as_ref()
            .is_some_and(|t| t.value == value && t.effect == effect);
        let taint = Taint {
            key: key.to_owned(),
            value: value.to_owned(),
            effect,
            added_by: previous
                .as_ref()
                .filter(|_| unchanged)
                .map_or_else(|| by.clone(), |t| t.added_by.clone()),
            added_at: previous
                .as_ref()
                .filter(|_| unchanged)
                .map_or(now, |t| t.added_at),
        };
        let rendered = render_taint(&taint);
        self.taints.push(taint);
        self.taints.sort_by(|a, b| a.key.cmp(&b.key));
        if unchanged {
            return Ok(Vec::new());
        }
        let mut changes = vec![
            Change::new(
                EventType::NodeTainted,
                Axis::Taints,
                previous.as_ref().map(render_taint),
                Some(rendered),
            )
            .with_key(key),
        ];
        let reason = ReasonKey::Taint(key.to_owned());
        changes.extend(match effect {
            TaintEffect::NoSchedule | TaintEffect::NoExecute => {
                self.add_reason(reason, by, now, None)
            }
            TaintEffect::PreferNoSchedule => self.remove_reason(&reason),
        });
        Ok(changes)
    }

    /// Removes an operator taint and its reason.
    pub fn untaint(&mut self, key: &str) -> Result<Vec<Change>, DomainError> {
        let index = self
            .taints
            .iter()
            .position(|t| t.key == key)
            .ok_or_else(|| DomainError::NotFound {
                kind: "taint",
                id: format!("{key} on {}", self.id),
            })?;
        let removed = self.taints.remove(index);
        let mut changes = vec![
            Change::new(
                EventType::NodeUntainted,
                Axis::Taints,
                Some(render_taint(&removed)),
                None::<String>,
            )
            .with_key(key),
        ];
        changes.extend(self.remove_reason(&ReasonKey::Taint(key.to_owned())));
        Ok(changes)
    }

    /// An operator's `labelNode`: sets and removes labels in one step. A key both set and
    /// removed is refused, and so is any key under the inventory's prefix
    /// ([`crate::health::INVENTORY_LABEL_PREFIX`]): those labels are inventory's, replaced on
    /// every report, so an operator's value would be silently overwritten (or a removed one
    /// come back) and selectors on them could no longer be trusted to mean the hardware.
    pub fn update_labels(
        &mut self,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> Result<Vec<Change>, DomainError> {
        if let Some((key, owner)) = set
            .keys()
            .chain(remove)
            .find_map(|k| label_owner(k).map(|owner| (k, owner)))
        {
            return Err(DomainError::ReservedLabel {
                key: key.clone(),
                owner,
            });
        }
        self.write_labels(set, remove)
    }

    /// Sets and removes an operator's labels, one change per key that moved: an operator
    /// names each key, and an audit of who set which label reads them one by one.
    fn write_labels(
        &mut self,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> Result<Vec<Change>, DomainError> {
        for (key, value) in set {
            validate_label_key(key)?;
            validate_label_value(value)?;
        }
        if let Some(both) = remove.iter().find(|k| set.contains_key(*k)) {
            return Err(DomainError::BadInput(format!(
                "label `{both}` is both set and removed"
            )));
        }
        let mut changes = Vec::new();
        for (key, value) in set {
            let previous = self.labels.insert(key.clone(), value.clone());
            if previous.as_ref() != Some(value) {
                changes.push(
                    Change::new(
                        EventType::NodeLabelSet,
                        Axis::Labels,
                        previous.map(|v| format!("{key}={v}")),
                        Some(format!("{key}={value}")),
                    )
                    .with_key(key.as_str()),
                );
            }
        }
        for key in remove {
            if let Some(previous) = self.labels.remove(key) {
                changes.push(
                    Change::new(
                        EventType::NodeLabelRemoved,
                        Axis::Labels,
                        Some(format!("{key}={previous}")),
                        None::<String>,
                    )
                    .with_key(key.as_str()),
                );
            }
        }
        Ok(changes)
    }

    /// The labels inventory owns: every key under [`crate::health::INVENTORY_LABEL_PREFIX`].
    pub fn inventory_labels(&self) -> BTreeMap<String, String> {
        let prefix = crate::health::INVENTORY_LABEL_PREFIX;
        self.labels
            .iter()
            .filter(|(key, _)| key.starts_with(prefix))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect()
    }

    /// Replaces the inventory labels (every key under
    /// [`crate::health::INVENTORY_LABEL_PREFIX`]) with a report's whole set, as one change
    /// (`node.inventory_labels_changed`) however many keys moved. A report re-derives the
    /// set, so its effect is one fact about the node; a machine's first report sets about
    /// twenty labels, and an event per key made them most of a fleet's bring-up events
    /// (and of the database's work while it came up). `from` and `to` list the keys that
    /// changed, as `key=value` in key order, with what each held before and holds now.
    fn replace_inventory_labels(
        &mut self,
        labels: &BTreeMap<String, String>,
    ) -> Result<Option<Change>, DomainError> {
        let prefix = crate::health::INVENTORY_LABEL_PREFIX;
        for (key, value) in labels {
            if !key.starts_with(prefix) {
                return Err(DomainError::BadInput(format!(
                    "inventory label `{key}` is not under `{prefix}`"
                )));
            }
            validate_label_key(key)?;
            validate_label_value(value)?;
        }
        let before = self.inventory_labels();
        if before == *labels {
            return Ok(None);
        }
        self.labels.retain(|key, _| !key.starts_with(prefix));
        self.labels
            .extend(labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        let changed = changed_label_keys(&before, labels);
        let render = |set: &BTreeMap<String, String>| {
            let listed: Vec<String> = changed
                .iter()
                .filter_map(|key| set.get(*key).map(|value| format!("{key}={value}")))
                .collect();
            (!listed.is_empty()).then(|| listed.join(", "))
        };
        Ok(Some(Change::new(
            EventType::NodeInventoryLabelsChanged,
            Axis::Labels,
            render(&before),
            render(labels),
        )))
    }

    /// Records a condition from Inventory, Health, Liveness or NodeLifecycle.
    // The arguments are the fields of a Kubernetes-style condition plus who and when; a
    // struct for them would only be unpacked again here. A NoSchedule
    /// condition that is `true` puts its type in `noScheduleReasons`; any other status takes
    /// it out, in the same change.
    #[allow(clippy::too_many_arguments)]
    pub fn set_condition(
        &mut self,
        kind: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        no_schedule: bool,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        if !crate::reason::is_condition_type(kind) {
            return Err(DomainError::BadInput(format!(
                "`{kind}` is not a condition type (PascalCase)"
            )));
        }
        let previous = self
            .conditions
            .iter()
            .position(|c| c.kind == kind)
            .map(|i| self.conditions.remove(i));
        let transitioned = previous.as_ref().is_none_or(|c| c.status != status);
        let condition = Condition {
            kind: kind.to_owned(),
            status,
            reason: reason.to_owned(),
            message: message.to_owned(),
            no_schedule,
            set_by: by.clone(),
            last_transition_at: match &previous {
                Some(p) if !transitioned => p.last_transition_at,
                _ => now,
            },
            updated_at: now,
            proof: previous.as_ref().and_then(|p| p.proof.clone()),
        };
        let mut changes = Vec::new();
        if transitioned {
            changes.push(
                Change::new(
                    EventType::NodeConditionChanged,
                    Axis::Conditions,
                    previous.as_ref().map(|c| format!("{kind}={}", c.status)),
                    Some(format!("{kind}={status}")),
                )
                .with_detail(reason)
                .with_key(kind),
            );
        }
        self.conditions.push(condition);
        self.conditions.sort_by(|a, b| a.kind.cmp(&b.kind));
        let reason_key = ReasonKey::Condition(kind.to_owned());
        if no_schedule && status == ConditionStatus::True {
            changes.extend(self.add_reason(reason_key, by, now, Some(message.to_owned())));
        } else {
            changes.extend(self.remove_reason(&reason_key));
        }
        Ok(changes)
    }

    /// Moves the connectivity axis. `unreachable` and `lost` keep `unreachable` in
    /// `noScheduleReasons`; `connected` removes it. Used by the gateway and Liveness.
    pub fn set_connectivity(
        &mut self,
        to: Connectivity,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Vec<Change> {
        let from = self.connectivity;
        if from == to {
            return Vec::new();
        }
        self.connectivity = to;
        self.connectivity_since = now;
        let mut changes = vec![Change::new(
            EventType::NodeConnectivityChanged,
            Axis::Connectivity,
            Some(from.as_static_str()),
            Some(to.as_static_str()),
        )];
        match to {
            Connectivity::Unreachable | Connectivity::Lost => {
                changes.extend(self.add_reason(ReasonKey::Unreachable, by, now, None));
            }
            Connectivity::Connected => changes.extend(self.remove_reason(&ReasonKey::Unreachable)),
            Connectivity::Disconnected => {}
        }
        changes
    }

    /// Applies what the node's inventory says (`health::interpret` over every reported
    /// section): the inventory labels (the whole set under the inventory prefix, replacing
    /// earlier ones, never touching operators' labels), the GPU count once `gpus` was
    /// reported, and every condition the reports decide, each with its reason.
    pub fn apply_inventory(
        &mut self,
        facts: &crate::health::InventoryFacts,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let mut changes: Vec<Change> = self
            .replace_inventory_labels(&facts.labels)?
            .into_iter()
            .collect();
        if let Some(devices) = &facts.devices {
            let count = i32::try_from(devices.len()).unwrap_or(i32::MAX);
            if count != self.gpu_count {
                changes.push(Change::new(
                    EventType::NodeGpuCountChanged,
                    Axis::Inventory,
                    Some(self.gpu_count.to_string()),
                    Some(count.to_string()),
                ));
                self.gpu_count = count;
            }
        }
        for condition in &facts.conditions {
            changes.extend(self.report_condition(
                condition.kind,
                condition.status,
                &condition.reason,
                &condition.message,
                by,
                now,
            )?);
        }
        Ok(changes)
    }

    /// What a report says about one NoSchedule condition, applied as its clear rule says
    /// ([`crate::clear`]). A condition that clears with its evidence follows the report. One
    /// that clears only on proof or by hand is raised by evidence (with a fresh proof), but a
    /// report without the evidence only records that the evidence is gone
    /// (`node.condition_evidence_gone`); evidence that comes back after a step of the proof
    /// or after it was gone restarts the proof (`node.condition_proof_restarted`).
    pub fn report_condition(
        &mut self,
        kind: &str,
        status: ConditionStatus,
        reason: &str,
        message: &str,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let rule = ClearRule::for_condition(kind);
        if rule.clears_with_evidence() {
            return self.set_condition(kind, status, reason, message, true, by, now);
        }
        let index = self.conditions.iter().position(|c| c.kind == kind);
        let current = index.map(|i| self.conditions[i].status);
        let evidence = status == ConditionStatus::True;
        match (evidence, index, current) {
            (true, Some(i), Some(ConditionStatus::True)) => {
                let condition = &mut self.conditions[i];
                condition.message = message.to_owned();
                condition.updated_at = now;
                let raised = condition.last_transition_at;
                let proof = condition.proof.get_or_insert_with(|| Proof::new(raised));
                Ok(match clear::evidence_seen(proof, now) {
                    Some(why) => vec![
                        Change::new(
                            EventType::NodeConditionProofRestarted,
                            Axis::Conditions,
                            None::<String>,
                            Some(kind),
                        )
                        .with_detail(format!("{kind}: {why}; {}", rule.describe())),
                    ],
                    None => Vec::new(),
                })
            }
            (true, ..) => {
                let changes = self.set_condition(kind, status, reason, message, true, by, now)?;
                if let Some(condition) = self.conditions.iter_mut().find(|c| c.kind == kind) {
                    condition.proof = Some(Proof::new(now));
                }
                Ok(changes)
            }
            (false, Some(i), Some(ConditionStatus::True)) => {
                let condition = &mut self.conditions[i];
                let raised = condition.last_transition_at;
                let proof = condition.proof.get_or_insert_with(|| Proof::new(raised));
                if !clear::evidence_gone(proof, now) {
                    return Ok(Vec::new());
                }
                condition.updated_at = now;
                Ok(vec![
                    Change::new(
                        EventType::NodeConditionEvidenceGone,
                        Axis::Conditions,
                        None::<String>,
                        Some(kind),
                    )
                    .with_detail(format!(
                        "{kind}: a report no longer shows the evidence; it stays set, as it {}",
                        rule.describe()
                    )),
                ])
            }
            // Already cleared (by proof or by hand): a report without evidence keeps how.
            (false, Some(_), Some(ConditionStatus::False)) => Ok(Vec::new()),
            (false, ..) => self.set_condition(kind, status, reason, message, true, by, now),
        }
    }

    /// A command on this node ended: every `true` condition whose clear rule is a proof of
    /// commands takes it into account ([`clear::observe`]). A step satisfied writes
    /// `node.condition_proof_step`; the last one clears the condition (reason `Proven`) and
    /// its `noScheduleReasons` entry; a failed verification writes
    /// `node.condition_proof_restarted`.
    pub fn observe_command(
        &mut self,
        command: &crate::command::Command,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let mut changes = Vec::new();
        let proving: Vec<String> = self
            .conditions
            .iter()
            .filter(|c| c.status == ConditionStatus::True)
            .map(|c| c.kind.clone())
            .collect();
        for kind in proving {
            let rule = ClearRule::for_condition(&kind);
            let steps = rule.steps();
            if steps.is_empty() {
                continue;
            }
            let Some(condition) = self.conditions.iter_mut().find(|c| c.kind == kind) else {
                continue;
            };
            let raised = condition.last_transition_at;
            let proof = condition.proof.get_or_insert_with(|| Proof::new(raised));
            let before = proof.progress(steps.len());
            match clear::observe(steps, proof, command, now) {
                ProofEffect::None => {}
                ProofEffect::Advanced { step, complete } => {
                    let after = proof.progress(steps.len());
                    let done: Vec<String> = proof
                        .satisfied
                        .iter()
                        .map(|s| format!("{} {}", s.kind, s.command_id))
                        .collect();
                    condition.updated_at = now;
                    changes.push(
                        Change::new(
                            EventType::NodeConditionProofStep,
                            Axis::Conditions,
                            Some(format!("{kind} {before}")),
                            Some(format!("{kind} {after}")),
                        )
                        .with_detail(format!(
                            "{kind}: step {} of {} satisfied ({}: {} {})",
                            step + 1,
                            steps.len(),
                            steps[step].describe(),
                            command.kind,
                            command.id
                        )),
                    );
                    if complete {
                        let no_schedule = condition.no_schedule;
                        let message = format!("proven: {}", done.join(", then "));
                        changes.extend(self.set_condition(
                            &kind,
                            ConditionStatus::False,
                            "Proven",
                            &message,
                            no_schedule,
                            by,
                            now,
                        )?);
                    }
                }
                ProofEffect::Restarted(why) => {
                    condition.updated_at = now;
                    changes.push(
                        Change::new(
                            EventType::NodeConditionProofRestarted,
                            Axis::Conditions,
                            Some(format!("{kind} {before}")),
                            Some(format!("{kind} 0/{}", steps.len())),
                        )
                        .with_detail(format!("{kind}: {why}")),
                    );
                }
            }
        }
        Ok(changes)
    }

    /// An operator clears a `true` condition by hand, with a reason of their own (which the
    /// condition and its event keep, with the operator as the actor). Clearing
    /// `GpuNeedsPerson` also ends the maintenance that remediation turned on when it gave up
    /// (maintenance on a node that is not `failed`: a failed workflow's maintenance ends only
    /// with `recover`).
    pub fn clear_condition_by_hand(
        &mut self,
        kind: &str,
        reason: &str,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let reason = validate_reason(reason)?;
        let Some(no_schedule) = self
            .conditions
            .iter()
            .find(|c| c.kind == kind && c.status == ConditionStatus::True)
            .map(|c| c.no_schedule)
        else {
            return Err(DomainError::BadInput(format!(
                "condition `{kind}` is not set on node {}: there is nothing to clear",
                self.id
            )));
        };
        let said = format!("cleared by hand by {by}: {reason}");
        let mut changes = self.set_condition(
            kind,
            ConditionStatus::False,
            "ClearedByOperator",
            &said,
            no_schedule,
            by,
            now,
        )?;
        if let Some(first) = changes.first_mut() {
            first.detail = Some(said);
        }
        if kind == crate::clear::GPU_NEEDS_PERSON
            && self.maintenance
            && self.provision_state != ProvisionState::Failed
        {
            changes.extend(self.set_maintenance(false, None));
        }
        Ok(changes)
    }

    /// Health remediation gave up on `condition`: maintenance on, and `GpuNeedsPerson` set
    /// (the seed's rule), both saying why.
    pub fn give_up_remediation(
        &mut self,
        condition: &str,
        why: &str,
        by: &Actor,
        now: DateTime<Utc>,
    ) -> Result<Vec<Change>, DomainError> {
        let said = format!("remediation of {condition} gave up: {why}");
        let mut changes: Vec<Change> = self
            .set_maintenance(true, Some(said.clone()))
            .into_iter()
            .collect();
        changes.extend(self.report_condition(
            crate::clear::GPU_NEEDS_PERSON,
            ConditionStatus::True,
            "RemediationGaveUp",
            &format!("{said}; a person must look at the machine"),
            by,
            now,
        )?);
        Ok(changes)
    }

    /// Records the hardware key computed from the node's reported identifiers.
    pub fn set_hardware_key(&mut self, key: Option<String>, trusted: bool) -> Vec<Change> {
        if self.hardware_key == key && self.hardware_key_trusted == trusted {
            return Vec::new();
        }
        let describe = |key: &Option<String>, trusted: bool| {
            key.as_ref().map(|k| {
                format!(
                    "{}…{}",
                    &k[..k.len().min(12)],
                    if trusted { " (trusted)" } else { "" }
                )
            })
        };
        let change = Change::new(
            EventType::NodeHardwareKeyChanged,
            Axis::Inventory,
            describe(&self.hardware_key, self.hardware_key_trusted),
            describe(&key, trusted),
        );
        self.hardware_key = key;
        self.hardware_key_trusted = trusted;
        vec![change]
    }

    /// The NodeSpec controller writes a new desired-state generation.
    pub fn bump_generation(&mut self, why: &str) -> Vec<Change> {
        let from = self.generation;
        self.generation += 1;
        vec![
            Change::new(
                EventType::NodeSpecGeneration,
                Axis::Generation,
                Some(from.to_string()),
                Some(self.generation.to_string()),
            )
            .with_detail(why),
        ]
    }

    /// The daemon reports the spec generation it converged. It may only move forward, and
    /// never past the generation the control plane asked for.
    pub fn report_observed_generation(
        &mut self,
        observed: i64,
    ) -> Result<Vec<Change>, DomainError> {
        if observed == self.observed_generation {
            return Ok(Vec::new());
        }
        if observed < 0 || observed > self.generation {
            return Err(DomainError::BadInput(format!(
                "observedGeneration {observed} is outside 0..={} (the node's spec generation)",
                self.generation
            )));
        }
        if observed < self.observed_generation {
            // A daemon restarted from an older state; it will converge again. Keep the
            // highest generation seen rather than going backwards.
            return Ok(Vec::new());
        }
        let from = self.observed_generation;
        self.observed_generation = observed;
        Ok(vec![Change::new(
            EventType::NodeObservedGeneration,
            Axis::ObservedGeneration,
            Some(from.to_string()),
            Some(observed.to_string()),
        )])
    }

    /// `nodes.revokeIdentity`: an operator's decision, so it needs a reason.
    pub fn revoke_identity(&mut self, reason: &str) -> Result<Vec<Change>, DomainError> {
        let reason = validate_reason(reason)?;
        Ok(self.bump_identity_generation(&reason))
    }

    /// Every identity replacement (revocation, re-join in place, deletion): certificates of
    /// the old generation never work again.
    pub fn bump_identity_generation(&mut self, why: &str) -> Vec<Change> {
        let from = self.identity_generation;
        self.identity_generation += 1;
        vec![
            Change::new(
                EventType::NodeIdentityRevoked,
                Axis::IdentityGeneration,
                Some(from.to_string()),
                Some(self.identity_generation.to_string()),
            )
            .with_detail(why),
        ]
    }

    /// `nodes.delete`: the row stays (soft delete) so the history stays queryable; the
    /// identity is revoked so the machine's certificate stops working.
    pub fn delete(&mut self, now: DateTime<Utc>) -> Result<Vec<Change>, DomainError> {
        if self.deleted_at.is_some() {
            return Err(DomainError::NotFound {
                kind: "node",
                id: self.id.to_string(),
            });
        }
        provision::check_deletable(self.provision_state)?;
        let mut changes = self.bump_identity_generation("node deleted");
        self.deleted_at = Some(now);
        changes.push(Change::new(
            EventType::NodeDeleted,
            Axis::Lifecycle,
            Some("present"),
            Some("deleted"),
        ));
        Ok(changes)
    }

    fn add_reason(
        &mut self,
        key: ReasonKey,
        by: &Actor,
        now: DateTime<Utc>,
        detail: Option<String>,
    ) -> Option<Change> {
        // An empty detail is no detail (storage keeps `""` as none), so the record in memory
        // equals the record read back, which the history's rebuild relies on.
        let detail = detail.filter(|d| !d.is_empty());
        if let Some(existing) = self.no_schedule_reasons.iter_mut().find(|r| r.key == key) {
            // Same reason again: keep who set it first and since when, refresh the detail.
            existing.detail = detail;
            return None;
        }
        let rendered = key.to_string();
        self.no_schedule_reasons.push(NoScheduleReason {
            key,
            set_by: by.clone(),
            since: now,
            detail,
        });
        self.no_schedule_reasons.sort_by(|a, b| a.key.cmp(&b.key));
        Some(
            Change::new(
                EventType::NodeNoScheduleReasonAdded,
                Axis::NoScheduleReasons,
                None::<String>,
                Some(rendered.clone()),
            )
            .with_key(rendered),
        )
    }

    fn remove_reason(&mut self, key: &ReasonKey) -> Option<Change> {
        let index = self
            .no_schedule_reasons
            .iter()
            .position(|r| &r.key == key)?;
        self.no_schedule_reasons.remove(index);
        Some(
            Change::new(
                EventType::NodeNoScheduleReasonRemoved,
                Axis::NoScheduleReasons,
                Some(key.to_string()),
                None::<String>,
            )
            .with_key(key.to_string()),
        )
    }

    /// The reason keys alone, sorted: the seed's one column the placer reads.
    pub fn reason_keys(&self) -> Vec<String> {
        self.no_schedule_reasons
            .iter()
            .map(|r| r.key.to_string())
            .collect()
    }
}

fn render_taint(taint: &Taint) -> String {
    format!("{}={}:{}", taint.key, taint.value, taint.effect)
}

fn validate_reason(reason: &str) -> Result<String, DomainError> {
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(DomainError::BadInput("a reason is required".into()));
    }
    if reason.len() > MAX_REASON_LEN {
        return Err(DomainError::BadInput(format!(
            "the reason is longer than {MAX_REASON_LEN} bytes"
        )));
    }
    Ok(reason.to_owned())
}

/// A DNS name: labels of letters, digits and hyphens, separated by dots.
pub fn validate_hostname(hostname: &str) -> Result<(), DomainError> {
    let valid = !hostname.is_empty()
        && hostname.len() <= MAX_HOSTNAME_LEN
        && hostname.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if valid {
        Ok(())
    } else {
        Err(DomainError::BadInput(format!(
            "`{hostname}` is not a valid hostname"
        )))
    }
}

fn is_label_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_LABEL_PART_LEN
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Kubernetes' label key syntax: an optional DNS prefix and a slash, then a name of at most
/// 63 characters.
pub fn validate_label_key(key: &str) -> Result<(), DomainError> {
    let valid = match key.split_once('/') {
        Some((prefix, name)) => validate_hostname(prefix).is_ok() && is_label_name(name),
        None => is_label_name(key),
    };
    if valid {
        Ok(())
    } else {
        Err(DomainError::BadInput(format!(
            "`{key}` is not a valid key ([prefix/]name, name at most 63 of a-z0-9-_.)"
        )))
    }
}

/// Kubernetes' label value syntax: empty, or a label name.
pub fn validate_label_value(value: &str) -> Result<(), DomainError> {
    if value.is_empty() || is_label_name(value) {
        Ok(())
    } else {
        Err(DomainError::BadInput(format!(
            "`{value}` is not a valid value (at most 63 of a-z0-9-_.)"
        )))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use chrono::{Duration, TimeZone};

    pub(crate) fn t0() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0)
            .single()
            .expect("valid time")
    }

    pub(crate) fn node(state: ProvisionState) -> NodeRecord {
        NodeRecord::new(
            NewNode {
                hostname: "gpu-001.dc1.example.com".into(),
                site_id: SiteId::parse("site_dc1").expect("id"),
                pool_id: Some(PoolId::parse("pool_h100").expect("id")),
                owner_tenant_id: None,
                role: Role::Host,
                trust: Trust::Platform,
                adapter: Adapter::BcdV1,
                drivers: BTreeMap::new(),
                provision_state: state,
            },
            t0(),
        )
        .expect("valid node")
    }

    fn alice() -> Actor {
        Actor::User("alice".into())
    }

    #[test]
    fn fail_records_failed_from_and_turns_maintenance_on_and_recover_undoes_it() {
        let mut n = node(ProvisionState::Deploying);
        let changes = n
            .apply_move(ProvisionMove::Fail, Some("image checksum mismatch"))
            .expect("legal");
        assert_eq!(n.provision_state, ProvisionState::Failed);
        assert_eq!(n.failed_from, Some(ProvisionState::Deploying));
        assert!(n.maintenance);
        assert_eq!(
            n.maintenance_reason.as_deref(),
            Some("image checksum mismatch")
        );
        let axes: Vec<Axis> = changes.iter().map(|c| c.axis).collect();
        assert_eq!(axes, vec![Axis::ProvisionState, Axis::Maintenance]);

        let changes = n.apply_move(ProvisionMove::Recover, None).expect("legal");
        assert_eq!(n.provision_state, ProvisionState::Deploying);
        assert_eq!((n.failed_from, n.maintenance), (None, false));
        assert_eq!(changes.len(), 2);
    }

    #[test]
    fn an_illegal_move_changes_nothing() {
        let mut n = node(ProvisionState::Adopted);
        let before = n.clone();
        assert!(matches!(
            n.apply_move(ProvisionMove::Deploy, None),
            Err(DomainError::InvalidState { .. })
        ));
        assert_eq!(n, before);
    }

    #[test]
    fn drain_cordons_and_keeps_draining_until_uncordon() {
        let mut n = node(ProvisionState::Adopted);
        let deadline = t0() + Duration::hours(2);
        let changes = n
            .drain("firmware update", Some(deadline), &alice(), t0())
            .expect("valid");
        assert!(n.cordoned());
        assert!(n.has_reason(&ReasonKey::Draining));
        assert_eq!(
            changes.iter().map(|c| c.event_type).collect::<Vec<_>>(),
            vec![
                EventType::NodeCordoned,
                EventType::NodeNoScheduleReasonAdded,
                EventType::NodeDrainStarted
            ]
        );
        // Draining again with the same deadline changes nothing.
        assert!(
            n.drain("firmware update", Some(deadline), &alice(), t0())
                .expect("valid")
                .is_empty()
        );

        let changes = n.uncordon();
        assert!(!n.cordoned() && n.drain.is_none() && n.no_schedule_reasons.is_empty());
        assert_eq!(changes.len(), 2);
    }

    #[test]
    fn drain_refuses_a_past_deadline_and_finishing_keeps_the_cordon() {
        let mut n = node(ProvisionState::Adopted);
        let err = n
            .drain("x", Some(t0()), &alice(), t0())
            .expect_err("past deadline");
        assert!(matches!(err, DomainError::BadInput(_)));
        assert!(!n.cordoned(), "a refused drain must not cordon");

        n.drain("x", None, &alice(), t0()).expect("valid");
        let changes = n.finish_drain("deadline passed");
        assert!(n.cordoned() && !n.has_reason(&ReasonKey::Draining));
        assert_eq!(changes.len(), 2);
        assert!(n.finish_drain("again").is_empty());
    }

    #[test]
    fn cordon_needs_a_reason_and_is_idempotent() {
        let mut n = node(ProvisionState::Adopted);
        assert!(matches!(
            n.cordon("  ", &alice(), t0()),
            Err(DomainError::BadInput(_))
        ));
        assert_eq!(
            n.cordon("rack move", &alice(), t0()).expect("valid").len(),
            1
        );
        assert!(n.cordon("again", &alice(), t0()).expect("valid").is_empty());
        assert_eq!(
            n.cordon.as_ref().map(|c| c.reason.as_str()),
            Some("rack move")
        );
    }

    #[test]
    fn taints_drive_their_reasons() {
        let mut n = node(ProvisionState::Adopted);
        n.taint(
            "gpu-burn",
            "running",
            TaintEffect::NoSchedule,
            &alice(),
            t0(),
        )
        .expect("valid");
        assert!(n.has_reason(&ReasonKey::Taint("gpu-burn".into())));
        assert!(
            n.taint(
                "gpu-burn",
                "running",
                TaintEffect::NoSchedule,
                &alice(),
                t0()
            )
            .expect("valid")
            .is_empty()
        );
        n.taint(
            "gpu-burn",
            "running",
            TaintEffect::PreferNoSchedule,
            &alice(),
            t0(),
        )
        .expect("valid");
        assert!(n.no_schedule_reasons.is_empty());
        n.taint("gpu-burn", "x", TaintEffect::NoSchedule, &alice(), t0())
            .expect("valid");
        n.untaint("gpu-burn").expect("present");
        assert!(n.no_schedule_reasons.is_empty() && n.taints.is_empty());
        assert!(matches!(
            n.untaint("gpu-burn"),
            Err(DomainError::NotFound { .. })
        ));
        assert!(matches!(
            n.taint("Bad Key", "", TaintEffect::NoSchedule, &alice(), t0()),
            Err(DomainError::BadInput(_))
        ));
    }

    #[test]
    fn labels_validate_and_report_only_real_changes() {
        let mut n = node(ProvisionState::Adopted);
        let set = BTreeMap::from([("gpu.example.com/model".to_owned(), "H100".to_owned())]);
        assert_eq!(n.update_labels(&set, &[]).expect("valid").len(), 1);
        assert!(n.update_labels(&set, &[]).expect("valid").is_empty());
        assert!(
            n.update_labels(&BTreeMap::new(), &["absent".into()])
                .expect("valid")
                .is_empty()
        );
        assert_eq!(
            n.update_labels(&BTreeMap::new(), &["gpu.example.com/model".into()])
                .expect("valid")
                .len(),
            1
        );
        let bad = BTreeMap::from([("-x".to_owned(), "y".to_owned())]);
        assert!(n.update_labels(&bad, &[]).is_err());
        let both = BTreeMap::from([("a".to_owned(), "b".to_owned())]);
        assert!(n.update_labels(&both, &["a".into()]).is_err());
    }

    #[test]
    fn inventory_labels_are_inventorys_alone() {
        let mut n = node(ProvisionState::Adopted);
        let key = format!("{}gpu-model", crate::health::INVENTORY_LABEL_PREFIX);
        let facts = crate::health::InventoryFacts {
            devices: None,
            labels: BTreeMap::from([(key.clone(), "H100".to_owned())]),
            conditions: Vec::new(),
        };
        let operator = BTreeMap::from([("team".to_owned(), "ml".to_owned())]);
        n.update_labels(&operator, &[])
            .expect("an operator's label");
        assert_eq!(
            n.apply_inventory(&facts, &alice(), t0())
                .expect("applied")
                .len(),
            1
        );
        let forged = BTreeMap::from([(key.clone(), "A100".to_owned())]);
        let refused = n.update_labels(&forged, &[]).expect_err("inventory's");
        assert_eq!(
            refused,
            DomainError::ReservedLabel {
                key: key.clone(),
                owner: "inventory"
            }
        );
        assert!(
            n.update_labels(&BTreeMap::new(), std::slice::from_ref(&key))
                .is_err()
        );
        assert_eq!(n.labels[&key], "H100");
        // A report without the label removes it; the operator's stays, and the GPU count is
        // left alone while `gpus` was never reported.
        let empty = crate::health::InventoryFacts {
            devices: None,
            labels: BTreeMap::new(),
            conditions: Vec::new(),
        };
        n.gpu_count = 8;
        n.apply_inventory(&empty, &alice(), t0()).expect("applied");
        assert!(!n.labels.contains_key(&key));
        assert_eq!(n.labels["team"], "ml");
        assert_eq!(n.gpu_count, 8);
    }

    #[test]
    fn a_report_changes_its_inventory_labels_in_one_event() {
        let key = |name: &str| format!("{}{name}", crate::health::INVENTORY_LABEL_PREFIX);
        let facts = |labels: &[(&str, &str)]| crate::health::InventoryFacts {
            devices: None,
            labels: labels
                .iter()
                .map(|(name, value)| (key(name), (*value).to_owned()))
                .collect(),
            conditions: Vec::new(),
        };
        let labels_changed = |from: Option<String>, to: Option<String>| {
            vec![Change::new(
                EventType::NodeInventoryLabelsChanged,
                Axis::Labels,
                from,
                to,
            )]
        };
        let mut n = node(ProvisionState::Adopted);
        let first = facts(&[("gpu-model", "H100"), ("gpu-count", "8"), ("os", "ubuntu")]);
        assert_eq!(
            n.apply_inventory(&first, &alice(), t0()).expect("applied"),
            labels_changed(
                None,
                Some(format!(
                    "{}=8, {}=H100, {}=ubuntu",
                    key("gpu-count"),
                    key("gpu-model"),
                    key("os")
                ))
            )
        );
        // The same report again changes nothing, so it records nothing.
        assert!(
            n.apply_inventory(&first, &alice(), t0())
                .expect("applied")
                .is_empty()
        );

        // One label changed, one gone, one new: one event naming those three, with the detail
        // of each.
        let before = n.clone();
        let next = facts(&[("gpu-model", "H200"), ("gpu-count", "8"), ("kernel", "6.1")]);
        let changes = n.apply_inventory(&next, &alice(), t0()).expect("applied");
        assert_eq!(
            changes,
            labels_changed(
                Some(format!("{}=H100, {}=ubuntu", key("gpu-model"), key("os"))),
                Some(format!("{}=H200, {}=6.1", key("gpu-model"), key("kernel")))
            )
        );
        assert_eq!(
            crate::history::change_detail(&changes[0], Some(&before), &n),
            serde_json::json!({ "labels": [
                { "key": key("gpu-model"), "value": "H200", "previous": "H100" },
                { "key": key("kernel"), "value": "6.1", "previous": null },
                { "key": key("os"), "value": null, "previous": "ubuntu" },
            ] })
        );

        // A label outside inventory's prefix, or an invalid value, is refused and changes
        // nothing.
        let current = n.labels.clone();
        let outside = crate::health::InventoryFacts {
            devices: None,
            labels: BTreeMap::from([("team".to_owned(), "ml".to_owned())]),
            conditions: Vec::new(),
        };
        assert!(n.apply_inventory(&outside, &alice(), t0()).is_err());
        assert!(
            n.apply_inventory(&facts(&[("os", "no spaces")]), &alice(), t0())
                .is_err()
        );
        assert_eq!(n.labels, current);
    }

    #[test]
    fn no_schedule_conditions_drive_their_reasons() {
        let mut n = node(ProvisionState::Adopted);
        let by = Actor::Controller("inventory".into());
        n.set_condition(
            "GpuCountMismatch",
            ConditionStatus::True,
            "Expected8Got7",
            "7 of 8 GPUs",
            true,
            &by,
            t0(),
        )
        .expect("valid");
        assert_eq!(n.reason_keys(), vec!["GpuCountMismatch".to_owned()]);
        let later = t0() + Duration::minutes(5);
        let changes = n
            .set_condition(
                "GpuCountMismatch",
                ConditionStatus::False,
                "Expected8Got8",
                "",
                true,
                &by,
                later,
            )
            .expect("valid");
        assert!(n.no_schedule_reasons.is_empty());
        assert_eq!(changes.len(), 2);
        assert_eq!(n.conditions[0].last_transition_at, later);
    }

    #[test]
    fn connectivity_keeps_unreachable_in_reasons() {
        let mut n = node(ProvisionState::Adopted);
        let liveness = Actor::Controller("liveness".into());
        n.set_connectivity(Connectivity::Connected, &liveness, t0());
        n.set_connectivity(Connectivity::Unreachable, &liveness, t0());
        n.set_connectivity(Connectivity::Lost, &liveness, t0());
        assert_eq!(n.reason_keys(), vec!["unreachable".to_owned()]);
        n.set_connectivity(Connectivity::Connected, &liveness, t0());
        assert!(n.no_schedule_reasons.is_empty());
    }

    #[test]
    fn delete_needs_an_idle_state_and_revokes_identity() {
        let mut n = node(ProvisionState::Adopted);
        assert!(matches!(
            n.delete(t0()),
            Err(DomainError::InvalidState { .. })
        ));
        let mut n = node(ProvisionState::Retired);
        n.delete(t0()).expect("retired nodes can be deleted");
        assert_eq!(n.identity_generation, 2);
        assert!(n.deleted_at.is_some());
        assert!(matches!(n.delete(t0()), Err(DomainError::NotFound { .. })));
    }
}
