//! The fleet brake in the API: `livenessBrakes` lists the sites whose brake tripped, and
//! `releaseLivenessBrake` lets an admin release one (`bc_core::brake` for the episodes,
//! `controllers::liveness` for when a brake trips). Resolvers parse, call one service
//! function, and wrap the result.

use async_graphql::{Context, Enum, ID, InputObject, Object, SimpleObject};
use bc_core::brake::LivenessBrake as DomainBrake;
use bc_core::ids::SiteId;
use chrono::{DateTime, Utc};

use super::input_limits::{Field, Text, Validate, Validated};
use super::{parse_id, principal, services};
use crate::error::ApiError;

/// Where a site's brake episode is.
#[derive(Enum, Copy, Clone, Eq, PartialEq, Debug)]
#[graphql(remote = "bc_core::brake::BrakeStatus")]
pub enum BrakeStatus {
    /// Liveness marks none of the site's nodes `unreachable` or `lost`.
    Paused,
    /// An admin released the brake: the site's silent nodes are marked down after all, until
    /// the episode ends.
    Released,
}

/// The API's view of a stored brake ([`DomainBrake`]).
pub struct LivenessBrake(pub DomainBrake);

/// A site whose fleet brake tripped: too many of its nodes went silent at once, so Liveness
/// stopped marking them down. Listed until the first Liveness pass where the site no longer
/// crosses the rule (`liveness.brake_share` of its watched nodes).
#[Object]
impl LivenessBrake {
    /// The site (`site_…`).
    async fn site_id(&self) -> ID {
        ID(self.0.site_id.to_string())
    }

    /// `PAUSED` until an admin releases it, then `RELEASED`.
    async fn status(&self) -> BrakeStatus {
        self.0.status.into()
    }

    /// Nodes that had gone silent (no heartbeat for the grace) when it tripped.
    async fn silent(&self) -> u64 {
        self.0.tripped_with.silent
    }

    /// Nodes that had become `unreachable` within the brake's window when it tripped.
    async fn recently_unreachable(&self) -> u64 {
        self.0.tripped_with.recently_unreachable
    }

    /// Nodes Liveness watched in the site when it tripped.
    async fn watched(&self) -> u64 {
        self.0.tripped_with.watched
    }

    /// When it tripped.
    async fn tripped_at(&self) -> DateTime<Utc> {
        self.0.tripped_at
    }

    /// Who released it (`user:<subject>`); `null` while paused.
    async fn released_by(&self) -> Option<&str> {
        self.0.release.as_ref().map(|r| r.by.as_str())
    }

    /// Why it was released.
    async fn release_reason(&self) -> Option<&str> {
        self.0.release.as_ref().map(|r| r.reason.as_str())
    }

    /// When it was released.
    async fn released_at(&self) -> Option<DateTime<Utc>> {
        self.0.release.as_ref().map(|r| r.at)
    }
}

/// What `releaseLivenessBrake` needs.
#[derive(InputObject)]
pub struct ReleaseLivenessBrakeInput {
    /// The site whose brake to release (`site_…`).
    pub site_id: ID,
    /// Why its silent nodes should be marked down after all (a rack that lost power, a
    /// network that will not come back soon): kept with the release and its event. Required.
    pub reason: String,
}

impl Validate for ReleaseLivenessBrakeInput {
    fn validate(&self, at: &Field) -> Result<(), ApiError> {
        let ReleaseLivenessBrakeInput { site_id, reason } = self;
        at.at("siteId").id(site_id)?;
        at.at("reason").text(reason, Text::Reason)
    }
}

/// What `releaseLivenessBrake` answers.
#[derive(SimpleObject)]
pub struct ReleaseLivenessBrakePayload {
    /// The brake, now `RELEASED`.
    pub brake: LivenessBrake,
}

#[derive(Default)]
pub struct BrakeQuery;

#[Object]
impl BrakeQuery {
    /// The sites whose fleet brake tripped (paused, or released and not over yet), by site
    /// id; a tenant's token sees only its own sites'.
    async fn liveness_brakes(
        &self,
        ctx: &Context<'_>,
    ) -> async_graphql::Result<Vec<LivenessBrake>> {
        let brakes = services(ctx)?
            .visible_liveness_brakes(principal(ctx)?)
            .await?;
        Ok(brakes.into_iter().map(LivenessBrake).collect())
    }
}

#[derive(Default)]
pub struct BrakeMutation;

#[Object]
impl BrakeMutation {
    /// Releases a site's fleet brake (admins who may see the site): Liveness then marks its
    /// silent nodes `unreachable` and `lost` as usual, and the same silence does not trip the
    /// brake again. `NOT_FOUND` when the site's liveness is not paused.
    async fn release_liveness_brake(
        &self,
        ctx: &Context<'_>,
        #[graphql(desc = "The site and why.")] input: Validated<ReleaseLivenessBrakeInput>,
    ) -> async_graphql::Result<ReleaseLivenessBrakePayload> {
        let input = input.check("input")?;
        let site = parse_id(&input.site_id, SiteId::parse)?;
        let brake = services(ctx)?
            .release_liveness_brake(principal(ctx)?, &site, &input.reason)
            .await?;
        Ok(ReleaseLivenessBrakePayload {
            brake: LivenessBrake(brake),
        })
    }
}
