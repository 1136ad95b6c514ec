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

/// The kind of a statement: its verb and the table it is about, lower case, and `for update`
/// or `for share` for a statement that locks the rows it reads (their time is mostly waiting);
/// at most a few dozen distinct values (verbs × tables), so they are safe as a metric label.
/// The table is the first one named at the outermost level that names one: a select of nodes
/// with a subquery of their labels in its columns is `select nodes`, a count over a subquery
/// of `node_free_atoms` is `select node_free_atoms`. A `WITH` statement is named after the
/// first table any part of it reads from.
///
/// It runs for every statement, some of them multi-row writes of thousands of words, so it
/// reads words lazily and stops as soon as it knows.
pub fn statement_kind(sql: &str) -> String {
    let mut words = WordsWithDepth::new(sql).peekable();
    let Some((verb_depth, verb)) = words.next() else {
        return "empty".to_owned();
    };
    let verb = verb.to_ascii_lowercase();
    // The word after which a statement of this verb names its table.
    let marker = match verb.as_str() {
        "select" | "delete" | "with" => "from",
        "insert" => "into",
        "update" => return with_table(&verb, words.next().map(|(_, word)| word)),
        _ => return verb,
    };
    let mut shallowest: Option<(usize, &str)> = None;
    while let Some((depth, word)) = words.next() {
        if !word.eq_ignore_ascii_case(marker) {
            continue;
        }
        // A marker followed by a subquery (a word deeper than the marker) names no table.
        let Some(&(next_depth, table)) = words.peek() else {
            break;
        };
        if next_depth != depth {
            continue;
        }
        // Nothing is shallower than the verb, so a table named at its depth is the answer.
        if verb == "with" || depth <= verb_depth {
            shallowest = Some((depth, table));
            break;
        }
        if shallowest.is_none_or(|(found, _)| depth < found) {
            shallowest = Some((depth, table));
        }
    }
    let kind = with_table(&verb, shallowest.map(|(_, table)| table));
    match locking_clause(sql) {
        Some(lock) => format!("{kind} {lock}"),
        None => kind,
    }
}

/// `for update` or `for share` if `sql` ends with that locking clause.
fn locking_clause(sql: &str) -> Option<&'static str> {
    let sql = sql.trim_end().as_bytes();
    ["for update", "for share"].into_iter().find(|clause| {
        sql.len() > clause.len()
            && sql[sql.len() - clause.len()..].eq_ignore_ascii_case(clause.as_bytes())
            && sql[sql.len() - clause.len() - 1].is_ascii_whitespace()
    })
}

/// The words of a statement (split at whitespace, commas and parentheses), each with how many
/// parentheses enclose it.
struct WordsWithDepth<'a> {
    sql: &'a str,
    at: usize,
    depth: usize,
}

impl<'a> WordsWithDepth<'a> {
    fn new(sql: &'a str) -> Self {
        WordsWithDepth {
            sql,
            at: 0,
            depth: 0,
        }
    }
}

impl<'a> Iterator for WordsWithDepth<'a> {
    type Item = (usize, &'a str);

    fn next(&mut self) -> Option<Self::Item> {
        let separator = |c: char| c.is_whitespace() || matches!(c, ',' | '(' | ')');
        let rest = &self.sql[self.at..];
        for (offset, c) in rest.char_indices() {
            if !separator(c) {
                let word = &rest[offset..];
                let len = word.find(separator).unwrap_or(word.len());
                self.at += offset + len;
                return Some((self.depth, &word[..len]));
            }
            match c {
                '(' => self.depth += 1,
                ')' => self.depth = self.depth.saturating_sub(1),
                _ => {}
            }
        }
        self.at = self.sql.len();
        None
    }
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
    // The subscription runtime's boundary (`subscription_runtime`), checked where every
    // statement passes: a pool connection opened there would serve requests from there.
    debug_assert!(
        !crate::subscription_runtime::is_current_thread(),
        "a statement ran on the subscription runtime: {}",
        info.statement.sql
    );
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
            (
                r#"UPDATE "node_sessions" SET "last_seen" = v."at" FROM (VALUES ($1, $2)) AS v ("id", "at") WHERE "node_id" = v."id""#,
                "update node_sessions",
            ),
            (
                r#"INSERT INTO "events" ("seq") SELECT "seq" FROM "outbox""#,
                "insert events",
            ),
            (r#"SELECT "x" FROM (VALUES (1), (2)) AS v ("x")"#, "select"),
            (
                r#"SELECT "nodes"."id" FROM "nodes" WHERE "nodes"."id" = ANY($1) ORDER BY "nodes"."id" ASC FOR UPDATE"#,
                "select nodes for update",
            ),
            (
                r#"SELECT "nodes"."id" FROM "nodes" ORDER BY "nodes"."id" ASC LIMIT $1 FOR SHARE"#,
                "select nodes for share",
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
