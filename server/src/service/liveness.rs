//! What the Liveness controller reads and records: one indexed query per kind of candidate
//! (see `store/liveness.rs` for which nodes are watched), the site numbers behind the fleet
//! brake, and the brake's episodes (`bc_core::brake`) with their events; and an admin's
//! release of a brake. The controller decides; this only reads and writes.

use bc_core::Actor;
use bc_core::brake::{BrakeStatus, LivenessBrake};
use bc_core::event::EventType;
use bc_core::ids::{SiteId, TenantId};
use bc_core::node::NodeRecord;
use chrono::{DateTime, Utc};
use std::collections::HashMap;

use super::Services;
use super::node_changes::NodeTransition;
use super::store::{WriteTxn, brakes, catalog, events, liveness};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

pub use super::store::liveness::{Candidate, SiteLiveness};

impl Services {
    /// `connected` and `disconnected` nodes with no heartbeat since `cutoff`.
    pub async fn silent_nodes(&self, cutoff: DateTime<Utc>) -> ApiResult<Vec<Candidate>> {
        Ok(liveness::silent(self.store.db(), cutoff).await?)
    }

    /// Changes a node that [`Services::silent_nodes`] found silent (Liveness marks it
    /// `unreachable`), unless its daemon was heard at or after `cutoff` by the time the node
    /// is locked: then nothing is written and the answer is `None`.
    ///
    /// The candidate's version alone cannot tell: a daemon that comes back to a node still
    /// `connected` (its gateway died without closing the session) opens a session without
    /// changing the node. Under load the controller marks its candidates many seconds after
    /// its query: in a failover at 100,000 nodes 2,492 nodes were marked `unreachable`, and
    /// 2,197 of them came back by a heartbeat rather than a `hello`, their new session open
    /// before the mark (BENCHMARKS.md, session 29). A `hello` locks the node before it
    /// writes the session, so once the lock is held here a session opened since the query
    /// has committed, and the read after it sees it; a heartbeat batch writes the session
    /// row without the node's lock, and the read waits for it to commit
    /// ([`liveness::heard_since`]).
    pub async fn change_silent_node<F>(
        &self,
        actor: &Actor,
        candidate: &Candidate,
        cutoff: DateTime<Utc>,
        cause: &str,
        change: F,
    ) -> ApiResult<Option<NodeRecord>>
    where
        F: NodeTransition,
    {
        let txn = self.store.write().await?;
        txn.lock_node(&candidate.node_id).await?;
        if liveness::heard_since(&*txn, &candidate.node_id, cutoff).await? {
            return Ok(None);
        }
        let everyone = |_: &NodeRecord| true;
        let (after, changes) = self
            .change_node_in(
                &txn,
                actor,
                &candidate.node_id,
                Some(candidate.version),
                &everyone,
                cause,
                change,
            )
            .await?;
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        Ok(Some(after))
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

    /// Every stored brake (`bc_core::brake`), for the Liveness controller.
    pub async fn liveness_brakes(&self) -> ApiResult<Vec<LivenessBrake>> {
        Ok(brakes::all(self.store.db()).await?)
    }

    /// `livenessBrakes`: the brakes of the sites the principal may see.
    pub async fn visible_liveness_brakes(
        &self,
        principal: &Principal,
    ) -> ApiResult<Vec<LivenessBrake>> {
        let read = self.store.read().await?;
        let mut visible = Vec::new();
        for brake in brakes::all(&read).await? {
            let owner = catalog::site(&read, &brake.site_id)
                .await?
                .and_then(|s| s.owner_tenant_id);
            if principal.can_see(owner.as_ref()) {
                visible.push(brake);
            }
        }
        Ok(visible)
    }

    /// Stores a brake that tripped and its `site.liveness_paused` event (`data`), in one
    /// transaction. Returns false, recording nothing, when the site has a brake already.
    pub async fn trip_liveness_brake(
        &self,
        brake: &LivenessBrake,
        actor: &Actor,
        data: serde_json::Value,
    ) -> ApiResult<bool> {
        let txn = self.store.write().await?;
        if !brakes::insert(&*txn, brake).await? {
            return Ok(false);
        }
        let owner = site_owner(&txn, &brake.site_id).await?;
        events::append_other(
            &txn,
            EventType::SiteLivenessPaused,
            owner.as_ref().map(|t| t.as_str()),
            actor,
            data,
            brake.tripped_at,
        );
        txn.commit().await?;
        Ok(true)
    }

    /// Forgets the brake of `site` whose episode ended, if it is still in `status`; a paused
    /// one records `site.liveness_resumed` (`data`) in the same transaction (a released one
    /// resumed liveness when it was released). Returns whether it was forgotten.
    pub async fn end_liveness_brake(
        &self,
        site: &SiteId,
        status: BrakeStatus,
        actor: &Actor,
        data: serde_json::Value,
        now: DateTime<Utc>,
    ) -> ApiResult<bool> {
        let txn = self.store.write().await?;
        if !brakes::delete(&*txn, site, status).await? {
            return Ok(false);
        }
        if status == BrakeStatus::Paused {
            let owner = site_owner(&txn, site).await?;
            events::append_other(
                &txn,
                EventType::SiteLivenessResumed,
                owner.as_ref().map(|t| t.as_str()),
                actor,
                data,
                now,
            );
        }
        txn.commit().await?;
        Ok(true)
    }

    /// `releaseLivenessBrake`: an admin who may see the site lets Liveness mark its silent
    /// nodes down after all, with a reason of their own, recorded as
    /// `site.liveness_released`. The brake stays stored (released) until the episode ends,
    /// so the same silence does not trip it again.
    pub async fn release_liveness_brake(
        &self,
        principal: &Principal,
        site: &SiteId,
        reason: &str,
    ) -> ApiResult<LivenessBrake> {
        principal.require(Role::Admin)?;
        let txn = self.store.write().await?;
        let now = self.clock.now();
        let owner = catalog::site(&*txn, site)
            .await?
            .filter(|s| principal.can_see(s.owner_tenant_id.as_ref()))
            .ok_or_else(|| ApiError::NotFound(format!("site `{site}` does not exist")))?
            .owner_tenant_id;
        let mut brake = brakes::of_site(&*txn, site).await?.ok_or_else(|| {
            ApiError::NotFound(format!(
                "liveness in site `{site}` is not paused: it has no brake to release"
            ))
        })?;
        let actor = principal.actor();
        brake.release(actor.to_string(), reason.to_owned(), now)?;
        if !brakes::save_release(&*txn, &brake).await? {
            return Err(ApiError::NotFound(format!(
                "liveness in site `{site}` is not paused: its brake was released or ended meanwhile"
            )));
        }
        events::append_other(
            &txn,
            EventType::SiteLivenessReleased,
            owner.as_ref().map(|t| t.as_str()),
            &actor,
            serde_json::json!({
                "siteId": site,
                "reason": reason,
                "trippedAt": brake.tripped_at,
                "silent": brake.tripped_with.silent,
                "recentlyUnreachable": brake.tripped_with.recently_unreachable,
                "watched": brake.tripped_with.watched,
            }),
            now,
        );
        txn.commit().await?;
        Ok(brake)
    }
}

/// The tenant that owns `site` (`None`: the platform's), whose principals see its events.
async fn site_owner(txn: &WriteTxn, site: &SiteId) -> ApiResult<Option<TenantId>> {
    Ok(catalog::site(&**txn, site)
        .await?
        .and_then(|s| s.owner_tenant_id))
}
