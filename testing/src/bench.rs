//! The support code of the benchmarks (`fleet-bench`, `placement-bench` and
//! `subscription-bench`): the
//! `better-compute` binary as a child process on loopback ports ([`Server`]), the database it
//! runs on ([`BenchDatabase`]), its GraphQL API and `/metrics` ([`Api`]), a process's CPU and
//! memory from `/proc`, nearest-rank quantiles, and the table the results are printed in.
//!
//! Everything here talks to 127.0.0.1 only, every wait is bounded, and the child is stopped
//! (or killed on drop) when the benchmark ends.

use crate::daemon::{CaTrust, DaemonKnobs};
use crate::server::{Backend, TestDatabase};
use crate::sim::{Fleet, Progress, SimOptions};
use crate::simulator_processes::{SimulatorProcesses, SimulatorSpec};
use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tempfile::TempDir;
use tokio::process::{Child, Command};
use tokio::time::Instant;

/// How long the server may take to migrate its database and listen: migrating a fresh
/// database takes seconds even on a shared machine, so a minute catches only a server that
/// hangs.
const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the server's readiness is polled: often enough to add little to the start-up,
/// rarely enough not to load the server while it migrates.
const READY_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How long one readiness probe may take: a server that is up answers `/readyz` in
/// milliseconds, and a hung probe must not eat the whole `SERVER_READY_TIMEOUT`.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the server gets to stop after SIGTERM before it is killed: long enough for a
/// graceful shutdown (closing its sessions and subscriptions) under load, short enough not
/// to hold up the benchmark's exit.
const CHILD_STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// How many lines of the server's log an error quotes: enough for the panic or the last
/// errors, few enough to read on a terminal.
const LOG_TAIL_LINES: usize = 30;
/// Clock ticks per second when `getconf CLK_TCK` cannot say: Linux's `USER_HZ`, which is 100
/// on every architecture the benchmarks run on.
const DEFAULT_CLK_TCK: f64 = 100.0;
/// The heading of the results table's last column; the separator line is sized from it.
const LIMIT_HEADING: &str = "raw limit on this machine kind (shared/notes/performance.md)";
/// The space between two columns of the results table.
const COLUMN_GAP: &str = "  ";

/// How long the tokens a benchmark mints live: longer than the longest run, so that no
/// request of a benchmark fails because its token expired.
pub const TOKEN_HOURS: i64 = 4;
/// How often a benchmark logs its progress while it waits: often enough to show it is
/// alive, rarely enough to keep the log readable.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How often fleet progress is polled while the fleet comes up.
const FLEET_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// The page size [`Api::node_ids_in_pool`] reads ids in: the API's largest page.
const NODE_ID_PAGE: usize = 1000;
/// PostgreSQL connections [`BenchDatabase::pool_settings`] leaves to others than the
/// replicas: the benchmark's own, a psql to look on, and the superuser's reserve.
const CONNECTIONS_KEPT_FREE: usize = 10;
/// PostgreSQL connections the replicas' pools hold together by default, per core of this
/// machine (which runs PostgreSQL too): more backends than that do not do more work, they
/// queue for the same cores and locks. 10,000 nodes on seven replicas were schedulable in
/// 88 s with 3 connections each (21 in all on 2 cores), 93 s with 4, 114 s with 6 and 172 s
/// with 12, the most that fit under `max_connections` (BENCHMARKS.md).
const CONNECTIONS_PER_CORE: usize = 10;
/// The fewest connections a replica's pool may have: the event feed listens on one, and
/// the others serve everything else.
const MIN_CONNECTIONS_PER_REPLICA: usize = 3;
/// How long the join token a benchmark mints lives: longer than a fleet takes to come up.
const JOIN_TOKEN_TTL: Duration = Duration::from_secs(2 * 3600);

/// Logs to standard error (`warn`, and `info` for the benchmark named by `own_target`, the
/// binary's `module_path!()`, and for this module) unless `RUST_LOG` says otherwise, and
/// installs ring as the process's TLS provider, which the HTTP clients and the simulated
/// daemons need.
pub fn init(own_target: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "warn,{own_target}=info,{}=info",
            module_path!()
        ))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // Another provider installed first is as good: the error says only that one is.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The options of the server a benchmark starts, the same in every benchmark's command line
/// (`#[command(flatten)]`).
#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// The `better-compute` binary. Default: next to this one.
    #[arg(long, env = "BC_SERVER_BIN")]
    pub server_bin: Option<PathBuf>,
    /// The server's log filter (its log goes to server.log in the temporary directory).
    #[arg(long, default_value = "warn")]
    pub server_log: String,
    /// Keep the temporary directory (database, server.log) and print where it is.
    #[arg(long)]
    pub keep: bool,
}

/// Runs a benchmark to its end, or until it is stopped by Ctrl-C or `SIGTERM`, and gives
/// its exit: success, or its error logged (with its causes) and failure. A stopped
/// benchmark's future is dropped, and with it the servers and simulator processes it started
/// (each killed on drop) and its temporary directory, so stopping one by signal leaves
/// nothing running; without this, a signal ended the benchmark alone and its servers and
/// simulators went on loading the machine as orphans.
pub async fn run_to_exit(
    benchmark: &str,
    run: impl std::future::Future<Output = anyhow::Result<()>>,
) -> std::process::ExitCode {
    let outcome = tokio::select! {
        outcome = run => outcome,
        signal = stop_signal() => Err(anyhow::anyhow!("stopped by {signal}")),
    };
    match outcome {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{benchmark} failed: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The first of `SIGINT` and `SIGTERM` to arrive, by name. Should the handlers fail to
/// install, it never arrives (and the benchmark runs as it did before there were any).
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut interrupt), Ok(mut terminate)) => tokio::select! {
            _ = interrupt.recv() => "SIGINT",
            _ = terminate.recv() => "SIGTERM",
        },
        (Err(err), _) | (_, Err(err)) => {
            tracing::warn!(error = %err, "cannot watch for SIGINT and SIGTERM: stopping the benchmark by signal may leave its servers running");
            std::future::pending().await
        }
    }
}

/// The simulated fleet's options a benchmark takes on its command line
/// (`#[command(flatten)]`).
#[derive(Debug, clap::Args)]
pub struct FleetArgs {
    /// Heartbeat interval of the simulated daemons, in seconds.
    #[arg(long, default_value_t = 10)]
    pub heartbeat_secs: u64,
    /// Joins in flight at once, and (apart) session handshakes in flight at once (shared
    /// evenly by the simulator processes).
    #[arg(long, default_value_t = crate::sim::DEFAULT_JOIN_CONCURRENCY)]
    pub join_concurrency: usize,
    /// Run the simulated daemons in this many `better-compute sim` child processes instead
    /// of inside the benchmark. By default: inside, unless the fleet needs more sessions
    /// than one process may hold open files, then as few processes as hold it.
    #[arg(long)]
    pub sim_processes: Option<std::num::NonZeroUsize>,
}

