//! `schedulableSql` (server/src/store/schedule_sql.rs) must agree with the Rust predicate
//! (`bc_core::schedule`) on both databases, for every input of the seven checks of
//! shared/seed/nodes.md "When a node is schedulable".
//!
//! - `sql_agrees_with_the_rust_predicate_on_generated_nodes`: a property test. Each case
//!   writes a batch of generated nodes to a real SQLite and a real PostgreSQL database and
//!   compares the SQL bucket and `schedulable` of every node with the Rust answer.
//! - `each_check_alone_sends_a_node_to_its_bucket`: one node per check (and per value that
//!   fails it) with every other check passing, plus nodes that pass on edge values; the SQL
//!   and the GraphQL filters `schedulable` and `bucket` must return exactly what Rust says.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::Actor;
use bc_core::axes::{
    Adapter, ConditionStatus, Connectivity, ProvisionState, Role, TaintEffect, Trust,
};
use bc_core::clock::Clock;
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_core::node::{NewNode, NodeRecord};
use bc_core::schedule::{CapacityBucket, Check, SCHEDULABLE_PROVISION_STATES, SchedulingFacts};
use bc_testing::{Backend, TestServer, each_backend};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Value, json};
use strum::IntoEnumIterator;

/// Nodes written per proptest case, on each backend.
const BATCH: usize = 256;
/// Proptest cases per run.
const CASES: u32 = 16;

/// Two tenants, a platform site, and pools with no owner, owned by A and owned by B: every
/// relation between a node's owner and its pool's owner (same, different, none).
struct World {
    tenants: [TenantId; 2],
    site: SiteId,
    /// Index 0: no owner; 1: tenant A; 2: tenant B.
    pools: [(PoolId, Option<TenantId>); 3],
}

impl World {
    /// Created through the API, as an operator would.
    async fn create(s: &TestServer) -> World {
        let a = create_tenant(s, "tenant-a").await;
        let b = create_tenant(s, "tenant-b").await;
        let site = s
            .admin(
                "mutation { createSite(input: {name: \"dc1\", kind: PLATFORM}) { site { id } } }",
                json!({}),
            )
            .await["createSite"]["site"]["id"]
            .as_str()
            .map(|id| SiteId::parse(id).expect("a site id"))
            .expect("createSite returns an id");
        let p0 = create_pool(s, &site, "platform", None).await;
        let pa = create_pool(s, &site, "owned-by-a", Some(&a)).await;
        let pb = create_pool(s, &site, "owned-by-b", Some(&b)).await;
        World {
            tenants: [a.clone(), b.clone()],
            site,
            pools: [(p0, None), (pa, Some(a)), (pb, Some(b))],
        }
    }

    fn tenant_a(&self) -> &TenantId {
        &self.tenants[0]
    }

    fn pool_owner(&self, node: &NodeRecord) -> Option<&TenantId> {
        let pool = node.pool_id.as_ref()?;
        self.pools
            .iter()
            .find(|(id, _)| id == pool)
            .and_then(|(_, owner)| owner.as_ref())
    }

    /// What the Rust predicate says about `node`.
    fn expected(&self, node: &NodeRecord) -> CapacityBucket {
        SchedulingFacts::of(node, self.pool_owner(node)).bucket()
    }
}

async fn create_tenant(s: &TestServer, name: &str) -> TenantId {
    let data = s
        .admin(
            "mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }",
            json!({ "name": name }),
        )
        .await;
    TenantId::parse(
        data["createTenant"]["tenant"]["id"]
            .as_str()
            .expect("a tenant id"),
    )
    .expect("valid")
}

async fn create_pool(
    s: &TestServer,
    site: &SiteId,
    name: &str,
    owner: Option<&TenantId>,
) -> PoolId {
    let data = s
        .admin(
            "mutation($site: ID!, $name: String!, $owner: ID) {
                createPool(input: {
                    siteId: $site, name: $name, kind: METAL_HOST, ownerTenantId: $owner
                }) { pool { id ownerTenantId } }
            }",
            json!({ "site": site.as_str(), "name": name, "owner": owner.map(TenantId::as_str) }),
        )
        .await;
    assert_eq!(
        data["createPool"]["pool"]["ownerTenantId"].as_str(),
        owner.map(TenantId::as_str)
    );
    PoolId::parse(
        data["createPool"]["pool"]["id"]
            .as_str()
            .expect("a pool id"),
    )
    .expect("valid")
}

