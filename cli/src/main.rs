//! `better-compute`: the control plane binary.

use anyhow::Context;
use bc_core::axes::{PoolKind, SiteKind};
use bc_core::catalog::HardwareProfile;
use bc_core::clock::SystemClock;
use bc_core::ids::{PoolId, SiteId, TenantId};
use bc_testing::metal::ensure_metal_pool;
use bc_testing::sim::{DEFAULT_JOIN_CONCURRENCY, MIXED_FAULT_AFTER};
use bc_testing::workload::WORKLOAD_TENANT;
use bc_testing::{
    CaTrust, DaemonKnobs, GatewayContext, MetalFleet, MetalOptions, MetalPlace, MetalProgress,
    Progress, SimOptions, WorkloadOptions, run_sim, run_workload,
};
use better_compute::app::{self, RunningServer};
use better_compute::auth::{Principal, Role, TokenKeys};
use better_compute::config::Config;
use better_compute::service::NodeFilter;
use better_compute::service::catalog::NewPool;
use better_compute::service::join::NewJoinToken;
use better_compute::{graphql, telemetry};
use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// mimalloc instead of the system's allocator: profiling a 10,000-node bring-up found glibc's
/// `malloc`, `free` and their consolidation at about a fifth of the server's CPU (the database
/// driver allocates per row and per statement, across threads), where mimalloc's per-thread
/// free lists cost a fraction of that. Without the default `mimalloc` feature the system's
/// allocator is used, so that `heaptrack` can see every allocation (README, "Profiling").
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "better-compute",
    version,
    about = "The Better Compute GPU fleet control plane"
)]
struct Cli {
    /// A TOML configuration file; `BC_…` environment variables override it.
    #[arg(long, global = true, env = "BC_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the server.
    Serve,
    /// Runs the server on the embedded default, prints its URL and an admin token, and
    /// optionally a simulated fleet that joins it.
    Dev {
        /// Simulated nodes (FakeDaemons) that join and connect.
        #[arg(long, default_value_t = 0)]
        sim: usize,
        /// GPUs each simulated node reports (the dev pool expects 8).
        #[arg(long, default_value_t = 8)]
        sim_gpus: u32,
        /// Give the fleet a realistic mix: failing diagnostics, missing GPUs, and GPUs that
        /// fail in service (45 s after start) which health remediation fixes (a reset, a
        /// reboot) or gives up on (maintenance, GpuNeedsPerson).
        #[arg(long)]
        sim_mixed: bool,
        /// With --sim-mixed: how many seconds after start the GPUs fail in service.
        #[arg(long, value_name = "SECONDS", default_value_t = MIXED_FAULT_AFTER.as_secs(), requires = "sim_mixed")]
        sim_faults_after: u64,
        /// How long the printed admin token lives, in hours.
        #[arg(long, default_value_t = 12)]
        token_hours: i64,
        /// Put the simulated fleet to work: create R reservations a second in its pool (1 to
        /// 8 GPUs, some 2-node gangs), each released after 2 to 60 seconds, and print a
        /// summary every 10 s.
        #[arg(long, value_name = "R", requires = "sim")]
        workload: Option<f64>,
        /// Simulated bare-metal machines behind simulated Redfish BMCs: enrolled by their
        /// BMCs into the `dev-metal` pool, then inspected and commissioned to `ready` by
        /// the Workflow and Power controllers. Independent of --sim.
        #[arg(long, value_name = "N", default_value_t = 0)]
        sim_metal: usize,
    },
    /// Points simulated nodes at a running server's gateway.
    Sim {
        /// The gateway URL, e.g. https://127.0.0.1:8443. Repeat it for the gateways of several
        /// replicas: the nodes are spread over them and move to the next when theirs fails.
        #[arg(long, required = true)]
        server: Vec<String>,
        /// A join token secret (`createJoinToken`'s `secret`) admitting at least `--nodes` joins.
        #[arg(long)]
        token: String,
        #[arg(long, default_value_t = 10)]
        nodes: usize,
        /// The CA certificate to trust (PEM file).
        #[arg(long, conflicts_with = "ca_sha256")]
        ca_file: Option<PathBuf>,
        /// The CA's SHA-256 fingerprint to pin (`createJoinToken`'s `caCertificateSha256`).
        #[arg(long)]
        ca_sha256: Option<String>,
        /// GPUs each simulated node reports.
        #[arg(long, default_value_t = 8)]
        gpus: u32,
        /// Give the fleet a realistic mix: failing diagnostics, missing GPUs, and GPUs that
        /// fail in service (45 s after start) which health remediation fixes (a reset, a
        /// reboot) or gives up on (maintenance, GpuNeedsPerson).
        #[arg(long)]
        mixed: bool,
        /// With --mixed: how many seconds after start the GPUs fail in service.
        #[arg(long, value_name = "SECONDS", default_value_t = MIXED_FAULT_AFTER.as_secs(), requires = "mixed")]
        faults_after: u64,
        /// Hostnames are `<prefix><index, 5 digits>`; by default `sim-<4 hex digits of the
        /// fleet's random seed>-`. Several simulators on one control plane need distinct ones.
        #[arg(long)]
        hostname_prefix: Option<String>,
        /// Heartbeat every this many seconds instead of at the interval the server asks for.
        #[arg(long, value_name = "SECONDS")]
        heartbeat_secs: Option<u64>,
        /// Joins in flight at once, and (apart) session handshakes in flight at once.
        #[arg(long, default_value_t = DEFAULT_JOIN_CONCURRENCY)]
        join_concurrency: usize,
        /// Print the progress as one JSON object per line (`Progress`, camelCase), every
        /// half second, for a program that reads it (fleet-bench runs its biggest fleets as
        /// several `sim` processes), instead of a line of text every 2 s.
        #[arg(long)]
        progress_json: bool,
    },
    /// Mints a token signed with the configured secret.
    Token {
        #[arg(long)]
        subject: String,
        /// admin, operator or viewer.
        #[arg(long, default_value = "viewer")]
        role: Role,
        /// Scope the token to one tenant (`ten_…`).
        #[arg(long)]
        tenant: Option<String>,
        /// Lifetime in hours.
        #[arg(long, default_value_t = 1)]
        hours: i64,
    },
    /// Prints the GraphQL schema (SDL), which `schema.graphql` must equal.
    Schema,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    let config = Config::load(cli.config.as_deref())?;
    match cli.command {
        Command::Serve => {
            start_logging(&config);
            let server = app::start(&config, Arc::new(SystemClock)).await?;
            app::shutdown_signal().await;
            tracing::info!("shutting down: finishing requests in flight");
            server.shutdown().await
        }
        Command::Dev {
            sim,
            sim_gpus,
            sim_mixed,
            sim_faults_after,
            token_hours,
            workload,
            sim_metal,
        } => {
            start_logging(&config);
            let workload = workload
                .map(|rate| WorkloadOptions::new(rate, sim_gpus))
                .transpose()
                .context("--workload")?;
            let options = sim_options(sim_gpus, sim_mixed, Duration::from_secs(sim_faults_after));
            dev(&config, sim, options, sim_metal, token_hours, workload).await
        }
        Command::Sim {
            server,
            token,
            nodes,
            ca_file,
            ca_sha256,
            gpus,
            mixed,
            faults_after,
            hostname_prefix,
            heartbeat_secs,
            join_concurrency,
            progress_json,
        } => {
            start_logging(&config);
            let ca = match (ca_file, ca_sha256) {
                (Some(file), _) => CaTrust::Pem(
                    std::fs::read_to_string(&file)
                        .with_context(|| format!("reading {}", file.display()))?,
                ),
                (None, Some(pin)) => CaTrust::Sha256Pin(pin),
                (None, None) => CaTrust::TrustOnFirstUse,
            };
            let mut options = sim_options(gpus, mixed, Duration::from_secs(faults_after));
            options.hostname_prefix = hostname_prefix;
            options.knobs.heartbeat_interval_override = heartbeat_secs.map(Duration::from_secs);
            options.join_concurrency = join_concurrency;
            let report: fn(Progress) = if progress_json {
                options.report_every = JSON_PROGRESS_EVERY;
                print_progress_json
            } else {
                print_progress
            };
            let progress = run_sim(
                &server,
                &token,
                ca,
                nodes,
                options,
                report,
                app::shutdown_signal(),
            )
            .await?;
            if !progress_json {
                writeln!(std::io::stdout(), "stopped: {progress}")?;
            }
            Ok(())
        }
        Command::Token {
            subject,
            role,
            tenant,
            hours,
        } => {
            let keys = TokenKeys::new(&config.jwt_secret()?, &config.auth.audience)?;
            let tenant = tenant
                .as_deref()
                .map(TenantId::parse)
                .transpose()
                .context("--tenant")?;
            let token = keys.mint(
                &subject,
                &[role],
                tenant.as_ref(),
                chrono::Duration::hours(hours),
                chrono::Utc::now(),
            )?;
            writeln!(std::io::stdout(), "{token}")?;
            Ok(())
        }
        Command::Schema => {
            write!(std::io::stdout(), "{}", graphql::sdl())?;
            Ok(())
        }
    }
}

