//! Placement in the API: reservations, their allocations, pool offers, and the
//! `reservationUpdates` subscription. Resolvers parse, call one service function, and wrap
//! the domain value; every rule lives in `service::placement` and `bc_core::placement`.

use async_graphql::connection::{Connection, Edge};
use async_graphql::{
    ComplexObject, Context, Enum, ID, InputObject, Object, SimpleObject, Subscription,
};
use bc_core::ids::{NodeId, PoolId, ReservationId, TenantId};
use bc_core::placement::{LabelRequirement as DomainLabelRequirement, Shape};
use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use std::sync::Arc;

use super::input_limits::{
    Field, MAX_FILTER_VALUES, Text, Timestamp, VERSION, Validate, Validated,
};
use super::inputs::LabelSelectorInput;
use super::subscription::{start_cursor, until_expiry, visible};
use super::types::{Pool, PoolCapacity};
use super::{page_size, parse_id, principal, services};
use crate::error::ApiError;
use crate::feed::Feed;

type Checked = Result<(), ApiError>;
use crate::service::ReservationFilter;
use crate::service::placement::ReservationRequest;

/// Where a reservation is in its life.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::placement::ReservationState")]
pub enum ReservationState {
    /// Waiting for capacity; `reason` says what is missing. Retried when capacity changes.
    Pending,
    /// Every node of the gang is booked.
    Placed,
    /// Released by its owner, or expired after it was placed. Final.
    Released,
    /// Can never be placed, or expired while pending. Final; `reason` says why.
    Failed,
}

/// How the placer picks among nodes that fit.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::placement::PlacementPolicy")]
pub enum PlacementPolicy {
    /// Fullest node first: keeps whole nodes free for large shapes. The default.
    BinPack,
    /// Emptiest node first: spreads work to limit the blast radius of one node.
    Spread,
}

/// A label a node must carry to take the reservation.
#[derive(SimpleObject)]
pub struct LabelRequirement {
    /// The label's key.
    pub key: String,
    /// The value it must have; `null`: any value.
    pub value: Option<String>,
}

pub struct Reservation(pub bc_core::placement::Reservation);

/// A request for GPUs: `nodeCount` nodes of one pool with `gpusPerNode` free GPUs each, booked
/// all together (a gang) or not at all.
#[Object]
impl Reservation {
    /// `rsv_…`.
    async fn id(&self) -> ID {
        ID(self.0.id.to_string())
    }
    /// The tenant the GPUs are for.
    async fn tenant_id(&self) -> ID {
        ID(self.0.tenant_id.to_string())
    }
    /// The pool the nodes come from.
    async fn pool_id(&self) -> ID {
        ID(self.0.pool_id.to_string())
    }
    /// Free GPUs wanted on each node.
    async fn gpus_per_node(&self) -> u32 {
        self.0.shape.gpus_per_node
    }
    /// Nodes in the gang.
    async fn node_count(&self) -> u32 {
        self.0.shape.node_count
    }
    /// Only GPUs of this model count; `null`: any model.
    async fn gpu_model(&self) -> Option<&str> {
        self.0.shape.gpu_model.as_deref()
    }
    /// Labels every booked node carries.
    async fn selector(&self) -> Vec<LabelRequirement> {
        self.0
            .shape
            .selector
            .iter()
            .map(|r| LabelRequirement {
                key: r.key.clone(),
                value: r.value.clone(),
            })
            .collect()
    }
    /// Keys of `NoSchedule`/`NoExecute` taints the work tolerates.
    async fn tolerations(&self) -> &[String] {
        &self.0.shape.tolerations
    }
    /// How the placer picks among nodes that fit.
    async fn policy(&self) -> PlacementPolicy {
        self.0.policy.into()
    }
    /// Where the reservation is in its life.
    async fn state(&self) -> ReservationState {
        self.0.state.into()
    }
    /// Why it is PENDING (what capacity is missing, counted by capacity bucket), FAILED or
    /// RELEASED.
    async fn reason(&self) -> Option<&str> {
        self.0.reason.as_deref()
    }
    /// The key a retried create is matched by, if the client gave one.
    async fn idempotency_key(&self) -> Option<&str> {
        self.0.idempotency_key.as_deref()
    }
    /// When it ends by itself (placed: released; pending: failed); `null`: never.
    async fn expires_at(&self) -> Option<DateTime<Utc>> {
        self.0.expires_at
    }
    /// Optimistic concurrency: pass it to `releaseReservation`.
    async fn version(&self) -> i64 {
        self.0.version
    }
    /// Who created it (`user:<subject>`).
    async fn created_by(&self) -> String {
        self.0.created_by.to_string()
    }
    /// When it was created.
    async fn created_at(&self) -> DateTime<Utc> {
        self.0.created_at
    }
    /// When it last changed.
    async fn updated_at(&self) -> DateTime<Utc> {
        self.0.updated_at
    }
    /// Its allocations: the active ones first, then those released (newest first).
    async fn allocations(&self, ctx: &Context<'_>) -> async_graphql::Result<Vec<Allocation>> {
        Ok(services(ctx)?
            .reservation_allocations(&self.0.id)
            .await?
            .into_iter()
            .map(Allocation)
            .collect())
    }
}

