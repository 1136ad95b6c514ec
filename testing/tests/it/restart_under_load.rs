//! A restart under load (issue 17, item 6): a simulated fleet joins, passes acceptance
//! (`diag.nvml`), runs the `inventory.refresh` and `logs.collect` commands people send to
//! every node, and has its nodes cordoned, uncordoned and re-joined, while the control plane
//! restarts under it and the clock jumps past the liveness grace. Sessions close, reconnect,
//! dispatch and redeliver commands concurrently with heartbeats, Liveness and node changes.
//!
//! It ends with every node connected again and every command ended, and counts what must
//! stay zero: PostgreSQL's own deadlock counter for the test database, the server's
//! `bc_internal_errors_total`, and `INTERNAL` answers of the API.
//!
//! On PostgreSQL two replicas share the database behind one gateway address (a TCP proxy
//! in this file, the load balancer's part), and each restart takes one of them away while
//! its daemons reconnect to the other, so one replica's session ends (redelivery, the node
//! going `disconnected`) run concurrently with the other's session starts (a new epoch,
//! `connected`, dispatch). On SQLite one server restarts behind the proxy.
//!
//! Figures are printed (`--nocapture`). The deterministic reproduction of the lock-order
//! cycle itself is `lock_order.rs`; this test is the load that finds such cycles.

use bc_testing::daemon::CaTrust;
use bc_testing::sim::{Fleet, KnobOverride, SimOptions};
use bc_testing::{Backend, DaemonKnobs, Progress, TestServer};
use better_compute::config::Config;
use sea_orm::{ConnectionTrait, Statement};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

/// 200 nodes through TLS joins on a loaded 2-core machine.
const FLEET_UP: Duration = Duration::from_secs(240);
/// Bounds for what takes seconds when all is well: generous, so a loaded CI machine passes.
const SETTLE: Duration = Duration::from_secs(180);
/// Rounds of `inventory.refresh` and `logs.collect` to every node.
const COMMAND_ROUNDS: usize = 6;
/// Nodes whose identity is revoked as each restart begins.
const REVOKED_PER_RESTART: usize = 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_under_load_survives_restarts_without_deadlocks_or_internal_errors() {
    // The server's warnings (why something was INTERNAL) show with the figures.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
    for backend in Backend::selected() {
        let nodes = 200;
        let figures = restart_under_load(backend, nodes).await;
        eprintln!("restart under load, {backend:?}, {nodes} nodes: {figures:#?}");
        assert_eq!(
            figures.revoked,
            3 * REVOKED_PER_RESTART as u64,
            "{backend:?}: every revoke went through"
        );
        assert_eq!(figures.api_internal, 0, "{backend:?}: INTERNAL answers");
        assert_eq!(
            figures.internal_errors, 0,
            "{backend:?}: bc_internal_errors_total grew (see the warnings logged above)"
        );
        assert_eq!(
            figures.deadlocks,
            Some(0).filter(|_| backend == Backend::Postgres)
        );
    }
}

/// What one run measured.
#[derive(Debug, Default)]
#[allow(dead_code)] // Read through `Debug`, in the printed figures.
struct Figures {
    /// PostgreSQL's `deadlocks` for the test database, after minus before (None on SQLite).
    deadlocks: Option<i64>,
    /// `bc_internal_errors_total` (every replica, every cause), after minus before.
    internal_errors: u64,
    /// ... of which `cause="deadlock"`.
    internal_deadlocks: u64,
    /// API answers with code `INTERNAL`.
    api_internal: u64,
    /// API answers with another error code, by operation and code (`CONFLICT` with a
    /// controller, `FORBIDDEN` for a revoke that lost to another, are expected).
    api_other_errors: BTreeMap<String, u64>,
    restarts: usize,
    /// How long each restart took (shutdown, then start).
    restart_durations: Vec<Duration>,
    commands_sent: u64,
    sessions_opened: u64,
    /// Daemons that joined (re-joins after a revoke not counted again).
    daemons_joined: u64,
    revoked: u64,
}

