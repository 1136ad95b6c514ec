//! Placement under concurrency (issue 13, item 9): placers, cordons, drains and `NoExecute`
//! taints at once, then the invariants read back from the tables and the event log, in one
//! snapshot:
//!
//! - **No atom is booked twice.** The active allocations' atoms of each node are disjoint, the
//!   `atom_bookings` rows are exactly those atoms, and replaying `allocation.booked` and
//!   `allocation.released` in event order never books an atom that is booked (nor releases
//!   one that is not), ending where the tables are.
//! - **A cordon that committed first wins.** No `allocation.booked` on a node comes (in event
//!   order, which is commit order) after a `node.cordoned` there that no `node.uncordoned`
//!   undid, nor while the node has a `noScheduleReasons` entry (a drain, a taint) that was
//!   not removed. The reservations here tolerate nothing.
//! - **Gangs are all or nothing.** A PLACED reservation has exactly `nodeCount` active
//!   allocations, on distinct nodes, with `gpusPerNode` atoms each; a PENDING, RELEASED or
//!   FAILED one has none.
//! - No API answer and no drain pass is `INTERNAL`, and PostgreSQL counted no deadlock.
//!
//! `many_placers_with_cordons_drains_and_taints_on_a_200_node_pool` is the load (64 placers);
//! `random_interleavings_keep_the_invariants` is a property test over small random
//! interleavings of the same operations on a 4-node pool. Both run on PostgreSQL, where
//! transactions really overlap, and on SQLite, whose single writer must keep them too.

