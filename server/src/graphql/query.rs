//! Queries.

use async_graphql::connection::{Connection, Edge};
use async_graphql::{Context, ID, Object};
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::provision::{PROVISION_STATE_TABLE, Target};
use strum::IntoEnumIterator;

use super::input_limits::{Field, MAX_FILTER_VALUES, Validated};
use super::inputs::{CommandFilterInput, NodeFilterInput};
use super::types::{
    CapacityCount, JoinToken, NodeDetail, Pool, PoolCapacity, ProvisionEdge, Site, Tenant, Viewer,
};
use super::types::{Command, CommandConnection};
use super::{page_size, parse_id, principal, services};
use crate::error::ApiError;
use crate::service::CommandFilter;
use crate::service::Services;
use crate::service::{LabelSelector, NodeFilter};

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

#[Object]
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
    async fn node(&self, ctx: &Context<'_>, id: ID) -> async_graphql::Result<NodeDetail> {
        let id = parse_id(&id, NodeId::parse)?;
        Ok(NodeDetail(services(ctx)?.node(principal(ctx)?, &id).await?))
    }

    /// Nodes, ordered by id, filtered.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn nodes(
        &self,
        ctx: &Context<'_>,
        filter: Option<Validated<NodeFilterInput>>,
        first: Option<i32>,
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
            .nodes(principal(ctx)?, filter.clone(), after.as_deref(), first)
            .await?;
        let mut connection = Connection::with_additional_fields(
            after.is_some(),
            page.has_next_page,
            NodeListFields { filter },
        );
        connection.edges.extend(
            page.nodes
                .into_iter()
                .map(|n| Edge::new(n.record.id.to_string(), NodeDetail(n))),
        );
        Ok(connection)
    }

    /// Capacity of each pool by bucket (all visible pools, or those named).
    async fn capacity(
        &self,
        ctx: &Context<'_>,
        pool_ids: Option<Vec<ID>>,
    ) -> async_graphql::Result<Vec<PoolCapacity>> {
        Field::argument("poolIds").list_opt(pool_ids.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        let services: &Services = services(ctx)?;
        let p = principal(ctx)?;
        let wanted = pool_ids
            .unwrap_or_default()
            .iter()
            .map(|id| parse_id(id, PoolId::parse))
            .collect::<Result<Vec<_>, _>>()?;
        let pools = services.pools(p, None).await?;
        let rows = services.capacity(p, &wanted).await?;
        Ok(pools
            .into_iter()
            .filter(|pool| wanted.is_empty() || wanted.contains(&pool.id))
            .map(|pool| {
                let pool_id = pool.id.to_string();
                let buckets: Vec<CapacityCount> = bc_core::schedule::CapacityBucket::iter()
                    .map(|bucket| {
                        let row = rows
                            .iter()
                            .find(|r| r.pool_id == pool_id && r.bucket == bucket);
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
                    pool_id: ID(pool_id),
                    buckets,
                }
            })
            .collect())
    }

    /// One command.
    async fn command(&self, ctx: &Context<'_>, id: ID) -> async_graphql::Result<Command> {
        let id = parse_id(&id, bc_core::ids::CommandId::parse)?;
        Ok(Command(services(ctx)?.command(principal(ctx)?, &id).await?))
    }

    /// Commands, newest first.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn commands(
        &self,
        ctx: &Context<'_>,
        filter: Option<Validated<CommandFilterInput>>,
        first: Option<i32>,
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
    async fn join_tokens(&self, ctx: &Context<'_>) -> async_graphql::Result<Vec<JoinToken>> {
        Ok(services(ctx)?
            .join_tokens(principal(ctx)?)
            .await?
            .into_iter()
            .map(Into::into)
            .collect())
    }

    async fn tenants(&self, ctx: &Context<'_>) -> async_graphql::Result<Vec<Tenant>> {
        Ok(services(ctx)?
            .tenants(principal(ctx)?)
            .await?
            .into_iter()
            .map(Into::into)
            .collect())
    }

    async fn sites(&self, ctx: &Context<'_>) -> async_graphql::Result<Vec<Site>> {
        Ok(services(ctx)?
            .sites(principal(ctx)?)
            .await?
            .into_iter()
            .map(Into::into)
            .collect())
    }

    async fn pools(
        &self,
        ctx: &Context<'_>,
        site_id: Option<ID>,
    ) -> async_graphql::Result<Vec<Pool>> {
        let site_id = site_id
            .as_ref()
            .map(|s| parse_id(s, SiteId::parse))
            .transpose()?;
        Ok(services(ctx)?
            .pools(principal(ctx)?, site_id.as_ref())
            .await?
            .into_iter()
            .map(Into::into)
            .collect())
    }

    /// `provisionStateTable`: every legal move, where it may start and where it leads.
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
        .commands(principal(ctx)?, filter, after.as_deref(), first)
        .await?;
    let mut connection = CommandConnection::new(after.is_some(), more);
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
        owner: None,
        include_deleted: false,
    })
}
