//! Capacity: nodes and GPUs of each pool by capacity bucket, computed in SQL with
//! `schedulableSql`'s bucket expression.

use super::schedule_sql;
use anyhow::anyhow;
use bc_core::schedule::CapacityBucket;
use bc_entity::node;
use sea_orm::sea_query::{Alias, Expr, ExprTrait};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QuerySelect, QueryTrait};

/// Each node's capacity bucket as computed by the SQL expression, for the property test
/// that compares it with the Rust predicate (through `test_support`).
#[cfg(feature = "test-support")]
pub async fn sql_buckets(
    conn: &impl ConnectionTrait,
) -> anyhow::Result<std::collections::HashMap<String, (CapacityBucket, bool)>> {
    let stmt = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .expr_as(schedule_sql::bucket(), "bucket")
        .expr_as(schedule_sql::schedulable(), "schedulable")
        .build(conn.get_database_backend());
    let mut out = std::collections::HashMap::new();
    for row in conn.query_all_raw(stmt).await? {
        let id: String = row.try_get("", "id")?;
        let bucket: String = row.try_get("", "bucket")?;
        let schedulable: bool = row.try_get("", "schedulable")?;
        out.insert(
            id,
            (
                bucket
                    .parse()
                    .map_err(|_| anyhow!("unknown bucket `{bucket}`"))?,
                schedulable,
            ),
        );
    }
    Ok(out)
}

/// One pool's capacity in one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityRow {
    pub pool_id: String,
    pub bucket: CapacityBucket,
    pub nodes: i64,
    pub gpus: i64,
}

/// Nodes and GPUs of each pool by bucket, computed in one grouped query.
pub async fn by_pool(
    conn: &impl ConnectionTrait,
    pool_ids: &[String],
) -> anyhow::Result<Vec<CapacityRow>> {
    if pool_ids.is_empty() {
        return Ok(Vec::new());
    }
    let stmt = node::Entity::find()
        .select_only()
        .column(node::Column::PoolId)
        .expr_as(schedule_sql::bucket(), "bucket")
        .expr_as(Expr::col((node::Entity, node::Column::Id)).count(), "nodes")
        .expr_as(
            Expr::col((node::Entity, node::Column::GpuCount)).sum(),
            "gpus",
        )
        .filter(node::Column::DeletedAt.is_null())
        .filter(node::Column::PoolId.is_in(pool_ids.to_vec()))
        .group_by(node::Column::PoolId)
        // By the output column: PostgreSQL does not see the `CASE` repeated here, with its own
        // bind parameters, as the selected expression and refuses the query.
        .group_by(Expr::col(Alias::new("bucket")))
        .build(conn.get_database_backend());
    let mut out = Vec::new();
    for row in conn.query_all_raw(stmt).await? {
        let bucket: String = row.try_get("", "bucket")?;
        out.push(CapacityRow {
            pool_id: row.try_get("", "pool_id")?,
            bucket: bucket
                .parse()
                .map_err(|_| anyhow!("unknown bucket `{bucket}`"))?,
            nodes: row.try_get("", "nodes")?,
            gpus: row.try_get::<Option<i64>>("", "gpus")?.unwrap_or(0),
        });
    }
    Ok(out)
}