/// Logging first, so that a failure to raise the open-file limit is reported, then the limit.
fn start_logging(config: &Config) {
    telemetry::init_logging(&config.log);
    raise_open_file_limit();
}

/// Every daemon session is a socket, and `dev --sim` holds both ends of each in one process:
/// the default soft limit of open files (often 1,024) is far too low for a fleet, so it is
/// raised to the hard limit the system allows.
fn raise_open_file_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::debug!(limit, "open file limit"),
        Err(err) => tracing::warn!(error = %err, "could not raise the open file limit"),
    }
}

/// The fleet `dev --sim` and `sim` start: `mixed` fails GPUs in service `faults_after` start.
fn sim_options(gpus: u32, mixed: bool, faults_after: Duration) -> SimOptions {
    let mut options = if mixed {
        SimOptions::mixed_failing_after(faults_after)
    } else {
        SimOptions::default()
    };
    options.knobs.gpu_count = gpus;
    options
}

fn print_progress(progress: Progress) {
    let _ = writeln!(std::io::stdout(), "  {progress}");
}

/// How often `sim --progress-json` prints: a program reading it times the fleet's milestones
/// by these lines, so they come often enough not to blur them.
const JSON_PROGRESS_EVERY: Duration = Duration::from_millis(500);

fn print_progress_json(progress: Progress) {
    // Progress is plain counters: serialising it cannot fail.
    if let Ok(line) = serde_json::to_string(&progress) {
        let _ = writeln!(std::io::stdout(), "{line}");
    }
}

