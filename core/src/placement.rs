//! Placement: reservations, the allocations that book a node's atoms for them, and the
//! placer's choice of nodes.
//!
//! A reservation asks for `node_count` nodes of one pool with `gpus_per_node` free atoms each.
//! It is a gang: placed all or nothing. Its state moves
//!
//! ```text
//! PENDING ──place──▶ PLACED ──release / expire──▶ RELEASED
//!    ▲                  │
//!    └────evict─────────┘        PENDING ──impossible shape / expired──▶ FAILED
//! ```
//!
//! Every move bumps `version`, so `releaseReservation(id, version)` is refused with `CONFLICT`
//! when the reservation moved since the caller read it. The placer's choice ([`choose`]) is
//! pure: the server feeds it the candidates it has locked and books what it returns; the
//! database's unique index over booked atoms stops a double booking whatever this returns.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::actor::Actor;
use crate::axes::axis_enum;
use crate::error::DomainError;
use crate::event::EventType;
use crate::ids::{AllocationId, NodeId, PoolId, ReservationId, TenantId};
use crate::schedule::CapacityBucket;

/// The most GPUs one reservation may ask for on one node: larger than any machine built today,
/// small enough that a typo (`8000`) is refused instead of waiting forever.
pub const MAX_GPUS_PER_NODE: u32 = 64;
/// The most nodes one gang may span.
pub const MAX_NODE_COUNT: u32 = 1024;
/// The most label requirements and tolerations one reservation may carry.
pub const MAX_SELECTOR_TERMS: usize = 32;

axis_enum!(
    /// Where a reservation is in its life.
    ReservationState {
        /// Waiting for capacity; `reason` says what is missing. Retried when capacity changes.
        Pending = "pending",
        /// Every node of the gang is booked.
        Placed = "placed",
        /// Released by its owner, or expired after it was placed. Final.
        Released = "released",
        /// Can never be placed (its shape fits no node of the pool any more), or expired while
        /// pending. Final; `reason` says why.
        Failed = "failed",
    }
);

axis_enum!(
    /// How the placer picks among nodes that fit.
    PlacementPolicy {
        /// Fullest node first: keeps whole nodes free for large shapes. The default.
        BinPack = "bin-pack",
        /// Emptiest node first: spreads work to limit the blast radius of one node.
        Spread = "spread",
    }
);

impl ReservationState {
    /// Whether the reservation can still change (PENDING or PLACED).
    pub fn is_live(self) -> bool {
        matches!(self, ReservationState::Pending | ReservationState::Placed)
    }
}

/// A label requirement of a reservation: the node has the label, with this value if given.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LabelRequirement {
    pub key: String,
    pub value: Option<String>,
}

/// What a reservation asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shape {
    /// Free atoms (whole GPUs today) wanted on each node.
    pub gpus_per_node: u32,
    /// Nodes in the gang; all are booked in one transaction or none.
    pub node_count: u32,
    /// Only GPUs of this model count (`NVIDIA H100 80GB HBM3`, as the inventory reports it).
    pub gpu_model: Option<String>,
    /// Every requirement must hold on a node (Kubernetes `matchLabels` / `Exists`).
    pub selector: Vec<LabelRequirement>,
    /// Keys of `NoSchedule` (and `NoExecute`) taints the work tolerates: a node whose only
    /// `noScheduleReasons` are `taint:<key>` for these keys may still take it.
    pub tolerations: Vec<String>,
}

impl Shape {
    /// Checks the numbers against their documented ranges.
    pub fn validate(&self) -> Result<(), DomainError> {
        if !(1..=MAX_GPUS_PER_NODE).contains(&self.gpus_per_node) {
            return Err(DomainError::BadInput(format!(
                "gpusPerNode must be between 1 and {MAX_GPUS_PER_NODE}, not {}",
                self.gpus_per_node
            )));
        }
        if !(1..=MAX_NODE_COUNT).contains(&self.node_count) {
            return Err(DomainError::BadInput(format!(
                "nodeCount must be between 1 and {MAX_NODE_COUNT}, not {}",
                self.node_count
            )));
        }
        if self.selector.len() > MAX_SELECTOR_TERMS || self.tolerations.len() > MAX_SELECTOR_TERMS {
            return Err(DomainError::BadInput(format!(
                "a reservation takes at most {MAX_SELECTOR_TERMS} label requirements and \
                 {MAX_SELECTOR_TERMS} tolerations"
            )));
        }
        Ok(())
    }

