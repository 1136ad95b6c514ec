//! Node rows: load (with children), insert, save, list with filters, capacity.

use anyhow::anyhow;
use bc_core::Actor;
use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::command::{CommandKind, CommandStatus};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_entity::{
    command, node, node_condition, node_inventory_section, node_label, node_no_schedule_reason,
    node_taint,
};
use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
};
use std::collections::HashMap;

use super::node_filter::NodeFilter;
use super::rows::{self, NodeChildren};

/// Reads one node. `for_update` locks the row until the transaction ends (PostgreSQL).
/// Deleted nodes are returned too; callers decide what a deleted node means to them.
pub async fn load(
    conn: &impl ConnectionTrait,
    id: &NodeId,
    for_update: bool,
) -> anyhow::Result<Option<NodeRecord>> {
    let mut select = node::Entity::find_by_id(id.to_string());
    if for_update {
        select = super::lock_for_update(select, conn);
    }
    let Some(row) = select.one(conn).await? else {
        return Ok(None);
    };
    let mut children = load_children(conn, std::slice::from_ref(&row.id)).await?;
    let node_children = children.remove(&row.id).unwrap_or_default();
    Ok(Some(rows::node_record(row, node_children)?))
}

/// Locks one node row until the transaction ends, without reading it (PostgreSQL; SQLite's
/// write transaction holds the whole database already). A transaction that writes a node's
/// session or inventory row as well as the node takes this first: node rows come first in
/// the lock order of ARCHITECTURE.md's Invariants. Returns whether the node exists.
pub async fn lock(conn: &impl ConnectionTrait, id: &NodeId) -> anyhow::Result<bool> {
    let select = node::Entity::find_by_id(id.to_string())
        .select_only()
        .column(node::Column::Id);
    let row = super::lock_for_update(select, conn)
        .into_tuple::<String>()
        .one(conn)
        .await?;
    Ok(row.is_some())
}

/// A live node's identity generation, without the rest of the node: what every gateway
/// route checks a client certificate against. `None` if the node does not exist or is
/// deleted.
pub async fn live_identity_generation(
    conn: &impl ConnectionTrait,
    id: &NodeId,
) -> anyhow::Result<Option<i64>> {
    Ok(node::Entity::find_by_id(id.to_string())
        .select_only()
        .column(node::Column::IdentityGeneration)
        .filter(node::Column::DeletedAt.is_null())
        .into_tuple::<i64>()
        .one(conn)
        .await?)
}

/// A live or deleted node's spec generation and pool, without the rest of the node (one
/// statement where [`load`] takes five): what a session's hello and an inventory report ask
/// of the node before they change it. `None` if the node does not exist.
pub async fn generation_and_pool(
    conn: &impl ConnectionTrait,
    id: &NodeId,
) -> anyhow::Result<Option<(i64, Option<bc_core::ids::PoolId>)>> {
    let row = node::Entity::find_by_id(id.to_string())
        .select_only()
        .column(node::Column::Generation)
        .column(node::Column::PoolId)
        .into_tuple::<(i64, Option<String>)>()
        .one(conn)
        .await?;
    row.map(|(generation, pool)| {
        let pool = pool
            .map(|p| bc_core::ids::PoolId::parse(&p).map_err(|e| anyhow!("pool id `{p}`: {e}")))
            .transpose()?;
        Ok((generation, pool))
    })
    .transpose()
}

