//! Controllers: loops that look at the fleet and change nodes when time alone makes a rule
//! true (a heartbeat that never came, a drain deadline that passed), and health remediation
//! (a pool's policy run as commands, `remediation.rs`).
//!
//! A controller never writes a node itself. It finds candidates with one query per rule
//! (a `Services` read such as `silent_nodes`), then hands them to the node changes of
//! `Services` ([`apply_batch`], or one of its own such as `change_silent_nodes`) with its own
//! actor and the `version` the query read: the rows are locked, the domain transitions
//! applied, `version` bumped and the events written, [`NODES_PER_TRANSACTION`] nodes to a
//! transaction. A node that changed since the query is `CONFLICT` and is simply looked at
//! again on the next tick.
//!
//! Each controller has a `tick()` that does one pass and returns a report; [`spawn`] runs
//! them all every `liveness.tick_interval_secs` until stopped (the Power controller, whose
//! passes wait on BMCs, on a task of its own with the same period), on one server of the
//! deployment at a time: the holder of the controllers' lease ([`leadership`]). The Lifecycle
//! pass (acceptance and first specs) also runs soon after any event that may move a node
//! through it ([`LIFECYCLE_BATCH_WINDOW`]), so a node does not wait for ticks on its way to
//! schedulable; its tick stays as the safety net for what no event announces. Tests leave
//! the loop off and call `tick()` themselves with a `ManualClock`.

pub mod commands;
pub mod drain;
pub mod leadership;
pub mod lifecycle;
pub mod liveness;
pub mod placement;
pub mod power;
pub mod remediation;
pub mod workflow;

use bc_core::Actor;
use bc_core::ids::NodeId;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

pub use commands::{CommandTimingController, CommandTimingReport};
pub use drain::{DrainController, DrainReport};
pub use leadership::Leadership;
pub use lifecycle::{LifecycleController, LifecycleReport};
pub use liveness::{LivenessController, LivenessReport};
pub use placement::{PlacementController, PlacementTickReport};
pub use power::{PowerController, PowerReport};
pub use remediation::{RemediationController, RemediationReport};
pub use workflow::{WorkflowController, WorkflowReport};

use crate::config::LivenessConfig;
use crate::error::{ApiError, ApiResult};
use crate::feed::Feed;
use crate::service::Services;
use crate::service::node_changes::{NodeChangeRequest, NodeTransition};

/// How long the loop waits, once an event may have moved a node through acceptance
/// ([`bc_core::acceptance::may_advance`]), before it runs the Lifecycle pass: the events of a
/// burst (a fleet coming up writes hundreds a second) are served by one pass. Waiting for the
/// tick instead cost each node up to two ticks (10 s) between connecting and being
/// schedulable: one to queue its check and one to judge it.
pub const LIFECYCLE_BATCH_WINDOW: Duration = Duration::from_millis(200);

/// How often the leader brings PostgreSQL's planner statistics up to date
/// ([`Services::refresh_planner_statistics`]): often enough that a fleet growing by
/// thousands of nodes a minute is planned for its size within half a minute; a fleet that
/// stopped growing costs one catalog query per round.
pub const PLANNER_STATISTICS_EVERY: Duration = Duration::from_secs(30);

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

/// Nodes a controller writes per transaction (Lifecycle's diagnostics, adoptions and first
/// specs; Liveness's marks `unreachable` and recoveries). A fleet coming up gives a pass a thousand nodes
/// to move, and a transaction each (about 13 ms on the one SQLite writer) held adoption to a
/// few dozen nodes a second while sessions and operators queued behind it; on PostgreSQL
/// each commit takes the event-order lock, which every other writer of events waits for. A
/// batch this size commits in tens of milliseconds, so no one waits on the writer longer
/// than that.
const NODES_PER_TRANSACTION: usize = 250;

/// Applies controller transitions to many nodes in one transaction
/// ([`Services::apply_node_changes`]), each expecting the version its candidate query read;
/// what became of each, in the order given. A batch that failed as a whole (a database
/// error) is `Failed` for every node and logged once ([`batch_failed`]).
pub(crate) async fn apply_batch<F>(
    services: &Services,
    actor: &Actor,
    requests: Vec<NodeChangeRequest<F>>,
) -> Vec<Applied>
where
    F: NodeTransition,
{
    let asked = requests.len();
    let causes: Vec<String> = requests.iter().map(|r| r.cause.clone()).collect();
    match services.apply_node_changes(requests).await {
        // One outcome per request, in the order given.
        Ok(outcomes) => outcomes
            .into_iter()
            .zip(causes)
            .map(|((id, outcome), cause)| {
                let changed = outcome.map(|(_, changes)| !changes.is_empty());
                judge(actor, &id, &cause, changed)
            })
            .collect(),
        Err(err) => {
            let causes: Vec<&str> = causes.iter().map(String::as_str).collect();
            batch_failed(actor, asked, &causes, &err)
        }
    }
}

