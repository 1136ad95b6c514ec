//! The event log: one row per change, written in the transaction of the change as its last
//! write (the `append_*` functions collect, [`WriteTxn::commit`] writes). The sequence
//! number is the event's id and the resume cursor.

use bc_core::Actor;
use bc_core::event::{Axis, Change, EventType, RecordedEvent};
use bc_core::ids::{EventId, NodeId, TenantId};
use bc_core::node::NodeRecord;
use bc_entity::event;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::{NotSet, Set};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder,
    QuerySelect,
};

use super::batch_shapes::{one_of, runs_of};
use super::rows::recorded_event;
use super::{Store, WriteTxn};

/// The PostgreSQL channel that announces new events to every replica, and the advisory lock
/// that orders event writers: the `events` table's insert trigger, which the migration that
/// defines them creates, takes the lock and notifies the channel.
pub use bc_migration::{EVENT_ORDER_LOCK, NOTIFY_CHANNEL};
/// How long to wait before re-opening a dropped LISTEN connection.
const LISTEN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Writes a transaction's events, in the order they were appended. [`WriteTxn::commit`]
/// calls it just before `COMMIT`.
///
/// Event order is commit order (ARCHITECTURE.md, Invariants): on PostgreSQL the first insert
/// takes the event-order lock before its rows draw their sequence numbers (the `events`
/// table's statement trigger, `bc_migration`'s `event_order_trigger`), and the transaction
/// holds it until it commits, so a reader following `seq > last` never skips an event that
/// commits late. It is the last lock a transaction takes (lock order): the inserts are its
/// last writes, and the serialised stretch is the inserts and the commit. SQLite has one
/// writer at a time already.
pub(super) async fn write_pending(
    conn: &impl ConnectionTrait,
    rows: Vec<event::ActiveModel>,
) -> Result<(), sea_orm::DbErr> {
    for run in runs_of::<event::Entity, _>(rows) {
        event::Entity::insert_many(run)
            .exec_without_returning(conn)
            .await?;
    }
    Ok(())
}