use bc_core::clock::Clock;
use bc_core::ids::{NodeId, PoolId};
use bc_entity::{allocation, atom_booking, event, node, node_device, node_free_atom, reservation};
use bc_testing::{Backend, Gql, TestServer};
use better_compute::config::Config;
use better_compute::controllers::DrainController;
use futures::future::join_all;
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sea_orm::{
    AccessMode, ColumnTrait, ConnectionTrait, DatabaseTransaction, DbBackend, EntityTrait,
    IsolationLevel, QueryFilter, QueryOrder, QuerySelect, Statement, TransactionTrait,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::placement::{Setup, release, reserve, schedulable_nodes, setup};

/// The load: 64 placers on a 200-node pool of 8-GPU nodes.
const PLACERS: usize = 64;
const NODES: usize = 200;
const GPUS: usize = 8;
/// Creates and releases each placer makes.
const PLACER_OPS: usize = 12;
/// Reservations a placer holds (placed or pending) before it must release one: 64 placers
/// holding 6 reservations of 3.75 GPUs on average want about the pool's 1,600 GPUs, so the
/// run goes through both a pool with room and a full one, where reservations wait.
const MAX_HELD: usize = 6;
/// Of a placer's operations when it holds something, the share that releases.
const RELEASE_SHARE: f64 = 0.3;
/// Of creates, the share a client sends twice at once with one idempotency key (a retry
/// after a timeout while the first is still running).
const DOUBLE_SEND_SHARE: f64 = 0.05;
/// Operators cordoning, uncordoning, draining and tainting random nodes meanwhile.
const OPERATORS: usize = 4;
const OPERATOR_OPS: usize = 40;
/// The server's database pool for the load: more transactions overlap than with the default
/// 16, within what a shared PostgreSQL (100 connections) leaves other tests.
const LOAD_DB_CONNECTIONS: u32 = 24;
/// How often the drain controller's pass runs during the load, and how far the clock moves
/// before each pass, so drain deadlines (one to three minutes out) pass during the run.
const DRAIN_PASS_EVERY: Duration = Duration::from_millis(100);
const CLOCK_STEP: chrono::Duration = chrono::Duration::seconds(15);
/// Seeds of the load's random choices (per placer and operator: the seed plus its index).
const PLACER_SEED: u64 = 13_000;
const OPERATOR_SEED: u64 = 13_900;

/// The property test: cases, concurrent actors and steps per actor, and its small pool,
/// where every operation lands on nodes the others use too.
const CASES: u32 = 12;
const MAX_ACTORS: usize = 4;
const MAX_STEPS: usize = 5;
const CASE_NODES: usize = 4;
const CASE_GPUS: usize = 4;
/// How far a drain pass of the property test moves the clock first: past any deadline set
/// by an earlier step (they are at most three minutes out).
const CASE_CLOCK_STEP: chrono::Duration = chrono::Duration::minutes(4);

/// The key of the `NoExecute` taint the operators set; no reservation tolerates it.
const TAINT_KEY: &str = "evict";
/// A taint key no node ever has. Reservations tolerating it tolerate nothing that is set, so
/// the invariants are the same for them, but the placer checks their nodes' reasons one by
/// one (the reasons table) instead of the node row's empty list.
const UNUSED_TAINT_KEY: &str = "never-set";
/// How long a run waits for the servers' PostgreSQL backends to exit after a restart.
const BACKENDS_EXIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_placers_with_cordons_drains_and_taints_on_a_200_node_pool() {
    show_server_warnings();
    for backend in Backend::selected() {
        let s = TestServer::start_with(backend, |c: &mut Config| {
            c.database.max_connections = LOAD_DB_CONNECTIONS;
            // Every placer's and operator's request runs at once; they queue for connections.
            c.graphql.max_concurrent_requests = PLACERS + OPERATORS;
        })
        .await
        .unwrap_or_else(|err| panic!("starting a {backend:?} test server: {err:#}"));
        let deadlocks_before = s.postgres_deadlocks().await;
        let setup = setup(&s).await;
        let nodes = schedulable_nodes(&s, &setup, NODES, GPUS).await;
        let tally = Tally::default();
        let done = AtomicBool::new(false);
        let started = std::time::Instant::now();
        let work = async {
            let placers = join_all((0..PLACERS).map(|i| placer(&s, &setup, i, &tally)));
            let operators = join_all((0..OPERATORS).map(|i| operator(&s, &nodes, i, &tally)));
            tokio::join!(placers, operators);
            done.store(true, Ordering::Release);
        };
        tokio::join!(work, drain_passes(&s, &done, &tally));
        let took = started.elapsed();

        let ledger = check_invariants(&s, &setup.pool).await;
        eprintln!(
            "placement races, {backend:?}: {PLACERS} placers, {OPERATORS} operators, {NODES} nodes, {took:.1?}\n  answers: {:?}\n  {ledger:?}",
            tally.counts()
        );
        assert_eq!(ledger.violations, Vec::<String>::new(), "{backend:?}");
        assert_eq!(
            tally.internal(),
            Vec::<String>::new(),
            "{backend:?}: INTERNAL answers"
        );
        // The run did what it is for: bookings, and cordons among them.
        assert!(ledger.booked > PLACERS, "{backend:?}: {ledger:?}");
        assert!(ledger.cordons > 0, "{backend:?}: {ledger:?}");

        let (s, deadlocks) = deadlocks_of_the_run(s).await;
        assert_eq!(
            deadlocks
                .zip(deadlocks_before)
                .map(|(after, before)| after - before),
            Some(0).filter(|_| backend == Backend::Postgres),
            "{backend:?}: PostgreSQL's deadlock counter"
        );
        s.stop().await;
    }
}

/// An eviction and a release on one node, interleaved step by step on PostgreSQL (the lock
/// order of ARCHITECTURE.md's Invariants; the load above met this race). The node holds two
/// reservations, `first` and `second` in id order, and a `NoExecute` taint evicts both while
/// `second`'s owner releases it. The test holds the node's free-atom count row from a
/// connection of its own, so that:
///
/// - the taint locks the node and the reservations on it and waits for the count;
/// - the release starts, locks `second` (or waits for it) and waits behind the taint;
/// - the test lets the count go.
///
/// An eviction that locked `first`, released it (locking the count) and only then locked
/// `second` waited for the release, which waited for the count: `deadlock detected`, one of
/// them `INTERNAL`. Locking every reservation before any count, the taint evicts both and
/// the release, finding `second` moved on, is `CONFLICT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_racing_a_release_of_one_of_its_reservations_does_not_deadlock() {
    if !Backend::selected().contains(&Backend::Postgres) {
        return;
    }
    show_server_warnings();
    let s = TestServer::start(Backend::Postgres)
        .await
        .expect("a PostgreSQL test server");
    // No drain pass runs meanwhile. (The placement retry loop still runs, and finds nothing
    // pending: both reservations are placed, and the evicted ones wait for a pool's change.)
    s.server.stop_controllers().await;
    let setup = setup(&s).await;
    let node = schedulable_nodes(&s, &setup, 1, GPUS).await.remove(0);
    let mut placed = Vec::new();
    for _ in 0..2 {
        let answer = reserve(
            &s,
            &setup.token,
            json!({ "poolId": setup.pool.to_string(), "gpusPerNode": GPUS / 2 }),
        )
        .await;
        let reservation = answer.data()["createReservation"]["reservation"].clone();
        assert_eq!(reservation["state"], "PLACED", "{reservation:#}");
        placed.push(reservation);
    }
    placed.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    let second = &placed[1];

    let watcher = s.single_connection().await;
    let holder = s.single_connection().await;
    let held = holder.begin().await.expect("a transaction");
    held.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "SELECT node_id FROM node_free_atoms WHERE node_id = $1 FOR UPDATE",
        [node.to_string().into()],
    ))
    .await
    .expect("the node's count row locked");

    let (release_may_start, release_starts) = tokio::sync::oneshot::channel();
    let taint = s.gql(
        Some(s.admin_token()),
        "mutation($id: ID!) { taintNode(input: {id: $id, version: 1, key: \"evict\", value: \"x\", effect: NO_EXECUTE}) { node { version } } }",
        json!({ "id": node.to_string() }),
    );
    let release = async {
        release_starts.await.expect("the go-ahead");
        release(
            &s,
            &setup.token,
            second["id"].as_str().expect("an id"),
            second["version"].as_i64().expect("a version"),
        )
        .await
    };
    let interleave = async {
        s.wait_for_lock_waiters(&watcher, "query LIKE '%node_free_atoms%'", 1)
            .await;
        release_may_start.send(()).expect("the release waits");
        s.wait_for_lock_waiters(&watcher, "true", 2).await;
        held.commit().await.expect("letting the count go");
    };
    let (taint, release, ()) = tokio::join!(taint, release, interleave);
    assert_eq!(taint.code(), None, "the taint: {}", taint.error());
    assert_eq!(
        release.code(),
        Some("CONFLICT"),
        "the release: {}",
        release.error()
    );
    for reservation in &placed {
        let id = reservation["id"].as_str().expect("an id");
        let now = crate::placement::fetch(&s, &setup.token, id).await;
        assert_eq!(now["state"], "PENDING", "{now:#}");
    }
    s.stop().await;
}

