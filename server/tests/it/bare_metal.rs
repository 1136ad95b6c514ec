//! Bare metal through the BMC (issue 14): enrolment by BMC with sealed credentials, the
//! Redfish power driver, the Power controller and power actions. Against OpenStack's Redfish
//! emulator (`sushy-emulator`, fake driver, TLS and basic auth: `bc_testing::bmc`) for real,
//! and against the in-repo stub for the faults the emulator cannot produce. The Power
//! controller is ticked by hand.

use crate::common;
use bc_core::bare_metal::{BmcTlsVerification, PowerAction, PowerDriverKind};
use bc_core::clock::Clock;
use bc_core::ids::{AllocationId, ReservationId};
use bc_testing::bmc::{BmcStub, StubMode, SushyEmulator, SushyOptions, SushySystem};
use bc_testing::{Gql, TestServer, each_backend, each_backend_with};
use better_compute::bmc::{BmcEndpoint, BmcError, BmcTls, DriverSettings};
use better_compute::controllers::PowerController;
use better_compute::credentials::BmcCredentials;
use sea_orm::EntityTrait;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const VIEW: &str = "bareMetalNode { node { id version provisionState hardwareKeyTrusted conditions { type status reason } } power powerDriver bmcReachable bmc { address systemId systemPath tlsVerification reachable lastError consecutiveFailures lastPolledAt nextPollAt } }";

/// `enrollBareMetalNode` with this BMC input and the system's identifiers.
async fn enroll(
    s: &TestServer,
    (site, pool): &(String, String),
    bmc: Value,
    uuid: &str,
    serial: &str,
) -> Gql {
    s.gql(
        Some(s.admin_token()),
        &format!("mutation($input: EnrollBareMetalNodeInput!) {{ enrollBareMetalNode(input: $input) {{ {VIEW} }} }}"),
        json!({ "input": {
            "hostname": format!("metal-{}.dc1.example.com", &uuid[uuid.len() - 4..]),
            "siteId": site, "poolId": pool, "bmc": bmc,
            "identifiers": [
                { "name": "system-uuid", "value": uuid },
                { "name": "system-serial", "value": serial },
            ],
        } }),
    )
    .await
}

async fn view(s: &TestServer, id: &str) -> Value {
    s.admin(
        &format!(
            "query($id: ID!) {{ {} }}",
            VIEW.replacen("bareMetalNode", "bareMetalNode(id: $id)", 1)
        ),
        json!({ "id": id }),
    )
    .await["bareMetalNode"]
        .clone()
}

async fn power_node(s: &TestServer, id: &str, version: i64, action: &str, force: bool) -> Gql {
    s.gql(
        Some(s.admin_token()),
        &format!("mutation($input: PowerNodeInput!) {{ powerNode(input: $input) {{ {VIEW} }} }}"),
        json!({ "input": { "id": id, "version": version, "action": action, "force": force } }),
    )
    .await
}

async fn tick(s: &TestServer) -> better_compute::controllers::PowerReport {
    PowerController::new(s.server.services.clone())
        .tick()
        .await
        .unwrap_or_else(|err| panic!("power tick: {}", err.message()))
}

/// Ticks (moving the test clock past the poll interval) until `done` holds for the view,
/// within `limit` of real time: the emulator applies power changes when it is next read.
async fn tick_until(
    s: &TestServer,
    id: &str,
    limit: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let mut first = true;
    let step = async || {
        if !first {
            s.clock.advance(chrono::Duration::seconds(120));
        }
        first = false;
        tick(s).await;
        view(s, id).await
    };
    common::poll_until(limit, Duration::from_millis(200), step, done).await
}

fn emulator_bmc(emulator: &SushyEmulator, system_id: Option<&str>, password: &str) -> Value {
    json!({
        "address": emulator.url, "systemId": system_id,
        "username": emulator.options.username, "password": password,
        "caCertificate": emulator.ca_pem,
    })
}

