//! Placement's use cases: create, release and read reservations; the placer that books them;
//! evictions; pool offers.
//!
//! **The placer** ([`Services::place_in`]) runs inside the transaction that changes the
//! reservation: it selects candidates with the placement predicate (`schedulableSql`'s checks
//! with the reservation's tolerations, trust and label selector) and enough free atoms,
//! locks the node rows it may book (`FOR UPDATE SKIP LOCKED` on PostgreSQL), re-reads their
//! free atoms, lets the pure [`choose`] pick the gang, books, and writes the reservation's
//! move and the events, all in that one transaction. A cordon that committed first makes the
//! node fail the locked re-check; one that comes later waits for the placer's commit.
//!
//! **Lock order** (ARCHITECTURE.md, Invariants): node rows before reservation rows, as every
//! node change does (an eviction locks the node, then every reservation on it, then the
//! free-atom counts of their nodes). The placer
//! takes the reservation first and node rows after, but only with `SKIP LOCKED`, so it never
//! waits for a node row and cannot close a cycle.
//!
//! **Retries** are event-driven: [`crate::placement::PlacementLoop`] follows the event feed
//! and calls [`Services::place_pending`] for each pool whose capacity may have grown.

use bc_core::Actor;
use bc_core::event::EventType;
use bc_core::ids::{AllocationId, NodeId, PoolId, ReservationId, TenantId};
use bc_core::node::NodeRecord;
use bc_core::placement::{
    Allocation, Candidate, NewReservation, Reservation, ReservationChange, ReservationState,
    choose, explain_unplaced,
};
use chrono::{DateTime, Utc};
use serde_json::json;
use std::collections::HashMap;

use super::Services;
use super::store::placement::{self as store, ModelCapacity, ReservationFilter};
use super::store::{WriteTxn, catalog, events};
use crate::auth::{Principal, Role};
use crate::error::{ApiError, ApiResult};

/// Candidates the placer reads per node it needs: room for rows that are locked by others or
/// fail the locked re-check, without reading the whole pool.
const CANDIDATES_PER_NODE: u64 = 4;
/// Candidates read at least, whatever the gang's size.
const MIN_CANDIDATES: u64 = 16;
/// Pending reservations one retry pass places per pool; the rest wait for the next signal
/// (the pass itself signals again when it hit this bound).
pub const PENDING_BATCH: u64 = 100;
/// Reservations expired per controller tick.
const EXPIRY_BATCH: u64 = 500;
/// The most allocations listed with one reservation or node.
const MAX_LISTED_ALLOCATIONS: u64 = 1000;

fn not_found(id: &ReservationId) -> ApiError {
    ApiError::NotFound(format!("reservation `{id}` does not exist"))
}

fn pool_not_found(id: &PoolId) -> ApiError {
    ApiError::NotFound(format!("pool `{id}` does not exist"))
}

/// What `createReservation` asks for, as the API received it.
#[derive(Debug, Clone)]
pub struct ReservationRequest {
    /// Whose reservation: a tenant token's own tenant; a platform principal must name one.
    pub tenant_id: Option<TenantId>,
    pub pool_id: PoolId,
    pub shape: bc_core::placement::Shape,
    pub policy: bc_core::placement::PlacementPolicy,
    pub idempotency_key: Option<String>,
    pub expires_at: Option<DateTime<Utc>>,
}

/// One page of reservations.
pub struct ReservationPage {
    pub reservations: Vec<Reservation>,
    pub has_next_page: bool,
}

/// `BAD_USER_INPUT` if no live node of the reservation's pool has as many healthy GPUs (of
/// its model, if given) as it asks for per node: it could never be placed.
async fn refuse_larger_than_any_node(txn: &WriteTxn, new: &NewReservation) -> ApiResult<()> {
    let largest = store::largest_node(&**txn, &new.pool_id, new.shape.gpu_model.as_deref()).await?;
    if largest > 0 && largest < i64::from(new.shape.gpus_per_node) {
        return Err(ApiError::BadUserInput(format!(
            "no node of pool `{}` has {} healthy GPUs{}: the largest has {largest}",
            new.pool_id,
            new.shape.gpus_per_node,
            new.shape
                .gpu_model
                .as_ref()
                .map_or_else(String::new, |m| format!(" of model {m}")),
        )));
    }
    Ok(())
}

