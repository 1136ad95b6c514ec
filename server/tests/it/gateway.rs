//! The daemon side of the control plane through its real doors: JoinService and renewal over
//! HTTPS, sessions over WebSocket over TLS with client certificates, on both databases.
//! The raw client in `raw_daemon` lets these tests send exactly the bytes they mean, garbage
//! included; the FakeDaemon in `bc-testing` is the well-behaved daemon.

#![allow(clippy::unwrap_used)]

use crate::raw_daemon::*;
use bc_core::clock::Clock;
use bc_core::protocol::{DaemonMessage, GatewayMessage, IssuedIdentity, section_hash};
use bc_testing::each_backend;
use better_compute::pki::NodeCsr;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

#[tokio::test]
async fn a_daemon_joins_connects_heartbeats_and_disconnects() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 1).await;
        let machine = Machine::new();
        let issued = join(s, &machine, &secret, "gpu-001").await;
        assert!(issued.node_id.starts_with("node_"));
        assert_eq!(issued.identity_generation, 1);
        assert_eq!((issued.expires_at - Clock::now(&s.clock)).num_hours(), 24);
        let joined = node(s, &issued.node_id).await;
        assert_eq!(joined["provisionState"], "ADOPTING");
        assert_eq!(joined["role"], "HOST");
        assert_eq!(joined["trust"], "PLATFORM");
        assert_eq!(joined["hardwareKeyTrusted"], true);
        assert_eq!(joined["connectivity"], "DISCONNECTED");
        let events = s
            .admin(
                "query($id: ID!) { node(id: $id) { events { edges { node { type actor } } } } }",
                json!({"id": issued.node_id}),
            )
            .await;
        assert_eq!(
            events["node"]["events"]["edges"][0]["node"]["type"],
            "node.joined"
        );

        let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
            .await
            .unwrap();
        send(&mut ws, &hello(0)).await;
        let GatewayMessage::Welcome {
            epoch,
            gateway_id,
            want_sections,
            heartbeat_interval_secs,
            spec,
        } = next(&mut ws).await.unwrap()
        else {
            panic!("expected welcome");
        };
        assert_eq!(
            (epoch, heartbeat_interval_secs, spec.generation),
            (1, 10, 0)
        );
        assert_eq!(want_sections, vec!["cpu".to_owned()]);
        let connected = node(s, &issued.node_id).await;
        assert_eq!(connected["connectivity"], "CONNECTED");
        assert_eq!(connected["session"]["gatewayId"], json!(gateway_id));
        let version = connected["version"].clone();

        // Heartbeats, and inventory sections that carry no node facts, never change the
        // node's version. A backslash and then `u0000` is text like any other (no NUL): the
        // section is stored, so the reconnect below is asked for none.
        let content = json!({"count": 8, "note": "epyc \\u0000"});
        let stored_hash = section_hash(&content);
        send(
            &mut ws,
            &DaemonMessage::Inventory {
                section: "cpu".into(),
                hash: stored_hash.clone(),
                content,
            },
        )
        .await;
        s.clock.advance(chrono::Duration::seconds(10));
        send(&mut ws, &DaemonMessage::Heartbeat { seq: 1 }).await;
        let seen_at = Clock::now(&s.clock);
        wait_until(async || {
            node(s, &issued.node_id).await["session"]["lastSeen"]
                .as_str()
                .is_some_and(|t| parse_time(t) >= seen_at)
        })
        .await;
        assert_eq!(node(s, &issued.node_id).await["version"], version);

        ws.close(None).await.unwrap();
        wait_until(async || node(s, &issued.node_id).await["connectivity"] == "DISCONNECTED").await;
        assert!(node(s, &issued.node_id).await["session"]["disconnectedAt"].is_string());

        // A reconnect sends only changed inventory: the stored hash matches now.
        let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
            .await
            .unwrap();
        let hello_again = DaemonMessage::Hello {
            daemon_version: "test".into(),
            inventory_hashes: BTreeMap::from([("cpu".into(), stored_hash)]),
            observed_generation: 0,
        };
        send(&mut ws, &hello_again).await;
        let GatewayMessage::Welcome {
            epoch,
            want_sections,
            ..
        } = next(&mut ws).await.unwrap()
        else {
            panic!("expected welcome")
        };
        assert_eq!(epoch, 2);
        assert!(want_sections.is_empty());
    })
    .await;
}

