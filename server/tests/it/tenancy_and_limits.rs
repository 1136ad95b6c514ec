//! Tenancy (a tenant token sees and changes only what its tenant owns), the API's limits
//! (depth, complexity, page size), and the plain HTTP endpoints, over real HTTP on SQLite
//! and on PostgreSQL.

use bc_core::ids::TenantId;
use bc_testing::{Gql, TestServer, each_backend};
use better_compute::auth::Role;
use chrono::Duration;
use serde_json::{Value, json};

/// A tenant with its own `CUSTOM` site, a pool on it and a node enrolled there.
struct Tenancy {
    tenant: String,
    site: String,
    pool: String,
    node: String,
}

/// Two tenants and the platform, each with one node.
struct World {
    a: Tenancy,
    b: Tenancy,
    platform_site: String,
    platform_node: String,
}

async fn tenancy(s: &TestServer, name: &str) -> Tenancy {
    let tenant = s
        .admin(
            "mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id name } } }",
            json!({ "name": name }),
        )
        .await["createTenant"]["tenant"]
        .clone();
    assert_eq!(tenant["name"], json!(name));
    let tenant = tenant["id"].as_str().expect("a tenant id").to_owned();
    assert!(tenant.starts_with("ten_"), "{tenant}");
    let site = s
        .admin(
            "mutation($name: String!, $owner: ID!) { createSite(input: {name: $name, kind: CUSTOM, ownerTenantId: $owner}) { site { id kind ownerTenantId } } }",
            json!({ "name": format!("{name}-dc"), "owner": tenant }),
        )
        .await["createSite"]["site"]
        .clone();
    assert_eq!(site["kind"], json!("CUSTOM"));
    assert_eq!(site["ownerTenantId"], json!(tenant));
    let site = site["id"].as_str().expect("a site id").to_owned();
    let pool = s
        .admin(
            "mutation($site: ID!) { createPool(input: {siteId: $site, name: \"own\", kind: METAL_HOST}) { pool { id ownerTenantId } } }",
            json!({ "site": site }),
        )
        .await["createPool"]["pool"]
        .clone();
    assert_eq!(
        pool["ownerTenantId"],
        json!(tenant),
        "a pool on a tenant's site is the tenant's"
    );
    let pool = pool["id"].as_str().expect("a pool id").to_owned();
    let node = s
        .enroll(&site, &pool, &format!("gpu-1.{name}.example.com"))
        .await;
    let node = node["id"].as_str().expect("a node id").to_owned();
    Tenancy {
        tenant,
        site,
        pool,
        node,
    }
}

async fn world(s: &TestServer) -> World {
    let a = tenancy(s, "acme").await;
    let b = tenancy(s, "globex").await;
    let (platform_site, platform_pool) = s.site_and_pool(8).await;
    let platform_node = s
        .enroll(&platform_site, &platform_pool, "gpu-1.platform.example.com")
        .await["id"]
        .as_str()
        .expect("a node id")
        .to_owned();
    World {
        a,
        b,
        platform_site,
        platform_node,
    }
}

/// A token scoped to `tenant`.
fn tenant_token(s: &TestServer, tenant: &str, role: Role) -> String {
    let tenant = TenantId::parse(tenant).expect("a tenant id");
    s.mint(
        &format!("{role}@{tenant}"),
        role,
        Some(&tenant),
        Duration::hours(1),
    )
}

const LIST: &str = "query($filter: NodeFilterInput) {
  nodes(filter: $filter, first: 100) { totalCount nodes { id ownerTenantId trust } }
}";

/// The ids `nodes(filter)` lists for `token`, checked against its `totalCount`.
async fn listed(s: &TestServer, token: &str, filter: Value) -> Vec<String> {
    let response = s.gql(Some(token), LIST, json!({ "filter": filter })).await;
    let nodes = &response.data()["nodes"];
    let ids: Vec<String> = nodes["nodes"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|n| n["id"].as_str().expect("an id").to_owned())
        .collect();
    assert_eq!(nodes["totalCount"], json!(ids.len()), "{:#}", response.body);
    ids
}

