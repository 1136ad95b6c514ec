//! `placement-bench`: how fast the placer books GPUs on a large fleet, measured.
//!
//! Measures first the raw rate of single-row `UPDATE … WHERE id = $1 AND version = $2`
//! statements on a database of the same kind, on the same disk, with the server's settings
//! (the limit every write of the placer is bounded by): from one connection, and on
//! PostgreSQL from `--clients` connections too. Then it starts the `better-compute` binary as a
//! child process (as `fleet-bench` does), brings up `--nodes` simulated daemons through the
//! real gateway, waits until all of them are schedulable (adopted after acceptance), offers
//! the pool to a tenant of its own, and for `--window` seconds runs `--clients` concurrent
//! API clients. Each creates reservations of mixed shapes (the GPUs per node `dev --workload`
//! draws, on one node or, sometimes, a gang of 2 to 4 nodes), keeps up to `--hold` placed ones, and releases its
//! oldest beyond that, so the pool stays partly booked the way a busy fleet is. A
//! reservation that comes back PENDING (no room now) is released at once.
//!
//! It prints placements per second, the latency of `createReservation` and
//! `releaseReservation`, the answers by state and error code, and the server's CPU, beside
//! the raw UPDATE rates.
//!
//! ```text
//! cargo build --release -p bc-cli -p bc-testing
//! target/release/placement-bench --nodes 10000 --window 30
//! target/release/placement-bench --nodes 10000 --window 30 --postgres
//! ```

use anyhow::{Context, ensure};
use bc_testing::bench::{
    self, Api, BenchDatabase, BringUp, FleetArgs, Latencies, Row, Server, ServerArgs,
};
use clap::Parser;
use rand::Rng;
use sea_orm::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};
use serde_json::{Value, json};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// How long a GraphQL request of the benchmark may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long each raw UPDATE measurement runs: long enough for thousands of commits, short
/// enough to add little to the run.
const RAW_UPDATE_DURATION: Duration = Duration::from_secs(5);
/// Rows of the raw UPDATE table: one per connection, so that no two writers wait on the same
/// row (the rate measured is the database's, not a lock queue's).
const RAW_TABLE: &str = "placement_bench_raw";
/// How long SQLite waits on a lock in the raw measurement, and how much of the file it maps:
/// as the server does (`server/src/service/store/mod.rs`).
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(5);
const SQLITE_MMAP_BYTES: u64 = 1 << 30;
/// The share of reservations that are gangs, and their sizes.
const GANG_SHARE: f64 = 0.1;
const GANG_SIZES: std::ops::RangeInclusive<u32> = 2..=4;
/// The share of reservations placed by spreading (the rest bin-pack, the default).
const SPREAD_SHARE: f64 = 0.2;

/// The raw limits measured on this machine kind, from `shared/notes/performance.md`.
const RAW_PG_UPDATES: &str =
    "PG single-row UPDATE: 5k/s (1 conn), 17k/s (8), 25k/s (32); sqlx 0.6-0.8 of that";
const RAW_SQLITE_UPDATES: &str = "SQLite WAL: 7k/s durable, 130k/s with synchronous = NORMAL";
const RAW_GRAPHQL: &str =
    "GraphQL over HTTP: ~45k req/s, 23 us server CPU per request (node(id) from memory)";
const RAW_CPU: &str = "2 cores: 200 % is the whole machine (simulator included)";

#[derive(Debug, Parser)]
#[command(
    name = "placement-bench",
    about = "Measures reservations placed per second on a simulated fleet (127.0.0.1 only)"
)]
struct Args {
    /// Simulated nodes (8 GPUs each).
    #[arg(long, default_value_t = 10_000)]
    nodes: usize,
    /// Concurrent API clients creating and releasing reservations.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// The measurement window, in seconds.
    #[arg(long, default_value_t = 30)]
    window: u64,
    /// Placed reservations each client holds before it releases its oldest.
    #[arg(long, default_value_t = 20)]
    hold: usize,
    #[command(flatten)]
    fleet: FleetArgs,
    /// How long the whole fleet may take to join, connect and pass acceptance, in seconds.
    #[arg(long, default_value_t = 1200)]
    ready_timeout: u64,
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
    bench::run_to_exit("placement-bench", run(args)).await
}

