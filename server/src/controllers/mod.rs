//! Controllers: loops that look at the fleet and change nodes when time alone makes a rule
//! true (a heartbeat that never came, a drain deadline that passed).
//!
//! A controller never writes a node itself. It finds candidates with one query per rule
//! (a `Services` read such as `silent_nodes`), then hands each to [`Services::apply_node_change`] with its own
//! actor and the `version` the query read: the row is locked, the domain transition applied,
//! `version` bumped and the events written in one transaction. A node that changed since the
//! query is `CONFLICT` and is simply looked at again on the next tick.
//!
//! Each controller has a `tick()` that does one pass and returns a report; [`spawn`] runs
//! them all every `liveness.tick_interval_secs` until stopped. Tests leave the loop off and
//! call `tick()` themselves with a `ManualClock`.

pub mod commands;
pub mod drain;
pub mod lifecycle;
pub mod liveness;

use bc_core::Actor;
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

pub use commands::{CommandTimingController, CommandTimingReport};
pub use drain::{DrainController, DrainReport};
pub use lifecycle::{LifecycleController, LifecycleReport};
pub use liveness::{LivenessController, LivenessReport};

use crate::config::LivenessConfig;
use crate::error::ApiError;
use crate::service::Services;
use crate::service::node_changes::NodeTransition;

/// What became of one node a controller tried to change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applied {
    /// The transition was written.
    Changed,
    /// The node no longer needed it (the closure found nothing to do).
    Unchanged,
    /// The node changed since the query (`CONFLICT`) or is gone (`NOT_FOUND`).
    Skipped,
    /// Anything else; logged at `warn`.
    Failed,
}

/// Applies one controller transition to one node, expecting the `version` the candidate
/// query read.
pub(crate) async fn apply<F>(
    services: &Services,
    actor: &Actor,
    id: &NodeId,
    version: i64,
    cause: &str,
    change: F,
) -> Applied
where
    F: NodeTransition,
{
    let everyone = |_: &NodeRecord| true;
    match services
        .apply_node_change(actor, id, Some(version), &everyone, cause, change)
        .await
    {
        Ok(after) if after.version > version => Applied::Changed,
        Ok(_) => Applied::Unchanged,
        Err(err @ (ApiError::Conflict { .. } | ApiError::NotFound(_))) => {
            tracing::debug!(node = %id, %actor, cause, code = err.code(), "node changed under the controller; trying again next tick");
            Applied::Skipped
        }
        Err(ApiError::Internal(err)) => {
            tracing::warn!(node = %id, %actor, cause, error = ?err, "a controller could not change a node");
            Applied::Failed
        }
        Err(err) => {
            tracing::warn!(node = %id, %actor, cause, code = err.code(), message = %err.message(), "a controller could not change a node");
            Applied::Failed
        }
    }
}

/// The background loop: every controller, every tick, until stopped.
pub struct ControllerLoop {
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

/// Starts the loop. The first pass runs one `tick_interval` after start, not at once: the
/// server has just started and its gateway's daemons are still reconnecting.
pub fn spawn(services: Services, config: LivenessConfig) -> ControllerLoop {
    let period = config.tick_interval();
    let mut liveness = LivenessController::new(services.clone(), config);
    let mut drain = DrainController::new(services.clone());
    let mut commands = CommandTimingController::new(services.clone());
    let mut lifecycle = LifecycleController::new(services);
    let (stop, mut stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        // A tick that overran (a slow database) is not followed by a burst of catch-up
        // ticks: the next pass starts one period later.
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // Stopped, or the handle was dropped: either way, no further ticks. A pass
                // under way always finishes first, since this is only polled between them.
                _ = &mut stopped => break,
                _ = ticks.tick() => {
                    match liveness.tick().await {
                        Ok(report) if !report.is_quiet() => tracing::info!(?report, "liveness tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(error = ?err, "liveness tick failed"),
                    }
                    match drain.tick().await {
                        Ok(report) if report.finished > 0 => tracing::info!(?report, "drain deadline tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(error = ?err, "drain deadline tick failed"),
                    }
                    match lifecycle.tick().await {
                        Ok(report) if report != LifecycleReport::default() => tracing::info!(?report, "lifecycle tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "lifecycle tick failed"),
                    }
                    match commands.tick().await {
                        Ok(report) if report != CommandTimingReport::default() => tracing::info!(?report, "command timing tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "command timing tick failed"),
                    }
                }
            }
        }
    });
    ControllerLoop {
        stop: Some(stop),
        task,
    }
}

impl ControllerLoop {
    /// Stops the loop after the pass under way (if any) and waits for it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Err(err) = (&mut self.task).await {
            tracing::warn!(error = %err, "the controller loop ended abnormally");
        }
    }
}
