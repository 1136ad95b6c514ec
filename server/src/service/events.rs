//! The event log: every change's event, written in the same transaction as the change, and
//! read back as a node's history and by the live feed that tails it.

use bc_core::event::RecordedEvent;
use bc_core::ids::{EventId, NodeId};
use bc_core::view::NodeDetail;
use std::sync::Arc;
use tokio::sync::{Notify, watch};

use super::Services;
use super::catalog::Page;
use super::nodes::not_found;
use super::store::events::{self, EventFilter};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

impl Services {
    /// A node's event history, newest first.
    pub async fn node_events(
        &self,
        principal: &Principal,
        node: &NodeDetail,
        before: Option<EventId>,
        limit: u64,
    ) -> ApiResult<Vec<RecordedEvent>> {
        let node = &node.record;
        if !principal.can_see(node.owner_tenant_id.as_ref()) {
            return Err(not_found(&node.id));
        }
        self.node_history(&node.id, before, limit).await
    }

    /// A node's event history, newest first, for the platform's own use (no visibility
    /// check): controllers, the gateway and tests.
    pub async fn node_history(
        &self,
        id: &NodeId,
        before: Option<EventId>,
        limit: u64,
    ) -> ApiResult<Vec<RecordedEvent>> {
        Ok(events::for_node(self.store.db(), id.as_str(), before, limit).await?)
    }

    /// `events(filter, first, after)`: the fleet event log, newest first, filtered, with the
    /// one visibility rule (a tenant sees its own events only). `after` is the last event of
    /// the previous page.
    pub async fn event_log(
        &self,
        principal: &Principal,
        mut filter: EventFilter,
        after: Option<EventId>,
        first: u64,
    ) -> ApiResult<Page<RecordedEvent>> {
        check_window(&filter)?;
        filter.tenant = principal.tenant.clone();
        let items = events::list(self.store.db(), &filter, after.map(|a| a.0), first + 1).await?;
        Ok(Page::of(items, first))
    }

    /// How many events `filter` matches, of those the principal may see (`totalCount`).
    pub async fn count_events(
        &self,
        principal: &Principal,
        mut filter: EventFilter,
    ) -> ApiResult<u64> {
        filter.tenant = principal.tenant.clone();
        Ok(events::count(self.store.db(), &filter).await?)
    }

    /// The `last` newest events matching `filter` at or before sequence number `head`,
    /// oldest first: what the live `events` subscription sends before it follows from `head`.
    pub async fn recent_events(
        &self,
        principal: &Principal,
        mut filter: EventFilter,
        head: i64,
        last: u64,
    ) -> ApiResult<Vec<RecordedEvent>> {
        check_window(&filter)?;
        filter.tenant = principal.tenant.clone();
        let mut items = events::list(self.store.db(), &filter, Some(head + 1), last).await?;
        items.reverse();
        Ok(items)
    }

    /// The newest event's sequence number (0 when there is none): where a live subscription
    /// without a cursor starts.
    pub async fn event_head(&self) -> ApiResult<i64> {
        Ok(events::head(self.store.db()).await?)
    }

    /// At most `limit` events after sequence number `after`, oldest first: the feed's replay
    /// and tail.
    pub async fn events_after(&self, after: i64, limit: u64) -> ApiResult<Vec<RecordedEvent>> {
        Ok(events::after(self.store.db(), after, limit).await?)
    }

    /// Notified after every write this process commits, so its feed reads new events at once.
    pub fn committed_writes(&self) -> Arc<Notify> {
        self.store.committed()
    }

    /// On PostgreSQL, a task that wakes `wake` whenever any replica commits events (`LISTEN`),
    /// until `shutdown`; `None` on SQLite, where this process is the only writer.
    pub fn other_writers_listener(
        &self,
        wake: Arc<Notify>,
        shutdown: watch::Receiver<bool>,
    ) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        events::listen_for_commits(&self.store, wake, shutdown)
    }
}

/// `since` after `until` selects nothing by mistake: refused.
fn check_window(filter: &EventFilter) -> ApiResult<()> {
    if let (Some(since), Some(until)) = (filter.since, filter.until)
        && since > until
    {
        return Err(ApiError::InvalidField {
            field: "filter.since".into(),
            message: format!(
                "`since` ({}) is after `until` ({})",
                since.to_rfc3339(),
                until.to_rfc3339()
            ),
        });
    }
    Ok(())
}
