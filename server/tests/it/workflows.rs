//! Bare-metal workflows (issue 14, item 3) against OpenStack's Redfish emulator: inspect
//! (network boot once, power on, the ramdisk daemon joins as the enrolled node, identifiers
//! checked), commission (burn-in `diag.nvml`, firmware facts, power off), deploy (the image
//! as virtual media, the installed system's daemon), release and retire (the ramdisk wipes
//! the disks), rescue; abort, timeouts and `recover`; a restart in the middle; and a machine
//! whose identifiers contradict its enrolment (item 7). The harness plays the machine: when a
//! workflow waits for the machine's daemon and the emulator reports the system on, it boots
//! the machine (its previous daemon stops, a FakeDaemon with the machine's identifiers
//! starts), as the ramdisk or system the workflow booted would; when the emulator reports
//! the system off, its daemon stops. The Workflow controller is ticked by hand, time moved
//! with the test clock.

use crate::common::poll_until;
use bc_core::ids::{PoolId, SiteId};
use bc_core::workflow::AWAIT_DAEMON_TIMEOUT;
use bc_testing::bmc::{SushyEmulator, SushyOptions, SushySystem};
use bc_testing::daemon::GatewayContext;
use bc_testing::metal::{BootSource, MetalFleet, MetalOptions, MetalPlace, SimMachine};
use bc_testing::{
    Backend, CaTrust, DaemonKnobs, FakeDaemon, Gql, TestServer, each_backend, each_backend_with,
};
use better_compute::controllers::{WorkflowController, WorkflowReport};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const VIEW: &str = "bareMetalNode { node { id version provisionState failedFrom maintenance maintenanceReason identityGeneration connectivity } power workflow { id kind status reason startedBy currentStep steps { kind status attempts maxAttempts timeoutSeconds startedAt finishedAt deadline commandId log { at message } } } workflows { id kind status } }";

/// The most real time a workflow may take here: the emulator answers in milliseconds and
/// a FakeDaemon joins in well under a second, so this only bounds a broken run.
const LIMIT: Duration = Duration::from_secs(60);
/// How long [`tick_until`] waits between ticks.
const POLL_PAUSE: Duration = Duration::from_millis(100);

/// The deploy image the pools of these tests name (`drivers.deploy`).
const IMAGE: &str = "ubuntu-24.04";

struct Place {
    site: String,
    pool: String,
}

async fn metal_pool(s: &TestServer) -> Place {
    let (site, pool) = crate::common::metal_pool(s, "redfish").await;
    Place { site, pool }
}

/// A pool whose machines deploy [`IMAGE`] (and power through Redfish).
async fn imaged_pool(s: &TestServer) -> Place {
    let site = s
        .admin(
            "mutation($name: String!) { createSite(input: {name: $name, kind: PLATFORM}) { site { id } } }",
            json!({ "name": format!("dc-{}", uuid::Uuid::new_v4().simple()) }),
        )
        .await["createSite"]["site"]["id"]
        .as_str()
        .expect("site id")
        .to_owned();
    let pool = s
        .admin(
            "mutation($site: ID!, $image: String!) { createPool(input: {siteId: $site, name: \"metal\", kind: METAL_HOST, drivers: [{key: \"power\", value: \"redfish\"}, {key: \"deploy\", value: $image}]}) { pool { id } } }",
            json!({ "site": site, "image": IMAGE }),
        )
        .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("pool id")
        .to_owned();
    Place { site, pool }
}

/// Serves a small stand-in for an ISO image over plain HTTP on a free port, as an image
/// server would, until the test ends; answers its address.
async fn image_server() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let address = listener.local_addr().expect("an address");
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buffer[..n]),
                    }
                }
                let body = b"CD001 a deploy image";
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    format!("http://{address}/{IMAGE}.iso")
}

/// The machine behind emulator system `n`: its identifiers as its daemon reports them.
fn machine(n: u32) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("system-uuid".to_owned(), SushySystem::numbered(n).uuid),
        ("board-serial".to_owned(), format!("BSN-WF-{n:04}")),
        ("mac:eno1".to_owned(), format!("b8:ce:f6:00:10:{n:02x}")),
    ])
}

/// Enrols emulator system `n` by the emulator's BMC with the machine's identifiers.
async fn enroll(s: &TestServer, place: &Place, emulator: &SushyEmulator, n: u32) -> String {
    let identifiers: Vec<Value> = machine(n)
        .into_iter()
        .map(|(name, value)| json!({ "name": name.split(':').next(), "value": value }))
        .collect();
    let answer = s
        .gql(
            Some(s.admin_token()),
            "mutation($input: EnrollBareMetalNodeInput!) { enrollBareMetalNode(input: $input) { bareMetalNode { node { id } } } }",
            json!({ "input": {
                "hostname": format!("metal-wf-{n}.dc1.example.com"),
                "siteId": place.site, "poolId": place.pool,
                "bmc": {
                    "address": emulator.url, "systemId": SushySystem::numbered(n).uuid,
                    "username": emulator.options.username, "password": emulator.options.password,
                    "caCertificate": emulator.ca_pem,
                },
                "identifiers": identifiers,
            } }),
        )
        .await;
    answer.data()["enrollBareMetalNode"]["bareMetalNode"]["node"]["id"]
        .as_str()
        .expect("a node id")
        .to_owned()
}

async fn view(s: &TestServer, id: &str) -> Value {
    s.admin(
        &format!(
            "query($id: ID!) {{ {} }}",
            VIEW.replacen("bareMetalNode", "bareMetalNode(id: $id)", 1)
        ),
        json!({ "id": id }),
    )
    .await["bareMetalNode"]
        .clone()
}

fn version(v: &Value) -> i64 {
    v["node"]["version"].as_i64().expect("a version")
}

/// `transitionNode` with the version the node is at.
async fn transition(s: &TestServer, id: &str, action: &str) -> Gql {
    let v = view(s, id).await;
    s.gql(
        Some(s.admin_token()),
        "mutation($input: TransitionNodeInput!) { transitionNode(input: $input) { node { provisionState } } }",
        json!({ "input": { "id": id, "version": version(&v), "move": action } }),
    )
    .await
}

