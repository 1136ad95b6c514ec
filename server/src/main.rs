//! `better-compute`: the control plane binary.

use anyhow::Context;
use bc_core::clock::SystemClock;
use bc_core::ids::TenantId;
use better_compute::auth::{Role, TokenKeys};
use better_compute::config::Config;
use better_compute::{app, graphql, telemetry};
use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

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
    /// Runs the server on the embedded default and prints its URL and an admin token.
    Dev {
        /// How long the printed admin token lives, in hours.
        #[arg(long, default_value_t = 12)]
        token_hours: i64,
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
    let cli = Cli::parse();
    let config = Config::load(cli.config.as_deref())?;
    match cli.command {
        Command::Serve => {
            telemetry::init_logging(&config.log);
            serve(&config, None).await
        }
        Command::Dev { token_hours } => {
            telemetry::init_logging(&config.log);
            serve(&config, Some(token_hours)).await
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

async fn serve(config: &Config, dev_token_hours: Option<i64>) -> anyhow::Result<()> {
    let server = app::start(config, Arc::new(SystemClock)).await?;
    if let Some(hours) = dev_token_hours {
        let token = server.keys.mint(
            "dev-admin",
            &[Role::Admin],
            None,
            chrono::Duration::hours(hours),
            chrono::Utc::now(),
        )?;
        let mut out = std::io::stdout();
        writeln!(out, "\nBetter Compute is running.")?;
        writeln!(
            out,
            "  GraphQL (GraphiQL in a browser): {}/graphql",
            server.url()
        )?;
        writeln!(
            out,
            "  Admin token ({hours} h), send as `Authorization: Bearer <token>`:\n  {token}\n"
        )?;
    }
    tokio::select! {
        () = app::shutdown_signal() => {
            tracing::info!("shutting down: finishing requests in flight");
            server.shutdown().await
        }
    }
}
