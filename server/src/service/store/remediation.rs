//! Remediation attempts: one row per try, so a restarted server resumes where it was.

use anyhow::{Context, anyhow};
use bc_core::ids::{CommandId, NodeId, RemediationId};
use bc_core::remediation::{AttemptStatus, RemediationAttempt};
use bc_entity::remediation_attempt;
use sea_orm::ActiveValue::Set;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use std::collections::BTreeSet;

fn corrupt(column: &str, value: &str) -> anyhow::Error {
    anyhow!("corrupt row: remediation_attempts.{column} = `{value}`")
}

fn command_id(column: &str, raw: Option<String>) -> anyhow::Result<Option<CommandId>> {
    raw.map(|raw| CommandId::parse(&raw).map_err(|_| corrupt(column, &raw)))
        .transpose()
}

fn attempt_from(row: remediation_attempt::Model) -> anyhow::Result<RemediationAttempt> {
    Ok(RemediationAttempt {
        id: RemediationId::parse(&row.id).map_err(|_| corrupt("id", &row.id))?,
        run_id: RemediationId::parse(&row.run_id).map_err(|_| corrupt("run_id", &row.run_id))?,
        node_id: NodeId::parse(&row.node_id).map_err(|_| corrupt("node_id", &row.node_id))?,
        condition: row.condition_type,
        ladder: serde_json::from_value(row.ladder)
            .context("corrupt row: remediation_attempts.ladder")?,
        step: u32::try_from(row.step).map_err(|_| corrupt("step", &row.step.to_string()))?,
        attempt: u32::try_from(row.attempt)
            .map_err(|_| corrupt("attempt", &row.attempt.to_string()))?,
        status: row
            .status
            .parse::<AttemptStatus>()
            .map_err(|_| corrupt("status", &row.status))?,
        action_command_id: command_id("action_command_id", row.action_command_id)?,
        refresh_command_id: command_id("refresh_command_id", row.refresh_command_id)?,
        verify_command_id: command_id("verify_command_id", row.verify_command_id)?,
        next_attempt_at: row.next_attempt_at,
        note: row.note,
        created_at: row.created_at,
        updated_at: row.updated_at,
        finished_at: row.finished_at,
    })
}

fn row(a: &RemediationAttempt) -> anyhow::Result<remediation_attempt::ActiveModel> {
    Ok(remediation_attempt::ActiveModel {
        id: Set(a.id.to_string()),
        run_id: Set(a.run_id.to_string()),
        node_id: Set(a.node_id.to_string()),
        condition_type: Set(a.condition.clone()),
        ladder: Set(serde_json::to_value(&a.ladder)?),
        step: Set(i32::try_from(a.step)?),
        attempt: Set(i32::try_from(a.attempt)?),
        action: Set(a
            .current()
            .map_or_else(String::new, |s| s.action.to_string())),
        status: Set(a.status.to_string()),
        action_command_id: Set(a.action_command_id.as_ref().map(ToString::to_string)),
        refresh_command_id: Set(a.refresh_command_id.as_ref().map(ToString::to_string)),
        verify_command_id: Set(a.verify_command_id.as_ref().map(ToString::to_string)),
        next_attempt_at: Set(a.next_attempt_at),
        note: Set(a.note.clone()),
        created_at: Set(a.created_at),
        updated_at: Set(a.updated_at),
        finished_at: Set(a.finished_at),
    })
}

fn open_statuses() -> Vec<String> {
    AttemptStatus::ALL
        .iter()
        .filter(|s| s.is_open())
        .map(ToString::to_string)
        .collect()
}

pub async fn insert(conn: &impl ConnectionTrait, a: &RemediationAttempt) -> anyhow::Result<()> {
    remediation_attempt::Entity::insert(row(a)?)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// Writes `a` if its row still has `before` as its status (a compare-and-set, the second
/// guard behind the node lock every writer holds). Returns whether it did.
pub async fn save(
    conn: &impl ConnectionTrait,
    before: AttemptStatus,
    a: &RemediationAttempt,
) -> anyhow::Result<bool> {
    let result = remediation_attempt::Entity::update_many()
        .set(row(a)?)
        .filter(remediation_attempt::Column::Id.eq(a.id.to_string()))
        .filter(remediation_attempt::Column::Status.eq(before.to_string()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// The node's open try, if any (a node has at most one: runs go one at a time).
pub async fn open_of_node(
    conn: &impl ConnectionTrait,
    node: &NodeId,
) -> anyhow::Result<Option<RemediationAttempt>> {
    remediation_attempt::Entity::find()
        .filter(remediation_attempt::Column::NodeId.eq(node.to_string()))
        .filter(remediation_attempt::Column::Status.is_in(open_statuses()))
        .order_by_desc(remediation_attempt::Column::CreatedAt)
        .order_by_desc(remediation_attempt::Column::Id)
        .one(conn)
        .await?
        .map(attempt_from)
        .transpose()
}

/// Nodes with an open try, at most `limit` (the index on `status` finds them).
pub async fn open_nodes(
    conn: &impl ConnectionTrait,
    limit: u64,
) -> anyhow::Result<BTreeSet<NodeId>> {
    let ids: Vec<String> = remediation_attempt::Entity::find()
        .select_only()
        .column(remediation_attempt::Column::NodeId)
        .filter(remediation_attempt::Column::Status.is_in(open_statuses()))
        .limit(limit)
        .into_tuple::<String>()
        .all(conn)
        .await?;
    ids.into_iter()
        .map(|id| NodeId::parse(&id).map_err(|_| corrupt("node_id", &id)))
        .collect()
}

/// The node's tries, newest first, at most `limit`.
pub async fn of_node(
    conn: &impl ConnectionTrait,
    node: &NodeId,
    limit: u64,
) -> anyhow::Result<Vec<RemediationAttempt>> {
    remediation_attempt::Entity::find()
        .filter(remediation_attempt::Column::NodeId.eq(node.to_string()))
        .order_by_desc(remediation_attempt::Column::CreatedAt)
        .order_by_desc(remediation_attempt::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(attempt_from)
        .collect()
}
