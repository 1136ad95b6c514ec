//! Node history in the event log: `events.node_version`, the node's version after a node
//! change (`node.*` events; `NULL` for every other event), indexed with the node, so that a
//! rebuild reads the events of a range of versions with one indexed range scan
//! (`bc_core::history`). Existing node-change rows take it from `data.version`, where they
//! always kept it. Also an index for the fleet event log's type filter.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[derive(DeriveIden)]
enum Events {
    Table,
    NodeId,
    NodeVersion,
    EventType,
    Seq,
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
                    .table(Events::Table)
                    .add_column(
                        ColumnDef::new(Events::NodeVersion)
                            .big_integer()
                            .null()
                            .take(),
                    )
                    .take(),
            )
            .await?;
        let backfill = match manager.get_database_backend() {
            sea_orm::DbBackend::Postgres => {
                "UPDATE events SET node_version = (data->>'version')::bigint \
                 WHERE node_id IS NOT NULL AND event_type LIKE 'node.%' \
                 AND jsonb_typeof(data->'version') = 'number'"
            }
            _ => {
                "UPDATE events SET node_version = json_extract(data, '$.version') \
                 WHERE node_id IS NOT NULL AND event_type LIKE 'node.%' \
                 AND json_type(data, '$.version') = 'integer'"
            }
        };
        manager
            .get_connection()
            .execute_unprepared(backfill)
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_events_node_id_node_version")
                    .table(Events::Table)
                    .col(Events::NodeId)
                    .col(Events::NodeVersion)
                    .take(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name("ix_events_event_type_seq")
                    .table(Events::Table)
                    .col(Events::EventType)
                    .col(Events::Seq)
                    .take(),
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name("ix_events_event_type_seq")
                    .table(Events::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .drop_index(
                Index::drop()
                    .name("ix_events_node_id_node_version")
                    .table(Events::Table)
                    .to_owned(),
            )
            .await?;
        manager
            .alter_table(
                Table::alter()
                    .table(Events::Table)
                    .drop_column(Events::NodeVersion)
                    .take(),
            )
            .await?;
        Ok(())
    }
}
