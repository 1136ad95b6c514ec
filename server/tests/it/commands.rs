//! The command queue end to end: GraphQL to send and cancel, the gateway dispatching over a
//! real bcd/v1 session (the raw client plays the daemon, so the tests decide exactly when it
//! starts, answers or drops), the timing controller, and `commandUpdates`. Both databases.

#![allow(clippy::unwrap_used)]

use crate::raw_daemon::*;
use bc_core::command::Outcome;
use bc_core::ids::EventId;
use bc_core::protocol::{DaemonMessage, GatewayMessage};
use bc_testing::subscription::SubscriptionClient;
use bc_testing::{TestServer, each_backend};
use better_compute::auth::Role;
use better_compute::controllers::CommandTimingController;
use serde_json::{Value, json};
use std::time::Duration;

const COMMAND_FIELDS: &str =
    "id nodeId kind kindName lane status attempts exitCode output result error params";

/// A joined node with an open session (the raw client as its daemon).
struct Live {
    node_id: String,
    ws: Ws,
    machine: Machine,
    certificate: String,
}

async fn live_node(s: &TestServer, site: &str, pool: &str) -> Live {
    let secret = s.join_token(site, Some(pool), 1).await;
    let machine = Machine::new();
    let issued = join(
        s,
        &machine,
        &secret,
        &format!("gpu-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
    )
    .await;
    let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
        .await
        .unwrap();
    send(&mut ws, &hello(0)).await;
    assert!(matches!(
        next(&mut ws).await,
        Ok(GatewayMessage::Welcome { .. })
    ));
    Live {
        node_id: issued.node_id,
        ws,
        machine,
        certificate: issued.certificate_pem,
    }
}

async fn send_command(
    s: &TestServer,
    token: &str,
    node: &str,
    kind: &str,
    extra: Value,
) -> Result<Vec<Value>, Value> {
    let mut input = json!({"nodeIds": [node], "kind": kind});
    if let Value::Object(extra) = extra {
        input.as_object_mut().unwrap().extend(extra);
    }
    let answer = s
        .gql(Some(token), &format!("mutation($input: SendCommandInput!) {{ sendCommand(input: $input) {{ commands {{ {COMMAND_FIELDS} }} }} }}"), json!({"input": input}))
        .await;
    match answer.body["errors"].is_array() {
        true => Err(answer.error().clone()),
        false => Ok(answer.data()["sendCommand"]["commands"]
            .as_array()
            .unwrap()
            .clone()),
    }
}

async fn command(s: &TestServer, id: &str) -> Value {
    s.admin(
        &format!("query($id: ID!) {{ command(id: $id) {{ {COMMAND_FIELDS} }} }}"),
        json!({"id": id}),
    )
    .await["command"]
        .clone()
}

async fn cordon(s: &TestServer, node: &str) {
    let version = crate::raw_daemon::node(s, node).await["version"]
        .as_i64()
        .unwrap();
    s.admin("mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: \"maintenance\"}) { node { version } } }", json!({"id": node, "v": version}))
        .await;
}

/// The next command the daemon is sent (skipping nothing else: any other message fails).
async fn next_command(ws: &mut Ws) -> (String, String) {
    match next(ws).await {
        Ok(GatewayMessage::Command { id, kind, .. }) => (id, kind.to_string()),
        other => panic!("expected a command, got {other:?}"),
    }
}

async fn finish(ws: &mut Ws, id: &str, outcome: Outcome, exit_code: i32, result: Value) {
    send(ws, &DaemonMessage::CommandStarted { id: id.to_owned() }).await;
    send(
        ws,
        &DaemonMessage::CommandResult {
            id: id.to_owned(),
            outcome,
            exit_code: Some(exit_code),
            output: "done\n".into(),
            result: Some(result),
        },
    )
    .await;
}

async fn wait_status(s: &TestServer, id: &str, status: &str) -> Value {
    wait_until(async || command(s, id).await["status"] == status).await;
    command(s, id).await
}

/// Asserts that the daemon is sent nothing for a moment (a lane must stay blocked). A
/// heartbeat round trip is the fence: anything the gateway meant to send came before it
/// handled the heartbeat, because it sends dispatches from the same task.
async fn nothing_more(live: &mut Live, seq: u64) {
    send(&mut live.ws, &DaemonMessage::Heartbeat { seq }).await;
    match tokio::time::timeout(Duration::from_millis(300), next(&mut live.ws)).await {
        Err(_) => {}
        Ok(other) => panic!("expected nothing, got {other:?}"),
    }
}

#[tokio::test]
async fn commands_run_one_at_a_time_per_lane_and_lanes_run_side_by_side() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let mut live = live_node(s, &site, &pool).await;
        cordon(s, &live.node_id).await;
        let admin = s.admin_token().to_owned();
        let diag = send_command(s, &admin, &live.node_id, "DIAG_NVML", json!({"params": {"level": 2}})).await.unwrap();
        let reset = send_command(s, &admin, &live.node_id, "GPU_RESET", json!({})).await.unwrap();
        let logs = send_command(s, &admin, &live.node_id, "LOGS_COLLECT", json!({})).await.unwrap();
        assert_eq!(diag[0]["lane"], "GPU");
        assert_eq!(diag[0]["params"], json!({"level": 2}));
        assert_eq!(reset[0]["status"], "QUEUED");

        // diag.nvml (gpu lane) and logs.collect (logs lane) go out; gpu.reset waits.
        let mut sent = [next_command(&mut live.ws).await, next_command(&mut live.ws).await];
        sent.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(sent.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>(), vec!["diag.nvml", "logs.collect"]);
        assert_eq!(sent[0].0, diag[0]["id"].as_str().unwrap());
        assert_eq!(sent[1].0, logs[0]["id"].as_str().unwrap());
        nothing_more(&mut live, 1).await;
        assert_eq!(command(s, reset[0]["id"].as_str().unwrap()).await["status"], "QUEUED");
        assert_eq!(command(s, &sent[0].0).await["status"], "DISPATCHED");

        finish(&mut live.ws, &sent[0].0, Outcome::Succeeded, 0, json!({"passed": true, "failures": []})).await;
        // The gpu lane is free: the reset follows.
        let (reset_id, kind) = next_command(&mut live.ws).await;
        assert_eq!((reset_id.as_str(), kind.as_str()), (reset[0]["id"].as_str().unwrap(), "gpu.reset"));
        let done = wait_status(s, &sent[0].0, "SUCCEEDED").await;
        assert_eq!(done["exitCode"], 0);
        assert_eq!(done["output"], "done\n");
        assert_eq!(done["result"]["passed"], true);
        assert_eq!(done["attempts"], 1);
        finish(&mut live.ws, &reset_id, Outcome::Failed, 3, json!({"reason": "GPU busy"})).await;
        assert_eq!(wait_status(s, &reset_id, "FAILED").await["exitCode"], 3);
        finish(&mut live.ws, &sent[1].0, Outcome::Succeeded, 0, json!({})).await;
        wait_status(s, &sent[1].0, "SUCCEEDED").await;

        // The node's command list, newest first, filterable by status.
        let list = s
            .admin("query($id: ID!) { node(id: $id) { commands(status: [SUCCEEDED]) { edges { node { kindName } } } } }", json!({"id": live.node_id}))
            .await;
        let kinds: Vec<&str> = list["node"]["commands"]["edges"].as_array().unwrap().iter().map(|e| e["node"]["kindName"].as_str().unwrap()).collect();
        assert_eq!(kinds, vec!["logs.collect", "diag.nvml"]);
    })
    .await;
}