fn node_id(v: &Value) -> String {
    v["node"]["id"].as_str().expect("a node id").to_owned()
}

fn version(v: &Value) -> i64 {
    v["node"]["version"].as_i64().expect("a version")
}

#[tokio::test]
async fn enrolment_by_bmc_seals_the_credentials_and_seeds_the_hardware_key() {
    each_backend(async |s| {
        let place = common::metal_pool(s, "redfish").await;
        let bmc = json!({ "address": "https://bmc-7.dc1.example.com", "username": "root", "password": "calvin-pw-123" });
        let uuid = "4c4c4544-0042-3510-8051-b7c04f4e3732";
        let answer = enroll(s, &place, bmc.clone(), uuid, "SN-7").await;
        let v = answer.data()["enrollBareMetalNode"]["bareMetalNode"].clone();
        assert_eq!(v["node"]["provisionState"], "ENROLLING");
        assert_eq!(v["node"]["hardwareKeyTrusted"], true, "the identifiers seed the key");
        assert_eq!(v["power"], "UNKNOWN");
        assert_eq!(v["powerDriver"], "REDFISH");
        assert_eq!(v["bmc"]["address"], "https://bmc-7.dc1.example.com/");
        assert_eq!(v["bmc"]["tlsVerification"], "VERIFY");
        assert_eq!(v["bmc"]["reachable"], Value::Null, "not polled yet");
        assert!(!answer.body.to_string().contains("calvin"), "the password is never answered");

        // At rest: sealed, bound to the node, under the key file created at start.
        let db = s.database().await;
        let rows = bc_entity::node_bmc::Entity::find().all(&db).await.expect("rows");
        assert_eq!(rows.len(), 1);
        assert!(!rows[0].sealed_credentials.contains("calvin") && !rows[0].sealed_credentials.contains("root"));
        assert_eq!(rows[0].tls_verification, BmcTlsVerification::Verify.to_string());
        let opened = BmcCredentials::open(&s.server.services.bare_metal.key, &rows[0].node_id, &rows[0].sealed_credentials)
            .expect("opens with the server's key");
        assert_eq!(opened.password, "calvin-pw-123");
        let key_file = s.server.services.bare_metal.key.id().to_owned();
        assert_eq!(rows[0].credential_key_id, key_file);

        // The same machine again (its identifiers) is refused, naming the node; nothing is written.
        let again = enroll(s, &place, bmc.clone(), uuid, "SN-7").await;
        assert_eq!(again.code(), Some("BAD_USER_INPUT"), "{:#}", again.body);
        assert!(again.message().contains(&node_id(&v)), "{}", again.message());
        // The daemon that boots on it later is recognised as this node (the enrolment path
        // `enrollNode` uses): its identifiers find it.
        let nodes = s.admin("{ nodes { totalCount } }", json!({})).await;
        assert_eq!(nodes["nodes"]["totalCount"], 1);
        db.close().await.expect("closing");
    })
    .await;
}