    /// The `noScheduleReasons` keys the shape tolerates (`taint:<key>`).
    pub fn tolerated_reasons(&self) -> Vec<String> {
        self.tolerations
            .iter()
            .map(|key| format!("{}{key}", crate::reason::ReasonKey::TAINT_PREFIX))
            .collect()
    }

    /// A short description for messages: "2 nodes × 8 GPUs (H100)".
    pub fn describe(&self) -> String {
        let nodes = plural(u64::from(self.node_count), "node", "nodes");
        let gpus = plural(u64::from(self.gpus_per_node), "GPU", "GPUs");
        match &self.gpu_model {
            Some(model) => format!("{nodes} × {gpus} ({model})"),
            None => format!("{nodes} × {gpus}"),
        }
    }
}

fn plural(n: u64, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// What `createReservation` asks for, before it is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewReservation {
    pub tenant_id: TenantId,
    pub pool_id: PoolId,
    pub shape: Shape,
    pub policy: PlacementPolicy,
    /// Repeating a create with the same key (per tenant) returns the first reservation
    /// instead of creating a second: a client may retry after a timeout safely.
    pub idempotency_key: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// A reservation as the domain sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub id: ReservationId,
    pub tenant_id: TenantId,
    pub pool_id: PoolId,
    pub shape: Shape,
    pub policy: PlacementPolicy,
    pub state: ReservationState,
    /// Why it is PENDING (what capacity is missing), FAILED, or RELEASED.
    pub reason: Option<String>,
    pub idempotency_key: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
    pub version: i64,
    pub created_by: Actor,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// One move of a reservation: the event it writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationChange {
    pub event_type: EventType,
    pub from: Option<ReservationState>,
    pub to: ReservationState,
    pub detail: Option<String>,
}

impl Reservation {
    /// A new reservation, PENDING until the placer books it.
    pub fn new(
        new: NewReservation,
        by: Actor,
        now: DateTime<Utc>,
    ) -> Result<(Reservation, ReservationChange), DomainError> {
        new.shape.validate()?;
        if let Some(expires_at) = new.expires_at
            && expires_at <= now
        {
            return Err(DomainError::BadInput(format!(
                "expiresAt {expires_at} is not in the future"
            )));
        }
        let reservation = Reservation {
            id: ReservationId::generate(),
            tenant_id: new.tenant_id,
            pool_id: new.pool_id,
            shape: new.shape,
            policy: new.policy,
            state: ReservationState::Pending,
            reason: None,
            idempotency_key: new.idempotency_key,
            expires_at: new.expires_at,
            version: 1,
            created_by: by,
            created_at: now,
            updated_at: now,
        };
        let change = ReservationChange {
            event_type: EventType::ReservationCreated,
            from: None,
            to: ReservationState::Pending,
            detail: Some(reservation.shape.describe()),
        };
        Ok((reservation, change))
    }

    /// `version` check: the caller passes the version it read.
    pub fn expect_version(&self, expected: i64) -> Result<(), DomainError> {
        if self.version == expected {
            Ok(())
        } else {
            Err(DomainError::Conflict {
                expected,
                current: self.version,
            })
        }
    }

    fn move_to(
        &mut self,
        to: ReservationState,
        event_type: EventType,
        reason: Option<String>,
        now: DateTime<Utc>,
    ) -> ReservationChange {
        let from = self.state;
        self.state = to;
        self.reason.clone_from(&reason);
        self.version += 1;
        self.updated_at = now;
        ReservationChange {
            event_type,
            from: Some(from),
            to,
            detail: reason,
        }
    }

    fn refuse(&self, attempted: &str) -> DomainError {
        DomainError::ReservationState {
            id: self.id.to_string(),
            current: self.state.to_string(),
            attempted: attempted.to_owned(),
        }
    }

    /// PENDING → PLACED: the placer booked every node of the gang.
    pub fn place(
        &mut self,
        nodes: &[NodeId],
        now: DateTime<Utc>,
    ) -> Result<ReservationChange, DomainError> {
        if self.state != ReservationState::Pending {
            return Err(self.refuse("place"));
        }
        let list: Vec<&str> = nodes.iter().map(NodeId::as_str).collect();
        let mut change = self.move_to(
            ReservationState::Placed,
            EventType::ReservationPlaced,
            None,
            now,
        );
        change.detail = Some(format!("on {}", list.join(", ")));
        Ok(change)
    }

