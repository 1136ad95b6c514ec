//! Placement's tables: `reservations`, `allocations`, `atom_bookings` (one row per booked
//! atom, whose primary key makes a double booking impossible) and `pool_offers`, plus the
//! placer's queries: candidates, locking, free atoms, and the counts behind a pending
//! reservation's explanation.

use anyhow::{Context as _, anyhow};
use bc_core::ids::{AllocationId, NodeId, PoolId, ReservationId, TenantId};
use bc_core::placement::{
    Allocation, FitCount, LabelRequirement, PlacementPolicy, Reservation, ReservationState, Shape,
};
use bc_core::schedule::{CapacityBucket, Check};
use bc_entity::{
    allocation, atom_booking, node, node_device, node_free_atom, node_label,
    node_no_schedule_reason, node_taint, pool_offer, reservation,
};
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::{
    Alias, Expr, ExprTrait, LockBehavior, LockType, OnConflict, Order, Query, SelectStatement,
};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, PaginatorTrait, QueryFilter, QueryOrder,
    QuerySelect,
};
use std::collections::{BTreeMap, HashMap};

use super::batch_shapes::{one_of, runs_of};
use super::schedule_sql;

fn corrupt(table: &str, column: &str, value: &str) -> anyhow::Error {
    anyhow!("corrupt row: {table}.{column} = `{value}`")
}

// ---------------------------------------------------------------------------------------------
// Rows ↔ domain.

pub fn reservation_from(row: reservation::Model) -> anyhow::Result<Reservation> {
    let selector: Vec<LabelRequirement> = serde_json::from_value(row.selector.clone())
        .with_context(|| corrupt("reservations", "selector", &row.selector.to_string()))?;
    let tolerations: Vec<String> = serde_json::from_value(row.tolerations.clone())
        .with_context(|| corrupt("reservations", "tolerations", &row.tolerations.to_string()))?;
    Ok(Reservation {
        id: ReservationId::parse(&row.id).map_err(|_| corrupt("reservations", "id", &row.id))?,
        tenant_id: TenantId::parse(&row.tenant_id)
            .map_err(|_| corrupt("reservations", "tenant_id", &row.tenant_id))?,
        pool_id: PoolId::parse(&row.pool_id)
            .map_err(|_| corrupt("reservations", "pool_id", &row.pool_id))?,
        shape: Shape {
            gpus_per_node: u32::try_from(row.gpus_per_node).map_err(|_| {
                corrupt(
                    "reservations",
                    "gpus_per_node",
                    &row.gpus_per_node.to_string(),
                )
            })?,
            node_count: u32::try_from(row.node_count)
                .map_err(|_| corrupt("reservations", "node_count", &row.node_count.to_string()))?,
            gpu_model: row.gpu_model,
            selector,
            tolerations,
        },
        policy: row
            .policy
            .parse()
            .map_err(|_| corrupt("reservations", "policy", &row.policy))?,
        state: row
            .state
            .parse()
            .map_err(|_| corrupt("reservations", "state", &row.state))?,
        reason: row.reason,
        idempotency_key: row.idempotency_key,
        expires_at: row.expires_at,
        version: row.version,
        created_by: bc_core::Actor::parse(&row.created_by)
            .ok_or_else(|| corrupt("reservations", "created_by", &row.created_by))?,
        created_at: row.created_at,
        updated_at: row.updated_at,
    })
}

fn reservation_row(r: &Reservation) -> reservation::ActiveModel {
    reservation::ActiveModel {
        id: Set(r.id.to_string()),
        tenant_id: Set(r.tenant_id.to_string()),
        pool_id: Set(r.pool_id.to_string()),
        gpus_per_node: Set(i32::try_from(r.shape.gpus_per_node).unwrap_or(i32::MAX)),
        node_count: Set(i32::try_from(r.shape.node_count).unwrap_or(i32::MAX)),
        gpu_model: Set(r.shape.gpu_model.clone()),
        selector: Set(serde_json::to_value(&r.shape.selector).unwrap_or_default()),
        tolerations: Set(serde_json::to_value(&r.shape.tolerations).unwrap_or_default()),
        policy: Set(r.policy.to_string()),
        state: Set(r.state.to_string()),
        reason: Set(r.reason.clone()),
        idempotency_key: Set(r.idempotency_key.clone()),
        expires_at: Set(r.expires_at),
        version: Set(r.version),
        created_by: Set(r.created_by.to_string()),
        created_at: Set(r.created_at),
        updated_at: Set(r.updated_at),
    }
}

pub fn allocation_from(row: allocation::Model) -> anyhow::Result<Allocation> {
    let atoms: Vec<String> = serde_json::from_value(row.atoms.clone())
        .with_context(|| corrupt("allocations", "atoms", &row.atoms.to_string()))?;
    Ok(Allocation {
        id: AllocationId::parse(&row.id).map_err(|_| corrupt("allocations", "id", &row.id))?,
        reservation_id: ReservationId::parse(&row.reservation_id)
            .map_err(|_| corrupt("allocations", "reservation_id", &row.reservation_id))?,
        tenant_id: TenantId::parse(&row.tenant_id)
            .map_err(|_| corrupt("allocations", "tenant_id", &row.tenant_id))?,
        pool_id: PoolId::parse(&row.pool_id)
            .map_err(|_| corrupt("allocations", "pool_id", &row.pool_id))?,
        node_id: NodeId::parse(&row.node_id)
            .map_err(|_| corrupt("allocations", "node_id", &row.node_id))?,
        atoms,
        booked_at: row.booked_at,
        released_at: row.released_at,
        release_reason: row.release_reason,
    })
}

