//! Property tests over everything an outsider can send (issue 17, item 11): a daemon's frames
//! on a live session, join requests, and the inputs of GraphQL mutations. Whatever arrives,
//! the answer is typed (a close with a reason, an error code) and nothing already stored
//! changes on a refusal; the server stays up and other sessions do not notice.
//!
//! Every test here is named `fuzz_…`, so `cargo test -- fuzz_` selects them with bc-core's
//! decoder properties. Each runs few cases by default (a case is real requests to a real
//! server, on SQLite and on PostgreSQL); `PROPTEST_CASES` raises that for a longer run (the
//! README's testing section). A failing case's seed is saved under
//! `server/proptest-regressions/`, which is committed so that every later run tries it first.

#![allow(clippy::unwrap_used)]

use crate::raw_daemon::{self, Machine};
use bc_core::protocol::{DaemonMessage, GatewayMessage, section_hash};
use bc_testing::{Backend, TestServer};
use futures::SinkExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

/// Cases per backend when `PROPTEST_CASES` is not set: each opens a session or sends a few
/// requests, so a handful keeps the whole fuzz set within a minute of `cargo test`.
const GATEWAY_CASES: u32 = 16;
const JOIN_CASES: u32 = 32;
const GRAPHQL_CASES: u32 = 64;

/// The longest error message an answer may carry (SECURITY.md: no large value echoed).
const MAX_MESSAGE_BYTES: usize = better_compute::graphql::input_limits::MAX_ERROR_MESSAGE_BYTES;

/// proptest's defaults (which read `PROPTEST_CASES` and the other `PROPTEST_*` variables)
/// with `cases` unless `PROPTEST_CASES` is set, and failures saved to `regressions` (relative
/// to the crate: cargo runs tests there). `ProptestConfig::with_cases` would ignore the
/// variable, hence this.
fn fuzz_config(cases: u32, regressions: &'static str) -> Config {
    let config = Config {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
        ..Config::default()
    };
    if std::env::var_os("PROPTEST_CASES").is_some() {
        config
    } else {
        Config { cases, ..config }
    }
}

/// Runs `test` over `strategy` against one server per selected backend (started once for
/// the whole run; `setup` prepares each, `finish` checks each after the last case), panicking
/// with proptest's report on a failure.
fn run_against_servers<S, W, T>(
    cases: u32,
    regressions: &'static str,
    strategy: S,
    setup: impl AsyncFn(&TestServer) -> W,
    test: T,
    finish: impl AsyncFn(&TestServer, W),
) where
    S: Strategy,
    S::Value: Clone + std::fmt::Debug,
    T: AsyncFn(&TestServer, &W, S::Value) -> Result<(), TestCaseError>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let fixtures: Vec<(TestServer, W)> = Backend::selected()
        .into_iter()
        .map(|backend| {
            rt.block_on(async {
                let s = TestServer::start(backend)
                    .await
                    .unwrap_or_else(|err| panic!("starting a {backend:?} test server: {err:#}"));
                let world = setup(&s).await;
                (s, world)
            })
        })
        .collect();
    let mut runner = TestRunner::new(fuzz_config(cases, regressions));
    let result = runner.run(&strategy, |value| {
        for (s, world) in &fixtures {
            rt.block_on(test(s, world, value.clone()))
                .map_err(|err| TestCaseError::fail(format!("{:?}: {err}", s.backend)))?;
        }
        Ok(())
    });
    if let Err(err) = result {
        for (s, _) in fixtures {
            rt.block_on(s.stop());
        }
        panic!("{err}");
    }
    for (s, world) in fixtures {
        rt.block_on(async {
            finish(&s, world).await;
            s.stop().await;
        });
    }
}

/// How often each outcome came up in a run, printed at its end: what the generated inputs
/// reached (successes and each kind of refusal) is visible in the test's output.
#[derive(Default)]
struct Tally(std::sync::Mutex<BTreeMap<String, u64>>);

impl Tally {
    fn add(&self, outcome: impl Into<String>) {
        let mut counts = self.0.lock().unwrap();
        *counts.entry(outcome.into()).or_default() += 1;
    }

    fn print(&self, what: &str, s: &TestServer) {
        let counts = self.0.lock().unwrap();
        eprintln!("{what} ({:?}): {counts:?}", s.backend);
    }
}

/// `text` cut for a failure message.
fn cut(text: &str) -> String {
    let mut end = text.len().min(300);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// Strings of every kind an input may carry: short and plain (mostly, so that operations
/// with several strings often get through to the domain), any Unicode, NUL bytes, long.
fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => "[a-z0-9-]{1,12}",
        2 => ".{0,24}",
        1 => ".{0,8}".prop_map(|s| format!("{s}\u{0}{s}")),
        1 => (1usize..20_000).prop_map(|n| "x".repeat(n)),
        1 => Just(String::new()),
    ]
}

// ---------------------------------------------------------------------------------------
// Gateway frames

/// One frame a misbehaving daemon sends on an open session.
#[derive(Debug, Clone)]
enum Frame {
    Text(String),
    Binary(Vec<u8>),
}

