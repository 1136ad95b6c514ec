//! Placement: reservations book free atoms of schedulable nodes, gangs all or nothing, the
//! placer's policies, trust rules, drains that finish, evictions, expiry, and the database's
//! guard against double booking; on SQLite and PostgreSQL. Its fixtures and calls serve
//! `placement_races` too.

use bc_core::axes::{ProvisionState, Trust};
use bc_core::health::Device;
use bc_core::ids::{NodeId, PoolId, SiteId, TenantId};
use bc_core::node::NodeRecord;
use bc_testing::subscription::SubscriptionClient;
use bc_testing::{Gql, TestServer, each_backend};
use better_compute::auth::Role;
use better_compute::controllers::{DrainController, PlacementController};
use chrono::Duration;
use serde_json::{Value, json};
use std::time::Duration as StdDuration;

use crate::common::{node_record, now};

/// The GPU model the fixtures' devices report.
pub(crate) const H100: &str = "NVIDIA H100 80GB HBM3";
/// How long a test waits for the event-driven retry loop to place a reservation.
const RETRY_WAIT: StdDuration = StdDuration::from_secs(20);

pub(crate) const RESERVATION: &str = "
fragment R on Reservation {
  id tenantId poolId state reason version gpusPerNode nodeCount policy tolerations
  allocations { id nodeId atoms gpus active releaseReason }
}";

/// A platform pool offered to a fresh tenant, and an operator token of that tenant.
pub(crate) struct Setup {
    pub(crate) site: SiteId,
    pub(crate) pool: PoolId,
    pub(crate) tenant: TenantId,
    pub(crate) token: String,
}

pub(crate) async fn setup(s: &TestServer) -> Setup {
    let (site, pool) = crate::common::site_and_pool(s).await;
    let tenant = s
        .tenant(&format!("t-{}", uuid::Uuid::new_v4().simple()))
        .await;
    s.offer_pool(pool.as_str(), &tenant).await;
    let tenant = TenantId::parse(&tenant).expect("a tenant id");
    let token = s.mint(
        "tenant-ops",
        Role::Operator,
        Some(&tenant),
        Duration::hours(4),
    );
    Setup {
        site,
        pool,
        tenant,
        token,
    }
}

/// A node that passes every check, with `gpus` healthy GPUs, written straight to storage.
fn schedulable(s: &TestServer, setup: &Setup) -> NodeRecord {
    let mut node = node_record(
        s,
        &(setup.site.clone(), setup.pool.clone()),
        ProvisionState::Adopted,
    );
    node.observed_generation = 1;
    node.connectivity = bc_core::axes::Connectivity::Connected;
    node
}

async fn insert_with_gpus(s: &TestServer, nodes: &[NodeRecord], gpus: usize) -> Vec<NodeId> {
    s.insert_nodes(nodes).await;
    let devices: Vec<(NodeId, Vec<Device>)> = nodes
        .iter()
        .map(|node| {
            let list = (0..gpus)
                .map(|i| Device {
                    name: format!("gpu{i}"),
                    uuid: format!("GPU-{}-{i}", node.id),
                    pci_bus_id: format!("0000:{:02x}:00.0", i + 1),
                    model: H100.to_owned(),
                    memory_mib: 81_559,
                    serial: None,
                    atom: format!("gpu{i}/whole"),
                    healthy: true,
                })
                .collect();
            (node.id.clone(), list)
        })
        .collect();
    s.replace_devices(&devices).await;
    nodes.iter().map(|n| n.id.clone()).collect()
}

pub(crate) async fn schedulable_nodes(
    s: &TestServer,
    setup: &Setup,
    count: usize,
    gpus: usize,
) -> Vec<NodeId> {
    let nodes: Vec<NodeRecord> = (0..count).map(|_| schedulable(s, setup)).collect();
    insert_with_gpus(s, &nodes, gpus).await
}

pub(crate) async fn reserve(s: &TestServer, token: &str, input: Value) -> Gql {
    s.gql(
        Some(token),
        &format!(
            "mutation($input: CreateReservationInput!) {{ createReservation(input: $input) {{ reservation {{ ...R }} }} }} {RESERVATION}"
        ),
        json!({ "input": input }),
    )
    .await
}