async fn run(args: Args) -> anyhow::Result<()> {
    ensure!(args.nodes > 0, "--nodes must be at least 1");
    ensure!(
        args.clients > 0 && args.window > 0 && args.hold > 0,
        "--clients, --window and --hold must be at least 1"
    );
    let server_bin = bench::server_binary(args.server.server_bin.as_deref())?;
    rlimit::increase_nofile_limit(u64::MAX).context("raising RLIMIT_NOFILE")?;
    let dir = tempfile::Builder::new()
        .prefix("placement-bench-")
        .tempdir()?;
    let database = BenchDatabase::prepare(args.postgres, None).await?;
    let raw = raw_update_rates(database.url(), dir.path(), args.clients).await?;
    let server = Server::start(
        &server_bin,
        dir.path(),
        database.url(),
        &args.server.server_log,
        &[],
    )
    .await?;
    let outcome = run_bench(&args, &server, database.description(), raw, dir.path()).await;
    bench::finish(server, database, dir, args.server.keep, outcome).await
}

async fn run_bench(
    args: &Args,
    server: &Server,
    backend: &str,
    raw: RawUpdates,
    dir: &std::path::Path,
) -> anyhow::Result<()> {
    let api = Api::new(
        server.api_url(),
        server.admin_token().await?,
        REQUEST_TIMEOUT,
    )?;
    let (site, pool) = api.create_site_and_pool().await?;
    let started = Instant::now();
    let servers = std::slice::from_ref(server);
    let fleet =
        bench::start_fleet(&api, servers, &site, &pool, args.nodes, &args.fleet, dir).await?;
    let timeout = Duration::from_secs(args.ready_timeout);
    let outcome = async {
        let mut bring_up = bench::bring_up(&api, servers, &fleet, &pool, timeout, started).await?;
        let tenant = tenant_offered(&api, &pool).await?;
        let measured = measure(args, server, &api, &tenant, &pool).await?;
        bring_up.count_events(&api).await;
        let booked = booked_gpus(&api, &pool).await?;
        Report {
            nodes: args.nodes,
            backend,
            clients: args.clients,
            hold: args.hold,
            bring_up,
            raw,
            measured,
            booked,
        }
        .print()?;
        anyhow::Ok(())
    }
    .await;
    let last = fleet.shutdown().await;
    tracing::info!(%last, "fleet stopped");
    outcome
}

/// A tenant of the benchmark's own, offered the pool: its id.
async fn tenant_offered(api: &Api, pool: &str) -> anyhow::Result<String> {
    let tenant = api
        .data(
            "mutation { createTenant(input: {name: \"placement-bench\"}) { tenant { id } } }",
            json!({}),
        )
        .await?["createTenant"]["tenant"]["id"]
        .as_str()
        .context("createTenant returned no id")?
        .to_owned();
    api.data(
        "mutation($input: OfferPoolInput!) { offerPool(input: $input) { tenantId } }",
        json!({ "input": { "poolId": pool, "tenantId": tenant } }),
    )
    .await?;
    Ok(tenant)
}

/// GPUs of the pool booked now, and all of its schedulable nodes' GPUs.
async fn booked_gpus(api: &Api, pool: &str) -> anyhow::Result<(i64, i64)> {
    let data = api
        .data(
            "query($pool: ID!) { capacity(poolIds: [$pool]) { nodes { allocatedGpus freeGpus } } }",
            json!({ "pool": pool }),
        )
        .await?;
    let rows = data["capacity"]["nodes"]
        .as_array()
        .context("capacity returned no rows")?;
    let sum = |field: &str| rows.iter().filter_map(|r| r[field].as_i64()).sum::<i64>();
    let allocated = sum("allocatedGpus");
    Ok((allocated, allocated + sum("freeGpus")))
}

/// What the clients did in the window, all of them together.
#[derive(Default)]
struct Measured {
    elapsed: Duration,
    create: Latencies,
    release: Latencies,
    /// Answers of `createReservation` by the reservation's state, or by error code.
    answers: BTreeMap<String, u64>,
    placed_gpus: u64,
    /// Release failures and unexpected answers, the first few kept for the report.
    failures: Vec<String>,
    failure_count: u64,
    server_cpu: f64,
}

