//! What the NodeLifecycle, NodeSpec and drain-deadline controllers read: bounded, indexed
//! work lists, so a settled fleet costs one cheap query per controller per tick.

use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;

use super::Services;
use super::store::drains;
use super::store::node_filter::NodeFilter;
use super::store::nodes;
use crate::error::ApiResult;

pub use super::store::drains::ExpiredDrain;

impl Services {
    /// `adopting`, connected nodes that reported at least one GPU: the ones acceptance
    /// looks at, at most `limit`.
    pub async fn acceptance_candidates(&self, limit: u64) -> ApiResult<Vec<NodeRecord>> {
        let filter = NodeFilter {
            provision_states: vec![ProvisionState::Adopting],
            connectivity: vec![Connectivity::Connected],
            ..NodeFilter::default()
        };
        let read = self.store.read().await?;
        let candidates = nodes::list(&read, &filter, None, limit).await?;
        Ok(candidates.into_iter().filter(|n| n.gpu_count > 0).collect())
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
