//! `liveness_brakes`: the fleet brake's episodes, one row per site whose brake tripped
//! (`bc_core::brake`). Stored, not kept in the controller's memory, so that the leader after
//! a failover holds the same sites, and so that an admin can list a brake and release it.
//! The row is deleted when the episode ends.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum LivenessBrakes {
    Table,
    SiteId,
    Status,
    Silent,
    RecentlyUnreachable,
    Watched,
    TrippedAt,
    ReleasedBy,
    ReleaseReason,
    ReleasedAt,
}

#[derive(DeriveIden)]
enum Sites {
    Table,
    Id,
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
                    .table(LivenessBrakes::Table)
                    .col(text(LivenessBrakes::SiteId).primary_key())
                    .col(text(LivenessBrakes::Status))
                    .col(big_integer(LivenessBrakes::Silent))
                    .col(big_integer(LivenessBrakes::RecentlyUnreachable))
                    .col(big_integer(LivenessBrakes::Watched))
                    .col(timestamp_with_time_zone(LivenessBrakes::TrippedAt))
                    .col(text_null(LivenessBrakes::ReleasedBy))
                    .col(text_null(LivenessBrakes::ReleaseReason))
                    .col(timestamp_with_time_zone_null(LivenessBrakes::ReleasedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_liveness_brakes_site_id")
                            .from(LivenessBrakes::Table, LivenessBrakes::SiteId)
                            .to(Sites::Table, Sites::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(LivenessBrakes::Table).take())
            .await
    }
}
