//! The Liveness and drain-deadline controllers, on both backends. Time moves only through
//! the server's `ManualClock`; each test stops the background loop and calls `tick()`.

use bc_core::Actor;
use bc_core::axes::{Connectivity, ProvisionState};
use bc_core::event::{EventType, RecordedEvent};
use bc_core::ids::{NodeId, PoolId, SiteId};
use bc_core::node::NodeRecord;
use bc_core::reason::ReasonKey;
use bc_entity::{event, node_session};
use bc_testing::{TestServer, each_backend};
use better_compute::auth::Role as ApiRole;
use better_compute::config::LivenessConfig;
use better_compute::controllers::liveness::{
    CAUSE_HEARD_AGAIN, CAUSE_LOST, CAUSE_TIMEOUT, EVENT_PAUSED, EVENT_RELEASED, EVENT_RESUMED,
    transition_request,
};
use better_compute::controllers::{
    DrainController, DrainReport, LivenessController, LivenessReport,
};
use better_compute::pki::NodeIdentity;
use better_compute::service::liveness::SilentChange;
use better_compute::service::sessions::Hello;
use chrono::{DateTime, Duration, Utc};
use sea_orm::ActiveValue::Set;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder};
use serde_json::json;

use crate::common::{node_record, now};
use std::collections::BTreeMap;

const GRACE: Duration = Duration::seconds(40);
const LOST_AFTER: Duration = Duration::minutes(10);

/// The defaults, with the background loop off.
fn config() -> LivenessConfig {
    LivenessConfig {
        enabled: false,
        ..LivenessConfig::default()
    }
}

/// A Liveness controller on the test server's services, with the server's own loop stopped
/// so that only this test's ticks change anything.
async fn liveness(s: &TestServer) -> LivenessController {
    s.server.stop_controllers().await;
    LivenessController::new(s.server.services.clone(), config())
}

async fn site(s: &TestServer) -> (SiteId, PoolId) {
    let (site, pool) = s.site_and_pool(8).await;
    (
        SiteId::parse(&site).expect("a site id"),
        PoolId::parse(&pool).expect("a pool id"),
    )
}

/// An adopted host in `site`, `connected` since now.
fn connected_node(s: &TestServer, site: &(SiteId, PoolId)) -> NodeRecord {
    let mut node = node_record(s, site, ProvisionState::Adopted);
    node.connectivity = Connectivity::Connected;
    node
}

/// `count` connected nodes in `site`, each with an open session that heartbeated now.
async fn connected_nodes(s: &TestServer, site: &(SiteId, PoolId), count: usize) -> Vec<NodeId> {
    let records: Vec<NodeRecord> = (0..count).map(|_| connected_node(s, site)).collect();
    s.insert_nodes(&records).await;
    let ids: Vec<NodeId> = records.into_iter().map(|n| n.id).collect();
    open_sessions(s, &ids).await;
    ids
}

/// What the gateway writes on `Hello`: a session row, open, heartbeated now.
async fn open_sessions(s: &TestServer, ids: &[NodeId]) {
    let at = now(s);
    let db = s.database().await;
    node_session::Entity::insert_many(ids.iter().map(|id| node_session::ActiveModel {
        node_id: Set(id.to_string()),
        epoch: Set(1),
        gateway_id: Set("gw-test".to_owned()),
        connected_at: Set(at),
        disconnected_at: Set(None),
        last_seen: Set(at),
    }))
    .exec_without_returning(&db)
    .await
    .expect("inserting sessions");
}

/// What the gateway writes on a heartbeat: `last_seen` only.
async fn heartbeat(s: &TestServer, ids: &[NodeId]) {
    let db = s.database().await;
    node_session::Entity::update_many()
        .col_expr(node_session::Column::LastSeen, Expr::value(now(s)))
        .filter(node_session::Column::NodeId.is_in(ids.iter().map(ToString::to_string)))
        .exec(&db)
        .await
        .expect("updating sessions");
}

async fn load(s: &TestServer, id: &NodeId) -> NodeRecord {
    s.server
        .services
        .node_record(id)
        .await
        .unwrap_or_else(|err| panic!("loading a node: {}", err.message()))
        .expect("the node exists")
}

