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
//! when `watched >= brake_min_nodes` and `silent + recent > brake_share × watched`
//! ([`BrakeRule`]). A
//! tripped site is *paused*: no `unreachable` or `lost` transitions at all for it this tick
//! (recoveries still happen). On entering the paused state the controller records one
//! `site.liveness_paused` event (no node; data: site, counts, threshold), and one
//! `site.liveness_resumed` on leaving it, on the first tick where the condition no longer
//! holds (the silent nodes came back, or were deleted). A site stays paused for as long as
//! its silent nodes stay silent: the `bc_liveness_paused_sites` gauge and the event are
//! the operator's signal to look, and cordoning the affected nodes is the manual way to
//! keep work off them meanwhile.
//!
//! A brake is stored (`liveness_brakes`, see `bc_core::brake` for its episodes), so the
//! leader after a failover, or a restarted server, holds the same sites and records no second
//! `site.liveness_paused`. An admin lists brakes (`livenessBrakes`) and may release one
//! (`releaseLivenessBrake`, with a reason, recorded as `site.liveness_released`): the site's
//! silent nodes are then marked down after all, and the same episode does not trip the brake
//! again. The episode ends, and its row is forgotten, on the first tick where the site no
//! longer crosses the rule; a released brake ends quietly, since its release already resumed
//! liveness.
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
//! again next tick. A daemon that comes back to a node still `connected` (its gateway died
//! without closing the session) and its heartbeats land in `node_sessions` without
//! changing the node, so the mark of silent nodes reads their sessions again once it holds
//! the nodes' locks (`Services::change_silent_nodes`), which a `hello` takes before writing
//! the session: a node heard since the cutoff by then is left alone (counted as
//! `heard_at_mark`). On PostgreSQL that read waits for a heartbeat written but not yet
//! committed (`FOR SHARE`); SQLite has one writer, so nothing is uncommitted when it reads.
//! A heartbeat batch that starts after that read waits for the mark to commit, and its node
//! is `unreachable` until the next tick reads the fresh `last_seen` and makes it
//! `connected` again.
//!
//! # Batches
//!
//! Marks and recoveries are written [`NODES_PER_TRANSACTION`] nodes to a transaction, not one
//! each: a failover hands the new leader thousands of silent nodes while their daemons
//! reconnect, and every transaction takes the event-order lock at its commit, as every
//! `hello` does. A node refused in a batch (changed since the query) is skipped alone. Nodes
//! become `lost` one to a transaction, since each loses its work with it
//! ([`LOST_PER_TRANSACTION`]).
//!
//! [`paused_sites`]: LivenessController::paused_sites

use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::brake::{self, BrakeNumbers, BrakeRule, BrakeStatus, BrakeStep, LivenessBrake};
use bc_core::event::EventType;
use bc_core::ids::SiteId;
use bc_core::node::NodeRecord;
use chrono::{DateTime, Utc};
use std::collections::{BTreeMap, BTreeSet};

use super::{Applied, NODES_PER_TRANSACTION, apply_batch, batch_failed, judge};
use crate::config::LivenessConfig;
use crate::service::Services;
use crate::service::liveness::{Candidate, SilentChange, SiteLiveness};
use crate::service::node_changes::{NodeChangeRequest, NodeTransition};

/// The controller's name: events and reasons say `controller:liveness`.
pub const ACTOR: &str = "liveness";
/// Cause of `… → unreachable`.
pub const CAUSE_TIMEOUT: &str = "liveness:heartbeat-timeout";
/// Cause of `unreachable → lost`.
pub const CAUSE_LOST: &str = "liveness:lost";
/// Nodes made `lost` per transaction: one. A node that becomes `lost` loses its work in the
/// same transaction, and an eviction locks every reservation on the node and then the
/// free-atom counts of all their nodes (ARCHITECTURE.md, lock order, steps 3 and 4); a second
/// node's evictions in the same transaction would go back to step 3 and could wait, in a
/// cycle, for a release that waits for counts the first eviction took. And nodes become
/// `lost` far less often than `unreachable`: ten minutes after they went silent, if they
/// stayed so.
const LOST_PER_TRANSACTION: usize = 1;
/// Cause of `unreachable`/`lost` → `connected`.
pub const CAUSE_HEARD_AGAIN: &str = "liveness:heartbeat-resumed";
/// Event recorded when a site's brake trips.
pub const EVENT_PAUSED: EventType = EventType::SiteLivenessPaused;
/// Event recorded when a paused site's brake releases.
pub const EVENT_RESUMED: EventType = EventType::SiteLivenessResumed;
/// Event recorded when an admin releases a site's brake.
pub const EVENT_RELEASED: EventType = EventType::SiteLivenessReleased;

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
    /// Nodes that changed since the query (`CONFLICT`), disappeared, or no longer needed the
    /// change; next tick looks at them again.
    pub skipped: usize,
    /// Silent nodes whose daemon was heard again between the query and the mark, so they
    /// stayed as they were ([`Services::change_silent_nodes`]). Many of these mean the ticks
    /// are written long after their query: a machine too busy for its fleet.
    pub heard_at_mark: usize,
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

    fn count_heard_at_mark(&mut self) {
        self.heard_at_mark += 1;
        metrics::counter!("bc_liveness_heard_at_mark_total").increment(1);
    }
}

