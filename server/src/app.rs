//! Starting and stopping a server: storage, migrations, schema, HTTP listener, graceful
//! shutdown. `main` and the test harness both use this.

use bc_core::clock::Clock;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::auth::TokenKeys;
use crate::config::Config;
use crate::graphql::build_schema;
use crate::http::{AppState, router};
use crate::service::Services;
use crate::store::Store;

/// A server that is accepting requests.
pub struct RunningServer {
    pub local_addr: SocketAddr,
    pub keys: Arc<TokenKeys>,
    pub services: Services,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

impl RunningServer {
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// Stops accepting, lets requests in flight finish, then closes the database pool.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        (&mut self.task).await??;
        self.services.store.clone().close().await;
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
    let store = Store::connect(&config.database_url(), &config.database).await?;
    store.migrate().await?;
    let keys = Arc::new(TokenKeys::new(
        &config.jwt_secret()?,
        &config.auth.audience,
    )?);
    let services = Services::new(store, clock);
    let schema = build_schema(Some(services.clone()), &config.graphql);
    crate::telemetry::metrics_handle();

    let listener = TcpListener::bind(config.listen).await?;
    let local_addr = listener.local_addr()?;
    let app = router(AppState {
        schema,
        keys: keys.clone(),
        services: services.clone(),
    });
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await
    });
    tracing::info!(%local_addr, database = %redact(&config.database_url()), "better-compute is listening");
    Ok(RunningServer {
        local_addr,
        keys,
        services,
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
