//! Starting and stopping a server: storage, migrations, schema, the API listener (within
//! its connection caps and timeouts, see `listener.rs`), the gateway, graceful shutdown.
//! `main` and the test harness both use this.

use bc_core::clock::Clock;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::auth::TokenKeys;
use crate::config::{Config, ConnectionCaps};
use crate::controllers::{self, ControllerLoop};
use crate::graphql::build_schema;
use crate::http::{AppState, Dashboard, ReservedConnection, router};
use crate::listener::{ConnectionGate, accept_loop, serve_http};
use crate::service::Services;

/// A server that is accepting requests.
pub struct RunningServer {
    pub local_addr: SocketAddr,
    pub keys: Arc<TokenKeys>,
    pub services: Services,
    /// The background controllers (`controllers::spawn`), while they run.
    controllers: std::sync::Mutex<Option<ControllerLoop>>,
    /// The daemon-facing TLS listener.
    pub gateway: Option<crate::gateway::Gateway>,
    /// The shared streams of live subscriptions.
    pub subscription_hubs: Arc<crate::subscription_hubs::SubscriptionHubs>,
    /// Stops the live event feed.
    feed_stop: tokio::sync::watch::Sender<bool>,
    feed: Arc<crate::feed::Feed>,
    /// Places pending reservations when capacity may have grown; ends with the feed.
    placement: JoinHandle<()>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl RunningServer {
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// The gateway's base URL (`https://127.0.0.1:<port>`), where daemons join and connect.
    pub fn gateway_url(&self) -> Option<String> {
        self.gateway
            .as_ref()
            .map(|g| format!("https://{}", g.local_addr))
    }

    /// Stops the background controller loop (after the pass under way) and waits for it.
    /// Afterwards only explicit `tick()` calls change nodes on time: what tests that drive a
    /// `ManualClock` need when the server was started with the loop on. Idempotent.
    pub async fn stop_controllers(&self) {
        let running = self
            .controllers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(running) = running {
            running.stop().await;
        }
    }

    /// Stops the controllers and accepting, lets requests in flight finish, then closes the
    /// database pool.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop_controllers().await;
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown().await;
        }
        // Ends every subscription stream, so open WebSockets close and the server can stop.
        let _ = self.feed_stop.send(true);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await??;
        self.feed.stopped().await;
        if let Err(err) = (&mut self.placement).await {
            tracing::warn!(error = %err, "the placement loop ended abnormally");
        }
        self.services.close().await;
        Ok(())
    }

    /// Waits until the server stops by itself (it only does on error).
    pub async fn wait(&mut self) -> anyhow::Result<()> {
        (&mut self.task).await??;
        Ok(())
    }
}

/// Connects to the database, runs pending migrations and starts listening.
pub async fn start(config: &Config, clock: Arc<dyn Clock>) -> anyhow::Result<RunningServer> {
    config.liveness.validate()?;
    config.auth.validate()?;
    config.api.validate()?;
    config.bare_metal.validate()?;
    config
        .gateway
        .validate(config.liveness.heartbeat_interval_secs)?;
    let open_files = crate::listener::open_file_limit();
    let caps = ConnectionCaps::derive(config, open_files)?;
    tracing::info!(
        open_files,
        api = caps.api,
        api_per_peer = caps.api_per_peer,
        api_admin_reserved = caps.api_admin_reserved,
        gateway = caps.gateway,
        gateway_per_peer = caps.gateway_per_peer,
        "connection caps"
    );
    let ca = Arc::new(crate::pki::Ca::load_or_create(
        &config.ca_dir(),
        clock.now(),
    )?);
    let credential_key =
        crate::credentials::CredentialKey::load_or_create(&config.credential_key_file())?;
    let services = Services::connect(&config.database_url(), &config.database, clock.clone(), ca)
        .await?
        .with_bare_metal(crate::service::bare_metal::BareMetal::new(
            credential_key,
            config.bare_metal.clone(),
        ));
    let keys = Arc::new(
        TokenKeys::new(&config.jwt_secret()?, &config.auth.audience)?
            .with_leeway(config.auth.leeway_secs),
    );
    let (feed_stop, feed_stopped) = tokio::sync::watch::channel(false);
    let feed = crate::feed::Feed::start(services.clone(), feed_stopped.clone()).await?;
    let gateway_feed = feed.clone();
    let placement = crate::controllers::placement::spawn_retry_loop(services.clone(), feed.clone());
    let schema = build_schema(Some((services.clone(), feed.clone())), &config.graphql);
    crate::telemetry::metrics_handle();

    let listener = TcpListener::bind(config.listen).await?;
    let local_addr = listener.local_addr()?;
    let dashboard = Dashboard::new(&config.dashboard_dir);
    if !dashboard.is_built().await {
        // Not an error: the API works without it, and the dashboard appears once built.
        tracing::info!(
            dir = %config.dashboard_dir.display(),
            "the dashboard is not built (no index.html); build it with scripts/build-web"
        );
    }
    let subscription_hubs = crate::subscription_hubs::SubscriptionHubs::new(
        schema.clone(),
        feed.clone(),
        config.graphql.max_query_bytes,
    );
    let app = router(AppState {
        shutdown: feed_stopped,
        hubs: subscription_hubs.clone(),
        schema,
        keys: keys.clone(),
        services: services.clone(),
        dashboard,
        graphql: crate::http::GraphqlExecutor::new(config.graphql.max_concurrent_requests),
        limits: Arc::new(config.api.clone()),
    });
    let (tx, rx) = oneshot::channel::<()>();
    let gate = ConnectionGate::new("api", caps.api, caps.api_per_peer, caps.api_admin_reserved);
    let header_timeout = config.api.header_timeout();
    let stop = async move {
        let _ = rx.await;
    };
    let task = tokio::spawn(async move {
        accept_loop(listener, gate, stop, move |socket, _peer, stop| {
            let app = app.clone();
            async move {
                let reserved = socket.admission().is_reserved();
                let service = hyper::service::service_fn(
                    move |mut request: axum::http::Request<hyper::body::Incoming>| {
                        if reserved {
                            request.extensions_mut().insert(ReservedConnection);
                        }
                        tower::ServiceExt::oneshot(app.clone(), request)
                    },
                );
                serve_http("api", socket, service, header_timeout, stop).await;
            }
        })
        .await;
        Ok(())
    });
    let controllers = config
        .liveness
        .enabled
        .then(|| controllers::spawn(services.clone(), config.liveness.clone(), feed.clone()));
    let gateway = crate::gateway::Gateway::start(
        &config.gateway,
        (caps.gateway, caps.gateway_per_peer),
        services.clone(),
        gateway_feed,
        config.liveness.heartbeat_interval(),
    )
    .await?;
    tracing::info!(%local_addr, database = %redact(&config.database_url()), "better-compute is listening");
    Ok(RunningServer {
        local_addr,
        keys,
        services,
        controllers: std::sync::Mutex::new(controllers),
        gateway: Some(gateway),
        subscription_hubs,
        feed_stop,
        feed,
        placement,
        shutdown: Some(tx),
        task,
    })
}

/// A database URL without its password, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let userinfo = &url[scheme_end + 3..at];
            let user = userinfo.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &url[..scheme_end + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            super::redact("postgres://bc:secret@db:5432/bc"),
            "postgres://bc:***@db:5432/bc"
        );
        assert_eq!(super::redact("sqlite://data/x.db"), "sqlite://data/x.db");
    }
}
