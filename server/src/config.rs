//! Configuration: built-in defaults, then an optional TOML file, then `BC_…` environment
//! variables (nested keys with `__`, e.g. `BC_AUTH__AUDIENCE`), then `DATABASE_URL`.
//! Every field and its default is listed in README.md's configuration table.

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
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
    /// The built dashboard (`index.html`, its scripts, wasm and styles, and a `.gz` copy of
    /// each) that the API serves at `/`. A relative path is taken from the working directory.
    pub dashboard_dir: PathBuf,
    pub database: DatabaseConfig,
    pub auth: AuthConfig,
    pub graphql: GraphqlConfig,
    pub log: LogConfig,
    pub liveness: LivenessConfig,
    pub gateway: GatewayConfig,
    pub api: ApiConfig,
    pub bare_metal: BareMetalConfig,
}

/// Where `scripts/build-web` writes the dashboard, relative to the repository root: the
/// working directory of `scripts/dev` and `cargo run`, so both find it without configuration.
pub const DEFAULT_DASHBOARD_DIR: &str = "web/dist";

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
    /// How far a token's `nbf` (not before) and `iat` (issued at) may lie in the future:
    /// the clocks of whoever mints tokens and of this server differ by a little, never by
    /// minutes. `exp` gets no leeway: a token is dead when it says it is.
    pub leeway_secs: u64,
}

/// The largest `auth.leeway_secs` accepted: more would let future-dated tokens in.
pub const MAX_AUTH_LEEWAY_SECS: u64 = 3600;

impl AuthConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.leeway_secs <= MAX_AUTH_LEEWAY_SECS,
            "auth.leeway_secs must be at most {MAX_AUTH_LEEWAY_SECS}"
        );
        Ok(())
    }
}

/// Tolerates a minting machine's clock half a minute ahead of ours; NTP keeps real clocks
/// within a second, so anything further ahead is a forged or broken token.
pub const DEFAULT_AUTH_LEEWAY_SECS: u64 = 30;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GraphqlConfig {
    /// Deepest query accepted, in nested fields (introspection has its own limit). The
    /// dashboard's deepest query nests 4; the schema has no cycle deeper than this allows.
    pub max_depth: usize,
    /// Highest complexity accepted (each field costs 1, a connection multiplies what is under
    /// it by `first`, at least 1). Checked during validation, whose work the limits below
    /// bound beforehand.
    pub max_complexity: usize,
    /// Page size when a connection is asked without `first`.
    pub default_page_size: u64,
    /// Largest `first` accepted.
    pub max_page_size: u64,
    /// Longest query text accepted, in bytes, checked before it is parsed: parsing and every
    /// later walk are linear in it. All of the dashboard's operations together are 4.3 KB,
    /// graphql-js's introspection query 2 KB.
    pub max_query_bytes: usize,
    /// Most aliased fields in a query, counted with every fragment spread expanded: aliases
    /// are how one request asks for the same expensive field many times (10,000 aliases of
    /// `nodes { totalCount }` were 10,000 counts). The dashboard uses none.
    pub max_aliases: usize,
    /// Most fragment spreads in a query, counted with every spread expanded: fragments that
    /// each spread the next twice double the document per fragment. All of the dashboard's
    /// operations together spread 4, graphql-js's introspection query 10.
    pub max_fragment_spreads: usize,
    /// Most fields (and directives) in a query, counted with every fragment spread expanded:
    /// what validation and execution walk. All of the dashboard's operations together have
    /// 232, graphql-js's introspection query 230.
    pub max_fields: usize,
    /// Deepest nesting under `__schema` and `__type`. graphql-js's introspection query, which
    /// GraphiQL and code generators send, nests 15 fields deep.
    pub introspection_max_depth: usize,
    /// Largest introspection answer a query may ask for: an upper bound on its values, each
    /// list counting as the longest such list in the schema (every type, the widest type's
    /// fields, …). Depth alone does not bound it, since `types { fields { type { fields … } } }`
    /// multiplies at every level. graphql-js's introspection query measures 1,202,466 here
    /// (165 types, 61 values in the widest enum), well under half the default; its real answer
    /// is far smaller.
    pub introspection_max_cost: usize,
    /// GraphQL operations over HTTP that run at once; more wait for a turn. Each runs on a
    /// thread of its own (see `http::GraphqlExecutor`), so this bounds those threads and the
    /// answers held in memory. Twice the default database pool, so that requests queue here
    /// rather than time out waiting for a connection.
    pub max_concurrent_requests: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
    /// A `tracing` filter such as `info,better_compute=debug`; `RUST_LOG` wins when set.
    pub filter: String,
}

