//! The shapes of batched statements: how many values an `IN` list holds and how many rows a
//! multi-row write carries, rounded so that a batch of any size makes one of a few SQL texts.
//!
//! sqlx keeps up to 100 prepared statements per connection, by SQL text, and SQLite's prepared
//! form of a statement with a few thousand parameters takes hundreds of kilobytes. When each
//! batch size made its own text, the cache filled with statements used once: `heaptrack` on a
//! 1,500-node bring-up found 48 MB in 1,060 cached statements after 17 s, and a 2,000-node
//! fleet-bench ended with about 260 MB more anonymous memory than before the batched writers.
//! So a list of values to match is one array parameter on PostgreSQL (`= ANY($1)`), and on
//! SQLite an `IN` list padded to the next power of two (repeating the last value changes what
//! no statement selects); multi-row writes are split into runs whose lengths are powers of
//! two (100 rows: 64, 32 and 4), in order.

use sea_orm::sea_query::extension::postgres::PgFunc;
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{DbBackend, EntityTrait, Iterable};

/// `column` equals one of `values`: `column = ANY($1)` with the values as one array on
/// PostgreSQL, `column IN (…)` padded to a power of two on SQLite (which has no arrays).
///
/// On PostgreSQL the array also keeps the plan right. A prepared statement runs on a cached
/// generic plan after five executions, and the planner takes an array parameter for a few
/// values, but an `IN` list of 128 parameters for 128 values of unknown selectivity: on a
/// table without statistics (a database that has not been analysed yet, as right after a
/// fleet came up, or where autovacuum is off) each is a 200th of the table, so a page of 100
/// nodes read its labels by a sequential scan of all 210,000 (19 of the statement's 26 ms at
/// 10,000 nodes, `auto_explain`), where the array's plan reads them by index (5 ms).
pub fn one_of<V: ToString>(column: Expr, values: &[V], backend: DbBackend) -> Expr {
    let values: Vec<String> = values.iter().map(ToString::to_string).collect();
    match backend {
        DbBackend::Postgres => column.eq(PgFunc::any(Expr::val(values))),
        // SQLite, the store's only other backend.
        _ => column.is_in(padded(&values)),
    }
}

/// `values` padded to the next power of two by repeating the last value, for an `IN` list.
fn padded<T: Clone>(values: &[T]) -> Vec<T> {
    let mut padded = values.to_vec();
    if let Some(last) = values.last() {
        padded.resize(values.len().next_power_of_two(), last.clone());
    }
    padded
}

/// The most parameters one multi-row write binds; [`longest_run`] makes each writer's run
/// length from it.
///
/// A database connection keeps what its largest statements needed for as long as it lives:
/// sqlx's PostgreSQL connection keeps its write buffer at the size of the largest message it
/// sent, and its statement cache keeps each statement shape it prepared with a type for
/// every parameter (SQLite's, the compiled program). With runs of up to about 10,000
/// parameters (1,024 events, 256 nodes, 1,024 child rows), a 10,000-node bring-up on
/// PostgreSQL left 42 MB of prepared statements and 38 MB of write buffers in the pool at
/// rest, 8 KB a node; the write buffers all grown by the events written at commit (up to
/// 1.8 MB a message with their JSON). With 2,048, 16 MB and 0.3 MB (heaptrack, BENCHMARKS.md,
/// session 36). A bring-up's batch still takes a few statements per table, not one per row.
/// Both backends' limits are far above it (SQLite 32,766, PostgreSQL 65,535).
pub const MOST_PARAMETERS_PER_WRITE: usize = 2_048;

/// The longest run ([`runs`]) of rows that bind `parameters_per_row` each: the largest power
/// of two of them that binds at most [`MOST_PARAMETERS_PER_WRITE`].
pub const fn longest_run(parameters_per_row: usize) -> usize {
    assert!(
        parameters_per_row > 0 && parameters_per_row <= MOST_PARAMETERS_PER_WRITE,
        "a row binds at least one parameter and at most MOST_PARAMETERS_PER_WRITE"
    );
    1 << (MOST_PARAMETERS_PER_WRITE / parameters_per_row).ilog2()
}

/// Rows of table `E`, in order, as [`runs`] of at most [`longest_run`] of its columns: a row
/// binds at most one parameter a column, so every table's multi-row writes stay within
/// [`MOST_PARAMETERS_PER_WRITE`], with no count kept by hand. (A wider table gets shorter
/// runs: 32 node rows, 128 events, 512 labels.)
pub fn runs_of<E: EntityTrait, T>(rows: Vec<T>) -> Vec<Vec<T>> {
    runs_of_at_most::<E, T>(rows, usize::MAX)
}

