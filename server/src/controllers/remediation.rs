//! The Remediation controller: runs each pool's health remediation policy as commands.
//!
//! Each tick reads its work list from the service (nodes with a remediation under way, and
//! nodes in service whose pool remediates a condition they carry) and advances each node by
//! one step through [`Services::advance_remediation`], which decides with the node row locked
//! and writes the commands, the attempt rows, the node and the events in one transaction.
//! The rules (the ladder, backoff, waiting for allocations, giving up) are
//! `bc_core::remediation`'s; a restart resumes from the attempt rows.

use crate::error::ApiError;
use crate::service::Services;
use crate::service::remediation::Advanced;

/// Nodes looked at per pass at most; the rest wait for the next tick.
const MAX_PER_TICK: u64 = 2_000;

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemediationReport {
    /// Actions (`gpu.reset`, `node.reboot`) queued.
    pub acted: usize,
    /// Verifications queued.
    pub verifying: usize,
    /// Conditions proven and cleared.
    pub succeeded: usize,
    /// Tries that failed, with another to follow.
    pub retrying: usize,
    /// Runs that gave up (maintenance on, `GpuNeedsPerson`).
    pub gave_up: usize,
    /// Runs ended without a verdict.
    pub cancelled: usize,
    /// Tries waiting (backoff, allocations, a session, a command running).
    pub waiting: usize,
    /// Nodes whose step failed otherwise (logged at `warn`; tried again next tick).
    pub failed: usize,
}

impl RemediationReport {
    /// Nothing but waiting: not worth a log line.
    pub fn is_quiet(&self) -> bool {
        RemediationReport {
            waiting: 0,
            ..self.clone()
        } == RemediationReport::default()
    }
}

/// See the module documentation.
pub struct RemediationController {
    services: Services,
}

impl RemediationController {
    pub fn new(services: Services) -> Self {
        RemediationController { services }
    }

    /// One pass over the work list.
    pub async fn tick(&mut self) -> Result<RemediationReport, ApiError> {
        let mut report = RemediationReport::default();
        for node in self.services.remediation_work(MAX_PER_TICK).await? {
            match self.services.advance_remediation(&node).await {
                Ok(Advanced::Nothing) => {}
                Ok(Advanced::Waiting) => report.waiting += 1,
                Ok(Advanced::Acted) => report.acted += 1,
                Ok(Advanced::Verifying) => report.verifying += 1,
                Ok(Advanced::Succeeded) => report.succeeded += 1,
                Ok(Advanced::Retrying) => report.retrying += 1,
                Ok(Advanced::GaveUp) => report.gave_up += 1,
                Ok(Advanced::Cancelled) => report.cancelled += 1,
                Err(err) => {
                    tracing::warn!(node = %node, code = err.code(), message = %err.message(), "remediation could not advance a node");
                    report.failed += 1;
                }
            }
        }
        Ok(report)
    }
}
