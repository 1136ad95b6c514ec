//! Better Compute's schema migrations, run by the server at start.
//!
//! ```no_run
//! use bc_migration::{Migrator, MigratorTrait};
//! # async fn start(db: &sea_orm::DatabaseConnection) -> Result<(), sea_orm::DbErr> {
//! Migrator::up(db, None).await?;
//! # Ok(())
//! # }
//! ```
//!
//! The same DDL runs on SQLite and PostgreSQL, except where a migration says otherwise (the
//! event-order trigger is PostgreSQL's alone). Migrations are frozen once
//! released: never edit one, add a new `mYYYYMMDD_NNNNNN_*` module instead.

pub use sea_orm_migration::MigratorTrait;
use sea_orm_migration::prelude::*;

mod m20261202_000001_initial;
mod m20261202_000002_join_and_inventory;
mod m20261202_000003_commands;
mod m20261202_000004_devices;
mod m20261203_000001_enrolled_identifiers;
mod m20261203_000005_placement;
mod m20261203_000006_event_history;
mod m20261203_000007_remediation;
mod m20261203_000008_bare_metal;
mod m20261203_000009_free_atoms;
mod m20261203_000010_workflows;
mod m20261203_000011_pool_acceptance;
mod m20261203_000012_controller_leases;
mod m20261203_000020_liveness_brakes;
mod m20261205_000021_event_order_trigger;
mod m20261205_000022_nodes_awaiting_first_spec;
mod m20261206_000023_open_sessions_by_gateway;

pub use m20261205_000021_event_order_trigger::{EVENT_ORDER_LOCK, NOTIFY_CHANNEL};

/// Runs every migration in order; see [`MigratorTrait`] for `up`/`down`/`status`.
pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261202_000001_initial::Migration),
            Box::new(m20261202_000002_join_and_inventory::Migration),
            Box::new(m20261202_000003_commands::Migration),
            Box::new(m20261202_000004_devices::Migration),
            Box::new(m20261203_000001_enrolled_identifiers::Migration),
            Box::new(m20261203_000005_placement::Migration),
            Box::new(m20261203_000006_event_history::Migration),
            Box::new(m20261203_000007_remediation::Migration),
            Box::new(m20261203_000008_bare_metal::Migration),
            Box::new(m20261203_000009_free_atoms::Migration),
            Box::new(m20261203_000010_workflows::Migration),
            Box::new(m20261203_000011_pool_acceptance::Migration),
            Box::new(m20261203_000012_controller_leases::Migration),
            Box::new(m20261203_000020_liveness_brakes::Migration),
            Box::new(m20261205_000021_event_order_trigger::Migration),
            Box::new(m20261205_000022_nodes_awaiting_first_spec::Migration),
            Box::new(m20261206_000023_open_sessions_by_gateway::Migration),
        ]
    }
}
