//! Every node mutation, over real HTTP, on SQLite and on PostgreSQL.
//!
//! Each test is one table of cases and one helper that runs a case: what a successful call
//! changes (fields, `version + 1`, its events), and every way a call is refused
//! (`CONFLICT`, `INVALID_STATE`, `FORBIDDEN`, `UNAUTHENTICATED`, `BAD_USER_INPUT`,
//! `NOT_FOUND`) without changing the node. Fixtures are written straight to storage with
//! `insert_node`, so each case starts from exactly the state it names.

use crate::common::{
    NODE_FIELDS, event_summary, events, extensions, fetch_node, node, node_record, now,
};
use bc_core::Actor;
use bc_core::axes::{ProvisionState, TaintEffect};
use bc_core::ids::NodeId;
use bc_core::node::NodeRecord;
use bc_core::provision::invalid_state;
use bc_core::reason::ReasonKey;
use bc_testing::{Gql, TestServer, each_backend};
use better_compute::auth::{Role, TokenKeys};
use better_compute::error::ApiError;
use chrono::{DateTime, Duration, Utc};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use ProvisionState::*;

/// The subject every test token carries; events must name `user:alice`.
const SUBJECT: &str = "alice";
const ACTOR: &str = "user:alice";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    Cordon,
    Uncordon,
    Drain,
    Taint,
    Untaint,
    Label,
    Adopt,
    Retire,
    Transition,
    RevokeIdentity,
    Delete,
}

impl Mutation {
    const ALL: [Mutation; 11] = [
        Mutation::Cordon,
        Mutation::Uncordon,
        Mutation::Drain,
        Mutation::Taint,
        Mutation::Untaint,
        Mutation::Label,
        Mutation::Adopt,
        Mutation::Retire,
        Mutation::Transition,
        Mutation::RevokeIdentity,
        Mutation::Delete,
    ];

    fn field(self) -> &'static str {
        match self {
            Mutation::Cordon => "cordonNode",
            Mutation::Uncordon => "uncordonNode",
            Mutation::Drain => "drainNode",
            Mutation::Taint => "taintNode",
            Mutation::Untaint => "untaintNode",
            Mutation::Label => "labelNode",
            Mutation::Adopt => "adoptNode",
            Mutation::Retire => "retireNode",
            Mutation::Transition => "transitionNode",
            Mutation::RevokeIdentity => "revokeNodeIdentity",
            Mutation::Delete => "deleteNode",
        }
    }

    fn input_type(self) -> &'static str {
        match self {
            Mutation::Cordon => "CordonNodeInput",
            Mutation::Uncordon => "UncordonNodeInput",
            Mutation::Adopt => "AdoptNodeInput",
            Mutation::Delete => "DeleteNodeInput",
            Mutation::Drain => "DrainNodeInput",
            Mutation::Taint => "TaintNodeInput",
            Mutation::Untaint => "UntaintNodeInput",
            Mutation::Label => "LabelNodeInput",
            Mutation::Retire => "RetireNodeInput",
            Mutation::RevokeIdentity => "RevokeNodeIdentityInput",
            Mutation::Transition => "TransitionNodeInput",
        }
    }

    /// The role `server/src/service/nodes.rs` requires.
    fn role(self) -> Role {
        match self {
            Mutation::RevokeIdentity | Mutation::Delete => Role::Admin,
            _ => Role::Operator,
        }
    }

    /// A call that succeeds: the state and preparation of the node, and the arguments
    /// besides `id` and `version`. The refusal tables use it, so that whatever refuses a
    /// call is the one thing the case changes.
    fn valid(self) -> (ProvisionState, Prep, Value) {
        match self {
            Mutation::Cordon => (Adopted, plain, json!({ "reason": "rack move" })),
            Mutation::Uncordon => (Adopted, cordoned, json!({})),
            Mutation::Drain => (Adopted, plain, json!({ "reason": "firmware update" })),
            Mutation::Taint => (
                Adopted,
                plain,
                json!({ "key": "gpu-burn", "value": "running" }),
            ),
            Mutation::Untaint => (Adopted, tainted, json!({ "key": "gpu-burn" })),
            Mutation::Label => (
                Adopted,
                plain,
                json!({ "set": [{ "key": "rack", "value": "r12" }] }),
            ),
            Mutation::Adopt => (Adopting, plain, json!({})),
            Mutation::Retire => (Adopted, plain, json!({ "reason": "end of life" })),
            Mutation::Transition => (Ready, plain, json!({ "move": "DEPLOY" })),
            Mutation::RevokeIdentity => (Adopted, plain, json!({ "reason": "key leaked" })),
            Mutation::Delete => (Retired, plain, json!({})),
        }
    }
}

/// Prepares a fixture before it is written: `(node, the server's now)`.
type Prep = fn(&mut NodeRecord, DateTime<Utc>);

fn setup_actor() -> Actor {
    Actor::User("setup".into())
}

fn plain(_: &mut NodeRecord, _: DateTime<Utc>) {}

fn cordoned(n: &mut NodeRecord, now: DateTime<Utc>) {
    n.cordon("maintenance window", &setup_actor(), now)
        .expect("a valid cordon");
}

fn draining(n: &mut NodeRecord, now: DateTime<Utc>) {
    n.drain(
        "firmware update",
        Some(drain_deadline(now)),
        &setup_actor(),
        now,
    )
    .expect("a valid drain");
}

/// The deadline the drain fixtures use.
fn drain_deadline(now: DateTime<Utc>) -> DateTime<Utc> {
    now + Duration::hours(2)
}

fn tainted(n: &mut NodeRecord, now: DateTime<Utc>) {
    n.taint(
        "gpu-burn",
        "running",
        TaintEffect::NoSchedule,
        &setup_actor(),
        now,
    )
    .expect("a valid taint");
}

fn labelled(n: &mut NodeRecord, _: DateTime<Utc>) {
    let labels = BTreeMap::from([
        ("rack".to_owned(), "r12".to_owned()),
        ("zone".to_owned(), "a".to_owned()),
    ]);
    n.update_labels(&labels, &[]).expect("valid labels");
}

fn failed_while_deploying(n: &mut NodeRecord, _: DateTime<Utc>) {
    n.failed_from = Some(Deploying);
    n.maintenance = true;
    n.maintenance_reason = Some("deploying failed".into());
}