/// `[liveness]`: how the Liveness controller turns missing heartbeats into `unreachable` and
/// `lost`, and when its fleet brake stops it. See `controllers::liveness` for the rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LivenessConfig {
    /// Run the background controller loop (every controller, `controllers::spawn`). `false`
    /// leaves them to whoever calls their `tick()`: tests that drive time with a
    /// `ManualClock`.
    pub enabled: bool,
    /// How often a daemon heartbeats; the gateway tells daemons this in its `Hello` answer.
    pub heartbeat_interval_secs: u64,
    /// How long a node may go without a heartbeat before it is `unreachable`.
    pub grace_secs: u64,
    /// How long a node stays `unreachable` before it is `lost`.
    pub lost_after_secs: u64,
    /// How often the controllers look at the fleet (acceptance also looks soon after the
    /// events that may move a node through it).
    pub tick_interval_secs: u64,
    /// The fleet brake counts nodes of a site that went `unreachable` within this window.
    pub brake_window_secs: u64,
    /// The fleet brake trips when more than this share (0 to 1) of a site's watched nodes
    /// would be (or recently were) marked `unreachable` within `brake_window_secs`.
    pub brake_share: f64,
    /// Sites with fewer watched nodes than this never trip the brake: in a small site a
    /// single node is already a large share.
    pub brake_min_nodes: u64,
}

/// Every daemon heartbeats this often: often enough that four missed beats still fit in
/// the grace, rare enough that 10,000 nodes cost 1,000 small writes a second.
pub const DEFAULT_HEARTBEAT_INTERVAL_SECS: u64 = 10;
/// Four missed heartbeats (the brief's 40 s): one late or lost beat, a GC pause or a
/// brief network blip never marks a node down.
pub const DEFAULT_GRACE_SECS: u64 = 40;
/// Ten minutes unreachable is `lost` (the brief): long enough to ride out a switch or
/// gateway reboot, short enough that operators learn about dead machines the same hour.
pub const DEFAULT_LOST_AFTER_SECS: u64 = 600;
/// Half a heartbeat interval: a silent node is noticed at most 5 s after its grace ends,
/// and each tick is a handful of indexed queries.
pub const DEFAULT_TICK_INTERVAL_SECS: u64 = 5;
/// A minute: long enough to see a site-wide outage that unfolds over several ticks (a
/// switch failing port by port), short enough that unrelated failures do not add up.
pub const DEFAULT_BRAKE_WINDOW_SECS: u64 = 60;
/// Independent machine failures almost never take out 30 % of a site within a minute;
/// a network partition or a control-plane fault does.
pub const DEFAULT_BRAKE_SHARE: f64 = 0.3;
/// Below ten nodes one failure is already 10 %+ of the site; the brake would only hide
/// real failures there.
pub const DEFAULT_BRAKE_MIN_NODES: u64 = 10;

impl LivenessConfig {
    /// The heartbeat interval the gateway hands to daemons.
    pub fn heartbeat_interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.heartbeat_interval_secs)
    }

    pub fn grace(&self) -> chrono::Duration {
        secs(self.grace_secs)
    }

    pub fn lost_after(&self) -> chrono::Duration {
        secs(self.lost_after_secs)
    }

    pub fn tick_interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.tick_interval_secs)
    }

    pub fn brake_window(&self) -> chrono::Duration {
        secs(self.brake_window_secs)
    }

    /// Refuses settings that would make the controller misbehave rather than fail loudly.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.heartbeat_interval_secs > 0,
            "liveness.heartbeat_interval_secs must be at least 1"
        );
        anyhow::ensure!(
            self.grace_secs > self.heartbeat_interval_secs,
            "liveness.grace_secs ({}) must be longer than liveness.heartbeat_interval_secs ({}), \
             or every node goes unreachable between two heartbeats",
            self.grace_secs,
            self.heartbeat_interval_secs
        );
        anyhow::ensure!(
            self.lost_after_secs > 0,
            "liveness.lost_after_secs must be at least 1"
        );
        anyhow::ensure!(
            self.tick_interval_secs > 0,
            "liveness.tick_interval_secs must be at least 1"
        );
        anyhow::ensure!(
            self.brake_share > 0.0 && self.brake_share <= 1.0,
            "liveness.brake_share must be above 0 and at most 1, not {}",
            self.brake_share
        );
        // Every duration is later added to or subtracted from a timestamp.
        for (key, value) in [
            ("grace_secs", self.grace_secs),
            ("lost_after_secs", self.lost_after_secs),
            ("brake_window_secs", self.brake_window_secs),
        ] {
            anyhow::ensure!(
                value <= MAX_DURATION_SECS,
                "liveness.{key} must be at most {MAX_DURATION_SECS}"
            );
        }
        Ok(())
    }
}

/// A hundred years: any longer setting is a typo, and it keeps time arithmetic in range.
const MAX_DURATION_SECS: u64 = 100 * 365 * 24 * 3600;

fn secs(value: u64) -> chrono::Duration {
    chrono::Duration::seconds(i64::try_from(value.min(MAX_DURATION_SECS)).unwrap_or(i64::MAX))
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
            dashboard_dir: PathBuf::from(DEFAULT_DASHBOARD_DIR),
            database: DatabaseConfig::default(),
            auth: AuthConfig::default(),
            graphql: GraphqlConfig::default(),
            log: LogConfig::default(),
            gateway: GatewayConfig::default(),
            liveness: LivenessConfig::default(),
            api: ApiConfig::default(),
            bare_metal: BareMetalConfig::default(),
        }
    }
}

