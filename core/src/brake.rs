//! The fleet brake (`shared/DESIGN.md`, Liveness): when too much of a site goes silent at
//! once, the Liveness controller stops marking its nodes `unreachable` and `lost`, because a
//! control-plane or network fault must not mark a whole site down.
//!
//! A brake is an *episode* of one site, stored so that every replica's controller (and the
//! next leader after a failover) sees the same one, and so that an admin can list it and
//! release it:
//!
//! - it **trips** when the site's numbers cross the rule ([`BrakeRule::trips`]): the site is
//!   `paused`;
//! - an admin may **release** it (with a reason of their own): the operator has looked and
//!   says the silence is real (a rack lost power), so the nodes should go `unreachable` and
//!   `lost` after all. A released brake stays stored, so that the same episode does not trip
//!   it again on the next tick;
//! - the episode **ends** on the first tick where the numbers no longer cross the rule (the
//!   nodes came back, were marked down after a release, or were deleted): the stored brake is
//!   forgotten, and a later silence is a new episode.
//!
//! [`step`] is that decision, pure; the controller performs it.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::axes::axis_enum;
use crate::error::DomainError;
use crate::ids::SiteId;

axis_enum!(
    /// Where a site's brake episode is.
    BrakeStatus {
        /// Liveness makes no `unreachable` or `lost` transitions in the site.
        Paused = "paused",
        /// An admin released the brake: transitions go ahead although the site still
        /// crosses the rule, until the episode ends.
        Released = "released",
    }
);

/// A site's numbers, as the brake reads them on one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BrakeNumbers {
    /// Nodes that would now be marked `unreachable` (no heartbeat for the grace).
    pub silent: u64,
    /// Nodes that became `unreachable` within the brake's window.
    pub recently_unreachable: u64,
    /// Nodes Liveness watches in the site.
    pub watched: u64,
}

/// When a site's numbers trip the brake (`[liveness]` settings).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BrakeRule {
    /// The share of the watched nodes that may go silent (or have recently gone
    /// unreachable) before the brake trips.
    pub share: f64,
    /// Sites with fewer watched nodes are never braked: a handful of machines going dark
    /// together is ordinary.
    pub min_nodes: u64,
}

impl BrakeRule {
    /// How many silent and recently unreachable nodes the site may have.
    pub fn threshold(&self, watched: u64) -> f64 {
        self.share * watched as f64
    }

    /// Whether these numbers trip the brake.
    pub fn trips(&self, n: BrakeNumbers) -> bool {
        n.watched >= self.min_nodes
            && (n.silent + n.recently_unreachable) as f64 > self.threshold(n.watched)
    }
}

/// An admin's release of a brake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrakeRelease {
    /// Who released it (an [`crate::Actor`]'s spelling).
    pub by: String,
    pub reason: String,
    pub at: DateTime<Utc>,
}

/// One site's brake episode, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LivenessBrake {
    pub site_id: SiteId,
    pub status: BrakeStatus,
    /// The numbers when it tripped.
    pub tripped_with: BrakeNumbers,
    pub tripped_at: DateTime<Utc>,
    /// Set once an admin released it.
    pub release: Option<BrakeRelease>,
}

impl LivenessBrake {
    /// A brake that tripped now.
    pub fn tripped(site_id: SiteId, numbers: BrakeNumbers, now: DateTime<Utc>) -> LivenessBrake {
        LivenessBrake {
            site_id,
            status: BrakeStatus::Paused,
            tripped_with: numbers,
            tripped_at: now,
            release: None,
        }
    }

    /// Whether Liveness holds the site's transitions.
    pub fn holds_transitions(&self) -> bool {
        self.status == BrakeStatus::Paused
    }

    /// An admin releases the brake. Only a paused brake can be released.
    pub fn release(
        &mut self,
        by: String,
        reason: String,
        now: DateTime<Utc>,
    ) -> Result<(), DomainError> {
        if reason.trim().is_empty() {
            return Err(DomainError::BadInput(
                "a release needs a reason: say why the site's silent nodes should be marked down"
                    .into(),
            ));
        }
        if self.status != BrakeStatus::Paused {
            return Err(DomainError::BadInput(format!(
                "liveness in site `{}` is not paused: its brake was already released by {}",
                self.site_id,
                self.release.as_ref().map_or("an admin", |r| r.by.as_str())
            )));
        }
        self.status = BrakeStatus::Released;
        self.release = Some(BrakeRelease {
            by,
            reason,
            at: now,
        });
        Ok(())
    }
}

