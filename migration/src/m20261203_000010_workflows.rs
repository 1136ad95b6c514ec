//! Bare-metal workflows (`bare_metal_workflows`): one row per workflow run on a node, its
//! steps (status, timestamps, attempts, deadline, log) as one JSON column, so the Workflow
//! controller resumes each where it was after a restart. A workflow's steps are read and
//! written together, always whole, under the row's `version`, so they need no table of
//! their own.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum BareMetalWorkflows {
    Table,
    Id,
    NodeId,
    Kind,
    Status,
    CurrentStep,
    Steps,
    Reason,
    StartedBy,
    IdentityGeneration,
    Version,
    CreatedAt,
    UpdatedAt,
    FinishedAt,
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
                    .table(BareMetalWorkflows::Table)
                    .col(text(BareMetalWorkflows::Id).primary_key())
                    .col(text(BareMetalWorkflows::NodeId))
                    .col(text(BareMetalWorkflows::Kind))
                    .col(text(BareMetalWorkflows::Status))
                    .col(big_integer(BareMetalWorkflows::CurrentStep))
                    .col(json_binary(BareMetalWorkflows::Steps))
                    .col(text_null(BareMetalWorkflows::Reason))
                    .col(text(BareMetalWorkflows::StartedBy))
                    .col(big_integer(BareMetalWorkflows::IdentityGeneration))
                    .col(big_integer(BareMetalWorkflows::Version))
                    .col(timestamp_with_time_zone(BareMetalWorkflows::CreatedAt))
                    .col(timestamp_with_time_zone(BareMetalWorkflows::UpdatedAt))
                    .col(timestamp_with_time_zone_null(
                        BareMetalWorkflows::FinishedAt,
                    ))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_bare_metal_workflows_node_id")
                            .from(BareMetalWorkflows::Table, BareMetalWorkflows::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        // A node's workflows, newest first (the bare-metal view shows the latest).
        manager
            .create_index(
                Index::create()
                    .name("ix_bare_metal_workflows_node_id_created_at")
                    .table(BareMetalWorkflows::Table)
                    .col(BareMetalWorkflows::NodeId)
                    .col(BareMetalWorkflows::CreatedAt)
                    .take(),
            )
            .await?;
        // The controller's work list (the running ones) and the rule that a node runs at
        // most one workflow at a time, which storage keeps whatever two writers race to do.
        // Partial indexes are written the same way on SQLite and PostgreSQL.
        manager
            .get_connection()
            .execute_unprepared(
                "CREATE UNIQUE INDEX ux_bare_metal_workflows_running_node \
                 ON bare_metal_workflows (node_id) WHERE status = 'running'",
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(BareMetalWorkflows::Table).take())
            .await?;
        Ok(())
    }
}