async fn connectivity(s: &TestServer, ids: &[NodeId]) -> Vec<Connectivity> {
    let mut out = Vec::new();
    for id in ids {
        out.push(load(s, id).await.connectivity);
    }
    out
}

/// A node's events, oldest first.
async fn node_events(s: &TestServer, id: &NodeId) -> Vec<RecordedEvent> {
    let mut list = s
        .server
        .services
        .node_history(id, None, 100)
        .await
        .unwrap_or_else(|err| panic!("listing events: {}", err.message()));
    list.reverse();
    list
}

/// Site-level events of one type, oldest first.
async fn site_events(s: &TestServer, event_type: EventType) -> Vec<event::Model> {
    event::Entity::find()
        .filter(event::Column::EventType.eq(event_type.as_static_str()))
        .filter(event::Column::NodeId.is_null())
        .order_by_asc(event::Column::Seq)
        .all(&s.database().await)
        .await
        .expect("listing events")
}

async fn tick(controller: &mut LivenessController) -> LivenessReport {
    controller.tick().await.expect("a liveness tick")
}

#[tokio::test]
async fn a_silent_node_goes_unreachable_then_lost_and_comes_back() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 1).await;
        let id = &ids[0];

        // Just past the grace without a heartbeat.
        s.clock.advance(GRACE + Duration::seconds(1));
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.lost, report.connected),
            (1, 0, 0),
            "{report:?}"
        );
        let node = load(s, id).await;
        assert_eq!(node.connectivity, Connectivity::Unreachable);
        assert_eq!(node.connectivity_since, now(s));
        let reason = node
            .no_schedule_reasons
            .iter()
            .find(|r| r.key == ReasonKey::Unreachable)
            .expect("`unreachable` is a reason");
        assert_eq!(reason.set_by, Actor::Controller("liveness".into()));
        assert_eq!(node.version, 2, "one transaction, one version");
        let history = node_events(s, id).await;
        let change = history
            .iter()
            .find(|e| e.event_type == EventType::NodeConnectivityChanged)
            .expect("a connectivity event");
        assert_eq!(change.actor.to_string(), "controller:liveness");
        assert_eq!(change.cause.as_deref(), Some(CAUSE_TIMEOUT));
        assert_eq!(
            (change.from.as_deref(), change.to.as_deref()),
            (Some("connected"), Some("unreachable"))
        );
        assert!(
            history
                .iter()
                .any(|e| e.event_type == EventType::NodeNoScheduleReasonAdded
                    && e.to.as_deref() == Some("unreachable")
                    && e.actor.to_string() == "controller:liveness")
        );

        // Unreachable, but not yet for ten minutes.
        s.clock.advance(LOST_AFTER - Duration::seconds(1));
        assert!(tick(&mut liveness).await.is_quiet());
        assert_eq!(load(s, id).await.connectivity, Connectivity::Unreachable);

        s.clock.advance(Duration::seconds(2));
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.lost, report.connected),
            (0, 1, 0),
            "{report:?}"
        );
        let node = load(s, id).await;
        assert_eq!(node.connectivity, Connectivity::Lost);
        assert!(
            node.has_reason(&ReasonKey::Unreachable),
            "a lost node keeps the reason"
        );
        let last = node_events(s, id).await.pop().expect("an event");
        assert_eq!(
            (last.to.as_deref(), last.cause.as_deref()),
            (Some("lost"), Some(CAUSE_LOST))
        );

        // The session stayed open; the daemon heartbeats again.
        heartbeat(s, &ids).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.lost, report.connected),
            (0, 0, 1),
            "{report:?}"
        );
        let node = load(s, id).await;
        assert_eq!(node.connectivity, Connectivity::Connected);
        assert!(
            !node.has_reason(&ReasonKey::Unreachable),
            "the reason is gone"
        );
        let history = node_events(s, id).await;
        let back: Vec<_> = history
            .iter()
            .filter(|e| e.cause.as_deref() == Some(CAUSE_HEARD_AGAIN))
            .collect();
        assert_eq!(
            back.iter()
                .map(|e| e.event_type.as_static_str())
                .collect::<Vec<_>>(),
            [
                "node.connectivity_changed",
                "node.no_schedule_reason_removed"
            ],
            "both changes in one transaction, with one cause"
        );
        assert!(back.iter().all(|e| e.at == now(s)));

        // And nothing more happens while it keeps heartbeating.
        s.clock.advance(Duration::seconds(5));
        assert!(tick(&mut liveness).await.is_quiet());
    })
    .await;
}

