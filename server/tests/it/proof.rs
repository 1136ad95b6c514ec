//! Reasons that clear only on proof (`clearWhen`), through the real gateway with a raw
//! daemon: a GPU that needed a reset stays unschedulable when the next report lacks the XID,
//! and is trusted again only after a `gpu.reset` succeeded and a `diag.nvml` after it passed;
//! a failed diagnostic restarts the proof; evidence that comes back raises the condition
//! again; an operator clears a condition by hand only with a reason of their own. The helpers
//! here (a node in service with a faulty GPU, its commands answered by hand) serve
//! `remediation.rs` too.

use crate::raw_daemon::{Machine, Ws, connect, join, next, send, wait_until};
use bc_core::command::{CommandKind, Outcome};
use bc_core::ids::TenantId;
use bc_core::protocol::{DaemonMessage, GatewayMessage, section_hash};
use bc_testing::{TestServer, each_backend};
use better_compute::auth::Role;
use better_compute::controllers::LifecycleController;
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Eight GPUs; `xids` on the third.
pub(super) fn gpus(xids: &[u32]) -> Value {
    let devices: Vec<Value> = (0..8)
        .map(|i| {
            let errors: Vec<Value> = if i == 2 {
                xids.iter().map(|x| json!({"xid": x, "count": 1})).collect()
            } else {
                Vec::new()
            };
            json!({
                "index": i, "uuid": format!("GPU-proof-{i}"), "pciBusId": format!("00000000:{:02x}:00.0", 0x18 + i),
                "name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559,
                "eccErrors": {"volatileUncorrectable": 0}, "retiredPages": 0, "xidErrors": errors,
            })
        })
        .collect();
    json!({"count": 8, "model": "NVIDIA H100 80GB HBM3", "driverVersion": "550.54.15", "devices": devices})
}

/// A node in service (adopted, its first spec converged, connected) whose GPUs reported
/// `xids`, with its daemon's session.
pub(super) struct InService {
    pub ws: Ws,
    pub id: String,
    pub pool: String,
    pub machine: Machine,
    pub certificate: String,
}

pub(super) async fn in_service_with(s: &TestServer, xids: &[u32]) -> InService {
    let (site, pool) = s.site_and_pool(8).await;
    let secret = s.join_token(&site, Some(&pool), 1).await;
    let machine = Machine::new();
    let hostname = format!("gpu-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let issued = join(s, &machine, &secret, &hostname).await;
    let id = issued.node_id.clone();
    let inventory = gpus(xids);
    let ws = open(s, &issued.certificate_pem, &machine, &inventory, 0).await;
    let mut n = InService {
        ws,
        id,
        pool,
        machine,
        certificate: issued.certificate_pem,
    };
    wait_until(async || detail(s, &n.id).await["gpuCount"] == 8).await;
    // An operator vouches for the machine (adoptNode); NodeSpec writes generation 1 and the
    // daemon converges it.
    let version = detail(s, &n.id).await["version"].clone();
    s.admin(
        "mutation($id: ID!, $v: Int!) { adoptNode(input: {id: $id, version: $v}) { node { provisionState } } }",
        json!({"id": n.id, "v": version}),
    )
    .await;
    LifecycleController::new(s.server.services.clone())
        .tick()
        .await
        .expect("a lifecycle pass");
    let Ok(GatewayMessage::Spec { spec }) = next(&mut n.ws).await else {
        panic!("expected the first spec")
    };
    send(
        &mut n.ws,
        &DaemonMessage::Converged {
            generation: spec.generation,
        },
    )
    .await;
    wait_until(async || detail(s, &n.id).await["observedGeneration"] == 1).await;
    n
}

/// Opens a session announcing `inventory` as the `gpus` section, and sends it if asked.
pub(super) async fn open(
    s: &TestServer,
    certificate: &str,
    machine: &Machine,
    inventory: &Value,
    observed: i64,
) -> Ws {
    let mut ws = connect(s, certificate, machine.key_der())
        .await
        .expect("a session");
    send(
        &mut ws,
        &DaemonMessage::Hello {
            daemon_version: "test".into(),
            inventory_hashes: BTreeMap::from([("gpus".to_owned(), section_hash(inventory))]),
            observed_generation: observed,
        },
    )
    .await;
    let Ok(GatewayMessage::Welcome { want_sections, .. }) = next(&mut ws).await else {
        panic!("expected welcome")
    };
    if want_sections.iter().any(|w| w == "gpus") {
        report(&mut ws, inventory).await;
    }
    ws
}

/// The daemon reports its `gpus` section.
pub(super) async fn report(ws: &mut Ws, inventory: &Value) {
    send(
        ws,
        &DaemonMessage::Inventory {
            section: "gpus".into(),
            hash: section_hash(inventory),
            content: inventory.clone(),
        },
    )
    .await;
}

/// The next command the gateway sends: id, kind, parameters.
pub(super) async fn command(ws: &mut Ws) -> (String, CommandKind, Value) {
    match next(ws).await {
        Ok(GatewayMessage::Command {
            id, kind, params, ..
        }) => (id, kind, params),
        other => panic!("expected a command, got {other:?}"),
    }
}

/// The daemon's result for a command: success (a diagnostic that passed) or failure.
pub(super) async fn answer(ws: &mut Ws, id: &str, kind: CommandKind, ok: bool) {
    let result = match kind {
        CommandKind::DiagNvml => {
            json!({"passed": ok, "failures": if ok { json!([]) } else { json!([{"gpu": 2, "message": "GPU 2: XID 48"}]) }})
        }
        _ => json!({}),
    };
    send(
        ws,
        &DaemonMessage::CommandResult {
            id: id.to_owned(),
            outcome: if ok {
                Outcome::Succeeded
            } else {
                Outcome::Failed
            },
            exit_code: Some(i32::from(!ok)),
            output: String::new(),
            result: Some(result),
        },
    )
    .await;
}

/// Queues a command as the test admin (forced: the node is not cordoned); its id.
pub(super) async fn send_command(s: &TestServer, node: &str, kind: &str, params: Value) -> String {
    s.admin(
        "mutation($ids: [ID!], $kind: CommandKind!, $params: JSON) { sendCommand(input: {nodeIds: $ids, kind: $kind, params: $params, force: true}) { commands { id } } }",
        json!({"ids": [node], "kind": kind, "params": params}),
    )
    .await["sendCommand"]["commands"][0]["id"]
        .as_str()
        .expect("a command id")
        .to_owned()
}

pub(super) async fn command_status(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { command(id: $id) { status } }",
        json!({"id": id}),
    )
    .await["command"]["status"]
        .clone()
}

