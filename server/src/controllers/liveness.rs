//! The Liveness controller: turns heartbeats that stopped into `unreachable` and `lost`, and
//! heartbeats that resumed back into `connected`.
//!
//! The gateway owns the session: `Hello` makes a node `connected`, a clean close makes it
//! `disconnected`, and heartbeats only move `node_sessions.last_seen` (they never bump the
//! node's `version`). This controller owns the rest of the `connectivity` axis. Each tick
//! (times from the injected clock; settings in `[liveness]`):
//!
//! 1. **Heard again.** An `unreachable` or `lost` node whose session is open and heartbeated
//!    within the grace becomes `connected`, and `unreachable` leaves `noScheduleReasons` in
//!    the same transaction. This covers a session that stayed up while heartbeats were late.
//!    Recovery is always safe, so it happens even in a site the brake paused and during the
//!    startup hold.
//! 2. **Silent.** A `connected` or `disconnected` node with no heartbeat for the grace
//!    (40 s) becomes `unreachable`, which adds `unreachable` to `noScheduleReasons` in the
//!    same transaction. A `connected` node without a session row counts from when it
//!    became connected.
//!    *Decision:* `disconnected` nodes go `unreachable` too (then `lost`). The brief says
//!    "a closed session makes the node disconnected; no heartbeat for 40 s makes it
//!    unreachable", and a cleanly closed session is still no heartbeat: `disconnected` is a
//!    short-lived "the daemon said goodbye" that either ends in a reconnect (the gateway
//!    makes the node `connected` again) or, when the machine does not come back, in
//!    `unreachable` and `lost` like any other silent machine. A node that never had a
//!    session (nothing to miss) stays `disconnected`.
//! 3. **Lost.** A node `unreachable` for `lost_after` (10 min) becomes `lost`; the reason
//!    stays.
//!
//! Only live `bcd/v1` nodes are watched; see `store::liveness`.
//!
//! # Fleet brake
//!
//! A control-plane or network fault must not mark a whole site down. Per site, before any
//! transition of step 2 or 3: let *silent* be the nodes step 2 would now mark `unreachable`,
//! *recent* the site's nodes that became `unreachable` within `brake_window` (read from
//! `connectivity` and `connectivity_since`), and *watched* the nodes Liveness watches in the
//! site (every role, site agents included: they heartbeat like any node). The brake trips
//! when `watched >= brake_min_nodes` and `silent + recent > brake_share × watched`. A
//! tripped site is *paused*: no `unreachable` or `lost` transitions at all for it this tick
//! (recoveries still happen). On entering the paused state the controller records one
//! `site.liveness_paused` event (no node; data: site, counts, threshold), and one
//! `site.liveness_resumed` on leaving it, on the first tick where the condition no longer
//! holds (the silent nodes came back, or were deleted). A site stays paused for as long as
//! its silent nodes stay silent: the `bc_liveness_paused_sites` gauge and the event are
//! the operator's signal to look, and cordoning the affected nodes is the manual way to
//! keep work off them meanwhile.
//!
//! The set of paused sites lives in the controller, in memory ([`paused_sites`]); a
//! restarted controller starts with none and, if a site still trips, records a fresh
//! `site.liveness_paused`.
//!
//! # Startup hold
//!
//! *Decision:* for one grace period after the controller starts it makes no `unreachable`
//! or `lost` transitions (recoveries still happen). A restarted control plane finds every
//! session's `last_seen` as old as its own downtime; daemons need one grace to reconnect
//! before their silence means anything. The brake is not evaluated during the hold.
//!
//! # Races
//!
//! Every transition passes the `version` its query read, so a node the gateway or an
//! operator changed in between is skipped (`CONFLICT`, logged at `debug`) and looked at
//! again next tick. A heartbeat lands in `node_sessions` without touching the node row, so
//! one that arrives between the query and the write can still see its node marked
//! `unreachable`; the next tick reads the fresh `last_seen` and makes it `connected` again.
//!
//! [`paused_sites`]: LivenessController::paused_sites

use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::event::EventType;
use bc_core::ids::SiteId;
use chrono::{DateTime, Utc};
use std::collections::{BTreeMap, BTreeSet};

use super::{Applied, apply};
use crate::config::LivenessConfig;
use crate::service::Services;
use crate::service::liveness::{Candidate, SiteLiveness};

