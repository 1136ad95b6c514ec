//! [`TestServer`]: the control plane on a fresh database, on a free loopback port.

use anyhow::Context;
use bc_core::clock::ManualClock;
use bc_core::ids::{NodeId, TenantId};
use better_compute::app::{self, RunningServer};
use better_compute::auth::Role;
use better_compute::config::Config;
use chrono::Duration;
use sea_orm::{ConnectionTrait, Database};
use serde_json::{Value, json};
use std::sync::Arc;

/// A database backend the server supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The PostgreSQL server tests create their databases on. CI and every developer machine
/// have one at this address; override with `BC_TEST_POSTGRES_URL`.
pub const DEFAULT_POSTGRES_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

impl Backend {
    /// The backends to test: `BC_TEST_BACKENDS=sqlite` (or `postgres`) narrows the default
    /// of both.
    pub fn selected() -> Vec<Backend> {
        match std::env::var("BC_TEST_BACKENDS").ok().as_deref() {
            Some("sqlite") => vec![Backend::Sqlite],
            Some("postgres") => vec![Backend::Postgres],
            _ => vec![Backend::Sqlite, Backend::Postgres],
        }
    }

    pub fn postgres_admin_url() -> String {
        std::env::var("BC_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| DEFAULT_POSTGRES_ADMIN_URL.to_owned())
    }
}

/// A database that exists for one test and is dropped afterwards.
pub struct TestDatabase {
    pub backend: Backend,
    pub url: String,
    postgres_name: Option<String>,
    _dir: tempfile::TempDir,
}

impl TestDatabase {
    pub async fn create(backend: Backend) -> anyhow::Result<TestDatabase> {
        let dir = tempfile::tempdir()?;
        match backend {
            Backend::Sqlite => Ok(TestDatabase {
                backend,
                url: format!("sqlite://{}?mode=rwc", dir.path().join("test.db").display()),
                postgres_name: None,
                _dir: dir,
            }),
            Backend::Postgres => {
                let name = format!("bc_test_{}", uuid::Uuid::new_v4().simple());
                let admin_url = Backend::postgres_admin_url();
                let admin = Database::connect(&admin_url).await.with_context(|| {
                    format!("connecting to PostgreSQL at {admin_url} (set BC_TEST_POSTGRES_URL)")
                })?;
                admin
                    .execute_unprepared(&format!("CREATE DATABASE {name}"))
                    .await?;
                admin.close().await?;
                let base = admin_url
                    .rsplit_once('/')
                    .map_or(admin_url.as_str(), |(base, _)| base);
                Ok(TestDatabase {
                    backend,
                    url: format!("{base}/{name}"),
                    postgres_name: Some(name),
                    _dir: dir,
                })
            }
        }
    }

    /// Drops the PostgreSQL database (SQLite's file goes with its temporary directory).
    pub async fn drop_database(mut self) -> anyhow::Result<()> {
        if let Some(name) = self.postgres_name.take() {
            drop_postgres_database(&name).await?;
        }
        Ok(())
    }
}

async fn drop_postgres_database(name: &str) -> anyhow::Result<()> {
    let admin = Database::connect(&Backend::postgres_admin_url()).await?;
    admin
        .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await?;
    admin.close().await?;
    Ok(())
}

/// A test that panics never reaches `drop_database`; its PostgreSQL database is dropped here
/// instead, on a thread of its own (a destructor cannot await, and may run inside a runtime).
impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Some(name) = self.postgres_name.take() else {
            return;
        };
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(drop_postgres_database(&name))
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            // Nothing else to do from a destructor; the database name says it is a test's.
            eprintln!("could not drop a test database");
        }
    }
}

/// A GraphQL response: HTTP status and body.
#[derive(Debug, Clone)]
pub struct Gql {
    pub status: u16,
    pub body: Value,
}

impl Gql {
    /// `data`, panicking with the whole response if there were errors.
    #[track_caller]
    pub fn data(&self) -> &Value {
        assert!(
            self.body.get("errors").is_none_or(Value::is_null),
            "unexpected errors: {:#}",
            self.body
        );
        &self.body["data"]
    }

