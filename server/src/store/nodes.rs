//! Node rows: load (with children), insert, save, list with filters, capacity.

use anyhow::anyhow;
use bc_core::axes::{Connectivity, ProvisionState, Role, Trust};
use bc_core::ids::{NodeId, PoolId, SiteId, TenantId};
use bc_core::node::{NodeRecord, Session};
use bc_core::schedule::CapacityBucket;
use bc_entity::{
    node, node_condition, node_label, node_no_schedule_reason, node_session, node_taint,
};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{
    ColumnTrait, Condition, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    QueryTrait,
};
use std::collections::HashMap;

use super::rows::{self, NodeChildren};
use super::schedule_sql;

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

/// The sessions of several nodes.
pub async fn sessions(
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
        .map(|row| (row.node_id.clone(), rows::session(row)))
        .collect())
}

/// A label selector term: the key is present, or has this value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSelector {
    pub key: String,
    pub value: Option<String>,
}

/// Which nodes to list. Lists within one field are "any of"; fields and label selectors
/// combine with "and", as in Kubernetes selectors.
#[derive(Debug, Clone, Default)]
pub struct NodeFilter {
    /// Only these nodes (empty: any).
    pub ids: Vec<NodeId>,
    pub provision_states: Vec<ProvisionState>,
    pub connectivity: Vec<Connectivity>,
    pub maintenance: Option<bool>,
    pub cordoned: Option<bool>,
    pub roles: Vec<Role>,
    pub trusts: Vec<Trust>,
    pub site_ids: Vec<SiteId>,
    pub pool_ids: Vec<PoolId>,
    pub labels: Vec<LabelSelector>,
    /// Nodes with any of these `noScheduleReasons` (exact keys such as `taint:gpu-burn`).
    pub reasons: Vec<String>,
    pub buckets: Vec<CapacityBucket>,
    pub schedulable: Option<bool>,
    pub hostname_contains: Option<String>,
    /// Visibility: a tenant principal sees only its own nodes.
    pub owner: Option<TenantId>,
    pub include_deleted: bool,
}

impl NodeFilter {
    fn condition(&self) -> Condition {
        fn strings<T: ToString>(values: &[T]) -> Vec<String> {
            values.iter().map(ToString::to_string).collect()
        }
        let mut cond = Condition::all();
        if !self.include_deleted {
            cond = cond.add(node::Column::DeletedAt.is_null());
        }
        if let Some(owner) = &self.owner {
            cond = cond.add(node::Column::OwnerTenantId.eq(owner.to_string()));
        }
        if !self.ids.is_empty() {
            cond = cond.add(node::Column::Id.is_in(strings(&self.ids)));
        }
        if !self.provision_states.is_empty() {
            cond = cond.add(node::Column::ProvisionState.is_in(strings(&self.provision_states)));
        }
        if !self.connectivity.is_empty() {
            cond = cond.add(node::Column::Connectivity.is_in(strings(&self.connectivity)));
        }
        if let Some(maintenance) = self.maintenance {
            cond = cond.add(node::Column::Maintenance.eq(maintenance));
        }
        if let Some(cordoned) = self.cordoned {
            cond = cond.add(node::Column::Cordoned.eq(cordoned));
        }
        if !self.roles.is_empty() {
            cond = cond.add(node::Column::Role.is_in(strings(&self.roles)));
        }
        if !self.trusts.is_empty() {
            cond = cond.add(node::Column::Trust.is_in(strings(&self.trusts)));
        }
        if !self.site_ids.is_empty() {
            cond = cond.add(node::Column::SiteId.is_in(strings(&self.site_ids)));
        }
        if !self.pool_ids.is_empty() {
            cond = cond.add(node::Column::PoolId.is_in(strings(&self.pool_ids)));
        }
        for selector in &self.labels {
            let alias = Alias::new("selected_label");
            let mut sub = Query::select();
            sub.expr(Expr::val(1))
                .from_as(node_label::Entity, alias.clone())
                .and_where(
                    Expr::col((alias.clone(), node_label::Column::NodeId))
                        .equals((node::Entity, node::Column::Id)),
                )
                .and_where(
                    Expr::col((alias.clone(), node_label::Column::Key)).eq(selector.key.as_str()),
                );
            if let Some(value) = &selector.value {
                sub.and_where(Expr::col((alias, node_label::Column::Value)).eq(value.as_str()));
            }
            cond = cond.add(Expr::exists(sub.to_owned()));
        }
        if !self.reasons.is_empty() {
            let alias = Alias::new("selected_reason");
            let sub = Query::select()
                .expr(Expr::val(1))
                .from_as(node_no_schedule_reason::Entity, alias.clone())
                .and_where(
                    Expr::col((alias.clone(), node_no_schedule_reason::Column::NodeId))
                        .equals((node::Entity, node::Column::Id)),
                )
                .and_where(
                    Expr::col((alias, node_no_schedule_reason::Column::Reason))
                        .is_in(self.reasons.clone()),
                )
                .to_owned();
            cond = cond.add(Expr::exists(sub));
        }
        if !self.buckets.is_empty() {
            cond = cond.add(
                schedule_sql::bucket().is_in(self.buckets.iter().map(|b| b.as_ref().to_owned())),
            );
        }
        if let Some(schedulable) = self.schedulable {
            let predicate = schedule_sql::schedulable();
            cond = cond.add(if schedulable {
                predicate
            } else {
                predicate.not()
            });
        }
        if let Some(needle) = &self.hostname_contains {
            let escaped = needle
                .replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_");
            // Case-insensitive on both databases (SQLite's LIKE already is for ASCII,
            // PostgreSQL's is not): hostnames are DNS names.
            cond = cond.add(
                sea_orm::sea_query::Func::lower(Expr::col((node::Entity, node::Column::Hostname)))
                    .like(
                        sea_orm::sea_query::LikeExpr::new(format!(
                            "%{}%",
                            escaped.to_ascii_lowercase()
                        ))
                        .escape('\\'),
                    ),
            );
        }
        cond
    }
}