impl FleetArgs {
    /// Daemons that heartbeat every `heartbeat_secs`, joining `join_concurrency` at a time.
    pub fn sim_options(&self) -> SimOptions {
        SimOptions {
            join_concurrency: self.join_concurrency,
            knobs: DaemonKnobs {
                heartbeat_interval_override: Some(Duration::from_secs(self.heartbeat_secs)),
                ..DaemonKnobs::default()
            },
            ..SimOptions::default()
        }
    }

    /// How many simulator processes hold `nodes` daemons: `--sim-processes`, else none (the
    /// daemons run inside the benchmark) while one process may hold them all, else as few as
    /// hold them. The open-file limit is raised as far as it goes here, as it will be in each
    /// simulator process; where it cannot be read or leaves no room beyond [`SPARE_FDS`], the
    /// daemons run inside and the benchmark warns of the limit.
    pub fn processes_for(&self, nodes: usize) -> Option<usize> {
        if let Some(processes) = self.sim_processes {
            return Some(processes.get());
        }
        match rlimit::increase_nofile_limit(u64::MAX) {
            Ok(files) if files > SPARE_FDS => {
                let per_process = usize::try_from(files - SPARE_FDS).unwrap_or(usize::MAX);
                Some(nodes.div_ceil(per_process)).filter(|&n| n > 1)
            }
            outcome => {
                tracing::warn!(
                    ?outcome,
                    nodes,
                    "the open-file limit leaves no room for sessions; the daemons run inside the benchmark"
                );
                None
            }
        }
    }
}

/// File descriptors a process holding simulated daemons needs beyond one per session (joins,
/// the benchmark's own GraphQL clients, the runtime).
pub const SPARE_FDS: u64 = 1024;

/// The `better-compute` binary: `given`, or the one next to the running benchmark.
pub fn server_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
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

/// The database a benchmark runs on: a fresh PostgreSQL database (dropped afterwards), a
/// given one on this machine, or, when neither, a fresh SQLite file the server creates in its
/// data directory.
pub struct BenchDatabase {
    fresh: Option<TestDatabase>,
    url: Option<String>,
    description: &'static str,
}

impl BenchDatabase {
    /// A fresh PostgreSQL database with `postgres`, else `given` (which must be on this
    /// machine), else the server's own SQLite file.
    pub async fn prepare(postgres: bool, given: Option<&str>) -> anyhow::Result<BenchDatabase> {
        if let Some(url) = given {
            ensure!(
                !postgres,
                "a fresh PostgreSQL database and a given database exclude each other"
            );
            ensure!(
                is_loopback_database(url),
                "--database-url must point at 127.0.0.1, localhost or a local socket"
            );
            return Ok(BenchDatabase {
                fresh: None,
                url: Some(url.to_owned()),
                description: "the given database",
            });
        }
        if postgres {
            let fresh = TestDatabase::create(Backend::Postgres).await?;
            return Ok(BenchDatabase {
                url: Some(fresh.url.clone()),
                fresh: Some(fresh),
                description: "PostgreSQL (fresh database)",
            });
        }
        Ok(BenchDatabase {
            fresh: None,
            url: None,
            description: "SQLite (fresh file)",
        })
    }

    /// The pool size of each of `replicas` servers on PostgreSQL: `asked` if given (refused
    /// if the pools do not fit the PostgreSQL server's `max_connections`, keeping
    /// [`CONNECTIONS_KEPT_FREE`] for the benchmark and psql), else [`CONNECTIONS_PER_CORE`]
    /// per core of this machine shared among them, at least
    /// [`MIN_CONNECTIONS_PER_REPLICA`] and at most what fits and the server's default.
    /// Nothing for one server or SQLite.
    pub async fn pool_settings(
        &self,
        replicas: usize,
        asked: Option<usize>,
    ) -> anyhow::Result<Vec<(&'static str, String)>> {
        let Some(url) = self.url.as_deref().filter(|u| u.starts_with("postgres")) else {
            return Ok(Vec::new());
        };
        if replicas < 2 {
            return Ok(Vec::new());
        }
        use sea_orm::{ConnectionTrait, Database, Statement};
        let db = Database::connect(url).await?;
        let row = db
            .query_one_raw(Statement::from_string(
                db.get_database_backend(),
                "SELECT current_setting('max_connections')::int AS max",
            ))
            .await?
            .context("no max_connections")?;
        let max: i32 = row.try_get("", "max")?;
        db.close().await?;
        let default = better_compute::config::DatabaseConfig::default().max_connections as usize;
        // The feed's listening connection is one of the pool's.
        let fitting = usize::try_from(max)?.saturating_sub(CONNECTIONS_KEPT_FREE) / replicas;
        anyhow::ensure!(
            fitting >= MIN_CONNECTIONS_PER_REPLICA,
            "{replicas} replicas of {MIN_CONNECTIONS_PER_REPLICA} connections or more do not fit \
             PostgreSQL's max_connections ({max}, {CONNECTIONS_KEPT_FREE} kept free)"
        );
        let per_replica = match asked {
            Some(asked) => {
                anyhow::ensure!(
                    asked >= MIN_CONNECTIONS_PER_REPLICA,
                    "a replica needs at least {MIN_CONNECTIONS_PER_REPLICA} database connections \
                     (the event feed listens on one)"
                );
                anyhow::ensure!(
                    asked <= fitting,
                    "{replicas} replicas of {asked} connections do not fit PostgreSQL's \
                     max_connections ({max}, {CONNECTIONS_KEPT_FREE} kept free): at most {fitting} \
                     each"
                );
                asked
            }
            None => {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                (CONNECTIONS_PER_CORE * cores / replicas)
                    .clamp(MIN_CONNECTIONS_PER_REPLICA, default)
                    .min(fitting)
            }
        };
        tracing::info!(
            max,
            replicas,
            per_replica,
            "database connections per replica"
        );
        Ok(vec![(
            "BC_DATABASE__MAX_CONNECTIONS",
            per_replica.to_string(),
        )])
    }

    /// The `DATABASE_URL` the server gets, if any (none: its SQLite file).
    pub fn url(&self) -> Option<&str> {
        self.url.as_deref()
    }

    /// What the results say the benchmark ran on.
    pub fn description(&self) -> &'static str {
        self.description
    }

    /// Drops the database if the benchmark created it.
    async fn drop_if_fresh(self) -> anyhow::Result<()> {
        if let Some(fresh) = self.fresh {
            fresh
                .drop_database()
                .await
                .context("dropping the benchmark database")?;
        }
        Ok(())
    }
}