/// Frames a daemon could plausibly send in this session (the `cpu` section was asked for),
/// which the mutations below bend out of shape.
fn plausible_message() -> impl Strategy<Value = DaemonMessage> {
    let cpu = json!({"count": 8});
    prop_oneof![
        3 => (1u64..1000).prop_map(|seq| DaemonMessage::Heartbeat { seq }),
        2 => Just(DaemonMessage::Inventory {
            section: "cpu".into(),
            hash: section_hash(&cpu),
            content: cpu,
        }),
        1 => (0i64..3).prop_map(|generation| DaemonMessage::Converged { generation }),
        1 => "cmd_[0-9a-f]{8}".prop_map(|id| DaemonMessage::CommandStarted { id }),
        1 => Just(raw_daemon::hello(0)),
    ]
}

/// A valid frame with bytes edited: deleted, replaced or inserted (JSON's own bytes often).
fn mutated_text() -> impl Strategy<Value = String> {
    let edit = (any::<usize>(), 0usize..4, "[{}\\[\\]\":,0-9a-z\\\\ -]{0,4}");
    let edits = prop_oneof![
        1 => Just(Vec::new()),
        2 => prop::collection::vec(edit, 1..3),
    ];
    (plausible_message(), edits).prop_map(|(message, edits)| {
        let mut bytes = message.encode().into_bytes();
        for (at, delete, insert) in edits {
            let at = at % (bytes.len() + 1);
            let end = (at + delete).min(bytes.len());
            bytes.splice(at..end, insert.bytes());
        }
        // A text frame is UTF-8 by the WebSocket protocol; an edit inside a multi-byte
        // character (none of the plausible frames have one yet) would not be.
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// A valid frame with one field's value replaced by any JSON, or a field added or removed:
/// a known message type with bad fields.
fn mistyped_text() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just(Value::Null),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter_map("finite", serde_json::Number::from_f64)
            .prop_map(Value::Number),
        ".{0,8}".prop_map(Value::from),
        Just(json!({})),
        Just(json!([1])),
    ];
    (
        plausible_message(),
        any::<usize>(),
        proptest::option::of(value),
        "[a-zA-Z]{1,8}",
    )
        .prop_map(|(message, at, value, extra)| {
            let mut frame = serde_json::to_value(&message).unwrap();
            let object = frame.as_object_mut().unwrap();
            let fields: Vec<String> = object.keys().filter(|k| *k != "type").cloned().collect();
            match (fields.get(at % fields.len().max(1)), value) {
                (Some(field), Some(value)) => _ = object.insert(field.clone(), value),
                (Some(field), None) => _ = object.remove(field),
                (None, value) => _ = object.insert(extra, value.unwrap_or_default()),
            }
            frame.to_string()
        })
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        4 => mutated_text().prop_map(Frame::Text),
        2 => mistyped_text().prop_map(Frame::Text),
        2 => ".{0,64}".prop_map(Frame::Text),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Frame::Binary),
    ]
}

/// What the gateway tests share on each server: a token, and a well-behaved neighbour with an
/// open session that must notice nothing.
struct GatewayWorld {
    secret: String,
    neighbour_id: String,
    neighbour_ws: tokio::sync::Mutex<raw_daemon::Ws>,
    neighbour_seq: std::sync::atomic::AtomicU64,
    /// The neighbour's node as stored when its session opened.
    neighbour_stored: Value,
    /// Nodes joined so far (the neighbour and one per case).
    joined: std::sync::atomic::AtomicU64,
    /// Close reasons, up to their first colon.
    outcomes: Tally,
}

/// The frame the tests send last: an unknown type, which closes a session that is still open
/// with a reason naming it, so a test learns whether what came before was accepted.
const PROBE: &str = r#"{"type":"probe"}"#;
const PROBE_REASON: &str = "unknown message type `probe`";

/// The node fields a session must never change, whatever the daemon sends.
fn stored_fields(node: &Value) -> Value {
    json!([
        node["provisionState"],
        node["identityGeneration"],
        node["role"],
        node["trust"],
        node["hardwareKeyTrusted"],
    ])
}

/// Sends `frames` then [`PROBE`] on `ws`, and returns the close that ended the session.
async fn close_after(ws: &mut raw_daemon::Ws, frames: &[Frame]) -> (Option<CloseCode>, String) {
    for frame in frames {
        let message = match frame {
            Frame::Text(text) => Message::Text(text.clone().into()),
            Frame::Binary(bytes) => Message::Binary(bytes.clone().into()),
        };
        // The gateway may have closed already; the close frame tells why.
        let _ = ws.send(message).await;
    }
    let _ = ws.send(Message::Text(PROBE.into())).await;
    loop {
        match raw_daemon::next(ws).await {
            // Whatever the gateway sends meanwhile (a spec, a command): the close follows.
            Ok(_) => continue,
            Err(close) => return close,
        }
    }
}