// ---------------------------------------------------------------------------------------------
// Reservations.

/// Inserts a new reservation. Returns `false`, inserting nothing, when the tenant already has
/// one with its idempotency key: on PostgreSQL a concurrent create with the same key (a
/// client's retry while the first request is still running) waits here until the first
/// commits, instead of failing on the unique index, and the caller reads the first.
pub async fn insert_reservation(
    conn: &impl ConnectionTrait,
    r: &Reservation,
) -> anyhow::Result<bool> {
    let inserted = reservation::Entity::insert(reservation_row(r))
        .on_conflict(
            OnConflict::columns([
                reservation::Column::TenantId,
                reservation::Column::IdempotencyKey,
            ])
            .do_nothing()
            .to_owned(),
        )
        .exec_without_returning(conn)
        .await?;
    Ok(inserted == 1)
}

/// Writes `after` over the stored row, if the row still has `before_version`. Returns whether
/// it did (the reservation row is locked by the caller, so it always does there).
pub async fn save_reservation(
    conn: &impl ConnectionTrait,
    before_version: i64,
    after: &Reservation,
) -> anyhow::Result<bool> {
    let result = reservation::Entity::update_many()
        .set(reservation_row(after))
        .filter(reservation::Column::Id.eq(after.id.to_string()))
        .filter(reservation::Column::Version.eq(before_version))
        .exec(conn)
        .await?;
    Ok(result.rows_affected == 1)
}

/// One reservation, locked `FOR UPDATE` on PostgreSQL when `lock` (SQLite's writer holds the
/// database lock already).
pub async fn load_reservation(
    conn: &impl ConnectionTrait,
    id: &ReservationId,
    lock: bool,
) -> anyhow::Result<Option<Reservation>> {
    let mut select = reservation::Entity::find_by_id(id.to_string());
    if lock {
        select = super::lock_for_update(select, conn);
    }
    select.one(conn).await?.map(reservation_from).transpose()
}

pub async fn find_by_idempotency_key(
    conn: &impl ConnectionTrait,
    tenant: &TenantId,
    key: &str,
) -> anyhow::Result<Option<Reservation>> {
    reservation::Entity::find()
        .filter(reservation::Column::TenantId.eq(tenant.to_string()))
        .filter(reservation::Column::IdempotencyKey.eq(key))
        .one(conn)
        .await?
        .map(reservation_from)
        .transpose()
}

/// Which reservations to list.
#[derive(Debug, Clone, Default)]
pub struct ReservationFilter {
    /// Visibility: a tenant principal sees only its own.
    pub tenant: Option<TenantId>,
    pub pool_ids: Vec<PoolId>,
    pub states: Vec<ReservationState>,
}

impl ReservationFilter {
    fn apply(
        &self,
        mut select: sea_orm::Select<reservation::Entity>,
    ) -> sea_orm::Select<reservation::Entity> {
        if let Some(tenant) = &self.tenant {
            select = select.filter(reservation::Column::TenantId.eq(tenant.to_string()));
        }
        if !self.pool_ids.is_empty() {
            select = select.filter(
                reservation::Column::PoolId.is_in(self.pool_ids.iter().map(ToString::to_string)),
            );
        }
        if !self.states.is_empty() {
            select = select.filter(
                reservation::Column::State.is_in(self.states.iter().map(ToString::to_string)),
            );
        }
        select
    }
}

/// Reservations matching `filter`, newest first (ids are UUIDv7, so by id descending), after
/// the cursor `after` (an id), at most `limit`.
pub async fn list_reservations(
    conn: &impl ConnectionTrait,
    filter: &ReservationFilter,
    after: Option<&str>,
    limit: u64,
) -> anyhow::Result<Vec<Reservation>> {
    let mut select = filter.apply(reservation::Entity::find());
    if let Some(after) = after {
        select = select.filter(reservation::Column::Id.lt(after));
    }
    select
        .order_by_desc(reservation::Column::Id)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(reservation_from)
        .collect()
}

pub async fn count_reservations(
    conn: &impl ConnectionTrait,
    filter: &ReservationFilter,
) -> anyhow::Result<u64> {
    Ok(filter
        .apply(reservation::Entity::find())
        .count(conn)
        .await?)
}

/// Pending reservations of `pool`, oldest first: the order the placer retries them in, so
/// an older reservation is not starved by newer ones.
pub async fn pending_in_pool(
    conn: &impl ConnectionTrait,
    pool: &PoolId,
    limit: u64,
) -> anyhow::Result<Vec<ReservationId>> {
    reservation::Entity::find()
        .select_only()
        .column(reservation::Column::Id)
        .filter(reservation::Column::PoolId.eq(pool.to_string()))
        .filter(reservation::Column::State.eq(ReservationState::Pending.to_string()))
        .order_by_asc(reservation::Column::CreatedAt)
        .order_by_asc(reservation::Column::Id)
        .limit(limit)
        .into_tuple::<String>()
        .all(conn)
        .await?
        .into_iter()
        .map(|id| ReservationId::parse(&id).map_err(|_| corrupt("reservations", "id", &id)))
        .collect()
}

