//! Holding under abuse (issue 17, items 3 to 5), on SQLite and on PostgreSQL: both
//! listeners cap their connections (per listener and per peer address, closed at once at
//! accept) and time out silent handshakes, slow headers and idle connections, and with the
//! API full an admin still gets in and open sessions keep working; subscription sockets
//! must `connection_init` in time and answer pings; bodies are bounded and tokens checked
//! before a body is read; a token's expiry, `nbf` and `iat` hold on open sockets too.
//!
//! The servers run with small limits (caps of tens of connections, 1 s timeouts), so each
//! test takes seconds and a few dozen sockets. Each prints the figure it measures and
//! asserts a generous bound (a loaded 2-core machine) that fails without the limit. The
//! figures go to stderr (`-- --nocapture` shows them).

#![allow(clippy::unwrap_used)]

use crate::raw_daemon::*;
use bc_core::clock::Clock;
use bc_core::protocol::{DaemonMessage, GatewayMessage};
use bc_testing::subscription::{ConnectError, ConnectOptions, SubMessage, SubscriptionClient};
use bc_testing::{TestServer, each_backend_with};
use better_compute::auth::Role;
use chrono::Duration as ChronoDuration;
use futures::StreamExt;
use serde_json::{Value, json};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

/// The longest anything may take to happen on a loaded machine.
const WAIT: Duration = Duration::from_secs(20);
/// How long a socket must stay quiet to count as held open by the server.
const HELD: Duration = Duration::from_millis(300);

const EVENTS: &str = "subscription { events { id type } }";

fn api_address(s: &TestServer) -> SocketAddr {
    s.server.local_addr
}

fn gateway_address(s: &TestServer) -> SocketAddr {
    s.server.gateway.as_ref().unwrap().local_addr
}

/// 127.0.0.`n`: every loopback address reaches the server, and each is a peer of its own.
fn loopback(n: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, n))
}

/// A TCP connection to `to` from loopback address `from`.
async fn tcp_from(from: IpAddr, to: SocketAddr) -> TcpStream {
    try_tcp_from(from, to).await.unwrap()
}

/// [`tcp_from`], which fails when the server resets the connection before the client has
/// seen it established (it refused it at accept).
async fn try_tcp_from(from: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(to).await
}

/// How long until the peer closed `stream` (what it sends is read and dropped), or `None`
/// if it is still open after `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    let deadline = start + within;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(start.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

/// Whether the server still holds `stream` open (it sends nothing on an idle one).
async fn held(stream: &mut TcpStream) -> bool {
    closed_within(stream, HELD).await.is_none()
}

/// How many of `streams` the server closed within `within`, and the latest close.
async fn closes(streams: &mut [TcpStream], within: Duration) -> (usize, Duration) {
    let results =
        futures::future::join_all(streams.iter_mut().map(|s| closed_within(s, within))).await;
    let closed: Vec<Duration> = results.into_iter().flatten().collect();
    let latest = closed.iter().max().copied().unwrap_or_default();
    (closed.len(), latest)
}

/// Opens `count` idle connections from `from`, then sorts them: held by the server, or
/// closed at once.
async fn open_idle(from: IpAddr, to: SocketAddr, count: usize) -> (Vec<TcpStream>, usize) {
    let mut streams = Vec::new();
    let mut refused = 0;
    for _ in 0..count {
        match try_tcp_from(from, to).await {
            Ok(stream) => streams.push(stream),
            Err(_) => refused += 1,
        }
    }
    let mut kept = Vec::new();
    for mut stream in streams {
        if held(&mut stream).await {
            kept.push(stream);
        } else {
            refused += 1;
        }
    }
    (kept, refused)
}

