//! Live subscriptions over `graphql-transport-ws` and the durable event log behind them, on
//! SQLite and on PostgreSQL: replay then follow with no gap and no duplicate, `nodeChanges`
//! snapshots and filters, resuming from a cursor after a disconnect and after a server
//! restart, two replicas on one PostgreSQL, a slow consumer told to resume, and auth.
//!
//! Every wait is for a message, bounded by [`WAIT`]; nothing sleeps and nothing is timed.

use bc_core::clock::Clock;
use bc_core::event::{EventType, RecordedEvent};
use bc_core::ids::{EventId, TenantId};
use bc_entity::node_session;
use bc_testing::subscription::{ConnectError, ConnectOptions, SubMessage, SubscriptionClient};
use bc_testing::{Backend, TestServer, each_backend, each_backend_with};
use better_compute::auth::{Role, TokenKeys};
use better_compute::feed::FEED_BUFFER;
use chrono::{Duration as ChronoDuration, Utc};
use sea_orm::{ActiveValue::Set, EntityTrait};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::time::Duration;

/// The longest any single message may take to arrive: generous, for a loaded machine.
const WAIT: Duration = Duration::from_secs(30);

const EVENTS: &str = "subscription($after: ID, $filter: EventFilterInput, $nodeId: ID) {
  events(after: $after, filter: $filter, nodeId: $nodeId) { id type nodeId axis from to actor cause data at }
}";

const NODE_CHANGES: &str = "subscription($filter: NodeFilterInput, $after: ID) {
  nodeChanges(filter: $filter, after: $after) {
    kind cursor
    node { id version poolId cordoned ownerTenantId labels { key value } }
    change { eventId type axis from to actor cause version at }
  }
}";

/// The actor of every change made with the harness's admin token.
const ADMIN_ACTOR: &str = "user:test-admin";

// ---------------------------------------------------------------------------------------
// Fixtures and helpers

/// A node the test changes, with the version it last read.
#[derive(Debug, Clone)]
struct Node {
    id: String,
    version: i64,
    cordoned: bool,
    /// Changes made through [`bump`].
    bumps: usize,
}

/// `count` nodes enrolled through the API into `pool` of `site`.
async fn enroll(s: &TestServer, site: &str, pool: &str, count: usize) -> Vec<Node> {
    let mut nodes = Vec::new();
    for i in 0..count {
        let node = s
            .enroll(
                site,
                pool,
                &format!("gpu-{i}-{}.example.com", uuid::Uuid::new_v4().simple()),
            )
            .await;
        nodes.push(Node {
            id: node["id"].as_str().expect("a node id").to_owned(),
            version: node["version"].as_i64().expect("a version"),
            cordoned: false,
            bumps: 0,
        });
    }
    nodes
}

/// A platform site and pool with `count` nodes.
async fn fleet(s: &TestServer, count: usize) -> Vec<Node> {
    let (site, pool) = s.site_and_pool(8).await;
    enroll(s, &site, &pool, count).await
}

/// A second pool on `site`.
async fn pool_on(s: &TestServer, site: &str, name: &str) -> String {
    s.admin(
        "mutation($site: ID!, $name: String!) { createPool(input: {siteId: $site, name: $name, kind: METAL_HOST}) { pool { id } } }",
        json!({ "site": site, "name": name }),
    )
    .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("a pool id")
        .to_owned()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Cordon,
    Uncordon,
    Label,
}

/// Changes `node` once (a label, then a cordon or an uncordon, in turn): every call is a
/// real change, so it writes events and bumps the version. Returns what it did.
async fn bump(s: &TestServer, node: &mut Node) -> Change {
    let change = match (node.bumps % 2, node.cordoned) {
        (0, _) => Change::Label,
        (_, false) => Change::Cordon,
        (_, true) => Change::Uncordon,
    };
    node.bumps += 1;
    apply(s, node, change).await;
    change
}

/// Applies `change` to `node` through `s` with the admin token and records the new version.
async fn apply(s: &TestServer, node: &mut Node, change: Change) {
    let (field, query, vars) = match change {
        Change::Cordon => (
            "cordonNode",
            "mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: \"subscription test\"}) { node { version } } }",
            json!({ "id": node.id, "v": node.version }),
        ),
        Change::Uncordon => (
            "uncordonNode",
            "mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }",
            json!({ "id": node.id, "v": node.version }),
        ),
        Change::Label => (
            "labelNode",
            "mutation($id: ID!, $v: Int!, $value: String!) { labelNode(input: {id: $id, version: $v, set: [{key: \"round\", value: $value}]}) { node { version } } }",
            json!({ "id": node.id, "v": node.version, "value": format!("v{}", node.version + 1) }),
        ),
    };
    let data = s.admin(query, vars).await;
    let version = data[field]["node"]["version"]
        .as_i64()
        .expect("the new version");
    assert_eq!(
        version,
        node.version + 1,
        "{change:?} of {} changed it once",
        node.id
    );
    node.version = version;
    match change {
        Change::Cordon => node.cordoned = true,
        Change::Uncordon => node.cordoned = false,
        Change::Label => {}
    }
}

/// Every event of the table after `after`, oldest first, read in pages.
async fn table_after(s: &TestServer, after: i64) -> Vec<RecordedEvent> {
    let mut all: Vec<RecordedEvent> = Vec::new();
    let mut last = after;
    loop {
        let page = s
            .server
            .services
            .events_after(last, 1000)
            .await
            .unwrap_or_else(|err| panic!("reading the event table: {}", err.message()));
        let Some(newest) = page.last() else { break };
        last = newest.id.0;
        all.extend(page);
    }
    all
}

/// The newest event's sequence number.
async fn head(s: &TestServer) -> i64 {
    s.server
        .services
        .event_head()
        .await
        .unwrap_or_else(|err| panic!("reading the event head: {}", err.message()))
}