async fn reserved(s: &TestServer, setup: &Setup, input: Value) -> Value {
    let mut input = input;
    input["poolId"] = json!(setup.pool.to_string());
    reserve(s, &setup.token, input).await.data()["createReservation"]["reservation"].clone()
}

pub(crate) async fn fetch(s: &TestServer, token: &str, id: &str) -> Value {
    s.gql(
        Some(token),
        &format!("query($id: ID!) {{ reservation(id: $id) {{ ...R }} }} {RESERVATION}"),
        json!({ "id": id }),
    )
    .await
    .data()["reservation"]
        .clone()
}

pub(crate) async fn release(s: &TestServer, token: &str, id: &str, version: i64) -> Gql {
    s.gql(
        Some(token),
        &format!(
            "mutation($id: ID!, $v: Int!) {{ releaseReservation(input: {{id: $id, version: $v}}) {{ reservation {{ ...R }} }} }} {RESERVATION}"
        ),
        json!({ "id": id, "v": version }),
    )
    .await
}

/// Waits until the reservation is in `state` (the retry loop works in the background).
async fn wait_for_state(s: &TestServer, token: &str, id: &str, state: &str) -> Value {
    let deadline = tokio::time::Instant::now() + RETRY_WAIT;
    loop {
        let r = fetch(s, token, id).await;
        if r["state"] == state {
            return r;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "reservation never became {state}: {r:#}"
        );
        tokio::time::sleep(StdDuration::from_millis(50)).await;
    }
}

fn active_nodes(r: &Value) -> Vec<String> {
    let mut nodes: Vec<String> = r["allocations"]
        .as_array()
        .expect("allocations")
        .iter()
        .filter(|a| a["active"] == true)
        .map(|a| a["nodeId"].as_str().expect("node id").to_owned())
        .collect();
    nodes.sort();
    nodes
}

async fn capacity(s: &TestServer, pool: &PoolId) -> Value {
    s.admin(
        "query($p: [ID!]) { capacity(poolIds: $p) { nodes { poolId allocatedGpus freeGpus schedulableByModel { model allocated free } } } }",
        json!({ "p": [pool.to_string()] }),
    )
    .await["capacity"]["nodes"][0]
        .clone()
}

#[tokio::test]
async fn reservations_book_free_atoms_bin_packed_and_release_frees_them() {
    each_backend(async |s| {
        let setup = setup(s).await;
        let nodes = schedulable_nodes(s, &setup, 3, 8).await;

        let first = reserved(s, &setup, json!({ "gpusPerNode": 4 })).await;
        assert_eq!(first["state"], "PLACED", "{first:#}");
        assert_eq!(first["tenantId"], setup.tenant.to_string());
        let first_node = active_nodes(&first);
        assert_eq!(first_node.len(), 1);
        assert_eq!(
            first["allocations"][0]["atoms"],
            json!(["gpu0/whole", "gpu1/whole", "gpu2/whole", "gpu3/whole"])
        );
        // Bin-packing: the next 4 GPUs go to the node that already has 4 booked.
        let second = reserved(s, &setup, json!({ "gpusPerNode": 4 })).await;
        assert_eq!(active_nodes(&second), first_node, "{second:#}");
        assert_eq!(
            second["allocations"][0]["atoms"],
            json!(["gpu4/whole", "gpu5/whole", "gpu6/whole", "gpu7/whole"])
        );
        // Spreading: the emptiest node.
        let spread = reserved(s, &setup, json!({ "gpusPerNode": 2, "policy": "SPREAD" })).await;
        assert_ne!(active_nodes(&spread), first_node);

        let cap = capacity(s, &setup.pool).await;
        assert_eq!(
            (cap["allocatedGpus"].as_i64(), cap["freeGpus"].as_i64()),
            (Some(10), Some(14)),
            "{cap:#}"
        );
        assert_eq!(
            cap["schedulableByModel"],
            json!([{ "model": H100, "allocated": 10, "free": 14 }])
        );

        // The node page lists what is booked on it.
        let on_node = s
            .admin(
                "query($id: ID!) { node(id: $id) { allocations { reservationId gpus } } }",
                json!({ "id": first_node[0] }),
            )
            .await;
        assert_eq!(
            on_node["node"]["allocations"].as_array().map(Vec::len),
            Some(2)
        );

        // Stale version: CONFLICT with the current one; nothing changes.
        let stale = release(s, &setup.token, first["id"].as_str().expect("a string"), 1).await;
        assert_eq!(stale.code(), Some("CONFLICT"), "{stale:?}");
        let released = release(
            s,
            &setup.token,
            first["id"].as_str().expect("a string"),
            first["version"].as_i64().expect("a number"),
        )
        .await;
        let released = &released.data()["releaseReservation"]["reservation"];
        assert_eq!(released["state"], "RELEASED");
        assert_eq!(released["allocations"][0]["active"], false);
        assert_eq!(
            released["allocations"][0]["releaseReason"],
            "reservation released"
        );
        let again = release(
            s,
            &setup.token,
            released["id"].as_str().expect("a string"),
            released["version"].as_i64().expect("a number"),
        )
        .await;
        assert_eq!(again.code(), Some("INVALID_STATE"), "{again:?}");
        assert!(again.message().contains("released"), "{}", again.message());

        // Its atoms are free again: an 8-GPU shape still fits only on an untouched node, and the
        // freed half of the first node takes the next 4.
        let cap = capacity(s, &setup.pool).await;
        assert_eq!(cap["allocatedGpus"].as_i64(), Some(6), "{cap:#}");
        let refill = reserved(s, &setup, json!({ "gpusPerNode": 4 })).await;
        assert_eq!(active_nodes(&refill), first_node);
        assert_eq!(nodes.len(), 3);
    })
    .await;
}

