//! `bare_metal_workflows`: a node's bare-metal workflows, each with its steps as one JSON
//! column, written whole under the row's `version`.

use anyhow::Context;
use bc_core::ids::{NodeId, SiteId, WorkflowId};
use bc_core::workflow::{Step, Workflow, WorkflowStatus};
use bc_entity::{bare_metal_workflow as row, node, node_inventory_section};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use std::collections::BTreeMap;

fn from_row(r: row::Model) -> anyhow::Result<Workflow> {
    let corrupt =
        |column: &str| format!("corrupt row: bare_metal_workflows.{column} of `{}`", r.id);
    Ok(Workflow {
        id: WorkflowId::parse(&r.id).map_err(|_| anyhow::anyhow!("{}", corrupt("id")))?,
        node_id: NodeId::parse(&r.node_id)
            .map_err(|_| anyhow::anyhow!("{}", corrupt("node_id")))?,
        kind: r
            .kind
            .parse()
            .map_err(|_| anyhow::anyhow!("{}", corrupt("kind")))?,
        status: r
            .status
            .parse()
            .map_err(|_| anyhow::anyhow!("{}", corrupt("status")))?,
        current: usize::try_from(r.current_step).with_context(|| corrupt("current_step"))?,
        steps: serde_json::from_value::<Vec<Step>>(r.steps.clone())
            .with_context(|| corrupt("steps"))?,
        reason: r.reason,
        started_by: r.started_by,
        identity_generation: r.identity_generation,
        created_at: r.created_at,
        updated_at: r.updated_at,
        finished_at: r.finished_at,
        version: r.version,
    })
}

fn to_row(w: &Workflow) -> anyhow::Result<row::ActiveModel> {
    Ok(row::ActiveModel {
        id: Set(w.id.to_string()),
        node_id: Set(w.node_id.to_string()),
        kind: Set(w.kind.to_string()),
        status: Set(w.status.to_string()),
        current_step: Set(i64::try_from(w.current)?),
        steps: Set(serde_json::to_value(&w.steps)?),
        reason: Set(w.reason.clone()),
        started_by: Set(w.started_by.clone()),
        identity_generation: Set(w.identity_generation),
        version: Set(w.version),
        created_at: Set(w.created_at),
        updated_at: Set(w.updated_at),
        finished_at: Set(w.finished_at),
    })
}

pub async fn insert(conn: &impl ConnectionTrait, w: &Workflow) -> anyhow::Result<()> {
    row::Entity::insert(to_row(w)?)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// Writes `w` (whose `version` is already the next one) where the stored row is still at
/// `expected`. `false`: someone wrote it since (an abort raced a controller pass).
pub async fn save(
    conn: &impl ConnectionTrait,
    w: &Workflow,
    expected: i64,
) -> anyhow::Result<bool> {
    let result = row::Entity::update_many()
        .col_expr(row::Column::Status, Expr::value(w.status.to_string()))
        .col_expr(
            row::Column::CurrentStep,
            Expr::value(i64::try_from(w.current)?),
        )
        .col_expr(
            row::Column::Steps,
            Expr::value(serde_json::to_value(&w.steps)?),
        )
        .col_expr(row::Column::Reason, Expr::value(w.reason.clone()))
        .col_expr(row::Column::Version, Expr::value(w.version))
        .col_expr(row::Column::UpdatedAt, Expr::value(w.updated_at))
        .col_expr(row::Column::FinishedAt, Expr::value(w.finished_at))
        .filter(row::Column::Id.eq(w.id.to_string()))
        .filter(row::Column::Version.eq(expected))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// The node's running workflow, if any (at most one: a unique index keeps it so).
pub async fn running_for(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<Option<Workflow>> {
    row::Entity::find()
        .filter(row::Column::NodeId.eq(node_id.to_string()))
        .filter(row::Column::Status.eq(WorkflowStatus::Running.to_string()))
        .one(conn)
        .await?
        .map(from_row)
        .transpose()
}

/// The node's newest workflows, at most `limit`.
pub async fn of_node(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    limit: u64,
) -> anyhow::Result<Vec<Workflow>> {
    row::Entity::find()
        .filter(row::Column::NodeId.eq(node_id.to_string()))
        .order_by_desc(row::Column::CreatedAt)
        .order_by_desc(row::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(from_row)
        .collect()
}

/// Running workflows, the least recently advanced first, at most `limit`.
pub async fn running(conn: &impl ConnectionTrait, limit: u64) -> anyhow::Result<Vec<Workflow>> {
    row::Entity::find()
        .filter(row::Column::Status.eq(WorkflowStatus::Running.to_string()))
        .order_by_asc(row::Column::UpdatedAt)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(from_row)
        .collect()
}

/// The `system` and `network` inventory sections (which carry a machine's identifiers) of
/// the live nodes of `site` other than `except` created at or after `since`, at most
/// `limit` nodes: the daemons that joined as nodes of their own while a workflow waited.
pub async fn identity_sections_of_nodes_since(
    conn: &impl ConnectionTrait,
    site: &SiteId,
    except: &NodeId,
    since: DateTime<Utc>,
    limit: u64,
) -> anyhow::Result<Vec<(NodeId, BTreeMap<String, serde_json::Value>)>> {
    let ids: Vec<String> = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .filter(node::Column::SiteId.eq(site.to_string()))
        .filter(node::Column::Id.ne(except.to_string()))
        .filter(node::Column::CreatedAt.gte(since))
        .filter(node::Column::DeletedAt.is_null())
        .order_by_asc(node::Column::Id)
        .limit(limit)
        .into_tuple::<String>()
        .all(conn)
        .await?;
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut by_node: BTreeMap<String, BTreeMap<String, serde_json::Value>> = BTreeMap::new();
    for r in node_inventory_section::Entity::find()
        .filter(node_inventory_section::Column::NodeId.is_in(ids))
        .filter(node_inventory_section::Column::Section.is_in(["system", "network"]))
        .all(conn)
        .await?
    {
        by_node
            .entry(r.node_id)
            .or_default()
            .insert(r.section, r.content);
    }
    by_node
        .into_iter()
        .map(|(id, sections)| {
            Ok((
                NodeId::parse(&id).map_err(|_| {
                    anyhow::anyhow!("corrupt row: node_inventory_sections.node_id `{id}`")
                })?,
                sections,
            ))
        })
        .collect()
}

/// The identifiers a node was enrolled with, by kind.
pub async fn enrolled_identifiers(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<bc_core::workflow::Identifiers> {
    let mut out = bc_core::workflow::Identifiers::new();
    for r in bc_entity::node_enrolled_identifier::Entity::find()
        .filter(bc_entity::node_enrolled_identifier::Column::NodeId.eq(node_id.to_string()))
        .all(conn)
        .await?
    {
        out.entry(r.kind).or_default().insert(r.value);
    }
    Ok(out)
}