fn failed_without_origin(n: &mut NodeRecord, _: DateTime<Utc>) {
    n.maintenance = true;
}

/// A token for `role`, subject [`SUBJECT`].
fn token(s: &TestServer, role: Role) -> String {
    s.mint(SUBJECT, role, None, Duration::hours(1))
}

/// Runs `m` on node `id` at `version` with `args`, returning the node with
/// [`NODE_FIELDS`].
async fn call(
    s: &TestServer,
    token: Option<&str>,
    m: Mutation,
    id: &str,
    version: i64,
    args: &Value,
) -> Gql {
    let mut input = json!({ "id": id, "version": version });
    if let (Some(input), Some(args)) = (input.as_object_mut(), args.as_object()) {
        input.extend(args.clone());
    }
    let query = format!(
        "mutation($input: {}!) {{ {}(input: $input) {{ node {{ ...NodeFields }} }} }} {NODE_FIELDS}",
        m.input_type(),
        m.field()
    );
    s.gql(token, &query, json!({ "input": input })).await
}

/// Writes a node in `state`, prepared by `prep`, at `version`; returns it as the API shows it.
async fn fixture(
    s: &TestServer,
    place: &(bc_core::ids::SiteId, bc_core::ids::PoolId),
    state: ProvisionState,
    prep: Prep,
    version: i64,
) -> Value {
    let mut record = node_record(s, place, state);
    prep(&mut record, now(s));
    record.version = version;
    s.insert_node(&record).await;
    node(s, record.id.as_str()).await
}

fn id_of(node: &Value) -> &str {
    node["id"].as_str().expect("a node id")
}

/// The node reads back exactly as `before`: no field, version or event changed.
async fn assert_unchanged(s: &TestServer, before: &Value, case: &str) {
    let after = node(s, id_of(before)).await;
    assert_eq!(
        &after, before,
        "{case} ({:?}): a refused call must not change the node",
        s.backend
    );
}

/// The error of a refused call: its code and the HTTP status it came with.
#[track_caller]
fn assert_refused(response: &Gql, status: u16, code: &str, case: &str) {
    assert_eq!(
        (response.status, response.code()),
        (status, Some(code)),
        "{case}: expected HTTP {status} with {code}, got {:#}",
        response.body
    );
    assert!(
        response.body["data"].is_null(),
        "{case}: a refused mutation returns no data: {:#}",
        response.body
    );
}

/// An event expected in a node's history: type, axis, from, to.
type Ev = (
    &'static str,
    &'static str,
    Option<&'static str>,
    Option<&'static str>,
);

fn ev(
    event_type: &'static str,
    axis: &'static str,
    from: Option<&'static str>,
    to: Option<&'static str>,
) -> Ev {
    (event_type, axis, from, to)
}

