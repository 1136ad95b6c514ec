//! The drain controller: a drain ends when the node holds no allocations, or at its deadline.
//!
//! `draining` stays in `noScheduleReasons` until the node's allocations are released or the
//! drain's deadline passes (the brief). Each tick ends the drains of nodes that hold no
//! allocation any more, and at a passed deadline first evicts the work still there (its
//! reservations go back to PENDING and are placed elsewhere). Both write `node.drained` and
//! take `draining` out; the node stays cordoned until an operator uncordons it. A drain
//! without a deadline therefore ends as soon as the node's last allocation is released, and at
//! once (next tick) on a node that runs nothing. The fleet brake does not apply: a drain is
//! the operator's own instruction, not an observation that a fault could fake.

use bc_core::Actor;

use crate::error::ApiError;
use crate::service::Services;

/// The controller's name: events say `controller:drain`.
pub const ACTOR: &str = "drain";
/// Cause of the events of a drain ended by its deadline.
pub const CAUSE_DEADLINE: &str = "drain:deadline-passed";
/// Cause of the events of a drain ended because the node runs nothing.
pub const CAUSE_EMPTY: &str = "drain:no-allocations";

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Drains ended because their deadline passed (work still there was evicted).
    pub finished: usize,
    /// Drains ended because the node holds no allocation.
    pub drained: usize,
    /// Nodes that changed since the query (`CONFLICT`) or disappeared; next tick retries.
    pub skipped: usize,
    /// Nodes whose change failed otherwise (logged at `warn`).
    pub failed: usize,
}

/// See the module documentation.
pub struct DrainController {
    services: Services,
    actor: Actor,
}

impl DrainController {
    pub fn new(services: Services) -> Self {
        DrainController {
            services,
            actor: Actor::Controller(ACTOR.to_owned()),
        }
    }

    /// One pass: ends every drain whose deadline is at or before now, then every drain of a
    /// node that holds no allocation.
    pub async fn tick(&mut self) -> Result<DrainReport, ApiError> {
        let mut report = DrainReport::default();
        for drain in self.services.drains_past_deadline().await? {
            let ended = self
                .services
                .finish_drain(
                    &self.actor,
                    &drain.node_id,
                    drain.version,
                    CAUSE_DEADLINE,
                    true,
                )
                .await;
            self.count(&mut report, ended, |r| &mut r.finished);
        }
        for (node, version) in self.services.drained_nodes().await? {
            let ended = self
                .services
                .finish_drain(&self.actor, &node, version, CAUSE_EMPTY, false)
                .await;
            self.count(&mut report, ended, |r| &mut r.drained);
        }
        Ok(report)
    }

    fn count(
        &self,
        report: &mut DrainReport,
        ended: Result<bool, ApiError>,
        done: impl FnOnce(&mut DrainReport) -> &mut usize,
    ) {
        match ended {
            Ok(true) => *done(report) += 1,
            Ok(false) | Err(ApiError::Conflict { .. } | ApiError::NotFound(_)) => {
                report.skipped += 1;
            }
            Err(err) => {
                tracing::warn!(code = err.code(), message = %err.message(), "the drain controller could not end a drain");
                report.failed += 1;
            }
        }
    }
}
