//! The GraphQL API: thin resolvers over [`crate::service::Services`].
//!
//! Resolvers parse input, call one service function, and convert the result; errors are
//! [`crate::error::ApiError`]s with stable `extensions.code`s.

pub mod bare_metal;
pub mod brakes;
pub mod input_limits;
pub mod inputs;
pub mod limits;
pub mod mutation;
pub mod payloads;
pub mod placement;
pub mod query;
pub mod subscription;
pub mod types;

use async_graphql::{Context, Schema};
use std::sync::Arc;

use crate::auth::Principal;
use crate::config::GraphqlConfig;
use crate::error::ApiError;
use crate::service::Services;

pub type AppSchema = Schema<QueryRoot, MutationRoot, SubscriptionRoot>;

/// The query root: nodes, catalog and commands ([`query`]), placement ([`placement`]), bare
/// metal ([`bare_metal`]) and the fleet brake ([`brakes`]).
#[derive(async_graphql::MergedObject)]
#[graphql(name = "Query")]
pub struct QueryRoot(
    query::QueryRoot,
    placement::PlacementQuery,
    bare_metal::BareMetalQuery,
    brakes::BrakeQuery,
);

/// The mutation root: node, catalog and command changes ([`mutation`]), placement's, bare
/// metal's and the fleet brake's.
#[derive(async_graphql::MergedObject)]
#[graphql(name = "Mutation")]
pub struct MutationRoot(
    mutation::MutationRoot,
    placement::PlacementMutation,
    bare_metal::BareMetalMutation,
    brakes::BrakeMutation,
);

/// The subscription root: the event log, nodes and commands ([`subscription`]) and
/// placement's.
#[derive(async_graphql::MergedSubscription)]
#[graphql(name = "Subscription")]
pub struct SubscriptionRoot(
    subscription::SubscriptionRoot,
    placement::PlacementSubscription,
);

/// The schema with its limits and the services it resolves against.
pub fn build_schema(
    services: Option<(Services, Arc<crate::feed::Feed>)>,
    config: &GraphqlConfig,
) -> AppSchema {
    schema_builder(services, config).finish()
}

fn schema_builder(
    services: Option<(Services, Arc<crate::feed::Feed>)>,
    config: &GraphqlConfig,
) -> async_graphql::SchemaBuilder<QueryRoot, MutationRoot, SubscriptionRoot> {
    let mut builder = Schema::build(
        QueryRoot(
            query::QueryRoot,
            placement::PlacementQuery,
            bare_metal::BareMetalQuery,
            brakes::BrakeQuery,
        ),
        MutationRoot(
            mutation::MutationRoot,
            placement::PlacementMutation,
            bare_metal::BareMetalMutation,
            brakes::BrakeMutation,
        ),
        SubscriptionRoot(
            subscription::SubscriptionRoot,
            placement::PlacementSubscription,
        ),
    )
    // `limits::QueryLimits` holds plain fields to `max_depth` and introspection to its own,
    // deeper limit before validation; this is the backstop for both.
    .limit_depth(config.max_depth.max(config.introspection_max_depth))
    .limit_complexity(config.max_complexity)
    .extension(limits::QueryLimits::new(config))
    .extension(crate::telemetry::GraphqlMetrics)
    .extension(ErrorCodes)
    .data(config.clone());
    builder = describe_library_types(builder);
    if let Some((services, feed)) = services {
        builder = builder.data(services).data(feed);
    }
    builder
}

/// Descriptions for the types async-graphql defines, which it leaves undescribed (the
/// connections) or describes in its own terms ("Implement the DateTime<Utc> scalar"). The
/// schema documents itself for operators, and the schema linter holds every type to that.
fn describe_library_types(
    builder: async_graphql::SchemaBuilder<QueryRoot, MutationRoot, SubscriptionRoot>,
) -> async_graphql::SchemaBuilder<QueryRoot, MutationRoot, SubscriptionRoot> {
    builder
        .override_output_type_description::<chrono::DateTime<chrono::Utc>>(
            "A point in time: an RFC 3339 string, e.g. `2026-03-01T12:00:00Z`. The server \
             answers in UTC; inputs may carry any offset.",
        )
        .override_output_type_description::<async_graphql::Json<serde_json::Value>>(
            "Any JSON value: a command's parameters and result, an event's detail.",
        )
        .override_output_type_description::<query::NodeConnection>(
            "One page of nodes, with how many match across all pages.",
        )
        .override_output_type_description::<types::CommandConnection>(
            "One page of commands, newest first, with how many match across all pages.",
        )
        .override_output_type_description::<types::EventConnection>(
            "One page of a node's events, newest first.",
        )
        .override_output_type_description::<query::TenantConnection>(
            "One page of tenants by name, with how many there are across all pages.",
        )
        .override_output_type_description::<query::SiteConnection>(
            "One page of sites by name, with how many there are across all pages.",
        )
        .override_output_type_description::<query::PoolConnection>(
            "One page of pools by name, with how many match across all pages.",
        )
        .override_output_type_description::<query::PoolCapacityConnection>(
            "One page of pools' capacity, pools by name, with how many pools match across all \
             pages.",
        )
        .override_output_type_description::<query::JoinTokenConnection>(
            "One page of join tokens, newest first, with how many there are across all pages.",
        )
        .override_output_type_description::<placement::ReservationConnection>(
            "One page of reservations, newest first, with how many match across all pages.",
        )
}