/// Pools with at least one pending reservation.
pub async fn pools_with_pending(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<PoolId>> {
    reservation::Entity::find()
        .select_only()
        .column(reservation::Column::PoolId)
        .distinct()
        .filter(reservation::Column::State.eq(ReservationState::Pending.to_string()))
        .into_tuple::<String>()
        .all(conn)
        .await?
        .into_iter()
        .map(|id| PoolId::parse(&id).map_err(|_| corrupt("reservations", "pool_id", &id)))
        .collect()
}

/// Live reservations whose expiry is at or before `now`, at most `limit`.
pub async fn due_to_expire(
    conn: &impl ConnectionTrait,
    now: DateTime<Utc>,
    limit: u64,
) -> anyhow::Result<Vec<ReservationId>> {
    let mut due = Vec::new();
    for state in [ReservationState::Pending, ReservationState::Placed] {
        let ids: Vec<String> = reservation::Entity::find()
            .select_only()
            .column(reservation::Column::Id)
            .filter(reservation::Column::State.eq(state.to_string()))
            .filter(reservation::Column::ExpiresAt.lte(now))
            .order_by_asc(reservation::Column::ExpiresAt)
            .limit(limit)
            .into_tuple::<String>()
            .all(conn)
            .await?;
        for id in ids {
            due.push(ReservationId::parse(&id).map_err(|_| corrupt("reservations", "id", &id))?);
        }
    }
    Ok(due)
}

// ---------------------------------------------------------------------------------------------
// Allocations and bookings.

/// Writes new allocations and one booking per atom. A booking of an atom already booked
/// fails on the primary key, so the transaction fails rather than double-book.
pub async fn book(conn: &impl ConnectionTrait, allocations: &[Allocation]) -> anyhow::Result<()> {
    if allocations.is_empty() {
        return Ok(());
    }
    let nodes: Vec<NodeId> = allocations.iter().map(|a| a.node_id.clone()).collect();
    lock_free_counts(conn, &nodes).await?;
    let rows: Vec<allocation::ActiveModel> = allocations
        .iter()
        .map(|a| allocation::ActiveModel {
            id: Set(a.id.to_string()),
            reservation_id: Set(a.reservation_id.to_string()),
            tenant_id: Set(a.tenant_id.to_string()),
            pool_id: Set(a.pool_id.to_string()),
            node_id: Set(a.node_id.to_string()),
            atoms: Set(serde_json::to_value(&a.atoms).unwrap_or_default()),
            booked_at: Set(a.booked_at),
            released_at: Set(None),
            release_reason: Set(None),
        })
        .collect();
    for run in runs_of::<allocation::Entity, _>(rows) {
        allocation::Entity::insert_many(run)
            .exec_without_returning(conn)
            .await?;
    }
    let bookings: Vec<atom_booking::ActiveModel> = allocations
        .iter()
        .flat_map(|a| {
            a.atoms.iter().map(|atom| atom_booking::ActiveModel {
                node_id: Set(a.node_id.to_string()),
                atom: Set(atom.clone()),
                allocation_id: Set(a.id.to_string()),
            })
        })
        .collect();
    // A gang books up to 1,024 nodes × `MAX_GPUS_PER_NODE` (64) atoms: in one statement,
    // 196,608 parameters, past SQLite's 32,766 and PostgreSQL's 65,535.
    for run in runs_of::<atom_booking::Entity, _>(bookings) {
        atom_booking::Entity::insert_many(run)
            .exec_without_returning(conn)
            .await?;
    }
    recount_free_atoms(conn, &nodes).await
}

/// Ends allocations: sets `released_at` and the reason, and frees their atoms.
pub async fn release_allocations(
    conn: &impl ConnectionTrait,
    ids: &[AllocationId],
    reason: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let backend = conn.get_database_backend();
    let nodes: Vec<NodeId> = atom_booking::Entity::find()
        .select_only()
        .column(atom_booking::Column::NodeId)
        .distinct()
        .filter(one_of(
            Expr::col(atom_booking::Column::AllocationId),
            ids,
            backend,
        ))
        .into_tuple::<String>()
        .all(conn)
        .await?
        .iter()
        .map(|id| NodeId::parse(id).map_err(|_| corrupt("atom_bookings", "node_id", id)))
        .collect::<anyhow::Result<_>>()?;
    lock_free_counts(conn, &nodes).await?;
    atom_booking::Entity::delete_many()
        .filter(one_of(
            Expr::col(atom_booking::Column::AllocationId),
            ids,
            backend,
        ))
        .exec(conn)
        .await?;
    recount_free_atoms(conn, &nodes).await?;
    allocation::Entity::update_many()
        .col_expr(allocation::Column::ReleasedAt, Expr::val(now))
        .col_expr(allocation::Column::ReleaseReason, Expr::val(reason))
        .filter(one_of(Expr::col(allocation::Column::Id), ids, backend))
        .filter(allocation::Column::ReleasedAt.is_null())
        .exec(conn)
        .await?;
    Ok(())
}

/// The active allocations of a reservation.
pub async fn active_of_reservation(
    conn: &impl ConnectionTrait,
    id: &ReservationId,
) -> anyhow::Result<Vec<Allocation>> {
    allocation::Entity::find()
        .filter(allocation::Column::ReservationId.eq(id.to_string()))
        .filter(allocation::Column::ReleasedAt.is_null())
        .order_by_asc(allocation::Column::NodeId)
        .all(conn)
        .await?
        .into_iter()
        .map(allocation_from)
        .collect()
}

/// The nodes on which any of `ids` holds an active allocation, in id order.
pub async fn active_nodes_of_reservations(
    conn: &impl ConnectionTrait,
    ids: &[ReservationId],
) -> anyhow::Result<Vec<NodeId>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    allocation::Entity::find()
        .select_only()
        .column(allocation::Column::NodeId)
        .distinct()
        .filter(one_of(
            Expr::col(allocation::Column::ReservationId),
            ids,
            conn.get_database_backend(),
        ))
        .filter(allocation::Column::ReleasedAt.is_null())
        .order_by_asc(allocation::Column::NodeId)
        .into_tuple::<String>()
        .all(conn)
        .await?
        .iter()
        .map(|id| NodeId::parse(id).map_err(|_| corrupt("allocations", "node_id", id)))
        .collect()
}