/// Ends a benchmark run: stops the server, drops a fresh database, keeps the temporary
/// directory if asked, and quotes the server's log if the run (`outcome`) failed. A failure
/// to drop the database is returned at once; otherwise the run's error comes first, then the
/// server's failure to stop.
pub async fn finish(
    mut server: Server,
    database: BenchDatabase,
    dir: TempDir,
    keep: bool,
    outcome: anyhow::Result<()>,
) -> anyhow::Result<()> {
    let stopped = server.stop().await.map(|_| ());
    database.drop_if_fresh().await?;
    if keep {
        let kept = dir.keep();
        tracing::info!(dir = %kept.display(), "kept the temporary directory");
    }
    if outcome.is_err() {
        tracing::error!("the server's log ends with:\n{}", server.log_tail());
    }
    outcome?;
    stopped
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

/// The server as a child process: its API and gateway on loopback ports it was given, a
/// JWT secret of its own, and its log in `server.log` of the benchmark's directory
/// (`server-<n>.log` for replica n).
pub struct Server {
    child: Child,
    bin: PathBuf,
    env: Vec<(String, String)>,
    jwt_secret: String,
    api_port: u16,
    gateway_port: u16,
    /// The id its gateway writes in session rows (`bench-gw-<gateway port>`), so the
    /// benchmark can tell which replica holds a node's session.
    gateway_id: String,
    log: PathBuf,
}

impl Server {
    /// Starts `better-compute serve` with its data and log in `dir`, on `database_url` (none:
    /// a SQLite file in its data directory), logging with `log_filter`, with `settings` (more
    /// `BC_…` variables), and waits until both its API and its gateway answer.
    ///
    /// Every benchmark client connects from 127.0.0.1, so the per-address connection caps
    /// are lifted to the listeners' own caps: a benchmark's load is one address by
    /// construction, not an attacker.
    pub async fn start(
        bin: &Path,
        dir: &Path,
        database_url: Option<&str>,
        log_filter: &str,
        settings: &[(&str, String)],
    ) -> anyhow::Result<Server> {
        let (api_port, gateway_port) = free_ports()?;
        let jwt_secret = hex::encode(rand::random::<[u8; 32]>());
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
            ("BC_AUTH__JWT_SECRET".to_owned(), jwt_secret.clone()),
            ("BC_LOG__FILTER".to_owned(), log_filter.to_owned()),
            (
                "BC_API__MAX_CONNECTIONS_PER_PEER".to_owned(),
                usize::MAX.to_string(),
            ),
            (
                "BC_GATEWAY__MAX_CONNECTIONS_PER_PEER".to_owned(),
                usize::MAX.to_string(),
            ),
        ];
        env.extend(settings.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
        if let Some(url) = database_url {
            env.push(("DATABASE_URL".to_owned(), url.to_owned()));
        }
        Server::spawn(
            bin,
            env,
            jwt_secret,
            (api_port, gateway_port),
            dir.join("server.log"),
        )
        .await
    }

    /// Another server on this one's database, data directory (so its CA and keys) and JWT
    /// secret, on ports of its own, logging to `server-<replica>.log` beside this one's: a
    /// replica of the control plane. Only a shared database (PostgreSQL) makes it one.
    pub async fn start_replica(&self, replica: usize) -> anyhow::Result<Server> {
        let (api_port, gateway_port) = free_ports()?;
        let env = self
            .env
            .iter()
            .map(|(key, value)| match key.as_str() {
                "BC_LISTEN" => (key.clone(), format!("127.0.0.1:{api_port}")),
                "BC_GATEWAY__LISTEN" => (key.clone(), format!("127.0.0.1:{gateway_port}")),
                _ => (key.clone(), value.clone()),
            })
            .collect();
        let log = self.log.with_file_name(format!("server-{replica}.log"));
        Server::spawn(
            &self.bin,
            env,
            self.jwt_secret.clone(),
            (api_port, gateway_port),
            log,
        )
        .await
    }

    async fn spawn(
        bin: &Path,
        mut env: Vec<(String, String)>,
        jwt_secret: String,
        (api_port, gateway_port): (u16, u16),
        log: PathBuf,
    ) -> anyhow::Result<Server> {
        let gateway_id = format!("bench-gw-{gateway_port}");
        env.retain(|(key, _)| key != "BC_GATEWAY__GATEWAY_ID");
        env.push(("BC_GATEWAY__GATEWAY_ID".to_owned(), gateway_id.clone()));
        let log_file = std::fs::File::create(&log)?;
        let child = isolated_command(bin, &env)
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
            jwt_secret,
            api_port,
            gateway_port,
            gateway_id,
            log,
        };
        server.wait_ready().await?;
        tracing::info!(api = %server.api_url(), gateway = %server.gateway_url(), pid = server.pid(), "server ready");
        Ok(server)
    }

    /// Waits until `/readyz` answers and the gateway accepts connections, at most
    /// `SERVER_READY_TIMEOUT`; fails at once if the server exits.
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let client = reqwest::Client::builder()
            .timeout(READY_PROBE_TIMEOUT)
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
            tokio::time::sleep(READY_POLL_INTERVAL).await;
        }
    }

    /// An admin token from `better-compute token` with the server's configuration (so signed
    /// with its secret, for its audience), living `TOKEN_HOURS`.
    pub async fn admin_token(&self) -> anyhow::Result<String> {
        let output = isolated_command(&self.bin, &self.env)
            .args([
                "token",
                "--subject",
                "bench",
                "--role",
                "admin",
                "--hours",
                &TOKEN_HOURS.to_string(),
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

    /// The secret the server signs and checks tokens with, for minting tokens in-process.
    pub fn jwt_secret(&self) -> &str {
        &self.jwt_secret
    }

    pub fn api_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.api_port)
    }

    pub fn gateway_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.gateway_port)
    }

    /// The id its gateway writes in session rows.
    pub fn gateway_id(&self) -> &str {
        &self.gateway_id
    }

    /// The server's process id (0 once it has been waited for).
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or_default()
    }

    /// Whether the server's process is gone.
    /// A child that died but was not waited for yet is a zombie: its `/proc` entry stays,
    /// with state `Z`.
    pub fn exited(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).map_or(true, |stat| {
            // The state follows the command name, which is in parentheses and may hold spaces.
            stat.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
    }

    /// The server's CPU time so far, in clock ticks (see [`clock_ticks_per_second`]).
    pub fn cpu_ticks(&self) -> anyhow::Result<f64> {
        cpu_ticks_of_pid(self.pid())
    }

    /// The CPU time so far of the server's threads named `name` (their `comm`, as
    /// `/proc/<pid>/task/*/comm` shows it), in clock ticks. A thread that has exited counts
    /// no more.
    pub fn thread_cpu_ticks(&self, name: &str) -> anyhow::Result<f64> {
        thread_cpu_ticks_of(&self.pid().to_string(), name)
    }

    /// The server's memory now and at its peak.
    pub fn memory(&self) -> anyhow::Result<Memory> {
        memory(self.pid())
    }

    /// The last `LOG_TAIL_LINES` lines of the server's log.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log, LOG_TAIL_LINES)
    }

    /// Kills the server (SIGKILL): it says nothing to anyone, as a crashed replica.
    pub async fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill().await?;
        Ok(())
    }

    /// Stops the server (SIGTERM, then a kill after `CHILD_STOP_TIMEOUT`): how long it took.
    /// A server that already stopped takes no time.
    pub async fn stop(&mut self) -> anyhow::Result<Duration> {
        let started = Instant::now();
        match terminate(&mut self.child, CHILD_STOP_TIMEOUT).await? {
            Stopped::Exited(status) if !status.success() => {
                tracing::warn!(%status, "the server did not exit cleanly");
            }
            Stopped::Killed => {
                tracing::warn!("the server did not stop within {CHILD_STOP_TIMEOUT:?}; killed it");
            }
            Stopped::Exited(_) | Stopped::AlreadyGone => {}
        }
        Ok(started.elapsed())
    }
}