#[tokio::test]
async fn a_node_on_a_tenants_custom_site_is_tenant_owned_by_it() {
    each_backend(async |s| {
        let w = world(s).await;
        let node = crate::common::node(s, &w.a.node).await;
        assert_eq!(node["trust"], json!("TENANT_OWNED"));
        assert_eq!(node["ownerTenantId"], json!(w.a.tenant));
        assert_eq!(node["role"], json!("HOST"));
        assert_eq!(node["siteId"], json!(w.a.site));
        assert_eq!(node["poolId"], json!(w.a.pool));
        assert_eq!(node["provisionState"], json!("ENROLLING"));
        // In its owner's pool, trust does not keep it from work.
        let failing: Vec<&Value> = node["schedulability"]["failingChecks"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|f| &f["check"])
            .collect();
        assert!(
            !failing.contains(&&json!("TRUST_ALLOWS_POOL")),
            "{failing:?}"
        );
        let platform = crate::common::node(s, &w.platform_node).await;
        assert_eq!(platform["trust"], json!("PLATFORM"));
        assert_eq!(platform["ownerTenantId"], Value::Null);
    })
    .await;
}

#[tokio::test]
async fn a_tenant_token_sees_only_its_tenants_nodes() {
    each_backend(async |s| {
        let w = world(s).await;
        let mut everything = vec![w.a.node.clone(), w.b.node.clone(), w.platform_node.clone()];
        everything.sort();
        assert_eq!(listed(s, s.admin_token(), json!({})).await, everything);

        for (me, other) in [(&w.a, &w.b), (&w.b, &w.a)] {
            for role in [Role::Viewer, Role::Operator, Role::Admin] {
                let token = tenant_token(s, &me.tenant, role);
                let label = format!("{role} of {} ({:?})", me.tenant, s.backend);
                // (filter, what the tenant may see of it)
                let cases = [
                    (json!({}), vec![me.node.clone()]),
                    (json!({ "trust": ["TENANT_OWNED"] }), vec![me.node.clone()]),
                    (json!({ "trust": ["PLATFORM"] }), vec![]),
                    (json!({ "siteId": [other.site] }), vec![]),
                    (json!({ "poolId": [other.pool] }), vec![]),
                    (json!({ "siteId": [w.platform_site] }), vec![]),
                    (json!({ "hostname": "example.com" }), vec![me.node.clone()]),
                ];
                for (filter, want) in cases {
                    assert_eq!(
                        listed(s, &token, filter.clone()).await,
                        want,
                        "{label}: {filter}"
                    );
                }

                let own = s
                    .gql(
                        Some(&token),
                        "query($id: ID!) { node(id: $id) { id events { nodes { type } } } }",
                        json!({ "id": me.node }),
                    )
                    .await;
                assert_eq!(own.data()["node"]["id"], json!(me.node), "{label}");
                assert_eq!(
                    own.data()["node"]["events"]["nodes"],
                    json!([{ "type": "node.enrolled" }]),
                    "{label}"
                );
                for foreign in [&other.node, &w.platform_node] {
                    let response = s
                        .gql(
                            Some(&token),
                            "query($id: ID!) { node(id: $id) { id } }",
                            json!({ "id": foreign }),
                        )
                        .await;
                    assert_eq!(
                        response.code(),
                        Some("NOT_FOUND"),
                        "{label}: {:#}",
                        response.body
                    );
                    // Exactly what a node that does not exist gets.
                    assert_eq!(
                        response.error()["message"],
                        json!(format!("node `{foreign}` does not exist")),
                        "{label}"
                    );
                }

                let catalog = s
                    .gql(
                        Some(&token),
                        "{ tenants { nodes { id } } sites { nodes { id } } pools { nodes { id } } capacity { nodes { poolId } } }",
                        json!({}),
                    )
                    .await;
                let catalog = catalog.data();
                assert_eq!(catalog["tenants"]["nodes"], json!([{ "id": me.tenant }]), "{label}");
                assert_eq!(catalog["sites"]["nodes"], json!([{ "id": me.site }]), "{label}");
                assert_eq!(catalog["pools"]["nodes"], json!([{ "id": me.pool }]), "{label}");
                assert_eq!(
                    catalog["capacity"]["nodes"],
                    json!([{ "poolId": me.pool }]),
                    "{label}"
                );
            }
        }
    })
    .await;
}