#[tokio::test]
async fn every_refused_join_says_why_and_creates_nothing() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let machine = Machine::new();
        let good = s.join_token(&site, Some(&pool), 1).await;
        let (token_id, _) = good.split_once('.').unwrap();

        let used = s.join_token(&site, Some(&pool), 1).await;
        join(s, &Machine::new(), &used, "first").await;
        let revoked = s.join_token(&site, Some(&pool), 5).await;
        s.admin("mutation($id: ID!) { revokeJoinToken(input: {id: $id}) { joinToken { revokedAt } } }", json!({"id": revoked.split_once('.').unwrap().0}))
            .await;
        let expiring = s
            .admin(
                "mutation($site: ID!) { createJoinToken(input: {siteId: $site, expiresInSeconds: 60}) { secret } }",
                json!({"site": site}),
            )
            .await["createJoinToken"]["secret"]
            .as_str()
            .unwrap()
            .to_owned();
        s.clock.advance(chrono::Duration::seconds(61));

        let mut tampered = machine.csr().into_bytes();
        let middle = tampered.len() / 2;
        tampered[middle] = if tampered[middle] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).unwrap();

        let valid = |token: &str| json!({"token": token, "csrPem": machine.csr(), "hostname": "gpu-x", "identifiers": machine.identifiers});
        let cases: Vec<(&str, Value, u16, &str)> = vec![
            ("unknown token", valid(&format!("jt_{}.abc", uuid::Uuid::new_v4().simple())), 401, "unknown token"),
            ("wrong secret", valid(&format!("{token_id}.{}", "0".repeat(64))), 401, "wrong token secret"),
            ("used up", valid(&used), 401, "used up"),
            ("revoked", valid(&revoked), 401, "revoked"),
            ("expired", valid(&expiring), 401, "expired"),
            ("malformed token", valid("not-a-token"), 400, "malformed"),
            ("garbage csr", json!({"token": good, "csrPem": "garbage", "hostname": "gpu-x"}), 400, "CSR"),
            ("tampered csr", json!({"token": good, "csrPem": tampered, "hostname": "gpu-x"}), 400, "CSR"),
            ("bad hostname", json!({"token": good, "csrPem": machine.csr(), "hostname": "-bad host-"}), 400, "hostname"),
            ("unknown field", json!({"token": good, "csrPem": machine.csr(), "hostname": "gpu-x", "admin": true}), 400, "malformed join request"),
            ("not json", json!("just a string"), 400, "malformed join request"),
        ];
        let before = node_count(s).await;
        for (name, body, status, needle) in cases {
            let (got, answer) = post_join(s, body).await;
            assert_eq!(got, status, "{name}: {answer:#}");
            let code = if status == 401 { "UNAUTHENTICATED" } else { "BAD_USER_INPUT" };
            assert_eq!(answer["code"], code, "{name}: {answer:#}");
            assert!(answer["message"].as_str().unwrap().contains(needle), "{name}: {answer:#}");
        }
        assert_eq!(node_count(s).await, before, "a refused join created a node");
        // The good token was never spent by the refusals.
        let tokens = s.admin("{ joinTokens { nodes { id uses } } }", json!({})).await;
        let good_token = tokens["joinTokens"]["nodes"].as_array().unwrap().iter().find(|t| t["id"] == token_id).unwrap().clone();
        assert_eq!(good_token["uses"], 0);
        join(s, &machine, &good, "gpu-x").await;
    })
    .await;
}

/// Joins sent at once reach the gateway's join batches together: a batch needing more uses
/// than the token has left is written a join at a time, each counting its use on the token's
/// locked row, so exactly as many as the token has uses left get in, and the others are
/// refused as used up, having created nothing. (`batched_writes` races two batches.)
#[tokio::test]
async fn concurrent_joins_spend_a_token_exactly_to_its_last_use() {
    const USES: i64 = 2;
    const JOINS: usize = 6;
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), USES).await;
        let (token_id, _) = secret.split_once('.').unwrap();
        let before = node_count(s).await;
        let machines: Vec<Machine> = (0..JOINS).map(|_| Machine::new()).collect();
        let answers = futures::future::join_all(machines.iter().enumerate().map(|(i, machine)| {
            post_join(s, json!({
                "token": secret, "csrPem": machine.csr(), "hostname": format!("gpu-{i}"), "identifiers": machine.identifiers,
            }))
        }))
        .await;
        let admitted = answers.iter().filter(|(status, _)| *status == 200).count();
        assert_eq!(admitted, USES as usize, "{answers:#?}");
        for (status, answer) in answers.iter().filter(|(status, _)| *status != 200) {
            assert_eq!(*status, 401, "{answer:#}");
            assert!(answer["message"].as_str().unwrap().contains("used up"), "{answer:#}");
        }
        assert_eq!(node_count(s).await, before + USES as u64);
        let tokens = s.admin("{ joinTokens { nodes { id uses } } }", json!({})).await;
        let token = tokens["joinTokens"]["nodes"].as_array().unwrap().iter().find(|t| t["id"] == token_id).unwrap().clone();
        assert_eq!(token["uses"], USES);
    })
    .await;
}