/// A client whose connections come from loopback address `from`, one per request.
fn client_from(from: IpAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .local_address(from)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// POSTs `query` from `from` with `token`; the status and the JSON body.
async fn gql_from(s: &TestServer, from: IpAddr, token: Option<&str>, query: &str) -> (u16, Value) {
    let mut request = client_from(from)
        .post(format!("{}/graphql", s.url()))
        .json(&json!({ "query": query }));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = tokio::time::timeout(WAIT, request.send())
        .await
        .expect("an answer in time")
        .expect("an answer");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The sum of the samples of `name` whose labels include every one of `labels`, read from
/// `/metrics` (from `from`, as an admin, so that it works while the listener is full).
/// Metrics are per process and tests share it: compare before and after.
async fn metric(s: &TestServer, from: IpAddr, name: &str, labels: &[&str]) -> f64 {
    let text = client_from(from)
        .get(format!("{}/metrics", s.url()))
        .bearer_auth(s.admin_token())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|line| {
            line.starts_with(name)
                && line[name.len()..].starts_with(['{', ' '])
                && labels.iter().all(|l| line.contains(l))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Sends a raw HTTP/1.1 request head (and `body`), and returns the status of the answer
/// within `within`, or `None` if none came.
async fn raw_status(
    stream: &mut TcpStream,
    head: &str,
    body: &[u8],
    within: Duration,
) -> Option<u16> {
    stream.write_all(head.as_bytes()).await.unwrap();
    if !body.is_empty() {
        let _ = stream.write_all(body).await;
    }
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) | Ok(Ok(0) | Err(_)) => break,
            Ok(Ok(n)) => {
                answer.extend_from_slice(&buf[..n]);
                if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
        }
    }
    let text = String::from_utf8_lossy(&answer);
    text.split(' ').nth(1)?.parse().ok()
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

// ---------------------------------------------------------------------------------------
// 3. Connection caps and timeouts on the API listener

/// Slowloris (headers trickled a line at a time) and idle connections are closed by the
/// header timeout.
#[tokio::test]
async fn slow_and_idle_api_connections_are_closed_by_the_header_timeout() {
    each_backend_with(
        |c| c.api.header_timeout_secs = 1,
        async |s| {
            let mut idle = Vec::new();
            let mut slow = Vec::new();
            for _ in 0..10 {
                idle.push(tcp_from(loopback(1), api_address(s)).await);
                let mut stream = tcp_from(loopback(1), api_address(s)).await;
                stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").await.unwrap();
                slow.push(stream);
            }
            let trickle = async {
                for _ in 0..(WAIT.as_millis() / 250) {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    for stream in &mut slow {
                        let _ = stream.write_all(b"X-Slow: 1\r\n").await;
                    }
                }
            };
            let (idle_closed, idle_latest) = tokio::select! {
                closed = closes(&mut idle, WAIT) => closed,
                () = trickle => (0, Duration::ZERO),
            };
            let (slow_closed, slow_latest) = closes(&mut slow, WAIT).await;
            eprintln!(
                "{:?}: header timeout 1 s: {idle_closed}/10 idle connections closed, the last after {} ms; \
                 {slow_closed}/10 slowloris connections closed, the last after {} ms",
                s.backend,
                ms(idle_latest),
                ms(slow_latest)
            );
            assert_eq!((idle_closed, slow_closed), (10, 10));
            // A keep-alive connection idle after its request is closed by the same timer.
            let mut keep_alive = tcp_from(loopback(1), api_address(s)).await;
            let status = raw_status(
                &mut keep_alive,
                "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                b"",
                WAIT,
            )
            .await;
            assert_eq!(status, Some(200));
            let closed = closed_within(&mut keep_alive, WAIT).await;
            eprintln!("{:?}: an idle keep-alive connection closed after {closed:?}", s.backend);
            assert!(closed.is_some());
        },
    )
    .await;
}

/// Over the listener's cap and over a peer's cap, connections are closed at once and
/// counted; another address still gets in while one address is at its cap.
#[tokio::test]
async fn api_connections_over_the_caps_are_closed_at_once_and_counted() {
    each_backend_with(
        |c| {
            c.api.max_connections = Some(40);
            c.api.max_connections_per_peer = Some(15);
            c.api.admin_reserved_connections = 4;
            c.api.header_timeout_secs = 60;
        },
        async |s| {
            let before = metric(s, loopback(9), "bc_connections_refused_total", &["listener=\"api\"", "peer_full"]).await;
            // One address: 15 held, the rest closed at once.
            let (mut from_one, refused) = open_idle(loopback(2), api_address(s), 20).await;
            eprintln!("{:?}: per-peer cap 15: {} held, {refused} closed at once", s.backend, from_one.len());
            assert_eq!((from_one.len(), refused), (15, 5));
            let after = metric(s, loopback(9), "bc_connections_refused_total", &["listener=\"api\"", "peer_full"]).await;
            assert!(after - before >= 5.0, "refusals are counted: {before} -> {after}");
            // Other addresses fill the rest: 36 ordinary slots, then one reserved slot each.
            let (mut from_two, _) = open_idle(loopback(3), api_address(s), 15).await;
            let (mut from_three, refused) = open_idle(loopback(4), api_address(s), 15).await;
            let open = from_one.len() + from_two.len() + from_three.len();
            eprintln!("{:?}: listener cap 40 (4 reserved): {open} held, {refused} of the last 15 closed at once", s.backend);
            assert_eq!(from_two.len(), 15);
            assert_eq!(from_three.len(), 6 + 1, "6 ordinary slots, then one reserved");
            assert_eq!(refused, 8);
            // Closing connections frees their slots (once the server has read their end).
            from_one.truncate(5);
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (mut again, refused) = open_idle(loopback(5), api_address(s), 10).await;
            assert_eq!((again.len(), refused), (10, 0), "freed slots are taken again");
            for stream in from_one.iter_mut().chain(&mut from_two).chain(&mut from_three).chain(&mut again) {
                let _ = stream.shutdown().await;
            }
        },
    )
    .await;
}

/// With the API listener full, a platform admin's request is served on a reserved slot
/// (anyone else's is answered 503 and its connection closed), and the subscription
/// socket already open keeps delivering.
#[tokio::test]
async fn with_the_api_full_an_admin_request_and_open_sessions_still_work() {
    each_backend_with(
        |c| {
            c.api.max_connections = Some(31);
            c.api.max_connections_per_peer = Some(31);
            c.api.admin_reserved_connections = 4;
            c.api.header_timeout_secs = 60;
        },
        async |s| {
            let mut subscriber = SubscriptionClient::connect(&s.url(), &s.token(Role::Viewer))
                .await
                .unwrap();
            subscriber.subscribe("e", EVENTS, json!({})).await.unwrap();
            // Fill the listener from one address: it takes the ordinary slots and one
            // reserved slot, no more.
            let (mut filler, refused) = open_idle(loopback(2), api_address(s), 40).await;
            eprintln!(
                "{:?}: cap 31 with 4 reserved: the flood holds {}, {refused} closed at once",
                s.backend,
                filler.len()
            );
            assert!(refused >= 10, "the flood is capped: {refused} refused");

            let started = Instant::now();
            let (status, body) = gql_from(
                s,
                loopback(3),
                Some(s.admin_token()),
                "mutation { createTenant(input: {name: \"while-full\"}) { tenant { id } } }",
            )
            .await;
            eprintln!(
                "{:?}: an admin's request while the listener is full: HTTP {status} in {} ms",
                s.backend,
                ms(started.elapsed())
            );
            assert_eq!(status, 200, "{body:#}");
            assert!(
                body["data"]["createTenant"]["tenant"]["id"].is_string(),
                "{body:#}"
            );
            // The open subscription saw it.
            let event = subscriber.next_data("e", "events", WAIT).await.unwrap();
            assert_eq!(event["type"], "tenant.created", "{event:#}");

            let (status, body) = gql_from(
                s,
                loopback(4),
                Some(&s.token(Role::Viewer)),
                "{ viewer { subject } }",
            )
            .await;
            assert_eq!(
                (status, body["errors"][0]["extensions"]["code"].as_str()),
                (503, Some("FORBIDDEN")),
                "{body:#}"
            );
            let (status, body) = gql_from(s, loopback(5), None, "{ viewer { subject } }").await;
            assert_eq!(
                (status, body["errors"][0]["extensions"]["code"].as_str()),
                (503, Some("UNAUTHENTICATED")),
                "{body:#}"
            );
            // The flood's address already holds a reserved slot: it gets no second one.
            let (more, _) = open_idle(loopback(2), api_address(s), 1).await;
            assert!(
                more.is_empty(),
                "a connection over the cap is closed at once"
            );
            subscriber.close().await;
            filler.clear();
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 3. The gateway listener

/// Connections that never start TLS, and TLS connections that trickle half a request, are
/// closed by the handshake and header timeouts.
#[tokio::test]
async fn the_gateway_closes_silent_handshakes_and_slow_headers() {
    each_backend_with(
        |c| {
            c.gateway.tls_handshake_timeout_secs = 1;
            c.gateway.header_timeout_secs = 1;
        },
        async |s| {
            let mut silent = Vec::new();
            for _ in 0..20 {
                silent.push(tcp_from(loopback(1), gateway_address(s)).await);
            }
            let (closed, latest) = closes(&mut silent, WAIT).await;
            eprintln!("{:?}: TLS handshake timeout 1 s: {closed}/20 silent connections closed, the last after {} ms", s.backend, ms(latest));
            assert_eq!(closed, 20);

            let config = tls_config(&s.ca_pem(), None);
            let mut slow = Vec::new();
            for _ in 0..5 {
                let tcp = tcp_from(loopback(1), gateway_address(s)).await;
                let mut tls = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(rustls::pki_types::ServerName::try_from("localhost").unwrap(), tcp)
                    .await
                    .unwrap();
                tls.write_all(b"GET /v1/ca.pem HTTP/1.1\r\nHost: x\r\n").await.unwrap();
                tls.flush().await.unwrap();
                slow.push(tls);
            }
            let started = Instant::now();
            let mut closed = 0;
            for tls in &mut slow {
                let mut buf = [0u8; 1024];
                if let Ok(Ok(0) | Err(_)) = tokio::time::timeout_at(started + WAIT, tls.read(&mut buf)).await {
                    closed += 1;
                }
            }
            eprintln!("{:?}: header timeout 1 s: {closed}/5 TLS connections with half a request closed within {} ms", s.backend, ms(started.elapsed()));
            assert_eq!(closed, 5);
        },
    )
    .await;
}

/// A session that goes silent is closed by the idle timeout; one that heartbeats is not.
#[tokio::test]
async fn the_gateway_closes_a_silent_session() {
    each_backend_with(
        |c| {
            c.liveness.heartbeat_interval_secs = 1;
            c.liveness.grace_secs = 4;
            c.gateway.idle_timeout_secs = 3;
        },
        async |s| {
            let (site, pool) = s.site_and_pool(8).await;
            let secret = s.join_token(&site, Some(&pool), 1).await;
            let machine = Machine::new();
            let issued = join(s, &machine, &secret, "gpu-idle").await;
            let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
                .await
                .unwrap();
            send(&mut ws, &hello(0)).await;
            assert!(matches!(
                next(&mut ws).await,
                Ok(GatewayMessage::Welcome { .. })
            ));
            // Heartbeating for longer than the idle timeout keeps the session.
            for seq in 1..=10 {
                send(&mut ws, &DaemonMessage::Heartbeat { seq }).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            // Then silence.
            let started = Instant::now();
            let ended = tokio::time::timeout(WAIT, async {
                loop {
                    match ws.next().await {
                        Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                        Some(Ok(_)) => {}
                    }
                }
            })
            .await;
            eprintln!(
                "{:?}: idle timeout 3 s: a silent session ended after {} ms",
                s.backend,
                ms(started.elapsed())
            );
            assert!(
                ended.is_ok(),
                "the silent session is still open after {WAIT:?}"
            );
            wait_until(async || node(s, &issued.node_id).await["connectivity"] == "DISCONNECTED")
                .await;
        },
    )
    .await;
}

/// With the gateway full, new connections are closed at once and the session already open
/// keeps working.
#[tokio::test]
async fn with_the_gateway_full_open_sessions_still_work() {
    each_backend_with(
        |c| {
            c.gateway.max_connections = Some(20);
            c.gateway.tls_handshake_timeout_secs = 60;
        },
        async |s| {
            let (site, pool) = s.site_and_pool(8).await;
            let secret = s.join_token(&site, Some(&pool), 1).await;
            let machine = Machine::new();
            let issued = join(s, &machine, &secret, "gpu-full").await;
            let mut ws = connect(s, &issued.certificate_pem, machine.key_der())
                .await
                .unwrap();
            send(&mut ws, &hello(0)).await;
            assert!(matches!(
                next(&mut ws).await,
                Ok(GatewayMessage::Welcome { .. })
            ));

            let before = metric(
                s,
                loopback(9),
                "bc_connections_refused_total",
                &["listener=\"gateway\"", "listener_full"],
            )
            .await;
            let (flood, refused) = open_idle(loopback(2), gateway_address(s), 30).await;
            eprintln!(
                "{:?}: gateway cap 20: a flood of 30 holds {}, {refused} closed at once",
                s.backend,
                flood.len()
            );
            assert_eq!(
                (flood.len(), refused),
                (19, 11),
                "the session holds the 20th slot"
            );
            let after = metric(
                s,
                loopback(9),
                "bc_connections_refused_total",
                &["listener=\"gateway\"", "listener_full"],
            )
            .await;
            assert!(
                after - before >= 11.0,
                "refusals are counted: {before} -> {after}"
            );

            // The open session still heartbeats.
            s.clock.advance(ChronoDuration::seconds(10));
            send(&mut ws, &DaemonMessage::Heartbeat { seq: 1 }).await;
            let seen_at = Clock::now(&s.clock);
            wait_until(async || {
                node(s, &issued.node_id).await["session"]["lastSeen"]
                    .as_str()
                    .is_some_and(|t| parse_time(t) >= seen_at)
            })
            .await;
            assert_eq!(node(s, &issued.node_id).await["connectivity"], "CONNECTED");
            drop(flood);
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 3. Subscription sockets: connection_init and keep-alive

/// A WebSocket that never sends `connection_init` is closed with 4408.
#[tokio::test]
async fn a_subscription_socket_without_connection_init_is_closed_with_4408() {
    each_backend_with(
        |c| c.api.ws_init_timeout_secs = 1,
        async |s| {
            let mut request =
                tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
                    format!("ws://{}/graphql", api_address(s)),
                )
                .unwrap();
            request.headers_mut().insert(
                "Sec-WebSocket-Protocol",
                "graphql-transport-ws".parse().unwrap(),
            );
            let (mut ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
            let started = Instant::now();
            let frame = tokio::time::timeout(WAIT, ws.next()).await;
            eprintln!(
                "{:?}: init timeout 1 s: {frame:?} after {} ms",
                s.backend,
                ms(started.elapsed())
            );
            match frame {
                Ok(Some(Ok(Message::Close(Some(frame))))) => {
                    assert_eq!(u16::from(frame.code), 4408)
                }
                other => panic!("expected a close with 4408, got {other:?}"),
            }
        },
    )
    .await;
}

/// A client that stops answering pings is closed with 3008; one that reads (and so
/// answers) stays open past several intervals and keeps receiving. The pong timeout is
/// three intervals: with one, a loaded machine (the whole suite in parallel beside builds)
/// once kept the live client from answering in time.
#[tokio::test]
async fn a_subscription_socket_that_stops_answering_pings_is_closed() {
    each_backend_with(
        |c| {
            c.api.ws_ping_interval_secs = 1;
            c.api.ws_pong_timeout_secs = 3;
        },
        async |s| {
            let token = s.token(Role::Admin);
            let mut live = SubscriptionClient::connect(&s.url(), &token).await.unwrap();
            live.subscribe("e", EVENTS, json!({})).await.unwrap();
            let mut deaf = SubscriptionClient::connect(&s.url(), &token).await.unwrap();
            // The live client reads (and so answers pings) for four intervals.
            let quiet = live.next("e", Duration::from_secs(4)).await;
            assert!(
                quiet.is_err() && live.closed().is_none(),
                "the live client is open: {quiet:?}"
            );
            s.admin(
                "mutation { createTenant(input: {name: \"ping\"}) { tenant { id } } }",
                json!({}),
            )
            .await;
            let event = live.next_data("e", "events", WAIT).await.unwrap();
            assert_eq!(event["type"], "tenant.created");
            // The deaf one read nothing all along: it was closed.
            let outcome = deaf.next_any(WAIT).await;
            eprintln!(
                "{:?}: ping 1 s, pong timeout 3 s: the deaf client got {outcome:?}, closed {:?}",
                s.backend,
                deaf.closed()
            );
            assert_eq!(deaf.closed().map(|(code, _)| *code), Some(3008));
            live.close().await;
        },
    )
    .await;
}

/// `graphql-transport-ws`: a `subscribe` that reuses the id of an operation still running
/// closes the socket with 4409, whether a hub (`events`) or the engine (`nodeChanges`) runs
/// it; the id of an operation that completed, or that the client stopped, may be used again.
#[tokio::test]
async fn a_subscribe_reusing_a_running_operations_id_closes_the_socket_with_4409() {
    const QUERY: &str = "{ nodes(first: 1) { edges { node { id } } } }";
    const NODE_CHANGES: &str = "subscription { nodeChanges { kind } }";
    each_backend_with(
        |_| {},
        async |s| {
            let token = s.token(Role::Admin);
            for running in [EVENTS, NODE_CHANGES] {
                let mut client = SubscriptionClient::connect(&s.url(), &token).await.unwrap();
                // A query completes by itself, and its id is free again.
                for _ in 0..2 {
                    client.subscribe("q", QUERY, json!({})).await.unwrap();
                    let answer = client.next("q", WAIT).await.unwrap();
                    assert!(answer.data().is_some(), "{answer:?}");
                    assert_eq!(client.next("q", WAIT).await.unwrap(), SubMessage::Complete);
                }
                // A subscription the client stopped frees its id at once.
                client.subscribe("s", running, json!({})).await.unwrap();
                client.complete("s").await.unwrap();
                client.subscribe("s", running, json!({})).await.unwrap();
                client.subscribe("q", QUERY, json!({})).await.unwrap();
                let answer = client.next("q", WAIT).await.unwrap();
                assert!(
                    answer.data().is_some(),
                    "{running}: the socket is open: {answer:?}"
                );
                assert!(
                    client.closed().is_none(),
                    "{running}: {:?}",
                    client.closed()
                );
                // Running: reusing its id closes the socket.
                client.subscribe("s", running, json!({})).await.unwrap();
                let deadline = Instant::now() + WAIT;
                while client.closed().is_none() && Instant::now() < deadline {
                    if client.next_any(WAIT).await.is_err() {
                        break;
                    }
                }
                let closed = client.closed().cloned();
                assert_eq!(
                    closed,
                    Some((4409, "Subscriber for s already exists".to_owned())),
                    "{running}"
                );
            }
        },
    )
    .await;
}

/// The older `graphql-ws` protocol (`subscriptions-transport-ws`): a `start` that reuses the
/// id of a running subscription replaces it, as that protocol allows, without closing the
/// socket. A client subscribes to cordons as `s`, then to uncordons as `s`; a node is then
/// cordoned and uncordoned, and `s` brings the uncordon only. (A socket refusing the reuse,
/// as it must under `graphql-transport-ws`, closes with 4409 and fails this.)
#[tokio::test]
async fn a_legacy_start_reusing_a_running_subscriptions_id_replaces_it() {
    const CORDONS: &str = "subscription { events(filter: {types: [NODE_CORDONED]}) { id type } }";
    const UNCORDONS: &str =
        "subscription { events(filter: {types: [NODE_UNCORDONED]}) { id type } }";
    each_backend_with(
        |_| {},
        async |s| {
            let (site, pool) = s.site_and_pool(8).await;
            let node = s.enroll(&site, &pool, "legacy-ws").await["id"]
                .as_str()
                .unwrap()
                .to_owned();
            let mut request =
                tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
                    format!("ws://{}/graphql", api_address(s)),
                )
                .unwrap();
            request
                .headers_mut()
                .insert("Sec-WebSocket-Protocol", "graphql-ws".parse().unwrap());
            let (mut ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
            let token = s.token(Role::Admin);
            let send = |message: Value| Message::Text(message.to_string().into());
            futures::SinkExt::send(
                &mut ws,
                send(json!({ "type": "connection_init", "payload": { "Authorization": format!("Bearer {token}") } })),
            )
            .await
            .unwrap();
            for (query, id) in [(CORDONS, "s"), (UNCORDONS, "s"), ("{ viewer { subject } }", "q")] {
                futures::SinkExt::send(
                    &mut ws,
                    send(json!({ "type": "start", "id": id, "payload": { "query": query } })),
                )
                .await
                .unwrap();
            }
            // The query's answer comes after both starts were taken (a socket's messages are
            // handled in order); the mutations follow it.
            let mut seen: Vec<Value> = Vec::new();
            let mut mutated = false;
            let deadline = Instant::now() + WAIT;
            let uncordoned = loop {
                let frame = tokio::time::timeout_at(deadline, ws.next())
                    .await
                    .expect("the uncordon arrives under `s`")
                    .expect("the socket stays open")
                    .unwrap();
                let message: Value = match frame {
                    Message::Text(text) => serde_json::from_str(&text).unwrap(),
                    Message::Close(frame) => panic!("the socket was closed: {frame:?}"),
                    _ => continue,
                };
                match (message["type"].as_str(), message["id"].as_str()) {
                    (Some("data"), Some("q")) if !mutated => {
                        mutated = true;
                        s.admin(
                            "mutation($id: ID!) { cordonNode(input: {id: $id, version: 1, reason: \"r\"}) { node { version } } }",
                            json!({ "id": node }),
                        )
                        .await;
                        s.admin(
                            "mutation($id: ID!) { uncordonNode(input: {id: $id, version: 2}) { node { version } } }",
                            json!({ "id": node }),
                        )
                        .await;
                    }
                    (Some("data"), Some("s")) => {
                        let event = message["payload"]["data"]["events"].clone();
                        if event["type"] == "node.uncordoned" {
                            break event;
                        }
                        seen.push(event);
                    }
                    (Some("error"), _) => panic!("an error: {message}"),
                    _ => {}
                }
            };
            assert!(mutated, "the query was answered");
            assert_eq!(seen, Vec::<Value>::new(), "the replaced subscription sent events");
            assert_eq!(uncordoned["type"], "node.uncordoned");
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 4. Bodies

/// A request without a token is answered 401 before its body is read: the client has
/// sent the headers of a 100 MB body and nothing of it.
#[tokio::test]
async fn a_body_without_a_token_is_refused_before_it_is_read() {
    each_backend_with(
        |_| {},
        async |s| {
            let mut streams = Vec::new();
            for _ in 0..8 {
                streams.push(tcp_from(loopback(1), api_address(s)).await);
            }
            let head = "POST /graphql HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 104857600\r\n\r\n";
            let started = Instant::now();
            let statuses = futures::future::join_all(
                streams.iter_mut().map(|stream| raw_status(stream, head, b"{\"query\": \"", Duration::from_secs(10))),
            )
            .await;
            eprintln!("{:?}: 8 unauthenticated 100 MB bodies (none of it sent): {statuses:?} in {} ms", s.backend, ms(started.elapsed()));
            assert!(statuses.iter().all(|s| *s == Some(401)), "{statuses:?}");
        },
    )
    .await;
}

/// Bodies over `api.max_body_bytes` (1 MiB) are refused with 413: from the declared length
/// before reading, and while reading a chunked one; a body under it works.
#[tokio::test]
async fn an_oversized_body_is_refused_while_reading() {
    each_backend_with(
        |_| {},
        async |s| {
            let token = s.admin_token().to_owned();
            // Declared too large: nothing is read.
            let mut stream = tcp_from(loopback(1), api_address(s)).await;
            let head = format!(
                "POST /graphql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                2 * 1024 * 1024
            );
            let status = raw_status(&mut stream, &head, b"", Duration::from_secs(10)).await;
            eprintln!("{:?}: a declared 2 MiB body, none of it sent: {status:?}", s.backend);
            assert_eq!(status, Some(413));

            // Chunked: the server stops reading past 1 MiB.
            let mut stream = tcp_from(loopback(1), api_address(s)).await;
            let head = format!(
                "POST /graphql HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            let (mut reader, mut writer) = stream.into_split();
            let chunk = format!("{:x}\r\n{}\r\n", 64 * 1024, " ".repeat(64 * 1024));
            let sender = tokio::spawn(async move {
                let mut sent = 0usize;
                // 2 MiB, never terminated: only a server that stops reading answers.
                for _ in 0..32 {
                    if writer.write_all(chunk.as_bytes()).await.is_err() {
                        break;
                    }
                    sent += 64 * 1024;
                }
                (sent, writer)
            });
            let mut answer = Vec::new();
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(10), async {
                while let Ok(n) = reader.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    answer.extend_from_slice(&buf[..n]);
                    if String::from_utf8_lossy(&answer).contains("\r\n\r\n") && answer.ends_with(b"}") {
                        break;
                    }
                }
            })
            .await;
            let answer = String::from_utf8_lossy(&answer).to_string();
            let (sent, _writer) = sender.await.unwrap();
            eprintln!("{:?}: a chunked body of up to 2 MiB ({} KiB written): {}", s.backend, sent / 1024, answer.lines().next().unwrap_or("no answer"));
            assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
            assert!(answer.contains("BAD_USER_INPUT"), "{answer}");

            // Under the limit: served.
            let padding = "a".repeat(900 * 1024);
            let response = reqwest::Client::new()
                .post(format!("{}/graphql", s.url()))
                .bearer_auth(&token)
                .json(&json!({ "query": "query($pad: String) { viewer { subject } }", "variables": { "pad": padding } }))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), 200);
        },
    )
    .await;
}

/// The gateway's join and renewal bodies are bounded (`gateway.max_body_bytes`), and a
/// renewal without a client certificate is refused before its body is read.
#[tokio::test]
async fn gateway_bodies_are_bounded() {
    each_backend_with(
        |c| c.gateway.max_body_bytes = 8 * 1024,
        async |s| {
            let big = json!({ "token": "jt_x.y", "csrPem": "x".repeat(16 * 1024), "hostname": "h", "identifiers": {} });
            let (status, body) = post_join(s, big.clone()).await;
            eprintln!("{:?}: a 16 KiB join body with an 8 KiB limit: {status} {body}", s.backend);
            assert_eq!((status, body["code"].as_str()), (413, Some("BAD_USER_INPUT")));
            let response = http(&s.ca_pem(), None)
                .post(format!("{}/v1/renew", s.gateway_url()))
                .json(&big)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status().as_u16(), 401, "no certificate: refused before the body");
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 5. Token lifetimes

/// A token that expires while its subscription socket is open gets the socket closed with
/// 4403 at expiry (on the server's clock, which the test moves).
#[tokio::test]
async fn a_socket_is_closed_with_4403_when_its_token_expires() {
    each_backend_with(
        |c| c.api.ws_ping_interval_secs = 1,
        async |s| {
            let token = s.mint("short", Role::Viewer, None, ChronoDuration::seconds(60));
            let mut client = SubscriptionClient::connect(&s.url(), &token).await.unwrap();
            client.subscribe("e", EVENTS, json!({})).await.unwrap();
            s.clock.advance(ChronoDuration::seconds(59));
            assert!(client.next("e", Duration::from_secs(2)).await.is_err());
            assert!(
                client.closed().is_none(),
                "open before expiry: {:?}",
                client.closed()
            );
            s.clock.advance(ChronoDuration::seconds(1));
            let started = Instant::now();
            let outcome = client.next("e", WAIT).await;
            eprintln!(
                "{:?}: token expired: {outcome:?}, closed {:?} after {} ms",
                s.backend,
                client.closed(),
                ms(started.elapsed())
            );
            assert_eq!(client.closed().map(|(code, _)| *code), Some(4403));
        },
    )
    .await;
}

/// An operation sent on a socket after its token expired does not run: the socket is
/// closed with 4403 (or the operation refused `UNAUTHENTICATED`), and the tenant it would
/// have created does not exist. Over HTTP the same token is refused 401.
#[tokio::test]
async fn an_operation_after_expiry_is_refused() {
    each_backend_with(
        |_| {},
        async |s| {
            let token = s.mint(
                "short-admin",
                Role::Admin,
                None,
                ChronoDuration::seconds(60),
            );
            let mut client = SubscriptionClient::connect(&s.url(), &token).await.unwrap();
            s.clock.advance(ChronoDuration::seconds(65));
            client
                .subscribe(
                    "late",
                    "mutation { createTenant(input: {name: \"late\"}) { tenant { id } } }",
                    json!({}),
                )
                .await
                .unwrap();
            let outcome = client.next("late", WAIT).await;
            eprintln!(
                "{:?}: createTenant 65 s after expiry: {outcome:?}, closed {:?}",
                s.backend,
                client.closed()
            );
            match &outcome {
                Ok(message) => {
                    assert_eq!(message.error_code(), Some("UNAUTHENTICATED"), "{message:?}")
                }
                Err(_) => assert_eq!(client.closed().map(|(code, _)| *code), Some(4403)),
            }
            let tenants = s.admin("{ tenants { nodes { name } } }", json!({})).await;
            assert!(
                !tenants["tenants"]["nodes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|t| t["name"] == "late"),
                "the tenant was created: {tenants:#}"
            );
            let refused = s
                .gql(Some(&token), "{ viewer { subject } }", json!({}))
                .await;
            assert_eq!(
                (refused.status, refused.code()),
                (401, Some("UNAUTHENTICATED"))
            );
        },
    )
    .await;
}

/// Tokens with `nbf` or `iat` in the future beyond the leeway are refused, over HTTP and at
/// `connection_init` (with 4403, as is every bad token there); within the leeway they work.
#[tokio::test]
async fn tokens_from_the_future_are_refused() {
    each_backend_with(
        |c| c.auth.leeway_secs = 30,
        async |s| {
            let now = Clock::now(&s.clock).timestamp();
            let claims = |iat: i64, nbf: Option<i64>| {
                let mut claims = json!({
                    "sub": "future", "aud": "better-compute", "iat": iat, "exp": now + 3600, "roles": ["admin"],
                });
                if let Some(nbf) = nbf {
                    claims["nbf"] = json!(nbf);
                }
                s.mint_claims(&claims)
            };
            let cases = [
                ("nbf in 5 minutes", claims(now, Some(now + 300)), false),
                ("iat in 5 minutes", claims(now + 300, None), false),
                ("nbf within the leeway", claims(now, Some(now + 20)), true),
                ("iat within the leeway", claims(now + 20, None), true),
            ];
            for (name, token, good) in &cases {
                let response = s.gql(Some(token), "{ viewer { subject } }", json!({})).await;
                eprintln!("{:?}: {name}: HTTP {}", s.backend, response.status);
                if *good {
                    assert_eq!(response.status, 200, "{name}: {:#}", response.body);
                } else {
                    assert_eq!((response.status, response.code()), (401, Some("UNAUTHENTICATED")), "{name}");
                }
            }
            let expired = s.mint("late", Role::Admin, None, ChronoDuration::seconds(-5));
            let bad_inits = [
                ("nbf in 5 minutes", json!({ "Authorization": format!("Bearer {}", cases[0].1) })),
                ("iat in 5 minutes", json!({ "Authorization": format!("Bearer {}", cases[1].1) })),
                ("expired", json!({ "Authorization": format!("Bearer {expired}") })),
                ("malformed", json!({ "Authorization": "Bearer not-a-jwt" })),
                ("no token", json!({})),
            ];
            for (name, payload) in bad_inits {
                match SubscriptionClient::connect_with(&s.url(), &ConnectOptions::with_payload(payload)).await {
                    Err(ConnectError::Refused { code, reason }) => {
                        eprintln!("{:?}: connection_init with {name}: closed {code} {reason:?}", s.backend);
                        assert_eq!(code, 4403, "{name}: {reason}");
                    }
                    Err(ConnectError::Other(err)) => panic!("{name}: {err:#}"),
                    Ok(_) => panic!("{name}: acknowledged"),
                }
            }
            let good = SubscriptionClient::connect(&s.url(), &cases[2].1).await.unwrap();
            good.close().await;
        },
    )
    .await;
}