#[tokio::test]
async fn a_gang_is_placed_whole_or_waits_with_an_explanation_until_capacity_frees() {
    each_backend(async |s| {
        let setup = setup(s).await;
        let nodes = schedulable_nodes(s, &setup, 3, 8).await;
        // One node cordoned: a 3-node gang cannot fit, and nothing is booked.
        let cordoned = s
            .admin(
                "mutation($id: ID!) { cordonNode(input: {id: $id, version: 1, reason: \"rack work\"}) { node { version } } }",
                json!({ "id": nodes[2].to_string() }),
            )
            .await;
        let version = cordoned["cordonNode"]["node"]["version"].as_i64().expect("a number");
        let gang = reserved(s, &setup, json!({ "gpusPerNode": 8, "nodeCount": 3 })).await;
        assert_eq!(gang["state"], "PENDING", "{gang:#}");
        assert_eq!(gang["allocations"], json!([]));
        assert_eq!(
            gang["reason"],
            "needs 3 nodes with 8 GPUs free: 2 nodes are free now; 1 node is in maintenance or cordoned"
        );
        let cap = capacity(s, &setup.pool).await;
        assert_eq!(cap["allocatedGpus"].as_i64(), Some(0), "all or nothing: {cap:#}");

        // Uncordoning frees capacity; the retry loop places the gang, on three distinct nodes.
        s.admin(
            "mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }",
            json!({ "id": nodes[2].to_string(), "v": version }),
        )
        .await;
        let placed = wait_for_state(s, &setup.token, gang["id"].as_str().expect("a string"), "PLACED").await;
        let mut expected: Vec<String> = nodes.iter().map(ToString::to_string).collect();
        expected.sort();
        assert_eq!(active_nodes(&placed), expected);
        assert_eq!(placed["reason"], Value::Null);
    })
    .await;
}

/// The largest gang the API accepts books every one of its atoms: 1,024 nodes of 64 GPUs are
/// 65,536 bookings, more parameters than either backend binds to one statement.
#[tokio::test]
async fn the_largest_gang_books_every_atom() {
    use bc_core::placement::{MAX_GPUS_PER_NODE, MAX_NODE_COUNT};
    each_backend(async |s| {
        let setup = setup(s).await;
        let (count, gpus) = (MAX_NODE_COUNT, MAX_GPUS_PER_NODE);
        schedulable_nodes(s, &setup, count as usize, gpus as usize).await;
        let gang = reserve(
            s,
            &setup.token,
            json!({ "poolId": setup.pool.to_string(), "gpusPerNode": gpus, "nodeCount": count }),
        )
        .await
        .data()["createReservation"]["reservation"]["state"]
            .clone();
        assert_eq!(gang, "PLACED");
        let cap = capacity(s, &setup.pool).await;
        assert_eq!(
            (cap["allocatedGpus"].as_u64(), cap["freeGpus"].as_u64()),
            (Some(u64::from(count * gpus)), Some(0)),
            "{cap:#}"
        );
    })
    .await;
}