    /// The `extensions.code` of the first error, if any.
    pub fn code(&self) -> Option<&str> {
        self.body["errors"][0]["extensions"]["code"].as_str()
    }

    /// The message of the first error (empty if there is none).
    pub fn message(&self) -> &str {
        self.body["errors"][0]["message"]
            .as_str()
            .unwrap_or_default()
    }

    /// The first error, panicking if there is none.
    #[track_caller]
    pub fn error(&self) -> &Value {
        let err = &self.body["errors"][0];
        assert!(!err.is_null(), "expected an error, got {:#}", self.body);
        err
    }
}

/// How long [`TestServer::wait_for_lock_waiters`] waits for lock waits that take
/// milliseconds when all is well.
const LOCK_WAIT_SETTLE: std::time::Duration = std::time::Duration::from_secs(60);
/// How often [`TestServer::wait_for_lock_waiters`] looks.
const LOCK_WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(20);
/// The JWT secret test servers sign with.
const TEST_SECRET: &str = "better-compute-test-secret-0123456789abcdef";
/// The harness's admin token lives ten years of the test clock: tests move it days ahead.
const ADMIN_TOKEN_TTL: Duration = Duration::days(3650);

/// What every server on one test database shares: the database and the data directory
/// (the CA). It goes (and a PostgreSQL database is dropped) when the last server on it stops.
struct SharedState {
    database: TestDatabase,
    data_dir: tempfile::TempDir,
    /// The test's own settings ([`TestServer::start_with`]), applied to every server on the
    /// database, because replicas and restarts are the same deployment.
    configure: Box<Configure>,
}

/// A change to a test server's configuration, made after the harness's own settings.
type Configure = dyn Fn(&mut Config) + Send + Sync;

/// A running server on its own database, or a replica on the database of another
/// ([`TestServer::replica`]).
pub struct TestServer {
    pub backend: Backend,
    pub clock: ManualClock,
    pub server: RunningServer,
    shared: Arc<SharedState>,
    client: reqwest::Client,
    admin_token: String,
}

impl TestServer {
    pub async fn start(backend: Backend) -> anyhow::Result<TestServer> {
        TestServer::start_with(backend, |_| {}).await
    }

