//! Queries.

use async_graphql::connection::{Connection, Edge};
use async_graphql::{Context, ID, Object};
use bc_core::ids::{EventId, JoinTokenId, NodeId, PoolId, SiteId, TenantId};
use bc_core::provision::{PROVISION_STATE_TABLE, Target};
use strum::IntoEnumIterator;

use super::input_limits::{Field, MAX_FILTER_VALUES, Timestamp, VERSION, Validated};
use super::inputs::{CommandFilterInput, EventFilterInput, NodeFilterInput};
use super::types::{
    CapacityCount, JoinToken, NodeDetail, Pool, PoolCapacity, ProvisionEdge, Site, Tenant, Viewer,
};
use super::types::{
    Command, CommandConnection, CommandListFields, Event, EventConnection, EventListFields,
};
use super::{page_size, parse_id, principal, services};
use crate::error::ApiError;
use crate::service::CapacityRow;
use crate::service::CommandFilter;
use crate::service::EventFilter;
use crate::service::catalog::{Page, PoolFilter};
use crate::service::history::AsOf;
use crate::service::{ChildSets, LabelSelector, NodeFilter};

/// The `Query` root (named so in the schema, as clients and tools expect).
pub struct QueryRoot;

/// Extra fields of the node list.
pub struct NodeListFields {
    filter: NodeFilter,
}

#[Object]
impl NodeListFields {
    /// How many nodes match the filter, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> async_graphql::Result<u64> {
        Ok(services(ctx)?
            .count_nodes(principal(ctx)?, self.filter.clone())
            .await?)
    }
}

pub type NodeConnection = Connection<String, NodeDetail, NodeListFields>;

/// The child sets of a node that the `nodes` field being resolved selects, through `edges {
/// node }` or `nodes`, by name, alias or fragment: the page reads those and no others
/// ([`ChildSets`]). A field under `@skip` or `@include` counts as selected, so the
/// page may read a set it does not show, never the other way round.
fn selected_child_sets(ctx: &Context<'_>) -> ChildSets {
    let look_ahead = ctx.look_ahead();
    let selected = |field: &str| {
        look_ahead
            .field("edges")
            .field("node")
            .field(field)
            .exists()
            || look_ahead.field("nodes").field(field).exists()
    };
    ChildSets {
        labels: selected("labels"),
        taints: selected("taints"),
        conditions: selected("conditions"),
    }
}

// Merged into the schema's `QueryRoot` (graphql/mod.rs), so its own name must differ.
#[Object(name = "NodeQueryRoot")]
impl QueryRoot {
    /// Who the caller is, as the server sees its token.
    async fn viewer(&self, ctx: &Context<'_>) -> async_graphql::Result<Viewer> {
        let p = principal(ctx)?;
        Ok(Viewer {
            subject: p.subject.clone(),
            role: p.role.to_string(),
            tenant_id: p.tenant.as_ref().map(|t| ID(t.to_string())),
            expires_at: p.expires_at,
        })
    }

    /// One node (`nodes.get`).
    async fn node(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node's id (`node_…`).")] id: ID,
    ) -> async_graphql::Result<NodeDetail> {
        let id = parse_id(&id, NodeId::parse)?;
        Ok(NodeDetail::from(
            services(ctx)?.node(principal(ctx)?, &id).await?,
        ))
    }

