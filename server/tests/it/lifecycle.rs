//! A node's working life through the real gateway: inventory turns into devices, labels and
//! health conditions; acceptance runs `diag.nvml` as a command and adopts or fails the node;
//! NodeSpec writes generation 1, the daemon converges, and the node becomes schedulable.
//! The raw client plays the daemon; controllers are ticked by hand on the test clock.

#![allow(clippy::unwrap_used)]

use crate::raw_daemon::*;
use bc_core::command::Outcome;
use bc_core::protocol::{DaemonMessage, GatewayMessage, section_hash};
use bc_testing::{TestServer, each_backend};
use better_compute::controllers::LifecycleController;
use serde_json::{Value, json};
use std::collections::BTreeMap;

fn gpus(count: usize, xids: &[(usize, u32)]) -> Value {
    let devices: Vec<Value> = (0..count)
        .map(|i| {
            let xid_errors: Vec<Value> = xids.iter().filter(|(g, _)| *g == i).map(|(_, x)| json!({"xid": x, "count": 2})).collect();
            json!({
                "index": i, "uuid": format!("GPU-{i}-{}", uuid::Uuid::new_v4().simple()), "pciBusId": format!("00000000:{:02x}:00.0", 0x18 + i),
                "name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "serial": format!("S{i}"),
                "eccErrors": {"volatileUncorrectable": 0}, "retiredPages": 0, "xidErrors": xid_errors,
            })
        })
        .collect();
    json!({"count": count, "model": "NVIDIA H100 80GB HBM3", "driverVersion": "550.54.15", "cudaVersion": "12.4", "devices": devices})
}

/// Opens a session announcing `gpus`, and sends it when the gateway asks.
async fn session_with(
    s: &TestServer,
    certificate: &str,
    machine: &Machine,
    gpus: &Value,
    observed: i64,
) -> (Ws, i64) {
    let mut ws = connect(s, certificate, machine.key_der()).await.unwrap();
    send(
        &mut ws,
        &DaemonMessage::Hello {
            daemon_version: "test".into(),
            inventory_hashes: BTreeMap::from([("gpus".to_owned(), section_hash(gpus))]),
            observed_generation: observed,
        },
    )
    .await;
    let Ok(GatewayMessage::Welcome {
        want_sections,
        spec,
        ..
    }) = next(&mut ws).await
    else {
        panic!("expected welcome")
    };
    if want_sections.contains(&"gpus".to_owned()) {
        send(
            &mut ws,
            &DaemonMessage::Inventory {
                section: "gpus".into(),
                hash: section_hash(gpus),
                content: gpus.clone(),
            },
        )
        .await;
    }
    (ws, spec.generation)
}

async fn detail(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { node(id: $id) { id version provisionState failedFrom maintenance maintenanceReason generation observedGeneration gpuCount noScheduleReasons
            labels { key value } conditions { type status reason message }
            devices { name uuid pciBusId atom healthy }
            schedulability { schedulable bucket failingChecks { check message } reasons { reason setBy clearedBy detail } } } }",
        json!({"id": id}),
    )
    .await["node"]
    .clone()
}

fn condition<'a>(node: &'a Value, kind: &str) -> &'a Value {
    node["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {node:#}"))
}