/// `evt_<seq>` as its sequence number.
fn seq(value: &Value) -> i64 {
    let raw = value
        .as_str()
        .unwrap_or_else(|| panic!("an event id, got {value}"));
    EventId::parse(raw)
        .unwrap_or_else(|err| panic!("`{raw}` is an event id: {err}"))
        .0
}

fn cursor(seq: i64) -> String {
    EventId(seq).to_string()
}

fn ids(events: &[RecordedEvent]) -> Vec<i64> {
    events.iter().map(|e| e.id.0).collect()
}

/// Ids strictly increase (which also rules out duplicates).
#[track_caller]
fn assert_strictly_increasing(ids: &[i64], what: &str) {
    if let Some(pair) = ids.windows(2).find(|w| w[0] >= w[1]) {
        panic!(
            "{what}: ids must strictly increase, but {} came after {}",
            pair[1], pair[0]
        );
    }
}

async fn connect(s: &TestServer) -> SubscriptionClient {
    SubscriptionClient::connect(&s.url(), s.admin_token())
        .await
        .expect("connecting as the admin")
}

/// Reads `events` messages of subscription `id` until one has sequence number `last` or
/// higher; returns them all.
async fn events_through(client: &mut SubscriptionClient, id: &str, last: i64) -> Vec<Value> {
    let mut got = Vec::new();
    let mut newest = i64::MIN;
    while newest < last {
        let event = client
            .next_data(id, "events", WAIT)
            .await
            .expect("the next event");
        newest = seq(&event["id"]);
        got.push(event);
    }
    got
}

fn event_ids(events: &[Value]) -> Vec<i64> {
    events.iter().map(|e| seq(&e["id"])).collect()
}

/// Asserts the events delivered are exactly the table's, in order, field by field.
#[track_caller]
fn assert_same_events(delivered: &[Value], table: &[RecordedEvent], what: &str) {
    let delivered_ids = event_ids(delivered);
    assert_strictly_increasing(&delivered_ids, what);
    assert_eq!(
        delivered_ids,
        ids(table),
        "{what}: the events delivered are exactly the table's"
    );
    for (got, row) in delivered.iter().zip(table) {
        assert_eq!(
            got["type"],
            json!(row.event_type),
            "{what}: type of {}",
            row.id
        );
        assert_eq!(
            got["nodeId"],
            json!(row.node_id),
            "{what}: node of {}",
            row.id
        );
        assert_eq!(
            got["actor"],
            json!(row.actor),
            "{what}: actor of {}",
            row.id
        );
    }
}

/// Reads the `nodeChanges` items of `id` until one has cursor `last` or higher.
async fn changes_through(client: &mut SubscriptionClient, id: &str, last: i64) -> Vec<Value> {
    let mut got = Vec::new();
    let mut newest = i64::MIN;
    while newest < last {
        let item = client
            .next_data(id, "nodeChanges", WAIT)
            .await
            .expect("the next node change");
        newest = seq(&item["cursor"]);
        got.push(item);
    }
    got
}

/// Reads a `nodeChanges` snapshot of `count` nodes: returns their ids and the cursor.
async fn snapshot(
    client: &mut SubscriptionClient,
    id: &str,
    count: usize,
) -> (BTreeSet<String>, i64) {
    let mut nodes = BTreeSet::new();
    let mut cursors = BTreeSet::new();
    for _ in 0..count {
        let item = client
            .next_data(id, "nodeChanges", WAIT)
            .await
            .expect("a snapshot item");
        assert_eq!(
            item["kind"],
            json!("SNAPSHOT"),
            "snapshot items come first: {item:#}"
        );
        assert_eq!(
            item["change"],
            Value::Null,
            "a snapshot carries no change: {item:#}"
        );
        assert!(
            nodes.insert(item["node"]["id"].as_str().expect("a node id").to_owned()),
            "each node once: {item:#}"
        );
        cursors.insert(seq(&item["cursor"]));
    }
    assert_eq!(
        cursors.len(),
        1,
        "every snapshot item carries the same cursor"
    );
    (nodes, cursors.into_iter().next().unwrap_or_default())
}

fn set_of(nodes: &[&Node]) -> BTreeSet<String> {
    nodes.iter().map(|n| n.id.clone()).collect()
}

/// Asserts `item` is the CHANGE of `node` made by `change`, with every field of the change.
#[track_caller]
fn assert_change(item: &Value, node: &Node, change: Change) {
    assert_eq!(item["kind"], json!("CHANGE"), "{item:#}");
    assert_eq!(
        item["node"]["id"],
        json!(node.id),
        "the change of {}: {item:#}",
        node.id
    );
    let c = &item["change"];
    assert_eq!(
        c["eventId"], item["cursor"],
        "a change's cursor is its event id: {item:#}"
    );
    assert_eq!(c["actor"], json!(ADMIN_ACTOR), "{item:#}");
    assert_eq!(
        c["version"],
        json!(node.version),
        "the node's version after the change: {item:#}"
    );
    assert_eq!(
        item["node"]["version"],
        json!(node.version),
        "the node as it is now: {item:#}"
    );
    assert!(c["at"].is_string(), "{item:#}");
    let (event_type, axis, from, to, cause) = match change {
        Change::Cordon => (
            "node.cordoned",
            "cordoned",
            json!("false"),
            json!("true"),
            "cordonNode",
        ),
        Change::Uncordon => (
            "node.uncordoned",
            "cordoned",
            json!("true"),
            json!("false"),
            "uncordonNode",
        ),
        Change::Label => {
            // The label's previous value, if the node had it, was set by an earlier label.
            let from = c["from"].clone();
            assert!(
                from.is_null() || from.as_str().is_some_and(|f| f.starts_with("round=v")),
                "{item:#}"
            );
            (
                "node.label_set",
                "labels",
                from,
                json!(format!("round=v{}", node.version)),
                "labelNode",
            )
        }
    };
    assert_eq!(c["type"], json!(event_type), "{item:#}");
    assert_eq!(c["axis"], json!(axis), "{item:#}");
    assert_eq!(c["from"], from, "{item:#}");
    assert_eq!(c["to"], to, "{item:#}");
    assert_eq!(c["cause"], json!(cause), "{item:#}");
}

