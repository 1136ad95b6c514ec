//! The batched writers: many node changes in one transaction
//! (`Services::apply_node_changes`, on `change_nodes_in`), and many daemons' hellos opened in
//! one (`Services::open_sessions`), and daemons' `converged` reports written together
//! (`Services::report_converged_many`), and inventory reports stored together
//! (`Services::store_inventory_reports`), and daemons' command reports and sessions' looks at
//! their commands (`Services::report_commands`, `Services::dispatch_many`), and joins
//! (`Services::join_many`); and connections' certificate checks read together
//! (`Services::check_identities`). Each request of a batch is answered as if it had been a
//! transaction of its own, and what a refused request asked for is not written.

use bc_core::Actor;
use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::command::{Command, CommandKind, CommandStatus, NewCommand, Outcome};
use bc_core::ids::{CommandId, NodeId};
use bc_core::node::NodeRecord;
use bc_core::protocol::{IssuedIdentity, JoinRequest};
use bc_core::provision::ProvisionMove;
use bc_entity::{node_device, node_inventory_section, node_session};
use bc_testing::inventory::Machine;
use bc_testing::{DaemonKnobs, TestServer, each_backend};
use better_compute::auth::{Principal, Role};
use better_compute::pki::NodeIdentity;
use better_compute::service::commands::{CommandProgress, CommandReport, DispatchLook};
use better_compute::service::inventory::ReportedSection;
use better_compute::service::node_changes::{NodeChangeRequest, NodeTransition};
use better_compute::service::sessions::Hello;
use chrono::{DateTime, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::EntityTrait;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

use crate::common::{event_summary, node, node_record, now, site_and_pool};
use crate::raw_daemon;

/// A request's answer: the node's version and how many changes, or the error's code.
type Answer = (NodeId, Result<(i64, usize), &'static str>);

/// What a request of the batch test asks of its node.
#[derive(Clone, Copy)]
enum Ask {
    Cordon,
    Label,
    /// A provision move the state table refuses from `adopted`.
    RefusedMove,
    /// A change that changes nothing.
    Nothing,
}

fn request(id: &NodeId, version: i64, ask: Ask) -> NodeChangeRequest<impl NodeTransition> {
    NodeChangeRequest {
        id: id.clone(),
        actor: Actor::Controller("batch-test".into()),
        expected_version: Some(version),
        cause: "test:batch".to_owned(),
        change: move |n: &mut NodeRecord, by: &Actor, at: DateTime<Utc>| match ask {
            Ask::Cordon => n.cordon("rack swap", by, at),
            Ask::Label => n.update_labels(
                &BTreeMap::from([("team".to_owned(), "vision".to_owned())]),
                &[],
            ),
            Ask::RefusedMove => n.apply_move(ProvisionMove::Adopt, None),
            Ask::Nothing => Ok(Vec::new()),
        },
    }
}

/// What the batches here could have changed of a node.
fn unchanged(
    n: &NodeRecord,
) -> (
    i64,
    bool,
    BTreeMap<String, String>,
    ProvisionState,
    Connectivity,
) {
    (
        n.version,
        n.cordoned(),
        n.labels.clone(),
        n.provision_state,
        n.connectivity,
    )
}

/// `count` adopted nodes in a new site and pool, each shaped by `shape`, written to storage.
async fn adopted_nodes(
    s: &TestServer,
    count: usize,
    shape: impl Fn(&mut NodeRecord),
) -> Vec<NodeRecord> {
    let site = site_and_pool(s).await;
    let nodes: Vec<NodeRecord> = (0..count)
        .map(|_| {
            let mut node = node_record(s, &site, ProvisionState::Adopted);
            shape(&mut node);
            node
        })
        .collect();
    s.insert_nodes(&nodes).await;
    nodes
}

/// How many rows of table `E` each node has, by node id (`node_id` reads a row's).
async fn rows_per_node<E: EntityTrait>(
    s: &TestServer,
    node_id: fn(E::Model) -> String,
) -> BTreeMap<String, usize> {
    let rows = E::find()
        .all(&s.database().await)
        .await
        .unwrap_or_else(|err| panic!("reading {}: {err}", E::default().table_name()));
    let mut counts = BTreeMap::new();
    for row in rows {
        *counts.entry(node_id(row)).or_insert(0) += 1;
    }
    counts
}

/// An adopted node that was deleted, written to storage.
async fn deleted_node(s: &TestServer) -> NodeRecord {
    let deleted_at = now(s);
    adopted_nodes(s, 1, |n| n.deleted_at = Some(deleted_at))
        .await
        .remove(0)
}

async fn record(s: &TestServer, id: &NodeId) -> NodeRecord {
    s.server
        .services
        .node_record(id)
        .await
        .unwrap_or_else(|err| panic!("reading node {id}: {}", err.message()))
        .unwrap_or_else(|| panic!("node {id} is stored"))
}

#[tokio::test]
async fn a_batch_of_node_changes_answers_each_request_and_writes_the_rest_together() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 5, |_| {}).await;
        let deleted = deleted_node(s).await;
        let [a, b, c, d, e] = [0, 1, 2, 3, 4].map(|i| nodes[i].id.clone());
        let missing = NodeId::generate();
        let v = nodes[0].version;

        let requests = vec![
            request(&a, v, Ask::Cordon),
            request(&b, v + 1, Ask::Cordon),
            request(&deleted.id, deleted.version, Ask::Cordon),
            request(&missing, 1, Ask::Cordon),
            request(&c, v, Ask::RefusedMove),
            // The second request for `a` is decided on the node the first one wrote.
            request(&a, v + 1, Ask::Label),
            request(&d, v, Ask::Nothing),
            request(&e, v, Ask::Label),
        ];
        let outcomes = s
            .server
            .services
            .apply_node_changes(requests)
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));

        let answers: Vec<Answer> = outcomes
            .iter()
            .map(|(id, outcome)| {
                let answer = match outcome {
                    Ok((after, changes)) => Ok((after.version, changes.len())),
                    Err(err) => Err(err.code()),
                };
                (id.clone(), answer)
            })
            .collect();
        assert_eq!(
            answers,
            vec![
                (a.clone(), Ok((v + 1, 1))),
                (b.clone(), Err("CONFLICT")),
                (deleted.id.clone(), Err("NOT_FOUND")),
                (missing.clone(), Err("NOT_FOUND")),
                (c.clone(), Err("INVALID_STATE")),
                (a.clone(), Ok((v + 2, 1))),
                (d.clone(), Ok((v, 0))),
                (e.clone(), Ok((v + 1, 1))),
            ],
            "each request answered in the order given"
        );

        // `a` carries both changes, in two versions with their own events; the label went
        // to its child table.
        let stored_a = record(s, &a).await;
        assert_eq!(stored_a.version, v + 2);
        assert!(stored_a.cordoned());
        assert_eq!(
            stored_a.labels.get("team").map(String::as_str),
            Some("vision")
        );
        let a_node = node(s, &a.to_string()).await;
        let summary = event_summary(&a_node);
        assert_eq!(
            summary.len(),
            2,
            "one for the cordon and one for the label: {summary:?}"
        );
        let versions: Vec<i64> = crate::common::events(&a_node)
            .iter()
            .map(|e| e["data"]["version"].as_i64().expect("an event's version"))
            .collect();
        assert_eq!(versions, vec![v + 1, v + 2]);
        // `e` was written by the same statements, and the refused ones not at all.
        let stored_e = record(s, &e).await;
        assert_eq!(stored_e.version, v + 1);
        assert_eq!(
            stored_e.labels.get("team").map(String::as_str),
            Some("vision")
        );
        for (id, original) in [(&b, &nodes[1]), (&c, &nodes[2]), (&d, &nodes[3])] {
            assert_eq!(
                unchanged(&record(s, id).await),
                unchanged(original),
                "node {id} is as it was"
            );
            assert!(event_summary(&node(s, &id.to_string()).await).is_empty());
        }
        assert_eq!(
            unchanged(&record(s, &deleted.id).await),
            unchanged(&deleted)
        );
    })
    .await;
}