/// The controller's name: events and reasons say `controller:liveness`.
pub const ACTOR: &str = "liveness";
/// Cause of `… → unreachable`.
pub const CAUSE_TIMEOUT: &str = "liveness:heartbeat-timeout";
/// Cause of `unreachable → lost`.
pub const CAUSE_LOST: &str = "liveness:lost";
/// Cause of `unreachable`/`lost` → `connected`.
pub const CAUSE_HEARD_AGAIN: &str = "liveness:heartbeat-resumed";
/// Event recorded when a site's brake trips.
pub const EVENT_PAUSED: EventType = EventType::SiteLivenessPaused;
/// Event recorded when a paused site's brake releases.
pub const EVENT_RESUMED: EventType = EventType::SiteLivenessResumed;

/// What one tick did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LivenessReport {
    /// Nodes made `unreachable`.
    pub unreachable: usize,
    /// Nodes made `lost`.
    pub lost: usize,
    /// `unreachable` or `lost` nodes made `connected` again.
    pub connected: usize,
    /// `unreachable`/`lost` transitions not made because the node's site is paused.
    pub held_by_brake: usize,
    /// `unreachable`/`lost` transitions not made because of the startup hold.
    pub held_at_startup: usize,
    /// Nodes that changed since the query (`CONFLICT`) or disappeared; next tick retries.
    pub skipped: usize,
    /// Nodes whose change failed otherwise (logged at `warn`).
    pub failed: usize,
    /// Sites whose brake tripped this tick.
    pub newly_paused: Vec<SiteId>,
    /// Sites whose brake released this tick.
    pub resumed: Vec<SiteId>,
    /// Every site paused after this tick.
    pub paused_sites: Vec<SiteId>,
}

impl LivenessReport {
    /// Nothing happened: not worth a log line. (A site that stays paused is not news; its
    /// pausing and resuming are logged when they happen, and the gauge shows it.)
    pub fn is_quiet(&self) -> bool {
        LivenessReport {
            paused_sites: Vec::new(),
            held_by_brake: 0,
            ..self.clone()
        } == LivenessReport::default()
    }

    fn count(&mut self, applied: Applied, to: Connectivity) {
        match applied {
            Applied::Changed => {
                match to {
                    Connectivity::Unreachable => self.unreachable += 1,
                    Connectivity::Lost => self.lost += 1,
                    Connectivity::Connected => self.connected += 1,
                    Connectivity::Disconnected => {}
                }
                metrics::counter!("bc_liveness_transitions_total", "to" => to.as_static_str())
                    .increment(1);
            }
            Applied::Unchanged | Applied::Skipped => self.skipped += 1,
            Applied::Failed => self.failed += 1,
        }
    }
}

/// Why a site is paused: the numbers when its brake tripped.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Brake {
    silent: u64,
    recent: u64,
    watched: u64,
}

/// See the module documentation.
pub struct LivenessController {
    services: Services,
    config: LivenessConfig,
    actor: Actor,
    /// When this controller started (by the injected clock), for the startup hold.
    started_at: DateTime<Utc>,
    /// Sites whose brake is on, with the numbers that tripped it.
    paused: BTreeMap<SiteId, Brake>,
}

impl LivenessController {
    pub fn new(services: Services, config: LivenessConfig) -> Self {
        let started_at = services.clock.now();
        LivenessController {
            services,
            config,
            actor: Actor::Controller(ACTOR.to_owned()),
            started_at,
            paused: BTreeMap::new(),
        }
    }

    /// The sites whose brake is on, sorted.
    pub fn paused_sites(&self) -> Vec<SiteId> {
        self.paused.keys().cloned().collect()
    }