async fn abort(s: &TestServer, id: &str, version: i64, reason: &str) -> Gql {
    s.gql(
        Some(s.admin_token()),
        &format!(
            "mutation($input: AbortWorkflowInput!) {{ abortWorkflow(input: $input) {{ {VIEW} }} }}"
        ),
        json!({ "input": { "id": id, "version": version, "reason": reason } }),
    )
    .await
}

async fn tick(s: &TestServer) -> WorkflowReport {
    WorkflowController::new(s.server.services.clone())
        .tick()
        .await
        .unwrap_or_else(|err| panic!("workflow tick: {}", err.message()))
}

/// A command as the API shows it.
async fn command(s: &TestServer, id: &str) -> Value {
    s.admin(
        "query($id: ID!) { command(id: $id) { id kind status params output result error createdBy } }",
        json!({ "id": id }),
    )
    .await["command"]
        .clone()
}

/// The kinds of the commands sent to node `id`, oldest first.
async fn command_kinds(s: &TestServer, id: &str) -> Vec<String> {
    let answer = s
        .admin(
            "query($id: ID!) { commands(filter: {nodeId: [$id]}, first: 100) { nodes { kind } } }",
            json!({ "id": id }),
        )
        .await;
    let mut kinds: Vec<String> = answer["commands"]["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|c| c["kind"].as_str().map(str::to_owned))
        .collect();
    kinds.reverse();
    kinds
}

/// The machine's side: the emulator's system `n`, and what it boots ([`SimMachine`], the
/// simulated bare metal's machine: a boot starts a daemon with the machine's identifiers).
/// The emulator runs no machine of its own, so this follows its power state.
struct Machine {
    n: u32,
    sim: SimMachine,
    /// The workflow whose boot started the daemon it runs.
    booted_for: Option<String>,
    /// Every daemon it started, by the kind of workflow that booted it.
    boots: Vec<String>,
}

impl Machine {
    fn new(n: u32) -> Machine {
        Machine {
            n,
            sim: SimMachine::new(DaemonKnobs {
                identifiers: Some(machine(n)),
                gpu_count: 8,
                ..DaemonKnobs::default()
            }),
            booted_for: None,
            boots: Vec::new(),
        }
    }

    /// The GPU diagnostic fails on this machine (at its next boot).
    fn fail_diagnostics(&mut self, fail: bool) {
        self.sim.knobs.fail_diagnostics = fail;
    }

    /// The identifiers its daemons report (at its next boot).
    fn identifiers_mut(&mut self) -> &mut BTreeMap<String, String> {
        self.sim.knobs.identifiers.get_or_insert_with(BTreeMap::new)
    }

    fn daemon(&self) -> Option<&FakeDaemon> {
        self.sim.daemon()
    }

    /// Follows the emulator: off, the daemon stops; on while the node's workflow waits for
    /// a daemon this boot has not started yet, it (re)boots into a new one.
    async fn react(&mut self, s: &TestServer, emulator: &SushyEmulator, place: &Place, v: &Value) {
        let power = emulator
            .power_state(&SushySystem::numbered(self.n).uuid)
            .await
            .expect("the emulator answers");
        if power != "On" {
            self.stop();
            return;
        }
        let workflow = &v["workflow"];
        let waits = workflow["status"] == "RUNNING"
            && workflow["steps"].as_array().is_some_and(|steps| {
                steps
                    .iter()
                    .any(|s| s["kind"] == "AWAIT_DAEMON" && s["status"] == "RUNNING")
            });
        let id = workflow["id"].as_str().map(str::to_owned);
        if waits && self.booted_for != id {
            self.boot(s, place).await;
            self.booted_for = id;
            self.boots
                .push(workflow["kind"].as_str().unwrap_or_default().to_owned());
        }
    }

    /// Starts the machine's daemon afresh (stopping the one it ran), as a boot would.
    async fn boot(&mut self, s: &TestServer, place: &Place) {
        let secret = s.join_token(&place.site, Some(&place.pool), 10).await;
        self.sim.boot(|knobs| {
            FakeDaemon::new(s.gateway_url(), secret, CaTrust::Pem(s.ca_pem())).with_knobs(knobs)
        });
    }

    /// Waits until the daemon it runs holds a session.
    async fn wait_connected(&self) {
        let started = Instant::now();
        while !self.daemon().is_some_and(|d| d.status().connected) {
            assert!(
                started.elapsed() < LIMIT,
                "the machine's daemon never connected"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn stop(&mut self) {
        self.sim.power_off();
    }

    fn wipes(&self) -> u64 {
        self.sim.wipes()
    }
}

/// Ticks the Workflow controller (the machine reacting to its power between ticks) until
/// `done` holds for the node's view.
async fn tick_until(
    s: &TestServer,
    id: &str,
    emulator: &SushyEmulator,
    place: &Place,
    mut machine: Option<&mut Machine>,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let step = async || {
        tick(s).await;
        let v = view(s, id).await;
        match machine.as_deref_mut() {
            Some(m) => {
                m.react(s, emulator, place, &v).await;
                view(s, id).await
            }
            None => v,
        }
    };
    poll_until(LIMIT, POLL_PAUSE, step, done).await
}

/// Ticks the Workflow controller until `done` holds for the node's view, with no harness
/// playing the machine: what its BMC does is all that happens to it.
async fn tick_alone(s: &TestServer, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let step = async || {
        tick(s).await;
        view(s, id).await
    };
    poll_until(LIMIT, POLL_PAUSE, step, done).await
}

/// Ticks until the workflow of `kind` has ended (the node may have started the next one).
async fn run_workflow(
    s: &TestServer,
    id: &str,
    emulator: &SushyEmulator,
    place: &Place,
    machine: Option<&mut Machine>,
    kind: &str,
) -> Value {
    let v = tick_until(s, id, emulator, place, machine, |v| {
        v["workflows"]
            .as_array()
            .and_then(|list| list.iter().find(|w| w["kind"] == kind))
            .is_some_and(|w| w["status"] != "RUNNING")
    })
    .await;
    let workflow = v["workflows"]
        .as_array()
        .and_then(|list| list.iter().find(|w| w["kind"] == kind))
        .cloned()
        .expect("the workflow");
    let one = s
        .admin(
            "query($id: ID!) { bareMetalNode(id: $id) { workflows { id kind status reason currentStep steps { kind status attempts startedAt finishedAt commandId log { message } } } } }",
            json!({ "id": id }),
        )
        .await;
    let full = one["bareMetalNode"]["workflows"]
        .as_array()
        .and_then(|list| list.iter().find(|w| w["id"] == workflow["id"]))
        .cloned()
        .expect("the workflow in full");
    json!({ "node": v["node"], "workflow": full, "current": v["workflow"] })
}

fn status(v: &Value) -> &str {
    v["workflow"]["status"].as_str().unwrap_or("")
}

fn step_statuses(v: &Value) -> Vec<String> {
    v["workflow"]["steps"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|s| {
            format!(
                "{}={}",
                s["kind"].as_str().unwrap_or(""),
                s["status"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// The log of step `kind`, its lines joined.
fn step_log(v: &Value, kind: &str) -> String {
    v["workflow"]["steps"]
        .as_array()
        .and_then(|steps| steps.iter().find(|s| s["kind"] == kind))
        .and_then(|s| s["log"].as_array())
        .map(|lines| {
            lines
                .iter()
                .filter_map(|l| l["message"].as_str())
                .collect::<Vec<_>>()
                .join(" | ")
        })
        .unwrap_or_default()
}

fn step_command(v: &Value, kind: &str) -> String {
    v["workflow"]["steps"]
        .as_array()
        .and_then(|steps| steps.iter().find(|s| s["kind"] == kind))
        .and_then(|s| s["commandId"].as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("{kind} has a command: {v:#}"))
}

async fn start_emulator(systems: u32) -> SushyEmulator {
    SushyEmulator::start(SushyOptions {
        systems: (1..=systems).map(SushySystem::numbered).collect(),
        ..SushyOptions::default()
    })
    .await
    .expect("the Redfish emulator starts (scripts/ensure-sushy installs it)")
}

async fn event_types(s: &TestServer, id: &str) -> Vec<String> {
    let events = s
        .admin(
            "query($id: ID!) { node(id: $id) { events(first: 100) { nodes { type } } } }",
            json!({ "id": id }),
        )
        .await;
    events["node"]["events"]["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| e["type"].as_str().map(str::to_owned))
        .collect()
}

/// The system's `Boot` and its virtual CD, as the emulator has them.
async fn boot_and_cd(emulator: &SushyEmulator, n: u32) -> (Value, Value) {
    let uuid = SushySystem::numbered(n).uuid;
    let system = emulator
        .get(&format!("/redfish/v1/Systems/{uuid}"))
        .await
        .expect("the system");
    let cd = emulator
        .get(&format!("/redfish/v1/Systems/{uuid}/VirtualMedia/Cd"))
        .await
        .expect("the virtual CD");
    (system["Boot"].clone(), cd)
}

/// Enrols system 1, inspects and commissions it: the node is `ready`, the machine off.
async fn to_ready(
    s: &TestServer,
    emulator: &SushyEmulator,
    place: &Place,
    machine: &mut Machine,
) -> String {
    let id = enroll(s, place, emulator, machine.n).await;
    transition(s, &id, "INSPECT").await.data();
    let inspected = run_workflow(s, &id, emulator, place, Some(&mut *machine), "INSPECT").await;
    assert_eq!(status(&inspected), "SUCCEEDED", "{inspected:#}");
    let commissioned =
        run_workflow(s, &id, emulator, place, Some(&mut *machine), "COMMISSION").await;
    assert_eq!(status(&commissioned), "SUCCEEDED", "{commissioned:#}");
    assert_eq!(commissioned["node"]["provisionState"], "READY");
    id
}

#[tokio::test]
async fn enrol_inspect_commission_deploy_release_and_retire_against_the_redfish_emulator() {
    let configured = image_server().await;
    each_backend_with(
        move |c| {
            c.bare_metal.images.insert(IMAGE.to_owned(), configured.clone());
        },
        async |s| {
            let emulator = start_emulator(1).await;
            let place = imaged_pool(s).await;
            let id = enroll(s, &place, &emulator, 1).await;
            let mut machine = Machine::new(1);

            // The operator's move starts the inspection in the same transaction.
            assert_eq!(transition(s, &id, "INSPECT").await.data()["transitionNode"]["node"]["provisionState"], "INSPECTING");
            let v = view(s, &id).await;
            assert_eq!(v["workflow"]["kind"], "INSPECT");
            assert_eq!(v["workflow"]["status"], "RUNNING");
            assert_eq!(v["workflow"]["startedBy"], "user:test-admin");
            assert_eq!(step_statuses(&v), ["BOOT_NETWORK_ONCE=PENDING", "POWER_ON=PENDING", "AWAIT_DAEMON=PENDING", "CHECK_IDENTIFIERS=PENDING"]);
            // While it runs, moves other than `fail` are refused.
            let refused = transition(s, &id, "COMMISSION").await;
            assert_eq!(refused.code(), Some("BAD_USER_INPUT"), "{:#}", refused.body);
            assert!(refused.message().contains("abortWorkflow"), "{}", refused.message());

            let inspected = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "INSPECT").await;
            assert_eq!(status(&inspected), "SUCCEEDED", "{inspected:#}");
            assert!(step_statuses(&inspected).iter().all(|s| s.ends_with("=SUCCEEDED")), "{inspected:#}");
            assert!(step_log(&inspected, "CHECK_IDENTIFIERS").contains("match its enrolment"), "{inspected:#}");
            let (boot, _) = boot_and_cd(&emulator, 1).await;
            assert_eq!(boot["BootSourceOverrideTarget"], "Pxe", "the inspection booted the network: {boot:#}");
            let daemon_node = machine.daemon().and_then(|d| d.status().node_id);
            assert_eq!(daemon_node.as_deref(), Some(id.as_str()), "the ramdisk's daemon is the enrolled node");
            assert_eq!(s.admin("{ nodes { totalCount } }", json!({})).await["nodes"]["totalCount"], 1);

            // The inspection's success moved the node to `commissioning` and started the
            // commissioning in the same transaction; the ramdisk's daemon runs its burn-in.
            let commissioned = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "COMMISSION").await;
            assert_eq!(status(&commissioned), "SUCCEEDED", "{commissioned:#}");
            assert_eq!(step_statuses(&commissioned), ["BURN_IN=SUCCEEDED", "RECORD_FIRMWARE=SUCCEEDED", "POWER_OFF=SUCCEEDED"]);
            assert_eq!(commissioned["node"]["provisionState"], "READY");
            assert_eq!(commissioned["node"]["identityGeneration"], 2, "the ramdisk joined once, in place");
            let burn_in = command(s, &step_command(&commissioned, "BURN_IN")).await;
            assert_eq!((burn_in["kind"].as_str(), burn_in["status"].as_str()), (Some("DIAG_NVML"), Some("SUCCEEDED")), "{burn_in:#}");
            assert_eq!(burn_in["params"]["level"], 2, "the pool's acceptance level: {burn_in:#}");
            assert_eq!(burn_in["createdBy"], "controller:workflow");
            assert!(step_log(&commissioned, "BURN_IN").contains("diag.nvml level 2"), "{commissioned:#}");
            let firmware = step_log(&commissioned, "RECORD_FIRMWARE");
            assert!(firmware.contains("BIOS 2.1") && firmware.contains("GPU VBIOS 96.00.99.00.01 on 8 GPU(s)"), "{firmware}");
            assert_eq!(emulator.power_state(&SushySystem::numbered(1).uuid).await.expect("read"), "Off");
            assert!(machine.daemon().is_none(), "the machine is off");

            // Deploy: the pool's image as the BMC's virtual CD, booted once; the installed
            // system's daemon joins with a new identity generation.
            transition(s, &id, "DEPLOY").await.data();
            let deployed = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "DEPLOY").await;
            assert_eq!(status(&deployed), "SUCCEEDED", "{deployed:#}");
            assert_eq!(step_statuses(&deployed), ["BOOT_DEPLOY_IMAGE=SUCCEEDED", "POWER_ON=SUCCEEDED", "AWAIT_DAEMON=SUCCEEDED"]);
            assert!(step_log(&deployed, "BOOT_DEPLOY_IMAGE").contains(&format!("the image `{IMAGE}` is inserted as the BMC's virtual CD")), "{deployed:#}");
            assert!(!step_log(&deployed, "BOOT_DEPLOY_IMAGE").contains("http://"), "the image's address is not logged");
            let (boot, cd) = boot_and_cd(&emulator, 1).await;
            assert_eq!(boot["BootSourceOverrideTarget"], "Cd", "{boot:#}");
            // Once the installed system's daemon joined, the image was ejected (as Ironic
            // does), which the step's log says.
            assert_eq!(cd["Inserted"], false, "{cd:#}");
            assert!(step_log(&deployed, "AWAIT_DAEMON").contains("the deploy image was ejected from the BMC's virtual CD"), "{deployed:#}");
            assert_eq!(deployed["node"]["provisionState"], "DEPLOYED");
            assert_eq!(deployed["node"]["identityGeneration"], 3);
            assert_eq!(deployed["node"]["connectivity"], "CONNECTED");
            assert_eq!(machine.boots, ["INSPECT", "DEPLOY"]);

            // Release: the ramdisk boots (the deployed system's daemon goes with its
            // boot), wipes the disks and powers off; `ready` again.
            transition(s, &id, "RELEASE").await.data();
            let released = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "RELEASE").await;
            assert_eq!(status(&released), "SUCCEEDED", "{released:#}");
            assert_eq!(step_statuses(&released), ["BOOT_NETWORK_ONCE=SUCCEEDED", "POWER_ON=SUCCEEDED", "AWAIT_DAEMON=SUCCEEDED", "WIPE_DISKS=SUCCEEDED", "POWER_OFF=SUCCEEDED"]);
            assert_eq!(released["node"]["provisionState"], "READY");
            let wipe = command(s, &step_command(&released, "WIPE_DISKS")).await;
            assert_eq!((wipe["kind"].as_str(), wipe["status"].as_str()), (Some("DISK_WIPE"), Some("SUCCEEDED")), "{wipe:#}");
            assert!(step_log(&released, "WIPE_DISKS").contains("erased nvme0n1"), "{released:#}");
            assert_eq!(machine.wipes(), 1, "the machine's ramdisk wiped it once");
            assert_eq!(machine.boots, ["INSPECT", "DEPLOY", "RELEASE"]);
            assert_eq!(emulator.power_state(&SushySystem::numbered(1).uuid).await.expect("read"), "Off");

            // Retire: the ramdisk wipes again; the identity is replaced and the node `retired`.
            let v = view(s, &id).await;
            s.gql(
                Some(s.admin_token()),
                "mutation($input: RetireNodeInput!) { retireNode(input: $input) { node { provisionState } } }",
                json!({ "input": { "id": id, "version": version(&v), "reason": "end of life" } }),
            )
            .await
            .data();
            let retired = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "RETIRE").await;
            assert_eq!(status(&retired), "SUCCEEDED", "{retired:#}");
            assert_eq!(retired["node"]["provisionState"], "RETIRED");
            assert_eq!(retired["node"]["identityGeneration"], 6, "the ramdisk joined (5), retiring replaced it");
            assert_eq!(machine.wipes(), 2);
            let kinds = command_kinds(s, &id).await;
            assert_eq!(kinds, ["DIAG_NVML", "INVENTORY_REFRESH", "DISK_WIPE", "DISK_WIPE"], "one command per command step");
            let all = view(s, &id).await;
            assert_eq!(all["workflows"].as_array().map(Vec::len), Some(5));
            assert_eq!(tick(s).await.advanced, 0, "nothing runs");
            let types = event_types(s, &id).await;
            for t in ["workflow.started", "workflow.step_changed", "workflow.finished", "node.provision_state_changed"] {
                assert!(types.iter().any(|x| x == t), "{t}: {types:?}");
            }
            machine.stop();
        },
    )
    .await;
}

/// Rescue from `deployed`: the rescue ramdisk boots from the network and its daemon joins;
/// the workflow's success leaves the node in `rescue` (no finishing move), and `unrescue`
/// is the operator's. A pool without a deploy image deploys from the network.
#[tokio::test]
async fn rescue_boots_the_rescue_ramdisk_and_leaves_the_node_in_rescue() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let mut machine = Machine::new(1);
        let id = to_ready(s, &emulator, &place, &mut machine).await;
        transition(s, &id, "DEPLOY").await.data();
        let deployed = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "DEPLOY").await;
        assert_eq!(status(&deployed), "SUCCEEDED", "{deployed:#}");
        assert!(
            step_log(&deployed, "BOOT_DEPLOY_IMAGE").contains("no deploy image is named"),
            "{deployed:#}"
        );
        let (boot, cd) = boot_and_cd(&emulator, 1).await;
        assert_eq!(boot["BootSourceOverrideTarget"], "Pxe", "{boot:#}");
        assert_eq!(cd["Inserted"], false, "{cd:#}");

        let generation = deployed["node"]["identityGeneration"]
            .as_i64()
            .expect("a generation");
        transition(s, &id, "RESCUE").await.data();
        let refused = transition(s, &id, "UNRESCUE").await;
        assert_eq!(
            refused.code(),
            Some("BAD_USER_INPUT"),
            "not while the rescue boots: {:#}",
            refused.body
        );
        let rescued = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "RESCUE").await;
        assert_eq!(status(&rescued), "SUCCEEDED", "{rescued:#}");
        assert_eq!(
            step_statuses(&rescued),
            [
                "BOOT_NETWORK_ONCE=SUCCEEDED",
                "POWER_ON=SUCCEEDED",
                "AWAIT_DAEMON=SUCCEEDED"
            ]
        );
        assert!(
            step_log(&rescued, "BOOT_NETWORK_ONCE").contains("the rescue ramdisk"),
            "{rescued:#}"
        );
        assert_eq!(
            rescued["node"]["provisionState"], "RESCUE",
            "no finishing move"
        );
        assert_eq!(
            rescued["node"]["identityGeneration"],
            generation + 1,
            "the rescue ramdisk joined in place"
        );
        assert_eq!(rescued["node"]["maintenance"], false);
        assert_eq!(machine.boots, ["INSPECT", "DEPLOY", "RESCUE"]);
        assert_eq!(
            tick(s).await.advanced,
            0,
            "nothing runs in rescue once it booted"
        );
        assert_eq!(
            transition(s, &id, "UNRESCUE").await.data()["transitionNode"]["node"]["provisionState"],
            "DEPLOYED"
        );
        machine.stop();
    })
    .await;
}

