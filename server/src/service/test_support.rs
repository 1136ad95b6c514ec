//! Fixtures and checks for tests, behind the `test-support` feature: writes that bypass the
//! use cases (a node in any state, without the events a real change would write) and reads
//! of storage internals that only a test compares against the domain.

use bc_core::event::EventType;
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::schedule::CapacityBucket;
use std::collections::HashMap;

use super::Services;
use super::store::{capacity, events, inventory, nodes};
use crate::error::ApiResult;

/// The key of PostgreSQL's transaction-scoped advisory lock that orders event writers, so
/// a test can hold it and interleave writers step by step (the lock-order test).
pub use super::store::events::EVENT_ORDER_LOCK;

impl Services {
    /// Writes these nodes straight into storage, in one transaction: the fixture for tests
    /// that need states the API cannot reach quickly (or at all).
    pub async fn insert_nodes_for_tests(&self, records: &[NodeRecord]) -> ApiResult<()> {
        let txn = self.store.write().await?;
        for record in records {
            nodes::insert(&*txn, record).await?;
        }
        txn.commit().await?;
        Ok(())
    }

    /// Gives each node these devices, as an inventory report would (the placer's count of
    /// free atoms included), in one transaction, without the report or its events.
    pub async fn replace_devices_for_tests(
        &self,
        devices: &[(NodeId, Vec<bc_core::health::Device>)],
    ) -> ApiResult<()> {
        let txn = self.store.write().await?;
        let now = self.clock.now();
        inventory::replace_devices(&*txn, devices, now).await?;
        txn.commit().await?;
        Ok(())
    }

    /// Every node's capacity bucket and schedulability as the SQL predicate
    /// (`schedulableSql`) computes them, for the property test that compares it with Rust.
    pub async fn sql_buckets_for_tests(
        &self,
    ) -> ApiResult<HashMap<NodeId, (CapacityBucket, bool)>> {
        let by_id = capacity::sql_buckets(self.store.db()).await?;
        by_id
            .into_iter()
            .map(|(id, answer)| {
                let id = NodeId::parse(&id)
                    .map_err(|_| anyhow::anyhow!("corrupt row: nodes.id = `{id}`"))?;
                Ok((id, answer))
            })
            .collect()
    }

    /// Appends events that are not about a node, all in one transaction, as the system: the
    /// filler with which feed tests make a subscriber fall behind.
    pub async fn append_events_for_tests(
        &self,
        batch: &[(EventType, serde_json::Value)],
    ) -> ApiResult<()> {
        let txn = self.store.write().await?;
        let now = self.clock.now();
        for (event_type, data) in batch {
            events::append_other(
                &txn,
                *event_type,
                None,
                &bc_core::Actor::System,
                data.clone(),
                now,
            );
        }
        txn.commit().await?;
        Ok(())
    }
}
