//! `fleet-bench`: the control plane under a simulated fleet, measured.
//!
//! Starts the `better-compute` binary as a child process on a fresh database (a SQLite file
//! in a temporary directory, a fresh PostgreSQL database with `--postgres`, or
//! `--database-url`), on loopback ports it picked, joins and connects `--nodes` simulated
//! daemons through the real gateway, and then, for `--window` seconds, measures heartbeats
//! handled per second (the server's `bc_heartbeats_total`), the latency of `cordonNode`,
//! `uncordonNode` and a `nodes(first: 100)` query, and the server's CPU and memory. The
//! results are printed next to the raw limits measured on this machine kind
//! (`shared/notes/performance.md`).
//!
//! Everything talks to 127.0.0.1 only; every loop is bounded; the child is stopped on exit.
//!
//! ```text
//! cargo build --release -p bc-cli
//! cargo run --release -p bc-testing --bin fleet-bench -- --nodes 1000 --window 10
//! ```

use anyhow::{Context, bail, ensure};
use bc_testing::daemon::CaTrust;
use bc_testing::server::{Backend, TestDatabase};
use bc_testing::sim::{Fleet, Progress, SimOptions};
use clap::Parser;
use rand::seq::IndexedRandom;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the server may take to migrate its database and listen.
const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often readiness and fleet progress are polled.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How often progress is printed while the fleet comes up.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long the server gets to stop after SIGTERM before it is killed.
const CHILD_STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a GraphQL request of the benchmark may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the join token the benchmark mints lives.
const JOIN_TOKEN_TTL: Duration = Duration::from_secs(2 * 3600);
/// Lifetime of the admin token the benchmark mints.
const ADMIN_TOKEN_HOURS: &str = "4";
/// File descriptors the benchmark wants beyond one per node (joins, GraphQL, the runtime).
const SPARE_FDS: u64 = 1024;
/// Clock ticks per second when `getconf CLK_TCK` cannot say (Linux's value everywhere).
const DEFAULT_CLK_TCK: f64 = 100.0;

/// The raw limits measured on this machine kind, quoted from
/// `shared/notes/performance.md`, by the measure they bound.
const RAW_JOINS: &str =
    "PG single-row UPDATE: 5k/s (1 conn) to 25k/s (32); SQLite: 7k durable writes/s";
const RAW_HEARTBEATS: &str = "PG UPDATE 5k/s (1 conn), 17k/s (8), 25k/s (32), 50-60k/s async commit; SQLite 7k/s durable, 130k/s NORMAL";
const RAW_GRAPHQL: &str =
    "GraphQL over HTTP: ~45k req/s, 23 us server CPU per request (node(id) from memory)";
const RAW_CPU: &str = "2 cores: 200 % is the whole machine (simulator included)";
const RAW_MEMORY: &str =
    "WebSocket: ~7 KB per connection with a 4 KiB read buffer, 135 KB with the default";