fn hello(node: &NodeRecord, identity_generation: i64, sections: &[(&str, &str)]) -> Hello {
    Hello {
        identity: NodeIdentity {
            node_id: node.id.clone(),
            identity_generation,
        },
        inventory_hashes: sections
            .iter()
            .map(|(section, hash)| ((*section).to_owned(), (*hash).to_owned()))
            .collect(),
        observed_generation: 0,
    }
}

/// The certificate checks of a batch of connections: each answered in the order asked, a node
/// twice in one batch answered twice, and only a live node at the certificate's identity
/// generation passes.
#[tokio::test]
async fn certificate_checks_read_together_answer_each_connection() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 2, |_| {}).await;
        let replaced = adopted_nodes(s, 1, |n| n.identity_generation = 2)
            .await
            .remove(0);
        let deleted = deleted_node(s).await;
        let identity = |node: &NodeRecord, identity_generation: i64| NodeIdentity {
            node_id: node.id.clone(),
            identity_generation,
        };
        let never_joined = NodeIdentity {
            node_id: NodeId::generate(),
            identity_generation: 1,
        };
        let answers = s
            .server
            .services
            .check_identities(&[
                identity(&nodes[0], 1),
                identity(&replaced, 1),
                identity(&nodes[1], 1),
                identity(&deleted, deleted.identity_generation),
                never_joined,
                identity(&replaced, 2),
                identity(&nodes[0], 1),
            ])
            .await
            .unwrap_or_else(|err| panic!("checking certificates: {}", err.message()));
        let codes: Vec<&str> = answers
            .iter()
            .map(|answer| answer.as_ref().map_or_else(|err| err.code(), |()| "OK"))
            .collect();
        assert_eq!(
            codes,
            [
                "OK",
                "FORBIDDEN",
                "OK",
                "FORBIDDEN",
                "FORBIDDEN",
                "OK",
                "OK"
            ]
        );
        let replaced_message = answers[1]
            .as_ref()
            .expect_err("a replaced identity is refused")
            .message();
        assert!(
            replaced_message.contains("identity generation 1")
                && replaced_message.contains("is at 2"),
            "{replaced_message}"
        );
        let none = s
            .server
            .services
            .check_identities(&[])
            .await
            .unwrap_or_else(|err| panic!("checking no certificate: {}", err.message()));
        assert!(none.is_empty());
    })
    .await;
}