/// How often `dev --sim` prints the fleet's progress.
const DEV_PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// The seed of `dev --sim`'s machines.
const DEV_FLEET_SEED: u64 = 0x00bc_de00;
/// The names of what `dev --sim` creates (once; later runs reuse them).
const DEV_SITE: &str = "dev";
const DEV_POOL: &str = "dev-gpu";
/// The bare-metal pool of `dev --sim-metal` (power through Redfish), in the dev site.
const DEV_METAL_POOL: &str = "dev-metal";
/// The seed of `dev --sim-metal`'s machines: the same machines every run.
const DEV_METAL_SEED: u64 = 0x00bc_3e7a;
/// Where, in the data directory, the simulated BMCs keep their port, CA and machines' power.
const DEV_METAL_STATE_FILE: &str = "sim-metal-bmcs.json";

async fn dev(
    config: &Config,
    sim: usize,
    mut options: SimOptions,
    sim_metal: usize,
    token_hours: i64,
    workload: Option<WorkloadOptions>,
) -> anyhow::Result<()> {
    let server = app::start(config, Arc::new(SystemClock)).await?;
    let now = chrono::Utc::now();
    let token = server.keys.mint(
        "dev-admin",
        &[Role::Admin],
        None,
        chrono::Duration::hours(token_hours),
        now,
    )?;
    let mut out = std::io::stdout();
    writeln!(out, "\nBetter Compute is running.")?;
    // The token travels in the URL fragment, which browsers never send: it stays out of
    // request lines and so out of the server's and any proxy's logs. The dashboard reads it
    // from there and signs in with it.
    writeln!(
        out,
        "  Dashboard (signs in):           {}/#token={token}",
        server.url()
    )?;
    writeln!(
        out,
        "  GraphiQL (signs in):            {}/graphql#token={token}",
        server.url()
    )?;
    if let Some(gateway) = server.gateway_url() {
        writeln!(out, "  Gateway for daemons:            {gateway}")?;
    }
    writeln!(
        out,
        "  Admin token ({token_hours} h), send as `Authorization: Bearer <token>`:\n  {token}\n"
    )?;

    if sim == 0 && sim_metal == 0 {
        app::shutdown_signal().await;
        return server.shutdown().await;
    }
    // The bare-metal machines start first (enrolment is quick) and report on a task of their
    // own, beside the simulated fleet's.
    let metal = match sim_metal {
        0 => None,
        machines => Some(start_dev_metal(&server, config, machines, options.knobs.clone()).await?),
    };
    let result = if sim > 0 {
        run_dev_sim(&server, sim, &mut options, workload).await
    } else {
        app::shutdown_signal().await;
        Ok(())
    };
    tracing::info!("shutting down");
    if let Some(metal) = metal {
        // It stops on the same signal and powers its machines' daemons down.
        if let Err(err) = metal.await {
            tracing::warn!(error = %err, "the simulated bare-metal fleet did not stop cleanly");
        }
    }
    server.shutdown().await?;
    result
}

