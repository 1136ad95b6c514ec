//! Persistence: the only module that knows about tables.
//!
//! Storage rows (`bc_entity`) and domain types (`bc_core`) are mapped explicitly in [`rows`];
//! nothing above this module sees a row. Every write happens in a [`WriteTxn`], and every
//! change to a node is written together with its events and its `noScheduleReasons`.

pub mod bare_metal;
mod batch_shapes;
pub mod brakes;
pub mod capacity;
pub mod catalog;
pub mod commands;
pub mod drains;
pub mod enrolled_identifiers;
pub mod events;
pub mod inventory;
pub mod join_tokens;
pub mod leases;
pub mod liveness;
pub mod node_filter;
pub mod nodes;
pub mod placement;
pub mod planner_statistics;
pub mod remediation;
pub mod rows;
pub mod schedule_sql;
pub mod sessions;
mod statement_metrics;
pub use statement_metrics::attributed;
pub mod workflows;

use bc_core::ids::NodeId;
use bc_migration::{Migrator, MigratorTrait};
use sea_orm::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DatabaseTransaction, DbBackend,
    DbErr, SqliteTransactionMode, TransactionOptions, TransactionTrait,
};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, Notify, OwnedMutexGuard};

use crate::config::DatabaseConfig;

/// How long SQLite waits for a lock held by another process before giving up. Writers in
/// this process queue on [`Store::sqlite_write_lock`] instead and never reach this.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How much of the SQLite file each connection maps into memory: reads of mapped pages come
/// from the operating system's page cache, shared by every connection, instead of being
/// copied into each connection's own 2 MiB page cache (the default), which a 10,000-node
/// database (about 200 MB) overflows on every scan: placement-bench's profile showed a
/// third of the SQLite thread in `pread` copies. Address space, not memory: untouched pages
/// cost nothing.
const SQLITE_MMAP_BYTES: u64 = 1 << 30;

#[derive(Clone)]
pub struct Store {
    db: DatabaseConnection,
    /// SQLite allows one writer at a time, and several connections that race for it starve
    /// each other (multi-second tails, busy errors). Funnelling this process's write
    /// transactions through one fair lock is as fast and keeps latency flat.
    sqlite_write_lock: Option<Arc<Mutex<()>>>,
    /// Woken after every committed write, so this process's event feed reads new events at
    /// once instead of at its next poll.
    committed: Arc<Notify>,
    /// The pool's settings, which an error getting a connection names.
    config: DatabaseConfig,
}

/// A write transaction, holding the SQLite write lock (if any) until it ends.
///
/// Its events are collected as the transaction goes ([`events::append_node_changes`] and
/// the like) and written by [`WriteTxn::commit`] after every other write, so the
/// event-order lock is always the last lock a transaction takes: the lock order of
/// ARCHITECTURE.md's Invariants, which every write transaction follows.
pub struct WriteTxn {
    txn: DatabaseTransaction,
    _guard: Option<OwnedMutexGuard<()>>,
    _held: WriterHeld,
    committed: Arc<Notify>,
    /// The events to write at commit, in the order they were appended.
    events: std::sync::Mutex<Vec<bc_entity::event::ActiveModel>>,
    /// The node rows this transaction has locked ([`WriteTxn::lock_nodes`]).
    locked_nodes: std::sync::Mutex<HashSet<NodeId>>,
}

impl WriteTxn {
    fn new(
        txn: DatabaseTransaction,
        guard: Option<OwnedMutexGuard<()>>,
        committed: Arc<Notify>,
    ) -> WriteTxn {
        WriteTxn {
            txn,
            _guard: guard,
            _held: WriterHeld(Instant::now()),
            committed,
            events: std::sync::Mutex::default(),
            locked_nodes: std::sync::Mutex::default(),
        }
    }

    /// Locks the node rows of `ids` until the transaction ends, in id order (the lock order of
    /// ARCHITECTURE.md's Invariants), skipping those it locked already. Every node change locks
    /// its nodes through here (the placer's `SKIP LOCKED` reads and `powerNode`'s
    /// [`nodes::lock_existing`] lock rows of their own). A batch that locks its nodes before
    /// writing other rows of theirs (sessions, inventory, commands) and then changes them
    /// (`Services::change_nodes_in`, which locks its nodes here too) so takes each lock in
    /// one statement, not two. A hello batch locked its nodes twice before: 5,600 statements
    /// and 12 s of the survivors' database time in a failover at 50,000 nodes (BENCHMARKS.md,
    /// session 29).
    ///
    /// The ids of nodes that do not exist are remembered too: there is no row to lock, and
    /// node ids are never reused. SQLite's write transaction holds the whole database
    /// already, so there this runs nothing.
    pub async fn lock_nodes(&self, ids: &[NodeId]) -> anyhow::Result<()> {
        if self.txn.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        let new: Vec<NodeId> = {
            let locked = self
                .locked_nodes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            ids.iter()
                .filter(|id| !locked.contains(*id))
                .cloned()
                .collect()
        };
        if new.is_empty() {
            return Ok(());
        }
        nodes::lock_many(&self.txn, &new).await?;
        self.locked_nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(new);
        Ok(())
    }

