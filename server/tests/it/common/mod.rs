//! Helpers shared by the node API tests: fixtures written straight to storage, the fields a
//! test reads back, and the spelling of domain enums on the wire.

#![allow(dead_code)]

use bc_core::axes::{Adapter, ProvisionState, Role as NodeRole, Trust};
use bc_core::clock::Clock;
use bc_core::ids::{PoolId, SiteId};
use bc_core::node::{NewNode, NodeRecord};
use bc_testing::{Gql, TestServer};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Every field of a node the tests look at, its history included.
pub const NODE_FIELDS: &str = "
fragment NodeFields on NodeDetail {
  id hostname siteId poolId ownerTenantId role trust version identityGeneration
  provisionState failedFrom maintenance maintenanceReason
  cordoned cordon { reason by at } drain { startedAt deadline }
  noScheduleReasons
  noScheduleReasonDetails { reason setBy since detail clearedBy }
  labels { key value }
  taints { key value effect addedBy }
  schedulability { schedulable bucket failingChecks { check bucket } reasons { reason setBy clearedBy } }
  events(first: 50) { nodes { id type axis from to actor cause data } }
}";

/// The server's clock (the harness's `ManualClock`).
pub fn now(s: &TestServer) -> DateTime<Utc> {
    s.clock.now()
}

/// A platform site with a `metal-host` pool, created through the API.
pub async fn site_and_pool(s: &TestServer) -> (SiteId, PoolId) {
    let (site, pool) = s.site_and_pool(8).await;
    (
        SiteId::parse(&site).expect("the API returns a site id"),
        PoolId::parse(&pool).expect("the API returns a pool id"),
    )
}

/// A platform host node in `state` (not yet written), in `site`/`pool`.
pub fn node_record(
    s: &TestServer,
    (site, pool): &(SiteId, PoolId),
    state: ProvisionState,
) -> NodeRecord {
    NodeRecord::new(
        NewNode {
            hostname: format!("gpu-{}.dc1.example.com", uuid::Uuid::new_v4().simple()),
            site_id: site.clone(),
            pool_id: Some(pool.clone()),
            owner_tenant_id: None,
            role: NodeRole::Host,
            trust: Trust::Platform,
            adapter: Adapter::BcdV1,
            drivers: BTreeMap::new(),
            provision_state: state,
        },
        now(s),
    )
    .expect("a valid node")
}

/// The wire spelling of a domain enum value (`finish-deploy` → `FINISH_DEPLOY`).
pub fn gql_enum(domain: impl AsRef<str>) -> String {
    domain.as_ref().replace('-', "_").to_uppercase()
}

/// `node(id)` as the test admin, with [`NODE_FIELDS`].
pub async fn fetch_node(s: &TestServer, id: &str) -> Gql {
    s.gql(
        Some(s.admin_token()),
        &format!("query($id: ID!) {{ node(id: $id) {{ ...NodeFields }} }} {NODE_FIELDS}"),
        json!({ "id": id }),
    )
    .await
}

/// `node(id)` as the test admin, panicking on errors.
pub async fn node(s: &TestServer, id: &str) -> Value {
    fetch_node(s, id).await.data()["node"].clone()
}

/// A node's events as the API lists them, oldest first.
pub fn events(node: &Value) -> Vec<Value> {
    let mut events = node["events"]["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    events.reverse();
    events
}

/// `(type, axis, from, to)` of each event, oldest first.
pub fn event_summary(node: &Value) -> Vec<(String, String, Option<String>, Option<String>)> {
    events(node)
        .iter()
        .map(|e| {
            let text = |v: &Value| v.as_str().map(str::to_owned);
            (
                e["type"].as_str().unwrap_or_default().to_owned(),
                e["axis"].as_str().unwrap_or_default().to_owned(),
                text(&e["from"]),
                text(&e["to"]),
            )
        })
        .collect()
}

/// The `extensions` of the first error.
pub fn extensions(response: &Gql) -> &Value {
    &response.error()["extensions"]
}

/// A site and a `metal-host` pool whose drivers bind `power` to `driver`.
pub async fn metal_pool(s: &TestServer, driver: &str) -> (String, String) {
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
            "mutation($site: ID!, $driver: String!) { createPool(input: {siteId: $site, name: \"metal\", kind: METAL_HOST, drivers: [{key: \"power\", value: $driver}]}) { pool { id } } }",
            json!({ "site": site, "driver": driver }),
        )
        .await["createPool"]["pool"]["id"]
        .as_str()
        .expect("pool id")
        .to_owned();
    (site, pool)
}

/// Runs `step` (a controller tick and a read of the node, say) until `done` holds for what it
/// returns, pausing `pause` between tries, and returns that value. The test fails with the
/// last value once `limit` of real time has passed: the controllers under test talk to a
/// BMC or an emulator, which answer in real time.
pub async fn poll_until(
    limit: std::time::Duration,
    pause: std::time::Duration,
    mut step: impl AsyncFnMut() -> Value,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let started = std::time::Instant::now();
    loop {
        let value = step().await;
        if done(&value) {
            return value;
        }
        assert!(
            started.elapsed() < limit,
            "not reached within {limit:?}: {value:#}"
        );
        tokio::time::sleep(pause).await;
    }
}
