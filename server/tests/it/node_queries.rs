//! The read side of the API over real HTTP, on SQLite and PostgreSQL: the `nodes` connection
//! (paging, `totalCount`, every field of `NodeFilterInput`), `capacity`, a node's `events`,
//! `provisionStateTable`, the catalog's connections (`tenants`, `sites`, `pools`,
//! `joinTokens`), the validation of `createSite` and `createPool`, and the planner
//! statistics that keep PostgreSQL's reads of a grown fleet on their indexes.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::Actor;
use bc_core::axes::{Adapter, ConditionStatus, Connectivity, ProvisionState, Role, Trust};
use bc_core::clock::Clock;
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_core::node::{NewNode, NodeRecord};
use bc_core::provision::{PROVISION_STATE_TABLE, ProvisionMove, Target};
use bc_core::schedule::CapacityBucket;
use bc_testing::{Backend, TestServer, each_backend};

use crate::common::{node_record, site_and_pool};
use bc_entity::node_session;
use better_compute::auth::Role as ApiRole;
use better_compute::service::ChildSets;
use sea_orm::sea_query::Expr;
use sea_orm::{ActiveValue::Set, EntityTrait};
use serde_json::{Value, json};
use strum::IntoEnumIterator;

/// The GraphQL spelling of a kebab-case enum value (`finish-deploy` → `FINISH_DEPLOY`).
fn gql_enum(kebab: &str) -> String {
    kebab.replace('-', "_").to_uppercase()
}

/// The id of what a create mutation answers: `data[field][object]["id"]`.
fn id_of(data: &Value, field: &str, object: &str) -> String {
    data[field][object]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{field} returns an id: {data}"))
        .to_owned()
}

async fn create_tenant(s: &TestServer, name: &str) -> String {
    let data = s
        .admin(
            "mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }",
            json!({ "name": name }),
        )
        .await;
    id_of(&data, "createTenant", "tenant")
}

async fn create_site(s: &TestServer, name: &str, owner: Option<&str>) -> String {
    let kind = if owner.is_some() {
        "CUSTOM"
    } else {
        "PLATFORM"
    };
    let data = s
        .admin(
            "mutation($input: CreateSiteInput!) { createSite(input: $input) { site { id } } }",
            json!({ "input": { "name": name, "kind": kind, "ownerTenantId": owner } }),
        )
        .await;
    id_of(&data, "createSite", "site")
}

async fn create_pool(s: &TestServer, input: Value) -> String {
    let data = s
        .admin(
            "mutation($input: CreatePoolInput!) { createPool(input: $input) { pool { id } } }",
            json!({ "input": input }),
        )
        .await;
    id_of(&data, "createPool", "pool")
}

const FILTERED_COUNT: &str = "query($f: NodeFilterInput) { nodes(filter: $f) { totalCount } }";
const FIRST_ZERO: &str = "{ nodes(first: 0) { pageInfo { hasNextPage } edges { cursor } } }";
const PAGE_COUNT: &str =
    "query($first: Int, $after: String) { nodes(first: $first, after: $after) { totalCount } }";
const CAPACITY: &str = "query($pools: [ID!]) { capacity(poolIds: $pools) { nodes {
    poolId totalNodes totalGpus buckets { bucket nodes gpus }
} } }";
const SCOPE: &str = "{ tenants { nodes { id } } sites { nodes { id } } pools { nodes { id } } }";
const CATALOG: &str =
    "{ tenants { nodes { name } } sites { nodes { name } } pools { nodes { name siteId } } }";
const SITE: &str =
    "mutation($input: CreateSiteInput!) { createSite(input: $input) { site { id } } }";
const POOL: &str =
    "mutation($input: CreatePoolInput!) { createPool(input: $input) { pool { id } } }";

/// The first label of a hostname: the fleet's nodes are named by it.
fn short(hostname: &str) -> String {
    hostname.split('.').next().unwrap_or(hostname).to_owned()
}

/// A small fleet in which every filter field tells nodes apart:
///
/// | node    | site      | pool | role       | trust             | state     | conn.        | other                          | bucket       | GPUs |
/// |---------|-----------|------|------------|-------------------|-----------|--------------|--------------------------------|--------------|------|
/// | alpha   | dc1       | p1   | host       | platform          | adopted   | connected    | labels gpu=h100, rack=r1 (API) | schedulable  | 8    |
/// | bravo   | dc1       | p1   | host       | platform          | deployed  | connected    | cordoned (API), gpu=a100       | maintenance  | 4    |
/// | charlie | dc1       | p1   | host       | platform          | failed    | disconnected | maintenance (failed deploying) | maintenance  | 8    |
/// | echo    | dc1       | p1   | host       | platform          | enrolling | disconnected | generation 0, rack=r2          | provisioning | 0    |
/// | foxtrot | dc1       | p1   | host       | platform          | adopted   | unreachable  | reason unreachable             | unreachable  | 8    |
/// | golf    | dc1       | p1   | host       | platform          | adopted   | connected    | taint gpu-burn (API)           | unhealthy    | 8    |
/// | lima    | dc1       | p1   | site       | platform          | adopted   | connected    |                                | excluded     | 2    |
/// | delta   | dc2       | p2   | dedicated  | platform          | adopted   | connected    | gpu=h100                       | excluded     | 2    |
/// | kilo    | dc2       | p2   | dedicated  | tenant-controlled | adopted   | lost         | reason unreachable             | excluded     | 8    |
/// | hotel   | acme-home | p3   | host       | tenant-owned (A)  | adopted   | connected    | GpuCountMismatch               | unhealthy    | 7    |
/// | india   | acme-home | p3   | host       | tenant-owned (A)  | deployed  | connected    | observedGeneration 2           | schedulable  | 4    |
/// | juliet  | acme-home | —    | unassigned | tenant-owned (A)  | adopting  | connected    | generation 0                   | excluded     | 0    |
/// | mike    | dc1       | p1   | host       | platform          | retired   | connected    | deleted: never listed/counted  | —            | 8    |
///
/// `p4` (dc1) has no nodes.
struct Fleet {
    tenant_a: String,
    dc1: String,
    dc2: String,
    home: String,
    p1: String,
    p2: String,
    p3: String,
    p4: String,
    /// Short name → (pool, bucket, GPUs) of each live node, as the table above says.
    expected: BTreeMap<&'static str, (Option<String>, CapacityBucket, i64)>,
}