/// Every allocation of a reservation, active first, then newest released first.
pub async fn of_reservation(
    conn: &impl ConnectionTrait,
    id: &ReservationId,
    limit: u64,
) -> anyhow::Result<Vec<Allocation>> {
    let mut all: Vec<Allocation> = allocation::Entity::find()
        .filter(allocation::Column::ReservationId.eq(id.to_string()))
        .order_by_desc(allocation::Column::BookedAt)
        .order_by_asc(allocation::Column::NodeId)
        .limit(limit)
        .all(conn)
        .await?
        .into_iter()
        .map(allocation_from)
        .collect::<anyhow::Result<_>>()?;
    all.sort_by_key(|a| !a.is_active());
    Ok(all)
}

/// The active allocations on each of `nodes`.
pub async fn active_on_nodes(
    conn: &impl ConnectionTrait,
    nodes: &[NodeId],
) -> anyhow::Result<Vec<Allocation>> {
    if nodes.is_empty() {
        return Ok(Vec::new());
    }
    allocation::Entity::find()
        .filter(one_of(
            Expr::col(allocation::Column::NodeId),
            nodes,
            conn.get_database_backend(),
        ))
        .filter(allocation::Column::ReleasedAt.is_null())
        .order_by_asc(allocation::Column::NodeId)
        .order_by_asc(allocation::Column::BookedAt)
        .all(conn)
        .await?
        .into_iter()
        .map(allocation_from)
        .collect()
}

/// Draining nodes (not deleted) that hold no active allocation: their drain is done.
pub async fn drained_nodes(conn: &impl ConnectionTrait) -> anyhow::Result<Vec<(NodeId, i64)>> {
    let active = Query::select()
        .expr(Expr::val(1))
        .from(allocation::Entity)
        .and_where(
            Expr::col((allocation::Entity, allocation::Column::NodeId))
                .equals((node::Entity, node::Column::Id)),
        )
        .and_where(Expr::col((allocation::Entity, allocation::Column::ReleasedAt)).is_null())
        .to_owned();
    let query = Query::select()
        .column((node::Entity, node::Column::Id))
        .column((node::Entity, node::Column::Version))
        .from(node::Entity)
        .and_where(Expr::col((node::Entity, node::Column::DeletedAt)).is_null())
        .and_where(Expr::col((node::Entity, node::Column::DrainStartedAt)).is_not_null())
        .and_where(Expr::not_exists(active))
        .order_by((node::Entity, node::Column::Id), Order::Asc)
        .to_owned();
    conn.query_all(&query)
        .await?
        .iter()
        .map(|row| {
            let id: String = row.try_get("", "id")?;
            Ok((
                NodeId::parse(&id).map_err(|_| corrupt("nodes", "id", &id))?,
                row.try_get("", "version")?,
            ))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The placer's queries.

fn node_col(column: node::Column) -> Expr {
    Expr::col((node::Entity, column))
}

/// Locks the free-atom counts of `nodes` (PostgreSQL; SQLite has one writer), in id order,
/// before their devices or bookings change: every writer of a node's count holds its row
/// from before its change until commit, so the recount after the change (a statement of its
/// own, whose snapshot is taken with the lock held) sees every other writer's committed
/// change and none in flight. Without it a release and a booking on one node, committing
/// together, each recounted without the other's change and the last write won (the
/// placement race test caught it). Lock order (ARCHITECTURE.md, Invariants): node rows,
/// then these, then bookings.
pub async fn lock_free_counts(conn: &impl ConnectionTrait, nodes: &[NodeId]) -> anyhow::Result<()> {
    if nodes.is_empty() || conn.get_database_backend() != DbBackend::Postgres {
        return Ok(());
    }
    let mut ids: Vec<String> = nodes.iter().map(ToString::to_string).collect();
    ids.sort_unstable();
    ids.dedup();
    let lock = Query::select()
        .column(node_free_atom::Column::NodeId)
        .from(node_free_atom::Entity)
        .and_where(one_of(
            Expr::col(node_free_atom::Column::NodeId),
            &ids,
            conn.get_database_backend(),
        ))
        .order_by(node_free_atom::Column::NodeId, Order::Asc)
        .lock(LockType::Update)
        .to_owned();
    conn.query_all(&lock).await?;
    Ok(())
}

/// Recounts the free atoms (healthy, not booked) of `nodes` into `node_free_atoms`, the
/// placer's index. Called in the same transaction as every change to a node's devices or
/// bookings, after [`lock_free_counts`], so the count is never stale where it is read.
pub async fn recount_free_atoms(
    conn: &impl ConnectionTrait,
    nodes: &[NodeId],
) -> anyhow::Result<()> {
    if nodes.is_empty() {
        return Ok(());
    }
    let counted = Query::select()
        .column((node::Entity, node::Column::Id))
        .column((node::Entity, node::Column::PoolId))
        .expr(free_atoms_expr(None))
        .from(node::Entity)
        .and_where(one_of(
            node_col(node::Column::Id),
            nodes,
            conn.get_database_backend(),
        ))
        .to_owned();
    let upsert = Query::insert()
        .into_table(node_free_atom::Entity)
        .columns([
            node_free_atom::Column::NodeId,
            node_free_atom::Column::PoolId,
            node_free_atom::Column::Free,
        ])
        .select_from(counted)?
        .on_conflict(
            OnConflict::column(node_free_atom::Column::NodeId)
                .update_columns([node_free_atom::Column::PoolId, node_free_atom::Column::Free])
                .to_owned(),
        )
        .to_owned();
    conn.execute(&upsert).await?;
    Ok(())
}

/// Free atoms of the node in scope: its healthy devices (of `model`, if given) whose atom
/// has no booking. A correlated scalar subquery, for filters and ordering.
fn free_atoms_expr(model: Option<&str>) -> Expr {
    let device = Alias::new("free_device");
    let booked = Query::select()
        .expr(Expr::val(1))
        .from(atom_booking::Entity)
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::NodeId))
                .equals((device.clone(), node_device::Column::NodeId)),
        )
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::Atom))
                .equals((device.clone(), node_device::Column::Atom)),
        )
        .to_owned();
    let mut count = Query::select();
    count
        .expr(Expr::col((device.clone(), node_device::Column::Atom)).count())
        .from_as(node_device::Entity, device.clone())
        .and_where(
            Expr::col((device.clone(), node_device::Column::NodeId))
                .equals((node::Entity, node::Column::Id)),
        )
        .and_where(Expr::col((device.clone(), node_device::Column::Healthy)).eq(true))
        .and_where(Expr::not_exists(booked));
    if let Some(model) = model {
        count.and_where(Expr::col((device, node_device::Column::Model)).eq(model));
    }
    Expr::SubQuery(None, Box::new(count.to_owned().into()))
}