/// The inputs of one generated node.
#[derive(Debug, Clone)]
struct NodeSpec {
    role: Role,
    trust: Trust,
    /// `None`, or an index into `World::tenants`.
    owner: Option<usize>,
    /// `None` (no pool), or an index into `World::pools`.
    pool: Option<usize>,
    maintenance: bool,
    cordoned: bool,
    provision_state: ProvisionState,
    observed_generation: i64,
    connectivity: Connectivity,
    /// Reach `connectivity` through `set_connectivity` (which keeps `unreachable` in
    /// `noScheduleReasons` for `unreachable` and `lost`) rather than by assignment.
    connectivity_by_transition: bool,
    /// Bits of [`REASON_SOURCES`] to apply.
    reasons: u8,
    gpu_count: i32,
}

/// What can change `noScheduleReasons`, and whether it adds a reason.
const REASON_SOURCES: [(&str, bool); 5] = [
    ("NoSchedule taint", true),
    ("PreferNoSchedule taint", false),
    ("NoSchedule condition true", true),
    ("NoSchedule condition false", false),
    ("drain (cordons too)", true),
];

/// Two times in three the value that passes, otherwise any value: so that every check, the later
/// ones included, is reached by a good share of the nodes.
fn mostly<T: Clone + std::fmt::Debug + 'static>(
    passing: &'static [T],
    all: &'static [T],
) -> impl Strategy<Value = T> {
    prop_oneof![
        2 => proptest::sample::select(passing),
        1 => proptest::sample::select(all)
    ]
}

fn node_spec() -> impl Strategy<Value = NodeSpec> {
    (
        mostly(&[Role::Host], Role::ALL),
        mostly(&[Trust::Platform], Trust::ALL),
        proptest::option::of(0usize..2),
        proptest::option::weighted(0.9, 0usize..3),
        proptest::bool::weighted(0.2),
        proptest::bool::weighted(0.2),
        mostly(SCHEDULABLE_PROVISION_STATES, ProvisionState::ALL),
        0i64..3,
        mostly(&[Connectivity::Connected], Connectivity::ALL),
        any::<bool>(),
        prop_oneof![Just(0u8), 0u8..(1 << REASON_SOURCES.len())],
        0i32..=8,
    )
        .prop_map(
            |(
                role,
                trust,
                owner,
                pool,
                maintenance,
                cordoned,
                provision_state,
                observed_generation,
                connectivity,
                connectivity_by_transition,
                reasons,
                gpu_count,
            )| NodeSpec {
                role,
                trust,
                owner,
                pool,
                maintenance,
                cordoned,
                provision_state,
                observed_generation,
                connectivity,
                connectivity_by_transition,
                reasons,
                gpu_count,
            },
        )
}

/// A node for `spec`, reaching its state through the transitions of `bc_core::node` where
/// there is one.
fn build(
    spec: &NodeSpec,
    world: &World,
    hostname: &str,
    now: chrono::DateTime<chrono::Utc>,
) -> NodeRecord {
    let who = Actor::User("proptest".into());
    let mut n = NodeRecord::new(
        NewNode {
            hostname: hostname.to_owned(),
            site_id: world.site.clone(),
            pool_id: spec.pool.map(|i| world.pools[i].0.clone()),
            owner_tenant_id: spec.owner.map(|i| world.tenants[i].clone()),
            role: spec.role,
            trust: spec.trust,
            adapter: Adapter::BcdV1,
            drivers: BTreeMap::new(),
            provision_state: spec.provision_state,
        },
        now,
    )
    .expect("a valid node");
    n.generation = spec.observed_generation.max(1);
    n.observed_generation = spec.observed_generation;
    if spec.maintenance {
        n.maintenance = true;
        n.maintenance_reason = Some("generated".into());
    }
    if spec.cordoned {
        n.cordon("generated", &who, now).expect("a valid cordon");
    }
    if spec.connectivity_by_transition {
        n.set_connectivity(
            spec.connectivity,
            &Actor::Controller("liveness".into()),
            now,
        );
    } else {
        n.connectivity = spec.connectivity;
    }
    let bit = |i: usize| spec.reasons & (1 << i) != 0;
    if bit(0) {
        n.taint("gpu-burn", "running", TaintEffect::NoSchedule, &who, now)
            .expect("a valid taint");
    }
    if bit(1) {
        n.taint("prefer-other", "", TaintEffect::PreferNoSchedule, &who, now)
            .expect("a valid taint");
    }
    let health = Actor::Controller("health".into());
    if bit(2) {
        n.set_condition(
            "GpuCountMismatch",
            ConditionStatus::True,
            "Expected8Got7",
            "7 of 8 GPUs",
            true,
            &health,
            now,
        )
        .expect("a valid condition");
    }
    if bit(3) {
        n.set_condition(
            "XidCritical",
            ConditionStatus::False,
            "NoXid",
            "",
            true,
            &health,
            now,
        )
        .expect("a valid condition");
    }
    if bit(4) {
        n.drain("generated", None, &who, now)
            .expect("a valid drain");
    }
    n.gpu_count = spec.gpu_count;
    n
}