/// Item 7: a pool whose `drivers.deploy` names an image the server's `bare_metal.images`
/// does not list: the deploy fails at once with that as its reason, and nothing was asked
/// of the BMC (no virtual media, no boot override, the machine still off).
#[tokio::test]
async fn a_deploy_image_the_server_does_not_know_fails_the_deploy_naming_it() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = imaged_pool(s).await;
        let mut machine = Machine::new(1);
        let id = to_ready(s, &emulator, &place, &mut machine).await;
        let (boot_before, _) = boot_and_cd(&emulator, 1).await;
        transition(s, &id, "DEPLOY").await.data();
        let failed = run_workflow(s, &id, &emulator, &place, Some(&mut machine), "DEPLOY").await;
        assert_eq!(status(&failed), "FAILED", "{failed:#}");
        assert_eq!(
            step_statuses(&failed),
            [
                "BOOT_DEPLOY_IMAGE=FAILED",
                "POWER_ON=PENDING",
                "AWAIT_DAEMON=PENDING"
            ]
        );
        let reason = failed["workflow"]["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(&format!(
                "names the image `{IMAGE}`, which bare_metal.images does not list"
            )),
            "{reason}"
        );
        assert_eq!(failed["workflow"]["steps"][0]["attempts"], 1, "not retried");
        assert_eq!(
            (
                failed["node"]["provisionState"].as_str(),
                failed["node"]["failedFrom"].as_str(),
                failed["node"]["maintenance"].as_bool()
            ),
            (Some("FAILED"), Some("DEPLOYING"), Some(true))
        );
        let (boot, cd) = boot_and_cd(&emulator, 1).await;
        assert_eq!(boot, boot_before, "no boot override was set");
        assert_eq!(cd["Inserted"], false, "{cd:#}");
        assert_eq!(
            emulator
                .power_state(&SushySystem::numbered(1).uuid)
                .await
                .expect("read"),
            "Off"
        );
        machine.stop();
    })
    .await;
}