#[tokio::test]
async fn hellos_opened_together_each_get_their_own_session_and_a_refused_one_opens_nothing() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 3, |_| {}).await;
        let replaced = adopted_nodes(s, 1, |n| n.identity_generation = 2)
            .await
            .remove(0);
        let [fresh, returning, other] = [0, 1, 2].map(|i| &nodes[i]);
        let db = s.database().await;
        // `returning` had four sessions before, the last one closed; it stored two sections.
        node_session::Entity::insert(node_session::ActiveModel {
            node_id: Set(returning.id.to_string()),
            epoch: Set(4),
            gateway_id: Set("gw-old".to_owned()),
            connected_at: Set(now(s)),
            disconnected_at: Set(Some(now(s))),
            last_seen: Set(now(s)),
        })
        .exec_without_returning(&db)
        .await
        .expect("a closed session");
        node_inventory_section::Entity::insert_many(["gpus", "os"].map(|section| {
            node_inventory_section::ActiveModel {
                node_id: Set(returning.id.to_string()),
                section: Set(section.to_owned()),
                hash: Set(format!("{section}-1")),
                content: Set(json!({})),
                reported_at: Set(now(s)),
            }
        }))
        .exec_without_returning(&db)
        .await
        .expect("stored sections");

        let twice = s
            .server
            .services
            .open_sessions("gw-test", &[hello(fresh, 1, &[]), hello(fresh, 1, &[])])
            .await;
        assert!(twice.is_err(), "a batch names each node once");

        let answers = s
            .server
            .services
            .open_sessions(
                "gw-test",
                &[
                    hello(fresh, 1, &[("gpus", "gpus-1")]),
                    hello(&replaced, 1, &[]),
                    hello(returning, 1, &[("gpus", "gpus-1"), ("os", "os-2")]),
                    hello(other, 1, &[]),
                ],
            )
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));
        let summary: Vec<Result<(i64, Vec<String>), &str>> = answers
            .iter()
            .map(|answer| match answer {
                Ok(opened) => Ok((opened.epoch, opened.want_sections.clone())),
                Err(err) => Err(err.code()),
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                Ok((1, vec!["gpus".to_owned()])),
                Err("FORBIDDEN"),
                Ok((5, vec!["os".to_owned()])),
                Ok((1, vec![])),
            ]
        );

        for (node, epoch) in [(fresh, 1), (returning, 5), (other, 1)] {
            let stored = record(s, &node.id).await;
            assert_eq!(stored.connectivity, Connectivity::Connected);
            assert_eq!(stored.version, node.version + 1);
            let session = node_session::Entity::find_by_id(node.id.to_string())
                .one(&db)
                .await
                .expect("reading a session")
                .expect("an open session");
            assert_eq!(
                (
                    session.epoch,
                    session.gateway_id.as_str(),
                    session.disconnected_at
                ),
                (epoch, "gw-test", None)
            );
            let causes: Vec<String> =
                crate::common::events(&crate::common::node(s, &node.id.to_string()).await)
                    .iter()
                    .map(|e| e["cause"].as_str().unwrap_or_default().to_owned())
                    .collect();
            assert!(
                !causes.is_empty() && causes.iter().all(|c| *c == format!("session:{epoch}")),
                "node {}'s events name its session: {causes:?}",
                node.id
            );
        }
        // The refused hello opened no session and changed nothing.
        assert!(
            node_session::Entity::find_by_id(replaced.id.to_string())
                .one(&db)
                .await
                .expect("reading a session")
                .is_none()
        );
        assert_eq!(
            unchanged(&record(s, &replaced.id).await),
            unchanged(&replaced)
        );
    })
    .await;
}

#[tokio::test]
async fn convergence_reports_written_together_are_each_the_daemons_own() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 2, |n| n.generation = 2).await;
        let (x, y) = (&nodes[0], &nodes[1]);

        let answers = s
            .server
            .services
            .report_converged_many(&[(x.id.clone(), 2), (y.id.clone(), 5)])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));

        let codes: Vec<Result<(), &str>> = answers
            .iter()
            .map(|answer| answer.as_ref().map(|_| ()).map_err(|err| err.code()))
            .collect();
        assert_eq!(
            codes,
            vec![Ok(()), Err("BAD_USER_INPUT")],
            "generation 5 is not one the node ever had"
        );
        let stored = record(s, &x.id).await;
        assert_eq!(
            (stored.observed_generation, stored.version),
            (2, x.version + 1)
        );
        let events = crate::common::events(&node(s, &x.id.to_string()).await);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0]["actor"], json!(format!("node:{}", x.id)));
        assert_eq!(events[0]["cause"], json!("daemon:converged"));
        assert_eq!(unchanged(&record(s, &y.id).await), unchanged(y));
        assert_eq!(record(s, &y.id).await.observed_generation, 0);
    })
    .await;
}

