//! Health remediation through the real gateway, the raw daemon answering its commands and the
//! Remediation controller ticked by hand on the test clock: a pool's ladder walked from
//! `gpu.reset` → verify to `node.reboot` → verify to giving up (maintenance on,
//! `GpuNeedsPerson`), the policy set with `updatePool`, and a remediation that resumes after
//! a restart of the server.

use crate::proof::{
    answer, command, condition, detail, event_types, gpus, in_service_with, open, report,
};
use crate::raw_daemon::{Ws, send, wait_until};
use bc_core::command::CommandKind;
use bc_core::protocol::DaemonMessage;
use bc_testing::{Backend, TestServer, each_backend};
use better_compute::controllers::{RemediationController, RemediationReport};
use serde_json::{Value, json};

const UPDATE_POOL: &str = "mutation($id: ID!, $remediation: RemediationPolicyInput) {
    updatePool(input: {id: $id, remediation: $remediation}) {
        pool { id remediation { enabled rules { condition steps { action attempts backoffSeconds verifyLevel } } } } } }";

async fn tick(controller: &mut RemediationController) -> RemediationReport {
    controller.tick().await.expect("a remediation pass")
}

/// Ticks until `done` holds for a pass's report (a result may still be on its way).
async fn tick_until(
    controller: &mut RemediationController,
    done: impl Fn(&RemediationReport) -> bool,
) -> RemediationReport {
    let mut last = RemediationReport::default();
    wait_until(async || {
        last = tick(controller).await;
        done(&last)
    })
    .await;
    last
}

/// Answers the verification of a try: the `inventory.refresh` of `gpus` (reporting `xids`)
/// and the `diag.nvml` (passing or not), in whichever order they come. Returns the
/// diagnostic's parameters.
async fn verify(ws: &mut Ws, xids: &[u32], passes: bool) -> Value {
    let mut params = Value::Null;
    for _ in 0..2 {
        let (id, kind, sent) = command(ws).await;
        match kind {
            CommandKind::InventoryRefresh => {
                assert_eq!(sent, json!({"sections": ["gpus"]}));
                report(ws, &gpus(xids)).await;
                answer(ws, &id, kind, true).await;
            }
            CommandKind::DiagNvml => {
                params = sent;
                answer(ws, &id, kind, passes).await;
            }
            other => panic!("expected the verification, got {other}"),
        }
    }
    params
}