/// A daemon that retries a slow join sends its machine's joins at once: they go one after
/// the other (rounds of a batch, or batches waiting on the machine's hardware key lock), so
/// the first creates the node and the others take it back, rather than each inserting a node
/// with the one key.
#[tokio::test]
async fn a_machine_joining_several_times_at_once_is_one_node() {
    const JOINS: usize = 4;
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), JOINS as i64).await;
        let machine = Machine::new();
        let before = node_count(s).await;
        let answers = futures::future::join_all((0..JOINS).map(|_| {
            post_join(s, json!({
                "token": secret, "csrPem": machine.csr(), "hostname": "gpu-retry", "identifiers": machine.identifiers,
            }))
        }))
        .await;
        for (status, answer) in &answers {
            assert_eq!(*status, 200, "{answer:#}");
        }
        let node_ids: std::collections::BTreeSet<&str> =
            answers.iter().map(|(_, answer)| answer["nodeId"].as_str().unwrap()).collect();
        assert_eq!(node_ids.len(), 1, "{answers:#?}");
        assert_eq!(node_count(s).await, before + 1);
    })
    .await;
}

#[tokio::test]
async fn replaced_identities_and_foreign_certificates_are_refused_at_the_gateway() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 2).await;
        let machine = Machine::new();
        let first = join(s, &machine, &secret, "gpu-001").await;
        let mut ws = connect(s, &first.certificate_pem, machine.key_der()).await.unwrap();
        send(&mut ws, &hello(0)).await;
        assert!(matches!(next(&mut ws).await, Ok(GatewayMessage::Welcome { .. })));

        // Revocation ends the live session at once and refuses the old certificate after.
        let version = node(s, &first.node_id).await["version"].as_i64().unwrap();
        s.admin(
            "mutation($id: ID!, $v: Int!) { revokeNodeIdentity(input: {id: $id, version: $v, reason: \"key leaked\"}) { node { identityGeneration } } }",
            json!({"id": first.node_id, "v": version}),
        )
        .await;
        match next(&mut ws).await {
            Ok(GatewayMessage::Goodbye { reason, reconnect }) => {
                assert_eq!(reason, "identity revoked");
                assert!(!reconnect);
            }
            other => panic!("expected goodbye, got {other:?}"),
        }
        let refused = connect(s, &first.certificate_pem, machine.key_der()).await.expect_err("an old generation is refused");
        assert!(refused.contains("403"), "{refused}");
        let renew = http(&s.ca_pem(), Some((&first.certificate_pem, machine.key_der())))
            .post(format!("{}/v1/renew", s.gateway_url()))
            .json(&json!({"csrPem": machine.csr()}))
            .send()
            .await
            .unwrap();
        assert_eq!(renew.status().as_u16(), 403);
        assert_eq!(renew.json::<Value>().await.unwrap()["code"], "FORBIDDEN");

        // The same machine re-joins in place: same node, next generation, not a twin.
        let again = join(s, &machine, &secret, "gpu-001").await;
        assert_eq!(again.node_id, first.node_id);
        assert_eq!(again.identity_generation, 3);
        assert_eq!(node_count(s).await, 1);
        assert!(connect(s, &again.certificate_pem, machine.key_der()).await.is_ok());
        assert!(connect(s, &first.certificate_pem, machine.key_der()).await.is_err());

        // No TLS session is resumed, by a TLS 1.3 ticket or a TLS 1.2 session id: a resumed
        // session would bring the certificate back without checking its chain or expiry
        // again (docs/decisions.md).
        for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
            let config = tls_config_of_versions(&s.ca_pem(), Some((&again.certificate_pem, machine.key_der())), &[version]);
            for _ in 0..2 {
                assert_eq!(handshake_kind(s, config.clone()).await, Some(rustls::HandshakeKind::Full), "{version:?}");
            }
        }

        // Renewal keeps the node and generation.
        let renewed: IssuedIdentity = http(&s.ca_pem(), Some((&again.certificate_pem, machine.key_der())))
            .post(format!("{}/v1/renew", s.gateway_url()))
            .json(&json!({"csrPem": machine.csr()}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!((renewed.node_id.as_str(), renewed.identity_generation), (again.node_id.as_str(), 3));

        // A certificate from another CA, or an expired one from ours, fails the handshake itself.
        let other_dir = tempfile::tempdir().unwrap();
        let other_ca = better_compute::pki::Ca::load_or_create(other_dir.path(), chrono::Utc::now()).unwrap();
        let node_id = bc_core::ids::NodeId::parse(&again.node_id).unwrap();
        let forged = other_ca.sign_node(&NodeCsr::parse(&machine.csr()).unwrap(), &node_id, 3, chrono::Utc::now(), chrono::Duration::hours(24)).unwrap();
        let err = connect(s, &forged.pem, machine.key_der()).await.expect_err("a foreign CA is refused");
        assert!(err.starts_with("tls") || err.contains("upgrade"), "{err}");
        let expired = s
            .server
            .services
            .ca
            .sign_node(&NodeCsr::parse(&machine.csr()).unwrap(), &node_id, 3, chrono::Utc::now() - chrono::Duration::hours(48), chrono::Duration::hours(24))
            .unwrap();
        assert!(connect(s, &expired.pem, machine.key_der()).await.is_err(), "an expired certificate is refused");

        // Deleting the node refuses its certificate too.
        let (status, _) = post_join(s, json!({"token": secret, "csrPem": machine.csr(), "hostname": "x"})).await;
        assert_eq!(status, 401, "the two-use token is spent");
    })
    .await;
}