#[tokio::test]
async fn bad_bmc_input_is_refused_with_its_field_and_nothing_is_written() {
    each_backend(async |s| {
        let place = common::metal_pool(s, "redfish").await;
        let cases = [
            (json!({ "address": "http://10.0.0.5", "username": "u", "password": "p" }), "input.bmc.address"),
            (json!({ "address": "https://u:p@10.0.0.5", "username": "u", "password": "p" }), "input.bmc.address"),
            (json!({ "address": "https://10.0.0.5/redfish/v1", "username": "u", "password": "p" }), "input.bmc.address"),
            (json!({ "address": "https://10.0.0.5", "username": "", "password": "p" }), "input.bmc.username"),
            (json!({ "address": "https://10.0.0.5", "systemId": "../x", "username": "u", "password": "p" }), "input.bmc.systemId"),
            (json!({ "address": "https://10.0.0.5", "username": "u", "password": "p", "caCertificate": "not pem" }), "input.bmc.caCertificate"),
            (json!({ "address": "https://10.0.0.5", "username": "u", "password": "p", "verifyTls": false, "caCertificate": "x" }), "input.bmc.caCertificate"),
        ];
        for (i, (bmc, field)) in cases.into_iter().enumerate() {
            let answer = enroll(s, &place, bmc, &format!("4c4c4544-0042-3510-8051-b7c04f4e37{i:02}"), "SN").await;
            assert_eq!(answer.code(), Some("BAD_USER_INPUT"), "{field}: {:#}", answer.body);
            assert_eq!(answer.error()["extensions"]["field"], field, "{:#}", answer.body);
        }
        assert!(
            enroll(s, &place, json!({ "address": "http://10.0.0.5", "username": "u", "password": "p" }), "4c4c4544-0042-3510-8051-b7c04f4e3799", "SN")
                .await
                .message()
                .contains("allow_insecure_http"),
        );
        // A pool without a Redfish power driver takes no machine by BMC.
        let no_bmc = common::metal_pool(s, "none").await;
        let answer = enroll(s, &no_bmc, json!({ "address": "https://10.0.0.5", "username": "u", "password": "p" }), "4c4c4544-0042-3510-8051-b7c04f4e3798", "SN").await;
        assert_eq!(answer.code(), Some("BAD_USER_INPUT"), "{:#}", answer.body);
        assert!(answer.message().contains("power = redfish"), "{}", answer.message());
        // Operators may not enrol; viewers may not read the bare-metal view.
        let answer = s
            .gql(
                Some(&s.token(better_compute::auth::Role::Operator)),
                "mutation($input: EnrollBareMetalNodeInput!) { enrollBareMetalNode(input: $input) { bareMetalNode { power } } }",
                json!({ "input": { "hostname": "x", "siteId": place.0, "poolId": place.1, "bmc": { "address": "https://10.0.0.5", "username": "u", "password": "p" } } }),
            )
            .await;
        assert_eq!(answer.code(), Some("FORBIDDEN"));
        let nodes = s.admin("{ nodes { totalCount } }", json!({})).await;
        assert_eq!(nodes["nodes"]["totalCount"], 0, "nothing half-written");
        let db = s.database().await;
        assert!(bc_entity::node_bmc::Entity::find().all(&db).await.expect("rows").is_empty());
        db.close().await.expect("closing");
    })
    .await;
}

