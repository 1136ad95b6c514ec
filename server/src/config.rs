//! Configuration: built-in defaults, then an optional TOML file, then `BC_…` environment
//! variables (nested keys with `__`, e.g. `BC_AUTH__AUDIENCE`), then `DATABASE_URL`.
//! Every field and its default is listed in README.md's configuration table.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where the API (GraphQL, dashboard, health, metrics) listens.
    pub listen: SocketAddr,
    /// Where the embedded database, the JWT secret and (later) the CA live.
    pub data_dir: PathBuf,
    /// `sqlite://…` or `postgres://…`. Unset: a SQLite file in `data_dir`.
    pub database_url: Option<String>,
    pub database: DatabaseConfig,
    pub auth: AuthConfig,
    pub graphql: GraphqlConfig,
    pub log: LogConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Connections in the pool (PostgreSQL). SQLite writes are funnelled through one lock
    /// whatever this says; see ARCHITECTURE.md.
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before failing.
    pub acquire_timeout_secs: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// The HS256 secret (at least 32 bytes). Unset: generated once and kept in
    /// `data_dir/jwt-secret`.
    pub jwt_secret: Option<String>,
    /// The `aud` claim every token must carry.
    pub audience: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GraphqlConfig {
    /// Deepest query accepted.
    pub max_depth: usize,
    /// Highest complexity accepted (each field costs 1, a list field multiplies by `first`).
    pub max_complexity: usize,
    /// Page size when a connection is asked without `first`.
    pub default_page_size: u64,
    /// Largest `first` accepted.
    pub max_page_size: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
    /// A `tracing` filter such as `info,better_compute=debug`; `RUST_LOG` wins when set.
    pub filter: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            data_dir: PathBuf::from("data"),
            database_url: None,
            database: DatabaseConfig::default(),
            auth: AuthConfig::default(),
            graphql: GraphqlConfig::default(),
            log: LogConfig::default(),
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            max_connections: 16,
            acquire_timeout_secs: 10,
        }
    }
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig {
            jwt_secret: None,
            audience: "better-compute".to_owned(),
        }
    }
}

impl Default for GraphqlConfig {
    fn default() -> Self {
        GraphqlConfig {
            max_depth: 12,
            max_complexity: 20_000,
            default_page_size: 100,
            max_page_size: 1_000,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            filter: "info".to_owned(),
        }
    }
}

impl Config {
    /// Defaults, then `file` (if given), then the environment.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Config> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(file) = file {
            anyhow::ensure!(
                file.exists(),
                "the configuration file {} does not exist",
                file.display()
            );
            figment = figment.merge(Toml::file(file));
        }
        figment = figment.merge(Env::prefixed("BC_").split("__")).merge(
            Env::raw()
                .only(&["DATABASE_URL"])
                .map(|_| "database_url".into()),
        );
        Ok(figment.extract()?)
    }

    /// The database to use: `database_url`, or the embedded SQLite file.
    pub fn database_url(&self) -> String {
        match &self.database_url {
            Some(url) => url.clone(),
            None => format!(
                "sqlite://{}?mode=rwc",
                self.data_dir.join("better-compute.db").display()
            ),
        }
    }

    /// The JWT secret: configured, or generated once and kept in `data_dir/jwt-secret`.
    pub fn jwt_secret(&self) -> anyhow::Result<Vec<u8>> {
        if let Some(secret) = &self.auth.jwt_secret {
            return Ok(secret.as_bytes().to_vec());
        }
        let path = self.data_dir.join("jwt-secret");
        if path.exists() {
            return Ok(std::fs::read_to_string(&path)?.trim().as_bytes().to_vec());
        }
        std::fs::create_dir_all(&self.data_dir)?;
        let secret: String = {
            use rand::Rng;
            let bytes: [u8; 32] = rand::rng().random();
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        };
        write_private(&path, secret.as_bytes())?;
        Ok(secret.into_bytes())
    }
}

/// Writes a secret readable only by its owner.
fn write_private(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options.open(path)?.write_all(contents)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_environment_override_defaults() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "bc.toml",
                "listen = \"0.0.0.0:9000\"\n[graphql]\nmax_depth = 5\n",
            )?;
            jail.set_env("BC_AUTH__AUDIENCE", "fleet");
            jail.set_env("DATABASE_URL", "postgres://db/x");
            let config = Config::load(Some(Path::new("bc.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(config.listen.port(), 9000);
            assert_eq!(config.graphql.max_depth, 5);
            assert_eq!(config.auth.audience, "fleet");
            assert_eq!(config.database_url(), "postgres://db/x");
            assert_eq!(
                config.graphql.max_page_size,
                GraphqlConfig::default().max_page_size
            );
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_are_refused() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("bc.toml", "lisen = \"0.0.0.0:9000\"\n")?;
            assert!(Config::load(Some(Path::new("bc.toml"))).is_err());
            Ok(())
        });
    }
}