#[test]
fn fuzz_gateway_garbage_frames_close_only_their_session() {
    run_against_servers(
        GATEWAY_CASES,
        "proptest-regressions/fuzz/gateway_frames.txt",
        prop::collection::vec(frame(), 1..3),
        async |s| {
            let (site, pool) = s.site_and_pool(8).await;
            let secret = s.join_token(&site, Some(&pool), 100_000).await;
            let neighbour = Machine::new();
            let issued = raw_daemon::join(s, &neighbour, &secret, "neighbour").await;
            let mut ws = raw_daemon::connect(s, &issued.certificate_pem, neighbour.key_der())
                .await
                .unwrap();
            raw_daemon::send(&mut ws, &raw_daemon::hello(0)).await;
            assert!(matches!(
                raw_daemon::next(&mut ws).await,
                Ok(GatewayMessage::Welcome { .. })
            ));
            let neighbour_stored = raw_daemon::node(s, &issued.node_id).await;
            GatewayWorld {
                secret,
                neighbour_id: issued.node_id,
                neighbour_ws: tokio::sync::Mutex::new(ws),
                neighbour_seq: 0.into(),
                neighbour_stored,
                joined: 1.into(),
                outcomes: Tally::default(),
            }
        },
        async |s, world, frames| {
            use std::sync::atomic::Ordering::SeqCst;
            let machine = Machine::new();
            let hostname = format!("fuzz-{}", uuid::Uuid::new_v4().simple());
            let issued = raw_daemon::join(s, &machine, &world.secret, &hostname).await;
            world.joined.fetch_add(1, SeqCst);
            let mut ws = raw_daemon::connect(s, &issued.certificate_pem, machine.key_der())
                .await
                .map_err(TestCaseError::fail)?;
            raw_daemon::send(&mut ws, &raw_daemon::hello(0)).await;
            let welcome = raw_daemon::next(&mut ws).await;
            prop_assert!(
                matches!(welcome, Ok(GatewayMessage::Welcome { .. })),
                "{:?}",
                welcome
            );
            let stored = stored_fields(&raw_daemon::node(s, &issued.node_id).await);

            let (code, reason) = close_after(&mut ws, &frames).await;
            world
                .outcomes
                .add(reason.split(':').next().unwrap_or_default());
            prop_assert!(!reason.is_empty(), "closed without a reason ({code:?})");
            prop_assert!(reason.len() <= 123, "a close reason over 123 bytes");
            prop_assert!(
                matches!(code, Some(CloseCode::Policy | CloseCode::Size)),
                "closed with {code:?}: {reason}"
            );
            // The decoder is the oracle: a frame it refuses ends the session before the probe.
            let refused = frames.iter().any(|frame| match frame {
                Frame::Text(text) => DaemonMessage::decode(text.as_bytes()).is_err(),
                Frame::Binary(_) => true,
            });
            if refused {
                prop_assert_ne!(
                    reason.as_str(),
                    PROBE_REASON,
                    "a frame the decoder refuses was accepted"
                );
            }

            // Only the session ended: the node's own facts, the neighbour and the server are
            // as they were.
            let id = issued.node_id.clone();
            raw_daemon::wait_until(async || {
                raw_daemon::node(s, &id).await["connectivity"] == "DISCONNECTED"
            })
            .await;
            let after = raw_daemon::node(s, &issued.node_id).await;
            prop_assert_eq!(stored_fields(&after), stored);
            let (status, _) = s.get("/healthz").await;
            prop_assert_eq!(status, 200);
            let neighbour = raw_daemon::node(s, &world.neighbour_id).await;
            prop_assert_eq!(&neighbour["connectivity"], "CONNECTED");
            prop_assert_eq!(&neighbour["version"], &world.neighbour_stored["version"]);
            prop_assert_eq!(
                &neighbour["session"]["epoch"],
                &world.neighbour_stored["session"]["epoch"]
            );
            let seq = world.neighbour_seq.fetch_add(1, SeqCst) + 1;
            raw_daemon::send(
                &mut *world.neighbour_ws.lock().await,
                &DaemonMessage::Heartbeat { seq },
            )
            .await;
            prop_assert_eq!(
                raw_daemon::node_count(s).await,
                world.joined.load(SeqCst),
                "a frame created or removed a node"
            );
            Ok(())
        },
        // The neighbour's session outlived every case: still open, and closed by the probe
        // rather than by anything before it.
        async |s, world| {
            world.outcomes.print("sessions closed by", s);
            let mut calm = world.neighbour_ws.into_inner();
            let (code, reason) = close_after(&mut calm, &[]).await;
            assert_eq!(
                (code, reason.as_str()),
                (Some(CloseCode::Policy), PROBE_REASON)
            );
        },
    );
}

// ---------------------------------------------------------------------------------------
// Join requests

/// What a join body's token is.
#[derive(Debug, Clone)]
enum TokenChoice {
    Good,
    WrongSecret,
    Revoked,
    UnknownId,
    Garbage(String),
}

/// What a join body's CSR is.
#[derive(Debug, Clone)]
enum CsrChoice {
    /// A fresh machine's.
    Fresh,
    /// The machine of the world's `twin`, which joins again (a duplicate join).
    Twin,
    /// A valid CSR with one byte changed.
    Tampered(usize),
    Garbage(String),
}

#[derive(Debug, Clone)]
enum IdentifiersChoice {
    None,
    Fresh,
    Twin,
    Any(BTreeMap<String, String>),
}

