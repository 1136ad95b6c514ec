//! `subscription-bench`: live subscriptions under fan-out, measured.
//!
//! Starts the `better-compute` binary as a child process on a fresh database (a SQLite file
//! in a temporary directory, or a fresh PostgreSQL database with `--postgres`), on loopback
//! ports it picked, opens `--subscribers` `graphql-transport-ws` connections, each
//! subscribed to `events` (cordons and uncordons), and then changes nodes in two phases of
//! `--mutations` each: paced at `--rate` per second, then as a burst (as fast as the server
//! answers, `--burst-concurrency` nodes at a time). For every event and
//! every subscriber it records when the event arrived, and reports the time from the
//! mutation's response (the commit is acknowledged) and from its request to each receipt
//! (p50, p99, max), the deliveries per second, and the server's CPU (per delivery, too) and
//! memory (per connection), next to the raw limits measured on this machine kind
//! (`shared/notes/performance.md`). The subscribers run on a runtime of their own, whose
//! threads `--subscriber-niceness` puts below the rest of the benchmark: they stand in for
//! dashboards on other machines, and on this one they compete with the server for its cores.
//!
//! Everything talks to 127.0.0.1 only; every loop is bounded; the child is stopped on exit.
//!
//! ```text
//! cargo build --release -p bc-cli -p bc-testing
//! target/release/subscription-bench --subscribers 1000
//! target/release/subscription-bench --subscribers 10000
//! ```

use anyhow::{Context, bail, ensure};
use bc_testing::bench::{self, Api, BenchDatabase, PROGRESS_EVERY, Row, Server, ServerArgs};
use bc_testing::subscription::{ConnectOptions, SubscriptionClient};
use better_compute::auth::{Role, TokenKeys};
use better_compute::subscription_runtime::THREAD_NAME as SUBSCRIPTION_THREADS;
use clap::Parser;
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How often delivery progress is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// How long a GraphQL request of the benchmark may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The audience tokens carry (the server's default).
const AUDIENCE: &str = "better-compute";
/// File descriptors the benchmark wants beyond one per subscriber.
const SPARE_FDS: u64 = 512;
/// A receipt slot nobody filled.
const NOT_RECEIVED: u32 = u32::MAX;
/// The name of the subscribers' threads (Linux keeps 15 bytes of it).
const SUBSCRIBER_THREADS: &str = "bench-subscribe";

/// The raw limits measured on this machine kind, quoted from
/// `shared/notes/performance.md`, by the measure they bound.
const RAW_DELIVERIES: &str = "async-graphql subscriptions (4 KiB read buffer): 408k deliveries/s with 1,000 subscribers, 301k/s with 10,000; raw WebSocket fan-out 2-4.5 M/s";
const RAW_CPU_PER_DELIVERY: &str = "10-13 us of server CPU per delivered event (41-46 us with tungstenite's default 128 KiB read buffer)";
const RAW_MEMORY: &str = "~7 KB per connection with a 4 KiB read buffer, ~135 KB with the default";
const RAW_CPU: &str = "2 cores: 200 % is the whole machine (the benchmark's clients included)";
const RAW_MUTATION: &str =
    "PG single-row UPDATE 5k/s (1 conn); SQLite 7k durable writes/s; GraphQL over HTTP ~45k req/s";