/// A burn-in whose diagnostic fails fails the commissioning with the command's error:
/// `failed`, `failedFrom: commissioning`, maintenance on. Once the machine is repaired,
/// `recover` starts the commissioning over, and it passes.
#[tokio::test]
async fn a_failing_burn_in_fails_commissioning_and_recover_starts_it_over() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let mut machine = Machine::new(1);
        machine.fail_diagnostics(true);
        let id = enroll(s, &place, &emulator, 1).await;
        transition(s, &id, "INSPECT").await.data();
        run_workflow(s, &id, &emulator, &place, Some(&mut machine), "INSPECT").await;
        let failed =
            run_workflow(s, &id, &emulator, &place, Some(&mut machine), "COMMISSION").await;
        assert_eq!(status(&failed), "FAILED", "{failed:#}");
        assert_eq!(
            step_statuses(&failed),
            [
                "BURN_IN=FAILED",
                "RECORD_FIRMWARE=PENDING",
                "POWER_OFF=PENDING"
            ]
        );
        let reason = failed["workflow"]["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("burn-in") && reason.contains("diag.nvml") && reason.contains("FAIL"),
            "{reason}"
        );
        assert_eq!(
            (
                failed["node"]["provisionState"].as_str(),
                failed["node"]["failedFrom"].as_str(),
                failed["node"]["maintenance"].as_bool()
            ),
            (Some("FAILED"), Some("COMMISSIONING"), Some(true))
        );
        let diag = command(s, &step_command(&failed, "BURN_IN")).await;
        assert_eq!(diag["status"], "FAILED", "{diag:#}");
        assert_eq!(
            emulator
                .power_state(&SushySystem::numbered(1).uuid)
                .await
                .expect("read"),
            "On",
            "left on for the operator"
        );

        // The operator replaces the GPU and reboots the machine into the ramdisk by hand.
        machine.fail_diagnostics(false);
        machine.boot(s, &place).await;
        machine.wait_connected().await;
        transition(s, &id, "RECOVER").await.data();
        let restarted = view(s, &id).await;
        assert_eq!(restarted["node"]["provisionState"], "COMMISSIONING");
        assert_eq!(restarted["node"]["maintenance"], false);
        assert_eq!(
            (
                restarted["workflow"]["kind"].as_str(),
                restarted["workflow"]["status"].as_str()
            ),
            (Some("COMMISSION"), Some("RUNNING"))
        );
        assert_ne!(restarted["workflow"]["id"], failed["workflow"]["id"]);
        let passed = tick_until(s, &id, &emulator, &place, Some(&mut machine), |v| {
            status(v) != "RUNNING"
        })
        .await;
        assert_eq!(status(&passed), "SUCCEEDED", "{passed:#}");
        assert_eq!(passed["node"]["provisionState"], "READY");
        assert_eq!(
            command_kinds(s, &id).await,
            ["DIAG_NVML", "DIAG_NVML", "INVENTORY_REFRESH"]
        );
        machine.stop();
    })
    .await;
}