impl Fleet {
    async fn create(s: &TestServer) -> Fleet {
        let tenant_a = create_tenant(s, "acme").await;
        create_tenant(s, "globex").await;
        let dc1 = create_site(s, "dc1", None).await;
        let dc2 = create_site(s, "dc2", None).await;
        let home = create_site(s, "acme-home", Some(&tenant_a)).await;
        let p1 = create_pool(
            s,
            json!({ "siteId": dc1, "name": "gpu", "kind": "METAL_HOST", "expectedGpuCount": 8 }),
        )
        .await;
        let p2 = create_pool(
            s,
            json!({ "siteId": dc2, "name": "dedicated", "kind": "METAL_DEDICATED" }),
        )
        .await;
        let p3 = create_pool(
            s,
            json!({ "siteId": home, "name": "own", "kind": "PROVIDER" }),
        )
        .await;
        let p4 = create_pool(
            s,
            json!({ "siteId": dc1, "name": "empty", "kind": "VPS_HOST" }),
        )
        .await;

        let now = s.clock.now();
        let liveness = Actor::Controller("liveness".into());
        let record = |name: &str,
                      site: &str,
                      pool: Option<&str>,
                      role: Role,
                      trust: Trust,
                      state: ProvisionState,
                      gpus: i32| {
            let site_id = SiteId::parse(site).expect("a site id");
            let domain = if site == home {
                "acme"
            } else if site == dc2 {
                "dc2"
            } else {
                "dc1"
            };
            let mut n = NodeRecord::new(
                NewNode {
                    hostname: format!("{name}.{domain}.example.com"),
                    site_id,
                    pool_id: pool.map(|p| PoolId::parse(p).expect("a pool id")),
                    owner_tenant_id: (trust == Trust::TenantOwned)
                        .then(|| TenantId::parse(&tenant_a).expect("a tenant id")),
                    role,
                    trust,
                    adapter: Adapter::BcdV1,
                    drivers: BTreeMap::new(),
                    provision_state: state,
                },
                now,
            )
            .expect("a valid node");
            n.generation = 1;
            n.observed_generation = 1;
            n.connectivity = Connectivity::Connected;
            n.gpu_count = gpus;
            n
        };
        use ProvisionState::*;
        use Role::{Dedicated, Host, Site, Unassigned};
        use Trust::{Platform, TenantControlled, TenantOwned};

        let alpha = record("alpha", &dc1, Some(&p1), Host, Platform, Adopted, 8);
        let bravo = record("bravo", &dc1, Some(&p1), Host, Platform, Deployed, 4);
        let mut charlie = record("charlie", &dc1, Some(&p1), Host, Platform, Deploying, 8);
        charlie
            .apply_move(ProvisionMove::Fail, Some("image checksum mismatch"))
            .expect("deploying can fail");
        charlie.connectivity = Connectivity::Disconnected;
        let mut echo = record("echo", &dc1, Some(&p1), Host, Platform, Enrolling, 0);
        echo.generation = 0;
        echo.observed_generation = 0;
        echo.connectivity = Connectivity::Disconnected;
        echo.update_labels(&BTreeMap::from([("rack".to_owned(), "r2".to_owned())]), &[])
            .expect("valid labels");
        let mut foxtrot = record("foxtrot", &dc1, Some(&p1), Host, Platform, Adopted, 8);
        foxtrot.set_connectivity(Connectivity::Unreachable, &liveness, now);
        let golf = record("golf", &dc1, Some(&p1), Host, Platform, Adopted, 8);
        let lima = record("lima", &dc1, Some(&p1), Site, Platform, Adopted, 2);
        let mut delta = record("delta", &dc2, Some(&p2), Dedicated, Platform, Adopted, 2);
        delta
            .update_labels(
                &BTreeMap::from([("gpu".to_owned(), "h100".to_owned())]),
                &[],
            )
            .expect("valid labels");
        let mut kilo = record(
            "kilo",
            &dc2,
            Some(&p2),
            Dedicated,
            TenantControlled,
            Adopted,
            8,
        );
        kilo.set_connectivity(Connectivity::Lost, &liveness, now);
        let mut hotel = record("hotel", &home, Some(&p3), Host, TenantOwned, Adopted, 7);
        hotel
            .set_condition(
                "GpuCountMismatch",
                ConditionStatus::True,
                "Expected8Got7",
                "7 of 8 GPUs",
                true,
                &Actor::Controller("health".into()),
                now,
            )
            .expect("a valid condition");
        let mut india = record("india", &home, Some(&p3), Host, TenantOwned, Deployed, 4);
        india.generation = 2;
        india.observed_generation = 2;
        let mut juliet = record("juliet", &home, None, Unassigned, TenantOwned, Adopting, 0);
        juliet.generation = 0;
        juliet.observed_generation = 0;
        let mut mike = record("mike", &dc1, Some(&p1), Host, Platform, Retired, 8);
        mike.delete(now).expect("a retired node can be deleted");

        s.insert_nodes(&[
            alpha.clone(),
            bravo.clone(),
            charlie,
            echo,
            foxtrot,
            golf.clone(),
            lima,
            delta,
            kilo.clone(),
            hotel.clone(),
            india,
            juliet,
            mike.clone(),
        ])
        .await;
        // Some state through the API, as an operator makes it.
        let gpu = |value: &str| json!({ "key": "gpu", "value": value });
        let rack = json!({ "key": "rack", "value": "r1" });
        let set = json!({ "set": [gpu("h100"), rack] });
        assert_eq!(mutate(s, "labelNode", alpha.id.as_str(), 1, set).await, 2);
        let v = mutate(
            s,
            "labelNode",
            bravo.id.as_str(),
            1,
            json!({ "set": [gpu("a100")] }),
        )
        .await;
        mutate(
            s,
            "cordonNode",
            bravo.id.as_str(),
            v,
            json!({ "reason": "rack move" }),
        )
        .await;
        let taint = json!({ "key": "gpu-burn", "value": "running" });
        mutate(s, "taintNode", golf.id.as_str(), 1, taint).await;
        // Sessions as gateways leave them: alpha's open on gw-a, bravo's closed there, and the
        // deleted mike's left open there. gw-b died without closing its sessions: Liveness has
        // found kilo lost since, not yet golf or the tenant's hotel.
        let session = |node: &NodeRecord, gateway: &str, open: bool| node_session::ActiveModel {
            node_id: Set(node.id.to_string()),
            epoch: Set(1),
            gateway_id: Set(gateway.to_owned()),
            connected_at: Set(now),
            disconnected_at: Set((!open).then_some(now)),
            last_seen: Set(now),
        };
        node_session::Entity::insert_many([
            session(&alpha, "gw-a", true),
            session(&bravo, "gw-a", false),
            session(&mike, "gw-a", true),
            session(&golf, "gw-b", true),
            session(&kilo, "gw-b", true),
            session(&hotel, "gw-b", true),
        ])
        .exec_without_returning(&s.database().await)
        .await
        .expect("inserting sessions");

        use CapacityBucket as B;
        let (pa, pb, pc) = (Some(p1.clone()), Some(p2.clone()), Some(p3.clone()));
        let expected = BTreeMap::from([
            ("alpha", (pa.clone(), B::Schedulable, 8)),
            ("bravo", (pa.clone(), B::Maintenance, 4)),
            ("charlie", (pa.clone(), B::Maintenance, 8)),
            ("echo", (pa.clone(), B::Provisioning, 0)),
            ("foxtrot", (pa.clone(), B::Unreachable, 8)),
            ("golf", (pa.clone(), B::Unhealthy, 8)),
            ("lima", (pa, B::Excluded, 2)),
            ("delta", (pb.clone(), B::Excluded, 2)),
            ("kilo", (pb, B::Excluded, 8)),
            ("hotel", (pc.clone(), B::Unhealthy, 7)),
            ("india", (pc, B::Schedulable, 4)),
            ("juliet", (None, B::Excluded, 0)),
        ]);
        Fleet {
            tenant_a,
            dc1,
            dc2,
            home,
            p1,
            p2,
            p3,
            p4,
            expected,
        }
    }

    fn all(&self) -> BTreeSet<String> {
        self.expected.keys().map(|k| (*k).to_owned()).collect()
    }
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|n| (*n).to_owned()).collect()
}

/// The short names of the nodes `filter` selects for `token`, checking `totalCount` and
/// that one page held them all.
async fn matching(s: &TestServer, token: &str, filter: &Value) -> BTreeSet<String> {
    let response = s
        .gql(
            Some(token),
            "query($f: NodeFilterInput) { nodes(filter: $f, first: 1000) {
                totalCount pageInfo { hasNextPage } edges { node { hostname } }
            } }",
            json!({ "f": filter }),
        )
        .await;
    let nodes = &response.data()["nodes"];
    assert_eq!(nodes["pageInfo"]["hasNextPage"], json!(false));
    let found: Vec<String> = nodes["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .map(|e| short(e["node"]["hostname"].as_str().expect("a hostname")))
        .collect();
    let set: BTreeSet<String> = found.iter().cloned().collect();
    assert_eq!(set.len(), found.len(), "no node twice for {filter}");
    assert_eq!(
        nodes["totalCount"].as_u64(),
        Some(found.len() as u64),
        "totalCount for {filter}"
    );
    set
}