#[tokio::test]
async fn destructive_commands_need_a_cordon_or_an_admins_force() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let live = live_node(s, &site, &pool).await;
        let operator = s.token(Role::Operator);
        let viewer = s.token(Role::Viewer);
        let err = send_command(s, &operator, &live.node_id, "NODE_REBOOT", json!({})).await.unwrap_err();
        assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");
        assert!(err["message"].as_str().unwrap().contains("cordon"), "{err}");
        let err = send_command(s, &operator, &live.node_id, "NODE_REBOOT", json!({"force": true})).await.unwrap_err();
        assert_eq!(err["extensions"]["code"], "FORBIDDEN", "{err}");
        let err = send_command(s, &viewer, &live.node_id, "DIAG_NVML", json!({})).await.unwrap_err();
        assert_eq!(err["extensions"]["code"], "FORBIDDEN", "{err}");
        assert!(send_command(s, s.admin_token(), &live.node_id, "NODE_REBOOT", json!({"force": true})).await.is_ok());
        let err = send_command(s, &operator, &live.node_id, "DIAG_NVML", json!({"params": {"level": 7}})).await.unwrap_err();
        assert_eq!(err["extensions"]["code"], "BAD_USER_INPUT", "{err}");

        // The platform never sends a destructive command to a tenant-controlled node.
        let mut leased = common_node(s, &site, &pool);
        leased.trust = bc_core::axes::Trust::TenantControlled;
        leased.cordon("leased", &bc_core::Actor::System, leased.created_at).unwrap();
        s.insert_node(&leased).await;
        let err = send_command(s, s.admin_token(), leased.id.as_str(), "GPU_RESET", json!({"force": true})).await.unwrap_err();
        assert_eq!(err["extensions"]["code"], "FORBIDDEN", "{err}");
        assert!(err["message"].as_str().unwrap().contains("tenant-controlled"), "{err}");
        // A non-destructive one is fine, and a bulk send is all or nothing.
        assert!(send_command(s, s.admin_token(), leased.id.as_str(), "LOGS_COLLECT", json!({})).await.is_ok());
        let bulk = s
            .gql(
                Some(s.admin_token()),
                "mutation($ids: [ID!]) { sendCommand(input: {nodeIds: $ids, kind: GPU_RESET}) { commands { id } } }",
                json!({"ids": [live.node_id, leased.id.to_string()]}),
            )
            .await;
        assert_eq!(bulk.code(), Some("BAD_USER_INPUT"), "{:#}", bulk.body);
        let queued = s.admin("{ commands(filter: {kind: [GPU_RESET]}) { edges { node { id } } } }", json!({})).await;
        assert!(queued["commands"]["edges"].as_array().unwrap().is_empty(), "a refused bulk send queued something");
    })
    .await;
}