/// The SDL of the schema: what `schema.graphql` holds.
pub fn sdl() -> String {
    build_schema(None, &GraphqlConfig::default()).sdl()
}

/// The authenticated caller, while its token lives. The HTTP layer refuses requests without
/// a valid token, so a missing principal here is a wiring fault, reported as
/// `UNAUTHENTICATED` all the same. A subscription socket keeps the principal it was opened
/// with, so the expiry is checked again here, on every operation, against the services'
/// clock.
pub(crate) fn principal<'a>(ctx: &'a Context<'_>) -> Result<&'a Principal, ApiError> {
    let principal = ctx
        .data_opt::<Principal>()
        .ok_or_else(|| ApiError::Unauthenticated("no credentials".into()))?;
    if let Some(services) = ctx.data_opt::<Services>() {
        principal.check_live(services.clock.now())?;
    }
    Ok(principal)
}

pub(crate) fn services<'a>(ctx: &'a Context<'_>) -> async_graphql::Result<&'a Services> {
    ctx.data::<Services>()
}

/// `first` checked against the configured limits.
pub(crate) fn page_size(ctx: &Context<'_>, first: Option<i32>) -> Result<u64, ApiError> {
    let config = ctx.data_opt::<GraphqlConfig>().cloned().unwrap_or_default();
    match first {
        None => Ok(config.default_page_size),
        Some(n) if n < 0 => Err(ApiError::BadUserInput(
            "`first` must not be negative".into(),
        )),
        Some(n) if n as u64 > config.max_page_size => Err(ApiError::BadUserInput(format!(
            "`first` must be at most {}",
            config.max_page_size
        ))),
        Some(n) => Ok(n as u64),
    }
}

/// Parses a prefixed id argument into a `BAD_USER_INPUT` on failure.
pub(crate) fn parse_id<T>(
    raw: &async_graphql::ID,
    parse: fn(&str) -> Result<T, bc_core::DomainError>,
) -> Result<T, ApiError> {
    parse(raw.as_str()).map_err(ApiError::from)
}

/// Gives every error a code. Our resolvers always set one; errors async-graphql raises itself
/// (a query that does not parse or validate, nests too deep, is too complex, or passes a value
/// of the wrong type) have none, and all of them are the caller's input: `BAD_USER_INPUT`.
pub struct ErrorCodes;

impl async_graphql::extensions::ExtensionFactory for ErrorCodes {
    fn create(&self) -> Arc<dyn async_graphql::extensions::Extension> {
        Arc::new(ErrorCodes)
    }
}

fn ensure_codes(response: &mut async_graphql::Response) {
    for error in &mut response.errors {
        input_limits::bound_message(&mut error.message);
        let extensions = error.extensions.get_or_insert_with(Default::default);
        if extensions.get("code").is_none() {
            extensions.set("code", "BAD_USER_INPUT");
        }
    }
}

#[async_trait::async_trait]
impl async_graphql::extensions::Extension for ErrorCodes {
    async fn request(
        &self,
        ctx: &async_graphql::extensions::ExtensionContext<'_>,
        next: async_graphql::extensions::NextRequest<'_>,
    ) -> async_graphql::Response {
        let mut response = next.run(ctx).await;
        ensure_codes(&mut response);
        response
    }

    fn subscribe<'s>(
        &self,
        ctx: &async_graphql::extensions::ExtensionContext<'_>,
        stream: futures::stream::BoxStream<'s, async_graphql::Response>,
        next: async_graphql::extensions::NextSubscribe<'_>,
    ) -> futures::stream::BoxStream<'s, async_graphql::Response> {
        use futures::StreamExt;
        next.run(ctx, stream)
            .map(|mut response| {
                ensure_codes(&mut response);
                response
            })
            .boxed()
    }
}