    /// Records why a PENDING reservation could not be placed this time. Not a move: no new
    /// version and no event, so a retry that fails again does not make the owner's next
    /// `releaseReservation` a `CONFLICT`. Returns whether the explanation changed.
    pub fn explain_pending(&mut self, explanation: String, now: DateTime<Utc>) -> bool {
        if self.state != ReservationState::Pending || self.reason.as_ref() == Some(&explanation) {
            return false;
        }
        self.reason = Some(explanation);
        self.updated_at = now;
        true
    }

    /// PLACED → PENDING: its allocations were evicted (drain deadline, lost node, `NoExecute`
    /// taint); the placer books it elsewhere.
    pub fn evicted(
        &mut self,
        why: &str,
        now: DateTime<Utc>,
    ) -> Result<ReservationChange, DomainError> {
        if self.state != ReservationState::Placed {
            return Err(self.refuse("evict"));
        }
        Ok(self.move_to(
            ReservationState::Pending,
            EventType::ReservationEvicted,
            Some(why.to_owned()),
            now,
        ))
    }

    /// PENDING or PLACED → RELEASED, by its owner (`releaseReservation`) or at expiry once
    /// placed.
    pub fn release(
        &mut self,
        why: &str,
        now: DateTime<Utc>,
    ) -> Result<ReservationChange, DomainError> {
        if !self.state.is_live() {
            return Err(self.refuse("release"));
        }
        Ok(self.move_to(
            ReservationState::Released,
            EventType::ReservationReleased,
            Some(why.to_owned()),
            now,
        ))
    }

    /// PENDING → FAILED: the shape can never be placed, or the reservation expired before it
    /// was.
    pub fn fail(
        &mut self,
        why: &str,
        now: DateTime<Utc>,
    ) -> Result<ReservationChange, DomainError> {
        if self.state != ReservationState::Pending {
            return Err(self.refuse("fail"));
        }
        Ok(self.move_to(
            ReservationState::Failed,
            EventType::ReservationFailed,
            Some(why.to_owned()),
            now,
        ))
    }

    /// What expiry at `now` does to this reservation, if it is due: a placed one is released,
    /// a pending one fails.
    pub fn expire(&mut self, now: DateTime<Utc>) -> Option<ReservationChange> {
        let due = self.expires_at.is_some_and(|at| at <= now);
        match self.state {
            _ if !due => None,
            ReservationState::Placed => self.release("expired", now).ok(),
            ReservationState::Pending => self.fail("expired before it could be placed", now).ok(),
            ReservationState::Released | ReservationState::Failed => None,
        }
    }
}

/// Atoms of one node booked for one reservation. Active until `released_at` is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocationId,
    pub reservation_id: ReservationId,
    pub tenant_id: TenantId,
    pub pool_id: PoolId,
    pub node_id: NodeId,
    /// The booked atoms, in device order (`gpu0/whole`, …).
    pub atoms: Vec<String>,
    pub booked_at: DateTime<Utc>,
    pub released_at: Option<DateTime<Utc>>,
    /// Why it ended: the reservation was released, or the allocation was evicted (and why).
    pub release_reason: Option<String>,
}

impl Allocation {
    pub fn is_active(&self) -> bool {
        self.released_at.is_none()
    }
}

/// A node the placer may book, with its free atoms (locked by the placer's transaction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: NodeId,
    /// Free atoms of the wanted model, in device order.
    pub free_atoms: Vec<String>,
    /// The node carries a `PreferNoSchedule` taint the shape does not tolerate: used only when
    /// nothing else fits.
    pub discouraged: bool,
}

/// One node's part of a placement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub node_id: NodeId,
    pub atoms: Vec<String>,
}