/// `dev --sim N [--workload R]`: the simulated fleet joins, and the workload runs, until the
/// shutdown signal.
async fn run_dev_sim(
    server: &RunningServer,
    sim: usize,
    options: &mut SimOptions,
    workload: Option<WorkloadOptions>,
) -> anyhow::Result<()> {
    let mut out = std::io::stdout();
    let (pool, secret) = dev_join_token(server, sim, options.knobs.gpu_count).await?;
    let gateway = server.gateway_url().context("the server runs no gateway")?;
    let ca = CaTrust::Pem(server.services.ca.cert_pem().to_owned());
    options.report_every = DEV_PROGRESS_EVERY;
    // The same machines every run: a restarted `dev --sim` re-joins them in place (same
    // hardware keys) instead of adding a second fleet to the embedded database.
    options.seed = Some(DEV_FLEET_SEED);
    writeln!(
        out,
        "Starting {sim} simulated nodes (joined / connected / schedulable):"
    )?;
    let services = server.services.clone();
    let admin = dev_principal(chrono::Utc::now());
    let last_line = Arc::new(std::sync::Mutex::new(String::new()));
    let report = move |progress: Progress| {
        let services = services.clone();
        let admin = admin.clone();
        let last_line = last_line.clone();
        // Counting schedulable nodes needs the database; do it off the reporting callback.
        tokio::spawn(async move {
            let filter = NodeFilter {
                schedulable: Some(true),
                ..NodeFilter::default()
            };
            let schedulable = services.count_nodes(&admin, filter).await.unwrap_or(0);
            print_when_changed(
                &last_line,
                format!(
                    "  {}/{} joined, {}/{} connected, {schedulable}/{} schedulable, {} errors",
                    progress.joined,
                    progress.nodes,
                    progress.connected,
                    progress.nodes,
                    progress.nodes,
                    progress.errors
                ),
            );
        });
    };
    let workload = workload.map(|options| {
        writeln!(
            out,
            "Workload: reservations at {}/s in pool {pool}, as tenant `{WORKLOAD_TENANT}`:",
            options.rate
        )
        .ok();
        tokio::spawn(run_workload(
            server.services.clone(),
            pool,
            options,
            |report| {
                let _ = writeln!(std::io::stdout(), "  {report}");
            },
            app::shutdown_signal(),
        ))
    });
    let result = run_sim(
        std::slice::from_ref(&gateway),
        &secret,
        ca,
        sim,
        options.clone(),
        report,
        app::shutdown_signal(),
    )
    .await;
    if let Some(workload) = workload {
        // It stops on the same signal; what it left running ends at its expiry.
        workload.abort();
    }
    result.map(|_| ()).map_err(Into::into)
}