#[tokio::test]
async fn a_newer_session_replaces_the_older_one() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 1).await;
        let machine = Machine::new();
        let issued = join(s, &machine, &secret, "gpu-001").await;
        let mut older = connect(s, &issued.certificate_pem, machine.key_der())
            .await
            .unwrap();
        send(&mut older, &hello(0)).await;
        assert!(matches!(
            next(&mut older).await,
            Ok(GatewayMessage::Welcome { epoch: 1, .. })
        ));
        let mut newer = connect(s, &issued.certificate_pem, machine.key_der())
            .await
            .unwrap();
        send(&mut newer, &hello(0)).await;
        assert!(matches!(
            next(&mut newer).await,
            Ok(GatewayMessage::Welcome { epoch: 2, .. })
        ));
        match next(&mut older).await {
            Ok(GatewayMessage::Goodbye { reason, .. }) => {
                assert_eq!(reason, "superseded by a newer session")
            }
            other => panic!("expected goodbye, got {other:?}"),
        }
        // The older session's end does not disconnect the node: the newer one holds it.
        tokio::time::timeout(ANSWER_TIMEOUT, async {
            while older.next().await.is_some() {}
        })
        .await
        .unwrap();
        send(&mut newer, &DaemonMessage::Heartbeat { seq: 1 }).await;
        let n = node(s, &issued.node_id).await;
        assert_eq!(n["connectivity"], "CONNECTED");
        assert_eq!(n["session"]["epoch"], 2);
    })
    .await;
}

/// What a misbehaving daemon sends after (or instead of) `hello`.
enum Garbage {
    Text(String),
    Binary(Vec<u8>),
}