    /// One pass; see the module documentation for the rules and their order.
    pub async fn tick(&mut self) -> anyhow::Result<LivenessReport> {
        let mut report = LivenessReport::default();
        let now = self.services.clock.now();
        let cutoff = now - self.config.grace();

        // 1. Recovery first, whatever the brake says.
        for node in self.services.nodes_heard_again(cutoff).await? {
            let applied = self
                .transition(&node, Connectivity::Connected, CAUSE_HEARD_AGAIN)
                .await;
            report.count(applied, Connectivity::Connected);
        }

        let silent = self.services.silent_nodes(cutoff).await?;
        let expired = self
            .services
            .nodes_unreachable_since_before(now - self.config.lost_after())
            .await?;

        if now < self.started_at + self.config.grace() {
            report.held_at_startup = silent.len() + expired.len();
        } else {
            self.update_brakes(now, &silent, &mut report).await?;
            for (node, to, cause) in silent
                .iter()
                .map(|n| (n, Connectivity::Unreachable, CAUSE_TIMEOUT))
                .chain(expired.iter().map(|n| (n, Connectivity::Lost, CAUSE_LOST)))
            {
                if self.paused.contains_key(&node.site_id) {
                    report.held_by_brake += 1;
                    continue;
                }
                let applied = self.transition(node, to, cause).await;
                report.count(applied, to);
            }
        }

        report.paused_sites = self.paused_sites();
        metrics::gauge!("bc_liveness_paused_sites").set(self.paused.len() as f64);
        Ok(report)
    }

    /// Moves one candidate's connectivity, if it is still what the query saw.
    async fn transition(&self, node: &Candidate, to: Connectivity, cause: &str) -> Applied {
        let seen = node.connectivity;
        apply(
            &self.services,
            &self.actor,
            &node.node_id,
            node.version,
            cause,
            move |record, actor, now| {
                // The version check already guarantees this; a cheap second guard.
                if record.connectivity != seen {
                    return Ok(Vec::new());
                }
                Ok(record.set_connectivity(to, actor, now))
            },
        )
        .await
    }

    /// Re-evaluates the brake of every site with silent nodes and of every paused site,
    /// recording an event for each site that enters or leaves the paused state.
    async fn update_brakes(
        &mut self,
        now: DateTime<Utc>,
        silent: &[Candidate],
        report: &mut LivenessReport,
    ) -> anyhow::Result<()> {
        let mut silent_by_site: BTreeMap<&SiteId, u64> = BTreeMap::new();
        for node in silent {
            *silent_by_site.entry(&node.site_id).or_default() += 1;
        }
        let sites: BTreeSet<SiteId> = silent_by_site
            .keys()
            .map(|s| (*s).clone())
            .chain(self.paused.keys().cloned())
            .collect();
        let sites: Vec<SiteId> = sites.into_iter().collect();
        let numbers = self
            .services
            .site_liveness(&sites, now - self.config.brake_window())
            .await?;

        for site in sites {
            let SiteLiveness {
                watched,
                recently_unreachable: recent,
            } = numbers.get(&site).copied().unwrap_or_default();
            let brake = Brake {
                silent: silent_by_site.get(&site).copied().unwrap_or(0),
                recent,
                watched,
            };
            let tripped = self.trips(brake);
            match (tripped, self.paused.contains_key(&site)) {
                (true, false) => {
                    self.record(&site, EVENT_PAUSED, brake, now).await?;
                    tracing::warn!(site = %site, silent = brake.silent, recent = brake.recent, watched = brake.watched,
                        "liveness paused for a site: too many of its nodes went silent at once");
                    self.paused.insert(site.clone(), brake);
                    report.newly_paused.push(site);
                }
                (false, true) => {
                    self.record(&site, EVENT_RESUMED, brake, now).await?;
                    tracing::info!(site = %site, "liveness resumed for a site");
                    self.paused.remove(&site);
                    report.resumed.push(site);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether these numbers trip the brake.
    fn trips(&self, brake: Brake) -> bool {
        brake.watched >= self.config.brake_min_nodes
            && (brake.silent + brake.recent) as f64 > self.config.brake_share * brake.watched as f64
    }

    /// Writes one `site.liveness_paused`/`resumed` event, visible to the site's tenant.
    async fn record(
        &self,
        site: &SiteId,
        event_type: EventType,
        brake: Brake,
        now: DateTime<Utc>,
    ) -> anyhow::Result<()> {
        let data = serde_json::json!({
            "siteId": site,
            "silent": brake.silent,
            "recentlyUnreachable": brake.recent,
            "watched": brake.watched,
            "share": self.config.brake_share,
            "threshold": self.config.brake_share * brake.watched as f64,
            "minNodes": self.config.brake_min_nodes,
            "windowSecs": self.config.brake_window_secs,
        });
        self.services
            .record_site_liveness_event(site, event_type, &self.actor, data, now)
            .await?;
        Ok(())
    }
}