/// A daemon that comes back to a node still `connected` (its gateway died without closing
/// the session) opens a session without changing the node, so the version Liveness's query
/// read cannot tell that it was heard since. The mark reads the sessions again under the
/// nodes' locks: a node heard between the query and the mark stays `connected`, unchanged,
/// and the rest of its batch is marked.
#[tokio::test]
async fn a_node_heard_between_the_query_and_the_mark_stays_connected() {
    each_backend(async |s| {
        s.server.stop_controllers().await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 3).await;
        let mut before = Vec::new();
        for id in &ids {
            before.push(load(s, id).await);
        }
        s.clock.advance(GRACE + Duration::seconds(1));
        let cutoff = now(s) - GRACE;
        let services = &s.server.services;
        let mut silent = services
            .silent_nodes(cutoff)
            .await
            .unwrap_or_else(|err| panic!("the silent nodes: {}", err.message()));
        silent.sort_by_key(|c| ids.iter().position(|id| *id == c.node_id));
        assert_eq!(
            silent.iter().map(|c| &c.node_id).collect::<Vec<_>>(),
            ids.iter().collect::<Vec<_>>()
        );

        // After the query, before the mark: the first node's daemon comes back through
        // another replica (a new session, as after a failover; the node stays `connected`,
        // so its version does not change), and the second one's heartbeat lands late.
        let opened = services
            .open_sessions(
                "gw-other",
                &[Hello {
                    identity: NodeIdentity {
                        node_id: ids[0].clone(),
                        identity_generation: before[0].identity_generation,
                    },
                    inventory_hashes: BTreeMap::new(),
                    observed_generation: before[0].observed_generation,
                }],
            )
            .await
            .unwrap_or_else(|err| panic!("opening a session: {}", err.message()));
        if let Some(Err(err)) = opened.first() {
            panic!("the hello was refused: {}", err.message());
        }
        assert_eq!(opened.len(), 1, "one answer for the one hello");
        heartbeat(s, &ids[1..2]).await;

        // The three are marked in one batch, as the controller marks them, asked for in an
        // order of neither their ids nor their answers (the node to mark between the two
        // heard again): each answer must be its own request's.
        let actor = Actor::Controller("liveness".into());
        let requests = [&silent[1], &silent[2], &silent[0]]
            .into_iter()
            .map(|candidate| {
                transition_request(&actor, candidate, Connectivity::Unreachable, CAUSE_TIMEOUT)
            })
            .collect();
        let marked: Vec<Option<Connectivity>> = services
            .change_silent_nodes(cutoff, requests)
            .await
            .unwrap_or_else(|err| panic!("marking the silent nodes: {}", err.message()))
            .into_iter()
            .map(|change| match change {
                SilentChange::HeardAgain => None,
                SilentChange::Tried(outcome) => match *outcome {
                    Ok((after, _)) => Some(after.connectivity),
                    Err(err) => panic!("a mark was refused: {}", err.message()),
                },
            })
            .collect();
        assert_eq!(marked, [None, Some(Connectivity::Unreachable), None]);
        assert_eq!(
            connectivity(s, &ids).await,
            [
                Connectivity::Connected,
                Connectivity::Connected,
                Connectivity::Unreachable
            ]
        );
        let versions: Vec<i64> = before.iter().map(|n| n.version).collect();
        let mut after = Vec::new();
        for id in &ids {
            after.push(load(s, id).await.version);
        }
        assert_eq!(after, [versions[0], versions[1], versions[2] + 1]);
    })
    .await;
}

#[tokio::test]
async fn nothing_happens_within_the_grace() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 3).await;
        let (late, regular) = ids.split_at(1);

        // Exactly the grace without a heartbeat is still within it.
        s.clock.advance(GRACE);
        let report = tick(&mut liveness).await;
        assert!(report.is_quiet(), "{report:?}");

        // Heartbeats every 10 s for ten minutes keep a node connected, and so do late ones
        // (every 30 s) that still fall within the grace.
        heartbeat(s, &ids).await;
        for i in 0..60 {
            s.clock.advance(Duration::seconds(10));
            heartbeat(s, regular).await;
            if i % 3 == 2 {
                heartbeat(s, late).await;
            }
            let report = tick(&mut liveness).await;
            assert!(report.is_quiet(), "{report:?}");
        }
        assert_eq!(connectivity(s, &ids).await, [Connectivity::Connected; 3]);
        for id in &ids {
            assert_eq!(load(s, id).await.version, 1, "no writes to the node row");
        }
    })
    .await;
}