#[tokio::test]
async fn every_node_filter_field_selects_exactly_the_right_nodes() {
    each_backend(async |s| {
        let f = Fleet::create(s).await;
        let all = f.all();
        let except =
            |out: &[&str]| -> BTreeSet<String> { all.difference(&names(out)).cloned().collect() };
        let dc1_nodes = [
            "alpha", "bravo", "charlie", "echo", "foxtrot", "golf", "lima",
        ];
        let cases: Vec<(Value, BTreeSet<String>)> = vec![
            (json!(null), all.clone()),
            (json!({}), all.clone()),
            // provisionState
            (
                json!({ "provisionState": ["ADOPTED"] }),
                names(&["alpha", "foxtrot", "golf", "lima", "delta", "kilo", "hotel"]),
            ),
            (
                json!({ "provisionState": ["DEPLOYED", "ENROLLING"] }),
                names(&["bravo", "echo", "india"]),
            ),
            (json!({ "provisionState": ["FAILED"] }), names(&["charlie"])),
            (json!({ "provisionState": ["RETIRED"] }), names(&[])),
            // connectivity
            (
                json!({ "connectivity": ["UNREACHABLE", "LOST"] }),
                names(&["foxtrot", "kilo"]),
            ),
            (
                json!({ "connectivity": ["DISCONNECTED"] }),
                names(&["charlie", "echo"]),
            ),
            (
                json!({ "connectivity": ["CONNECTED"] }),
                except(&["charlie", "echo", "foxtrot", "kilo"]),
            ),
            // maintenance, cordoned
            (json!({ "maintenance": true }), names(&["charlie"])),
            (json!({ "maintenance": false }), except(&["charlie"])),
            (json!({ "cordoned": true }), names(&["bravo"])),
            (json!({ "cordoned": false }), except(&["bravo"])),
            // role, trust
            (json!({ "role": ["DEDICATED"] }), names(&["delta", "kilo"])),
            (
                json!({ "role": ["SITE", "UNASSIGNED"] }),
                names(&["lima", "juliet"]),
            ),
            (
                json!({ "role": ["HOST"] }),
                except(&["delta", "kilo", "lima", "juliet"]),
            ),
            (
                json!({ "trust": ["TENANT_OWNED"] }),
                names(&["hotel", "india", "juliet"]),
            ),
            (json!({ "trust": ["TENANT_CONTROLLED"] }), names(&["kilo"])),
            (
                json!({ "trust": ["PLATFORM"] }),
                except(&["hotel", "india", "juliet", "kilo"]),
            ),
            // siteId, poolId
            (json!({ "siteId": [f.dc2] }), names(&["delta", "kilo"])),
            (
                json!({ "siteId": [f.home] }),
                names(&["hotel", "india", "juliet"]),
            ),
            (
                json!({ "siteId": [f.dc1, f.dc2] }),
                except(&["hotel", "india", "juliet"]),
            ),
            (json!({ "siteId": ["site_nosuchsite"] }), names(&[])),
            (json!({ "poolId": [f.p1] }), names(&dc1_nodes)),
            (
                json!({ "poolId": [f.p2, f.p3] }),
                names(&["delta", "kilo", "hotel", "india"]),
            ),
            (json!({ "poolId": [f.p4] }), names(&[])),
            // labels: key only, key=value, several (all must hold)
            (
                json!({ "labels": [{ "key": "gpu" }] }),
                names(&["alpha", "bravo", "delta"]),
            ),
            (
                json!({ "labels": [{ "key": "gpu", "value": "h100" }] }),
                names(&["alpha", "delta"]),
            ),
            (
                json!({ "labels": [{ "key": "gpu", "value": "H100" }] }),
                names(&[]),
            ),
            (
                json!({ "labels": [{ "key": "gpu", "value": "h100" }, { "key": "rack" }] }),
                names(&["alpha"]),
            ),
            (
                json!({ "labels": [{ "key": "rack", "value": "r2" }] }),
                names(&["echo"]),
            ),
            (
                json!({ "labels": [{ "key": "gpu", "value": null }] }),
                names(&["alpha", "bravo", "delta"]),
            ),
            (json!({ "labels": [{ "key": "absent" }] }), names(&[])),
            // reason: any of
            (json!({ "reason": ["taint:gpu-burn"] }), names(&["golf"])),
            (
                json!({ "reason": ["unreachable", "GpuCountMismatch"] }),
                names(&["foxtrot", "kilo", "hotel"]),
            ),
            (json!({ "reason": ["draining"] }), names(&[])),
            // bucket, schedulable
            (
                json!({ "bucket": ["SCHEDULABLE"] }),
                names(&["alpha", "india"]),
            ),
            (
                json!({ "bucket": ["MAINTENANCE", "UNHEALTHY"] }),
                names(&["bravo", "charlie", "golf", "hotel"]),
            ),
            (
                json!({ "bucket": ["EXCLUDED"] }),
                names(&["lima", "delta", "kilo", "juliet"]),
            ),
            (json!({ "bucket": ["PROVISIONING"] }), names(&["echo"])),
            (json!({ "bucket": ["UNREACHABLE"] }), names(&["foxtrot"])),
            (json!({ "schedulable": true }), names(&["alpha", "india"])),
            (json!({ "schedulable": false }), except(&["alpha", "india"])),
            // hostname: a substring; LIKE wildcards are literal
            (json!({ "hostname": "dc2" }), names(&["delta", "kilo"])),
            (
                json!({ "hostname": ".acme." }),
                names(&["hotel", "india", "juliet"]),
            ),
            (
                json!({ "hostname": "alpha.dc1.example.com" }),
                names(&["alpha"]),
            ),
            (json!({ "hostname": "lf.d" }), names(&["golf"])),
            // Case-insensitive (DNS names), on both databases.
            (json!({ "hostname": "ALPHA" }), names(&["alpha"])),
            (
                json!({ "hostname": "Dc2.Example" }),
                names(&["delta", "kilo"]),
            ),
            (json!({ "hostname": "zulu" }), names(&[])),
            (json!({ "hostname": "%" }), names(&[])),
            (json!({ "hostname": "_" }), names(&[])),
            (json!({ "hostname": "a_pha" }), names(&[])),
            (json!({ "hostname": "" }), all.clone()),
            // gatewayId: open sessions only; a dead replica's sessions stay open until the
            // daemon's next session replaces them, so its lost nodes still count there.
            (json!({ "gatewayId": ["gw-a"] }), names(&["alpha"])),
            (
                json!({ "gatewayId": ["gw-b"] }),
                names(&["golf", "kilo", "hotel"]),
            ),
            (
                json!({ "gatewayId": ["gw-b"], "connectivity": ["CONNECTED"] }),
                names(&["golf", "hotel"]),
            ),
            (
                json!({ "gatewayId": ["gw-a", "gw-b"] }),
                names(&["alpha", "golf", "kilo", "hotel"]),
            ),
            (json!({ "gatewayId": ["gw-c"] }), names(&[])),
            (json!({ "gatewayId": ["g".repeat(100)] }), names(&[])),
            (json!({ "gatewayId": [] }), all.clone()),
            // fields combine with "and"
            (
                json!({ "poolId": [f.p1], "schedulable": false, "connectivity": ["CONNECTED"] }),
                names(&["bravo", "golf", "lima"]),
            ),
            (
                json!({ "trust": ["TENANT_OWNED"], "bucket": ["SCHEDULABLE", "EXCLUDED"] }),
                names(&["india", "juliet"]),
            ),
            (
                json!({ "role": ["HOST"], "labels": [{ "key": "gpu" }], "cordoned": false }),
                names(&["alpha"]),
            ),
        ];
        for (filter, want) in &cases {
            assert_eq!(
                &matching(s, s.admin_token(), filter).await,
                want,
                "{:?}: filter {filter}",
                s.backend
            );
        }

        // The API's own explanation agrees with the table (the Rust predicate).
        let data = s
            .admin(
                "{ nodes(first: 100) { edges { node {
                    hostname poolId gpuCount schedulability { bucket }
                } } } }",
                json!({}),
            )
            .await;
        let seen: BTreeMap<String, (Option<String>, String, i64)> = data["nodes"]["edges"]
            .as_array()
            .expect("edges")
            .iter()
            .map(|e| {
                let n = &e["node"];
                (
                    short(n["hostname"].as_str().expect("a hostname")),
                    (
                        n["poolId"].as_str().map(str::to_owned),
                        n["schedulability"]["bucket"]
                            .as_str()
                            .expect("a bucket")
                            .to_owned(),
                        n["gpuCount"].as_i64().expect("a count"),
                    ),
                )
            })
            .collect();
        let want: BTreeMap<String, (Option<String>, String, i64)> = f
            .expected
            .iter()
            .map(|(k, (pool, bucket, gpus))| {
                (
                    (*k).to_owned(),
                    (pool.clone(), gql_enum(bucket.as_ref()), *gpus),
                )
            })
            .collect();
        assert_eq!(seen, want, "{:?}", s.backend);

        // A tenant sees only its own nodes, whatever the filter.
        let tenant = TenantId::parse(&f.tenant_a).expect("a tenant id");
        let token = s.mint(
            "acme-viewer",
            ApiRole::Viewer,
            Some(&tenant),
            chrono::Duration::hours(1),
        );
        assert_eq!(
            matching(s, &token, &json!({})).await,
            names(&["hotel", "india", "juliet"])
        );
        assert_eq!(
            matching(s, &token, &json!({ "schedulable": true })).await,
            names(&["india"])
        );
        assert_eq!(
            matching(s, &token, &json!({ "poolId": [f.p1] })).await,
            names(&[])
        );
        assert_eq!(
            matching(s, &token, &json!({ "gatewayId": ["gw-b"] })).await,
            names(&["hotel"])
        );

        // Malformed ids in a filter are refused, not silently matched against nothing (a
        // gateway id longer than `gateway.gateway_id` may be is one).
        for filter in [
            json!({ "siteId": ["pool_x"] }),
            json!({ "poolId": ["site_x"] }),
            json!({ "gatewayId": ["g".repeat(101)] }),
        ] {
            let response = s
                .gql(
                    Some(s.admin_token()),
                    FILTERED_COUNT,
                    json!({ "f": filter }),
                )
                .await;
            assert_eq!(
                response.code(),
                Some("BAD_USER_INPUT"),
                "{filter}: {:#}",
                response.body
            );
        }
    })
    .await;
}

