//! Queries are bounded before any work is done on them (issue 17, items 2 and 8): their
//! size in bytes, aliases, fragment spreads and fields with every fragment expanded, and the
//! answer an introspection query can ask for, are checked right after parsing, before
//! validation walks the document; abusive queries are refused in milliseconds while
//! `/healthz` keeps answering; the dashboard's own operations and graphql-js's standard
//! introspection query pass. Over real HTTP, on SQLite and on PostgreSQL.

use bc_testing::{Backend, Gql, TestServer, each_backend};
use better_compute::auth::Role;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// graphql-js's `getIntrospectionQuery()` with every option on: what GraphiQL and codegen
/// tools send.
const INTROSPECTION_QUERY: &str = include_str!("../fixtures/introspection-query.graphql");

/// The dashboard's operations, as `web/` sends them.
const DASHBOARD_OPERATIONS: &str = include_str!("../../../web/graphql/operations.graphql");

/// A query whose fragments each spread the next one twice: 1 KiB of text that expands to
/// 2^`levels` copies of its innermost selection.
fn exponential_fragments(levels: usize) -> String {
    let mut query = String::from("query { ...F0 }\n");
    for level in 0..levels {
        let next = level + 1;
        query.push_str(&format!(
            "fragment F{level} on Query {{ ...F{next} ...F{next} }}\n"
        ));
    }
    query.push_str(&format!(
        "fragment F{levels} on Query {{ viewer {{ subject }} }}\n"
    ));
    query
}

/// `count` aliases of an empty page: `first: 0` must not make a field free.
fn empty_page_aliases(count: usize) -> String {
    let fields: String = (0..count)
        .map(|i| format!("a{i}: nodes(first: 0) {{ totalCount }} "))
        .collect();
    format!("{{ {fields}}}")
}

/// The operation refused before it ran: `BAD_USER_INPUT`, no data, a message naming `limit`.
#[track_caller]
fn assert_refused(response: &Gql, limit: &str) {
    assert_eq!(response.status, 200, "{:#}", response.body);
    assert!(response.body["data"].is_null(), "{:#}", response.body);
    assert_eq!(
        response.code(),
        Some("BAD_USER_INPUT"),
        "{:#}",
        response.body
    );
    let message = response.error()["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(limit),
        "the message should name {limit}: {:#}",
        response.body
    );
}

/// Posts `query` as a viewer and returns the answer with how long it took.
async fn timed(s: &TestServer, query: &str) -> (Gql, Duration) {
    let token = s.token(Role::Viewer);
    let started = Instant::now();
    let response = s.gql(Some(&token), query, json!({})).await;
    (response, started.elapsed())
}

#[tokio::test]
async fn an_exponential_fragment_query_is_refused_at_once() {
    each_backend(async |s| {
        let query = exponential_fragments(26);
        eprintln!("the query is {} bytes", query.len());
        assert!(query.len() < 1200, "{}", query.len());
        let (response, took) = timed(s, &query).await;
        eprintln!("{:?}: refused in {took:?}", s.backend);
        assert_refused(&response, "graphql.max_fragment_spreads");
        assert!(took < Duration::from_secs(1), "took {took:?}");
    })
    .await;
}

#[tokio::test]
async fn aliases_fields_and_bytes_are_limited() {
    each_backend(async |s| {
        // The 10,000 aliases of an empty page: 360 KB, over the byte limit.
        let (response, took) = timed(s, &empty_page_aliases(10_000)).await;
        eprintln!("{:?}: 10,000 aliases refused in {took:?}", s.backend);
        assert_refused(&response, "graphql.max_query_bytes");
        assert!(took < Duration::from_secs(1), "took {took:?}");

        // Under the byte limit, still too many aliases.
        let (response, took) = timed(s, &empty_page_aliases(150)).await;
        eprintln!("{:?}: 150 aliases refused in {took:?}", s.backend);
        assert_refused(&response, "graphql.max_aliases");
        let (fine, _) = timed(s, &empty_page_aliases(20)).await;
        assert_eq!(fine.data()["a19"]["totalCount"], json!(0));

        // Fields without aliases: the same field selected many times (they merge, but every
        // copy is validated).
        let query = format!("{{ viewer {{ {} }} }}", "role ".repeat(2_100));
        let (response, _) = timed(s, &query).await;
        assert_refused(&response, "graphql.max_fields");

        // Bytes are counted before anything is parsed: a comment is enough.
        let query = format!("{{ viewer {{ subject }} }}\n#{}\n", "x".repeat(40_000));
        let (response, _) = timed(s, &query).await;
        assert_refused(&response, "graphql.max_query_bytes");
    })
    .await;
}

#[tokio::test]
async fn an_empty_page_still_costs_what_it_selects() {
    each_backend(async |s| {
        // `first: 0` used to make a connection cost nothing, whatever was under it.
        let alias = "nodes(first: 0) { nodes { events(first: 1000) { nodes { id type } } } }";
        let fields: String = (0..25).map(|i| format!("a{i}: {alias} ")).collect();
        let (response, _) = timed(s, &format!("{{ {fields}}}")).await;
        assert_refused(&response, "too complex");
    })
    .await;
}

