//! Bad input gets an error a client can act on (issue 17, items 7 and 9), over real HTTP on
//! SQLite and on PostgreSQL: every number out of its range and every string over its length
//! or carrying a NUL byte is `BAD_USER_INPUT` naming the field, before anything is stored and
//! without a panic or an `INTERNAL`; a malformed request body gets a coded GraphQL error with
//! no Rust `Debug` text and no echo of a large value; `INVALID_STATE` lists the moves a
//! client can send back.

use bc_testing::{TestServer, each_backend};
use serde_json::{Value, json};

/// `base` with the fields of `extra` added.
fn merged(mut base: Value, extra: Value) -> Value {
    if let (Some(base), Value::Object(extra)) = (base.as_object_mut(), extra) {
        base.extend(extra);
    }
    base
}

/// What the refusal cases act on: a site and pool, and a node enrolled there (`enrolling`).
struct Place {
    site: String,
    pool: String,
    node: String,
}

async fn place(s: &TestServer) -> Place {
    let (site, pool) = s.site_and_pool(8).await;
    let node = s.enroll(&site, &pool, "gpu-bad-input").await["id"]
        .as_str()
        .expect("node id")
        .to_owned();
    Place { site, pool, node }
}

const CREATE_JOIN_TOKEN: &str =
    "mutation($input: CreateJoinTokenInput!) { createJoinToken(input: $input) { secret } }";
const SEND_COMMAND: &str =
    "mutation($input: SendCommandInput!) { sendCommand(input: $input) { commands { id } } }";
const CORDON: &str =
    "mutation($input: CordonNodeInput!) { cordonNode(input: $input) { node { version } } }";
const DRAIN: &str =
    "mutation($input: DrainNodeInput!) { drainNode(input: $input) { node { version } } }";
const TRANSITION: &str =
    "mutation($input: TransitionNodeInput!) { transitionNode(input: $input) { node { version } } }";
const TAINT: &str =
    "mutation($input: TaintNodeInput!) { taintNode(input: $input) { node { version } } }";
const LABEL: &str =
    "mutation($input: LabelNodeInput!) { labelNode(input: $input) { node { version } } }";
const ENROLL: &str =
    "mutation($input: EnrollNodeInput!) { enrollNode(input: $input) { node { id } } }";
const CREATE_SITE: &str =
    "mutation($input: CreateSiteInput!) { createSite(input: $input) { site { id } } }";
const CREATE_POOL: &str =
    "mutation($input: CreatePoolInput!) { createPool(input: $input) { pool { id } } }";
const CREATE_TENANT: &str =
    "mutation($input: CreateTenantInput!) { createTenant(input: $input) { tenant { id } } }";
const CANCEL_COMMAND: &str =
    "mutation($input: CancelCommandInput!) { cancelCommand(input: $input) { command { id } } }";
const REVOKE_JOIN_TOKEN: &str = "mutation($input: RevokeJoinTokenInput!) { revokeJoinToken(input: $input) { joinToken { id } } }";
const NODES: &str = "query($filter: NodeFilterInput) { nodes(filter: $filter) { totalCount } }";
const COMMANDS: &str =
    "query($filter: CommandFilterInput) { commands(filter: $filter) { edges { cursor } } }";

const MAX: i64 = i64::MAX;
const MIN: i64 = i64::MIN;

/// One refused input: the operation, its variables, and the field the error must name
/// (`extensions.field`, also named in the message).
struct Refused {
    label: String,
    query: &'static str,
    variables: Value,
    field: &'static str,
}

fn refused(
    label: impl Into<String>,
    query: &'static str,
    variables: Value,
    field: &'static str,
) -> Refused {
    Refused {
        label: label.into(),
        query,
        variables,
        field,
    }
}