#[tokio::test]
async fn the_power_controller_and_power_actions_against_the_redfish_emulator() {
    each_backend(async |s| {
        // An emulator per backend: its systems keep their power between runs.
        let emulator = SushyEmulator::start(SushyOptions {
            systems: vec![
                SushySystem::numbered(1),
                SushySystem { power_on: true, ..SushySystem::numbered(2) },
            ],
            ..SushyOptions::default()
        })
        .await
        .expect("the Redfish emulator starts (scripts/ensure-sushy installs it)");
        let place = common::metal_pool(s, "redfish").await;
        let password = emulator.options.password.clone();
        // No system id: the BMC serves two systems; the enrolled system UUID picks one.
        let one = SushySystem::numbered(1).uuid;
        let v = enroll(s, &place, emulator_bmc(&emulator, None, &password), &one, "EMU-1").await.data()["enrollBareMetalNode"]["bareMetalNode"].clone();
        let id = node_id(&v);
        let two = SushySystem::numbered(2).uuid;
        let w = enroll(s, &place, emulator_bmc(&emulator, Some(&two), &password), &two, "EMU-2").await.data()["enrollBareMetalNode"]["bareMetalNode"].clone();
        let id2 = node_id(&w);

        // One pass asks both BMCs. The emulator, a Python process beside a loaded test run,
        // fails a request now and then (one of these two did in CI); the controller counts
        // the failure and asks again an interval later. So each node's power is awaited,
        // not assumed from the first pass.
        let report = tick(s).await;
        assert_eq!(report.polled, 2, "{report:?}");
        let v = tick_until(s, &id, Duration::from_secs(20), |v| v["power"] == "OFF").await;
        assert_eq!(v["bmcReachable"], true);
        assert_eq!(v["bmc"]["systemPath"], format!("/redfish/v1/Systems/{one}"));
        tick_until(s, &id2, Duration::from_secs(20), |v| v["power"] == "ON").await;
        // Not due again before the interval: a second tick polls nothing.
        assert_eq!(tick(s).await.polled, 0);

        // A stale version is CONFLICT and asks nothing of the BMC.
        let stale = power_node(s, &id, version(&v) - 1, "ON", false).await;
        assert_eq!(stale.code(), Some("CONFLICT"));
        let answer = power_node(s, &id, version(&v), "ON", false).await;
        let after = answer.data()["powerNode"]["bareMetalNode"].clone();
        assert_eq!(after["node"]["version"], v["node"]["version"], "an action changes no field");
        let on = tick_until(s, &id, Duration::from_secs(20), |v| v["power"] == "ON").await;
        assert_eq!(emulator.power_state(&one).await.expect("read"), "On");
        let events = s
            .admin("query($id: ID!) { node(id: $id) { events(first: 20) { nodes { type axis from to actor cause } } } }", json!({ "id": id }))
            .await;
        let events = events["node"]["events"]["nodes"].as_array().cloned().unwrap_or_default();
        assert!(events.iter().any(|e| e["type"] == "node.power_action" && e["cause"] == "powerNode"), "{events:#?}");
        assert!(events.iter().any(|e| e["type"] == "node.power_changed" && e["to"] == "on" && e["actor"] == "controller:power"), "{events:#?}");

        // Off, while the node holds work: refused without force, then forced by an admin.
        let db = s.database().await;
        hold_an_allocation(s, &db, &id, &place.1).await;
        let refused = power_node(s, &id, version(&on), "OFF", false).await;
        assert_eq!(refused.code(), Some("BAD_USER_INPUT"), "{:#}", refused.body);
        assert!(refused.message().contains("allocation"), "{}", refused.message());
        assert_eq!(emulator.power_state(&one).await.expect("read"), "On", "nothing was asked");
        power_node(s, &id, version(&on), "OFF", true).await.data();
        tick_until(s, &id, Duration::from_secs(20), |v| v["power"] == "OFF").await;
        db.close().await.expect("closing");

        // Cycle (ForceRestart: the emulator has no PowerCycle) brings an off machine on.
        let off = view(s, &id).await;
        power_node(s, &id, version(&off), "CYCLE", true).await.data();
        tick_until(s, &id, Duration::from_secs(20), |v| v["power"] == "ON").await;

        // Wrong credentials: a typed BMC error, and the BMC's answer in the view.
        let bad = enroll(s, &place, emulator_bmc(&emulator, Some(&SushySystem::numbered(3).uuid), "wrong-password"), &SushySystem::numbered(3).uuid, "EMU-3").await.data()["enrollBareMetalNode"]["bareMetalNode"].clone();
        let answer = power_node(s, &node_id(&bad), version(&bad), "ON", false).await;
        assert_eq!(answer.code(), Some("BMC_ERROR"), "{:#}", answer.body);
        assert_eq!(answer.error()["extensions"]["bmcError"], "UNAUTHORIZED");
    })
    .await;
}

