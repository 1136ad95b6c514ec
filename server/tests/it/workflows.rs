//! Bare-metal workflows (issue 14, item 3) against OpenStack's Redfish emulator: inspect
//! (network boot once, power on, the ramdisk daemon joins as the enrolled node, identifiers
//! checked), release and retire; abort, timeouts and `recover`; a restart in the middle;
//! and a machine whose identifiers contradict its enrolment (item 7). The harness plays the
//! machine: when the emulator reports the system on, it starts a FakeDaemon with the
//! machine's identifiers, as a ramdisk booting from the network would. The Workflow
//! controller is ticked by hand, time moved with the test clock.

use bc_core::workflow::AWAIT_DAEMON_TIMEOUT;
use bc_testing::bmc::{SushyEmulator, SushyOptions, SushySystem};
use bc_testing::{Backend, CaTrust, DaemonKnobs, FakeDaemon, Gql, TestServer, each_backend};
use better_compute::controllers::{WorkflowController, WorkflowReport};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

const VIEW: &str = "bareMetalNode { node { id version provisionState failedFrom maintenance maintenanceReason identityGeneration connectivity } power workflow { id kind status reason startedBy currentStep steps { kind status attempts maxAttempts timeoutSeconds startedAt finishedAt deadline log { at message } } } workflows { id status } }";

/// The most real time a workflow may take here: the emulator answers in milliseconds and
/// a FakeDaemon joins in well under a second, so this only bounds a broken run.
const LIMIT: Duration = Duration::from_secs(60);

struct Place {
    site: String,
    pool: String,
}