    /// Nodes matching a filter, ordered by id, a page at a time.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn nodes(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Which nodes; omit for every node visible.")] filter: Option<
            Validated<NodeFilterInput>,
        >,
        #[graphql(
            desc = "How many to return (default `graphql.default_page_size`, 100; at most `graphql.max_page_size`, 1000)."
        )]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<NodeConnection> {
        let first = page_size(ctx, first)?;
        let filter = node_filter(
            filter
                .map(|f| f.check("filter"))
                .transpose()?
                .unwrap_or_default(),
        )?;
        if let Some(after) = &after {
            NodeId::parse(after).map_err(ApiError::from)?;
        }
        let page = services(ctx)?
            .nodes(
                principal(ctx)?,
                filter.clone(),
                after.as_deref(),
                first,
                selected_child_sets(ctx),
            )
            .await?;
        let sets = page.child_sets;
        let mut connection = Connection::with_additional_fields(
            after.is_some(),
            page.has_next_page,
            NodeListFields { filter },
        );
        connection.edges.extend(page.nodes.into_iter().map(|n| {
            Edge::new(
                n.record.id.to_string(),
                NodeDetail::with_child_sets(n, sets),
            )
        }));
        Ok(connection)
    }

    /// Capacity of each pool by bucket (every pool visible, or those named), pools ordered
    /// as `pools` orders them, a page at a time.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn capacity(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only these pools; omit for every pool visible.")] pool_ids: Option<
            Vec<ID>,
        >,
        #[graphql(
            desc = "How many pools to return (default 100, at most `graphql.max_page_size`)."
        )]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<PoolCapacityConnection> {
        Field::argument("poolIds").list_opt(pool_ids.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        let filter = PoolFilter {
            site_id: None,
            ids: pool_ids
                .unwrap_or_default()
                .iter()
                .map(|id| parse_id(id, PoolId::parse))
                .collect::<Result<_, _>>()?,
        };
        let first = page_size(ctx, first)?;
        let after = cursor(after.as_deref(), PoolId::parse)?;
        let page = services(ctx)?
            .pool_capacity(principal(ctx)?, &filter, after.as_ref(), first)
            .await?;
        Ok(connection(
            page,
            after.is_some(),
            ListTotal::Pools(filter),
            |(pool, _)| pool.id.to_string(),
            |(pool, rows)| pool_capacity(&pool.id, &rows),
        ))
    }

    /// One command.
    async fn command(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The command's id (`cmd_…`).")] id: ID,
    ) -> async_graphql::Result<Command> {
        let id = parse_id(&id, bc_core::ids::CommandId::parse)?;
        Ok(Command(services(ctx)?.command(principal(ctx)?, &id).await?))
    }

    /// Commands, newest first.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn commands(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Which commands; omit for every command visible.")] filter: Option<
            Validated<CommandFilterInput>,
        >,
        #[graphql(
            desc = "How many to return (default `graphql.default_page_size`, 100; at most `graphql.max_page_size`, 1000)."
        )]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the newest commands.")]
        after: Option<String>,
    ) -> async_graphql::Result<CommandConnection> {
        let filter = filter.map(|f| f.check("filter")).transpose()?;
        command_page(
            ctx,
            command_filter(filter.unwrap_or_default())?,
            first,
            after,
        )
        .await
    }

    /// Join tokens, newest first (platform admins only).
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn join_tokens(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "How many to return (default 100, at most `graphql.max_page_size`).")]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<JoinTokenConnection> {
        let first = page_size(ctx, first)?;
        let after = cursor(after.as_deref(), JoinTokenId::parse)?;
        let page = services(ctx)?
            .join_tokens(principal(ctx)?, after.as_ref(), first)
            .await?;
        Ok(connection(
            page,
            after.is_some(),
            ListTotal::JoinTokens,
            |t| t.id.to_string(),
            JoinToken::from,
        ))
    }

    /// Tenants by name (a tenant's token sees only its own).
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn tenants(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "How many to return (default 100, at most `graphql.max_page_size`).")]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<TenantConnection> {
        let first = page_size(ctx, first)?;
        let after = cursor(after.as_deref(), TenantId::parse)?;
        let page = services(ctx)?
            .tenants(principal(ctx)?, after.as_ref(), first)
            .await?;
        Ok(connection(
            page,
            after.is_some(),
            ListTotal::Tenants,
            |t| t.id.to_string(),
            Tenant::from,
        ))
    }

    /// Sites by name (a tenant's token sees only its own sites).
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn sites(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "How many to return (default 100, at most `graphql.max_page_size`).")]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<SiteConnection> {
        let first = page_size(ctx, first)?;
        let after = cursor(after.as_deref(), SiteId::parse)?;
        let page = services(ctx)?
            .sites(principal(ctx)?, after.as_ref(), first)
            .await?;
        Ok(connection(
            page,
            after.is_some(),
            ListTotal::Sites,
            |s| s.id.to_string(),
            Site::from,
        ))
    }

    /// Pools by name (a tenant's token sees only its own pools).
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn pools(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Only the pools of this site.")] site_id: Option<ID>,
        #[graphql(desc = "How many to return (default 100, at most `graphql.max_page_size`).")]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<PoolConnection> {
        let filter = PoolFilter {
            site_id: site_id
                .as_ref()
                .map(|s| parse_id(s, SiteId::parse))
                .transpose()?,
            ids: Vec::new(),
        };
        let first = page_size(ctx, first)?;
        let after = cursor(after.as_deref(), PoolId::parse)?;
        let page = services(ctx)?
            .pools(principal(ctx)?, &filter, after.as_ref(), first)
            .await?;
        Ok(connection(
            page,
            after.is_some(),
            ListTotal::Pools(filter),
            |p| p.id.to_string(),
            Pool::from,
        ))
    }

    /// The node as it was at a past time or version, rebuilt from its event log (`nodes.get`
    /// as of then). Give exactly one of `at` and `version`. What a past `NodeDetail` carries:
    /// every field of the record as it was at that version; `session` is `null` (sessions are
    /// not versioned: heartbeats never change a node's version); `schedulability` and
    /// `noScheduleReasons` are those of the rebuilt record, the explanation recomputed for it
    /// (with the pool's owner); `version` is the version shown; list fields that are not part
    /// of the record (`events`, `devices`, `allocations`, `commands`) are today's. A deleted
    /// node's history stays readable. A time before the node existed is `NOT_FOUND`; history
    /// written before events carried rebuild data is `HISTORY_NOT_RECORDED` (with
    /// `extensions.version`), never a guess.
    async fn node_as_of(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The node's id (`node_…`).")] id: ID,
        #[graphql(
            desc = "The node as it was at this time: the version in force then (its newest change at or before it)."
        )]
        at: Option<Timestamp>,
        #[graphql(desc = "The node at this version (1 to the node's current version).")]
        version: Option<i64>,
    ) -> async_graphql::Result<NodeDetail> {
        let id = parse_id(&id, NodeId::parse)?;
        let as_of = match (at, version) {
            (Some(at), None) => {
                Field::argument("at").time(Some(&at))?;
                AsOf::Time(at.value()?)
            }
            (None, Some(version)) => {
                Field::argument("version").int(version, VERSION)?;
                AsOf::Version(version)
            }
            _ => {
                return Err(ApiError::BadUserInput(
                    "give exactly one of `at` and `version`".into(),
                )
                .into());
            }
        };
        Ok(NodeDetail::from(
            services(ctx)?
                .node_as_of(principal(ctx)?, &id, as_of)
                .await?,
        ))
    }

    /// The fleet's event log, newest first, a page at a time: every change to every node
    /// visible (with its actor, cause and typed detail), command status changes, placement
    /// and catalog events. Events are never deleted.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn events(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Which events; omit for every event visible.")] filter: Option<
            Validated<EventFilterInput>,
        >,
        #[graphql(
            desc = "How many to return (default `graphql.default_page_size`, 100; at most `graphql.max_page_size`, 1000)."
        )]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the newest events.")]
        after: Option<String>,
    ) -> async_graphql::Result<EventConnection> {
        let first = page_size(ctx, first)?;
        let filter = event_filter(
            filter
                .map(|f| f.check("filter"))
                .transpose()?
                .unwrap_or_default(),
        )?;
        let after = cursor(after.as_deref(), EventId::parse)?;
        let page = services(ctx)?
            .event_log(principal(ctx)?, filter.clone(), after, first)
            .await?;
        let mut connection = EventConnection::with_additional_fields(
            after.is_some(),
            page.has_next_page,
            EventListFields { filter },
        );
        connection.edges.extend(
            page.items
                .into_iter()
                .map(|e| Edge::new(e.id.to_string(), Event::new(e))),
        );
        Ok(connection)
    }

    /// `provisionStateTable`: every legal move, where it may start and where it leads. A fixed
    /// table of 14 moves, one per `ProvisionMove`.
    async fn provision_state_table(&self) -> Vec<ProvisionEdge> {
        PROVISION_STATE_TABLE
            .iter()
            .map(|edge| ProvisionEdge {
                action: edge.action.into(),
                from: edge.from.iter().map(|s| (*s).into()).collect(),
                to: match edge.to {
                    Target::State(s) => Some(s.into()),
                    Target::FailedFrom => None,
                },
            })
            .collect()
    }
}

