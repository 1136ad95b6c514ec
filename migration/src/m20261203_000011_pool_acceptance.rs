//! Acceptance per pool: the checks acceptance runs on a pool's new nodes
//! (`pools.acceptance`, `bc_core::acceptance::AcceptancePolicy` as JSON; `NULL` for the
//! defaults). A pool's expected driver version lives in `pools.hardware_profile` beside its
//! expected GPU count and model, which needs no change here.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Pools {
    Table,
    Acceptance,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Pools::Table)
                    .add_column(json_binary_null(Pools::Acceptance))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(Pools::Table)
                    .drop_column(Pools::Acceptance)
                    .take(),
            )
            .await
    }
}