#[tokio::test]
async fn bad_shapes_foreign_pools_and_repeated_keys_get_typed_errors() {
    each_backend(async |s| {
        let setup = setup(s).await;
        schedulable_nodes(s, &setup, 1, 8).await;
        let pool = setup.pool.to_string();

        let too_big = reserve(s, &setup.token, json!({ "poolId": pool, "gpusPerNode": 16 })).await;
        assert_eq!(too_big.code(), Some("BAD_USER_INPUT"), "{too_big:?}");
        assert!(too_big.message().contains("the largest has 8"), "{}", too_big.message());

        let zero = reserve(s, &setup.token, json!({ "poolId": pool, "gpusPerNode": 0 })).await;
        assert_eq!(zero.code(), Some("BAD_USER_INPUT"));
        assert_eq!(zero.error()["extensions"]["field"], "input.gpusPerNode");

        // A pool that is not offered to the tenant does not exist for it.
        let (_, other_pool) = s.site_and_pool(8).await;
        let foreign = reserve(s, &setup.token, json!({ "poolId": other_pool, "gpusPerNode": 1 })).await;
        assert_eq!(foreign.code(), Some("NOT_FOUND"), "{foreign:?}");

        // A retried create returns the first reservation; a different request with the same
        // key is refused.
        let input = json!({ "poolId": pool, "gpusPerNode": 2, "idempotencyKey": "job-42" });
        let once = reserve(s, &setup.token, input.clone()).await.data()["createReservation"]["reservation"].clone();
        let twice = reserve(s, &setup.token, input).await.data()["createReservation"]["reservation"].clone();
        assert_eq!(once["id"], twice["id"]);
        assert_eq!(active_nodes(&twice).len(), 1, "booked once");
        let different = reserve(
            s,
            &setup.token,
            json!({ "poolId": pool, "gpusPerNode": 3, "idempotencyKey": "job-42" }),
        )
        .await;
        assert_eq!(different.code(), Some("BAD_USER_INPUT"), "{different:?}");

        // Another tenant cannot see, release or reserve for this one.
        let other = TenantId::parse(&s.tenant("intruder").await).expect("valid");
        let intruder = s.mint("intruder", Role::Operator, Some(&other), Duration::hours(1));
        let hidden = s
            .gql(Some(&intruder), "query($id: ID!) { reservation(id: $id) { id } }", json!({ "id": once["id"] }))
            .await;
        assert_eq!(hidden.code(), Some("NOT_FOUND"));
        let theirs = release(s, &intruder, once["id"].as_str().expect("a string"), once["version"].as_i64().expect("a number")).await;
        assert_eq!(theirs.code(), Some("NOT_FOUND"));
        let for_them = reserve(
            s,
            &intruder,
            json!({ "poolId": pool, "gpusPerNode": 1, "tenantId": setup.tenant.to_string() }),
        )
        .await;
        assert_eq!(for_them.code(), Some("FORBIDDEN"));
        // Nothing of the refused requests was stored.
        let list = s
            .gql(Some(&setup.token), "{ reservations { totalCount } }", json!({}))
            .await;
        assert_eq!(list.data()["reservations"]["totalCount"], 1);
    })
    .await;
}

#[tokio::test]
async fn trust_decides_whose_work_a_node_takes_and_which_pools_may_be_offered() {
    each_backend(async |s| {
        let setup = setup(s).await;
        // A node owned by another tenant, in this platform pool: its capacity is not this
        // tenant's (and, not being in its owner's pool, nobody's).
        let owner = TenantId::parse(&s.tenant("owner").await).expect("valid");
        let mut owned = schedulable(s, &setup);
        owned.trust = Trust::TenantOwned;
        owned.owner_tenant_id = Some(owner.clone());
        let mut controlled = schedulable(s, &setup);
        controlled.trust = Trust::TenantControlled;
        insert_with_gpus(s, &[owned, controlled], 8).await;
        let waiting = reserved(s, &setup, json!({ "gpusPerNode": 1 })).await;
        assert_eq!(waiting["state"], "PENDING", "{waiting:#}");
        assert!(
            waiting["reason"].as_str().expect("a string").contains("2 nodes are excluded"),
            "{waiting:#}"
        );

        // The offering validator: a pool holding the owner's tenant-owned node cannot be
        // offered to another tenant.
        let refused = s
            .gql(
                Some(s.admin_token()),
                "mutation($p: ID!, $t: ID!) { offerPool(input: {poolId: $p, tenantId: $t}) { tenantId } }",
                json!({ "p": setup.pool.to_string(), "t": TenantId::parse(&s.tenant("third").await).expect("valid").to_string() }),
            )
            .await;
        assert_eq!(refused.code(), Some("BAD_USER_INPUT"), "{refused:?}");
        assert!(refused.message().contains("tenant-owned"), "{}", refused.message());
    })
    .await;
}