/// Mutations a tenant admin could make on its own node, tried on nodes it does not own.
#[tokio::test]
async fn a_tenant_cannot_change_a_node_it_does_not_own() {
    // (mutation, input type, arguments besides id and version). Each would succeed on the
    // target (an `enrolling` node) if the tenant owned it.
    let cases: Vec<(&str, &str, Value)> = vec![
        (
            "cordonNode",
            "CordonNodeInput",
            json!({ "reason": "mine now" }),
        ),
        ("uncordonNode", "UncordonNodeInput", json!({})),
        (
            "drainNode",
            "DrainNodeInput",
            json!({ "reason": "mine now" }),
        ),
        ("taintNode", "TaintNodeInput", json!({ "key": "gpu-burn" })),
        (
            "untaintNode",
            "UntaintNodeInput",
            json!({ "key": "gpu-burn" }),
        ),
        (
            "labelNode",
            "LabelNodeInput",
            json!({ "set": [{ "key": "owner", "value": "acme" }] }),
        ),
        ("adoptNode", "AdoptNodeInput", json!({})),
        (
            "retireNode",
            "RetireNodeInput",
            json!({ "reason": "mine now" }),
        ),
        (
            "transitionNode",
            "TransitionNodeInput",
            json!({ "move": "INSPECT" }),
        ),
        (
            "revokeNodeIdentity",
            "RevokeNodeIdentityInput",
            json!({ "reason": "mine now" }),
        ),
        ("deleteNode", "DeleteNodeInput", json!({})),
    ];
    each_backend(async |s| {
        let w = world(s).await;
        let token = tenant_token(s, &w.a.tenant, Role::Admin);
        for target in [&w.b.node, &w.platform_node] {
            // Tainted, so that untaintNode too would succeed for the owner.
            s.admin(
                "mutation($id: ID!) { taintNode(input: {id: $id, version: 1, key: \"gpu-burn\"}) { node { id } } }",
                json!({ "id": target }),
            )
            .await;
            let before = crate::common::node(s, target).await;
            for (field, input_type, args) in &cases {
                let mut input = json!({ "id": target, "version": before["version"] });
                if let (Some(input), Some(args)) = (input.as_object_mut(), args.as_object()) {
                    input.extend(args.clone());
                }
                let response = s
                    .gql(
                        Some(&token),
                        &format!("mutation($input: {input_type}!) {{ {field}(input: $input) {{ node {{ id version }} }} }}"),
                        json!({ "input": input }),
                    )
                    .await;
                assert_eq!(
                    response.code(),
                    Some("NOT_FOUND"),
                    "{field} on {target} ({:?}): {:#}",
                    s.backend,
                    response.body
                );
            }
            assert_eq!(crate::common::node(s, target).await, before, "{target} unchanged");
        }

        // The same token changes its own node.
        let response = s
            .gql(
                Some(&token),
                "mutation($id: ID!) { cordonNode(input: {id: $id, version: 1, reason: \"mine\"}) { node { version cordon { by } } } }",
                json!({ "id": w.a.node }),
            )
            .await;
        let cordoned = &response.data()["cordonNode"]["node"];
        assert_eq!(cordoned["version"], json!(2));
        assert_eq!(cordoned["cordon"]["by"], json!(format!("user:admin@{}", w.a.tenant)));
    })
    .await;
}