struct Success {
    name: &'static str,
    mutation: Mutation,
    state: ProvisionState,
    prep: Prep,
    args: Value,
    /// JSON pointers into the returned node and the value each must have.
    expect: Vec<(&'static str, Value)>,
    /// Every event the call writes, oldest first.
    events: Vec<Ev>,
    cause: &'static str,
}

fn success_cases(now: DateTime<Utc>) -> Vec<Success> {
    let deadline = drain_deadline(now);
    vec![
        Success {
            name: "cordon",
            mutation: Mutation::Cordon,
            state: Adopted,
            prep: plain,
            args: json!({ "reason": "  rack move  " }),
            expect: vec![
                ("/cordoned", json!(true)),
                ("/cordon/reason", json!("rack move")),
                ("/cordon/by", json!(ACTOR)),
                ("/drain", Value::Null),
                ("/noScheduleReasons", json!([])),
                ("/schedulability/bucket", json!("MAINTENANCE")),
            ],
            events: vec![ev("node.cordoned", "cordoned", Some("false"), Some("true"))],
            cause: "cordonNode",
        },
        Success {
            name: "uncordon",
            mutation: Mutation::Uncordon,
            state: Adopted,
            prep: cordoned,
            args: json!({}),
            expect: vec![("/cordoned", json!(false)), ("/cordon", Value::Null)],
            events: vec![ev(
                "node.uncordoned",
                "cordoned",
                Some("true"),
                Some("false"),
            )],
            cause: "uncordonNode",
        },
        Success {
            name: "uncordon ends a drain",
            mutation: Mutation::Uncordon,
            state: Adopted,
            prep: draining,
            args: json!({}),
            expect: vec![
                ("/cordoned", json!(false)),
                ("/drain", Value::Null),
                ("/noScheduleReasons", json!([])),
            ],
            events: vec![
                ev(
                    "node.no_schedule_reason_removed",
                    "noScheduleReasons",
                    Some("draining"),
                    None,
                ),
                ev("node.uncordoned", "cordoned", Some("true"), Some("false")),
            ],
            cause: "uncordonNode",
        },
        Success {
            name: "drain with a deadline",
            mutation: Mutation::Drain,
            state: Adopted,
            prep: plain,
            args: json!({ "reason": "firmware update", "deadline": deadline.to_rfc3339() }),
            expect: vec![
                ("/cordoned", json!(true)),
                ("/cordon/reason", json!("firmware update")),
                ("/cordon/by", json!(ACTOR)),
                ("/noScheduleReasons", json!(["draining"])),
            ],
            events: vec![
                ev("node.cordoned", "cordoned", Some("false"), Some("true")),
                ev(
                    "node.no_schedule_reason_added",
                    "noScheduleReasons",
                    None,
                    Some("draining"),
                ),
                ev("node.drain_started", "cordoned", None, None),
            ],
            cause: "drainNode",
        },
        Success {
            name: "drain a cordoned node, no deadline",
            mutation: Mutation::Drain,
            state: Adopted,
            prep: cordoned,
            args: json!({ "reason": "firmware update" }),
            expect: vec![
                ("/cordoned", json!(true)),
                // The first cordon's reason and author stay.
                ("/cordon/reason", json!("maintenance window")),
                ("/cordon/by", json!("user:setup")),
                ("/drain/deadline", Value::Null),
                ("/noScheduleReasons", json!(["draining"])),
            ],
            events: vec![
                ev(
                    "node.no_schedule_reason_added",
                    "noScheduleReasons",
                    None,
                    Some("draining"),
                ),
                ev("node.drain_started", "cordoned", None, None),
            ],
            cause: "drainNode",
        },
        Success {
            name: "taint NO_SCHEDULE",
            mutation: Mutation::Taint,
            state: Adopted,
            prep: plain,
            args: json!({ "key": "gpu-burn", "value": "running", "effect": "NO_SCHEDULE" }),
            expect: vec![
                (
                    "/taints",
                    json!([{ "key": "gpu-burn", "value": "running", "effect": "NO_SCHEDULE", "addedBy": ACTOR }]),
                ),
                ("/noScheduleReasons", json!(["taint:gpu-burn"])),
            ],
            events: vec![
                ev(
                    "node.tainted",
                    "taints",
                    None,
                    Some("gpu-burn=running:NoSchedule"),
                ),
                ev(
                    "node.no_schedule_reason_added",
                    "noScheduleReasons",
                    None,
                    Some("taint:gpu-burn"),
                ),
            ],
            cause: "taintNode",
        },
        Success {
            name: "taint PREFER_NO_SCHEDULE",
            mutation: Mutation::Taint,
            state: Adopted,
            prep: plain,
            args: json!({ "key": "example.com/slow", "effect": "PREFER_NO_SCHEDULE" }),
            expect: vec![
                (
                    "/taints",
                    json!([{ "key": "example.com/slow", "value": "", "effect": "PREFER_NO_SCHEDULE", "addedBy": ACTOR }]),
                ),
                ("/noScheduleReasons", json!([])),
            ],
            events: vec![ev(
                "node.tainted",
                "taints",
                None,
                Some("example.com/slow=:PreferNoSchedule"),
            )],
            cause: "taintNode",
        },
        Success {
            name: "taint replaced NO_SCHEDULE -> PREFER_NO_SCHEDULE",
            mutation: Mutation::Taint,
            state: Adopted,
            prep: tainted,
            args: json!({ "key": "gpu-burn", "value": "running", "effect": "PREFER_NO_SCHEDULE" }),
            expect: vec![
                ("/taints/0/effect", json!("PREFER_NO_SCHEDULE")),
                ("/taints/0/addedBy", json!(ACTOR)),
                ("/noScheduleReasons", json!([])),
            ],
            events: vec![
                ev(
                    "node.tainted",
                    "taints",
                    Some("gpu-burn=running:NoSchedule"),
                    Some("gpu-burn=running:PreferNoSchedule"),
                ),
                ev(
                    "node.no_schedule_reason_removed",
                    "noScheduleReasons",
                    Some("taint:gpu-burn"),
                    None,
                ),
            ],
            cause: "taintNode",
        },
        Success {
            name: "untaint",
            mutation: Mutation::Untaint,
            state: Adopted,
            prep: tainted,
            args: json!({ "key": "gpu-burn" }),
            expect: vec![("/taints", json!([])), ("/noScheduleReasons", json!([]))],
            events: vec![
                ev(
                    "node.untainted",
                    "taints",
                    Some("gpu-burn=running:NoSchedule"),
                    None,
                ),
                ev(
                    "node.no_schedule_reason_removed",
                    "noScheduleReasons",
                    Some("taint:gpu-burn"),
                    None,
                ),
            ],
            cause: "untaintNode",
        },
        Success {
            name: "label set",
            mutation: Mutation::Label,
            state: Adopted,
            prep: plain,
            args: json!({ "set": [{ "key": "gpu.example.com/model", "value": "H100" }] }),
            expect: vec![(
                "/labels",
                json!([{ "key": "gpu.example.com/model", "value": "H100" }]),
            )],
            events: vec![ev(
                "node.label_set",
                "labels",
                None,
                Some("gpu.example.com/model=H100"),
            )],
            cause: "labelNode",
        },
        Success {
            name: "label change and remove",
            mutation: Mutation::Label,
            state: Adopted,
            prep: labelled,
            args: json!({ "set": [{ "key": "rack", "value": "r14" }], "remove": ["zone"] }),
            expect: vec![("/labels", json!([{ "key": "rack", "value": "r14" }]))],
            events: vec![
                ev(
                    "node.label_set",
                    "labels",
                    Some("rack=r12"),
                    Some("rack=r14"),
                ),
                ev("node.label_removed", "labels", Some("zone=a"), None),
            ],
            cause: "labelNode",
        },
        Success {
            name: "adopt",
            mutation: Mutation::Adopt,
            state: Adopting,
            prep: plain,
            args: json!({}),
            expect: vec![("/provisionState", json!("ADOPTED"))],
            events: vec![ev(
                "node.provision_state_changed",
                "provisionState",
                Some("adopting"),
                Some("adopted"),
            )],
            cause: "provision:adopt",
        },
        Success {
            name: "retire",
            mutation: Mutation::Retire,
            state: Adopted,
            prep: plain,
            args: json!({ "reason": "end of life" }),
            expect: vec![
                ("/provisionState", json!("RETIRING")),
                ("/maintenance", json!(false)),
            ],
            events: vec![ev(
                "node.provision_state_changed",
                "provisionState",
                Some("adopted"),
                Some("retiring"),
            )],
            cause: "provision:retire",
        },
        Success {
            name: "transition DEPLOY",
            mutation: Mutation::Transition,
            state: Ready,
            prep: plain,
            args: json!({ "move": "DEPLOY" }),
            expect: vec![("/provisionState", json!("DEPLOYING"))],
            events: vec![ev(
                "node.provision_state_changed",
                "provisionState",
                Some("ready"),
                Some("deploying"),
            )],
            cause: "provision:deploy",
        },
        Success {
            name: "transition FAIL with a reason",
            mutation: Mutation::Transition,
            state: Deploying,
            prep: plain,
            args: json!({ "move": "FAIL", "reason": "image checksum mismatch" }),
            expect: vec![
                ("/provisionState", json!("FAILED")),
                ("/failedFrom", json!("DEPLOYING")),
                ("/maintenance", json!(true)),
                ("/maintenanceReason", json!("image checksum mismatch")),
                ("/schedulability/bucket", json!("MAINTENANCE")),
            ],
            events: vec![
                ev(
                    "node.provision_state_changed",
                    "provisionState",
                    Some("deploying"),
                    Some("failed"),
                ),
                ev(
                    "node.maintenance_on",
                    "maintenance",
                    Some("false"),
                    Some("true"),
                ),
            ],
            cause: "provision:fail",
        },
        Success {
            name: "transition FAIL without a reason",
            mutation: Mutation::Transition,
            state: Inspecting,
            prep: plain,
            args: json!({ "move": "FAIL" }),
            expect: vec![
                ("/failedFrom", json!("INSPECTING")),
                ("/maintenanceReason", json!("inspecting failed")),
            ],
            events: vec![
                ev(
                    "node.provision_state_changed",
                    "provisionState",
                    Some("inspecting"),
                    Some("failed"),
                ),
                ev(
                    "node.maintenance_on",
                    "maintenance",
                    Some("false"),
                    Some("true"),
                ),
            ],
            cause: "provision:fail",
        },
        Success {
            name: "transition RECOVER",
            mutation: Mutation::Transition,
            state: Failed,
            prep: failed_while_deploying,
            args: json!({ "move": "RECOVER" }),
            expect: vec![
                ("/provisionState", json!("DEPLOYING")),
                ("/failedFrom", Value::Null),
                ("/maintenance", json!(false)),
                ("/maintenanceReason", Value::Null),
            ],
            events: vec![
                ev(
                    "node.provision_state_changed",
                    "provisionState",
                    Some("failed"),
                    Some("deploying"),
                ),
                ev(
                    "node.maintenance_off",
                    "maintenance",
                    Some("true"),
                    Some("false"),
                ),
            ],
            cause: "provision:recover",
        },
        Success {
            name: "revokeNodeIdentity",
            mutation: Mutation::RevokeIdentity,
            state: Adopted,
            prep: plain,
            args: json!({ "reason": "key leaked" }),
            expect: vec![
                ("/identityGeneration", json!(2)),
                ("/provisionState", json!("ADOPTED")),
            ],
            events: vec![ev(
                "node.identity_revoked",
                "identityGeneration",
                Some("1"),
                Some("2"),
            )],
            cause: "revokeIdentity",
        },
        Success {
            name: "deleteNode",
            mutation: Mutation::Delete,
            state: Retired,
            prep: plain,
            args: json!({}),
            expect: vec![("/identityGeneration", json!(2))],
            events: vec![
                ev(
                    "node.identity_revoked",
                    "identityGeneration",
                    Some("1"),
                    Some("2"),
                ),
                ev(
                    "node.deleted",
                    "lifecycle",
                    Some("present"),
                    Some("deleted"),
                ),
            ],
            cause: "deleteNode",
        },
    ]
}

/// Runs one success case: the fields change, `version` goes up by exactly one, and the
/// node's history holds exactly the expected events, by `user:alice`, with the cause.
async fn check_success(
    s: &TestServer,
    place: &(bc_core::ids::SiteId, bc_core::ids::PoolId),
    case: &Success,
) {
    let label = format!("{} ({:?})", case.name, s.backend);
    let before = fixture(s, place, case.state, case.prep, 1).await;
    let response = call(
        s,
        Some(&token(s, case.mutation.role())),
        case.mutation,
        id_of(&before),
        1,
        &case.args,
    )
    .await;
    assert_eq!(response.status, 200, "{label}");
    let after = &response.data()[case.mutation.field()]["node"];
    assert_eq!(
        after["version"],
        json!(2),
        "{label}: version goes up by exactly 1"
    );
    for (pointer, want) in &case.expect {
        assert_eq!(
            after.pointer(pointer),
            Some(want),
            "{label}: {pointer} in {after:#}"
        );
    }
    let want: Vec<(String, String, Option<String>, Option<String>)> = case
        .events
        .iter()
        .map(|(t, a, f, to)| {
            (
                (*t).to_owned(),
                (*a).to_owned(),
                f.map(str::to_owned),
                to.map(str::to_owned),
            )
        })
        .collect();
    assert_eq!(event_summary(after), want, "{label}: events");
    for event in events(after) {
        assert_eq!(event["actor"], json!(ACTOR), "{label}: actor of {event}");
        assert_eq!(
            event["cause"],
            json!(case.cause),
            "{label}: cause of {event}"
        );
        assert_eq!(
            event["data"]["version"],
            json!(2),
            "{label}: the event names the version it produced"
        );
    }
    if case.mutation != Mutation::Delete {
        // What the mutation answered is what was stored.
        assert_eq!(&node(s, id_of(&before)).await, after, "{label}: stored");
    }
}

#[tokio::test]
async fn every_mutation_changes_its_fields_bumps_the_version_once_and_records_events() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let cases = success_cases(now(s));
        for m in Mutation::ALL {
            assert!(
                cases.iter().any(|c| c.mutation == m),
                "{m:?} has no success case"
            );
        }
        for case in &cases {
            check_success(s, &place, case).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_stale_version_is_a_conflict_naming_the_current_version() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        // (mutation, the version passed) against a node at version 7.
        let cases: Vec<(Mutation, i64)> = Mutation::ALL
            .into_iter()
            .map(|m| (m, 6))
            .chain([(Mutation::Cordon, 1), (Mutation::Cordon, 8)])
            .collect();
        for (m, version) in cases {
            let label = format!("{m:?} at version {version} ({:?})", s.backend);
            let (state, prep, args) = m.valid();
            let before = fixture(s, &place, state, prep, 7).await;
            let response = call(
                s,
                Some(&token(s, m.role())),
                m,
                id_of(&before),
                version,
                &args,
            )
            .await;
            assert_refused(&response, 200, "CONFLICT", &label);
            assert_eq!(
                extensions(&response)["currentVersion"],
                json!(7),
                "{label}: {:#}",
                response.body
            );
            assert_unchanged(s, &before, &label).await;
            // The version the error names is the one that works.
            let retry = call(s, Some(&token(s, m.role())), m, id_of(&before), 7, &args).await;
            assert_eq!(
                retry.data()[m.field()]["node"]["version"],
                json!(8),
                "{label}: retry"
            );
        }
    })
    .await;
}