async fn restart_under_load(backend: Backend, nodes: usize) -> Figures {
    let mut figures = Figures::default();
    let first = TestServer::start_with(backend, |c: &mut Config| {
        // Every replica runs its controllers (Liveness, acceptance, command timing) as in
        // production; the fleet brake would hold the clock jump's downgrades, so it never
        // trips here.
        c.liveness.enabled = true;
        c.liveness.tick_interval_secs = 1;
        c.liveness.brake_min_nodes = u64::MAX;
    })
    .await
    .expect("a server");
    let mut servers = vec![first];
    if backend == Backend::Postgres {
        let replica = servers[0].replica().await.expect("a replica");
        servers.push(replica);
    }
    let internal_before = internal_errors(&servers[0]).await;
    let internal_deadlocks_before = internal_deadlocks(&servers[0]).await;
    let deadlocks_before = servers[0].postgres_deadlocks().await;

    let proxy = Proxy::start(servers.iter().map(gateway_addr).collect()).await;
    let api = Api::new(&servers);
    let (site, pool) = servers[0].site_and_pool(8).await;
    // Enough uses for every node to join again after its identity is revoked.
    let secret = servers[0]
        .join_token(&site, Some(&pool), 4 * nodes as i64)
        .await;
    let options = SimOptions {
        seed: Some(17),
        knobs: DaemonKnobs {
            heartbeat_interval_override: Some(Duration::from_millis(300)),
            rejoin_when_revoked: true,
            ..DaemonKnobs::default()
        },
        overrides: vec![
            KnobOverride::failing_diagnostics(0.05),
            KnobOverride::missing_gpu(0.05),
            KnobOverride::xid_errors(0.03, vec![79]),
        ],
        ..SimOptions::default()
    };
    let fleet = Fleet::start(
        &[proxy.url()],
        &secret,
        CaTrust::Pem(servers[0].ca_pem()),
        nodes,
        &options,
    )
    .await
    .expect("a fleet");

    // The first restart comes while half the fleet is still joining: joins, first sessions,
    // inventory and acceptance are all under way.
    fleet
        .wait_for(|p| p.connected >= nodes as u64 / 2, FLEET_UP)
        .await
        .unwrap_or_else(|p| panic!("half the fleet did not connect: {p:?}"));
    let load = Load::start(api.clone());
    // Each restart comes with the identities of a few nodes revoked (each node once), so
    // nodes are reclaimed in place while their sessions end and start.
    let mut revoked = HashSet::new();
    let revoking = revoke(&api, pick(&fleet, &mut revoked));
    restart(&mut servers, 0, &proxy, &api, &mut figures).await;
    figures.revoked += revoking.await.expect("revoking");
    fleet
        .wait_for(|p| p.connected == nodes as u64, FLEET_UP)
        .await
        .unwrap_or_else(|p| {
            panic!(
                "the fleet did not connect: {p:?}; {:?}",
                fleet.sample_error()
            )
        });

    // Past the liveness grace: every node is silent until its next heartbeat, Liveness marks
    // the fleet unreachable and back while the other server restarts.
    servers[0].clock.advance(chrono::Duration::seconds(45));
    let last = servers.len() - 1;
    let revoking = revoke(&api, pick(&fleet, &mut revoked));
    restart(&mut servers, last, &proxy, &api, &mut figures).await;
    figures.revoked += revoking.await.expect("revoking");
    settle_connected(&fleet, nodes, &servers[0]).await;
    let revoking = revoke(&api, pick(&fleet, &mut revoked));
    restart(&mut servers, 0, &proxy, &api, &mut figures).await;
    figures.revoked += revoking.await.expect("revoking");
    settle_connected(&fleet, nodes, &servers[0]).await;
    let (api_internal, api_other, sent) = load.stop().await;
    figures.api_internal = api_internal;
    figures.api_other_errors = api_other;
    figures.commands_sent = sent;

    // Every node back and connected, every command ended (requeued ones ran again).
    settle_connected(&fleet, nodes, &servers[0]).await;
    wait_until("every node is CONNECTED", || async {
        let listed = api.all_nodes().await;
        listed.len() == nodes && listed.iter().all(|n| n["connectivity"] == "CONNECTED")
    })
    .await;
    wait_until("no command is queued, dispatched or running", || async {
        api.open_commands().await == Some(0)
    })
    .await;

    let progress: Progress = fleet.shutdown().await;
    figures.sessions_opened = progress.sessions;
    figures.daemons_joined = progress.joined;
    figures.internal_errors = internal_errors(&servers[0]).await - internal_before;
    figures.internal_deadlocks = internal_deadlocks(&servers[0]).await - internal_deadlocks_before;
    // PostgreSQL counts a deadlock when the backend that saw it reports its statistics,
    // which it does at the latest when it exits: restart every server so that all the
    // backends of the run exit, wait until they have, and read the counter.
    let old_backends = servers[0].postgres_backends().await;
    let mut restarted = Vec::new();
    for server in servers {
        restarted.push(server.restart().await.expect("a last restart"));
    }
    if backend == Backend::Postgres {
        wait_until("the run's PostgreSQL backends exited", || async {
            let now = restarted[0].postgres_backends().await;
            !old_backends.iter().any(|pid| now.contains(pid))
        })
        .await;
        let after = restarted[0].postgres_deadlocks().await;
        figures.deadlocks = after.zip(deadlocks_before).map(|(a, b)| a - b);
    }
    for server in restarted {
        server.stop().await;
    }
    drop(proxy);
    figures
}

