//! Subscriptions: the live event feed, filtered and shaped. Each can start from a cursor (an
//! event id) and replays what the client missed before following live changes; without one
//! it starts from now (`nodeChanges` first sends the current state of every matching node).
//! Every stream ends when the caller's token expires.

use async_graphql::{Context, Enum, ID, SimpleObject, Subscription};
use bc_core::event::{Axis, RecordedEvent};
use bc_core::ids::EventId;
use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use std::sync::Arc;

use super::input_limits::{Field, Validated};
use super::inputs::{EventFilterInput, NodeFilterInput};
use super::query::{event_filter, node_filter};
use super::types::{Event, NodeDetail};
use super::{page_size, parse_id, principal, services};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::feed::{Feed, FeedEvent};
use crate::service::{ChildSets, NodeFilter};
use crate::subscription_hubs::HubCursor;

/// The `Subscription` root (named so in the schema, as clients and tools expect).
pub struct SubscriptionRoot;

/// Nodes sent per page of a `nodeChanges` snapshot.
const SNAPSHOT_PAGE: u64 = 500;

/// Whether a `NodeChange` is the node's state when the subscription started or a change.
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
    /// The event that recorded the change (`evt_…`).
    pub event_id: ID,
    /// The event type, e.g. `node.cordoned`.
    #[graphql(name = "type")]
    pub event_type: String,
    /// The axis or field that changed (`cordoned`, `connectivity`, …).
    pub axis: Option<String>,
    /// The value before, in its stored spelling.
    pub from: Option<String>,
    /// The value after, in its stored spelling.
    pub to: Option<String>,
    /// Who: `user:<subject>`, `controller:<name>`, `node:<id>` or `system`.
    pub actor: String,
    /// What caused it: the mutation, controller step, session or command.
    pub cause: Option<String>,
    /// The node's version after the change.
    pub version: Option<i64>,
    /// When it happened.
    pub at: DateTime<Utc>,
}

/// A node's change (or, first, its current state), with the node as it was right after the
/// change: a replayed change carries the node of its time, rebuilt from the event log, never
/// today's.
#[derive(SimpleObject)]
pub struct NodeChange {
    /// The current state (`SNAPSHOT`) or a change (`CHANGE`).
    pub kind: NodeChangeKind,
    /// Resume from here (`after`) after a reconnect.
    pub cursor: ID,
    /// The node as it was right after the change (for a snapshot, as it is now). A node
    /// rebuilt from the log has no `session` (sessions are not versioned); see `nodeAsOf`.
    pub node: NodeDetail,
    /// What changed; `null` for a snapshot.
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
pub(super) fn visible(principal: &Principal, event: &RecordedEvent) -> bool {
    principal.can_see(event.tenant_id.as_ref())
}

/// What a subscription ends with when its token expires.
pub fn token_expired() -> ApiError {
    ApiError::Unauthenticated("the token expired; subscribe again with a fresh one".into())
}

/// Ends `stream` with `UNAUTHENTICATED` when the token expires.
pub(super) fn until_expiry<T: Send + 'static>(
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
                    yield Err(token_expired().into());
                    return;
                }
            }
        }
    }
}

/// The cursor to resume after, if the client gave one (`None`: from now).
pub(super) fn start_cursor(after: Option<&ID>) -> Result<Option<i64>, ApiError> {
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
    if !filter.gateway_ids.is_empty() {
        // The feed sees node changes, and a daemon reconnecting to another replica changes
        // its session, not its node: the stream could not tell when a node left the filter.
        return Err(Field::argument("filter")
            .at("gatewayId")
            .refuse("cannot be followed live (a session moves between gateways without a node change); query `nodes` with it instead")
            .into());
    }
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
                    let page = match services.nodes(&principal, filter.clone(), page_after.as_deref(), SNAPSHOT_PAGE, ChildSets::ALL).await {
                        Ok(page) => page,
                        Err(err) => { yield Err(err.into()); return; }
                    };
                    page_after = page.nodes.last().map(|n| n.record.id.to_string());
                    for node in page.nodes {
                        yield Ok(NodeChange {
                            kind: NodeChangeKind::Snapshot,
                            cursor: ID(EventId(head).to_string()),
                            node: NodeDetail::from(node),
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
                    if let Some(version) = event.node_not_recorded
                        && visible(&principal, &event.event)
                    {
                        // Written before events carried rebuild data: say so for this change
                        // rather than show today's node, and go on.
                        yield Err(ApiError::HistoryNotRecorded {
                            message: format!(
                                "event {}: version {version} of node {} was recorded before node history carried rebuild data",
                                event.event.id,
                                event.event.node_id.as_ref().map_or("?", |n| n.as_str()),
                            ),
                            version,
                        }.into());
                        continue;
                    }
                    let Some(node) = &event.node else { continue };
                    if !visible(&principal, &event.event) || !filter.matches(node) {
                        continue;
                    }
                    if only_axis.is_some_and(|axis| event.event.axis != Some(axis)) {
                        continue;
                    }
                    yield Ok(NodeChange {
                        kind: NodeChangeKind::Change,
                        cursor: ID(event.event.id.to_string()),
                        node: NodeDetail::from(node.as_ref().clone()),
                        change: Some(axis_change(&event)),
                    });
                }
            }
        }
    };
    Ok(until_expiry(stream, expires_at))
}