/// The server's warnings and errors (why something was `INTERNAL`) show with a failure.
fn show_server_warnings() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// One of the load's placers: creates reservations of mixed shapes and releases them, holding
/// at most [`MAX_HELD`].
async fn placer(s: &TestServer, setup: &Setup, index: usize, tally: &Tally) {
    let mut rng = StdRng::seed_from_u64(PLACER_SEED + index as u64);
    let mut held: Vec<(String, i64)> = Vec::new();
    for op in 0..PLACER_OPS {
        if held.len() >= MAX_HELD || (!held.is_empty() && rng.random_bool(RELEASE_SHARE)) {
            let (id, version) = held.swap_remove(rng.random_range(0..held.len()));
            release_whatever_its_version(s, &setup.token, &id, version, tally).await;
            continue;
        }
        let mut input = random_shape(&mut rng);
        input["poolId"] = json!(setup.pool.to_string());
        let created = if rng.random_bool(DOUBLE_SEND_SHARE) {
            input["idempotencyKey"] = json!(format!("placer-{index}-{op}"));
            let (first, second) = tokio::join!(
                reserve(s, &setup.token, input.clone()),
                reserve(s, &setup.token, input.clone())
            );
            let first = tally.reservation("createReservation", &first);
            let second = tally.reservation("createReservation (same key)", &second);
            if let (Some(a), Some(b)) = (&first, &second) {
                assert_eq!(a["id"], b["id"], "one idempotency key, two reservations");
            }
            first.or(second)
        } else {
            tally.reservation("createReservation", &reserve(s, &setup.token, input).await)
        };
        if let Some(r) = created {
            held.push((id_of(&r), r["version"].as_i64().expect("a version")));
        }
    }
}

/// A reservation of 1, 2, 4 or 8 GPUs on one node, sometimes a gang of two or three nodes,
/// bin-packed or (a quarter) spread; half of them tolerate [`UNUSED_TAINT_KEY`].
fn random_shape(rng: &mut StdRng) -> Value {
    let gpus = [1, 2, 4, 8][rng.random_range(0..4)];
    let nodes = if rng.random_bool(0.125) {
        rng.random_range(2..=3)
    } else {
        1
    };
    let policy = if rng.random_bool(0.25) {
        "SPREAD"
    } else {
        "BIN_PACK"
    };
    let tolerations: &[&str] = if rng.random_bool(0.5) {
        &[UNUSED_TAINT_KEY]
    } else {
        &[]
    };
    json!({ "gpusPerNode": gpus, "nodeCount": nodes, "policy": policy, "tolerations": tolerations })
}

/// Releases a reservation, rereading its version after a `CONFLICT` (an eviction moved it);
/// one that ended meanwhile (`INVALID_STATE`) is left.
async fn release_whatever_its_version(
    s: &TestServer,
    token: &str,
    id: &str,
    mut version: i64,
    tally: &Tally,
) {
    loop {
        let answer = release(s, token, id, version).await;
        tally.record("releaseReservation", &answer);
        if answer.code() != Some("CONFLICT") {
            return;
        }
        version = answer.error()["extensions"]["currentVersion"]
            .as_i64()
            .expect("CONFLICT carries the current version");
    }
}

