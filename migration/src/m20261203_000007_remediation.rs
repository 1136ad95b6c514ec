//! Reasons that clear only on proof, and health remediation: the progress of a condition's
//! proof (`node_conditions.proof`), a pool's remediation policy (`pools.remediation`, `NULL`
//! for the defaults), and one row per remediation try (`remediation_attempts`).

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum RemediationAttempts {
    Table,
    Id,
    RunId,
    NodeId,
    ConditionType,
    Ladder,
    Step,
    Attempt,
    Action,
    Status,
    ActionCommandId,
    RefreshCommandId,
    VerifyCommandId,
    NextAttemptAt,
    Note,
    CreatedAt,
    UpdatedAt,
    FinishedAt,
}

#[derive(DeriveIden)]
enum Nodes {
    Table,
    Id,
}

#[derive(DeriveIden)]
enum Pools {
    Table,
    Remediation,
}

#[derive(DeriveIden)]
enum NodeConditions {
    Table,
    Proof,
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
                    .table(NodeConditions::Table)
                    .add_column(json_binary_null(NodeConditions::Proof))
                    .take(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(Pools::Table)
                    .add_column(json_binary_null(Pools::Remediation))
                    .take(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(RemediationAttempts::Table)
                    .col(text(RemediationAttempts::Id).primary_key())
                    .col(text(RemediationAttempts::RunId))
                    .col(text(RemediationAttempts::NodeId))
                    .col(text(RemediationAttempts::ConditionType))
                    .col(json_binary(RemediationAttempts::Ladder))
                    .col(integer(RemediationAttempts::Step))
                    .col(integer(RemediationAttempts::Attempt))
                    .col(text(RemediationAttempts::Action))
                    .col(text(RemediationAttempts::Status))
                    .col(text_null(RemediationAttempts::ActionCommandId))
                    .col(text_null(RemediationAttempts::RefreshCommandId))
                    .col(text_null(RemediationAttempts::VerifyCommandId))
                    .col(timestamp_with_time_zone(RemediationAttempts::NextAttemptAt))
                    .col(text_null(RemediationAttempts::Note))
                    .col(timestamp_with_time_zone(RemediationAttempts::CreatedAt))
                    .col(timestamp_with_time_zone(RemediationAttempts::UpdatedAt))
                    .col(timestamp_with_time_zone_null(
                        RemediationAttempts::FinishedAt,
                    ))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_remediation_attempts_node_id")
                            .from(RemediationAttempts::Table, RemediationAttempts::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        // The controller's work list (open tries by status) and a node's history (newest
        // first).
        manager
            .create_index(
                Index::create()
                    .name("ix_remediation_attempts_status")
                    .table(RemediationAttempts::Table)
                    .col(RemediationAttempts::Status)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_remediation_attempts_node_id_created_at")
                    .table(RemediationAttempts::Table)
                    .col(RemediationAttempts::NodeId)
                    .col(RemediationAttempts::CreatedAt)
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(RemediationAttempts::Table).take())
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(Pools::Table)
                    .drop_column(Pools::Remediation)
                    .take(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(NodeConditions::Table)
                    .drop_column(NodeConditions::Proof)
                    .take(),
            )
            .await?;
        Ok(())
    }
}