/// The free atoms of the node in scope, of `model` if given: read from the placer's index
/// when any model will do (one lookup), counted from devices and bookings otherwise.
fn free_atoms_of_node(model: Option<&str>) -> Expr {
    if model.is_some() {
        return free_atoms_expr(model);
    }
    let counted = Query::select()
        .column((node_free_atom::Entity, node_free_atom::Column::Free))
        .from(node_free_atom::Entity)
        .and_where(
            Expr::col((node_free_atom::Entity, node_free_atom::Column::NodeId))
                .equals((node::Entity, node::Column::Id)),
        )
        .to_owned();
    Expr::expr(Expr::SubQuery(None, Box::new(counted.into()))).if_null(0)
}

/// Healthy atoms of the node in scope (booked or not), of `model` if given.
fn total_atoms_expr(model: Option<&str>) -> Expr {
    let device = Alias::new("any_device");
    let mut count = Query::select();
    count
        .expr(Expr::col((device.clone(), node_device::Column::Atom)).count())
        .from_as(node_device::Entity, device.clone())
        .and_where(
            Expr::col((device.clone(), node_device::Column::NodeId))
                .equals((node::Entity, node::Column::Id)),
        )
        .and_where(Expr::col((device.clone(), node_device::Column::Healthy)).eq(true));
    if let Some(model) = model {
        count.and_where(Expr::col((device, node_device::Column::Model)).eq(model));
    }
    Expr::SubQuery(None, Box::new(count.to_owned().into()))
}

/// Whether the node in scope may take `reservation`: `schedulableSql`'s checks 1–6, its
/// `noScheduleReasons` all tolerated (none, without tolerations), and trust: a
/// `tenant-owned` node only for its owner.
fn placeable(reservation: &Reservation) -> Expr {
    let mut expr = Check::ORDER
        .into_iter()
        .filter(|check| *check != Check::NoReasons)
        .map(schedule_sql::passes)
        .reduce(ExprTrait::and)
        .unwrap_or_else(|| Expr::val(true));
    let tolerated = reservation.shape.tolerated_reasons();
    expr = if tolerated.is_empty() {
        expr.and(schedule_sql::passes(Check::NoReasons))
    } else {
        let reason = Alias::new("untolerated_reason");
        let untolerated = Query::select()
            .expr(Expr::val(1))
            .from_as(node_no_schedule_reason::Entity, reason.clone())
            .and_where(
                Expr::col((reason.clone(), node_no_schedule_reason::Column::NodeId))
                    .equals((node::Entity, node::Column::Id)),
            )
            .and_where(
                Expr::col((reason, node_no_schedule_reason::Column::Reason)).is_not_in(tolerated),
            )
            .to_owned();
        expr.and(Expr::not_exists(untolerated))
    };
    expr.and(
        node_col(node::Column::Trust)
            .ne(bc_core::axes::Trust::TenantOwned.as_static_str())
            .or(node_col(node::Column::OwnerTenantId).eq(reservation.tenant_id.to_string())),
    )
}

/// Whether the node in scope carries a `PreferNoSchedule` taint the reservation does not
/// tolerate.
fn discouraged(reservation: &Reservation) -> Expr {
    let taint = Alias::new("preferred_taint");
    let mut sub = Query::select();
    sub.expr(Expr::val(1))
        .from_as(node_taint::Entity, taint.clone())
        .and_where(
            Expr::col((taint.clone(), node_taint::Column::NodeId))
                .equals((node::Entity, node::Column::Id)),
        )
        .and_where(
            Expr::col((taint.clone(), node_taint::Column::Effect))
                .eq(bc_core::axes::TaintEffect::PreferNoSchedule.as_static_str()),
        );
    if !reservation.shape.tolerations.is_empty() {
        sub.and_where(
            Expr::col((taint, node_taint::Column::Key))
                .is_not_in(reservation.shape.tolerations.clone()),
        );
    }
    Expr::exists(sub.to_owned())
}