impl Default for LivenessConfig {
    fn default() -> Self {
        LivenessConfig {
            enabled: true,
            heartbeat_interval_secs: DEFAULT_HEARTBEAT_INTERVAL_SECS,
            grace_secs: DEFAULT_GRACE_SECS,
            lost_after_secs: DEFAULT_LOST_AFTER_SECS,
            tick_interval_secs: DEFAULT_TICK_INTERVAL_SECS,
            brake_window_secs: DEFAULT_BRAKE_WINDOW_SECS,
            brake_share: DEFAULT_BRAKE_SHARE,
            brake_min_nodes: DEFAULT_BRAKE_MIN_NODES,
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
            leeway_secs: DEFAULT_AUTH_LEEWAY_SECS,
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
            max_query_bytes: 16 * 1024,
            max_aliases: 100,
            max_fragment_spreads: 100,
            max_fields: 2_000,
            introspection_max_depth: 20,
            introspection_max_cost: 3_000_000,
            max_concurrent_requests: 32,
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

/// `BC_…` variables that belong to the project's tools, not to the server (with the prefix
/// removed): the config file's path (`BC_CONFIG`, read by the command line), the test and
/// build scripts' settings and the benchmarks'. The server refuses unknown keys, so without
/// this a developer who exported one of them could not start it.
const TOOLING_VARIABLES: &[&str] = &["CONFIG", "BIN", "TOOLS_DIR"];
const TOOLING_PREFIXES: &[&str] = &["TEST_", "WEB_", "BENCH_"];

fn is_tooling_variable(key: &str) -> bool {
    let key = key.to_ascii_uppercase();
    TOOLING_VARIABLES.contains(&key.as_str()) || TOOLING_PREFIXES.iter().any(|p| key.starts_with(p))
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
        figment = figment
            .merge(
                Env::prefixed("BC_")
                    .filter(|key| !is_tooling_variable(key.as_str()))
                    .split("__"),
            )
            .merge(
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

    /// Where the CA lives: `gateway.ca_dir`, or `data_dir/ca`.
    pub fn ca_dir(&self) -> PathBuf {
        self.gateway
            .ca_dir
            .clone()
            .unwrap_or_else(|| self.data_dir.join("ca"))
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
        crate::private_file::write_private(&path, secret.as_bytes())?;
        Ok(secret.into_bytes())
    }
}

/// The daemon-facing gateway (`[gateway]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    /// Where daemons connect (TLS).
    pub listen: SocketAddr,
    /// Names and addresses the gateway's server certificate is valid for.
    pub hostnames: Vec<String>,
    /// Where the CA's certificate and key live. Unset: `data_dir/ca`. Replicas must share it.
    pub ca_dir: Option<PathBuf>,
    /// This gateway's id in session rows. Unset: `gw-<random>` per process start. At most
    /// [`MAX_GATEWAY_ID_BYTES`] bytes of printable characters without spaces, so that it reads
    /// as one word in logs and is typed into a filter as it is.
    pub gateway_id: Option<String>,
    /// Most connections open at once; one over it is closed at accept. Every daemon holds
    /// one, so this bounds the fleet one process serves. Unset: 90 % of the open files the
    /// API's share leaves (see [`ConnectionCaps::derive`]).
    pub max_connections: Option<usize>,
    /// Most connections one peer address may hold. Unset: `max_connections`, because a
    /// site behind one NAT address legitimately holds thousands of sessions; lower it where
    /// daemons have addresses of their own.
    pub max_connections_per_peer: Option<usize>,
    /// A TLS handshake not finished within this is dropped: a peer that connects and says
    /// nothing must not hold a socket.
    pub tls_handshake_timeout_secs: u64,
    /// A request's headers must arrive within this of the gateway starting to wait for them
    /// (this also closes keep-alive connections idle between requests).
    pub header_timeout_secs: u64,
    /// A request body (a join or renewal) must arrive whole within this.
    pub body_timeout_secs: u64,
    /// A connection on which nothing was read or written for this long is closed, sessions
    /// included: a daemon heartbeats every `liveness.heartbeat_interval_secs`, so a silent
    /// connection is a dead peer (a machine that lost power leaves its TCP half open).
    pub idle_timeout_secs: u64,
    /// The largest join or renewal body (JSON with a CSR and the machine's identifiers).
    pub max_body_bytes: usize,
}

/// Ten seconds is an age for a TLS handshake on any network a daemon uses, and short enough
/// that silent connections cannot pile up faster than they are dropped.
pub const DEFAULT_TLS_HANDSHAKE_TIMEOUT_SECS: u64 = 10;
/// Headers are a few hundred bytes; ten seconds covers the slowest link and starves
/// slowloris clients that trickle them.
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 10;
/// A join body is a few KiB; half a minute covers a 1 MiB API body on a slow link too.
pub const DEFAULT_BODY_TIMEOUT_SECS: u64 = 30;
/// Nine missed heartbeats at the default interval: long after Liveness has called the node
/// `unreachable` (40 s), well before its dead socket would otherwise live on for hours.
pub const DEFAULT_GATEWAY_IDLE_TIMEOUT_SECS: u64 = 90;
/// A join is a CSR (under 1 KiB) and a few identifiers, one per network interface: 16 KiB
/// is ten times a large machine's, and bounds what unauthenticated peers make us buffer.
pub const DEFAULT_GATEWAY_MAX_BODY_BYTES: usize = 16 * 1024;

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8443)),
            hostnames: vec!["localhost".to_owned(), "127.0.0.1".to_owned()],
            ca_dir: None,
            gateway_id: None,
            max_connections: None,
            max_connections_per_peer: None,
            tls_handshake_timeout_secs: DEFAULT_TLS_HANDSHAKE_TIMEOUT_SECS,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            idle_timeout_secs: DEFAULT_GATEWAY_IDLE_TIMEOUT_SECS,
            max_body_bytes: DEFAULT_GATEWAY_MAX_BODY_BYTES,
        }
    }
}