impl Measured {
    fn absorb(&mut self, client: Client) {
        self.create.extend(client.create);
        self.release.extend(client.release);
        for (answer, count) in client.answers {
            *self.answers.entry(answer).or_default() += count;
        }
        self.placed_gpus += client.placed_gpus;
        self.failure_count += client.failures.len() as u64;
        let room = MAX_FAILURES_KEPT.saturating_sub(self.failures.len());
        self.failures.extend(client.failures.into_iter().take(room));
    }

    fn placed(&self) -> u64 {
        self.answers.get("PLACED").copied().unwrap_or(0)
    }
}

/// How many failure messages the report quotes.
const MAX_FAILURES_KEPT: usize = 3;

async fn measure(
    args: &Args,
    server: &Server,
    api: &Api,
    tenant: &str,
    pool: &str,
) -> anyhow::Result<Measured> {
    let clk_tck = bench::clock_ticks_per_second().await;
    let cpu_before = server.cpu_ticks()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.window);
    let mut clients = JoinSet::new();
    for _ in 0..args.clients {
        let (api, tenant, pool, hold) =
            (api.clone(), tenant.to_owned(), pool.to_owned(), args.hold);
        clients.spawn(async move { Client::run(&api, &tenant, &pool, hold, deadline).await });
    }
    let mut measured = Measured::default();
    while let Some(client) = clients.join_next().await {
        measured.absorb(client.context("a benchmark client panicked")?);
    }
    measured.elapsed = start.elapsed();
    measured.server_cpu =
        (server.cpu_ticks()? - cpu_before) / clk_tck / measured.elapsed.as_secs_f64() * 100.0;
    Ok(measured)
}

/// One API client: creates, holds and releases reservations until the deadline.
#[derive(Default)]
struct Client {
    create: Latencies,
    release: Latencies,
    answers: BTreeMap<String, u64>,
    placed_gpus: u64,
    failures: Vec<String>,
}

/// A reservation a client holds: its id and the version to release it at.
struct Held {
    id: String,
    version: i64,
}

impl Client {
    async fn run(api: &Api, tenant: &str, pool: &str, hold: usize, deadline: Instant) -> Client {
        let mut client = Client::default();
        let mut held = VecDeque::new();
        while Instant::now() < deadline {
            let input = random_request(tenant, pool);
            let timer = Instant::now();
            let answer = api
                .query(
                    "mutation($input: CreateReservationInput!) { createReservation(input: $input) { reservation { id state version nodeCount gpusPerNode } } }",
                    json!({ "input": input }),
                )
                .await;
            let took = timer.elapsed();
            let reservation = match answer {
                Ok(body) => match body["errors"].get(0) {
                    Some(error) => {
                        let code = error["extensions"]["code"].as_str().unwrap_or("UNKNOWN");
                        client.count(code);
                        client.fail(format!("createReservation: {code}: {}", error["message"]));
                        continue;
                    }
                    None => body["data"]["createReservation"]["reservation"].clone(),
                },
                Err(err) => {
                    client.count("TRANSPORT");
                    client.fail(format!("createReservation: {err:#}"));
                    continue;
                }
            };
            client.create.push(took);
            let state = reservation["state"].as_str().unwrap_or("?").to_owned();
            client.count(&state);
            let Some(this) = held_from(&reservation) else {
                client.fail(format!("createReservation answered {reservation}"));
                continue;
            };
            if state == "PLACED" {
                let gpus = reservation["nodeCount"].as_u64().unwrap_or(0)
                    * reservation["gpusPerNode"].as_u64().unwrap_or(0);
                client.placed_gpus += gpus;
                held.push_back(this);
                if held.len() > hold
                    && let Some(oldest) = held.pop_front()
                {
                    client.release(api, oldest).await;
                }
            } else {
                // Waiting work is not what this measures: give its place in the queue back.
                client.release(api, this).await;
            }
        }
        client
    }