/// Writes the batch and returns a line per node whose SQL bucket or `schedulable` differs
/// from the Rust predicate.
async fn disagreements(
    s: &TestServer,
    world: &World,
    specs: &[NodeSpec],
    case: usize,
) -> Vec<String> {
    let now = s.clock.now();
    let nodes: Vec<NodeRecord> = specs
        .iter()
        .enumerate()
        .map(|(i, spec)| build(spec, world, &format!("gen-{case}-{i}.example.com"), now))
        .collect();
    s.insert_nodes(&nodes).await;
    let sql = s
        .server
        .services
        .sql_buckets_for_tests()
        .await
        .unwrap_or_else(|err| panic!("the SQL buckets: {}", err.message()));
    let mut out = Vec::new();
    for (spec, node) in specs.iter().zip(&nodes) {
        let rust = world.expected(node);
        let rust_schedulable = rust == CapacityBucket::Schedulable;
        match sql.get(&node.id) {
            None => out.push(format!("{} is missing from sql_buckets", node.id)),
            Some(&(bucket, schedulable)) if bucket != rust || schedulable != rust_schedulable => {
                out.push(format!(
                    "SQL says {bucket} (schedulable: {schedulable}), Rust says {rust}: \
                     {spec:?}, reasons {:?}",
                    node.reason_keys()
                ));
            }
            Some(_) => {}
        }
    }
    out
}