/// An abort while the deploy waits for the installed system: the node fails from
/// `deploying` with maintenance on; `recover` deploys again.
#[tokio::test]
async fn an_abort_during_deploy_fails_the_node_and_recover_deploys_again() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let mut machine = Machine::new(1);
        let id = to_ready(s, &emulator, &place, &mut machine).await;
        transition(s, &id, "DEPLOY").await.data();
        // The machine does not boot (no harness): the deploy waits for its daemon.
        let waiting = tick_until(s, &id, &emulator, &place, None, |v| {
            v["workflow"]["currentStep"] == 2
        })
        .await;
        assert_eq!(step_statuses(&waiting)[2], "AWAIT_DAEMON=RUNNING");
        let aborted = abort(s, &id, version(&waiting), "wrong image").await.data()["abortWorkflow"]
            ["bareMetalNode"]
            .clone();
        assert_eq!(aborted["workflow"]["status"], "ABORTED");
        assert_eq!(step_statuses(&aborted)[2], "AWAIT_DAEMON=ABORTED");
        assert_eq!(
            (
                aborted["node"]["provisionState"].as_str(),
                aborted["node"]["failedFrom"].as_str(),
                aborted["node"]["maintenance"].as_bool()
            ),
            (Some("FAILED"), Some("DEPLOYING"), Some(true))
        );
        assert!(
            aborted["node"]["maintenanceReason"]
                .as_str()
                .is_some_and(|r| r.contains("wrong image")),
            "{aborted:#}"
        );
        assert_eq!(tick(s).await.advanced, 0);

        transition(s, &id, "RECOVER").await.data();
        let deployed = tick_until(s, &id, &emulator, &place, Some(&mut machine), |v| {
            status(v) != "RUNNING"
        })
        .await;
        assert_eq!(status(&deployed), "SUCCEEDED", "{deployed:#}");
        assert_eq!(deployed["node"]["provisionState"], "DEPLOYED");
        assert_eq!(
            deployed["workflows"]
                .as_array()
                .map(|l| l.iter().filter(|w| w["kind"] == "DEPLOY").count()),
            Some(2)
        );
        machine.stop();
    })
    .await;
}