#[tokio::test]
async fn inventory_reports_stored_together_refuse_a_malformed_one_whole() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 3, |_| {}).await;
        let deleted = deleted_node(s).await;
        // `twin` reports the same machine as `good` (the same identifiers, so the same
        // hardware key) in the same batch.
        let (good, bad, twin) = (&nodes[0], &nodes[1], &nodes[2]);
        let report = |seed: u64| -> Vec<ReportedSection> {
            let sections = Machine::new(seed, None, None).inventory(&DaemonKnobs::default());
            let hashes = bc_testing::inventory::hashes(&sections);
            sections
                .into_iter()
                .map(|(section, content)| ReportedSection {
                    hash: hashes[&section].clone(),
                    section,
                    content: content.to_string(),
                })
                .collect()
        };
        let mut malformed = report(2);
        for section in &mut malformed {
            if section.section == "gpus" {
                section.content = json!({ "devices": "not a list" }).to_string();
            }
        }

        let answers = s
            .server
            .services
            .store_inventory_reports(&[
                (good.id.clone(), report(1)),
                (bad.id.clone(), malformed),
                (deleted.id.clone(), report(3)),
                (twin.id.clone(), report(1)),
            ])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));

        let codes: Vec<Result<(), &str>> = answers
            .iter()
            .map(|answer| answer.as_ref().map(|_| ()).map_err(|err| err.code()))
            .collect();
        assert_eq!(
            codes,
            vec![Ok(()), Err("BAD_USER_INPUT"), Err("NOT_FOUND"), Ok(())]
        );
        let sections = rows_per_node::<node_inventory_section::Entity>(s, |row| row.node_id).await;
        let stored_for = |id: &NodeId| sections.get(&id.to_string()).copied().unwrap_or(0);
        assert_eq!(
            (
                stored_for(&good.id),
                stored_for(&bad.id),
                stored_for(&deleted.id),
                stored_for(&twin.id)
            ),
            (7, 0, 0, 7),
            "only the accepted reports' sections are stored"
        );
        let devices = rows_per_node::<node_device::Entity>(s, |row| row.node_id).await;
        let devices_of = |id: &NodeId| devices.get(&id.to_string()).copied().unwrap_or(0);
        assert_eq!(
            devices.values().sum::<usize>(),
            devices_of(&good.id) + devices_of(&twin.id),
            "devices for the accepted reports only"
        );
        let stored = record(s, &good.id).await;
        assert_eq!(stored.gpu_count as usize, devices_of(&good.id));
        assert!(devices_of(&good.id) > 0);
        assert!(
            stored.hardware_key.is_some() && stored.hardware_key_trusted,
            "the key from system and network, trusted"
        );
        // Of two nodes claiming one machine in a batch, the first holds the key trusted; the
        // second keeps it untrusted, as if the reports had come one after the other.
        let stored_twin = record(s, &twin.id).await;
        assert_eq!(stored_twin.hardware_key, stored.hardware_key);
        assert!(!stored_twin.hardware_key_trusted);
        assert_eq!(unchanged(&record(s, &bad.id).await), unchanged(bad));
        assert!(event_summary(&node(s, &bad.id.to_string()).await).is_empty());
    })
    .await;
}

/// A command queued by the test's controller for `node`.
async fn queued(s: &TestServer, node: &NodeRecord, kind: CommandKind) -> Command {
    let params = match kind {
        CommandKind::DiagNvml => json!({ "level": 1 }),
        _ => json!({}),
    };
    let new = NewCommand {
        kind,
        params,
        timeout: None,
        not_before: None,
        ttl: None,
        force: false,
    };
    s.server
        .services
        .queue_command_as(&Actor::Controller("batch-test".into()), node, new)
        .await
        .unwrap_or_else(|err| panic!("queueing {kind}: {}", err.message()))
}

async fn status_of(s: &TestServer, id: &CommandId) -> (CommandStatus, i32) {
    let admin = Principal {
        subject: "test-admin".into(),
        role: Role::Admin,
        tenant: None,
        expires_at: now(s) + chrono::Duration::days(1),
    };
    let command = s
        .server
        .services
        .command(&admin, id)
        .await
        .unwrap_or_else(|err| panic!("reading command {id}: {}", err.message()));
    (command.status, command.attempts)
}