#[derive(Debug, Parser)]
#[command(
    name = "fleet-bench",
    about = "Measures the control plane under a simulated fleet (127.0.0.1 only)"
)]
struct Args {
    /// Simulated nodes.
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// The measurement window, in seconds.
    #[arg(long, default_value_t = 30)]
    window: u64,
    /// Latency samples of each operation during the window.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Heartbeat interval of the simulated daemons, in seconds.
    #[arg(long, default_value_t = 10)]
    heartbeat_secs: u64,
    /// Joins and session handshakes in flight at once.
    #[arg(long, default_value_t = bc_testing::sim::DEFAULT_JOIN_CONCURRENCY)]
    join_concurrency: usize,
    /// Seconds between the whole fleet being connected and the window (default: one
    /// heartbeat interval, so every node is heartbeating and its inventory is written).
    #[arg(long)]
    warmup: Option<u64>,
    /// How long the whole fleet may take to join and connect, in seconds.
    #[arg(long, default_value_t = 900)]
    connect_timeout: u64,
    /// Run on a fresh database on the PostgreSQL server of `BC_TEST_POSTGRES_URL` (default
    /// postgres://postgres@127.0.0.1:5432/postgres), dropped afterwards.
    #[arg(long, conflicts_with = "database_url")]
    postgres: bool,
    /// Run on this database as it is (loopback hosts only). Default: a fresh SQLite file.
    #[arg(long)]
    database_url: Option<String>,
    /// The `better-compute` binary. Default: next to this one.
    #[arg(long, env = "BC_SERVER_BIN")]
    server_bin: Option<PathBuf>,
    /// The server's log filter (its log goes to server.log in the temporary directory).
    #[arg(long, default_value = "warn")]
    server_log: String,
    /// Keep the temporary directory (database, server.log) and print where it is.
    #[arg(long)]
    keep: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,fleet_bench=info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("fleet-bench failed: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    ensure!(args.nodes > 0, "--nodes must be at least 1");
    ensure!(
        args.window > 0 && args.samples > 0,
        "--window and --samples must be at least 1"
    );
    let server_bin = server_binary(args.server_bin.as_deref())?;
    let fd_limit = rlimit::increase_nofile_limit(u64::MAX).context("raising RLIMIT_NOFILE")?;
    if fd_limit < args.nodes as u64 + SPARE_FDS {
        tracing::warn!(
            fd_limit,
            nodes = args.nodes,
            "the file descriptor limit is low for this many sessions"
        );
    }
    let dir = tempfile::Builder::new().prefix("fleet-bench-").tempdir()?;
    let (database, backend_name) = if args.postgres {
        let database = TestDatabase::create(Backend::Postgres).await?;
        (Some(database), "PostgreSQL (fresh database)")
    } else {
        (
            None,
            if args.database_url.is_some() {
                "the given database"
            } else {
                "SQLite (fresh file)"
            },
        )
    };
    let database_url = match (&database, &args.database_url) {
        (Some(database), _) => Some(database.url.clone()),
        (None, Some(url)) => {
            ensure!(
                is_loopback_database(url),
                "--database-url must point at 127.0.0.1, localhost or a local socket"
            );
            Some(url.clone())
        }
        (None, None) => None,
    };

    let mut server = Server::start(
        &server_bin,
        dir.path(),
        database_url.as_deref(),
        &args.server_log,
    )
    .await?;
    let outcome = bench(&args, &server, backend_name, fd_limit).await;
    let stopped = server.stop().await;
    if let Some(database) = database {
        database
            .drop_database()
            .await
            .context("dropping the benchmark database")?;
    }
    if args.keep {
        let kept = dir.keep();
        tracing::info!(dir = %kept.display(), "kept the temporary directory");
    }
    if outcome.is_err() {
        tracing::error!("the server's log ends with:\n{}", server.log_tail());
    }
    outcome?;
    stopped
}

async fn bench(
    args: &Args,
    server: &Server,
    backend_name: &str,
    fd_limit: u64,
) -> anyhow::Result<()> {
    let api = Api::new(
        server.api_url(),
        server.admin_token(&args.server_log).await?,
    )?;
    let site = api
        .data(
            "mutation($name: String!) { createSite(input: {name: $name, kind: PLATFORM}) { id } }",
            json!({ "name": "bench" }),
        )
        .await?["createSite"]["id"]
        .as_str()
        .context("createSite returned no id")?
        .to_owned();
    let pool = api
        .data(
            "mutation($site: ID!) { createPool(input: {siteId: $site, name: \"bench\", kind: METAL_HOST, expectedGpuCount: 8}) { id } }",
            json!({ "site": site }),
        )
        .await?["createPool"]["id"]
        .as_str()
        .context("createPool returned no id")?
        .to_owned();
    let token = api
        .data(
            "mutation($site: ID!, $pool: ID, $uses: Int, $ttl: Int) { createJoinToken(input: {siteId: $site, poolId: $pool, maxUses: $uses, expiresInSeconds: $ttl, description: \"fleet-bench\"}) { secret caCertificateSha256 token { id } } }",
            json!({ "site": site, "pool": pool, "uses": args.nodes, "ttl": JOIN_TOKEN_TTL.as_secs() }),
        )
        .await?;
    let secret = token["createJoinToken"]["secret"]
        .as_str()
        .context("createJoinToken returned no secret")?;
    let pin = token["createJoinToken"]["caCertificateSha256"]
        .as_str()
        .context("createJoinToken returned no CA fingerprint")?;

    // The fleet comes up.
    let options = SimOptions {
        join_concurrency: args.join_concurrency,
        knobs: bc_testing::DaemonKnobs {
            heartbeat_interval_override: Some(Duration::from_secs(args.heartbeat_secs)),
            ..bc_testing::DaemonKnobs::default()
        },
        ..SimOptions::default()
    };
    tracing::info!(nodes = args.nodes, gateway = %server.gateway_url(), "starting the fleet");
    let started = Instant::now();
    let fleet = Fleet::start(
        &server.gateway_url(),
        secret,
        CaTrust::Sha256Pin(pin.to_owned()),
        args.nodes,
        &options,
    )
    .await?;
    let (all_joined, all_connected) = wait_for_fleet(
        &fleet,
        server,
        Duration::from_secs(args.connect_timeout),
        started,
    )
    .await;
    let outcome = async {
        let (all_joined, all_connected) = (all_joined?, all_connected?);
        let warmup = Duration::from_secs(args.warmup.unwrap_or(args.heartbeat_secs));
        tracing::info!(?warmup, "warming up before the window");
        tokio::time::sleep(warmup).await;
        let measured = measure(args, server, &api, &fleet).await?;
        let report = Report {
            nodes: args.nodes,
            backend: backend_name.to_owned(),
            window: Duration::from_secs(args.window),
            heartbeat_secs: args.heartbeat_secs,
            fd_limit,
            all_joined,
            all_connected,
            measured,
        };
        report.print()?;
        anyhow::Ok(())
    }
    .await;
    let last = fleet.shutdown().await;
    tracing::info!(%last, "fleet stopped");
    outcome
}

/// Waits until every node joined and every node is connected: the two times, from `started`.
async fn wait_for_fleet(
    fleet: &Fleet,
    server: &Server,
    timeout: Duration,
    started: Instant,
) -> (anyhow::Result<Duration>, anyhow::Result<Duration>) {
    let nodes = fleet.len() as u64;
    let deadline = started + timeout;
    let mut joined_at = None;
    let mut next_report = Instant::now() + PROGRESS_EVERY;
    loop {
        let progress = fleet.progress();
        if joined_at.is_none() && progress.joined >= nodes {
            joined_at = Some(started.elapsed());
        }
        if progress.connected >= nodes {
            let connected = started.elapsed();
            tracing::info!(%progress, ?connected, "the whole fleet is connected");
            return (Ok(joined_at.unwrap_or(connected)), Ok(connected));
        }
        let stuck = if progress.failed > 0 {
            Some(format!(
                "{} daemons gave up, e.g. {}",
                progress.failed,
                fleet.sample_error().unwrap_or_default()
            ))
        } else if Instant::now() >= deadline {
            Some(format!(
                "the fleet did not connect within {timeout:?}: {progress}"
            ))
        } else if server.exited() {
            Some("the server exited".to_owned())
        } else {
            None
        };
        if let Some(stuck) = stuck {
            let joined = joined_at.ok_or_else(|| anyhow::anyhow!("{stuck}"));
            return (joined, Err(anyhow::anyhow!("{stuck}")));
        }
        if Instant::now() >= next_report {
            tracing::info!(%progress, elapsed = ?started.elapsed(), "fleet coming up");
            next_report += PROGRESS_EVERY;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// What the window measured.
struct Measured {
    elapsed: Duration,
    heartbeats_handled: Option<f64>,
    heartbeats_received: Option<f64>,
    heartbeats_sent: f64,
    cordon: Latencies,
    uncordon: Latencies,
    nodes_query: Latencies,
    conflicts: usize,
    failures: Vec<String>,
    server_cpu: f64,
    server_rss_kb: u64,
    server_peak_rss_kb: u64,
    sim_cpu: f64,
    connected_at_end: u64,
    progress: Progress,
}

async fn measure(
    args: &Args,
    server: &Server,
    api: &Api,
    fleet: &Fleet,
) -> anyhow::Result<Measured> {
    let node_ids = fleet.node_ids();
    ensure!(!node_ids.is_empty(), "no node joined");
    let window = Duration::from_secs(args.window);
    let clk_tck = clock_ticks_per_second().await;

    let metrics_before = api.metrics().await?;
    let cpu_before = cpu_ticks(&format!("/proc/{}/stat", server.pid()))?;
    let sim_cpu_before = cpu_ticks("/proc/self/stat")?;
    let sent_before = fleet.progress().heartbeats_sent;
    let start = Instant::now();

    let mut cordon = Latencies::default();
    let mut uncordon = Latencies::default();
    let mut nodes_query = Latencies::default();
    let mut conflicts = 0;
    let mut failures = Vec::new();
    let mut ticker = tokio::time::interval(window / args.samples as u32);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for _ in 0..args.samples {
        ticker.tick().await;
        if start.elapsed() >= window {
            break;
        }
        let id = node_ids
            .choose(&mut rand::rng())
            .context("a node id")?
            .clone();
        match cordon_pair(api, &id, &mut cordon, &mut uncordon).await {
            Ok(()) => {}
            Err(Sample::Conflict(message)) => {
                conflicts += 1;
                failures.push(message);
            }
            Err(Sample::Failed(err)) => failures.push(format!("{err:#}")),
        }
        let timer = Instant::now();
        match api.query(NODES_QUERY, json!({})).await {
            Ok(_) => nodes_query.push(timer.elapsed()),
            Err(err) => failures.push(format!("nodes query: {err:#}")),
        }
    }
    if let Some(rest) = window.checked_sub(start.elapsed()) {
        tokio::time::sleep(rest).await;
    }
    let elapsed = start.elapsed();
    let metrics_after = api.metrics().await?;
    let cpu_after = cpu_ticks(&format!("/proc/{}/stat", server.pid()))?;
    let sim_cpu_after = cpu_ticks("/proc/self/stat")?;
    let progress = fleet.progress();
    let (server_rss_kb, server_peak_rss_kb) = memory_kb(server.pid())?;
    // A counter appears in /metrics once first incremented: absent before but present after
    // is zero before; absent after means the server does not have it.
    let per_second = |before: Option<f64>, after: Option<f64>| {
        after.map(|after| (after - before.unwrap_or(0.0)) / elapsed.as_secs_f64())
    };
    Ok(Measured {
        elapsed,
        heartbeats_handled: per_second(
            metrics_before.get("bc_heartbeats_total"),
            metrics_after.get("bc_heartbeats_total"),
        ),
        heartbeats_received: per_second(
            metrics_before.get("bc_heartbeats_received_total"),
            metrics_after.get("bc_heartbeats_received_total"),
        ),
        heartbeats_sent: (progress.heartbeats_sent - sent_before) as f64 / elapsed.as_secs_f64(),
        cordon,
        uncordon,
        nodes_query,
        conflicts,
        failures,
        server_cpu: (cpu_after - cpu_before) / clk_tck / elapsed.as_secs_f64() * 100.0,
        server_rss_kb,
        server_peak_rss_kb,
        sim_cpu: (sim_cpu_after - sim_cpu_before) / clk_tck / elapsed.as_secs_f64() * 100.0,
        connected_at_end: progress.connected,
        progress,
    })
}

/// A realistic fleet-table page: every axis plus the session.
const NODES_QUERY: &str = "query { nodes(first: 100) { edges { node { id hostname version provisionState connectivity cordoned maintenance noScheduleReasons gpuCount session { epoch lastSeen } } } pageInfo { endCursor hasNextPage } } }";

enum Sample {
    Conflict(String),
    Failed(anyhow::Error),
}

/// Reads the node's version (not timed), then cordons and uncordons it (each timed).
async fn cordon_pair(
    api: &Api,
    id: &str,
    cordon: &mut Latencies,
    uncordon: &mut Latencies,
) -> Result<(), Sample> {
    let read = api
        .data(
            "query($id: ID!) { node(id: $id) { version } }",
            json!({ "id": id }),
        )
        .await
        .map_err(Sample::Failed)?;
    let version = read["node"]["version"]
        .as_i64()
        .ok_or_else(|| Sample::Failed(anyhow::anyhow!("node {id} has no version")))?;
    let timer = Instant::now();
    let cordoned = api
        .query(
            "mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: \"fleet-bench\"}) { version } }",
            json!({ "id": id, "v": version }),
        )
        .await
        .map_err(Sample::Failed)?;
    let took = timer.elapsed();
    let version = check(&cordoned, "cordonNode")?;
    cordon.push(took);
    let timer = Instant::now();
    let uncordoned = api
        .query("mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { version } }", json!({ "id": id, "v": version }))
        .await
        .map_err(Sample::Failed)?;
    let took = timer.elapsed();
    check(&uncordoned, "uncordonNode")?;
    uncordon.push(took);
    Ok(())
}

/// The new version in a mutation's answer, or why there is none.
fn check(body: &Value, field: &str) -> Result<i64, Sample> {
    if let Some(error) = body["errors"].get(0) {
        let message = format!(
            "{field}: {}",
            error["message"].as_str().unwrap_or("an error")
        );
        return Err(if error["extensions"]["code"] == "CONFLICT" {
            Sample::Conflict(message)
        } else {
            Sample::Failed(anyhow::anyhow!(message))
        });
    }
    body["data"][field]["version"]
        .as_i64()
        .ok_or_else(|| Sample::Failed(anyhow::anyhow!("{field} returned no version")))
}

#[derive(Debug, Default)]
struct Latencies(Vec<Duration>);

impl Latencies {
    fn push(&mut self, took: Duration) {
        self.0.push(took);
    }

    /// The `q` quantile (nearest rank).
    fn quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
        sorted.get(rank - 1).copied()
    }

    fn describe(&self) -> String {
        match (self.quantile(0.5), self.quantile(0.99)) {
            (Some(p50), Some(p99)) => format!(
                "{} / {} ({} samples)",
                millis(p50),
                millis(p99),
                self.0.len()
            ),
            _ => "no samples".to_owned(),
        }
    }
}

fn millis(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

struct Report {
    nodes: usize,
    backend: String,
    window: Duration,
    heartbeat_secs: u64,
    fd_limit: u64,
    all_joined: Duration,
    all_connected: Duration,
    measured: Measured,
}

impl Report {
    fn print(&self) -> std::io::Result<()> {
        let m = &self.measured;
        let expected = self.nodes as f64 / self.heartbeat_secs as f64;
        let rate = |r: Option<f64>| {
            r.map_or_else(
                || "n/a (metric missing)".to_owned(),
                |r| format!("{r:.0}/s"),
            )
        };
        let rss_per_session = m.server_rss_kb as f64 / self.nodes as f64;
        let rows: Vec<(String, String, &str)> = vec![
            (
                "joins".into(),
                format!(
                    "{:.0} joins/s ({} in {:.1} s)",
                    self.nodes as f64 / self.all_joined.as_secs_f64(),
                    self.nodes,
                    self.all_joined.as_secs_f64()
                ),
                RAW_JOINS,
            ),
            (
                "all connected after".into(),
                format!("{:.1} s", self.all_connected.as_secs_f64()),
                "",
            ),
            (
                "heartbeats handled (bc_heartbeats_total)".into(),
                format!("{} (expected {expected:.0}/s)", rate(m.heartbeats_handled)),
                RAW_HEARTBEATS,
            ),
            (
                "heartbeats received / sent".into(),
                format!(
                    "{} / {:.0}/s",
                    rate(m.heartbeats_received),
                    m.heartbeats_sent
                ),
                "",
            ),
            (
                "cordonNode p50 / p99".into(),
                m.cordon.describe(),
                RAW_GRAPHQL,
            ),
            (
                "uncordonNode p50 / p99".into(),
                m.uncordon.describe(),
                RAW_GRAPHQL,
            ),
            (
                "nodes(first: 100) p50 / p99".into(),
                m.nodes_query.describe(),
                RAW_GRAPHQL,
            ),
            (
                "CONFLICTs on cordon (must be 0)".into(),
                m.conflicts.to_string(),
                "",
            ),
            (
                "server CPU".into(),
                format!("{:.1} % of one core", m.server_cpu),
                RAW_CPU,
            ),
            (
                "simulator CPU".into(),
                format!("{:.1} % of one core", m.sim_cpu),
                "",
            ),
            (
                "server RSS (peak)".into(),
                format!(
                    "{:.1} MB ({:.1} MB), {rss_per_session:.1} KB per node",
                    m.server_rss_kb as f64 / 1024.0,
                    m.server_peak_rss_kb as f64 / 1024.0
                ),
                RAW_MEMORY,
            ),
            (
                "connected at the end".into(),
                format!("{} of {}", m.connected_at_end, self.nodes),
                "",
            ),
        ];
        let mut out = std::io::stdout().lock();
        writeln!(out)?;
        writeln!(
            out,
            "fleet-bench: {} nodes on {}, heartbeats every {} s, window {:.1} s (asked {} s), fd limit {}",
            self.nodes,
            self.backend,
            self.heartbeat_secs,
            m.elapsed.as_secs_f64(),
            self.window.as_secs(),
            self.fd_limit
        )?;
        writeln!(out)?;
        let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let value_width = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
        writeln!(
            out,
            "{:width$}  {:value_width$}  raw limit on this machine kind (shared/notes/performance.md)",
            "measure", "result"
        )?;
        writeln!(out, "{}", "-".repeat(width + value_width + 64))?;
        for (name, value, limit) in &rows {
            writeln!(out, "{name:width$}  {value:value_width$}  {limit}")?;
        }
        writeln!(out)?;
        writeln!(out, "fleet: {}", m.progress)?;
        if !m.failures.is_empty() {
            writeln!(
                out,
                "{} sample(s) failed; the first: {}",
                m.failures.len(),
                m.failures[0]
            )?;
        }
        Ok(())
    }
}

/// The GraphQL API of the child server, as the benchmark's admin.
struct Api {
    client: reqwest::Client,
    url: String,
    token: String,
}

impl Api {
    fn new(url: String, token: String) -> anyhow::Result<Api> {
        Ok(Api {
            client: reqwest::Client::builder()
                .timeout(REQUEST_TIMEOUT)
                .build()?,
            url,
            token,
        })
    }

    /// The whole response body.
    async fn query(&self, query: &str, variables: Value) -> anyhow::Result<Value> {
        let response = self
            .client
            .post(format!("{}/graphql", self.url))
            .bearer_auth(&self.token)
            .json(&json!({ "query": query, "variables": variables }))
            .send()
            .await?;
        Ok(response.json().await?)
    }

    /// `data`, or the errors as an error.
    async fn data(&self, query: &str, variables: Value) -> anyhow::Result<Value> {
        let body = self.query(query, variables).await?;
        if body.get("errors").is_some_and(|e| !e.is_null()) {
            bail!("GraphQL errors: {}", body["errors"]);
        }
        Ok(body["data"].clone())
    }

    /// Every sample of `/metrics`, summed over labels, by metric name.
    async fn metrics(&self) -> anyhow::Result<Metrics> {
        let text = self
            .client
            .get(format!("{}/metrics", self.url))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?;
        Ok(Metrics::parse(&text))
    }
}

struct Metrics(std::collections::BTreeMap<String, f64>);

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let mut sums = std::collections::BTreeMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let name = series.split('{').next().unwrap_or(series);
            if let Ok(value) = value.parse::<f64>() {
                *sums.entry(name.to_owned()).or_insert(0.0) += value;
            }
        }
        Metrics(sums)
    }

    fn get(&self, name: &str) -> Option<f64> {
        self.0.get(name).copied()
    }
}

/// The server as a child process.
struct Server {
    child: Child,
    bin: PathBuf,
    env: Vec<(String, String)>,
    api_port: u16,
    gateway_port: u16,
    log: PathBuf,
}

impl Server {
    async fn start(
        bin: &Path,
        dir: &Path,
        database_url: Option<&str>,
        log_filter: &str,
    ) -> anyhow::Result<Server> {
        let (api_port, gateway_port) = free_ports()?;
        let mut env = vec![
            ("BC_LISTEN".to_owned(), format!("127.0.0.1:{api_port}")),
            (
                "BC_GATEWAY__LISTEN".to_owned(),
                format!("127.0.0.1:{gateway_port}"),
            ),
            (
                "BC_DATA_DIR".to_owned(),
                dir.join("data").display().to_string(),
            ),
            (
                "BC_AUTH__JWT_SECRET".to_owned(),
                hex::encode(rand::random::<[u8; 32]>()),
            ),
            ("BC_LOG__FILTER".to_owned(), log_filter.to_owned()),
        ];
        if let Some(url) = database_url {
            env.push(("DATABASE_URL".to_owned(), url.to_owned()));
        }
        let log = dir.join("server.log");
        let log_file = std::fs::File::create(&log)?;
        let child = server_command(bin, &env)
            .arg("serve")
            .stdout(Stdio::from(log_file.try_clone()?))
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut server = Server {
            child,
            bin: bin.to_owned(),
            env,
            api_port,
            gateway_port,
            log,
        };
        server.wait_ready().await?;
        tracing::info!(api = %server.api_url(), gateway = %server.gateway_url(), pid = server.pid(), "server ready");
        Ok(server)
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let client = reqwest::Client::builder()
            .timeout(POLL_INTERVAL * 10)
            .build()?;
        let deadline = Instant::now() + SERVER_READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the server exited with {status}; its log ends with:\n{}",
                    self.log_tail()
                );
            }
            let api_up = client
                .get(format!("{}/readyz", self.api_url()))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            let gateway_up = tokio::net::TcpStream::connect(("127.0.0.1", self.gateway_port))
                .await
                .is_ok();
            if api_up && gateway_up {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "the server was not ready within {SERVER_READY_TIMEOUT:?}; its log ends with:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// `better-compute token` with the server's configuration (so the same secret).
    async fn admin_token(&self, log_filter: &str) -> anyhow::Result<String> {
        let output = server_command(&self.bin, &self.env)
            .env("BC_LOG__FILTER", log_filter)
            .args([
                "token",
                "--subject",
                "bench",
                "--role",
                "admin",
                "--hours",
                ADMIN_TOKEN_HOURS,
            ])
            .output()
            .await?;
        ensure!(
            output.status.success(),
            "better-compute token failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let token = String::from_utf8(output.stdout)?.trim().to_owned();
        ensure!(!token.is_empty(), "better-compute token printed nothing");
        Ok(token)
    }

    fn api_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.api_port)
    }