fn common_node(s: &TestServer, site: &str, pool: &str) -> bc_core::node::NodeRecord {
    let mut node = bc_core::node::NodeRecord::new(
        bc_core::node::NewNode {
            hostname: format!("leased-{}", &uuid::Uuid::new_v4().simple().to_string()[..6]),
            site_id: bc_core::ids::SiteId::parse(site).unwrap(),
            pool_id: Some(bc_core::ids::PoolId::parse(pool).unwrap()),
            owner_tenant_id: None,
            role: bc_core::axes::Role::Host,
            trust: bc_core::axes::Trust::Platform,
            adapter: bc_core::axes::Adapter::BcdV1,
            drivers: Default::default(),
            provision_state: bc_core::axes::ProvisionState::Deployed,
        },
        bc_core::clock::Clock::now(&s.clock),
    )
    .unwrap();
    node.connectivity = bc_core::axes::Connectivity::Connected;
    node
}

#[tokio::test]
async fn a_cancel_racing_a_result_keeps_the_first_final_state() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let mut live = live_node(s, &site, &pool).await;
        let sent = send_command(s, s.admin_token(), &live.node_id, "DIAG_NVML", json!({}))
            .await
            .unwrap();
        let id = sent[0]["id"].as_str().unwrap().to_owned();
        let (got, _) = next_command(&mut live.ws).await;
        assert_eq!(got, id);
        send(
            &mut live.ws,
            &DaemonMessage::CommandStarted { id: id.clone() },
        )
        .await;
        wait_status(s, &id, "RUNNING").await;

        let cancelled = s
            .admin(
                &format!("mutation($id: ID!) {{ cancelCommand(input: {{id: $id}}) {{ command {{ {COMMAND_FIELDS} }} }} }}"),
                json!({"id": id}),
            )
            .await;
        assert_eq!(cancelled["cancelCommand"]["command"]["status"], "CANCELLED");
        assert!(
            cancelled["cancelCommand"]["command"]["error"]
                .as_str()
                .unwrap()
                .contains("cancelled by user:test-admin")
        );
        match next(&mut live.ws).await {
            Ok(GatewayMessage::Cancel { id: cancel }) => assert_eq!(cancel, id),
            other => panic!("expected cancel, got {other:?}"),
        }
        // The daemon's result crossed the cancel on the wire: ignored, the session lives on.
        finish(
            &mut live.ws,
            &id,
            Outcome::Succeeded,
            0,
            json!({"passed": true}),
        )
        .await;
        send(&mut live.ws, &DaemonMessage::Heartbeat { seq: 1 }).await;
        let after = command(s, &id).await;
        assert_eq!(after["status"], "CANCELLED");
        assert!(after["exitCode"].is_null());
        assert_eq!(
            crate::raw_daemon::node(s, &live.node_id).await["connectivity"],
            "CONNECTED"
        );
        // Cancelling an ended command is refused with the state it is in.
        let again = s
            .gql(
                Some(s.admin_token()),
                "mutation($id: ID!) { cancelCommand(input: {id: $id}) { command { id } } }",
                json!({"id": id}),
            )
            .await;
        assert_eq!(again.code(), Some("INVALID_STATE"), "{:#}", again.body);
        // And a queued one never reaches the daemon.
        let queued = send_command(
            s,
            s.admin_token(),
            &live.node_id,
            "INVENTORY_REFRESH",
            json!({"notBefore": "2099-01-01T00:00:00Z", "expiresInSeconds": 60}),
        )
        .await
        .unwrap();
        let queued_id = queued[0]["id"].as_str().unwrap();
        s.admin(
            "mutation($id: ID!) { cancelCommand(input: {id: $id}) { command { id } } }",
            json!({"id": queued_id}),
        )
        .await;
        assert_eq!(command(s, queued_id).await["status"], "CANCELLED");
    })
    .await;
}