/// `[api]`: what the API listener (`listen`) lets one connection, peer and request hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// Most connections open at once, the admin reserve included; one over it is closed at
    /// accept. Unset: a tenth of the process's open-file limit (see
    /// [`ConnectionCaps::derive`]).
    pub max_connections: Option<usize>,
    /// Most connections one peer address may hold, so that one address cannot fill the
    /// listener. Unset: a quarter of `max_connections`.
    pub max_connections_per_peer: Option<usize>,
    /// Of `max_connections`, this many are kept for platform admins: when the rest are
    /// taken, a new connection may take one of these, but only requests bearing a platform
    /// admin's token are served on it (others are answered 503 and the connection closed),
    /// at most one per peer address. So an operator gets in while the listener is full.
    pub admin_reserved_connections: usize,
    /// A request's headers must arrive within this of the server starting to wait for
    /// them; the same timer closes keep-alive connections idle between requests.
    pub header_timeout_secs: u64,
    /// A request body must arrive whole within this.
    pub body_timeout_secs: u64,
    /// The largest request body (a GraphQL operation with its variables).
    pub max_body_bytes: usize,
    /// A subscription socket must send `connection_init` within this of the upgrade, or
    /// it is closed with 4408.
    pub ws_init_timeout_secs: u64,
    /// The server pings every subscription socket this often.
    pub ws_ping_interval_secs: u64,
    /// A subscription socket that sends nothing (not even the pong) for this long after a
    /// ping is closed with 3008: its peer is gone.
    pub ws_pong_timeout_secs: u64,
}

/// Kept for platform admins: a handful of requests at a time is all an operator needs to
/// look around and act while the listener is under attack.
pub const DEFAULT_ADMIN_RESERVED_CONNECTIONS: usize = 8;
/// 1 MiB: the largest operation the dashboard or an agent sends is a few KiB; a
/// `sendCommand` to a thousand nodes by id is about 40 KiB.
pub const DEFAULT_API_MAX_BODY_BYTES: usize = 1024 * 1024;
/// The `graphql-ws` library sends `connection_init` at once; ten seconds is generous.
pub const DEFAULT_WS_INIT_TIMEOUT_SECS: u64 = 10;
/// Half a minute: idle subscription sockets cost one small frame each way per interval, and
/// NAT and proxy idle timers (often 60 s) never see a silent connection.
pub const DEFAULT_WS_PING_INTERVAL_SECS: u64 = 30;
/// Browsers and WebSocket libraries answer a ping at once; twenty seconds covers a peer
/// busy with a burst of events.
pub const DEFAULT_WS_PONG_TIMEOUT_SECS: u64 = 20;

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            max_connections: None,
            max_connections_per_peer: None,
            admin_reserved_connections: DEFAULT_ADMIN_RESERVED_CONNECTIONS,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            max_body_bytes: DEFAULT_API_MAX_BODY_BYTES,
            ws_init_timeout_secs: DEFAULT_WS_INIT_TIMEOUT_SECS,
            ws_ping_interval_secs: DEFAULT_WS_PING_INTERVAL_SECS,
            ws_pong_timeout_secs: DEFAULT_WS_PONG_TIMEOUT_SECS,
        }
    }
}

