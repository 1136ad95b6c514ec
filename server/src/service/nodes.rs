//! Node use cases: read, list, and every change an operator makes.

use bc_core::axes::TaintEffect;
use bc_core::catalog::{Placement, Pool};
use bc_core::event::{Change, EventType};
use bc_core::hardware::{MIN_TRUSTED_IDENTIFIERS, hardware_key_of, same_machine};
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::node::NodeRecord;
use bc_core::provision::ENROLL_STATE;
use bc_core::view::NodeDetail;
use chrono::{DateTime, SubsecRound, Utc};
use sea_orm::ConnectionTrait;
use std::collections::BTreeMap;

use super::Services;
use super::catalog::{Page, PoolFilter};
use super::store::{WriteTxn, capacity, catalog, enrolled_identifiers, events, nodes, sessions};
use super::{CapacityRow, ChildSets, NodeFilter};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

/// One page of nodes.
pub struct NodePage {
    pub nodes: Vec<NodeDetail>,
    pub has_next_page: bool,
    /// The child sets the page's records hold; the others are empty ([`ChildSets`]).
    pub child_sets: ChildSets,
}

/// A node that does not exist, or that the principal may not see: the same answer, so ids
/// do not leak existence.
pub(super) fn not_found(id: &NodeId) -> ApiError {
    ApiError::NotFound(format!("node `{id}` does not exist"))
}

impl Services {
    /// `node(id)`: a tenant asking for another tenant's node gets `NOT_FOUND`, exactly as if
    /// it did not exist.
    pub async fn node(&self, principal: &Principal, id: &NodeId) -> ApiResult<NodeDetail> {
        let read = self.store.read().await?;
        let record = nodes::load(&read, id)
            .await?
            .filter(|n| n.deleted_at.is_none());
        let record = record
            .filter(|n| principal.can_see(n.owner_tenant_id.as_ref()))
            .ok_or_else(|| not_found(id))?;
        self.detail_of(&read, vec![record])
            .await?
            .pop()
            .ok_or_else(|| not_found(id))
    }

    /// A node's full record (deleted ones included), for the platform's own use: the gateway,
    /// controllers and tests. People read the API view through [`Services::node`].
    pub async fn node_record(&self, id: &NodeId) -> ApiResult<Option<NodeRecord>> {
        Ok(nodes::load(&self.store.read().await?, id).await?)
    }