    async fn release(&mut self, api: &Api, reservation: Held) {
        let timer = Instant::now();
        let answer = api
            .query(
                "mutation($input: ReleaseReservationInput!) { releaseReservation(input: $input) { reservation { state } } }",
                json!({ "input": { "id": reservation.id, "version": reservation.version } }),
            )
            .await;
        let took = timer.elapsed();
        match answer {
            Ok(body) if body["errors"].get(0).is_none() => self.release.push(took),
            Ok(body) => self.fail(format!("releaseReservation: {}", body["errors"][0])),
            Err(err) => self.fail(format!("releaseReservation: {err:#}")),
        }
    }

    fn count(&mut self, answer: &str) {
        *self.answers.entry(answer.to_owned()).or_default() += 1;
    }

    fn fail(&mut self, message: String) {
        self.failures.push(message);
    }
}

fn held_from(reservation: &Value) -> Option<Held> {
    Some(Held {
        id: reservation["id"].as_str()?.to_owned(),
        version: reservation["version"].as_i64()?,
    })
}

/// A `CreateReservationInput` of a random shape.
fn random_request(tenant: &str, pool: &str) -> Value {
    let mut rng = rand::rng();
    let gpus = bc_testing::workload::random_gpus_per_node(&mut rng);
    let nodes = if rng.random_bool(GANG_SHARE) {
        rng.random_range(GANG_SIZES)
    } else {
        1
    };
    let policy = if rng.random_bool(SPREAD_SHARE) {
        "SPREAD"
    } else {
        "BIN_PACK"
    };
    json!({
        "tenantId": tenant,
        "poolId": pool,
        "gpusPerNode": gpus,
        "nodeCount": nodes,
        "policy": policy,
    })
}

/// Raw single-row UPDATE rates of the database the server will run on.
struct RawUpdates {
    /// What they were measured on.
    kind: DbBackend,
    one: f64,
    /// On PostgreSQL, from `clients` connections at once (SQLite has one writer).
    many: Option<(usize, f64)>,
}

/// Measures the raw UPDATE rates on a scratch table: in the fresh PostgreSQL database at
/// `url` (dropped again before the server starts), or in a scratch SQLite file beside the
/// server's, opened as the server opens its own (WAL, `synchronous = NORMAL`).
async fn raw_update_rates(
    url: Option<&str>,
    dir: &Path,
    clients: usize,
) -> anyhow::Result<RawUpdates> {
    let (url, connections) = match url {
        Some(url) => (url.to_owned(), clients),
        None => (
            format!("sqlite://{}?mode=rwc", dir.join("raw.sqlite").display()),
            1,
        ),
    };
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(connections as u32)
        .sqlx_logging(false)
        .map_sqlx_sqlite_opts(|opts: SqliteConnectOptions| {
            opts.journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Normal)
                .busy_timeout(SQLITE_BUSY_TIMEOUT)
                .pragma("mmap_size", SQLITE_MMAP_BYTES.to_string())
        });
    let db = Database::connect(options)
        .await
        .context("connecting for the raw UPDATE rate")?;
    let kind = db.get_database_backend();
    db.execute_unprepared(&format!(
        "CREATE TABLE {RAW_TABLE} (id BIGINT PRIMARY KEY, version BIGINT NOT NULL, touched BIGINT NOT NULL)"
    ))
    .await?;
    for id in 0..clients {
        db.execute_unprepared(&format!(
            "INSERT INTO {RAW_TABLE} (id, version, touched) VALUES ({id}, 0, 0)"
        ))
        .await?;
    }
    let one = updates_per_second(&db, 1).await?;
    let many = if kind == DbBackend::Postgres {
        Some((clients, updates_per_second(&db, clients).await?))
    } else {
        None
    };
    db.execute_unprepared(&format!("DROP TABLE {RAW_TABLE}"))
        .await?;
    db.close().await?;
    tracing::info!(one, ?many, "raw UPDATE rates measured");
    Ok(RawUpdates { kind, one, many })
}

