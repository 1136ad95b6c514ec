//! The Workflow controller: advances every running bare-metal workflow
//! (`bc_core::workflow`, the pure step machine) and performs what it asks.
//!
//! Each tick (times from the injected clock):
//!
//! 1. **Work list.** One indexed query gives the running workflows, the least recently
//!    advanced first, at most [`WORKFLOW_BATCH`].
//! 2. **Advance.** For each: a `Tick` (start the current step, time it out, or poll it);
//!    the step's execution (`Services::execute_workflow_step`: a BMC call, a look at the
//!    node and its inventory, a command built for the node's daemon or the poll of the one
//!    queued), outside any transaction; its outcome fed back. A step that succeeds starts
//!    the next one in the same pass, up to [`MAX_STEPS_PER_PASS`], so a workflow moves as
//!    fast as its machine does.
//! 3. **Record.** One transaction per workflow (`Services::record_workflow`): the
//!    workflow row under its `version`, the commands its steps built (queued with the
//!    handles that name them), the node's move when it ends and the workflow of the state
//!    it moves to, the events. An abort that committed in between wins: the pass is
//!    dropped with its commands, and the next tick sees the aborted workflow, which is no
//!    longer in the list.
//!
//! Nothing is kept in memory between ticks: a restarted server resumes every workflow from
//! its stored step, executing a running step again (each step's execution is safe to
//! repeat). Workflows run on the Power controller's task, since both wait on BMCs.

use std::time::Instant;

use crate::error::ApiResult;
use crate::service::Services;
use crate::service::workflows::Recorded;
use bc_core::workflow::{self, Input};

/// Running workflows advanced per tick. A fleet inspects or releases machines in waves of
/// a few racks at a time; 200 is several racks, and the rest wait for the next tick.
pub const WORKFLOW_BATCH: u64 = 200;

/// Steps one workflow may go through in one pass. Higher than any workflow's step count,
/// so that steps that succeed at once (a boot override) never wait for the next tick; a
/// bound all the same, so a pass always ends.
pub const MAX_STEPS_PER_PASS: usize = 8;

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkflowReport {
    /// Running workflows looked at.
    pub advanced: usize,
    /// Step executions performed.
    pub executed: usize,
    /// Workflows that ended this tick (succeeded, failed, or found their node gone).
    pub ended: usize,
    /// Passes dropped because the workflow changed meanwhile (an abort).
    pub dropped: usize,
    /// The whole pass, in milliseconds.
    pub elapsed_ms: u128,
}

impl WorkflowReport {
    pub fn is_quiet(&self) -> bool {
        self.ended == 0 && self.dropped == 0
    }
}

pub struct WorkflowController {
    services: Services,
}

impl WorkflowController {
    pub fn new(services: Services) -> Self {
        WorkflowController { services }
    }

    /// One pass over the running workflows.
    pub async fn tick(&mut self) -> ApiResult<WorkflowReport> {
        let started = Instant::now();
        let mut report = WorkflowReport::default();
        for before in self.services.running_workflows(WORKFLOW_BATCH).await? {
            report.advanced += 1;
            let mut now = self.services.clock.now();
            let mut current = workflow::advance(&before, Input::Tick, now);
            let mut ending = current.ending();
            let mut queued = Vec::new();
            let mut steps = 0;
            while let Some((step, attempt, kind, handle)) = current.execute() {
                if steps == MAX_STEPS_PER_PASS {
                    break;
                }
                steps += 1;
                let executed = self
                    .services
                    .execute_workflow_step(&current.workflow, kind, handle.as_deref())
                    .await;
                queued.extend(executed.command);
                let result = executed.result;
                tracing::debug!(workflow = %before.id, %kind, ?result, "a workflow step executed");
                now = self.services.clock.now();
                current = workflow::advance(
                    &current.workflow,
                    Input::Outcome {
                        step,
                        attempt,
                        result,
                    },
                    now,
                );
                ending = ending.or(current.ending());
            }
            report.executed += steps;
            if current.workflow == before {
                // A step still waits on the same thing: nothing to write.
                continue;
            }
            match self
                .services
                .record_workflow(&before, current.workflow, ending, queued)
                .await
            {
                Ok(Recorded::Ended) => report.ended += 1,
                Ok(Recorded::Saved | Recorded::Unchanged) => {}
                Ok(Recorded::Dropped) => report.dropped += 1,
                Err(err) => {
                    tracing::warn!(workflow = %before.id, node = %before.node_id, code = err.code(), reason = %err.message(), "a workflow pass could not be recorded; trying again next tick");
                }
            }
        }
        report.elapsed_ms = started.elapsed().as_millis();
        Ok(report)
    }
}