/// What one attempt to place a reservation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    /// Every node of the gang is booked.
    Booked,
    /// It stays pending. `contended`: some candidates were locked by other transactions and
    /// skipped, so capacity may exist that this attempt could not see; try again soon.
    StillPending { contended: bool },
    /// Not pending (released, failed or placed meanwhile): nothing to do.
    NotPending,
}

/// What one retry pass over a pool did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlacementReport {
    pub placed: usize,
    pub still_pending: usize,
    /// The pass should run again soon: it hit [`PENDING_BATCH`] or met contended candidates.
    pub retry: bool,
}

/// Capacity of a pool's schedulable nodes by GPU model.
pub type SchedulableByModel = Vec<ModelCapacity>;

impl Services {
    /// `createReservation`: stores it PENDING and tries to place it in the same transaction,
    /// so a reservation that fits comes back PLACED.
    pub async fn create_reservation(
        &self,
        principal: &Principal,
        request: ReservationRequest,
    ) -> ApiResult<Reservation> {
        principal.require(Role::Operator)?;
        let tenant = match (&principal.tenant, request.tenant_id) {
            (Some(own), None) => own.clone(),
            (Some(own), Some(asked)) if &asked == own => asked,
            (Some(_), Some(_)) => {
                return Err(ApiError::Forbidden(
                    "a tenant token reserves for its own tenant only".into(),
                ));
            }
            (None, Some(asked)) => asked,
            (None, None) => {
                return Err(ApiError::BadUserInput(
                    "a platform principal must name the tenant the reservation is for (tenantId)"
                        .into(),
                ));
            }
        };
        let new = NewReservation {
            tenant_id: tenant.clone(),
            pool_id: request.pool_id,
            shape: request.shape,
            policy: request.policy,
            idempotency_key: request.idempotency_key,
            expires_at: request.expires_at,
        };
        let actor = principal.actor();
        let txn = self.store.write().await?;
        if catalog::tenant(&*txn, &tenant).await?.is_none() {
            return Err(ApiError::NotFound(format!(
                "tenant `{tenant}` does not exist"
            )));
        }
        self.check_may_reserve_in(&txn, &tenant, &new.pool_id)
            .await?;
        if let Some(key) = &new.idempotency_key
            && let Some(existing) = store::find_by_idempotency_key(&*txn, &tenant, key).await?
        {
            return same_request(existing, &new);
        }
        let now = self.clock.now();
        let (mut reservation, created) = Reservation::new(new.clone(), actor.clone(), now)?;
        if !store::insert_reservation(&*txn, &reservation).await? {
            // A create with the same key committed meanwhile (this one waited for it).
            let key = reservation.idempotency_key.as_deref().unwrap_or_default();
            let existing = store::find_by_idempotency_key(&*txn, &tenant, key)
                .await?
                .ok_or_else(|| {
                    anyhow::anyhow!("reservation with idempotency key `{key}` vanished")
                })?;
            return same_request(existing, &new);
        }
        append_move(&txn, &reservation, &created, &actor, now);
        let placed = self.place_in(&txn, &mut reservation, &actor).await?;
        // A shape larger than any node of the pool is bad input, and the transaction is
        // dropped with nothing written. Only a reservation that stays pending can be one: a
        // booked one fitted. Asked only then, because the question walks every device of
        // the pool (1.5 s per create at 10,000 nodes on PostgreSQL, under load).
        if placed != Placed::Booked {
            refuse_larger_than_any_node(&txn, &new).await?;
        }
        txn.commit().await?;
        if placed == (Placed::StillPending { contended: true }) {
            self.placement_retry.request(&reservation.pool_id);
        }
        Ok(reservation)
    }

    /// Whether `tenant` may reserve in `pool`: its own pool, or one offered to it. Anything
    /// else is `NOT_FOUND`, as if the pool did not exist.
    async fn check_may_reserve_in(
        &self,
        txn: &WriteTxn,
        tenant: &TenantId,
        pool: &PoolId,
    ) -> ApiResult<()> {
        let found = catalog::pool(&**txn, pool)
            .await?
            .ok_or_else(|| pool_not_found(pool))?;
        let allowed = found.owner_tenant_id.as_ref() == Some(tenant)
            || store::is_offered(&**txn, pool, tenant).await?;
        if allowed {
            Ok(())
        } else {
            Err(pool_not_found(pool))
        }
    }

