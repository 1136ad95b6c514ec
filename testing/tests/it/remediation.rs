//! Health remediation end to end with FakeDaemons through the real gateway: two machines join,
//! pass acceptance and become schedulable; then a GPU of each fails in service (XID 48). On the
//! one whose `gpu.reset` clears the fault, remediation resets it, verifies it (a fresh `gpus`
//! report and a passing `diag.nvml`), and the node is schedulable again; on the one whose
//! fault nothing clears, it gives up: maintenance on and `GpuNeedsPerson`. Both databases.

use bc_testing::daemon::{CaTrust, DaemonKnobs, FakeDaemon};
use bc_testing::{TestServer, each_backend};
use better_compute::controllers::{LifecycleController, RemediationController};
use serde_json::{Value, json};
use std::time::Duration;

/// Joins, acceptance, reconnects and commands on a loaded 2-core machine.
const SETTLE: Duration = Duration::from_secs(120);

async fn node(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { node(id: $id) { id maintenance maintenanceReason
            conditions { type status reason }
            schedulability { schedulable bucket }
            remediationAttempts { action status } } }",
        json!({"id": id}),
    )
    .await["node"]
        .clone()
}

fn status_of(node: &Value, kind: &str) -> Option<String> {
    node["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .and_then(|c| c["status"].as_str().map(str::to_owned))
}

/// Whether every remediation attempt of `node` has its verdict (none waiting, acting or
/// verifying).
fn attempts_ended(node: &Value) -> bool {
    node["remediationAttempts"]
        .as_array()
        .is_some_and(|attempts| {
            attempts.iter().all(|a| {
                !matches!(
                    a["status"].as_str(),
                    Some("WAITING" | "ACTING" | "VERIFYING")
                )
            })
        })
}

/// Ticks the controllers until `done` holds for the nodes, at most [`SETTLE`].
async fn settle(
    s: &TestServer,
    ids: &[String],
    what: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let mut lifecycle = LifecycleController::new(s.server.services.clone());
    let mut remediation = RemediationController::new(s.server.services.clone());
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        lifecycle.tick().await.expect("a lifecycle pass");
        remediation.tick().await.expect("a remediation pass");
        let mut nodes = Vec::new();
        for id in ids {
            nodes.push(node(s, id).await);
        }
        if done(&nodes) {
            return nodes;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not settled: {nodes:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_failing_in_service_is_remediated_or_given_up_on_through_the_real_gateway() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        // One try of one reset, then give up: the broken machine's story stays short.
        s.admin(
            "mutation($id: ID!) { updatePool(input: {id: $id, remediation: {rules: [{condition: \"GpuNeedsReset\", steps: [{action: GPU_RESET, attempts: 1, backoffSeconds: 0}]}]}}) { pool { id } } }",
            json!({"id": pool}),
        )
        .await;
        let secret = s.join_token(&site, Some(&pool), 2).await;
        let daemon = |knobs: DaemonKnobs| {
            FakeDaemon::new(s.gateway_url(), secret.clone(), CaTrust::Pem(s.ca_pem()))
                .with_knobs(knobs)
        };
        let fixable = daemon(DaemonKnobs::default());
        let broken = daemon(DaemonKnobs {
            reset_clears_faults: false,
            reboot_clears_faults: false,
            ..DaemonKnobs::default()
        });
        let tasks = [fixable.start(), broken.start()];
        let mut ids = Vec::new();
        for d in [&fixable, &broken] {
            let status = d
                .wait_for(|st| st.connected && st.node_id.is_some(), SETTLE)
                .await
                .expect("the daemon connects");
            ids.push(status.node_id.expect("a node id"));
        }
        settle(s, &ids, "acceptance", |nodes| {
            nodes.iter().all(|n| n["schedulability"]["schedulable"] == true)
        })
        .await;

        // A GPU of each fails in service; the daemons reconnect to report it.
        fixable.inject_xids(&[48]);
        broken.inject_xids(&[48]);
        // The proof clears the condition when the diagnostic's result arrives; the attempt
        // records its verdict on the controller's next pass. Settle on both, so the verdict
        // asserted below is the attempt's last word, not a snapshot taken between the two.
        let nodes = settle(s, &ids, "remediation", |nodes| {
            let fixed = &nodes[0];
            let given_up = &nodes[1];
            status_of(fixed, "GpuNeedsReset").as_deref() == Some("FALSE")
                && fixed["schedulability"]["schedulable"] == true
                && given_up["maintenance"] == true
                && nodes.iter().all(attempts_ended)
        })
        .await;

        let fixed = &nodes[0];
        assert!(
            fixed["conditions"]
                .as_array()
                .expect("conditions")
                .iter()
                .any(|c| c["type"] == "GpuNeedsReset" && c["reason"] == "Proven"),
            "{fixed:#}"
        );
        assert_eq!(
            fixed["remediationAttempts"],
            json!([{"action": "GPU_RESET", "status": "SUCCEEDED"}])
        );
        assert!(fixable.faults().is_empty(), "the reset cleared the fault");

        let given_up = &nodes[1];
        assert_eq!(status_of(given_up, "GpuNeedsPerson").as_deref(), Some("TRUE"));
        assert_eq!(status_of(given_up, "GpuNeedsReset").as_deref(), Some("TRUE"));
        assert_eq!(given_up["schedulability"]["bucket"], "MAINTENANCE");
        assert_eq!(
            given_up["remediationAttempts"],
            json!([{"action": "GPU_RESET", "status": "GAVE_UP"}])
        );
        assert_eq!(broken.faults(), vec![48]);

        for d in [&fixable, &broken] {
            d.stop();
        }
        for task in tasks {
            let _ = tokio::time::timeout(SETTLE, task).await;
        }
    })
    .await;
}