/// The `provisionState` moves from a state the table does not allow them from.
#[tokio::test]
async fn a_provision_move_from_a_wrong_state_is_invalid_state() {
    // (mutation, state, arguments, the attempted move as the error names it)
    let cases: Vec<(Mutation, ProvisionState, Value, &str)> = vec![
        (Mutation::Adopt, Adopted, json!({}), "adopt"),
        (Mutation::Adopt, Enrolling, json!({}), "adopt"),
        (Mutation::Adopt, Failed, json!({}), "adopt"),
        (
            Mutation::Retire,
            Deployed,
            json!({ "reason": "eol" }),
            "retire",
        ),
        (
            Mutation::Retire,
            Retired,
            json!({ "reason": "eol" }),
            "retire",
        ),
        (
            Mutation::Retire,
            Adopting,
            json!({ "reason": "eol" }),
            "retire",
        ),
        (
            Mutation::Transition,
            Adopted,
            json!({ "move": "DEPLOY" }),
            "deploy",
        ),
        (
            Mutation::Transition,
            Ready,
            json!({ "move": "FINISH_RETIRE" }),
            "finish-retire",
        ),
        (
            Mutation::Transition,
            Deployed,
            json!({ "move": "RECOVER" }),
            "recover",
        ),
        (
            Mutation::Transition,
            Retired,
            json!({ "move": "FAIL" }),
            "fail",
        ),
        (
            Mutation::Transition,
            Rescue,
            json!({ "move": "RESCUE" }),
            "rescue",
        ),
        (Mutation::Delete, Deployed, json!({}), "delete"),
        (Mutation::Delete, Adopted, json!({}), "delete"),
        (Mutation::Delete, Ready, json!({}), "delete"),
    ];
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        for (m, state, args, attempted) in &cases {
            let label = format!("{m:?} {args} from {state} ({:?})", s.backend);
            let before = fixture(s, &place, *state, plain, 1).await;
            let response = call(s, Some(&token(s, m.role())), *m, id_of(&before), 1, args).await;
            assert_refused(&response, 200, "INVALID_STATE", &label);
            // The domain's error, in the API's words.
            let ApiError::InvalidState {
                message,
                current,
                attempted: want_attempted,
                allowed,
            } = ApiError::from(invalid_state(*state, attempted))
            else {
                unreachable!("invalid_state builds INVALID_STATE")
            };
            let ext = extensions(&response);
            assert_eq!(ext["current"], json!(current), "{label}");
            assert_eq!(ext["attempted"], json!(want_attempted), "{label}");
            assert_eq!(ext["allowed"], json!(allowed), "{label}");
            assert_eq!(response.error()["message"], json!(message), "{label}");
            assert_unchanged(s, &before, &label).await;
        }
    })
    .await;
}