/// How [`terminate`] ended a child process.
pub(crate) enum Stopped {
    /// It exited after SIGTERM, with this status.
    Exited(std::process::ExitStatus),
    /// It did not exit within the time given and was killed.
    Killed,
    /// It had been waited for already.
    AlreadyGone,
}

/// Asks a child process to stop (SIGTERM) and waits for it at most `timeout`, then kills it.
pub(crate) async fn terminate(child: &mut Child, timeout: Duration) -> std::io::Result<Stopped> {
    let Some(pid) = child.id() else {
        return Ok(Stopped::AlreadyGone);
    };
    // If `kill` fails the child is gone already or the wait below times out and kills it,
    // so its result adds nothing.
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await;
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(status) => Ok(Stopped::Exited(status?)),
        Err(_) => {
            child.kill().await?;
            Ok(Stopped::Killed)
        }
    }
}

/// The last `lines` lines of a log file (empty if it cannot be read).
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The `better-compute` binary (a server, or a simulator's `sim`) with only the benchmark's
/// configuration: no `BC_…`, `DATABASE_URL` or `RUST_LOG` from the caller's environment.
pub(crate) fn isolated_command(bin: &Path, env: &[(String, String)]) -> Command {
    let mut command = Command::new(bin);
    for (key, _) in std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v))) {
        if key.starts_with("BC_") || key == "DATABASE_URL" || key == "RUST_LOG" {
            command.env_remove(key);
        }
    }
    command.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    command
}

/// Two free loopback ports: bound together (so they differ), then released for the server.
fn free_ports() -> anyhow::Result<(u16, u16)> {
    let a = std::net::TcpListener::bind("127.0.0.1:0")?;
    let b = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok((a.local_addr()?.port(), b.local_addr()?.port()))
}

/// The GraphQL API of the child server, as the bearer of one token. Clones share one
/// connection pool.
#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    url: String,
    token: String,
}

impl Api {
    /// The API at `url` (the server's [`Server::api_url`]) with `token`; a request taking
    /// longer than `timeout` fails.
    pub fn new(url: String, token: String, timeout: Duration) -> anyhow::Result<Api> {
        Ok(Api {
            client: reqwest::Client::builder().timeout(timeout).build()?,
            url,
            token,
        })
    }

    /// The whole response body.
    pub async fn query(&self, query: &str, variables: Value) -> anyhow::Result<Value> {
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
    pub async fn data(&self, query: &str, variables: Value) -> anyhow::Result<Value> {
        let body = self.query(query, variables).await?;
        if body.get("errors").is_some_and(|e| !e.is_null()) {
            bail!("GraphQL errors: {}", body["errors"]);
        }
        Ok(body["data"].clone())
    }

    /// The ids of every node in `pool`, a page of [`NODE_ID_PAGE`] at a time.
    pub async fn node_ids_in_pool(&self, pool: &str) -> anyhow::Result<Vec<String>> {
        let mut ids = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let data = self
                .data(
                    "query($pool: ID!, $first: Int!, $after: String) { nodes(first: $first, after: $after, filter: {poolId: [$pool]}) { edges { node { id } } pageInfo { endCursor hasNextPage } } }",
                    json!({ "pool": pool, "first": NODE_ID_PAGE, "after": after }),
                )
                .await?;
            let page = &data["nodes"];
            let edges = page["edges"]
                .as_array()
                .context("nodes returned no edges")?;
            ids.extend(
                edges
                    .iter()
                    .filter_map(|e| e["node"]["id"].as_str().map(str::to_owned)),
            );
            if page["pageInfo"]["hasNextPage"].as_bool() != Some(true) {
                return Ok(ids);
            }
            after = Some(
                page["pageInfo"]["endCursor"]
                    .as_str()
                    .context("a next page without a cursor")?
                    .to_owned(),
            );
        }
    }

    /// Creates the site (a platform) and the bare-metal pool, both named `bench`, that the
    /// benchmark's nodes join or are enrolled in: their ids. The pool expects as many GPUs as a
    /// simulated daemon reports, so that no node is flagged for a missing GPU.
    pub async fn create_site_and_pool(&self) -> anyhow::Result<(String, String)> {
        let site = self
            .data(
                "mutation($name: String!) { createSite(input: {name: $name, kind: PLATFORM}) { site { id } } }",
                json!({ "name": "bench" }),
            )
            .await?["createSite"]["site"]["id"]
            .as_str()
            .context("createSite returned no id")?
            .to_owned();
        let pool = self
            .data(
                "mutation($site: ID!, $gpus: Int) { createPool(input: {siteId: $site, name: \"bench\", kind: METAL_HOST, expectedGpuCount: $gpus}) { pool { id } } }",
                json!({ "site": site, "gpus": DaemonKnobs::default().gpu_count }),
            )
            .await?["createPool"]["pool"]["id"]
            .as_str()
            .context("createPool returned no id")?
            .to_owned();
        Ok((site, pool))
    }