/// The gateway writes heartbeats a thousand to a statement. A batch of more than one such
/// chunk records the newest beat of every current session and reports the rest stale
/// without touching their rows: a session reopened since (an older epoch), a closed
/// session, a node that never opened one, and the older of two epochs one node beat with.
#[tokio::test]
async fn a_batch_of_heartbeats_records_current_sessions_and_reports_the_rest_stale() {
    each_backend(async |s| {
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 1_203).await;
        let sessionless = connected_node(s, &site);
        s.insert_nodes(std::slice::from_ref(&sessionless)).await;
        let db = s.database().await;
        let set_session = async |id: &NodeId, column: node_session::Column, value: Expr| {
            node_session::Entity::update_many()
                .col_expr(column, value)
                .filter(node_session::Column::NodeId.eq(id.to_string()))
                .exec(&db)
                .await
                .expect("changing a session row");
        };
        // Node 1 reconnected (epoch 2) and beats in both sessions; node 2's session was
        // closed; node 6 reconnected twice and only its first session's beat arrives.
        set_session(&ids[1], node_session::Column::Epoch, Expr::value(2)).await;
        set_session(
            &ids[2],
            node_session::Column::DisconnectedAt,
            Expr::value(Some(now(s))),
        )
        .await;
        set_session(&ids[6], node_session::Column::Epoch, Expr::value(3)).await;
        let opened = now(s);
        let first = opened + Duration::seconds(10);
        let second = opened + Duration::seconds(11);
        let mut beats: Vec<(NodeId, i64, DateTime<Utc>)> =
            ids.iter().map(|id| (id.clone(), 1, first)).collect();
        beats.push((ids[3].clone(), 1, second));
        beats.push((ids[1].clone(), 2, second));
        beats.push((sessionless.id.clone(), 1, first));

        let mut stale = s
            .server
            .services
            .record_heartbeats(&beats)
            .await
            .unwrap_or_else(|err| panic!("recording heartbeats: {}", err.message()));

        stale.sort();
        let mut expected = vec![
            (ids[1].clone(), 1),
            (ids[2].clone(), 1),
            (ids[6].clone(), 1),
            (sessionless.id.clone(), 1),
        ];
        expected.sort();
        assert_eq!(stale, expected);
        let last_seen: BTreeMap<String, i64> = node_session::Entity::find()
            .all(&db)
            .await
            .expect("reading sessions")
            .into_iter()
            .map(|row| (row.node_id, row.last_seen.timestamp_micros()))
            .collect();
        assert_eq!(last_seen.len(), ids.len(), "no session row was added");
        for (i, id) in ids.iter().enumerate() {
            let expected = match i {
                1 | 3 => second,
                2 | 6 => opened,
                _ => first,
            };
            assert_eq!(
                last_seen[&id.to_string()],
                expected.timestamp_micros(),
                "node {i}'s last_seen"
            );
        }
    })
    .await;
}