#[derive(Debug, Parser)]
#[command(
    name = "subscription-bench",
    about = "Measures live subscription fan-out (127.0.0.1 only)"
)]
struct Args {
    /// Open subscriptions (one connection each).
    #[arg(long, default_value_t = 1_000)]
    subscribers: usize,
    /// Mutations per phase (the paced phase, then the back-to-back one).
    #[arg(long, default_value_t = 200)]
    mutations: usize,
    /// Mutations per second in the paced phase.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Nodes the mutations cordon and uncordon in turn.
    #[arg(long, default_value_t = 20)]
    nodes: usize,
    /// Mutations in flight at once in the burst phase (on different nodes).
    #[arg(long, default_value_t = 16)]
    burst_concurrency: usize,
    /// Connections being opened at once.
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    /// How long all subscribers may take to connect, in seconds.
    #[arg(long, default_value_t = 600)]
    connect_timeout: u64,
    /// How long every subscriber may take to receive every event of a phase, in seconds.
    #[arg(long, default_value_t = 600)]
    delivery_timeout: u64,
    /// How many nice steps below the benchmark's other threads (the mutations, the clock)
    /// its subscribers' threads run. The subscribers stand in for dashboards on other
    /// machines; on this one they compete with the server for its cores, and where the
    /// machine is full the server's figures then include waiting for them. At 0 they compete
    /// as equals. At 10 a contended core goes about 90 % to the server's request threads and
    /// 75 % to its fan-out (at +5), which shows what the clients' competition adds to a
    /// mutation's latency; the delivery times then include the subscribers' own wait for a
    /// core.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    subscriber_niceness: i32,
    /// Run on a fresh database on the PostgreSQL server of `BC_TEST_POSTGRES_URL` (default
    /// postgres://postgres@127.0.0.1:5432/postgres), dropped afterwards.
    #[arg(long)]
    postgres: bool,
    #[command(flatten)]
    server: ServerArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    bench::init(module_path!());
    let args = Args::parse();
    bench::run_to_exit("subscription-bench", run(args)).await
}

async fn run(args: Args) -> anyhow::Result<()> {
    ensure!(
        args.subscribers > 0 && args.mutations > 0 && args.nodes > 0,
        "--subscribers, --mutations and --nodes must be at least 1"
    );
    ensure!(args.rate > 0.0, "--rate must be above 0");
    ensure!(
        args.connect_concurrency > 0 && args.burst_concurrency > 0,
        "--connect-concurrency and --burst-concurrency must be at least 1"
    );
    let server_bin = bench::server_binary(args.server.server_bin.as_deref())?;
    // Raised before the server starts, so the child inherits it too.
    let fd_limit = rlimit::increase_nofile_limit(u64::MAX).context("raising RLIMIT_NOFILE")?;
    ensure!(
        fd_limit >= args.subscribers as u64 + SPARE_FDS,
        "the file descriptor limit is {fd_limit} (the hard limit): {} subscribers need at least {}; raise it (ulimit -Hn, limits.conf)",
        args.subscribers,
        args.subscribers as u64 + SPARE_FDS
    );
    let dir = tempfile::Builder::new()
        .prefix("subscription-bench-")
        .tempdir()?;
    let database = BenchDatabase::prepare(args.postgres, None).await?;

    // The API's connection cap is a tenth of the open-file limit unless set: room for every
    // subscriber and the benchmark's own requests instead.
    let api_connections = (args.subscribers as u64 + SPARE_FDS).to_string();
    let server = Server::start(
        &server_bin,
        dir.path(),
        database.url(),
        &args.server.server_log,
        &[("BC_API__MAX_CONNECTIONS", api_connections)],
    )
    .await?;
    let outcome = run_bench(&args, &server, database.description(), fd_limit).await;
    bench::finish(server, database, dir, args.server.keep, outcome).await
}

/// One planned mutation: which node, cordon or uncordon, and the version it leaves.
#[derive(Debug, Clone)]
struct Planned {
    node: usize,
    cordon: bool,
    from_version: i64,
    to_version: i64,
}

/// When each mutation was sent and answered, in microseconds since the epoch.
#[derive(Debug, Clone, Copy, Default)]
struct Sent {
    request_us: u32,
    response_us: u32,
}

/// What one subscriber saw.
struct Seen {
    /// Microseconds since the epoch each mutation's event arrived, by mutation index.
    receipts: Vec<u32>,
    resumes: usize,
    error: Option<String>,
}