/// A reservation with an active allocation on `node`, written straight to storage: the
/// placer needs a schedulable node with devices, which a machine still `enrolling` is not.
async fn hold_an_allocation(
    s: &TestServer,
    db: &sea_orm::DatabaseConnection,
    node: &str,
    pool: &str,
) {
    let tenant = s
        .tenant(&format!("t-{}", uuid::Uuid::new_v4().simple()))
        .await;
    let now = s.clock.now();
    let reservation = ReservationId::generate().to_string();
    bc_entity::reservation::Entity::insert(bc_entity::reservation::ActiveModel {
        id: sea_orm::Set(reservation.clone()),
        tenant_id: sea_orm::Set(tenant.clone()),
        pool_id: sea_orm::Set(pool.to_owned()),
        gpus_per_node: sea_orm::Set(1),
        node_count: sea_orm::Set(1),
        gpu_model: sea_orm::Set(None),
        selector: sea_orm::Set(json!([])),
        tolerations: sea_orm::Set(json!([])),
        policy: sea_orm::Set("bin-pack".into()),
        state: sea_orm::Set("placed".into()),
        reason: sea_orm::Set(None),
        idempotency_key: sea_orm::Set(None),
        expires_at: sea_orm::Set(None),
        version: sea_orm::Set(1),
        created_by: sea_orm::Set("user:test".into()),
        created_at: sea_orm::Set(now),
        updated_at: sea_orm::Set(now),
    })
    .exec_without_returning(db)
    .await
    .expect("a reservation");
    bc_entity::allocation::Entity::insert(bc_entity::allocation::ActiveModel {
        id: sea_orm::Set(AllocationId::generate().to_string()),
        reservation_id: sea_orm::Set(reservation),
        tenant_id: sea_orm::Set(tenant),
        pool_id: sea_orm::Set(pool.to_owned()),
        node_id: sea_orm::Set(node.to_owned()),
        atoms: sea_orm::Set(json!(["gpu0"])),
        booked_at: sea_orm::Set(now),
        released_at: sea_orm::Set(None),
        release_reason: sea_orm::Set(None),
    })
    .exec_without_returning(db)
    .await
    .expect("an allocation");
}