    /// [`WriteTxn::lock_nodes`] for one node.
    pub async fn lock_node(&self, id: &NodeId) -> anyhow::Result<()> {
        self.lock_nodes(std::slice::from_ref(id)).await
    }

    /// Queues events to be written at commit.
    fn append_events(&self, rows: impl IntoIterator<Item = bc_entity::event::ActiveModel>) {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(rows);
    }

    /// Writes the transaction's events (whose insert takes the event-order lock, on PostgreSQL)
    /// and commits.
    pub async fn commit(self) -> Result<(), sea_orm::DbErr> {
        let events = std::mem::take(
            &mut *self
                .events
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        events::write_pending(&self.txn, events).await?;
        self.txn.commit().await?;
        self.committed.notify_one();
        Ok(())
    }
}

/// Records how long a write transaction held the writer (`bc_db_writer_held_seconds`) when
/// it ends, committed or not. With `bc_db_writer_wait_seconds` it tells whether writes
/// queue because the writer is busy (held most of each second) or because each holds it
/// long (README: "Profiling").
struct WriterHeld(Instant);

impl Drop for WriterHeld {
    fn drop(&mut self) {
        metrics::histogram!("bc_db_writer_held_seconds").record(self.0.elapsed().as_secs_f64());
    }
}

impl std::ops::Deref for WriteTxn {
    type Target = DatabaseTransaction;
    fn deref(&self) -> &DatabaseTransaction {
        &self.txn
    }
}

impl Store {
    /// Connects to `url` (`sqlite://…` or `postgres://…`).
    pub async fn connect(url: &str, config: &DatabaseConfig) -> anyhow::Result<Store> {
        let mut options = ConnectOptions::new(url.to_owned());
        options
            .max_connections(config.max_connections)
            .acquire_timeout(Duration::from_secs(config.acquire_timeout_secs))
            .sqlx_logging(false)
            .map_sqlx_sqlite_opts(|opts: SqliteConnectOptions| {
                opts.journal_mode(SqliteJournalMode::Wal)
                    // In WAL mode NORMAL never corrupts the database; a power cut may lose the
                    // last transactions. That is the trade the embedded default makes for 20x
                    // the write rate; production runs on PostgreSQL.
                    .synchronous(SqliteSynchronous::Normal)
                    .foreign_keys(true)
                    .busy_timeout(SQLITE_BUSY_TIMEOUT)
                    .pragma("mmap_size", SQLITE_MMAP_BYTES.to_string())
            });
        if url.starts_with("sqlite:")
            && let Some(path) = sqlite_path(url)
            && let Some(dir) = std::path::Path::new(path).parent()
        {
            std::fs::create_dir_all(dir)?;
        }
        let mut db = Database::connect(options)
            .await
            .map_err(|err| explain_pool_timeout(err, config))?;
        db.set_metric_callback(statement_metrics::record);
        let sqlite_write_lock =
            (db.get_database_backend() == DbBackend::Sqlite).then(|| Arc::new(Mutex::new(())));
        Ok(Store {
            db,
            sqlite_write_lock,
            committed: Arc::default(),
            config: config.clone(),
        })
    }

    /// Runs pending migrations.
    pub async fn migrate(&self) -> anyhow::Result<()> {
        Migrator::up(&self.db, None)
            .await
            .map_err(|err| explain_pool_timeout(err, &self.config))
    }

    pub fn db(&self) -> &DatabaseConnection {
        &self.db
    }

    pub fn backend(&self) -> DbBackend {
        self.db.get_database_backend()
    }

    /// Starts a write transaction. On SQLite it takes the write lock first and begins
    /// IMMEDIATE, so a transaction never fails half-way when it upgrades from read to write.
    pub async fn write(&self) -> Result<WriteTxn, sea_orm::DbErr> {
        match &self.sqlite_write_lock {
            Some(lock) => {
                let asked = Instant::now();
                let guard = lock.clone().lock_owned().await;
                metrics::histogram!("bc_db_writer_wait_seconds")
                    .record(asked.elapsed().as_secs_f64());
                let txn = self
                    .db
                    .begin_with_options(TransactionOptions {
                        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
                        ..TransactionOptions::default()
                    })
                    .await?;
                Ok(WriteTxn::new(txn, Some(guard), self.committed.clone()))
            }
            None => Ok(WriteTxn::new(
                self.db.begin().await?,
                None,
                self.committed.clone(),
            )),
        }
    }