pub struct Allocation(pub bc_core::placement::Allocation);

/// Atoms (whole GPUs today) of one node booked for one reservation.
#[Object]
impl Allocation {
    /// `alloc_…`.
    async fn id(&self) -> ID {
        ID(self.0.id.to_string())
    }
    /// The reservation it belongs to.
    async fn reservation_id(&self) -> ID {
        ID(self.0.reservation_id.to_string())
    }
    /// The tenant it is for.
    async fn tenant_id(&self) -> ID {
        ID(self.0.tenant_id.to_string())
    }
    /// The node whose atoms are booked.
    async fn node_id(&self) -> ID {
        ID(self.0.node_id.to_string())
    }
    /// The booked atoms, in device order (`gpu0/whole`, …).
    async fn atoms(&self) -> &[String] {
        &self.0.atoms
    }
    /// How many GPUs it books.
    async fn gpus(&self) -> usize {
        self.0.atoms.len()
    }
    /// Whether it still holds its atoms.
    async fn active(&self) -> bool {
        self.0.is_active()
    }
    /// When the atoms were booked.
    async fn booked_at(&self) -> DateTime<Utc> {
        self.0.booked_at
    }
    /// When it ended; `null` while active.
    async fn released_at(&self) -> Option<DateTime<Utc>> {
        self.0.released_at
    }
    /// Why it ended: its reservation was released or expired, or it was evicted (and why).
    async fn release_reason(&self) -> Option<&str> {
        self.0.release_reason.as_deref()
    }
}

/// Allocated and free GPUs of a pool's schedulable nodes, for one GPU model.
#[derive(SimpleObject)]
pub struct ModelCapacity {
    /// The GPU model, as the inventory reports it.
    pub model: String,
    /// GPUs booked by allocations.
    pub allocated: i64,
    /// GPUs a reservation could book now.
    pub free: i64,
}

#[ComplexObject]
impl PoolCapacity {
    /// The `SCHEDULABLE` bucket's GPUs by model: how many are booked and how many are free.
    async fn schedulable_by_model(
        &self,
        ctx: &Context<'_>,
    ) -> async_graphql::Result<Vec<ModelCapacity>> {
        Ok(services(ctx)?
            .schedulable_by_model(&[self.pool_id.to_string()])
            .await?
            .into_iter()
            .map(|m| ModelCapacity {
                model: m.model,
                allocated: m.allocated,
                free: m.free,
            })
            .collect())
    }
    /// GPUs of schedulable nodes booked by allocations.
    async fn allocated_gpus(&self, ctx: &Context<'_>) -> async_graphql::Result<i64> {
        Ok(self
            .schedulable_by_model(ctx)
            .await?
            .iter()
            .map(|m| m.allocated)
            .sum())
    }
    /// GPUs of schedulable nodes a reservation could book now.
    async fn free_gpus(&self, ctx: &Context<'_>) -> async_graphql::Result<i64> {
        Ok(self
            .schedulable_by_model(ctx)
            .await?
            .iter()
            .map(|m| m.free)
            .sum())
    }
}