    /// Every sample of `/metrics`, summed over labels, by metric name.
    pub async fn metrics(&self) -> anyhow::Result<Metrics> {
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

/// The server's `/metrics`: every metric's samples summed over their labels, and each series
/// (a metric with one set of labels) apart.
pub struct Metrics {
    sums: BTreeMap<String, f64>,
    series: BTreeMap<String, f64>,
}

impl Metrics {
    /// Parses the Prometheus text format, skipping comments and lines that are not samples.
    pub fn parse(text: &str) -> Metrics {
        let (mut sums, mut series) = (BTreeMap::new(), BTreeMap::new());
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((one, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let name = one.split('{').next().unwrap_or(one);
            if let Ok(value) = value.parse::<f64>() {
                *sums.entry(name.to_owned()).or_insert(0.0) += value;
                *series.entry(one.to_owned()).or_insert(0.0) += value;
            }
        }
        Metrics { sums, series }
    }

    /// The sum of `name`'s samples, if the server has the metric.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.sums.get(name).copied()
    }

    /// `name`'s series by their labels (`statement="select nodes"`, as written between the
    /// braces), each with its value.
    pub fn series(&self, name: &str) -> BTreeMap<&str, f64> {
        let prefix = format!("{name}{{");
        self.series
            .iter()
            .filter_map(|(one, value)| {
                let labels = one.strip_prefix(&prefix)?.strip_suffix('}')?;
                Some((labels, *value))
            })
            .collect()
    }

    /// Several servers' metrics with each metric (and series) summed over them: the replicas
    /// of one control plane as one. Meant for counters (a gauge's sum is only sometimes a sum).
    pub fn sum(all: impl IntoIterator<Item = Metrics>) -> Metrics {
        let (mut sums, mut series) = (BTreeMap::new(), BTreeMap::new());
        for metrics in all {
            for (name, value) in metrics.sums {
                *sums.entry(name).or_insert(0.0) += value;
            }
            for (one, value) in metrics.series {
                *series.entry(one).or_insert(0.0) += value;
            }
        }
        Metrics { sums, series }
    }

    /// The statement kinds that took the most time between `before` and `self` (the servers'
    /// `bc_db_statement_seconds`, timed by sea-orm from when a statement has its connection:
    /// a busy database's queue counts, the wait for a pool connection does not): at most
    /// `top` of them, the longest first, each with its seconds and its number of statements.
    pub fn statements_since(&self, before: &Metrics, top: usize) -> Vec<StatementTime> {
        let since = |name: &str| -> BTreeMap<String, f64> {
            let earlier = before.series(name);
            self.series(name)
                .into_iter()
                .map(|(labels, value)| {
                    let kind = labels
                        .strip_prefix("statement=\"")
                        .and_then(|rest| rest.strip_suffix('"'))
                        .unwrap_or(labels);
                    (
                        kind.to_owned(),
                        value - earlier.get(labels).copied().unwrap_or(0.0),
                    )
                })
                .collect()
        };
        let counts = since("bc_db_statement_seconds_count");
        let mut times: Vec<StatementTime> = since("bc_db_statement_seconds_sum")
            .into_iter()
            .filter(|(_, seconds)| *seconds > 0.0)
            .map(|(kind, seconds)| StatementTime {
                statements: counts.get(&kind).copied().unwrap_or(0.0),
                kind,
                seconds,
            })
            .collect();
        times.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        times.truncate(top);
        times
    }
}

/// One kind of statement's time over a stretch ([`Metrics::statements_since`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StatementTime {
    /// Its verb and table (`select nodes`).
    pub kind: String,
    pub seconds: f64,
    pub statements: f64,
}

/// The benchmark's own CPU time so far, in clock ticks (see [`clock_ticks_per_second`]).
pub fn own_cpu_ticks() -> anyhow::Result<f64> {
    cpu_ticks("/proc/self/stat")
}

/// The CPU time so far of this process's threads named `name`, in clock ticks: as
/// [`Server::thread_cpu_ticks`], for the benchmark's own threads.
pub fn own_thread_cpu_ticks(name: &str) -> anyhow::Result<f64> {
    thread_cpu_ticks_of("self", name)
}

/// The CPU time so far of the threads named `name` (their `comm`, as
/// `/proc/<process>/task/*/comm` shows it) of `process` (a pid, or `self`), in clock ticks.
fn thread_cpu_ticks_of(process: &str, name: &str) -> anyhow::Result<f64> {
    let tasks = format!("/proc/{process}/task");
    let mut ticks = 0.0;
    for task in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let dir = task?.path();
        // A thread may exit between the listing and the read: it is not counted then.
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue;
        };
        if comm.trim_end() == name {
            ticks += cpu_ticks(&dir.join("stat").to_string_lossy()).unwrap_or(0.0);
        }
    }
    Ok(ticks)
}

/// A child process's CPU time so far, in clock ticks.
pub fn cpu_ticks_of_pid(pid: u32) -> anyhow::Result<f64> {
    cpu_ticks(&format!("/proc/{pid}/stat"))
}

/// utime + stime of a process, in clock ticks, from its `/proc/<pid>/stat`.
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

/// The CPU time every core of the machine has spent busy, in clock ticks, from the first line
/// of `/proc/stat`: user, nice, system, irq and softirq time; not idle, not waiting for I/O,
/// and not stolen (time the hypervisor gave other machines, which no process here used).
/// Beside the servers' and the simulator's, it shows whether the machine was full and how
/// much the rest (mostly the database, also the kernel's network work) took.
pub fn machine_busy_ticks() -> anyhow::Result<f64> {
    busy_ticks(&std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?)
}

/// The busy ticks of `/proc/stat`'s text (see [`machine_busy_ticks`]).
fn busy_ticks(stat: &str) -> anyhow::Result<f64> {
    let line = stat
        .lines()
        .find(|line| line.starts_with("cpu "))
        .context("no cpu line in /proc/stat")?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("a /proc/stat cpu line")?;
    // user nice system idle iowait irq softirq steal ...; guest time is already in user.
    let [user, nice, system, _idle, _iowait, irq, softirq, _steal, ..] = ticks[..] else {
        anyhow::bail!("a short /proc/stat cpu line: {line}");
    };
    Ok(user + nice + system + irq + softirq)
}

/// CPU time in clock ticks (from `/proc`), spent over `wall`, as % of one core.
pub fn share_of_a_core(ticks: f64, clk_tck: f64, wall: Duration) -> f64 {
    100.0 * ticks / clk_tck / wall.as_secs_f64().max(0.001)
}

/// The clock ticks in a second of CPU time, to turn [`Server::cpu_ticks`] and
/// [`own_cpu_ticks`] into seconds.
pub async fn clock_ticks_per_second() -> f64 {
    match Command::new("getconf").arg("CLK_TCK").output().await {
        Ok(output) => String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap_or(DEFAULT_CLK_TCK),
        Err(_) => DEFAULT_CLK_TCK,
    }
}

/// A process's resident memory, in kB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// Resident now (VmRSS).
    pub rss_kb: u64,
    /// Resident at the peak so far (VmHWM).
    pub peak_rss_kb: u64,
}

/// VmRSS and VmHWM of a process, from `/proc/<pid>/status` (0 where it has no such line).
fn memory(pid: u32) -> anyhow::Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    Ok(parse_memory(&status))
}

fn parse_memory(status: &str) -> Memory {
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    };
    Memory {
        rss_kb: field("VmRSS:"),
        peak_rss_kb: field("VmHWM:"),
    }
}

/// The `q` quantile of `sorted` (ascending) by nearest rank: the smallest sample with at
/// least a `q` share of the samples at or below it (`q` = 1 is the largest). None when there
/// are no samples.
pub fn nearest_rank<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len().max(1));
    sorted.get(rank - 1).copied()
}