    /// [`TestServer::start`] with `configure` applied on top of the harness's settings (to set
    /// `dashboard_dir`, say); its replicas and restarts apply it too.
    pub async fn start_with(
        backend: Backend,
        configure: impl Fn(&mut Config) + Send + Sync + 'static,
    ) -> anyhow::Result<TestServer> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let database = TestDatabase::create(backend).await?;
        let data_dir = tempfile::tempdir()?;
        let clock = ManualClock::new(bc_core::clock::Clock::now(&bc_core::clock::SystemClock));
        let shared = SharedState {
            database,
            data_dir,
            configure: Box::new(configure),
        };
        TestServer::start_on(backend, Arc::new(shared), clock).await
    }

    /// A server on `shared`'s database, listening on fresh loopback ports.
    async fn start_on(
        backend: Backend,
        shared: Arc<SharedState>,
        clock: ManualClock,
    ) -> anyhow::Result<TestServer> {
        let mut config = Config {
            listen: "127.0.0.1:0".parse()?,
            data_dir: shared.data_dir.path().to_path_buf(),
            database_url: Some(shared.database.url.clone()),
            gateway: better_compute::gateway::GatewayConfig {
                listen: "127.0.0.1:0".parse()?,
                ..Default::default()
            },
            // Tests drive Liveness and drain deadlines with `tick()` and the ManualClock; a
            // background loop reading the same clock would race them.
            liveness: better_compute::config::LivenessConfig {
                enabled: false,
                ..Default::default()
            },
            auth: better_compute::config::AuthConfig {
                jwt_secret: Some(TEST_SECRET.to_owned()),
                ..Default::default()
            },
            ..Config::default()
        };
        (shared.configure)(&mut config);
        let server = app::start(&config, Arc::new(clock.clone())).await?;
        // The server checks tokens against its (manual) clock, which tests move days ahead.
        let admin_token = server.keys.mint(
            "test-admin",
            &[Role::Admin],
            None,
            ADMIN_TOKEN_TTL,
            bc_core::clock::Clock::now(&clock),
        )?;
        Ok(TestServer {
            backend,
            clock,
            server,
            shared,
            client: reqwest::Client::new(),
            admin_token,
        })
    }

    /// A second server ("replica") on this server's database: its own listeners (new ports),
    /// live event feed and gateway, the same CA, JWT secret and clock, as another process of
    /// the same deployment would be. Tokens of either work on both.
    /// Stop each with [`TestServer::stop`]; the database is dropped with the last of them.
    pub async fn replica(&self) -> anyhow::Result<TestServer> {
        TestServer::start_on(self.backend, self.shared.clone(), self.clock.clone()).await
    }

    /// Stops the server (as [`TestServer::stop`] does, but keeping its database) and starts
    /// it again on the same database, data directory and clock. It listens on new ports:
    /// read [`TestServer::url`] again. Replicas on the same database keep running.
    pub async fn restart(self) -> anyhow::Result<TestServer> {
        let TestServer {
            backend,
            clock,
            server,
            shared,
            ..
        } = self;
        server.shutdown().await?;
        TestServer::start_on(backend, shared, clock).await
    }

    /// The database URL this server (and any replica of it) uses.
    pub fn database_url(&self) -> &str {
        &self.shared.database.url
    }

    /// A connection of the test's own to the server's database, for fixtures no use case
    /// writes (a session row, say) and for reading tables as they are. The server reaches
    /// storage only through its services; a test may reach it here.
    pub async fn database(&self) -> sea_orm::DatabaseConnection {
        sea_orm::Database::connect(self.database_url())
            .await
            .expect("connecting to the test database")
    }

    /// One connection of the test's own, in a pool of one (so `pg_backend_pid` is stable):
    /// to hold a lock a racing writer would hold, or to watch who waits for one.
    pub async fn single_connection(&self) -> sea_orm::DatabaseConnection {
        let mut options = sea_orm::ConnectOptions::new(self.database_url().to_owned());
        options.max_connections(1).sqlx_logging(false);
        sea_orm::Database::connect(options)
            .await
            .expect("connecting to the test database")
    }

    /// Waits until exactly `count` backends of this server's PostgreSQL database wait for a
    /// lock and match `filter` (a condition on `pg_stat_activity`), asking through `watcher`
    /// (a [`TestServer::single_connection`]). Panics after [`LOCK_WAIT_SETTLE`].
    pub async fn wait_for_lock_waiters(
        &self,
        watcher: &sea_orm::DatabaseConnection,
        filter: &str,
        count: i64,
    ) {
        let deadline = tokio::time::Instant::now() + LOCK_WAIT_SETTLE;
        loop {
            let row = watcher
                .query_one_raw(sea_orm::Statement::from_string(
                    watcher.get_database_backend(),
                    format!(
                        "SELECT count(*) AS waiting FROM pg_stat_activity \
                         WHERE datname = current_database() AND wait_event_type = 'Lock' AND {filter}"
                    ),
                ))
                .await
                .expect("pg_stat_activity")
                .expect("a row");
            let waiting: i64 = row.try_get("", "waiting").expect("a count");
            if waiting == count {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{waiting} backends wait for a lock ({filter}), not {count}"
            );
            tokio::time::sleep(LOCK_WAIT_POLL).await;
        }
    }

    /// PostgreSQL's `deadlocks` counter for this server's database (`None` on SQLite). A
    /// backend adds the deadlocks it saw when it reports its statistics, at the latest when
    /// it exits: to count a run's, restart the servers on the database and wait until the
    /// run's [`TestServer::postgres_backends`] are gone.
    pub async fn postgres_deadlocks(&self) -> Option<i64> {
        if self.backend != Backend::Postgres {
            return None;
        }
        let db = self.single_connection().await;
        let row = db
            .query_one_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
            ))
            .await
            .expect("pg_stat_database")
            .expect("a row for the test database");
        let count: i64 = row.try_get("", "deadlocks").expect("deadlocks");
        db.close().await.expect("closing");
        Some(count)
    }

    /// The PostgreSQL backends on this server's database other than the asking one (none on
    /// SQLite).
    pub async fn postgres_backends(&self) -> Vec<i32> {
        if self.backend != Backend::Postgres {
            return Vec::new();
        }
        let db = self.single_connection().await;
        let rows = db
            .query_all_raw(sea_orm::Statement::from_string(
                db.get_database_backend(),
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
            ))
            .await
            .expect("pg_stat_activity");
        db.close().await.expect("closing");
        rows.iter()
            .map(|r| r.try_get::<i32>("", "pid").expect("pid"))
            .collect()
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    /// A platform token with `role`.
    pub fn token(&self, role: Role) -> String {
        self.mint(&format!("test-{role}"), role, None, Duration::hours(1))
    }

    /// A token of any shape, signed with the server's secret, issued now by the server's
    /// clock (which the server checks tokens against): it expires when the test has moved
    /// the clock past `ttl`.
    pub fn mint(
        &self,
        subject: &str,
        role: Role,
        tenant: Option<&TenantId>,
        ttl: Duration,
    ) -> String {
        self.server
            .keys
            .mint(
                subject,
                &[role],
                tenant,
                ttl,
                bc_core::clock::Clock::now(&self.clock),
            )
            .expect("minting a test token")
    }

    /// A token with exactly `claims` (any JSON object), signed with the server's secret:
    /// for tokens `mint` does not make, such as one with `nbf` or `iat` in the future.
    pub fn mint_claims(&self, claims: &Value) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            claims,
            &jsonwebtoken::EncodingKey::from_secret(TEST_SECRET.as_bytes()).expect("an HS256 key"),
        )
        .expect("signing test claims")
    }

    /// A token signed with the server's own secret but for another audience (`aud`): the
    /// server must refuse it although its signature is good.
    pub fn mint_for_audience(
        &self,
        subject: &str,
        role: Role,
        audience: &str,
        ttl: Duration,
    ) -> String {
        better_compute::auth::TokenKeys::new(TEST_SECRET.as_bytes(), audience)
            .and_then(|keys| {
                keys.mint(
                    subject,
                    &[role],
                    None,
                    ttl,
                    bc_core::clock::Clock::now(&self.clock),
                )
            })
            .expect("minting a test token")
    }

    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// POSTs one GraphQL operation with `token` (none: no Authorization header).
    pub async fn gql(&self, token: Option<&str>, query: &str, variables: Value) -> Gql {
        let mut request = self
            .client
            .post(format!("{}/graphql", self.url()))
            .json(&json!({
                "query": query,
                "variables": variables,
            }));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.expect("the test server answers");
        let status = response.status().as_u16();
        let body = response.json::<Value>().await.expect("a JSON body");
        Gql { status, body }
    }

    /// Runs an operation as the test admin and returns its `data`, panicking on errors.
    pub async fn admin(&self, query: &str, variables: Value) -> Value {
        self.gql(Some(&self.admin_token), query, variables)
            .await
            .data()
            .clone()
    }

    /// GETs a plain path such as `/healthz`.
    pub async fn get(&self, path: &str) -> (u16, String) {
        let response = self
            .client
            .get(format!("{}{path}", self.url()))
            .send()
            .await
            .expect("the test server answers");
        (
            response.status().as_u16(),
            response.text().await.unwrap_or_default(),
        )
    }

    /// A platform site and a `metal-host` pool on it, through the API. Returns their ids.
    pub async fn site_and_pool(&self, expected_gpus: i32) -> (String, String) {
        let site = self
            .admin(
                "mutation($name: String!) { createSite(input: {name: $name, kind: PLATFORM}) { site { id } } }",
                json!({ "name": format!("site-{}", uuid::Uuid::new_v4().simple()) }),
            )
            .await["createSite"]["site"]["id"]
            .as_str()
            .expect("site id")
            .to_owned();
        let pool = self
            .admin(
                "mutation($site: ID!, $gpus: Int) { createPool(input: {siteId: $site, name: \"gpu\", kind: METAL_HOST, expectedGpuCount: $gpus}) { pool { id } } }",
                json!({ "site": site, "gpus": expected_gpus }),
            )
            .await["createPool"]["pool"]["id"]
            .as_str()
            .expect("pool id")
            .to_owned();
        (site, pool)
    }

    /// A tenant created through the API; returns its id.
    pub async fn tenant(&self, name: &str) -> String {
        self.admin(
            "mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }",
            json!({ "name": name }),
        )
        .await["createTenant"]["tenant"]["id"]
            .as_str()
            .expect("tenant id")
            .to_owned()
    }

    /// Offers a platform pool to a tenant through the API (`offerPool`).
    pub async fn offer_pool(&self, pool: &str, tenant: &str) {
        self.admin(
            "mutation($pool: ID!, $tenant: ID!) { offerPool(input: {poolId: $pool, tenantId: $tenant}) { tenantId } }",
            json!({ "pool": pool, "tenant": tenant }),
        )
        .await;
    }

    /// Enrols a node through the API (`enrollNode`); it starts `enrolling`.
    pub async fn enroll(&self, site: &str, pool: &str, hostname: &str) -> Value {
        self.admin(
            "mutation($site: ID!, $pool: ID, $host: String!) { enrollNode(input: {siteId: $site, poolId: $pool, hostname: $host}) { node { id version provisionState } } }",
            json!({ "site": site, "pool": pool, "host": hostname }),
        )
        .await["enrollNode"]["node"]
        .clone()
    }

    /// Writes a node straight into storage, in any state: the fixture for tests that need
    /// states the API cannot reach quickly (or at all before joining exists).
    pub async fn insert_node(&self, node: &bc_core::node::NodeRecord) {
        self.insert_nodes(std::slice::from_ref(node)).await;
    }

    /// [`TestServer::insert_node`] for many nodes, in one transaction.
    pub async fn insert_nodes(&self, nodes: &[bc_core::node::NodeRecord]) {
        self.server
            .services
            .insert_nodes_for_tests(nodes)
            .await
            .unwrap_or_else(|err| panic!("inserting nodes: {}", err.message()));
    }

    /// Gives each node these devices as an inventory report would (see
    /// `Services::replace_devices_for_tests`).
    pub async fn replace_devices(&self, devices: &[(NodeId, Vec<bc_core::health::Device>)]) {
        self.server
            .services
            .replace_devices_for_tests(devices)
            .await
            .unwrap_or_else(|err| panic!("writing devices: {}", err.message()));
    }

    /// The gateway's base URL (`https://127.0.0.1:<port>`).
    pub fn gateway_url(&self) -> String {
        self.server
            .gateway_url()
            .expect("the test server runs a gateway")
    }

    /// The control plane CA certificate (PEM) daemons trust.
    pub fn ca_pem(&self) -> String {
        self.server.services.ca.cert_pem().to_owned()
    }

    /// A join token for `pool` (in `site`) admitting `max_uses` joins; returns its secret.
    pub async fn join_token(&self, site: &str, pool: Option<&str>, max_uses: i64) -> String {
        self.admin(
            "mutation($site: ID!, $pool: ID, $uses: Int) { createJoinToken(input: {siteId: $site, poolId: $pool, maxUses: $uses}) { secret } }",
            json!({ "site": site, "pool": pool, "uses": max_uses }),
        )
        .await["createJoinToken"]["secret"]
        .as_str()
        .expect("a join token secret")
        .to_owned()
    }

    /// Stops the server and drops its database, unless a replica still runs on it (then
    /// the last server to stop drops it).
    pub async fn stop(self) {
        self.server.shutdown().await.expect("a clean shutdown");
        if let Some(shared) = Arc::into_inner(self.shared) {
            shared
                .database
                .drop_database()
                .await
                .expect("dropping the test database");
        }
    }
}

/// Runs `test` against a fresh server on each selected backend, stopping each server
/// (and dropping its database) afterwards.
pub async fn each_backend<F>(test: F)
where
    F: AsyncFn(&TestServer),
{
    each_backend_with(|_| {}, test).await;
}

/// [`each_backend`] on servers with `configure` applied to their configuration (a small
/// database pool, say).
pub async fn each_backend_with<F>(
    configure: impl Fn(&mut Config) + Clone + Send + Sync + 'static,
    test: F,
) where
    F: AsyncFn(&TestServer),
{
    for backend in Backend::selected() {
        let server = TestServer::start_with(backend, configure.clone())
            .await
            .unwrap_or_else(|err| panic!("starting a {backend:?} test server: {err:#}"));
        test(&server).await;
        server.stop().await;
    }
}