/// The pools these nodes are in (nodes in no pool add nothing), in one query per thousand
/// nodes.
pub async fn pools_of(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<std::collections::BTreeSet<bc_core::ids::PoolId>> {
    let mut pools = std::collections::BTreeSet::new();
    for chunk in ids.chunks(1_000) {
        let rows = node::Entity::find()
            .select_only()
            .column(node::Column::PoolId)
            .distinct()
            .filter(node::Column::Id.is_in(chunk.iter().map(ToString::to_string)))
            .filter(node::Column::PoolId.is_not_null())
            .into_tuple::<Option<String>>()
            .all(conn)
            .await?;
        for pool in rows.into_iter().flatten() {
            pools.insert(
                bc_core::ids::PoolId::parse(&pool).map_err(|e| anyhow!("pool id `{pool}`: {e}"))?,
            );
        }
    }
    Ok(pools)
}

/// Locks several node rows until the transaction ends, in id order (the lock order of
/// ARCHITECTURE.md's Invariants), without reading them: a batch of node changes takes all
/// its node locks before it writes anything else.
pub async fn lock_many(conn: &impl ConnectionTrait, ids: &[NodeId]) -> anyhow::Result<()> {
    let mut sorted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    for chunk in sorted.chunks(1_000) {
        let select = node::Entity::find()
            .select_only()
            .column(node::Column::Id)
            .filter(node::Column::Id.is_in(chunk.iter().cloned()))
            .order_by_asc(node::Column::Id);
        super::lock_for_update(select, conn)
            .into_tuple::<String>()
            .all(conn)
            .await?;
    }
    Ok(())
}

/// The child rows (labels, taints, conditions, reasons) of several nodes, four queries in all.
async fn load_children(
    conn: &impl ConnectionTrait,
    ids: &[String],
) -> anyhow::Result<HashMap<String, NodeChildren>> {
    let mut by_node: HashMap<String, NodeChildren> = HashMap::new();
    if ids.is_empty() {
        return Ok(by_node);
    }
    let ids = ids.to_vec();
    for row in node_label::Entity::find()
        .filter(node_label::Column::NodeId.is_in(ids.clone()))
        .all(conn)
        .await?
    {
        by_node
            .entry(row.node_id.clone())
            .or_default()
            .labels
            .push(row);
    }
    for row in node_taint::Entity::find()
        .filter(node_taint::Column::NodeId.is_in(ids.clone()))
        .all(conn)
        .await?
    {
        by_node
            .entry(row.node_id.clone())
            .or_default()
            .taints
            .push(row);
    }
    for row in node_condition::Entity::find()
        .filter(node_condition::Column::NodeId.is_in(ids.clone()))
        .all(conn)
        .await?
    {
        by_node
            .entry(row.node_id.clone())
            .or_default()
            .conditions
            .push(row);
    }
    for row in node_no_schedule_reason::Entity::find()
        .filter(node_no_schedule_reason::Column::NodeId.is_in(ids))
        .all(conn)
        .await?
    {
        by_node
            .entry(row.node_id.clone())
            .or_default()
            .reasons
            .push(row);
    }
    Ok(by_node)
}

/// Writes a new node and its children.
pub async fn insert(conn: &impl ConnectionTrait, node: &NodeRecord) -> anyhow::Result<()> {
    node::Entity::insert(rows::node_row(node)?)
        .exec_without_returning(conn)
        .await?;
    write_children(conn, None, node).await
}

/// Writes `after` over `before` if the row still has `before.version`. Returns `false` when
/// it does not (someone else wrote first): the caller reports `CONFLICT`.
pub async fn save(
    conn: &impl ConnectionTrait,
    before: &NodeRecord,
    after: &NodeRecord,
) -> anyhow::Result<bool> {
    let result = node::Entity::update_many()
        .set(rows::node_row(after)?)
        .filter(node::Column::Id.eq(before.id.to_string()))
        .filter(node::Column::Version.eq(before.version))
        .exec(conn)
        .await?;
    if result.rows_affected != 1 {
        return Ok(false);
    }
    write_children(conn, Some(before), after).await?;
    Ok(true)
}

/// Rewrites each child table whose contents changed.
async fn write_children(
    conn: &impl ConnectionTrait,
    before: Option<&NodeRecord>,
    after: &NodeRecord,
) -> anyhow::Result<()> {
    let id = after.id.to_string();
    if before.is_none_or(|b| b.labels != after.labels) {
        node_label::Entity::delete_many()
            .filter(node_label::Column::NodeId.eq(&id))
            .exec(conn)
            .await?;
        let rows = rows::label_rows(after);
        if !rows.is_empty() {
            node_label::Entity::insert_many(rows)
                .exec_without_returning(conn)
                .await?;
        }
    }
    if before.is_none_or(|b| b.taints != after.taints) {
        node_taint::Entity::delete_many()
            .filter(node_taint::Column::NodeId.eq(&id))
            .exec(conn)
            .await?;
        let rows = rows::taint_rows(after);
        if !rows.is_empty() {
            node_taint::Entity::insert_many(rows)
                .exec_without_returning(conn)
                .await?;
        }
    }
    if before.is_none_or(|b| b.conditions != after.conditions) {
        node_condition::Entity::delete_many()
            .filter(node_condition::Column::NodeId.eq(&id))
            .exec(conn)
            .await?;
        let rows = rows::condition_rows(after);
        if !rows.is_empty() {
            node_condition::Entity::insert_many(rows)
                .exec_without_returning(conn)
                .await?;
        }
    }
    if before.is_none_or(|b| b.no_schedule_reasons != after.no_schedule_reasons) {
        node_no_schedule_reason::Entity::delete_many()
            .filter(node_no_schedule_reason::Column::NodeId.eq(&id))
            .exec(conn)
            .await?;
        let rows = rows::reason_rows(after);
        if !rows.is_empty() {
            node_no_schedule_reason::Entity::insert_many(rows)
                .exec_without_returning(conn)
                .await?;
        }
    }
    Ok(())
}

/// The live node holding a trusted hardware key, if any.
pub async fn by_trusted_hardware_key(
    conn: &impl ConnectionTrait,
    key: &str,
) -> anyhow::Result<Option<NodeId>> {
    let row = node::Entity::find()
        .filter(node::Column::HardwareKey.eq(key))
        .filter(node::Column::HardwareKeyTrusted.eq(true))
        .filter(node::Column::DeletedAt.is_null())
        .one(conn)
        .await?;
    row.map(|r| {
        NodeId::parse(&r.id).map_err(|_| anyhow::anyhow!("corrupt row: nodes.id = `{}`", r.id))
    })
    .transpose()
}

/// One page of nodes ordered by id, after the cursor `after`, at most `limit`.
pub async fn list(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    after: Option<&str>,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    list_with(conn, filter, after, limit, false).await
}

/// [`list`] inside a write transaction: the nodes are locked `FOR SHARE` (PostgreSQL), in id
/// order, until the transaction ends. A write transaction reads committed data statement by
/// statement, so without the lock a node changed between the read of its row and of its
/// child rows would be torn (and reported as corrupt); with it, no node changes under the
/// caller's checks until it commits. Node rows come first in the lock order of
/// ARCHITECTURE.md's Invariants.
pub async fn list_locked(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    list_with(conn, filter, None, limit, true).await
}

async fn list_with(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    after: Option<&str>,
    limit: u64,
    lock: bool,
) -> anyhow::Result<Vec<NodeRecord>> {
    list_where(conn, filter.condition(), after, limit, lock).await
}

/// Live `adopting`, `connected` nodes that reported their `gpus` section and have no
/// `diag.nvml` from `acceptor` in flight (queued, dispatched or running), by id, at most
/// `limit`: the nodes acceptance can act on now. A node waiting on its diagnostic is left
/// out in SQL (`ix_commands_node_id_status_lane` answers the check), so while thousands of
/// nodes run theirs the pass loads none of them, and the limit is spent on nodes with
/// something to decide.
pub async fn acceptance_candidates(
    conn: &impl ConnectionTrait,
    acceptor: &Actor,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    let filter = NodeFilter {
        provision_states: vec![ProvisionState::Adopting],
        connectivity: vec![Connectivity::Connected],
        ..NodeFilter::default()
    };
    let node_id = || Expr::col((node::Entity, node::Column::Id));
    let reported_gpus = Query::select()
        .expr(Expr::value(1))
        .from(node_inventory_section::Entity)
        .and_where(
            Expr::col((
                node_inventory_section::Entity,
                node_inventory_section::Column::NodeId,
            ))
            .eq(node_id()),
        )
        .and_where(
            Expr::col((
                node_inventory_section::Entity,
                node_inventory_section::Column::Section,
            ))
            .eq("gpus"),
        )
        .take();
    let in_flight: Vec<&str> = CommandStatus::ALL
        .iter()
        .filter(|s| !s.is_final())
        .map(|s| s.as_static_str())
        .collect();
    let diagnostic_running = Query::select()
        .expr(Expr::value(1))
        .from(command::Entity)
        .and_where(Expr::col((command::Entity, command::Column::NodeId)).eq(node_id()))
        .and_where(Expr::col((command::Entity, command::Column::Status)).is_in(in_flight))
        .and_where(
            Expr::col((command::Entity, command::Column::Kind))
                .eq(CommandKind::DiagNvml.as_static_str()),
        )
        .and_where(
            Expr::col((command::Entity, command::Column::CreatedBy)).eq(acceptor.to_string()),
        )
        .take();
    let cond = filter
        .condition()
        .add(Expr::exists(reported_gpus))
        .add(Expr::exists(diagnostic_running).not());
    list_where(conn, cond, None, limit, false).await
}

async fn list_where(
    conn: &impl ConnectionTrait,
    cond: Condition,
    after: Option<&str>,
    limit: u64,
    lock: bool,
) -> anyhow::Result<Vec<NodeRecord>> {
    let mut select = node::Entity::find().filter(cond);
    if let Some(after) = after {
        select = select.filter(node::Column::Id.gt(after));
    }
    let mut select = select.order_by_asc(node::Column::Id).limit(limit);
    if lock && conn.get_database_backend() == sea_orm::DbBackend::Postgres {
        select = select.lock_shared();
    }
    let rows = select.all(conn).await?;
    let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
    let mut children = load_children(conn, &ids).await?;
    rows.into_iter()
        .map(|row| {
            let kids = children.remove(&row.id).unwrap_or_default();
            rows::node_record(row, kids)
        })
        .collect()
}

/// Live nodes in `states` whose spec generation is still 0 (id and version), at most `limit`:
/// the NodeSpec controller's work list, selected in SQL so a settled fleet costs one cheap
/// query per tick instead of loading every node.
pub async fn awaiting_first_spec(
    conn: &impl ConnectionTrait,
    states: &[ProvisionState],
    limit: u64,
) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let rows = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .column(node::Column::Version)
        .filter(node::Column::DeletedAt.is_null())
        .filter(node::Column::Generation.eq(0))
        .filter(node::Column::ProvisionState.is_in(states.iter().map(ToString::to_string)))
        .limit(limit)
        .into_tuple::<(String, i64)>()
        .all(conn)
        .await?;
    rows.into_iter()
        .map(|(id, version)| {
            Ok((
                NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?,
                version,
            ))
        })
        .collect()
}

/// How many nodes match.
pub async fn count(conn: &impl ConnectionTrait, filter: &NodeFilter) -> anyhow::Result<u64> {
    use sea_orm::PaginatorTrait;
    Ok(node::Entity::find()
        .filter(filter.condition())
        .count(conn)
        .await?)
}