    /// Starts a read-only transaction: every query in it sees one snapshot, so what a read
    /// puts together from several statements (a page of nodes and their sessions, more nodes
    /// than one statement reads) is never torn by a write that commits in between.
    /// PostgreSQL: REPEATABLE READ; SQLite: a read transaction in WAL mode is a snapshot
    /// already.
    pub async fn read(&self) -> Result<DatabaseTransaction, sea_orm::DbErr> {
        match self.backend() {
            DbBackend::Postgres => {
                self.db
                    .begin_with_config(
                        Some(sea_orm::IsolationLevel::RepeatableRead),
                        Some(sea_orm::AccessMode::ReadOnly),
                    )
                    .await
            }
            _ => self.db.begin().await,
        }
    }

    /// Notified after every committed write transaction of this process.
    pub fn committed(&self) -> Arc<Notify> {
        self.committed.clone()
    }

    /// Whether the database answers (`/readyz`).
    pub async fn ping(&self) -> bool {
        self.db.ping().await.is_ok()
    }

    /// Connections open and idle in the pool, for `/metrics`.
    pub fn pool_stats(&self) -> (u32, usize) {
        match self.backend() {
            DbBackend::Postgres => {
                let pool = self.db.get_postgres_connection_pool();
                (pool.size(), pool.num_idle())
            }
            DbBackend::Sqlite => {
                let pool = self.db.get_sqlite_connection_pool();
                (pool.size(), pool.num_idle())
            }
            _ => (0, 0),
        }
    }

    pub async fn close(self) {
        if let Err(err) = self.db.close().await {
            tracing::warn!(error = %err, "closing the database pool failed");
        }
    }
}

/// `err`, explained when it is the pool giving up on a connection: at start that is a
/// database that does not answer or refuses new connections, and sqlx's own words ("pool
/// timed out while waiting for an open connection") name neither. PostgreSQL refuses past
/// its `max_connections`, which every replica's pool counts against.
fn explain_pool_timeout(err: DbErr, config: &DatabaseConfig) -> anyhow::Error {
    if !crate::error::is_pool_timeout(&err) {
        return err.into();
    }
    anyhow::Error::new(err).context(format!(
        "no database connection within {} s ([database] acquire_timeout_secs): the database \
         does not answer, or it refuses new connections; PostgreSQL refuses them past its \
         `max_connections` setting, which the pools of every replica count against (each \
         opens up to [database] max_connections = {})",
        config.acquire_timeout_secs, config.max_connections
    ))
}

fn sqlite_path(url: &str) -> Option<&str> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next()?;
    (!path.is_empty() && path != ":memory:").then_some(path)
}

/// Applies `FOR UPDATE` where the database has it. SQLite has no row locks: the write
/// transaction already holds the database's single write lock.
pub fn lock_for_update<S: sea_orm::QuerySelect>(select: S, conn: &impl ConnectionTrait) -> S {
    if conn.get_database_backend() == DbBackend::Postgres {
        select.lock_exclusive()
    } else {
        select
    }
}

/// Applies `FOR SHARE` where the database has it: a read that must wait for a row's
/// uncommitted write, without keeping other readers out. SQLite has no row locks, and its one
/// writer leaves nothing uncommitted for a write transaction to wait for.
pub fn lock_for_share<S: sea_orm::QuerySelect>(select: S, conn: &impl ConnectionTrait) -> S {
    if conn.get_database_backend() == DbBackend::Postgres {
        select.lock_shared()
    } else {
        select
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_database_that_gives_no_connection_is_explained_naming_max_connections() {
        let config = DatabaseConfig {
            max_connections: 3,
            acquire_timeout_secs: 1,
        };
        // Nothing listens on port 1, so every connection is refused; sqlx retries a refused
        // connection (a database starting up) until the pool gives up, as it does against a
        // PostgreSQL past its `max_connections`.
        let err = match Store::connect("postgres://postgres@127.0.0.1:1/none", &config).await {
            Ok(_) => panic!("connected to a port nothing listens on"),
            Err(err) => format!("{err:#}"),
        };
        assert!(
            err.contains("within 1 s") && err.contains("max_connections = 3"),
            "{err}"
        );
    }
}
