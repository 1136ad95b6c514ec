//! `controller_leases`: which server runs the controllers. Replicas on one database would
//! otherwise each run every pass (Liveness, drains, placement, remediation, power): safe,
//! since every change is version-checked, but each pass done N times and most of them ending
//! in conflicts. One row per lease; the holder renews it every tick, and another server takes
//! it over once it has expired (`store::leases`).

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum ControllerLeases {
    Table,
    Name,
    Holder,
    Since,
    ExpiresAt,
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ControllerLeases::Table)
                    .col(text(ControllerLeases::Name).primary_key())
                    .col(text(ControllerLeases::Holder))
                    .col(timestamp_with_time_zone(ControllerLeases::Since))
                    .col(timestamp_with_time_zone(ControllerLeases::ExpiresAt))
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ControllerLeases::Table).take())
            .await
    }
}
