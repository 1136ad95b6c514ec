//! What the NodeLifecycle, NodeSpec and drain-deadline controllers read: bounded, indexed
//! work lists, so a settled fleet costs one cheap query per controller per tick.

use bc_core::acceptance::AcceptancePolicy;
use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::catalog::{HardwareProfile, Pool};
use bc_core::command::CommandStatus;
use bc_core::event::EventType;
use bc_core::ids::{CommandId, NodeId, PoolId};
use bc_core::node::NodeRecord;

use super::Services;
use super::store::drains;
use super::store::node_filter::NodeFilter;
use super::store::{catalog, events, inventory, nodes};
use crate::error::ApiResult;
use std::collections::BTreeMap;

pub use super::store::drains::ExpiredDrain;

/// A node acceptance looks at, with what its pool asks.
#[derive(Debug, Clone)]
pub struct AcceptanceCandidate {
    pub node: NodeRecord,
    pub policy: AcceptancePolicy,
    pub profile: HardwareProfile,
}

impl Services {
    /// `adopting`, connected nodes that reported their `gpus` section (with no GPUs, too):
    /// the ones acceptance looks at, at most `limit`, each with its pool's acceptance policy
    /// and hardware profile (the defaults for a node in no pool).
    pub async fn acceptance_candidates(&self, limit: u64) -> ApiResult<Vec<AcceptanceCandidate>> {
        let filter = NodeFilter {
            provision_states: vec![ProvisionState::Adopting],
            connectivity: vec![Connectivity::Connected],
            ..NodeFilter::default()
        };
        let read = self.store.read().await?;
        let candidates = nodes::list(&read, &filter, None, limit).await?;
        let ids: Vec<NodeId> = candidates.iter().map(|n| n.id.clone()).collect();
        let reported = inventory::nodes_with_section(&read, &ids, "gpus").await?;
        let mut pools: BTreeMap<PoolId, Option<Pool>> = BTreeMap::new();
        let mut out = Vec::new();
        for node in candidates.into_iter().filter(|n| reported.contains(&n.id)) {
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