/// Takes server `index` out of the proxy and the API rotation, restarts it (its sessions
/// end; its daemons reconnect elsewhere, or to it once it is back) and puts it back.
async fn restart(
    servers: &mut Vec<TestServer>,
    index: usize,
    proxy: &Proxy,
    api: &Api,
    figures: &mut Figures,
) {
    let server = servers.remove(index);
    proxy.remove(gateway_addr(&server));
    api.remove(&server.url());
    let old = gateway_addr(&server);
    let started = std::time::Instant::now();
    let server = server.restart().await.expect("a restart");
    figures.restart_durations.push(started.elapsed());
    // The stopped server's process would have exited, closing its sockets; in this process
    // its keep-alive connections live on, so the proxy closes them as the exit would.
    proxy.sever(old);
    proxy.add(gateway_addr(&server));
    api.add(&server.url());
    servers.insert(index, server);
    figures.restarts += 1;
}

async fn settle_connected(fleet: &Fleet, nodes: usize, server: &TestServer) {
    let settled = fleet
        .wait_for(|p| p.connected == nodes as u64 && p.failed == 0, SETTLE)
        .await;
    if let Err(p) = settled {
        let stragglers: Vec<String> = fleet
            .daemons()
            .iter()
            .map(|d| d.status())
            .filter(|s| !s.connected)
            .map(|s| {
                format!(
                    "  {} {:?} node {:?} gen {:?} joins {} sessions {} epoch {:?} closed {:?} error {:?}",
                    s.hostname,
                    s.phase,
                    s.node_id,
                    s.identity_generation,
                    s.joins,
                    s.sessions,
                    s.epoch,
                    s.last_close_reason,
                    s.last_error
                )
            })
            .collect();
        panic!(
            "the fleet did not reconnect: {p:?}; not connected:\n{}\n{}",
            stragglers.join("\n"),
            activity(server).await
        );
    }
}