/// Every page of `nodes(filter, first)`, followed by `after` until `hasNextPage` is false.
/// Returns the ids page by page; checks `totalCount`, cursors and `hasPreviousPage` on the way.
async fn all_pages(s: &TestServer, filter: Value, first: i64, total: u64) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let data = s
            .admin(
                "query($f: NodeFilterInput, $first: Int, $after: String) {
                    nodes(filter: $f, first: $first, after: $after) {
                        totalCount
                        pageInfo { hasNextPage hasPreviousPage startCursor endCursor }
                        edges { cursor node { id } }
                    }
                }",
                json!({ "f": filter, "first": first, "after": after }),
            )
            .await;
        let nodes = &data["nodes"];
        assert_eq!(
            nodes["totalCount"].as_u64(),
            Some(total),
            "totalCount on every page"
        );
        let info = &nodes["pageInfo"];
        assert_eq!(info["hasPreviousPage"], json!(after.is_some()));
        let edges = nodes["edges"].as_array().expect("edges");
        let ids: Vec<String> = edges
            .iter()
            .map(|e| {
                let id = e["node"]["id"].as_str().expect("an id").to_owned();
                assert_eq!(
                    e["cursor"].as_str(),
                    Some(id.as_str()),
                    "the cursor is the node id"
                );
                id
            })
            .collect();
        assert_eq!(
            info["startCursor"].as_str(),
            ids.first().map(String::as_str)
        );
        assert_eq!(info["endCursor"].as_str(), ids.last().map(String::as_str));
        let more = info["hasNextPage"].as_bool().expect("hasNextPage");
        after = ids.last().cloned();
        pages.push(ids);
        if !more {
            return pages;
        }
        assert!(pages.len() <= total as usize, "paging does not end");
    }
}

#[tokio::test]
async fn nodes_pages_by_cursor_without_losing_or_repeating_a_node() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let now = s.clock.now();
        // 25 nodes; every third one schedulable (9 of them), the rest still `adopting`.
        let nodes: Vec<NodeRecord> = (0..25)
            .map(|i| {
                let mut n = NodeRecord::new(
                    NewNode {
                        hostname: format!("page-{i:02}.example.com"),
                        site_id: SiteId::parse(&site).expect("a site id"),
                        pool_id: Some(PoolId::parse(&pool).expect("a pool id")),
                        owner_tenant_id: None,
                        role: Role::Host,
                        trust: Trust::Platform,
                        adapter: Adapter::BcdV1,
                        drivers: BTreeMap::new(),
                        provision_state: ProvisionState::Adopting,
                    },
                    now,
                )
                .expect("a valid node");
                if i % 3 == 0 {
                    n.provision_state = ProvisionState::Adopted;
                    n.generation = 1;
                    n.observed_generation = 1;
                    n.connectivity = Connectivity::Connected;
                }
                n
            })
            .collect();
        s.insert_nodes(&nodes).await;
        let mut ids: Vec<String> = nodes.iter().map(|n| n.id.to_string()).collect();
        ids.sort();
        let mut schedulable: Vec<String> =
            nodes.iter().step_by(3).map(|n| n.id.to_string()).collect();
        schedulable.sort();

        // (filter, first, expected page sizes, expected ids in order)
        let cases: Vec<(Value, i64, Vec<usize>, &Vec<String>)> = vec![
            (json!({}), 7, vec![7, 7, 7, 4], &ids),
            (json!(null), 25, vec![25], &ids),
            (json!({}), 24, vec![24, 1], &ids),
            (json!({}), 5, vec![5, 5, 5, 5, 5], &ids),
            (json!({}), 1000, vec![25], &ids),
            (
                json!({ "schedulable": true }),
                2,
                vec![2, 2, 2, 2, 1],
                &schedulable,
            ),
            (
                json!({ "schedulable": true }),
                3,
                vec![3, 3, 3],
                &schedulable,
            ),
        ];
        for (filter, first, sizes, want) in cases {
            let pages = all_pages(s, filter.clone(), first, want.len() as u64).await;
            assert_eq!(
                pages.iter().map(Vec::len).collect::<Vec<_>>(),
                sizes,
                "{:?}: {filter} first {first}",
                s.backend
            );
            let flat: Vec<String> = pages.concat();
            assert_eq!(
                &flat, want,
                "{:?}: {filter} first {first}: every node once, ordered by id",
                s.backend
            );
        }

        // After the last node: an empty page with nothing next.
        let data = s
            .admin(
                "query($after: String) { nodes(first: 7, after: $after) {
                    totalCount pageInfo { hasNextPage } edges { cursor }
                } }",
                json!({ "after": ids.last() }),
            )
            .await;
        assert_eq!(data["nodes"]["edges"], json!([]));
        assert_eq!(data["nodes"]["pageInfo"]["hasNextPage"], json!(false));
        assert_eq!(data["nodes"]["totalCount"], json!(25));
        // `first: 0` returns no node but says there are some.
        let data = s.admin(FIRST_ZERO, json!({})).await;
        assert_eq!(data["nodes"]["edges"], json!([]));
        assert_eq!(data["nodes"]["pageInfo"]["hasNextPage"], json!(true));

        for (first, after) in [
            (json!(-1), json!(null)),
            (json!(1001), json!(null)),
            (json!(7), json!("not-a-node")),
            (json!(7), json!("pool_x")),
        ] {
            let response = s
                .gql(
                    Some(s.admin_token()),
                    PAGE_COUNT,
                    json!({ "first": first, "after": after }),
                )
                .await;
            assert_eq!(
                response.code(),
                Some("BAD_USER_INPUT"),
                "first {first} after {after}: {:#}",
                response.body
            );
        }
    })
    .await;
}

#[tokio::test]
async fn capacity_lists_every_bucket_of_every_pool_with_node_and_gpu_counts() {
    each_backend(async |s| {
        let f = Fleet::create(s).await;
        // Expected: the fleet table grouped by pool and bucket (the deleted node and the
        // node without a pool count nowhere).
        let mut want: BTreeMap<String, BTreeMap<CapacityBucket, (i64, i64)>> = BTreeMap::new();
        for pool in [&f.p1, &f.p2, &f.p3, &f.p4] {
            want.insert(
                pool.clone(),
                CapacityBucket::iter().map(|b| (b, (0, 0))).collect(),
            );
        }
        for (pool, bucket, gpus) in f.expected.values() {
            if let Some(pool) = pool {
                let count = want
                    .get_mut(pool)
                    .and_then(|m| m.get_mut(bucket))
                    .expect("a known pool");
                count.0 += 1;
                count.1 += gpus;
            }
        }
        // Spot checks of the table itself.
        assert_eq!(want[&f.p1][&CapacityBucket::Maintenance], (2, 12));
        assert_eq!(want[&f.p1][&CapacityBucket::Schedulable], (1, 8));
        assert_eq!(want[&f.p3][&CapacityBucket::Unhealthy], (1, 7));

        let expected_json = |pool: &str| -> Value {
            let buckets = &want[pool];
            json!({
                "poolId": pool,
                "totalNodes": buckets.values().map(|c| c.0).sum::<i64>(),
                "totalGpus": buckets.values().map(|c| c.1).sum::<i64>(),
                // Every bucket, in the order of the enum, zeros where empty.
                "buckets": CapacityBucket::iter()
                    .map(|b| {
                        let (nodes, gpus) = buckets[&b];
                        json!({ "bucket": gql_enum(b.as_ref()), "nodes": nodes, "gpus": gpus })
                    })
                    .collect::<Vec<_>>(),
            })
        };
        let by_pool = |data: &Value| -> BTreeMap<String, Value> {
            data["capacity"]["nodes"]
                .as_array()
                .expect("a list")
                .iter()
                .map(|c| {
                    (
                        c["poolId"].as_str().expect("a pool id").to_owned(),
                        c.clone(),
                    )
                })
                .collect()
        };

        let all = by_pool(&s.admin(CAPACITY, json!({ "pools": null })).await);
        assert_eq!(
            all.keys().cloned().collect::<BTreeSet<_>>(),
            want.keys().cloned().collect(),
            "{:?}",
            s.backend
        );
        for pool in want.keys() {
            assert_eq!(
                all[pool],
                expected_json(pool),
                "{:?}: capacity of {pool}",
                s.backend
            );
        }
        assert_eq!(all[&f.p1]["totalNodes"], json!(7));
        assert_eq!(all[&f.p1]["totalGpus"], json!(38));
        assert_eq!(all[&f.p4]["totalNodes"], json!(0));

        let some = by_pool(&s.admin(CAPACITY, json!({ "pools": [f.p1, f.p4] })).await);
        assert_eq!(
            some.keys().cloned().collect::<BTreeSet<_>>(),
            BTreeSet::from([f.p1.clone(), f.p4.clone()])
        );
        assert_eq!(some[&f.p1], expected_json(&f.p1));

        // A tenant sees the capacity of its own pools only.
        let tenant = TenantId::parse(&f.tenant_a).expect("a tenant id");
        let token = s.mint(
            "acme-viewer",
            ApiRole::Viewer,
            Some(&tenant),
            chrono::Duration::hours(1),
        );
        let response = s
            .gql(Some(&token), CAPACITY, json!({ "pools": null }))
            .await;
        let mine = by_pool(response.data());
        assert_eq!(mine.keys().cloned().collect::<Vec<_>>(), vec![f.p3.clone()]);
        assert_eq!(mine[&f.p3], expected_json(&f.p3));
        let response = s
            .gql(Some(&token), CAPACITY, json!({ "pools": [f.p1] }))
            .await;
        assert_eq!(response.data()["capacity"]["nodes"], json!([]));

        let response = s
            .gql(
                Some(s.admin_token()),
                CAPACITY,
                json!({ "pools": ["site_x"] }),
            )
            .await;
        assert_eq!(response.code(), Some("BAD_USER_INPUT"));
    })
    .await;
}