/// The placer's choice: `node_count` distinct nodes with `gpus_per_node` free atoms each, or
/// `None` when the gang does not fit (all or nothing).
///
/// Nodes carrying a taint the work would rather avoid come last. Among the rest, bin-packing
/// takes the fullest node that fits (fewest free atoms), so whole nodes stay free for large
/// shapes; spreading takes the emptiest. Ties go to the lower node id, so the choice is
/// deterministic.
pub fn choose(
    shape: &Shape,
    policy: PlacementPolicy,
    candidates: &[Candidate],
) -> Option<Vec<Booking>> {
    let wanted = shape.gpus_per_node as usize;
    let mut fitting: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.free_atoms.len() >= wanted)
        .collect();
    fitting.sort_by(|a, b| {
        let by_free = match policy {
            PlacementPolicy::BinPack => a.free_atoms.len().cmp(&b.free_atoms.len()),
            PlacementPolicy::Spread => b.free_atoms.len().cmp(&a.free_atoms.len()),
        };
        a.discouraged
            .cmp(&b.discouraged)
            .then(by_free)
            .then_with(|| a.node_id.cmp(&b.node_id))
    });
    fitting.dedup_by(|a, b| a.node_id == b.node_id);
    if fitting.len() < shape.node_count as usize {
        return None;
    }
    Some(
        fitting
            .into_iter()
            .take(shape.node_count as usize)
            .map(|c| Booking {
                node_id: c.node_id.clone(),
                atoms: c.free_atoms.iter().take(wanted).cloned().collect(),
            })
            .collect(),
    )
}

/// Whether an event may let a pending reservation fit where it did not: any change to a node
/// (uncordoned, reconnected, a reason cleared, new devices, …), a released allocation, or a
/// reservation evicted back to PENDING. Events that only consume capacity (a booking, a
/// placement, a new reservation, which was tried when created) and command events do not.
pub fn may_free_capacity(event_type: EventType) -> bool {
    let spelling = event_type.as_static_str();
    spelling.starts_with("node.")
        || matches!(
            event_type,
            EventType::AllocationReleased | EventType::ReservationEvicted
        )
}

/// How many of a pool's nodes are big enough for a shape, grouped by what stops them: the
/// input of [`explain_unplaced`], computed by the server from the capacity buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FitCount {
    /// The node's capacity bucket (`schedulable` for one that could take work now).
    pub bucket: CapacityBucket,
    /// The node may take this reservation (schedulable, or held back only by taints the shape
    /// tolerates, and allowed by trust).
    pub placeable: bool,
    /// The node has enough free atoms of the wanted model now.
    pub enough_free: bool,
    pub nodes: u64,
}