/// See the module documentation.
pub struct LivenessController {
    services: Services,
    config: LivenessConfig,
    actor: Actor,
    /// When this controller started (by the injected clock), for the startup hold.
    started_at: DateTime<Utc>,
    /// Sites whose brake holds their transitions, as of the last tick.
    paused: BTreeSet<SiteId>,
}

impl LivenessController {
    pub fn new(services: Services, config: LivenessConfig) -> Self {
        let started_at = services.clock.now();
        LivenessController {
            services,
            config,
            actor: Actor::Controller(ACTOR.to_owned()),
            started_at,
            paused: BTreeSet::new(),
        }
    }

    /// The sites whose brake held their transitions on the last tick, sorted.
    pub fn paused_sites(&self) -> Vec<SiteId> {
        self.paused.iter().cloned().collect()
    }

    fn rule(&self) -> BrakeRule {
        BrakeRule {
            share: self.config.brake_share,
            min_nodes: self.config.brake_min_nodes,
        }
    }

    /// One pass; see the module documentation for the rules and their order.
    pub async fn tick(&mut self) -> anyhow::Result<LivenessReport> {
        let mut report = LivenessReport::default();
        let now = self.services.clock.now();
        let cutoff = now - self.config.grace();

        // 1. Recovery first, whatever the brake says.
        let heard_again = self.services.nodes_heard_again(cutoff).await?;
        let heard_again: Vec<&Candidate> = heard_again.iter().collect();
        self.transition(
            &heard_again,
            Connectivity::Connected,
            CAUSE_HEARD_AGAIN,
            NODES_PER_TRANSACTION,
            &mut report,
        )
        .await;

        let silent = self.services.silent_nodes(cutoff).await?;
        let expired = self
            .services
            .nodes_unreachable_since_before(now - self.config.lost_after())
            .await?;

        // The stored brakes, whoever tripped them (this server before a restart, the leader
        // before a failover) and whatever an admin did to them since.
        let stored: BTreeMap<SiteId, LivenessBrake> = self
            .services
            .liveness_brakes()
            .await?
            .into_iter()
            .map(|b| (b.site_id.clone(), b))
            .collect();
        self.paused = stored
            .values()
            .filter(|b| b.holds_transitions())
            .map(|b| b.site_id.clone())
            .collect();

        if now < self.started_at + self.config.grace() {
            report.held_at_startup = silent.len() + expired.len();
        } else {
            self.update_brakes(now, &silent, &stored, &mut report)
                .await?;
            let silent = self.unless_paused(&silent, &mut report);
            self.mark_silent(&silent, cutoff, &mut report).await;
            let expired = self.unless_paused(&expired, &mut report);
            self.transition(
                &expired,
                Connectivity::Lost,
                CAUSE_LOST,
                LOST_PER_TRANSACTION,
                &mut report,
            )
            .await;
        }

        report.paused_sites = self.paused_sites();
        metrics::gauge!("bc_liveness_paused_sites").set(self.paused.len() as f64);
        Ok(report)
    }

