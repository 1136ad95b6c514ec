//! An index of the open sessions by the gateway replica that holds them.
//!
//! `NodeFilterInput.gatewayId` asks which nodes a replica serves: the sessions an operator
//! moves before stopping it, and what fleet-bench counts while a killed replica's daemons
//! reconnect to the others. Without this index the question reads every session row (one
//! per node, 100,000 in the largest fleets). PostgreSQL turns the filter's `EXISTS` into a
//! join that starts here: the replica's open sessions from the index, then each of their
//! nodes by its key (3,315 sessions of 27,000 in 95 ms on a 100,000-node database mid
//! bring-up, the machine busy). The index is partial, holding open sessions only. Heartbeats
//! write only `last_seen`, which no index holds, so they stay heap-only updates on
//! PostgreSQL. SQLite (one process, no replicas) walks the nodes instead and finds each one's
//! session by its key. The predicate's text is the same on both backends.

use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared(
                "CREATE INDEX ix_node_sessions_open_by_gateway ON node_sessions (gateway_id, node_id) \
                 WHERE disconnected_at IS NULL",
            )
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .get_connection()
            .execute_unprepared("DROP INDEX ix_node_sessions_open_by_gateway")
            .await?;
        Ok(())
    }
}
