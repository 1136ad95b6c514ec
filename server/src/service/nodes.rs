//! Node use cases: read, list, and every change an operator makes.

use bc_core::Actor;
use bc_core::axes::TaintEffect;
use bc_core::catalog::Placement;
use bc_core::event::{Change, EventType, RecordedEvent};
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::node::{NewNode, NodeRecord};
use bc_core::provision::{ENROLL_STATE, ProvisionMove};
use bc_core::view::NodeDetail;
use chrono::{DateTime, SubsecRound, Utc};
use std::collections::BTreeMap;

use super::Services;
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};
use crate::store::{WriteTxn, catalog, events, nodes};

pub use crate::store::nodes::{CapacityRow, LabelSelector, NodeFilter};

/// One page of nodes.
pub struct NodePage {
    pub nodes: Vec<NodeDetail>,
    pub has_next_page: bool,
}

fn not_found(id: &NodeId) -> ApiError {
    ApiError::NotFound(format!("node `{id}` does not exist"))
}

impl Services {
    /// `node(id)`: a tenant asking for another tenant's node gets `NOT_FOUND`, exactly as if
    /// it did not exist.
    pub async fn node(&self, principal: &Principal, id: &NodeId) -> ApiResult<NodeDetail> {
        let read = self.store.read().await?;
        let record = nodes::load(&read, id, false)
            .await?
            .filter(|n| n.deleted_at.is_none());
        let record = record
            .filter(|n| principal.can_see(n.owner_tenant_id.as_ref()))
            .ok_or_else(|| not_found(id))?;
        self.detail_of(vec![record])
            .await?
            .pop()
            .ok_or_else(|| not_found(id))
    }

    /// `nodes(filter, first, after)`.
    pub async fn nodes(
        &self,
        principal: &Principal,
        mut filter: NodeFilter,
        after: Option<&str>,
        first: u64,
    ) -> ApiResult<NodePage> {
        filter.owner = principal.tenant.clone();
        let read = self.store.read().await?;
        let mut records = nodes::list(&read, &filter, after, first + 1).await?;
        drop(read);
        let has_next_page = records.len() as u64 > first;
        records.truncate(first as usize);
        Ok(NodePage {
            nodes: self.detail_of(records).await?,
            has_next_page,
        })
    }