#[tokio::test]
async fn closed_and_missing_sessions() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        // Connected, but the gateway never wrote a session row.
        let sessionless = connected_node(s, &site);
        // The gateway closed its session cleanly.
        let mut closed = connected_node(s, &site);
        closed.connectivity = Connectivity::Disconnected;
        // Never connected at all (a machine still being enrolled).
        let mut never = connected_node(s, &site);
        never.connectivity = Connectivity::Disconnected;
        never.provision_state = ProvisionState::Enrolling;
        s.insert_nodes(&[sessionless.clone(), closed.clone(), never.clone()])
            .await;
        open_sessions(s, std::slice::from_ref(&closed.id)).await;
        let db = s.database().await;
        node_session::Entity::update_many()
            .col_expr(
                node_session::Column::DisconnectedAt,
                Expr::value(Some(now(s))),
            )
            .filter(node_session::Column::NodeId.eq(closed.id.to_string()))
            .exec(&db)
            .await
            .expect("closing the session");
        let ids = [sessionless.id.clone(), closed.id.clone(), never.id.clone()];

        s.clock.advance(GRACE);
        assert!(tick(&mut liveness).await.is_quiet());

        s.clock.advance(Duration::seconds(1));
        let report = tick(&mut liveness).await;
        assert_eq!(report.unreachable, 2, "{report:?}");
        assert_eq!(
            connectivity(s, &ids).await,
            [
                Connectivity::Unreachable,
                Connectivity::Unreachable,
                Connectivity::Disconnected
            ]
        );
        let change = node_events(s, &closed.id)
            .await
            .into_iter()
            .find(|e| e.event_type == EventType::NodeConnectivityChanged)
            .expect("an event");
        assert_eq!(
            (change.from.as_deref(), change.to.as_deref()),
            (Some("disconnected"), Some("unreachable"))
        );

        // A closed session that heartbeated recently does not bring a node back: only an open
        // one does (a reconnect is the gateway's `Hello`).
        heartbeat(s, std::slice::from_ref(&closed.id)).await;
        s.clock.advance(LOST_AFTER + Duration::seconds(1));
        let report = tick(&mut liveness).await;
        assert_eq!((report.connected, report.lost), (0, 2), "{report:?}");
        assert_eq!(
            connectivity(s, &ids).await,
            [
                Connectivity::Lost,
                Connectivity::Lost,
                Connectivity::Disconnected
            ]
        );
    })
    .await;
}

#[tokio::test]
async fn a_site_going_silent_at_once_pauses_liveness() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let big = site(s).await;
        let small = site(s).await;
        let ids = connected_nodes(s, &big, 20).await;
        let (silent, healthy) = ids.split_at(10);
        let lone = connected_nodes(s, &small, 1).await;

        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, healthy).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            report.newly_paused,
            std::slice::from_ref(&big.0),
            "{report:?}"
        );
        assert_eq!(report.paused_sites, std::slice::from_ref(&big.0));
        assert_eq!(report.held_by_brake, 10);
        assert_eq!(
            report.unreachable, 1,
            "a site below brake_min_nodes is not braked: {report:?}"
        );
        assert_eq!(liveness.paused_sites(), std::slice::from_ref(&big.0));
        assert_eq!(connectivity(s, &lone).await, [Connectivity::Unreachable]);
        assert!(
            connectivity(s, &ids)
                .await
                .iter()
                .all(|c| *c == Connectivity::Connected),
            "no transitions in a paused site"
        );
        let paused = site_events(s, EVENT_PAUSED).await;
        assert_eq!(paused.len(), 1);
        assert_eq!(paused[0].actor, "controller:liveness");
        assert_eq!(paused[0].data["siteId"], big.0.as_str());
        assert_eq!(paused[0].data["silent"], 10);
        assert_eq!(paused[0].data["watched"], 20);
        assert_eq!(paused[0].data["threshold"], 6.0);

        // Still silent, ticks later and past the lost threshold: still paused, no new event,
        // no transitions.
        for _ in 0..3 {
            s.clock.advance(Duration::seconds(5));
            heartbeat(s, healthy).await;
            let report = tick(&mut liveness).await;
            assert!(
                report.newly_paused.is_empty() && report.unreachable == 0,
                "{report:?}"
            );
            assert_eq!(report.held_by_brake, 10);
        }
        s.clock.advance(LOST_AFTER);
        heartbeat(s, healthy).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.lost, report.held_by_brake),
            (0, 1, 10),
            "only the small site's node: {report:?}"
        );
        assert_eq!(
            site_events(s, EVENT_PAUSED).await.len(),
            1,
            "exactly one paused event"
        );
        assert!(site_events(s, EVENT_RESUMED).await.is_empty());
        assert_eq!(
            connectivity(s, silent).await,
            [Connectivity::Connected; 10],
            "never marked down while paused, not even after lost_after"
        );

        // They come back.
        heartbeat(s, &ids).await;
        let report = tick(&mut liveness).await;
        assert_eq!(report.resumed, std::slice::from_ref(&big.0), "{report:?}");
        assert!(report.paused_sites.is_empty() && liveness.paused_sites().is_empty());
        assert_eq!(
            (report.unreachable, report.connected, report.held_by_brake),
            (0, 0, 0)
        );
        let resumed = site_events(s, EVENT_RESUMED).await;
        assert_eq!(resumed.len(), 1);
        assert_eq!(resumed[0].data["siteId"], big.0.as_str());
        assert_eq!(resumed[0].data["silent"], 0);
        assert!(
            connectivity(s, &ids)
                .await
                .iter()
                .all(|c| *c == Connectivity::Connected)
        );

        s.clock.advance(Duration::seconds(5));
        heartbeat(s, &ids).await;
        assert!(tick(&mut liveness).await.is_quiet());
        assert_eq!(site_events(s, EVENT_PAUSED).await.len(), 1);
        assert_eq!(site_events(s, EVENT_RESUMED).await.len(), 1);
    })
    .await;
}

