//! The queries of the Liveness and drain-deadline controllers: one indexed query per kind
//! of candidate, joined with `node_sessions`, so a tick never loads the whole fleet.
//!
//! Liveness watches the nodes that heartbeat: live (not deleted) `bcd/v1` nodes that have a
//! session row or are not `disconnected`. A node that never opened a session (a bare-metal
//! machine being enrolled, a freshly joined node whose daemon has not said `Hello` yet) has
//! no heartbeat to miss and is left alone; `provider-api/v1` nodes have no daemon at all.

use anyhow::anyhow;
use bc_core::axes::{Adapter, Connectivity};
use bc_core::ids::{NodeId, SiteId};
use bc_entity::{node, node_session};
use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Cond, Expr, ExprTrait, Func, Order, Query, SelectStatement};
use sea_orm::{ConnectionTrait, EntityTrait, QueryFilter, QueryOrder, QueryResult, QuerySelect};
use std::collections::{HashMap, HashSet};

use super::batch_shapes::one_of;
use super::sessions::HEARTBEAT_CHUNK;

/// A node a liveness rule picked, with what the rule saw. `version` is passed back with the
/// change (`apply_node_changes`, or `change_silent_nodes` for silent ones), so a node that
/// changed since this query is skipped (`CONFLICT`) and looked at again next tick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: NodeId,
    pub site_id: SiteId,
    pub version: i64,
    pub connectivity: Connectivity,
    pub connectivity_since: DateTime<Utc>,
    /// The session's last heartbeat; `None` when the node has no session row.
    pub last_seen: Option<DateTime<Utc>>,
}

/// A site's numbers for the fleet brake.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteLiveness {
    /// Nodes Liveness watches (see the module documentation).
    pub watched: u64,
    /// Of those, the ones that are `unreachable` and became so at or after the window start.
    pub recently_unreachable: u64,
}

fn node_col(column: node::Column) -> Expr {
    Expr::col((node::Entity, column))
}

fn session_col(column: node_session::Column) -> Expr {
    Expr::col((node_session::Entity, column))
}

fn connectivity_in(values: &[Connectivity]) -> Expr {
    node_col(node::Column::Connectivity).is_in(values.iter().map(|c| c.as_static_str()))
}

/// `nodes LEFT JOIN node_sessions`, restricted to live `bcd/v1` nodes.
fn watched_nodes() -> SelectStatement {
    Query::select()
        .from(node::Entity)
        .left_join(
            node_session::Entity,
            session_col(node_session::Column::NodeId).equals((node::Entity, node::Column::Id)),
        )
        .and_where(node_col(node::Column::DeletedAt).is_null())
        .and_where(node_col(node::Column::Adapter).eq(Adapter::BcdV1.as_static_str()))
        .to_owned()
}

async fn candidates(conn: &impl ConnectionTrait, rule: Cond) -> anyhow::Result<Vec<Candidate>> {
    let query = watched_nodes()
        .column((node::Entity, node::Column::Id))
        .column((node::Entity, node::Column::SiteId))
        .column((node::Entity, node::Column::Version))
        .column((node::Entity, node::Column::Connectivity))
        .column((node::Entity, node::Column::ConnectivitySince))
        .column((node_session::Entity, node_session::Column::LastSeen))
        .cond_where(rule)
        .order_by((node::Entity, node::Column::Id), Order::Asc)
        .to_owned();
    conn.query_all(&query)
        .await?
        .iter()
        .map(candidate)
        .collect()
}

fn candidate(row: &QueryResult) -> anyhow::Result<Candidate> {
    let id: String = row.try_get("", "id")?;
    let site: String = row.try_get("", "site_id")?;
    let connectivity: String = row.try_get("", "connectivity")?;
    Ok(Candidate {
        node_id: NodeId::parse(&id).map_err(|_| anyhow!("corrupt row: nodes.id = `{id}`"))?,
        site_id: SiteId::parse(&site)
            .map_err(|_| anyhow!("corrupt row: nodes.site_id = `{site}`"))?,
        version: row.try_get("", "version")?,
        connectivity: connectivity
            .parse()
            .map_err(|_| anyhow!("corrupt row: nodes.connectivity = `{connectivity}`"))?,
        connectivity_since: row.try_get("", "connectivity_since")?,
        last_seen: row.try_get("", "last_seen")?,
    })
}

