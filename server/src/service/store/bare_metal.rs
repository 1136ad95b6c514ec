//! `node_bmcs`: a bare-metal node's BMC and the Power controller's bookkeeping.

use anyhow::Context;
use bc_core::axes::{ConditionStatus, Power};
use bc_core::bare_metal::{BMC_UNREACHABLE, BmcTlsVerification};
use bc_core::ids::{NodeId, SiteId};
use bc_entity::{node, node_bmc, node_condition, node_enrolled_identifier};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};
use std::collections::{BTreeMap, HashMap};

use super::batch_shapes::one_of;

/// A node's BMC as stored: the credentials still sealed.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredBmc {
    pub node_id: NodeId,
    pub address: String,
    pub system_id: Option<String>,
    pub tls_verification: BmcTlsVerification,
    pub ca_pem: Option<String>,
    pub credential_key_id: String,
    pub sealed_credentials: String,
    pub system_path: Option<String>,
    pub reachable: Option<bool>,
    pub last_error: Option<String>,
    pub consecutive_failures: i64,
    pub last_polled_at: Option<DateTime<Utc>>,
    pub next_poll_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
}

impl std::fmt::Debug for StoredBmc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredBmc")
            .field("node_id", &self.node_id)
            .field("address", &self.address)
            .field("reachable", &self.reachable)
            .finish_non_exhaustive()
    }
}

/// What one poll found, for [`record_polls`].
#[derive(Debug, Clone)]
pub struct PollRecord {
    pub node_id: NodeId,
    pub polled_at: DateTime<Utc>,
    /// `None` when the BMC answered.
    pub error: Option<String>,
    pub consecutive_failures: i64,
    pub next_poll_at: DateTime<Utc>,
    pub system_path: Option<String>,
}

/// A BMC due for a poll, with what the poll needs of its node.
#[derive(Debug, Clone)]
pub struct DueBmc {
    pub bmc: StoredBmc,
    pub site_id: SiteId,
    pub drivers: BTreeMap<String, String>,
    /// The machine's enrolled system UUID, if any (to pick its system among several).
    pub system_uuid: Option<String>,
    /// The node's `power` when the list was read.
    pub power: Power,
    /// Whether `BmcUnreachable` was `true` when the list was read.
    pub bmc_unreachable: bool,
}

fn from_row(row: node_bmc::Model) -> anyhow::Result<StoredBmc> {
    let corrupt = |column: &str| format!("corrupt row: node_bmcs.{column} of `{}`", row.node_id);
    Ok(StoredBmc {
        node_id: NodeId::parse(&row.node_id)
            .map_err(|_| anyhow::anyhow!("{}", corrupt("node_id")))?,
        tls_verification: row
            .tls_verification
            .parse()
            .map_err(|_| anyhow::anyhow!("{}", corrupt("tls_verification")))?,
        address: row.address,
        system_id: row.system_id,
        ca_pem: row.ca_pem,
        credential_key_id: row.credential_key_id,
        sealed_credentials: row.sealed_credentials,
        system_path: row.system_path,
        reachable: row.reachable,
        last_error: row.last_error,
        consecutive_failures: row.consecutive_failures,
        last_polled_at: row.last_polled_at,
        next_poll_at: row.next_poll_at,
        created_at: row.created_at,
    })
}

pub async fn insert(conn: &impl ConnectionTrait, bmc: &StoredBmc) -> anyhow::Result<()> {
    node_bmc::Entity::insert(node_bmc::ActiveModel {
        node_id: Set(bmc.node_id.to_string()),
        address: Set(bmc.address.clone()),
        system_id: Set(bmc.system_id.clone()),
        tls_verification: Set(bmc.tls_verification.to_string()),
        ca_pem: Set(bmc.ca_pem.clone()),
        credential_key_id: Set(bmc.credential_key_id.clone()),
        sealed_credentials: Set(bmc.sealed_credentials.clone()),
        system_path: Set(bmc.system_path.clone()),
        reachable: Set(bmc.reachable),
        last_error: Set(bmc.last_error.clone()),
        consecutive_failures: Set(bmc.consecutive_failures),
        last_polled_at: Set(bmc.last_polled_at),
        next_poll_at: Set(bmc.next_poll_at),
        created_at: Set(bmc.created_at),
    })
    .exec_without_returning(conn)
    .await?;
    Ok(())
}

pub async fn load(conn: &impl ConnectionTrait, id: &NodeId) -> anyhow::Result<Option<StoredBmc>> {
    node_bmc::Entity::find_by_id(id.to_string())
        .one(conn)
        .await?
        .map(from_row)
        .transpose()
}