async fn run_bench(
    args: &Args,
    server: &Server,
    backend_name: &str,
    fd_limit: u64,
) -> anyhow::Result<()> {
    let keys = TokenKeys::new(server.jwt_secret().as_bytes(), AUDIENCE)?;
    let now = chrono::Utc::now();
    let ttl = chrono::Duration::hours(bench::TOKEN_HOURS);
    let admin = keys.mint("subscription-bench", &[Role::Admin], None, ttl, now)?;
    let viewer = keys.mint("subscription-bench-viewer", &[Role::Viewer], None, ttl, now)?;
    let api = Api::new(server.api_url(), admin, REQUEST_TIMEOUT)?;
    let clk_tck = bench::clock_ticks_per_second().await;

    // The nodes the mutations change, and the plan: node i % nodes, cordon and uncordon in
    // turn. Mutation 0 is the barrier that shows every subscription is live.
    let (node_ids, versions) = setup(&api, args.nodes).await?;
    let total = 1 + 2 * args.mutations;
    let mut plan = Vec::with_capacity(total);
    let mut current = versions.clone();
    let mut cordoned = vec![false; args.nodes];
    for i in 0..total {
        let node = i % args.nodes;
        plan.push(Planned {
            node,
            cordon: !cordoned[node],
            from_version: current[node],
            to_version: current[node] + 1,
        });
        cordoned[node] = !cordoned[node];
        current[node] += 1;
    }
    let by_event: HashMap<(usize, i64), u32> = plan
        .iter()
        .enumerate()
        .map(|(i, p)| ((p.node, p.to_version), i as u32))
        .collect();
    let node_index: HashMap<String, usize> = node_ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.clone(), i))
        .collect();
    let lookup = Arc::new(Lookup {
        node_index,
        by_event,
    });
    let cursor = newest_event(&api, node_ids.last().context("a node")?).await?;

    // Subscribers connect (bounded concurrency) and subscribe after the setup's last event.
    let epoch = Instant::now();
    let rss_before = server.memory()?.rss_kb;
    let received = Arc::new(AtomicU64::new(0));
    let (stop_tx, stop_rx) = watch::channel(false);
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<
        anyhow::Result<tokio::task::JoinHandle<Seen>>,
    >(args.subscribers);
    let connect_started = Instant::now();
    let subscriber_runtime = SubscriberRuntime::start(args.subscriber_niceness)?;
    let opener = {
        let url = server.api_url();
        let lookup = lookup.clone();
        let received = received.clone();
        let concurrency = args.connect_concurrency;
        let count = args.subscribers;
        // Every subscriber's connection and task on the subscribers' runtime.
        subscriber_runtime.spawn(async move {
            futures::stream::iter(0..count)
                .for_each_concurrent(concurrency, |_| {
                    let (url, viewer, cursor) = (url.clone(), viewer.clone(), cursor.clone());
                    let (lookup, received, stop_rx, ready_tx) = (
                        lookup.clone(),
                        received.clone(),
                        stop_rx.clone(),
                        ready_tx.clone(),
                    );
                    async move {
                        let opened = open_subscriber(&url, &viewer, &cursor).await;
                        let handle = opened.map(|client| {
                            tokio::spawn(subscriber(
                                client, total, epoch, lookup, received, stop_rx,
                            ))
                        });
                        let _ = ready_tx.send(handle).await;
                    }
                })
                .await;
        })
    };
    let mut handles = Vec::with_capacity(args.subscribers);
    let connect_deadline = Instant::now() + Duration::from_secs(args.connect_timeout);
    let mut next_report = Instant::now() + PROGRESS_EVERY;
    while handles.len() < args.subscribers {
        let next =
            tokio::time::timeout_at(connect_deadline.min(next_report), ready_rx.recv()).await;
        match next {
            Ok(Some(Ok(handle))) => handles.push(handle),
            Ok(Some(Err(err))) => {
                let _ = stop_tx.send(true);
                opener.abort();
                bail!(
                    "subscriber {} of {} could not connect: {err:#}",
                    handles.len() + 1,
                    args.subscribers
                );
            }
            Ok(None) => bail!("the connecting task ended early"),
            Err(_) if Instant::now() >= connect_deadline => {
                let _ = stop_tx.send(true);
                opener.abort();
                bail!(
                    "only {} of {} subscribers connected within {} s",
                    handles.len(),
                    args.subscribers,
                    args.connect_timeout
                );
            }
            Err(_) => {
                tracing::info!(
                    connected = handles.len(),
                    of = args.subscribers,
                    "connecting"
                );
                next_report += PROGRESS_EVERY;
            }
        }
        if server.exited() {
            bail!("the server exited while subscribers connected");
        }
    }
    let connect_took = connect_started.elapsed();
    tracing::info!(subscribers = args.subscribers, took = ?connect_took, "every subscriber is connected");

    let outcome = async {
        // The barrier: every subscription delivers mutation 0.
        let mut sent = vec![Sent::default(); total];
        sent[0] = mutate(&api, &node_ids, &plan, 0, epoch).await?;
        wait_for_deliveries(
            &received,
            args.subscribers as u64,
            Duration::from_secs(args.delivery_timeout),
            server,
        )
        .await?;
        let rss_after = server.memory()?.rss_kb;
        tracing::info!("every subscription is live; the paced phase starts");

        let mut phases = Vec::new();
        for (name, range, pace) in [
            (
                "paced".to_owned(),
                1..1 + args.mutations,
                Some(Duration::from_secs_f64(1.0 / args.rate)),
            ),
            (
                format!(
                    "burst ({} in flight)",
                    args.burst_concurrency.min(args.nodes)
                ),
                1 + args.mutations..total,
                None,
            ),
        ] {
            let cpu_before = server.cpu_ticks()?;
            let fanout_cpu_before = server.thread_cpu_ticks(SUBSCRIPTION_THREADS)?;
            let own_cpu_before = bench::own_cpu_ticks()?;
            let subscribers_cpu_before = bench::own_thread_cpu_ticks(SUBSCRIBER_THREADS)?;
            let started = Instant::now();
            let mut ticker = pace.map(|p| {
                let mut ticker = tokio::time::interval(p);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker
            });
            if let Some(ticker) = ticker.as_mut() {
                for i in range.clone() {
                    ticker.tick().await;
                    sent[i] = mutate(&api, &node_ids, &plan, i, epoch).await?;
                }
            } else {
                // As fast as the server answers: each node's mutations in order (they carry
                // its version), `--burst-concurrency` nodes at a time.
                let (api, node_ids, plan) = (&api, &node_ids, &plan);
                let results: Vec<anyhow::Result<Vec<(usize, Sent)>>> =
                    futures::stream::iter(0..args.nodes)
                        .map(|node| {
                            let range = range.clone();
                            async move {
                                let mut done = Vec::new();
                                for i in range.filter(|i| plan[*i].node == node) {
                                    done.push((i, mutate(api, node_ids, plan, i, epoch).await?));
                                }
                                anyhow::Ok(done)
                            }
                        })
                        .buffer_unordered(args.burst_concurrency)
                        .collect()
                        .await;
                for result in results {
                    for (i, at) in result? {
                        sent[i] = at;
                    }
                }
            }
            let target = (range.end as u64) * args.subscribers as u64;
            let delivered = wait_for_deliveries(
                &received,
                target,
                Duration::from_secs(args.delivery_timeout),
                server,
            )
            .await;
            let elapsed = started.elapsed();
            let cpu = (server.cpu_ticks()? - cpu_before) / clk_tck;
            let fanout_cpu =
                (server.thread_cpu_ticks(SUBSCRIPTION_THREADS)? - fanout_cpu_before) / clk_tck;
            let own_cpu = (bench::own_cpu_ticks()? - own_cpu_before) / clk_tck;
            let subscribers_cpu = (bench::own_thread_cpu_ticks(SUBSCRIBER_THREADS)?
                - subscribers_cpu_before)
                / clk_tck;
            if let Err(err) = &delivered {
                tracing::warn!("{name}: {err:#}");
            }
            phases.push(PhaseRun {
                name,
                range,
                pace,
                elapsed,
                server_cpu_s: cpu,
                fanout_cpu_s: fanout_cpu,
                own_cpu_s: own_cpu,
                subscribers_cpu_s: subscribers_cpu,
                complete: delivered.is_ok(),
            });
            if delivered.is_err() {
                break;
            }
        }
        // After the phases: what the sockets kept of the burst (a write buffer keeps the
        // size of the most it wrote out at once).
        let rss_end = server.memory()?.rss_kb;
        let _ = stop_tx.send(true);
        let mut seen = Vec::with_capacity(handles.len());
        for handle in handles.drain(..) {
            seen.push(handle.await.context("a subscriber task")?);
        }
        let report = Report {
            subscribers: args.subscribers,
            backend: backend_name.to_owned(),
            mutations: args.mutations,
            rate: args.rate,
            subscriber_niceness: args.subscriber_niceness,
            nodes: args.nodes,
            fd_limit,
            connect_took,
            rss_before_kb: rss_before,
            rss_after_kb: rss_after,
            rss_end_kb: rss_end,
            peak_rss_kb: server.memory()?.peak_rss_kb,
            sent,
            phases,
            seen,
        };
        report.print()?;
        anyhow::Ok(())
    }
    .await;
    let _ = stop_tx.send(true);
    for handle in handles {
        handle.abort();
    }
    opener.abort();
    outcome
}