/// `totalCount` of a catalog list, counted only when a client asks for it.
pub enum ListTotal {
    Tenants,
    Sites,
    Pools(PoolFilter),
    JoinTokens,
}

#[Object]
impl ListTotal {
    /// How many items the list holds across all pages (of those the caller may see).
    async fn total_count(&self, ctx: &Context<'_>) -> async_graphql::Result<u64> {
        let (services, p) = (services(ctx)?, principal(ctx)?);
        Ok(match self {
            ListTotal::Tenants => services.count_tenants(p).await?,
            ListTotal::Sites => services.count_sites(p).await?,
            ListTotal::Pools(filter) => services.count_pools(p, filter).await?,
            ListTotal::JoinTokens => services.count_join_tokens(p).await?,
        })
    }
}

pub type TenantConnection = Connection<String, Tenant, ListTotal>;
pub type SiteConnection = Connection<String, Site, ListTotal>;
pub type PoolConnection = Connection<String, Pool, ListTotal>;
pub type PoolCapacityConnection = Connection<String, PoolCapacity, ListTotal>;
pub type JoinTokenConnection = Connection<String, JoinToken, ListTotal>;

/// A connection of one page: each item's cursor (its id) and its API view.
fn connection<T, Node: async_graphql::OutputType>(
    page: Page<T>,
    has_previous_page: bool,
    total: ListTotal,
    cursor: impl Fn(&T) -> String,
    view: impl Fn(T) -> Node,
) -> Connection<String, Node, ListTotal> {
    let mut connection =
        Connection::with_additional_fields(has_previous_page, page.has_next_page, total);
    connection.edges.extend(
        page.items
            .into_iter()
            .map(|item| Edge::new(cursor(&item), view(item))),
    );
    connection
}

