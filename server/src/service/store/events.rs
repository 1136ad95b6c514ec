//! The event log: one row per change, written in the transaction of the change as its last
//! write (the `append_*` functions collect, [`WriteTxn::commit`] writes). The sequence
//! number is the event's id and the resume cursor.

use bc_core::Actor;
use bc_core::event::{Axis, Change, EventType, RecordedEvent};
use bc_core::ids::EventId;
use bc_core::node::NodeRecord;
use bc_entity::event;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::{NotSet, Set};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use super::rows::recorded_event;
use super::{Store, WriteTxn};

/// The PostgreSQL channel that announces new events to every replica. `pg_notify` is
/// transactional: listeners hear it only when (and if) the transaction commits.
pub const NOTIFY_CHANNEL: &str = "bc_events";
/// How long to wait before re-opening a dropped LISTEN connection.
const LISTEN_RETRY: std::time::Duration = std::time::Duration::from_secs(1);
/// The advisory lock that orders event writers (an arbitrary constant, unique to us).
pub const EVENT_ORDER_LOCK: i64 = 0x6263_6576_7473;
/// Events per INSERT when a transaction writes its events (PostgreSQL takes at most 65,535
/// parameters per statement, and an event has ten).
const EVENTS_PER_INSERT: usize = 1_000;

/// Makes `seq` order equal commit order on PostgreSQL, so a reader that follows
/// `seq > last` never skips an event that commits late: the transaction takes a lock held
/// until it commits, and only then takes its sequence numbers. SQLite has one writer at a
/// time already.
///
/// It is the last lock a transaction takes (ARCHITECTURE.md, Invariants: lock order): only
/// [`write_pending`] calls it, from [`WriteTxn::commit`], after every other write, so a
/// writer never waits for a row while holding it and the serialised stretch is the event
/// insert and the commit.
async fn order_events(conn: &impl ConnectionTrait) -> Result<(), sea_orm::DbErr> {
    if conn.get_database_backend() == sea_orm::DbBackend::Postgres {
        conn.execute_unprepared(&format!(
            "SELECT pg_advisory_xact_lock({EVENT_ORDER_LOCK}); SELECT pg_notify('{NOTIFY_CHANNEL}', '')"
        ))
        .await?;
    }
    Ok(())
}

/// Writes a transaction's events, in the order they were appended: the event-order lock,
/// then the inserts. [`WriteTxn::commit`] calls it just before `COMMIT`.
pub(super) async fn write_pending(
    conn: &impl ConnectionTrait,
    rows: Vec<event::ActiveModel>,
) -> Result<(), sea_orm::DbErr> {
    if rows.is_empty() {
        return Ok(());
    }
    order_events(conn).await?;
    for chunk in rows.chunks(EVENTS_PER_INSERT) {
        event::Entity::insert_many(chunk.iter().cloned())
            .exec_without_returning(conn)
            .await?;
    }
    Ok(())
}

/// Appends one event per change of `node`, written when `txn` commits.
pub fn append_node_changes(
    txn: &WriteTxn,
    node: &NodeRecord,
    changes: &[Change],
    actor: &Actor,
    cause: Option<&str>,
    now: DateTime<Utc>,
) {
    txn.append_events(changes.iter().map(|change| event::ActiveModel {
        seq: NotSet,
        node_id: Set(Some(node.id.to_string())),
        tenant_id: Set(node.owner_tenant_id.as_ref().map(ToString::to_string)),
        event_type: Set(change.event_type.to_string()),
        axis: Set(Some(change.axis.to_string())),
        from_value: Set(change.from.clone()),
        to_value: Set(change.to.clone()),
        actor: Set(actor.to_string()),
        cause: Set(cause.map(str::to_owned)),
        data: Set(serde_json::json!({ "detail": change.detail, "version": node.version })),
        created_at: Set(now),
    }));
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

/// The node's newest event of `event_type` (with this `cause`, if given), if any: an indexed
/// lookup by node, newest first.
pub async fn latest_of_type(
    conn: &impl ConnectionTrait,
    node_id: &str,
    event_type: EventType,
    cause: Option<&str>,
) -> anyhow::Result<Option<RecordedEvent>> {
    let mut select = event::Entity::find()
        .filter(event::Column::NodeId.eq(node_id))
        .filter(event::Column::EventType.eq(event_type.as_static_str()));
    if let Some(cause) = cause {
        select = select.filter(event::Column::Cause.eq(cause));
    }
    select
        .order_by_desc(event::Column::Seq)
        .one(conn)
        .await?
        .map(recorded_event)
        .transpose()
}

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
