//! An index of the nodes still waiting for their first spec (generation 0).
//!
//! The NodeSpec controller asks for them on every Lifecycle pass
//! (`nodes::awaiting_first_spec`: live, generation 0, `adopted` or `deployed`). In a fleet
//! that has settled no node matches, but the only index on those columns was the provision
//! state's, and nearly every node of a settled fleet is `adopted` or `deployed`: each pass read
//! the whole table to find nothing, on every leader, at 100,000 nodes too. A partial index
//! holds only the nodes at generation 0, so it stays as small as the bring-up in progress.
//! It is keyed by the generation as well, so that SQLite, which keeps no statistics here,
//! sees it match more of the query than the provision state's index and picks it, and it
//! holds every column the query reads, so that it answers alone.
//! The predicate's text is the same on both backends.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(
                "CREATE INDEX ix_nodes_awaiting_first_spec ON nodes (generation, provision_state, id, version) \
                 WHERE generation = 0 AND deleted_at IS NULL",
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared("DROP INDEX ix_nodes_awaiting_first_spec")
            .await?;
        Ok(())
    }
}