#[tokio::test]
async fn commands_in_flight_when_a_session_drops_are_redelivered_or_failed_with_a_reason() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let mut live = live_node(s, &site, &pool).await;
        cordon(s, &live.node_id).await;
        let diag = send_command(s, s.admin_token(), &live.node_id, "DIAG_NVML", json!({}))
            .await
            .unwrap();
        let reboot = send_command(s, s.admin_token(), &live.node_id, "LOGS_COLLECT", json!({}))
            .await
            .unwrap();
        let first = next_command(&mut live.ws).await;
        let second = next_command(&mut live.ws).await;
        assert_eq!(
            [first.0.as_str(), second.0.as_str()]
                .iter()
                .filter(|id| **id == diag[0]["id"] || **id == reboot[0]["id"])
                .count(),
            2
        );
        // The session drops before any result.
        live.ws.close(None).await.unwrap();
        let diag_id = diag[0]["id"].as_str().unwrap();
        wait_status(s, diag_id, "QUEUED").await;

        // The next session gets them again, second attempt.
        let mut ws = connect(s, &live.certificate, live.machine.key_der())
            .await
            .unwrap();
        send(&mut ws, &hello(0)).await;
        assert!(matches!(
            next(&mut ws).await,
            Ok(GatewayMessage::Welcome { epoch: 2, .. })
        ));
        let mut again = vec![next_command(&mut ws).await.0, next_command(&mut ws).await.0];
        again.sort();
        let mut expected = vec![
            diag_id.to_owned(),
            reboot[0]["id"].as_str().unwrap().to_owned(),
        ];
        expected.sort();
        assert_eq!(again, expected);
        assert_eq!(command(s, diag_id).await["attempts"], 2);

        // A reboot that was dispatched may have happened: it is failed, not sent again.
        let reboot =
            send_command(s, s.admin_token(), &live.node_id, "NODE_REBOOT", json!({})).await;
        // The gpu lane is busy with the diagnostic: finish it so the reboot goes out.
        finish(
            &mut ws,
            diag_id,
            Outcome::Succeeded,
            0,
            json!({"passed": true}),
        )
        .await;
        let reboot_id = reboot.unwrap()[0]["id"].as_str().unwrap().to_owned();
        loop {
            let (id, _) = next_command(&mut ws).await;
            if id == reboot_id {
                break;
            }
        }
        ws.close(None).await.unwrap();
        let failed = wait_status(s, &reboot_id, "FAILED").await;
        assert!(
            failed["error"].as_str().unwrap().contains("not sent again"),
            "{failed}"
        );
    })
    .await;
}