/// One `POST /v1/join`.
#[derive(Debug, Clone)]
enum JoinBody {
    Request {
        token: TokenChoice,
        csr: CsrChoice,
        hostname: String,
        identifiers: IdentifiersChoice,
        /// A field the request does not have.
        extra: Option<(String, Value)>,
        /// A field given a value of the wrong type.
        wrong_type: Option<&'static str>,
    },
    /// Any JSON at all.
    Json(Value),
    /// Any bytes at all.
    Bytes(Vec<u8>),
}

fn join_body() -> impl Strategy<Value = JoinBody> {
    let token = prop_oneof![
        4 => Just(TokenChoice::Good),
        1 => Just(TokenChoice::WrongSecret),
        1 => Just(TokenChoice::Revoked),
        1 => Just(TokenChoice::UnknownId),
        1 => any_text().prop_map(TokenChoice::Garbage),
    ];
    let csr = prop_oneof![
        3 => Just(CsrChoice::Fresh),
        2 => Just(CsrChoice::Twin),
        1 => any::<usize>().prop_map(CsrChoice::Tampered),
        1 => any_text().prop_map(CsrChoice::Garbage),
    ];
    let hostname = prop_oneof![
        3 => "[a-z][a-z0-9-]{0,20}[a-z0-9]",
        1 => any_text(),
    ];
    let kinds = prop::sample::select(vec![
        "system-uuid",
        "board-serial",
        "chassis-serial",
        "system-serial",
        "mac:eth0",
        "mac:eth1",
        "tpm-ek",
        "favourite-colour",
    ]);
    let identifiers = prop_oneof![
        1 => Just(IdentifiersChoice::None),
        2 => Just(IdentifiersChoice::Fresh),
        2 => Just(IdentifiersChoice::Twin),
        2 => prop::collection::btree_map(kinds.prop_map(str::to_owned), any_text(), 0..5)
            .prop_map(IdentifiersChoice::Any),
    ];
    let extra =
        proptest::option::weighted(0.1, ("[a-zA-Z]{1,10}", any::<i64>().prop_map(Value::from)));
    let wrong_type = proptest::option::weighted(
        0.1,
        prop::sample::select(vec!["token", "csrPem", "hostname", "identifiers"]),
    );
    prop_oneof![
        8 => (token, csr, hostname, identifiers, extra, wrong_type).prop_map(
            |(token, csr, hostname, identifiers, extra, wrong_type)| JoinBody::Request {
                token, csr, hostname, identifiers, extra, wrong_type,
            }
        ),
        1 => prop_oneof![
            Just(Value::Null),
            any::<i64>().prop_map(Value::from),
            any_text().prop_map(Value::from),
            prop::collection::vec(any_text().prop_map(Value::from), 0..3).prop_map(Value::from),
        ].prop_map(JoinBody::Json),
        1 => prop::collection::vec(any::<u8>(), 0..256).prop_map(JoinBody::Bytes),
    ]
}

/// The join test's fixtures: tokens of every standing, and a machine that joins again.
struct JoinWorld {
    good: String,
    revoked: String,
    twin: Machine,
    /// Answers by status and code.
    outcomes: Tally,
}

/// Every node as the API lists it, and every join token's uses: what a refused join must
/// leave exactly as it was.
async fn join_snapshot(s: &TestServer) -> (BTreeMap<String, Value>, Value) {
    let data = s
        .admin(
            "{ nodes(first: 1000) { edges { node { id version identityGeneration hostname } } } joinTokens(first: 1000) { nodes { id uses revokedAt } } }",
            json!({}),
        )
        .await;
    let nodes = data["nodes"]["edges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["node"]["id"].as_str().unwrap().to_owned(),
                e["node"].clone(),
            )
        })
        .collect();
    (nodes, data["joinTokens"]["nodes"].clone())
}

fn join_request_body(world: &JoinWorld, body: &JoinBody) -> Vec<u8> {
    let JoinBody::Request {
        token,
        csr,
        hostname,
        identifiers,
        extra,
        wrong_type,
    } = body
    else {
        return match body {
            JoinBody::Json(value) => value.to_string().into_bytes(),
            JoinBody::Bytes(bytes) => bytes.clone(),
            JoinBody::Request { .. } => unreachable!(),
        };
    };
    let (good_id, _) = world.good.split_once('.').unwrap();
    let token = match token {
        TokenChoice::Good => world.good.clone(),
        TokenChoice::WrongSecret => format!("{good_id}.{}", "0".repeat(64)),
        TokenChoice::Revoked => world.revoked.clone(),
        TokenChoice::UnknownId => format!("jt_{}.abc", uuid::Uuid::new_v4().simple()),
        TokenChoice::Garbage(text) => text.clone(),
    };
    let fresh = Machine::new();
    let csr = match csr {
        CsrChoice::Fresh => fresh.csr(),
        CsrChoice::Twin => world.twin.csr(),
        CsrChoice::Tampered(at) => {
            let mut bytes = fresh.csr().into_bytes();
            // Inside the base64 body (past the BEGIN line), so the PEM still parses.
            let at = 40 + at % (bytes.len() - 80);
            bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
            String::from_utf8(bytes).unwrap()
        }
        CsrChoice::Garbage(text) => text.clone(),
    };
    let identifiers = match identifiers {
        IdentifiersChoice::None => None,
        IdentifiersChoice::Fresh => Some(fresh.identifiers.clone()),
        IdentifiersChoice::Twin => Some(world.twin.identifiers.clone()),
        IdentifiersChoice::Any(map) => Some(map.clone()),
    };
    let mut request = json!({ "token": token, "csrPem": csr, "hostname": hostname });
    if let Some(identifiers) = identifiers {
        request["identifiers"] = json!(identifiers);
    }
    if let Some((field, value)) = extra {
        request[field.as_str()] = value.clone();
    }
    if let Some(field) = wrong_type {
        request[*field] = json!(7);
    }
    request.to_string().into_bytes()
}