    /// `nodes(filter, first, after)`.
    pub async fn nodes(
        &self,
        principal: &Principal,
        mut filter: NodeFilter,
        after: Option<&str>,
        first: u64,
        sets: ChildSets,
    ) -> ApiResult<NodePage> {
        filter.owner = principal.tenant.clone();
        let read = self.store.read().await?;
        let mut records = nodes::list(&read, &filter, after, first + 1, sets).await?;
        let has_next_page = records.len() as u64 > first;
        records.truncate(first as usize);
        Ok(NodePage {
            nodes: self.detail_of(&read, records).await?,
            has_next_page,
            child_sets: sets,
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
        let records = nodes::list(&read, &filter, None, ids.len() as u64, ChildSets::ALL).await?;
        self.detail_of(&read, records).await
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

    /// Builds the API views of several nodes with two batched queries (sessions, pool owners)
    /// on `conn`: the caller's read transaction where it has one, so a request never holds a
    /// pooled connection while it waits for another (enough concurrent reads doing that
    /// exhaust the pool and deadlock it).
    pub(super) async fn detail_of(
        &self,
        conn: &impl ConnectionTrait,
        records: Vec<NodeRecord>,
    ) -> ApiResult<Vec<NodeDetail>> {
        self.views_of(conn, records, true).await
    }

    /// The API views of `records` on `conn`: with each node's session if `with_sessions`
    /// (a past node, rebuilt from the log, has none: heartbeats are not versioned), and the
    /// explanation computed for each record.
    pub(super) async fn views_of(
        &self,
        conn: &impl ConnectionTrait,
        records: Vec<NodeRecord>,
        with_sessions: bool,
    ) -> ApiResult<Vec<NodeDetail>> {
        let mut pool_ids: Vec<String> = records
            .iter()
            .filter_map(|n| n.pool_id.as_ref().map(ToString::to_string))
            .collect();
        pool_ids.sort();
        pool_ids.dedup();
        let mut sessions = if with_sessions {
            let ids: Vec<String> = records.iter().map(|n| n.id.to_string()).collect();
            sessions::of_nodes(conn, &ids).await?
        } else {
            Default::default()
        };
        let owners = catalog::pool_owners(conn, &pool_ids).await?;
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

    /// `clearNodeCondition`: an operator clears a `true` condition by hand with a reason of
    /// their own, kept on the condition and in its event with the operator as the actor.
    pub async fn clear_node_condition(
        &self,
        p: &Principal,
        id: &NodeId,
        version: i64,
        condition: &str,
        reason: &str,
    ) -> ApiResult<NodeDetail> {
        self.change_node(
            p,
            Role::Operator,
            id,
            version,
            "clearNodeCondition",
            |n, actor, now| n.clear_condition_by_hand(condition, reason, actor, now),
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
    ///
    /// `identifiers` are the machine's as its BMC reports them (`(name, value)`, names as a
    /// daemon's join names them: `system-uuid`, `mac`, …). They give the node its hardware key
    /// and are kept, so that the daemon which later boots on the machine is recognised as
    /// this node ([`bc_core::hardware::same_machine`]) instead of joining as a second one. At
    /// least two independent kinds must survive normalisation; a machine already known (by
    /// its key, or enrolled with matching identifiers) is refused, naming its node. Without
    /// identifiers the node has no key, and a daemon on the machine joins as a new node.
    pub async fn enroll_node(
        &self,
        principal: &Principal,
        hostname: &str,
        site_id: &SiteId,
        pool_id: Option<&PoolId>,
        identifiers: &[(String, String)],
    ) -> ApiResult<NodeDetail> {
        let txn = self.store.write().await?;
        let record = self
            .enroll_in(
                &txn,
                principal,
                hostname,
                site_id,
                pool_id,
                identifiers,
                "enrollNode",
            )
            .await?;
        txn.commit().await?;
        self.detail_of(self.store.db(), vec![record])
            .await?
            .pop()
            .ok_or_else(|| ApiError::internal(anyhow::anyhow!("enrolled node vanished")))
    }

    /// The enrolment itself, in the caller's transaction: an admin's, with the identifiers
    /// checked against every known machine, the node written `enrolling` with its hardware
    /// key and identifiers, and its `node.enrolled` event (caused by `cause`). Shared by
    /// `enrollNode` and `enrollBareMetalNode`, so a machine enrolled either way is the same
    /// machine to JoinService.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn enroll_in(
        &self,
        txn: &WriteTxn,
        principal: &Principal,
        hostname: &str,
        site_id: &SiteId,
        pool_id: Option<&PoolId>,
        identifiers: &[(String, String)],
        cause: &str,
    ) -> ApiResult<NodeRecord> {
        principal.require(Role::Admin)?;
        for (name, _) in identifiers {
            bc_core::hardware::validate_identifier_name(name)?;
        }
        let hw = hardware_key_of(identifiers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        if !identifiers.is_empty() && !hw.trusted {
            return Err(ApiError::BadUserInput(format!(
                "a machine is enrolled with at least {MIN_TRUSTED_IDENTIFIERS} independent identifiers (say its system UUID and a MAC) that are not placeholders; these leave {}",
                match hw
                    .identifiers
                    .keys()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .as_slice()
                {
                    [] => "none".to_owned(),
                    kinds => kinds.join(", "),
                }
            )));
        }
        if let Some(key) = hw.key.as_deref().filter(|_| hw.trusted) {
            // The machine's key, locked as a join of the machine locks it (lock order, step
            // 1), so that the machine's daemon joining with the same identifiers waits for this
            // enrolment and then takes its node back, or this enrolment waits for the join and
            // then finds the node. Without it both found no node holding the key, both
            // inserted one, and the later insert failed on the unique index of trusted keys
            // (an `INTERNAL`). A daemon reporting more identifiers than these (a BMC knows a
            // subset) joins with another key: it waits for the enrolment lock instead, and
            // then finds this node by its identifiers.
            nodes::lock_hardware_keys(&**txn, &[key]).await?;
            nodes::lock_against_enrolments(&**txn, nodes::EnrolmentSide::Enrolling).await?;
            if let Some(known) = nodes::by_trusted_hardware_key(&**txn, key).await? {
                return Err(ApiError::BadUserInput(format!(
                    "this machine is node `{known}` already (the same hardware key)"
                )));
            }
            for (known, enrolled) in
                enrolled_identifiers::sharing_any(&**txn, &hw.identifiers).await?
            {
                if same_machine(&enrolled, &hw.identifiers) {
                    return Err(ApiError::BadUserInput(format!(
                        "this machine is enrolled as node `{known}` already (matching identifiers)"
                    )));
                }
            }
        }
        let site = catalog::site(&**txn, site_id)
            .await?
            .filter(|s| principal.can_see(s.owner_tenant_id.as_ref()))
            .ok_or_else(|| ApiError::NotFound(format!("site `{site_id}` does not exist")))?;
        let pool = match pool_id {
            Some(pool_id) => Some(
                catalog::pool(&**txn, pool_id)
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
        let now = self.clock.now();
        let mut record = NodeRecord::new(
            Placement::new_node(hostname, &site, pool.as_ref(), ENROLL_STATE),
            now,
        )?;
        record.hardware_key = hw.key;
        record.hardware_key_trusted = hw.trusted;
        nodes::insert(&**txn, &record).await?;
        enrolled_identifiers::insert(&**txn, &record.id, &hw.identifiers).await?;
        let change = Change::new(
            EventType::NodeEnrolled,
            bc_core::event::Axis::Lifecycle,
            None::<String>,
            Some(ENROLL_STATE.as_static_str()),
        );
        events::append_node_changes(
            txn,
            None,
            &record,
            &[change],
            &principal.actor(),
            Some(cause),
            now,
        )?;
        Ok(record)
    }

    /// Capacity of each visible pool, by bucket.
    /// `capacity(poolIds, first, after)`: a page of pools, as `pools` pages them, each with
    /// its nodes and GPUs by bucket, counted in one grouped query for the page.
    pub async fn pool_capacity(
        &self,
        principal: &Principal,
        filter: &PoolFilter,
        after: Option<&PoolId>,
        first: u64,
    ) -> ApiResult<Page<(Pool, Vec<CapacityRow>)>> {
        let page = self.pools(principal, filter, after, first).await?;
        let ids: Vec<String> = page.items.iter().map(|p| p.id.to_string()).collect();
        let mut rows = capacity::by_pool(self.store.db(), &ids).await?;
        Ok(page.map(|pool| {
            let id = pool.id.as_str();
            let (of_pool, rest) = rows.drain(..).partition(|r| r.pool_id == id);
            rows = rest;
            (pool, of_pool)
        }))
    }
}
