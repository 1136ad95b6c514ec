//! `provisionStateTable` over the API, exhaustively: every provision state against every
//! move (and against `adoptNode`, `retireNode` and `deleteNode`), on SQLite and on
//! PostgreSQL. The expected answer of each case comes from `bc_core::provision`, so the
//! API can never drift from the table.

use crate::common::{events, extensions, gql_enum, node_record};
use bc_core::DomainError;
use bc_core::axes::ProvisionState;
use bc_core::ids::{PoolId, SiteId};
use bc_core::provision::{
    self, DELETABLE_STATES, PROVISION_STATE_TABLE, ProvisionMove, Target, invalid_state,
};
use bc_testing::{TestServer, each_backend};
use better_compute::auth::Role;
use better_compute::error::ApiError;
use chrono::Duration;
use serde_json::{Value, json};
use strum::IntoEnumIterator;

/// The state a `FAILED` fixture failed from.
const FAILED_FROM: ProvisionState = ProvisionState::Deploying;
/// The reason every call passes; `FAIL` makes it the maintenance reason.
const REASON: &str = "state table";

/// How a case asks for the move.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// `transitionNode` with this move.
    Transition(ProvisionMove),
    /// `adoptNode`.
    Adopt,
    /// `retireNode`.
    Retire,
    /// `deleteNode`: not a move of the table, but allowed only from the idle states.
    Delete,
}

impl Via {
    fn field(self) -> &'static str {
        match self {
            Via::Transition(_) => "transitionNode",
            Via::Adopt => "adoptNode",
            Via::Retire => "retireNode",
            Via::Delete => "deleteNode",
        }
    }

    fn call(self) -> (&'static str, Value) {
        match self {
            Via::Transition(m) => (
                "TransitionNodeInput",
                json!({ "move": gql_enum(m), "reason": REASON }),
            ),
            Via::Adopt => ("AdoptNodeInput", json!({})),
            Via::Retire => ("RetireNodeInput", json!({ "reason": REASON })),
            Via::Delete => ("DeleteNodeInput", json!({})),
        }
    }

    /// The move as `INVALID_STATE` names it.
    fn attempted(self) -> &'static str {
        match self {
            Via::Transition(m) => m.into(),
            Via::Adopt => ProvisionMove::Adopt.into(),
            Via::Retire => ProvisionMove::Retire.into(),
            Via::Delete => "delete",
        }
    }
}

const FIELDS: &str =
    "id version provisionState failedFrom maintenance maintenanceReason identityGeneration
  events(first: 10) { nodes { type axis from to actor cause data } }";

/// Writes a node in `state` (`FAILED` with its `failedFrom` and maintenance on, as a failure
/// leaves it), calls `via`, and checks the answer against the domain's state table.
/// Returns whether the move was allowed.
async fn check(
    s: &TestServer,
    place: &(SiteId, PoolId),
    token: &str,
    state: ProvisionState,
    via: Via,
) -> bool {
    let label = format!("{via:?} from {state} ({:?})", s.backend);
    let mut record = node_record(s, place, state);
    if state == ProvisionState::Failed {
        record.failed_from = Some(FAILED_FROM);
        record.maintenance = true;
        record.maintenance_reason = Some("deploying failed".into());
    }
    s.insert_node(&record).await;
    let (input_type, args) = via.call();
    let mut input = json!({ "id": record.id.as_str(), "version": 1 });
    if let (Some(input), Some(args)) = (input.as_object_mut(), args.as_object()) {
        input.extend(args.clone());
    }
    let response = s
        .gql(
            Some(token),
            &format!(
                "mutation($input: {input_type}!) {{ {}(input: $input) {{ node {{ {FIELDS} }} }} }}",
                via.field()
            ),
            json!({ "input": input }),
        )
        .await;

    let expected = match via {
        Via::Transition(m) => provision::next_state(state, m, record.failed_from).map(Some),
        Via::Adopt => {
            provision::next_state(state, ProvisionMove::Adopt, record.failed_from).map(Some)
        }
        Via::Retire => {
            provision::next_state(state, ProvisionMove::Retire, record.failed_from).map(Some)
        }
        Via::Delete => provision::check_deletable(state).map(|()| None),
    };
    match expected {
        Ok(to) => {
            let node = &response.data()[via.field()]["node"];
            assert_eq!(node["version"], json!(2), "{label}");
            let history = events(node);
            let first = history
                .first()
                .unwrap_or_else(|| panic!("{label}: no event"));
            for event in &history {
                assert_eq!(event["actor"], json!("user:state-table"), "{label}");
            }
            match to {
                Some(to) => {
                    let m: &str = match via {
                        Via::Transition(m) => m.into(),
                        _ => via.attempted(),
                    };
                    assert_eq!(node["provisionState"], json!(gql_enum(to)), "{label}");
                    assert_eq!(
                        first["type"],
                        json!("node.provision_state_changed"),
                        "{label}"
                    );
                    assert_eq!(first["axis"], json!("provisionState"), "{label}");
                    assert_eq!(first["from"], json!(state.as_static_str()), "{label}");
                    assert_eq!(first["to"], json!(to.as_static_str()), "{label}");
                    assert_eq!(first["cause"], json!(format!("provision:{m}")), "{label}");
                    let (failed_from, maintenance, maintenance_reason) = match via {
                        Via::Transition(ProvisionMove::Fail) => {
                            (json!(gql_enum(state)), true, json!(REASON))
                        }
                        Via::Transition(ProvisionMove::Recover) => {
                            assert_eq!(to, FAILED_FROM, "{label}: back to failedFrom");
                            (Value::Null, false, Value::Null)
                        }
                        // Other moves leave failedFrom and maintenance alone.
                        _ => (
                            record
                                .failed_from
                                .map_or(Value::Null, |f| json!(gql_enum(f))),
                            record.maintenance,
                            json!(record.maintenance_reason),
                        ),
                    };
                    assert_eq!(node["failedFrom"], failed_from, "{label}");
                    assert_eq!(node["maintenance"], json!(maintenance), "{label}");
                    assert_eq!(node["maintenanceReason"], maintenance_reason, "{label}");
                    let maintenance_events = usize::from(maintenance != record.maintenance);
                    assert_eq!(
                        history.len(),
                        1 + maintenance_events,
                        "{label}: {history:?}"
                    );
                }
                None => {
                    // Deleted: the identity was revoked, and the node is gone.
                    assert_eq!(node["identityGeneration"], json!(2), "{label}");
                    assert_eq!(first["type"], json!("node.identity_revoked"), "{label}");
                    let gone = s
                        .gql(
                            Some(token),
                            "query($id: ID!) { node(id: $id) { id } }",
                            json!({ "id": record.id.as_str() }),
                        )
                        .await;
                    assert_eq!(gone.code(), Some("NOT_FOUND"), "{label}: {:#}", gone.body);
                }
            }
            true
        }
        Err(DomainError::InvalidState { attempted, .. }) => {
            assert_eq!(
                response.code(),
                Some("INVALID_STATE"),
                "{label}: {:#}",
                response.body
            );
            assert_eq!(attempted, via.attempted(), "{label}");
            // The domain's error in the API's words: the state and the move as the GraphQL
            // enums spell them (a deletion is `deleteNode`), and as allowed the table's moves
            // from this state, which `transitionNode` takes as they are.
            let ext = extensions(&response);
            assert_eq!(ext["current"], json!(gql_enum(state)), "{label}");
            let sent = match via {
                Via::Delete => "deleteNode".to_owned(),
                _ => gql_enum(via.attempted()),
            };
            assert_eq!(ext["attempted"], json!(sent), "{label}");
            let listed: Vec<String> = provision::allowed_moves(state)
                .into_iter()
                .map(gql_enum)
                .collect();
            assert_eq!(ext["allowed"], json!(listed), "{label}");
            let ApiError::InvalidState { message, .. } =
                ApiError::from(invalid_state(state, via.attempted()))
            else {
                unreachable!("invalid_state builds INVALID_STATE")
            };
            assert_eq!(response.error()["message"], json!(message), "{label}");
            // Nothing changed.
            let after = s
                .gql(
                    Some(token),
                    &format!("query($id: ID!) {{ node(id: $id) {{ {FIELDS} }} }}"),
                    json!({ "id": record.id.as_str() }),
                )
                .await;
            let node = &after.data()["node"];
            assert_eq!(node["version"], json!(1), "{label}");
            assert_eq!(node["provisionState"], json!(gql_enum(state)), "{label}");
            assert_eq!(node["maintenance"], json!(record.maintenance), "{label}");
            assert!(events(node).is_empty(), "{label}: no event");
            false
        }
        Err(other) => panic!("{label}: the fixture should never give {other:?}"),
    }
}

