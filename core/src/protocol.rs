//! `bcd/v1`: the wire types between a node's daemon and the control plane.
//!
//! Join and renewal are JSON over HTTPS (`POST /v1/join`, `POST /v1/renew`); the session is a
//! WebSocket over TLS (`GET /v1/session`, client certificate required) carrying one JSON
//! message per text frame, tagged by `type`. `PROTOCOL.md` at the repository root is the prose
//! version of this module.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The protocol name, sent as the WebSocket subprotocol.
pub const PROTOCOL: &str = "bcd.v1";

/// The largest frame the gateway accepts. Inventory sections are the largest messages and
/// stay far below this; anything bigger is a broken or hostile daemon.
pub const MAX_FRAME_BYTES: usize = 1024 * 1024;

/// `POST /v1/join`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequest {
    /// `<jt_…>.<secret>`, as `createJoinToken` printed it.
    pub token: String,
    /// A PKCS#10 certificate signing request (PEM) for a key the daemon generated itself.
    pub csr_pem: String,
    pub hostname: String,
    /// Machine identifiers for the hardware key (system UUID, board serial, MACs, …).
    #[serde(default)]
    pub identifiers: BTreeMap<String, String>,
}

/// The answer to a join or a renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IssuedIdentity {
    pub node_id: String,
    pub identity_generation: i64,
    /// The node certificate (PEM), valid [`CERTIFICATE_LIFETIME_HOURS`].
    pub certificate_pem: String,
    /// The control plane's CA (PEM): the root the daemon trusts for the gateway.
    pub ca_certificate_pem: String,
    pub expires_at: DateTime<Utc>,
    /// Renew after this time (two thirds of the lifetime), before the certificate expires.
    pub renew_after: DateTime<Utc>,
}

/// How long a node certificate is valid (the seed: 24 hours).
pub const CERTIFICATE_LIFETIME_HOURS: i64 = 24;

/// `POST /v1/renew` (client certificate required): a new CSR, signed for the same identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    pub csr_pem: String,
}

/// An error answer of the HTTPS endpoints: a stable code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    pub code: String,
    pub message: String,
}

/// Daemon → gateway.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
pub enum DaemonMessage {
    /// The first message of every session.
    #[serde(rename_all = "camelCase")]
    Hello {
        daemon_version: String,
        /// The hash of each inventory section the daemon holds, by section name.
        #[serde(default)]
        inventory_hashes: BTreeMap<String, String>,
        /// The spec generation the daemon last converged.
        observed_generation: i64,
    },
    /// "I am alive"; every `heartbeatIntervalSecs`.
    #[serde(rename_all = "camelCase")]
    Heartbeat { seq: u64 },
    /// The daemon started a command.
    #[serde(rename_all = "camelCase")]
    CommandStarted { id: String },
    /// A command ended on the node. `output` is bounded (64 KiB); `result` is structured
    /// (for `diag.nvml`: `{"passed": bool, "failures": [...]}`).
    #[serde(rename_all = "camelCase")]
    CommandResult {
        id: String,
        outcome: crate::command::Outcome,
        exit_code: Option<i32>,
        #[serde(default)]
        output: String,
        result: Option<serde_json::Value>,
    },
    /// The daemon converged spec `generation` (reported as the node's `observedGeneration`).
    #[serde(rename_all = "camelCase")]
    Converged { generation: i64 },
    /// One inventory section the gateway asked for in `welcome.wantSections`. `hash` must be
    /// [`section_hash`] of `content`.
    #[serde(rename_all = "camelCase")]
    Inventory {
        section: String,
        hash: String,
        content: serde_json::Value,
    },
}

/// Why a frame is not a [`DaemonMessage`]. Every frame a daemon sends goes through
/// [`DaemonMessage::decode`], and whatever the bytes, the answer is a message or one of these;
/// the gateway closes the session with its text (`Display`) and counts it by
/// [`FrameError::reason`]. The text never repeats more than [`ECHO_BYTES`] of what the daemon
/// sent, so a hostile frame cannot fill logs or close frames with itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("the frame is {bytes} bytes; the most bcd/v1 accepts is {MAX_FRAME_BYTES}")]
    TooLarge { bytes: usize },
    #[error("the frame is not UTF-8 (invalid byte at offset {valid_up_to})")]
    NotUtf8 { valid_up_to: usize },
    #[error("the frame is not JSON: {0}")]
    NotJson(String),
    #[error("the frame is not a JSON object with a string `type`")]
    NoType,
    #[error("unknown message type `{0}`")]
    UnknownType(String),
    #[error("malformed `{message_type}` message: {detail}")]
    Malformed {
        message_type: &'static str,
        detail: String,
    },
}