#[test]
fn sql_agrees_with_the_rust_predicate_on_generated_nodes() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // One server (and database) per backend for the whole run; each case adds a batch.
    let fixtures: Vec<(TestServer, World)> = Backend::selected()
        .into_iter()
        .map(|backend| {
            rt.block_on(async {
                let s = TestServer::start(backend)
                    .await
                    .unwrap_or_else(|err| panic!("starting a {backend:?} test server: {err:#}"));
                let world = World::create(&s).await;
                (s, world)
            })
        })
        .collect();

    let mut runner = TestRunner::new(Config {
        cases: CASES,
        // There is no source file to persist to outside the `proptest!` macro; a failure
        // prints the disagreeing nodes instead.
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::cell::Cell::new(0usize);
    let mut checked: BTreeMap<String, (usize, BTreeMap<CapacityBucket, usize>)> = BTreeMap::new();
    let result = runner.run(&proptest::collection::vec(node_spec(), BATCH), |specs| {
        case.set(case.get() + 1);
        for (s, world) in &fixtures {
            let bad = rt.block_on(disagreements(s, world, &specs, case.get()));
            prop_assert!(
                bad.is_empty(),
                "{:?}: {} of {} nodes disagree:\n{}",
                s.backend,
                bad.len(),
                specs.len(),
                bad.join("\n")
            );
        }
        Ok(())
    });
    // Tally what the checked nodes covered (by the SQL answer, which matched Rust's for every
    // node, or `result` below fails the test first).
    for (s, _) in &fixtures {
        let entry = checked.entry(format!("{:?}", s.backend)).or_default();
        let all = rt.block_on(async {
            s.server
                .services
                .sql_buckets_for_tests()
                .await
                .unwrap_or_else(|err| panic!("the SQL buckets: {}", err.message()))
        });
        entry.0 = all.len();
        for (bucket, _) in all.values() {
            *entry.1.entry(*bucket).or_default() += 1;
        }
    }
    for (s, _) in fixtures {
        rt.block_on(s.stop());
    }
    if let Err(err) = result {
        panic!("{err}");
    }
    for (backend, (total, buckets)) in &checked {
        eprintln!("{backend}: {total} generated nodes checked, by bucket {buckets:?}");
        assert!(
            CapacityBucket::iter().all(|b| buckets.get(&b).copied().unwrap_or(0) > 0),
            "{backend}: the generator never reached some bucket: {buckets:?}"
        );
    }
}

/// A change to a node, given the world it lives in.
type Change = Box<dyn Fn(&mut NodeRecord, &World)>;

/// One row of the deterministic table: a change to a schedulable node and the checks it
/// must then fail (empty: it stays schedulable).
struct Case {
    name: String,
    change: Change,
    failing: Vec<Check>,
}

fn case(
    name: impl Into<String>,
    failing: &[Check],
    change: impl Fn(&mut NodeRecord, &World) + 'static,
) -> Case {
    Case {
        name: name.into(),
        change: Box::new(change),
        failing: failing.to_vec(),
    }
}

fn at() -> chrono::DateTime<chrono::Utc> {
    bc_core::clock::SystemClock.now()
}

fn who() -> Actor {
    Actor::User("alice".into())
}

fn cases() -> Vec<Case> {
    use Check::*;
    let mut cases = vec![
        case("schedulable as built", &[], |_, _| {}),
        case("tenant-owned in its owner's pool", &[], |n, _| {
            n.trust = Trust::TenantOwned
        }),
        case("deployed", &[], |n, _| {
            n.provision_state = ProvisionState::Deployed
        }),
        case("observedGeneration 2", &[], |n, _| {
            n.observed_generation = 2
        }),
        case("a PreferNoSchedule taint", &[], |n, _| {
            n.taint("soft", "", TaintEffect::PreferNoSchedule, &who(), at())
                .expect("valid");
        }),
        case("a NoSchedule condition that is false", &[], |n, _| {
            n.set_condition(
                "XidCritical",
                ConditionStatus::False,
                "NoXid",
                "",
                true,
                &who(),
                at(),
            )
            .expect("valid");
        }),
        case("a true condition without NoSchedule", &[], |n, _| {
            n.set_condition(
                "Overheating",
                ConditionStatus::True,
                "Hot",
                "",
                false,
                &who(),
                at(),
            )
            .expect("valid");
        }),
        case("reconnected after being unreachable", &[], |n, _| {
            n.set_connectivity(Connectivity::Unreachable, &who(), at());
            n.set_connectivity(Connectivity::Connected, &who(), at());
        }),
        case("uncordoned after a drain", &[], |n, _| {
            n.drain("x", None, &who(), at()).expect("valid");
            n.uncordon();
        }),
        case("tenant-controlled", &[TrustAllowsPool], |n, _| {
            n.trust = Trust::TenantControlled
        }),
        case(
            "tenant-owned in another tenant's pool",
            &[TrustAllowsPool],
            |n, w| {
                n.trust = Trust::TenantOwned;
                n.pool_id = Some(w.pools[2].0.clone());
            },
        ),
        case(
            "tenant-owned in a platform pool",
            &[TrustAllowsPool],
            |n, w| {
                n.trust = Trust::TenantOwned;
                n.pool_id = Some(w.pools[0].0.clone());
            },
        ),
        case("tenant-owned without a pool", &[TrustAllowsPool], |n, _| {
            n.trust = Trust::TenantOwned;
            n.pool_id = None;
        }),
        case(
            "tenant-owned without an owner",
            &[TrustAllowsPool],
            |n, _| {
                n.trust = Trust::TenantOwned;
                n.owner_tenant_id = None;
            },
        ),
        case(
            "tenant-owned, no owner, platform pool",
            &[TrustAllowsPool],
            |n, w| {
                n.trust = Trust::TenantOwned;
                n.owner_tenant_id = None;
                n.pool_id = Some(w.pools[0].0.clone());
            },
        ),
        case("in maintenance", &[InService], |n, _| n.maintenance = true),
        case("cordoned", &[InService], |n, _| {
            n.cordon("rack move", &who(), at()).expect("valid");
        }),
        case("observedGeneration 0", &[ConvergedFirstSpec], |n, _| {
            n.observed_generation = 0
        }),
        case("a NoSchedule taint", &[NoReasons], |n, _| {
            n.taint("gpu-burn", "", TaintEffect::NoSchedule, &who(), at())
                .expect("valid");
        }),
        case("a true NoSchedule condition", &[NoReasons], |n, _| {
            n.set_condition(
                "GpuCountMismatch",
                ConditionStatus::True,
                "Expected8Got7",
                "",
                true,
                &who(),
                at(),
            )
            .expect("valid");
        }),
        case("draining", &[InService, NoReasons], |n, _| {
            n.drain("firmware", None, &who(), at()).expect("valid");
        }),
        case("every check fails", &Check::ORDER, |n, _| {
            n.role = Role::Site;
            n.trust = Trust::TenantControlled;
            n.maintenance = true;
            n.provision_state = ProvisionState::Enrolling;
            n.observed_generation = 0;
            n.set_connectivity(Connectivity::Lost, &who(), at());
        }),
    ];
    for role in Role::ALL.iter().copied().filter(|r| *r != Role::Host) {
        cases.push(case(format!("role {role}"), &[RoleIsHost], move |n, _| {
            n.role = role
        }));
    }
    for state in ProvisionState::ALL
        .iter()
        .copied()
        .filter(|s| !SCHEDULABLE_PROVISION_STATES.contains(s))
    {
        cases.push(case(
            format!("provisionState {state}"),
            &[Provisioned],
            move |n, _| n.provision_state = state,
        ));
    }
    for to in [
        Connectivity::Disconnected,
        Connectivity::Unreachable,
        Connectivity::Lost,
    ] {
        cases.push(case(
            format!("connectivity {to} (assigned)"),
            &[Connected],
            move |n, _| n.connectivity = to,
        ));
        // Through the transition, `unreachable` and `lost` also add the `unreachable` reason.
        let failing: &[Check] = if to == Connectivity::Disconnected {
            &[Connected]
        } else {
            &[Connected, NoReasons]
        };
        cases.push(case(
            format!("connectivity {to} (transition)"),
            failing,
            move |n, _| {
                n.set_connectivity(to, &who(), at());
            },
        ));
    }
    cases
}

/// A node that passes every check: a converged, connected, adopted host in tenant A's pool,
/// owned by tenant A, `platform` trust.
fn schedulable_node(world: &World, hostname: &str) -> NodeRecord {
    let mut n = NodeRecord::new(
        NewNode {
            hostname: hostname.to_owned(),
            site_id: world.site.clone(),
            pool_id: Some(world.pools[1].0.clone()),
            owner_tenant_id: Some(world.tenant_a().clone()),
            role: Role::Host,
            trust: Trust::Platform,
            adapter: Adapter::BcdV1,
            drivers: BTreeMap::new(),
            provision_state: ProvisionState::Adopted,
        },
        at(),
    )
    .expect("a valid node");
    n.generation = 1;
    n.observed_generation = 1;
    n.connectivity = Connectivity::Connected;
    n.gpu_count = 8;
    n
}

/// The GraphQL spelling of a kebab-case enum value (`role-is-host` → `ROLE_IS_HOST`).
fn gql_enum(kebab: &str) -> String {
    kebab.replace('-', "_").to_uppercase()
}

/// The ids of the nodes `filter` selects, through the API; checks `totalCount` on the way.
async fn ids_matching(s: &TestServer, filter: Value) -> BTreeSet<String> {
    let data = s
        .admin(
            "query($f: NodeFilterInput) { nodes(filter: $f, first: 1000) {
                totalCount pageInfo { hasNextPage } edges { node { id } }
            } }",
            json!({ "f": filter }),
        )
        .await;
    let nodes = &data["nodes"];
    assert_eq!(nodes["pageInfo"]["hasNextPage"], json!(false));
    let ids: BTreeSet<String> = nodes["edges"]
        .as_array()
        .expect("edges")
        .iter()
        .map(|e| e["node"]["id"].as_str().expect("an id").to_owned())
        .collect();
    assert_eq!(
        nodes["totalCount"].as_u64(),
        Some(ids.len() as u64),
        "totalCount for {filter}"
    );
    ids
}