/// Why a reservation stays PENDING, in the operator's words: "needs 2 nodes with 8 free GPUs:
/// 1 node has 8 free; 3 are big enough but busy; 3 are in maintenance or cordoned; …".
/// `fits` counts only nodes with enough healthy GPUs of the model in total.
pub fn explain_unplaced(shape: &Shape, fits: &[FitCount]) -> String {
    let model = shape
        .gpu_model
        .as_ref()
        .map_or_else(String::new, |m| format!(" of model {m}"));
    let mut text = format!(
        "needs {} with {} free{model}",
        plural(u64::from(shape.node_count), "node", "nodes"),
        plural(u64::from(shape.gpus_per_node), "GPU", "GPUs"),
    );
    let total: u64 = fits.iter().map(|f| f.nodes).sum();
    if total == 0 {
        text.push_str(": no node of the pool has that many healthy GPUs");
        return text;
    }
    let mut by_reason: BTreeMap<u8, (String, u64)> = BTreeMap::new();
    for fit in fits.iter().filter(|f| f.nodes > 0) {
        let (order, what) = match (fit.placeable, fit.enough_free, fit.bucket) {
            (true, true, _) => (0, "free now".to_owned()),
            (true, false, _) => (1, "big enough but busy".to_owned()),
            (false, _, CapacityBucket::Schedulable) => (
                2,
                "held back by a taint it does not tolerate or by trust".to_owned(),
            ),
            (false, _, CapacityBucket::Maintenance) => (3, "in maintenance or cordoned".to_owned()),
            (false, _, CapacityBucket::Unreachable) => (4, "unreachable".to_owned()),
            (false, _, CapacityBucket::Unhealthy) => {
                (5, "unhealthy (noScheduleReasons not empty)".to_owned())
            }
            (false, _, CapacityBucket::Provisioning) => (6, "provisioning".to_owned()),
            (false, _, CapacityBucket::Excluded) => (7, "excluded (role or trust)".to_owned()),
        };
        by_reason.entry(order).or_insert((what, 0)).1 += fit.nodes;
    }
    text.push(':');
    let mut first = true;
    for (what, nodes) in by_reason.values() {
        let sep = if first { " " } else { "; " };
        first = false;
        let _ = write!(
            text,
            "{sep}{} {} {what}",
            nodes,
            if *nodes == 1 { "node is" } else { "nodes are" }
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(gpus: u32, nodes: u32) -> Shape {
        Shape {
            gpus_per_node: gpus,
            node_count: nodes,
            gpu_model: None,
            selector: Vec::new(),
            tolerations: Vec::new(),
        }
    }

    fn candidate(id: &str, free: usize) -> Candidate {
        Candidate {
            node_id: NodeId::parse(id).expect("valid id"),
            free_atoms: (0..free).map(|i| format!("gpu{i}/whole")).collect(),
            discouraged: false,
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2026-12-03T10:00:00Z")
            .expect("valid time")
            .with_timezone(&Utc)
    }

    fn pending() -> Reservation {
        Reservation::new(
            NewReservation {
                tenant_id: TenantId::parse("ten_a").expect("valid"),
                pool_id: PoolId::parse("pool_a").expect("valid"),
                shape: shape(8, 1),
                policy: PlacementPolicy::BinPack,
                idempotency_key: None,
                expires_at: Some(now() + chrono::Duration::hours(1)),
            },
            Actor::User("alice".into()),
            now(),
        )
        .expect("valid")
        .0
    }

    #[test]
    fn bin_packing_takes_the_fullest_node_that_fits_and_spreading_the_emptiest() {
        let nodes = [
            candidate("node_a", 8),
            candidate("node_b", 2),
            candidate("node_c", 4),
            candidate("node_d", 1),
        ];
        let packed = choose(&shape(2, 1), PlacementPolicy::BinPack, &nodes).expect("fits");
        assert_eq!(packed[0].node_id.as_str(), "node_b");
        assert_eq!(packed[0].atoms, ["gpu0/whole", "gpu1/whole"]);
        let spread = choose(&shape(2, 2), PlacementPolicy::Spread, &nodes).expect("fits");
        let ids: Vec<&str> = spread.iter().map(|b| b.node_id.as_str()).collect();
        assert_eq!(ids, ["node_a", "node_c"]);
    }

    #[test]
    fn a_gang_is_all_or_nothing_and_discouraged_nodes_come_last() {
        let mut nodes = vec![candidate("node_a", 8), candidate("node_b", 8)];
        assert!(choose(&shape(8, 3), PlacementPolicy::BinPack, &nodes).is_none());
        nodes[0].discouraged = true;
        let one = choose(&shape(8, 1), PlacementPolicy::BinPack, &nodes).expect("fits");
        assert_eq!(one[0].node_id.as_str(), "node_b");
        let two = choose(&shape(8, 2), PlacementPolicy::BinPack, &nodes).expect("fits");
        assert_eq!(two.len(), 2);
    }

    #[test]
    fn states_move_only_along_the_diagram_and_bump_the_version() {
        let mut r = pending();
        assert_eq!(r.version, 1);
        let node = NodeId::parse("node_a").expect("valid");
        let placed = r
            .place(std::slice::from_ref(&node), now())
            .expect("pending → placed");
        assert_eq!(
            (placed.from, placed.to),
            (Some(ReservationState::Pending), ReservationState::Placed)
        );
        assert_eq!(r.version, 2);
        assert!(r.place(&[node], now()).is_err(), "placed twice");
        r.evicted("drain deadline passed", now())
            .expect("placed → pending");
        assert_eq!(r.state, ReservationState::Pending);
        assert!(r.explain_pending("needs 1 node".into(), now()));
        assert!(
            !r.explain_pending("needs 1 node".into(), now()),
            "same explanation"
        );
        assert_eq!(r.version, 3, "an explanation is not a move");
        r.release("done", now()).expect("pending → released");
        let err = r.release("again", now()).expect_err("released is final");
        assert!(err.to_string().contains("released"), "{err}");
        assert!(r.fail("x", now()).is_err());
    }

    #[test]
    fn expiry_releases_placed_and_fails_pending_reservations() {
        let later = now() + chrono::Duration::hours(2);
        let mut waiting = pending();
        assert_eq!(waiting.expire(now()), None, "not due yet");
        assert_eq!(
            waiting.expire(later).map(|c| c.to),
            Some(ReservationState::Failed)
        );
        let mut running = pending();
        running
            .place(&[NodeId::parse("node_a").expect("valid")], now())
            .expect("placed");
        assert_eq!(
            running.expire(later).map(|c| c.to),
            Some(ReservationState::Released)
        );
        assert_eq!(running.expire(later), None, "already released");
    }

    #[test]
    fn shapes_outside_their_ranges_are_refused() {
        for bad in [
            shape(0, 1),
            shape(MAX_GPUS_PER_NODE + 1, 1),
            shape(1, 0),
            shape(1, MAX_NODE_COUNT + 1),
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(shape(8, 4).validate().is_ok());
        assert_eq!(shape(8, 2).describe(), "2 nodes × 8 GPUs");
        assert_eq!(shape(1, 1).tolerated_reasons(), Vec::<String>::new());
    }

    #[test]
    fn the_pending_explanation_counts_nodes_by_what_stops_them() {
        let fits = [
            FitCount {
                bucket: CapacityBucket::Maintenance,
                placeable: false,
                enough_free: true,
                nodes: 3,
            },
            FitCount {
                bucket: CapacityBucket::Unreachable,
                placeable: false,
                enough_free: true,
                nodes: 2,
            },
            FitCount {
                bucket: CapacityBucket::Schedulable,
                placeable: true,
                enough_free: false,
                nodes: 1,
            },
            FitCount {
                bucket: CapacityBucket::Schedulable,
                placeable: true,
                enough_free: true,
                nodes: 1,
            },
        ];
        assert_eq!(
            explain_unplaced(&shape(8, 2), &fits),
            "needs 2 nodes with 8 GPUs free: 1 node is free now; 1 node is big enough but busy; \
             3 nodes are in maintenance or cordoned; 2 nodes are unreachable"
        );
        assert_eq!(
            explain_unplaced(&shape(8, 1), &[]),
            "needs 1 node with 8 GPUs free: no node of the pool has that many healthy GPUs"
        );
    }

    #[test]
    fn only_events_that_may_free_capacity_wake_the_placer() {
        assert!(may_free_capacity(EventType::NodeUncordoned));
        assert!(may_free_capacity(EventType::NodeConnectivityChanged));
        assert!(may_free_capacity(EventType::AllocationReleased));
        assert!(may_free_capacity(EventType::ReservationEvicted));
        assert!(!may_free_capacity(EventType::AllocationBooked));
        assert!(!may_free_capacity(EventType::ReservationPlaced));
        assert!(!may_free_capacity(EventType::ReservationCreated));
        assert!(!may_free_capacity(EventType::CommandQueued));
    }

    proptest! {
        /// Whatever the candidates, a choice books distinct nodes, exactly the shape's atoms on
        /// each, only atoms that were free, and all of the gang or nothing.
        #[test]
        fn choices_book_only_free_atoms_of_distinct_nodes(
            free in proptest::collection::vec(0usize..10, 0..12),
            discouraged in proptest::collection::vec(any::<bool>(), 12),
            gpus in 1u32..9,
            nodes in 1u32..6,
            spread in any::<bool>(),
        ) {
            let candidates: Vec<Candidate> = free.iter().enumerate().map(|(i, n)| Candidate {
                discouraged: discouraged[i],
                ..candidate(&format!("node_{i:02}"), *n)
            }).collect();
            let policy = if spread { PlacementPolicy::Spread } else { PlacementPolicy::BinPack };
            let fitting = free.iter().filter(|n| **n >= gpus as usize).count();
            match choose(&shape(gpus, nodes), policy, &candidates) {
                None => prop_assert!(fitting < nodes as usize),
                Some(bookings) => {
                    prop_assert_eq!(bookings.len(), nodes as usize);
                    let mut ids: Vec<&NodeId> = bookings.iter().map(|b| &b.node_id).collect();
                    ids.sort();
                    ids.dedup();
                    prop_assert_eq!(ids.len(), nodes as usize);
                    for booking in &bookings {
                        let c = candidates.iter().find(|c| c.node_id == booking.node_id).expect("a candidate");
                        prop_assert_eq!(booking.atoms.len(), gpus as usize);
                        prop_assert!(booking.atoms.iter().all(|a| c.free_atoms.contains(a)));
                    }
                }
            }
        }
    }
}