#[tokio::test]
async fn queued_commands_expire_and_running_ones_time_out() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let mut live = live_node(s, &site, &pool).await;
        let mut controller = CommandTimingController::new(s.server.services.clone());
        // Waits behind nothing but its not-before, and expires first.
        let later =
            (bc_core::clock::Clock::now(&s.clock) + chrono::Duration::hours(2)).to_rfc3339();
        let waiting = send_command(
            s,
            s.admin_token(),
            &live.node_id,
            "INVENTORY_REFRESH",
            json!({"notBefore": later, "expiresInSeconds": 60}),
        )
        .await
        .unwrap();
        let running = send_command(
            s,
            s.admin_token(),
            &live.node_id,
            "LOGS_COLLECT",
            json!({"timeoutSeconds": 30}),
        )
        .await
        .unwrap();
        let (id, _) = next_command(&mut live.ws).await;
        assert_eq!(id, running[0]["id"].as_str().unwrap());
        send(
            &mut live.ws,
            &DaemonMessage::CommandStarted { id: id.clone() },
        )
        .await;
        wait_status(s, &id, "RUNNING").await;

        s.clock.advance(chrono::Duration::seconds(31));
        let report = controller.tick().await.unwrap();
        assert_eq!((report.expired, report.timed_out), (0, 1));
        let timed_out = command(s, &id).await;
        assert_eq!(timed_out["status"], "TIMED_OUT");
        assert!(timed_out["error"].as_str().unwrap().contains("30 s"));
        match next(&mut live.ws).await {
            Ok(GatewayMessage::Cancel { id: cancel }) => assert_eq!(cancel, id),
            other => panic!("expected cancel, got {other:?}"),
        }

        s.clock.advance(chrono::Duration::hours(3));
        let report = controller.tick().await.unwrap();
        assert_eq!((report.expired, report.timed_out), (1, 0));
        assert_eq!(
            command(s, waiting[0]["id"].as_str().unwrap()).await["status"],
            "EXPIRED"
        );
        assert_eq!(controller.tick().await.unwrap(), Default::default());
    })
    .await;
}

#[tokio::test]
async fn command_updates_stream_live_with_results() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let mut live = live_node(s, &site, &pool).await;
        let url = s.url().replace("http://", "ws://") + "/graphql";
        let mut client = SubscriptionClient::connect(&url, s.admin_token()).await.unwrap();
        // From the event log's head as it is before the command is sent. Without `after` the
        // subscription starts from the head when the server gets to the subscribe message,
        // which nothing orders before the mutation below: it could miss `queued`.
        let head = s.server.services.event_head().await.unwrap_or_else(|err| panic!("reading the event head: {}", err.message()));
        client
            .subscribe(
                "c",
                "subscription($node: ID, $after: ID) { commandUpdates(nodeId: $node, after: $after) { cursor from to command { id status exitCode result } } }",
                json!({"node": live.node_id, "after": EventId(head).to_string()}),
            )
            .await
            .unwrap();
        let sent = send_command(s, s.admin_token(), &live.node_id, "DIAG_NVML", json!({})).await.unwrap();
        let id = sent[0]["id"].as_str().unwrap().to_owned();
        let (got, _) = next_command(&mut live.ws).await;
        // A NUL in a daemon's result (which PostgreSQL cannot store) does not keep the result
        // from being recorded.
        finish(&mut live.ws, &got, Outcome::Failed, 1, json!({"passed": false, "failures": [{"gpu": 3, "detail": "xid\u{0}79"}]})).await;
        let mut seen = Vec::new();
        while seen.last().map(String::as_str) != Some("failed") {
            let update = client.next_data("c", "commandUpdates", Duration::from_secs(10)).await.unwrap();
            assert_eq!(update["command"]["id"], json!(id));
            seen.push(update["to"].as_str().unwrap().to_owned());
        }
        assert_eq!(seen, vec!["queued", "dispatched", "running", "failed"]);
        let last = command(s, &id).await;
        assert_eq!(last["result"]["failures"][0]["gpu"], 3);
        assert_eq!(last["result"]["failures"][0]["detail"], "xid\u{FFFD}79");
    })
    .await;
}