/// `connected` and `disconnected` nodes with no heartbeat since `cutoff`: those with a
/// session whose `last_seen` is older, and `connected` ones without a session row that have
/// been connected since before `cutoff` (they never heartbeat at all).
pub async fn silent(
    conn: &impl ConnectionTrait,
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Vec<Candidate>> {
    let with_session = Cond::all()
        .add(session_col(node_session::Column::NodeId).is_not_null())
        .add(session_col(node_session::Column::LastSeen).lt(cutoff));
    let without_session = Cond::all()
        .add(session_col(node_session::Column::NodeId).is_null())
        .add(node_col(node::Column::Connectivity).eq(Connectivity::Connected.as_static_str()))
        .add(node_col(node::Column::ConnectivitySince).lt(cutoff));
    candidates(
        conn,
        Cond::all()
            .add(connectivity_in(&[
                Connectivity::Connected,
                Connectivity::Disconnected,
            ]))
            .add(Cond::any().add(with_session).add(without_session)),
    )
    .await
}

/// Which of `ids` have a session that heartbeated (or opened) at or after `cutoff`: the
/// session half of [`silent`]'s rule, read again by the transaction about to mark those nodes
/// (the rest of the rule, their connectivity, is what each candidate's version guards).
///
/// On PostgreSQL the rows are read `FOR SHARE` by their keys alone, and compared here: a
/// heartbeat batch that has written a row but not yet committed holds it, so the read waits
/// for that commit and then returns the new `last_seen`. (A condition on `last_seen` in the
/// query would be judged on the row as it was before, and the read would not wait.) The rows
/// are taken in node id order, as heartbeat batches take theirs, so a mark and a heartbeat
/// batch that share rows wait for one another in one direction only; and heartbeat batches
/// lock session rows only, so this wait closes no cycle (ARCHITECTURE.md, lock order, step
/// 5). One statement reads as many sessions as one heartbeat read does, for the same reason
/// (the planner keeps the lookup by key).
pub async fn heard_since(
    conn: &impl ConnectionTrait,
    ids: &[NodeId],
    cutoff: DateTime<Utc>,
) -> anyhow::Result<HashSet<NodeId>> {
    let mut sorted: Vec<String> = ids.iter().map(ToString::to_string).collect();
    sorted.sort();
    sorted.dedup();
    let mut heard = HashSet::new();
    for chunk in sorted.chunks(HEARTBEAT_CHUNK) {
        let select = node_session::Entity::find()
            .select_only()
            .column(node_session::Column::NodeId)
            .column(node_session::Column::LastSeen)
            .filter(one_of(
                Expr::col(node_session::Column::NodeId),
                chunk,
                conn.get_database_backend(),
            ))
            .order_by_asc(node_session::Column::NodeId);
        let rows: Vec<(String, DateTime<Utc>)> = super::lock_for_share(select, conn)
            .into_tuple()
            .all(conn)
            .await?;
        for (id, last_seen) in rows {
            if last_seen >= cutoff {
                heard.insert(
                    NodeId::parse(&id)
                        .map_err(|_| anyhow!("corrupt row: node_sessions.node_id = `{id}`"))?,
                );
            }
        }
    }
    Ok(heard)
}

/// `unreachable` and `lost` nodes whose session is open and heartbeated at or after
/// `cutoff`: the daemon is talking again.
pub async fn heard_again(
    conn: &impl ConnectionTrait,
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Vec<Candidate>> {
    candidates(
        conn,
        Cond::all()
            .add(connectivity_in(&[
                Connectivity::Unreachable,
                Connectivity::Lost,
            ]))
            .add(session_col(node_session::Column::NodeId).is_not_null())
            .add(session_col(node_session::Column::DisconnectedAt).is_null())
            .add(session_col(node_session::Column::LastSeen).gte(cutoff)),
    )
    .await
}

/// `unreachable` nodes that have been so since before `cutoff`.
pub async fn unreachable_since_before(
    conn: &impl ConnectionTrait,
    cutoff: DateTime<Utc>,
) -> anyhow::Result<Vec<Candidate>> {
    candidates(
        conn,
        Cond::all()
            .add(connectivity_in(&[Connectivity::Unreachable]))
            .add(node_col(node::Column::ConnectivitySince).lt(cutoff)),
    )
    .await
}

/// For each of `sites`, the nodes Liveness watches and how many of them became
/// `unreachable` at or after `window_start`: one grouped query. Sites with no watched node
/// are absent.
pub async fn site_liveness(
    conn: &impl ConnectionTrait,
    sites: &[SiteId],
    window_start: DateTime<Utc>,
) -> anyhow::Result<HashMap<SiteId, SiteLiveness>> {
    if sites.is_empty() {
        return Ok(HashMap::new());
    }
    let recently_unreachable = Expr::case(
        Cond::all()
            .add(node_col(node::Column::Connectivity).eq(Connectivity::Unreachable.as_static_str()))
            .add(node_col(node::Column::ConnectivitySince).gte(window_start)),
        1,
    );
    let query = watched_nodes()
        .column((node::Entity, node::Column::SiteId))
        .expr_as(node_col(node::Column::Id).count(), "watched")
        .expr_as(Func::count(recently_unreachable), "recently_unreachable")
        .cond_where(
            Cond::any()
                .add(session_col(node_session::Column::NodeId).is_not_null())
                .add(
                    node_col(node::Column::Connectivity)
                        .ne(Connectivity::Disconnected.as_static_str()),
                ),
        )
        .and_where(node_col(node::Column::SiteId).is_in(sites.iter().map(|s| s.as_str())))
        .group_by_col((node::Entity, node::Column::SiteId))
        .to_owned();
    let mut out = HashMap::new();
    for row in conn.query_all(&query).await? {
        let site: String = row.try_get("", "site_id")?;
        let watched: i64 = row.try_get("", "watched")?;
        let recently_unreachable: i64 = row.try_get("", "recently_unreachable")?;
        out.insert(
            SiteId::parse(&site).map_err(|_| anyhow!("corrupt row: nodes.site_id = `{site}`"))?,
            SiteLiveness {
                watched: u64::try_from(watched).unwrap_or(0),
                recently_unreachable: u64::try_from(recently_unreachable).unwrap_or(0),
            },
        );
    }
    Ok(out)
}
