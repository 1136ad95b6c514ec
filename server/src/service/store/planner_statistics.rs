//! PostgreSQL's planner statistics of this schema's tables, kept current by the server
//! itself.
//!
//! Why: PostgreSQL plans a prepared statement for its parameters the first few times, then
//! keeps one generic plan per connection, made from the statistics of its tables as they
//! were. A fleet's tables grow from nothing to hundreds of thousands of rows within minutes
//! of its start, so plans made on near-empty tables (a sequential scan of `node_conditions`
//! testing each row against a list of ids) stay in use long after an index would be
//! thousands of times faster (BENCHMARKS.md: a 75 ms page of nodes at 10,000 nodes). New
//! statistics (`ANALYZE`) invalidate those plans. Autovacuum analyses a table once enough of
//! its rows changed, but at its own pace (a minute between rounds, by default), and not at
//! all where it is off. This analyses a table once its size moved from the one its
//! statistics describe by more than autovacuum's own rule allows, with the database's own
//! settings: `autovacuum_analyze_threshold` plus `autovacuum_analyze_scale_factor` of its
//! rows. Size, not every change: updates in place (a heartbeat updates its node's session
//! row) leave the plans right, and counting them would analyse the busiest tables on every
//! round for ever. Once a fleet has stopped growing, nothing is due here.
//!
//! `SKIP_LOCKED`: a table autovacuum is working on is left for the next round rather than
//! waited for (waiting would make PostgreSQL cancel that vacuum).
//!
//! SQLite keeps no statistics unless asked (`ANALYZE`, which this server never runs there) and
//! without them plans by fixed rules, so its plans do not go stale as tables grow: nothing to
//! do there.

use sea_orm::{ConnectionTrait, DbBackend, DbErr, Statement};

/// This schema's tables whose live rows moved away from the count their statistics describe
/// (`reltuples`) by more than autovacuum's analyse rule allows, their names quoted for SQL.
/// A table never analysed counts as having no rows, so 50 rows (the default threshold) make
/// it due.
const TABLES_DUE: &str = "SELECT quote_ident(s.relname) AS name
    FROM pg_stat_user_tables s
    JOIN pg_class c ON c.oid = s.relid
    WHERE s.schemaname = current_schema()
      AND abs(s.n_live_tup - greatest(c.reltuples, 0))
          > current_setting('autovacuum_analyze_threshold')::float8
          + current_setting('autovacuum_analyze_scale_factor')::float8 * greatest(c.reltuples, 0)
    ORDER BY s.relname";

/// Analyses the tables due (PostgreSQL; nothing on SQLite): their names.
pub async fn analyse_tables_due(conn: &impl ConnectionTrait) -> Result<Vec<String>, DbErr> {
    if conn.get_database_backend() != DbBackend::Postgres {
        return Ok(Vec::new());
    }
    let due = conn
        .query_all_raw(Statement::from_string(DbBackend::Postgres, TABLES_DUE))
        .await?;
    let mut analysed = Vec::with_capacity(due.len());
    for row in due {
        let name: String = row.try_get("", "name")?;
        // The name comes quoted from the catalog itself, never from a request.
        conn.execute_unprepared(&format!("ANALYZE (SKIP_LOCKED) {name}"))
            .await?;
        analysed.push(name);
    }
    Ok(analysed)
}