/// Runs a node mutation as the admin and returns the node's new version.
async fn mutate(s: &TestServer, mutation: &str, id: &str, version: i64, extra: Value) -> i64 {
    let mut input = json!({ "id": id, "version": version });
    if let (Some(input), Some(extra)) = (input.as_object_mut(), extra.as_object()) {
        input.extend(extra.clone());
    }
    let input_type = match mutation {
        "labelNode" => "LabelNodeInput",
        "cordonNode" => "CordonNodeInput",
        "uncordonNode" => "UncordonNodeInput",
        "taintNode" => "TaintNodeInput",
        other => panic!("no input type for {other}"),
    };
    let data = s
        .admin(
            &format!(
                "mutation($input: {input_type}!) {{ {mutation}(input: $input) {{ node {{ version }} }} }}"
            ),
            json!({ "input": input }),
        )
        .await;
    data[mutation]["node"]["version"]
        .as_i64()
        .expect("a version")
}

#[tokio::test]
async fn a_nodes_events_page_newest_first() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let node = s.enroll(&site, &pool, "events-1.example.com").await;
        let other = s.enroll(&site, &pool, "events-2.example.com").await;
        let id = node["id"].as_str().expect("an id").to_owned();
        let other_id = other["id"].as_str().expect("an id").to_owned();

        // Interleave changes to both nodes; only the first node's belong in its history.
        let mut expected = vec!["node.enrolled"];
        let mut version = node["version"].as_i64().expect("a version");
        let mut other_version = other["version"].as_i64().expect("a version");
        for step in 0..6 {
            let label = json!({ "set": [{ "key": "step", "value": format!("s{step}") }] });
            version = mutate(s, "labelNode", &id, version, label.clone()).await;
            expected.push("node.label_set");
            other_version = mutate(s, "labelNode", &other_id, other_version, label).await;
        }
        version = mutate(
            s,
            "cordonNode",
            &id,
            version,
            json!({ "reason": "rack move" }),
        )
        .await;
        expected.push("node.cordoned");
        version = mutate(s, "taintNode", &id, version, json!({ "key": "gpu-burn" })).await;
        expected.extend(["node.tainted", "node.no_schedule_reason_added"]);
        mutate(s, "uncordonNode", &id, version, json!({})).await;
        expected.push("node.uncordoned");
        expected.reverse(); // newest first
        assert_eq!(expected.len(), 11);

        let query = "query($id: ID!, $first: Int, $after: String) {
            node(id: $id) { events(first: $first, after: $after) {
                pageInfo { hasNextPage hasPreviousPage endCursor }
                edges { cursor node { id type nodeId } }
            } }
        }";
        for (first, sizes) in [
            (4, vec![4, 4, 3]),
            (11, vec![11]),
            (10, vec![10, 1]),
            (1, vec![1; 11]),
            (50, vec![11]),
        ] {
            let mut after: Option<String> = None;
            let mut seen: Vec<(i64, String)> = Vec::new();
            let mut got_sizes = Vec::new();
            loop {
                let data = s
                    .admin(query, json!({ "id": id, "first": first, "after": after }))
                    .await;
                let events = &data["node"]["events"];
                assert_eq!(
                    events["pageInfo"]["hasPreviousPage"],
                    json!(after.is_some())
                );
                let edges = events["edges"].as_array().expect("edges");
                got_sizes.push(edges.len());
                for edge in edges {
                    let event = &edge["node"];
                    let event_id = event["id"].as_str().expect("an event id");
                    assert_eq!(
                        edge["cursor"].as_str(),
                        Some(event_id),
                        "the cursor is the event id"
                    );
                    assert_eq!(event["nodeId"].as_str(), Some(id.as_str()));
                    let seq = event_id
                        .strip_prefix("evt_")
                        .and_then(|n| n.parse::<i64>().ok())
                        .expect("evt_<seq>");
                    seen.push((seq, event["type"].as_str().expect("a type").to_owned()));
                }
                assert_eq!(
                    events["pageInfo"]["endCursor"].as_str(),
                    edges.last().and_then(|e| e["cursor"].as_str())
                );
                after = edges
                    .last()
                    .and_then(|e| e["cursor"].as_str())
                    .map(str::to_owned);
                if events["pageInfo"]["hasNextPage"] != json!(true) {
                    break;
                }
                assert!(got_sizes.len() <= expected.len(), "paging does not end");
            }
            assert_eq!(
                got_sizes, sizes,
                "{:?}: page sizes for first {first}",
                s.backend
            );
            assert!(
                seen.windows(2).all(|w| w[0].0 > w[1].0),
                "{:?}: newest first, no repeats: {seen:?}",
                s.backend
            );
            let types: Vec<&str> = seen.iter().map(|(_, t)| t.as_str()).collect();
            assert_eq!(types, expected, "{:?}: first {first}", s.backend);
        }

        let response = s
            .gql(
                Some(s.admin_token()),
                query,
                json!({ "id": id, "first": 3, "after": "evt_x" }),
            )
            .await;
        assert_eq!(response.code(), Some("BAD_USER_INPUT"));
    })
    .await;
}

#[tokio::test]
async fn provision_state_table_lists_every_edge() {
    each_backend(async |s| {
        let data = s
            .admin("{ provisionStateTable { move from to } }", json!({}))
            .await;
        let want: Vec<Value> = PROVISION_STATE_TABLE
            .iter()
            .map(|edge| {
                let from: Vec<String> = edge
                    .from
                    .iter()
                    .map(|s| gql_enum(s.as_static_str()))
                    .collect();
                json!({
                    "move": gql_enum(edge.action.as_ref()),
                    "from": from,
                    "to": match edge.to {
                        Target::State(state) => json!(gql_enum(state.as_static_str())),
                        Target::FailedFrom => json!(null),
                    },
                })
            })
            .collect();
        assert_eq!(data["provisionStateTable"], json!(want));
        // Every move once.
        assert_eq!(want.len(), ProvisionMove::iter().count());
        assert!(want.contains(&json!({ "move": "RECOVER", "from": ["FAILED"], "to": null })));
    })
    .await;
}