/// The most bytes of a daemon's own text (a type, a field name) a [`FrameError`] repeats.
pub const ECHO_BYTES: usize = 64;

impl FrameError {
    /// A stable label for metrics (`bc_gateway_frames_rejected_total{reason}`).
    pub fn reason(&self) -> &'static str {
        match self {
            FrameError::TooLarge { .. } => "too_large",
            FrameError::NotUtf8 { .. } => "not_utf8",
            FrameError::NotJson(_) => "not_json",
            FrameError::NoType => "no_type",
            FrameError::UnknownType(_) => "unknown_type",
            FrameError::Malformed { .. } => "malformed",
        }
    }
}

/// `text` cut to [`ECHO_BYTES`] on a character boundary, marked when cut.
fn echo(text: &str) -> String {
    if text.len() <= ECHO_BYTES {
        return text.to_owned();
    }
    let mut end = ECHO_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// serde_json's error in words, without its quotes of the input cut short: serde names an
/// unknown field or variant in full, which may be as long as the frame.
fn serde_detail(err: &serde_json::Error) -> String {
    let text = err.to_string();
    let cut = echo(&text);
    if cut.len() < text.len() {
        format!("{cut} (at line {}, column {})", err.line(), err.column())
    } else {
        text
    }
}

impl DaemonMessage {
    /// Every `type` a daemon may send, as spelled on the wire.
    pub const TYPES: &'static [&'static str] = &[
        "hello",
        "heartbeat",
        "commandStarted",
        "commandResult",
        "converged",
        "inventory",
    ];

    /// Decodes one frame: the only way the gateway reads what a daemon sent. Pure and total:
    /// any bytes give a message or a [`FrameError`], never a panic (serde_json's recursion
    /// limit bounds nesting, [`MAX_FRAME_BYTES`] bounds the size).
    pub fn decode(frame: &[u8]) -> Result<DaemonMessage, FrameError> {
        if frame.len() > MAX_FRAME_BYTES {
            return Err(FrameError::TooLarge { bytes: frame.len() });
        }
        let text = std::str::from_utf8(frame).map_err(|err| FrameError::NotUtf8 {
            valid_up_to: err.valid_up_to(),
        })?;
        // Parsed as a value first, so that a frame of the wrong type is told apart from a
        // frame of a known type with bad fields: the daemon's author needs to know which.
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|err| FrameError::NotJson(serde_detail(&err)))?;
        let Some(tag) = value.get("type").and_then(serde_json::Value::as_str) else {
            return Err(FrameError::NoType);
        };
        let Some(message_type) = Self::TYPES.iter().copied().find(|t| *t == tag) else {
            return Err(FrameError::UnknownType(echo(tag)));
        };
        serde_json::from_value(value).map_err(|err| FrameError::Malformed {
            message_type,
            detail: serde_detail(&err),
        })
    }

    /// The frame's text, as [`DaemonMessage::decode`] reads it back.
    pub fn encode(&self) -> String {
        // Serialising cannot fail: every map has string keys and serde_json's numbers hold
        // no NaN or infinity.
        serde_json::to_string(self).expect("a daemon message always serialises")
    }
}

/// The hash of an inventory section: SHA-256 (hex) over its canonical JSON form (object keys
/// sorted, no insignificant whitespace), so equal content always hashes equal whatever order
/// the daemon wrote it in.
pub fn section_hash(content: &serde_json::Value) -> String {
    canonical_section(content).hash
}

/// An inventory section's canonical JSON text and its hash ([`section_hash`]), made by one
/// serialisation: the gateway checks a daemon's hash and then keeps the very text it hashed.
pub fn canonical_section(content: &serde_json::Value) -> CanonicalSection {
    use sha2::{Digest, Sha256};
    // serde_json's map is ordered by key (the `preserve_order` feature is off), so
    // serialising a `Value` is canonical. It cannot fail: a `Value`'s keys are strings.
    let text = content.to_string();
    let hash = hex::encode(Sha256::digest(text.as_bytes()));
    CanonicalSection { text, hash }
}