/// One of the load's operators: cordons, uncordons, drains (with and without a deadline),
/// taints `NoExecute` and untaints random nodes of the pool.
async fn operator(s: &TestServer, nodes: &[NodeId], index: usize, tally: &Tally) {
    let mut rng = StdRng::seed_from_u64(OPERATOR_SEED + index as u64);
    for _ in 0..OPERATOR_OPS {
        let node = &nodes[rng.random_range(0..nodes.len())];
        let action = match rng.random_range(0..10) {
            0..=2 => NodeAction::Cordon,
            3..=5 => NodeAction::Uncordon,
            6 => NodeAction::Drain { deadline: false },
            7 => NodeAction::Drain { deadline: true },
            8 => NodeAction::TaintNoExecute,
            _ => NodeAction::Untaint,
        };
        action.apply(s, node, tally).await;
    }
}

/// What an operator does to a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeAction {
    Cordon,
    Uncordon,
    /// With a deadline one to three minutes out, or none.
    Drain {
        deadline: bool,
    },
    TaintNoExecute,
    Untaint,
}

impl NodeAction {
    /// Reads the node's version and applies the action with it, as an operator's client
    /// would; a change in between is a `CONFLICT`, counted like any answer.
    async fn apply(self, s: &TestServer, node: &NodeId, tally: &Tally) {
        let version = s
            .admin(
                "query($id: ID!) { node(id: $id) { version } }",
                json!({ "id": node.to_string() }),
            )
            .await["node"]["version"]
            .as_i64()
            .expect("a node version");
        let id = node.to_string();
        let (operation, query, variables) = match self {
            NodeAction::Cordon => (
                "cordonNode",
                "mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: \"race\"}) { node { version } } }",
                json!({ "id": id, "v": version }),
            ),
            NodeAction::Uncordon => (
                "uncordonNode",
                "mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }",
                json!({ "id": id, "v": version }),
            ),
            NodeAction::Drain { deadline } => {
                let minutes = 1 + version % 3;
                let at = deadline
                    .then(|| (s.clock.now() + chrono::Duration::minutes(minutes)).to_rfc3339());
                (
                    "drainNode",
                    "mutation($id: ID!, $v: Int!, $at: DateTime) { drainNode(input: {id: $id, version: $v, reason: \"race\", deadline: $at}) { node { version } } }",
                    json!({ "id": id, "v": version, "at": at }),
                )
            }
            NodeAction::TaintNoExecute => (
                "taintNode",
                "mutation($id: ID!, $v: Int!, $key: String!) { taintNode(input: {id: $id, version: $v, key: $key, value: \"x\", effect: NO_EXECUTE}) { node { version } } }",
                json!({ "id": id, "v": version, "key": TAINT_KEY }),
            ),
            NodeAction::Untaint => (
                "untaintNode",
                "mutation($id: ID!, $v: Int!, $key: String!) { untaintNode(input: {id: $id, version: $v, key: $key}) { node { version } } }",
                json!({ "id": id, "v": version, "key": TAINT_KEY }),
            ),
        };
        let answer = s.gql(Some(s.admin_token()), query, variables).await;
        tally.record(operation, &answer);
    }
}

/// The drain controller's passes during the load, each after moving the clock, until `done`.
async fn drain_passes(s: &TestServer, done: &AtomicBool, tally: &Tally) {
    let mut drains = DrainController::new(s.server.services.clone());
    while !done.load(Ordering::Acquire) {
        s.clock.advance(CLOCK_STEP);
        drain_pass(&mut drains, tally).await;
        tokio::time::sleep(DRAIN_PASS_EVERY).await;
    }
}

async fn drain_pass(drains: &mut DrainController, tally: &Tally) {
    match drains.tick().await {
        // `failed` counts what the controller logged as neither a conflict nor a vanished
        // node: an internal error.
        Ok(report) if report.failed == 0 => tally.bump("drain pass", "ok"),
        Ok(report) => tally.internal_error("drain pass", format!("{report:?}")),
        Err(err) => tally.internal_error("drain pass", err.message()),
    }
}

/// Restarts the server so every PostgreSQL backend of the run exits (and reports its
/// statistics), then reads the deadlock counter.
async fn deadlocks_of_the_run(s: TestServer) -> (TestServer, Option<i64>) {
    let old = s.postgres_backends().await;
    let s = s.restart().await.expect("a restart");
    let deadline = tokio::time::Instant::now() + BACKENDS_EXIT;
    while s
        .postgres_backends()
        .await
        .iter()
        .any(|pid| old.contains(pid))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the run's PostgreSQL backends did not exit within {BACKENDS_EXIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadlocks = s.postgres_deadlocks().await;
    (s, deadlocks)
}

// ---------------------------------------------------------------------------------------------
// The property test.

