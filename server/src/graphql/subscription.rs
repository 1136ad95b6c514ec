//! Subscriptions: the live event feed, filtered and shaped. Each can start from a cursor (an
//! event id) and replays what the client missed before following live changes; without one
//! it starts from now (`nodeChanges` first sends the current state of every matching node).
//! Every stream ends when the caller's token expires.

use async_graphql::{Context, Enum, ID, SimpleObject, Subscription};
use bc_core::event::Axis;
use bc_core::ids::EventId;
use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use std::sync::Arc;

use super::input_limits::{Field, MAX_EVENT_TYPES, Text, Validated};
use super::inputs::NodeFilterInput;
use super::query::node_filter;
use super::types::{Event, NodeDetail};
use super::{principal, services};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::feed::{Feed, FeedEvent};
use crate::service::NodeFilter;

pub struct SubscriptionRoot;

/// Nodes sent per page of a `nodeChanges` snapshot.
const SNAPSHOT_PAGE: u64 = 500;

#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
pub enum NodeChangeKind {
    /// The node's state when the subscription started (no cursor given).
    Snapshot,
    /// A change to one axis or field.
    Change,
}

/// One change to one axis of a node.
#[derive(SimpleObject)]
pub struct AxisChange {
    pub event_id: ID,
    /// The event type, e.g. `node.cordoned`.
    #[graphql(name = "type")]
    pub event_type: String,
    pub axis: Option<String>,
    pub from: Option<String>,
    pub to: Option<String>,
    /// Who: `user:<subject>`, `controller:<name>`, `node:<id>` or `system`.
    pub actor: String,
    /// What caused it: the mutation, controller step, session or command.
    pub cause: Option<String>,
    /// The node's version after the change.
    pub version: Option<i64>,
    pub at: DateTime<Utc>,
}

/// A node's change (or, first, its current state), with the node as it is now.
#[derive(SimpleObject)]
pub struct NodeChange {
    pub kind: NodeChangeKind,
    /// Resume from here (`after`) after a reconnect.
    pub cursor: ID,
    pub node: NodeDetail,
    /// `null` for a snapshot.
    pub change: Option<AxisChange>,
}

fn axis_change(feed_event: &FeedEvent) -> AxisChange {
    let e = &feed_event.event;
    AxisChange {
        event_id: ID(e.id.to_string()),
        event_type: e.event_type.to_string(),
        axis: e.axis.map(|a| a.to_string()),
        from: e.from.clone(),
        to: e.to.clone(),
        actor: e.actor.to_string(),
        cause: e.cause.clone(),
        version: e.node_version(),
        at: e.at,
    }
}

/// Whether `principal` may see this event: the one tenancy rule, [`Principal::can_see`],
/// applied to the event's tenant.
fn visible(principal: &Principal, event: &FeedEvent) -> bool {
    principal.can_see(event.event.tenant_id.as_ref())
}

/// Ends `stream` with `UNAUTHENTICATED` when the token expires.
fn until_expiry<T: Send + 'static>(
    stream: impl Stream<Item = async_graphql::Result<T>> + Send + 'static,
    expires_at: DateTime<Utc>,
) -> impl Stream<Item = async_graphql::Result<T>> + Send + 'static {
    async_stream::stream! {
        let remaining = (expires_at - Utc::now()).to_std().unwrap_or_default();
        let deadline = tokio::time::sleep(remaining);
        tokio::pin!(deadline);
        tokio::pin!(stream);
        loop {
            tokio::select! {
                item = stream.next() => match item {
                    Some(item) => yield item,
                    None => return,
                },
                () = &mut deadline => {
                    yield Err(ApiError::Unauthenticated("the token expired; subscribe again with a fresh one".into()).into());
                    return;
                }
            }
        }
    }
}

/// The cursor to resume after, if the client gave one (`None`: from now).
fn start_cursor(after: Option<&ID>) -> Result<Option<i64>, ApiError> {
    after
        .map(|a| EventId::parse(a.as_str()).map(|e| e.0))
        .transpose()
        .map_err(ApiError::from)
}

/// Node changes matching `filter`, optionally only those of one axis.
async fn node_change_stream(
    ctx: &Context<'_>,
    filter: Option<Validated<NodeFilterInput>>,
    after: Option<ID>,
    only_axis: Option<Axis>,
) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<NodeChange>> + Send + 'static> {
    let filter = filter.map(|f| f.check("filter")).transpose()?;
    let services = services(ctx)?.clone();
    let principal = principal(ctx)?.clone();
    let feed = ctx.data::<Arc<Feed>>()?.clone();
    let mut filter: NodeFilter = node_filter(filter.unwrap_or_default())?;
    filter.owner = principal.tenant.clone();
    let cursor = start_cursor(after.as_ref())?;
    let expires_at = principal.expires_at;
    let stream = async_stream::stream! {
        let start = match cursor {
            Some(cursor) => cursor,
            None => {
                // The snapshot is taken after the head is read, so a change that lands while
                // the snapshot pages is delivered again as a change: nothing is missed. The
                // head is the table's, not the feed's: the feed may not have read the newest
                // events yet, and those are already in the snapshot.
                let head = match services.event_head().await {
                    Ok(head) => head,
                    Err(err) => { yield Err(err.into()); return; }
                };
                let mut page_after: Option<String> = None;
                loop {
                    let page = match services.nodes(&principal, filter.clone(), page_after.as_deref(), SNAPSHOT_PAGE).await {
                        Ok(page) => page,
                        Err(err) => { yield Err(err.into()); return; }
                    };
                    page_after = page.nodes.last().map(|n| n.record.id.to_string());
                    for node in page.nodes {
                        yield Ok(NodeChange {
                            kind: NodeChangeKind::Snapshot,
                            cursor: ID(EventId(head).to_string()),
                            node: NodeDetail(node),
                            change: None,
                        });
                    }
                    if !page.has_next_page {
                        break;
                    }
                }
                head
            }
        };
        let events = feed.subscribe(services.clone(), start);
        tokio::pin!(events);
        while let Some(item) = events.next().await {
            match item {
                Err(err) => { yield Err(err.into()); return; }
                Ok(event) => {
                    let Some(node) = &event.node else { continue };
                    if !visible(&principal, &event) || !filter.matches(node) {
                        continue;
                    }
                    if only_axis.is_some_and(|axis| event.event.axis != Some(axis)) {
                        continue;
                    }
                    yield Ok(NodeChange {
                        kind: NodeChangeKind::Change,
                        cursor: ID(event.event.id.to_string()),
                        node: NodeDetail(node.as_ref().clone()),
                        change: Some(axis_change(&event)),
                    });
                }
            }
        }
    };
    Ok(until_expiry(stream, expires_at))
}