#[tokio::test]
async fn the_standard_introspection_query_works_when_signed_in() {
    each_backend(async |s| {
        let (response, took) = timed(s, INTROSPECTION_QUERY).await;
        eprintln!(
            "{:?}: introspection answered in {took:?}, {} bytes",
            s.backend,
            response.body.to_string().len()
        );
        let schema = &response.data()["__schema"];
        assert_eq!(schema["queryType"]["name"], json!("Query"));
        let types = schema["types"].as_array().expect("a list of types");
        let node = types
            .iter()
            .find(|t| t["name"] == json!("NodeDetail"))
            .expect("NodeDetail is introspected");
        assert!(
            node["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{node:#}"
        );
        assert!(!schema["directives"].as_array().expect("a list").is_empty());

        // Without a token: nothing but the refusal.
        let anonymous = s.gql(None, INTROSPECTION_QUERY, json!({})).await;
        assert_eq!(anonymous.status, 401, "{:#}", anonymous.body);
        assert_eq!(anonymous.code(), Some("UNAUTHENTICATED"));
        assert!(anonymous.body["data"].is_null(), "{:#}", anonymous.body);
    })
    .await;
}

#[tokio::test]
async fn introspection_has_its_own_bounded_cost() {
    each_backend(async |s| {
        // Shallow enough for any depth limit, but every `type { fields }` multiplies the
        // answer by the widest type's field count.
        let query = "{ __schema { types { fields { type { fields { type { fields { type { fields { name } } } } } } } } } }";
        let (response, took) = timed(s, query).await;
        eprintln!(
            "{:?}: nested introspection lists answered in {took:?} ({} bytes)",
            s.backend,
            response.body.to_string().len()
        );
        assert_refused(&response, "graphql.introspection_max_cost");

        // And deeper than the standard query needs is refused.
        let of_types = 30;
        let query = format!(
            "{{ __type(name: \"NodeDetail\") {{ fields {{ type {{ {}name{} }} }} }} }}",
            "ofType { ".repeat(of_types),
            " }".repeat(of_types)
        );
        let (response, _) = timed(s, &query).await;
        assert_refused(&response, "graphql.introspection_max_depth");
    })
    .await;
}

#[tokio::test]
async fn fields_outside_introspection_keep_max_depth() {
    for backend in Backend::selected() {
        let s = TestServer::start_with(backend, |config| config.graphql.max_depth = 3)
            .await
            .expect("a test server");
        let (fine, _) = timed(&s, "{ nodes { nodes { id } } }").await;
        assert_eq!(fine.data()["nodes"]["nodes"], json!([]));
        let (response, _) = timed(&s, "{ nodes { nodes { cordon { reason } } } }").await;
        assert_refused(
            &response,
            "the query nests fields 4 deep; the limit (graphql.max_depth) is 3",
        );
        // Introspection has its own.
        let (fine, _) = timed(&s, "{ __schema { types { fields { name } } } }").await;
        assert!(fine.data()["__schema"]["types"].is_array());
        s.stop().await;
    }
}

/// The top-level definitions of a GraphQL document (comments dropped): each operation and
/// fragment as its own text.
fn definitions(document: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut depth = 0usize;
    for line in document.lines() {
        let line = line.split('#').next().unwrap_or_default();
        for c in line.chars() {
            current.push(c);
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(std::mem::take(&mut current).trim().to_owned());
                    }
                }
                _ => {}
            }
        }
        current.push('\n');
    }
    out
}

/// The name after `keyword` in a definition (`query NodePage(…)` → `NodePage`).
fn name_after<'a>(definition: &'a str, keyword: &str) -> Option<&'a str> {
    let rest = definition.strip_prefix(keyword)?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// Each of the dashboard's operations with the fragments it spreads, as `web/src/gql.rs`
/// sends it: (name, document).
fn dashboard_operations() -> Vec<(String, String)> {
    let definitions = definitions(DASHBOARD_OPERATIONS);
    let fragments: Vec<(&str, &String)> = definitions
        .iter()
        .filter_map(|d| name_after(d, "fragment").map(|name| (name, d)))
        .collect();
    definitions
        .iter()
        .filter(|d| !d.starts_with("fragment"))
        .map(|operation| {
            let name = ["query", "mutation", "subscription"]
                .iter()
                .find_map(|keyword| name_after(operation, keyword))
                .expect("a named operation")
                .to_owned();
            let mut document = operation.clone();
            let mut added: Vec<&str> = Vec::new();
            loop {
                let wanted: Vec<&(&str, &String)> = fragments
                    .iter()
                    .filter(|(fragment, _)| {
                        !added.contains(fragment) && document.contains(&format!("...{fragment}"))
                    })
                    .collect();
                if wanted.is_empty() {
                    break;
                }
                for (fragment, text) in wanted {
                    added.push(fragment);
                    document.push_str("\n\n");
                    document.push_str(text);
                }
            }
            (name, document)
        })
        .collect()
}