/// One step of an actor in the property test.
#[derive(Debug, Clone)]
enum Step {
    Create {
        gpus: u32,
        nodes: u32,
        spread: bool,
    },
    /// Releases one of this actor's reservations (the `pick`-th, modulo how many it made).
    Release {
        pick: usize,
    },
    Node {
        node: usize,
        action: NodeAction,
    },
    /// Moves the clock past every drain deadline and runs a drain controller pass.
    DrainPass,
}

fn step() -> impl Strategy<Value = Step> {
    let node = 0..CASE_NODES;
    prop_oneof![
        3 => (prop::sample::select(vec![1u32, 2, 4]), 1u32..=2, any::<bool>())
            .prop_map(|(gpus, nodes, spread)| Step::Create { gpus, nodes, spread }),
        2 => any::<usize>().prop_map(|pick| Step::Release { pick }),
        1 => node.clone().prop_map(|node| Step::Node { node, action: NodeAction::Cordon }),
        1 => node.clone().prop_map(|node| Step::Node { node, action: NodeAction::Uncordon }),
        1 => (node.clone(), any::<bool>())
            .prop_map(|(node, deadline)| Step::Node { node, action: NodeAction::Drain { deadline } }),
        1 => node.clone().prop_map(|node| Step::Node { node, action: NodeAction::TaintNoExecute }),
        1 => node.prop_map(|node| Step::Node { node, action: NodeAction::Untaint }),
        1 => Just(Step::DrainPass),
    ]
}

/// Concurrent actors, each a sequence of steps.
fn interleaving() -> impl Strategy<Value = Vec<Vec<Step>>> {
    prop::collection::vec(prop::collection::vec(step(), 1..=MAX_STEPS), 2..=MAX_ACTORS)
}