/// [`runs_of`], in runs of at most `most` rows (a power of two, or `usize::MAX` for no bound
/// but the columns'): for a table whose rows are large for the parameters they bind
/// (inventory sections' JSON).
pub fn runs_of_at_most<E: EntityTrait, T>(rows: Vec<T>, most: usize) -> Vec<Vec<T>> {
    runs(rows, most.min(longest_run(E::Column::iter().count())))
}

/// `rows` in order, as runs of `largest` rows (a power of two) and then one run for each bit
/// of what remains, longest first.
pub fn runs<T>(rows: Vec<T>, largest: usize) -> Vec<Vec<T>> {
    debug_assert!(largest.is_power_of_two());
    let mut left = rows.len();
    let mut rows = rows.into_iter();
    let mut runs = Vec::new();
    while left > 0 {
        let take = if left >= largest {
            largest
        } else {
            1 << left.ilog2()
        };
        runs.push(rows.by_ref().take(take).collect());
        left -= take;
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::{one_of, padded, runs};
    use sea_orm::DbBackend;
    use sea_orm::sea_query::{Expr, PostgresQueryBuilder, Query, SqliteQueryBuilder};

    #[test]
    fn a_list_is_one_array_on_postgres_and_a_padded_in_list_on_sqlite() {
        let select = |backend| {
            Query::select()
                .column("id")
                .from("t")
                .and_where(one_of(Expr::col("id"), &["a", "b", "c"], backend))
                .to_owned()
        };
        let (postgres, values) = select(DbBackend::Postgres).build(PostgresQueryBuilder);
        assert_eq!(postgres, r#"SELECT "id" FROM "t" WHERE "id" = ANY($1)"#);
        assert_eq!(values.0.len(), 1, "{values:?}");
        let (sqlite, values) = select(DbBackend::Sqlite).build(SqliteQueryBuilder);
        assert_eq!(sqlite, r#"SELECT "id" FROM "t" WHERE "id" IN (?, ?, ?, ?)"#);
        assert_eq!(values.0.len(), 4);
    }

    #[test]
    fn in_lists_are_padded_to_a_power_of_two_with_the_last_value() {
        assert_eq!(padded::<u8>(&[]), Vec::<u8>::new());
        assert_eq!(padded(&[1]), vec![1]);
        assert_eq!(padded(&[1, 2, 3]), vec![1, 2, 3, 3]);
        assert_eq!(padded(&[1, 2, 3, 4]), vec![1, 2, 3, 4]);
        assert_eq!(padded(&[1, 2, 3, 4, 5]).len(), 8);
    }

    #[test]
    fn the_longest_run_is_the_largest_power_of_two_within_the_parameter_bound() {
        use super::{MOST_PARAMETERS_PER_WRITE, longest_run};
        for (parameters_per_row, longest) in [
            (1, 2_048),
            (2, 1_024),
            (3, 512),
            (6, 256),
            (9, 128),
            (12, 128),
            (24, 64),
            (33, 32),
            (2_048, 1),
        ] {
            assert_eq!(
                longest_run(parameters_per_row),
                longest,
                "{parameters_per_row}"
            );
            assert!(longest * parameters_per_row <= MOST_PARAMETERS_PER_WRITE);
            assert!(2 * longest * parameters_per_row > MOST_PARAMETERS_PER_WRITE);
        }
    }

    #[test]
    fn writes_are_split_into_power_of_two_runs_in_order() {
        let lengths = |n: usize, largest| -> Vec<usize> {
            let split = runs((0..n).collect(), largest);
            let flat: Vec<usize> = split.iter().flatten().copied().collect();
            assert_eq!(
                flat,
                (0..n).collect::<Vec<_>>(),
                "{n} rows keep their order"
            );
            split.iter().map(Vec::len).collect()
        };
        assert_eq!(lengths(0, 256), Vec::<usize>::new());
        assert_eq!(lengths(1, 256), vec![1]);
        assert_eq!(lengths(100, 256), vec![64, 32, 4]);
        assert_eq!(lengths(256, 256), vec![256]);
        assert_eq!(lengths(600, 256), vec![256, 256, 64, 16, 8]);
    }
}