#[tokio::test]
async fn a_caller_without_the_role_is_forbidden() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let mut checked = 0;
        for m in Mutation::ALL {
            for role in [Role::Viewer, Role::Operator] {
                if role >= m.role() {
                    continue;
                }
                let label = format!("{m:?} as {role} ({:?})", s.backend);
                let (state, prep, args) = m.valid();
                let before = fixture(s, &place, state, prep, 1).await;
                let response = call(s, Some(&token(s, role)), m, id_of(&before), 1, &args).await;
                assert_refused(&response, 200, "FORBIDDEN", &label);
                assert_unchanged(s, &before, &label).await;
                checked += 1;
            }
        }
        // Every mutation for a viewer, and revokeNodeIdentity and deleteNode for an operator.
        assert_eq!(checked, 13);
    })
    .await;
}

#[tokio::test]
async fn a_request_without_valid_credentials_is_401_unauthenticated() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let other_secret =
            TokenKeys::new(b"not-the-server-secret-0123456789abcdef", "better-compute")
                .expect("a valid secret")
                .mint(
                    SUBJECT,
                    &[Role::Admin],
                    None,
                    Duration::hours(1),
                    Utc::now(),
                )
                .expect("minting");
        let credentials: Vec<(&str, Option<String>)> = vec![
            ("no token", None),
            (
                "an expired token",
                Some(s.mint(SUBJECT, Role::Admin, None, Duration::seconds(-60))),
            ),
            ("a token signed with another secret", Some(other_secret)),
            (
                "a token for another audience",
                Some(s.mint_for_audience(SUBJECT, Role::Admin, "someone-else", Duration::hours(1))),
            ),
            ("not a JWT", Some("not-a-jwt".to_owned())),
        ];
        for m in Mutation::ALL {
            let (state, prep, args) = m.valid();
            let before = fixture(s, &place, state, prep, 1).await;
            for (what, credential) in &credentials {
                let label = format!("{m:?} with {what} ({:?})", s.backend);
                let response = call(s, credential.as_deref(), m, id_of(&before), 1, &args).await;
                assert_refused(&response, 401, "UNAUTHENTICATED", &label);
            }
            assert_unchanged(s, &before, &format!("{m:?} unauthenticated")).await;
        }
    })
    .await;
}

struct BadInput {
    name: String,
    mutation: Mutation,
    state: ProvisionState,
    prep: Prep,
    /// Replaces the node's id when set.
    id: Option<&'static str>,
    args: Value,
}

