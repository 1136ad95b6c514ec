//! Explicit mapping between storage rows (`bc_entity`) and domain types (`bc_core`).
//!
//! A row that does not map (an unknown enum spelling, a malformed id) is a corrupt row: it
//! is reported as an internal error naming the table and column, never guessed at.

use anyhow::{Context, anyhow};
use bc_core::Actor;
use bc_core::catalog::{HardwareProfile, Pool, Site, Tenant};
use bc_core::event::{Axis, RecordedEvent};
use bc_core::ids::{EventId, NodeId, PoolId, SiteId, TenantId};
use bc_core::node::{Condition, Cordon, Drain, NodeRecord, Session, Taint};
use bc_core::reason::{NoScheduleReason, ReasonKey};
use bc_entity::{
    event, node, node_condition, node_label, node_no_schedule_reason, node_session, node_taint,
    pool, site, tenant,
};
use sea_orm::ActiveValue::Set;
use std::collections::BTreeMap;
use std::str::FromStr;

fn parse<T: FromStr>(table: &str, column: &str, raw: &str) -> anyhow::Result<T> {
    raw.parse::<T>()
        .map_err(|_| anyhow!("corrupt row: {table}.{column} = `{raw}`"))
}

fn actor(table: &str, column: &str, raw: &str) -> anyhow::Result<Actor> {
    Actor::parse(raw).ok_or_else(|| anyhow!("corrupt row: {table}.{column} = `{raw}`"))
}

fn id<T>(
    table: &str,
    column: &str,
    raw: &str,
    parse: fn(&str) -> Result<T, bc_core::DomainError>,
) -> anyhow::Result<T> {
    parse(raw).map_err(|_| anyhow!("corrupt row: {table}.{column} = `{raw}`"))
}

fn opt_id<T>(
    table: &str,
    column: &str,
    raw: Option<&str>,
    parse: fn(&str) -> Result<T, bc_core::DomainError>,
) -> anyhow::Result<Option<T>> {
    raw.map(|raw| id(table, column, raw, parse)).transpose()
}

fn string_map(
    table: &str,
    column: &str,
    value: &serde_json::Value,
) -> anyhow::Result<BTreeMap<String, String>> {
    serde_json::from_value(value.clone()).with_context(|| format!("corrupt row: {table}.{column}"))
}

/// The child rows of one node.
#[derive(Debug)]
pub struct NodeChildren {
    pub labels: Vec<node_label::Model>,
    pub taints: Vec<node_taint::Model>,
    pub conditions: Vec<node_condition::Model>,
    pub reasons: Vec<node_no_schedule_reason::Model>,
}