#[test]
fn fuzz_join_requests_are_admitted_or_refused_in_words() {
    run_against_servers(
        JOIN_CASES,
        "proptest-regressions/fuzz/join_requests.txt",
        join_body(),
        async |s| {
            let (site, pool) = s.site_and_pool(8).await;
            let good = s.join_token(&site, Some(&pool), 100_000).await;
            let revoked = s.join_token(&site, Some(&pool), 10).await;
            s.admin(
                "mutation($id: ID!) { revokeJoinToken(input: {id: $id}) { joinToken { revokedAt } } }",
                json!({ "id": revoked.split_once('.').unwrap().0 }),
            )
            .await;
            JoinWorld {
                good,
                revoked,
                twin: Machine::new(),
                outcomes: Tally::default(),
            }
        },
        async |s, world, body| {
            let (nodes_before, tokens_before) = join_snapshot(s).await;
            let response = raw_daemon::http(&s.ca_pem(), None)
                .post(format!("{}/v1/join", s.gateway_url()))
                .header("content-type", "application/json")
                .body(join_request_body(world, &body))
                .send()
                .await
                .map_err(|err| TestCaseError::fail(format!("no answer: {err}")))?;
            let status = response.status().as_u16();
            let text = response.text().await.unwrap_or_default();
            let answer: Value = serde_json::from_str(&text)
                .map_err(|_| TestCaseError::fail(format!("{status}, not JSON: {}", cut(&text))))?;
            let (nodes_after, tokens_after) = join_snapshot(s).await;
            world.outcomes.add(format!(
                "{status} {}",
                answer["code"].as_str().unwrap_or_default()
            ));
            if status == 200 {
                let issued: bc_core::protocol::IssuedIdentity = serde_json::from_value(answer)
                    .map_err(|err| TestCaseError::fail(format!("not an identity: {err}")))?;
                // A new node, or the same machine again on its node (a duplicate join is a
                // re-join in place, with the next identity generation): nothing else moved.
                let id = &issued.node_id;
                match nodes_before.get(id) {
                    Some(before) => prop_assert_eq!(
                        nodes_after[id]["identityGeneration"].as_i64(),
                        before["identityGeneration"].as_i64().map(|g| g + 1)
                    ),
                    None => prop_assert!(nodes_after.contains_key(id)),
                }
                for (other, before) in &nodes_before {
                    if other != id {
                        prop_assert_eq!(&nodes_after[other], before, "node {} changed", other);
                    }
                }
                prop_assert!(nodes_after.len() <= nodes_before.len() + 1);
            } else {
                let code = answer["code"].as_str().unwrap_or_default();
                let expected = match status {
                    400 | 413 => "BAD_USER_INPUT",
                    401 => "UNAUTHENTICATED",
                    _ => "",
                };
                prop_assert_eq!(code, expected, "status {}: {}", status, cut(&text));
                let message = answer["message"].as_str().unwrap_or_default();
                prop_assert!(!message.is_empty(), "no message: {}", cut(&text));
                prop_assert!(
                    message.len() <= MAX_MESSAGE_BYTES,
                    "a {}-byte message: {}",
                    message.len(),
                    cut(message)
                );
                prop_assert_eq!(nodes_after, nodes_before, "a refused join changed nodes");
                prop_assert_eq!(tokens_after, tokens_before, "a refused join spent a token");
            }
            Ok(())
        },
        async |s, world| world.outcomes.print("join answers", s),
    );
}

// ---------------------------------------------------------------------------------------
// GraphQL mutations

/// Which node (or other object) an operation names.
#[derive(Debug, Clone)]
enum Target {
    /// The n-th node of the world (modulo their number).
    Node(usize),
    /// A well-formed id of nothing.
    Missing,
    /// An id of another kind (a site's id where a node's is due).
    WrongKind,
    Garbage(String),
}

/// The `version` an operation passes.
#[derive(Debug, Clone)]
enum VersionChoice {
    Current,
    Stale,
    Any(i64),
}

/// A number an `Int` input receives: small, at the edges of `Int` and beyond, or not an
/// integer at all.
fn any_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (-3i64..100).prop_map(Value::from),
        1 => prop::sample::select(vec![
            i64::from(i32::MAX), i64::from(i32::MIN), i64::MAX, i64::MIN, 86_400 * 366, 1_000_001,
        ]).prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_filter_map("finite", serde_json::Number::from_f64).prop_map(Value::Number),
        1 => "[0-9]{1,4}".prop_map(Value::from),
    ]
}

fn any_time() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!("2030-01-01T00:00:00Z")),
        Just(json!("+262143-12-31T23:59:59Z")),
        Just(json!("1970-01-01T00:00:00Z")),
        any_text().prop_map(Value::from),
    ]
}

