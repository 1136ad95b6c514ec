//! Command rows.

use anyhow::anyhow;
use bc_core::Actor;
use bc_core::command::{Command, CommandKind, CommandStatus, Lane};
use bc_core::ids::{CommandId, NodeId, TenantId};
use bc_entity::command;
use chrono::{DateTime, Duration, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
};
use std::collections::HashMap;

use super::batch_shapes::{one_of, runs_of};

fn corrupt(column: &str, value: &str) -> anyhow::Error {
    anyhow!("corrupt row: commands.{column} = `{value}`")
}

pub fn command_from(row: command::Model) -> anyhow::Result<Command> {
    Ok(Command {
        id: CommandId::parse(&row.id).map_err(|_| corrupt("id", &row.id))?,
        node_id: NodeId::parse(&row.node_id).map_err(|_| corrupt("node_id", &row.node_id))?,
        tenant_id: row
            .tenant_id
            .as_deref()
            .map(|t| TenantId::parse(t).map_err(|_| corrupt("tenant_id", t)))
            .transpose()?,
        kind: row
            .kind
            .parse::<CommandKind>()
            .map_err(|_| corrupt("kind", &row.kind))?,
        lane: row
            .lane
            .parse::<Lane>()
            .map_err(|_| corrupt("lane", &row.lane))?,
        params: row.params,
        status: row
            .status
            .parse::<CommandStatus>()
            .map_err(|_| corrupt("status", &row.status))?,
        force: row.force,
        not_before: row.not_before,
        timeout: Duration::seconds(row.timeout_secs),
        expires_at: row.expires_at,
        attempts: row.attempts,
        session_epoch: row.session_epoch,
        exit_code: row.exit_code,
        output: row.output,
        result: row.result,
        error: row.error,
        created_by: Actor::parse(&row.created_by)
            .ok_or_else(|| corrupt("created_by", &row.created_by))?,
        created_at: row.created_at,
        dispatched_at: row.dispatched_at,
        started_at: row.started_at,
        finished_at: row.finished_at,
        updated_at: row.updated_at,
    })
}

fn row(c: &Command) -> command::ActiveModel {
    command::ActiveModel {
        id: Set(c.id.to_string()),
        node_id: Set(c.node_id.to_string()),
        tenant_id: Set(c.tenant_id.as_ref().map(ToString::to_string)),
        kind: Set(c.kind.to_string()),
        lane: Set(c.lane.to_string()),
        params: Set(c.params.clone()),
        status: Set(c.status.to_string()),
        force: Set(c.force),
        not_before: Set(c.not_before),
        timeout_secs: Set(c.timeout.num_seconds()),
        expires_at: Set(c.expires_at),
        attempts: Set(c.attempts),
        session_epoch: Set(c.session_epoch),
        exit_code: Set(c.exit_code),
        output: Set(c.output.clone()),
        result: Set(c.result.clone()),
        error: Set(c.error.clone()),
        created_by: Set(c.created_by.to_string()),
        created_at: Set(c.created_at),
        dispatched_at: Set(c.dispatched_at),
        started_at: Set(c.started_at),
        finished_at: Set(c.finished_at),
        updated_at: Set(c.updated_at),
    }
}

/// Writes new commands: a statement per run of them ([`runs_of`]), so that batches of every
/// size (acceptance's, a `sendCommand` to many nodes) make a few SQL
/// texts, not one per size, in each connection's prepared-statement cache.
pub async fn insert(conn: &impl ConnectionTrait, commands: &[Command]) -> anyhow::Result<()> {
    for run in runs_of::<command::Entity, _>(commands.iter().collect()) {
        command::Entity::insert_many(run.into_iter().map(row))
            .exec_without_returning(conn)
            .await?;
    }
    Ok(())
}