    /// `releaseReservation(id, version)`: frees its atoms and ends it.
    pub async fn release_reservation(
        &self,
        principal: &Principal,
        id: &ReservationId,
        version: i64,
    ) -> ApiResult<Reservation> {
        principal.require(Role::Operator)?;
        let actor = principal.actor();
        let txn = self.store.write().await?;
        let mut reservation = store::load_reservation(&*txn, id, true)
            .await?
            .filter(|r| principal.can_see(Some(&r.tenant_id)))
            .ok_or_else(|| not_found(id))?;
        reservation.expect_version(version)?;
        let now = self.clock.now();
        let change = reservation.release("released by its owner", now)?;
        self.end_allocations_in(&txn, &reservation, "reservation released", &actor, now)
            .await?;
        self.save_move(&txn, &reservation, version, &change, &actor, now)
            .await?;
        txn.commit().await?;
        Ok(reservation)
    }

    /// `reservation(id)`.
    pub async fn reservation(
        &self,
        principal: &Principal,
        id: &ReservationId,
    ) -> ApiResult<Reservation> {
        store::load_reservation(self.store.db(), id, false)
            .await?
            .filter(|r| principal.can_see(Some(&r.tenant_id)))
            .ok_or_else(|| not_found(id))
    }

    /// `reservations(filter, first, after)`, newest first.
    pub async fn reservations(
        &self,
        principal: &Principal,
        mut filter: ReservationFilter,
        after: Option<&str>,
        first: u64,
    ) -> ApiResult<ReservationPage> {
        filter.tenant = principal.tenant.clone();
        let mut reservations =
            store::list_reservations(self.store.db(), &filter, after, first + 1).await?;
        let has_next_page = reservations.len() as u64 > first;
        reservations.truncate(first as usize);
        Ok(ReservationPage {
            reservations,
            has_next_page,
        })
    }

    pub async fn count_reservations(
        &self,
        principal: &Principal,
        mut filter: ReservationFilter,
    ) -> ApiResult<u64> {
        filter.tenant = principal.tenant.clone();
        Ok(store::count_reservations(self.store.db(), &filter).await?)
    }

    /// A reservation's allocations, active first (the principal already read the reservation).
    pub async fn reservation_allocations(&self, id: &ReservationId) -> ApiResult<Vec<Allocation>> {
        Ok(store::of_reservation(self.store.db(), id, MAX_LISTED_ALLOCATIONS).await?)
    }

    /// The active allocations on a node that the principal may see (a tenant sees its own).
    pub async fn node_allocations(
        &self,
        principal: &Principal,
        node: &NodeId,
    ) -> ApiResult<Vec<Allocation>> {
        let mut all = store::active_on_nodes(self.store.db(), std::slice::from_ref(node)).await?;
        all.retain(|a| principal.can_see(Some(&a.tenant_id)));
        Ok(all)
    }

    /// Allocated and free GPUs of schedulable nodes, per pool and model.
    pub async fn schedulable_by_model(&self, pool_ids: &[String]) -> ApiResult<SchedulableByModel> {
        Ok(store::schedulable_by_model(self.store.db(), pool_ids).await?)
    }

    /// The tenants each pool is offered to.
    pub async fn pool_offers(
        &self,
        pool_ids: &[String],
    ) -> ApiResult<HashMap<String, Vec<String>>> {
        Ok(store::offers_of(self.store.db(), pool_ids).await?)
    }

    /// `offerPool(poolId, tenantId)`: lets the tenant reserve in a platform pool. The offering
    /// validator refuses a pool holding another tenant's `tenant-owned` node (its capacity
    /// belongs to its owner alone) and a pool another tenant owns.
    pub async fn offer_pool(
        &self,
        principal: &Principal,
        pool: &PoolId,
        tenant: &TenantId,
    ) -> ApiResult<bc_core::catalog::Pool> {
        principal.require_platform_admin()?;
        let txn = self.store.write().await?;
        let found = catalog::pool(&*txn, pool)
            .await?
            .ok_or_else(|| pool_not_found(pool))?;
        if catalog::tenant(&*txn, tenant).await?.is_none() {
            return Err(ApiError::NotFound(format!(
                "tenant `{tenant}` does not exist"
            )));
        }
        if let Some(owner) = &found.owner_tenant_id
            && owner != tenant
        {
            return Err(ApiError::BadUserInput(format!(
                "pool `{pool}` belongs to tenant `{owner}`; only platform pools are offered"
            )));
        }
        let foreign = store::foreign_tenant_owned_nodes(&*txn, pool, tenant).await?;
        if foreign > 0 {
            return Err(ApiError::BadUserInput(format!(
                "pool `{pool}` holds {foreign} tenant-owned node(s) of another tenant; their \
                 capacity belongs to their owner, so the pool cannot be offered to `{tenant}`"
            )));
        }
        let now = self.clock.now();
        let actor = principal.actor();
        if store::offer_pool(&*txn, pool, tenant, &actor.to_string(), now).await? {
            events::append_other(
                &txn,
                EventType::PoolOffered,
                Some(tenant.as_str()),
                &actor,
                json!({ "poolId": pool, "tenantId": tenant }),
                now,
            );
        }
        txn.commit().await?;
        Ok(found)
    }