#[tokio::test]
async fn a_tenant_cannot_manage_tenants_sites_or_pools_or_enroll_elsewhere() {
    each_backend(async |s| {
        let w = world(s).await;
        // (what, mutation, variables, expected code)
        let cases: Vec<(&str, &str, Value, &str)> = vec![
            (
                "createSite CUSTOM for itself",
                "mutation($owner: ID) { createSite(input: {name: \"mine\", kind: CUSTOM, ownerTenantId: $owner}) { site { id } } }",
                json!({ "owner": w.a.tenant }),
                "FORBIDDEN",
            ),
            (
                "createSite PLATFORM",
                "mutation { createSite(input: {name: \"mine\", kind: PLATFORM}) { site { id } } }",
                json!({}),
                "FORBIDDEN",
            ),
            (
                "createTenant",
                "mutation { createTenant(input: {name: \"another\"}) { tenant { id } } }",
                json!({}),
                "FORBIDDEN",
            ),
            (
                "createPool on its own site",
                "mutation($site: ID!) { createPool(input: {siteId: $site, name: \"more\", kind: METAL_HOST}) { pool { id } } }",
                json!({ "site": w.a.site }),
                "FORBIDDEN",
            ),
            (
                "enrollNode on another tenant's site",
                "mutation($site: ID!, $pool: ID) { enrollNode(input: {siteId: $site, poolId: $pool, hostname: \"sneaky\"}) { node { id } } }",
                json!({ "site": w.b.site, "pool": w.b.pool }),
                "NOT_FOUND",
            ),
            (
                "enrollNode on a platform site",
                "mutation($site: ID!) { enrollNode(input: {siteId: $site, hostname: \"sneaky\"}) { node { id } } }",
                json!({ "site": w.platform_site }),
                "NOT_FOUND",
            ),
        ];
        for role in [Role::Operator, Role::Admin] {
            let token = tenant_token(s, &w.a.tenant, role);
            for (what, query, variables, code) in &cases {
                // Below admin, everything is FORBIDDEN whatever the target.
                let code = if role == Role::Admin { *code } else { "FORBIDDEN" };
                let response = s.gql(Some(&token), query, variables.clone()).await;
                assert_eq!(
                    response.code(),
                    Some(code),
                    "{what} as a tenant {role} ({:?}): {:#}",
                    s.backend,
                    response.body
                );
            }
        }
        let everything = s
            .admin("{ tenants { totalCount } sites { totalCount } pools { totalCount } }", json!({}))
            .await;
        assert_eq!(everything["tenants"]["totalCount"], 2);
        assert_eq!(everything["sites"]["totalCount"], 3);
        assert_eq!(everything["pools"]["totalCount"], 3);
        assert_eq!(listed(s, s.admin_token(), json!({})).await.len(), 3);
    })
    .await;
}

/// An introspection query `levels` fields deep.
fn nested(levels: usize) -> String {
    // `__type` > `fields` > `type` > `ofType`… > `name`
    let of_types = levels - 4;
    format!(
        "{{ __type(name: \"NodeDetail\") {{ fields {{ type {{ {}name{} }} }} }} }}",
        "ofType { ".repeat(of_types),
        " }".repeat(of_types)
    )
}

/// A limit refused the operation before it ran: an error naming it, not a 500.
#[track_caller]
fn assert_limited(response: &Gql, message: &str) {
    assert_eq!(response.status, 200, "{:#}", response.body);
    assert!(response.body["data"].is_null(), "{:#}", response.body);
    assert_eq!(
        response.error()["message"],
        json!(message),
        "{:#}",
        response.body
    );
    assert_eq!(
        response.code(),
        Some("BAD_USER_INPUT"),
        "{:#}",
        response.body
    );
}

#[tokio::test]
async fn query_depth_and_complexity_are_limited() {
    each_backend(async |s| {
        let token = s.token(Role::Viewer);
        // Introspection nests deeper than the API's own fields (graphql.introspection_max_depth).
        let at_limit = s.gql(Some(&token), &nested(20), json!({})).await;
        assert!(at_limit.data()["__type"]["fields"][0]["type"].is_object());
        let too_deep = s.gql(Some(&token), &nested(21), json!({})).await;
        assert_limited(
            &too_deep,
            "the query nests introspection fields 21 deep; the limit (graphql.introspection_max_depth) is 20",
        );
        let far_too_deep = s.gql(Some(&token), &nested(40), json!({})).await;
        assert_limited(
            &far_too_deep,
            "the query nests introspection fields 40 deep; the limit (graphql.introspection_max_depth) is 20",
        );

        // `first` multiplies the cost of what is under it.
        let fine = s
            .gql(
                Some(&token),
                "{ nodes(first: 1000) { nodes { id hostname } } }",
                json!({}),
            )
            .await;
        assert_eq!(fine.data()["nodes"]["nodes"], json!([]));
        for query in [
            "{ nodes(first: 1000) { nodes { id events(first: 1000) { nodes { id } } } } }",
            "{ nodes { nodes { events(first: 500) { nodes { id type } } } } }",
        ] {
            let response = s.gql(Some(&token), query, json!({})).await;
            assert_limited(&response, "Query is too complex.");
        }
    })
    .await;
}