#[tokio::test]
async fn tenants_sites_and_pools_are_listed_by_name_within_scope() {
    each_backend(async |s| {
        let globex = create_tenant(s, "globex").await;
        let acme = create_tenant(s, "acme").await;
        let dc2 = create_site(s, "dc2", None).await;
        let dc1 = create_site(s, "dc1", None).await;
        let home = create_site(s, "acme-home", Some(&acme)).await;
        let gpu = create_pool(
            s,
            json!({
                "siteId": dc1, "name": "gpu", "kind": "METAL_HOST", "expectedGpuCount": 8,
                "expectedGpuModel": "H100", "drivers": [{ "key": "power", "value": "ipmi" }],
            }),
        )
        .await;
        let shared = json!({
            "siteId": dc1, "name": "shared", "kind": "VPS_HOST", "ownerTenantId": globex
        });
        let shared = create_pool(s, shared).await;
        let dedicated = json!({
            "siteId": dc2, "name": "dedicated", "kind": "METAL_DEDICATED", "agent": "NONE"
        });
        let dedicated = create_pool(s, dedicated).await;
        let own = json!({ "siteId": home, "name": "own", "kind": "PROVIDER" });
        let own = create_pool(s, own).await;

        let data = s
            .admin("{ tenants { nodes { id name createdAt } } }", json!({}))
            .await;
        let tenants: Vec<(&str, &str)> = data["tenants"]["nodes"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|t| {
                assert!(t["createdAt"].is_string());
                (
                    t["id"].as_str().expect("an id"),
                    t["name"].as_str().expect("a name"),
                )
            })
            .collect();
        assert_eq!(
            tenants,
            vec![(acme.as_str(), "acme"), (globex.as_str(), "globex")]
        );

        let data = s
            .admin(
                "{ sites { nodes { id name kind ownerTenantId } } }",
                json!({}),
            )
            .await;
        assert_eq!(
            data["sites"]["nodes"],
            json!([
                { "id": home, "name": "acme-home", "kind": "CUSTOM", "ownerTenantId": acme },
                { "id": dc1, "name": "dc1", "kind": "PLATFORM", "ownerTenantId": null },
                { "id": dc2, "name": "dc2", "kind": "PLATFORM", "ownerTenantId": null },
            ])
        );

        let pools_query = "query($site: ID) { pools(siteId: $site) { nodes {
            id siteId name kind agent ownerTenantId expectedGpuCount expectedGpuModel
            drivers { key value }
        } } }";
        let gpu_json = json!({
            "id": gpu, "siteId": dc1, "name": "gpu", "kind": "METAL_HOST", "agent": "BCD",
            "ownerTenantId": null, "expectedGpuCount": 8, "expectedGpuModel": "H100",
            "drivers": [{ "key": "power", "value": "ipmi" }],
        });
        let shared_json = json!({
            "id": shared, "siteId": dc1, "name": "shared", "kind": "VPS_HOST", "agent": "BCD",
            "ownerTenantId": globex,
            "expectedGpuCount": null, "expectedGpuModel": null, "drivers": [],
        });
        // A pool on a tenant's site belongs to that tenant.
        let own_json = json!({
            "id": own, "siteId": home, "name": "own", "kind": "PROVIDER", "agent": "BCD",
            "ownerTenantId": acme,
            "expectedGpuCount": null, "expectedGpuModel": null, "drivers": [],
        });
        let dedicated_json = json!({
            "id": dedicated, "siteId": dc2, "name": "dedicated", "kind": "METAL_DEDICATED",
            "agent": "NONE", "ownerTenantId": null,
            "expectedGpuCount": null, "expectedGpuModel": null, "drivers": [],
        });
        let cases = [
            (
                json!(null),
                json!([dedicated_json, gpu_json, own_json, shared_json]),
            ),
            (json!(dc1), json!([gpu_json, shared_json])),
            (json!(home), json!([own_json])),
            (json!("site_nosuchsite"), json!([])),
        ];
        for (site, want) in cases {
            assert_eq!(
                s.admin(pools_query, json!({ "site": site })).await["pools"]["nodes"],
                want,
                "{:?}: pools(siteId: {site})",
                s.backend
            );
        }
        let response = s
            .gql(
                Some(s.admin_token()),
                pools_query,
                json!({ "site": "pool_x" }),
            )
            .await;
        assert_eq!(response.code(), Some("BAD_USER_INPUT"));

        // A tenant's token sees its own tenant, sites and pools only.
        let token = s.mint(
            "acme-viewer",
            ApiRole::Viewer,
            Some(&TenantId::parse(&acme).expect("an id")),
            chrono::Duration::hours(1),
        );
        let response = s.gql(Some(&token), SCOPE, json!({})).await;
        assert_eq!(
            response.data(),
            &json!({
                "tenants": { "nodes": [{ "id": acme }] },
                "sites": { "nodes": [{ "id": home }] },
                "pools": { "nodes": [{ "id": own }] },
            })
        );
    })
    .await;
}

/// Every page of a catalog connection, two items at a time: the ids in order, and whether
/// each page's `pageInfo` and `totalCount` told the truth.
async fn every_page(s: &TestServer, token: &str, field: &str, arguments: &str) -> Vec<String> {
    let id = if field == "capacity" { "poolId" } else { "id" };
    let query = format!(
        "query($after: String) {{ {field}(first: 2, after: $after{arguments}) {{
            totalCount pageInfo {{ hasNextPage hasPreviousPage endCursor }}
            edges {{ cursor node {{ {id} }} }}
        }} }}"
    );
    let mut ids = Vec::new();
    let mut after = Value::Null;
    loop {
        let response = s.gql(Some(token), &query, json!({ "after": after })).await;
        let page = &response.data()[field];
        let edges = page["edges"].as_array().expect("edges");
        assert!(edges.len() <= 2, "{field}: a page holds at most `first`");
        for edge in edges {
            assert_eq!(
                edge["cursor"], edge["node"][id],
                "{field}: the cursor is the id"
            );
            ids.push(edge["node"][id].as_str().expect("an id").to_owned());
        }
        assert_eq!(page["pageInfo"]["hasPreviousPage"], json!(!after.is_null()));
        let total = page["totalCount"].as_u64().expect("a total");
        if page["pageInfo"]["hasNextPage"] == json!(false) {
            assert_eq!(
                total,
                ids.len() as u64,
                "{field}: totalCount counts every page"
            );
            return ids;
        }
        assert!(
            edges.len() == 2 && ids.len() < 100,
            "{field}: a full page before the next"
        );
        after = page["pageInfo"]["endCursor"].clone();
    }
}

/// `tenants`, `sites`, `pools`, `capacity` and `joinTokens` are connections: paged by cursor
/// (the item's id) in a stable order, names shared across sites included, with a total, and
/// a cursor that names nothing the list (as the caller sees it) holds is refused.
#[tokio::test]
async fn catalog_lists_page_by_cursor_in_a_stable_order_with_their_totals() {
    each_backend(async |s| {
        let admin = s.admin_token().to_owned();
        let mut tenants = Vec::new();
        for name in ["t3", "t1", "t4", "t0", "t2"] {
            tenants.push((name, create_tenant(s, name).await));
        }
        tenants.sort();
        let mut sites = Vec::new();
        for name in ["s2", "s0", "s4", "s1", "s3"] {
            sites.push((name, create_site(s, name, None).await));
        }
        sites.sort();
        // Two sites with pools of the same names: the id orders pools of one name.
        let mut pools = Vec::new();
        for (_, site) in &sites[..2] {
            for name in ["b", "a", "c"] {
                let pool = json!({ "siteId": site, "name": name, "kind": "METAL_HOST" });
                pools.push((name, create_pool(s, pool).await));
            }
        }
        pools.sort();
        let mut tokens = Vec::new();
        for _ in 0..5 {
            let secret = s.join_token(&sites[0].1, None, 1).await;
            tokens.push(
                secret
                    .split_once('.')
                    .expect("`<id>.<secret>`")
                    .0
                    .to_owned(),
            );
        }
        tokens.reverse();
        let ids =
            |list: &[(&str, String)]| list.iter().map(|(_, id)| id.clone()).collect::<Vec<_>>();

        assert_eq!(every_page(s, &admin, "tenants", "").await, ids(&tenants));
        assert_eq!(every_page(s, &admin, "sites", "").await, ids(&sites));
        assert_eq!(every_page(s, &admin, "pools", "").await, ids(&pools));
        assert_eq!(every_page(s, &admin, "capacity", "").await, ids(&pools));
        assert_eq!(
            every_page(s, &admin, "joinTokens", "").await,
            tokens,
            "newest first"
        );
        let site = &sites[1].1;
        let of_site: Vec<String> =
            every_page(s, &admin, "pools", &format!(", siteId: \"{site}\"")).await;
        assert_eq!(of_site.len(), 3, "{:?}: pools(siteId)", s.backend);
        let named = format!(
            ", poolIds: [\"{}\", \"{}\", \"{}\"]",
            pools[0].1, pools[3].1, pools[5].1
        );
        assert_eq!(
            every_page(s, &admin, "capacity", &named).await,
            vec![pools[0].1.clone(), pools[3].1.clone(), pools[5].1.clone()]
        );

        // Cursors that name nothing the list holds.
        let tenant = TenantId::parse(&tenants[0].1).expect("a tenant id");
        let own_site = create_site(s, "own", Some(&tenants[0].1)).await;
        let tenant_token = s.mint(
            "t0-viewer",
            ApiRole::Viewer,
            Some(&tenant),
            chrono::Duration::hours(1),
        );
        let refused = [
            (&admin, "sites", "site_nosuchsite".to_owned()),
            (&admin, "sites", tenants[0].1.clone()),
            (&admin, "tenants", "ten_nosuchtenant".to_owned()),
            (&admin, "pools", sites[0].1.clone()),
            (&admin, "joinTokens", "node_x".to_owned()),
            (&tenant_token, "sites", sites[0].1.clone()),
            (&tenant_token, "tenants", tenants[1].1.clone()),
        ];
        for (token, field, after) in refused {
            let response = s
                .gql(
                    Some(token),
                    &format!("query($after: String) {{ {field}(after: $after) {{ totalCount }} }}"),
                    json!({ "after": after }),
                )
                .await;
            assert_eq!(
                response.code(),
                Some("BAD_USER_INPUT"),
                "{:?}: {field}(after: {after}): {:#}",
                s.backend,
                response.body
            );
        }
        assert_eq!(
            every_page(s, &tenant_token, "sites", "").await,
            vec![own_site]
        );
        assert_eq!(
            every_page(s, &tenant_token, "tenants", "").await,
            vec![tenants[0].1.clone()]
        );
    })
    .await;
}