    fn gateway_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.gateway_port)
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap_or_default()
    }

    fn exited(&self) -> bool {
        !Path::new(&format!("/proc/{}", self.pid())).exists()
    }

    fn log_tail(&self) -> String {
        const TAIL_LINES: usize = 30;
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
    }

    /// SIGTERM, then SIGKILL if it does not stop in time.
    async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
            match tokio::time::timeout(CHILD_STOP_TIMEOUT, self.child.wait()).await {
                Ok(status) => {
                    let status = status?;
                    if !status.success() {
                        tracing::warn!(%status, "the server did not exit cleanly");
                    }
                }
                Err(_) => {
                    tracing::warn!(
                        "the server did not stop within {CHILD_STOP_TIMEOUT:?}; killing it"
                    );
                    self.child.kill().await?;
                }
            }
        }
        Ok(())
    }
}

/// The server binary with only the benchmark's configuration: no `BC_…`, `DATABASE_URL`
/// or `RUST_LOG` from the caller's environment.
fn server_command(bin: &Path, env: &[(String, String)]) -> Command {
    let mut command = Command::new(bin);
    for (key, _) in std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v))) {
        if key.starts_with("BC_") || key == "DATABASE_URL" || key == "RUST_LOG" {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    command
}

fn server_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(path) => path.to_owned(),
        None => std::env::current_exe()?
            .parent()
            .context("the benchmark's directory")?
            .join("better-compute"),
    };
    ensure!(
        path.is_file(),
        "no server binary at {}: build it first (`cargo build --release -p bc-cli`) or set BC_SERVER_BIN",
        path.display()
    );
    Ok(path)
}