/// Prints `line` unless it is the line printed last: a steady fleet stays quiet.
fn print_when_changed(last: &std::sync::Mutex<String>, line: String) {
    let mut last = last
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if *last != line {
        let _ = writeln!(std::io::stdout(), "{line}");
        *last = line;
    }
}

/// `dev --sim-metal N`: the `dev-metal` pool (created on the first run), a join token for
/// the machines' daemons, and the machines: their simulated BMCs (whose port, CA and power
/// the data directory keeps, so a later run answers where the first enrolled them), their
/// enrolment by BMC (the machines a previous run enrolled are kept), and the inspection of
/// each new one. Returns the task that reports their progress until the shutdown signal.
async fn start_dev_metal(
    server: &RunningServer,
    config: &Config,
    machines: usize,
    knobs: DaemonKnobs,
) -> anyhow::Result<tokio::task::JoinHandle<MetalProgress>> {
    let services = server.services.clone();
    let admin = dev_principal(chrono::Utc::now());
    let site = dev_site(server).await?;
    let pool = ensure_metal_pool(&services, &admin, &site, DEV_METAL_POOL, knobs.gpu_count).await?;
    let place = MetalPlace {
        principal: admin,
        site,
        pool,
    };
    let secret = place
        .join_token(
            &services,
            &format!("better-compute dev --sim-metal {machines}"),
        )
        .await?;
    let gateway = server.gateway_url().context("the server runs no gateway")?;
    let ca = CaTrust::Pem(server.services.ca.cert_pem().to_owned());
    let context = Arc::new(GatewayContext::resolve(&gateway, &ca).await?);
    writeln!(
        std::io::stdout(),
        "Starting {machines} simulated bare-metal machines behind Redfish BMCs, in pool `{DEV_METAL_POOL}` (enrolled / inspecting / commissioning / ready / failed):"
    )?;
    let options = MetalOptions {
        machines,
        seed: DEV_METAL_SEED,
        knobs,
        state_file: Some(config.data_dir.join(DEV_METAL_STATE_FILE)),
    };
    let fleet = MetalFleet::start(services, place, context, secret, &options).await?;
    let last_line = std::sync::Mutex::new(String::new());
    Ok(tokio::spawn(fleet.run_until(
        DEV_PROGRESS_EVERY,
        move |progress| print_when_changed(&last_line, format!("  metal: {progress}")),
        app::shutdown_signal(),
    )))
}

/// The principal `dev` acts as when it sets up the simulated fleet's site, pool and token.
fn dev_principal(now: chrono::DateTime<chrono::Utc>) -> Principal {
    Principal {
        subject: "dev-admin".to_owned(),
        role: Role::Admin,
        tenant: None,
        expires_at: now + chrono::Duration::days(1),
    }
}

/// The dev site (created on the first run).
async fn dev_site(server: &RunningServer) -> anyhow::Result<SiteId> {
    let services = &server.services;
    let admin = dev_principal(chrono::Utc::now());
    Ok(match services.site_named(&admin, DEV_SITE).await? {
        Some(site) => site.id,
        None => {
            services
                .create_site(&admin, DEV_SITE, SiteKind::Platform, None)
                .await?
                .id
        }
    })
}