#[tokio::test]
async fn drains_end_when_work_leaves_and_evict_what_is_left_at_the_deadline() {
    each_backend(async |s| {
        s.server.stop_controllers().await;
        let mut drains = DrainController::new(s.server.services.clone());
        let setup = setup(s).await;
        let nodes = schedulable_nodes(s, &setup, 3, 8).await;
        let first = reserved(s, &setup, json!({ "gpusPerNode": 8 })).await;
        let second = reserved(s, &setup, json!({ "gpusPerNode": 8 })).await;
        let busy_a = active_nodes(&first)[0].clone();
        let busy_b = active_nodes(&second)[0].clone();
        let spare = nodes
            .iter()
            .map(ToString::to_string)
            .find(|n| n != &busy_a && n != &busy_b)
            .expect("a spare node");

        // Without a deadline: draining until the work is released.
        s.admin(
            "mutation($id: ID!) { drainNode(input: {id: $id, version: 1, reason: \"bios\"}) { node { version } } }",
            json!({ "id": busy_a }),
        )
        .await;
        assert_eq!(drains.tick().await.expect("a tick").drained, 0, "work still runs");
        release(s, &setup.token, first["id"].as_str().expect("a string"), first["version"].as_i64().expect("a number")).await.data();
        assert_eq!(drains.tick().await.expect("a tick").drained, 1);
        let drained = s
            .admin(
                "query($id: ID!) { node(id: $id) { cordoned noScheduleReasons events(first: 5) { nodes { type data } } } }",
                json!({ "id": busy_a }),
            )
            .await;
        assert_eq!(drained["node"]["cordoned"], true);
        assert_eq!(drained["node"]["noScheduleReasons"], json!([]));
        assert_eq!(drained["node"]["events"]["nodes"][0]["type"], "node.drained");

        // With a deadline: at the deadline the work is evicted and placed elsewhere.
        s.admin(
            "mutation($id: ID!, $at: DateTime!) { drainNode(input: {id: $id, version: 1, reason: \"swap\", deadline: $at}) { node { version } } }",
            json!({ "id": busy_b, "at": (now(s) + Duration::minutes(30)).to_rfc3339() }),
        )
        .await;
        assert_eq!(drains.tick().await.expect("a tick"), Default::default(), "before the deadline");
        s.clock.advance(Duration::minutes(31));
        assert_eq!(drains.tick().await.expect("a tick").finished, 1);
        let moved = wait_for_state(s, &setup.token, second["id"].as_str().expect("a string"), "PLACED").await;
        assert_eq!(active_nodes(&moved), [spare]);
        let evicted: Vec<&Value> = moved["allocations"]
            .as_array()
            .expect("present")
            .iter()
            .filter(|a| a["active"] == false)
            .collect();
        assert_eq!(evicted.len(), 1);
        assert_eq!(evicted[0]["nodeId"], busy_b.as_str());
        assert_eq!(evicted[0]["releaseReason"], "the node's drain deadline passed");
    })
    .await;
}

