//! How every node changes: [`Services::change_node_in`] locks the row, checks visibility and
//! `version`, applies one domain transition and writes the row, its child rows and one event
//! per change in the caller's transaction. Operators' mutations, controllers, the gateway and
//! JoinService all come through here, so these rules hold for every writer.

use bc_core::Actor;
use bc_core::event::Change;
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::view::NodeDetail;
use chrono::{DateTime, Utc};

use super::Services;
use super::nodes::not_found;
use super::store::{WriteTxn, events, nodes, sessions};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

/// A domain transition: changes the record in memory at `now` on behalf of the actor, and
/// returns what it changed (nothing: no new version, no event) or why it may not.
pub trait NodeTransition:
    FnOnce(&mut NodeRecord, &Actor, DateTime<Utc>) -> Result<Vec<Change>, bc_core::DomainError>
{
}

impl<F> NodeTransition for F where
    F: FnOnce(&mut NodeRecord, &Actor, DateTime<Utc>) -> Result<Vec<Change>, bc_core::DomainError>
{
}

/// One node change of a batch ([`Services::apply_node_changes`]): the node, the `version`
/// the caller read, why (the events' cause), and the transition.
pub struct NodeChangeRequest<F> {
    pub id: NodeId,
    pub expected_version: i64,
    pub cause: String,
    pub change: F,
}

impl Services {
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
        F: NodeTransition,
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
        self.detail_of(self.store.db(), vec![after])
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
        F: NodeTransition,
    {
        let txn = self.store.write().await?;
        let (after, changes) = self
            .change_node_in(&txn, actor, id, expected_version, visible, cause, change)
            .await?;
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        Ok(after)
    }

    /// Many controller changes in one transaction, one commit for all: while a fleet comes
    /// up, a controller has a thousand nodes to move, and a transaction each kept SQLite's
    /// one writer (which sessions and operators wait on) busy with commits.
    ///
    /// Each item is [`Services::change_node_in`] with the `version` its caller read. Every
    /// node of the batch is locked first, in id order, before anything is written (the lock
    /// order of ARCHITECTURE.md's Invariants: node rows before any other row). It is meant
    /// for transitions that write node rows only (acceptance, first specs); one that also
    /// locks other rows (a replaced identity's session, an eviction's reservations) locks
    /// them node by node, after every node lock. An item refused before it wrote anything
    /// (`CONFLICT`, `NOT_FOUND`, a domain rule) is answered with its error and the rest go
    /// on; an error after an item wrote (a database error, mostly) rolls the whole batch back
    /// and is the answer, since committing half of one node's change is never right.
    pub async fn apply_node_changes<F>(
        &self,
        actor: &Actor,
        mut items: Vec<NodeChangeRequest<F>>,
    ) -> ApiResult<Vec<(NodeId, ApiResult<NodeRecord>)>>
    where
        F: NodeTransition,
    {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        items.sort_by(|a, b| a.id.cmp(&b.id));
        let everyone = |_: &NodeRecord| true;
        let txn = self.store.write().await?;
        let ids: Vec<NodeId> = items.iter().map(|item| item.id.clone()).collect();
        nodes::lock_many(&*txn, &ids).await?;
        let mut outcomes = Vec::with_capacity(items.len());
        let mut committed = Vec::new();
        for item in items {
            let written_before = txn.pending_events();
            match self
                .change_node_in(
                    &txn,
                    actor,
                    &item.id,
                    Some(item.expected_version),
                    &everyone,
                    &item.cause,
                    item.change,
                )
                .await
            {
                Ok((after, changes)) => {
                    outcomes.push((item.id, Ok(after.clone())));
                    committed.push((after, changes));
                }
                Err(err @ ApiError::Internal(_)) => return Err(err),
                Err(err) if txn.pending_events() != written_before => return Err(err),
                Err(err) => outcomes.push((item.id, Err(err))),
            }
        }
        txn.commit().await?;
        for (after, changes) in &committed {
            self.after_node_commit(after, changes);
        }
        Ok(outcomes)
    }

    /// The heart of every node change, inside the caller's transaction: lock the row, check
    /// visibility and (if given) the version, apply `change`, and, if anything changed,
    /// write the node with `version + 1` and one event per change. When the identity
    /// generation moved, the node's open session is closed in the same transaction, so
    /// every gateway replica refuses its next heartbeat.
    ///
    /// The node row is locked here; a caller that locks another row of the node first (its
    /// session, say) must lock the node before it ([`nodes::lock`]), to keep the lock order
    /// of ARCHITECTURE.md's Invariants.
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
        F: NodeTransition,
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
                let current = nodes::load(&**txn, id, false)
                    .await?
                    .map_or(before.version, |n| n.version);
                return Err(ApiError::Conflict {
                    expected: expected_version.unwrap_or(before.version),
                    current,
                });
            }
            // Lock order (ARCHITECTURE.md, Invariants): the node row, then its session row;
            // the events are written at commit, after both.
            if after.identity_generation != before.identity_generation {
                sessions::close_open(&**txn, id, now).await?;
            }
            events::append_node_changes(
                txn,
                Some(&before),
                &after,
                &changes,
                actor,
                Some(cause),
                now,
            )?;
            self.evict_after_change_in(txn, &after, &changes, actor)
                .await?;
        }
        metrics::counter!("bc_node_changes_total", "cause" => cause.to_owned())
            .increment(changes.len() as u64);
        Ok((after, changes))
    }

    /// Placement's part of a node change, in the same transaction: a node that became `lost`
    /// loses all its work, and a `NoExecute` taint evicts the work that does not tolerate it.
    /// Both hold for every writer because every node change comes through here.
    async fn evict_after_change_in(
        &self,
        txn: &WriteTxn,
        after: &NodeRecord,
        changes: &[Change],
        actor: &Actor,
    ) -> ApiResult<()> {
        let became_lost = after.connectivity == bc_core::axes::Connectivity::Lost
            && changes
                .iter()
                .any(|c| c.axis == bc_core::event::Axis::Connectivity);
        let tainted = changes
            .iter()
            .any(|c| c.event_type == bc_core::event::EventType::NodeTainted);
        if became_lost {
            self.evict_from_node_in(
                txn,
                after,
                true,
                &format!("node {} is lost", after.id),
                actor,
            )
            .await?;
        } else if tainted {
            self.evict_from_node_in(txn, after, false, "", actor)
                .await?;
        }
        Ok(())
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
}