/// One mutation with its (fuzzed) input.
#[derive(Debug, Clone)]
enum Op {
    /// A mutation taking `input: {id, version, …}` on a node, with the other fields.
    OnNode {
        mutation: &'static str,
        input_type: &'static str,
        node: Target,
        version: VersionChoice,
        fields: BTreeMap<&'static str, Value>,
    },
    Enroll {
        site: Target,
        hostname: String,
        identifiers: Vec<(String, String)>,
    },
    CreateSite {
        name: String,
        kind: &'static str,
    },
    CreatePool {
        site: Target,
        name: String,
        kind: &'static str,
        gpus: Value,
        model: Option<String>,
    },
    CreateJoinToken {
        site: Target,
        max_uses: Value,
        expires: Value,
        description: String,
    },
    SendCommand {
        nodes: Vec<Target>,
        kind: &'static str,
        params: Value,
        timeout: Option<Value>,
        force: bool,
    },
    CancelCommand(Target),
    CreateTenant(String),
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        6 => (0usize..16).prop_map(Target::Node),
        1 => Just(Target::Missing),
        1 => Just(Target::WrongKind),
        1 => any_text().prop_map(Target::Garbage),
    ]
}

fn version() -> impl Strategy<Value = VersionChoice> {
    prop_oneof![
        4 => Just(VersionChoice::Current),
        1 => Just(VersionChoice::Stale),
        1 => any_number().prop_filter_map("an integer", |v| v.as_i64()).prop_map(VersionChoice::Any),
    ]
}

type Fields = BTreeMap<&'static str, Value>;

fn on_node(
    mutation: &'static str,
    input_type: &'static str,
    fields: impl Strategy<Value = Fields> + 'static,
) -> BoxedStrategy<Op> {
    (target(), version(), fields)
        .prop_map(move |(node, version, fields)| Op::OnNode {
            mutation,
            input_type,
            node,
            version,
            fields,
        })
        .boxed()
}

/// A `reason` field, of any text.
fn reason() -> impl Strategy<Value = Fields> {
    any_text().prop_map(|r| BTreeMap::from([("reason", json!(r))]))
}

fn node_op() -> impl Strategy<Value = Op> {
    let moves = prop_oneof![
        5 => prop::sample::select(vec![
            "ADOPT", "INSPECT", "COMMISSION", "PROVIDE", "DEPLOY", "FINISH_DEPLOY", "RELEASE",
            "FINISH_RELEASE", "RESCUE", "UNRESCUE", "RETIRE", "FINISH_RETIRE", "FAIL", "RECOVER",
        ])
        .prop_map(str::to_owned),
        1 => any_text(),
    ];
    prop::strategy::Union::new(vec![
        on_node("cordonNode", "CordonNodeInput", reason()),
        on_node("uncordonNode", "UncordonNodeInput", Just(Fields::new())),
        on_node(
            "drainNode",
            "DrainNodeInput",
            (reason(), proptest::option::of(any_time())).prop_map(|(mut fields, deadline)| {
                if let Some(deadline) = deadline {
                    fields.insert("deadline", deadline);
                }
                fields
            }),
        ),
        on_node(
            "taintNode",
            "TaintNodeInput",
            (
                any_text(),
                any_text(),
                prop::sample::select(vec!["NO_SCHEDULE", "PREFER_NO_SCHEDULE", "EVICT"]),
            )
                .prop_map(|(key, value, effect)| {
                    BTreeMap::from([
                        ("key", json!(key)),
                        ("value", json!(value)),
                        ("effect", json!(effect)),
                    ])
                }),
        ),
        on_node(
            "untaintNode",
            "UntaintNodeInput",
            any_text().prop_map(|key| BTreeMap::from([("key", json!(key))])),
        ),
        on_node(
            "labelNode",
            "LabelNodeInput",
            (
                prop::collection::vec((any_text(), any_text()), 0..3),
                prop::collection::vec(any_text(), 0..2),
            )
                .prop_map(|(set, remove)| {
                    let set: Vec<Value> = set
                        .into_iter()
                        .map(|(key, value)| json!({"key": key, "value": value}))
                        .collect();
                    BTreeMap::from([("set", json!(set)), ("remove", json!(remove))])
                }),
        ),
        on_node("adoptNode", "AdoptNodeInput", Just(Fields::new())),
        on_node("retireNode", "RetireNodeInput", reason()),
        on_node(
            "transitionNode",
            "TransitionNodeInput",
            (moves, proptest::option::of(any_text())).prop_map(|(mv, reason)| {
                let mut fields = BTreeMap::from([("move", json!(mv))]);
                if let Some(reason) = reason {
                    fields.insert("reason", json!(reason));
                }
                fields
            }),
        ),
        on_node("revokeNodeIdentity", "RevokeNodeIdentityInput", reason()),
        on_node("deleteNode", "DeleteNodeInput", Just(Fields::new())),
    ])
}