/// The active allocations on a node, for `NodeDetail.allocations`.
pub(super) async fn node_allocations(
    ctx: &Context<'_>,
    node: &NodeId,
) -> async_graphql::Result<Vec<Allocation>> {
    Ok(services(ctx)?
        .node_allocations(principal(ctx)?, node)
        .await?
        .into_iter()
        .map(Allocation)
        .collect())
}

/// What `createReservation` asks for: a pool, the shape (GPUs per node, nodes in the gang,
/// model, labels, tolerations), the placement policy, and optionally an idempotency key and an
/// expiry.
#[derive(InputObject)]
pub struct CreateReservationInput {
    /// The tenant the GPUs are for: a tenant token's own (may be omitted); a platform
    /// principal must name one.
    pub tenant_id: Option<ID>,
    /// The pool the nodes come from: the tenant's own, or one offered to it.
    pub pool_id: ID,
    /// Free GPUs wanted on each node (1–64).
    pub gpus_per_node: i64,
    /// Nodes in the gang (1–1024), booked all together or not at all.
    #[graphql(default = 1)]
    pub node_count: i64,
    /// Only GPUs of this model count.
    pub gpu_model: Option<String>,
    /// Labels every booked node must carry.
    pub selector: Option<Vec<LabelSelectorInput>>,
    /// Keys of `NoSchedule`/`NoExecute` taints the work tolerates.
    pub tolerations: Option<Vec<String>>,
    /// How the placer picks among nodes that fit.
    #[graphql(default_with = "PlacementPolicy::BinPack")]
    pub policy: PlacementPolicy,
    /// A retried create with the same key returns the first reservation.
    pub idempotency_key: Option<String>,
    /// When it ends by itself: placed, it is released; still pending, it fails.
    pub expires_at: Option<Timestamp>,
}

impl Validate for CreateReservationInput {
    fn validate(&self, at: &Field) -> Checked {
        let CreateReservationInput {
            tenant_id,
            pool_id,
            gpus_per_node,
            node_count,
            gpu_model,
            selector,
            tolerations,
            policy: _,
            idempotency_key,
            expires_at,
        } = self;
        tenant_id
            .as_ref()
            .map_or(Ok(()), |t| at.at("tenantId").id(t))?;
        at.at("poolId").id(pool_id)?;
        at.at("gpusPerNode").int(
            *gpus_per_node,
            1..=i64::from(bc_core::placement::MAX_GPUS_PER_NODE),
        )?;
        at.at("nodeCount").int(
            *node_count,
            1..=i64::from(bc_core::placement::MAX_NODE_COUNT),
        )?;
        at.at("gpuModel")
            .text_opt(gpu_model.as_deref(), Text::GpuModel)?;
        at.at("selector").list_opt(
            selector.as_deref(),
            bc_core::placement::MAX_SELECTOR_TERMS,
            Field::object,
        )?;
        at.at("tolerations").list_opt(
            tolerations.as_deref(),
            bc_core::placement::MAX_SELECTOR_TERMS,
            |f, key| f.text(key, Text::LabelKeyFilter),
        )?;
        at.at("idempotencyKey")
            .text_opt(idempotency_key.as_deref(), Text::Id)?;
        at.at("expiresAt").time(expires_at.as_ref())
    }
}

/// Which reservation to release, at the version read.
#[derive(InputObject)]
pub struct ReleaseReservationInput {
    /// `rsv_…`.
    pub id: ID,
    /// The `version` you read; a reservation that moved since is `CONFLICT`.
    pub version: i64,
}

