//! Placement's background work: the retry loop that places pending reservations when
//! capacity may have grown, and the expiry tick.
//!
//! The retry loop is event-driven: it follows the live event feed (which carries every
//! replica's commits) and, for each event that may free capacity
//! ([`bc_core::placement::may_free_capacity`]), asks for a retry of the pool concerned. Pools
//! asked for within [`RETRY_BATCH_WINDOW`] are retried together, each once. At rest, a fleet
//! with pending reservations costs nothing but a [`SAFETY_SWEEP`] pass, a safety net for
//! anything the feed did not say. A retry that fails (a database error) is asked for again
//! after [`FAILED_RETRY_BACKOFF`], doubled for each failure in a row up to the sweep, so a
//! transient error delays a placement by about a second and a lasting one costs a try a
//! minute.

use bc_core::Actor;
use bc_core::event::RecordedEvent;
use bc_core::ids::PoolId;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

use crate::error::ApiError;
use crate::feed::Feed;
use crate::service::Services;

/// The controller's name: events say `controller:placement`.
pub const ACTOR: &str = "placement";
/// Requests arriving within this window after the first are served by one pass: a burst of
/// node events (a rack reconnecting) costs one retry per pool, not one per event.
pub const RETRY_BATCH_WINDOW: Duration = Duration::from_millis(50);
/// Every pool with pending reservations is retried at least this often, whatever the feed
/// says.
pub const SAFETY_SWEEP: Duration = Duration::from_secs(60);
/// How long a follower of the feed (this retry loop, and the Lifecycle pass's wakes in
/// `controllers::spawn`) waits before following it again after it failed.
pub(crate) const FEED_RETRY: Duration = Duration::from_secs(1);
/// How long the loop first waits before it retries pools whose retry failed (a busy or lost
/// database): long enough not to spin on a database that is down, short enough that an
/// operator does not notice. Each failure in a row doubles it, up to [`SAFETY_SWEEP`].
pub const FAILED_RETRY_BACKOFF: Duration = Duration::from_secs(1);

/// What one expiry tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementTickReport {
    /// Reservations ended by their expiry (placed ones released, pending ones failed).
    pub expired: usize,
}

/// The time-driven half of placement: expiry. Run by the controller loop.
pub struct PlacementController {
    services: Services,
    actor: Actor,
}

impl PlacementController {
    pub fn new(services: Services) -> Self {
        PlacementController {
            services,
            actor: Actor::Controller(ACTOR.to_owned()),
        }
    }

    /// One pass: ends the reservations whose expiry passed.
    pub async fn tick(&mut self) -> Result<PlacementTickReport, ApiError> {
        Ok(PlacementTickReport {
            expired: self.services.expire_reservations(&self.actor).await?,
        })
    }
}

/// Asks for the retry an event calls for, if it may free capacity: of the pool in its data
/// (placement events), else of its node's pool.
fn request_retry(services: &Services, event: &RecordedEvent) {
    if !bc_core::placement::may_free_capacity(event.event_type) {
        return;
    }
    let pool = event
        .data
        .get("poolId")
        .and_then(serde_json::Value::as_str)
        .and_then(|p| PoolId::parse(p).ok());
    match (pool, &event.node_id) {
        (Some(pool), _) => services.placement_retry.request(&pool),
        (None, Some(node)) => services.placement_retry.request_for_node(node),
        (None, None) => {}
    }
}

/// Retries the pending reservations of every pool asked for, once each. What failed is asked
/// for again; returns whether anything failed, so the loop backs off before that retry.
async fn retry_requested(services: &Services, actor: &Actor) -> bool {
    let asked = services.placement_retry.take();
    let pools = match services.pools_to_retry(&asked).await {
        Ok(pools) => pools,
        Err(err) => {
            tracing::warn!(code = err.code(), message = %err.message(), "finding the pools to retry failed");
            services.placement_retry.request_again(asked);
            return true;
        }
    };
    let mut failed = false;
    for pool in pools {
        match services.place_pending(&pool, actor).await {
            Ok(report) => {
                if report.placed > 0 {
                    tracing::debug!(%pool, ?report, "placed pending reservations");
                }
                if report.retry {
                    services.placement_retry.request(&pool);
                }
            }
            Err(err) => {
                tracing::warn!(%pool, code = err.code(), message = %err.message(), "retrying pending reservations failed");
                services.placement_retry.request(&pool);
                failed = true;
            }
        }
    }
    failed
}

/// Asks for a retry of every pool with pending reservations.
async fn request_all(services: &Services) {
    match services.pools_with_pending().await {
        Ok(pools) => pools
            .iter()
            .for_each(|pool| services.placement_retry.request(pool)),
        Err(err) => {
            tracing::warn!(code = err.code(), message = %err.message(), "listing pools with pending reservations failed");
        }
    }
}

/// Starts the retry loop; it ends when the feed stops (server shutdown).
pub fn spawn_retry_loop(services: Services, feed: Arc<Feed>) -> JoinHandle<()> {
    let actor = Actor::Controller(ACTOR.to_owned());
    let retries = tokio::spawn({
        let services = services.clone();
        let actor = actor.clone();
        async move {
            let mut backoff = FAILED_RETRY_BACKOFF;
            let mut sweep = tokio::time::interval(SAFETY_SWEEP);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    // The first tick is immediate: pending work left by a previous run is
                    // retried at start.
                    _ = sweep.tick() => request_all(&services).await,
                    () = services.placement_retry.requested() => {
                        tokio::time::sleep(RETRY_BATCH_WINDOW).await;
                    }
                }
                // Failures in a row double the pause, up to the sweep: a transient error
                // costs a second, a pool that keeps failing one try a minute.
                if retry_requested(&services, &actor).await {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(SAFETY_SWEEP);
                } else {
                    backoff = FAILED_RETRY_BACKOFF;
                }
            }
        }
    });
    // The feed's head now, not read later in the task: every event committed after this
    // function returns is followed, even if the task first runs after a request's commit.
    let mut start = feed.head();
    tokio::spawn(async move {
        loop {
            let events = feed.subscribe_events(services.clone(), start);
            tokio::pin!(events);
            let mut failed = false;
            while let Some(item) = events.next().await {
                match item {
                    Ok(event) => {
                        start = event.id.0;
                        request_retry(&services, &event);
                    }
                    Err(err) => {
                        // Fell behind the feed, or could not read it: resumed from the last
                        // event seen, after a full sweep in case the feed stays unreadable.
                        tracing::debug!(code = err.code(), "the placement loop resumes the feed");
                        request_all(&services).await;
                        failed = true;
                        break;
                    }
                }
            }
            if !failed {
                // The feed ended: the server is stopping.
                retries.abort();
                return;
            }
            tokio::time::sleep(FEED_RETRY).await;
        }
    })
}