/// A machine identifier's name: a known kind mostly, anything sometimes.
fn identifier_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "system-uuid", "board-serial", "chassis-serial", "system-serial", "mac", "mac:eth0", "tpm-ek",
        ])
        .prop_map(str::to_owned),
        1 => any_text(),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let kinds = prop::sample::select(vec![
        "INVENTORY_REFRESH",
        "DIAG_NVML",
        "LOGS_COLLECT",
        "GPU_RESET",
        "NODE_REBOOT",
        "SELF_DESTRUCT",
    ]);
    let params = prop_oneof![
        Just(Value::Null),
        Just(json!({})),
        Just(json!({"level": 2})),
        (any_text(), any_number()).prop_map(|(key, value)| json!({ key: value })),
        any_number(),
        prop::collection::vec(any_text(), 0..3).prop_map(|sources| json!({"sources": sources})),
    ];
    prop_oneof![
        10 => node_op(),
        1 => (target(), any_text(), prop::collection::vec((identifier_name(), any_text()), 0..4))
            .prop_map(|(site, hostname, identifiers)| Op::Enroll { site, hostname, identifiers }),
        1 => (any_text(), prop::sample::select(vec!["PLATFORM", "CUSTOM", "MOON"]))
            .prop_map(|(name, kind)| Op::CreateSite { name, kind }),
        1 => (
            target(),
            any_text(),
            prop::sample::select(vec!["METAL_HOST", "VPS_HOST", "PROVIDER", "METAL_DEDICATED"]),
            any_number(),
            proptest::option::of(any_text()),
        )
            .prop_map(|(site, name, kind, gpus, model)| Op::CreatePool { site, name, kind, gpus, model }),
        1 => (target(), any_number(), any_number(), any_text()).prop_map(
            |(site, max_uses, expires, description)| Op::CreateJoinToken { site, max_uses, expires, description }
        ),
        3 => (
            prop::collection::vec(target(), 0..3),
            kinds,
            params,
            proptest::option::of(any_number()),
            any::<bool>(),
        )
            .prop_map(|(nodes, kind, params, timeout, force)| Op::SendCommand { nodes, kind, params, timeout, force }),
        2 => target().prop_map(Op::CancelCommand),
        1 => any_text().prop_map(Op::CreateTenant),
    ]
}

/// The GraphQL test's fixtures: a site, and nodes in several states.
struct GraphqlWorld {
    site: String,
    nodes: Vec<String>,
    /// Answers by mutation and code.
    outcomes: Tally,
}

/// Everything a mutation could change, as the API lists it: a refused one must leave all of
/// it exactly as it was.
async fn graphql_snapshot(s: &TestServer) -> Value {
    s.admin(
        "{ nodes(first: 1000) { edges { node { id version } } } sites(first: 1000) { nodes { id } } pools(first: 1000) { nodes { id } } tenants(first: 1000) { nodes { id } }
           joinTokens(first: 1000) { nodes { id uses revokedAt } } commands(first: 1000) { edges { node { id status } } } }",
        json!({}),
    )
    .await
}

/// The id `target` names, as an id of `kind` (`node`, `site`, `command`).
fn resolve(world: &GraphqlWorld, snapshot: &Value, target: &Target, kind: &str) -> String {
    match target {
        Target::Node(n) => match kind {
            "site" => world.site.clone(),
            "command" => {
                let commands = snapshot["commands"]["edges"].as_array().unwrap();
                match commands.get(n % commands.len().max(1)) {
                    Some(edge) => edge["node"]["id"].as_str().unwrap().to_owned(),
                    None => format!("cmd_{}", uuid::Uuid::now_v7().simple()),
                }
            }
            _ => world.nodes[n % world.nodes.len()].clone(),
        },
        Target::Missing => format!("{kind}_{}", uuid::Uuid::now_v7().simple()),
        Target::WrongKind => match kind {
            "node" => world.site.clone(),
            _ => world.nodes[0].clone(),
        },
        Target::Garbage(text) => text.clone(),
    }
}

