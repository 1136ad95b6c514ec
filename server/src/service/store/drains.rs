//! Drains: the drain-deadline controller's query.

use anyhow::anyhow;
use bc_core::ids::NodeId;
use bc_entity::node;
use chrono::{DateTime, Utc};
use sea_orm::ConnectionTrait;
use sea_orm::sea_query::{Expr, ExprTrait, Order, Query};

fn node_col(column: node::Column) -> Expr {
    Expr::col((node::Entity, column))
}

/// A drain whose deadline has passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpiredDrain {
    pub node_id: NodeId,
    pub version: i64,
    pub deadline: DateTime<Utc>,
}

/// Live nodes draining with a deadline at or before `now`.
pub async fn past_deadline(
    conn: &impl ConnectionTrait,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<ExpiredDrain>> {
    let query = Query::select()
        .column((node::Entity, node::Column::Id))
        .column((node::Entity, node::Column::Version))
        .column((node::Entity, node::Column::DrainDeadline))
        .from(node::Entity)
        .and_where(node_col(node::Column::DeletedAt).is_null())
        .and_where(node_col(node::Column::DrainStartedAt).is_not_null())
        .and_where(node_col(node::Column::DrainDeadline).lte(now))
        .order_by((node::Entity, node::Column::Id), Order::Asc)
        .to_owned();
    conn.query_all(&query)
        .await?
        .iter()
        .map(|row| {
            let id: String = row.try_get("", "id")?;
            Ok(ExpiredDrain {
                node_id: NodeId::parse(&id)
                    .map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?,
                version: row.try_get("", "version")?,
                deadline: row.try_get("", "drain_deadline")?,
            })
        })
        .collect()
}