/// An `after` argument parsed as the id it must be.
fn cursor<T>(
    after: Option<&str>,
    parse: fn(&str) -> Result<T, bc_core::DomainError>,
) -> Result<Option<T>, ApiError> {
    after.map(parse).transpose().map_err(ApiError::from)
}

/// A pool's capacity: every bucket, in check order, with zeros where no node is.
fn pool_capacity(pool: &PoolId, rows: &[CapacityRow]) -> PoolCapacity {
    let buckets: Vec<CapacityCount> = bc_core::schedule::CapacityBucket::iter()
        .map(|bucket| {
            let row = rows.iter().find(|r| r.bucket == bucket);
            CapacityCount {
                bucket: bucket.into(),
                nodes: row.map_or(0, |r| r.nodes),
                gpus: row.map_or(0, |r| r.gpus),
            }
        })
        .collect();
    PoolCapacity {
        total_nodes: buckets.iter().map(|b| b.nodes).sum(),
        total_gpus: buckets.iter().map(|b| b.gpus).sum(),
        pool_id: ID(pool.to_string()),
        buckets,
    }
}

/// Maps the GraphQL command filter onto the storage filter.
pub(crate) fn command_filter(input: CommandFilterInput) -> Result<CommandFilter, ApiError> {
    Ok(CommandFilter {
        node_ids: input
            .node_id
            .unwrap_or_default()
            .iter()
            .map(|id| parse_id(id, NodeId::parse))
            .collect::<Result<_, _>>()?,
        statuses: input
            .status
            .unwrap_or_default()
            .into_iter()
            .map(Into::into)
            .collect(),
        kinds: input
            .kind
            .unwrap_or_default()
            .into_iter()
            .map(Into::into)
            .collect(),
        tenant: None,
    })
}