#[tokio::test]
async fn abort_timeout_and_recover_fail_the_node_and_start_over() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let id = enroll(s, &place, &emulator, 1).await;
        transition(s, &id, "INSPECT").await.data();
        // No machine reacts: the inspection waits for a daemon that does not come.
        let waiting = tick_until(s, &id, &emulator, &place, None, |v| {
            v["workflow"]["currentStep"] == 2
        })
        .await;
        assert_eq!(step_statuses(&waiting)[2], "AWAIT_DAEMON=RUNNING");
        let quiet = tick(s).await;
        assert_eq!((quiet.advanced, quiet.ended), (1, 0), "{quiet:?}");

        let stale = abort(s, &id, version(&waiting) - 1, "wrong rack").await;
        assert_eq!(stale.code(), Some("CONFLICT"), "{:#}", stale.body);
        let blank = abort(s, &id, version(&waiting), " ").await;
        assert_eq!(blank.code(), Some("BAD_USER_INPUT"), "{:#}", blank.body);
        let aborted = abort(s, &id, version(&waiting), "wrong rack").await.data()["abortWorkflow"]
            ["bareMetalNode"]
            .clone();
        assert_eq!(aborted["workflow"]["status"], "ABORTED");
        assert!(
            aborted["workflow"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("wrong rack")),
            "{aborted:#}"
        );
        assert_eq!(step_statuses(&aborted)[2], "AWAIT_DAEMON=ABORTED");
        assert_eq!(aborted["node"]["provisionState"], "FAILED");
        assert_eq!(aborted["node"]["failedFrom"], "INSPECTING");
        assert_eq!(aborted["node"]["maintenance"], true);
        assert!(
            aborted["node"]["maintenanceReason"]
                .as_str()
                .is_some_and(|r| r.contains("wrong rack"))
        );
        assert_eq!(
            tick(s).await.advanced,
            0,
            "an aborted workflow is not advanced"
        );
        let again = abort(s, &id, version(&aborted), "twice").await;
        assert_eq!(again.code(), Some("BAD_USER_INPUT"), "{:#}", again.body);

        // `recover` goes back to `inspecting` and starts the inspection over.
        transition(s, &id, "RECOVER").await.data();
        let restarted = view(s, &id).await;
        assert_eq!(restarted["node"]["provisionState"], "INSPECTING");
        assert_eq!(restarted["node"]["maintenance"], false);
        assert_eq!(restarted["workflow"]["status"], "RUNNING");
        assert_ne!(restarted["workflow"]["id"], aborted["workflow"]["id"]);
        assert_eq!(restarted["workflows"].as_array().map(Vec::len), Some(2));

        // The machine is on already: the inspection restarts it, then waits again; no
        // daemon comes within the step's timeout (the test clock moves past it).
        tick_until(s, &id, &emulator, &place, None, |v| {
            v["workflow"]["currentStep"] == 2
        })
        .await;
        s.clock
            .advance(AWAIT_DAEMON_TIMEOUT + chrono::Duration::seconds(1));
        let report = tick(s).await;
        assert_eq!(report.ended, 1, "{report:?}");
        let failed = view(s, &id).await;
        assert_eq!(failed["workflow"]["status"], "FAILED");
        assert!(
            failed["workflow"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("await-daemon") && r.contains("timed out")),
            "{failed:#}"
        );
        assert_eq!(
            (
                failed["node"]["provisionState"].as_str(),
                failed["node"]["failedFrom"].as_str(),
                failed["node"]["maintenance"].as_bool()
            ),
            (Some("FAILED"), Some("INSPECTING"), Some(true))
        );
        let types = event_types(s, &id).await;
        assert!(
            types.iter().filter(|t| *t == "workflow.finished").count() == 2,
            "{types:?}"
        );
    })
    .await;
}