fn attempts(node: &Value) -> Vec<Value> {
    let mut list = node["remediationAttempts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    list.sort_by_key(|a| (a["step"].as_i64(), a["attempt"].as_i64()));
    list
}

#[tokio::test]
async fn remediation_walks_reset_verify_reboot_verify_then_gives_up_with_maintenance_and_gpu_needs_person()
 {
    each_backend(async |s| {
        let mut n = in_service_with(s, &[48]).await;
        // A short ladder for the pool: one reset, then one reboot, 10 s apart.
        let policy = json!({"rules": [{"condition": "GpuNeedsReset", "steps": [
            {"action": "GPU_RESET", "attempts": 1, "backoffSeconds": 10, "verifyLevel": 2},
            {"action": "NODE_REBOOT", "attempts": 1, "backoffSeconds": 10},
        ]}]});
        let updated = s
            .admin(UPDATE_POOL, json!({"id": n.pool, "remediation": policy}))
            .await;
        let rules = &updated["updatePool"]["pool"]["remediation"]["rules"];
        assert_eq!(rules.as_array().map(Vec::len), Some(1));
        assert_eq!(rules[0]["steps"][1]["verifyLevel"], 1, "the default level");
        // A policy the domain cannot run is refused.
        let bad =
            json!({"rules": [{"condition": "GpuNeedsReboot", "steps": [{"action": "GPU_RESET"}]}]});
        let refused = s
            .gql(
                Some(s.admin_token()),
                UPDATE_POOL,
                json!({"id": n.pool, "remediation": bad}),
            )
            .await;
        assert_eq!(refused.code(), Some("BAD_USER_INPUT"), "{:#}", refused.body);

        let mut controller = RemediationController::new(s.server.services.clone());
        // Step 1, try 1: gpu.reset, then its verification fails (the XID is still there).
        assert_eq!(tick(&mut controller).await.acted, 1);
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(kind, CommandKind::GpuReset);
        answer(&mut n.ws, &id, kind, true).await;
        tick_until(&mut controller, |r| r.verifying == 1).await;
        let level = verify(&mut n.ws, &[48], false).await;
        assert_eq!(level, json!({"level": 2}));
        tick_until(&mut controller, |r| r.retrying == 1).await;

        // The next try (step 2) waits for its backoff, then reboots.
        assert_eq!(tick(&mut controller).await.waiting, 1);
        let node = detail(s, &n.id).await;
        let waiting = attempts(&node);
        assert_eq!(
            waiting
                .iter()
                .map(|a| a["status"].clone())
                .collect::<Vec<_>>(),
            vec![json!("FAILED"), json!("WAITING")]
        );
        assert_eq!(waiting[1]["action"], "NODE_REBOOT");
        assert_eq!(waiting[0]["runId"], waiting[1]["runId"]);
        s.clock.advance(chrono::Duration::seconds(10));
        assert_eq!(tick(&mut controller).await.acted, 1);
        let (id, kind, _) = command(&mut n.ws).await;
        assert_eq!(kind, CommandKind::NodeReboot);
        answer(&mut n.ws, &id, kind, true).await;
        tick_until(&mut controller, |r| r.verifying == 1).await;
        verify(&mut n.ws, &[48], false).await;
        tick_until(&mut controller, |r| r.gave_up == 1).await;

        // Given up: maintenance on, GpuNeedsPerson set, the ladder recorded.
        let node = detail(s, &n.id).await;
        assert_eq!(node["maintenance"], true);
        assert!(
            node["maintenanceReason"]
                .as_str()
                .expect("a reason")
                .starts_with("remediation of GpuNeedsReset gave up"),
            "{node:#}"
        );
        let person = condition(&node, "GpuNeedsPerson");
        assert_eq!(person["status"], "TRUE");
        assert_eq!(person["reason"], "RemediationGaveUp");
        assert_eq!(person["setBy"], "controller:remediation");
        assert_eq!(condition(&node, "GpuNeedsReset")["status"], "TRUE");
        assert_eq!(node["schedulability"]["bucket"], "MAINTENANCE");
        let done = attempts(&node);
        assert_eq!(
            done.iter()
                .map(|a| (a["action"].clone(), a["status"].clone()))
                .collect::<Vec<_>>(),
            vec![
                (json!("GPU_RESET"), json!("FAILED")),
                (json!("NODE_REBOOT"), json!("GAVE_UP"))
            ]
        );
        assert!(done.iter().all(|a| a["actionCommandId"].is_string()
            && a["verifyCommandId"].is_string()
            && a["finishedAt"].is_string()));
        let types = event_types(&node);
        for expected in [
            "remediation.waiting",
            "remediation.acting",
            "remediation.verifying",
            "remediation.failed",
            "remediation.gave_up",
            "node.maintenance_on",
        ] {
            assert!(
                types.contains(&expected.to_owned()),
                "{expected}: {types:?}"
            );
        }
        // Nothing more: the node is in maintenance, a person's now.
        s.clock.advance(chrono::Duration::seconds(600));
        assert_eq!(tick(&mut controller).await, RemediationReport::default());
    })
    .await;
}

#[tokio::test]
async fn a_remediation_resumes_after_a_restart_and_succeeds() {
    for backend in Backend::selected() {
        let s = TestServer::start(backend).await.expect("a test server");
        let mut n = in_service_with(&s, &[48]).await;
        let mut controller = RemediationController::new(s.server.services.clone());
        assert_eq!(tick(&mut controller).await.acted, 1);
        let (reset, kind, _) = command(&mut n.ws).await;
        assert_eq!(kind, CommandKind::GpuReset);
        let before = attempts(&detail(&s, &n.id).await);
        assert_eq!(before.len(), 1);
        assert_eq!(before[0]["status"], "ACTING");
        assert_eq!(before[0]["actionCommandId"], reset.as_str());

        // The server restarts while the reset runs; the daemon comes back to it.
        drop(n.ws);
        let s = s.restart().await.expect("a restart");
        let mut ws = open(&s, &n.certificate, &n.machine, &gpus(&[48]), 1).await;
        // The reset was requeued when its session ended, and is sent again.
        let (again, kind, _) = command(&mut ws).await;
        assert_eq!(
            (again.as_str(), kind),
            (reset.as_str(), CommandKind::GpuReset)
        );
        send(
            &mut ws,
            &DaemonMessage::CommandStarted { id: again.clone() },
        )
        .await;
        answer(&mut ws, &again, kind, true).await;

        // A new controller (the restarted server's) resumes the same try.
        let mut controller = RemediationController::new(s.server.services.clone());
        tick_until(&mut controller, |r| r.verifying == 1).await;
        verify(&mut ws, &[], true).await;
        tick_until(&mut controller, |r| r.succeeded == 1).await;
        let node = detail(&s, &n.id).await;
        let cleared = condition(&node, "GpuNeedsReset");
        assert_eq!(cleared["status"], "FALSE");
        assert_eq!(cleared["reason"], "Proven");
        assert_eq!(node["schedulability"]["schedulable"], true, "{node:#}");
        let after = attempts(&node);
        assert_eq!(after.len(), 1, "{after:#?}");
        assert_eq!(after[0]["id"], before[0]["id"]);
        assert_eq!(after[0]["status"], "SUCCEEDED");
        assert!(event_types(&node).contains(&"remediation.succeeded".to_owned()));
        s.stop().await;
    }
}