impl ApiConfig {
    pub fn header_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.header_timeout_secs)
    }

    pub fn body_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.body_timeout_secs)
    }

    pub fn ws_init_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.ws_init_timeout_secs)
    }

    pub fn ws_ping_interval(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.ws_ping_interval_secs)
    }

    pub fn ws_pong_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.ws_pong_timeout_secs)
    }

    /// Refuses a zero timeout or size, which would refuse every connection or request.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (key, value) in [
            ("header_timeout_secs", self.header_timeout_secs),
            ("body_timeout_secs", self.body_timeout_secs),
            ("ws_init_timeout_secs", self.ws_init_timeout_secs),
            ("ws_ping_interval_secs", self.ws_ping_interval_secs),
            ("ws_pong_timeout_secs", self.ws_pong_timeout_secs),
        ] {
            anyhow::ensure!(
                (1..=MAX_DURATION_SECS).contains(&value),
                "api.{key} must be between 1 and {MAX_DURATION_SECS}"
            );
        }
        anyhow::ensure!(
            self.max_body_bytes > 0,
            "api.max_body_bytes must be at least 1"
        );
        Ok(())
    }
}

impl GatewayConfig {
    pub fn tls_handshake_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.tls_handshake_timeout_secs)
    }

    pub fn header_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.header_timeout_secs)
    }

    pub fn body_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.body_timeout_secs)
    }

    pub fn idle_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.idle_timeout_secs)
    }

    /// Refuses a zero timeout or size, an idle timeout that healthy sessions would hit
    /// between two heartbeats, and a gateway id that is empty, too long or holds spaces or
    /// control characters.
    pub fn validate(&self, heartbeat_interval_secs: u64) -> anyhow::Result<()> {
        for (key, value) in [
            (
                "tls_handshake_timeout_secs",
                self.tls_handshake_timeout_secs,
            ),
            ("header_timeout_secs", self.header_timeout_secs),
            ("body_timeout_secs", self.body_timeout_secs),
            ("idle_timeout_secs", self.idle_timeout_secs),
        ] {
            anyhow::ensure!(
                (1..=MAX_DURATION_SECS).contains(&value),
                "gateway.{key} must be between 1 and {MAX_DURATION_SECS}"
            );
        }
        anyhow::ensure!(
            self.idle_timeout_secs > 2 * heartbeat_interval_secs,
            "gateway.idle_timeout_secs ({}) must be more than twice \
             liveness.heartbeat_interval_secs ({heartbeat_interval_secs}), or healthy sessions \
             are closed between heartbeats",
            self.idle_timeout_secs
        );
        anyhow::ensure!(
            self.max_body_bytes > 0,
            "gateway.max_body_bytes must be at least 1"
        );
        if let Some(id) = &self.gateway_id {
            anyhow::ensure!(
                (1..=MAX_GATEWAY_ID_BYTES).contains(&id.len())
                    && !id.chars().any(|c| c.is_control() || c.is_whitespace()),
                "gateway.gateway_id must be 1 to {MAX_GATEWAY_ID_BYTES} bytes of printable \
                 characters without spaces, not {id:?}"
            );
        }
        Ok(())
    }
}

/// The longest `gateway.gateway_id`: operators filter nodes by it (`NodeFilterInput.gatewayId`),
/// and the API refuses a longer one there.
pub const MAX_GATEWAY_ID_BYTES: usize = 100;

/// `[bare_metal]`: machines reached through their BMC (Redfish): where the key that seals
/// their credentials lives, and how the Power controller polls them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BareMetalConfig {
    /// The 32-byte key that seals BMC credentials at rest. Unset: `data_dir/bmc-credentials.key`,
    /// created (owner-only) on first start. Replicas must share it; losing it loses every
    /// stored BMC password (re-enrol the machines).
    pub credential_key_file: Option<PathBuf>,
    /// Accept `http://` BMC addresses. Only for tests and labs: plain HTTP sends the BMC's
    /// password in the clear.
    pub allow_insecure_http: bool,
    /// How often the Power controller reads each BMC's power state.
    pub poll_interval_secs: u64,
    /// Each poll is moved by up to this many seconds either way, so BMCs enrolled together
    /// (or a restarted server) do not poll in lockstep.
    pub poll_jitter_secs: u64,
    /// BMCs polled at once, fleet-wide.
    pub poll_concurrency: usize,
    /// BMCs of one site polled at once: a site's management network is often small.
    pub poll_concurrency_per_site: usize,
    /// Most BMCs polled in one pass; the rest wait for the next tick.
    pub poll_batch: u64,
    /// One HTTP request to a BMC (connect included) must finish within this.
    pub request_timeout_secs: u64,
    /// Consecutive failed polls before `BmcUnreachable` is set (one lost packet is no outage).
    pub unreachable_after_failures: u32,
    /// Deploy images by name: a node whose `drivers.deploy` names one boots it as virtual
    /// media during its deploy workflow (where its BMC has virtual media), from this address
    /// (`http://` or `https://`, which the BMC downloads). A node without `drivers.deploy`
    /// boots its deploy from the network, as the boot server decides.
    pub images: BTreeMap<String, String>,
}

