//! Join tokens and the inventory sections daemons report.

use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum JoinTokens {
    Table,
    Id,
    SecretHash,
    SiteId,
    PoolId,
    Description,
    ExpiresAt,
    MaxUses,
    Uses,
    RevokedAt,
    CreatedBy,
    CreatedAt,
}

#[derive(DeriveIden)]
enum NodeInventorySections {
    Table,
    NodeId,
    Section,
    Hash,
    Content,
    ReportedAt,
}

#[derive(DeriveIden)]
enum Sites {
    Table,
    Id,
}

#[derive(DeriveIden)]
enum Pools {
    Table,
    Id,
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
                    .table(JoinTokens::Table)
                    .col(text(JoinTokens::Id).primary_key())
                    .col(text(JoinTokens::SecretHash))
                    .col(text(JoinTokens::SiteId))
                    .col(text_null(JoinTokens::PoolId))
                    .col(text(JoinTokens::Description))
                    .col(timestamp_with_time_zone(JoinTokens::ExpiresAt))
                    .col(big_integer(JoinTokens::MaxUses))
                    .col(big_integer(JoinTokens::Uses))
                    .col(timestamp_with_time_zone_null(JoinTokens::RevokedAt))
                    .col(text(JoinTokens::CreatedBy))
                    .col(timestamp_with_time_zone(JoinTokens::CreatedAt))
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_join_tokens_site_id")
                            .from(JoinTokens::Table, JoinTokens::SiteId)
                            .to(Sites::Table, Sites::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_join_tokens_pool_id")
                            .from(JoinTokens::Table, JoinTokens::PoolId)
                            .to(Pools::Table, Pools::Id)
                            .on_delete(ForeignKeyAction::Restrict),
                    )
                    .take(),
            )
            .await?;

        manager
            .create_table(
                Table::create()
                    .table(NodeInventorySections::Table)
                    .col(text(NodeInventorySections::NodeId))
                    .col(text(NodeInventorySections::Section))
                    .col(text(NodeInventorySections::Hash))
                    .col(json_binary(NodeInventorySections::Content))
                    .col(timestamp_with_time_zone(NodeInventorySections::ReportedAt))
                    .primary_key(
                        Index::create()
                            .col(NodeInventorySections::NodeId)
                            .col(NodeInventorySections::Section),
                    )
                    .foreign_key(
                        ForeignKey::create()
                            .name("fk_node_inventory_sections_node_id")
                            .from(NodeInventorySections::Table, NodeInventorySections::NodeId)
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
            .drop_table(Table::drop().table(NodeInventorySections::Table).take())
            .await?;
        manager
            .drop_table(Table::drop().table(JoinTokens::Table).take())
            .await?;
        Ok(())
    }
}