fn bad_input_cases(now: DateTime<Utc>) -> Vec<BadInput> {
    let case = |name: &str, mutation: Mutation, args: Value| BadInput {
        name: name.to_owned(),
        mutation,
        state: Adopted,
        prep: plain,
        id: None,
        args,
    };
    let long_name = "x".repeat(64);
    let mut cases: Vec<BadInput> = Mutation::ALL
        .into_iter()
        .flat_map(|m| {
            let (state, prep, args) = m.valid();
            ["site_x", "node_", "node_a b", "gpu-001"].map(|id| BadInput {
                name: format!("{m:?} with the id `{id}`"),
                mutation: m,
                state,
                prep,
                id: Some(id),
                args: args.clone(),
            })
        })
        .collect();
    cases.extend([
        case(
            "an empty cordon reason",
            Mutation::Cordon,
            json!({ "reason": "" }),
        ),
        case(
            "a blank cordon reason",
            Mutation::Cordon,
            json!({ "reason": "  \t " }),
        ),
        case(
            "a cordon reason over 1024 bytes",
            Mutation::Cordon,
            json!({ "reason": "r".repeat(1025) }),
        ),
        case(
            "an empty drain reason",
            Mutation::Drain,
            json!({ "reason": "" }),
        ),
        case(
            "a drain deadline in the past",
            Mutation::Drain,
            json!({ "reason": "x", "deadline": (now - Duration::minutes(1)).to_rfc3339() }),
        ),
        case(
            "a drain deadline of now",
            Mutation::Drain,
            json!({ "reason": "x", "deadline": now.to_rfc3339() }),
        ),
        case(
            // The wall clock's future, the server clock's past: the server asks its clock.
            "a drain deadline before the server's clock",
            Mutation::Drain,
            json!({ "reason": "x", "deadline": (Utc::now() + Duration::hours(1)).to_rfc3339() }),
        ),
        case(
            "a taint key with a space",
            Mutation::Taint,
            json!({ "key": "gpu burn" }),
        ),
        case(
            "a taint key starting with -",
            Mutation::Taint,
            json!({ "key": "-gpu" }),
        ),
        case(
            "a taint key with two slashes",
            Mutation::Taint,
            json!({ "key": "a/b/c" }),
        ),
        case("an empty taint key", Mutation::Taint, json!({ "key": "" })),
        case(
            "a taint value with a space",
            Mutation::Taint,
            json!({ "key": "gpu-burn", "value": "still running" }),
        ),
        case(
            "a label key starting with -",
            Mutation::Label,
            json!({ "set": [{ "key": "-rack", "value": "r1" }] }),
        ),
        case(
            "a label key with a space",
            Mutation::Label,
            json!({ "set": [{ "key": "Bad Key", "value": "r1" }] }),
        ),
        case(
            "a label key with an empty name",
            Mutation::Label,
            json!({ "set": [{ "key": "example.com/", "value": "r1" }] }),
        ),
        case(
            "a label key with a bad prefix",
            Mutation::Label,
            json!({ "set": [{ "key": "-bad-.com/rack", "value": "r1" }] }),
        ),
        case(
            "a label key over 63 characters",
            Mutation::Label,
            json!({ "set": [{ "key": long_name, "value": "r1" }] }),
        ),
        case(
            "a label value over 63 characters",
            Mutation::Label,
            json!({ "set": [{ "key": "rack", "value": long_name }] }),
        ),
        case(
            "a label value with a slash",
            Mutation::Label,
            json!({ "set": [{ "key": "rack", "value": "r1/2" }] }),
        ),
        case(
            "a label both set and removed",
            Mutation::Label,
            json!({ "set": [{ "key": "rack", "value": "r1" }], "remove": ["rack"] }),
        ),
        case(
            "a label set twice",
            Mutation::Label,
            json!({ "set": [{ "key": "rack", "value": "r1" }, { "key": "rack", "value": "r2" }] }),
        ),
        case(
            "valid labels beside an invalid one",
            Mutation::Label,
            json!({ "set": [{ "key": "rack", "value": "r1" }, { "key": "-x", "value": "y" }] }),
        ),
    ]);
    cases.push(BadInput {
        name: "RECOVER without a recorded failedFrom".to_owned(),
        mutation: Mutation::Transition,
        state: Failed,
        prep: failed_without_origin,
        id: None,
        args: json!({ "move": "RECOVER" }),
    });
    cases
}

#[tokio::test]
async fn malformed_input_is_bad_user_input() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        // Move the server's clock a day ahead of the wall clock.
        s.clock.advance(Duration::days(1));
        for case in bad_input_cases(now(s)) {
            let label = format!("{} ({:?})", case.name, s.backend);
            let before = fixture(s, &place, case.state, case.prep, 1).await;
            let id = case.id.unwrap_or_else(|| id_of(&before));
            let response = call(
                s,
                Some(&token(s, Role::Admin)),
                case.mutation,
                id,
                1,
                &case.args,
            )
            .await;
            assert_refused(&response, 200, "BAD_USER_INPUT", &label);
            assert_unchanged(s, &before, &label).await;
        }
        let response = fetch_node(s, "site_x").await;
        assert_eq!(
            response.code(),
            Some("BAD_USER_INPUT"),
            "node(site_x): {:#}",
            response.body
        );
    })
    .await;
}

#[tokio::test]
async fn an_unknown_node_or_taint_is_not_found() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let unknown = NodeId::generate();
        for m in Mutation::ALL {
            let label = format!("{m:?} on an unknown node ({:?})", s.backend);
            let (_, _, args) = m.valid();
            let response = call(
                s,
                Some(&token(s, Role::Admin)),
                m,
                unknown.as_str(),
                1,
                &args,
            )
            .await;
            assert_refused(&response, 200, "NOT_FOUND", &label);
        }
        let response = fetch_node(s, unknown.as_str()).await;
        assert_eq!(
            response.code(),
            Some("NOT_FOUND"),
            "node(unknown): {:#}",
            response.body
        );

        let before = fixture(s, &place, Adopted, tainted, 1).await;
        let response = call(
            s,
            Some(&token(s, Role::Operator)),
            Mutation::Untaint,
            id_of(&before),
            1,
            &json!({ "key": "no-such-taint" }),
        )
        .await;
        assert_refused(&response, 200, "NOT_FOUND", "untaint an absent key");
        assert_unchanged(s, &before, "untaint an absent key").await;
    })
    .await;
}

/// A call that asks for what already holds succeeds without a new version or an event.
#[tokio::test]
async fn a_call_that_changes_nothing_keeps_the_version_and_writes_no_event() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let deadline = drain_deadline(now(s));
        let cases: Vec<(&str, Mutation, Prep, Value)> = vec![
            (
                "cordon a cordoned node",
                Mutation::Cordon,
                cordoned,
                json!({ "reason": "another reason" }),
            ),
            (
                "uncordon an uncordoned node",
                Mutation::Uncordon,
                plain,
                json!({}),
            ),
            (
                "drain a draining node with its deadline",
                Mutation::Drain,
                draining,
                json!({ "reason": "firmware update", "deadline": deadline.to_rfc3339() }),
            ),
            (
                "taint with the same key, value and effect",
                Mutation::Taint,
                tainted,
                json!({ "key": "gpu-burn", "value": "running", "effect": "NO_SCHEDULE" }),
            ),
            (
                "label with the values it has",
                Mutation::Label,
                labelled,
                json!({ "set": [{ "key": "rack", "value": "r12" }] }),
            ),
            (
                "remove an absent label",
                Mutation::Label,
                labelled,
                json!({ "remove": ["absent"] }),
            ),
            ("label nothing", Mutation::Label, plain, json!({})),
        ];
        for (name, m, prep, args) in &cases {
            let label = format!("{name} ({:?})", s.backend);
            let before = fixture(s, &place, Adopted, *prep, 1).await;
            let response = call(s, Some(&token(s, m.role())), *m, id_of(&before), 1, args).await;
            let after = &response.data()[m.field()]["node"];
            assert_eq!(after, &before, "{label}: the answer is the node as it was");
            assert_eq!(after["version"], json!(1), "{label}");
            assert!(events(after).is_empty(), "{label}: no event");
            assert_unchanged(s, &before, &label).await;
        }
    })
    .await;
}