/// Mints a join token for `nodes` joins to `site` and `pool` and starts that many simulated
/// daemons on the servers' gateways, spread evenly over them (each daemon knows every
/// gateway and moves to the next when its own fails, so replicas can fail over). They pin the
/// CA by the fingerprint the token came with. They join and connect in the background:
/// [`bring_up`] waits for them.
pub async fn start_fleet(
    api: &Api,
    servers: &[Server],
    site: &str,
    pool: &str,
    nodes: usize,
    fleet: &FleetArgs,
    log_dir: &Path,
) -> anyhow::Result<BenchFleet> {
    let token = api
        .data(
            "mutation($site: ID!, $pool: ID, $uses: Int, $ttl: Int) { createJoinToken(input: {siteId: $site, poolId: $pool, maxUses: $uses, expiresInSeconds: $ttl, description: \"benchmark\"}) { secret caCertificateSha256 joinToken { id } } }",
            json!({ "site": site, "pool": pool, "uses": nodes, "ttl": JOIN_TOKEN_TTL.as_secs() }),
        )
        .await?;
    let secret = token["createJoinToken"]["secret"]
        .as_str()
        .context("createJoinToken returned no secret")?;
    let pin = token["createJoinToken"]["caCertificateSha256"]
        .as_str()
        .context("createJoinToken returned no CA fingerprint")?;
    let gateways: Vec<String> = servers.iter().map(Server::gateway_url).collect();
    let processes = fleet.processes_for(nodes);
    tracing::info!(nodes, ?gateways, ?processes, "starting the fleet");
    let Some(processes) = processes else {
        let options = fleet.sim_options();
        let inside = Fleet::start(
            &gateways,
            secret,
            CaTrust::Sha256Pin(pin.to_owned()),
            nodes,
            &options,
        )
        .await
        .context("starting the simulated fleet")?;
        return Ok(BenchFleet::Inside(inside));
    };
    let binary = servers.first().context("a server to join")?.bin.clone();
    let spec = SimulatorSpec {
        binary,
        gateways,
        join_secret: secret.to_owned(),
        ca_sha256: pin.to_owned(),
        heartbeat: Some(Duration::from_secs(fleet.heartbeat_secs)),
        join_concurrency: fleet.join_concurrency.div_ceil(processes),
        log_dir: log_dir.to_owned(),
    };
    let children = SimulatorProcesses::start(&spec, nodes, processes)
        .context("starting the simulator processes")?;
    Ok(BenchFleet::Processes(children))
}

/// A benchmark's simulated fleet: inside the benchmark's process, or (for fleets bigger
/// than one process may hold) in simulator child processes.
pub enum BenchFleet {
    Inside(Fleet),
    Processes(SimulatorProcesses),
}

impl BenchFleet {
    pub fn len(&self) -> usize {
        match self {
            BenchFleet::Inside(fleet) => fleet.len(),
            BenchFleet::Processes(children) => children.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn progress(&self) -> Progress {
        match self {
            BenchFleet::Inside(fleet) => fleet.progress(),
            BenchFleet::Processes(children) => children.progress(),
        }
    }

    /// The CPU time the simulator has used so far, in clock ticks: the benchmark's own
    /// process (where the daemons run inside it), and its simulator processes.
    pub fn cpu_ticks(&self) -> anyhow::Result<f64> {
        let own = own_cpu_ticks()?;
        match self {
            BenchFleet::Inside(_) => Ok(own),
            BenchFleet::Processes(children) => Ok(own + children.cpu_ticks()?),
        }
    }

    /// How many simulator processes hold the daemons (none: they run inside the benchmark).
    pub fn processes(&self) -> Option<usize> {
        match self {
            BenchFleet::Inside(_) => None,
            BenchFleet::Processes(children) => Some(children.count()),
        }
    }

    /// An error, with the end of its log, if a simulator process has exited: its daemons are
    /// gone, and its last progress no longer says anything.
    pub fn check(&self) -> anyhow::Result<()> {
        match self {
            BenchFleet::Inside(_) => Ok(()),
            BenchFleet::Processes(children) => children.check(),
        }
    }

    /// The ids of the nodes that joined: the daemons know them when they run inside; the
    /// simulator processes say only how many, so then the API lists `pool`'s nodes.
    pub async fn node_ids(&self, api: &Api, pool: &str) -> anyhow::Result<Vec<String>> {
        match self {
            BenchFleet::Inside(fleet) => Ok(fleet.node_ids()),
            BenchFleet::Processes(_) => api.node_ids_in_pool(pool).await,
        }
    }

    /// The last error of some daemon that gave up, to explain a fleet that cannot join.
    pub fn sample_error(&self) -> Option<String> {
        match self {
            BenchFleet::Inside(fleet) => fleet.sample_error(),
            BenchFleet::Processes(children) => children.sample_error(),
        }
    }

    /// Stops every daemon; the last progress.
    pub async fn shutdown(self) -> Progress {
        match self {
            BenchFleet::Inside(fleet) => fleet.shutdown().await,
            BenchFleet::Processes(children) => children.shutdown().await,
        }
    }
}

/// The servers' CPU time so far, in clock ticks, summed.
pub fn cpu_ticks_of(servers: &[Server]) -> anyhow::Result<f64> {
    servers.iter().map(Server::cpu_ticks).sum()
}

/// How often [`bring_up`] asks the API how many nodes are adopted and schedulable: each ask
/// counts the pool's nodes twice, which is cheap next to acceptance but not free.
const BRING_UP_COUNT_EVERY: Duration = Duration::from_secs(1);
/// The step of the bring-up timeline [`BringUp::rows`] prints.
const BRING_UP_SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// How many of the fleet's nodes had reached each milestone at one moment of the bring-up.
#[derive(Debug, Clone, Copy)]
pub struct BringUpSample {
    /// Since the fleet started.
    pub at: Duration,
    pub joined: u64,
    pub connected: u64,
    pub adopted: u64,
    pub schedulable: u64,
    /// The server's CPU since the previous sample, in % of one core.
    pub server_cpu: f64,
}

/// A fleet's bring-up, from its start until every node is schedulable: when each milestone
/// was reached by the whole fleet, the counts over time, and the server's CPU throughout.
#[derive(Debug, Clone)]
pub struct BringUp {
    pub nodes: u64,
    pub joined: Duration,
    pub connected: Duration,
    pub adopted: Duration,
    pub schedulable: Duration,
    /// The server's CPU from the fleet's start to every node schedulable, in % of one core.
    pub server_cpu: f64,
    /// The events written from the fleet's start until every node was schedulable, once
    /// [`BringUp::count_events`] has counted them. Each event is a row and its index entries
    /// that the database writes and the feed reads back, much of what a bring-up costs.
    pub events: Option<u64>,
    /// When the fleet started, by the wall clock the server's event times use (both run on
    /// this machine): where the span [`BringUp::count_events`] counts begins (inclusive).
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// When every node was seen schedulable, by the same clock: where that span ends
    /// (exclusive), so the window's own events are not counted.
    pub schedulable_at: chrono::DateTime<chrono::Utc>,
    pub timeline: Vec<BringUpSample>,
}

impl BringUp {
    /// Counts the events the bring-up wrote (the event log's `totalCount` between its start
    /// and every node schedulable, counted by the database, so exact whatever the feed has
    /// read or an earlier run left in a reused database); left out if the API does not
    /// answer, a figure of the report not worth failing a long run for. Call it after the
    /// window's memory is measured: the count reads every one of those events, and on
    /// SQLite, whose file the server maps into memory, the pages it reads count in the
    /// server's RSS (peaks 236 and 308 MB higher at 10,000 nodes when it ran before).
    pub async fn count_events(&mut self, api: &Api) {
        let data = api
            .data(
                "query($since: DateTime!, $until: DateTime!) { events(filter: { since: $since, until: $until }, first: 1) { totalCount } }",
                json!({ "since": self.started_at.to_rfc3339(), "until": self.schedulable_at.to_rfc3339() }),
            )
            .await;
        self.events = match data {
            Ok(data) => data["events"]["totalCount"].as_u64(),
            Err(err) => {
                tracing::warn!(error = %err, "could not count the bring-up's events");
                None
            }
        };
    }

    /// The milestones and the timeline, as rows of the results table.
    pub fn rows(&self) -> Vec<Row<'static>> {
        let secs = |d: Duration| d.as_secs_f64();
        let mut rows: Vec<Row<'static>> = vec![
            (
                "bring-up: all joined / connected / adopted / schedulable".into(),
                format!(
                    "{:.1} s / {:.1} s / {:.1} s / {:.1} s",
                    secs(self.joined),
                    secs(self.connected),
                    secs(self.adopted),
                    secs(self.schedulable)
                ),
                "",
            ),
            (
                "bring-up: acceptance rate (adopted / s after all joined)".into(),
                format!(
                    "{:.0} nodes/s",
                    self.nodes as f64 / secs(self.adopted.saturating_sub(self.joined)).max(0.001)
                ),
                "",
            ),
            (
                "bring-up: server CPU".into(),
                format!("{:.1} % of one core", self.server_cpu),
                "2 cores: 200 % is the whole machine (simulator included)",
            ),
            (
                "bring-up: events written".into(),
                self.events.map_or_else(
                    || "n/a (not counted)".to_owned(),
                    |events| {
                        format!(
                            "{events} ({:.1} per node)",
                            events as f64 / self.nodes as f64
                        )
                    },
                ),
                "",
            ),
        ];
        rows.extend(self.timeline.iter().map(|s| {
            (
                format!(
                    "  at {:>5.0} s: joined/connected/adopted/schedulable",
                    secs(s.at)
                ),
                format!(
                    "{}/{}/{}/{}, server {:.0} %",
                    s.joined, s.connected, s.adopted, s.schedulable, s.server_cpu
                ),
                "",
            )
        }));
        rows
    }
}