    /// One retry pass over `pool`'s pending reservations, oldest first, each in its own
    /// transaction (so one reservation's failure does not hold back the others).
    pub async fn place_pending(&self, pool: &PoolId, actor: &Actor) -> ApiResult<PlacementReport> {
        let pending = store::pending_in_pool(self.store.db(), pool, PENDING_BATCH).await?;
        let mut report = PlacementReport {
            retry: pending.len() as u64 == PENDING_BATCH,
            ..PlacementReport::default()
        };
        for id in pending {
            let txn = self.store.write().await?;
            let Some(mut reservation) = store::load_reservation(&*txn, &id, true).await? else {
                continue;
            };
            let placed = self.place_in(&txn, &mut reservation, actor).await?;
            txn.commit().await?;
            match placed {
                Placed::Booked => report.placed += 1,
                Placed::StillPending { contended } => {
                    report.still_pending += 1;
                    report.retry |= contended;
                }
                Placed::NotPending => {}
            }
        }
        Ok(report)
    }

    /// Pools with pending reservations: what a full retry pass visits.
    pub async fn pools_with_pending(&self) -> ApiResult<Vec<PoolId>> {
        Ok(store::pools_with_pending(self.store.db()).await?)
    }

    /// The pools a retry asked for, and those of the nodes it asked for that have pending
    /// reservations: the ones worth a placement pass. The nodes' pools are not looked up
    /// while no reservation waits anywhere, which is most of a fleet's bring-up.
    pub async fn pools_to_retry(&self, asked: &RetryAsked) -> ApiResult<Vec<PoolId>> {
        let mut pools = asked.pools.clone();
        if !asked.nodes.is_empty() {
            let pending = self.pools_with_pending().await?;
            if !pending.is_empty() {
                let nodes: Vec<NodeId> = asked.nodes.iter().cloned().collect();
                let of_nodes = super::store::nodes::pools_of(self.store.db(), &nodes).await?;
                pools.extend(pending.into_iter().filter(|p| of_nodes.contains(p)));
            }
        }
        Ok(pools.into_iter().collect())
    }

