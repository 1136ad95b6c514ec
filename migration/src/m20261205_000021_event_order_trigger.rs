//! The event-order lock, taken by the `events` table itself on PostgreSQL.
//!
//! Sequence numbers must be handed out in commit order, so that a reader following
//! `seq > cursor` never skips an event that commits late (ARCHITECTURE.md, Invariants: event
//! order is commit order). A writer takes a transaction-scoped advisory lock before its
//! events take their numbers, and holds it until it commits. The server took it in a
//! statement of its own before inserting its events: one more round trip inside the stretch
//! that every event writer of every replica takes in turn (lock, insert, commit), where the
//! fleet's joins queue at 100,000 nodes (BENCHMARKS.md). A statement-level `BEFORE INSERT`
//! trigger takes it in the insert's own round trip instead, before the insert evaluates any
//! row (and so before any `seq` is drawn), and announces the new events on
//! [`NOTIFY_CHANNEL`] (delivered to listeners only if the transaction commits). Whoever
//! inserts an event now takes the lock, by construction.
//!
//! SQLite has one writer at a time already and needs neither.

use sea_orm_migration::prelude::*;

/// The transaction-scoped advisory lock that orders event writers (an arbitrary constant,
/// unique to us). Tests take it to stand in for a writer that holds it.
pub const EVENT_ORDER_LOCK: i64 = 0x6263_6576_7473;
/// The PostgreSQL channel that announces new events to every replica.
pub const NOTIFY_CHANNEL: &str = "bc_events";

#[derive(DeriveMigrationName)]
pub struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    fn use_transaction(&self) -> Option<bool> {
        Some(true)
    }

    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != sea_orm::DbBackend::Postgres {
            return Ok(());
        }
        manager
            .get_connection()
            .execute_unprepared(&format!(
                "CREATE FUNCTION bc_order_events() RETURNS trigger LANGUAGE plpgsql AS $$ \
                 BEGIN \
                   PERFORM pg_advisory_xact_lock({EVENT_ORDER_LOCK}); \
                   PERFORM pg_notify('{NOTIFY_CHANNEL}', ''); \
                   RETURN NULL; \
                 END $$; \
                 CREATE TRIGGER events_order BEFORE INSERT ON events \
                 FOR EACH STATEMENT EXECUTE FUNCTION bc_order_events();"
            ))
            .await?;
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != sea_orm::DbBackend::Postgres {
            return Ok(());
        }
        manager
            .get_connection()
            .execute_unprepared(
                "DROP TRIGGER events_order ON events; DROP FUNCTION bc_order_events();",
            )
            .await?;
        Ok(())
    }
}