/// Writes `after` if the row still has `before_status` (a compare-and-set on the status, so
/// of two racing changes, say a cancel and a result, exactly one wins). Returns whether it did.
pub async fn save(
    conn: &impl ConnectionTrait,
    before_status: CommandStatus,
    after: &Command,
) -> anyhow::Result<bool> {
    let result = command::Entity::update_many()
        .set(row(after))
        .filter(command::Column::Id.eq(after.id.to_string()))
        .filter(command::Column::Status.eq(before_status.to_string()))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// Writes many commands at once, each as it is now: one upsert per run of rows
/// ([`runs`]), an update of many rows to different values in one
/// statement on both backends.
///
/// This is the gateway's batched write, and unlike [`save`] it is no compare-and-set: the
/// caller read every row locked in this transaction ([`load_many`] or [`of_nodes`] with
/// `for_update`; on SQLite the transaction holds the one writer), so no one else can have
/// changed a status since, and the caller decided each change on the status it read. (A
/// guard on `updated_at` would compare the clocks of two replicas, and refuse right writes
/// when they disagree by a few milliseconds.)
pub async fn save_many(conn: &impl ConnectionTrait, commands: &[&Command]) -> anyhow::Result<()> {
    use sea_orm::Iterable;
    use sea_orm::sea_query::OnConflict;
    for run in runs_of::<command::Entity, _>(commands.to_vec()) {
        let upsert = OnConflict::column(command::Column::Id)
            .update_columns(command::Column::iter().filter(|c| !matches!(c, command::Column::Id)))
            .to_owned();
        let count = run.len() as u64;
        let written = command::Entity::insert_many(run.into_iter().map(row))
            .on_conflict(upsert)
            .exec_without_returning(conn)
            .await?;
        if written != count {
            return Err(anyhow!(
                "{count} commands were to be written and {written} were; nothing was written"
            ));
        }
    }
    Ok(())
}

pub async fn load(
    conn: &impl ConnectionTrait,
    id: &CommandId,
    for_update: bool,
) -> anyhow::Result<Option<Command>> {
    let mut select = command::Entity::find_by_id(id.to_string());
    if for_update {
        select = super::lock_for_update(select, conn);
    }
    select.one(conn).await?.map(command_from).transpose()
}

/// Many commands by id, locked when `for_update` (in id order, where the database has row
/// locks); ids that name no command are left out.
pub async fn load_many(
    conn: &impl ConnectionTrait,
    ids: &[CommandId],
    for_update: bool,
) -> anyhow::Result<HashMap<CommandId, Command>> {
    let mut sorted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    sorted.dedup();
    let mut loaded = HashMap::with_capacity(sorted.len());
    for chunk in sorted.chunks(IDS_PER_QUERY) {
        let mut select = command::Entity::find()
            .filter(one_of(
                Expr::col(command::Column::Id),
                chunk,
                conn.get_database_backend(),
            ))
            .order_by_asc(command::Column::Id);
        if for_update {
            select = super::lock_for_update(select, conn);
        }
        for row in select.all(conn).await? {
            let command = command_from(row)?;
            loaded.insert(command.id.clone(), command);
        }
    }
    Ok(loaded)
}

/// Ids per `IN (…)` list of a batched read: the gateway's batches (256) fit in one.
const IDS_PER_QUERY: usize = 1_024;

/// Which commands to list.
#[derive(Debug, Clone, Default)]
pub struct CommandFilter {
    pub node_ids: Vec<NodeId>,
    pub statuses: Vec<CommandStatus>,
    pub kinds: Vec<CommandKind>,
    /// Visibility: a tenant sees only commands to its nodes.
    pub tenant: Option<TenantId>,
}

/// The commands `filter` matches.
fn matching(filter: &CommandFilter) -> Condition {
    let mut cond = Condition::all();
    if !filter.node_ids.is_empty() {
        cond = cond
            .add(command::Column::NodeId.is_in(filter.node_ids.iter().map(ToString::to_string)));
    }
    if !filter.statuses.is_empty() {
        cond = cond
            .add(command::Column::Status.is_in(filter.statuses.iter().map(ToString::to_string)));
    }
    if !filter.kinds.is_empty() {
        cond = cond.add(command::Column::Kind.is_in(filter.kinds.iter().map(ToString::to_string)));
    }
    if let Some(tenant) = &filter.tenant {
        cond = cond.add(command::Column::TenantId.eq(tenant.to_string()));
    }
    cond
}

/// Newest first, ids before `before` (the previous page's last id).
pub async fn list(
    conn: &impl ConnectionTrait,
    filter: &CommandFilter,
    before: Option<&str>,
    limit: u64,
) -> anyhow::Result<Vec<Command>> {
    let mut cond = matching(filter);
    if let Some(before) = before {
        cond = cond.add(command::Column::Id.lt(before));
    }
    let rows = command::Entity::find()
        .filter(cond)
        .order_by_desc(command::Column::Id)
        .limit(limit)
        .all(conn)
        .await?;
    rows.into_iter().map(command_from).collect()
}

/// The newest command of `kind` that `actor` created for each of `nodes` (a node without one
/// is absent): one query for a controller's whole work list, not one per node.
pub async fn newest_by(
    conn: &impl ConnectionTrait,
    nodes: &[NodeId],
    kind: CommandKind,
    actor: &Actor,
) -> anyhow::Result<HashMap<NodeId, Command>> {
    let mut newest = HashMap::new();
    if nodes.is_empty() {
        return Ok(newest);
    }
    let rows = command::Entity::find()
        .filter(one_of(
            Expr::col(command::Column::NodeId),
            nodes,
            conn.get_database_backend(),
        ))
        .filter(command::Column::Kind.eq(kind.to_string()))
        .filter(command::Column::CreatedBy.eq(actor.to_string()))
        .order_by_desc(command::Column::Id)
        .all(conn)
        .await?;
    for row in rows {
        let command = command_from(row)?;
        newest.entry(command.node_id.clone()).or_insert(command);
    }
    Ok(newest)
}

/// How many commands `filter` matches.
pub async fn count(conn: &impl ConnectionTrait, filter: &CommandFilter) -> anyhow::Result<u64> {
    use sea_orm::PaginatorTrait;
    Ok(command::Entity::find()
        .filter(matching(filter))
        .count(conn)
        .await?)
}

/// The node's commands in `statuses`, oldest first, locked where the database can.
pub async fn of_node(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    statuses: &[CommandStatus],
) -> anyhow::Result<Vec<Command>> {
    let mut by_node = of_nodes(conn, std::slice::from_ref(node_id), statuses, true).await?;
    Ok(by_node.remove(node_id).unwrap_or_default())
}

/// [`of_node`] for many nodes at once, by node (a node with none is absent), each node's
/// oldest first; locked, in id order, when `for_update`. The rows are read in one statement
/// per [`IDS_PER_QUERY`] nodes, and only within one statement are they locked in id order,
/// so a caller that locks locks at most that many nodes' commands at once (lock order,
/// ARCHITECTURE.md).
pub async fn of_nodes(
    conn: &impl ConnectionTrait,
    node_ids: &[NodeId],
    statuses: &[CommandStatus],
    for_update: bool,
) -> anyhow::Result<HashMap<NodeId, Vec<Command>>> {
    let mut sorted: Vec<String> = node_ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    sorted.dedup();
    debug_assert!(
        !for_update || sorted.len() <= IDS_PER_QUERY,
        "locking the commands of more than {IDS_PER_QUERY} nodes at once"
    );
    let mut by_node: HashMap<NodeId, Vec<Command>> = HashMap::new();
    for chunk in sorted.chunks(IDS_PER_QUERY) {
        let mut select = command::Entity::find()
            .filter(one_of(
                Expr::col(command::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .filter(command::Column::Status.is_in(statuses.iter().map(ToString::to_string)))
            .order_by_asc(command::Column::Id);
        if for_update {
            select = super::lock_for_update(select, conn);
        }
        for row in select.all(conn).await? {
            let command = command_from(row)?;
            by_node
                .entry(command.node_id.clone())
                .or_default()
                .push(command);
        }
    }
    Ok(by_node)
}

/// How many commands are queued, dispatched and running (the queue depths `/metrics` shows).
pub async fn depths(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<(CommandStatus, u64)>> {
    use sea_orm::PaginatorTrait;
    let mut out = Vec::new();
    for status in [
        CommandStatus::Queued,
        CommandStatus::Dispatched,
        CommandStatus::Running,
    ] {
        let count = command::Entity::find()
            .filter(command::Column::Status.eq(status.to_string()))
            .count(conn)
            .await?;
        out.push((status, count));
    }
    Ok(out)
}

/// Queued commands that expired by `now`, and dispatched or running ones (whose deadlines
/// the caller checks), at most `limit` of each.
pub async fn overdue_candidates(
    conn: &impl ConnectionTrait,
    now: DateTime<Utc>,
    limit: u64,
) -> anyhow::Result<Vec<Command>> {
    let expired = command::Entity::find()
        .filter(command::Column::Status.eq(CommandStatus::Queued.to_string()))
        .filter(command::Column::ExpiresAt.lte(now))
        .limit(limit)
        .all(conn)
        .await?;
    let active = command::Entity::find()
        .filter(command::Column::Status.is_in([
            CommandStatus::Dispatched.to_string(),
            CommandStatus::Running.to_string(),
        ]))
        .limit(limit)
        .all(conn)
        .await?;
    expired
        .into_iter()
        .chain(active)
        .map(command_from)
        .collect()
}
