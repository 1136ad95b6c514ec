//! Sessions and heartbeats: one `node_sessions` row per node, holding the current epoch,
//! the gateway that holds it and `lastSeen`. Heartbeats write here, never to the node row, so
//! they never bump the node's `version`.

use bc_core::ids::NodeId;
use bc_core::node::Session;
use bc_entity::node_session;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::OnConflict;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter};
use std::collections::HashMap;

/// Opens a session: the next epoch for the node, connected now. Returns the epoch.
pub async fn open(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    gateway_id: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<i64> {
    let previous = node_session::Entity::find_by_id(node_id.to_string())
        .one(conn)
        .await?;
    let epoch = previous.map_or(1, |s| s.epoch + 1);
    let row = node_session::ActiveModel {
        node_id: Set(node_id.to_string()),
        epoch: Set(epoch),
        gateway_id: Set(gateway_id.to_owned()),
        connected_at: Set(now),
        disconnected_at: Set(None),
        last_seen: Set(now),
    };
    node_session::Entity::insert(row)
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
    Ok(epoch)
}

/// Marks the session of `epoch` closed. Returns whether it was still the current session
/// (a newer epoch may have replaced it, in which case nothing changes).
pub async fn close(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
    epoch: i64,
    now: DateTime<Utc>,
) -> anyhow::Result<bool> {
    let result = node_session::Entity::update_many()
        .col_expr(
            node_session::Column::DisconnectedAt,
            sea_orm::sea_query::Expr::val(now),
        )
        .filter(node_session::Column::NodeId.eq(node_id.to_string()))
        .filter(node_session::Column::Epoch.eq(epoch))
        .filter(node_session::Column::DisconnectedAt.is_null())
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// The epoch of the node's latest session (open or closed), if it ever had one.
pub async fn current_epoch(
    conn: &impl ConnectionTrait,
    node_id: &NodeId,
) -> anyhow::Result<Option<i64>> {
    Ok(node_session::Entity::find_by_id(node_id.to_string())
        .one(conn)
        .await?
        .map(|s| s.epoch))
}

/// Records heartbeats: `last_seen` of each (node, epoch) that is still the current, open
/// session. Returns the entries that were not (their session was superseded or closed).
///
/// The rows are updated in node id order, whatever the order of `beats`: two batches (two
/// replicas') lock the session rows they share in the same order (ARCHITECTURE.md,
/// Invariants: lock order).
pub async fn record_heartbeats(
    conn: &impl ConnectionTrait,
    beats: &[(NodeId, i64, DateTime<Utc>)],
) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let mut ordered: Vec<&(NodeId, i64, DateTime<Utc>)> = beats.iter().collect();
    ordered.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    let mut stale = Vec::new();
    for (node_id, epoch, at) in ordered {
        let result = node_session::Entity::update_many()
            .col_expr(
                node_session::Column::LastSeen,
                sea_orm::sea_query::Expr::val(*at),
            )
            .filter(node_session::Column::NodeId.eq(node_id.to_string()))
            .filter(node_session::Column::Epoch.eq(*epoch))
            .filter(node_session::Column::DisconnectedAt.is_null())
            .exec(conn)
            .await?;
        if result.rows_affected == 0 {
            stale.push((node_id.clone(), *epoch));
        }
    }
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
        .filter(node_session::Column::NodeId.is_in(ids.to_vec()))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| (row.node_id.clone(), super::rows::session(row)))
        .collect())
}
