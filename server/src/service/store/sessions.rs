//! Sessions and heartbeats: one `node_sessions` row per node, holding the current epoch,
//! the gateway that holds it and `lastSeen`. Heartbeats write here, never to the node row, so
//! they never bump the node's `version`.

use super::batch_shapes::{longest_run, one_of, runs, runs_of};
use bc_core::ids::NodeId;
use bc_core::node::Session;
use bc_entity::node_session;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{
    Alias, Expr, ExprTrait, IntoIden, OnConflict, Query, TableRef, ValueTuple,
};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, HashMap, HashSet};

/// The most sessions one statement of [`next_epochs`] or [`close_many`] reads (one array
/// parameter on PostgreSQL, an `IN` list on SQLite: [`one_of`]).
const OPEN_CHUNK: usize = 1_024;

/// The epoch each node's next session gets: one more than its latest (open or closed), or 1
/// for a node that never had one. The caller holds the nodes' locks
/// ([`super::WriteTxn::lock_nodes`]), so two hellos of one node take their epochs one after
/// the other.
pub async fn next_epochs(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
) -> anyhow::Result<HashMap<NodeId, i64>> {
    let mut latest: HashMap<String, i64> = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(OPEN_CHUNK) {
        let rows = node_session::Entity::find()
            .select_only()
            .column(node_session::Column::NodeId)
            .column(node_session::Column::Epoch)
            .filter(one_of(
                Expr::col(node_session::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .into_tuple::<(String, i64)>()
            .all(conn)
            .await?;
        latest.extend(rows);
    }
    Ok(ids
        .iter()
        .map(|id| (id.clone(), latest.get(&id.to_string()).map_or(1, |e| e + 1)))
        .collect())
}

/// Opens sessions, each `(node, epoch)` from [`next_epochs`], held by `gateway_id` and
/// connected now: a statement per run of them ([`runs_of`]), in node id order.
///
/// An upsert locks the existing rows in the order of its `VALUES`, so the order is the lock
/// order's (step 5): a heartbeat batch, which locks the session rows it updates in node id
/// order, holding one of this batch's rows and waiting for another it had taken first would
/// otherwise close a cycle (a hello batch's order is the order its hellos arrived in).
pub async fn open_many(
    conn: &impl ConnectionTrait,
    opens: &[(NodeId, i64)],
    gateway_id: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    let mut opens = opens.to_vec();
    opens.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for run in runs_of::<node_session::Entity, _>(opens) {
        let rows = run
            .iter()
            .map(|(node_id, epoch)| node_session::ActiveModel {
                node_id: Set(node_id.to_string()),
                epoch: Set(*epoch),
                gateway_id: Set(gateway_id.to_owned()),
                connected_at: Set(now),
                disconnected_at: Set(None),
                last_seen: Set(now),
            });
        node_session::Entity::insert_many(rows)
            .on_conflict(
                OnConflict::column(node_session::Column::NodeId)
                    .update_columns([
                        node_session::Column::Epoch,
                        node_session::Column::GatewayId,
                        node_session::Column::ConnectedAt,
                        node_session::Column::DisconnectedAt,
                        node_session::Column::LastSeen,
                    ])
                    .to_owned(),
            )
            .exec_without_returning(conn)
            .await?;
    }
    Ok(())
}

/// Of the sessions that ended, each `(node, epoch)` with each node once, those that are still
/// their node's latest: their rows are closed where still open (a revoked identity closes the
/// row in the revoking transaction, and the session's end comes after). Returns those nodes.
/// The caller holds the nodes' locks ([`super::WriteTxn::lock_nodes`]), so no hello replaces
/// a session meanwhile. Per [`OPEN_CHUNK`] nodes, in node id order, one statement reads the
/// rows, locking them in that order (lock order: a heartbeat batch locks the same rows in the
/// same order), and one closes them.
pub async fn close_many(
    conn: &impl ConnectionTrait,
    ended: &[(NodeId, i64)],
    now: DateTime<Utc>,
) -> anyhow::Result<HashSet<NodeId>> {
    let mut ended: Vec<&(NodeId, i64)> = ended.iter().collect();
    ended.sort_by(|(a, _), (b, _)| a.cmp(b));
    let mut latest = HashSet::with_capacity(ended.len());
    for chunk in ended.chunks(OPEN_CHUNK) {
        let ids: Vec<String> = chunk.iter().map(|(id, _)| id.to_string()).collect();
        let select = node_session::Entity::find()
            .select_only()
            .column(node_session::Column::NodeId)
            .column(node_session::Column::Epoch)
            .column(node_session::Column::DisconnectedAt)
            .filter(one_of(
                Expr::col(node_session::Column::NodeId),
                &ids,
                conn.get_database_backend(),
            ))
            .order_by_asc(node_session::Column::NodeId);
        let rows = super::lock_for_update(select, conn)
            .into_tuple::<(String, i64, Option<DateTime<Utc>>)>()
            .all(conn)
            .await?;
        let rows: HashMap<String, (i64, bool)> = rows
            .into_iter()
            .map(|(id, epoch, disconnected_at)| (id, (epoch, disconnected_at.is_some())))
            .collect();
        let mut open = Vec::new();
        for (node_id, epoch) in chunk {
            let key = node_id.to_string();
            if let Some(&(current, closed)) = rows.get(&key)
                && current == *epoch
            {
                latest.insert(node_id.clone());
                if !closed {
                    open.push(key);
                }
            }
        }
        if !open.is_empty() {
            node_session::Entity::update_many()
                .col_expr(node_session::Column::DisconnectedAt, Expr::val(now))
                .filter(one_of(
                    Expr::col(node_session::Column::NodeId),
                    &open,
                    conn.get_database_backend(),
                ))
                .filter(node_session::Column::DisconnectedAt.is_null())
                .exec(conn)
                .await?;
        }
    }
    Ok(latest)
}

/// How many heartbeats one statement reads or writes (a power of two: [`runs`]), and how many
/// sessions Liveness reads again in one statement before it marks their nodes
/// (`liveness::heard_since`), for the same reason.
///
/// Small enough that PostgreSQL keeps the plan that looks each row up by its key. Its
/// planner prices an index lookup as a read from disk (`random_page_cost`), so past some
/// number of rows it joins a `VALUES` list (or an `= ANY` array) to `node_sessions` by a
/// sequential scan of the whole table instead. At 50,000 nodes that was between 300 and 512
/// rows for the write and between 512 and 1,024 for the read, and 512 beats took 15.5 ms
/// that way against 1.8 ms for 300 looked up by key (BENCHMARKS.md, session 29). A flush
/// holds the beats that arrived since the last one started, so it grows with the time the
/// last one took: 225 ms on average, for about 170 beats, in a 50,000-node bring-up. The
/// price, on both backends, is a read per 256 beats rather than per 1,000, and about as
/// many writes as before.
pub(super) const HEARTBEAT_CHUNK: usize = 256;
const _: () = assert!(
    HEARTBEAT_CHUNK.is_power_of_two() && HEARTBEAT_CHUNK <= longest_run(2),
    "runs() splits by powers of two, and a beat binds two parameters"
);

/// Records heartbeats: `last_seen` of each (node, epoch) that is still the current, open
/// session. Returns the entries that were not (their session was superseded or closed).
///
/// A fleet beats a thousand times a second per 10,000 nodes, so this costs a read per
/// [`HEARTBEAT_CHUNK`] beats and a write per power-of-two run of them ([`runs`]), not a
/// statement per beat: on SQLite each statement is a round trip to the database's thread
/// while every other writer waits. The chunk's session rows are read (locked, on
/// PostgreSQL, in node id order, so two replicas' batches that share rows take them in the
/// same order: ARCHITECTURE.md, Invariants, lock order), the beats of current sessions are
/// told apart from the stale ones, and an `UPDATE … FROM (VALUES …)` per run sets each
/// current row's `last_seen`.
///
/// Of two beats of one node in a batch, only the one of the higher epoch can be current:
/// a node's epoch only grows, so the row holds at least the higher one. The lower one is
/// reported stale without a look.
pub async fn record_heartbeats(
    conn: &impl ConnectionTrait,
    beats: &[(NodeId, i64, DateTime<Utc>)],
) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let mut stale = Vec::new();
    // Each node's newest beat: the highest epoch, and of that epoch the latest time.
    let mut newest: BTreeMap<&NodeId, (i64, DateTime<Utc>)> = BTreeMap::new();
    for (node_id, epoch, at) in beats {
        match newest.entry(node_id) {
            Entry::Vacant(slot) => {
                slot.insert((*epoch, *at));
            }
            Entry::Occupied(mut slot) => {
                let (kept_epoch, kept_at) = *slot.get();
                if *epoch > kept_epoch {
                    stale.push((node_id.clone(), kept_epoch));
                    slot.insert((*epoch, *at));
                } else if *epoch < kept_epoch {
                    stale.push((node_id.clone(), *epoch));
                } else if *at > kept_at {
                    slot.insert((*epoch, *at));
                }
            }
        }
    }
    let newest: Vec<(&NodeId, i64, DateTime<Utc>)> = newest
        .into_iter()
        .map(|(node_id, (epoch, at))| (node_id, epoch, at))
        .collect();
    for chunk in newest.chunks(HEARTBEAT_CHUNK) {
        let ids: Vec<String> = chunk.iter().map(|(id, _, _)| id.to_string()).collect();
        let select = node_session::Entity::find()
            .select_only()
            .column(node_session::Column::NodeId)
            .column(node_session::Column::Epoch)
            .filter(one_of(
                Expr::col(node_session::Column::NodeId),
                &ids,
                conn.get_database_backend(),
            ))
            .filter(node_session::Column::DisconnectedAt.is_null())
            .order_by_asc(node_session::Column::NodeId);
        let open: HashMap<String, i64> = super::lock_for_update(select, conn)
            .into_tuple::<(String, i64)>()
            .all(conn)
            .await?
            .into_iter()
            .collect();
        let mut current = Vec::with_capacity(chunk.len());
        for ((node_id, epoch, at), id) in chunk.iter().zip(ids) {
            if open.get(&id) == Some(epoch) {
                current.push(ValueTuple::Two(id.into(), (*at).into()));
            } else {
                stale.push(((*node_id).clone(), *epoch));
            }
        }
        // UPDATE node_sessions SET last_seen = beat.column2 FROM (VALUES (id, at), …) AS beat
        // WHERE node_sessions.node_id = beat.column1 (both backends name a VALUES list's
        // columns column1, column2, …), a run of beats at a time (batch_shapes).
        for current in runs(current, HEARTBEAT_CHUNK) {
            let beat = || Alias::new("beat");
            let update = Query::update()
                .table(node_session::Entity)
                .value(
                    node_session::Column::LastSeen,
                    Expr::col((beat(), Alias::new("column2"))),
                )
                .from(TableRef::ValuesList(current, beat().into_iden()))
                .and_where(
                    Expr::col((node_session::Entity, node_session::Column::NodeId))
                        .equals((beat(), Alias::new("column1"))),
                )
                .to_owned();
            conn.execute(&update).await?;
        }
    }
    stale.sort();
    stale.dedup();
    Ok(stale)
}

/// Closes whatever session of the node is open (its identity was replaced).
pub async fn close_open(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    node_session::Entity::update_many()
        .col_expr(
            node_session::Column::DisconnectedAt,
            sea_orm::sea_query::Expr::val(now),
        )
        .filter(node_session::Column::NodeId.eq(node_id.to_string()))
        .filter(node_session::Column::DisconnectedAt.is_null())
        .exec(conn)
        .await?;
    Ok(())
}

/// The sessions of several nodes.
pub async fn of_nodes(
    conn: &impl ConnectionTrait,
    ids: &[String],
) -> anyhow::Result<HashMap<String, Session>> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    Ok(node_session::Entity::find()
        .filter(one_of(
            Expr::col(node_session::Column::NodeId),
            ids,
            conn.get_database_backend(),
        ))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| (row.node_id.clone(), super::rows::session(row)))
        .collect())
}