/// Appends one event per change of `node` (`after`, which was `before`; `None` for a new
/// node), written when `txn` commits. Each event's `data` holds the node's version after
/// the change, the rendered detail, and the change's structured detail
/// ([`bc_core::history::change_detail`]); the version's first event also holds the step
/// that rebuilds the node at this version ([`bc_core::history::Rebuild`]), and
/// `node_version` is set on all of them.
#[allow(clippy::too_many_arguments)]
pub fn append_node_changes(
    txn: &WriteTxn,
    before: Option<&NodeRecord>,
    node: &NodeRecord,
    changes: &[Change],
    actor: &Actor,
    cause: Option<&str>,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    let rebuild = bc_core::history::Rebuild::between(before, node)?;
    let mut rebuild = Some(rebuild);
    let rows: Vec<event::ActiveModel> = changes
        .iter()
        .map(|change| {
            let mut data = serde_json::json!({
                "version": node.version,
                "detail": change.detail,
                "change": bc_core::history::change_detail(change, before, node),
            });
            if let Some(key) = &change.key {
                data["key"] = serde_json::Value::from(key.as_str());
            }
            if let Some(step) = rebuild.take() {
                data["rebuild"] = serde_json::to_value(step)?;
            }
            Ok(event::ActiveModel {
                seq: NotSet,
                node_id: Set(Some(node.id.to_string())),
                tenant_id: Set(node.owner_tenant_id.as_ref().map(ToString::to_string)),
                event_type: Set(change.event_type.to_string()),
                axis: Set(Some(change.axis.to_string())),
                from_value: Set(change.from.clone()),
                to_value: Set(change.to.clone()),
                actor: Set(actor.to_string()),
                cause: Set(cause.map(str::to_owned)),
                data: Set(data),
                created_at: Set(now),
                node_version: Set(Some(node.version)),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    txn.append_events(rows);
    Ok(())
}

/// Appends one event about a node that changed none of its fields (an operator's power
/// action, which the BMC carries out): no axis, the node's `version` unchanged in `data`.
pub fn append_node_action(
    txn: &WriteTxn,
    node: &NodeRecord,
    event_type: EventType,
    actor: &Actor,
    cause: Option<&str>,
    data: serde_json::Value,
    now: DateTime<Utc>,
) {
    txn.append_events([event::ActiveModel {
        seq: NotSet,
        node_id: Set(Some(node.id.to_string())),
        tenant_id: Set(node.owner_tenant_id.as_ref().map(ToString::to_string)),
        event_type: Set(event_type.to_string()),
        axis: Set(None),
        from_value: Set(None),
        to_value: Set(None),
        actor: Set(actor.to_string()),
        cause: Set(cause.map(str::to_owned)),
        data: Set(data),
        node_version: Set(None),
        created_at: Set(now),
    }]);
}

/// Appends one event that is not about a single node axis (a tenant, site, pool or join token
/// created or revoked, a site's liveness paused or resumed),
/// written when `txn` commits.
pub fn append_other(
    txn: &WriteTxn,
    event_type: EventType,
    tenant_id: Option<&str>,
    actor: &Actor,
    data: serde_json::Value,
    now: DateTime<Utc>,
) {
    txn.append_events([event::ActiveModel {
        seq: NotSet,
        node_id: Set(None),
        tenant_id: Set(tenant_id.map(str::to_owned)),
        event_type: Set(event_type.to_string()),
        axis: Set(None),
        from_value: Set(None),
        to_value: Set(None),
        actor: Set(actor.to_string()),
        cause: Set(None),
        data: Set(data),
        created_at: Set(now),
        node_version: Set(None),
    }]);
}

/// Appends the event of a remediation try entering its status (`remediation.<status>`):
/// about the node, the try's id as the cause, the try itself in `data`.
pub fn append_remediation(
    txn: &WriteTxn,
    attempt: &bc_core::remediation::RemediationAttempt,
    tenant_id: Option<&bc_core::ids::TenantId>,
    from: Option<bc_core::remediation::AttemptStatus>,
    actor: &Actor,
    now: DateTime<Utc>,
) {
    let data = serde_json::json!({
        "attemptId": attempt.id,
        "runId": attempt.run_id,
        "condition": attempt.condition,
        "step": attempt.step,
        "action": attempt.current().map(|s| s.action),
        "attempt": attempt.attempt,
        "status": attempt.status,
        "actionCommandId": attempt.action_command_id,
        "verifyCommandId": attempt.verify_command_id,
        "nextAttemptAt": attempt.next_attempt_at,
        "note": attempt.note,
    });
    txn.append_events([event::ActiveModel {
        seq: NotSet,
        node_id: Set(Some(attempt.node_id.to_string())),
        tenant_id: Set(tenant_id.map(ToString::to_string)),
        event_type: Set(EventType::remediation(attempt.status).to_string()),
        axis: Set(None),
        from_value: Set(from.map(|s| s.to_string())),
        to_value: Set(Some(attempt.status.to_string())),
        actor: Set(actor.to_string()),
        cause: Set(Some(attempt.id.to_string())),
        data: Set(data),
        node_version: Set(None),
        created_at: Set(now),
    }]);
}

/// Appends one placement event (`reservation.*`, `allocation.*`): about a reservation, and
/// about a node where an allocation is booked or released. The cause is the reservation's id,
/// so a client follows one reservation by it; the tenant is the reservation's.
#[allow(clippy::too_many_arguments)]
pub fn append_placement(
    txn: &WriteTxn,
    event_type: EventType,
    reservation: &bc_core::placement::Reservation,
    node_id: Option<&bc_core::ids::NodeId>,
    from: Option<String>,
    to: Option<String>,
    actor: &Actor,
    data: serde_json::Value,
    now: DateTime<Utc>,
) {
    txn.append_events([event::ActiveModel {
        seq: NotSet,
        node_id: Set(node_id.map(ToString::to_string)),
        tenant_id: Set(Some(reservation.tenant_id.to_string())),
        event_type: Set(event_type.to_string()),
        axis: Set(None),
        from_value: Set(from),
        to_value: Set(to),
        actor: Set(actor.to_string()),
        cause: Set(Some(reservation.id.to_string())),
        data: Set(data),
        created_at: Set(now),
        node_version: Set(None),
    }]);
}

/// Events after `after`, oldest first, at most `limit`: the feed's read.
pub async fn after(
    conn: &impl ConnectionTrait,
    after: i64,
    limit: u64,
) -> anyhow::Result<Vec<RecordedEvent>> {
    let rows = event::Entity::find()
        .filter(event::Column::Seq.gt(after))
        .order_by_asc(event::Column::Seq)
        .limit(limit)
        .all(conn)
        .await?;
    rows.into_iter().map(recorded_event).collect()
}

/// The newest event's sequence number (0 when there is none).
pub async fn head(conn: &impl ConnectionTrait) -> Result<i64, sea_orm::DbErr> {
    let row = event::Entity::find()
        .order_by_desc(event::Column::Seq)
        .one(conn)
        .await?;
    Ok(row.map_or(0, |r| r.seq))
}

/// A node's events, newest first, `limit` of them, older than `before` if given.
pub async fn for_node(
    conn: &impl ConnectionTrait,
    node_id: &str,
    before: Option<EventId>,
    limit: u64,
) -> anyhow::Result<Vec<RecordedEvent>> {
    let mut select = event::Entity::find().filter(event::Column::NodeId.eq(node_id));
    if let Some(before) = before {
        select = select.filter(event::Column::Seq.lt(before.0));
    }
    let rows = select
        .order_by_desc(event::Column::Seq)
        .limit(limit)
        .all(conn)
        .await?;
    rows.into_iter().map(recorded_event).collect()
}

/// Which events of the log a reader wants (the fleet event log and the live `events`
/// subscription share it: [`EventFilter::matches`] is the same filter in Rust). Empty lists
/// match everything; `since` is inclusive, `until` exclusive.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventFilter {
    pub node_ids: Vec<NodeId>,
    pub types: Vec<EventType>,
    pub actors: Vec<Actor>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// Only the events of this tenant (a tenant principal's visibility); `None`: all.
    pub tenant: Option<TenantId>,
}

impl EventFilter {
    /// Whether `event` passes the filter: the same rule as [`list`]'s SQL.
    pub fn matches(&self, event: &RecordedEvent) -> bool {
        (self.node_ids.is_empty()
            || event
                .node_id
                .as_ref()
                .is_some_and(|n| self.node_ids.contains(n)))
            && (self.types.is_empty() || self.types.contains(&event.event_type))
            && (self.actors.is_empty() || self.actors.contains(&event.actor))
            && self.since.is_none_or(|since| event.at >= since)
            && self.until.is_none_or(|until| event.at < until)
            && self
                .tenant
                .as_ref()
                .is_none_or(|t| event.tenant_id.as_ref() == Some(t))
    }
}

/// The events `filter` matches, as SQL.
fn matching(filter: &EventFilter) -> Condition {
    let mut cond = Condition::all();
    if !filter.node_ids.is_empty() {
        cond =
            cond.add(event::Column::NodeId.is_in(filter.node_ids.iter().map(ToString::to_string)));
    }
    if !filter.types.is_empty() {
        cond = cond
            .add(event::Column::EventType.is_in(filter.types.iter().map(|t| t.as_static_str())));
    }
    if !filter.actors.is_empty() {
        cond = cond.add(event::Column::Actor.is_in(filter.actors.iter().map(ToString::to_string)));
    }
    if let Some(since) = filter.since {
        cond = cond.add(event::Column::CreatedAt.gte(since));
    }
    if let Some(until) = filter.until {
        cond = cond.add(event::Column::CreatedAt.lt(until));
    }
    if let Some(tenant) = &filter.tenant {
        cond = cond.add(event::Column::TenantId.eq(tenant.to_string()));
    }
    cond
}

/// The fleet event log: events matching `filter`, newest first, older than `before` if
/// given, `limit` of them.
pub async fn list(
    conn: &impl ConnectionTrait,
    filter: &EventFilter,
    before: Option<i64>,
    limit: u64,
) -> anyhow::Result<Vec<RecordedEvent>> {
    let mut cond = matching(filter);
    if let Some(before) = before {
        cond = cond.add(event::Column::Seq.lt(before));
    }
    let rows = event::Entity::find()
        .filter(cond)
        .order_by_desc(event::Column::Seq)
        .limit(limit)
        .all(conn)
        .await?;
    rows.into_iter().map(recorded_event).collect()
}

/// How many events `filter` matches.
pub async fn count(
    conn: &impl ConnectionTrait,
    filter: &EventFilter,
) -> Result<u64, sea_orm::DbErr> {
    event::Entity::find()
        .filter(matching(filter))
        .count(conn)
        .await
}

/// The events of a node whose node version lies in `from..=to`, oldest first: what a
/// rebuild of the node folds (`bc_core::history`). An indexed range read
/// (`ix_events_node_id_node_version`).
pub async fn of_node_versions(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    from: i64,
    to: i64,
) -> anyhow::Result<Vec<RecordedEvent>> {
    let rows = event::Entity::find()
        .filter(event::Column::NodeId.eq(node_id.as_str()))
        .filter(event::Column::NodeVersion.between(from, to))
        .order_by_asc(event::Column::NodeVersion)
        .order_by_asc(event::Column::Seq)
        .all(conn)
        .await?;
    rows.into_iter().map(recorded_event).collect()
}

/// A point in the log: a time, or an event's sequence number.
#[derive(Debug, Clone, Copy)]
pub enum LogPoint {
    At(DateTime<Utc>),
    Seq(i64),
}

/// The node's version in force at `point`: that of its newest node change at or before it
/// (`None`: the node did not exist yet, or has no recorded change).
pub async fn node_version_at(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    point: LogPoint,
) -> Result<Option<i64>, sea_orm::DbErr> {
    let until = match point {
        LogPoint::At(at) => event::Column::CreatedAt.lte(at),
        LogPoint::Seq(seq) => event::Column::Seq.lte(seq),
    };
    let version = event::Entity::find()
        .select_only()
        .column(event::Column::NodeVersion)
        .filter(event::Column::NodeId.eq(node_id.as_str()))
        .filter(event::Column::NodeVersion.is_not_null())
        .filter(until)
        .order_by_desc(event::Column::NodeVersion)
        .into_tuple::<Option<i64>>()
        .one(conn)
        .await?;
    Ok(version.flatten())
}

/// For many nodes at once, the sequence number of each node's newest event of `event_type`,
/// keyed by `key`: the node, or the event's cause (a command's id, for `command.*` events).
/// `causes`, if given, limits the events to those causes. Nodes without such an event are
/// absent. One grouped query per chunk of nodes, walking each node's events by the
/// `(node_id, seq)` index, where a query per node cost a round trip each.
pub async fn newest_seqs_of_type(
    conn: &impl ConnectionTrait,
    node_ids: &[&str],
    event_type: EventType,
    causes: Option<&[&str]>,
    key: SeqKey,
) -> anyhow::Result<std::collections::HashMap<String, i64>> {
    let key_column = match key {
        SeqKey::Node => event::Column::NodeId,
        SeqKey::Cause => event::Column::Cause,
    };
    let mut newest = std::collections::HashMap::new();
    let backend = conn.get_database_backend();
    for chunk in node_ids.chunks(IDS_PER_QUERY) {
        let mut select = event::Entity::find()
            .select_only()
            .column(key_column)
            .column_as(event::Column::Seq.max(), "seq")
            .filter(one_of(Expr::col(event::Column::NodeId), chunk, backend))
            .filter(event::Column::EventType.eq(event_type.as_static_str()));
        if let Some(causes) = causes {
            select = select.filter(one_of(Expr::col(event::Column::Cause), causes, backend));
        }
        let rows = select
            .group_by(key_column)
            .into_tuple::<(Option<String>, i64)>()
            .all(conn)
            .await?;
        newest.extend(rows.into_iter().filter_map(|(k, seq)| Some((k?, seq))));
    }
    Ok(newest)
}

/// What [`newest_seqs_of_type`] groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqKey {
    Node,
    Cause,
}

/// Ids per list ([`one_of`]): far below SQLite's bound-parameter limit.
const IDS_PER_QUERY: usize = 1_000;

/// Appends the event of one command status change (`command.<status>`), written when `txn`
/// commits.
pub fn append_command(
    txn: &WriteTxn,
    command: &bc_core::command::Command,
    from: Option<bc_core::command::CommandStatus>,
    actor: &Actor,
    now: DateTime<Utc>,
) {
    txn.append_events([event::ActiveModel {
        seq: NotSet,
        node_id: Set(Some(command.node_id.to_string())),
        tenant_id: Set(command.tenant_id.as_ref().map(ToString::to_string)),
        event_type: Set(EventType::command(command.status).to_string()),
        axis: Set(Some(Axis::Command.to_string())),
        from_value: Set(from.map(|s| s.to_string())),
        to_value: Set(Some(command.status.to_string())),
        actor: Set(actor.to_string()),
        cause: Set(Some(command.id.to_string())),
        data: Set(serde_json::json!({
            "commandId": command.id,
            "kind": command.kind,
            "lane": command.lane,
            "status": command.status,
            "attempts": command.attempts,
            "exitCode": command.exit_code,
            "error": command.error,
        })),
        created_at: Set(now),
        node_version: Set(None),
    }]);
}

/// On PostgreSQL, a task that wakes `wake` whenever any replica commits events (`LISTEN` on
/// [`NOTIFY_CHANNEL`]), reconnecting after [`LISTEN_RETRY`] when the connection drops, until
/// `shutdown`. `None` on SQLite: one process writes, and it wakes its own feed.
pub fn listen_for_commits(
    store: &Store,
    wake: std::sync::Arc<tokio::sync::Notify>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
    if store.backend() != sea_orm::DbBackend::Postgres {
        return None;
    }
    let pool = store.db().get_postgres_connection_pool().clone();
    Some(async move {
        use sea_orm::sqlx::postgres::PgListener;
        loop {
            let listener = async {
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.listen(NOTIFY_CHANNEL).await?;
                loop {
                    listener.recv().await?;
                    wake.notify_one();
                }
                #[allow(unreachable_code)]
                Ok::<(), sea_orm::sqlx::Error>(())
            };
            tokio::select! {
                result = listener => {
                    if let Err(err) = result {
                        tracing::warn!(error = %err, "LISTEN for new events failed; retrying");
                    }
                }
                _ = shutdown.changed() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(LISTEN_RETRY) => {}
                _ = shutdown.changed() => return,
            }
        }
    })
}
