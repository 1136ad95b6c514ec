//! Which nodes a list, a count or a live subscription wants: [`NodeFilter`], translated to
//! SQL for reads and evaluated in Rust for the live feed, which must agree.

use bc_core::axes::{Connectivity, ProvisionState, Role, Trust};
use bc_core::ids::{NodeId, PoolId, SiteId, TenantId};
use bc_core::schedule::CapacityBucket;
use bc_entity::{node, node_label, node_no_schedule_reason, node_session};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ColumnTrait, Condition};

use super::schedule_sql;

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
    /// Nodes whose open session is held by any of these gateway replicas. The live feed
    /// cannot follow it (a session moves to another gateway without a node change), so
    /// subscriptions refuse it.
    pub gateway_ids: Vec<String>,
    /// Visibility: a tenant principal sees only its own nodes.
    pub owner: Option<TenantId>,
    pub include_deleted: bool,
}

impl NodeFilter {
    pub(super) fn condition(&self) -> Condition {
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
        if !self.gateway_ids.is_empty() {
            // On PostgreSQL, answered from `ix_node_sessions_open_by_gateway` (open sessions
            // by gateway); the literal `IS NULL` is the index's predicate.
            let alias = Alias::new("held_session");
            let sub = Query::select()
                .expr(Expr::val(1))
                .from_as(node_session::Entity, alias.clone())
                .and_where(
                    Expr::col((alias.clone(), node_session::Column::NodeId))
                        .equals((node::Entity, node::Column::Id)),
                )
                .and_where(
                    Expr::col((alias.clone(), node_session::Column::GatewayId))
                        .is_in(self.gateway_ids.clone()),
                )
                .and_where(Expr::col((alias, node_session::Column::DisconnectedAt)).is_null())
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
    /// event per subscriber). `server/tests/it/schedulable_sql.rs` checks the schedulability
    /// checks agree with the SQL; the unit tests below check the session's gateway.
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
            && (self.gateway_ids.is_empty()
                || detail.session.as_ref().is_some_and(|session| {
                    session.disconnected_at.is_none()
                        && self.gateway_ids.contains(&session.gateway_id)
                }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::axes::Adapter;
    use bc_core::node::{NewNode, NodeRecord, Session};
    use bc_core::view::NodeDetail;
    use chrono::{TimeZone, Utc};
    use std::collections::BTreeMap;

    /// A node whose session, if any, is held by `gateway` and open or closed.
    fn node_with_session(session: Option<(&str, bool)>) -> NodeDetail {
        let at = Utc.with_ymd_and_hms(2026, 12, 6, 3, 0, 0).unwrap();
        let record = NodeRecord::new(
            NewNode {
                hostname: "gpu-1.example.com".into(),
                site_id: SiteId::generate(),
                pool_id: None,
                owner_tenant_id: None,
                role: Role::Host,
                trust: Trust::Platform,
                adapter: Adapter::BcdV1,
                drivers: BTreeMap::new(),
                provision_state: ProvisionState::Adopted,
            },
            at,
        )
        .expect("a valid node");
        let session = session.map(|(gateway, open)| Session {
            epoch: 1,
            gateway_id: gateway.to_owned(),
            connected_at: at,
            disconnected_at: (!open).then_some(at),
            last_seen: at,
        });
        NodeDetail::new(record, session, None)
    }

    /// The feed's predicate agrees with the SQL's (`server/tests/it/node_queries.rs`): only an
    /// open session on a listed gateway matches, and an empty list matches every node.
    #[test]
    fn a_gateway_filter_matches_open_sessions_on_the_listed_gateways() {
        let filter = |gateways: &[&str]| NodeFilter {
            gateway_ids: gateways.iter().map(|g| (*g).to_owned()).collect(),
            ..NodeFilter::default()
        };
        let cases = [
            (Some(("gw-a", true)), &["gw-a"][..], true),
            (Some(("gw-a", true)), &["gw-b", "gw-a"][..], true),
            (Some(("gw-a", false)), &["gw-a"][..], false),
            (Some(("gw-b", true)), &["gw-a"][..], false),
            (Some(("GW-A", true)), &["gw-a"][..], false),
            (None, &["gw-a"][..], false),
            (None, &[][..], true),
            (Some(("gw-a", false)), &[][..], true),
        ];
        for (session, gateways, want) in cases {
            assert_eq!(
                filter(gateways).matches(&node_with_session(session)),
                want,
                "session {session:?}, filter {gateways:?}"
            );
        }
    }
}
