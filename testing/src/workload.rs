//! A workload for a simulated fleet (`better-compute dev --sim N --workload R`): reservations
//! of mixed shapes created at a steady rate in one pool, each released after a random
//! lifetime, so a newcomer watching the dashboard sees the fleet's allocated and free GPUs
//! move as they would under real users.
//!
//! It runs in the server's process and goes through [`Services`], the door every API call
//! takes, as a tenant of its own (`dev-workload`) to which the pool is offered. Every
//! reservation also carries an expiry a little after its lifetime, so the reservations of a
//! workload that was stopped half-way end by themselves once a server runs again.

use bc_core::ids::{PoolId, ReservationId, TenantId};
use bc_core::placement::{PlacementPolicy, ReservationState, Shape};
use better_compute::auth::{Principal, Role};
use better_compute::error::ApiError;
use better_compute::service::placement::ReservationRequest;
use better_compute::service::{ReservationFilter, Services};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use std::fmt;
use std::future::Future;
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The tenant the workload reserves as (found by name, created on the first run).
pub const WORKLOAD_TENANT: &str = "dev-workload";
/// The principals the workload acts as: a platform admin to set up the tenant and the pool's
/// offer, then that tenant's operator.
const WORKLOAD_SUBJECT: &str = "dev-workload";
/// How long a workload principal is good for: as long as the workload runs (services do not
/// check it; the API checks tokens, which the workload does not use).
const PRINCIPAL_LIFETIME: chrono::Duration = chrono::Duration::days(3650);
/// How long after its lifetime a reservation expires if the workload did not release it
/// (the process stopped): long enough never to race the release of a running workload.
const EXPIRY_GRACE: Duration = Duration::from_secs(30);
/// Creates in flight at most: when the server falls behind the rate, later ticks are skipped
/// (and counted) instead of piling up requests.
const MAX_CREATES_IN_FLIGHT: usize = 32;
/// The highest rate accepted, in reservations per second.
pub const MAX_RATE: f64 = 1000.0;
/// Of the reservations, the share that is a 2-node gang, and the share placed by spreading
/// (the rest bin-pack).
const GANG_SHARE: f64 = 0.1;
const SPREAD_SHARE: f64 = 0.2;
/// GPUs per node a reservation asks for, with their weights: mostly small shapes, some whole
/// nodes.
const GPU_SHAPES: [(u32, u32); 4] = [(1, 35), (2, 25), (4, 20), (8, 20)];

/// GPUs per node for one reservation, drawn from [`GPU_SHAPES`] by weight: the mix of the
/// workload and of `placement-bench`.
pub fn random_gpus_per_node(rng: &mut impl Rng) -> u32 {
    GPU_SHAPES
        .choose_weighted(rng, |(_, weight)| *weight)
        .map_or(1, |(gpus, _)| *gpus)
}

/// What the workload does.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Reservations created per second.
    pub rate: f64,
    /// The most GPUs per node a reservation asks for: the fleet's GPUs per node, so every
    /// shape fits some machine.
    pub max_gpus: u32,
    /// Each reservation is released after a lifetime drawn from this range.
    pub lifetime: RangeInclusive<Duration>,
    /// How often the summary is reported.
    pub report_every: Duration,
    /// The seed of the shapes and lifetimes (random when `None`).
    pub seed: Option<u64>,
}

impl WorkloadOptions {
    /// `rate` reservations per second of shapes up to `max_gpus` GPUs per node, living two
    /// seconds to a minute, summarised every 10 s.
    pub fn new(rate: f64, max_gpus: u32) -> anyhow::Result<WorkloadOptions> {
        if !(rate > 0.0 && rate <= MAX_RATE) {
            anyhow::bail!(
                "the workload's rate must be above 0 and at most {MAX_RATE} per second, not {rate}"
            );
        }
        if max_gpus == 0 {
            anyhow::bail!("the workload needs nodes with GPUs");
        }
        Ok(WorkloadOptions {
            rate,
            max_gpus,
            lifetime: Duration::from_secs(2)..=Duration::from_secs(60),
            report_every: Duration::from_secs(10),
            seed: None,
        })
    }
}

/// What the workload did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkloadCounts {
    pub created: u64,
    /// Created and placed at once.
    pub placed_at_once: u64,
    /// Created PENDING: placed later when capacity frees, or released while still waiting.
    pub pending_at_once: u64,
    /// Released at the end of their lifetime (placed or still pending).
    pub released: u64,
    /// Ended before their release (expired or failed).
    pub ended_otherwise: u64,
    /// Ticks skipped because [`MAX_CREATES_IN_FLIGHT`] creates were still running.
    pub skipped: u64,
    /// Creates and releases that failed (each logged at `warn`).
    pub errors: u64,
}