#[test]
fn random_interleavings_keep_the_invariants() {
    show_server_warnings();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    // One server per backend for the whole run; each case has a pool, tenant and nodes of its
    // own, and the checks read only that pool.
    let servers: Vec<(TestServer, Option<i64>)> = Backend::selected()
        .into_iter()
        .map(|backend| {
            rt.block_on(async {
                let s = TestServer::start(backend)
                    .await
                    .unwrap_or_else(|err| panic!("starting a {backend:?} test server: {err:#}"));
                let deadlocks = s.postgres_deadlocks().await;
                (s, deadlocks)
            })
        })
        .collect();
    let mut runner = TestRunner::new(ProptestConfig {
        cases: CASES,
        // Outside the `proptest!` macro there is no source file to persist to; a failure
        // prints the interleaving instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&interleaving(), |actors| {
        for (s, _) in &servers {
            let (ledger, tally) = rt.block_on(run_interleaving(s, &actors));
            prop_assert_eq!(
                &ledger.violations,
                &Vec::<String>::new(),
                "{:?}: {:?}",
                s.backend,
                ledger
            );
            prop_assert_eq!(tally.internal(), Vec::<String>::new(), "{:?}", s.backend);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{failure}");
    }
    for (s, before) in servers {
        let backend = s.backend;
        let (s, after) = rt.block_on(deadlocks_of_the_run(s));
        assert_eq!(
            after.zip(before).map(|(a, b)| a - b),
            Some(0).filter(|_| backend == Backend::Postgres),
            "{backend:?}: PostgreSQL's deadlock counter"
        );
        rt.block_on(s.stop());
    }
}

/// Runs the actors of one case at once on a fresh pool and checks the invariants.
async fn run_interleaving(s: &TestServer, actors: &[Vec<Step>]) -> (Ledger, Tally) {
    let setup = setup(s).await;
    let nodes = schedulable_nodes(s, &setup, CASE_NODES, CASE_GPUS).await;
    let tally = Tally::default();
    join_all(
        actors
            .iter()
            .map(|steps| run_actor(s, &setup, &nodes, steps, &tally)),
    )
    .await;
    (check_invariants(s, &setup.pool).await, tally)
}

/// One actor of a case: its steps in order.
async fn run_actor(s: &TestServer, setup: &Setup, nodes: &[NodeId], steps: &[Step], tally: &Tally) {
    let mut made: Vec<String> = Vec::new();
    for step in steps {
        match step {
            Step::Create {
                gpus,
                nodes: node_count,
                spread,
            } => {
                let input = json!({
                    "poolId": setup.pool.to_string(),
                    "gpusPerNode": gpus,
                    "nodeCount": node_count,
                    "policy": if *spread { "SPREAD" } else { "BIN_PACK" },
                });
                let answer = reserve(s, &setup.token, input).await;
                if let Some(r) = tally.reservation("createReservation", &answer) {
                    made.push(id_of(&r));
                }
            }
            Step::Release { pick } => {
                if !made.is_empty() {
                    let id = &made[pick % made.len()];
                    let current = crate::placement::fetch(s, &setup.token, id).await;
                    let version = current["version"].as_i64().expect("a version");
                    release_whatever_its_version(s, &setup.token, id, version, tally).await;
                }
            }
            Step::Node { node, action } => action.apply(s, &nodes[*node], tally).await,
            Step::DrainPass => {
                s.clock.advance(CASE_CLOCK_STEP);
                drain_pass(&mut DrainController::new(s.server.services.clone()), tally).await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the API answered.

/// Answers by operation and outcome (`ok` or the error code), and the messages of
/// `INTERNAL` ones.
#[derive(Default)]
struct Tally {
    counts: Mutex<BTreeMap<(String, String), u64>>,
    internal: Mutex<Vec<String>>,
}

impl Tally {
    fn record(&self, operation: &str, answer: &Gql) {
        match answer.code() {
            None => self.bump(operation, "ok"),
            Some("INTERNAL") => self.internal_error(operation, answer.message().to_owned()),
            Some(code) => self.bump(operation, code),
        }
    }

    /// Records a create's answer and returns the reservation, if one came back.
    fn reservation(&self, operation: &str, answer: &Gql) -> Option<Value> {
        self.record(operation, answer);
        answer.code().is_none().then(|| {
            let r = answer.data()["createReservation"]["reservation"].clone();
            let state = format!("{operation}: {}", r["state"].as_str().unwrap_or("?"));
            self.bump(&state, "ok");
            r
        })
    }

    fn bump(&self, operation: &str, outcome: &str) {
        *self
            .counts
            .lock()
            .expect("the tally")
            .entry((operation.to_owned(), outcome.to_owned()))
            .or_default() += 1;
    }

    fn internal_error(&self, operation: &str, message: String) {
        self.bump(operation, "INTERNAL");
        self.internal
            .lock()
            .expect("the tally")
            .push(format!("{operation}: {message}"));
    }

    fn counts(&self) -> BTreeMap<(String, String), u64> {
        self.counts.lock().expect("the tally").clone()
    }

    fn internal(&self) -> Vec<String> {
        self.internal.lock().expect("the tally").clone()
    }
}

fn id_of(reservation: &Value) -> String {
    reservation["id"]
        .as_str()
        .expect("a reservation id")
        .to_owned()
}

// ---------------------------------------------------------------------------------------------
// The invariants.

/// What the checks found in one pool: counts, and every broken invariant in words.
#[derive(Debug, Default)]
#[allow(dead_code)] // Some counts are read only through `Debug`, in the printed figures.
struct Ledger {
    reservations: BTreeMap<String, usize>,
    /// The explanations of reservations still pending, with how many share each.
    pending_reasons: BTreeMap<String, usize>,
    /// `allocation.booked` events (each one allocation row).
    booked: usize,
    released: usize,
    active: usize,
    cordons: usize,
    evictions: usize,
    violations: Vec<String>,
}

impl Ledger {
    fn violation(&mut self, what: String) {
        self.violations.push(what);
    }
}

/// A read-only snapshot of the database: every table read in it is as of one moment, while
/// the placer's retry loop may still be at work.
async fn snapshot(s: &TestServer) -> DatabaseTransaction {
    let db = s.database().await;
    match s.backend {
        Backend::Postgres => db
            .begin_with_config(
                Some(IsolationLevel::RepeatableRead),
                Some(AccessMode::ReadOnly),
            )
            .await
            .expect("a snapshot"),
        // A read transaction in WAL mode is a snapshot from its first read on.
        Backend::Sqlite => db.begin().await.expect("a snapshot"),
    }
}

/// Reads the pool's reservations, allocations, bookings and its nodes' events in one
/// snapshot and checks the invariants of the module documentation.
async fn check_invariants(s: &TestServer, pool: &PoolId) -> Ledger {
    let txn = snapshot(s).await;
    let pool = pool.to_string();
    let nodes: Vec<String> = node::Entity::find()
        .select_only()
        .column(node::Column::Id)
        .filter(node::Column::PoolId.eq(pool.as_str()))
        .into_tuple()
        .all(&txn)
        .await
        .expect("the pool's nodes");
    let reservations = reservation::Entity::find()
        .filter(reservation::Column::PoolId.eq(pool.as_str()))
        .all(&txn)
        .await
        .expect("reservations");
    let allocations = allocation::Entity::find()
        .filter(allocation::Column::PoolId.eq(pool.as_str()))
        .all(&txn)
        .await
        .expect("allocations");
    let bookings = atom_booking::Entity::find()
        .filter(atom_booking::Column::NodeId.is_in(nodes.clone()))
        .all(&txn)
        .await
        .expect("atom bookings");
    let healthy: Vec<(String, String)> = node_device::Entity::find()
        .select_only()
        .column(node_device::Column::NodeId)
        .column(node_device::Column::Atom)
        .filter(node_device::Column::NodeId.is_in(nodes.clone()))
        .filter(node_device::Column::Healthy.eq(true))
        .into_tuple()
        .all(&txn)
        .await
        .expect("devices");
    let free_index: BTreeMap<String, i64> = node_free_atom::Entity::find()
        .filter(node_free_atom::Column::NodeId.is_in(nodes.clone()))
        .all(&txn)
        .await
        .expect("the placer's free-atom index")
        .into_iter()
        .map(|row| (row.node_id, row.free))
        .collect();
    let events = event::Entity::find()
        .filter(event::Column::NodeId.is_in(nodes))
        .filter(event::Column::EventType.is_in([
            "node.cordoned",
            "node.uncordoned",
            "node.no_schedule_reason_added",
            "node.no_schedule_reason_removed",
            "allocation.booked",
            "allocation.released",
        ]))
        .order_by_asc(event::Column::Seq)
        .all(&txn)
        .await
        .expect("events");
    let evictions = event::Entity::find()
        .filter(event::Column::EventType.eq("reservation.evicted"))
        .filter(event::Column::Cause.is_in(reservations.iter().map(|r| r.id.clone())))
        .all(&txn)
        .await
        .expect("eviction events")
        .len();
    txn.commit().await.expect("ending the snapshot");

    let mut ledger = Ledger {
        evictions,
        ..Ledger::default()
    };
    check_tables(&mut ledger, &reservations, &allocations, &bookings);
    check_free_index(&mut ledger, &healthy, &bookings, &free_index);
    check_event_order(&mut ledger, &events, &allocations);
    ledger
}

fn atoms_of(value: &Value) -> Vec<String> {
    serde_json::from_value(value.clone()).expect("atoms are a list of strings")
}

/// The placer's index (`node_free_atoms`) counts exactly each node's healthy atoms that are
/// not booked.
fn check_free_index(
    ledger: &mut Ledger,
    healthy: &[(String, String)],
    bookings: &[atom_booking::Model],
    index: &BTreeMap<String, i64>,
) {
    let booked: std::collections::BTreeSet<(&str, &str)> = bookings
        .iter()
        .map(|b| (b.node_id.as_str(), b.atom.as_str()))
        .collect();
    let mut counted: BTreeMap<String, i64> = BTreeMap::new();
    for (node, atom) in healthy {
        let free = counted.entry(node.clone()).or_default();
        if !booked.contains(&(node.as_str(), atom.as_str())) {
            *free += 1;
        }
    }
    if &counted != index {
        ledger.violation(format!(
            "node_free_atoms is not the count of free healthy atoms: index {index:?}, counted {counted:?}"
        ));
    }
}

/// Double booking and gangs, from the tables.
fn check_tables(
    ledger: &mut Ledger,
    reservations: &[reservation::Model],
    allocations: &[allocation::Model],
    bookings: &[atom_booking::Model],
) {
    let mut owner: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut active_of: HashMap<&str, Vec<&allocation::Model>> = HashMap::new();
    for a in allocations.iter().filter(|a| a.released_at.is_none()) {
        ledger.active += 1;
        active_of
            .entry(a.reservation_id.as_str())
            .or_default()
            .push(a);
        for atom in atoms_of(&a.atoms) {
            if let Some(other) = owner.insert((a.node_id.clone(), atom.clone()), a.id.clone()) {
                ledger.violation(format!(
                    "atom {atom} of {} is in two active allocations: {other} and {}",
                    a.node_id, a.id
                ));
            }
        }
    }
    let booked: BTreeMap<(String, String), String> = bookings
        .iter()
        .map(|b| ((b.node_id.clone(), b.atom.clone()), b.allocation_id.clone()))
        .collect();
    if booked != owner {
        ledger.violation(format!(
            "atom_bookings ({} rows) are not the active allocations' atoms ({})",
            booked.len(),
            owner.len()
        ));
    }
    for r in reservations {
        *ledger.reservations.entry(r.state.clone()).or_default() += 1;
        if r.state == "pending" {
            let reason = r.reason.clone().unwrap_or_default();
            *ledger.pending_reasons.entry(reason).or_default() += 1;
        }
        let active = active_of.remove(r.id.as_str()).unwrap_or_default();
        let distinct: BTreeSet<&str> = active.iter().map(|a| a.node_id.as_str()).collect();
        let expected = if r.state == "placed" {
            usize::try_from(r.node_count).expect("a node count")
        } else {
            0
        };
        if active.len() != expected || distinct.len() != active.len() {
            ledger.violation(format!(
                "{} reservation {} ({} × {} GPUs) has {} active allocations on {} nodes",
                r.state,
                r.id,
                r.node_count,
                r.gpus_per_node,
                active.len(),
                distinct.len()
            ));
        }
        for a in active {
            let gpus = atoms_of(&a.atoms).len();
            if i32::try_from(gpus).ok() != Some(r.gpus_per_node) {
                ledger.violation(format!(
                    "allocation {} of {} has {gpus} atoms, not {}",
                    a.id, r.id, r.gpus_per_node
                ));
            }
        }
    }
    for orphan in active_of.keys() {
        ledger.violation(format!(
            "active allocations of unknown reservation {orphan}"
        ));
    }
}

/// Double booking and "a cordon that committed first wins", from the event log in order.
fn check_event_order(
    ledger: &mut Ledger,
    events: &[event::Model],
    allocations: &[allocation::Model],
) {
    #[derive(Default)]
    struct NodeState {
        cordoned: bool,
        reasons: BTreeSet<String>,
        /// Booked atom → allocation.
        booked: BTreeMap<String, String>,
        /// The last `node.cordoned` not undone, for messages.
        cordoned_at: Option<i64>,
    }
    let mut nodes: HashMap<String, NodeState> = HashMap::new();
    for e in events {
        let node_id = e.node_id.clone().expect("a node event has a node");
        let state = nodes.entry(node_id.clone()).or_default();
        let allocation = || {
            e.data["allocationId"]
                .as_str()
                .expect("an allocation event names its allocation")
                .to_owned()
        };
        match e.event_type.as_str() {
            "node.cordoned" => {
                ledger.cordons += 1;
                state.cordoned = true;
                state.cordoned_at = Some(e.seq);
            }
            "node.uncordoned" => {
                state.cordoned = false;
                state.cordoned_at = None;
            }
            "node.no_schedule_reason_added" => {
                state.reasons.extend(e.to_value.clone());
            }
            "node.no_schedule_reason_removed" => {
                if let Some(reason) = &e.from_value {
                    state.reasons.remove(reason);
                }
            }
            "allocation.booked" => {
                ledger.booked += 1;
                if state.cordoned {
                    ledger.violation(format!(
                        "event {}: {} booked on {node_id}, cordoned since event {:?}",
                        e.seq,
                        allocation(),
                        state.cordoned_at
                    ));
                }
                if !state.reasons.is_empty() {
                    ledger.violation(format!(
                        "event {}: {} booked on {node_id} while its noScheduleReasons were {:?}",
                        e.seq,
                        allocation(),
                        state.reasons
                    ));
                }
                for atom in atoms_of(&e.data["atoms"]) {
                    if let Some(other) = state.booked.insert(atom.clone(), allocation()) {
                        ledger.violation(format!(
                            "event {}: {} booked {atom} of {node_id}, booked by {other}",
                            e.seq,
                            allocation()
                        ));
                    }
                }
            }
            "allocation.released" => {
                ledger.released += 1;
                for atom in atoms_of(&e.data["atoms"]) {
                    if state.booked.remove(&atom).as_deref() != Some(allocation().as_str()) {
                        ledger.violation(format!(
                            "event {}: {} released {atom} of {node_id}, which it had not booked",
                            e.seq,
                            allocation()
                        ));
                    }
                }
            }
            other => unreachable!("not selected: {other}"),
        }
    }
    // The log ends where the tables are: one `allocation.booked` per allocation row, one
    // `allocation.released` per released one, and the same atoms booked.
    let released = allocations
        .iter()
        .filter(|a| a.released_at.is_some())
        .count();
    if (ledger.booked, ledger.released) != (allocations.len(), released) {
        ledger.violation(format!(
            "{} allocation.booked and {} allocation.released events for {} allocations, {} released",
            ledger.booked,
            ledger.released,
            allocations.len(),
            released
        ));
    }
    let replayed: BTreeSet<(String, String, String)> = nodes
        .into_iter()
        .flat_map(|(node, state)| {
            state
                .booked
                .into_iter()
                .map(move |(atom, allocation)| (node.clone(), atom, allocation))
        })
        .collect();
    let stored: BTreeSet<(String, String, String)> = allocations
        .iter()
        .filter(|a| a.released_at.is_none())
        .flat_map(|a| {
            atoms_of(&a.atoms)
                .into_iter()
                .map(|atom| (a.node_id.clone(), atom, a.id.clone()))
        })
        .collect();
    if replayed != stored {
        ledger.violation(format!(
            "replaying the events books {} atoms; the active allocations hold {}",
            replayed.len(),
            stored.len()
        ));
    }
}
