//! What the NodeLifecycle, NodeSpec and drain-deadline controllers read: bounded, indexed
//! work lists, so a settled fleet costs one cheap query per controller per pass.

use bc_core::Actor;
use bc_core::acceptance::AcceptancePolicy;
use bc_core::axes::ProvisionState;
use bc_core::catalog::{HardwareProfile, Pool};
use bc_core::command::{Command, CommandKind, CommandStatus};
use bc_core::event::EventType;
use bc_core::ids::{CommandId, NodeId, PoolId};
use bc_core::node::NodeRecord;

use super::Services;
use super::store::drains;
use super::store::events::SeqKey;
use super::store::{catalog, commands, events, nodes};
use crate::error::ApiResult;
use std::collections::{BTreeMap, HashMap, HashSet};

pub use super::store::drains::ExpiredDrain;

/// A node acceptance looks at, with what its pool asks.
#[derive(Debug, Clone)]
pub struct AcceptanceCandidate {
    pub node: NodeRecord,
    pub policy: AcceptancePolicy,
    pub profile: HardwareProfile,
}

impl Services {
    /// `adopting`, connected nodes that reported their `gpus` section (with no GPUs, too)
    /// and are not waiting on an acceptance diagnostic from `acceptor`: the ones acceptance
    /// can act on now, at most `limit`, each with its pool's acceptance policy and hardware
    /// profile (the defaults for a node in no pool).
    ///
    /// *Decision:* a node whose diagnostic runs is not looked at until it ends. The pass used
    /// to load every candidate on every tick to find that it still waits; the only earlier
    /// verdict that skips is a hardware mismatch that appears while the diagnostic runs,
    /// which now fails the node when the diagnostic ends rather than at once.
    pub async fn acceptance_candidates(
        &self,
        acceptor: &Actor,
        limit: u64,
    ) -> ApiResult<Vec<AcceptanceCandidate>> {
        let read = self.store.read().await?;
        let candidates = nodes::acceptance_candidates(&read, acceptor, limit).await?;
        let mut pools: BTreeMap<PoolId, Option<Pool>> = BTreeMap::new();
        let mut out = Vec::new();
        for node in candidates {
            let pool = match &node.pool_id {
                Some(id) => match pools.get(id) {
                    Some(pool) => pool.clone(),
                    None => {
                        let pool = catalog::pool(&read, id).await?;
                        pools.insert(id.clone(), pool.clone());
                        pool
                    }
                },
                None => None,
            };
            let (policy, profile) = pool
                .map(|p| (p.acceptance, p.hardware_profile))
                .unwrap_or_default();
            out.push(AcceptanceCandidate {
                node,
                policy,
                profile,
            });
        }
        Ok(out)
    }

    /// The newest `kind` command `actor` created for each of `nodes`, in one query.
    pub async fn newest_commands_by(
        &self,
        nodes: &[NodeId],
        kind: CommandKind,
        actor: &Actor,
    ) -> ApiResult<HashMap<NodeId, Command>> {
        Ok(commands::newest_by(self.store.db(), nodes, kind, actor).await?)
    }

    /// Of `checks` (each a finished command sent to its node), those queued before their
    /// node's last provision move: they judged the node in a previous life (a failed
    /// acceptance before a `recover`) and prove nothing now. Compared by the event log's
    /// order, which is commit order, so it does not depend on the clock's resolution. Two
    /// grouped queries for the whole list: a fleet coming up finishes thousands of checks,
    /// and two queries for each kept the database answering the same question per node.
    pub async fn checks_queued_before_last_provision_move(
        &self,
        checks: &[(NodeId, CommandId)],
    ) -> ApiResult<HashSet<CommandId>> {
        if checks.is_empty() {
            return Ok(HashSet::new());
        }
        let read = self.store.read().await?;
        let node_ids: Vec<&str> = checks.iter().map(|(node, _)| node.as_str()).collect();
        let check_ids: Vec<&str> = checks.iter().map(|(_, check)| check.as_str()).collect();
        let moved = events::newest_seqs_of_type(
            &read,
            &node_ids,
            EventType::NodeProvisionStateChanged,
            None,
            SeqKey::Node,
        )
        .await?;
        let queued = events::newest_seqs_of_type(
            &read,
            &node_ids,
            EventType::command(CommandStatus::Queued),
            Some(&check_ids),
            SeqKey::Cause,
        )
        .await?;
        Ok(checks
            .iter()
            .filter(|(node, check)| {
                matches!(
                    (moved.get(node.as_str()), queued.get(check.as_str())),
                    (Some(moved), Some(queued)) if queued < moved
                )
            })
            .map(|(_, check)| check.clone())
            .collect())
    }

    /// Live nodes in `states` still at spec generation 0 (id and version), at most `limit`.
    pub async fn nodes_awaiting_first_spec(
        &self,
        states: &[ProvisionState],
        limit: u64,
    ) -> ApiResult<Vec<(NodeId, i64)>> {
        Ok(nodes::awaiting_first_spec(self.store.db(), states, limit).await?)
    }

    /// Live nodes draining with a deadline at or before now.
    pub async fn drains_past_deadline(&self) -> ApiResult<Vec<ExpiredDrain>> {
        Ok(drains::past_deadline(self.store.db(), self.clock.now()).await?)
    }
}
