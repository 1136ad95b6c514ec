//! Statements per second by kind and caller, for profiling: every statement the store runs is
//! counted in `bc_db_statements_total{statement, caller}` and timed in
//! `bc_db_statement_seconds{statement}`, where the kind is its verb and the table it is about
//! (`select nodes`, `update node_sessions`) and the caller is the part of the server whose work
//! ran it (`gateway.hello`, `controller.lifecycle`, `api`: [`attributed`]).
//! Reading the counter's rate from `/metrics` while a fleet comes up or a benchmark runs says
//! which part of the code keeps the database busy, next to the per-thread CPU and `perf`
//! (README: "Profiling").

use sea_orm::metric::Info;
use std::future::Future;

tokio::task_local! {
    /// The part of the server the running task works for (see [`attributed`]).
    static CALLER: &'static str;
}

/// Runs `work` with every statement it runs counted under `caller`: a fixed name of the part
/// of the server it belongs to (a gateway handler, a controller, the feed, the API). The
/// statement kinds say what keeps the database busy; the callers say whose work it is, which
/// is where a change has to be made. A statement of no attributed work counts as `other`.
///
/// A plain function, not an `async fn`: an `async fn` keeps its argument `work` in its own
/// future and moves it into the scope's, so every attributed future took twice its size (a
/// gateway session's held two copies of its end for as long as it ran).
pub fn attributed<F: Future>(caller: &'static str, work: F) -> impl Future<Output = F::Output> {
    CALLER.scope(caller, work)
}

/// The kind of a statement: its verb and the table it is about, lower case; at most a few
/// dozen distinct values (verbs × tables), so they are safe as a metric label. The table is
/// the first one named at the outermost level that names one: a select of nodes with a
/// subquery of their labels in its columns is `select nodes`, a count over a subquery of
/// `node_free_atoms` is `select node_free_atoms`. A `WITH` statement is named after the first
/// table its first part reads.
pub fn statement_kind(sql: &str) -> String {
    let words = words_with_depth(sql);
    let mut rest = words.iter().map(|(_, word)| *word);
    let Some(verb) = rest.next() else {
        return "empty".to_owned();
    };
    let verb = verb.to_ascii_lowercase();
    // The word after which a statement of this verb names its table.
    let marker = match verb.as_str() {
        "select" | "delete" | "with" => "from",
        "insert" => "into",
        "update" => return with_table(&verb, rest.next()),
        _ => return verb,
    };
    // Each table the marker names, with its depth; a marker followed by a subquery (a word
    // deeper than the marker) names none.
    let tables = words.windows(2).filter_map(|pair| {
        let [(depth, word), (next_depth, next)] = pair else {
            return None;
        };
        (word.eq_ignore_ascii_case(marker) && next_depth == depth).then_some((*depth, *next))
    });
    let table = if verb == "with" {
        tables.map(|(_, table)| table).next()
    } else {
        tables
            .min_by_key(|(depth, _)| *depth)
            .map(|(_, table)| table)
    };
    match table {
        Some(table) => with_table(&verb, Some(table)),
        None => verb,
    }
}

/// The words of `sql` (split at whitespace, commas and parentheses), each with how many
/// parentheses enclose it.
fn words_with_depth(sql: &str) -> Vec<(usize, &str)> {
    let mut words = Vec::new();
    let mut depth = 0usize;
    let mut start = None;
    for (at, c) in sql.char_indices() {
        let separator = c.is_whitespace() || matches!(c, ',' | '(' | ')');
        if separator {
            if let Some(from) = start.take() {
                words.push((depth, &sql[from..at]));
            }
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ => {}
            }
        } else if start.is_none() {
            start = Some(at);
        }
    }
    if let Some(from) = start {
        words.push((depth, &sql[from..]));
    }
    words
}

fn with_table(verb: &str, table: Option<&str>) -> String {
    match table {
        Some(table) => {
            let table: String = table
                .trim_matches(|c| c == '"' || c == '`')
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if table.is_empty() {
                verb.to_owned()
            } else {
                format!("{verb} {table}")
            }
        }
        None => verb.to_owned(),
    }
}

/// Records one statement (sea-orm's metric callback).
pub fn record(info: &Info<'_>) {
    let kind = statement_kind(&info.statement.sql);
    metrics::histogram!("bc_db_statement_seconds", "statement" => kind.clone())
        .record(info.elapsed.as_secs_f64());
    let caller = CALLER.try_with(|caller| *caller).unwrap_or("other");
    metrics::counter!(
        "bc_db_statements_total",
        "statement" => kind,
        "caller" => caller,
        "failed" => if info.failed { "true" } else { "false" }
    )
    .increment(1);
}

#[cfg(test)]
mod tests {
    use super::statement_kind;

    #[test]
    fn kinds_are_the_verb_and_the_outermost_table() {
        for (sql, kind) in [
            (
                r#"SELECT "nodes"."id" FROM "nodes" WHERE "id" = $1"#,
                "select nodes",
            ),
            (
                r#"SELECT COUNT(*) FROM (SELECT 1 FROM "node_free_atoms") AS x"#,
                "select node_free_atoms",
            ),
            (
                r#"INSERT INTO "events" ("seq") VALUES (?)"#,
                "insert events",
            ),
            (
                r#"UPDATE "node_sessions" SET "last_seen" = ?"#,
                "update node_sessions",
            ),
            (
                r#"DELETE FROM "atom_bookings" WHERE x"#,
                "delete atom_bookings",
            ),
            (
                r#"SELECT "nodes"."id", (SELECT json_agg(l."key") FROM "node_labels" AS l WHERE l."node_id" = "nodes"."id") AS "child_labels" FROM "nodes" WHERE "id" = $1"#,
                "select nodes",
            ),
            (
                r#"WITH "keys" AS MATERIALIZED (SELECT "k" FROM "node_hardware" ORDER BY "k") SELECT 1 FROM "keys""#,
                "with node_hardware",
            ),
            ("BEGIN IMMEDIATE", "begin"),
            ("COMMIT", "commit"),
            ("SELECT 1", "select"),
            ("   ", "empty"),
        ] {
            assert_eq!(statement_kind(sql), kind, "{sql}");
        }
    }
}