impl Validate for ReleaseReservationInput {
    fn validate(&self, at: &Field) -> Checked {
        let ReleaseReservationInput { id, version } = self;
        at.at("id").id(id)?;
        at.at("version").int(*version, VERSION)
    }
}

/// Which pool to offer to which tenant.
#[derive(InputObject)]
pub struct OfferPoolInput {
    /// A platform pool.
    pub pool_id: ID,
    /// The tenant that may reserve in it from now on.
    pub tenant_id: ID,
}

impl Validate for OfferPoolInput {
    fn validate(&self, at: &Field) -> Checked {
        let OfferPoolInput { pool_id, tenant_id } = self;
        at.at("poolId").id(pool_id)?;
        at.at("tenantId").id(tenant_id)
    }
}

/// Which reservations to list. Values within one field are alternatives; fields must all
/// hold.
#[derive(InputObject, Default)]
pub struct ReservationFilterInput {
    /// Reservations in these pools.
    pub pool_ids: Option<Vec<ID>>,
    /// Reservations in these states.
    pub states: Option<Vec<ReservationState>>,
}

impl Validate for ReservationFilterInput {
    fn validate(&self, at: &Field) -> Checked {
        let ReservationFilterInput { pool_ids, states } = self;
        at.at("poolIds")
            .list_opt(pool_ids.as_deref(), MAX_FILTER_VALUES, Field::id)?;
        at.at("states")
            .bounded(states.as_deref(), MAX_FILTER_VALUES)
    }
}

/// The answer to `createReservation`.
#[derive(SimpleObject)]
pub struct CreateReservationPayload {
    /// The reservation: PLACED if it fit at once, else PENDING with the reason.
    pub reservation: Reservation,
}

/// The answer to `releaseReservation`.
#[derive(SimpleObject)]
pub struct ReleaseReservationPayload {
    /// The reservation, RELEASED.
    pub reservation: Reservation,
}

/// The answer to `offerPool`.
#[derive(SimpleObject)]
pub struct OfferPoolPayload {
    /// The pool offered.
    pub pool: Pool,
    /// The tenant it is offered to.
    pub tenant_id: ID,
}

/// Extra fields of the reservation list.
pub struct ReservationListFields {
    filter: ReservationFilter,
}

#[Object]
impl ReservationListFields {
    /// How many reservations match the filter, across all pages.
    async fn total_count(&self, ctx: &Context<'_>) -> async_graphql::Result<u64> {
        Ok(services(ctx)?
            .count_reservations(principal(ctx)?, self.filter.clone())
            .await?)
    }
}

/// A page of reservations, newest first.
pub type ReservationConnection = Connection<String, Reservation, ReservationListFields>;

#[derive(Default)]
pub struct PlacementQuery;

#[Object]
impl PlacementQuery {
    /// One reservation.
    async fn reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The reservation's id (`rsv_…`).")] id: ID,
    ) -> async_graphql::Result<Reservation> {
        let id = parse_id(&id, ReservationId::parse)?;
        Ok(Reservation(
            services(ctx)?.reservation(principal(ctx)?, &id).await?,
        ))
    }

    /// Reservations, newest first, filtered.
    #[graphql(complexity = "first.unwrap_or(100).max(1) as usize * child_complexity")]
    async fn reservations(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Which reservations; omit for every one visible.")] filter: Option<
            Validated<ReservationFilterInput>,
        >,
        #[graphql(
            desc = "How many to return (default `graphql.default_page_size`, 100; at most `graphql.max_page_size`, 1000)."
        )]
        first: Option<i32>,
        #[graphql(desc = "The `endCursor` of the previous page; omit for the first page.")]
        after: Option<String>,
    ) -> async_graphql::Result<ReservationConnection> {
        let input = filter
            .map(|f| f.check("filter"))
            .transpose()?
            .unwrap_or_default();
        Field::argument("after").text_opt(after.as_deref(), Text::Id)?;
        let filter = ReservationFilter {
            tenant: None,
            pool_ids: input
                .pool_ids
                .unwrap_or_default()
                .iter()
                .map(|p| parse_id(p, PoolId::parse))
                .collect::<Result<_, _>>()?,
            states: input
                .states
                .unwrap_or_default()
                .into_iter()
                .map(Into::into)
                .collect(),
        };
        let first = page_size(ctx, first)?;
        let page = services(ctx)?
            .reservations(principal(ctx)?, filter.clone(), after.as_deref(), first)
            .await?;
        let mut connection = Connection::with_additional_fields(
            after.is_some(),
            page.has_next_page,
            ReservationListFields { filter },
        );
        connection.edges.extend(
            page.reservations
                .into_iter()
                .map(|r| Edge::new(r.id.to_string(), Reservation(r))),
        );
        Ok(connection)
    }
}