/// A minute: power changes by an operator are followed by an immediate poll, so the
/// interval only bounds how late a change made behind our back (a button, another tool) shows.
pub const DEFAULT_POWER_POLL_INTERVAL_SECS: u64 = 60;
/// A tenth of the interval, either way.
pub const DEFAULT_POWER_POLL_JITTER_SECS: u64 = 6;
/// BMCs answer in tens of milliseconds to seconds; 32 at once keeps 10,000 BMCs polled
/// within a minute at 200 ms each.
pub const DEFAULT_POWER_POLL_CONCURRENCY: usize = 32;
/// BMC management networks and their switches are slow; 8 per site is gentle.
pub const DEFAULT_POWER_POLL_CONCURRENCY_PER_SITE: usize = 8;
/// A pass's work list; at 32 at once and 200 ms each, 2,000 BMCs take about 13 s.
pub const DEFAULT_POWER_POLL_BATCH: u64 = 2_000;
/// BMCs are slow (a busy one takes seconds), never ten.
pub const DEFAULT_BMC_REQUEST_TIMEOUT_SECS: u64 = 10;
/// Two polls in a row: a single dropped request is not an outage.
pub const DEFAULT_BMC_UNREACHABLE_AFTER_FAILURES: u32 = 2;

impl Default for BareMetalConfig {
    fn default() -> Self {
        BareMetalConfig {
            credential_key_file: None,
            allow_insecure_http: false,
            poll_interval_secs: DEFAULT_POWER_POLL_INTERVAL_SECS,
            poll_jitter_secs: DEFAULT_POWER_POLL_JITTER_SECS,
            poll_concurrency: DEFAULT_POWER_POLL_CONCURRENCY,
            poll_concurrency_per_site: DEFAULT_POWER_POLL_CONCURRENCY_PER_SITE,
            poll_batch: DEFAULT_POWER_POLL_BATCH,
            request_timeout_secs: DEFAULT_BMC_REQUEST_TIMEOUT_SECS,
            unreachable_after_failures: DEFAULT_BMC_UNREACHABLE_AFTER_FAILURES,
            images: BTreeMap::new(),
        }
    }
}

impl BareMetalConfig {
    pub fn poll_interval(&self) -> chrono::Duration {
        secs(self.poll_interval_secs)
    }

    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.request_timeout_secs)
    }

    /// Refuses settings that would stop polling or poll in a busy loop.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            (1..=MAX_DURATION_SECS).contains(&self.poll_interval_secs),
            "bare_metal.poll_interval_secs must be between 1 and {MAX_DURATION_SECS}"
        );
        anyhow::ensure!(
            self.poll_jitter_secs < self.poll_interval_secs,
            "bare_metal.poll_jitter_secs must be less than bare_metal.poll_interval_secs"
        );
        anyhow::ensure!(
            (1..=3600).contains(&self.request_timeout_secs),
            "bare_metal.request_timeout_secs must be between 1 and 3600"
        );
        anyhow::ensure!(
            self.poll_concurrency > 0 && self.poll_concurrency_per_site > 0 && self.poll_batch > 0,
            "bare_metal.poll_concurrency, poll_concurrency_per_site and poll_batch must be at least 1"
        );
        anyhow::ensure!(
            self.unreachable_after_failures > 0,
            "bare_metal.unreachable_after_failures must be at least 1"
        );
        for (name, address) in &self.images {
            anyhow::ensure!(
                bc_core::node::validate_label_value(name).is_ok() && !name.is_empty(),
                "bare_metal.images: `{name}` is not an image name (what drivers.deploy names: at most 63 of a-z0-9-_.)"
            );
            let valid = reqwest::Url::parse(address)
                .is_ok_and(|url| matches!(url.scheme(), "http" | "https") && url.has_host());
            anyhow::ensure!(
                valid,
                "bare_metal.images.{name}: `{address}` is not an http(s) address"
            );
        }
        Ok(())
    }
}

impl Config {
    /// Where the BMC credential key lives: `bare_metal.credential_key_file`, or
    /// `data_dir/bmc-credentials.key`.
    pub fn credential_key_file(&self) -> PathBuf {
        self.bare_metal
            .credential_key_file
            .clone()
            .unwrap_or_else(|| self.data_dir.join("bmc-credentials.key"))
    }
}

/// The connection caps of both listeners, as they apply to this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionCaps {
    pub api: usize,
    pub api_per_peer: usize,
    pub api_admin_reserved: usize,
    pub gateway: usize,
    pub gateway_per_peer: usize,
}

/// The API's share of the open-file limit when `api.max_connections` is unset: people,
/// agents and dashboard tabs are few next to a fleet's daemons.
pub const API_SHARE_OF_OPEN_FILES: f64 = 0.1;
/// The gateway's share of the open files the API leaves, when `gateway.max_connections` is
/// unset. The last 10 % stay for everything else a process holds: the database pool, the
/// SQLite files, the dashboard's files while they are served, logs, outgoing connections.
pub const GATEWAY_SHARE_OF_REMAINING_FILES: f64 = 0.9;
/// When unset, one peer address may hold this share of the API's connections.
pub const API_PER_PEER_SHARE: f64 = 0.25;