fn operator(s: &TestServer) -> String {
    s.mint("state-table", Role::Operator, None, Duration::hours(1))
}

/// 13 states × 14 moves through `transitionNode`.
#[tokio::test]
async fn transition_node_follows_the_table_from_every_state_for_every_move() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let token = operator(s);
        let (mut allowed, mut refused) = (0, 0);
        for state in ProvisionState::iter() {
            for m in ProvisionMove::iter() {
                if check(s, &place, &token, state, Via::Transition(m)).await {
                    allowed += 1;
                } else {
                    refused += 1;
                }
            }
        }
        // Every edge of the table, each from each of its states (`recover` included).
        let edges: usize = PROVISION_STATE_TABLE.iter().map(|e| e.from.len()).sum();
        assert_eq!((allowed, refused), (edges, 13 * 14 - edges));
    })
    .await;
}

/// `adoptNode`, `retireNode` and `deleteNode` from each of the 13 states.
#[tokio::test]
async fn adopt_retire_and_delete_follow_the_table_from_every_state() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        // Deleting needs an admin.
        let token = s.mint("state-table", Role::Admin, None, Duration::hours(1));
        for via in [Via::Adopt, Via::Retire, Via::Delete] {
            let mut allowed = Vec::new();
            for state in ProvisionState::iter() {
                if check(s, &place, &token, state, via).await {
                    allowed.push(state);
                }
            }
            let want: Vec<ProvisionState> = match via {
                Via::Adopt => provision::edge(ProvisionMove::Adopt).from.to_vec(),
                Via::Retire => provision::edge(ProvisionMove::Retire).from.to_vec(),
                _ => DELETABLE_STATES.to_vec(),
            };
            let mut want = want;
            want.sort();
            allowed.sort();
            assert_eq!(allowed, want, "{via:?}");
        }
    })
    .await;
}

/// The `provisionStateTable` query is the domain's table, edge for edge.
#[tokio::test]
async fn the_provision_state_table_query_is_the_domain_table() {
    let want: Vec<Value> = PROVISION_STATE_TABLE
        .iter()
        .map(|edge| {
            json!({
                "move": gql_enum(edge.action),
                "from": edge.from.iter().map(gql_enum).collect::<Vec<_>>(),
                "to": match edge.to {
                    Target::State(state) => json!(gql_enum(state)),
                    Target::FailedFrom => Value::Null,
                },
            })
        })
        .collect();
    each_backend(async |s| {
        let viewer = s.mint("reader", Role::Viewer, None, Duration::hours(1));
        let response = s
            .gql(
                Some(&viewer),
                "{ provisionStateTable { move from to } }",
                json!({}),
            )
            .await;
        assert_eq!(response.data()["provisionStateTable"], json!(want));
    })
    .await;
}