/// One page of commands, newest first; `after` is the last id of the previous page.
pub(crate) async fn command_page(
    ctx: &Context<'_>,
    filter: CommandFilter,
    first: Option<i32>,
    after: Option<String>,
) -> async_graphql::Result<CommandConnection> {
    let first = page_size(ctx, first)?;
    if let Some(after) = &after {
        bc_core::ids::CommandId::parse(after).map_err(ApiError::from)?;
    }
    let (list, more) = services(ctx)?
        .commands(principal(ctx)?, filter.clone(), after.as_deref(), first)
        .await?;
    let mut connection = CommandConnection::with_additional_fields(
        after.is_some(),
        more,
        CommandListFields { filter },
    );
    connection.edges.extend(
        list.into_iter()
            .map(|c| Edge::new(c.id.to_string(), Command(c))),
    );
    Ok(connection)
}

/// Maps the GraphQL filter onto the storage filter, validating ids.
pub(crate) fn node_filter(input: NodeFilterInput) -> Result<NodeFilter, ApiError> {
    fn ids<T>(
        raw: Option<Vec<ID>>,
        parse: fn(&str) -> Result<T, bc_core::DomainError>,
    ) -> Result<Vec<T>, ApiError> {
        raw.unwrap_or_default()
            .iter()
            .map(|id| parse_id(id, parse))
            .collect()
    }
    fn all<A: Copy, B: From<A>>(values: Option<Vec<A>>) -> Vec<B> {
        values
            .unwrap_or_default()
            .into_iter()
            .map(B::from)
            .collect()
    }
    Ok(NodeFilter {
        ids: Vec::new(),
        provision_states: all(input.provision_state),
        connectivity: all(input.connectivity),
        maintenance: input.maintenance,
        cordoned: input.cordoned,
        roles: all(input.role),
        trusts: all(input.trust),
        site_ids: ids(input.site_id, SiteId::parse)?,
        pool_ids: ids(input.pool_id, PoolId::parse)?,
        labels: input
            .labels
            .unwrap_or_default()
            .into_iter()
            .map(|l| LabelSelector {
                key: l.key,
                value: l.value,
            })
            .collect(),
        reasons: input.reason.unwrap_or_default(),
        buckets: all(input.bucket),
        schedulable: input.schedulable,
        hostname_contains: input.hostname.filter(|h| !h.is_empty()),
        gateway_ids: input.gateway_id.unwrap_or_default(),
        owner: None,
        include_deleted: false,
    })
}

/// Maps the GraphQL event filter onto the storage filter, validating ids, actors and times.
pub(crate) fn event_filter(input: EventFilterInput) -> Result<EventFilter, ApiError> {
    let since = input.since.map(|t| t.value()).transpose()?;
    let until = input.until.map(|t| t.value()).transpose()?;
    if let (Some(since), Some(until)) = (since, until)
        && since > until
    {
        return Err(Field::argument("filter")
            .at("since")
            .refuse("is after `until`"));
    }
    Ok(EventFilter {
        node_ids: input
            .node_ids
            .unwrap_or_default()
            .iter()
            .map(|id| parse_id(id, NodeId::parse))
            .collect::<Result<_, _>>()?,
        types: input
            .types
            .unwrap_or_default()
            .into_iter()
            .map(Into::into)
            .collect(),
        actors: input
            .actors
            .unwrap_or_default()
            .iter()
            .map(|a| {
                bc_core::Actor::parse(a)
                    .ok_or_else(|| ApiError::BadUserInput(format!("`{a}` is not an actor")))
            })
            .collect::<Result<_, _>>()?,
        since,
        until,
        tenant: None,
    })
}
