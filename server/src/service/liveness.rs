//! What the Liveness controller reads and records: one indexed query per kind of candidate
//! (see `store/liveness.rs` for which nodes are watched), the site numbers behind the fleet
//! brake, and the brake's own events. The controller decides; this only reads and writes.

use bc_core::Actor;
use bc_core::event::EventType;
use bc_core::ids::SiteId;
use chrono::{DateTime, Utc};
use std::collections::HashMap;

use super::Services;
use super::store::{catalog, events, liveness};
use crate::error::ApiResult;

pub use super::store::liveness::{Candidate, SiteLiveness};

impl Services {
    /// `connected` and `disconnected` nodes with no heartbeat since `cutoff`.
    pub async fn silent_nodes(&self, cutoff: DateTime<Utc>) -> ApiResult<Vec<Candidate>> {
        Ok(liveness::silent(self.store.db(), cutoff).await?)
    }

    /// `unreachable` and `lost` nodes whose open session heartbeated at or after `cutoff`.
    pub async fn nodes_heard_again(&self, cutoff: DateTime<Utc>) -> ApiResult<Vec<Candidate>> {
        Ok(liveness::heard_again(self.store.db(), cutoff).await?)
    }

    /// `unreachable` nodes that have been so since before `cutoff`.
    pub async fn nodes_unreachable_since_before(
        &self,
        cutoff: DateTime<Utc>,
    ) -> ApiResult<Vec<Candidate>> {
        Ok(liveness::unreachable_since_before(self.store.db(), cutoff).await?)
    }

    /// For each of `sites`, the watched nodes and how many became `unreachable` at or after
    /// `window_start`.
    pub async fn site_liveness(
        &self,
        sites: &[SiteId],
        window_start: DateTime<Utc>,
    ) -> ApiResult<HashMap<SiteId, SiteLiveness>> {
        Ok(liveness::site_liveness(self.store.db(), sites, window_start).await?)
    }

    /// Records a fleet-brake event of `site` (paused or resumed), visible to the site's
    /// tenant.
    pub async fn record_site_liveness_event(
        &self,
        site: &SiteId,
        event_type: EventType,
        actor: &Actor,
        data: serde_json::Value,
        now: DateTime<Utc>,
    ) -> ApiResult<()> {
        let txn = self.store.write().await?;
        let owner = catalog::site(&*txn, site)
            .await?
            .and_then(|s| s.owner_tenant_id);
        events::append_other(
            &txn,
            event_type,
            owner.as_ref().map(|t| t.as_str()),
            actor,
            data,
            now,
        );
        txn.commit().await?;
        Ok(())
    }
}
