//! What a pool expects of its machines, through the real gateway (the raw client plays the
//! daemon, controllers are ticked by hand): the acceptance checks and levels it lists, a
//! machine reporting no GPUs (adopted in a CPU pool, failed with a reason in a GPU pool),
//! every inventory section as labels, `GpuModelMismatch` and `DriverVersionMismatch` against
//! the pool's expectations (following `updatePool` at once), and inventory's labels refused
//! to operators with `RESERVED_LABEL`.

use crate::raw_daemon::*;
use bc_core::protocol::{DaemonMessage, GatewayMessage, section_hash};
use bc_testing::{TestServer, each_backend};
use better_compute::controllers::LifecycleController;
use serde_json::{Value, json};
use std::collections::BTreeMap;

const POOL_FIELDS: &str = "id expectedGpuCount expectedGpuModel expectedDriverVersion
    acceptance { checks { check level description } }";

/// A `gpus` section of `count` H100s on `driver`.
fn gpus(count: usize, driver: &str) -> Value {
    let devices: Vec<Value> = (0..count)
        .map(|i| {
            json!({
                "index": i, "uuid": format!("GPU-{i}-{}", uuid::Uuid::new_v4().simple()),
                "pciBusId": format!("00000000:{:02x}:00.0", 0x18 + i),
                "name": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "xidErrors": [],
                "eccErrors": {"volatileUncorrectable": 0}, "retiredPages": 0,
            })
        })
        .collect();
    if count == 0 {
        return json!({"count": 0, "devices": []});
    }
    json!({"count": count, "model": "NVIDIA H100 80GB HBM3", "driverVersion": driver, "cudaVersion": "12.4", "devices": devices})
}

/// The other sections bcd reports.
fn machine_sections(driver: Option<&str>) -> BTreeMap<String, Value> {
    let mut drivers =
        json!({"ofed": "MLNX_OFED_LINUX-24.01-0.3.3.1", "kernel": "5.15.0-105-generic"});
    if let Some(driver) = driver {
        drivers["nvidia"] = json!(driver);
    }
    BTreeMap::from([
        (
            "cpu".to_owned(),
            json!({"model": "AMD EPYC 9654 96-Core Processor", "architecture": "x86_64",
                   "sockets": 2, "coresPerSocket": 96, "threadsPerCore": 2, "numaNodes": 2}),
        ),
        (
            "memory".to_owned(),
            json!({"totalBytes": 1_649_267_441_664_u64, "type": "DDR5", "speedMTs": 4800}),
        ),
        (
            "disks".to_owned(),
            json!({"devices": [{"name": "nvme0n1", "sizeBytes": 1_920_383_410_176_u64}]}),
        ),
        ("drivers".to_owned(), drivers),
    ])
}