pub(super) async fn detail(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { node(id: $id) { id version provisionState maintenance maintenanceReason gpuCount observedGeneration noScheduleReasons
            conditions { type status reason message setBy
                clearWhen { kind byHand description steps { kinds minDiagLevel description } }
                proof { since stepsTotal satisfied { step commandId kind } evidenceGoneAt restarts lastRestart } }
            schedulability { schedulable bucket failingChecks { check message } reasons { reason clearedBy clearWhen { kind description } } }
            remediationAttempts { id runId condition step stepsTotal action attempt attemptsAllowed status actionCommandId verifyCommandId refreshCommandId nextAttemptAt note finishedAt }
            events(first: 200) { nodes { type axis from to actor cause data } } } }",
        json!({"id": id}),
    )
    .await["node"]
        .clone()
}

pub(super) fn condition(node: &Value, kind: &str) -> Value {
    node["conditions"]
        .as_array()
        .and_then(|list| list.iter().find(|c| c["type"] == kind))
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} in {node:#}"))
}

pub(super) fn event_types(node: &Value) -> Vec<String> {
    node["events"]["nodes"]
        .as_array()
        .map(|events| {
            events
                .iter()
                .filter_map(|e| e["type"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn satisfied(node: &Value, kind: &str) -> usize {
    condition(node, kind)["proof"]["satisfied"]
        .as_array()
        .map_or(0, Vec::len)
}

#[tokio::test]
async fn a_reset_needing_gpu_stays_unschedulable_without_its_xid_until_a_reset_and_a_passing_diagnostic()
 {
    each_backend(async |s| {
        let mut n = in_service_with(s, &[48]).await;
        let node = detail(s, &n.id).await;
        let reset = condition(&node, "GpuNeedsReset");
        assert_eq!(reset["status"], "TRUE");
        assert_eq!(reset["clearWhen"]["kind"], "COMMANDS");
        assert_eq!(reset["clearWhen"]["byHand"], true);
        assert_eq!(
            reset["clearWhen"]["steps"][0]["kinds"],
            json!(["GPU_RESET", "NODE_REBOOT"])
        );
        assert_eq!(reset["clearWhen"]["steps"][1]["minDiagLevel"], 1);
        let sentence = reset["clearWhen"]["description"]
            .as_str()
            .expect("a sentence");
        assert!(
            sentence.starts_with(
                "clears when gpu.reset or node.reboot succeeds and then diag.nvml level 1"
            ),
            "{sentence}"
        );
        assert_eq!(node["schedulability"]["schedulable"], false);
        let explained = node["schedulability"]["reasons"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["reason"] == "GpuNeedsReset"))
            .cloned()
            .expect("the reason is explained");
        assert_eq!(explained["clearWhen"]["kind"], "COMMANDS");
        assert_eq!(explained["clearedBy"], sentence);
        let checks = node["schedulability"]["failingChecks"].to_string();
        assert!(checks.contains("clears when gpu.reset"), "{checks}");

        // The next report lacks the XID: recorded as evidence gone, nothing cleared.
        report(&mut n.ws, &gpus(&[])).await;
        wait_until(async || {
            !condition(&detail(s, &n.id).await, "GpuNeedsReset")["proof"]["evidenceGoneAt"]
                .is_null()
        })
        .await;
        let node = detail(s, &n.id).await;
        assert_eq!(condition(&node, "GpuNeedsReset")["status"], "TRUE");
        assert_eq!(node["schedulability"]["schedulable"], false);
        assert!(event_types(&node).contains(&"node.condition_evidence_gone".to_owned()));

        // A diagnostic before any reset proves nothing.
        let early = send_command(s, &n.id, "DIAG_NVML", json!({"level": 1})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(id, early);
        answer(&mut n.ws, &id, kind, true).await;
        wait_until(async || command_status(s, &early).await == "SUCCEEDED").await;
        assert_eq!(satisfied(&detail(s, &n.id).await, "GpuNeedsReset"), 0);

        // The reset succeeds: step 1 of 2, still unschedulable.
        let reset_id = send_command(s, &n.id, "GPU_RESET", json!({})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(
            (id.as_str(), kind),
            (reset_id.as_str(), CommandKind::GpuReset)
        );
        answer(&mut n.ws, &id, kind, true).await;
        wait_until(async || satisfied(&detail(s, &n.id).await, "GpuNeedsReset") == 1).await;
        let node = detail(s, &n.id).await;
        let proof = &condition(&node, "GpuNeedsReset")["proof"];
        assert_eq!(proof["satisfied"][0]["commandId"], reset_id.as_str());
        assert_eq!(proof["satisfied"][0]["kind"], "GPU_RESET");
        assert_eq!(proof["stepsTotal"], 2);
        assert_eq!(node["schedulability"]["schedulable"], false);

        // A diagnostic after it passes: proven, cleared, schedulable.
        let diag = send_command(s, &n.id, "DIAG_NVML", json!({"level": 1})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(id, diag);
        answer(&mut n.ws, &id, kind, true).await;
        wait_until(async || {
            condition(&detail(s, &n.id).await, "GpuNeedsReset")["status"] == "FALSE"
        })
        .await;
        let node = detail(s, &n.id).await;
        let cleared = condition(&node, "GpuNeedsReset");
        assert_eq!(cleared["reason"], "Proven");
        assert_eq!(cleared["setBy"], "controller:health");
        assert!(
            cleared["message"]
                .as_str()
                .expect("a message")
                .contains(&reset_id)
        );
        assert_eq!(node["noScheduleReasons"], json!([]));
        assert_eq!(node["schedulability"]["schedulable"], true, "{node:#}");
        let types = event_types(&node);
        assert_eq!(
            types
                .iter()
                .filter(|t| *t == "node.condition_proof_step")
                .count(),
            2,
            "{types:?}"
        );
        let step = node["events"]["nodes"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["type"] == "node.condition_proof_step"))
            .cloned()
            .expect("a proof step event");
        assert_eq!(step["actor"], "controller:health");
        assert_eq!(step["cause"], format!("proof:{diag}"));

        // The evidence comes back: the condition is raised again, with a fresh proof.
        report(&mut n.ws, &gpus(&[48])).await;
        wait_until(async || {
            condition(&detail(s, &n.id).await, "GpuNeedsReset")["status"] == "TRUE"
        })
        .await;
        let node = detail(s, &n.id).await;
        assert_eq!(satisfied(&node, "GpuNeedsReset"), 0);
        assert_eq!(node["schedulability"]["schedulable"], false);
    })
    .await;
}

#[tokio::test]
async fn a_failed_diagnostic_keeps_the_condition_and_restarts_its_proof() {
    each_backend(async |s| {
        let mut n = in_service_with(s, &[48]).await;
        let reset = send_command(s, &n.id, "GPU_RESET", json!({})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(id, reset);
        answer(&mut n.ws, &id, kind, true).await;
        wait_until(async || satisfied(&detail(s, &n.id).await, "GpuNeedsReset") == 1).await;

        let diag = send_command(s, &n.id, "DIAG_NVML", json!({"level": 2})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        answer(&mut n.ws, &id, kind, false).await;
        wait_until(async || {
            condition(&detail(s, &n.id).await, "GpuNeedsReset")["proof"]["restarts"] == 1
        })
        .await;
        let node = detail(s, &n.id).await;
        let kept = condition(&node, "GpuNeedsReset");
        assert_eq!(kept["status"], "TRUE");
        assert_eq!(satisfied(&node, "GpuNeedsReset"), 0);
        assert!(
            kept["proof"]["lastRestart"]
                .as_str()
                .expect("why")
                .contains(&diag),
            "{kept:#}"
        );
        assert!(event_types(&node).contains(&"node.condition_proof_restarted".to_owned()));
        assert_eq!(node["schedulability"]["schedulable"], false);

        // A passing diagnostic now proves nothing: the reset must come again first.
        let again = send_command(s, &n.id, "DIAG_NVML", json!({"level": 1})).await;
        let (id, kind, _) = command(&mut n.ws).await;
        answer(&mut n.ws, &id, kind, true).await;
        wait_until(async || command_status(s, &again).await == "SUCCEEDED").await;
        assert_eq!(
            condition(&detail(s, &n.id).await, "GpuNeedsReset")["status"],
            "TRUE"
        );
    })
    .await;
}

const CLEAR: &str = "mutation($id: ID!, $v: Int!, $type: String!, $reason: String!) {
    clearNodeCondition(input: {id: $id, version: $v, type: $type, reason: $reason}) {
        node { version noScheduleReasons maintenance conditions { type status reason message setBy } } } }";

#[tokio::test]
async fn an_operator_clears_a_condition_by_hand_only_with_a_reason_of_their_own() {
    each_backend(async |s| {
        // XID 64 (row remap failed): a person must replace the GPU.
        let mut n = in_service_with(s, &[64]).await;
        let node = detail(s, &n.id).await;
        let person = condition(&node, "GpuNeedsPerson");
        assert_eq!(person["status"], "TRUE");
        assert_eq!(person["clearWhen"]["kind"], "OPERATOR");
        // A report without the XID does not clear it.
        report(&mut n.ws, &gpus(&[])).await;
        wait_until(async || {
            !condition(&detail(s, &n.id).await, "GpuNeedsPerson")["proof"]["evidenceGoneAt"]
                .is_null()
        })
        .await;
        let node = detail(s, &n.id).await;
        assert_eq!(condition(&node, "GpuNeedsPerson")["status"], "TRUE");
        let version = node["version"].as_i64().expect("a version");
        let admin = s.admin_token().to_owned();
        let clear = async |token: &str, v: i64, kind: &str, reason: &str| {
            s.gql(
                Some(token),
                CLEAR,
                json!({"id": n.id, "v": v, "type": kind, "reason": reason}),
            )
            .await
        };

        let blank = clear(&admin, version, "GpuNeedsPerson", "  ").await;
        assert_eq!(blank.code(), Some("BAD_USER_INPUT"), "{:#}", blank.body);
        let unset = clear(&admin, version, "GpuNeedsReboot", "looked at it").await;
        assert_eq!(unset.code(), Some("BAD_USER_INPUT"), "{:#}", unset.body);
        assert!(unset.message().contains("not set"), "{}", unset.message());
        let stale = clear(&admin, version - 1, "GpuNeedsPerson", "replaced").await;
        assert_eq!(stale.code(), Some("CONFLICT"), "{:#}", stale.body);
        let tenant = TenantId::parse(&s.tenant("acme-proof").await).expect("a tenant id");
        let theirs = s.mint(
            "acme-op",
            Role::Operator,
            Some(&tenant),
            chrono::Duration::hours(1),
        );
        let hidden = clear(&theirs, version, "GpuNeedsPerson", "replaced").await;
        assert_eq!(hidden.code(), Some("NOT_FOUND"), "{:#}", hidden.body);
        assert_eq!(
            detail(s, &n.id).await["version"],
            version,
            "nothing changed"
        );

        let done = clear(
            &admin,
            version,
            "GpuNeedsPerson",
            "GPU 2 replaced, RMA 4711",
        )
        .await;
        let after = &done.data()["clearNodeCondition"]["node"];
        let cleared = condition(after, "GpuNeedsPerson");
        assert_eq!(cleared["status"], "FALSE");
        assert_eq!(cleared["reason"], "ClearedByOperator");
        assert_eq!(cleared["setBy"], "user:test-admin");
        assert!(
            cleared["message"]
                .as_str()
                .expect("a message")
                .contains("RMA 4711")
        );
        assert_eq!(after["noScheduleReasons"], json!([]));
        let node = detail(s, &n.id).await;
        let event = node["events"]["nodes"]
            .as_array()
            .and_then(|e| {
                e.iter().find(|e| {
                    e["type"] == "node.condition_changed" && e["to"] == "GpuNeedsPerson=false"
                })
            })
            .cloned()
            .expect("the clearing event");
        assert_eq!(event["actor"], "user:test-admin");
        assert_eq!(event["cause"], "clearNodeCondition");
        let said = event["data"]["detail"].as_str().expect("a detail");
        assert!(
            said.contains("cleared by hand") && said.contains("RMA 4711"),
            "{said}"
        );
    })
    .await;
}