#[tokio::test]
async fn garbage_closes_only_that_session_and_loses_nothing() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 100).await;
        // A well-behaved neighbour that must not notice anything.
        let neighbour = Machine::new();
        let neighbour_id = join(s, &neighbour, &secret, "neighbour").await;
        let mut calm = connect(s, &neighbour_id.certificate_pem, neighbour.key_der())
            .await
            .unwrap();
        send(&mut calm, &hello(0)).await;
        assert!(matches!(
            next(&mut calm).await,
            Ok(GatewayMessage::Welcome { .. })
        ));

        let hello_text = serde_json::to_string(&hello(0)).unwrap();
        // PostgreSQL's jsonb cannot hold it, and reports are stored in batches with other
        // daemons': refused at the gateway, it ends this session only.
        let with_nul = json!({ "count": 8, "model": "epyc\u{0}" });
        let with_nul = json!({
            "type": "inventory",
            "section": "cpu",
            "hash": section_hash(&with_nul),
            "content": with_nul,
        })
        .to_string();
        let oversized = format!(
            r#"{{"type":"heartbeat","seq":1,"pad":"{}"}}"#,
            "x".repeat(1024 * 1024 + 10)
        );
        // (name, sent before hello?, frames, expected close code, reason fragment)
        let cases: Vec<(&str, bool, Vec<Garbage>, CloseCode, &str)> = vec![
            (
                "binary before hello",
                true,
                vec![Garbage::Binary(vec![0, 1, 2])],
                CloseCode::Policy,
                "hello",
            ),
            (
                "heartbeat before hello",
                true,
                vec![Garbage::Text(r#"{"type":"heartbeat","seq":1}"#.into())],
                CloseCode::Policy,
                "first message must be hello",
            ),
            (
                "not json",
                false,
                vec![Garbage::Text("{{{".into())],
                CloseCode::Policy,
                "not JSON",
            ),
            (
                "unknown type",
                false,
                vec![Garbage::Text(r#"{"type":"selfDestruct"}"#.into())],
                CloseCode::Policy,
                "unknown message type `selfDestruct`",
            ),
            (
                "unknown field",
                false,
                vec![Garbage::Text(
                    r#"{"type":"heartbeat","seq":1,"evil":true}"#.into(),
                )],
                CloseCode::Policy,
                "malformed `heartbeat` message: unknown field `evil`",
            ),
            (
                "binary frame",
                false,
                vec![Garbage::Binary(vec![1; 16])],
                CloseCode::Policy,
                "binary",
            ),
            (
                "second hello",
                false,
                vec![Garbage::Text(hello_text.clone())],
                CloseCode::Policy,
                "already",
            ),
            (
                "seq goes back",
                false,
                vec![
                    Garbage::Text(r#"{"type":"heartbeat","seq":5}"#.into()),
                    Garbage::Text(r#"{"type":"heartbeat","seq":5}"#.into()),
                ],
                CloseCode::Policy,
                "does not increase",
            ),
            (
                "unwanted inventory",
                false,
                vec![Garbage::Text(
                    r#"{"type":"inventory","section":"disks","hash":"x","content":{}}"#.into(),
                )],
                CloseCode::Policy,
                "not asked for",
            ),
            (
                "wrong hash",
                false,
                vec![Garbage::Text(
                    r#"{"type":"inventory","section":"cpu","hash":"00","content":{"count":8}}"#
                        .into(),
                )],
                CloseCode::Policy,
                "hash",
            ),
            (
                "NUL in a section",
                false,
                vec![Garbage::Text(with_nul)],
                CloseCode::Policy,
                "NUL character",
            ),
            (
                "oversized",
                false,
                vec![Garbage::Text(oversized)],
                CloseCode::Size,
                "",
            ),
        ];
        for (name, before_hello, frames, code, fragment) in cases {
            let machine = Machine::new();
            let issued = join(
                s,
                &machine,
                &secret,
                &format!("bad-{}", uuid::Uuid::new_v4().simple()),
            )
            .await;
            let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
                .await
                .unwrap();
            if !before_hello {
                send(&mut ws, &hello(0)).await;
                assert!(
                    matches!(next(&mut ws).await, Ok(GatewayMessage::Welcome { .. })),
                    "{name}"
                );
            }
            let stored = node(s, &issued.node_id).await;
            for frame in frames {
                let message = match frame {
                    Garbage::Text(text) => Message::Text(text.into()),
                    Garbage::Binary(bytes) => Message::Binary(bytes.into()),
                };
                // The gateway may already have closed; a failed send is part of the outcome.
                let _ = ws.send(message).await;
            }
            match next(&mut ws).await {
                Err((got, reason)) => {
                    if let Some(got) = got {
                        assert_eq!(got, code, "{name}: {reason}");
                    }
                    assert!(reason.contains(fragment), "{name}: {reason}");
                }
                Ok(other) => panic!("{name}: expected the session to close, got {other:?}"),
            }
            // Nothing stored was touched beyond the session ending.
            wait_until(async || node(s, &issued.node_id).await["connectivity"] == "DISCONNECTED")
                .await;
            let after = node(s, &issued.node_id).await;
            assert_eq!(after["provisionState"], stored["provisionState"], "{name}");
            assert_eq!(
                after["identityGeneration"], stored["identityGeneration"],
                "{name}"
            );
        }
        // The neighbour's session is still alive and answers.
        send(&mut calm, &DaemonMessage::Heartbeat { seq: 1 }).await;
        assert_eq!(
            node(s, &neighbour_id.node_id).await["connectivity"],
            "CONNECTED"
        );
        let renewed = http(
            &s.ca_pem(),
            Some((&neighbour_id.certificate_pem, neighbour.key_der())),
        )
        .post(format!("{}/v1/renew", s.gateway_url()))
        .json(&json!({"csrPem": neighbour.csr()}))
        .send()
        .await
        .unwrap();
        assert_eq!(renewed.status().as_u16(), 200);
    })
    .await;
}

/// `enrollNode` records the machine's identity (issue 15, item 7: it created a node without a
/// hardware key, so the daemon that booted on the machine joined as a second node): the join
/// of that machine's daemon claims the enrolled node; a machine that shares an identifier but
/// contradicts another does not; identity too thin to tell machines apart is refused, and so
/// is enrolling a machine that is a node already.
#[tokio::test]
async fn an_enrolled_machine_is_claimed_by_its_own_daemon_and_no_other() {
    each_backend(async |s| {
        let (site, pool) = s.site_and_pool(8).await;
        let secret = s.join_token(&site, Some(&pool), 10).await;
        let enroll = async |hostname: &str, identifiers: Value| {
            s.gql(
                Some(s.admin_token()),
                "mutation($input: EnrollNodeInput!) { enrollNode(input: $input) { node { id hardwareKeyTrusted } } }",
                json!({ "input": { "siteId": site, "poolId": pool, "hostname": hostname, "identifiers": identifiers } }),
            )
            .await
        };
        let machine = Machine::new();
        let uuid = machine.identifiers["system-uuid"].clone();
        let serial = machine.identifiers["board-serial"].clone();

        for (identifiers, field, needle) in [
            (json!([{ "name": "system-uuid", "value": uuid }]), None, "at least 2 independent identifiers"),
            (
                json!([{ "name": "system-uuid", "value": "00000000-0000-0000-0000-000000000000" },
                       { "name": "board-serial", "value": "To Be Filled By O.E.M." }]),
                None,
                "these leave none",
            ),
            (
                json!([{ "name": "system_uuid", "value": uuid }, { "name": "board-serial", "value": serial }]),
                Some("input.identifiers[0].name"),
                "not a machine identifier",
            ),
        ] {
            let refused = enroll("bm-thin", identifiers).await;
            assert_eq!(refused.code(), Some("BAD_USER_INPUT"), "{:#}", refused.body);
            let error = refused.error();
            assert!(error["message"].as_str().unwrap().contains(needle), "{error:#}");
            if let Some(field) = field {
                assert_eq!(error["extensions"]["field"], field);
            }
        }
        assert_eq!(node_count(s).await, 0, "a refused enrolment created a node");

        let enrolled = enroll(
            "bm-001",
            json!([{ "name": "system-uuid", "value": uuid.to_uppercase() },
                   { "name": "board-serial", "value": serial },
                   { "name": "system-serial", "value": "SYS-1" }]),
        )
        .await
        .data()["enrollNode"]["node"]
            .clone();
        assert_eq!(enrolled["hardwareKeyTrusted"], true);
        let enrolled_id = enrolled["id"].as_str().unwrap().to_owned();
        let again = enroll(
            "bm-001-again",
            json!([{ "name": "system-uuid", "value": uuid }, { "name": "board-serial", "value": serial }]),
        )
        .await;
        assert_eq!(again.code(), Some("BAD_USER_INPUT"), "{:#}", again.body);
        assert!(again.error()["message"].as_str().unwrap().contains(&enrolled_id));

        // Another machine with the same board serial (a swapped board) but its own UUID.
        let mut impostor = Machine::new();
        impostor.identifiers.insert("board-serial".into(), serial.clone());
        let other = join(s, &impostor, &secret, "impostor").await;
        assert_ne!(other.node_id, enrolled_id);

        // The machine's own daemon, which reports its identifiers in its own spelling.
        let claimed = join(s, &machine, &secret, "gpu-from-the-daemon").await;
        assert_eq!(claimed.node_id, enrolled_id);
        assert_eq!(claimed.identity_generation, 2);
        assert_eq!(node_count(s).await, 2);
        let n = node(s, &enrolled_id).await;
        assert_eq!(n["provisionState"], "ENROLLING");
        assert_eq!(n["hardwareKeyTrusted"], true);
        // Now a node by its hardware key: enrolling it again is refused too.
        let joined = enroll(
            "bm-twice",
            json!(machine.identifiers.iter().map(|(k, v)| json!({"name": k, "value": v})).collect::<Vec<_>>()),
        )
        .await;
        assert_eq!(joined.code(), Some("BAD_USER_INPUT"), "{:#}", joined.body);
        assert!(joined.error()["message"].as_str().unwrap().contains(&enrolled_id));
    })
    .await;
}