/// A workflow is rows: a server that stops in the middle of an inspection resumes it from
/// the stored step when it starts again, without redoing the steps that were done.
#[tokio::test]
async fn a_workflow_resumes_after_a_restart() {
    for backend in Backend::selected() {
        let mut s = TestServer::start(backend).await.expect("a server");
        let emulator = start_emulator(1).await;
        let place = metal_pool(&s).await;
        let id = enroll(&s, &place, &emulator, 1).await;
        transition(&s, &id, "INSPECT").await.data();
        let before = tick_until(&s, &id, &emulator, &place, None, |v| {
            v["workflow"]["currentStep"] == 2
        })
        .await;
        s = s.restart().await.expect("a restart");
        let after = view(&s, &id).await;
        assert_eq!(
            after["workflow"], before["workflow"],
            "the workflow is as it was stored"
        );
        let mut machine = Machine::new(1);
        let done = run_workflow(&s, &id, &emulator, &place, Some(&mut machine), "INSPECT").await;
        assert_eq!(status(&done), "SUCCEEDED", "{done:#}");
        assert_eq!(done["workflow"]["id"], before["workflow"]["id"]);
        for step in 0..2 {
            for field in ["status", "attempts", "startedAt", "finishedAt"] {
                assert_eq!(
                    done["workflow"]["steps"][step][field],
                    before["workflow"]["steps"][step][field],
                    "step {step} was not redone ({field})"
                );
            }
        }
        assert_eq!(done["node"]["provisionState"], "COMMISSIONING");
        machine.stop();
        s.stop().await;
    }
}

/// A command step resumes from its handle: a server that stops while the release's wipe
/// runs polls the `disk.wipe` it queued when it starts again, and queues no second one.
#[tokio::test]
async fn a_wipe_resumes_after_a_restart_without_a_second_wipe() {
    for backend in Backend::selected() {
        let mut s = TestServer::start(backend).await.expect("a server");
        let emulator = start_emulator(1).await;
        let place = metal_pool(&s).await;
        let mut machine = Machine::new(1);
        let id = to_ready(&s, &emulator, &place, &mut machine).await;
        transition(&s, &id, "DEPLOY").await.data();
        run_workflow(&s, &id, &emulator, &place, Some(&mut machine), "DEPLOY").await;
        transition(&s, &id, "RELEASE").await.data();
        let wiping = tick_until(&s, &id, &emulator, &place, Some(&mut machine), |v| {
            v["workflow"]["steps"][3]["commandId"].is_string()
        })
        .await;
        assert_eq!(step_statuses(&wiping)[3], "WIPE_DISKS=RUNNING");
        let wipe = step_command(&wiping, "WIPE_DISKS");
        // The ramdisk carries the wipe out while no controller looks.
        let started = Instant::now();
        while command(&s, &wipe).await["status"] != "SUCCEEDED" {
            assert!(started.elapsed() < LIMIT, "the wipe never ended");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The ramdisk's daemon knows the old server's gateway only; the machine needs it
        // no more (the power-off is the BMC's).
        machine.stop();
        s = s.restart().await.expect("a restart");
        let after = view(&s, &id).await;
        assert_eq!(after["workflow"], wiping["workflow"], "as it was stored");
        let released =
            tick_until(&s, &id, &emulator, &place, None, |v| status(v) != "RUNNING").await;
        assert_eq!(status(&released), "SUCCEEDED", "{released:#}");
        assert_eq!(
            step_command(&released, "WIPE_DISKS"),
            wipe,
            "the same command"
        );
        assert_eq!(released["node"]["provisionState"], "READY");
        assert_eq!(machine.wipes(), 1);
        let wipes = command_kinds(&s, &id)
            .await
            .into_iter()
            .filter(|k| k == "DISK_WIPE")
            .count();
        assert_eq!(wipes, 1, "no second wipe was queued");
        s.stop().await;
    }
}

/// Item 7: the machine behind the BMC is not the one enrolled (its board serial differs):
/// its daemon joins as a node of its own, and the inspection fails naming the
/// contradiction; the enrolled node keeps its identity and nothing of the other machine.
#[tokio::test]
async fn a_machine_that_contradicts_its_enrolment_fails_its_inspection() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let id = enroll(s, &place, &emulator, 1).await;
        let mut impostor = Machine::new(1);
        impostor
            .identifiers_mut()
            .insert("board-serial".into(), "BSN-SWAPPED".into());
        transition(s, &id, "INSPECT").await.data();
        let failed = tick_until(s, &id, &emulator, &place, Some(&mut impostor), |v| {
            status(v) != "RUNNING"
        })
        .await;
        assert_eq!(status(&failed), "FAILED", "{failed:#}");
        let reason = failed["workflow"]["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("contradict")
                && reason.contains(
                    "board-serial was enrolled as bsn-wf-0001 but the machine reports bsn-swapped"
                ),
            "{reason}"
        );
        assert_eq!(step_statuses(&failed)[2], "AWAIT_DAEMON=FAILED");
        assert_eq!(
            (
                failed["node"]["provisionState"].as_str(),
                failed["node"]["failedFrom"].as_str(),
                failed["node"]["maintenance"].as_bool()
            ),
            (Some("FAILED"), Some("INSPECTING"), Some(true))
        );
        assert_eq!(
            failed["node"]["identityGeneration"], 1,
            "the other machine never became this node"
        );
        let other = impostor.daemon().and_then(|d| d.status().node_id);
        assert!(
            other.is_some_and(|o| o != id && reason.contains(&o)),
            "{reason}"
        );
        impostor.stop();
    })
    .await;
}