/// `(type, actor)` of the node's command events, oldest first.
async fn command_events(s: &TestServer, node_record: &NodeRecord) -> Vec<(String, String)> {
    crate::common::events(&node(s, &node_record.id.to_string()).await)
        .iter()
        .filter(|e| {
            e["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("command."))
        })
        .map(|e| {
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            (text(&e["type"]), text(&e["actor"]))
        })
        .collect()
}

fn ids(commands: &[Command]) -> Vec<CommandId> {
    commands.iter().map(|c| c.id.clone()).collect()
}

/// Sessions' ends recorded together: each requeues the commands its own session had in
/// flight, and disconnects its node only if it was still the node's latest session, also when
/// a revoke of the node's identity closed the session's row first; an end recorded twice
/// changes nothing the second time.
#[tokio::test]
async fn session_ends_recorded_together_each_end_only_their_own_session() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 4, |_| {}).await;
        let (a, b, c, revoked) = (&nodes[0], &nodes[1], &nodes[2], &nodes[3]);
        let services = &s.server.services;
        let open = |node: &NodeRecord| {
            let hello = hello(node, 1, &[]);
            async move {
                services
                    .open_sessions("gw-test", &[hello])
                    .await
                    .and_then(|mut answers| answers.remove(0))
                    .unwrap_or_else(|err| panic!("opening a session: {}", err.message()))
                    .epoch
            }
        };
        let (a_epoch, b_epoch, c_first) = (open(a).await, open(b).await, open(c).await);
        let revoked_epoch = open(revoked).await;
        // `c` came back on a newer session before its first one's end was recorded.
        let c_second = open(c).await;
        assert!(c_second > c_first);
        // A command in flight in `a`'s session, one in `c`'s newer session, which the end of
        // `c`'s first session leaves alone, and one in the session of the node whose
        // identity is revoked next.
        let diag = queued(s, a, CommandKind::DiagNvml).await;
        let c_logs = queued(s, c, CommandKind::LogsCollect).await;
        let revoked_logs = queued(s, revoked, CommandKind::LogsCollect).await;
        let look = |node: &NodeRecord, epoch: i64| DispatchLook {
            node_id: node.id.clone(),
            epoch,
            in_flight: Vec::new(),
            spec_sent: node.generation,
        };
        services
            .dispatch_many(&[
                look(a, a_epoch),
                look(c, c_second),
                look(revoked, revoked_epoch),
            ])
            .await
            .unwrap_or_else(|err| panic!("dispatching: {}", err.message()));
        for command in [&diag, &c_logs, &revoked_logs] {
            assert_eq!(
                status_of(s, &command.id).await,
                (CommandStatus::Dispatched, 1)
            );
        }
        // The revoke closes the node's session row in its own transaction; the gateway
        // records the session's end after it.
        let revoked_at = now(s);
        let revoke = NodeChangeRequest {
            id: revoked.id.clone(),
            actor: Actor::Controller("batch-test".into()),
            expected_version: None,
            cause: "test:revoke".to_owned(),
            change: |n: &mut NodeRecord, _: &Actor, _: DateTime<Utc>| {
                n.revoke_identity("key leaked")
            },
        };
        let outcome = services
            .apply_node_changes(vec![revoke])
            .await
            .unwrap_or_else(|err| panic!("revoking: {}", err.message()))
            .remove(0)
            .1;
        assert!(outcome.is_ok(), "the revoke is written");
        s.clock.advance(chrono::Duration::seconds(5));
        let ended_at = now(s);

        let ended = [
            (a.id.clone(), a_epoch),
            (b.id.clone(), b_epoch),
            (c.id.clone(), c_first),
            (revoked.id.clone(), revoked_epoch),
        ];
        let answers = services
            .end_sessions(&ended)
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));
        let requeued: Vec<Vec<CommandId>> = answers.iter().map(|lost| ids(lost)).collect();
        assert_eq!(
            requeued,
            vec![
                vec![diag.id.clone()],
                Vec::new(),
                Vec::new(),
                vec![revoked_logs.id.clone()]
            ]
        );
        assert_eq!(status_of(s, &diag.id).await, (CommandStatus::Queued, 1));
        assert_eq!(
            status_of(s, &revoked_logs.id).await,
            (CommandStatus::Queued, 1)
        );
        assert_eq!(
            status_of(s, &c_logs.id).await,
            (CommandStatus::Dispatched, 1)
        );
        let mut connectivity = Vec::new();
        for node in &nodes {
            connectivity.push(record(s, &node.id).await.connectivity);
        }
        assert_eq!(
            connectivity,
            vec![
                Connectivity::Disconnected,
                Connectivity::Disconnected,
                Connectivity::Connected,
                Connectivity::Disconnected,
            ]
        );
        let sessions = node_session::Entity::find()
            .all(&s.database().await)
            .await
            .expect("reading the sessions");
        let closed = |node: &NodeRecord| {
            sessions
                .iter()
                .find(|row| row.node_id == node.id.to_string())
                .map(|row| (row.epoch, row.disconnected_at))
        };
        // The revoked node's row keeps the revoke's time.
        assert_eq!(
            nodes.iter().map(closed).collect::<Vec<_>>(),
            vec![
                Some((a_epoch, Some(ended_at))),
                Some((b_epoch, Some(ended_at))),
                Some((c_second, None)),
                Some((revoked_epoch, Some(revoked_at))),
            ]
        );

        let versions = [
            record(s, &a.id).await.version,
            record(s, &b.id).await.version,
        ];
        let again = services
            .end_sessions(&ended[..2])
            .await
            .unwrap_or_else(|err| panic!("the batch again: {}", err.message()));
        assert!(again.iter().all(Vec::is_empty));
        assert_eq!(
            [
                record(s, &a.id).await.version,
                record(s, &b.id).await.version
            ],
            versions
        );
    })
    .await;
}

