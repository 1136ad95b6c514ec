//! Bare metal: a node's BMC (`node_bmcs`), one row per node enrolled through its BMC. The
//! credentials are sealed (XChaCha20-Poly1305, see SECURITY.md) before they reach this
//! table; the poll bookkeeping lives here, not in the node row, so a poll that finds nothing
//! new never bumps the node's `version`.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum NodeBmcs {
    Table,
    NodeId,
    Address,
    SystemId,
    TlsVerification,
    CaPem,
    CredentialKeyId,
    SealedCredentials,
    SystemPath,
    Reachable,
    LastError,
    ConsecutiveFailures,
    LastPolledAt,
    NextPollAt,
    CreatedAt,
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
                    .table(NodeBmcs::Table)
                    .col(text(NodeBmcs::NodeId).primary_key())
                    .col(text(NodeBmcs::Address))
                    .col(text_null(NodeBmcs::SystemId))
                    .col(text(NodeBmcs::TlsVerification))
                    .col(text_null(NodeBmcs::CaPem))
                    .col(text(NodeBmcs::CredentialKeyId))
                    .col(text(NodeBmcs::SealedCredentials))
                    .col(text_null(NodeBmcs::SystemPath))
                    .col(boolean_null(NodeBmcs::Reachable))
                    .col(text_null(NodeBmcs::LastError))
                    .col(big_integer(NodeBmcs::ConsecutiveFailures))
                    .col(timestamp_with_time_zone_null(NodeBmcs::LastPolledAt))
                    .col(timestamp_with_time_zone(NodeBmcs::NextPollAt))
                    .col(timestamp_with_time_zone(NodeBmcs::CreatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_node_bmcs_node_id")
                            .from(NodeBmcs::Table, NodeBmcs::NodeId)
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        // The Power controller's work list: the BMCs due for a poll, oldest first.
        manager
            .create_index(
                Index::create()
                    .name("ix_node_bmcs_next_poll_at")
                    .table(NodeBmcs::Table)
                    .col(NodeBmcs::NextPollAt)
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(NodeBmcs::Table).take())
            .await?;
        Ok(())
    }
}