/// What became of each of a batch's `asked` nodes when the batch failed as a whole: `Failed`,
/// logged once with the batch's causes and, for an internal error, what caused it (its
/// message to API clients says only "internal error").
fn batch_failed(actor: &Actor, asked: usize, causes: &[&str], err: &ApiError) -> Vec<Applied> {
    let mut causes = causes.to_vec();
    causes.sort_unstable();
    causes.dedup();
    let causes = causes.join(", ");
    match err {
        ApiError::Internal(source) => {
            tracing::warn!(%actor, nodes = asked, causes, error = ?source, "a controller could not change a batch of nodes");
        }
        other => {
            tracing::warn!(%actor, nodes = asked, causes, code = other.code(), message = %other.message(), "a controller could not change a batch of nodes");
        }
    }
    vec![Applied::Failed; asked]
}

/// What became of one node change, logged as a controller logs it.
/// `result` is whether the node changed.
fn judge(actor: &Actor, id: &NodeId, cause: &str, result: ApiResult<bool>) -> Applied {
    match result {
        Ok(true) => Applied::Changed,
        Ok(false) => Applied::Unchanged,
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
    /// The Power and Workflow controllers' loop: the same period, on a task of its own,
    /// because their passes wait on BMCs (seconds, at worst a request timeout) and must not
    /// delay Liveness.
    power_stop: Option<oneshot::Sender<()>>,
    power_task: JoinHandle<()>,
    /// Follows the event feed and wakes the Lifecycle pass ([`wake_lifecycle_on_events`]).
    lifecycle_wakes: JoinHandle<()>,
    /// Keeps the planner's statistics current ([`refresh_planner_statistics`]).
    planner_statistics: JoinHandle<()>,
}

/// Starts the loop. The first tick's passes run one `tick_interval` after start, not at
/// once: the server has just started and its gateway's daemons are still reconnecting, which
/// Liveness must not take for silence. The Lifecycle pass may run sooner, woken by events:
/// acceptance acts only on connected nodes, so a reconnecting fleet cannot mislead it. The
/// lease is asked for at once, so that those wakes can run from the start. Each pass runs
/// only on the server that holds the controllers' lease ([`leadership`]).
pub fn spawn(services: Services, config: LivenessConfig, feed: Arc<Feed>) -> ControllerLoop {
    let period = config.tick_interval();
    let leadership = Leadership::new(services.clone(), period);
    let power_leads = leadership.leading();
    let lifecycle_leads = leadership.leading();
    let planner_statistics = tokio::spawn(refresh_planner_statistics(
        services.clone(),
        leadership.leading(),
    ));
    let lifecycle_wake = Arc::new(Notify::new());
    // The feed's head now, not read later in the task: every event committed after this
    // function returns is followed, even if the task first runs after a commit.
    let followed_from = feed.head();
    let lifecycle_wakes = tokio::spawn(wake_lifecycle_on_events(
        services.clone(),
        feed,
        followed_from,
        lifecycle_wake.clone(),
    ));
    let mut liveness = LivenessController::new(services.clone(), config);
    let mut drain = DrainController::new(services.clone());
    let mut commands = CommandTimingController::new(services.clone());
    let mut placement = PlacementController::new(services.clone());
    let mut remediation = RemediationController::new(services.clone());
    let mut lifecycle = LifecycleController::new(services.clone());
    let mut workflows = WorkflowController::new(services.clone());
    let mut power = PowerController::new(services);
    let (power_stop, mut power_stopped) = oneshot::channel::<()>();
    let power_task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut power_stopped => break,
                _ = ticks.tick() => {
                    // The main loop keeps the lease; this one follows its verdict.
                    if !power_leads.load(std::sync::atomic::Ordering::Relaxed) {
                        continue;
                    }
                    match crate::service::attributed("controller.power", power.tick()).await {
                        Ok(report) if !report.is_quiet() => tracing::info!(?report, "power tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "power tick failed"),
                    }
                    match crate::service::attributed("controller.workflows", workflows.tick()).await {
                        Ok(report) if !report.is_quiet() => tracing::info!(?report, "workflow tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "workflow tick failed"),
                    }
                }
            }
        }
    });
    let (stop, mut stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        // A tick that overran (a slow database) is not followed by a burst of catch-up
        // ticks: the next pass starts one period later.
        ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
        leadership.check().await;
        loop {
            tokio::select! {
                // In this order when several are ready: a stop first, then the tick, whose
                // check renews the lease, so that a stream of wakes cannot hold it off.
                biased;
                // Stopped, or the handle was dropped: either way, no further ticks. A pass
                // under way always finishes first, since this is only polled between them.
                _ = &mut stopped => {
                    leadership.resign().await;
                    break;
                }
                _ = ticks.tick() => {
                    if !leadership.check().await {
                        continue;
                    }
                    match crate::service::attributed("controller.liveness", liveness.tick()).await {
                        Ok(report) if !report.is_quiet() => tracing::info!(?report, "liveness tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(error = ?err, "liveness tick failed"),
                    }
                    match crate::service::attributed("controller.drain", drain.tick()).await {
                        Ok(report) if report.finished + report.drained > 0 => tracing::info!(?report, "drain tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(error = ?err, "drain tick failed"),
                    }
                    match crate::service::attributed("controller.placement", placement.tick()).await {
                        Ok(report) if report != PlacementTickReport::default() => tracing::info!(?report, "placement tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "placement tick failed"),
                    }
                    run_lifecycle(&mut lifecycle).await;
                    match crate::service::attributed("controller.remediation", remediation.tick()).await {
                        Ok(report) if !report.is_quiet() => tracing::info!(?report, "remediation tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "remediation tick failed"),
                    }
                    match crate::service::attributed("controller.commands", commands.tick()).await {
                        Ok(report) if report != CommandTimingReport::default() => tracing::info!(?report, "command timing tick"),
                        Ok(_) => {}
                        Err(err) => tracing::warn!(code = err.code(), reason = %err.message(), "command timing tick failed"),
                    }
                }
                () = lifecycle_wake.notified() => {
                    // A server that did not lead at the last check leaves the pass to the
                    // one that did; one that did checks again (which renews the lease), so a
                    // server whose lease lapsed since never runs a pass beside the new
                    // leader's (two passes would each queue the same node's check).
                    if lifecycle_leads.load(Ordering::Relaxed) {
                        tokio::time::sleep(LIFECYCLE_BATCH_WINDOW).await;
                        if leadership.check().await {
                            run_lifecycle(&mut lifecycle).await;
                        }
                    }
                }
            }
        }
    });
    ControllerLoop {
        stop: Some(stop),
        task,
        power_stop: Some(power_stop),
        power_task,
        lifecycle_wakes,
        planner_statistics,
    }
}

/// Every [`PLANNER_STATISTICS_EVERY`], on the leader, analyses the tables whose planner
/// statistics are due. On a task of its own: analysing a table of 100,000 rows takes a
/// moment, which Liveness must not wait for.
async fn refresh_planner_statistics(services: Services, leads: Arc<AtomicBool>) {
    let mut ticks = tokio::time::interval(PLANNER_STATISTICS_EVERY);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if !leads.load(Ordering::Relaxed) {
            continue;
        }
        let refreshed = crate::service::attributed(
            "controller.planner_statistics",
            services.refresh_planner_statistics(),
        )
        .await;
        match refreshed {
            Ok(tables) if !tables.is_empty() => {
                tracing::info!(?tables, "planner statistics refreshed");
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(error = ?err, "refreshing planner statistics failed");
            }
        }
    }
}

/// One Lifecycle pass, logged.
async fn run_lifecycle(lifecycle: &mut LifecycleController) {
    match crate::service::attributed("controller.lifecycle", lifecycle.tick()).await {
        Ok(report) if report != LifecycleReport::default() => {
            tracing::info!(?report, "lifecycle pass");
        }
        Ok(_) => {}
        Err(err) => {
            tracing::warn!(code = err.code(), reason = %err.message(), "lifecycle pass failed");
        }
    }
}

/// Follows the event feed (every replica's commits) from the event after `after` and wakes
/// the Lifecycle pass for each event that may move a node through acceptance. A wake while a
/// pass runs is kept, so what that pass may have missed gets the next. When the feed fails
/// (fallen behind, or unreadable), following resumes from the last event seen a moment
/// later, and the pass is woken then too, since it looks at every candidate anyway.
async fn wake_lifecycle_on_events(
    services: Services,
    feed: Arc<Feed>,
    mut after: i64,
    wake: Arc<Notify>,
) {
    use futures::StreamExt;
    loop {
        let events = feed.subscribe_events(services.clone(), after);
        tokio::pin!(events);
        loop {
            match events.next().await {
                Some(Ok(event)) => {
                    after = event.id.0;
                    if bc_core::acceptance::may_advance(event.event_type) {
                        wake.notify_one();
                    }
                }
                Some(Err(_)) => break,
                // The feed ended: the server is stopping.
                None => return,
            }
        }
        tokio::time::sleep(placement::FEED_RETRY).await;
        wake.notify_one();
    }
}

/// The feed's follower and the planner statistics' task stop with the loop, however the
/// loop ends (the other tasks stop when their stop senders drop). An `ANALYZE` cut short
/// changes nothing: the next leader's runs again.
impl Drop for ControllerLoop {
    fn drop(&mut self) {
        self.lifecycle_wakes.abort();
        self.planner_statistics.abort();
    }
}

impl ControllerLoop {
    /// Stops the loop after the pass under way (if any) and waits for it.
    pub async fn stop(mut self) {
        for stop in [self.stop.take(), self.power_stop.take()]
            .into_iter()
            .flatten()
        {
            let _ = stop.send(());
        }
        for task in [&mut self.task, &mut self.power_task] {
            if let Err(err) = task.await {
                tracing::warn!(error = %err, "a controller loop ended abnormally");
            }
        }
    }
}
