//! The command queue.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Commands {
    Table,
    Id,
    NodeId,
    TenantId,
    Kind,
    Lane,
    Params,
    Status,
    Force,
    NotBefore,
    TimeoutSecs,
    ExpiresAt,
    Attempts,
    SessionEpoch,
    ExitCode,
    Output,
    Result,
    Error,
    CreatedBy,
    CreatedAt,
    DispatchedAt,
    StartedAt,
    FinishedAt,
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
                    .table(Commands::Table)
                    .col(text(Commands::Id).primary_key())
                    .col(text(Commands::NodeId))
                    .col(text_null(Commands::TenantId))
                    .col(text(Commands::Kind))
                    .col(text(Commands::Lane))
                    .col(json_binary(Commands::Params))
                    .col(text(Commands::Status))
                    .col(boolean(Commands::Force))
                    .col(timestamp_with_time_zone(Commands::NotBefore))
                    .col(big_integer(Commands::TimeoutSecs))
                    .col(timestamp_with_time_zone(Commands::ExpiresAt))
                    .col(integer(Commands::Attempts))
                    .col(big_integer_null(Commands::SessionEpoch))
                    .col(integer_null(Commands::ExitCode))
                    .col(text(Commands::Output))
                    .col(json_binary_null(Commands::Result))
                    .col(text_null(Commands::Error))
                    .col(text(Commands::CreatedBy))
                    .col(timestamp_with_time_zone(Commands::CreatedAt))
                    .col(timestamp_with_time_zone_null(Commands::DispatchedAt))
                    .col(timestamp_with_time_zone_null(Commands::StartedAt))
                    .col(timestamp_with_time_zone_null(Commands::FinishedAt))
                    .col(timestamp_with_time_zone(Commands::UpdatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_commands_node_id")
                            .from(Commands::Table, Commands::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_commands_node_id_status_lane")
                    .table(Commands::Table)
                    .col(Commands::NodeId)
                    .col(Commands::Status)
                    .col(Commands::Lane)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_commands_status_expires_at")
                    .table(Commands::Table)
                    .col(Commands::Status)
                    .col(Commands::ExpiresAt)
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Commands::Table).take())
            .await?;
        Ok(())
    }
}