    /// The placer, inside the caller's transaction, on a reservation the caller locked.
    pub(super) async fn place_in(
        &self,
        txn: &WriteTxn,
        reservation: &mut Reservation,
        actor: &Actor,
    ) -> ApiResult<Placed> {
        if reservation.state != ReservationState::Pending {
            return Ok(Placed::NotPending);
        }
        let shape = &reservation.shape;
        let wanted = shape.node_count as usize;
        let limit = u64::from(shape.node_count) * CANDIDATES_PER_NODE + MIN_CANDIDATES;
        let rows = store::candidates(&**txn, reservation, limit).await?;
        let mut contended = false;
        let mut bookings = None;
        if rows.len() >= wanted {
            // Lock the best candidates only as many at a time as the gang still needs, going
            // down the list past rows that are locked elsewhere or no longer fit. Locking
            // every candidate read would hold them all until commit, and every concurrent
            // placer, having read the same list, would skip them all and stay PENDING while
            // the pool has room.
            let mut fitting: Vec<Candidate> = Vec::with_capacity(wanted);
            let mut rest = rows.as_slice();
            while fitting.len() < wanted && rest.len() >= wanted - fitting.len() {
                let (batch, after) = rest.split_at(wanted - fitting.len());
                rest = after;
                let ids: Vec<NodeId> = batch.iter().map(|r| r.node_id.clone()).collect();
                let locked = store::lock_placeable(&**txn, reservation, &ids).await?;
                contended |= locked.len() < ids.len();
                let mut free =
                    store::free_atoms(&**txn, &locked, shape.gpu_model.as_deref()).await?;
                fitting.extend(
                    batch
                        .iter()
                        .filter(|r| locked.contains(&r.node_id))
                        .map(|r| Candidate {
                            node_id: r.node_id.clone(),
                            free_atoms: free.remove(&r.node_id).unwrap_or_default(),
                            discouraged: r.discouraged,
                        })
                        .filter(|c| c.free_atoms.len() >= shape.gpus_per_node as usize),
                );
            }
            bookings = choose(shape, reservation.policy, &fitting);
        }
        let now = self.clock.now();
        let Some(bookings) = bookings else {
            let fits = store::fit_counts(&**txn, reservation).await?;
            let explanation = explain_unplaced(&reservation.shape, &fits);
            if reservation.explain_pending(explanation, now) {
                // Not a move: same version, no event.
                store::save_reservation(&**txn, reservation.version, reservation).await?;
            }
            return Ok(Placed::StillPending { contended });
        };
        let allocations: Vec<Allocation> = bookings
            .into_iter()
            .map(|b| Allocation {
                id: AllocationId::generate(),
                reservation_id: reservation.id.clone(),
                tenant_id: reservation.tenant_id.clone(),
                pool_id: reservation.pool_id.clone(),
                node_id: b.node_id,
                atoms: b.atoms,
                booked_at: now,
                released_at: None,
                release_reason: None,
            })
            .collect();
        store::book(&**txn, &allocations).await?;
        let before = reservation.version;
        let nodes: Vec<NodeId> = allocations.iter().map(|a| a.node_id.clone()).collect();
        let change = reservation.place(&nodes, now)?;
        for allocation in &allocations {
            events::append_placement(
                txn,
                EventType::AllocationBooked,
                reservation,
                Some(&allocation.node_id),
                None,
                Some(allocation.id.to_string()),
                actor,
                allocation_data(allocation),
                now,
            );
        }
        self.save_move(txn, reservation, before, &change, actor, now)
            .await?;
        metrics::counter!("bc_placements_total").increment(1);
        Ok(Placed::Booked)
    }

