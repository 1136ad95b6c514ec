//! The drain-deadline controller: a drain whose deadline has passed is over.
//!
//! `draining` stays in `noScheduleReasons` until the node's allocations are released or the
//! drain's deadline passes (the brief). Releasing allocations arrives with placement; this
//! controller does the deadline half: [`NodeRecord::finish_drain`] takes `draining` out and
//! records `node.drain_finished`, and the node stays cordoned until an operator uncordons
//! it. The fleet brake does not apply: a deadline is the operator's own instruction, not an
//! observation that a fault could fake.
//!
//! [`NodeRecord::finish_drain`]: bc_core::node::NodeRecord::finish_drain

use bc_core::Actor;

use super::{Applied, apply};
use crate::error::ApiError;
use crate::service::Services;

/// The controller's name: events say `controller:drain`.
pub const ACTOR: &str = "drain";
/// Cause of the events of a drain ended by its deadline.
pub const CAUSE: &str = "drain:deadline-passed";
/// The detail of `node.drain_finished`.
pub const WHY: &str = "deadline passed";

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Drains ended because their deadline passed.
    pub finished: usize,
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

    /// One pass: ends every drain whose deadline is at or before now.
    pub async fn tick(&mut self) -> Result<DrainReport, ApiError> {
        let mut report = DrainReport::default();
        for drain in self.services.drains_past_deadline().await? {
            let applied = apply(
                &self.services,
                &self.actor,
                &drain.node_id,
                drain.version,
                CAUSE,
                |record, _, now| {
                    // The version check already guarantees this; a cheap second guard.
                    let due = record
                        .drain
                        .as_ref()
                        .and_then(|d| d.deadline)
                        .is_some_and(|deadline| deadline <= now);
                    Ok(if due {
                        record.finish_drain(WHY)
                    } else {
                        Vec::new()
                    })
                },
            )
            .await;
            match applied {
                Applied::Changed => report.finished += 1,
                Applied::Unchanged | Applied::Skipped => report.skipped += 1,
                Applied::Failed => report.failed += 1,
            }
        }
        Ok(report)
    }
}