    /// The candidates whose site the brake does not hold; those it holds are counted.
    fn unless_paused<'a>(
        &self,
        candidates: &'a [Candidate],
        report: &mut LivenessReport,
    ) -> Vec<&'a Candidate> {
        let (held, free): (Vec<&Candidate>, Vec<&Candidate>) = candidates
            .iter()
            .partition(|node| self.paused.contains(&node.site_id));
        report.held_by_brake += held.len();
        free
    }

    /// Moves the candidates' connectivity to `to`, `per_transaction` nodes to a transaction,
    /// and counts what became of each.
    async fn transition(
        &self,
        candidates: &[&Candidate],
        to: Connectivity,
        cause: &str,
        per_transaction: usize,
        report: &mut LivenessReport,
    ) {
        for batch in candidates.chunks(per_transaction) {
            let requests = batch
                .iter()
                .map(|node| transition_request(&self.actor, node, to, cause))
                .collect();
            for applied in apply_batch(&self.services, &self.actor, requests).await {
                report.count(applied, to);
            }
        }
    }

    /// Marks silent candidates `unreachable`, [`NODES_PER_TRANSACTION`] to a transaction,
    /// except those whose daemon was heard at or after `cutoff` since the query: a daemon that
    /// comes back to a node still `connected` leaves the node's version as it was
    /// ([`Services::change_silent_nodes`]). Counts what became of each.
    async fn mark_silent(
        &self,
        silent: &[&Candidate],
        cutoff: DateTime<Utc>,
        report: &mut LivenessReport,
    ) {
        let to = Connectivity::Unreachable;
        for batch in silent.chunks(NODES_PER_TRANSACTION) {
            let requests = batch
                .iter()
                .map(|node| transition_request(&self.actor, node, to, CAUSE_TIMEOUT))
                .collect();
            match self.services.change_silent_nodes(cutoff, requests).await {
                Ok(changes) => {
                    for (change, node) in changes.into_iter().zip(batch) {
                        match change {
                            SilentChange::HeardAgain => report.count_heard_at_mark(),
                            SilentChange::Tried(outcome) => {
                                let changed = (*outcome).map(|(_, changes)| !changes.is_empty());
                                let applied =
                                    judge(&self.actor, &node.node_id, CAUSE_TIMEOUT, changed);
                                report.count(applied, to);
                            }
                        }
                    }
                }
                Err(err) => {
                    for applied in batch_failed(&self.actor, batch.len(), &[CAUSE_TIMEOUT], &err) {
                        report.count(applied, to);
                    }
                }
            }
        }
    }

    /// Re-evaluates the brake of every site with silent nodes and of every site with a
    /// stored brake ([`brake::step`]), storing a brake that trips and forgetting one whose
    /// episode ended, each with its event.
    async fn update_brakes(
        &mut self,
        now: DateTime<Utc>,
        silent: &[Candidate],
        stored: &BTreeMap<SiteId, LivenessBrake>,
        report: &mut LivenessReport,
    ) -> anyhow::Result<()> {
        let mut silent_by_site: BTreeMap<&SiteId, u64> = BTreeMap::new();
        for node in silent {
            *silent_by_site.entry(&node.site_id).or_default() += 1;
        }
        let sites: BTreeSet<SiteId> = silent_by_site
            .keys()
            .map(|s| (*s).clone())
            .chain(stored.keys().cloned())
            .collect();
        let sites: Vec<SiteId> = sites.into_iter().collect();
        let numbers = self
            .services
            .site_liveness(&sites, now - self.config.brake_window())
            .await?;

        for site in sites {
            let SiteLiveness {
                watched,
                recently_unreachable,
            } = numbers.get(&site).copied().unwrap_or_default();
            let n = BrakeNumbers {
                silent: silent_by_site.get(&site).copied().unwrap_or(0),
                recently_unreachable,
                watched,
            };
            match brake::step(self.rule().trips(n), stored.get(&site)) {
                BrakeStep::Trip => {
                    let tripped = LivenessBrake::tripped(site.clone(), n, now);
                    let data = self.data(&site, n);
                    if self
                        .services
                        .trip_liveness_brake(&tripped, &self.actor, data)
                        .await?
                    {
                        tracing::warn!(site = %site, silent = n.silent, recent = n.recently_unreachable, watched = n.watched,
                            "liveness paused for a site: too many of its nodes went silent at once");
                        report.newly_paused.push(site.clone());
                    }
                    // Stored now, by this pass or a moment earlier by another: held either way.
                    self.paused.insert(site);
                }
                BrakeStep::Resume => {
                    let data = self.data(&site, n);
                    if self
                        .services
                        .end_liveness_brake(&site, BrakeStatus::Paused, &self.actor, data, now)
                        .await?
                    {
                        tracing::info!(site = %site, "liveness resumed for a site");
                        report.resumed.push(site.clone());
                    }
                    self.paused.remove(&site);
                }
                BrakeStep::Forget => {
                    let data = self.data(&site, n);
                    if self
                        .services
                        .end_liveness_brake(&site, BrakeStatus::Released, &self.actor, data, now)
                        .await?
                    {
                        tracing::info!(site = %site, "a released brake's episode ended");
                    }
                }
                BrakeStep::Stay => {}
            }
        }
        Ok(())
    }

    /// The data of a `site.liveness_paused`/`resumed` event: the numbers and the rule.
    fn data(&self, site: &SiteId, n: BrakeNumbers) -> serde_json::Value {
        serde_json::json!({
            "siteId": site,
            "silent": n.silent,
            "recentlyUnreachable": n.recently_unreachable,
            "watched": n.watched,
            "share": self.config.brake_share,
            "threshold": self.rule().threshold(n.watched),
            "minNodes": self.config.brake_min_nodes,
            "windowSecs": self.config.brake_window_secs,
        })
    }
}

/// The request that moves a candidate's connectivity to `to` on behalf of `actor`, expecting
/// the version its query read: what the controller writes for each of its transitions (and
/// what tests hand [`Services::change_silent_nodes`] to mark nodes as the controller does).
pub fn transition_request(
    actor: &Actor,
    node: &Candidate,
    to: Connectivity,
    cause: &str,
) -> NodeChangeRequest<impl NodeTransition + use<>> {
    NodeChangeRequest {
        id: node.node_id.clone(),
        actor: actor.clone(),
        expected_version: Some(node.version),
        cause: cause.to_owned(),
        change: move_connectivity(node.connectivity, to),
    }
}

/// The change that moves a node's connectivity from `seen` (what the candidate query read)
/// to `to`, and leaves a node whose connectivity is no longer `seen` alone. The version check
/// already guarantees that; this is a cheap second guard.
fn move_connectivity(seen: Connectivity, to: Connectivity) -> impl NodeTransition {
    move |record: &mut NodeRecord, actor: &Actor, now: DateTime<Utc>| {
        if record.connectivity != seen {
            return Ok(Vec::new());
        }
        Ok(record.set_connectivity(to, actor, now))
    }
}
