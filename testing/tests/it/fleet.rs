//! The FakeDaemon and the fleet simulator against the real gateway, on both backends.

use bc_testing::daemon::{CaTrust, DaemonError, DaemonKnobs, FakeDaemon, Phase};
use bc_testing::sim::{Fleet, SimOptions};
use bc_testing::{Backend, TestServer, each_backend};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

/// Generous bounds for things that take milliseconds, so a loaded CI machine does not fail.
const SETTLE: Duration = Duration::from_secs(60);
/// 200 nodes joining and connecting through TLS on a 2-core machine.
const FLEET_UP: Duration = Duration::from_secs(180);

async fn node(server: &TestServer, id: &str) -> Value {
    server
        .admin(
            "query($id: ID!) { node(id: $id) { id hostname version connectivity identityGeneration hardwareKeyTrusted provisionState session { epoch gatewayId } } }",
            json!({ "id": id }),
        )
        .await["node"]
        .clone()
}

/// Polls the node until `predicate` holds (at most [`SETTLE`]).
async fn node_until(
    server: &TestServer,
    id: &str,
    what: &str,
    predicate: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + SETTLE;
    loop {
        let current = node(server, id).await;
        if predicate(&current) {
            return current;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: node is {current:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `revokeNodeIdentity` with the node's current version, reading it again when a controller
/// changed the node in between (`CONFLICT`).
async fn revoke(server: &TestServer, id: &str) {
    const TRIES: usize = 20;
    for _ in 0..TRIES {
        let version = node(server, id).await["version"].clone();
        let answer = server
            .gql(
                Some(server.admin_token()),
                "mutation($id: ID!, $v: Int!) { revokeNodeIdentity(input: {id: $id, version: $v, reason: \"test\"}) { node { identityGeneration } } }",
                json!({ "id": id, "v": version }),
            )
            .await;
        match answer.code() {
            None => return,
            Some("CONFLICT") => tokio::time::sleep(Duration::from_millis(20)).await,
            Some(_) => panic!("revoking {id}: {:#}", answer.body),
        }
    }
    panic!("revoking {id}: still CONFLICT after {TRIES} tries");
}

async fn all_nodes(server: &TestServer) -> Vec<Value> {
    let mut nodes = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = server
            .admin(
                "query($after: String) { nodes(first: 500, after: $after) { edges { node { id hostname connectivity session { epoch } } } pageInfo { hasNextPage endCursor } } }",
                json!({ "after": after }),
            )
            .await;
        let connection = &page["nodes"];
        nodes.extend(
            connection["edges"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e["node"].clone()),
        );
        if connection["pageInfo"]["hasNextPage"] != true {
            return nodes;
        }
        after = connection["pageInfo"]["endCursor"]
            .as_str()
            .map(str::to_owned);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_simulated_nodes_join_connect_and_heartbeat() {
    const NODES: usize = 200;
    each_backend(async |server| {
        let (site, pool) = server.site_and_pool(8).await;
        let secret = server.join_token(&site, Some(&pool), NODES as i64).await;
        let options = SimOptions {
            seed: Some(7),
            knobs: DaemonKnobs {
                heartbeat_interval_override: Some(Duration::from_millis(500)),
                ..DaemonKnobs::default()
            },
            ..SimOptions::mixed()
        };
        let fleet = Fleet::start(
            &[server.gateway_url()],
            &secret,
            CaTrust::Pem(server.ca_pem()),
            NODES,
            &options,
        )
        .await
        .expect("a fleet");
        let up = fleet
            .wait_for(|p| p.connected == NODES as u64, FLEET_UP)
            .await;
        assert!(
            up.is_ok(),
            "not all connected: {:?}; e.g. {:?}",
            up,
            fleet.sample_error()
        );
        let progress = fleet
            .wait_for(|p| p.heartbeats_sent >= 2 * NODES as u64, SETTLE)
            .await
            .expect("heartbeats flow");
        assert_eq!(progress.joined, NODES as u64);
        assert_eq!(progress.failed, 0);

        let nodes = all_nodes(server).await;
        assert_eq!(nodes.len(), NODES);
        assert!(
            nodes.iter().all(|n| n["connectivity"] == "CONNECTED"),
            "every node is connected"
        );
        assert!(
            nodes
                .iter()
                .all(|n| n["session"]["epoch"].as_i64().is_some_and(|e| e >= 1))
        );
        let mut ids: Vec<String> = fleet.node_ids();
        ids.sort();
        let mut listed: Vec<String> = nodes
            .iter()
            .filter_map(|n| n["id"].as_str().map(str::to_owned))
            .collect();
        listed.sort();
        assert_eq!(
            ids, listed,
            "the daemons' node ids are the nodes the API lists"
        );
        // Daemons whose GPU fails in service (the mixed fleet's) reconnect to report it.
        for daemon in fleet
            .daemons()
            .iter()
            .filter(|d| d.knobs().xid_after.is_none())
            .take(5)
        {
            let status = daemon.status();
            assert_eq!(status.phase, Phase::Connected);
            assert_eq!(status.identity_generation, Some(1));
            assert_eq!(
                status.inventory_sections_sent, 7,
                "a new node is asked for every section"
            );
            let id = status.node_id.expect("a node id");
            let detail = node(server, &id).await;
            assert_eq!(detail["hostname"], daemon.hostname());
            assert_eq!(detail["hardwareKeyTrusted"], true);
            assert_eq!(detail["session"]["epoch"], json!(status.epoch));
        }

        // A stopped fleet closes its sessions: the nodes become disconnected.
        let probe = fleet.node_ids().swap_remove(0);
        let last = fleet.shutdown().await;
        assert_eq!(last.connected, 0);
        node_until(
            server,
            &probe,
            "disconnected after the fleet stopped",
            |n| n["connectivity"] == "DISCONNECTED",
        )
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_pins_the_ca_renews_reconnects_and_stops_when_revoked() {
    each_backend(async |server| {
        let (site, pool) = server.site_and_pool(8).await;
        let created = server
            .admin(
                "mutation($site: ID!, $pool: ID) { createJoinToken(input: {siteId: $site, poolId: $pool, maxUses: 5}) { secret caCertificateSha256 } }",
                json!({ "site": site, "pool": pool }),
            )
            .await["createJoinToken"]
            .clone();
        let secret = created["secret"].as_str().expect("secret").to_owned();
        let pin = created["caCertificateSha256"].as_str().expect("pin").to_owned();

        // A wrong pin is refused before anything is sent.
        let wrong = FakeDaemon::new(server.gateway_url(), secret.clone(), CaTrust::Sha256Pin("00".repeat(32)));
        assert!(matches!(wrong.run().await, Err(DaemonError::CaFingerprintMismatch { .. })));
        assert_eq!(wrong.status().phase, Phase::Failed);
        assert_eq!(wrong.status().joins, 0);

        let daemon = FakeDaemon::new(server.gateway_url(), secret.clone(), CaTrust::Sha256Pin(pin)).with_knobs(DaemonKnobs {
            renew_interval_override: Some(Duration::from_millis(500)),
            flapping: Some(Duration::from_secs(2)),
            heartbeat_interval_override: Some(Duration::from_millis(200)),
            ..DaemonKnobs::default()
        });
        let task = daemon.start();
        let renewed = daemon.wait_for(|s| s.renewals >= 2 && s.sessions >= 2 && s.connected, SETTLE).await.expect("renewals and a reconnect");
        let id = renewed.node_id.clone().expect("a node id");
        assert_eq!(renewed.identity_generation, Some(1), "renewal keeps the generation");
        assert!(renewed.heartbeats_sent > 0);
        // The reconnect after the flap is a new session with a higher epoch, and no section
        // is sent again: the gateway has them all.
        node_until(server, &id, "connected with the new epoch", |n| {
            n["connectivity"] == "CONNECTED" && n["session"]["epoch"].as_i64() >= Some(2)
        })
        .await;
        assert!(daemon.status().inventory_sections_sent == 7, "sections sent once: {:?}", daemon.status());

        // Revoking the identity ends the session with a goodbye, and the daemon stops.
        revoke(server, &id).await;
        let result = tokio::time::timeout(SETTLE, task).await.expect("the daemon stops").expect("the task");
        assert!(matches!(result, Err(DaemonError::IdentityRevoked(_))), "{result:?}");
        let status = daemon.status();
        assert_eq!(status.phase, Phase::Failed);
        assert!(!status.connected);
        // The revocation reaches the daemon either as the live session's goodbye or, when it
        // lands while the flapping daemon reconnects, as the gateway refusing the old
        // certificate: both say the identity is gone.
        let reason = status.last_close_reason.clone().unwrap_or_default();
        assert!(
            reason == bc_core::protocol::close::IDENTITY_REVOKED || reason.contains("revoked or replaced"),
            "{reason}"
        );
    })
    .await;
}

/// PROTOCOL.md: when a session closes, the node becomes `disconnected` (if that session was
/// still the current one), and revoking the identity closes the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_connected_node_disconnects_it() {
    each_backend(async |server| {
        let (site, pool) = server.site_and_pool(8).await;
        let secret = server.join_token(&site, Some(&pool), 1).await;
        let daemon = FakeDaemon::new(server.gateway_url(), secret, CaTrust::Pem(server.ca_pem()));
        let task = daemon.start();
        let id = daemon
            .wait_for(|s| s.connected, SETTLE)
            .await
            .expect("connected")
            .node_id
            .expect("a node id");
        node_until(server, &id, "connected", |n| {
            n["connectivity"] == "CONNECTED"
        })
        .await;
        revoke(server, &id).await;
        let result = tokio::time::timeout(SETTLE, task)
            .await
            .expect("the daemon stops")
            .expect("the task");
        assert!(
            matches!(result, Err(DaemonError::IdentityRevoked(_))),
            "{result:?}"
        );
        node_until(server, &id, "disconnected after revocation", |n| {
            n["connectivity"] == "DISCONNECTED"
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_machine_rejoins_in_place_and_a_used_up_token_is_final() {
    each_backend(async |server| {
        let (site, pool) = server.site_and_pool(8).await;
        let secret = server.join_token(&site, Some(&pool), 2).await;
        let machine = DaemonKnobs {
            seed: Some(42),
            hostname: Some("gpu-rejoin".into()),
            ..DaemonKnobs::default()
        };

        let first = FakeDaemon::new(
            server.gateway_url(),
            secret.clone(),
            CaTrust::TrustOnFirstUse,
        )
        .with_knobs(machine.clone());
        let task = first.start();
        let joined = first
            .wait_for(|s| s.connected, SETTLE)
            .await
            .expect("the first daemon connects");
        first.stop();
        assert!(
            tokio::time::timeout(SETTLE, task)
                .await
                .expect("stops")
                .expect("task")
                .is_ok()
        );
        assert_eq!(first.status().phase, Phase::Stopped);

        // The same machine (same identifiers) joins again: the same node, a new generation.
        let second = FakeDaemon::new(
            server.gateway_url(),
            secret.clone(),
            CaTrust::Pem(server.ca_pem()),
        )
        .with_knobs(machine.clone());
        let task = second.start();
        let rejoined = second
            .wait_for(|s| s.connected, SETTLE)
            .await
            .expect("the second daemon connects");
        assert_eq!(rejoined.node_id, joined.node_id, "reclaimed in place");
        assert_eq!(rejoined.identity_generation, Some(2));
        assert!(
            rejoined.inventory_sections_sent < 7,
            "the gateway already has this machine's inventory: {rejoined:?}"
        );

        // The token admitted two joins; a third machine is refused for good.
        let third = FakeDaemon::new(server.gateway_url(), secret, CaTrust::Pem(server.ca_pem()));
        match third.run().await {
            Err(DaemonError::Refused {
                status: 401, code, ..
            }) => assert_eq!(code, "UNAUTHENTICATED"),
            other => panic!("expected a 401, got {other:?}"),
        }
        assert_eq!(third.status().phase, Phase::Failed);

        second.stop();
        assert!(
            tokio::time::timeout(SETTLE, task)
                .await
                .expect("stops")
                .expect("task")
                .is_ok()
        );
    })
    .await;
}

/// A bare-metal machine enrolled through its BMC (issue 15, item 7): the daemon that boots
/// on it is recognised as the enrolled node and does not join as a second one. The BMC knows
/// a different subset of the machine's identifiers than the daemon reports (its system UUID,
/// its host NIC's MAC in its own spelling, and a system serial the daemon does not report).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_booting_on_an_enrolled_machine_is_its_enrolled_node() {
    each_backend(async |server| {
        let (site, pool) = server.site_and_pool(8).await;
        let seed = 4242;
        let machine = bc_testing::inventory::Machine::new(seed, None, None);
        let uuid = machine.identifiers["system-uuid"].to_uppercase();
        let mac = machine.identifiers["mac:eno1"].replace(':', "-").to_uppercase();
        let enrolled = server
            .admin(
                "mutation($input: EnrollNodeInput!) { enrollNode(input: $input) { node { id hardwareKeyTrusted } } }",
                json!({ "input": {
                    "siteId": site, "poolId": pool, "hostname": "bm-001",
                    "identifiers": [
                        { "name": "system-uuid", "value": format!("{{{uuid}}}") },
                        { "name": "mac", "value": mac },
                        { "name": "system-serial", "value": "S4N-0042" },
                    ],
                } }),
            )
            .await["enrollNode"]["node"]
            .clone();
        assert_eq!(enrolled["hardwareKeyTrusted"], true);
        let id = enrolled["id"].as_str().unwrap_or_default().to_owned();

        let secret = server.join_token(&site, Some(&pool), 1).await;
        let daemon = FakeDaemon::new(
            server.gateway_url(),
            secret,
            CaTrust::Pem(server.ca_pem()),
        )
        .with_knobs(DaemonKnobs {
            seed: Some(seed),
            ..DaemonKnobs::default()
        });
        let task = daemon.start();
        let status = daemon
            .wait_for(|s| s.connected && s.inventory_sections_sent >= 7, SETTLE)
            .await
            .expect("the daemon connects and reports its inventory");
        assert_eq!(status.node_id.as_deref(), Some(id.as_str()));
        let nodes = server.admin("{ nodes { totalCount } }", json!({})).await;
        assert_eq!(nodes["nodes"]["totalCount"], 1, "no second node");
        let claimed = node_until(server, &id, "connected", |n| {
            n["connectivity"] == "CONNECTED"
        })
        .await;
        // Still the enrolled machine on its bare-metal path, now with the daemon's identity.
        assert_eq!(claimed["provisionState"], "ENROLLING");
        assert_eq!(claimed["hostname"], "bm-001");
        assert_eq!(claimed["identityGeneration"], 2);
        assert_eq!(claimed["hardwareKeyTrusted"], true);
        let history = server
            .admin(
                "query($id: ID!) { node(id: $id) { events(first: 50) { nodes { type data } } } }",
                json!({ "id": id }),
            )
            .await;
        let events = history["node"]["events"]["nodes"].as_array().cloned().unwrap_or_default();
        let rejoined = events
            .iter()
            .find(|e| e["type"] == "node.rejoined")
            .unwrap_or_else(|| panic!("a node.rejoined event: {events:#?}"));
        assert!(
            rejoined.to_string().contains("the identifiers it was enrolled with"),
            "{rejoined:#}"
        );
        // The key the join gave it is the one its inventory computes, once both sections it
        // is computed from are stored: set once, at the join.
        let db = server.database().await;
        let stored = async |sql: String| {
            use sea_orm::ConnectionTrait;
            db.query_all_raw(sea_orm::Statement::from_string(db.get_database_backend(), sql))
                .await
                .expect("a query")
        };
        let deadline = tokio::time::Instant::now() + SETTLE;
        while stored(format!(
            "SELECT section FROM node_inventory_sections WHERE node_id = '{id}' AND section IN ('system', 'network')"
        ))
        .await
        .len()
            < 2
        {
            assert!(tokio::time::Instant::now() < deadline, "the inventory is stored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let key: Option<String> = stored(format!("SELECT hardware_key FROM nodes WHERE id = '{id}'"))
            .await[0]
            .try_get("", "hardware_key")
            .expect("the key column");
        assert_eq!(key, bc_core::hardware::hardware_key(&machine.identifiers).key);
        let history = server
            .admin(
                "query($id: ID!) { node(id: $id) { events(first: 50) { nodes { type } } } }",
                json!({ "id": id }),
            )
            .await;
        let key_changes = history["node"]["events"]["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["type"] == "node.hardware_key_changed")
            .count();
        assert_eq!(key_changes, 1, "{history:#}");

        daemon.stop();
        assert!(
            tokio::time::timeout(SETTLE, task)
                .await
                .expect("stops")
                .expect("task")
                .is_ok()
        );
    })
    .await;
}

/// The gateway each node's session is on, by node id.
async fn session_gateways(server: &TestServer) -> BTreeMap<String, String> {
    let page = server
        .admin(
            "{ nodes(first: 500) { edges { node { id connectivity session { gatewayId } } } } }",
            json!({}),
        )
        .await;
    page["nodes"]["edges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["node"]["connectivity"] == "CONNECTED")
        .filter_map(|e| {
            Some((
                e["node"]["id"].as_str()?.to_owned(),
                e["node"]["session"]["gatewayId"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// Issue 16, item 2: a daemon may connect to any replica. Daemons given two replicas'
/// gateways spread over them, and when one replica stops, its daemons move to the other.
/// Replicas share a database, so this runs on PostgreSQL only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_spreads_over_replicas_and_moves_off_one_that_stops() {
    const NODES: usize = 8;
    for backend in Backend::selected()
        .into_iter()
        .filter(|b| *b == Backend::Postgres)
    {
        let a = TestServer::start(backend).await.expect("replica A");
        let b = a.replica().await.expect("replica B");
        let (site, pool) = a.site_and_pool(8).await;
        let secret = a.join_token(&site, Some(&pool), NODES as i64).await;
        let options = SimOptions {
            seed: Some(11),
            ..SimOptions::default()
        };
        let fleet = Fleet::start(
            &[a.gateway_url(), b.gateway_url()],
            &secret,
            CaTrust::Pem(a.ca_pem()),
            NODES,
            &options,
        )
        .await
        .expect("a fleet on both gateways");
        fleet
            .wait_for(|p| p.connected == NODES as u64, FLEET_UP)
            .await
            .unwrap_or_else(|p| {
                panic!("not all connected: {p:?}; e.g. {:?}", fleet.sample_error())
            });

        let deadline = tokio::time::Instant::now() + SETTLE;
        let before = loop {
            let gateways = session_gateways(&a).await;
            if gateways.len() == NODES {
                break gateways;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sessions: {gateways:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let mut per_gateway: BTreeMap<&str, usize> = BTreeMap::new();
        for gateway in before.values() {
            *per_gateway.entry(gateway).or_default() += 1;
        }
        // Half start on each; a daemon whose first try failed may have moved.
        assert_eq!(
            per_gateway.len(),
            2,
            "the daemons are spread over both gateways: {per_gateway:?}"
        );

        // B stops (its daemons are told to go away): they reconnect to A, and only A.
        b.stop().await;
        let deadline = tokio::time::Instant::now() + SETTLE;
        let after = loop {
            let gateways = session_gateways(&a).await;
            let on: HashSet<&String> = gateways.values().collect();
            if gateways.len() == NODES && on.len() == 1 {
                break gateways;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "B's daemons did not all move to A: {gateways:?}; {}",
                fleet.progress()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let survivor = after.values().next().expect("a gateway");
        assert!(
            per_gateway.contains_key(survivor.as_str()),
            "they moved to the surviving replica's gateway"
        );
        assert_eq!(fleet.progress().failed, 0);
        fleet.shutdown().await;
        a.stop().await;
    }
}