/// The pool's live nodes matching the reservation's label selector.
fn pool_nodes(reservation: &Reservation) -> SelectStatement {
    let mut select = Query::select();
    select
        .from(node::Entity)
        .and_where(node_col(node::Column::DeletedAt).is_null())
        .and_where(node_col(node::Column::PoolId).eq(reservation.pool_id.to_string()));
    for requirement in &reservation.shape.selector {
        let label = Alias::new("selected_label");
        let mut sub = Query::select();
        sub.expr(Expr::val(1))
            .from_as(node_label::Entity, label.clone())
            .and_where(
                Expr::col((label.clone(), node_label::Column::NodeId))
                    .equals((node::Entity, node::Column::Id)),
            )
            .and_where(
                Expr::col((label.clone(), node_label::Column::Key)).eq(requirement.key.as_str()),
            );
        if let Some(value) = &requirement.value {
            sub.and_where(Expr::col((label, node_label::Column::Value)).eq(value.as_str()));
        }
        select.and_where(Expr::exists(sub.to_owned()));
    }
    select
}

/// A node the candidate query found, before it is locked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateRow {
    pub node_id: NodeId,
    pub discouraged: bool,
}

/// Up to `limit` nodes that may take `reservation` now, best first for its policy: not
/// discouraged before discouraged, then by free atoms (fewest first to bin-pack, most first
/// to spread), then by id (ascending to bin-pack, descending to spread). Not locked: [`lock_placeable`] locks and re-checks them.
///
/// The scan runs down `node_free_atoms`' (pool, free, id) index from the first node with
/// enough free atoms and stops at `limit` nodes that pass the placement predicate, so its
/// cost follows the candidates wanted, not the pool's size. Discouraged nodes (an untolerated
/// `PreferNoSchedule` taint) are a second scan, run only when the first falls short.
pub async fn candidates(
    conn: &impl ConnectionTrait,
    reservation: &Reservation,
    limit: u64,
) -> anyhow::Result<Vec<CandidateRow>> {
    let mut rows = candidate_scan(conn, reservation, limit, false).await?;
    let short = limit.saturating_sub(rows.len() as u64);
    if short > 0 {
        rows.extend(candidate_scan(conn, reservation, short, true).await?);
    }
    Ok(rows)
}

/// One scan of [`candidates`]: the discouraged nodes or the others.
async fn candidate_scan(
    conn: &impl ConnectionTrait,
    reservation: &Reservation,
    limit: u64,
    discouraged_nodes: bool,
) -> anyhow::Result<Vec<CandidateRow>> {
    let free_col = || Expr::col((node_free_atom::Entity, node_free_atom::Column::Free));
    let order = match reservation.policy {
        PlacementPolicy::BinPack => Order::Asc,
        PlacementPolicy::Spread => Order::Desc,
    };
    let wanted = i64::from(reservation.shape.gpus_per_node);
    let mut node = pool_nodes(reservation);
    node.expr(Expr::val(1))
        .and_where(
            node_col(node::Column::Id)
                .equals((node_free_atom::Entity, node_free_atom::Column::NodeId)),
        )
        .and_where(placeable(reservation))
        .and_where(if discouraged_nodes {
            discouraged(reservation)
        } else {
            discouraged(reservation).not()
        });
    let model = reservation.shape.gpu_model.as_deref();
    if model.is_some() {
        // Of one model: the node's total free count is only a bound, so the model's own
        // count is checked per node (still only on nodes the index lets through).
        node.and_where(free_atoms_expr(model).gte(wanted));
    }
    let mut query = Query::select();
    query
        .column((node_free_atom::Entity, node_free_atom::Column::NodeId))
        .from(node_free_atom::Entity)
        .and_where(
            Expr::col((node_free_atom::Entity, node_free_atom::Column::PoolId))
                .eq(reservation.pool_id.to_string()),
        )
        .and_where(free_col().gte(wanted))
        .and_where(Expr::exists(node.to_owned()))
        .order_by_expr(free_col(), order.clone())
        // Ties go the same way as the count, so the index serves the whole order.
        .order_by(
            (node_free_atom::Entity, node_free_atom::Column::NodeId),
            order,
        )
        .limit(limit);
    conn.query_all(&query)
        .await?
        .iter()
        .map(|row| {
            let id: String = row.try_get("", "node_id")?;
            Ok(CandidateRow {
                node_id: NodeId::parse(&id)
                    .map_err(|_| corrupt("node_free_atoms", "node_id", &id))?,
                discouraged: discouraged_nodes,
            })
        })
        .collect()
}

/// Locks the rows of `nodes` that are still placeable for `reservation` and returns their
/// ids. On PostgreSQL `FOR UPDATE SKIP LOCKED`: a row another transaction holds (a cordon, a
/// concurrent placer) is skipped, never waited for, and a row updated since the candidate
/// query is re-checked against the predicate on its newest version, so a cordon that
/// committed first wins. SQLite has one writer, which this transaction is.
///
/// That re-check sees the newest node row, but the predicate's subqueries (the reasons a
/// reservation's tolerations are held against, the labels of its selector, the pool's owner)
/// still read the snapshot the locking statement started with. A taint committed between
/// that start and the lock would go unseen, so on PostgreSQL the locked rows are checked
/// once more in a statement of their own, whose snapshot is taken with the locks held:
/// every change to a node locks its row, so nothing it reads can change any more.
pub async fn lock_placeable(
    conn: &impl ConnectionTrait,
    reservation: &Reservation,
    nodes: &[NodeId],
) -> anyhow::Result<Vec<NodeId>> {
    let placeable_among = |nodes: &[NodeId]| {
        let mut query = pool_nodes(reservation);
        query
            .column((node::Entity, node::Column::Id))
            .and_where(one_of(
                node_col(node::Column::Id),
                nodes,
                conn.get_database_backend(),
            ))
            .and_where(placeable(reservation))
            .order_by((node::Entity, node::Column::Id), Order::Asc);
        query
    };
    if nodes.is_empty() {
        return Ok(Vec::new());
    }
    if conn.get_database_backend() != DbBackend::Postgres {
        return node_ids(conn, &placeable_among(nodes)).await;
    }
    let mut lock = placeable_among(nodes);
    lock.lock_with_behavior(LockType::Update, LockBehavior::SkipLocked);
    let locked = node_ids(conn, &lock).await?;
    if locked.is_empty() {
        return Ok(locked);
    }
    node_ids(conn, &placeable_among(&locked)).await
}