/// What the test database's backends are doing, for a failure message.
async fn activity(server: &TestServer) -> String {
    if server.backend != Backend::Postgres {
        return String::new();
    }
    let db = server.single_connection().await;
    let rows = db
        .query_all_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT pid, state, coalesce(wait_event_type, '') || ':' || coalesce(wait_event, '') AS wait, \
             coalesce(now() - xact_start, interval '0')::text AS xact_age, left(query, 200) AS query \
             FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() \
             ORDER BY xact_start NULLS LAST",
        ))
        .await
        .expect("pg_stat_activity");
    db.close().await.expect("closing");
    let mut out = String::from("PostgreSQL backends (pid, state, wait, transaction age, query):\n");
    for row in rows {
        let pid: i32 = row.try_get("", "pid").unwrap_or_default();
        let state: Option<String> = row.try_get("", "state").unwrap_or_default();
        let wait: String = row.try_get("", "wait").unwrap_or_default();
        let age: String = row.try_get("", "xact_age").unwrap_or_default();
        let query: String = row.try_get("", "query").unwrap_or_default();
        out.push_str(&format!(
            "  {pid} {} {wait} {age} {query}\n",
            state.unwrap_or_default()
        ));
    }
    out
}

async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + SETTLE;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not after {SETTLE:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn gateway_addr(server: &TestServer) -> SocketAddr {
    server
        .server
        .gateway
        .as_ref()
        .expect("a gateway")
        .local_addr
}

// ---------------------------------------------------------------------------------------
// What PostgreSQL and the server count

/// `bc_internal_errors_total`, summed over causes. The recorder is the process's, shared by
/// every server of this test (and only this test runs in this binary).
async fn internal_errors(server: &TestServer) -> u64 {
    metric_sum(server, "bc_internal_errors_total{").await
}

async fn internal_deadlocks(server: &TestServer) -> u64 {
    metric_sum(server, "bc_internal_errors_total{cause=\"deadlock\"}").await
}

async fn metric_sum(server: &TestServer, prefix: &str) -> u64 {
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, 200);
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

// ---------------------------------------------------------------------------------------
// The API, through whichever servers are up

#[derive(Clone)]
struct Api {
    client: reqwest::Client,
    token: String,
    urls: Arc<Mutex<Vec<String>>>,
    turn: Arc<AtomicU64>,
    internal: Arc<AtomicU64>,
    other_errors: Arc<Mutex<BTreeMap<String, u64>>>,
}

impl Api {
    fn new(servers: &[TestServer]) -> Api {
        Api {
            client: reqwest::Client::new(),
            token: servers[0].admin_token().to_owned(),
            urls: Arc::new(Mutex::new(servers.iter().map(TestServer::url).collect())),
            turn: Arc::default(),
            internal: Arc::default(),
            other_errors: Arc::default(),
        }
    }

    fn add(&self, url: &str) {
        self.urls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(url.to_owned());
    }

    fn remove(&self, url: &str) {
        self.urls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|u| u != url);
    }

    /// One operation on the next server up; None when none answered (a restart), or on an
    /// error, which is counted.
    async fn call(&self, query: &str, variables: Value) -> Option<Value> {
        let url = {
            let urls = self.urls.lock().unwrap_or_else(PoisonError::into_inner);
            if urls.is_empty() {
                return None;
            }
            let turn = self.turn.fetch_add(1, Ordering::Relaxed) as usize;
            urls[turn % urls.len()].clone()
        };
        let response = self
            .client
            .post(format!("{url}/graphql"))
            .bearer_auth(&self.token)
            .json(&json!({ "query": query, "variables": variables }))
            .send()
            .await
            .ok()?;
        let body: Value = response.json().await.ok()?;
        match body["errors"][0]["extensions"]["code"].as_str() {
            None => Some(body["data"].clone()),
            Some("INTERNAL") => {
                eprintln!("INTERNAL from {query}: {body}");
                self.internal.fetch_add(1, Ordering::Relaxed);
                None
            }
            Some(code) => {
                // The root field: the first word after the first brace.
                let operation = query
                    .split_once('{')
                    .and_then(|(_, rest)| {
                        rest.trim_start()
                            .split(|c: char| !c.is_alphanumeric())
                            .next()
                    })
                    .unwrap_or(query);
                *self
                    .other_errors
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .entry(format!("{operation}: {code}"))
                    .or_default() += 1;
                None
            }
        }
    }

    async fn all_nodes(&self) -> Vec<Value> {
        let mut nodes = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let Some(page) = self
                .call(
                    "query($after: String) { nodes(first: 500, after: $after) { edges { node { id version connectivity cordoned } } pageInfo { hasNextPage endCursor } } }",
                    json!({ "after": after }),
                )
                .await
            else {
                return Vec::new();
            };
            let connection = &page["nodes"];
            nodes.extend(
                connection["edges"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|e| e["node"].clone()),
            );
            if connection["pageInfo"]["hasNextPage"] != true {
                return nodes;
            }
            after = connection["pageInfo"]["endCursor"]
                .as_str()
                .map(str::to_owned);
        }
    }

    async fn open_commands(&self) -> Option<usize> {
        let data = self
            .call(
                "{ commands(filter: {status: [QUEUED, DISPATCHED, RUNNING]}, first: 100) { edges { node { id } } } }",
                json!({}),
            )
            .await?;
        data["commands"]["edges"].as_array().map(Vec::len)
    }
}