/// The site, the pool and `count` nodes enrolled in it: the nodes' ids and versions.
async fn setup(api: &Api, count: usize) -> anyhow::Result<(Vec<String>, Vec<i64>)> {
    let (site, pool) = api.create_site_and_pool().await?;
    let mut ids = Vec::with_capacity(count);
    let mut versions = Vec::with_capacity(count);
    for i in 0..count {
        let node = api
            .data(
                "mutation($site: ID!, $pool: ID, $host: String!) { enrollNode(input: {siteId: $site, poolId: $pool, hostname: $host}) { node { id version } } }",
                json!({ "site": site, "pool": pool, "host": format!("gpu-{i}.bench.example.com") }),
            )
            .await?;
        ids.push(
            node["enrollNode"]["node"]["id"]
                .as_str()
                .context("enrollNode returned no id")?
                .to_owned(),
        );
        versions.push(
            node["enrollNode"]["node"]["version"]
                .as_i64()
                .context("enrollNode returned no version")?,
        );
    }
    Ok((ids, versions))
}

/// The newest event of `node`: the setup's last event, where the subscriptions start.
async fn newest_event(api: &Api, node: &str) -> anyhow::Result<String> {
    let data = api
        .data(
            "query($id: ID!) { node(id: $id) { events(first: 1) { nodes { id } } } }",
            json!({ "id": node }),
        )
        .await?;
    Ok(data["node"]["events"]["nodes"][0]["id"]
        .as_str()
        .context("the node has no event")?
        .to_owned())
}