/// Waits until every node of `fleet` (all in `pool`) is joined, connected, adopted and
/// schedulable, and reports when each happened, from `started`, with the servers' CPU.
pub async fn bring_up(
    api: &Api,
    servers: &[Server],
    fleet: &BenchFleet,
    pool: &str,
    timeout: Duration,
    started: Instant,
) -> anyhow::Result<BringUp> {
    let nodes = fleet.len() as u64;
    let deadline = started + timeout;
    let started_at =
        chrono::Utc::now() - chrono::Duration::from_std(started.elapsed()).unwrap_or_default();
    let clk_tck = clock_ticks_per_second().await;
    let cpu_at_start = cpu_ticks_of(servers)?;
    let mut cpu_at_sample = (started, cpu_at_start);
    let mut milestones: [Option<Duration>; 4] = [None; 4];
    let mut counts = (0, 0);
    let mut next_count = Instant::now();
    let mut next_sample = started + BRING_UP_SAMPLE_EVERY;
    let mut next_report = Instant::now() + PROGRESS_EVERY;
    let mut timeline = Vec::new();
    loop {
        let progress = fleet.progress();
        if Instant::now() >= next_count {
            counts = adopted_and_schedulable(api, pool).await?;
            next_count = Instant::now() + BRING_UP_COUNT_EVERY;
        }
        let reached = [progress.joined, progress.connected, counts.0, counts.1];
        for (milestone, count) in milestones.iter_mut().zip(reached) {
            if milestone.is_none() && count >= nodes {
                *milestone = Some(started.elapsed());
            }
        }
        let now = Instant::now();
        if now >= next_sample || milestones[3].is_some() {
            let cpu = cpu_ticks_of(servers)?;
            timeline.push(BringUpSample {
                at: now.duration_since(started),
                joined: reached[0],
                connected: reached[1],
                adopted: reached[2],
                schedulable: reached[3],
                server_cpu: share_of_a_core(
                    cpu - cpu_at_sample.1,
                    clk_tck,
                    now.duration_since(cpu_at_sample.0),
                ),
            });
            cpu_at_sample = (now, cpu);
            next_sample += BRING_UP_SAMPLE_EVERY;
        }
        if let [
            Some(joined),
            Some(connected),
            Some(adopted),
            Some(schedulable),
        ] = milestones
        {
            let cpu = cpu_ticks_of(servers)?;
            tracing::info!(?schedulable, "every node is schedulable");
            return Ok(BringUp {
                nodes,
                joined,
                connected,
                adopted,
                schedulable,
                server_cpu: share_of_a_core(cpu - cpu_at_start, clk_tck, started.elapsed()),
                events: None,
                started_at,
                schedulable_at: chrono::Utc::now(),
                timeline,
            });
        }
        ensure!(
            progress.failed == 0,
            "{} daemons gave up, e.g. {}",
            progress.failed,
            fleet.sample_error().unwrap_or_default()
        );
        ensure!(
            !servers.iter().any(Server::exited),
            "a server exited; its log ends with:\n{}",
            servers
                .iter()
                .find(|s| s.exited())
                .map(Server::log_tail)
                .unwrap_or_default()
        );
        fleet.check()?;
        ensure!(
            now < deadline,
            "the fleet was not schedulable within {timeout:?}: {progress}, {} adopted, {} schedulable",
            counts.0,
            counts.1
        );
        if now >= next_report {
            tracing::info!(
                %progress,
                adopted = counts.0,
                schedulable = counts.1,
                elapsed = ?started.elapsed(),
                "fleet coming up"
            );
            next_report += PROGRESS_EVERY;
        }
        tokio::time::sleep(FLEET_POLL_INTERVAL).await;
    }
}

/// How many nodes of `pool` are adopted, and how many schedulable.
pub async fn adopted_and_schedulable(api: &Api, pool: &str) -> anyhow::Result<(u64, u64)> {
    let data = api
        .data(
            "query($pool: ID!) { adopted: nodes(first: 1, filter: {poolId: [$pool], provisionState: [ADOPTED]}) { totalCount } schedulable: nodes(first: 1, filter: {poolId: [$pool], schedulable: true}) { totalCount } }",
            json!({ "pool": pool }),
        )
        .await?;
    let count = |alias: &str| {
        data[alias]["totalCount"]
            .as_u64()
            .with_context(|| format!("nodes ({alias}) returned no totalCount"))
    };
    Ok((count("adopted")?, count("schedulable")?))
}