async fn node_ids(
    conn: &impl ConnectionTrait,
    query: &SelectStatement,
) -> anyhow::Result<Vec<NodeId>> {
    conn.query_all(query)
        .await?
        .iter()
        .map(|row| {
            let id: String = row.try_get("", "id")?;
            NodeId::parse(&id).map_err(|_| corrupt("nodes", "id", &id))
        })
        .collect()
}

/// The free atoms of each node (healthy, of `model` if given, not booked), in device order.
/// Read after the rows are locked, so it sees every booking committed before.
pub async fn free_atoms(
    conn: &impl ConnectionTrait,
    nodes: &[NodeId],
    model: Option<&str>,
) -> anyhow::Result<HashMap<NodeId, Vec<String>>> {
    if nodes.is_empty() {
        return Ok(HashMap::new());
    }
    let booked = Query::select()
        .expr(Expr::val(1))
        .from(atom_booking::Entity)
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::NodeId))
                .equals((node_device::Entity, node_device::Column::NodeId)),
        )
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::Atom))
                .equals((node_device::Entity, node_device::Column::Atom)),
        )
        .to_owned();
    let mut query = Query::select();
    query
        .column((node_device::Entity, node_device::Column::NodeId))
        .column((node_device::Entity, node_device::Column::Atom))
        .from(node_device::Entity)
        .and_where(one_of(
            Expr::col((node_device::Entity, node_device::Column::NodeId)),
            nodes,
            conn.get_database_backend(),
        ))
        .and_where(Expr::col((node_device::Entity, node_device::Column::Healthy)).eq(true))
        .and_where(Expr::not_exists(booked))
        .order_by(
            (node_device::Entity, node_device::Column::NodeId),
            Order::Asc,
        )
        .order_by((node_device::Entity, node_device::Column::Name), Order::Asc);
    if let Some(model) = model {
        query.and_where(Expr::col((node_device::Entity, node_device::Column::Model)).eq(model));
    }
    let mut out: HashMap<NodeId, Vec<String>> = HashMap::new();
    for row in conn.query_all(&query).await? {
        let id: String = row.try_get("", "node_id")?;
        let atom: String = row.try_get("", "atom")?;
        out.entry(NodeId::parse(&id).map_err(|_| corrupt("node_devices", "node_id", &id))?)
            .or_default()
            .push(atom);
    }
    Ok(out)
}

/// The most healthy GPUs (of `model`, if given) any live node of `pool` has: a shape asking
/// for more per node can never be placed there.
pub async fn largest_node(
    conn: &impl ConnectionTrait,
    pool: &PoolId,
    model: Option<&str>,
) -> anyhow::Result<i64> {
    let mut counts = Query::select();
    counts
        .expr_as(
            Expr::col((node_device::Entity, node_device::Column::Atom)).count(),
            Alias::new("atoms"),
        )
        .from(node_device::Entity)
        .inner_join(
            node::Entity,
            Expr::col((node::Entity, node::Column::Id))
                .equals((node_device::Entity, node_device::Column::NodeId)),
        )
        .and_where(node_col(node::Column::PoolId).eq(pool.to_string()))
        .and_where(node_col(node::Column::DeletedAt).is_null())
        .and_where(Expr::col((node_device::Entity, node_device::Column::Healthy)).eq(true))
        .group_by_col((node_device::Entity, node_device::Column::NodeId))
        .order_by_expr(
            Expr::col((node_device::Entity, node_device::Column::Atom)).count(),
            Order::Desc,
        )
        .limit(1);
    if let Some(model) = model {
        counts.and_where(Expr::col((node_device::Entity, node_device::Column::Model)).eq(model));
    }
    Ok(match conn.query_one(&counts.to_owned()).await? {
        Some(row) => row.try_get("", "atoms")?,
        None => 0,
    })
}

/// The pool's nodes that are big enough for the reservation's shape, counted by capacity
/// bucket, whether the reservation may use them, and whether they have enough free atoms now:
/// what [`bc_core::placement::explain_unplaced`] turns into a sentence.
pub async fn fit_counts(
    conn: &impl ConnectionTrait,
    reservation: &Reservation,
) -> anyhow::Result<Vec<FitCount>> {
    let model = reservation.shape.gpu_model.as_deref();
    let wanted = i64::from(reservation.shape.gpus_per_node);
    let query = pool_nodes(reservation)
        .expr_as(schedule_sql::bucket(), Alias::new("bucket"))
        .expr_as(placeable(reservation), Alias::new("placeable"))
        .expr_as(
            free_atoms_of_node(model).gte(wanted),
            Alias::new("enough_free"),
        )
        .and_where(total_atoms_expr(model).gte(wanted))
        .to_owned();
    let mut counts: BTreeMap<(CapacityBucket, bool, bool), u64> = BTreeMap::new();
    for row in conn.query_all(&query).await? {
        let bucket: String = row.try_get("", "bucket")?;
        let bucket: CapacityBucket = bucket
            .parse()
            .map_err(|_| anyhow!("unknown bucket `{bucket}`"))?;
        let placeable: bool = row.try_get("", "placeable")?;
        let enough_free: bool = row.try_get("", "enough_free")?;
        *counts.entry((bucket, placeable, enough_free)).or_default() += 1;
    }
    Ok(counts
        .into_iter()
        .map(|((bucket, placeable, enough_free), nodes)| FitCount {
            bucket,
            placeable,
            enough_free,
            nodes,
        })
        .collect())
}