/// The mutation document and its variables.
fn document(world: &GraphqlWorld, snapshot: &Value, op: &Op) -> (String, Value) {
    let id = |target: &Target, kind: &str| resolve(world, snapshot, target, kind);
    let with_input = |mutation: &str, input_type: &str, input: Value| {
        (
            format!(
                "mutation($input: {input_type}!) {{ {mutation}(input: $input) {{ __typename }} }}"
            ),
            json!({ "input": input }),
        )
    };
    match op {
        Op::OnNode {
            mutation,
            input_type,
            node,
            version,
            fields,
        } => {
            let node = id(node, "node");
            let current = snapshot["nodes"]["edges"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["node"]["id"] == node.as_str())
                .and_then(|e| e["node"]["version"].as_i64())
                .unwrap_or(1);
            let version = match version {
                VersionChoice::Current => current,
                VersionChoice::Stale => current - 1,
                VersionChoice::Any(v) => *v,
            };
            let mut input = json!({ "id": node, "version": version });
            for (field, value) in fields {
                input[*field] = value.clone();
            }
            with_input(mutation, input_type, input)
        }
        Op::Enroll {
            site,
            hostname,
            identifiers,
        } => {
            let identifiers: Vec<Value> = identifiers
                .iter()
                .map(|(name, value)| json!({ "name": name, "value": value }))
                .collect();
            with_input(
                "enrollNode",
                "EnrollNodeInput",
                json!({ "siteId": id(site, "site"), "hostname": hostname, "identifiers": identifiers }),
            )
        }
        Op::CreateSite { name, kind } => with_input(
            "createSite",
            "CreateSiteInput",
            json!({ "name": name, "kind": kind }),
        ),
        Op::CreatePool {
            site,
            name,
            kind,
            gpus,
            model,
        } => with_input(
            "createPool",
            "CreatePoolInput",
            json!({ "siteId": id(site, "site"), "name": name, "kind": kind,
                    "expectedGpuCount": gpus, "expectedGpuModel": model }),
        ),
        Op::CreateJoinToken {
            site,
            max_uses,
            expires,
            description,
        } => with_input(
            "createJoinToken",
            "CreateJoinTokenInput",
            json!({ "siteId": id(site, "site"), "maxUses": max_uses,
                    "expiresInSeconds": expires, "description": description }),
        ),
        Op::SendCommand {
            nodes,
            kind,
            params,
            timeout,
            force,
        } => {
            let node_ids: Vec<String> = nodes.iter().map(|n| id(n, "node")).collect();
            let mut input =
                json!({ "nodeIds": node_ids, "kind": kind, "params": params, "force": force });
            if let Some(timeout) = timeout {
                input["timeoutSeconds"] = timeout.clone();
            }
            with_input("sendCommand", "SendCommandInput", input)
        }
        Op::CancelCommand(command) => (
            "mutation($id: ID!) { cancelCommand(input: {id: $id}) { __typename } }".into(),
            json!({ "id": id(command, "command") }),
        ),
        Op::CreateTenant(name) => (
            "mutation($name: String!) { createTenant(input: {name: $name}) { __typename } }".into(),
            json!({ "name": name }),
        ),
    }
}

/// The codes a refusal of a client's input may carry. `INTERNAL` (a server fault) and
/// `FORBIDDEN` (the test runs as a platform admin) are never right here.
const REFUSAL_CODES: &[&str] = &["BAD_USER_INPUT", "NOT_FOUND", "CONFLICT", "INVALID_STATE"];

#[test]
fn fuzz_graphql_mutations_succeed_or_refuse_with_a_code_and_change_nothing() {
    run_against_servers(
        GRAPHQL_CASES,
        "proptest-regressions/fuzz/graphql_mutations.txt",
        prop::collection::vec(op(), 1..4),
        async |s| {
            let place = crate::common::site_and_pool(s).await;
            let mut nodes = Vec::new();
            for state in [
                bc_core::axes::ProvisionState::Adopting,
                bc_core::axes::ProvisionState::Adopted,
                bc_core::axes::ProvisionState::Enrolling,
                bc_core::axes::ProvisionState::Deployed,
                bc_core::axes::ProvisionState::Failed,
            ] {
                let mut record = crate::common::node_record(s, &place, state);
                if state == bc_core::axes::ProvisionState::Failed {
                    record.failed_from = Some(bc_core::axes::ProvisionState::Deployed);
                    record.maintenance = true;
                }
                s.insert_node(&record).await;
                nodes.push(record.id.to_string());
            }
            GraphqlWorld {
                site: place.0.to_string(),
                nodes,
                outcomes: Tally::default(),
            }
        },
        async |s, world, ops| {
            for op in ops {
                let before = graphql_snapshot(s).await;
                let (query, variables) = document(world, &before, &op);
                let response = reqwest::Client::new()
                    .post(format!("{}/graphql", s.url()))
                    .bearer_auth(s.admin_token())
                    .json(&json!({ "query": query, "variables": variables }))
                    .send()
                    .await
                    .map_err(|err| TestCaseError::fail(format!("no answer: {err}")))?;
                let status = response.status().as_u16();
                let text = response.text().await.unwrap_or_default();
                prop_assert_eq!(status, 200, "{}", cut(&text));
                let body: Value = serde_json::from_str(&text)
                    .map_err(|_| TestCaseError::fail(format!("not JSON: {}", cut(&text))))?;
                let mutation = query
                    .split(['{', '('])
                    .nth(2)
                    .unwrap_or_default()
                    .trim()
                    .to_owned();
                let Some(errors) = body["errors"].as_array().filter(|e| !e.is_empty()) else {
                    world.outcomes.add(format!("{mutation} ok"));
                    continue;
                };
                world.outcomes.add(format!(
                    "{mutation} {}",
                    errors[0]["extensions"]["code"].as_str().unwrap_or("(none)")
                ));
                for error in errors {
                    let code = error["extensions"]["code"].as_str().unwrap_or("(none)");
                    prop_assert!(
                        REFUSAL_CODES.contains(&code),
                        "{} answered {}: {}",
                        query,
                        code,
                        cut(&error.to_string())
                    );
                    let message = error["message"].as_str().unwrap_or_default();
                    prop_assert!(!message.is_empty());
                    prop_assert!(
                        message.len() <= MAX_MESSAGE_BYTES,
                        "a {}-byte message: {}",
                        message.len(),
                        cut(message)
                    );
                }
                let after = graphql_snapshot(s).await;
                prop_assert_eq!(after, before, "a refused {} changed what is stored", query);
            }
            Ok(())
        },
        async |s, world| world.outcomes.print("mutation answers", s),
    );
}