#[tokio::test]
async fn sessions_looking_together_each_get_their_own_commands_stops_and_spec() {
    each_backend(async |s| {
        let nodes = adopted_nodes(s, 3, |n| n.generation = 3).await;
        let (a, b, c) = (&nodes[0], &nodes[1], &nodes[2]);
        let a_diag = queued(s, a, CommandKind::DiagNvml).await;
        let a_logs = queued(s, a, CommandKind::LogsCollect).await;
        let b_first = queued(s, b, CommandKind::DiagNvml).await;
        let b_second = queued(s, b, CommandKind::DiagNvml).await;
        let c_logs = queued(s, c, CommandKind::LogsCollect).await;
        let ghost = CommandId::generate();
        let look = |node: &NodeRecord, spec_sent: i64, in_flight: Vec<CommandId>| DispatchLook {
            node_id: node.id.clone(),
            epoch: 1,
            in_flight,
            spec_sent,
        };

        let answers = s
            .server
            .services
            .dispatch_many(&[
                look(a, 3, Vec::new()),
                look(b, 1, Vec::new()),
                look(b, 3, Vec::new()),
                look(c, 3, vec![ghost.clone()]),
            ])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));

        let seen: Vec<(Vec<CommandId>, Option<i64>, Vec<CommandId>)> = answers
            .iter()
            .map(|d| (d.stop.clone(), d.spec, ids(&d.send)))
            .collect();
        assert_eq!(
            seen,
            vec![
                // One command per free lane: the GPU lane's and the logs lane's.
                (Vec::new(), None, vec![a_diag.id.clone(), a_logs.id.clone()]),
                // Spec 1 was sent, the node is at 3; the oldest of the lane goes first...
                (Vec::new(), Some(3), vec![b_first.id.clone()]),
                // ...and the second look sees the lane the first one filled.
                (Vec::new(), None, Vec::new()),
                // A command in flight that is gone is stopped.
                (vec![ghost], None, vec![c_logs.id.clone()]),
            ]
        );
        assert_eq!(
            status_of(s, &a_diag.id).await,
            (CommandStatus::Dispatched, 1)
        );
        assert_eq!(status_of(s, &b_second.id).await, (CommandStatus::Queued, 0));

        let report = |node: &NodeRecord, id: &CommandId, progress: CommandProgress| CommandReport {
            node_id: node.id.clone(),
            id: id.clone(),
            progress,
        };
        let succeeded = CommandProgress::Finished {
            outcome: Outcome::Succeeded,
            exit_code: Some(0),
            output: "all GPUs passed".into(),
            result: None,
        };
        let answers = s
            .server
            .services
            .report_commands(&[
                report(a, &a_diag.id, CommandProgress::Started),
                report(b, &b_first.id, succeeded),
                // Another node's command: not this daemon's to report.
                report(a, &c_logs.id, CommandProgress::Started),
                // A command still queued cannot have started.
                report(b, &b_second.id, CommandProgress::Started),
            ])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));
        let codes = statuses_or_codes(&answers);
        assert_eq!(
            codes,
            vec![
                Ok(CommandStatus::Running),
                Ok(CommandStatus::Succeeded),
                Err("BAD_USER_INPUT"),
                Err("INVALID_STATE"),
            ]
        );
        assert_eq!(status_of(s, &a_diag.id).await, (CommandStatus::Running, 1));
        assert_eq!(
            status_of(s, &b_first.id).await,
            (CommandStatus::Succeeded, 1)
        );
        assert_eq!(
            status_of(s, &c_logs.id).await,
            (CommandStatus::Dispatched, 1)
        );
        assert_eq!(status_of(s, &b_second.id).await, (CommandStatus::Queued, 0));

        // One event per change, each by whoever made it: the controller queued, the gateway
        // dispatched, the daemon started.
        assert_eq!(
            command_events(s, a).await,
            vec![
                (
                    "command.queued".to_owned(),
                    "controller:batch-test".to_owned()
                ),
                (
                    "command.queued".to_owned(),
                    "controller:batch-test".to_owned()
                ),
                (
                    "command.dispatched".to_owned(),
                    "controller:gateway".to_owned()
                ),
                (
                    "command.dispatched".to_owned(),
                    "controller:gateway".to_owned()
                ),
                ("command.running".to_owned(), format!("node:{}", a.id)),
            ]
        );

        // A command started and finished in one batch: both written, one row, two events.
        let answers = s
            .server
            .services
            .report_commands(&[
                report(c, &c_logs.id, CommandProgress::Started),
                report(
                    c,
                    &c_logs.id,
                    CommandProgress::Finished {
                        outcome: Outcome::Failed,
                        exit_code: Some(2),
                        output: String::new(),
                        result: None,
                    },
                ),
            ])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));
        let codes = statuses_or_codes(&answers);
        assert_eq!(
            codes,
            vec![Ok(CommandStatus::Running), Ok(CommandStatus::Failed)]
        );
        assert_eq!(status_of(s, &c_logs.id).await, (CommandStatus::Failed, 1));
        let c_events = command_events(s, c).await;
        assert_eq!(
            c_events[c_events.len() - 2..].to_vec(),
            vec![
                ("command.running".to_owned(), format!("node:{}", c.id)),
                ("command.failed".to_owned(), format!("node:{}", c.id)),
            ]
        );

        // With its GPU lane free, b's next look dispatches the second diagnostic.
        let next = s
            .server
            .services
            .dispatch_many(&[look(b, 3, vec![b_first.id.clone()])])
            .await
            .unwrap_or_else(|err| panic!("the batch as a whole: {}", err.message()));
        assert_eq!(ids(&next[0].send), vec![b_second.id.clone()]);
        assert_eq!(
            next[0].stop,
            vec![b_first.id.clone()],
            "an ended command is stopped"
        );
    })
    .await;
}

