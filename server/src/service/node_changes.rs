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
use std::collections::HashMap;

use super::Services;
use super::nodes::not_found;
use super::store::{WriteTxn, events, nodes, sessions};
use crate::auth::{Principal, Role};
use crate::error::ApiResult;

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

/// One node change of a batch ([`Services::change_nodes_in`]): the node, who asks (the
/// events' actor), the `version` the caller read (if it read one), why (the events' cause),
/// and the transition.
pub struct NodeChangeRequest<F> {
    pub id: NodeId,
    pub actor: Actor,
    pub expected_version: Option<i64>,
    pub cause: String,
    pub change: F,
}

/// What became of one request of a batch: the node as written and what changed, or why the
/// request was refused (nothing of it was written).
pub type NodeChangeOutcome = (NodeId, ApiResult<(NodeRecord, Vec<Change>)>);

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

    /// [`Services::change_node_in`] in a transaction of its own, for a writer with one node to
    /// change (controllers write theirs in batches, [`Services::apply_node_changes`]).
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

    /// Many node changes in one transaction, one commit for all: while a fleet comes
    /// up, a controller has a thousand nodes to move, and a transaction each kept SQLite's
    /// one writer (which sessions and operators wait on) busy with commits. Every request is
    /// answered ([`Services::change_nodes_in`]); an error of the whole batch (a database
    /// error, mostly) rolls it back and is the answer.
    pub async fn apply_node_changes<F>(
        &self,
        items: Vec<NodeChangeRequest<F>>,
    ) -> ApiResult<Vec<NodeChangeOutcome>>
    where
        F: NodeTransition,
    {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let everyone = |_: &NodeRecord| true;
        let txn = self.store.write().await?;
        let outcomes = self.change_nodes_in(&txn, &everyone, items).await?;
        txn.commit().await?;
        self.after_node_commits(&outcomes);
        Ok(outcomes)
    }

    /// The heart of every node change, inside the caller's transaction: lock the row, check
    /// visibility and (if given) the version, apply `change`, and, if anything changed,
    /// write the node with `version + 1` and one event per change. When the identity
    /// generation moved, the node's open session is closed in the same transaction, so
    /// every gateway replica refuses its next heartbeat.
    ///
    /// The node row is locked here; a caller that locks another row of the node first (its
    /// session, say) must lock the node before it ([`WriteTxn::lock_nodes`], which this
    /// lock then skips), to keep the lock order of ARCHITECTURE.md's Invariants.
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
        let request = NodeChangeRequest {
            id: id.clone(),
            actor: actor.clone(),
            expected_version,
            cause: cause.to_owned(),
            change,
        };
        let mut outcomes = self.change_nodes_in(txn, visible, vec![request]).await?;
        outcomes
            .pop()
            .map_or_else(|| Err(not_found(id)), |(_, outcome)| outcome)
    }

    /// [`Services::change_node_in`] for many nodes, at a cost in statements that grows with
    /// the batch by runs of rows, not by nodes: the nodes are loaded (locked, in id order)
    /// together, each request is decided in memory, and the changed nodes are written
    /// together ([`nodes::save_many`]: 32 node rows a statement, and each child table's rows
    /// and the events in runs of their own). On SQLite each statement is a round trip to the
    /// database's thread while every other writer waits, so a batch of a hundred nodes costs a
    /// few statements more than one did, not a hundred times as many.
    ///
    /// A request refused before anything of it was written (`NOT_FOUND`, `CONFLICT`, a
    /// domain rule) is answered with its error and the rest go on; an error after writing
    /// began is the whole call's, and the caller rolls back. Two requests for one node are
    /// applied one after the other, as if in two calls: the second sees the first's node.
    pub async fn change_nodes_in<F>(
        &self,
        txn: &WriteTxn,
        visible: &(dyn Fn(&NodeRecord) -> bool + Send + Sync),
        items: Vec<NodeChangeRequest<F>>,
    ) -> ApiResult<Vec<NodeChangeOutcome>>
    where
        F: NodeTransition,
    {
        let mut outcomes: Vec<Option<NodeChangeOutcome>> =
            std::iter::repeat_with(|| None).take(items.len()).collect();
        // Rounds of distinct nodes: a node's second request waits for the round after its
        // first, so it is decided on the node the first one wrote.
        let mut rounds: Vec<Vec<(usize, NodeChangeRequest<F>)>> = Vec::new();
        let mut requests_of: HashMap<NodeId, usize> = HashMap::new();
        for (index, item) in items.into_iter().enumerate() {
            let seen = requests_of.entry(item.id.clone()).or_insert(0);
            if rounds.len() <= *seen {
                rounds.push(Vec::new());
            }
            rounds[*seen].push((index, item));
            *seen += 1;
        }
        for round in rounds {
            for (index, outcome) in self.change_distinct_nodes_in(txn, visible, round).await? {
                outcomes[index] = Some(outcome);
            }
        }
        Ok(outcomes.into_iter().flatten().collect())
    }

    /// One round of [`Services::change_nodes_in`], in which no node comes twice: each
    /// request's index with its outcome.
    async fn change_distinct_nodes_in<F>(
        &self,
        txn: &WriteTxn,
        visible: &(dyn Fn(&NodeRecord) -> bool + Send + Sync),
        items: Vec<(usize, NodeChangeRequest<F>)>,
    ) -> ApiResult<Vec<(usize, NodeChangeOutcome)>>
    where
        F: NodeTransition,
    {
        let ids: Vec<NodeId> = items.iter().map(|(_, item)| item.id.clone()).collect();
        // Locked through the transaction, which skips the nodes that the caller, or an
        // earlier round, locked already.
        txn.lock_nodes(&ids).await?;
        let mut loaded = nodes::load_many(&**txn, &ids).await?;
        let now = self.clock.now();
        let decided: Vec<Decided> = items
            .into_iter()
            .map(|(index, item)| {
                let NodeChangeRequest {
                    id,
                    actor,
                    expected_version,
                    cause,
                    change,
                } = item;
                let outcome = decide(
                    &mut loaded,
                    &id,
                    expected_version,
                    visible,
                    change,
                    &actor,
                    now,
                );
                Decided {
                    index,
                    id,
                    actor,
                    cause,
                    outcome,
                }
            })
            .collect();
        let writes: Vec<(&NodeRecord, &NodeRecord)> = decided
            .iter()
            .filter_map(|decided| match &decided.outcome {
                Ok((before, after, changes)) if !changes.is_empty() => Some((before, after)),
                _ => None,
            })
            .collect();
        nodes::save_many(&**txn, &writes).await?;
        let mut outcomes = Vec::with_capacity(decided.len());
        for decided in decided {
            let outcome = match decided.outcome {
                Ok((before, after, changes)) => {
                    if !changes.is_empty() {
                        let (actor, cause) = (&decided.actor, &decided.cause);
                        self.after_node_write_in(txn, &before, &after, &changes, actor, cause, now)
                            .await?;
                    }
                    metrics::counter!("bc_node_changes_total", "cause" => decided.cause)
                        .increment(changes.len() as u64);
                    Ok((after, changes))
                }
                Err(err) => Err(err),
            };
            outcomes.push((decided.index, (decided.id, outcome)));
        }
        Ok(outcomes)
    }

    /// What goes with a node's write in its transaction, in this order: a replaced identity
    /// closes the node's open session (the lock order of ARCHITECTURE.md's Invariants: the
    /// node row, then its session row; the events are written at commit, after both), the
    /// events of its changes, and placement's evictions.
    #[allow(clippy::too_many_arguments)]
    async fn after_node_write_in(
        &self,
        txn: &WriteTxn,
        before: &NodeRecord,
        after: &NodeRecord,
        changes: &[Change],
        actor: &Actor,
        cause: &str,
        now: DateTime<Utc>,
    ) -> ApiResult<()> {
        if after.identity_generation != before.identity_generation {
            sessions::close_open(&**txn, &after.id, now).await?;
        }
        events::append_node_changes(txn, Some(before), after, changes, actor, Some(cause), now)?;
        self.evict_after_change_in(txn, after, changes, actor).await
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

    /// [`Services::after_node_commit`] for each change of a batch that was written.
    pub(crate) fn after_node_commits(&self, outcomes: &[NodeChangeOutcome]) {
        for (after, changes) in outcomes
            .iter()
            .filter_map(|(_, outcome)| outcome.as_ref().ok())
        {
            self.after_node_commit(after, changes);
        }
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

/// A request of a round once decided: its place in the batch, its node, actor and cause, and
/// `(before, after, changes)` or why it is refused.
struct Decided {
    index: usize,
    id: NodeId,
    actor: Actor,
    cause: String,
    outcome: ApiResult<(NodeRecord, NodeRecord, Vec<Change>)>,
}

/// One request of a round, decided in memory against the nodes the round loaded: `(before,
/// after, changes)`, or why it is refused. The round writes every `after` that changed.
fn decide<F: NodeTransition>(
    loaded: &mut HashMap<NodeId, NodeRecord>,
    id: &NodeId,
    expected_version: Option<i64>,
    visible: &(dyn Fn(&NodeRecord) -> bool + Send + Sync),
    change: F,
    actor: &Actor,
    now: DateTime<Utc>,
) -> ApiResult<(NodeRecord, NodeRecord, Vec<Change>)> {
    let before = loaded
        .remove(id)
        .filter(|n| n.deleted_at.is_none() && visible(n))
        .ok_or_else(|| not_found(id))?;
    if let Some(expected) = expected_version {
        before.expect_version(expected)?;
    }
    let mut after = before.clone();
    let changes = change(&mut after, actor, now)?;
    if !changes.is_empty() {
        after.version = before.version + 1;
        after.updated_at = now;
    }
    Ok((before, after, changes))
}
