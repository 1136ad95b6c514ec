//! Placement: reservations, the allocations that book atoms for them, the bookings that make a
//! double booking impossible, and the tenants each pool is offered to.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Reservations {
    Table,
    Id,
    TenantId,
    PoolId,
    GpusPerNode,
    NodeCount,
    GpuModel,
    Selector,
    Tolerations,
    Policy,
    State,
    Reason,
    IdempotencyKey,
    ExpiresAt,
    Version,
    CreatedBy,
    CreatedAt,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Allocations {
    Table,
    Id,
    ReservationId,
    TenantId,
    PoolId,
    NodeId,
    Atoms,
    BookedAt,
    ReleasedAt,
    ReleaseReason,
}

#[derive(DeriveIden)]
enum AtomBookings {
    Table,
    NodeId,
    Atom,
    AllocationId,
}

#[derive(DeriveIden)]
enum PoolOffers {
    Table,
    PoolId,
    TenantId,
    OfferedBy,
    OfferedAt,
}

#[derive(DeriveIden)]
enum Nodes {
    Table,
    Id,
}

#[derive(DeriveIden)]
enum Pools {
    Table,
    Id,
}

#[derive(DeriveIden)]
enum Tenants {
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
                    .table(Reservations::Table)
                    .col(text(Reservations::Id).primary_key())
                    .col(text(Reservations::TenantId))
                    .col(text(Reservations::PoolId))
                    .col(integer(Reservations::GpusPerNode))
                    .col(integer(Reservations::NodeCount))
                    .col(text_null(Reservations::GpuModel))
                    .col(json_binary(Reservations::Selector))
                    .col(json_binary(Reservations::Tolerations))
                    .col(text(Reservations::Policy))
                    .col(text(Reservations::State))
                    .col(text_null(Reservations::Reason))
                    .col(text_null(Reservations::IdempotencyKey))
                    .col(timestamp_with_time_zone_null(Reservations::ExpiresAt))
                    .col(big_integer(Reservations::Version))
                    .col(text(Reservations::CreatedBy))
                    .col(timestamp_with_time_zone(Reservations::CreatedAt))
                    .col(timestamp_with_time_zone(Reservations::UpdatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_reservations_tenant_id")
                            .from(Reservations::Table, Reservations::TenantId)
                            .to(Tenants::Table, Tenants::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_reservations_pool_id")
                            .from(Reservations::Table, Reservations::PoolId)
                            .to(Pools::Table, Pools::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .take(),
            )
            .await?;
        // A retried create with the same key finds the first reservation (NULL keys are
        // distinct on both databases, so reservations without a key never collide).
        manager
            .create_index(
                Index::create()
                    .name("ux_reservations_tenant_idempotency_key")
                    .table(Reservations::Table)
                    .col(Reservations::TenantId)
                    .col(Reservations::IdempotencyKey)
                    .unique()
                    .take(),
            )
            .await?;
        // The placer's retry reads pending reservations of a pool oldest first.
        manager
            .create_index(
                Index::create()
                    .name("ix_reservations_pool_state_created")
                    .table(Reservations::Table)
                    .col(Reservations::PoolId)
                    .col(Reservations::State)
                    .col(Reservations::CreatedAt)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_reservations_state_expires_at")
                    .table(Reservations::Table)
                    .col(Reservations::State)
                    .col(Reservations::ExpiresAt)
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(Allocations::Table)
                    .col(text(Allocations::Id).primary_key())
                    .col(text(Allocations::ReservationId))
                    .col(text(Allocations::TenantId))
                    .col(text(Allocations::PoolId))
                    .col(text(Allocations::NodeId))
                    .col(json_binary(Allocations::Atoms))
                    .col(timestamp_with_time_zone(Allocations::BookedAt))
                    .col(timestamp_with_time_zone_null(Allocations::ReleasedAt))
                    .col(text_null(Allocations::ReleaseReason))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_allocations_reservation_id")
                            .from(Allocations::Table, Allocations::ReservationId)
                            .to(Reservations::Table, Reservations::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_allocations_node_id")
                            .from(Allocations::Table, Allocations::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_allocations_node_released")
                    .table(Allocations::Table)
                    .col(Allocations::NodeId)
                    .col(Allocations::ReleasedAt)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_allocations_reservation")
                    .table(Allocations::Table)
                    .col(Allocations::ReservationId)
                    .take(),
            )
            .await?;

        // One row per atom an active allocation holds; releasing deletes it. The primary key
        // is the unique index over active allocations per atom: a second booking of an atom
        // fails in the database, whatever the placer computed.
        manager
            .create_table(
                Table::create()
                    .table(AtomBookings::Table)
                    .col(text(AtomBookings::NodeId))
                    .col(text(AtomBookings::Atom))
                    .col(text(AtomBookings::AllocationId))
                    .primary_key(
                        Index::create()
                            .col(AtomBookings::NodeId)
                            .col(AtomBookings::Atom),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_atom_bookings_allocation_id")
                            .from(AtomBookings::Table, AtomBookings::AllocationId)
                            .to(Allocations::Table, Allocations::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_atom_bookings_allocation")
                    .table(AtomBookings::Table)
                    .col(AtomBookings::AllocationId)
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(PoolOffers::Table)
                    .col(text(PoolOffers::PoolId))
                    .col(text(PoolOffers::TenantId))
                    .col(text(PoolOffers::OfferedBy))
                    .col(timestamp_with_time_zone(PoolOffers::OfferedAt))
                    .primary_key(
                        Index::create()
                            .col(PoolOffers::PoolId)
                            .col(PoolOffers::TenantId),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_pool_offers_pool_id")
                            .from(PoolOffers::Table, PoolOffers::PoolId)
                            .to(Pools::Table, Pools::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_pool_offers_tenant_id")
                            .from(PoolOffers::Table, PoolOffers::TenantId)
                            .to(Tenants::Table, Tenants::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in [
            PoolOffers::Table.into_iden(),
            AtomBookings::Table.into_iden(),
            Allocations::Table.into_iden(),
            Reservations::Table.into_iden(),
        ] {
            manager
                .drop_table(Table::drop().table(table).take())
                .await?;
        }
        Ok(())
    }
}