/// The BMCs of live nodes whose next poll is due at `now`, the longest overdue first, at
/// most `limit`: one indexed query, then the nodes' site and drivers and the enrolled
/// system UUIDs of just those.
pub async fn due(
    conn: &impl ConnectionTrait,
    now: DateTime<Utc>,
    limit: u64,
) -> anyhow::Result<Vec<DueBmc>> {
    // Deleted nodes keep their row (soft delete) and are never polled; filtering them here
    // keeps them from filling the work list's head.
    let live = sea_orm::sea_query::Query::select()
        .column(node::Column::Id)
        .from(node::Entity)
        .and_where(node::Column::DeletedAt.is_null())
        .to_owned();
    let rows = node_bmc::Entity::find()
        .filter(node_bmc::Column::NextPollAt.lte(now))
        .filter(node_bmc::Column::NodeId.in_subquery(live))
        .order_by_asc(node_bmc::Column::NextPollAt)
        .limit(limit)
        .all(conn)
        .await?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = rows.iter().map(|r| r.node_id.clone()).collect();
    let backend = conn.get_database_backend();
    let nodes: HashMap<String, (String, serde_json::Value, String)> = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .column(node::Column::SiteId)
        .column(node::Column::Drivers)
        .column(node::Column::Power)
        .filter(one_of(Expr::col(node::Column::Id), &ids, backend))
        .filter(node::Column::DeletedAt.is_null())
        .into_tuple::<(String, String, serde_json::Value, String)>()
        .all(conn)
        .await?
        .into_iter()
        .map(|(id, site, drivers, power)| (id, (site, drivers, power)))
        .collect();
    let unreachable: std::collections::HashSet<String> = node_condition::Entity::find()
        .select_only()
        .column(node_condition::Column::NodeId)
        .filter(one_of(
            Expr::col(node_condition::Column::NodeId),
            &ids,
            backend,
        ))
        .filter(node_condition::Column::ConditionType.eq(BMC_UNREACHABLE))
        .filter(node_condition::Column::Status.eq(ConditionStatus::True.to_string()))
        .into_tuple::<String>()
        .all(conn)
        .await?
        .into_iter()
        .collect();
    let uuids: HashMap<String, String> = node_enrolled_identifier::Entity::find()
        .filter(one_of(
            Expr::col(node_enrolled_identifier::Column::NodeId),
            &ids,
            backend,
        ))
        .filter(node_enrolled_identifier::Column::Kind.eq("system-uuid"))
        .all(conn)
        .await?
        .into_iter()
        .map(|row| (row.node_id, row.value))
        .collect();
    let mut due = Vec::with_capacity(rows.len());
    for row in rows {
        // A deleted node's row stays with its node (soft delete) but is never polled.
        let Some((site, drivers, power)) = nodes.get(&row.node_id) else {
            continue;
        };
        let power = power
            .parse()
            .map_err(|_| anyhow::anyhow!("corrupt row: nodes.power = `{power}`"))?;
        let bmc_unreachable = unreachable.contains(&row.node_id);
        let system_uuid = uuids.get(&row.node_id).cloned();
        let site_id = SiteId::parse(site)
            .map_err(|_| anyhow::anyhow!("corrupt row: nodes.site_id = `{site}`"))?;
        let drivers: BTreeMap<String, String> = serde_json::from_value(drivers.clone())
            .with_context(|| format!("corrupt row: nodes.drivers of `{}`", row.node_id))?;
        due.push(DueBmc {
            bmc: from_row(row)?,
            site_id,
            drivers,
            system_uuid,
            power,
            bmc_unreachable,
        });
    }
    Ok(due)
}

/// The enrolled system UUID of one node, if any.
pub async fn system_uuid(
    conn: &impl ConnectionTrait,
    id: &NodeId,
) -> anyhow::Result<Option<String>> {
    Ok(node_enrolled_identifier::Entity::find()
        .filter(node_enrolled_identifier::Column::NodeId.eq(id.to_string()))
        .filter(node_enrolled_identifier::Column::Kind.eq("system-uuid"))
        .one(conn)
        .await?
        .map(|row| row.value))
}

/// Writes what each poll found: one UPDATE per BMC, in the caller's transaction.
pub async fn record_polls(conn: &impl ConnectionTrait, polls: &[PollRecord]) -> anyhow::Result<()> {
    for poll in polls {
        node_bmc::Entity::update_many()
            .col_expr(node_bmc::Column::Reachable, Expr::val(poll.error.is_none()))
            .col_expr(node_bmc::Column::LastError, Expr::val(poll.error.clone()))
            .col_expr(
                node_bmc::Column::ConsecutiveFailures,
                Expr::val(poll.consecutive_failures),
            )
            .col_expr(node_bmc::Column::LastPolledAt, Expr::val(poll.polled_at))
            .col_expr(node_bmc::Column::NextPollAt, Expr::val(poll.next_poll_at))
            .col_expr(
                node_bmc::Column::SystemPath,
                Expr::val(poll.system_path.clone()),
            )
            .filter(node_bmc::Column::NodeId.eq(poll.node_id.to_string()))
            .exec(conn)
            .await?;
    }
    Ok(())
}

/// Makes a BMC due at `at` (after a power action: see its effect soon).
pub async fn poll_at(
    conn: &impl ConnectionTrait,
    id: &NodeId,
    at: DateTime<Utc>,
) -> anyhow::Result<()> {
    node_bmc::Entity::update_many()
        .col_expr(node_bmc::Column::NextPollAt, Expr::val(at))
        .filter(node_bmc::Column::NodeId.eq(id.to_string()))
        .exec(conn)
        .await?;
    Ok(())
}
