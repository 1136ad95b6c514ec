//! The lock order of ARCHITECTURE.md's Invariants, driven step by step on PostgreSQL (issue
//! 17, item 6): real use cases interleaved by holding a lock they need (the event-order lock,
//! a session row) from a connection of the test's own, so that each takes its first locks
//! and then waits where the order says it may.
//!
//! A revoke (any change that replaces a node's identity closes the node's open session in
//! its transaction) races a session starting or ending on the same node:
//!
//! - the revoke locks the node row and waits for the event-order lock, held by the test;
//! - the session's transaction starts and waits behind the revoke;
//! - the test lets the event-order lock go.
//!
//! When the session's transaction takes the session row before the node row, and the revoke
//! takes the session row after the node row and the event-order lock, the two wait on each
//! other and PostgreSQL aborts one (`deadlock detected`, an `INTERNAL`). In one order (node,
//! session, …, the event-order lock last, at commit) the session waits for the revoke to
//! commit and then finds the identity replaced (`FORBIDDEN`) or the node still its own.
//!
//! Liveness, about to mark silent nodes `unreachable`, locks the nodes and then reads their
//! session rows (step 5) `FOR SHARE`: a heartbeat batch written but not yet committed holds
//! one of those rows, so the mark waits for it, then leaves that node alone and marks the
//! rest of its batch.
//!
//! A hello batch, and a batch of sessions' ends, write their session rows in node id order,
//! whatever order their requests came in, so a heartbeat batch (step 5 alone, in node id
//! order) on the same nodes waits for it or it for the heartbeats, never both.
//!
//! An enrolment of a machine (`enrollNode`) races the join of that machine's daemon. With the
//! identifiers the daemon reports, both lock the machine's hardware key (step 1), so the later
//! one finds the earlier one's node; without the enrolment's lock both found no node holding
//! the key and inserted one, and the later insert failed on the unique index of trusted keys
//! (an `INTERNAL`). With the subset of them a BMC reports, the two keys differ: the join waits
//! for the enrolment lock (exclusive for an enrolment, shared by joins) and then finds the
//! enrolled node by its identifiers; without that lock it inserted a second node. (An
//! enrolment by a BMC's identifiers that comes after the join is not recognised as the joined
//! machine: an enrolment compares identifiers with other enrolments' only, and a joined
//! node's are not stored.)
//!
//! SQLite has one writer at a time and no row locks: nothing to interleave there.

use bc_core::Actor;
use bc_core::axes::Connectivity;
use bc_core::ids::NodeId;
use bc_core::protocol::JoinRequest;
use bc_testing::daemon::key_and_csr;
use bc_testing::inventory::Machine;
use bc_testing::{Backend, TestServer};
use better_compute::controllers::liveness::{CAUSE_TIMEOUT, transition_request};
use better_compute::error::{ApiError, ApiResult};
use better_compute::pki::NodeIdentity;
use better_compute::service::Services;
use better_compute::service::liveness::{Candidate, SilentChange};
use better_compute::service::sessions::{Hello, OpenedSession};
use better_compute::service::test_support::EVENT_ORDER_LOCK;
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, TransactionTrait};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// Which of an enrolment and its machine's join starts first.
#[derive(Debug, Clone, Copy)]
enum StartsFirst {
    Enrolment,
    Join,
}

/// The identifiers an enrolment gives for its machine.
#[derive(Debug, Clone, Copy)]
enum EnrolledBy {
    /// Every identifier the daemon reports: the two compute one hardware key.
    TheDaemonsIdentifiers,
    /// The subset a BMC reports ([`Machine::bmc_identifiers`]): another key.
    TheBmcsIdentifiers,
}

