//! The identifiers a bare-metal node was enrolled with (its BMC's report), normalised as the
//! hardware key normalises them, so that the daemon which later boots on the machine is
//! matched to the enrolled node instead of joining as a second one.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum NodeEnrolledIdentifiers {
    Table,
    NodeId,
    Kind,
    Value,
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
                    .table(NodeEnrolledIdentifiers::Table)
                    .col(text(NodeEnrolledIdentifiers::NodeId))
                    .col(text(NodeEnrolledIdentifiers::Kind))
                    .col(text(NodeEnrolledIdentifiers::Value))
                    .primary_key(
                        Index::create()
                            .col(NodeEnrolledIdentifiers::NodeId)
                            .col(NodeEnrolledIdentifiers::Kind)
                            .col(NodeEnrolledIdentifiers::Value),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_node_enrolled_identifiers_node_id")
                            .from(
                                NodeEnrolledIdentifiers::Table,
                                NodeEnrolledIdentifiers::NodeId,
                            )
                            .to(Nodes::Table, Nodes::Id)
                            .on_delete(ForeignKeyAction::Cascade),
                    )
                    .take(),
            )
            .await?;
        // A join looks up the nodes enrolled with any of its identifiers.
        manager
            .create_index(
                Index::create()
                    .name("ix_node_enrolled_identifiers_kind_value")
                    .table(NodeEnrolledIdentifiers::Table)
                    .col(NodeEnrolledIdentifiers::Kind)
                    .col(NodeEnrolledIdentifiers::Value)
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(NodeEnrolledIdentifiers::Table).take())
            .await?;
        Ok(())
    }
}
