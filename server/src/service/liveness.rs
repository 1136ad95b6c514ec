//! What the Liveness controller reads and records: one indexed query per kind of candidate
//! (see `store/liveness.rs` for which nodes are watched), the site numbers behind the fleet
//! brake, and the brake's episodes (`bc_core::brake`) with their events; and an admin's
//! release of a brake. The controller decides; this only reads and writes.

use bc_core::Actor;
use bc_core::brake::{BrakeStatus, LivenessBrake};
use bc_core::event::{Change, EventType};
use bc_core::ids::{NodeId, SiteId, TenantId};
use bc_core::node::NodeRecord;
use chrono::{DateTime, Utc};
use std::collections::HashMap;

use super::Services;
use super::node_changes::{NodeChangeRequest, NodeTransition};
use super::store::{WriteTxn, brakes, catalog, events, liveness};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

pub use super::store::liveness::{Candidate, SiteLiveness};

/// What became of one request of [`Services::change_silent_nodes`].
#[derive(Debug)]
pub enum SilentChange {
    /// The node's daemon was heard at or after the cutoff by the time the node was locked:
    /// nothing of the request was written.
    HeardAgain,
    /// The change was tried: the node as written and what changed, or why the request was
    /// refused (`CONFLICT` for a node changed since the query, say). Boxed: a node record is
    /// large, and a `HeardAgain` carries nothing.
    Tried(Box<ApiResult<(NodeRecord, Vec<Change>)>>),
}

impl Services {
    /// `connected` and `disconnected` nodes with no heartbeat since `cutoff`.
    pub async fn silent_nodes(&self, cutoff: DateTime<Utc>) -> ApiResult<Vec<Candidate>> {
        Ok(liveness::silent(self.store.db(), cutoff).await?)
    }

    /// Changes nodes that [`Services::silent_nodes`] found silent (Liveness marks them
    /// `unreachable`), in one transaction, except those whose daemon was heard at or after
    /// `cutoff` by the time their nodes are locked: nothing of those is written. One answer
    /// per request, in the order given; an error of the whole batch (a database error,
    /// mostly) rolls it back and is the answer.
    ///
    /// A request's version alone cannot tell: a daemon that comes back to a node still
    /// `connected` (its gateway died without closing the session) opens a session without
    /// changing the node. Under load the controller marks its candidates many seconds after
    /// its query: in a failover at 100,000 nodes 2,492 nodes were marked `unreachable`, and
    /// 2,197 of them came back by a heartbeat rather than a `hello`, their new session open
    /// before the mark (BENCHMARKS.md, session 29). A `hello` locks the node before it
    /// writes the session, so once the locks are held here a session opened since the query
    /// has committed, and the read after them sees it; a heartbeat batch writes session rows
    /// without their nodes' locks, and the read waits for it to commit
    /// ([`liveness::heard_since`]).
    ///
    /// The nodes are changed together ([`Services::change_nodes_in`]), not a transaction
    /// each (each takes the event-order lock at its commit): one transaction a mark, Liveness
    /// marked 753 nodes over 35 s of a failover at 100,000 nodes; in batches it marked all
    /// 3,621 still silent after the grace within 15 s (BENCHMARKS.md, sessions 30 and 31).
    pub async fn change_silent_nodes<F>(
        &self,
        cutoff: DateTime<Utc>,
        requests: Vec<NodeChangeRequest<F>>,
    ) -> ApiResult<Vec<SilentChange>>
    where
        F: NodeTransition,
    {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<NodeId> = requests.iter().map(|r| r.id.clone()).collect();
        let txn = self.store.write().await?;
        txn.lock_nodes(&ids).await?;
        let heard = liveness::heard_since(&*txn, &ids, cutoff).await?;
        let was_heard: Vec<bool> = ids.iter().map(|id| heard.contains(id)).collect();
        let tried: Vec<NodeChangeRequest<F>> = requests
            .into_iter()
            .zip(&was_heard)
            .filter(|(_, heard)| !**heard)
            .map(|(request, _)| request)
            .collect();
        let everyone = |_: &NodeRecord| true;
        let outcomes = self.change_nodes_in(&txn, &everyone, tried).await?;
        txn.commit().await?;
        self.after_node_commits(&outcomes);
        // `change_nodes_in` answers each request it was given (the tried ones), in order.
        let mut outcomes = outcomes.into_iter();
        was_heard
            .into_iter()
            .map(|heard| {
                if heard {
                    return Ok(SilentChange::HeardAgain);
                }
                let (_, outcome) = outcomes.next().ok_or_else(|| {
                    ApiError::internal(anyhow::anyhow!(
                        "a batch of node changes answered fewer requests than it was given"
                    ))
                })?;
                Ok(SilentChange::Tried(Box::new(outcome)))
            })
            .collect()
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