/// Allocated and free GPUs of schedulable nodes, per pool and GPU model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelCapacity {
    pub pool_id: String,
    pub model: String,
    pub allocated: i64,
    pub free: i64,
}

pub async fn schedulable_by_model(
    conn: &impl ConnectionTrait,
    pool_ids: &[String],
) -> anyhow::Result<Vec<ModelCapacity>> {
    if pool_ids.is_empty() {
        return Ok(Vec::new());
    }
    let booked = Query::select()
        .expr(Expr::val(1))
        .from(atom_booking::Entity)
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::NodeId))
                .equals((node_device::Entity, node_device::Column::NodeId)),
        )
        .and_where(
            Expr::col((atom_booking::Entity, atom_booking::Column::Atom))
                .equals((node_device::Entity, node_device::Column::Atom)),
        )
        .to_owned();
    let is_booked = Expr::exists(booked);
    let query = Query::select()
        .column((node::Entity, node::Column::PoolId))
        .column((node_device::Entity, node_device::Column::Model))
        .expr_as(
            sea_orm::sea_query::CaseStatement::new()
                .case(is_booked.clone(), Expr::val(1))
                .finally(Expr::val(0))
                .sum(),
            Alias::new("allocated"),
        )
        .expr_as(
            sea_orm::sea_query::CaseStatement::new()
                .case(is_booked, Expr::val(0))
                .finally(Expr::val(1))
                .sum(),
            Alias::new("free"),
        )
        .from(node_device::Entity)
        .inner_join(
            node::Entity,
            Expr::col((node::Entity, node::Column::Id))
                .equals((node_device::Entity, node_device::Column::NodeId)),
        )
        .and_where(node_col(node::Column::DeletedAt).is_null())
        .and_where(node_col(node::Column::PoolId).is_in(pool_ids.to_vec()))
        .and_where(Expr::col((node_device::Entity, node_device::Column::Healthy)).eq(true))
        .and_where(schedule_sql::schedulable())
        .group_by_col((node::Entity, node::Column::PoolId))
        .group_by_col((node_device::Entity, node_device::Column::Model))
        .order_by((node::Entity, node::Column::PoolId), Order::Asc)
        .order_by(
            (node_device::Entity, node_device::Column::Model),
            Order::Asc,
        )
        .to_owned();
    conn.query_all(&query)
        .await?
        .iter()
        .map(|row| {
            Ok(ModelCapacity {
                pool_id: row.try_get("", "pool_id")?,
                model: row.try_get("", "model")?,
                allocated: row.try_get::<Option<i64>>("", "allocated")?.unwrap_or(0),
                free: row.try_get::<Option<i64>>("", "free")?.unwrap_or(0),
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Pool offers.

pub async fn offer_pool(
    conn: &impl ConnectionTrait,
    pool: &PoolId,
    tenant: &TenantId,
    by: &str,
    now: DateTime<Utc>,
) -> anyhow::Result<bool> {
    let exists = pool_offer::Entity::find_by_id((pool.to_string(), tenant.to_string()))
        .one(conn)
        .await?
        .is_some();
    if exists {
        return Ok(false);
    }
    pool_offer::Entity::insert(pool_offer::ActiveModel {
        pool_id: Set(pool.to_string()),
        tenant_id: Set(tenant.to_string()),
        offered_by: Set(by.to_owned()),
        offered_at: Set(now),
    })
    .exec_without_returning(conn)
    .await?;
    Ok(true)
}

/// Whether `pool` is offered to `tenant`.
pub async fn is_offered(
    conn: &impl ConnectionTrait,
    pool: &PoolId,
    tenant: &TenantId,
) -> anyhow::Result<bool> {
    Ok(
        pool_offer::Entity::find_by_id((pool.to_string(), tenant.to_string()))
            .one(conn)
            .await?
            .is_some(),
    )
}

/// The tenants each of `pools` is offered to.
pub async fn offers_of(
    conn: &impl ConnectionTrait,
    pools: &[String],
) -> anyhow::Result<HashMap<String, Vec<String>>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    if pools.is_empty() {
        return Ok(out);
    }
    for row in pool_offer::Entity::find()
        .filter(pool_offer::Column::PoolId.is_in(pools.to_vec()))
        .order_by_asc(pool_offer::Column::TenantId)
        .all(conn)
        .await?
    {
        out.entry(row.pool_id).or_default().push(row.tenant_id);
    }
    Ok(out)
}

/// Live `tenant-owned` nodes of `pool` owned by someone other than `tenant`: the offering
/// validator refuses to offer such a pool to `tenant`.
pub async fn foreign_tenant_owned_nodes(
    conn: &impl ConnectionTrait,
    pool: &PoolId,
    tenant: &TenantId,
) -> anyhow::Result<u64> {
    Ok(node::Entity::find()
        .filter(node::Column::PoolId.eq(pool.to_string()))
        .filter(node::Column::DeletedAt.is_null())
        .filter(node::Column::Trust.eq(bc_core::axes::Trust::TenantOwned.as_static_str()))
        .filter(node::Column::OwnerTenantId.ne(tenant.to_string()))
        .count(conn)
        .await?)
}