/// Whether a `CommandUpdate` is a command's state when the subscription started or a change.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
pub enum CommandUpdateKind {
    /// The command's state when the subscription started (`current: true`): every command
    /// still in flight (queued, dispatched or running), or the one command asked for.
    Snapshot,
    /// The command changed status.
    Change,
}

/// A command changed status (queued, dispatched, running, and how it ended), with the command
/// as it is now (result and output included); or, first when asked, its current state.
#[derive(SimpleObject)]
pub struct CommandUpdate {
    /// The current state (`SNAPSHOT`) or a change (`CHANGE`).
    pub kind: CommandUpdateKind,
    /// The event of the change (`evt_…`), or for a snapshot the newest event when the
    /// subscription started: resume from here (`after`) after a reconnect.
    pub cursor: ID,
    /// The status before (e.g. `queued`); `null` when the command was just queued, and for a
    /// snapshot.
    pub from: Option<String>,
    /// The status after (e.g. `running`, `succeeded`).
    pub to: Option<String>,
    /// When the status changed (for a snapshot, when the command last changed).
    pub at: DateTime<Utc>,
    /// The command as it is now, result and output included.
    pub command: super::types::Command,
}

// Merged into the schema's `SubscriptionRoot` (graphql/mod.rs), so its own name must differ.
#[Subscription(name = "NodeSubscriptionRoot")]
impl SubscriptionRoot {
    /// Command updates and results, for one node, one command, or every command visible.
    /// With `current: true` (and no `after`), first the current state: every matching command
    /// still in flight, or the one command asked for (`SNAPSHOT`), then changes from that
    /// moment, with no gap and no duplicate.
    async fn command_updates(
        &self,
        ctx: &Context<'_>,
        #[graphql(
            desc = "Resume after this event (`evt_…`, a `cursor` or event id you received) without missing any; omit to start from now."
        )]
        after: Option<ID>,
        #[graphql(desc = "Only commands of this node.")] node_id: Option<ID>,
        #[graphql(desc = "Only this command.")] command_id: Option<ID>,
        #[graphql(
            desc = "Start with the current state of the matching commands (`SNAPSHOT`): those in flight, or the one `commandId` names. Not with `after`."
        )]
        current: Option<bool>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<CommandUpdate>>> {
        let services = services(ctx)?.clone();
        let principal = principal(ctx)?.clone();
        let feed = ctx.data::<Arc<Feed>>()?.clone();
        let current = current.unwrap_or(false);
        if current && after.is_some() {
            return Err(ApiError::BadUserInput(
                "`current` starts from now; it cannot be combined with `after`".into(),
            )
            .into());
        }
        // From now: the table's head, which the feed may not have read yet.
        let start = match start_cursor(after.as_ref())? {
            Some(start) => start,
            None => services.event_head().await?,
        };
        let node = node_id
            .as_ref()
            .map(|n| parse_id(n, bc_core::ids::NodeId::parse))
            .transpose()?;
        let command = command_id
            .as_ref()
            .map(|c| parse_id(c, bc_core::ids::CommandId::parse))
            .transpose()?;
        // The snapshot is read after the head: a change landing meanwhile is in the snapshot
        // and is delivered again as a change, so nothing is missed.
        let snapshot = if current {
            services
                .commands_in_flight(&principal, node.as_ref(), command.as_ref())
                .await?
        } else {
            Vec::new()
        };
        let node_id = node.map(|n| n.to_string());
        let command_id = command.map(|c| c.to_string());
        let expires_at = principal.expires_at;
        // Command updates carry the command, never a node: they follow the feed without
        // nodes.
        let events = feed.subscribe_events(services.clone(), start);
        let stream = async_stream::stream! {
            for command in snapshot {
                yield Ok(CommandUpdate {
                    kind: CommandUpdateKind::Snapshot,
                    cursor: ID(EventId(start).to_string()),
                    from: None,
                    to: Some(command.status.to_string()),
                    at: command.updated_at,
                    command: super::types::Command(command),
                });
            }
            tokio::pin!(events);
            while let Some(item) = events.next().await {
                let event = match item {
                    Ok(event) => event,
                    Err(err) => { yield Err(err.into()); return; }
                };
                let e = &*event;
                let wanted = e.axis == Some(Axis::Command)
                    && visible(&principal, e)
                    && node_id.as_ref().is_none_or(|n| e.node_id.as_ref().is_some_and(|id| id.as_str() == n.as_str()))
                    && command_id.as_ref().is_none_or(|c| e.cause.as_ref() == Some(c));
                if !wanted {
                    continue;
                }
                let Some(id) = e.cause.as_deref().and_then(|c| bc_core::ids::CommandId::parse(c).ok()) else { continue };
                match services.command(&principal, &id).await {
                    Ok(command) => yield Ok(CommandUpdate {
                        kind: CommandUpdateKind::Change,
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

    /// The event log as it grows: events matching `filter`, from `after` (exclusive) or from
    /// now. With `last: N` (and no `after`), first the N newest matching events (oldest
    /// first), then every new one, with no gap and no duplicate between the two.
    async fn events(
        &self,
        ctx: &Context<'_>,
        #[graphql(
            desc = "Resume after this event (`evt_…`, a `cursor` or event id you received) without missing any; omit to start from now."
        )]
        after: Option<ID>,
        #[graphql(
            desc = "Only events matching this filter (the `events` query's); omit for every event visible."
        )]
        filter: Option<Validated<EventFilterInput>>,
        #[graphql(
            desc = "Only events about this node: added to `filter.nodeIds` (alone, the same as `filter: {nodeIds: [nodeId]}`)."
        )]
        node_id: Option<ID>,
        #[graphql(
            desc = "Start with the newest `last` matching events already in the log (0 to `graphql.max_page_size`), oldest first, then follow. Not with `after`."
        )]
        last: Option<i32>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<Event>>> {
        let mut filter = event_filter(
            filter
                .map(|f| f.check("filter"))
                .transpose()?
                .unwrap_or_default(),
        )?;
        if let Some(node_id) = &node_id {
            Field::argument("nodeId").id(node_id)?;
            filter
                .node_ids
                .push(parse_id(node_id, bc_core::ids::NodeId::parse)?);
        }
        let last = match last {
            Some(_) if after.is_some() => {
                return Err(ApiError::BadUserInput(
                    "`last` starts from now; it cannot be combined with `after`".into(),
                )
                .into());
            }
            Some(n) => Some(page_size(ctx, Some(n)).map_err(|e| match e {
                ApiError::BadUserInput(m) => ApiError::BadUserInput(m.replace("`first`", "`last`")),
                other => other,
            })?),
            None => None,
        };
        let services = services(ctx)?.clone();
        let principal = principal(ctx)?.clone();
        let feed = ctx.data::<Arc<Feed>>()?.clone();
        // A hub's stream (see `subscription_hubs`) starts where the hub does and reports each
        // event it receives, so the hub can tell its subscribers their cursor.
        let hub_cursor = ctx.data_opt::<HubCursor>().cloned();
        // From now: the table's head, which the feed may not have read yet.
        let start = match (&hub_cursor, start_cursor(after.as_ref())?) {
            (Some(hub), _) => hub.get(),
            (None, Some(start)) => start,
            (None, None) => services.event_head().await?,
        };
        // The backlog ends at the head the live part starts after: no gap, no duplicate.
        let backlog = match last {
            Some(n) if n > 0 => {
                services
                    .recent_events(&principal, filter.clone(), start, n)
                    .await?
            }
            _ => Vec::new(),
        };
        let expires_at = principal.expires_at;
        // The log's entries carry no node: they follow the feed without nodes.
        let live = feed
            .subscribe_events(services, start)
            .filter_map(move |item| {
                let out = match item {
                    Err(err) => Some(Err(err.into())),
                    Ok(event) => {
                        if let Some(hub) = &hub_cursor {
                            hub.advance(event.id.0);
                        }
                        (visible(&principal, &event) && filter.matches(&event))
                            .then(|| Ok(Event(event)))
                    }
                };
                futures::future::ready(out)
            });
        let stream =
            futures::stream::iter(backlog.into_iter().map(|e| Ok(Event::new(e)))).chain(live);
        Ok(until_expiry(stream, expires_at))
    }

    /// Changes to nodes matching `filter`, axis by axis. Without `after`, first the current
    /// state of every matching node (`SNAPSHOT`), then changes.
    async fn node_changes(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only nodes matching this filter; omit for every node visible.")]
        filter: Option<Validated<NodeFilterInput>>,
        #[graphql(
            desc = "Resume after this `cursor` without missing a change (and without a snapshot); omit for a snapshot, then changes."
        )]
        after: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<NodeChange>>> {
        node_change_stream(ctx, filter, after, None).await
    }

    /// Connectivity changes of nodes matching `filter` (`connected`, `disconnected`,
    /// `unreachable`, `lost`). Without `after`, first the current state of every matching node.
    async fn connectivity_changes(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only nodes matching this filter; omit for every node visible.")]
        filter: Option<Validated<NodeFilterInput>>,
        #[graphql(
            desc = "Resume after this `cursor` without missing a change (and without a snapshot); omit for a snapshot, then changes."
        )]
        after: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<NodeChange>>> {
        node_change_stream(ctx, filter, after, Some(Axis::Connectivity)).await
    }
}