/// Two free loopback ports: bound together (so they differ), then released for the server.
fn free_ports() -> anyhow::Result<(u16, u16)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// A database URL whose host is on this machine.
fn is_loopback_database(url: &str) -> bool {
    if url.starts_with("sqlite:") {
        return true;
    }
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        host_port.split(':').next().unwrap_or_default()
    };
    matches!(host, "" | "127.0.0.1" | "localhost" | "::1")
}

/// utime + stime of a process, in clock ticks, from `/proc/<pid>/stat`.
fn cpu_ticks(stat_path: &str) -> anyhow::Result<f64> {
    let stat =
        std::fs::read_to_string(stat_path).with_context(|| format!("reading {stat_path}"))?;
    // The command name (field 2) may hold spaces; the fields after its closing parenthesis
    // start with field 3 (state), so utime (14) and stime (15) are the 12th and 13th.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("a /proc stat line")?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| -> anyhow::Result<f64> {
        Ok(fields
            .get(i)
            .context("a short /proc stat line")?
            .parse::<f64>()?)
    };
    Ok(field(11)? + field(12)?)
}

/// VmRSS and VmHWM of a process, in kB.
fn memory_kb(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

async fn clock_ticks_per_second() -> f64 {
    match Command::new("getconf").arg("CLK_TCK").output().await {
        Ok(output) => String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap_or(DEFAULT_CLK_TCK),
        Err(_) => DEFAULT_CLK_TCK,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_databases_are_accepted() {
        assert!(is_loopback_database(
            "postgres://postgres@127.0.0.1:5432/bench"
        ));
        assert!(is_loopback_database("postgres://u:p@localhost/bench"));
        assert!(is_loopback_database("postgres://[::1]:5432/x"));
        assert!(is_loopback_database("sqlite:///tmp/x.db?mode=rwc"));
        assert!(!is_loopback_database("postgres://u@10.0.0.5:5432/x"));
        assert!(!is_loopback_database("postgres://db.example.com/x"));
    }

    #[test]
    fn metrics_are_summed_over_labels_and_quantiles_are_nearest_rank() {
        let metrics = Metrics::parse("# TYPE a counter\na{x=\"1\"} 2\na{x=\"2\"} 3\nb 7\n");
        assert_eq!(metrics.get("a"), Some(5.0));
        assert_eq!(metrics.get("b"), Some(7.0));
        assert_eq!(metrics.get("c"), None);
        let latencies = Latencies((1..=100).map(Duration::from_millis).collect());
        assert_eq!(latencies.quantile(0.5), Some(Duration::from_millis(50)));
        assert_eq!(latencies.quantile(0.99), Some(Duration::from_millis(99)));
        assert_eq!(Latencies::default().quantile(0.5), None);
    }

    #[test]
    fn cpu_ticks_read_past_a_command_with_spaces() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let path = dir.path().join("stat");
        std::fs::write(&path, "42 (a b) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0").expect("write");
        assert_eq!(
            cpu_ticks(&path.display().to_string()).expect("ticks"),
            300.0
        );
    }
}