const BRAKES: &str = "{ livenessBrakes { siteId status silent recentlyUnreachable watched
    trippedAt releasedBy releaseReason releasedAt } }";
const RELEASE: &str = "mutation($site: ID!, $reason: String!) {
    releaseLivenessBrake(input: {siteId: $site, reason: $reason}) {
        brake { siteId status releasedBy releaseReason } } }";

#[tokio::test]
async fn a_brake_outlives_its_controller_is_listed_and_an_admin_can_release_it() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let big = site(s).await;
        let quiet = site(s).await;
        let ids = connected_nodes(s, &big, 20).await;
        let (silent, healthy) = ids.split_at(10);
        connected_nodes(s, &quiet, 1).await;

        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, healthy).await;
        assert_eq!(
            tick(&mut liveness).await.newly_paused,
            std::slice::from_ref(&big.0)
        );

        // Another controller takes over (a failover, a restart): it holds the same site
        // without tripping the brake again.
        let mut successor = LivenessController::new(s.server.services.clone(), config());
        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, healthy).await;
        let report = tick(&mut successor).await;
        assert!(report.newly_paused.is_empty(), "{report:?}");
        assert_eq!(
            (report.held_by_brake, report.unreachable),
            (10, 0),
            "{report:?}"
        );
        assert_eq!(successor.paused_sites(), std::slice::from_ref(&big.0));
        assert_eq!(site_events(s, EVENT_PAUSED).await.len(), 1);

        let listed = s.admin(BRAKES, json!({})).await["livenessBrakes"].clone();
        assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed:#}");
        let brake = &listed[0];
        assert_eq!(
            (
                brake["siteId"].as_str(),
                brake["status"].as_str(),
                brake["silent"].as_u64(),
                brake["watched"].as_u64()
            ),
            (Some(big.0.as_str()), Some("PAUSED"), Some(10), Some(20))
        );
        assert!(brake["releasedBy"].is_null() && brake["releasedAt"].is_null());

        // Refusals change nothing: an operator, a blank reason, a site without a brake.
        let release = |token: String, site: &SiteId, reason: &str| {
            let vars = json!({"site": site.as_str(), "reason": reason});
            async move { s.gql(Some(&token), RELEASE, vars).await }
        };
        let admin = s.token(ApiRole::Admin);
        let refused = [
            (s.token(ApiRole::Operator), &big.0, "looked", "FORBIDDEN"),
            (admin.clone(), &big.0, " ", "BAD_USER_INPUT"),
            (admin.clone(), &quiet.0, "looked", "NOT_FOUND"),
        ];
        for (token, site, reason, code) in refused {
            let answer = release(token, site, reason).await;
            assert_eq!(answer.code(), Some(code), "{:#}", answer.body);
        }
        assert_eq!(
            s.admin(BRAKES, json!({})).await["livenessBrakes"][0]["status"],
            "PAUSED"
        );

        let released = release(admin.clone(), &big.0, "rack 4 lost power").await;
        let brake = &released.data()["releaseLivenessBrake"]["brake"];
        assert_eq!(brake["status"], "RELEASED");
        assert_eq!(brake["releaseReason"], "rack 4 lost power");
        assert!(
            brake["releasedBy"]
                .as_str()
                .is_some_and(|by| by.starts_with("user:"))
        );
        let again = release(admin.clone(), &big.0, "twice").await;
        assert_eq!(again.code(), Some("BAD_USER_INPUT"), "{:#}", again.body);
        let events = site_events(s, EVENT_RELEASED).await;
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].data["reason"], "rack 4 lost power");
        assert!(events[0].actor.starts_with("user:"));

        // Released: the silent nodes go unreachable although the site still crosses the
        // rule, and the same silence does not trip the brake again.
        heartbeat(s, healthy).await;
        let report = tick(&mut successor).await;
        assert_eq!(
            (report.unreachable, report.held_by_brake),
            (10, 0),
            "{report:?}"
        );
        assert!(report.newly_paused.is_empty() && report.paused_sites.is_empty());
        assert_eq!(
            connectivity(s, silent).await,
            [Connectivity::Unreachable; 10]
        );
        assert_eq!(
            s.admin(BRAKES, json!({})).await["livenessBrakes"][0]["status"],
            "RELEASED",
            "listed until the episode ends"
        );

        // Out of the window the site no longer crosses the rule: the episode ends quietly
        // (the release already resumed liveness), and the list is empty.
        s.clock.advance(Duration::seconds(61));
        heartbeat(s, healthy).await;
        let report = tick(&mut successor).await;
        assert!(report.resumed.is_empty(), "{report:?}");
        assert_eq!(
            s.admin(BRAKES, json!({})).await["livenessBrakes"],
            json!([])
        );
        assert_eq!(site_events(s, EVENT_PAUSED).await.len(), 1);
        assert!(site_events(s, EVENT_RESUMED).await.is_empty());
    })
    .await;
}