#[tokio::test]
async fn page_arguments_out_of_range_are_bad_user_input() {
    each_backend(async |s| {
        let token = s.token(Role::Viewer);
        let place = crate::common::site_and_pool(s).await;
        let record = crate::common::node_record(s, &place, bc_core::axes::ProvisionState::Adopted);
        s.insert_node(&record).await;
        let id = record.id.as_str();
        // (query, whether it is accepted)
        let cases = [
            ("{ nodes(first: 1000) { totalCount } }", true),
            ("{ nodes(first: 0) { totalCount } }", true),
            ("{ nodes(first: 1001) { totalCount } }", false),
            ("{ nodes(first: 5000) { totalCount } }", false),
            ("{ nodes(first: -1) { totalCount } }", false),
            ("{ nodes(after: \"site_x\") { totalCount } }", false),
            (
                "{ nodes(filter: {siteId: [\"pool_x\"]}) { totalCount } }",
                false,
            ),
            (
                "query($id: ID!) { node(id: $id) { events(first: 1000) { nodes { id } } } }",
                true,
            ),
            (
                "query($id: ID!) { node(id: $id) { events(first: 1001) { nodes { id } } } }",
                false,
            ),
            (
                "query($id: ID!) { node(id: $id) { events(first: -5) { nodes { id } } } }",
                false,
            ),
            (
                "query($id: ID!) { node(id: $id) { events(after: \"evt_x\") { nodes { id } } } }",
                false,
            ),
        ];
        for (query, accepted) in cases {
            let response = s.gql(Some(&token), query, json!({ "id": id })).await;
            if accepted {
                response.data();
            } else {
                assert_eq!(
                    response.code(),
                    Some("BAD_USER_INPUT"),
                    "{query} ({:?}): {:#}",
                    s.backend,
                    response.body
                );
            }
        }
    })
    .await;
}

#[tokio::test]
async fn health_readiness_metrics_and_graphiql_are_served() {
    each_backend(async |s| {
        assert_eq!(s.get("/healthz").await, (200, "ok".to_owned()));
        assert_eq!(s.get("/readyz").await, (200, "ready".to_owned()));

        let viewer = s
            .gql(
                Some(&s.token(Role::Viewer)),
                "{ viewer { subject role tenantId } }",
                json!({}),
            )
            .await;
        assert_eq!(
            viewer.data()["viewer"],
            json!({ "subject": "test-viewer", "role": "viewer", "tenantId": null })
        );
        // A query that reads the database, so its statements are counted under `api`.
        s.gql(
            Some(&s.token(Role::Viewer)),
            "{ nodes(first: 1) { nodes { id } } }",
            json!({}),
        )
        .await
        .data();
        let (status, metrics) = s.get("/metrics").await;
        assert_eq!(status, 200);
        for needle in [
            "bc_graphql_requests_total",
            "operation=\"query:viewer\"",
            "bc_graphql_request_duration_seconds",
            "bc_db_pool_connections",
            // Every statement the store ran, by kind (README: "Profiling").
            "bc_db_statements_total{",
            "caller=\"api\"",
            "bc_db_statement_seconds",
        ] {
            assert!(
                metrics.contains(needle),
                "/metrics lacks {needle}:\n{metrics}"
            );
        }

        let (status, page) = s.get("/graphql").await;
        assert_eq!(status, 200);
        let lower = page.to_lowercase();
        assert!(
            lower.contains("<html") && lower.contains("graphiql"),
            "{page}"
        );
        assert!(page.contains("Better Compute GraphQL"), "{page}");
    })
    .await;
}