/// What one tick does with a site's brake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrakeStep {
    /// The site crosses the rule and has no brake: store a paused one (and say so).
    Trip,
    /// The site no longer crosses the rule and its brake was paused: forget it (and say
    /// that liveness resumed).
    Resume,
    /// The site no longer crosses the rule and its brake was released: the episode is over;
    /// forget it quietly (the release already resumed liveness).
    Forget,
    /// Nothing changes: still paused, still released, or no brake and no reason for one.
    Stay,
}

/// The decision for one site, from whether its numbers cross the rule now and its stored
/// brake.
pub fn step(crosses: bool, brake: Option<&LivenessBrake>) -> BrakeStep {
    match (crosses, brake.map(|b| b.status)) {
        (true, None) => BrakeStep::Trip,
        (false, Some(BrakeStatus::Paused)) => BrakeStep::Resume,
        (false, Some(BrakeStatus::Released)) => BrakeStep::Forget,
        (true, Some(_)) | (false, None) => BrakeStep::Stay,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).expect("a valid time")
    }

    fn numbers(silent: u64, recently_unreachable: u64, watched: u64) -> BrakeNumbers {
        BrakeNumbers {
            silent,
            recently_unreachable,
            watched,
        }
    }

    #[test]
    fn the_rule_trips_above_the_share_of_big_enough_sites() {
        let rule = BrakeRule {
            share: 0.3,
            min_nodes: 10,
        };
        // (silent, recent, watched) → trips
        let cases = [
            ((6, 0, 20), false),
            ((7, 0, 20), true),
            ((3, 4, 20), true),
            ((0, 0, 20), false),
            ((9, 0, 9), false),
            ((10, 0, 10), true),
        ];
        for ((silent, recent, watched), trips) in cases {
            assert_eq!(
                rule.trips(numbers(silent, recent, watched)),
                trips,
                "{silent} silent + {recent} recent of {watched}"
            );
        }
    }

    #[test]
    fn an_episode_trips_holds_is_released_and_ends() {
        let site = SiteId::generate();
        let mut brake = LivenessBrake::tripped(site, numbers(10, 0, 20), at(0));
        // (crosses, brake) → step
        assert_eq!(step(true, None), BrakeStep::Trip);
        assert_eq!(step(false, None), BrakeStep::Stay);
        assert_eq!(step(true, Some(&brake)), BrakeStep::Stay);
        assert!(brake.holds_transitions());
        assert_eq!(step(false, Some(&brake)), BrakeStep::Resume);

        assert!(
            brake
                .release("user:ops".into(), "  ".into(), at(59))
                .is_err(),
            "a blank reason is refused"
        );
        assert!(brake.holds_transitions(), "and changes nothing");
        brake
            .release("user:ops".into(), "rack 4 lost power".into(), at(60))
            .expect("a paused brake can be released");
        assert!(!brake.holds_transitions());
        assert_eq!(
            step(true, Some(&brake)),
            BrakeStep::Stay,
            "released: the same episode does not trip it again"
        );
        assert_eq!(step(false, Some(&brake)), BrakeStep::Forget);
        assert_eq!(
            brake.release.as_ref().map(|r| (r.by.as_str(), r.at)),
            Some(("user:ops", at(60)))
        );

        let again = brake.release("user:other".into(), "again".into(), at(61));
        assert!(
            matches!(&again, Err(DomainError::BadInput(m)) if m.contains("user:ops")),
            "{again:?}"
        );
        assert_eq!(
            brake.release.as_ref().map(|r| r.by.as_str()),
            Some("user:ops"),
            "a refused release changes nothing"
        );
    }

    #[test]
    fn statuses_are_pinned() {
        let spellings: Vec<&str> = BrakeStatus::ALL.iter().map(|s| s.as_static_str()).collect();
        assert_eq!(spellings, ["paused", "released"]);
    }
}
