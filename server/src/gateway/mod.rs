//! The gateway: the TLS listener daemons talk to (`bcd/v1`, see PROTOCOL.md). It serves
//! JoinService (`/v1/join`), renewal (`/v1/renew`), the CA (`/v1/ca.pem`) and sessions
//! (`/v1/session`, a WebSocket), and always speaks TLS with optional client certificates:
//! joining needs none, everything else needs a node certificate.

mod heartbeats;
mod http;
mod session;
mod tls;

use hyper_util::rt::{TokioExecutor, TokioIo};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use crate::config::GatewayConfig;
use crate::service::Services;
pub use heartbeats::HeartbeatWriter;

/// How long a shutting-down gateway waits for its sessions to say goodbye and record their
/// end (commands requeued, the node `disconnected`).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What the gateway's handlers share.
#[derive(Clone)]
pub(crate) struct GatewayState {
    pub services: Services,
    pub gateway_id: Arc<str>,
    pub heartbeat_interval: Duration,
    pub heartbeats: HeartbeatWriter,
    pub shutdown: watch::Receiver<bool>,
    pub session_tasks: SessionTasks,
}

/// How many session tasks run, from the upgrade to the last write of their end. Shutdown
/// waits for them before the database pool closes: a session is unregistered before it
/// records its end, so an empty registry does not mean its writes are done.
#[derive(Clone, Default)]
pub(crate) struct SessionTasks(Arc<std::sync::atomic::AtomicUsize>);

/// One running session task; dropping it ends the count.
pub(crate) struct SessionTask(SessionTasks);

impl SessionTasks {
    pub fn enter(&self) -> SessionTask {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        SessionTask(self.clone())
    }

    fn running(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for SessionTask {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A running gateway.
pub struct Gateway {
    pub local_addr: SocketAddr,
    pub gateway_id: String,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// The heartbeat writer and the command router, which stop with `shutdown`.
    background: Vec<JoinHandle<()>>,
    session_tasks: SessionTasks,
    services: Services,
}

impl Gateway {
    /// Binds the listener and starts accepting.
    pub async fn start(
        config: &GatewayConfig,
        services: Services,
        feed: Arc<crate::feed::Feed>,
        heartbeat_interval: Duration,
    ) -> anyhow::Result<Gateway> {
        let gateway_id = config
            .gateway_id
            .clone()
            .unwrap_or_else(|| format!("gw-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let tls = tls::server_config(&services.ca, &config.hostnames, services.clock.now())?;
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let listener = TcpListener::bind(config.listen).await?;
        let local_addr = listener.local_addr()?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let (heartbeats, heartbeat_writer) =
            HeartbeatWriter::start(services.clone(), shutdown_rx.clone());
        let session_tasks = SessionTasks::default();
        let state = GatewayState {
            heartbeats,
            services: services.clone(),
            gateway_id: gateway_id.clone().into(),
            heartbeat_interval,
            shutdown: shutdown_rx.clone(),
            session_tasks: session_tasks.clone(),
        };
        let app = http::router(state);
        let router = tokio::spawn(route_command_events(
            services.clone(),
            feed,
            shutdown_rx.clone(),
        ));
        let task = tokio::spawn(accept_loop(listener, acceptor, app, shutdown_rx));
        tracing::info!(%local_addr, %gateway_id, "gateway is listening (TLS)");
        Ok(Gateway {
            local_addr,
            gateway_id,
            shutdown: shutdown_tx,
            task,
            background: vec![heartbeat_writer, router],
            session_tasks,
            services,
        })
    }

    /// Stops accepting, tells every session goodbye, and waits (briefly) for them to end and
    /// record their end, and for the last heartbeats to be written: after this the database
    /// pool may close without failing a write of the gateway's.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        self.services
            .sessions
            .kick_all(bc_core::protocol::close::SHUTDOWN);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while self.session_tasks.running() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.task.await;
        for task in self.background {
            let _ = task.await;
        }
    }
}

/// Commands queued or cancelled, and new spec generations, written through any replica reach the session that holds their node
/// through the live event feed: this routes each command event to the session held here.
async fn route_command_events(
    services: Services,
    feed: Arc<crate::feed::Feed>,
    mut shutdown: watch::Receiver<bool>,
) {
    use futures::StreamExt;
    loop {
        let events = feed.subscribe(services.clone(), feed.head());
        tokio::pin!(events);
        loop {
            let item = tokio::select! {
                item = events.next() => item,
                _ = shutdown.changed() => return,
            };
            match item {
                Some(Ok(event)) => {
                    let e = &event.event;
                    let wakes_session = (e.axis.as_deref() == Some("command")
                        && matches!(e.to.as_deref(), Some("queued" | "cancelled" | "timed_out")))
                        || e.axis.as_deref() == Some("generation");
                    if wakes_session
                        && let Some(node) = e
                            .node_id
                            .as_deref()
                            .and_then(|n| bc_core::ids::NodeId::parse(n).ok())
                    {
                        services.sessions.poke(&node);
                    }
                }
                // Fell behind (a burst of events): every session looks at its commands again,
                // and routing resumes from now.
                Some(Err(_)) => {
                    services.sessions.poke_all();
                    break;
                }
                None => return,
            }
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    app: axum::Router,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %err, "gateway accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => return,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let tls = match acceptor.accept(tcp).await {
                Ok(tls) => tls,
                Err(err) => {
                    metrics::counter!("bc_gateway_tls_handshake_failures_total").increment(1);
                    tracing::debug!(%peer, error = %err, "TLS handshake refused");
                    return;
                }
            };
            let identity = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|chain| chain.first())
                .and_then(crate::pki::node_identity);
            let app = app.layer(axum::Extension(http::PeerIdentity(identity)));
            let service = hyper_util::service::TowerToHyperService::new(app);
            if let Err(err) = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .await
            {
                tracing::debug!(%peer, error = %err, "gateway connection ended with an error");
            }
        });
    }
}