/// Cordons or uncordons as planned, recording when the request left and the answer came.
async fn mutate(
    api: &Api,
    node_ids: &[String],
    plan: &[Planned],
    i: usize,
    epoch: Instant,
) -> anyhow::Result<Sent> {
    let p = &plan[i];
    let (field, query) = if p.cordon {
        (
            "cordonNode",
            "mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: \"subscription-bench\"}) { node { version } } }",
        )
    } else {
        (
            "uncordonNode",
            "mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }",
        )
    };
    let request_us = micros_since(epoch);
    let data = api
        .data(
            query,
            json!({ "id": node_ids[p.node], "v": p.from_version }),
        )
        .await
        .with_context(|| format!("mutation {i}"))?;
    let response_us = micros_since(epoch);
    let version = data[field]["node"]["version"]
        .as_i64()
        .context("no version in the answer")?;
    ensure!(
        version == p.to_version,
        "mutation {i} left version {version}, the plan says {}",
        p.to_version
    );
    Ok(Sent {
        request_us,
        response_us,
    })
}

/// Waits until `received` reaches `target`, polling, at most `timeout`.
async fn wait_for_deliveries(
    received: &AtomicU64,
    target: u64,
    timeout: Duration,
    server: &Server,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut next_report = Instant::now() + PROGRESS_EVERY;
    loop {
        let got = received.load(Ordering::Relaxed);
        if got >= target {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{got} of {target} deliveries arrived within {timeout:?}");
        }
        if server.exited() {
            bail!("the server exited");
        }
        if Instant::now() >= next_report {
            tracing::info!(got, target, "waiting for deliveries");
            next_report += PROGRESS_EVERY;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

fn micros_since(epoch: Instant) -> u32 {
    u32::try_from(epoch.elapsed().as_micros()).unwrap_or(NOT_RECEIVED - 1)
}

const EVENTS: &str = "subscription($after: ID, $filter: EventFilterInput) { events(after: $after, filter: $filter) { nodeId data } }";
const TYPES: [&str; 2] = ["NODE_CORDONED", "NODE_UNCORDONED"];

async fn open_subscriber(
    url: &str,
    token: &str,
    cursor: &str,
) -> anyhow::Result<SubscriptionClient> {
    let mut client = SubscriptionClient::connect_with(url, &ConnectOptions::bearer(token)).await?;
    client
        .subscribe(
            "1",
            EVENTS,
            json!({ "after": cursor, "filter": { "types": TYPES } }),
        )
        .await?;
    Ok(client)
}

/// Maps an event (node id, version after) to its mutation.
struct Lookup {
    node_index: HashMap<String, usize>,
    by_event: HashMap<(usize, i64), u32>,
}

impl Lookup {
    fn mutation_of(&self, event: &Value) -> Option<usize> {
        let node = *self.node_index.get(event["nodeId"].as_str()?)?;
        let version = event["data"]["version"].as_i64()?;
        self.by_event.get(&(node, version)).map(|i| *i as usize)
    }
}

/// One subscriber: records when each mutation's event arrives until it has all of them or
/// is told to stop. A `RESUME_REQUIRED` is followed as a client should: resubscribe from
/// the cursor.
async fn subscriber(
    mut client: SubscriptionClient,
    total: usize,
    epoch: Instant,
    lookup: Arc<Lookup>,
    received: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> Seen {
    let mut seen = Seen {
        receipts: vec![NOT_RECEIVED; total],
        resumes: 0,
        error: None,
    };
    let mut count = 0;
    let mut id = "1".to_owned();
    while count < total && !*stop.borrow() {
        let message = tokio::select! {
            message = client.next(&id, Duration::from_secs(3600)) => message,
            _ = stop.changed() => break,
        };
        let at = micros_since(epoch);
        match message {
            Ok(message) => {
                if let Some(data) = message.data() {
                    let event = &data["events"];
                    if let Some(i) = lookup.mutation_of(event)
                        && seen.receipts[i] == NOT_RECEIVED
                    {
                        seen.receipts[i] = at;
                        count += 1;
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                if message.error_code() == Some("RESUME_REQUIRED")
                    && let Some(cursor) = message
                        .first_error()
                        .and_then(|e| e["extensions"]["cursor"].as_str())
                {
                    seen.resumes += 1;
                    id = format!("{}", seen.resumes + 1);
                    let variables = json!({ "after": cursor, "filter": { "types": TYPES } });
                    if let Err(err) = client.subscribe(&id, EVENTS, variables).await {
                        seen.error = Some(format!("resubscribing: {err:#}"));
                        break;
                    }
                    continue;
                }
                seen.error = Some(format!("{message:?}"));
                break;
            }
            Err(err) => {
                seen.error = Some(format!("{err:#}"));
                break;
            }
        }
    }
    client.close().await;
    seen
}

struct PhaseRun {
    name: String,
    range: std::ops::Range<usize>,
    pace: Option<Duration>,
    elapsed: Duration,
    server_cpu_s: f64,
    /// Of `server_cpu_s`, the subscription runtime's threads' (the sockets' loops).
    fanout_cpu_s: f64,
    own_cpu_s: f64,
    /// Of `own_cpu_s`, the subscribers' threads'.
    subscribers_cpu_s: f64,
    complete: bool,
}

struct Report {
    subscribers: usize,
    backend: String,
    mutations: usize,
    rate: f64,
    subscriber_niceness: i32,
    nodes: usize,
    fd_limit: u64,
    connect_took: Duration,
    rss_before_kb: u64,
    rss_after_kb: u64,
    rss_end_kb: u64,
    peak_rss_kb: u64,
    sent: Vec<Sent>,
    phases: Vec<PhaseRun>,
    seen: Vec<Seen>,
}

/// Nearest-rank quantiles of microsecond samples.
struct Quantiles {
    p50: f64,
    p99: f64,
    max: f64,
}

fn quantiles(samples: &mut [u32]) -> Option<Quantiles> {
    samples.sort_unstable();
    let millis = |q: f64| bench::nearest_rank(samples, q).map(|us| f64::from(us) / 1000.0);
    Some(Quantiles {
        p50: millis(0.5)?,
        p99: millis(0.99)?,
        max: millis(1.0)?,
    })
}

fn describe(q: Option<Quantiles>) -> String {
    q.map_or_else(
        || "no samples".to_owned(),
        |q| format!("{:.1} / {:.1} / {:.1} ms", q.p50, q.p99, q.max),
    )
}

impl Report {
    fn print(&self) -> std::io::Result<()> {
        let n = self.subscribers as f64;
        let mut rows: Vec<Row<'_>> = vec![
            (
                "connect + subscribe".into(),
                format!(
                    "{:.1} s ({:.0} connections/s)",
                    self.connect_took.as_secs_f64(),
                    n / self.connect_took.as_secs_f64()
                ),
                "",
            ),
            (
                "server RSS before / after connecting".into(),
                format!(
                    "{:.1} MB / {:.1} MB: {:.1} KB per subscriber (peak {:.1} MB)",
                    self.rss_before_kb as f64 / 1024.0,
                    self.rss_after_kb as f64 / 1024.0,
                    self.rss_after_kb.saturating_sub(self.rss_before_kb) as f64 / n,
                    self.peak_rss_kb as f64 / 1024.0
                ),
                RAW_MEMORY,
            ),
            (
                "server RSS after the phases".into(),
                format!(
                    "{:.1} MB: {:.1} KB per subscriber",
                    self.rss_end_kb as f64 / 1024.0,
                    self.rss_end_kb.saturating_sub(self.rss_before_kb) as f64 / n,
                ),
                "",
            ),
        ];
        for phase in &self.phases {
            let mut from_response = Vec::new();
            let mut from_request = Vec::new();
            let mut early = 0usize;
            let mut last_receipt = 0u32;
            let mut missing = 0usize;
            for seen in &self.seen {
                for i in phase.range.clone() {
                    let at = seen.receipts[i];
                    if at == NOT_RECEIVED {
                        missing += 1;
                        continue;
                    }
                    let sent = self.sent[i];
                    if at < sent.response_us {
                        early += 1;
                    }
                    from_response.push(at.saturating_sub(sent.response_us));
                    from_request.push(at.saturating_sub(sent.request_us));
                    last_receipt = last_receipt.max(at);
                }
            }
            let delivered = from_response.len();
            let first_request = self.sent[phase.range.start].request_us;
            let span_s = f64::from(last_receipt.saturating_sub(first_request)) / 1e6;
            let mut mutation_latency: Vec<u32> = phase
                .range
                .clone()
                .map(|i| {
                    self.sent[i]
                        .response_us
                        .saturating_sub(self.sent[i].request_us)
                })
                .collect();
            let label = match phase.pace {
                Some(p) => format!("{} ({:.0}/s)", phase.name, 1.0 / p.as_secs_f64()),
                None => phase.name.clone(),
            };
            let cpu_pct = phase.server_cpu_s / phase.elapsed.as_secs_f64() * 100.0;
            rows.extend([
                (
                    format!("{label}: mutation latency p50 / p99 / max"),
                    describe(quantiles(&mut mutation_latency)),
                    RAW_MUTATION,
                ),
                (
                    format!("{label}: delivery after the response p50 / p99 / max"),
                    format!(
                        "{} ({:.1} % arrived before the response)",
                        describe(quantiles(&mut from_response)),
                        early as f64 * 100.0 / delivered.max(1) as f64
                    ),
                    "",
                ),
                (
                    format!("{label}: delivery after the request p50 / p99 / max"),
                    describe(quantiles(&mut from_request)),
                    "",
                ),
                (
                    format!("{label}: deliveries"),
                    format!(
                        "{delivered} of {} ({missing} missing{}), {:.0}/s over {:.2} s",
                        phase.range.len() * self.subscribers,
                        if phase.complete { "" } else { ", timed out" },
                        delivered as f64 / span_s.max(1e-9),
                        span_s
                    ),
                    RAW_DELIVERIES,
                ),
                (
                    format!("{label}: server CPU"),
                    format!(
                        "{cpu_pct:.1} % of one core ({:.1} % on the subscription runtime), {:.1} us per delivery",
                        phase.fanout_cpu_s / phase.elapsed.as_secs_f64() * 100.0,
                        phase.server_cpu_s * 1e6 / delivered.max(1) as f64
                    ),
                    RAW_CPU_PER_DELIVERY,
                ),
                (
                    format!("{label}: benchmark CPU (clients)"),
                    format!(
                        "{:.1} % of one core ({:.1} % the subscribers')",
                        phase.own_cpu_s / phase.elapsed.as_secs_f64() * 100.0,
                        phase.subscribers_cpu_s / phase.elapsed.as_secs_f64() * 100.0,
                    ),
                    RAW_CPU,
                ),
            ]);
        }
        let resumes: usize = self.seen.iter().map(|s| s.resumes).sum();
        let errors: Vec<&String> = self.seen.iter().filter_map(|s| s.error.as_ref()).collect();
        rows.push(("RESUME_REQUIRED followed".into(), resumes.to_string(), ""));
        rows.push((
            "subscribers that failed".into(),
            errors.len().to_string(),
            "",
        ));

        let mut out = std::io::stdout().lock();
        writeln!(out)?;
        writeln!(
            out,
            "subscription-bench: {} subscribers (events, one connection each) on {}; {} mutations paced at {}/s, then {} in a burst, over {} nodes; fd limit {}",
            self.subscribers,
            self.backend,
            self.mutations,
            self.rate,
            self.mutations,
            self.nodes,
            self.fd_limit
        )?;
        if self.subscriber_niceness > 0 {
            writeln!(
                out,
                "the subscribers' threads run {} nice steps below the rest of the benchmark: the delivery times include their own wait for a core",
                self.subscriber_niceness
            )?;
        }
        writeln!(out)?;
        bench::write_table(&mut out, &rows)?;
        if let Some(first) = errors.first() {
            writeln!(out)?;
            writeln!(
                out,
                "{} subscriber(s) failed; the first: {first}",
                errors.len()
            )?;
        }
        Ok(())
    }
}

/// The runtime the subscribers' connections and tasks run on, apart from the one that sends
/// the mutations and polls for deliveries: those then never wait behind 10,000 subscribers'
/// frames in the benchmark's own run queues, and the subscribers' threads can run at a lower
/// priority (`--subscriber-niceness`). Shut down without waiting when dropped, which an async
/// context allows (a plain runtime's drop would panic there).
struct SubscriberRuntime {
    handle: tokio::runtime::Handle,
    /// `None` once shut down.
    runtime: Option<tokio::runtime::Runtime>,
}

impl SubscriberRuntime {
    fn start(niceness: i32) -> anyhow::Result<SubscriberRuntime> {
        // Set, not added: a thread starts with the nice value of the thread that spawned it.
        let nice = rustix::process::getpriority_process(None).unwrap_or(0) + niceness;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .thread_name(SUBSCRIBER_THREADS)
            .on_thread_start(move || {
                // Linux keeps a nice value per thread: this lowers only these threads.
                if let Err(err) = rustix::process::setpriority_process(None, nice) {
                    tracing::warn!(error = %err, "could not lower a subscriber thread's priority");
                }
            })
            .enable_all()
            .build()
            .context("starting the subscribers' runtime")?;
        Ok(SubscriberRuntime {
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
        })
    }

    fn spawn<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(future)
    }
}

impl Drop for SubscriberRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_rank_in_milliseconds() {
        let mut samples: Vec<u32> = (1..=100).map(|ms| ms * 1000).collect();
        let q = quantiles(&mut samples).expect("samples");
        assert_eq!((q.p50, q.p99, q.max), (50.0, 99.0, 100.0));
        assert!(quantiles(&mut []).is_none());
    }

    #[test]
    fn events_map_to_their_mutation() {
        let lookup = Lookup {
            node_index: HashMap::from([("node_a".to_owned(), 0), ("node_b".to_owned(), 1)]),
            by_event: HashMap::from([((0, 2), 0), ((1, 2), 1), ((0, 3), 2)]),
        };
        assert_eq!(
            lookup.mutation_of(&json!({ "nodeId": "node_a", "data": { "version": 3 } })),
            Some(2)
        );
        assert_eq!(
            lookup.mutation_of(&json!({ "nodeId": "node_b", "data": { "version": 2 } })),
            Some(1)
        );
        assert_eq!(
            lookup.mutation_of(&json!({ "nodeId": "node_c", "data": { "version": 2 } })),
            None
        );
        assert_eq!(
            lookup.mutation_of(&json!({ "nodeId": "node_a", "data": {} })),
            None
        );
    }
}