/// The dev site and pool (created on the first run) and a fresh join token for `nodes` joins:
/// the pool and the token's secret.
async fn dev_join_token(
    server: &RunningServer,
    nodes: usize,
    gpus: u32,
) -> anyhow::Result<(PoolId, String)> {
    let services = &server.services;
    let admin = dev_principal(chrono::Utc::now());
    let site = dev_site(server).await?;
    let pool = match services.pool_named(&admin, &site, DEV_POOL).await? {
        Some(pool) => pool,
        None => {
            services
                .create_pool(
                    &admin,
                    NewPool {
                        site_id: site.clone(),
                        name: DEV_POOL.to_owned(),
                        kind: PoolKind::MetalHost,
                        agent: bc_core::axes::PoolAgent::Bcd,
                        owner_tenant_id: None,
                        hardware_profile: HardwareProfile {
                            gpu_count: Some(gpus),
                            ..HardwareProfile::default()
                        },
                        drivers: Default::default(),
                        remediation: None,
                        acceptance: None,
                    },
                )
                .await?
        }
    };
    let (_, secret) = services
        .create_join_token(
            &admin,
            NewJoinToken {
                site_id: site,
                pool_id: Some(pool.id.clone()),
                lifetime: None,
                max_uses: Some(i64::try_from(nodes).unwrap_or(i64::MAX)),
                description: format!("better-compute dev --sim {nodes}"),
            },
        )
        .await?;
    Ok((pool.id, secret))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn dev_workload(args: &[&str]) -> Result<Option<f64>, clap::Error> {
        let cli = Cli::try_parse_from(args)?;
        match cli.command {
            Command::Dev { workload, .. } => Ok(workload),
            _ => panic!("not the dev command"),
        }
    }

    fn dev_fleets(args: &[&str]) -> Result<(usize, usize), clap::Error> {
        match Cli::try_parse_from(args)?.command {
            Command::Dev { sim, sim_metal, .. } => Ok((sim, sim_metal)),
            _ => panic!("not the dev command"),
        }
    }

    #[test]
    fn dev_takes_simulated_bare_metal_with_or_without_a_simulated_fleet() {
        assert_eq!(
            dev_fleets(&["better-compute", "dev", "--sim-metal", "3"]).expect("parses"),
            (0, 3)
        );
        assert_eq!(
            dev_fleets(&["better-compute", "dev", "--sim", "20", "--sim-metal", "2"])
                .expect("parses"),
            (20, 2)
        );
        assert_eq!(
            dev_fleets(&["better-compute", "dev", "--sim", "5"]).expect("parses"),
            (5, 0)
        );
        assert!(dev_fleets(&["better-compute", "dev", "--sim-metal", "-1"]).is_err());
    }

    #[test]
    fn dev_takes_a_workload_rate_for_its_simulated_fleet() {
        let rate = dev_workload(&["better-compute", "dev", "--sim", "20", "--workload", "2.5"])
            .expect("parses");
        assert_eq!(rate, Some(2.5));
        assert_eq!(
            dev_workload(&["better-compute", "dev", "--sim", "20"]).expect("parses"),
            None
        );
        // A workload needs a fleet to work on.
        let alone = dev_workload(&["better-compute", "dev", "--workload", "2"])
            .expect_err("--workload without --sim");
        assert_eq!(
            alone.kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
        assert!(
            dev_workload(&["better-compute", "dev", "--sim", "2", "--workload", "fast"]).is_err()
        );
        // Rates outside (0, MAX_RATE] are refused before anything starts.
        for bad in [0.0, -1.0, f64::NAN, 1e9] {
            assert!(WorkloadOptions::new(bad, 8).is_err(), "{bad}");
        }
    }
}