/// Single-row UPDATEs per second from `writers` tasks, each on its own row, for
/// [`RAW_UPDATE_DURATION`].
async fn updates_per_second(db: &DatabaseConnection, writers: usize) -> anyhow::Result<f64> {
    // Each writer counts its row's version from 0, and an earlier measurement moved them.
    db.execute_unprepared(&format!("UPDATE {RAW_TABLE} SET version = 0"))
        .await?;
    let start = Instant::now();
    let deadline = start + RAW_UPDATE_DURATION;
    let mut tasks = JoinSet::new();
    for id in 0..writers {
        let db = db.clone();
        tasks.spawn(async move {
            let backend = db.get_database_backend();
            let sql = match backend {
                DbBackend::Postgres => format!(
                    "UPDATE {RAW_TABLE} SET version = version + 1, touched = $1 WHERE id = $2 AND version = $3"
                ),
                _ => format!(
                    "UPDATE {RAW_TABLE} SET version = version + 1, touched = ? WHERE id = ? AND version = ?"
                ),
            };
            let mut version = 0_i64;
            while Instant::now() < deadline {
                let statement = Statement::from_sql_and_values(
                    backend,
                    &sql,
                    [version.into(), (id as i64).into(), version.into()],
                );
                let done = db.execute_raw(statement).await?;
                ensure!(done.rows_affected() == 1, "the raw UPDATE missed its row");
                version += 1;
            }
            anyhow::Ok(version as u64)
        });
    }
    let mut total = 0;
    while let Some(done) = tasks.join_next().await {
        total += done.context("a raw UPDATE writer panicked")??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

struct Report<'a> {
    nodes: usize,
    backend: &'a str,
    clients: usize,
    hold: usize,
    bring_up: BringUp,
    raw: RawUpdates,
    measured: Measured,
    booked: (i64, i64),
}

impl Report<'_> {
    fn print(&self) -> std::io::Result<()> {
        let m = &self.measured;
        let seconds = m.elapsed.as_secs_f64();
        let created: u64 = m.create.len() as u64;
        let raw_limit = match self.raw.kind {
            DbBackend::Postgres => RAW_PG_UPDATES,
            _ => RAW_SQLITE_UPDATES,
        };
        let answers = m
            .answers
            .iter()
            .map(|(answer, count)| format!("{answer} {count}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut rows: Vec<Row<'_>> = vec![(
            "raw single-row UPDATE, 1 connection".into(),
            format!("{:.0}/s", self.raw.one),
            raw_limit,
        )];
        if let Some((connections, rate)) = self.raw.many {
            rows.push((
                format!("raw single-row UPDATE, {connections} connections"),
                format!("{rate:.0}/s"),
                raw_limit,
            ));
        }
        rows.extend(self.bring_up.rows());
        rows.extend([
            (
                "reservations placed".into(),
                format!(
                    "{:.0}/s ({} in {seconds:.1} s, {:.0} GPUs/s)",
                    m.placed() as f64 / seconds,
                    m.placed(),
                    m.placed_gpus as f64 / seconds
                ),
                "",
            ),
            (
                "createReservation answered".into(),
                format!("{:.0}/s ({created})", created as f64 / seconds),
                "",
            ),
            (
                "createReservation p50 / p99".into(),
                m.create.describe(),
                RAW_GRAPHQL,
            ),
            (
                "releaseReservation p50 / p99".into(),
                m.release.describe(),
                RAW_GRAPHQL,
            ),
            ("answers by state or error".into(), answers, ""),
            (
                "GPUs booked at the end".into(),
                format!("{} of {}", self.booked.0, self.booked.1),
                "",
            ),
            (
                "server CPU".into(),
                format!("{:.1} % of one core", m.server_cpu),
                RAW_CPU,
            ),
        ]);
        let mut out = std::io::stdout().lock();
        writeln!(out)?;
        writeln!(
            out,
            "placement-bench: {} nodes on {}, {} clients holding up to {} each, window {seconds:.1} s",
            self.nodes, self.backend, self.clients, self.hold,
        )?;
        writeln!(out)?;
        bench::write_table(&mut out, &rows)?;
        if m.failure_count > 0 {
            writeln!(out)?;
            writeln!(
                out,
                "{} request(s) failed; the first: {}",
                m.failure_count,
                m.failures.join(" | ")
            )?;
        }
        Ok(())
    }
}