/// Whether a string or key anywhere in `value` holds a NUL character, which PostgreSQL's
/// `jsonb` cannot store. Asked of the parsed value, not of its text: a string holding a
/// backslash and then `u0000` (six characters, none of them NUL) is written `\\u0000`, which
/// contains a NUL's escape `\u0000`. (serde_json stops parsing at 128 levels of nesting, so
/// this recursion is bounded.)
pub fn holds_nul(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::String(text) => text.contains('\0'),
        Value::Array(items) => items.iter().any(holds_nul),
        Value::Object(fields) => fields
            .iter()
            .any(|(key, field)| key.contains('\0') || holds_nul(field)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// What [`canonical_section`] makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalSection {
    /// The section as canonical JSON.
    pub text: String,
    /// SHA-256 (hex) of `text`.
    pub hash: String,
}

/// Gateway → daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum GatewayMessage {
    /// The answer to `hello`.
    #[serde(rename_all = "camelCase")]
    Welcome {
        /// This session's epoch; a session with a higher epoch replaces this one.
        epoch: i64,
        gateway_id: String,
        /// The inventory sections whose hashes the control plane has not seen.
        want_sections: Vec<String>,
        heartbeat_interval_secs: u64,
        spec: NodeSpec,
    },
    /// Run a command. Commands of one lane arrive one at a time.
    #[serde(rename_all = "camelCase")]
    Command {
        id: String,
        kind: crate::command::CommandKind,
        params: serde_json::Value,
        timeout_secs: i64,
    },
    /// Stop a command that was sent (it was cancelled or timed out).
    #[serde(rename_all = "camelCase")]
    Cancel { id: String },
    /// The desired state changed: converge to it and report `converged`.
    #[serde(rename_all = "camelCase")]
    Spec { spec: NodeSpec },
    /// The gateway is closing the session; the daemon should reconnect unless told not to.
    #[serde(rename_all = "camelCase")]
    Goodbye { reason: String, reconnect: bool },
}

/// The desired state the daemon converges to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    pub generation: i64,
}

/// The inventory sections of NodeInventory v1, in the order the daemon reports them.
pub const INVENTORY_SECTIONS: &[&str] = &[
    "system", "gpus", "cpu", "memory", "network", "disks", "drivers",
];