impl ConnectionCaps {
    /// The caps `config` sets, with the unset ones derived from `open_file_limit` (the
    /// process's soft `RLIMIT_NOFILE` at start): the API gets a tenth, the gateway 90 % of
    /// the rest. At the 20,000 files of our machines: API 2,000 (500 per address), gateway
    /// 16,200, leaving 1,800 for the rest of the process.
    pub fn derive(config: &Config, open_file_limit: u64) -> anyhow::Result<ConnectionCaps> {
        let limit = usize::try_from(open_file_limit).unwrap_or(usize::MAX);
        let share = |of: usize, share: f64| ((of as f64) * share) as usize;
        let api = config
            .api
            .max_connections
            .unwrap_or_else(|| share(limit, API_SHARE_OF_OPEN_FILES).max(1));
        let api_per_peer = config
            .api
            .max_connections_per_peer
            .unwrap_or_else(|| share(api, API_PER_PEER_SHARE).max(1))
            .min(api);
        let gateway = config.gateway.max_connections.unwrap_or_else(|| {
            share(limit.saturating_sub(api), GATEWAY_SHARE_OF_REMAINING_FILES).max(1)
        });
        let gateway_per_peer = config
            .gateway
            .max_connections_per_peer
            .unwrap_or(gateway)
            .min(gateway);
        anyhow::ensure!(
            api > 0 && gateway > 0 && api_per_peer > 0 && gateway_per_peer > 0,
            "api.max_connections, gateway.max_connections and their _per_peer limits must be \
             at least 1"
        );
        anyhow::ensure!(
            config.api.admin_reserved_connections < api,
            "api.admin_reserved_connections ({}) must be less than api.max_connections ({api})",
            config.api.admin_reserved_connections
        );
        Ok(ConnectionCaps {
            api,
            api_per_peer,
            api_admin_reserved: config.api.admin_reserved_connections,
            gateway,
            gateway_per_peer,
        })
    }
}