    /// Releases the reservation's active allocations (its atoms are free at commit) with an
    /// `allocation.released` event each.
    async fn end_allocations_in(
        &self,
        txn: &WriteTxn,
        reservation: &Reservation,
        why: &str,
        actor: &Actor,
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<Allocation>> {
        let active = store::active_of_reservation(&**txn, &reservation.id).await?;
        let ids: Vec<AllocationId> = active.iter().map(|a| a.id.clone()).collect();
        store::release_allocations(&**txn, &ids, why, now).await?;
        for allocation in &active {
            events::append_placement(
                txn,
                EventType::AllocationReleased,
                reservation,
                Some(&allocation.node_id),
                Some(allocation.id.to_string()),
                None,
                actor,
                json!({ "allocationId": allocation.id, "poolId": allocation.pool_id, "atoms": allocation.atoms, "why": why }),
                now,
            );
        }
        Ok(active)
    }

    /// Writes a reservation's move (it was loaded at `before_version` and is locked) and its
    /// event.
    async fn save_move(
        &self,
        txn: &WriteTxn,
        reservation: &Reservation,
        before_version: i64,
        change: &ReservationChange,
        actor: &Actor,
        now: DateTime<Utc>,
    ) -> ApiResult<()> {
        if !store::save_reservation(&**txn, before_version, reservation).await? {
            let current = store::load_reservation(&**txn, &reservation.id, false)
                .await?
                .map_or(before_version, |r| r.version);
            return Err(ApiError::Conflict {
                expected: before_version,
                current,
            });
        }
        append_move(txn, reservation, change, actor, now);
        Ok(())
    }

    /// Evicts the work on `node` that may not stay there, inside the caller's transaction
    /// (which has locked the node): everything when `all` (drain deadline, lost node), else
    /// the reservations that do not tolerate one of its `NoExecute` taints. Each evicted
    /// reservation loses all its allocations (a gang runs whole or not at all) and goes back
    /// to PENDING, to be placed elsewhere. Returns how many reservations were evicted.
    pub(super) async fn evict_from_node_in(
        &self,
        txn: &WriteTxn,
        node: &NodeRecord,
        all: bool,
        why: &str,
        actor: &Actor,
    ) -> ApiResult<usize> {
        let on_node = store::active_on_nodes(&**txn, std::slice::from_ref(&node.id)).await?;
        let no_execute: Vec<&str> = node
            .taints
            .iter()
            .filter(|t| t.effect == bc_core::axes::TaintEffect::NoExecute)
            .map(|t| t.key.as_str())
            .collect();
        if on_node.is_empty() || (!all && no_execute.is_empty()) {
            return Ok(0);
        }
        let now = self.clock.now();
        // Every reservation on the node is locked (step 3 of the lock order, in id order)
        // before any free-atom count (step 4): evicting one reservation and then locking the
        // next would go back a step, and a release of that next reservation, holding it and
        // waiting for a count this eviction holds, would close a cycle (`deadlock detected`;
        // `placement_races` met it).
        let mut reservation_ids: Vec<ReservationId> =
            on_node.into_iter().map(|a| a.reservation_id).collect();
        reservation_ids.sort();
        reservation_ids.dedup();
        let mut evictions = Vec::new();
        for reservation_id in reservation_ids {
            let Some(mut reservation) =
                store::load_reservation(&**txn, &reservation_id, true).await?
            else {
                continue;
            };
            let why = if all {
                why.to_owned()
            } else {
                let Some(key) = no_execute
                    .iter()
                    .find(|key| !reservation.shape.tolerations.iter().any(|t| t == *key))
                else {
                    continue;
                };
                format!(
                    "node {} has a NoExecute taint `{key}` the work does not tolerate",
                    node.id
                )
            };
            let before = reservation.version;
            let Ok(change) = reservation.evicted(&why, now) else {
                continue;
            };
            evictions.push((reservation, before, change, why));
        }
        // The counts of every node the evicted gangs hold, locked once: each release below
        // locks its own again, which a transaction holding them does not wait for.
        let evicted_ids: Vec<ReservationId> =
            evictions.iter().map(|(r, ..)| r.id.clone()).collect();
        let nodes = store::active_nodes_of_reservations(&**txn, &evicted_ids).await?;
        store::lock_free_counts(&**txn, &nodes).await?;
        let evicted = evictions.len();
        for (reservation, before, change, why) in &evictions {
            self.end_allocations_in(txn, reservation, why, actor, now)
                .await?;
            self.save_move(txn, reservation, *before, change, actor, now)
                .await?;
        }
        if evicted > 0 {
            metrics::counter!("bc_evictions_total").increment(evicted as u64);
        }
        Ok(evicted)
    }

    /// Ends reservations whose expiry passed: placed ones are released, pending ones fail.
    pub async fn expire_reservations(&self, actor: &Actor) -> ApiResult<usize> {
        let now = self.clock.now();
        let due = store::due_to_expire(self.store.db(), now, EXPIRY_BATCH).await?;
        let mut expired = 0;
        for id in due {
            let txn = self.store.write().await?;
            let Some(mut reservation) = store::load_reservation(&*txn, &id, true).await? else {
                continue;
            };
            let before = reservation.version;
            let Some(change) = reservation.expire(now) else {
                continue;
            };
            self.end_allocations_in(&txn, &reservation, "reservation expired", actor, now)
                .await?;
            self.save_move(&txn, &reservation, before, &change, actor, now)
                .await?;
            txn.commit().await?;
            expired += 1;
        }
        Ok(expired)
    }

    /// Draining nodes that hold no allocation: their drain is done.
    pub async fn drained_nodes(&self) -> ApiResult<Vec<(NodeId, i64)>> {
        Ok(store::drained_nodes(self.store.db()).await?)
    }
}

/// The answer to a create repeated with an idempotency key already used: the first
/// reservation if the request is the same, `BAD_USER_INPUT` if it differs.
fn same_request(existing: Reservation, new: &NewReservation) -> ApiResult<Reservation> {
    if existing.pool_id == new.pool_id
        && existing.shape == new.shape
        && existing.policy == new.policy
        && existing.expires_at == new.expires_at
    {
        Ok(existing)
    } else {
        Err(ApiError::BadUserInput(format!(
            "idempotency key `{}` was used for reservation {} with a different request",
            new.idempotency_key.as_deref().unwrap_or_default(),
            existing.id
        )))
    }
}

fn allocation_data(allocation: &Allocation) -> serde_json::Value {
    json!({
        "allocationId": allocation.id,
        "poolId": allocation.pool_id,
        "atoms": allocation.atoms,
    })
}

fn append_move(
    txn: &WriteTxn,
    reservation: &Reservation,
    change: &ReservationChange,
    actor: &Actor,
    now: DateTime<Utc>,
) {
    events::append_placement(
        txn,
        change.event_type,
        reservation,
        None,
        change.from.map(|s| s.to_string()),
        Some(change.to.to_string()),
        actor,
        json!({
            "poolId": reservation.pool_id,
            "version": reservation.version,
            "detail": change.detail,
        }),
        now,
    );
}

/// Pools whose pending reservations should be retried, and a wakeup for the loop that does
/// it. Filled by the placement loop from the event feed, and by the placer itself when it
/// met contended rows.
#[derive(Debug, Default)]
pub struct PlacementRetry {
    asked: std::sync::Mutex<RetryAsked>,
    wake: tokio::sync::Notify,
}

/// What the retry loop has been asked to retry: pools, and nodes whose pool it looks up
/// when it runs (the feed's events name their node, not its pool).
#[derive(Debug, Default)]
pub struct RetryAsked {
    pub pools: std::collections::BTreeSet<PoolId>,
    pub nodes: std::collections::BTreeSet<NodeId>,
}

impl PlacementRetry {
    /// Asks for a retry of `pool`'s pending reservations.
    pub fn request(&self, pool: &PoolId) {
        let inserted = self.asked().pools.insert(pool.clone());
        if inserted {
            self.wake.notify_one();
        }
    }

