//! The command-timing controller: queued commands that waited past their expiry expire;
//! dispatched or running ones past their timeout time out (and the gateway tells the daemon
//! to stop them).

use crate::error::ApiError;
use crate::service::Services;

/// Commands ended per pass at most; the rest wait for the next tick, so one pass stays short
/// even after an outage left thousands overdue.
const MAX_PER_TICK: u64 = 1_000;

pub struct CommandTimingController {
    services: Services,
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CommandTimingReport {
    pub expired: usize,
    pub timed_out: usize,
}

impl CommandTimingController {
    pub fn new(services: Services) -> Self {
        CommandTimingController { services }
    }

    pub async fn tick(&mut self) -> Result<CommandTimingReport, ApiError> {
        let ended = self.services.end_overdue_commands(MAX_PER_TICK).await?;
        let mut report = CommandTimingReport::default();
        for command in &ended {
            match command.status {
                bc_core::command::CommandStatus::Expired => report.expired += 1,
                _ => report.timed_out += 1,
            }
        }
        Ok(report)
    }
}