fn time(value: &Value) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(value.as_str().expect("a DateTime string"))
        .expect("RFC 3339")
        .with_timezone(&Utc)
}

#[tokio::test]
async fn drain_cordons_and_keeps_draining_with_its_deadline_until_uncordon() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let operator = token(s, Role::Operator);
        let before = fixture(s, &place, Adopted, plain, 1).await;
        let id = id_of(&before);
        let started = now(s);
        let deadline = started + Duration::hours(2);

        let response = call(
            s,
            Some(&operator),
            Mutation::Drain,
            id,
            1,
            &json!({ "reason": "firmware update", "deadline": deadline.to_rfc3339() }),
        )
        .await;
        let drained = response.data()["drainNode"]["node"].clone();
        assert_eq!(drained["cordoned"], json!(true));
        assert_eq!(
            time(&drained["cordon"]["at"]),
            started,
            "the server's clock"
        );
        assert_eq!(time(&drained["drain"]["startedAt"]), started);
        assert_eq!(time(&drained["drain"]["deadline"]), deadline);
        assert_eq!(drained["noScheduleReasons"], json!(["draining"]));
        let draining_reason = json!({
            "reason": "draining",
            "setBy": ACTOR,
            "clearedBy": ReasonKey::Draining.cleared_by(),
        });
        assert_eq!(
            drained["schedulability"]["reasons"],
            json!([draining_reason])
        );
        let detail = &drained["noScheduleReasonDetails"][0];
        assert_eq!(
            detail["detail"],
            json!(format!("deadline {}", deadline.to_rfc3339()))
        );
        assert_eq!(time(&detail["since"]), started);
        assert_eq!(node(s, id).await, drained, "stored as answered");

        // Draining again with a later deadline keeps the start and moves the deadline.
        s.clock.advance(Duration::minutes(10));
        let later = deadline + Duration::hours(1);
        let response = call(
            s,
            Some(&operator),
            Mutation::Drain,
            id,
            2,
            &json!({ "reason": "firmware update", "deadline": later.to_rfc3339() }),
        )
        .await;
        let redrained = response.data()["drainNode"]["node"].clone();
        assert_eq!(redrained["version"], json!(3));
        assert_eq!(time(&redrained["drain"]["startedAt"]), started);
        assert_eq!(time(&redrained["drain"]["deadline"]), later);
        assert_eq!(
            redrained["noScheduleReasonDetails"][0]["detail"],
            json!(format!("deadline {}", later.to_rfc3339()))
        );
        assert_eq!(
            event_summary(&redrained).last().map(|e| e.0.clone()),
            Some("node.drain_started".to_owned())
        );
        assert_eq!(node(s, id).await, redrained, "stored as answered");

        let response = call(s, Some(&operator), Mutation::Uncordon, id, 3, &json!({})).await;
        let uncordoned = &response.data()["uncordonNode"]["node"];
        assert_eq!(uncordoned["version"], json!(4));
        assert_eq!(uncordoned["cordoned"], json!(false));
        assert_eq!(uncordoned["cordon"], Value::Null);
        assert_eq!(uncordoned["drain"], Value::Null);
        assert_eq!(uncordoned["noScheduleReasons"], json!([]));
        assert_eq!(uncordoned["schedulability"]["reasons"], json!([]));
        assert_eq!(&node(s, id).await, uncordoned);
    })
    .await;
}

/// Two changes of one node at once, at the same version, are one change and one `CONFLICT`,
/// never an internal error. On PostgreSQL the second waits for the first's lock and then reads
/// the node as the first left it, its row and child rows alike: each adds a taint, which is a
/// no-schedule reason in the row's column and a detail row, and a row read newer than its
/// child rows would disagree with them (a corrupt node).
#[tokio::test]
async fn two_changes_of_one_node_at_once_are_one_change_and_one_conflict() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let operator = token(s, Role::Operator);
        for round in 0..20 {
            let before = fixture(s, &place, Adopted, plain, 1).await;
            let id = id_of(&before);
            let (race_a, race_b) = (json!({ "key": "race-a" }), json!({ "key": "race-b" }));
            let (a, b) = tokio::join!(
                call(s, Some(&operator), Mutation::Taint, id, 1, &race_a),
                call(s, Some(&operator), Mutation::Taint, id, 1, &race_b),
            );
            let mut codes = [a.code(), b.code()];
            codes.sort();
            assert_eq!(
                codes,
                [None, Some("CONFLICT")],
                "round {round} ({:?}): {:#} and {:#}",
                s.backend,
                a.body,
                b.body
            );
            let after = node(s, id).await;
            assert_eq!(after["version"], json!(2));
            assert_eq!(after["taints"].as_array().map(Vec::len), Some(1));
        }
    })
    .await;
}