#[tokio::test]
async fn each_check_alone_sends_a_node_to_its_bucket() {
    each_backend(async |s| {
        let world = World::create(s).await;
        let cases = cases();
        let nodes: Vec<NodeRecord> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut n = schedulable_node(&world, &format!("case-{i}.example.com"));
                (c.change)(&mut n, &world);
                n
            })
            .collect();
        // The table itself: Rust fails exactly the listed checks.
        for (c, n) in cases.iter().zip(&nodes) {
            let explanation = SchedulingFacts::of(n, world.pool_owner(n)).explain();
            let failing: Vec<Check> = explanation.failing.iter().map(|f| f.check).collect();
            assert_eq!(failing, c.failing, "Rust, case `{}`", c.name);
            let bucket = c
                .failing
                .first()
                .map_or(CapacityBucket::Schedulable, |f| f.bucket());
            assert_eq!(explanation.bucket, bucket, "Rust, case `{}`", c.name);
        }
        s.insert_nodes(&nodes).await;

        // SQL: the bucket of the first failing check, and `schedulable` exactly when none fails.
        let sql = s
            .server
            .services
            .sql_buckets_for_tests()
            .await
            .unwrap_or_else(|err| panic!("the SQL buckets: {}", err.message()));
        for (c, n) in cases.iter().zip(&nodes) {
            let rust = world.expected(n);
            assert_eq!(
                sql.get(&n.id).copied(),
                Some((rust, rust == CapacityBucket::Schedulable)),
                "{:?}: SQL for case `{}`",
                s.backend,
                c.name
            );
        }

        // The API: each node's explanation, and the `schedulable` and `bucket` filters.
        let data = s
            .admin(
                "{ nodes(first: 1000) { edges { node {
                    id schedulability { schedulable bucket failingChecks { check } }
                } } } }",
                json!({}),
            )
            .await;
        let by_id: BTreeMap<&str, &Value> = data["nodes"]["edges"]
            .as_array()
            .expect("edges")
            .iter()
            .map(|e| {
                (
                    e["node"]["id"].as_str().expect("an id"),
                    &e["node"]["schedulability"],
                )
            })
            .collect();
        assert_eq!(by_id.len(), nodes.len());
        for (c, n) in cases.iter().zip(&nodes) {
            let checks: Vec<String> = c.failing.iter().map(|f| gql_enum(f.as_ref())).collect();
            assert_eq!(
                by_id.get(n.id.as_str()).copied(),
                Some(&json!({
                    "schedulable": c.failing.is_empty(),
                    "bucket": gql_enum(world.expected(n).as_ref()),
                    "failingChecks": checks
                        .iter()
                        .map(|c| json!({ "check": c }))
                        .collect::<Vec<_>>(),
                })),
                "{:?}: API explanation for case `{}`",
                s.backend,
                c.name
            );
        }
        let expect = |pred: &dyn Fn(CapacityBucket) -> bool| -> BTreeSet<String> {
            nodes
                .iter()
                .filter(|n| pred(world.expected(n)))
                .map(|n| n.id.to_string())
                .collect()
        };
        let schedulable = expect(&|b| b == CapacityBucket::Schedulable);
        assert_eq!(schedulable.len(), 9, "the table's schedulable rows");
        assert_eq!(
            ids_matching(s, json!({ "schedulable": true })).await,
            schedulable
        );
        assert_eq!(
            ids_matching(s, json!({ "schedulable": false })).await,
            expect(&|b| b != CapacityBucket::Schedulable)
        );
        for bucket in CapacityBucket::iter() {
            let want = expect(&|b| b == bucket);
            assert!(!want.is_empty(), "the table covers {bucket}");
            assert_eq!(
                ids_matching(s, json!({ "bucket": [gql_enum(bucket.as_ref())] })).await,
                want,
                "{:?}: bucket filter {bucket}",
                s.backend
            );
        }
        assert_eq!(
            ids_matching(s, json!({ "bucket": ["EXCLUDED", "UNHEALTHY"] })).await,
            expect(&|b| matches!(b, CapacityBucket::Excluded | CapacityBucket::Unhealthy))
        );
        // `bucket` and `schedulable` combine with "and".
        assert_eq!(
            ids_matching(
                s,
                json!({ "bucket": ["SCHEDULABLE", "MAINTENANCE"], "schedulable": false })
            )
            .await,
            expect(&|b| b == CapacityBucket::Maintenance)
        );
    })
    .await;
}