#[tokio::test]
async fn a_few_silent_nodes_in_a_big_site_go_unreachable() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 20).await;
        let (silent, healthy) = ids.split_at(2);

        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, healthy).await;
        let report = tick(&mut liveness).await;
        assert_eq!(report.unreachable, 2, "{report:?}");
        assert!(report.newly_paused.is_empty() && report.paused_sites.is_empty());
        assert_eq!(
            connectivity(s, silent).await,
            [Connectivity::Unreachable; 2]
        );
        assert!(site_events(s, EVENT_PAUSED).await.is_empty());
    })
    .await;
}

/// Marks and recoveries are written 250 nodes to a transaction: a tick with more than that
/// writes every one of them, and each once.
#[tokio::test]
async fn more_silent_nodes_than_a_transaction_holds_are_all_marked_and_all_recovered() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        // 260 of 1,000 go silent: under the brake's 30 %.
        let ids = connected_nodes(s, &site, 1_000).await;
        let (silent, healthy) = ids.split_at(260);

        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, healthy).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.skipped, report.failed),
            (260, 0, 0),
            "{report:?}"
        );
        assert!(report.paused_sites.is_empty(), "{report:?}");
        assert_eq!(
            connectivity(s, silent).await,
            [Connectivity::Unreachable; 260]
        );

        // They all heartbeat again: every one comes back on the next tick.
        s.clock.advance(Duration::seconds(5));
        heartbeat(s, &ids).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.connected, report.unreachable, report.skipped),
            (260, 0, 0),
            "{report:?}"
        );
        assert_eq!(
            connectivity(s, silent).await,
            [Connectivity::Connected; 260]
        );
        let marks = node_events(s, &silent[259])
            .await
            .into_iter()
            .filter(|e| e.cause.as_deref() == Some(CAUSE_TIMEOUT))
            .count();
        assert_eq!(
            marks, 2,
            "one connectivity change and one reason added, once"
        );
    })
    .await;
}