/// Waits until the node's daemon is gone (its session closed).
async fn wait_disconnected(s: &TestServer, id: &str) -> Value {
    let started = Instant::now();
    loop {
        let v = view(s, id).await;
        if v["node"]["connectivity"] != "CONNECTED" {
            return v;
        }
        assert!(started.elapsed() < LIMIT, "the daemon never went: {v:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Ticks until the running workflow's first step has queued its command; that command.
async fn queued_burn_in(
    s: &TestServer,
    id: &str,
    emulator: &SushyEmulator,
    place: &Place,
) -> (Value, String) {
    let v = tick_until(s, id, emulator, place, None, |v| {
        v["workflow"]["steps"][0]["commandId"].is_string()
    })
    .await;
    assert_eq!(step_statuses(&v)[0], "BURN_IN=RUNNING", "{v:#}");
    let diag = step_command(&v, "BURN_IN");
    assert_eq!(
        command(s, &diag).await["status"],
        "QUEUED",
        "no daemon to run it"
    );
    (v, diag)
}

/// An abort while a step's command has not run yet: the abort cancels the command in its
/// own transaction (the step's log says so), so the machine's daemon, when it comes back,
/// never runs it. The same for `fail` typed while a workflow runs.
#[tokio::test]
async fn ending_a_workflow_cancels_the_commands_it_queued() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
        let mut machine = Machine::new(1);
        let id = enroll(s, &place, &emulator, 1).await;
        transition(s, &id, "INSPECT").await.data();
        run_workflow(s, &id, &emulator, &place, Some(&mut machine), "INSPECT").await;
        // The ramdisk's daemon goes before the commissioning's first pass: its burn-in is
        // queued and waits for a session.
        machine.stop();
        wait_disconnected(s, &id).await;
        let (queued, diag) = queued_burn_in(s, &id, &emulator, &place).await;

        let aborted = abort(s, &id, version(&queued), "wrong GPUs").await.data()["abortWorkflow"]
            ["bareMetalNode"]
            .clone();
        assert_eq!(aborted["workflow"]["status"], "ABORTED");
        let cancelled = command(s, &diag).await;
        assert_eq!(cancelled["status"], "CANCELLED", "{cancelled:#}");
        assert!(
            cancelled["error"]
                .as_str()
                .is_some_and(|e| e.contains("user:test-admin")),
            "{cancelled:#}"
        );
        assert!(
            step_log(&aborted, "BURN_IN")
                .contains(&format!("cancelled diag.nvml {diag}, which was still queued")),
            "{aborted:#}"
        );

        // `recover` commissions again; a `fail` typed while its burn-in is queued cancels
        // that one too.
        transition(s, &id, "RECOVER").await.data();
        let (queued, second) = queued_burn_in(s, &id, &emulator, &place).await;
        assert_ne!(second, diag);
        let failed = s
            .gql(
                Some(s.admin_token()),
                "mutation($input: TransitionNodeInput!) { transitionNode(input: $input) { node { provisionState } } }",
                json!({ "input": { "id": id, "version": version(&queued), "move": "FAIL", "reason": "bad riser" } }),
            )
            .await;
        assert_eq!(failed.data()["transitionNode"]["node"]["provisionState"], "FAILED");
        assert_eq!(command(s, &second).await["status"], "CANCELLED");

        // The machine's daemon comes back: neither burn-in is sent to it (its session's
        // opening dispatches what is queued for the node; a moment more for stragglers).
        machine.boot(s, &place).await;
        machine.wait_connected().await;
        let started = Instant::now();
        while view(s, &id).await["node"]["connectivity"] != "CONNECTED" {
            assert!(started.elapsed() < LIMIT, "the node never connected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let received = machine.daemon().map(|d| d.status().commands_received);
        assert_eq!(received, Some(0), "nothing was sent to it");
        for cancelled in [&diag, &second] {
            assert_eq!(command(s, cancelled).await["status"], "CANCELLED");
        }
        assert_eq!(tick(s).await.advanced, 0, "nothing runs");
        machine.stop();
    })
    .await;
}

/// The deploy image's eject fails at the BMC: logged in the step's log, not fatal; the
/// node is deployed, and the image stays inserted for an operator. The BMC is the simulated
/// bare metal's (`bc_testing::metal`, which `dev --sim-metal` runs), whose eject can fail
/// on demand; its machine boots by itself, as the BMC boots it.
#[tokio::test]
async fn a_failed_eject_of_the_deploy_image_is_logged_and_the_deploy_succeeds() {
    let configured = image_server().await;
    let image = configured.clone();
    each_backend_with(
        move |c| {
            c.bare_metal
                .images
                .insert(IMAGE.to_owned(), configured.clone());
        },
        async |s| {
            let place = imaged_pool(s).await;
            let services = s.server.services.clone();
            let admin = better_compute::auth::Principal {
                subject: "test-admin".to_owned(),
                role: better_compute::auth::Role::Admin,
                tenant: None,
                expires_at: bc_core::clock::Clock::now(&s.clock) + chrono::Duration::days(1),
            };
            let secret = s.join_token(&place.site, Some(&place.pool), 10).await;
            let context = std::sync::Arc::new(
                GatewayContext::resolve(&s.gateway_url(), &CaTrust::Pem(s.ca_pem()))
                    .await
                    .expect("the gateway"),
            );
            let fleet = MetalFleet::start(
                services,
                MetalPlace {
                    principal: admin,
                    site: SiteId::parse(&place.site).expect("a site id"),
                    pool: PoolId::parse(&place.pool).expect("a pool id"),
                },
                context,
                secret,
                &MetalOptions {
                    machines: 1,
                    seed: 11,
                    knobs: DaemonKnobs::default(),
                    state_file: None,
                },
            )
            .await
            .expect("the machine is enrolled and its inspection started");
            let system = fleet.machines()[0].system_id.clone();
            let id = fleet
                .node_id(&fleet.machines()[0].hostname)
                .await
                .expect("a read")
                .expect("a node")
                .to_string();
            let ready = tick_alone(s, &id, |v| v["node"]["provisionState"] == "READY").await;
            assert_eq!(ready["node"]["maintenance"], false, "{ready:#}");

            fleet.bmcs().fail_ejects(&system, true);
            transition(s, &id, "DEPLOY").await.data();
            let deployed = tick_alone(s, &id, |v| status(v) != "RUNNING").await;
            assert_eq!(status(&deployed), "SUCCEEDED", "{deployed:#}");
            assert_eq!(deployed["node"]["provisionState"], "DEPLOYED");
            let log = step_log(&deployed, "AWAIT_DAEMON");
            assert!(
                log.contains("the deploy image could not be ejected from the BMC's virtual CD")
                    && log.contains("HTTP 500")
                    && log.contains("stays inserted"),
                "{log}"
            );
            assert_eq!(
                fleet.bmcs().inserted_media(&system).as_deref(),
                Some(image.as_str())
            );
            assert_eq!(
                fleet.bmcs().boots(&system),
                [BootSource::Network, BootSource::VirtualCd],
                "inspected from the network, deployed from the image"
            );
            fleet.shutdown().await;
        },
    )
    .await;
}