/// What the session's side does while the revoke is under way.
#[derive(Debug, Clone, Copy)]
enum SessionStep {
    /// A daemon says hello again: a new session (epoch), `connected`.
    Opens,
    /// The node's open session ends: `disconnected`.
    Closes,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_racing_a_session_start_or_end_on_the_node_does_not_deadlock() {
    let Some(s) = postgres_server().await else {
        return;
    };
    let (site, pool) = s.site_and_pool(8).await;
    for (n, step) in [SessionStep::Opens, SessionStep::Closes]
        .into_iter()
        .enumerate()
    {
        let node = s.enroll(&site, &pool, &format!("race-{n}")).await;
        let id = node["id"].as_str().expect("a node id");
        race(&s, id, step).await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enrolment_racing_its_machines_join_leaves_one_node() {
    let Some(s) = postgres_server().await else {
        return;
    };
    for (seed, first, enrolled_by) in [
        (1, StartsFirst::Enrolment, EnrolledBy::TheDaemonsIdentifiers),
        (2, StartsFirst::Join, EnrolledBy::TheDaemonsIdentifiers),
        (3, StartsFirst::Enrolment, EnrolledBy::TheBmcsIdentifiers),
    ] {
        let case = format!("{first:?} first, enrolled by {enrolled_by:?}");
        // A pool of its own, whose nodes are the machine's.
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 10).await;
        let machine = Machine::new(seed, None, None);
        let conns = TestConnections::open(&s).await;
        let held = conns.hold_event_order_lock().await;

        let enrolment = || {
            let identifiers: Vec<Value> = match enrolled_by {
                EnrolledBy::TheDaemonsIdentifiers => {
                    machine.identifiers.clone().into_iter().collect()
                }
                EnrolledBy::TheBmcsIdentifiers => machine.bmc_identifiers(),
            }
            .into_iter()
            .map(|(name, value)| json!({ "name": name, "value": value }))
            .collect();
            tokio::spawn(gql(
                s.url(),
                s.admin_token().to_owned(),
                "mutation($input: EnrollNodeInput!) { enrollNode(input: $input) { node { id } } }",
                json!({ "input": { "siteId": site, "poolId": pool, "hostname": "bm-enrolled", "identifiers": identifiers } }),
            ))
        };
        let join = || {
            let services = s.server.services.clone();
            let (_, csr_pem) = key_and_csr(&machine.hostname).expect("a CSR");
            let request = JoinRequest {
                token: secret.clone(),
                csr_pem,
                hostname: machine.hostname.clone(),
                identifiers: machine.identifiers.clone(),
            };
            tokio::spawn(async move { services.join(&request).await })
        };
        // 1. The first looks for the machine's node, finds none, writes its own and waits for
        //    the event-order lock at its commit. 2. The second waits for the first.
        let (enrolled, joined) = match first {
            StartsFirst::Enrolment => {
                let enrolled = enrolment();
                s.wait_for_lock_waiters(&conns.watcher, "wait_event = 'advisory'", 1)
                    .await;
                let joined = join();
                s.wait_for_lock_waiters(&conns.watcher, "true", 2).await;
                (enrolled, joined)
            }
            StartsFirst::Join => {
                let joined = join();
                s.wait_for_lock_waiters(&conns.watcher, "wait_event = 'advisory'", 1)
                    .await;
                let enrolled = enrolment();
                s.wait_for_lock_waiters(&conns.watcher, "true", 2).await;
                (enrolled, joined)
            }
        };
        // 3. The event-order lock goes: the first commits, and the second finds its node.
        held.commit().await.expect("releasing the event-order lock");
        let enrolled = enrolled.await.expect("the enrolment");
        let joined = joined.await.expect("the join").unwrap_or_else(|e| {
            panic!(
                "{first:?} first: the join failed with {}: {}",
                e.code(),
                internal_detail(&e)
            )
        });
        match first {
            StartsFirst::Enrolment => {
                assert!(
                    enrolled.get("errors").is_none_or(Value::is_null),
                    "{case}: the enrolment failed: {enrolled}"
                );
                // The daemon took the enrolled node back, with the next identity generation.
                assert_eq!(
                    enrolled["data"]["enrollNode"]["node"]["id"],
                    joined.node_id.as_str()
                );
                assert_eq!(joined.identity_generation, 2);
            }
            StartsFirst::Join => {
                let error = &enrolled["errors"][0];
                assert_eq!(
                    error["extensions"]["code"], "BAD_USER_INPUT",
                    "{case}: {enrolled}"
                );
                let message = error["message"].as_str().unwrap_or_default();
                assert!(message.contains(&joined.node_id), "{enrolled}");
            }
        }
        let nodes_of_the_machine = s
            .admin(
                "query($pool: ID!) { nodes(first: 1, filter: {poolId: [$pool]}) { totalCount } }",
                json!({ "pool": pool }),
            )
            .await["nodes"]["totalCount"]
            .as_i64()
            .expect("a count");
        assert_eq!(nodes_of_the_machine, 1, "{case}");
        conns.close().await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_not_yet_committed_keeps_its_node_from_being_marked_unreachable() {
    let Some(s) = postgres_server().await else {
        return;
    };
    let services = s.server.services.clone();
    let (site, pool) = s.site_and_pool(8).await;
    // Two connected nodes: one whose heartbeat is under way when Liveness marks them, and
    // one whose daemon stays silent.
    let identities = connected_nodes(&s, &site, &pool, &["heard-late", "silent"], "gw-first").await;
    let (heard_late, silent_node) = (&identities[0].0.node_id, &identities[1].0.node_id);

    // Silent as of a cutoff a second ahead; the candidate query reads the nodes' versions.
    let cutoff = services.clock.now() + chrono::Duration::seconds(1);
    let candidates: Vec<Candidate> = services
        .silent_nodes(cutoff)
        .await
        .unwrap_or_else(|e| panic!("the silent nodes: {}", e.message()));
    assert_eq!(candidates.len(), 2, "both nodes are silent: {candidates:?}");
    let versions: BTreeMap<NodeId, i64> = candidates
        .iter()
        .map(|c| (c.node_id.clone(), c.version))
        .collect();

    // 1. A heartbeat batch writes the first node's `last_seen` past the cutoff, uncommitted.
    let conns = TestConnections::open(&s).await;
    let heartbeat = conns.holder.begin().await.expect("a transaction");
    heartbeat
        .execute_unprepared(&format!(
            "UPDATE node_sessions SET last_seen = '{}' WHERE node_id = '{}'",
            (cutoff + chrono::Duration::seconds(1)).to_rfc3339(),
            heard_late
        ))
        .await
        .expect("the heartbeat's write");

    // 2. The mark locks both nodes and waits for the first one's session row. It is asked
    //    for the nodes in the opposite order to their ids, the order it locks them in: each
    //    answer must be its own request's.
    let mark = tokio::spawn({
        let services = services.clone();
        let mut candidates = candidates;
        candidates.reverse();
        async move {
            let actor = Actor::Controller("liveness".into());
            let requests = candidates
                .iter()
                .map(|candidate| {
                    transition_request(&actor, candidate, Connectivity::Unreachable, CAUSE_TIMEOUT)
                })
                .collect();
            let changes = services.change_silent_nodes(cutoff, requests).await?;
            Ok::<_, ApiError>(candidates.into_iter().zip(changes).collect::<Vec<_>>())
        }
    });
    s.wait_for_lock_waiters(&conns.watcher, "true", 1).await;

    // 3. The heartbeat commits: the mark sees it and leaves that node alone, and marks the
    //    other one.
    heartbeat.commit().await.expect("the heartbeat's commit");
    let marked = mark
        .await
        .expect("the mark")
        .unwrap_or_else(|e| panic!("marking the nodes: {}", e.message()));
    for (candidate, change) in &marked {
        match change {
            SilentChange::HeardAgain => assert_eq!(&candidate.node_id, heard_late),
            SilentChange::Tried(outcome) => match &**outcome {
                Ok((after, _)) => {
                    assert_eq!(&candidate.node_id, silent_node);
                    assert_eq!(after.connectivity, Connectivity::Unreachable);
                }
                Err(e) => panic!("a mark was refused: {}", e.message()),
            },
        }
    }
    for (id, connectivity, version) in [
        (heard_late, Connectivity::Connected, versions[heard_late]),
        (
            silent_node,
            Connectivity::Unreachable,
            versions[silent_node] + 1,
        ),
    ] {
        let after = services
            .node_record(id)
            .await
            .unwrap_or_else(|e| panic!("reading the node: {}", e.message()))
            .expect("the node");
        assert_eq!(
            (after.connectivity, after.version),
            (connectivity, version),
            "{id}"
        );
    }
    conns.close().await;
    s.stop().await;
}

/// Which of the gateway's batches that write session rows races a heartbeat batch.
#[derive(Debug, Clone, Copy)]
enum SessionBatch {
    /// Daemons' hellos, on another replica (each node's second session).
    Hellos,
    /// The sessions' ends (their daemons left).
    Ends,
}

/// A batch that writes session rows and a heartbeat batch on the same two nodes (a replica
/// still flushing the beats of sessions whose daemons have said hello to another, or whose
/// daemons have left). The test holds the first node's session row so that:
///
/// - the heartbeat batch waits for it, holding nothing;
/// - the other batch locks the nodes, then waits for the first session row as well;
/// - the test lets the row go, and both batches commit.
///
/// A batch that wrote the session rows in its requests' order took the second node's row
/// before waiting for the first; the heartbeats, given the first, then waited for the
/// second: `deadlock detected`, one batch `INTERNAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_batch_and_a_heartbeat_batch_on_the_same_nodes_do_not_deadlock() {
    let Some(s) = postgres_server().await else {
        return;
    };
    for batch in [SessionBatch::Hellos, SessionBatch::Ends] {
        session_batch_against_heartbeats(&s, batch).await;
    }
    s.stop().await;
}

async fn session_batch_against_heartbeats(s: &TestServer, batch: SessionBatch) {
    let services = s.server.services.clone();
    let (site, pool) = s.site_and_pool(8).await;
    let names = [format!("{batch:?}-a"), format!("{batch:?}-b")];
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut identities = connected_nodes(s, &site, &pool, &names, "gw-leaving").await;
    identities.sort_by(|a, b| a.0.node_id.cmp(&b.0.node_id));
    let first = identities[0].0.node_id.clone();

    let conns = TestConnections::open(s).await;
    let held = conns.holder.begin().await.expect("a transaction");
    held.execute_unprepared(&format!(
        "SELECT 1 FROM node_sessions WHERE node_id = '{first}' FOR UPDATE"
    ))
    .await
    .expect("the first node's session row locked");

    // 1. The leaving replica's heartbeats, in node id order, wait for the first row.
    let beats: Vec<(NodeId, i64, chrono::DateTime<chrono::Utc>)> = identities
        .iter()
        .map(|(identity, epoch)| (identity.node_id.clone(), *epoch, services.clock.now()))
        .collect();
    let heartbeats = tokio::spawn({
        let services = services.clone();
        async move { services.record_heartbeats(&beats).await }
    });
    s.wait_for_lock_waiters(&conns.watcher, "true", 1).await;

    // 2. The other batch, naming the nodes in the other order.
    let reversed: Vec<(NodeIdentity, i64)> = identities.iter().rev().cloned().collect();
    let written = tokio::spawn({
        let services = services.clone();
        async move {
            match batch {
                SessionBatch::Hellos => {
                    let hellos: Vec<Hello> = reversed
                        .iter()
                        .map(|(identity, _)| Hello {
                            identity: identity.clone(),
                            inventory_hashes: BTreeMap::new(),
                            observed_generation: 0,
                        })
                        .collect();
                    let opened = services.open_sessions("gw-joining", &hellos).await?;
                    for answer in opened {
                        assert_eq!(answer?.epoch, 2, "each node's second session");
                    }
                }
                SessionBatch::Ends => {
                    let ended: Vec<(NodeId, i64)> = reversed
                        .iter()
                        .map(|(identity, epoch)| (identity.node_id.clone(), *epoch))
                        .collect();
                    services.end_sessions(&ended).await?;
                }
            }
            Ok::<_, ApiError>(())
        }
    });
    s.wait_for_lock_waiters(&conns.watcher, "true", 2).await;

    // 3. The row goes; both batches commit.
    held.commit().await.expect("letting the row go");
    let beaten = heartbeats.await.expect("the heartbeats");
    if let Err(e) = beaten {
        panic!("{batch:?}: the heartbeats: {}", internal_detail(&e));
    }
    let written = written.await.expect("the session batch");
    if let Err(e) = written {
        panic!("{batch:?}: the session batch: {}", internal_detail(&e));
    }
    if let SessionBatch::Ends = batch {
        for (identity, _) in &identities {
            let node = services
                .node_record(&identity.node_id)
                .await
                .unwrap_or_else(|e| panic!("reading the node: {}", e.message()))
                .expect("the node");
            assert_eq!(node.connectivity, Connectivity::Disconnected, "{batch:?}");
        }
    }
    conns.close().await;
}

/// A test server on PostgreSQL with its controllers stopped, so that nothing but the test's
/// own steps waits for a lock while the waiters are counted; or none when the run leaves
/// PostgreSQL out (these races need its row and advisory locks).
async fn postgres_server() -> Option<TestServer> {
    if !Backend::selected().contains(&Backend::Postgres) {
        return None;
    }
    let s = TestServer::start(Backend::Postgres)
        .await
        .expect("a PostgreSQL test server");
    s.server.stop_controllers().await;
    Some(s)
}

/// The test's own two connections to the server's database: `holder` holds, in a transaction
/// of its own, a lock the racing writers need; `watcher` counts who waits for a lock
/// ([`TestServer::wait_for_lock_waiters`]).
struct TestConnections {
    watcher: DatabaseConnection,
    holder: DatabaseConnection,
}

impl TestConnections {
    async fn open(s: &TestServer) -> TestConnections {
        TestConnections {
            watcher: s.single_connection().await,
            holder: s.single_connection().await,
        }
    }

    /// A transaction on `holder` holding the event-order lock, which every writer takes last,
    /// at its commit, until it ends.
    async fn hold_event_order_lock(&self) -> DatabaseTransaction {
        let held = self.holder.begin().await.expect("a transaction");
        held.execute_unprepared(&format!("SELECT pg_advisory_xact_lock({EVENT_ORDER_LOCK})"))
            .await
            .expect("the event-order lock");
        held
    }

    async fn close(self) {
        self.watcher.close().await.expect("closing");
        self.holder.close().await.expect("closing");
    }
}

/// Enrols a node for each of `names` and opens its session through `gateway_id`, as its
/// daemon's first `hello` would: each node's identity and its session's epoch, in `names`'
/// order.
async fn connected_nodes(
    s: &TestServer,
    site: &str,
    pool: &str,
    names: &[&str],
    gateway_id: &str,
) -> Vec<(NodeIdentity, i64)> {
    let mut nodes = Vec::new();
    for name in names {
        let node = s.enroll(site, pool, name).await;
        let identity = NodeIdentity {
            node_id: NodeId::parse(node["id"].as_str().expect("a node id")).expect("a node id"),
            identity_generation: 1,
        };
        let opened = open_session(&s.server.services, &identity, gateway_id)
            .await
            .unwrap_or_else(|e| panic!("opening a session: {}", e.message()));
        nodes.push((identity, opened.epoch));
    }
    nodes
}

/// What the gateway does with one daemon's `hello` (no inventory, nothing converged).
async fn open_session(
    services: &Services,
    identity: &NodeIdentity,
    gateway_id: &str,
) -> ApiResult<OpenedSession> {
    let hello = Hello {
        identity: identity.clone(),
        inventory_hashes: BTreeMap::new(),
        observed_generation: 0,
    };
    let mut answers = services.open_sessions(gateway_id, &[hello]).await?;
    answers.pop().expect("an answer for the one hello")
}

async fn race(s: &TestServer, id: &str, step: SessionStep) {
    let services = s.server.services.clone();
    let identity = NodeIdentity {
        node_id: NodeId::parse(id).expect("a node id"),
        identity_generation: 1,
    };
    // The node has an open session (epoch 1), as a connected node has.
    let open = open_session(&services, &identity, "gw-first")
        .await
        .unwrap_or_else(|e| panic!("opening the first session: {}", e.message()));

    let conns = TestConnections::open(s).await;
    let held = conns.hold_event_order_lock().await;

    // 1. The revoke locks the node and waits for the event-order lock.
    let version = node_version(s, id).await;
    let revoke = tokio::spawn(gql(
        s.url(),
        s.admin_token().to_owned(),
        "mutation($input: RevokeNodeIdentityInput!) { revokeNodeIdentity(input: $input) { node { identityGeneration } } }",
        json!({ "input": { "id": id, "version": version, "reason": "lock order" } }),
    ));
    s.wait_for_lock_waiters(&conns.watcher, "wait_event = 'advisory'", 1)
        .await;

    // 2. The session's transaction starts and waits behind the revoke.
    let session = tokio::spawn({
        let services = services.clone();
        let identity = NodeIdentity {
            node_id: identity.node_id.clone(),
            identity_generation: identity.identity_generation,
        };
        async move {
            match step {
                SessionStep::Opens => open_session(&services, &identity, "gw-second")
                    .await
                    .map(|_| ()),
                SessionStep::Closes => services
                    .end_sessions(&[(identity.node_id.clone(), open.epoch)])
                    .await
                    .map(|_| ()),
            }
        }
    });
    s.wait_for_lock_waiters(&conns.watcher, "true", 2).await;

    // 3. The event-order lock goes; both finish, in some order.
    held.commit().await.expect("releasing the event-order lock");
    let revoked = revoke.await.expect("the revoke");
    let session = session.await.expect("the session step");
    eprintln!(
        "{step:?}: revoke answered {revoked}; the session step: {:?}",
        session
            .as_ref()
            .map_err(|e| format!("{}: {}", e.code(), internal_detail(e)))
    );
    assert!(
        revoked.get("errors").is_none_or(Value::is_null),
        "{step:?}: the revoke failed: {revoked}"
    );
    assert_eq!(
        revoked["data"]["revokeNodeIdentity"]["node"]["identityGeneration"],
        2
    );
    match session {
        Ok(()) | Err(ApiError::Forbidden(_)) => {}
        Err(err) => panic!(
            "{step:?}: the session step failed with {}: {}",
            err.code(),
            internal_detail(&err)
        ),
    }
    conns.close().await;
}

/// The source of an internal error (`deadlock detected`, say), or the message.
fn internal_detail(err: &ApiError) -> String {
    match err {
        ApiError::Internal(source) => format!("{source:#}"),
        other => other.message(),
    }
}

async fn node_version(s: &TestServer, id: &str) -> i64 {
    s.admin(
        "query($id: ID!) { node(id: $id) { version } }",
        json!({ "id": id }),
    )
    .await["node"]["version"]
        .as_i64()
        .expect("a version")
}

/// One GraphQL operation over HTTP; the whole answer.
async fn gql(url: String, token: String, query: &'static str, variables: Value) -> Value {
    reqwest::Client::new()
        .post(format!("{url}/graphql"))
        .bearer_auth(token)
        .json(&json!({ "query": query, "variables": variables }))
        .send()
        .await
        .expect("the server answers")
        .json()
        .await
        .expect("a JSON answer")
}