#[tokio::test]
async fn create_site_and_create_pool_refuse_bad_input() {
    each_backend(async |s| {
        let acme = create_tenant(s, "acme").await;
        let globex = create_tenant(s, "globex").await;
        let dc1 = create_site(s, "dc1", None).await;
        let dc2 = create_site(s, "dc2", None).await;
        let home = create_site(s, "acme-home", Some(&acme)).await;
        create_pool(
            s,
            json!({ "siteId": dc1, "name": "gpu", "kind": "METAL_HOST" }),
        )
        .await;

        const TENANT: &str =
            "mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }";
        let site = |input: Value| (SITE, json!({ "input": input }));
        let pool = |input: Value| (POOL, json!({ "input": input }));
        let cases: Vec<(&str, (&str, Value), &str)> = vec![
            (
                "duplicate site name",
                site(json!({ "name": "dc1", "kind": "PLATFORM" })),
                "BAD_USER_INPUT",
            ),
            (
                "duplicate custom site name",
                site(json!({ "name": "acme-home", "kind": "CUSTOM", "ownerTenantId": acme })),
                "BAD_USER_INPUT",
            ),
            (
                "custom site without owner",
                site(json!({ "name": "x", "kind": "CUSTOM" })),
                "BAD_USER_INPUT",
            ),
            (
                "platform site with owner",
                site(json!({ "name": "x", "kind": "PLATFORM", "ownerTenantId": acme })),
                "BAD_USER_INPUT",
            ),
            (
                "custom site, unknown owner",
                site(json!({ "name": "x", "kind": "CUSTOM", "ownerTenantId": "ten_nosuchtenant" })),
                "NOT_FOUND",
            ),
            (
                "custom site, owner not a tenant id",
                site(json!({ "name": "x", "kind": "CUSTOM", "ownerTenantId": "site_x" })),
                "BAD_USER_INPUT",
            ),
            (
                "site name with surrounding space",
                site(json!({ "name": " x", "kind": "PLATFORM" })),
                "BAD_USER_INPUT",
            ),
            (
                "empty site name",
                site(json!({ "name": "", "kind": "PLATFORM" })),
                "BAD_USER_INPUT",
            ),
            (
                "pool on an unknown site",
                pool(json!({ "siteId": "site_nosuchsite", "name": "p", "kind": "METAL_HOST" })),
                "NOT_FOUND",
            ),
            (
                "pool on a site id that is not one",
                pool(json!({ "siteId": "pool_x", "name": "p", "kind": "METAL_HOST" })),
                "BAD_USER_INPUT",
            ),
            (
                "duplicate pool name in a site",
                pool(json!({ "siteId": dc1, "name": "gpu", "kind": "VPS_HOST" })),
                "BAD_USER_INPUT",
            ),
            (
                "pool with an unknown owner",
                pool(json!({
                    "siteId": dc1, "name": "p", "kind": "METAL_HOST",
                    "ownerTenantId": "ten_nosuchtenant"
                })),
                "NOT_FOUND",
            ),
            (
                "pool on a tenant's site for another tenant",
                pool(json!({
                    "siteId": home, "name": "p", "kind": "PROVIDER", "ownerTenantId": globex
                })),
                "BAD_USER_INPUT",
            ),
            (
                "pool with a negative GPU count",
                pool(json!({
                    "siteId": dc1, "name": "p", "kind": "METAL_HOST", "expectedGpuCount": -1
                })),
                "BAD_USER_INPUT",
            ),
            (
                "empty pool name",
                pool(json!({ "siteId": dc1, "name": "", "kind": "METAL_HOST" })),
                "BAD_USER_INPUT",
            ),
            (
                "duplicate tenant name",
                (TENANT, json!({ "name": "acme" })),
                "BAD_USER_INPUT",
            ),
        ];
        for (name, (query, variables), code) in &cases {
            let response = s.gql(Some(s.admin_token()), query, variables.clone()).await;
            assert_eq!(
                response.code(),
                Some(*code),
                "{:?}: {name}: {:#}",
                s.backend,
                response.body
            );
            assert!(response.body["data"].is_null(), "{name}: nothing returned");
        }

        // Only platform admins create: an operator, or a tenant's admin, is FORBIDDEN.
        let tenant_admin = s.mint(
            "acme-admin",
            ApiRole::Admin,
            Some(&TenantId::parse(&acme).expect("an id")),
            chrono::Duration::hours(1),
        );
        for token in [s.token(ApiRole::Operator), tenant_admin] {
            let response = s
                .gql(
                    Some(&token),
                    SITE,
                    json!({ "input": { "name": "y", "kind": "PLATFORM" } }),
                )
                .await;
            assert_eq!(response.code(), Some("FORBIDDEN"), "{:#}", response.body);
        }

        // Nothing refused was written.
        let data = s.admin(CATALOG, json!({})).await;
        assert_eq!(
            data,
            json!({
                "tenants": { "nodes": [{ "name": "acme" }, { "name": "globex" }] },
                "sites": {
                    "nodes": [{ "name": "acme-home" }, { "name": "dc1" }, { "name": "dc2" }]
                },
                "pools": { "nodes": [{ "name": "gpu", "siteId": dc1 }] },
            })
        );
        // A pool name is unique per site, not globally.
        create_pool(
            s,
            json!({ "siteId": dc2, "name": "gpu", "kind": "METAL_HOST" }),
        )
        .await;
    })
    .await;
}

/// A node's child rows (labels, taints, conditions with and without a proof, reasons) are
/// read back as written, for one node and for a page of several: they come back as JSON
/// columns of the node's own row, which each backend renders its way (booleans, timestamps,
/// JSON in JSON).
#[tokio::test]
async fn child_rows_load_back_as_written_one_node_or_many() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let now = s.clock.now();
        let by = Actor::Controller("test".into());
        let nodes: Vec<NodeRecord> = (0..4)
            .map(|i| {
                let mut n = crate::common::node_record(s, &place, ProvisionState::Adopted);
                // Node 3 has no child rows at all; the others have more the higher they are.
                if i < 3 {
                    let labels = (0..=i)
                        .map(|l| (format!("rack-{l}"), format!("r{i}{l}")))
                        .collect();
                    n.update_labels(&labels, &[]).expect("labels");
                }
                if (1..3).contains(&i) {
                    taint_and_fill_disk(&mut n, &by, now);
                }
                if i == 2 {
                    // A condition that clears only on proof carries its proof.
                    n.report_condition(
                        bc_core::clear::GPU_NEEDS_RESET,
                        ConditionStatus::True,
                        "Xid79",
                        "GPU fell off the bus",
                        &by,
                        now,
                    )
                    .expect("a proof condition");
                }
                n
            })
            .collect();
        assert!(
            nodes[2].conditions.iter().any(|c| c.proof.is_some())
                && nodes[2].conditions.iter().any(|c| c.proof.is_none())
                && !nodes[2].no_schedule_reasons.is_empty()
                && !nodes[2].taints.is_empty(),
            "the fixture has every kind of child row: {:?}",
            nodes[2]
        );
        s.insert_nodes(&nodes).await;
        let services = &s.server.services;
        for node in &nodes {
            let loaded = services
                .node_record(&node.id)
                .await
                .expect("loading a node")
                .expect("the node exists");
            assert_eq!(&loaded, node, "one node loads back as written");
        }
        let admin = better_compute::auth::Principal {
            subject: "test-admin".into(),
            role: ApiRole::Admin,
            tenant: None,
            expires_at: now + chrono::Duration::hours(1),
        };
        // Every combination of child sets: those named load back as written, the others
        // are empty, and the reasons (which schedulability needs) are always read.
        for combination in 0..8 {
            let sets = ChildSets {
                labels: combination & 1 != 0,
                taints: combination & 2 != 0,
                conditions: combination & 4 != 0,
            };
            let page = services
                .nodes(
                    &admin,
                    better_compute::service::NodeFilter::default(),
                    None,
                    10,
                    sets,
                )
                .await
                .expect("a page of nodes");
            assert_eq!(page.nodes.len(), nodes.len());
            for detail in &page.nodes {
                let mut expected = nodes
                    .iter()
                    .find(|n| n.id == detail.record.id)
                    .expect("a written node")
                    .clone();
                if !sets.labels {
                    expected.labels.clear();
                }
                if !sets.taints {
                    expected.taints.clear();
                }
                if !sets.conditions {
                    expected.conditions.clear();
                }
                assert_eq!(
                    detail.record, expected,
                    "a page's node loads back as written, with the sets {sets:?}"
                );
            }
        }
    })
    .await;
}

