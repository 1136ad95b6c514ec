//! The Power controller: reads each bare-metal node's power through its BMC and writes the
//! `power` axis (`on`/`off`/`unknown`) and the `BmcUnreachable` condition.
//!
//! Each tick (times from the injected clock; settings in `[bare_metal]`):
//!
//! 1. **Due.** One indexed query gives the BMCs whose `next_poll_at` has come (live nodes
//!    only, the longest overdue first, at most `poll_batch`).
//! 2. **Poll.** Each is asked for its `ComputerSystem`'s power through the node's power
//!    driver, at most `poll_concurrency` at once fleet-wide and `poll_concurrency_per_site`
//!    per site (a site's management network is often a slow, small switch). Each request is
//!    bounded by `request_timeout_secs`. Drivers (an HTTP client each, with its TLS set up)
//!    are kept between ticks and rebuilt only when the node's BMC row changes.
//! 3. **Record.** One transaction: the nodes whose power moved, or whose BMC stopped (after
//!    `unreachable_after_failures` failed polls in a row: `BmcUnreachable` true, power
//!    `unknown`) or started answering again (`BmcUnreachable` false) change through
//!    `Services::change_node_in`, with their events; every BMC's bookkeeping (answered,
//!    last error, failures in a row, and the next poll `poll_interval_secs` away, moved by
//!    up to `poll_jitter_secs` either way) is written. A poll that finds nothing new writes
//!    only its `node_bmcs` row: no node `version`, no event.
//!
//! A power action (`powerNode`) makes its BMC due at once, so the change shows on the next
//! tick after the BMC has made it (the Redfish emulator takes 1 to 11 s).
//!
//! The polls run on a task of their own beside the other controllers' (same period), so a
//! slow BMC never delays Liveness.

use bc_core::ids::{NodeId, SiteId};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;

use crate::bmc::{BmcError, PowerDriver};
use crate::error::ApiResult;
use crate::service::Services;
use crate::service::bare_metal::{DueBmc, PollReport, PowerPoll};

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PowerReport {
    /// BMCs asked.
    pub polled: usize,
    /// Of those, the ones that answered.
    pub answered: usize,
    /// What the answers (and silences) changed.
    pub changes: PollReport,
    /// The longest single poll, in milliseconds.
    pub slowest_ms: u128,
    /// The whole pass (polls and the write), in milliseconds.
    pub elapsed_ms: u128,
}

impl PowerReport {
    /// Only changes are worth a log line; polls that confirm what was known are not.
    pub fn is_quiet(&self) -> bool {
        self.changes == PollReport::default()
    }
}

/// A kept driver and the BMC row it was built from.
struct KeptDriver {
    built_from: String,
    driver: Arc<dyn PowerDriver>,
}

pub struct PowerController {
    services: Services,
    drivers: HashMap<NodeId, KeptDriver>,
}

impl PowerController {
    pub fn new(services: Services) -> Self {
        PowerController {
            services,
            drivers: HashMap::new(),
        }
    }

    /// One pass: poll every BMC due, then record what they said.
    pub async fn tick(&mut self) -> ApiResult<PowerReport> {
        let started = Instant::now();
        let config = self.services.bare_metal.config.clone();
        let due = self.services.bmcs_due(config.poll_batch).await?;
        if due.is_empty() {
            return Ok(PowerReport::default());
        }
        let global = Arc::new(Semaphore::new(config.poll_concurrency));
        let mut per_site: HashMap<SiteId, Arc<Semaphore>> = HashMap::new();
        let mut jobs = Vec::with_capacity(due.len());
        for bmc in &due {
            let site = per_site
                .entry(bmc.site_id.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(config.poll_concurrency_per_site)))
                .clone();
            let driver = self.driver_for(bmc);
            let global = global.clone();
            let node_id = bmc.bmc.node_id.clone();
            let failures_before = bmc.bmc.consecutive_failures;
            let (known_power, known_unreachable) = (bmc.power, bmc.bmc_unreachable);
            jobs.push(async move {
                // The site's permit first: a job waiting for its site holds no global slot.
                let _site = site.acquire_owned().await;
                let _global = global.acquire_owned().await;
                let asked = Instant::now();
                let (result, system_path) = match driver {
                    Ok(driver) => (driver.power_state().await, driver.system_path()),
                    Err(err) => (Err(err), None),
                };
                let took = asked.elapsed();
                metrics::histogram!("bc_power_poll_seconds").record(took.as_secs_f64());
                metrics::counter!(
                    "bc_power_polls_total",
                    "result" => result.as_ref().map_or_else(BmcError::reason, |_| "Answered")
                )
                .increment(1);
                (
                    PowerPoll {
                        node_id,
                        result,
                        failures_before,
                        system_path,
                        known_power,
                        known_unreachable,
                    },
                    took,
                )
            });
        }
        let results = futures::future::join_all(jobs).await;
        let mut report = PowerReport {
            polled: results.len(),
            ..PowerReport::default()
        };
        let mut polls = Vec::with_capacity(results.len());
        for (poll, took) in results {
            report.answered += usize::from(poll.result.is_ok());
            report.slowest_ms = report.slowest_ms.max(took.as_millis());
            polls.push(poll);
        }
        report.changes = self.services.record_power_polls(polls).await?;
        report.elapsed_ms = started.elapsed().as_millis();
        Ok(report)
    }

    /// The kept driver for `due`, or a new one if its BMC row changed (or it has none yet).
    fn driver_for(&mut self, due: &DueBmc) -> Result<Arc<dyn PowerDriver>, BmcError> {
        let built_from = format!(
            "{}\n{:?}\n{}\n{:?}\n{}",
            due.bmc.address,
            due.bmc.system_id,
            due.bmc.tls_verification,
            due.drivers,
            due.bmc.sealed_credentials
        );
        if let Some(kept) = self.drivers.get(&due.bmc.node_id)
            && kept.built_from == built_from
        {
            return Ok(kept.driver.clone());
        }
        let driver = self.services.poll_driver(due).map_err(|err| {
            tracing::warn!(node = %due.bmc.node_id, code = err.code(), reason = %err.message(), "no power driver for a BMC");
            BmcError::Unsupported(format!(
                "the control plane cannot build this BMC's driver ({})",
                err.code()
            ))
        })?;
        self.drivers.insert(
            due.bmc.node_id.clone(),
            KeptDriver {
                built_from,
                driver: driver.clone(),
            },
        );
        Ok(driver)
    }
}