#[tokio::test]
async fn no_execute_taints_evict_work_that_does_not_tolerate_them() {
    each_backend(async |s| {
        let setup = setup(s).await;
        let nodes = schedulable_nodes(s, &setup, 1, 8).await;
        let tolerant = reserved(s, &setup, json!({ "gpusPerNode": 4, "tolerations": ["burn-in"] })).await;
        let plain = reserved(s, &setup, json!({ "gpusPerNode": 4 })).await;
        assert_eq!((tolerant["state"].as_str(), plain["state"].as_str()), (Some("PLACED"), Some("PLACED")));
        s.admin(
            "mutation($id: ID!) { taintNode(input: {id: $id, version: 1, key: \"burn-in\", value: \"x\", effect: NO_EXECUTE}) { node { version } } }",
            json!({ "id": nodes[0].to_string() }),
        )
        .await;
        let plain = fetch(s, &setup.token, plain["id"].as_str().expect("a string")).await;
        assert_eq!(plain["state"], "PENDING", "{plain:#}");
        assert!(plain["reason"].as_str().expect("a string").contains("NoExecute taint `burn-in`"));
        let tolerant = fetch(s, &setup.token, tolerant["id"].as_str().expect("a string")).await;
        assert_eq!(tolerant["state"], "PLACED", "{tolerant:#}");
        // A tolerating newcomer may still land on the tainted node; the plain one may not.
        let newcomer = reserved(s, &setup, json!({ "gpusPerNode": 2, "tolerations": ["burn-in"] })).await;
        assert_eq!(newcomer["state"], "PLACED");
    })
    .await;
}

#[tokio::test]
async fn reservations_expire_placed_ones_released_pending_ones_failed() {
    each_backend(async |s| {
        s.server.stop_controllers().await;
        let mut placement = PlacementController::new(s.server.services.clone());
        let setup = setup(s).await;
        schedulable_nodes(s, &setup, 1, 8).await;
        let at = (now(s) + Duration::hours(1)).to_rfc3339();
        let placed = reserved(s, &setup, json!({ "gpusPerNode": 8, "expiresAt": at })).await;
        let pending = reserved(s, &setup, json!({ "gpusPerNode": 8, "expiresAt": at })).await;
        assert_eq!((placed["state"].as_str(), pending["state"].as_str()), (Some("PLACED"), Some("PENDING")));
        assert_eq!(placement.tick().await.expect("a tick").expired, 0);
        s.clock.advance(Duration::hours(1));
        assert_eq!(placement.tick().await.expect("a tick").expired, 2);
        let placed = fetch(s, &setup.token, placed["id"].as_str().expect("a string")).await;
        assert_eq!(placed["state"], "RELEASED");
        assert_eq!(placed["reason"], "expired");
        let pending = fetch(s, &setup.token, pending["id"].as_str().expect("a string")).await;
        assert_eq!(pending["state"], "FAILED");
        assert_eq!(pending["reason"], "expired before it could be placed");
        let past = reserve(
            s,
            &setup.token,
            json!({ "poolId": setup.pool.to_string(), "gpusPerNode": 1, "expiresAt": (now(s) - Duration::minutes(1)).to_rfc3339() }),
        )
        .await;
        assert_eq!(past.code(), Some("BAD_USER_INPUT"));
    })
    .await;
}

#[tokio::test]
async fn reservation_updates_follow_a_reservation_from_creation_to_release() {
    each_backend(async |s| {
        let setup = setup(s).await;
        schedulable_nodes(s, &setup, 1, 8).await;
        // The subscription starts after the event head read here, not at whatever head the
        // server reads when it sets the subscription up: that may come after the
        // reservation's first events on a busy machine.
        let head = s.server.services.event_head().await.expect("the event head");
        let mut updates = SubscriptionClient::connect(&s.url(), &setup.token)
            .await
            .expect("a subscription connection");
        updates
            .subscribe(
                "r",
                "subscription($after: ID) { reservationUpdates(after: $after) { type from to nodeId reservation { id state } } }",
                json!({ "after": bc_core::ids::EventId(head).to_string() }),
            )
            .await
            .expect("subscribed");
        let r = reserved(s, &setup, json!({ "gpusPerNode": 8 })).await;
        release(s, &setup.token, r["id"].as_str().expect("a string"), r["version"].as_i64().expect("a number")).await.data();
        let mut seen = Vec::new();
        for _ in 0..5 {
            let u = updates
                .next_data("r", "reservationUpdates", StdDuration::from_secs(10))
                .await
                .expect("an update");
            assert_eq!(u["reservation"]["id"], r["id"]);
            seen.push(u["type"].as_str().expect("a string").to_owned());
        }
        assert_eq!(
            seen,
            [
                "reservation.created",
                "allocation.booked",
                "reservation.placed",
                "allocation.released",
                "reservation.released"
            ]
        );
    })
    .await;
}