/// A page of `nodes` reads the child sets its query selects, however it selects them: each
/// of these answers with the node's labels, taints and conditions, none with an error (a set
/// the look-ahead missed is refused as `INTERNAL`), and a page that selects none of them
/// still answers its other fields.
#[tokio::test]
async fn a_page_shows_every_child_set_its_query_selects_by_any_path() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let by = Actor::Controller("test".into());
        let now = s.clock.now();
        let mut n = crate::common::node_record(s, &place, ProvisionState::Adopted);
        n.update_labels(&BTreeMap::from([("rack".to_owned(), "r-1".to_owned())]), &[])
            .expect("a label");
        taint_and_fill_disk(&mut n, &by, now);
        s.insert_nodes(std::slice::from_ref(&n)).await;
        let sets = "labels { key value } taints { key } conditions { type }";
        let shapes = [
            format!("{{ nodes(first: 10) {{ edges {{ node {{ {sets} }} }} }} }}"),
            format!("{{ nodes(first: 10) {{ nodes {{ {sets} }} }} }}"),
            format!("{{ nodes(first: 10) {{ nodes {{ ...Sets }} }} }} fragment Sets on NodeDetail {{ {sets} }}"),
            format!("{{ nodes(first: 10) {{ edges {{ node {{ ... on NodeDetail {{ {sets} }} }} }} }} }}"),
            format!("{{ nodes(first: 10) {{ ...Page }} }} fragment Page on NodeDetailConnection {{ edges {{ ...Edge }} }} fragment Edge on NodeDetailEdge {{ node {{ {sets} }} }}"),
            "{ nodes(first: 10) { edges { node { l: labels { key value } t: taints { key } c: conditions { type } } } } }".to_owned(),
            format!("{{ nodes(first: 10) {{ e: edges {{ n: node {{ {sets} }} }} }} }}"),
            format!("{{ nodes(first: 10) {{ edges {{ node {{ ... @include(if: true) {{ {sets} }} }} }} }} }}"),
            "query($yes: Boolean!) { nodes(first: 10) { edges { node { labels @include(if: $yes) { key value } taints @skip(if: false) { key } conditions { type } } } } }".to_owned(),
            // Two pages in one query: the second selects the sets, the first does not.
            format!("{{ a: nodes(first: 10) {{ edges {{ node {{ hostname }} }} }} b: nodes(first: 10) {{ edges {{ node {{ {sets} }} }} }} }}"),
        ];
        for query in &shapes {
            let response = s
                .gql(Some(s.admin_token()), query, json!({ "yes": true }))
                .await;
            // No error (a set the look-ahead missed is `INTERNAL`), and each set shown.
            let shown = response.data().to_string();
            for expected in [
                r#"{"key":"rack","value":"r-1"}"#,
                r#"{"key":"gpu"}"#,
                r#"{"type":"DiskPressure"}"#,
            ] {
                assert!(shown.contains(expected), "{expected} in {query}: {shown}");
            }
        }
        let response = s
            .gql(
                Some(s.admin_token()),
                "{ nodes(first: 10) { edges { node { hostname noScheduleReasons schedulability { schedulable } } } } }",
                json!({}),
            )
            .await;
        let node = &response.data()["nodes"]["edges"][0]["node"];
        assert_eq!(node["hostname"], json!(n.hostname));
        let reasons: Vec<String> = n.no_schedule_reasons.iter().map(|r| r.key.to_string()).collect();
        assert!(!reasons.is_empty(), "the condition keeps work off the node");
        assert_eq!(node["noScheduleReasons"], json!(reasons), "{node}");
        assert_eq!(node["schedulability"]["schedulable"], json!(false), "{node}");

        // A page that does not select a set does not read it: with the node's condition and
        // taint rows made unreadable, a page without them still answers, and a page with
        // either fails as the corrupt row it read.
        let db = s.database().await;
        bc_entity::node_condition::Entity::update_many()
            .col_expr(bc_entity::node_condition::Column::Status, Expr::value("Bogus"))
            .exec(&db)
            .await
            .expect("corrupting the condition");
        bc_entity::node_taint::Entity::update_many()
            .col_expr(bc_entity::node_taint::Column::Effect, Expr::value("Bogus"))
            .exec(&db)
            .await
            .expect("corrupting the taint");
        let page = |fields: &str| format!("{{ nodes(first: 10) {{ edges {{ node {{ {fields} }} }} }} }}");
        let answered = s
            .gql(Some(s.admin_token()), &page("hostname labels { key } noScheduleReasons"), json!({}))
            .await;
        assert_eq!(
            answered.data()["nodes"]["edges"][0]["node"]["hostname"],
            json!(n.hostname)
        );
        for fields in ["conditions { type }", "taints { key }"] {
            let refused = s.gql(Some(s.admin_token()), &page(fields), json!({})).await;
            assert_eq!(refused.code(), Some("INTERNAL"), "{fields}");
        }
    })
    .await;
}

/// Gives `n` a `gpu=flaky` `NO_SCHEDULE` taint and a `DiskPressure` condition that keeps
/// work off it: one row of each child table but the labels, and a reason.
fn taint_and_fill_disk(n: &mut NodeRecord, by: &Actor, now: chrono::DateTime<chrono::Utc>) {
    n.taint(
        "gpu",
        "flaky",
        bc_core::axes::TaintEffect::NoSchedule,
        by,
        now,
    )
    .expect("a taint");
    n.set_condition(
        "DiskPressure",
        ConditionStatus::True,
        "Full",
        "the disk is full",
        true,
        by,
        now,
    )
    .expect("a condition");
}

/// Each child column reads back as its own: the children are rendered as JSON by the
/// database and decoded by position, so two columns of one type swapped, a `false` flag, a
/// timestamp's microseconds or text JSON must escape would be lost without a failing read.
#[tokio::test]
async fn child_columns_keep_their_own_values_through_json() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let by = Actor::Controller("test".into());
        let first = s.clock.now() + chrono::Duration::microseconds(123_457);
        let later = first + chrono::Duration::microseconds(654_321);
        let text = "quote \" back\\slash\nnew\tline ☃ 😀 \u{1}";
        let mut n = crate::common::node_record(s, &place, ProvisionState::Adopted);
        let labels = BTreeMap::from([
            ("example.com/rack".to_owned(), "r-7".to_owned()),
            ("zone".to_owned(), "a.b-c_d".to_owned()),
        ]);
        n.update_labels(&labels, &[]).expect("labels");
        n.set_condition(
            "MemoryPressure",
            ConditionStatus::False,
            "Fine",
            text,
            false,
            &by,
            first,
        )
        .expect("a condition that does not keep work off");
        n.set_condition(
            "DiskPressure",
            ConditionStatus::True,
            "Full",
            text,
            true,
            &by,
            first,
        )
        .expect("a condition");
        // The same status later: `updated_at` moves, `last_transition_at` stays.
        n.set_condition(
            "DiskPressure",
            ConditionStatus::True,
            "Full",
            "still full",
            true,
            &by,
            later,
        )
        .expect("the condition again");
        n.taint(
            "gpu",
            "flaky",
            bc_core::axes::TaintEffect::NoSchedule,
            &by,
            later,
        )
        .expect("a taint");
        let disk = n
            .conditions
            .iter()
            .find(|c| c.kind == "DiskPressure")
            .expect("the condition");
        assert_ne!(disk.last_transition_at, disk.updated_at);
        assert!(n.conditions.iter().any(|c| !c.no_schedule));
        s.insert_nodes(std::slice::from_ref(&n)).await;
        let loaded = s
            .server
            .services
            .node_record(&n.id)
            .await
            .expect("loading the node")
            .expect("the node exists");
        assert_eq!(loaded, n, "{:?}", s.backend);
    })
    .await;
}

/// A fleet that grew gets fresh planner statistics on PostgreSQL, by autovacuum's rule
/// (BENCHMARKS.md: plans made while the tables were empty scanned 60,000 condition rows for
/// a page of 100 nodes): the node table is analysed once enough of it changed, and is not
/// due again until it changes as much more. SQLite keeps no statistics to refresh.
#[tokio::test]
async fn tables_that_grew_get_fresh_planner_statistics_on_postgresql() {
    each_backend(async |s| {
        let place = site_and_pool(s).await;
        let records: Vec<NodeRecord> = (0..120)
            .map(|_| node_record(s, &place, ProvisionState::Adopted))
            .collect();
        s.server
            .services
            .insert_nodes_for_tests(&records)
            .await
            .expect("inserting nodes");
        let refresh = async || {
            s.server
                .services
                .refresh_planner_statistics()
                .await
                .expect("refreshing planner statistics")
        };
        match s.backend {
            Backend::Sqlite => assert_eq!(refresh().await, Vec::<String>::new()),
            Backend::Postgres => {
                // PostgreSQL counts a connection's changes for everyone within seconds, not
                // at its commit: look again until the inserts are counted.
                let started = std::time::Instant::now();
                let analysed = loop {
                    let analysed = refresh().await;
                    if analysed.iter().any(|t| t == "nodes") {
                        break analysed;
                    }
                    assert!(
                        started.elapsed() < std::time::Duration::from_secs(30),
                        "nodes was never analysed; last: {analysed:?}"
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                };
                assert!(analysed.iter().all(|t| !t.contains('"')), "{analysed:?}");
                let again = refresh().await;
                assert!(
                    !again.iter().any(|t| t == "nodes"),
                    "analysed again without changes: {again:?}"
                );
            }
        }
    })
    .await;
}