// ---------------------------------------------------------------------------------------
// 1. Replay, then follow

/// A subscriber that starts from a cursor taken while several writers change nodes at once
/// receives exactly the table's events after that cursor: strictly increasing ids, no
/// duplicate, nothing missing, across the switch from replaying the table to following the
/// live feed (writes go on during both).
#[tokio::test]
async fn replay_then_follow_has_no_gap_and_no_duplicate_under_concurrent_writes() {
    const WRITERS: usize = 4;
    const ROUNDS: usize = 30;
    each_backend(async |s| {
        let nodes = fleet(s, WRITERS).await;
        // Writer 0 paces the test: at a third of its rounds the cursor is taken, at half the
        // client subscribes and writer 0 waits until the subscription delivered its first
        // event, so later writes land while the subscription is live.
        let (progress_tx, progress_rx) = tokio::sync::watch::channel(0usize);
        let (live_tx, live_rx) = tokio::sync::watch::channel(false);
        let (done_tx, mut done_rx) = tokio::sync::watch::channel(false);

        let writers = async {
            let runs = nodes.iter().cloned().enumerate().map(|(w, mut node)| {
                let progress_tx = &progress_tx;
                let mut live_rx = live_rx.clone();
                async move {
                    for round in 0..ROUNDS {
                        bump(s, &mut node).await;
                        if w == 0 {
                            progress_tx.send_replace(round + 1);
                            if round + 1 == ROUNDS / 2 {
                                live_rx.wait_for(|live| *live).await.expect("the subscriber signals");
                            }
                        }
                    }
                }
            });
            futures::future::join_all(runs).await;
            done_tx.send_replace(true);
        };

        let subscriber = async {
            let mut progress = progress_rx.clone();
            progress.wait_for(|r| *r >= ROUNDS / 3).await.expect("writer 0 progresses");
            let start = head(s).await;
            progress.wait_for(|r| *r >= ROUNDS / 2).await.expect("writer 0 progresses");
            let mut client = connect(s).await;
            client.subscribe("e", EVENTS, json!({ "after": cursor(start) })).await.expect("subscribing");
            let first = client.next_data("e", "events", WAIT).await.expect("the first event");
            live_tx.send_replace(true);
            let mut delivered = vec![first];
            // Read while the writers write; once they are done, read up to the table's end.
            let mut done = false;
            loop {
                if done {
                    let last = table_after(s, start).await.last().map_or(start, |e| e.id.0);
                    let newest = delivered.last().map_or(start, |e| seq(&e["id"]));
                    if newest < last {
                        delivered.extend(events_through(&mut client, "e", last).await);
                    }
                    break;
                }
                tokio::select! {
                    event = client.next_data("e", "events", WAIT) => delivered.push(event.expect("the next event")),
                    changed = done_rx.changed() => {
                        changed.expect("the writers signal");
                        done = *done_rx.borrow();
                    }
                }
            }
            client.close().await;
            (start, delivered)
        };

        let ((), (start, delivered)) = tokio::join!(writers, subscriber);
        let table = table_after(s, start).await;
        // At least writer 0's last two thirds: some replayed, some followed live.
        assert!(table.len() >= ROUNDS - ROUNDS / 3, "the writes after the cursor are in the table");
        assert_same_events(&delivered, &table, &format!("{:?} events after {}", s.backend, cursor(start)));
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// 2. nodeChanges: snapshot, then changes

/// Without a cursor, `nodeChanges` first sends one SNAPSHOT per matching node (all with
/// the same cursor), then CHANGE items, each with the axis, from, to, actor, cause and
/// version of the change. A filter (a pool, `cordoned: true`) applies to both: other
/// nodes' changes are not sent (shown by the next item being the next matching change).
/// A gateway filter, which the feed cannot follow, is refused.
#[tokio::test]
async fn node_changes_send_a_snapshot_then_the_changes_of_matching_nodes() {
    each_backend(async |s| {
        let (site, pool_a) = s.site_and_pool(8).await;
        let pool_b = pool_on(s, &site, "other").await;
        let mut a = enroll(s, &site, &pool_a, 3).await;
        let mut b = enroll(s, &site, &pool_b, 2).await;
        apply(s, &mut a[2], Change::Cordon).await;
        apply(s, &mut b[1], Change::Cordon).await;

        let mut client = connect(s).await;
        client
            .subscribe("all", NODE_CHANGES, json!({}))
            .await
            .expect("subscribing");
        client
            .subscribe(
                "pool",
                NODE_CHANGES,
                json!({ "filter": { "poolId": [pool_a] } }),
            )
            .await
            .expect("subscribing");
        client
            .subscribe(
                "cordoned",
                NODE_CHANGES,
                json!({ "filter": { "cordoned": true } }),
            )
            .await
            .expect("subscribing");

        let (all, all_cursor) = snapshot(&mut client, "all", 5).await;
        assert_eq!(
            all,
            set_of(&[&a[0], &a[1], &a[2], &b[0], &b[1]]),
            "every node"
        );
        let (in_pool, _) = snapshot(&mut client, "pool", 3).await;
        assert_eq!(
            in_pool,
            set_of(&[&a[0], &a[1], &a[2]]),
            "the nodes of the pool"
        );
        let (cordoned, _) = snapshot(&mut client, "cordoned", 2).await;
        assert_eq!(cordoned, set_of(&[&a[2], &b[1]]), "the cordoned nodes");
        assert!(
            all_cursor <= head(s).await,
            "the snapshot's cursor is an event id of the log"
        );

        // A change every subscription matches (a2: in the pool, cordoned) shows all three
        // follow the feed. Then each change is awaited on `all` before the next, so each
        // event's node (attached when the feed reads it) is the node right after that change.
        apply(s, &mut a[2], Change::Label).await;
        for id in ["all", "pool", "cordoned"] {
            let item = client
                .next_data(id, "nodeChanges", WAIT)
                .await
                .expect("the first change");
            assert_change(&item, &a[2], Change::Label);
        }
        let steps: [(bool, usize, Change); 5] = [
            (false, 0, Change::Label),   // b0: not in the pool, not cordoned
            (true, 0, Change::Cordon),   // a0: in the pool, now cordoned
            (true, 1, Change::Label),    // a1: in the pool, not cordoned
            (false, 0, Change::Cordon),  // b0: not in the pool, now cordoned
            (true, 2, Change::Uncordon), // a2: in the pool, no longer cordoned
        ];
        for (in_a, index, change) in steps {
            let node = if in_a { &mut a[index] } else { &mut b[index] };
            apply(s, node, change).await;
            let item = client
                .next_data("all", "nodeChanges", WAIT)
                .await
                .expect("a change on `all`");
            assert_change(&item, node, change);
        }
        // The filtered subscriptions got the matching changes only, in order.
        for (id, expected) in [
            (
                "pool",
                vec![
                    (&a[0], Change::Cordon),
                    (&a[1], Change::Label),
                    (&a[2], Change::Uncordon),
                ],
            ),
            (
                "cordoned",
                vec![(&a[0], Change::Cordon), (&b[0], Change::Cordon)],
            ),
        ] {
            for (node, change) in expected {
                let item = client
                    .next_data(id, "nodeChanges", WAIT)
                    .await
                    .expect("a filtered change");
                assert_change(&item, node, change);
                if id == "cordoned" {
                    assert_eq!(item["node"]["cordoned"], json!(true), "{item:#}");
                }
            }
        }
        // Nothing else is queued: one more change, in the pool and cordoned, comes next on
        // both filtered subscriptions.
        apply(s, &mut a[0], Change::Label).await;
        for id in ["all", "pool", "cordoned"] {
            let item = client
                .next_data(id, "nodeChanges", WAIT)
                .await
                .expect("the last change");
            assert_change(&item, &a[0], Change::Label);
        }
        // A gateway filter is refused: the feed sees node changes, and a session moves to
        // another gateway without one. A node has a session there, so a refusal that came
        // after the snapshot would send that node first.
        let now = s.clock.now();
        node_session::Entity::insert(node_session::ActiveModel {
            node_id: Set(a[0].id.clone()),
            epoch: Set(1),
            gateway_id: Set("gw-a".to_owned()),
            connected_at: Set(now),
            disconnected_at: Set(None),
            last_seen: Set(now),
        })
        .exec_without_returning(&s.database().await)
        .await
        .expect("a session on gw-a");
        client
            .subscribe(
                "gateway",
                NODE_CHANGES,
                json!({ "filter": { "gatewayId": ["gw-a"] } }),
            )
            .await
            .expect("subscribing");
        let refused = client.next("gateway", WAIT).await.expect("an answer");
        assert_eq!(refused.error_code(), Some("BAD_USER_INPUT"), "{refused:?}");
        assert_eq!(
            refused
                .first_error()
                .and_then(|e| e.pointer("/extensions/field")),
            Some(&json!("filter.gatewayId")),
            "{refused:?}"
        );
        client.close().await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// 3. Resume after a disconnect and after a restart

/// A client that disconnects and reconnects with its last cursor receives exactly the
/// events it missed (`events` and `nodeChanges`, the latter without a snapshot), and the
/// same holds when the server restarts on its database in between.
#[tokio::test]
async fn a_client_resumes_from_its_cursor_after_a_disconnect_and_a_server_restart() {
    for backend in Backend::selected() {
        let s = TestServer::start(backend)
            .await
            .unwrap_or_else(|err| panic!("starting a {backend:?} server: {err:#}"));
        let mut nodes = fleet(&s, 2).await;
        let start = head(&s).await;

        // Connected: three changes arrive.
        let mut client = connect(&s).await;
        client
            .subscribe("e", EVENTS, json!({ "after": cursor(start) }))
            .await
            .expect("subscribing");
        client
            .subscribe("n", NODE_CHANGES, json!({ "after": cursor(start) }))
            .await
            .expect("subscribing");
        for round in 0..3 {
            bump(&s, &mut nodes[round % 2]).await;
        }
        let last = head(&s).await;
        let seen = events_through(&mut client, "e", last).await;
        assert_same_events(&seen, &table_after(&s, start).await, "connected");
        let seen_changes = changes_through(&mut client, "n", last).await;
        assert_eq!(seen_changes.len(), seen.len(), "one node change per event");
        let (event_cursor, change_cursor) =
            (last, seq(&seen_changes[seen_changes.len() - 1]["cursor"]));
        client.close().await;

        // Disconnected: four more changes, then a reconnect with the cursors.
        for round in 0..4 {
            bump(&s, &mut nodes[round % 2]).await;
        }
        let missed = table_after(&s, event_cursor).await;
        assert!(!missed.is_empty());
        let (event_cursor, change_cursor) = resume_and_check(
            &s,
            event_cursor,
            change_cursor,
            &mut nodes,
            &format!("{backend:?} after a disconnect"),
        )
        .await;

        // Disconnected across a restart: changes before it and through the new server.
        for round in 0..2 {
            bump(&s, &mut nodes[round % 2]).await;
        }
        let old_url = s.url();
        let s = s
            .restart()
            .await
            .unwrap_or_else(|err| panic!("restarting the {backend:?} server: {err:#}"));
        assert_ne!(s.url(), old_url, "the restarted server listens anew");
        for round in 0..2 {
            bump(&s, &mut nodes[round % 2]).await;
        }
        resume_and_check(
            &s,
            event_cursor,
            change_cursor,
            &mut nodes,
            &format!("{backend:?} after a restart"),
        )
        .await;
        s.stop().await;
    }
}

/// Reconnects with the cursors, checks the missed events and node changes are exactly the
/// table's after them, then that one more change is the next thing on both; returns the
/// new cursors.
async fn resume_and_check(
    s: &TestServer,
    event_cursor: i64,
    change_cursor: i64,
    nodes: &mut [Node],
    what: &str,
) -> (i64, i64) {
    assert_eq!(
        event_cursor, change_cursor,
        "{what}: both subscriptions saw every event (no filter)"
    );
    let missed = table_after(s, event_cursor).await;
    let last = missed.last().map_or(event_cursor, |e| e.id.0);
    let mut client = connect(s).await;
    client
        .subscribe("e", EVENTS, json!({ "after": cursor(event_cursor) }))
        .await
        .expect("resubscribing");
    client
        .subscribe("n", NODE_CHANGES, json!({ "after": cursor(change_cursor) }))
        .await
        .expect("resubscribing");
    let got = events_through(&mut client, "e", last).await;
    assert_same_events(&got, &missed, what);
    let changes = changes_through(&mut client, "n", last).await;
    assert!(
        changes.iter().all(|c| c["kind"] == json!("CHANGE")),
        "{what}: with a cursor, no snapshot"
    );
    let change_ids: Vec<i64> = changes.iter().map(|c| seq(&c["cursor"])).collect();
    assert_eq!(
        change_ids,
        ids(&missed),
        "{what}: the missed node changes, exactly"
    );

    // Nothing else was queued: the next change is the next message on both.
    apply(s, &mut nodes[0], Change::Label).await;
    let marker = table_after(s, last).await;
    assert_eq!(marker.len(), 1, "{what}: one label change, one event");
    let next = client
        .next_data("e", "events", WAIT)
        .await
        .expect("the marker event");
    assert_eq!(
        seq(&next["id"]),
        marker[0].id.0,
        "{what}: the next event is the new one"
    );
    let next = client
        .next_data("n", "nodeChanges", WAIT)
        .await
        .expect("the marker change");
    assert_change(&next, &nodes[0], Change::Label);
    client.close().await;
    (marker[0].id.0, marker[0].id.0)
}

// ---------------------------------------------------------------------------------------
// 4. Two replicas on one PostgreSQL

/// A subscriber on replica A sees the changes made through replica B (and the other way
/// round): B's commits reach A's feed through `NOTIFY` (or, failing that, its poll).
#[tokio::test]
async fn a_subscriber_on_one_replica_sees_changes_made_through_another() {
    if !Backend::selected().contains(&Backend::Postgres) {
        return;
    }
    let a = TestServer::start(Backend::Postgres)
        .await
        .expect("starting replica A");
    let b = a
        .replica()
        .await
        .expect("starting replica B on A's database");
    assert_eq!(a.database_url(), b.database_url());
    assert_ne!(a.url(), b.url());
    let mut nodes = fleet(&a, 3).await;

    for (name, watcher, writer) in [
        ("A watches, B writes", &a, &b),
        ("B watches, A writes", &b, &a),
    ] {
        let start = head(watcher).await;
        let mut client = connect(watcher).await;
        client
            .subscribe("e", EVENTS, json!({ "after": cursor(start) }))
            .await
            .expect("subscribing");
        client
            .subscribe("n", NODE_CHANGES, json!({}))
            .await
            .expect("subscribing");
        let (snap, _) = snapshot(&mut client, "n", nodes.len()).await;
        assert_eq!(snap, set_of(&nodes.iter().collect::<Vec<_>>()), "{name}");
        let mut made = Vec::new();
        for node in nodes.iter_mut() {
            made.push(bump(writer, node).await);
        }
        let table = table_after(watcher, start).await;
        let last = table.last().map_or(start, |e| e.id.0);
        let got = events_through(&mut client, "e", last).await;
        assert_same_events(&got, &table, name);
        for (node, change) in nodes.iter().zip(made) {
            let item = client
                .next_data("n", "nodeChanges", WAIT)
                .await
                .expect("a node change");
            assert_change(&item, node, change);
        }
        client.close().await;
    }
    b.stop().await;
    a.stop().await;
}

// ---------------------------------------------------------------------------------------
// 5. A slow consumer

/// Events appended to the table in one transaction at a time.
const CHUNK: usize = 1000;
/// Padding in each filler event, so each message is large and few fit in socket buffers.
const PAD_BYTES: usize = 1024;
/// The slow client's socket receive buffer.
const SLOW_RCVBUF: u32 = 16 * 1024;
/// What the server buffers per WebSocket besides the kernel (axum's write buffer, 128 KiB)
/// plus slack.
const SERVER_WS_BUFFER: usize = 256 * 1024;

/// The most bytes the kernel can hold for one loopback connection the reader stopped
/// reading: the sender's largest send buffer plus the reader's receive buffer.
fn socket_buffer_bound() -> usize {
    let wmem_max = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(2)
                .and_then(|v| v.parse::<usize>().ok())
        })
        .unwrap_or(4 * 1024 * 1024);
    wmem_max + 2 * SLOW_RCVBUF as usize
}

/// One transaction of `CHUNK` filler events (not about a node), then the feed is woken by
/// the commit. They carry a real type (`tenant.created`): the log holds only the types the
/// control plane writes, and a row of any other type is read as corrupt.
async fn append_chunk(s: &TestServer, chunk: usize) {
    let pad = "x".repeat(PAD_BYTES);
    let batch: Vec<(EventType, Value)> = (0..CHUNK)
        .map(|i| {
            (
                EventType::TenantCreated,
                json!({ "chunk": chunk, "i": i, "pad": pad }),
            )
        })
        .collect();
    s.server
        .services
        .append_events_for_tests(&batch)
        .await
        .unwrap_or_else(|err| panic!("appending events: {}", err.message()));
}

/// A subscriber that stops reading falls more than `FEED_BUFFER` events behind while a
/// fast one on another connection receives every event; when the slow one reads again it
/// gets what was buffered for it, then `RESUME_REQUIRED` with its cursor, and resubscribing
/// from that cursor yields the rest: nothing lost, nothing twice. Both with a cursor (each
/// subscriber follows the feed itself) and without (both share one hub, which holds as many
/// payloads for a slow subscriber as the feed holds events).
#[tokio::test]
async fn a_slow_subscriber_is_told_to_resume_and_loses_nothing() {
    // The slow client reads nothing, and so answers no ping, until the fast one has had
    // every chunk: on a loaded machine that outlasted the keep-alive (ping after 30 s, pong
    // within 20) and the write timeout derived from it (a send to a full socket may block
    // for the ping interval plus the pong timeout), and the server closed the slow client
    // as dead. Both have tests of their own; this one is about a client that is slow, not
    // gone.
    each_backend_with(
        |config| config.api.ws_ping_interval_secs = 3_600,
        async |s| {
            slow_and_fast(s, true).await;
            slow_and_fast(s, false).await;
        },
    )
    .await;
}

/// One case of [`a_slow_subscriber_is_told_to_resume_and_loses_nothing`]: both subscribe
/// from the head (`from_cursor`) or from now (without a cursor: through a hub).
async fn slow_and_fast(s: &TestServer, from_cursor: bool) {
    let head_before = head(s).await;
    let variables = if from_cursor {
        json!({ "after": cursor(head_before) })
    } else {
        json!({})
    };
    let mut slow_options = ConnectOptions::bearer(s.admin_token());
    slow_options.recv_buffer_bytes = Some(SLOW_RCVBUF);
    let mut slow = SubscriptionClient::connect_with(&s.url(), &slow_options)
        .await
        .expect("connecting the slow client");
    slow.subscribe("slow", EVENTS, variables.clone())
        .await
        .expect("subscribing");
    let mut fast = connect(s).await;
    fast.subscribe("fast", EVENTS, variables)
        .await
        .expect("subscribing");
    if !from_cursor {
        // A subscription from now starts once the server has read it: an event written
        // after both are following is received by both.
        wait_until_live(s, &mut fast, "fast").await;
    }

    // Chunk by chunk, the fast client reads each chunk before the next is written, so it
    // never falls behind; the slow one reads nothing. Enough chunks that, after every
    // buffer between the server and the slow client is full, more than FEED_BUFFER
    // events are left.
    let mut fast_got: Vec<Value> = Vec::new();
    let mut chunks = 0;
    let mut needed = usize::MAX;
    while chunks * CHUNK < needed {
        append_chunk(s, chunks).await;
        chunks += 1;
        let last = head(s).await;
        let got = events_through(&mut fast, "fast", last).await;
        if needed == usize::MAX {
            let smallest = got
                .iter()
                .map(|e| e.to_string().len())
                .min()
                .expect("a chunk of events");
            needed = FEED_BUFFER + (socket_buffer_bound() + SERVER_WS_BUFFER) / smallest + CHUNK;
        }
        fast_got.extend(got);
    }
    // Without a cursor, each started after the last event before its first.
    let start = if from_cursor {
        head_before
    } else {
        seq(&fast_got[0]["id"]) - 1
    };
    let table = table_after(s, start).await;
    assert!(
        table.len() > FEED_BUFFER + CHUNK,
        "{} events written",
        table.len()
    );
    assert_same_events(&fast_got, &table, "the fast client");

    // The slow client reads: buffered events, then RESUME_REQUIRED with its cursor.
    let mut slow_got: Vec<Value> = Vec::new();
    let resume_at = loop {
        let message = slow
            .next("slow", WAIT)
            .await
            .expect("the slow client's next message");
        if let Some(data) = message.data() {
            slow_got.push(data["events"].clone());
            continue;
        }
        assert_eq!(
            message.error_code(),
            Some("RESUME_REQUIRED"),
            "the slow client is told to resume: {message:?}"
        );
        let error = message.first_error().expect("an error");
        let at = seq(&error["extensions"]["cursor"]);
        let delivered = slow_got.last().map_or(start, |e| seq(&e["id"]));
        assert_eq!(at, delivered, "the cursor is the last event delivered");
        break at;
    };
    assert!(slow_got.len() < table.len(), "the slow client fell behind");
    assert_eq!(
        slow.next("slow", WAIT)
            .await
            .expect("the end of the subscription"),
        SubMessage::Complete
    );

    // Resubscribing from the cursor yields the rest.
    slow.subscribe("again", EVENTS, json!({ "after": cursor(resume_at) }))
        .await
        .expect("resubscribing");
    let last = table.last().map_or(start, |e| e.id.0);
    slow_got.extend(events_through(&mut slow, "again", last).await);
    let slow_start = seq(&slow_got[0]["id"]) - 1;
    assert_same_events(
        &slow_got,
        &table_after(s, slow_start).await,
        "the slow client, before and after resuming",
    );
    slow.close().await;
    fast.close().await;
}

/// Waits until subscription `id` (from now) of `client` follows the feed: writes marker
/// events until one arrives, and reads every event up to it.
async fn wait_until_live(s: &TestServer, client: &mut SubscriptionClient, id: &str) {
    // Each try waits half a second for its marker: as long as [`WAIT`] in all. A marker is
    // one small event: a try that timed out while the fan-out ran late (its socket loops
    // yield most of a contended core to the rest, `subscription_runtime`) adds little to
    // deliver.
    for _ in 0..60 {
        s.server
            .services
            .append_events_for_tests(&[(EventType::TenantCreated, json!({ "marker": true }))])
            .await
            .unwrap_or_else(|err| panic!("appending a marker: {}", err.message()));
        let marker = head(s).await;
        if let Ok(Some(event)) = tokio::time::timeout(
            Duration::from_millis(500),
            client.next_data(id, "events", WAIT),
        )
        .await
        .map(|e| e.ok())
        {
            let mut newest = seq(&event["id"]);
            while newest < marker {
                newest = seq(&client
                    .next_data(id, "events", WAIT)
                    .await
                    .expect("the marker")["id"]);
            }
            return;
        }
    }
    panic!("subscription {id} did not start following the feed within {WAIT:?}");
}

/// Subscribers of one shape (document, variables but the cursor, role and tenant) share one
/// hub, which sends each of them every event; another role gets a hub of its own; a
/// subscription from a cursor the hub has passed replays on its own; the hub ends when its
/// last subscriber leaves. A client that completes one subscription is told so and the
/// others go on; one that reuses a running subscription's id is closed with 4409.
#[tokio::test]
async fn subscribers_of_one_shape_share_one_hub() {
    each_backend(async |s| {
        let hubs = &s.server.subscription_hubs;
        let mut nodes = fleet(s, 2).await;
        let mut admins = Vec::new();
        for _ in 0..3 {
            let mut client = connect(s).await;
            client
                .subscribe("e", EVENTS, json!({}))
                .await
                .expect("subscribing");
            wait_until_live(s, &mut client, "e").await;
            admins.push(client);
        }
        assert_eq!(hubs.len(), 1, "one hub for three admins");
        let viewer_token = s.mint("watcher", Role::Viewer, None, ChronoDuration::hours(1));
        let mut viewer = SubscriptionClient::connect(&s.url(), &viewer_token)
            .await
            .expect("a viewer connects");
        viewer
            .subscribe("e", EVENTS, json!({}))
            .await
            .expect("subscribing");
        wait_until_live(s, &mut viewer, "e").await;
        assert_eq!(hubs.len(), 2, "a viewer's subscription is another shape");
        // A last marker every subscriber is sent: each reads up to it, so what follows is
        // the changes below.
        append_chunk(s, usize::MAX).await;
        let from_cursor = head(s).await;
        for client in admins.iter_mut() {
            events_through(client, "e", from_cursor).await;
        }
        events_through(&mut viewer, "e", from_cursor).await;
        assert_eq!(hubs.subscribers(), 4);
        // From a cursor the hub has not passed: it joins the hub. From one it has passed: it
        // needs a replay, and runs on its own.
        viewer
            .subscribe("c", EVENTS, json!({ "after": cursor(from_cursor) }))
            .await
            .expect("subscribing");
        viewer
            .subscribe("old", EVENTS, json!({ "after": cursor(from_cursor - 1) }))
            .await
            .expect("subscribing");
        let replayed = viewer
            .next_data("old", "events", WAIT)
            .await
            .expect("the replay");
        assert_eq!(
            seq(&replayed["id"]),
            from_cursor,
            "the replay starts after its cursor"
        );
        assert_eq!(hubs.len(), 2, "the same shapes");
        assert_eq!(
            hubs.subscribers(),
            5,
            "the viewer's `c` joined its hub, `old` did not"
        );

        // Every subscriber receives every change, in order, with the same payload.
        for node in &mut nodes {
            bump(s, node).await;
        }
        let table = table_after(s, from_cursor).await;
        let last = table.last().expect("the changes").id.0;
        let mut payloads = Vec::new();
        for client in admins.iter_mut() {
            let got = events_through(client, "e", last).await;
            assert_same_events(&got, &table, "an admin");
            payloads.push(got);
        }
        assert!(
            payloads.windows(2).all(|p| p[0] == p[1]),
            "one payload for all"
        );
        assert_same_events(
            &events_through(&mut viewer, "e", last).await,
            &table,
            "the viewer",
        );
        assert_same_events(
            &events_through(&mut viewer, "c", last).await,
            &table,
            "from the cursor",
        );
        assert_same_events(
            &events_through(&mut viewer, "old", last).await,
            &table,
            "from an older cursor",
        );

        // One admin completes: it is told so; the hub goes on for the others.
        admins[0].complete("e").await.expect("completing");
        assert_eq!(
            admins[0].next("e", WAIT).await.expect("the end"),
            SubMessage::Complete
        );
        bump(s, &mut nodes[0]).await;
        let newest = head(s).await;
        for client in admins.iter_mut().skip(1) {
            events_through(client, "e", newest).await;
        }

        // An id reused while its subscription runs closes the socket (4409, as
        // graphql-transport-ws says), and the socket's hub subscription ends with it.
        admins[1]
            .subscribe(
                "e",
                "subscription { events(last: 0) { id type nodeId axis from to actor cause data at } }",
                json!({}),
            )
            .await
            .expect("resubscribing");
        let deadline = tokio::time::Instant::now() + WAIT;
        while admins[1].closed().is_none() && tokio::time::Instant::now() < deadline {
            if admins[1].next_any(WAIT).await.is_err() {
                break;
            }
        }
        assert_eq!(admins[1].closed().map(|(code, _)| *code), Some(4409));
        // Left on hubs: one admin, and the viewer's `e` and `c`.
        while hubs.subscribers() != 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} subscribers left on hubs",
                hubs.subscribers()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // Once every subscriber of a shape has left, its hub ends.
        for client in admins {
            client.close().await;
        }
        viewer.close().await;
        let deadline = tokio::time::Instant::now() + WAIT;
        while !hubs.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} hubs left",
                hubs.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// 6. Auth

/// `connection_init` without a token, with a malformed one, one signed with another
/// secret, one for another audience, or an expired one: the server closes the connection
/// instead of acknowledging it.
#[tokio::test]
async fn connection_init_without_a_valid_token_is_refused() {
    each_backend(async |s| {
        let forged = TokenKeys::new(b"another-secret-another-secret-0123456789", "better-compute")
            .and_then(|keys| keys.mint("mallory", &[Role::Admin], None, ChronoDuration::hours(1), Utc::now()))
            .expect("minting");
        let cases = [
            ("no payload", Value::Null),
            ("no token", json!({})),
            ("not a bearer token", json!({ "Authorization": "Basic YWRtaW46YWRtaW4=" })),
            ("malformed", json!({ "Authorization": "Bearer not-a-jwt" })),
            ("another secret", json!({ "Authorization": format!("Bearer {forged}") })),
            (
                "another audience",
                json!({ "Authorization": format!("Bearer {}", s.mint_for_audience("eve", Role::Admin, "elsewhere", ChronoDuration::hours(1))) }),
            ),
            (
                "expired",
                json!({ "Authorization": format!("Bearer {}", s.mint("late", Role::Admin, None, ChronoDuration::minutes(-5))) }),
            ),
        ];
        for (name, payload) in cases {
            match SubscriptionClient::connect_with(&s.url(), &ConnectOptions::with_payload(payload)).await {
                Err(ConnectError::Refused { code, reason }) => {
                    assert_ne!(code, 1000, "{name}: refused with an error code");
                    assert!(!reason.is_empty(), "{name}: the close frame says why");
                }
                Err(ConnectError::Other(err)) => panic!("{name}: expected a refusal, got {err:#}"),
                Ok(_) => panic!("{name}: a connection was acknowledged"),
            }
        }
        // The right token works on the same endpoint.
        let client = connect(s).await;
        client.close().await;
    })
    .await;
}

/// A tenant-scoped token's `nodeChanges` and `events` carry only its tenant's nodes: the
/// snapshot lists exactly them, and changes to other tenants' and platform nodes are not
/// sent (the next item is the tenant's own next change).
#[tokio::test]
async fn a_tenant_token_sees_only_its_tenants_node_changes() {
    each_backend(async |s| {
        let mut tenants = Vec::new();
        for name in ["acme", "globex"] {
            let tenant = s.admin("mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }", json!({ "name": name })).await["createTenant"]["tenant"]["id"]
                .as_str()
                .expect("a tenant id")
                .to_owned();
            let site = s
                .admin(
                    "mutation($name: String!, $owner: ID!) { createSite(input: {name: $name, kind: CUSTOM, ownerTenantId: $owner}) { site { id } } }",
                    json!({ "name": format!("{name}-dc"), "owner": tenant }),
                )
                .await["createSite"]["site"]["id"]
                .as_str()
                .expect("a site id")
                .to_owned();
            let pool = pool_on(s, &site, "own").await;
            let nodes = enroll(s, &site, &pool, 2).await;
            tenants.push((tenant, nodes));
        }
        let mut platform = fleet(s, 1).await;
        let (acme, mut acme_nodes) = tenants.remove(0);
        let (_, mut globex_nodes) = tenants.remove(0);

        let tenant_id = TenantId::parse(&acme).expect("a tenant id");
        let token = s.mint("viewer@acme", Role::Viewer, Some(&tenant_id), ChronoDuration::hours(1));
        let start = head(s).await;
        let mut client = SubscriptionClient::connect(&s.url(), &token).await.expect("a tenant token connects");
        client.subscribe("n", NODE_CHANGES, json!({})).await.expect("subscribing");
        client.subscribe("e", EVENTS, json!({ "after": cursor(start) })).await.expect("subscribing");
        let (snap, _) = snapshot(&mut client, "n", 2).await;
        assert_eq!(snap, set_of(&acme_nodes.iter().collect::<Vec<_>>()), "the snapshot lists exactly the tenant's nodes");

        // Others' nodes change first, then the tenant's own.
        apply(s, &mut globex_nodes[0], Change::Cordon).await;
        apply(s, &mut platform[0], Change::Label).await;
        apply(s, &mut acme_nodes[1], Change::Cordon).await;
        let item = client.next_data("n", "nodeChanges", WAIT).await.expect("the tenant's change");
        assert_change(&item, &acme_nodes[1], Change::Cordon);
        assert_eq!(item["node"]["ownerTenantId"], json!(acme));
        let event = client.next_data("e", "events", WAIT).await.expect("the tenant's event");
        assert_eq!(event["nodeId"], json!(acme_nodes[1].id), "only the tenant's events: {event:#}");
        assert_eq!(event["type"], json!("node.cordoned"));
        client.close().await;
    })
    .await;
}

/// A subscription whose token expires ends with `UNAUTHENTICATED` (then `complete`).
#[tokio::test]
async fn a_subscription_ends_with_unauthenticated_when_its_token_expires() {
    each_backend(async |s| {
        let token = s.mint(
            "short-lived",
            Role::Viewer,
            None,
            ChronoDuration::seconds(3),
        );
        let mut client = SubscriptionClient::connect(&s.url(), &token)
            .await
            .expect("a fresh token connects");
        client
            .subscribe("e", EVENTS, json!({}))
            .await
            .expect("subscribing");
        client
            .subscribe("n", NODE_CHANGES, json!({}))
            .await
            .expect("subscribing");
        for id in ["e", "n"] {
            let message = loop {
                let message = client
                    .next(id, WAIT)
                    .await
                    .expect("a message before the token's end");
                if message.data().is_none() {
                    break message;
                }
            };
            assert_eq!(
                message.error_code(),
                Some("UNAUTHENTICATED"),
                "{id}: {message:?}"
            );
            assert_eq!(
                client.next(id, WAIT).await.expect("the end"),
                SubMessage::Complete,
                "{id}"
            );
        }
        client.close().await;
    })
    .await;
}

/// A server that stops ends its subscriptions and closes their sockets, so clients notice at
/// once and resume elsewhere, instead of hanging on a dead feed.
#[tokio::test]
async fn stopping_the_server_ends_its_subscriptions() {
    for backend in Backend::selected() {
        let s = TestServer::start(backend).await.expect("a test server");
        let mut client = connect(&s).await;
        client
            .subscribe("e", "subscription { events { id } }", json!({}))
            .await
            .expect("subscribed");
        let restarted = s.restart().await.expect("a restart");
        // The old server is gone: the client sees its operation end or its socket close,
        // never a silent wait.
        let outcome = client.next("e", Duration::from_secs(10)).await;
        match outcome {
            Ok(SubMessage::Complete) => {}
            Err(_) => assert!(
                client.closed().is_some(),
                "nothing arrived and the socket is still open: {outcome:?}"
            ),
            Ok(other) => panic!("expected the subscription to end, got {other:?}"),
        }
        restarted.stop().await;
    }
}