#[derive(Default)]
pub struct PlacementMutation;

#[Object]
impl PlacementMutation {
    /// Asks for GPUs. Placed at once if the gang fits (bin-packing by default), else PENDING
    /// with the reason and retried whenever capacity may have grown. A shape larger than any
    /// node of the pool is `BAD_USER_INPUT`; a pool the tenant may not use is `NOT_FOUND`.
    async fn create_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The pool, the shape and how to place it.")] input: Validated<
            CreateReservationInput,
        >,
    ) -> async_graphql::Result<CreateReservationPayload> {
        let input = input.check("input")?;
        let pool_id = parse_id(&input.pool_id, PoolId::parse)?;
        let tenant_id = input
            .tenant_id
            .as_ref()
            .map(|t| parse_id(t, TenantId::parse))
            .transpose()?;
        let expires_at = input
            .expires_at
            .as_ref()
            .map(Timestamp::value)
            .transpose()?;
        let selector = input
            .selector
            .unwrap_or_default()
            .into_iter()
            .map(|s| DomainLabelRequirement {
                key: s.key,
                value: s.value,
            })
            .collect();
        let request = ReservationRequest {
            tenant_id,
            pool_id,
            shape: Shape {
                gpus_per_node: u32::try_from(input.gpus_per_node).unwrap_or(u32::MAX),
                node_count: u32::try_from(input.node_count).unwrap_or(u32::MAX),
                gpu_model: input.gpu_model,
                selector,
                tolerations: input.tolerations.unwrap_or_default(),
            },
            policy: input.policy.into(),
            idempotency_key: input.idempotency_key,
            expires_at,
        };
        let reservation = services(ctx)?
            .create_reservation(principal(ctx)?, request)
            .await?;
        Ok(CreateReservationPayload {
            reservation: Reservation(reservation),
        })
    }

    /// Releases a reservation: its atoms are free at once and it is RELEASED. A reservation
    /// that moved since `version` is `CONFLICT`; a released or failed one `INVALID_STATE`.
    async fn release_reservation(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The reservation and the version you read.")] input: Validated<
            ReleaseReservationInput,
        >,
    ) -> async_graphql::Result<ReleaseReservationPayload> {
        let input = input.check("input")?;
        let id = parse_id(&input.id, ReservationId::parse)?;
        let reservation = services(ctx)?
            .release_reservation(principal(ctx)?, &id, input.version)
            .await?;
        Ok(ReleaseReservationPayload {
            reservation: Reservation(reservation),
        })
    }

    /// Offers a platform pool to a tenant, which may then reserve in it (platform admins).
    /// Refused for a pool holding another tenant's `tenant-owned` node.
    async fn offer_pool(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The platform pool and the tenant.")] input: Validated<OfferPoolInput>,
    ) -> async_graphql::Result<OfferPoolPayload> {
        let input = input.check("input")?;
        let pool_id = parse_id(&input.pool_id, PoolId::parse)?;
        let tenant_id = parse_id(&input.tenant_id, TenantId::parse)?;
        let pool = services(ctx)?
            .offer_pool(principal(ctx)?, &pool_id, &tenant_id)
            .await?;
        Ok(OfferPoolPayload {
            pool: pool.into(),
            tenant_id: ID(tenant_id.to_string()),
        })
    }
}