async fn create_pool(s: &TestServer, site: &str, input: Value) -> Value {
    let mut input = input;
    input["siteId"] = json!(site);
    input["name"] = json!(format!(
        "pool-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    input["kind"] = json!("METAL_HOST");
    s.admin(
        &format!(
            "mutation($input: CreatePoolInput!) {{ createPool(input: $input) {{ pool {{ {POOL_FIELDS} }} }} }}"
        ),
        json!({ "input": input }),
    )
    .await["createPool"]["pool"]
        .clone()
}

async fn update_pool(s: &TestServer, input: Value) -> Value {
    s.admin(
        &format!(
            "mutation($input: UpdatePoolInput!) {{ updatePool(input: $input) {{ pool {{ {POOL_FIELDS} }} }} }}"
        ),
        json!({ "input": input }),
    )
    .await["updatePool"]["pool"]
        .clone()
}

async fn site(s: &TestServer) -> String {
    s.admin(
        "mutation($name: String!) { createSite(input: {name: $name, kind: PLATFORM}) { site { id } } }",
        json!({ "name": format!("site-{}", uuid::Uuid::new_v4().simple()) }),
    )
    .await["createSite"]["site"]["id"]
        .as_str()
        .expect("a site id")
        .to_owned()
}

/// A machine joined to `pool`: its id, with a session that reported `sections` (every one
/// the gateway asked for).
struct Joined {
    id: String,
    ws: Ws,
}

async fn join_with(
    s: &TestServer,
    site: &str,
    pool: &str,
    sections: &BTreeMap<String, Value>,
) -> Joined {
    let secret = s.join_token(site, Some(pool), 1).await;
    let machine = Machine::new();
    let hostname = format!("gpu-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]);
    let issued = join(s, &machine, &secret, &hostname).await;
    let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
        .await
        .expect("a session");
    let hashes = sections
        .iter()
        .map(|(name, content)| (name.clone(), section_hash(content)))
        .collect();
    send(
        &mut ws,
        &DaemonMessage::Hello {
            daemon_version: "test".into(),
            inventory_hashes: hashes,
            observed_generation: 0,
        },
    )
    .await;
    let Ok(GatewayMessage::Welcome { want_sections, .. }) = next(&mut ws).await else {
        panic!("expected welcome")
    };
    for section in &want_sections {
        let content = &sections[section];
        send(
            &mut ws,
            &DaemonMessage::Inventory {
                section: section.clone(),
                hash: section_hash(content),
                content: content.clone(),
            },
        )
        .await;
    }
    let id = issued.node_id;
    // Every section stored: the node carries the label each one gives.
    let expected = sections.len();
    wait_until(async || reported_sections(&detail(s, &id).await) == expected).await;
    Joined { id, ws }
}

/// How many of the sections `join_with` sends show in the node's labels.
fn reported_sections(node: &Value) -> usize {
    let labels = labels(node);
    [
        "gpu-count",
        "cpu-model",
        "memory-gib",
        "disk-count",
        "driver-kernel",
    ]
    .iter()
    .filter(|name| labels.contains_key(&format!("inventory.bettercompute.io/{name}")))
    .count()
}

async fn detail(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { node(id: $id) { id version provisionState failedFrom maintenance maintenanceReason gpuCount noScheduleReasons
            labels { key value } conditions { type status reason message clearWhen { description } }
            commands(first: 10) { edges { node { kind params } } } } }",
        json!({"id": id}),
    )
    .await["node"]
        .clone()
}

fn labels(node: &Value) -> BTreeMap<String, String> {
    node["labels"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| {
            Some((
                l["key"].as_str()?.to_owned(),
                l["value"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

fn condition(node: &Value, kind: &str) -> Value {
    node["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == kind)
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} in {node:#}"))
}

fn reasons(node: &Value) -> Vec<String> {
    node["noScheduleReasons"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r.as_str().map(str::to_owned))
        .collect()
}

fn commands(node: &Value) -> Vec<Value> {
    node["commands"]["edges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["node"].clone())
        .collect()
}

fn gpu_sections(count: usize, driver: &str) -> BTreeMap<String, Value> {
    let mut sections = machine_sections((count > 0).then_some(driver));
    sections.insert("gpus".to_owned(), gpus(count, driver));
    sections
}

#[tokio::test]
async fn acceptance_runs_the_checks_and_level_the_pool_lists() {
    each_backend(async |s| {
        let site = site(s).await;
        let deep = create_pool(
            s,
            &site,
            json!({"expectedGpuCount": 8, "acceptance": {"checks": [
                {"check": "HARDWARE_PROFILE"}, {"check": "GPU_DIAGNOSTIC", "level": 3}]}}),
        )
        .await;
        assert_eq!(
            deep["acceptance"]["checks"],
            json!([
                {"check": "HARDWARE_PROFILE", "level": null, "description": "the hardware matches the pool's profile"},
                {"check": "GPU_DIAGNOSTIC", "level": 3, "description": "diag.nvml level 3 passes"},
            ])
        );
        let trusted = create_pool(s, &site, json!({"expectedGpuCount": 8, "acceptance": {"checks": []}})).await;
        let default = create_pool(s, &site, json!({"expectedGpuCount": 8})).await;
        assert_eq!(
            default["acceptance"]["checks"],
            json!([{"check": "GPU_DIAGNOSTIC", "level": 2, "description": "diag.nvml level 2 passes"}])
        );
        let pool_id = |p: &Value| p["id"].as_str().expect("a pool id").to_owned();

        let mut checked = join_with(s, &site, &pool_id(&deep), &gpu_sections(8, "550.54.15")).await;
        let vouched = join_with(s, &site, &pool_id(&trusted), &gpu_sections(8, "550.54.15")).await;
        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        let report = lifecycle.tick().await.expect("a lifecycle pass");
        assert_eq!((report.checks_queued, report.adopted), (1, 1), "{report:?}");
        let Ok(GatewayMessage::Command { kind, params, .. }) = next(&mut checked.ws).await else {
            panic!("expected the acceptance check")
        };
        assert_eq!((kind.to_string(), params), ("diag.nvml".to_owned(), json!({"level": 3})));
        // A pool without checks adopts the node as soon as it reported its GPUs.
        let node = detail(s, &vouched.id).await;
        assert_eq!(node["provisionState"], "ADOPTED");
        assert!(commands(&node).is_empty(), "{node:#}");

        // The pool's checks can change (a diagnostic without a level runs at level 2); a
        // node in acceptance is judged by them from the next pass.
        let shallower = update_pool(
            s,
            json!({"id": pool_id(&deep), "acceptance": {"checks": [{"check": "GPU_DIAGNOSTIC"}]}}),
        )
        .await;
        assert_eq!(shallower["acceptance"]["checks"][0]["level"], 2);
        // A policy the domain cannot run is refused, naming why.
        let twice = s
            .gql(
                Some(s.admin_token()),
                "mutation($input: UpdatePoolInput!) { updatePool(input: $input) { pool { id } } }",
                json!({"input": {"id": pool_id(&deep), "acceptance": {"checks": [
                    {"check": "GPU_DIAGNOSTIC"}, {"check": "GPU_DIAGNOSTIC", "level": 1}]}}}),
            )
            .await;
        assert_eq!(twice.code(), Some("BAD_USER_INPUT"), "{:#}", twice.body);
        let deeper = s
            .gql(
                Some(s.admin_token()),
                "mutation($input: UpdatePoolInput!) { updatePool(input: $input) { pool { id } } }",
                json!({"input": {"id": pool_id(&deep), "acceptance": {"checks": [{"check": "GPU_DIAGNOSTIC", "level": 4}]}}}),
            )
            .await;
        assert_eq!(deeper.code(), Some("BAD_USER_INPUT"), "{:#}", deeper.body);
    })
    .await;
}

#[tokio::test]
async fn a_machine_without_gpus_is_adopted_in_a_cpu_pool_and_failed_with_a_reason_in_a_gpu_pool() {
    each_backend(async |s| {
        let site = site(s).await;
        let cpu = create_pool(s, &site, json!({"expectedGpuCount": 0})).await;
        let gpu = create_pool(
            s,
            &site,
            json!({"expectedGpuCount": 8, "expectedGpuModel": "NVIDIA H100 80GB HBM3"}),
        )
        .await;
        let unsaid = create_pool(s, &site, json!({})).await;
        let pool_id = |p: &Value| p["id"].as_str().expect("a pool id").to_owned();
        let bare = gpu_sections(0, "");
        let in_cpu = join_with(s, &site, &pool_id(&cpu), &bare).await;
        let in_gpu = join_with(s, &site, &pool_id(&gpu), &bare).await;
        let in_unsaid = join_with(s, &site, &pool_id(&unsaid), &bare).await;

        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        let report = lifecycle.tick().await.expect("a lifecycle pass");
        assert_eq!(
            (report.checks_queued, report.adopted, report.failed),
            (0, 1, 2),
            "{report:?}"
        );
        // The CPU machine: adopted without a GPU diagnostic, and schedulable-to-be.
        let node = detail(s, &in_cpu.id).await;
        assert_eq!(node["provisionState"], "ADOPTED", "{node:#}");
        assert_eq!(node["gpuCount"], 0);
        assert!(commands(&node).is_empty(), "{node:#}");
        assert_eq!(condition(&node, "GpuCountMismatch")["status"], "FALSE");
        assert!(reasons(&node).is_empty(), "{node:#}");
        // The GPU pool's: failed at once, maintenance on, the reason saying why.
        let node = detail(s, &in_gpu.id).await;
        assert_eq!(
            (
                &node["provisionState"],
                &node["failedFrom"],
                &node["maintenance"]
            ),
            (&json!("FAILED"), &json!("ADOPTING"), &json!(true)),
            "{node:#}"
        );
        let why = node["maintenanceReason"].as_str().expect("a reason");
        assert!(why.contains("reports no GPUs"), "{why}");
        assert!(why.contains("8 NVIDIA H100 80GB HBM3 GPUs"), "{why}");
        assert_eq!(condition(&node, "GpuModelMismatch")["reason"], "NoGpus");
        // A pool that says nothing about GPUs holds GPU machines: a machine without them
        // (whose driver did not load, say) is not adopted as healthy.
        let node = detail(s, &in_unsaid.id).await;
        assert_eq!(node["provisionState"], "FAILED", "{node:#}");
        // Nothing is left adopting, and nothing changes on the next pass.
        let again = lifecycle.tick().await.expect("a lifecycle pass");
        assert_eq!(
            (again.checks_queued, again.adopted, again.failed),
            (0, 0, 0)
        );
    })
    .await;
}

#[tokio::test]
async fn every_section_becomes_labels_and_mismatches_follow_the_pools_expectations() {
    each_backend(async |s| {
        let site = site(s).await;
        let pool = create_pool(
            s,
            &site,
            json!({"expectedGpuCount": 8, "expectedGpuModel": "NVIDIA H100 80GB HBM3", "expectedDriverVersion": "535"}),
        )
        .await;
        assert_eq!(pool["expectedDriverVersion"], "535");
        let pool_id = pool["id"].as_str().expect("a pool id").to_owned();
        let joined = join_with(s, &site, &pool_id, &gpu_sections(8, "550.54.15")).await;
        let node = detail(s, &joined.id).await;
        let labels = labels(&node);
        for (name, value) in [
            ("gpu-count", "8"),
            ("gpu-model", "NVIDIA-H100-80GB-HBM3"),
            ("gpu-memory-mib", "81559"),
            ("gpu-driver", "550.54.15"),
            ("cpu-model", "AMD-EPYC-9654-96-Core-Processor"),
            ("cpu-cores", "192"),
            ("cpu-threads", "384"),
            ("numa-nodes", "2"),
            ("memory-gib", "1536"),
            ("memory-type", "DDR5"),
            ("disk-count", "1"),
            ("disk-total-gib", "1788"),
            ("driver-nvidia", "550.54.15"),
            ("driver-ofed", "MLNX_OFED_LINUX-24.01-0.3.3.1"),
        ] {
            assert_eq!(
                labels.get(&format!("inventory.bettercompute.io/{name}")).map(String::as_str),
                Some(value),
                "{name}: {labels:#?}"
            );
        }
        // The driver is not the pool's: NoSchedule, with the rule that clears it.
        let mismatch = condition(&node, "DriverVersionMismatch");
        assert_eq!(
            (&mismatch["status"], &mismatch["reason"], &mismatch["message"]),
            (
                &json!("TRUE"),
                &json!("UnexpectedVersion"),
                &json!("the pool expects NVIDIA driver 535; this machine runs 550.54.15")
            )
        );
        assert!(
            mismatch["clearWhen"]["description"]
                .as_str()
                .expect("a rule")
                .contains("gpus or drivers report"),
            "{mismatch:#}"
        );
        assert_eq!(condition(&node, "GpuModelMismatch")["status"], "FALSE");
        assert_eq!(reasons(&node), vec!["DriverVersionMismatch".to_owned()]);

        // The pool moves to the 550 branch: the node is compared again at once.
        let moved = update_pool(s, json!({"id": pool_id, "expectedDriverVersion": "550"})).await;
        assert_eq!(moved["expectedDriverVersion"], "550");
        let node = detail(s, &joined.id).await;
        assert_eq!(condition(&node, "DriverVersionMismatch")["status"], "FALSE");
        assert!(reasons(&node).is_empty(), "{node:#}");

        // The pool now expects another model: every GPU is named.
        update_pool(s, json!({"id": pool_id, "expectedGpuModel": "NVIDIA A100-SXM4-80GB"})).await;
        let node = detail(s, &joined.id).await;
        let model = condition(&node, "GpuModelMismatch");
        assert_eq!(model["status"], "TRUE");
        assert_eq!(
            model["message"],
            "the pool expects NVIDIA A100-SXM4-80GB; gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, gpu7 are NVIDIA H100 80GB HBM3"
        );
        assert_eq!(reasons(&node), vec!["GpuModelMismatch".to_owned()]);
        // Removing the expectations (null) leaves the conditions unknown, and nothing in
        // the way of work; an omitted field stays as it was.
        let cleared = update_pool(
            s,
            json!({"id": pool_id, "expectedGpuModel": null, "expectedDriverVersion": null}),
        )
        .await;
        assert_eq!(
            (&cleared["expectedGpuModel"], &cleared["expectedDriverVersion"], &cleared["expectedGpuCount"]),
            (&Value::Null, &Value::Null, &json!(8))
        );
        let node = detail(s, &joined.id).await;
        assert_eq!(condition(&node, "GpuModelMismatch")["status"], "UNKNOWN");
        assert_eq!(condition(&node, "DriverVersionMismatch")["status"], "UNKNOWN");
        assert!(reasons(&node).is_empty(), "{node:#}");
        // A version that cannot be compared is refused.
        let bad = s
            .gql(
                Some(s.admin_token()),
                "mutation($input: UpdatePoolInput!) { updatePool(input: $input) { pool { id } } }",
                json!({"input": {"id": pool_id, "expectedDriverVersion": "550 beta"}}),
            )
            .await;
        assert_eq!(bad.code(), Some("BAD_USER_INPUT"), "{:#}", bad.body);
        // Each change is in the log as the pool's.
        let events = s
            .admin(
                "{ events(first: 20, filter: {types: [POOL_UPDATED]}) { edges { node { data } } } }",
                json!({}),
            )
            .await;
        let updates = events["events"]["edges"].as_array().map_or(0, Vec::len);
        assert_eq!(updates, 3, "{events:#}");
    })
    .await;
}

#[tokio::test]
async fn a_hardware_profile_check_fails_a_machine_that_does_not_match() {
    each_backend(async |s| {
        let site = site(s).await;
        let pool = create_pool(
            s,
            &site,
            json!({"expectedGpuCount": 8, "expectedDriverVersion": "550.54.15",
                   "acceptance": {"checks": [{"check": "HARDWARE_PROFILE"}, {"check": "GPU_DIAGNOSTIC", "level": 1}]}}),
        )
        .await;
        let pool_id = pool["id"].as_str().expect("a pool id").to_owned();
        let old_driver = join_with(s, &site, &pool_id, &gpu_sections(8, "535.161.08")).await;
        let mut lifecycle = LifecycleController::new(s.server.services.clone());
        let report = lifecycle.tick().await.expect("a lifecycle pass");
        assert_eq!((report.checks_queued, report.failed), (0, 1), "{report:?}");
        let node = detail(s, &old_driver.id).await;
        assert_eq!(node["provisionState"], "FAILED");
        let why = node["maintenanceReason"].as_str().expect("a reason");
        assert!(
            why.contains("the hardware does not match the pool (DriverVersionMismatch: the pool expects NVIDIA driver 550.54.15; this machine runs 535.161.08)"),
            "{why}"
        );
    })
    .await;
}

#[tokio::test]
async fn inventory_labels_are_refused_to_operators_with_reserved_label() {
    each_backend(async |s| {
        let site = site(s).await;
        let pool = create_pool(s, &site, json!({"expectedGpuCount": 8})).await;
        let pool_id = pool["id"].as_str().expect("a pool id").to_owned();
        let joined = join_with(s, &site, &pool_id, &gpu_sections(8, "550.54.15")).await;
        let label = "mutation($id: ID!, $v: Int!, $set: [LabelInput!]!, $remove: [String!]!) {
            labelNode(input: {id: $id, version: $v, set: $set, remove: $remove}) { node { version labels { key value } } } }";
        let version = detail(s, &joined.id).await["version"].clone();
        for (set, remove) in [
            (json!([{"key": "inventory.bettercompute.io/gpu-model", "value": "A100"}]), json!([])),
            (json!([{"key": "team", "value": "ml"}]), json!(["inventory.bettercompute.io/gpu-count"])),
        ] {
            let refused = s
                .gql(
                    Some(s.admin_token()),
                    label,
                    json!({"id": joined.id, "v": version, "set": set, "remove": remove}),
                )
                .await;
            assert_eq!(refused.code(), Some("RESERVED_LABEL"), "{:#}", refused.body);
            let extensions = &refused.body["errors"][0]["extensions"];
            assert_eq!(extensions["owner"], "inventory");
            assert!(
                extensions["label"]
                    .as_str()
                    .is_some_and(|k| k.starts_with("inventory.bettercompute.io/")),
                "{extensions:#}"
            );
        }
        // Nothing changed, and the operator's own labels still work beside inventory's.
        let node = detail(s, &joined.id).await;
        assert_eq!(node["version"], version);
        let labelled = s
            .admin(label, json!({"id": joined.id, "v": version, "set": [{"key": "team", "value": "ml"}], "remove": []}))
            .await;
        let after = labels(&labelled["labelNode"]["node"]);
        assert_eq!(after.get("team").map(String::as_str), Some("ml"));
        assert_eq!(
            after.get("inventory.bettercompute.io/gpu-model").map(String::as_str),
            Some("NVIDIA-H100-80GB-HBM3")
        );
    })
    .await;
}