/// The summary reported every [`WorkloadOptions::report_every`]: the counts, and the pool as
/// it is now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkloadReport {
    pub totals: WorkloadCounts,
    /// The workload's reservations in the pool now, by state.
    pub placed_now: u64,
    pub pending_now: u64,
    /// GPUs of the pool's schedulable nodes, booked and free.
    pub allocated_gpus: i64,
    pub free_gpus: i64,
}

impl fmt::Display for WorkloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.totals;
        write!(
            f,
            "workload: {} created ({} placed at once, {} pending), {} released; now {} placed, {} pending; {} of {} GPUs allocated",
            t.created,
            t.placed_at_once,
            t.pending_at_once,
            t.released,
            self.placed_now,
            self.pending_now,
            self.allocated_gpus,
            self.allocated_gpus + self.free_gpus,
        )?;
        if t.ended_otherwise > 0 {
            write!(f, "; {} expired or failed", t.ended_otherwise)?;
        }
        if t.skipped > 0 {
            write!(f, "; {} skipped (server behind)", t.skipped)?;
        }
        if t.errors > 0 {
            write!(f, "; {} errors", t.errors)?;
        }
        Ok(())
    }
}

/// Runs the workload in `pool` until `stop` completes, reporting every
/// [`WorkloadOptions::report_every`]; returns what it did. Reservations still live when it
/// stops are left to their expiry.
pub async fn run_workload<S>(
    services: Services,
    pool: PoolId,
    options: WorkloadOptions,
    report: impl Fn(WorkloadReport) + Send + Sync + 'static,
    stop: S,
) -> anyhow::Result<WorkloadCounts>
where
    S: Future<Output = ()>,
{
    let tenant = workload_tenant(&services, &pool).await?;
    let workload = Arc::new(Workload {
        services,
        tenant: principal(Role::Operator, Some(tenant)),
        pool,
        counts: Mutex::new(WorkloadCounts::default()),
    });
    let mut rng = match options.seed {
        Some(seed) => StdRng::seed_from_u64(seed),
        None => StdRng::from_os_rng(),
    };
    let mut creates = tokio::time::interval(Duration::from_secs_f64(1.0 / options.rate));
    creates.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut reports = tokio::time::interval(options.report_every);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first report tick is immediate; the first summary comes after one period.
    reports.tick().await;
    let in_flight = Arc::new(Semaphore::new(MAX_CREATES_IN_FLIGHT));
    let mut lives = JoinSet::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            _ = creates.tick() => {
                let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                    workload.count(|c| c.skipped += 1);
                    continue;
                };
                let request = workload.random_request(&mut rng, &options);
                let lifetime = rng.random_range(options.lifetime.clone());
                let workload = workload.clone();
                lives.spawn(async move { workload.live(request, lifetime, permit).await });
            }
            _ = reports.tick() => report(workload.report().await),
            // Reap finished lives so the set does not grow with the run.
            Some(_) = lives.join_next(), if !lives.is_empty() => {}
        }
    }
    lives.shutdown().await;
    Ok(workload.totals())
}

/// Tenants read per page while looking for the workload's.
const TENANT_PAGE: u64 = 500;

/// The workload's tenant, found by name or created, with `pool` offered to it.
async fn workload_tenant(services: &Services, pool: &PoolId) -> anyhow::Result<TenantId> {
    let admin = principal(Role::Admin, None);
    // Tenants are paged by name: read pages until the workload's is found or none is left.
    let mut after: Option<TenantId> = None;
    let existing = loop {
        let page = services
            .tenants(&admin, after.as_ref(), TENANT_PAGE)
            .await
            .map_err(api)?;
        after = page.items.last().map(|t| t.id.clone());
        let found = page.items.into_iter().find(|t| t.name == WORKLOAD_TENANT);
        if found.is_some() || !page.has_next_page {
            break found;
        }
    };
    let tenant = match existing {
        Some(tenant) => tenant,
        None => services
            .create_tenant(&admin, WORKLOAD_TENANT)
            .await
            .map_err(api)?,
    };
    services
        .offer_pool(&admin, pool, &tenant.id)
        .await
        .map_err(api)?;
    Ok(tenant.id)
}