#[tokio::test]
async fn commands_left_dispatched_by_a_crashed_session_are_redelivered_to_the_next() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let live = live_node(s, &site, &pool).await;
        let services = &s.server.services;
        let node = bc_core::ids::NodeId::parse(&live.node_id).unwrap();
        // The session of epoch 1 is held by the test: the command goes to it...
        let sent = send_command(s, s.admin_token(), &live.node_id, "LOGS_COLLECT", json!({}))
            .await
            .unwrap();
        let id = sent[0]["id"].as_str().unwrap().to_owned();
        wait_status(s, &id, "DISPATCHED").await;
        // ...and that session's replica dies without recording anything: the next session
        // (epoch 2, opened elsewhere) gets the command again.
        let look = better_compute::service::commands::DispatchLook {
            node_id: node.clone(),
            epoch: 2,
            in_flight: Vec::new(),
            spec_sent: i64::MAX,
        };
        let mut answers = services.dispatch_many(&[look]).await.unwrap();
        let redelivered = answers.pop().unwrap().send;
        assert_eq!(
            redelivered
                .iter()
                .map(|c| c.id.to_string())
                .collect::<Vec<_>>(),
            vec![id.clone()]
        );
        let again = command(s, &id).await;
        assert_eq!(
            (again["status"].as_str(), again["attempts"].as_i64()),
            (Some("DISPATCHED"), Some(2))
        );
    })
    .await;
}

/// How long a SQLite test gives the server to reach the write it must wait at: SQLite cannot
/// say who waits, and the server only needs to run a read first. (Well within the server's
/// SQLite busy timeout, after which its write would fail.)
const SQLITE_SETTLE: Duration = Duration::from_millis(500);

/// Returns once the server waits for the row `holder` has locked: on PostgreSQL when a
/// backend of the test database waits for a lock, on SQLite after [`SQLITE_SETTLE`].
async fn until_the_server_waits(s: &TestServer, watcher: &sea_orm::DatabaseConnection) {
    if s.backend != bc_testing::Backend::Postgres {
        tokio::time::sleep(SQLITE_SETTLE).await;
        return;
    }
    s.wait_for_lock_waiters(watcher, "true", 1).await;
}