#[cfg(test)]
// `figment::Jail` fixes its closures' error type, `figment::Error`, which is large.
#[allow(clippy::result_large_err)]
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
            jail.set_env("BC_DASHBOARD_DIR", "/srv/dashboard");
            // The scripts' own variables are not configuration.
            for tooling in [
                "BC_CONFIG",
                "BC_BIN",
                "BC_TOOLS_DIR",
                "BC_TEST_BACKENDS",
                "BC_WEB_STRICT",
                "BC_BENCH_NODES",
            ] {
                jail.set_env(tooling, "x");
            }
            let config = Config::load(Some(Path::new("bc.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(config.listen.port(), 9000);
            assert_eq!(config.graphql.max_depth, 5);
            assert_eq!(config.auth.audience, "fleet");
            assert_eq!(config.database_url(), "postgres://db/x");
            assert_eq!(config.dashboard_dir, PathBuf::from("/srv/dashboard"));
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

    #[test]
    fn connection_caps_derive_from_the_open_file_limit_unless_set() {
        let caps = ConnectionCaps::derive(&Config::default(), 20_000).expect("caps");
        assert_eq!(
            caps,
            ConnectionCaps {
                api: 2_000,
                api_per_peer: 500,
                api_admin_reserved: DEFAULT_ADMIN_RESERVED_CONNECTIONS,
                gateway: 16_200,
                gateway_per_peer: 16_200,
            }
        );
        let mut config = Config::default();
        config.api.max_connections = Some(50);
        config.api.max_connections_per_peer = Some(500);
        config.gateway.max_connections = Some(100);
        config.gateway.max_connections_per_peer = Some(10);
        let caps = ConnectionCaps::derive(&config, 20_000).expect("caps");
        assert_eq!(
            (
                caps.api,
                caps.api_per_peer,
                caps.gateway,
                caps.gateway_per_peer
            ),
            (50, 50, 100, 10),
            "a per-peer cap above its listener's is the listener's"
        );
        config.api.admin_reserved_connections = 50;
        assert!(ConnectionCaps::derive(&config, 20_000).is_err());
        config.api.admin_reserved_connections = 0;
        config.api.max_connections = Some(0);
        assert!(ConnectionCaps::derive(&config, 20_000).is_err());
    }

    #[test]
    fn listener_limits_load_and_are_checked() {
        assert!(ApiConfig::default().validate().is_ok());
        assert!(
            GatewayConfig::default()
                .validate(DEFAULT_HEARTBEAT_INTERVAL_SECS)
                .is_ok()
        );
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "bc.toml",
                "[api]\nmax_connections = 300\nws_ping_interval_secs = 5\n[gateway]\nidle_timeout_secs = 60\n",
            )?;
            jail.set_env("BC_API__MAX_BODY_BYTES", "65536");
            jail.set_env("BC_AUTH__LEEWAY_SECS", "5");
            let config = Config::load(Some(Path::new("bc.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(config.api.max_connections, Some(300));
            assert_eq!(config.api.max_body_bytes, 65_536);
            assert_eq!(config.api.ws_ping_interval_secs, 5);
            assert_eq!(config.api.header_timeout_secs, DEFAULT_HEADER_TIMEOUT_SECS);
            assert_eq!(config.gateway.idle_timeout_secs, 60);
            assert_eq!(config.gateway.max_connections, None);
            assert_eq!(config.auth.leeway_secs, 5);
            Ok(())
        });
        let api = ApiConfig {
            ws_pong_timeout_secs: 0,
            ..ApiConfig::default()
        };
        assert!(api.validate().is_err());
        let gateway = GatewayConfig {
            idle_timeout_secs: 2 * DEFAULT_HEARTBEAT_INTERVAL_SECS,
            ..GatewayConfig::default()
        };
        assert!(
            gateway.validate(DEFAULT_HEARTBEAT_INTERVAL_SECS).is_err(),
            "an idle timeout healthy sessions would hit"
        );
        for (id, valid) in [
            ("gw-fra1-a", true),
            (&"g".repeat(MAX_GATEWAY_ID_BYTES), true),
            (&"g".repeat(MAX_GATEWAY_ID_BYTES + 1), false),
            ("", false),
            ("gw a", false),
            ("gw\u{1b}", false),
        ] {
            let gateway = GatewayConfig {
                gateway_id: Some(id.to_owned()),
                ..GatewayConfig::default()
            };
            assert_eq!(
                gateway.validate(DEFAULT_HEARTBEAT_INTERVAL_SECS).is_ok(),
                valid,
                "gateway_id {id:?}"
            );
        }
        let auth = AuthConfig {
            leeway_secs: MAX_AUTH_LEEWAY_SECS + 1,
            ..AuthConfig::default()
        };
        assert!(auth.validate().is_err());
    }

    #[test]
    fn bare_metal_settings_load_and_are_checked() {
        assert!(BareMetalConfig::default().validate().is_ok());
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "bc.toml",
                "[bare_metal]\npoll_interval_secs = 30\n[bare_metal.images]\n\"ubuntu-24.04\" = \"https://images.example.com/ubuntu.iso\"\n",
            )?;
            jail.set_env("BC_BARE_METAL__ALLOW_INSECURE_HTTP", "true");
            let config = Config::load(Some(Path::new("bc.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(
                config.bare_metal.poll_interval(),
                chrono::Duration::seconds(30)
            );
            assert!(config.bare_metal.allow_insecure_http);
            assert_eq!(
                config
                    .bare_metal
                    .images
                    .get("ubuntu-24.04")
                    .map(String::as_str),
                Some("https://images.example.com/ubuntu.iso")
            );
            assert_eq!(
                config.credential_key_file(),
                config.data_dir.join("bmc-credentials.key")
            );
            Ok(())
        });
        let bad = [
            BareMetalConfig {
                poll_interval_secs: 0,
                ..BareMetalConfig::default()
            },
            BareMetalConfig {
                poll_jitter_secs: DEFAULT_POWER_POLL_INTERVAL_SECS,
                ..BareMetalConfig::default()
            },
            BareMetalConfig {
                poll_concurrency: 0,
                ..BareMetalConfig::default()
            },
            BareMetalConfig {
                unreachable_after_failures: 0,
                ..BareMetalConfig::default()
            },
            BareMetalConfig {
                images: BTreeMap::from([("ubuntu".into(), "ftp://images/ubuntu.iso".into())]),
                ..BareMetalConfig::default()
            },
            BareMetalConfig {
                images: BTreeMap::from([("Ubuntu 24".into(), "https://images/u.iso".into())]),
                ..BareMetalConfig::default()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }

    #[test]
    fn liveness_settings_load_and_are_checked() {
        assert!(LivenessConfig::default().validate().is_ok());
        figment::Jail::expect_with(|jail| {
            jail.create_file("bc.toml", "[liveness]\ngrace_secs = 60\n")?;
            jail.set_env("BC_LIVENESS__ENABLED", "false");
            let config = Config::load(Some(Path::new("bc.toml"))).map_err(|e| e.to_string())?;
            assert_eq!(config.liveness.grace(), chrono::Duration::seconds(60));
            assert!(!config.liveness.enabled);
            assert_eq!(
                config.liveness.heartbeat_interval(),
                std::time::Duration::from_secs(DEFAULT_HEARTBEAT_INTERVAL_SECS)
            );
            Ok(())
        });
        let bad = [
            LivenessConfig {
                grace_secs: DEFAULT_HEARTBEAT_INTERVAL_SECS,
                ..LivenessConfig::default()
            },
            LivenessConfig {
                tick_interval_secs: 0,
                ..LivenessConfig::default()
            },
            LivenessConfig {
                brake_share: 0.0,
                ..LivenessConfig::default()
            },
            LivenessConfig {
                brake_share: 1.5,
                ..LivenessConfig::default()
            },
        ];
        for config in bad {
            assert!(config.validate().is_err(), "{config:?}");
        }
    }
}