/// Each answer of a batch of command reports: the command's status, or the error's code.
fn statuses_or_codes(
    answers: &[Result<Command, better_compute::error::ApiError>],
) -> Vec<Result<CommandStatus, &'static str>> {
    answers
        .iter()
        .map(|answer| answer.as_ref().map(|c| c.status).map_err(|err| err.code()))
        .collect()
}

/// A join of the batch tests: `machine` joining through `token` as `hostname`.
fn join_request(machine: &raw_daemon::Machine, token: &str, hostname: &str) -> JoinRequest {
    JoinRequest {
        token: token.to_owned(),
        csr_pem: machine.csr(),
        hostname: hostname.to_owned(),
        identifiers: machine.identifiers.clone(),
    }
}

/// Each answer of a batch of joins: the node id and identity generation, or the error's code.
fn joined_or_codes(
    answers: &[Result<IssuedIdentity, better_compute::error::ApiError>],
) -> Vec<Result<(String, i64), &'static str>> {
    answers
        .iter()
        .map(|answer| {
            answer
                .as_ref()
                .map(|issued| (issued.node_id.clone(), issued.identity_generation))
                .map_err(|err| err.code())
        })
        .collect()
}

/// How many joins the token `secret` has counted.
async fn token_uses(s: &TestServer, secret: &str) -> i64 {
    let (token_id, _) = secret.split_once('.').expect("a token is `<id>.<secret>`");
    let tokens = s
        .admin("{ joinTokens { nodes { id uses } } }", json!({}))
        .await;
    tokens["joinTokens"]["nodes"]
        .as_array()
        .expect("a list of tokens")
        .iter()
        .find(|token| token["id"] == token_id)
        .and_then(|token| token["uses"].as_i64())
        .unwrap_or_else(|| panic!("token {token_id} is listed: {tokens:#}"))
}