async fn joined(s: &TestServer, expected_gpus: i32) -> (Machine, String, String) {
    let (site, pool) = s.site_and_pool(expected_gpus).await;
    let secret = s.join_token(&site, Some(&pool), 1).await;
    let machine = Machine::new();
    let issued = join(
        s,
        &machine,
        &secret,
        &format!("gpu-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]),
    )
    .await;
    (machine, issued.node_id, issued.certificate_pem)
}

#[tokio::test]
async fn a_node_goes_from_join_to_schedulable_by_itself() {
    each_backend(async |s| {
        let (machine, id, cert) = joined(s, 8).await;
        let inventory = gpus(8, &[]);
        let (mut ws, generation) = session_with(s, &cert, &machine, &inventory, 0).await;
        assert_eq!(generation, 0);
        wait_until(async || detail(s, &id).await["gpuCount"] == 8).await;
        let node = detail(s, &id).await;
        assert_eq!(node["devices"].as_array().unwrap().len(), 8);
        assert_eq!(node["devices"][0]["name"], "gpu0");
        assert_eq!(node["devices"][0]["atom"], "gpu0/whole");
        let labels: BTreeMap<String, String> = node["labels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["key"].as_str().unwrap().to_owned(),
                    l["value"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(labels["inventory.bettercompute.io/gpu-count"], "8");
        assert_eq!(
            labels["inventory.bettercompute.io/gpu-model"],
            "NVIDIA-H100-80GB-HBM3"
        );
        assert_eq!(condition(&node, "GpuCountMismatch")["status"], "FALSE");
        // The report's labels are one event, listing each with its value.
        let events = s
            .admin(
                "query($id: ID!) { node(id: $id) { events(first: 100) { edges { node { type from to data } } } } }",
                json!({"id": id}),
            )
            .await;
        let label_events: Vec<&Value> = events["node"]["events"]["edges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| &e["node"])
            .filter(|e| e["type"].as_str().is_some_and(|t| t.contains("label")))
            .collect();
        assert_eq!(label_events.len(), 1, "{events:#}");
        let event = label_events[0];
        assert_eq!(event["type"], "node.inventory_labels_changed");
        assert!(event["from"].is_null(), "{event:#}");
        let listed = event["to"].as_str().unwrap().split(", ").collect::<Vec<_>>();
        let changed = event["data"]["change"]["labels"].as_array().unwrap();
        assert_eq!(listed.len(), labels.len(), "{event:#}");
        assert_eq!(changed.len(), labels.len(), "{event:#}");
        for ((key, value), (text, change)) in labels.iter().zip(listed.iter().zip(changed)) {
            assert_eq!(*text, format!("{key}={value}"));
            assert_eq!(change, &json!({ "key": key, "value": value, "previous": null }));
        }

        // Acceptance: diag.nvml as a command; a pass adopts the node.
        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        assert_eq!(lifecycle.tick().await.unwrap().checks_queued, 1);
        let Ok(GatewayMessage::Command {
            id: check,
            kind,
            params,
            ..
        }) = next(&mut ws).await
        else {
            panic!("expected the acceptance check")
        };
        assert_eq!(
            (kind.to_string().as_str(), &params),
            ("diag.nvml", &json!({"level": 2}))
        );
        send(
            &mut ws,
            &DaemonMessage::CommandStarted { id: check.clone() },
        )
        .await;
        send(
            &mut ws,
            &DaemonMessage::CommandResult {
                id: check,
                outcome: Outcome::Succeeded,
                exit_code: Some(0),
                output: "PASS".into(),
                result: Some(json!({"passed": true, "failures": []})),
            },
        )
        .await;
        wait_until(async || {
            lifecycle.tick().await.unwrap();
            detail(s, &id).await["provisionState"] == "ADOPTED"
        })
        .await;

        // NodeSpec: generation 1 goes to the daemon, which converges.
        wait_until(async || {
            lifecycle.tick().await.unwrap();
            detail(s, &id).await["generation"] == 1
        })
        .await;
        let Ok(GatewayMessage::Spec { spec }) = next(&mut ws).await else {
            panic!("expected a spec")
        };
        assert_eq!(spec.generation, 1);
        let before = detail(s, &id).await;
        assert_eq!(before["schedulability"]["bucket"], "PROVISIONING");
        send(&mut ws, &DaemonMessage::Converged { generation: 1 }).await;
        wait_until(async || detail(s, &id).await["observedGeneration"] == 1).await;
        let node = detail(s, &id).await;
        assert_eq!(node["schedulability"]["schedulable"], true, "{node:#}");
        assert_eq!(node["schedulability"]["bucket"], "SCHEDULABLE");
    })
    .await;
}

#[tokio::test]
async fn seven_of_eight_gpus_is_unschedulable_with_gpu_count_mismatch_in_its_explanation() {
    each_backend(async |s| {
        let (machine, id, cert) = joined(s, 8).await;
        let (_ws, _) = session_with(s, &cert, &machine, &gpus(7, &[]), 0).await;
        wait_until(async || detail(s, &id).await["gpuCount"] == 7).await;
        let node = detail(s, &id).await;
        let mismatch = condition(&node, "GpuCountMismatch");
        assert_eq!(mismatch["status"], "TRUE");
        assert_eq!(mismatch["reason"], "Expected8Got7");
        assert!(
            node["noScheduleReasons"]
                .as_array()
                .unwrap()
                .contains(&json!("GpuCountMismatch"))
        );
        let explained = &node["schedulability"];
        assert_eq!(explained["schedulable"], false);
        let checks: Vec<&str> = explained["failingChecks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["check"].as_str().unwrap())
            .collect();
        assert!(checks.contains(&"NO_REASONS"), "{explained:#}");
        let reason = explained["reasons"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["reason"] == "GpuCountMismatch")
            .unwrap();
        assert_eq!(reason["setBy"], "controller:inventory");
        assert!(
            reason["clearedBy"]
                .as_str()
                .unwrap()
                .contains("a fresh gpus report no longer shows the evidence")
        );
    })
    .await;
}

#[tokio::test]
async fn a_failing_diagnostic_ends_failed_with_maintenance_on_and_a_recovered_node_is_checked_again()
 {
    each_backend(async |s| {
        let (machine, id, cert) = joined(s, 8).await;
        let (mut ws, _) = session_with(s, &cert, &machine, &gpus(8, &[]), 0).await;
        wait_until(async || detail(s, &id).await["gpuCount"] == 8).await;
        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        lifecycle.tick().await.unwrap();
        let Ok(GatewayMessage::Command { id: check, .. }) = next(&mut ws).await else { panic!("expected the acceptance check") };
        let failures = json!({"passed": false, "failures": [{"gpu": 3, "test": "memory", "message": "GPU 3: memory test found uncorrectable errors"}]});
        send(&mut ws, &DaemonMessage::CommandResult { id: check.clone(), outcome: Outcome::Failed, exit_code: Some(1), output: "FAIL".into(), result: Some(failures) }).await;
        wait_until(async || {
            lifecycle.tick().await.unwrap();
            detail(s, &id).await["provisionState"] == "FAILED"
        })
        .await;
        let node = detail(s, &id).await;
        assert_eq!(node["failedFrom"], "ADOPTING");
        assert_eq!(node["maintenance"], true);
        assert!(node["maintenanceReason"].as_str().unwrap().contains("GPU 3: memory test"), "{node:#}");
        let kept = s.admin("query($id: ID!) { command(id: $id) { status exitCode result } }", json!({"id": check})).await;
        assert_eq!(kept["command"]["result"]["failures"][0]["gpu"], 3);
        // No second check is queued for a failed node.
        assert_eq!(lifecycle.tick().await.unwrap().checks_queued, 0);

        // An operator recovers it (the GPU was reseated): it is checked again, not failed
        // again on the old check's evidence, and a passing check adopts it.
        let version = detail(s, &id).await["version"].clone();
        let recovered = s
            .admin(
                "mutation($id: ID!, $v: Int!) { transitionNode(input: {id: $id, version: $v, move: RECOVER, reason: \"GPU 3 reseated\"}) { node { provisionState maintenance } } }",
                json!({"id": id, "v": version}),
            )
            .await;
        assert_eq!(recovered["transitionNode"]["node"]["provisionState"], "ADOPTING");
        let report = lifecycle.tick().await.unwrap();
        assert_eq!((report.checks_queued, report.failed), (1, 0), "{report:?}");
        assert_eq!(detail(s, &id).await["provisionState"], "ADOPTING");
        let Ok(GatewayMessage::Command { id: second, .. }) = next(&mut ws).await else { panic!("expected a second acceptance check") };
        assert_ne!(second, check);
        send(&mut ws, &DaemonMessage::CommandResult { id: second, outcome: Outcome::Succeeded, exit_code: Some(0), output: "PASS".into(), result: Some(json!({"passed": true, "failures": []})) }).await;
        wait_until(async || {
            lifecycle.tick().await.unwrap();
            detail(s, &id).await["provisionState"] == "ADOPTED"
        })
        .await;
    })
    .await;
}

#[tokio::test]
async fn xid_evidence_sets_a_condition_that_a_report_without_it_does_not_clear() {
    each_backend(async |s| {
        let (machine, id, cert) = joined(s, 8).await;
        let bad = gpus(8, &[(2, 48), (5, 13)]);
        let (ws, _) = session_with(s, &cert, &machine, &bad, 0).await;
        wait_until(async || detail(s, &id).await["gpuCount"] == 8).await;
        let node = detail(s, &id).await;
        assert_eq!(condition(&node, "GpuNeedsReset")["status"], "TRUE");
        assert_eq!(condition(&node, "GpuNeedsReboot")["status"], "FALSE");
        assert!(node["noScheduleReasons"].as_array().unwrap().contains(&json!("GpuNeedsReset")));
        assert_eq!(node["devices"].as_array().unwrap().iter().filter(|d| d["healthy"] == false).count(), 1);
        drop(ws);
        // The next report carries no XIDs: the evidence is gone, but a GPU that needed a
        // reset is trusted again only on proof (server/tests/it/proof.rs), so the condition
        // and its reason stay, and the event log says the evidence went.
        wait_until(async || detail(s, &id).await["noScheduleReasons"].as_array().is_some()).await;
        let (_ws, _) = session_with(s, &cert, &machine, &gpus(8, &[]), 0).await;
        let gone = async || {
            let events = s
                .admin("query($id: ID!) { node(id: $id) { events(first: 50) { edges { node { type to data } } } } }", json!({"id": id}))
                .await;
            events["node"]["events"]["edges"].as_array().unwrap().iter().any(|e| e["node"]["type"] == "node.condition_evidence_gone")
        };
        wait_until(gone).await;
        let node = detail(s, &id).await;
        assert_eq!(condition(&node, "GpuNeedsReset")["status"], "TRUE");
        assert!(node["noScheduleReasons"].as_array().unwrap().contains(&json!("GpuNeedsReset")));
        // The devices follow the report: every GPU is healthy again.
        assert!(node["devices"].as_array().unwrap().iter().all(|d| d["healthy"] == true));
    })
    .await;
}