// ---------------------------------------------------------------------------------------
// The load: commands to every node, and node changes

struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
    api: Api,
    sent: Arc<AtomicU64>,
}

impl Load {
    fn start(api: Api) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();

        // People send commands to the whole fleet, round after round.
        tasks.push(tokio::spawn({
            let (api, stop, sent) = (api.clone(), stop.clone(), sent.clone());
            async move {
                let mut round = 0;
                while round < COMMAND_ROUNDS && !stop.load(Ordering::Relaxed) {
                    for kind in ["INVENTORY_REFRESH", "LOGS_COLLECT"] {
                        if let Some(data) = api
                            .call(
                                "mutation($kind: CommandKind!) { sendCommand(input: {filter: {}, kind: $kind}) { commands { id } } }",
                                json!({ "kind": kind }),
                            )
                            .await
                        {
                            let n = data["sendCommand"]["commands"].as_array().map_or(0, Vec::len);
                            sent.fetch_add(n as u64, Ordering::Relaxed);
                            round += usize::from(kind == "LOGS_COLLECT");
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }));

        // Operators cordon and uncordon nodes (a `CONFLICT` with a controller is expected).
        tasks.push(tokio::spawn({
            let (api, stop) = (api.clone(), stop.clone());
            async move {
                let mut pass = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let nodes = api.all_nodes().await;
                    for node in nodes.iter().skip(pass % 7).step_by(7) {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let (id, version) = (&node["id"], &node["version"]);
                        if node["cordoned"] == true {
                            api.call(
                                "mutation($input: UncordonNodeInput!) { uncordonNode(input: $input) { node { id } } }",
                                json!({ "input": { "id": id, "version": version } }),
                            )
                            .await;
                        } else {
                            api.call(
                                "mutation($input: CordonNodeInput!) { cordonNode(input: $input) { node { id } } }",
                                json!({ "input": { "id": id, "version": version, "reason": "restart under load" } }),
                            )
                            .await;
                        }
                    }
                    pass += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }));
        Load {
            stop,
            tasks,
            api,
            sent,
        }
    }

    /// Stops the load; (INTERNAL answers, other errors, commands sent).
    async fn stop(self) -> (u64, BTreeMap<String, u64>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("a load task");
        }
        (
            self.api.internal.load(Ordering::Relaxed),
            self.api
                .other_errors
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
            self.sent.load(Ordering::Relaxed),
        )
    }
}

/// [`REVOKED_PER_RESTART`] nodes of daemons that joined, none revoked before.
fn pick(fleet: &Fleet, revoked: &mut HashSet<String>) -> Vec<String> {
    let ids: Vec<String> = fleet
        .node_ids()
        .into_iter()
        .filter(|id| !revoked.contains(id))
        .take(REVOKED_PER_RESTART)
        .collect();
    revoked.extend(ids.iter().cloned());
    ids
}

/// Revokes the identity of each of `ids` once (reading its version again after a
/// `CONFLICT`, or trying again while no server is up), all at once: the daemons join again
/// and their nodes are reclaimed in place, each in a transaction that also closes the
/// node's session. Returns how many it revoked.
fn revoke(api: &Api, ids: Vec<String>) -> JoinHandle<u64> {
    let api = api.clone();
    tokio::spawn(async move {
        let revokes = ids.into_iter().map(|id| {
            let api = api.clone();
            async move {
                let deadline = tokio::time::Instant::now() + SETTLE;
                while tokio::time::Instant::now() < deadline {
                    let Some(node) = api
                        .call(
                            "query($id: ID!) { node(id: $id) { version } }",
                            json!({ "id": id }),
                        )
                        .await
                    else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let input = json!({ "id": id, "version": node["node"]["version"], "reason": "restart under load" });
                    if api
                        .call(
                            "mutation($input: RevokeNodeIdentityInput!) { revokeNodeIdentity(input: $input) { node { id } } }",
                            json!({ "input": input }),
                        )
                        .await
                        .is_some()
                    {
                        return 1;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                0
            }
        });
        futures::future::join_all(revokes).await.into_iter().sum()
    })
}

// ---------------------------------------------------------------------------------------
// The load balancer

/// A TCP proxy in front of the gateways that are up: each connection goes to the next one
/// in turn, so daemons keep one gateway address across restarts, as behind a load balancer.
struct Proxy {
    addr: SocketAddr,
    targets: Arc<Mutex<Vec<SocketAddr>>>,
    /// Each proxied connection's gateway, to close those of a stopped one.
    connections: Arc<Mutex<Vec<(SocketAddr, AbortHandle)>>>,
    task: JoinHandle<()>,
}

impl Proxy {
    async fn start(targets: Vec<SocketAddr>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let addr = listener.local_addr().expect("an address");
        let targets = Arc::new(Mutex::new(targets));
        let connections = Arc::default();
        let task = tokio::spawn(Proxy::accept(
            listener,
            targets.clone(),
            Arc::clone(&connections),
        ));
        Proxy {
            addr,
            targets,
            connections,
            task,
        }
    }

    async fn accept(
        listener: TcpListener,
        targets: Arc<Mutex<Vec<SocketAddr>>>,
        open: Arc<Mutex<Vec<(SocketAddr, AbortHandle)>>>,
    ) {
        // Dropped with the accept task: every proxied connection ends with the proxy.
        let mut connections = JoinSet::new();
        let mut turn = 0usize;
        loop {
            tokio::select! {
                accepted = listener.accept() => {
                    let Ok((mut client, _)) = accepted else { continue };
                    let target = {
                        let targets = targets.lock().unwrap_or_else(PoisonError::into_inner);
                        turn += 1;
                        (!targets.is_empty()).then(|| targets[turn % targets.len()])
                    };
                    // No gateway up: the connection is refused, and the daemon backs off.
                    let Some(target) = target else { continue };
                    let handle = connections.spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    let mut open = open.lock().unwrap_or_else(PoisonError::into_inner);
                    open.retain(|(_, h)| !h.is_finished());
                    open.push((target, handle));
                }
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
    }

    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    fn add(&self, target: SocketAddr) {
        self.targets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(target);
    }

    fn remove(&self, target: SocketAddr) {
        self.targets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|t| *t != target);
    }

    /// Closes every connection to `target`.
    fn sever(&self, target: SocketAddr) {
        for (_, handle) in self
            .connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(t, _)| *t == target)
        {
            handle.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