/// Joins written together (`Services::join_many`): each is answered as if it had been alone,
/// a refused one (before its transaction or inside it) writes nothing and spends nothing, a
/// machine joining twice in one batch is one node, and the token counts the admitted joins.
/// A batch needing more uses than its token has left is decided a join at a time.
#[tokio::test]
async fn a_batch_of_joins_answers_each_join_and_counts_the_token_once() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let (other_site, other_pool) = s.site_and_pool(8).await;
        let token = s.join_token(&site, Some(&pool), 10).await;
        let (token_id, _) = token.split_once('.').expect("a token is `<id>.<secret>`");
        let wrong_secret = format!("{token_id}.{}", "0".repeat(64));
        // A machine that joined another site before: a token of this site cannot take it.
        let elsewhere = raw_daemon::Machine::new();
        let elsewhere_token = s.join_token(&other_site, Some(&other_pool), 1).await;
        s.server
            .services
            .join(&join_request(&elsewhere, &elsewhere_token, "gpu-elsewhere"))
            .await
            .unwrap_or_else(|err| panic!("joining the other site: {}", err.message()));
        let nodes_before = raw_daemon::node_count(s).await;

        let (a, b) = (raw_daemon::Machine::new(), raw_daemon::Machine::new());
        let batch = [
            join_request(&a, &token, "gpu-a"),
            join_request(&b, &token, "-bad host-"),
            join_request(&b, &wrong_secret, "gpu-b"),
            join_request(&elsewhere, &token, "gpu-elsewhere"),
            join_request(&b, &token, "gpu-b"),
            // `a` again, as a daemon retrying a slow join: it takes back the node the first
            // join of the batch created, with the next identity generation.
            join_request(&a, &token, "gpu-a"),
        ];
        let answers = joined_or_codes(&s.server.services.join_many(&batch).await);
        let Ok((a_node, a_generation)) = answers[0].clone() else {
            panic!("a joined: {answers:?}")
        };
        let Ok((b_node, _)) = answers[4].clone() else {
            panic!("b joined: {answers:?}")
        };
        assert_eq!(
            answers,
            vec![
                Ok((a_node.clone(), a_generation)),
                Err("BAD_USER_INPUT"),
                Err("UNAUTHENTICATED"),
                Err("BAD_USER_INPUT"),
                Ok((b_node.clone(), 1)),
                Ok((a_node.clone(), a_generation + 1)),
            ],
            "each join answered in the order given"
        );
        assert_ne!(a_node, b_node);
        assert_eq!(raw_daemon::node_count(s).await, nodes_before + 2);
        assert_eq!(token_uses(s, &token).await, 3, "a, b and a's second join");

        // Two uses left for three new machines: the batch cannot take them all, so they
        // decide one at a time, in order, and the last is refused as used up.
        let scarce = s.join_token(&site, Some(&pool), 2).await;
        let machines = [
            raw_daemon::Machine::new(),
            raw_daemon::Machine::new(),
            raw_daemon::Machine::new(),
        ];
        let batch: Vec<JoinRequest> = machines
            .iter()
            .enumerate()
            .map(|(i, machine)| join_request(machine, &scarce, &format!("gpu-scarce-{i}")))
            .collect();
        let answers = s.server.services.join_many(&batch).await;
        let codes: Vec<Result<(), &str>> = answers
            .iter()
            .map(|answer| answer.as_ref().map(|_| ()).map_err(|err| err.code()))
            .collect();
        assert_eq!(codes, vec![Ok(()), Ok(()), Err("UNAUTHENTICATED")]);
        let refusal = answers[2].as_ref().err().map(|err| err.message());
        assert!(
            refusal.as_deref().is_some_and(|m| m.contains("used up")),
            "{refusal:?}"
        );
        assert_eq!(raw_daemon::node_count(s).await, nodes_before + 4);
        assert_eq!(token_uses(s, &scarce).await, 2);
    })
    .await;
}

/// Two batches of joins at once, as two replicas write them, sharing a machine and a token
/// with uses for one batch: exactly as many get in as the token has uses, the others are
/// refused as used up (the later batch finds the token used up when it counts its uses, or
/// already when it checks it), the shared machine is one node, and nothing refused is
/// written.
#[tokio::test]
async fn two_batches_of_joins_at_once_share_a_machine_and_a_scarce_token() {
    const USES: usize = 3;
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let token = s.join_token(&site, Some(&pool), USES as i64).await;
        let nodes_before = raw_daemon::node_count(s).await;
        let shared = raw_daemon::Machine::new();
        let [a, b, c, d] = std::array::from_fn(|_| raw_daemon::Machine::new());
        let first = [
            join_request(&shared, &token, "gpu-shared"),
            join_request(&a, &token, "gpu-a"),
            join_request(&b, &token, "gpu-b"),
        ];
        let second = [
            join_request(&shared, &token, "gpu-shared"),
            join_request(&c, &token, "gpu-c"),
            join_request(&d, &token, "gpu-d"),
        ];
        let services = &s.server.services;
        let (first, second) =
            futures::join!(services.join_many(&first), services.join_many(&second));

        let answers: Vec<_> = first.iter().chain(&second).collect();
        let admitted: Vec<&IssuedIdentity> = answers
            .iter()
            .filter_map(|answer| answer.as_ref().ok())
            .collect();
        assert_eq!(admitted.len(), USES, "{:?}", joined_or_codes(&first));
        for refusal in answers.iter().filter_map(|answer| answer.as_ref().err()) {
            assert_eq!(refusal.code(), "UNAUTHENTICATED", "{}", refusal.message());
            assert!(
                refusal.message().contains("used up"),
                "{}",
                refusal.message()
            );
        }
        let shared_nodes: BTreeSet<&str> = [&first[0], &second[0]]
            .into_iter()
            .filter_map(|answer| answer.as_ref().ok())
            .map(|issued| issued.node_id.as_str())
            .collect();
        assert!(
            shared_nodes.len() <= 1,
            "the shared machine is one node: {shared_nodes:?}"
        );
        let nodes: BTreeSet<&str> = admitted
            .iter()
            .map(|issued| issued.node_id.as_str())
            .collect();
        assert_eq!(
            raw_daemon::node_count(s).await,
            nodes_before + nodes.len() as u64
        );
        assert_eq!(token_uses(s, &token).await, USES as i64);
    })
    .await;
}