/// Latency samples of one operation.
#[derive(Debug, Default)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    pub fn push(&mut self, took: Duration) {
        self.0.push(took);
    }

    /// How many samples there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds another's samples.
    pub fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    /// The `q` quantile (nearest rank).
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let mut sorted = self.0.clone();
        sorted.sort_unstable();
        nearest_rank(&sorted, q)
    }

    /// "p50 / p99 (n samples)", or "no samples".
    pub fn describe(&self) -> String {
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

/// A duration in milliseconds, two decimals.
pub fn millis(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// One line of the results table: the measure, its result, and the raw limit on this
/// machine kind it compares with (empty if none).
pub type Row<'a> = (String, String, &'a str);

/// Writes the results table: a heading, a separator as wide as the heading, and the rows,
/// each column as wide as its widest cell.
pub fn write_table(out: &mut impl Write, rows: &[Row<'_>]) -> std::io::Result<()> {
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
    let value_width = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
    writeln!(
        out,
        "{:width$}{COLUMN_GAP}{:value_width$}{COLUMN_GAP}{LIMIT_HEADING}",
        "measure", "result"
    )?;
    writeln!(
        out,
        "{}",
        "-".repeat(width + value_width + 2 * COLUMN_GAP.len() + LIMIT_HEADING.len())
    )?;
    for (name, value, limit) in rows {
        writeln!(
            out,
            "{name:width$}{COLUMN_GAP}{value:value_width$}{COLUMN_GAP}{limit}"
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_quantiles_are_nearest_rank() {
        let mut latencies = Latencies::default();
        for ms in 1..=100 {
            latencies.push(Duration::from_millis(ms));
        }
        assert_eq!(latencies.quantile(0.5), Some(Duration::from_millis(50)));
        assert_eq!(latencies.quantile(0.99), Some(Duration::from_millis(99)));
        assert_eq!(Latencies::default().quantile(0.5), None);
    }

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

    #[tokio::test]
    async fn a_given_database_must_be_local_and_alone() {
        let local = BenchDatabase::prepare(false, Some("postgres://u@localhost/x"))
            .await
            .expect("a local database");
        assert_eq!(local.url(), Some("postgres://u@localhost/x"));
        assert_eq!(local.description(), "the given database");
        assert!(
            BenchDatabase::prepare(false, Some("postgres://u@10.0.0.5/x"))
                .await
                .is_err()
        );
        assert!(
            BenchDatabase::prepare(true, Some("postgres://u@localhost/x"))
                .await
                .is_err()
        );
        let sqlite = BenchDatabase::prepare(false, None)
            .await
            .expect("the server's own file");
        assert_eq!(sqlite.url(), None);
        assert_eq!(sqlite.description(), "SQLite (fresh file)");
    }

    #[test]
    fn metrics_are_summed_over_labels() {
        let metrics = Metrics::parse("# TYPE a counter\na{x=\"1\"} 2\na{x=\"2\"} 3\nb 7\n");
        assert_eq!(metrics.get("a"), Some(5.0));
        assert_eq!(metrics.get("b"), Some(7.0));
        assert_eq!(metrics.get("c"), None);
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
        assert!(own_cpu_ticks().expect("our own ticks") >= 0.0);
    }

    #[test]
    fn statements_are_ranked_by_their_time_since_a_reading() {
        let before = Metrics::parse(concat!(
            "bc_db_statement_seconds_sum{statement=\"select nodes\"} 1.5\n",
            "bc_db_statement_seconds_count{statement=\"select nodes\"} 10\n",
            "bc_db_statement_seconds_sum{statement=\"update node_sessions\"} 4\n",
            "bc_db_statement_seconds_count{statement=\"update node_sessions\"} 40\n",
        ));
        let after = |sessions: &str| {
            Metrics::parse(&format!(
                "bc_db_statement_seconds_sum{{statement=\"select nodes\"}} 2.5\n\
                 bc_db_statement_seconds_count{{statement=\"select nodes\"}} 30\n\
                 bc_db_statement_seconds_sum{{statement=\"update node_sessions\"}} {sessions}\n\
                 bc_db_statement_seconds_count{{statement=\"update node_sessions\"}} 45\n\
                 bc_db_statement_seconds_sum{{statement=\"insert events\"}} 0.5\n\
                 bc_db_statement_seconds_count{{statement=\"insert events\"}} 5\n"
            ))
        };
        // Two replicas read as one: each series summed.
        let two = Metrics::sum([after("6"), after("6")]);
        let ranked = two.statements_since(&before, 2);
        let kinds: Vec<(&str, f64, f64)> = ranked
            .iter()
            .map(|t| (t.kind.as_str(), t.seconds, t.statements))
            .collect();
        assert_eq!(
            kinds,
            [
                ("update node_sessions", 8.0, 50.0),
                ("select nodes", 3.5, 50.0)
            ]
        );
        assert_eq!(two.get("bc_db_statement_seconds_count"), Some(160.0));
        // A kind that took no time since is left out.
        assert!(
            after("4")
                .statements_since(&before, 5)
                .iter()
                .all(|t| t.kind != "update node_sessions")
        );
    }

    #[test]
    fn the_machine_is_busy_in_all_but_idle_io_wait_and_steal() {
        let stat = "cpu  100 2 30 5000 40 6 7 8 0 0\ncpu0 50 1 15 2500 20 3 3 4 0 0\n";
        assert_eq!(busy_ticks(stat).expect("ticks"), 145.0);
        assert!(busy_ticks("cpu  1 2 3\n").is_err());
        assert!(busy_ticks("intr 5\n").is_err());
        assert!(machine_busy_ticks().expect("this machine's ticks") > 0.0);
    }

    #[test]
    fn memory_is_read_from_the_status_lines() {
        let status = "Name:\tbetter-compute\nVmHWM:\t   66560 kB\nVmRSS:\t   65000 kB\n";
        assert_eq!(
            parse_memory(status),
            Memory {
                rss_kb: 65_000,
                peak_rss_kb: 66_560
            }
        );
        assert_eq!(
            parse_memory("Name:\tkthreadd\n"),
            Memory {
                rss_kb: 0,
                peak_rss_kb: 0
            }
        );
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let samples: Vec<u32> = (1..=100).collect();
        assert_eq!(nearest_rank(&samples, 0.5), Some(50));
        assert_eq!(nearest_rank(&samples, 0.99), Some(99));
        assert_eq!(nearest_rank(&samples, 1.0), Some(100));
        assert_eq!(nearest_rank(&samples, 0.0), Some(1));
        assert_eq!(nearest_rank(&[7], 0.99), Some(7));
        assert_eq!(nearest_rank::<u32>(&[], 0.5), None);
    }

    #[test]
    fn the_table_aligns_its_columns_under_a_separator_as_wide_as_the_heading() {
        let rows: Vec<Row<'_>> = vec![
            ("joins".into(), "391 joins/s".into(), "7k writes/s"),
            ("all connected after".into(), "1.1 s".into(), ""),
        ];
        let mut out = Vec::new();
        write_table(&mut out, &rows).expect("written");
        let text = String::from_utf8(out).expect("UTF-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            format!("measure              result       {LIMIT_HEADING}")
        );
        assert_eq!(lines[1].len(), lines[0].len());
        assert!(lines[1].chars().all(|c| c == '-'));
        assert_eq!(lines[2], "joins                391 joins/s  7k writes/s");
        assert_eq!(lines[3], "all connected after  1.1 s        ");
        assert_eq!(lines.len(), 4);
    }
}