    /// The API views of these nodes, deleted ones included (the live feed's enrichment).
    pub async fn node_details_by_ids(&self, ids: &[NodeId]) -> ApiResult<Vec<NodeDetail>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let filter = NodeFilter {
            ids: ids.to_vec(),
            include_deleted: true,
            ..NodeFilter::default()
        };
        let read = self.store.read().await?;
        let records = nodes::list(&read, &filter, None, ids.len() as u64).await?;
        drop(read);
        self.detail_of(records).await
    }

    /// How many nodes match `filter` (what the principal may see).
    pub async fn count_nodes(
        &self,
        principal: &Principal,
        mut filter: NodeFilter,
    ) -> ApiResult<u64> {
        filter.owner = principal.tenant.clone();
        Ok(nodes::count(self.store.db(), &filter).await?)
    }

    /// Builds the API views of several nodes with two batched queries (sessions, pool owners).
    async fn detail_of(&self, records: Vec<NodeRecord>) -> ApiResult<Vec<NodeDetail>> {
        let db = self.store.db();
        let ids: Vec<String> = records.iter().map(|n| n.id.to_string()).collect();
        let mut pool_ids: Vec<String> = records
            .iter()
            .filter_map(|n| n.pool_id.as_ref().map(ToString::to_string))
            .collect();
        pool_ids.sort();
        pool_ids.dedup();
        let mut sessions = nodes::sessions(db, &ids).await?;
        let owners = catalog::pool_owners(db, &pool_ids).await?;
        Ok(records
            .into_iter()
            .map(|record| {
                let session = sessions.remove(record.id.as_str());
                let pool_owner = record
                    .pool_id
                    .as_ref()
                    .and_then(|p| owners.get(p.as_str()))
                    .cloned()
                    .flatten();
                NodeDetail::new(record, session, pool_owner.as_ref())
            })
            .collect())
    }

    /// A node's event history, newest first.
    pub async fn node_events(
        &self,
        principal: &Principal,
        node: &NodeDetail,
        before: Option<bc_core::ids::EventId>,
        limit: u64,
    ) -> ApiResult<Vec<RecordedEvent>> {
        let node = &node.record;
        if !principal.can_see(node.owner_tenant_id.as_ref()) {
            return Err(not_found(&node.id));
        }
        Ok(events::for_node(self.store.db(), node.id.as_str(), before, limit).await?)
    }

    /// The common shape of every node mutation by a person: check the role, then
    /// [`Services::apply_node_change`] with the principal's visibility and version.
    pub async fn change_node<F>(
        &self,
        principal: &Principal,
        required: Role,
        id: &NodeId,
        expected_version: i64,
        cause: &str,
        change: F,
    ) -> ApiResult<NodeDetail>
    where
        F: FnOnce(
            &mut NodeRecord,
            &Actor,
            DateTime<Utc>,
        ) -> Result<Vec<Change>, bc_core::DomainError>,
    {
        principal.require(required)?;
        let visible = |n: &NodeRecord| principal.can_see(n.owner_tenant_id.as_ref());
        let after = self
            .apply_node_change(
                &principal.actor(),
                id,
                Some(expected_version),
                &visible,
                cause,
                change,
            )
            .await?;
        self.detail_of(vec![after])
            .await?
            .pop()
            .ok_or_else(|| not_found(id))
    }

    /// [`Services::change_node_in`] in a transaction of its own. Controllers call this
    /// directly with their own actor and no version.
    pub async fn apply_node_change<F>(
        &self,
        actor: &Actor,
        id: &NodeId,
        expected_version: Option<i64>,
        visible: &(dyn Fn(&NodeRecord) -> bool + Send + Sync),
        cause: &str,
        change: F,
    ) -> ApiResult<NodeRecord>
    where
        F: FnOnce(
            &mut NodeRecord,
            &Actor,
            DateTime<Utc>,
        ) -> Result<Vec<Change>, bc_core::DomainError>,
    {
        let txn = self.store.write().await?;
        let (after, changes) = self
            .change_node_in(&txn, actor, id, expected_version, visible, cause, change)
            .await?;
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        Ok(after)
    }

    /// The heart of every node change, inside the caller's transaction: lock the row, check
    /// visibility and (if given) the version, apply `change`, and, if anything changed,
    /// write the node with `version + 1` and one event per change. When the identity
    /// generation moved, the node's open session is closed in the same transaction, so
    /// every gateway replica refuses its next heartbeat.
    #[allow(clippy::too_many_arguments)]
    pub async fn change_node_in<F>(
        &self,
        txn: &WriteTxn,
        actor: &Actor,
        id: &NodeId,
        expected_version: Option<i64>,
        visible: &(dyn Fn(&NodeRecord) -> bool + Send + Sync),
        cause: &str,
        change: F,
    ) -> ApiResult<(NodeRecord, Vec<Change>)>
    where
        F: FnOnce(
            &mut NodeRecord,
            &Actor,
            DateTime<Utc>,
        ) -> Result<Vec<Change>, bc_core::DomainError>,
    {
        let before = nodes::load(&**txn, id, true)
            .await?
            .filter(|n| n.deleted_at.is_none() && visible(n))
            .ok_or_else(|| not_found(id))?;
        if let Some(expected) = expected_version {
            before.expect_version(expected)?;
        }
        let now = self.clock.now();
        let mut after = before.clone();
        let changes = change(&mut after, actor, now)?;
        if !changes.is_empty() {
            after.version = before.version + 1;
            after.updated_at = now;
            if !nodes::save(&**txn, &before, &after).await? {
                // Only reachable where the row was not locked; report what is there now.
                let current = nodes::load(self.store.db(), id, false)
                    .await?
                    .map_or(before.version, |n| n.version);
                return Err(ApiError::Conflict {
                    expected: expected_version.unwrap_or(before.version),
                    current,
                });
            }
            events::append_node_changes(&**txn, &after, &changes, actor, Some(cause), now).await?;
            if after.identity_generation != before.identity_generation {
                crate::store::gateway::close_open_session(&**txn, id, now).await?;
            }
        }
        metrics::counter!("bc_node_changes_total", "cause" => cause.to_owned())
            .increment(changes.len() as u64);
        Ok((after, changes))
    }

    /// What follows a committed node change in this process: a replaced identity ends the
    /// node's session here at once (other replicas notice at its next heartbeat).
    pub(crate) fn after_node_commit(&self, after: &NodeRecord, changes: &[Change]) {
        if changes
            .iter()
            .any(|c| c.axis == bc_core::event::Axis::IdentityGeneration)
        {
            self.sessions
                .kick(&after.id, bc_core::protocol::close::IDENTITY_REVOKED);
        }
    }

    pub async fn cordon_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        reason: &str,
    ) -> ApiResult<NodeDetail> {
        self.change_node(
            p,
            Role::Operator,
            id,
            version,
            "cordonNode",
            |n, actor, now| n.cordon(reason, actor, now),
        )
        .await
    }

    pub async fn uncordon_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
    ) -> ApiResult<NodeDetail> {
        self.change_node(p, Role::Operator, id, version, "uncordonNode", |n, _, _| {
            Ok(n.uncordon())
        })
        .await
    }

    pub async fn drain_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        reason: &str,
        deadline: Option<DateTime<Utc>>,
    ) -> ApiResult<NodeDetail> {
        // Microseconds, as PostgreSQL stores them (and as the clock gives them): otherwise
        // the answer shows a deadline the database does not keep, and draining again with
        // the same deadline is a change on PostgreSQL but not on SQLite.
        let deadline = deadline.map(|d| d.trunc_subsecs(6));
        self.change_node(
            p,
            Role::Operator,
            id,
            version,
            "drainNode",
            |n, actor, now| n.drain(reason, deadline, actor, now),
        )
        .await
    }

    pub async fn taint_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        key: &str,
        value: &str,
        effect: TaintEffect,
    ) -> ApiResult<NodeDetail> {
        self.change_node(
            p,
            Role::Operator,
            id,
            version,
            "taintNode",
            |n, actor, now| n.taint(key, value, effect, actor, now),
        )
        .await
    }

    pub async fn untaint_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        key: &str,
    ) -> ApiResult<NodeDetail> {
        self.change_node(p, Role::Operator, id, version, "untaintNode", |n, _, _| {
            n.untaint(key)
        })
        .await
    }

    pub async fn label_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> ApiResult<NodeDetail> {
        self.change_node(p, Role::Operator, id, version, "labelNode", |n, _, _| {
            n.update_labels(set, remove)
        })
        .await
    }

    /// Any move of the provision state table (`adopt`, `retire` and the bare-metal workflow).
    pub async fn move_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        action: ProvisionMove,
        reason: Option<&str>,
    ) -> ApiResult<NodeDetail> {
        let cause = format!("provision:{action}");
        self.change_node(p, Role::Operator, id, version, &cause, |n, _, _| {
            n.apply_move(action, reason)
        })
        .await
    }

    /// `revokeIdentity`: every certificate of the current identity generation stops working.
    pub async fn revoke_node_identity(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        reason: &str,
    ) -> ApiResult<NodeDetail> {
        self.change_node(p, Role::Admin, id, version, "revokeIdentity", |n, _, _| {
            n.revoke_identity(reason)
        })
        .await
    }

    /// `deleteNode`: soft delete; the history stays queryable.
    pub async fn delete_node(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
    ) -> ApiResult<NodeDetail> {
        self.change_node(p, Role::Admin, id, version, "deleteNode", |n, _, now| {
            n.delete(now)
        })
        .await
    }

    /// `metal.enroll`: a bare-metal machine known by its BMC enters as `enrolling`.
    pub async fn enroll_node(
        &self,
        principal: &Principal,
        hostname: &str,
        site_id: &SiteId,
        pool_id: Option<&PoolId>,
    ) -> ApiResult<NodeDetail> {
        principal.require(Role::Admin)?;
        let txn = self.store.write().await?;
        let site = catalog::site(&*txn, site_id)
            .await?
            .filter(|s| principal.can_see(s.owner_tenant_id.as_ref()))
            .ok_or_else(|| ApiError::NotFound(format!("site `{site_id}` does not exist")))?;
        let pool = match pool_id {
            Some(pool_id) => Some(
                catalog::pool(&*txn, pool_id)
                    .await?
                    .filter(|p| p.site_id == site.id)
                    .ok_or_else(|| {
                        ApiError::NotFound(format!(
                            "pool `{pool_id}` does not exist in site `{site_id}`"
                        ))
                    })?,
            ),
            None => None,
        };
        let placement = Placement::of(&site, pool.as_ref());
        let now = self.clock.now();
        let record = NodeRecord::new(
            NewNode {
                hostname: hostname.to_owned(),
                site_id: site.id.clone(),
                pool_id: pool.as_ref().map(|p| p.id.clone()),
                owner_tenant_id: placement.owner_tenant_id,
                role: placement.role,
                trust: placement.trust,
                adapter: pool
                    .as_ref()
                    .map_or(bc_core::axes::Adapter::BcdV1, |p| p.agent.adapter()),
                drivers: pool.as_ref().map(|p| p.drivers.clone()).unwrap_or_default(),
                provision_state: ENROLL_STATE,
            },
            now,
        )?;
        nodes::insert(&*txn, &record).await?;
        let change = Change::new(
            EventType::NodeEnrolled,
            bc_core::event::Axis::Lifecycle,
            None::<String>,
            Some(ENROLL_STATE.as_static_str()),
        );
        events::append_node_changes(
            &*txn,
            &record,
            &[change],
            &principal.actor(),
            Some("enrollNode"),
            now,
        )
        .await?;
        txn.commit().await?;
        self.detail_of(vec![record])
            .await?
            .pop()
            .ok_or_else(|| ApiError::internal(anyhow::anyhow!("enrolled node vanished")))
    }

    /// Capacity of each visible pool, by bucket.
    pub async fn capacity(
        &self,
        principal: &Principal,
        pool_ids: &[PoolId],
    ) -> ApiResult<Vec<CapacityRow>> {
        let visible = catalog::pools(self.store.db(), principal.tenant.as_ref(), None).await?;
        let wanted: Vec<String> = visible
            .into_iter()
            .filter(|p| pool_ids.is_empty() || pool_ids.contains(&p.id))
            .map(|p| p.id.to_string())
            .collect();
        Ok(nodes::capacity(self.store.db(), &wanted).await?)
    }
}
