//! What the NodeLifecycle, NodeSpec and drain-deadline controllers read: bounded, indexed
//! work lists, so a settled fleet costs one cheap query per controller per tick.

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
use super::store::{catalog, commands, events, nodes};
use crate::error::ApiResult;
use std::collections::{BTreeMap, HashMap};

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

    /// Whether `check`, a command sent to the node, was queued before the node's last
    /// provision move: it then judged the node in a previous life (a failed acceptance before
    /// a `recover`) and proves nothing now. Compared by the event log's order, which is
    /// commit order, so it does not depend on the clock's resolution.
    pub async fn queued_before_last_provision_move(
        &self,
        node: &NodeId,
        check: &CommandId,
    ) -> ApiResult<bool> {
        let db = self.store.db();
        let moved = events::latest_of_type(
            db,
            node.as_str(),
            EventType::NodeProvisionStateChanged,
            None,
        )
        .await?;
        let queued = events::latest_of_type(
            db,
            node.as_str(),
            EventType::command(CommandStatus::Queued),
            Some(check.as_str()),
        )
        .await?;
        Ok(matches!((moved, queued), (Some(moved), Some(queued)) if queued.id < moved.id))
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