#[tokio::test]
async fn a_bmc_that_stops_answering_sets_bmc_unreachable_and_clears_it_when_it_answers() {
    let stub = BmcStub::start("admin", "stub-pw")
        .await
        .expect("the stub BMC starts");
    each_backend_with(
        |c| {
            c.bare_metal.allow_insecure_http = true;
            c.bare_metal.request_timeout_secs = 1;
        },
        async |s| {
            stub.set_mode(StubMode::Normal);
            stub.set_power(true);
            let place = common::metal_pool(s, "redfish").await;
            let bmc = json!({ "address": stub.url, "username": "admin", "password": "stub-pw" });
            let v = enroll(
                s,
                &place,
                bmc,
                "22222222-2222-4222-8222-000000000001",
                "STUB-1",
            )
            .await
            .data()["enrollBareMetalNode"]["bareMetalNode"]
                .clone();
            let id = node_id(&v);
            tick(s).await;
            assert_eq!(view(s, &id).await["power"], "ON");

            for (mode, reason) in [
                (StubMode::Hang, "Timeout"),
                (StubMode::ServerError, "UnexpectedAnswer"),
                (StubMode::Unauthorized, "Unauthorized"),
                (StubMode::Lie, "UnexpectedAnswer"),
            ] {
                stub.set_mode(mode);
                // One failure is not an outage (unreachable_after_failures = 2).
                s.clock.advance(chrono::Duration::seconds(120));
                let report = tick(s).await;
                assert_eq!(
                    (report.polled, report.answered),
                    (1, 0),
                    "{mode:?}: {report:?}"
                );
                let once = view(s, &id).await;
                assert_eq!(once["power"], "ON", "{mode:?}: {once:#}");
                assert_eq!(once["bmc"]["reachable"], false);
                assert_eq!(once["bmc"]["consecutiveFailures"], 1);
                s.clock.advance(chrono::Duration::seconds(120));
                let started = Instant::now();
                let report = tick(s).await;
                assert_eq!(report.changes.became_unreachable, 1, "{mode:?}: {report:?}");
                if mode == StubMode::Hang {
                    assert!(
                        started.elapsed() < Duration::from_secs(5),
                        "the request timeout bounds a hung BMC"
                    );
                }
                let down = view(s, &id).await;
                assert_eq!(down["power"], "UNKNOWN", "{mode:?}: {down:#}");
                assert_eq!(down["bmcReachable"], false);
                let condition = down["node"]["conditions"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                assert!(
                    condition.iter().any(|c| c["type"] == "BmcUnreachable"
                        && c["status"] == "TRUE"
                        && c["reason"] == reason),
                    "{mode:?}: {condition:#?}"
                );
                stub.set_mode(StubMode::Normal);
                s.clock.advance(chrono::Duration::seconds(120));
                let report = tick(s).await;
                assert_eq!(
                    (
                        report.changes.became_reachable,
                        report.changes.power_changed
                    ),
                    (1, 1),
                    "{mode:?}: {report:?}"
                );
                let up = view(s, &id).await;
                assert_eq!(
                    (up["power"].clone(), up["bmcReachable"].clone()),
                    (json!("ON"), json!(true))
                );
            }
            // A power action at a BMC that hangs is a typed timeout, not a hung request.
            stub.set_mode(StubMode::Hang);
            let v = view(s, &id).await;
            let answer = power_node(s, &id, version(&v), "ON", false).await;
            assert_eq!(
                answer.error()["extensions"]["bmcError"],
                "TIMEOUT",
                "{:#}",
                answer.body
            );
            stub.set_mode(StubMode::Normal);
            // The stub saw a ForceOff only when asked for OFF.
            let answer = power_node(s, &id, version(&v), "OFF", false).await;
            answer.data();
            assert_eq!(stub.resets().last().map(String::as_str), Some("ForceOff"));
        },
    )
    .await;
}

fn settings() -> DriverSettings {
    DriverSettings {
        request_timeout: Duration::from_secs(10),
        allow_insecure_http: false,
    }
}

fn endpoint(emulator: &SushyEmulator, system: &str, tls: BmcTls, password: &str) -> BmcEndpoint {
    BmcEndpoint {
        address: better_compute::bmc::parse_address(&emulator.url, false)
            .expect("an https address"),
        system_id: Some(system.to_owned()),
        system_uuid: None,
        system_path: None,
        tls,
        credentials: BmcCredentials {
            username: emulator.options.username.clone(),
            password: password.to_owned(),
        },
    }
}

/// The driver on its own against the emulator as it ships (no instant power): a change
/// shows only seconds later, on a read; a restart reads `Off` at once; TLS is checked.
#[tokio::test]
async fn the_redfish_driver_against_the_unpatched_emulator() {
    let emulator = SushyEmulator::start(SushyOptions {
        systems: vec![SushySystem {
            power_on: true,
            ..SushySystem::numbered(1)
        }],
        instant_power: false,
        ..SushyOptions::default()
    })
    .await
    .expect("the Redfish emulator starts (scripts/ensure-sushy installs it)");
    let uuid = SushySystem::numbered(1).uuid;
    let password = emulator.options.password.clone();
    let driver = better_compute::bmc::driver(
        PowerDriverKind::Redfish,
        Some(endpoint(
            &emulator,
            &uuid,
            BmcTls::CustomCa(emulator.ca_pem.clone()),
            &password,
        )),
        settings(),
    )
    .expect("a driver");
    let started = Instant::now();
    assert_eq!(driver.power_state().await, Ok(bc_core::axes::Power::On));
    let read_ms = started.elapsed().as_millis();
    driver
        .power(PowerAction::Cycle)
        .await
        .expect("ForceRestart accepted");
    assert_eq!(
        driver.power_state().await,
        Ok(bc_core::axes::Power::Off),
        "a restart reads Off at once"
    );
    let cycled = Instant::now();
    loop {
        if driver.power_state().await == Ok(bc_core::axes::Power::On) {
            break;
        }
        assert!(
            cycled.elapsed() < Duration::from_secs(20),
            "the restart finishes within the emulator's 1-11 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "one power read over TLS 1.2 with basic auth: {read_ms} ms; the restart took {:?}",
        cycled.elapsed()
    );

    // The emulator's certificate is from a CA of its own: the platform's roots refuse it,
    // and so does a TLS check against another CA; no check at all connects.
    for tls in [
        BmcTls::Verify,
        BmcTls::CustomCa(
            bc_testing::bmc::TestCertificates::generate()
                .expect("certs")
                .ca_pem,
        ),
    ] {
        let driver = better_compute::bmc::driver(
            PowerDriverKind::Redfish,
            Some(endpoint(&emulator, &uuid, tls, &password)),
            settings(),
        )
        .expect("a driver");
        assert!(matches!(
            driver.power_state().await,
            Err(BmcError::Unreachable(_))
        ));
    }
    let unchecked = better_compute::bmc::driver(
        PowerDriverKind::Redfish,
        Some(endpoint(&emulator, &uuid, BmcTls::Off, &password)),
        settings(),
    )
    .expect("a driver");
    assert!(unchecked.power_state().await.is_ok());
    let wrong = better_compute::bmc::driver(
        PowerDriverKind::Redfish,
        Some(endpoint(&emulator, &uuid, BmcTls::Off, "nope")),
        settings(),
    )
    .expect("a driver");
    assert_eq!(wrong.power_state().await, Err(BmcError::Unauthorized(401)));
    let missing = better_compute::bmc::driver(
        PowerDriverKind::Redfish,
        Some(endpoint(
            &emulator,
            "no-such-system",
            BmcTls::Off,
            &password,
        )),
        settings(),
    )
    .expect("a driver");
    assert!(
        matches!(missing.power_state().await, Err(BmcError::UnexpectedAnswer(why)) if why.contains("404"))
    );
    let none =
        better_compute::bmc::driver(PowerDriverKind::None, None, settings()).expect("a driver");
    assert!(matches!(
        none.power(PowerAction::On).await,
        Err(BmcError::Unsupported(_))
    ));
}

/// Fifty machines behind one emulator (one site, so at most `poll_concurrency_per_site` at
/// once): one pass polls them all and writes their power in one transaction; a pass with
/// nothing due is one indexed query. Prints what each took (README's figures).
#[tokio::test]
async fn one_pass_polls_fifty_bmcs_and_a_quiet_pass_costs_one_query() {
    const MACHINES: u32 = 50;
    each_backend(async |s| {
        let emulator = SushyEmulator::start(SushyOptions {
            systems: (1..=MACHINES).map(SushySystem::numbered).collect(),
            ..SushyOptions::default()
        })
        .await
        .expect("the Redfish emulator starts (scripts/ensure-sushy installs it)");
        let place = common::metal_pool(s, "redfish").await;
        let password = emulator.options.password.clone();
        for n in 1..=MACHINES {
            let uuid = SushySystem::numbered(n).uuid;
            enroll(s, &place, emulator_bmc(&emulator, Some(&uuid), &password), &uuid, &format!("MANY-{n}"))
                .await
                .data();
        }
        let report = tick(s).await;
        assert_eq!((report.polled, report.answered, report.changes.power_changed), (50, 50, 50), "{report:?}");
        let mut quiet = Vec::new();
        for _ in 0..20 {
            let started = Instant::now();
            assert_eq!(tick(s).await.polled, 0);
            quiet.push(started.elapsed().as_micros());
        }
        quiet.sort_unstable();
        // The next pass, once every BMC is due again, finds nothing new: no node changes.
        s.clock.advance(chrono::Duration::seconds(120));
        let again = tick(s).await;
        assert_eq!((again.polled, again.changes.power_changed), (50, 0), "{again:?}");
        eprintln!(
            "{:?}: {MACHINES} BMCs (8 at once): first pass {} ms (slowest poll {} ms), unchanged pass {} ms; a pass with nothing due: median {} µs",
            s.backend,
            report.elapsed_ms,
            report.slowest_ms,
            again.elapsed_ms,
            quiet[quiet.len() / 2]
        );
    })
    .await;
}
