//! Devices (GPUs) and their atoms, as the Inventory controller derives them.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum NodeDevices {
    Table,
    NodeId,
    Name,
    Kind,
    Uuid,
    PciBusId,
    Model,
    MemoryMib,
    Serial,
    Atom,
    Healthy,
    UpdatedAt,
}

#[derive(DeriveIden)]
enum Nodes {
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
                    .table(NodeDevices::Table)
                    .col(text(NodeDevices::NodeId))
                    .col(text(NodeDevices::Name))
                    .col(text(NodeDevices::Kind))
                    .col(text(NodeDevices::Uuid))
                    .col(text(NodeDevices::PciBusId))
                    .col(text(NodeDevices::Model))
                    .col(big_integer(NodeDevices::MemoryMib))
                    .col(text_null(NodeDevices::Serial))
                    .col(text(NodeDevices::Atom))
                    .col(boolean(NodeDevices::Healthy))
                    .col(timestamp_with_time_zone(NodeDevices::UpdatedAt))
                    .primary_key(
                        Index::create()
                            .col(NodeDevices::NodeId)
                            .col(NodeDevices::Name),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_node_devices_node_id")
                            .from(NodeDevices::Table, NodeDevices::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(NodeDevices::Table).take())
            .await?;
        Ok(())
    }
}