async fn metal_pool(s: &TestServer) -> Place {
    let (site, pool) = crate::common::metal_pool(s, "redfish").await;
    Place { site, pool }
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

/// The machine's side: once the emulator reports system `n` on, its (ramdisk's) daemon
/// boots and joins with `identifiers`.
struct Machine {
    n: u32,
    identifiers: BTreeMap<String, String>,
    daemon: Option<FakeDaemon>,
}

impl Machine {
    fn new(n: u32) -> Machine {
        Machine {
            n,
            identifiers: machine(n),
            daemon: None,
        }
    }

    async fn react(&mut self, s: &TestServer, emulator: &SushyEmulator, place: &Place) {
        if self.daemon.is_some() {
            return;
        }
        let power = emulator
            .power_state(&SushySystem::numbered(self.n).uuid)
            .await
            .expect("the emulator answers");
        if power != "On" {
            return;
        }
        let secret = s.join_token(&place.site, Some(&place.pool), 10).await;
        let daemon = FakeDaemon::new(s.gateway_url(), secret, CaTrust::Pem(s.ca_pem())).with_knobs(
            DaemonKnobs {
                identifiers: Some(self.identifiers.clone()),
                gpu_count: 8,
                ..DaemonKnobs::default()
            },
        );
        daemon.start();
        self.daemon = Some(daemon);
    }

    fn stop(&mut self) {
        if let Some(daemon) = self.daemon.take() {
            daemon.stop();
        }
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
    let started = Instant::now();
    loop {
        tick(s).await;
        if let Some(m) = machine.as_deref_mut() {
            m.react(s, emulator, place).await;
        }
        let v = view(s, id).await;
        if done(&v) {
            return v;
        }
        assert!(
            started.elapsed() < LIMIT,
            "not reached within {LIMIT:?}: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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

#[tokio::test]
async fn inspect_release_and_retire_against_the_redfish_emulator() {
    each_backend(async |s| {
        let emulator = start_emulator(1).await;
        let place = metal_pool(s).await;
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

        let done = tick_until(s, &id, &emulator, &place, Some(&mut machine), |v| status(v) != "RUNNING").await;
        assert_eq!(status(&done), "SUCCEEDED", "{done:#}");
        assert!(step_statuses(&done).iter().all(|s| s.ends_with("=SUCCEEDED")), "{done:#}");
        assert_eq!(done["node"]["provisionState"], "COMMISSIONING");
        assert_eq!(done["node"]["identityGeneration"], 2, "the ramdisk joined in place");
        assert_eq!(done["node"]["connectivity"], "CONNECTED");
        let daemon_node = machine.daemon.as_ref().and_then(|d| d.status().node_id);
        assert_eq!(daemon_node.as_deref(), Some(id.as_str()), "the daemon is the enrolled node");
        assert_eq!(s.admin("{ nodes { totalCount } }", json!({})).await["nodes"]["totalCount"], 1);
        assert_eq!(emulator.power_state(&SushySystem::numbered(1).uuid).await.expect("read"), "On");
        let system: Value = emulator
            .client()
            .expect("a client")
            .get(format!("{}/redfish/v1/Systems/{}", emulator.url, SushySystem::numbered(1).uuid))
            .basic_auth(&emulator.options.username, Some(&emulator.options.password))
            .send()
            .await
            .expect("the emulator answers")
            .json()
            .await
            .expect("json");
        assert_eq!(system["Boot"]["BootSourceOverrideTarget"], "Pxe", "the inspection booted the network: {system:#}");
        let check = &done["workflow"]["steps"][3];
        assert!(check["log"].as_array().is_some_and(|l| l.iter().any(|line| line["message"].as_str().is_some_and(|m| m.contains("match its enrolment")))), "{check:#}");
        let types = event_types(s, &id).await;
        for t in ["workflow.started", "workflow.step_changed", "workflow.finished", "node.provision_state_changed"] {
            assert!(types.iter().any(|x| x == t), "{t}: {types:?}");
        }

        // No workflow for commissioning or deploying yet: the operator moves on by hand.
        for action in ["PROVIDE", "DEPLOY", "FINISH_DEPLOY"] {
            transition(s, &id, action).await.data();
        }
        assert_eq!(view(s, &id).await["node"]["provisionState"], "DEPLOYED");

        // Release: powers the machine off, then `ready`.
        transition(s, &id, "RELEASE").await.data();
        let released = tick_until(s, &id, &emulator, &place, None, |v| status(v) != "RUNNING").await;
        assert_eq!((status(&released), released["workflow"]["kind"].as_str()), ("SUCCEEDED", Some("RELEASE")), "{released:#}");
        assert_eq!(released["node"]["provisionState"], "READY");
        assert_eq!(emulator.power_state(&SushySystem::numbered(1).uuid).await.expect("read"), "Off");

        // Retire: off already; the identity is replaced and the node `retired`.
        let v = view(s, &id).await;
        s.gql(
            Some(s.admin_token()),
            "mutation($input: RetireNodeInput!) { retireNode(input: $input) { node { provisionState } } }",
            json!({ "input": { "id": id, "version": version(&v), "reason": "end of life" } }),
        )
        .await
        .data();
        let retired = tick_until(s, &id, &emulator, &place, None, |v| status(v) != "RUNNING").await;
        assert_eq!((status(&retired), retired["workflow"]["kind"].as_str()), ("SUCCEEDED", Some("RETIRE")), "{retired:#}");
        assert_eq!(retired["node"]["provisionState"], "RETIRED");
        assert_eq!(retired["node"]["identityGeneration"], 3);
        assert_eq!(retired["workflows"].as_array().map(Vec::len), Some(3));
        assert_eq!(tick(s).await.advanced, 0, "nothing runs");
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
        let done = tick_until(&s, &id, &emulator, &place, Some(&mut machine), |v| {
            status(v) != "RUNNING"
        })
        .await;
        assert_eq!(status(&done), "SUCCEEDED", "{done:#}");
        assert_eq!(done["workflow"]["id"], before["workflow"]["id"]);
        for step in 0..2 {
            assert_eq!(
                done["workflow"]["steps"][step], before["workflow"]["steps"][step],
                "step {step} was not redone"
            );
        }
        assert_eq!(done["node"]["provisionState"], "COMMISSIONING");
        machine.stop();
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
            .identifiers
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
        let other = impostor.daemon.as_ref().and_then(|d| d.status().node_id);
        assert!(
            other.is_some_and(|o| o != id && reason.contains(&o)),
            "{reason}"
        );
        impostor.stop();
    })
    .await;
}
