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

/// The hash of an inventory section: SHA-256 (hex) over its canonical JSON form (object keys
/// sorted, no insignificant whitespace), so equal content always hashes equal whatever order
/// the daemon wrote it in.
pub fn section_hash(content: &serde_json::Value) -> String {
    use sha2::{Digest, Sha256};
    // serde_json's map is ordered by key (the `preserve_order` feature is off), so
    // serialising a `Value` is canonical.
    let canonical = serde_json::to_vec(content).unwrap_or_default();
    hex::encode(Sha256::digest(&canonical))
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