/// A reservation moved or one of its allocations was booked or released, with the
/// reservation as it is now.
#[derive(SimpleObject)]
pub struct ReservationUpdate {
    /// Resume from here (`after`) to miss nothing.
    pub cursor: ID,
    /// The event: `reservation.created`, `reservation.placed`, `allocation.booked`, ….
    #[graphql(name = "type")]
    pub event_type: String,
    /// The state before (reservation moves) or the allocation released.
    pub from: Option<String>,
    /// The state after (reservation moves) or the allocation booked.
    pub to: Option<String>,
    /// The node, for allocation events.
    pub node_id: Option<ID>,
    /// When it happened.
    pub at: DateTime<Utc>,
    /// The reservation as it is now.
    pub reservation: Reservation,
}

#[derive(Default)]
pub struct PlacementSubscription;

#[Subscription]
impl PlacementSubscription {
    /// Reservation moves and allocation changes, for one reservation, one pool, or every
    /// reservation visible, from `after` (exclusive) or from now.
    async fn reservation_updates(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "Resume after this cursor (exclusive); omit to start from now.")]
        after: Option<ID>,
        #[graphql(desc = "Only this reservation's updates.")] reservation_id: Option<ID>,
        #[graphql(desc = "Only updates of reservations in this pool.")] pool_id: Option<ID>,
    ) -> async_graphql::Result<impl Stream<Item = async_graphql::Result<ReservationUpdate>>> {
        let services = services(ctx)?.clone();
        let principal = principal(ctx)?.clone();
        let feed = ctx.data::<Arc<Feed>>()?.clone();
        let reservation_id = reservation_id
            .map(|r| parse_id(&r, ReservationId::parse))
            .transpose()?;
        let pool_id = pool_id.map(|p| parse_id(&p, PoolId::parse)).transpose()?;
        let start = match start_cursor(after.as_ref())? {
            Some(start) => start,
            None => services.event_head().await?,
        };
        let expires_at = principal.expires_at;
        // Reservation updates carry the reservation, never a node: they follow the feed
        // without nodes, which costs it nothing to serve.
        let events = feed.subscribe_events(services.clone(), start);
        let stream = async_stream::stream! {
            tokio::pin!(events);
            while let Some(item) = events.next().await {
                let event = match item {
                    Ok(event) => event,
                    Err(err) => { yield Err(err.into()); return; }
                };
                let e = &*event;
                let spelling = e.event_type.as_static_str();
                let placement = spelling.starts_with("reservation.") || spelling.starts_with("allocation.");
                if !placement || !visible(&principal, e) {
                    continue;
                }
                let Some(id) = e.cause.as_deref().and_then(|c| ReservationId::parse(c).ok()) else { continue };
                if reservation_id.as_ref().is_some_and(|wanted| wanted != &id) {
                    continue;
                }
                let in_pool = e.data.get("poolId").and_then(serde_json::Value::as_str);
                if pool_id.as_ref().is_some_and(|wanted| in_pool != Some(wanted.as_str())) {
                    continue;
                }
                match services.reservation(&principal, &id).await {
                    Ok(reservation) => yield Ok(ReservationUpdate {
                        cursor: ID(e.id.to_string()),
                        event_type: spelling.to_owned(),
                        from: e.from.clone(),
                        to: e.to.clone(),
                        node_id: e.node_id.as_ref().map(|n| ID(n.to_string())),
                        at: e.at,
                        reservation: Reservation(reservation),
                    }),
                    Err(err) => { yield Err(err.into()); return; }
                }
            }
        };
        Ok(until_expiry(stream, expires_at))
    }
}