/// Why the gateway closed a session, as sent in the WebSocket close frame.
pub mod close {
    /// A newer session of the same node took over.
    pub const SUPERSEDED: &str = "superseded by a newer session";
    /// The node's identity was revoked or replaced.
    pub const IDENTITY_REVOKED: &str = "identity revoked";
    /// The server is shutting down; reconnect elsewhere or later.
    pub const SHUTDOWN: &str = "gateway shutting down";
    /// The database gave the gateway no connection in time (`UNAVAILABLE`); reconnect.
    pub const DATABASE_BUSY: &str = "database busy";
    /// Something failed on the server's side (`INTERNAL`); reconnect.
    pub const INTERNAL_ERROR: &str = "internal error";
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NUL anywhere in a section (a string, a key, deep down) is found in the parsed value;
    /// text that only looks like a NUL's escape is not one.
    #[test]
    fn a_nul_is_found_in_strings_and_keys_and_nowhere_else() {
        let parse = |text: &str| -> serde_json::Value {
            serde_json::from_str(text).unwrap_or_else(|err| panic!("{text}: {err}"))
        };
        // JSON text, in raw strings: `\u0000` is JSON's escape of a NUL, `\\u0000` a
        // backslash and then `u0000`.
        for (text, holds) in [
            (r#"{"model":"epyc"}"#, false),
            (r#"{"model":"epyc \\u0000"}"#, false),
            (r#"{"model \\u0000":"epyc"}"#, false),
            (r#"{"model":"epyc \u0000"}"#, true),
            (r#"{"model \u0000":1}"#, true),
            (
                r#"{"gpus":[{"uuid":"GPU-1"},{"serial":["x","\u0000"]}]}"#,
                true,
            ),
            (r#"[1, true, null, 2.5, "\u0000"]"#, true),
        ] {
            assert_eq!(holds_nul(&parse(text)), holds, "{text}");
        }
    }

    /// The canonical text is what the hash is taken over, and parses back to the value.
    #[test]
    fn a_canonical_section_is_the_text_its_hash_is_of() {
        use sha2::{Digest, Sha256};
        let content: serde_json::Value =
            serde_json::from_str(r#"{ "b": [1, "\\u0000"], "a": {"y": 2.5, "x": null} }"#)
                .expect("json");
        let canonical = canonical_section(&content);
        assert_eq!(
            canonical.text,
            r#"{"a":{"x":null,"y":2.5},"b":[1,"\\u0000"]}"#
        );
        assert_eq!(canonical.hash, section_hash(&content));
        assert_eq!(
            canonical.hash,
            hex::encode(Sha256::digest(canonical.text.as_bytes()))
        );
        let reparsed: serde_json::Value = serde_json::from_str(&canonical.text).expect("json");
        assert_eq!(reparsed, content);
    }

    #[test]
    fn messages_have_a_stable_wire_form() {
        let hello = DaemonMessage::Hello {
            daemon_version: "0.1.0".into(),
            inventory_hashes: BTreeMap::from([("gpus".into(), "abc".into())]),
            observed_generation: 0,
        };
        assert_eq!(
            serde_json::to_string(&hello).ok().as_deref(),
            Some(
                r#"{"type":"hello","daemonVersion":"0.1.0","inventoryHashes":{"gpus":"abc"},"observedGeneration":0}"#
            )
        );
        assert_eq!(
            serde_json::from_str::<DaemonMessage>(r#"{"type":"heartbeat","seq":7}"#).ok(),
            Some(DaemonMessage::Heartbeat { seq: 7 })
        );
        let a: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":[1,2]}"#).expect("json");
        let b: serde_json::Value =
            serde_json::from_str(r#"{ "a": [1, 2], "b": 1 }"#).expect("json");
        assert_eq!(section_hash(&a), section_hash(&b));
        assert_ne!(
            section_hash(&a),
            section_hash(&serde_json::json!({"a": [2, 1], "b": 1}))
        );
        for garbage in [
            r#"{"type":"reboot"}"#,
            r#"{"type":"heartbeat"}"#,
            r#"{"type":"heartbeat","seq":1,"x":2}"#,
            "nope",
        ] {
            assert!(
                serde_json::from_str::<DaemonMessage>(garbage).is_err(),
                "{garbage}"
            );
        }
    }

    #[test]
    fn each_kind_of_bad_frame_has_its_own_error() {
        let decode = |text: &str| DaemonMessage::decode(text.as_bytes());
        assert_eq!(
            decode(r#"{"type":"heartbeat","seq":7}"#),
            Ok(DaemonMessage::Heartbeat { seq: 7 })
        );
        assert_eq!(
            DaemonMessage::decode(&[b'"', 0xff, b'"']),
            Err(FrameError::NotUtf8 { valid_up_to: 1 })
        );
        assert!(matches!(decode("{{{"), Err(FrameError::NotJson(_))));
        assert!(matches!(decode(""), Err(FrameError::NotJson(_))));
        for no_type in ["[]", "7", r#"{"seq":1}"#, r#"{"type":7}"#] {
            assert_eq!(decode(no_type), Err(FrameError::NoType), "{no_type}");
        }
        assert_eq!(
            decode(r#"{"type":"selfDestruct"}"#),
            Err(FrameError::UnknownType("selfDestruct".into()))
        );
        let Err(FrameError::Malformed {
            message_type,
            detail,
        }) = decode(r#"{"type":"heartbeat","seq":1,"evil":true}"#)
        else {
            panic!("an unknown field is a malformed heartbeat");
        };
        assert_eq!(message_type, "heartbeat");
        assert!(detail.contains("evil"), "{detail}");
        // Every listed type is one the decoder knows: with its fields missing it is malformed,
        // not unknown.
        for message_type in DaemonMessage::TYPES {
            let frame = format!(r#"{{"type":"{message_type}"}}"#);
            assert!(
                matches!(decode(&frame), Err(FrameError::Malformed { .. })),
                "{frame}"
            );
        }
        let too_large = vec![b' '; MAX_FRAME_BYTES + 1];
        assert_eq!(
            DaemonMessage::decode(&too_large),
            Err(FrameError::TooLarge {
                bytes: MAX_FRAME_BYTES + 1
            })
        );
        // Nesting deeper than serde_json's recursion limit is an error, not a stack overflow.
        let deep = "[".repeat(100_000);
        assert!(matches!(decode(&deep), Err(FrameError::NotJson(_))));
        let deep_content = format!(
            r#"{{"type":"inventory","section":"cpu","hash":"x","content":{}}}"#,
            "[".repeat(100_000)
        );
        assert!(matches!(decode(&deep_content), Err(FrameError::NotJson(_))));
    }

    #[test]
    fn errors_do_not_repeat_long_input() {
        let long = "x".repeat(10_000);
        for frame in [
            format!(r#"{{"type":"{long}"}}"#),
            format!(r#"{{"type":"heartbeat","seq":1,"{long}":1}}"#),
            format!(r#"{{"type":"hello","daemonVersion":1,"observedGeneration":"{long}"}}"#),
            format!(r#"{{"type":"converged","generation":{long}}}"#),
        ] {
            let err = DaemonMessage::decode(frame.as_bytes()).expect_err("refused");
            assert!(err.to_string().len() <= MAX_ERROR_TEXT, "{err}");
        }
    }

    /// The longest a [`FrameError`]'s text may be: its words and at most [`ECHO_BYTES`] of the
    /// daemon's own text, once.
    const MAX_ERROR_TEXT: usize = 2 * ECHO_BYTES + 160;

    /// The property tests below run this many cases by default (each case is microseconds);
    /// `PROPTEST_CASES` overrides it for a longer run (see the README's testing section).
    const FUZZ_CASES: u32 = 5_000;

    /// proptest's configuration for the fuzz tests: proptest's own defaults, which read
    /// `PROPTEST_CASES` and the other `PROPTEST_*` variables, with [`FUZZ_CASES`] cases unless
    /// `PROPTEST_CASES` says otherwise. (`ProptestConfig::with_cases` would ignore the
    /// variable.) Failures are persisted under `core/proptest-regressions/`.
    fn fuzz_config() -> proptest::test_runner::Config {
        let config = proptest::test_runner::Config::default();
        if std::env::var_os("PROPTEST_CASES").is_some() {
            config
        } else {
            proptest::test_runner::Config {
                cases: FUZZ_CASES,
                ..config
            }
        }
    }

    mod fuzz {
        use super::super::*;
        use super::{MAX_ERROR_TEXT, fuzz_config};
        use crate::command::Outcome;
        use proptest::prelude::*;
        use serde_json::Value;

        /// Any JSON value, floats included: every finite `f64` must survive the wire exactly
        /// (serde_json's `float_roundtrip`), or a section's hash would differ between the
        /// daemon that computed it and the gateway that checks it.
        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                any::<f64>()
                    .prop_filter_map("finite", serde_json::Number::from_f64)
                    .prop_map(Value::Number),
                ".{0,12}".prop_map(Value::String),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map(".{0,8}", inner, 0..6)
                        .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        /// A command's structured result. `null` is "no result" on the wire (`None`), so
        /// `Some(null)` is not a value a daemon can send.
        fn result() -> impl Strategy<Value = Option<Value>> {
            proptest::option::of(json().prop_filter("null is no result", |v| !v.is_null()))
        }

        fn message() -> impl Strategy<Value = DaemonMessage> {
            prop_oneof![
                (
                    ".{0,16}",
                    prop::collection::btree_map(".{0,8}", ".{0,64}", 0..8),
                    any::<i64>()
                )
                    .prop_map(
                        |(daemon_version, inventory_hashes, observed_generation)| {
                            DaemonMessage::Hello {
                                daemon_version,
                                inventory_hashes,
                                observed_generation,
                            }
                        }
                    ),
                any::<u64>().prop_map(|seq| DaemonMessage::Heartbeat { seq }),
                ".{0,32}".prop_map(|id| DaemonMessage::CommandStarted { id }),
                (
                    ".{0,32}",
                    prop::sample::select(vec![
                        Outcome::Succeeded,
                        Outcome::Failed,
                        Outcome::Cancelled
                    ]),
                    any::<Option<i32>>(),
                    ".{0,64}",
                    result()
                )
                    .prop_map(|(id, outcome, exit_code, output, result)| {
                        DaemonMessage::CommandResult {
                            id,
                            outcome,
                            exit_code,
                            output,
                            result,
                        }
                    }),
                any::<i64>().prop_map(|generation| DaemonMessage::Converged { generation }),
                (".{0,12}", ".{0,64}", json()).prop_map(|(section, hash, content)| {
                    DaemonMessage::Inventory {
                        section,
                        hash,
                        content,
                    }
                }),
            ]
        }

        /// One edit of a frame's bytes; positions wrap around the frame's length.
        #[derive(Debug, Clone)]
        enum Mutation {
            Flip { at: usize, bits: u8 },
            Set { at: usize, byte: u8 },
            Delete { at: usize, len: usize },
            Insert { at: usize, bytes: Vec<u8> },
            Truncate { at: usize },
            Duplicate { at: usize, len: usize },
        }

        fn mutation() -> impl Strategy<Value = Mutation> {
            // Bytes JSON gives meaning to, so that edits often stay close to valid JSON.
            let byte = prop_oneof![
                any::<u8>(),
                prop::sample::select(b"{}[]\",:0123456789-.eEtrufalsn \\".to_vec()),
            ];
            prop_oneof![
                (any::<usize>(), 1u8..).prop_map(|(at, bits)| Mutation::Flip { at, bits }),
                (any::<usize>(), byte.clone()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
                (any::<usize>(), 1usize..16).prop_map(|(at, len)| Mutation::Delete { at, len }),
                (any::<usize>(), prop::collection::vec(byte, 1..8))
                    .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
                any::<usize>().prop_map(|at| Mutation::Truncate { at }),
                (any::<usize>(), 1usize..32).prop_map(|(at, len)| Mutation::Duplicate { at, len }),
            ]
        }

        fn mutate(frame: &mut Vec<u8>, mutation: &Mutation) {
            let position = |at: usize, len: usize| if len == 0 { 0 } else { at % len };
            let len = frame.len();
            match mutation {
                Mutation::Flip { at, bits } if len > 0 => frame[position(*at, len)] ^= bits,
                Mutation::Set { at, byte } if len > 0 => frame[position(*at, len)] = *byte,
                Mutation::Delete { at, len: n } if len > 0 => {
                    let start = position(*at, len);
                    frame.drain(start..(start + n).min(len));
                }
                Mutation::Insert { at, bytes } => {
                    let start = position(*at, len + 1);
                    frame.splice(start..start, bytes.iter().copied());
                }
                Mutation::Truncate { at } => frame.truncate(position(*at, len + 1)),
                Mutation::Duplicate { at, len: n } if len > 0 => {
                    let start = position(*at, len);
                    let copy = frame[start..(start + n).min(len)].to_vec();
                    frame.splice(start..start, copy);
                }
                _ => {}
            }
        }

        /// What every decode must give, whatever the bytes: a message that survives a second
        /// trip over the wire, or a typed error whose text is short.
        fn check_decode(frame: &[u8]) -> Result<(), TestCaseError> {
            match DaemonMessage::decode(frame) {
                Ok(message) => {
                    let again = DaemonMessage::decode(message.encode().as_bytes());
                    prop_assert_eq!(again, Ok(message));
                }
                Err(err) => {
                    let text = err.to_string();
                    prop_assert!(
                        text.len() <= MAX_ERROR_TEXT,
                        "{} bytes: {}",
                        text.len(),
                        text
                    );
                    prop_assert!(!err.reason().is_empty());
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(fuzz_config())]

            /// Every message a daemon can send reads back as itself.
            #[test]
            fn fuzz_protocol_every_message_round_trips(message in message()) {
                let frame = message.encode();
                prop_assert_eq!(DaemonMessage::decode(frame.as_bytes()), Ok(message));
            }

            /// Bytes of any kind never panic the decoder and give a typed, short error.
            #[test]
            fn fuzz_protocol_arbitrary_bytes_are_refused_in_words(
                frame in prop::collection::vec(any::<u8>(), 0..512)
            ) {
                check_decode(&frame)?;
            }

            /// Text of any kind (valid UTF-8, often JSON-like) likewise.
            #[test]
            fn fuzz_protocol_arbitrary_text_is_refused_in_words(
                frame in r#"[{}\[\]":,0-9a-zA-Z \\.-]{0,128}"#
            ) {
                check_decode(frame.as_bytes())?;
            }

            /// Valid frames with a few bytes edited: the edits a broken daemon, a bad cable
            /// or a fuzzer make. Still a message or a typed error, never a panic.
            #[test]
            fn fuzz_protocol_mutated_frames_never_panic(
                message in message(),
                mutations in prop::collection::vec(mutation(), 1..6),
            ) {
                let mut frame = message.encode().into_bytes();
                for mutation in &mutations {
                    mutate(&mut frame, mutation);
                }
                check_decode(&frame)?;
            }
        }
    }
}