pub fn node_record(row: node::Model, children: NodeChildren) -> anyhow::Result<NodeRecord> {
    const T: &str = "nodes";
    let cordon = match (
        row.cordoned,
        row.cordon_reason,
        row.cordoned_by,
        row.cordoned_at,
    ) {
        (false, ..) => None,
        (true, Some(reason), Some(by), Some(at)) => Some(Cordon {
            reason,
            by: actor(T, "cordoned_by", &by)?,
            at,
        }),
        (true, ..) => {
            return Err(anyhow!(
                "corrupt row: nodes.cordoned is true without reason, actor and time"
            ));
        }
    };
    let drain = row.drain_started_at.map(|started_at| Drain {
        started_at,
        deadline: row.drain_deadline,
    });

    let mut taints = children
        .taints
        .into_iter()
        .map(|t| {
            Ok(Taint {
                effect: parse("node_taints", "effect", &t.effect)?,
                added_by: actor("node_taints", "added_by", &t.added_by)?,
                key: t.key,
                value: t.value,
                added_at: t.added_at,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    taints.sort_by(|a, b| a.key.cmp(&b.key));
    let mut conditions = children
        .conditions
        .into_iter()
        .map(|c| {
            Ok(Condition {
                status: parse("node_conditions", "status", &c.status)?,
                set_by: actor("node_conditions", "set_by", &c.set_by)?,
                kind: c.condition_type,
                reason: c.reason,
                message: c.message,
                no_schedule: c.no_schedule,
                last_transition_at: c.last_transition_at,
                updated_at: c.updated_at,
                proof: c
                    .proof
                    .map(serde_json::from_value)
                    .transpose()
                    .context("corrupt row: node_conditions.proof")?,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    conditions.sort_by(|a, b| a.kind.cmp(&b.kind));
    let mut reasons = children
        .reasons
        .into_iter()
        .map(|r| {
            Ok(NoScheduleReason {
                key: ReasonKey::parse(&r.reason).ok_or_else(|| {
                    anyhow!(
                        "corrupt row: node_no_schedule_reasons.reason = `{}`",
                        r.reason
                    )
                })?,
                set_by: actor("node_no_schedule_reasons", "set_by", &r.set_by)?,
                since: r.since,
                detail: (!r.detail.is_empty()).then_some(r.detail),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    reasons.sort_by(|a, b| a.key.cmp(&b.key));

    // The column the placer reads and the detail rows are written together; a mismatch
    // means someone wrote one without the other.
    let column: Vec<String> =
        serde_json::from_str(&row.no_schedule_reasons).with_context(|| {
            format!(
                "corrupt row: nodes.no_schedule_reasons = `{}`",
                row.no_schedule_reasons
            )
        })?;
    let detail_keys: Vec<String> = reasons.iter().map(|r| r.key.to_string()).collect();
    if column != detail_keys {
        return Err(anyhow!(
            "corrupt row: nodes.no_schedule_reasons {column:?} disagrees with node_no_schedule_reasons {detail_keys:?} for {}",
            row.id
        ));
    }

    Ok(NodeRecord {
        id: id(T, "id", &row.id, NodeId::parse)?,
        hostname: row.hostname,
        site_id: id(T, "site_id", &row.site_id, SiteId::parse)?,
        pool_id: opt_id(T, "pool_id", row.pool_id.as_deref(), PoolId::parse)?,
        owner_tenant_id: opt_id(
            T,
            "owner_tenant_id",
            row.owner_tenant_id.as_deref(),
            TenantId::parse,
        )?,
        role: parse(T, "role", &row.role)?,
        trust: parse(T, "trust", &row.trust)?,
        adapter: parse(T, "adapter", &row.adapter)?,
        drivers: string_map(T, "drivers", &row.drivers)?,
        hardware_key: row.hardware_key,
        hardware_key_trusted: row.hardware_key_trusted,
        generation: row.generation,
        observed_generation: row.observed_generation,
        identity_generation: row.identity_generation,
        version: row.version,
        provision_state: parse(T, "provision_state", &row.provision_state)?,
        failed_from: row
            .failed_from
            .as_deref()
            .map(|s| parse(T, "failed_from", s))
            .transpose()?,
        maintenance: row.maintenance,
        maintenance_reason: row.maintenance_reason,
        cordon,
        drain,
        power: parse(T, "power", &row.power)?,
        connectivity: parse(T, "connectivity", &row.connectivity)?,
        connectivity_since: row.connectivity_since,
        no_schedule_reasons: reasons,
        labels: children
            .labels
            .into_iter()
            .map(|l| (l.key, l.value))
            .collect(),
        taints,
        conditions,
        gpu_count: row.gpu_count,
        created_at: row.created_at,
        updated_at: row.updated_at,
        deleted_at: row.deleted_at,
    })
}

/// Every column of the node row, set from the record.
pub fn node_row(node: &NodeRecord) -> anyhow::Result<node::ActiveModel> {
    Ok(node::ActiveModel {
        id: Set(node.id.to_string()),
        hostname: Set(node.hostname.clone()),
        site_id: Set(node.site_id.to_string()),
        pool_id: Set(node.pool_id.as_ref().map(ToString::to_string)),
        owner_tenant_id: Set(node.owner_tenant_id.as_ref().map(ToString::to_string)),
        role: Set(node.role.to_string()),
        trust: Set(node.trust.to_string()),
        adapter: Set(node.adapter.to_string()),
        drivers: Set(serde_json::to_value(&node.drivers)?),
        hardware_key: Set(node.hardware_key.clone()),
        hardware_key_trusted: Set(node.hardware_key_trusted),
        generation: Set(node.generation),
        observed_generation: Set(node.observed_generation),
        identity_generation: Set(node.identity_generation),
        version: Set(node.version),
        provision_state: Set(node.provision_state.to_string()),
        failed_from: Set(node.failed_from.map(|s| s.to_string())),
        maintenance: Set(node.maintenance),
        maintenance_reason: Set(node.maintenance_reason.clone()),
        cordoned: Set(node.cordon.is_some()),
        cordon_reason: Set(node.cordon.as_ref().map(|c| c.reason.clone())),
        cordoned_by: Set(node.cordon.as_ref().map(|c| c.by.to_string())),
        cordoned_at: Set(node.cordon.as_ref().map(|c| c.at)),
        drain_started_at: Set(node.drain.as_ref().map(|d| d.started_at)),
        drain_deadline: Set(node.drain.as_ref().and_then(|d| d.deadline)),
        power: Set(node.power.to_string()),
        connectivity: Set(node.connectivity.to_string()),
        connectivity_since: Set(node.connectivity_since),
        no_schedule_reasons: Set(serde_json::to_string(&node.reason_keys())?),
        gpu_count: Set(node.gpu_count),
        created_at: Set(node.created_at),
        updated_at: Set(node.updated_at),
        deleted_at: Set(node.deleted_at),
    })
}

pub fn label_rows(node: &NodeRecord) -> Vec<node_label::ActiveModel> {
    node.labels
        .iter()
        .map(|(key, value)| node_label::ActiveModel {
            node_id: Set(node.id.to_string()),
            key: Set(key.clone()),
            value: Set(value.clone()),
        })
        .collect()
}

pub fn taint_rows(node: &NodeRecord) -> Vec<node_taint::ActiveModel> {
    node.taints
        .iter()
        .map(|t| node_taint::ActiveModel {
            node_id: Set(node.id.to_string()),
            key: Set(t.key.clone()),
            value: Set(t.value.clone()),
            effect: Set(t.effect.to_string()),
            added_by: Set(t.added_by.to_string()),
            added_at: Set(t.added_at),
        })
        .collect()
}

pub fn condition_rows(node: &NodeRecord) -> Vec<node_condition::ActiveModel> {
    node.conditions
        .iter()
        .map(|c| node_condition::ActiveModel {
            node_id: Set(node.id.to_string()),
            condition_type: Set(c.kind.clone()),
            status: Set(c.status.to_string()),
            reason: Set(c.reason.clone()),
            message: Set(c.message.clone()),
            no_schedule: Set(c.no_schedule),
            set_by: Set(c.set_by.to_string()),
            last_transition_at: Set(c.last_transition_at),
            updated_at: Set(c.updated_at),
            proof: Set(c.proof.as_ref().and_then(|p| serde_json::to_value(p).ok())),
        })
        .collect()
}

pub fn reason_rows(node: &NodeRecord) -> Vec<node_no_schedule_reason::ActiveModel> {
    node.no_schedule_reasons
        .iter()
        .map(|r| node_no_schedule_reason::ActiveModel {
            node_id: Set(node.id.to_string()),
            reason: Set(r.key.to_string()),
            set_by: Set(r.set_by.to_string()),
            since: Set(r.since),
            detail: Set(r.detail.clone().unwrap_or_default()),
        })
        .collect()
}

/// A device row. Every device is a GPU today; a row of another kind was written by a newer
/// version of this code and is reported rather than misread.
pub fn device(row: bc_entity::node_device::Model) -> anyhow::Result<bc_core::health::Device> {
    if row.kind != bc_core::health::GPU_DEVICE_KIND {
        anyhow::bail!("corrupt row: node_devices.kind = `{}`", row.kind);
    }
    Ok(bc_core::health::Device {
        name: row.name,
        uuid: row.uuid,
        pci_bus_id: row.pci_bus_id,
        model: row.model,
        memory_mib: u64::try_from(row.memory_mib).map_err(|_| {
            anyhow::anyhow!("corrupt row: node_devices.memory_mib = {}", row.memory_mib)
        })?,
        serial: row.serial,
        atom: row.atom,
        healthy: row.healthy,
    })
}

pub fn session(row: node_session::Model) -> Session {
    Session {
        epoch: row.epoch,
        gateway_id: row.gateway_id,
        connected_at: row.connected_at,
        disconnected_at: row.disconnected_at,
        last_seen: row.last_seen,
    }
}

pub fn tenant(row: tenant::Model) -> anyhow::Result<Tenant> {
    Ok(Tenant {
        id: id("tenants", "id", &row.id, TenantId::parse)?,
        name: row.name,
        created_at: row.created_at,
    })
}

pub fn site(row: site::Model) -> anyhow::Result<Site> {
    Ok(Site {
        id: id("sites", "id", &row.id, SiteId::parse)?,
        name: row.name,
        kind: parse("sites", "kind", &row.kind)?,
        owner_tenant_id: opt_id(
            "sites",
            "owner_tenant_id",
            row.owner_tenant_id.as_deref(),
            TenantId::parse,
        )?,
        created_at: row.created_at,
    })
}

pub fn pool(row: pool::Model) -> anyhow::Result<Pool> {
    Ok(Pool {
        id: id("pools", "id", &row.id, PoolId::parse)?,
        site_id: id("pools", "site_id", &row.site_id, SiteId::parse)?,
        name: row.name,
        kind: parse("pools", "kind", &row.kind)?,
        agent: parse("pools", "agent", &row.agent)?,
        owner_tenant_id: opt_id(
            "pools",
            "owner_tenant_id",
            row.owner_tenant_id.as_deref(),
            TenantId::parse,
        )?,
        hardware_profile: serde_json::from_value::<HardwareProfile>(row.hardware_profile)
            .context("corrupt row: pools.hardware_profile")?,
        drivers: string_map("pools", "drivers", &row.drivers)?,
        remediation: row
            .remediation
            .map(serde_json::from_value)
            .transpose()
            .context("corrupt row: pools.remediation")?
            .unwrap_or_default(),
        acceptance: row
            .acceptance
            .map(serde_json::from_value)
            .transpose()
            .context("corrupt row: pools.acceptance")?
            .unwrap_or_default(),
        created_at: row.created_at,
    })
}

/// An event row as the domain's read model; a type, axis, actor or id that does not parse is
/// a corrupt row.
pub fn recorded_event(row: event::Model) -> anyhow::Result<RecordedEvent> {
    Ok(RecordedEvent {
        id: EventId(row.seq),
        node_id: opt_id("events", "node_id", row.node_id.as_deref(), NodeId::parse)?,
        tenant_id: opt_id(
            "events",
            "tenant_id",
            row.tenant_id.as_deref(),
            TenantId::parse,
        )?,
        event_type: parse("events", "event_type", &row.event_type)?,
        axis: row
            .axis
            .as_deref()
            .map(|axis| parse::<Axis>("events", "axis", axis))
            .transpose()?,
        from: row.from_value,
        to: row.to_value,
        actor: actor("events", "actor", &row.actor)?,
        cause: row.cause,
        data: row.data,
        at: row.created_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::event::EventType;

    fn event_row() -> event::Model {
        event::Model {
            seq: 7,
            node_id: Some("node_a".into()),
            tenant_id: None,
            event_type: "node.cordoned".into(),
            axis: Some("cordoned".into()),
            from_value: Some("false".into()),
            to_value: Some("true".into()),
            actor: "user:alice".into(),
            cause: Some("cordonNode".into()),
            data: serde_json::json!({ "detail": "rack move", "version": 2 }),
            created_at: chrono::DateTime::UNIX_EPOCH,
            node_version: Some(2),
        }
    }

    #[test]
    fn an_event_row_maps_to_its_domain_types() {
        let e = recorded_event(event_row()).expect("a valid row");
        assert_eq!(e.id, EventId(7));
        assert_eq!(e.node_id.as_ref().map(NodeId::as_str), Some("node_a"));
        assert_eq!(e.event_type, EventType::NodeCordoned);
        assert_eq!(e.axis, Some(Axis::Cordoned));
        assert_eq!(e.actor, Actor::User("alice".into()));
        assert_eq!(e.node_version(), Some(2));
    }

    #[test]
    fn an_event_row_that_does_not_map_is_corrupt() {
        type Corrupt = fn(&mut event::Model);
        let cases: [(Corrupt, &str); 4] = [
            (
                |r| r.event_type = "node.exploded".into(),
                "events.event_type",
            ),
            (|r| r.axis = Some("mood".into()), "events.axis"),
            (|r| r.actor = "robot:x".into(), "events.actor"),
            (|r| r.node_id = Some("site_a".into()), "events.node_id"),
        ];
        for (corrupt, column) in cases {
            let mut row = event_row();
            corrupt(&mut row);
            let err = recorded_event(row).expect_err("a corrupt row");
            assert!(
                err.to_string()
                    .starts_with(&format!("corrupt row: {column} = ")),
                "{err}"
            );
        }
    }
}