/// A change to a command that loses a race with another writer is judged on the status the
/// winner left, and answered in words about the command (issue 15, item 7: it was `CONFLICT`
/// with `currentVersion: 0`, a node's answer with a version commands do not have). The test
/// plays the winner from a connection of its own: it changes the command's row in a
/// transaction it holds open until the server's change waits for it, then commits.
///
/// - A cancel that loses to the daemon's result: `INVALID_STATE`, "already finished".
/// - The timing controller that found a queued command overdue and loses to a dispatch: the
///   command is dispatched now and far from its deadline, so it is left alone (it used to be
///   timed out on the spot, the controller deciding on the status it had read unlocked).
#[tokio::test]
async fn a_command_change_that_loses_a_race_is_judged_on_the_winners_status() {
    use sea_orm::{ConnectionTrait, TransactionTrait};
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let node = s.enroll(&site, &pool, "gpu-race").await["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let holder = s.single_connection().await;
        let watcher = s.single_connection().await;

        // The cancel and the result.
        let sent = send_command(s, s.admin_token(), &node, "INVENTORY_REFRESH", json!({}))
            .await
            .unwrap();
        let id = sent[0]["id"].as_str().unwrap().to_owned();
        let held = holder.begin().await.unwrap();
        held.execute_unprepared(&format!(
            "UPDATE commands SET status = 'succeeded', finished_at = not_before WHERE id = '{id}'"
        ))
        .await
        .unwrap();
        let cancel = tokio::spawn({
            let (url, token, id) = (s.url(), s.admin_token().to_owned(), id.clone());
            async move {
                reqwest::Client::new()
                    .post(format!("{url}/graphql"))
                    .bearer_auth(token)
                    .json(&json!({
                        "query": "mutation($id: ID!) { cancelCommand(input: { id: $id }) { command { status } } }",
                        "variables": { "id": id },
                    }))
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            }
        });
        until_the_server_waits(s, &watcher).await;
        held.commit().await.unwrap();
        let answer = cancel.await.unwrap();
        let error = &answer["errors"][0];
        assert_eq!(error["extensions"]["code"], "INVALID_STATE", "{answer:#}");
        assert_eq!(
            error["message"],
            format!("command {id} already finished (SUCCEEDED): only a QUEUED, DISPATCHED or RUNNING command can be cancelled")
        );
        assert_eq!(command(s, &id).await["status"], "SUCCEEDED");

        // The controller and a dispatch.
        let sent = send_command(
            s,
            s.admin_token(),
            &node,
            "LOGS_COLLECT",
            json!({"expiresInSeconds": 60}),
        )
        .await
        .unwrap();
        let id = sent[0]["id"].as_str().unwrap().to_owned();
        s.clock.advance(chrono::Duration::seconds(61));
        let held = holder.begin().await.unwrap();
        // Dispatched (by the clock) a moment ago: its deadline is its timeout away.
        held.execute_unprepared(&format!(
            "UPDATE commands SET status = 'dispatched', dispatched_at = expires_at, \
             session_epoch = 1, attempts = 1 WHERE id = '{id}'"
        ))
        .await
        .unwrap();
        let tick = tokio::spawn({
            let mut controller = CommandTimingController::new(s.server.services.clone());
            async move { controller.tick().await }
        });
        until_the_server_waits(s, &watcher).await;
        held.commit().await.unwrap();
        let report = tick.await.unwrap().unwrap();
        assert_eq!((report.expired, report.timed_out), (0, 0), "{report:?}");
        let after = command(s, &id).await;
        assert_eq!(after["status"], "DISPATCHED", "{after:#}");
        assert!(after["error"].is_null(), "{after:#}");

        holder.close().await.unwrap();
        watcher.close().await.unwrap();
    })
    .await;
}

/// A command to thousands of nodes is queued for every one of them: their rows are inserted
/// in several statements, since one INSERT of 3,000 commands binds more parameters than
/// either database accepts in one statement.
#[tokio::test]
async fn a_command_to_thousands_of_nodes_is_queued_for_each() {
    const TARGETS: usize = 3_000;
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let nodes: Vec<_> = (0..TARGETS)
            .map(|_| crate::common::node_record(s, &place, bc_core::axes::ProvisionState::Deployed))
            .collect();
        s.insert_nodes(&nodes).await;
        let sent = s
            .admin(
                "mutation($pool: ID!) { sendCommand(input: {filter: {poolId: [$pool]}, kind: LOGS_COLLECT}) { commands { id } } }",
                json!({"pool": place.1.to_string()}),
            )
            .await;
        assert_eq!(sent["sendCommand"]["commands"].as_array().unwrap().len(), TARGETS);
        let stored = s
            .admin("{ commands(filter: {kind: [LOGS_COLLECT]}, first: 1) { totalCount } }", json!({}))
            .await;
        assert_eq!(stored["commands"]["totalCount"], TARGETS);
    })
    .await;
}