/// Sends each case as the admin and checks it is `BAD_USER_INPUT` naming its field, that the
/// message is short (nothing large echoed), and that the server still answers; reports every
/// case that is not.
async fn assert_all_refused(s: &TestServer, cases: Vec<Refused>) {
    let mut wrong = Vec::new();
    for case in cases {
        let label = format!("{} ({:?})", case.label, s.backend);
        let response = s.post(case.query, case.variables).await;
        if let Err(why) = bad_user_input(&response, case.field) {
            wrong.push(format!("{label}: {why}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} cases not refused as they should be:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // Alive and well.
    s.admin("{ viewer { subject } }", json!({})).await;
}

/// The answer as it came: a status and a body, or the transport error (a handler that
/// panicked drops the connection).
type Answer = Result<(u16, Value), String>;

trait Post {
    async fn post(&self, query: &str, variables: Value) -> Answer;
}

impl Post for TestServer {
    async fn post(&self, query: &str, variables: Value) -> Answer {
        let response = reqwest::Client::new()
            .post(format!("{}/graphql", self.url()))
            .bearer_auth(self.admin_token())
            .json(&json!({ "query": query, "variables": variables }))
            .send()
            .await
            .map_err(|err| format!("no answer ({err})"))?;
        let status = response.status().as_u16();
        let text = response
            .text()
            .await
            .map_err(|err| format!("no body ({err})"))?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }
}

/// `text` cut to at most `max` bytes, for failure messages.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let ellipsis = if end < text.len() { "…" } else { "" };
    format!("{}{ellipsis}", &text[..end])
}

fn bad_user_input(answer: &Answer, field: &str) -> Result<(), String> {
    let (status, body) = answer.as_ref().map_err(Clone::clone)?;
    let short = |body: &Value| cut(&body.to_string(), 400);
    if *status != 200 {
        return Err(format!("status {status}: {}", short(body)));
    }
    let error = &body["errors"][0];
    if error["extensions"]["code"] != "BAD_USER_INPUT" {
        return Err(format!("not BAD_USER_INPUT: {}", short(body)));
    }
    if error["extensions"]["field"] != json!(field) {
        return Err(format!(
            "extensions.field is not `{field}`: {}",
            short(body)
        ));
    }
    let message = error["message"].as_str().unwrap_or_default();
    let last = field.rsplit('.').next().unwrap_or(field);
    let last = last.split('[').next().unwrap_or(last);
    if !message.contains(last) {
        return Err(format!(
            "the message does not name `{last}`: {}",
            short(body)
        ));
    }
    if body.to_string().len() > 2048 {
        return Err(format!(
            "{} bytes long: {}",
            body.to_string().len(),
            short(body)
        ));
    }
    Ok(())
}

/// `expiresInSeconds` or `timeoutSeconds` of 2^63−1 used to panic the handler (the client
/// saw its connection drop); every duration and count has a range now.
#[tokio::test]
async fn numbers_out_of_range_are_bad_user_input_naming_the_field() {
    each_backend(async |s| {
        let p = place(s).await;
        let token = |extra: Value| json!({ "input": merged(json!({ "siteId": p.site, "poolId": p.pool }), extra) });
        let command = |extra: Value| json!({ "input": merged(json!({ "nodeIds": [p.node], "kind": "INVENTORY_REFRESH" }), extra) });
        let mut cases = Vec::new();
        for value in [MAX, MIN, 0, -1, 365 * 86400 + 1] {
            cases.push(refused(
                format!("createJoinToken expiresInSeconds {value}"),
                CREATE_JOIN_TOKEN,
                token(json!({ "expiresInSeconds": value })),
                "input.expiresInSeconds",
            ));
        }
        for value in [MAX, MIN, 0, 1_000_001] {
            cases.push(refused(
                format!("createJoinToken maxUses {value}"),
                CREATE_JOIN_TOKEN,
                token(json!({ "maxUses": value })),
                "input.maxUses",
            ));
        }
        for value in [MAX, MIN, 0, 6 * 3600 + 1] {
            cases.push(refused(
                format!("sendCommand timeoutSeconds {value}"),
                SEND_COMMAND,
                command(json!({ "timeoutSeconds": value })),
                "input.timeoutSeconds",
            ));
        }
        for value in [MAX, MIN, 0, 30 * 86400 + 1] {
            cases.push(refused(
                format!("sendCommand expiresInSeconds {value}"),
                SEND_COMMAND,
                command(json!({ "expiresInSeconds": value })),
                "input.expiresInSeconds",
            ));
        }
        // Timestamps chrono parses but the databases cannot hold, or that overflow once a
        // duration is added to them.
        for value in ["+262143-12-31T23:59:59Z", "-262143-01-01T00:00:00Z", "10000-01-01T00:00:00Z"] {
            cases.push(refused(
                format!("sendCommand notBefore {value}"),
                SEND_COMMAND,
                command(json!({ "notBefore": value })),
                "input.notBefore",
            ));
            cases.push(refused(
                format!("drainNode deadline {value}"),
                DRAIN,
                json!({ "input": { "id": p.node, "version": 1, "reason": "r", "deadline": value } }),
                "input.deadline",
            ));
        }
        for value in [MIN, 0, -1] {
            cases.push(refused(
                format!("cordonNode version {value}"),
                CORDON,
                json!({ "input": { "id": p.node, "version": value, "reason": "r" } }),
                "input.version",
            ));
        }
        for value in [i64::from(i32::MAX), -1, 1025] {
            cases.push(refused(
                format!("createPool expectedGpuCount {value}"),
                CREATE_POOL,
                json!({ "input": { "siteId": p.site, "name": "p", "kind": "METAL_HOST", "expectedGpuCount": value } }),
                "input.expectedGpuCount",
            ));
        }
        assert_all_refused(s, cases).await;
        // Nothing was queued or created by any of them.
        let commands = s
            .admin(COMMANDS, json!({ "filter": { "nodeId": [p.node] } }))
            .await;
        assert_eq!(commands["commands"]["edges"], json!([]));
        let tokens = s.admin("{ joinTokens { totalCount } }", json!({})).await;
        assert_eq!(tokens["joinTokens"]["totalCount"], 0);
    })
    .await;
}

/// NUL bytes gave `INTERNAL` on PostgreSQL (it stores no NUL in text or jsonb); every kind of
/// string field refuses them, nested command parameters included.
#[tokio::test]
async fn nul_bytes_in_every_kind_of_string_are_bad_user_input() {
    each_backend(async |s| {
        let p = place(s).await;
        let nul = "rack\u{0}move";
        let node = |extra: Value| json!({ "input": merged(json!({ "id": p.node, "version": 1 }), extra) });
        let cases = vec![
            refused("cordon reason", CORDON, node(json!({ "reason": nul })), "input.reason"),
            refused("drain reason", DRAIN, node(json!({ "reason": nul })), "input.reason"),
            refused(
                "FAIL reason",
                TRANSITION,
                node(json!({ "move": "FAIL", "reason": nul })),
                "input.reason",
            ),
            refused(
                "join token description",
                CREATE_JOIN_TOKEN,
                json!({ "input": { "siteId": p.site, "description": nul } }),
                "input.description",
            ),
            refused(
                "hostname filter",
                NODES,
                json!({ "filter": { "hostname": nul } }),
                "filter.hostname",
            ),
            refused(
                "label selector key",
                NODES,
                json!({ "filter": { "labels": [{ "key": nul }] } }),
                "filter.labels[0].key",
            ),
            refused(
                "label selector value",
                NODES,
                json!({ "filter": { "labels": [{ "key": "a", "value": nul }] } }),
                "filter.labels[0].value",
            ),
            refused(
                "reason filter",
                NODES,
                json!({ "filter": { "reason": ["draining", nul] } }),
                "filter.reason[1]",
            ),
            refused(
                "gateway filter",
                NODES,
                json!({ "filter": { "gatewayId": ["gw-a", nul] } }),
                "filter.gatewayId[1]",
            ),
            refused(
                "command filter",
                SEND_COMMAND,
                json!({ "input": { "filter": { "hostname": nul }, "kind": "LOGS_COLLECT" } }),
                "input.filter.hostname",
            ),
            refused(
                "command filter by gateway",
                SEND_COMMAND,
                json!({ "input": { "filter": { "gatewayId": [nul] }, "kind": "LOGS_COLLECT" } }),
                "input.filter.gatewayId[0]",
            ),
            refused(
                "command params, nested",
                SEND_COMMAND,
                json!({ "input": { "nodeIds": [p.node], "kind": "LOGS_COLLECT", "params": { "sources": ["kern", nul] } } }),
                "input.params.sources[1]",
            ),
            refused(
                "command params, a key",
                SEND_COMMAND,
                json!({ "input": { "nodeIds": [p.node], "kind": "LOGS_COLLECT", "params": { nul: 1 } } }),
                "input.params",
            ),
            refused(
                "taint value",
                TAINT,
                node(json!({ "key": "k", "value": nul })),
                "input.value",
            ),
            refused(
                "label value",
                LABEL,
                node(json!({ "set": [{ "key": "k", "value": nul }] })),
                "input.set[0].value",
            ),
            refused(
                "enrolled hostname",
                ENROLL,
                json!({ "input": { "siteId": p.site, "hostname": nul } }),
                "input.hostname",
            ),
            refused(
                "site name",
                CREATE_SITE,
                json!({ "input": { "name": nul, "kind": "PLATFORM" } }),
                "input.name",
            ),
            refused(
                "tenant name",
                CREATE_TENANT,
                json!({ "input": { "name": nul } }),
                "input.name",
            ),
            refused(
                "GPU model",
                CREATE_POOL,
                json!({ "input": { "siteId": p.site, "name": "p", "kind": "METAL_HOST", "expectedGpuModel": nul } }),
                "input.expectedGpuModel",
            ),
            refused(
                "pool driver",
                CREATE_POOL,
                json!({ "input": { "siteId": p.site, "name": "p", "kind": "METAL_HOST", "drivers": [{ "key": "power", "value": nul }] } }),
                "input.drivers[0].value",
            ),
        ];
        assert_all_refused(s, cases).await;
        // The node is as it was.
        let node = s
            .admin(
                "query($id: ID!) { node(id: $id) { version events(first: 50) { nodes { id } } } }",
                json!({ "id": p.node }),
            )
            .await;
        assert_eq!(node["node"]["version"], 1);
    })
    .await;
}

/// A 1 MB `FAIL` reason was written into three events, and a 1 MB hostname filter was
/// `INTERNAL` on SQLite; strings have lengths, checked before anything is written. The values
/// here are 4 KiB short of a mebibyte, so that the request stays under the API's body limit
/// (`api.max_body_bytes`, 1 MiB, which refuses larger requests whole: `listeners.rs`) and it
/// is the field's own check that refuses them.
#[tokio::test]
async fn strings_over_their_length_are_bad_user_input_and_write_nothing() {
    each_backend(async |s| {
        let p = place(s).await;
        let megabyte = "x".repeat(1024 * 1024 - 4096);
        let events = async || {
            s.admin(
                "query($id: ID!) { node(id: $id) { version events(first: 100) { nodes { id } } } }",
                json!({ "id": p.node }),
            )
            .await["node"]
                .clone()
        };
        let before = events().await;
        let node = |extra: Value| json!({ "input": merged(json!({ "id": p.node, "version": 1 }), extra) });
        let mut big_params = serde_json::Map::new();
        big_params.insert("sources".into(), json!(vec!["kern"; 20_000]));
        let cases = vec![
            refused(
                "1 MB FAIL reason",
                TRANSITION,
                node(json!({ "move": "FAIL", "reason": megabyte })),
                "input.reason",
            ),
            refused(
                "1 MB cordon reason",
                CORDON,
                node(json!({ "reason": megabyte })),
                "input.reason",
            ),
            refused(
                "1 MB hostname filter",
                NODES,
                json!({ "filter": { "hostname": megabyte } }),
                "filter.hostname",
            ),
            refused(
                "1 MB gateway filter",
                NODES,
                json!({ "filter": { "gatewayId": [megabyte] } }),
                "filter.gatewayId[0]",
            ),
            refused(
                "1 MB label selector",
                NODES,
                json!({ "filter": { "labels": [{ "key": megabyte }] } }),
                "filter.labels[0].key",
            ),
            refused(
                "1 MB description",
                CREATE_JOIN_TOKEN,
                json!({ "input": { "siteId": p.site, "description": megabyte } }),
                "input.description",
            ),
            refused(
                "1 MB taint key",
                TAINT,
                node(json!({ "key": megabyte })),
                "input.key",
            ),
            refused(
                "1 MB id",
                CORDON,
                json!({ "input": { "id": format!("node_{megabyte}"), "version": 1, "reason": "r" } }),
                "input.id",
            ),
            refused(
                "tenant name over 100 bytes",
                CREATE_TENANT,
                json!({ "input": { "name": "t".repeat(101) } }),
                "input.name",
            ),
            refused(
                "1 MB command id",
                CANCEL_COMMAND,
                json!({ "input": { "id": format!("cmd_{megabyte}") } }),
                "input.id",
            ),
            refused(
                "1 MB join token id",
                REVOKE_JOIN_TOKEN,
                json!({ "input": { "id": format!("jt_{megabyte}") } }),
                "input.id",
            ),
            refused(
                "params over their size",
                SEND_COMMAND,
                json!({ "input": { "nodeIds": [p.node], "kind": "LOGS_COLLECT", "params": big_params } }),
                "input.params",
            ),
        ];
        assert_all_refused(s, cases).await;
        assert_eq!(events().await, before, "no event written, no version bumped");
    })
    .await;
}

/// POSTs raw bytes to `/graphql` as the admin.
async fn post_raw(s: &TestServer, body: impl Into<reqwest::Body>) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("{}/graphql", s.url()))
        .bearer_auth(s.admin_token())
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the server answers");
    (
        response.status().as_u16(),
        response.text().await.unwrap_or_default(),
    )
}

/// Malformed bodies answered `400` with Rust `Debug` text (`InvalidRequest(Error("…",
/// line: 1, column: 2))`), echoing what they could not parse; large invalid values in a
/// well-formed body were echoed whole in validation errors.
#[tokio::test]
async fn malformed_requests_get_a_coded_error_without_debug_text_or_echo() {
    each_backend(async |s| {
        let big = "y".repeat(100 * 1024);
        // (what, body, status): a body that is no request is 400; a request without a `query`
        // is an empty document, a GraphQL error like any other.
        let bodies: Vec<(&str, String, u16)> = vec![
            ("not JSON", "{".into(), 400),
            ("empty", String::new(), 400),
            ("a number", "42".into(), 400),
            ("query not a string", r#"{"query": 1}"#.into(), 400),
            ("no query", r#"{"variables": {}}"#.into(), 200),
            (
                "variables not an object",
                json!({ "query": "{ viewer { subject } }", "variables": big }).to_string(),
                400,
            ),
            (
                "operationName not a string",
                json!({ "query": "{ viewer { subject } }", "operationName": [big] }).to_string(),
                400,
            ),
            ("a batch", r#"[{"query": "{ viewer { subject } }"}]"#.into(), 400),
        ];
        let mut wrong = Vec::new();
        for (label, body, want) in bodies {
            let (status, text) = post_raw(s, body).await;
            if let Err(why) = coded(status, &text, want) {
                wrong.push(format!("{label}: {why}"));
            }
        }
        let (status, text) = post_raw(s, vec![b'{', b'"', 0xff, 0xfe, b'"']).await;
        if let Err(why) = coded(status, &text, 400) {
            wrong.push(format!("invalid UTF-8: {why}"));
        }

        // Well-formed requests whose invalid values are large.
        let mut unknown_field = serde_json::Map::new();
        unknown_field.insert("id".into(), json!("node_x"));
        unknown_field.insert("version".into(), json!(1));
        unknown_field.insert("reason".into(), json!("r"));
        unknown_field.insert(big.clone(), json!(1));
        let documents: Vec<(&str, String, Value)> = vec![
            (
                "unknown enum value",
                TRANSITION.to_owned(),
                json!({ "input": { "id": "node_x", "version": 1, "move": big } }),
            ),
            (
                "unknown input field",
                CORDON.to_owned(),
                json!({ "input": unknown_field }),
            ),
            (
                "string for an Int",
                CORDON.to_owned(),
                json!({ "input": { "id": "node_x", "version": big, "reason": "r" } }),
            ),
            ("unknown field in the query", format!("{{ {big} }}"), json!({})),
            ("a syntax error", format!("{{ viewer {{ subject }} }} {big}!"), json!({})),
            (
                "an inline string for an Int",
                format!("mutation {{ cordonNode(input: {{id: \"node_x\", version: \"{big}\", reason: \"r\"}}) {{ node {{ version }} }} }}"),
                json!({}),
            ),
        ];
        for (label, query, variables) in documents {
            let (status, text) = post_raw(
                s,
                json!({ "query": query, "variables": variables }).to_string(),
            )
            .await;
            if let Err(why) = coded(status, &text, 200) {
                wrong.push(format!("{label}: {why}"));
            }
        }
        assert!(wrong.is_empty(), "{} malformed requests answered wrongly ({:?}):\n{}", wrong.len(), s.backend, wrong.join("\n"));
        s.admin("{ viewer { subject } }", json!({})).await;
    })
    .await;
}

/// A GraphQL-shaped error with a code, no Rust `Debug` text, and nothing large echoed.
fn coded(status: u16, text: &str, want_status: u16) -> Result<(), String> {
    let shown = cut(text, 300);
    if status != want_status {
        return Err(format!("status {status}, not {want_status}: {shown}"));
    }
    if text.len() > 2048 {
        return Err(format!("{} bytes: {shown}", text.len()));
    }
    let body: Value = serde_json::from_str(text).map_err(|_| format!("not JSON: {shown}"))?;
    if body["errors"][0]["extensions"]["code"] != "BAD_USER_INPUT" {
        return Err(format!("not BAD_USER_INPUT: {shown}"));
    }
    let message = body["errors"][0]["message"].as_str().unwrap_or_default();
    if message.is_empty() {
        return Err(format!("no message: {shown}"));
    }
    for debug in [
        "InvalidRequest(",
        "Error(\"",
        "line:",
        "column:",
        "Io(",
        "Custom {",
    ] {
        if message.contains(debug) {
            return Err(format!("Debug text `{debug}`: {shown}"));
        }
    }
    Ok(())
}

/// `INVALID_STATE.allowed` listed the moves in the domain's spelling (`inspect`, and
/// `delete`, which no move can express); it lists what `transitionNode` takes now.
#[tokio::test]
async fn invalid_state_lists_the_moves_in_the_api_spelling() {
    each_backend(async |s| {
        let p = place(s).await;
        // An enrolled node is `enrolling`: it may be inspected or failed (or deleted, which is
        // `deleteNode`, not a move).
        let response = s
            .gql(
                Some(s.admin_token()),
                TRANSITION,
                json!({ "input": { "id": p.node, "version": 1, "move": "ADOPT" } }),
            )
            .await;
        assert_eq!(response.code(), Some("INVALID_STATE"), "{:#}", response.body);
        let error = response.error();
        let ext = &error["extensions"];
        assert_eq!(ext["allowed"], json!(["INSPECT", "FAIL"]), "{:#}", response.body);
        assert_eq!(ext["attempted"], "ADOPT");
        assert_eq!(ext["current"], "ENROLLING");
        assert_eq!(
            error["message"],
            "cannot ADOPT a node that is ENROLLING; the moves allowed from ENROLLING are INSPECT, FAIL (and deleteNode)"
        );
        // Every move listed is one the move enum takes, and it works.
        for (moved, version) in [("INSPECT", 1), ("FAIL", 2)] {
            let ok = s
                .gql(
                    Some(s.admin_token()),
                    TRANSITION,
                    json!({ "input": { "id": p.node, "version": version, "move": moved, "reason": "r" } }),
                )
                .await;
            ok.data();
        }
        // Failed: RETIRE and RECOVER; deletion is named in words, never as a move.
        let response = s
            .gql(
                Some(s.admin_token()),
                TRANSITION,
                json!({ "input": { "id": p.node, "version": 3, "move": "DEPLOY" } }),
            )
            .await;
        let ext = &response.error()["extensions"];
        assert_eq!(ext["allowed"], json!(["RETIRE", "RECOVER"]), "{:#}", response.body);
        // deleteNode from a state that cannot be deleted.
        let (site, pool) = (&p.site, &p.pool);
        let other = s.enroll(site, pool, "gpu-other").await["id"].as_str().unwrap_or_default().to_owned();
        for (moved, version) in [("INSPECT", 1), ("COMMISSION", 2)] {
            s.admin(TRANSITION, json!({ "input": { "id": other, "version": version, "move": moved } })).await;
        }
        let response = s
            .gql(
                Some(s.admin_token()),
                "mutation($id: ID!) { deleteNode(input: {id: $id, version: 3}) { node { id } } }",
                json!({ "id": other }),
            )
            .await;
        assert_eq!(response.code(), Some("INVALID_STATE"), "{:#}", response.body);
        let error = response.error();
        assert_eq!(error["extensions"]["attempted"], "deleteNode");
        assert_eq!(error["extensions"]["current"], "COMMISSIONING");
        assert_eq!(error["extensions"]["allowed"], json!(["PROVIDE", "FAIL"]));
        assert_eq!(
            error["message"],
            "cannot delete a node that is COMMISSIONING (only ADOPTING, ENROLLING, FAILED or RETIRED nodes can be); the moves allowed from COMMISSIONING are PROVIDE, FAIL"
        );
    })
    .await;
}

/// `cancelCommand` on a finished command said "cannot cancelled a node that is cancelled".
#[tokio::test]
async fn cancelling_a_finished_command_says_so_about_the_command() {
    each_backend(async |s| {
        let p = place(s).await;
        let sent = s
            .admin(
                SEND_COMMAND,
                json!({ "input": { "nodeIds": [p.node], "kind": "INVENTORY_REFRESH" } }),
            )
            .await;
        let id = sent["sendCommand"]["commands"][0]["id"].as_str().unwrap_or_default().to_owned();
        let cancel = "mutation($id: ID!) { cancelCommand(input: {id: $id}) { command { status } } }";
        let first = s.admin(cancel, json!({ "id": id })).await;
        assert_eq!(first["cancelCommand"]["command"]["status"], "CANCELLED");
        let again = s.gql(Some(s.admin_token()), cancel, json!({ "id": id })).await;
        assert_eq!(again.code(), Some("INVALID_STATE"), "{:#}", again.body);
        let error = again.error();
        assert_eq!(
            error["message"],
            format!("command {id} already finished (CANCELLED): only a QUEUED, DISPATCHED or RUNNING command can be cancelled")
        );
        assert_eq!(error["extensions"]["current"], "CANCELLED");
        assert_eq!(error["extensions"]["attempted"], "cancelCommand");
        assert_eq!(error["extensions"]["allowed"], json!([]));
    })
    .await;
}