#[tokio::test]
async fn a_no_schedule_taint_is_a_reason_with_what_clears_it_until_untainted() {
    /// Otherwise schedulable: converged, connected, adopted, platform host.
    fn schedulable(n: &mut NodeRecord, _: DateTime<Utc>) {
        n.observed_generation = 1;
        n.connectivity = bc_core::axes::Connectivity::Connected;
    }
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let operator = token(s, Role::Operator);
        let before = fixture(s, &place, Adopted, schedulable, 1).await;
        let id = id_of(&before);
        assert_eq!(before["schedulability"]["schedulable"], json!(true));
        assert_eq!(before["schedulability"]["bucket"], json!("SCHEDULABLE"));

        // NO_SCHEDULE is the default effect.
        let response = call(
            s,
            Some(&operator),
            Mutation::Taint,
            id,
            1,
            &json!({ "key": "gpu-burn" }),
        )
        .await;
        let tainted = response.data()["taintNode"]["node"].clone();
        assert_eq!(tainted["taints"][0]["effect"], json!("NO_SCHEDULE"));
        assert_eq!(tainted["noScheduleReasons"], json!(["taint:gpu-burn"]));
        let schedulability = &tainted["schedulability"];
        assert_eq!(schedulability["schedulable"], json!(false));
        assert_eq!(schedulability["bucket"], json!("UNHEALTHY"));
        assert_eq!(
            schedulability["failingChecks"],
            json!([{ "check": "NO_REASONS", "bucket": "UNHEALTHY" }])
        );
        let cleared_by = ReasonKey::Taint("gpu-burn".into()).cleared_by();
        assert!(cleared_by.contains("untaintNode"), "{cleared_by}");
        assert_eq!(
            schedulability["reasons"],
            json!([{ "reason": "taint:gpu-burn", "setBy": ACTOR, "clearedBy": cleared_by }])
        );
        assert_eq!(node(s, id).await, tainted, "stored as answered");

        // A PREFER_NO_SCHEDULE taint beside it is no reason.
        let response = call(
            s,
            Some(&operator),
            Mutation::Taint,
            id,
            2,
            &json!({ "key": "slow-nic", "effect": "PREFER_NO_SCHEDULE" }),
        )
        .await;
        assert_eq!(
            response.data()["taintNode"]["node"]["noScheduleReasons"],
            json!(["taint:gpu-burn"])
        );

        let response = call(
            s,
            Some(&operator),
            Mutation::Untaint,
            id,
            3,
            &json!({ "key": "gpu-burn" }),
        )
        .await;
        let untainted = &response.data()["untaintNode"]["node"];
        assert_eq!(untainted["version"], json!(4));
        assert_eq!(untainted["noScheduleReasons"], json!([]));
        assert_eq!(untainted["schedulability"]["reasons"], json!([]));
        assert_eq!(untainted["schedulability"]["schedulable"], json!(true));
        assert_eq!(untainted["taints"][0]["key"], json!("slow-nic"));
        assert_eq!(&node(s, id).await, untainted);
    })
    .await;
}

#[tokio::test]
async fn a_deleted_node_is_gone_from_the_api_but_its_history_stays() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let admin = token(s, Role::Admin);
        let kept = fixture(s, &place, Retired, plain, 1).await;
        let before = fixture(s, &place, Retired, plain, 1).await;
        let id = id_of(&before).to_owned();

        let response = call(
            s,
            Some(&admin),
            Mutation::Label,
            &id,
            1,
            &json!({ "set": [{ "key": "rack", "value": "r1" }] }),
        )
        .await;
        assert_eq!(response.data()["labelNode"]["node"]["version"], json!(2));
        let response = call(s, Some(&admin), Mutation::Delete, &id, 2, &json!({})).await;
        let deleted = &response.data()["deleteNode"]["node"];
        assert_eq!(deleted["version"], json!(3));
        assert_eq!(deleted["identityGeneration"], json!(2));

        let response = fetch_node(s, &id).await;
        assert_eq!(response.code(), Some("NOT_FOUND"), "{:#}", response.body);
        let listed = s
            .admin(
                "query { all: nodes(first: 1000) { totalCount nodes { id } } retired: nodes(filter: {provisionState: [RETIRED]}) { totalCount nodes { id } } }",
                json!({}),
            )
            .await;
        for list in ["all", "retired"] {
            assert_eq!(
                listed[list],
                json!({ "totalCount": 1, "nodes": [{ "id": id_of(&kept) }] }),
                "{list}"
            );
        }
        for (m, args) in [
            (Mutation::Cordon, json!({ "reason": "x" })),
            (Mutation::Delete, json!({})),
            (Mutation::RevokeIdentity, json!({ "reason": "x" })),
        ] {
            let response = call(s, Some(&admin), m, &id, 3, &args).await;
            assert_refused(&response, 200, "NOT_FOUND", &format!("{m:?} on a deleted node"));
        }

        // The history stays in the log, newest first; the identity was revoked first.
        let services = &s.server.services;
        let node_id = NodeId::parse(&id).expect("id");
        let history = services
            .node_history(&node_id, None, 100)
            .await
            .unwrap_or_else(|err| panic!("reading events: {}", err.message()));
        let summary: Vec<(&str, Option<&str>, Option<&str>, &str)> = history
            .iter()
            .map(|e| {
                (
                    e.event_type.as_static_str(),
                    e.from.as_deref(),
                    e.to.as_deref(),
                    e.cause.as_deref().unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("node.deleted", Some("present"), Some("deleted"), "deleteNode"),
                ("node.identity_revoked", Some("1"), Some("2"), "deleteNode"),
                ("node.label_set", None, Some("rack=r1"), "labelNode"),
            ]
        );
        assert!(history[1].id < history[0].id, "identity revoked before the delete");
        assert!(history.iter().all(|e| e.actor.to_string() == ACTOR));

        // The row stays (soft delete) with the bumped identity generation.
        let stored = services
            .node_record(&node_id)
            .await
            .unwrap_or_else(|err| panic!("reading the node: {}", err.message()))
            .expect("the row stays");
        assert_eq!(stored.identity_generation, 2);
        assert_eq!(stored.deleted_at, Some(now(s)));
    })
    .await;
}

/// A deadline finer than a microsecond is kept as the databases keep it, so the answer is
/// what is stored and draining again with it changes nothing, on both backends.
#[tokio::test]
async fn a_drain_deadline_is_kept_to_the_microsecond() {
    each_backend(async |s| {
        let place = crate::common::site_and_pool(s).await;
        let operator = token(s, Role::Operator);
        let before = fixture(s, &place, Adopted, plain, 1).await;
        let id = id_of(&before);
        let deadline = "2099-01-01T12:00:00.123456789Z";
        let args = json!({ "reason": "firmware update", "deadline": deadline });
        let response = call(s, Some(&operator), Mutation::Drain, id, 1, &args).await;
        let drained = response.data()["drainNode"]["node"].clone();
        assert_eq!(
            time(&drained["drain"]["deadline"]),
            time(&json!("2099-01-01T12:00:00.123456Z")),
            "{:?}",
            s.backend
        );
        assert_eq!(
            node(s, id).await,
            drained,
            "{:?}: stored as answered",
            s.backend
        );
        let again = call(s, Some(&operator), Mutation::Drain, id, 2, &args).await;
        assert_eq!(
            again.data()["drainNode"]["node"],
            drained,
            "{:?}: the same drain again changes nothing",
            s.backend
        );
    })
    .await;
}