/// A command changed status (queued, dispatched, running, and how it ended), with the command
/// as it is now (result and output included).
#[derive(SimpleObject)]
pub struct CommandUpdate {
    pub cursor: ID,
    pub from: Option<String>,
    pub to: Option<String>,
    pub at: DateTime<Utc>,
    pub command: super::types::Command,
}

#[Subscription]
impl SubscriptionRoot {
    /// Command updates and results, for one node, one command, or every command visible.
    async fn command_updates(
        &self,
        ctx: &Context<'_>,
        after: Option<ID>,
        node_id: Option<ID>,
        command_id: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<CommandUpdate>>> {
        let services = services(ctx)?.clone();
        let principal = principal(ctx)?.clone();
        let feed = ctx.data::<Arc<Feed>>()?.clone();
        // From now: the table's head, which the feed may not have read yet.
        let start = match start_cursor(after.as_ref())? {
            Some(start) => start,
            None => services.event_head().await?,
        };
        let node_id = node_id.map(|n| n.to_string());
        let command_id = command_id.map(|c| c.to_string());
        let expires_at = principal.expires_at;
        let events = feed.subscribe(services.clone(), start);
        let stream = async_stream::stream! {
            tokio::pin!(events);
            while let Some(item) = events.next().await {
                let event = match item {
                    Ok(event) => event,
                    Err(err) => { yield Err(err.into()); return; }
                };
                let e = &event.event;
                let wanted = e.axis == Some(Axis::Command)
                    && visible(&principal, &event)
                    && node_id.as_ref().is_none_or(|n| e.node_id.as_ref().is_some_and(|id| id.as_str() == n.as_str()))
                    && command_id.as_ref().is_none_or(|c| e.cause.as_ref() == Some(c));
                if !wanted {
                    continue;
                }
                let Some(id) = e.cause.as_deref().and_then(|c| bc_core::ids::CommandId::parse(c).ok()) else { continue };
                match services.command(&principal, &id).await {
                    Ok(command) => yield Ok(CommandUpdate {
                        cursor: ID(e.id.to_string()),
                        from: e.from.clone(),
                        to: e.to.clone(),
                        at: e.at,
                        command: super::types::Command(command),
                    }),
                    Err(err) => { yield Err(err.into()); return; }
                }
            }
        };
        Ok(until_expiry(stream, expires_at))
    }

    /// The raw event log, from `after` (exclusive) or from now.
    async fn events(
        &self,
        ctx: &Context<'_>,
        after: Option<ID>,
        #[graphql(desc = "Only these event types, e.g. `node.cordoned`.")] types: Option<
            Vec<String>,
        >,
        node_id: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<Event>>> {
        Field::argument("types").list_opt(types.as_deref(), MAX_EVENT_TYPES, |at, t| {
            at.text(t, Text::EventType)
        })?;
        let services = services(ctx)?.clone();
        let principal = principal(ctx)?.clone();
        let feed = ctx.data::<Arc<Feed>>()?.clone();
        // From now: the table's head, which the feed may not have read yet.
        let start = match start_cursor(after.as_ref())? {
            Some(start) => start,
            None => services.event_head().await?,
        };
        let types = types.unwrap_or_default();
        let node_id = node_id.map(|n| n.to_string());
        let expires_at = principal.expires_at;
        let stream = feed.subscribe(services, start).filter_map(move |item| {
            let out = match item {
                Err(err) => Some(Err(err.into())),
                Ok(event) => {
                    let wanted = visible(&principal, &event)
                        && (types.is_empty()
                            || types
                                .iter()
                                .any(|t| t == event.event.event_type.as_static_str()))
                        && node_id.as_ref().is_none_or(|n| {
                            event
                                .event
                                .node_id
                                .as_ref()
                                .is_some_and(|id| id.as_str() == n.as_str())
                        });
                    wanted.then(|| Ok(Event(event.event.clone())))
                }
            };
            futures::future::ready(out)
        });
        Ok(until_expiry(stream, expires_at))
    }

    /// Changes to nodes matching `filter`, axis by axis. Without `after`, first the current
    /// state of every matching node (`SNAPSHOT`), then changes.
    async fn node_changes(
        &self,
        ctx: &Context<'_>,
        filter: Option<Validated<NodeFilterInput>>,
        after: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<NodeChange>>> {
        node_change_stream(ctx, filter, after, None).await
    }

    /// Connectivity changes of nodes matching `filter` (`connected`, `disconnected`,
    /// `unreachable`, `lost`). Without `after`, first the current state of every matching node.
    async fn connectivity_changes(
        &self,
        ctx: &Context<'_>,
        filter: Option<Validated<NodeFilterInput>>,
        after: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<NodeChange>>> {
        node_change_stream(ctx, filter, after, Some(Axis::Connectivity)).await
    }
}