impl NodeFilter {
    /// The same filter in Rust, for the live feed (which must not query the database per
    /// event per subscriber). `server/tests/node_queries.rs` checks it agrees with the SQL.
    pub fn matches(&self, detail: &bc_core::view::NodeDetail) -> bool {
        fn any<T: PartialEq>(wanted: &[T], value: &T) -> bool {
            wanted.is_empty() || wanted.contains(value)
        }
        let (n, schedulability) = (&detail.record, &detail.schedulability);
        (self.include_deleted || n.deleted_at.is_none())
            && self
                .owner
                .as_ref()
                .is_none_or(|o| n.owner_tenant_id.as_ref() == Some(o))
            && any(&self.ids, &n.id)
            && any(&self.provision_states, &n.provision_state)
            && any(&self.connectivity, &n.connectivity)
            && self.maintenance.is_none_or(|m| m == n.maintenance)
            && self.cordoned.is_none_or(|c| c == n.cordon.is_some())
            && any(&self.roles, &n.role)
            && any(&self.trusts, &n.trust)
            && any(&self.site_ids, &n.site_id)
            && (self.pool_ids.is_empty()
                || n.pool_id
                    .as_ref()
                    .is_some_and(|p| self.pool_ids.contains(p)))
            && self.labels.iter().all(|selector| {
                match (n.labels.get(&selector.key), &selector.value) {
                    (Some(value), Some(wanted)) => value == wanted,
                    (Some(_), None) => true,
                    (None, _) => false,
                }
            })
            && (self.reasons.is_empty()
                || n.no_schedule_reasons
                    .iter()
                    .any(|r| self.reasons.contains(&r.key.to_string())))
            && any(&self.buckets, &schedulability.bucket)
            && self
                .schedulable
                .is_none_or(|s| s == schedulability.schedulable)
            && self.hostname_contains.as_ref().is_none_or(|h| {
                n.hostname
                    .to_ascii_lowercase()
                    .contains(&h.to_ascii_lowercase())
            })
    }
}

/// One page of nodes ordered by id, after the cursor `after`, at most `limit`.
pub async fn list(
    conn: &impl ConnectionTrait,
    filter: &NodeFilter,
    after: Option<&str>,
    limit: u64,
) -> anyhow::Result<Vec<NodeRecord>> {
    let mut select = node::Entity::find().filter(filter.condition());
    if let Some(after) = after {
        select = select.filter(node::Column::Id.gt(after));
    }
    let rows = select
        .order_by_asc(node::Column::Id)
        .limit(limit)
        .all(conn)
        .await?;
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

/// Each node's capacity bucket as computed by the SQL expression, for the property test
/// that compares it with the Rust predicate.
pub async fn sql_buckets(
    conn: &impl ConnectionTrait,
) -> anyhow::Result<HashMap<String, (CapacityBucket, bool)>> {
    let stmt = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .expr_as(schedule_sql::bucket(), "bucket")
        .expr_as(schedule_sql::schedulable(), "schedulable")
        .build(conn.get_database_backend());
    let mut out = HashMap::new();
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
pub async fn capacity(
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