#[tokio::test]
async fn the_dashboards_operations_pass_the_limits() {
    each_backend(async |s| {
        let operations = dashboard_operations();
        assert!(operations.len() >= 15, "{}", operations.len());
        let node_page = operations
            .iter()
            .find(|(name, _)| name == "NodePage")
            .expect("the node page's query");
        assert!(
            node_page.1.contains("fragment CommandFields"),
            "{}",
            node_page.1
        );
        for (name, document) in &operations {
            // Variables of the right types; the ids name nothing, so the operations fail
            // later, at the resolvers, which is fine: only the limits are under test here.
            let variables = json!({
                "id": "node_00000000000000000000000000",
                "nodeId": "node_00000000000000000000000000",
                "first": 50,
                "input": {},
            });
            let response = s.gql(Some(s.admin_token()), document, variables).await;
            let errors = response.body["errors"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for error in errors {
                let message = error["message"].as_str().unwrap_or_default();
                assert!(
                    !message.contains("graphql.")
                        && !message.contains("too complex")
                        && !message.contains("too deep"),
                    "{name} ({:?}) hit a limit: {:#}",
                    s.backend,
                    response.body
                );
            }
        }
    })
    .await;
}

/// The slowest answer of `/healthz`, probed every 20 ms from a thread of its own (so that a
/// stalled server cannot stall the probe too), while `clients` clients keep sending `query`
/// for `duration`; and how many of those were answered.
async fn healthz_under(
    s: &TestServer,
    query: &str,
    clients: usize,
    duration: Duration,
) -> (Duration, usize) {
    let token = s.token(Role::Viewer);
    let url = format!("{}/graphql", s.url());
    let deadline = Instant::now() + duration;
    let mut abusers = Vec::new();
    for _ in 0..clients {
        let (url, token, query) = (url.clone(), token.clone(), query.to_owned());
        abusers.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut answered = 0;
            while Instant::now() < deadline {
                let response = client
                    .post(&url)
                    .bearer_auth(&token)
                    .json(&json!({ "query": query }))
                    .send()
                    .await;
                if let Ok(response) = response {
                    let _ = response.json::<Value>().await;
                    answered += 1;
                }
            }
            answered
        }));
    }
    let healthz = format!("{}/healthz", s.url());
    let probe = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime for the probe");
        runtime.block_on(async move {
            let client = reqwest::Client::builder()
                .timeout(PROBE_TIMEOUT)
                .build()
                .expect("a client");
            // Let the abusive requests get going first.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut slowest = Duration::ZERO;
            while Instant::now() < deadline {
                let started = Instant::now();
                let answered = client.get(&healthz).send().await;
                slowest = slowest.max(started.elapsed());
                if let Ok(response) = answered {
                    assert_eq!(response.status(), 200);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            slowest
        })
    });
    let mut answered = 0;
    for abuser in abusers {
        answered += abuser.await.expect("an abusive client");
    }
    let slowest = tokio::task::spawn_blocking(move || probe.join().expect("the probe"))
        .await
        .expect("joining the probe");
    (slowest, answered)
}

/// A probe that waits longer than this has seen the server stall.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The server on two worker threads, as on the 2-core machines it runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_while_abusive_queries_are_in_flight() {
    each_backend(async |s| {
        let query = exponential_fragments(26);
        let (slowest, answered) = healthz_under(s, &query, 4, Duration::from_secs(2)).await;
        eprintln!(
            "{:?}: /healthz took at most {slowest:?} while 4 clients sent {answered} exponential queries",
            s.backend
        );
        assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    })
    .await;
}

/// The heaviest query anyone signed in may send, again and again: the whole introspection
/// answer is computed in one poll of its future, so on the threads that also answer
/// `/healthz` it would hold them that long each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_while_heavy_queries_run() {
    each_backend(async |s| {
        let (slowest, answered) =
            healthz_under(s, INTROSPECTION_QUERY, 4, Duration::from_secs(3)).await;
        eprintln!(
            "{:?}: /healthz took at most {slowest:?} while 4 clients sent {answered} introspection queries",
            s.backend
        );
        assert!(answered > 0);
        assert!(slowest < Duration::from_secs(1), "{slowest:?}");
    })
    .await;
}

/// GraphiQL loads its scripts from the server itself: the machines reach no CDN, and a page
/// holding an admin token runs no third-party script.
#[tokio::test]
async fn graphiql_is_served_without_a_cdn() {
    each_backend(async |s| {
        let (status, page) = s.get("/graphql").await;
        assert_eq!(status, 200);
        assert!(!page.contains("https://"), "{page}");
        let scripts: Vec<&str> = page
            .split("src=\"")
            .skip(1)
            .chain(page.split("href=\"").skip(1))
            .filter_map(|rest| rest.split('"').next())
            .collect();
        assert_eq!(scripts.len(), 4, "{scripts:?}");
        for path in scripts {
            assert!(path.starts_with("/graphql/assets/"), "{path}");
            let (status, body) = s.get(path).await;
            assert_eq!(status, 200, "{path}");
            assert!(body.len() > 10_000, "{path}: {} bytes", body.len());
        }
        assert_eq!(s.get("/graphql/assets/nothing.js").await.0, 404);
    })
    .await;
}