    /// Asks for a retry of the pending reservations of `node`'s pool.
    pub fn request_for_node(&self, node: &NodeId) {
        let inserted = self.asked().nodes.insert(node.clone());
        if inserted {
            self.wake.notify_one();
        }
    }

    /// Asks again for what a failed retry took.
    pub fn request_again(&self, asked: RetryAsked) {
        let mut pending = self.asked();
        pending.pools.extend(asked.pools);
        pending.nodes.extend(asked.nodes);
        drop(pending);
        self.wake.notify_one();
    }

    /// What was asked for since the last call.
    pub fn take(&self) -> RetryAsked {
        std::mem::take(&mut *self.asked())
    }

    fn asked(&self) -> std::sync::MutexGuard<'_, RetryAsked> {
        self.asked
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until a retry is requested.
    pub async fn requested(&self) {
        self.wake.notified().await;
    }
}

impl Services {
    /// Ends a drain, in one transaction: at its deadline, the work still on the node is
    /// evicted first; otherwise only once the node holds no allocation. `node.drained` records
    /// it; the cordon stays. Returns whether the drain ended (a node that changed since the
    /// controller's query, `version`, is `CONFLICT`).
    pub async fn finish_drain(
        &self,
        actor: &Actor,
        node: &NodeId,
        version: i64,
        cause: &str,
        at_deadline: bool,
    ) -> ApiResult<bool> {
        let everyone = |_: &NodeRecord| true;
        let txn = self.store.write().await?;
        // Locks the node row first (the lock order), changing nothing.
        let (record, _) = self
            .change_node_in(
                &txn,
                actor,
                node,
                Some(version),
                &everyone,
                cause,
                |_, _, _| Ok(Vec::new()),
            )
            .await?;
        let now = self.clock.now();
        let Some(drain) = &record.drain else {
            return Ok(false);
        };
        let why = if at_deadline {
            if drain.deadline.is_none_or(|deadline| deadline > now) {
                return Ok(false);
            }
            let evicted = self
                .evict_from_node_in(
                    &txn,
                    &record,
                    true,
                    "the node's drain deadline passed",
                    actor,
                )
                .await?;
            format!("deadline passed; {evicted} reservation(s) evicted")
        } else {
            let left = store::active_on_nodes(&*txn, std::slice::from_ref(node)).await?;
            if !left.is_empty() {
                return Ok(false);
            }
            "no allocations left".to_owned()
        };
        let (after, changes) = self
            .change_node_in(&txn, actor, node, None, &everyone, cause, move |r, _, _| {
                Ok(r.finish_drain(&why))
            })
            .await?;
        txn.commit().await?;
        self.after_node_commit(&after, &changes);
        Ok(!changes.is_empty())
    }
}