#[tokio::test]
async fn silence_spreading_within_the_window_trips_the_brake() {
    each_backend(async |s| {
        let mut liveness = liveness(s).await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 20).await;

        // 4 of 20 go silent: under 30 %, so they go unreachable.
        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, &ids[4..]).await;
        assert_eq!(tick(&mut liveness).await.unreachable, 4);

        // A grace later 3 more fall silent: 4 recent + 3 new = 7 > 6 within the minute.
        s.clock.advance(GRACE + Duration::seconds(1));
        heartbeat(s, &ids[7..]).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            report.newly_paused,
            std::slice::from_ref(&site.0),
            "{report:?}"
        );
        assert_eq!((report.unreachable, report.held_by_brake), (0, 3));
        let paused = site_events(s, EVENT_PAUSED).await;
        assert_eq!(paused.len(), 1);
        assert_eq!(
            (
                paused[0].data["silent"].as_u64(),
                paused[0].data["recentlyUnreachable"].as_u64()
            ),
            (Some(3), Some(4))
        );

        // Once the first four are out of the window, 3 silent alone do not trip it: the site
        // resumes and they go unreachable in the same tick.
        s.clock.advance(Duration::seconds(61));
        heartbeat(s, &ids[7..]).await;
        let report = tick(&mut liveness).await;
        assert_eq!(report.resumed, std::slice::from_ref(&site.0), "{report:?}");
        assert_eq!(report.unreachable, 3);
        assert_eq!(
            connectivity(s, &ids[..7]).await,
            [Connectivity::Unreachable; 7]
        );
    })
    .await;
}

#[tokio::test]
async fn a_restarted_controller_gives_daemons_one_grace_to_reconnect() {
    each_backend(async |s| {
        s.server.stop_controllers().await;
        let site = site(s).await;
        let ids = connected_nodes(s, &site, 2).await;
        // The control plane was down for five minutes.
        s.clock.advance(Duration::minutes(5));
        let mut liveness = LivenessController::new(s.server.services.clone(), config());

        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.held_at_startup),
            (0, 2),
            "{report:?}"
        );

        // One daemon reconnects within the grace; the other never does.
        s.clock.advance(GRACE - Duration::seconds(1));
        heartbeat(s, &ids[..1]).await;
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.held_at_startup),
            (0, 1),
            "{report:?}"
        );

        s.clock.advance(Duration::seconds(1));
        let report = tick(&mut liveness).await;
        assert_eq!(
            (report.unreachable, report.held_at_startup),
            (1, 0),
            "{report:?}"
        );
        assert_eq!(
            connectivity(s, &ids).await,
            [Connectivity::Connected, Connectivity::Unreachable]
        );
    })
    .await;
}

#[tokio::test]
async fn a_drain_on_a_node_that_runs_nothing_ends_at_the_next_tick() {
    each_backend(async |s| {
        s.server.stop_controllers().await;
        let mut drains = DrainController::new(s.server.services.clone());
        let site = site(s).await;
        let operator = Actor::User("ops@example.com".into());
        let mut with_deadline = connected_node(s, &site);
        with_deadline
            .drain(
                "firmware",
                Some(now(s) + Duration::hours(1)),
                &operator,
                now(s),
            )
            .expect("a drain");
        let mut without_deadline = connected_node(s, &site);
        without_deadline
            .drain("rack move", None, &operator, now(s))
            .expect("a drain");
        s.insert_nodes(&[with_deadline.clone(), without_deadline.clone()])
            .await;

        // A drain whose node holds no allocation ends at the next tick, deadline or not
        // (the node runs nothing, so nothing is left to wait for).
        let report = drains.tick().await.expect("a drain tick");
        assert_eq!((report.finished, report.drained), (0, 2), "{report:?}");
        for drained in [&with_deadline, &without_deadline] {
            let node = load(s, &drained.id).await;
            assert!(node.drain.is_none());
            assert!(!node.has_reason(&ReasonKey::Draining), "`draining` is gone");
            assert!(
                node.cordoned(),
                "still cordoned until an operator uncordons"
            );
            assert_eq!(node.version, drained.version + 1);
            let finished = node_events(s, &node.id)
                .await
                .into_iter()
                .filter(|e| e.actor.to_string() == "controller:drain")
                .map(|e| {
                    (
                        e.event_type.to_string(),
                        e.cause,
                        e.data["detail"].as_str().map(str::to_owned),
                    )
                })
                .collect::<Vec<_>>();
            let cause = Some("drain:no-allocations".to_owned());
            assert_eq!(
                finished,
                [
                    (
                        "node.no_schedule_reason_removed".to_owned(),
                        cause.clone(),
                        None
                    ),
                    (
                        "node.drained".to_owned(),
                        cause,
                        Some("no allocations left".to_owned())
                    ),
                ]
            );
        }

        s.clock.advance(Duration::days(1));
        assert_eq!(
            drains.tick().await.expect("a drain tick"),
            DrainReport::default(),
            "nothing is left to end"
        );
    })
    .await;
}