fn principal(role: Role, tenant: Option<TenantId>) -> Principal {
    Principal {
        subject: WORKLOAD_SUBJECT.to_owned(),
        role,
        tenant,
        expires_at: chrono::Utc::now() + PRINCIPAL_LIFETIME,
    }
}

fn api(err: ApiError) -> anyhow::Error {
    anyhow::anyhow!("{}: {}", err.code(), err.message())
}

struct Workload {
    services: Services,
    tenant: Principal,
    pool: PoolId,
    counts: Mutex<WorkloadCounts>,
}

impl Workload {
    fn count(&self, change: impl FnOnce(&mut WorkloadCounts)) {
        change(&mut self.counts.lock().unwrap_or_else(PoisonError::into_inner));
    }

    fn totals(&self) -> WorkloadCounts {
        *self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A reservation of 1, 2, 4 or 8 GPUs per node (at most `max_gpus`), sometimes a 2-node
    /// gang, mostly bin-packed.
    fn random_request(&self, rng: &mut StdRng, options: &WorkloadOptions) -> ReservationRequest {
        let gpus = random_gpus_per_node(rng);
        ReservationRequest {
            tenant_id: None,
            pool_id: self.pool.clone(),
            shape: Shape {
                gpus_per_node: gpus.min(options.max_gpus),
                node_count: if rng.random_bool(GANG_SHARE) { 2 } else { 1 },
                gpu_model: None,
                selector: Vec::new(),
                tolerations: Vec::new(),
            },
            policy: if rng.random_bool(SPREAD_SHARE) {
                PlacementPolicy::Spread
            } else {
                PlacementPolicy::BinPack
            },
            idempotency_key: None,
            expires_at: None,
        }
    }

    /// One reservation's life: created (the permit is held while the create runs), then
    /// released after `lifetime`.
    async fn live(
        &self,
        mut request: ReservationRequest,
        lifetime: Duration,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let expires_in =
            chrono::Duration::from_std(lifetime + EXPIRY_GRACE).unwrap_or(chrono::Duration::MAX);
        request.expires_at = Some(self.services.clock.now() + expires_in);
        let created = self
            .services
            .create_reservation(&self.tenant, request)
            .await;
        drop(permit);
        let reservation = match created {
            Ok(reservation) => reservation,
            Err(err) => {
                tracing::warn!(code = err.code(), message = %err.message(), "the workload could not create a reservation");
                self.count(|c| c.errors += 1);
                return;
            }
        };
        self.count(|c| {
            c.created += 1;
            if reservation.state == ReservationState::Placed {
                c.placed_at_once += 1;
            } else {
                c.pending_at_once += 1;
            }
        });
        tokio::time::sleep(lifetime).await;
        match self.release(&reservation.id, reservation.version).await {
            Ok(true) => self.count(|c| c.released += 1),
            Ok(false) => self.count(|c| c.ended_otherwise += 1),
            Err(err) => {
                tracing::warn!(code = err.code(), message = %err.message(), "the workload could not release a reservation");
                self.count(|c| c.errors += 1);
            }
        }
    }

    /// Releases a reservation, reading its version again when it moved meanwhile (placed
    /// after waiting, or evicted). `false`: it had ended already.
    async fn release(&self, id: &ReservationId, mut version: i64) -> Result<bool, ApiError> {
        loop {
            match self
                .services
                .release_reservation(&self.tenant, id, version)
                .await
            {
                Ok(_) => return Ok(true),
                Err(ApiError::Conflict { current, .. }) => version = current,
                Err(ApiError::InvalidState { .. }) => return Ok(false),
                Err(err) => return Err(err),
            }
        }
    }

    /// The counts and the pool now.
    async fn report(&self) -> WorkloadReport {
        let count = |state: ReservationState| {
            let filter = ReservationFilter {
                tenant: None,
                pool_ids: vec![self.pool.clone()],
                states: vec![state],
            };
            self.services.count_reservations(&self.tenant, filter)
        };
        let placed_now = count(ReservationState::Placed).await.unwrap_or_default();
        let pending_now = count(ReservationState::Pending).await.unwrap_or_default();
        let capacity = self
            .services
            .schedulable_by_model(&[self.pool.to_string()])
            .await
            .unwrap_or_default();
        WorkloadReport {
            totals: self.totals(),
            placed_now,
            pending_now,
            allocated_gpus: capacity.iter().map(|c| c.allocated).sum(),
            free_gpus: capacity.iter().map(|c| c.free).sum(),
        }
    }
}
